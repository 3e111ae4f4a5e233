"""plan_commit (pure): skip rule, checks (D6), commit record and GC bounds (D7)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pytest

from imq.commit import CommitPlan, gc_bounds, plan_commit
from imq.errors import CommitError
from imq.types import BlockId, CommitPointer, DiffInfo, QueueKey, ShardIdent, TopBlock

MC = ShardIdent.MASTERCHAIN
LEFT = ShardIdent(0, 0x4000_0000_0000_0000)
RIGHT = ShardIdent(0, 0xC000_0000_0000_0000)

Record = dict[ShardIdent, dict[ShardIdent, QueueKey]]
Bounds = dict[tuple[int, ShardIdent], QueueKey]


def k(lt: int) -> QueueKey:
    return QueueKey.max_for_lt(lt)


def info(
    seqno: int, max_lt: int, processed_to: Mapping[ShardIdent, QueueKey] | None = None
) -> DiffInfo:
    return DiffInfo(
        min_message=QueueKey.min_for_lt(max_lt),
        max_message=k(max_lt),
        shards_messages_count={},
        hash=bytes((seqno % 256,)) * 32,
        processed_to=dict(processed_to or {}),
        router_src={},
        router_dst={},
        seqno=seqno,
    )


def top(shard: ShardIdent, seqno: int, ref: int | None = None, updated: bool = True) -> TopBlock:
    return TopBlock(BlockId(shard, seqno), seqno if ref is None else ref, updated)


class Diffs:
    """A dict-backed ``find_diff`` that records its calls."""

    def __init__(self, diffs: Mapping[tuple[ShardIdent, int], DiffInfo]) -> None:
        self.diffs = dict(diffs)
        self.calls: list[tuple[ShardIdent, int]] = []

    def __call__(self, shard: ShardIdent, seqno: int) -> DiffInfo | None:
        self.calls.append((shard, seqno))
        return self.diffs.get((shard, seqno))


def plan(
    tops: list[TopBlock],
    diffs: Mapping[tuple[ShardIdent, int], DiffInfo],
    *,
    partitions: Iterable[int] = (0, 1),
    pointers: Mapping[ShardIdent, CommitPointer] | None = None,
    last_mc_block: BlockId | None = None,
    record: Record | None = None,
    gc_requested: Bounds | None = None,
    zerostate_seqno: int = 0,
) -> CommitPlan | None:
    return plan_commit(
        tops,
        partitions,
        pointers=pointers or {},
        last_mc_block=last_mc_block,
        record=record or {},
        gc_requested=gc_requested or {},
        find_diff=Diffs(diffs),
        zerostate_seqno=zerostate_seqno,
    )


def must_plan(*args: object, **kwargs: object) -> CommitPlan:
    result = plan(*args, **kwargs)  # type: ignore[arg-type]
    assert result is not None
    return result


# --- the masterchain block and the skip rule ------------------------------------------


def test_first_commit() -> None:
    diffs = {
        (MC, 5): info(5, 50, {MC: k(40), LEFT: k(10)}),
        (LEFT, 3): info(3, 30, {MC: k(45), LEFT: k(20), RIGHT: k(7)}),
    }
    result = must_plan([top(MC, 5), top(LEFT, 3, ref=5)], diffs)
    assert result.mc_block == BlockId(MC, 5)
    assert result.moved == {MC: CommitPointer(k(50), 5), LEFT: CommitPointer(k(30), 3)}
    assert result.pointers == result.moved
    assert result.record == {
        MC: {MC: k(40), LEFT: k(10)},
        LEFT: {MC: k(45), LEFT: k(20), RIGHT: k(7)},
    }
    assert result.gc_requested == {
        (p, shard): key
        for p in (0, 1)
        for shard, key in {MC: k(40), LEFT: k(10), RIGHT: k(7)}.items()
    }


def test_masterchain_block_need_not_come_first() -> None:
    diffs = {(MC, 5): info(5, 50), (LEFT, 3): info(3, 30)}
    result = must_plan([top(LEFT, 3, ref=5), top(MC, 5)], diffs)
    assert result.mc_block == BlockId(MC, 5)
    assert set(result.moved) == {MC, LEFT}


@pytest.mark.parametrize("tops", [[], [top(LEFT, 3)], [top(LEFT, 3), top(RIGHT, 4)]])
def test_no_masterchain_block(tops: list[TopBlock]) -> None:
    with pytest.raises(CommitError, match="masterchain"):
        plan(tops, {(LEFT, 3): info(3, 30), (RIGHT, 4): info(4, 40)})


@pytest.mark.parametrize("pointer_seqno", [5, 6, 100])
def test_skip_when_mc_pointer_is_at_or_after_the_block(pointer_seqno: int) -> None:
    diffs = Diffs({(MC, 5): info(5, 50)})
    result = plan_commit(
        [top(MC, 5)],
        (0, 1),
        pointers={MC: CommitPointer(k(99), pointer_seqno)},
        last_mc_block=None,
        record={},
        gc_requested={},
        find_diff=diffs,
        zerostate_seqno=0,
    )
    assert result is None
    assert diffs.calls == []


def test_skip_even_if_the_top_blocks_are_otherwise_invalid() -> None:
    # the skip check comes first (§5.5 step 3): a duplicate shard is not looked at
    result = plan(
        [top(MC, 5), top(LEFT, 3), top(LEFT, 3)],
        {},
        pointers={MC: CommitPointer(k(99), 7)},
    )
    assert result is None


def test_mc_pointer_below_the_block_commits() -> None:
    result = must_plan(
        [top(MC, 5)],
        {(MC, 5): info(5, 50)},
        pointers={MC: CommitPointer(k(40), 4)},
    )
    assert result.moved == {MC: CommitPointer(k(50), 5)}


def test_pointer_of_another_shard_does_not_skip() -> None:
    result = must_plan(
        [top(MC, 5)],
        {(MC, 5): info(5, 50)},
        pointers={LEFT: CommitPointer(k(99), 100)},
    )
    assert result.pointers == {LEFT: CommitPointer(k(99), 100), MC: CommitPointer(k(50), 5)}


# --- duplicates and missing diffs -----------------------------------------------------


@pytest.mark.parametrize(
    "tops",
    [
        [top(MC, 5), top(LEFT, 3), top(LEFT, 3)],
        [top(MC, 5), top(LEFT, 3), top(LEFT, 2)],
        [top(MC, 5), top(MC, 5)],
        [top(MC, 5), top(MC, 4)],
        # a skipped entry between the two changes nothing
        [top(MC, 5), top(LEFT, 3), top(LEFT, 9, updated=False), top(LEFT, 2)],
        # the masterchain twice, even with one entry skipped (I24)
        [top(MC, 5), top(MC, 3, updated=False)],
        [top(MC, 3, updated=False), top(MC, 5)],
    ],
)
def test_duplicate_shard(tops: list[TopBlock]) -> None:
    diffs = {
        (MC, 5): info(5, 50),
        (MC, 4): info(4, 40),
        (LEFT, 3): info(3, 30),
        (LEFT, 2): info(2, 20),
    }
    with pytest.raises(CommitError, match="twice"):
        plan(tops, diffs)


@pytest.mark.parametrize(
    "tops",
    [
        [top(MC, 5), top(RIGHT, 9, updated=False), top(RIGHT, 9, updated=False)],
        [top(MC, 5), top(RIGHT, 9, ref=0), top(RIGHT, 8, ref=0)],
    ],
)
def test_a_shard_repeated_only_by_skipped_entries_is_not_listed_twice(
    tops: list[TopBlock],
) -> None:
    """SEMANTICS §5.5 step 4: an entry without a diff (not updated, or referenced at or
    below the zerostate) is skipped before "If that shard already has an entry", so
    only two entries with a diff each make a shard listed twice."""
    result = must_plan(tops, {(MC, 5): info(5, 50, {MC: k(45)})}, record={RIGHT: {LEFT: k(7)}})
    assert result.moved == {MC: CommitPointer(k(50), 5)}
    # a listed shard whose diff is missing keeps its entry; an unlisted one drops out
    kept = {RIGHT: {LEFT: k(7)}} if any(t.block_id.shard == RIGHT for t in tops) else {}
    assert result.record == {MC: {MC: k(45)}, **kept}


@pytest.mark.parametrize("found_first", [True, False])
def test_a_found_diff_outranks_a_skipped_entry_of_its_shard(found_first: bool) -> None:
    """A shard listed with a diff and again with a skipped entry, in either order: the
    diff sets its pointer and its record entry; the old entry the skip would keep is
    replaced (D7: the record holds the shard's newest committed diff)."""
    found, skipped = top(LEFT, 3), top(LEFT, 9, updated=False)
    pair = [found, skipped] if found_first else [skipped, found]
    result = must_plan(
        [top(MC, 5), *pair],
        {(MC, 5): info(5, 50), (LEFT, 3): info(3, 30, {LEFT: k(25)})},
        record={LEFT: {LEFT: k(1)}},
    )
    assert result.moved[LEFT] == CommitPointer(k(30), 3)
    assert result.record[LEFT] == {LEFT: k(25)}
    assert result.gc_requested[(0, LEFT)] == k(25)


@pytest.mark.parametrize(
    ("item", "zerostate"),
    [
        (top(LEFT, 3, ref=5), 0),
        (top(LEFT, 3, ref=5), 4),
        (top(LEFT, 0, ref=1), 0),
    ],
)
def test_missing_updated_diff_above_zerostate(item: TopBlock, zerostate: int) -> None:
    with pytest.raises(CommitError, match="not found") as exc:
        plan([top(MC, 5), item], {(MC, 5): info(5, 50)}, zerostate_seqno=zerostate)
    assert str(item.block_id.shard) in str(exc.value)


def test_missing_mc_diff_is_an_error_too() -> None:
    with pytest.raises(CommitError, match="not found"):
        plan([top(MC, 5)], {})


@pytest.mark.parametrize(
    ("item", "zerostate"),
    [
        (top(LEFT, 3, ref=5, updated=False), 0),  # unchanged top block
        (top(LEFT, 3, ref=5, updated=False), 10),
        (top(LEFT, 3, ref=4), 4),  # at the zerostate
        (top(LEFT, 3, ref=2), 4),  # below the zerostate
        (top(LEFT, 0, ref=0), 0),
    ],
)
def test_missing_diff_skipped(item: TopBlock, zerostate: int) -> None:
    old_entry = {LEFT: k(1), MC: k(2)}
    result = must_plan(
        [top(MC, 5), item],
        {(MC, 5): info(5, 50, {MC: k(10)})},
        record={LEFT: old_entry, RIGHT: {RIGHT: k(3)}},
        pointers={LEFT: CommitPointer(k(25), 2)},
        zerostate_seqno=zerostate,
    )
    assert result.moved == {MC: CommitPointer(k(50), 5)}
    assert result.pointers[LEFT] == CommitPointer(k(25), 2)  # untouched
    # listed-but-missing shard keeps its entry; unlisted RIGHT is dropped
    assert result.record == {MC: {MC: k(10)}, LEFT: old_entry}


def test_missing_diff_without_previous_entry_adds_none() -> None:
    result = must_plan(
        [top(MC, 5), top(LEFT, 3, updated=False)],
        {(MC, 5): info(5, 50, {MC: k(10)})},
    )
    assert result.record == {MC: {MC: k(10)}}


def test_all_diffs_missing_at_zerostate() -> None:
    result = must_plan([top(MC, 0, ref=0), top(LEFT, 0, ref=0)], {}, zerostate_seqno=0)
    assert result.mc_block == BlockId(MC, 0)
    assert result.moved == {}
    assert result.record == {}
    assert result.gc_requested == {}


# --- pointers never move backwards (D6) ----------------------------------------------


@pytest.mark.parametrize(
    ("old", "new_seqno", "new_lt"),
    [
        (CommitPointer(k(31), 2), 3, 30),  # key lower, seqno higher
        (CommitPointer(k(30), 4), 3, 30),  # same key, seqno lower
        (CommitPointer(k(20), 4), 3, 30),  # key higher, seqno lower
        (CommitPointer(k(31), 4), 3, 30),  # both lower
    ],
)
def test_backwards_pointer(old: CommitPointer, new_seqno: int, new_lt: int) -> None:
    diffs = {(MC, 5): info(5, 50), (LEFT, new_seqno): info(new_seqno, new_lt)}
    with pytest.raises(CommitError, match="backwards") as exc:
        plan([top(MC, 5), top(LEFT, new_seqno, ref=5)], diffs, pointers={LEFT: old})
    assert str(LEFT) in str(exc.value)


def test_backwards_mc_pointer() -> None:
    # the mc pointer's seqno is below the block, but its key is ahead of the new diff's
    with pytest.raises(CommitError, match="backwards"):
        plan([top(MC, 5)], {(MC, 5): info(5, 50)}, pointers={MC: CommitPointer(k(60), 4)})


@pytest.mark.parametrize(
    "old",
    [
        CommitPointer(k(30), 2),  # equal key, higher seqno: two empty diffs can share a key
        CommitPointer(k(30), 3),  # the very same diff again
        CommitPointer(k(29), 3),  # higher key, same seqno
        CommitPointer(k(10), 1),
    ],
)
def test_forward_or_equal_pointer_allowed(old: CommitPointer) -> None:
    diffs = {(MC, 5): info(5, 50), (LEFT, 3): info(3, 30)}
    result = must_plan([top(MC, 5), top(LEFT, 3, ref=5)], diffs, pointers={LEFT: old})
    assert result.moved[LEFT] == CommitPointer(k(30), 3)


def test_error_after_valid_items_plans_nothing() -> None:
    diffs = {(MC, 5): info(5, 50), (LEFT, 3): info(3, 30)}
    with pytest.raises(CommitError):
        plan(
            [top(MC, 5), top(LEFT, 3, ref=5), top(RIGHT, 4, ref=5)],
            diffs,
        )


# --- commit record and GC bounds (D7) -------------------------------------------------


def test_gc_bounds_is_the_minimum_over_entries() -> None:
    record: Record = {
        MC: {MC: k(10), LEFT: k(30)},
        LEFT: {MC: k(12), LEFT: k(25), RIGHT: k(5)},
        RIGHT: {LEFT: k(40), RIGHT: k(9)},
    }
    assert gc_bounds(record) == {MC: k(10), LEFT: k(25), RIGHT: k(5)}
    assert gc_bounds({}) == {}
    assert gc_bounds({MC: {}}) == {}


def test_record_replaces_entries_of_committed_shards() -> None:
    result = must_plan(
        [top(MC, 6), top(LEFT, 4, ref=6)],
        {(MC, 6): info(6, 60, {MC: k(55)}), (LEFT, 4): info(4, 40, {LEFT: k(38), MC: k(50)})},
        record={MC: {MC: k(10)}, LEFT: {LEFT: k(1)}, RIGHT: {RIGHT: k(2), LEFT: k(0)}},
    )
    assert result.record == {MC: {MC: k(55)}, LEFT: {LEFT: k(38), MC: k(50)}}
    # RIGHT is no longer listed, so its old entry no longer holds back LEFT
    assert result.gc_requested[(0, LEFT)] == k(38)
    assert (0, RIGHT) not in result.gc_requested


def test_idle_shard_holds_the_bound_back() -> None:
    # Commit 1: RIGHT's collator has read LEFT's messages only up to lt 5.
    first = must_plan(
        [top(MC, 5), top(LEFT, 3, ref=5), top(RIGHT, 7, ref=5)],
        {
            (MC, 5): info(5, 50, {MC: k(45)}),
            (LEFT, 3): info(3, 30, {LEFT: k(20)}),
            (RIGHT, 7): info(7, 70, {LEFT: k(5), RIGHT: k(60)}),
        },
    )
    assert first.gc_requested[(0, LEFT)] == k(5)
    # Commit 2: RIGHT is idle (top block unchanged) and its diff is already gone;
    # LEFT moved on. The bound for LEFT must stay at RIGHT's read position.
    second = must_plan(
        [top(MC, 6), top(LEFT, 4, ref=6), top(RIGHT, 7, ref=5, updated=False)],
        {
            (MC, 6): info(6, 60, {MC: k(58)}),
            (LEFT, 4): info(4, 40, {LEFT: k(35)}),
        },
        pointers=first.pointers,
        record=first.record,
        gc_requested=first.gc_requested,
    )
    assert second.record[RIGHT] == {LEFT: k(5), RIGHT: k(60)}
    assert second.gc_requested[(0, LEFT)] == k(5)
    assert second.gc_requested[(1, LEFT)] == k(5)
    assert second.gc_requested[(0, RIGHT)] == k(60)
    assert second.gc_requested[(0, MC)] == k(58)
    assert second.pointers[RIGHT] == CommitPointer(k(70), 7)
    assert RIGHT not in second.moved


def test_requested_bounds_per_partition() -> None:
    existing: Bounds = {
        (0, LEFT): k(1),  # overwritten (a given partition, a bounded shard)
        (2, LEFT): k(2),  # another partition: kept
        (7, RIGHT): k(3),  # another partition: kept
        (1, RIGHT): k(4),  # a given partition but RIGHT has no bound now: kept
    }
    result = must_plan(
        [top(MC, 5)],
        {(MC, 5): info(5, 50, {LEFT: k(20), MC: k(40)})},
        partitions=[0, 1, 3],
        gc_requested=existing,
    )
    assert result.gc_requested == {
        (0, LEFT): k(20),
        (1, LEFT): k(20),
        (3, LEFT): k(20),
        (0, MC): k(40),
        (1, MC): k(40),
        (3, MC): k(40),
        (2, LEFT): k(2),
        (7, RIGHT): k(3),
        (1, RIGHT): k(4),
    }
    assert existing[(0, LEFT)] == k(1)  # the input is not mutated


def test_requested_bound_overwritten_even_with_a_smaller_key() -> None:
    result = must_plan(
        [top(MC, 5)],
        {(MC, 5): info(5, 50, {LEFT: k(3)})},
        partitions=[0],
        gc_requested={(0, LEFT): k(9)},
    )
    assert result.gc_requested == {(0, LEFT): k(3)}


def test_no_partitions_keeps_requested_bounds() -> None:
    existing: Bounds = {(0, LEFT): k(9)}
    result = must_plan(
        [top(MC, 5)],
        {(MC, 5): info(5, 50, {LEFT: k(20)})},
        partitions=[],
        gc_requested=existing,
    )
    assert result.gc_requested == existing
    assert result.record == {MC: {LEFT: k(20)}}


def test_partitions_may_be_a_generator() -> None:
    result = must_plan(
        [top(MC, 5)],
        {(MC, 5): info(5, 50, {LEFT: k(20), RIGHT: k(21)})},
        partitions=(p for p in (0, 1)),
    )
    assert set(result.gc_requested) == {(0, LEFT), (1, LEFT), (0, RIGHT), (1, RIGHT)}


def test_plan_does_not_mutate_its_inputs() -> None:
    pointers = {LEFT: CommitPointer(k(10), 1)}
    record: Record = {LEFT: {LEFT: k(1)}}
    requested: Bounds = {(0, LEFT): k(1)}
    processed = {LEFT: k(25)}
    diffs = {(MC, 5): info(5, 50), (LEFT, 3): info(3, 30, processed)}
    result = must_plan(
        [top(MC, 5), top(LEFT, 3, ref=5)],
        diffs,
        pointers=pointers,
        record=record,
        gc_requested=requested,
    )
    assert pointers == {LEFT: CommitPointer(k(10), 1)}
    assert record == {LEFT: {LEFT: k(1)}}
    assert requested == {(0, LEFT): k(1)}
    result.record[LEFT][RIGHT] = k(0)
    assert diffs[(LEFT, 3)].processed_to == {LEFT: k(25)}


@pytest.mark.parametrize("last_seqno", [5, 6, 100])
def test_skip_when_the_last_committed_block_is_at_or_after_the_block(last_seqno: int) -> None:
    """I8: no masterchain pointer (its diff was absent), but a later block was committed."""
    last = BlockId(MC, last_seqno)
    assert plan([top(MC, 5, updated=False)], {}, last_mc_block=last) is None


def test_commit_proceeds_when_the_last_committed_block_is_older() -> None:
    result = must_plan([top(MC, 5, updated=False)], {}, last_mc_block=BlockId(MC, 4))
    assert result.mc_block == BlockId(MC, 5)
