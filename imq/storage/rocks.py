"""The RocksDB store: open and lock, atomic writes, consistent reads.

Consistency without working snapshots. rocksdict 0.3.29 ignores a snapshot when
iterating it, and a ``ReadOptions`` cannot carry one. What does hold: a plain iterator
is an implicit snapshot taken when it is created, and ``snapshot[key]`` is consistent.
So every write goes through one mutex (the *gate*), and a :class:`Snapshot` opens, under
that same gate, the per-table point snapshots and every cursor its read call will use.
All of them then see the same sequence number: one consistent view across tables (D12).
The gate also publishes the queue's in-memory state (:class:`QueueState`: commit
pointers etc., D14) in step with the write that changed it.

Bounds. ``set_iterate_lower_bound`` is broken (it sets the upper bound), so cursors
seek to their lower bound instead; and a bound is a dangling pointer once its ``bytes``
object dies, so each :class:`Cursor` keeps its bound and ``ReadOptions`` alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import random
import re
import shutil
import stat
import threading
import time
import traceback
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain, filterfalse, islice
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, NoReturn, Protocol, cast

from rocksdict import (
    AccessType,
    BottommostLevelCompaction,
    Cache,
    CompactOptions,
    DBRecoveryMode,
    Options,
    Rdict,
    ReadOptions,
    WriteBatch,
    WriteOptions,
)

from imq._files import sync_directory
from imq.errors import (
    CorruptDataError,
    DatabaseLockedError,
    FileAccessError,
    ImqError,
    QueueClosedError,
    ReadOnlyError,
    SchemaVersionError,
    StorageError,
)
from imq.storage import codec, shadow, wal
from imq.storage.backend import CursorProtocol, TransactionProtocol
from imq.storage.cache import MessageCache, Row, Tee
from imq.storage.queue_state import QueueState, StateUpdate
from imq.storage.tables import TABLES, StoreOptions, Table, table_options
from imq.storage.tops import DiffTop, DiffTops
from imq.types import ShardIdent

__all__ = [
    "GONE_SINCE_OPEN",
    "drop_frame_locals",
    "DATABASE_FILE",
    "Closable",
    "Cursor",
    "Scan",
    "Snapshot",
    "Store",
    "Transaction",
    "open_rdict",
    "wipe_database",
]

LOCK_FILE = "imq.lock"
# Locked (flock) by an import_state while it writes: readers tell an import under way from
# one a crash left by it (import_lock_held). Created by the first import; empty.
IMPORT_LOCK_FILE = "imq.importing"
# The sequence number of the last write a writer saw synced to the log (rewritten in place
# after each synced write; synced itself at most once per MARK_SYNC_INTERVAL, by a later
# synced write or a timer, and at close):
# an open that recovers less than it finds the log or the MANIFEST cut short or replaced
# (see _check_synced).
SYNCED_FILE = "imq.synced"
# Seconds between two fsyncs of SYNCED_FILE: after a power loss the mark on disk names the
# synced writes up to at most this long before the last one (a synced write that finds the
# mark's last fsync older pays one more, about 0.1 ms here, for at most one write a second).
MARK_SYNC_INTERVAL = 1.0
_SYNCED_MAGIC = b"imqS"
INFO_LOG_FILES = 10  # RocksDB's text logs kept (LOG and LOG.old.*), at most
INFO_LOG_FILE_SIZE = 16 << 20  # bytes; past it the LOG rolls over
MANIFEST_FILE_SIZE = 1 << 20  # bytes; past it RocksDB starts a new MANIFEST
_SEGMENT = codec.MESSAGE_PREFIX_LEN  # a message key's (partition, source shard) prefix


class Closable(Protocol):
    def close_for_queue(self) -> None: ...


class Scan(NamedTuple):
    """A bounded range read: ``[lo, hi)`` of ``table``; ``hi=None`` means to the table's end.
    ``reverse`` reads the same range from its last key down (it needs ``hi``).

    A named tuple, not a frozen dataclass: every iterator builds one per source shard,
    and a tuple is built in a third of the time (0.35 against 1.0 us)."""

    table: Table
    lo: bytes
    hi: bytes | None
    keys_only: bool = False
    reverse: bool = False
    seekable: bool = False  # a raw iterator for Cursor.count over many sub-ranges


def _says_damaged(reason: str) -> bool:
    """Whether RocksDB's error text reports a damaged file (a failed checksum)."""
    return "Corruption" in reason or "checksum" in reason.lower()


def says_disk_full(reason: str) -> bool:
    """Whether RocksDB's error text reports a full disk (or an exhausted quota)."""
    return "No space left" in reason or "Disk quota" in reason


def _read_error(
    path: object, table: Table, key: bytes, exc: BaseException, *, read_only: bool = False
) -> ImqError:
    """The typed error for a failed RocksDB read: a damaged block (``Corruption``) is
    :class:`CorruptDataError`, anything else (an I/O error) :class:`StorageError`."""
    text = shadow.real_names(str(exc))
    if _says_damaged(text):
        return CorruptDataError(table.value, key, f"RocksDB could not read the table: {text}")
    # A read-only view's file gone while a writer holds the directory: that writer's
    # compaction, not damage (with no writer, the directory was changed outside imq).
    outdated = read_only and "No such file" in text and writer_holds_lock(path)
    return StorageError(
        path, f"a read of table {table.value!r}", text, hint=_read_hint(text, outdated)
    )


def from_rocksdict(exc: BaseException) -> bool:
    """Whether ``exc`` is one rocksdict raises for RocksDB (a bare ``Exception`` with
    RocksDB's status text, or its ``DbClosedError``), not one of the host's that landed
    in the same code (a signal handler's ``TimeoutError``, say)."""
    kind = type(exc)
    return kind is Exception or kind.__module__ == "rocksdict"


def writer_holds_lock(path: object) -> bool:
    """Whether a writer (of any process, this one included) holds the directory's lock
    now; False when that cannot be told (see :func:`_flock_held`). Probed where
    ``/proc/locks`` does not list it, as :func:`import_lock_held`: a writer in another
    container is seen too."""
    return isinstance(path, Path) and _flock_held(path / LOCK_FILE)


def import_lock_held(path: object) -> bool:
    """Whether an ``import_state`` (of any process, this one included) is writing into
    the queue in ``path`` now: it holds ``IMPORT_LOCK_FILE`` from before its marker is
    written until it finished or rolled back, or failed. False when that cannot be told
    (see :func:`_flock_held`). A lock ``/proc/locks`` does not list is tried as well: it
    lists only the holders in the reader's PID namespace, and an operator's ``imq
    inspect`` in another container than the node's would take a running import for an
    interrupted one (the import retries its lock past such a moment's probe)."""
    return isinstance(path, Path) and _flock_held(path / IMPORT_LOCK_FILE)


def _flock_held(file: Path) -> bool:
    """Whether a process holds a write ``flock`` on ``file`` now. Linux lists every lock
    in ``/proc/locks``, read without touching the lock (only the locks of processes in
    the reader's PID namespace: a holder in another container is not seen); where it
    names none, or elsewhere, a shared lock is tried for a moment (a writer locking
    without retrying in that instant would fail)."""
    try:
        found = os.stat(file)
    except OSError:
        return False  # no lock file: nobody ever took it, or it cannot be seen
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as listing:
            listed = _listed_flock(listing, found)
    except OSError:
        pass
    else:
        if listed:
            return True
    try:
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        # Unlocked before the close: a child forked meanwhile would keep a copy of the
        # descriptor, and with it the lock, for its whole life.
        fcntl.flock(fd, fcntl.LOCK_UN)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


# Seconds an import, and a writer's open, try for their lock past a reader's probe of it
# (a moment's shared lock, which a descheduled reader can stretch to tens of ms on a
# loaded machine); a lock still held then is another writer's: DatabaseLockedError.
_LOCK_RETRY = 0.25


def _flock_retrying(fd: int) -> None:
    """Take an exclusive ``flock`` on ``fd``, trying again for ``_LOCK_RETRY`` seconds
    while it is held: a reader's probe (:func:`_flock_held`) holds a shared lock for a
    moment. ``BlockingIOError`` if it is still held then."""
    deadline = time.monotonic() + _LOCK_RETRY
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.001)
        else:
            return


def _listed_flock(listing: Iterable[str], lock: os.stat_result) -> bool:
    """Whether ``/proc/locks`` lists a write flock on the file ``lock`` describes (its
    lines: ``1: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF``)."""
    device = (os.major(lock.st_dev), os.minor(lock.st_dev), lock.st_ino)
    for line in listing:
        fields = line.split()
        if "->" in fields:  # a waiter's line, "1: -> FLOCK ...": its lock is not held
            continue
        if len(fields) < 6 or fields[1] != "FLOCK" or fields[3] != "WRITE":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == device:
                return True
        except ValueError:
            continue
    return False


# A read-only handle's missing file: the hint imq verify looks for to open again.
GONE_SINCE_OPEN = "a live writer's compaction removed it since this read-only view opened"


def _read_hint(reason: str, outdated: bool = False) -> str:
    """What to do after a read that failed other than on a damaged block (``outdated``:
    a read-only view's file that the live writer removed)."""
    if outdated:
        # A read-only view reads the files listed at its open; a writer beside it goes on
        # compacting and deletes what it replaced. Table files are opened at open, blob
        # files (message bodies of 32 KiB and more) only when first read.
        return (
            f"a file the database listed at this handle's open is missing, and a writer "
            f"holds the directory: most likely {GONE_SINCE_OPEN}; open it again (a view "
            "sees the files as they were at its open)"
        )
    if "No such file" in reason:
        return (
            "a file the database lists is missing (named above): the directory was "
            "changed outside imq; run `imq verify` on it, then restore it from a copy or "
            "rebuild it from a persistent state in a new directory"
        )
    return (
        "the read changed nothing and the handle stays usable: retry; if it fails again, "
        "check the disk and its kernel log, then run `imq verify` on the directory"
    )


def drop_frame_locals(exc: BaseException | None) -> None:
    """Clear the locals of the finished frames in the tracebacks of ``exc`` and of the
    exceptions it was raised in (``__context__``, kept even ``from None``). A read error's
    frames hold RocksDB iterators and snapshots, and a host that keeps the error (a log
    list, a future), or a reference cycle through it, would keep the database, and its
    lock, open after ``close()`` (an outside audit: every reopen refused). The lines of
    the traceback stay."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__context__


class _EndCheck:
    """The last link of a cursor's rows: when they run out, ask RocksDB *why*.

    rocksdict's ``items()``/``keys()`` loops end quietly when RocksDB's iterator turns
    invalid on a damaged block, exactly as they end at the range's end (the only trace is
    the raw iterator's ``status()``). So each cursor opens, at the same instant as its
    rows (the same implicit snapshot), a second raw iterator; when the rows run out, that
    one steps just past the last row read. If it finds another row in range, or its
    status is not OK, the scan ended early and this raises instead of ending. One seek
    per scan end, nothing per row.
    """

    __slots__ = ("_lo", "_path", "_raw", "_read_only", "_reverse", "_table", "seen")

    def __init__(self, raw: Any, scan: Scan, path: object, read_only: bool = False) -> None:
        self._raw = raw
        self._read_only = read_only
        # The last row read, when the rows are iterated through ``Cursor.items``.
        self.seen: deque[Any] | None = None
        self._table = scan.table
        self._lo = scan.lo
        self._reverse = scan.reverse
        self._path = path

    def __iter__(self) -> _EndCheck:
        return self

    def __next__(self) -> NoReturn:
        last = self.seen[0] if self.seen else None
        self.finish(None if last is None else last if isinstance(last, bytes) else last[0])
        raise StopIteration

    def finish(self, last_key: bytes | None) -> None:
        """Check once that the rows ended at the range's end, ``last_key`` being the
        last key read (None: no row was read); later calls do nothing."""
        raw, self._raw = self._raw, None
        if raw is not None:
            try:
                self.check(raw, last_key)
            except BaseException as exc:
                raw = None
                drop_frame_locals(exc)  # check()'s frame holds the RocksDB iterator
                raise

    def check(self, raw: Any, last_key: bytes | None) -> None:
        try:
            if self._reverse:
                if last_key is None:
                    raw.seek_to_last()  # the upper bound applies
                else:
                    raw.seek_for_prev(last_key)
                    if raw.valid() and raw.key() == last_key:
                        raw.prev()
            elif last_key is None:
                raw.seek(self._lo)
            else:
                raw.seek(last_key)
                if raw.valid() and raw.key() == last_key:
                    raw.next()
            if raw.valid():
                found: bytes = raw.key()
                raise CorruptDataError(
                    self._table.value,
                    last_key if last_key is not None else self._lo,
                    f"the scan ended early although key {found.hex()} follows "
                    "(RocksDB's iterator stopped without an error)",
                )
            raw.status()
        except ImqError:
            raise
        except Exception as exc:  # rocksdict raises a bare Exception("Corruption: ...")
            if not from_rocksdict(exc):  # a host's (a signal handler's): passed on as it is
                raise
            key = last_key if last_key is not None else self._lo
            raise _read_error(
                self._path, self._table, key, exc, read_only=self._read_only
            ) from None


class Cursor:
    """One bounded iterator. Keep the cursor object alive while iterating:
    it owns the bound bytes that RocksDB points into.

    ``items`` yields the raw rows (``(key, value)``, or keys with ``keys_only``) and, when
    they run out, checks that RocksDB reached the range's end: a damaged block raises
    :class:`CorruptDataError` naming the table instead of ending the scan early.

    A consumer that tracks the last key it read itself (the merge iterator) may instead
    pull from ``rows``, the bare RocksDB rows (no bookkeeping per row), and must then call
    ``finish(last_key)`` when they run out: the same end check, from that key. Use one of
    the two, never both. For scans other than forward rows, ``rows`` is ``items`` and
    ``finish`` does nothing (``items`` checks the end itself).
    """

    dropped = 0  # rows left out of ``rows`` (a cached scan's; never a RocksDB cursor's)

    __slots__ = (
        "__weakref__",
        "_end",
        "_hi",
        "_items",
        "_lo",
        "_path",
        "_raw",
        "_read_only",
        "_reverse",
        "_ro",
        "_table",
        "rows",
    )

    def __init__(
        self,
        rdict: Any,
        scan: Scan,
        path: object = None,
        *,
        fill_cache: bool = True,
        read_only: bool = False,
    ) -> None:
        self._read_only = read_only  # the handle's: a missing file's hint depends on it
        self._lo = scan.lo
        self._hi = scan.hi
        self._reverse = scan.reverse
        self._table = scan.table
        self._path = path
        self._ro = ReadOptions()
        if not fill_cache:
            self._ro.fill_cache(False)  # type: ignore[call-arg]  # the stub omits its bool
        if scan.hi is not None:
            self._ro.set_iterate_upper_bound(scan.hi)
        self._items: Iterator[Any] | None = iter(())
        self.rows: Iterator[Any] = self._items
        self._end: _EndCheck | None = None
        self._raw: Any = None
        rows: Any = None
        end: _EndCheck | None = None
        try:
            if scan.seekable:
                self._raw = rdict.iter(self._ro)
                return
            if scan.reverse:
                if scan.hi is None:
                    raise ValueError("a reverse scan needs an upper bound")
                # seek_for_prev(hi) under upper bound hi: the last key below hi.
                read = rdict.keys if scan.keys_only else rdict.items
                rows = read(backwards=True, from_key=scan.hi, read_opt=self._ro)
            elif scan.keys_only:
                rows = rdict.keys(from_key=scan.lo, read_opt=self._ro)
            else:
                rows = rdict.items(from_key=scan.lo, read_opt=self._ro)
            # Opened at the same instant as ``rows``: the same implicit snapshot.
            end = _EndCheck(rdict.iter(self._ro), scan, path, read_only)
            if scan.reverse or scan.keys_only:
                self._items = self.rows = self._checked(rows, end)
            else:
                self.rows = rows
                self._end = end
                # ``items`` wraps the rows when first asked for: the merge iterator, which
                # opens most cursors, pulls the bare rows and never needs it.
                self._items = None
        except BaseException:
            # Cut short (a Ctrl-C): a traceback kept by the host holds this frame, and a
            # RocksDB iterator it held would keep the database, and its directory's lock,
            # open after the queue's close(), so that no new open could take them.
            rdict = rows = end = None  # the table object too: it keeps RocksDB open
            self.close()
            raise

    @staticmethod
    def _checked(rows: Iterator[Any], end: _EndCheck) -> Iterator[Any]:
        """``rows``, then ``end``'s check from the last row they yielded."""
        seen: deque[Any] = deque(maxlen=1)
        end.seen = seen
        # filterfalse(seen.append, rows) yields every row (append returns None) and keeps
        # the last one in ``seen``, all in C: no Python frame per row.
        return chain(filterfalse(seen.append, rows), end)

    @property
    def items(self) -> Iterator[Any]:
        """The rows, checked at their end (see the class docstring)."""
        items = self._items
        if items is None:
            assert self._end is not None  # set with ``_items = None``
            items = self._items = self._checked(self.rows, self._end)
        return items

    def finish(self, last_key: bytes | None) -> None:
        """After ``rows`` ran out: raise if the scan ended before the range's end (a
        damaged block), ``last_key`` being the last key read from ``rows`` (None: none)."""
        end = self._end
        if end is not None:
            end.finish(last_key)

    def __iter__(self) -> Iterator[Any]:
        # A generator keeps ``self`` (and so the bounds) alive while the caller iterates.
        if not self._reverse:
            yield from self.items
            return
        lo = self._lo
        for row in self.items:  # no lower bound in RocksDB (rocksdict bug): stop here
            if (row if isinstance(row, bytes) else row[0]) < lo:
                return
            yield row

    def last(self) -> bytes | None:
        """The greatest key of the scan's ``[lo, hi)``, or ``None`` when it holds none (a
        seekable cursor with an upper bound: one seek, one RocksDB iterator)."""
        raw, hi = self._raw, self._hi
        if raw is None or hi is None:
            raise ValueError("last needs a seekable cursor with an upper bound")
        try:
            raw.seek_for_prev(hi)  # the last key below hi: hi is the upper bound
            if raw.valid():
                key: bytes = raw.key()
                return key if key >= self._lo else None
            raw.status()  # no key below hi at all, or a damaged block?
        except Exception as exc:
            raw = None  # a kept error's traceback keeps this frame: no RocksDB iterator in it
            raise _read_error(self._path, self._table, hi, exc, read_only=self._read_only) from None
        return None

    def count(self, lo: bytes, hi: bytes) -> int:
        """Rows in ``[lo, hi)`` (a seekable cursor; one seek per call)."""
        raw = self._raw
        if raw is None:
            raise ValueError("count needs a seekable cursor")
        n = 0
        raw.seek(lo)
        while raw.valid():
            key = raw.key()
            if key >= hi:
                return n
            n += 1
            raw.next()
        try:
            raw.status()
        except Exception as exc:
            raw = None  # a kept error's traceback keeps this frame: no RocksDB iterator in it
            raise _read_error(self._path, self._table, lo, exc, read_only=self._read_only) from None
        return n

    def close(self) -> None:
        self._items = self.rows = iter(())
        self._end = None
        self._raw = None


class Snapshot:
    """A consistent read view: point reads on the tables named at creation, the cursors
    declared at creation, and the queue state as it was at that instant."""

    __slots__ = ("_closed", "_holder", "_points", "_store", "cursors", "state")

    def __init__(
        self,
        store: Store,
        points: dict[Table, Any],
        cursors: list[Cursor | CursorProtocol],
        state: QueueState,
        holder: int | None = None,
    ) -> None:
        self._store = store
        self._points = points
        self.cursors = cursors
        self.state = state
        self._closed = False
        self._holder = holder  # the thread the store counts this view for, if it does

    def get(self, table: Table, key: bytes) -> bytes | None:
        try:
            snap = self._points[table]
        except KeyError:
            raise ImqError(f"snapshot was not opened for point reads on {table.value}") from None
        try:
            value: bytes = snap[key]
        except Exception as exc:  # rocksdict raises a bare Exception("key not found")
            snap = None  # a kept error's traceback keeps this frame: no RocksDB snapshot in it
            if not from_rocksdict(exc):  # the host's (a signal handler's), passed on
                raise
            if str(exc) == "key not found":  # exactly: no I/O error may read as a missing key
                return None
            raise _read_error(
                self._store.path, table, key, exc, read_only=self._store.read_only
            ) from None
        return value

    def check_usable(self) -> None:
        """Raise the store's refusal in a forked child (a snapshot taken before the fork
        would go on reading RocksDB there, whose threads and locks stayed with the
        parent: an outside audit found its iterator still yielding)."""
        store = self._store
        if store._forked and store._dead is not None:
            raise store._dead.again()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                for cursor in self.cursors:
                    cursor.close()
                self._points.clear()
            finally:
                holder, self._holder = self._holder, None
                if holder is not None:
                    self._store.end_view(holder)

    def __enter__(self) -> Snapshot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Transaction:
    """One atomic ``WriteBatch`` across tables, plus the queue-state changes it publishes.

    Single use: :meth:`Store.write` consumes it. The message rows put through
    :meth:`writer` are kept (``kept``, per segment) for the store's cache of fresh rows;
    a batch that changes the messages table in a way the cache cannot follow (rows put
    with ``cached=False``, a point delete, rows put and deleted in one batch) sets
    ``cache_blind`` and the store's cache forgets every segment once it is written.
    """

    __slots__ = (
        "_handles",
        "_keep",
        "_tees",
        "batch",
        "cache_blind",
        "deleted_messages",
        "deleted_ranges",
        "diff_tops",
        "diffs_blind",
        "kept",
        "state_updates",
    )

    def __init__(self, handles: Mapping[Table, Any], *, keep_messages: bool = True) -> None:
        self._handles = handles
        self._keep = keep_messages  # False: the store has no cache to give the rows to
        self.batch = WriteBatch(raw_mode=True)
        self.state_updates: list[StateUpdate] = []
        self.deleted_ranges: list[tuple[Table, bytes, bytes]] = []
        self.kept: dict[bytes, list[bytearray]] = {}  # per segment, a [data, offs] chunk
        self.deleted_messages: list[tuple[bytes, bytes]] = []
        self.cache_blind = False
        # Diff records put by put_diff_record, and whether any other change touched
        # the diff records: what the store's DiffTops follows (imq.storage.tops).
        self.diff_tops: list[tuple[ShardIdent, DiffTop]] = []
        self.diffs_blind = False
        self._tees: list[Any] = []

    def _handle(self, table: Table) -> Any:
        try:
            return self._handles[table]
        except KeyError:  # Store.close dropped the handles while this batch was staged
            raise QueueClosedError(
                "the queue was closed while this write was being staged; nothing was written"
            ) from None

    def put(self, table: Table, key: bytes, value: bytes) -> None:
        if table is Table.MESSAGES:
            self.cache_blind = True
        elif table is Table.DIFF_INFO:
            self.diffs_blind = True
        self.batch.put(key, value, self._handle(table))

    def put_diff_record(self, shard: ShardIdent, top: DiffTop) -> None:
        """Put the diff record ``top`` of ``shard`` (``top.key`` -> ``top.record``); the
        store's :class:`~imq.storage.tops.DiffTops` takes it once the batch is written."""
        self.batch.put(top.key, top.record, self._handle(Table.DIFF_INFO))
        self.diff_tops.append((shard, top))

    def writer(
        self, table: Table, *, cached: bool = True
    ) -> contextlib.AbstractContextManager[tuple[Callable[[bytes, bytes, Any], object], Any]]:
        """``with txn.writer(table) as (put, target)``: ``put(key, value, target)`` adds a
        row to ``table`` in this batch, for hot loops.

        Inside the block ``table`` is the batch's default column family and ``target``
        is ``None``: a put without a column-family handle costs rocksdict about a quarter
        less (64 against 90 ns a row, measured). Every other put of the batch names its
        table. The default is reset on leaving: a batch that holds a column family keeps
        RocksDB open (and its lock held) for as long as the batch lives.

        Message rows are kept for the store's cache (a :class:`~imq._speedups.Tee`
        around the put copies each row into its segment's chunk); ``cached=False`` (a
        bulk import) writes them without keeping them, and the cache forgets every
        segment after the write instead."""
        put: Callable[[bytes, bytes, Any], object] = self.batch.put
        if table is Table.DIFF_INFO:
            self.diffs_blind = True
        if table is Table.MESSAGES and self._keep:
            if cached:
                tee = Tee(put, self.kept, codec.MESSAGE_PREFIX_LEN)
                self._tees.append(tee)
                put = tee
            else:
                self.cache_blind = True
        return self._default_family(self._handle(table), put)

    @property
    def kept_in_order(self) -> bool:
        """Whether each chunk of ``kept`` is strictly ascending (as a diff's rows are)."""
        return not any(tee.unordered for tee in self._tees)

    @property
    def kept_all(self) -> bool:
        """Whether every message row put through :meth:`writer` was kept (a row that is
        not a message row is not: the cache must then forget, as for a blind write)."""
        return not any(tee.invalid for tee in self._tees)

    @contextlib.contextmanager
    def _default_family(
        self, handle: Any, put: Callable[[bytes, bytes, Any], object]
    ) -> Iterator[tuple[Callable[[bytes, bytes, Any], object], Any]]:
        self.batch.set_default_column_family(handle)
        try:
            yield put, None
        finally:
            self.batch.set_default_column_family(None)

    def delete(self, table: Table, key: bytes) -> None:
        if table is Table.MESSAGES:
            self.cache_blind = True
        elif table is Table.DIFF_INFO:
            self.diffs_blind = True
        self.batch.delete(key, self._handle(table))

    def compact_after(self, table: Table, lo: bytes, hi: bytes) -> None:
        """Compact ``[lo, hi)`` after the write (for point deletes spread over a span)."""
        if lo < hi:
            self.deleted_ranges.append((table, lo, hi))

    def delete_range(self, table: Table, lo: bytes, hi: bytes) -> None:
        """Delete ``[lo, hi)``; the range is remembered for compaction after the write."""
        if lo < hi:
            self.batch.delete_range(lo, hi, self._handle(table))
            self.deleted_ranges.append((table, lo, hi))
            if table is Table.DIFF_INFO:
                self.diffs_blind = True
            if table is Table.MESSAGES:
                if self.kept:  # the cache replays deletes before puts: not this order
                    self.cache_blind = True
                self.deleted_messages.append((lo, hi))

    def publish(self, update: StateUpdate) -> None:
        """Apply ``update`` to the queue state once (and only if) the batch is written,
        under the write gate, to the state current then."""
        self.state_updates.append(update)

    def __len__(self) -> int:
        return len(self.batch)

    def size_in_bytes(self) -> int:
        return int(self.batch.size_in_bytes())


# What a queue database directory holds: RocksDB's files (temporary ones included, and
# those a crash during its creation leaves before CURRENT exists), the config rocksdict
# writes, and imq's lock. Anything else is someone else's: never adopted, never deleted.
DATABASE_FILE = re.compile(
    r"CURRENT|IDENTITY|LOCK|LOG(\.old\.\d+)?|(MANIFEST|OPTIONS)-\d+(\.dbtmp)?"
    r"|\d+\.(sst|log|blob|dbtmp)|rocksdict-config\.json|"
    + re.escape(LOCK_FILE)
    + "|"
    + re.escape(SYNCED_FILE)
    + "|"
    + re.escape(IMPORT_LOCK_FILE)
)


_BOOT_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _boot_id() -> str | None:
    """This boot of the machine (Linux: a new random id at every start), or ``None``."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            text = f.read().strip()
    except (OSError, ValueError):
        return None
    return text if _BOOT_ID.fullmatch(text) else None


def _make_directory(path: Path) -> None:
    """Create ``path`` and any missing parents, and sync each new entry into its parent
    directory: RocksDB syncs the files inside, but only this makes the directory itself
    survive a power loss, so a commit that returned cannot vanish with it."""
    missing = []
    at = path
    while not at.exists():
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    path.mkdir(parents=True, exist_ok=True)
    for made in reversed(missing):
        sync_directory(made.parent)


def holds_database_files(names: Iterable[str]) -> bool:
    """Whether a directory's file ``names`` include a RocksDB database's own data files (a
    MANIFEST, table, log or blob files): beside no CURRENT file, a database that lost it,
    or whose deletion was cut short."""
    return any(n.startswith("MANIFEST-") or n.endswith((".sst", ".log", ".blob")) for n in names)


def _synced_record(sequence: int) -> bytes:
    body = _SYNCED_MAGIC + sequence.to_bytes(8, "big")
    return body + zlib.crc32(body).to_bytes(4, "big")


def read_synced_mark(directory: Path) -> int | None:
    """The sequence number ``SYNCED_FILE`` in ``directory`` records, or ``None`` when it
    is missing or unreadable (a torn rewrite after a power loss: no check then)."""
    try:
        data = (directory / SYNCED_FILE).read_bytes()
    except OSError:
        return None
    if (
        len(data) != 16
        or data[:4] != _SYNCED_MAGIC
        or zlib.crc32(data[:12]).to_bytes(4, "big") != data[12:]
    ):
        return None
    return int.from_bytes(data[4:12], "big")


def _check_replaceable(path: Path) -> bool:
    """Whether ``path`` holds a database to delete (``False``: nothing to delete); an
    :class:`ImqError` when it holds anything that is not an imq database's."""
    if not path.exists():
        return False
    if not path.is_dir():
        raise ImqError(f"{path} is a file, not a queue database directory; it is not deleted")
    entries = list(os.scandir(path))
    names = [e.name for e in entries]
    others = sorted(
        e.name
        for e in entries
        if not (DATABASE_FILE.fullmatch(e.name) and e.is_file(follow_symlinks=False))
    )
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise ImqError(
            f"{path} holds other files than a queue database's ({shown}); it is not "
            "deleted: give a new or empty directory, or a queue database's"
        )
    if names and LOCK_FILE not in names:  # imq writes its lock file into every database
        raise ImqError(
            f"{path} holds a RocksDB database that imq did not create; it is not deleted"
        )
    return bool(names)


def wipe_database(path: Path) -> None:
    """Empty ``path`` so that a new queue database can be made there (the demo's, a
    simulation's ``--fresh``). Only a directory that holds nothing but an imq queue
    database's files is emptied, and only under the database's lock: never beside a live
    writer, which holds it (:class:`DatabaseLockedError`). The lock file itself stays, so
    a writer that opens the directory meanwhile still locks the same file."""
    if not _check_replaceable(path):
        return
    lock = path / LOCK_FILE
    try:
        fd = _open_lock_file(lock, os.O_RDWR)
    except OSError as exc:
        raise FileAccessError(lock, "open the lock of queue database", exc) from exc
    try:
        try:
            _flock_retrying(fd)
        except BlockingIOError:
            raise DatabaseLockedError(
                f"queue database {path} is already open (in this or another process); "
                "it is not deleted"
            ) from None
        _check_replaceable(path)  # again, now that no writer can add to it
        # CURRENT first: a wipe cut short then leaves no database RocksDB would open, only
        # files the next open refuses and the next wipe deletes.
        for name in sorted(os.listdir(path), key=lambda n: n != "CURRENT"):
            if name != LOCK_FILE:
                try:
                    (path / name).unlink(missing_ok=True)
                except OSError as exc:
                    raise FileAccessError(path / name, "delete", exc) from exc
    finally:
        _unlock(fd)


_DAMAGED_HINT = (
    "if the files are damaged, restore the directory from a copy or rebuild it from a "
    "persistent state in a new directory; run `imq verify` on it for details"
)


# RocksDB's (and rocksdict's) words for a file system that refuses to write.
_FILE_SYSTEM_REFUSALS = (
    (errno.EROFS, "Read-only file system"),
    (errno.EACCES, "Permission denied"),
)


def _open_hint(reason: str, *, read_only: bool = False) -> str:
    """What to do about a failed RocksDB open, from its reason."""
    if says_disk_full(reason):
        return "the disk is full: free space and open the queue again (nothing was lost)"
    if "Too many open files" in reason:
        return (
            "the process ran out of file descriptors (RocksDB keeps every table file "
            "open): raise its limit (ulimit -n, LimitNOFILE) and open the queue again; "
            "nothing is damaged"
        )
    if any(says in reason for _, says in _FILE_SYSTEM_REFUSALS):
        if read_only:
            return (
                "a file of the database cannot be read: run as a user that may read "
                "every file in the directory, or open a copy"
            )
        return _UNWRITABLE_HINT
    if read_only and "Corruption" in reason:
        # A log torn past its synced part by a power loss: a writer's open after the
        # restart replays it up to the damage (Store._open_after_restart); this one
        # cannot write the replay.
        return (
            f"{_DAMAGED_HINT}; if this machine lost power since the queue was last "
            "opened, open it for writing first (the node, or `imq gc`): after a "
            "restart, that open replays a log torn past its synced part"
        )
    return _DAMAGED_HINT


# A writer's open of a directory it cannot write (it writes its lock file, then RocksDB's).
_UNWRITABLE_HINT = (
    "the directory is not writable, and a writer's open writes there: fix the permissions "
    "or mount, or open it read-only (read_only=True, as the CLI's inspect, export and "
    "verify do), or copy it somewhere writable"
)


def _refusal(text: str) -> OSError | None:
    """The file system's refusal RocksDB's error ``text`` reports (not damage), if any."""
    for code, says in _FILE_SYSTEM_REFUSALS:
        if says in text:
            return OSError(code, f"{os.strerror(code)} ({text})")
    return None


def _failed_hint(reason: str) -> str:
    """What to do after a failed write, flush or compaction, from RocksDB's reason."""
    if _says_damaged(reason):
        # Met by a compaction (RocksDB's background one included) reading a damaged
        # table file: a reopen brings the same compaction back to the same file.
        return (
            "a table file is damaged (named above) and reopening will not mend it: restore "
            "the directory from a copy or rebuild it from a persistent state in a new "
            "directory (nothing the failed call staged was written); `imq verify` on the "
            "directory lists the damage reads reach, which may not include this block (a "
            "block whose rows are all deleted is read by compactions only)"
        )
    if says_disk_full(reason):
        return (
            "the disk is full: free space, close the queue and open it again (nothing the "
            "failed call staged was written)"
        )
    return StorageError.WRITE_HINT


# A synced write whose batch RocksDB took but whose log sync then failed: the batch is in
# the log file, not known to be on the disk; a reopen replays what the file holds.
_UNSYNCED_HINT = (
    "the call's batch was written but the sync of the log failed, so whether the change "
    "survives is known only after a reopen, where it is found whole or not at all: close "
    "the queue, open it again and check what the call would have changed (get_diff_info, "
    "the commit pointers, get_last_committed_mc_block_id) before retrying it; apply_diff "
    "and commit_diff retried return False where it landed, and an import is complete or "
    "rolled back by that open"
)


def _free_space(path: Path) -> str:
    """The free space of ``path``'s file system, said for an error message."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "the free space of its disk is unknown"
    return f"{free:,} bytes free on its disk"


def _synced() -> WriteOptions:
    options = WriteOptions()
    options.sync = True
    return options


# Every store open in this process, so that a forked child can refuse to use them.
_OPEN_STORES: weakref.WeakSet[Store] = weakref.WeakSet()


def _deferred_mark_sync(ref: weakref.ref[Store]) -> None:
    """The mark's timer: sync it if its store is still there (:meth:`Store._mark_synced`)."""
    store = ref()
    if store is not None:
        store._deferred_mark_sync()


_LOCK_FDS: set[int] = set()
"""This process's descriptors of imq's ``flock``s (a writer's ``imq.lock``, an import's
``imq.importing``, a wipe's), from their open to their close: a forked child closes its
copies at the fork, whatever the state of the store that took them (one still opening,
or closing, too), so that a child that outlives its parent never keeps a lock."""


def _open_lock_file(path: Path, flags: int) -> int:
    fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
    _LOCK_FDS.add(fd)
    return fd


def _close_lock_file(fd: int) -> None:
    _LOCK_FDS.discard(fd)
    with contextlib.suppress(OSError):
        os.close(fd)


def _after_fork_in_child() -> None:
    for fd in list(_LOCK_FDS):  # copies: closed, never unlocked (the parent's locks)
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()
    for store in list(_OPEN_STORES):
        if not store.closed:
            store._forked_into_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Holders:
    """What threads hold of RocksDB outside the store's gate, per thread (all calls under
    the gate): manual compactions (a table handle), or read views (snapshots and
    cursors). Either keeps RocksDB open, with the directory's lock, after the store let
    go of it, so ``close`` waits for them; a thread's own (a close from a signal handler
    during one) cannot end while that thread waits, so it is not waited for."""

    __slots__ = ("_done", "_running")

    def __init__(self, gate: threading.Lock) -> None:
        self._running: dict[int, int] = {}  # thread ident -> holds under way
        self._done = threading.Condition(gate)

    def start(self) -> int:
        """Count a hold of the calling thread; its ident, for :meth:`end`."""
        me = threading.get_ident()
        self._running[me] = self._running.get(me, 0) + 1
        return me

    def end(self, thread: int | None = None) -> None:
        """End a hold of ``thread`` (the calling thread by default)."""
        me = threading.get_ident() if thread is None else thread
        left = self._running.pop(me) - 1
        if left:
            self._running[me] = left
        self._done.notify_all()

    def wait_for_others(self, timeout: float | None = None) -> bool:
        """Wait until no other thread holds anything: False if ``timeout`` seconds
        passed first."""
        me = threading.get_ident()
        return self._done.wait_for(lambda: all(thread == me for thread in self._running), timeout)


# How long close() waits for another thread's read view (a read call ends in
# milliseconds; a view that outlives this was leaked, and close() goes on without it).
_VIEW_WAIT = 10.0


def open_rdict(
    path: Path, options: StoreOptions, *, read_only: bool = False, point_in_time: bool = False
) -> Any:
    """Open the rocksdict database with imq's six column families and options (raw mode,
    one block cache shared by all tables). ``Store`` opens through this; so does the raw
    floor of the benchmarks, so both measure the same engine configuration.
    ``point_in_time``: replay the logs up to their first damaged record (the writer's
    open after a restart, ``Store._open_after_restart``) instead of refusing them."""
    cache = Cache(options.block_cache_size)
    db_opts = Options(raw_mode=True)
    db_opts.create_if_missing(True)
    db_opts.create_missing_column_families(True)
    db_opts.set_max_background_jobs(options.max_background_jobs)
    # A damaged log record fails the open (a typed error) instead of RocksDB's default
    # point-in-time recovery, which silently drops every record after it, acknowledged
    # writes included. A record cut short at the very end (power lost mid-append, after
    # the last fsync) is still tolerated: only unsynced diffs can sit there. The one
    # exception, ``point_in_time``, is the writer's open after a restart of the machine.
    db_opts.set_wal_recovery_mode(
        DBRecoveryMode.point_in_time()
        if point_in_time
        else DBRecoveryMode.tolerate_corrupted_tail_records()
    )
    # Bound the WAL: the small tables are written by every commit and rarely fill a
    # memtable, so without a cap every log file stays (RocksDB's default cap is 4x the
    # sum of all write buffers, over 2 GB here); past the cap RocksDB flushes the tables
    # that pin the oldest log. The endurance benchmark measures the effect.
    db_opts.set_max_total_wal_size(options.max_total_wal_size)
    # RocksDB opens every table file at open with up to 16 threads *per column family*:
    # seven families made every open spawn and join about 110 threads (strace), about
    # 5 of the 13 ms an open took in the simulation's restarts. imq's tables hold few
    # files (level compaction keeps L0 short), so one thread opens them; the threads
    # would only help a cold page cache on a large store.
    db_opts.set_max_file_opening_threads(1)
    # RocksDB's own text log (``LOG`` in the directory) starts a new file at every open and
    # by default keeps 1,000 old ones, each unbounded in size: a node that restarts often
    # would fill its queue directory with them.
    db_opts.set_keep_log_file_num(INFO_LOG_FILES)
    db_opts.set_max_log_file_size(INFO_LOG_FILE_SIZE)
    # Every flush and compaction appends an edit to the MANIFEST, and RocksDB starts a
    # new one only at open or past this size (its default: 1 GB). Every open reads the
    # whole file four times (imq's two checks, RocksDB's list of tables and recovery):
    # a writer that ran 20 s beside the read-only stress test left a 2 MB MANIFEST and
    # opens of 45 ms, 43 of them on the MANIFEST. A new one holds only the live files.
    db_opts.set_max_manifest_file_size(MANIFEST_FILE_SIZE)
    cfs = {t.value: table_options(spec, cache, options) for t, spec in TABLES.items()}
    access = AccessType.read_only() if read_only else AccessType.read_write()
    return Rdict(str(path), options=db_opts, column_families=cfs, access_type=access)


def _no_log_deleted(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    """No log the open may have read went away meanwhile (``Store._files_now`` before and
    after it). Only a deleted log can tear the view: its rows are in table files for the
    tables that flushed them and nowhere for the others. A log created meanwhile holds
    writes after the ones the open read, so the open saw a consistent earlier state
    (each write batch sits whole in one log). A recycled log changes its name: deleted."""
    if len(before) != len(after) or before == (None,):
        return False
    return set(before[-1]) <= set(after[-1])


# A read-only open beside a live writer is tried again while the writer's flushes tear it,
# for up to this many seconds.
_READ_ONLY_BUDGET = 15.0
_READ_ONLY_PAUSE = 0.005  # seconds slept after the first attempt; growing, jittered

# The pauses' jitter: a private generator, so the host's `random` sequence is not touched.
_jitter = random.Random()


def _close_rdict(opened: tuple[Any, dict[Table, Any], dict[Table, Any]]) -> None:
    """Close a RocksDB handle from :meth:`Store._open_rocksdb` (its column-family objects
    first: a live one keeps RocksDB open)."""
    db, tables, handles = opened
    tables.clear()
    handles.clear()
    with contextlib.suppress(Exception):
        db.close()


def _unlock(fd: int) -> None:
    """Release and close the lock file descriptor ``fd``."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    _close_lock_file(fd)


def _drop_lock(fd: int, owner: int) -> None:
    """The lock of a store collected unclosed: close ``fd`` (which frees the lock once no
    other process holds the descriptor) without ``LOCK_UN``, and only in the process that
    took it. A forked child inherits the descriptor, the lock and this finalizer: an
    unlock from it, at its exit, would free the parent's lock under the parent."""
    if os.getpid() == owner:
        _close_lock_file(fd)


def _check_path(path: str | os.PathLike[str]) -> None:
    """Refuse, before anything is created, a path RocksDB cannot take."""
    text = os.fspath(path)
    if not text:
        raise ValueError("the queue database path is empty; pass its directory")
    try:
        text.encode()
    except UnicodeEncodeError:  # undecodable bytes of the file system's name
        raise ValueError(
            f"the queue database path {text!r} is not valid UTF-8, which RocksDB requires "
            "of its paths; pass a directory whose name is"
        ) from None
    if os.path.islink(text) and not os.path.exists(text):  # mkdir: "File exists"
        raise FileAccessError(
            text,
            "open queue database",
            FileNotFoundError(
                errno.ENOENT, f"it is a symbolic link to {os.readlink(text)}, which does not exist"
            ),
            "create the directory it points to, or pass another path",
        )
    # As RocksDB is given it: a relative path is resolved by the kernel from the working
    # directory, whose own length does not count.
    size = len(os.fsencode(text))
    limit = _path_max(text) - 1 - _NAMES_ROOM  # PATH_MAX counts the terminating NUL
    if size > limit:  # the directory itself may fit: RocksDB's files in it would not
        raise FileAccessError(
            text,
            "open queue database",
            OSError(
                errno.ENAMETOOLONG,
                f"the path ({size} bytes) leaves too little room for the names of the "
                f"files RocksDB must write inside it (up to {_NAMES_ROOM} bytes more)",
            ),
            f"use a path of at most {limit} bytes",
        )


# Room for "/" and the longest name of a file a database directory must hold: rocksdict's
# config file (21 bytes; "OPTIONS-<number>.dbtmp" is 20 until the millionth file).
# RocksDB's "LOG.old.<16 digits>" is longer, but RocksDB goes on without it (its text log
# is then not rotated), as it did before this check: a path that opened still opens.
_NAMES_ROOM = 22


def _path_max(text: str) -> int:
    """The file system's longest path (in bytes, with its NUL) where ``text`` would live:
    asked of its nearest existing ancestor (4096 if that cannot be asked)."""
    at = os.path.abspath(text)
    while True:
        try:
            return int(os.pathconf(at, "PC_PATH_MAX"))
        except (OSError, ValueError):
            parent = os.path.dirname(at)
            if parent == at:
                return 4096
            at = parent


def _short_of_synced(path: Path, recovered: int, floor: int, *, untouched: bool) -> StorageError:
    """The error of an open that recovered writes only up to the sequence number
    ``recovered``, below the ``floor`` the mark of synced writes (``SYNCED_FILE``) names.
    ``untouched``: refused before any open that could change the directory."""
    unchanged = "; nothing in it was changed" if untouched else ""
    return StorageError(
        path,
        "open",
        f"RocksDB recovered its writes up to sequence number {recovered}, but writes up "
        f"to {floor} had been synced to disk ({SYNCED_FILE}): its write-ahead log or "
        "its MANIFEST lost records written before their last fsync (cut short, or "
        "replaced by an older copy), so the queue would open as an older, shorter one",
        hint=f"{_SHORT_HINT}{unchanged}",
    )


_SHORT_HINT = (
    "restore the directory from a copy, or rebuild the queue from a persistent state "
    "(`imq import`); a copy taken while the node ran can be torn the same way. To open "
    f"what is left as it is, copy the directory first (a writer's open deletes the table "
    f"files its MANIFEST does not list), then delete {SYNCED_FILE}"
)


class Store:
    """A dedicated RocksDB directory with imq's six column families."""

    _forked = False  # set in a process forked from the one that opened it
    _manifest_log: int | None = None  # the newest log the current MANIFEST names
    _manifest_sequence: int | None = None  # the highest last sequence number it records
    _logged_sequence: int | None = None  # the highest one of the logs' last write batches
    _writer_boot: str | None = None  # the boot its last writer opened it in (the lock file)
    _synced_mark: int | None = None  # SYNCED_FILE's number, read before the logs' checks
    _tables_before = 0  # table files in the directory before RocksDB's open
    _refused = False  # the open failed its schema check: close writes no mark of synced writes

    def __init__(
        self,
        path: str | os.PathLike[str],
        options: StoreOptions | None = None,
        *,
        read_only: bool = False,
        check_synced: bool = True,
        check_schema: bool = True,
    ) -> None:
        """Open (creating if missing) the store in ``path``.

        ``read_only`` opens an existing store beside a live writer, for inspection: no
        lock is taken, nothing can be written, and the view is the state at open
        (including the writer's unflushed log). ``check_synced=False`` leaves out the
        check against the mark of synced writes (a writer's open makes it with such a
        read-only open first: ``_check_recoverable``). ``check_schema=False`` (read-only
        only) leaves out the schema version's check: ``_check_versioned``'s probe reads it.
        """
        _check_path(path)
        self.path = Path(path)
        self.options = options or StoreOptions()
        self.read_only = read_only
        self._checks_synced = check_synced
        self._lock_fd = -1
        self._synced_fd = -1  # SYNCED_FILE, opened at the first synced write
        self._importing = 0  # imports of this handle inside importing()
        # A read-only open: whether an import held its lock just before RocksDB's open.
        self.import_lock_at_open = False
        self._mark_fsynced_at = -MARK_SYNC_INTERVAL  # monotonic time of its last fsync
        self._mark_entry_synced = False  # its name synced into the directory
        # The mark's deferred fsync: a mark written but not yet synced is synced by a timer
        # once its last fsync is MARK_SYNC_INTERVAL old, so that a queue left idle after a
        # burst of commits does not keep an unsynced mark. The lock guards the file's
        # descriptor and the timer against close().
        self._mark_lock = threading.Lock()
        self._mark_timer: threading.Timer | None = None
        self._mark_dirty = False  # written since its last fsync
        self._shadow: shadow.Shadow | None = None  # a read-only open of an unwritable directory
        if read_only:
            self._check_database_exists()
        found = self._stat_directory()
        self._complete = False  # whether the MANIFEST listed all of imq's tables at open
        # What the walk of the logs found that is not sure damage, one line each (a
        # zeroed record header with data after it): the queue logs them as warnings at
        # open, ``imq verify`` lists them.
        self.log_notes: list[str] = []
        # The zeroed headers of the current MANIFEST, found by its walk before RocksDB's
        # list of tables (``_check_manifest``), noted with the logs' (``_check_logs``).
        self._manifest_zeroed: list[tuple[str, int]] = []
        if read_only:
            self._open_for_reading()
        else:
            self._open_for_writing(found)
        self._gate = threading.Lock()
        self._compactions = _Holders(self._gate)
        self._views = _Holders(self._gate)
        self._state = QueueState()
        self._resources: weakref.WeakSet[Any] = weakref.WeakSet()
        self._closed = False
        self._dead: StorageError | None = None
        self._sync = _synced()
        self.cache = MessageCache(
            0 if read_only else self.options.message_cache_size, codec.MESSAGE_PREFIX_LEN
        )
        self.diff_tops = DiffTops()
        try:
            if check_schema or not read_only:
                self._check_schema()
        except BaseException:
            self._refused = True
            self.close()
            raise
        self._register()

    # -- open / close -------------------------------------------------------------------------

    def _open_for_writing(self, found: os.stat_result | None) -> None:
        """The writer's open, under the directory's lock, checked before RocksDB's open
        and against the mark of synced writes. ``found``: the directory's stat (``None``:
        it does not exist yet)."""
        # Before anything touches the directory: RocksDB would adopt a foreign database
        # and, at open, delete the table files a damaged MANIFEST no longer lists.
        seen = self._files_now()  # before the walk: a change after it shows
        self._tables_before = self._check_directory() if found is not None else 0
        try:
            if found is None:
                _make_directory(self.path)
            self._lock_fd = self._acquire_lock()
            self._read_writer_boot()
        except OSError as exc:
            refused = exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
            hint = _UNWRITABLE_HINT if refused and found is not None else ""
            raise FileAccessError(self.path, "open queue database", exc, hint) from exc
        try:
            # The MANIFEST again, under the lock, if a writer that closed since the first
            # walk (``_check_directory``) changed the files.
            if self._files_now() != seen:
                self._check_manifest()
            floor = self._synced_mark = self._synced_floor()
            self._check_logs()  # under the lock: no writer changes them meanwhile
            self._check_recoverable(floor)
            self._check_versioned(floor)
            try:
                self._db, self._tables, self._handles = self._open_rocksdb()
            except StorageError as exc:
                self._open_after_restart(exc)
            self._check_synced(floor)
            self._record_boot()
        except BaseException:
            self._release_lock()
            raise

    def _open_for_reading(self) -> None:
        """The read-only open, checked against the mark of synced writes."""
        try:
            # Read before the open: a live writer's later marks name later writes.
            floor = read_synced_mark(self.path) if self._checks_synced else None
            self._synced_mark = floor
            self._db, self._tables, self._handles = self._open_read_only()
            self._check_synced(floor)
        except BaseException:
            self._remove_shadow()
            raise

    def _synced_floor(self) -> int | None:
        """A writer's open: the mark of the last synced write (``SYNCED_FILE``), or
        ``None``; one beside no database (RocksDB creates a new one) is stale and goes."""
        if not (self.path / "CURRENT").exists():
            with contextlib.suppress(OSError):
                os.unlink(self.path / SYNCED_FILE)
            return None
        return read_synced_mark(self.path)

    def _check_synced(self, floor: int | None) -> None:
        """Refuse a database RocksDB opened short of a write it had synced: its log cut
        short or lost before its last fsync, or its MANIFEST cut short (RocksDB's
        recovery takes either for a torn tail and opens an older state without a word).
        ``floor``: the mark read before the open. Closes RocksDB when it refuses."""
        if floor is None:
            return
        recovered = self._db.latest_sequence_number()
        if recovered >= floor:
            return
        _close_rdict((self._db, self._tables, self._handles))
        self._db = None
        raise _short_of_synced(self.path, recovered, floor, untouched=False)

    def _check_recoverable(self, floor: int | None) -> None:
        """A writer's open, before RocksDB's: refuse a database whose files cannot bring
        back every synced write while nothing in it is changed yet. RocksDB's writer open
        deletes the table files its MANIFEST does not list, so a MANIFEST cut short would
        lose them for good before the check after the open (``_check_synced``) refused.

        What the files can bring back is bounded by the highest last sequence number the
        MANIFEST records and the last write batch of the logs (both read by the checks
        before, ``_check_manifest`` and ``_check_logs``): at or above the mark, as after
        every clean close and every crash, the open goes on. Below it, or unknown, a
        read-only open (which changes nothing) tells what RocksDB recovers."""
        if floor is None or not self._complete:
            return
        known = [n for n in (self._manifest_sequence, self._logged_sequence) if n is not None]
        if known and max(known) >= floor:
            return
        try:
            probe = Store(self.path, self.options, read_only=True, check_synced=False)
        except ImqError as exc:
            # Not known to recover the synced writes, and RocksDB's writer open could
            # delete what a read-only open would need: refused, nothing changed (an
            # outside audit: a MANIFEST cut after the tables' creation failed the
            # read-only open's schema check, and the writer's open deleted every file).
            raise StorageError(
                self.path,
                "open",
                f"writes up to sequence number {floor} had been synced to disk "
                f"({SYNCED_FILE}), its MANIFEST and write-ahead logs show "
                f"{f'writes only up to {max(known)}' if known else 'no sequence number'}, "
                f"and a read-only open to tell what RocksDB recovers failed: {exc}",
                hint=f"{_SHORT_HINT}; nothing in it was changed",
            ) from exc
        try:
            recovered = probe._db.latest_sequence_number()
        finally:
            probe.close()
        if recovered < floor:
            raise _short_of_synced(self.path, recovered, floor, untouched=True)

    def _check_versioned(self, floor: int | None) -> None:
        """A writer's open of table files without the mark of synced writes (deleted, or
        never written), before RocksDB's: refuse them while nothing is changed when they
        show no schema version. RocksDB's writer open deletes the table files a damaged
        MANIFEST no longer lists, so the check after the open (``_check_schema``) refused
        only once: the next open found neither table files nor a version and created an
        empty queue (an outside audit). With the mark, ``_check_recoverable`` guards this.
        Costs one read-only open, only on this path."""
        if floor is not None or not self._complete or not self._tables_before:
            return
        try:
            probe = Store(
                self.path, self.options, read_only=True, check_synced=False, check_schema=False
            )
        except ImqError:
            return  # the writer's open and its own checks decide, as without the probe
        try:
            versioned = probe.get_latest(Table.VARS, codec.SCHEMA_VERSION_KEY) is not None
        finally:
            probe.close()
        if not versioned:
            raise self._data_without_version()

    def _data_without_version(self) -> SchemaVersionError:
        # imq writes the version (synced) when it creates the tables, before any table
        # file can exist: table files without it mean a damaged MANIFEST (RocksDB drops
        # the files it no longer lists at a writer's open) or a foreign database.
        return SchemaVersionError(
            f"queue database {self.path} holds data ({self._tables_before} table "
            "files before this open) but no schema version: its files are damaged "
            "or it is not an imq queue; restore the directory from a copy or "
            "rebuild it from a persistent state in a new directory (import_state)"
        )

    def _mark_synced(self, *, durable: bool = False) -> None:
        """Record that the log is synced up to the latest write (under the gate, after a
        synced write). Written after the log's fsync, the mark can only lag what is on
        disk, never lead it; a failure leaves it lagging too. The mark itself is synced
        when its last fsync is ``MARK_SYNC_INTERVAL`` old, or with ``durable`` (at close);
        a mark written sooner is synced by a timer (one daemon thread, at most one at a
        time) when that interval has passed. So a power loss leaves the mark at most that
        far behind the synced log, and a log that then replays short of it (a storage
        fault in its synced part) is refused."""
        with self._mark_lock:
            try:
                if self._synced_fd < 0:
                    self._synced_fd = os.open(
                        self.path / SYNCED_FILE, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644
                    )
                os.pwrite(self._synced_fd, _synced_record(self._db.latest_sequence_number()), 0)
            except OSError:
                return
            self._mark_dirty = True
            wait = MARK_SYNC_INTERVAL - (time.monotonic() - self._mark_fsynced_at)
            if durable or wait <= 0:
                self._fsync_mark()
                self._drop_mark_timer()  # due now too: it would sync again at once
            elif not self._closed and (
                self._mark_timer is None or self._mark_timer.finished.is_set()
            ):  # none pending (one that ran or was stopped counts as none)
                # The timer holds the store weakly: a queue dropped without close() is
                # collected (and its lock freed) as before, not kept until the timer runs.
                # Its fsync holds the mark's lock, which a synced write (under the gate)
                # then waits for: one fsync of 16 bytes, at most once a second.
                timer = threading.Timer(wait, _deferred_mark_sync, (weakref.ref(self),))
                timer.name, timer.daemon = "imq-mark-sync", True
                try:
                    timer.start()
                except RuntimeError:  # no thread to be had (the interpreter exiting)
                    return  # the mark waits for the next synced write, or close
                self._mark_timer = timer

    def _fsync_mark(self) -> None:
        """Sync the mark file (and, once per open, its directory entry); under the mark's
        lock. A failure leaves the mark lagging: a weaker check, never a wrong one."""
        now = time.monotonic()
        try:
            os.fdatasync(self._synced_fd)
            if not self._mark_entry_synced:  # once per open: the file may be new
                sync_directory(self.path)
                self._mark_entry_synced = True
        except OSError:
            return
        self._mark_fsynced_at, self._mark_dirty = now, False

    def _deferred_mark_sync(self) -> None:
        """The timer's run: sync the mark if a write since its last fsync left it unsynced
        (not if a synced write or close() synced it meanwhile, nor once the file is
        closed)."""
        with self._mark_lock:
            if self._mark_timer is threading.current_thread():  # not a later one's
                self._mark_timer = None
            if self._synced_fd >= 0 and self._mark_dirty:
                self._fsync_mark()

    def _drop_mark_timer(self) -> None:
        """Cancel a pending deferred sync; under the mark's lock."""
        if self._mark_timer is not None:
            self._mark_timer.cancel()
            self._mark_timer = None

    def _stop_mark_timer(self) -> None:
        """Stop a pending deferred sync (close: the mark is synced there, durably)."""
        with self._mark_lock:
            self._drop_mark_timer()

    def _stat_directory(self) -> os.stat_result | None:
        """The database directory's stat, or None when it does not exist yet (created at
        open; a path under a file fails there, typed); a file is refused."""
        try:
            found = os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:  # not permitted to look
            raise FileAccessError(self.path, "open queue database", exc) from None
        if not stat.S_ISDIR(found.st_mode):
            raise FileAccessError(
                self.path,
                "open queue database",
                NotADirectoryError(errno.ENOTDIR, "it is a file, not a directory"),
                "pass the directory that holds (or will hold) the queue",
            )
        return found

    def _acquire_lock(self) -> int:
        fd = _open_lock_file(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT)
        try:
            _flock_retrying(fd)
        except BlockingIOError:
            _close_lock_file(fd)
            raise DatabaseLockedError(
                f"queue database {self.path} is already open (in this or another process)"
            ) from None
        except BaseException:  # an interrupt during the retry: the lock, if taken, goes
            _unlock(fd)
            raise
        # A store dropped without close() (a REPL, a test, an error path that skipped
        # ``with``) still frees its lock when it is collected, as RocksDB's own is freed:
        # else the directory stays locked for the rest of the process.
        self._lock_finalizer = weakref.finalize(self, _drop_lock, fd, os.getpid())
        return fd

    def _release_lock(self, *, unlock: bool = True) -> None:
        """Release the directory's lock; ``unlock=False`` only closes this process's
        descriptor (a forked child: the lock then stays with the parent)."""
        if self._lock_fd < 0:
            return
        fd, self._lock_fd = self._lock_fd, -1
        self._lock_finalizer.detach()
        if unlock:
            _unlock(fd)
        else:
            _close_lock_file(fd)

    def _open_after_restart(self, refused: StorageError) -> None:
        """RocksDB refused the logs (``refused``): replay them up to their first damaged
        record instead, if the machine restarted since this queue's last writer opened
        it, else raise ``refused``.

        Only a power loss (or an OS crash) can leave damage in a log that no storage
        fault made: the kernel writes a log's unsynced end back in any order, and some
        file systems then show it torn, or with zeroed pages between written ones. Only
        writes after the last fsync sit there (uncommitted diffs; a commit is synced
        before it returns), and the check after the open (``_check_synced``, against
        the mark of synced writes) still refuses a replay that ends short of a synced
        write the mark names. Without a restart the damage has no such cause: refused,
        as every damaged log is."""
        then, now = self._writer_boot, _boot_id()
        if then is None or now is None or then == now or "Corruption" not in str(refused):
            raise refused
        self._db, self._tables, self._handles = self._open_rocksdb(point_in_time=True)
        recovered = self._db.latest_sequence_number()
        logged = self._logged_sequence
        lost = "" if logged is None or logged <= recovered else f" of {logged} logged"
        self.log_notes.append(
            f"the write-ahead log is damaged ({refused.reason}); this machine restarted "
            f"since the queue was last opened, and a power loss leaves the unsynced end of "
            f"a log torn on some file systems, so it was replayed up to its first damaged "
            f"record: sequence number {recovered}{lost}, every synced write the mark names "
            f"included. A power loss takes only writes made after the last commit "
            f"(uncommitted diffs, which the node's start sequence applies again); if this "
            f"machine did not lose power, the file is damaged: compare the queue with a "
            f"copy, or rebuild it from a persistent state in a new directory"
        )

    def _read_writer_boot(self) -> None:
        """The boot of the machine when this queue's last writer opened it, as that open
        recorded it in the lock file (``_record_boot``); ``None`` if not recorded."""
        try:
            raw = os.pread(self._lock_fd, 64, 0)
        except OSError:
            raw = b""
        text = raw.decode("ascii", "replace").strip()
        self._writer_boot = text if _BOOT_ID.fullmatch(text) else None

    def _record_boot(self) -> None:
        """Write this boot's id into the lock file, synced so that a power loss keeps it:
        the next writer's open tells a restart since this one (``_open_after_restart``).
        A failure only leaves the next open stricter."""
        now = _boot_id()
        if now is None or now == self._writer_boot:
            return
        with contextlib.suppress(OSError):
            data = now.encode() + b"\n"
            os.pwrite(self._lock_fd, data, 0)
            os.ftruncate(self._lock_fd, len(data))
            os.fsync(self._lock_fd)

    def _check_database_exists(self) -> None:
        """For a read-only open, which creates nothing: a database must be there."""
        operation = "open queue database (read-only)"
        try:
            found = os.stat(self.path / "CURRENT")
        except (FileNotFoundError, NotADirectoryError):
            found = None
        except OSError as exc:  # not permitted to look
            raise FileAccessError(self.path, operation, exc) from None
        if found is None or not stat.S_ISREG(found.st_mode):
            if found is None and self._lost_current():
                raise StorageError(
                    self.path,
                    "open (read-only)",
                    "it holds a RocksDB database's files (MANIFEST, table or log files) but "
                    "no CURRENT file: the file was lost or damaged, or a deletion of the "
                    "database was cut short",
                    hint="restore the directory from a copy; nothing in it was changed",
                )
            raise FileAccessError(
                self.path,
                operation,
                FileNotFoundError(errno.ENOENT, f"no queue database at {self.path}"),
                "pass the directory of an existing queue (a read-only open creates nothing)",
            )

    def _lost_current(self) -> bool:
        """A directory holding a RocksDB's MANIFEST, table or log files without CURRENT
        (read-only open; named as what it is, not as no database at all)."""
        try:
            return holds_database_files(os.listdir(self.path))
        except OSError:
            return False

    def _check_directory(self) -> int:
        """Refuse a directory that is not (yet) an imq queue: one holding a RocksDB
        database without imq's tables (another program's, or one whose MANIFEST lost the
        records that created them), or other files and no database at all. Nothing in it
        is changed. The number of table (``.sst``) files it holds."""
        try:
            names = os.listdir(self.path)
        except OSError as exc:
            raise FileAccessError(self.path, "open queue database", exc) from exc
        tables = sum(name.endswith(".sst") for name in names)
        if "CURRENT" in names:
            # RocksDB's list of tables reads the MANIFEST with its log reader: a record of
            # a recycled log's type there hangs it for ever (as in a log, see
            # ``_check_logs``), and a damaged length makes it drop edits, so that imq's
            # tables look missing. So the MANIFEST's records are walked first (an outside
            # audit: one bit flipped in a record's type hung every open, Ctrl-C ignored).
            self._check_manifest()
            try:
                # With options of its own: without, rocksdict leaks ~200 bytes of native
                # memory a call (measured with mallinfo2 over 3,000 opens).
                families = set(Rdict.list_cf(str(self.path), Options(raw_mode=True)))
            except Exception as exc:
                unopened = self._missing_manifest()
                if unopened is not None:  # as the read-only open names it (_check_manifest)
                    raise self._unreadable_log(unopened) from exc
                raise self._open_error(
                    str(exc),
                    "read the list of tables of queue database",
                    f"cannot read its list of tables: {exc}",
                ) from exc
            missing = [t.value for t in Table if t.value not in families]
            # imq's own creation cut short (killed between RocksDB's CURRENT and the
            # last of its tables): imq's lock file, no foreign table, no table file yet.
            interrupted = (
                LOCK_FILE in names
                and families <= {"default", *(t.value for t in Table)}
                and tables == 0
            )
            if missing and not interrupted:
                raise StorageError(
                    self.path,
                    "open",
                    f"it is a RocksDB database without imq's tables {', '.join(missing)}",
                    hint="either it is not an imq queue (pass the queue's own directory, or "
                    "a new or empty one) or its MANIFEST is damaged (restore the directory "
                    "from a copy); nothing in it was changed",
                )
            unknown = sorted(families - {"default", *(t.value for t in Table)})
            if unknown and not missing:
                raise SchemaVersionError(
                    f"queue database {self.path} holds tables this imq does not know "
                    f"({', '.join(unknown)}): a newer imq wrote it; open it with that "
                    "version (nothing in it was changed)"
                )
            self._complete = not missing
        elif not self.read_only and any(not DATABASE_FILE.fullmatch(n) for n in names):
            raise StorageError(
                self.path,
                "open",
                "the directory holds other files but no queue database",
                hint="pass a new or empty directory, or the queue's own; nothing in it was changed",
            )
        elif not self.read_only and (tables or wal.log_files(names)):
            # RocksDB writes CURRENT before any table or log file: these are what a
            # deletion cut short left (or CURRENT itself was lost).
            raise StorageError(
                self.path,
                "open",
                "it holds table or log files but no CURRENT file: a deletion of the "
                "database was cut short, or its CURRENT file was lost",
                hint="delete the directory to start afresh (`imq simulate --fresh` does), or "
                "restore it from a copy; nothing in it was changed",
            )
        return tables

    def _check_logs(self) -> None:
        """Refuse a database whose write-ahead log is missing, or whose logs hold a record
        RocksDB's recovery would never finish reading or would silently drop with
        everything after it (:mod:`imq.storage.wal`; the current MANIFEST was walked by
        ``_check_manifest`` before RocksDB's list of tables read it). Nothing is changed.
        A read-only open passes over a log that disappears while it is read (a live
        writer deleted it: the open after this check cannot read it either)."""
        if not self._complete:  # no database yet (or its creation was cut short)
            return
        zeroed: list[tuple[str, int]] = []
        spans: list[wal.LogSpan] = []
        try:
            names = os.listdir(self.path)
            damage = wal.find_log_damage(
                self.path, names, zeroed, skip_vanished=self.read_only, spans=spans
            )
        except FileNotFoundError as exc:
            if self.read_only:
                raise  # a dangling link, or the directory gone: the read-only open decides
            raise self._unreadable_log(exc) from exc
        except OSError as exc:
            raise FileAccessError(self.path, "read the write-ahead log of", exc) from exc
        if not wal.log_files(names):
            raise StorageError(
                self.path,
                "open",
                "its write-ahead log is missing (no .log file beside the MANIFEST, which "
                "lists imq's tables): the writes not yet in table files are lost",
                hint="restore the directory, with its .log files, from a copy, or rebuild "
                "the queue from a persistent state; nothing in it was changed",
            )
        if damage is not None:
            raise self._log_damage_error(damage)
        self._check_newest_log(names)
        self._check_log_spans(spans)
        self.log_notes = [
            f"{name}: a zeroed record header at offset {offset} with data after it in its "
            "32 KiB block: RocksDB's recovery skipped the rest of that block, so records "
            "there were not replayed. Unless this machine lost power (which on some file "
            "systems leaves zeros in the unsynced end of a log), the file is damaged: "
            "compare the queue with a copy, or rebuild it from a persistent state in a new "
            "directory"
            for name, offset in zeroed + self._manifest_zeroed
        ]

    def _check_log_spans(self, spans: list[wal.LogSpan]) -> None:
        """Refuse logs that do not take up the writes where the MANIFEST leaves them, or
        that lost writes the mark of synced writes names (``_synced_mark``, read before
        the logs were listed); nothing is changed. RocksDB's open goes on in silence
        either way, a writer's deleting the table files the MANIFEST does not list.

        - The MANIFEST records with each edit the last sequence number written then;
          RocksDB deletes a log only once every table flushed it, which it records in an
          edit made after the next log took over. So the oldest log holding a write batch
          starts at most one past the highest number the MANIFEST records. One that
          starts later follows writes that are in no file: the MANIFEST lost its last
          edits (cut short, or an older copy put back; an outside audit: a queue of 100
          messages opened with 40, its other table files deleted, the check after the
          open passed), or a log was lost.
        - A synced write stays in its log, whole, until every table flushed it, and the
          logs after it start past it. So logs that start at or below the mark must end
          at it or beyond: ones that end short lost synced writes (cut, or records lost),
          which the check after the open misses where a table's flush recorded a higher
          number in the MANIFEST (an outside audit: an acknowledged commit gone)."""
        starts = [(span.first, span.name) for span in spans if span.first is not None]
        ends = [span.last for span in spans if span.last is not None]
        self._logged_sequence = max(ends, default=None)
        if not starts:
            return
        first, oldest = starts[0]
        recorded = self._manifest_sequence
        if recorded is not None and first > recorded + 1:
            raise StorageError(
                self.path,
                "open",
                f"its MANIFEST records writes up to sequence number {recorded}, but its "
                f"oldest write-ahead log holding writes, {oldest}, starts at {first}: the "
                "writes in between are in no file (the MANIFEST lost its last edits, cut "
                "short or replaced by an older copy, or a log was lost), and RocksDB's "
                "open would go on without them in silence",
                hint=f"{_DAMAGED_HINT}; nothing in it was changed",
            )
        mark = self._synced_mark
        start = min(number for number, _ in starts)
        if mark is None or start > mark:
            return
        end = max(ends, default=start - 1)
        if end < mark:
            raise StorageError(
                self.path,
                "open",
                f"writes up to sequence number {mark} had been synced to disk "
                f"({SYNCED_FILE}), but its write-ahead logs, which hold the writes from "
                f"{start} on, end at {end}: a log was cut short or lost records written "
                "before their last fsync, and RocksDB's open would go on without them in "
                "silence",
                hint=f"{_SHORT_HINT}; nothing in it was changed",
            )

    def _check_newest_log(self, names: list[str]) -> None:
        """Refuse a directory whose newest log was lost: the current MANIFEST records a
        log number no log here reaches (:func:`wal.newest_log_number`). A writer creates
        a log before its MANIFEST names it and deletes one only once every table's number
        is past it, and the MANIFEST was read before ``names`` were listed."""
        needed = self._manifest_log
        numbers = [int(name[:-4]) for name in wal.log_files(names)]
        if needed is None or not numbers or max(numbers) >= needed:
            return
        found = ", ".join(wal.log_files(names))
        raise StorageError(
            self.path,
            "open",
            f"its newest write-ahead log is missing: the MANIFEST records log {needed:06d} "
            f"as holding writes not yet in table files, and the directory holds only older "
            f"logs ({found}): the writes in the missing log are lost, committed diffs "
            "included, and RocksDB's open would go on without them in silence",
            hint=f"restore {needed:06d}.log (and any later log) from a copy of the directory, "
            "or rebuild the queue from a persistent state in a new directory; nothing in "
            "it was changed",
        )

    def _unreadable_log(self, exc: FileNotFoundError) -> FileAccessError:
        """A log or MANIFEST the directory lists but that cannot be opened, no writer
        having deleted it meanwhile (a dangling link)."""
        name = Path(exc.filename).name if exc.filename else "a file"
        if name.startswith("MANIFEST"):  # CURRENT names it (an outside audit: not "a log")
            return FileAccessError(
                self.path,
                "read the MANIFEST of",
                exc,
                f"CURRENT names {name} but it cannot be opened (missing, or a dangling "
                "link): restore the directory from a copy; nothing was changed",
            )
        return FileAccessError(
            self.path,
            "read the write-ahead log of",
            exc,
            f"the directory lists {name} but it cannot be opened (a dangling link?): "
            "restore it from a copy; nothing was changed",
        )

    def _check_manifest(self) -> None:
        """Refuse a current MANIFEST holding a record RocksDB's reader would never finish
        or would silently drop (:func:`wal.find_file_damage`); nothing is changed. Its
        zeroed headers are kept for the open's notes. A MANIFEST that cannot be read is
        left to RocksDB's own open to report."""
        zeroed: list[tuple[str, int]] = []
        self._manifest_zeroed = zeroed
        self._manifest_log = self._manifest_sequence = None
        try:
            manifest = self._current_manifest()
            damage = None if manifest is None else wal.find_file_damage(self.path, manifest, zeroed)
            if manifest is not None and damage is None:
                # Read before the logs are listed: a live writer creates a log before
                # its MANIFEST names it (see _check_logs).
                facts = wal.manifest_facts(self.path / manifest)
                self._manifest_log, self._manifest_sequence = facts
        except FileNotFoundError:
            if self.read_only:
                raise  # a live writer started a new MANIFEST: the read-only open retries
            return
        except OSError:
            return
        if damage is not None:
            raise self._log_damage_error(damage)

    def _missing_manifest(self) -> FileNotFoundError | None:
        """The error of opening the MANIFEST CURRENT names, where that file is not there;
        else ``None``. Asked once RocksDB failed to read it: a live writer's switch to a
        new MANIFEST names the new one in CURRENT before it deletes the old one."""
        try:
            manifest = self._current_manifest()
            if manifest is None:
                return None
            os.stat(self.path / manifest)
        except FileNotFoundError as exc:
            return None if exc.filename == str(self.path / "CURRENT") else exc
        except OSError:
            return None
        return None

    def _current_manifest(self) -> str | None:
        """The MANIFEST file CURRENT names, or None when CURRENT names none (RocksDB's
        open then reports it)."""
        named = (self.path / "CURRENT").read_text(encoding="ascii", errors="replace").strip()
        return named if re.fullmatch(r"MANIFEST-\d+", named) else None

    def _log_damage_error(self, damage: wal.LogDamage) -> StorageError:
        manifest = damage.name.startswith("MANIFEST")
        where = f"{'' if manifest else 'write-ahead log '}{damage.name}"
        if damage.gap is not None:
            expected, found = damage.gap
            return StorageError(
                self.path,
                "open",
                f"{where} does not continue the log before it: its first write batch "
                f"(offset {damage.offset}) has sequence number {found}, where the log "
                f"before it leaves off at {expected}. A log between them was lost, or the "
                "earlier one lost records at its end; RocksDB's open would replay the rest "
                "in silence, without the writes in between, committed diffs included",
                hint=f"{_DAMAGED_HINT}; nothing in it was changed",
            )
        if damage.cut:
            return StorageError(
                self.path,
                "open",
                f"{where} is cut short at offset {damage.offset} (its last record is not "
                "whole), yet a newer log follows it: a crash cuts only the newest log, so "
                "the file is damaged or was truncated. RocksDB's open would skip the rest "
                "of it in silence and replay the newer logs, losing the writes in between, "
                "committed diffs included",
                hint=f"{_DAMAGED_HINT}; nothing in it was changed",
            )
        if damage.whole_length is None:
            return StorageError(
                self.path,
                "open",
                f"{where} holds a damaged record at offset {damage.offset} (type "
                f"{damage.kind}, a recycled log's, which imq never writes; or a damaged "
                "length field before it led there): RocksDB's recovery could loop for "
                "ever on it",
                hint=f"{_DAMAGED_HINT}; nothing in it was changed",
            )
        lost = (
            "drop it and every edit after it, and delete the table files they added"
            if manifest
            else "silently drop it and every record after it, committed diffs included"
        )
        return StorageError(
            self.path,
            "open",
            f"{where} holds a damaged record at offset {damage.offset}: its length field "
            f"runs past the file's end, yet the record is whole at {damage.whole_length} "
            "bytes (its checksum matches there): RocksDB's open would take it for a write "
            f"cut short by a crash and {lost}",
            hint=f"{_DAMAGED_HINT}; nothing in it was changed (on a copy, the 2 bytes at "
            f"offset {damage.offset + 4} of {damage.name} set to {damage.whole_length} "
            "little-endian repair the length field)",
        )

    def _open_read_only(self) -> tuple[Any, dict[Table, Any], dict[Table, Any]]:
        """The read-only open, beside a live writer: RocksDB reads the MANIFEST, then the
        logs, and the writer's flushes and compactions meanwhile can delete a table file
        it was about to read (the open fails) or a log whose rows one table had flushed
        and the others had not (a view torn across tables: measured by an outside audit,
        ``imq verify`` then reported damage). So an open that failed while the files
        changed is tried again, and so is one during which a log was deleted (a log
        created meanwhile holds only later writes: see :func:`_no_log_deleted`), for up
        to ``_READ_ONLY_BUDGET`` seconds. A compaction alone cannot tear the view: the
        open holds every table file it read.

        Only RocksDB's own open must see no log deleted, so the window watched is that
        open alone, not the checks before it: a log the checks find gone is one the open
        cannot read, and one created after them is a live writer's newest (not what a
        crash left)."""
        self._make_shadow()
        failure: BaseException | None = None
        deadline = time.monotonic() + _READ_ONLY_BUDGET
        attempts = 0
        while not attempts or time.monotonic() < deadline:
            if attempts:
                # Growing and jittered: a writer that flushes on a steady beat (every few
                # ms, say) would otherwise meet attempts paced like it in the same phase
                # every time (measured: 6 of 76 opens failed all of 20 attempts with a
                # fixed 5 ms pause beside a writer flushing every 19 ms).
                time.sleep(_READ_ONLY_PAUSE * min(attempts, 8) * _jitter.uniform(0.5, 1.5))
            attempts += 1
            listed = self._files_now()
            try:
                self._tables_before = self._check_directory()
                self._check_logs()
                before = self._files_now()
                # Right before the view is taken: whether an import was writing as it was
                # (verify's question; the checks above can take seconds).
                self.import_lock_at_open = import_lock_held(self.path)
                opened = self._open_rocksdb()
            except (StorageError, FileNotFoundError) as exc:
                if self._files_now() == listed:  # the files held still: their own failure
                    if isinstance(exc, StorageError):
                        raise
                    raise self._unreadable_log(exc) from exc
                failure = exc
                continue
            if _no_log_deleted(before, self._files_now()):
                return opened
            _close_rdict(opened)
            failure = None
        last = "" if failure is None else f" (the last attempt failed: {failure})"
        raise StorageError(
            self.path,
            "open (read-only)",
            f"the live writer changed the database's files during each of {attempts} "
            f"attempts in {_READ_ONLY_BUDGET:g} s{last}",
            hint="it is flushing or compacting without pause: try again, or open a copy",
        )

    def _files_now(self) -> tuple[Any, ...]:
        """What a writer's flush or compaction changes: the current MANIFEST and its size,
        and the log files (``None`` parts where they cannot be read)."""
        try:
            current = (self.path / "CURRENT").read_bytes()
            manifest = os.stat(self.path / current.decode("ascii").strip()).st_size
            logs = tuple(wal.log_files(os.listdir(self.path)))
        except (OSError, UnicodeDecodeError):
            return (None,)
        return current, manifest, logs

    def _open_rocksdb(
        self, *, point_in_time: bool = False
    ) -> tuple[Any, dict[Table, Any], dict[Table, Any]]:
        where = self._rocksdb_path()
        try:
            db = open_rdict(
                where, self.options, read_only=self.read_only, point_in_time=point_in_time
            )
        except Exception as exc:
            text = str(exc)
            if "While lock file" in text or "lock hold by" in text or "/LOCK:" in text:
                raise DatabaseLockedError(f"queue database {self.path} is locked: {exc}") from exc
            text = shadow.real_names(text)
            raise self._open_error(text, "open queue database", text) from exc
        tables = {t: db.get_column_family(t.value) for t in Table}
        handles = {t: db.get_column_family_handle(t.value) for t in Table}
        return db, tables, handles

    def _open_error(self, text: str, operation: str, reason: str) -> ImqError:
        """The typed error of a failed RocksDB read at open, from RocksDB's ``text``: the
        file system's refusal (not damage, as for imq's own opens) is a
        :class:`FileAccessError` of ``operation``; anything else a :class:`StorageError`
        saying ``reason``."""
        hint = _open_hint(text, read_only=self.read_only)
        refused = _refusal(text)
        if refused is not None:
            return FileAccessError(self.path, operation, refused, hint)
        return StorageError(self.path, "open", reason, hint=hint)

    def _make_shadow(self) -> None:
        """For a read-only open of a directory rocksdict cannot write its config file
        into: the private directory of links RocksDB opens instead (:class:`shadow.Shadow`)."""
        if shadow.writable_for_rocksdict(self.path):
            return
        try:
            self._shadow = shadow.Shadow(self.path)
        except OSError as exc:  # tempfile's "no usable temporary directory" included
            where = shadow.temporary_directory(exc)
            error = FileAccessError(
                where or "the temporary directory ($TMPDIR, else /tmp)",
                f"make a temporary directory of links to {self.path} in",
                exc,
                shadow.SHADOW_HINT,
            )
            error.filename = where  # None when no directory was usable: no path to name
            raise error from exc

    def _rocksdb_path(self) -> Path:
        """Where RocksDB opens the database: its directory, or the private directory of
        links of :meth:`_make_shadow`, linked again now."""
        return self.path if self._shadow is None else self._shadow.link()

    def _remove_shadow(self) -> None:
        if self._shadow is not None:
            self._shadow.remove()

    def _check_schema(self) -> None:
        raw = self.get_latest(Table.VARS, codec.SCHEMA_VERSION_KEY)
        if raw is None and self.read_only and self._tables_before:
            raise self._data_without_version()
        if raw is None and self.read_only:
            raise SchemaVersionError(
                f"queue database {self.path} has no schema version: it is not an imq queue, "
                "or a writer never finished creating it (a writer's open completes it) or "
                "it is damaged (restore it from a copy); nothing in it was changed"
            )
        if raw is None:
            if self._tables_before or any(self._has_rows(t) for t in Table if t is not Table.VARS):
                raise self._data_without_version()
            self._tables[Table.VARS].put(
                codec.SCHEMA_VERSION_KEY, codec.u32_value(codec.SCHEMA_VERSION), self._sync
            )
            return
        version = codec.decode_u32(codec.SCHEMA_VERSION_KEY, raw)
        if version != codec.SCHEMA_VERSION:
            raise SchemaVersionError(
                f"queue database {self.path} has schema version {version}; "
                f"this imq reads version {codec.SCHEMA_VERSION}: open it with the imq "
                "version that wrote it, or import a persistent state into a new directory "
                "(nothing in it was changed)"
            )

    def _cursor(self, scan: Scan) -> Cursor:
        """A cursor of ``scan`` on this store; a scan of the message table reads around
        the block cache when ``StoreOptions.message_scans_fill_cache`` is off (see
        ``QueueConfig.message_scans_fill_cache`` for what that trades)."""
        fill = scan.table is not Table.MESSAGES or self.options.message_scans_fill_cache
        return Cursor(
            self._tables[scan.table], scan, self.path, fill_cache=fill, read_only=self.read_only
        )

    def _has_rows(self, table: Table) -> bool:
        cursor = Cursor(self._table(table), Scan(table, b"", None, keys_only=True), self.path)
        try:
            return next(iter(cursor.items), None) is not None
        finally:
            cursor.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def register(self, resource: Closable) -> None:
        """Track a long-lived reader (an iterator) so :meth:`close` can release it first:
        a live RocksDB iterator keeps the database open and its lock held."""
        self._resources.add(resource)

    @property
    def dead(self) -> StorageError | None:
        """The failure that killed this handle (a failed write), or ``None``."""
        return self._dead

    @property
    def importing_now(self) -> bool:
        return self._importing > 0

    @contextlib.contextmanager
    def importing(self) -> Iterator[None]:
        """Hold ``IMPORT_LOCK_FILE`` (an exclusive ``flock``) while an import writes, so
        that a reader of another handle or process tells it from an import a crash left
        (:func:`import_lock_held`). Best effort: where the file cannot be created or
        locked, readers take the import for an interrupted one (their warning says to
        roll it back; nothing is hidden). Released in every case, a failed write's
        included: a dead handle's marker stays for the next open to roll back. Released
        with ``LOCK_UN``, not only by closing the descriptor: a copy of it that a child
        forked outside Python's fork hooks keeps (a C library's ``fork``) would keep the
        lock held (a child forked through Python closes its copies at the fork, see
        ``_LOCK_FDS``)."""
        fd, owner = -1, os.getpid()
        try:
            fd = _open_lock_file(self.path / IMPORT_LOCK_FILE, os.O_RDWR | os.O_CREAT)
            _flock_retrying(fd)
        except BaseException as exc:  # an interrupt must not leave the lock taken
            if fd >= 0:
                _unlock(fd)
            if not isinstance(exc, OSError):
                raise
            fd = -1
        self._importing += 1
        try:
            yield
        finally:
            self._importing -= 1
            # Another process: a child forked inside the import, which closed its copy at
            # the fork (the number may name another file of the child's by now).
            if fd >= 0 and os.getpid() == owner:
                _unlock(fd)

    def close(self) -> str | None:
        """Close the database and release the directory (idempotent; never raises).

        The lock is released whatever RocksDB raises; a RocksDB error while closing is
        returned as text (``None`` when the close was clean) for the caller to log.
        Opening the directory again replays RocksDB's log.
        """
        if self._closed:
            return None
        if self._forked:
            self._close_in_forked_child()
            return None
        failure: Exception | None = None
        with self._gate:
            if self._closed:
                return None
            self._closed = True
            self._stop_mark_timer()  # the close syncs the mark itself, below
            self._forget_memory()
            self._compactions.wait_for_others()  # none can start now
            if not self._views.wait_for_others(_VIEW_WAIT):  # nor a view
                failure = StorageError(
                    self.path,
                    "close",
                    f"a read view of another thread was still open after {_VIEW_WAIT:.0f} s "
                    "(not closed: leaked?); it keeps RocksDB, and the directory's lock, "
                    "open in this process until it is dropped",
                )
            try:
                for resource in list(self._resources):
                    try:
                        resource.close_for_queue()
                    except Exception as exc:  # keep closing: the lock must be released
                        failure = failure or exc
                self._tables.clear()
                self._handles.clear()
                if (
                    not self.read_only
                    and self._db is not None
                    and self._dead is None
                    and not self._refused
                ):
                    self._sync_at_close()
                db, self._db = self._db, None
                if db is not None:
                    try:
                        db.close()
                    except Exception as exc:
                        failure = failure or exc
            finally:
                with self._mark_lock:
                    if self._synced_fd >= 0:
                        with contextlib.suppress(OSError):
                            os.close(self._synced_fd)
                        self._synced_fd = -1
                self._release_lock()
                self._remove_shadow()
        return None if failure is None else str(failure)

    def _sync_at_close(self) -> None:
        """Sync the log and the mark of it: a clean close leaves every write synced and
        marked, so a later open that recovers less (its MANIFEST or log cut short) is
        refused. A failure leaves the mark as it was (lagging: a weaker check)."""
        try:
            self._db.flush_wal(True)
        except Exception:
            return
        self._mark_synced(durable=True)

    def _check_open(self) -> None:
        if self._closed:
            raise QueueClosedError(f"queue database {self.path} is closed")
        if self._dead is not None:
            raise self._dead.again()

    def _register(self) -> None:
        """Remember the process that opened this store: a forked child refuses it."""
        self._pid = os.getpid()
        _OPEN_STORES.add(self)

    def _forked_into_child(self) -> None:
        """In a process forked from the one that opened this store (``os.fork``): RocksDB's
        background threads, its locks and the directory's lock stay with the parent, and a
        write here would go into the parent's log behind its back (an outside audit: a
        later crash of the parent then left a log no open could replay). Every call is
        refused from now on; the RocksDB objects are kept alive for good, since their
        destructors wait for threads this process does not have (a hang, or a crash, at
        the child's exit even if it never used the queue)."""
        self._forked = True
        # The parent's timer thread is not here, and may have held the lock at the fork.
        self._mark_lock, self._mark_timer = threading.Lock(), None
        # This process's copies of the directory's lock and of a running import's were
        # closed by the fork hook (never unlocked, which would free the parent's locks):
        # the directory's is forgotten here. So the locks go with the parent, or with its
        # import, and with the parent if it dies; a child that outlived a parent killed
        # without a close (the OOM killer) kept them, and the restarted writer was refused.
        if self._lock_fd >= 0:
            self._lock_fd = -1
            self._lock_finalizer.detach()
        self._dead = StorageError(
            self.path,
            "a call in a forked process",
            f"this queue was opened by process {self._pid}, and this process was forked "
            "from it: RocksDB's threads and the directory's lock stay with that process",
            hint="open the database in this process after the other one has closed it (or "
            "start worker processes with multiprocessing's 'spawn' or 'forkserver' method); "
            "this handle can only be closed",
        )
        kept = [self._db, *self._tables.values(), *self._handles.values()]
        for obj in kept:
            if obj is not None:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))

    def _close_in_forked_child(self) -> None:
        """``close`` in a forked process: nothing of RocksDB's is touched (its objects are
        kept, see :meth:`_forked_into_child`), nor is the parent's lock released: this
        process's copy of the lock's descriptor is closed, which leaves the lock to the
        parent. No gate either: a thread of the parent may have held it at the fork."""
        self._closed = True
        self._release_lock(unlock=False)

    def _table(self, table: Table) -> Any:
        self._check_open()
        try:
            return self._tables[table]
        except KeyError:  # closed between the check and the lookup
            raise QueueClosedError(f"queue database {self.path} is closed") from None

    def _forget_memory(self) -> None:
        """Drop what this handle keeps of the disk's rows in memory (the cache of fresh
        rows, the shards' top diffs): read from RocksDB again, or never, from now on."""
        self.cache.forget()
        self.diff_tops.forget()

    def _interrupted(self, exc: BaseException) -> None:
        """Kill the handle after a write that an exception other than an error (a
        ``KeyboardInterrupt``) cut short: its memory may not match the disk."""
        with contextlib.suppress(Exception):
            self._forget_memory()
        self._dead = self._dead or StorageError(
            self.path,
            "write",
            f"a write was interrupted ({type(exc).__name__}): whether it reached the disk, "
            "this handle cannot tell",
        )

    def _failed(self, operation: str, exc: Exception, hint: str | None = None) -> ImqError:
        """Kill the handle after a failed write: RocksDB refuses writes after an I/O error
        until it is reopened, so every later call says so."""
        if self._closed:
            return QueueClosedError(f"queue database {self.path} closed during {operation}")
        reason = str(exc)
        error = StorageError(self.path, operation, reason, hint=hint or _failed_hint(reason))
        self._dead = self._dead or error
        return error

    # -- reads --------------------------------------------------------------------------------

    def snapshot(self, points: Iterable[Table] = (), scans: Sequence[Scan] = ()) -> Snapshot:
        """Open a consistent view: point reads on ``points``, one cursor per scan. A
        forward scan of the messages table inside one segment is served by the cache
        of fresh rows when it can be (:mod:`imq.storage.cache`)."""
        with self._gate:
            self._check_open()
            snaps: dict[Table, Any] = {}
            cursors: list[Cursor | CursorProtocol] = []
            try:
                for t in points:
                    snaps[t] = self._tables[t].snapshot()
                for s in scans:
                    cached = None
                    if (
                        s.table is Table.MESSAGES
                        and s.hi is not None
                        and not (s.reverse or s.keys_only or s.seekable)
                    ):
                        cached = self._cached(s.lo, s.hi, None)
                    cursors.append(self._cursor(s) if cached is None else cached)
            except BaseException:
                # Cut short (a Ctrl-C): a traceback the host keeps holds this frame, whose
                # RocksDB snapshots and cursors would keep the database and its lock open
                # after the queue's close(). Closed as a finished view's are.
                Snapshot(self, snaps, cursors, self._state).close()
                raise
            state = self._state
            # Counted until closed: its RocksDB snapshots and cursors keep the database
            # open, so close() waits for it, as for a manual compaction. (An iterator's
            # view, message_snapshot, is a registered resource: close() closes it.)
            holder = self._views.start()
        return Snapshot(self, snaps, cursors, state, holder)

    def end_view(self, holder: int) -> None:
        """A view of thread ``holder`` was closed (:meth:`snapshot`)."""
        with self._gate:
            self._views.end(holder)

    @property
    def forked(self) -> bool:
        """Whether this process was forked from the one that opened the store: every call
        is refused, and ``close`` touches no lock (see :meth:`_forked_into_child`)."""
        return self._forked

    def message_snapshot(
        self, bounds: Sequence[tuple[bytes, bytes]], reader: tuple[int, int, int] | None
    ) -> Snapshot:
        """:meth:`snapshot` of the merge iterator's scans: one forward scan of the
        messages table per ``[lo, hi)``; the cache of fresh rows serves every one it can,
        leaving out the rows a reader with destination test ``reader``
        (:func:`imq.iterator.destination_test`) would skip unseen."""
        with self._gate:
            self._check_open()
            cache = self.cache
            # Every range at once (one call to C); a segment not known yet gets its
            # second chance in _cache_miss, which starts watching it.
            found = cache.scan_many(list(bounds), reader) if cache.enabled else None
            cursors: list[Cursor | CursorProtocol] = []
            hits = 0
            try:
                for i, (lo, hi) in enumerate(bounds):
                    cached = None
                    if found is not None:
                        cached = found[i]
                        if cached is None:
                            cached = self._cache_miss(lo, hi, reader)
                        else:
                            hits += 1
                    cursors.append(
                        self._cursor(Scan(Table.MESSAGES, lo, hi)) if cached is None else cached
                    )
            except BaseException:  # cut short: let go of RocksDB, as snapshot() does
                Snapshot(self, {}, cursors, self._state).close()
                raise
            cache.hits += hits
            state = self._state
        return Snapshot(self, {}, cursors, state)

    def _cached(
        self, lo: bytes, hi: bytes, reader: tuple[int, int, int] | None
    ) -> CursorProtocol | None:
        """The cache's answer to ``[lo, hi)`` of the messages table, or ``None``. A
        segment seen for the first time is watched from now on. Under the gate."""
        cache = self.cache
        if not cache.enabled:
            return None
        rows = cache.scan(lo, hi, reader)
        if rows is None:
            return self._cache_miss(lo, hi, reader)
        cache.hits += 1
        return cast(CursorProtocol, rows)

    def _cache_miss(
        self, lo: bytes, hi: bytes, reader: tuple[int, int, int] | None
    ) -> CursorProtocol | None:
        """After the cache declined ``[lo, hi)``: if it does not know the range's segment
        yet, it starts watching it here; if it does, the segment may load its rows below
        the floor (:meth:`MessageCache.missed`). Then the cache is asked again. Under the
        gate."""
        cache = self.cache
        if len(lo) < _SEGMENT:  # not inside one segment: never the cache's
            return None
        prefix = lo[:_SEGMENT]
        if cache.unknown((prefix,)):
            self._establish(prefix)
            rows = cache.scan(lo, hi, reader)
            if rows is not None:
                cache.hits += 1
                return cast(CursorProtocol, rows)
        # Declined by a known segment: at its second such scan, its rows below the floor.
        floor = cache.missed(prefix)
        below = None if floor is None else self._load_below(prefix, floor)
        if below is not None:
            try:
                cache.extend_down(prefix, below)
            except BaseException:
                # Cut short (what a signal handler raised, landing mid-splice): the
                # segment's lists may be out of step. A forgotten cache is always right.
                cache.forget()
                raise
            rows = cache.scan(lo, hi, reader)
            if rows is not None:
                cache.hits += 1
                return cast(CursorProtocol, rows)
        cache.misses += 1
        return None

    def cached_counts(self, ranges: Sequence[tuple[bytes, bytes]]) -> list[int | None]:
        """For each ``(lo, hi)`` (inside one segment), the message rows with
        ``lo <= key < hi`` when the cache of fresh rows holds them all, else ``None``
        (count them in RocksDB). One pass under the gate for all of them."""
        with self._gate:
            self._check_open()
            if not self.cache.enabled:
                return [None] * len(ranges)
            count = self.cache.count
            return [count(lo, hi) for lo, hi in ranges]

    def message_cache_stats(self) -> dict[str, int]:
        """The cache of fresh rows: see :meth:`imq.storage.cache.MessageCache.stats`."""
        with self._gate:
            return self.cache.stats()

    @property
    def state(self) -> QueueState:
        """The queue state as of the last write."""
        return self._state

    def load_table(self, table: Table) -> list[tuple[bytes, bytes]]:
        """Every row of a small table (used at open to load the queue state)."""
        cursor = Cursor(
            self._table(table), Scan(table, b"", None), self.path, read_only=self.read_only
        )
        try:
            return list(cursor.items)
        finally:
            cursor.close()

    def get_latest(self, table: Table, key: bytes) -> bytes | None:
        rdict = self._table(table)
        try:
            value: bytes | None = rdict.get(key)
        except Exception as exc:
            rdict = None  # a kept error's traceback keeps this frame: no table handle in it
            if self._closed:
                raise QueueClosedError(f"queue database {self.path} is closed") from exc
            raise _read_error(self.path, table, key, exc, read_only=self.read_only) from None
        return value

    # -- writes -------------------------------------------------------------------------------

    def _read_only_error(self) -> ReadOnlyError:
        return ReadOnlyError(f"queue database {self.path} is open read-only")  # + next_step

    def transaction(self) -> Transaction:
        self._check_open()
        if self.read_only:
            raise self._read_only_error()
        return Transaction(self._handles, keep_messages=self.cache.enabled)

    def write(self, txn: TransactionProtocol, *, sync: bool = False) -> None:
        """Write ``txn`` atomically and publish its queue-state updates."""
        if not isinstance(txn, Transaction):
            raise TypeError(f"a RocksDB store writes Transaction, not {type(txn).__name__}")
        with self._gate:
            self._check_open()
            cache = self.cache
            if txn.kept and not txn.cache_blind:
                # Segments this batch writes first: their floor is what is stored before
                # it, so the batch's own rows are cached.
                for prefix in cache.unknown(txn.kept):
                    self._establish(prefix)
            failed: ImqError | None = None
            written = False
            try:
                try:
                    self._db.write(txn.batch)
                    written = True
                    if sync:
                        # The same guarantee as a write with sync set (the log synced up
                        # to and with this batch before the call returns), but rocksdict
                        # holds the GIL through a write, fsync included, and releases it
                        # in flush_wal: the host's other threads run while the disk syncs.
                        self._db.flush_wal(True)
                        self._mark_synced()
                except Exception as exc:
                    if type(exc) is not Exception:  # not RocksDB's: handled below
                        raise
                    # rocksdict raises a bare Exception("IO error"): whatever the batch
                    # did, memory must not vouch for it
                    self._forget_memory()
                    if written:  # the batch is in the log and the memtable, unsynced
                        failed = self._failed(StorageError.UNSYNCED_OPERATION, exc, _UNSYNCED_HINT)
                    else:
                        failed = self._failed("write", exc)
                    failed.__cause__ = exc
                else:
                    self.diff_tops.after_write(txn.diffs_blind, txn.diff_tops)
                    if txn.cache_blind or not txn.kept_all:
                        cache.forget()
                    elif txn.kept or txn.deleted_messages:
                        cache.after_write(
                            txn.kept, txn.deleted_messages, in_order=txn.kept_in_order
                        )
                    state = self._state
                    for update in txn.state_updates:
                        state = update(state)
                    self._state = state
            except BaseException as exc:
                # Any other exception between RocksDB taking the batch, or not, and this
                # handle's memory following it: a KeyboardInterrupt, or what a signal
                # handler raised there (an alarm's TimeoutError), or a failure half-way
                # through the memory's update. Whether the batch reached the disk, and how
                # far the memory followed, the handle cannot tell. It dies, so that no
                # later call answers from a state, cache or tops the disk no longer matches.
                self._interrupted(exc)
                raise
            if failed is not None:
                raise failed

    def _establish(self, prefix: bytes) -> None:
        """Start watching the segment ``prefix`` above its greatest stored key. Under
        the gate. On a read error the segment stays unknown: RocksDB serves its scans,
        and reports the damage."""
        try:
            end = codec.prefix_end(prefix)
        except ValueError:  # only 0xff bytes: no segment of real keys looks like that
            return
        try:
            top = self._segment_top(prefix, end)
        except Exception:  # a read error: leave the segment to RocksDB
            return
        self.cache.establish(prefix, top)

    def _segment_top(self, prefix: bytes, end: bytes) -> bytes:
        """The segment's greatest stored key, or the prefix when it holds none: one
        reverse seek. Raises on a read error."""
        cursor = self._cursor(Scan(Table.MESSAGES, prefix, end, seekable=True))
        try:
            return cursor.last() or prefix
        finally:
            cursor.close()

    def _load_below(self, prefix: bytes, floor: bytes) -> list[Row] | None:
        """Every stored row of the segment ``prefix`` at or below ``floor``, read
        forwards, if they fit in the cache's load limit; ``None`` once they exceed it (a
        little past it: whole batches) or on a read error (a damaged block: RocksDB
        reports it when a scan reads it). Under the gate."""
        limit = self.cache.load_limit
        if limit <= 0:
            return None
        cursor = self._cursor(Scan(Table.MESSAGES, prefix, floor + b"\x00"))  # just above it
        try:
            items = cursor.items  # checked at their end: a damaged block raises
            rows: list[Row] = []
            size, row_size = 0, 128  # bytes read; a row's guessed size (a small message)
            while size <= limit:
                # Batches pulled in C, sized to end near the limit.
                n = min(1024, (limit - size) // row_size + 1)
                batch = list(islice(items, n))
                rows += batch
                batch_size = sum(len(k) + len(v) for k, v in batch)
                size += batch_size
                if len(batch) < n:  # the rows ended (and their end was checked)
                    return rows if size <= limit else None
                row_size = max(1, batch_size // n)
            return None
        except Exception:
            return None
        finally:
            cursor.close()

    def set_state(self, state: QueueState) -> None:
        """Replace the queue state without a write (when loading it at open)."""
        with self._gate:
            self._state = state

    def compact(self, ranges: Iterable[tuple[Table, bytes, bytes]]) -> None:
        """Compact exactly the given key ranges (after a range delete).

        Runs without the gate: RocksDB compaction is safe beside reads and writes.
        """
        opts = CompactOptions()
        for table, lo, hi in ranges:
            self._compact_one(table, lo, hi, opts, fail=True)

    def compact_all(self, progress: Callable[[int, int], object] | None = None) -> None:
        """A full manual compaction of every table (column family), one after another,
        down to the bottommost level; ``progress(tables done, tables)`` after each.
        Like :meth:`compact`, it runs without the gate, beside reads and writes."""
        if self.read_only:
            raise self._read_only_error()
        opts = CompactOptions()
        opts.set_bottommost_level_compaction(BottommostLevelCompaction.force())
        tables = list(Table)
        errors = self._background_errors()
        for done, table in enumerate(tables, start=1):
            self._compact_one(table, None, None, opts, fail=False)
            # rocksdict's compact_range returns no error: a compaction that failed (a
            # full disk, a damaged file) shows only in RocksDB's count of background
            # errors, and as the next write's failure (an outside audit found compact()
            # reporting success on a full disk).
            if self._background_errors() > errors:
                try:  # RocksDB's reason: a flush returns the background error it keeps
                    self._tables[table].flush()
                except Exception as exc:
                    raise self._failed("compaction", exc) from exc
                error = StorageError(
                    self.path,
                    "compaction",
                    f"RocksDB's compaction of table {table.value} failed (a background "
                    f"error; {_free_space(self.path)}); its reason is in the directory's "
                    "LOG file",
                    hint="if the disk is full, free space; close the queue and open it "
                    "again (a compaction changes no data: nothing was lost); if it fails "
                    "again, run `imq verify` on the directory",
                )
                self._dead = self._dead or error  # RocksDB refuses writes until reopened
                raise error
            if progress is not None:
                progress(done, len(tables))

    def _background_errors(self) -> int:
        """RocksDB's count of its background jobs' errors since the open (0 when it
        cannot be read)."""
        try:
            return int(self._db.property_int_value("rocksdb.background-errors") or 0)
        except Exception:  # a property read that fails says nothing of the compaction
            return 0

    def _compact_one(
        self, table: Table, lo: bytes | None, hi: bytes | None, opts: Any, *, fail: bool
    ) -> None:
        """One ``compact_range``, outside the gate but counted, so that :meth:`close`
        waits for it instead of leaving RocksDB open under it (the table's handle keeps
        the database alive); a close that comes first makes it a ``QueueClosedError``.
        ``fail``: an error kills the handle (:meth:`_failed`); else it is raised as is."""
        with self._gate:
            self._check_open()
            rdict = self._tables[table]
            self._compactions.start()
        try:
            rdict.compact_range(lo, hi, opts)
        except Exception as exc:
            rdict = None  # not kept alive by a traceback the caller holds on to
            if self._closed:
                raise QueueClosedError(
                    f"queue database {self.path} closed during compaction"
                ) from exc
            if fail:
                raise self._failed("compaction", exc) from exc
            raise
        finally:
            rdict = None
            with self._gate:
                self._compactions.end()

    def flush(self, tables: Iterable[Table]) -> None:
        """Flush the memtables of ``tables`` to table files. Outside the gate but counted
        as a compaction is, so that :meth:`close` waits for it; a close that comes first
        makes it a ``QueueClosedError``."""
        for table in tables:
            with self._gate:
                self._check_open()
                rdict = self._tables[table]
                self._compactions.start()
            try:
                rdict.flush()
            except Exception as exc:
                rdict = None  # not kept alive by a traceback the caller holds on to
                if self._closed:
                    raise QueueClosedError(
                        f"queue database {self.path} closed during a flush"
                    ) from exc
                raise self._failed("flush", exc) from exc
            finally:
                rdict = None
                with self._gate:
                    self._compactions.end()

    def property_int(self, table: Table, name: str) -> int:
        """A RocksDB integer property of one table (``rocksdb.num-files-at-level0``,
        ``rocksdb.live-sst-files-size``, ...); 0 when RocksDB does not know it."""
        try:
            return int(self._table(table).property_int_value(name) or 0)
        except ImqError:
            raise
        except Exception as exc:
            raise self._failed("property read", exc) from exc

    def disk_usage(self) -> int:
        """Bytes of the files under the database directory but RocksDB's text info logs
        (``LOG``, ``LOG.old.*``), which grow at every open and say nothing of the data (a
        compaction's before and after compared them too, and a compaction that shrank
        the tables could look like growth). RocksDB deletes obsolete files from its
        background threads, so a file listed may be gone by the time it is measured: it
        counts nothing (it raised ``FileNotFoundError`` before)."""
        total = 0
        try:
            for f in self.path.rglob("*"):
                if f.name == "LOG" or f.name.startswith("LOG.old."):
                    continue
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
        except OSError as exc:  # out of file descriptors, a permission changed
            raise FileAccessError(self.path, "measure the files of", exc) from exc
        return total
