"""Empty diffs commit (issue 8): with no hand-built ``DiffStatistics``, an empty diff
takes the bounds of its block's lt span, or, without a span, rests just above its
shard's newest position (pointer or newest stored diff) once that position is above
``MIN``, so committing it never moves a commit pointer backwards (D6) and, until
committed, it is uncommitted like any diff. While the shard's newest position is
``MIN`` (or it has none), a spanless empty diff is at ``MIN``, as the original's rule for
``statistics=None`` and its tests have it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
from builders import MC, Clock, block, diff_hash, key, messages, open_queue, top

from imq import (
    CommitPointer,
    DiffConflictError,
    DiffZone,
    Queue,
    QueueDiff,
    QueueKey,
    ShardIdent,
)

S = ShardIdent.BASECHAIN


def _commit(
    queue: Queue,
    mc_seqno: int,
    shard_seqno: int,
    processed_to: Mapping[ShardIdent, QueueKey] | None = None,
) -> None:
    """Apply an empty masterchain diff ``mc_seqno`` (with its span) and commit on it with
    the basechain block ``shard_seqno`` as the top shard block."""
    lt = 10_000_000 + mc_seqno * 100
    mc_diff = QueueDiff(processed_to=processed_to, start_lt=lt, end_lt=lt + 50)
    assert queue.apply_diff(mc_diff, block(MC, mc_seqno), diff_hash(("mc", mc_seqno)))
    assert queue.commit_diff([top(MC, mc_seqno), top(S, shard_seqno, mc_seqno)]) is True


@pytest.mark.parametrize("with_span", [True, False], ids=["span", "no-span"])
def test_non_empty_and_empty_diffs_alternate_and_each_commits(
    queue: Queue, with_span: bool
) -> None:
    clock = Clock()
    previous_max = QueueKey.MIN
    for seqno in range(1, 7):
        start_lt = clock.next_lt()
        msgs = messages(clock, S, 3) if seqno % 2 else []  # 1, 3, 5: messages; 2, 4, 6: empty
        end_lt = clock.next_lt()
        span = {"start_lt": start_lt, "end_lt": end_lt} if with_span else {}
        diff = QueueDiff(msgs, **span)
        if msgs:
            expected = (msgs[0].key, msgs[-1].key)
        elif with_span:
            expected = (QueueKey.min_for_lt(start_lt), QueueKey.max_for_lt(end_lt))
        else:  # just above the previous diff (committed: also the pointer)
            expected = (previous_max.next_value(), previous_max.next_value())
        assert queue.apply_diff(diff, block(S, seqno), diff_hash(seqno)) is True
        info = queue.get_diff_info(S, seqno, DiffZone.UNCOMMITTED)
        assert info is not None
        assert (info.min_message, info.max_message) == expected
        _commit(queue, seqno, seqno)
        assert queue.get_commit_pointers()[S] == CommitPointer(expected[1], seqno)
        assert queue.get_diff_info(S, seqno, DiffZone.COMMITTED) == info
        previous_max = expected[1]
    assert queue.get_last_applied_seqno(S) == 6
    assert queue.get_diffs_tail_len(S, QueueKey.MIN) == 6


def test_a_spanless_empty_diff_is_uncommitted_until_committed_and_clear_removes_it(
    queue: Queue,
) -> None:
    clock = Clock()
    assert queue.apply_diff(QueueDiff(messages(clock, S, 2)), block(S, 1), diff_hash(1))
    _commit(queue, 1, 1)
    assert queue.apply_diff(QueueDiff(), block(S, 2), diff_hash(2))
    assert queue.get_diff_info(S, 2, DiffZone.COMMITTED) is None
    assert queue.get_diff_info(S, 2, DiffZone.UNCOMMITTED) is not None
    queue.clear_uncommitted_state()
    assert not queue.is_diff_exists(block(S, 2))
    # The block is collated again (another hash): no conflict with the cleared one.
    again = QueueDiff(processed_to={S: key(1)})
    assert queue.apply_diff(again, block(S, 2), diff_hash("again"), check_sequence=DiffZone.BOTH)
    _commit(queue, 2, 2)
    assert queue.get_commit_pointers()[S].seqno == 2


def test_an_empty_diff_after_its_predecessor_was_collected_rests_above_the_pointer(
    queue: Queue,
) -> None:
    clock = Clock()
    msgs = messages(clock, S, 2)
    read_all = {S: msgs[-1].key}
    assert queue.apply_diff(QueueDiff(msgs, read_all), block(S, 1), diff_hash(1))
    _commit(queue, 1, 1, read_all)
    pointer = queue.get_commit_pointers()[S]
    assert queue.run_gc() > 0  # every reader passed diff 1: GC deletes its record
    assert not queue.is_diff_exists(block(S, 1))
    assert queue.apply_diff(QueueDiff(), block(S, 2), diff_hash(2))
    info = queue.get_diff_info(S, 2)
    assert info is not None
    assert info.min_message == info.max_message == pointer.key.next_value()
    _commit(queue, 2, 2)
    assert queue.get_commit_pointers()[S] == CommitPointer(pointer.key.next_value(), 2)


def test_an_uncommitted_predecessor_above_the_pointer_wins(queue: Queue) -> None:
    clock = Clock()
    assert queue.apply_diff(QueueDiff(messages(clock, S, 2)), block(S, 1), diff_hash(1))
    _commit(queue, 1, 1)
    second = messages(clock, S, 2)
    assert queue.apply_diff(QueueDiff(second), block(S, 2), diff_hash(2))
    assert queue.apply_diff(QueueDiff(), block(S, 3), diff_hash(3))
    info = queue.get_diff_info(S, 3, DiffZone.UNCOMMITTED)
    assert info is not None
    assert info.min_message == info.max_message == second[-1].key.next_value()
    _commit(queue, 2, 3)
    assert queue.get_commit_pointers()[S] == CommitPointer(second[-1].key.next_value(), 3)


def test_spanless_empty_diffs_in_a_row_after_messages_each_rest_above_the_last(
    queue: Queue,
) -> None:
    clock = Clock()
    msgs = messages(clock, S, 2)
    assert queue.apply_diff(QueueDiff(msgs), block(S, 1), diff_hash(1))
    assert queue.apply_diff(QueueDiff(), block(S, 2), diff_hash(2))
    assert queue.apply_diff(QueueDiff(), block(S, 3), diff_hash(3))
    second = queue.get_diff_info(S, 2)
    third = queue.get_diff_info(S, 3)
    assert second is not None and third is not None
    assert second.max_message == msgs[-1].key.next_value()
    assert third.max_message == second.max_message.next_value()
    _commit(queue, 1, 2)
    _commit(queue, 2, 3)
    assert queue.get_commit_pointers()[S] == CommitPointer(third.max_message, 3)


def test_spanless_empty_diffs_from_a_shards_start_share_min_as_in_the_original(
    queue: Queue,
) -> None:
    """The original's rule for ``statistics=None`` (an empty diff's bounds are ``MIN``)
    holds while the shard's newest position is ``MIN``: a pointer at ``MIN`` with a
    higher seqno is a legal move ("two empty diffs can share a key")."""
    for seqno in (1, 2, 3):
        assert queue.apply_diff(QueueDiff(), block(S, seqno), diff_hash(seqno))
        info = queue.get_diff_info(S, seqno)
        assert info is not None
        assert (info.min_message, info.max_message) == (QueueKey.MIN, QueueKey.MIN)
    _commit(queue, 1, 2)
    assert queue.get_commit_pointers()[S] == CommitPointer(QueueKey.MIN, 2)
    _commit(queue, 2, 3)
    assert queue.get_commit_pointers()[S] == CommitPointer(QueueKey.MIN, 3)
    assert queue.get_diffs_tail_len(S, QueueKey.MIN) == 3  # D3: none overwrites another
    # The first diff with messages moves the shard off MIN: empty diffs rest above it.
    clock = Clock()
    msgs = messages(clock, S, 1)
    assert queue.apply_diff(QueueDiff(msgs), block(S, 4), diff_hash(4))
    assert queue.apply_diff(QueueDiff(), block(S, 5), diff_hash(5))
    info = queue.get_diff_info(S, 5)
    assert info is not None
    assert info.max_message == msgs[-1].key.next_value()


def test_a_spanless_empty_diff_at_a_pointer_at_min_is_in_the_committed_zone(
    queue: Queue,
) -> None:
    """SEMANTICS §6: zones compare keys only, so an empty diff at ``MIN`` is committed as
    soon as its shard's pointer is at ``MIN``: clear keeps it, and the block collated
    again with another hash conflicts with it. A collator's empty diffs carry their
    block's lt span and never rest at ``MIN`` (the tests above)."""
    assert queue.apply_diff(QueueDiff(), block(S, 1), diff_hash(1))
    _commit(queue, 1, 1)
    assert queue.apply_diff(QueueDiff(), block(S, 2), diff_hash(2))
    assert queue.get_diff_info(S, 2, DiffZone.COMMITTED) is not None
    assert queue.get_diff_info(S, 2, DiffZone.UNCOMMITTED) is None
    queue.clear_uncommitted_state(top_shards=[S])
    assert queue.is_diff_exists(block(S, 2))
    with pytest.raises(DiffConflictError):
        queue.apply_diff(QueueDiff(), block(S, 2), diff_hash("again"))
    _commit(queue, 2, 2)
    assert queue.get_commit_pointers()[S] == CommitPointer(QueueKey.MIN, 2)


def test_a_first_empty_diff_without_a_span_rests_at_min(queue: Queue) -> None:
    assert queue.apply_diff(QueueDiff(), block(S, 1), diff_hash(1))
    info = queue.get_diff_info(S, 1)
    assert info is not None
    assert (info.min_message, info.max_message) == (QueueKey.MIN, QueueKey.MIN)


def test_explicit_keys_are_the_stored_bounds(queue: Queue) -> None:
    clock = Clock()
    msgs = messages(clock, S, 2)
    lo, hi = QueueKey.min_for_lt(msgs[0].key.lt - 1), key(msgs[-1].key.lt + 5)
    assert queue.apply_diff(QueueDiff(msgs, min_key=lo, max_key=hi), block(S, 1), diff_hash(1))
    info = queue.get_diff_info(S, 1)
    assert info is not None
    assert (info.min_message, info.max_message) == (lo, hi)
    assert queue.get_diffs_tail_len(S, hi) == 1


def test_prepare_of_an_empty_diff_derives_its_bounds_under_the_shard_lock(queue: Queue) -> None:
    clock = Clock()
    msgs = messages(clock, S, 2)
    assert queue.apply_diff(QueueDiff(msgs), block(S, 1), diff_hash(1))
    pending = queue.prepare_diff(QueueDiff(), block(S, 2), diff_hash(2))
    assert pending is not None
    pending.write()
    info = queue.get_diff_info(S, 2)
    assert info is not None
    assert info.max_message == msgs[-1].key.next_value()


def test_empty_diff_bounds_survive_a_reopen(db_path: Path) -> None:
    clock = Clock()
    msgs = messages(clock, S, 2)
    with open_queue(db_path) as q:
        assert q.apply_diff(QueueDiff(msgs), block(S, 1), diff_hash(1))
        _commit(q, 1, 1)
    with open_queue(db_path) as q:
        assert q.apply_diff(QueueDiff(), block(S, 2), diff_hash(2))
        _commit(q, 2, 2)
        assert q.get_commit_pointers()[S] == CommitPointer(msgs[-1].key.next_value(), 2)


def test_a_committed_diff_at_max_survives_clear_and_startup(queue: Queue) -> None:
    """A diff whose span ends at ``MAX``, committed, puts its shard's pointer at ``MAX``:
    nothing lies above it, so a clear (or startup) leaves that diff and the pointer alone
    (``next_value()`` saturates at ``MAX``: a clear that started there would delete it)."""
    low = QueueKey.min_for_lt(500)
    diff = QueueDiff(min_key=low, max_key=QueueKey.MAX)
    assert queue.apply_diff(diff, block(S, 1), diff_hash(1))
    _commit(queue, 1, 1)
    assert queue.get_commit_pointers()[S] == CommitPointer(QueueKey.MAX, 1)
    committed = queue.get_diff_info(S, 1, DiffZone.COMMITTED)
    assert committed is not None
    queue.clear_uncommitted_state(top_shards=[S])
    assert queue.get_diff_info(S, 1) == committed
    assert queue.get_diffs_tail_len(S, QueueKey.MAX) == 1
    last = queue.get_last_committed_mc_block_id()
    assert last is not None
    queue.startup(last, [S])
    assert queue.get_diff_info(S, 1) == committed
    assert queue.get_commit_pointers()[S] == CommitPointer(QueueKey.MAX, 1)
