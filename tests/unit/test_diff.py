"""QueueDiff and DiffStatistics: ordering, validation, counting, the coarse shard rule."""

from __future__ import annotations

import pickle

import pytest

from imq.diff import DiffStatistics, QueueDiff
from imq.router import PartitionRouter
from imq.types import U64_MAX, Address, Message, QueueKey, ShardIdent

H = bytes(32)
LEFT = ShardIdent(0, 0x4000_0000_0000_0000)


def addr(n: int, workchain: int = 0) -> Address:
    return Address(workchain, bytes((n,)) * 32)


A, B, C = addr(0x10), addr(0x90), addr(0x20)
MC_ADDR = addr(0x30, -1)
WC5_ADDR = addr(0x40, 5)


def key(lt: int, last: int = 0) -> QueueKey:
    return QueueKey(lt, bytes(31) + bytes((last,)))


def msg(lt: int, src: Address = A, dst: Address = B, last: int = 0, body: bytes = b"") -> Message:
    return Message(key(lt, last), src, dst, body)


# --- QueueDiff ------------------------------------------------------------------------


def test_messages_sorted_by_key() -> None:
    messages = [msg(5), msg(1, last=2), msg(3), msg(1, last=1), msg(2)]
    diff = QueueDiff(messages)
    assert isinstance(diff.messages, tuple)
    assert [m.key for m in diff.messages] == sorted(m.key for m in messages)
    assert diff.min_message == key(1, 1)
    assert diff.max_message == key(5)


def test_messages_accept_a_generator() -> None:
    diff = QueueDiff(msg(lt) for lt in (3, 1, 2))
    assert [m.key.lt for m in diff.messages] == [1, 2, 3]


def test_duplicate_key_raises() -> None:
    with pytest.raises(ValueError):
        QueueDiff([msg(1), msg(2), msg(1, dst=C)])
    with pytest.raises(ValueError):
        QueueDiff([msg(1), msg(1)])


def test_empty_diff() -> None:
    diff = QueueDiff()
    assert diff.messages == ()
    assert diff.min_message is None
    assert diff.max_message is None
    assert diff.processed_to == {}
    assert diff.prev_hash is None


def test_bounds_of_an_empty_diff_without_span_are_left_to_the_queue() -> None:
    diff = QueueDiff()
    assert diff.start_lt is diff.end_lt is diff.min_key is diff.max_key is None
    assert diff.bounds is None


def test_bounds_of_an_empty_diff_are_its_lt_span() -> None:
    diff = QueueDiff(start_lt=100, end_lt=150)
    assert diff.bounds == (QueueKey.min_for_lt(100), QueueKey.max_for_lt(150))
    assert diff.min_message is None
    assert "lt=100..150" in repr(diff)
    assert QueueDiff(start_lt=7, end_lt=7).bounds == (
        QueueKey.min_for_lt(7),
        QueueKey.max_for_lt(7),
    )


def test_bounds_of_a_non_empty_diff_are_its_message_keys_even_with_a_span() -> None:
    diff = QueueDiff([msg(120), msg(110)], start_lt=100, end_lt=150)
    assert diff.bounds == (key(110), key(120))


def test_explicit_keys_win() -> None:
    diff = QueueDiff([msg(120)], start_lt=100, end_lt=150, min_key=key(101), max_key=key(149))
    assert diff.bounds == (key(101), key(149))
    assert QueueDiff(min_key=key(3), max_key=key(3)).bounds == (key(3), key(3))
    assert "keys=" in repr(diff)


def test_span_and_keys_take_part_in_equality() -> None:
    assert QueueDiff(start_lt=1, end_lt=2) == QueueDiff(start_lt=1, end_lt=2)
    assert QueueDiff(start_lt=1, end_lt=2) != QueueDiff(start_lt=1, end_lt=3)
    assert QueueDiff(start_lt=1, end_lt=2) != QueueDiff()
    assert QueueDiff(min_key=key(1), max_key=key(2)) != QueueDiff()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"start_lt": 1}, ValueError),
        ({"end_lt": 1}, ValueError),
        ({"start_lt": 5, "end_lt": 4}, ValueError),
        ({"start_lt": -1, "end_lt": 4}, ValueError),
        ({"start_lt": 0, "end_lt": 1 << 64}, ValueError),
        ({"start_lt": 1.0, "end_lt": 4}, TypeError),
        ({"start_lt": True, "end_lt": 4}, TypeError),
        ({"min_key": key(1)}, ValueError),
        ({"max_key": key(1)}, ValueError),
        ({"min_key": key(2), "max_key": key(1)}, ValueError),
        ({"min_key": (1, H), "max_key": key(1)}, TypeError),
    ],
)
def test_bad_span_or_keys(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        QueueDiff(**kwargs)  # type: ignore[arg-type]


def test_messages_must_lie_inside_the_span_and_the_keys() -> None:
    with pytest.raises(ValueError, match="outside the block's lt span"):
        QueueDiff([msg(99), msg(120)], start_lt=100, end_lt=150)
    with pytest.raises(ValueError, match="outside the block's lt span"):
        QueueDiff([msg(151)], start_lt=100, end_lt=150)
    QueueDiff([msg(100), msg(150, last=0xFF)], start_lt=100, end_lt=150)
    with pytest.raises(ValueError, match=r"outside min_key\.\.max_key"):
        QueueDiff([msg(5)], min_key=key(6), max_key=key(9))
    with pytest.raises(ValueError, match=r"outside min_key\.\.max_key"):
        QueueDiff([msg(9, last=1)], min_key=key(6), max_key=key(9))


def test_single_message_min_equals_max() -> None:
    diff = QueueDiff([msg(4)])
    assert diff.min_message == diff.max_message == key(4)


def test_processed_to_and_prev_hash() -> None:
    processed = {ShardIdent.BASECHAIN: key(9), ShardIdent.MASTERCHAIN: key(3)}
    diff = QueueDiff([msg(1)], processed, prev_hash=b"\x07" * 32)
    assert diff.processed_to == processed
    assert list(diff.processed_to) == [ShardIdent.MASTERCHAIN, ShardIdent.BASECHAIN]
    assert diff.prev_hash == b"\x07" * 32
    processed[LEFT] = key(1)
    assert LEFT not in diff.processed_to


@pytest.mark.parametrize(
    "messages",
    [
        [(key(1), A, B, b"")],
        [msg(1), "message"],
        [None],
    ],
)
def test_messages_must_be_messages(messages: list[object]) -> None:
    with pytest.raises(TypeError):
        QueueDiff(messages)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "processed_to",
    [
        {(0, 0x8000_0000_0000_0000): key(1)},
        {ShardIdent.BASECHAIN: (1, H)},
        {ShardIdent.BASECHAIN: None},
    ],
)
def test_processed_to_types(processed_to: dict[object, object]) -> None:
    with pytest.raises(TypeError):
        QueueDiff([msg(1)], processed_to)  # type: ignore[arg-type]


def test_router_type() -> None:
    with pytest.raises(TypeError):
        QueueDiff([msg(1)], router={1: [A]})  # type: ignore[arg-type]


@pytest.mark.parametrize("prev_hash", [bytes(31), bytes(33), b""])
def test_prev_hash_length(prev_hash: bytes) -> None:
    with pytest.raises(ValueError):
        QueueDiff(prev_hash=prev_hash)


@pytest.mark.parametrize("prev_hash", ["00" * 32, bytearray(32), 0])
def test_prev_hash_type(prev_hash: object) -> None:
    # API.md: "values of the wrong type [raise] TypeError".
    with pytest.raises(TypeError):
        QueueDiff(prev_hash=prev_hash)  # type: ignore[arg-type]


def test_equality() -> None:
    router = PartitionRouter(dst={1: [B]})
    processed = {ShardIdent.BASECHAIN: key(1)}
    a = QueueDiff([msg(2), msg(1)], processed, router, b"\x01" * 32)
    b = QueueDiff([msg(1), msg(2)], dict(processed), router.copy(), b"\x01" * 32)
    assert a == b
    assert a != QueueDiff([msg(1), msg(2)], processed, router)
    assert a != QueueDiff([msg(1), msg(2)], processed, None, b"\x01" * 32)
    assert a != QueueDiff([msg(1)], processed, router, b"\x01" * 32)
    assert a != QueueDiff([msg(1), msg(2, body=b"x")], processed, router, b"\x01" * 32)
    assert a != QueueDiff([msg(1), msg(2)], {}, router, b"\x01" * 32)
    assert a != "diff"
    # API.md: value types are hashable. Equal diffs hash equal.
    assert hash(a) == hash(b)
    assert len({a, b, QueueDiff([msg(1)], processed, router)}) == 2


def test_a_diffs_router_is_read_only_and_copies_to_a_mutable_one() -> None:
    """The diff keeps its own copy of the router, and the copy it hands out cannot be
    changed (statistics computed from the diff must stay true of it); ``copy()`` of it
    is an ordinary router."""
    router = PartitionRouter(dst={1: [B]})
    diff = QueueDiff([msg(1)], {}, router)
    router.insert_dst(C, 2)  # the caller's router: the diff's copy does not follow
    assert diff.router == PartitionRouter(dst={1: [B]})
    for insert in (diff.router.insert_src, diff.router.insert_dst, QueueDiff().router.insert_dst):
        with pytest.raises(TypeError, match=r"read-only .* router\.copy\(\)"):
            insert(C, 3)
    assert diff.router == PartitionRouter(dst={1: [B]})
    mutable = diff.router.copy()
    mutable.insert_src(C, 3)
    assert type(mutable) is PartitionRouter
    assert QueueDiff([msg(1)], {}, mutable).router.partition_for(C, A) == 3
    assert pickle.loads(pickle.dumps(diff)) == diff


def test_diff_is_frozen() -> None:
    diff = QueueDiff()
    with pytest.raises(AttributeError):
        diff.messages = ()  # type: ignore[misc]


# --- DiffStatistics -------------------------------------------------------------------


def test_statistics_constructor() -> None:
    stats = DiffStatistics(ShardIdent.BASECHAIN, key(1), key(5), {1: {B: 2}, 0: {A: 1, MC_ADDR: 3}})
    assert stats.shard == ShardIdent.BASECHAIN
    assert stats.min_message == key(1)
    assert stats.max_message == key(5)
    assert stats.partitions == {0: {A: 1, MC_ADDR: 3}, 1: {B: 2}}
    assert list(stats.partitions) == [0, 1]
    assert stats.total == 6
    assert stats.shards_messages_count == {ShardIdent.MASTERCHAIN: 3, ShardIdent.BASECHAIN: 3}


def test_statistics_min_equal_max_allowed_and_empty_partitions_dropped() -> None:
    stats = DiffStatistics(LEFT, key(3), key(3), {0: {}, 4: {}})
    assert stats.partitions == {}
    assert stats.total == 0
    assert stats.shards_messages_count == {}


def test_statistics_copies_its_input() -> None:
    counts = {A: 1}
    partitions = {0: counts}
    stats = DiffStatistics(LEFT, key(1), key(2), partitions)
    counts[B] = 5
    partitions[1] = {C: 1}
    assert stats.partitions == {0: {A: 1}}


def test_statistics_max_below_min() -> None:
    with pytest.raises(ValueError):
        DiffStatistics(LEFT, key(2), key(1), {})
    with pytest.raises(ValueError):
        DiffStatistics(LEFT, key(2, 1), key(2, 0), {})


@pytest.mark.parametrize("count", [0, -1])
def test_statistics_non_positive_count(count: int) -> None:
    with pytest.raises(ValueError):
        DiffStatistics(LEFT, key(1), key(2), {0: {A: count}})


def test_statistics_counts_fit_the_u64_a_diff_record_keeps() -> None:
    """A count, and a workchain's sum of them (a diff's record keeps it per destination
    shard), is a u64: past it the constructor refuses, instead of apply_diff failing
    with an OverflowError."""
    assert DiffStatistics(LEFT, key(1), key(2), {0: {A: U64_MAX}}).total == U64_MAX
    with pytest.raises(ValueError, match="u64"):
        DiffStatistics(LEFT, key(1), key(2), {0: {A: U64_MAX + 1}})
    with pytest.raises(ValueError, match="u64"):
        DiffStatistics(LEFT, key(1), key(2), {0: {A: U64_MAX, B: 1}})
    with pytest.raises(ValueError, match="u64"):
        DiffStatistics(LEFT, key(1), key(2), {0: {A: U64_MAX}, 1: {B: 1}})


@pytest.mark.parametrize("count", [True, 1.0, "1", None])
def test_statistics_count_wrong_type(count: object) -> None:
    # API.md: "values of the wrong type [raise] TypeError".
    with pytest.raises(TypeError):
        DiffStatistics(LEFT, key(1), key(2), {0: {A: count}})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (((0, 0x8000_0000_0000_0000), key(1), key(2), {}), TypeError),
        ((LEFT, (1, H), key(2), {}), TypeError),
        ((LEFT, key(1), None, {}), TypeError),
        ((LEFT, key(1), key(2), {0: {(0, bytes(32)): 1}}), TypeError),
        ((LEFT, key(1), key(2), {"0": {A: 1}}), TypeError),
        ((LEFT, key(1), key(2), {True: {A: 1}}), TypeError),
        ((LEFT, key(1), key(2), {-1: {A: 1}}), ValueError),
        ((LEFT, key(1), key(2), {65536: {A: 1}}), ValueError),
    ],
)
def test_statistics_validation(args: tuple[object, ...], error: type[Exception]) -> None:
    with pytest.raises(error):
        DiffStatistics(*args)  # type: ignore[arg-type]


def test_statistics_equality() -> None:
    a = DiffStatistics(LEFT, key(1), key(2), {0: {A: 1}})
    assert a == DiffStatistics(LEFT, key(1), key(2), {0: {A: 1}, 3: {}})
    assert a != DiffStatistics(ShardIdent.BASECHAIN, key(1), key(2), {0: {A: 1}})
    assert a != DiffStatistics(LEFT, key(0), key(2), {0: {A: 1}})
    assert a != DiffStatistics(LEFT, key(1), key(3), {0: {A: 1}})
    assert a != DiffStatistics(LEFT, key(1), key(2), {0: {A: 2}})
    assert a != DiffStatistics(LEFT, key(1), key(2), {1: {A: 1}})
    assert a != 1
    assert hash(a) == hash(DiffStatistics(LEFT, key(1), key(2), {0: {A: 1}, 3: {}}))
    assert len({a, DiffStatistics(LEFT, key(1), key(2), {0: {A: 1}})}) == 1


def test_from_diff_without_router() -> None:
    diff = QueueDiff(
        [
            msg(1, A, B),
            msg(2, C, B),
            msg(3, A, MC_ADDR),
            msg(4, B, A),
            msg(5, A, WC5_ADDR),
            msg(6, A, B),
        ]
    )
    stats = DiffStatistics.from_diff(diff, LEFT, key(1), key(6))
    assert stats.shard == LEFT
    assert (stats.min_message, stats.max_message) == (key(1), key(6))
    assert stats.partitions == {0: {B: 3, MC_ADDR: 1, A: 1, WC5_ADDR: 1}}
    assert stats.total == 6
    # coarse rule: the destination workchain's full shard, never the split shard
    assert stats.shards_messages_count == {
        ShardIdent.MASTERCHAIN: 1,
        ShardIdent.BASECHAIN: 4,
        ShardIdent.full(5): 1,
    }
    assert list(stats.shards_messages_count) == sorted(stats.shards_messages_count)
    assert stats == DiffStatistics(LEFT, key(1), key(6), stats.partitions)


def test_from_diff_with_router() -> None:
    router = PartitionRouter(src={2: [C]}, dst={1: [B], 3: [MC_ADDR]})
    diff = QueueDiff(
        [
            msg(1, A, B),  # dst routed -> 1
            msg(2, C, B),  # dst wins over src -> 1
            msg(3, C, A),  # src routed -> 2
            msg(4, A, A),  # neither -> 0
            msg(5, C, MC_ADDR),  # dst -> 3
            msg(6, A, C),  # C is only a routed *source* -> 0
        ],
        router=router,
    )
    stats = DiffStatistics.from_diff(diff, ShardIdent.BASECHAIN, key(1), key(6))
    assert stats.partitions == {0: {A: 1, C: 1}, 1: {B: 2}, 2: {A: 1}, 3: {MC_ADDR: 1}}
    assert list(stats.partitions) == [0, 1, 2, 3]
    assert stats.shards_messages_count == {ShardIdent.MASTERCHAIN: 1, ShardIdent.BASECHAIN: 5}
    assert stats.total == 6


def test_from_diff_router_that_matches_nothing_equals_no_router() -> None:
    messages = [msg(1, A, B), msg(2, B, A), msg(3, A, B)]
    plain = DiffStatistics.from_diff(QueueDiff(messages), LEFT, key(1), key(3))
    routed = DiffStatistics.from_diff(
        QueueDiff(messages, router=PartitionRouter(src={1: [C]}, dst={2: [C]})),
        LEFT,
        key(1),
        key(3),
    )
    assert plain == routed
    assert plain.partitions == {0: {B: 2, A: 1}}


def test_from_diff_empty_diff_uses_the_given_bounds() -> None:
    stats = DiffStatistics.from_diff(
        QueueDiff(), LEFT, QueueKey.min_for_lt(10), QueueKey.max_for_lt(20)
    )
    assert stats.partitions == {}
    assert stats.shards_messages_count == {}
    assert stats.min_message == QueueKey.min_for_lt(10)
    assert stats.max_message == QueueKey.max_for_lt(20)


def test_from_diff_does_not_recompute_bounds() -> None:
    diff = QueueDiff([msg(5), msg(7)])
    stats = DiffStatistics.from_diff(diff, LEFT, QueueKey.MIN, QueueKey.MAX)
    assert (stats.min_message, stats.max_message) == (QueueKey.MIN, QueueKey.MAX)


def test_from_diff_validates_bounds() -> None:
    diff = QueueDiff([msg(1)])
    with pytest.raises(ValueError):
        DiffStatistics.from_diff(diff, LEFT, key(2), key(1))
    with pytest.raises(TypeError):
        DiffStatistics.from_diff(diff, (0, 1 << 63), key(1), key(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        DiffStatistics.from_diff(diff, LEFT, None, key(1))  # type: ignore[arg-type]


# --- dict arguments: a mapping or a TypeError naming the argument -----------------------


@pytest.mark.parametrize("value", [[5], "ab", 7])
def test_processed_to_and_router_halves_must_be_mappings(value: object) -> None:
    with pytest.raises(TypeError, match=r"QueueDiff\.processed_to must be a mapping"):
        QueueDiff([], value)  # type: ignore[arg-type]
    for half in ("src", "dst"):
        with pytest.raises(TypeError, match=f"PartitionRouter {half} must be a mapping"):
            PartitionRouter(**{half: value})  # type: ignore[arg-type]


def test_statistics_must_be_mappings_of_mappings() -> None:
    low, high = QueueKey.MIN, QueueKey.MAX
    with pytest.raises(TypeError, match=r"DiffStatistics\.partitions must be a mapping"):
        DiffStatistics(LEFT, low, high, [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="statistics of partition 1 must be a mapping"):
        DiffStatistics(LEFT, low, high, {1: [A]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="from_diff takes a QueueDiff"):
        DiffStatistics.from_diff(None, LEFT, low, high)  # type: ignore[arg-type]


def test_a_diffs_hash_ignores_its_handed_out_processed_to() -> None:
    diff = QueueDiff([msg(10)], {LEFT: key(1)})
    held = {diff}
    diff.processed_to[ShardIdent.MASTERCHAIN] = QueueKey.MAX
    assert diff in held
