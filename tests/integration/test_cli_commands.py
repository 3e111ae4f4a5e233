"""The ``imq`` command's promises: paths (read-only commands create nothing, import
creates its database only after the header checks, every path error is one line and exit
status 1), ids that start with ``-``, block ids without hashes, ``gc`` and ``compact``,
lossless JSON, and the progress heartbeat."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders import BASE, Chain, open_queue
from cli_runner import Imq, Run
from state_fixtures import DUMP_STATES, MASTER_BIN, MASTER_TOP_HASH, SHARD_BIN, SHARD_TOP_HASH

from imq import (
    Address,
    BlockId,
    BlockIdShort,
    DatabaseLockedError,
    ImqError,
    Message,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    ShardIdent,
    TopBlock,
)
from imq.cli import state as state_cli
from imq.cli.common import Heartbeat
from imq.cli.main import build_parser
from imq.state.block import parse_block_id_name
from imq.state.source import open_source
from imq.state.tl import read_state_header

MC = ShardIdent.MASTERCHAIN
LEFT = ShardIdent(0, 0x4000_0000_0000_0000)
MC_ID = "-1:8000000000000000"
SHARD_ID = "0:8000000000000000:160"


def _one_line_error(run: Run) -> str:
    assert run.code == 1, run
    assert run.out == ""
    lines = run.err.strip().splitlines()
    assert len(lines) == 1, run.err
    assert lines[0].startswith("imq: error: ")
    assert "Traceback" not in run.err
    return lines[0]


def _message(lt: int) -> Message:
    return Message(
        QueueKey(lt, lt.to_bytes(32, "big")),
        Address(0, b"\x10" * 32),
        Address(0, b"\x90" + b"\x01" * 31),
    )


def _collectable(db: Path) -> None:
    """LEFT diffs 1 (2 messages) and 2 (1 message), and a committed masterchain diff whose
    processed_to covers LEFT's diff 1: GC may delete diff 1 from partitions 0 and 1."""
    with Queue.open(db, QueueConfig(gc_enabled=False)) as queue:
        queue.apply_diff(QueueDiff([_message(10), _message(11)]), BlockIdShort(LEFT, 1), b"\1" * 32)
        queue.apply_diff(QueueDiff([_message(20)]), BlockIdShort(LEFT, 2), b"\2" * 32)
        mc = QueueDiff([], {LEFT: QueueKey.max_for_lt(11)})
        queue.apply_diff(mc, BlockIdShort(MC, 1), b"\3" * 32)
        queue.commit_diff([TopBlock(BlockId(MC, 1), 1), TopBlock(BlockId(LEFT, 2), 1)])


# -- paths --------------------------------------------------------------------------------------

_OUT = "{tmp}/out.queue"
READERS = {
    "inspect": ["inspect", "{db}"],
    "inspect-json": ["inspect", "{db}", "--json"],
    "export": [
        "export",
        "{db}",
        "--shard",
        "0:8000000000000000",
        "--seqno",
        "1",
        "--tail-len",
        "1",
        _OUT,
    ],
    "gc": ["gc", "{db}"],
    "compact": ["compact", "{db}"],
}


@pytest.mark.parametrize("argv", READERS.values(), ids=READERS.keys())
@pytest.mark.parametrize("kind", ["missing", "file", "empty-dir", "other-dir"])
def test_a_path_without_a_database_is_refused_and_left_alone(
    argv: list[str], kind: str, imq: Imq, tmp_path: Path
) -> None:
    db = tmp_path / "db"
    if kind == "file":
        db.write_bytes(b"not a database")
    elif kind in ("empty-dir", "other-dir"):
        db.mkdir()
        if kind == "other-dir":
            (db / "notes.txt").write_text("mine")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    line = _one_line_error(imq(*[a.format(db=db, tmp=tmp_path) for a in argv]))
    assert f"no queue database at {db}" in line
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing created
    if kind == "file":
        assert db.read_bytes() == b"not a database"


@pytest.mark.parametrize(
    "argv",
    [*READERS.values(), ["import", "{db}", str(SHARD_BIN), "--block-id", SHARD_ID]],
    ids=[*READERS.keys(), "import"],
)
def test_a_database_that_lost_its_current_file_is_named_as_one(
    argv: list[str], imq: Imq, tmp_path: Path
) -> None:
    """An outside audit: without CURRENT a queue's directory was "no database" (or "other
    files"), with no hint of damage. Nothing in it is changed."""
    db = tmp_path / "db"
    with open_queue(db) as queue:
        Chain(queue).apply(BASE, 3)
        queue.compact()
    (db / "CURRENT").unlink()
    before = {p.name: p.read_bytes() for p in db.iterdir()}
    line = _one_line_error(imq(*[a.format(db=db, tmp=tmp_path) for a in argv]))
    assert "but no CURRENT file" in line and "restore the directory from a copy" in line, line
    assert {p.name: p.read_bytes() for p in db.iterdir()} == before


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["import", "{db}", "{tmp}/missing.queue", "--block-id", SHARD_ID], "does not exist"),
        # without --block-id: the missing file first, not that its name names no block
        (["import", "{db}", "{tmp}/missing.queue"], "missing.queue does not exist"),
        (["import", "{db}", "{tmp}", "--block-id", SHARD_ID], "is a directory"),
        (
            ["import", "{db}", str(SHARD_BIN), "--block-id", SHARD_ID, "--block", "{tmp}/no.block"],
            "block file",
        ),
        (
            ["import", "{db}", str(SHARD_BIN), "--block-id", SHARD_ID, "--block", str(SHARD_BIN)],
            f"{SHARD_BIN}: block BOC",
        ),
        (["import", "{tmp}/afile", str(SHARD_BIN), "--block-id", SHARD_ID], "is a file"),
        (["import", "{tmp}/other", str(SHARD_BIN), "--block-id", SHARD_ID], "other files"),
        (["dump-diff", "{tmp}/missing.bin"], "does not exist"),
        (["dump-diff", "{tmp}"], "is a directory"),
        (["demo", "--db", "{tmp}/afile"], "is a file"),
        (["demo", "--db", "{tmp}/other"], "other files"),
    ],
    ids=[
        "import-missing-file",
        "import-missing-file-unnamed",
        "import-directory",
        "import-missing-block",
        "import-block-not-a-block",
        "import-db-is-file",
        "import-db-is-other-dir",
        "dump-missing",
        "dump-directory",
        "demo-db-is-file",
        "demo-db-is-other-dir",
    ],
)
def test_path_errors_are_one_line_and_create_nothing(
    argv: list[str], says: str, imq: Imq, tmp_path: Path
) -> None:
    (tmp_path / "afile").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    line = _one_line_error(imq(*[a.format(db=tmp_path / "db", tmp=tmp_path) for a in argv]))
    assert says in line
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_export_to_a_missing_directory_is_refused_before_reading(imq: Imq, tmp_path: Path) -> None:
    db = tmp_path / "db"
    assert imq("import", db, SHARD_BIN, "--block-id", SHARD_ID, "--no-progress").code == 0
    line = _one_line_error(
        imq(
            "export",
            db,
            "--shard",
            "0:8000000000000000",
            "--seqno",
            "160",
            "--tail-len",
            "3",
            tmp_path / "nowhere" / "out.queue",
        )
    )
    assert "does not exist" in line
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize(
    "extra",
    [
        ["--block-id", "0:8000000000000000:161"],  # the header says 160
        ["--block-id", SHARD_ID, "--top-update", f"{'0' * 64}:3"],
        ["--block-id", SHARD_ID, "--top-update", f"{SHARD_TOP_HASH}:2"],
    ],
    ids=["other-block", "other-hash", "other-tail"],
)
def test_import_creates_nothing_when_the_header_check_fails(
    extra: list[str], imq: Imq, tmp_path: Path
) -> None:
    db = tmp_path / "deep" / "db"
    _one_line_error(imq("import", db, SHARD_BIN, *extra))
    assert not (tmp_path / "deep").exists()


def test_a_path_error_in_a_real_process_has_no_traceback(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "imq",
            "export",
            str(tmp_path / "nothing"),
            "--shard",
            f"{MC_ID}",
            "--seqno",
            "1",
            "--tail-len",
            "1",
            str(tmp_path / "o.queue"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"imq: error: no queue database at {tmp_path / 'nothing'}: the path does not exist"
    ]
    assert list(tmp_path.iterdir()) == []


def test_a_database_held_by_a_writer_is_one_line(imq: Imq, tmp_path: Path) -> None:
    db = tmp_path / "db"
    _collectable(db)
    with Queue.open(db, QueueConfig(gc_enabled=False)):
        line = _one_line_error(imq("gc", db))
    assert "already open" in line
    assert issubclass(DatabaseLockedError, Exception)


# -- ids that start with '-', block ids without hashes -------------------------------------


def test_ids_with_a_leading_dash_are_option_values() -> None:
    parser = build_parser()
    export = parser.parse_args(
        ["export", "db", "--shard", MC_ID, "--seqno", "1", "--tail-len", "1", "o"]
    )
    assert export.shard == MC
    for argv in (
        ["import", "db", "f", "--block-id", f"{MC_ID}:57"],
        ["import", "db", "f", f"--block-id={MC_ID}:57"],
    ):
        assert parser.parse_args(argv).block_id == BlockId(MC, 57)
    named = parser.parse_args(["import", "db", "-1_8000000000000000_57_x.queue"])
    assert named.file == Path("-1_8000000000000000_57_x.queue")
    with pytest.raises(SystemExit):  # a real unknown option still is one
        parser.parse_args(["import", "db", "f", "-x"])


def test_masterchain_import_and_export_with_leading_dash_ids(imq: Imq, tmp_path: Path) -> None:
    db, out = tmp_path / "db", tmp_path / "mc.bin"
    run = imq(
        "import", db, MASTER_BIN, "--block-id", f"{MC_ID}:90", "--top-update",
        f"{MASTER_TOP_HASH}:1", "--no-progress",
    )  # fmt: skip
    assert run.code == 0, run.err
    with Queue.open(db, read_only=True) as queue:
        assert queue.get_last_committed_mc_block_id() == BlockId(MC, 90)  # no hashes given
    run = imq("export", db, "--shard", MC_ID, "--seqno", "90", "--tail-len", "1", out)
    assert run.code == 0, run.err
    assert out.read_bytes() == MASTER_BIN.read_bytes()


def test_a_block_id_without_hashes_takes_them_from_the_block_file(imq: Imq, tmp_path: Path) -> None:
    mc57 = DUMP_STATES[0]
    assert mc57.block is not None
    run = imq("import", tmp_path / "db", mc57.path, "--block-id", f"{MC_ID}:57", "--block",
              mc57.block, "--no-progress")  # fmt: skip
    assert run.code == 0, run.err
    with Queue.open(tmp_path / "db", read_only=True) as queue:
        assert queue.get_last_committed_mc_block_id() == parse_block_id_name(mc57.path.name)


def test_a_bad_block_id_says_what_is_expected(imq: Imq, tmp_path: Path) -> None:
    run = imq("import", tmp_path / "db", SHARD_BIN, "--block-id", "0:8000000000000000")
    assert run.code == 2
    assert "expected wc:shard:seqno or wc:shard:seqno:root:file" in run.err
    assert not (tmp_path / "db").exists()


# -- gc and compact -------------------------------------------------------------------------


def test_gc_prints_what_it_deleted(imq: Imq, tmp_path: Path) -> None:
    db = tmp_path / "db"
    _collectable(db)
    run = imq("gc", db)
    assert run.code == 0, run.err
    first = run.out.splitlines()[0]
    assert first.startswith(f"gc {db}: 2 (partition, shard) ranges deleted, 2 messages, 1 diffs")
    bound = QueueKey.max_for_lt(11)
    assert f"  p0 {LEFT!s:22} up to {bound}: 2 messages, 1 diffs" in run.out
    assert f"  p1 {LEFT!s:22} up to {bound}: 0 messages, 1 diffs" in run.out
    with Queue.open(db, read_only=True) as queue:
        assert not queue.is_diff_exists(BlockIdShort(LEFT, 1))
        assert queue.is_diff_exists(BlockIdShort(LEFT, 2))
    again = imq("gc", db)
    assert again.out.startswith(f"gc {db}: 0 (partition, shard) ranges deleted, 0 messages")


def test_run_gc_report_and_run_gc(tmp_path: Path) -> None:
    _collectable(tmp_path / "a")
    _collectable(tmp_path / "b")
    with Queue.open(tmp_path / "a", QueueConfig(gc_enabled=False)) as queue:
        report = queue.run_gc_report()
        assert (report.executed, report.messages, report.diffs, report.failed) == (2, 2, 1, 0)
        assert {(r.partition, r.shard, r.bound) for r in report.ranges} == {
            (0, LEFT, QueueKey.max_for_lt(11)),
            (1, LEFT, QueueKey.max_for_lt(11)),
        }
        assert queue.run_gc_report().executed == 0
    with Queue.open(tmp_path / "b", QueueConfig(gc_enabled=False)) as queue:
        assert queue.run_gc() == 2  # the int API is unchanged


def test_compact_reports_sizes_and_keeps_the_data(imq: Imq, tmp_path: Path) -> None:
    db = tmp_path / "db"
    _collectable(db)
    assert imq("gc", db).code == 0
    run = imq("compact", db, "--no-progress")
    assert run.code == 0, run.err
    assert run.out.startswith(f"compacted {db}: 6 tables, ")
    seen: list[tuple[int, int]] = []
    with Queue.open(db, QueueConfig(gc_enabled=False)) as queue:
        report = queue.compact(lambda done, total: seen.append((done, total)))
        assert queue.is_diff_exists(BlockIdShort(LEFT, 2))
    assert seen == [(i, 6) for i in range(1, 7)]
    assert report.tables == 6 and report.bytes_after > 0
    with Queue.open(db, read_only=True) as queue, pytest.raises(ImqError, match="read-only"):
        queue.compact()


# -- lossless JSON --------------------------------------------------------------------------


def test_dump_diff_json_reads_back_into_the_header(imq: Imq) -> None:
    run = imq("dump-diff", "--json", SHARD_BIN)
    assert run.code == 0
    entries = json.loads(run.out)
    with open_source(SHARD_BIN) as src:
        header = read_state_header(src)
    assert len(entries) == len(header.diffs)
    for entry, diff in zip(entries, header.diffs, strict=True):
        assert BlockIdShort.parse(entry["block"]) == BlockIdShort(diff.shard, diff.seqno)
        assert ShardIdent.parse(entry["shard"]) == diff.shard
        assert QueueKey.from_json(entry["min_message"]) == diff.min_message
        assert QueueKey.from_json(entry["max_message"]) == diff.max_message
        assert {
            ShardIdent.parse(s): QueueKey.from_json(k) for s, k in entry["processed_to"].items()
        } == dict(diff.processed_to)
        assert entry["messages"] == diff.n_messages == len(entry["message_hashes"])
    # Written a diff at a time (a state's hashes are never all in text at once), in the
    # layout json.dump(entries, indent=2) gives the whole list.
    assert run.out == json.dumps(entries, indent=2) + "\n"
    # The text form builds only the three hashes it shows of each diff.
    text = imq("dump-diff", SHARD_BIN)
    assert text.code == 0
    first = header.diffs[0]
    shown = ", ".join(first.hash_at(i).hex()[:16] for i in range(3))
    assert f"messages        {first.n_messages} ({shown}, ...)" in text.out


@pytest.mark.parametrize("damage", ["cut in its chunk", "a flipped message byte", "a byte more"])
def test_dump_diff_of_a_damaged_state_fails(imq: Imq, tmp_path: Path, damage: str) -> None:
    """Found by an outside audit: dump-diff read only a state's header, so a file cut
    short in its chunks printed as sound (exit 0). It reads and checks the whole file."""
    data = bytearray(SHARD_BIN.read_bytes())
    if damage == "cut in its chunk":
        data = data[:200_000]
    elif damage == "a flipped message byte":
        data[len(data) - 1000] ^= 0x40
    else:
        data += b"\x00"
    bad = tmp_path / "bad.bin"
    bad.write_bytes(bytes(data))
    run = imq("dump-diff", bad)
    assert run.code == 1, run
    assert "Traceback" not in run.err
    assert str(bad) in run.err
    good = imq("dump-diff", SHARD_BIN)
    assert good.code == 0
    assert "4300 messages checked against their diffs' hashes" in good.out


def test_inspect_json_reads_back_into_the_queue(imq: Imq, tmp_path: Path) -> None:
    db = tmp_path / "db"
    _collectable(db)
    run = imq("inspect", db, "--json")
    assert run.code == 0
    data = json.loads(run.out)
    with Queue.open(db, read_only=True) as queue:
        pointers = queue.get_commit_pointers()
        assert BlockId.parse(data["last_committed_mc_block"]) == (
            queue.get_last_committed_mc_block_id()
        )
        requested, _ = queue.gc_bounds()
    assert {
        ShardIdent.parse(s): (QueueKey.from_json(p["key"]), p["seqno"])
        for s, p in data["commit_pointers"].items()
    } == {s: (p.key, p.seqno) for s, p in pointers.items()}
    assert {name: QueueKey.from_json(bound["requested"]) for name, bound in data["gc"].items()} == {
        f"{p}/{s}": key for (p, s), key in requested.items()
    }
    text = imq("inspect", db)
    assert str(pointers[LEFT].key) in text.out  # the text form is lossless too


# -- progress -------------------------------------------------------------------------------


def test_heartbeat_is_silent_for_short_work() -> None:
    stream = io.StringIO()
    with Heartbeat("gc", after=3600.0, stream=stream) as beat:
        beat.update("collecting")
    assert stream.getvalue() == ""


def test_heartbeat_shows_long_work_and_ends_with_a_line() -> None:
    stream = io.StringIO()
    with Heartbeat("compact", after=0.0, stream=stream) as beat:
        beat.progress("tables")(2, 6)
        deadline = time.monotonic() + 30
        while not stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        beat.update("6/6 tables")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("compact: ")
    assert lines[-1].startswith("compact: 6/6 tables (")
    disabled = io.StringIO()
    with Heartbeat("gc", enabled=False, after=0.0, stream=disabled):
        pass
    assert disabled.getvalue() == ""


def test_dump_diff_of_a_state_shows_its_progress(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user audit: dump-diff checks every message of a state (17 s for 600,000) with
    nothing on stderr. It now shows the count as import and export do (after a second;
    here at once), and ``--no-progress`` keeps stderr quiet."""

    class AtOnce(Heartbeat):
        def __init__(self, label: str, **kwargs: object) -> None:
            super().__init__(label, after=0.0, enabled=bool(kwargs.get("enabled", True)))

    monkeypatch.setattr(state_cli, "Heartbeat", AtOnce)
    out = io.StringIO()
    state_cli.dump_diff(SHARD_BIN, as_json=False, out=out, progress=True)
    err = capsys.readouterr().err
    assert f"checking {SHARD_BIN.name}: 4,300/4,300 messages" in err, err
    assert "4300 messages checked" in out.getvalue()
    state_cli.dump_diff(SHARD_BIN, as_json=False, out=io.StringIO(), progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("command", ["inspect", "verify", "gc", "compact"])
def test_every_reader_names_a_missing_or_empty_database_alike(
    imq: Imq, tmp_path: Path, command: str
) -> None:
    """One wording for a path that holds no queue (a helper found `verify` saying it
    differently, through the read-only open's error, from `inspect`, `gc` and `compact`)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, why in (
        (tmp_path / "nothing", "the path does not exist"),
        (empty, "the directory holds no database"),
    ):
        run = imq(command, path)
        assert run.code == 1
        assert run.err.strip().splitlines() == [f"imq: error: no queue database at {path}: {why}"]
    assert sorted(tmp_path.iterdir()) == [empty] and list(empty.iterdir()) == []
