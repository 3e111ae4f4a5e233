"""A block's queue diff and its per-destination statistics."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import islice, pairwise
from operator import itemgetter
from operator import lt as _lt
from types import MappingProxyType
from typing import Any

from imq import _native as native
from imq.router import PartitionRouter
from imq.types import (
    U64_MAX,
    Address,
    Message,
    QueueKey,
    ShardIdent,
    check_mapping,
    check_partition,
    listed,
)

__all__ = ["DiffStatistics", "QueueDiff"]

_by_key = itemgetter(0)
_dst_of = itemgetter(2)
_c_strictly_ascending: Any = None if native.speedups is None else native.speedups.strictly_ascending


def _strictly_ascending(msgs: list[Message]) -> bool:
    """True when every item is a ``Message`` and the keys rise strictly: the input is
    sorted and has no duplicate key, so neither a sort nor a duplicate check is needed
    (a collator's messages arrive in key order). One C pass when ``imq._speedups`` is
    built; otherwise three C-level passes of builtins."""
    if _c_strictly_ascending is not None:
        return bool(_c_strictly_ascending(msgs, Message))
    if set(map(type, msgs)) - {Message}:
        return False
    keys = list(map(_by_key, msgs))
    return all(map(_lt, keys, islice(keys, 1, None)))


# The router of a diff built without one: read-only, so one object serves every diff.
_EMPTY_ROUTER = PartitionRouter().read_only_copy()

# QueueDiff's default processed_to: none. Read-only, so one object serves every call.
_NOT_PROCESSED: Mapping[ShardIdent, QueueKey] = MappingProxyType({})


def _check_processed_to(processed_to: Mapping[ShardIdent, QueueKey]) -> dict[ShardIdent, QueueKey]:
    check_mapping("QueueDiff.processed_to", processed_to)
    checked: dict[ShardIdent, QueueKey] = {}
    for shard in sorted(processed_to):
        key = processed_to[shard]
        if type(shard) is not ShardIdent or type(key) is not QueueKey:
            raise TypeError("processed_to must map ShardIdent to QueueKey")
        checked[shard] = key
    return checked


def _check_span(
    start_lt: int | None, end_lt: int | None, first: QueueKey | None, last: QueueKey | None
) -> None:
    if start_lt is None and end_lt is None:
        return
    if start_lt is None or end_lt is None:
        raise ValueError(
            "QueueDiff: give both start_lt and end_lt (the block's lt span), or neither"
        )
    for name, lt in (("start_lt", start_lt), ("end_lt", end_lt)):
        if not isinstance(lt, int) or isinstance(lt, bool):
            raise TypeError(f"QueueDiff.{name} must be an int, got {type(lt).__name__}")
        if not 0 <= lt <= U64_MAX:
            raise ValueError(f"QueueDiff.{name} must be a u64, got {lt}")
    if end_lt < start_lt:
        raise ValueError(f"QueueDiff: end_lt {end_lt} is below start_lt {start_lt}")
    if first is not None and last is not None and not start_lt <= first.lt <= last.lt <= end_lt:
        raise ValueError(
            f"QueueDiff: message lts {first.lt}..{last.lt} are outside the block's lt span "
            f"{start_lt}..{end_lt}; pass the span of the block that created the messages"
        )


def _check_keys(
    min_key: QueueKey | None,
    max_key: QueueKey | None,
    first: QueueKey | None,
    last: QueueKey | None,
) -> None:
    if min_key is None and max_key is None:
        return
    if min_key is None or max_key is None:
        raise ValueError("QueueDiff: give both min_key and max_key, or neither")
    if type(min_key) is not QueueKey or type(max_key) is not QueueKey:
        raise TypeError("QueueDiff.min_key and max_key must be QueueKey values")
    if max_key < min_key:
        raise ValueError(f"QueueDiff: max_key {max_key!r} is below min_key {min_key!r}")
    if first is not None and last is not None and not min_key <= first <= last <= max_key:
        raise ValueError(
            f"QueueDiff: message keys {first!r}..{last!r} are outside min_key..max_key "
            f"({min_key!r}..{max_key!r})"
        )


@dataclass(frozen=True, slots=True, eq=False)
class QueueDiff:
    """The outgoing internal messages of one block, with its read positions and router.

    ``messages`` is a tuple sorted by key; two messages with one key raise ``ValueError``.
    The diff keeps its own copy of ``router``.

    A diff may carry the key range it covers, which becomes its stored ``min_message``
    and ``max_message`` when the caller passes no :class:`DiffStatistics` (see
    :attr:`bounds`):

    - ``start_lt`` / ``end_lt``: the block's logical-time span (both or neither,
      ``start_lt <= end_lt``); every message key must lie in
      ``[QueueKey.min_for_lt(start_lt), QueueKey.max_for_lt(end_lt)]``;
    - ``min_key`` / ``max_key``: explicit bounds, as a serialized diff carries them (both
      or neither, ``min_key <= max_key``); every message key must lie between them.
    """

    messages: tuple[Message, ...]
    processed_to: dict[ShardIdent, QueueKey]
    router: PartitionRouter
    prev_hash: bytes | None = field(default=None)
    start_lt: int | None = field(default=None)
    end_lt: int | None = field(default=None)
    min_key: QueueKey | None = field(default=None)
    max_key: QueueKey | None = field(default=None)

    def __init__(
        self,
        messages: Iterable[Message] = (),
        processed_to: Mapping[ShardIdent, QueueKey] | None = _NOT_PROCESSED,
        router: PartitionRouter | None = None,
        prev_hash: bytes | None = None,
        *,
        start_lt: int | None = None,
        end_lt: int | None = None,
        min_key: QueueKey | None = None,
        max_key: QueueKey | None = None,
    ) -> None:
        msgs = listed("QueueDiff.messages", messages, Message)
        if not _strictly_ascending(msgs):
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
        first = msgs[0][0] if msgs else None
        last = msgs[-1][0] if msgs else None
        _check_span(start_lt, end_lt, first, last)
        _check_keys(min_key, max_key, first, last)
        object.__setattr__(self, "messages", tuple(msgs))
        # ``None`` alone means none: a falsy non-mapping ([], 0, "") is refused too.
        processed = {} if processed_to is None else processed_to
        object.__setattr__(self, "processed_to", _check_processed_to(processed))
        fixed = _EMPTY_ROUTER if router is None else router.read_only_copy()
        object.__setattr__(self, "router", fixed)
        object.__setattr__(self, "prev_hash", prev_hash)
        object.__setattr__(self, "start_lt", start_lt)
        object.__setattr__(self, "end_lt", end_lt)
        object.__setattr__(self, "min_key", min_key)
        object.__setattr__(self, "max_key", max_key)

    @property
    def min_message(self) -> QueueKey | None:
        """The smallest message key (``None`` when empty)."""
        return self.messages[0].key if self.messages else None

    @property
    def max_message(self) -> QueueKey | None:
        """The largest message key (``None`` when empty)."""
        return self.messages[-1].key if self.messages else None

    @property
    def bounds(self) -> tuple[QueueKey, QueueKey] | None:
        """The ``(min_message, max_message)`` stored for this diff when no statistics are
        passed: ``min_key``/``max_key`` if given; else the first and last message keys;
        else, for an empty diff, ``(min_for_lt(start_lt), max_for_lt(end_lt))``; else
        ``None``, and ``Queue.prepare_diff`` derives them from the store: an empty diff
        without a span rests at ``MIN`` while its shard's newest position (pointer or
        newest stored diff below it) is ``MIN`` or absent, else just above that
        position, so committing it never moves a pointer backwards."""
        if self.min_key is not None and self.max_key is not None:
            return self.min_key, self.max_key
        if self.messages:
            return self.messages[0].key, self.messages[-1].key
        if self.start_lt is not None and self.end_lt is not None:
            return QueueKey.min_for_lt(self.start_lt), QueueKey.max_for_lt(self.end_lt)
        return None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QueueDiff):
            return NotImplemented
        return (
            self.messages == other.messages
            and self.processed_to == other.processed_to
            and self.router == other.router
            and self.prev_hash == other.prev_hash
            and self.start_lt == other.start_lt
            and self.end_lt == other.end_lt
            and self.min_key == other.min_key
            and self.max_key == other.max_key
        )

    def __hash__(self) -> int:
        # Over the fields that cannot change: the router (the one mutable value type) and
        # the ``processed_to`` dict the diff hands out are left out, so mutating either
        # never moves a diff in a set. Equal diffs hash equal.
        span = (self.start_lt, self.end_lt, self.min_key, self.max_key)
        return hash((self.messages, self.prev_hash, span))

    def __repr__(self) -> str:
        extra = ""
        if self.start_lt is not None:
            extra += f", lt={self.start_lt}..{self.end_lt}"
        if self.min_key is not None:
            extra += f", keys={self.min_key}..{self.max_key}"
        return (
            f"QueueDiff({len(self.messages)} messages, min={self.min_message}, "
            f"max={self.max_message}, processed_to={len(self.processed_to)} shards{extra})"
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
        check_mapping("DiffStatistics.partitions", partitions)
        checked: dict[int, dict[Address, int]] = {}
        for partition in sorted(partitions):
            check_partition(partition)
            check_mapping(f"statistics of partition {partition}", partitions[partition])
            counts: dict[Address, int] = {}
            for address, count in partitions[partition].items():
                if type(address) is not Address:
                    raise TypeError("statistics must be keyed by Address values")
                if not isinstance(count, int) or isinstance(count, bool):
                    raise TypeError(f"statistics count for {address} must be an int")
                if not 0 < count <= U64_MAX:
                    raise ValueError(
                        f"statistics count for {address} must be a positive u64, got {count}"
                    )
                counts[address] = count
            if counts:
                checked[partition] = counts
        per_workchain: dict[int, int] = {}
        for counts in checked.values():
            for (workchain, _account), count in counts.items():
                per_workchain[workchain] = per_workchain.get(workchain, 0) + count
        for workchain, total in per_workchain.items():
            if total > U64_MAX:  # a diff's record keeps each destination shard's sum as a u64
                raise ValueError(
                    f"statistics counts for workchain {workchain} sum to {total}, past a u64"
                )
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
        if not isinstance(diff, QueueDiff):
            raise TypeError(f"from_diff takes a QueueDiff, got {type(diff).__name__}")
        cls(shard, min_message, max_message, {})
        partition_for = diff.router.partition_for
        counts: dict[int, dict[Address, int]] = {}
        by_dst = diff.router.destination_routes()
        if by_dst is not None:  # count per destination in C, then place each in its partition
            if diff.messages:
                for dst, count in Counter(map(_dst_of, diff.messages)).items():
                    counts.setdefault(by_dst.get(dst, 0), {})[dst] = count
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

    def __hash__(self) -> int:
        # The counts are left out (equal statistics still hash equal): a value type's
        # hash must not move if someone mutates the dicts it hands out.
        return hash((self.shard, self.min_message, self.max_message))
