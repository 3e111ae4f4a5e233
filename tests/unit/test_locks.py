"""RWLock (writer preference, jump_queue, release errors) and ShardLocks.

Every blocking call runs in a helper thread; the test waits on an event with a timeout
and joins with a timeout, so a broken lock fails the test instead of hanging it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from imq.locks import RWLock, ShardLocks
from imq.types import ShardIdent

TIMEOUT = 5.0  # upper bound for something that must happen
BLOCKED = 0.1  # how long we watch something that must not happen


class Attempt:
    """Runs ``action`` in a daemon thread and records when it returned."""

    def __init__(self, action: Callable[[], object]) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            try:
                action()
            except BaseException as exc:
                self.error = exc
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def finished(self, timeout: float = TIMEOUT) -> bool:
        return self.done.wait(timeout)

    def blocked(self) -> bool:
        return not self.done.wait(BLOCKED)

    def join(self) -> None:
        assert self.done.wait(TIMEOUT), "the attempt never finished"
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error


def wait_for(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def writer_waiting(lock: RWLock) -> Callable[[], bool]:
    # No public counter of waiting writers: peek at the private one so the test knows
    # the writer is queued before it checks that new readers wait behind it.
    return lambda: lock._writers_waiting > 0


@pytest.fixture
def lock() -> Iterator[RWLock]:
    yield RWLock()


def test_readers_share(lock: RWLock) -> None:
    lock.acquire_read()
    second = Attempt(lock.acquire_read)
    assert second.finished()
    second.join()
    assert lock.readers == 2
    lock.release_read()
    lock.release_read()
    assert lock.readers == 0


def test_writer_waits_for_readers(lock: RWLock) -> None:
    lock.acquire_read()
    lock.acquire_read()
    writer = Attempt(lock.acquire_write)
    assert writer.blocked()
    lock.release_read()
    assert writer.blocked()
    lock.release_read()
    writer.join()
    lock.release_write()


def test_writer_excludes_readers_and_writers(lock: RWLock) -> None:
    lock.acquire_write()
    reader = Attempt(lock.acquire_read)
    writer = Attempt(lock.acquire_write)
    assert reader.blocked()
    assert writer.blocked()
    lock.release_write()
    # the waiting writer goes first; the reader waits behind it
    writer.join()
    assert reader.blocked()
    lock.release_write()
    reader.join()
    assert lock.readers == 1
    lock.release_read()


def test_holding_writer_blocks_jump_queue_readers(lock: RWLock) -> None:
    lock.acquire_write()
    jumper = Attempt(lambda: lock.acquire_read(jump_queue=True))
    assert jumper.blocked()  # jump_queue passes a *waiting* writer, not a holding one
    lock.release_write()
    jumper.join()
    assert lock.readers == 1
    lock.release_read()


def test_waiting_writer_blocks_new_readers(lock: RWLock) -> None:
    lock.acquire_read()
    writer = Attempt(lock.acquire_write)
    wait_for(writer_waiting(lock))
    newcomer = Attempt(lock.acquire_read)
    assert newcomer.blocked()
    assert writer.blocked()
    lock.release_read()
    writer.join()
    assert newcomer.blocked()
    lock.release_write()
    newcomer.join()
    assert lock.readers == 1
    lock.release_read()


def test_jump_queue_reader_passes_a_waiting_writer(lock: RWLock) -> None:
    lock.acquire_read()
    writer = Attempt(lock.acquire_write)
    wait_for(writer_waiting(lock))
    jumper = Attempt(lambda: lock.acquire_read(jump_queue=True))
    jumper.join()
    assert lock.readers == 2
    assert writer.blocked()
    lock.release_read()
    assert writer.blocked()
    lock.release_read()
    writer.join()
    lock.release_write()


def test_readers_pass_again_once_no_writer_waits(lock: RWLock) -> None:
    lock.acquire_read()

    def write_once() -> None:
        lock.acquire_write()
        lock.release_write()

    writer = Attempt(write_once)
    wait_for(writer_waiting(lock))
    lock.release_read()
    writer.join()
    reader = Attempt(lock.acquire_read)
    reader.join()
    lock.release_read()
    assert lock.readers == 0


def test_release_errors(lock: RWLock) -> None:
    with pytest.raises(RuntimeError):
        lock.release_read()
    with pytest.raises(RuntimeError):
        lock.release_write()
    lock.acquire_read()
    with pytest.raises(RuntimeError):
        lock.release_write()
    lock.release_read()
    with pytest.raises(RuntimeError):
        lock.release_read()
    lock.acquire_write()
    with pytest.raises(RuntimeError):
        lock.release_read()
    lock.release_write()
    with pytest.raises(RuntimeError):
        lock.release_write()
    assert lock.readers == 0
    # the lock still works after the failed releases
    with lock.write_locked():
        pass


def test_write_locked_releases_on_error(lock: RWLock) -> None:
    with pytest.raises(KeyError), lock.write_locked():
        raise KeyError("boom")
    reader = Attempt(lock.acquire_read)
    reader.join()
    lock.release_read()
    with lock.write_locked():
        blocked = Attempt(lock.acquire_read)
        assert blocked.blocked()
    blocked.join()
    lock.release_read()


def test_locks_are_not_owned_by_a_thread(lock: RWLock) -> None:
    reader = Attempt(lock.acquire_read)
    reader.join()
    lock.release_read()  # released by another thread
    writer = Attempt(lock.acquire_write)
    writer.join()
    blocked = Attempt(lock.acquire_read)
    assert blocked.blocked()
    lock.release_write()  # released by another thread
    blocked.join()
    lock.release_read()


def test_many_readers_and_writers_are_exclusive(lock: RWLock) -> None:
    state = {"readers": 0, "writers": 0, "violations": 0}
    guard = threading.Lock()

    def reader() -> None:
        for _ in range(50):
            lock.acquire_read()
            with guard:
                state["readers"] += 1
                if state["writers"]:
                    state["violations"] += 1
            with guard:
                state["readers"] -= 1
            lock.release_read()

    def writer() -> None:
        for _ in range(50):
            with lock.write_locked():
                with guard:
                    state["writers"] += 1
                    if state["writers"] > 1 or state["readers"]:
                        state["violations"] += 1
                time.sleep(0)
                with guard:
                    state["writers"] -= 1

    attempts = [Attempt(reader) for _ in range(4)] + [Attempt(writer) for _ in range(2)]
    for attempt in attempts:
        attempt.join()
    assert state["violations"] == 0
    assert lock.readers == 0


# --- ShardLocks -----------------------------------------------------------------------


def test_shard_locks_same_lock_per_shard() -> None:
    locks = ShardLocks()
    first = locks.get(ShardIdent.BASECHAIN)
    assert locks.get(ShardIdent.BASECHAIN) is first
    assert locks.get(ShardIdent(0, 0x8000_0000_0000_0000)) is first
    assert locks.get(ShardIdent.MASTERCHAIN) is not first
    assert locks.get(ShardIdent(0, 0x4000_0000_0000_0000)) is not first
    assert ShardLocks().get(ShardIdent.BASECHAIN) is not first


def test_shard_locks_concurrent_get_returns_one_lock() -> None:
    locks = ShardLocks()
    seen: list[object] = []
    start = threading.Barrier(8, timeout=TIMEOUT)

    def get() -> None:
        start.wait()
        seen.append(locks.get(ShardIdent.BASECHAIN))

    attempts = [Attempt(get) for _ in range(8)]
    for attempt in attempts:
        attempt.join()
    assert len(seen) == 8
    assert all(item is seen[0] for item in seen)


def test_shard_lock_serializes_one_shard() -> None:
    locks = ShardLocks()
    lock = locks.get(ShardIdent.BASECHAIN)
    assert lock.acquire(timeout=TIMEOUT)
    other = Attempt(locks.get(ShardIdent.MASTERCHAIN).acquire)
    other.join()  # another shard is independent
    same = Attempt(locks.get(ShardIdent.BASECHAIN).acquire)
    assert same.blocked()
    lock.release()
    same.join()
    lock.release()  # released by this thread: plain mutexes are not owned
