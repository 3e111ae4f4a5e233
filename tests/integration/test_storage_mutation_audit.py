"""Tests from a mutation audit of the storage layer (``imq/storage/rocks.py``, ``wal.py``,
``codec.py``, ``tops.py``, ``queue_state.py`` and ``ops.py``), for reliability: each pins a
rule of ``docs/reliability.md`` or ``docs/architecture.md`` that a small change to that
code broke without any other test failing. A damaged or inconsistent database must be
refused or reported with a typed error, never read as a shorter or emptier one, and a
refused open must leave every file as it was.

Real RocksDB in ``tmp_path``; the builders of ``test_synced_mark.py`` make the queues.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import msgpack
import pytest
from builders import (
    MC,
    Chain,
    Clock,
    address_in,
    block,
    block_id,
    diff_hash,
    full_range,
    key,
    make_diff,
    message,
    open_queue,
    quarter_shards,
    quiet_config,
    top,
)
from rocksdict import Options, Rdict
from test_corruption import _enlarge_length, _flip
from test_synced_mark import _build, _files, _manifest, _observed

from imq import DiffZone, Queue, QueueKey, ShardIdent
from imq.errors import CorruptDataError, SchemaVersionError, StateFormatError, StorageError
from imq.storage import Table, codec, ops, rocks, wal
from imq.storage.rocks import SYNCED_FILE, read_synced_mark
from imq.storage.tables import StoreOptions

SHARDS = quarter_shards()
MESSAGES = 2_400  # about 20 of the messages table's 32 KiB data blocks


@pytest.fixture(scope="module")
def closed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A queue closed cleanly after three flushed rounds, and what it holds."""
    db = tmp_path_factory.mktemp("audit") / "closed"
    with open_queue(db) as q:
        _build(q, 3, flush=True)
    with Queue.open(db, read_only=True) as q:
        return db, _observed(q)


@pytest.fixture(scope="module")
def many_blocks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A closed queue whose messages table is one table file of many data blocks."""
    db = tmp_path_factory.mktemp("audit") / "blocks"
    with open_queue(db) as q:
        chain = Chain(q)
        for _ in range(MESSAGES // 200):
            chain.apply(SHARDS[0], 200, body=b"b" * 200)
        q._store.flush(list(Table))
    return db


def _damaged_copy(intact: Path, tmp_path: Path) -> Path:
    """A copy of ``intact`` with bytes flipped in the middle of its largest table file."""
    db = tmp_path / "damaged"
    shutil.copytree(intact, db)
    sst = max(db.glob("*.sst"), key=lambda p: p.stat().st_size)
    _flip(sst, sst.stat().st_size // 2)
    return db


def _cut_after_the_tables(db: Path, source: Path) -> None:
    """Cut the MANIFEST of ``db`` (a copy of ``source``) just after the record that
    creates the last of imq's tables: it lists every table and none of their files."""
    imqs = {t.value for t in Table}
    manifest = _manifest(source)
    for offset, length, _ in wal.record_headers(manifest):
        os.truncate(_manifest(db), offset + 7 + length)
        if imqs <= set(Rdict.list_cf(str(db), Options(raw_mode=True))):
            return
        shutil.copyfile(manifest, _manifest(db))
    raise AssertionError("no edit creates the last of imq's tables")


# -- scans over a damaged block ---------------------------------------------------------------


def test_counting_rows_over_a_damaged_block_raises_instead_of_counting_short(
    many_blocks: Path, tmp_path: Path
) -> None:
    """reliability.md: every scan checks why its rows ended; a damaged block raises
    ``CorruptDataError`` naming the table, never a range that looks shorter. The
    seekable cursor GC counts removed messages with (``ops.MessageCounter``) is such a
    scan: its count stops where RocksDB's iterator turns invalid, and only the
    iterator's status tells a damaged block from the range's end."""
    everything = (b"", b"\xff" * 64)
    with Queue.open(many_blocks, read_only=True) as q:
        rows = ops.MessageCounter()
        with ops.view(q._store, rows) as view:
            assert view[rows].count_keys(*everything) == MESSAGES
    db = _damaged_copy(many_blocks, tmp_path)
    with Queue.open(db, read_only=True) as q:
        rows = ops.MessageCounter()
        with ops.view(q._store, rows) as view, pytest.raises(CorruptDataError) as info:
            view[rows].count_keys(*everything)
    assert info.value.table == "messages"


def test_a_segment_whose_top_cannot_be_read_is_left_to_rocksdb(
    many_blocks: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """architecture.md (the cache of fresh rows): a segment becomes known at its first
    write, its floor being its greatest stored key, read by one reverse seek; the cache
    then claims the rows above the floor. A seek that fails (a damaged block) leaves the
    segment unknown, so RocksDB serves its scans and reports the damage. Forced here:
    the seek fails once; every stored message must still be read. Taking the segment's
    start for its floor, the cache claimed the whole segment and the iterator returned
    only the rows written since the open."""
    db = tmp_path / "db"
    shutil.copytree(many_blocks, db)

    def unreadable(store: rocks.Store, prefix: bytes, end: bytes) -> bytes:
        raise CorruptDataError(Table.MESSAGES.value, prefix, "forced: a damaged block")

    with open_queue(db) as q:
        monkeypatch.setattr(rocks.Store, "_segment_top", unreadable)
        chain = Chain(q, Clock(start=10**9))
        chain._seqnos = {SHARDS[0]: MESSAGES // 200}  # after the stored diffs
        chain.apply(SHARDS[0], 5)
        monkeypatch.undo()
        with q.iterator(0, [full_range(SHARDS[0])], SHARDS[0]) as it:
            assert sum(1 for _ in it) == MESSAGES + 5


# -- the MANIFEST's facts -------------------------------------------------------------------------


def test_a_manifest_cut_inside_the_edit_that_first_records_the_mark_changes_nothing(
    closed: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """reliability.md: a MANIFEST cut short is refused before RocksDB's writer open
    deletes the table files it no longer lists. Cut inside the first edit that records
    the synced mark's sequence number, after that edit's leading fields: the torn edit
    is no evidence of what RocksDB recovers (it drops a torn record), so the highest
    sequence number of the whole edits is below the mark and the writer's open must be
    refused with every file as it was. Counting the torn edit's number let the open go
    on, and RocksDB deleted a table file before the check after the open refused."""
    intact, expected = closed
    db = tmp_path / "db"
    shutil.copytree(intact, db)
    mark = read_synced_mark(db)
    manifest = _manifest(db)
    data = manifest.read_bytes()
    first = next(
        (offset, length)
        for offset, length, _ in wal.record_headers(manifest)
        if wal._leading_fields(data[offset + 7 : offset + 7 + length])[1] == mark
    )
    offset, length = first
    os.truncate(manifest, offset + 7 + length // 2)
    before = _files(db)
    for read_only in (False, True):
        with pytest.raises(StorageError, match=f"had been synced to disk \\({SYNCED_FILE}\\)"):
            Queue.open(db, read_only=read_only)
    assert _files(db) == before
    shutil.copyfile(intact / manifest.name, manifest)  # the way out: the intact file
    with Queue.open(db) as q:
        assert _observed(q) == expected


def test_a_manifest_that_lost_some_of_imqs_tables_is_refused_with_nothing_changed(
    closed: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """reliability.md: a directory whose MANIFEST lost the records of imq's tables is
    refused at open before RocksDB touches it. Cut at the record boundary after which
    the MANIFEST lists some of imq's tables but not all: the directory holds table
    files, so this is no creation cut short (which holds none) but damage. Taking it
    for an interrupted creation let RocksDB's writer open create the missing tables and
    delete every table file before the check after the open refused."""
    intact, expected = closed
    imqs = {t.value for t in Table}
    manifest = _manifest(intact)
    probe = tmp_path / "probe"
    cut = None
    for offset, length, _ in wal.record_headers(manifest):
        shutil.rmtree(probe, ignore_errors=True)
        shutil.copytree(intact, probe)
        os.truncate(_manifest(probe), offset + 7 + length)
        listed = imqs & set(Rdict.list_cf(str(probe), Options(raw_mode=True)))
        if listed == imqs:
            break
        if listed:
            cut = offset + 7 + length
    assert cut is not None
    db = tmp_path / "db"
    shutil.copytree(intact, db)
    os.truncate(_manifest(db), cut)
    before = _files(db)
    assert any(name.endswith(".sst") for name in before)
    for read_only in (False, True):
        with pytest.raises(StorageError, match="without imq's tables"):
            Queue.open(db, read_only=read_only)
    assert _files(db) == before
    shutil.copyfile(manifest, _manifest(db))
    with Queue.open(db) as q:
        assert _observed(q) == expected


def test_table_files_gone_with_the_schema_version_are_refused_not_opened_empty(
    closed: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """reliability.md, api.md (``SchemaVersionError``): a directory that held table
    files but shows no schema version is damaged, never opened as an empty queue. A
    MANIFEST cut just after the tables' creation, the mark of synced writes deleted (the
    documented way to open what is left): RocksDB's writer open drops every table file
    the MANIFEST does not list, so the tables are empty by the time the version is read,
    and only the count of table files taken before the open tells damage from a new
    database. Without it the open wrote a new version and opened an empty queue."""
    intact, _ = closed
    db = tmp_path / "db"
    shutil.copytree(intact, db)
    (db / SYNCED_FILE).unlink()
    _cut_after_the_tables(db, intact)
    with pytest.raises(SchemaVersionError, match="table files before this open"):
        Queue.open(db)


def test_a_refused_open_of_table_files_without_a_schema_version_stays_refused(
    closed: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """reliability.md: a directory whose MANIFEST no longer lists its table files is
    refused at open, never opened as a smaller or empty queue, and a refused open
    changes nothing. Without the mark of synced writes the refusal was the schema
    version check after RocksDB's writer open, which had by then deleted the table files
    the cut MANIFEST does not list: a second open of the same directory (an operator
    retrying) saw no table file and no version, took it for a creation cut short and
    opened an empty queue (the bug this audit found). A read-only probe now refuses it
    first; a read-only open names the damage instead of offering a writer's open."""
    intact, _ = closed
    db = tmp_path / "db"
    shutil.copytree(intact, db)
    (db / SYNCED_FILE).unlink()
    _cut_after_the_tables(db, intact)
    before = {n: b for n, b in _files(db).items() if n != "rocksdict-config.json"}
    for _ in range(2):
        with pytest.raises(SchemaVersionError, match="table files before this open"):
            Queue.open(db)
        with pytest.raises(SchemaVersionError, match="table files before this open"):
            Queue.open(db, read_only=True)
    after = {n: b for n, b in _files(db).items() if n != "rocksdict-config.json"}
    assert after == before


def test_log_files_without_current_are_refused_untouched(
    closed: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """reliability.md (item 15): table *or log* files without CURRENT (a deletion cut
    short, which deletes CURRENT first) are refused untouched. Here the deletion also
    took the table files and left the log: RocksDB's creation of a new database beside
    it was refused by RocksDB only after it had written files into the directory."""
    intact, _ = closed
    db = tmp_path / "db"
    shutil.copytree(intact, db)
    (db / "CURRENT").unlink()
    for sst in db.glob("*.sst"):
        sst.unlink()
    assert wal.log_files(os.listdir(db))
    before = _files(db)
    with pytest.raises(StorageError, match="no CURRENT file"):
        Queue.open(db)
    assert _files(db) == before


def test_a_lower_schema_version_is_refused_too(tmp_path: Path) -> None:
    """formats.md: the schema version is checked at open, ``SchemaVersionError`` if it
    is not imq's; api.md: a database written by an incompatible imq. A lower version is
    as foreign as a higher one (only the higher one was tested)."""
    db = tmp_path / "db"
    with open_queue(db) as q:
        q._store._tables[Table.VARS].put(
            codec.SCHEMA_VERSION_KEY, codec.u32_value(codec.SCHEMA_VERSION - 1)
        )
    for read_only in (False, True):
        with pytest.raises(SchemaVersionError, match="has schema version 0"):
            Queue.open(db, read_only=read_only)


def test_an_open_refused_by_the_schema_check_writes_no_mark(tmp_path: Path) -> None:
    """A refused open changes nothing it can avoid changing: its close does not write the
    mark of synced writes (before stop 48 it did, recording the refused database's
    sequence number as synced, in a directory that may have had no mark)."""
    db = tmp_path / "db"
    with open_queue(db) as q:
        q._store._tables[Table.VARS].put(
            codec.SCHEMA_VERSION_KEY, codec.u32_value(codec.SCHEMA_VERSION + 1)
        )
    mark = (db / SYNCED_FILE).read_bytes()
    with pytest.raises(SchemaVersionError, match="has schema version"):
        Queue.open(db)
    assert (db / SYNCED_FILE).read_bytes() == mark
    (db / SYNCED_FILE).unlink()
    with pytest.raises(SchemaVersionError, match="has schema version"):
        Queue.open(db)
    assert not (db / SYNCED_FILE).exists()


def test_a_manifest_changed_while_the_writer_took_the_lock_is_walked_again(
    closed: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """architecture.md: the MANIFEST is walked before RocksDB opens the directory, and
    a writer's open walks it before it takes the directory's lock (a writer may hold it
    then). A writer that closed meanwhile can leave another MANIFEST: when the files
    changed, it is walked again under the lock. Forced here: once the lock is taken,
    CURRENT names a new MANIFEST whose last edit's length runs past its end (which
    RocksDB drops, deleting the table file it added). Refused, nothing changed; without
    the second walk RocksDB's open went on with the first walk's verdict."""
    intact, _ = closed
    db = tmp_path / "db"
    shutil.copytree(intact, db)
    acquire = rocks.Store._acquire_lock
    before: dict[str, bytes] = {}

    def acquire_then_change(store: rocks.Store) -> int:
        fd = acquire(store)
        new = db / "MANIFEST-999999"
        shutil.copyfile(_manifest(db), new)
        _enlarge_length(new, 1)
        (db / "CURRENT").write_text(f"{new.name}\n")
        before.update(_files(db))
        return fd

    monkeypatch.setattr(rocks.Store, "_acquire_lock", acquire_then_change)
    with pytest.raises(StorageError, match="MANIFEST-999999 holds a damaged record"):
        Queue.open(db)
    assert _files(db) == before


def test_a_read_only_open_of_a_damaged_directory_no_writer_touches_is_refused_as_damage(
    closed: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reliability.md: a read-only open is tried again when it failed *while the
    writer's files changed*. With no writer and the files holding still, the damage its
    checks find is the answer at once: the error names the damaged MANIFEST, not a live
    writer that outran the open (which sends the operator to try again). The retry
    budget is cut short only to bound this test's time should that regress."""
    intact, _ = closed
    db = tmp_path / "db"
    shutil.copytree(intact, db)
    manifest = _manifest(db)
    _enlarge_length(manifest, 1)
    monkeypatch.setattr(rocks, "_READ_ONLY_BUDGET", 1.0)
    with pytest.raises(StorageError) as info:
        Queue.open(db, read_only=True)
    assert f"{manifest.name} holds a damaged record" in str(info.value)
    assert "live writer" not in str(info.value)


def test_a_read_only_open_of_a_creation_cut_before_the_schema_version_is_typed(
    tmp_path: Path,
) -> None:
    """api.md (``SchemaVersionError``), behaviour.md 5.1 (a read-only open writes
    nothing): a directory whose creation was cut short after RocksDB made imq's tables
    and before imq wrote the schema version is refused by a read-only open with
    ``SchemaVersionError``, every file as it was. Taken for a writer's open, it tried to
    write the version and RocksDB's untyped refusal escaped."""
    db = tmp_path / "db"
    rocks.open_rdict(db, StoreOptions()).close()  # RocksDB's part of a creation
    (db / rocks.LOCK_FILE).touch()
    before = _files(db)
    with pytest.raises(SchemaVersionError, match="no schema version"):
        Queue.open(db, read_only=True)
    assert _files(db) == before
    with Queue.open(db) as q:  # a writer's open completes the creation
        assert q.summary()["shards"] == {}


def test_a_read_only_open_during_which_a_log_was_deleted_is_tried_again(
    closed: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reliability.md: a read-only open during which the writer deleted a log it may
    have read (a flush can) is tried again, so that the view is never torn across
    tables. Forced here: a log disappears during RocksDB's first open; that view is
    dropped and a second open is the one kept."""
    intact, expected = closed
    db = tmp_path / "db"
    shutil.copytree(intact, db)
    retired = db / "000002.log"  # an old, empty log, as a writer's flush retires one
    retired.write_bytes(b"")
    opens = 0
    open_rocksdb = rocks.Store._open_rocksdb

    def open_while_a_log_goes(store: rocks.Store) -> Any:
        nonlocal opens
        opened = open_rocksdb(store)
        opens += 1
        retired.unlink(missing_ok=True)
        return opened

    monkeypatch.setattr(rocks.Store, "_open_rocksdb", open_while_a_log_goes)
    with Queue.open(db, read_only=True) as q:
        assert _observed(q) == expected
    assert opens == 2


# -- diff records a delete decodes ------------------------------------------------------------


def _rewrite_field(q: Queue, key: bytes, field: int | None, value: Any) -> None:
    """Rewrite one field of the stored diff record ``key`` (``None``: the whole record
    becomes ``value``). The table handle stays local: one kept would keep RocksDB, and
    the directory's lock, open after the close."""
    table = q._store._tables[Table.DIFF_INFO]
    record = list(msgpack.unpackb(table[key], raw=False))
    if field is not None:
        record[field] = value
    table.put(key, value if field is None else msgpack.packb(record, use_bin_type=True))


@pytest.mark.parametrize(
    ("field", "value"),
    [(0, 2), (10, [[0, -1]]), (10, [[0, True]]), (None, b"")],
    ids=["unknown version", "negative count", "count a bool", "empty record"],
)
def test_a_clear_refuses_a_diff_record_it_cannot_trust(
    tmp_path: Path, field: int | None, value: Any
) -> None:
    """reliability.md: stored bytes that cannot be decoded as imq wrote them are a
    ``CorruptDataError``. A clear reads each diff's span and messages per partition from
    its record with the short decode (no ``DiffInfo`` built), which must refuse what
    the full decode refuses: a record of another version, a message count that is no
    u64, an empty value (a present record, not a missing one). The clear deletes
    nothing then."""
    db = tmp_path / "db"
    with open_queue(db) as q:
        applied = Chain(q).apply(SHARDS[0], 3)
        _rewrite_field(q, codec.diff_info_key(SHARDS[0], applied.seqno), field, value)
    with open_queue(db) as q:
        with pytest.raises(CorruptDataError) as info:
            q.clear_uncommitted_state(top_shards=[SHARDS[0]])
        assert info.value.table == "diff_info"
        assert q.get_diffs_tail_len(SHARDS[0], QueueKey.MIN) == 1
        with q.iterator(0, [full_range(SHARDS[0])], SHARDS[0]) as it:
            assert [m.message for m in it] == list(applied.messages)


def test_gc_counts_what_it_removed_from_the_diff_records_spans(tmp_path: Path) -> None:
    """api.md (``run_gc_report``): the messages a GC pass removed. Without the cache of
    fresh rows they are counted from the deleted diffs' records (each one's span and
    messages per partition, the short decode) plus the rows between the spans: a span
    decoded with the wrong end counts rows inside a diff twice."""
    with Queue.open(tmp_path / "db", quiet_config(message_cache_size=0)) as q:
        chain = Chain(q)
        diffs = [chain.apply(SHARDS[0], 4) for _ in range(3)]
        mc = chain.apply(MC, 0, processed_to={SHARDS[0]: diffs[-1].max_message})
        assert q.commit_diff([mc.top(), diffs[-1].top(mc.seqno)])
        report = q.run_gc_report()
        assert report.messages == 12


@pytest.mark.parametrize("name", [codec.GC_REQUESTED, codec.GC_EXECUTED])
def test_a_damaged_gc_bound_record_is_named_at_open(tmp_path: Path, name: bytes) -> None:
    """reliability.md, errors.py (``CorruptDataError``: ``key`` names the raw key): the
    open loads the queue state, and a GC bound record it cannot decode is reported
    under its own name, so that the operator looks at the right record."""
    db = tmp_path / "db"
    with open_queue(db) as q:
        q._store._tables[Table.VARS].put(name, b"\x92\x07\x90")  # an unknown version
    with pytest.raises(CorruptDataError) as info:
        Queue.open(db, read_only=True)
    assert (info.value.table, info.value.key) == ("vars", name)


def test_the_sequence_rule_reads_where_the_top_diffs_span_ends(tmp_path: Path) -> None:
    """behaviour.md 5.2 and section 3: the sequence rule looks at the shard's highest
    stored diff only if it is visible in the zone, and a diff is committed when its
    shard's pointer is at or above its ``max_message``. That diff's span is read with
    the short decode of its record (``View.diff_top``). Here the top diff's span holds
    the pointer (the API accepts diffs whose spans overlap): it is uncommitted, so a
    prepare checked against the committed zone has no constraint; read with the wrong
    end, it looked committed and the block was refused as out of sequence."""
    shard = SHARDS[0]
    src, dst = address_in(shard, 0), address_in(shard, 1)
    with open_queue(tmp_path / "db") as q:
        for seqno, lts in ((1, (10, 20)), (2, (15, 30))):
            diff = make_diff([message(key(lt), src, dst) for lt in lts])
            assert q.apply_diff(diff, block(shard, seqno), diff_hash(seqno))
        Chain(q).apply(MC, 0, seqno=1)
        assert q.commit_diff([top(MC, 1), top(shard, 1, 1)])
        assert q.get_commit_pointers()[shard].key == key(20)
        later = make_diff([message(key(40), src, dst)])
        assert q.apply_diff(later, block(shard, 4), diff_hash(4), None, DiffZone.COMMITTED)


class _WatchedDb:
    """RocksDB's handle, with the calls of the write path recorded in order."""

    def __init__(self, db: Any) -> None:
        self._db = db
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._db, name)
        if name not in ("write", "flush_wal"):
            return attr

        def watched(*args: Any) -> Any:
            self.calls.append((name, args[1:] if name == "write" else args))
            return attr(*args)

        return watched


@pytest.mark.parametrize("sync_commits", [True, False])
def test_a_commit_is_synced_to_the_log_before_it_returns(
    tmp_path: Path, sync_commits: bool
) -> None:
    """reliability.md: commits are fsynced by default (``sync_commits``), diffs are not;
    architecture.md: a synced write is the batch's write followed by ``flush_wal(True)``
    under the same gate, and the mark of synced writes is written after that fsync (it
    may lag the disk, never lead it). A lost fsync cannot be seen by a process kill (the
    log stays in the page cache), only by watching the calls."""
    with Queue.open(tmp_path / "db", quiet_config(sync_commits=sync_commits)) as q:
        chain = Chain(q)
        applied = chain.apply(SHARDS[0], 3)
        mc = chain.apply(MC, 0, seqno=1)
        store = q._store
        watched = _WatchedDb(store._db)
        store._db = watched
        try:
            chain.apply(SHARDS[1], 2)
            assert [name for name, _ in watched.calls] == ["write"]  # a diff: no fsync
            watched.calls.clear()
            assert q.commit_diff([mc.top(), applied.top(1)])
        finally:
            store._db = watched._db
        synced = [("write", ()), ("flush_wal", (True,))]
        assert watched.calls == (synced if sync_commits else [("write", ())])
    mark = read_synced_mark(tmp_path / "db")
    with Queue.open(tmp_path / "db", read_only=True) as q:
        assert mark == q._store._db.latest_sequence_number()


def test_an_import_marker_of_another_layout_fails_the_open(tmp_path: Path) -> None:
    """behaviour.md 5.1 and D10: an open rolls back an import a crash interrupted, by
    the spans its marker lists. A marker that is not the layout this imq writes (a
    field more) is a ``CorruptDataError`` naming it, not a rollback by a record it does
    not understand (which would also delete the marker)."""
    db = tmp_path / "db"
    with open_queue(db) as q:
        value = codec.import_marker_value(block_id(MC, 1), [], [])
        marker = list(msgpack.unpackb(value, raw=False))
        q._store._tables[Table.VARS].put(
            codec.IMPORT_MARKER, msgpack.packb([*marker, None], use_bin_type=True)
        )
    with pytest.raises(CorruptDataError) as info:
        Queue.open(db)
    assert (info.value.table, info.value.key) == ("vars", codec.IMPORT_MARKER)


def test_a_sound_message_row_with_an_empty_body_is_no_damage(tmp_path: Path) -> None:
    """behaviour.md: ``apply_diff`` takes any body, an empty one too; its row is the
    two addresses and nothing more. An export reads it as a sound row and refuses it
    for what it is (no internal message: ``StateFormatError``), never reports a
    damaged database (``CorruptDataError``, "restore it from a copy")."""
    shard = ShardIdent.BASECHAIN
    with open_queue(tmp_path / "db") as q:
        applied = Chain(q).apply(shard, 1, body=b"")
        with pytest.raises(StateFormatError, match="body"):
            q.export_state(shard, applied.seqno, 1, tmp_path / "state.bin")
