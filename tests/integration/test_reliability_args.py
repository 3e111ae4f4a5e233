"""Wrong arguments found by the reliability campaign: each gets a typed error and leaves
the database unchanged."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import io
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from builders import (
    BASE,
    FORK_WARNING,
    MC,
    Chain,
    block_id,
    derived_stats,
    dump,
    key,
    open_queue,
    quiet_config,
    run_python,
    top,
)

from imq import (
    Address,
    CommitError,
    DiffBelowCommitPointerError,
    DiffSequenceError,
    DiffZone,
    FileAccessError,
    ImqError,
    IteratedMessage,
    Message,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    ShardIdent,
    StartupError,
)
from imq.cli.common import database_dir
from imq.errors import ConfigError, QueueClosedError
from imq.state.synth import synth_state, write_synth_state
from imq.storage import rocks, shadow
from imq.verify import verify


@pytest.mark.parametrize("source", [None, 12345, 1.5, object()])
def test_import_state_refuses_a_source_that_is_neither_a_path_nor_a_file(
    queue: Queue, source: object
) -> None:
    before = dump(queue)
    with pytest.raises(TypeError, match="source must be a path or a binary file object"):
        queue.import_state(source, block_id(BASE, 10))  # type: ignore[arg-type]
    assert dump(queue) == before


@pytest.mark.parametrize("field", ["block_cache_size", "write_buffer_size", "max_background_jobs"])
def test_sizes_rocksdb_cannot_take_are_refused_at_construction(field: str) -> None:
    with pytest.raises((ValueError, ConfigError), match=field):
        QueueConfig(**{field: 2**70})


def test_opening_a_regular_file_is_a_typed_error(tmp_path: Path) -> None:
    file = tmp_path / "not-a-dir"
    file.write_bytes(b"hello")
    for read_only in (False, True):
        with pytest.raises(FileAccessError, match=r"not a directory|no queue database"):
            Queue.open(file, read_only=read_only)
    assert file.read_bytes() == b"hello"


def test_a_read_only_open_of_nothing_is_a_file_access_error(tmp_path: Path) -> None:
    """A read-only open creates nothing: a missing database is the spec's "missing" case
    (``FileAccessError``, also an ``OSError``), and the message says what to pass."""
    for path in (tmp_path / "missing", tmp_path):
        with pytest.raises(FileAccessError, match=r"no queue database at .*an existing queue"):
            Queue.open(path, read_only=True)
    assert list(tmp_path.iterdir()) == []


# RocksDB's threads run in this process: Python 3.12+ warns at every fork (FORK_WARNING).
# Both forks are meant (what the child does after it is the test) and the children end
# with os._exit.


@pytest.mark.filterwarnings(FORK_WARNING)
@pytest.mark.skipif(os.geteuid() != 0, reason="drops to another user, which needs root")
def test_a_read_only_open_without_permission_is_a_file_access_error(tmp_path: Path) -> None:
    """The directory exists but this user may not enter it: a typed error, not a bare
    ``PermissionError``, from the queue's opens and from the CLI's check of the path
    (which raised a bare ``PermissionError`` once `imq verify` used it). A forked child
    turns into the unprivileged user ``nobody`` and reports what each raised."""
    db = tmp_path / "db"
    open_queue(db).close()
    tmp_path.chmod(0o755)
    db.chmod(0o700)  # root's: nobody cannot look inside
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no RocksDB call is reached, the checks before it refuse
        code = 1
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            seen = []
            opens: list[Callable[[], object]] = [
                lambda: Queue.open(db),
                lambda: Queue.open(db, read_only=True),
                lambda: database_dir(db),  # the CLI's check before inspect, verify, gc...
            ]
            for attempt in opens:
                try:
                    attempt()
                except FileAccessError as exc:
                    seen.append(f"{exc.errno} {'permissions' in str(exc)}")
                except BaseException as exc:
                    seen.append(type(exc).__name__)
            os.write(write, ";".join(seen).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    assert _exit_code(pid) == 0  # the report fits the pipe: the child never blocks on it
    with os.fdopen(read, "rb") as pipe:
        report = pipe.read().decode()
    assert report == "13 True;13 True;13 True"


def _exit_code(pid: int, timeout: float = 60.0) -> int:
    """The exit code of the forked child ``pid``; killed (and the test failed) if it has
    not ended within ``timeout`` seconds: a fork copies one thread of a process whose
    other threads may hold locks, so a hung child must not hang the suite."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child did not end within {timeout} s")


def _names(fd: str, name: str) -> bool:
    """Whether this process's descriptor ``fd`` is open on a file called ``name``."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").endswith(name)
    except FileNotFoundError:  # closed meanwhile (the listing's own descriptor)
        return False


def _two_commits(queue: Queue) -> None:
    """Two rounds of a shard's diff and a commit, in a row (no reference kept)."""
    chain = Chain(queue)
    for mc_seqno in (1, 2):
        top = chain.apply(BASE)
        mc = chain.apply(MC, 0, seqno=mc_seqno)
        assert queue.commit_diff([mc.top(), top.top(mc_seqno)])


@pytest.mark.parametrize("synced", [False, True], ids=["unsynced", "synced-commits"])
@pytest.mark.parametrize("worker", [False, True], ids=["no-gc-worker", "gc-worker"])
def test_a_queue_dropped_without_close_frees_its_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, worker: bool, synced: bool
) -> None:
    """Forgetting ``close()`` (a REPL, a test, an error path) must not leave the directory
    locked for the rest of the process: collecting the queue frees the lock. With the GC
    worker on (the default), whose thread holds the store, collecting the queue stops the
    thread, which then lets the store go. With synced commits (the default) two commits in
    a row leave the mark of synced writes to its timer, which holds the store weakly (a
    review found it kept the store, and the lock, until it ran)."""
    db = tmp_path / "db"
    monkeypatch.setattr(rocks, "MARK_SYNC_INTERVAL", 30.0)  # the second commit's: a timer's
    queue = Queue.open(db, quiet_config(gc_enabled=worker, gc_interval=0.01, sync_commits=synced))
    _two_commits(queue)
    assert (queue._store._mark_timer is not None) == synced  # the second one's mark: pending
    thread = next((t for t in threading.enumerate() if t.name == "imq-gc"), None)
    assert (thread is not None) == worker
    del queue
    gc.collect()
    if thread is not None:
        thread.join(10)
        assert not thread.is_alive()
        del thread
        gc.collect()
    assert not [fd for fd in os.listdir("/proc/self/fd") if _names(fd, "imq.lock")]
    with open_queue(db) as again:
        assert again.get_last_applied_seqno(BASE) == 2


@pytest.mark.filterwarnings(FORK_WARNING)
def test_a_forked_child_never_frees_its_parents_lock(tmp_path: Path) -> None:
    """A forked child inherits the lock's descriptor and the finalizer that frees it: at
    the fork it closes its copy and drops the finalizer (never unlocking), so nothing the
    child runs, its exit included, frees the parent's lock under the parent."""
    db = tmp_path / "db"
    queue = open_queue(db)
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                finalizer = queue._store._lock_finalizer  # type: ignore[attr-defined]
                kept = [fd for fd in os.listdir("/proc/self/fd") if _names(fd, "imq.lock")]
                finalizer()  # what its exit would run: nothing now
                code = 0 if not finalizer.alive and not kept else 2
            finally:
                os._exit(code)
        assert _exit_code(pid) == 0
        other = os.open(db / "imq.lock", os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    finally:
        queue.close()


@pytest.mark.filterwarnings(FORK_WARNING)
def test_a_lock_of_a_store_still_opening_is_not_kept_by_a_child(tmp_path: Path) -> None:
    """A fork from another thread can land while a store holds its lock but has not yet
    registered (its open's checks and RocksDB's open can take seconds), or is closing:
    every lock descriptor imq holds is closed in the child at the fork, whatever its
    store's state (a review found the per-store hook missing those)."""
    fd = rocks._open_lock_file(tmp_path / "imq.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as _acquire_lock, no store yet
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                kept = [f for f in os.listdir("/proc/self/fd") if _names(f, "imq.lock")]
                code = 0 if not kept else 2
            finally:
                os._exit(code)
        assert _exit_code(pid) == 0
    finally:
        rocks._unlock(fd)
    assert fd not in rocks._LOCK_FDS


ORPHANING = """
import os, sys, time
from imq import Queue, QueueConfig
queue = Queue.open(sys.argv[1], QueueConfig.testing())
pid = os.fork()
if pid == 0:  # a worker forked by the node (multiprocessing's default on Linux)
    print("child", os.getpid(), flush=True)  # its fork hooks have run
    time.sleep(120)
    os._exit(0)
time.sleep(120)
"""


def test_a_forked_child_does_not_keep_a_killed_writers_lock(tmp_path: Path) -> None:
    """A worker the writer forked outlives the writer, killed without a close (the OOM
    killer): the restarted writer opens the queue. Before, the child's copy of the lock's
    descriptor kept the lock held until the child exited, so the restart was refused
    with ``DatabaseLockedError`` naming no live writer (an outside audit)."""
    db = tmp_path / "db"
    open_queue(db).close()
    writer = subprocess.Popen(
        [sys.executable, "-c", ORPHANING, str(db)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None
    child = 0
    try:
        ready, _, _ = select.select([writer.stdout], [], [], 60)
        assert ready, "the writer's child said nothing in 60 s"
        said = writer.stdout.readline().split()
        assert said[:1] == ["child"], said
        child = int(said[1])
        writer.kill()
        writer.wait(60)
        with open_queue(db) as again:  # the child lives on
            assert again.get_last_applied_seqno(BASE) is None
            os.kill(child, 0)  # still there
    finally:
        writer.kill()
        writer.wait(60)
        writer.stdout.close()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_a_gc_interval_past_what_a_thread_can_wait_is_refused() -> None:
    """Above ``threading.TIMEOUT_MAX`` the GC worker's wait would raise and end GC for
    good: such intervals are refused at construction, and from TOML."""
    assert threading.TIMEOUT_MAX > 1e9
    QueueConfig(gc_interval=1e9)
    for interval in (1e10, 1e300):
        with pytest.raises(ValueError, match=r"gc_interval must be at most .*gc_enabled"):
            QueueConfig(gc_interval=interval)
    with pytest.raises(ConfigError, match="gc_interval must be at most"):
        QueueConfig.from_mapping({"gc_interval": "300y"})


def test_mutating_handed_out_dicts_moves_nothing_and_writes_nothing(queue: Queue) -> None:
    """Value types are immutable, but their dict fields are plain dicts: changing one
    never moves the value in a set, and a diff whose dicts were changed into something
    unstorable is refused with a ``ValueError`` that says so, writing nothing."""
    chain = Chain(queue)
    first = chain.build(BASE, 2, processed_to={BASE: key(1)})
    diffs = {first.diff}
    first.diff.processed_to[MC] = key(2)
    assert first.diff in diffs
    before = dump(queue)
    first.diff.processed_to["junk"] = 7  # type: ignore[index]
    with pytest.raises(ValueError, match="changed after they were built"):
        queue.apply_diff(first.diff, first.block, first.hash)
    second = chain.build(BASE, 2)
    counts = derived_stats(second.diff, BASE)
    counts.partitions[0][next(iter(counts.partitions[0]))] = -5
    with pytest.raises(ValueError, match="changed after they were built"):
        queue.apply_diff(second.diff, second.block, second.hash, counts)
    counts = derived_stats(second.diff, BASE)
    counts.partitions[3] = None  # type: ignore[assignment]  # a partition without counts
    with pytest.raises(ValueError, match=r"AttributeError.*changed after they were built"):
        queue.apply_diff(second.diff, second.block, second.hash, counts)
    assert dump(queue) == before


def test_replace_and_make_check_like_the_constructors() -> None:
    """namedtuple's ``_replace`` and ``_make`` build the tuple unchecked: the value types
    route them through their constructors, so neither makes a value no constructor takes."""
    z = bytes(32)
    k, a = QueueKey(7, z), Address(0, z)
    assert k._replace(lt=8) == QueueKey(8, z)
    assert type(QueueKey._make((1, z))) is QueueKey
    for bad in (
        lambda: k._replace(lt=-1),
        lambda: QueueKey._make((1, b"short")),
        lambda: a._replace(account=b"x"),
        lambda: ShardIdent.BASECHAIN._replace(prefix=3),
        lambda: Message(k, a, a)._replace(body="text"),
        lambda: IteratedMessage(BASE, Message(k, a, a))._replace(source=1),
    ):
        with pytest.raises((TypeError, ValueError)):
            bad()
    with pytest.raises(TypeError, match=r"IteratedMessage\.source must be a ShardIdent"):
        IteratedMessage(1, 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"IteratedMessage\.message must be a Message"):
        IteratedMessage(BASE, None)  # type: ignore[arg-type]


def test_compact_and_from_toml_refuse_wrong_argument_types_first(
    queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compact(progress=5)`` failed with "'int' object is not callable" from inside
    the store, after the first table was compacted; ``QueueConfig.from_toml(None)`` with
    pathlib's words (an outside audit of embedding). Both are ``TypeError``s naming the
    argument, before anything is done."""

    def compacted(*_args: object) -> None:
        raise AssertionError("compacted before the argument was checked")

    monkeypatch.setattr(queue._store, "compact_all", compacted)
    for bad in (5, "yes"):
        with pytest.raises(TypeError, match="progress must be None or a callable"):
            queue.compact(bad)  # type: ignore[arg-type]
    for path in (None, 5):
        with pytest.raises(TypeError, match="from_toml takes the path of a TOML file"):
            QueueConfig.from_toml(path)  # type: ignore[arg-type]


def test_startup_takes_a_masterchain_block_only(queue: Queue) -> None:
    before = dump(queue)
    with pytest.raises(ValueError, match="must be a masterchain block"):
        queue.startup(block_id(BASE, 1), [BASE])
    assert dump(queue) == before


def test_state_calls_refuse_wrong_argument_types_before_reading(queue: Queue) -> None:
    Chain(queue).apply(BASE)
    sink = io.BytesIO()
    for kwargs, match in (
        ({"tail_len": True}, "tail_len must be an int"),
        ({"tail_len": 1.0}, "tail_len must be an int"),
        ({"dest": None}, "dest must be a path or a binary file object"),
        ({"dest": io.StringIO()}, "binary mode"),
        ({"progress": "yes"}, "progress must be a bool"),
    ):
        args = {"tail_len": 1, "dest": sink, **kwargs}
        progress = args.pop("progress", False)
        with pytest.raises(TypeError, match=match):
            queue.export_state(BASE, 1, args["tail_len"], args["dest"], progress=progress)  # type: ignore[arg-type]
    assert sink.getvalue() == b""
    before = dump(queue)
    with pytest.raises(TypeError, match="binary mode"):
        queue.import_state(io.StringIO("text"), block_id(BASE, 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="progress must be a bool"):
        queue.import_state(io.BytesIO(b""), block_id(BASE, 1), progress=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="top_update must be"):
        queue.import_state(io.BytesIO(b""), block_id(BASE, 1), ("x",))  # type: ignore[arg-type]
    # a value out of range is the caller's (ValueError), before the source is read
    for bad in ((bytes(32), -1), (bytes(32), 1 << 32), (bytes(31), 1)):
        with pytest.raises(ValueError, match=r"tail_len in 0\.\.2\*\*32-1"):
            queue.import_state(io.BytesIO(b""), block_id(BASE, 1), bad)
    with pytest.raises(TypeError, match="read_only must be a bool"):
        Queue.open(queue.path, read_only="yes")  # type: ignore[arg-type]
    assert dump(queue) == before


def test_refusals_of_a_collator_call_say_what_to_do(queue: Queue) -> None:
    """Each refusal ends with a next step, not only the fact."""
    chain = Chain(queue)
    chain.apply(BASE)
    gap = chain.build(BASE, 1, seqno=5)
    with pytest.raises(
        DiffSequenceError, match=r"last stored diff .*apply the diffs of seqnos 2\.\.4"
    ):
        queue.apply_diff(gap.diff, gap.block, gap.hash, check_sequence=DiffZone.BOTH)
    mc = chain.apply(MC, 0)
    with pytest.raises(CommitError, match="list the masterchain block"):
        queue.commit_diff([top(BASE, 1, 1)])
    with pytest.raises(CommitError, match="list each shard once"):
        queue.commit_diff([top(MC, mc.seqno), top(BASE, 1, 1), top(BASE, 1, 1)])
    with pytest.raises(CommitError, match="apply that block's diff first"):
        queue.commit_diff([top(MC, mc.seqno), top(BASE, 7, 1)])
    assert queue.commit_diff([top(MC, mc.seqno), top(BASE, 1, 1)])
    below = QueueDiff(chain.of(BASE)[0].diff.messages[:1])
    with pytest.raises(DiffBelowCommitPointerError, match="drop this diff"):
        queue.apply_diff(below, gap.block, gap.hash)
    with pytest.raises(StartupError, match="apply the masterchain blocks up to it first"):
        queue.startup(block_id(MC, 0), [BASE])


def test_a_damaged_lock_free_directory_reopens_after_a_failed_open(tmp_path: Path) -> None:
    """A failed open (here: a file where the directory should be) holds nothing."""
    file = tmp_path / "x"
    file.write_bytes(b"")
    with pytest.raises(ImqError):
        Queue.open(file)
    file.unlink()
    open_queue(file).close()


def test_wrong_types_of_zerostate_seqno_are_type_errors(db_path: Path) -> None:
    for wrong in ("0", 1.5, None, True):
        with pytest.raises(TypeError, match="zerostate_seqno must be an int"):
            Queue.open(db_path, zerostate_seqno=wrong)  # type: ignore[arg-type]
    for out_of_range in (-1, 2**32):
        with pytest.raises(ValueError, match="zerostate_seqno must be in"):
            Queue.open(db_path, zerostate_seqno=out_of_range)
    assert not db_path.exists(), "a refused open created the directory"


def test_entering_a_closed_queue_is_refused(queue: Queue) -> None:
    queue.close()
    with pytest.raises(QueueClosedError), queue:
        pass


def test_file_objects_of_the_wrong_kind_are_refused_before_any_work(
    queue: Queue, tmp_path: Path
) -> None:
    """``export_state``/``import_state`` take a path or a binary file object: one closed,
    or open the wrong way round, is a ``ValueError`` naming the fix; a stream that fails
    mid-write is a ``FileAccessError`` (an ``OSError``) naming it."""
    state = synth_state(diffs=2, messages_per_diff=3, seed=11)
    path = tmp_path / "state.bin"
    write_synth_state(state, path)
    queue.import_state(path, state.block_id, state.top_update)
    shard, seqno = state.block_id.shard, state.block_id.seqno
    before = dump(queue)

    closed = io.BytesIO()
    closed.close()
    with path.open("rb") as read_side:
        for dest, match in ((closed, "closed file object"), (read_side, "not open for writing")):
            with pytest.raises(ValueError, match=match):
                queue.export_state(shard, seqno, 1, dest)  # type: ignore[arg-type]

    class Failing(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data: object) -> int:
            raise OSError(28, "No space left on device")

    with pytest.raises(FileAccessError, match="failed to write") as info:
        queue.export_state(shard, seqno, 1, Failing())  # type: ignore[arg-type]
    assert info.value.errno == 28
    with (tmp_path / "w.bin").open("wb") as write_side:
        for source, match in ((closed, "closed file object"), (write_side, "not open for reading")):
            with pytest.raises(ValueError, match=match):
                queue.import_state(source, state.block_id, state.top_update)  # type: ignore[arg-type]
    assert dump(queue) == before


def test_refusals_say_what_to_do(queue: Queue, db_path: Path, tmp_path: Path) -> None:
    """A write on a read-only handle, an export of diffs not stored and a pending diff
    used twice each end with the way forward."""
    chain = Chain(queue)
    applied = chain.apply(BASE, 2)
    with pytest.raises(ImqError, match=r"export a block whose last 2 diffs .* shorter tail_len"):
        queue.export_state(BASE, applied.seqno, 2, io.BytesIO())
    built = chain.build(BASE, 1)
    pending = queue.prepare_diff(built.diff, built.block, built.hash)
    assert pending is not None
    pending.write()
    with pytest.raises(ImqError, match=r"prepare the diff again \(Queue\.prepare_diff\)"):
        pending.write()
    queue.close()
    with (
        Queue.open(db_path, read_only=True) as reader,
        pytest.raises(ImqError, match="open the queue without read_only=True"),
    ):
        reader.run_gc()


@pytest.mark.parametrize("read_only", [False, True])
def test_a_path_that_is_not_utf8_is_refused_before_anything_is_created(
    tmp_path: Path, read_only: bool
) -> None:
    """RocksDB takes only UTF-8 paths; a name with undecodable bytes (as ``os.fsdecode``
    gives them) was refused by rocksdict after the directory and its lock file existed,
    as a "damaged files" StorageError."""
    path = os.fsdecode(os.fsencode(tmp_path) + b"/q\xff/sub")
    with pytest.raises(ValueError, match="is not valid UTF-8"):
        Queue.open(path, quiet_config(), read_only=read_only)
    assert list(tmp_path.iterdir()) == []


def _unwritable(directory: Path) -> Callable[[], None]:
    """Make ``directory`` unwritable for this process, the way a user meets it: a
    read-only mount for root (whom permissions do not stop), else mode 0555. Returns
    what undoes it."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return lambda: directory.chmod(0o755)
    bind = ["mount", "--bind", str(directory), str(directory)]
    if subprocess.run(bind, capture_output=True, check=False).returncode != 0:
        pytest.skip("root, but cannot mount here: no way to make a directory unwritable")
    remount = ["mount", "-o", "remount,bind,ro", str(directory)]
    subprocess.run(remount, check=True, capture_output=True)
    return lambda: subprocess.run(["umount", "-l", str(directory)], check=False)


def test_a_directory_it_cannot_write_opens_read_only_and_refuses_a_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rocksdict writes its config file into the directory at every open, read-only ones
    too, so both opens failed on a directory this process cannot write (another user's
    node, a read-only mount). The writer's open still fails, a ``FileAccessError`` saying
    to open it read-only; the read-only open now works, through a temporary directory of
    links to the database's files, gone at close, and the database is left as it was."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    db = tmp_path / "db"
    with open_queue(db) as queue:
        applied = Chain(queue).apply(BASE)
    before = {p.name: p.stat().st_mtime_ns for p in db.iterdir()}
    undo = _unwritable(db)
    try:
        with pytest.raises(FileAccessError) as info:
            Queue.open(db, quiet_config())
        assert info.value.errno in (errno.EROFS, errno.EACCES), info.value
        assert "open it read-only" in str(info.value)

        with Queue.open(db, read_only=True) as queue:
            assert queue.get_diff_info(BASE, applied.seqno) is not None
            assert len(os.listdir(scratch)) == 1  # the links, while it is open
        assert os.listdir(scratch) == []
        assert verify(db).ok
        assert os.listdir(scratch) == []
    finally:
        undo()
    assert {p.name: p.stat().st_mtime_ns for p in db.iterdir()} == before


@pytest.mark.parametrize("how", ["TMPDIR missing", "no usable temporary directory"])
def test_a_read_only_open_with_no_temporary_directory_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The links of an unwritable directory's read-only open go to the temporary
    directory: when none can be made there (a container with a read-only root file
    system: tempfile finds no usable directory at all, an outside audit), a
    ``FileAccessError`` names TMPDIR. Before, the hint's own look-up of the temporary
    directory raised tempfile's bare ``FileNotFoundError`` instead."""
    db = tmp_path / "db"
    open_queue(db).close()
    monkeypatch.setattr(shadow, "writable_for_rocksdict", lambda path: False)
    if how == "TMPDIR missing":
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    else:

        def none_usable() -> str:
            raise FileNotFoundError(errno.ENOENT, "No usable temporary directory found")

        monkeypatch.setattr(tempfile, "tempdir", None)
        monkeypatch.setattr(tempfile, "gettempdir", none_usable)
    with pytest.raises(FileAccessError, match="TMPDIR") as info:
        Queue.open(db, read_only=True)
    assert info.value.errno == errno.ENOENT
    assert f"make a temporary directory of links to {db} in" in str(info.value)
    if how == "TMPDIR missing":  # the error names the directory (a docs audit), not the db
        assert info.value.filename == str(tmp_path / "missing")
    else:
        assert info.value.filename is None
        assert "in the temporary directory ($TMPDIR, else /tmp):" in str(info.value)
    assert not (tmp_path / "missing").exists()


def test_a_failure_in_the_temporary_directory_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The links cannot be made (the temporary file system full, an outside audit): the
    error named the database's directory and advised freeing its disk; it names the
    temporary directory now, and nothing is left there."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    db = tmp_path / "db"
    open_queue(db).close()
    monkeypatch.setattr(shadow, "writable_for_rocksdict", lambda path: False)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    def full(source: object, target: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "symlink", full)
    with pytest.raises(FileAccessError, match=r"\$TMPDIR") as info:
        Queue.open(db, read_only=True)
    assert info.value.errno == errno.ENOSPC
    assert str(scratch / "imq-read-only-") in str(info.value)
    assert str(db) not in str(info.value)
    assert os.listdir(scratch) == []


def test_an_unreadable_list_of_tables_on_a_read_only_open_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RocksDB cannot read the MANIFEST (mode 0600, another user's: an outside audit):
    a read-only open told its caller to open the directory read-only. It is a
    ``FileAccessError`` saying a file cannot be read now."""
    db = tmp_path / "db"
    open_queue(db).close()
    manifest = db / (db / "CURRENT").read_text().strip()

    def refused(path: str, options: object) -> list[str]:
        raise Exception(  # what rocksdict raises
            f"IO error: While opening a file for sequentially reading: {manifest}: "
            "Permission denied"
        )

    monkeypatch.setattr(rocks.Rdict, "list_cf", refused)
    with pytest.raises(FileAccessError) as info:
        Queue.open(db, read_only=True)
    assert info.value.errno == errno.EACCES
    assert "cannot be read" in str(info.value)
    assert "open it read-only" not in str(info.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to take another effective user")
def test_unwritable_is_judged_for_the_effective_user(tmp_path: Path) -> None:
    """A process whose effective user is not its real one (root that took nobody's
    identity, an outside audit) was judged by its real user: the directory looked
    writable, no links were made, and rocksdict's write failed the open."""
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from imq.storage import shadow\n"
        "os.seteuid(65534)\n"
        "print(shadow.writable_for_rocksdict(Path(sys.argv[1])))\n"
    )
    db = tmp_path / "db"
    db.mkdir(mode=0o755)
    run = subprocess.run(
        [sys.executable, "-c", script, str(db)], capture_output=True, text=True, check=False
    )
    assert run.stdout.strip() == "False", run.stderr


def test_links_left_by_a_dead_process_are_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed process (or one interrupted at the wrong instant) leaves its directory of
    links behind: the next read-only open that makes links removes those no process
    holds locked (a live one keeps a lock on its own: the kernel lets go of it when the
    process ends, and sees it across PID namespaces, which a process id did not: an
    outside audit had a container's reader delete the host's live directory). Left
    alone: a locked one, a young one (its process may not have locked it yet), one that
    holds anything but links and rocksdict's config, and any other name."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(shadow, "writable_for_rocksdict", lambda path: False)
    db = tmp_path / "db"
    open_queue(db).close()
    old = time.time() - 3600
    left = {  # name: swept
        "imq-read-only-1-dead": True,
        "imq-read-only-99999999999999999999-dead": True,  # no pid it could name
        "imq-read-only-2-locked": False,
        "imq-read-only-3-young": False,
        "imq-read-only-4-notes": False,
        "other": False,
    }
    for name in left:
        (scratch / name).mkdir()
        (scratch / name / "000001.sst").symlink_to(db / "CURRENT")
        (scratch / name / "rocksdict-config.json").write_text("{}")
    (scratch / "imq-read-only-4-notes" / "notes.txt").write_text("mine")
    for name in left:
        if name != "imq-read-only-3-young":
            os.utime(scratch / name, (old, old))
    held = os.open(scratch / "imq-read-only-2-locked", os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_SH)
        with Queue.open(db, read_only=True):
            kept = set(os.listdir(scratch))
    finally:
        os.close(held)
    own = {n for n in kept if n.startswith(f"imq-read-only-{os.getpid()}-")}
    assert len(own) == 1  # this open's links
    assert kept - own == {n for n, swept in left.items() if not swept}
    assert (db / "CURRENT").exists()  # the links' targets are untouched
    assert set(os.listdir(scratch)) == kept - own  # and this open's links went at close


_FORK_SCRIPT = """
import os, sys
from imq import Queue
from imq.storage import shadow
shadow.writable_for_rocksdict = lambda path: False
queue = Queue.open(sys.argv[1], read_only=True)
links = queue._store._shadow.path
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: the interpreter's exit hooks run in the child
os.waitpid(pid, 0)
print(links.is_dir(), len(queue.summary()["shards"]))
queue.close()
print(links.exists())
"""


def test_a_forked_childs_exit_leaves_the_parents_links(tmp_path: Path) -> None:
    """The links of a read-only open are removed at close or at the interpreter's exit:
    not by a child forked from the process (whose exit runs the same hooks), while the
    parent still reads through them."""
    db = tmp_path / "db"
    with open_queue(db) as queue:
        Chain(queue).apply(BASE)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    run = run_python(_FORK_SCRIPT, str(db), env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "1", "False"], run.stdout


@pytest.mark.parametrize("read_only", [False, True])
def test_a_dangling_symlink_is_named_as_one(tmp_path: Path, read_only: bool) -> None:
    """A database path that is a symbolic link to nothing: the open said 'File exists'
    (its mkdir's complaint). Nothing is created at the link's target."""
    link = tmp_path / "db"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(FileAccessError, match=r"symbolic link to .*gone, which does not exist"):
        Queue.open(link, quiet_config(), read_only=read_only)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db"]


def _deep_path(base: Path, total: int) -> Path:
    """A path of exactly ``total`` bytes under ``base`` (components of 200 bytes)."""
    text = str(base)
    while len(text) + 201 < total:
        text += "/" + "z" * 200
    text += "/" + "w" * (total - len(text) - 1)
    assert len(text) == total
    return Path(text)


def test_a_path_too_long_for_rocksdbs_file_names_is_refused_before_anything_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory's own path may fit in PATH_MAX when the files RocksDB writes in it
    do not: the open failed inside RocksDB with a ``StorageError`` that spoke of damage,
    after creating the directories and imq's lock file (an outside audit). The longest
    path that leaves room for them opens and reopens, and the path is measured as given
    (a short relative one under a deep working directory opens: a review)."""
    limit = os.pathconf(tmp_path, "PC_PATH_MAX") - 1 - 22
    too_long = _deep_path(tmp_path / "a", limit + 1)
    with pytest.raises(FileAccessError, match=r"leaves too little room") as raised:
        Queue.open(too_long, quiet_config())
    assert raised.value.errno == errno.ENAMETOOLONG
    assert f"use a path of at most {limit} bytes" in str(raised.value)
    assert not (tmp_path / "a").exists()
    fits = _deep_path(tmp_path / "b", limit)
    with Queue.open(fits, quiet_config()) as queue:
        applied = Chain(queue).apply(BASE, 1)
    for read_only in (False, True):
        with Queue.open(fits, quiet_config(), read_only=read_only) as queue:
            assert queue.get_diff_info(BASE, applied.seqno) is not None
    deep = _deep_path(tmp_path / "c", limit + 10)
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    with Queue.open("db", quiet_config()) as queue:
        Chain(queue).apply(BASE, 1)
    assert (deep / "db" / "CURRENT").exists()
