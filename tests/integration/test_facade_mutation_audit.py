"""Tests from a mutation audit of ``imq/queue.py`` (the facade: argument checks, open
and close, read-only mode, the GC worker's start and stop), ``imq/locks.py``,
``imq/pending.py``, ``imq/storage/shadow.py`` and ``imq/storage/memory.py``: each pins a
rule of the docs that a small change to that code broke without any other test failing.

Real RocksDB in ``tmp_path``; the storage tests run each rule on both backends (the
RocksDB store and its in-memory model, which must answer alike); the lock tests drive
``RWLock`` and ``PendingRegistry`` directly, with threads that wait for state, not time.
"""

from __future__ import annotations

import io
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import (
    MC,
    Chain,
    address_in,
    block,
    diff_hash,
    make_diff,
    message,
    open_queue,
    quarter_shards,
    quiet_config,
    rows,
    top,
)
from threads import TIMEOUT, started

from imq import (
    BlockIdShort,
    ImqError,
    Queue,
    QueueClosedError,
    QueueDiff,
    QueueKey,
    ReadOnlyError,
    StorageError,
    verify,
)
from imq.locks import RWLock, ShardLocks
from imq.observability import capture_events
from imq.pending import PendingRegistry
from imq.queue import store_options
from imq.storage import StoreProtocol, Table, shadow
from imq.storage.memory import MemoryStore
from imq.storage.rocks import Scan, Store

SHARDS = quarter_shards()
LEFT = SHARDS[0]


# -- open and close -------------------------------------------------------------------------------


def test_an_open_that_fails_after_rocksdb_opened_releases_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """architecture/api: a failed open leaves nothing open; ``Queue._on_store`` closes
    the store when building the queue over it fails, so the directory's lock is free and
    the next open succeeds (the failure's traceback, which holds the store, still alive)."""
    path = tmp_path / "db"
    open_queue(path).close()

    def boom(store: object) -> list[str]:
        raise RuntimeError("the check at open failed")

    monkeypatch.setattr(verify, "state_problems", boom)
    with pytest.raises(RuntimeError, match="the check at open failed") as failed:
        open_queue(path)
    monkeypatch.undo()
    with open_queue(path) as q:  # DatabaseLockedError if the failed open kept RocksDB
        assert not q.closed
    assert failed.value is not None


def test_a_second_close_does_nothing(tmp_path: Path) -> None:
    """api.md: ``close()`` is idempotent: a second one closes nothing again and logs no
    second ``queue_closed``."""
    q = open_queue(tmp_path / "db")
    with capture_events() as events:
        q.close()
        q.close()
    assert [e["event"] for e in events if e["event"].startswith("queue_closed")] == ["queue_closed"]
    assert q.closed and q.close_error is None


def test_close_stops_the_gc_workers_thread(tmp_path: Path) -> None:
    """api.md: ``close()`` stops GC: when it returns the worker's thread has ended, also
    when it was waiting out a long interval (1 h here) between passes."""
    before = {t for t in threading.enumerate() if t.name == "imq-gc"}
    q = Queue.open(tmp_path / "db", quiet_config(gc_enabled=True))
    assert q.gc_worker is not None
    assert q.gc_worker.tick(timeout=60)  # the thread is now waiting for the next interval
    q.close()
    left = {t for t in threading.enumerate() if t.name == "imq-gc" and t.is_alive()} - before
    assert left == set()


def test_compact_on_a_read_only_queue_is_refused(tmp_path: Path) -> None:
    """api.md / architecture "Read-only inspection": every call that would write raises
    ``ImqError`` on a read-only handle; ``compact()`` rewrites the table files, so it is
    one of them, refused before any work."""
    path = tmp_path / "db"
    with open_queue(path) as q:
        Chain(q).apply(LEFT, 2)
    calls: list[tuple[int, int]] = []
    with Queue.open(path, quiet_config(), read_only=True) as view:
        with pytest.raises(ImqError, match=r"compact: .* is open read-only"):
            view.compact(lambda done, total: calls.append((done, total)))
        assert view.get_last_applied_seqno(LEFT) == 1
    assert calls == []


def test_a_read_only_refusal_gives_its_next_step_once(tmp_path: Path) -> None:
    """Every write call on a read-only handle raises ``ReadOnlyError`` naming the call
    and the path, then what to do, once (the class appends its ``next_step``; a message
    that also carried it said it twice)."""
    path = tmp_path / "db"
    with open_queue(path) as q:
        Chain(q).apply(LEFT, 2)
    step = ReadOnlyError.next_step
    with Queue.open(path, quiet_config(), read_only=True) as view:
        calls: dict[str, Callable[[], object]] = {
            "prepare_diff": lambda: view.prepare_diff(
                QueueDiff(), BlockIdShort(LEFT, 9), bytes(32)
            ),
            "apply_diff": lambda: view.apply_diff(QueueDiff(), BlockIdShort(LEFT, 9), bytes(32)),
            "commit_diff": lambda: view.commit_diff([top(MC, 1)]),
            "clear_uncommitted_state": view.clear_uncommitted_state,
            "run_gc": view.run_gc,
            "compact": view.compact,
        }
        for name, call in calls.items():
            with pytest.raises(ReadOnlyError) as caught:
                call()
            text = str(caught.value)
            assert text.startswith(f"{name}: queue {path} is open read-only"), text
            assert text.count(step) == 1 and text.endswith(step), text
            assert text.count("read_only=True") == 1, text


class _FailingClose:
    """rocksdict's handle, whose ``close`` closes and then reports a failure, as RocksDB
    does when a background job failed (a compaction that met a damaged table file)."""

    def __init__(self, db: Any) -> None:
        self._db = db

    def close(self) -> None:
        self._db.close()
        raise OSError("IO error: injected background failure")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def test_a_failure_while_closing_is_kept_in_close_error(tmp_path: Path) -> None:
    """api.md ``close_error``: RocksDB's error while the queue closed is kept there (a
    caller that must know its work was done checks it after ``close()``), and logged;
    the directory is released all the same."""
    path = tmp_path / "db"
    q = open_queue(path)
    Chain(q).apply(LEFT, 2)
    q._store._db = _FailingClose(q._store._db)  # type: ignore[attr-defined]
    with capture_events() as events:
        q.close()
    assert q.closed
    assert q.close_error is not None and "injected background failure" in q.close_error
    assert [e["event"] for e in events if e["event"].startswith("queue_closed")] == [
        "queue_closed_with_error"
    ]
    with open_queue(path) as again:
        assert again.get_last_applied_seqno(LEFT) == 1


# -- the in-memory store behaves as the RocksDB one -----------------------------------------------


@pytest.fixture(params=["rocksdb", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreProtocol]:
    """One store of each backend: ``MemoryStore`` is the model of ``Store`` and must
    answer every call as it does (architecture, storage backends)."""
    made: StoreProtocol
    if request.param == "rocksdb":
        made = Store(tmp_path / "db", store_options(quiet_config()))
    else:
        made = MemoryStore(str(tmp_path / "memory"))
    try:
        yield made
    finally:
        made.close()


def _row(store: StoreProtocol, key: bytes) -> None:
    txn = store.transaction()
    txn.put(Table.VARS, key, b"value")
    store.write(txn)


def test_a_closed_store_refuses_transactions_and_writes(store: StoreProtocol) -> None:
    """api.md: a call on a closed queue raises ``QueueClosedError``; below the facade both
    stores refuse a new transaction, and the write of one staged before the close."""
    staged = store.transaction()
    staged.put(Table.VARS, b"late", b"row")
    store.close()
    with pytest.raises(QueueClosedError):
        store.transaction()
    with pytest.raises(QueueClosedError):
        store.write(staged)


def test_a_reverse_scan_without_an_upper_bound_is_refused(store: StoreProtocol) -> None:
    """``Scan``: a reverse scan needs ``hi``; both stores refuse one without."""
    _row(store, b"a")
    with pytest.raises(ValueError, match="reverse scan needs an upper bound"):
        store.snapshot(scans=[Scan(Table.VARS, b"", None, reverse=True)]).close()


def test_compact_all_reports_each_table_done_from_one(store: StoreProtocol) -> None:
    """api.md ``compact(progress)``: ``progress(tables done, tables)`` after each table,
    so the calls run from 1 to the number of tables."""
    calls: list[tuple[int, int]] = []
    store.compact_all(lambda done, total: calls.append((done, total)))
    assert calls == [(n, len(Table)) for n in range(1, len(Table) + 1)]


def test_an_empty_or_inverted_delete_range_stages_nothing(store: StoreProtocol) -> None:
    """``delete_range(lo, hi)`` deletes ``[lo, hi)``: with ``hi <= lo`` there is nothing
    to delete, and neither store stages an operation or a range to compact."""
    _row(store, b"k")
    txn = store.transaction()
    txn.delete_range(Table.VARS, b"z", b"a")
    txn.delete_range(Table.VARS, b"k", b"k")
    assert len(txn) == 0
    assert txn.deleted_ranges == []
    assert not txn.diffs_blind
    store.write(txn)
    assert store.get_latest(Table.VARS, b"k") == b"value"


def test_a_snapshot_reads_the_rows_of_its_instant(store: StoreProtocol) -> None:
    """architecture: a read is one snapshot: rows written after it was taken, changed or
    new, are not seen through it, by either store."""
    _row(store, b"k")
    with store.snapshot(points=[Table.VARS]) as snap:
        txn = store.transaction()
        txn.put(Table.VARS, b"k", b"changed")
        txn.put(Table.VARS, b"new", b"row")
        store.write(txn)
        assert snap.get(Table.VARS, b"k") == b"value"
        assert snap.get(Table.VARS, b"new") is None
    assert store.get_latest(Table.VARS, b"k") == b"changed"


def _rows(store: StoreProtocol, *keys: bytes) -> None:
    txn = store.transaction()
    for k in keys:
        txn.put(Table.VARS, k, b"v-" + k)
    store.write(txn)


def test_scans_cover_their_half_open_range(store: StoreProtocol) -> None:
    """A ``Scan`` reads ``[lo, hi)``: the row at ``hi`` is left out, forwards and in
    reverse, by both stores."""
    _rows(store, b"b", b"d", b"f")
    scans = [Scan(Table.VARS, b"b", b"f"), Scan(Table.VARS, b"b", b"f", reverse=True)]
    with store.snapshot(scans=scans) as snap:
        forward, backward = ([row[0] for row in c.items] for c in snap.cursors)
    assert forward == [b"b", b"d"]
    assert backward == [b"d", b"b"]


def test_a_seekable_cursor_counts_and_finds_the_last_key_inside_its_bounds(
    store: StoreProtocol,
) -> None:
    """A seekable cursor's ``last()`` is the greatest key of its ``[lo, hi)`` (``None``
    when only keys below ``lo`` exist), and ``count(lo, hi)`` counts ``[lo, hi)`` inside
    the cursor's bounds: 0 for an empty or inverted range. The model answers as RocksDB
    does."""
    _rows(store, b"b", b"d", b"f")
    scans = [
        Scan(Table.VARS, b"c", b"e", seekable=True),
        Scan(Table.VARS, b"x", b"z", seekable=True),
        Scan(Table.VARS, b"\x00", b"c", seekable=True),
    ]
    with store.snapshot(scans=scans) as snap:
        inside, above, below = snap.cursors
        assert inside.last() == b"d"
        assert above.last() is None
        assert below.last() == b"b"
        assert inside.count(b"c", b"e") == 1
        assert inside.count(b"e", b"c") == 0
        assert inside.count(b"d", b"d") == 0


def test_delete_range_leaves_the_row_at_its_upper_bound(store: StoreProtocol) -> None:
    """``delete_range(lo, hi)`` deletes ``[lo, hi)`` (a RocksDB range tombstone): the row
    at ``hi`` stays, in the model as in RocksDB."""
    _rows(store, b"b", b"c", b"d", b"f")
    txn = store.transaction()
    txn.delete_range(Table.VARS, b"b", b"d")
    store.write(txn)
    assert [store.get_latest(Table.VARS, k) for k in (b"b", b"c", b"d", b"f")] == [
        None,
        None,
        b"v-d",
        b"v-f",
    ]


def test_a_closed_store_refuses_point_reads(store: StoreProtocol) -> None:
    """A read on a closed queue raises ``QueueClosedError``: both stores' ``get_latest``
    (the point read of a diff's record before a prepare) refuse once closed."""
    _row(store, b"k")
    assert store.get_latest(Table.VARS, b"k") == b"value"
    store.close()
    with pytest.raises(QueueClosedError):
        store.get_latest(Table.VARS, b"k")


def test_a_put_into_diff_info_makes_the_batch_blind_to_the_remembered_tops(
    store: StoreProtocol,
) -> None:
    """``imq.storage.tops``: a batch that writes a diff-info row other than through
    ``put_diff_record`` is blind, so the store forgets the shards' remembered tops after
    it; the model marks it as the RocksDB store does."""
    txn = store.transaction()
    txn.put(Table.VARS, b"k", b"v")
    assert not txn.diffs_blind
    txn.put(Table.DIFF_INFO, b"\x00" * 8, b"record")
    assert txn.diffs_blind


# -- argument checks and clear --------------------------------------------------------------------


@pytest.mark.parametrize("wrong", ["mc:1", None, (0, 1)])
def test_commit_diff_refuses_a_top_block_of_the_wrong_type(tmp_path: Path, wrong: object) -> None:
    """api.md conventions: a value of the wrong type is a ``TypeError``, raised before any
    work; ``commit_diff`` checks each item of ``top_blocks``, not only the list."""
    with open_queue(tmp_path / "db") as q:
        chain = Chain(q)
        chain.apply(MC, 0)
        with pytest.raises(TypeError, match="top block"):
            q.commit_diff([top(MC, 1), wrong])  # type: ignore[list-item]
        assert q.get_last_committed_mc_block_id() is None


def test_a_clear_keeps_a_committed_message_at_the_highest_key(tmp_path: Path) -> None:
    """api.md ``clear_uncommitted_state``: everything *above* the commit pointers goes. A
    pointer on ``QueueKey.MAX`` (the shard's last committed message has the highest key)
    has nothing above it: the clear keeps that message and its diff."""
    with open_queue(tmp_path / "db") as q:
        chain = Chain(q)
        highest = message(QueueKey.MAX, address_in(LEFT, 0), address_in(LEFT, 1000))
        diff = make_diff([highest])
        q.apply_diff(diff, block(LEFT, 1), diff_hash("max"))
        chain.apply(MC, 0)
        q.commit_diff([top(MC, 1), top(LEFT, 1, 1)])
        assert q.get_commit_pointers()[LEFT].key == QueueKey.MAX
        q.clear_uncommitted_state(top_shards=[LEFT])
        assert q.get_last_applied_seqno(LEFT) == 1
        assert q.get_diff_info(LEFT, 1) is not None
        assert len(rows(q, Table.MESSAGES)) == 1


# -- read-only opens through a directory of links (shadow) ----------------------------------------


@pytest.fixture
def links_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own temporary directory: where the directories of links go."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


def test_removed_links_are_no_longer_named_as_their_database(
    tmp_path: Path, links_dir: Path
) -> None:
    """architecture "Read-only inspection": RocksDB's error texts name the real directory
    instead of a *live* directory of links; once removed, that directory is forgotten."""
    db = tmp_path / "db"
    open_queue(db).close()
    links = shadow.Shadow(db)
    text = f"IO error: {links.path}/CURRENT"
    assert shadow.real_names(text) == f"IO error: {db}/CURRENT"
    links.remove()
    assert shadow.real_names(text) == text


# -- calls that would deadlock are refused ------------------------------------------------------


def test_run_gc_by_a_thread_holding_a_pending_diff_is_refused(tmp_path: Path) -> None:
    """architecture "Locking": a thread that holds a pending diff calling ``run_gc`` is
    refused with ``ImqError`` (a pass waits for shards' mutexes), also when GC has
    nothing to do; once the diff is written the same call runs."""
    with open_queue(tmp_path / "db") as q:
        chain = Chain(q)
        built = chain.build(LEFT, 2)
        pending = q.prepare_diff(built.diff, built.block, built.hash)
        assert pending is not None
        for call in (q.run_gc, q.run_gc_report):
            with pytest.raises(ImqError, match="run_gc would deadlock"):
                call()
        pending.write()
        assert q.run_gc() == 0


def test_a_prepare_waiting_for_a_shard_is_woken_by_close(tmp_path: Path) -> None:
    """architecture "Locking": ``close()`` wakes every call waiting for a lock, the wait
    for a shard's mutex too: a prepare of a shard whose pending diff is never written
    raises ``QueueClosedError`` at the close instead of waiting on."""
    q = open_queue(tmp_path / "db")
    chain = Chain(q)
    first, second = chain.build(LEFT, 2), chain.build(LEFT, 2)
    pending = q.prepare_diff(first.diff, first.block, first.hash)
    assert pending is not None
    waiter = started(lambda: q.apply_diff(second.diff, second.block, second.hash), "waiter")
    _wait_until(lambda: q._rw.readers == 2, "the second prepare to take its read lock")
    q.close()
    with pytest.raises(QueueClosedError):
        waiter.outcome()
    pending.discard()
    assert q._rw.readers == 0


def test_an_interrupted_call_wakes_the_calls_waiting_for_a_lock(tmp_path: Path) -> None:
    """api.md / ``Queue._interrupt``: a call that takes locks cut short by a
    ``KeyboardInterrupt`` retires the handle, and calls waiting for a lock stop waiting
    and raise the same ``StorageError`` (the lock they wait for may never be released)."""
    q = open_queue(tmp_path / "db")
    chain = Chain(q)
    chain.apply(MC, 0)
    first, second = chain.build(LEFT, 2), chain.build(LEFT, 2)
    pending = q.prepare_diff(first.diff, first.block, first.hash)
    assert pending is not None
    waiter = started(lambda: q.apply_diff(second.diff, second.block, second.hash), "waiter")
    _wait_until(lambda: q._rw.readers == 2, "the second prepare to take its read lock")

    def ctrl_c(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        q.export_state(MC, 1, 1, io.BytesIO(), progress=ctrl_c)
    with pytest.raises(StorageError, match="interrupted"):
        waiter.outcome()
    pending.discard()
    q.close()


def test_a_diff_prepared_before_an_interrupt_is_not_written_after_it(tmp_path: Path) -> None:
    """``Queue._interrupt``: a handle retired by an interrupted call refuses every later
    call; the write of a diff prepared before the interrupt is one, and writes nothing
    (the handle's memory may not match the disk)."""
    path = tmp_path / "db"
    q = open_queue(path)
    chain = Chain(q)
    chain.apply(MC, 0)
    built = chain.build(LEFT, 2)
    pending = q.prepare_diff(built.diff, built.block, built.hash)
    assert pending is not None

    def ctrl_c(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        q.export_state(MC, 1, 1, io.BytesIO(), progress=ctrl_c)
    with pytest.raises(StorageError, match="interrupted"):
        pending.write()
    assert pending.state == "failed"
    q.close()
    with open_queue(path) as again:
        assert again.get_last_applied_seqno(LEFT) is None


def test_a_pending_diff_whose_write_failed_says_failed(tmp_path: Path) -> None:
    """api.md ``PendingDiff.state``: ``failed`` when its write raised (here: the queue
    closed meanwhile), not ``written``; a second write says it failed to write."""
    q = open_queue(tmp_path / "db")
    built = Chain(q).build(LEFT, 2)
    pending = q.prepare_diff(built.diff, built.block, built.hash)
    assert pending is not None
    q.close()
    with pytest.raises(QueueClosedError):
        pending.write()
    assert pending.state == "failed"
    with pytest.raises(ImqError, match="failed to write"):
        pending.write()


def test_a_guard_released_twice_releases_its_locks_once(tmp_path: Path) -> None:
    """``LockGuard``: release is idempotent; the second call releases nothing (not the
    read lock another hold took meanwhile, nor an unlocked mutex)."""
    rw, shard_locks, registry = RWLock(), ShardLocks(), PendingRegistry()
    guard = registry.hold_shard(rw, shard_locks, LEFT)
    other = registry.hold_shard(rw, shard_locks, SHARDS[1])
    guard.release()
    guard.release()
    assert rw.readers == 1
    assert not shard_locks.get(LEFT).locked()
    other.release()
    assert rw.readers == 0


def test_a_wait_that_ended_is_no_edge_of_a_later_cycle() -> None:
    """architecture "Locking": the registry keeps which shard each thread waits for, to
    refuse a wait that closes a cycle. A wait that ended (the shard was taken) is
    forgotten: a later prepare that waits for a shard held by that thread, whose old wait
    named a shard the preparer now holds, waits (no deadlock: the holder waits for
    nothing) and gets it, rather than being refused."""
    rw, shard_locks, registry = RWLock(), ShardLocks(), PendingRegistry()
    a, b = LEFT, SHARDS[1]
    release_b = threading.Event()

    def holder() -> None:
        gb = registry.hold_shard(rw, shard_locks, b)
        ga = registry.hold_shard(rw, shard_locks, a)  # waits: the main thread holds a
        ga.release()
        assert release_b.wait(TIMEOUT)
        gb.release()

    main_a = registry.hold_shard(rw, shard_locks, a)
    w = started(holder, "holder")
    _wait_until(lambda: w in registry._waiting, "the holder to wait for shard a")
    main_a.release()
    _wait_until(lambda: not shard_locks.get(a).locked(), "the holder to release shard a")

    def preparer() -> None:
        ga = registry.hold_shard(rw, shard_locks, a)
        gb = registry.hold_shard(rw, shard_locks, b)  # waits for the holder's b
        gb.release()
        ga.release()

    p = started(preparer, "preparer")
    _wait_until(lambda: p in registry._waiting or p.finished.is_set(), "the preparer to wait")
    release_b.set()
    p.outcome()
    w.outcome()
    assert rw.readers == 0


# -- the readers/writer lock after a close --------------------------------------------------------


class _SignallingCondition(threading.Condition):
    """The lock's condition, telling when a thread starts waiting on it (it holds the
    condition's mutex until the wait releases it, so a ``notify`` after ``waiting`` is
    set reaches that waiter)."""

    def __init__(self) -> None:
        super().__init__(threading.RLock())
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` (as tests/integration/test_concurrency.py does); fail after
    ``TIMEOUT`` seconds."""
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _closed() -> QueueClosedError:
    return QueueClosedError("queue closed while this call waited")


def test_closing_the_lock_wakes_a_reader_waiting_behind_the_writer() -> None:
    """architecture "Locking": ``close()`` wakes every call waiting for a lock, and it
    raises: a reader waiting (with no timeout) for a held write lock is woken by the
    close and raises its error instead of waiting on."""
    rw = RWLock()
    cond = _SignallingCondition()
    rw._cond = cond  # type: ignore[attr-defined]
    rw.acquire_write()
    reader = started(rw.acquire_read, name="reader")
    assert cond.waiting.wait(TIMEOUT)
    rw.close(_closed)
    with pytest.raises(QueueClosedError, match="closed while this call waited"):
        reader.outcome()
    rw.release_write()
    assert rw.readers == 0


def test_a_closed_lock_refuses_every_later_wait() -> None:
    """``RWLock.close``: every later wait raises the close's error, a free lock's too;
    no read lock is taken."""
    rw = RWLock()
    rw.close(_closed)
    with pytest.raises(QueueClosedError):
        rw.acquire_read()
    with pytest.raises(QueueClosedError):
        rw.acquire_read(jump_queue=True, timeout=0)
    with pytest.raises(QueueClosedError):
        rw.acquire_write()
    assert rw.readers == 0
    assert not rw.write_held_here()
