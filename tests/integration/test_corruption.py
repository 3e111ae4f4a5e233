"""Damaged table files: every scan either returns exactly what the intact database
returns or raises a typed error; never a short read that looks like a smaller range.

rocksdict's ``items()`` loops end quietly when RocksDB meets a damaged block (the error
is only visible through the raw iterator's ``status()``); ``imq.storage.Cursor`` checks
why its rows ran out. Each case copies one intact database, flips bytes inside the SST
file of one table (or inside the write-ahead log), reopens it and runs every read, clear,
GC and export.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from builders import BASE, Chain, Clock, full_range, open_queue, quarter_shards, quiet_config
from rocksdict import Options, Rdict
from state_fixtures import write_state

import imq.verify
from imq import DiffZone, ImqError, Queue, QueueKey
from imq import iterator as iterator_module
from imq.errors import CorruptDataError, FileAccessError, SchemaVersionError, StorageError
from imq.state.synth import synth_state
from imq.storage import Table, codec, wal
from imq.storage.rocks import Cursor, Scan
from imq.verify import verify

APPLIED = quarter_shards()
SHARDS = [*APPLIED, BASE]
EXPORTED = synth_state(diffs=6, messages_per_diff=1, seed=5).seqno
DIFFS = 12
PER_DIFF = 150


def _files(path: Path, suffix: str) -> set[str]:
    return {n for n in os.listdir(path) if n.endswith(suffix)}


@pytest.fixture(scope="module")
def intact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Table, str]]:
    """An intact database (every table flushed to its own SST file) and which file holds
    which table."""
    path = tmp_path_factory.mktemp("corrupt") / "intact"
    q = open_queue(path)
    state = synth_state(diffs=6, messages_per_diff=300, body_bytes=64, seed=5)
    written, _ = write_state(state, path.parent / "in.bin")
    q.import_state(written, state.block_id, state.top_update)
    chain = Chain(q)
    for _ in range(DIFFS):
        for shard in APPLIED:
            chain.apply(shard, PER_DIFF, body=b"b" * 120)
    sst: dict[Table, str] = {}
    for table in Table:
        before = _files(path, ".sst")
        q._store.flush([table])
        (new,) = _files(path, ".sst") - before
        sst[table] = new
    q.close()
    return path, sst


def _flip(file: Path, offset: int, count: int = 48) -> None:
    data = bytearray(file.read_bytes())
    offset = max(0, min(offset, len(data) - count))
    for i in range(offset, offset + count):
        data[i] ^= 0x5A
    file.write_bytes(bytes(data))


def _iterate(q: Queue) -> Any:
    with q.iterator(0, [full_range(s) for s in SHARDS], BASE) as it:
        return [m.message.key for m in it]


def _tails(q: Queue) -> Any:
    return [q.get_diffs_tail_len(s, QueueKey.MIN) for s in SHARDS]


def _stats(q: Queue) -> Any:
    return [sorted(q.load_diff_statistics(0, full_range(s)).items()) for s in SHARDS]


def _separated(q: Queue) -> Any:
    return [
        sorted(
            (p, sorted(v.items()))
            for p, v in q.load_separated_diff_statistics([0, 1], full_range(s)).items()
        )
        for s in SHARDS
    ]


def _summary(q: Queue) -> Any:
    summary = q.summary()
    summary.pop("path")
    return repr(summary)


def _infos(q: Queue) -> Any:
    return [repr(q.get_diff_info(s, n, DiffZone.BOTH)) for s in SHARDS for n in (1, DIFFS)]


def _last_applied(q: Queue) -> Any:
    return [q.get_last_applied_seqno(s) for s in SHARDS]


def _export(q: Queue, dest: Path) -> Any:
    report = q.export_state(BASE, EXPORTED, 6, dest / "state.bin")
    return (report.messages, (dest / "state.bin").read_bytes())


def _after_clear(q: Queue) -> Any:
    q.clear_uncommitted_state(top_shards=SHARDS)
    return (_tails(q), _iterate(q))


def _after_gc(q: Queue) -> Any:
    q.run_gc()
    return (_tails(q), _iterate(q))


OPERATIONS: dict[str, Callable[..., Any]] = {
    "iterate": _iterate,
    "tail_len": _tails,
    "statistics": _stats,
    "separated_statistics": _separated,
    "summary": _summary,
    "diff_info": _infos,
    "last_applied": _last_applied,
    "export": _export,
    "clear": _after_clear,
    "gc": _after_gc,
}


def _run(path: Path, name: str, workdir: Path) -> tuple[str, Any]:
    """``("ok", result)`` or ``("error", exception)``; only typed errors are accepted."""
    try:
        # No compaction after clear/GC: compacting a damaged file makes RocksDB retry for
        # seconds (and rocksdict's compact_range reports nothing); reads are under test.
        q = Queue.open(path, quiet_config(compact_after_delete=False))
    except ImqError as exc:
        return "error", exc
    try:
        op = OPERATIONS[name]
        return "ok", op(q, workdir) if name == "export" else op(q)
    except ImqError as exc:
        return "error", exc
    finally:
        q.close()


@pytest.fixture(scope="module")
def expected(
    intact: tuple[Path, dict[Table, str]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    path, _ = intact
    out = {}
    for name in OPERATIONS:
        work = tmp_path_factory.mktemp("expected")
        copy = work / "db"
        shutil.copytree(path, copy)
        kind, result = _run(copy, name, work)
        assert kind == "ok", result
        out[name] = result
    return out


@pytest.mark.parametrize("where", ["first_block", "middle"])
@pytest.mark.parametrize("table", list(Table), ids=[t.value for t in Table])
def test_damaged_sst_never_reads_short(
    intact: tuple[Path, dict[Table, str]],
    expected: dict[str, Any],
    tmp_path: Path,
    table: Table,
    where: str,
) -> None:
    path, sst = intact
    errors = 0
    for name in OPERATIONS:
        work = tmp_path / name
        copy = work / "db"
        shutil.copytree(path, copy)
        file = copy / sst[table]
        _flip(file, 40 if where == "first_block" else file.stat().st_size // 2)
        kind, result = _run(copy, name, work)
        if kind == "error":
            errors += 1
            assert isinstance(result, CorruptDataError | StorageError), repr(result)
        else:
            assert result == expected[name], f"{name} read short on a damaged {table.value} file"
    if where == "first_block":  # the first data block of every table is read by something
        assert errors > 0


def _open_damaged_messages(
    intact: tuple[Path, dict[Table, str]], tmp_path: Path, where: float
) -> Queue:
    """A copy of the intact database with bytes flipped at ``where`` (a fraction of the
    file) of the messages table's SST file, opened."""
    path, sst = intact
    copy = tmp_path / "db"
    shutil.copytree(path, copy)
    file = copy / sst[Table.MESSAGES]
    _flip(file, int(file.stat().st_size * where))
    return open_queue(copy)


@pytest.mark.parametrize("pure", [False, True], ids=["default", "pure-python"])
def test_a_damaged_messages_block_stops_the_iterator_with_a_typed_error(
    intact: tuple[Path, dict[Table, str]], tmp_path: Path, pure: bool
) -> None:
    """Both decode paths: the merge runs each cursor's end check when its rows run out."""
    q = _open_damaged_messages(intact, tmp_path, 1 / 3)
    try:
        with (
            iterator_module.pure_python() if pure else contextlib.nullcontext(),
            pytest.raises(CorruptDataError, match="messages") as info,
        ):
            _iterate(q)
        assert info.value.table == "messages"
    finally:
        q.close()


def test_a_compaction_that_meets_a_damaged_file_fails_writes_with_the_damage_named(
    intact: tuple[Path, dict[Table, str]], tmp_path: Path
) -> None:
    """RocksDB's background compaction reads the damaged messages file once enough new
    files pile up beside it: the next write fails with a typed error naming the file and
    saying that a reopen will not mend it (the same compaction would come back), every
    later call repeats it, and ``verify`` names the damage."""
    q = _open_damaged_messages(intact, tmp_path, 1 / 3)
    _, sst = intact
    chain = Chain(q, Clock(start=10**12))
    chain._seqnos = {shard: DIFFS for shard in APPLIED}  # after the intact database's diffs
    try:
        with pytest.raises(StorageError) as info:
            for _ in range(400):  # a bound, not a wait: compaction starts at 4 level-0 files
                chain.apply(APPLIED[0], 20)
                q._store.flush([Table.MESSAGES])  # one more level-0 file
                time.sleep(0.01)
        assert sst[Table.MESSAGES] in str(info.value), info.value
        assert "reopening will not mend it" in str(info.value)
        with pytest.raises(StorageError, match="reopening will not mend it"):
            chain.apply(APPLIED[1], 1)
        with pytest.raises(StorageError, match="this handle is dead"):
            q.get_diffs_tail_len(APPLIED[0], QueueKey.MIN)
    finally:
        q.close()
    report = verify(tmp_path / "db")
    assert any(sst[Table.MESSAGES] in p for p in report.problems), report.problems


@pytest.mark.parametrize("damage", ["flipped", "cut", "deleted"])
def test_a_damaged_blob_file_is_a_typed_error_naming_it(tmp_path: Path, damage: str) -> None:
    """Message bodies of 32 KiB and more live in RocksDB's blob files, outside the table
    files: a blob file with flipped bytes, cut short or deleted fails the read that needs
    it with a typed error (never a short or empty body) and ``verify`` reports it; a
    deleted one is named as missing, with the remedy, not as a reason to retry."""
    path = tmp_path / "db"
    with open_queue(path) as q:
        Chain(q).apply(APPLIED[0], 4, body=b"x" * (100 << 10))
        q._store.flush([Table.MESSAGES])
    (blob,) = path.glob("*.blob")
    data = blob.read_bytes()
    if damage == "flipped":
        middle = len(data) // 2
        blob.write_bytes(
            data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 8]) + data[middle + 8 :]
        )
    elif damage == "cut":
        blob.write_bytes(data[: len(data) // 2])
    else:
        blob.unlink()
    expected = (
        (StorageError, "a file the database lists is missing")
        if damage == "deleted"
        else (CorruptDataError, "(?i)Corruption: .*blob")
    )
    with open_queue(path) as q, pytest.raises(expected[0], match=expected[1]) as info:
        _iterate(q)
    assert blob.name in str(info.value) or damage != "deleted", info.value
    assert "imq verify" in str(info.value)
    report = verify(path)
    assert len(report.problems) == 1, report.problems
    assert "table messages: cannot be read to its end" in report.problems[0]


def _segment_rows(q: Queue, prefix: bytes) -> list[tuple[bytes, bytes]]:
    store = q._store  # type: ignore[attr-defined]
    scan = Scan(Table.MESSAGES, prefix, codec.prefix_end(prefix))
    cursor = Cursor(store._table(Table.MESSAGES), scan, store.path)
    try:
        return list(cursor.items)
    finally:
        cursor.close()


def test_the_cache_never_loads_a_segment_from_a_damaged_block(
    intact: tuple[Path, dict[Table, str]], tmp_path: Path
) -> None:
    """A segment read below its floor again and again loads its rows below the floor
    into the cache of fresh rows; a load that meets the damaged block loads nothing, so
    every read still reports it, and every segment that did load holds exactly the
    intact rows."""
    q = _open_damaged_messages(intact, tmp_path, 1 / 2)
    good = Queue.open(intact[0], quiet_config(message_cache_size=0), read_only=True)
    try:
        for _ in range(4):  # past the reads after which a segment loads
            with pytest.raises(CorruptDataError, match="messages"):
                _iterate(q)
        store = q._store  # type: ignore[attr-defined]
        store.cache.check()
        known = store.cache.segments()
        assert known, "the reads established no segment"
        for prefix, (floor, rows) in known.items():
            assert rows == [r for r in _segment_rows(good, prefix) if r[0] > floor]
    finally:
        good.close()
        q.close()


def _written(path: Path, rounds: int, *, compact: bool = False) -> tuple[Queue, Chain]:
    """An open queue at ``path`` after ``rounds`` rounds of a 50-message diff per applied
    shard (each round followed by a flush and compaction with ``compact``)."""
    q = open_queue(path)
    chain = Chain(q)
    for _ in range(rounds):
        for shard in APPLIED:
            chain.apply(shard, 50)
        if compact:
            q.compact()
    return q, chain


_BUSY = (
    "rocksdb.num-running-compactions",
    "rocksdb.num-running-flushes",
    "rocksdb.compaction-pending",
    "rocksdb.num-immutable-mem-table",
)


def _copy_live(q: Queue, path: Path, image: Path) -> None:
    """Copy the directory of the open queue ``q`` as a crash image, once RocksDB has no
    flush or compaction running or pending: one finishing during the copy deletes files
    the copy has listed (a failed copy under load), or adds files after the copy took
    the MANIFEST. No write runs meanwhile, so none starts again before the copy ends."""
    deadline = time.monotonic() + 120
    while any(q._store.property_int(t, name) for t in Table for name in _BUSY):
        assert time.monotonic() < deadline, "RocksDB stayed busy for two minutes"
        time.sleep(0.01)
    shutil.copytree(path, image)


def _log_image(tmp_path: Path) -> tuple[Path, Chain]:
    """A crash image (a copy taken while the queue is open) whose last writes are only
    in the write-ahead log."""
    path = tmp_path / "db"
    q, chain = _written(path, 4)
    image = tmp_path / "image"
    _copy_live(q, path, image)
    q.close()
    return image, chain


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9])
def test_a_damaged_log_record_fails_the_open(tmp_path: Path, where: float) -> None:
    """RocksDB's default recovery would drop every record after the damaged one, and
    with them acknowledged diffs, without a word."""
    image, _ = _log_image(tmp_path)
    (log,) = _files(image, ".log")
    _flip(image / log, int((image / log).stat().st_size * where))
    with pytest.raises(StorageError, match="Corruption"):
        open_queue(image)


def test_a_log_cut_short_at_its_end_opens_with_a_prefix(tmp_path: Path) -> None:
    """Power lost in the middle of an append leaves a short last record: tolerated (it
    can only hold writes after the last fsync, and those are uncommitted diffs)."""
    image, chain = _log_image(tmp_path)
    (log,) = _files(image, ".log")
    os.truncate(image / log, (image / log).stat().st_size - 100)
    q = open_queue(image)
    try:
        seen = _iterate(q)
        want = sorted(m.key for a in chain.applied for m in a.messages)
        assert 0 < len(seen) < len(want)
        assert seen == [k for k in want if k <= seen[-1]]
    finally:
        q.close()


def _set_length(file: Path, offset: int, length: int) -> None:
    """Write ``length`` into the length field of the record header at ``offset``."""
    with open(file, "r+b") as f:
        f.seek(offset + 4)
        f.write(length.to_bytes(2, "little"))


def _enlarge_length(file: Path, back: int) -> tuple[int, int]:
    """Enlarge the length field of the log-format ``file``'s record ``back`` from the
    end, in its last, partial block, to run a few bytes past the file's end; the record's
    offset and true length."""
    offset, length, _ = list(wal.record_headers(file))[-back]
    size = file.stat().st_size
    assert offset // wal.BLOCK == (size - 1) // wal.BLOCK  # in the last, partial block
    _set_length(file, offset, size - offset)
    return offset, length


def _assert_refused_with_repair(
    path: Path, name: str, offset: int, length: int, consequence: str
) -> None:
    """Both open modes refuse ``path`` naming the damaged record, ``consequence`` and
    the repair, and change nothing."""
    before = _listing(path)
    for read_only in (False, True):
        with pytest.raises(StorageError) as caught:
            Queue.open(path, quiet_config(), read_only=read_only)
        text = str(caught.value)
        assert f"{name} holds a damaged record at offset {offset}" in text
        assert consequence in text
        assert f"the 2 bytes at offset {offset + 4} of {name} set to {length}" in text
    assert _listing(path) == before


@pytest.mark.parametrize("back", [1, 2])
def test_a_length_field_run_past_the_logs_end_fails_the_open(tmp_path: Path, back: int) -> None:
    """A record's length field in the log's last block, enlarged so that it runs past the
    file's end: RocksDB's recovery took it for a write cut short by a crash and opened
    the queue without it and every record after it (measured: 50 and 100 of 800 messages
    gone, no error). The open fails instead, changes nothing, and the repair it names
    gives back every message."""
    image, chain = _log_image(tmp_path)
    intact = tmp_path / "intact"
    shutil.copytree(image, intact)
    (log,) = _files(image, ".log")
    offset, length = _enlarge_length(image / log, back)
    _assert_refused_with_repair(image, log, offset, length, f"whole at {length} bytes")
    _set_length(image / log, offset, length)  # the repair the error names
    want = sorted(m.key for a in chain.applied for m in a.messages)
    for path in (image, intact):
        q = open_queue(path)
        try:
            assert _iterate(q) == want
        finally:
            q.close()


@pytest.mark.parametrize("back", [1, 2, 4])
def test_a_manifest_length_field_run_past_its_end_fails_the_open(tmp_path: Path, back: int) -> None:
    """The MANIFEST is written in the log's format and read with the same tolerance of
    a cut tail: an edit's length field enlarged past the file's end made RocksDB's open
    drop that edit and every later one and delete the table files they had added
    (measured, the second and fourth edit from the end: one and two of nine table files
    deleted by the open; the messages survived there because the log still held them,
    which it need not). The open fails first and deletes nothing; the repair it names
    opens every message."""
    path = tmp_path / "db"
    q, chain = _written(path, 3, compact=True)  # flushes and compactions: MANIFEST edits
    q.close()
    manifest = (path / "CURRENT").read_text().strip()
    offset, length = _enlarge_length(path / manifest, back)
    _assert_refused_with_repair(path, manifest, offset, length, "delete the table files")
    _set_length(path / manifest, offset, length)  # the repair the error names
    q = open_queue(path)
    try:
        assert _iterate(q) == sorted(m.key for a in chain.applied for m in a.messages)
    finally:
        q.close()


def test_a_zeroed_log_header_is_logged_and_listed_by_verify(tmp_path: Path) -> None:
    """A record header zeroed in the log's last block: RocksDB skips the rest of the
    block without a word (an outside audit: 60 of 600 messages gone). Not refused (a
    power loss can leave zeros there on some file systems), but no longer silent: the
    open logs a warning naming the file and offset, and `imq verify` (before that open,
    which replaces the log) lists it as a note."""
    image, chain = _log_image(tmp_path)
    (log,) = _files(image, ".log")
    # the last whole record (a fragment's zeroed header RocksDB reports itself)
    offset = next(o for o, _, kind in reversed(list(wal.record_headers(image / log))) if kind == 1)
    with open(image / log, "r+b") as file:
        file.seek(offset + 4)  # the length and type bytes
        file.write(bytes(3))
    before_open = tmp_path / "before-open"  # the open replaces the log: verify a copy
    shutil.copytree(image, before_open)
    report = verify(before_open)
    assert any(f"{log}: a zeroed record header at offset {offset}" in n for n in report.notes)
    assert report.ok  # a note, not a problem: a power loss can leave this
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("imq")
    keep = Keep(logging.WARNING)
    logger.addHandler(keep)
    try:
        q = open_queue(image)
        try:
            seen = _iterate(q)
        finally:
            q.close()
    finally:
        logger.removeHandler(keep)
    assert len(seen) < sum(len(a.messages) for a in chain.applied)  # RocksDB's doing
    warned = [r for r in records if r.msg["event"] == "write_ahead_log_not_replayed_in_full"]  # type: ignore[index]
    assert len(warned) == 1
    assert f"{log}: a zeroed record header at offset {offset}" in str(warned[0].msg)


def test_a_zeroed_manifest_header_is_listed_by_verify(tmp_path: Path) -> None:
    """The MANIFEST's walk notes a zero header with data after it as the logs' does."""
    db = tmp_path / "db"
    with open_queue(db) as q:
        Chain(q).apply(APPLIED[0], 5)
    manifest = (db / "CURRENT").read_text().strip()
    size = (db / manifest).stat().st_size
    with open(db / manifest, "ab") as file:
        file.write(bytes(7) + b"junk")  # a zero header, then data in its block
    report = verify(db)
    assert any(f"{manifest}: a zeroed record header at offset {size}" in n for n in report.notes)


def test_a_log_that_cannot_be_opened_is_a_typed_error_in_both_modes(tmp_path: Path) -> None:
    """A log the directory lists but that cannot be opened (a dangling link) escaped the
    writer's open as a bare ``FileNotFoundError``, and the read-only open blamed a live
    writer after 20 attempts (an outside audit)."""
    image, _ = _log_image(tmp_path)
    (image / "000999.log").symlink_to(tmp_path / "nowhere.log")
    before = _listing_names(image)
    for read_only in (False, True):
        with pytest.raises(FileAccessError, match=r"lists 000999\.log but it cannot be opened"):
            Queue.open(image, quiet_config(), read_only=read_only)
    assert _listing_names(image) == before


def test_a_manifest_current_names_but_that_is_missing_is_named_as_such(tmp_path: Path) -> None:
    """CURRENT naming a MANIFEST that is not there: the read-only open said it could not
    read "the write-ahead log", which "the directory lists" (an outside audit); it names
    the MANIFEST and CURRENT now. The writer's open is refused the same way (it said it
    could not read the list of tables, and advised `imq verify`, which says the above)."""
    db = tmp_path / "db"
    open_queue(db).close()
    (db / "CURRENT").write_text("MANIFEST-000099\n")
    with pytest.raises(FileAccessError, match=r"CURRENT names MANIFEST-000099") as info:
        Queue.open(db, quiet_config(), read_only=True)
    assert "write-ahead log" not in str(info.value)
    before = _listing_names(db)
    with pytest.raises(FileAccessError, match=r"CURRENT names MANIFEST-000099") as info:
        Queue.open(db, quiet_config())
    assert "imq verify" not in str(info.value) and "nothing was changed" in str(info.value)
    assert _listing_names(db) == before


def _listing_names(path: Path) -> list[str]:
    return sorted(os.listdir(path))


# A child process opens the directory, so that an open that never returns fails the test
# instead of hanging the suite.
_OPEN_IN_CHILD = """
import sys
from imq import Queue, StorageError
try:
    Queue.open(sys.argv[1], read_only=sys.argv[2] == "ro").close()
    print("opened")
except StorageError as exc:
    print(exc)
"""


@pytest.mark.parametrize("kind", sorted(wal.RECYCLABLE))
def test_a_record_of_a_recycled_logs_type_fails_the_open_instead_of_hanging(
    tmp_path: Path, kind: int
) -> None:
    """One flipped bit turns a full record (type 1) into a recycled log's (5), on which
    RocksDB 9.8's recovery loops for ever at 100% CPU (facebook/rocksdb#13333; so do 6,
    7, 8 and 11): the open fails first, naming the log and the record, and changes
    nothing."""
    image, _ = _log_image(tmp_path)
    (log,) = _files(image, ".log")
    headers = list(wal.record_headers(image / log))
    assert len(headers) > 4 and {k for _, _, k in headers} <= {1, 2, 3, 4}
    _retyped_record_is_refused(image, log, headers[len(headers) // 2][0], kind)


def _retyped_record_is_refused(db: Path, name: str, offset: int, kind: int) -> None:
    """Set the type byte of the record header at ``offset`` of file ``name`` to ``kind``:
    both open modes (each in a child, so that a hang fails the test instead of hanging
    the suite) refuse it, naming the file, the offset and the type, and change nothing."""
    with open(db / name, "r+b") as file:
        file.seek(offset + 6)  # the header's type byte
        file.write(bytes([kind]))
    before = _listing(db)
    for mode in ("rw", "ro"):
        done = subprocess.run(
            [sys.executable, "-c", _OPEN_IN_CHILD, str(db), mode],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        expected = f"{name} holds a damaged record at offset {offset} (type {kind},"
        assert expected in done.stdout, done.stdout + done.stderr
    assert _listing(db) == before


@pytest.mark.parametrize(("record", "kind"), [(0, 6), (4, 5), (-1, 7)])
def test_a_manifest_record_of_a_recycled_logs_type_fails_the_open_instead_of_hanging(
    tmp_path: Path, record: int, kind: int
) -> None:
    """RocksDB reads the MANIFEST with the same log reader, first for its list of tables:
    one bit flipped in a record's type hung every open, writer, read-only and `imq
    verify`, Ctrl-C ignored; type 6 in the first record made the queue look like a
    foreign database (an outside audit). The MANIFEST is walked before that read now."""
    path = tmp_path / "db"
    q, _ = _written(path, 4)
    q.close()
    manifest = (path / "CURRENT").read_text().strip()
    headers = list(wal.record_headers(path / manifest))
    _retyped_record_is_refused(path, manifest, headers[record][0], kind)
    if kind == 5:  # the check runs first, so `imq verify` fails at once too
        with pytest.raises(StorageError, match="damaged record") as caught:
            verify(path)
        # without its advice to run `imq verify`: that is what failed (an outside audit)
        assert "imq verify" not in str(caught.value), caught.value


def _logs_image(tmp_path: Path) -> Path:
    """A crash image with several logs holding data: small write buffers make the
    messages table flush (each flush starts a log) while the small tables keep their
    rows in the older logs."""
    path = tmp_path / "db"
    q = Queue.open(path, quiet_config(write_buffer_size=256 * 1024, message_cache_size=0))
    chain = Chain(q)
    for _ in range(40):
        chain.apply(APPLIED[0], 60, body=bytes(200))
    image = tmp_path / "image"
    _copy_live(q, path, image)
    q.close()
    logs = [n for n in wal.log_files(os.listdir(image)) if (image / n).stat().st_size]
    assert len(logs) >= 3, logs
    return image


@pytest.mark.parametrize("cut", ["half", "inside its last record", "inside a header"])
def test_an_older_log_cut_short_is_refused(tmp_path: Path, cut: str) -> None:
    """A crash cuts only the newest log; RocksDB's recovery skips the cut end of an older
    one in silence and replays the newer ones: acknowledged diffs (and synced commits)
    from the middle of the history vanished, `imq verify` alone noticed (an outside
    audit)."""
    image = _logs_image(tmp_path)
    oldest = wal.log_files(os.listdir(image))[0]
    log = image / oldest
    size = log.stat().st_size
    last = list(wal.record_headers(log))[-1][0]
    at = {"half": size // 2, "inside its last record": size - 10, "inside a header": last + 3}
    os.truncate(log, at[cut])
    found = wal.find_log_damage(image, os.listdir(image))
    assert found is not None and found.cut
    # the error names where the cut record starts
    assert found.offset <= at[cut]
    if cut == "inside its last record":
        assert found.offset == last
    _refused_in_both_modes(
        image, rf"write-ahead log {oldest} is cut short at offset {found.offset} "
    )


def _refused_in_both_modes(image: Path, pattern: str) -> None:
    """The writer's open and a read-only one raise ``StorageError`` matching ``pattern``;
    the directory is left as it was."""
    before = _listing(image)
    for read_only in (False, True):
        with pytest.raises(StorageError, match=pattern):
            Queue.open(image, quiet_config(), read_only=read_only)
    assert _listing(image) == before


def test_a_log_lost_between_two_others_is_refused(tmp_path: Path) -> None:
    """A middle log deleted: its writes (diff info, tail and statistics rows, whose tables
    had not flushed) were gone without a word at open, only `imq verify` noticed (an
    outside audit). The next log's first batch does not continue the sequence numbers
    of the one before: refused."""
    image = _logs_image(tmp_path)
    logs = [n for n in wal.log_files(os.listdir(image)) if (image / n).stat().st_size]
    (image / logs[1]).unlink()
    found = wal.find_log_damage(image, os.listdir(image))
    assert found is not None and found.gap is not None
    expected, first = found.gap
    assert first > expected  # the lost log's writes
    _refused_in_both_modes(
        image,
        rf"{logs[2]} does not continue the log before it: its first write batch \(offset "
        rf"{found.offset}\) has sequence number {first}, where the log before it leaves "
        rf"off at {expected}\.",
    )


def test_the_newest_log_lost_beside_older_ones_is_refused(tmp_path: Path) -> None:
    """The newest logs deleted, older ones kept (the small tables had not flushed): the
    sequence numbers of what is left continue, nothing after the lost logs says they
    existed, and RocksDB opened the queue shorter (an outside audit: 720 of 3,600
    messages gone, `imq verify` said ok). The MANIFEST records the log the flushed
    tables' writes continue in; no log here reaches it: refused, by `imq verify` too."""
    image = _logs_image(tmp_path)
    logs = wal.log_files(os.listdir(image))
    needed = wal.newest_log_number(image / (image / "CURRENT").read_text().strip())
    assert needed is not None
    lost = [n for n in logs if int(n[:-4]) >= needed]
    assert lost and len(lost) < len(logs), (needed, logs)  # older logs stay
    for name in lost:
        (image / name).unlink()
    _refused_in_both_modes(
        image, rf"newest write-ahead log is missing: the MANIFEST records log {needed:06d} "
    )
    with pytest.raises(StorageError, match="newest write-ahead log is missing"):
        verify(image)
    # Numbered one below the number the MANIFEST records (renamed so, where it is lower),
    # the newest log left is still not the one it names.
    newest_left = wal.log_files(os.listdir(image))[-1]
    assert int(newest_left[:-4]) <= needed - 1, (newest_left, needed)
    if int(newest_left[:-4]) < needed - 1:
        (image / newest_left).rename(image / f"{needed - 1:06d}.log")
    assert wal.log_files(os.listdir(image))[-1] == f"{needed - 1:06d}.log"
    _refused_in_both_modes(image, "newest write-ahead log is missing")


def test_an_older_log_cut_at_a_record_boundary_is_refused(tmp_path: Path) -> None:
    """Cut exactly after a whole record, an older log looks whole: the sequence numbers
    of the next log's first batch show what is missing."""
    image = _logs_image(tmp_path)
    oldest = image / wal.log_files(os.listdir(image))[0]
    offset = [o for o, _, kind in wal.record_headers(oldest) if kind in (1, 2)][-1]
    os.truncate(oldest, offset)  # the last batch's record gone, whole
    with pytest.raises(StorageError, match="does not continue the log before"):
        Queue.open(image, quiet_config(), read_only=True)


def test_a_newest_log_cut_short_beside_older_logs_opens(tmp_path: Path) -> None:
    """What a crash leaves (a torn last record in the newest log) still opens."""
    image = _logs_image(tmp_path)
    newest = image / wal.log_files(os.listdir(image))[-1]
    os.truncate(newest, newest.stat().st_size - 10)
    with Queue.open(image, quiet_config(), read_only=True) as q:
        assert q.get_last_applied_seqno(APPLIED[0]) is not None
    with Queue.open(image, quiet_config()) as q:
        assert q.get_last_applied_seqno(APPLIED[0]) is not None


def test_a_database_that_lost_its_log_is_refused(tmp_path: Path) -> None:
    """The log holds every write not yet in a table file (here: all of them). Without it,
    RocksDB opens what the tables hold, here nothing, and imq took that for a new queue
    (an outside audit: deleted, the log of a killed node opened as an empty queue and
    `imq verify` said ok). A database always has its current log."""
    image, _ = _log_image(tmp_path)
    for log in _files(image, ".log"):
        (image / log).unlink()
    before = _listing(image)
    for read_only in (False, True):
        with pytest.raises(StorageError, match="write-ahead log is missing"):
            Queue.open(image, quiet_config(), read_only=read_only)
    assert _listing(image) == before


def test_every_closed_or_killed_database_keeps_a_log(tmp_path: Path) -> None:
    """What the missing-log refusals rest on: RocksDB keeps its current log file through
    opens, flushes, compactions and closes, numbered at least the newest log number its
    MANIFEST records."""
    path = tmp_path / "db"
    clock = Clock()
    for seqno in (1, 2, 3):
        q = open_queue(path)
        Chain(q, clock).apply(BASE, 20, seqno=seqno)
        _keeps_its_newest_log(path)
        q.compact()
        _keeps_its_newest_log(path)
        q.close()
        _keeps_its_newest_log(path)
    image, _ = _log_image(tmp_path / "killed")
    _keeps_its_newest_log(image)
    _keeps_its_newest_log(_logs_image(tmp_path / "flushed"))


def _keeps_its_newest_log(path: Path) -> None:
    numbers = [int(n[:-4]) for n in _files(path, ".log")]
    assert numbers
    needed = wal.newest_log_number(path / (path / "CURRENT").read_text().strip())
    assert needed is not None and max(numbers) >= needed, (needed, numbers)


# -- the MANIFEST, and directories that are not (yet) a queue ---------------------------------


def _listing(path: Path) -> dict[str, bytes]:
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path))}


@pytest.mark.parametrize("damage", ["cut", "flip"])
def test_a_damaged_manifest_never_opens_as_a_smaller_queue(
    intact: tuple[Path, dict[Table, str]], expected: dict[str, Any], tmp_path: Path, damage: str
) -> None:
    """RocksDB reads a MANIFEST cut short (or with a record length flipped so that it
    points past the end) as an older, valid one: it lists fewer tables or table files,
    and the open deletes the files it no longer lists. imq must refuse such a directory,
    never open it as a smaller (or empty, fresh) queue."""
    path, _ = intact
    (manifest,) = (n for n in os.listdir(path) if n.startswith("MANIFEST-"))
    size = (path / manifest).stat().st_size
    opened = refused = 0
    for at in sorted({size * i // 24 for i in range(24)} | {size - 1, size - 7}):
        work = tmp_path / f"{damage}-{at}"
        copy = work / "db"
        shutil.copytree(path, copy)
        if damage == "cut":
            os.truncate(copy / manifest, at)
        else:  # one bit of the byte at `at`
            data = bytearray((copy / manifest).read_bytes())
            data[at] ^= 0x10
            (copy / manifest).write_bytes(bytes(data))
        kind, result = _run(copy, "iterate", work)
        if kind == "error":
            refused += 1
            assert isinstance(result, StorageError | SchemaVersionError), repr(result)
        else:
            opened += 1
            assert result == expected["iterate"], f"opened short with the MANIFEST {damage} at {at}"
    assert refused > 0


def test_a_foreign_rocksdb_directory_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "other"
    db = Rdict(str(path), Options(raw_mode=True))
    db[b"their key"] = b"their value"
    db.close()
    before = _listing(path)
    with pytest.raises(StorageError, match="without imq's tables"):
        Queue.open(path)
    after = _listing(path)
    assert after == before
    db = Rdict(str(path), Options(raw_mode=True))
    try:
        assert db[b"their key"] == b"their value"
    finally:
        db.close()


def test_a_queue_with_a_table_this_imq_does_not_know_is_a_newer_schema(tmp_path: Path) -> None:
    """A newer imq that added a table: `SchemaVersionError` before RocksDB opens anything
    (RocksDB would refuse to open without the table, a message that read as damage), and
    the directory is left as it was, for the newer imq."""
    path = tmp_path / "db"
    q = open_queue(path)
    Chain(q).apply(BASE, 5)
    q.close()
    tables = [t.value for t in Table]
    raw = Options(raw_mode=True)
    db = Rdict(str(path), raw, column_families={t: Options(raw_mode=True) for t in tables})
    db.create_column_family("a_later_table", Options(raw_mode=True))
    db.close()
    before = _listing(path)
    for read_only in (False, True):
        with pytest.raises(SchemaVersionError, match=r"does not know \(a_later_table\)"):
            Queue.open(path, quiet_config(), read_only=read_only)
    assert _listing(path) == before


def test_a_directory_of_other_files_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "mine"
    path.mkdir()
    (path / "notes.txt").write_text("not a queue")
    with pytest.raises(StorageError, match="other files but no queue database"):
        Queue.open(path)
    assert os.listdir(path) == ["notes.txt"]


def test_an_empty_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="empty"):
        Queue.open("")
    assert os.listdir(tmp_path) == []


def test_a_creation_cut_short_before_imqs_tables_opens(tmp_path: Path) -> None:
    """Killed during the very first open, after RocksDB wrote CURRENT and before it made
    imq's tables: imq's lock file is there, no table file: the next open completes it."""
    path = tmp_path / "new"
    db = Rdict(str(path), Options(raw_mode=True))  # RocksDB's part of a creation
    db.close()
    (path / "imq.lock").touch()  # imq takes its lock before RocksDB creates anything
    q = Queue.open(path)
    try:
        assert _iterate(q) == []
    finally:
        q.close()


def test_table_files_without_current_are_refused_untouched(tmp_path: Path) -> None:
    """What a deletion cut short leaves (CURRENT gone first, table and log files still
    there) is refused before RocksDB writes a new database among them; the read-only
    open refuses it too."""
    path = tmp_path / "q"
    q = open_queue(path)
    Chain(q, Clock()).apply(BASE, 20, seqno=1)
    q.compact()
    q.close()
    (path / "CURRENT").unlink()
    before = _listing(path)
    assert _files(path, ".sst") and _files(path, ".log"), before.keys()
    with pytest.raises(StorageError, match="no CURRENT file") as err:
        Queue.open(path, quiet_config())
    assert "delete the directory" in str(err.value)
    assert _listing(path) == before
    with pytest.raises(ImqError):
        Queue.open(path, quiet_config(), read_only=True)
    assert _listing(path) == before


@pytest.mark.parametrize(
    "table",
    [Table.MESSAGES, Table.STATISTICS, Table.DIFF_INFO, Table.DIFF_TAIL],
    ids=lambda t: t.value,
)
def test_verify_draws_nothing_from_part_of_a_streamed_table(
    intact: tuple[Path, dict[Table, str]], tmp_path: Path, table: Table
) -> None:
    """``verify`` streams the tables with rows per message, destination or diff (their
    rows are never held whole): one damaged in its middle is reported as unreadable, and
    the rows read before the damage are not counted against the diffs (no false count
    problems). Without every diff record nothing is counted against them at all: the
    other tables are read for damage only, and a note says so."""
    path, sst = intact
    copy = tmp_path / "db"
    shutil.copytree(path, copy)
    file = copy / sst[table]
    _flip(file, file.stat().st_size // 2)
    seen: list[tuple[str, int]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(imq.verify, "_PROGRESS_EVERY", 5)
        report = verify(copy, progress=lambda name, rows: seen.append((name, rows)))
    assert len(report.problems) == 1, report.problems
    assert f"table {table.value}: cannot be read to its end" in report.problems[0]
    assert table.value not in report.rows  # not read to its end: no count of it
    if table is not Table.DIFF_TAIL:  # (whose few short rows fit in the damaged block)
        assert any(name == table.value for name, _ in seen)  # rows read before the damage
    uncounted = [n for n in report.notes if "read for damage only" in n]
    assert len(uncounted) == (table is Table.DIFF_INFO), report.notes
