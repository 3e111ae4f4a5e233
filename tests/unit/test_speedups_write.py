"""The compiled write path (``imq._speedups``: ``encode_diff``, ``sources_in_shard``,
``strictly_ascending``) gives exactly what its pure-Python forms give: the same rows,
statistics, totals, verdicts and errors, and the same stored bytes through the queue;
the compiled ``Tee`` keeps what the encoders put in chunks sized ahead.

The pure-Python forms run in the same process by setting the module globals that hold
the compiled functions to ``None`` (what ``IMQ_PURE_PYTHON=1`` does at import)."""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
from compiled_only import COMPILED_ONLY
from hypothesis import given, settings
from hypothesis import strategies as st

from imq import apply, diff
from imq.config import QueueConfig
from imq.diff import DiffStatistics, QueueDiff
from imq.queue import Queue
from imq.router import PartitionRouter
from imq.storage import Table, codec
from imq.storage import cache as cache_mod
from imq.testing import MemoryDatabase
from imq.types import Address, BlockIdShort, Message, QueueKey, ShardIdent

pytestmark = COMPILED_ONLY

SHARD = ShardIdent(0, 0x4000_0000_0000_0000)


@contextlib.contextmanager
def pure_write_path() -> Iterator[None]:
    """Run the write path's pure-Python forms, as ``IMQ_PURE_PYTHON=1`` would."""
    with (
        mock.patch.object(codec, "_c_put_rows", None),
        mock.patch.object(codec, "_c_stat_value", None),
        mock.patch.object(codec, "_c_encode_diff", None),
        mock.patch.object(codec, "_c_diff_record", None),
        mock.patch.object(apply, "_c_sources_in_shard", None),
        mock.patch.object(diff, "_c_strictly_ascending", None),
    ):
        yield


def test_the_compiled_write_path_is_in_use() -> None:
    assert codec._c_encode_diff is not None
    assert codec._c_diff_record is not None
    assert apply._c_sources_in_shard is not None
    assert diff._c_strictly_ascending is not None


# A small pool of destinations, so that counts merge; each one may also be rebuilt as an
# equal but distinct object (counting is by value, not by identity). Some differ only in
# their last account byte, some only in their workchain.
POOL = [
    *(Address(wc, bytes((i,)) * 32) for i, wc in enumerate((0, 0, -1, 5, 127, -128))),
    *(Address(0, b"\x07" * 31 + bytes((last,))) for last in (1, 2, 3)),
    *(Address(wc, b"\x09" * 32) for wc in (0, 1, -1)),
]


@st.composite
def addresses(draw: st.DrawFn) -> Address:
    if draw(st.booleans()):
        picked = draw(st.sampled_from(POOL))
        if draw(st.booleans()):
            return Address(picked.workchain, bytes(bytearray(picked.account)))  # a copy
        return picked
    return Address(draw(st.integers(-128, 127)), draw(st.binary(min_size=32, max_size=32)))


keys = st.builds(QueueKey, st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32))
messages = st.builds(Message, keys, addresses(), addresses(), st.binary(max_size=64))


@st.composite
def routers(draw: st.DrawFn) -> PartitionRouter:
    routes = st.dictionaries(st.integers(1, 3), st.lists(st.sampled_from(POOL), max_size=3))
    return PartitionRouter(draw(routes), draw(routes))


def _encode(
    encode: Callable[..., codec.EncodedDiff],
    batch: tuple[Message, ...],
    partition_for: codec.PartitionFor,
) -> tuple[codec.EncodedDiff, list[tuple[bytes, bytes]]]:
    rows: list[tuple[bytes, bytes]] = []
    out = encode(lambda k, v, _t: rows.append((k, v)), None, SHARD, batch, partition_for)
    return out, rows


@given(
    st.lists(messages, max_size=60, unique_by=lambda m: m.key),
    routers(),
    st.booleans(),
    st.booleans(),
)
def test_encode_diff_compiled_equals_pure_python_and_from_diff(
    batch: list[Message], router: PartitionRouter, routed: bool, no_src: bool
) -> None:
    """Both encoders, with the router as a callable and, when it routes destinations
    only, as the dict of its destination routes (looked up without a call)."""
    if no_src:
        router = PartitionRouter(dst=router.dst_partitions())
    d = QueueDiff(batch, router=router if routed else None)
    partition_for = None if d.router.is_empty else d.router.partition_for
    compiled, rows_c = _encode(codec.encode_diff, d.messages, partition_for)
    pure, rows_py = _encode(codec._encode_diff_py, d.messages, partition_for)
    assert compiled == pure
    assert rows_c == rows_py == codec.message_rows(SHARD, d.messages, partition_for)
    routes = d.router.destination_routes()
    if partition_for is not None and routes is not None:
        for encode in (codec.encode_diff, codec._encode_diff_py):
            assert _encode(encode, d.messages, dict(routes)) == (compiled, rows_c)
    assert compiled.rows == len(batch)
    # The reference: what DiffStatistics.from_diff counts, packed by stat_value.
    stats = DiffStatistics.from_diff(d, SHARD, QueueKey.MIN, QueueKey.MAX)
    assert [p for p, _, _ in compiled.partitions] == list(stats.partitions)
    for partition, count, value in compiled.partitions:
        assert value == codec._stat_value_py(stats.partitions[partition])
        assert count == sum(stats.partitions[partition].values())
    assert {ShardIdent.full(w): n for w, n in compiled.workchains} == stats.shards_messages_count
    assert [w for w, _ in compiled.workchains] == sorted(w for w, _ in compiled.workchains)


def test_encode_diff_errors_leave_nothing_half_counted() -> None:
    """A failing put or router raises out of the C pass, as out of the Python one."""
    batch = (Message(QueueKey(1, bytes(32)), POOL[0], POOL[1], b""),)

    def bad_put(_k: bytes, _v: bytes, _t: Any) -> None:
        raise OSError("disk")

    def bad_router(_s: Address, _d: Address) -> int:
        raise KeyError("router")

    for encode in (codec.encode_diff, codec._encode_diff_py):
        with pytest.raises(OSError, match="disk"):
            encode(bad_put, None, SHARD, batch, None)
        with pytest.raises(KeyError, match="router"):
            encode(lambda *_: None, None, SHARD, batch, bad_router)


def test_encode_diff_refuses_a_partition_out_of_range() -> None:
    batch = (Message(QueueKey(1, bytes(32)), POOL[0], POOL[1], b""),)
    for encode in (codec.encode_diff, codec._encode_diff_py):
        with pytest.raises(ValueError, match="partition"):
            encode(lambda *_: None, None, SHARD, batch, lambda _s, _d: 65536)


shards = st.sampled_from(
    [
        ShardIdent(0, 0x8000_0000_0000_0000),
        ShardIdent(0, 0x4000_0000_0000_0000),
        ShardIdent(0, 0xC000_0000_0000_0000),
        ShardIdent(0, 0x2000_0000_0000_0000),
        ShardIdent(0, 0x0000_0000_0000_0008),  # prefix_len 60
        ShardIdent(-1, 0x8000_0000_0000_0000),
        ShardIdent(5, 0xA000_0000_0000_0000),
    ]
)


any_shards = st.builds(
    ShardIdent,
    st.integers(-(2**31), 2**31 - 1).filter(lambda wc: wc != -1),
    st.integers(1, 2**61 - 1).map(lambda p: p << 3),
) | st.just(ShardIdent.MASTERCHAIN)
# Every msgpack int form: fixint, uint8..uint64, around each boundary.
edge_ints = st.sampled_from([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1])
counts = st.integers(0, 2**64 - 1) | edge_ints


@settings(max_examples=300)
@given(
    min_message=keys,
    max_message=keys,
    shards_messages_count=st.dictionaries(any_shards, counts, max_size=20),
    diff_hash=st.binary(min_size=32, max_size=32),
    processed_to=st.dictionaries(any_shards, keys, max_size=20),
    router_src=st.dictionaries(st.integers(0, 255), st.frozensets(addresses(), max_size=20)),
    router_dst=st.dictionaries(st.integers(0, 255), st.frozensets(addresses(), max_size=20)),
    seqno=st.integers(0, 2**32 - 1) | edge_ints.filter(lambda n: n < 2**32),
    prev_hash=st.none() | st.binary(min_size=32, max_size=32),
    partitions=st.dictionaries(st.integers(0, 255), counts, max_size=20),
)
def test_diff_record_compiled_equals_msgpack(**fields: Any) -> None:
    """The C packing of a diff's record is msgpack's, byte for byte (every int form,
    arrays of 16 and more, shards and addresses sorted as their values sort)."""
    record = codec.diff_record_value(**fields)
    with pure_write_path():
        assert record == codec.diff_record_value(**fields)
    span = codec.decode_diff_span(b"k", record)
    assert span[:2] == (fields["min_message"], fields["max_message"])


def test_diff_record_refuses_what_is_not_a_record() -> None:
    """The C packing raises on a field it cannot pack (the apply path hands it checked
    fields; ``diff_record_value`` takes the Python packing for mappings of other types)."""
    key = QueueKey(1, bytes(32))
    good: dict[str, Any] = {
        "min_message": key,
        "max_message": key,
        "shards_messages_count": {},
        "diff_hash": bytes(32),
        "processed_to": {},
        "router_src": {},
        "router_dst": {},
        "seqno": 1,
        "prev_hash": None,
        "partitions": {0: 1},
    }
    with pure_write_path():
        packed = codec.diff_record_value(**good)
    assert codec.diff_record_value(**good) == packed
    for field, bad in (
        ("min_message", (1, b"short")),
        ("shards_messages_count", {(0,): 1}),
        ("processed_to", {SHARD: "key"}),
        ("router_dst", {0: [Address(0, bytes(32))]}),
        ("router_dst", {0: frozenset({"not an address"})}),
        ("seqno", True),
        ("seqno", -(2**64)),
        ("prev_hash", "hash"),
        ("partitions", {"0": 1}),
        ("partitions", [0]),
    ):
        with pytest.raises((TypeError, ValueError, OverflowError)):
            codec._c_diff_record(codec._RECORD_VERSION, *{**good, field: bad}.values())


@st.composite
def sources(draw: st.DrawFn, shard: ShardIdent) -> Address:
    """Mostly inside ``shard``, sometimes just outside (other workchain or prefix)."""
    bits = shard.prefix_len
    head = draw(st.integers(0, 2**64 - 1))
    if bits and draw(st.integers(0, 9)):
        shift = 64 - bits
        head = ((shard.prefix >> shift) << shift) | (head & ((1 << shift) - 1))
    wc = shard.workchain if draw(st.integers(0, 9)) else draw(st.integers(-128, 127))
    return Address(wc, head.to_bytes(8, "big") + draw(st.binary(min_size=24, max_size=24)))


@given(st.data(), shards)
def test_source_check_compiled_equals_pure_python(data: st.DataObject, shard: ShardIdent) -> None:
    srcs = data.draw(st.lists(sources(shard), max_size=30))
    batch = [Message(QueueKey(i, bytes(32)), src, POOL[0], b"") for i, src in enumerate(srcs, 1)]
    d, block = QueueDiff(batch), BlockIdShort(shard, 1)
    inside = all(shard.contains(m.src) for m in batch)
    if batch:
        assert apply._c_sources_in_shard(d.messages, *shard, shard.prefix_len) is inside
    outcomes = []
    for path in (contextlib.nullcontext, pure_write_path):
        with path():
            try:
                apply.check_sources(d, block)
                outcomes.append(None)
            except ValueError as exc:
                outcomes.append(str(exc))
    assert outcomes[0] == outcomes[1]
    assert (outcomes[0] is None) is inside


@given(
    st.lists(
        st.one_of(
            messages,
            st.builds(
                Message,
                st.builds(QueueKey, st.integers(0, 3), st.sampled_from([bytes(32), b"\x01" * 32])),
                st.sampled_from(POOL),
                st.sampled_from(POOL),
            ),
        ),
        max_size=20,
    ),
    st.booleans(),
    st.sampled_from([None, "tuple", "int"]),
)
def test_queue_diff_construction_compiled_equals_pure_python(
    batch: list[Message], presort: bool, intruder: str | None
) -> None:
    """Sorted or not, duplicated or not, with a non-Message or not: the same diff or the
    same error either way."""
    items: list[Any] = sorted(batch) if presort else list(batch)
    if intruder == "tuple":
        items.insert(len(items) // 2, tuple(batch[0]) if batch else (1, 2, 3, 4))
    elif intruder == "int":
        items.append(7)
    outcomes = []
    for path in (contextlib.nullcontext, pure_write_path):
        with path():
            fast = diff._strictly_ascending(list(items))
            try:
                outcomes.append((fast, QueueDiff(items).messages))
            except (TypeError, ValueError) as exc:
                outcomes.append((fast, f"{type(exc).__name__}: {exc}"))
    assert outcomes[0] == outcomes[1]
    keys_ = [m.key for m in items if type(m) is Message]
    ascending = len(keys_) == len(items) and all(a < b for a, b in itertools.pairwise(keys_))
    assert outcomes[0][0] is ascending


# --- through the queue: the same stored bytes either way -----------------------------------

H = [bytes((i,)) * 32 for i in range(256)]


@st.composite
def diffs(draw: st.DrawFn) -> list[tuple[QueueDiff, bool]]:
    """A few diffs of SHARD in rising lts: messages (sources inside SHARD), a router or
    none, and whether the caller passes its statistics."""
    out = []
    lt = 1_000
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(0, 25))
        msgs = []
        for _ in range(n):
            lt += draw(st.integers(1, 3))
            src = Address(0, b"\x50" + draw(st.binary(min_size=31, max_size=31)))
            msgs.append(
                Message(
                    QueueKey(lt, draw(st.binary(min_size=32, max_size=32))),
                    src,
                    draw(addresses()),
                    draw(st.binary(max_size=40)),
                )
            )
        if draw(st.booleans()):
            msgs.reverse()
        router = draw(routers()) if draw(st.booleans()) else None
        span = {"start_lt": lt - 50, "end_lt": lt + 1} if not msgs and draw(st.booleans()) else {}
        out.append((QueueDiff(msgs, router=router, **span), draw(st.booleans())))
        lt += 10
    return out


def _apply_all(batch: list[tuple[QueueDiff, bool]]) -> tuple[dict[Any, Any], list[Any]]:
    db = MemoryDatabase()
    infos = []
    with db.open(QueueConfig.testing()) as queue:
        for seqno, (d, give_stats) in enumerate(batch, 1):
            block = BlockIdShort(SHARD, seqno)
            stats = None
            if give_stats and d.bounds is not None:
                stats = DiffStatistics.from_diff(d, SHARD, *d.bounds)
            assert queue.apply_diff(d, block, H[seqno], stats)
            infos.append(queue.get_diff_info(SHARD, seqno))
    return db.rows(), infos


@settings(max_examples=60)
@given(diffs())
def test_queue_writes_identical_rows_on_both_paths(batch: list[tuple[QueueDiff, bool]]) -> None:
    compiled = _apply_all(batch)
    with pure_write_path():
        pure = _apply_all(batch)
    assert compiled == pure


@settings(max_examples=25, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=40))
def test_rows_through_a_rocksdb_batch_are_intact(
    tmp_path_factory: Any, bodies: list[bytes]
) -> None:
    """A WriteBatch copies each row and lets go of it, so the C pass writes the next row
    into the same two objects (resized to each body): what RocksDB stores must still be
    every row exactly."""
    batch = [
        Message(QueueKey(10 + i, bytes((i,)) * 32), Address(0, b"\x50" * 32), POOL[i % 3], body)
        for i, body in enumerate(bodies)
    ]
    d = QueueDiff(batch)
    path = tmp_path_factory.mktemp("rows")
    with Queue.open(path / "q", QueueConfig.testing()) as queue:
        assert queue.apply_diff(d, BlockIdShort(SHARD, 1), H[1])
        stored = queue._store.load_table(Table.MESSAGES)
    assert stored == codec.message_rows(SHARD, d.messages)


# -- the Tee's chunks: sized ahead by the encoders, trimmed by the cache --------------------

_EMPTY = sys.getsizeof(bytearray())


def _allocated(buffer: bytearray) -> int:
    """What a bytearray has allocated (``sys.getsizeof`` counts its whole buffer)."""
    return sys.getsizeof(buffer) - _EMPTY


@settings(max_examples=60, deadline=None)
@given(
    st.lists(messages, min_size=1, max_size=60, unique_by=lambda m: m.key),
    routers(),
    st.booleans(),
)
def test_a_tee_keeps_what_an_encoder_puts_in_chunks_allocated_once(
    batch: list[Message], router: PartitionRouter, derived: bool
) -> None:
    """``encode_diff`` (statistics derived) and ``put_message_rows`` (given) tell a
    compiled Tee how many bytes of rows come, so every chunk it starts is allocated once
    at that size, however the rows split over partitions, and never grows (a growth
    copies the chunk); the cache's trim then leaves each holding its bytes alone. The
    chunks hold exactly the rows put, in order."""
    d = QueueDiff(batch, router=router)
    partition_for = None if d.router.is_empty else d.router.partition_for
    put: list[tuple[bytes, bytes]] = []
    kept: dict[bytes, list[bytearray]] = {}
    tee = cache_mod.Tee(lambda k, v, _t: put.append((k, v)), kept, codec.MESSAGE_PREFIX_LEN)
    encode = codec.encode_diff if derived else codec.put_message_rows
    encode(tee, None, SHARD, d.messages, partition_for)
    assert put == codec.message_rows(SHARD, d.messages, partition_for)
    whole = sum(len(k) + len(v) for k, v in put)
    by_segment = itertools.groupby(
        sorted(put, key=lambda r: r[0][: codec.MESSAGE_PREFIX_LEN]),
        key=lambda r: r[0][: codec.MESSAGE_PREFIX_LEN],
    )
    expected = {pre: list(rows) for pre, rows in by_segment}
    assert set(kept) == set(expected)
    for pre, (data, offs) in kept.items():
        assert _allocated(data) == whole + 1  # the whole batch, and its trailing NUL
        assert _allocated(offs) == 4 * len(put) + 1
        cache_mod._chunk_trim(data)
        cache_mod._chunk_trim(offs)
        assert (_allocated(data), _allocated(offs)) == (len(data) + 1, len(offs) + 1)
        rows = list(cache_mod.ChunkRows([data], [offs], 0, len(offs) // 4))
        assert rows == expected[pre]
    assert not tee.unordered and not tee.invalid
    # the next batch through the same Tee, row by row: the chunk grows (doubling) and
    # still holds every row
    more = [(k[:-1] + b"\xff", v) for k, v in put]
    for k, v in more:
        tee(k, v, None)
    p = codec.MESSAGE_PREFIX_LEN
    for pre, (data, offs) in kept.items():
        added = [r for r in more if r[0][:p] == pre]
        assert len(offs) == 4 * (len(expected[pre]) + len(added))
        assert _allocated(data) < 2 * (len(data) + 1)
        got = list(cache_mod.ChunkRows([data], [offs], 0, len(offs) // 4))
        assert got == expected[pre] + added


def test_a_tee_and_the_trim_leave_a_buffer_someone_reads_as_it_is() -> None:
    """A chunk buffer exported to a reader (a memoryview) is never moved: appending to it
    raises ``BufferError`` (as CPython does) and leaves the chunk as it was, and the trim
    leaves it alone; anything but a bytearray is not trimmed."""
    kept: dict[bytes, list[bytearray]] = {}
    tee = cache_mod.Tee(lambda *_: None, kept, codec.MESSAGE_PREFIX_LEN)
    rows = codec.message_rows(
        SHARD, [Message(QueueKey(lt, bytes(32)), *POOL[:2], b"x") for lt in (1, 2)]
    )
    tee(*rows[0], None)
    [(data, offs)] = kept.values()
    before = bytes(data), bytes(offs)
    with memoryview(data) as view:
        with pytest.raises(BufferError):
            tee(*rows[1], None)
        assert (bytes(view), bytes(offs)) == before
        cache_mod._chunk_trim(data)
        assert bytes(data) == before[0]
    cache_mod._chunk_trim(b"bytes")  # no-op
    cache_mod._chunk_trim(None)  # type: ignore[arg-type]
