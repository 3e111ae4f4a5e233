"""Waits the locks cannot refuse are reported (docs/behaviour.md 4).

A pending diff counts as its preparing thread's until written or discarded (I5 refuses
the waits that thread would make for itself). A thread that was *handed* one and then
commits, clears, imports or prepares its shard before writing it waits for itself, which
no lock can see (an outside audit found the commit waiting until ``close()``, silently).
Such a call now logs ``lock_wait_long`` once, after ``locks.STUCK_AFTER`` seconds, naming
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
from imq.observability import capture_events

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
        return [e for e in events if e["event"] == "lock_wait_long" and e["operation"] == operation]

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
    assert report["held"] == f"shard {LEFT}: thread 'preparer' (exited)"
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
    assert report["held"] == f"shard {LEFT}: thread 'preparer' (exited)"


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
    assert report["held"] == f"shard {LEFT}: thread 'preparer' (exited)"
    with pytest.raises(QueueClosedError):
        pending.write()


def test_a_short_wait_reports_nothing(queue: Queue) -> None:
    """A commit that waits less than STUCK_AFTER for a pending diff (the normal case: the
    diffs collated beside it) logs nothing; the one report of a long wait is the only
    one, however long the wait."""
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
        threading.Event().wait(STUCK * 4)
        pending.write()
        assert committer.outcome() is True
    reports = [e for e in events if e["event"] == "lock_wait_long"]
    assert len(reports) == 1, reports
    assert reports[0]["held"] == f"shard {RIGHT}: thread 'MainThread' (running)"
