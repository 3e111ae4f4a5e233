"""Locks of the facade (SEMANTICS §4).

A writer-preferring readers/writer lock orders prepares (readers, held until the
pending diff is written or discarded) against commit and clear (writers): once a
writer waits, new readers wait behind it. Per-shard mutexes serialize prepares of one
shard. Neither lock is owned by a thread, so a pending diff may be written from another
thread than the one that prepared it.

The write lock remembers the thread that holds it, only so that a call from that thread
which would wait for it (a write call from ``import_state``'s progress callback, which
runs under the write lock) is refused with ``ImqError`` instead of hanging.

A wait the locks cannot refuse (a thread that was handed a pending diff and commits
before writing it waits for itself) is reported instead: a waiting call given a
:class:`LongWait` makes its report once, ``STUCK_AFTER`` seconds after the call began,
and goes on waiting. The report is made with the condition released: it may take other
locks (the pending registry's, the host's logging handlers'), and the registry's mutex
may be held by a thread that is about to release a read lock (a dropped pending diff,
collected inside a registry section).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from imq.errors import ImqError
from imq.types import ShardIdent

__all__ = ["LongWait", "RWLock", "ShardLocks", "STUCK_AFTER"]

# Seconds a call waits for the locks before its wait is reported (once). A prepare,
# commit or clear normally waits milliseconds: for the pending diffs collated beside it.
STUCK_AFTER = 10.0


class LongWait:
    """One call's wait for the queue's locks, reported once: ``report(waited)`` is made
    the first time a wait finds ``STUCK_AFTER`` seconds gone since the call began (the
    call goes on waiting). One object a call, shared by every lock the call waits for,
    so that a call reports once and says how long it has waited in all."""

    __slots__ = ("_report", "_started")

    def __init__(self, report: Callable[[float], None]) -> None:
        self._report: Callable[[float], None] | None = report
        self._started = time.monotonic()

    def left(self) -> float | None:
        """Seconds until the report is due (0 once it is), ``None`` once it was made."""
        if self._report is None:
            return None
        return max(0.0, STUCK_AFTER - (time.monotonic() - self._started))

    def report_if_due(self) -> None:
        """Make the report if it is due and not made yet. The report may take other
        locks: call it holding none of the queue's."""
        report = self._report
        if report is not None:
            waited = time.monotonic() - self._started
            if waited >= STUCK_AFTER:
                self._report = None
                report(waited)


class RWLock:
    __slots__ = ("_closed", "_cond", "_owner", "_readers", "_writer", "_writers_waiting")

    # A waiting writer re-checks at least this often (seconds). Its wakeup can be lost:
    # a dropped pending diff's ``__del__`` may release the last read lock from inside the
    # writer's own ``Condition.wait`` (cyclic GC runs at the allocation of the waiter's
    # lock), notifying before the waiter is registered.
    _WRITER_RECHECK = 0.05

    def __init__(self) -> None:
        # Re-entrant: a dropped pending diff releases its read lock from ``__del__``, which
        # cyclic GC may run inside one of these sections (imq.pending).
        self._cond = threading.Condition(threading.RLock())
        self._readers = 0
        self._writer = False
        self._owner: threading.Thread | None = None  # the thread holding the write lock
        self._writers_waiting = 0
        # Set by close(): what a call waiting for a lock then raises instead of waiting on.
        self._closed: Callable[[], BaseException] | None = None

    def close(self, error: Callable[[], BaseException]) -> None:
        """The queue closed: every call waiting for this lock, or for a shard's mutex
        (:meth:`check_closed`), stops waiting and raises ``error()``; so does every later
        wait. Held locks are released as usual."""
        with self._cond:
            self._closed = error
            self._cond.notify_all()

    def check_closed(self) -> None:
        closed = self._closed
        if closed is not None:
            raise closed()

    def _refuse_self_deadlock(self, what: str) -> None:
        """Under ``_cond``: raise if this thread holds the write lock (it would wait for
        itself forever)."""
        if self._writer and self._owner is threading.current_thread():
            raise ImqError(
                f"{what} would deadlock: this thread holds the queue's write lock (it is "
                "inside commit_diff, clear_uncommitted_state or import_state, e.g. in "
                "import_state's progress callback); make the call after that one returns"
            )

    def acquire_read(
        self,
        *,
        jump_queue: bool = False,
        timeout: float | None = None,
        on_stuck: LongWait | None = None,
    ) -> bool:
        """Take a read lock; ``False`` if ``timeout`` seconds passed first. ``jump_queue``
        lets a caller that already holds one pass a waiting writer (otherwise it would
        wait for a writer that waits for it). ``ImqError`` if this thread holds the write
        lock. ``on_stuck`` (with no ``timeout``): its report, when due, is made with the
        condition released."""

        def free() -> bool:
            return self._closed is not None or not (
                self._writer or (self._writers_waiting and not jump_queue)
            )

        with self._cond:
            self._refuse_self_deadlock("taking the queue's read lock")
            if on_stuck is not None and timeout is None:
                left = on_stuck.left()
                if left is not None and not self._cond.wait_for(free, left):
                    self._report(on_stuck)
            got = self._cond.wait_for(free, timeout)
            self.check_closed()
            if not got:
                return False
            self._readers += 1
            return True

    def _report(self, on_stuck: LongWait) -> None:
        """Under ``_cond`` (held once, by this waiting call): make ``on_stuck``'s report
        with it released, then take it again (the caller's wait re-checks the state)."""
        self._cond.release()
        try:
            on_stuck.report_if_due()
        finally:
            self._cond.acquire()

    def release_read(self) -> None:
        with self._cond:
            if self._readers <= 0:
                raise RuntimeError("release_read without a matching acquire_read")
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    def acquire_write(self, on_stuck: LongWait | None = None) -> None:
        """Take the write lock; ``ImqError`` if this thread holds it already.
        ``on_stuck``: its report, when due, is made with the condition released."""
        with self._cond:
            self._refuse_self_deadlock("taking the queue's write lock")
            self._writers_waiting += 1
            acquired = False
            try:
                while self._writer or self._readers:
                    self.check_closed()
                    self._cond.wait(self._WRITER_RECHECK)
                    if on_stuck is not None and on_stuck.left() == 0.0:
                        self._report(on_stuck)
                self.check_closed()
                acquired = True
            finally:
                self._writers_waiting -= 1
                if not acquired and not self._writers_waiting:
                    # Left by an exception (KeyboardInterrupt): readers that queued
                    # behind this writer wait for a notification nobody else sends.
                    self._cond.notify_all()
            self._writer = True
            self._owner = threading.current_thread()

    def release_write(self) -> None:
        with self._cond:
            if not self._writer:
                raise RuntimeError("release_write without a matching acquire_write")
            self._writer = False
            self._owner = None
            self._cond.notify_all()

    @contextmanager
    def write_locked(self, on_stuck: LongWait | None = None) -> Iterator[None]:
        self.acquire_write(on_stuck)
        try:
            yield
        finally:
            self.release_write()

    def write_held_here(self) -> bool:
        """Whether the calling thread holds the write lock (for a facade call that must
        be refused there before it takes another lock, such as GC's pass lock)."""
        with self._cond:
            return self._writer and self._owner is threading.current_thread()

    def writer_name(self) -> str | None:
        """The name of the thread holding the write lock (a commit, clear or import), or
        ``None``: for a report of a long wait (read without the condition)."""
        owner = self._owner
        return None if owner is None else owner.name

    @property
    def readers(self) -> int:
        return self._readers


class ShardLocks:
    """One mutex per shard, created on first use."""

    __slots__ = ("_guard", "_locks")

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[ShardIdent, threading.Lock] = {}

    def get(self, shard: ShardIdent) -> threading.Lock:
        with self._guard:
            lock = self._locks.get(shard)
            if lock is None:
                lock = self._locks[shard] = threading.Lock()
            return lock
