"""D1: byte order equals logical order, for every key kind, and range bounds select
exactly the logically selected keys.

RocksDB's default comparator orders keys as Python orders ``bytes``, so comparing the
encoded keys here is what the database does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from hypothesis import assume, given
from hypothesis import strategies as st

from imq.storage import codec
from imq.types import Address, QueueKey, ShardIdent

T = TypeVar("T")

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1

# Values near the edges collide and carry more often than uniform ones.
_lts = st.one_of(
    st.integers(0, 4),
    st.integers(U64_MAX - 4, U64_MAX),
    st.sampled_from([2**7, 2**8, 2**31, 2**32, 2**63 - 1, 2**63]),
    st.integers(0, U64_MAX),
)
_hashes = st.one_of(
    st.sampled_from([bytes(32), b"\xff" * 32, bytes(31) + b"\x01", b"\x80" + bytes(31)]),
    st.binary(min_size=1, max_size=3).map(lambda b: b + bytes(32 - len(b))),
    st.binary(min_size=1, max_size=3).map(lambda b: bytes(32 - len(b)) + b),
    st.binary(min_size=32, max_size=32),
)
queue_keys = st.builds(QueueKey, _lts, _hashes)

_accounts = st.one_of(
    st.sampled_from([bytes(32), b"\xff" * 32, b"\x7f" + b"\xff" * 31, b"\x80" + bytes(31)]),
    st.binary(min_size=32, max_size=32),
)
addresses = st.builds(
    Address,
    st.one_of(st.sampled_from([-128, -1, 0, 1, 127]), st.integers(-128, 127)),
    _accounts,
)


@st.composite
def _prefixes(draw: st.DrawFn) -> int:
    depth = draw(st.integers(0, 60))
    bits = draw(st.integers(0, 2**depth - 1))
    return (bits << (64 - depth)) | (1 << (63 - depth)) if depth else 1 << 63


@st.composite
def _shards(draw: st.DrawFn) -> ShardIdent:
    workchain = draw(
        st.one_of(
            st.sampled_from([-(2**31), -2, -1, 0, 1, 2**31 - 1]),
            st.integers(-(2**31), 2**31 - 1),
        )
    )
    if workchain == -1:
        return ShardIdent.MASTERCHAIN
    return ShardIdent(workchain, draw(_prefixes()))


shards = _shards()
partitions = st.one_of(st.sampled_from([0, 1, 255, 256, 65535]), st.integers(0, 65535))
seqnos = st.one_of(st.sampled_from([0, 1, 255, 256, U32_MAX]), st.integers(0, U32_MAX))


# Range ends: the edges MIN and MAX matter most (an inclusive end at MAX has no next key).
range_keys = st.one_of(st.just(QueueKey.MIN), st.just(QueueKey.MAX), queue_keys)


def _lists(strategy: st.SearchStrategy[T]) -> st.SearchStrategy[list[T]]:
    return st.lists(strategy, min_size=2, max_size=30)


@st.composite
def _tied(
    draw: st.DrawFn, heads: st.SearchStrategy[tuple[Any, ...]], tails: st.SearchStrategy[Any]
) -> list[tuple[Any, ...]]:
    """Tuples that share their leading fields often, so the later fields decide the order."""
    pool = draw(st.lists(heads, min_size=1, max_size=3))
    pairs = draw(st.lists(st.tuples(st.sampled_from(pool), tails), min_size=2, max_size=30))
    return [(*head, tail) for head, tail in pairs]


def assert_order_preserved(values: Sequence[T], encode: Callable[[T], bytes]) -> None:
    """Sorting encoded bytes == encoding logically sorted values, and the encoding is
    injective (equal bytes only for equal values)."""
    encoded = [encode(v) for v in values]
    assert sorted(encoded) == [encode(v) for v in sorted(values)]  # type: ignore[type-var]
    assert len(set(encoded)) == len(set(values))
    lengths = {len(e) for e in encoded}
    assert len(lengths) == 1  # fixed width: no key is a prefix of another


# --- order of every key kind ----------------------------------------------------------


@given(_lists(queue_keys), partitions, shards)
def test_queue_key_order_within_partition_and_shard(
    keys: list[QueueKey], partition: int, shard: ShardIdent
) -> None:
    assert_order_preserved(keys, lambda key: codec.message_key(partition, shard, key))
    assert_order_preserved(keys, codec.key_bytes)


@given(queue_keys)
def test_queue_key_round_trip_and_next_value(key: QueueKey) -> None:
    raw = codec.key_bytes(key)
    assert codec.decode_key(raw) == key
    nxt = key.next_value()
    if key == QueueKey.MAX:
        assert nxt == key
    else:
        assert key < nxt
        # nothing lies strictly between: the next byte string of the same width
        assert int.from_bytes(codec.key_bytes(nxt), "big") == int.from_bytes(raw, "big") + 1


@given(_lists(shards))
def test_shard_order(values: list[ShardIdent]) -> None:
    # logical order: (workchain as signed i32, prefix as unsigned u64)
    assert sorted(values) == sorted(values, key=lambda s: (s.workchain, s.prefix))
    assert_order_preserved(values, codec.shard_bytes)


@given(shards)
def test_shard_round_trip(shard: ShardIdent) -> None:
    assert codec.decode_shard(codec.shard_bytes(shard)) == shard


@given(_lists(addresses))
def test_address_order(values: list[Address]) -> None:
    assert sorted(values) == sorted(values, key=lambda a: (a.workchain, a.account))
    assert_order_preserved(values, codec.address_bytes)


@given(addresses)
def test_address_round_trip(address: Address) -> None:
    assert codec.decode_address(codec.address_bytes(address)) == address


@given(
    st.one_of(
        _lists(st.tuples(partitions, shards, queue_keys)),
        _tied(st.tuples(partitions, shards), queue_keys),
        _tied(st.tuples(partitions), st.tuples(shards, queue_keys)).map(
            lambda values: [(p, *rest) for p, rest in values]
        ),
    )
)
def test_message_key_order_across_partitions_and_shards(
    values: list[tuple[int, ShardIdent, QueueKey]],
) -> None:
    assert_order_preserved(values, lambda v: codec.message_key(*v))


@given(
    shards,
    st.one_of(
        _lists(st.tuples(partitions, queue_keys, seqnos)),
        _tied(st.tuples(partitions, queue_keys), seqnos),
        _tied(st.tuples(partitions), st.tuples(queue_keys, seqnos)).map(
            lambda values: [(p, *rest) for p, rest in values]
        ),
    ),
)
def test_stat_key_order_within_shard(
    shard: ShardIdent, values: list[tuple[int, QueueKey, int]]
) -> None:
    assert_order_preserved(values, lambda v: codec.stat_key(shard, *v))


@given(
    shards,
    st.one_of(_lists(st.tuples(queue_keys, seqnos)), _tied(st.tuples(queue_keys), seqnos)),
)
def test_tail_key_order_within_shard(shard: ShardIdent, values: list[tuple[QueueKey, int]]) -> None:
    assert_order_preserved(values, lambda v: codec.tail_key(shard, *v))


@given(shards, _lists(seqnos))
def test_diff_info_key_order_within_shard(shard: ShardIdent, values: list[int]) -> None:
    assert_order_preserved(values, lambda seqno: codec.diff_info_key(shard, seqno))


@given(_lists(st.tuples(shards, seqnos)))
def test_diff_info_key_order_across_shards(values: list[tuple[ShardIdent, int]]) -> None:
    assert_order_preserved(values, lambda v: codec.diff_info_key(*v))


# --- range bounds select exactly the logical range ------------------------------------


def _inside(raw: bytes, bounds: tuple[bytes, bytes]) -> bool:
    lo, hi = bounds
    return lo <= raw < hi


_other_partition = st.sampled_from([0, 1, 65535])
_places = st.tuples(partitions, shards)  # (partition, shard)
_ends = st.tuples(range_keys, range_keys)


@given(_places, _ends, _lists(st.tuples(_other_partition, shards, queue_keys)), _lists(queue_keys))
def test_message_range_selects_half_open(
    place: tuple[int, ShardIdent],
    ends: tuple[QueueKey, QueueKey],
    others: list[tuple[int, ShardIdent, QueueKey]],
    keys: list[QueueKey],
) -> None:
    (partition, shard), (from_key, to_key) = place, ends
    bounds = codec.message_range(partition, shard, from_key, to_key)
    for key in [*keys, from_key, to_key, QueueKey.MIN, QueueKey.MAX]:
        raw = codec.message_key(partition, shard, key)
        assert _inside(raw, bounds) == (from_key <= key < to_key)
    for other_partition, other_shard, key in others:
        if (other_partition, other_shard) != place:
            assert not _inside(codec.message_key(other_partition, other_shard, key), bounds)


@given(_places, _ends, _lists(st.tuples(_other_partition, shards, queue_keys)), _lists(queue_keys))
def test_message_delete_range_selects_inclusive(
    place: tuple[int, ShardIdent],
    ends: tuple[QueueKey, QueueKey],
    others: list[tuple[int, ShardIdent, QueueKey]],
    keys: list[QueueKey],
) -> None:
    (partition, shard), (first, last) = place, ends
    bounds = codec.message_delete_range(partition, shard, first, last)
    for key in [*keys, first, last, last.next_value(), QueueKey.MIN, QueueKey.MAX]:
        raw = codec.message_key(partition, shard, key)
        assert _inside(raw, bounds) == (first <= key <= last)
    for other_partition, other_shard, key in others:
        if (other_partition, other_shard) != place:
            assert not _inside(codec.message_key(other_partition, other_shard, key), bounds)


_stat_rows = _lists(st.tuples(queue_keys, seqnos))


@given(_places, _ends, _stat_rows, _places)
def test_stat_range_selects_half_open(
    place: tuple[int, ShardIdent],
    ends: tuple[QueueKey, QueueKey],
    rows: list[tuple[QueueKey, int]],
    other: tuple[int, ShardIdent],
) -> None:
    (partition, shard), (from_key, to_key) = place, ends
    bounds = codec.stat_range(shard, partition, from_key, to_key)
    for max_message, seqno in [*rows, (QueueKey.MAX, U32_MAX)]:
        raw = codec.stat_key(shard, partition, max_message, seqno)
        assert _inside(raw, bounds) == (from_key <= max_message < to_key)
        if other != place:
            raw = codec.stat_key(other[1], other[0], max_message, seqno)
            assert not _inside(raw, bounds)


@given(_places, _ends, _stat_rows, _places)
def test_stat_delete_range_selects_inclusive(
    place: tuple[int, ShardIdent],
    ends: tuple[QueueKey, QueueKey],
    rows: list[tuple[QueueKey, int]],
    other: tuple[int, ShardIdent],
) -> None:
    (partition, shard), (first, last) = place, ends
    bounds = codec.stat_delete_range(shard, partition, first, last)
    extra = [(first, 0), (last, U32_MAX), (QueueKey.MAX, U32_MAX)]
    for max_message, seqno in [*rows, *extra]:
        raw = codec.stat_key(shard, partition, max_message, seqno)
        assert _inside(raw, bounds) == (first <= max_message <= last)
        if other != place:
            raw = codec.stat_key(other[1], other[0], max_message, seqno)
            assert not _inside(raw, bounds)


_tail_rows = _lists(st.tuples(queue_keys, seqnos))


@given(shards, range_keys, _tail_rows, shards)
def test_tail_range_selects_from_key_up(
    shard: ShardIdent, from_key: QueueKey, rows: list[tuple[QueueKey, int]], other: ShardIdent
) -> None:
    bounds = codec.tail_range(shard, from_key)
    for max_message, seqno in [*rows, (QueueKey.MAX, U32_MAX), (from_key, 0)]:
        assert _inside(codec.tail_key(shard, max_message, seqno), bounds) == (
            max_message >= from_key
        )
        if other != shard:
            assert not _inside(codec.tail_key(other, max_message, seqno), bounds)


@given(shards, range_keys, range_keys, _tail_rows, shards)
def test_tail_range_inclusive_selects(
    shard: ShardIdent,
    first: QueueKey,
    last: QueueKey,
    rows: list[tuple[QueueKey, int]],
    other: ShardIdent,
) -> None:
    bounds = codec.tail_range_inclusive(shard, first, last)
    extra = [(first, 0), (last, U32_MAX), (QueueKey.MAX, U32_MAX), (last.next_value(), 0)]
    for max_message, seqno in [*rows, *extra]:
        assert _inside(codec.tail_key(shard, max_message, seqno), bounds) == (
            first <= max_message <= last
        )
        if other != shard:
            assert not _inside(codec.tail_key(other, max_message, seqno), bounds)


@given(shards, _lists(st.tuples(shards, seqnos)))
def test_diff_info_shard_range_selects_one_shard(
    shard: ShardIdent, rows: list[tuple[ShardIdent, int]]
) -> None:
    bounds = codec.diff_info_shard_range(shard)
    for row_shard, seqno in [*rows, (shard, 0), (shard, U32_MAX)]:
        assert _inside(codec.diff_info_key(row_shard, seqno), bounds) == (row_shard == shard)


@given(st.binary(min_size=1, max_size=20), st.binary(max_size=20), st.binary(max_size=20))
def test_prefix_end_bounds_every_extension(prefix: bytes, suffix: bytes, other: bytes) -> None:
    assume(prefix.rstrip(b"\xff") != b"")
    end = codec.prefix_end(prefix)
    assert prefix + suffix < end
    # every string at or above the prefix either extends it or is not below the end
    if other >= prefix and not other.startswith(prefix):
        assert other >= end
