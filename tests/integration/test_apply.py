"""prepare_diff / apply_diff on a real RocksDB (SEMANTICS §5.3, §5.4; API.md)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from builders import (
    BASE,
    MC,
    Applied,
    Chain,
    address_in,
    block,
    derived_stats,
    diff_hash,
    dump,
    key,
    make_diff,
    message,
    quarter_shards,
    quiet_config,
    rows,
    split_shard,
    stats,
)

from imq import (
    CorruptDataError,
    DiffBelowCommitPointerError,
    DiffConflictError,
    DiffInfo,
    DiffSequenceError,
    DiffStatistics,
    DiffZone,
    ImqError,
    PartitionRouter,
    PendingDiff,
    Queue,
    QueueKey,
    QueueShardRange,
    ShardIdent,
)
from imq.storage import Table, codec

S = split_shard(0, 1, 0)  # 0:4000000000000000
OTHER = split_shard(0, 1, 1)  # 0:c000000000000000


def expected_info(applied: Applied, statistics: DiffStatistics | None = None) -> DiffInfo:
    st = statistics or derived_stats(applied.diff, applied.shard)
    return DiffInfo(
        min_message=st.min_message,
        max_message=st.max_message,
        shards_messages_count=st.shards_messages_count,
        hash=applied.hash,
        processed_to=dict(applied.diff.processed_to),
        router_src=applied.diff.router.src_partitions(),
        router_dst=applied.diff.router.dst_partitions(),
        seqno=applied.seqno,
        prev_hash=applied.diff.prev_hash,
    )


def commit_on(queue: Queue, chain: Chain, mc_seqno: int, *tops: Applied) -> None:
    """Apply an empty masterchain diff ``mc_seqno`` and commit it with ``tops``."""
    mc = chain.apply(MC, 0, seqno=mc_seqno)
    assert queue.commit_diff([mc.top(), *(t.top(mc_seqno) for t in tops)])


# -- duplicates -------------------------------------------------------------------------------


def test_same_hash_twice_is_written_once(queue: Queue, chain: Chain) -> None:
    a = chain.build(S, 3, processed_to={BASE: key(5)})
    assert queue.apply_diff(a.diff, a.block, a.hash) is True
    after_first = dump(queue)
    assert queue.get_diff_info(S, 1) == expected_info(a)
    assert len(rows(queue, Table.MESSAGES)) == 3

    assert queue.apply_diff(a.diff, a.block, a.hash) is False
    assert queue.prepare_diff(a.diff, a.block, a.hash) is None
    assert dump(queue) == after_first
    counters = queue.metrics.snapshot()["counters"]
    assert counters["diffs_applied"] == 1  # type: ignore[index]
    assert counters["diffs_skipped"] == 2  # type: ignore[index]


@pytest.mark.parametrize("same_content", [True, False])
def test_different_hash_conflicts_and_writes_nothing(
    queue: Queue, chain: Chain, same_content: bool
) -> None:
    a = chain.apply(S, 3)
    before = dump(queue)
    diff = a.diff if same_content else chain.build(S, 4, seqno=1).diff
    other_hash = diff_hash("another")
    with pytest.raises(DiffConflictError) as err:
        queue.apply_diff(diff, a.block, other_hash)
    text = str(err.value)
    assert str(a.block) in text
    assert a.hash.hex() in text
    assert other_hash.hex() in text
    with pytest.raises(DiffConflictError):
        queue.prepare_diff(diff, a.block, other_hash)
    assert dump(queue) == before
    assert queue.get_diff_info(S, 1) == expected_info(a)
    # The shard lock was released: the shard still accepts its next diff.
    chain.apply(S, 1)


# -- sequence check ---------------------------------------------------------------------------


@pytest.mark.parametrize("zone", [None, DiffZone.UNCOMMITTED, DiffZone.BOTH, DiffZone.COMMITTED])
@pytest.mark.parametrize("last_committed", [False, True])
def test_sequence_rule(
    queue: Queue, chain: Chain, zone: DiffZone | None, last_committed: bool
) -> None:
    chain.apply(S, 2, seqno=1)
    last = chain.apply(S, 2, seqno=3)  # seqno 2 was never applied
    if last_committed:
        commit_on(queue, chain, 1, last)
    visible = zone is not None and (
        zone is DiffZone.BOTH or (zone is DiffZone.COMMITTED) == last_committed
    )
    before = dump(queue)

    below = chain.build(S, 2, seqno=2)
    gap = chain.build(S, 2, seqno=5)
    if visible:
        assert zone is not None
        # seqno <= last visible: skipped, nothing written
        assert queue.prepare_diff(below.diff, below.block, below.hash, None, zone) is None
        assert queue.apply_diff(below.diff, below.block, below.hash, None, zone) is False
        assert dump(queue) == before
        # a gap: error naming both seqnos
        with pytest.raises(DiffSequenceError) as err:
            queue.apply_diff(gap.diff, gap.block, gap.hash, None, zone)
        assert str(gap.block) in str(err.value)
        assert "3" in str(err.value)
        assert dump(queue) == before
        # the next seqno is accepted
        nxt = chain.build(S, 2, seqno=4)
        assert queue.apply_diff(nxt.diff, nxt.block, nxt.hash, None, zone) is True
        assert queue.get_last_applied_seqno(S) == 4
    else:
        # no constraint: both the lower seqno and the gap are written
        assert queue.apply_diff(below.diff, below.block, below.hash, None, zone) is True
        assert queue.apply_diff(gap.diff, gap.block, gap.hash, None, zone) is True
        assert queue.get_diff_info(S, 5) == expected_info(gap)
        assert queue.get_diff_info(S, 2) == expected_info(below)
        assert queue.get_last_applied_seqno(S) == 5


def test_sequence_rule_without_any_diff_of_the_shard(queue: Queue, chain: Chain) -> None:
    chain.apply(OTHER, 1, seqno=1)
    for zone in DiffZone:
        a = chain.build(S, 1, seqno=7 + list(DiffZone).index(zone))
        assert queue.apply_diff(a.diff, a.block, a.hash, None, zone) is True


# -- the remembered top of a shard (imq.storage.tops) -----------------------------------------
# A prepare with a sequence check remembers the shard's highest stored diff; the next
# block's prepare then reads only that record's bytes. These check that what it
# remembers follows every write that changes the shard's diffs.


def test_sequence_rule_after_a_clear_uses_the_stored_top(queue: Queue, chain: Chain) -> None:
    for _ in range(4):
        chain.apply(S, 2, check_sequence=DiffZone.BOTH)  # seqnos 1..4, each remembered
    commit_on(queue, chain, 1, chain.of(S)[1])  # seqno 2 committed
    queue.clear_uncommitted_state()  # 3 and 4 are gone
    assert queue.get_last_applied_seqno(S) == 2
    gap = chain.build(S, 2, seqno=5)  # the next block of the forgotten top: a gap now
    with pytest.raises(DiffSequenceError):
        queue.apply_diff(gap.diff, gap.block, gap.hash, None, DiffZone.BOTH)
    again = chain.build(S, 2, seqno=3)
    assert queue.apply_diff(again.diff, again.block, again.hash, None, DiffZone.BOTH) is True
    nxt = chain.build(S, 2, seqno=4)
    assert queue.apply_diff(nxt.diff, nxt.block, nxt.hash, None, DiffZone.UNCOMMITTED) is True
    assert queue.get_last_applied_seqno(S) == 4


def test_sequence_rule_follows_the_commit_of_the_remembered_top(queue: Queue, chain: Chain) -> None:
    a = chain.apply(S, 2, check_sequence=DiffZone.UNCOMMITTED)
    chain.apply(S, 2, check_sequence=DiffZone.UNCOMMITTED)
    commit_on(queue, chain, 1, chain.of(S)[-1])  # the top moves to the committed zone
    # Committed now: the uncommitted rule no longer sees it (no gap), the committed one does.
    far = chain.build(S, 2, seqno=9)
    with pytest.raises(DiffSequenceError):
        queue.apply_diff(far.diff, far.block, far.hash, None, DiffZone.COMMITTED)
    assert queue.apply_diff(far.diff, far.block, far.hash, None, DiffZone.UNCOMMITTED) is True
    assert queue.get_diff_info(S, a.seqno) is not None


def test_a_remembered_top_damaged_under_the_queue_fails_the_next_apply(
    queue: Queue, chain: Chain
) -> None:
    chain.apply(S, 2, check_sequence=DiffZone.BOTH)
    top = chain.apply(S, 2, check_sequence=DiffZone.BOTH)  # remembered as the top
    row_key = codec.diff_info_key(S, top.seqno)
    queue._store._tables[Table.DIFF_INFO].put(row_key, b"\x93garbage")
    nxt = chain.build(S, 2)
    with pytest.raises(CorruptDataError) as err:
        queue.apply_diff(nxt.diff, nxt.block, nxt.hash, None, DiffZone.BOTH)
    assert err.value.key == row_key
    assert queue.get_last_applied_seqno(S) == top.seqno  # nothing written


def test_reopen_forgets_the_remembered_tops(tmp_path: Path) -> None:
    queue = Queue.open(tmp_path / "q", quiet_config())
    chain = Chain(queue)
    for _ in range(3):
        chain.apply(S, 1, check_sequence=DiffZone.BOTH)
    assert len(queue._store.diff_tops) == 1
    queue.close()
    queue = Queue.open(tmp_path / "q", quiet_config())
    try:
        assert len(queue._store.diff_tops) == 0
        gap = chain.build(S, 1, seqno=9)
        with pytest.raises(DiffSequenceError):
            queue.apply_diff(gap.diff, gap.block, gap.hash, None, DiffZone.BOTH)
    finally:
        queue.close()


# -- commit pointer check ---------------------------------------------------------------------


def test_first_message_must_be_above_the_commit_pointer(queue: Queue, chain: Chain) -> None:
    committed = chain.apply(S, 3)
    commit_on(queue, chain, 1, committed)
    pointer = queue.get_commit_pointers()[S]
    assert pointer.key == committed.max_message
    before = dump(queue)
    src, dst = address_in(S), address_in(OTHER)

    for first in (committed.messages[0].key, pointer.key):
        later = [message(chain.clock.next_key(), src, dst)]
        diff = make_diff([message(first, src, dst), *later])
        with pytest.raises(DiffBelowCommitPointerError) as err:
            queue.apply_diff(diff, block(S, 2), diff_hash("below"))
        assert str(block(S, 2)) in str(err.value)
        assert str(S) in str(err.value)
        assert dump(queue) == before

    # The check reads the first message key, not statistics.min_message.
    diff = make_diff([message(pointer.key, src, dst)])
    high = chain.clock.next_key()
    st = stats(S, high, high, {0: {dst: 1}})
    with pytest.raises(DiffBelowCommitPointerError):
        queue.prepare_diff(diff, block(S, 2), diff_hash("below"), st)
    assert dump(queue) == before

    # An empty diff passes, and so does a diff starting just above the pointer.
    assert queue.apply_diff(make_diff(), block(S, 2), diff_hash("empty")) is True
    just_above = make_diff([message(pointer.key.next_value(), src, dst)])
    assert queue.apply_diff(just_above, block(S, 3), diff_hash("above")) is True
    assert queue.get_last_applied_seqno(S) == 3


def test_pointer_of_another_shard_does_not_constrain(queue: Queue, chain: Chain) -> None:
    committed = chain.apply(OTHER, 3)
    commit_on(queue, chain, 1, committed)
    src, dst = address_in(S), address_in(OTHER)
    diff = make_diff([message(QueueKey.min_for_lt(1).next_value(), src, dst)])
    assert queue.apply_diff(diff, block(S, 1), diff_hash("low")) is True


# -- order of checks --------------------------------------------------------------------------


def test_duplicate_check_runs_before_sequence_check(queue: Queue, chain: Chain) -> None:
    first = chain.apply(S, 2, seqno=1)
    chain.apply(S, 2, seqno=3)
    before = dump(queue)
    # The sequence rule alone would skip seqno 1 (<= 3); the duplicate check raises first.
    with pytest.raises(DiffConflictError):
        queue.apply_diff(first.diff, first.block, diff_hash("other"), None, DiffZone.BOTH)
    # Same hash: a duplicate (None) even with a zone in which the sequence rule applies.
    assert queue.prepare_diff(first.diff, first.block, first.hash, None, DiffZone.BOTH) is None
    assert dump(queue) == before


@pytest.mark.parametrize("zone", list(DiffZone))
def test_the_shards_last_diff_again_with_another_hash_conflicts_in_every_zone(
    queue: Queue, chain: Chain, zone: DiffZone
) -> None:
    """The shard's newest stored diff (its seqno is the highest stored: the duplicate
    check reads its record even when the sequence rule's own question came first) under
    another hash is a conflict, whether or not the zone asked for holds it."""
    chain.apply(S, 2, seqno=1)
    last = chain.apply(S, 2, seqno=2)
    before = dump(queue)
    with pytest.raises(DiffConflictError):
        queue.prepare_diff(last.diff, last.block, diff_hash("other"), None, zone)
    assert queue.prepare_diff(last.diff, last.block, last.hash, None, zone) is None
    assert dump(queue) == before


def test_duplicate_check_runs_before_pointer_check(queue: Queue, chain: Chain) -> None:
    committed = chain.apply(S, 3)
    commit_on(queue, chain, 1, committed)
    before = dump(queue)
    # The committed diff's messages are all at or below the pointer.
    assert queue.apply_diff(committed.diff, committed.block, committed.hash) is False
    with pytest.raises(DiffConflictError):
        queue.apply_diff(committed.diff, committed.block, diff_hash("x"))
    assert dump(queue) == before


def test_sequence_check_runs_before_pointer_check(queue: Queue, chain: Chain) -> None:
    chain.apply(S, 2, seqno=1)
    committed = chain.apply(S, 2, seqno=3)
    commit_on(queue, chain, 1, committed)
    before = dump(queue)
    src, dst = address_in(S), address_in(OTHER)
    below_pointer = make_diff([message(committed.messages[0].key, src, dst)])
    # seqno 2 <= last: skipped before the pointer check could fail.
    for zone in (DiffZone.BOTH, DiffZone.COMMITTED):
        assert queue.apply_diff(below_pointer, block(S, 2), diff_hash(2), None, zone) is False
    # seqno 9 is a gap: the sequence error wins over the pointer error.
    with pytest.raises(DiffSequenceError):
        queue.apply_diff(below_pointer, block(S, 9), diff_hash(9), None, DiffZone.BOTH)
    # Without a sequence check the pointer check is what fails.
    with pytest.raises(DiffBelowCommitPointerError):
        queue.apply_diff(below_pointer, block(S, 2), diff_hash(2))
    assert dump(queue) == before


# -- PendingDiff ------------------------------------------------------------------------------


def test_pending_diff_write(queue: Queue, chain: Chain) -> None:
    a = chain.build(S, 3)
    before = dump(queue)
    pending = queue.prepare_diff(a.diff, a.block, a.hash)
    assert isinstance(pending, PendingDiff)
    assert pending.state == "pending"
    assert dump(queue) == before  # nothing written before write()
    assert queue.get_diff_info(S, 1) is None
    pending.write()
    assert pending.state == "written"
    assert queue.get_diff_info(S, 1) == expected_info(a)
    written = dump(queue)
    with pytest.raises(ImqError):
        pending.write()
    with pytest.raises(ImqError):
        pending.discard()
    assert pending.state == "written"
    assert dump(queue) == written


def test_pending_diff_discard_leaves_no_trace(queue: Queue, chain: Chain) -> None:
    chain.apply(S, 2)
    before = dump(queue)
    router = PartitionRouter(dst={1: [address_in(OTHER, 5)]})
    a = chain.build(S, [address_in(OTHER, 5), address_in(BASE, 6)], router=router)
    pending = queue.prepare_diff(a.diff, a.block, a.hash)
    assert pending is not None
    pending.discard()
    assert pending.state == "discarded"
    with pytest.raises(ImqError):
        pending.discard()
    with pytest.raises(ImqError):
        pending.write()
    assert pending.state == "discarded"

    assert dump(queue) == before
    assert queue.get_diff_info(S, 2) is None
    assert not queue.is_diff_exists(a.block)
    assert queue.get_last_applied_seqno(S) == 1
    assert queue.get_diffs_tail_len(S, a.diff.min_message or QueueKey.MIN) == 0
    whole = QueueShardRange(S, QueueKey.MIN, QueueKey.MAX)
    assert queue.load_diff_statistics(1, whole) == {}
    with queue.iterator(1, [whole], BASE) as it:
        assert list(it) == []
    # The locks were released: the same diff can now be applied.
    assert queue.apply_diff(a.diff, a.block, a.hash) is True


def test_pending_diff_context_manager(queue: Queue, chain: Chain) -> None:
    a = chain.build(S, 2)
    before = dump(queue)

    def prepare() -> PendingDiff:
        pending = queue.prepare_diff(a.diff, a.block, a.hash)
        assert pending is not None
        return pending

    with prepare() as pending:
        assert pending.state == "pending"
    assert pending.state == "discarded"
    assert dump(queue) == before

    with pytest.raises(RuntimeError, match="boom"), prepare() as pending:
        raise RuntimeError("boom")
    assert pending.state == "discarded"
    assert dump(queue) == before

    with prepare() as pending:
        pending.write()
    assert pending.state == "written"
    assert queue.get_diff_info(S, 1) == expected_info(a)


# -- statistics -------------------------------------------------------------------------------


def test_statistics_none_derives_from_the_diff(queue: Queue, chain: Chain) -> None:
    q0, q1, q2, q3 = quarter_shards()
    low = address_in(q1, 7)
    router = PartitionRouter(dst={1: [low]}, src={2: [address_in(S, 1)]})
    dsts = [address_in(q0), low, address_in(q2), low, address_in(MC), address_in(q3)]
    a = chain.apply(S, dsts, router=router, processed_to={S: key(1), MC: key(2)})
    info = queue.get_diff_info(S, 1)
    assert info == expected_info(a)
    assert info is not None
    assert info.min_message == a.messages[0].key
    assert info.max_message == a.messages[-1].key
    assert info.shards_messages_count == {MC: 1, BASE: 5}
    assert info.router_dst == {1: frozenset([low])}
    assert info.router_src == {2: frozenset([address_in(S, 1)])}
    assert info.processed_to == {S: key(1), MC: key(2)}

    st = derived_stats(a.diff, S)
    whole = QueueShardRange(S, QueueKey.MIN, QueueKey.MAX)
    for partition in (0, 1, 2):
        assert queue.load_diff_statistics(partition, whole) == st.partitions.get(partition, {})
    assert queue.load_diff_statistics(1, whole) == {low: 2}
    assert sum(queue.load_diff_statistics(p, whole).get(low, 0) for p in (0, 2)) == 0
    assert queue.get_diffs_tail_len(S, info.max_message) == 1
    assert queue.get_diffs_tail_len(S, info.max_message.next_value()) == 0


def test_statistics_none_for_an_empty_diff(queue: Queue) -> None:
    assert queue.apply_diff(make_diff(), block(S, 1), diff_hash(1)) is True
    info = queue.get_diff_info(S, 1)
    assert info is not None
    assert (info.min_message, info.max_message) == (QueueKey.MIN, QueueKey.MIN)
    assert info.shards_messages_count == {}
    assert queue.get_diffs_tail_len(S, QueueKey.MIN) == 1
    assert rows(queue, Table.STATISTICS) == []
    assert rows(queue, Table.MESSAGES) == []


def test_explicit_statistics_are_used_verbatim(queue: Queue, chain: Chain) -> None:
    a = chain.build(S, 3)
    dst_a, dst_b = address_in(OTHER, 1), address_in(MC, 2)
    lo, hi = key(1), chain.clock.next_key()
    st = stats(S, lo, hi, {0: {dst_a: 10}, 3: {dst_b: 4}})
    assert queue.apply_diff(a.diff, a.block, a.hash, st) is True
    info = queue.get_diff_info(S, 1)
    assert info == expected_info(a, st)
    assert info is not None
    assert (info.min_message, info.max_message) == (lo, hi)
    assert info.shards_messages_count == {MC: 4, BASE: 10}
    whole = QueueShardRange(S, QueueKey.MIN, QueueKey.MAX)
    assert queue.load_diff_statistics(0, whole) == {dst_a: 10}
    assert queue.load_diff_statistics(3, whole) == {dst_b: 4}
    # The tail row sits at statistics.max_message, not at the last message key.
    assert queue.get_diffs_tail_len(S, hi) == 1
    assert queue.get_diffs_tail_len(S, hi.next_value()) == 0
    assert queue.load_separated_diff_statistics([0, 3], whole) == {
        0: {hi: {dst_a: 10}},
        3: {hi: {dst_b: 4}},
    }


def test_check_statistics_mode_refuses_any_difference(tmp_path: Path) -> None:
    q = Queue.open(tmp_path / "q", replace(quiet_config(), check_statistics=True))
    try:
        a = Chain(q).build(S, 3)
        right = derived_stats(a.diff, S)
        before = dump(q)
        for counts in ({0: {address_in(OTHER, 1): 3}}, {0: {address_in(OTHER, 1): 999}}, {}):
            wrong = stats(S, right.min_message, right.max_message, counts)
            with pytest.raises(ValueError, match="contradict"):
                q.apply_diff(a.diff, a.block, a.hash, wrong)
            with pytest.raises(ValueError, match="contradict"):
                q.prepare_diff(a.diff, a.block, a.hash, wrong)
        assert dump(q) == before
        assert q.apply_diff(a.diff, a.block, a.hash, right) is True
    finally:
        q.close()


def test_check_statistics_mode_refuses_bounds_that_miss_messages(tmp_path: Path) -> None:
    """The statistics' bounds become the diff's span, which commit, clear and GC act on:
    in the debug mode a span that leaves out a message is refused (nothing written); a
    wider span is the collator's to choose and passes."""
    q = Queue.open(tmp_path / "q", replace(quiet_config(), check_statistics=True))
    try:
        a = Chain(q).build(S, 3)
        right = derived_stats(a.diff, S)
        first, last = a.diff.min_message, a.diff.max_message
        assert first is not None and last is not None
        before = dump(q)
        for low, high in ((first.next_value(), last), (first, first), (QueueKey.MIN, first)):
            narrow = DiffStatistics(S, low, high, right.partitions)
            with pytest.raises(ValueError, match="does not hold its messages"):
                q.apply_diff(a.diff, a.block, a.hash, narrow)
        assert dump(q) == before
        wide = DiffStatistics(S, QueueKey.min_for_lt(first.lt), last, right.partitions)
        assert q.apply_diff(a.diff, a.block, a.hash, wide) is True
    finally:
        q.close()


def test_a_source_outside_the_block_shard_is_refused_with_check_sources(
    tmp_path: Path, chain: Chain
) -> None:
    q = Queue.open(tmp_path / "q", replace(quiet_config(), check_sources=True))
    try:
        inside = chain.build(S, 3)
        before = dump(q)
        for stranger in (address_in(OTHER, 5), address_in(MC, 5)):
            msgs = [*inside.messages[:2], message(chain.clock.next_key(), stranger, stranger)]
            diff = make_diff(msgs)
            with pytest.raises(ValueError, match="outside the block's shard"):
                q.apply_diff(diff, inside.block, inside.hash)
            with pytest.raises(ValueError, match="outside the block's shard"):
                q.prepare_diff(diff, inside.block, inside.hash)
        assert dump(q) == before
        assert q.apply_diff(inside.diff, inside.block, inside.hash) is True
    finally:
        q.close()


def test_a_block_of_a_workchain_without_std_addresses_refuses_every_source(
    tmp_path: Path, chain: Chain
) -> None:
    """No std address lives in workchain 128: every source is outside such a block's
    shard, named in a ``ValueError`` that says what to do (an audit: the check built an
    address in the block's workchain and raised ``Address``'s own error)."""
    with Queue.open(tmp_path / "q", replace(quiet_config(), check_sources=True)) as q:
        src = address_in(S, 5)
        msgs = [message(chain.clock.next_key(), src, address_in(OTHER, 1))]
        before = dump(q)
        with pytest.raises(ValueError, match=rf"source {src} is outside the block's shard \(a"):
            q.apply_diff(make_diff(msgs), block(ShardIdent.full(128), 1), diff_hash("w"))
        assert dump(q) == before


def test_a_source_outside_the_block_shard_is_stored_under_the_block_shard_by_default(
    queue: Queue, chain: Chain
) -> None:
    """As in the original, whose own tests send masterchain diffs' messages from the
    default address ``0:00..``: the queue files a message under its block's shard."""
    stranger = address_in(OTHER, 5)
    first, second = chain.clock.next_key(), chain.clock.next_key()
    msgs = [message(first, stranger, address_in(MC, 1)), message(second, stranger, stranger)]
    assert queue.apply_diff(make_diff(msgs), block(MC, 1), diff_hash("mc")) is True
    ranges = [QueueShardRange(MC, QueueKey.MIN, QueueKey.MAX)]
    with queue.iterator(0, ranges, MC) as it:
        assert [(m.source, m.message) for m in it] == [(MC, msgs[0])]
    with queue.iterator(0, ranges, OTHER) as it:
        assert [(m.source, m.message) for m in it] == [(MC, msgs[1])]


def test_statistics_for_another_shard(queue: Queue, chain: Chain) -> None:
    a = chain.build(S, 2)
    st = derived_stats(a.diff, OTHER)
    before = dump(queue)
    with pytest.raises(ValueError, match=str(OTHER)):
        queue.apply_diff(a.diff, a.block, a.hash, st)
    with pytest.raises(ValueError):
        queue.prepare_diff(a.diff, a.block, a.hash, st)
    assert dump(queue) == before
    assert queue.apply_diff(a.diff, a.block, a.hash) is True  # no lock left behind


# -- argument validation ----------------------------------------------------------------------

_A = make_diff()
_B = block(S, 1)
_H = diff_hash(1)

BAD_TYPES: list[tuple[str, dict[str, Any]]] = [
    ("diff list", {"diff": []}),
    ("diff None", {"diff": None}),
    ("block None", {"block": None}),
    ("block tuple", {"block": (S, 1)}),
    ("statistics dict", {"statistics": {0: {}}}),
    ("check_sequence str", {"check_sequence": "both"}),
]


@pytest.mark.parametrize("method", ["prepare_diff", "apply_diff"])
@pytest.mark.parametrize(("label", "override"), BAD_TYPES, ids=[b[0] for b in BAD_TYPES])
def test_bad_argument_types(
    queue: Queue, method: str, label: str, override: dict[str, Any]
) -> None:
    args: dict[str, Any] = {
        "diff": _A,
        "block": _B,
        "diff_hash": _H,
        "statistics": None,
        "check_sequence": None,
    }
    args.update(override)
    before = dump(queue)
    with pytest.raises(TypeError):
        getattr(queue, method)(**args)
    assert dump(queue) == before
    assert queue.apply_diff(_A, _B, _H) is True  # no lock left behind


@pytest.mark.parametrize("method", ["prepare_diff", "apply_diff"])
def test_diff_hash_of_the_wrong_type_is_a_type_error(queue: Queue, method: str) -> None:
    """API.md: "values of the wrong type [raise] TypeError" -- a str/int/bytearray hash."""
    before = dump(queue)
    for bad in ("00" * 32, 0, bytearray(32)):
        with pytest.raises(TypeError):
            getattr(queue, method)(_A, _B, bad)
    assert dump(queue) == before


@pytest.mark.parametrize("method", ["prepare_diff", "apply_diff"])
@pytest.mark.parametrize("size", [0, 31, 33])
def test_diff_hash_must_be_32_bytes(queue: Queue, method: str, size: int) -> None:
    before = dump(queue)
    with pytest.raises(ValueError):
        getattr(queue, method)(_A, _B, bytes(size))
    assert dump(queue) == before


def test_block_id_instead_of_short_is_a_type_error(queue: Queue) -> None:
    from builders import block_id

    with pytest.raises(TypeError):
        queue.apply_diff(_A, block_id(S, 1), _H)  # type: ignore[arg-type]


def test_messages_of_several_diffs_and_shards_are_stored_per_source(
    queue: Queue, chain: Chain
) -> None:
    a1 = chain.apply(S, 2)
    b1 = chain.apply(OTHER, 2)
    a2 = chain.apply(S, 2)
    ranges = [
        QueueShardRange(S, QueueKey.MIN, QueueKey.MAX),
        QueueShardRange(OTHER, QueueKey.MIN, QueueKey.MAX),
    ]
    with queue.iterator(0, ranges, BASE) as it:
        got = list(it)
    expected = sorted([*a1.iterated(), *b1.iterated(), *a2.iterated()], key=lambda m: m.message.key)
    assert got == expected
    assert len(rows(queue, Table.DIFF_INFO)) == 3
    assert len(rows(queue, Table.DIFF_TAIL)) == 3


@pytest.mark.parametrize("again_zone", [None, *DiffZone])
def test_the_remembered_top_again_with_another_hash_conflicts(
    queue: Queue, chain: Chain, again_zone: DiffZone | None
) -> None:
    """Prepares with the sequence rule let the store remember the shard's top diff (the
    fast path of a collator's next block); the top's own seqno again, under another
    hash, must still meet the duplicate check: a conflict that writes nothing."""
    for seqno in (1, 2):
        a = chain.build(S, 2, seqno=seqno)
        assert queue.apply_diff(a.diff, a.block, a.hash, None, DiffZone.BOTH)
        chain.record(a)
    before = dump(queue)
    other = chain.build(S, 3, seqno=2)
    with pytest.raises(DiffConflictError):
        queue.apply_diff(other.diff, other.block, diff_hash("other"), None, again_zone)
    assert dump(queue) == before
    assert queue.apply_diff(a.diff, a.block, a.hash, None, again_zone) is False
    assert dump(queue) == before
