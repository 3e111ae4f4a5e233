"""Locks of the facade (SEMANTICS §4).

A writer-preferring readers/writer lock orders prepares (readers, held until the
pending diff is written or discarded) against commit and clear (writers): once a
writer waits, new readers wait behind it. Per-shard mutexes serialize prepares of one
shard. Neither lock is owned by a thread, so a pending diff may be written from another
thread than the one that prepared it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from imq.types import ShardIdent

__all__ = ["RWLock", "ShardLocks"]


class RWLock:
    __slots__ = ("_cond", "_readers", "_writer", "_writers_waiting")

    def __init__(self) -> None:
        # Re-entrant: a dropped pending diff releases its read lock from ``__del__``, which
        # cyclic GC may run inside one of these sections (imq.pending).
        self._cond = threading.Condition(threading.RLock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    def acquire_read(self, *, jump_queue: bool = False, timeout: float | None = None) -> bool:
        """Take a read lock; ``False`` if ``timeout`` seconds passed first. ``jump_queue``
        lets a caller that already holds one pass a waiting writer (otherwise it would
        wait for a writer that waits for it)."""
        with self._cond:
            if not self._cond.wait_for(
                lambda: not (self._writer or (self._writers_waiting and not jump_queue)),
                timeout,
            ):
                return False
            self._readers += 1
            return True

    def release_read(self) -> None:
        with self._cond:
            if self._readers <= 0:
                raise RuntimeError("release_read without a matching acquire_read")
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    def acquire_write(self) -> None:
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = True

    def release_write(self) -> None:
        with self._cond:
            if not self._writer:
                raise RuntimeError("release_write without a matching acquire_write")
            self._writer = False
            self._cond.notify_all()

    @contextmanager
    def write_locked(self) -> Iterator[None]:
        self.acquire_write()
        try:
            yield
        finally:
            self.release_write()

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
