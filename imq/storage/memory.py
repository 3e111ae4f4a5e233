"""An in-memory store: the six tables as sorted dicts, behind the same interface as the
RocksDB store (:class:`imq.storage.backend.StoreProtocol`).

The queue's rows are built only in :mod:`imq.storage.ops` and :mod:`imq.storage.codec`,
so this store holds the very bytes RocksDB would; what it replaces is the engine: a
``WriteBatch`` becomes a list of operations applied under one lock, a snapshot copies
the rows it may read. It is meant for tests (thousands of operations a second, no
directory) and as the second implementation that keeps the interface honest, not for
large queues: a snapshot costs time linear in the rows its cursors cover.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from imq.errors import ImqError, QueueClosedError, StorageError
from imq.storage import codec
from imq.storage.backend import Closable, TransactionProtocol
from imq.storage.queue_state import QueueState, StateUpdate
from imq.storage.rocks import Scan
from imq.storage.tables import Table
from imq.storage.tops import DiffTop, DiffTops
from imq.types import ShardIdent

__all__ = ["MemoryCursor", "MemorySnapshot", "MemoryStore", "MemoryTransaction"]

_Op = tuple[str, Table, bytes, bytes]  # ("put" | "delete" | "delete_range", table, a, b)


class MemoryCursor:
    """The rows of one scan, copied when its snapshot was opened."""

    dropped = 0  # a memory store leaves no row out

    __slots__ = ("_bounds", "_keys", "items", "rows")

    def __init__(
        self,
        rows: list[Any],
        keys: list[bytes] | None = None,
        bounds: tuple[bytes, bytes | None] = (b"", None),
    ) -> None:
        self.items: Iterator[Any] = iter(rows)
        self.rows = self.items  # copied rows cannot end early: no end check
        self._keys = keys  # every key of the table, for count and last (a seekable scan)
        self._bounds = bounds  # the scan's [lo, hi)

    def __iter__(self) -> Iterator[Any]:
        return self.items

    def finish(self, last_key: bytes | None) -> None:
        """Nothing to check: the rows were copied whole."""

    def last(self) -> bytes | None:
        lo, hi = self._bounds
        if self._keys is None or hi is None:
            raise ValueError("last needs a seekable cursor with an upper bound")
        i = bisect.bisect_left(self._keys, hi) - 1
        return self._keys[i] if i >= 0 and self._keys[i] >= lo else None

    def count(self, lo: bytes, hi: bytes) -> int:
        if self._keys is None:
            raise ValueError("count needs a seekable cursor")
        if hi <= lo:
            return 0
        return bisect.bisect_left(self._keys, hi) - bisect.bisect_left(self._keys, lo)

    def close(self) -> None:
        self.items = self.rows = iter(())
        self._keys = None


class MemorySnapshot:
    """A consistent view: the point tables and cursor rows copied at one instant."""

    __slots__ = ("_closed", "_points", "cursors", "state")

    def __init__(
        self,
        points: dict[Table, dict[bytes, bytes]],
        cursors: list[MemoryCursor],
        state: QueueState,
    ) -> None:
        self._points = points
        self.cursors = cursors
        self.state = state
        self._closed = False

    def get(self, table: Table, key: bytes) -> bytes | None:
        try:
            rows = self._points[table]
        except KeyError:
            raise ImqError(f"snapshot was not opened for point reads on {table.value}") from None
        return rows.get(key)

    def check_usable(self) -> None:
        """Always usable: an in-memory store belongs to every process that has it."""

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for cursor in self.cursors:
                cursor.close()
            self._points.clear()

    def __enter__(self) -> MemorySnapshot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class MemoryTransaction:
    """Operations staged for one atomic write, and the state updates it publishes."""

    __slots__ = ("deleted_ranges", "diff_tops", "diffs_blind", "ops", "state_updates")

    def __init__(self) -> None:
        self.ops: list[_Op] = []
        self.state_updates: list[StateUpdate] = []
        self.deleted_ranges: list[tuple[Table, bytes, bytes]] = []
        self.diff_tops: list[tuple[ShardIdent, DiffTop]] = []
        self.diffs_blind = False

    def put(self, table: Table, key: bytes, value: bytes) -> None:
        self.diffs_blind |= table is Table.DIFF_INFO
        self.ops.append(("put", table, key, value))

    def put_diff_record(self, shard: ShardIdent, top: DiffTop) -> None:
        self.ops.append(("put", Table.DIFF_INFO, top.key, top.record))
        self.diff_tops.append((shard, top))

    def _put(self, key: bytes, value: bytes, table: Table) -> None:
        self.ops.append(("put", table, key, value))

    @contextlib.contextmanager
    def writer(
        self, table: Table, *, cached: bool = True
    ) -> Iterator[tuple[Callable[[bytes, bytes, Any], object], Any]]:
        self.diffs_blind |= table is Table.DIFF_INFO
        yield self._put, table

    def delete(self, table: Table, key: bytes) -> None:
        self.diffs_blind |= table is Table.DIFF_INFO
        self.ops.append(("delete", table, key, b""))

    def delete_range(self, table: Table, lo: bytes, hi: bytes) -> None:
        if lo < hi:
            self.diffs_blind |= table is Table.DIFF_INFO
            self.ops.append(("delete_range", table, lo, hi))
            self.deleted_ranges.append((table, lo, hi))

    def compact_after(self, table: Table, lo: bytes, hi: bytes) -> None:
        if lo < hi:
            self.deleted_ranges.append((table, lo, hi))

    def publish(self, update: StateUpdate) -> None:
        self.state_updates.append(update)

    def __len__(self) -> int:
        return len(self.ops)


class MemoryStore:
    """The six tables in memory. ``tables`` (another store's :attr:`tables`, after it
    closed) reopens what that store held; ``path`` only names the store in logs."""

    def __init__(
        self, path: str = ":memory:", *, tables: dict[Table, dict[bytes, bytes]] | None = None
    ) -> None:
        self.path = Path(path)
        self.read_only = False
        self.tables: dict[Table, dict[bytes, bytes]] = (
            {t: {} for t in Table} if tables is None else tables
        )
        self._tables = self.tables
        self._sorted: dict[Table, list[bytes] | None] = {t: None for t in Table}
        self._gate = threading.Lock()
        self._state = QueueState()
        self._resources: weakref.WeakSet[Any] = weakref.WeakSet()
        self._closed = False
        self._importing = 0
        self.diff_tops = DiffTops()
        self._tables[Table.VARS].setdefault(
            codec.SCHEMA_VERSION_KEY, codec.u32_value(codec.SCHEMA_VERSION)
        )

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def state(self) -> QueueState:
        return self._state

    @property
    def dead(self) -> StorageError | None:
        """Always ``None``: memory has no I/O to fail."""
        return None

    @property
    def forked(self) -> bool:
        """Always ``False``: a forked child's copy of memory is its own."""
        return False

    @property
    def importing_now(self) -> bool:
        return self._importing > 0

    @contextlib.contextmanager
    def importing(self) -> Iterator[None]:
        """Counts the imports under way (no other process can see memory)."""
        self._importing += 1
        try:
            yield
        finally:
            self._importing -= 1

    def set_state(self, state: QueueState) -> None:
        with self._gate:
            self._state = state

    def _check_open(self) -> None:
        if self._closed:
            raise QueueClosedError(f"queue database {self.path} is closed")

    def _keys(self, table: Table) -> list[bytes]:
        keys = self._sorted[table]
        if keys is None:
            keys = self._sorted[table] = sorted(self._tables[table])
        return keys

    # -- reads --------------------------------------------------------------------------------

    def _cursor(self, scan: Scan) -> MemoryCursor:
        keys = self._keys(scan.table)
        if scan.seekable:  # the sorted keys are replaced on a write, never changed: shared
            return MemoryCursor([], keys, (scan.lo, scan.hi))
        start = bisect.bisect_left(keys, scan.lo)
        end = len(keys) if scan.hi is None else bisect.bisect_left(keys, scan.hi)
        if scan.reverse and scan.hi is None:
            raise ValueError("a reverse scan needs an upper bound")
        selected = keys[start:end]
        if scan.reverse:
            selected.reverse()
        if scan.keys_only:
            return MemoryCursor(list(selected))
        rows = self._tables[scan.table]
        return MemoryCursor([(k, rows[k]) for k in selected])

    def cached_counts(self, ranges: Sequence[tuple[bytes, bytes]]) -> list[int | None]:
        """No cache in front of these tables: ``None`` for every range."""
        self._check_open()
        return [None] * len(ranges)

    def message_cache_stats(self) -> dict[str, int]:
        return {}  # no cache of fresh rows: the rows are in memory already

    def message_snapshot(
        self, bounds: Sequence[tuple[bytes, bytes]], reader: tuple[int, int, int] | None
    ) -> MemorySnapshot:
        return self.snapshot(scans=[Scan(Table.MESSAGES, lo, hi) for lo, hi in bounds])

    def snapshot(self, points: Iterable[Table] = (), scans: Sequence[Scan] = ()) -> MemorySnapshot:
        with self._gate:
            self._check_open()
            copies = {t: dict(self._tables[t]) for t in points}
            cursors = [self._cursor(s) for s in scans]
            state = self._state
        return MemorySnapshot(copies, cursors, state)

    def load_table(self, table: Table) -> list[tuple[bytes, bytes]]:
        with self._gate:
            self._check_open()
            rows = self._tables[table]
            return [(k, rows[k]) for k in self._keys(table)]

    def get_latest(self, table: Table, key: bytes) -> bytes | None:
        self._check_open()
        return self._tables[table].get(key)

    def register(self, resource: Closable) -> None:
        self._resources.add(resource)

    # -- writes -------------------------------------------------------------------------------

    def transaction(self) -> MemoryTransaction:
        self._check_open()
        return MemoryTransaction()

    def write(self, txn: TransactionProtocol, *, sync: bool = False) -> None:
        if not isinstance(txn, MemoryTransaction):
            raise TypeError(f"a memory store writes MemoryTransaction, not {type(txn).__name__}")
        with self._gate:
            self._check_open()
            for op, table, a, b in txn.ops:
                rows = self._tables[table]
                if op == "put":
                    if a not in rows:
                        self._sorted[table] = None
                    rows[a] = b
                elif op == "delete":
                    if rows.pop(a, None) is not None:
                        self._sorted[table] = None
                else:
                    keys = self._keys(table)
                    doomed = keys[bisect.bisect_left(keys, a) : bisect.bisect_left(keys, b)]
                    for key in doomed:
                        del rows[key]
                    if doomed:
                        self._sorted[table] = None
            self.diff_tops.after_write(txn.diffs_blind, txn.diff_tops)
            state = self._state
            for update in txn.state_updates:
                state = update(state)
            self._state = state

    # -- maintenance: nothing to reclaim ------------------------------------------------------

    def compact(self, ranges: Iterable[tuple[Table, bytes, bytes]]) -> None:
        self._check_open()

    def compact_all(self, progress: Callable[[int, int], object] | None = None) -> None:
        tables = list(Table)
        for done, _ in enumerate(tables, start=1):
            self._check_open()
            if progress is not None:
                progress(done, len(tables))

    def flush(self, tables: Iterable[Table]) -> None:
        self._check_open()

    def dump(self) -> dict[Table, list[tuple[bytes, bytes]]]:
        """Every row of every table, in key order."""
        with self._gate:
            return {t: [(k, self._tables[t][k]) for k in self._keys(t)] for t in Table}

    def property_int(self, table: Table, name: str) -> int:
        """No engine below: no files, no levels."""
        self._check_open()
        return 0

    def disk_usage(self) -> int:
        """The bytes of every stored key and value."""
        return sum(len(k) + len(v) for rows in self._tables.values() for k, v in rows.items())

    def close(self) -> str | None:
        with self._gate:
            if self._closed:
                return None
            self._closed = True
            self.diff_tops.forget()
            resources = list(self._resources)
        for resource in resources:
            resource.close_for_queue()
        return None
