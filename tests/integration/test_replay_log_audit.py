"""Op logs the replay cannot use, and recordings that must replay (an outside audit).

A value the format does not allow (a JSON float where an integer belongs, ``1e400``, a
boolean given as a string, a line nested too deeply, an integer of 5,000 digits) is one
:class:`OpLogError` naming the file and the line, from ``imq.testing.replay`` and from
``imq replay`` (one line on stderr, exit status 1, never a traceback). A log with a step
cut out of it is refused rather than replayed to "agree". The recorder writes every
step it numbers (an iterator left open when its queue closes, or dropped unclosed), and
a Ctrl-C between an iterator's pull and its bookkeeping no longer logs a position one
message past the logged messages.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import io
import itertools
import json
import operator
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from imq import (
    Address,
    BlockIdShort,
    IteratedMessage,
    Message,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
)
from imq.errors import FileAccessError
from imq.testing import OpLog, OpLogError, ReplayDivergenceError, replay
from imq.testing.record import RecordingIterator

REPO = Path(__file__).resolve().parents[2]
KEPT = REPO / "tests" / "replays" / "sim-2shards-seed7.jsonl"
HEADER = '{"imq_ops":1,"zerostate_seqno":0}'
OPEN = '{"step":1,"op":"open","args":{},"result":null}'
SHARD = ShardIdent(0, 0x4000_0000_0000_0000)
ZERO64 = "0" * 64
# A well-formed step 2 of each op the cases below break; a case puts a bad value in
GOOD = {
    "get_diff_info": {"shard": "0:4000000000000000", "seqno": 1, "zone": "BOTH"},
    "iterate": {"partition": 0, "ranges": [], "for_shard": "0:8000000000000000"},
    "load_diff_statistics": {
        "partition": 0,
        "range": ["0:4000000000000000", f"0:{ZERO64}", f"1:{ZERO64}"],
    },
    "commit_diff": {
        "top_blocks": [
            {
                "block": f"-1:8000000000000000:1:{ZERO64}:{ZERO64}",
                "ref_by_mc_seqno": 1,
                "updated": True,
            }
        ],
        "partitions": [0, 1],
    },
    "startup": {
        "last_applied_mc_block": f"-1:8000000000000000:1:{ZERO64}:{ZERO64}",
        "top_shards": [],
        "partitions": [0, 1],
    },
}
RESULT = {"iterate": {"messages": [], "exhausted": True, "position": {}}, "commit_diff": True}


def _step(op: str, step: int = 2, **change: object) -> str:
    args = json.loads(json.dumps(GOOD[op]))
    for name, value in change.items():
        if name == "top":
            args["top_blocks"][0].update(value)  # type: ignore[call-overload]
        else:
            args[name] = value
    line = {"step": step, "op": op, "args": args, "result": RESULT.get(op)}
    return json.dumps(line)


def _raw(op: str, name: str, text: str) -> str:
    """A step whose argument ``name`` is the raw JSON ``text`` (1e400 has no Python form)."""
    return _step(op, **{name: "@@"}).replace('"@@"', text)


def _log(tmp_path: Path, *lines: str) -> Path:
    log = tmp_path / "ops.jsonl"
    log.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return log


def _imq(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "imq", *map(str, argv)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
        check=False,
    )


def _error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, done
    assert done.stdout == "" and "Traceback" not in done.stderr, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("imq: error: op log "), lines[0]
    return lines[0]


def test_the_well_formed_steps_below_are_accepted(tmp_path: Path) -> None:
    from imq.testing.replay import check_log

    steps = [_step(op, step) for step, op in enumerate(GOOD, start=2)]
    assert check_log(_log(tmp_path, HEADER, OPEN, *steps)) == 1 + len(GOOD)


# -- F1: values the JSON reader or the integer conversion choked on -------------------------

HUGE = "9" * 5000
DEEP = "[" * 100_000 + "]" * 100_000
UNREADABLE = [
    (
        [HEADER, OPEN, _raw("get_diff_info", "seqno", "1e400")],
        "line 3: get_diff_info: argument 'seqno' is not valid",
    ),
    (
        [HEADER, OPEN, _raw("iterate", "partition", "1e400")],
        "line 3: iterate: argument 'partition' is not valid",
    ),
    (
        [HEADER, OPEN, '{"step":2,"op":"write","args":{"pending":1e400},"result":null}'],
        "line 3: write: argument 'pending' is not valid",
    ),
    ([HEADER, OPEN, _step("iterate").replace('"step": 2', '"step": 1e400')], "line 3: a step"),
    (['{"imq_ops":1,"zerostate_seqno":1e400}', OPEN], 'line 1: "zerostate_seqno" is not'),
    ([HEADER, OPEN, f'{{"step":2,"op":"run_gc","args":{{}},"result":{DEEP}}}'], "line 3:"),
    (
        [HEADER, f'{{"step":{HUGE},"op":"open","args":{{}},"result":null}}'],
        "line 2: not JSON the replay can read (an integer of more than 4300 digits)",
    ),
    ([HEADER, OPEN, _raw("get_diff_info", "seqno", "NaN")], "line 3: not JSON"),
]
UNREADABLE_IDS = ["inf-seqno", "inf-partition", "inf-pending", "inf-step"]
UNREADABLE_IDS += ["inf-zerostate", "deep", "5000-digits", "nan"]


@pytest.mark.parametrize(("lines", "says"), UNREADABLE, ids=UNREADABLE_IDS)
def test_an_unreadable_value_is_an_op_log_error_naming_the_file_and_line(
    tmp_path: Path, lines: list[str], says: str
) -> None:
    log = _log(tmp_path, *lines)
    with pytest.raises(OpLogError) as caught:
        replay(log)
    assert f"op log {log} {says}" in str(caught.value)
    line = _error_line(_imq("replay", "--no-progress", log))
    assert f"op log {log} {says}" in line, line


# -- F6: values of the wrong JSON type, once coerced and replayed as agreeing ---------------

ILL_TYPED = [
    (_step("iterate", partition="0"), "'partition' is not valid (a partition must be"),
    (_step("iterate", partition=0.7), "'partition' is not valid"),
    (_step("iterate", partition=True), "'partition' is not valid (a partition must be an"),
    (_step("load_diff_statistics", partition=1.0), "'partition' is not valid"),
    (_step("get_diff_info", seqno=True), "'seqno' is not valid"),
    (_step("commit_diff", top={"ref_by_mc_seqno": 1.9}), "ref_by_mc_seqno must be an integer"),
    (_step("commit_diff", top={"updated": "false"}), "updated must be a boolean, got a string"),
    (_step("commit_diff", partitions="01"), "'partitions' is not valid"),
    (_step("commit_diff", partitions=["0"]), "'partitions' is not valid"),
    (_step("startup", partitions=[True]), "'partitions' is not valid"),
    (_step("get_diff_info", zone=None), "'zone' is not valid"),
]


ILL_TYPED_IDS = ["partition-str", "partition-float", "partition-bool", "stats-partition-1.0"]
ILL_TYPED_IDS += ["seqno-bool", "ref-float", "updated-str", "partitions-str"]
ILL_TYPED_IDS += ["partitions-of-str", "partitions-of-bool", "zone-null"]


@pytest.mark.parametrize(("line", "says"), ILL_TYPED, ids=ILL_TYPED_IDS)
def test_an_ill_typed_argument_is_refused(tmp_path: Path, line: str, says: str) -> None:
    log = _log(tmp_path, HEADER, OPEN, line)
    with pytest.raises(OpLogError, match=r"line 3: \w+: argument ") as caught:
        replay(log)
    assert says in str(caught.value) and f"op log {log} " in str(caught.value)


@pytest.mark.parametrize("header", ['{"imq_ops":1,"zerostate_seqno":true}', '{"imq_ops":true}'])
def test_an_ill_typed_header_is_refused(tmp_path: Path, header: str) -> None:
    log = _log(tmp_path, header, OPEN)
    with pytest.raises(OpLogError, match=f"op log {log} line 1: "):
        replay(log)


# -- F7: a line cut short names its line ----------------------------------------------------


def test_a_line_cut_short_is_named_by_the_library(tmp_path: Path) -> None:
    lines = KEPT.read_text().splitlines()
    log = _log(tmp_path, *lines[:5], lines[5][:25], *lines[6:])
    with pytest.raises(OpLogError, match=f"op log {log} line 6: not JSON"):
        replay(log)


# -- F2: a step missing ---------------------------------------------------------------------


def _without_first(op: str, tmp_path: Path) -> tuple[Path, int, int]:
    """The kept log without its first ``op`` line: (the log, that step, the next line)."""
    lines = KEPT.read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if json.loads(line).get("op") == op)
    step = json.loads(lines[index])["step"]
    return _log(tmp_path, *lines[:index], *lines[index + 1 :]), step, index + 1


@pytest.mark.parametrize("op", ["run_gc", "startup", "get_commit_pointers", "iterate"])
def test_a_log_with_a_step_cut_out_is_refused(tmp_path: Path, op: str) -> None:
    log, step, _ = _without_first(op, tmp_path)
    with pytest.raises(OpLogError, match=f"step {step} missing before it: the log was cut"):
        replay(log)


def test_the_cli_refuses_a_log_with_a_step_cut_out(tmp_path: Path) -> None:
    log, step, line = _without_first("run_gc", tmp_path)
    said = _error_line(_imq("replay", "--no-progress", log))
    assert f"op log {log} line {line} (step {step + 1}, " in said, said
    assert f"step {step} missing before it" in said, said


def test_a_log_of_only_its_header_is_refused(tmp_path: Path) -> None:
    log = _log(tmp_path, HEADER)
    with pytest.raises(OpLogError, match="holds no step"):
        replay(log)
    assert "holds no step" in _error_line(_imq("replay", "--no-progress", log))


def test_a_log_cut_at_a_line_end_still_replays(tmp_path: Path) -> None:
    lines = KEPT.read_text().splitlines()
    assert replay(_log(tmp_path, *lines[:20])).steps == 19


def _reading(log: OpLog, path: Path) -> tuple[Queue, Iterator[IteratedMessage]]:
    """A recorded queue holding three messages, and an iterator that has yielded one."""
    queue, full = _queue_with_a_message(log, path)
    it = queue.iterator(0, [full], ShardIdent.BASECHAIN)
    next(it)
    return queue, it


def _queue_with_a_message(log: OpLog, path: Path) -> tuple[Queue, QueueShardRange]:
    queue = log.open(Queue.open, path, QueueConfig.testing())
    msgs = [
        Message(
            QueueKey(1001 + i, bytes([i + 1]) * 32),
            Address(0, b"\x10" * 32),
            Address(0, b"\x90" * 32),
        )
        for i in range(3)
    ]
    assert queue.apply_diff(QueueDiff(msgs), BlockIdShort(SHARD, 1), b"\x01" * 32)
    return queue, QueueShardRange(SHARD, QueueKey.MIN, QueueKey.MAX)


def test_an_iterator_open_when_its_queue_closes_is_written(tmp_path: Path) -> None:
    path = tmp_path / "ops.jsonl"
    with path.open("w") as sink:
        queue, it = _reading(OpLog(sink), tmp_path / "q")
        queue.close()  # the iterator is never closed
        steps = [json.loads(line) for line in path.read_text().splitlines()[1:]]
        assert [s["step"] for s in steps] == [1, 2, 4, 3]
        assert len(steps[-1]["result"]["messages"]) == 1
    assert replay(path).steps == 4
    assert it is not None


def test_an_iterator_dropped_unclosed_is_written(tmp_path: Path) -> None:
    path = tmp_path / "ops.jsonl"
    with path.open("w") as sink:
        queue, it = _reading(OpLog(sink), tmp_path / "q")
        next(it)
        del it
        gc.collect()
        queue.get_commit_pointers()
        queue.close()
    steps = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert len(steps[2]["result"]["messages"]) == 2
    assert replay(path).steps == 5


# -- F3: a Ctrl-C between an iterator's pull and its bookkeeping --------------------------


def test_a_ctrl_c_right_after_a_pull_keeps_the_message_with_the_position() -> None:
    """The interrupt lands where the interpreter next checks for signals after the inner
    iterator handed a message over. Here the pull itself raises SIGINT's flag from C
    (``PyErr_SetInterrupt`` through a C-only pipeline: no Python frame in between, as a
    real ``itertools.chain`` pull), so the check comes at the first point the recorder's
    own code allows. The logged messages and position must agree."""
    source_shard = ShardIdent(0, 0x8000_0000_0000_0000)
    items = [
        IteratedMessage(
            source_shard,
            Message(
                QueueKey(1000 + i, bytes([i]) * 32),
                Address(0, b"\x01" * 32),
                Address(0, b"\x02" * 32),
            ),
        )
        for i in range(3)
    ]
    source = iter(items)

    class Inner(map):  # type: ignore[type-arg]
        def current_position(self) -> dict[ShardIdent, QueueKey]:
            taken = len(items) - operator.length_hint(source)
            return {source_shard: items[taken - 1].message.key} if taken else {}

        def close(self) -> None:
            pass

    trip = ctypes.pythonapi.PyErr_SetInterrupt
    inner = Inner(operator.itemgetter(0), zip(source, itertools.starmap(trip, [()]), strict=False))
    sink = io.StringIO()
    recording = RecordingIterator(inner, OpLog(sink), {"partition": 0})
    with pytest.raises(KeyboardInterrupt):
        next(recording)
    assert operator.length_hint(source) == 2  # the inner iterator did move past one
    recording.close()
    result = json.loads(sink.getvalue().splitlines()[1])["result"]
    assert result["position"] == {str(source_shard): str(items[0].message.key)}
    assert [m[1][0] for m in result["messages"]] == [str(items[0].message.key)]


# -- the sink of a recording ----------------------------------------------------------------


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_a_sink_that_cannot_be_written_is_named() -> None:
    with open("/dev/full", "w") as sink:
        log = OpLog(sink)
        with pytest.raises(FileAccessError, match="cannot write the op log to /dev/full"):
            log.flush()
        with pytest.raises(OSError):  # the close flushes what is left
            sink.close()


def test_a_closed_sink_is_a_typed_error_that_says_to_keep_it_open(tmp_path: Path) -> None:
    """A bare ``ValueError: I/O operation on closed file`` until stop 40."""
    sink = io.StringIO()
    log = OpLog(sink)
    queue = log.open(Queue.open, tmp_path / "db", QueueConfig.testing())
    try:
        sink.close()
        with pytest.raises(FileAccessError, match="keep the op log's file open") as caught:
            queue.get_last_applied_seqno(SHARD)
        assert caught.value.errno == errno.EBADF
    finally:
        queue.inner.close()


class _FailingSink(io.StringIO):
    """A sink that fails with ENOSPC from its ``fail_at``-th write on."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes >= self.fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(text)


def test_a_sink_that_fails_after_the_call_says_the_call_took_effect(tmp_path: Path) -> None:
    """The queue wrote the diff, then the log's line failed: the error says the call took
    effect (a caller taking it for failed would apply it again), and which step the log
    lacks."""
    sink = _FailingSink(fail_at=3)  # the header, the open, then the apply's line
    log = OpLog(sink)
    queue = log.open(Queue.open, tmp_path / "db", QueueConfig.testing())
    src = Address(0, bytes(32))
    dst = Address(0, b"\x80" + bytes(31))
    diff = QueueDiff([Message(QueueKey(1, bytes(32)), src, dst, b"m")])
    try:
        with pytest.raises(FileAccessError) as caught:
            queue.apply_diff(diff, BlockIdShort(SHARD, 1), b"\x01" * 32)
        text = str(caught.value)
        assert "apply_diff took effect on the queue all the same" in text, text
        assert "lacks its line (step 2)" in text and "the disk is full" in text, text
        assert caught.value.errno == errno.ENOSPC
        assert queue.inner.get_last_applied_seqno(SHARD) == 1  # it did take effect
    finally:
        queue.inner.close()


@pytest.mark.parametrize("value", [False, 0.0])
def test_a_result_of_another_json_type_does_not_agree(tmp_path: Path, value: object) -> None:
    """A result is compared exactly: ``false`` or ``0.0`` is not the ``0`` the queue gives."""
    lines = KEPT.read_text().splitlines()
    index = next(
        i for i, line in enumerate(lines) if '"op":"run_gc"' in line and '"result":0' in line
    )
    step = json.loads(lines[index])
    step["result"] = value
    lines[index] = json.dumps(step)
    with pytest.raises(ReplayDivergenceError) as caught:
        replay(_log(tmp_path, *lines))
    assert caught.value.step == step["step"] and caught.value.op == "run_gc"
    # shown as the log writes it (JSON), so the two can be told apart on screen
    says = f"the log says {json.dumps({'result': value})}, the queue now " + '{"result": 0}'
    assert caught.value.difference == says, caught.value.difference
