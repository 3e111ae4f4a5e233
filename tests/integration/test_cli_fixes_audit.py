"""The CLI defects an audit found, each run through a real ``imq`` process: ``verify`` after
an ordinary GC, ``demo`` beside a live writer or on someone's directory, ``import`` from a
pipe, ``compact`` and ``gc`` on a damaged database, Ctrl-C, and a bad op log.

A command runs as ``python -m imq`` does, with Python's own Ctrl-C handler installed even
when the test runner was started with SIGINT ignored (as a background job is).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zstandard
from builders import MC, Chain, damage_largest_table_file, open_queue, quarter_shards, top
from state_fixtures import SHARD_BIN, SHARD_TOP_HASH

from imq.state.synth import synth_state, write_synth_state
from imq.storage import Table

REPO = Path(__file__).resolve().parents[2]
SHARD_ID = "0:8000000000000000:160"
SHARDS = quarter_shards()
# `python -m imq`, with the default SIGINT handler whatever the parent ignores.
_IMQ = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'imq'; runpy.run_module('imq', run_name='__main__', alter_sys=True)"
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _imq(
    *argv: str | Path, stdin: bytes | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", _IMQ, *map(str, argv)],
        input=None if stdin is None else stdin,
        capture_output=True,
        cwd=cwd,
        env=_env(),
        timeout=120,
        check=False,
    )
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode(), done.stderr.decode()
    )


def _error_line(done: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The single stderr line of a refused command (no traceback, nothing else)."""
    assert done.returncode == code, done
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def _summary(db: Path) -> dict[str, object]:
    done = _imq("inspect", db, "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    summary.pop("path")
    return summary  # type: ignore[no-any-return]


# -- 1. verify after an ordinary GC ------------------------------------------------------------


def test_verify_passes_after_the_demo_and_its_gc(tmp_path: Path) -> None:
    """The demo's GC stops at a processed_to inside a diff: no lost message."""
    db = tmp_path / "demo-db"
    assert _imq("demo", "--db", db).returncode == 0
    done = _imq("verify", db)
    assert done.returncode == 0, done.stdout
    assert "ok: checksums and cross-checks pass" in done.stdout
    assert _imq("gc", db).returncode == 0
    assert _imq("verify", db).returncode == 0


# -- 2. demo: never beside a live writer, never someone's files --------------------------------


def test_demo_refuses_a_database_a_live_writer_holds(tmp_path: Path) -> None:
    db = tmp_path / "db"
    assert _imq("demo", "--db", db).returncode == 0
    before = _summary(db)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from imq import Queue, QueueConfig; "
            "q = Queue.open(sys.argv[1], QueueConfig(gc_enabled=False)); "
            "print('ready', flush=True); sys.stdin.read(); q.close()",
            str(db),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=_env(),
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
        line = _error_line(_imq("demo", "--db", db))
        assert line.startswith("imq: error: ")
        assert "is already open" in line and "not deleted" in line
        assert (db / "CURRENT").is_file()
    finally:
        holder.communicate(b"", timeout=60)
    assert holder.returncode == 0
    assert _summary(db) == before  # the writer's database is whole


@pytest.mark.parametrize(
    "names",
    [["CURRENT", "notes.txt"], ["CURRENT", "imq.lock", "notes.txt"], ["CURRENT"]],
    ids=["current-and-notes", "lock-current-and-notes", "current-alone"],
)
def test_demo_never_deletes_what_is_not_an_imq_database(names: list[str], tmp_path: Path) -> None:
    """A directory with a file named CURRENT used to be taken for a database and deleted
    whole, the user's files with it."""
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in names:
        (mine / name).write_text(f"the user's {name}")
    line = _error_line(_imq("demo", "--db", mine))
    assert "not deleted" in line
    assert sorted(p.name for p in mine.iterdir()) == sorted(names)
    assert all((mine / n).read_text() == f"the user's {n}" for n in names)


def test_demo_replaces_its_own_database(tmp_path: Path) -> None:
    db = tmp_path / "db"
    first = _imq("demo", "--db", db)
    second = _imq("demo", "--db", db)
    assert first.returncode == second.returncode == 0, second.stderr
    assert first.stdout.split("\nLatency")[0] == second.stdout.split("\nLatency")[0]


# -- 3. import from a pipe -------------------------------------------------------------------


def _feed(
    fifo: Path, data: bytes, *, pause_at: int | None = None
) -> tuple[threading.Thread, threading.Event]:
    """Write ``data`` into the FIFO once a reader opens it (``pause_at``: stop there until
    the returned event is set, then close without the rest)."""
    resume = threading.Event()

    def write() -> None:
        deadline = time.monotonic() + 60
        while True:  # a non-blocking open fails until the reader is there
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.01)
        os.set_blocking(fd, True)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data if pause_at is None else data[:pause_at])
                f.flush()
                if pause_at is not None:
                    resume.wait(60)
        except BrokenPipeError:
            pass

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread, resume


@pytest.mark.parametrize("compressed", [False, True], ids=["raw", "zstd"])
def test_import_reads_a_fifo_once(compressed: bool, tmp_path: Path) -> None:
    """The CLI used to read the source for the header check, then open it again: a pipe
    was drained by then ('truncated at offset 0') and an empty database was left."""
    data = SHARD_BIN.read_bytes()
    if compressed:
        data = zstandard.ZstdCompressor().compress(data)
    fifo = tmp_path / "state.fifo"
    os.mkfifo(fifo)
    writer, _ = _feed(fifo, data)
    top_update = f"{SHARD_TOP_HASH}:3"
    db = tmp_path / "from-fifo"
    done = _imq(
        "import", db, fifo, "--block-id", SHARD_ID, "--top-update", top_update, "--no-progress"
    )
    writer.join(10)
    assert done.returncode == 0, done.stderr
    assert "4,300 messages" in done.stdout
    reference = tmp_path / "from-file"
    assert (
        _imq("import", reference, SHARD_BIN, "--block-id", SHARD_ID, "--no-progress").returncode
        == 0
    )
    assert _summary(db) == _summary(reference)
    assert _imq("verify", db).returncode == 0


def _import_stdin(
    db: Path, block_id: str, name: str = "/dev/stdin"
) -> subprocess.CompletedProcess[str]:
    return _imq(
        "import", db, name, "--block-id", block_id, "--no-progress",
        stdin=SHARD_BIN.read_bytes(),
    )  # fmt: skip


@pytest.mark.parametrize("name", ["/dev/stdin", "-"])
def test_import_reads_stdin(tmp_path: Path, name: str) -> None:
    done = _import_stdin(tmp_path / "db", SHARD_ID, name)
    assert done.returncode == 0, done.stderr
    assert "3 diffs (3 written" in done.stdout


def test_a_bad_header_on_stdin_creates_no_database(tmp_path: Path) -> None:
    db = tmp_path / "db"
    done = _import_stdin(db, "0:8000000000000000:161")
    assert "belongs to block" in _error_line(done)
    assert not db.exists()


# -- 4. compact and gc on a damaged database ----------------------------------------------------


def _damaged(db: Path) -> None:
    """A database whose messages table file has a damaged block, with GC due on it."""
    q = open_queue(db)
    chain = Chain(q)
    for seqno in (1, 2):
        for shard in SHARDS:
            chain.apply(shard, 200)
        chain.apply(MC, 0, processed_to={s: chain.of(s)[0].max_message for s in SHARDS})
        q.commit_diff([top(MC, seqno)] + [top(s, seqno, seqno) for s in SHARDS])
    q._store.flush(list(Table))
    q.close()
    damage_largest_table_file(db)


def _fails_on_a_damaged_database(tmp_path: Path, command: str) -> str:
    """Run ``command`` on a damaged database: exit 1, no traceback, nothing on stdout;
    the last stderr line (the library's own warning event, queue_closed_with_error,
    may come before it)."""
    db = tmp_path / "db"
    _damaged(db)
    done = _imq(command, db)
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("imq: error: ") and f"imq verify {db}" in line
    return line


def test_compact_of_a_damaged_database_fails(tmp_path: Path) -> None:
    """RocksDB's manual compaction meets the damaged block and returns as if it had
    succeeded; the failure shows only when the queue closes. It used to print 'compacted
    ... 6 tables' and exit 0."""
    line = _fails_on_a_damaged_database(tmp_path, "compact")
    assert line.startswith(f"imq: error: storage error in queue database {tmp_path / 'db'}")
    assert "during compaction" in line and "Corruption" in line and "restore" in line


def test_gc_of_a_damaged_database_fails(tmp_path: Path) -> None:
    _fails_on_a_damaged_database(tmp_path, "gc")


def test_compact_of_a_sound_database_still_succeeds(tmp_path: Path) -> None:
    db = tmp_path / "db"
    assert _imq("demo", "--db", db).returncode == 0
    done = _imq("--log-level", "error", "compact", db)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"compacted {db}: 6 tables")
    assert done.stderr == ""


# -- 5. Ctrl-C ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sig", "code", "word"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
    ids=["SIGINT", "SIGTERM"],
)
def test_ctrl_c_during_an_import_is_one_line_and_rolls_back(
    tmp_path: Path, sig: signal.Signals, code: int, word: str
) -> None:
    """A state of about 5 MB (its header 1.4 MB, which the check reads before the
    database is created) fed through a FIFO that stalls at 80 %: the import is under way
    (database created, rows written) when SIGINT arrives. SIGTERM (``kill``, systemd,
    ``timeout``) stops it the same way (a user audit: it left the partial import and no
    message), with its own exit status."""
    state = synth_state(diffs=3, messages_per_diff=15_000, seed=3)
    path = tmp_path / "state.bin"
    write_synth_state(state, path)
    data = path.read_bytes()
    fifo = tmp_path / "state.fifo"
    os.mkfifo(fifo)
    writer, resume = _feed(fifo, data, pause_at=len(data) * 4 // 5)
    db = tmp_path / "db"
    block_id = f"{state.shard}:{state.seqno}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _IMQ,
            "import",
            str(db),
            str(fifo),
            "--block-id",
            block_id,
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    try:
        deadline = time.monotonic() + 60
        while not (db / "CURRENT").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (db / "CURRENT").exists(), "the import did not start"
        time.sleep(0.5)  # let it read what the pipe holds, then block on the rest
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        resume.set()
        if proc.poll() is None:
            proc.kill()
        writer.join(10)
    assert proc.returncode == code, err
    assert out == b""
    assert b"Traceback" not in err
    *logged, last = err.decode().strip().splitlines()
    assert last == (
        f"imq: {word}; the import was rolled back (or is, at the database's next open): "
        "the database keeps nothing of the state (a directory the import created is removed)"
    )
    # The queue's own log: the rollback, and the interrupted call retiring the handle.
    assert all(
        "import_rolled_back" in line or "queue_call_interrupted" in line for line in logged
    ), err
    rolled_back = [line for line in logged if "import_rolled_back" in line]
    assert rolled_back and all("reason=interrupted" in line for line in rolled_back), err
    assert not db.exists()  # the import created it: it went with the import


# -- 7. a bad op log ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"imq_ops":1}\n{"step":1,\n', "line 2: not JSON: Expecting property name"),
        ("not json\n", "line 1: not JSON: Expecting value (column 1)"),
        ('{"imq_ops":1}\n\n{"step":1,"op":"open"}\n[1]\n', "line 4: an array, not an object"),
        ('{"imq_ops":1}\nnull\n', "line 2: null, not an object"),
        ('{"imq_ops":1}\n{"op":"open"}\n', 'line 2: a step without an integer "step"'),
    ],
    ids=["cut-short", "not-json", "not-an-object", "null", "no-step"],
)
def test_a_bad_op_log_names_the_file_and_line(text: str, says: str, tmp_path: Path) -> None:
    log = tmp_path / "ops.jsonl"
    log.write_text(text)
    line = _error_line(_imq("replay", log))
    assert line == f"imq: error: op log {log} {says}" or (str(log) in line and says in line), line


@pytest.mark.parametrize("target", ["parent", "group"])
def test_ctrl_c_during_a_simulation_with_a_queue_process_is_one_line(
    tmp_path: Path, target: str
) -> None:
    """`imq simulate --kill` runs its queue in a child process. A Ctrl-C that cut a call
    short between its request and its answer left the answer in the pipe, where the
    next call read it as its own (a TypeError traceback, exit 1; an outside audit); a
    terminal's Ctrl-C, which reaches the child too, killed it mid-call. Now the child
    ignores SIGINT and the parent stops it: exit 130, one line, a sound queue."""
    run = tmp_path / "sim"
    argv = ["simulate", "--fresh", "--rounds", "100000", "--kill", "--dir", str(run), "--no-plot"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _IMQ, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        start_new_session=True,  # its own process group, as a terminal's job
    )
    try:
        deadline = time.monotonic() + 60
        while not (run / "queue" / "CURRENT").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(2.0)  # well into the rounds: calls to the queue process all the time
        if target == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert b"Traceback" not in err
    assert err.decode().strip().splitlines()[-1].startswith("imq: interrupted; the run stopped")
    assert _imq("verify", run / "queue").returncode == 0
