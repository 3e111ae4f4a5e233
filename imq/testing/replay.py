"""Replay an op log (``docs/replay-format.md``) on a fresh database and on the model.

Every recorded result is compared with what the real queue and the in-memory model
(:class:`imq.testing.model.QueueModel`, the oracle) return now, and after every step
that can change the state, the observable state of the two is compared: commit
pointers, last committed block, per shard the last applied seqno, tail length, every
stored diff's info and zone, the statistics, and every stored message as the iterator
yields it. The first difference raises :class:`ReplayDivergenceError`.

``kill`` is replayed as a close: RocksDB keeps every written batch either way, and a
prepared, unwritten diff dies with the process (the model drops it too). A call the host
made after closing its queue (a queue call, or a pending diff written or discarded) is
replayed on the closed queue, and the model, closed as well, answers
``QueueClosedError``. A log the replay cannot use (a line that is not JSON, a value not of
the type the format gives, a step missing) raises :class:`OpLogError` naming the file and
the line, before anything is replayed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from imq import (
    BlockId,
    DiffStatistics,
    DiffZone,
    PartitionRouter,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
)
from imq.errors import FileAccessError, ImqError, QueueClosedError
from imq.storage.codec import HASH_LEN
from imq.testing import codec as c
from imq.testing.model import DiffInput, QueueModel
from imq.types import U32_MAX, check_partition, check_partitions, check_u32

__all__ = [
    "OpLogError",
    "Opener",
    "ReplayDivergenceError",
    "ReplayReport",
    "assert_replays",
    "check_log",
    "iter_steps",
    "read_log",
    "replay",
]

MUTATING = {
    "open",
    "close",
    "kill",
    "write",
    "discard",
    "apply_diff",
    "commit_diff",
    "clear_uncommitted_state",
    "startup",
    "run_gc",
}
_FOR_SHARDS = (ShardIdent.MASTERCHAIN, ShardIdent.BASECHAIN)
_CLOSING = {"close", "kill"}  # after them the queue's state cannot be read


class ReplayDivergenceError(AssertionError):
    """The replay differs from the log, or the queue from the model.

    ``step`` and ``op`` name the step at which the difference showed. ``checked_to`` is
    ``None`` when that step made it (every result is compared at its step, and the state
    after every state-changing step unless ``check_every`` says otherwise); otherwise the
    state was compared less often and agreed last after step ``checked_to``: any step
    after it may have made the difference (:func:`replay` replays once more, comparing
    after every step up to ``step``, to name it, where it can)."""

    def __init__(
        self, step: int, op: str, difference: str, *, checked_to: int | None = None
    ) -> None:
        since = "" if checked_to is None else f" (the state agreed last after step {checked_to})"
        super().__init__(f"step {step} ({op}): {difference}{since}")
        self.step = step
        self.op = op
        self.difference = difference
        self.checked_to = checked_to


class OpLogError(ImqError, ValueError):
    """The op log is not one (a malformed line or step): the message names the file or
    the step; check the log against docs/replay-format.md."""


class _ClosedModel:
    """The model while the log's queue is closed: every call raises QueueClosedError, as
    the closed queue's do."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def closed(*args: object, **kwargs: object) -> Any:
            raise QueueClosedError("the queue is closed")

        return closed


_CLOSED_MODEL: Any = _ClosedModel()


@dataclass(frozen=True)
class ReplayReport:
    steps: int
    checks: int  # state comparisons
    check_every: int = 1  # the state compared after every this many state-changing steps


def _as_path(name: str, value: object) -> Path:
    if not isinstance(value, str | os.PathLike):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {type(value).__name__}")
    return Path(value)


# What the replay reads of each op's arguments (docs/replay-format.md, "Operations"): a
# decoder per argument, strict about JSON types (codec.py).
_Decode = Callable[[Any], object]


def _each(decode: _Decode) -> _Decode:
    def check(values: Any) -> object:
        if not isinstance(values, list):
            raise TypeError(f"expected an array, got {c.json_kind(values)}")
        return [decode(v) for v in values]

    return check


def _int(what: str) -> _Decode:
    return lambda v: c.dec_int(v, what)


def _zone(v: Any) -> DiffZone:  # a query's zone: never null
    zone = c.dec_zone(v)
    if zone is None:
        raise TypeError(f"expected one of {', '.join(DiffZone.__members__)}, got null")
    return zone


def _block_id(v: Any) -> BlockId:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {c.json_kind(v)}")
    return BlockId.parse(v)


_DIFF_ARGS: dict[str, _Decode] = {
    "block": c.dec_block,
    "diff": c.dec_diff,
    "hash": c.dec_hash,
    "statistics": c.dec_statistics,
    "check_sequence": c.dec_zone,
}
_ARGS: dict[str, dict[str, _Decode]] = {
    "open": {},
    "close": {},
    "kill": {},
    "prepare_diff": _DIFF_ARGS,
    "apply_diff": _DIFF_ARGS,
    "write": {"pending": _int("pending")},
    "discard": {"pending": _int("pending")},
    "commit_diff": {"top_blocks": _each(c.dec_top), "partitions": c.dec_partitions},
    "clear_uncommitted_state": {"partitions": c.dec_partitions, "top_shards": _each(c.dec_shard)},
    "startup": {
        "last_applied_mc_block": _block_id,
        "top_shards": _each(c.dec_shard),
        "partitions": c.dec_partitions,
    },
    "iterate": {
        "partition": c.dec_partition,
        "ranges": _each(c.dec_range),
        "for_shard": c.dec_shard,
    },
    "run_gc": {},
    "get_commit_pointers": {},
    "get_last_committed_mc_block_id": {},
    "get_diff_info": {"shard": c.dec_shard, "seqno": _int("seqno"), "zone": _zone},
    "get_diffs_tail_len": {"shard": c.dec_shard, "from_key": c.dec_key},
    "get_last_applied_seqno": {"shard": c.dec_shard},
    "load_diff_statistics": {"partition": c.dec_partition, "range": c.dec_range},
}
# Ops on the pending diff of an earlier prepare (they need no open queue of their own).
_PENDING_OPS = {"write", "discard"}
# What a malformed value raises in a decoder (ArithmeticError: an overflow, say).
_BAD_VALUE = (ValueError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError)


def holds_arguments(op: str, args: dict[str, Any]) -> bool:
    """Whether a log line could hold these encoded arguments of ``op``: each one, written
    as JSON and read back, decodes as the format says (what :func:`read_log` checks)."""
    decoders = _ARGS.get(op)
    if decoders is None:
        return False
    try:
        read = json.loads(json.dumps(args))
        for name, decode in decoders.items():
            decode(read[name])
    except (*_BAD_VALUE, RecursionError):
        return False
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _check_step(line: dict[str, Any], where: str) -> None:
    """One step line holds what the replay reads: a known op, its arguments (each one
    decodable as the format says), and a result or an error with a type."""
    op = line.get("op")
    if not isinstance(op, str) or op not in _ARGS:
        raise OpLogError(
            f"{where}: unknown op {op!r} (the ops are listed in docs/replay-format.md)"
        )
    args = line.get("args", {})
    if not isinstance(args, dict):
        raise OpLogError(f'{where}: {op}: "args" is {c.json_kind(args)}, not an object')
    for name, decode in _ARGS[op].items():
        if name not in args:
            raise OpLogError(f"{where}: {op} without its argument {name!r}")
        try:
            decode(args[name])
        except _BAD_VALUE as exc:
            reason = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
            raise OpLogError(f"{where}: {op}: argument {name!r} is not valid ({reason})") from None
    error = line.get("error")
    if "error" in line:
        if not (isinstance(error, dict) and isinstance(error.get("type"), str)):
            raise OpLogError(f'{where}: {op}: "error" must be an object with a "type" string')
    elif op == "iterate":  # the replay takes as many messages as the log's iterator did
        result = line.get("result")
        if not (
            isinstance(result, dict)
            and isinstance(result.get("messages"), list)
            and isinstance(result.get("exhausted"), bool)
        ):
            raise OpLogError(
                f'{where}: iterate: "result" must be an object with a "messages" array and '
                'an "exhausted" boolean'
            )


def _parse(path: Path, number: int, raw: bytes) -> Any:
    where = f"op log {path} line {number}"
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise OpLogError(f"{where}: not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise OpLogError(f"{where}: not JSON: {exc.msg} (column {exc.colno})") from None
    except RecursionError:
        raise OpLogError(f"{where}: JSON nested too deeply to read") from None
    except ValueError as exc:  # NaN, or an integer of more digits than Python reads
        reason = str(exc)
        if "integer string conversion" in reason:  # its hint (a process-wide limit) is not ours
            reason = f"an integer of more than {sys.get_int_max_str_digits()} digits"
        raise OpLogError(f"{where}: not JSON the replay can read ({reason})") from None


@dataclass(frozen=True, slots=True)
class _Line:
    """A step as the check found it. The line itself is read again when its step
    replays (``offset``/``size``, its bytes' CRC-32 ``crc``), or kept (``held``) when the
    log cannot be read twice (a pipe)."""

    number: int  # in the file, from 1 (the header)
    step: int
    op: str
    token: int | None  # write/discard: the pending diff named; prepare_diff: the one returned
    offset: int
    size: int
    crc: int
    held: dict[str, Any] | None


class _Log:
    """An op log checked whole (its header and its steps in step order), open until
    closed: the replay reads each step's line again from the file, so that a log is never
    held in memory whole (a pipe's is: it cannot be read twice)."""

    def __init__(
        self,
        path: Path,
        checking: Callable[[int, int], object] | None = None,
        *,
        keep: bool = False,
    ) -> None:
        self.path = path
        self._keep = keep  # hold every line from the check on (read_log returns them all)
        try:
            self._file: BinaryIO = path.open("rb")
        except OSError as exc:
            raise FileAccessError(path, "read the op log", exc) from exc
        try:
            self.header, self.lines = self._check(checking)
        except BaseException:
            self._file.close()
            raise

    def __enter__(self) -> _Log:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def line(self, s: _Line) -> dict[str, Any]:
        """The step's line as checked; OpLogError if the file changed since."""
        if s.held is not None:
            return s.held
        try:
            self._file.seek(s.offset)
            raw = self._file.read(s.size)
        except OSError as exc:
            raise FileAccessError(self.path, "read the op log", exc) from exc
        if len(raw) != s.size or zlib.crc32(raw) != s.crc:
            raise OpLogError(
                f"op log {self.path} line {s.number} (step {s.step}, {s.op}) changed after "
                "the replay checked it: the file was written meanwhile; replay a log that "
                "no process is writing (copy it first)"
            )
        line: dict[str, Any] = _parse(self.path, s.number, raw)
        return line

    def _check(
        self, checking: Callable[[int, int], object] | None
    ) -> tuple[dict[str, Any], list[_Line]]:
        """The header and the steps in step order; :class:`OpLogError` naming the file
        and the line for anything the replay cannot use (the list is in
        docs/replay-format.md)."""
        path, f = self.path, self._file
        # A pipe's lines are kept (it cannot be read twice), and all when asked for.
        again = f.seekable() and not self._keep
        try:
            total = os.fstat(f.fileno()).st_size if again else 0
            raws = iter(f)
            first = next(raws, b"")
        except OSError as exc:
            raise FileAccessError(path, "read the op log", exc) from exc
        if not first:
            raise OpLogError(f"op log {path} is empty")
        header = _header(path, first)
        lines: list[_Line] = []
        seen: dict[int, int] = {}
        offset = len(first)
        number = 1
        try:
            for raw in raws:
                number += 1
                start, offset = offset, offset + len(raw)
                if checking is not None and number % _CHECK_EVERY == 0:
                    checking(offset, total)
                if not raw.strip():
                    continue
                line = _parse(path, number, raw)
                where = f"op log {path} line {number}"
                if not isinstance(line, dict):
                    raise OpLogError(f"{where}: {c.json_kind(line)}, not an object")
                step = line.get("step")
                if type(step) is not int:
                    raise OpLogError(f'{where}: a step without an integer "step"')
                if step in seen:
                    raise OpLogError(f"{where}: step {step} again (first on line {seen[step]})")
                seen[step] = number
                _check_step(line, where)
                op: str = line["op"]
                lines.append(
                    _Line(
                        number,
                        step,
                        op,
                        _token(op, line),
                        start,
                        len(raw),
                        zlib.crc32(raw),
                        None if again else line,
                    )
                )
        except OSError as exc:
            raise FileAccessError(path, "read the op log", exc) from exc
        if not lines:
            raise OpLogError(
                f"op log {path} holds no step, only its header: there is nothing to replay"
            )
        lines.sort(key=lambda s: s.step)
        _check_numbers(path, lines)
        _check_order(path, lines)
        return header, lines


def _header(path: Path, raw: bytes) -> dict[str, Any]:
    """The log's first line, checked."""
    header = _parse(path, 1, raw)
    where = f"op log {path} line 1"
    if not isinstance(header, dict):
        raise OpLogError(f"{where}: {c.json_kind(header)}, not an op log header (an object)")
    version = header.get("imq_ops")
    if type(version) is not int or version != c.FORMAT_VERSION:
        raise OpLogError(
            f"{where}: not an op log header of version {c.FORMAT_VERSION} "
            f'("imq_ops": {json.dumps(version)}); this imq reads version '
            f"{c.FORMAT_VERSION} only"
        )
    zerostate = header.get("zerostate_seqno", 0)
    if type(zerostate) is not int or not 0 <= zerostate <= U32_MAX:
        raise OpLogError(f'{where}: "zerostate_seqno" is not a seqno (an integer in 0..2^32-1)')
    return header


_CHECK_EVERY = 256  # lines between two calls of the check's progress callback


def _token(op: str, line: dict[str, Any]) -> int | None:
    """The pending diff a step names (checked by _check_step) or returns."""
    if op in _PENDING_OPS:
        token: int = line["args"]["pending"]
        return token
    if op == "prepare_diff":
        result = line.get("result")
        if isinstance(result, dict) and type(result.get("pending")) is int:
            returned: int = result["pending"]
            return returned
    return None


def _check_numbers(path: Path, lines: list[_Line]) -> None:
    """Steps 1, 2, 3, ... without a gap: the recorder writes every number it takes (an
    iterator's at the latest when its queue closes), so a missing one is a step cut out
    of the log, and a replay without it would vouch for a history that did not happen."""
    for expected, s in enumerate(lines, start=1):
        if s.step == expected:
            continue
        where = f"op log {path} line {s.number} (step {s.step}, {s.op})"
        if expected == 1:
            raise OpLogError(f"{where}: the first step is {s.step}; steps are numbered from 1")
        missing = (
            f"step {expected}" if s.step == expected + 1 else f"steps {expected}..{s.step - 1}"
        )
        raise OpLogError(
            f"{where}: {missing} missing before it: the log was cut or edited (the "
            "recorder writes every step it numbers), and a replay without a step cannot "
            "vouch for the steps after it; replay the complete log"
        )


def _check_order(path: Path, lines: list[_Line]) -> None:
    """In step order (the replay's): no queue call before the first open, no second open
    before a close (a replay has one queue), and pending diffs only from an earlier
    prepare. Calls after a close are fine: they replay to the host's QueueClosedError."""
    state = "never opened"
    pending: set[int] = set()
    for s in lines:
        op = s.op
        where = f"op log {path} line {s.number} (step {s.step}, {op})"
        if op == "open":
            if state == "open":
                raise OpLogError(
                    f"{where}: the queue is opened again without a close; a replay "
                    "replays one queue at a time"
                )
            state = "open"
        elif op in ("close", "kill"):
            if state == "open":
                state = "closed"
        elif op in _PENDING_OPS:
            token = s.token
            if token not in pending:
                raise OpLogError(
                    f"{where}: pending diff {token} was not returned by an earlier prepare_diff"
                )
        elif state == "never opened":
            raise OpLogError(f"{where}: a queue call before the log opens its queue")
        elif op == "prepare_diff" and s.token is not None:
            pending.add(s.token)


def read_log(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and the step lines, in step order, of a log the replay can use; else
    :class:`OpLogError` naming the file and the line (``FileAccessError``: unreadable)."""
    with _Log(_as_path("the op log's path", path), keep=True) as log:
        return log.header, [log.line(s) for s in log.lines]


def check_log(path: str | os.PathLike[str]) -> int:
    """Check the whole log as :func:`replay` does before replaying it (every line, every
    argument, the step numbers and their order); returns the number of steps."""
    with _Log(_as_path("the op log's path", path)) as log:
        return len(log.lines)


def _outcome(fn: Any, enc: Any) -> dict[str, Any]:
    try:
        value = fn()
    except Exception as exc:
        return {"error": type(exc).__name__}
    return {"result": enc(value)}


def _recorded(line: dict[str, Any]) -> dict[str, Any]:
    if "error" in line:
        return {"error": line["error"]["type"]}
    return {"result": line.get("result")}


def _diff_input(args: dict[str, Any]) -> tuple[QueueDiff, Any, DiffInput]:
    diff = c.dec_diff(args["diff"])
    block = c.dec_block(args["block"])
    stats = c.dec_statistics(args["statistics"])
    router: PartitionRouter = diff.router
    src = {a: p for p, addrs in router.src_partitions().items() for a in addrs}
    dst = {a: p for p, addrs in router.dst_partitions().items() for a in addrs}
    model_input = DiffInput(
        block=block,
        diff_hash=c.dec_hash(args["hash"]),
        messages=diff.messages,
        processed_to=dict(diff.processed_to),
        router_src=src,
        router_dst=dst,
        prev_hash=diff.prev_hash,
        bounds=diff.bounds if stats is None else (stats.min_message, stats.max_message),
        given_statistics=None
        if stats is None
        else {p: dict(counts) for p, counts in stats.partitions.items()},
    )
    return diff, stats, model_input


Opener = Callable[[QueueConfig, int], Queue]  # (config, zerostate seqno) -> an open queue


class _Replayer:
    def __init__(
        self,
        db: Path,
        zerostate_seqno: int,
        opener: Opener | None = None,
        check_every: int = 1,
    ) -> None:
        self.db = db
        self.zerostate = zerostate_seqno
        self.opener: Opener = opener or (
            lambda config, zerostate: Queue.open(self.db, config, zerostate_seqno=zerostate)
        )
        self.model = QueueModel(zerostate_seqno)
        self.queue: Queue | None = None
        self.closed: Queue | None = None  # the last queue the log closed
        self.real_pending: dict[int, Any] = {}
        self.model_pending: dict[int, DiffInput] = {}
        self.shards: set[ShardIdent] = set()
        self.checks = 0
        # The state is compared after every ``check_every``-th state-changing step, before
        # the log closes the queue and at the log's end: ``unchecked`` steps since the last
        # comparison, the last of them ``last_change`` (step, op), the state agreeing
        # after step ``agreed`` (0: before the first step).
        self.check_every = check_every
        self.unchecked = 0
        self.last_change: tuple[int, str] = (0, "")
        self.agreed = 0
        # The recorded queue's checks that make an apply fail (logged with "open")
        self.check_sources = False
        self.check_statistics = False

    def q(self) -> Queue:
        """The open queue, or the one the log closed last (its calls raise
        QueueClosedError, as the host's did)."""
        queue = self.queue if self.queue is not None else self.closed
        if queue is None:
            raise OpLogError("the log uses the queue before opening it")
        return queue

    def m(self) -> QueueModel:
        """The model, or while the log's queue is closed one that answers QueueClosedError."""
        return self.model if self.queue is not None else _CLOSED_MODEL

    def step(self, line: dict[str, Any]) -> None:
        op, args, step = line["op"], line.get("args", {}), line["step"]
        self._line = line
        if op in _CLOSING and self.unchecked:  # compare what the steps before it left
            self.check_state()
        real, model = self._run(op, args)
        recorded = _recorded(line)
        # A result that differs after unchecked state changes may follow from one of them.
        since = self.agreed if self.unchecked else None
        if real != recorded or _json(real) != _json(recorded):
            raise ReplayDivergenceError(
                step,
                op,
                f"the log says {_short(recorded)}, the queue now {_short(real)}",
                checked_to=since,
            )
        if model != real:
            raise ReplayDivergenceError(
                step,
                op,
                f"the queue gives {_short(real)}, the model {_short(model)}",
                checked_to=since,
            )
        if op in MUTATING and self.queue is not None and "error" not in real:
            self.unchecked += 1
            self.last_change = (step, op)
            if self.unchecked >= self.check_every:
                self.check_state()

    def check_state(self) -> None:
        """Compare the queue's observable state with the model's (the queue open), as it
        is after ``last_change``; raise at the first difference."""
        step, op = self.last_change
        difference = self._compare_state()
        # Exact where one state-changing step ran since the state last agreed.
        checked_to = None if self.unchecked <= 1 else self.agreed
        self.unchecked = 0
        if difference is not None:
            raise ReplayDivergenceError(step, op, difference, checked_to=checked_to)
        self.agreed = step

    def _refused(self, diff: QueueDiff, inp: DiffInput, stats: DiffStatistics | None) -> bool:
        """The queue's refusals of a diff on the model's side, in the queue's order: its
        values first (a hash of another length, statistics of another shard or
        partition, the recorded config's checks), then a prepare of a shard whose
        pending diff this log holds; else False."""
        shard = inp.block.shard
        if len(inp.diff_hash) != HASH_LEN:
            raise ValueError(f"{inp.block}: diff_hash must be {HASH_LEN} bytes")
        if stats is not None:
            if stats.shard != shard:
                raise ValueError(f"statistics are for shard {stats.shard}, the block {shard}")
            check_partitions(stats.partitions)
        if self.check_sources and not all(shard.contains(m.src) for m in diff.messages):
            raise ValueError(f"{inp.block}: a message source outside the shard")
        if self.check_statistics and stats is not None:  # of this shard: checked above
            counted = DiffStatistics.from_diff(diff, shard, stats.min_message, stats.max_message)
            first, last = diff.min_message, diff.max_message
            if stats != counted or (
                first is not None
                and last is not None
                and not stats.min_message <= first <= last <= stats.max_message
            ):
                raise ValueError(f"{inp.block}: statistics contradict the messages")
        if any(d.block.shard == shard for d in self.model_pending.values()):
            raise ImqError(f"{inp.block}: the shard's pending diff is not written or discarded")
        return False

    def _guarded(self, partitions: Iterable[int], model: Callable[[], Any]) -> Callable[[], Any]:
        """``model`` behind the queue's checks of a call that writes: its partitions
        (``ValueError``), then a pending diff the log holds unwritten (``ImqError``: the
        queue refuses what would deadlock on it)."""

        def checked() -> Any:
            check_partitions(partitions)
            if self.model_pending:
                raise ImqError("a pending diff is neither written nor discarded")
            return model()

        return checked

    def _both(
        self, real: Any, model: Any, enc: Any = lambda v: v
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        return _outcome(real, enc), _outcome(model, enc)

    def _run(self, op: str, a: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:  # noqa: PLR0915 - one branch per op
        m = self.m()
        none = _outcome(lambda: None, lambda v: v)
        if op == "open":
            for name, value in a.items():  # a typo must not turn a check off unseen
                if name not in c.OPEN_CHECKS or value is not True:
                    raise OpLogError(
                        f"open: unknown argument {name}={json.dumps(value)} (open takes "
                        'only "check_sources": true and "check_statistics": true)'
                    )
            self.check_sources = "check_sources" in a
            self.check_statistics = "check_statistics" in a
            config = QueueConfig(
                gc_enabled=False,
                sync_commits=False,
                check_sources=self.check_sources,
                check_statistics=self.check_statistics,
            )
            if self.queue is not None:  # the host opened a second queue: refused here
                raise OpLogError("the log opens a queue while one is open; a replay has one")
            self.queue = self.opener(config, self.zerostate)
            self.closed = None
            return none, none
        if op in ("close", "kill"):
            if self.queue is None:  # closing a closed queue is a no-op
                return none, none
            # The model's staged diffs die with the queue; the real pending diffs are
            # kept, so that a write or discard the host tried after the close replays
            # to what it got then (QueueClosedError).
            self.model_pending.clear()
            self.queue.close()
            self.closed, self.queue = self.queue, None
            return none, none
        if op in ("prepare_diff", "apply_diff"):
            diff, stats, inp = _diff_input(a)
            self.shards.add(inp.block.shard)
            zone = c.dec_zone(a["check_sequence"])
            if op == "apply_diff":
                return self._both(
                    lambda: self.q().apply_diff(diff, inp.block, inp.diff_hash, stats, zone),
                    lambda: self._refused(diff, inp, stats) or m.apply(inp, zone),
                )
            real = _outcome(
                lambda: self.q().prepare_diff(diff, inp.block, inp.diff_hash, stats, zone),
                lambda p: p,
            )
            modeled = _outcome(
                lambda: self._refused(diff, inp, stats) or m.check_diff(inp, zone), lambda ok: ok
            )
            if "error" in real:
                return real, modeled
            pending = real["result"]
            if pending is None:
                if "error" in modeled:  # the queue took it for applied, the model refuses it
                    return {"result": None}, modeled
                return {"result": None}, {
                    "result": None if modeled["result"] is False else "written"
                }
            self._token += 1
            token = self._token
            self.real_pending[token] = pending
            self.model_pending[token] = inp
            return {"result": {"pending": token}}, (
                {"result": {"pending": token}} if modeled.get("result") is True else modeled
            )
        if op in ("write", "discard"):
            token = c.dec_int(a["pending"])
            pending = self.real_pending.get(token)
            if pending is None:
                raise OpLogError(f"pending diff {token} was not returned by a prepare_diff")
            staged = self.model_pending.pop(token, None)  # None: already written or discarded
            real = _outcome(pending.write if op == "write" else pending.discard, lambda v: None)
            if op == "write" and "error" not in real and staged is not None:
                m._write(staged)
            # The model has no pending diffs: using one twice is the PendingDiff's own
            # check (ImqError), so the model agrees with whatever the queue says.
            return real, real
        if op == "commit_diff":
            tops = [c.dec_top(t) for t in a["top_blocks"]]
            parts = c.dec_partitions(a["partitions"])
            return self._both(
                lambda: self.q().commit_diff(tops, parts),
                self._guarded(parts, lambda: m.commit(tops, parts)),
            )
        if op == "clear_uncommitted_state":
            parts = c.dec_partitions(a["partitions"])
            shards = [c.dec_shard(s) for s in a["top_shards"]]
            self.shards.update(shards)
            return self._both(
                lambda: self.q().clear_uncommitted_state(parts, shards),
                self._guarded(parts, lambda: m.clear(parts, shards)),
            )
        if op == "startup":
            block = _block_id(a["last_applied_mc_block"])
            parts = c.dec_partitions(a["partitions"])
            shards = [c.dec_shard(s) for s in a["top_shards"]]
            self.shards.update(shards)
            return self._both(
                lambda: self.q().startup(block, shards, parts),
                self._guarded(parts, lambda: m.startup(block, shards, parts)),
            )
        if op == "run_gc":
            # refused while this thread holds a pending diff (it would deadlock on it)
            return self._both(lambda: self.q().run_gc(), self._guarded((), m.run_gc))
        if op == "iterate":
            return self._iterate(a)
        if op == "get_commit_pointers":
            return self._both(
                lambda: self.q().get_commit_pointers(), m.get_commit_pointers, c.enc_pointers
            )
        if op == "get_last_committed_mc_block_id":
            enc = lambda b: None if b is None else str(b)  # noqa: E731
            return self._both(
                lambda: self.q().get_last_committed_mc_block_id(),
                m.get_last_committed_mc_block_id,
                enc,
            )
        if op == "get_diff_info":
            shard, seqno = c.dec_shard(a["shard"]), c.dec_int(a["seqno"])
            zone = _zone(a["zone"])
            return self._both(
                lambda: self.q().get_diff_info(shard, seqno, zone),
                lambda: (check_u32("seqno", seqno), m.get_diff_info(shard, seqno, zone))[1],
                c.enc_diff_info,
            )
        if op == "get_diffs_tail_len":
            shard, key = c.dec_shard(a["shard"]), c.dec_key(a["from_key"])
            return self._both(
                lambda: self.q().get_diffs_tail_len(shard, key),
                lambda: m.get_diffs_tail_len(shard, key),
            )
        if op == "get_last_applied_seqno":
            shard = c.dec_shard(a["shard"])
            return self._both(
                lambda: self.q().get_last_applied_seqno(shard),
                lambda: m.get_last_applied_seqno(shard),
            )
        if op == "load_diff_statistics":
            r, p = c.dec_range(a["range"]), c.dec_partition(a["partition"])
            return self._both(
                lambda: self.q().load_diff_statistics(p, r),
                lambda: (check_partition(p), m.load_diff_statistics(p, r))[1],
                c.enc_stats_map,
            )
        raise OpLogError(f"unknown op {op!r} (the ops are listed in docs/replay-format.md)")

    _token = 0
    _line: dict[str, Any] = {}  # noqa: RUF012 - the line being replayed

    def _iterate(self, a: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        partition, for_shard = c.dec_partition(a["partition"]), c.dec_shard(a["for_shard"])
        ranges = [c.dec_range(r) for r in a["ranges"]]
        recorded = self._line.get("result") or {}
        want = None if recorded.get("exhausted", True) else len(recorded.get("messages", []))

        def run(it: Any, close: Callable[[], None]) -> dict[str, Any]:
            seen = []
            exhausted = False
            for _ in range(limit):
                try:
                    seen.append(c.enc_iterated(next(it)))
                except StopIteration:
                    exhausted = True
                    break
            close()  # the log holds the position once closed: what was consumed stays so
            position = {str(s): c.enc_key(k) for s, k in sorted(it.current_position().items())}
            return {"messages": seen, "exhausted": exhausted, "position": position}

        limit = 1 << 62 if want is None else want
        model = _outcome(
            lambda: run(self.m().iterator(partition, ranges, for_shard), lambda: None),
            lambda v: v,
        )
        try:
            real_it = self.q().iterator(partition, ranges, for_shard)
        except Exception as exc:  # a closed queue, say: as the model's
            return {"error": type(exc).__name__}, model
        try:
            real = _outcome(lambda: run(real_it, real_it.close), lambda v: v)
        finally:
            real_it.close()
        return real, model

    def _compare_state(self) -> str | None:
        self.checks += 1
        q, m = self.q(), self.model
        self.shards.update(m.pointers)
        self.shards.update(s for s, _ in m.diffs)
        pairs: list[tuple[str, Any, Any]] = [
            (
                "commit pointers",
                c.enc_pointers(q.get_commit_pointers()),
                c.enc_pointers(m.get_commit_pointers()),
            ),
            (
                "last committed block",
                q.get_last_committed_mc_block_id(),
                m.get_last_committed_mc_block_id(),
            ),
        ]
        full = [QueueShardRange(s, QueueKey.MIN, QueueKey.MAX) for s in sorted(self.shards)]
        for shard in sorted(self.shards):
            pairs.append(
                (
                    f"last applied seqno of {shard}",
                    q.get_last_applied_seqno(shard),
                    m.get_last_applied_seqno(shard),
                )
            )
            pairs.append(
                (
                    f"tail length of {shard}",
                    q.get_diffs_tail_len(shard, QueueKey.MIN),
                    m.get_diffs_tail_len(shard, QueueKey.MIN),
                )
            )
            for seqno in m.seqnos(shard):
                for zone in (DiffZone.BOTH, DiffZone.COMMITTED):
                    pairs.append(
                        (
                            f"diff {shard}:{seqno} in zone {zone.name}",
                            c.enc_diff_info(q.get_diff_info(shard, seqno, zone)),
                            c.enc_diff_info(m.get_diff_info(shard, seqno, zone)),
                        )
                    )
        for r in full:
            real_stats = q.load_separated_diff_statistics((0, 1), r)
            model_stats = m.load_separated_diff_statistics((0, 1), r)
            pairs.append(
                (
                    f"statistics of {r.shard}",
                    _enc_separated(real_stats),
                    _enc_separated(model_stats),
                )
            )
        for what, real, model in pairs:
            if real != model:
                return f"{what}: the queue has {_short(real)}, the model {_short(model)}"
        for partition in (0, 1):
            for for_shard in _FOR_SHARDS:
                with q.iterator(partition, full, for_shard) as it:
                    real_msgs = list(it)
                model_msgs = list(m.iterator(partition, full, for_shard))
                # The values compared as they are (tuples of ints, bytes and tuples, equal
                # exactly when their encodings are); encoded only to show a difference.
                if real_msgs != model_msgs:
                    real_enc = [c.enc_iterated(x) for x in real_msgs]
                    model_enc = [c.enc_iterated(x) for x in model_msgs]
                    return (
                        f"messages of partition {partition} for {for_shard}: the queue has "
                        f"{_short(real_enc)}, the model {_short(model_enc)}"
                    )
        return None


def _enc_separated(stats: dict[int, dict[QueueKey, Any]]) -> dict[int, Any]:
    return {
        p: {c.enc_key(k): c.enc_stats_map(v) for k, v in sorted(d.items())}
        for p, d in sorted(stats.items())
    }


def _json(value: Any) -> str:
    """The JSON text of an outcome: "exactly" includes the type (Python has false == 0
    and 1.0 == 1; the format does not)."""
    return json.dumps(value, sort_keys=True, default=str)


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 600 else text[:600] + "..."


def replay(
    path: str | os.PathLike[str],
    db: str | os.PathLike[str] | None = None,
    *,
    open_queue: Opener | None = None,
    checked: Callable[[int], object] | None = None,
    progress: Callable[[int, int], object] | None = None,
    checking: Callable[[int, int], object] | None = None,
    check_every: int = 1,
) -> ReplayReport:
    """Replay the log at ``path`` on a fresh database in ``db`` (a temporary directory if
    None; ``db`` must not hold a database) and on the model. Raises
    :class:`ReplayDivergenceError` at the first difference, and :class:`OpLogError` naming
    the file and the line, before replaying anything, for a log it cannot replay.

    The log is checked whole first, then each step's line is read again from the file as
    it replays, so that memory does not grow with the log (a pipe, which cannot be read
    twice, is held in memory). A file written to after the check fails its step's
    replay with :class:`OpLogError`. ``checking(bytes_read, file_size)`` is called while
    the check reads (the size is 0 for a pipe), ``checked(steps)`` once the log has
    passed, before the first step, and ``progress(done, total)`` every 256 steps while
    they replay.

    Every step's result is compared with the log's and the model's. The whole observable
    state (every stored diff, statistic and message) is compared after every
    state-changing step by default, which costs time in proportion to the state: most of
    a long log's replay. ``check_every=N`` compares it after every N-th such step, before
    each close of the queue and at the log's end instead. A difference found after
    unchecked state changes (by a comparison, or in a result that may follow from one of
    them) is then replayed once more on a fresh temporary database, the state compared
    after every step up to where it showed, so that the error names the step that made
    it, as with ``check_every=1`` (a difference that a later step undid before the next
    comparison, with no result showing it, goes unseen).

    ``open_queue(config, zerostate_seqno)``, when given, opens the queue instead (every
    ``open`` of the log calls it; it must reopen one database, e.g.
    :meth:`MemoryDatabase.open`), and ``db`` is not used; the error of a difference found
    after unchecked steps then gives the step after which the state agreed last
    (``checked_to``) instead of a second replay."""
    if type(check_every) is not int or check_every < 1:
        raise ValueError(f"check_every must be an int of at least 1, not {check_every!r}")
    with _Log(_as_path("the op log's path", path), checking) as log:
        if checked is not None:
            checked(len(log.lines))
        if open_queue is not None:
            return _replay(log, Path("unused"), open_queue, progress=progress, every=check_every)
        if db is None:
            with tempfile.TemporaryDirectory(prefix="imq-replay-") as tmp:
                return _pinpointed(log, Path(tmp) / "queue", progress, check_every)
        where = _as_path("db", db)
        if where.exists() and any(where.iterdir()):
            raise ValueError(f"{where} is not empty: a replay needs a fresh database")
        return _pinpointed(log, where, progress, check_every)


def _pinpointed(
    log: _Log, db: Path, progress: Callable[[int, int], object] | None, every: int
) -> ReplayReport:
    """:func:`_replay` on ``db``; a difference found after unchecked steps is replayed
    again on a temporary database, comparing after every step, to name its first step."""
    try:
        return _replay(log, db, progress=progress, every=every)
    except ReplayDivergenceError as found:
        if found.checked_to is None:
            raise
        first: ReplayDivergenceError | None = None
        with tempfile.TemporaryDirectory(prefix="imq-replay-") as tmp:
            try:
                _replay(log, Path(tmp) / "queue", progress=progress, until=found.step)
            except ReplayDivergenceError as exc:
                first = exc
        if first is None:  # not found again (a replay that does not repeat itself)
            raise
        raise first from found


def _replay(
    log: _Log,
    db: Path,
    opener: Opener | None = None,
    *,
    progress: Callable[[int, int], object] | None = None,
    every: int = 1,
    until: int | None = None,
) -> ReplayReport:
    """Replay ``log`` (up to and with step ``until``, when given), the state compared
    after every ``every`` state-changing steps, before each close and at the end."""
    lines = log.lines
    r = _Replayer(db, log.header.get("zerostate_seqno", 0), opener, every)
    try:
        for done, s in enumerate(lines):
            if progress is not None and done % 256 == 0:
                progress(done, len(lines))
            line = log.line(s)
            try:
                r.step(line)
            except (*_BAD_VALUE, RecursionError) as exc:  # OpLogError is a ValueError
                what = f"missing {exc}" if type(exc) is KeyError else str(exc)
                raise OpLogError(
                    f"op log {log.path} line {s.number} (step {s.step}, {s.op}): the log "
                    f"cannot be replayed: {what}; check it against docs/replay-format.md"
                ) from exc
            del line
            if s.step == until:
                break
        if r.unchecked:  # the steps since the last comparison (the queue is open)
            r.check_state()
    finally:
        if r.queue is not None:
            for token in r.model_pending:
                r.real_pending[token].discard()
            r.queue.close()
    return ReplayReport(steps=len(lines), checks=r.checks, check_every=every)


def assert_replays(
    path: str | os.PathLike[str], db: str | os.PathLike[str] | None = None
) -> ReplayReport:
    """For a user's test: ``assert_replays("tests/replays/x.jsonl")`` fails the test with
    the step, the op and the first difference."""
    return replay(path, db)


def iter_steps(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The step lines in step order, of a log checked whole first (as :func:`read_log`),
    each read again from the file as it is asked for."""
    with _Log(_as_path("the op log's path", path)) as log:
        for s in log.lines:
            yield log.line(s)
