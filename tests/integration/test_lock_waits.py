"""Waits the locks cannot refuse are reported (docs/behaviour.md 4).

A pending diff counts as its preparing thread's until written or discarded (I5 refuses
the waits that thread would make for itself). A thread that was *handed* one and then
commits, clears, imports or prepares its shard before writing it waits for itself, which
no lock can see (an outside audit found the commit waiting until ``close()``, silently).
Such a call now logs ``lock_wait_reported`` once, after ``locks.STUCK_AFTER`` seconds, naming
the shards held and whether their threads still run; it goes on waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from builders import MC, Applied, Chain, quarter_shards, quiet_config, top
from threads import TIMEOUT, started

from imq import PendingDiff, Queue, QueueClosedError
from imq import locks as locks_module
from imq.locks import LongWait, RWLock
from imq.observability import capture_events
from imq.pending import PendingRegistry

LEFT, RIGHT = quarter_shards()[:2]
STUCK = 0.2  # seconds: locks.STUCK_AFTER in these tests


@pytest.fixture
def queue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Queue]:
    monkeypatch.setattr(locks_module, "STUCK_AFTER", STUCK)
    q = Queue.open(tmp_path / "q", quiet_config(gc_enabled=False))
    try:
        yield q
    finally:
        q.close()


def _handed_over(queue: Queue, applied: Applied) -> PendingDiff:
    """A pending diff prepared by a thread that has exited since (as a pool worker's
    result is handed to the caller)."""
    worker = started(
        lambda: queue.prepare_diff(applied.diff, applied.block, applied.hash), "preparer"
    )
    pending = worker.outcome()
    assert isinstance(pending, PendingDiff)
    return pending


def _stuck_report(
    queue: Queue,
    operation: str,
    call: Callable[[], Any],
    events: list[MutableMapping[str, Any]],
) -> MutableMapping[str, Any]:
    """Run ``call`` (an ``operation`` that waits for itself) until it has reported its
    wait, then close the queue, which ends the wait with ``QueueClosedError``; the
    report, the only one of that operation."""
    closer_done = threading.Event()

    def reports() -> list[MutableMapping[str, Any]]:
        return [
            e for e in events if e["event"] == "lock_wait_reported" and e["operation"] == operation
        ]

    def close_once_reported() -> None:  # or after TIMEOUT: the test then fails, not hangs
        deadline = time.monotonic() + TIMEOUT
        while not reports() and time.monotonic() < deadline:
            if closer_done.wait(0.02):
                return
        queue.close()

    closer = threading.Thread(target=close_once_reported, daemon=True)
    closer.start()
    try:
        with pytest.raises(QueueClosedError):
            call()
    finally:
        closer_done.set()
        closer.join(TIMEOUT)
    (report,) = reports()
    return report


@pytest.mark.parametrize("operation", ["commit_diff", "clear_uncommitted_state"])
def test_a_write_call_holding_a_handed_over_diff_reports_its_wait(
    queue: Queue, operation: str
) -> None:
    chain = Chain(queue)
    chain.apply(MC)
    pending = _handed_over(queue, chain.build(LEFT))
    calls: dict[str, Callable[[], Any]] = {
        "commit_diff": lambda: queue.commit_diff([top(MC, 1)]),
        "clear_uncommitted_state": queue.clear_uncommitted_state,
    }
    with capture_events() as events:
        report = _stuck_report(queue, operation, calls[operation], events)
    assert report["operation"] == operation
    assert report["log_level"] == "warning"
    assert report["waited_seconds"] >= STUCK
    assert report["held"] == f"shard {LEFT}: pending diff of thread 'preparer' (exited)"
    assert report["write_lock"] is None
    assert "a thread handed a pending diff must write or discard it" in report["hint"]
    with pytest.raises(QueueClosedError):
        pending.write()


def test_a_prepare_of_a_handed_over_shard_reports_its_wait(queue: Queue) -> None:
    chain = Chain(queue)
    _handed_over(queue, chain.build(LEFT))
    again = chain.build(LEFT)
    with capture_events() as events:
        report = _stuck_report(
            queue,
            "prepare_diff",
            lambda: queue.prepare_diff(again.diff, again.block, again.hash),
            events,
        )
    assert report["operation"] == "prepare_diff"
    assert report["held"] == f"shard {LEFT}: pending diff of thread 'preparer' (exited)"


def test_a_prepare_behind_a_stuck_commit_reports_its_wait(queue: Queue) -> None:
    """The documented wait: a commit waits for a diff handed to this thread, and this
    thread's next prepare (of another shard) waits behind that commit."""
    chain = Chain(queue)
    chain.apply(MC)
    pending = _handed_over(queue, chain.build(LEFT))
    with capture_events() as events:
        committer = started(lambda: queue.commit_diff([top(MC, 1)]), "committer")
        other = chain.build(RIGHT)
        report = _stuck_report(
            queue,
            "prepare_diff",
            lambda: queue.prepare_diff(other.diff, other.block, other.hash),
            events,
        )
        with pytest.raises(QueueClosedError):
            committer.outcome()
    assert report["operation"] == "prepare_diff"
    assert report["held"] == f"shard {LEFT}: pending diff of thread 'preparer' (exited)"
    with pytest.raises(QueueClosedError):
        pending.write()


def test_a_short_wait_reports_nothing(queue: Queue, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit that waits less than STUCK_AFTER for a pending diff (the normal case: the
    diffs collated beside it) logs nothing; the one report of a long wait is the only
    one, however long the wait."""
    monkeypatch.setattr(locks_module, "STUCK_AFTER", STUCK * 4)  # room for a loaded host
    chain = Chain(queue)
    chain.apply(MC)
    applied = chain.build(LEFT)
    pending = queue.prepare_diff(applied.diff, applied.block, applied.hash)
    assert pending is not None
    with capture_events() as events:
        committer = started(lambda: queue.commit_diff([top(MC, 1)]), "committer")
        threading.Event().wait(STUCK / 4)
        pending.write()
        assert committer.outcome() is True
        chain.apply(MC)
        held = chain.build(RIGHT)
        pending = queue.prepare_diff(held.diff, held.block, held.hash)
        assert pending is not None
        committer = started(lambda: queue.commit_diff([top(MC, 2)]), "committer")
        threading.Event().wait(STUCK * 12)
        pending.write()
        assert committer.outcome() is True
    reports = [e for e in events if e["event"] == "lock_wait_reported"]
    assert len(reports) == 1, reports
    assert reports[0]["held"] == f"shard {RIGHT}: pending diff of thread 'MainThread' (running)"


def test_a_report_names_an_export_and_the_write_locks_holder(queue: Queue) -> None:
    """A wait behind an export says it is one (an export holds its shard while it runs,
    legitimately); a prepare behind a commit names the thread holding the write lock."""
    chain = Chain(queue)
    chain.apply(LEFT)
    registry, rw = queue._pending, queue._rw
    guard = registry.hold_shard(rw, queue._shard_locks, LEFT, kind="export")
    try:
        assert registry.holders() == f"shard {LEFT}: export of thread 'MainThread' (running)"
    finally:
        guard.release()
    rw.acquire_write()
    try:
        assert rw.writer_name() == "MainThread"
    finally:
        rw.release_write()
    assert rw.writer_name() is None


def test_a_report_runs_with_the_lock_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report takes the pending registry's mutex (and the host's logging handlers'
    locks); a thread inside a registry section may release a read lock there (a dropped
    pending diff collected by cyclic GC), which needs the lock's condition. Reported
    under the condition, the two waited for each other (an outside review); the report
    now runs with the condition released."""
    monkeypatch.setattr(locks_module, "STUCK_AFTER", 0.05)
    rw, registry = RWLock(), PendingRegistry()
    rw.acquire_read()  # a pending diff's hold: the writer below waits for it
    reporting = threading.Event()

    def on_stuck(waited: float) -> None:
        reporting.set()
        registry.holders()  # takes the registry's mutex

    with registry._mutex:  # a registry section, in which a dropped diff releases its hold
        writer = started(lambda: rw.acquire_write(LongWait(on_stuck)), "writer")
        assert reporting.wait(TIMEOUT)
        releaser = started(rw.release_read, "releaser")
        assert releaser.finished.wait(TIMEOUT), "the report held the lock's condition"
    writer.outcome()
    assert rw.writer_name() == "writer"
    rw.release_write()
