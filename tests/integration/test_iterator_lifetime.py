"""The iterator's contract around ``close()`` (docs/behaviour.md 5.6, 5.9):
an iterator that raced the queue's close, and what a closed or exhausted iterator holds."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import BASE, Chain, full_range, open_queue, quarter_shards, quiet_config

from imq import Queue, QueueClosedError
from imq.storage import Table, ops

SOURCES = quarter_shards()


def _populate(queue: Queue) -> int:
    chain = Chain(queue)
    for shard in SOURCES:
        chain.apply(shard, 5)
        chain.apply(shard, 5)
    return 40


@pytest.mark.parametrize("cache", [0, 64 << 20], ids=["rocksdb", "cache"])
def test_an_iterator_created_while_close_runs_raises_and_leaves_the_directory_free(
    db_path: Path, monkeypatch: pytest.MonkeyPatch, cache: int
) -> None:
    """``close()`` running between the iterator's snapshot and its registration (a real
    race, made certain here): the call raises ``QueueClosedError`` like any call that
    raced close, and the cursors it opened do not keep RocksDB's lock, so the directory
    opens again at once (it used to yield every message of the closed queue and leave
    the directory locked until the iterator was collected)."""
    queue = Queue.open(db_path, quiet_config(message_cache_size=cache))
    _populate(queue)
    opened = ops.open_messages

    def open_then_close(*args: Any, **kwargs: Any) -> Any:
        snap = opened(*args, **kwargs)
        closer = threading.Thread(target=queue.close)
        closer.start()
        closer.join()
        return snap

    monkeypatch.setattr(ops, "open_messages", open_then_close)
    kept = []
    with pytest.raises(QueueClosedError):
        kept.append(queue.iterator(0, [full_range(s) for s in SOURCES], BASE))
    monkeypatch.setattr(ops, "open_messages", opened)
    with (
        open_queue(db_path) as again,
        again.iterator(0, [full_range(s) for s in SOURCES], BASE) as it,
    ):
        assert len(list(it)) == 40


def _live_versions(queue: Queue) -> int:
    """RocksDB versions of the messages table still referenced: an open RocksDB iterator
    pins the one it was created on (its memtables and table files, deleted or not)."""
    return queue._store.property_int(Table.MESSAGES, "rocksdb.num-live-versions")


def _rewrite(queue: Queue, chain: Chain) -> None:
    """Replace every message (clear, apply anew) and flush and compact: a new version."""
    queue.clear_uncommitted_state(top_shards=SOURCES)
    for shard in SOURCES:
        chain.apply(shard, 3)
    queue._store.flush([Table.MESSAGES])
    queue.compact()


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """Only reference counting frees objects while the test runs (so a reference cycle
    shows, whenever a collection would have happened to run)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def test_an_exhausted_iterator_kept_for_its_position_pins_no_rocksdb_version(
    db_path: Path, no_cyclic_gc: None
) -> None:
    """A collator keeps its iterator to ask ``current_position()`` later. Once the merge
    has run out, the iterator needs no cursor: it must not keep RocksDB's version (and
    the table files a GC or a clear has since deleted) alive while it is kept."""
    with Queue.open(db_path, quiet_config(message_cache_size=0)) as queue:
        chain = Chain(queue)
        for shard in SOURCES:
            chain.apply(shard, 3)
        queue._store.flush([Table.MESSAGES])
        assert _live_versions(queue) == 1
        it = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
        got = list(it)
        assert len(got) == 12
        position = it.current_position()
        _rewrite(queue, chain)
        assert _live_versions(queue) == 1
        assert it.current_position() == position
        with pytest.raises(StopIteration):
            next(it)


@pytest.mark.parametrize("taken", [0, 1], ids=["fresh", "started"])
@pytest.mark.parametrize("cache", [0, 64 << 20], ids=["rocksdb", "cache"])
def test_a_dropped_iterator_is_freed_at_once(
    db_path: Path, no_cyclic_gc: None, taken: int, cache: int
) -> None:
    """An iterator dropped before its end (a ``for`` loop left with ``break``, a reader
    that lost interest) is freed by reference counting, with its cursors: it is in no
    reference cycle, so it does not wait for Python's cyclic collector while pinning
    RocksDB's version (it used to: the iterator and its merge generator referred to each
    other)."""
    with Queue.open(db_path, quiet_config(message_cache_size=cache)) as queue:
        chain = Chain(queue)
        for shard in SOURCES:
            chain.apply(shard, 3)
        queue._store.flush([Table.MESSAGES])
        it = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
        for _ in range(taken):
            next(it)
        ref = weakref.ref(it)
        del it
        assert ref() is None, "the dropped iterator is still alive (a reference cycle)"
        _rewrite(queue, chain)
        assert _live_versions(queue) == 1
        if taken:
            assert queue.metrics.counter("messages_iterated") == taken


@pytest.mark.parametrize("how", ["close", "drop", "queue-close"])
def test_messages_taken_before_a_close_inside_a_batch_are_counted(db_path: Path, how: str) -> None:
    """``messages_iterated`` counts every message handed to the consumer, also when the
    iterator ends inside a batch (a bounded read always does); it used to count whole
    batches only, so a read of 5 messages counted 0."""
    queue = Queue.open(db_path, quiet_config())
    try:
        _populate(queue)
        it = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
        for _ in range(5):
            next(it)
        if how == "close":
            it.close()
        elif how == "queue-close":
            queue.close()
        del it
        gc.collect()
        assert queue.metrics.counter("messages_iterated") == 5
    finally:
        queue.close()
