"""The queue in a child process, so a restart can be a real crash (``imq simulate --kill``).

:class:`ChildQueue` forwards every call the simulation makes to a :class:`imq.Queue`
opened in a child process, over a pipe. :meth:`ChildQueue.kill` sends SIGKILL: the
child dies with whatever it held (a prepared, unwritten diff included) and RocksDB
recovers from its write-ahead log at the next open. The kill happens between two calls
the parent chose, so a seeded run stays deterministic.

Iterators are materialised in the child: the parent gets the whole (bounded) range.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from types import TracebackType
from typing import Any

from imq import (
    BlockId,
    BlockIdShort,
    CommitPointer,
    DiffInfo,
    DiffStatistics,
    DiffZone,
    ImqError,
    IteratedMessage,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    TopBlock,
)

__all__ = ["ChildQueue", "ChildQueueError"]


class ChildQueueError(ImqError):
    """The child process died or answered something unexpected."""


def _serve(
    conn: Connection, path: str, config: QueueConfig, setup: Callable[[], None] | None
) -> None:
    # A terminal's Ctrl-C reaches the whole process group: the parent handles it (it
    # closes this process, or kills it as a crash); here it would only cut a call short.
    # The process started with SIGINT blocked (ChildQueue), so none was lost meanwhile.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if setup is not None:
        setup()
    try:
        queue = Queue.open(Path(path), config)
    except Exception as exc:
        # The first call's answer is the open's own error (the database locked by another
        # process, say), raised in the parent as it was raised here: not a traceback on
        # this process's stderr and "the queue process died" there.
        conn.recv()
        conn.send(("error", exc))
        return
    pending: dict[int, Any] = {}
    next_id = 0
    while True:
        op, args = conn.recv()
        try:
            if op == "prepare_diff":
                p = queue.prepare_diff(*args)
                if p is None:
                    result: Any = None
                else:
                    next_id += 1
                    pending[next_id] = p
                    result = next_id
            elif op == "write":
                pending.pop(args[0]).write()
                result = None
            elif op == "discard":
                pending.pop(args[0]).discard()
                result = None
            elif op == "iterator":
                with queue.iterator(*args) as it:
                    steps = [(item, it.current_position()) for item in it]
                    result = (steps, it.current_position())
            elif op == "close":
                queue.close()
                conn.send(("ok", None))
                return
            elif op == "counters":
                worker = queue.gc_worker
                result = (
                    queue.metrics.counter("messages_deleted"),
                    queue.metrics.counter("gc_ranges_deleted"),
                    worker.passes if worker is not None else 0,
                )
            else:
                result = getattr(queue, op)(*args)
        except Exception as exc:
            conn.send(("error", exc))
        else:
            conn.send(("ok", result))


Position = dict[ShardIdent, QueueKey]


class _ListIterator:
    """The child's iterator output: each message with the position after it, and the
    position once exhausted, so ``current_position`` answers as the real one does."""

    def __init__(self, steps: list[tuple[IteratedMessage, Position]], final: Position) -> None:
        self._steps = iter(steps)
        self._final = final
        self._position: Position = {}

    def __iter__(self) -> Iterator[IteratedMessage]:
        return self

    def __next__(self) -> IteratedMessage:
        try:
            item, self._position = next(self._steps)
        except StopIteration:
            self._position = self._final
            raise
        return item

    def current_position(self) -> Position:
        return dict(self._position)

    def close(self) -> None:
        self._steps = iter(())

    def __enter__(self) -> _ListIterator:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _ChildPending:
    def __init__(self, owner: ChildQueue, token: int) -> None:
        self._owner = owner
        self._token = token

    def write(self) -> None:
        self._owner._call("write", self._token)

    def discard(self) -> None:
        self._owner._call("discard", self._token)


class _Counters:
    """``metrics.counter`` and ``gc_worker.passes`` as the simulation reads them."""

    def __init__(self, values: tuple[int, int, int]) -> None:
        self._values = values

    def counter(self, name: str) -> int:
        return {"messages_deleted": self._values[0], "gc_ranges_deleted": self._values[1]}[name]


class ChildQueue:
    """A queue living in a child process; the methods the simulation uses."""

    def __init__(
        self, path: Path, config: QueueConfig, setup: Callable[[], None] | None = None
    ) -> None:
        """``setup`` (a module-level function) runs first in the child, e.g. to configure
        its logging the way the parent's command line did."""
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve,
            args=(child_conn, str(path), config, setup),
            name="imq-queue",
            daemon=True,
        )
        # Started with SIGINT blocked (a signal mask survives exec): a Ctrl-C while the
        # child's interpreter starts stays pending until it ignores SIGINT (_serve), where
        # it would kill the child mid-import with a traceback.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        child_conn.close()
        # A call cut short between sending and receiving (a Ctrl-C): its answer is still
        # in the pipe, where the next call would take it for its own.
        self._interrupted: str | None = None

    def _call(self, op: str, *args: Any) -> Any:
        if self._interrupted is not None:
            raise ChildQueueError(
                f"the call {self._interrupted} to the queue process was interrupted; its "
                "answer would be read as the next call's: the channel is closed"
            )
        try:
            self._conn.send((op, args))
            status, value = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            raise ChildQueueError(f"the queue process died during {op}") from exc
        except BaseException:
            self._interrupted = op
            raise
        if status == "error":
            raise value
        return value

    # -- what the simulation calls --------------------------------------------------------

    def prepare_diff(
        self,
        diff: QueueDiff,
        block: BlockIdShort,
        diff_hash: bytes,
        statistics: DiffStatistics | None = None,
        check_sequence: DiffZone | None = None,
    ) -> _ChildPending | None:
        token = self._call("prepare_diff", diff, block, diff_hash, statistics, check_sequence)
        return None if token is None else _ChildPending(self, token)

    def apply_diff(
        self,
        diff: QueueDiff,
        block: BlockIdShort,
        diff_hash: bytes,
        statistics: DiffStatistics | None = None,
        check_sequence: DiffZone | None = None,
    ) -> bool:
        return bool(self._call("apply_diff", diff, block, diff_hash, statistics, check_sequence))

    def get_diffs_tail_len(self, shard: ShardIdent, from_key: QueueKey) -> int:
        return int(self._call("get_diffs_tail_len", shard, from_key))

    def get_diff_info(
        self, shard: ShardIdent, seqno: int, zone: DiffZone = DiffZone.BOTH
    ) -> DiffInfo | None:
        result: DiffInfo | None = self._call("get_diff_info", shard, seqno, zone)
        return result

    def get_last_committed_mc_block_id(self) -> BlockId | None:
        result: BlockId | None = self._call("get_last_committed_mc_block_id")
        return result

    def export_state(self, shard: ShardIdent, seqno: int, tail_len: int, dest: Any) -> Any:
        """``dest`` must be a path (the child writes the file)."""
        return self._call("export_state", shard, seqno, tail_len, dest)

    def commit_diff(
        self, top_blocks: Sequence[TopBlock], partitions: Sequence[int] = (0, 1)
    ) -> bool:
        return bool(self._call("commit_diff", list(top_blocks), list(partitions)))

    def clear_uncommitted_state(
        self, partitions: Sequence[int] = (0, 1), top_shards: Sequence[ShardIdent] = ()
    ) -> None:
        self._call("clear_uncommitted_state", list(partitions), list(top_shards))

    def startup(
        self,
        last_applied_mc_block: BlockId,
        top_shards: Sequence[ShardIdent],
        partitions: Sequence[int] = (0, 1),
    ) -> None:
        self._call("startup", last_applied_mc_block, list(top_shards), list(partitions))

    def iterator(
        self, partition: int, ranges: Sequence[QueueShardRange], for_shard: ShardIdent
    ) -> _ListIterator:
        steps, final = self._call("iterator", partition, list(ranges), for_shard)
        return _ListIterator(steps, final)

    def get_commit_pointers(self) -> dict[ShardIdent, CommitPointer]:
        result: dict[ShardIdent, CommitPointer] = self._call("get_commit_pointers")
        return result

    def load_diff_statistics(self, partition: int, range: QueueShardRange) -> dict[Any, int]:
        result: dict[Any, int] = self._call("load_diff_statistics", partition, range)
        return result

    def run_gc(self) -> int:
        return int(self._call("run_gc"))

    def _counters(self) -> Any:
        """The child's GC counters; zeros once the channel is out of step (the report's
        totals are all they feed, and a Ctrl-C's run reports no totals)."""
        if self._interrupted is not None:
            return (0, 0, 0)
        return self._call("counters")

    @property
    def metrics(self) -> _Counters:
        self._last = self._counters()
        return _Counters(self._last)

    @property
    def gc_worker(self) -> Any:
        values = self._counters()

        class _Worker:
            passes = values[2]

        return _Worker()

    def close(self) -> None:
        if self._interrupted is not None:  # the channel is out of step: stop the child
            self._proc.kill()  # as a crash: what it acknowledged is on disk
        elif self._proc.is_alive():
            self._call("close")
        self._proc.join()
        self._conn.close()

    def kill(self) -> None:
        """SIGKILL the child: no close, no flush; whatever it held is gone."""
        self._proc.kill()
        self._proc.join()
        self._conn.close()
