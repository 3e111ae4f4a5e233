"""An outside acceptance audit (stop 46), written black-box from the project's contract
(spec API.md, SEMANTICS.md, FORMAT.md) and its docs (docs/api.md, docs/behaviour.md).

Only the public API is used: ``from imq import ...`` (and ``imq.state`` builders, a
public module per docs/api.md, to make valid message bodies).

Each test pins one stated rule (quoted in its docstring) that the rest of the suite did
not pin in this form. The audit's two mismatches (settings beside the ``[internal_queue]``
table dropped without a word) are kept in ``tests/unit/test_config.py``.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import block_id, digest, top

from imq import (
    Address,
    BlockIdShort,
    CommitError,
    CommitPointer,
    DiffConflictError,
    DiffSequenceError,
    DiffStatistics,
    DiffZone,
    ImqError,
    Message,
    PartitionRouter,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    StartupError,
)

K = QueueKey
MC = ShardIdent.MASTERCHAIN
BC = ShardIdent.BASECHAIN
LEFT = ShardIdent(0, 0x4000_0000_0000_0000)
RIGHT = ShardIdent(0, 0xC000_0000_0000_0000)
FULL = (K.MIN, K.MAX)


def addr(wc: int, n: int, first: int | None = None) -> Address:
    acc = digest("acc", wc, n)
    if first is not None:
        acc = bytes([first]) + acc[1:]
    return Address(wc, acc)


A0 = addr(0, 1)
A1 = addr(0, 2)
AM = addr(-1, 3)
AL = addr(0, 4, first=0x10)  # in LEFT
AR = addr(0, 5, first=0x90)  # in RIGHT


def msg(lt: int, src: Address, dst: Address, salt: object = 0) -> Message:
    return Message(K(lt, digest("m", lt, salt)), src, dst, b"body%d" % lt)


def rng(shard: ShardIdent, lo: QueueKey = K.MIN, hi: QueueKey = K.MAX) -> QueueShardRange:
    return QueueShardRange(shard, lo, hi)


@pytest.fixture
def q(tmp_path: Path) -> Iterator[Queue]:
    queue = Queue.open(tmp_path / "q", QueueConfig(gc_enabled=False))
    try:
        yield queue
    finally:
        queue.close()


def all_keys(queue: Queue, partition: int, source: ShardIdent) -> list[int]:
    """lts of every stored message of (partition, source), whatever its destination."""
    out: list[int] = []
    for for_shard in (MC, BC):
        out += [m.message.key.lt for m in queue.iterator(partition, [rng(source)], for_shard)]
    return sorted(out)


# ==========================================================================================
# Coverage: specific stated rules
# ==========================================================================================


def test_duplicate_check_runs_before_the_sequence_check(q: Queue) -> None:
    """SEMANTICS §5.3: "Checks, in this exact order: ... 2. Duplicate check ... Found with a
    different stored hash -> error ... 3. Sequence check, only if check_sequence". A
    re-collated block below the last seqno is a conflict, not a silent skip."""
    assert q.apply_diff(QueueDiff([msg(10, A0, A1)]), BlockIdShort(BC, 1), digest("b1"))
    assert q.apply_diff(QueueDiff([msg(20, A0, A1)]), BlockIdShort(BC, 2), digest("b2"))
    with pytest.raises(DiffConflictError):
        q.prepare_diff(
            QueueDiff([msg(10, A0, A1)]),
            BlockIdShort(BC, 1),
            digest("other"),
            check_sequence=DiffZone.BOTH,
        )


def test_sequence_skip_runs_before_the_commit_pointer_check(q: Queue) -> None:
    """SEMANTICS §5.3: the sequence check (3: "new seqno <= last.seqno -> return none") comes
    before the commit-pointer check (4). A stale diff below the pointer is skipped with
    None / False when check_sequence is set, and raises only without it."""
    q.apply_diff(QueueDiff([msg(10, A0, A1)]), BlockIdShort(BC, 1), digest("b1"))
    q.apply_diff(QueueDiff(), BlockIdShort(MC, 1), digest("m1"))
    assert q.commit_diff([top(MC, 1), top(BC, 1, 1)])
    q.apply_diff(QueueDiff([msg(20, A0, A1)]), BlockIdShort(BC, 3), digest("b3"))
    stale = QueueDiff([msg(5, A0, A1)])
    assert (
        q.prepare_diff(stale, BlockIdShort(BC, 2), digest("b2"), check_sequence=DiffZone.BOTH)
        is None
    )
    assert (
        q.apply_diff(stale, BlockIdShort(BC, 2), digest("b2"), check_sequence=DiffZone.BOTH)
        is False
    )
    assert not q.is_diff_exists(BlockIdShort(BC, 2))


def test_commit_pointer_is_the_stored_statistics_max(q: Queue) -> None:
    """SEMANTICS §1.10/§5.5: the DiffInfo's min/max are "taken from the DiffStatistics"
    (not recomputed from the messages) and commit sets "pointers[item.shard] =
    (diff.max_message, diff.seqno)"; the pointer check reads the first message key, not
    statistics.min (§5.3 step 4)."""
    q.apply_diff(QueueDiff([msg(10, A0, A1)]), BlockIdShort(BC, 1), digest("b1"))
    q.apply_diff(QueueDiff(), BlockIdShort(MC, 1), digest("m1"))
    q.commit_diff([top(MC, 1), top(BC, 1, 1)])
    # statistics.min is below the pointer, the messages are above: accepted.
    st = DiffStatistics(BC, K.MIN, K.max_for_lt(25), {0: {A1: 1}})
    assert q.apply_diff(QueueDiff([msg(20, A0, A1)]), BlockIdShort(BC, 2), digest("b2"), st)
    info = q.get_diff_info(BC, 2)
    assert info is not None
    assert (info.min_message, info.max_message) == (K.MIN, K.max_for_lt(25))
    q.apply_diff(QueueDiff(), BlockIdShort(MC, 2), digest("m2"))
    assert q.commit_diff([top(MC, 2), top(BC, 2, 2)])
    assert q.get_commit_pointers()[BC].key == K.max_for_lt(25)
    assert q.get_commit_pointers()[BC].seqno == 2


def test_zone_is_decided_by_key_only_and_drives_the_sequence_rule(q: Queue) -> None:
    """SEMANTICS §6: "Which zone a diff is in is decided only by comparing the shard's
    commit pointer key with the diff's max_message ... The pointer's seqno is not used";
    §5.3: "If last does not exist, or that diff is not visible in zone, there is no
    sequence constraint"."""
    q.apply_diff(QueueDiff([msg(10, A0, A1)]), BlockIdShort(BC, 1), digest("b1"))
    q.apply_diff(QueueDiff(), BlockIdShort(MC, 1), digest("m1"))
    q.commit_diff([top(MC, 1), top(BC, 1, 1)])
    # seqno 3 (above the pointer's seqno 1) but max_message below the pointer's key.
    low = DiffStatistics(BC, K.MIN, K.max_for_lt(5), {})
    assert q.apply_diff(QueueDiff(), BlockIdShort(BC, 3), digest("b3"), low)
    assert q.get_diff_info(BC, 3, DiffZone.COMMITTED) is not None
    assert q.get_diff_info(BC, 3, DiffZone.UNCOMMITTED) is None
    far = QueueDiff([msg(90, A0, A1)])
    with q.prepare_diff(
        far, BlockIdShort(BC, 9), digest("b9"), check_sequence=DiffZone.UNCOMMITTED
    ) as pd:
        assert pd is not None  # last (3) is not uncommitted: no constraint
    with pytest.raises(DiffSequenceError):  # 3 is committed, 9 != 4
        q.prepare_diff(far, BlockIdShort(BC, 9), digest("b9"), check_sequence=DiffZone.COMMITTED)


def test_iterator_position_holds_skips_gathered_while_refilling(q: Queue) -> None:
    """SEMANTICS §11.2: next() first refills every shard not in the heap (a Skip sets
    current_position[shard] = key and pulling continues), then pops the smallest message.
    §11.3: "It holds only shards that have yielded or skipped at least one message"."""
    q.apply_diff(QueueDiff([msg(10, AL, AR), msg(12, AL, AL)]), BlockIdShort(LEFT, 1), digest("L1"))
    q.apply_diff(
        QueueDiff([msg(11, AR, AL), msg(14, AR, AM)]), BlockIdShort(RIGHT, 1), digest("R1")
    )
    q.apply_diff(QueueDiff([msg(9, AM, AL)]), BlockIdShort(MC, 1), digest("M1"))
    it = q.iterator(0, [rng(LEFT), rng(RIGHT), rng(MC)], LEFT)
    assert it.current_position() == {}
    first = next(it)
    assert (first.source, first.message.key.lt) == (MC, 9)
    # LEFT's message 10 (for RIGHT) was skipped during the refill, before 9 was popped;
    # RIGHT's 11 is buffered, not consumed.
    assert {s: k.lt for s, k in it.current_position().items()} == {MC: 9, LEFT: 10}
    assert [(m.source, m.message.key.lt) for m in it] == [(RIGHT, 11), (LEFT, 12)]
    # RIGHT's trailing 14 (for the masterchain) was skipped: it counts.
    assert {s: k.lt for s, k in it.current_position().items()} == {MC: 9, LEFT: 12, RIGHT: 14}


def test_iterator_range_is_half_open_even_at_max(q: Queue) -> None:
    """API.md: QueueShardRange is "half-open [from_key, to_key)"; SEMANTICS §5.2: upper
    bound key(partition, S, to) exclusive. A message at QueueKey.MAX is never in [MIN, MAX),
    while load/tail counts still see its diff (I1: tail counts MAX included)."""
    assert q.apply_diff(QueueDiff([Message(K.MIN, A0, A1)]), BlockIdShort(BC, 1), digest("b1"))
    assert q.apply_diff(QueueDiff([Message(K.MAX, A0, A1)]), BlockIdShort(BC, 2), digest("b2"))
    assert [m.message.key for m in q.iterator(0, [rng(BC)], BC)] == [K.MIN]
    assert q.get_diffs_tail_len(BC, K.MAX) == 1
    assert q.load_diff_statistics(0, rng(BC)) == {A1: 1}  # the MAX diff is outside [MIN, MAX)


def test_pointer_at_max_clear_keeps_the_committed_diff(q: Queue) -> None:
    """SEMANTICS §6: "uncommitted messages of a shard are those with key > pointer" and
    QueueKey.next_value "saturates at MAX": a pointer at MAX leaves nothing uncommitted, so
    a clear must not remove the committed diff whose message is at MAX."""
    q.apply_diff(QueueDiff([Message(K.MAX, A0, A1)]), BlockIdShort(BC, 1), digest("b1"))
    q.apply_diff(QueueDiff(), BlockIdShort(MC, 1), digest("m1"))
    assert q.commit_diff([top(MC, 1), top(BC, 1, 1)])
    assert q.get_commit_pointers()[BC].key == K.MAX
    q.clear_uncommitted_state(top_shards=[BC])
    assert q.is_diff_exists(BlockIdShort(BC, 1))
    assert q.get_diffs_tail_len(BC, K.MIN) == 1


def test_two_masterchain_entries_are_a_listed_twice_error(q: Queue) -> None:
    """SEMANTICS §5.5: "mc_block_id = the first item whose block id is masterchain"; every
    item with a diff sets pointers[item.shard], "If that shard already has an entry ->
    error". API.md: CommitError for "a shard listed twice"; nothing written."""
    q.apply_diff(QueueDiff(), BlockIdShort(MC, 1), digest("m1"))
    q.apply_diff(QueueDiff(), BlockIdShort(MC, 2), digest("m2"))
    with pytest.raises(CommitError, match="twice"):
        q.commit_diff([top(MC, 2), top(MC, 1)])
    assert q.get_commit_pointers() == {}
    assert q.get_last_committed_mc_block_id() is None


def test_a_skipped_entry_does_not_make_its_shard_listed_twice(q: Queue) -> None:
    """SEMANTICS §5.5 step 4: an item with no diff that is not updated "otherwise skip[s]
    the item"; only "If there is a diff: pointers[item.shard] = ...  If that shard already
    has an entry -> error". So a shard listed once with its diff and once more with a
    skipped entry (either order) commits; the diff sets the pointer. Two entries with a
    diff each stay an error, with a skipped one between them."""
    q.apply_diff(QueueDiff([msg(10, AL, AR)]), BlockIdShort(LEFT, 1), digest("l1"))
    for seqno in (1, 2):
        q.apply_diff(QueueDiff(), BlockIdShort(MC, seqno), digest(f"m{seqno}"))
    skipped = top(LEFT, 99, ref_by_mc_seqno=1, updated=False)
    assert q.commit_diff([top(MC, 1), top(LEFT, 1), skipped]) is True
    stored = q.get_diff_info(LEFT, 1)
    assert stored is not None
    assert q.get_commit_pointers()[LEFT] == CommitPointer(stored.max_message, 1)
    q.apply_diff(QueueDiff([msg(20, AL, AR)]), BlockIdShort(LEFT, 2), digest("l2"))
    with pytest.raises(CommitError, match="twice"):
        q.commit_diff([top(MC, 2), top(LEFT, 1), skipped, top(LEFT, 2)])
    assert q.get_last_committed_mc_block_id() == block_id(MC, 1)
    assert q.commit_diff([top(MC, 2), skipped, top(LEFT, 2)]) is True
    assert q.get_commit_pointers()[LEFT].seqno == 2


def test_missing_diff_referenced_at_the_zerostate_seqno_is_skipped(tmp_path: Path) -> None:
    """SEMANTICS §5.5 step 4: a missing diff is an error only when
    "item.updated && item.block.ref_by_mc_seqno > zerostate_id.seqno" (strictly);
    otherwise the item is skipped."""
    with Queue.open(tmp_path / "q", QueueConfig(gc_enabled=False), zerostate_seqno=5) as q:
        q.apply_diff(QueueDiff(), BlockIdShort(MC, 6), digest("m6"))
        assert q.commit_diff([top(MC, 6), top(BC, 3, ref_by_mc_seqno=5, updated=True)]) is True
        assert set(q.get_commit_pointers()) == {MC}
        q.apply_diff(QueueDiff(), BlockIdShort(MC, 7), digest("m7"))
        with pytest.raises(CommitError, match="zerostate seqno 5"):
            q.commit_diff([top(MC, 7), top(BC, 3, ref_by_mc_seqno=6, updated=True)])
        assert q.get_last_committed_mc_block_id() == block_id(MC, 6)


def test_clear_with_no_partitions_still_removes_the_diffs_own_partitions(q: Queue) -> None:
    """docs/behaviour.md 5.4 (I3): clear removes the cleared diffs' "messages and statistics
    in every partition they wrote rows into ... and in the given partitions", so even
    ``partitions=()`` leaves no orphan message of a cleared diff (here in partitions 0, 1
    and 5)."""
    router = PartitionRouter(dst={1: [A1], 5: [AM]})
    diff = QueueDiff([msg(10, A0, A1), msg(11, A0, AM), msg(12, A0, A0)], router=router)
    q.apply_diff(diff, BlockIdShort(BC, 1), digest("b1"))
    assert [all_keys(q, p, BC) for p in (0, 1, 5)] == [[12], [10], [11]]
    q.clear_uncommitted_state(partitions=(), top_shards=[BC])
    assert not q.is_diff_exists(BlockIdShort(BC, 1))
    assert [all_keys(q, p, BC) for p in (0, 1, 5)] == [[], [], []]
    assert q.load_separated_diff_statistics([0, 1, 5], rng(BC)) == {0: {}, 1: {}, 5: {}}


def test_export_refuses_a_diff_whose_messages_gc_partly_removed(q: Queue) -> None:
    """API.md export_state: "raises ImqError if a needed diff or any of its messages is no
    longer stored". A GC bound inside a diff's key span removes some of its messages but
    keeps its record (§7.3: tails/infos go only when max_message <= end_key)."""
    msgs = [msg(10, A0, A1), msg(11, A0, A1), msg(12, A0, A1)]
    q.apply_diff(QueueDiff(msgs), BlockIdShort(BC, 1), digest("b1"))
    q.apply_diff(QueueDiff([], {BC: msgs[1].key}), BlockIdShort(MC, 1), digest("m1"))
    q.commit_diff([top(MC, 1), top(BC, 1, 1)])
    assert q.run_gc() == 2  # (0, BC) and (1, BC)
    assert q.is_diff_exists(BlockIdShort(BC, 1))
    assert all_keys(q, 0, BC) == [12]
    out = io.BytesIO()
    with pytest.raises(ImqError, match="0:8000000000000000:1"):
        q.export_state(BC, 1, 1, out)


def test_startup_with_same_seqno_other_block_changes_nothing(q: Queue) -> None:
    """SEMANTICS §14.2 step 3: require "c == last_block_id or c.seqno < last_block_id.seqno";
    API.md: "startup checks first and clears only if the check passes; a StartupError
    changes nothing". Same seqno, different hashes: refused, uncommitted diff kept."""
    q.apply_diff(QueueDiff(), BlockIdShort(MC, 1), digest("m1"))
    q.commit_diff([top(MC, 1)])
    q.apply_diff(QueueDiff([msg(10, A0, A1)]), BlockIdShort(BC, 1), digest("b1"))
    with pytest.raises(StartupError):
        q.startup(block_id(MC, 1, tag="other"), [BC])
    assert q.is_diff_exists(BlockIdShort(BC, 1))
    q.startup(block_id(MC, 1), [BC])
    assert not q.is_diff_exists(BlockIdShort(BC, 1))


def test_last_applied_seqno_finds_the_u32_max_seqno(q: Queue) -> None:
    """API.md get_last_applied_seqno: "highest seqno with a stored diff, either zone"
    (SEMANTICS §5.12); seqno is u32, so 2**32-1 must be found, and seqno 0 too."""
    q.apply_diff(QueueDiff([msg(5, A0, A1)]), BlockIdShort(BC, 0), digest("0"))
    assert q.get_last_applied_seqno(BC) == 0
    q.apply_diff(QueueDiff([msg(50, A0, A1)]), BlockIdShort(BC, 2**32 - 1), digest("max"))
    assert q.get_last_applied_seqno(BC) == 2**32 - 1


def test_waiting_commit_blocks_new_prepares_until_the_pending_diff_goes(q: Queue) -> None:
    """SEMANTICS §4: "commit and clear wait until every pending (prepared, unwritten) diff
    is written or dropped, and while one of them waits, new prepares wait behind it"
    (writer-preferring lock), even prepares of another shard."""
    q.apply_diff(QueueDiff(), BlockIdShort(MC, 1), digest("m1"))
    pending = q.prepare_diff(QueueDiff([msg(5, A0, A1)]), BlockIdShort(BC, 1), digest("b1"))
    assert pending is not None
    done: dict[str, float] = {}

    def commit() -> None:
        q.commit_diff([top(MC, 1)])
        done["commit"] = time.monotonic()

    def apply_other() -> None:
        q.apply_diff(QueueDiff(), BlockIdShort(LEFT, 1), digest("L1"))
        done["apply"] = time.monotonic()

    committer = threading.Thread(target=commit)
    committer.start()
    time.sleep(0.2)
    applier = threading.Thread(target=apply_other)
    applier.start()
    time.sleep(0.4)
    assert done == {}  # both wait: the commit for the pending diff, the apply behind it
    released = time.monotonic()
    pending.write()
    committer.join(10)
    applier.join(10)
    assert set(done) == {"commit", "apply"}
    assert min(done.values()) >= released
