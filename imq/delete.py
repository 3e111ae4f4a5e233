"""The delete algorithm shared by clear and GC (SEMANTICS §8, with D3, D4, D5).

A :class:`DeleteRange` names an inclusive key range ``[first, last]`` of one source
shard. Deleting it removes, in one transaction:

- the diffs whose ``max_message`` lies in the range: their tail rows (found by a scan;
  the tail key carries the seqno, D3) and their diff-info rows, seqno 0 included (D5);
- for every partition to clear: the messages with keys in the range, and the
  statistics rows of diffs with ``max_message`` in the range (clean prefix bounds, D4).

Clear also clears every partition the deleted diffs wrote into (their stored record
lists them), so a partition outside the requested set is never left behind.
Compaction of the deleted ranges happens after the write, outside the facade's locks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from imq.storage import TransactionProtocol as Transaction
from imq.storage import ops
from imq.types import QueueKey, ShardIdent

__all__ = [
    "DeleteRange",
    "DeletedDiffs",
    "DiffSpan",
    "diff_spans",
    "stage_delete",
    "tail_rows",
]


@dataclass(frozen=True, slots=True)
class DeleteRange:
    shard: ShardIdent
    first: QueueKey
    last: QueueKey
    partitions: frozenset[int]
    include_diff_partitions: bool  # clear: yes; GC: only the partition it was asked for


@dataclass(frozen=True, slots=True)
class DiffSpan:
    """A deleted diff: its seqno, key range and messages per partition."""

    seqno: int
    min_message: QueueKey
    max_message: QueueKey
    messages: dict[int, int]


@dataclass(frozen=True, slots=True)
class DeletedDiffs:
    """What :func:`stage_delete` staged: the seqnos of every diff whose tail row it
    deletes, their records as spans (unless the caller asked for none) and the partitions
    whose rows it deletes."""

    shard: ShardIdent
    first: QueueKey  # where the staged range starts
    last: QueueKey  # where the staged range ends: the range's own end, or a cut (``limit``)
    seqnos: tuple[int, ...]
    diffs: tuple[DiffSpan, ...]
    partitions: frozenset[int]

    @property
    def total_messages(self) -> int:
        return sum(sum(d.messages.values()) for d in self.diffs)


def tail_rows(r: DeleteRange) -> ops.TailRows:
    """The read :func:`stage_delete` needs: the tail rows of the diffs ``r`` deletes."""
    return ops.TailRows(r.shard, r.first, r.last)


def stage_delete(
    view: ops.View,
    tail: ops.TailRows,
    txn: Transaction,
    r: DeleteRange,
    *,
    spans: bool = True,
    limit: int | None = None,
) -> DeletedDiffs:
    """Stage the deletion of ``r``; ``view`` answers ``tail`` (``tail_rows(r)``) and
    point reads of diff records. ``spans=False`` (GC, which counts the deleted messages
    apart) reads no diff record: the result lists seqnos only.

    ``limit`` (GC, which deletes a prefix): when more than ``limit`` diffs lie in the
    range, stage only the first ``limit`` in tail order (and every further one that ends
    at the same ``max_message``), and end the range at that ``max_message``: the result's
    ``last``. What is staged is then the deletion of the shorter prefix, whole."""
    if not spans and r.include_diff_partitions:
        raise ValueError("a clear needs the deleted diffs' records")
    partitions = set(r.partitions)
    rows = view[tail]
    if limit is None:
        seqnos, last = [seqno for _max_message, seqno in rows], r.last
    else:
        seqnos, last = _take(rows, limit, r.last)
    diffs = diff_spans(view, r.shard, seqnos) if spans else ()
    if r.include_diff_partitions:
        for d in diffs:
            partitions |= d.messages.keys()
    ops.delete_diff_rows(txn, r.shard, seqnos, r.first, last)
    for partition in sorted(partitions):
        ops.delete_partition_rows(txn, r.shard, partition, r.first, last)
    return DeletedDiffs(r.shard, r.first, last, tuple(seqnos), diffs, frozenset(partitions))


def diff_spans(view: ops.View, shard: ShardIdent, seqnos: Iterable[int]) -> tuple[DiffSpan, ...]:
    """The stored records of ``seqnos`` as spans, read through ``view`` (a seqno whose
    record is missing is left out)."""
    found: list[DiffSpan] = []
    for seqno in seqnos:
        span = view.diff_span(shard, seqno)
        if span is not None:
            min_message, max_message, counts = span
            found.append(DiffSpan(seqno, min_message, max_message, counts))
    return tuple(found)


def _take(
    rows: Iterator[tuple[QueueKey, int]], limit: int, last: QueueKey
) -> tuple[list[int], QueueKey]:
    """The seqnos of the first ``limit`` tail rows, and of the rows after them with the
    same ``max_message`` (a cut between two of them would delete a tail row whose record
    stays); and where the range then ends: that ``max_message``, or ``last`` when no row
    is left out."""
    seqnos: list[int] = []
    cut: QueueKey | None = None
    for max_message, seqno in rows:
        if cut is not None and max_message != cut:
            return seqnos, cut
        seqnos.append(seqno)
        if cut is None and len(seqnos) >= limit:
            cut = max_message
    return seqnos, last
