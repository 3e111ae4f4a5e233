"""Garbage collection (SEMANTICS §7, §8 with D4, D5, D7, D8, D9).

Commits persist the *requested* bound of every (partition, source shard) (D7); the
collector persists the *executed* one. A pass runs every entry whose requested bound is
strictly above its executed bound, grouped by (shard, bound) so one delete batch serves
every partition that shares a bound. For each group:

1. under the facade's read lock and the shard's mutex (so the batch serializes with
   that shard's diff writes and with commit and clear): stage and write the delete of
   everything up to the bound, inclusive;
2. without any facade lock (D9): compact exactly the deleted ranges;
3. only then mark the bound executed, in its own small batch.

A failure at any step is logged (``gc_range_failed``) and the bound stays unexecuted,
so the next tick retries it (D8); deletes are idempotent. Passes never overlap, and the
background worker never dies from one error.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from imq.delete import DeleteRange, stage_delete, tail_scan
from imq.errors import QueueClosedError
from imq.locks import RWLock, ShardLocks
from imq.observability import Metrics
from imq.storage import Store, Table, codec
from imq.storage.codec import GcBounds
from imq.types import QueueKey, ShardIdent

__all__ = ["GarbageCollector", "GcTask", "GcWorker", "due_tasks"]

_LOCK_POLL = 0.05  # seconds between checks of the stop flag while waiting for a lock


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


class GarbageCollector:
    """Runs GC passes; one at a time, from the worker or from ``Queue.run_gc``."""

    def __init__(
        self,
        store: Store,
        rw: RWLock,
        shard_locks: ShardLocks,
        metrics: Metrics,
        log: Any,
        *,
        compact: bool,
    ) -> None:
        self._store = store
        self._rw = rw
        self._shard_locks = shard_locks
        self._metrics = metrics
        self._log = log
        self._compact = compact
        self._pass_lock = threading.Lock()
        self.stopping = threading.Event()

    def run_pass(self) -> int:
        """Run every due deletion; return how many (partition, shard) deletions ran."""
        with self._pass_lock:
            started = perf_counter()
            tasks = due_tasks(self._store.cached("gc_requested"), self._store.cached("gc_executed"))
            done = failed = 0
            for task in tasks:
                if self.stopping.is_set():
                    break
                try:
                    self._run(task)
                except QueueClosedError:
                    raise
                except Exception as exc:
                    failed += len(task.partitions)
                    self._metrics.inc("gc_ranges_failed", len(task.partitions))
                    for partition in task.partitions:
                        self._log.error(
                            "gc_range_failed",
                            partition=partition,
                            shard=str(task.shard),
                            bound=str(task.bound),
                            error=f"{type(exc).__name__}: {exc}",
                        )
                else:
                    done += len(task.partitions)
            if tasks:
                self._log.info(
                    "gc_pass_finished",
                    executed=done,
                    failed=failed,
                    seconds=round(perf_counter() - started, 6),
                )
            return done

    def _run(self, task: GcTask) -> None:
        started = perf_counter()
        store = self._store
        r = DeleteRange(task.shard, QueueKey.MIN, task.bound, frozenset(task.partitions), False)
        txn = store.transaction()
        with self._locked(task.shard):
            with store.snapshot(points=[Table.DIFF_INFO], scans=[tail_scan(r)]) as snap:
                deleted = stage_delete(snap, 0, txn, r)
            store.write(txn)
        if self._compact:
            store.compact(txn.deleted_ranges)
        executed = dict(store.cached("gc_executed"))
        for partition in task.partitions:
            executed[(partition, task.shard)] = task.bound
        mark = store.transaction()
        mark.put(Table.VARS, codec.GC_EXECUTED, codec.gc_bounds_value(executed))
        mark.publish("gc_executed", executed)
        store.write(mark)
        seconds = round(perf_counter() - started, 6)
        self._metrics.inc("gc_ranges_deleted", len(task.partitions))
        self._metrics.inc("messages_deleted", deleted.total_messages)
        for partition in task.partitions:
            self._log.info(
                "gc_range_deleted",
                partition=partition,
                shard=str(task.shard),
                bound=str(task.bound),
                messages=deleted.messages.get(partition, 0),
                diffs=len(deleted.seqnos),
                seconds=seconds,
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


class GcWorker:
    """The background thread: a pass at once, then one every ``interval`` seconds."""

    def __init__(self, collector: GarbageCollector, interval: float, log: Any) -> None:
        self._collector = collector
        self._interval = interval
        self._log = log
        self._wake = threading.Event()
        self._progress = threading.Condition()
        self._started = 0
        self._finished = 0
        self._thread = threading.Thread(target=self._loop, name="imq-gc", daemon=True)

    def start(self) -> None:
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

    def stop(self) -> None:
        """Stop after the current step; waits for the thread (bounded by one compaction)."""
        self._collector.stopping.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
