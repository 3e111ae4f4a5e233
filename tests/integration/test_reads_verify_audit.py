"""Tests from a mutation audit of ``imq/reads.py``, ``imq/queue_reads.py``,
``imq/verify.py`` and ``imq/delete.py``: each pins a rule of the docs that a small
change to that code broke without any other test failing.

Real RocksDB in ``tmp_path``; verify's fixtures come from ``test_verify.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from builders import (
    MC,
    Applied,
    Chain,
    address_in,
    full_range,
    iterate_all,
    open_queue,
    quarter_shards,
    quiet_config,
    top,
)
from test_verify import _build, _gc_inside_a_diff, _tamper

from imq import PartitionRouter, Queue, QueueClosedError, QueueKey
from imq.observability import capture_events
from imq.storage import Table, codec
from imq.types import CommitPointer
from imq.verify import verify

SHARDS = quarter_shards()
LEFT, RIGHT = SHARDS[0], SHARDS[1]


# -- reads ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seqno", [True, False])
def test_get_diff_info_refuses_a_bool_seqno(tmp_path: Path, seqno: bool) -> None:
    """api.md conventions: a value of the wrong type is a ``TypeError``; a seqno is a
    u32 int. ``True`` is an int to ``isinstance`` and would read the diff of seqno 1."""
    with open_queue(tmp_path / "db") as q:
        Chain(q).apply(LEFT, 2)
        with pytest.raises(TypeError, match="seqno must be an int, got bool"):
            q.get_diff_info(LEFT, seqno)


def test_summary_shows_the_executed_bound_apart_from_a_higher_requested_one(
    tmp_path: Path,
) -> None:
    """api.md ``summary()`` and ``gc_bounds()``: the GC entry of a (partition, shard)
    gives its requested bound and its executed bound, each as stored; after a commit
    that raised the requested bound and before GC ran, the two differ."""
    with open_queue(tmp_path / "db") as q:
        chain = Chain(q)
        first = chain.apply(LEFT, 3)
        chain.apply(MC, 0, processed_to={LEFT: first.max_message})
        q.commit_diff([top(MC, 1), top(LEFT, 1, 1)])
        q.run_gc()
        second = chain.apply(LEFT, 3)
        chain.apply(MC, 0, processed_to={LEFT: second.max_message})
        q.commit_diff([top(MC, 2), top(LEFT, 2, 2)])
        requested, executed = q.gc_bounds()
        assert requested[(0, LEFT)] == second.max_message
        assert executed[(0, LEFT)] == first.max_message
        gc = q.summary()["gc"][f"0/{LEFT}"]
    assert gc == {
        "requested": second.max_message.to_json(),
        "executed": first.max_message.to_json(),
    }


def test_summary_of_a_shard_whose_only_diff_is_seqno_zero(tmp_path: Path) -> None:
    """api.md ``summary()``: per shard, the seqnos of its stored diffs (lowest, highest);
    seqno 0 is a diff like any other (D5), so a shard holding only it shows ``[0, 0]``."""
    with open_queue(tmp_path / "db") as q:
        Chain(q).apply(LEFT, 2, seqno=0)
        entry = q.summary()["shards"][str(LEFT)]
    assert entry["seqnos"] == [0, 0]
    assert entry["diffs"] == 1


def test_changing_what_commit_record_returns_changes_nothing_in_the_queue(
    tmp_path: Path,
) -> None:
    """behaviour.md 5.6 (reads take no lock and change nothing) and D7 (the commit record
    is the queue's, persisted with the commit): ``commit_record()`` hands out a copy, at
    both levels, as ``get_commit_pointers()`` does."""
    with open_queue(tmp_path / "db") as q:
        chain = Chain(q)
        first = chain.apply(LEFT, 3)
        chain.apply(MC, 0, processed_to={LEFT: first.max_message})
        q.commit_diff([top(MC, 1), top(LEFT, 1, 1)])
        before = {top_shard: dict(entries) for top_shard, entries in q.commit_record().items()}
        assert before == {MC: {LEFT: first.max_message}, LEFT: {}}
        got = q.commit_record()
        got[MC][LEFT] = QueueKey.MAX
        got[RIGHT] = {}
        assert q.commit_record() == before
        got.clear()
        assert q.commit_record() == before


ADDITIONS: dict[str, Callable[[Queue], Any]] = {
    "gc_bounds": lambda q: q.gc_bounds(),
    "commit_record": lambda q: q.commit_record(),
    "summary": lambda q: q.summary(),
    "unfinished_import": lambda q: q.unfinished_import(),
    "message_cache_stats": lambda q: q.message_cache_stats(),
}


@pytest.mark.parametrize("method", sorted(ADDITIONS))
def test_imqs_read_additions_after_close_raise(tmp_path: Path, method: str) -> None:
    """behaviour.md 5.9: any call on a closed queue raises ``QueueClosedError``
    (``test_lifecycle.py`` covers the original's calls; these are imq's additions)."""
    q = open_queue(tmp_path / "db")
    Chain(q).apply(LEFT, 2)
    ADDITIONS[method](q)  # works while open
    q.close()
    with pytest.raises(QueueClosedError):
        ADDITIONS[method](q)


def test_an_iterator_created_while_close_runs_raises_queue_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """api.md (``QueueIterator``): ``Queue.iterator()`` racing a ``close()`` in another
    thread raises ``QueueClosedError``. Forced here: ``close()`` starts between the
    iterator's snapshot and its registration, and has marked the store closed (so it
    may not see the new iterator) before the registration; the call must not hand out
    an iterator over a closed queue."""
    q = open_queue(tmp_path / "db")
    Chain(q).apply(LEFT, [address_in(RIGHT, 1)])
    store = q._store
    register = store.register
    closer = threading.Thread(target=q.close)

    def register_during_close(resource: Any) -> None:
        closer.start()
        while not store.closed:  # close() marks the store closed first
            time.sleep(0.001)
        register(resource)

    monkeypatch.setattr(store, "register", register_during_close)
    try:
        with pytest.raises(QueueClosedError):
            q.iterator(0, [full_range(LEFT)], RIGHT)
    finally:
        closer.join()
    assert q.closed


# -- verify: GC bounds per partition and per shard -----------------------------------------------


def _two_partition_bounds(path: Path) -> tuple[QueueKey, QueueKey]:
    """LEFT diff 1 sends two messages to HOT (partition 1) and two to others. A first
    commit (both partitions) requests a bound below the diff (``low``); a second, for
    partition 0 only, one at its ``max_message``. GC collects the diff's records with
    partition 0's rows; partition 1 keeps its rows under its own, lower, bound, and
    LEFT's pointer names the collected diff. Returns (``low``, the diff's max)."""
    hot = address_in(RIGHT, 9)
    low = QueueKey(5, bytes(32))
    with open_queue(path) as q:
        chain = Chain(q)
        router = PartitionRouter(dst={1: [hot]})
        first = chain.apply(
            LEFT, [address_in(LEFT, 1), hot, address_in(LEFT, 2), hot], router=router
        )
        chain.apply(MC, 0, processed_to={LEFT: low})
        q.commit_diff([top(MC, 1), top(LEFT, 1, 1)], partitions=(0, 1))
        q.run_gc()
        chain.apply(MC, 0, processed_to={LEFT: first.max_message})
        q.commit_diff([top(MC, 2)], partitions=(0,))
        q.run_gc()
        assert q.get_diff_info(LEFT, 1) is None
        assert q.get_commit_pointers()[LEFT] == CommitPointer(first.max_message, 1)
        assert q.load_diff_statistics(1, full_range(LEFT)) == {hot: 2}
        requested, executed = q.gc_bounds()
        assert requested[(0, LEFT)] == executed[(0, LEFT)] == first.max_message
        assert requested[(1, LEFT)] == executed[(1, LEFT)] == low
    return low, first.max_message


def test_rows_below_the_highest_partitions_bound_are_no_problem(tmp_path: Path) -> None:
    """docs/reliability.md, integrity checks: statistics rows and messages of no stored
    diff are a problem only above every GC bound of their shard, and a pointer naming a
    collected diff is explained by a GC bound of its shard: the highest of the shard's
    partitions' bounds (GC deletes a diff's records once any partition's bound passes
    it), not the lowest."""
    db = tmp_path / "db"
    _two_partition_bounds(db)
    report = verify(db)
    assert report.ok, report.problems
    assert report.rows["statistics"] == 1
    assert report.rows["messages"] == 2


def test_an_executed_bound_above_a_later_requested_one_still_explains_gc(tmp_path: Path) -> None:
    """verify.py ``_gc_reach`` (docs/reliability.md: a GC bound, requested or executed):
    a later masterchain block reading less lowers the requested bound below the executed
    one (D7); what the executed bound collected is gone all the same, so the pointer
    naming the collected diff and partition 1's leftover rows are no problem."""
    db = tmp_path / "db"
    low, high = _two_partition_bounds(db)
    with open_queue(db) as q:
        Chain(q).apply(MC, 0, seqno=3, processed_to={LEFT: low})
        q.commit_diff([top(MC, 3)], partitions=(0,))
        requested, executed = q.gc_bounds()
        assert requested[(0, LEFT)] == low
        assert executed[(0, LEFT)] == high
    report = verify(db)
    assert report.ok, report.problems


def _split_diff(q: Queue, to_partition_1: list[bool], read_to: int) -> Applied:
    """LEFT diff 1, committed, of one message per flag: to a RIGHT account the router
    sends to partition 1 where the flag is set, else to a LEFT account (partition 0);
    the masterchain reads partition 0 up to message ``read_to``."""
    hot, other = address_in(RIGHT, 9), address_in(LEFT, 1)
    chain = Chain(q)
    router = PartitionRouter(dst={1: [hot]})
    first = chain.apply(LEFT, [hot if f else other for f in to_partition_1], router=router)
    chain.apply(MC, 0, processed_to={LEFT: first.messages[read_to].key})
    q.commit_diff([top(MC, 1), top(LEFT, 1, 1)], partitions=(0,))
    return first


def test_a_lost_message_of_a_partition_no_gc_bound_reaches_is_reported(tmp_path: Path) -> None:
    """docs/reliability.md and verify.py: a diff's messages are counted per partition
    against the partition's own GC bound. Partition 0's bound lies inside LEFT diff 1's
    span (only an excess shows there); partition 1 has no bound, so a partition 1
    message lost inside the same span is reported."""
    db = tmp_path / "db"
    with open_queue(db) as q:
        first = _split_diff(q, [False, True, False, True, False, True], read_to=2)
        q.run_gc()
        assert q.gc_bounds()[1] == {(0, LEFT): first.messages[2].key}
        assert len(iterate_all(q, [LEFT], partition=1, for_shard=RIGHT)) == 3
    assert verify(db).ok
    lost = codec.message_key(1, LEFT, first.messages[5].key)
    _tamper(db, lambda t: t.delete(Table.MESSAGES, lost))
    assert verify(db).problems == [
        f"diff {LEFT}:1 partition 1: 2 messages stored in its span, the diff record says 3"
    ]


def test_a_span_gc_reached_with_every_message_of_a_partition_kept_is_no_problem(
    tmp_path: Path,
) -> None:
    """verify.py ``_count_problem``: inside or above a diff's span only *more* messages
    than the diff stored is a problem. Partition 0's GC bound sits at LEFT diff 1's first
    message, which went to partition 1: GC deleted none of partition 0's rows, so all
    of them are there (as many as stored), which is sound."""
    db = tmp_path / "db"
    with open_queue(db) as q:
        first = _split_diff(q, [True, False, False], read_to=0)
        assert q.run_gc_report().messages == 0
        assert q.gc_bounds()[1] == {(0, LEFT): first.diff.min_message}
    report = verify(db)
    assert report.ok, report.problems


def test_a_diffs_lost_statistics_row_is_reported(tmp_path: Path) -> None:
    """verify.py module docstring (the statistics of each diff count as many messages as
    the diff stored) and docs/reliability.md (statistics per diff and partition <-> the
    diff's stored message count): a diff whose statistics row is gone counts 0 of its
    20 messages, with no GC bound to explain it."""
    db = tmp_path / "db"
    chain = _build(db)
    first = next(a for a in chain.applied if a.shard == LEFT)
    row = codec.stat_key(LEFT, 0, first.diff.max_message, first.seqno)
    _tamper(db, lambda t: t.delete(Table.STATISTICS, row))
    assert verify(db).problems == [
        f"diff {LEFT}:1 partition 0: statistics count 0 messages, the diff stored 20"
    ]


def test_a_pointer_is_excused_only_by_a_gc_bound_of_its_own_shard(tmp_path: Path) -> None:
    """docs/reliability.md: each commit pointer <-> the diff it names, or a GC bound *of
    its shard* that explains a collected diff. LEFT has a GC bound; RIGHT has none, so a
    RIGHT pointer naming a missing diff is reported even below LEFT's bound."""
    db = tmp_path / "db"
    bound, _ = _gc_inside_a_diff(db)
    wrong = CommitPointer(QueueKey(bound.lt - 1, bytes(32)), 99)
    _tamper(
        db,
        lambda t: t.put(
            Table.COMMIT_POINTERS, codec.shard_bytes(RIGHT), codec.pointer_value(wrong)
        ),
    )
    assert verify(db).problems == [
        f"commit pointer of {RIGHT} names diff 99, which is not stored and no GC bound of "
        "the shard reaches it"
    ]


def test_a_pointer_above_its_shards_gc_bound_naming_no_diff_is_reported(tmp_path: Path) -> None:
    """docs/reliability.md: a GC bound explains a pointer's missing diff only when it
    reaches the pointer's key. LEFT's bound lies below this pointer."""
    db = tmp_path / "db"
    bound, _ = _gc_inside_a_diff(db)
    wrong = CommitPointer(QueueKey(10**9, bytes(32)), 99)
    assert wrong.key > bound
    _tamper(
        db,
        lambda t: t.put(Table.COMMIT_POINTERS, codec.shard_bytes(LEFT), codec.pointer_value(wrong)),
    )
    assert verify(db).problems == [
        f"commit pointer of {LEFT} names diff 99, which is not stored and no GC bound of "
        "the shard reaches it"
    ]


def test_a_single_stray_message_in_a_shard_without_gc_bounds_is_reported(tmp_path: Path) -> None:
    """docs/reliability.md: messages of no stored diff above every GC bound of their
    shard are a problem; a shard with no bound at all has every stray above them, one
    stray included."""
    db = tmp_path / "db"
    _build(db)
    with open_queue(db) as q:
        assert q.gc_bounds() == ({}, {})
    stray = codec.message_key(0, LEFT, QueueKey(10**12, bytes(32)))
    _tamper(db, lambda t: t.put(Table.MESSAGES, stray, b"x"))
    assert verify(db).problems == [
        "1 stored messages belong to no stored diff (above every GC bound of their shard)"
    ]


def test_a_partition_above_255_verifies_clean(tmp_path: Path) -> None:
    """api.md: partitions are ints in 0..=65535; formats.md: the partition is 2 bytes of
    the message and statistics keys. A sound queue whose diff writes into partition 256
    verifies clean (its rows counted under 256, not 0)."""
    db = tmp_path / "db"
    hot = address_in(RIGHT, 9)
    with open_queue(db) as q:
        router = PartitionRouter(dst={256: [hot]})
        Chain(q).apply(LEFT, [address_in(LEFT, 1), hot, hot], router=router)
        assert q.load_diff_statistics(256, full_range(LEFT)) == {hot: 2}
    report = verify(db)
    assert report.ok, report.problems
    assert report.rows["messages"] == 3


def test_a_seqno_above_65535_verifies_clean(tmp_path: Path) -> None:
    """api.md: a seqno is a u32; formats.md: it is the last 4 bytes of the statistics
    key. A sound queue with a diff of seqno 70,000 verifies clean."""
    db = tmp_path / "db"
    with open_queue(db) as q:
        Chain(q).apply(LEFT, 3, seqno=70_000)
    report = verify(db)
    assert report.ok, report.problems


def test_open_does_not_warn_of_a_pointer_whose_diff_gc_collected(tmp_path: Path) -> None:
    """verify.py module docstring and docs/reliability.md (*At open*): the open-time
    check accepts a pointer whose diff GC collected when a GC bound of its shard,
    executed *or requested*, reaches it; a crash between a pass's deletes and its mark
    leaves the bound only requested."""
    db = tmp_path / "db"
    _two_partition_bounds(db)
    with capture_events() as events:
        Queue.open(db, read_only=True).close()
    assert [e["problem"] for e in events if e["event"] == "integrity_check_failed"] == []
    # GC off: a worker's tick at this open would run the due pass and mark it again
    with Queue.open(db, quiet_config(gc_enabled=False)) as q:
        txn = q._store.transaction()
        txn.delete(Table.VARS, codec.GC_EXECUTED)
        q._store.write(txn)
    with capture_events() as events, Queue.open(db, read_only=True) as q:
        assert q.gc_bounds()[1] == {}
    assert [e["problem"] for e in events if e["event"] == "integrity_check_failed"] == []


# -- delete ---------------------------------------------------------------------------------------


def test_clear_of_a_seqno_zero_diff_clears_every_partition_it_wrote(tmp_path: Path) -> None:
    """behaviour.md 5.4 and I3: clear deletes the cleared diffs' rows in every partition
    they wrote into, beyond the requested ones; D5: a diff of seqno 0 is deleted like
    any other."""
    hot = address_in(RIGHT, 9)
    with open_queue(tmp_path / "db") as q:
        router = PartitionRouter(dst={1: [hot]})
        Chain(q).apply(LEFT, [address_in(LEFT, 1), hot, hot], seqno=0, router=router)
        q.clear_uncommitted_state(partitions=(0,), top_shards=[LEFT])
        assert q.get_diff_info(LEFT, 0) is None
        assert iterate_all(q, [LEFT], partition=1, for_shard=RIGHT) == []
        assert q.load_diff_statistics(1, full_range(LEFT)) == {}


BAD_PARTITIONS = [(-1, ValueError, "0..=65535"), (65536, ValueError, "0..=65535")]
BAD_PARTITIONS += [(True, TypeError, "must be an int, got bool")]
PARTITION_READS: dict[str, Callable[[Queue, Any], Any]] = {
    "iterator": lambda q, p: list(q.iterator(p, [full_range(LEFT)], RIGHT)),
    "load_diff_statistics": lambda q, p: q.load_diff_statistics(p, full_range(LEFT)),
}


@pytest.mark.parametrize("read", sorted(PARTITION_READS))
@pytest.mark.parametrize(("partition", "error", "text"), BAD_PARTITIONS)
def test_a_read_refuses_a_partition_outside_u16_or_of_the_wrong_type(
    tmp_path: Path, read: str, partition: object, error: type[Exception], text: str
) -> None:
    """api.md: partitions are plain ints in ``0..=65535``; invalid values raise
    ``ValueError``, values of the wrong type ``TypeError`` (a ``bool`` would read
    partition 0 or 1, a negative one fail inside the key encoder)."""
    with open_queue(tmp_path / "db") as q:
        Chain(q).apply(LEFT, [address_in(RIGHT, 1)])
        with pytest.raises(error, match=text):
            PARTITION_READS[read](q, partition)


def test_a_message_in_a_partition_the_diff_never_wrote_is_reported(tmp_path: Path) -> None:
    """docs/reliability.md (integrity checks: the diff's stored message count <-> the
    messages inside its key span) and verify.py (a message outside every stored diff is
    a problem above its shard's bounds, and in a span only what the diff stored is
    explained): LEFT diff 1 wrote its 20 messages into partition 0 and none into
    partition 1, and no GC bound exists. A partition 1 row inside diff 1's span is a
    message no diff stored, yet ``verify`` reports the queue sound."""
    db = tmp_path / "db"
    chain = _build(db)
    first = next(a for a in chain.applied if a.shard == LEFT)
    inside = QueueKey(first.messages[3].key.lt, bytes([0xEE]) * 32)
    assert first.diff.min_message < inside < first.diff.max_message
    assert verify(db).ok
    extra = codec.message_key(1, LEFT, inside)
    _tamper(db, lambda t: t.put(Table.MESSAGES, extra, b"x"))
    report = verify(db)
    assert report.rows["messages"] == 3 * 4 * 20 + 1
    assert not report.ok, "a partition 1 row no diff stored passed verify"
    assert any(f"{LEFT}:1 partition 1" in p for p in report.problems), report.problems


def test_statistics_of_a_partition_the_diff_never_wrote_are_reported(tmp_path: Path) -> None:
    """verify.py module docstring (the statistics of each diff count as many messages as
    the diff stored) and docs/reliability.md (statistics per diff and partition <-> the
    diff's stored message count): LEFT diff 1 stored 20 messages in partition 0 and none
    in partition 1. A partition 1 statistics row under diff 1's key (a copy of its
    partition 0 row) makes ``load_diff_statistics(1, ...)`` report 20 messages that do
    not exist, yet ``verify`` reports the queue sound."""
    db = tmp_path / "db"
    chain = _build(db)
    first = next(a for a in chain.applied if a.shard == LEFT)
    row0 = codec.stat_key(LEFT, 0, first.diff.max_message, first.seqno)
    with open_queue(db) as q:
        value = dict(q._store.load_table(Table.STATISTICS))[row0]
    row1 = codec.stat_key(LEFT, 1, first.diff.max_message, first.seqno)
    _tamper(db, lambda t: t.put(Table.STATISTICS, row1, value))
    with open_queue(db) as q:
        assert sum(q.load_diff_statistics(1, full_range(LEFT)).values()) == 20
    report = verify(db)
    assert not report.ok, "a statistics row of a partition the diff never wrote passed verify"
    assert any(f"{LEFT}:1 partition 1" in p for p in report.problems), report.problems
