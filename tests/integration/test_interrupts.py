"""A Ctrl-C (``KeyboardInterrupt``) that lands inside a queue call, in a host that
catches it and goes on (a REPL, a node whose signal handler unwinds the current call).

rocksdict holds the GIL through a write, so Python raises the interrupt at the first
bytecode after RocksDB took the batch: the disk has the write, the handle's memory (its
state, its cache of fresh rows) does not. An outside audit found the live queue then
serving 20 of 30 messages without an error, and forgetting a commit, so that the next
clear deleted a committed diff. Now the interrupted handle is dead: every later call
says so, and a reopen reads what the disk holds.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from builders import BASE, MC, Chain, full_range, open_queue, top
from threads import at_line

from imq import Queue, StorageError
from imq.locks import RWLock
from imq.pending import LockGuard, PendingRegistry
from imq.storage import rocks
from imq.verify import verify


class _SignalAfterWrite:
    """rocksdict's handle, whose ``write`` raises a signal (SIGINT unless told) right
    after RocksDB took the batch: the moment a real Ctrl-C during a write is handled."""

    def __init__(self, db: Any, signum: int = signal.SIGINT) -> None:
        self._db = db
        self._signum = signum
        self.armed = False

    def write(self, *args: Any) -> Any:
        result = self._db.write(*args)
        if self.armed:
            self.armed = False
            signal.raise_signal(self._signum)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def _later_calls(queue: Queue, chain: Chain) -> dict[str, Any]:
    third = chain.build(BASE, 5)
    return {
        "get_commit_pointers": queue.get_commit_pointers,
        "get_last_committed_mc_block_id": queue.get_last_committed_mc_block_id,
        "iterator": lambda: list(queue.iterator(0, [full_range(BASE)], BASE)),
        "get_diffs_tail_len": lambda: queue.get_diffs_tail_len(BASE, full_range(BASE).from_key),
        "clear_uncommitted_state": queue.clear_uncommitted_state,
        "apply_diff": lambda: queue.apply_diff(third.diff, third.block, third.hash),
    }


def _queue_with_a_diff_to_come(
    tmp_path: Path, messages: int
) -> tuple[Path, Queue, Chain, Any, Any, Any]:
    """A queue at ``tmp_path / "db"`` with a diff of ``messages`` applied to BASE and an
    empty masterchain diff, and the next BASE diff built, not applied."""
    path = tmp_path / "db"
    queue = open_queue(path)
    chain = Chain(queue)
    first = chain.apply(BASE, messages)
    mc = chain.apply(MC, 0)
    return path, queue, chain, first, mc, chain.build(BASE, messages)


def _alarm_times_out(signum: int, frame: object) -> None:
    raise TimeoutError("the alarm went off")


@pytest.mark.parametrize("call", ["apply_diff", "commit_diff"])
@pytest.mark.parametrize("by", ["ctrl-c", "alarm"])
def test_a_ctrl_c_during_a_write_kills_the_handle(tmp_path: Path, call: str, by: str) -> None:
    """A Ctrl-C, or an alarm whose handler raises ``TimeoutError`` (an error, not an
    interrupt), right after RocksDB took the batch: the handle's memory has not followed
    the disk, so it dies rather than answer from it (an alarm's error used to go through,
    and the handle went on answering from memory that missed the batch)."""
    path, queue, chain, first, mc, second = _queue_with_a_diff_to_come(tmp_path, 10)
    signum, raised = (
        (signal.SIGINT, KeyboardInterrupt) if by == "ctrl-c" else (signal.SIGALRM, TimeoutError)
    )
    proxy = _SignalAfterWrite(queue._store._db, signum)  # type: ignore[attr-defined]
    queue._store._db = proxy  # type: ignore[attr-defined]
    proxy.armed = True
    before = signal.signal(signal.SIGALRM, _alarm_times_out)
    try:
        with pytest.raises(raised):
            if call == "apply_diff":
                queue.apply_diff(second.diff, second.block, second.hash)
            else:
                queue.commit_diff([top(MC, mc.seqno), top(BASE, first.seqno, mc.seqno)])
    finally:
        signal.signal(signal.SIGALRM, before)
    for name, later in _later_calls(queue, chain).items():  # none served from memory
        try:
            later()
        except StorageError as exc:
            assert "this handle is dead" in str(exc), (name, exc)
            assert "interrupted" in str(exc), (name, exc)
        else:
            pytest.fail(f"{name} answered on a handle whose write was interrupted")
    queue.close()
    with open_queue(path) as again:  # what the disk holds: the whole interrupted call
        messages = list(again.iterator(0, [full_range(BASE)], BASE))
        if call == "apply_diff":
            assert len(messages) == 20
        else:
            assert again.get_commit_pointers()[BASE].seqno == first.seqno
            assert again.get_last_committed_mc_block_id() == top(MC, mc.seqno).block_id
            again.clear_uncommitted_state()
            assert len(list(again.iterator(0, [full_range(BASE)], BASE))) == 10
    report = verify(path)
    assert report.ok, report.problems


def _interrupt_once(method: Any, *, before: bool = False) -> Any:
    """``method`` raising a KeyboardInterrupt at its first call, after doing its work (a
    Ctrl-C that lands between taking a lock and recording it), or ``before`` it."""
    fired = [False]

    def call(*args: Any, **kwargs: Any) -> Any:
        if before and not fired[0]:
            fired[0] = True
            raise KeyboardInterrupt
        result = method(*args, **kwargs)
        if not fired[0]:
            fired[0] = True
            raise KeyboardInterrupt
        return result

    return call


@pytest.mark.parametrize(
    "window", ["after the read lock", "after the shard's mutex", "write", "with-exit"]
)
def test_a_ctrl_c_that_may_leave_a_lock_held_retires_the_handle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: str
) -> None:
    """An outside audit: a Ctrl-C caught by the host inside a prepare left the read lock
    (or a shard's mutex) held with no pending diff to release it, and the next
    ``commit_diff``, from any thread, waited forever. Such a call now retires the handle:
    later calls raise ``StorageError`` at once (a commit already waiting too), ``close()``
    releases the directory, and a reopen holds what was written."""
    path, queue, _, first, mc, second = _queue_with_a_diff_to_come(tmp_path, 3)
    if window == "after the read lock":  # before the shard's mutex is even looked up
        monkeypatch.setattr(RWLock, "acquire_read", _interrupt_once(RWLock.acquire_read))
    elif window == "after the shard's mutex":  # both held, the guard lost on the way
        monkeypatch.setattr(
            PendingRegistry, "hold_shard", _interrupt_once(PendingRegistry.hold_shard)
        )
    with pytest.raises(KeyboardInterrupt):
        if window == "write":  # the write done, its locks' release cut short
            diff = queue.prepare_diff(second.diff, second.block, second.hash)
            assert diff is not None
            monkeypatch.setattr(
                LockGuard, "release", _interrupt_once(LockGuard.release, before=True)
            )
            diff.write()
        elif window == "with-exit":  # discarded by leaving `with`, its release cut short
            with queue.prepare_diff(second.diff, second.block, second.hash):
                monkeypatch.setattr(
                    LockGuard, "release", _interrupt_once(LockGuard.release, before=True)
                )
        else:
            queue.prepare_diff(second.diff, second.block, second.hash)
    monkeypatch.undo()
    done: list[BaseException] = []

    def commit() -> None:
        try:
            queue.commit_diff([top(MC, mc.seqno), top(BASE, first.seqno, mc.seqno)])
        except BaseException as exc:
            done.append(exc)

    committer = threading.Thread(target=commit)
    committer.start()
    committer.join(5)
    assert not committer.is_alive(), "a commit waits for a lock the interrupt left held"
    assert len(done) == 1 and isinstance(done[0], StorageError), done
    assert "interrupted (KeyboardInterrupt)" in str(done[0])
    queue.close()
    with open_queue(path) as again:
        assert again.get_diff_info(BASE, first.seqno) is not None


def _interrupt_at_line(function: Any, text: str) -> Any:
    """A trace function that raises KeyboardInterrupt once, as a Ctrl-C would, when
    ``function`` reaches its line containing ``text``."""
    fired = [False]

    def ctrl_c() -> None:
        if not fired[0]:
            fired[0] = True
            raise KeyboardInterrupt

    return at_line(function, text, ctrl_c)


def test_a_queue_reopens_inside_the_except_block_of_a_ctrl_c_while_a_view_opens(
    tmp_path: Path,
) -> None:
    """An outside audit: a Ctrl-C while a call opened its RocksDB cursors left them in the
    interrupted frame, which the exception's traceback keeps alive; they held the
    database, and the directory's lock, open after ``close()``, so an open in the
    ``except`` block (where a host recovers) raised ``DatabaseLockedError``."""
    path, queue, _, _, _, _ = _queue_with_a_diff_to_come(tmp_path, 3)
    queue.close()
    queue = open_queue(path)  # nothing in the cache of fresh rows: RocksDB serves reads
    before = sys.gettrace()
    sys.settrace(_interrupt_at_line(rocks.Cursor.__init__, "if scan.reverse or scan.keys_only"))
    try:
        list(queue.iterator(0, [full_range(BASE)], BASE))
    except KeyboardInterrupt:
        sys.settrace(before)
        queue.close()
        with open_queue(path) as again:  # still inside the except block
            assert len(list(again.iterator(0, [full_range(BASE)], BASE))) == 3
    else:
        pytest.fail("the interrupt did not land")
    finally:
        sys.settrace(before)
