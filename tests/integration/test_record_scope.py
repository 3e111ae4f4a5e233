"""What a recording holds and what it refuses (found by a docs audit: the recorder was
documented as recording every call, while state-changing calls outside the log's format
went through unrecorded and the logs then failed to replay).

- the config's checks that make an apply fail (``check_sources``, ``check_statistics``)
  are logged with ``open`` and run by the replay, so a refused diff replays as refused;
- ``run_gc_report`` is a GC pass like ``run_gc``: recorded as ``run_gc``;
- the background GC worker and ``import_state`` change the queue outside any call the log
  can hold: refused, with what to do instead.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from imq import (
    Address,
    BlockId,
    BlockIdShort,
    DiffStatistics,
    DiffZone,
    Message,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    TopBlock,
)
from imq.errors import ConfigError, DatabaseLockedError, ImqError
from imq.testing import OpLog, OpLogError, ReplayDivergenceError, UnrecordableCallError, replay

SHARD = ShardIdent(0, 0x4000_0000_0000_0000)  # accounts 0x0000.. to 0x7fff..
INSIDE = Address(0, b"\x10" * 32)
OUTSIDE = Address(0, b"\x90" * 32)
CONFIG = QueueConfig.testing()
_RANGE = QueueShardRange(SHARD, QueueKey.MIN, QueueKey.MAX)


def _diff(lt: int, src: Address = INSIDE) -> QueueDiff:
    return QueueDiff([Message(QueueKey(lt, bytes([lt % 256]) * 32), src, OUTSIDE)])


def _steps(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()[1:]]


def test_a_refusal_by_check_sources_replays(tmp_path: Path) -> None:
    log_path = tmp_path / "ops.jsonl"
    config = dataclasses.replace(CONFIG, check_sources=True)
    with log_path.open("w") as sink:
        queue = OpLog(sink).open(Queue.open, tmp_path / "q", config)
        with pytest.raises(ValueError, match="outside the block's shard"):
            queue.apply_diff(_diff(10, OUTSIDE), BlockIdShort(SHARD, 1), b"\x01" * 32)
        assert queue.apply_diff(_diff(11), BlockIdShort(SHARD, 1), b"\x02" * 32)
        queue.close()
    steps = _steps(log_path)
    assert steps[0]["args"] == {"check_sources": True}
    assert steps[1]["error"]["type"] == "ValueError"  # type: ignore[index]
    assert replay(log_path).steps == 4
    # Without the check logged, the replay's queue would take the diff the host's refused.
    text = log_path.read_text().replace('{"check_sources":true}', "{}")
    log_path.write_text(text)
    with pytest.raises(ReplayDivergenceError, match="step 2"):
        replay(log_path)


def test_a_refusal_by_check_statistics_replays(tmp_path: Path) -> None:
    log_path = tmp_path / "ops.jsonl"
    config = dataclasses.replace(CONFIG, check_statistics=True)
    diff = _diff(10)
    wrong = DiffStatistics(SHARD, QueueKey(10, bytes(32)), QueueKey(20, bytes(32)), {0: {}})
    with log_path.open("w") as sink:
        queue = OpLog(sink).open(Queue.open, tmp_path / "q", config)
        with pytest.raises(ValueError, match="contradict"):
            queue.apply_diff(diff, BlockIdShort(SHARD, 1), b"\x01" * 32, wrong)
        assert queue.apply_diff(diff, BlockIdShort(SHARD, 1), b"\x01" * 32)
        queue.close()
    assert _steps(log_path)[0]["args"] == {"check_statistics": True}
    assert replay(log_path).steps == 4


def test_run_gc_report_is_recorded_as_a_gc_pass(tmp_path: Path) -> None:
    log_path = tmp_path / "ops.jsonl"
    mc = ShardIdent.MASTERCHAIN
    with log_path.open("w") as sink:
        queue = OpLog(sink).open(Queue.open, tmp_path / "q", CONFIG)
        assert queue.apply_diff(_diff(10), BlockIdShort(SHARD, 1), b"\x01" * 32)
        # The masterchain block's diff has read the shard past its message: GC may go.
        mc_diff = QueueDiff([], processed_to={SHARD: QueueKey(10, bytes([10]) * 32)})
        assert queue.apply_diff(mc_diff, BlockIdShort(mc, 1), b"\x02" * 32)
        top = [TopBlock(BlockId(mc, 1, b"\x00" * 32, b"\x00" * 32), 1)]
        top.append(TopBlock(BlockId(SHARD, 1, b"\x00" * 32, b"\x00" * 32), 1))
        assert queue.commit_diff(top)
        report = queue.run_gc_report()
        assert report.executed >= 1
        queue.close()
    gc_steps = [s for s in _steps(log_path) if s["op"] == "run_gc"]
    assert [s["result"] for s in gc_steps] == [report.executed]
    assert replay(log_path).steps == len(_steps(log_path))


def test_the_background_gc_worker_is_refused(tmp_path: Path) -> None:
    with (tmp_path / "ops.jsonl").open("w") as sink:
        log = OpLog(sink)
        with pytest.raises(ConfigError, match="gc_enabled=False"):
            log.open(Queue.open, tmp_path / "q", QueueConfig())
    assert not (tmp_path / "q").exists()  # refused before anything was opened


def test_import_state_is_refused(tmp_path: Path) -> None:
    with (tmp_path / "ops.jsonl").open("w") as sink:
        queue = OpLog(sink).open(Queue.open, tmp_path / "q", CONFIG)
        try:
            with pytest.raises(UnrecordableCallError, match="import_state cannot be recorded"):
                queue.import_state(tmp_path / "missing.bin", None)
            assert queue.get_commit_pointers() == {}  # nothing happened
        finally:
            queue.close()
    assert replay(tmp_path / "ops.jsonl").steps == 3


# -- honest recordings the replay's model refused (a record/replay audit) --------------------


def _record(tmp_path: Path, session: Callable[[Any], None]) -> Path:
    log_path = tmp_path / "ops.jsonl"
    with log_path.open("w") as sink, OpLog(sink).open(Queue.open, tmp_path / "q", CONFIG) as q:
        session(q)
    return log_path


def test_statistics_the_caller_passes_are_stored_as_given_in_the_replay(tmp_path: Path) -> None:
    """The queue stores the caller's statistics as given (check_statistics off); the model
    recounted them, so an honest log with other counts diverged."""
    diff = _diff(10)
    off = DiffStatistics(SHARD, diff.min_message, diff.max_message, {0: {OUTSIDE: 5}})
    log = _record(tmp_path, lambda q: q.apply_diff(diff, BlockIdShort(SHARD, 1), b"\x01" * 32, off))
    assert replay(log).steps == 3


def test_the_pending_diff_guard_replays(tmp_path: Path) -> None:
    """With a pending diff held, commit, clear, startup and a prepare of its shard are
    refused (ImqError); the model said yes."""
    mc = BlockId(ShardIdent.MASTERCHAIN, 1, b"\x00" * 32, b"\x00" * 32)

    def session(q: Any) -> None:
        pending = q.prepare_diff(_diff(10), BlockIdShort(SHARD, 1), b"\x01" * 32)
        for call in (
            lambda: q.commit_diff([TopBlock(mc, 1)]),
            q.clear_uncommitted_state,
            lambda: q.startup(mc, []),
            lambda: q.prepare_diff(_diff(11), BlockIdShort(SHARD, 2), b"\x02" * 32),
        ):
            with pytest.raises(ImqError):
                call()
        pending.write()

    assert replay(_record(tmp_path, session)).steps == 8


def test_run_gc_beside_a_pending_diff_replays(tmp_path: Path) -> None:
    """A replay audit: the queue refuses run_gc while the thread holds a pending diff
    (it would deadlock on it); the model ran it."""

    def session(q: Any) -> None:
        pending = q.prepare_diff(_diff(10), BlockIdShort(SHARD, 1), b"\x01" * 32)
        with pytest.raises(ImqError, match="deadlock"):
            q.run_gc()
        pending.write()

    assert replay(_record(tmp_path, session)).steps == 5


@pytest.mark.parametrize(
    ("check", "bad"),
    [
        ("check_statistics", "statistics"),
        ("check_sources", "source"),
        ("", "hash"),
    ],
)
def test_a_value_refused_beside_a_pending_diff_of_its_shard_replays(
    tmp_path: Path, check: str, bad: str
) -> None:
    """A replay audit: the queue checks a diff's values before the shard's pending diff,
    the model the other way round: a refused value replayed as ImqError."""
    config = dataclasses.replace(CONFIG, **{check: True}) if check else CONFIG
    diff = _diff(11, OUTSIDE if bad == "source" else INSIDE)
    wrong = DiffStatistics(SHARD, QueueKey(1, bytes(32)), QueueKey(2, bytes(32)), {0: {}})
    log_path = tmp_path / "ops.jsonl"
    with log_path.open("w") as sink:
        queue = OpLog(sink).open(Queue.open, tmp_path / "q", config)
        pending = queue.prepare_diff(_diff(10), BlockIdShort(SHARD, 1), b"\x01" * 32)
        with pytest.raises(ValueError):
            queue.apply_diff(
                diff,
                BlockIdShort(SHARD, 2),
                b"\x02" * (64 if bad == "hash" else 32),
                wrong if bad == "statistics" else None,
            )
        pending.write()
        queue.close()
    assert replay(log_path).steps == 5


def test_a_dropped_pending_diff_is_logged_as_discarded(tmp_path: Path) -> None:
    def session(q: Any) -> None:
        q.prepare_diff(_diff(10), BlockIdShort(SHARD, 1), b"\x01" * 32)  # dropped at once
        gc.collect()
        assert q.apply_diff(_diff(10), BlockIdShort(SHARD, 1), b"\x01" * 32)

    log = _record(tmp_path, session)
    assert [s["op"] for s in _steps(log)][1:3] == ["prepare_diff", "discard"]
    assert replay(log).steps == 5


def test_argument_errors_replay(tmp_path: Path) -> None:
    """Refused arguments (a partition out of range, a seqno no u32, statistics of another
    shard) are refused by the model too."""
    mc = BlockId(ShardIdent.MASTERCHAIN, 1, b"\x00" * 32, b"\x00" * 32)
    other = DiffStatistics(ShardIdent.BASECHAIN, QueueKey.MIN, QueueKey.MAX, {0: {}})

    def session(q: Any) -> None:
        for call in (
            lambda: q.commit_diff([TopBlock(mc, 1)], [70_000]),
            lambda: q.clear_uncommitted_state([-1]),
            lambda: q.get_diff_info(SHARD, 2**40, DiffZone.BOTH),
            lambda: q.load_diff_statistics(70_000, _RANGE),
            lambda: q.apply_diff(_diff(10), BlockIdShort(SHARD, 1), b"\x01" * 32, other),
        ):
            with pytest.raises(ValueError):
                call()

    assert replay(_record(tmp_path, session)).steps == 7


def test_a_failed_open_is_not_logged(tmp_path: Path) -> None:
    log_path = tmp_path / "ops.jsonl"
    with log_path.open("w") as sink:
        log = OpLog(sink)
        with Queue.open(tmp_path / "q", CONFIG), pytest.raises(DatabaseLockedError):
            log.open(Queue.open, tmp_path / "q", CONFIG)  # another handle holds it
        with log.open(Queue.open, tmp_path / "q", CONFIG) as queue:  # the recorder's with
            assert queue.apply_diff(_diff(10), BlockIdShort(SHARD, 1), b"\x01" * 32)
    assert [s["op"] for s in _steps(log_path)] == ["open", "apply_diff", "close"]
    assert replay(log_path).steps == 3


def test_a_zerostate_the_log_header_does_not_say_is_refused(tmp_path: Path) -> None:
    """The header's zerostate seqno is what the replay opens with; a queue opened with
    another diverged at its first commit of an older top block (record/replay audit)."""
    with (tmp_path / "ops.jsonl").open("w") as sink:
        log = OpLog(sink)
        opener = functools.partial(Queue.open, zerostate_seqno=5)
        with pytest.raises(ConfigError, match=r"OpLog\(sink, zerostate_seqno=5\)"):
            log.open(opener, tmp_path / "q", CONFIG)
    with Queue.open(tmp_path / "q", CONFIG) as queue:  # refused, and closed again
        assert queue.zerostate_seqno == 0
    with (tmp_path / "ops2.jsonl").open("w") as sink:
        OpLog(sink, zerostate_seqno=5).open(opener, tmp_path / "q2", CONFIG).close()
    assert replay(tmp_path / "ops2.jsonl").steps == 2


@pytest.mark.parametrize("args", ['{"check_source":true}', '{"check_sources":1}'])
def test_an_open_with_an_unknown_check_is_refused(tmp_path: Path, args: str) -> None:
    """A misspelt or non-boolean check was ignored, so the replay ran without it."""
    log = tmp_path / "ops.jsonl"
    log.write_text(
        '{"imq_ops":1,"zerostate_seqno":0}\n'
        f'{{"step":1,"op":"open","args":{args},"result":null}}\n'
        '{"step":2,"op":"close","args":{},"result":null}\n'
    )
    with pytest.raises(OpLogError, match="open: unknown argument"):
        replay(log)


# A call with arguments a log line cannot hold (found by stop 40's review: the recorder's
# encoders raised their own errors first, "Object of type object is not JSON
# serializable", "'int' object is not iterable", and a bool seqno was logged in a form
# the reader refuses, so the whole log would not replay).
_BAD_CALLS: dict[str, Callable[[Any], Any]] = {
    "seqno a bool": lambda q: q.get_diff_info(SHARD, True),
    "seqno an object": lambda q: q.get_diff_info(SHARD, object()),
    "seqno a string": lambda q: q.get_diff_info(SHARD, "5"),
    "shard a string": lambda q: q.get_diff_info("0:40", 1),
    "zone a string": lambda q: q.get_diff_info(SHARD, 1, "BOTH"),
    "last applied of a string": lambda q: q.get_last_applied_seqno("0:40"),
    "partitions an int": lambda q: q.commit_diff([], 5),
    "top blocks an int": lambda q: q.commit_diff(5),
    "top shards a string": lambda q: q.clear_uncommitted_state([0], "0:40"),
    "startup of a string block": lambda q: q.startup("-1:8000000000000000:1", [SHARD]),
    "iterator ranges an int": lambda q: q.iterator(0, 5, SHARD),
    "iterator partition a bool": lambda q: q.iterator(True, [_RANGE], SHARD),
    "tail of an int key": lambda q: q.get_diffs_tail_len(SHARD, 5),
    "statistics of no range": lambda q: q.load_diff_statistics(0, None),
    "apply of no diff": lambda q: q.apply_diff(None, BlockIdShort(SHARD, 1), bytes(32)),
    # a replay audit: these encoded as the values the queue takes, so they replayed as done
    "apply of a bytearray hash": lambda q: q.apply_diff(
        QueueDiff(), BlockIdShort(SHARD, 1), bytearray(32)
    ),
    "apply of a memoryview hash": lambda q: q.apply_diff(
        QueueDiff(), BlockIdShort(SHARD, 1), memoryview(bytes(32))
    ),
    "apply of a BlockId": lambda q: q.apply_diff(
        QueueDiff(), BlockId(SHARD, 1, bytes(32), bytes(32)), bytes(32)
    ),
    "prepare of a bytearray hash": lambda q: q.prepare_diff(
        QueueDiff(), BlockIdShort(SHARD, 1), bytearray(32)
    ),
}


@pytest.mark.parametrize("name", sorted(_BAD_CALLS))
def test_a_call_refused_for_its_arguments_raises_the_queues_error_and_replays(
    tmp_path: Path, name: str
) -> None:
    call = _BAD_CALLS[name]
    with Queue.open(tmp_path / "bare", CONFIG) as bare, pytest.raises(Exception) as expected:
        call(bare)
    log_path = tmp_path / "ops.jsonl"
    with log_path.open("w") as sink:
        queue = OpLog(sink).open(Queue.open, tmp_path / "db", CONFIG)
        with pytest.raises(type(expected.value)) as got:
            call(queue)
        assert str(got.value) == str(expected.value)
        queue.apply_diff(_diff(1), BlockIdShort(SHARD, 1), bytes([1]) * 32)
        queue.close()
    assert replay(log_path).steps >= 3  # open, apply, close (and the refused call if held)
