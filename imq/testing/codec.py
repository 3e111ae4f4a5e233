"""JSON forms of the queue's values for the op log (``docs/replay-format.md``).

Lossless: full 32-byte hashes and accounts as hex, every field of every value. Each
``enc_*`` has a ``dec_*`` that gives back an equal value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from imq import (
    Address,
    BlockId,
    BlockIdShort,
    CommitPointer,
    DiffInfo,
    DiffStatistics,
    DiffZone,
    IteratedMessage,
    Message,
    PartitionRouter,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    TopBlock,
)

__all__ = [
    "FORMAT_VERSION",
    "dec_block",
    "dec_diff",
    "dec_key",
    "dec_message",
    "dec_range",
    "dec_shard",
    "dec_statistics",
    "dec_top",
    "dec_zone",
    "enc_block",
    "enc_diff",
    "enc_diff_info",
    "enc_iterated",
    "enc_key",
    "enc_message",
    "enc_pointers",
    "enc_range",
    "enc_stats_map",
    "enc_statistics",
    "enc_top",
    "enc_zone",
]

FORMAT_VERSION = 1

Json = Any


def enc_key(key: QueueKey) -> str:
    return f"{key.lt}:{key.hash.hex()}"


def dec_key(text: str) -> QueueKey:
    lt, _, digest = text.partition(":")
    return QueueKey(int(lt), bytes.fromhex(digest))


def dec_shard(text: str) -> ShardIdent:
    return ShardIdent.parse(text)


def enc_block(block: BlockIdShort) -> str:
    return f"{block.shard}:{block.seqno}"


def dec_block(text: str) -> BlockIdShort:
    wc, prefix, seqno = text.split(":")
    return BlockIdShort(ShardIdent.parse(f"{wc}:{prefix}"), int(seqno))


def enc_message(m: Message) -> list[str]:
    return [enc_key(m.key), str(m.src), str(m.dst), m.body.hex()]


def dec_message(v: list[str]) -> Message:
    return Message(dec_key(v[0]), Address.parse(v[1]), Address.parse(v[2]), bytes.fromhex(v[3]))


def _enc_partitions(parts: Mapping[int, Iterable[Address]]) -> dict[str, list[str]]:
    return {str(p): sorted(str(a) for a in addrs) for p, addrs in sorted(parts.items())}


def _dec_partitions(v: Mapping[str, list[str]]) -> dict[int, list[Address]]:
    return {int(p): [Address.parse(a) for a in addrs] for p, addrs in v.items()}


def enc_diff(diff: QueueDiff) -> dict[str, Json]:
    out: dict[str, Json] = {
        "messages": [enc_message(m) for m in diff.messages],
        "processed_to": {str(s): enc_key(k) for s, k in sorted(diff.processed_to.items())},
        "router_src": _enc_partitions(diff.router.src_partitions()),
        "router_dst": _enc_partitions(diff.router.dst_partitions()),
        "prev_hash": None if diff.prev_hash is None else diff.prev_hash.hex(),
        "start_lt": diff.start_lt,
        "end_lt": diff.end_lt,
        "min_key": None if diff.min_key is None else enc_key(diff.min_key),
        "max_key": None if diff.max_key is None else enc_key(diff.max_key),
    }
    return out


def dec_diff(v: Mapping[str, Json]) -> QueueDiff:
    router = PartitionRouter(_dec_partitions(v["router_src"]), _dec_partitions(v["router_dst"]))
    prev = v.get("prev_hash")
    min_key, max_key = v.get("min_key"), v.get("max_key")
    return QueueDiff(
        [dec_message(m) for m in v["messages"]],
        {dec_shard(s): dec_key(k) for s, k in v["processed_to"].items()},
        router,
        prev_hash=None if prev is None else bytes.fromhex(prev),
        start_lt=v.get("start_lt"),
        end_lt=v.get("end_lt"),
        min_key=None if min_key is None else dec_key(min_key),
        max_key=None if max_key is None else dec_key(max_key),
    )


def enc_statistics(stats: DiffStatistics | None) -> dict[str, Json] | None:
    if stats is None:
        return None
    return {
        "shard": str(stats.shard),
        "min_message": enc_key(stats.min_message),
        "max_message": enc_key(stats.max_message),
        "partitions": {
            str(p): {str(a): n for a, n in sorted(counts.items())}
            for p, counts in sorted(stats.partitions.items())
        },
    }


def dec_statistics(v: Mapping[str, Json] | None) -> DiffStatistics | None:
    if v is None:
        return None
    return DiffStatistics(
        dec_shard(v["shard"]),
        dec_key(v["min_message"]),
        dec_key(v["max_message"]),
        {
            int(p): {Address.parse(a): int(n) for a, n in counts.items()}
            for p, counts in v["partitions"].items()
        },
    )


def enc_zone(zone: DiffZone | None) -> str | None:
    return None if zone is None else zone.name


def dec_zone(v: str | None) -> DiffZone | None:
    return None if v is None else DiffZone[v]


def enc_top(top: TopBlock) -> dict[str, Json]:
    return {
        "block": str(top.block_id),
        "ref_by_mc_seqno": top.ref_by_mc_seqno,
        "updated": top.updated,
    }


def dec_top(v: Mapping[str, Json]) -> TopBlock:
    return TopBlock(BlockId.parse(v["block"]), int(v["ref_by_mc_seqno"]), bool(v["updated"]))


def enc_range(r: QueueShardRange) -> list[str]:
    return [str(r.shard), enc_key(r.from_key), enc_key(r.to_key)]


def dec_range(v: list[str]) -> QueueShardRange:
    return QueueShardRange(dec_shard(v[0]), dec_key(v[1]), dec_key(v[2]))


def enc_iterated(item: IteratedMessage) -> list[Json]:
    return [str(item.source), enc_message(item.message)]


def enc_pointers(pointers: Mapping[ShardIdent, CommitPointer]) -> dict[str, Json]:
    return {str(s): [enc_key(p.key), p.seqno] for s, p in sorted(pointers.items())}


def enc_diff_info(info: DiffInfo | None) -> dict[str, Json] | None:
    if info is None:
        return None
    return {
        "min_message": enc_key(info.min_message),
        "max_message": enc_key(info.max_message),
        "shards_messages_count": {str(s): n for s, n in sorted(info.shards_messages_count.items())},
        "hash": info.hash.hex(),
        "processed_to": {str(s): enc_key(k) for s, k in sorted(info.processed_to.items())},
        "router_src": _enc_partitions(info.router_src),
        "router_dst": _enc_partitions(info.router_dst),
        "seqno": info.seqno,
        "prev_hash": None if info.prev_hash is None else info.prev_hash.hex(),
    }


def enc_stats_map(stats: Mapping[Address, int]) -> dict[str, int]:
    return {str(a): n for a, n in sorted(stats.items())}
