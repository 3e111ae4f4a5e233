"""A process killed in the middle of ``Queue.import_state`` leaves no partial import (D10).

A child process imports a synthetic state of 30,000 messages in 60 chunks into a queue
that already holds data, tells the parent on stdout how far it got, and is killed with
SIGKILL. The parent then opens the queue: the open rolls the import back (warning
``import_rolled_back``), every table holds exactly what it held before, the marker is
gone, and importing the same file again succeeds. A read-only open before that sees the
marker and warns ``import_incomplete``.
"""

from __future__ import annotations

import fcntl
import io
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from builders import (
    BASE,
    FORK_WARNING,
    MC,
    Chain,
    dump,
    open_queue,
    pid_namespace_command,
    shard_rows,
)
from tycho_data import TYCHO

from imq import BlockId, ImqError, Queue, ShardIdent
from imq import verify as verify_module
from imq.cli import inspect as inspect_cli
from imq.state import importer
from imq.state.synth import SynthState, synth_state, write_synth_state
from imq.storage import Table, codec, rocks
from imq.verify import verify

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MASTER_BIN = TYCHO / "persistent_state" / "master.bin"
OTHER = ShardIdent(0, 0x2000_0000_0000_0000)
APPLIED = ShardIdent(0, 0xA000_0000_0000_0000)
MESSAGES = 30_000
WAIT = 120.0  # seconds a child may take to report; only a broken child gets near it

Logs = list[MutableMapping[str, Any]]

CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path

    sys.path.insert(0, sys.argv[1])
    from builders import open_queue
    from imq import BlockId, ShardIdent

    db, source = Path(sys.argv[2]), sys.argv[3]
    wc, prefix, seqno, tail, threshold = (int(a) for a in sys.argv[4:9])
    top_hash, hold = bytes.fromhex(sys.argv[9]), sys.argv[10] == "hold"
    queue = open_queue(db)
    said = False

    def progress(done, total):
        global said
        if not said and done >= threshold:
            said = True
            print("started", done, total, flush=True)
            if hold:
                time.sleep(600)

    block = BlockId(ShardIdent(wc, prefix), seqno)
    report = queue.import_state(source, block, (top_hash, tail), progress=progress)
    print("finished", report.messages, flush=True)
    queue.close()
    """
)


@dataclass(frozen=True)
class Crash:
    state: SynthState
    path: Path


def make_crash_state(tmp_path_factory: pytest.TempPathFactory) -> Crash:
    """The state every child imports (``test_power_loss.py`` imports it too)."""
    state = synth_state(BASE, top_seqno=500, diffs=3, messages_per_diff=10_000, seed=31)
    path = tmp_path_factory.mktemp("crash") / "state.bin"
    assert write_synth_state(state, path, max_chunk_roots=500) == 60
    return Crash(state, path)


@pytest.fixture(scope="module")
def crash_state(tmp_path_factory: pytest.TempPathFactory) -> Crash:
    return make_crash_state(tmp_path_factory)


def build_prior(path: Path) -> dict[str, list[tuple[bytes, bytes]]]:
    """The same data before every import: the masterchain state, a state of another
    shard and two applied diffs. Returns the dump."""
    with open_queue(path) as queue:
        queue.import_state(MASTER_BIN, BlockId(MC, 90))
        other = synth_state(OTHER, top_seqno=40, diffs=2, messages_per_diff=6, seed=7)
        buf = io.BytesIO()
        write_synth_state(other, buf)
        buf.seek(0)
        queue.import_state(buf, other.block_id, other.top_update)
        chain = Chain(queue)
        chain.apply(APPLIED, 3)
        chain.apply(APPLIED, 2)
        return dump(queue)


@dataclass
class Child:
    proc: subprocess.Popen[str]
    lines: list[str]

    def wait_for(self, word: str) -> str:
        """The first stdout line starting with ``word`` (fails if the child exits first)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buffer = b""
        while True:
            ready, _, _ = select.select([fd], [], [], WAIT)
            assert ready, f"the child said nothing for {WAIT} s"
            data = os.read(fd, 4096)
            if not data:
                self.proc.wait()
                assert self.proc.stderr is not None
                raise AssertionError(
                    f"the child exited ({self.proc.returncode}) before '{word}': "
                    f"{self.proc.stderr.read()}"
                )
            buffer += data
            *done, rest = buffer.split(b"\n")
            buffer = rest
            self.lines += [line.decode() for line in done]
            for line in self.lines:
                if line.startswith(word):
                    return line

    def kill(self) -> list[str]:
        """SIGKILL; returns every line the child printed."""
        os.kill(self.proc.pid, signal.SIGKILL)
        out, _ = self.proc.communicate(timeout=WAIT)
        assert self.proc.returncode in (-signal.SIGKILL, 0)
        return self.lines + out.splitlines()


def start_child(
    tmp_path: Path,
    db: Path,
    crash: Crash,
    threshold: int,
    *,
    hold: bool,
    extra_env: dict[str, str] | None = None,
) -> Child:
    """``extra_env``: added to the child's environment (``test_power_loss.py`` preloads
    its recorder that way)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    state = crash.state
    top_hash, tail = state.top_update
    args = [
        sys.executable,
        str(script),
        str(HERE),
        str(db),
        str(crash.path),
        str(state.shard.workchain),
        str(state.shard.prefix),
        str(state.seqno),
        str(tail),
        str(threshold),
        top_hash.hex(),
        "hold" if hold else "run",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        **(extra_env or {}),
    }
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    return Child(proc, [])


def reaped_children() -> Iterator[list[Child]]:
    """A fixture's body: children still running at the end of a test are killed (by
    their own pid)."""
    started: list[Child] = []
    yield started
    for child in started:
        if child.proc.poll() is None:
            os.kill(child.proc.pid, signal.SIGKILL)
            child.proc.communicate(timeout=WAIT)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    yield from reaped_children()


def marker(queue: Queue) -> bytes | None:
    return queue._store.get_latest(Table.VARS, codec.IMPORT_MARKER)


def events(logs: Logs, name: str) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == name]


def assert_rolled_back(queue: Queue, prior: dict[str, list[tuple[bytes, bytes]]]) -> None:
    assert marker(queue) is None
    assert dump(queue) == prior
    assert BASE not in queue.get_commit_pointers()
    assert queue.get_last_committed_mc_block_id() == BlockId(MC, 90)


def assert_reimport(queue: Queue, crash: Crash, tmp_path: Path) -> None:
    """The same file imports completely, into exactly what a clean import writes."""
    state = crash.state
    report = queue.import_state(crash.path, state.block_id, state.top_update)
    assert report.messages == MESSAGES and report.written_diffs == 3
    assert queue.get_commit_pointers()[BASE].seqno == state.seqno
    reference = tmp_path / "reference"
    build_prior(reference)
    with open_queue(reference) as clean:
        clean.import_state(crash.path, state.block_id, state.top_update)
        assert dump(queue) == dump(clean)


# -----------------------------------------------------------------------------------------------


def test_kill_after_batches_were_written(
    tmp_path: Path, db_path: Path, crash_state: Crash, children: list[Child], logs: Logs
) -> None:
    prior = build_prior(db_path)
    child = start_child(tmp_path, db_path, crash_state, 20_000, hold=True)
    children.append(child)
    line = child.wait_for("started")
    assert int(line.split()[1]) > importer.BATCH_ROWS  # a batch of messages is on disk
    lines = child.kill()
    assert not any(x.startswith("finished") for x in lines)
    with open_queue(db_path) as queue:
        (event,) = events(logs, "import_rolled_back")
        assert event["reason"] == "interrupted" and sorted(event["diffs"]) == [498, 499, 500]
        assert queue.metrics.counter("imports_rolled_back") == 1
        assert_rolled_back(queue, prior)
        assert_reimport(queue, crash_state, tmp_path)


def test_kill_before_any_batch(
    tmp_path: Path, db_path: Path, crash_state: Crash, children: list[Child], logs: Logs
) -> None:
    """The marker is written, no message batch yet."""
    prior = build_prior(db_path)
    child = start_child(tmp_path, db_path, crash_state, 1, hold=True)
    children.append(child)
    line = child.wait_for("started")
    assert int(line.split()[1]) < importer.BATCH_ROWS
    child.kill()
    with open_queue(db_path) as queue:
        (event,) = events(logs, "import_rolled_back")
        assert event["reason"] == "interrupted"
        assert_rolled_back(queue, prior)
        assert_reimport(queue, crash_state, tmp_path)


def test_read_only_open_sees_the_partial_import_and_warns(
    tmp_path: Path, db_path: Path, crash_state: Crash, children: list[Child], logs: Logs
) -> None:
    prior = build_prior(db_path)
    child = start_child(tmp_path, db_path, crash_state, 20_000, hold=True)
    children.append(child)
    child.wait_for("started")
    child.kill()
    block = str(crash_state.state.block_id)
    with Queue.open(db_path, read_only=True) as viewer:
        (event,) = events(logs, "import_incomplete")
        assert event["log_level"] == "warning"
        assert events(logs, "import_rolled_back") == []
        assert marker(viewer) is not None
        assert len(shard_rows(viewer, Table.MESSAGES, BASE)) > importer.BATCH_ROWS
        # What an operator looks at says so, not only a log line a level can hide.
        assert str(viewer.unfinished_import()) == block
        assert viewer.summary()["unfinished_import"] == block
        short = crash_state.state.block_id.short
        with pytest.raises(ImqError, match=f"an import of block {short} .* interrupted"):
            viewer.export_state(BASE, 499, 1, io.BytesIO())
    text = io.StringIO()
    inspect_cli.run(db_path, as_json=False, out=text)
    assert f"UNFINISHED IMPORT of block {block}" in text.getvalue()
    problems = verify(db_path).problems
    assert problems[0].startswith(f"an import of block {block} was interrupted"), problems
    warned = len(events(logs, "import_incomplete"))  # the viewer's and inspect's opens
    with open_queue(db_path) as queue:
        assert len(events(logs, "import_rolled_back")) == 1
        assert_rolled_back(queue, prior)
    with Queue.open(db_path, read_only=True) as viewer:
        assert len(events(logs, "import_incomplete")) == warned  # nothing left to warn about
        assert viewer.unfinished_import() is None
        assert viewer.summary()["unfinished_import"] is None
    assert verify(db_path).ok


def _stray_diff(db: Path) -> None:
    """Damage outside any import: the records of APPLIED's diff 2 deleted, so its
    messages and statistics belong to no stored diff."""
    with open_queue(db) as queue:
        info = queue.get_diff_info(APPLIED, 2)
        assert info is not None
        txn = queue._store.transaction()
        txn.delete(Table.DIFF_INFO, codec.diff_info_key(APPLIED, 2))
        txn.delete(Table.DIFF_TAIL, codec.tail_key(APPLIED, info.max_message, 2))
        queue._store.write(txn)


def test_an_import_under_way_is_told_from_an_interrupted_one(
    tmp_path: Path, db_path: Path, crash_state: Crash, children: list[Child], logs: Logs
) -> None:
    """A reader beside a running import (an operator's `imq verify` or `inspect` during
    a cold start) sees its marker and the batches written so far. Before, it was told
    the import "was interrupted", to roll it back with `imq gc`, and `verify` failed
    on the import's messages of no stored diff: a false alarm. What is not the
    import's is still reported: a diff whose records were lost, in another shard. Once
    the importer dies, the same views say interrupted, as before."""
    build_prior(db_path)
    _stray_diff(db_path)
    damage = verify(db_path).problems
    assert len(damage) == 2 and all("belong to no stored diff" in p for p in damage), damage
    child = start_child(tmp_path, db_path, crash_state, 20_000, hold=True)
    children.append(child)
    child.wait_for("started")  # alive, its import half written, its import lock held
    block = str(crash_state.state.block_id)
    with Queue.open(db_path, read_only=True) as viewer:
        assert events(logs, "import_incomplete") == []
        assert len(events(logs, "import_under_way")) == 1
        assert str(viewer.unfinished_import()) == block
        assert viewer.import_running()
        summary = viewer.summary()
        assert summary["unfinished_import"] == block and summary["import_running"] is True
        with pytest.raises(ImqError, match=r"is under way .* export once it has returned"):
            viewer.export_state(BASE, 499, 1, io.BytesIO())
    text = io.StringIO()
    inspect_cli.run(db_path, as_json=False, out=text)
    assert f"IMPORT UNDER WAY of block {block}" in text.getvalue()
    assert "UNFINISHED IMPORT" not in text.getvalue()
    report = verify(db_path)
    assert report.problems == damage  # the import's messages of no stored diff not among them
    assert report.notes[0].startswith(f"an import of block {block} is under way"), report.notes
    child.kill()
    with Queue.open(db_path, read_only=True) as viewer:
        assert len(events(logs, "import_incomplete")) == 1
        assert not viewer.import_running()
        assert viewer.summary()["import_running"] is False
    problems = verify(db_path).problems
    assert problems[0].startswith(f"an import of block {block} was interrupted"), problems
    # the damage's strays and the import's counted together now
    (strays,) = [p for p in damage if "stored messages belong" in p]
    (now,) = [p for p in problems if "stored messages belong" in p]
    assert int(now.split()[0]) > int(strays.split()[0]) > 0, (strays, now)


def test_an_import_under_way_is_seen_from_another_pid_namespace(
    tmp_path: Path, db_path: Path, crash_state: Crash, children: list[Child]
) -> None:
    """An operator's `imq inspect` in another container than the node's (a sidecar: its
    own PID namespace, the queue's directory shared). ``/proc/locks`` there lists no lock
    of the node's processes, so the running import looked interrupted, with the advice
    to roll it back; the import lock is now also tried when the listing does not name
    it."""
    namespaced = pid_namespace_command()
    if namespaced is None:
        pytest.skip("no PID namespace can be made here (needs root or user namespaces)")
    build_prior(db_path)
    child = start_child(tmp_path, db_path, crash_state, 20_000, hold=True)
    children.append(child)
    child.wait_for("started")  # its import lock held
    block = str(crash_state.state.block_id)

    def inspect_elsewhere() -> str:
        done = subprocess.run(
            [*namespaced, sys.executable, "-m", "imq", "inspect", str(db_path)],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    seen = inspect_elsewhere()
    assert f"IMPORT UNDER WAY of block {block}" in seen, seen
    assert "UNFINISHED IMPORT" not in seen
    child.kill()
    assert f"UNFINISHED IMPORT of block {block}" in inspect_elsewhere()


def test_an_import_takes_its_lock_past_a_readers_probe(db_path: Path) -> None:
    """A reader that cannot see the import lock listed probes it with a shared lock for a
    moment; an import starting in that moment waits it out instead of writing unlocked
    (which readers would take for an interrupted import)."""
    with open_queue(db_path) as queue:
        store = queue._store
        with store.importing():
            pass  # creates the lock file
        probe = os.open(db_path / rocks.IMPORT_LOCK_FILE, os.O_RDONLY)
        fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a reader's probe, held 50 ms
        threading.Timer(0.05, os.close, (probe,)).start()
        with store.importing():
            assert rocks._flock_held(db_path / rocks.IMPORT_LOCK_FILE)  # listed: taken
        assert not rocks.import_lock_held(db_path)


def _child_holds(pid: int, file: Path) -> bool:
    """Whether process ``pid`` has a descriptor open on ``file``."""
    fds = Path(f"/proc/{pid}/fd")
    return any(os.path.realpath(fd) == str(file.resolve()) for fd in fds.iterdir())


@pytest.mark.filterwarnings(FORK_WARNING)
def test_a_child_forked_during_an_import_does_not_keep_its_lock(db_path: Path) -> None:
    """A child forked while an import holds its lock shares the lock's descriptor. Its
    copy is closed at the fork, and the import releases the lock with ``LOCK_UN``: once
    the import is over, or its process gone, readers no longer see it under way while
    the child lives (before, the child kept it held until it exited)."""
    lock = db_path / rocks.IMPORT_LOCK_FILE
    with open_queue(db_path) as queue:
        with queue._store.importing():
            ready, said = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: its fork hooks have run; says so, sleeps until killed
                try:
                    os.write(said, b"!")
                    time.sleep(60)
                finally:
                    os._exit(0)
            os.close(said)
            try:
                assert os.read(ready, 1) == b"!"
                assert rocks.import_lock_held(db_path)
                assert not _child_holds(pid, lock)  # closed at the fork
            except BaseException:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise
            finally:
                os.close(ready)
        try:
            assert not rocks.import_lock_held(db_path)  # over: released
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        # A copy the fork hook did not close (a C library's fork): LOCK_UN frees the lock
        # all the same; closing the import's own descriptor alone would not.
        held = set(rocks._LOCK_FDS)  # the writer's lock
        with queue._store.importing():
            (fd,) = rocks._LOCK_FDS - held  # the import's
            copy = os.dup(fd)
        try:
            assert not rocks.import_lock_held(db_path)
        finally:
            os.close(copy)


def test_verify_looks_at_the_import_lock_as_its_view_is_taken(
    tmp_path: Path, db_path: Path, crash_state: Crash, children: list[Child]
) -> None:
    """``verify`` looks at the import lock right before RocksDB takes its view, and after.
    An import under way then that ends right after is not reported as interrupted (the
    lock was looked at after the open only); one that dies during the open's checks
    before it (they can take seconds) is not reported as under way, its stray messages
    hidden (two outside reviews). Simulated: the lock is seen held until a given step of
    the open, then not."""
    build_prior(db_path)
    child = start_child(tmp_path, db_path, crash_state, 20_000, hold=True)
    children.append(child)
    child.wait_for("started")
    child.kill()  # the marker stays; whether it is under way is what the lock says
    ended = [False]

    def held(_path: object) -> bool:
        return not ended[0]

    def ending(step: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = step(*args, **kwargs)
            ended[0] = True  # the import ends right after this step
            return result

        return call

    def verified_after(step: str) -> Any:
        ended[0] = False
        with (
            mock.patch.object(rocks, "import_lock_held", held),
            mock.patch.object(verify_module, "import_lock_held", held),
            mock.patch.object(rocks.Store, step, ending(getattr(rocks.Store, step))),
        ):
            return verify(db_path)

    taken = verified_after("_open_rocksdb")  # ends as the view is taken
    assert "is under way" in taken.notes[0], taken.notes
    checked = verified_after("_check_logs")  # ends during the checks before the view
    assert checked.problems[0].startswith("an import of block"), checked.problems
    assert "was interrupted" in checked.problems[0], checked.problems


def test_a_writer_that_is_not_importing_leaves_a_stale_marker_interrupted(
    tmp_path: Path, db_path: Path, crash_state: Crash, children: list[Child]
) -> None:
    """Only the import lock says an import is under way, not the writer's lock: a writer
    that holds the queue without importing (here: one whose open is stopped before it
    rolls the crash's import back) leaves the marker what it is, an interrupted import,
    and every stray row counted (an outside review found the writer's lock taken for an
    import under way)."""
    build_prior(db_path)
    child = start_child(tmp_path, db_path, crash_state, 20_000, hold=True)
    children.append(child)
    child.wait_for("started")
    child.kill()  # the marker and the partial import stay
    with (
        mock.patch.object(importer, "rollback_import", return_value=False),
        open_queue(db_path) as writer,  # holds imq.lock, imports nothing
    ):
        assert writer.unfinished_import() is not None
        assert not writer.import_running()
        report = verify(db_path)
    assert report.problems[0].startswith("an import of block"), report.problems
    assert any("belong to no stored diff" in p for p in report.problems), report.problems


@pytest.mark.parametrize("threshold", [1, 9_000, 17_000, 25_000, MESSAGES])
def test_all_or_nothing_wherever_the_kill_lands(
    tmp_path: Path,
    db_path: Path,
    *,
    crash_state: Crash,
    children: list[Child],
    logs: Logs,
    threshold: int,
) -> None:
    """Killed while it runs on (no pause): whatever the child managed, the queue after
    reopen holds either the prior data or the prior data plus the whole state."""
    prior = build_prior(db_path)
    child = start_child(tmp_path, db_path, crash_state, threshold, hold=False)
    children.append(child)
    child.wait_for("started")
    finished = any(x.startswith("finished") for x in child.kill())
    with open_queue(db_path) as queue:
        assert marker(queue) is None
        rolled = events(logs, "import_rolled_back")
        pointer = queue.get_commit_pointers().get(BASE)
        if pointer is None:
            assert not finished and len(rolled) == 1
            assert_rolled_back(queue, prior)
            assert_reimport(queue, crash_state, tmp_path)
        else:
            assert rolled == [] and pointer.seqno == crash_state.state.seqno
            assert len(shard_rows(queue, Table.MESSAGES, BASE)) == MESSAGES


def test_an_interrupt_just_after_the_last_batch_says_the_import_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C landing after the import's last batch was written and before the call
    returned: the interrupt goes on to the caller, and nothing can be rolled back (the
    marker went with that batch). It says so in a note: an outside audit found callers
    and `imq import` told that the import was rolled back while the queue held it all."""
    state = synth_state(BASE, top_seqno=40, diffs=2, messages_per_diff=20, seed=5)
    source = tmp_path / "state.bin"
    write_synth_state(state, source)
    finish = importer._finish

    def finish_then_interrupt(*args: Any, **kwargs: Any) -> None:
        finish(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(importer, "_finish", finish_then_interrupt)
    db = tmp_path / "db"
    queue = open_queue(db)
    with pytest.raises(KeyboardInterrupt) as raised:
        queue.import_state(source, state.block_id, state.top_update)
    assert any("had finished before this exception" in n for n in raised.value.__notes__)
    queue.close()
    monkeypatch.undo()
    with open_queue(db) as queue:
        assert queue.get_diff_info(BASE, state.block_id.seqno) is not None
        assert queue.unfinished_import() is None
