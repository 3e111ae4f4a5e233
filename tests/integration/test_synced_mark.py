"""A log or MANIFEST cut short before its last fsync is refused, never opened as an older,
shorter queue.

RocksDB's recovery takes a write-ahead log or a MANIFEST that ends early for a torn tail
(what a power loss leaves after the last fsync) and opens the state before the cut
without a word: an outside audit cut the newest log of a killed writer in its middle
(synced commits gone, `imq verify` "ok") and the MANIFEST of a cleanly closed queue (a
third of the messages gone, then deleted for good by the next writer's open). The store
now records, after each synced write and at close, the sequence number the log is
synced up to (``imq.synced``); an open that recovers less is refused.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import textwrap
import threading
import types
import weakref
from pathlib import Path
from typing import Any

import pytest
from builders import MC, Chain, iterate_all, open_queue, quarter_shards, quiet_config, state

from imq import Queue
from imq.errors import StorageError
from imq.storage import Table, rocks, wal
from imq.storage.rocks import SYNCED_FILE, read_synced_mark

SHARDS = quarter_shards()
ROOT = Path(__file__).resolve().parents[2]


def _observed(q: Queue) -> dict[str, Any]:
    return {"messages": iterate_all(q, SHARDS, for_shard=SHARDS[0]), **state(q, SHARDS)}


def _commit_rounds(
    q: Queue, chain: Chain, rounds: range, messages: int = 2, body: bytes = b""
) -> None:
    """Rounds of a diff of ``messages`` per shard and a commit on a masterchain block."""
    for mc_seqno in rounds:
        tops = [chain.apply(s, messages, body=body) for s in SHARDS]
        mc = chain.apply(MC, 0, seqno=mc_seqno)
        assert q.commit_diff([mc.top(), *(t.top(mc_seqno) for t in tops)])


def _build(q: Queue, rounds: int, *, flush: bool) -> None:
    """Rounds of 40 messages a shard and a commit; each round's tables flushed when
    ``flush`` (so that the MANIFEST holds an edit per table and round)."""
    chain = Chain(q)
    for mc_seqno in range(1, rounds + 1):
        _commit_rounds(q, chain, range(mc_seqno, mc_seqno + 1), 40, b"m" * 80)
        if flush:
            q._store.flush(list(Table))


def _manifest(db: Path) -> Path:
    return db / (db / "CURRENT").read_text().strip()


@pytest.fixture(scope="module")
def closed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A queue closed cleanly after six flushed rounds, and what it holds."""
    db = tmp_path_factory.mktemp("synced") / "closed"
    with open_queue(db) as q:
        _build(q, 6, flush=True)
    with Queue.open(db, read_only=True) as q:
        return db, _observed(q)


def test_a_clean_close_marks_every_write_synced(closed: tuple[Path, dict[str, Any]]) -> None:
    db, _ = closed
    mark = read_synced_mark(db)
    assert mark is not None and mark > 0
    with Queue.open(db, read_only=True) as q:
        assert q._store._db.latest_sequence_number() == mark


def test_a_manifest_cut_short_is_refused_never_read_short(
    closed: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Cut at 24 points over its last half: every open (read-only, then a writer's) is
    refused or reads all; before, 8 of them read an older queue without a word."""
    intact, expected = closed
    size = _manifest(intact).stat().st_size
    refused = 0
    for n, cut in enumerate(range(size // 2, size, max(1, size // 48))):
        db = tmp_path / f"cut{n}"
        shutil.copytree(intact, db)
        os.truncate(_manifest(db), cut)
        for read_only in (True, False):
            try:
                with Queue.open(db, read_only=read_only) as q:
                    assert _observed(q) == expected, (cut, read_only)
            except StorageError as exc:
                assert SYNCED_FILE in str(exc) or "MANIFEST" in str(exc), exc
                refused += 1
        shutil.rmtree(db)
    assert refused >= 8


def _files(db: Path) -> dict[str, bytes]:
    """The directory's files and their bytes, RocksDB's info log (``LOG*``) left out."""
    return {p.name: p.read_bytes() for p in db.iterdir() if not p.name.startswith("LOG")}


def test_a_writer_refuses_a_cut_manifest_before_rocksdb_deletes_anything(
    closed: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A writer's open of a MANIFEST cut short is refused with every file as it was, so
    the intact MANIFEST put back opens the whole queue. Before, the refusal came after
    RocksDB's open had deleted the table files the cut MANIFEST no longer listed (the
    queue's messages gone for good, whatever was restored)."""
    intact, expected = closed
    manifest = _manifest(intact)
    size = manifest.stat().st_size
    refused = 0
    for n, cut in enumerate(range(size // 2, size, max(1, size // 24))):
        db = tmp_path / f"cut{n}"
        shutil.copytree(intact, db)
        os.truncate(_manifest(db), cut)
        before = _files(db)
        try:
            with Queue.open(db) as q:
                assert _observed(q) == expected, cut
            continue
        except StorageError as exc:  # RocksDB's own refusal of a cut inside an edit too
            if "had been synced to disk" in str(exc):
                assert "nothing in it was changed" in str(exc), exc
                refused += 1
        assert _files(db) == before, cut
        shutil.copyfile(manifest, _manifest(db))  # the way out: a copy of the file
        with Queue.open(db) as q:
            assert _observed(q) == expected, cut
        shutil.rmtree(db)
    assert refused >= 4


def test_a_manifest_cut_after_the_tables_creation_is_refused_with_nothing_changed(
    closed: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """The read-only open that settles a doubtful writer's open can fail on its own: a
    MANIFEST cut just after the tables' creation fails its schema check. The writer's
    open is refused then too, with every file as it was; before, it went on, RocksDB
    deleted every table file, the log and the MANIFEST, and then the open was refused
    (an outside audit)."""
    intact, expected = closed
    db = tmp_path / "db"
    shutil.copytree(intact, db)
    manifest = _manifest(db)
    data = manifest.read_bytes()
    cut = next(  # the first edit recording a write: cut there, the tables' creation left
        offset
        for offset, length, kind in wal.record_headers(manifest)
        if kind == 1 and (wal._leading_fields(data[offset + 7 : offset + 7 + length])[1] or 0)
    )
    os.truncate(manifest, cut)
    before = _files(db)
    with pytest.raises(StorageError, match="a read-only open to tell what RocksDB") as info:
        Queue.open(db)
    assert "nothing in it was changed" in str(info.value)
    assert _files(db) == before
    shutil.copyfile(_manifest(intact), manifest)
    with Queue.open(db) as q:
        assert _observed(q) == expected


def _run_child(source: str, *args: Path) -> None:
    """Run ``source`` in a child process: argv[1] the tests' directory, argv[2] the
    repository's root, then ``args``."""
    tests = Path(__file__).resolve().parent
    subprocess.run(
        [sys.executable, "-c", source, str(tests), str(ROOT), *map(str, args)],
        check=True,
        timeout=120,
    )


_OLDER_MANIFEST = textwrap.dedent(
    """
    import os, shutil, sys
    sys.path[:0] = sys.argv[1:3]
    from builders import Chain, quiet_config
    from imq import Queue
    from imq.storage import Table
    from test_synced_mark import _commit_rounds
    db, copy = sys.argv[3:5]
    q = Queue.open(db, quiet_config(sync_commits=True))
    chain = Chain(q)
    q._store.flush(list(Table))
    _commit_rounds(q, chain, range(1, 4), 20)
    name = open(os.path.join(db, "CURRENT")).read().strip()
    shutil.copyfile(os.path.join(db, name), copy)  # the MANIFEST as it is now
    q._store.flush(list(Table))  # rounds 1-3 into table files; their log goes
    _commit_rounds(q, chain, range(4, 6), 20)
    os._exit(0)  # killed
    """
)


def test_an_older_copy_of_the_manifest_is_refused_before_rocksdb_deletes_tables(
    tmp_path: Path,
) -> None:
    """A MANIFEST put back from before the last flush, beside the newer log: the log
    starts past the last write the MANIFEST records, and the writes between are in
    table files that MANIFEST does not list. Before, the writer's open went on (the log
    reached the mark), RocksDB deleted 6 of 7 table files, and the queue opened with 40
    of its 100 messages (an outside audit)."""
    db, older = tmp_path / "db", tmp_path / "older-manifest"
    _run_child(_OLDER_MANIFEST, db, older)
    with Queue.open(db, read_only=True) as q:
        expected = _observed(q)
    assert len(expected["messages"]) == 100
    shutil.copyfile(older, _manifest(db))
    before = _files(db)
    for read_only in (True, False):
        with pytest.raises(StorageError, match="the writes in between are in no file") as info:
            Queue.open(db, read_only=read_only)
        assert "nothing in it was changed" in str(info.value)
        assert _files(db) == before


_FLUSHED_PAST_THE_MARK = textwrap.dedent(
    """
    import os, sys
    sys.path[:0] = sys.argv[1:3]
    from builders import Chain, quarter_shards, quiet_config
    from imq import Queue
    from imq.storage import Table
    from test_synced_mark import _commit_rounds
    q = Queue.open(sys.argv[3], quiet_config(sync_commits=True))
    chain = Chain(q)
    _commit_rounds(q, chain, range(1, 3), 5)  # synced: the mark
    chain.apply(quarter_shards()[0], 5)  # a write after the last commit, not synced
    q._store.flush([Table.MESSAGES])  # its flush records that write's sequence number
    os._exit(0)  # killed
    """
)


def test_a_log_cut_before_a_synced_commit_is_refused_past_a_flushs_number(
    tmp_path: Path,
) -> None:
    """The newest log cut before the last synced commit's batch, where a later flush of
    one table recorded a higher sequence number in the MANIFEST: RocksDB recovers that
    number, so the check after the open passed, and the acknowledged commit was gone
    (an outside audit). The logs are checked against the mark before the open now."""
    db = tmp_path / "db"
    _run_child(_FLUSHED_PAST_THE_MARK, db)
    mark = read_synced_mark(db)
    recorded = wal.manifest_facts(_manifest(db)).last_sequence
    assert mark is not None and recorded is not None and recorded > mark
    with Queue.open(db, read_only=True) as q:
        last = q.get_last_committed_mc_block_id()
        assert last is not None and last.seqno == 2
    log = next(
        p for p in map(db.joinpath, reversed(wal.log_files(os.listdir(db)))) if p.stat().st_size
    )
    batches = {}
    data = log.read_bytes()
    for offset, _, kind in wal.record_headers(log):
        if kind in (1, 2):  # a batch starts in a full record or a first fragment
            seq, count = struct.unpack_from("<QI", data, offset + 7)
            batches[seq + count - 1] = offset
    os.truncate(log, batches[mark])  # the commit's batch and everything after it
    before = _files(db)
    for read_only in (True, False):
        with pytest.raises(StorageError, match=f"writes up to sequence number {mark} had"):
            Queue.open(db, read_only=read_only)
        assert _files(db) == before


@pytest.mark.parametrize(
    ("recorded", "mark", "refused"),
    [
        (100, None, None),  # the log takes up right after the MANIFEST's last write
        (500, None, None),  # or before it (writes after the flush's switch of logs)
        (None, None, None),  # a MANIFEST recording no number: nothing concluded
        (99, None, "in no file"),  # write 100 in no file
        (100, 160, None),  # the logs reach the mark
        (100, 161, "had been synced"),  # they end one short of it
        (100, 100, None),  # the mark before the logs: its writes flushed, logs gone
    ],
)
def test_the_log_checks_boundaries(
    tmp_path: Path, recorded: int | None, mark: int | None, refused: str | None
) -> None:
    """The oldest log (here starting at 101) may start at most one past the MANIFEST's
    last write; logs that start at or below the mark must reach it (here 160)."""
    store = types.SimpleNamespace(path=tmp_path, _manifest_sequence=recorded, _synced_mark=mark)
    spans = [wal.LogSpan("000009.log", 101, 150), wal.LogSpan("000011.log", 151, 160)]
    if refused is None:
        rocks.Store._check_log_spans(store, spans)  # type: ignore[arg-type]
        assert store._logged_sequence == 160
    else:
        with pytest.raises(StorageError, match=refused):
            rocks.Store._check_log_spans(store, spans)  # type: ignore[arg-type]


def test_logs_with_no_whole_batch_reach_no_mark_they_start_at(tmp_path: Path) -> None:
    """A log whose only batch, at the mark, is not whole (its head read, its end cut)
    lost that synced write; one starting past the mark holds none of its writes."""
    spans = [wal.LogSpan("000009.log", 101, None)]
    store = types.SimpleNamespace(path=tmp_path, _manifest_sequence=100, _synced_mark=101)
    with pytest.raises(StorageError, match="end at 100"):
        rocks.Store._check_log_spans(store, spans)  # type: ignore[arg-type]
    store._synced_mark = 100
    rocks.Store._check_log_spans(store, spans)  # type: ignore[arg-type]


_KILLED_WRITER = textwrap.dedent(
    """
    import os, sys
    sys.path[:0] = sys.argv[1:3]
    from builders import quiet_config
    from imq import Queue
    from test_synced_mark import _build
    q = Queue.open(sys.argv[3], quiet_config(sync_commits=True))  # each commit fsyncs
    _build(q, 8, flush=False)  # every row still in the log: nothing flushed
    os._exit(0)  # killed: no close
    """
)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A writer killed after eight synced commits, its rows only in the log."""
    db = tmp_path_factory.mktemp("synced") / "killed"
    _run_child(_KILLED_WRITER, db)
    with Queue.open(db, read_only=True) as q:
        return db, _observed(q)


def _newest_log(db: Path) -> Path:
    return db / wal.log_files(os.listdir(db))[-1]


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.9])
def test_the_newest_log_cut_before_its_last_fsync_is_refused(
    killed: tuple[Path, dict[str, Any]], tmp_path: Path, fraction: float
) -> None:
    """Before, the open replayed the cut log as a torn tail: commits acknowledged with
    their fsync gone, and `imq verify` said "ok"."""
    intact, expected = killed
    db = tmp_path / "db"
    shutil.copytree(intact, db)
    log = _newest_log(db)
    os.truncate(log, int(log.stat().st_size * fraction))
    for read_only in (True, False):
        with pytest.raises(StorageError, match="had been synced to disk") as info:
            Queue.open(db, read_only=read_only)
        assert "delete imq.synced" in str(info.value)
    verify = subprocess.run(
        [sys.executable, "-m", "imq", "verify", str(db)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert verify.returncode == 1 and "had been synced" in verify.stderr
    # The way out the error names: without the mark, what is left opens as it is.
    (db / SYNCED_FILE).unlink()
    with Queue.open(db) as q:
        assert len(_observed(q)["messages"]) < len(expected["messages"])


_UNSYNCED_WRITER = textwrap.dedent(
    """
    import os, sys
    sys.path[:0] = sys.argv[1:3]
    from builders import Chain, Clock, open_queue, quarter_shards
    q = open_queue(sys.argv[3])  # replays the log; a new log starts
    chain = Chain(q, Clock(start=10**9))  # above every committed key
    chain.apply(quarter_shards()[0], 400, seqno=9, body=b"u" * 200)  # not synced
    os._exit(0)  # killed: no close, so no sync at close either
    """
)


def test_an_intact_queue_opens_without_the_read_only_check(
    closed: tuple[Path, dict[str, Any]],
    killed: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a clean close and after a kill, the MANIFEST's and the logs' sequence
    numbers reach the mark: a writer's open needs no read-only open first."""
    probes: list[Path] = []
    real = rocks.Store._open_for_reading

    def probe(store: rocks.Store) -> None:
        probes.append(store.path)
        real(store)

    monkeypatch.setattr(rocks.Store, "_open_for_reading", probe)
    for intact, expected in (closed, killed):
        db = tmp_path / intact.name
        shutil.copytree(intact, db)
        with Queue.open(db) as q:
            assert _observed(q) == expected
    assert probes == []


def test_a_torn_unsynced_tail_still_opens(
    killed: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """What a power loss can take, writes after the last fsync, is still taken as a torn
    tail: a diff applied after the last commit, its record cut short, opens without it."""
    intact, expected = killed
    db = tmp_path / "db"
    shutil.copytree(intact, db)
    _run_child(_UNSYNCED_WRITER, db)
    log = _newest_log(db)
    size = log.stat().st_size
    assert size > 400 * 200  # the unsynced diff's record ends the log
    os.truncate(log, size - 1000)
    with Queue.open(db) as q:
        assert _observed(q) == expected


def test_a_stale_mark_beside_no_database_is_dropped(tmp_path: Path) -> None:
    """The mark left beside a database whose RocksDB files were deleted does not refuse
    the new database created there."""
    db = tmp_path / "db"
    with open_queue(db) as q:
        _build(q, 2, flush=False)
    assert read_synced_mark(db) is not None
    for name in os.listdir(db):
        if name != SYNCED_FILE:
            path = db / name
            path.unlink()
    with open_queue(db) as q:
        # gone at the open, not at the first synced write: a crash before that would
        # leave the new database refused by the old mark
        assert not (db / SYNCED_FILE).exists()
        assert q.get_last_committed_mc_block_id() is None


def test_a_torn_mark_is_no_mark(closed: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """A mark whose checksum does not match (a torn rewrite after a power loss) checks
    nothing: its number, however high, refuses no open."""
    intact, expected = closed
    db = tmp_path / "db"
    shutil.copytree(intact, db)
    with open(db / SYNCED_FILE, "r+b") as file:
        file.seek(4)
        file.write((2**40).to_bytes(8, "big"))  # the sequence number, not its checksum
    assert read_synced_mark(db) is None
    with Queue.open(db) as q:
        assert _observed(q) == expected


def test_the_shortfall_error_names_both_numbers(tmp_path: Path) -> None:
    error = rocks._short_of_synced(tmp_path, 5, 9, untouched=True)
    assert "recovered its writes up to sequence number 5, but writes up to 9 had" in str(error)
    assert str(error).endswith("nothing in it was changed")
    assert "nothing in it was changed" not in str(
        rocks._short_of_synced(tmp_path, 5, 9, untouched=False)
    )


def test_a_doubtful_open_whose_read_only_check_recovers_the_mark_goes_on(
    closed: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the files cannot show the mark reached (here: their numbers hidden), the
    read-only open settles it: recovering exactly the mark, the writer's open goes on."""
    intact, expected = closed
    db = tmp_path / "db"
    shutil.copytree(intact, db)
    real_spans = rocks.Store._check_log_spans

    def hidden_spans(store: rocks.Store, spans: list[wal.LogSpan]) -> None:
        real_spans(store, spans)
        store._logged_sequence = None

    probes: list[Path] = []
    real_read = rocks.Store._open_for_reading

    def counted(store: rocks.Store) -> None:
        probes.append(store.path)
        real_read(store)

    monkeypatch.setattr(rocks.wal, "manifest_facts", lambda _path: wal.ManifestFacts(None, None))
    monkeypatch.setattr(rocks.Store, "_check_log_spans", hidden_spans)
    monkeypatch.setattr(rocks.Store, "_open_for_reading", counted)
    with Queue.open(db, read_only=True) as q:
        assert q._store._db.latest_sequence_number() == read_synced_mark(db)
    probes.clear()
    with Queue.open(db) as q:
        assert _observed(q) == expected
    assert probes == [db]


def test_the_mark_keeps_one_descriptor_however_many_synced_writes(tmp_path: Path) -> None:
    with Queue.open(tmp_path / "db", quiet_config(sync_commits=True)) as q:
        chain = Chain(q)
        _commit_rounds(q, chain, range(1, 2))
        before = len(os.listdir("/proc/self/fd"))
        _commit_rounds(q, chain, range(2, 22))
        assert len(os.listdir("/proc/self/fd")) <= before + 1


class _FailingSync:
    """RocksDB's handle, whose sync of the log at close fails."""

    def __init__(self, db: Any) -> None:
        self._real = db

    def flush_wal(self, sync: bool = False) -> None:
        raise RuntimeError("IO error: sync failed (the test's)")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def test_a_close_whose_log_sync_fails_leaves_the_mark_as_it_was(tmp_path: Path) -> None:
    """A mark written after a failed sync would claim writes the disk may not hold (the
    next open refused): it stays at the last synced write."""
    db = tmp_path / "db"
    q = Queue.open(db, quiet_config(sync_commits=True))
    chain = Chain(q)
    _commit_rounds(q, chain, range(1, 3))
    mark = read_synced_mark(db)
    chain.apply(SHARDS[0], 5)  # a write after the last synced one
    store = q._store
    assert store._db.latest_sequence_number() > mark
    store._db = _FailingSync(store._db)
    q.close()
    assert read_synced_mark(db) == mark


def _mark_timers(store: Any) -> list[threading.Thread]:
    """The mark timers of ``store`` that are alive (other tests' may linger elsewhere)."""
    timer = store._mark_timer
    return [timer] if timer is not None and timer.is_alive() else []


def _counting_mark_syncs(store: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The fsyncs of ``store``'s mark file from now on, one entry each."""
    synced: list[int] = []
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        if fd == store._synced_fd:
            synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    return synced


def test_a_mark_written_too_soon_to_sync_is_synced_by_one_timer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Synced commits within a second of the mark's last fsync leave it to a timer: one
    thread for them all, which syncs the mark once that second has passed (what a queue
    left idle after a burst of commits needs: the power-loss test shows the disk), and
    which close() stops before it syncs the mark itself."""
    monkeypatch.setattr(rocks, "MARK_SYNC_INTERVAL", 0.5)
    q = Queue.open(tmp_path / "db", quiet_config(sync_commits=True))
    store = q._store
    synced = _counting_mark_syncs(store, monkeypatch)
    try:
        assert _mark_timers(store) == []
        chain = Chain(q)
        _commit_rounds(q, chain, range(1, 2))  # the first mark: synced at once
        assert len(synced) == 1 and _mark_timers(store) == []
        monkeypatch.setattr(rocks, "MARK_SYNC_INTERVAL", 30.0)  # due long after the burst
        _commit_rounds(q, chain, range(2, 6))  # too soon: one timer takes them all
        assert len(synced) == 1 and len(_mark_timers(store)) == 1
        (timer,) = _mark_timers(store)
        timer.cancel()  # run it now instead of in 30 s: what its thread runs when due
        rocks._deferred_mark_sync(weakref.ref(store))
        assert len(synced) == 2  # the timer's
        rocks._deferred_mark_sync(weakref.ref(store))
        assert len(synced) == 2  # a mark synced already is not synced again
        # Another burst, then close: the pending timer is stopped, close syncs the mark.
        _commit_rounds(q, chain, range(6, 8))
        (timer,) = _mark_timers(store)
        latest = store._db.latest_sequence_number()
    finally:
        q.close()
    timer.join(5)
    assert not timer.is_alive() and store._mark_timer is None
    assert len(synced) == 3  # close's, not the timer's as well
    assert read_synced_mark(tmp_path / "db") == latest


def test_a_synced_write_that_syncs_the_mark_stops_its_pending_timer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A synced write that finds the mark's last fsync a second old syncs it itself; a
    timer still pending (due at the same moment) is stopped, not left to sync it again
    right after."""
    monkeypatch.setattr(rocks, "MARK_SYNC_INTERVAL", 30.0)
    with Queue.open(tmp_path / "db", quiet_config(sync_commits=True)) as q:
        store = q._store
        synced = _counting_mark_syncs(store, monkeypatch)
        chain = Chain(q)
        _commit_rounds(q, chain, range(1, 3))  # the first synced, the second: a timer
        (timer,) = _mark_timers(store)
        assert len(synced) == 1
        store._mark_fsynced_at -= 31.0  # as if 31 s had passed (the timer not yet run)
        _commit_rounds(q, chain, range(3, 4))
        assert len(synced) == 2  # the write's own
        timer.join(5)
        assert not timer.is_alive() and store._mark_timer is None  # stopped, not run
        assert len(synced) == 2


def test_a_commit_whose_mark_timer_cannot_start_still_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread to be had (an interpreter exiting, a process at its thread limit): the
    commit, already synced, returns; the mark waits for a later write or close."""
    q = Queue.open(tmp_path / "db", quiet_config(sync_commits=True))
    chain = Chain(q)
    _commit_rounds(q, chain, range(1, 2))

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Timer, "start", refuse)
    try:
        _commit_rounds(q, chain, range(2, 4))
        assert q._store._mark_timer is None
        latest = q._store._db.latest_sequence_number()
    finally:
        q.close()
    assert read_synced_mark(tmp_path / "db") == latest


def test_a_synced_write_whose_sync_fails_says_its_outcome_is_known_after_a_reopen(
    tmp_path: Path,
) -> None:
    """RocksDB took the batch, then the log's sync failed: the batch is in the log file
    (and the memtable), not known to be on the disk. The error must not claim that
    nothing was written (an audit: it did, and the commit was there after the reopen);
    it names the sync and says to check after a reopen, where the change is whole."""
    db = tmp_path / "db"
    q = Queue.open(db, quiet_config(sync_commits=True))
    chain = Chain(q)
    _commit_rounds(q, chain, range(1, 2))
    tops = [chain.apply(s, 2) for s in SHARDS]
    mc = chain.apply(MC, 0, seqno=2)
    blocks = [mc.top(), *(t.top(2) for t in tops)]
    store = q._store
    real = store._db

    class SyncFails:
        def flush_wal(self, sync: bool = False) -> None:  # what rocksdict raises
            raise Exception("IO error: sync failed (the test's)")

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    store._db = SyncFails()
    try:
        with pytest.raises(StorageError) as raised:
            q.commit_diff(blocks)
    finally:
        store._db = real
    error = raised.value
    assert error.operation == StorageError.UNSYNCED_OPERATION
    assert "known only after a reopen" in error.hint
    assert "nothing the failed call staged was written" not in str(error)
    assert store.dead is error
    with pytest.raises(StorageError) as later:  # a later call wrote nothing: it says so
        chain.apply(SHARDS[0], 1)
    assert later.value.operation == f"a call after {StorageError.UNSYNCED_OPERATION} failed"
    assert "this call wrote nothing" in later.value.hint
    assert "the call's batch was written" not in str(later.value)
    q.close()
    with Queue.open(db, quiet_config(sync_commits=True)) as q:
        assert q.get_last_committed_mc_block_id() == mc.top().block_id
        assert not q.commit_diff(blocks)  # landed: the retry is a no-op
