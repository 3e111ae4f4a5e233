"""Read helpers of the facade: argument checks, diff infos by zone, and the operator
summary. The questions themselves are the named reads of :mod:`imq.storage.ops`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from imq.storage import ops
from imq.types import (
    U32_MAX,
    BlockId,
    DiffInfo,
    DiffZone,
    QueueShardRange,
    ShardIdent,
)
from imq.zones import in_zone

__all__ = [
    "check_block",
    "check_masterchain_block",
    "check_ranges",
    "check_type",
    "diff_info",
    "summarize",
]


def check_type(name: str, value: object, expected: type) -> None:
    if not isinstance(value, expected):
        raise TypeError(f"{name} must be a {expected.__name__}, got {type(value).__name__}")


def check_masterchain_block(block: BlockId) -> None:
    if not block.is_masterchain:
        raise ValueError(
            f"last_applied_mc_block must be a masterchain block, got {block}; pass the "
            "node's last applied masterchain block"
        )


def check_block(shard: ShardIdent, seqno: int) -> None:
    if type(shard) is not ShardIdent:
        raise TypeError(f"shard must be a ShardIdent, got {type(shard).__name__}")
    if not isinstance(seqno, int) or isinstance(seqno, bool):
        raise TypeError(f"seqno must be an int, got {type(seqno).__name__}")
    if not 0 <= seqno <= U32_MAX:
        raise ValueError(f"seqno must be a u32, got {seqno}")


def check_ranges(ranges: Sequence[QueueShardRange]) -> None:
    """The ranges of an iterator: ``QueueShardRange`` values, one per source shard."""
    seen: set[ShardIdent] = set()
    for r in ranges:
        if type(r) is not QueueShardRange:
            raise TypeError(f"ranges must hold QueueShardRange values, got {type(r).__name__}")
        if r.shard in seen:
            raise ValueError(f"two ranges name the source shard {r.shard}")
        seen.add(r.shard)


def diff_info(
    view: ops.View, shard: ShardIdent, seqno: int, zone: DiffZone = DiffZone.BOTH
) -> DiffInfo | None:
    """The stored diff of (``shard``, ``seqno``) if it is in ``zone``."""
    info = view.diff_info(shard, seqno)
    if info is None:
        return None
    return info if in_zone(info, view.state.pointers.get(shard), zone) else None


def summarize(view: ops.View, diffs: ops.AllDiffs, path: object, read_only: bool) -> dict[str, Any]:
    """A JSON-friendly, lossless picture of the queue (see ``Queue.summary``): keys as
    ``{"lt": int, "hash": hex}`` (``QueueKey.to_json``), ids and shards in their ``str``
    forms, which ``BlockId.parse`` and ``ShardIdent.parse`` read."""
    state = view.state
    pointers = state.pointers
    shards: dict[ShardIdent, dict[str, Any]] = {}
    for shard, info, partitions in view[diffs]:
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
    last = state.last_mc_block
    requested, executed = state.gc_requested, state.gc_executed
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
