"""Tests from a mutation audit of the oracle and the recorder: ``imq/testing/model.py``
(the plain-Python model every state machine, replay and simulation compares the real
queue against), ``imq/testing/record.py`` (the op-log recorder) and ``imq/sim/child.py``
(the simulator's child process).

143 mutants (stop 49), each run against the existing tests in tiers (the fast files
first; a survivor then against the hypothesis state machines, the replays, the
simulator's and the CLI's files; the machines with shrinking off, and the clean code
checked to pass under the same settings):

- the model, 90: 82 killed (most only by the state machines), 6 equivalent (returns no
  call reaches, checks an earlier one always decides, empty statistics partitions
  dropped), 2 gaps (``startup`` without its masterchain check; ``current_position()``
  handing out the model's own dict);
- the recorder, 32: 23 killed, 4 equivalent (the order of keys in a log line, the
  order of an iterator's close and its log line, a GC pass's failures added to a count
  that is 0 when none fails), 5 gaps (the header's zerostate, a ``null`` result left
  out, generators of ranges and of top blocks consumed by the log before the queue,
  an unloggable call returning as if recorded);
- the child queue, 21: 6 killed, 12 gaps (pending diffs sharing a token, ``None`` of
  an applied diff, positions, a commit's partitions, the GC counters and passes,
  SIGKILL, SIGINT ignored, an interrupted call, a closed iterator, a clean close), 3
  not pinned: two with no effect a caller can see (startup's partitions, which a clear
  widens to every partition the cleared diffs wrote, I3; written pending diffs kept in
  the child's table), and one a race (the child's answer to its first call when its
  open failed, sent before that call).

The tests below kill every gap; the model's tests (before the recorder's) also pin
rules of ``docs/behaviour.md`` that only the state machines pinned before.

Each model test runs one fixed sequence of calls on the real queue (``imq.Queue`` on the
in-memory store) and on the model, and compares every observable read of the public API
afterwards (:class:`Pair`): a wrong rule of the model fails here at once, deterministic
and in well under a second, where a state machine has to find the sequence first.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

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
from imq.sim.child import ChildQueue, ChildQueueError
from imq.testing import MemoryDatabase, OpLog, UnrecordableCallError, replay
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


def test_a_position_handed_out_is_a_copy(pair: Pair) -> None:
    """docs/behaviour.md 5.6: ``current_position()`` is the last key consumed per source
    shard; what it returns is the caller's, as the real iterator's is: changing it does
    not move the iterator. Mutant: the model's iterator handing out its own dict."""
    pair.apply(diff_input(LEFT, 1, [msg(10, A_LEFT, A_RIGHT), msg(11, B_LEFT, B_RIGHT)]))
    for q in (pair.q, pair.model):
        it = q.iterator(0, [full(LEFT)], ShardIdent.BASECHAIN)
        next(it)
        position = it.current_position()
        position[LEFT] = key(99)
        position[RIGHT] = key(1)
        assert it.current_position() == {LEFT: key(10)}


# -- the recorder (``imq/testing/record.py``): rules of docs/replay-format.md ---------------------


def _recorded(tmp_path: Path, zerostate_seqno: int = 0) -> tuple[Path, Any]:
    """An op log in ``tmp_path`` and a recorded queue on it (closed by the caller)."""
    log_path = tmp_path / "ops.jsonl"
    sink = log_path.open("w")
    log = OpLog(sink, zerostate_seqno=zerostate_seqno)
    queue = log.open(
        lambda path, config, **kw: Queue.open(path, config, zerostate_seqno=zerostate_seqno),
        tmp_path / "q",
        CONFIG,
    )
    return log_path, (queue, sink)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_log_header_holds_the_zerostate_seqno_and_replays_with_it(tmp_path: Path) -> None:
    """docs/replay-format.md: the header's ``zerostate_seqno`` is what the replay opens
    with. A recording of a queue opened with zerostate 5 (a masterchain block of seqno
    5 is then its first, committed with ``ref_by_mc_seqno`` 5) replays only with it.
    Mutant: the header always written with 0."""
    log_path, (queue, sink) = _recorded(tmp_path, zerostate_seqno=5)
    with sink:
        left = diff_input(LEFT, 1, [msg(10, A_LEFT, A_RIGHT)])
        queue.apply_diff(*real_arguments(left)[:1], BlockIdShort(LEFT, 1), left.diff_hash)
        queue.apply_diff(QueueDiff(), BlockIdShort(MC, 5), bytes([5]) * 32)
        assert queue.commit_diff([top(MC, 5, 5), top(LEFT, 1, 5)])
        queue.close()
    assert _lines(log_path)[0] == {"imq_ops": 1, "zerostate_seqno": 5}
    assert replay(log_path).steps == len(_lines(log_path)) - 1


def test_a_call_returning_none_logs_a_null_result(tmp_path: Path) -> None:
    """docs/replay-format.md: every line holds ``result`` (the value returned, ``null``
    for none) or ``error``. Mutant: a ``None`` result left out of the line."""
    log_path, (queue, sink) = _recorded(tmp_path)
    with sink:
        queue.clear_uncommitted_state()
        queue.close()
    (clear,) = [line for line in _lines(log_path)[1:] if line["op"] == "clear_uncommitted_state"]
    assert "result" in clear
    assert clear["result"] is None


def test_generators_of_ranges_and_top_blocks_reach_the_queue_whole(tmp_path: Path) -> None:
    """The recorder reads an iterable argument once, for the log and the queue alike
    (``_listed``): a generator of ranges or of top blocks must reach the queue with
    every item, and the log replay. Mutants: ``iterator`` or ``commit_diff`` passing
    the generator the log's encoding already consumed."""
    log_path, (queue, sink) = _recorded(tmp_path)
    with sink:
        left = diff_input(LEFT, 1, [msg(10, A_LEFT, A_RIGHT)])
        queue.apply_diff(*real_arguments(left)[:1], BlockIdShort(LEFT, 1), left.diff_hash)
        queue.apply_diff(QueueDiff(), BlockIdShort(MC, 1), bytes([1]) * 32)
        assert queue.commit_diff(t for t in [top(MC, 1), top(LEFT, 1)])
        with queue.iterator(0, (r for r in [full(LEFT)]), RIGHT) as it:
            assert [m.message.key for m in it] == [key(10)]
        queue.close()
    assert replay(log_path).steps == len(_lines(log_path)) - 1


def test_a_call_whose_arguments_cannot_be_logged_is_refused_after_it(tmp_path: Path) -> None:
    """``OpLog.call``: a call that took effect although the log cannot hold its
    arguments raises ``UnrecordableCallError`` (saying so), never returns as if
    recorded. Mutant: the value returned instead."""
    with (tmp_path / "ops.jsonl").open("w") as sink:
        log = OpLog(sink)
        ran: list[int] = []

        def unencodable() -> dict[str, Any]:
            raise TypeError("no log form")

        with pytest.raises(UnrecordableCallError, match="took effect"):
            log.call("run_gc", unencodable, lambda: ran.append(1) or 0, int)
        assert ran == [1]


# -- the simulator's child process (``imq/sim/child.py``) -----------------------------------------


def _child_script(q: Any, gc_config: bool = False) -> list[object]:
    """The calls the simulation makes, on ``q`` (a ``Queue`` or a ``ChildQueue``), and
    what each answered."""
    out: list[object] = []
    left = diff_input(LEFT, 1, [msg(10, A_LEFT, A_RIGHT), msg(11, B_LEFT, B_RIGHT)])
    right = diff_input(RIGHT, 1, [msg(12, A_RIGHT, A_LEFT)], router_dst={A_LEFT: 2})
    # Two prepared diffs of two shards held at once, written in the other order.
    first = q.prepare_diff(real_arguments(left)[0], left.block, left.diff_hash)
    second = q.prepare_diff(real_arguments(right)[0], right.block, right.diff_hash)
    second.write()
    first.write()
    # Applied already (same hash): no pending diff.
    out.append(q.prepare_diff(real_arguments(left)[0], left.block, left.diff_hash))
    again = diff_input(LEFT, 2, [msg(20, A_LEFT, A_RIGHT)])
    pending = q.prepare_diff(real_arguments(again)[0], again.block, again.diff_hash)
    pending.discard()
    out.append(q.get_diff_info(LEFT, 2))
    # A refused call raises the queue's own error in the caller.
    out.append(outcome(lambda: q.get_diff_info(LEFT, -1)))
    # Each message with the position after it, and the position at the end.
    with q.iterator(0, [full(LEFT), full(RIGHT)], ShardIdent.BASECHAIN) as it:
        out.append([(item, it.current_position()) for item in it])
        out.append(it.current_position())
    # A commit's partitions get GC bounds: partition 2's message goes with the others.
    mc = diff_input(MC, 1, [], {LEFT: key(11), RIGHT: key(12)})
    q.apply_diff(real_arguments(mc)[0], mc.block, mc.diff_hash)
    out.append(q.commit_diff([top(MC, 1), top(LEFT, 1), top(RIGHT, 1)], [0, 1, 2]))
    out.append(q.run_gc())
    out.append(q.metrics.counter("messages_deleted"))
    with q.iterator(2, [full(RIGHT)], ShardIdent.BASECHAIN) as it:
        out.append(list(it))
    return out


def test_the_child_queue_answers_as_the_queue_it_runs(tmp_path: Path) -> None:
    """docs/simulation.md (``--kill``): the queue in a child process forwards every call
    the simulation makes and answers as an in-process queue does. Mutants: pending
    diffs sharing one token, ``None`` of an applied diff turned into a pending one,
    errors not raised, iterator positions dropped, a commit's partitions replaced by
    (0, 1), the GC counter read from another metric."""
    with Queue.open(tmp_path / "in-process", CONFIG) as queue:
        expected = _child_script(queue)
    child = ChildQueue(tmp_path / "child", CONFIG)
    try:
        assert _child_script(child) == expected
    finally:
        child.close()
    assert child._proc.exitcode == 0  # closed cleanly, not killed
    assert expected[2] == ("raised", ValueError)
    # Committed; six (partition, shard) deletions, three messages, partition 2's among them.
    assert expected[-4:] == [True, 6, 3, []]


def test_the_child_queue_iterator_closes_and_kill_is_sigkill(tmp_path: Path) -> None:
    """A closed iterator of the child queue hands out nothing more; ``kill()`` is a crash
    (SIGKILL, no close), and the queue reopens with every acknowledged write. Mutants:
    ``close`` a no-op, ``terminate`` (SIGTERM) instead of SIGKILL."""
    child = ChildQueue(tmp_path / "q", CONFIG)
    left = diff_input(LEFT, 1, [msg(10, A_LEFT, A_RIGHT), msg(11, B_LEFT, B_RIGHT)])
    assert child.apply_diff(real_arguments(left)[0], left.block, left.diff_hash)
    it = child.iterator(0, [full(LEFT)], ShardIdent.BASECHAIN)
    assert next(it).message.key == key(10)
    it.close()
    assert list(it) == []
    child.kill()
    assert child._proc.exitcode == -signal.SIGKILL
    with Queue.open(tmp_path / "q", CONFIG) as queue:
        assert queue.get_diff_info(LEFT, 1) is not None


def test_the_child_queue_ignores_ctrl_c_and_goes_on(tmp_path: Path) -> None:
    """The queue process ignores SIGINT (a Ctrl-C reaches the whole process group; the
    command decides what to do): it answers the next call. Mutant: SIGINT not ignored,
    so the child died with the parent's Ctrl-C."""
    child = ChildQueue(tmp_path / "q", CONFIG)
    try:
        assert child.get_commit_pointers() == {}  # the child is serving
        os.kill(child._proc.pid, signal.SIGINT)  # type: ignore[arg-type]
        time.sleep(0.2)
        assert child.get_commit_pointers() == {}
    finally:
        child.close()


def test_an_interrupted_call_closes_the_channel(tmp_path: Path) -> None:
    """A call cut short between its send and its answer (a Ctrl-C) leaves the answer in
    the pipe: every later call raises ``ChildQueueError`` instead of reading it as its
    own, the counters read as zeros and ``close()`` stops the child. Mutants: the
    interruption not noted; the counters asked of the child all the same."""
    child = ChildQueue(tmp_path / "q", CONFIG)
    real_conn = child._conn

    class _CutShort:
        def send(self, message: object) -> None:
            real_conn.send(message)

        def recv(self) -> object:
            raise KeyboardInterrupt

    child._conn = _CutShort()  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        child.get_last_committed_mc_block_id()
    child._conn = real_conn
    with pytest.raises(ChildQueueError, match="interrupted"):
        child.get_commit_pointers()
    assert child.metrics.counter("messages_deleted") == 0
    child.close()
    assert child._proc.exitcode == -signal.SIGKILL


def test_the_child_queue_reports_its_gc_workers_passes(tmp_path: Path) -> None:
    """The simulation's report counts the background GC worker's passes, which for a
    queue in a child process are the child's: its first tick fires right after the open
    (docs/behaviour.md), so the count reaches 1. Mutant: the child answering 0."""
    child = ChildQueue(tmp_path / "q", replace(CONFIG, gc_enabled=True))
    try:
        deadline = time.monotonic() + 10
        while child.gc_worker.passes < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.gc_worker.passes >= 1
    finally:
        child.close()
