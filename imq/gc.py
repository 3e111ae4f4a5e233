"""Garbage collection (SEMANTICS §7, §8 with D4, D5, D7, D8, D9).

Commits persist the *requested* bound of every (partition, source shard) (D7); the
collector persists the *executed* one. A pass runs every entry whose requested bound is
strictly above its executed bound, grouped by (shard, bound) so one delete batch serves
every partition that shares a bound. A pass:

1. for each group, under the facade's read lock and the shard's mutex (so the batch
   serializes with that shard's diff writes and with commit and clear): stage and
   write the delete of everything up to the bound, inclusive, then release them. A
   group over more than ``batch_diffs`` diffs goes in several batches, each the whole
   deletion of a shorter prefix (up to the end of a diff), the locks released between
   them; what a batch removed is counted after the release, in its view from before
   the write;
2. when compaction is due, once every group is deleted and without any facade lock
   (D9): compact exactly the ranges deleted since the last compaction, at once;
3. only then mark the bounds of the deleted groups executed, in one small batch.

Compaction is due after every pass with ``compact_after_delete``, and otherwise once
the ranges deleted since the last compaction hold ``compaction_debt`` messages. Until
then the range tombstones cost readers nothing, and RocksDB's background compaction
drops the rows they cover as it merges the files that hold them. The debt lives in
memory: after a reopen it starts again from zero (what it held is left to RocksDB).

A failure at any step is logged (``gc_range_failed``) and the bound stays unexecuted,
so the next tick retries it (D8); deletes are idempotent. Passes never overlap, and the
background worker never dies from one error.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from time import perf_counter

from imq.delete import DeletedDiffs, DeleteRange, DiffSpan, diff_spans, stage_delete, tail_rows
from imq.errors import QueueClosedError, StorageError
from imq.locks import RWLock, ShardLocks
from imq.observability import ImqLogger, Metrics
from imq.storage import StoreProtocol as Store
from imq.storage import Table, ops
from imq.storage.queue_state import GcBounds
from imq.types import QueueKey, ShardIdent

__all__ = ["GarbageCollector", "GcRange", "GcReport", "GcTask", "GcWorker", "due_tasks", "union"]

_LOCK_POLL = 0.05  # seconds between checks of the stop flag while waiting for a lock
_FLUSH_EVERY = 256  # batches of one deletion between flushes of the tables it range-deletes
_TOMBSTONED = (Table.MESSAGES, Table.STATISTICS, Table.DIFF_TAIL)


@dataclass(frozen=True, slots=True, order=True)
class GcTask:
    shard: ShardIdent
    bound: QueueKey
    partitions: tuple[int, ...]


def due_tasks(requested: GcBounds, executed: GcBounds) -> list[GcTask]:
    """Entries whose requested bound is above the executed one, grouped by (shard, bound)."""
    groups: dict[tuple[ShardIdent, QueueKey], list[int]] = {}
    for (partition, shard), bound in requested.items():
        last = executed.get((partition, shard))
        if last is None or bound > last:
            groups.setdefault((shard, bound), []).append(partition)
    return sorted(GcTask(s, b, tuple(sorted(ps))) for (s, b), ps in groups.items())


@dataclass(frozen=True, slots=True)
class GcRange:
    """One (partition, source shard) deletion of a pass: everything up to ``bound``
    (inclusive). ``diffs`` counts the shard's diffs the deletion removed (shared by the
    partitions deleted together), ``messages`` this partition's messages."""

    partition: int
    shard: ShardIdent
    bound: QueueKey
    messages: int
    diffs: int


@dataclass(frozen=True, slots=True)
class GcReport:
    """What one GC pass did (``Queue.run_gc_report``). ``executed`` is what
    ``Queue.run_gc`` returns; ``failed`` deletions stay due and are retried next pass."""

    ranges: tuple[GcRange, ...]
    failed: int
    seconds: float
    compaction_seconds: float

    @property
    def executed(self) -> int:
        return len(self.ranges)

    @property
    def messages(self) -> int:
        return sum(r.messages for r in self.ranges)

    @property
    def diffs(self) -> int:
        """Diffs removed (each shard's diffs counted once, however many partitions)."""
        return sum({(r.shard, r.bound): r.diffs for r in self.ranges}.values())


_EMPTY_REPORT = GcReport((), 0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class _Deleted:
    task: GcTask
    messages: dict[int, int]  # per partition: messages this deletion removed
    diffs: int
    seconds: float


Gap = tuple[QueueKey, QueueKey, bool]  # from, to, whether ``to`` itself is included


def _first_above(after: QueueKey | None) -> QueueKey | None:
    """The first key a deletion above the executed bound ``after`` removes (``None``
    for no bound yet: from the start); ``None`` when nothing lies above it."""
    if after is None:
        return QueueKey.MIN
    return None if after == QueueKey.MAX else after.next_value()


def _count_plan(
    partition: int,
    low: QueueKey,
    bound: QueueKey,
    deleted: Sequence[DiffSpan],
) -> tuple[int, list[Gap]]:
    """How to count the messages of ``partition`` in ``[low, bound]``: the diffs that
    lie wholly inside count by their records; the gaps between them (at most a partial
    diff at each end, when a shard's diffs cover disjoint key ranges as blocks do) are
    counted row by row. Returns (counted from records, gap key ranges to count)."""
    inside = sorted(
        (d for d in deleted if low <= d.min_message and d.max_message <= bound),
        key=lambda d: d.min_message,
    )
    counted = sum(d.messages.get(partition, 0) for d in inside)
    gaps: list[Gap] = []
    cursor = low
    for d in inside:
        if cursor < d.min_message:
            gaps.append((cursor, d.min_message, False))
        if d.max_message == QueueKey.MAX:
            return counted, gaps
        cursor = max(cursor, d.max_message.next_value())
    if cursor <= bound:
        gaps.append((cursor, bound, True))
    return counted, gaps


def union(ranges: list[tuple[Table, bytes, bytes]]) -> list[tuple[Table, bytes, bytes]]:
    """Half-open key ranges ``[lo, hi)`` per table, merged where they overlap or touch;
    sorted by table, then start."""
    merged: list[tuple[Table, bytes, bytes]] = []
    for table, lo, hi in sorted(ranges, key=lambda r: (r[0].value, r[1])):
        if merged and merged[-1][0] is table and lo <= merged[-1][2]:
            last = merged[-1]
            merged[-1] = (table, last[1], max(last[2], hi))
        else:
            merged.append((table, lo, hi))
    return merged


class GarbageCollector:
    """Runs GC passes; one at a time, from the worker or from ``Queue.run_gc``.

    A pass writes every due deletion first, then, when compaction is due (``compact``,
    or the debt reached ``compaction_debt``), compacts every range deleted since the last
    compaction at once, then marks the bounds executed in one batch. Compacting after each
    shard's delete instead cost 4x more: each compaction rewrote the live rows of shards
    not yet deleted (``benchmarks/results/gc.md``).
    """

    def __init__(
        self,
        store: Store,
        rw: RWLock,
        shard_locks: ShardLocks,
        metrics: Metrics,
        log: ImqLogger,
        *,
        compact: bool,
        compaction_debt: int = 0,
        batch_diffs: int = 10_000,
    ) -> None:
        if batch_diffs < 1:
            raise ValueError(f"batch_diffs must be at least 1, got {batch_diffs}")
        self._store = store
        self._rw = rw
        self._shard_locks = shard_locks
        self._metrics = metrics
        self._log = log
        self._compact = compact
        self._debt_limit = compaction_debt
        self._batch_diffs = batch_diffs
        # Deleted but not yet compacted: messages, and the union of the deleted key ranges
        # (GC deletes a growing prefix of each (partition, shard) and consecutive diff
        # seqnos, so successive passes' ranges overlap or touch and the union stays small).
        self._debt = 0
        self._unflushed = 0  # this pass's delete batches since the last flush of their tables
        self._debt_ranges: list[tuple[Table, bytes, bytes]] = []
        self._pass_lock = threading.Lock()
        self.stopping = threading.Event()

    def run_pass(self) -> int:
        """Run every due deletion; return how many (partition, shard) deletions ran."""
        return self.run_pass_report().executed

    def run_pass_report(self) -> GcReport:
        """Run every due deletion; return what the pass deleted."""
        with self._pass_lock:
            started = perf_counter()
            state = self._store.state
            tasks = due_tasks(state.gc_requested, state.gc_executed)
            if not tasks:
                return _EMPTY_REPORT
            # Per pass: a node's passes of a few batches each leave the flushes to RocksDB
            # (a flush every few minutes made small table files for nothing).
            self._unflushed = 0
            deleted: list[_Deleted] = []
            ranges: list[tuple[Table, bytes, bytes]] = []
            failed = 0
            for task in tasks:
                if self.stopping.is_set():
                    break
                try:
                    done, task_ranges = self._delete(task)
                except Exception as exc:
                    self._raise_if_final(exc)
                    failed += self._failed([task], exc)
                else:
                    deleted.append(done)
                    ranges.extend(task_ranges)
            compaction = 0.0
            try:
                if deleted:
                    self._add_debt(deleted, ranges)
                    if self._compaction_due():
                        compact_started = perf_counter()
                        self._store.compact(self._debt_ranges)
                        compaction = perf_counter() - compact_started
                        self._debt, self._debt_ranges = 0, []
                self._mark_executed([d.task for d in deleted])
            except Exception as exc:
                self._raise_if_final(exc)
                failed += self._failed([d.task for d in deleted], exc)
                deleted = []
            self._report(deleted, failed, started, compaction)
            collected = tuple(
                GcRange(p, d.task.shard, d.task.bound, d.messages[p], d.diffs)
                for d in deleted
                for p in d.task.partitions
            )
            return GcReport(collected, failed, perf_counter() - started, compaction)

    @property
    def debt(self) -> int:
        """Messages deleted (by this process) since the last compaction of their ranges."""
        return self._debt

    def _add_debt(self, deleted: list[_Deleted], ranges: list[tuple[Table, bytes, bytes]]) -> None:
        self._debt += sum(sum(d.messages.values()) for d in deleted)
        self._debt_ranges = union(self._debt_ranges + ranges)

    def _compaction_due(self) -> bool:
        if self._compact:
            return True
        return self._debt_limit > 0 and self._debt >= self._debt_limit

    def _delete(self, task: GcTask) -> tuple[_Deleted, list[tuple[Table, bytes, bytes]]]:
        """Write one (shard, bound) deletion, in batches of at most ``batch_diffs`` diffs
        (the shard's mutex is released between them); return it and the ranges to compact.

        Each batch starts just above where the one before ended: a range delete from the
        start every time would nest the tombstones, and each batch's reads would cost
        more than the one before (an outside audit: 680 batches of 1 diff, 16 s against
        1.0 s). Unless the shard's writers wrote at or below that end meanwhile (a bound
        above the commit pointer, a clear and a new diff there): that batch starts from
        the beginning again, or a diff across the end would lose its record and keep its
        rows below it (an outside audit). Batches are cut while they are among the diffs
        the first batch found under the bound (up to its ``horizon``); the rest goes in
        one batch, so that a pass ends beside a writer that never pauses."""
        started = perf_counter()
        state = self._store.state
        executed = state.gc_executed
        # The commit pointer as the pass found it: the shard's writers write above it
        # (a commit may move it up meanwhile, over what they wrote between batches).
        pointer = state.pointers.get(task.shard)
        floor = None if pointer is None else pointer.key
        messages = dict.fromkeys(task.partitions, 0)
        diffs = 0
        ranges: list[tuple[Table, bytes, bytes]] = []
        found, removed, batch_ranges, newest = self._delete_batch(
            task, None, floor, executed, self._batch_diffs, horizon=True
        )
        horizon = task.bound if newest is None else newest
        while True:
            # Counted once its batch is written: a pass that close() interrupts later (in
            # its next batch, or in compaction) has removed these rows all the same, and
            # its retry after the next open finds nothing left to count.
            self._metrics.inc("messages_deleted", sum(removed.values()))
            for p, n in removed.items():
                messages[p] += n
            diffs += len(found.seqnos)
            ranges.extend(batch_ranges)
            if found.last == task.bound:
                break
            if self.stopping.is_set():
                raise QueueClosedError("the queue is closing")
            limit = self._batch_diffs if found.last < horizon else None
            found, removed, batch_ranges, _ = self._delete_batch(
                task, found.last, floor, executed, limit
            )
        return _Deleted(task, messages, diffs, perf_counter() - started), union(ranges)

    def _delete_batch(
        self,
        task: GcTask,
        after: QueueKey | None,
        floor: QueueKey | None,
        executed: GcBounds,
        limit: int | None,
        *,
        horizon: bool = False,
    ) -> tuple[DeletedDiffs, dict[int, int], list[tuple[Table, bytes, bytes]], QueueKey | None]:
        """Delete everything of the task's partitions above ``after`` (the end of the
        batch before; ``None``: from the start) up to the bound, or, when more than
        ``limit`` diffs lie there, up to the end of the first ``limit`` (a shorter
        prefix: ``DeletedDiffs.last``). From the start after all when anything of the
        shard was written at or below ``after`` since, above ``floor`` (the commit
        pointer when the pass began: nothing is written at or below it). Returns what
        was staged, the messages removed per partition, the ranges to compact and, with
        ``horizon`` and a batch that was cut, the ``max_message`` of the last diff under
        the bound as the batch found it (else ``None``)."""
        store = self._store
        if self._unflushed >= _FLUSH_EVERY:
            # Every batch leaves range tombstones in the memtables, and every cursor (each
            # batch's own view included) goes over all of them; in a table file they are
            # gone over once (outside audits: 6,800 batches of one diff took 19 s, each
            # slower than the one before, 2.0-3.1 s with this; a pass over 4,000 shards
            # that hold nothing, one batch each, 3.0 s). Counted across a pass's
            # deletions, and not after the last batch: the small table files of a flush
            # made the next iterators' creation slower than the tombstones did (measured).
            store.flush(_TOMBSTONED)
            self._unflushed = 0
        self._unflushed += 1
        txn = store.transaction()
        with ExitStack() as stack:
            with self._locked(task.shard):
                # Under the shard's mutex nothing writes this shard: the views and the
                # cache all show the shard as the delete finds it.
                if after is None or self._written_at_or_below(task, floor, after):
                    first = QueueKey.MIN
                else:
                    first = after.next_value()  # not MAX: only the bound can be
                r = DeleteRange(task.shard, first, task.bound, frozenset(task.partitions), False)
                tail = tail_rows(r)
                rows = ops.MessageCounter()
                view = stack.enter_context(ops.view(store, tail, rows, diffs=True))
                found = stage_delete(view, tail, txn, r, spans=False, limit=limit)
                last_diff = None
                if horizon and found.last != task.bound:  # cut: where the cuts may go on
                    newest = ops.LastTail(task.shard, first, task.bound)
                    with ops.view(store, newest) as seen:
                        last_diff = seen[newest]
                lows = self._lows(task, first, found.last, executed)
                removed = self._cached_removed(task.shard, lows, found.last)  # before the write
                store.write(txn)
            rest = {p: low for p, low in lows.items() if p not in removed}
            if rest:
                # Counted with the mutex released, in the view taken before the write: it
                # holds every row the write removed, and the shard's writers go on.
                removed.update(self._count_removed(view, view[rows], task.shard, rest, found))
        return found, removed, txn.deleted_ranges, last_diff

    def _written_at_or_below(self, task: GcTask, floor: QueueKey | None, key: QueueKey) -> bool:
        """Whether the shard holds a diff (a tail row) or a message of the task's
        partitions at or below ``key``, where the batches before deleted everything: the
        shard's writers wrote there since (the caller holds the shard's mutex). Only
        above ``floor``, the shard's commit pointer when the pass began: nothing is
        applied at or below a pointer, nor cleared, and a pointer only moves up (so below
        a bound at or under the pointer, as a network's are, nothing is read; the seeks
        run over every batch's tombstones)."""
        low = QueueKey.MIN
        if floor is not None:
            if floor >= key:
                return False
            low = floor.next_value()
        newest = ops.LastTail(task.shard, low, key)
        rows = ops.MessageCounter()
        with ops.view(self._store, newest, rows) as view:
            if view[newest] is not None:
                return True
            counter = view[rows]
            return any(
                counter.count(p, task.shard, low, key, inclusive=True) for p in task.partitions
            )

    @staticmethod
    def _lows(
        task: GcTask, first: QueueKey, last: QueueKey, executed: GcBounds
    ) -> dict[int, QueueKey | None]:
        """Per partition, the first key at which a batch over ``[first, last]`` removes
        rows: above the partition's executed bound and at or above ``first`` (``None``:
        none of the batch's keys lies above that bound)."""
        lows: dict[int, QueueKey | None] = {}
        for p in task.partitions:
            low = _first_above(executed.get((p, task.shard)))
            if low is not None:
                low = max(low, first)
            lows[p] = low if low is not None and low <= last else None
        return lows

    def _cached_removed(
        self, shard: ShardIdent, lows: dict[int, QueueKey | None], last: QueueKey
    ) -> dict[int, int]:
        """The messages a batch up to ``last`` removes in each partition (from its
        ``lows``) whose rows there the store's cache of fresh rows holds every one of (as
        a collector that keeps up with its readers finds them): counted by bisection, no
        row or diff record read. A partition the cache cannot tell is left out, to be
        counted from the view: each partition on its own, since a partition the shard
        never wrote to (the low-priority one, often) has no segment in the cache, and
        counting every partition from RocksDB then read every collected message again
        (a pass every 5 s filled the block cache at about 30 MB a minute)."""
        counts: dict[int, int] = {}
        ranges: list[tuple[int, tuple[bytes, bytes]]] = []
        for p, low in lows.items():
            if low is None:
                counts[p] = 0  # nothing in the batch above the executed bound
            else:
                ranges.append((p, ops.count_range(p, shard, low, last, inclusive=True)))
        cached = self._store.cached_counts([r for _p, r in ranges]) if ranges else []
        for (p, _r), n in zip(ranges, cached, strict=True):
            if n is not None:
                counts[p] = n
        return counts

    @staticmethod
    def _count_removed(
        view: ops.View,
        rows: ops.RowCounter,
        shard: ShardIdent,
        lows: dict[int, QueueKey | None],
        found: DeletedDiffs,
    ) -> dict[int, int]:
        """The messages a batch removed per partition, when the cache could not count
        them all, from ``view`` (taken before the batch was written): the deleted diffs'
        records, plus the gaps between them counted row by row."""
        deleted = diff_spans(view, shard, found.seqnos)
        counts: dict[int, int] = {}
        for p, low in lows.items():
            if low is None:
                counts[p] = 0
                continue
            counted, gaps = _count_plan(p, low, found.last, deleted)
            counts[p] = counted + sum(
                rows.count(p, shard, lo, hi, inclusive=inc) for lo, hi, inc in gaps
            )
        return counts

    def _mark_executed(self, tasks: list[GcTask]) -> None:
        if not tasks:
            return
        executed = dict(self._store.state.gc_executed)
        for task in tasks:
            for partition in task.partitions:
                executed[(partition, task.shard)] = task.bound
        mark = self._store.transaction()
        ops.mark_gc_executed(mark, executed)
        self._store.write(mark)

    def _raise_if_final(self, exc: Exception) -> None:
        """Raise ``exc`` again when no later pass can do better: the queue is closed, or
        a failed write killed the handle. A read's I/O error (a ``StorageError`` too,
        with the handle still usable: too many open files, say) fails the step only, and
        the next pass retries it (D8)."""
        store = self._store
        if isinstance(exc, QueueClosedError) or store.closed or store.dead is not None:
            raise exc

    def _failed(self, tasks: list[GcTask], exc: Exception) -> int:
        n = sum(len(t.partitions) for t in tasks)
        self._metrics.inc("gc_ranges_failed", n)
        for task in tasks:
            for partition in task.partitions:
                self._log.error(
                    "gc_range_failed",
                    partition=partition,
                    shard=str(task.shard),
                    bound=str(task.bound),
                    error=f"{type(exc).__name__}: {exc}",
                )
        return n

    def _report(
        self, deleted: list[_Deleted], failed: int, started: float, compaction: float
    ) -> None:
        executed = sum(len(d.task.partitions) for d in deleted)
        removed = sum(sum(d.messages.values()) for d in deleted)
        self._metrics.inc("gc_ranges_deleted", executed)
        for d in deleted:
            for partition in d.task.partitions:
                self._log.info(
                    "gc_range_deleted",
                    partition=partition,
                    shard=str(d.task.shard),
                    bound=str(d.task.bound),
                    messages=d.messages[partition],
                    diffs=d.diffs,
                    seconds=round(d.seconds, 6),
                )
        self._log.info(
            "gc_pass_finished",
            executed=executed,
            failed=failed,
            messages=removed,
            compaction_seconds=round(compaction, 6),
            seconds=round(perf_counter() - started, 6),
        )

    def _locked(self, shard: ShardIdent) -> _Held:
        """Take the read lock and the shard's mutex, giving up if the queue is stopping."""
        while not self._rw.acquire_read(timeout=_LOCK_POLL):
            if self.stopping.is_set():
                raise QueueClosedError("the queue is closing")
        lock = self._shard_locks.get(shard)
        while not lock.acquire(timeout=_LOCK_POLL):
            if self.stopping.is_set():
                self._rw.release_read()
                raise QueueClosedError("the queue is closing")
        return _Held(lock, self._rw)


class _Held:
    __slots__ = ("_lock", "_rw")

    def __init__(self, lock: threading.Lock, rw: RWLock) -> None:
        self._lock = lock
        self._rw = rw

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        self._rw.release_read()


# Workers whose thread may run at interpreter exit (a queue never closed). Python ends
# daemon threads when they next take the GIL after exit began, and one inside RocksDB (a
# compaction, the GIL released) ended that way aborts the process ("FATAL: exception not
# rethrown", SIGABRT): an exit hook, run before that, stops them as close() does.
_LIVE_WORKERS: weakref.WeakSet[GcWorker] = weakref.WeakSet()


@atexit.register
def _stop_workers_at_exit() -> None:
    for worker in list(_LIVE_WORKERS):
        worker.stop()


class GcWorker:
    """The background thread: a pass at once, then one every ``interval`` seconds."""

    def __init__(self, collector: GarbageCollector, interval: float, log: ImqLogger) -> None:
        self._collector = collector
        self._interval = min(interval, threading.TIMEOUT_MAX)  # what a wait takes
        self._log = log
        self._wake = threading.Event()
        self._progress = threading.Condition()
        self._started = 0
        self._finished = 0
        self._thread = threading.Thread(target=self._loop, name="imq-gc", daemon=True)

    def start(self) -> None:
        _LIVE_WORKERS.add(self)
        self._thread.start()

    @property
    def passes(self) -> int:
        """Passes finished so far."""
        return self._finished

    def _loop(self) -> None:
        stopping = self._collector.stopping
        while not stopping.is_set():
            self._wake.clear()
            with self._progress:
                self._started += 1
            try:
                self._collector.run_pass()
            except QueueClosedError:
                return
            except StorageError as exc:  # the handle is dead: nothing more can be written
                self._log.error("gc_stopped", error=str(exc))
                return
            except Exception as exc:  # never let one error end GC (D8)
                self._log.error("gc_pass_failed", error=f"{type(exc).__name__}: {exc}")
            finally:
                with self._progress:
                    self._finished += 1
                    self._progress.notify_all()
            self._wake.wait(self._interval)

    def tick(self, timeout: float | None = None) -> bool:
        """Run a pass now and wait until a pass that started after this call finished;
        ``False`` on timeout or if the worker has stopped."""
        with self._progress:
            after = self._started
            self._wake.set()
            return (
                self._progress.wait_for(
                    lambda: self._finished > after or not self._thread.is_alive(), timeout
                )
                and self._finished > after
            )

    def signal_stop(self) -> None:
        """Ask the thread to stop after its current step, without waiting for it."""
        self._collector.stopping.set()
        self._wake.set()

    def stop(self) -> None:
        """Stop after the current step; waits for the thread (bounded by one compaction)."""
        self.signal_stop()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
