"""Checks that must fire: each test here makes one of imq's own checks meet the fault it
exists for (a scan's end check, the import's synced marker). Written after a round of
hand mutation testing (stop 30): each of these checks could be broken without any other
test failing (verify's own such tests are in test_verify.py). A second round (stop 33,
82 mutants) added the rest of this file: boundaries no test reached (two keys one apart,
a debt met exactly), checks no test triggered, counters no test read.
"""

from __future__ import annotations

import io
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from builders import MC, Chain, open_queue, quiet_config, split_shard
from rocksdict import Options, Rdict
from state_fixtures import write_state
from test_gc import apply_keys, commit
from test_verify import LEFT, _build, _gc_inside_a_diff, _tamper

from imq import ImqError, Queue, QueueKey, QueueShardRange
from imq.cli.maintenance import run_gc
from imq.errors import CorruptDataError
from imq.gc import GarbageCollector
from imq.observability import capture_events
from imq.state.synth import synth_state
from imq.storage import Table, codec, ops
from imq.storage.rocks import Cursor, Scan
from imq.verify import verify

# -- the end check of a scan (imq/storage/rocks.py, _EndCheck) -------------------------------


class _StopsEarly:
    """A rocksdict handle whose row loops end after ``n`` rows, as rocksdict's loops end
    quietly when RocksDB's iterator turns invalid on a damaged block; the raw iterator
    (``iter``, which the end check uses) is the real one."""

    def __init__(self, db: Rdict, n: int) -> None:
        self._db = db
        self._n = n

    def items(self, *args: Any, **kwargs: Any) -> Any:
        return islice(self._db.items(*args, **kwargs), self._n)

    def keys(self, *args: Any, **kwargs: Any) -> Any:
        return islice(self._db.keys(*args, **kwargs), self._n)

    def iter(self, *args: Any) -> Any:
        return self._db.iter(*args)


@pytest.fixture
def rdict(tmp_path: Path) -> Any:
    db = Rdict(str(tmp_path / "raw"), Options(raw_mode=True))
    for i in range(5):
        db[b"k%d" % i] = b"v%d" % i
    yield db
    db.close()


@pytest.mark.parametrize("keys_only", [False, True])
def test_a_scan_that_ends_early_raises_instead_of_reading_short(
    rdict: Any, keys_only: bool
) -> None:
    scan = Scan(Table.MESSAGES, b"k", b"l", keys_only=keys_only)
    assert len(list(Cursor(rdict, scan).items)) == 5  # the whole range: no error
    with pytest.raises(CorruptDataError, match="ended early"):
        list(Cursor(_StopsEarly(rdict, 2), scan).items)


def test_the_merge_path_end_check_raises_when_rows_end_early(rdict: Any) -> None:
    """The merge iterator pulls ``Cursor.rows`` and calls ``finish(last_key)`` itself."""
    cursor = Cursor(_StopsEarly(rdict, 2), Scan(Table.MESSAGES, b"k", b"l"))
    rows = list(cursor.rows)
    assert [k for k, _ in rows] == [b"k0", b"k1"]
    with pytest.raises(CorruptDataError, match="ended early"):
        cursor.finish(rows[-1][0])


# -- import durability (imq/state/importer.py) --------------------------------------------


def test_the_import_marker_and_the_final_batch_are_synced(tmp_path: Path) -> None:
    """docs/architecture.md: the import-in-progress marker is written with fsync before
    any row of the import, and the last batch (pointer, marker removed) too. A lost fsync
    cannot be seen by a process kill (the log stays in the page cache), only by watching
    the writes."""
    state = synth_state(diffs=2, messages_per_diff=[30, 20], seed=3)
    path, _ = write_state(state, tmp_path / "s.bin")
    queue = open_queue(tmp_path / "db")
    try:
        store = queue._store
        original = store.write
        writes: list[tuple[bool, bool]] = []  # (sync, the marker is stored after it)

        def write(txn: Any, *, sync: bool = False) -> None:
            original(txn, sync=sync)
            writes.append((sync, ops.read_import_marker(store) is not None))

        store.write = write  # type: ignore[method-assign]
        try:
            queue.import_state(path, state.block_id, state.top_update)
        finally:
            del store.write
        assert len(writes) >= 3
        first_sync, marker_stored = writes[0]
        assert marker_stored and first_sync, writes  # the marker, synced, comes first
        last_sync, marker_left = writes[-1]
        assert last_sync and not marker_left, writes
    finally:
        queue.close()


# -- GC at its boundaries: two keys one apart, a debt met exactly ---------------------------

A = split_shard(0, 1, 0)
K1 = QueueKey(100, bytes(31) + b"\x01")
K2 = K1.next_value()  # the key just above K1
K3 = QueueKey(200, bytes(31) + b"\x07")


def test_gc_keeps_the_cached_row_just_above_its_bound(tmp_path: Path) -> None:
    """GC up to K1 deletes up to (not including) K1's successor from the cache of fresh
    rows; K2, the successor and its chunk's last row, stays readable from it."""
    with Queue.open(tmp_path / "db", quiet_config()) as queue:
        chain = Chain(queue)
        a = apply_keys(chain, A, [K1, K2])
        mc = chain.apply(MC, 0, processed_to={A: K1})
        commit(queue, mc, a)
        queue.run_gc()
        with queue.iterator(0, [QueueShardRange(A, K2, QueueKey.MAX)], A) as it:
            assert [m.message.key for m in it] == [K2]
        assert queue.message_cache_stats()["hits"] >= 1  # the read the cache served


def test_gc_counts_a_deletion_of_the_one_key_above_the_executed_bound(tmp_path: Path) -> None:
    """Without the cache (the diff records and gaps path), a deletion of exactly the
    executed bound's successor counts that one message."""
    with Queue.open(tmp_path / "db", quiet_config(message_cache_size=0)) as queue:
        chain = Chain(queue)
        a = apply_keys(chain, A, [K1, K2, K3])
        mc = chain.apply(MC, 0, processed_to={A: K1})
        commit(queue, mc, a)
        assert queue.run_gc_report().messages == 1
        mc = chain.apply(MC, 0, processed_to={A: K2})
        commit(queue, mc, idle=[a])
        report = queue.run_gc_report()
        assert [r.messages for r in report.ranges if r.partition == 0] == [1]


def test_a_pass_that_meets_the_compaction_debt_exactly_compacts(tmp_path: Path) -> None:
    """GC compacts once the deleted ranges hold ``compaction_debt`` messages: at the
    limit, not past it."""
    with Queue.open(tmp_path / "db", quiet_config(compaction_debt=3)) as queue:
        chain = Chain(queue)
        a = apply_keys(chain, A, [K1, K2, K3])
        keep = chain.apply(A, 1)
        mc = chain.apply(MC, 0, processed_to={A: K3})
        commit(queue, mc, keep)
        report = queue.run_gc_report()
        assert report.messages == 3
        assert queue._gc.debt == 0 and report.compaction_seconds > 0, (queue._gc.debt, a)


def _collectable_db(path: Path) -> None:
    with Queue.open(path, quiet_config()) as queue:
        chain = Chain(queue)
        a = apply_keys(chain, A, [K1, K2, K3])
        mc = chain.apply(MC, 0, processed_to={A: K2})
        commit(queue, mc, a)


def test_imq_gc_fails_when_a_range_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``imq gc``: work that failed is an error (exit status 1), not a quiet success."""
    db = tmp_path / "db"
    _collectable_db(db)

    def boom(self: object, task: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(GarbageCollector, "_delete", boom)
    with pytest.raises(ImqError, match="failed"):
        run_gc(db, progress=False, out=io.StringIO())


# -- verify's checks and the counters no test read ---------------------------------------


def test_a_masterchain_pointer_without_its_block_is_reported(tmp_path: Path) -> None:
    """A masterchain commit pointer comes with a last committed block: ``imq verify``
    and the open-time integrity check both report one without it."""
    db = tmp_path / "db"
    _build(db)
    _tamper(db, lambda t: t.delete(Table.VARS, codec.LAST_COMMITTED_MC_BLOCK))
    problem = "a masterchain commit pointer but no last committed block"
    assert problem in verify(db).problems
    with capture_events() as events:
        Queue.open(db, quiet_config()).close()
    failed = [e["problem"] for e in events if e["event"] == "integrity_check_failed"]
    assert failed == [problem]


def test_a_lower_executed_bound_does_not_hide_a_higher_requested_one(tmp_path: Path) -> None:
    """GC may have deleted up to the higher of its executed and requested bounds (the
    deletes written, the pass not yet marked): verify counts no loss below either."""
    db = tmp_path / "db"
    _gc_inside_a_diff(db)
    older = {(0, LEFT): QueueKey.MIN}  # an earlier pass's mark, below the first diff
    _tamper(db, lambda t: t.put(Table.VARS, codec.GC_EXECUTED, codec.gc_bounds_value(older)))
    report = verify(db)
    assert report.ok, report.problems


def test_the_summary_and_the_import_and_export_counters(tmp_path: Path) -> None:
    db = tmp_path / "db"
    _collectable_db(db)
    with Queue.open(db, quiet_config()) as queue:
        queue.run_gc()
        assert queue.summary()["gc"][f"0/{A}"]["executed"] == K2.to_json()
    state = synth_state(diffs=2, messages_per_diff=[3, 2], seed=1)
    path, _ = write_state(state, tmp_path / "s.bin")
    with Queue.open(tmp_path / "db2", quiet_config()) as queue:
        queue.import_state(path, state.block_id, state.top_update)
        assert queue.metrics.counter("states_imported") == 1
        assert queue.metrics.counter("messages_imported") == 5
        queue.export_state(state.shard, state.seqno, 2, tmp_path / "back.bin")
        assert queue.metrics.counter("states_exported") == 1


def test_verify_takes_a_gc_bound_at_a_diffs_first_message_as_inside_its_span(
    tmp_path: Path,
) -> None:
    """A reader that processed exactly a diff's first message puts the GC bound at the
    diff's ``min_message``: GC deletes that message and keeps the diff (its max lies
    above), and ``imq verify`` must count the span as partly collected, not as a
    message lost."""
    path = tmp_path / "db"
    with Queue.open(path, quiet_config()) as queue:
        chain = Chain(queue)
        a = apply_keys(chain, A, [K1, K2, K3])
        mc = chain.apply(MC, 0, processed_to={A: K1})
        commit(queue, mc, a)
        assert queue.run_gc_report().messages == 1
        info = queue.get_diff_info(A, a.seqno)
        assert info is not None and info.min_message == K1
    report = verify(path)
    assert report.ok, report.problems


def test_a_compaction_debt_of_zero_never_compacts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compaction_debt=0`` means never (docs/api.md, QueueConfig): the passes only
    delete, and what they deleted stays owed, whatever it adds up to."""
    config = quiet_config(compaction_debt=0, compact_after_delete=False)
    with Queue.open(tmp_path / "db", config) as queue:
        compacted: list[object] = []
        monkeypatch.setattr(queue._store, "compact", compacted.append)
        chain = Chain(queue)
        apply_keys(chain, A, [K1, K2, K3])
        keep = chain.apply(A, 1)
        mc = chain.apply(MC, 0, processed_to={A: K3})
        commit(queue, mc, keep)
        report = queue.run_gc_report()
        assert report.messages == 3
        assert compacted == [] and report.compaction_seconds == 0
        assert queue._gc.debt == 3
