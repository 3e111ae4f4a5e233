"""Queues on an in-memory store (:class:`imq.storage.memory.MemoryStore`)."""

from __future__ import annotations

from imq.config import QueueConfig
from imq.errors import DatabaseLockedError
from imq.queue import Queue
from imq.storage import Table
from imq.storage.memory import MemoryStore

__all__ = ["MemoryDatabase"]


class MemoryDatabase:
    """One in-memory queue database that outlives the queues opened on it, so a test can
    close and reopen as with a directory. Not thread-safe to open twice at once: like a
    directory's lock, a second open while a queue is open raises ``DatabaseLockedError``.

    >>> db = MemoryDatabase()
    >>> with db.open() as queue:
    ...     queue.get_commit_pointers()
    {}
    """

    def __init__(self) -> None:
        self._store: MemoryStore | None = None

    def open(self, config: QueueConfig | None = None, *, zerostate_seqno: int = 0) -> Queue:
        """Open a queue on this database (``QueueConfig()`` if no config is given)."""
        if self._store is not None and not self._store.closed:
            raise DatabaseLockedError("the in-memory database is already open")
        self._store = MemoryStore(tables=None if self._store is None else self._store.tables)
        return Queue._on_store(self._store, config, zerostate_seqno=zerostate_seqno)

    def rows(self) -> dict[Table, list[tuple[bytes, bytes]]]:
        """Every stored row of every table, in key order."""
        if self._store is None:
            return {t: [] for t in Table}
        return self._store.dump()
