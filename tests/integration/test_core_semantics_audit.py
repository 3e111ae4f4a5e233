"""Core write/commit/GC/zone behaviour pinned by a mutation audit of apply, commit, gc,
zones, delete, pending, router, diff and the store's write operations (SEMANTICS §4-§8,
docs/behaviour.md). Each test names the behaviour it pins; all run on a real RocksDB in
``tmp_path``."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from builders import (
    BASE,
    MC,
    Chain,
    Clock,
    address_in,
    block,
    diff_hash,
    key,
    make_diff,
    message,
    message_keys,
    messages,
    quiet_config,
    split_shard,
    top,
)

from imq import Message, Queue, QueueDiff, QueueKey

Logs = list[MutableMapping[str, Any]]


def test_a_discarded_or_written_pending_diff_is_not_reported_dropped_when_collected(
    queue: Queue, chain: Chain, logs: Logs
) -> None:
    """SEMANTICS §4 / docs/behaviour.md §4: only a pending diff dropped *unwritten and
    undiscarded* is discarded by its collection (with a ``pending_diff_dropped``
    warning); one that was written or discarded releases nothing more and warns
    nothing when it is collected."""
    discarded = chain.build(BASE, 2)
    pending = queue.prepare_diff(discarded.diff, discarded.block, discarded.hash)
    assert pending is not None
    pending.discard()
    written = chain.build(BASE, 2)
    pending2 = queue.prepare_diff(written.diff, written.block, written.hash)
    assert pending2 is not None
    pending2.write()
    del pending, pending2
    gc.collect()
    assert [e for e in logs if e["event"] == "pending_diff_dropped"] == []
    # The shard is free: another thread prepares it at once.
    third = chain.build(BASE, 1)
    result: list[object] = []
    t = threading.Thread(
        target=lambda: result.append(queue.apply_diff(third.diff, third.block, third.hash))
    )
    t.start()
    t.join(10)
    assert result == [True]


def test_a_lock_guard_releases_its_locks_exactly_once(queue: Queue) -> None:
    """SEMANTICS §4 (a pending diff's guards are released once, at write or drop):
    releasing a pending diff's guard again is a no-op; it never releases a shard mutex
    or a read lock it no longer holds (which would free another holder's lock)."""
    guard = queue._pending.hold_shard(queue._rw, queue._shard_locks, BASE)
    guard.release()
    guard.release()  # idempotent: no RuntimeError, no second release_read
    other = queue._pending.hold_shard(queue._rw, queue._shard_locks, BASE)
    guard.release()  # must not free `other`'s mutex
    lock = queue._shard_locks.get(BASE)
    assert not lock.acquire(blocking=False)
    other.release()
    assert lock.acquire(blocking=False)
    lock.release()
    # The read lock is balanced: a commit (the write lock) gets in at once.
    assert queue.apply_diff(make_diff(), block(MC, 1), diff_hash("mc1"))
    assert queue.commit_diff([top(MC, 1)])


def test_a_diffs_explicit_bounds_and_lt_span_are_inclusive(queue: Queue) -> None:
    """SEMANTICS §1.12/§1.9 and docs/behaviour.md §2 (QueueDiff): every message must lie
    *inside* ``[min_key, max_key]`` and ``[min_for_lt(start_lt), max_for_lt(end_lt)]``,
    both ends included, so bounds equal to the first and last message keys (as a
    serialized diff carries them) are valid and stored as given."""
    clock = Clock()
    msgs = messages(clock, BASE, 3)
    first, last = msgs[0].key, msgs[-1].key
    exact = QueueDiff(msgs, min_key=first, max_key=last)
    assert exact.bounds == (first, last)
    assert queue.apply_diff(exact, block(BASE, 1), diff_hash(1))
    info = queue.get_diff_info(BASE, 1)
    assert info is not None
    assert (info.min_message, info.max_message) == (first, last)
    spanned = messages(clock, BASE, 2)
    lts = QueueDiff(spanned, start_lt=spanned[0].key.lt, end_lt=spanned[-1].key.lt)
    assert lts.bounds == (spanned[0].key, spanned[-1].key)  # a diff's messages win
    assert queue.apply_diff(lts, block(BASE, 2), diff_hash(2))


A = split_shard(0, 1, 0)


def _msg(lt: int) -> Message:
    return message(key(lt), address_in(A, 1), address_in(A, 2))


def _gc_with_a_write_after_batch(
    path: Path, monkeypatch: pytest.MonkeyPatch, write: Callable[[Queue], None], batch: int
) -> Queue:
    """Six one-message diffs of ``A`` at lt 1010..1060, the pointer at lt 1020, a GC
    bound at lt 1200 (above the pointer) and batches of one diff; ``write`` runs after
    batch number ``batch``, which ended at lt ``1000 + 10 * batch`` (the sixth batch,
    the one diff left under the bound, goes to the bound). Returns the queue after the
    pass (open)."""
    from imq import gc as imq_gc

    queue = Queue.open(path, quiet_config(gc_batch_diffs=1))
    for seqno in range(1, 7):
        diff = make_diff([_msg(1000 + 10 * seqno)])
        assert queue.apply_diff(diff, block(A, seqno), diff_hash((A, seqno)))
    assert queue.apply_diff(make_diff([], {A: key(1200)}), block(MC, 1), diff_hash(MC))
    assert queue.commit_diff([top(MC, 1), top(A, 2, 1)])
    real = imq_gc.GarbageCollector._delete_batch
    ends: list[QueueKey] = []

    def batch_then_write(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = real(self, *args, **kwargs)
        ends.append(result[0].last)
        if len(ends) == batch:
            write(queue)
        return result

    monkeypatch.setattr(imq_gc.GarbageCollector, "_delete_batch", batch_then_write)
    queue.run_gc()
    assert ends[batch - 1] == key(1000 + 10 * batch)
    return queue


def test_a_message_rewritten_at_a_batchs_end_restarts_the_deletion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SEMANTICS §7.3/§8.1 (GC deletes every message at or below its bound, inclusive)
    with docs/behaviour.md §4 (batched GC starts again from the beginning when the
    shard's writers wrote at or below where the batch before ended): a diff re-applied
    between two batches, whose first message sits exactly at that end and whose last is
    above the bound, loses that first message: only the part above the bound stays, with
    the diff's record (its ``max_message`` is above the bound)."""

    def write(queue: Queue) -> None:
        again = make_diff([_msg(1050), _msg(1305)])
        assert queue.apply_diff(again, block(A, 100), diff_hash((A, 100)))

    with _gc_with_a_write_after_batch(tmp_path / "q", monkeypatch, write, 5) as queue:
        assert message_keys(queue, 0, A) == [key(1305)]
        assert queue.get_diff_info(A, 100) is not None
        assert queue.get_diffs_tail_len(A, QueueKey.MIN) == 1


def test_an_empty_diff_written_below_a_batchs_end_is_collected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SEMANTICS §7.3 (GC removes the tail and info rows of every diff whose
    ``max_message`` is at or below the bound) with docs/behaviour.md §4: an empty diff
    (no message, only a span) applied between two batches below where the batch before
    ended is found by its tail row and collected too; no diff record stays under the
    bound."""

    def write(queue: Queue) -> None:
        empty = QueueDiff(start_lt=1033, end_lt=1036)
        assert queue.apply_diff(empty, block(A, 100), diff_hash((A, 100)))

    with _gc_with_a_write_after_batch(tmp_path / "q", monkeypatch, write, 4) as queue:
        assert queue.get_diff_info(A, 100) is None
        assert queue.get_diffs_tail_len(A, QueueKey.MIN) == 0
        assert message_keys(queue, 0, A) == []
        assert queue.get_last_applied_seqno(A) is None
