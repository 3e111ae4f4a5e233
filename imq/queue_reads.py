"""The read side of the facade: the iterator, diff infos, tail lengths, statistics,
pointers and summaries. Each call reads one consistent snapshot (D12) or the queue
state (D14); none takes the facade's locks.

:class:`QueueReads` is a base of :class:`imq.queue.Queue`, which owns the store, the
metrics and the lifecycle; it is not used on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from imq import reads
from imq.errors import QueueClosedError, StorageError
from imq.iterator import QueueIterator, destination_test
from imq.observability import Metrics
from imq.reads import check_type
from imq.storage import StoreProtocol as Store
from imq.storage import ops
from imq.storage.rocks import import_lock_held
from imq.types import (
    Address,
    BlockId,
    BlockIdShort,
    CommitPointer,
    DiffInfo,
    DiffZone,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    check_partition,
    check_partitions,
    listed,
)

__all__ = ["QueueReads"]


class QueueReads:
    """Read-only calls of :class:`imq.queue.Queue`."""

    _store: Store
    metrics: Metrics
    # Set when a call that takes the queue's locks was cut short by an exception other
    # than an error (a KeyboardInterrupt): a lock may be left held for good, so every
    # later call raises this (and calls waiting for a lock are woken with it).
    _interrupted: StorageError | None = None

    def _check_not_closed(self) -> None:
        if self._store.closed:
            raise QueueClosedError(f"queue {self._store.path} is closed")

    def _check_open(self) -> None:
        self._check_not_closed()
        dead = self._store.dead or self._interrupted
        if dead is not None:  # what this handle holds in memory may not match the disk
            raise dead.again()

    # -- reads --------------------------------------------------------------------------------

    def iterator(
        self, partition: int, ranges: Sequence[QueueShardRange], for_shard: ShardIdent
    ) -> QueueIterator:
        """Messages of ``partition`` from the source shards of ``ranges``, merged by key,
        only those whose destination ``for_shard`` contains."""
        self._check_open()
        check_partition(partition)
        check_type("for_shard", for_shard, ShardIdent)
        ranges = listed("ranges", ranges, QueueShardRange)
        with self.metrics.time("iterator_create"):
            reads.check_ranges(ranges)
            snap = ops.open_messages(self._store, partition, ranges, destination_test(for_shard))
            try:
                it = QueueIterator(snap, ranges, for_shard, self._iterator_done)
            except BaseException:
                snap.close()
                raise
            self._store.register(it)
            # close() may have run between the snapshot and the registration: it then
            # did not see this iterator, whose cursors would keep RocksDB (and its lock)
            # open and serve the closed queue. close() marks the store closed before it
            # lists the iterators, so one of the two always releases them.
            if self._store.closed:
                it.close_for_queue()
                raise QueueClosedError(f"queue {self._store.path} was closed")
        return it

    def _iterator_done(self, yielded: int, skipped: int) -> None:
        self.metrics.inc("messages_iterated", yielded)
        self.metrics.inc("messages_skipped_by_iterator", skipped)

    def get_diff_info(
        self, shard: ShardIdent, seqno: int, zone: DiffZone = DiffZone.BOTH
    ) -> DiffInfo | None:
        self._check_open()
        reads.check_block(shard, seqno)
        check_type("zone", zone, DiffZone)
        with self.metrics.time("get_diff_info"), ops.view(self._store, diffs=True) as view:
            return reads.diff_info(view, shard, seqno, zone)

    def is_diff_exists(self, block: BlockIdShort) -> bool:
        self._check_open()
        check_type("block", block, BlockIdShort)
        with self.metrics.time("is_diff_exists"), ops.view(self._store, diffs=True) as view:
            return view.diff_info(block.shard, block.seqno) is not None

    def get_diffs_tail_len(self, shard: ShardIdent, from_key: QueueKey) -> int:
        """Number of stored diffs of ``shard`` (either zone) with ``max_message >= from_key``."""
        self._check_open()
        check_type("shard", shard, ShardIdent)
        check_type("from_key", from_key, QueueKey)
        tail = ops.TailLen(shard, from_key)
        with self.metrics.time("get_diffs_tail_len"), ops.view(self._store, tail) as view:
            return view[tail]

    def load_diff_statistics(self, partition: int, range: QueueShardRange) -> dict[Address, int]:
        """Per destination account: messages of diffs whose ``max_message`` is in ``range``."""
        self._check_open()
        check_partition(partition)
        check_type("range", range, QueueShardRange)
        totals = ops.StatTotals(partition, range)
        with self.metrics.time("load_diff_statistics"), ops.view(self._store, totals) as view:
            return view[totals]

    def load_separated_diff_statistics(
        self, partitions: Iterable[int], range: QueueShardRange
    ) -> dict[int, dict[QueueKey, dict[Address, int]]]:
        """partition -> diff max_message -> account -> count; every partition present."""
        self._check_open()
        parts = sorted(check_partitions(partitions))
        check_type("range", range, QueueShardRange)
        with self.metrics.time("load_separated_diff_statistics"):
            per_partition = {p: ops.StatsByDiff(p, range) for p in parts}
            with ops.view(self._store, *per_partition.values()) as view:
                return {p: view[read] for p, read in per_partition.items()}

    def gc_bounds(
        self,
    ) -> tuple[dict[tuple[int, ShardIdent], QueueKey], dict[tuple[int, ShardIdent], QueueKey]]:
        """The persisted GC bounds: (requested, executed), each keyed by (partition, shard)."""
        self._check_open()
        state = self._store.state
        return dict(state.gc_requested), dict(state.gc_executed)

    def commit_record(self) -> dict[ShardIdent, dict[ShardIdent, QueueKey]]:
        """The commit record of the last commit (D7): per top shard it listed, the
        ``processed_to`` of that shard's newest committed diff. The GC bound of a source
        shard is the lowest key any entry gives it."""
        self._check_open()
        return {top: dict(entries) for top, entries in self._store.state.commit_record.items()}

    def message_cache_stats(self) -> dict[str, int]:
        """The cache of fresh message rows (``message_cache_size``): its budget and bytes,
        the segments, chunks and rows it holds, and the iterator ranges it served
        (``hits``) or left to RocksDB (``misses``) since the queue opened. With
        ``message_cache_size=0`` every count is 0; a queue on the in-memory store has no
        cache and returns ``{}``."""
        self._check_open()
        return self._store.message_cache_stats()

    def summary(self) -> dict[str, Any]:
        """What the queue holds, for operators: pointers, the last committed block, GC
        bounds, and per shard its diffs by zone and its messages per partition. Reads
        every diff record (one snapshot); meant for inspection, not for a hot path."""
        self._check_open()
        diffs = ops.AllDiffs()
        with ops.view(self._store, diffs) as view:
            summary = reads.summarize(view, diffs, self._store.path, self._store.read_only)
        unfinished, running = self._import_state()
        summary["unfinished_import"] = None if unfinished is None else str(unfinished)
        summary["import_running"] = running
        return summary

    def unfinished_import(self) -> BlockId | None:
        """The block of an ``import_state`` that was interrupted (a crash, a kill, a full
        disk) before it finished, else ``None``. Its diffs and messages are partial. A
        writer's open rolls such an import back, so only a read-only handle (or a reader
        beside a running import) sees one: open the queue for writing, then import again."""
        self._check_open()
        marker = ops.read_import_marker(self._store)
        return None if marker is None else marker[0]

    def import_running(self) -> bool:
        """Whether the import :meth:`unfinished_import` names is being written now rather
        than left by a crash: an ``import_state`` of this handle, or of another handle
        or process, holds the queue's import lock (``imq.importing``, from before its
        marker is written until it has finished or rolled back, or failed). What a read
        sees meanwhile is the batches written so far; read again once the import has
        returned. ``False`` without an unfinished import, and where the lock cannot be
        seen (a reader not allowed to open ``imq.importing``, a network file system
        that does not share ``flock``): then the import looks interrupted. A holder in
        another PID namespace (another container) is seen."""
        self._check_open()
        return self._import_state()[1]

    def _import_state(self) -> tuple[BlockId | None, bool]:
        """The unfinished import's block and whether it is under way, from one read of
        its marker."""
        marker = ops.read_import_marker(self._store)
        if marker is None:
            return None, False
        store = self._store
        return marker[0], store.importing_now or import_lock_held(store.path)

    def get_last_committed_mc_block_id(self) -> BlockId | None:
        self._check_open()
        with self.metrics.time("get_last_committed_mc_block_id"):
            return self._store.state.last_mc_block

    def get_commit_pointers(self) -> dict[ShardIdent, CommitPointer]:
        self._check_open()
        with self.metrics.time("get_commit_pointers"):
            return dict(self._store.state.pointers)

    def get_last_applied_seqno(self, shard: ShardIdent) -> int | None:
        """Highest seqno with a stored diff of ``shard``, either zone."""
        self._check_open()
        check_type("shard", shard, ShardIdent)
        last = ops.LastSeqno(shard)
        with self.metrics.time("get_last_applied_seqno"), ops.view(self._store, last) as view:
            return view[last]
