"""The facade: one queue over one RocksDB directory.

Only locks, argument checks and orchestration live here; the work is done by
:mod:`imq.apply` (checks and rows of a diff), :mod:`imq.commit` (commit planning),
:mod:`imq.delete` (clear and GC deletes), :mod:`imq.gc`, and :mod:`imq.state.importer`
and :mod:`imq.state.exporter` (persistent states). The read calls live in
:mod:`imq.queue_reads` (a base class of :class:`Queue`).
"""

from __future__ import annotations

import atexit
import functools
import io
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from types import TracebackType
from typing import BinaryIO, Concatenate, ParamSpec, TypeVar

from imq import apply, reads, verify
from imq.commit import masterchain_block, plan_commit, stage_commit
from imq.config import QueueConfig
from imq.delete import DeletedDiffs, DeleteRange, stage_delete, tail_rows
from imq.diff import DiffStatistics, QueueDiff
from imq.errors import (
    ImqError,
    QueueClosedError,
    ReadOnlyError,
    StartupError,
    StateFormatError,
    StorageError,
)
from imq.gc import GarbageCollector, GcReport, GcWorker
from imq.locks import LongWait, RWLock, ShardLocks
from imq.observability import Metrics, ProgressLine, get_logger
from imq.pending import LockGuard, PendingDiff, PendingRegistry
from imq.queue_reads import QueueReads
from imq.reads import check_masterchain_block, check_type
from imq.state import exporter, importer
from imq.state.exporter import ExportReport
from imq.state.importer import ImportReport, Progress
from imq.storage import Store, StoreOptions, StoreProtocol, Table, ops
from imq.types import (
    BlockId,
    BlockIdShort,
    DiffZone,
    QueueKey,
    ShardIdent,
    TopBlock,
    check_partitions,
    check_u32,
    listed,
)

__all__ = ["CompactReport", "Queue", "store_options"]

_DEFAULT_PARTITIONS = (0, 1)
_CLEAR_COMPACT_DIFFS = 256  # a clear of at least this many diffs compacts their diff infos


def _check_file(name: str, value: object, method: str, binary: str) -> None:
    """``value`` is a path, or a binary file object with ``method`` (``read``/``write``);
    ``binary`` says how to open a text file's path instead."""
    if not isinstance(value, str | os.PathLike) and not callable(getattr(value, method, None)):
        raise TypeError(
            f"{name} must be a path or a binary file object, got {type(value).__name__}"
        )
    if isinstance(value, io.TextIOBase):
        raise TypeError(f"{name} is a text file: {binary}")
    if isinstance(value, str | os.PathLike):
        return
    if getattr(value, "closed", False) is True:
        raise ValueError(f"{name} is a closed file object: pass an open one, or a path")
    able = getattr(value, "readable" if method == "read" else "writable", None)
    try:
        usable = able() if callable(able) else True
    except (OSError, ValueError):  # some streams cannot tell
        usable = True
    if usable is False:
        doing = "reading" if method == "read" else "writing"
        raise ValueError(f"{name} is not open for {doing}: {binary}, or pass a path")


def _check_progress(progress: object) -> None:
    if not isinstance(progress, bool) and not callable(progress):
        raise TypeError(
            "progress must be a bool (True: a progress line on stderr) or a callable "
            f"taking (messages done, messages in the state), got {type(progress).__name__}"
        )


def store_options(config: QueueConfig) -> StoreOptions:
    """The storage settings a queue config asks for."""
    return StoreOptions(
        block_cache_size=config.block_cache_size,
        write_buffer_size=config.write_buffer_size,
        max_background_jobs=config.max_background_jobs,
        message_cache_size=config.message_cache_size,
        message_scans_fill_cache=config.message_scans_fill_cache,
    )


# Every queue open in this process (weakly: a queue dropped without close() is collected
# as before). At interpreter exit the ones a host left open are closed: Python ends daemon
# threads when they next take the GIL, and a host's thread inside RocksDB with the GIL
# released (a synced commit's fsync, a manual compaction) ended that way aborts the
# process ("FATAL: exception not rethrown", SIGABRT; an outside audit, 10 of 10 exits with
# a thread committing). close() waits for what is in flight; the thread's next call raises
# QueueClosedError in Python instead. Registered at import, so it runs after the exit
# hooks of a host that imported imq first and used the queue in them.
_OPEN_QUEUES: weakref.WeakSet[Queue] = weakref.WeakSet()


@atexit.register
def _close_queues_at_exit() -> None:
    for queue in list(_OPEN_QUEUES):
        queue.close()


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _takes_locks(
    operation: str,
) -> Callable[[Callable[Concatenate[Queue, _P], _R]], Callable[Concatenate[Queue, _P], _R]]:
    """A facade call that takes the queue's locks: cut short by an exception other than
    an error (a ``KeyboardInterrupt``), it may leave a lock held for good (Python can
    raise one between any two steps, also between taking a lock and recording it), so
    the handle is retired (:meth:`Queue._interrupt`) rather than left to hang later
    calls."""

    def wrap(method: Callable[Concatenate[Queue, _P], _R]) -> Callable[Concatenate[Queue, _P], _R]:
        @functools.wraps(method)
        def call(self: Queue, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return method(self, *args, **kwargs)
            except BaseException as exc:
                if not isinstance(exc, Exception):
                    self._interrupt(operation, exc)
                raise

        return call

    return wrap


@dataclass(frozen=True, slots=True)
class CompactReport:
    """What :meth:`Queue.compact` did: the tables compacted and the bytes of every file
    in the database directory before and after."""

    tables: int
    bytes_before: int
    bytes_after: int
    seconds: float


class Queue(QueueReads):
    """The internal message queue. Open with :meth:`Queue.open`; close with :meth:`close`."""

    def __init__(
        self, store: StoreProtocol, config: QueueConfig, zerostate_seqno: int
    ) -> None:  # use Queue.open
        self._store = store
        self._config = config
        self._zerostate_seqno = zerostate_seqno
        self._rw = RWLock()
        self._shard_locks = ShardLocks()
        self._pending = PendingRegistry()
        self._close_lock = threading.Lock()
        self._close_error: str | None = None
        self.metrics = Metrics()
        self._log = get_logger("queue", db=str(store.path))
        if importer.rollback_import_at_open(store, self._log):
            self.metrics.inc("imports_rolled_back")
        store.set_state(ops.load_state(store))
        for problem in verify.state_problems(store):  # a few point reads; never refuses
            self._log.warning("integrity_check_failed", problem=problem)
        gc_log = get_logger("gc", db=str(store.path))
        self._gc = GarbageCollector(
            store,
            self._rw,
            self._shard_locks,
            self.metrics,
            gc_log,
            compact=config.compact_after_delete,
            compaction_debt=config.compaction_debt,
            batch_diffs=config.gc_batch_diffs,
        )
        self._gc_worker: GcWorker | None = None
        if config.gc_enabled and not store.read_only:
            self._gc_worker = GcWorker(self._gc, config.gc_interval, gc_log)
            self._gc_worker.start()
            # The worker's thread holds the store, so a queue dropped without close()
            # would keep RocksDB open and the directory locked for the rest of the
            # process: collecting the queue stops the thread, and the store is then
            # collected (and its lock freed) as a queue's without a worker is.
            weakref.finalize(self, self._gc_worker.signal_stop).atexit = False
        _OPEN_QUEUES.add(self)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        config: QueueConfig | None = None,
        *,
        zerostate_seqno: int = 0,
        read_only: bool = False,
    ) -> Queue:
        """Open (creating if missing, parents too) the queue database in directory ``path``.

        ``read_only=True`` opens an existing database beside a live writer, for inspection:
        no lock, no GC worker, and every call that would write raises ``ImqError``. An open
        the writer's flushes tear is tried again, for up to 15 s, before ``StorageError``.
        """
        config = config if config is not None else QueueConfig()
        check_type("config", config, QueueConfig)
        check_u32("zerostate_seqno", zerostate_seqno)
        if not isinstance(path, str | os.PathLike):
            raise TypeError(
                f"path must be a str or os.PathLike (the database directory), got "
                f"{type(path).__name__}"
            )
        if not os.fspath(path):  # Path("") is the working directory
            raise ValueError("the queue database path is empty; pass its directory")
        check_type("read_only", read_only, bool)
        store = Store(Path(path), store_options(config), read_only=read_only)
        return cls._on_store(store, config, zerostate_seqno=zerostate_seqno)

    @classmethod
    def _on_store(
        cls, store: StoreProtocol, config: QueueConfig | None = None, *, zerostate_seqno: int = 0
    ) -> Queue:
        """A queue over an open ``store`` (closed with the queue, or on failure): what
        :meth:`open` does after opening RocksDB, and how tests run the queue on
        :class:`imq.storage.memory.MemoryStore` (see ``imq.testing.MemoryDatabase``)."""
        config = config if config is not None else QueueConfig()
        try:
            queue = cls(store, config, zerostate_seqno)
        except BaseException:
            store.close()
            raise
        queue._log.info("queue_opened", pointers=len(queue._store.state.pointers))
        for note in getattr(store, "log_notes", ()):
            queue._log.warning("write_ahead_log_not_replayed_in_full", detail=note)
        return queue

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self._store.path

    @property
    def closed(self) -> bool:
        return self._store.closed

    def close(self) -> None:
        """Close the database (idempotent; never raises). Open iterators stop with
        ``QueueClosedError``. What RocksDB reported while closing, if anything, is logged
        and kept in :attr:`close_error`."""
        if self._store.forked:
            # A forked child: a thread of the parent may have held any of the facade's
            # locks at the fork (the close lock, the RW lock's condition), and none will
            # ever be released here (an outside audit: 10 of 240 children hung). The
            # store's own close in a child takes no lock and releases nothing of the
            # parent's.
            self._store.close()
            return
        with self._close_lock:
            if self._store.closed:
                return
            try:
                self._gc.stopping.set()
                if self._gc_worker is not None:
                    self._gc_worker.stop()
            finally:
                failure = self._store.close()
                # Calls waiting for a lock (behind a pending diff never written, say)
                # would wait on: they raise now, as any call on a closed queue does.
                path = self._store.path
                self._rw.close(
                    lambda: QueueClosedError(f"queue {path} closed while this call waited")
                )
            if failure is None:
                self._log.info("queue_closed")
            else:  # the directory is released all the same; a reopen replays the log
                self._close_error = failure
                self._log.warning("queue_closed_with_error", error=failure)

    @property
    def zerostate_seqno(self) -> int:
        """The seqno of the zerostate this queue was opened with (``Queue.open``)."""
        return self._zerostate_seqno

    @property
    def close_error(self) -> str | None:
        """RocksDB's error while the queue closed (``None``: closed cleanly, or still
        open). A background job that failed (a compaction that met a damaged table file)
        shows here: a caller that must know its work was done checks it after ``close``."""
        return self._close_error

    def __enter__(self) -> Queue:
        self._check_not_closed()  # a dead handle may still enter: its exit closes it
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _interrupt(self, operation: str, exc: BaseException) -> None:
        """Retire the handle after a call that takes locks was cut short by ``exc`` (not
        an error): every later call raises, and calls waiting for a lock stop waiting
        and raise the same, instead of waiting for a lock that may never be released.
        ``close()`` still works."""
        if self._interrupted is None:
            self._interrupted = StorageError(
                self._store.path,
                operation,
                f"it was interrupted ({type(exc).__name__}) while it took or held the "
                "queue's locks, which may be left held",
                hint="close the queue and open it again (close() works; what earlier calls "
                "wrote is kept)",
            )
            self._log.warning(
                "queue_call_interrupted", operation=operation, error=type(exc).__name__
            )
        self._rw.close(self._interrupted.again)

    def _stuck(self, operation: str) -> LongWait:
        """A call's wait for the queue's locks: at ``locks.STUCK_AFTER`` seconds it logs a
        warning naming the shards held and by which threads (the call goes on waiting).
        Such a wait is a pending diff left unwritten, or handed to a thread that then
        commits, clears, imports or prepares its shard before writing it: a wait for
        itself that the locks cannot see."""

        def report(waited: float) -> None:
            self._log.warning(
                "lock_wait_reported",
                operation=operation,
                waited_seconds=round(waited, 1),
                held=self._pending.holders(),
                write_lock=self._rw.writer_name(),
                hint="a long import_state or export_state holds the locks while it runs; "
                "otherwise write or discard the pending diffs held: a thread handed a "
                "pending diff must write or discard it before its own commit_diff, "
                "clear_uncommitted_state, import_state, or prepare or export of that "
                "shard, which would otherwise wait for it until close()",
            )

        return LongWait(report)

    def _check_writable(self, operation: str) -> None:
        self._check_open()
        if self._store.read_only:
            # ReadOnlyError.next_step says what to do
            raise ReadOnlyError(f"{operation}: queue {self._store.path} is open read-only")

    @property
    def read_only(self) -> bool:
        return self._store.read_only

    # -- applying diffs -----------------------------------------------------------------------

    @_takes_locks("prepare_diff")
    def prepare_diff(
        self,
        diff: QueueDiff,
        block: BlockIdShort,
        diff_hash: bytes,
        statistics: DiffStatistics | None = None,
        check_sequence: DiffZone | None = None,
    ) -> PendingDiff | None:
        """Run every pre-write check and stage the diff; ``None`` if it is already applied
        (same hash) or skipped by the sequence rule. Locks are held until the pending
        diff is written or discarded."""
        self._check_writable("prepare_diff")
        stats = self._check_diff_args(diff, block, diff_hash, statistics, check_sequence)
        with self.metrics.time("prepare_diff"):
            return self._prepare(
                diff, block, diff_hash, stats, check_sequence, operation="prepare_diff"
            )

    @_takes_locks("apply_diff")
    def apply_diff(
        self,
        diff: QueueDiff,
        block: BlockIdShort,
        diff_hash: bytes,
        statistics: DiffStatistics | None = None,
        check_sequence: DiffZone | None = None,
    ) -> bool:
        """Prepare and write at once; ``True`` if written, ``False`` if it was a no-op."""
        self._check_writable("apply_diff")
        stats = self._check_diff_args(diff, block, diff_hash, statistics, check_sequence)
        with self.metrics.time("apply_diff"):
            pending = self._prepare(
                diff, block, diff_hash, stats, check_sequence, operation="apply_diff"
            )
            if pending is None:
                return False
            pending.write()
            return True

    def _check_diff_args(
        self,
        diff: QueueDiff,
        block: BlockIdShort,
        diff_hash: bytes,
        statistics: DiffStatistics | None,
        check_sequence: DiffZone | None,
    ) -> DiffStatistics | tuple[QueueKey, QueueKey] | None:
        """The statistics to store: the caller's, or the diff's bounds when they are to
        be derived from its messages (counted while its rows are encoded), or ``None``
        for an empty diff without a span (its bounds come from the store)."""
        check_type("diff", diff, QueueDiff)
        check_type("block", block, BlockIdShort)
        if self._config.check_sources:
            apply.check_sources(diff, block)
        if not isinstance(diff_hash, bytes):
            raise TypeError(f"diff_hash must be bytes, got {type(diff_hash).__name__}")
        if len(diff_hash) != 32:
            raise ValueError(f"diff_hash must be 32 bytes, got {len(diff_hash)}")
        if check_sequence is not None:
            check_type("check_sequence", check_sequence, DiffZone)
        if statistics is None:
            # None for an empty diff without a span: bounds from the store (_prepare)
            return diff.bounds
        check_type("statistics", statistics, DiffStatistics)
        if statistics.shard != block.shard:
            raise ValueError(f"statistics are for shard {statistics.shard}, the block is {block}")
        # Statistics are used as given (SEMANTICS §5.3); recounting costs about 6% of an
        # apply, so it runs only in the check_statistics (debug) mode.
        if not self._config.check_statistics:
            return statistics
        if statistics != DiffStatistics.from_diff(
            diff, block.shard, statistics.min_message, statistics.max_message
        ):
            raise ValueError(
                f"statistics of block {block} contradict its messages ({statistics.total} "
                f"counted, {len(diff.messages)} messages): pass the diff's own counts, or None"
            )
        # Their bounds become the diff's span, which commit, clear and GC act on: a
        # message outside it would be left behind or deleted with another diff.
        first, last = diff.min_message, diff.max_message
        if first is not None and last is not None:
            low, high = statistics.min_message, statistics.max_message
            if first < low or high < last:
                raise ValueError(
                    f"statistics of block {block} span {low}..{high}, which does not hold "
                    f"its messages {first}..{last}: pass the diff's own bounds, or None"
                )
        return statistics

    def _prepare(
        self,
        diff: QueueDiff,
        block: BlockIdShort,
        diff_hash: bytes,
        stats: DiffStatistics | tuple[QueueKey, QueueKey] | None,
        check_sequence: DiffZone | None,
        *,
        operation: str,
    ) -> PendingDiff | None:
        guard = self._pending.hold_shard(
            self._rw, self._shard_locks, block.shard, self._stuck(operation)
        )
        try:
            store = self._store
            epoch, known, top = store.diff_tops.lookup(block.shard)
            if (
                known
                and stats is not None
                and (
                    top is None
                    or (
                        block.seqno > top.seqno
                        and store.get_latest(Table.DIFF_INFO, top.key) == top.record
                    )
                )
            ):
                # A collator's next block: above the shard's highest stored diff as this
                # store's writes left it (imq.storage.tops), whose record is still the
                # one written. The block's own record is not stored, and the sequence
                # rule needs only that diff's seqno and span: no view.
                pointer = store.state.pointers.get(block.shard)
                if check_sequence is not None and apply.sequence_skips(
                    top, pointer, block, check_sequence
                ):
                    self._skipped(guard, block)
                    return None
            else:
                # The questions the view answers: the shard's last seqno for the sequence
                # rule, the one below the block's for an empty diff without a span.
                last = ops.LastSeqno(block.shard) if check_sequence is not None else None
                previous = ops.LastSeqno(block.shard, block.seqno) if stats is None else None
                questions = [q for q in (last, previous) if q is not None]
                with ops.view(store, *questions, diffs=True) as view:
                    pointer = view.state.pointers.get(block.shard)
                    # Above the shard's highest stored seqno the block's diff is not
                    # stored: a collator's next block, whose record needs no point read.
                    seqno = view[last] if last is not None else None
                    unstored = last is not None and (seqno is None or block.seqno > seqno)
                    if not unstored and apply.already_applied(view, block, diff_hash):
                        self._skipped(guard, block)
                        return None
                    if check_sequence is not None:
                        top = None if seqno is None else view.diff_top(block.shard, seqno)
                        if seqno is None or top is not None:
                            store.diff_tops.remember(block.shard, epoch, top)
                        if apply.sequence_skips(top, pointer, block, check_sequence):
                            self._skipped(guard, block)
                            return None
                    if stats is None:
                        assert previous is not None  # asked whenever stats is None
                        at = apply.resting_key(view, previous, block, pointer)
                        stats = (at, at)
            apply.check_above_pointer(pointer, block, diff)
            txn = self._store.transaction()
            apply.stage_diff(txn, diff, block, diff_hash, stats)
        except BaseException:
            guard.release()
            raise
        return PendingDiff(
            self._write_pending,
            txn,
            guard,
            block,
            len(diff.messages),
            on_drop=self._dropped,
            on_interrupt=self._interrupt,
        )

    def _dropped(self, pending: PendingDiff) -> None:
        """A pending diff dropped unwritten: discarded, its locks released (a caller bug
        that would otherwise hold every commit up). No metrics counter: ``__del__`` may
        run inside the metrics' own (non-re-entrant) lock. Once the queue is closed the
        diff could not be written any more and holds nothing up: no warning then (a
        collection may run this long after, inside whatever the host does next)."""
        if self.closed:
            return
        self._log.warning(
            "pending_diff_dropped",
            block=str(pending.block),
            hint="write() or discard() every prepared diff, or use it as a context manager",
        )

    def _skipped(self, guard: LockGuard, block: BlockIdShort) -> None:
        """A prepare that writes nothing: the diff is already applied, or the sequence
        rule skips it."""
        self.metrics.inc("diffs_skipped")
        self._log.debug("diff_skipped", block=str(block))
        guard.release()

    def _write_pending(self, pending: PendingDiff) -> None:
        """Called by ``PendingDiff.write`` while it still holds the locks."""
        self._check_open()
        with self.metrics.time("write_diff"):
            self._store.write(pending.txn)
        self.metrics.inc("diffs_applied")
        self.metrics.inc("messages_written", pending.messages)
        if self._log.isEnabledFor(logging.INFO):  # the fields cost more than a disabled call
            self._log.info(
                "diff_applied",
                shard=str(pending.block.shard),
                seqno=pending.block.seqno,
                messages=pending.messages,
            )

    # -- commit, clear, startup ---------------------------------------------------------------

    @_takes_locks("commit_diff")
    def commit_diff(
        self, top_blocks: Sequence[TopBlock], partitions: Iterable[int] = _DEFAULT_PARTITIONS
    ) -> bool:
        """Commit the queue on the masterchain block in ``top_blocks``; ``False`` if an
        equal or later masterchain block was already committed."""
        self._check_writable("commit_diff")
        tops = listed("top_blocks", top_blocks, TopBlock)
        for top in tops:
            check_type("top block", top, TopBlock)
        parts = check_partitions(partitions)
        self._pending.check_no_pending("commit_diff")
        with self.metrics.time("commit_diff"), self._rw.write_locked(self._stuck("commit_diff")):
            self._check_open()
            with ops.view(self._store, diffs=True) as view:
                state = view.state
                plan = plan_commit(
                    tops,
                    sorted(parts),
                    pointers=state.pointers,
                    last_mc_block=state.last_mc_block,
                    record=state.commit_record,
                    gc_requested=state.gc_requested,
                    find_diff=view.diff_info,
                    zerostate_seqno=self._zerostate_seqno,
                )
            if plan is None:
                self.metrics.inc("commits_skipped")
                self._log.debug("commit_skipped", mc_block=str(masterchain_block(tops)))
                return False
            txn = self._store.transaction()
            stage_commit(txn, plan)
            self._store.write(txn, sync=self._config.sync_commits)
        self.metrics.inc("commits")
        if self._log.isEnabledFor(logging.INFO):
            self._log.info(
                "diff_committed",
                mc_block=str(plan.mc_block),
                pointers={str(s): f"{p.key}@{p.seqno}" for s, p in sorted(plan.moved.items())},
            )
        return True

    @_takes_locks("clear_uncommitted_state")
    def clear_uncommitted_state(
        self, partitions: Iterable[int] = _DEFAULT_PARTITIONS, top_shards: Iterable[ShardIdent] = ()
    ) -> None:
        """Delete everything above the commit pointers; shards without a pointer are cleared
        entirely when listed in ``top_shards`` and left alone otherwise."""
        self._check_writable("clear_uncommitted_state")
        parts = check_partitions(partitions)
        tops = listed("top_shards", top_shards, ShardIdent)
        for shard in tops:
            check_type("top shard", shard, ShardIdent)
        self._pending.check_no_pending("clear_uncommitted_state")
        with self.metrics.time("clear_uncommitted_state"):
            deleted, compact = self._clear(parts, tops)
            # D9: compaction after the locks are released, and only for a large clear.
            # A clear removes what the last restart or cancelled collation left above
            # the pointers: messages, statistics and tails go by range tombstones (free
            # for reads) and the few diff-info tombstones are overwritten when those
            # seqnos are applied again; GC compacts all of it later. Compacting here
            # flushed memtables and rewrote L0 files on every clear (25 ms on an empty
            # queue, 195 ms beside 72k unrelated messages).
            cleared = sum(len(d.seqnos) for d in deleted)
            if (
                self._config.compact_after_delete
                and cleared >= _CLEAR_COMPACT_DIFFS
                and not self._store.closed
            ):
                self._store.compact([r for r in compact if r[0] is Table.DIFF_INFO])
        self.metrics.inc("uncommitted_cleared")
        if self._log.isEnabledFor(logging.INFO):
            self._log.info(
                "uncommitted_cleared",
                shards={str(d.shard): list(d.seqnos) for d in deleted if d.seqnos},
                diffs=sum(len(d.seqnos) for d in deleted),
                messages=sum(d.total_messages for d in deleted),
            )

    def _clear(
        self, parts: frozenset[int], tops: list[ShardIdent]
    ) -> tuple[list[DeletedDiffs], list[tuple[Table, bytes, bytes]]]:
        with self._rw.write_locked(self._stuck("clear_uncommitted_state")):
            self._check_open()
            pointers = self._store.state.pointers
            ranges = []
            for shard in sorted({*pointers, *tops}):
                pointer = pointers.get(shard)
                if pointer is not None and pointer.key == QueueKey.MAX:
                    continue
                first = QueueKey.MIN if pointer is None else pointer.key.next_value()
                ranges.append(DeleteRange(shard, first, QueueKey.MAX, parts, True))
            tails = [tail_rows(r) for r in ranges]
            txn = self._store.transaction()
            with ops.view(self._store, *tails, diffs=True) as view:
                deleted = [
                    stage_delete(view, t, txn, r) for t, r in zip(tails, ranges, strict=True)
                ]
            self._store.write(txn)
            return deleted, txn.deleted_ranges

    @_takes_locks("startup")
    def startup(
        self,
        last_applied_mc_block: BlockId,
        top_shards: Iterable[ShardIdent],
        partitions: Iterable[int] = _DEFAULT_PARTITIONS,
    ) -> None:
        """The node-start sequence: check the last committed masterchain block against the
        last applied one, then clear the uncommitted zone of the masterchain and
        ``top_shards`` (listed or not, the masterchain is a top shard: SEMANTICS §14.2).
        A failed check changes nothing."""
        self._check_writable("startup")
        check_type("last_applied_mc_block", last_applied_mc_block, BlockId)
        check_masterchain_block(last_applied_mc_block)
        tops = listed("top_shards", top_shards, ShardIdent)
        if ShardIdent.MASTERCHAIN not in tops:
            tops.insert(0, ShardIdent.MASTERCHAIN)
        with self.metrics.time("startup"):
            committed = self.get_last_committed_mc_block_id()
            if committed is not None and not (
                committed == last_applied_mc_block or committed.seqno < last_applied_mc_block.seqno
            ):
                if committed.seqno == last_applied_mc_block.seqno:
                    zero = bytes(32)

                    def hashless(block: BlockId) -> bool:
                        return block.root_hash == zero and block.file_hash == zero

                    if hashless(committed):
                        why = (
                            "it was imported or committed with a block id without hashes; "
                            "import the state again into a new, empty directory with the "
                            "block's full id (wc:shard:seqno:roothash:filehash), or start "
                            "with that same id"
                        )
                    elif hashless(last_applied_mc_block):
                        why = (
                            "the last applied block was given without hashes; pass its full "
                            "id (wc:shard:seqno:roothash:filehash)"
                        )
                    else:
                        why = (
                            "this queue belongs to another chain of blocks; restore the "
                            "queue that belongs to this node's state, or import the state "
                            "into a new, empty directory"
                        )
                    raise StartupError(
                        f"the queue was committed on masterchain block {committed}, which has "
                        f"the seqno of the last applied block {last_applied_mc_block} but other "
                        f"hashes: {why}"
                    )
                raise StartupError(
                    f"the queue was committed on masterchain block {committed}, which is ahead "
                    f"of the last applied block {last_applied_mc_block}; apply the masterchain "
                    "blocks up to it first, or restore the queue that belongs to this node's "
                    "state"
                )
            self.clear_uncommitted_state(partitions, tops)

    # -- persistent state ---------------------------------------------------------------------

    @_takes_locks("import_state")
    def import_state(
        self,
        source: str | os.PathLike[str] | BinaryIO,
        block_id: BlockId,
        top_update: tuple[bytes, int] | None = None,
        *,
        progress: bool | Progress = False,
    ) -> ImportReport:
        """Import the persistent queue state of ``block_id`` (SEMANTICS §13.5, D10, D11):
        all or nothing, streamed with bounded memory. ``progress=True`` draws a progress
        line on stderr; a callable gets ``(messages done, messages in the state)``."""
        self._check_writable("import_state")
        _check_file("source", source, "read", "open the state file in binary mode ('rb')")
        check_type("block_id", block_id, BlockId)
        _check_progress(progress)
        self._pending.check_no_pending("import_state")
        line = ProgressLine(f"import {block_id.short}") if progress is True else None
        callback: Progress | None = line
        if callable(progress):
            callback = progress
        try:
            with (
                self.metrics.time("import_state"),
                self._rw.write_locked(self._stuck("import_state")),
            ):
                self._check_open()
                report = importer.import_state(
                    self._store, source, block_id, top_update, log=self._log, progress=callback
                )
        except StateFormatError as exc:
            # The readers name the offset; name the file too (a file object by its own
            # name, when it has one), and what to do.
            if isinstance(source, str | os.PathLike):
                raise StateFormatError(
                    f"{os.fsdecode(source)}: {exc}; the file is not the queue state of "
                    f"{block_id.short}, or it is damaged: check the path, or fetch it again"
                ) from exc
            name = getattr(source, "name", None)
            named = f"{name}: " if isinstance(name, str) and name else ""
            raise StateFormatError(
                f"{named}{exc}; the data is not the queue state of {block_id.short}, or it "
                "is damaged: check what was passed, or fetch the state again"
            ) from None  # the reader's own error, with the file's name and what to do
        finally:
            if line is not None:
                line.close()
        self.metrics.inc("states_imported")
        self.metrics.inc("messages_imported", report.messages)
        return report

    @_takes_locks("export_state")
    def export_state(
        self,
        shard: ShardIdent,
        seqno: int,
        tail_len: int,
        dest: str | os.PathLike[str] | BinaryIO,
        *,
        progress: bool | Progress = False,
    ) -> ExportReport:
        """Write the persistent queue state of block (``shard``, ``seqno``) with its
        ``tail_len`` diffs to ``dest`` (zstd when a path ends in ``.queue``).
        ``progress=True`` draws a progress line on stderr; a callable gets
        ``(messages done, messages in the state)`` after each diff."""
        self._check_open()
        reads.check_block(shard, seqno)
        if not isinstance(tail_len, int) or isinstance(tail_len, bool):
            raise TypeError(f"tail_len must be an int, got {type(tail_len).__name__}")
        _check_file("dest", dest, "write", "open it in binary mode ('wb')")
        _check_progress(progress)
        line = ProgressLine(f"export {shard}:{seqno}") if progress is True else None
        callback: Progress | None = line
        if callable(progress):
            callback = progress
        # The shard's diffs and messages must not change while they are read: hold the
        # shard as a pending diff does (read lock and the shard's mutex).
        guard = self._pending.hold_shard(
            self._rw, self._shard_locks, shard, self._stuck("export_state"), kind="export"
        )
        try:
            with self.metrics.time("export_state"):
                self._check_open()
                # Under the shard's hold, so no import of this queue's is running now.
                unfinished, running = self._import_state()
                if unfinished is not None and running:
                    raise ImqError(
                        f"cannot export from {self._store.path}: an import of block "
                        f"{unfinished.short} into it is under way (its import lock is "
                        "held) and its diffs are partial until it finishes; export once it "
                        "has returned"
                    )
                if unfinished is not None:
                    raise ImqError(
                        f"cannot export from {self._store.path}: an import of block "
                        f"{unfinished.short} into it was interrupted and its diffs are "
                        "partial; open the queue for writing (that rolls the import back, "
                        "e.g. `imq gc`), import the state again, then export"
                    )
                report = exporter.export_state(
                    self._store, shard, seqno, tail_len, dest, log=self._log, progress=callback
                )
        finally:
            guard.release()
            if line is not None:
                line.close()
        self.metrics.inc("states_exported")
        return report

    # -- garbage collection -------------------------------------------------------------------

    @_takes_locks("run_gc")
    def run_gc(self) -> int:
        """Run one GC pass now, in the caller's thread; return how many (partition, shard)
        deletions it executed."""
        self._check_gc_call()
        with self.metrics.time("run_gc"):
            return self._gc.run_pass()

    @_takes_locks("run_gc_report")
    def run_gc_report(self) -> GcReport:
        """Like :meth:`run_gc`, and return what the pass deleted: per (partition, shard)
        its bound and the messages and diffs removed."""
        self._check_gc_call()
        with self.metrics.time("run_gc"):
            return self._gc.run_pass_report()

    def _check_gc_call(self) -> None:
        self._check_writable("run_gc")
        self._pending.check_no_pending("run_gc")
        if self._rw.write_held_here():
            # Inside import_state's progress callback: the pass would wait for this
            # thread's own write lock (or for the worker's pass, which waits for it).
            raise ImqError(
                "run_gc would deadlock: this thread holds the queue's write lock (inside "
                "import_state's progress callback); call it after the import returns"
            )

    # -- maintenance --------------------------------------------------------------------------

    def compact(self, progress: Callable[[int, int], object] | None = None) -> CompactReport:
        """A full manual compaction of every table, in the caller's thread (beside reads
        and writes, which go on meanwhile). ``progress(tables done, tables)`` after each
        table. Reclaims the space of deleted rows at once rather than when RocksDB's
        background compactions get to them."""
        if progress is not None and not callable(progress):
            raise TypeError(
                "progress must be None or a callable taking (tables done, tables), got "
                f"{type(progress).__name__}"
            )
        self._check_writable("compact")
        started = perf_counter()
        before = self._store.disk_usage()
        self._store.compact_all(progress)
        after = self._store.disk_usage()
        self._log.info("queue_compacted", bytes_before=before, bytes_after=after)
        return CompactReport(
            tables=len(Table),
            bytes_before=before,
            bytes_after=after,
            seconds=perf_counter() - started,
        )

    @property
    def gc_worker(self) -> GcWorker | None:
        """The background GC worker (``None`` when ``gc_enabled`` is off)."""
        return self._gc_worker
