"""``close()`` under load: every call racing it completes or raises ``QueueClosedError``.

Four writers, a committer, two readers and a GC caller run against one queue (with the
background GC worker on) while the main thread closes it at a random moment. Then the
directory must open again in the same process and hold every acknowledged diff and
commit. The ``slow`` variant (``make soak``) runs many more rounds.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from builders import (
    BASE,
    MC,
    Chain,
    Clock,
    block,
    diff_hash,
    full_range,
    make_diff,
    messages,
    quarter_shards,
    quiet_config,
    top,
)

from imq import DiffZone, Queue, QueueKey
from imq.errors import QueueClosedError
from imq.storage import Table

SHARDS = quarter_shards()
CONFIG = replace(quiet_config(), gc_enabled=True, gc_interval=0.005)


def _round(path: Path, rng: random.Random) -> dict[str, int]:
    queue = Queue.open(path, CONFIG)
    acked: dict[Any, int] = {s: queue.get_last_applied_seqno(s) or 0 for s in [*SHARDS, MC]}
    committed = [queue.get_last_committed_mc_block_id()]
    attempted = list(committed)
    errors: list[BaseException] = []
    calls = [0]
    clock = Clock(start=1_000 + 100_000 * (acked[SHARDS[0]] + 1))
    lock = threading.Lock()

    def writer(shard: Any) -> None:
        previous: dict[Any, QueueKey] = {}
        while True:
            seqno = acked[shard] + 1
            with lock:
                msgs = messages(clock, shard, 40)
            diff = make_diff(msgs, processed_to=previous)
            queue.apply_diff(
                diff, block(shard, seqno), diff_hash((shard, seqno)), None, DiffZone.BOTH
            )
            acked[shard] = seqno
            previous = {shard: msgs[0].key}

    def committer() -> None:
        while True:
            seqno = acked[MC] + 1
            queue.apply_diff(make_diff(), block(MC, seqno), diff_hash(("mc", seqno)))
            acked[MC] = seqno
            tops = [top(MC, seqno)] + [top(s, acked[s], seqno) for s in SHARDS if acked[s]]
            attempted.append(tops[0].block_id)
            if queue.commit_diff(tops):
                committed.append(tops[0].block_id)

    def iterating() -> None:
        while True:
            with queue.iterator(0, [full_range(s) for s in SHARDS], BASE) as it:
                for _ in it:
                    pass

    def reading() -> None:
        while True:
            for shard in SHARDS:
                queue.get_diffs_tail_len(shard, QueueKey.MIN)
                queue.load_diff_statistics(0, full_range(shard))
            queue.summary()

    def collecting() -> None:
        while True:
            queue.run_gc()

    def guarded(fn: Callable[..., None], *args: Any) -> Callable[[], None]:
        def run() -> None:
            try:
                fn(*args)
            except QueueClosedError:
                pass
            except BaseException as exc:
                errors.append(exc)

        return run

    workers = [guarded(writer, s) for s in SHARDS]
    workers += [guarded(committer), guarded(iterating), guarded(reading), guarded(collecting)]
    threads = [threading.Thread(target=w, daemon=True) for w in workers]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(0.002, 0.04))
    queue.close()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a call racing close() hung"
    calls[0] = sum(acked.values())
    if errors:
        raise errors[0]

    again = Queue.open(path, quiet_config(gc_enabled=False))  # the directory is free
    try:
        for shard, seqno in acked.items():
            if seqno:
                assert again.get_diff_info(shard, seqno, DiffZone.BOTH) is not None, (shard, seqno)
        # The last acknowledged commit, or the one close() interrupted after its write.
        assert again.get_last_committed_mc_block_id() in (committed[-1], attempted[-1])
    finally:
        again.close()
    return {"acked": calls[0]}


def _rounds(tmp_path: Path, n: int) -> None:
    rng = random.Random(12)
    for i in range(n):
        _round(tmp_path / f"q{i % 3}", rng)


def test_close_under_load(tmp_path: Path) -> None:
    _rounds(tmp_path, 12)


@pytest.mark.slow
def test_close_under_load_many_times(tmp_path: Path) -> None:
    _rounds(tmp_path, 300)


def test_a_write_staged_while_close_runs_raises_queue_closed(tmp_path: Path) -> None:
    """The window the race above hits now and then, made certain: ``close()`` drops the
    table handles while a diff is being staged (it used to leak ``KeyError``)."""
    queue = Queue.open(tmp_path / "q", quiet_config())
    txn = queue._store.transaction()
    queue.close()
    with pytest.raises(QueueClosedError):
        txn.put(Table.STATISTICS, b"k", b"v")
    with pytest.raises(QueueClosedError):
        txn.writer(Table.MESSAGES)
    with pytest.raises(QueueClosedError):
        txn.delete_range(Table.DIFF_TAIL, b"a", b"b")
    Queue.open(tmp_path / "q", quiet_config()).close()


def test_close_beside_a_manual_compaction_releases_the_directory(tmp_path: Path) -> None:
    """An outside audit: ``close()`` returned while another thread's ``compact()`` still
    held a table's handle, so RocksDB stayed open under it and a reopen in the same
    process failed (``DatabaseLockedError``), even after that thread had ended while its
    caller kept the ``QueueClosedError`` (its traceback held the handle). ``close()`` now
    waits for other threads' manual compactions, and none keeps a handle once it fails."""
    db = tmp_path / "db"
    queue = Queue.open(db, quiet_config(write_buffer_size=1 << 20))
    chain = Chain(queue)
    for _ in range(150):
        chain.apply(SHARDS[0], 30, body=b"x" * 200)
    caught: list[BaseException] = []

    def compact_until_closed() -> None:
        try:
            while True:
                queue.compact()
        except BaseException as exc:
            caught.append(exc)

    compactor = threading.Thread(target=compact_until_closed)
    compactor.start()
    time.sleep(0.05)
    queue.close()
    Queue.open(db, quiet_config()).close()  # the directory is free at once
    compactor.join(30)
    assert not compactor.is_alive()
    assert len(caught) == 1 and isinstance(caught[0], QueueClosedError), caught
    Queue.open(db, quiet_config()).close()  # and with the error still held


def test_close_ends_the_waits_of_calls_queued_for_a_lock(tmp_path: Path) -> None:
    """An outside audit: calls waiting for a lock behind a pending diff (a commit for the
    write lock, a prepare queued behind that writer, a prepare of the held shard for its
    mutex) went on waiting after ``close()``, forever if the diff was never written.
    They now raise ``QueueClosedError``, as any call on a closed queue does."""
    db = tmp_path / "db"
    queue = Queue.open(db, quiet_config())
    chain = Chain(queue)
    mc = chain.apply(MC, 1)
    held = chain.build(SHARDS[0], 2)
    pending = queue.prepare_diff(held.diff, held.block, held.hash)
    assert pending is not None
    other, same = chain.build(SHARDS[1], 2), chain.build(SHARDS[0], 2)
    calls: dict[str, Callable[[], object]] = {
        "commit": lambda: queue.commit_diff([mc.top()]),
        "apply behind the writer": lambda: queue.apply_diff(other.diff, other.block, other.hash),
        "apply of the held shard": lambda: queue.apply_diff(same.diff, same.block, same.hash),
    }
    raised: dict[str, BaseException] = {}

    def run(name: str) -> None:
        try:
            calls[name]()
        except BaseException as exc:
            raised[name] = exc

    threads = [threading.Thread(target=run, args=(name,)) for name in calls]
    for thread in threads:
        thread.start()
        time.sleep(0.1)  # in order: the commit waits first
    assert not raised, raised
    queue.close()
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive(), "a call still waits after close()"
    assert set(raised) == set(calls)
    assert all(isinstance(e, QueueClosedError) for e in raised.values()), raised
    with pytest.raises(QueueClosedError):
        pending.write()
    Queue.open(db, quiet_config()).close()
