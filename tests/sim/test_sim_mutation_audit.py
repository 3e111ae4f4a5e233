"""Checks of ``imq simulate`` that hand-made mutants of ``imq.sim`` got past (a mutation
audit of the engine, its ledger and its state checks).

Each test pins a rule of ``docs/simulation.md``: the verdict must be able to fail. A
queue (or a ledger record) with one defect is run, and the test asserts that the run
fails *and* names the defect the check it pins is there to see: a message executed
that no committed block created (``phantom``), one created twice, messages or
statistics GC left behind, a tail that lost diff records, a wrong last committed block
at reopen, a startup that keeps uncommitted diffs, a stored diff that differs from
the written one in one field, wrong tail lengths right after a commit, a read outside
its range, a position past the next message, a range end included, wrong commit
pointers in a round, nodes disagreeing on the last committed block, a verdict line
that names the first failure; and the run's own rules: the drain goes on past the last
delivery, a block starts past every lt it read, the router moves accounts with 3
messages, the shard count is a power of two, and the report tells each count under its
own name. Two tests reproduce bugs the audit found, fixed in stop 48 (a crash instead
of a verdict; a drain one round shorter than documented). The faults are put into the
queue the run opens (a wrapper, as ``tests/sim/test_simulate.py`` does), never into the
simulation itself.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_simulate import _Wrapped

from imq import (
    CommitPointer,
    DiffConflictError,
    DiffZone,
    IteratedMessage,
    Message,
    Queue,
    QueueConfig,
    QueueKey,
    QueueShardRange,
    ShardIdent,
)
from imq.sim import SimConfig, Simulation
from imq.sim.child import _ListIterator
from imq.sim.engine import BlockRecord, SimResult
from imq.sim.report import summary_rows, to_json
from imq.sim.world import World, busiest_router

_SHORT: dict[str, Any] = {"rounds": 40, "seed": 3, "restart_rate": 0.08, "reset_rate": 0.05}
_CALM: dict[str, Any] = {"rounds": 24, "seed": 2, "restart_rate": 0, "reset_rate": 0}


def _past_the_pointers(inner: Any, partition: int, ranges: Any, for_shard: ShardIdent) -> Any:
    """An iterator call that reads the other shards' ranges on to ``MAX``: past their
    commit pointers, into blocks not committed before the reading one."""
    wide = [
        r if r.shard == for_shard else QueueShardRange(r.shard, r.from_key, QueueKey.MAX)
        for r in ranges
    ]
    return inner(partition, wide, for_shard)


def _simulation(tmp_path: Path, settings: dict[str, Any], **calls: Any) -> Simulation:
    def opener(path: Path, queue_config: QueueConfig) -> Any:
        return _Wrapped(Queue.open(path, queue_config), **calls)

    return Simulation(SimConfig(directory=tmp_path, **settings), opener=opener)


def _run(tmp_path: Path, settings: dict[str, Any] | None = None, **calls: Any) -> Any:
    return _simulation(tmp_path, settings or _SHORT, **calls).run()


def _errors(result: Any) -> list[str]:
    assert not result.verified
    assert "failed state checks" in result.verdict()
    return list(result.state_errors)


class _Iterator:
    """An iterator over ``items`` (a real iterator's messages) whose position is
    ``position(real position)``."""

    def __init__(self, inner: Any, items: Iterator[IteratedMessage], position: Any) -> None:
        self._inner = inner
        self._items = items
        self._position = position

    def __iter__(self) -> _Iterator:
        return self

    def __next__(self) -> IteratedMessage:
        return next(self._items)

    def current_position(self) -> dict[ShardIdent, QueueKey]:
        return dict(self._position(self._inner.current_position()))

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> _Iterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.close()


# -- the ledger --------------------------------------------------------------------------


def test_a_message_executed_that_no_committed_block_created_is_named_phantom(
    tmp_path: Path,
) -> None:
    """The queue serves the other shards' diffs past their commit pointers (the ranges'
    ends ignored): a block executes messages of blocks not committed before it, which the
    ledger names ``phantom`` (a mutant that left phantoms unreported went unseen)."""

    result = _run(tmp_path, _CALM, iterator=_past_the_pointers)
    phantoms = [v for v in result.violations if v.kind == "phantom"]
    assert phantoms, result.verdict()
    assert "no committed block created it" in phantoms[0].detail
    assert "phantom" in result.verdict()


def test_a_message_of_a_source_not_asked_for_is_named_not_a_crash(tmp_path: Path) -> None:
    """docs/simulation.md: at every read every message lies in its source's range, and a
    failed check fails the run, is named, and the run goes on. A queue that serves a
    read one message of a shard the read did not name must get a verdict, not a crash."""
    world = World.build(_CALM["seed"], SimConfig().shards)
    reader = world.basechain[0]
    own = world.accounts(reader)
    stray = IteratedMessage(
        ShardIdent.MASTERCHAIN, Message(QueueKey(10, bytes(32)), own[0], own[1], b"")
    )
    served: list[IteratedMessage] = []

    def iterator(inner: Any, partition: int, ranges: Any, for_shard: ShardIdent) -> Any:
        it = inner(partition, ranges, for_shard)
        if served or partition != 0 or for_shard != reader:
            return it
        served.append(stray)
        return _Iterator(it, itertools.chain([stray], it), lambda position: position)

    result = _run(tmp_path, {**_CALM, "cancel_rate": 0}, iterator=iterator)
    assert served
    assert any("outside its range" in e for e in _errors(result))


def test_a_message_created_again_while_still_owed_is_named(tmp_path: Path) -> None:
    """Two committed blocks that create the same message (source and key) before anyone
    executed it: the second is a duplicate (the check looked only at delivered ones)."""
    sim = Simulation(SimConfig(directory=tmp_path, rounds=1))
    shard = sim.world.basechain[0]
    account = sim.world.accounts(shard)[0]
    message = Message(QueueKey(10**9, bytes([3]) * 32), account, account, b"x")
    sim._commit_block(BlockRecord(shard, 1, [message], [], sim.committed[shard]))
    assert not sim.result.violations
    sim._commit_block(BlockRecord(shard, 2, [message], [], sim.committed[shard]))
    assert sim.result.duplicated == 1
    (violation,) = sim.result.violations
    assert violation.kind == "duplicated" and "created again by" in violation.detail


# -- what GC leaves ------------------------------------------------------------------------


def test_gc_that_collects_nothing_leaves_messages_statistics_and_tails_all_named(
    tmp_path: Path,
) -> None:
    """GC never deletes anything (``run_gc`` does nothing; no background worker): the
    final check names a stored message, the statistics left, and the tails."""
    result = _run(tmp_path, {**_CALM, "gc_every": 3}, run_gc=lambda inner: 0)
    stored = [v for v in result.violations if v.kind == "stored"]
    assert stored and "after the final commit and GC" in stored[0].detail
    errors = _errors(result)
    assert any("remain after the final GC" in e for e in errors), errors
    assert any("stored after the final GC" in e for e in errors), errors


def test_gc_that_deletes_a_diff_record_above_its_bound_is_named(tmp_path: Path) -> None:
    """After the final GC a shard stores one diff (tail row) fewer than it committed above
    its GC bound: too few is as wrong as too many."""

    def one_short(inner: Any, shard: ShardIdent, from_key: QueueKey) -> int:
        n = int(inner(shard, from_key))
        return max(n - 1, 0) if from_key == QueueKey.MIN else n

    errors = _errors(_run(tmp_path, _CALM, get_diffs_tail_len=one_short))
    assert any("stored after the final GC" in e for e in errors), errors


def _one_shard_to_itself(tmp_path: Path) -> SimConfig:
    return SimConfig(
        directory=tmp_path,
        shards=1,
        rounds=1,
        fanout=0,
        mc_share=0,
        cancel_rate=0,
        restart_rate=0,
        reset_rate=0,
        gc_every=1,
    )


def test_the_drain_goes_on_past_the_last_delivery(tmp_path: Path) -> None:
    """docs/simulation.md: the network drains until nothing is owed, "and three more so
    that every processed_to passes every message". One shard writing only to itself
    delivers everything in the first drain round, while the masterchain's processed_to
    still lies before it: stopping there leaves the messages stored after the final GC."""
    result = Simulation(_one_shard_to_itself(tmp_path)).run()
    assert result.verified, result.verdict()
    assert result.messages_delivered == result.messages_created > 0
    assert result.drain_rounds >= 3


def test_the_drain_runs_three_rounds_after_the_one_that_owes_nothing(tmp_path: Path) -> None:
    """docs/simulation.md: the drain runs "until nothing is owed, and three more" (it
    counted the round that first owed nothing as the first of the three)."""
    result = Simulation(_one_shard_to_itself(tmp_path)).run()
    assert result.verified, result.verdict()
    first_drain = result.samples[result.rounds]  # the first drain round delivered it all
    assert sum(first_drain.committed_depth.values()) == 0
    assert sum(first_drain.uncommitted.values()) == 0
    assert result.drain_rounds == 1 + 3


# -- at reopen and after startup -------------------------------------------------------------


def test_a_reopened_queue_that_forgot_its_last_committed_block_is_named(tmp_path: Path) -> None:
    errors = _errors(_run(tmp_path, get_last_committed_mc_block_id=lambda inner: None))
    assert any("reopened: last committed block None" in e for e in errors), errors


def test_a_startup_that_keeps_the_uncommitted_diffs_is_named(tmp_path: Path) -> None:
    """``startup()`` that resets nothing: the diffs written since the last commit are still
    stored after it. The check names it, even when the run cannot go on after it."""
    sim = _simulation(tmp_path, _SHORT, startup=lambda inner, *args: None)
    with pytest.raises(DiffConflictError):  # the next collation of that seqno is refused
        sim.run()
    kept = [e for e in sim.result.state_errors if "startup kept the uncommitted diff" in e]
    assert kept, sim.result.state_errors


# -- right after each commit -------------------------------------------------------------------


def _altered(field: str, value: Any) -> Any:
    if field == "hash":
        return bytes(b ^ 0xFF for b in value)
    if field == "max_message":
        return value.next_value()
    if field == "processed_to":
        return {**value, ShardIdent.MASTERCHAIN: QueueKey.MAX}
    return value + 1  # seqno


@pytest.mark.parametrize("field", ["hash", "max_message", "processed_to", "seqno"])
def test_a_committed_diff_stored_with_one_field_changed_is_named(
    tmp_path: Path, field: str
) -> None:
    """Each field the run compares (seqno, hash, max message, processed_to) is compared:
    one changed alone fails the run (a mutant that dropped any one of them went unseen)."""

    def get_diff_info(inner: Any, shard: ShardIdent, seqno: int, zone: DiffZone) -> Any:
        info = inner(shard, seqno, zone)
        if info is None or zone != DiffZone.COMMITTED:
            return info
        return dataclasses.replace(info, **{field: _altered(field, getattr(info, field))})

    errors = _errors(_run(tmp_path, _CALM, get_diff_info=get_diff_info))
    assert errors[0].startswith("committed diff of "), errors[0]


@pytest.mark.parametrize("fault", ["greater_than", "at_most_one"])
def test_tail_lengths_right_after_a_commit_are_checked(tmp_path: Path, fault: str) -> None:
    """``get_diffs_tail_len`` from a diff's own max message counts that diff (``>=``), and
    from the first diff of a commit counts all of them: a tail counting ``>`` fails the
    first comparison, one that never counts more than one diff the second."""

    def tail(inner: Any, shard: ShardIdent, from_key: QueueKey) -> int:
        if from_key == QueueKey.MIN:
            return int(inner(shard, from_key))
        if fault == "greater_than":
            return int(inner(shard, from_key.next_value()))
        return min(int(inner(shard, from_key)), 1)

    errors = _errors(_run(tmp_path, _CALM, get_diffs_tail_len=tail))
    assert any(
        e.startswith("get_diffs_tail_len(") and "right after the commit" in e for e in errors
    )


def _above_pointer(inner: Any, shard: ShardIdent) -> QueueKey:
    """The first key above ``shard``'s commit pointer (``MIN`` without one)."""
    pointer = inner.__self__.get_commit_pointers().get(shard)
    return QueueKey.MIN if pointer is None else pointer.key.next_value()


@pytest.mark.parametrize("call", ["get_diffs_tail_len", "load_diff_statistics"])
def test_reads_that_leave_out_the_uncommitted_zone_are_named(tmp_path: Path, call: str) -> None:
    """A tail length, or statistics, of the committed diffs only (the contract counts both
    zones) passed the run "verified" (an outside audit, stop 54): every check of them ran
    right after a commit or at the end, with nothing uncommitted in range. They are now
    checked right after each write too."""

    def tail(inner: Any, shard: ShardIdent, from_key: QueueKey) -> int:
        above = max(from_key, _above_pointer(inner, shard))
        return int(inner(shard, from_key)) - int(inner(shard, above))

    def stats(inner: Any, partition: int, r: QueueShardRange) -> Any:
        end = min(r.to_key, _above_pointer(inner, r.shard))
        return inner(partition, QueueShardRange(r.shard, r.from_key, max(end, r.from_key)))

    faults = {"get_diffs_tail_len": tail, "load_diff_statistics": stats}
    errors = _errors(_run(tmp_path, _CALM, **{call: faults[call]}))
    named = "get_diffs_tail_len(" if call == "get_diffs_tail_len" else "statistics of "
    assert any(e.startswith(named) and "uncommitted" in e for e in errors), errors[:3]


# -- at every read -------------------------------------------------------------------------


def test_a_read_that_ignores_where_its_ranges_start_is_named(tmp_path: Path) -> None:
    def from_the_start(inner: Any, partition: int, ranges: Any, for_shard: ShardIdent) -> Any:
        wide = [QueueShardRange(r.shard, QueueKey.MIN, r.to_key) for r in ranges]
        return inner(partition, wide, for_shard)

    result = _run(tmp_path, {**_CALM, "gc_every": 1000}, iterator=from_the_start)
    assert any("outside its range" in e for e in _errors(result))


def test_a_position_past_the_next_message_is_named(tmp_path: Path) -> None:
    """A collator takes its processed_to from the position: one that has passed a message
    not yielded yet (here: every source's end) would skip it."""

    def ahead(inner: Any, partition: int, ranges: Any, for_shard: ShardIdent) -> Any:
        it = inner(partition, ranges, for_shard)
        return _Iterator(it, iter(it), lambda position: dict.fromkeys(position, QueueKey.MAX))

    result = _run(tmp_path, {**_CALM, "read_limit": 4}, iterator=ahead)
    assert any("past the message" in e and "not read yet" in e for e in _errors(result))


def test_a_range_end_that_is_included_is_named(tmp_path: Path) -> None:
    def inclusive(inner: Any, partition: int, ranges: Any, for_shard: ShardIdent) -> Any:
        wider = [QueueShardRange(r.shard, r.from_key, r.to_key.next_value()) for r in ranges]
        return inner(partition, wider, for_shard)

    result = _run(tmp_path, _CALM, iterator=inclusive)
    assert any("yielded the message at" in e for e in _errors(result))


# -- each round ------------------------------------------------------------------------------


def test_commit_pointers_that_differ_in_a_round_are_named(tmp_path: Path) -> None:
    """Pointers one seqno ahead (the keys right, so the collators read as before): the
    round's own check names them, not only the check at a reopen."""

    def ahead(inner: Any) -> dict[ShardIdent, CommitPointer]:
        return {s: CommitPointer(p.key, p.seqno + 1) for s, p in inner().items()}

    errors = _errors(_run(tmp_path, _CALM, get_commit_pointers=ahead))
    assert any(e.startswith("round ") and "commit pointers" in e for e in errors), errors


# -- nodes -----------------------------------------------------------------------------------


def test_a_node_whose_last_committed_block_differs_is_named(tmp_path: Path) -> None:
    def opener(path: Path, queue_config: QueueConfig) -> Any:
        queue = Queue.open(path, queue_config)
        if path.name != "queue-node1":
            return queue
        return _Wrapped(queue, get_last_committed_mc_block_id=lambda inner: None)

    config = SimConfig(directory=tmp_path, nodes=2, **_CALM)
    result = Simulation(config, opener=opener).run()
    assert not result.verified
    assert any(
        "last committed block differ from node 0's (after the final GC)" in d
        for d in result.disagreements
    ), result.disagreements


# -- the collators' clocks ----------------------------------------------------------------


def test_a_block_starts_past_every_lt_its_collator_read(tmp_path: Path) -> None:
    """docs/simulation.md: a block starts past both its own clock and every lt it read
    (an lt is a causal clock: a message sent on is later than the one that caused it).
    The read limit is above any block's reads here, so every message read is taken."""
    read_max: dict[ShardIdent, int] = {}
    starts: list[tuple[int, int]] = []

    def iterator(inner: Any, partition: int, ranges: Any, for_shard: ShardIdent) -> Any:
        it = inner(partition, ranges, for_shard)

        def seen() -> Iterator[IteratedMessage]:
            for item in it:
                lt = item.message.key.lt
                read_max[for_shard] = max(read_max.get(for_shard, 0), lt)
                yield item

        return _Iterator(it, seen(), lambda position: position)

    def prepare_diff(inner: Any, diff: Any, block: Any, *args: Any) -> Any:
        starts.append((diff.start_lt, read_max.pop(block.shard, 0)))
        return inner(diff, block, *args)

    settings = {**_CALM, "read_limit": 100_000}
    result = _run(tmp_path, settings, iterator=iterator, prepare_diff=prepare_diff)
    assert result.verified, result.verdict()
    assert any(read for _, read in starts)
    assert all(start > read for start, read in starts), [x for x in starts if x[0] <= x[1]]


# -- the verdict and the report ----------------------------------------------------------------


def test_the_verdict_line_counts_and_names_the_first_failed_state_check(tmp_path: Path) -> None:
    """docs/simulation.md: failed state checks are counted in the verdict line and, when
    no delivery violation is named first, the first one is named."""

    def ahead(inner: Any) -> dict[ShardIdent, CommitPointer]:
        return {s: CommitPointer(p.key, p.seqno + 1) for s, p in inner().items()}

    result = _run(tmp_path, _CALM, get_commit_pointers=ahead)
    assert not result.violations and result.state_errors
    verdict = result.verdict()
    assert verdict.startswith("exactly-once: VIOLATED, ")
    assert f"{len(result.state_errors):,} failed state checks" in verdict
    assert verdict.endswith(f"; first failed state check: {result.state_errors[0]}")
    assert to_json(result)["verified"] is False


def test_the_verdict_line_names_the_first_violation(tmp_path: Path) -> None:
    result = _run(tmp_path, _CALM, iterator=_past_the_pointers)
    assert result.violations
    assert result.verdict().endswith(f"; first: {result.violations[0]}")


def test_the_run_counts_its_commits(tmp_path: Path) -> None:
    result = _run(tmp_path, _CALM)
    assert result.verified, result.verdict()
    assert result.commits == len(result.latencies["commit_diff"]) > 0
    assert to_json(result)["commits"] == result.commits


def test_the_report_gives_each_count_under_its_own_name(tmp_path: Path) -> None:
    """The table and ``report.json`` show the run's counts, each under its own name: a
    result whose counts all differ is told back as it is."""
    result = SimResult(
        SimConfig(directory=tmp_path),
        messages_created=11,
        messages_delivered=7,
        lost=3,
        duplicated=2,
        commits=5,
        state_checks=13,
        state_errors=["first", "second"],
    )
    doc = to_json(result)
    assert (doc["lost"], doc["duplicated"], doc["commits"]) == (3, 2, 5)
    assert (doc["messages_created"], doc["messages_delivered"]) == (11, 7)
    assert doc["verified"] is False and doc["state_errors"] == ["first", "second"]
    rows = dict(summary_rows(result))
    assert rows["messages created"] == "11" and rows["messages delivered"] == "7"
    assert rows["queue state checks failed / made"].startswith("2 / 13 ")


def test_the_busiest_router_moves_accounts_with_three_messages() -> None:
    """docs/simulation.md: the router moves the two busiest destination accounts of the
    block "(3 or more messages)" to partition 1."""
    world = World.build(1, 2)
    a, b, c = world.accounts(world.basechain[0])[:3]
    router = busiest_router({a: 3, b: 5, c: 2}, threshold=3, top=2)
    assert router.partition_for(a, a) == 1 and router.partition_for(b, b) == 1
    assert router.partition_for(c, c) == 0


@pytest.mark.parametrize("n", [0, 3, 6, 512])
def test_shards_that_cannot_split_the_workchain_evenly_are_refused(n: int) -> None:
    """docs/simulation.md: the N basechain shards are prefixes that split workchain 0
    evenly, so N is a power of two (3 shards would leave part of it to none)."""
    with pytest.raises(ValueError, match="power of two"):
        World.build(1, n)


def test_clean_runs_under_every_fault_wrapper_pass_through(tmp_path: Path) -> None:
    """The wrappers above change nothing when they replace nothing."""
    result = _run(tmp_path, _CALM)
    assert result.verified, result.verdict()


def test_the_child_queues_iterator_ends_at_the_position_the_real_one_ended_at() -> None:
    """``ChildQueue`` (``imq simulate --kill``) replays a child's iterator from its
    messages and positions: once exhausted, ``current_position()`` is the position the
    real iterator had at its end (past rows skipped after the last message), not the
    one after the last message (a mutant kept the latter and no test saw it)."""
    shard = ShardIdent(0, 1 << 63)
    first, skipped = QueueKey(10, bytes(32)), QueueKey(20, bytes(32))
    account = World.build(1, 2).accounts(shard)[0]
    item = IteratedMessage(shard, Message(first, account, account, b""))
    it = _ListIterator([(item, {shard: first})], {shard: skipped})
    assert next(it) is item
    assert it.current_position() == {shard: first}
    assert next(it, None) is None
    assert it.current_position() == {shard: skipped}
