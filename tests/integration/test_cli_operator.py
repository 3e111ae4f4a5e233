"""What an operator who reads only the README and the docs meets on the command line: a
malformed or unreplayable op log, a state file that is not a state, long work without a
progress line. Each failure is one line on stderr naming the file (and the step or line),
exit status 1, never a traceback.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from cli_runner import Imq, Run
from state_fixtures import SHARD_BIN

from imq import Address, BlockIdShort, Message, Queue, QueueConfig, QueueDiff, QueueKey, ShardIdent
from imq.cli import inspect as cli_inspect
from imq.cli import replay as cli_replay
from imq.cli import verify as cli_verify
from imq.cli.common import Heartbeat, checked_queue
from imq.errors import StorageError
from imq.testing import OpLog

REPO = Path(__file__).resolve().parents[2]
REPLAY = REPO / "tests" / "replays" / "sim-2shards-seed7.jsonl"
HEADER = '{"imq_ops":1,"zerostate_seqno":0}\n'
OPEN = '{"step":1,"op":"open","args":{},"result":null}\n'
SHARD = ShardIdent(0, 0x4000_0000_0000_0000)


def _one_error_line(run: Run) -> str:
    assert run.code == 1, run
    assert run.out == ""
    assert "Traceback" not in run.err
    lines = run.err.strip().splitlines()
    assert len(lines) == 1, run.err
    assert lines[0].startswith("imq: error: "), lines[0]
    return lines[0]


def _apply_line(step: int, **change: object) -> str:
    """A well-formed apply_diff step of an empty diff, with ``change`` put into its args."""
    args: dict[str, object] = {
        "block": "0:4000000000000000:1",
        "diff": {"messages": [], "processed_to": {}, "router_src": {}, "router_dst": {}},
        "hash": "01" * 32,
        "statistics": None,
        "check_sequence": None,
    }
    args.update(change)
    args = {k: v for k, v in args.items() if v is not _DROP}
    return json.dumps({"step": step, "op": "apply_diff", "args": args, "result": True}) + "\n"


_DROP = object()


@pytest.mark.parametrize(
    ("steps", "says"),
    [
        (_apply_line(2, diff=_DROP), "line 3: apply_diff without its argument 'diff'"),
        (_apply_line(2, block="zz"), "line 3: apply_diff: argument 'block' is not valid"),
        (_apply_line(2, check_sequence="SOON"), "argument 'check_sequence' is not valid"),
        ('{"step":2,"op":"bogus","args":{},"result":null}\n', "line 3: unknown op 'bogus'"),
        ('{"step":2,"op":"run_gc","args":{},"error":"boom"}\n', '"error" must be an object'),
        ('{"step":1,"op":"close","args":{},"result":null}\n', "line 3: step 1 again"),
        (
            '{"step":2,"op":"get_diff_info","args":{"shard":"0:8000000000000000","seqno":1},'
            '"result":null}\n',
            "get_diff_info without its argument 'zone'",
        ),
    ],
    ids=["no-diff", "bad-block", "bad-zone", "unknown-op", "bad-error", "step-twice", "no-zone"],
)
def test_a_malformed_step_is_one_line_naming_the_file_and_line(
    imq: Imq, tmp_path: Path, steps: str, says: str
) -> None:
    log = tmp_path / "ops.jsonl"
    log.write_text(HEADER + OPEN + steps)
    line = _one_error_line(imq("replay", log))
    assert f"op log {log} " in line and says in line, line


def test_a_header_of_another_version_is_one_line_with_exit_status_1(
    imq: Imq, tmp_path: Path
) -> None:
    log = tmp_path / "ops.jsonl"
    log.write_text('{"imq_ops":2,"zerostate_seqno":0}\n' + OPEN)
    line = _one_error_line(imq("replay", log))
    assert f"op log {log} line 1: not an op log header of version 1" in line, line


def _recorded(tmp_path: Path, after_close: str) -> Path:
    """A log recorded by imq's own recorder, in which the host calls the queue (or the
    pending diff it prepared) after closing it: the recorder logs the QueueClosedError."""
    path = tmp_path / "rec.jsonl"
    with open(path, "w") as sink:
        log = OpLog(sink)
        queue = log.open(Queue.open, tmp_path / "q", QueueConfig.testing())
        msg = Message(
            QueueKey(1001, b"\x11" * 32), Address(0, b"\x10" * 32), Address(0, b"\x90" * 32)
        )
        pending = queue.prepare_diff(QueueDiff([msg]), BlockIdShort(SHARD, 1), b"\x01" * 32)
        assert pending is not None
        queue.close()
        if after_close == "discard":  # a discard after the close is a no-op
            pending.discard()
        else:
            with pytest.raises(Exception, match="closed"):
                if after_close == "write":
                    pending.write()
                else:
                    getattr(queue, after_close)()
    return path


@pytest.mark.parametrize("after_close", ["write", "discard", "get_commit_pointers", "run_gc"])
def test_a_recorded_call_after_close_replays_to_the_closed_error(
    imq: Imq, tmp_path: Path, after_close: str
) -> None:
    """The recorder logs the QueueClosedError the host got (a discard after the close is a
    no-op); the replay makes the same call on its closed queue, the model (closed too)
    answers the same, and the log agrees."""
    log = _recorded(tmp_path, after_close)
    steps = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    assert steps[-1]["op"] == after_close
    if after_close != "discard":
        assert steps[-1]["error"]["type"] == "QueueClosedError"
    run = imq("replay", log, "--no-progress")
    assert run.code == 0, run
    assert "steps agree with the log and the model" in run.out


def test_a_queue_call_before_the_log_opens_its_queue_is_one_line(imq: Imq, tmp_path: Path) -> None:
    log = tmp_path / "ops.jsonl"
    log.write_text(HEADER + '{"step":1,"op":"run_gc","args":{},"result":0}\n')
    line = _one_error_line(imq("replay", log))
    assert "line 2 (step 1, run_gc): a queue call before the log opens its queue" in line, line


@pytest.mark.parametrize("kind", ["file", "non-empty"])
def test_replay_db_that_cannot_be_used_is_one_line(imq: Imq, tmp_path: Path, kind: str) -> None:
    db = tmp_path / "db"
    if kind == "file":
        db.write_text("x")
    else:
        db.mkdir()
        (db / "other").write_text("x")
    line = _one_error_line(imq("replay", REPLAY, "--db", db))
    assert f"--db {db} " in line and "new or empty directory" in line, line


def test_replay_shows_progress_on_stderr(imq: Imq, monkeypatch: pytest.MonkeyPatch) -> None:
    # The heartbeat waits a second before its first line; here it starts at once.
    monkeypatch.setattr(cli_replay, "Heartbeat", functools.partial(Heartbeat, after=0.0))
    run = imq("replay", REPLAY)
    assert run.code == 0, run
    assert run.out.startswith("replay: 179 steps agree")
    assert "of 179 (" in run.err  # "step N of 179": the step it is at, not only the length
    assert imq("replay", REPLAY, "--no-progress").err == ""


def test_inspect_shows_progress_on_stderr(
    imq: Imq, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A memory audit: inspect read 10^6 diff records for 20-26 s with nothing on
    stderr. It shows a heartbeat as gc, compact and verify do (after a second; here at
    once), and ``--no-progress`` keeps stderr quiet."""
    db = tmp_path / "db"
    assert imq("import", db, SHARD_BIN, "--block-id", "0:8000000000000000:160").code == 0
    monkeypatch.setattr(cli_inspect, "Heartbeat", functools.partial(Heartbeat, after=0.0))
    run = imq("inspect", db)
    assert run.code == 0, run
    assert f"inspect: reading the diff records of {db}" in run.err, run.err
    assert run.out.startswith(f"queue database {db}")
    assert imq("inspect", db, "--no-progress").err == ""
    assert json.loads(imq("inspect", db, "--json", "--no-progress").out)["path"] == str(db)


def test_verify_shows_progress_on_stderr(
    imq: Imq, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "db"
    assert imq("import", db, SHARD_BIN, "--block-id", "0:8000000000000000:160").code == 0
    monkeypatch.setattr(cli_verify, "Heartbeat", functools.partial(Heartbeat, after=0.0))
    run = imq("verify", db)
    assert run.code == 0, run
    assert run.out.endswith("ok: checksums and cross-checks pass\n")
    assert "verify: " in run.err
    assert imq("verify", db, "--no-progress").err == ""


@pytest.mark.parametrize("command", ["import", "dump-diff"])
def test_a_file_that_is_not_a_state_names_the_file_and_what_to_do(
    imq: Imq, tmp_path: Path, command: str
) -> None:
    bogus = tmp_path / "notes.queue"
    bogus.write_text("# not a state\n")
    argv = (
        ("import", tmp_path / "db", bogus, "--block-id", "0:8000000000000000:160")
        if command == "import"
        else ("dump-diff", bogus)
    )
    line = _one_error_line(imq(*argv))
    assert f"{bogus}: offset 0: unknown id" in line, line
    assert line.endswith("fetch the file again")
    assert not (tmp_path / "db").exists()


def test_a_state_cut_short_names_the_file(imq: Imq, tmp_path: Path) -> None:
    cut = tmp_path / "cut.bin"
    cut.write_bytes(SHARD_BIN.read_bytes()[:100_000])
    line = _one_error_line(
        imq("import", tmp_path / "db", cut, "--block-id", "0:8000000000000000:160")
    )
    assert f"{cut}: truncated at offset" in line, line


def test_simulate_dir_that_is_a_file_is_one_line(imq: Imq, tmp_path: Path) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    log = tmp_path / "ops.jsonl"
    log.write_text("kept\n")
    line = _one_error_line(imq("simulate", "--dir", a_file, "--rounds", "2", "--record", log))
    assert f"--dir {a_file} is a file" in line, line
    assert log.read_text() == "kept\n"  # refused before the log is opened


@pytest.mark.parametrize("duration", ["nan", "-1", "0", "inf"])
def test_simulate_refuses_a_duration_that_is_not_a_positive_time(
    imq: Imq, tmp_path: Path, duration: str
) -> None:
    """An outside audit: ``nan`` ran without end, ``-1`` "verified" nothing with exit 0."""
    run = imq("simulate", "--dir", tmp_path / "run", "--duration", duration, "--no-plot")
    assert run.code == 2, run
    assert "duration must be a positive number of seconds" in run.err
    assert not (tmp_path / "run").exists()


def test_simulate_record_into_a_directory_is_one_line(imq: Imq, tmp_path: Path) -> None:
    line = _one_error_line(
        imq("simulate", "--dir", tmp_path / "run", "--rounds", "2", "--record", tmp_path)
    )
    assert f"cannot write the op log {tmp_path}: Is a directory" in line, line


def test_simulate_help_states_the_defaults_the_docs_state(imq: Imq) -> None:
    text = " ".join(imq("simulate", "--help").out.split())
    for option in (
        "--shards SHARDS basechain shards, a power of 2 (default 4)",
        "--fanout FANOUT max messages sent per executed one (default 2)",
        "--commit-every COMMIT_EVERY rounds per masterchain block (default 4)",
    ):
        assert option in text, option


@pytest.mark.parametrize(
    ("failure", "says"),
    [
        (
            "IO error: No space left on device: While appending to file: 000014.sst",
            "the disk is full",
        ),
        ("Corruption: block checksum mismatch in 000009.sst", "may not be done; run `imq verify"),
    ],
)
def test_a_failure_as_a_command_closes_the_queue_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str, says: str
) -> None:
    """RocksDB's error at close (a flush that found the disk full, a compaction that met
    a damaged file): the command fails, with the fix for that cause."""
    monkeypatch.setattr(Queue, "close_error", property(lambda _queue: failure))
    with pytest.raises(StorageError) as info, checked_queue(tmp_path / "db", "import"):
        pass
    assert failure in str(info.value)
    assert says in str(info.value)


def test_a_refused_simulation_leaves_the_record_file_as_it_was(imq: Imq, tmp_path: Path) -> None:
    """An outside audit: a second ``simulate --record`` on a used --dir was refused (its
    queue is a previous run's) after it had emptied the log file it was given."""
    log = tmp_path / "ops.jsonl"
    run_dir = tmp_path / "run"
    assert (
        imq("simulate", "--dir", run_dir, "--rounds", "2", "--no-plot", "--record", log).code == 0
    )
    kept = log.read_bytes()
    assert len(kept.splitlines()) > 10
    line = _one_error_line(
        imq("simulate", "--dir", run_dir, "--rounds", "2", "--no-plot", "--record", log)
    )
    assert "holds the queue of a previous run" in line, line
    assert log.read_bytes() == kept
    missing = tmp_path / "new" / "ops.jsonl"
    _one_error_line(
        imq("simulate", "--dir", run_dir, "--rounds", "2", "--no-plot", "--record", missing)
    )
    assert not missing.parent.exists()  # nothing created for a refused run
