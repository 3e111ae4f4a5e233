"""The simulated network's fixed parts: shards, accounts, message keys and diff hashes.

Everything here is a pure function of the seed, so two runs with one seed build the
same world and the same messages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from blake3 import blake3

from imq import (
    LOW_PRIORITY_PARTITION,
    Address,
    PartitionRouter,
    QueueDiff,
    QueueKey,
    ShardIdent,
)
from imq.state.tl import TlDiff, diff_hash, encode_diff

__all__ = [
    "ZERO_HASH",
    "World",
    "basechain_shards",
    "busiest_router",
    "derive_rng",
    "diff_hash_of",
    "message_key",
]

ZERO_HASH = bytes(32)
ACCOUNTS_PER_SHARD = 32
MC_ACCOUNTS = 8


def basechain_shards(n: int) -> list[ShardIdent]:
    """``n`` (a power of two, 1..256) basechain shards that split the workchain evenly."""
    if n < 1 or n > 256 or n & (n - 1):
        raise ValueError(f"the number of shards must be a power of two in 1..256, got {n}")
    depth = n.bit_length() - 1
    if depth == 0:
        return [ShardIdent.BASECHAIN]
    tag = 1 << (63 - depth)
    return [ShardIdent(0, (i << (64 - depth)) | tag) for i in range(n)]


def derive_rng(seed: int, *parts: object) -> random.Random:
    """A generator that depends only on the seed and ``parts`` (never on call order)."""
    text = ":".join([str(seed), *(str(p) for p in parts)])
    return random.Random(blake3(text.encode()).digest()[:16])


@dataclass(frozen=True)
class World:
    """Shards and their accounts; accounts are weighted so a few are hot."""

    seed: int
    shards: tuple[ShardIdent, ...]  # masterchain first, then the basechain shards

    @classmethod
    def build(cls, seed: int, n_shards: int) -> World:
        return cls(seed, (ShardIdent.MASTERCHAIN, *basechain_shards(n_shards)))

    @property
    def basechain(self) -> tuple[ShardIdent, ...]:
        return self.shards[1:]

    def accounts(self, shard: ShardIdent) -> tuple[Address, ...]:
        return _accounts(self.seed, shard)

    def all_accounts(self) -> tuple[Address, ...]:
        return tuple(a for s in self.shards for a in self.accounts(s))

    def shard_of(self, address: Address) -> ShardIdent:
        for shard in self.shards:
            if shard.contains(address):
                return shard
        raise ValueError(f"no shard of the network contains {address}")


_ACCOUNT_CACHE: dict[tuple[int, ShardIdent], tuple[Address, ...]] = {}


def _accounts(seed: int, shard: ShardIdent) -> tuple[Address, ...]:
    cached = _ACCOUNT_CACHE.get((seed, shard))
    if cached is not None:
        return cached
    rng = derive_rng(seed, "accounts", shard)
    count = MC_ACCOUNTS if shard.is_masterchain else ACCOUNTS_PER_SHARD
    depth = shard.prefix_len
    out: list[Address] = []
    while len(out) < count:
        raw = bytearray(rng.randbytes(32))
        top = int.from_bytes(raw[:8], "big")
        if depth:
            keep = ((1 << 64) - 1) >> depth
            top = (shard.prefix & ~keep & ((1 << 64) - 1)) | (top & keep)
        raw[:8] = top.to_bytes(8, "big")
        address = Address(shard.workchain, bytes(raw))
        if shard.contains(address) and address not in out:
            out.append(address)
    result = tuple(out)
    _ACCOUNT_CACHE[(seed, shard)] = result
    return result


def _router_tl(router: PartitionRouter) -> tuple[tuple[tuple[int, tuple[Address, ...]], ...], ...]:
    src = tuple((p, tuple(sorted(a))) for p, a in sorted(router.src_partitions().items()))
    dst = tuple((p, tuple(sorted(a))) for p, a in sorted(router.dst_partitions().items()))
    return src, dst


def diff_hash_of(
    diff: QueueDiff, shard: ShardIdent, seqno: int, bounds: tuple[QueueKey, QueueKey]
) -> bytes:
    """The real diff hash: BLAKE3 of the block's TL queue diff (``imq.state.tl``)."""
    src, dst = _router_tl(diff.router)
    tl = TlDiff(
        prev_hash=diff.prev_hash if diff.prev_hash is not None else ZERO_HASH,
        shard=shard,
        seqno=seqno,
        processed_to=tuple(sorted(diff.processed_to.items())),
        min_message=bounds[0],
        max_message=bounds[1],
        hashes=b"".join(sorted(m.key.hash for m in diff.messages)),
        router_src=src,
        router_dst=dst,
    )
    return diff_hash(encode_diff(tl))


def busiest_router(diff_dsts: dict[Address, int], threshold: int, top: int) -> PartitionRouter:
    """Move the ``top`` busiest destinations with at least ``threshold`` messages to the
    low-priority partition."""
    ranked = sorted(diff_dsts.items(), key=lambda kv: (-kv[1], kv[0]))
    hot = [a for a, n in ranked[:top] if n >= threshold]
    return PartitionRouter(dst={LOW_PRIORITY_PARTITION: hot} if hot else {})


def message_key(shard: ShardIdent, lt: int) -> QueueKey:
    return QueueKey(lt, blake3(f"{shard}:{lt}".encode()).digest())
