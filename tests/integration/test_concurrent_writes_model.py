"""Appliers of four shards, a committer, a clearer (a cancelled collation), a GC
caller and a reader all race on one real RocksDB queue; the final state must equal the
plain model (``imq.testing.model.QueueModel``) fed the same writes in the order they
took effect.

The order is taken where it is decided: each operation's one batch is logged by a
wrapper around ``Store.write``, which every writing operation calls while it still holds
its facade locks (an apply its read lock and shard mutex, a commit or clear the write
lock), so two operations that do not commute are logged in the order they wrote. GC's
own writes are not logged: it deletes at most up to bounds that only grow, so a final
pass on both sides must leave the same state whatever it did meanwhile (as
``tests/property/test_queue_machine.py`` argues for GC beside sequential commits).
Every wait is bounded, and ``faulthandler`` dumps the stacks of a hang.
"""

from __future__ import annotations

import functools
import random
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
from builders import (
    BASE,
    MC,
    Clock,
    address_in,
    diff_hash,
    message,
    quarter_shards,
    top,
)
from threads import guarded as guarded_by
from threads import hang_guard

from imq import (
    BlockIdShort,
    DiffZone,
    ImqError,
    Queue,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
)
from imq.testing.model import DiffInput, QueueModel

SHARDS = quarter_shards()
DIFFS_PER_SHARD = 30
JOIN = 120.0


@pytest.fixture(autouse=True)
def _hang_guard() -> Iterator[None]:
    with hang_guard():
        yield


_current = threading.local()


def _logged(queue: Queue) -> list[tuple[Any, ...]]:
    """Log the operation of the calling thread (``_current.op``) at each batch write."""
    log: list[tuple[Any, ...]] = []
    store = queue._store
    write = store.write

    def logging_write(txn: Any, **kwargs: Any) -> None:
        write(txn, **kwargs)
        op = getattr(_current, "op", None)
        if op is not None:  # GC's writes (and anything untagged) are not logged
            log.append(op)
            _current.op = None  # one batch per operation

    store.write = logging_write  # type: ignore[method-assign]
    return log


def _run(op: tuple[Any, ...], call: Callable[[], Any]) -> Any:
    _current.op = op
    try:
        return call()
    finally:
        _current.op = None


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_apply_commit_clear_gc_race_equals_the_model_in_write_order(
    queue: Queue, seed: int
) -> None:
    rng = random.Random(seed)
    clock = Clock()
    log = _logged(queue)
    done = threading.Event()
    errors: list[BaseException] = []
    counts = {"commit_refused": 0, "commit_skipped": 0}

    guarded = functools.partial(guarded_by, errors=errors, stop=done)

    def applier(shard: ShardIdent, seed: int) -> None:
        local = random.Random(seed)
        previous: QueueKey | None = None
        for seqno in range(1, DIFFS_PER_SHARD + 1):
            msgs = tuple(
                _message(clock.next_key(), shard, j, local) for j in range(local.randint(1, 4))
            )
            d = DiffInput(
                block=BlockIdShort(shard, seqno),
                diff_hash=diff_hash((shard, seqno, seed)),
                messages=msgs,
                processed_to={} if previous is None else {shard: previous},
            )
            diff = QueueDiff(d.messages, d.processed_to)
            if local.random() < 0.5:
                prepare = partial(queue.prepare_diff, diff, d.block, d.diff_hash)
                pending = _run(("apply", d), prepare)
                assert pending is not None, d.block
                time.sleep(local.uniform(0, 0.002))  # "finalize the block" while holding it
                _run(("apply", d), pending.write)
            else:
                written = _run(("apply", d), partial(queue.apply_diff, diff, d.block, d.diff_hash))
                assert written is True, d.block
            previous = msgs[0].key
            time.sleep(local.uniform(0, 0.001))

    def committer() -> None:
        mc = 0
        while not done.is_set():
            mc += 1
            d = DiffInput(BlockIdShort(MC, mc), diff_hash(("mc", mc, seed)), ())
            diff = QueueDiff((), {})
            assert _run(("apply", d), partial(queue.apply_diff, diff, d.block, d.diff_hash))
            tops = [top(MC, mc)]
            for shard in SHARDS:
                last = queue.get_last_applied_seqno(shard)
                if last is not None:
                    tops.append(top(shard, last, mc))
            try:
                ok = _run(("commit", tops), partial(queue.commit_diff, tops))
            except ImqError:  # a clear removed a listed diff meanwhile: nothing written
                counts["commit_refused"] += 1
            else:
                if not ok:
                    counts["commit_skipped"] += 1
            time.sleep(rng.uniform(0, 0.004))

    def clearer() -> None:
        local = random.Random(seed * 7)
        while not done.is_set():
            time.sleep(local.uniform(0.002, 0.015))
            _run(("clear", tuple(SHARDS)), lambda: queue.clear_uncommitted_state(top_shards=SHARDS))

    def collector() -> None:
        while not done.is_set():
            queue.run_gc()
            time.sleep(0.002)

    def reader() -> None:
        while not done.is_set():
            with queue.iterator(0, [_full(s) for s in SHARDS], BASE) as it:
                keys = [im.message.key for im in it]
            assert keys == sorted(keys) and len(set(keys)) == len(keys)

    appliers = [
        threading.Thread(target=guarded(lambda s=s, i=i: applier(s, seed * 100 + i)), daemon=True)
        for i, s in enumerate(SHARDS)
    ]
    others = [
        threading.Thread(target=guarded(fn), daemon=True)
        for fn in (committer, clearer, collector, reader)
    ]
    for t in [*appliers, *others]:
        t.start()
    for t in appliers:
        t.join(JOIN)
        assert not t.is_alive(), "an applier hung"
    done.set()
    for t in others:
        t.join(JOIN)
        assert not t.is_alive(), "the committer, clearer, collector or reader hung"
    if errors:
        raise errors[0]

    # Replay the logged writes, in their order, on the model.
    model = QueueModel()
    applied = commits = clears = 0
    for op in log:
        if op[0] == "apply":
            assert model.apply(op[1], None) is True, op[1].block
            applied += 1
        elif op[0] == "commit":
            assert model.commit(op[1], (0, 1)) is True
            commits += 1
        else:
            model.clear((0, 1), op[1])
            clears += 1
    assert commits > 0 and clears > 0

    # Counters agree with what was written.
    assert queue.metrics.counter("diffs_applied") == applied
    assert queue.metrics.counter("commits") == commits
    assert queue.metrics.counter("uncommitted_cleared") == clears

    # A last GC pass on both sides; then every observable must agree.
    queue.run_gc()
    model.run_gc()
    assert queue.run_gc() == 0
    _assert_same(queue, model)


def _message(key: QueueKey, shard: ShardIdent, j: int, rng: random.Random) -> Any:
    return message(key, address_in(shard, j % 3), address_in(rng.choice(SHARDS), j))


def _full(shard: ShardIdent) -> QueueShardRange:
    return QueueShardRange(shard, QueueKey.MIN, QueueKey.MAX)


def _assert_same(queue: Queue, model: QueueModel) -> None:
    assert queue.get_commit_pointers() == model.get_commit_pointers()
    assert queue.get_last_committed_mc_block_id() == model.get_last_committed_mc_block_id()
    requested, executed = queue.gc_bounds()
    assert requested == model.gc_requested
    assert executed == model.gc_executed
    for shard in [MC, *SHARDS]:
        assert queue.get_last_applied_seqno(shard) == model.get_last_applied_seqno(shard), shard
        top_seqno = max([DIFFS_PER_SHARD, *model.seqnos(shard)]) + 2
        for seqno in range(1, top_seqno):
            got = queue.get_diff_info(shard, seqno, DiffZone.BOTH)
            assert got == model.get_diff_info(shard, seqno, DiffZone.BOTH), (shard, seqno)
        for key in [QueueKey.MIN, *(p.key for p in model.get_commit_pointers().values())]:
            assert queue.get_diffs_tail_len(shard, key) == model.get_diffs_tail_len(shard, key)
    stored = {}
    for partition in (0, 1):
        with queue.iterator(partition, [_full(s) for s in SHARDS], BASE) as it:
            for im in it:
                stored[(partition, im.source, im.message.key)] = im.message
    assert stored == model.messages
    for partition in (0, 1):
        for shard in SHARDS:
            r = _full(shard)
            assert queue.load_diff_statistics(partition, r) == model.load_diff_statistics(
                partition, r
            )
