"""A shard splits and its halves merge again (docs/behaviour.md 5.11): the queue keys its
rows by the source shard's identifier, so the parent, its children and the merged shard
are each a source shard of their own; readers drain the parent's messages through
their own ``processed_to``, GC collects a source shard once every reader listed in the
commit record is past it, and nothing of one shard is touched by an operation on
another. Real RocksDB in ``tmp_path``."""

from __future__ import annotations

from pathlib import Path

from builders import (
    BASE,
    MC,
    Chain,
    Clock,
    address_in,
    full_range,
    iterate_all,
    open_queue,
    split_shard,
    top,
)

from imq import IteratedMessage, Queue, QueueKey, QueueShardRange, ShardIdent

LEFT = split_shard(0, 1, 0)  # 0:4000..., accounts 0x00.. to 0x7f..
RIGHT = split_shard(0, 1, 1)  # 0:c000..., accounts 0x80.. to 0xff..


def _to(shard: ShardIdent, n: int) -> list:
    return [address_in(shard, 100 + i) for i in range(n)]


def _read(queue: Queue, for_shard: ShardIdent, sources: list[ShardIdent]) -> list[IteratedMessage]:
    ranges = [full_range(s) for s in sources]
    with queue.iterator(0, ranges, for_shard) as it:
        return list(it)


def _commit(queue: Queue, chain: Chain, mc_seqno: int, tops: list) -> None:
    chain.apply(MC, 0, seqno=mc_seqno)
    assert queue.commit_diff([top(MC, mc_seqno), *tops])


def test_a_split_then_a_merge_delivers_each_message_once_and_gc_waits_for_every_reader(
    tmp_path: Path,
) -> None:
    clock = Clock()
    with open_queue(tmp_path / "q") as queue:
        chain = Chain(queue, clock)
        # The full basechain shard sends to both future halves; committed.
        parent = chain.apply(BASE, [*_to(LEFT, 3), *_to(RIGHT, 3)], seqno=10)
        _commit(queue, chain, 1, [parent.top(1)])
        assert set(queue.get_commit_pointers()) == {MC, BASE}

        # The split: the children (seqno 11 each) read the parent's messages for them.
        for_left = _read(queue, LEFT, [BASE])
        for_right = _read(queue, RIGHT, [BASE])
        assert [m.message.dst for m in for_left] == _to(LEFT, 3)
        assert [m.message.dst for m in for_right] == _to(RIGHT, 3)
        # LEFT has read all of the parent's messages; RIGHT only its first one so far.
        left = chain.apply(LEFT, _to(RIGHT, 2), seqno=11, processed_to={BASE: parent.max_message})
        right = chain.apply(
            RIGHT, _to(LEFT, 2), seqno=11, processed_to={BASE: for_right[0].message.key}
        )
        _commit(queue, chain, 2, [left.top(2), right.top(2)])
        queue.run_gc()
        # The parent's messages RIGHT has not read are kept (GC takes the minimum over
        # the readers), its first message to RIGHT and everything before it are gone.
        kept = [m.message.key for m in iterate_all(queue, [BASE])]
        assert kept == [m.message.key for m in for_right[1:]]
        assert _read(queue, RIGHT, [BASE]) == for_right[1:]
        assert _read(queue, LEFT, [BASE]) == []

        # Each child reads the other's messages, merged by key across three sources.
        got = _read(queue, LEFT, [BASE, LEFT, RIGHT])
        assert got == [IteratedMessage(RIGHT, m) for m in right.messages]
        # An uncommitted diff of a child is cleared by naming it; the parent's and the
        # other child's committed rows are untouched.
        dropped = chain.apply(LEFT, _to(RIGHT, 1), seqno=12)
        before = {s: iterate_all(queue, [s]) for s in (BASE, RIGHT)}
        queue.clear_uncommitted_state(top_shards=[LEFT, RIGHT])
        assert not queue.is_diff_exists(dropped.block)
        assert {s: iterate_all(queue, [s]) for s in (BASE, RIGHT)} == before

        # RIGHT reads the rest of the parent: the parent's messages are all collected.
        right2 = chain.apply(
            RIGHT, 0, seqno=12, processed_to={BASE: parent.max_message, LEFT: left.max_message}
        )
        left2 = chain.apply(LEFT, 0, seqno=12, processed_to={RIGHT: right.max_message})
        _commit(queue, chain, 3, [left2.top(3), right2.top(3)])
        queue.run_gc()
        assert iterate_all(queue, [BASE]) == []
        assert queue.get_diff_info(BASE, 10) is None

        # The merge: the full shard again (seqno 13), reading what the children left.
        assert _read(queue, BASE, [LEFT, RIGHT]) == []
        merged = chain.apply(
            BASE,
            _to(LEFT, 1),
            seqno=13,
            processed_to={LEFT: left2.max_message, RIGHT: right2.max_message},
        )
        _commit(queue, chain, 4, [merged.top(4)])
        queue.run_gc()
        for child in (LEFT, RIGHT):
            assert iterate_all(queue, [child]) == []
        assert _read(queue, LEFT, [BASE, LEFT, RIGHT]) == merged.iterated()
        pointers = queue.get_commit_pointers()
        assert pointers[BASE].seqno == 13
        assert pointers[LEFT].seqno == 12 and pointers[RIGHT].seqno == 12
        assert queue.get_diffs_tail_len(BASE, QueueKey.MIN) == 1


def test_a_range_over_the_parent_and_its_child_counts_as_two_sources(tmp_path: Path) -> None:
    """Two ranges name one source shard only when their identifiers are equal: a parent
    and its child, whose prefixes overlap, are two sources, each with its own position."""
    with open_queue(tmp_path / "q") as queue:
        chain = Chain(queue)
        parent = chain.apply(BASE, _to(LEFT, 2), seqno=1)
        child = chain.apply(LEFT, _to(LEFT, 2), seqno=2)
        ranges = [
            QueueShardRange(BASE, QueueKey.MIN, QueueKey.MAX),
            QueueShardRange(LEFT, QueueKey.MIN, QueueKey.MAX),
        ]
        with queue.iterator(0, ranges, LEFT) as it:
            got = list(it)
            position = it.current_position()
        assert got == parent.iterated() + child.iterated()
        assert position == {BASE: parent.max_message, LEFT: child.max_message}
