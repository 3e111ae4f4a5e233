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

from dataclasses import dataclass

from imq.storage import TransactionProtocol as Transaction
from imq.storage import ops
from imq.types import QueueKey, ShardIdent

__all__ = ["DeleteRange", "DeletedDiffs", "DiffSpan", "stage_delete", "tail_rows"]


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
    view: ops.View, tail: ops.TailRows, txn: Transaction, r: DeleteRange, *, spans: bool = True
) -> DeletedDiffs:
    """Stage the deletion of ``r``; ``view`` answers ``tail`` (``tail_rows(r)``) and
    point reads of diff records. ``spans=False`` (GC, when it counts the deleted messages
    without the records) reads no diff record: the result lists seqnos only."""
    if not spans and r.include_diff_partitions:
        raise ValueError("a clear needs the deleted diffs' records")
    partitions = set(r.partitions)
    diffs: list[DiffSpan] = []
    seqnos = [seqno for _max_message, seqno in view[tail]]
    for seqno in seqnos if spans else ():
        span = view.diff_span(r.shard, seqno)
        if span is None:
            continue
        min_message, max_message, counts = span
        diffs.append(DiffSpan(seqno, min_message, max_message, counts))
        if r.include_diff_partitions:
            partitions |= counts.keys()
    ops.delete_diff_rows(txn, r.shard, seqnos, r.first, r.last)
    for partition in sorted(partitions):
        ops.delete_partition_rows(txn, r.shard, partition, r.first, r.last)
    return DeletedDiffs(r.shard, tuple(seqnos), tuple(diffs), frozenset(partitions))
