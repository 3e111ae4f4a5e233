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

from imq.storage import Scan, Snapshot, Table, Transaction, codec
from imq.types import QueueKey, ShardIdent

__all__ = ["DeleteRange", "DeletedDiffs", "DiffSpan", "stage_delete", "tail_scan"]


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
    shard: ShardIdent
    diffs: tuple[DiffSpan, ...]
    partitions: frozenset[int]

    @property
    def seqnos(self) -> tuple[int, ...]:
        return tuple(d.seqno for d in self.diffs)

    @property
    def total_messages(self) -> int:
        return sum(sum(d.messages.values()) for d in self.diffs)


def tail_scan(r: DeleteRange) -> Scan:
    lo, hi = codec.tail_range_inclusive(r.shard, r.first, r.last)
    return Scan(Table.DIFF_TAIL, lo, hi, keys_only=True)


def stage_delete(
    snap: Snapshot, cursor_index: int, txn: Transaction, r: DeleteRange
) -> DeletedDiffs:
    """Stage the deletion of ``r``; ``snap.cursors[cursor_index]`` is ``tail_scan(r)``."""
    partitions = set(r.partitions)
    diffs: list[DiffSpan] = []
    seqnos: list[int] = []
    for tail in snap.cursors[cursor_index]:
        _max_message, seqno = codec.decode_tail_key(tail)
        seqnos.append(seqno)
        info_key = codec.diff_info_key(r.shard, seqno)
        raw = snap.get(Table.DIFF_INFO, info_key)
        if raw is None:
            continue
        min_message, max_message, counts = codec.decode_diff_span(info_key, raw)
        diffs.append(DiffSpan(seqno, min_message, max_message, counts))
        if r.include_diff_partitions:
            partitions |= counts.keys()
        txn.delete(Table.DIFF_INFO, info_key)
    if seqnos:
        txn.delete_range(Table.DIFF_TAIL, *codec.tail_range_inclusive(r.shard, r.first, r.last))
        # The diff-info rows go by point deletes; compact their span too, or the
        # tombstones stay (no automatic compaction) and slow every later seek there.
        lo = codec.diff_info_key(r.shard, min(seqnos))
        txn.compact_after(
            Table.DIFF_INFO, lo, codec.prefix_end(codec.diff_info_key(r.shard, max(seqnos)))
        )
    for partition in sorted(partitions):
        txn.delete_range(
            Table.MESSAGES, *codec.message_delete_range(partition, r.shard, r.first, r.last)
        )
        txn.delete_range(
            Table.STATISTICS, *codec.stat_delete_range(r.shard, partition, r.first, r.last)
        )
    return DeletedDiffs(r.shard, tuple(diffs), frozenset(partitions))
