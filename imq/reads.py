"""Read helpers of the facade: diff infos by zone, scans for tail lengths and statistics,
and the queue state loaded at open."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from imq.storage import QueueState, Scan, Snapshot, Store, Table, codec
from imq.types import (
    U32_MAX,
    Address,
    CommitPointer,
    DiffInfo,
    DiffZone,
    QueueKey,
    QueueShardRange,
    ShardIdent,
)
from imq.zones import in_zone

__all__ = [
    "all_diffs_scan",
    "check_block",
    "check_type",
    "diff_info",
    "group_statistics",
    "load_state",
    "message_scans",
    "stats_scan",
    "sum_statistics",
    "summarize",
    "tail_len_scan",
]


def load_state(store: Store) -> None:
    """Load the queue state (D14) from the small tables, once at open."""
    pointers: dict[ShardIdent, CommitPointer] = dict(
        codec.decode_pointer(k, v) for k, v in store.load_table(Table.COMMIT_POINTERS)
    )
    raw_mc = store.get_latest(Table.VARS, codec.LAST_COMMITTED_MC_BLOCK)
    raw_record = store.get_latest(Table.VARS, codec.COMMIT_RECORD)
    raw_requested = store.get_latest(Table.VARS, codec.GC_REQUESTED)
    raw_executed = store.get_latest(Table.VARS, codec.GC_EXECUTED)
    store.set_state(
        QueueState(
            pointers=pointers,
            last_mc_block=None if raw_mc is None else codec.decode_block_id(raw_mc),
            commit_record={} if raw_record is None else codec.decode_commit_record(raw_record),
            gc_requested={}
            if raw_requested is None
            else codec.decode_gc_bounds(codec.GC_REQUESTED, raw_requested),
            gc_executed={}
            if raw_executed is None
            else codec.decode_gc_bounds(codec.GC_EXECUTED, raw_executed),
        )
    )


def check_type(name: str, value: object, expected: type) -> None:
    if not isinstance(value, expected):
        raise TypeError(f"{name} must be a {expected.__name__}, got {type(value).__name__}")


def check_block(shard: ShardIdent, seqno: int) -> None:
    if type(shard) is not ShardIdent:
        raise TypeError(f"shard must be a ShardIdent, got {type(shard).__name__}")
    if not isinstance(seqno, int) or isinstance(seqno, bool):
        raise TypeError(f"seqno must be an int, got {type(seqno).__name__}")
    if not 0 <= seqno <= U32_MAX:
        raise ValueError(f"seqno must be a u32, got {seqno}")


def diff_info(
    snap: Snapshot, shard: ShardIdent, seqno: int, zone: DiffZone = DiffZone.BOTH
) -> DiffInfo | None:
    key = codec.diff_info_key(shard, seqno)
    raw = snap.get(Table.DIFF_INFO, key)
    if raw is None:
        return None
    info = codec.decode_diff_info(key, raw)
    return info if in_zone(info, snap.state.pointers.get(shard), zone) else None


def message_scans(partition: int, ranges: Sequence[QueueShardRange]) -> list[Scan]:
    seen: set[ShardIdent] = set()
    scans = []
    for r in ranges:
        if type(r) is not QueueShardRange:
            raise TypeError(f"ranges must hold QueueShardRange values, got {type(r).__name__}")
        if r.shard in seen:
            raise ValueError(f"two ranges name the source shard {r.shard}")
        seen.add(r.shard)
        lo, hi = codec.message_range(partition, r.shard, r.from_key, r.to_key)
        scans.append(Scan(Table.MESSAGES, lo, max(lo, hi)))
    return scans


def tail_len_scan(shard: ShardIdent, from_key: QueueKey) -> Scan:
    lo, hi = codec.tail_range(shard, from_key)
    return Scan(Table.DIFF_TAIL, lo, hi, keys_only=True)


def stats_scan(partition: int, r: QueueShardRange) -> Scan:
    lo, hi = codec.stat_range(r.shard, partition, r.from_key, r.to_key)
    return Scan(Table.STATISTICS, lo, max(lo, hi))


def sum_statistics(rows: Iterable[tuple[bytes, bytes]]) -> dict[Address, int]:
    totals: dict[Address, int] = {}
    for key, value in rows:
        _max_message, entries = codec.decode_stat_row(key, value)
        for dst, count in entries:
            totals[dst] = totals.get(dst, 0) + count
    return totals


def group_statistics(
    rows: Iterable[tuple[bytes, bytes]],
) -> dict[QueueKey, dict[Address, int]]:
    grouped: dict[QueueKey, dict[Address, int]] = {}
    for key, value in rows:
        max_message, entries = codec.decode_stat_row(key, value)
        bucket = grouped.setdefault(max_message, {})
        for dst, count in entries:
            bucket[dst] = bucket.get(dst, 0) + count
    return grouped


def all_diffs_scan() -> Scan:
    return Scan(Table.DIFF_INFO, b"", None)


def summarize(snap: Snapshot, path: object, read_only: bool) -> dict[str, Any]:
    """A JSON-friendly, lossless picture of the queue (see ``Queue.summary``): keys as
    ``{"lt": int, "hash": hex}`` (``QueueKey.to_json``), ids and shards in their ``str``
    forms, which ``BlockId.parse`` and ``ShardIdent.parse`` read."""
    pointers = snap.state.pointers
    shards: dict[ShardIdent, dict[str, Any]] = {}
    for key, value in snap.cursors[0]:
        info, partitions = codec.decode_diff_record(key, value)
        shard = codec.decode_shard(key[: codec.SHARD_LEN])
        entry = shards.setdefault(
            shard,
            {"diffs": 0, "committed": 0, "uncommitted": 0, "seqnos": [None, None], "messages": {}},
        )
        entry["diffs"] += 1
        entry[
            "committed" if in_zone(info, pointers.get(shard), DiffZone.COMMITTED) else "uncommitted"
        ] += 1
        low, high = entry["seqnos"]
        entry["seqnos"] = [
            info.seqno if low is None else min(low, info.seqno),
            max(high or 0, info.seqno),
        ]
        for partition, count in partitions.items():
            entry["messages"][partition] = entry["messages"].get(partition, 0) + count
    last = snap.state.last_mc_block
    requested, executed = snap.state.gc_requested, snap.state.gc_executed
    return {
        "path": str(path),
        "read_only": read_only,
        "last_committed_mc_block": None if last is None else str(last),
        "commit_pointers": {
            str(s): {"key": p.key.to_json(), "seqno": p.seqno} for s, p in sorted(pointers.items())
        },
        "shards": {str(s): shards[s] for s in sorted(shards)},
        "gc": {
            f"{p}/{s}": {
                "requested": requested[(p, s)].to_json(),
                "executed": executed[(p, s)].to_json() if (p, s) in executed else None,
            }
            for p, s in sorted(requested)
        },
    }
