"""Garbage collection on a real RocksDB (SEMANTICS §7, §8 with D4, D5, D7, D8, D9).

What a deletion removes and what it must not touch, per-partition bounds, bounds that
never re-run, the idle-shard bound of D7, persistence across reopen, failures that are
retried, the background worker's life cycle, GC beside concurrent writers and readers,
and space coming back after compaction.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from builders import (
    BASE,
    MC,
    Applied,
    Chain,
    Clock,
    address_in,
    block,
    diff_hash,
    dump,
    full_range,
    iterate_all,
    key,
    make_diff,
    message,
    message_keys,
    quiet_config,
    rows,
    shard_rows,
    split_shard,
    top,
)
from threads import guarded as guarded_by

from imq import (
    Address,
    DiffZone,
    GcReport,
    ImqError,
    IteratedMessage,
    Message,
    PartitionRouter,
    Queue,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    StorageError,
)
from imq.gc import GarbageCollector
from imq.observability import get_logger
from imq.storage import Table, codec, rocks
from imq.verify import verify

A = split_shard(0, 1, 0)
B = split_shard(0, 1, 1)
HOT = address_in(B, 77)  # routed to partition 1 by destination
Logs = list[MutableMapping[str, Any]]
WAIT = 10.0  # seconds: generous bound for anything a background thread must do


def open_gc_queue(path: Path, **overrides: Any) -> Queue:
    """A queue with the background worker on; a long interval, so only the tick at open
    and explicit ``tick`` calls run passes."""
    return Queue.open(path, quiet_config(gc_enabled=True, **overrides))


def worker(queue: Queue) -> Any:
    assert queue.gc_worker is not None
    return queue.gc_worker


def wait_for(condition: Callable[[], bool], timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def apply_keys(
    chain: Chain,
    shard: ShardIdent,
    keys: Sequence[QueueKey],
    dsts: Sequence[Address] | None = None,
    *,
    processed_to: dict[ShardIdent, QueueKey] | None = None,
    router: PartitionRouter | None = None,
    seqno: int | None = None,
) -> Applied:
    """Apply a diff of ``shard`` whose messages sit at exactly ``keys``."""
    dsts = dsts or [address_in(shard, 900 + i) for i in range(len(keys))]
    msgs = [
        message(k, address_in(shard, i % 3), d)
        for i, (k, d) in enumerate(zip(keys, dsts, strict=True))
    ]
    if seqno is None:
        seqno = max((a.seqno for a in chain.of(shard)), default=0) + 1
    applied = Applied(
        block(shard, seqno), make_diff(msgs, processed_to, router), diff_hash((shard, seqno))
    )
    assert chain.queue.apply_diff(applied.diff, applied.block, applied.hash)
    chain.record(applied)
    return applied


def commit(
    queue: Queue,
    mc: Applied,
    *tops: Applied,
    idle: Sequence[Applied] = (),
    partitions: Sequence[int] = (0, 1),
) -> None:
    """Commit on ``mc`` with ``tops`` as updated top blocks and ``idle`` as unchanged ones."""
    blocks = [mc.top(), *(t.top(mc.seqno) for t in tops)]
    blocks += [t.top(mc.seqno, updated=False) for t in idle]
    assert queue.commit_diff(blocks, partitions) is True


def stat_rows_of(queue: Queue, shard: ShardIdent) -> list[tuple[QueueKey, int]]:
    """(diff max_message, partition) of every statistics row of ``shard``, from the key
    prefix alone (the destinations are read through the public API)."""
    out = []
    for k, _v in shard_rows(queue, Table.STATISTICS, shard):
        partition = int.from_bytes(k[codec.SHARD_LEN : codec.SHARD_LEN + 2], "big")
        out.append((codec.decode_key(k[codec.SHARD_LEN + 2 : codec.STAT_PREFIX_LEN]), partition))
    return out


def tail_rows_of(queue: Queue, shard: ShardIdent) -> list[tuple[QueueKey, int]]:
    return [codec.decode_tail_key(k) for k, _ in shard_rows(queue, Table.DIFF_TAIL, shard)]


def info_seqnos(queue: Queue, shard: ShardIdent) -> list[int]:
    return [codec.decode_diff_info_seqno(k) for k, _ in shard_rows(queue, Table.DIFF_INFO, shard)]


def events(logs: Logs, name: str) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == name]


def keys_of(*applied: Applied) -> list[QueueKey]:
    return [m.key for a in applied for m in a.messages]


# -- what a deletion removes ------------------------------------------------------------------


def test_deletion_is_inclusive_of_the_bound_and_touches_nothing_above(
    queue: Queue, chain: Chain
) -> None:
    bound = key(5000)
    b1 = chain.apply(B, 2)  # another shard: no bound, never touched
    a1 = apply_keys(chain, A, [key(1000), key(1010)])
    a2 = apply_keys(chain, A, [key(1020), bound])  # ends exactly on the bound
    a3 = apply_keys(chain, A, [bound.next_value(), key(6000)])  # starts right above it
    above = apply_keys(chain, A, [key(7000), key(8000)])
    pt = {A: bound}
    mc = chain.apply(MC, 0, processed_to=pt)
    a4 = apply_keys(chain, A, [key(9000)], processed_to=pt)
    commit(queue, mc, a4)
    infos = {s: queue.get_diff_info(A, s) for s in (3, 4, 5)}
    stats_before = queue.load_separated_diff_statistics([0, 1], full_range(A))
    b_rows = {t: shard_rows(queue, t, B) for t in Table if t is not Table.MESSAGES}
    b_messages = message_keys(queue, 0, B)

    assert queue.run_gc() == 2  # (0, A) and (1, A)

    assert message_keys(queue, 0, A) == keys_of(a3, above, a4)
    assert message_keys(queue, 0, A)[0] == bound.next_value()
    assert iterate_all(queue, [A]) == [m for a in (a3, above, a4) for m in a.iterated()]
    # Statistics: every row of a1 and a2 gone, the others intact.
    assert {mm for mm, _ in stat_rows_of(queue, A)} == {
        a3.max_message,
        above.max_message,
        a4.max_message,
    }
    stats_after = queue.load_separated_diff_statistics([0, 1], full_range(A))
    expected = {
        p: {mm: c for mm, c in per.items() if mm > bound} for p, per in stats_before.items()
    }
    assert stats_after == expected
    assert a2.max_message not in stats_after[0] and a3.max_message in stats_after[0]
    assert queue.load_diff_statistics(0, QueueShardRange(A, QueueKey.MIN, bound.next_value())) == {}
    # Tails and diff infos: a1 and a2 gone, the rest intact.
    assert queue.get_diffs_tail_len(A, QueueKey.MIN) == 3
    assert queue.get_diffs_tail_len(A, bound) == 3
    assert tail_rows_of(queue, A) == [(a.max_message, a.seqno) for a in (a3, above, a4)]
    assert queue.get_diff_info(A, a1.seqno) is None
    assert queue.get_diff_info(A, a2.seqno) is None
    assert not queue.is_diff_exists(a2.block)
    assert {s: queue.get_diff_info(A, s) for s in (3, 4, 5)} == infos
    assert info_seqnos(queue, A) == [3, 4, 5]
    # Another shard's rows are untouched.
    assert {t: shard_rows(queue, t, B) for t in Table if t is not Table.MESSAGES} == b_rows
    assert message_keys(queue, 0, B) == b_messages == keys_of(b1)


def test_a_diff_straddling_the_bound_keeps_its_records_and_upper_messages(
    queue: Queue, chain: Chain
) -> None:
    a1 = apply_keys(chain, A, [key(1000), key(1010), key(1020), key(1030)])
    bound = a1.messages[1].key
    mc = chain.apply(MC, 0, processed_to={A: bound})
    commit(queue, mc, a1)
    info = queue.get_diff_info(A, 1)
    stats = queue.load_diff_statistics(0, full_range(A))

    assert queue.run_gc() == 2

    assert message_keys(queue, 0, A) == [key(1020), key(1030)]
    assert queue.get_diff_info(A, 1) == info  # max_message is above the bound
    assert queue.get_diffs_tail_len(A, QueueKey.MIN) == 1
    assert queue.load_diff_statistics(0, full_range(A)) == stats  # whole-diff statistics stay


def test_bounds_are_per_partition(queue: Queue, chain: Chain) -> None:
    router = PartitionRouter(dst={1: [HOT]})
    a1 = chain.apply(A, [address_in(A, 1), HOT, address_in(A, 2), HOT], router=router)
    bound = a1.max_message
    hot_keys = [m.key for m in a1.messages if m.dst == HOT]
    mc1 = chain.apply(MC, 0, processed_to={A: bound})
    commit(queue, mc1, a1, partitions=(0,))
    assert queue.gc_bounds() == ({(0, A): bound}, {})

    assert queue.run_gc() == 1

    assert queue.gc_bounds() == ({(0, A): bound}, {(0, A): bound})
    assert message_keys(queue, 0, A) == []
    assert message_keys(queue, 1, A) == hot_keys  # partition 1 waits for its own bound
    assert queue.load_diff_statistics(0, full_range(A)) == {}
    assert queue.load_diff_statistics(1, full_range(A)) == {HOT: 2}
    assert queue.get_diff_info(A, 1) is None  # the diff's records go with the first delete
    assert queue.run_gc() == 0

    mc2 = chain.apply(MC, 0, processed_to={A: bound})
    commit(queue, mc2, idle=[a1], partitions=(0, 1))  # a1's diff is gone: record kept (D7)
    assert queue.gc_bounds()[0] == {(0, A): bound, (1, A): bound}

    assert queue.run_gc() == 1  # only (1, A): (0, A) already ran at this bound

    assert message_keys(queue, 1, A) == []
    assert queue.load_diff_statistics(1, full_range(A)) == {}
    assert shard_rows(queue, Table.STATISTICS, A) == []
    assert queue.gc_bounds()[1] == {(0, A): bound, (1, A): bound}


def test_seqno_zero_diff_is_deleted(queue: Queue, chain: Chain) -> None:
    """D5: the only diff found is seqno 0, and it goes (the original kept it)."""
    a0 = chain.apply(A, 2, seqno=0)
    a1 = chain.apply(A, 2)
    mc = chain.apply(MC, 0, processed_to={A: a0.max_message})
    commit(queue, mc, a1)

    assert queue.run_gc() == 2

    assert queue.get_diff_info(A, 0) is None
    assert not queue.is_diff_exists(a0.block)
    assert info_seqnos(queue, A) == [1]
    assert queue.get_last_applied_seqno(A) == 1
    assert tail_rows_of(queue, A) == [(a1.max_message, 1)]
    assert message_keys(queue, 0, A) == keys_of(a1)


def test_statistics_rows_of_deleted_diffs_all_go_including_masterchain_destinations(
    queue: Queue, chain: Chain
) -> None:
    """D4: clean prefix bounds. The original's §8.3 quirk kept, among others, the rows of
    the diff ending exactly on the bound whose destination is the masterchain."""
    dsts = [
        address_in(MC, 1),  # workchain -1: 0x7f after the offset
        Address(-128, bytes(32)),
        Address(-1, b"\xff" * 32),
        address_in(BASE, 2),
        Address(127, b"\xff" * 32),  # the all-0xff destination
        Address(127, bytes(32)),
    ]
    a1 = chain.apply(A, dsts)
    a2 = chain.apply(A, dsts)  # ends exactly on the bound
    a3 = chain.apply(A, dsts)  # above: its rows all stay
    mc = chain.apply(MC, 0, processed_to={A: a2.max_message})
    commit(queue, mc, a3)
    per_diff = dict.fromkeys(dsts, 1)
    assert queue.load_separated_diff_statistics([0], full_range(A)) == {
        0: {a.max_message: per_diff for a in (a1, a2, a3)}
    }

    assert queue.run_gc() == 2

    assert {mm for mm, _ in stat_rows_of(queue, A)} == {a3.max_message}
    assert queue.load_separated_diff_statistics([0], full_range(A)) == {
        0: {a3.max_message: per_diff}
    }
    assert queue.load_diff_statistics(0, QueueShardRange(A, QueueKey.MIN, a3.max_message)) == {}


# -- bounds that never re-run, the idle shard -------------------------------------------------


def test_an_equal_or_smaller_bound_never_reruns(db_path: Path, logs: Logs) -> None:
    with Queue.open(db_path, quiet_config()) as queue:
        chain = Chain(queue)
        a1 = chain.apply(A, 3)
        a2 = chain.apply(A, 3)
        bound = a1.max_message
        mc1 = chain.apply(MC, 0, processed_to={A: bound})
        commit(queue, mc1, a2)
        assert queue.run_gc() == 2
        assert queue.metrics.counter("gc_ranges_deleted") == 2
        logs.clear()

        assert queue.run_gc() == 0  # the same bound: nothing due

        mc2 = chain.apply(MC, 0, processed_to={A: bound})
        commit(queue, mc2, idle=[a2])  # an equal bound from a new commit
        assert queue.run_gc() == 0

        # A new top shard that has read less of A lowers A's bound: stored, not executed.
        lower = a1.messages[0].key
        b1 = chain.apply(B, 1, processed_to={A: lower})
        mc3 = chain.apply(MC, 0, processed_to={A: a2.max_message})
        commit(queue, mc3, b1, idle=[a2])
        requested, executed = queue.gc_bounds()
        assert requested[(0, A)] == requested[(1, A)] == lower
        assert executed == {(0, A): bound, (1, A): bound}
        assert queue.run_gc() == 0

        assert queue.metrics.counter("gc_ranges_deleted") == 2
        assert events(logs, "gc_range_deleted") == []
        assert message_keys(queue, 0, A) == keys_of(a2)


def test_an_idle_shard_holds_back_deletion_of_what_it_has_not_read(
    queue: Queue, chain: Chain
) -> None:
    """D7: B read only A's first message, then went idle. B's own diff is collected, yet
    A's bound stays at B's read position in every later commit."""
    to_b = [address_in(B, i) for i in range(3)]  # A writes to B's accounts
    a1 = chain.apply(A, to_b)
    b_read = a1.messages[0].key
    b1 = chain.apply(B, 2, processed_to={A: b_read})
    a2 = chain.apply(A, to_b, processed_to={A: a1.max_message, B: b1.max_message})
    mc1 = chain.apply(MC, 0, processed_to={A: a2.max_message, B: b1.max_message})
    commit(queue, mc1, a2, b1)
    assert queue.gc_bounds()[0] == {
        (p, s): k for p in (0, 1) for s, k in ((A, b_read), (B, b1.max_message))
    }

    assert queue.run_gc() == 4

    assert queue.get_diff_info(B, 1) is None  # B's own diff is gone ...
    assert message_keys(queue, 0, B) == []
    unread = keys_of(a1, a2)[1:]
    assert message_keys(queue, 0, A) == unread

    for _ in range(3):  # ... and A keeps producing and committing while B stays idle
        a_next = chain.apply(A, to_b, processed_to={A: chain.of(A)[-1].max_message})
        mc = chain.apply(MC, 0, processed_to={A: a_next.max_message, B: b1.max_message})
        commit(queue, mc, a_next, idle=[b1])
        assert queue.commit_record()[B] == b1.diff.processed_to
        assert queue.gc_bounds()[0][(0, A)] == b_read
        queue.run_gc()
        unread += keys_of(a_next)

    assert message_keys(queue, 0, A) == unread
    ranges = [QueueShardRange(A, b_read.next_value(), QueueKey.MAX)]
    with queue.iterator(0, ranges, B) as it:  # what B reads next: nothing lost
        assert [m.message.key for m in it] == [
            m.key for a in chain.of(A) for m in a.messages if m.key > b_read and B.contains(m.dst)
        ]
    assert iterate_all(queue, [A]) == [
        IteratedMessage(A, m) for a in chain.of(A) for m in a.messages if m.key > b_read
    ]


# -- persistence ------------------------------------------------------------------------------


def test_bounds_and_executed_positions_survive_reopen(db_path: Path) -> None:
    with Queue.open(db_path, quiet_config()) as queue:
        chain = Chain(queue)
        a1 = chain.apply(A, 3)
        a2 = chain.apply(A, 3)
        mc1 = chain.apply(MC, 0, processed_to={A: a1.max_message})
        commit(queue, mc1, a2)
        assert queue.run_gc() == 2
        bounds = queue.gc_bounds()
        before = dump(queue)
    with Queue.open(db_path, quiet_config()) as queue:
        assert queue.gc_bounds() == bounds
        assert queue.run_gc() == 0  # the executed positions came back: nothing re-runs
        assert dump(queue) == before


def test_gc_continues_after_reopen_without_a_new_commit(db_path: Path, logs: Logs) -> None:
    clock = Clock()
    with Queue.open(db_path, quiet_config()) as queue:
        chain = Chain(queue, clock)
        a1 = chain.apply(A, 3)
        a2 = chain.apply(A, 3)
        a3 = chain.apply(A, 3)
        mc1 = chain.apply(MC, 0, processed_to={A: a1.max_message})
        commit(queue, mc1, a2)
        assert queue.run_gc() == 2
        mc2 = chain.apply(MC, 0, processed_to={A: a2.max_message})
        commit(queue, mc2, a3)  # a new bound, not collected before the close
        requested, executed = queue.gc_bounds()
        assert requested[(0, A)] == a2.max_message and executed[(0, A)] == a1.max_message

    logs.clear()
    with open_gc_queue(db_path) as queue:
        # The first tick fires at open, with no call and no commit.
        assert wait_for(lambda: worker(queue).passes >= 1)
        assert queue.gc_bounds() == (requested, requested)
        assert message_keys(queue, 0, A) == keys_of(a3)
        assert queue.get_diffs_tail_len(A, QueueKey.MIN) == 1
        deleted = events(logs, "gc_range_deleted")
        assert {(e["partition"], e["bound"]) for e in deleted} == {
            (0, str(a2.max_message)),
            (1, str(a2.max_message)),
        }


# -- failures ---------------------------------------------------------------------------------


def _two_shards_due(chain: Chain) -> tuple[Applied, Applied, Applied, Applied]:
    a1 = chain.apply(A, 3)
    a2 = chain.apply(A, 2)
    b1 = chain.apply(B, 2)
    b2 = chain.apply(B, 2)
    mc = chain.apply(MC, 0, processed_to={A: a1.max_message, B: b1.max_message})
    commit(chain.queue, mc, a2, b2)
    return a1, a2, b1, b2


def test_a_failed_compaction_is_logged_not_marked_and_retried(db_path: Path, logs: Logs) -> None:
    """With ``compact_after_delete``, a pass compacts all its deleted ranges at once, after
    writing every delete; a failed compaction leaves every bound of the pass unexecuted
    (logged per range), and the next pass redoes the (idempotent) deletes and the
    compaction."""
    with Queue.open(db_path, quiet_config(compact_after_delete=True)) as queue:
        chain = Chain(queue)
        a1, a2, b1, b2 = _two_shards_due(chain)
        compact = queue._store.compact
        calls: list[int] = []

        def fail_once(ranges: Any) -> None:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected compaction failure")
            compact(ranges)

        queue._store.compact = fail_once  # type: ignore[method-assign]
        assert queue.run_gc() == 0

        failed = events(logs, "gc_range_failed")
        assert [(e["partition"], e["shard"], e["bound"]) for e in failed] == [
            (p, str(s), str(k))
            for s, k in ((A, a1.max_message), (B, b1.max_message))
            for p in (0, 1)
        ]
        assert all(e["error"] == "RuntimeError: injected compaction failure" for e in failed)
        assert all(e["log_level"] == "error" for e in failed)
        assert queue.gc_bounds()[1] == {}
        assert queue.metrics.counter("gc_ranges_failed") == 4
        [summary] = events(logs, "gc_pass_finished")
        assert (summary["executed"], summary["failed"]) == (0, 4)
        assert message_keys(queue, 0, A) == keys_of(a2)  # the deletes themselves went through

        logs.clear()
        assert queue.run_gc() == 4  # the retry: the deletes are idempotent
        assert events(logs, "gc_range_failed") == []
        assert [e["partition"] for e in events(logs, "gc_range_deleted")] == [0, 1, 0, 1]
        assert queue.gc_bounds()[1] == {
            (p, s): k for p in (0, 1) for s, k in ((A, a1.max_message), (B, b1.max_message))
        }
        assert message_keys(queue, 0, A) == keys_of(a2)
        assert message_keys(queue, 0, B) == keys_of(b2)
        assert queue.run_gc() == 0


def test_a_failed_delete_write_changes_nothing_and_is_retried(db_path: Path, logs: Logs) -> None:
    with Queue.open(db_path, quiet_config()) as queue:
        chain = Chain(queue)
        a1, a2, _b1, b2 = _two_shards_due(chain)
        write = queue._store.write
        failures = [RuntimeError("injected write failure")]

        def fail_first(txn: Any, **kwargs: Any) -> None:
            if failures:
                raise failures.pop()
            write(txn, **kwargs)

        queue._store.write = fail_first  # type: ignore[method-assign]
        assert queue.run_gc() == 2  # A's delete batch failed, B's went through

        assert message_keys(queue, 0, A) == keys_of(a1, a2)  # the batch is atomic
        assert queue.get_diff_info(A, a1.seqno) is not None
        assert message_keys(queue, 0, B) == keys_of(b2)
        assert (0, A) not in queue.gc_bounds()[1]
        [failed, _] = events(logs, "gc_range_failed")
        assert failed["error"] == "RuntimeError: injected write failure"

        assert queue.run_gc() == 2
        assert message_keys(queue, 0, A) == keys_of(a2)
        assert queue.get_diff_info(A, a1.seqno) is None
        assert queue.gc_bounds()[1][(0, A)] == a1.max_message


def _worker_and_a_due_bound(queue: Queue) -> tuple[Any, Applied, Applied]:
    """The queue's worker after its first pass, and two diffs of A committed with A's
    first one due for collection."""
    gc = worker(queue)
    assert gc.tick(timeout=WAIT)
    chain = Chain(queue)
    a1 = chain.apply(A, 3)
    a2 = chain.apply(A, 3)
    mc = chain.apply(MC, 0, processed_to={A: a1.max_message})
    commit(queue, mc, a2)
    return gc, a1, a2


def test_the_worker_survives_a_failed_pass(db_path: Path, logs: Logs) -> None:
    with open_gc_queue(db_path) as queue:
        gc, a1, a2 = _worker_and_a_due_bound(queue)
        run_pass = queue._gc.run_pass
        failures = [RuntimeError("injected pass failure")]

        def fail_once() -> int:
            if failures:
                raise failures.pop()
            return run_pass()

        queue._gc.run_pass = fail_once  # type: ignore[method-assign]
        passes = gc.passes
        assert gc.tick(timeout=WAIT)
        assert gc.passes == passes + 1
        [failed] = events(logs, "gc_pass_failed")
        assert failed["error"] == "RuntimeError: injected pass failure"
        assert message_keys(queue, 0, A) == keys_of(a1, a2)

        assert gc.tick(timeout=WAIT)  # still alive: the next pass collects
        assert gc.passes >= passes + 2
        assert message_keys(queue, 0, A) == keys_of(a2)
        assert queue.gc_bounds()[1] == {(0, A): a1.max_message, (1, A): a1.max_message}


def _fail_one_read_of(queue: Queue, table: Table) -> list[bool]:
    """Make the store's next cursor over ``table`` fail as RocksDB's read of a file does
    when the process is out of descriptors (a ``StorageError``; the handle stays usable);
    returns a flag that is cleared once the failure was raised."""
    store = queue._store
    cursor = store._cursor  # type: ignore[attr-defined]
    armed = [True]

    def failing(scan: Any) -> Any:
        if armed[0] and scan.table is table:
            armed[0] = False
            exc = Exception(
                "IO error: While open a file for random read: 12.sst: Too many open files"
            )
            raise rocks._read_error(store.path, table, scan.lo, exc)
        return cursor(scan)

    store._cursor = failing  # type: ignore[attr-defined]
    return armed


def test_the_worker_survives_a_read_error_of_a_live_handle(db_path: Path, logs: Logs) -> None:
    """A read's I/O error inside a pass (a ``StorageError`` whose handle is still usable)
    fails that step only: logged per range, the bound stays due, the worker goes on and
    its next tick collects. It stopped for good on such an error before (an audit)."""
    with open_gc_queue(db_path) as queue:
        gc, a1, a2 = _worker_and_a_due_bound(queue)
        armed = _fail_one_read_of(queue, Table.DIFF_TAIL)

        assert gc.tick(timeout=WAIT)
        assert not armed[0]  # the failure was met
        assert queue._store.dead is None
        failed = events(logs, "gc_range_failed")
        assert {e["partition"] for e in failed} == {0, 1}
        assert all("Too many open files" in e["error"] for e in failed)
        assert events(logs, "gc_stopped") == []
        assert message_keys(queue, 0, A) == keys_of(a1, a2)
        assert queue.gc_bounds()[1] == {}

        assert gc.tick(timeout=WAIT)  # alive: the next pass collects
        assert message_keys(queue, 0, A) == keys_of(a2)
        assert queue.gc_bounds()[1] == {(0, A): a1.max_message, (1, A): a1.max_message}


def test_a_read_error_fails_one_step_of_run_gc_and_the_next_call_does_it(
    db_path: Path, logs: Logs
) -> None:
    with Queue.open(db_path, quiet_config()) as queue:
        chain = Chain(queue)
        a1, a2, b1, b2 = _two_shards_due(chain)
        _fail_one_read_of(queue, Table.DIFF_TAIL)
        report = queue.run_gc_report()
        assert (len(report.ranges), report.failed) == (2, 2)  # one shard's step failed
        assert len(events(logs, "gc_range_failed")) == 2
        assert queue.run_gc() == 2
        assert message_keys(queue, 0, A) == keys_of(a2)
        assert message_keys(queue, 0, B) == keys_of(b2)
        assert queue.get_diff_info(A, a1.seqno) is None
        assert queue.get_diff_info(B, b1.seqno) is None


def test_a_dead_handle_stops_the_worker_and_says_so(db_path: Path, logs: Logs) -> None:
    """A failed write kills the handle (RocksDB refuses writes until a reopen): the
    worker logs ``gc_stopped`` and ends; the queue's calls raise ``StorageError``."""
    with open_gc_queue(db_path) as queue:
        gc, _, _ = _worker_and_a_due_bound(queue)
        store = queue._store
        real = store._db  # type: ignore[attr-defined]

        class Full:
            def write(self, *_: Any) -> None:  # what rocksdict raises: a bare Exception
                raise Exception("IO error: No space left on device")

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        store._db = Full()  # type: ignore[attr-defined]
        try:
            assert gc.tick(timeout=WAIT)  # the pass that met the failure
        finally:
            store._db = real  # type: ignore[attr-defined]
        assert wait_for(lambda: not gc._thread.is_alive())
        assert not gc.tick(timeout=WAIT)  # no pass runs any more
        assert store.dead is not None
        [stopped] = events(logs, "gc_stopped")
        assert "No space left on device" in stopped["error"]
        assert events(logs, "gc_range_failed") == []
        with pytest.raises(StorageError):
            Chain(queue).apply(A, 1)


def test_close_stops_a_worker_blocked_on_a_pending_diff(db_path: Path) -> None:
    """The pass waits for A's mutex, which a pending diff holds; close must not hang."""
    queue = open_gc_queue(db_path)
    chain = Chain(queue)
    pending = None
    try:
        gc = worker(queue)
        assert gc.tick(timeout=WAIT)
        a1 = chain.apply(A, 3)
        a2 = chain.apply(A, 3)
        mc = chain.apply(MC, 0, processed_to={A: a1.max_message})
        commit(queue, mc, a2)
        nxt = chain.build(A, 2)
        pending = queue.prepare_diff(nxt.diff, nxt.block, nxt.hash)
        assert pending is not None
        assert not gc.tick(timeout=0.3)  # the pass is stuck behind the pending diff
        assert message_keys(queue, 0, A) == keys_of(a1, a2)

        closer = threading.Thread(target=queue.close, daemon=True)
        closer.start()
        closer.join(timeout=5.0)
        assert not closer.is_alive(), "close() hung behind the GC worker"
        assert queue.closed
    finally:
        if pending is not None and pending.state == "pending":
            pending.discard()  # first: a failed assertion above must not hang close()
        queue.close()
    with Queue.open(db_path, quiet_config()) as queue:  # nothing was collected or marked
        assert queue.gc_bounds()[1] == {}
        assert message_keys(queue, 0, A) == keys_of(a1, a2)
        assert queue.run_gc() == 2
        assert message_keys(queue, 0, A) == keys_of(a2)


def test_close_between_two_batches_stops_the_pass_and_the_next_open_finishes_it(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() during a pass over a backlog waits for one batch, not for the backlog;
    the deletion stays due (not marked executed), and the next pass deletes what is
    left and counts only that."""
    from imq import gc as imq_gc

    first_written = threading.Event()
    real = imq_gc.GarbageCollector._delete_batch

    def batch_then_wait_for_close(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = real(self, *args, **kwargs)
        first_written.set()
        assert self.stopping.wait(WAIT), "close() never came"
        return result

    queue = open_gc_queue(db_path, gc_batch_diffs=1)
    try:
        assert worker(queue).tick(timeout=WAIT)  # the pass at open is done
        chain = Chain(queue)
        backlog = [chain.apply(A, 3) for _ in range(6)]
        mc = chain.apply(MC, 0, processed_to={A: backlog[-1].max_message})
        monkeypatch.setattr(imq_gc.GarbageCollector, "_delete_batch", batch_then_wait_for_close)
        commit(queue, mc, backlog[-1])
        worker(queue).tick(timeout=0)
        assert first_written.wait(WAIT)
        closer = threading.Thread(target=queue.close, daemon=True)
        closer.start()
        closer.join(timeout=WAIT)
        assert not closer.is_alive(), "close() waited for the whole backlog"
    finally:
        queue.close()
    monkeypatch.undo()

    with Queue.open(db_path, quiet_config()) as queue:
        assert queue.gc_bounds()[1] == {}  # nothing marked executed
        assert message_keys(queue, 0, A) == keys_of(*backlog[1:])  # one batch went
        report = queue.run_gc_report()
        assert (report.messages, report.diffs) == (15, 5)
        assert message_keys(queue, 0, A) == []
        assert tail_rows_of(queue, A) == info_seqnos(queue, A) == []


def test_run_gc_while_this_thread_holds_a_pending_diff_raises(queue: Queue, chain: Chain) -> None:
    a1 = chain.apply(A, 3)
    mc = chain.apply(MC, 0, processed_to={A: a1.max_message})
    commit(queue, mc, a1)
    nxt = chain.build(B, 1)
    pending = queue.prepare_diff(nxt.diff, nxt.block, nxt.hash)
    assert pending is not None
    with pytest.raises(ImqError, match="run_gc"):
        queue.run_gc()
    pending.discard()
    assert queue.run_gc() == 2


# -- logs -------------------------------------------------------------------------------------


def test_gc_logs_each_range_and_a_summary_per_pass(db_path: Path, logs: Logs) -> None:
    with Queue.open(db_path, quiet_config()) as queue:
        chain = Chain(queue)
        a1 = chain.apply(A, 3)
        a2 = chain.apply(A, 2)
        a3 = chain.apply(A, 1)
        mc = chain.apply(MC, 0, processed_to={A: a2.max_message})
        commit(queue, mc, a3)
        assert queue.run_gc() == 2

    deleted = events(logs, "gc_range_deleted")
    assert [
        {k: e[k] for k in ("partition", "shard", "bound", "messages", "diffs", "component")}
        for e in deleted
    ] == [
        {
            "partition": p,
            "shard": str(A),
            "bound": str(a2.max_message),
            "messages": n,
            "diffs": 2,
            "component": "gc",
        }
        for p, n in ((0, len(a1.messages) + len(a2.messages)), (1, 0))
    ]
    assert all(isinstance(e["seconds"], float) and e["seconds"] >= 0 for e in deleted)
    assert all(e["log_level"] == "info" for e in deleted)
    [summary] = events(logs, "gc_pass_finished")
    assert (summary["executed"], summary["failed"]) == (2, 0)
    assert isinstance(summary["seconds"], float)


@pytest.mark.parametrize("cache_size", [0, 8 << 20], ids=["rocksdb", "cache"])
def test_gc_range_deleted_counts_exactly_what_it_removed(
    db_path: Path, logs: Logs, cache_size: int
) -> None:
    """Bounds that fall inside a diff (the usual case: processed_to stops mid-diff): the
    count covers the partial diffs at both ends of (previous bound, bound], over two
    passes, and matches the rows actually removed, whether the gaps are counted in
    RocksDB or in the cache of fresh rows."""
    with Queue.open(db_path, quiet_config(message_cache_size=cache_size)) as queue:
        chain = Chain(queue)
        a1 = chain.apply(A, 4)
        chain.apply(A, 4)
        a3 = chain.apply(A, 4)
        mid_a1 = sorted(m.key for m in a1.messages)[1]  # 2 of a1's 4 messages are <= it
        mc1 = chain.apply(MC, 0, processed_to={A: mid_a1})
        commit(queue, mc1, a3)
        before = len(message_keys(queue, 0, A))
        assert queue.run_gc() == 2
        first = {e["partition"]: e["messages"] for e in events(logs, "gc_range_deleted")}
        assert first == {0: 2, 1: 0}
        assert before - len(message_keys(queue, 0, A)) == 2

        logs.clear()
        mid_a3 = sorted(m.key for m in a3.messages)[0]  # rest of a1, all of a2, 1 of a3
        mc2 = chain.apply(MC, 0, processed_to={A: mid_a3})
        commit(queue, mc2, a3)
        assert queue.run_gc() == 2
        second = {e["partition"]: e["messages"] for e in events(logs, "gc_range_deleted")}
        assert second == {0: 2 + 4 + 1, 1: 0}
        assert message_keys(queue, 0, A) == sorted(m.key for m in a3.messages)[1:]
        [summary] = events(logs, "gc_pass_finished")
        assert summary["messages"] == 7


# -- GC beside writers and readers ------------------------------------------------------------


ROUNDS = 12


def _script(chain: Chain) -> list[tuple[Applied, Applied, Applied]]:
    """Per round: a diff of A and of B (each read the other's previous diff), then an empty
    masterchain diff; the commit on it names both. Built once, applied to two queues."""
    rounds = []
    last: dict[ShardIdent, QueueKey] = {A: QueueKey.MIN, B: QueueKey.MIN}
    for _ in range(ROUNDS):
        a = chain.build(A, [address_in(A, 5), address_in(B, 6), HOT], processed_to=dict(last))
        b = chain.build(B, [address_in(B, 7), address_in(A, 8)], processed_to=dict(last))
        mc = chain.build(MC, 0, processed_to=dict(last))
        last = {A: a.max_message, B: b.max_message}
        rounds.append((a, b, mc))
    return rounds


def _run_script(queue: Queue, rounds: Sequence[tuple[Applied, Applied, Applied]]) -> None:
    for a, b, mc in rounds:
        for d in (a, b, mc):
            assert queue.apply_diff(d.diff, d.block, d.hash)
        commit(queue, mc, a, b)


def _observable(queue: Queue, rounds: Sequence[tuple[Applied, Applied, Applied]]) -> Any:
    diffs = [d for r in rounds for d in r]
    return {
        "messages": {p: iterate_all(queue, [A, B, MC], p) for p in (0, 1)},
        "infos": {d.block: queue.get_diff_info(d.shard, d.seqno) for d in diffs},
        "zones": {
            d.block: queue.get_diff_info(d.shard, d.seqno, DiffZone.COMMITTED) for d in diffs
        },
        "tails": {s: queue.get_diffs_tail_len(s, QueueKey.MIN) for s in (A, B, MC)},
        "stats": {p: queue.load_diff_statistics(p, full_range(A)) for p in (0, 1)},
        "bounds": queue.gc_bounds(),
        "rows": {t: rows(queue, t) for t in Table if t is not Table.VARS},
    }


def _check_snapshot(seen: list[IteratedMessage], order: dict[ShardIdent, list[QueueKey]]) -> None:
    """One iterator's output: sorted, and per source shard a contiguous run of that shard's
    keys (GC removes a prefix, writers append): no hole, no duplicate."""
    assert [m.message.key for m in seen] == sorted(m.message.key for m in seen)
    for shard, all_keys in order.items():
        got = [m.message.key for m in seen if m.source == shard]
        if got:
            start = all_keys.index(got[0])
            assert got == all_keys[start : start + len(got)]


def test_gc_in_its_thread_beside_writers_and_readers_matches_gc_alone(tmp_path: Path) -> None:
    with Queue.open(tmp_path / "alone", quiet_config()) as alone:
        rounds = _script(Chain(alone))
        _run_script(alone, rounds)
        assert alone.run_gc() > 0
        expected = _observable(alone, rounds)

    order = {
        s: [m.key for r in rounds for d in r if d.shard == s for m in d.messages] for s in (A, B)
    }
    queue = open_gc_queue(tmp_path / "busy", gc_interval=0.002)
    errors: list[BaseException] = []
    done = threading.Event()

    guarded = functools.partial(guarded_by, errors=errors, stop=done)

    def write() -> None:
        try:
            for i, r in enumerate(rounds):
                _run_script(queue, [r])
                if i % 3 == 2:  # make sure passes with work overlap the writes and reads
                    assert worker(queue).tick(timeout=WAIT)
                else:
                    time.sleep(0.001)
        finally:
            done.set()

    def read() -> None:
        while not done.is_set():
            for partition in (0, 1):
                _check_snapshot(iterate_all(queue, [A, B], partition), order)
            queue.get_diffs_tail_len(A, QueueKey.MIN)
            queue.load_separated_diff_statistics([0, 1], full_range(B))

    try:
        threads = [threading.Thread(target=guarded(f)) for f in (write, read, read)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)
        assert queue.metrics.counter("gc_ranges_deleted") >= 2 * (ROUNDS // 3)
        queue.run_gc()  # whatever the worker had not reached yet
        assert _observable(queue, rounds) == expected
    finally:
        queue.close()


# -- compaction gives space back --------------------------------------------------------------


def flushed_size(queue: Queue) -> int:
    queue._store.flush(list(Table))
    return queue._store.disk_usage()


def _collect_all_but_the_last(queue: Queue, chain: Chain) -> Applied:
    body = bytes(range(256)) * 4  # 1 KiB
    applied = [chain.apply(A, 1000, body=body) for _ in range(20)]  # 20k messages, ~21 MB
    keep = applied[-1]
    mc = chain.apply(MC, 0, processed_to={A: applied[-2].max_message})
    commit(queue, mc, keep)
    return keep


def _only_the_last_is_left(queue: Queue, keep: Applied) -> None:
    assert iterate_all(queue, [A]) == keep.iterated()
    middle = keep.messages[500].key
    with queue.iterator(0, [QueueShardRange(A, middle, QueueKey.MAX)], BASE) as it:
        assert [m.message for m in it] == list(keep.messages[500:])
    assert queue.get_diffs_tail_len(A, QueueKey.MIN) == 1
    assert message_keys(queue, 0, A) == keys_of(keep)


def test_compact_after_delete_gives_the_space_back_in_the_pass(db_path: Path) -> None:
    with Queue.open(db_path, quiet_config(compact_after_delete=True)) as queue:
        keep = _collect_all_but_the_last(queue, Chain(queue))
        before = flushed_size(queue)

        report = queue.run_gc_report()

        after = flushed_size(queue)
        assert report.executed == 2 and report.compaction_seconds > 0
        assert before > 20_000_000
        assert after < before / 5, (before, after)
        _only_the_last_is_left(queue, keep)


def test_by_default_the_pass_only_deletes_and_compaction_gives_the_space_back(
    queue: Queue, chain: Chain
) -> None:
    """The default pass writes range tombstones and does not compact: the rows are gone
    for every reader at once, the bytes stay until a compaction (RocksDB's own, or
    ``Queue.compact``) rewrites the files that hold them."""
    keep = _collect_all_but_the_last(queue, chain)
    before = flushed_size(queue)

    report = queue.run_gc_report()

    assert report.executed == 2 and report.messages == 19_000
    _only_the_last_is_left(queue, keep)
    assert flushed_size(queue) > before / 2  # nothing rewritten yet
    compacted = queue.compact()
    assert compacted.bytes_after < before / 5, (before, compacted)
    _only_the_last_is_left(queue, keep)


def test_disk_usage_skips_a_file_removed_while_it_walks(
    queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RocksDB deletes obsolete table files from its background threads, so a file the
    walk listed can be gone when it is measured (seen once in CI: ``FileNotFoundError``
    out of ``disk_usage`` after a GC pass). It counts nothing; the rest still count."""
    store = queue._store
    whole = store.disk_usage()

    class Vanishing(type(store.path)):  # type: ignore[misc]
        """A table file as the walk saw it, deleted before it is measured."""

        def is_file(self) -> bool:
            return True

        def stat(self, **_: Any) -> Any:
            raise FileNotFoundError(2, "No such file or directory", str(self))

    ghost = Vanishing(store.path / "000999.sst")
    real_rglob = Path.rglob

    def rglob(self: Path, pattern: str) -> Any:
        yield ghost
        yield from real_rglob(self, pattern)

    monkeypatch.setattr(Path, "rglob", rglob)
    assert store.disk_usage() == whole > 0


def _level0_files(queue: Queue) -> int:
    return queue._store.property_int(Table.MESSAGES, "rocksdb.num-files-at-level0")


def test_background_compaction_keeps_level0_bounded_when_nothing_is_collected(
    db_path: Path,
) -> None:
    """Nothing is collected (no commit), yet every memtable flush adds an L0 file that
    each read must seek in: RocksDB's background compaction must merge them, or reads
    slow down as the queue grows (the original turns it off for these tables)."""
    config = quiet_config(write_buffer_size=1 << 20)
    with Queue.open(db_path, config) as queue:
        chain = Chain(queue)
        body = bytes(200)
        flushes = 0
        most = 0
        for _ in range(40):  # ~40 flushes of 1 MiB memtables
            chain.apply(A, 4000, body=body)
            queue._store.flush([Table.MESSAGES])
            flushes += 1
            most = max(most, _level0_files(queue))
        deadline = time.monotonic() + 60
        while _level0_files(queue) > 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert flushes == 40
        assert _level0_files(queue) <= 4, most
        assert len(message_keys(queue, 0, A)) == 160_000


def test_compaction_debt_compacts_once_enough_is_collected(db_path: Path) -> None:
    """Below ``compaction_debt`` a pass only deletes; the pass that brings the messages
    deleted since the last compaction to the debt compacts every range they cover (those
    of the earlier passes too) and starts the debt again."""
    body = bytes(range(256)) * 4  # 1 KiB
    with Queue.open(db_path, quiet_config(compaction_debt=5_000)) as queue:
        chain = Chain(queue)
        applied = [chain.apply(A, 1000, body=body) for _ in range(10)]
        keep = applied[-1]

        def collect_through(i: int) -> GcReport:
            mc = chain.apply(MC, 0, processed_to={A: applied[i].max_message})
            commit(queue, mc, keep)
            return queue.run_gc_report()

        first = collect_through(2)  # 3,000 messages: below the debt
        assert (first.messages, first.compaction_seconds) == (3_000, 0.0)
        assert queue._gc.debt == 3_000
        before = flushed_size(queue)

        second = collect_through(5)  # 3,000 more: 6,000 >= 5,000
        assert second.messages == 3_000 and second.compaction_seconds > 0
        assert queue._gc.debt == 0
        after = flushed_size(queue)
        assert after < before * 0.55, (before, after)  # 6 of the 10 MB of messages gone

        third = collect_through(6)
        assert (third.messages, third.compaction_seconds, queue._gc.debt) == (1_000, 0.0, 1_000)
        assert message_keys(queue, 0, A) == [k for a in applied[7:] for k in keys_of(a)]


@pytest.mark.parametrize("batch", [10_000, 1], ids=["one batch", "a batch per diff"])
@pytest.mark.parametrize("rows_from", ["cache", "records", "records after a reopen"])
def test_each_deletion_reports_the_rows_and_diffs_it_removed(
    db_path: Path, rows_from: str, batch: int
) -> None:
    """A deletion counts its messages from the cache of fresh rows when the cache holds
    them all, else from the deleted diffs' records plus a row count of the partial diffs
    at the ends. Either way a report says exactly what went, bounds inside diffs
    included: compared here with the rows and tail entries stored before and after,
    whether a deletion goes in one batch or in one per diff (``gc_batch_diffs``)."""
    cache = 0 if rows_from == "records" else 64 << 20
    config = quiet_config(message_cache_size=cache, gc_batch_diffs=batch)
    queue = Queue.open(db_path, config)
    try:
        chain = Chain(queue)
        router = PartitionRouter(dst={1: [HOT]})
        dsts = [address_in(A, 1), HOT, address_in(A, 2), HOT, address_in(A, 3), address_in(A, 4)]
        diffs = [chain.apply(A, dsts, router=router) for _ in range(4)]
        # Bounds: inside the first diff, inside the third, then past the last.
        bounds = [diffs[0].messages[2].key, diffs[2].messages[3].key, diffs[3].max_message]
        for i, bound in enumerate(bounds):
            mc = chain.apply(MC, 0, processed_to={A: bound})
            if i == 0:
                commit(queue, mc, diffs[-1])
            else:
                commit(queue, mc, idle=[diffs[-1]])
            if rows_from == "records after a reopen":  # the cache starts empty
                queue.close()
                queue = chain.queue = Queue.open(db_path, config)
            before = {p: message_keys(queue, p, A) for p in (0, 1)}
            tails = queue.get_diffs_tail_len(A, QueueKey.MIN)

            report = queue.run_gc_report()

            ranges = [r for r in report.ranges if r.shard == A]
            assert sorted(r.partition for r in ranges) == [0, 1]
            for r in ranges:
                gone = set(before[r.partition]) - set(message_keys(queue, r.partition, A))
                assert gone and r.messages == len(gone), (i, r)
                assert r.diffs == tails - queue.get_diffs_tail_len(A, QueueKey.MIN), (i, r)
        assert message_keys(queue, 0, A) == message_keys(queue, 1, A) == []
    finally:
        queue.close()


def test_a_partition_the_cache_cannot_tell_leaves_the_others_counted_in_it(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard that never wrote to the low-priority partition has no segment for it in
    the cache of fresh rows, so the cache cannot count that partition. Stop 43 then
    counted every partition from RocksDB, partition 0's collected messages row by row:
    each GC pass read them all again (the endurance run's block cache grew about 30 MB
    a minute, RSS from 160 to 430 MB). Only the partition the cache cannot tell is
    counted from RocksDB now; partition 0's count comes from the cache, and the report
    is as exact as before."""
    from imq import gc as imq_gc

    counted: list[list[int]] = []
    real = imq_gc.GarbageCollector._count_removed

    def spy(view: Any, rows: Any, shard: ShardIdent, lows: Any, found: Any) -> Any:
        counted.append(sorted(lows))
        return real(view, rows, shard, lows, found)

    monkeypatch.setattr(imq_gc.GarbageCollector, "_count_removed", staticmethod(spy))
    config = quiet_config(message_cache_size=64 << 20, message_scans_fill_cache=True)
    with Queue.open(db_path, config) as queue:
        chain = Chain(queue)
        diffs = [chain.apply(A, 500) for _ in range(8)]  # partition 0 only
        everything = [full_range(A)]
        with queue.iterator(0, everything, ShardIdent.BASECHAIN) as it:
            assert sum(1 for _ in it) == 4_000  # a reader that keeps up: all cached
        mc = chain.apply(MC, 0, processed_to={A: diffs[-1].max_message})
        commit(queue, mc, diffs[-1])
        store = queue._store
        store.flush(Table)  # rows read from RocksDB now come through the block cache
        cache_before = store.property_int(Table.MESSAGES, "rocksdb.block-cache-usage")

        report = queue.run_gc_report()

        assert {(r.partition, r.messages) for r in report.ranges} == {(0, 4_000), (1, 0)}
        assert message_keys(queue, 0, A) == []
        assert counted == [[1]], counted  # partition 0 came from the cache
        grown = store.property_int(Table.MESSAGES, "rocksdb.block-cache-usage") - cache_before
        assert grown < 128 << 10, grown  # diff records and tails (35 KB), no message block (265 KB)


def test_a_backlog_goes_in_batches_and_the_shards_writers_get_in_between(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog of more than ``gc_batch_diffs`` diffs is deleted in batches, each under
    the shard's mutex: an apply of the shard finishes between two batches instead of
    waiting for the whole pass (a backlog of 62,500 diffs held it for 1.3 s in one
    piece). Each batch is a whole deletion of a shorter prefix, so the pass ends where
    one deletion would: everything up to the bound gone, the diff applied meanwhile
    kept, the report counting each removed message and diff once."""
    from imq import gc as imq_gc

    with Queue.open(db_path, quiet_config(gc_batch_diffs=2)) as queue:
        chain = Chain(queue)
        backlog = [chain.apply(A, 3) for _ in range(5)]
        mc = chain.apply(MC, 0, processed_to={A: backlog[-1].max_message})
        commit(queue, mc, backlog[-1])

        batches: list[int] = []
        starts: list[tuple[QueueKey, QueueKey]] = []  # (where a batch starts, where it ends)
        real = imq_gc.GarbageCollector._delete_batch

        def batch_then_apply(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = real(self, *args, **kwargs)
            batches.append(len(result[0].seqnos))
            starts.append((result[0].first, result[0].last))
            if len(batches) == 1:  # the mutex is released: a writer of the shard gets in
                done = threading.Event()
                writer = threading.Thread(target=lambda: (chain.apply(A, 2), done.set()))
                writer.start()
                writer.join(WAIT)
                assert done.is_set(), "the apply waited for the rest of the pass"
            return result

        monkeypatch.setattr(imq_gc.GarbageCollector, "_delete_batch", batch_then_apply)
        report = queue.run_gc_report()

        assert batches == [2, 2, 1]
        # Each batch starts just above the one before: range deletes from the start
        # every time would nest their tombstones, each batch's reads costing more.
        assert [first for first, _ in starts] == [
            QueueKey.MIN,
            *(last.next_value() for _, last in starts[:-1]),
        ]
        assert starts[-1][1] == backlog[-1].max_message
        assert (report.messages, report.diffs) == (15, 5)
        assert {(r.partition, r.messages) for r in report.ranges} == {(0, 15), (1, 0)}
        late = chain.applied[-1]
        assert message_keys(queue, 0, A) == keys_of(late)
        assert [s for _k, s in tail_rows_of(queue, A)] == info_seqnos(queue, A) == [late.seqno]


@pytest.mark.parametrize("batch", [10_000, 1], ids=["one batch", "a batch per diff"])
def test_overlapping_diffs_are_counted_once_whatever_the_batches(db_path: Path, batch: int) -> None:
    """Diff X spans lt 10 to 100, diff Y (applied after) lt 20 to 30, inside X's span. A
    batch of one diff deletes Y and every row up to lt 30, X's row at lt 10 with them;
    the next batch counted X from its record, that row a second time (an outside audit:
    6 reported, 5 removed). A batch counts from where it starts now."""
    with Queue.open(db_path, quiet_config(gc_batch_diffs=batch, message_cache_size=0)) as queue:
        chain = Chain(queue)
        x = apply_keys(chain, A, [key(10), key(50), key(100)])
        apply_keys(chain, A, [key(20), key(30)])
        mc = chain.apply(MC, 0, processed_to={A: x.max_message})
        commit(queue, mc, x)
        before = len(message_keys(queue, 0, A))
        report = queue.run_gc_report()
        removed = before - len(message_keys(queue, 0, A))
        assert removed == 5
        assert {(r.partition, r.messages) for r in report.ranges} == {(0, 5), (1, 0)}
        assert queue.metrics.counter("messages_deleted") == 5
    assert verify(db_path).ok


def test_a_pass_ends_beside_a_writer_that_never_pauses(db_path: Path) -> None:
    """A bound above the commit pointer (``processed_to`` at ``MAX``) and a thread that
    applies diffs to the shard without pause: every diff it adds lies under the bound,
    and a pass in batches of one chased them for ever (an outside audit). The batches
    are cut only among the diffs the pass found; the rest go in one last batch."""
    with Queue.open(db_path, quiet_config(gc_batch_diffs=1)) as queue:
        chain = Chain(queue)
        backlog = [chain.apply(A, 1) for _ in range(20)]
        mc = chain.apply(MC, 0, processed_to={A: QueueKey.MAX})
        commit(queue, mc, backlog[-1])
        stop = threading.Event()
        applied: list[int] = []

        def write() -> None:
            while not stop.is_set():
                chain.apply(A, 1)
                applied.append(1)

        writer = threading.Thread(target=write)
        writer.start()
        try:
            assert wait_for(lambda: len(applied) >= 5)
            reports: list[GcReport] = []
            gc = threading.Thread(target=lambda: reports.append(queue.run_gc_report()))
            gc.start()
            gc.join(WAIT)
            assert not gc.is_alive(), "the pass chased the writer"
        finally:
            stop.set()
            writer.join()
        [report] = reports
        assert report.diffs >= 20
        assert report.messages == report.diffs  # one message each, every one counted


@pytest.mark.parametrize("committed", [False, True], ids=["uncommitted", "then committed"])
def test_diffs_written_below_a_batchs_end_go_with_a_later_batch(
    db_path: Path, monkeypatch: pytest.MonkeyPatch, committed: bool
) -> None:
    """A bound above the commit pointer (``processed_to`` at ``MAX``): between two batches
    the shard's writer adds a diff below where the batch before ended, and one across it.
    A batch that started just above that end deleted the second one's record and kept
    its rows below the end, for ever (an outside audit). A batch after writes there
    starts from the beginning again: both go, whole, and the report counts them. Also
    when a commit moves the pointer over them before the next batch (writes are looked
    for above the pointer as the pass found it)."""
    from imq import gc as imq_gc

    def msg(lt: int) -> Message:
        return message(key(lt), address_in(A, 1), address_in(A, 2))

    with Queue.open(db_path, quiet_config(gc_batch_diffs=1)) as queue:
        for seqno in range(1, 21):  # one message each, at lt 1010 ... 1200
            assert queue.apply_diff(
                make_diff([msg(1000 + 10 * seqno)]), block(A, seqno), diff_hash((A, seqno))
            )
        mc = make_diff([], {A: QueueKey.MAX})
        assert queue.apply_diff(mc, block(MC, 1), diff_hash((MC, 1)))
        assert queue.commit_diff([top(MC, 1), top(A, 5, 1)])  # pointer at lt 1050
        real = imq_gc.GarbageCollector._delete_batch
        ends: list[QueueKey] = []

        def batch_then_write(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = real(self, *args, **kwargs)
            ends.append(result[0].last)
            if len(ends) == 10:  # the batches have reached lt 1100
                below = make_diff([msg(1055), msg(1065)])
                across = make_diff([msg(1075), msg(1305)])
                assert queue.apply_diff(below, block(A, 100), diff_hash((A, 100)))
                assert queue.apply_diff(across, block(A, 101), diff_hash((A, 101)))
                if committed:
                    mc2 = make_diff([], {A: QueueKey.MAX})
                    assert queue.apply_diff(mc2, block(MC, 2), diff_hash((MC, 2)))
                    assert queue.commit_diff([top(MC, 2), top(A, 101, 2)])
                    assert queue.get_commit_pointers()[A].key.lt == 1305
            return result

        monkeypatch.setattr(imq_gc.GarbageCollector, "_delete_batch", batch_then_write)
        report = queue.run_gc_report()
        assert ends[9].lt == 1100
        assert message_keys(queue, 0, A) == []
        assert queue.get_diff_info(A, 100) is None and queue.get_diff_info(A, 101) is None
        assert queue.get_diffs_tail_len(A, QueueKey.MIN) == 0
        assert (report.messages, report.diffs) == (24, 22)
    assert verify(db_path).ok


def test_a_long_run_of_batches_flushes_its_tombstones(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every batch leaves range tombstones in the memtables, and every cursor goes over
    all of them: 6,800 batches of one diff took 19 s, a batch's time growing with their
    number (an outside audit). A deletion flushes the tables it range-deletes every
    ``_FLUSH_EVERY`` batches."""
    from imq import gc as imq_gc

    monkeypatch.setattr(imq_gc, "_FLUSH_EVERY", 2)
    with Queue.open(db_path, quiet_config(gc_batch_diffs=1)) as queue:
        chain = Chain(queue)
        backlog = [chain.apply(A, 2) for _ in range(5)]
        mc = chain.apply(MC, 0, processed_to={A: backlog[-1].max_message})
        commit(queue, mc, backlog[-1])
        flushed: list[list[Table]] = []
        real = queue._store.flush
        monkeypatch.setattr(queue._store, "flush", lambda t: (flushed.append(list(t)), real(t)))
        report = queue.run_gc_report()
        assert report.diffs == 5
        tombstoned = [Table.MESSAGES, Table.STATISTICS, Table.DIFF_TAIL]
        assert flushed == [tombstoned, tombstoned]  # after batches 2 and 4 of 5
        assert message_keys(queue, 0, A) == []


def test_the_flushes_count_batches_across_a_passs_deletions(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One deletion a shard, one batch each: the tombstones pile up across a pass just
    the same (an outside audit: a masterchain diff naming 16,000 shards that hold
    nothing took a pass of 34 s, growing with the square of their number; 3.5 s with
    the flushes counted across the pass)."""
    from imq import gc as imq_gc

    monkeypatch.setattr(imq_gc, "_FLUSH_EVERY", 2)
    with Queue.open(db_path, quiet_config()) as queue:
        chain = Chain(queue)
        shards = [split_shard(0, 3, i) for i in range(5)]
        mc = chain.apply(MC, 0, processed_to={s: key(10 + i) for i, s in enumerate(shards)})
        commit(queue, mc)
        flushed: list[list[Table]] = []
        real = queue._store.flush
        monkeypatch.setattr(queue._store, "flush", lambda t: (flushed.append(list(t)), real(t)))
        report = queue.run_gc_report()
        assert {r.shard for r in report.ranges} == set(shards)
        tombstoned = [Table.MESSAGES, Table.STATISTICS, Table.DIFF_TAIL]
        assert flushed == [tombstoned, tombstoned]  # before the 3rd and the 5th deletion


def test_a_batch_never_cuts_between_diffs_that_end_at_the_same_key(db_path: Path) -> None:
    """Empty diffs of a shard that has no position yet all end at ``MIN``: a batch that
    reaches its size among them takes the rest too. Cut there, its range delete would
    remove every one of their tail rows but only the records it counted, and the other
    records would stay for ever, named by no tail row."""
    with Queue.open(db_path, quiet_config(gc_batch_diffs=2)) as queue:
        chain = Chain(queue)
        empty = [chain.apply(A, 0) for _ in range(4)]
        assert {queue.get_diff_info(A, e.seqno).max_message for e in empty} == {QueueKey.MIN}
        full = [chain.apply(A, 3) for _ in range(3)]
        mc = chain.apply(MC, 0, processed_to={A: full[-1].max_message})
        commit(queue, mc, full[-1])

        report = queue.run_gc_report()

        assert (report.messages, report.diffs) == (9, 7)
        assert tail_rows_of(queue, A) == info_seqnos(queue, A) == []
        assert message_keys(queue, 0, A) == []
    assert verify(db_path).ok


@pytest.mark.parametrize("cache", [64 << 20, 0], ids=["cache", "records"])
def test_a_bound_one_key_above_the_last_counts_the_message_there(db_path: Path, cache: int) -> None:
    """A deletion removes (executed bound, bound]: with the bound the very next key
    after the executed one, that range is the one key, and the message stored there is
    counted (its first key is its last, still a range of one), whether the cache or the
    diff records count it."""
    with Queue.open(db_path, quiet_config(message_cache_size=cache)) as queue:
        chain = Chain(queue)
        at = key(1000)
        x = apply_keys(chain, A, [at, at.next_value()])
        mc1 = chain.apply(MC, 0, processed_to={A: at})
        commit(queue, mc1, x)
        first = queue.run_gc_report()
        assert {(r.partition, r.messages) for r in first.ranges} == {(0, 1), (1, 0)}

        mc2 = chain.apply(MC, 0, processed_to={A: at.next_value()})
        commit(queue, mc2, idle=[x])
        second = queue.run_gc_report()

        assert {(r.partition, r.bound, r.messages) for r in second.ranges} == {
            (0, at.next_value(), 1),
            (1, at.next_value(), 0),
        }
        assert message_keys(queue, 0, A) == []


def test_a_collector_refuses_batches_of_no_diffs(queue: Queue) -> None:
    """``batch_diffs`` is at least 1 where the collector is made, not only in the
    config's check: a batch of no diffs would never reach its bound."""
    gc = queue._gc
    parts = (queue._store, gc._rw, gc._shard_locks, queue.metrics, get_logger("gc"))
    with pytest.raises(ValueError, match="batch_diffs must be at least 1, got 0"):
        GarbageCollector(*parts, compact=False, batch_diffs=0)
    GarbageCollector(*parts, compact=False, batch_diffs=1)  # the least it takes


def test_disk_usage_leaves_out_rocksdbs_text_logs(queue: Queue) -> None:
    """A user audit: ``imq compact`` reported 540,632 -> 580,439 bytes, the difference
    RocksDB's text info log (``LOG``, and ``LOG.old.*`` kept from earlier opens), which
    grows at every open and holds no data. Only the database's own files count."""
    store = queue._store
    before = store.disk_usage()
    (store.path / "LOG.old.1700000000000000").write_bytes(b"x" * 100_000)
    with (store.path / "LOG").open("ab") as log:
        log.write(b"y" * 100_000)
    assert store.disk_usage() == before


def test_the_flush_count_starts_again_with_each_pass(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's passes make a few batches each: counted across passes, they would flush
    the tables every few minutes for nothing (small table files); each pass counts its
    own."""
    from imq import gc as imq_gc

    monkeypatch.setattr(imq_gc, "_FLUSH_EVERY", 2)
    with Queue.open(db_path, quiet_config()) as queue:
        chain = Chain(queue)
        flushed: list[list[Table]] = []
        real = queue._store.flush
        monkeypatch.setattr(queue._store, "flush", lambda t: (flushed.append(list(t)), real(t)))
        for i in range(4):  # a pass of one deletion (one batch) each
            a = chain.apply(A, 2)
            mc = chain.apply(MC, 0, processed_to={A: a.max_message})
            commit(queue, mc, a)
            assert queue.run_gc() == 2, i
        assert flushed == []
