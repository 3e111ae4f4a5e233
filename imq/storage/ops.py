"""The queue's operations on the store: one named write per thing the domain does, one
named read per question it asks. Keys, values and cursors stay in here.

Writes stage rows into a :class:`~imq.storage.rocks.Transaction`:
:func:`put_messages` / :func:`put_raw_messages` (a diff's message rows),
:func:`put_diff_messages` (the message rows, counting the diff's statistics in the same
pass), :func:`put_diff` / :func:`put_diff_encoded` (its statistics, tail and info rows),
:func:`put_commit_state` (pointers, last committed block, commit record, GC bounds, and
the queue state they publish), :func:`delete_diff_rows` and
:func:`delete_partition_rows` (a delete span), :func:`mark_gc_executed`, and the import
marker.

Reads go through a :class:`View`: one consistent snapshot (D12) that answers point
reads of diff records and the questions declared when it was opened. A question is a
:class:`Read` value (:class:`LastSeqno`, :class:`TailRows`, :class:`TailLen`,
:class:`StatTotals`, ...) and the view answers it by name: ``view[read]``, typed by
the read's result. Every cursor is opened with the snapshot, under the store's gate, so
the answers agree with each other and with ``view.state``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Generic, TypeVar

from imq.storage import codec
from imq.storage.backend import CursorProtocol as Cursor
from imq.storage.backend import SnapshotProtocol as Snapshot
from imq.storage.backend import StoreProtocol as Store
from imq.storage.backend import TransactionProtocol as Transaction
from imq.storage.queue_state import CommitRecord, GcBounds, QueueState
from imq.storage.rocks import Scan
from imq.storage.tables import Table
from imq.storage.tops import DiffTop
from imq.types import (
    Address,
    BlockId,
    CommitPointer,
    DiffInfo,
    Message,
    QueueKey,
    QueueShardRange,
    ShardIdent,
)

__all__ = [
    "AllDiffs",
    "DiffMessages",
    "LastSeqno",
    "MessageCounter",
    "PartitionFor",
    "Read",
    "RowCounter",
    "count_range",
    "partition_rows",
    "ShardDiffs",
    "StatTotals",
    "StatisticsCounter",
    "StatsByDiff",
    "TailLen",
    "LastTail",
    "TailRows",
    "View",
    "delete_diff_rows",
    "delete_import_marker",
    "delete_partition_rows",
    "load_state",
    "mark_gc_executed",
    "open_messages",
    "put_commit_state",
    "put_diff",
    "put_diff_encoded",
    "put_diff_messages",
    "put_import_marker",
    "put_messages",
    "put_raw_messages",
    "read_import_marker",
    "stat_values",
    "view",
]

T = TypeVar("T")

DiffRecord = tuple[DiffInfo, dict[int, int]]  # the info and messages per partition
ImportMarker = tuple[BlockId, list[tuple[int, QueueKey, QueueKey]], list[int]]


# ---------------------------------------------------------------------------------------------
# writes


PartitionFor = codec.PartitionFor
"""How a diff's messages are routed to partitions (see :data:`codec.PartitionFor`)."""


def put_messages(
    txn: Transaction,
    shard: ShardIdent,
    messages: Iterable[Message],
    partition_for: PartitionFor,
    counts: dict[int, int],
) -> None:
    """The message rows of a diff of ``shard`` (``partition_for=None``: all in partition
    0); ``counts`` receives the messages per partition."""
    with txn.writer(Table.MESSAGES) as (put, target):
        codec.put_message_rows(put, target, shard, messages, partition_for, counts=counts)


def put_raw_messages(
    txn: Transaction,
    shard: ShardIdent,
    *,
    partitions: Iterable[int] | None,
    headers: Iterable[tuple[int, int, bytes, int, bytes]],
    roots: Iterable[Sequence[Any]],
) -> None:
    """The message rows of an imported diff, from plain fields (see
    :func:`imq.storage.codec.put_raw_message_rows`): the same bytes as :func:`put_messages`.
    A bulk write: a store's cache of fresh rows does not take them."""
    with txn.writer(Table.MESSAGES, cached=False) as (put, target):
        codec.put_raw_message_rows(
            put, target, shard, partitions=partitions, headers=headers, roots=roots
        )


def put_diff_messages(
    txn: Transaction,
    shard: ShardIdent,
    messages: Sequence[Message],
    partition_for: PartitionFor,
) -> codec.EncodedDiff:
    """The message rows of a diff of ``shard`` (as :func:`put_messages`), counted in the
    same pass per partition, destination and destination workchain: its derived
    statistics, with each partition's statistics value already packed."""
    with txn.writer(Table.MESSAGES) as (put, target):
        return codec.encode_diff(put, target, shard, messages, partition_for)


def stat_values(statistics: Mapping[int, codec.Destinations]) -> dict[int, bytes]:
    """The statistics value of each partition (what :func:`put_diff` stores)."""
    return {partition: codec.stat_value(counts) for partition, counts in statistics.items()}


def put_diff(
    txn: Transaction,
    shard: ShardIdent,
    info: DiffInfo,
    statistics: Mapping[int, codec.Destinations],
    partitions: Mapping[int, int],
) -> None:
    """A diff's statistics rows (per partition, its messages per destination), its tail
    row and its info record. ``partitions`` maps every partition the diff wrote
    messages or statistics into to its messages there (deletes find its rows by it)."""
    record = codec.diff_info_value(info, partitions)
    put_diff_encoded(txn, shard, info.seqno, info.max_message, stat_values(statistics), record)


def put_diff_encoded(  # noqa: PLR0917 - the row parts of one diff, packed
    txn: Transaction,
    shard: ShardIdent,
    seqno: int,
    max_message: QueueKey,
    stat_values: Mapping[int, bytes],
    record: bytes,
) -> None:
    """:func:`put_diff` of values already packed: each partition's statistics
    (:func:`stat_values`, or :func:`put_diff_messages`) and the info ``record``
    (:func:`imq.storage.codec.diff_record_value`)."""
    for partition, value in stat_values.items():
        txn.put(Table.STATISTICS, codec.stat_key(shard, partition, max_message, seqno), value)
    txn.put(Table.DIFF_TAIL, codec.tail_key(shard, max_message, seqno), b"")
    key = codec.diff_info_key(shard, seqno)
    txn.put_diff_record(shard, DiffTop(seqno, key, record, max_message))


def put_commit_state(
    txn: Transaction,
    moved: Mapping[ShardIdent, CommitPointer],
    mc_block: BlockId | None,
    record: CommitRecord | None = None,
    gc_requested: GcBounds | None = None,
) -> None:
    """Set the ``moved`` commit pointers, the last committed block (if given), the commit
    record and the requested GC bounds (if given), and publish them in the queue state
    with the write (a commit sets all four; an import a pointer, the record and maybe the
    block)."""
    for shard, pointer in moved.items():
        txn.put(Table.COMMIT_POINTERS, codec.shard_bytes(shard), codec.pointer_value(pointer))
    if mc_block is not None:
        txn.put(Table.VARS, codec.LAST_COMMITTED_MC_BLOCK, codec.block_id_bytes(mc_block))
    if record is not None:
        txn.put(Table.VARS, codec.COMMIT_RECORD, codec.commit_record_value(record))
    if gc_requested is not None:
        txn.put(Table.VARS, codec.GC_REQUESTED, codec.gc_bounds_value(gc_requested))
    moved = dict(moved)
    txn.publish(lambda s: s.committed(moved, mc_block, record, gc_requested))


def mark_gc_executed(txn: Transaction, executed: GcBounds) -> None:
    """Persist the executed GC bounds and publish them with the write."""
    txn.put(Table.VARS, codec.GC_EXECUTED, codec.gc_bounds_value(executed))
    txn.publish(lambda s: s.gc_marked(executed))


def delete_diff_rows(
    txn: Transaction, shard: ShardIdent, seqnos: Sequence[int], first: QueueKey, last: QueueKey
) -> None:
    """Delete the tail rows of ``shard`` with ``first <= max_message <= last`` and the info
    records of ``seqnos`` (the diffs those tail rows name)."""
    if not seqnos:
        return
    for seqno in seqnos:
        txn.delete(Table.DIFF_INFO, codec.diff_info_key(shard, seqno))
    txn.delete_range(Table.DIFF_TAIL, *codec.tail_range_inclusive(shard, first, last))
    # The diff-info rows go by point deletes; compact their span too, or the tombstones
    # stay (no automatic compaction) and slow every later seek there.
    lo = codec.diff_info_key(shard, min(seqnos))
    txn.compact_after(
        Table.DIFF_INFO, lo, codec.prefix_end(codec.diff_info_key(shard, max(seqnos)))
    )


def delete_partition_rows(
    txn: Transaction, shard: ShardIdent, partition: int, first: QueueKey, last: QueueKey
) -> None:
    """Delete the messages of (``partition``, ``shard``) with keys in ``[first, last]`` and
    the statistics rows of its diffs with ``max_message`` there (clean bounds, D4)."""
    txn.delete_range(Table.MESSAGES, *codec.message_delete_range(partition, shard, first, last))
    txn.delete_range(Table.STATISTICS, *codec.stat_delete_range(shard, partition, first, last))


def put_import_marker(
    txn: Transaction,
    block_id: BlockId,
    spans: Iterable[tuple[int, QueueKey, QueueKey]],
    partitions: Iterable[int],
) -> None:
    """The marker of an import in progress (D10): its block, the ``(seqno, min, max)`` of
    every diff it writes, and the partitions it writes into."""
    txn.put(Table.VARS, codec.IMPORT_MARKER, codec.import_marker_value(block_id, spans, partitions))


def delete_import_marker(txn: Transaction) -> None:
    txn.delete(Table.VARS, codec.IMPORT_MARKER)


# ---------------------------------------------------------------------------------------------
# reads outside a view: the small tables, at open


def load_state(store: Store) -> QueueState:
    """The queue state (D14), read from the small tables."""
    pointers = dict(codec.decode_pointer(k, v) for k, v in store.load_table(Table.COMMIT_POINTERS))
    raw_mc = store.get_latest(Table.VARS, codec.LAST_COMMITTED_MC_BLOCK)
    raw_record = store.get_latest(Table.VARS, codec.COMMIT_RECORD)
    raw_requested = store.get_latest(Table.VARS, codec.GC_REQUESTED)
    raw_executed = store.get_latest(Table.VARS, codec.GC_EXECUTED)
    return QueueState(
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


def read_import_marker(store: Store) -> ImportMarker | None:
    """The marker of an unfinished import, if one is stored."""
    raw = store.get_latest(Table.VARS, codec.IMPORT_MARKER)
    return None if raw is None else codec.decode_import_marker(raw)


# ---------------------------------------------------------------------------------------------
# questions a view answers


class Read(Generic[T]):
    """One question to a :class:`View`: the range it scans and how its rows answer it."""

    __slots__ = ("scan",)

    def __init__(self, scan: Scan) -> None:
        self.scan = scan

    def answer(self, cursor: Cursor) -> T:
        raise NotImplementedError


class LastSeqno(Read[int | None]):
    """The highest stored seqno of ``shard`` (below ``below``, when given)."""

    __slots__ = ()

    def __init__(self, shard: ShardIdent, below: int | None = None) -> None:
        lo, hi = codec.diff_info_shard_range(shard)
        if below is not None:
            hi = codec.diff_info_key(shard, below)
        self.scan = Scan(Table.DIFF_INFO, lo, hi, seekable=True)

    def answer(self, cursor: Cursor) -> int | None:
        key = cursor.last()
        return None if key is None else codec.decode_diff_info_seqno(key)


class TailRows(Read[Iterator[tuple[QueueKey, int]]]):
    """``(max_message, seqno)`` of the diffs of ``shard`` with ``first <= max_message <=
    last``, in key order."""

    __slots__ = ()

    def __init__(self, shard: ShardIdent, first: QueueKey, last: QueueKey) -> None:
        lo, hi = codec.tail_range_inclusive(shard, first, last)
        self.scan = Scan(Table.DIFF_TAIL, lo, hi, keys_only=True)

    def answer(self, cursor: Cursor) -> Iterator[tuple[QueueKey, int]]:
        return (codec.decode_tail_key(key) for key in cursor)


class LastTail(Read[QueueKey | None]):
    """The ``max_message`` of the last diff of ``shard`` with ``first <= max_message <=
    last`` in key order, or ``None`` when there is none (one seek)."""

    __slots__ = ()

    def __init__(self, shard: ShardIdent, first: QueueKey, last: QueueKey) -> None:
        lo, hi = codec.tail_range_inclusive(shard, first, last)
        self.scan = Scan(Table.DIFF_TAIL, lo, hi, keys_only=True, seekable=True)

    def answer(self, cursor: Cursor) -> QueueKey | None:
        key = cursor.last()
        return None if key is None else codec.decode_tail_key(key)[0]


class TailLen(Read[int]):
    """The number of stored diffs of ``shard`` with ``max_message >= from_key``."""

    __slots__ = ()

    def __init__(self, shard: ShardIdent, from_key: QueueKey) -> None:
        lo, hi = codec.tail_range(shard, from_key)
        self.scan = Scan(Table.DIFF_TAIL, lo, hi, keys_only=True)

    def answer(self, cursor: Cursor) -> int:
        return sum(1 for _ in cursor)


def _stat_scan(partition: int, r: QueueShardRange) -> Scan:
    lo, hi = codec.stat_range(r.shard, partition, r.from_key, r.to_key)
    return Scan(Table.STATISTICS, lo, max(lo, hi))


class StatTotals(Read[dict[Address, int]]):
    """Per destination: the messages of ``partition`` in the diffs whose ``max_message``
    lies in the range."""

    __slots__ = ()

    def __init__(self, partition: int, r: QueueShardRange) -> None:
        self.scan = _stat_scan(partition, r)

    def answer(self, cursor: Cursor) -> dict[Address, int]:
        totals: dict[Address, int] = {}
        for key, value in cursor:
            _max_message, entries = codec.decode_stat_row(key, value)
            for dst, count in entries:
                totals[dst] = totals.get(dst, 0) + count
        return totals


class StatsByDiff(Read[dict[QueueKey, dict[Address, int]]]):
    """Like :class:`StatTotals`, per diff ``max_message`` (diffs sharing one are summed)."""

    __slots__ = ()

    def __init__(self, partition: int, r: QueueShardRange) -> None:
        self.scan = _stat_scan(partition, r)

    def answer(self, cursor: Cursor) -> dict[QueueKey, dict[Address, int]]:
        grouped: dict[QueueKey, dict[Address, int]] = {}
        for key, value in cursor:
            max_message, entries = codec.decode_stat_row(key, value)
            bucket = grouped.setdefault(max_message, {})
            for dst, count in entries:
                bucket[dst] = bucket.get(dst, 0) + count
        return grouped


class ShardDiffs(Read[dict[int, DiffRecord]]):
    """Every stored diff record of ``shard``, by seqno."""

    __slots__ = ("_shard",)

    def __init__(self, shard: ShardIdent) -> None:
        lo, hi = codec.diff_info_shard_range(shard)
        self.scan = Scan(Table.DIFF_INFO, lo, hi)
        self._shard = shard

    def answer(self, cursor: Cursor) -> dict[int, DiffRecord]:
        return {
            codec.decode_diff_info_seqno(key): codec.decode_diff_record(key, value)
            for key, value in cursor
        }


class AllDiffs(Read[Iterator[tuple[ShardIdent, DiffInfo, dict[int, int]]]]):
    """Every stored diff record: ``(shard, info, messages per partition)``."""

    __slots__ = ()

    def __init__(self) -> None:
        self.scan = Scan(Table.DIFF_INFO, b"", None)

    def answer(self, cursor: Cursor) -> Iterator[tuple[ShardIdent, DiffInfo, dict[int, int]]]:
        for key, value in cursor:
            info, partitions = codec.decode_diff_record(key, value)
            yield codec.decode_shard(key[: codec.SHARD_LEN]), info, partitions


class DiffMessages(Read[list[tuple[bytes, bytes, bytes, bytes]]]):
    """``(hash, body, lt, addresses)`` of the messages of (``partition``, ``shard``) with
    keys in ``[first, last]``, in key order: see :func:`codec.decode_message_export`."""

    __slots__ = ()

    def __init__(self, partition: int, shard: ShardIdent, first: QueueKey, last: QueueKey) -> None:
        lo, hi = codec.message_delete_range(partition, shard, first, last)
        self.scan = Scan(Table.MESSAGES, lo, hi)

    def answer(self, cursor: Cursor) -> list[tuple[bytes, bytes, bytes, bytes]]:
        decode = codec.decode_message_export
        return [decode(k, v) for k, v in cursor]


def count_range(
    partition: int, shard: ShardIdent, first: QueueKey, end: QueueKey, *, inclusive: bool
) -> tuple[bytes, bytes]:
    """The key range of the message rows of (``partition``, ``shard``) from ``first`` to
    ``end`` (``end`` itself only when ``inclusive``): what :class:`RowCounter` counts."""
    if inclusive:
        return codec.message_delete_range(partition, shard, first, end)
    return codec.message_range(partition, shard, first, end)


class RowCounter:
    __slots__ = ("_cursor",)

    def __init__(self, cursor: Cursor) -> None:
        self._cursor = cursor

    def count(
        self, partition: int, shard: ShardIdent, first: QueueKey, end: QueueKey, *, inclusive: bool
    ) -> int:
        """Message rows of (``partition``, ``shard``) from ``first`` to ``end`` (``end``
        itself only when ``inclusive``)."""
        return self.count_keys(*count_range(partition, shard, first, end, inclusive=inclusive))

    def count_keys(self, lo: bytes, hi: bytes) -> int:
        """Rows of the counter's table with ``lo <= key < hi`` (one seek)."""
        return self._cursor.count(lo, hi)


class MessageCounter(Read[RowCounter]):
    """Counts message rows in any number of key ranges (one seek each)."""

    __slots__ = ()

    def __init__(self) -> None:
        self.scan = Scan(Table.MESSAGES, b"", None, keys_only=True, seekable=True)

    def answer(self, cursor: Cursor) -> RowCounter:
        return RowCounter(cursor)


class StatisticsCounter(Read[RowCounter]):
    """Counts statistics rows in any number of key ranges (one seek each), through
    :meth:`RowCounter.count_keys`; :func:`partition_rows` gives the ranges."""

    __slots__ = ()

    def __init__(self) -> None:
        self.scan = Scan(Table.STATISTICS, b"", None, keys_only=True, seekable=True)

    def answer(self, cursor: Cursor) -> RowCounter:
        return RowCounter(cursor)


def partition_rows(
    messages: RowCounter,
    statistics: RowCounter,
    shard: ShardIdent,
    partition: int,
    *,
    first: QueueKey,
    last: QueueKey,
) -> int:
    """The rows :func:`delete_partition_rows` of the same arguments would delete: the
    messages with keys in ``[first, last]`` (``messages``: a :class:`MessageCounter`'s)
    and the statistics rows of diffs with ``max_message`` there (``statistics``: a
    :class:`StatisticsCounter`'s)."""
    return messages.count_keys(
        *codec.message_delete_range(partition, shard, first, last)
    ) + statistics.count_keys(*codec.stat_delete_range(shard, partition, first, last))


def open_messages(
    store: Store,
    partition: int,
    ranges: Sequence[QueueShardRange],
    reader: tuple[int, int, int] | None = None,
) -> Snapshot:
    """A snapshot whose cursors are the messages of ``partition`` in each of ``ranges``,
    one per range and in order: the sources :class:`imq.iterator.QueueIterator` merges
    (``reader``: its destination test, see :meth:`Store.message_snapshot`)."""
    return store.message_snapshot(codec.message_bounds(partition, ranges), reader)


# ---------------------------------------------------------------------------------------------
# the view


class View:
    """A consistent read view (D12): the queue state, diff records by point read, and
    the answers to the questions it was opened with."""

    __slots__ = ("_cursors", "_reads", "_snap")

    def __init__(self, snap: Snapshot, reads: Sequence[Read[Any]]) -> None:
        # A view answers a handful of reads: parallel lists searched by identity are
        # cheaper than a dict here (every read call of the facade opens one view).
        self._snap = snap
        self._reads: list[Read[Any] | None] = list(reads)
        self._cursors = list(snap.cursors)

    @property
    def state(self) -> QueueState:
        return self._snap.state

    def __getitem__(self, read: Read[T]) -> T:
        reads = self._reads
        try:
            i = reads.index(read)  # by identity: a Read has no __eq__ of its own
        except ValueError:
            raise KeyError("this view was not opened with that read, or it was answered") from None
        reads[i] = None
        return read.answer(self._cursors[i])

    def _raw_info(self, shard: ShardIdent, seqno: int) -> tuple[bytes, bytes | None]:
        key = codec.diff_info_key(shard, seqno)
        return key, self._snap.get(Table.DIFF_INFO, key)

    def diff_info(self, shard: ShardIdent, seqno: int) -> DiffInfo | None:
        key, raw = self._raw_info(shard, seqno)
        return None if raw is None else codec.decode_diff_info(key, raw)

    def diff_record(self, shard: ShardIdent, seqno: int) -> DiffRecord | None:
        key, raw = self._raw_info(shard, seqno)
        return None if raw is None else codec.decode_diff_record(key, raw)

    def diff_top(self, shard: ShardIdent, seqno: int) -> DiffTop | None:
        """The stored diff ``seqno`` of ``shard`` as a :class:`DiffTop` (its record's
        bytes and span end, the record checked as :meth:`diff_span` checks it), or
        ``None`` when it is not stored."""
        key, raw = self._raw_info(shard, seqno)
        if raw is None:
            return None
        return DiffTop(seqno, key, raw, codec.decode_diff_span(key, raw)[1])

    def diff_span(
        self, shard: ShardIdent, seqno: int
    ) -> tuple[QueueKey, QueueKey, dict[int, int]] | None:
        """``(min_message, max_message, messages per partition)`` of a diff, without
        building its :class:`DiffInfo` (what deletes need)."""
        key, raw = self._raw_info(shard, seqno)
        return None if raw is None else codec.decode_diff_span(key, raw)

    def close(self) -> None:
        self._snap.close()

    def __enter__(self) -> View:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


_DIFF_POINTS = (Table.DIFF_INFO,)


def view(store: Store, *reads: Read[Any], diffs: bool = False) -> View:
    """Open a view answering ``reads``; ``diffs=True`` also allows point reads of diff
    records."""
    points = _DIFF_POINTS if diffs else ()
    return View(store.snapshot(points=points, scans=[r.scan for r in reads]), reads)
