"""Tests from a mutation audit of the oracle and the recorder: ``imq/testing/model.py``
(the plain-Python model every state machine, replay and simulation compares the real
queue against), ``imq/testing/record.py`` (the op-log recorder) and ``imq/sim/child.py``
(the simulator's child process).

143 mutants were written (90 of the model, 33 of the recorder, 20 of the child); within
the audit's time budget only the model's were run against the existing tests, and only
against their fast tier (the replay audit, the concurrent-writes model check, clear and
startup, the kept replays), not against the hypothesis machines. The tests below kill
every model mutant that tier let through, except those argued equivalent; each pins a
rule of ``docs/behaviour.md``.

Each model test runs one fixed sequence of calls on the real queue (``imq.Queue`` on the
in-memory store) and on the model, and compares every observable read of the public API
afterwards (:class:`Pair`): a rule of ``docs/behaviour.md`` that the model got wrong with
no other test noticing. Deterministic, well under a second each.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import pytest

from imq import (
    Address,
    BlockId,
    BlockIdShort,
    DiffStatistics,
    DiffZone,
    Message,
    PartitionRouter,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    TopBlock,
)
from imq.errors import ImqError
from imq.testing import MemoryDatabase
from imq.testing.model import DiffInput, QueueModel

CONFIG = replace(QueueConfig.testing(), gc_enabled=False)
MC = ShardIdent.MASTERCHAIN
LEFT = ShardIdent(0, 0x4000_0000_0000_0000)  # accounts 0x00.. to 0x7f..
RIGHT = ShardIdent(0, 0xC000_0000_0000_0000)  # accounts 0x80.. to 0xff..
SHARDS = (MC, LEFT, RIGHT)
PARTITIONS = (0, 1, 2)
A_LEFT = Address(0, b"\x10" * 32)
B_LEFT = Address(0, b"\x20" * 32)
A_RIGHT = Address(0, b"\x90" * 32)
B_RIGHT = Address(0, b"\xa0" * 32)
A_MC = Address(-1, b"\x33" * 32)
TARGETS = (ShardIdent.BASECHAIN, MC, LEFT, RIGHT)


def key(lt: int, tag: int = 0) -> QueueKey:
    return QueueKey(lt, bytes([tag or lt % 251 + 1]) * 32)


def msg(lt: int, src: Address, dst: Address, tag: int = 0) -> Message:
    return Message(key(lt, tag), src, dst, b"body %d" % lt)


def block_id(shard: ShardIdent, seqno: int) -> BlockId:
    return BlockId(shard, seqno, bytes([seqno % 256]) * 32, bytes(32))


def top(shard: ShardIdent, seqno: int, ref: int = 1, updated: bool = True) -> TopBlock:
    return TopBlock(block_id(shard, seqno), ref, updated)


def full(shard: ShardIdent) -> QueueShardRange:
    return QueueShardRange(shard, QueueKey.MIN, QueueKey.MAX)


def diff_input(
    shard: ShardIdent,
    seqno: int,
    messages: Sequence[Message] = (),
    processed_to: dict[ShardIdent, QueueKey] | None = None,
    **kw: object,
) -> DiffInput:
    return DiffInput(
        block=BlockIdShort(shard, seqno),
        diff_hash=bytes([seqno % 256, shard.prefix >> 56 & 0xFF, 7]) + bytes(29),
        messages=tuple(messages),
        processed_to=dict(processed_to or {}),
        **kw,  # type: ignore[arg-type]
    )


def real_arguments(d: DiffInput) -> tuple[QueueDiff, DiffStatistics | None]:
    """The queue's arguments for a model diff input (as the state machine builds them)."""
    router = None
    if d.router_src or d.router_dst:
        parts = set(d.router_src.values()) | set(d.router_dst.values())
        router = PartitionRouter(
            src={p: [a for a, q in d.router_src.items() if q == p] for p in parts},
            dst={p: [a for a, q in d.router_dst.items() if q == p] for p in parts},
        )
    span = {} if d.span is None else {"start_lt": d.span[0], "end_lt": d.span[1]}
    diff = QueueDiff(d.messages, d.processed_to, router, d.prev_hash, **span)  # type: ignore[arg-type]
    stats = None
    if d.given_statistics is not None:
        lo, hi = d.stat_bounds()
        stats = DiffStatistics(d.block.shard, lo, hi, d.given_statistics)
    elif d.bounds is not None:
        stats = DiffStatistics.from_diff(diff, d.block.shard, *d.bounds)
    return diff, stats


def outcome(fn: object) -> tuple[str, object]:
    try:
        return "ok", fn()  # type: ignore[operator]
    except (ImqError, ValueError) as exc:
        return "raised", type(exc)


class Pair:
    """The real queue (in-memory store) and the model, driven with the same calls."""

    def __init__(self, zerostate_seqno: int = 0) -> None:
        self.db = MemoryDatabase()
        self.q: Queue = self.db.open(CONFIG, zerostate_seqno=zerostate_seqno)
        self.model = QueueModel(zerostate_seqno)

    def close(self) -> None:
        self.q.close()

    def apply(self, d: DiffInput, check_sequence: DiffZone | None = None) -> tuple[str, object]:
        diff, stats = real_arguments(d)
        got = outcome(lambda: self.q.apply_diff(diff, d.block, d.diff_hash, stats, check_sequence))
        want = outcome(lambda: self.model.apply(d, check_sequence))
        assert got == want, (d.block, got, want)
        return got

    def commit(self, tops: Sequence[TopBlock], partitions: Sequence[int] = (0, 1)) -> object:
        got = outcome(lambda: self.q.commit_diff(list(tops), list(partitions)))
        want = outcome(lambda: self.model.commit(list(tops), list(partitions)))
        assert got == want, (got, want)
        return got

    def clear(
        self, partitions: Sequence[int] = (0, 1), top_shards: Sequence[ShardIdent] = ()
    ) -> None:
        self.q.clear_uncommitted_state(list(partitions), list(top_shards))
        self.model.clear(partitions, top_shards)

    def startup(
        self, block: BlockId, top_shards: Sequence[ShardIdent], partitions: Sequence[int] = (0, 1)
    ) -> tuple[str, object]:
        got = outcome(lambda: self.q.startup(block, list(top_shards), list(partitions)))
        want = outcome(lambda: self.model.startup(block, top_shards, partitions))
        assert got == want, (got, want)
        return got

    def gc(self) -> int:
        got = self.q.run_gc()
        assert got == self.model.run_gc()
        return got

    def iterate(
        self, partition: int, ranges: Sequence[QueueShardRange], for_shard: ShardIdent
    ) -> None:
        with self.q.iterator(partition, list(ranges), for_shard) as it:
            got = list(it)
            position = it.current_position()
        want_it = self.model.iterator(partition, list(ranges), for_shard)
        assert got == list(want_it), (partition, ranges, for_shard)
        assert position == want_it.current_position(), (partition, ranges, for_shard)

    def _ranges(self, shard: ShardIdent) -> Iterator[QueueShardRange]:
        keys = {QueueKey.MIN, QueueKey.MAX}
        keys |= {d.info.max_message for (s, _), d in self.model.diffs.items() if s == shard}
        keys |= {d.info.min_message for (s, _), d in self.model.diffs.items() if s == shard}
        pointer = self.model.pointers.get(shard)
        if pointer is not None:
            keys |= {pointer.key, pointer.key.next_value()}
        ordered = sorted(keys)
        for i, lo in enumerate(ordered):
            for hi in ordered[i:]:
                yield QueueShardRange(shard, lo, hi)

    def check(self) -> None:
        """Every observable read agrees (as the state machine's invariants, and more)."""
        q, m = self.q, self.model
        assert q.get_commit_pointers() == m.get_commit_pointers()
        assert q.get_last_committed_mc_block_id() == m.get_last_committed_mc_block_id()
        assert q.gc_bounds() == (m.gc_requested, m.gc_executed)
        assert q.commit_record() == m.commit_record
        shards = sorted({*SHARDS, *(s for s, _ in m.diffs), *(s for _, s, _ in m.messages)})
        for shard in shards:
            last = m.get_last_applied_seqno(shard)
            assert q.get_last_applied_seqno(shard) == last, shard
            for seqno in range(0, (last or 0) + 2):
                for zone in DiffZone:
                    got = q.get_diff_info(shard, seqno, zone)
                    assert got == m.get_diff_info(shard, seqno, zone), (shard, seqno, zone)
            for r in self._ranges(shard):
                assert q.get_diffs_tail_len(shard, r.from_key) == m.get_diffs_tail_len(
                    shard, r.from_key
                ), (shard, r.from_key)
                for partition in PARTITIONS:
                    got = q.load_diff_statistics(partition, r)
                    assert got == m.load_diff_statistics(partition, r), (r, partition)
                got_sep = q.load_separated_diff_statistics(PARTITIONS, r)
                assert got_sep == m.load_separated_diff_statistics(PARTITIONS, r), r
        ranges = [full(s) for s in shards]
        stored = {}
        for partition in PARTITIONS:
            for target in (ShardIdent.BASECHAIN, MC):
                with q.iterator(partition, ranges, target) as it:
                    for source, message in it:
                        stored[(partition, source, message.key)] = message
        assert stored == m.messages
        for partition in PARTITIONS:
            for target in TARGETS:
                self.iterate(partition, ranges, target)


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def _history(p: Pair) -> None:
    """Three shards' diffs with routers in both halves, committed, then more diffs."""
    left = diff_input(
        LEFT,
        1,
        [
            msg(10, A_LEFT, A_RIGHT),
            msg(11, B_LEFT, B_RIGHT),  # destination map (1) beats source map (2)
            msg(12, B_LEFT, A_RIGHT),  # source map: 2
            msg(13, A_LEFT, A_MC),
            msg(14, A_LEFT, A_RIGHT),
        ],
        {LEFT: key(14), RIGHT: key(20)},
        router_src={B_LEFT: 2},
        router_dst={B_RIGHT: 1},
        prev_hash=b"\x05" * 32,
    )
    p.apply(left)
    p.apply(
        diff_input(RIGHT, 1, [msg(20, A_RIGHT, A_LEFT), msg(21, B_RIGHT, B_LEFT)], {LEFT: key(14)})
    )
    p.apply(diff_input(MC, 1, [], {LEFT: key(14), RIGHT: key(21)}))
    p.commit([top(MC, 1), top(LEFT, 1), top(RIGHT, 1)], (0, 1, 2))
    p.apply(
        diff_input(
            LEFT,
            2,
            [msg(30, A_LEFT, B_RIGHT), msg(31, A_LEFT, A_RIGHT)],
            {LEFT: key(30), RIGHT: key(32)},
            router_dst={B_RIGHT: 1},
        )
    )
    p.apply(diff_input(RIGHT, 2, [msg(32, B_RIGHT, A_LEFT)], {RIGHT: key(21)}))


def test_a_committed_history_reads_the_same(pair: Pair) -> None:
    """Routing (destination map first, I11), statistics, zones, tail lengths, commit
    record and GC bounds agree after commits and a GC pass (sections 2, 3, 5.3, 5.7)."""
    _history(pair)
    pair.check()
    pair.gc()
    pair.check()
    pair.apply(diff_input(MC, 2, [], {LEFT: key(30), RIGHT: key(32)}))
    pair.commit([top(MC, 2, 2), top(LEFT, 2, 2), top(RIGHT, 2, 2)], (0, 1, 2))
    pair.check()
    pair.gc()
    pair.check()


def test_a_cleared_history_reads_the_same(pair: Pair) -> None:
    """Clear removes the uncommitted diffs and their rows in every partition they wrote
    (I3), startup clears the masterchain too (sections 5.4, 5.5)."""
    _history(pair)
    pair.apply(diff_input(MC, 2, [msg(40, A_MC, A_LEFT)]))
    pair.clear((0,), (LEFT,))
    pair.check()
    pair.apply(diff_input(LEFT, 2, [msg(41, B_LEFT, A_RIGHT)], router_src={B_LEFT: 2}))
    pair.apply(diff_input(MC, 2, [msg(42, A_MC, A_LEFT)]))
    pair.startup(block_id(MC, 1), [])
    pair.check()


def test_an_empty_diff_with_a_span_takes_the_blocks_lt_bounds(pair: Pair) -> None:
    """An empty diff with a span has bounds ``min_for_lt(start_lt)`` and
    ``max_for_lt(end_lt)`` (section 2); committing it moves the pointer there."""
    _history(pair)
    pair.apply(diff_input(LEFT, 3, [], {LEFT: key(31)}, span=(40, 45)))
    pair.check()
    info = pair.q.get_diff_info(LEFT, 3)
    assert info is not None
    assert (info.min_message, info.max_message) == (
        QueueKey.min_for_lt(40),
        QueueKey.max_for_lt(45),
    )
    pair.apply(diff_input(MC, 2, [], {LEFT: key(31)}))
    pair.commit([top(MC, 2, 2), top(LEFT, 3, 2)])
    pair.check()


def test_iterator_ranges_are_half_open(pair: Pair) -> None:
    """A range is ``[from_key, to_key)``: a message at ``from_key`` is read, one at
    ``to_key`` is not (section 5.6)."""
    _history(pair)
    for lo, hi in ((10, 14), (11, 13), (12, 12), (30, 31)):
        ranges = [QueueShardRange(LEFT, key(lo), key(hi)), QueueShardRange(RIGHT, key(20), key(21))]
        for partition in PARTITIONS:
            pair.iterate(partition, ranges, ShardIdent.BASECHAIN)


def test_duplicates_and_the_sequence_rule(pair: Pair) -> None:
    """Prepare's checks in order (section 5.2): a duplicate is a no-op, another hash a
    conflict; with ``check_sequence`` a lower seqno is skipped, a gap refused, and a
    newest diff outside the zone sets no constraint."""
    _history(pair)
    left = diff_input(LEFT, 2, [msg(30, A_LEFT, B_RIGHT)])
    assert pair.apply(left) == ("ok", False)
    assert pair.apply(replace(left, diff_hash=b"\x09" * 32))[0] == "raised"
    for zone in DiffZone:
        pair.apply(diff_input(LEFT, 1, [msg(50, A_LEFT, A_RIGHT)]), zone)
        pair.apply(diff_input(LEFT, 4, [msg(51, A_LEFT, A_RIGHT)]), zone)
    pair.apply(diff_input(LEFT, 3, [msg(52, A_LEFT, A_RIGHT)]), DiffZone.BOTH)
    pair.check()


def test_a_diff_must_start_above_the_commit_pointer(pair: Pair) -> None:
    """The smallest message key must be above the pointer (section 5.2, step 3): one at
    the pointer's key, or one below it with the rest above, is refused."""
    _history(pair)  # LEFT's pointer: key(14)
    assert pair.apply(diff_input(LEFT, 3, [msg(14, A_LEFT, A_RIGHT)]))[0] == "raised"
    assert (
        pair.apply(diff_input(LEFT, 3, [msg(13, A_LEFT, A_RIGHT, 9), msg(60, A_LEFT, A_RIGHT)]))[0]
        == "raised"
    )
    assert pair.apply(diff_input(LEFT, 3, [msg(15, A_LEFT, A_RIGHT)])) == ("ok", True)
    pair.check()


def test_an_empty_diff_rests_just_above_its_shards_newest_position(pair: Pair) -> None:
    """An empty diff without bounds sits at ``next_value()`` of the higher of the pointer
    and the newest stored diff *below* it; at ``MIN`` while the shard has neither
    (section 2, I13)."""
    pair.apply(diff_input(MC, 1, []))
    pair.apply(diff_input(MC, 2, []))
    pair.commit([top(MC, 1)])
    pair.commit([top(MC, 2, 2)])  # an equal key with a higher seqno is a legal move
    pair.check()
    _history(pair)
    pair.apply(diff_input(LEFT, 5, [msg(70, A_LEFT, A_RIGHT)]))
    pair.apply(diff_input(LEFT, 3, []))  # below LEFT 5: rests above LEFT 2, not LEFT 5
    pair.apply(diff_input(LEFT, 4, []))
    pair.check()
    pair.apply(diff_input(RIGHT, 6, [msg(80, A_RIGHT, A_LEFT)]))
    pair.apply(diff_input(MC, 3, []))
    pair.commit([top(MC, 3, 3), top(RIGHT, 6, 3)])
    pair.apply(diff_input(RIGHT, 3, []))  # the pointer (RIGHT 6) is above RIGHT 2
    pair.check()


def test_two_ranges_of_one_shard_are_refused(pair: Pair) -> None:
    """Two ranges of one source shard are a ``ValueError`` (section 5.6)."""
    _history(pair)
    ranges = [QueueShardRange(LEFT, key(10), key(12)), QueueShardRange(LEFT, key(12), key(40))]
    with pytest.raises(ValueError):
        pair.q.iterator(0, ranges, ShardIdent.BASECHAIN)
    with pytest.raises(ValueError):
        pair.model.iterator(0, ranges, ShardIdent.BASECHAIN)


def test_commit_skips_refuses_and_keeps_the_record(pair: Pair) -> None:
    """Commit (section 5.3, D6, I8): a masterchain seqno at or below the pointer's or the
    last committed block's is skipped; a missing diff is an error only when updated and
    referenced above the zerostate; a missing diff's shard keeps its record entry; a
    shard listed twice, or a pointer moving back in key or seqno, is refused; unlisted
    shards keep their pointers and drop out of the record."""
    _history(pair)
    assert pair.commit([top(MC, 1), top(LEFT, 2)]) == ("ok", False)
    assert pair.commit(
        [top(MC, 2, 2, updated=False), top(LEFT, 7, 0), top(RIGHT, 9, 2, False)]
    ) == ("ok", True)
    pair.check()  # MC's pointer stays, the last committed block is MC 2
    assert pair.commit([top(MC, 2, 2), top(LEFT, 2, 2)]) == ("ok", False)
    assert (
        pair.commit([top(MC, 3, 3, updated=False), top(LEFT, 2, 3), top(LEFT, 2, 3)])[0] == "raised"
    )
    assert pair.commit([top(MC, 3, 3, updated=False), top(LEFT, 4, 3)])[0] == "raised"
    assert pair.commit([top(MC, 3, 3, updated=False), top(LEFT, 4, 0)]) == ("ok", True)
    pair.check()
    pair.apply(diff_input(MC, 5, []))
    assert pair.commit([top(MC, 5, 5), top(MC, 1, 5)])[0] == "raised"
    pair.apply(diff_input(LEFT, 6, [msg(90, A_LEFT, A_RIGHT)], {LEFT: key(31)}))
    pair.apply(diff_input(LEFT, 5, [msg(95, A_LEFT, A_RIGHT)]))
    assert pair.commit([top(MC, 5, 5), top(LEFT, 6, 5)]) == ("ok", True)
    assert pair.commit([top(MC, 6, 6, False), top(LEFT, 5, 6)])[0] == "raised"  # seqno back
    assert pair.commit([top(MC, 6, 6, False), top(LEFT, 6, 6)]) == ("ok", True)  # same diff
    stats = {0: {A_RIGHT: 1}}
    low = diff_input(LEFT, 8, [], bounds=(key(1), key(1)), given_statistics=stats)
    pair.apply(low)
    assert pair.commit([top(MC, 7, 7, False), top(LEFT, 8, 7)])[0] == "raised"  # key back
    pair.check()


def test_gc_bounds_run_once_and_never_back(pair: Pair) -> None:
    """A requested bound runs once (strictly above the executed one), a bound that moved
    back is kept but not run, and a commit's partitions get bounds (sections 5.3, 5.7)."""
    _history(pair)
    assert pair.gc() > 0
    assert pair.gc() == 0
    pair.apply(diff_input(MC, 2, [], {LEFT: key(12), RIGHT: key(3)}))
    pair.commit([top(MC, 2, 2), top(LEFT, 1, 1, False)], (0, 2))
    pair.check()
    assert pair.gc() == 0
    pair.apply(diff_input(MC, 3, [], {LEFT: key(30), RIGHT: key(32)}))
    pair.commit([top(MC, 3, 3), top(LEFT, 2, 3), top(RIGHT, 2, 3)], (1,))
    pair.check()
    pair.gc()
    pair.check()


def test_gc_of_one_shard_leaves_the_other_shards_rows(pair: Pair) -> None:
    """A bound of source shard S deletes only S's messages, statistics and diffs
    (section 5.7): another shard's rows below that key stay until its own bound."""
    pair.apply(diff_input(LEFT, 1, [msg(10, A_LEFT, A_RIGHT)], {LEFT: key(10), RIGHT: key(1)}))
    pair.apply(diff_input(RIGHT, 1, [msg(5, A_RIGHT, A_LEFT)], {LEFT: key(10), RIGHT: key(1)}))
    pair.apply(diff_input(MC, 1, [], {LEFT: key(10), RIGHT: key(1)}))
    pair.commit([top(MC, 1), top(LEFT, 1), top(RIGHT, 1)])
    pair.gc()
    pair.check()


def test_clear_removes_every_partition_a_cleared_diff_wrote(pair: Pair) -> None:
    """Clear (section 5.4, I3): above the pointer only, in the given partitions and in
    every partition the cleared diffs wrote rows into (messages' and statistics'); a top
    shard without a pointer loses all its diffs; other shards without one are kept."""
    _history(pair)
    stats = {0: {A_RIGHT: 1}, 2: {B_RIGHT: 4}}
    pair.apply(
        diff_input(
            LEFT, 3, [msg(40, A_LEFT, A_RIGHT)], bounds=(key(40), key(40)), given_statistics=stats
        )
    )
    far = ShardIdent(0, 0x2000_0000_0000_0000)
    near = ShardIdent(0, 0x6000_0000_0000_0000)
    pair.apply(diff_input(far, 1, [msg(50, Address(0, b"\x21" * 32), A_RIGHT)]))
    pair.apply(diff_input(near, 1, [msg(51, Address(0, b"\x61" * 32), A_RIGHT)]))
    pair.clear((1,), (LEFT, far))
    pair.check()
    with pair.q.iterator(0, [full(far), full(near)], ShardIdent.BASECHAIN) as it:
        got = [(source, m.key) for source, m in it]
    assert got == [(near, key(51))]
    assert got == [(s, k) for (_p, s, k) in pair.model.messages if s in (far, near)]


def test_startup_checks_the_last_committed_block(pair: Pair) -> None:
    """Startup (section 5.5): a non-masterchain block is a ``ValueError``; the committed
    block itself or an older one passes; another block of the same seqno, or a newer
    committed one, is ``StartupError``."""
    _history(pair)
    assert pair.startup(block_id(LEFT, 1), [])[0] == "raised"
    other = BlockId(MC, 1, b"\x77" * 32, bytes(32))
    assert pair.startup(other, [])[0] == "raised"
    assert pair.startup(block_id(MC, 0), [])[0] == "raised"
    pair.apply(diff_input(MC, 2, [msg(60, A_MC, A_LEFT)]))
    assert pair.startup(block_id(MC, 1), [LEFT]) == ("ok", None)
    assert pair.q.get_last_applied_seqno(MC) == 1
    pair.check()
    assert pair.startup(block_id(MC, 5), [RIGHT], (2,)) == ("ok", None)
    pair.check()


def test_statistics_of_diffs_sharing_a_max_message_are_summed(pair: Pair) -> None:
    """Statistics with explicit bounds are stored under them; the separated read sums
    diffs that share a ``max_message``, the plain read sums every diff in the range
    (section 5.6, I2)."""
    stats = {0: {A_RIGHT: 2, B_RIGHT: 1}, 1: {A_LEFT: 3}}
    for seqno in (1, 2):
        lt = 10 * seqno
        pair.apply(
            diff_input(
                LEFT,
                seqno,
                [msg(lt, A_LEFT, A_RIGHT)],
                bounds=(key(lt), key(50)),
                given_statistics=stats,
            )
        )
    pair.check()
    assert pair.q.load_separated_diff_statistics([0], full(LEFT)) == {
        0: {key(50): {A_RIGHT: 4, B_RIGHT: 2}}
    }


def test_startup_clears_the_masterchain_without_a_pointer(pair: Pair) -> None:
    """The masterchain is a top shard of every startup (section 5.5), even with no
    pointer yet: its uncommitted diffs go, another shard without a pointer stays."""
    pair.apply(diff_input(MC, 1, [msg(10, A_MC, A_LEFT)]))
    pair.apply(diff_input(LEFT, 1, [msg(11, A_LEFT, A_RIGHT)]))
    assert pair.startup(block_id(MC, 1), []) == ("ok", None)
    assert pair.q.get_last_applied_seqno(MC) is None
    pair.check()
