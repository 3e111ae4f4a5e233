"""The cache of fresh message rows on real RocksDB: reads of recent diffs come from it,
and give what RocksDB gives, through writes, commits, GC, clears, evictions, failed and
blind writes, reopens and concurrent snapshots."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import Chain, address_in, quarter_shards, quiet_config

from imq import PartitionRouter, Queue, QueueKey, QueueShardRange, ShardIdent, iterator
from imq.errors import StorageError
from imq.storage import Table, codec, ops
from imq.storage.cache import ChunkRows
from imq.storage.rocks import Cursor, Scan

SHARDS = quarter_shards()
MC = ShardIdent.MASTERCHAIN


def _read(
    queue: Queue,
    ranges: list[QueueShardRange],
    for_shard: ShardIdent,
    partition: int,
    stop: int | None = None,
) -> tuple[list[Any], list[Any]]:
    """Messages, and the position after each, of one iterator (``stop``: close after that
    many messages)."""
    out, positions = [], []
    with queue.iterator(partition, ranges, for_shard) as it:
        for i, m in enumerate(it):
            out.append(m)
            positions.append(it.current_position())
            if stop is not None and i + 1 >= stop:
                break
        positions.append(it.current_position())
    return out, positions


def _cursors(queue: Queue, partition: int, ranges: list[QueueShardRange]) -> list[type]:
    snap = ops.open_messages(queue._store, partition, ranges)  # type: ignore[attr-defined]
    try:
        return [type(c) for c in snap.cursors]
    finally:
        snap.close()


def _random_run(path_on: Path, path_off: Path, seed: int, steps: int) -> None:
    """The same random workload on two queues, one with the cache (large or tiny) and
    one without: applies (some routed to partition 1), commits, clears, GC passes driven
    by processed_to, reopens; every read must agree, positions included."""
    rng = random.Random(seed)
    cached = quiet_config(message_cache_size=rng.choice([4096, 64 << 20]))
    plain = quiet_config(message_cache_size=0)
    queues = [Queue.open(path_on, cached), Queue.open(path_off, plain)]
    chain = Chain(queues[0])  # builds the diffs; both queues get the same calls
    applied: list[Any] = []  # stored diffs
    committed: list[Any] = []
    readers = [*SHARDS, MC]
    try:
        for step in range(steps):
            action = rng.random()
            if action < 0.55:
                shard = rng.choice(SHARDS)
                dsts = [
                    address_in(rng.choice(readers), rng.randrange(6))
                    for _ in range(rng.randrange(8))
                ]
                router = (
                    PartitionRouter(dst={1: [dsts[0]]}) if dsts and rng.random() < 0.5 else None
                )
                done = [a for a in applied if a.messages and a.shard != shard]
                processed = {}
                if done and rng.random() < 0.5:
                    other = rng.choice(done)
                    processed[other.shard] = other.messages[-1].key
                built = chain.build(shard, dsts, router=router, processed_to=processed)
                for q in queues:
                    q.apply_diff(built.diff, built.block, built.hash)
                applied.append(built)
            elif action < 0.7:
                mc = chain.build(MC, [address_in(rng.choice(SHARDS), 1)])
                for q in queues:
                    q.apply_diff(mc.diff, mc.block, mc.hash)
                applied.append(mc)
                tops = {a.shard: a for a in applied}
                blocks = [a.top(mc.seqno) for a in tops.values()]
                for q in queues:
                    q.commit_diff(blocks)
                committed = list(applied)
            elif action < 0.8:
                for q in queues:
                    q.clear_uncommitted_state()
                applied = list(committed)
            elif action < 0.9:
                assert queues[0].run_gc() == queues[1].run_gc()
                applied = [a for a in applied if queues[1].is_diff_exists(a.block)]
                committed = [a for a in committed if queues[1].is_diff_exists(a.block)]
            else:
                for q in queues:
                    q.close()
                queues = [Queue.open(path_on, cached), Queue.open(path_off, plain)]
            for reader in rng.sample(readers, 2):
                starts = [QueueKey.MIN, *(a.messages[0].key for a in applied[-6:] if a.messages)]
                ranges = [QueueShardRange(s, rng.choice(starts), QueueKey.MAX) for s in SHARDS]
                partition = rng.randrange(2)
                stop = rng.choice([None, 1, 3])
                assert _read(queues[0], ranges, reader, partition, stop) == _read(
                    queues[1], ranges, reader, partition, stop
                ), f"seed {seed}, step {step}: the cached read differs"
    finally:
        for q in queues:
            q.close()


@pytest.mark.parametrize("seed", range(6))
def test_reads_with_and_without_the_cache_agree(tmp_path: Path, seed: int) -> None:
    _random_run(tmp_path / "on", tmp_path / "off", seed, steps=60)


def test_fresh_diffs_are_read_from_the_cache_and_a_restarted_reader_soon_too(
    tmp_path: Path,
) -> None:
    queue = Queue.open(tmp_path / "db", quiet_config())
    chain = Chain(queue)
    try:
        shard = SHARDS[0]
        first = chain.apply(shard, [address_in(SHARDS[1], i) for i in range(3)])
        whole = [QueueShardRange(shard, QueueKey.MIN, QueueKey.MAX)]
        assert _cursors(queue, 0, whole) == [ChunkRows]  # every row written since open
        queue.close()
        queue = Queue.open(tmp_path / "db", quiet_config())
        chain.queue = queue
        # After a reopen the stored rows are RocksDB's; the first read (or write) of the
        # segment starts watching it above them.
        assert _cursors(queue, 0, whole) == [Cursor]
        second = chain.apply(shard, [address_in(SHARDS[1], i) for i in range(3)])
        new = [QueueShardRange(shard, second.messages[0].key, QueueKey.MAX)]
        assert _cursors(queue, 0, new) == [ChunkRows]
        assert queue.message_cache_stats()["rows"] == len(second.messages)
        # A reader below the floor (a restarted collator): the first read was the
        # segment's first declined scan; at the second, it loads its rows below the floor
        # (they fit) and serves the read.
        assert _cursors(queue, 0, whole) == [ChunkRows]
        assert queue.message_cache_stats()["rows"] == len(first.messages) + len(second.messages)
        got = [m.message for m in queue.iterator(0, whole, SHARDS[1])]
        assert got == [*first.messages, *second.messages]
        assert [m.message for m in queue.iterator(0, new, SHARDS[1])] == list(second.messages)
        # a segment never written reads as empty from the cache once seen
        empty = [QueueShardRange(SHARDS[2], QueueKey.MIN, QueueKey.MAX)]
        assert _cursors(queue, 1, empty) == [ChunkRows]
        before = queue.message_cache_stats()
        queue.iterator(0, [*new, *empty], SHARDS[1]).close()
        queue.iterator(0, whole, SHARDS[1]).close()
        after = queue.message_cache_stats()
        assert (after["hits"], after["misses"]) == (before["hits"] + 3, before["misses"])
        assert after["segments"] == 3  # partition 0 of shards 0 and 2, partition 1 of shard 2
    finally:
        queue.close()


def test_the_cached_chunks_of_a_diff_hold_their_rows_and_no_slack(tmp_path: Path) -> None:
    """A diff whose rows go to two partitions: the write path allocates each of its two
    chunks for the whole diff at once; once written, the cache keeps each trimmed to its
    own rows, so what it counts against its budget is what it holds."""
    empty = sys.getsizeof(bytearray())
    with Queue.open(tmp_path / "db", quiet_config()) as queue:
        chain = Chain(queue)
        dsts = [address_in(SHARDS[1], i % 5) for i in range(200)]
        built = chain.apply(SHARDS[0], dsts, router=PartitionRouter(dst={1: [dsts[0]]}))
        segments = queue._store.cache._segments  # type: ignore[attr-defined]
        chunks = [c for segment in segments.values() for c in segment.chunks]
        assert len(chunks) == 2 and sum(c.n for c in chunks) == len(built.messages)
        for chunk in chunks:
            for buffer in (chunk.data, chunk.offs):
                assert type(buffer) is bytearray
                if iterator.COMPILED:  # the pure-Python Tee grows them as CPython does
                    assert sys.getsizeof(buffer) - empty == len(buffer) + 1


@pytest.mark.parametrize("fits", [True, False])
def test_a_segment_loads_its_rows_below_the_floor_only_when_they_fit(
    tmp_path: Path, fits: bool
) -> None:
    queue = Queue.open(tmp_path / "db", quiet_config())
    chain = Chain(queue)
    shard = SHARDS[0]
    try:
        diffs = [chain.apply(shard, [address_in(SHARDS[1], i) for i in range(4)]) for _ in range(3)]
    finally:
        queue.close()
    messages = [m for d in diffs for m in d.messages]
    rows = codec.message_rows(shard, messages, lambda _s, _d: 0)
    size = sum(len(k) + len(v) for k, v in rows)
    # The load limit is 1/64 of the budget: the segment's size exactly, or a byte less.
    config = quiet_config(message_cache_size=64 * size + (0 if fits else -64))
    queue = Queue.open(tmp_path / "db", config)
    chain.queue = queue
    try:
        whole = [QueueShardRange(shard, QueueKey.MIN, QueueKey.MAX)]
        store = queue._store  # type: ignore[attr-defined]
        assert store.cache.load_limit == (size if fits else size - 1)
        # The first read establishes the segment above its top (its first declined
        # scan); the second loads the rows below the floor if they fit, once.
        assert _cursors(queue, 0, whole) == [Cursor]
        assert _cursors(queue, 0, whole) == [ChunkRows if fits else Cursor]
        assert _cursors(queue, 0, whole) == [ChunkRows if fits else Cursor]
        store.cache.check()
        ((floor, cached),) = store.cache.segments().values()
        if fits:
            assert (floor, cached) == (codec.message_prefix(0, shard), rows)
        else:  # still watched above its greatest key: what it stored is RocksDB's
            assert (floor, cached) == (rows[-1][0], [])
        more = chain.apply(shard, [address_in(SHARDS[1], 9)])
        new = [QueueShardRange(shard, more.messages[0].key, QueueKey.MAX)]
        assert _cursors(queue, 0, new) == [ChunkRows]
        everything = [*messages, *more.messages]
        for ranges in (whole, new):
            start = ranges[0].from_key
            assert [m.message for m in queue.iterator(0, ranges, SHARDS[1])] == [
                m for m in everything if m.key >= start
            ]
    finally:
        queue.close()


def test_a_load_below_the_floor_reads_every_batch(tmp_path: Path) -> None:
    """More rows below the floor than one batch of the load (1,024): all are loaded."""
    queue = Queue.open(tmp_path / "db", quiet_config())
    chain = Chain(queue)
    shard = SHARDS[0]
    try:
        diffs = [chain.apply(shard, [address_in(SHARDS[1], i % 7) for i in range(600)])]
        diffs += [chain.apply(shard, [address_in(SHARDS[1], i % 7) for i in range(600)])]
    finally:
        queue.close()
    rows = codec.message_rows(shard, [m for d in diffs for m in d.messages], lambda _s, _d: 0)
    queue = Queue.open(tmp_path / "db", quiet_config())
    try:
        whole = [QueueShardRange(shard, QueueKey.MIN, QueueKey.MAX)]
        assert _cursors(queue, 0, whole) == [Cursor]
        assert _cursors(queue, 0, whole) == [ChunkRows]
        store = queue._store  # type: ignore[attr-defined]
        store.cache.check()
        ((floor, cached),) = store.cache.segments().values()
        assert (floor, len(cached)) == (codec.message_prefix(0, shard), 1200)
        assert cached == rows
    finally:
        queue.close()


def test_an_iterator_keeps_its_snapshot_while_gc_and_clear_change_the_cache(
    tmp_path: Path,
) -> None:
    queue = Queue.open(tmp_path / "db", quiet_config())
    chain = Chain(queue)
    try:
        shard = SHARDS[0]
        a = chain.apply(shard, [address_in(SHARDS[1], i) for i in range(4)])
        b = chain.apply(shard, [address_in(SHARDS[1], i) for i in range(4)])
        ranges = [QueueShardRange(shard, a.messages[0].key, QueueKey.MAX)]
        assert _cursors(queue, 0, ranges) == [ChunkRows]
        it = queue.iterator(0, ranges, SHARDS[1])
        mc = chain.apply(MC, 1)
        queue.commit_diff([mc.top(), a.top(mc.seqno)])
        queue.clear_uncommitted_state()  # deletes b
        assert [m.message for m in queue.iterator(0, ranges, SHARDS[1])] == list(a.messages)
        c = chain.apply(shard, [address_in(SHARDS[1], 9)])
        got = [m.message for m in it]
        assert got == [*a.messages, *b.messages]  # as when the iterator was opened
        assert [m.message for m in queue.iterator(0, ranges, SHARDS[1])] == [
            *a.messages,
            *c.messages,
        ]
    finally:
        queue.close()


@pytest.fixture
def written(tmp_path: Path) -> Iterator[tuple[Queue, Any, Chain]]:
    """A queue whose cache holds two diffs of one shard: (queue, its store, the chain)."""
    queue = Queue.open(tmp_path / "db", quiet_config())
    try:
        chain = Chain(queue)
        for _ in range(2):
            chain.apply(SHARDS[0], 3)
        store = queue._store  # type: ignore[attr-defined]
        assert store.cache.segments()
        yield queue, store, chain
    finally:
        queue.close()


def _one_row(chain: Chain) -> tuple[bytes, bytes]:
    [(k, v)] = codec.message_rows(SHARDS[0], [chain.build(SHARDS[0], 1).messages[0]])
    return k, v


def test_a_blind_write_of_message_rows_makes_the_cache_forget(
    written: tuple[Queue, Any, Chain],
) -> None:
    _, store, chain = written
    k, v = _one_row(chain)
    txn = store.transaction()
    with txn.writer(Table.MESSAGES, cached=False) as (put, target):
        put(k, v, target)
    store.write(txn)
    assert store.cache.segments() == {}
    txn = store.transaction()
    txn.put(Table.MESSAGES, k, v)
    assert txn.cache_blind


def test_puts_then_deletes_in_one_batch_make_the_cache_forget(
    written: tuple[Queue, Any, Chain],
) -> None:
    _, store, chain = written
    k, v = _one_row(chain)
    txn = store.transaction()
    with txn.writer(Table.MESSAGES) as (put, target):
        put(k, v, target)
    assert not txn.cache_blind
    txn.delete_range(Table.MESSAGES, k, codec.prefix_end(k))
    assert txn.cache_blind  # the cache replays deletes first: not this batch's order


def test_a_failed_write_makes_the_cache_forget(written: tuple[Queue, Any, Chain]) -> None:
    _, store, chain = written

    class Failing:
        def __init__(self, db: Any) -> None:
            self.db = db

        def write(self, *_: Any) -> None:
            # what rocksdict raises for RocksDB's failures: a bare Exception
            raise Exception("IO error: No space left on device")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.db, name)

    real = store._db
    store._db = Failing(real)
    try:
        with pytest.raises(StorageError):
            chain.apply(SHARDS[0], 3)
    finally:
        store._db = real
    assert store.cache.segments() == {}


def test_every_reader_gets_its_own_rows_from_one_cached_segment(tmp_path: Path) -> None:
    queue = Queue.open(tmp_path / "db", quiet_config())
    chain = Chain(queue)
    try:
        src = SHARDS[0]
        dsts = [address_in(SHARDS[i % 4], i) for i in range(40)]
        d = chain.apply(src, dsts)
        ranges = [QueueShardRange(src, d.messages[0].key, QueueKey.MAX)]
        assert _cursors(queue, 0, ranges) == [ChunkRows]
        for reader in SHARDS:
            got, positions = _read(queue, ranges, reader, 0)
            assert [m.message for m in got] == [m for m in d.messages if reader.contains(m.dst)]
            assert positions[-1] == {src: d.messages[-1].key}  # skipped rows included
    finally:
        queue.close()


def test_scans_the_cache_cannot_answer_go_to_rocksdb(tmp_path: Path) -> None:
    queue = Queue.open(tmp_path / "db", quiet_config())
    store = queue._store  # type: ignore[attr-defined]
    try:
        Chain(queue).apply(SHARDS[0], 3)
        prefix = codec.message_prefix(0, SHARDS[0])
        scans = [
            Scan(Table.MESSAGES, b"", b"\x00\x01"),  # shorter than a segment prefix
            Scan(Table.MESSAGES, prefix, codec.prefix_end(prefix), keys_only=True),
            Scan(Table.MESSAGES, prefix, codec.prefix_end(prefix), reverse=True),
            Scan(Table.MESSAGES, b"\xff" * 14, b"\xff" * 15),  # a prefix with no end
        ]
        with store.snapshot(scans=scans) as snap:
            assert [type(c) for c in snap.cursors] == [Cursor] * 4
            assert len(list(snap.cursors[1])) == 3
            assert list(snap.cursors[3]) == []
        whole = Scan(Table.MESSAGES, prefix + bytes(40), codec.prefix_end(prefix))
        with store.snapshot(scans=[whole]) as snap:
            assert [type(c) for c in snap.cursors] == [ChunkRows]
            assert len(list(snap.cursors[0])) == 3
    finally:
        queue.close()
