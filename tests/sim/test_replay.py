"""Record and replay: a recorded simulation is deterministic, replays on a fresh database
and on the model, and a replay names the step where a log or the engine goes wrong."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import imq.queue
from imq import QueueConfig
from imq.cli.main import main
from imq.errors import FileAccessError
from imq.sim import SimConfig, SimQueue, Simulation
from imq.sim.child import ChildQueue
from imq.sim.engine import default_opener
from imq.storage import Table
from imq.testing import (
    MemoryDatabase,
    OpLog,
    OpLogError,
    RecordingQueue,
    ReplayDivergenceError,
    assert_replays,
    replay,
)

REPLAYS = Path(__file__).resolve().parent.parent / "replays"
FAULTY = {"restart_rate": 0.1, "reset_rate": 0.08, "cancel_rate": 0.15}


def record(
    directory: Path, log_path: Path, seed: int, rounds: int = 30, *, kill: bool = False
) -> None:
    """A recorded simulation; with ``kill`` the queue runs in a child process and some
    restarts SIGKILL it, one shard's next diff prepared and not written."""
    with log_path.open("w", encoding="utf-8") as sink:
        log = OpLog(sink)
        base: Any = ChildQueue if kill else default_opener

        def opener(path: Path, config: QueueConfig) -> SimQueue:
            return log.open(base, path, config)

        def crash(queue: SimQueue) -> None:
            assert isinstance(queue, RecordingQueue)
            queue.kill()

        config = SimConfig(
            directory=directory, rounds=rounds, seed=seed, shards=2, gc_every=3, **FAULTY
        )
        sim = Simulation(config, opener=opener, crash=crash if kill else None)
        result = sim.run()
        assert result.verified, result.verdict()
        assert not kill or result.kills


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("recorded")
    log = base / "ops.jsonl"
    record(base / "run", log, seed=4)
    return log


def test_same_seed_gives_byte_identical_logs(recorded: Path, tmp_path: Path) -> None:
    again = tmp_path / "again.jsonl"
    record(tmp_path / "run", again, seed=4)
    assert again.read_bytes() == recorded.read_bytes()
    ops = {json.loads(line).get("op") for line in recorded.read_text().splitlines()[1:]}
    assert {"prepare_diff", "write", "discard", "commit_diff", "iterate", "run_gc"} <= ops
    assert {"close", "startup", "clear_uncommitted_state"} <= ops


def test_a_recorded_run_replays(recorded: Path, tmp_path: Path) -> None:
    report = assert_replays(recorded, tmp_path / "db")
    assert report.steps > 100 and report.checks > 10


def test_a_recorded_run_with_kills_replays(tmp_path: Path) -> None:
    log = tmp_path / "killed.jsonl"
    record(tmp_path / "run", log, seed=11, rounds=40, kill=True)
    lines = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    kills = [i for i, line in enumerate(lines) if line["op"] == "kill"]
    assert kills
    # Killed mid-collation: a diff prepared just before the kill was never written (the
    # collator dropped it: the recorder logs that as its discard).
    before = lines[kills[0] - 1]
    if before["op"] == "discard":
        prepared = lines[kills[0] - 2]
        assert prepared["result"] == {"pending": before["args"]["pending"]}
        before = prepared
    assert before["op"] == "prepare_diff" and before["result"] is not None
    assert_replays(log)


def test_cli_replay(recorded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(recorded)]) == 0
    assert "agree with the log and the model" in capsys.readouterr().out


def _altered(recorded: Path, tmp_path: Path) -> tuple[Path, int]:
    lines = recorded.read_text().splitlines()
    for i, line in enumerate(lines[1:], start=1):
        obj = json.loads(line)
        if obj["op"] == "run_gc" and obj.get("result"):
            obj["result"] += 1
            lines[i] = json.dumps(obj)
            out = tmp_path / "altered.jsonl"
            out.write_text("\n".join(lines) + "\n")
            return out, obj["step"]
    raise AssertionError("no GC pass deleted anything in the recording")


def test_an_altered_result_is_reported_at_its_step(
    recorded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    altered, step = _altered(recorded, tmp_path)
    with pytest.raises(ReplayDivergenceError) as caught:
        replay(altered)
    assert caught.value.step == step and caught.value.op == "run_gc"
    assert main(["replay", str(altered)]) == 1
    out = capsys.readouterr().out
    assert f"DIVERGED at step {step} (run_gc)" in out and "first difference" in out


def test_an_altered_result_is_reported_at_its_step_with_sampled_state_checks(
    recorded: Path, tmp_path: Path
) -> None:
    altered, step = _altered(recorded, tmp_path)
    with pytest.raises(ReplayDivergenceError) as caught:
        replay(altered, check_every=50)
    assert (caught.value.step, caught.value.op, caught.value.checked_to) == (step, "run_gc", None)


class _NoStatsDeletes:
    """A transaction that drops every statistics range delete: clear leaves stats behind."""

    def __init__(self, txn: Any) -> None:
        self._txn = txn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)

    def delete_range(self, table: Table, lo: bytes, hi: bytes) -> None:
        if table is not Table.STATISTICS:
            self._txn.delete_range(table, lo, hi)


def test_an_engine_bug_is_caught_by_replay(recorded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = imq.queue.stage_delete

    def leaky(snap: Any, index: int, txn: Any, r: Any) -> Any:
        return original(snap, index, _NoStatsDeletes(txn), r)

    monkeypatch.setattr(imq.queue, "stage_delete", leaky)  # clear only; GC has its own
    with pytest.raises(ReplayDivergenceError) as caught:
        replay(recorded)
    assert caught.value.op in ("clear_uncommitted_state", "startup")
    assert "statistics" in caught.value.difference


@pytest.mark.parametrize("log", sorted(REPLAYS.glob("*.jsonl")), ids=lambda p: p.name)
def test_kept_replays(log: Path) -> None:
    assert_replays(log)


def test_simulate_with_nodes_records_node_0_and_the_log_replays(tmp_path: Path) -> None:
    """With --nodes, --record logs node 0's queue: the shards it collates and the diffs
    it applies for the others; that log replays against a fresh database and the model."""
    log = tmp_path / "ops.jsonl"
    args = ["simulate", "--dir", str(tmp_path / "run"), "--rounds", "20", "--nodes", "2"]
    assert main([*args, "--seed", "5", "--no-plot", "--record", str(log)]) == 0
    ops = [json.loads(line).get("op") for line in log.read_text().splitlines()[1:]]
    assert {"prepare_diff", "write", "apply_diff", "commit_diff", "iterate"} <= set(ops)
    report = assert_replays(log, tmp_path / "db")
    assert report.steps == len(ops)


def test_replay_takes_a_str_path_and_says_what_is_wrong_with_one(tmp_path: Path) -> None:
    """An outside docs audit: ``replay("x.jsonl")`` (as docs/replay-format.md writes it)
    raised a bare AttributeError; only a Path worked."""
    log = REPLAYS / "sim-2shards-seed7.jsonl"
    assert replay(str(log)).steps > 0
    assert replay(log, str(tmp_path / "db")).steps > 0
    with pytest.raises(FileAccessError, match="cannot read the op log"):
        replay(str(tmp_path / "missing.jsonl"))
    with pytest.raises(TypeError, match="must be a path"):
        replay(7)  # type: ignore[arg-type]
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(OpLogError, match="not UTF-8"):
        replay(binary)


def test_progress_reports_the_step_being_replayed(recorded: Path) -> None:
    """A replay audit: the progress line showed the log's length for the whole run."""
    seen: list[tuple[int, int]] = []
    report = replay(recorded, progress=lambda done, total: seen.append((done, total)))
    total = report.steps
    assert seen[0] == (0, total)
    assert [done for done, _ in seen] == list(range(0, total, 256))
    assert {t for _, t in seen} == {total}


def _rewrite_last_step(log: Path) -> int:
    """Change the last step's line in place (same length): its step number."""
    raw = log.read_bytes()
    start = raw.rstrip(b"\n").rfind(b"\n") + 1
    line = json.loads(raw[start:])
    changed = b"{ " + raw[start + 1 :].rstrip(b"\n")  # JSON whitespace, then no newline
    assert len(changed) == len(raw) - start and changed != raw[start:]
    log.write_bytes(raw[:start] + changed)
    step: int = line["step"]
    return step


def test_each_step_is_read_again_from_the_file_as_it_replays(
    recorded: Path, tmp_path: Path
) -> None:
    """Memory does not grow with the log: the check keeps where each line is, and the
    replay reads it again. A line that changed since its check fails its step, naming it
    (a replay never replays what it did not check)."""
    log = tmp_path / "ops.jsonl"
    log.write_bytes(recorded.read_bytes())
    steps: list[int] = []

    def edit(total: int) -> None:
        steps.append(_rewrite_last_step(log))
        assert steps[0] == total

    with pytest.raises(OpLogError, match=rf"step {total_of(recorded)}, .*changed after the replay"):
        replay(log, checked=edit)
    # The same edit made before the replay is a log like any other: it replays.
    assert replay(log).steps == steps[0]


def total_of(log: Path) -> int:
    return sum(1 for line in log.read_text().splitlines()[1:] if line.strip())


def test_a_log_cut_after_its_check_is_not_replayed_short(recorded: Path, tmp_path: Path) -> None:
    log = tmp_path / "ops.jsonl"
    log.write_bytes(recorded.read_bytes())
    done: list[int] = []

    def cut(total: int) -> None:
        with log.open("r+b") as f:
            f.truncate(len(recorded.read_bytes()) // 2)

    with pytest.raises(OpLogError, match="changed after the replay checked it"):
        replay(log, checked=cut, progress=lambda d, _: done.append(d))
    assert done and done[-1] < total_of(recorded)


def test_a_log_from_a_pipe_replays(recorded: Path, tmp_path: Path) -> None:
    """A pipe cannot be read twice: its lines are held from the check to the replay."""
    fifo = tmp_path / "ops.fifo"
    os.mkfifo(fifo)

    def feed() -> None:
        with fifo.open("wb") as f:
            f.write(recorded.read_bytes())

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        report = replay(fifo)
    finally:
        writer.join()
    assert report.steps == total_of(recorded)


def test_the_check_reports_the_bytes_it_read(recorded: Path) -> None:
    seen: list[tuple[int, int]] = []
    replay(recorded, checking=lambda done, size: seen.append((done, size)))
    size = recorded.stat().st_size
    assert seen and {s for _, s in seen} == {size}
    done = [d for d, _ in seen]
    assert done == sorted(done) and 0 < done[-1] <= size


class Altering:
    """An iterator whose messages come out with one byte added to their bodies."""

    def __init__(self, it: Any) -> None:
        self.it = it

    def __enter__(self) -> Altering:
        return self

    def __exit__(self, *exc: object) -> None:
        self.it.close()

    def __iter__(self) -> Iterator[Any]:
        for item in self.it:
            msg = item.message
            yield item._replace(message=msg._replace(body=msg.body + b"!"))


def test_a_message_the_queue_reads_wrong_is_caught_by_the_state_check(
    recorded: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state check compares every stored message (as values; encoded only to show
    the difference): a queue whose reads change one body diverges at the step that
    stored it."""
    original = imq.queue.Queue.iterator

    def iterator(self: Any, *args: Any, **kwargs: Any) -> Altering:
        return Altering(original(self, *args, **kwargs))

    monkeypatch.setattr(imq.queue.Queue, "iterator", iterator)
    with pytest.raises(ReplayDivergenceError) as caught:
        replay(recorded)
    assert caught.value.op in ("apply_diff", "write"), caught.value
    assert caught.value.difference.startswith("messages of partition 0 for ")
    assert "21" in caught.value.difference.split("the model")[0]  # b"!" in the queue's


def _leaky_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine bug that shows in the state only: clear leaves the statistics behind."""
    original = imq.queue.stage_delete

    def leaky(snap: Any, index: int, txn: Any, r: Any) -> Any:
        return original(snap, index, _NoStatsDeletes(txn), r)

    monkeypatch.setattr(imq.queue, "stage_delete", leaky)


def test_check_every_compares_the_state_less_often(recorded: Path) -> None:
    every_step = replay(recorded)
    sampled = replay(recorded, check_every=7)
    assert sampled.steps == every_step.steps and sampled.check_every == 7
    assert every_step.check_every == 1
    assert 0 < sampled.checks < every_step.checks / 3, (sampled, every_step)


@pytest.mark.parametrize("every", [5, 10**9])
def test_a_sampled_state_check_still_names_the_step_that_made_the_difference(
    recorded: Path, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    """A difference the state comparison finds after several unchecked steps is replayed
    again, comparing after every step, so that the error names the same step as a replay
    that compares after every one. With an N larger than the log, the state is compared
    only before each close of the queue and at the end, and the bug is still found."""
    _leaky_clear(monkeypatch)
    with pytest.raises(ReplayDivergenceError) as exact:
        replay(recorded)
    assert exact.value.checked_to is None
    with pytest.raises(ReplayDivergenceError) as sampled:
        replay(recorded, check_every=every)
    assert (sampled.value.step, sampled.value.op) == (exact.value.step, exact.value.op)
    assert sampled.value.difference == exact.value.difference
    assert sampled.value.checked_to is None
    found = sampled.value.__cause__  # what the sampled comparison saw first
    assert isinstance(found, ReplayDivergenceError)
    assert found.checked_to is not None
    assert found.checked_to < exact.value.step <= found.step
    assert f"agreed last after step {found.checked_to}" in str(found)


def test_the_state_is_compared_at_the_end_of_a_log_that_leaves_the_queue_open(
    recorded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log cut just after the step that made a difference only the state shows: with
    an N larger than the log, the comparison at its end finds it."""
    _leaky_clear(monkeypatch)
    with pytest.raises(ReplayDivergenceError) as exact:
        replay(recorded)
    lines = recorded.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[: exact.value.step + 1]))  # the header, then the steps
    assert json.loads(lines[exact.value.step])["step"] == exact.value.step
    with pytest.raises(ReplayDivergenceError) as sampled:
        replay(cut, check_every=10**9)
    assert (sampled.value.step, sampled.value.checked_to) == (exact.value.step, None)
    assert "statistics" in sampled.value.difference


def test_a_sampled_state_check_on_a_given_opener_gives_the_range(
    recorded: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``open_queue`` there is no fresh database to replay on again: the error names
    where the difference showed and the step after which the state agreed last."""
    _leaky_clear(monkeypatch)
    with pytest.raises(ReplayDivergenceError) as exact:
        replay(recorded)
    memory = MemoryDatabase()

    def opener(config: QueueConfig, zerostate: int) -> Any:
        return memory.open(config, zerostate_seqno=zerostate)

    with pytest.raises(ReplayDivergenceError) as sampled:
        replay(recorded, open_queue=opener, check_every=10**9)
    assert sampled.value.checked_to is not None
    assert sampled.value.checked_to < exact.value.step <= sampled.value.step


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "5"])
def test_check_every_must_be_a_whole_number_of_at_least_one(recorded: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="check_every"):
        replay(recorded, check_every=bad)


def test_cli_replay_check_every(recorded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(recorded), "--check-every", "4", "--no-progress"]) == 0
    assert "every 4 state changes" in capsys.readouterr().out
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit) as usage:
            main(["replay", str(recorded), "--check-every", bad])
        assert usage.value.code == 2
        assert "at least 1" in capsys.readouterr().err
