"""Synthetic persistent states: what the real files lack, made on purpose.

Tests and benchmarks build states here with router partitions, multi-cell and large
messages, masterchain destinations and many chunks. The builder is independent of the
store: it writes TL and BOCs directly, so an import of its output checks the reader
against a writer that shares no code path with the exporter except the chunk spool.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from imq.state.boc import CellBuilder, encode_boc
from imq.state.message import build_internal_message, build_state_init
from imq.state.tl import TlDiff, diff_hash, encode_diff
from imq.state.writer import MAX_CHUNK_BYTES, ChunkSpool, open_sink, write_state
from imq.types import Address, BlockId, Message, QueueKey, ShardIdent

__all__ = ["SynthDiff", "SynthState", "default_name", "synth_state", "write_synth_state"]

_LT_STEP = 1_000_000  # lt space of one block


@dataclass(frozen=True, slots=True)
class SynthDiff:
    seqno: int
    tl: TlDiff
    hash: bytes
    messages: tuple[Message, ...]  # in file order: ascending by hash


@dataclass(slots=True)
class SynthState:
    """A generated state: its diffs newest first, as the file lists them."""

    shard: ShardIdent
    diffs: list[SynthDiff] = field(default_factory=list)

    @property
    def seqno(self) -> int:
        return self.diffs[0].seqno

    @property
    def top_update(self) -> tuple[bytes, int]:
        return self.diffs[0].hash, len(self.diffs)

    @property
    def block_id(self) -> BlockId:
        return BlockId(self.shard, self.seqno)

    @property
    def messages(self) -> list[Message]:
        return [m for d in self.diffs for m in d.messages]


def _account(rng: random.Random, prefix: int, prefix_bits: int) -> bytes:
    """A random account whose first ``prefix_bits`` bits are those of ``prefix``."""
    raw = rng.getrandbits(256)
    if prefix_bits:
        raw = (prefix << (256 - prefix_bits)) | (raw & ((1 << (256 - prefix_bits)) - 1))
    return raw.to_bytes(32, "big")


def _destination(rng: random.Random, dst_shards: int, masterchain_every: int, i: int) -> Address:
    if masterchain_every and i % masterchain_every == 0:
        return Address(-1, _account(rng, 0, 0))
    bits = max(dst_shards - 1, 0).bit_length()
    return Address(0, _account(rng, rng.randrange(dst_shards), bits))


def synth_state(
    shard: ShardIdent = ShardIdent.BASECHAIN,
    *,
    top_seqno: int = 100,
    diffs: int = 3,
    messages_per_diff: int | Sequence[int] = 10,
    dst_shards: int = 4,
    body_bytes: int = 0,
    body_in_ref: bool = False,
    masterchain_every: int = 0,
    routed_every: int = 0,
    seed: int = 0,
    first_prev_hash: bytes = bytes(32),
    init_every: int = 0,
) -> SynthState:
    """Build a state in memory. ``routed_every=n`` sends every n-th destination to
    partition 1 and lists every (n+1)-th source in partition 2 of the src router;
    ``masterchain_every=n`` sends every n-th message to the masterchain;
    ``init_every=n`` gives every n-th message a ``StateInit`` (split depth, tick-tock,
    code and data), written inline and in a ref by turns."""
    rng = random.Random(seed)
    counts = (
        [messages_per_diff] * diffs
        if isinstance(messages_per_diff, int)
        else list(messages_per_diff)
    )
    if len(counts) != diffs:
        raise ValueError("messages_per_diff must give one count per diff")
    body = bytes(rng.getrandbits(8) for _ in range(body_bytes))
    state = SynthState(shard)
    prev_hash = first_prev_hash
    built: list[SynthDiff] = []
    for i, count in enumerate(counts):
        seqno = top_seqno - diffs + 1 + i
        diff = _synth_diff(
            rng,
            shard,
            seqno,
            count,
            prev_hash=prev_hash,
            dst_shards=dst_shards,
            body=body,
            body_in_ref=body_in_ref,
            masterchain_every=masterchain_every,
            routed_every=routed_every,
            init_every=init_every,
        )
        prev_hash = diff.hash
        built.append(diff)
    state.diffs = built[::-1]
    return state


def _synth_diff(
    rng: random.Random,
    shard: ShardIdent,
    seqno: int,
    count: int,
    *,
    prev_hash: bytes,
    dst_shards: int,
    body: bytes,
    body_in_ref: bool,
    masterchain_every: int,
    routed_every: int,
    init_every: int = 0,
) -> SynthDiff:
    start_lt = (seqno + 1) * _LT_STEP
    src_prefix = shard.prefix >> (64 - shard.prefix_len) if shard.prefix_len else 0
    messages = []
    routed_dst: set[Address] = set()
    routed_src: set[Address] = set()
    for j in range(count):
        src = Address(shard.workchain, _account(rng, src_prefix, shard.prefix_len))
        dst = _destination(rng, dst_shards, masterchain_every, j + 1)
        lt = start_lt + 1 + j // 3  # several messages share an lt, as in the real data
        init = None
        if init_every and (j + 1) % init_every == 0:
            code_cell = CellBuilder().store_uint(j, 32).end()
            data_cell = CellBuilder().store_bytes(src.account).end()
            init = build_state_init(split_depth=j % 31, special=j % 4, refs=[code_cell, data_cell])
        cell = build_internal_message(
            src,
            dst,
            lt,
            body=body,
            body_in_ref=body_in_ref or None,
            init=init,
            init_in_ref=(j // init_every) % 2 == 1 if init_every else False,
        )
        messages.append(Message(QueueKey(lt, cell.hash), src, dst, encode_boc([cell])))
        if routed_every and (j + 1) % routed_every == 0:
            routed_dst.add(dst)
        if routed_every and (j + 1) % (routed_every + 1) == 0:
            routed_src.add(src)
    messages.sort(key=lambda m: m.key.hash)
    keys = sorted(m.key for m in messages)
    end_lt = start_lt + _LT_STEP - 1
    tl = TlDiff(
        prev_hash=prev_hash,
        shard=shard,
        seqno=seqno,
        processed_to=(
            (ShardIdent.MASTERCHAIN, QueueKey.max_for_lt(start_lt - 5)),
            (ShardIdent.BASECHAIN, QueueKey.max_for_lt(start_lt - 3)),
        ),
        min_message=keys[0] if keys else QueueKey.min_for_lt(start_lt),
        max_message=keys[-1] if keys else QueueKey.max_for_lt(end_lt),
        hashes=b"".join(m.key.hash for m in messages),
        router_src=((2, tuple(sorted(routed_src))),) if routed_src else (),
        router_dst=((1, tuple(sorted(routed_dst))),) if routed_dst else (),
    )
    data = encode_diff(tl)
    return SynthDiff(seqno, tl, diff_hash(data), tuple(messages))


def write_synth_state(
    state: SynthState,
    dest: str | os.PathLike[str] | BinaryIO,
    *,
    max_chunk_roots: int = 10_000,
    max_chunk_bytes: int = MAX_CHUNK_BYTES,
) -> int:
    """Write ``state`` (zstd when ``dest`` ends in ``.queue``); return the chunk count."""
    spool = ChunkSpool(max_roots=max_chunk_roots, max_bytes=max_chunk_bytes)
    try:
        for diff in state.diffs:
            for message in diff.messages:
                spool.add(message.body)
        with open_sink(dest) as (_, out):
            write_state(
                out, state.shard, state.seqno, [encode_diff(d.tl) for d in state.diffs], spool
            )
        return spool.chunks
    finally:
        spool.close()


def default_name(state: SynthState, suffix: str = ".queue") -> Path:
    """The node's file name for the state: ``wc_shard_seqno_root_file`` + suffix."""
    shard = state.shard
    return Path(
        f"{shard.workchain}_{shard.prefix:016x}_{state.seqno}_{'0' * 64}_{'0' * 64}{suffix}"
    )
