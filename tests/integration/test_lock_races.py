"""The write path's locks under real threads, on real RocksDB directories.

Each test forces one interleaving that the lock design must survive: a dropped pending
diff released by cyclic GC inside a waiting commit's own ``Condition.wait``, a
``write()`` racing a ``discard()`` of one pending diff, a queue call made from inside
``import_state``'s progress callback (which runs under the write lock), and a waiting
writer that leaves by an exception. Every wait is bounded, every helper thread is a
daemon, and ``faulthandler`` dumps the stacks of a test that still hangs, so a locking
bug fails a test instead of hanging the run.
"""

from __future__ import annotations

import gc
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import MC, Chain, quiet_config, split_shard
from test_gc import apply_keys, commit
from threads import TIMEOUT, Worker, at_line, hang_guard, started

from imq import ImqError, PendingDiff, Queue, QueueKey
from imq import pending as pending_module
from imq.errors import StorageError
from imq.locks import RWLock

S = split_shard(0, 1, 0)
OTHER = split_shard(0, 1, 1)
BLOCKED = 0.3  # how long something must stay blocked to count as blocked, seconds


@pytest.fixture(autouse=True)
def _hang_guard() -> Iterator[None]:
    with hang_guard():
        yield


def _poke(rw: RWLock) -> None:
    """Wake whatever waits on ``rw`` (cleanup after a lost wakeup)."""
    rw.acquire_read(jump_queue=True)
    rw.release_read()


# -- 1. cyclic GC inside a waiting writer's Condition.wait -------------------------------------


def test_commit_is_not_lost_when_cyclic_gc_releases_the_last_reader_inside_its_wait(
    queue: Queue, chain: Chain, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pending diff prepared in another thread and dropped in a reference cycle is the
    last reader. The commit finds a reader, calls ``Condition.wait``, and the lock that
    ``wait`` allocates for itself (a GC-tracked object) triggers a collection in the
    committing thread: the diff's ``__del__`` releases the read lock and notifies before
    the commit's waiter is registered. Nobody notifies again: the commit hung forever
    with no reader left."""
    mc = chain.apply(MC, 1)
    a = chain.build(S, 2)
    preparer = started(lambda: queue.prepare_diff(a.diff, a.block, a.hash), "preparer")
    assert preparer.finished.wait(TIMEOUT) and preparer.error is None
    pending = preparer.result
    assert isinstance(pending, PendingDiff)
    preparer.result = None

    was_enabled = gc.isenabled()
    gc.disable()  # the cycle must be collected where the test says, not earlier
    try:
        cycle: list[object] = [pending]
        cycle.append(cycle)
        del pending, cycle
        real = threading._allocate_lock  # type: ignore[attr-defined]
        fired: list[bool] = []

        def allocate_lock() -> Any:
            # A collection at this allocation, in the committing thread only (what a
            # GC-tracked allocation may trigger anywhere).
            if threading.current_thread().name == "committer" and not fired:
                fired.append(True)
                gc.collect()
            return real()

        monkeypatch.setattr(threading, "_allocate_lock", allocate_lock)
        committer = started(lambda: queue.commit_diff([mc.top()]), "committer")
        finished = committer.finished.wait(3.0)
        monkeypatch.setattr(threading, "_allocate_lock", real)
    finally:
        if was_enabled:
            gc.enable()
    try:
        assert fired, "the collection was not triggered inside the commit's wait"
        assert queue._rw.readers == 0
        assert finished, "commit_diff hung with no reader left (lost wakeup)"
    finally:
        if not committer.finished.is_set():
            _poke(queue._rw)  # let the hung commit finish, so the queue can close
            committer.finished.wait(TIMEOUT)
    assert committer.error is None
    assert committer.result is True
    assert queue.get_diff_info(S, 1) is None  # the dropped diff was never written


# -- 2. write() racing discard() on one pending diff ---------------------------------------------


def _pause_in_finish(checked: threading.Event, go: threading.Event) -> Callable[..., Any]:
    """A trace function that stops the state change of ``PendingDiff`` (``_finish``, or
    the helper it delegates to) right after its state check, on the line that sets the
    new state, until ``go`` is set or a second passes."""
    for name in ("_finish", "_try_finish"):
        function = getattr(pending_module.PendingDiff, name, None)
        if function is not None and "self._state = state" in inspect.getsource(function):
            return at_line(function, "self._state = state", lambda: (checked.set(), go.wait(1.0)))
    raise AssertionError("no state change found in PendingDiff")


@pytest.mark.parametrize("first", ["write", "discard"])
def test_write_racing_discard_lets_exactly_one_win(queue: Queue, chain: Chain, first: str) -> None:
    """A cancelled collation discards the pending diff while the finalizing thread
    writes it. The state check and the state change were two steps: both calls passed
    the check, so ``discard()`` returned normally (and released the locks) while
    ``write()`` wrote the batch after the locks were gone. Exactly one may win; the
    other must raise ``ImqError``; the locks are released exactly once."""
    a = chain.build(S, 2)
    pending = queue.prepare_diff(a.diff, a.block, a.hash)
    assert pending is not None
    second = "discard" if first == "write" else "write"
    checked, go = threading.Event(), threading.Event()
    tracer = _pause_in_finish(checked, go)

    def paused() -> None:
        sys.settrace(tracer)
        try:
            getattr(pending, first)()
        finally:
            sys.settrace(None)

    def racing() -> None:
        assert checked.wait(TIMEOUT)
        try:
            getattr(pending, second)()
        finally:
            go.set()

    one, two = started(paused, first), started(racing, second)
    assert one.finished.wait(TIMEOUT) and two.finished.wait(TIMEOUT)
    errors = [w.error for w in (one, two)]
    assert sum(e is None for e in errors) == 1, f"both or neither won: {errors}"
    loser = next(e for e in errors if e is not None)
    assert isinstance(loser, ImqError), loser
    written = pending.state == "written"
    assert (queue.get_diff_info(S, 1) is not None) is written
    # The locks were released once: nothing held, and the shard is usable again.
    assert queue._rw.readers == 0
    assert not queue._shard_locks.get(S).locked()
    assert queue.apply_diff(a.diff, a.block, a.hash) is (not written)


def test_two_threads_writing_one_pending_diff_write_it_once(queue: Queue, chain: Chain) -> None:
    """Both passed the state check; the second wrote the consumed batch again, which
    RocksDB refused, and the store declared its handle dead: the queue took no more
    writes until reopened."""
    a = chain.build(S, 2)
    pending = queue.prepare_diff(a.diff, a.block, a.hash)
    assert pending is not None
    checked, go = threading.Event(), threading.Event()
    tracer = _pause_in_finish(checked, go)

    def paused() -> None:
        sys.settrace(tracer)
        try:
            pending.write()
        finally:
            sys.settrace(None)

    def racing() -> None:
        assert checked.wait(TIMEOUT)
        try:
            pending.write()
        finally:
            go.set()

    one, two = started(paused, "w1"), started(racing, "w2")
    assert one.finished.wait(TIMEOUT) and two.finished.wait(TIMEOUT)
    errors = [w.error for w in (one, two)]
    assert sum(e is None for e in errors) == 1, errors
    loser = next(e for e in errors if e is not None)
    # Not a second write of the consumed batch: that failed in RocksDB and killed the
    # store's handle (StorageError: every later write of the queue refused).
    assert not isinstance(loser, StorageError), loser
    assert isinstance(loser, ImqError), loser
    assert queue._store.dead is None
    assert queue.metrics.counter("diffs_applied") == 1
    assert queue._rw.readers == 0
    assert not queue._shard_locks.get(S).locked()
    b = chain.build(OTHER, 1)
    assert queue.apply_diff(b.diff, b.block, b.hash) is True


def test_context_exit_racing_a_write_from_another_thread_does_not_raise(
    queue: Queue, chain: Chain
) -> None:
    """``with pending:`` discards on exit unless written; when another thread writes it
    meanwhile, leaving the block must not fail (the diff is written: nothing to do)."""
    a = chain.build(S, 2)
    pending = queue.prepare_diff(a.diff, a.block, a.hash)
    assert pending is not None
    with pending:
        started(pending.write, "writer").finished.wait(TIMEOUT)
    assert pending.state == "written"
    assert queue._rw.readers == 0


# -- 3. queue calls from import_state's progress callback (under the write lock) ---------------


def _import_with_callback(queue: Queue, call: Callable[[], object]) -> tuple[Worker, list[Any]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from state_fixtures import MASTER_STATE, block_id, top_update

    seen: list[Any] = []

    def progress(done: int, total: int) -> None:
        if seen:
            return
        try:
            seen.append(call())
        except Exception as exc:
            seen.append(exc)

    importer = started(
        lambda: queue.import_state(
            MASTER_STATE.path,
            block_id(MASTER_STATE),
            top_update(MASTER_STATE),
            progress=progress,
        ),
        "importer",
    )
    return importer, seen


@pytest.mark.parametrize(
    "call", ["apply_diff", "prepare_diff", "commit_diff", "clear", "export", "run_gc", "gc_report"]
)
def test_a_queue_write_from_the_import_progress_callback_is_refused_not_hung(
    queue: Queue, chain: Chain, call: str, tmp_path: Path
) -> None:
    """``import_state`` holds the write lock while it calls ``progress``; a write call
    from there waited for a lock its own thread held: a silent hang. It must be refused
    with ``ImqError`` (as the documented same-thread deadlocks are), and the import
    must go on."""
    mc = chain.apply(MC, 1)
    # Committed: the import refuses an uncommitted diff of its shard below its pointer.
    assert queue.commit_diff([mc.top()])
    a = chain.build(S, 2)
    calls: dict[str, Callable[[], object]] = {
        "apply_diff": lambda: queue.apply_diff(a.diff, a.block, a.hash),
        "prepare_diff": lambda: queue.prepare_diff(a.diff, a.block, a.hash),
        "commit_diff": lambda: queue.commit_diff([mc.top()]),
        "clear": lambda: queue.clear_uncommitted_state(top_shards=[S]),
        "export": lambda: queue.export_state(MC, 1, 1, tmp_path / "x.bin"),
        "run_gc": queue.run_gc,
        "gc_report": queue.run_gc_report,
    }
    importer, seen = _import_with_callback(queue, calls[call])
    finished = importer.finished.wait(TIMEOUT)
    if not finished:  # hung: cannot be undone; the daemon thread is left behind
        pytest.fail(f"{call} from the import's progress callback hung (self-deadlock)")
    assert importer.error is None, importer.error
    assert len(seen) == 1
    assert isinstance(seen[0], ImqError), seen[0]
    assert "deadlock" in str(seen[0])
    assert queue._rw.readers == 0
    assert queue.get_diff_info(S, 1) is None


# -- 4. a waiting writer that leaves by an exception ---------------------------------------------


class _InterruptedOnce(threading.Condition):
    """A condition whose first ``wait`` in the thread named ``victim`` waits until
    ``interrupt`` is set and then raises, as a ``KeyboardInterrupt`` delivered to a
    commit waiting in the main thread does."""

    def __init__(self) -> None:
        super().__init__(threading.RLock())
        self.interrupt = threading.Event()
        self.fired = False

    def wait(self, timeout: float | None = None) -> bool:
        if threading.current_thread().name == "victim" and not self.fired:
            self.fired = True
            while not self.interrupt.is_set():
                super().wait(0.01)  # releases the lock meanwhile; notifies nobody
            raise KeyboardInterrupt
        return super().wait(timeout)


def test_readers_queued_behind_an_interrupted_writer_are_woken() -> None:
    """A reader that arrives while a writer waits queues behind it; when the writer
    leaves by an exception, nothing woke the reader: it stayed blocked until some
    unrelated release, although no writer was left."""
    lock = RWLock()
    cond = _InterruptedOnce()
    lock._cond = cond  # type: ignore[misc]
    lock.acquire_read()  # a pending diff held elsewhere
    writer = started(lock.acquire_write, "victim")
    deadline = threading.Event()
    for _ in range(int(TIMEOUT / 0.01)):
        if lock._writers_waiting:
            break
        deadline.wait(0.01)
    assert lock._writers_waiting == 1
    reader = started(lock.acquire_read, "reader")
    assert not reader.finished.wait(BLOCKED), "a reader passed a waiting writer"
    cond.interrupt.set()
    assert writer.finished.wait(TIMEOUT)
    assert isinstance(writer.error, KeyboardInterrupt)
    try:
        assert reader.finished.wait(2.0), "a reader stayed blocked behind a writer that left"
        assert lock.readers == 2
    finally:
        lock.release_read()  # the first reader's; wakes a still-blocked reader
        assert reader.finished.wait(TIMEOUT)
        lock.release_read()
    assert lock.readers == 0


# -- 5. two threads, each holding one shard, preparing the other's -------------------------------


def test_crossed_prepares_of_two_threads_are_refused_not_hung(queue: Queue, chain: Chain) -> None:
    """Thread 1 holds a pending diff of S and prepares OTHER; thread 2 holds one of
    OTHER and prepares S. Each waited for the other's shard mutex forever (a lock-order
    cycle no single thread can see). The second to wait must be refused with
    ``ImqError``; the first then gets its shard once the refused thread writes."""
    a1, b1 = chain.build(S, 1), chain.build(OTHER, 1)
    a2, b2 = chain.build(S, 1), chain.build(OTHER, 1)
    both_hold = threading.Barrier(2, timeout=TIMEOUT)

    def crossed(mine: Any, theirs: Any) -> str:
        first = queue.prepare_diff(mine.diff, mine.block, mine.hash)
        assert first is not None
        both_hold.wait()
        try:
            second = queue.prepare_diff(theirs.diff, theirs.block, theirs.hash)
        except ImqError:
            first.write()
            return "refused"
        first.write()
        assert second is not None
        second.write()
        return "written"

    one = started(lambda: crossed(a1, b2), "crossed-1")
    two = started(lambda: crossed(b1, a2), "crossed-2")
    finished = one.finished.wait(TIMEOUT) and two.finished.wait(TIMEOUT)
    if not finished:  # both threads wait on each other's mutex: cannot be undone
        pytest.fail("two threads preparing each other's held shard deadlocked")
    assert one.error is None and two.error is None, (one.error, two.error)
    assert sorted([one.result, two.result]) == ["refused", "written"]
    assert queue._rw.readers == 0
    # Both first diffs and the winner's second are written; the refused one is not.
    last = [queue.get_last_applied_seqno(S), queue.get_last_applied_seqno(OTHER)]
    assert sorted(last) == [1, 2], last


# -- D9: compaction after a clear or a GC pass holds none of the facade's locks -------------


def _compact_beside_a_writer(
    queue: Queue, chain: Chain
) -> tuple[Callable[[Any], None], list[bool]]:
    """A stand-in for the store's ``compact``, and what the writer beside each of its
    calls returned. While it runs, the stand-in checks that this thread holds no write
    lock and that another thread applies and commits a diff of another shard to the end:
    the commit takes the write lock, so a compaction under any facade lock leaves it
    waiting (``outcome`` fails after ``TIMEOUT``)."""
    seen: list[bool] = []

    def compact(ranges: Any) -> None:
        assert not queue._rw.write_held_here()
        other = chain.build(OTHER, 1)
        mc = chain.build(MC, 1)

        def write_beside() -> bool:
            assert queue.apply_diff(other.diff, other.block, other.hash)
            assert queue.apply_diff(mc.diff, mc.block, mc.hash)
            return queue.commit_diff([mc.top(), other.top(mc.seqno)])

        seen.append(started(write_beside, "beside-compaction").outcome())

    return compact, seen


def test_a_clears_compaction_lets_other_writers_run(tmp_path: Path) -> None:
    """D9 (tycho compacts under the global write lock, §16.6): a clear of 256 diffs or
    more compacts their diff infos after it let go of the write lock."""
    queue = Queue.open(tmp_path / "q", quiet_config(compact_after_delete=True))
    try:
        chain = Chain(queue)
        for _ in range(256):
            chain.apply(S, 1)
        compact, seen = _compact_beside_a_writer(queue, chain)
        queue._store.compact = compact  # type: ignore[method-assign]
        queue.clear_uncommitted_state(top_shards=[S])
        assert seen == [True]
        assert queue.get_last_applied_seqno(S) is None
        assert queue.get_last_applied_seqno(OTHER) == 1
    finally:
        queue.close()


def test_a_gc_passs_compaction_lets_other_writers_run(tmp_path: Path) -> None:
    """D9 for GC: with ``compact_after_delete`` a pass compacts what it deleted, and
    does so holding no facade lock."""
    k1 = QueueKey(100, bytes(31) + b"\x01")
    queue = Queue.open(tmp_path / "q", quiet_config(compact_after_delete=True))
    try:
        chain = Chain(queue)
        apply_keys(chain, S, [k1, k1.next_value()])
        keep = chain.apply(S, 1)
        mc = chain.apply(MC, 0, processed_to={S: k1.next_value()})
        commit(queue, mc, keep)
        compact, seen = _compact_beside_a_writer(queue, chain)
        queue._store.compact = compact  # type: ignore[method-assign]
        assert queue.run_gc_report().messages == 2
        assert seen == [True]
    finally:
        queue.close()
