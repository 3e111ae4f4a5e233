"""A block's queue diff and its per-destination statistics."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from operator import itemgetter

from imq.router import PartitionRouter
from imq.types import Address, Message, QueueKey, ShardIdent, check_partition

__all__ = ["DiffStatistics", "QueueDiff"]

_by_key = itemgetter(0)
_dst_of = itemgetter(2)


def _check_processed_to(processed_to: Mapping[ShardIdent, QueueKey]) -> dict[ShardIdent, QueueKey]:
    checked: dict[ShardIdent, QueueKey] = {}
    for shard in sorted(processed_to):
        key = processed_to[shard]
        if type(shard) is not ShardIdent or type(key) is not QueueKey:
            raise TypeError("processed_to must map ShardIdent to QueueKey")
        checked[shard] = key
    return checked


@dataclass(frozen=True, slots=True, eq=False)
class QueueDiff:
    """The outgoing internal messages of one block, with its read positions and router.

    ``messages`` is a tuple sorted by key; two messages with one key raise ``ValueError``.
    The diff keeps its own copy of ``router``.
    """

    messages: tuple[Message, ...]
    processed_to: dict[ShardIdent, QueueKey]
    router: PartitionRouter
    prev_hash: bytes | None = field(default=None)

    def __init__(
        self,
        messages: Iterable[Message] = (),
        processed_to: Mapping[ShardIdent, QueueKey] | None = None,
        router: PartitionRouter | None = None,
        prev_hash: bytes | None = None,
    ) -> None:
        msgs = list(messages)
        for m in msgs:
            if type(m) is not Message:
                raise TypeError(f"QueueDiff.messages must hold Message values, got {type(m)}")
        msgs.sort(key=_by_key)
        for before, after in pairwise(msgs):
            if before[0] == after[0]:
                raise ValueError(f"two messages share the key {after[0]!r}")
        if router is not None and not isinstance(router, PartitionRouter):
            raise TypeError("QueueDiff.router must be a PartitionRouter")
        if prev_hash is not None:
            if not isinstance(prev_hash, bytes):
                raise TypeError(
                    f"QueueDiff.prev_hash must be bytes, got {type(prev_hash).__name__}"
                )
            if len(prev_hash) != 32:
                raise ValueError("QueueDiff.prev_hash must be 32 bytes")
        object.__setattr__(self, "messages", tuple(msgs))
        object.__setattr__(self, "processed_to", _check_processed_to(processed_to or {}))
        object.__setattr__(self, "router", router.copy() if router else PartitionRouter())
        object.__setattr__(self, "prev_hash", prev_hash)

    @property
    def min_message(self) -> QueueKey | None:
        return self.messages[0].key if self.messages else None

    @property
    def max_message(self) -> QueueKey | None:
        return self.messages[-1].key if self.messages else None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QueueDiff):
            return NotImplemented
        return (
            self.messages == other.messages
            and self.processed_to == other.processed_to
            and self.router == other.router
            and self.prev_hash == other.prev_hash
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"QueueDiff({len(self.messages)} messages, min={self.min_message}, "
            f"max={self.max_message}, processed_to={len(self.processed_to)} shards)"
        )


@dataclass(frozen=True, slots=True, eq=False)
class DiffStatistics:
    """How many messages of one diff go to each destination account, per partition.

    ``min_message`` / ``max_message`` are supplied by the caller and not recomputed:
    for an empty diff the collator passes the block's lt range.
    """

    shard: ShardIdent
    min_message: QueueKey
    max_message: QueueKey
    partitions: dict[int, dict[Address, int]]

    def __init__(
        self,
        shard: ShardIdent,
        min_message: QueueKey,
        max_message: QueueKey,
        partitions: Mapping[int, Mapping[Address, int]],
    ) -> None:
        if type(shard) is not ShardIdent:
            raise TypeError("DiffStatistics.shard must be a ShardIdent")
        if type(min_message) is not QueueKey or type(max_message) is not QueueKey:
            raise TypeError("DiffStatistics bounds must be QueueKey values")
        if max_message < min_message:
            raise ValueError(f"max_message {max_message} is below min_message {min_message}")
        checked: dict[int, dict[Address, int]] = {}
        for partition in sorted(partitions):
            check_partition(partition)
            counts: dict[Address, int] = {}
            for address, count in partitions[partition].items():
                if type(address) is not Address:
                    raise TypeError("statistics must be keyed by Address values")
                if not isinstance(count, int) or isinstance(count, bool):
                    raise TypeError(f"statistics count for {address} must be an int")
                if count <= 0:
                    raise ValueError(f"statistics count for {address} must be positive")
                counts[address] = count
            if counts:
                checked[partition] = counts
        object.__setattr__(self, "shard", shard)
        object.__setattr__(self, "min_message", min_message)
        object.__setattr__(self, "max_message", max_message)
        object.__setattr__(self, "partitions", checked)

    @classmethod
    def from_diff(
        cls, diff: QueueDiff, shard: ShardIdent, min_message: QueueKey, max_message: QueueKey
    ) -> DiffStatistics:
        """Count ``diff``'s messages per partition (by its router) and destination."""
        # Validate the bounds only: the counted addresses come from validated Messages.
        cls(shard, min_message, max_message, {})
        partition_for = diff.router.partition_for
        counts: dict[int, dict[Address, int]] = {}
        if diff.router.is_empty:
            if diff.messages:
                counts[0] = dict(Counter(map(_dst_of, diff.messages)))
        else:
            for _key, src, dst, _body in diff.messages:
                bucket = counts.setdefault(partition_for(src, dst), {})
                bucket[dst] = bucket.get(dst, 0) + 1
        stats = object.__new__(cls)
        object.__setattr__(stats, "shard", shard)
        object.__setattr__(stats, "min_message", min_message)
        object.__setattr__(stats, "max_message", max_message)
        object.__setattr__(stats, "partitions", {p: counts[p] for p in sorted(counts)})
        return stats

    @property
    def shards_messages_count(self) -> dict[ShardIdent, int]:
        """Messages per destination shard, by the coarse rule: the destination workchain's
        full shard (SEMANTICS §1.9)."""
        per_wc: dict[int, int] = {}
        for counts in self.partitions.values():
            for (workchain, _account), count in counts.items():
                per_wc[workchain] = per_wc.get(workchain, 0) + count
        return {ShardIdent.full(wc): per_wc[wc] for wc in sorted(per_wc)}

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.partitions.values())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DiffStatistics):
            return NotImplemented
        return (
            self.shard == other.shard
            and self.min_message == other.min_message
            and self.max_message == other.max_message
            and self.partitions == other.partitions
        )

    __hash__ = None  # type: ignore[assignment]
