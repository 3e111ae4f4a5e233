"""The cache of fresh message rows (``imq.storage.cache``) against a model of the stored
rows: whatever it serves is exactly what RocksDB holds in the range, whatever the
sequence of writes, deletes and evictions; its C helpers equal their Python forms; and a
filtered scan merges to the same messages and positions as the whole range."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from imq import iterator
from imq.storage import cache as cache_mod
from imq.storage import codec
from imq.storage.cache import LOAD_AFTER_MISSES, MessageCache, Tee
from imq.types import Address, Message, QueueKey, QueueShardRange, ShardIdent

P = codec.MESSAGE_PREFIX_LEN
SHARDS = [ShardIdent(0, 0x4000_0000_0000_0000), ShardIdent(0, 0xC000_0000_0000_0000)]
Row = tuple[bytes, bytes]


def row(partition: int, shard: ShardIdent, lt: int, dst_top: int = 0, wc: int = 0) -> Row:
    """A real message row: key (partition, shard, lt, hash), destination account whose
    first byte is ``dst_top``."""
    dst = Address(wc, bytes([dst_top]) + bytes(31))
    src = Address(0, b"\x01" * 32)
    message = Message(QueueKey(lt, lt.to_bytes(32, "big")), src, dst, b"body")
    [r] = codec.message_rows(shard, [message], (lambda _s, _d: partition) if partition else None)
    return r


def prefix(partition: int, shard: ShardIdent) -> bytes:
    return codec.message_prefix(partition, shard)


class Stored:
    """The model: what RocksDB would hold, and ``top`` as the store computes it."""

    def __init__(self) -> None:
        self.rows: dict[bytes, bytes] = {}

    def put(self, rows: list[Row]) -> None:
        self.rows.update(rows)

    def delete(self, lo: bytes, hi: bytes) -> None:
        for key in [k for k in self.rows if lo <= k < hi]:
            del self.rows[key]

    def top(self, pre: bytes) -> bytes:
        keys = [k for k in self.rows if k.startswith(pre)]
        return max(keys) if keys else pre

    def below(self, pre: bytes, floor: bytes, limit: int) -> list[Row] | None:
        """What the store loads below a segment's floor: every row at or below it, if
        they fit in ``limit`` bytes."""
        rows = [r for r in self.scan(pre, codec.prefix_end(pre)) if r[0] <= floor]
        return rows if limit > 0 and sum(len(k) + len(v) for k, v in rows) <= limit else None

    def establish(self, cache: MessageCache, pre: bytes) -> None:
        """A read's first touch: the segment becomes known above its top; then, as the
        store does at its second declined scan, its rows below the floor when they fit."""
        cache.establish(pre, self.top(pre))
        for _ in range(LOAD_AFTER_MISSES):
            floor = cache.missed(pre)
        if floor is not None:
            rows = self.below(pre, floor, cache.load_limit)
            if rows is not None:
                cache.extend_down(pre, rows)

    def scan(self, lo: bytes, hi: bytes) -> list[Row]:
        return sorted((k, v) for k, v in self.rows.items() if lo <= k < hi)


def scan(
    cache: MessageCache, lo: bytes, hi: bytes, reader: Any = None
) -> tuple[list[Row], int] | None:
    """The cache's answer to a scan, pulled whole: (rows, rows left out), or None."""
    it = cache.scan(lo, hi, reader)
    if it is None:
        return None
    rows = list(it)
    return rows, it.dropped


def filtered(rows: list[Row], reader: tuple[int, int, int], c: Any = None) -> tuple[list[Row], int]:
    """``rows`` through ChunkRows (``c``: that class; default: the one imq uses)."""
    data, offs = cache_mod._pack(rows)
    it = (c or cache_mod.ChunkRows)([data], [offs], 0, len(rows), reader)
    out = list(it)
    return out, it.dropped


def write(cache: MessageCache, stored: Stored, rows: list[Row], deleted: Any = ()) -> None:
    """One batch, as Store.write hands it over: the segments it writes are established
    first (their floor: what is stored before it), then its deletes and rows are taken."""
    kept: dict[bytes, list[bytearray]] = {}
    tee = Tee(lambda *_: None, kept, P)
    for k, v in rows:
        tee(k, v, None)
    for pre in cache.unknown(kept):
        cache.establish(pre, stored.top(pre))
    for lo, hi in deleted:
        stored.delete(lo, hi)
    stored.put(rows)
    cache.after_write(kept, list(deleted), in_order=not tee.unordered)


def test_a_segment_is_known_from_its_first_write_and_caches_it() -> None:
    cache, stored = MessageCache(1 << 20, P, load_limit=0), Stored()  # loading nothing
    s = SHARDS[0]
    lo, hi = codec.message_range(0, s, QueueKey.MIN, QueueKey.MAX)
    before = [row(0, s, lt) for lt in (8, 9)]
    stored.put(before)  # written before the cache watched (before the queue opened)
    assert scan(cache, lo, hi) is None  # unknown segment: RocksDB
    first = [row(0, s, lt) for lt in (10, 11)]
    write(cache, stored, first)
    # Known now, its floor the greatest key stored before: older rows are never claimed.
    assert cache.segments()[prefix(0, s)] == (before[-1][0], first)
    assert scan(cache, lo, hi) is None  # the range starts at or below the floor
    above = codec.message_key(0, s, QueueKey(10, bytes(32)))
    assert scan(cache, above, hi) == (first, 0)
    assert scan(cache, above, codec.message_key(0, s, QueueKey(11, bytes(32)))) == (first[:1], 0)


def test_a_segment_missed_twice_loads_its_rows_below_the_floor_once() -> None:
    s = SHARDS[0]
    pre = prefix(0, s)
    lo, hi = codec.message_range(0, s, QueueKey.MIN, QueueKey.MAX)
    before = [row(0, s, lt) for lt in range(1, 10)]
    first = [row(0, s, lt) for lt in (10, 11)]
    cache, stored = MessageCache(1 << 20, P), Stored()
    stored.put(before)
    write(cache, stored, first)  # known above its top: before's rows are RocksDB's
    assert cache.segments()[pre] == (before[-1][0], first)
    assert scan(cache, lo, hi) is None
    assert cache.missed(pre) is None  # the first declined scan: counted
    assert cache.missed(pre) == before[-1][0]  # the second: load below the floor
    assert cache.missed(pre) is None  # once in the segment's life
    cache.extend_down(pre, before)
    assert cache.segments()[pre] == (pre, before + first)
    assert scan(cache, lo, hi) == (before + first, 0)
    assert cache.missed(pre) is None  # nothing lies below any more
    cache.check()
    assert MessageCache(64 << 20, P).load_limit == 1 << 20  # 1/64 of the budget
    assert cache.missed(prefix(1, s)) is None  # an unknown segment


def test_rows_below_the_floor_that_are_not_message_rows_change_nothing() -> None:
    s = SHARDS[0]
    pre = prefix(0, s)
    good = [row(0, s, lt) for lt in (1, 2, 3)]
    k, v = good[1]
    floor = good[-1][0]
    above = row(0, s, 4)
    for bad in [
        [good[0], (k[:-1], b"\x80" + v), good[2]],  # a key a byte short
        [good[0], (k + b"\x00", v[1:]), good[2]],  # a byte long
        [good[0], (k, v[:20]), good[2]],  # a value shorter than its header
        [good[2], good[0]],  # out of order
        [*good, above],  # a row above the floor
        [(pre, v)],  # a row at the prefix itself
    ]:
        cache = MessageCache(1 << 20, P)
        cache.establish(pre, floor)
        cache.extend_down(pre, bad)
        assert cache.segments()[pre] == (floor, [])
        cache.check()


def test_a_load_past_the_budget_evicts() -> None:
    s = SHARDS[0]
    rows = [row(0, s, lt) for lt in range(1, 41)]
    cache = MessageCache(10 * 300, P, load_limit=1 << 20)
    cache.establish(prefix(0, s), rows[-1][0])
    cache.extend_down(prefix(0, s), rows)
    cache.check()
    assert cache.nbytes <= 10 * 300
    assert cache.segments()[prefix(0, s)] == (rows[-1][0], [])  # its one chunk dropped


def test_a_segment_first_seen_by_a_read_is_empty_above_its_top() -> None:
    cache, stored = MessageCache(1 << 20, P), Stored()
    s = SHARDS[0]
    cache.establish(prefix(1, s), stored.top(prefix(1, s)))  # what a read does
    lo, hi = codec.message_range(1, s, QueueKey.MIN, QueueKey.MAX)
    assert scan(cache, lo, hi) == ([], 0)  # an empty segment: every range is served
    cache.establish(prefix(0, s), None)  # RocksDB could not tell
    assert cache.unknown([prefix(0, s), prefix(1, s)]) == [prefix(0, s)]


def test_a_scan_leaving_its_segment_goes_to_rocksdb() -> None:
    cache, stored = MessageCache(1 << 20, P), Stored()
    s = SHARDS[0]
    write(cache, stored, [row(0, s, 1)])
    write(cache, stored, [row(0, s, 2)])
    lo = codec.message_key(0, s, QueueKey(2, bytes(32)))
    assert scan(cache, lo, codec.prefix_end(prefix(0, s))) == ([row(0, s, 2)], 0)
    assert scan(cache, lo, codec.prefix_end(prefix(0, s)) + b"\x00") is None
    assert scan(cache, lo, codec.message_key(1, s, QueueKey.MIN)) is None


def test_a_row_that_is_not_a_message_row_makes_the_cache_forget() -> None:
    cache, stored = MessageCache(1 << 20, P), Stored()
    s = SHARDS[0]
    write(cache, stored, [row(0, s, 1)])
    key = codec.message_key(0, s, QueueKey(3, bytes(32)))
    data, offs = cache_mod._pack([(key, b"short")])
    cache.after_write({key[:P]: [data, offs]}, [])
    assert cache.segments() == {}
    assert cache.nbytes == 0


@pytest.mark.parametrize("tee", [cache_mod._PyTee, Tee], ids=["python", "default"])
def test_a_tee_marks_a_batch_with_a_row_that_is_not_a_message_row(tee: Any) -> None:
    kept: dict[bytes, list[bytearray]] = {}
    t = tee(lambda *_: None, kept, P)
    t(b"k" * codec.MESSAGE_KEY_LEN, b"short", None)
    assert t.invalid
    assert kept == {}


def test_a_disabled_cache_keeps_nothing() -> None:
    cache, stored = MessageCache(0, P), Stored()
    for lt in range(3):
        write(cache, stored, [row(0, SHARDS[0], lt)])
    assert not cache.enabled
    assert cache.segments() == {}


def test_a_delete_across_chunks_cuts_the_ends_and_drops_the_middle() -> None:
    cache, stored = MessageCache(1 << 20, P), Stored()
    s = SHARDS[0]
    for base in (10, 20, 30, 40):  # four chunks of three rows
        write(cache, stored, [row(0, s, base + i) for i in range(3)])
    lo = codec.message_key(0, s, QueueKey(21, bytes(32)))
    hi = codec.message_key(0, s, QueueKey(31, bytes(32)))
    write(cache, stored, [], [(lo, hi)])
    floor, rows = cache.segments()[prefix(0, s)]
    assert [r[0] for r in rows] == [row(0, s, lt)[0] for lt in (10, 11, 12, 20, 31, 32, 40, 41, 42)]
    assert rows == [r for r in stored.scan(floor, codec.prefix_end(prefix(0, s))) if r[0] > floor]
    cache.check()


def test_a_delete_across_segments_cuts_each_of_them() -> None:
    """A range from inside one segment to inside another (wider than any delete imq makes
    itself: those stay inside one segment, which is all the cache then looks at) takes
    the rows of both, and of every segment between."""
    cache, stored = MessageCache(1 << 20, P), Stored()
    shards = [ShardIdent(0, (2 * i + 1) << 61) for i in range(4)]
    for s in shards:
        write(cache, stored, [row(0, s, lt) for lt in (10, 20, 30)])
    lo = codec.message_key(0, shards[0], QueueKey(15, bytes(32)))
    hi = codec.message_key(0, shards[2], QueueKey(25, bytes(32)))
    write(cache, stored, [], [(lo, hi)])
    for s, left in zip(shards, [(10,), (), (30,), (10, 20, 30)], strict=True):
        floor, rows = cache.segments()[prefix(0, s)]
        assert rows == [row(0, s, lt) for lt in left]
        assert rows == [
            r for r in stored.scan(floor, codec.prefix_end(prefix(0, s))) if r[0] > floor
        ]
    cache.check()


def test_eviction_drops_the_oldest_chunks_and_raises_the_floor() -> None:
    r = row(0, SHARDS[0], 1)
    per_chunk = len(r[0]) + len(r[1]) + 4 + cache_mod.CHUNK_OVERHEAD
    cache, stored = MessageCache(4 * per_chunk, P), Stored()
    s = SHARDS[0]
    for lt in range(10):  # ten batches of one row: ten chunks
        write(cache, stored, [row(0, s, lt)])
        cache.check()
    floor, rows = cache.segments()[prefix(0, s)]
    assert cache.nbytes <= 4 * per_chunk
    assert 0 < len(rows) < 10  # the newer chunks stay
    assert rows == [r for r in stored.scan(floor, codec.prefix_end(prefix(0, s))) if r[0] > floor]
    assert floor == row(0, s, 9 - len(rows))[0]


def test_a_row_put_again_at_the_floor_is_not_cached() -> None:
    """A batch that puts a row again at exactly the segment's floor key (the greatest key
    stored when the cache began watching) keeps only what lies above it: the row at the
    floor stays RocksDB's, so a later load below the floor (which takes every row at or
    below it) adds it once, not a second time beside a cached copy."""
    cache, stored = MessageCache(1 << 20, P), Stored()
    s = SHARDS[0]
    pre = prefix(0, s)
    before = [row(0, s, 1), row(0, s, 2)]
    stored.put(before)
    cache.establish(pre, stored.top(pre))
    again = row(0, s, 2, dst_top=5)  # the floor's key, put again
    write(cache, stored, [again, row(0, s, 3)])
    assert cache.segments()[pre] == (before[-1][0], [row(0, s, 3)])
    cache.check()
    cache.extend_down(pre, stored.scan(pre, codec.message_key(0, s, QueueKey(3, bytes(32)))))
    assert cache.segments()[pre] == (pre, [before[0], again, row(0, s, 3)])
    cache.check()


def _one_row_chunk_bytes() -> int:
    """What a cached chunk of one row (of :func:`row`'s size) costs."""
    r = row(0, SHARDS[0], 1)
    return len(r[0]) + len(r[1]) + 4 + cache_mod.CHUNK_OVERHEAD


def test_eviction_goes_down_to_three_quarters_of_the_budget() -> None:
    """Past its budget the cache evicts down to three quarters of it, not just under it:
    the next few batches then fit without another eviction each."""
    per_chunk = _one_row_chunk_bytes()
    budget = 4 * per_chunk + per_chunk // 2
    cache, stored = MessageCache(budget, P), Stored()
    s = SHARDS[0]
    for lt in range(5):  # the fifth chunk goes past the budget
        write(cache, stored, [row(0, s, lt)])
    assert cache.nbytes <= budget * 3 // 4
    assert cache.nbytes == 3 * per_chunk
    cache.check()


def test_eviction_stops_at_exactly_three_quarters_of_the_budget() -> None:
    """Chunks whose total meets three quarters of the budget exactly once the oldest go
    are kept: eviction drops no chunk more than it must."""
    per_chunk = _one_row_chunk_bytes()
    budget = 4 * per_chunk  # three quarters: exactly three chunks
    cache, stored = MessageCache(budget, P), Stored()
    s = SHARDS[0]
    for lt in range(5):  # four fit; the fifth evicts
        write(cache, stored, [row(0, s, lt)])
        assert cache.stats()["chunks"] == (lt + 1 if lt < 4 else 3)
    floor, rows = cache.segments()[prefix(0, s)]
    assert rows == [row(0, s, lt) for lt in (2, 3, 4)]
    assert floor == row(0, s, 1)[0]
    assert cache.nbytes == budget * 3 // 4
    cache.check()


@pytest.mark.parametrize("tee", [cache_mod._PyTee, Tee], ids=["python", "default"])
def test_tee_puts_every_row_and_keeps_it_in_its_segments_chunk(tee: Any) -> None:
    put: list[tuple[bytes, bytes, object]] = []
    kept: dict[bytes, list[bytearray]] = {}
    t = tee(lambda k, v, target: put.append((k, v, target)), kept, P)
    a, b, c = row(0, SHARDS[0], 2), row(1, SHARDS[0], 1), row(0, SHARDS[0], 3)
    for r in (a, b, c):
        t(r[0], r[1], "cf")
    assert [p[2] for p in put] == ["cf"] * 3
    assert set(kept) == {prefix(0, SHARDS[0]), prefix(1, SHARDS[0])}
    data, offs = kept[prefix(0, SHARDS[0])]
    assert list(cache_mod._PyChunkRows([data], [offs], 0, 2)) == [a, c]
    data, offs = kept[prefix(1, SHARDS[0])]
    assert list(cache_mod._PyChunkRows([data], [offs], 0, 1)) == [b]
    assert [bytes(x) for x in kept[prefix(0, SHARDS[0])]] == list(cache_mod._pack([a, c]))
    assert not t.unordered and not t.invalid
    t(a[0], a[1], None)  # a key again: not above its chunk's last row
    assert t.unordered


# -- the invariant, under random sequences -----------------------------------------------------

LTS = st.integers(0, 30)
op = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 1), st.integers(0, 1), st.lists(LTS, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 1), st.integers(0, 1), st.tuples(LTS, LTS)),
    # a reopen (the new store's cache knows no segment), then a read of one segment
    st.tuples(st.just("reopen"), st.integers(0, 1), st.integers(0, 1), st.just(None)),
)
STEP = 10  # each op's lts start this much above the previous op's: mostly appends


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(op, max_size=30),
    budget_rows=st.integers(1, 40),
    load_rows=st.integers(0, 12),
    scans=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1), LTS, LTS), max_size=12),
    reader_top=st.integers(0, 3),
)
def test_a_cached_scan_is_exactly_the_stored_range(
    ops: list[Any], budget_rows: int, load_rows: int, scans: list[Any], reader_top: int
) -> None:
    """Puts (in order, out of order, again), range deletes, evictions and reopens in any
    order, segments first seen by a write or a read (loading their newest stored rows):
    every scan the cache answers equals the stored rows of its range, its filtered form
    is the filter of those rows, and ``count`` answers the same ranges with their
    number of rows."""
    per_row = 300
    row_bytes = sum(map(len, row(0, SHARDS[0], 0)))
    # a load limit of about `load_rows` rows (not a whole number: the load stops past it)
    limit = max(0, load_rows * row_bytes - row_bytes // 2)
    cache, stored = MessageCache(budget_rows * per_row, P, load_limit=limit), Stored()
    for i, (kind, partition, shard_i, arg) in enumerate(ops):
        shard, base = SHARDS[shard_i], i * STEP
        if kind == "reopen":
            cache.forget()
            stored.establish(cache, prefix(partition, shard))  # what a first read does
            cache.check()
        elif kind == "put":
            rows = [row(partition, shard, base + lt + 90, dst_top=lt % 4 * 64) for lt in arg]
            write(cache, stored, rows)
        else:
            a, b = sorted(arg)
            lo = codec.message_key(partition, shard, QueueKey(base + a + 90 - STEP, bytes(32)))
            hi = codec.message_key(partition, shard, QueueKey(base + b + 90, bytes(32)))
            if lo < hi:
                write(cache, stored, [], [(lo, hi)])
    reader = (128, 2, reader_top)  # workchain 0, accounts whose top 2 bits are reader_top
    end = len(ops) * STEP + 90
    for partition, shard_i, a, b in scans:
        shard = SHARDS[shard_i]
        lo = codec.message_key(partition, shard, QueueKey(end - 3 * a, bytes(32)))
        hi = codec.message_key(partition, shard, QueueKey(end - 3 * a + 3 * b, bytes(32)))
        got = scan(cache, lo, hi)
        counted = cache.count(lo, hi)
        assert (counted is None) == (got is None)  # count answers exactly where scan does
        if got is not None:
            assert got == (stored.scan(lo, hi), 0)
            assert counted == len(got[0])
            assert scan(cache, lo, hi, reader) == filtered(got[0], reader, cache_mod._PyChunkRows)
    for pre, (floor, rows) in cache.segments().items():  # the invariant itself
        assert rows == [r for r in stored.scan(pre, codec.prefix_end(pre)) if r[0] > floor]
    cache.check()
    assert_scan_many_is_scan(cache, end, reader)


def assert_scan_many_is_scan(cache: MessageCache, end: int, reader: Any) -> None:
    """``scan_many`` (one call to C when built) answers each range as ``scan`` does:
    ranges inside a segment, to its end, across two segments, and too short."""
    bounds = []
    for partition, shard in itertools.product((0, 1), SHARDS):
        pre = codec.message_prefix(partition, shard)
        beyond = pre[:-1] + bytes([pre[-1] + 2])  # past the segment's end: not the cache's
        low = pre + bytes(40)  # above the floor of a segment that was empty when first seen
        bounds += [(pre, codec.prefix_end(pre)), (low, codec.prefix_end(pre)), (low, beyond)]
        for a, b in itertools.product(range(0, end + 12, 7), (1, 5, 40)):
            lo = codec.message_key(partition, shard, QueueKey(a, bytes(32)))
            hi = codec.message_key(partition, shard, QueueKey(a + b, bytes(32)))
            bounds += [(lo, hi), (lo, codec.prefix_end(pre)), (lo, lo)]
    a, b = (codec.message_prefix(0, s) for s in SHARDS)
    bounds += [(a + bytes(40), b + bytes(40)), (a[:5], b), (b"", a)]
    for r in (None, reader):
        many = cache.scan_many(bounds, r)
        assert len(many) == len(bounds)
        for (lo, hi), got in zip(bounds, many, strict=True):
            want = cache.scan(lo, hi, r)
            assert (got is None) == (want is None), (lo.hex(), hi.hex())
            if got is not None:
                assert (list(got), got.dropped) == (list(want), want.dropped)


# -- the chunk functions: C against Python, and what the merge makes of a filtered scan --------

ROWS = st.lists(st.tuples(st.integers(0, 255), st.sampled_from([0, -1])), max_size=40)


@settings(max_examples=200, deadline=None)
@given(
    dsts=ROWS,
    cuts=st.lists(st.integers(0, 40), max_size=3),
    bounds=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    test=st.tuples(st.sampled_from([128, 127, -1]), st.integers(0, 8), st.integers(0, 255)),
    probe=st.integers(0, 45),
)
def test_the_chunk_functions_in_c_equal_python(
    dsts: list[tuple[int, int]],
    cuts: list[int],
    bounds: tuple[int, int],
    test: tuple[int, int, int],
    probe: int,
) -> None:
    """Rows split into chunks at ``cuts``; parts of them filtered, built, bisected and
    checked by both forms."""
    c = cache_mod.speedups
    if c is None:
        pytest.skip("the C helpers are not built")
    rows = [row(0, SHARDS[0], 2 * i + 1, top, wc) for i, (top, wc) in enumerate(dsts)]
    for pack in (c.chunk_pack, cache_mod._pack_py):
        with pytest.raises(ValueError, match="message key"):
            pack([*rows, (b"not a message key", b"")])
    edges = sorted({0, len(rows), *(x % (len(rows) + 1) for x in cuts)})
    chunks = [cache_mod._pack(rows[a:b]) for a, b in itertools.pairwise(edges)]
    sizes = [b - a for a, b in itertools.pairwise(edges)]
    reader = (test[0], test[1], test[2] >> (8 - test[1]))
    for (data, offs), (a, b) in zip(chunks, itertools.pairwise(edges), strict=True):
        assert (data, offs) == cache_mod._pack_py(rows[a:b]) == c.chunk_pack(rows[a:b])
        assert c.chunk_check(data, offs) == cache_mod._chunk_check_py(data, offs)
        key = codec.message_key(0, SHARDS[0], QueueKey(probe, bytes(32)))
        assert c.chunk_bisect(data, offs, key) == cache_mod._chunk_bisect_py(data, offs, key)
        # a delete that ends inside the chunk keeps rows [0, i) and [j, n)
        i, j = sorted((bounds[0] % (b - a + 1), bounds[1] % (b - a + 1)))
        cut = c.chunk_cut(bytearray(data), offs, i, j)
        assert cut == cache_mod._chunk_cut_py(data, offs, i, j)
        assert cut == cache_mod._pack_py(rows[a : a + i] + rows[a + j : b])
        with pytest.raises(ValueError, match="range"):
            c.chunk_cut(data, offs, j, b - a + 1)
        with pytest.raises(ValueError, match="range"):
            cache_mod._chunk_cut_py(data, offs, j, b - a + 1)
    if not chunks:
        return
    datas = [bytearray(d) for d, _ in chunks]
    offss = [o for _, o in chunks]
    start = bounds[0] % (sizes[0] + 1)
    stop = bounds[1] % (sizes[-1] + 1)
    if len(chunks) == 1:
        start, stop = sorted((start, stop))
    args = (datas, offss, start, stop)
    assert list(c.ChunkRows(*args)) == list(cache_mod._PyChunkRows(*args))
    got, want_ = c.ChunkRows(*args, reader), cache_mod._PyChunkRows(*args, reader)
    # Row by row: the same rows, and ``dropped`` the same after each (a merge that stops
    # early reads it there).
    for got_row, want_row in itertools.zip_longest(got, want_):
        assert got_row == want_row
        assert got.dropped == want_.dropped
    with pytest.raises(ValueError, match="start/stop"):
        c.ChunkRows(datas, offss, 0, sizes[-1] + 1)
    with pytest.raises(ValueError, match="start/stop"):
        cache_mod._PyChunkRows(datas, offss, 0, sizes[-1] + 1)


@pytest.mark.parametrize("form", ["python", "c"])
def test_chunk_rows_are_a_cursor(form: str) -> None:
    """What the store hands the merge for a cached scan is the cursor itself: ``rows`` and
    ``items`` are the iterator, ``finish`` checks nothing, ``close`` ends it and keeps
    ``dropped``, ``count`` is refused as on an unseekable cursor."""
    if form == "c" and cache_mod.speedups is None:
        pytest.skip("the C helpers are not built")
    cls = cache_mod._PyChunkRows if form == "python" else cache_mod.speedups.ChunkRows
    rows = [row(0, SHARDS[0], lt, dst_top=top) for lt, top in enumerate([0, 200, 200, 200, 0])]
    data, offs = cache_mod._pack(rows)
    it = cls([data], [offs], 0, len(rows), (128, 1, 0))
    assert it.rows is it and it.items is it and iter(it) is it
    assert next(it) == rows[0]
    assert next(it) == rows[3]  # the run of rows 1..3: its last one only
    assert it.dropped == 2
    assert it.finish(rows[3][0]) is None
    it.close()
    assert list(it) == [] and it.dropped == 2
    it.close()  # again: nothing happens
    with pytest.raises(ValueError, match="seekable"):
        it.count(b"", b"\xff")


@pytest.mark.parametrize("check", ["python", "c"])
def test_chunk_check_refuses_what_is_not_a_chunk_of_message_rows(check: str) -> None:
    fn = cache_mod._chunk_check_py if check == "python" else cache_mod._chunk_check
    good = cache_mod._pack([row(0, SHARDS[0], 1), row(0, SHARDS[0], 2)])
    assert fn(*good)[0] == 2
    assert fn(*good)[2] is True
    assert fn(*cache_mod._pack([row(0, SHARDS[0], 2), row(0, SHARDS[0], 1)]))[2] is False
    bad = [
        cache_mod._pack([(b"k" * codec.MESSAGE_KEY_LEN, b"short")]),  # no whole header
        (good[0], good[1][:-1]),  # offsets not uint32s
        (good[0][:-5] + b"", good[1][::-1]),  # offsets out of order
        (b"x", b""),  # bytes without rows
    ]
    for data, offs in bad:
        with pytest.raises(ValueError, match="chunk"):
            fn(data, offs)


class _Snap:
    def __init__(self, cursors: list[Any]) -> None:
        self.cursors = cursors
        self.state = None

    def check_usable(self) -> None:
        pass

    def close(self) -> None:
        for c in self.cursors:
            c.close()


def _walk(it: iterator.QueueIterator) -> Iterator[tuple[Any, dict[ShardIdent, QueueKey]]]:
    for message in it:
        yield message, it.current_position()
    yield None, it.current_position()


@settings(max_examples=150, deadline=None)
@given(
    sources=st.lists(
        st.lists(st.tuples(st.integers(1, 60), st.integers(0, 3)), max_size=15),
        min_size=1,
        max_size=3,
    ),
    stop_after=st.integers(0, 20),
    cuts=st.lists(st.integers(1, 14), max_size=4),
)
def test_a_filtered_scan_merges_to_the_same_messages_and_positions(
    sources: list[list[tuple[int, int]]], stop_after: int, cuts: list[int]
) -> None:
    """Leaving out all but the last row of each run of rows the reader skips changes
    nothing a consumer sees: messages, positions after each one, positions at the end,
    and the skipped count (what merge_fill skips plus what the scan dropped). The C merge
    reads a filtered scan's rows in place, in its chunks (``cuts`` splits each source's
    rows into several), and an unfiltered one through its rows."""
    shards = [ShardIdent(0, (2 * i + 1) << 61) for i in range(len(sources))]
    for_shard = ShardIdent(0, 0x4000_0000_0000_0000)  # accounts whose top 2 bits are 01
    reader = iterator.destination_test(for_shard)
    full: list[list[Row]] = []
    for shard, spec in zip(shards, sources, strict=True):
        lts = sorted({lt * 4 + shards.index(shard) for lt, _ in spec})
        tops = [top for _, top in spec]
        full.append([row(0, shard, lt, dst_top=t * 64) for lt, t in zip(lts, tops, strict=False)])
    ranges = [QueueShardRange(s, QueueKey.MIN, QueueKey.MAX) for s in shards]

    def run(filtered: bool) -> tuple[list[Any], list[int], bool]:
        cursors = []
        for rows in full:
            bounds = [0, *sorted({c for c in cuts if c < len(rows)}), len(rows)]
            parts = [cache_mod._pack(rows[a:b]) for a, b in itertools.pairwise(bounds)]
            datas, offss = [d for d, _ in parts], [o for _, o in parts]
            stop = bounds[-1] - bounds[-2]
            if filtered:
                source = cache_mod.ChunkRows(datas, offss, 0, stop, reader)
            else:
                source = cache_mod.ChunkRows(datas, offss, 0, stop)
            cursors.append(source)
        done: list[int] = []
        it = iterator.QueueIterator(
            _Snap(cursors), ranges, for_shard, lambda _y, skipped: done.append(skipped)
        )
        seen = []
        finished = True
        for i, step in enumerate(_walk(it)):
            seen.append(step)
            if i == stop_after and step[0] is not None:
                it.close()  # a consumer that stops early keeps what it took
                seen.append((None, it.current_position()))
                finished = False
                break
        it.close()
        return seen, done, finished

    for pure in (False, True):
        with iterator.pure_python() if pure else nullcontext():
            whole, skipped_whole, finished = run(False)
            part, skipped_part, _ = run(True)
        assert part == whole
        if finished:  # the whole skipped count is known once the merge ran to its end
            assert skipped_part == skipped_whole
