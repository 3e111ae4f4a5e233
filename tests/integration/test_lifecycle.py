"""Open, close, reopen, locking, schema version, corrupt rows, metrics and log events."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import pytest
from builders import (
    BASE,
    MC,
    Chain,
    address_in,
    block,
    block_id,
    diff_hash,
    dump,
    full_range,
    iterate_all,
    key,
    make_diff,
    open_queue,
    quiet_config,
    rows,
    split_shard,
    state,
    top,
)

from imq import (
    CorruptDataError,
    DatabaseLockedError,
    DiffZone,
    ImqError,
    PartitionRouter,
    Queue,
    QueueClosedError,
    QueueKey,
    QueueShardRange,
    SchemaVersionError,
)
from imq.storage import Table, codec, rocks
from imq.storage.rocks import INFO_LOG_FILES

S = split_shard(0, 1, 0)
OTHER = split_shard(0, 1, 1)
SHARDS = [MC, S, OTHER]


def populate(queue: Queue) -> Chain:
    """Committed and uncommitted diffs in three partitions; no processed_to (so no GC)."""
    chain = Chain(queue)
    router = PartitionRouter(dst={1: [address_in(OTHER, 1)], 2: [address_in(S, 2)]})
    dsts = [address_in(OTHER, 1), address_in(S, 2), address_in(OTHER, 3), address_in(MC, 4)]
    mc = chain.apply(MC, dsts, router=router)
    s1 = chain.apply(S, dsts, router=router)
    chain.apply(OTHER, dsts, router=router)
    assert queue.commit_diff([mc.top(), s1.top(1)])
    chain.apply(S, dsts, router=router)
    chain.apply(OTHER, dsts)
    return chain


# -- close ------------------------------------------------------------------------------------


def test_close_is_idempotent(db_path: Path) -> None:
    queue = open_queue(db_path)
    assert queue.closed is False
    assert queue.path == db_path
    queue.close()
    assert queue.closed is True
    queue.close()
    assert queue.closed is True


def test_a_clean_close_has_no_close_error(db_path: Path) -> None:
    queue = open_queue(db_path)
    assert queue.close_error is None  # still open
    queue.close()
    assert queue.close_error is None  # closed cleanly (the CLI's damaged-file case sets it)


def test_context_manager_closes(db_path: Path) -> None:
    with open_queue(db_path) as queue:
        assert not queue.closed
    assert queue.closed
    with pytest.raises(RuntimeError), open_queue(db_path) as queue:
        raise RuntimeError("boom")
    assert queue.closed
    with open_queue(db_path):  # the lock was released both times
        pass


CALLS: dict[str, Callable[[Queue], Any]] = {
    "prepare_diff": lambda q: q.prepare_diff(make_diff(), block(S, 9), diff_hash(9)),
    "apply_diff": lambda q: q.apply_diff(make_diff(), block(S, 9), diff_hash(9)),
    "commit_diff": lambda q: q.commit_diff([top(MC, 9, updated=False)]),
    "clear_uncommitted_state": lambda q: q.clear_uncommitted_state(),
    "startup": lambda q: q.startup(block_id(MC, 9), [S]),
    "iterator": lambda q: q.iterator(0, [full_range(S)], BASE),
    "get_diff_info": lambda q: q.get_diff_info(S, 1),
    "is_diff_exists": lambda q: q.is_diff_exists(block(S, 1)),
    "get_diffs_tail_len": lambda q: q.get_diffs_tail_len(S, QueueKey.MIN),
    "load_diff_statistics": lambda q: q.load_diff_statistics(0, full_range(S)),
    "load_separated_diff_statistics": lambda q: q.load_separated_diff_statistics(
        [0], full_range(S)
    ),
    "get_last_committed_mc_block_id": lambda q: q.get_last_committed_mc_block_id(),
    "get_commit_pointers": lambda q: q.get_commit_pointers(),
    "get_last_applied_seqno": lambda q: q.get_last_applied_seqno(S),
    "run_gc": lambda q: q.run_gc(),
    "run_gc_report": lambda q: q.run_gc_report(),
}


@pytest.mark.parametrize("method", sorted(CALLS))
def test_every_method_after_close_raises(db_path: Path, method: str) -> None:
    queue = open_queue(db_path)
    populate(queue)
    CALLS[method](queue)  # works while open
    queue.close()
    with pytest.raises(QueueClosedError):
        CALLS[method](queue)


def test_state_import_and_export_after_close_raise_and_touch_no_file(
    db_path: Path, tmp_path: Path
) -> None:
    """Both check the queue before they look at a file (their work while open is tested
    in the state tests, on real message BOCs)."""
    queue = open_queue(db_path)
    populate(queue)
    queue.close()
    dest = tmp_path / "closed.queue"
    with pytest.raises(QueueClosedError):
        queue.export_state(S, 1, 1, dest)
    assert not dest.exists()
    source = tmp_path / "some.queue"
    source.write_bytes(b"not read")
    with pytest.raises(QueueClosedError):
        queue.import_state(source, block_id(S, 1))
    assert source.read_bytes() == b"not read"


def test_pending_diff_written_after_close(db_path: Path) -> None:
    queue = open_queue(db_path)
    pending = queue.prepare_diff(make_diff(), block(S, 1), diff_hash(1))
    assert pending is not None
    queue.close()
    with pytest.raises(QueueClosedError):
        pending.write()
    assert pending.state != "written"
    with open_queue(db_path) as again:
        assert again.get_diff_info(S, 1) is None


# -- reopen -----------------------------------------------------------------------------------


def test_reopen_keeps_everything(db_path: Path) -> None:
    with open_queue(db_path) as queue:
        chain = populate(queue)
        before = dump(queue)
        api = state(queue, SHARDS)
        infos = {a.block: queue.get_diff_info(a.shard, a.seqno) for a in chain.applied}
        messages = {p: iterate_all(queue, SHARDS, p) for p in (0, 1, 2)}
        stats = {p: queue.load_separated_diff_statistics([p], full_range(S)) for p in (0, 1, 2)}
    with open_queue(db_path) as queue:
        assert dump(queue) == before
        assert state(queue, SHARDS) == api
        assert {b: queue.get_diff_info(b.shard, b.seqno) for b in infos} == infos
        assert {p: iterate_all(queue, SHARDS, p) for p in (0, 1, 2)} == messages
        assert {
            p: queue.load_separated_diff_statistics([p], full_range(S)) for p in (0, 1, 2)
        } == stats
        # Zones survive too (they follow the reloaded pointers).
        assert queue.get_diff_info(S, 1, DiffZone.COMMITTED) is not None
        assert queue.get_diff_info(S, 2, DiffZone.UNCOMMITTED) is not None
        assert all(v for v in messages.values())


def test_restarts_keep_a_bounded_number_of_rocksdb_text_logs(db_path: Path) -> None:
    # RocksDB starts a new LOG at every open and by default keeps 1,000 old ones.
    for _ in range(INFO_LOG_FILES + 5):
        Queue.open(db_path).close()
    logs = sorted(p.name for p in db_path.iterdir() if p.name.startswith("LOG"))
    assert "LOG" in logs
    assert len(logs) == INFO_LOG_FILES, logs


def test_a_long_running_writer_starts_new_manifests(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every flush and compaction appends to the MANIFEST, which every open reads three
    times; RocksDB's default cap is 1 GB. A writer that compacted after each of ~800
    diffs left a 2 MB MANIFEST and 45 ms read-only opens: imq caps it (at 1 MiB; 16 KiB
    here, so that a few compactions pass it)."""
    cap = 16 << 10
    monkeypatch.setattr(rocks, "MANIFEST_FILE_SIZE", cap)
    with open_queue(db_path) as queue:
        first = _manifests(db_path)
        chain = Chain(queue)
        for _ in range(40):
            chain.apply(S, 5)
            queue.compact()
        last = _manifests(db_path)
        assert chain.applied and queue.get_last_applied_seqno(S) == 40
    assert len(first) == len(last) == 1, (first, last)
    assert last[0][0] != first[0][0]  # a new MANIFEST while the queue stayed open
    assert last[0][1] < 2 * cap, last  # RocksDB passes the cap by at most one edit
    with open_queue(db_path) as queue:
        assert queue.get_last_applied_seqno(S) == 40


def _manifests(path: Path) -> list[tuple[str, int]]:
    return [(p.name, p.stat().st_size) for p in path.iterdir() if p.name.startswith("MANIFEST")]


# -- locking ----------------------------------------------------------------------------------


def test_second_open_in_the_same_process_is_refused(db_path: Path) -> None:
    first = open_queue(db_path)
    try:
        with pytest.raises(DatabaseLockedError, match=str(db_path)):
            open_queue(db_path)
        Chain(first).apply(S, 2)  # the first queue is unaffected
        assert first.get_last_applied_seqno(S) == 1
    finally:
        first.close()
    with open_queue(db_path) as again:
        assert again.get_last_applied_seqno(S) == 1


_CHILD = textwrap.dedent(
    """
    import logging, sys
    import structlog
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    from imq import DatabaseLockedError, Queue, QueueConfig, ShardIdent
    try:
        q = Queue.open(sys.argv[1], QueueConfig.testing())
    except DatabaseLockedError as exc:
        print(f"DatabaseLockedError: {exc}", file=sys.stderr)
        sys.exit(3)
    print("seqno", q.get_last_applied_seqno(ShardIdent.parse(sys.argv[2])))
    q.close()
    """
)


def _child(db_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(db_path), str(S)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_second_process_is_refused_while_the_first_holds_the_lock(db_path: Path) -> None:
    queue = open_queue(db_path)
    try:
        Chain(queue).apply(S, 1)
        held = _child(db_path)
        assert held.returncode == 3, held.stderr
        assert "DatabaseLockedError" in held.stderr
    finally:
        queue.close()
    free = _child(db_path)
    assert free.returncode == 0, free.stderr
    assert "seqno 1" in free.stdout


def test_this_process_is_refused_while_another_holds_the_lock(db_path: Path) -> None:
    open_queue(db_path).close()
    holder = textwrap.dedent(
        """
        import logging, sys
        import structlog
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
        from imq import Queue, QueueConfig
        q = Queue.open(sys.argv[1], QueueConfig.testing())
        print("ready", flush=True)
        sys.stdin.readline()
        q.close()
        print("closed", flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", holder, str(db_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        with pytest.raises(DatabaseLockedError):
            open_queue(db_path)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert out.strip() == "closed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    with open_queue(db_path):
        pass


# -- schema version ---------------------------------------------------------------------------


def test_schema_version_mismatch(db_path: Path) -> None:
    with open_queue(db_path) as queue:
        Chain(queue).apply(S, 1)
        queue._store._tables[Table.VARS].put(codec.SCHEMA_VERSION_KEY, codec.u32_value(99))
    for _ in range(2):  # a failed open releases the lock: the same error again
        with pytest.raises(SchemaVersionError, match="99") as info:
            open_queue(db_path)
        assert "open it with the imq version that wrote it" in str(info.value)  # what to do
    with pytest.raises(SchemaVersionError, match="imq version that wrote it"):
        Queue.open(db_path, read_only=True)


def test_missing_schema_version_with_data(db_path: Path) -> None:
    with open_queue(db_path) as queue:
        Chain(queue).apply(S, 1)
        queue._store._tables[Table.VARS].delete(codec.SCHEMA_VERSION_KEY)
    with pytest.raises(SchemaVersionError):
        open_queue(db_path)


def test_schema_version_is_written_on_create(db_path: Path) -> None:
    with open_queue(db_path) as queue:
        assert dict(rows(queue, Table.VARS)) == {
            codec.SCHEMA_VERSION_KEY: codec.u32_value(codec.SCHEMA_VERSION)
        }


def test_corrupt_schema_version_bytes(db_path: Path) -> None:
    with open_queue(db_path) as queue:
        queue._store._tables[Table.VARS].put(codec.SCHEMA_VERSION_KEY, b"\x01\x02\x03")
    with pytest.raises(CorruptDataError) as err:
        open_queue(db_path)
    assert err.value.table == "vars"
    with pytest.raises(CorruptDataError):  # and the lock was released
        open_queue(db_path)


# -- corrupt rows -----------------------------------------------------------------------------

GARBAGE = {
    "text": b"garbage",
    "empty": b"",
    "msgpack-reserved-byte": b"\xc1",
    "one-element-array": b"\x91\x01",
    "map": b"\x81\xa1a\x01",
    "eleven-ints": b"\x9b" + b"\x01" * 11,
    "version-2": b"\x9b\x02" + b"\xc0" * 10,
}


@pytest.mark.parametrize("garbage", list(GARBAGE.values()), ids=list(GARBAGE))
def test_corrupt_diff_info_raises_corrupt_data_error(queue: Queue, garbage: bytes) -> None:
    chain = Chain(queue)
    a = chain.apply(S, 2)
    row_key = codec.diff_info_key(S, 1)
    queue._store._tables[Table.DIFF_INFO].put(row_key, garbage)

    def check(call: Callable[[], Any]) -> None:
        with pytest.raises(CorruptDataError) as err:
            call()
        assert err.value.table == "diff_info"
        assert err.value.key == row_key
        assert "diff_info" in str(err.value)
        assert row_key.hex() in str(err.value)

    for zone in DiffZone:
        check(functools.partial(queue.get_diff_info, S, 1, zone))
    check(lambda: queue.is_diff_exists(a.block))
    check(lambda: queue.apply_diff(a.diff, a.block, a.hash))  # duplicate check
    later = chain.build(S, 1)
    check(lambda: queue.apply_diff(later.diff, later.block, later.hash, None, DiffZone.BOTH))
    mc = chain.apply(MC, 0)
    check(lambda: queue.commit_diff([mc.top(), a.top(1)]))
    # No lock was left behind by the failed calls.
    assert queue.apply_diff(later.diff, later.block, later.hash) is True
    assert queue.commit_diff([mc.top(), later.top(1)]) is True


def test_truncated_diff_info_record(queue: Queue) -> None:
    Chain(queue).apply(S, 2)
    row_key, value = rows(queue, Table.DIFF_INFO)[0]
    for cut in (1, len(value) // 2, len(value) - 1):
        queue._store._tables[Table.DIFF_INFO].put(row_key, value[:cut])
        with pytest.raises(CorruptDataError) as err:
            queue.get_diff_info(S, 1)
        assert err.value.table == "diff_info"
        assert err.value.key == row_key


_MSG_KEY = codec.message_key(0, S, key(5))
CORRUPT_MESSAGES = {
    "empty-value": (_MSG_KEY, b""),
    "header-byte-only": (_MSG_KEY, b"\x80"),
    "short-header": (_MSG_KEY, b"\x80" + bytes(40)),
    "short-key": (_MSG_KEY[:-1], b"\x80" + bytes(65) + b"body"),
    "long-key": (_MSG_KEY + b"\x00", b"\x80" + bytes(65) + b"body"),
}


@pytest.mark.parametrize(
    ("row_key", "value"), list(CORRUPT_MESSAGES.values()), ids=list(CORRUPT_MESSAGES)
)
def test_corrupt_message_row_raises_corrupt_data_error(
    db_path: Path, row_key: bytes, value: bytes
) -> None:
    with open_queue(db_path) as queue:
        Chain(queue).apply(S, [address_in(BASE, i) for i in range(3)])
        # A damaged row on disk, written behind the store's back: the queue that wrote
        # the diff still serves it from its cache of fresh rows (the bytes it wrote);
        # a queue opened on the directory reads RocksDB and finds the damage.
        queue._store._tables[Table.MESSAGES].put(row_key, value)
        assert len(list(queue.iterator(0, [full_range(S)], BASE))) == 3
    with (
        open_queue(db_path) as queue,
        queue.iterator(0, [full_range(S)], BASE) as it,
        pytest.raises(CorruptDataError) as err,
    ):
        list(it)
    assert err.value.table == "messages"
    assert err.value.key == row_key, "the error should name the corrupt row's key"


def test_corrupt_statistics_row(queue: Queue) -> None:
    Chain(queue).apply(S, 2)
    row_key, _ = rows(queue, Table.STATISTICS)[0]
    queue._store._tables[Table.STATISTICS].put(row_key, b"\x01\x02\x03")
    for load in (
        lambda: queue.load_diff_statistics(0, full_range(S)),
        lambda: queue.load_separated_diff_statistics([0], full_range(S)),
    ):
        with pytest.raises(CorruptDataError) as err:
            load()
        assert err.value.table == "statistics"
        assert err.value.key == row_key


def test_corrupt_diff_info_key(queue: Queue) -> None:
    Chain(queue).apply(S, 2)
    bad_key = codec.shard_bytes(S) + b"\xff" * 5  # one byte too long, sorts last
    queue._store._tables[Table.DIFF_INFO].put(bad_key, b"x")
    with pytest.raises(CorruptDataError) as err:
        queue.get_last_applied_seqno(S)
    assert err.value.table == "diff_info"
    assert err.value.key == bad_key
    assert queue.get_last_applied_seqno(OTHER) is None


CORRUPT_AT_OPEN = {
    "pointer-value": (Table.COMMIT_POINTERS, codec.shard_bytes(S), b"\x00" * 3, "commit_pointers"),
    "pointer-key": (Table.COMMIT_POINTERS, b"\x00" * 5, b"\x00" * 44, "commit_pointers"),
    "last-mc-block": (Table.VARS, codec.LAST_COMMITTED_MC_BLOCK, b"\x00" * 79, "vars"),
    "commit-record": (Table.VARS, codec.COMMIT_RECORD, b"garbage", "vars"),
    "gc-requested": (Table.VARS, codec.GC_REQUESTED, b"\x92\x07\x90", "vars"),
}


@pytest.mark.parametrize(
    ("table", "row_key", "value", "name"), list(CORRUPT_AT_OPEN.values()), ids=list(CORRUPT_AT_OPEN)
)
def test_corrupt_small_tables_fail_the_open(
    db_path: Path, table: Table, row_key: bytes, value: bytes, name: str
) -> None:
    with open_queue(db_path) as queue:
        populate(queue)
        queue._store._tables[table].put(row_key, value)
    for _ in range(2):  # the failed open released the lock
        with pytest.raises(CorruptDataError) as err:
            open_queue(db_path)
        assert err.value.table == name
        assert err.value.key == row_key


def test_corrupt_rows_are_imq_errors() -> None:
    assert issubclass(CorruptDataError, ImqError)


# -- metrics and log events -------------------------------------------------------------------


def test_metrics_count_the_operations(queue: Queue) -> None:
    chain = Chain(queue)
    a = chain.apply(S, 3)
    assert queue.apply_diff(a.diff, a.block, a.hash) is False
    b = chain.build(S, 2)
    pending = queue.prepare_diff(b.diff, b.block, b.hash)
    assert pending is not None
    pending.write()
    mc = chain.apply(MC, 1)
    assert queue.commit_diff([mc.top(), a.top(1)]) is True
    assert queue.commit_diff([mc.top(), a.top(1)]) is False
    got = iterate_all(queue, [S, MC], 0, BASE)
    queue.get_diff_info(S, 1)
    queue.load_diff_statistics(0, QueueShardRange(S, QueueKey.MIN, QueueKey.MAX))
    queue.clear_uncommitted_state()

    snap = queue.metrics.snapshot()
    counters = snap["counters"]
    assert isinstance(counters, dict)
    assert counters["diffs_applied"] == 3
    assert counters["diffs_skipped"] == 1
    assert counters["messages_written"] == 3 + 2 + 1
    assert counters["commits"] == 1
    assert counters["commits_skipped"] == 1
    assert counters["messages_iterated"] == len(got) == 5  # the mc-bound one is skipped
    assert counters["messages_skipped_by_iterator"] == 1
    assert counters["uncommitted_cleared"] == 1
    operations = snap["operations"]
    assert isinstance(operations, dict)
    expected_counts = {
        "apply_diff": 3,
        "prepare_diff": 1,
        "write_diff": 3,
        "commit_diff": 2,
        "iterator_create": 1,
        "get_diff_info": 1,
        "load_diff_statistics": 1,
        "clear_uncommitted_state": 1,
    }
    assert {op: operations[op]["count"] for op in expected_counts} == expected_counts
    for op in expected_counts:
        summary = operations[op]
        assert set(summary) == {"count", "mean", "p50", "p99", "max"}
        assert 0 <= summary["p50"] <= summary["max"]
    assert "run_gc" not in operations


def test_log_events_have_their_fields(db_path: Path, logs: list[MutableMapping[str, Any]]) -> None:
    with open_queue(db_path) as queue:
        chain = Chain(queue)
        a = chain.apply(S, 3)
        queue.apply_diff(a.diff, a.block, a.hash)  # skipped
        mc = chain.apply(MC, 1)
        assert queue.commit_diff([mc.top(), a.top(1)])
        assert not queue.commit_diff([mc.top(), a.top(1)])
    by_event: dict[str, list[MutableMapping[str, Any]]] = {}
    for entry in logs:
        by_event.setdefault(entry["event"], []).append(entry)

    applied = by_event["diff_applied"]
    assert [(e["shard"], e["seqno"], e["messages"]) for e in applied] == [
        (str(S), 1, 3),
        (str(MC), 1, 1),
    ]
    for e in applied:
        assert e["log_level"] == "info"
        assert e["component"] == "queue"
        assert e["db"] == str(db_path)

    (committed,) = by_event["diff_committed"]
    assert committed["log_level"] == "info"
    assert committed["mc_block"] == str(block_id(MC, 1))
    assert set(committed["pointers"]) == {str(S), str(MC)}
    assert committed["pointers"][str(S)].endswith("@1")
    assert str(a.max_message) in committed["pointers"][str(S)]

    assert by_event["diff_skipped"][0]["block"] == str(a.block)
    assert by_event["commit_skipped"][0]["mc_block"] == str(block_id(MC, 1))
    assert [e["event"] for e in logs if e["event"].startswith("queue_")] == [
        "queue_opened",
        "queue_closed",
    ]


# -- synced writes ----------------------------------------------------------------------------


class _RecordingDb:
    """Forwards everything to the real rocksdict handle, noting writes and WAL syncs."""

    def __init__(self, db: Any, calls: list[str]) -> None:
        self._db = db
        self._calls = calls

    def write(self, batch: Any, *opts: Any) -> None:
        self._calls.append("write(sync)" if opts and opts[0].sync else "write")
        self._db.write(batch, *opts)

    def flush_wal(self, sync: bool) -> None:
        self._calls.append(f"flush_wal({sync})")
        self._db.flush_wal(sync)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


@pytest.mark.parametrize("sync_commits", [True, False])
def test_a_synced_commit_syncs_the_log_after_its_write(db_path: Path, sync_commits: bool) -> None:
    """A synced commit writes its batch, then syncs the log with ``flush_wal(True)``:
    rocksdict holds the GIL through a write (a sync in it too) and releases it in
    ``flush_wal``, so the host's other threads run while the disk syncs. The batch is
    durable when the call returns, as with a synced write. Unsynced commits never sync."""
    queue = Queue.open(db_path, quiet_config(sync_commits=sync_commits))
    try:
        chain = Chain(queue)
        mc = chain.apply(MC, [address_in(S, 1)])
        s1 = chain.apply(S, [address_in(S, 2)])
        store: Any = queue._store
        calls: list[str] = []
        store._db = _RecordingDb(store._db, calls)
        assert queue.commit_diff([mc.top(), s1.top(1)])
        store._db = store._db._db
        assert calls == (["write", "flush_wal(True)"] if sync_commits else ["write"])
        assert queue.get_commit_pointers()[S].key == s1.diff.max_message
    finally:
        queue.close()
    reopened = open_queue(db_path)
    try:
        assert reopened.get_commit_pointers()[S].key == s1.diff.max_message
    finally:
        reopened.close()


_FORK = textwrap.dedent(
    """
    import os, sys
    from imq import *
    q = Queue.open(sys.argv[1], QueueConfig(gc_enabled=False))
    H, A, S = b"\\x11" * 32, Address(0, b"\\x01" * 32), ShardIdent.BASECHAIN
    q.apply_diff(QueueDiff([Message(QueueKey(10, H), A, A)]), BlockIdShort(S, 1), H)
    it = q.iterator(0, [QueueShardRange(S, QueueKey.MIN, QueueKey.MAX)], S)
    pid = os.fork()
    if pid == 0:
        for name, call in (
            ("apply", lambda: q.apply_diff(
                QueueDiff([Message(QueueKey(20, H), A, A)]), BlockIdShort(S, 2), H)),
            ("read", lambda: q.get_diff_info(S, 1)),
            ("iterate", lambda: next(it)),  # opened before the fork
        ):
            try:
                call()
                print("child", name, "accepted", flush=True)
            except StorageError as exc:
                print("child", name, "refused:", exc, flush=True)
        q.close()
        print("child closed", flush=True)
        sys.exit(0)  # RocksDB's destructors would wait for the parent's threads here
    _, status = os.waitpid(pid, 0)
    print("child exit status", status, flush=True)
    q.apply_diff(QueueDiff([Message(QueueKey(30, H), A, A)]), BlockIdShort(S, 2), H)
    q.close()
    again = Queue.open(sys.argv[1])
    print("parent reopened", again.get_diff_info(S, 2) is not None, flush=True)
    again.close()
    """
)


def test_a_forked_child_is_refused_the_parents_queue_and_exits_cleanly(db_path: Path) -> None:
    """An outside audit: a child forked from a process with an open queue could write
    into the parent's log behind its back (a later crash of the parent then left a log
    no open could replay), its ``close()`` hung, and it hung at exit even unused. The
    child is now refused every call, with the way forward; its ``close()`` touches
    nothing of the parent's; it exits; the parent goes on and reopens."""
    run = subprocess.run(
        [sys.executable, "-c", _FORK, str(db_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    for name in ("apply", "read", "iterate"):
        (line,) = [x for x in lines if x.startswith(f"child {name} ")]
        assert "refused:" in line and "forked from it" in line, line
    assert "child closed" in lines
    assert "child exit status 0" in lines
    assert "parent reopened True" in lines


_EXIT_MID_COMPACTION = """
import sys
from imq import (Address, BlockId, BlockIdShort, Message, Queue, QueueConfig, QueueDiff,
                 QueueKey, ShardIdent, TopBlock)
config = QueueConfig(gc_enabled=True, gc_interval=3600, compaction_debt=0,
                     compact_after_delete=True)
queue = Queue.open(sys.argv[1], config)
S, MC = ShardIdent.BASECHAIN, ShardIdent.MASTERCHAIN
src, dst = Address(0, b"\\x11" * 32), Address(0, b"\\x22" * 32)
lt = 1000
for seqno in range(1, 101):
    keys = [QueueKey(lt + i, (lt + i).to_bytes(32, "big")) for i in range(1000)]
    diff = QueueDiff([Message(k, src, dst, b"x" * 300) for k in keys],
                     {S: QueueKey.max_for_lt(lt - 1)})
    queue.apply_diff(diff, BlockIdShort(S, seqno), seqno.to_bytes(32, "big"))
    empty = QueueDiff(min_key=QueueKey.MIN, max_key=QueueKey.MIN)
    queue.apply_diff(empty, BlockIdShort(MC, seqno), (10**6 + seqno).to_bytes(32, "big"))
    queue.commit_diff([TopBlock(BlockId(MC, seqno), seqno), TopBlock(BlockId(S, seqno), seqno)])
    lt += 2000
queue.gc_worker.tick(timeout=0.005)  # a pass, which compacts what it deleted, in flight
if sys.argv[2] == "error":
    raise SystemExit("the host's own error")
"""


@pytest.mark.parametrize("end", ["normal", "error"])
def test_exiting_without_close_while_gc_compacts_ends_the_process_normally(
    tmp_path: Path, end: str
) -> None:
    """A host that ends (normally, or on its own error) without ``close()`` while the GC
    worker is inside a compaction: Python ended the daemon thread inside RocksDB and the
    process aborted ('FATAL: exception not rethrown', SIGABRT, 10 of 10 runs), hiding the
    host's own exit status. An exit hook now stops the worker first."""
    for run in range(3):
        done = subprocess.run(
            [sys.executable, "-c", _EXIT_MID_COMPACTION, str(tmp_path / f"db{run}"), end],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        expected = (0, "") if end == "normal" else (1, "the host's own error\n")
        assert (done.returncode, done.stderr) == expected, done.stderr
