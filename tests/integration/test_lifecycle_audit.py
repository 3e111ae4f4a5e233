"""Lifecycle edges a concurrency audit found, each on real RocksDB: ``close()`` racing
another thread's read (the directory was still held after ``close()`` returned), ``close()``
in a forked child (it could wait forever for a lock a thread of the parent held at the
fork), a host exiting while its daemon thread commits (SIGABRT), and a read-only view
whose files a live writer compacted away (reported as damage, ``imq verify`` included)."""

from __future__ import annotations

import fcntl
import gc as gc_module
import io
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from builders import (
    BASE,
    MC,
    Chain,
    damage_largest_table_file,
    full_range,
    pid_namespace_command,
    quarter_shards,
)

import imq.verify
from imq import (
    DatabaseLockedError,
    ImqError,
    Queue,
    QueueClosedError,
    QueueConfig,
    QueueKey,
    StorageError,
)
from imq.storage import ops
from imq.storage.rocks import GONE_SINCE_OPEN, _listed_flock, writer_holds_lock

REPO = Path(__file__).resolve().parents[2]
SHARDS = quarter_shards()


def _filled(path: Path, diffs: int = 300) -> None:
    with Queue.open(path, QueueConfig.testing()) as queue:
        chain = Chain(queue)
        for _ in range(diffs):
            for shard in SHARDS:
                chain.apply(shard, 3)


@pytest.mark.parametrize("read", ["summary", "tail", "info"])
def test_close_waits_for_another_threads_read_so_a_reopen_works(read: str, tmp_path: Path) -> None:
    """Before: 18 of 20 reopens right after close() were refused ("lock hold by current
    process"): the reading thread's RocksDB snapshot kept the database open."""
    path = tmp_path / "db"
    _filled(path)
    calls = {
        "summary": lambda q: q.summary(),
        "tail": lambda q: q.get_diffs_tail_len(SHARDS[0], QueueKey.MIN),
        "info": lambda q: q.get_diff_info(SHARDS[1], 7),
    }
    call = calls[read]
    for _ in range(4):
        queue = Queue.open(path, QueueConfig.testing())
        started = threading.Event()
        errors: list[BaseException] = []

        def reader(
            queue: Queue = queue,
            started: threading.Event = started,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                while True:
                    call(queue)
                    started.set()
            except QueueClosedError:
                pass
            except BaseException as exc:  # anything else fails the test below
                errors.append(exc)
            finally:
                started.set()

        thread = threading.Thread(target=reader)
        thread.start()
        started.wait(10)
        time.sleep(0.01)
        queue.close()
        try:
            Queue.open(path, QueueConfig.testing()).close()  # at once: the directory is free
        except DatabaseLockedError as exc:
            pytest.fail(f"reopen right after close() refused: {exc}")
        finally:
            thread.join(10)
        assert not errors, errors
        assert queue.close_error is None


def test_close_waits_for_a_view_another_thread_still_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race above made certain: the reading thread is held just before it lets go of
    its view, while the main thread closes and reopens."""
    path = tmp_path / "db"
    _filled(path, 5)
    queue = Queue.open(path, QueueConfig.testing())
    inside, closing = threading.Event(), threading.Event()
    real_close = ops.View.close

    def slow_close(view: ops.View) -> None:
        if threading.current_thread().name == "reader":
            inside.set()
            closing.wait(10)
            time.sleep(0.2)  # close() must still be waiting when the view ends
        real_close(view)

    monkeypatch.setattr(ops.View, "close", slow_close)
    reader = threading.Thread(target=queue.get_diff_info, args=(SHARDS[0], 3), name="reader")
    reader.start()
    assert inside.wait(10)
    closing.set()
    began = time.monotonic()
    queue.close()
    waited = time.monotonic() - began
    Queue.open(path, QueueConfig.testing()).close()  # at once: refused before the fix
    reader.join(10)
    assert waited >= 0.15, waited
    assert queue.close_error is None


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests' / 'integration'}"},
        check=False,
    )


def test_close_in_a_forked_child_takes_no_lock_a_parent_thread_held(tmp_path: Path) -> None:
    """A thread of the parent inside the facade's lock at the fork: the child's close()
    waited for it forever (10 of 240 forks of a busy queue)."""
    done = _run(
        """
        import faulthandler, os, sys, threading
        from imq import Queue, QueueConfig
        queue = Queue.open(sys.argv[1], QueueConfig.testing())
        held, release = threading.Event(), threading.Event()
        def holder():
            with queue._rw._cond:  # what every lock call of the facade takes, briefly
                held.set()
                release.wait()
        thread = threading.Thread(target=holder)
        thread.start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            faulthandler.dump_traceback_later(10, exit=True)  # a hang: exit status 1
            queue.close()
            os._exit(0 if queue.closed else 3)
        release.set()
        thread.join()
        _, status = os.waitpid(pid, 0)
        queue.close()
        print("child", os.waitstatus_to_exitcode(status))
        """,
        str(tmp_path / "db"),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["child", "0"], done.stderr


@pytest.mark.parametrize("what", ["commit", "compact"])
def test_exit_while_a_daemon_thread_is_inside_rocksdb_is_clean(what: str, tmp_path: Path) -> None:
    """A host that exits without close() while its daemon thread commits (a synced
    commit's fsync runs with the GIL released) or compacts: SIGABRT in 10 of 10 runs."""
    done = _run(
        """
        import sys, threading, time
        from dataclasses import replace
        from builders import MC, Chain, quarter_shards
        from imq import Queue, QueueConfig
        what = sys.argv[2]
        queue = Queue.open(sys.argv[1], replace(QueueConfig.testing(), sync_commits=True))
        shards, chain = quarter_shards(), Chain(queue)
        def committer():
            mc = Chain(queue, chain.clock)
            while True:
                for shard in shards:
                    chain.apply(shard, 20, body=b"x" * 300)
                block = mc.apply(MC, 0)
                tops = [chain.of(s)[-1].top(block.seqno) for s in shards]
                queue.commit_diff([block.top(), *tops])
        def compactor():
            while True:
                queue.compact()
        threading.Thread(target=committer, daemon=True).start()
        if what == "compact":
            threading.Thread(target=compactor, daemon=True).start()
        time.sleep(0.5)
        sys.exit(0)
        """,
        str(tmp_path / "db"),
        what,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    with Queue.open(tmp_path / "db", QueueConfig.testing()) as queue:  # and it reopens
        assert queue.get_commit_pointers()


def _blob_queue(path: Path) -> tuple[Queue, Chain]:
    writer = Queue.open(path, replace(QueueConfig.testing(), compact_after_delete=True))
    chain = Chain(writer)
    for _ in range(10):
        for shard in SHARDS:
            chain.apply(shard, 3, body=b"B" * (40 << 10))  # bodies in blob files
    writer.compact()
    return writer, chain


def _collect_everything(writer: Queue, chain: Chain) -> None:
    reached = {s: chain.of(s)[-1].max_message for s in SHARDS}
    mc = Chain(writer, chain.clock).apply(MC, 0, processed_to=reached)
    tops = [chain.apply(s, 1, processed_to=reached).top(mc.seqno) for s in SHARDS]
    writer.commit_diff([mc.top(), *tops])
    writer.run_gc()
    writer.compact()


def test_a_read_only_view_outdated_by_the_writer_says_so(tmp_path: Path) -> None:
    """Not "the directory was changed outside imq ... restore it": a sound database."""
    path = tmp_path / "db"
    writer, chain = _blob_queue(path)
    view = Queue.open(path, QueueConfig.testing(), read_only=True)
    try:
        _collect_everything(writer, chain)
        with (
            pytest.raises(StorageError) as info,
            view.iterator(0, [full_range(s) for s in SHARDS], BASE) as it,
        ):
            sum(1 for _ in it)
        assert GONE_SINCE_OPEN in info.value.hint
        assert ".blob" in info.value.reason
    finally:
        view.close()
    # A new view reads the writer's files as they are now.
    with Queue.open(path, QueueConfig.testing(), read_only=True) as again:
        assert list(again.iterator(0, [full_range(s) for s in SHARDS], BASE)) == list(
            writer.iterator(0, [full_range(s) for s in SHARDS], BASE)
        )
    writer.close()


def _outdated() -> StorageError:
    return StorageError(
        "db", "a read of table 'messages'", "000010.blob: No such file", hint=GONE_SINCE_OPEN
    )


def test_verify_opens_a_new_view_when_the_writer_outdated_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "db"
    _filled(path, 5)
    real = imq.verify._verify
    views: list[int] = []

    def outdated_twice(
        store: object, report: imq.verify.Report, progress: object, **kwargs: object
    ) -> None:
        views.append(1)
        if len(views) <= 2:
            raise _outdated()
        real(store, report, progress, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(imq.verify, "_verify", outdated_twice)
    report = imq.verify.verify(path)
    assert report.ok, report.problems
    assert len(views) == 3

    def always(store: object, report: imq.verify.Report, progress: object, **_: object) -> None:
        raise _outdated()

    monkeypatch.setattr(imq.verify, "_verify", always)
    with pytest.raises(StorageError, match="removed files of each of 5 read-only views") as info:
        imq.verify.verify(path)
    assert "nothing was found wrong" in str(info.value)


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="no /proc/locks to list locks")
def test_the_writer_probe_reads_the_lock_without_taking_it_where_it_is_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether a writer holds the directory decides the read-only hint; a lock that
    ``/proc/locks`` lists is told without taking it (only an unlisted one is probed, see
    the tests below)."""
    path = tmp_path / "db"
    assert not writer_holds_lock(path)  # nothing there
    with Queue.open(path, QueueConfig.testing()):
        probes: list[int] = []
        real = fcntl.flock

        def flock(fd: int, operation: int) -> None:
            probes.append(operation)
            real(fd, operation)

        monkeypatch.setattr(fcntl, "flock", flock)
        assert writer_holds_lock(path)
        with Queue.open(path, QueueConfig.testing(), read_only=True):
            assert writer_holds_lock(path)
        assert probes == []  # listed: no lock tried
        monkeypatch.undo()
    assert not writer_holds_lock(path)
    lock = os.stat(path / "imq.lock")
    where = f"{os.major(lock.st_dev):02x}:{os.minor(lock.st_dev):02x}:{lock.st_ino}"
    assert _listed_flock([f"1: FLOCK  ADVISORY  WRITE 7 {where} 0 EOF\\n"], lock)
    assert not _listed_flock([f"1: -> FLOCK  ADVISORY  WRITE 7 {where} 0 EOF\\n"], lock)
    assert not _listed_flock([f"1: POSIX  ADVISORY  WRITE 7 {where} 0 EOF\\n"], lock)
    assert not _listed_flock([f"1: FLOCK  ADVISORY  WRITE 7 {where}1 0 EOF\\n"], lock)


def test_a_writer_opens_past_a_readers_probe_of_its_lock(tmp_path: Path) -> None:
    """A reader probes an unlisted lock with a shared lock for a moment; a writer that
    opens in that moment waits it out (before the probe existed, it was refused at
    once: a false ``DatabaseLockedError``), and one that meets a writer's lock is still
    refused."""
    path = tmp_path / "db"
    with Queue.open(path, QueueConfig.testing()):
        pass
    probe = os.open(path / "imq.lock", os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
    threading.Timer(0.005, os.close, (probe,)).start()
    with Queue.open(path, QueueConfig.testing()), pytest.raises(DatabaseLockedError):
        Queue.open(path, QueueConfig.testing())


def test_a_writer_is_seen_from_another_pid_namespace(tmp_path: Path) -> None:
    """A read-only view in another container than the writer's (its own PID namespace,
    so ``/proc/locks`` lists none of the writer's locks) still tells that a writer holds
    the directory: a file a compaction removed since the view opened is then reported
    as that (open it again), not as the directory changed outside imq (restore it)."""
    namespaced = pid_namespace_command()
    if namespaced is None:
        pytest.skip("no PID namespace can be made here (needs root or user namespaces)")
    path = tmp_path / "db"
    code = (
        "import sys; from pathlib import Path; from imq.storage.rocks import writer_holds_lock; "
        "print(writer_holds_lock(Path(sys.argv[1])))"
    )

    def seen() -> str:
        done = subprocess.run(
            [*namespaced, sys.executable, "-c", code, str(path)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return done.stdout.strip()

    with Queue.open(path, QueueConfig.testing()):
        assert seen() == "True"
    assert seen() == "False"


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("read", ["iterator", "export"])
def test_a_kept_read_error_does_not_keep_the_database_open(read: str, tmp_path: Path) -> None:
    """A resource audit: after a read met a damaged table, the error a host kept (a log
    list, a future) held frames whose locals were RocksDB iterators: close() returned,
    but every reopen in the process was refused ("lock hold by current process"), 11
    descriptors left open; dropped, the iterator's error kept them until the cycle
    collector ran."""
    path = tmp_path / "db"
    with Queue.open(path, QueueConfig.testing()) as queue:
        chain = Chain(queue)
        for _ in range(3):
            for shard in SHARDS:
                chain.apply(shard, 20)
        queue.compact()
    damage_largest_table_file(path)
    before = _fds()
    gc_module.disable()  # a cycle must not be what lets go of RocksDB
    kept: list[BaseException] = []
    try:
        queue = Queue.open(path, QueueConfig.testing())
        try:
            if read == "iterator":
                with queue.iterator(0, [full_range(s) for s in SHARDS], BASE) as it:
                    list(it)
            else:
                queue.export_state(SHARDS[0], 3, 3, io.BytesIO())
        except ImqError as exc:
            kept.append(exc)
        queue.close()
        assert kept, "the damaged table was not met"
        assert _fds() == before
        Queue.open(path, QueueConfig.testing()).close()  # refused before the fix
    finally:
        gc_module.enable()
