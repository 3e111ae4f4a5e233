"""The domain modules on the in-memory store: apply, commit, delete, reads and the GC
planner, each called directly (no facade, no locks, no RocksDB)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from imq import apply, commit, delete, reads
from imq.diff import DiffStatistics, QueueDiff
from imq.errors import DiffConflictError, DiffSequenceError
from imq.gc import due_tasks
from imq.storage import QueueState, ops
from imq.storage.memory import MemoryStore
from imq.storage.rocks import Store
from imq.types import (
    Address,
    BlockId,
    BlockIdShort,
    CommitPointer,
    DiffZone,
    Message,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    TopBlock,
)

MC = ShardIdent.MASTERCHAIN
S1 = ShardIdent(0, 0x4000_0000_0000_0000)
DST = Address(0, bytes([0x10]) + bytes(31))
SRC = Address(0, bytes([0x20]) + bytes(31))


def key(lt: int) -> QueueKey:
    return QueueKey(lt, lt.to_bytes(32, "big"))


def diff_of(*lts: int, processed_to: dict[ShardIdent, QueueKey] | None = None) -> QueueDiff:
    return QueueDiff([Message(key(lt), SRC, DST, b"m%d" % lt) for lt in lts], processed_to or {})


def write_diff(store: MemoryStore, shard: ShardIdent, seqno: int, diff: QueueDiff) -> None:
    assert diff.min_message is not None and diff.max_message is not None
    stats = DiffStatistics.from_diff(diff, shard, diff.min_message, diff.max_message)
    txn = store.transaction()
    apply.stage_diff(txn, diff, BlockIdShort(shard, seqno), bytes([seqno]) * 32, stats)
    store.write(txn)


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


def test_apply_writes_every_row_a_read_answers(store: MemoryStore) -> None:
    write_diff(store, S1, 1, diff_of(10, 20))
    write_diff(store, S1, 2, diff_of(30))
    last, tail = ops.LastSeqno(S1), ops.TailLen(S1, QueueKey.MIN)
    totals = ops.StatTotals(0, QueueShardRange(S1, QueueKey.MIN, QueueKey.MAX))
    with ops.view(store, last, tail, totals, diffs=True) as view:
        assert view[last] == 2
        assert view[tail] == 2
        assert view[totals] == {DST: 3}
        info = view.diff_info(S1, 1)
        assert info is not None and (info.min_message, info.max_message) == (key(10), key(20))


def test_the_pre_write_checks(store: MemoryStore) -> None:
    write_diff(store, S1, 1, diff_of(10))
    block = BlockIdShort(S1, 1)
    with ops.view(store, diffs=True) as view:
        assert apply.already_applied(view, block, bytes([1]) * 32)
        with pytest.raises(DiffConflictError):
            apply.already_applied(view, block, bytes(32))
    last = ops.LastSeqno(S1)
    with ops.view(store, last, diffs=True) as view:
        top = view.diff_top(S1, view[last])
        assert apply.sequence_skips(top, None, block, DiffZone.BOTH)
        with pytest.raises(DiffSequenceError):
            apply.sequence_skips(top, None, BlockIdShort(S1, 3), DiffZone.BOTH)
    previous = ops.LastSeqno(S1, below=5)
    with ops.view(store, previous, diffs=True) as view:
        assert apply.resting_key(view, previous, BlockIdShort(S1, 5), None) == key(10).next_value()


def test_a_commit_persists_what_it_publishes(store: MemoryStore) -> None:
    write_diff(store, S1, 1, diff_of(10, 20, processed_to={S1: key(15)}))
    write_diff(store, MC, 1, diff_of(5, processed_to={S1: key(12)}))
    tops = [TopBlock(BlockId(MC, 1), 1), TopBlock(BlockId(S1, 1), 1)]
    with ops.view(store, diffs=True) as view:
        plan = commit.plan_commit(
            tops,
            [0],
            pointers=view.state.pointers,
            last_mc_block=view.state.last_mc_block,
            record=view.state.commit_record,
            gc_requested=view.state.gc_requested,
            find_diff=view.diff_info,
            zerostate_seqno=0,
        )
    assert plan is not None
    txn = store.transaction()
    commit.stage_commit(txn, plan)
    store.write(txn)
    assert store.state.pointers[S1] == CommitPointer(key(20), 1)
    assert store.state.gc_requested == {(0, S1): key(12)}
    assert ops.load_state(store) == store.state  # what a reopen reads back


def test_delete_removes_a_span_and_says_what(store: MemoryStore) -> None:
    write_diff(store, S1, 1, diff_of(10, 20))
    write_diff(store, S1, 2, diff_of(30, 40))
    r = delete.DeleteRange(S1, QueueKey.MIN, key(25), frozenset({0}), False)
    tail = delete.tail_rows(r)
    txn = store.transaction()
    with ops.view(store, tail, diffs=True) as view:
        deleted = delete.stage_delete(view, tail, txn, r)
    store.write(txn)
    assert deleted.seqnos == (1,)
    assert deleted.total_messages == 2
    last, length = ops.LastSeqno(S1), ops.TailLen(S1, QueueKey.MIN)
    rows = ops.DiffMessages(0, S1, QueueKey.MIN, QueueKey.MAX)
    with ops.view(store, last, length, rows, diffs=True) as view:
        assert view[last] == 2 and view[length] == 1
        assert [row[1] for row in view[rows]] == [b"m30", b"m40"]
        assert view.diff_info(S1, 1) is None


def test_reads_by_zone_and_the_summary(store: MemoryStore) -> None:
    write_diff(store, S1, 1, diff_of(10))
    write_diff(store, S1, 2, diff_of(20))
    store.set_state(QueueState(pointers={S1: CommitPointer(key(10), 1)}))
    diffs = ops.AllDiffs()
    with ops.view(store, diffs, diffs=True) as view:
        assert reads.diff_info(view, S1, 1, DiffZone.COMMITTED) is not None
        assert reads.diff_info(view, S1, 2, DiffZone.COMMITTED) is None
        assert reads.diff_info(view, S1, 2, DiffZone.UNCOMMITTED) is not None
        summary = reads.summarize(view, diffs, store.path, False)
    assert summary["shards"][str(S1)]["committed"] == 1
    assert summary["shards"][str(S1)]["uncommitted"] == 1


def test_the_gc_planner_runs_what_is_above_the_executed_bound() -> None:
    requested = {(0, S1): key(20), (1, S1): key(20), (0, MC): key(5)}
    executed = {(0, MC): key(5)}
    tasks = due_tasks(requested, executed)
    assert [(t.shard, t.bound, t.partitions) for t in tasks] == [(S1, key(20), (0, 1))]


def test_a_view_answers_only_its_reads_and_each_once(store: MemoryStore) -> None:
    asked, other = ops.LastSeqno(S1), ops.LastSeqno(S1)
    with ops.view(store, asked) as view:
        assert view[asked] is None
        with pytest.raises(KeyError):
            view[asked]
        with pytest.raises(KeyError):
            view[other]


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_last_seqno_is_the_greatest_below_its_bound(backend: str, tmp_path: Path) -> None:
    """One seek (RocksDB) or one bisection (memory): the shard's greatest seqno, or the
    greatest below ``below``; ``None`` when there is none, whatever the shards around
    it hold (the shard after S1 shares no key prefix with it)."""
    store: Any = MemoryStore() if backend == "memory" else Store(tmp_path / "db")
    after = ShardIdent(0, 0xC000_0000_0000_0000)
    try:

        def ask(shard: ShardIdent, below: int | None = None) -> int | None:
            question = ops.LastSeqno(shard, below)
            with ops.view(store, question) as view:
                answer: int | None = view[question]
                return answer

        assert ask(S1) is None
        write_diff(store, after, 9, diff_of(5))
        write_diff(store, MC, 4, diff_of(6))
        assert ask(S1) is None  # the neighbours' rows are not S1's
        for seqno, lt in ((1, 10), (2, 20), (3, 30)):
            write_diff(store, S1, seqno, diff_of(lt))
        assert ask(S1) == 3
        assert [ask(S1, below) for below in (0, 1, 2, 3, 4, 2**32 - 1)] == [None, None, 1, 2, 3, 3]
        assert ask(after) == 9
        assert ask(after, 9) is None
        assert ask(MC) == 4
    finally:
        store.close()
