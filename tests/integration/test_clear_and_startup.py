"""clear_uncommitted_state and startup on a real RocksDB (SEMANTICS §5.6, §14.2).

The strongest check here: after a clear, the database is byte-for-byte the database of
a second queue that was fed only the diffs that should survive.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from builders import (
    MC,
    Applied,
    Chain,
    Clock,
    address_in,
    block,
    block_id,
    dump,
    full_range,
    iterate_all,
    message_keys,
    open_queue,
    quiet_config,
    rows,
    shard_rows,
    split_shard,
    state,
    stats,
    top,
)

from imq import (
    DiffZone,
    IteratedMessage,
    PartitionRouter,
    Queue,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    StartupError,
)
from imq.storage import Table
from imq.testing.model import DiffInput, QueueModel

S1 = split_shard(0, 1, 0)  # has a commit pointer
S2 = split_shard(0, 1, 1)  # no pointer, listed in top_shards
S3 = ShardIdent.full(1)  # no pointer, not listed: never touched
SHARDS = [MC, S1, S2, S3]
HOT = address_in(S2, 42)  # routed to partition 2 by destination
LOW = address_in(S1, 43)  # routed to partition 1 by destination


@dataclass
class World:
    mc1: Applied
    s1_1: Applied
    s1_2: Applied
    s2_1: Applied
    s3_1: Applied
    mc2: Applied

    @property
    def survivors(self) -> list[Applied]:
        return [self.mc1, self.s1_1, self.s3_1]

    @property
    def cleared(self) -> list[Applied]:
        return [self.s1_2, self.s2_1, self.mc2]


def build_world(queue: Queue, *, with_uncommitted: bool = True, mc_seqno: int = 1) -> World:
    """Same calls, same bytes: ``with_uncommitted=False`` builds the expected state."""
    chain = Chain(queue, Clock())
    router = PartitionRouter(dst={2: [HOT], 1: [LOW]})
    w = World(
        mc1=chain.build(MC, [address_in(S1), HOT], seqno=mc_seqno, router=router),
        s1_1=chain.build(S1, [address_in(S2), HOT, LOW], router=router),
        s1_2=chain.build(S1, [HOT, LOW, address_in(S2, 3), address_in(MC)], seqno=2, router=router),
        s2_1=chain.build(S2, [HOT, address_in(S1, 4)], router=router),
        s3_1=chain.build(S3, [address_in(S3, 5), HOT], router=router),
        mc2=chain.build(MC, [address_in(S2, 6)], seqno=mc_seqno + 1),
    )
    for a in [w.mc1, w.s1_1, w.s3_1, *(w.cleared if with_uncommitted else [])]:
        assert queue.apply_diff(a.diff, a.block, a.hash)
    assert queue.commit_diff([w.mc1.top(), w.s1_1.top(mc_seqno)])
    return w


@pytest.fixture
def reference(tmp_path: Path) -> dict[str, list[tuple[bytes, bytes]]]:
    with open_queue(tmp_path / "reference") as ref:
        build_world(ref, with_uncommitted=False)
        return dump(ref)


def all_messages(queue: Queue, partition: int) -> list[IteratedMessage]:
    return iterate_all(queue, SHARDS, partition, ShardIdent.full(0)) + iterate_all(
        queue, SHARDS, partition, MC
    )


def expected_messages(applied: list[Applied], partition: int) -> list[IteratedMessage]:
    out = []
    for a in applied:
        for m in a.messages:
            if a.diff.router.partition_for(m.src, m.dst) == partition and m.dst.workchain in (
                0,
                -1,
            ):
                out.append(IteratedMessage(a.shard, m))
    return sorted(out, key=lambda im: (im.message.dst.workchain != 0, im.message.key))


# -- clear ------------------------------------------------------------------------------------


def test_clear_leaves_exactly_the_committed_state(
    queue: Queue, reference: dict[str, list[tuple[bytes, bytes]]]
) -> None:
    w = build_world(queue)
    s3_rows = {t: shard_rows(queue, t, S3) for t in Table if t not in (Table.VARS,)}
    pointers = queue.get_commit_pointers()
    assert set(pointers) == {MC, S1}

    queue.clear_uncommitted_state(top_shards=[S2])

    assert dump(queue) == reference
    assert queue.get_commit_pointers() == pointers
    assert queue.get_last_committed_mc_block_id() == block_id(MC, 1)
    # S1: the uncommitted diff is gone, the committed one intact.
    assert queue.get_diff_info(S1, 2) is None
    assert queue.get_diff_info(S1, 1, DiffZone.COMMITTED) is not None
    assert queue.get_last_applied_seqno(S1) == 1
    assert queue.get_diffs_tail_len(S1, QueueKey.MIN) == 1
    # S2: no pointer but listed: cleared entirely.
    assert queue.get_last_applied_seqno(S2) is None
    assert queue.get_diffs_tail_len(S2, QueueKey.MIN) == 0
    for table in (Table.MESSAGES, Table.STATISTICS, Table.DIFF_TAIL, Table.DIFF_INFO):
        assert shard_rows(queue, table, S2) == []
    # MC: the uncommitted mc diff is gone.
    assert queue.get_last_applied_seqno(MC) == 1
    # S3: untouched, row for row.
    assert {t: shard_rows(queue, t, S3) for t in s3_rows} == s3_rows
    assert queue.get_last_applied_seqno(S3) == 1
    # Messages: only committed ones (and S3's) remain, in every partition.
    for partition in (0, 1, 2):
        assert all_messages(queue, partition) == expected_messages(w.survivors, partition)
    assert queue.metrics.counter("uncommitted_cleared") == 1


def test_committed_messages_and_stats_are_kept(queue: Queue) -> None:
    w = build_world(queue)
    whole = full_range(S1)
    committed_stats = {
        p: queue.load_separated_diff_statistics(
            [p], QueueShardRange(S1, QueueKey.MIN, w.s1_1.max_message.next_value())
        )
        for p in (0, 1, 2)
    }
    queue.clear_uncommitted_state()
    for p in (0, 1, 2):
        assert queue.load_separated_diff_statistics([p], whole) == committed_stats[p]
    stored = {m for p in (0, 1, 2) for m in message_keys(queue, p, S1)}
    assert stored == {m.key for m in w.s1_1.messages}
    assert all(k <= queue.get_commit_pointers()[S1].key for k in stored)


def test_partition_outside_the_requested_ones_is_cleared_too(queue: Queue) -> None:
    """Decision: clear also clears every partition the cleared diffs wrote into."""
    w = build_world(queue)
    hot_uncommitted = [m.key for m in w.s1_2.messages if m.dst == HOT]
    assert hot_uncommitted
    assert set(hot_uncommitted) <= set(message_keys(queue, 2, S1))
    assert message_keys(queue, 2, S2)

    queue.clear_uncommitted_state(partitions=(0, 1), top_shards=[S2])

    assert message_keys(queue, 2, S1) == [m.key for m in w.s1_1.messages if m.dst == HOT]
    assert message_keys(queue, 2, S2) == []
    assert message_keys(queue, 2, S3) == [m.key for m in w.s3_1.messages if m.dst == HOT]
    above = QueueShardRange(S1, w.s1_1.max_message.next_value(), QueueKey.MAX)
    assert queue.load_diff_statistics(2, above) == {}
    assert queue.load_diff_statistics(2, full_range(S2)) == {}
    with queue.iterator(2, [full_range(S1), full_range(S2)], ShardIdent.full(0)) as it:
        assert [im.message.key for im in it] == [m.key for m in w.s1_1.messages if m.dst == HOT]


def test_statistics_only_partitions_are_cleared_too(queue: Queue) -> None:
    """A diff's explicit statistics may name a partition no message went to."""
    w = build_world(queue)
    a = Chain(queue, Clock(start=50_000)).build(S1, 2, seqno=3)
    st = stats(S1, a.messages[0].key, a.max_message, {5: {HOT: 2}, 0: {LOW: 1}})
    assert queue.apply_diff(a.diff, a.block, a.hash, st)
    assert queue.load_diff_statistics(5, full_range(S1)) == {HOT: 2}
    queue.clear_uncommitted_state(top_shards=[S2])
    assert queue.load_diff_statistics(5, full_range(S1)) == {}
    assert queue.load_separated_diff_statistics([0], full_range(S1)) == {
        0: {w.s1_1.max_message: {address_in(S2): 1}}
    }


def test_a_partition_neither_requested_nor_written_by_the_cleared_diffs_is_untouched(
    queue: Queue,
) -> None:
    """Found by an outside audit: a clear of partition 1 deleted partition 0's rows above
    the pointer although no cleared diff wrote there (every router named partition 0).
    Here they belong to a diff whose records GC collected through partition 1's bound
    (§7.2: partition 0's rows wait for their own bound)."""
    src, low = address_in(S1, 1), address_in(S1, 2)
    router = PartitionRouter(dst={1: [low]})
    chain = Chain(queue)
    first = chain.apply(S1, [src])  # committed: the pointer
    chain.apply(MC, 0)
    queue.commit_diff([top(MC, 1), top(S1, 1)])
    second = chain.build(S1, [src, low], router=router)  # one message in each partition
    assert queue.apply_diff(second.diff, second.block, second.hash)
    mc = chain.build(MC, 0, processed_to={S1: second.max_message})
    assert queue.apply_diff(mc.diff, mc.block, mc.hash)
    queue.commit_diff([top(MC, 2)], partitions=(1,))  # S1's pointer stays at the first diff
    queue.run_gc()  # partition 1 up to the second diff: its records go, partition 0's row stays
    assert not queue.is_diff_exists(second.block)
    third = chain.apply(S1, [low], router=router)  # partition 1 only
    kept = [*first.messages, second.messages[0]]
    assert [m.dst for m in kept[1:]] == [src]
    assert message_keys(queue, 0, S1) == [m.key for m in kept]

    queue.clear_uncommitted_state(partitions=(1,))

    assert not queue.is_diff_exists(third.block)
    assert message_keys(queue, 1, S1) == []
    assert message_keys(queue, 0, S1) == [m.key for m in kept]


def test_shard_without_pointer_and_not_listed_is_untouched(queue: Queue) -> None:
    build_world(queue)
    before = {t: shard_rows(queue, t, S2) for t in Table if t is not Table.VARS}
    assert before[Table.DIFF_INFO]
    queue.clear_uncommitted_state()  # S2 not in top_shards
    assert {t: shard_rows(queue, t, S2) for t in before} == before
    assert queue.get_last_applied_seqno(S2) == 1


def test_clear_is_idempotent(queue: Queue) -> None:
    build_world(queue)
    queue.clear_uncommitted_state(top_shards=[S2])
    after = dump(queue)
    queue.clear_uncommitted_state(top_shards=[S2])
    assert dump(queue) == after


def test_applying_again_after_a_clear(queue: Queue) -> None:
    w = build_world(queue)
    queue.clear_uncommitted_state(top_shards=[S2])
    for a in w.cleared:
        assert queue.apply_diff(a.diff, a.block, a.hash, None, DiffZone.BOTH) is True
    assert queue.get_last_applied_seqno(S1) == 2
    assert all_messages(queue, 1) == expected_messages([*w.survivors, *w.cleared], 1)


def test_clear_on_an_empty_queue(queue: Queue) -> None:
    before = dump(queue)
    queue.clear_uncommitted_state(top_shards=[S1, MC])
    assert dump(queue) == before


def test_clear_argument_checks(queue: Queue) -> None:
    with pytest.raises(TypeError):
        queue.clear_uncommitted_state(top_shards=[block(S1, 1)])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        queue.clear_uncommitted_state(partitions=[-1])


def test_iterator_after_clear(queue: Queue) -> None:
    w = build_world(queue)
    queue.clear_uncommitted_state(top_shards=[S2])
    for partition in (0, 1, 2):
        got = iterate_all(queue, [MC, S1, S2, S3], partition, ShardIdent.full(0))
        want = [
            im for im in expected_messages(w.survivors, partition) if im.message.dst.workchain == 0
        ]
        assert got == want


def test_clear_logs_an_event(db_path: Path, logs: list[MutableMapping[str, Any]]) -> None:
    with open_queue(db_path) as queue:
        w = build_world(queue)
        queue.clear_uncommitted_state(top_shards=[S2])
    events = [e for e in logs if e["event"] == "uncommitted_cleared"]
    assert len(events) == 1
    event = events[0]
    assert event["log_level"] == "info"
    assert event["component"] == "queue"
    assert event["shards"] == {str(MC): [2], str(S1): [2], str(S2): [1]}
    assert event["diffs"] == 3
    assert event["messages"] == sum(len(a.messages) for a in w.cleared)


# -- startup ----------------------------------------------------------------------------------


def test_startup_with_committed_block_ahead_fails_and_clears_nothing(queue: Queue) -> None:
    build_world(queue, mc_seqno=5)
    before, api = dump(queue), state(queue, SHARDS)
    for applied in (block_id(MC, 4), block_id(MC, 5, tag="fork")):
        with pytest.raises(StartupError) as err:
            queue.startup(applied, top_shards=[S2])
        assert str(block_id(MC, 5)) in str(err.value)
        assert str(applied) in str(err.value)
        assert dump(queue) == before
        assert state(queue, SHARDS) == api


@pytest.mark.parametrize("applied_seqno", [5, 6, 100])
def test_startup_with_committed_block_equal_or_behind_clears(
    queue: Queue, tmp_path: Path, applied_seqno: int
) -> None:
    build_world(queue, mc_seqno=5)
    with open_queue(tmp_path / "reference") as ref:
        build_world(ref, with_uncommitted=False, mc_seqno=5)
        expected = dump(ref)
    queue.startup(block_id(MC, applied_seqno), top_shards=[S2])
    assert dump(queue) == expected


def test_startup_without_any_commit_clears_top_shards(queue: Queue) -> None:
    chain = Chain(queue)
    chain.apply(S1, 2)
    chain.apply(S2, 2)
    queue.startup(block_id(MC, 1), top_shards=[MC, S1], partitions=(0,))
    assert queue.get_last_applied_seqno(S1) is None
    assert queue.get_last_applied_seqno(S2) == 1
    assert shard_rows(queue, Table.MESSAGES, S1) == []
    assert len(shard_rows(queue, Table.MESSAGES, S2)) == 2
    assert rows(queue, Table.COMMIT_POINTERS) == []


def test_startup_clears_the_masterchain_even_when_top_shards_leave_it_out(queue: Queue) -> None:
    """SEMANTICS 14.2: the top shards are the masterchain plus the shard table's. A
    masterchain diff applied before the restart and never committed must go, or
    collating that block again with another hash would conflict."""
    chain = Chain(queue)
    chain.apply(MC, 1)
    chain.apply(S1, 2)
    queue.startup(block_id(MC, 1), top_shards=[S1])
    assert queue.get_last_applied_seqno(MC) is None
    assert queue.get_last_applied_seqno(S1) is None
    again = chain.build(MC, 1, seqno=1, hash_label="re-collated")
    assert queue.apply_diff(again.diff, again.block, again.hash) is True


def test_startup_argument_type(queue: Queue) -> None:
    with pytest.raises(TypeError):
        queue.startup(block(MC, 1), top_shards=[])  # type: ignore[arg-type]


def test_startup_logs_the_clear(db_path: Path, logs: list[MutableMapping[str, Any]]) -> None:
    with open_queue(db_path) as queue:
        build_world(queue)
        queue.startup(block_id(MC, 1), top_shards=[S2])
    cleared = [e for e in logs if e["event"] == "uncommitted_cleared"]
    assert len(cleared) == 1
    assert cleared[0]["diffs"] == 3


def test_the_model_clears_the_masterchain_at_startup_as_the_queue_does(queue: Queue) -> None:
    """The state machine found the model (imq.testing.model) still clearing only the
    listed top shards once the queue cleared the masterchain too."""
    model = QueueModel()
    chain = Chain(queue)
    for applied in (chain.apply(MC, 1), chain.apply(S1, 2)):
        model.apply(DiffInput(applied.block, applied.hash, applied.messages), check_sequence=None)
    queue.startup(block_id(MC, 1), top_shards=[S1])
    model.startup(block_id(MC, 1), [S1], (0, 1))
    for shard in (MC, S1):
        assert queue.get_diff_info(shard, 1) is None
        assert model.get_diff_info(shard, 1) is None


@pytest.mark.parametrize("diffs", [255, 256])
def test_a_clear_of_256_diffs_or_more_compacts_their_diff_infos(
    tmp_path: Path, diffs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D9: with ``compact_after_delete``, a clear compacts the diff-info span it deleted
    once it removed 256 diffs or more; a smaller clear leaves it to GC."""
    queue = Queue.open(tmp_path / "q", quiet_config(compact_after_delete=True))
    try:
        chain = Chain(queue, Clock())
        for _ in range(diffs):
            chain.apply(S2, 1)
        compacted: list[list[tuple[Table, bytes, bytes]]] = []
        monkeypatch.setattr(queue._store, "compact", compacted.append)
        queue.clear_uncommitted_state(top_shards=[S2])
        assert queue.get_last_applied_seqno(S2) is None
        if diffs < 256:
            assert compacted == []
        else:
            (ranges,) = compacted
            assert ranges and {table for table, _, _ in ranges} == {Table.DIFF_INFO}
    finally:
        queue.close()
