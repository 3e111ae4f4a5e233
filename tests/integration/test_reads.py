"""Read calls on a real RocksDB (SEMANTICS §5.7-§5.12, §6; API.md)."""

from __future__ import annotations

import pytest
from builders import (
    BASE,
    MC,
    Chain,
    address_in,
    block,
    diff_hash,
    key,
    make_diff,
    message,
    split_shard,
    stats,
)

from imq import (
    Address,
    BlockIdShort,
    CommitPointer,
    DiffInfo,
    DiffZone,
    PartitionRouter,
    Queue,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    StorageError,
)

S = split_shard(0, 1, 0)  # 0:4000000000000000
OTHER = split_shard(0, 1, 1)  # 0:c000000000000000


# -- get_diff_info / is_diff_exists -----------------------------------------------------------


def test_get_diff_info_returns_every_stored_field(queue: Queue, chain: Chain) -> None:
    low = address_in(OTHER, 1)
    router = PartitionRouter(src={3: [address_in(S, 0)]}, dst={1: [low]})
    prev = diff_hash("previous")
    msgs = [
        message(key(10), address_in(S, 0), low),
        message(key(11), address_in(S, 1), address_in(MC)),
        message(key(12), address_in(S, 2), address_in(BASE, 3)),
    ]
    diff = QueueDiff(msgs, {S: key(5), MC: key(6)}, router, prev)
    assert queue.apply_diff(diff, block(S, 4), diff_hash(4))
    assert queue.get_diff_info(S, 4) == DiffInfo(
        min_message=key(10),
        max_message=key(12),
        shards_messages_count={MC: 1, BASE: 2},
        hash=diff_hash(4),
        processed_to={S: key(5), MC: key(6)},
        router_src={3: frozenset([address_in(S, 0)])},
        router_dst={1: frozenset([low])},
        seqno=4,
        prev_hash=prev,
    )


def test_get_diff_info_by_zone(queue: Queue, chain: Chain) -> None:
    d1, d2 = chain.apply(S, 2), chain.apply(S, 2)
    info1, info2 = queue.get_diff_info(S, 1), queue.get_diff_info(S, 2)
    assert info1 is not None and info2 is not None
    # No pointer: everything is uncommitted.
    assert queue.get_diff_info(S, 1, DiffZone.COMMITTED) is None
    assert queue.get_diff_info(S, 1, DiffZone.UNCOMMITTED) == info1
    mc = chain.apply(MC, 1)
    assert queue.commit_diff([mc.top(), d1.top(1)])
    assert queue.get_diff_info(S, 1, DiffZone.COMMITTED) == info1
    assert queue.get_diff_info(S, 1, DiffZone.UNCOMMITTED) is None
    assert queue.get_diff_info(S, 2, DiffZone.COMMITTED) is None
    assert queue.get_diff_info(S, 2, DiffZone.UNCOMMITTED) == info2
    # Unknown seqnos and shards: None in every zone.
    for zone in DiffZone:
        assert queue.get_diff_info(S, 3, zone) is None
        assert queue.get_diff_info(OTHER, 1, zone) is None
    assert d2.seqno == 2


def test_get_diff_info_argument_checks(queue: Queue) -> None:
    with pytest.raises(TypeError):
        queue.get_diff_info("0:4000000000000000", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        queue.get_diff_info(S, "1")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        queue.get_diff_info(S, -1)
    with pytest.raises(ValueError):
        queue.get_diff_info(S, 1 << 32)
    with pytest.raises(TypeError):
        queue.get_diff_info(S, 1, "both")  # type: ignore[arg-type]


def test_is_diff_exists(queue: Queue, chain: Chain) -> None:
    a = chain.apply(S, 1)
    assert queue.is_diff_exists(a.block) is True
    assert queue.is_diff_exists(block(S, 2)) is False
    assert queue.is_diff_exists(block(OTHER, 1)) is False
    assert queue.is_diff_exists(block(MC, 1)) is False
    mc = chain.apply(MC, 0)
    assert queue.commit_diff([mc.top(), a.top(1)])
    assert queue.is_diff_exists(a.block) is True  # both zones
    with pytest.raises(TypeError):
        queue.is_diff_exists((S, 1))  # type: ignore[arg-type]


# -- get_diffs_tail_len -----------------------------------------------------------------------


def test_get_diffs_tail_len(queue: Queue, chain: Chain) -> None:
    d = [chain.apply(S, 2) for _ in range(3)]
    chain.apply(OTHER, 2)
    k = [a.max_message for a in d]
    assert queue.get_diffs_tail_len(S, QueueKey.MIN) == 3
    assert queue.get_diffs_tail_len(S, k[0]) == 3  # >= from_key
    assert queue.get_diffs_tail_len(S, k[0].next_value()) == 2
    assert queue.get_diffs_tail_len(S, k[1]) == 2
    assert queue.get_diffs_tail_len(S, k[2]) == 1
    assert queue.get_diffs_tail_len(S, k[2].next_value()) == 0
    assert queue.get_diffs_tail_len(S, QueueKey.MAX) == 0
    assert queue.get_diffs_tail_len(ShardIdent.full(5), QueueKey.MIN) == 0
    # Both zones count.
    mc = chain.apply(MC, 0)
    assert queue.commit_diff([mc.top(), d[1].top(1)])
    assert queue.get_diffs_tail_len(S, QueueKey.MIN) == 3


def test_get_diffs_tail_len_includes_max(queue: Queue, chain: Chain) -> None:
    """Decision: a diff whose max_message is QueueKey.MAX is counted (API.md wording)."""
    a = chain.build(S, 1)
    st = stats(S, a.messages[0].key, QueueKey.MAX, {0: {a.messages[0].dst: 1}})
    assert queue.apply_diff(a.diff, a.block, a.hash, st)
    assert queue.get_diffs_tail_len(S, QueueKey.MAX) == 1
    assert queue.get_diffs_tail_len(S, QueueKey.MIN) == 1


def test_get_diffs_tail_len_argument_checks(queue: Queue) -> None:
    with pytest.raises(TypeError):
        queue.get_diffs_tail_len(S, (0, bytes(32)))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        queue.get_diffs_tail_len(None, QueueKey.MIN)  # type: ignore[arg-type]


# -- statistics -------------------------------------------------------------------------------


Counts = dict[Address, int]


def _three_diffs(queue: Queue, chain: Chain) -> list[tuple[QueueKey, dict[int, Counts]]]:
    """Three diffs of S with explicit statistics; returns (max_message, partitions)."""
    x, y, z = address_in(OTHER, 1), address_in(OTHER, 2), address_in(MC, 3)
    specs: list[dict[int, Counts]] = [
        {0: {x: 3, y: 1}, 1: {z: 2}},
        {0: {x: 5}},
        {0: {y: 7, z: 1}, 1: {z: 4}},
    ]
    out = []
    for partitions in specs:
        a = chain.build(S, 2)
        st = stats(S, a.messages[0].key, a.messages[-1].key, partitions)
        assert queue.apply_diff(a.diff, a.block, a.hash, st)
        out.append((a.max_message, partitions))
    other = chain.build(OTHER, 2)
    assert queue.apply_diff(other.diff, other.block, other.hash)
    return out


def _sum(parts: list[dict[int, Counts]], partition: int) -> Counts:
    total: Counts = {}
    for p in parts:
        for addr, n in p.get(partition, {}).items():
            total[addr] = total.get(addr, 0) + n
    return total


def test_load_diff_statistics(queue: Queue, chain: Chain) -> None:
    diffs = _three_diffs(queue, chain)
    (k1, p1), (k2, p2), (k3, p3) = diffs

    def load(partition: int, lo: QueueKey, hi: QueueKey) -> Counts:
        return queue.load_diff_statistics(partition, QueueShardRange(S, lo, hi))

    assert load(0, QueueKey.MIN, QueueKey.MAX) == _sum([p1, p2, p3], 0)
    assert load(1, QueueKey.MIN, QueueKey.MAX) == _sum([p1, p2, p3], 1)
    # [from, to) on max_message
    assert load(0, k1, k3) == _sum([p1, p2], 0)
    assert load(0, k1.next_value(), k3) == _sum([p2], 0)
    assert load(0, k1, k3.next_value()) == _sum([p1, p2, p3], 0)
    assert load(0, k2, k2) == {}
    assert load(0, k3, k1) == {}
    assert load(7, QueueKey.MIN, QueueKey.MAX) == {}
    assert queue.load_diff_statistics(0, QueueShardRange(OTHER, k1, k1)) == {}


def test_load_diff_statistics_counts_whole_diffs(queue: Queue, chain: Chain) -> None:
    a = chain.apply(S, [address_in(OTHER, i) for i in range(4)])
    first, last = a.messages[0].key, a.messages[-1].key
    # A range covering all but the last message misses the whole diff ...
    assert queue.load_diff_statistics(0, QueueShardRange(S, first, last)) == {}
    # ... and a range covering only the last one counts all of it.
    assert queue.load_diff_statistics(0, QueueShardRange(S, last, last.next_value())) == {
        address_in(OTHER, i): 1 for i in range(4)
    }


def test_load_separated_diff_statistics(queue: Queue, chain: Chain) -> None:
    (k1, p1), (k2, p2), (k3, p3) = _three_diffs(queue, chain)
    whole = QueueShardRange(S, QueueKey.MIN, QueueKey.MAX)
    assert queue.load_separated_diff_statistics([0, 1, 9], whole) == {
        0: {k1: p1[0], k2: p2[0], k3: p3[0]},
        1: {k1: p1[1], k3: p3[1]},
        9: {},
    }
    assert queue.load_separated_diff_statistics([1], QueueShardRange(S, k2, k3)) == {1: {}}
    assert queue.load_separated_diff_statistics([], whole) == {}
    empty = QueueShardRange(ShardIdent.full(3), QueueKey.MIN, QueueKey.MAX)
    assert queue.load_separated_diff_statistics((0, 1), empty) == {0: {}, 1: {}}


def test_separated_statistics_sum_diffs_sharing_a_max_message(queue: Queue, chain: Chain) -> None:
    """D3: two diffs with one max_message keep separate rows; the load sums them."""
    x, y = address_in(OTHER, 1), address_in(OTHER, 2)
    shared = key(5_000)
    for seqno, counts in ((1, {x: 2, y: 1}), (2, {x: 3})):
        a = chain.build(S, 1, seqno=seqno)
        st = stats(S, a.messages[0].key, shared, {0: counts})
        assert queue.apply_diff(a.diff, a.block, a.hash, st)
    whole = QueueShardRange(S, QueueKey.MIN, QueueKey.MAX)
    assert queue.load_separated_diff_statistics([0], whole) == {0: {shared: {x: 5, y: 1}}}
    assert queue.load_diff_statistics(0, whole) == {x: 5, y: 1}
    assert queue.get_diffs_tail_len(S, shared) == 2


# -- last applied seqno, pointers -------------------------------------------------------------


def test_get_last_applied_seqno(queue: Queue, chain: Chain) -> None:
    assert queue.get_last_applied_seqno(S) is None
    for seqno in (1, 2, 7):
        chain.apply(S, 1, seqno=seqno)
    assert queue.get_last_applied_seqno(S) == 7
    mc = chain.apply(MC, 0)
    assert queue.commit_diff([mc.top(), chain.of(S)[-1].top(1)])
    chain.apply(S, 1, seqno=9)
    assert queue.get_last_applied_seqno(S) == 9  # highest across zones
    assert queue.get_last_applied_seqno(OTHER) is None


@pytest.mark.parametrize("large", [False, True])
def test_last_applied_seqno_of_adjacent_shards(queue: Queue, large: bool) -> None:
    """Shard encodings next to each other in byte order never bleed into each other."""
    base = 0xFFFF_FF00 if large else 0
    shards = {
        split_shard(0, 2, 1): base + 9,  # 0:6000…
        ShardIdent.parse("0:4000000000000000"): base + 4,
        ShardIdent.parse("0:8000000000000000"): base + 3,
        ShardIdent.parse("0:c000000000000000"): base + 5,
        ShardIdent.parse("-1:8000000000000000"): base + 2,
        ShardIdent.parse("1:8000000000000000"): base + 6,
    }
    for shard, seqno in shards.items():
        for s in (seqno - 1, seqno):
            assert queue.apply_diff(make_diff(), BlockIdShort(shard, s), diff_hash((shard, s)))
    for shard, seqno in shards.items():
        assert queue.get_last_applied_seqno(shard) == seqno
    for empty in ("0:2000000000000000", "0:a000000000000000", "-2:8000000000000000"):
        assert queue.get_last_applied_seqno(ShardIdent.parse(empty)) is None


def test_last_applied_seqno_at_the_u32_edges(queue: Queue) -> None:
    for seqno in (0, 0xFFFF_FFFF):
        assert queue.apply_diff(make_diff(), block(S, seqno), diff_hash(seqno))
    assert queue.get_last_applied_seqno(S) == 0xFFFF_FFFF
    assert queue.get_last_applied_seqno(OTHER) is None
    assert queue.get_diff_info(S, 0) is not None


def test_get_commit_pointers_returns_a_copy(queue: Queue, chain: Chain) -> None:
    a = chain.apply(S, 2)
    mc = chain.apply(MC, 1)
    assert queue.commit_diff([mc.top(), a.top(1)])
    pointers = queue.get_commit_pointers()
    expected = {S: CommitPointer(a.max_message, 1), MC: CommitPointer(mc.max_message, 1)}
    assert pointers == expected
    pointers.clear()
    pointers[OTHER] = CommitPointer(QueueKey.MAX, 9)
    assert queue.get_commit_pointers() == expected


def test_empty_queue_reads(queue: Queue) -> None:
    assert queue.get_commit_pointers() == {}
    assert queue.get_last_committed_mc_block_id() is None
    assert queue.get_last_applied_seqno(MC) is None
    assert queue.get_diffs_tail_len(MC, QueueKey.MIN) == 0
    whole = QueueShardRange(MC, QueueKey.MIN, QueueKey.MAX)
    assert queue.load_diff_statistics(0, whole) == {}
    assert queue.load_separated_diff_statistics([0, 1], whole) == {0: {}, 1: {}}


def test_the_highest_u32_seqno_is_read_back_and_one_past_it_refused(
    queue: Queue, chain: Chain
) -> None:
    """Seqnos are u32: a diff at ``2**32 - 1`` is stored and read back by every read that
    names a seqno; ``2**32`` is a ``ValueError``, not a missing diff."""
    top = chain.apply(S, 2, seqno=2**32 - 1)
    assert queue.get_diff_info(S, 2**32 - 1) is not None
    assert queue.get_diff_info(S, 2**32 - 1, DiffZone.UNCOMMITTED) is not None
    assert queue.is_diff_exists(top.block)
    assert queue.get_last_applied_seqno(S) == 2**32 - 1
    with pytest.raises(ValueError, match="u32"):
        queue.get_diff_info(S, 2**32)


class _FailingPoints:
    """A RocksDB snapshot whose point reads raise ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self._exc = exc

    def __getitem__(self, key: bytes) -> bytes:
        raise self._exc


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        # RocksDB's text for a read that failed, which names "not found" too
        (Exception("IO error: While open a file: 000012.sst: file not found"), StorageError),
        (TimeoutError("the host's deadline: key not found"), TimeoutError),  # the host's
    ],
    ids=["io-error", "host-exception"],
)
def test_a_point_read_that_fails_is_never_a_missing_key(
    queue: Queue, chain: Chain, raised: BaseException, expected: type[BaseException]
) -> None:
    """Only rocksdict's exact ``key not found`` is a missing key: an error whose text
    merely held "not found" read as one, and ``get_diff_info`` then said ``None``
    (``is_diff_exists`` False) for a stored diff (an outside review)."""
    applied = chain.apply(S, 2)
    real = queue._store.snapshot

    def failing(*args: object, **kwargs: object) -> object:
        snap = real(*args, **kwargs)  # type: ignore[arg-type]
        snap._points = {t: _FailingPoints(raised) for t in snap._points}
        return snap

    queue._store.snapshot = failing  # type: ignore[method-assign]
    try:
        with pytest.raises(expected):
            queue.get_diff_info(S, applied.seqno)
    finally:
        del queue._store.snapshot
    assert queue.get_diff_info(S, applied.seqno) is not None
