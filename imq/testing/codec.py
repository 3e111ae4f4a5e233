"""JSON forms of the queue's values for the op log (``docs/replay-format.md``).

Lossless: full 32-byte hashes and accounts as hex, every field of every value. Each
``enc_*`` has a ``dec_*`` that gives back an equal value.

The decoders are strict: a value not of the JSON type the format gives (a boolean or a
float where an integer belongs, a string where a boolean does, ``"01"`` as a partition)
raises ``TypeError`` or ``ValueError`` saying what was expected, instead of being coerced
into something the recorder never wrote.
"""

from __future__ import annotations

import re
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
from imq.types import check_partition

__all__ = [
    "FORMAT_VERSION",
    "OPEN_CHECKS",
    "dec_block",
    "dec_bool",
    "dec_diff",
    "dec_hash",
    "dec_int",
    "dec_key",
    "dec_message",
    "dec_partition",
    "dec_partitions",
    "dec_range",
    "dec_shard",
    "dec_statistics",
    "dec_top",
    "dec_zone",
    "json_kind",
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
# The config's checks that make calls fail: an "open" line names those the recorded queue
# ran ({"check_sources": true}), and the replay runs them too.
OPEN_CHECKS = ("check_sources", "check_statistics")

Json = Any

_HEX = re.compile(r"(?:[0-9a-fA-F]{2})*")
_PARTITION_KEY = re.compile(r"0|[1-9][0-9]{0,4}")  # as str(int) writes it: no sign, no 0 first


def json_kind(v: Json) -> str:
    """What a decoded JSON value is, in JSON's words (for an error message)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return f"the number {v!r}" if abs(v) != float("inf") else "a number too large"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _expect(v: Json, kind: type, what: str) -> Any:
    # bool is an int to Python and not to the format: true is not 1
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        name = {int: "an integer", bool: "a boolean", str: "a string", list: "an array"}
        raise TypeError(f"{what} must be {name.get(kind, 'an object')}, got {json_kind(v)}")
    return v


def dec_int(v: Json, what: str = "the value") -> int:
    """A JSON integer (not a boolean, not a float such as ``1.0`` or ``1e400``)."""
    value: int = _expect(v, int, what)
    return value


def dec_bool(v: Json, what: str = "the value") -> bool:
    """``true`` or ``false`` (not a string, not a number)."""
    value: bool = _expect(v, bool, what)
    return value


def _str(v: Json, what: str) -> str:
    value: str = _expect(v, str, what)
    return value


def _list(v: Json, what: str, length: int | None = None) -> list[Json]:
    value: list[Json] = _expect(v, list, what)
    if length is not None and len(value) != length:
        raise ValueError(f"{what} must be an array of {length}, got one of {len(value)}")
    return value


def _obj(v: Json, what: str) -> dict[str, Json]:
    value: dict[str, Json] = _expect(v, dict, what)
    return value


def dec_hash(v: Json, what: str = "the hash") -> bytes:
    """Hex digits, two per byte (``bytes.fromhex`` would also take spaces)."""
    text = _str(v, what)
    if not _HEX.fullmatch(text):
        raise ValueError(f"{what} must be hex digits, two per byte, got {text[:80]!r}")
    return bytes.fromhex(text)


def dec_partition(v: Json) -> int:
    """A partition number: a JSON integer (its range is the queue's to check: a host's
    call with a partition out of range is logged with the error it got)."""
    return dec_int(v, "a partition")


def dec_partitions(v: Json) -> list[int]:
    """A JSON array of partition numbers."""
    return [dec_partition(p) for p in _list(v, "the partitions")]


def _partition_key(text: str) -> int:
    # Partition numbers as JSON object keys: the decimal str(int) writes, nothing else
    if not _PARTITION_KEY.fullmatch(text):
        raise ValueError(f'a partition key must be a partition number such as "1", got {text!r}')
    return check_partition(int(text))


def enc_key(key: QueueKey) -> str:
    return f"{key.lt}:{key.hash.hex()}"


def dec_key(text: Json) -> QueueKey:
    return QueueKey.parse(_str(text, "a queue key"))


def dec_shard(text: Json) -> ShardIdent:
    return ShardIdent.parse(_str(text, "a shard"))


def enc_block(block: BlockIdShort) -> str:
    return f"{block.shard}:{block.seqno}"


def dec_block(text: Json) -> BlockIdShort:
    return BlockIdShort.parse(_str(text, "a block"))


def enc_message(m: Message) -> list[str]:
    return [enc_key(m.key), str(m.src), str(m.dst), m.body.hex()]


def dec_message(v: Json) -> Message:
    key, src, dst, body = _list(v, "a message", 4)
    return Message(
        dec_key(key),
        Address.parse(_str(src, "a message's src")),
        Address.parse(_str(dst, "a message's dst")),
        dec_hash(body, "a message's body"),
    )


def _enc_partitions(parts: Mapping[int, Iterable[Address]]) -> dict[str, list[str]]:
    return {str(p): sorted(str(a) for a in addrs) for p, addrs in sorted(parts.items())}


def _dec_partitions(v: Json, what: str) -> dict[int, list[Address]]:
    return {
        _partition_key(p): [Address.parse(_str(a, "an address")) for a in _list(addrs, what)]
        for p, addrs in _obj(v, what).items()
    }


def _opt(v: Json, decode: Any) -> Any:
    return None if v is None else decode(v)


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


def dec_diff(v: Json) -> QueueDiff:
    v = _obj(v, "a diff")
    router = PartitionRouter(
        _dec_partitions(v["router_src"], "router_src"),
        _dec_partitions(v["router_dst"], "router_dst"),
    )
    return QueueDiff(
        [dec_message(m) for m in _list(v["messages"], "a diff's messages")],
        {dec_shard(s): dec_key(k) for s, k in _obj(v["processed_to"], "processed_to").items()},
        router,
        prev_hash=_opt(v.get("prev_hash"), lambda h: dec_hash(h, "prev_hash")),
        start_lt=_opt(v.get("start_lt"), lambda n: dec_int(n, "start_lt")),
        end_lt=_opt(v.get("end_lt"), lambda n: dec_int(n, "end_lt")),
        min_key=_opt(v.get("min_key"), dec_key),
        max_key=_opt(v.get("max_key"), dec_key),
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


def dec_statistics(v: Json) -> DiffStatistics | None:
    if v is None:
        return None
    v = _obj(v, "the statistics")
    return DiffStatistics(
        dec_shard(v["shard"]),
        dec_key(v["min_message"]),
        dec_key(v["max_message"]),
        {
            _partition_key(p): {
                Address.parse(a): dec_int(n, "a message count")
                for a, n in _obj(counts, "a partition's counts").items()
            }
            for p, counts in _obj(v["partitions"], "the statistics' partitions").items()
        },
    )


def enc_zone(zone: DiffZone | None) -> str | None:
    return None if zone is None else zone.name


def dec_zone(v: Json) -> DiffZone | None:
    """A zone's name, or null."""
    if v is None:
        return None
    if not isinstance(v, str) or v not in DiffZone.__members__:
        raise ValueError(f"expected one of {', '.join(DiffZone.__members__)} or null")
    return DiffZone[v]


def enc_top(top: TopBlock) -> dict[str, Json]:
    return {
        "block": str(top.block_id),
        "ref_by_mc_seqno": top.ref_by_mc_seqno,
        "updated": top.updated,
    }


def dec_top(v: Json) -> TopBlock:
    v = _obj(v, "a top block")
    return TopBlock(
        BlockId.parse(_str(v["block"], "a top block's block")),
        dec_int(v["ref_by_mc_seqno"], "ref_by_mc_seqno"),
        dec_bool(v["updated"], "updated"),
    )


def enc_range(r: QueueShardRange) -> list[str]:
    return [str(r.shard), enc_key(r.from_key), enc_key(r.to_key)]


def dec_range(v: Json) -> QueueShardRange:
    shard, from_key, to_key = _list(v, "a range", 3)
    return QueueShardRange(dec_shard(shard), dec_key(from_key), dec_key(to_key))


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
