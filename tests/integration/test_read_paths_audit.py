"""Read paths pinned by a mutation audit: zones, store scans, the merge iterator and the
cache of fresh rows (SEMANTICS §5.2, §5.7-§5.9, §6, §11;
docs/behaviour.md 5.6; docs/architecture.md "The cache of fresh message rows")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import (
    BASE,
    MC,
    Chain,
    Clock,
    address_in,
    full_range,
    key,
    make_diff,
    message,
    split_shard,
    stats,
)

from imq import (
    Address,
    BlockIdShort,
    DiffZone,
    Message,
    Queue,
    QueueConfig,
    QueueKey,
    QueueShardRange,
    ShardIdent,
)
from imq import iterator as iterator_module
from imq.storage import Table, codec
from imq.storage import cache as cache_module
from imq.storage.rocks import Scan

S = split_shard(0, 1, 0)  # 0:4000000000000000
OTHER = split_shard(0, 1, 1)  # 0:c000000000000000


def _open(tmp_path: Path) -> Queue:
    return Queue.open(tmp_path / "q", QueueConfig(gc_enabled=False))


@pytest.fixture(params=["compiled", "python"])
def read_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The default read path, or the pure-Python forms of the cache's filtered rows and of
    the merge (what runs without a compiler) for the test's duration."""
    if request.param == "compiled":
        yield
        return
    monkeypatch.setattr(cache_module, "ChunkRows", cache_module._PyChunkRows)
    monkeypatch.setattr(cache_module, "_cache_scan", None)
    with iterator_module.pure_python():
        yield


def test_zone_of_a_diff_spanning_the_pointer_follows_its_max_message(tmp_path: Path) -> None:
    """A diff is committed iff its shard's pointer is at or above the diff's
    ``max_message`` (SEMANTICS §6, §5.9): an empty diff whose statistics span the
    pointer (min below it, max above it, as the collator's ``min_for_lt``/``max_for_lt``
    of an empty block can) is uncommitted."""
    with _open(tmp_path) as queue:
        chain = Chain(queue)
        d1 = chain.apply(S, 1)
        mc = chain.apply(MC, 0)
        assert queue.commit_diff([mc.top(), d1.top(1)])
        pointer = queue.get_commit_pointers()[S].key
        empty = chain.build(S, 0)
        span = stats(
            S, QueueKey.min_for_lt(pointer.lt - 1), QueueKey.max_for_lt(pointer.lt + 100), {}
        )
        assert queue.apply_diff(empty.diff, empty.block, empty.hash, span)
        assert queue.get_diff_info(S, empty.seqno, DiffZone.COMMITTED) is None
        assert queue.get_diff_info(S, empty.seqno, DiffZone.UNCOMMITTED) is not None
        assert queue.get_diff_info(S, d1.seqno, DiffZone.COMMITTED) is not None


def test_a_pointer_of_seqno_zero_commits_its_diff(tmp_path: Path) -> None:
    """Zones compare the pointer's key with the diff's ``max_message`` only; the
    pointer's seqno plays no part (SEMANTICS §6, docs/behaviour.md 3), so a diff of
    seqno 0 (a zerostate's) is committed once its pointer reaches it."""
    with _open(tmp_path) as queue:
        chain = Chain(queue)
        zero = chain.apply(S, 2, seqno=0)
        mc = chain.apply(MC, 0)
        assert queue.commit_diff([mc.top(), zero.top(1)])
        assert queue.get_commit_pointers()[S].seqno == 0
        assert queue.get_diff_info(S, 0, DiffZone.COMMITTED) is not None
        assert queue.get_diff_info(S, 0, DiffZone.UNCOMMITTED) is None


def test_a_reverse_scan_reads_its_whole_half_open_range(tmp_path: Path) -> None:
    """A store scan reads ``[lo, hi)`` (``Scan``: ``reverse`` reads the same range from
    its last key down): the row at ``lo`` itself is in it, the one at ``hi`` is not."""
    with _open(tmp_path) as queue:
        Chain(queue).apply(S, 4)
        prefix = codec.message_prefix(0, S)
        whole = Scan(Table.MESSAGES, prefix, codec.prefix_end(prefix), keys_only=True)
        with queue._store.snapshot(scans=[whole]) as snap:
            keys = list(snap.cursors[0])
        assert len(keys) == 4
        backwards = Scan(Table.MESSAGES, keys[0], keys[3], reverse=True)
        with queue._store.snapshot(scans=[backwards]) as snap:
            got = [k for k, _v in snap.cursors[0]]
        assert got == keys[2::-1]


@pytest.mark.usefixtures("read_path")
def test_a_reader_in_a_workchain_no_address_can_name_gets_nothing(tmp_path: Path) -> None:
    """The iterator yields only messages whose destination ``for_shard`` contains
    (API.md ``iterator``; SEMANTICS §11.1): addresses live in i8 workchains, so a reader
    of workchain 128 or -129 gets none of them, not even those of workchain -128 or
    127 (whose stored destination bytes are 0 and 255)."""
    with _open(tmp_path) as queue:
        low, high = Address(-128, bytes(32)), Address(127, b"\xff" * 32)
        msgs = [message(key(10 + i), address_in(S, i), dst) for i, dst in enumerate([low, high])]
        assert queue.apply_diff(make_diff(msgs), BlockIdShort(S, 1), b"\x01" * 32)
        for workchain in (128, -129, 1000):
            with queue.iterator(0, [full_range(S)], ShardIdent.full(workchain)) as it:
                assert list(it) == []
                assert it.current_position() == {S: msgs[-1].key}
        with queue.iterator(0, [full_range(S)], ShardIdent.full(-128)) as it:
            assert [m.message for m in it] == [msgs[0]]


def test_a_keys_only_scan_of_fresh_messages_yields_keys(tmp_path: Path) -> None:
    """A ``keys_only`` scan yields the keys of its range and nothing else (``Scan``),
    also over message rows the cache of fresh rows holds: the cache serves only forward
    scans of whole rows (docs/architecture.md, "Reads")."""
    with _open(tmp_path) as queue:
        applied = Chain(queue).apply(S, 3)
        prefix = codec.message_prefix(0, S)
        scan = Scan(Table.MESSAGES, prefix + bytes(40), codec.prefix_end(prefix), keys_only=True)
        with queue._store.snapshot(scans=[scan]) as snap:
            got = list(snap.cursors[0])
        assert got == [prefix + codec.key_bytes(m.key) for m in applied.messages]


def test_a_range_ending_at_the_last_row_loaded_below_the_floor_excludes_it(
    tmp_path: Path,
) -> None:
    """An iterator range is half-open, ``[from_key, to_key)`` (API.md
    ``QueueShardRange``), also when the cache serves it from the rows it loaded below a
    segment's floor at the second declined scan (docs/architecture.md, the cache's
    invariant and its one-time load): the message at ``to_key`` is not read."""
    with _open(tmp_path) as queue:
        old = Chain(queue).apply(S, 3)
    with _open(tmp_path) as queue:
        Chain(queue, Clock(start=10_000)).apply(S, 2, seqno=2)  # the segment's floor: old's last
        end = old.messages[-1].key
        want = list(old.messages[:-1])
        for _ in range(3):  # RocksDB, RocksDB (then the load), the cache
            with queue.iterator(0, [QueueShardRange(S, QueueKey.MIN, end)], S) as it:
                assert [m.message for m in it] == want
        assert queue.message_cache_stats()["hits"] >= 1


def test_a_message_key_written_again_is_read_once_with_its_newest_row(tmp_path: Path) -> None:
    """A key stored again replaces its row (RocksDB: the last put wins), and the cache
    of fresh rows follows: "a key stored again replaces its row" (imq/storage/cache.py,
    docs/architecture.md). Whether the key is the newest one cached or below it, the
    iterator reads it once, with the row written last, as a read from RocksDB does."""
    src, dst = address_in(S, 1), address_in(S, 2)
    k1, k2, k3 = key(100), key(200), key(300)

    def diff(seqno: int, *keyed: tuple[QueueKey, bytes]) -> None:
        msgs = [Message(k, src, dst, body) for k, body in keyed]
        assert queue.apply_diff(make_diff(msgs), BlockIdShort(S, seqno), bytes([seqno]) * 32)

    def read() -> list[tuple[QueueKey, bytes]]:
        with queue.iterator(0, [full_range(S)], S) as it:
            return [(m.message.key, m.message.body) for m in it]

    for size in (0, 1 << 20):  # RocksDB only, then with the cache
        path = tmp_path / str(size)
        with Queue.open(path, QueueConfig(gc_enabled=False, message_cache_size=size)) as queue:
            diff(1, (k1, b"a"), (k2, b"a"))
            diff(2, (k2, b"b"), (k3, b"b"))  # starts at the newest cached key
            assert read() == [(k1, b"a"), (k2, b"b"), (k3, b"b")]
            diff(3, (k1, b"c"))  # below it
            assert read() == [(k1, b"c"), (k2, b"b"), (k3, b"b")]


@pytest.mark.usefixtures("read_path")
def test_fresh_rows_at_both_edges_of_the_readers_prefix_are_read(tmp_path: Path) -> None:
    """The destination test (SEMANTICS §1.3 ``contains_address``, §11.1) accepts every
    account whose top bits are the reader shard's prefix, the first (``00..``) and the
    last (``7f ff..`` in ``0:4000..``) included, also where the cache of fresh rows
    filters rows by their route (docs/architecture.md, "Reads"), and also in the
    pure-Python forms that run without a compiler."""
    first = Address(0, bytes(32))
    last = Address(0, b"\x7f" + b"\xff" * 31)
    outside = [Address(0, b"\x80" + bytes(31)), Address(-1, b"\x7f" + b"\xff" * 31)]
    dsts = [last, outside[0], first, outside[1], last]
    msgs = [message(key(10 + i), address_in(S, i), dst) for i, dst in enumerate(dsts)]
    with _open(tmp_path) as queue:
        assert queue.apply_diff(make_diff(msgs), BlockIdShort(S, 1), b"\x01" * 32)
        with queue.iterator(0, [full_range(S)], S) as it:
            got = [m.message for m in it]
            assert it.current_position() == {S: msgs[-1].key}
        assert got == [msgs[0], msgs[2], msgs[4]]
        assert queue.message_cache_stats()["hits"] == 1


def _tycho_positions(
    rows: dict[ShardIdent, list[tuple[QueueKey, bool]]],
) -> list[tuple[QueueKey, dict[ShardIdent, QueueKey]]]:
    """SEMANTICS §11.2 step by step: each ``next()`` first refills every source without
    a pending message (a skipped row moves its position, an accepted one becomes
    pending), then pops the smallest pending key. Per message: its key and the
    positions right after it was returned."""
    cursors = {s: iter(r) for s, r in rows.items()}
    pending: dict[ShardIdent, QueueKey] = {}
    position: dict[ShardIdent, QueueKey] = {}
    out: list[tuple[QueueKey, dict[ShardIdent, QueueKey]]] = []
    while True:
        for shard, cursor in cursors.items():
            if shard in pending:
                continue
            for k, accepted in cursor:
                if accepted:
                    pending[shard] = k
                    break
                position[shard] = k
        if not pending:
            return out
        shard = min(pending, key=pending.__getitem__)
        position[shard] = pending.pop(shard)
        out.append((position[shard], dict(position)))


@pytest.mark.usefixtures("read_path")
def test_current_position_after_each_message_matches_the_original_merge(tmp_path: Path) -> None:
    """``current_position()`` after each message: the last key consumed per source,
    skipped ones included, where a source's skipped rows count as consumed once the
    merge has read past them to its next message, i.e. at the ``next()`` after the
    message that preceded them (SEMANTICS §5.2, §11.2, §11.3; API.md). Two sources
    whose rows interleave, one with a skipped row at the end of a read-ahead chunk and
    a run of accepted rows after it (the pure-Python merge reads ahead in chunks); the
    reader is a whole workchain, the skipped row goes to the masterchain."""
    a_src, b_src = address_in(S, 1), address_in(OTHER, 1)
    to_s, to_other = address_in(OTHER, 5), address_in(MC, 5)
    a_rows = [(key(10 * k), k != 8) for k in range(1, 25)]  # one skipped row: the 8th
    b_rows = [(key(5 * k + 2), True) for k in range(1, 50)]
    rows = {S: a_rows, OTHER: b_rows}
    with _open(tmp_path) as queue:
        for seqno, (source, src) in enumerate([(S, a_src), (OTHER, b_src)], 1):
            msgs = [message(k, src, to_s if ok else to_other) for k, ok in rows[source]]
            assert queue.apply_diff(make_diff(msgs), BlockIdShort(source, seqno), bytes(32))
        want = _tycho_positions(rows)
        got = []
        with queue.iterator(0, [full_range(S), full_range(OTHER)], BASE) as it:
            for m in it:
                got.append((m.message.key, it.current_position()))
        assert got == want
