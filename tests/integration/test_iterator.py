"""The merge iterator on a real RocksDB (SEMANTICS §5.2, §11; API.md QueueIterator)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest
from builders import (
    BASE,
    MC,
    Chain,
    Clock,
    address_in,
    block,
    diff_hash,
    full_range,
    iterate_all,
    key,
    make_diff,
    message,
    messages,
    open_queue,
    quarter_shards,
    quiet_config,
    split_shard,
)

from imq import (
    Address,
    IteratedMessage,
    Message,
    PartitionRouter,
    Queue,
    QueueClosedError,
    QueueKey,
    QueueShardRange,
    ShardIdent,
)
from imq import iterator as iterator_module
from imq.storage import Table

SOURCES = quarter_shards()  # 0:2000…, 0:6000…, 0:a000…, 0:e000…
Q0, Q1, Q2, Q3 = SOURCES
DESTINATIONS = [*SOURCES, MC]
ROUNDS = 6


def _merge_path(pure: bool) -> AbstractContextManager[None]:
    """The pure-Python merge within the block when ``pure``, else the default one."""
    return iterator_module.pure_python() if pure else nullcontext()


def populate(queue: Queue) -> list[IteratedMessage]:
    """Messages of the 4 source shards interleaved one by one in lt, two diffs per shard,
    destinations cycling over the 4 quarters and the masterchain. Returns them in order."""
    per_shard: dict[ShardIdent, list[Message]] = {s: [] for s in SOURCES}
    for i in range(ROUNDS):
        for si, src in enumerate(SOURCES):
            dst = address_in(DESTINATIONS[(i + si) % len(DESTINATIONS)], i)
            per_shard[src].append(message(key(100 + 4 * i + si), address_in(src, i), dst))
    everything = []
    for src, msgs in per_shard.items():
        half = len(msgs) // 2
        for seqno, part in ((1, msgs[:half]), (2, msgs[half:])):
            assert queue.apply_diff(make_diff(part), block(src, seqno), diff_hash((src, seqno)))
        everything += [IteratedMessage(src, m) for m in msgs]
    return sorted(everything, key=lambda im: im.message.key)


def run(queue: Queue, for_shard: ShardIdent, partition: int = 0) -> list[IteratedMessage]:
    with queue.iterator(partition, [full_range(s) for s in SOURCES], for_shard) as it:
        return list(it)


# -- merge and filter -------------------------------------------------------------------------


def test_merge_order_across_four_source_shards(queue: Queue) -> None:
    everything = populate(queue)
    got = run(queue, BASE) + run(queue, MC)
    wc0 = [im for im in everything if im.message.dst.workchain == 0]
    mc = [im for im in everything if im.message.dst.workchain == -1]
    assert got == wc0 + mc
    keys = [im.message.key for im in run(queue, BASE)]
    assert keys == sorted(keys)
    # Each message comes back whole, with the shard it was applied to as its source.
    assert {im.source for im in got} == set(SOURCES)
    assert all(im.source.contains(im.message.src) for im in got)


def test_ranges_in_a_different_order_give_the_same_merge(queue: Queue) -> None:
    populate(queue)
    forward = run(queue, BASE)
    with queue.iterator(0, [full_range(s) for s in reversed(SOURCES)], BASE) as it:
        assert list(it) == forward


@pytest.mark.parametrize(
    "for_shard",
    [
        BASE,
        split_shard(0, 1, 0),
        split_shard(0, 1, 1),
        Q0,
        Q1,
        Q2,
        Q3,
        split_shard(0, 3, 5),
        MC,
        ShardIdent.full(7),
        ShardIdent.full(1000),
    ],
    ids=str,
)
def test_for_shard_filtering(queue: Queue, for_shard: ShardIdent) -> None:
    everything = populate(queue)
    expected = [im for im in everything if for_shard.contains(im.message.dst)]
    got = run(queue, for_shard)
    assert got == expected
    if for_shard.workchain in (7, 1000):
        assert got == []
    elif for_shard.prefix_len <= 2:
        assert got, "every destination shard of the fixture receives messages"


def test_masterchain_source_and_destinations(queue: Queue) -> None:
    chain = Chain(queue)
    mc = chain.apply(MC, [address_in(Q1), address_in(MC, 1), address_in(Q2)])
    q1 = chain.apply(Q1, [address_in(MC, 2), address_in(Q1, 3)])
    ranges = [full_range(MC), full_range(Q1)]
    with queue.iterator(0, ranges, MC) as it:
        got = list(it)
    assert got == [
        IteratedMessage(MC, mc.messages[1]),
        IteratedMessage(Q1, q1.messages[0]),
    ]
    with queue.iterator(0, ranges, Q1) as it:
        assert list(it) == [
            IteratedMessage(MC, mc.messages[0]),
            IteratedMessage(Q1, q1.messages[1]),
        ]


# -- ranges -----------------------------------------------------------------------------------


def test_half_open_ranges(queue: Queue) -> None:
    everything = populate(queue)
    mine = [im for im in everything if im.source == Q1]
    k = [im.message.key for im in mine]

    def within(from_key: QueueKey, to_key: QueueKey) -> list[IteratedMessage]:
        with queue.iterator(0, [QueueShardRange(Q1, from_key, to_key)], ShardIdent.full(0)) as it:
            wc0 = list(it)
        with queue.iterator(0, [QueueShardRange(Q1, from_key, to_key)], MC) as it:
            return sorted(wc0 + list(it), key=lambda im: im.message.key)

    assert within(k[1], k[4]) == mine[1:4]
    assert within(k[1].next_value(), k[4]) == mine[2:4]
    assert within(k[1], k[4].next_value()) == mine[1:5]
    assert within(k[-1], QueueKey.MAX) == mine[-1:]
    assert within(QueueKey.MIN, k[0]) == []
    assert within(QueueKey.MIN, QueueKey.MAX) == mine


def test_empty_and_reversed_ranges(queue: Queue) -> None:
    everything = populate(queue)
    k = [im.message.key for im in everything if im.source == Q2]
    for from_key, to_key in [
        (k[2], k[2]),
        (k[3], k[1]),
        (QueueKey.MAX, QueueKey.MIN),
        (QueueKey.MIN, QueueKey.MIN),
        (QueueKey.MAX, QueueKey.MAX),
    ]:
        with queue.iterator(0, [QueueShardRange(Q2, from_key, to_key)], BASE) as it:
            assert list(it) == []
            assert it.current_position() == {}
    with queue.iterator(0, [], BASE) as it:
        assert list(it) == []


def test_ranges_of_several_shards_with_different_bounds(queue: Queue) -> None:
    everything = populate(queue)
    k0 = [im.message.key for im in everything if im.source == Q0]
    k3 = [im.message.key for im in everything if im.source == Q3]
    ranges = [QueueShardRange(Q0, k0[2], QueueKey.MAX), QueueShardRange(Q3, QueueKey.MIN, k3[3])]
    expected = [
        im
        for im in everything
        if im.message.dst.workchain == 0
        and (
            (im.source == Q0 and im.message.key >= k0[2])
            or (im.source == Q3 and im.message.key < k3[3])
        )
    ]
    assert expected
    with queue.iterator(0, ranges, BASE) as it:
        assert list(it) == expected


def test_two_ranges_for_one_shard(queue: Queue) -> None:
    populate(queue)
    ranges = [full_range(Q1), QueueShardRange(Q1, key(1), key(2))]
    with pytest.raises(ValueError, match=str(Q1)):
        queue.iterator(0, ranges, BASE)
    with pytest.raises(ValueError):
        queue.iterator(0, [full_range(Q1), full_range(Q1)], BASE)


def test_argument_checks(queue: Queue) -> None:
    with pytest.raises(ValueError):
        queue.iterator(70_000, [full_range(Q1)], BASE)
    with pytest.raises(TypeError):
        queue.iterator(0, [full_range(Q1)], "0:8000000000000000")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        queue.iterator(0, [(Q1, QueueKey.MIN, QueueKey.MAX)], BASE)  # type: ignore[list-item]


# -- current_position -------------------------------------------------------------------------


def test_current_position_follows_consumed_and_skipped_keys(queue: Queue) -> None:
    a, b, c = Q0, Q1, Q2
    me, other = address_in(Q3, 1), address_in(Q0, 2)

    def m(lt: int, src: ShardIdent, dst: Address) -> Message:
        return message(key(lt), address_in(src), dst)

    a1, a2, a3, a4 = m(20, a, me), m(30, a, other), m(50, a, other), m(60, a, me)
    b1, b2, b3 = m(10, b, other), m(40, b, me), m(70, b, other)
    c1, c2 = m(15, c, other), m(55, c, other)
    for shard, msgs in ((a, [a1, a2, a3, a4]), (b, [b1, b2, b3]), (c, [c1, c2])):
        assert queue.apply_diff(make_diff(msgs), block(shard, 1), diff_hash(shard))

    it = queue.iterator(0, [full_range(a), full_range(b), full_range(c)], Q3)
    assert it.current_position() == {}
    # 1st: every shard's cursor is pulled up to its first match; c has none.
    assert next(it) == IteratedMessage(a, a1)
    assert it.current_position() == {a: a1.key, b: b1.key, c: c2.key}
    # 2nd: a's cursor advances past a2, a3 (skipped) to a4; b2 is the smallest.
    assert next(it) == IteratedMessage(b, b2)
    assert it.current_position() == {a: a3.key, b: b2.key, c: c2.key}
    # 3rd: b's cursor advances over b3 (skipped) to its end; a4 comes out.
    assert next(it) == IteratedMessage(a, a4)
    assert it.current_position() == {a: a4.key, b: b3.key, c: c2.key}
    with pytest.raises(StopIteration):
        next(it)
    assert it.current_position() == {a: a4.key, b: b3.key, c: c2.key}
    it.close()


@pytest.mark.parametrize("pure", [False, True], ids=["default", "pure-python"])
@pytest.mark.parametrize("closer", ["iterator", "queue"])
def test_current_position_survives_a_close_inside_a_batch(
    db_path: Path, closer: str, pure: bool
) -> None:
    """What was consumed stays consumed once the iterator or its queue closes, even in the
    middle of a decoded batch (skips inside it included). Closing emptied the batch, so
    the position fell back to where the batch began (here: only b1, skipped before the
    first message). The replay of the queue state machine's op log caught it
    (``tests/replays/machine-close-midway.jsonl``)."""
    a, b = Q0, Q1
    me, other = address_in(Q3, 1), address_in(Q0, 2)

    def m(lt: int, src: ShardIdent, dst: Address) -> Message:
        return message(key(lt), address_in(src), dst)

    a1, a2, a3 = m(20, a, me), m(30, a, other), m(60, a, me)
    b1, b2 = m(10, b, other), m(40, b, me)
    queue = open_queue(db_path)
    try:
        for shard, msgs in ((a, [a1, a2, a3]), (b, [b1, b2])):
            assert queue.apply_diff(make_diff(msgs), block(shard, 1), diff_hash(shard))
        with _merge_path(pure):
            it = queue.iterator(0, [full_range(a), full_range(b)], Q3)
        assert [next(it), next(it)] == [IteratedMessage(a, a1), IteratedMessage(b, b2)]
        taken = {a: a2.key, b: b2.key}  # a2 skipped on the way to a3, the next pending
        assert it.current_position() == taken
        if closer == "iterator":
            it.close()
            assert list(it) == []
        else:
            queue.close()
            with pytest.raises(QueueClosedError):
                next(it)
        assert it.current_position() == taken
        it.close()
        assert it.current_position() == taken
    finally:
        queue.close()


def test_current_position_when_everything_is_skipped(queue: Queue) -> None:
    everything = populate(queue)
    last = {s: [im.message.key for im in everything if im.source == s][-1] for s in SOURCES}
    with queue.iterator(0, [full_range(s) for s in SOURCES], ShardIdent.full(5)) as it:
        assert it.current_position() == {}
        assert list(it) == []
        assert it.current_position() == last


def test_current_position_is_not_seeded_with_the_range_start(queue: Queue) -> None:
    populate(queue)
    with queue.iterator(0, [QueueShardRange(Q1, key(1), key(2)), full_range(Q2)], BASE) as it:
        first = next(it)
        assert first.source == Q2
        assert set(it.current_position()) == {Q2}


# -- partitions -------------------------------------------------------------------------------


def test_partition_isolation(queue: Queue) -> None:
    to_low, from_hot = address_in(Q1, 50), address_in(Q0, 51)
    router = PartitionRouter(src={2: [from_hot]}, dst={1: [to_low]})
    plain = address_in(Q2, 52)
    msgs = [
        message(key(10), address_in(Q0, 1), plain),  # 0
        message(key(11), from_hot, plain),  # 2 (by source)
        message(key(12), from_hot, to_low),  # 1 (destination wins)
        message(key(13), address_in(Q0, 2), to_low),  # 1
        message(key(14), address_in(Q0, 3), address_in(Q3)),  # 0
    ]
    assert queue.apply_diff(make_diff(msgs, router=router), block(Q0, 1), diff_hash(1))
    parts = {p: [im.message for im in run(queue, BASE, p)] for p in (0, 1, 2, 3)}
    assert parts == {
        0: [msgs[0], msgs[4]],
        1: [msgs[2], msgs[3]],
        2: [msgs[1]],
        3: [],
    }


# -- snapshots --------------------------------------------------------------------------------


def test_iterator_does_not_see_later_writes(queue: Queue) -> None:
    everything = populate(queue)
    chain = Chain(queue)
    it = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
    first = next(it)
    later = chain.apply(Q1, [address_in(Q1, 9), address_in(Q2, 9)], seqno=3)
    wc0 = [im for im in everything if im.message.dst.workchain == 0]
    assert [first, *it] == wc0
    assert run(queue, BASE) == sorted(wc0 + later.iterated(), key=lambda im: im.message.key)


def test_fresh_iterator_is_a_snapshot_taken_at_creation(queue: Queue) -> None:
    everything = populate(queue)
    it = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
    Chain(queue).apply(Q1, [address_in(Q1, 9)], seqno=3)  # before the first next()
    with it:
        assert list(it) == [im for im in everything if im.message.dst.workchain == 0]


def test_clear_after_creation_does_not_affect_an_open_iterator(queue: Queue) -> None:
    everything = populate(queue)
    it = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
    queue.clear_uncommitted_state(top_shards=SOURCES)  # no pointers: everything goes
    assert run(queue, BASE) == []
    with it:
        assert list(it) == [im for im in everything if im.message.dst.workchain == 0]


# -- lifecycle --------------------------------------------------------------------------------


def test_context_manager_and_close(queue: Queue) -> None:
    populate(queue)
    with queue.iterator(0, [full_range(s) for s in SOURCES], BASE) as it:
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    it.close()  # idempotent

    it = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
    it.close()
    assert list(it) == []
    it.close()


def test_next_after_queue_close_raises(db_path: Path) -> None:
    queue = open_queue(db_path)
    everything = populate(queue)
    fresh = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
    started = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
    next(started)
    queue.close()
    with pytest.raises(QueueClosedError):
        next(fresh)
    with pytest.raises(QueueClosedError):
        next(started)
    # The iterators (still referenced) do not keep the database locked.
    with open_queue(db_path) as again:
        assert run(again, BASE) == [im for im in everything if im.message.dst.workchain == 0]
    with pytest.raises(QueueClosedError):
        next(started)


def test_metrics_count_iterated_and_skipped(queue: Queue) -> None:
    everything = populate(queue)
    got = run(queue, Q2)
    assert queue.metrics.counter("messages_iterated") == len(got)
    assert queue.metrics.counter("messages_skipped_by_iterator") == len(everything) - len(got)


def test_large_bodies_round_trip(db_path: Path) -> None:
    big = [bytes([i]) * (100 << 10) for i in range(1, 4)]
    with open_queue(db_path) as queue:
        chain = Chain(queue)
        a = chain.apply(Q1, [address_in(Q1, i) for i in range(3)])
        msgs = [
            message(chain.clock.next_key(), address_in(Q1), address_in(Q2, i), body=b)
            for i, b in enumerate(big)
        ]
        assert queue.apply_diff(make_diff(msgs), block(Q1, 2), diff_hash("big"))
        expected = [*a.iterated(), *(IteratedMessage(Q1, m) for m in msgs)]
        assert run(queue, BASE) == expected
        queue._store.flush([Table.MESSAGES])
        assert list(db_path.glob("*.blob")), "100 KiB values should live in blob files"
        assert run(queue, BASE) == expected
    with open_queue(db_path) as queue:
        got = run(queue, BASE)
        assert got == expected
        assert [len(im.message.body) for im in got[-3:]] == [100 << 10] * 3


@pytest.mark.parametrize("pure", [False, True], ids=["default", "pure-python"])
def test_true_iterator_and_long_runs_in_both_paths(queue: Queue, pure: bool) -> None:
    """``iter(it) is it``; runs longer than one decode batch, with skips, split across
    several runs, give the same merge in the compiled and the pure-Python path."""
    everything = []
    lt = 1000
    for seqno in (1, 2):
        for si, src in enumerate(SOURCES):
            msgs = [
                message(key(lt + i), address_in(src, i), address_in(DESTINATIONS[(i + si) % 5], i))
                for i in range(300)
            ]
            lt += 300
            assert queue.apply_diff(make_diff(msgs), block(src, seqno), diff_hash((src, seqno)))
            everything += [IteratedMessage(src, m) for m in msgs]
    everything.sort(key=lambda im: im.message.key)
    with _merge_path(pure):
        for for_shard in (BASE, Q1, MC):
            it = queue.iterator(0, [full_range(s) for s in SOURCES], for_shard)
            assert iter(it) is it
            want = [im for im in everything if for_shard.contains(im.message.dst)]
            got = [next(it) for _ in range(len(want) // 2)]
            assert it.current_position()[got[-1].source] == got[-1].message.key
            got += list(it)
            assert got == want
            it.close()


@pytest.mark.parametrize("fill", [False, True])
def test_message_scans_read_around_the_block_cache(db_path: Path, fill: bool) -> None:
    """With ``message_scans_fill_cache`` off, an iterator's scan of stored messages
    leaves the block cache as it was (each block is read once per reader: caching it
    would evict the point tables' blocks and fault in the cache's memory on a first long
    scan); on (the default), it fills it. A point read of a diff's record goes through
    the cache either way."""
    clock = Clock()
    config = quiet_config(message_cache_size=0, message_scans_fill_cache=fill)
    queue = Queue.open(db_path, config)
    for seqno in range(1, 5):
        msgs = messages(clock, Q0, [address_in(Q1, i) for i in range(500)], body=bytes(200))
        assert queue.apply_diff(make_diff(msgs), block(Q0, seqno), diff_hash(seqno))
    queue.compact()  # the rows into table files: a scan reads them through RocksDB's blocks
    queue.close()
    queue = Queue.open(db_path, config)
    try:
        store = queue._store

        def cached() -> int:
            return store.property_int(Table.MESSAGES, "rocksdb.block-cache-usage")

        before = cached()
        assert len(iterate_all(queue, [Q0], 0, Q1)) == 2000
        after_scan = cached()
        assert queue.get_diff_info(Q0, 4) is not None
        after_point_read = cached()
    finally:
        queue.close()
    # 2,000 rows of about 300 bytes: a scan through the cache adds about 600 kB.
    if fill:
        assert after_scan - before > 500_000, (before, after_scan)
    else:
        assert after_scan - before < 64 << 10, (before, after_scan)
    assert after_point_read > after_scan
