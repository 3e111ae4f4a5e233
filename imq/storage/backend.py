"""What a store must offer the queue: the interface RocksDB (:mod:`imq.storage.rocks`)
and memory (:mod:`imq.storage.memory`) both implement.

It sits one level below :mod:`imq.storage.ops`: raw rows of the six tables, atomic
transactions, consistent snapshots and the published :class:`QueueState`. The domain
never calls it for rows; it passes a backend to the named operations of ``ops``, which
hold every byte layout, so both backends store the same bytes by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from imq.errors import StorageError
from imq.storage.queue_state import QueueState, StateUpdate
from imq.storage.tables import Table
from imq.storage.tops import DiffTop, DiffTops
from imq.types import ShardIdent

if TYPE_CHECKING:
    from imq.storage.rocks import Scan

__all__ = [
    "Closable",
    "CursorProtocol",
    "SnapshotProtocol",
    "StoreProtocol",
    "TransactionProtocol",
]


class Closable(Protocol):
    def close_for_queue(self) -> None: ...


class CursorProtocol(Protocol):
    """A bounded range of one table, opened with its snapshot. Iterating yields
    ``(key, value)`` pairs (keys only for a ``keys_only`` scan); ``items`` is the same
    iterator, for a consumer that pulls rows in bulk. ``rows`` yields the same rows
    without checking, when they run out, that the scan reached the range's end; a
    consumer of ``rows`` calls ``finish(last_key)`` then, which raises if it did not
    (use ``items`` or ``rows``, not both). ``dropped``: rows a scan with a ``reader``
    left out of ``rows`` because the merge would skip them unseen (a cached scan's)."""

    rows: Iterator[Any]

    @property
    def dropped(self) -> int: ...

    @property
    def items(self) -> Iterator[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...

    def finish(self, last_key: bytes | None) -> None: ...

    def count(self, lo: bytes, hi: bytes) -> int: ...

    def last(self) -> bytes | None:
        """The greatest key of the scan's range, or ``None`` (a seekable scan with an
        upper bound)."""

    def close(self) -> str | None:
        """Close (idempotent); what went wrong while closing, if anything."""


class SnapshotProtocol(Protocol):
    """A consistent read view: point reads, the cursors declared at creation (in their
    order), and the queue state of that instant."""

    @property
    def state(self) -> QueueState: ...

    @property
    def cursors(self) -> Sequence[CursorProtocol]: ...

    def get(self, table: Table, key: bytes) -> bytes | None: ...

    def check_usable(self) -> None:
        """Raise what every call on the store raises once it cannot be used any more in
        this process (a forked child); else nothing. The merge asks before each batch."""

    def close(self) -> str | None:
        """Close (idempotent); what went wrong while closing, if anything."""

    def __enter__(self) -> SnapshotProtocol: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class TransactionProtocol(Protocol):
    """Rows staged for one atomic write, and the queue-state updates it publishes."""

    @property
    def deleted_ranges(self) -> list[tuple[Table, bytes, bytes]]: ...

    def put(self, table: Table, key: bytes, value: bytes) -> None: ...

    def put_diff_record(self, shard: ShardIdent, top: DiffTop) -> None:
        """Put an applied diff's record (``top.key`` -> ``top.record``): the one put the
        store's :attr:`StoreProtocol.diff_tops` follows (any other change to the diff
        records makes it forget every shard)."""

    def writer(
        self, table: Table, *, cached: bool = True
    ) -> AbstractContextManager[tuple[Callable[[bytes, bytes, Any], object], Any]]:
        """``with txn.writer(table) as (put, target)``: ``put(key, value, target)`` adds a
        row to ``table``, for hot loops; no other row may be staged inside the block.
        ``cached=False``: a bulk write whose message rows a store's cache of fresh rows
        should not take (it forgets what it holds instead)."""

    def delete(self, table: Table, key: bytes) -> None: ...

    def delete_range(self, table: Table, lo: bytes, hi: bytes) -> None: ...

    def compact_after(self, table: Table, lo: bytes, hi: bytes) -> None: ...

    def publish(self, update: StateUpdate) -> None: ...


class StoreProtocol(Protocol):
    """A queue's storage: tables, transactions, snapshots, the queue state."""

    @property
    def path(self) -> Path: ...

    @property
    def read_only(self) -> bool: ...

    @property
    def closed(self) -> bool: ...

    @property
    def state(self) -> QueueState: ...

    @property
    def dead(self) -> StorageError | None:
        """The error that killed the handle (a failed write), or ``None``."""

    @property
    def forked(self) -> bool:
        """Whether this process was forked from the one that opened the store (every
        call refused; ``close`` takes no lock)."""

    @property
    def importing_now(self) -> bool:
        """Whether an import of this handle is inside :meth:`importing`."""

    def importing(self) -> AbstractContextManager[None]:
        """Held by an import from before its marker is written until it finished, rolled
        back or failed: what tells an import under way from one a crash left."""
        ...

    @property
    def diff_tops(self) -> DiffTops:
        """Each shard's highest stored diff, as this store's writes left it
        (:mod:`imq.storage.tops`)."""

    def set_state(self, state: QueueState) -> None: ...

    def snapshot(
        self, points: Iterable[Table] = (), scans: Sequence[Scan] = ()
    ) -> SnapshotProtocol: ...

    def cached_counts(self, ranges: Sequence[tuple[bytes, bytes]]) -> list[int | None]:
        """For each ``(lo, hi)`` (inside one segment), the message rows with
        ``lo <= key < hi`` when a cache of fresh rows holds them all; ``None`` when they
        must be counted in the tables."""
        ...

    def message_cache_stats(self) -> dict[str, int]:
        """What the store's cache of fresh message rows holds and served (empty when the
        store has none)."""
        ...

    def message_snapshot(
        self, bounds: Sequence[tuple[bytes, bytes]], reader: tuple[int, int, int] | None
    ) -> SnapshotProtocol:
        """``snapshot`` with one forward scan of the messages table per ``[lo, hi)`` of
        ``bounds`` (each inside one segment), for the merge iterator whose destination
        test is ``reader`` (see :class:`Scan`)."""
        ...

    def transaction(self) -> TransactionProtocol: ...

    def write(self, txn: TransactionProtocol, *, sync: bool = False) -> None: ...

    def load_table(self, table: Table) -> list[tuple[bytes, bytes]]: ...

    def get_latest(self, table: Table, key: bytes) -> bytes | None: ...

    def register(self, resource: Closable) -> None: ...

    def compact(self, ranges: Iterable[tuple[Table, bytes, bytes]]) -> None: ...

    def compact_all(self, progress: Callable[[int, int], object] | None = None) -> None: ...

    def flush(self, tables: Iterable[Table]) -> None: ...

    def property_int(self, table: Table, name: str) -> int:
        """An engine property of one table (RocksDB's names); 0 where it has none."""
        ...

    def disk_usage(self) -> int: ...

    def close(self) -> str | None:
        """Close (idempotent); what went wrong while closing, if anything."""
