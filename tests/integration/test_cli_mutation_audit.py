"""Outside mutation audit of the operator CLI (stop 49): ``imq/cli/main.py``,
``imq/cli/common.py``, ``imq/cli/state.py``, ``imq/cli/simulate.py``, ``imq/cli/demo.py``
and ``imq/errors.py`` (with the read-only opens of ``imq/cli/inspect.py`` and
``imq/cli/verify.py``): exit codes, argument checks, one-line errors and their hints,
stdout against stderr, progress lines, refusals of paths, read-only opens.

130 mutants, each run against the CLI's test files (a survivor of that first run also
against the other files that exercise its code): 85 killed, 6 equivalent, 39 survived
(gaps), each pinned here by one test per documented rule (a test may pin several
mutants; the mutant is named in its docstring; the last gap, an op-log close error
raised over the run's own error in ``_OpLogFile.__exit__``, was pinned after the
audit). One bug, fixed (its test fails on the code before): an output path under a
plain file was reported as a missing directory. The audit's smaller findings, each
fixed with a test at the end: ``verify`` said "no queue database" of one that lost its
CURRENT file, ``simulate``'s paths under a plain file gave "Not a directory" or "File
exists" with no next step, ``--commit-every 0`` named a setting the command does not
have, and an export of bodies that are no messages said nothing of what to do.

Each test pins a rule of README.md's CLI paragraphs, ``docs/api.md``'s errors table,
``docs/simulation.md`` or a command's ``--help``.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any, ClassVar

import pytest
from cli_runner import Imq
from state_fixtures import DUMP_STATES, MASTER_BIN, SHARD_BIN, state_bytes

import imq as imq_package
from imq import (
    BlockId,
    BlockIdShort,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    ShardIdent,
    TopBlock,
)
from imq.cli import demo
from imq.cli import simulate as simulate_cli
from imq.cli import state as state_cli
from imq.cli.common import Heartbeat
from imq.cli.main import build_parser, main
from imq.errors import CorruptDataError, DiffConflictError, QueueClosedError, StorageError
from imq.sim import SimConfig
from imq.state.boc import CellBuilder, encode_boc
from imq.state.exporter import MAX_TAIL_LEN
from imq.state.synth import synth_state, write_synth_state

DUMP35, DUMP36 = DUMP_STATES[1], DUMP_STATES[2]
MASTER_TOP = "5795ca5d1b8d0c1ce96394eef851bde718ff2e14fd2840098ed2bb7640f278c5"  # master.bin


def _one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_version_names_the_program_and_its_version(imq: Imq) -> None:
    """README: ``imq --version`` names the version (as ``imq X.Y.Z`` on stdout, exit 0).
    Mutant: the program's name dropped from the line."""
    run = imq("--version")
    assert run.code == 0
    assert run.out.splitlines()[0] == f"imq {imq_package.__version__}"


def test_a_refused_path_with_a_newline_is_still_one_line(imq: Imq, tmp_path: Path) -> None:
    """README: a path that cannot be used is one line on stderr and exit status 1; a name
    with a line break in it (``$'db\\nold'``) must not split it. Mutant: the error text
    printed as it is, without joining its lines."""
    run = imq("inspect", tmp_path / "db\nold")
    assert run.code == 1
    line = _one_error_line(run.err)
    assert line.startswith("imq: error: no queue database at ")
    assert run.out == ""


def test_an_os_error_names_the_path_it_met(imq: Imq, tmp_path: Path) -> None:
    """README: a path that cannot be used is one line on stderr, exit 1; the line names the
    path (errors.py: messages name the file involved). ``simulate --dir`` under a plain
    file fails in the operating system. Mutants: the OSError's file name left out; its exit
    status made 2."""
    blocker = tmp_path / "plain"
    blocker.write_text("x")
    run = imq("simulate", "--dir", blocker / "sub", "--rounds", "5", "--no-plot")
    assert run.code == 1
    line = _one_error_line(run.err)
    assert line.startswith("imq: error: ")
    assert str(blocker / "sub") in line


@pytest.fixture(scope="module")
def demo_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A queue the demo filled (3 shards, committed and GC'd), made once; tests that write
    copy it (:func:`_copy`)."""
    db = tmp_path_factory.mktemp("demo") / "db"
    demo.run(db, io.StringIO())
    return db


def _copy(db: Path, to: Path) -> Path:
    shutil.copytree(db, to)
    return to


# -- paths a command cannot use ---------------------------------------------------------------


def test_import_into_an_empty_directory_is_allowed(imq: Imq, tmp_path: Path) -> None:
    """``imq import``'s refusal of a directory says "give a new or empty directory": an
    existing empty directory (a mount point, say) takes the import. Mutant: every
    directory without a database refused."""
    db = tmp_path / "empty"
    db.mkdir()
    run = imq("import", db, MASTER_BIN, "--block-id", "-1:8000000000000000:90", "--no-progress")
    assert run.code == 0, run.err
    assert (db / "CURRENT").is_file()


def test_import_into_a_path_that_is_a_file_says_so(imq: Imq, tmp_path: Path) -> None:
    """A file given as the import's database directory is named as a file (one line, exit
    1, the file unchanged). Mutant: the check dropped."""
    plain = tmp_path / "plain"
    plain.write_text("keep")
    run = imq("import", plain, MASTER_BIN, "--block-id", "-1:8000000000000000:90")
    assert run.code == 1
    assert _one_error_line(run.err) == (
        f"imq: error: {plain} is a file, not a queue database directory"
    )
    assert plain.read_text() == "keep"


@pytest.mark.parametrize("kind", ["directory", "missing"])
def test_an_input_file_that_cannot_be_read_says_why(imq: Imq, tmp_path: Path, kind: str) -> None:
    """README: a path that cannot be used is one line, exit 1, saying why in the CLI's own
    words: the state or diff file is a directory, or does not exist; import creates no
    database. Mutants: the checks of ``input_file`` dropped, in it or at its call in
    ``import`` and ``dump-diff`` (the open's own error text instead)."""
    given = tmp_path / "given"
    if kind == "directory":
        given.mkdir()
    why = "is a directory, not a file" if kind == "directory" else "does not exist"
    db = tmp_path / "db"
    run = imq("import", db, given, "--block-id", "-1:8000000000000000:90")
    assert run.code == 1
    assert _one_error_line(run.err) == f"imq: error: state file {given} {why}"
    assert not db.exists()
    run = imq("dump-diff", given)
    assert run.code == 1
    assert _one_error_line(run.err) == f"imq: error: file {given} {why}"


def test_export_to_a_directory_is_refused_before_reading(
    imq: Imq, demo_db: Path, tmp_path: Path
) -> None:
    """``imq export ... OUT``: OUT is a file; a directory is refused up front in one line
    (exit 1), before the database is read, and left as it was. Mutant: the check
    dropped."""
    out = tmp_path / "out"
    out.mkdir()
    run = imq(
        "export", demo_db, "--shard", "0:4000000000000000", "--seqno", "2", "--tail-len", "1", out
    )
    assert run.code == 1
    assert _one_error_line(run.err) == f"imq: error: output {out} is a directory, not a file"
    assert list(out.iterdir()) == []


# -- a queue's close ----------------------------------------------------------------------------


# -- progress -----------------------------------------------------------------------------------


# -- import, export, dump-diff ------------------------------------------------------------------


def test_a_block_option_that_is_a_directory_says_so(imq: Imq, tmp_path: Path) -> None:
    """README: a path that cannot be used is one line, exit 1, saying why; ``--block DIR``
    is named as a directory, before any database exists. Mutant: the check dropped (the
    read's own error)."""
    folder = tmp_path / "blocks"
    folder.mkdir()
    db = tmp_path / "db"
    run = imq("import", db, MASTER_BIN, "--block-id", "-1:8000000000000000:90", "--block", folder)
    assert run.code == 1
    assert _one_error_line(run.err) == f"imq: error: block file {folder} is a directory, not a file"
    assert not db.exists()


def test_tail_len_range_is_one_to_the_maximum_inclusive(
    imq: Imq, demo_db: Path, tmp_path: Path
) -> None:
    """``imq export --tail-len``: ``tail_len must be in 1..=1000`` (MAX_TAIL_LEN, inclusive),
    checked as an argument: 1000 passes (the export then says the tail reaches below seqno
    0); 1001 is a bad argument, exit 2 (README), before the database path is looked at.
    Mutants: the bound made exclusive; one past it left to the export (a missing database
    then exits 1)."""
    out = tmp_path / "out.bin"
    shard = ["--shard", "0:4000000000000000", "--seqno", "2"]
    run = imq("export", demo_db, *shard, "--tail-len", str(MAX_TAIL_LEN), out)
    assert run.code == 2
    assert "must be in" not in run.err
    assert "reaches below seqno 0" in run.err
    run = imq("export", tmp_path / "missing", *shard, "--tail-len", str(MAX_TAIL_LEN + 1), out)
    assert run.code == 2
    assert f"argument --tail-len: tail_len must be in 1..={MAX_TAIL_LEN}, got 1001" in run.err
    assert not out.exists()


@pytest.mark.parametrize("tail", ["-1", str(1 << 32)])
def test_a_tail_in_top_update_outside_a_u32_is_a_bad_argument(
    imq: Imq, tmp_path: Path, tail: str
) -> None:
    """README: bad arguments exit 2; ``--top-update HASH:TAIL`` with a tail outside a u32
    is one (it is refused before the file is read, and no database is created). Mutant:
    the range not checked (the state then "does not match", exit 1)."""
    db = tmp_path / "db"
    run = imq(
        "import", db, MASTER_BIN, "--block-id", "-1:8000000000000000:90",
        "--top-update", f"{MASTER_TOP}:{tail}",
    )  # fmt: skip
    assert run.code == 2
    assert _one_error_line(run.err) == (
        "imq: --top-update must be a 64-hex-digit hash, ':' and a tail length in 0..2**32-1"
    )
    assert not db.exists()


def test_a_state_of_another_block_is_refused_before_the_database_exists(
    imq: Imq, tmp_path: Path
) -> None:
    """``imq import --help``: the database is created only once the file's header has been
    read and checked; a state of another block than ``--block-id`` is refused in one line
    that names both blocks and says what to do. Mutants: the header check dropped (the
    import's own refusal, after the database was made); its advice dropped."""
    db = tmp_path / "db"
    run = imq("import", db, MASTER_BIN, "--block-id", "-1:8000000000000000:91")
    assert run.code == 1
    assert _one_error_line(run.err) == (
        f"imq: error: {MASTER_BIN}: the state belongs to block -1:8000000000000000:90, not to "
        "-1:8000000000000000:91 (header at offset 8); the file is not the queue state of "
        "-1:8000000000000000:91, or it is damaged: check the path, or fetch the file again"
    )
    assert not db.exists()


@pytest.mark.parametrize(("count", "more"), [(3, False), (4, True)])
def test_dump_diff_text_marks_hashes_left_out_only_when_some_are(
    imq: Imq, tmp_path: Path, count: int, more: bool
) -> None:
    """``imq dump-diff`` (text) shows the first three message hashes of each diff and ends
    the list with ``...`` only when the diff holds more. Mutant: ``...`` after exactly
    three."""
    state = synth_state(diffs=1, messages_per_diff=count, seed=3)
    path = tmp_path / "state.bin"
    write_synth_state(state, path)
    run = imq("dump-diff", path, "--no-progress")
    assert run.code == 0, run.err
    (line,) = [x for x in run.out.splitlines() if x.startswith("  messages ")]
    assert line.startswith(f"  messages        {count} (")
    assert line.endswith(", ...)") is more
    assert line.count(", ") == (3 if more else 2)


def test_ctrl_c_while_the_import_reports_says_it_was_complete(
    imq: Imq, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """README: Ctrl-C prints one line saying what state the command left, exit 130. A
    Ctrl-C while ``import`` prints its report comes after the import finished: the line
    says the database holds the whole state (not that it was rolled back), and it does.
    Mutant: the interrupt there left with the command's "rolled back" text."""

    def interrupted_report(*args: Any, **kwargs: Any) -> None:
        if args and str(args[0]).startswith("imported "):
            raise KeyboardInterrupt
        print(*args, **kwargs)

    monkeypatch.setattr(state_cli, "print", interrupted_report, raising=False)
    db = tmp_path / "db"
    run = imq("import", db, MASTER_BIN, "--block-id", "-1:8000000000000000:90", "--no-progress")
    assert run.code == 130
    assert run.err.splitlines()[-1] == (
        f"imq: interrupted; the import of {MASTER_BIN.name} into {db} was complete: the "
        "database holds the whole state"
    )
    with Queue.open(db, QueueConfig(gc_enabled=False), read_only=True) as queue:
        assert queue.get_commit_pointers()[ShardIdent.MASTERCHAIN].seqno == 90


# -- simulate -----------------------------------------------------------------------------------


class _StopError(Exception):
    """Raised by the stand-in for ``simulate``'s run builder: the test has what it needs."""


def _simulation_config(monkeypatch: pytest.MonkeyPatch, *argv: str | Path) -> SimConfig:
    """The ``SimConfig`` ``imq simulate ARGV`` builds, without running it."""
    seen: list[SimConfig] = []

    def build(config: SimConfig, *rest: object) -> object:
        seen.append(config)
        raise _StopError

    monkeypatch.setattr(simulate_cli, "_build", build)
    with pytest.raises(_StopError):
        main(["simulate", *map(str, argv)])
    return seen[0]


def test_simulate_runs_with_the_defaults_its_help_and_docs_state(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``imq simulate --help`` and docs/simulation.md: 4 shards, 4000 rounds, seed 1,
    fanout 2, a masterchain block every 4 rounds, GC in the background (0), one node;
    ``--duration`` counts seconds instead of rounds. Mutants: a default changed behind its
    help text; a timed run also cut at the default 4000 rounds."""
    config = _simulation_config(monkeypatch, "--dir", tmp_path / "run", "--no-plot")
    assert (config.shards, config.rounds, config.duration, config.seed) == (4, 4000, None, 1)
    assert (config.fanout, config.commit_every, config.gc_every, config.nodes) == (2, 4, 0, 1)
    timed = _simulation_config(monkeypatch, "--dir", tmp_path / "run", "--duration", "600")
    assert (timed.rounds, timed.duration) == (None, 600.0)  # seconds instead of rounds


@pytest.mark.parametrize("name", ["000012.log", "000013.sst", "000014.blob", "MANIFEST-000005"])
def test_one_rocksdb_file_without_current_is_named_as_a_lost_current(
    imq: Imq, tmp_path: Path, name: str
) -> None:
    """docs/reliability.md: table or log files without CURRENT are refused untouched; the
    message names the lost CURRENT file (MANIFEST, table or log files) for each kind,
    whether the command reads (inspect) or creates (import). Mutant: a log file alone no
    longer counted."""
    db = tmp_path / "db"
    db.mkdir()
    (db / name).write_bytes(b"\0" * 64)
    lost = f"imq: error: {db} holds a RocksDB database's files (MANIFEST, table or log files) "
    for argv in (
        ["inspect", db],
        ["import", db, MASTER_BIN, "--block-id", "-1:8000000000000000:90"],
    ):
        run = imq(*argv)
        assert run.code == 1
        assert _one_error_line(run.err).startswith(lost)
    assert [p.name for p in db.iterdir()] == [name]


def test_a_database_held_by_a_writer_says_how_to_look_at_it(
    imq: Imq, demo_db: Path, tmp_path: Path
) -> None:
    """docs/api.md errors table and errors.py: DatabaseLockedError says what to do, one
    writer at a time, or look at the live queue read-only (``imq inspect``), which works
    beside the writer. Mutant: the next step dropped from the message."""
    db = _copy(demo_db, tmp_path / "db")
    with Queue.open(db, QueueConfig(gc_enabled=False)):
        run = imq("compact", db, "--no-progress")
        assert run.code == 1
        line = _one_error_line(run.err)
        assert "one writer at a time: close the other handle" in line
        assert line.endswith("or `imq inspect`")
        assert imq("inspect", db).code == 0


def test_export_reads_beside_a_live_writer(imq: Imq, tmp_path: Path) -> None:
    """README and ``imq export --help``: export reads the database without changing its
    data, safe beside a live node (a read-only open that takes no lock), so it works while
    a writer holds the directory. Mutant: export opened for writing (refused as locked)."""
    db = tmp_path / "db"
    block = "-1:8000000000000000:90"
    assert imq("import", db, MASTER_BIN, "--block-id", block, "--no-progress").code == 0
    out = tmp_path / "90.bin"
    with Queue.open(db, QueueConfig(gc_enabled=False)):
        run = imq(
            "export", db, "--shard", "-1:8000000000000000", "--seqno", "90", "--tail-len", "1",
            out, "--no-progress",
        )  # fmt: skip
    assert run.code == 0, run.err
    assert run.out.startswith(f"exported -1:8000000000000000:90 to {out}: 1 diffs")
    assert out.read_bytes() == state_bytes(MASTER_BIN)


def test_export_says_when_its_state_is_not_bit_exact(imq: Imq, tmp_path: Path) -> None:
    """``imq export`` prints what it wrote on stdout and says when the state is not
    bit-exact (a diff applied without its ``prev_hash``: docs/formats.md, ``prev_hash``
    stored as null). Mutant: the note dropped from the summary."""
    db = tmp_path / "db"
    assert imq("import", db, MASTER_BIN, "--block-id", "-1:8000000000000000:90").code == 0
    with Queue.open(db, QueueConfig(gc_enabled=False)) as queue:
        queue.apply_diff(QueueDiff(), BlockIdShort(ShardIdent.MASTERCHAIN, 91), b"\x05" * 32)
        queue.commit_diff([TopBlock(BlockId(ShardIdent.MASTERCHAIN, 91), 91)])
    out = tmp_path / "91.bin"
    run = imq(
        "export", db, "--shard", "-1:8000000000000000", "--seqno", "91", "--tail-len", "1",
        out, "--no-progress",
    )  # fmt: skip
    assert run.code == 0, run.err
    assert run.out.startswith(f"exported -1:8000000000000000:91 to {out}: 1 diffs, ")
    assert " bytes (not bit-exact: a prev_hash was unknown) in " in run.out


def _block_without_tail_len(path: Path, diff_hash: bytes) -> Path:
    """A tycho block whose ``out_msg_queue_updates`` holds the tag and the diff hash but
    no tail length (the layout of ``test_state_cli._block_file`` without its last u32)."""
    empty = CellBuilder().end()
    updates = CellBuilder().store_uint(1, 4).store_bytes(diff_hash).end()
    root = CellBuilder().store_uint(0x11EF55BB, 32).store_int(-239, 32)
    for ref in (empty, empty, updates, empty):
        root.store_ref(ref)
    path.write_bytes(encode_boc([root.end()]))
    return path


def test_a_block_without_a_tail_length_is_refused_in_one_line(imq: Imq, tmp_path: Path) -> None:
    """``imq import --block FILE``: the block gives the top diff's hash and the tail length
    the state must match; a block without the tail length cannot check the state and is
    refused in one line naming the file and what to do (exit 1, no database). Mutant: the
    missing tail length let through."""
    block = _block_without_tail_len(tmp_path / "top.block", bytes.fromhex(MASTER_TOP))
    db = tmp_path / "db"
    run = imq("import", db, MASTER_BIN, "--block-id", "-1:8000000000000000:90", "--block", block)
    assert run.code == 1
    assert _one_error_line(run.err) == (
        f"imq: error: {block}: the block has no tail length; the file is not the block "
        "-1:8000000000000000:90 (a block file of the node), or it is damaged: check the path, "
        "or fetch the file again"
    )
    assert not db.exists()


def test_a_wrong_top_update_is_refused_before_the_database_exists(imq: Imq, tmp_path: Path) -> None:
    """``imq import --help``: the database is created only once the header has been read
    and checked, top update included: a state whose newest diff is not the given hash is
    refused in one line naming the file, with no queue warning of a rollback before it.
    Mutant: the header's top-update check dropped (the import refuses it later, after
    creating the database)."""
    db = tmp_path / "db"
    run = imq(
        "import", db, MASTER_BIN, "--block-id", "-1:8000000000000000:90",
        "--top-update", f"{'00' * 32}:1",
    )  # fmt: skip
    assert run.code == 1
    line = _one_error_line(run.err)
    assert line.startswith(f"imq: error: {MASTER_BIN}: ")
    assert line.endswith("check the path, or fetch the file again")
    assert not db.exists()


class _Skipping:
    """A queue whose iterator never yields one message (the first a basechain collator
    reads): a lost delivery, for every read of it, across reopens."""

    victim: ClassVar[list[QueueKey]] = []

    def __init__(self, queue: Queue) -> None:
        self._queue = queue

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)

    def iterator(self, partition: int, ranges: Any, for_shard: ShardIdent) -> Any:
        inner = self._queue.iterator(partition, ranges, for_shard)
        if for_shard.is_masterchain:
            return inner
        victim = self.victim

        class _It:
            def __iter__(self) -> _It:
                return self

            def __next__(self) -> Any:
                item = next(inner)
                if not victim:
                    victim.append(item.message.key)
                if item.message.key == victim[0]:
                    item = next(inner)
                return item

            def current_position(self) -> Any:
                return inner.current_position()

            def close(self) -> None:
                inner.close()

            def __enter__(self) -> _It:
                return self

            def __exit__(self, *exc: object) -> None:
                inner.close()

        return _It()


def test_simulate_exits_1_when_a_message_is_not_delivered(
    imq: Imq, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """docs/simulation.md and ``imq simulate --help``: exit status 1 when a committed
    message was not executed exactly once; the verdict on stdout names the loss. Mutant:
    the verdict printed, exit status 0 all the same."""
    monkeypatch.setattr(_Skipping, "victim", [])

    def opener(path: Path, config: QueueConfig) -> Any:
        return _Skipping(Queue.open(path, config))

    monkeypatch.setattr(simulate_cli, "default_opener", opener)
    run = imq("simulate", "--dir", tmp_path, "--rounds", "30", "--shards", "2", "--no-plot")
    assert run.code == 1
    verdict = run.out.splitlines()[0]
    assert verdict.startswith("exactly-once: VIOLATED, "), verdict
    assert ", 1 lost, 0 duplicated; first: message " in verdict


def test_simulate_says_where_its_files_are_and_draws_nothing_with_no_plot(
    imq: Imq, tmp_path: Path
) -> None:
    """``imq simulate --help``: ``--no-plot`` does not draw report.png; the run writes
    report.json into ``--dir`` and says on stdout where the JSON and the op log
    (``--record``) are; progress goes to stderr. Mutants: the picture drawn (and named)
    anyway; the op log's line dropped; report.json not written."""
    log = tmp_path / "ops.jsonl"
    run_dir = tmp_path / "run"
    run = imq(
        "simulate", "--dir", run_dir, "--rounds", "5", "--shards", "1", "--no-plot",
        "--record", log,
    )  # fmt: skip
    assert run.code == 0, run.err
    assert run.out.startswith("exactly-once: verified, ")
    assert f"  JSON:    {run_dir / 'report.json'}\n" in run.out
    assert run.out.endswith(f"  op log:  {log}\n")
    assert "picture:" not in run.out
    assert (run_dir / "report.json").is_file()
    assert not (run_dir / "report.png").exists()
    assert log.stat().st_size > 0


def test_simulate_rounds_and_duration_exclude_each_other(imq: Imq, tmp_path: Path) -> None:
    """``imq simulate``: ``--rounds`` or ``--duration`` (seconds instead of rounds), not
    both: a bad argument, exit 2, and nothing created. Mutant: both accepted."""
    run = imq("simulate", "--dir", tmp_path / "run", "--rounds", "5", "--duration", "1")
    assert run.code == 2
    assert "not allowed with argument" in run.err
    assert not (tmp_path / "run").exists()


def test_simulate_kill_kills_the_queue_process_at_restarts(imq: Imq, tmp_path: Path) -> None:
    """``imq simulate --kill``: run the queue in a child process and kill it (SIGKILL) at
    restarts; the summary's "restarts (of which kills)" and report.json count them (seed
    1 restarts once in 60 rounds, as a crash). Mutant: ``--kill`` runs the child but
    closes it cleanly at every restart."""
    run_dir = tmp_path / "run"
    run = imq(
        "simulate", "--kill", "--rounds", "60", "--shards", "1", "--no-plot", "--dir", run_dir
    )
    assert run.code == 0, run.err
    report = json.loads((run_dir / "report.json").read_text())
    assert (report["restarts"], report["kills"]) == (1, 1)
    (line,) = [x for x in run.out.splitlines() if "restarts (of which kills)" in x]
    assert line.split()[-2:] == ["1", "(1)"]


def test_dump_diff_no_progress_keeps_stderr_quiet_for_long_work(
    imq: Imq, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``imq dump-diff --no-progress``: no progress line on stderr, however long the check
    of the state's messages takes (here every heartbeat shows at once, as if each took
    longer than a second); without it the count is shown. Mutant: the option ignored by
    the command."""

    class AtOnce(Heartbeat):
        def __init__(self, label: str, **kwargs: Any) -> None:
            super().__init__(label, after=0.0, enabled=bool(kwargs.get("enabled", True)))

    monkeypatch.setattr(state_cli, "Heartbeat", AtOnce)
    quiet = imq("dump-diff", "--no-progress", SHARD_BIN)
    assert quiet.code == 0
    assert quiet.err == ""
    shown = imq("dump-diff", SHARD_BIN)
    assert f"checking {SHARD_BIN.name}: 4,300/4,300 messages" in shown.err
    assert shown.out == quiet.out


def test_demo_uses_the_directory_the_readme_names(tmp_path: Path) -> None:
    """README: ``imq demo`` runs the five-step scenario in ``var/demo-db`` (and ``imq
    inspect var/demo-db`` follows it in ``imq --help``). Mutant: another default."""
    args = build_parser().parse_args(["demo"])
    assert args.db == Path("var") / "demo-db"


# -- errors.py ----------------------------------------------------------------------------------


def test_a_call_on_a_closed_queue_says_to_open_it_again(tmp_path: Path) -> None:
    """docs/api.md, errors table: QueueClosedError, a call on a closed queue; what to do:
    open the queue again (the message ends with it, as errors.py's ``next_step`` says).
    Mutant: the next step dropped."""
    queue = Queue.open(tmp_path / "db", QueueConfig(gc_enabled=False))
    queue.close()
    with pytest.raises(QueueClosedError) as caught:
        queue.get_commit_pointers()
    assert str(caught.value).endswith("; open the queue again (Queue.open) to go on")


def test_a_diff_conflict_says_to_clear_the_uncommitted_zone(tmp_path: Path) -> None:
    """docs/api.md, errors table: DiffConflictError, a diff for the same block stored with
    a different hash; what to do: clear the uncommitted state (the message ends with it).
    Mutant: the next step dropped."""
    block = BlockIdShort(ShardIdent.BASECHAIN, 1)
    with Queue.open(tmp_path / "db", QueueConfig(gc_enabled=False)) as queue:
        queue.apply_diff(QueueDiff(), block, b"\x01" * 32)
        with pytest.raises(DiffConflictError) as caught:
            queue.apply_diff(QueueDiff(), block, b"\x02" * 32)
    assert str(caught.value).endswith(
        "; the block was collated again differently: clear the uncommitted zone "
        "(clear_uncommitted_state, or startup after a restart) before applying the new diff, "
        "or check that the block id and hash belong together"
    )


def test_a_corrupt_row_says_to_run_imq_verify() -> None:
    """docs/api.md, errors table: CorruptDataError; what to do: stop the node, ``imq verify
    DB``, restore from a persistent state (errors.py: the message says so, after the table
    and the key in hex). Mutant: ``imq verify`` dropped from the message."""
    exc = CorruptDataError("messages", b"\x01\xff", "bad length")
    assert str(exc) == (
        "corrupt row in table 'messages' at key 01ff: bad length; the database files are "
        "damaged: run `imq verify` on the directory, then restore it from a copy or rebuild "
        "it from a persistent state in a new directory"
    )


def test_simulate_nodes_run_as_processes(
    imq: Imq, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``imq simulate --nodes N``: node processes, each with its own queue (the help's
    words), which must agree at the end. Mutant: the nodes' queues opened in the command's
    own process."""
    started: list[Path] = []
    child = simulate_cli._child

    def counting(path: Path, config: QueueConfig) -> Any:
        started.append(path)
        return child(path, config)

    monkeypatch.setattr(simulate_cli, "_child", counting)
    run = imq(
        "simulate", "--dir", tmp_path, "--rounds", "5", "--shards", "1", "--nodes", "2", "--no-plot"
    )
    assert run.code == 0, run.err
    assert {p.name for p in started} >= {"queue"}
    assert len(set(started)) == 2
    assert "nodes: 2 agree" in run.out


# -- bugs found by the audit --------------------------------------------------------------------


def test_export_under_a_plain_file_says_it_is_a_file(
    imq: Imq, demo_db: Path, tmp_path: Path
) -> None:
    """README: a path that cannot be used is one line on stderr and exit status 1, and the
    line says why. An output path whose parent is a plain file must not be reported as a
    missing directory."""
    plain = tmp_path / "plain"
    plain.write_text("x")
    for out in (plain / "out.bin", plain / "sub" / "out.bin"):
        run = imq(
            "export",
            demo_db,
            "--shard",
            "0:4000000000000000",
            "--seqno",
            "2",
            "--tail-len",
            "1",
            out,
        )
        assert run.code == 1
        line = _one_error_line(run.err)
        assert "does not exist" not in line, line
        assert f"{plain} is a file, not a directory" in line, line


def test_an_op_log_close_error_does_not_hide_the_runs_own_error() -> None:
    """The ``--record`` file's close error (a full disk: ``/dev/full``) is not raised over
    the error that ended the run, which is the one to tell (mutant x21:
    ``_OpLogFile.__exit__`` without its ``suppress``); with no error of the run, the
    close error is raised, naming the file."""
    from imq.cli.simulate import _OpLogFile
    from imq.errors import FileAccessError

    full = Path("/dev/full")
    if not full.exists():
        pytest.skip("no /dev/full here")
    with pytest.raises(RuntimeError, match="the run's own"), _OpLogFile(full) as log:
        log.write("{}\n")  # buffered: the write fails only at the close
        raise RuntimeError("the run's own error")
    with pytest.raises(FileAccessError, match="/dev/full"), _OpLogFile(full) as log:
        log.write("{}\n")


# -- the audit's smaller findings, fixed after it -------------------------------------------------


def test_verify_names_a_lost_current_file(imq: Imq, demo_db: Path, tmp_path: Path) -> None:
    """A directory holding a queue's files without CURRENT lost it (or a deletion was
    cut short): ``imq verify`` (a read-only open) says so, as ``inspect`` and ``gc`` do,
    not that there is no database; a read-only ``Queue.open`` raises ``StorageError``
    with the same words. Nothing is changed."""
    db = _copy(demo_db, tmp_path / "db")
    (db / "CURRENT").unlink()
    before = sorted(p.name for p in db.iterdir())
    for argv in (("verify", db), ("inspect", db)):
        run = imq(*argv)
        assert run.code == 1
        line = _one_error_line(run.err)
        assert "no CURRENT file" in line, line
        assert "restore the directory from a copy" in line, line
    with pytest.raises(StorageError, match="no CURRENT file"):
        Queue.open(db, read_only=True)
    assert sorted(p.name for p in db.iterdir()) == before


def test_simulate_paths_under_a_plain_file_say_so(imq: Imq, tmp_path: Path) -> None:
    """``imq simulate``: a run directory or an op log under a plain file is refused in
    one line naming the file in the way (not "Not a directory" with no next step, nor
    "File exists"), exit 1, and nothing is created."""
    plain = tmp_path / "plain"
    plain.write_text("x")
    run = imq("simulate", "--rounds", "3", "--dir", plain / "sub")
    assert run.code == 1
    line = _one_error_line(run.err)
    assert f"--dir {plain / 'sub'} is under {plain}, a file; give a directory" in line, line
    run = imq("simulate", "--rounds", "3", "--dir", tmp_path / "run", "--record", plain / "x.jsonl")
    assert run.code == 1
    line = _one_error_line(run.err)
    assert f"cannot write the op log {plain / 'x.jsonl'}: {plain} is a file" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


def test_simulate_commit_every_zero_names_that_option_alone(imq: Imq, tmp_path: Path) -> None:
    """``imq simulate --commit-every 0``: a bad argument (exit 2) whose line names the
    value given, and no setting the command does not have (``read_limit``)."""
    run = imq("simulate", "--rounds", "3", "--dir", tmp_path / "run", "--commit-every", "0")
    assert run.code == 2
    line = _one_error_line(run.err)
    assert line == "imq: commit_every must be at least 1, got 0", line
    assert not (tmp_path / "run").exists()


def test_export_of_bodies_that_are_no_messages_says_what_to_do(
    imq: Imq, demo_db: Path, tmp_path: Path
) -> None:
    """``imq export`` of a queue whose stored bodies are not TON messages (the demo's)
    fails in one line that names the message and says where such a state comes from,
    and leaves no output file."""
    out = tmp_path / "out.bin"
    run = imq(
        "export", demo_db, "--shard", "0:4000000000000000", "--seqno", "2", "--tail-len", "1", out
    )
    assert run.code == 1
    line = _one_error_line(run.err.splitlines()[-1])
    assert "is not a message BOC" in line, line
    assert "take it from a node that serves it" in line, line
    assert not out.exists()
