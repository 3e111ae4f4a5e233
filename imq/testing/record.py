"""A recording wrapper around :class:`imq.Queue`: every call of the op log's format, its
arguments and what it returned (or raised), one JSON object per line
(``docs/replay-format.md``). Reads outside the format (``is_diff_exists``, the
separated statistics, ``export_state``) and ``compact`` pass through unrecorded: they
change nothing a replay compares. What would change the queue unrecorded is refused:
the background GC worker (open with ``gc_enabled=False`` and call ``run_gc()``) and
``import_state`` (a log holds no state file).

A host application wraps its queue to capture what a live collator did::

    log = OpLog(open("ops.jsonl", "w"))
    queue = log.open(Queue.open, path, config)   # records "open"
    ...                                          # use queue as a Queue
    queue.close()                                # records "close"

An iterator is written when it is closed (or exhausted), with the messages it yielded
and its position, under the step number of its creation: an iterator reads one
snapshot, so a replay runs it at that step, and a reader orders lines by step. One still
open when its queue is closed or killed is written then (the close ends it), and one
dropped unclosed when it is freed, so that every step number taken is written: a replay
refuses a log with a step missing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from imq import (
    BlockId,
    BlockIdShort,
    DiffInfo,
    DiffStatistics,
    DiffZone,
    IteratedMessage,
    QueueConfig,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    TopBlock,
)
from imq.errors import ConfigError, FileAccessError, ImqError
from imq.testing.codec import (
    FORMAT_VERSION,
    OPEN_CHECKS,
    enc_block,
    enc_diff,
    enc_diff_info,
    enc_iterated,
    enc_key,
    enc_pointers,
    enc_range,
    enc_statistics,
    enc_stats_map,
    enc_top,
    enc_zone,
)
from imq.testing.replay import holds_arguments

__all__ = [
    "OpLog",
    "RecordingIterator",
    "RecordingPending",
    "RecordingQueue",
    "UnrecordableCallError",
]


class OpLog:
    """The sink of one recording: a header line, then one line per operation."""

    def __init__(self, sink: TextIO, *, zerostate_seqno: int = 0) -> None:
        self._sink = sink
        self._zerostate_seqno = zerostate_seqno
        self._step = 0
        self._pending = 0
        self._write({"imq_ops": FORMAT_VERSION, "zerostate_seqno": zerostate_seqno})

    def _write(self, obj: dict[str, Any]) -> None:
        text = json.dumps(obj, separators=(",", ":")) + "\n"
        try:
            self._sink.write(text)
        except FileAccessError:
            raise  # the sink named itself (the CLI's file does)
        except OSError as exc:
            raise self._sink_error(exc) from exc
        except ValueError as exc:  # a closed file's "I/O operation on closed file"
            if not getattr(self._sink, "closed", False):
                raise
            raise self._sink_error(
                OSError(errno.EBADF, "the sink is closed"),
                "keep the op log's file open until the recorded queue is closed",
            ) from exc

    def _sink_error(self, exc: OSError, hint: str = "") -> FileAccessError:
        name = getattr(self._sink, "name", None)
        where = name if isinstance(name, str) and name else "its sink"
        return FileAccessError(where, "write the op log to", exc, hint)

    def reserve_step(self) -> int:
        """Take the next step number now for a line written later (an iterator's)."""
        self._step += 1
        return self._step

    def record(
        self,
        op: str,
        args: dict[str, Any],
        result: Any = None,
        error: BaseException | None = None,
        *,
        step: int | None = None,
    ) -> None:
        if step is None:
            step = self.reserve_step()
        line: dict[str, Any] = {"step": step, "op": op, "args": args}
        if error is not None:
            line["error"] = {"type": type(error).__name__, "message": str(error)}
        else:
            line["result"] = result
        self._write(line)

    def next_pending(self) -> int:
        self._pending += 1
        return self._pending

    def call(
        self,
        op: str,
        args: dict[str, Any] | Callable[[], dict[str, Any]],
        fn: Callable[[], Any],
        enc: Callable[[Any], Any],
    ) -> Any:
        """Make the call ``fn`` and log it: ``args`` (or what the callable gives: it is
        asked before the call) and what the call returned, through ``enc``, or raised.

        A call the queue refuses for arguments no log line can hold (a value of another
        type, a boolean or a string where an integer belongs, a partition out of range)
        is not logged: it changed nothing, and no replay could make it. The caller gets
        the queue's own error, as from a bare queue."""
        try:
            encoded: dict[str, Any] | None = args() if callable(args) else args
        except Exception:  # what the encoders cannot take, the queue refuses
            encoded = None
        try:
            value = fn()
        except Exception as exc:
            if encoded is not None and holds_arguments(op, encoded):
                self.record(op, encoded, error=exc)
            raise
        if encoded is None:
            raise UnrecordableCallError(
                f"{op} took effect on the queue all the same (do not repeat it), but the "
                "op log cannot hold its arguments, so the log will not replay: report it "
                "as a bug of imq's recorder"
            )
        step = self._step + 1
        try:
            self.record(op, encoded, enc(value))
        except FileAccessError as exc:
            # Raised for a call that took effect: say so, or the caller takes it for
            # failed (and a collator would, say, apply the diff again).
            raise exc.noting(
                f"{op} took effect on the queue all the same (do not repeat it), but the "
                f"op log lacks its line (step {step}), so the log will not replay"
            ) from exc
        return value

    def open(
        self, opener: Callable[[Path, QueueConfig], Any], path: Path, config: QueueConfig
    ) -> RecordingQueue:
        """Open a queue with ``opener`` and record it. The path is not logged (a replay
        opens a fresh database of its own), nor the config but for the checks that make
        a call fail (``check_sources``, ``check_statistics``), which the replay's queue
        then runs too. A config with the background GC worker is refused: its passes
        happen between the recorded calls, so no replay could repeat them."""
        if config.gc_enabled:
            raise ConfigError(
                "a recorded queue cannot run the background GC worker (its passes are not "
                "calls the log can hold, so the log would not replay): open it with "
                "QueueConfig(gc_enabled=False) and call run_gc() where a pass should run, "
                "as imq simulate --record does"
            )
        args = {name: True for name in OPEN_CHECKS if getattr(config, name)}
        # An open that failed opened nothing a replay could repeat (the replay's own open
        # would succeed): it is not logged.
        queue = opener(path, config)
        opened_with = getattr(queue, "zerostate_seqno", self._zerostate_seqno)
        if opened_with != self._zerostate_seqno:  # a replay would open with the header's
            queue.close()
            raise ConfigError(
                f"the queue was opened with zerostate_seqno={opened_with}, the op log's "
                f"header says {self._zerostate_seqno}: create the log with "
                f"OpLog(sink, zerostate_seqno={opened_with})"
            )
        self.record("open", args, None)
        return RecordingQueue(queue, self)

    def flush(self) -> None:
        try:
            self._sink.flush()
        except FileAccessError:
            raise
        except OSError as exc:
            raise self._sink_error(exc) from exc


class UnrecordableCallError(ImqError, TypeError):
    """A call on a :class:`RecordingQueue` that the op log cannot hold."""


def _same(value: Any) -> Any:
    return value


class RecordingPending:
    def __init__(self, inner: Any, log: OpLog, token: int) -> None:
        self._inner = inner
        self._log = log
        self.token = token
        self._finished = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write(self) -> None:
        self._finished = True  # logged either way: a failed write is a step too
        self._log.call("write", {"pending": self.token}, self._inner.write, _same)

    def discard(self) -> None:
        self._finished = True
        self._log.call("discard", {"pending": self.token}, self._inner.discard, _same)

    def __del__(self) -> None:
        """Dropped unwritten: the queue frees the pending diff (``pending_diff_dropped``)
        as a discard does, so the log says ``discard`` here (without it a replay would
        hold the diff and refuse the shard's next prepare)."""
        if getattr(self, "_finished", True):
            return
        self._finished = True
        with contextlib.suppress(Exception):  # never raise from a finalizer
            self._log.record("discard", {"pending": self.token}, None)

    def __enter__(self) -> RecordingPending:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._finished:
            self.discard()


class RecordingIterator:
    """Yields what the real iterator yields; logs the op once, at close or exhaustion."""

    def __init__(self, inner: Any, log: OpLog, args: dict[str, Any]) -> None:
        self._inner = inner
        self._log = log
        self._args = args
        self._seen: list[IteratedMessage] = []  # encoded when the line is written
        self._done = False
        self._step = log.reserve_step()

    def __iter__(self) -> Iterator[IteratedMessage]:
        return self

    def __next__(self) -> IteratedMessage:
        # The message must be in _seen once the inner iterator has moved past it, or the
        # logged position is one message past the logged messages (a replay then reports
        # a false divergence). CPython raises a KeyboardInterrupt where it checks for
        # signals: when a call such as next() has returned, before its value is stored,
        # and when a Python function starts; not when a for loop pulls. So the pull is a
        # for loop's, and the first call after it is the append (the message is encoded
        # only when the line is written): an interrupt lands before the pull or after
        # the append.
        for item in self._inner:
            self._seen.append(item)
            return item  # type: ignore[no-any-return]
        self._finish(exhausted=True)
        raise StopIteration

    def current_position(self) -> dict[ShardIdent, QueueKey]:
        position: dict[ShardIdent, QueueKey] = self._inner.current_position()
        return position

    def _finish(self, *, exhausted: bool) -> None:
        if self._done:
            return
        self._done = True
        position = {str(s): enc_key(k) for s, k in sorted(self.current_position().items())}
        messages = [enc_iterated(item) for item in self._seen]
        result = {"messages": messages, "exhausted": exhausted, "position": position}
        self._log.record("iterate", self._args, result, step=self._step)

    def close(self) -> None:
        # The position once closed (a replay reads it there too): what the iterator
        # consumed stays consumed, whether it or its queue was closed first.
        self._inner.close()
        self._finish(exhausted=False)

    def __del__(self) -> None:
        # Dropped unclosed: written now, or its step number would be missing from the log.
        # Nothing may escape a finalizer; if the sink is gone, the line is lost (and a
        # replay refuses the log, rather than replaying it without the step).
        if not self._done:
            with contextlib.suppress(Exception):  # nowhere to report it from here
                self.close()

    def __enter__(self) -> RecordingIterator:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _parts(partitions: Iterable[int]) -> list[int]:
    return sorted(set(partitions))


def _listed(values: Any) -> Any:
    """An iterable argument as a list (a generator is read once, for the log and the
    queue alike); anything else as it is, for the queue to refuse with its own words."""
    if isinstance(values, Iterable) and not isinstance(values, str | bytes | Mapping):
        return list(values)
    return values


def _shard(shard: ShardIdent) -> str:
    """A shard's log form; another type cannot be logged (the queue refuses it)."""
    if not isinstance(shard, ShardIdent):
        raise TypeError(f"not a ShardIdent: {type(shard).__name__}")
    return str(shard)


def _block_id(block: BlockId) -> str:
    if not isinstance(block, BlockId):
        raise TypeError(f"not a BlockId: {type(block).__name__}")
    return str(block)


class RecordingQueue:
    """A queue whose calls are recorded. What is not listed here is forwarded as is: the
    reads outside the log's format and ``compact``, which change nothing a replay
    compares."""

    def __init__(self, inner: Any, log: OpLog) -> None:
        self._inner = inner
        self._log = log
        # Iterators not closed yet: the queue's close ends them, and their lines are
        # written then (weak: a dropped iterator writes its line when freed).
        self._iterators: weakref.WeakSet[RecordingIterator] = weakref.WeakSet()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __enter__(self) -> RecordingQueue:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()  # recorded, as the queue's own ``with`` closes it

    @property
    def inner(self) -> Any:
        return self._inner

    @staticmethod
    def _diff_args(
        diff: QueueDiff,
        block: BlockIdShort,
        diff_hash: bytes,
        statistics: DiffStatistics | None,
        check_sequence: DiffZone | None,
    ) -> Callable[[], dict[str, Any]]:
        def encoded() -> dict[str, Any]:
            # The encoders take what merely looks right (a BlockId for the block, a
            # bytearray hash): what the queue refuses for its type must not be logged
            # as a value it takes, or the replay would make the call (an outside audit).
            if not isinstance(block, BlockIdShort) or not isinstance(diff_hash, bytes):
                raise TypeError("a block or hash of a type the queue refuses")
            return {
                "block": enc_block(block),
                "diff": enc_diff(diff),
                "hash": diff_hash.hex(),
                "statistics": enc_statistics(statistics),
                "check_sequence": enc_zone(check_sequence),
            }

        return encoded

    def prepare_diff(
        self,
        diff: QueueDiff,
        block: BlockIdShort,
        diff_hash: bytes,
        statistics: DiffStatistics | None = None,
        check_sequence: DiffZone | None = None,
    ) -> RecordingPending | None:
        args = self._diff_args(diff, block, diff_hash, statistics, check_sequence)
        pending = self._log.call(
            "prepare_diff",
            args,
            lambda: self._inner.prepare_diff(diff, block, diff_hash, statistics, check_sequence),
            lambda p: None if p is None else {"pending": self._log._pending + 1},
        )
        if pending is None:
            return None
        return RecordingPending(pending, self._log, self._log.next_pending())

    def apply_diff(
        self,
        diff: QueueDiff,
        block: BlockIdShort,
        diff_hash: bytes,
        statistics: DiffStatistics | None = None,
        check_sequence: DiffZone | None = None,
    ) -> bool:
        args = self._diff_args(diff, block, diff_hash, statistics, check_sequence)
        return bool(
            self._log.call(
                "apply_diff",
                args,
                lambda: self._inner.apply_diff(diff, block, diff_hash, statistics, check_sequence),
                bool,
            )
        )

    def commit_diff(
        self, top_blocks: Sequence[TopBlock], partitions: Iterable[int] = (0, 1)
    ) -> bool:
        tops, parts = _listed(top_blocks), _listed(partitions)

        def args() -> dict[str, Any]:
            return {"top_blocks": [enc_top(t) for t in tops], "partitions": _parts(parts)}

        return bool(
            self._log.call("commit_diff", args, lambda: self._inner.commit_diff(tops, parts), bool)
        )

    def clear_uncommitted_state(
        self, partitions: Iterable[int] = (0, 1), top_shards: Iterable[ShardIdent] = ()
    ) -> None:
        parts, shards = _listed(partitions), _listed(top_shards)

        def args() -> dict[str, Any]:
            return {"partitions": _parts(parts), "top_shards": [_shard(s) for s in shards]}

        self._log.call(
            "clear_uncommitted_state",
            args,
            lambda: self._inner.clear_uncommitted_state(parts, shards),
            lambda _: None,
        )

    def startup(
        self,
        last_applied_mc_block: BlockId,
        top_shards: Iterable[ShardIdent],
        partitions: Iterable[int] = (0, 1),
    ) -> None:
        shards, parts = _listed(top_shards), _listed(partitions)

        def args() -> dict[str, Any]:
            return {
                "last_applied_mc_block": _block_id(last_applied_mc_block),
                "top_shards": [_shard(s) for s in shards],
                "partitions": _parts(parts),
            }

        self._log.call(
            "startup",
            args,
            lambda: self._inner.startup(last_applied_mc_block, shards, parts),
            lambda _: None,
        )

    def iterator(
        self, partition: int, ranges: Sequence[QueueShardRange], for_shard: ShardIdent
    ) -> RecordingIterator:
        ranges = _listed(ranges)
        try:
            args = {
                "partition": partition,
                "ranges": [enc_range(r) for r in ranges],
                "for_shard": _shard(for_shard),
            }
        except Exception:  # what the encoders cannot take, the queue refuses
            args = None
        # One the queue refuses is not logged (it changed nothing), as in ``OpLog.call``.
        inner = self._inner.iterator(partition, ranges, for_shard)
        if args is None or not holds_arguments("iterate", args):
            inner.close()
            raise UnrecordableCallError(
                "the queue made an iterator of arguments the op log cannot hold: report "
                "it as a bug of imq's recorder"
            )
        it = RecordingIterator(inner, self._log, args)
        self._iterators.add(it)
        return it

    def get_commit_pointers(self) -> Any:
        return self._log.call(
            "get_commit_pointers", {}, self._inner.get_commit_pointers, enc_pointers
        )

    def get_last_committed_mc_block_id(self) -> BlockId | None:
        result: BlockId | None = self._log.call(
            "get_last_committed_mc_block_id",
            {},
            self._inner.get_last_committed_mc_block_id,
            lambda b: None if b is None else str(b),
        )
        return result

    def get_diff_info(
        self, shard: ShardIdent, seqno: int, zone: DiffZone = DiffZone.BOTH
    ) -> DiffInfo | None:
        result: DiffInfo | None = self._log.call(
            "get_diff_info",
            lambda: {"shard": _shard(shard), "seqno": seqno, "zone": zone.name},
            lambda: self._inner.get_diff_info(shard, seqno, zone),
            enc_diff_info,
        )
        return result

    def get_diffs_tail_len(self, shard: ShardIdent, from_key: QueueKey) -> int:
        return int(
            self._log.call(
                "get_diffs_tail_len",
                lambda: {"shard": _shard(shard), "from_key": enc_key(from_key)},
                lambda: self._inner.get_diffs_tail_len(shard, from_key),
                int,
            )
        )

    def get_last_applied_seqno(self, shard: ShardIdent) -> int | None:
        result: int | None = self._log.call(
            "get_last_applied_seqno",
            lambda: {"shard": _shard(shard)},
            lambda: self._inner.get_last_applied_seqno(shard),
            _same,
        )
        return result

    def load_diff_statistics(self, partition: int, range: QueueShardRange) -> Any:
        return self._log.call(
            "load_diff_statistics",
            lambda: {"partition": partition, "range": enc_range(range)},
            lambda: self._inner.load_diff_statistics(partition, range),
            enc_stats_map,
        )

    def run_gc(self) -> int:
        return int(self._log.call("run_gc", {}, self._inner.run_gc, int))

    def run_gc_report(self) -> Any:
        """A GC pass, recorded as ``run_gc`` (its result: the report's ``executed``)."""
        return self._log.call("run_gc", {}, self._inner.run_gc_report, lambda r: r.executed)

    def import_state(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: an import changes the queue by a state file the log cannot hold."""
        raise UnrecordableCallError(
            "import_state cannot be recorded (an op log holds no state file, so a replay "
            "could not repeat it): import on the bare queue (Queue.open, import_state) "
            "and record another session, or record from a new database"
        )

    def close(self) -> None:
        try:
            self._log.call("close", {}, self._inner.close, lambda _: None)
        finally:
            self._finish_iterators()
        self._log.flush()

    def kill(self) -> None:
        """Record a crash, then kill the inner queue (``kill()`` if it has one, else close)."""
        killer = getattr(self._inner, "kill", None)
        try:
            self._log.call(
                "kill", {}, killer if killer is not None else self._inner.close, lambda _: None
            )
        finally:
            self._finish_iterators()
        self._log.flush()

    def _finish_iterators(self) -> None:
        """Write the line of every iterator still open: the queue's close ended it (what
        it consumed stays consumed), so its messages and position are final."""
        for it in list(self._iterators):
            it.close()
