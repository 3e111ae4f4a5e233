"""commit_diff on a real RocksDB (SEMANTICS §5.5, D6 pointers never move backwards,
D7 the persisted commit record and GC bounds)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import pytest
from builders import (
    MC,
    Applied,
    Chain,
    block_id,
    dump,
    key,
    open_queue,
    rows,
    split_shard,
    state,
    stats,
    top,
)

from imq import (
    BlockId,
    CommitError,
    CommitPointer,
    DiffZone,
    Queue,
    QueueKey,
    ShardIdent,
    TopBlock,
)
from imq.storage import Table, codec

S1 = split_shard(0, 1, 0)  # 0:4000000000000000
S2 = split_shard(0, 1, 1)  # 0:c000000000000000
SHARDS = [MC, S1, S2]
# Empty diffs of S1 that share max_message MIN (without statistics, a second empty diff
# would rest just above the first).
AT_MIN = stats(S1, QueueKey.MIN, QueueKey.MIN, {})


def pointer(a: Applied) -> CommitPointer:
    return CommitPointer(a.max_message, a.seqno)


def committed_world(chain: Chain) -> dict[str, Applied]:
    """MC:1, S1:1, S1:2, S2:1 applied; committed on MC:1 with S1:2 and S2:1."""
    w = {
        "mc1": chain.apply(MC, 2, processed_to={MC: key(100), S1: key(50), S2: key(70)}),
        "s1_1": chain.apply(S1, 3, processed_to={S1: key(10)}),
        "s1_2": chain.apply(S1, 3, processed_to={MC: key(90), S1: key(60), S2: key(40)}),
        "s2_1": chain.apply(S2, 2, processed_to={MC: key(95), S1: key(55)}),
    }
    assert chain.queue.commit_diff([w["mc1"].top(), w["s1_2"].top(1), w["s2_1"].top(1)])
    return w


# -- the happy path ---------------------------------------------------------------------------


def test_commit_moves_pointers_to_the_max_message_of_the_top_diffs(
    queue: Queue, chain: Chain
) -> None:
    assert queue.get_commit_pointers() == {}
    assert queue.get_last_committed_mc_block_id() is None
    w = committed_world(chain)
    assert queue.get_commit_pointers() == {
        MC: pointer(w["mc1"]),
        S1: pointer(w["s1_2"]),
        S2: pointer(w["s2_1"]),
    }
    assert queue.get_last_committed_mc_block_id() == block_id(MC, 1)
    stored = dict(codec.decode_pointer(k, v) for k, v in rows(queue, Table.COMMIT_POINTERS))
    assert stored == queue.get_commit_pointers()
    assert queue.metrics.counter("commits") == 1


def test_the_masterchain_block_may_be_anywhere_in_the_list(queue: Queue, chain: Chain) -> None:
    s1 = chain.apply(S1, 2)
    mc = chain.apply(MC, 1, seqno=4)
    assert queue.commit_diff([s1.top(4), top(MC, 4)]) is True
    assert queue.get_last_committed_mc_block_id() == block_id(MC, 4)
    assert queue.get_commit_pointers() == {MC: pointer(mc), S1: pointer(s1)}


def test_unlisted_shards_keep_their_pointers(queue: Queue, chain: Chain) -> None:
    w = committed_world(chain)
    s1_3 = chain.apply(S1, 2)
    mc2 = chain.apply(MC, 1)
    assert queue.commit_diff([mc2.top(), s1_3.top(2)]) is True
    assert queue.get_commit_pointers() == {
        MC: pointer(mc2),
        S1: pointer(s1_3),
        S2: pointer(w["s2_1"]),
    }
    assert queue.get_last_committed_mc_block_id() == block_id(MC, 2)


@pytest.mark.parametrize("mc_seqno", [1, 0])
def test_equal_or_older_mc_block_is_skipped(queue: Queue, chain: Chain, mc_seqno: int) -> None:
    w = committed_world(chain)
    s1_3 = chain.apply(S1, 2)
    if mc_seqno == 0:
        chain.apply(MC, 1, seqno=0)
    before, api = dump(queue), state(queue, SHARDS)
    assert queue.commit_diff([top(MC, mc_seqno, tag="x"), s1_3.top(1)]) is False
    assert dump(queue) == before
    assert state(queue, SHARDS) == api
    assert queue.get_commit_pointers()[S1] == pointer(w["s1_2"])
    assert queue.metrics.counter("commits_skipped") == 1
    assert queue.metrics.counter("commits") == 1


def test_a_commit_with_the_top_blocks_unchanged_is_legal(queue: Queue, chain: Chain) -> None:
    w = committed_world(chain)
    mc2 = chain.apply(MC, 1)
    tops = [mc2.top(), w["s1_2"].top(1, updated=False), w["s2_1"].top(1, updated=False)]
    assert queue.commit_diff(tops) is True
    assert queue.get_commit_pointers() == {
        MC: pointer(mc2),
        S1: pointer(w["s1_2"]),
        S2: pointer(w["s2_1"]),
    }


# -- errors -----------------------------------------------------------------------------------


def test_no_masterchain_block(queue: Queue, chain: Chain) -> None:
    s1 = chain.apply(S1, 2)
    before = dump(queue)
    with pytest.raises(CommitError, match="masterchain"):
        queue.commit_diff([s1.top(1)])
    with pytest.raises(CommitError):
        queue.commit_diff([])
    assert dump(queue) == before
    assert queue.get_commit_pointers() == {}


def test_duplicate_shard(queue: Queue, chain: Chain) -> None:
    mc = chain.apply(MC, 1)
    s1a = chain.apply(S1, 2)
    s1b = chain.apply(S1, 2)
    before = dump(queue)
    with pytest.raises(CommitError, match=re.escape(str(S1))):
        queue.commit_diff([mc.top(), s1a.top(1), s1b.top(1)])
    with pytest.raises(CommitError, match=re.escape(str(MC))):
        queue.commit_diff([mc.top(), mc.top()])
    assert dump(queue) == before
    # Entries without a diff are skipped before the check (SEMANTICS §5.5 step 4): a
    # shard repeated only by them is not listed twice.
    assert queue.commit_diff(
        [mc.top(), top(S2, 7, 1, updated=False), top(S2, 8, 1, updated=False), s1a.top(1)]
    )
    assert set(queue.get_commit_pointers()) == {MC, S1}


def test_missing_required_diff_names_block_ref_and_zerostate(tmp_path: Path) -> None:
    with open_queue(tmp_path / "q", zerostate_seqno=5) as queue:
        chain = Chain(queue)
        mc = chain.apply(MC, 1, seqno=6)
        before = dump(queue)
        with pytest.raises(CommitError) as err:
            queue.commit_diff([mc.top(), top(S1, 3, ref_by_mc_seqno=6)])
        text = str(err.value)
        assert str(S1) in text
        assert re.search(r"\b3\b", text)  # the block's seqno
        assert re.search(r"\b6\b", text)  # ref_by_mc_seqno
        assert re.search(r"\b5\b", text)  # zerostate seqno
        assert dump(queue) == before

        # The masterchain block's own diff is required too.
        with pytest.raises(CommitError, match=re.escape(str(MC))):
            queue.commit_diff([top(MC, 7)])
        assert dump(queue) == before


@pytest.mark.parametrize(
    ("ref_by_mc_seqno", "updated"),
    [(6, False), (5, True), (4, True), (0, False)],
    ids=["not-updated", "ref-at-zerostate", "ref-below-zerostate", "both"],
)
def test_missing_diff_is_skipped_when_not_required(
    tmp_path: Path, ref_by_mc_seqno: int, updated: bool
) -> None:
    with open_queue(tmp_path / "q", zerostate_seqno=5) as queue:
        chain = Chain(queue)
        mc = chain.apply(MC, 1, seqno=6)
        s2 = chain.apply(S2, 2)
        missing = top(S1, 3, ref_by_mc_seqno=ref_by_mc_seqno, updated=updated)
        assert queue.commit_diff([mc.top(), missing, s2.top(6)]) is True
        assert queue.get_commit_pointers() == {MC: pointer(mc), S2: pointer(s2)}
        assert queue.get_last_committed_mc_block_id() == block_id(MC, 6)


def test_pointer_never_moves_backwards(queue: Queue, chain: Chain) -> None:
    w = committed_world(chain)
    mc2 = chain.apply(MC, 1)
    before, api = dump(queue), state(queue, SHARDS)
    # S1:1 lies below the committed S1:2 (both key and seqno go back).
    with pytest.raises(CommitError) as err:
        queue.commit_diff([mc2.top(), w["s1_1"].top(2)])
    assert str(S1) in str(err.value)
    assert "backwards" in str(err.value)
    assert dump(queue) == before
    assert state(queue, SHARDS) == api
    assert queue.get_last_committed_mc_block_id() == block_id(MC, 1)
    assert queue.get_commit_pointers()[S1] == pointer(w["s1_2"])


def test_equal_key_needs_a_higher_seqno(queue: Queue, chain: Chain) -> None:
    """Two empty diffs share max_message MIN: forward by seqno is legal, back is not."""
    e1 = chain.apply(S1, 0, statistics=AT_MIN)
    e2 = chain.apply(S1, 0, statistics=AT_MIN)
    assert e1.max_message == e2.max_message == QueueKey.MIN
    mc1, mc2, mc3 = (chain.apply(MC, 0) for _ in range(3))
    assert queue.commit_diff([mc1.top(), e1.top(1)]) is True
    assert queue.get_commit_pointers()[S1] == CommitPointer(QueueKey.MIN, 1)
    assert queue.commit_diff([mc2.top(), e2.top(2)]) is True
    assert queue.get_commit_pointers()[S1] == CommitPointer(QueueKey.MIN, 2)
    before = dump(queue)
    with pytest.raises(CommitError, match=re.escape(str(S1))):
        queue.commit_diff([mc3.top(), e1.top(3)])
    assert dump(queue) == before


def _bad_commits(w: dict[str, Applied], mc2: Applied, s1_3: Applied) -> dict[str, list[TopBlock]]:
    return {
        "no-mc": [s1_3.top(2)],
        "duplicate": [mc2.top(), s1_3.top(2), s1_3.top(2)],
        "missing-after-valid": [mc2.top(), s1_3.top(2), top(S2, 9, 2)],
        "backwards-after-valid": [mc2.top(), s1_3.top(2), w["s1_1"].top(2)],
        "backwards": [mc2.top(), w["s1_1"].top(2)],
        "mc-missing": [top(MC, 9), s1_3.top(9)],
    }


@pytest.mark.parametrize(
    "case",
    [
        "no-mc",
        "duplicate",
        "missing-after-valid",
        "backwards-after-valid",
        "backwards",
        "mc-missing",
    ],
)
def test_every_commit_error_leaves_everything_unchanged(
    queue: Queue, chain: Chain, case: str
) -> None:
    w = committed_world(chain)
    mc2 = chain.apply(MC, 1, processed_to={S1: key(1)})
    s1_3 = chain.apply(S1, 2, processed_to={S2: key(1)})
    before, api = dump(queue), state(queue, SHARDS)
    tops = _bad_commits(w, mc2, s1_3)[case]
    with pytest.raises(CommitError):
        queue.commit_diff(tops)
    assert dump(queue) == before
    assert state(queue, SHARDS) == api
    # The failed commit released the write lock and a correct commit still works.
    assert queue.commit_diff([mc2.top(), s1_3.top(2)]) is True
    assert queue.get_commit_pointers()[S1] == pointer(s1_3)


def test_bad_argument_types(queue: Queue, chain: Chain) -> None:
    mc = chain.apply(MC, 0)
    with pytest.raises(TypeError):
        queue.commit_diff([mc.top(), block_id(S1, 1)])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        queue.commit_diff([mc.top()], partitions=[70_000])
    assert queue.get_commit_pointers() == {}


# -- persistence ------------------------------------------------------------------------------


def test_commit_is_persisted_across_reopen(db_path: Path) -> None:
    with open_queue(db_path) as queue:
        committed_world(Chain(queue))
        api = state(queue, SHARDS)
        before = dump(queue)
        assert api["gc_requested"]
        assert api["commit_record"]
    with open_queue(db_path) as queue:
        assert state(queue, SHARDS) == api
        assert dump(queue) == before
        assert queue.get_last_committed_mc_block_id() == block_id(MC, 1)


# -- GC bounds (D7) ---------------------------------------------------------------------------


def _requested(
    bounds: Mapping[ShardIdent, QueueKey], partitions: tuple[int, ...]
) -> dict[tuple[int, ShardIdent], QueueKey]:
    return {(p, s): k for p in partitions for s, k in bounds.items()}


def test_gc_bounds_are_the_min_processed_to_over_the_top_diffs(queue: Queue, chain: Chain) -> None:
    w = committed_world(chain)
    expected = {MC: key(90), S1: key(50), S2: key(40)}
    assert queue.gc_bounds()[0] == _requested(expected, (0, 1))
    assert queue.commit_record() == {
        MC: w["mc1"].diff.processed_to,
        S1: w["s1_2"].diff.processed_to,
        S2: w["s2_1"].diff.processed_to,
    }


def test_gc_bounds_follow_the_partitions_argument(queue: Queue, chain: Chain) -> None:
    mc = chain.apply(MC, 1, processed_to={S1: key(7)})
    s1 = chain.apply(S1, 1, processed_to={S1: key(9), MC: key(3)})
    assert queue.commit_diff([mc.top(), s1.top(1)], partitions=[0, 3]) is True
    assert queue.gc_bounds()[0] == _requested({S1: key(7), MC: key(3)}, (0, 3))


def test_gc_bounds_of_an_idle_shard(queue: Queue, chain: Chain) -> None:
    w = committed_world(chain)
    # Commit 2: S2 is listed unchanged and its diff still exists -> its entry stays.
    mc2 = chain.apply(MC, 1, processed_to={MC: key(300), S1: key(310), S2: key(320)})
    s1_3 = chain.apply(S1, 1, processed_to={MC: key(200), S1: key(210), S2: key(220)})
    tops = [mc2.top(), s1_3.top(2), w["s2_1"].top(1, updated=False)]
    assert queue.commit_diff(tops) is True
    idle = {MC: key(95), S1: key(55), S2: key(220)}
    requested = queue.gc_bounds()[0]
    assert {k: requested[k] for k in _requested(idle, (0, 1))} == _requested(idle, (0, 1))

    # The idle shard's DiffInfo is gone (as after a GC pass): D7 keeps its old entry, so
    # the bounds never pass the idle shard's read position.
    queue._store._tables[Table.DIFF_INFO].delete(codec.diff_info_key(S2, 1))
    mc3 = chain.apply(MC, 1, processed_to={MC: key(400), S1: key(410), S2: key(420)})
    s1_4 = chain.apply(S1, 1, processed_to={MC: key(500), S1: key(510), S2: key(520)})
    tops = [mc3.top(), s1_4.top(3), w["s2_1"].top(3, updated=False)]
    assert queue.commit_diff(tops) is True
    record = queue.commit_record()
    assert record[S2] == w["s2_1"].diff.processed_to
    idle = {MC: key(95), S1: key(55), S2: key(420)}
    requested = queue.gc_bounds()[0]
    assert {k: requested[k] for k in _requested(idle, (0, 1))} == _requested(idle, (0, 1))

    # A commit that no longer lists S2 drops its entry.
    mc4 = chain.apply(MC, 1, processed_to={MC: key(600), S1: key(610), S2: key(620)})
    assert queue.commit_diff([mc4.top(), s1_4.top(4, updated=False)]) is True
    assert set(queue.commit_record()) == {MC, S1}
    moved = {MC: key(500), S1: key(510), S2: key(520)}
    requested = queue.gc_bounds()[0]
    assert {k: requested[k] for k in _requested(moved, (0, 1))} == _requested(moved, (0, 1))


def test_gc_bounds_survive_reopen(db_path: Path) -> None:
    with open_queue(db_path) as queue:
        committed_world(Chain(queue))
        requested = dict(queue.gc_bounds()[0])
    with open_queue(db_path) as queue:
        assert queue.gc_bounds()[0] == requested


# -- zones ------------------------------------------------------------------------------------


def test_zones_change_after_commit(queue: Queue, chain: Chain) -> None:
    d = [chain.apply(S1, 2) for _ in range(3)]
    mc = chain.apply(MC, 1)
    for a in d:
        assert queue.get_diff_info(S1, a.seqno, DiffZone.COMMITTED) is None
        assert queue.get_diff_info(S1, a.seqno, DiffZone.UNCOMMITTED) is not None
        assert queue.get_diff_info(S1, a.seqno, DiffZone.BOTH) is not None
    assert queue.commit_diff([mc.top(), d[1].top(1)]) is True
    for a, committed in zip(d, [True, True, False], strict=True):
        info = queue.get_diff_info(S1, a.seqno)
        assert info is not None and info.seqno == a.seqno
        assert (queue.get_diff_info(S1, a.seqno, DiffZone.COMMITTED) == info) is committed
        assert (queue.get_diff_info(S1, a.seqno, DiffZone.UNCOMMITTED) == info) is not committed
        assert queue.get_diff_info(S1, a.seqno, DiffZone.BOTH) == info
    assert queue.get_diff_info(MC, mc.seqno, DiffZone.COMMITTED) is not None
    assert queue.get_diff_info(MC, mc.seqno, DiffZone.UNCOMMITTED) is None


def test_two_empty_diffs_with_one_max_message_are_both_counted(queue: Queue, chain: Chain) -> None:
    """D3: the tail key carries the seqno, so neither row overwrites the other."""
    e1 = chain.apply(S1, 0, statistics=AT_MIN)
    e2 = chain.apply(S1, 0, statistics=AT_MIN)
    assert queue.get_diffs_tail_len(S1, QueueKey.MIN) == 2
    assert len(rows(queue, Table.DIFF_TAIL)) == 2
    mc = chain.apply(MC, 0)
    assert queue.commit_diff([mc.top(), e2.top(1)]) is True
    assert queue.get_commit_pointers()[S1] == CommitPointer(QueueKey.MIN, 2)
    assert queue.get_diffs_tail_len(S1, QueueKey.MIN) == 2
    for a in (e1, e2):
        assert queue.get_diff_info(S1, a.seqno, DiffZone.COMMITTED) is not None


def test_last_committed_block_never_moves_back_without_a_masterchain_pointer(
    queue: Queue,
) -> None:
    """I8: a commit whose masterchain diff is absent sets the last committed block but no
    masterchain pointer; an older masterchain block must then be skipped, not recorded."""
    mc = ShardIdent.MASTERCHAIN
    assert queue.commit_diff([TopBlock(BlockId(mc, 5), 5, updated=False)]) is True
    assert queue.commit_diff([TopBlock(BlockId(mc, 3), 3, updated=False)]) is False
    assert queue.commit_diff([TopBlock(BlockId(mc, 5), 5, updated=False)]) is False
    last = queue.get_last_committed_mc_block_id()
    assert last is not None and last.seqno == 5
