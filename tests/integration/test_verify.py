"""``imq verify DB`` and the pointer cross-check at open (a warning, never a refusal)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from builders import (
    MC,
    Chain,
    address_in,
    block,
    damage_largest_table_file,
    diff_hash,
    full_range,
    key,
    make_diff,
    message,
    open_queue,
    quarter_shards,
    stats,
    top,
)

from imq.cli.main import main
from imq.observability import capture_events
from imq.router import PartitionRouter
from imq.storage import Table, codec
from imq.types import CommitPointer, QueueKey
from imq.verify import Report, verify

SHARDS = quarter_shards()


def _build(path: Path) -> Chain:
    q = open_queue(path)
    chain = Chain(q)
    for seqno in (1, 2, 3):
        for shard in SHARDS:
            chain.apply(shard, 20)
        chain.apply(MC, 0)
        if seqno < 3:
            tops = [top(MC, seqno)] + [top(s, seqno, seqno) for s in SHARDS]
            q.commit_diff(tops)
    q.close()
    return chain


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "db"
    _build(path)
    return path


def _tamper(path: Path, fn: object) -> None:
    q = open_queue(path)
    try:
        txn = q._store.transaction()
        fn(txn)  # type: ignore[operator]
        q._store.write(txn)
    finally:
        q.close()


def test_a_sound_database_passes(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert verify(db).ok
    assert main(["verify", str(db)]) == 0
    assert "ok:" in capsys.readouterr().out


def test_a_missing_tail_row_is_reported(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q = open_queue(db)
    info = q.get_diff_info(SHARDS[0], 3)
    q.close()
    assert info is not None
    _tamper(db, lambda t: t.delete(Table.DIFF_TAIL, codec.tail_key(SHARDS[0], info.max_message, 3)))
    report = verify(db)
    assert any("has no tail row" in p for p in report.problems)
    assert main(["verify", str(db)]) == 1
    assert "problem:" in capsys.readouterr().out


def test_a_lost_message_is_reported(db: Path) -> None:
    q = open_queue(db)
    key = next(k for k, _ in q._store.load_table(Table.MESSAGES))
    q.close()
    _tamper(db, lambda t: t.delete(Table.MESSAGES, key))
    assert any("messages stored in its span" in p for p in verify(db).problems)


def test_a_pointer_naming_the_wrong_diff_is_reported(db: Path) -> None:
    wrong = CommitPointer(QueueKey(10**9, bytes(32)), 2)
    _tamper(
        db,
        lambda t: t.put(
            Table.COMMIT_POINTERS, codec.shard_bytes(SHARDS[1]), codec.pointer_value(wrong)
        ),
    )
    assert any("differs from the max_message" in p for p in verify(db).problems)


def test_open_warns_of_a_pointer_naming_the_wrong_diff(db: Path) -> None:
    """The open-time cross-check logs what it finds and still opens the queue."""
    with capture_events() as events:
        open_queue(db).close()
    assert not [e for e in events if e["event"] == "integrity_check_failed"]
    wrong = CommitPointer(QueueKey(10**9, bytes(32)), 2)
    _tamper(
        db,
        lambda t: t.put(
            Table.COMMIT_POINTERS, codec.shard_bytes(SHARDS[1]), codec.pointer_value(wrong)
        ),
    )
    with capture_events() as events:
        q = open_queue(db)
        assert q.get_commit_pointers()[SHARDS[1]] == wrong  # opened all the same
        q.close()
    warned = [e for e in events if e["event"] == "integrity_check_failed"]
    assert len(warned) == 1
    assert warned[0]["log_level"] == "warning"
    assert str(SHARDS[1]) in warned[0]["problem"]
    assert "differs from the max_message" in warned[0]["problem"]


def test_a_damaged_table_file_is_reported(db: Path, tmp_path: Path) -> None:
    q = open_queue(db)
    q._store.flush([Table.MESSAGES])
    q.close()
    damage_largest_table_file(db)
    out = io.StringIO()
    report = verify(db)
    assert not report.ok, out.getvalue()
    assert any("cannot be read to its end" in p or "corrupt" in p for p in report.problems)
    shutil.rmtree(db)


# -- GC that stops inside a diff's span ----------------------------------------------------------

LEFT, RIGHT = SHARDS[0], SHARDS[1]


def _gc_inside_a_diff(path: Path) -> tuple[QueueKey, list[bytes]]:
    """LEFT diff 1 (10 messages), read by every committed diff up to its 5th message
    (``processed_to``), then LEFT diff 2 (4 messages) above it; one GC pass deletes the
    first 5 messages of diff 1 and keeps its records. Returns the GC bound and the
    message keys (rows) of diff 2."""
    q = open_queue(path)
    chain = Chain(q)
    first = chain.apply(LEFT, 10)
    chain.apply(MC, 0)
    q.commit_diff([top(MC, 1), top(LEFT, 1, 1)])
    bound = first.messages[4].key
    read = {LEFT: bound}
    second = chain.apply(LEFT, 4, processed_to=read)
    chain.apply(RIGHT, 3, processed_to=read)
    chain.apply(MC, 0, processed_to=read)
    q.commit_diff([top(MC, 2), top(LEFT, 2, 2), top(RIGHT, 1, 2)])
    assert q.run_gc() >= 1
    left_rows = [
        k
        for k, _ in q._store.load_table(Table.MESSAGES)
        if k[2:].startswith(codec.shard_bytes(LEFT))
    ]
    q.close()
    upper = {codec.key_bytes(m.key) for m in second.messages}
    return bound, [k for k in left_rows if k[codec.MESSAGE_PREFIX_LEN :] in upper]


def test_a_gc_bound_inside_a_diff_is_no_loss(tmp_path: Path) -> None:
    """GC stopped at a processed_to inside LEFT's diff 1: the 5 messages it deleted are
    not reported lost (``imq verify`` used to report '5 messages stored in its span, the
    diff record says 10' after every ordinary GC)."""
    db = tmp_path / "db"
    _gc_inside_a_diff(db)
    report = verify(db)
    assert report.ok, report.problems
    assert report.rows["messages"] == 5 + 4 + 3


def test_a_message_lost_above_the_gc_bound_is_reported(tmp_path: Path) -> None:
    db = tmp_path / "db"
    _bound, upper = _gc_inside_a_diff(db)
    _tamper(db, lambda t: t.delete(Table.MESSAGES, upper[1]))
    problems = verify(db).problems
    assert problems == [
        f"diff {LEFT}:2 partition 0: 3 messages stored in its span, the diff record says 4"
    ]


def test_an_extra_message_in_a_collected_span_is_reported(tmp_path: Path) -> None:
    """Inside the span GC stopped in, more rows than the diff wrote still show (5 kept
    and 6 added make 11 of 10; fewer would go unseen: no record says how many of the
    diff's messages lay at or below the bound)."""
    db = tmp_path / "db"
    bound, _upper = _gc_inside_a_diff(db)
    # above the bound, inside diff 1's span
    extra = [QueueKey(bound.lt + 1, bytes([0xF0 + i]) * 32) for i in range(6)]

    def add(t: object) -> None:
        for k in extra:
            t.put(Table.MESSAGES, codec.message_key(0, LEFT, k), b"x")  # type: ignore[attr-defined]

    _tamper(db, add)
    problems = verify(db).problems
    assert len(problems) == 1
    assert problems[0].startswith(
        f"diff {LEFT}:1 partition 0: 11 messages stored in its span, more than the 10"
    )


def test_a_gc_deleted_but_not_yet_marked_executed_is_no_loss(tmp_path: Path) -> None:
    """A pass writes its deletes, then marks the bound executed in a later batch: a crash
    (or a read-only snapshot beside the live node) between the two finds the rows gone
    and the bound only requested."""
    db = tmp_path / "db"
    _gc_inside_a_diff(db)
    _tamper(db, lambda t: t.delete(Table.VARS, codec.GC_EXECUTED))
    report = verify(db)
    assert report.ok, report.problems


def test_a_stray_message_above_every_gc_bound_is_reported(tmp_path: Path) -> None:
    """The diff records of LEFT diff 2 removed: its messages lie above the GC bound, so
    they are strays (GC never leaves them behind)."""
    db = tmp_path / "db"
    _gc_inside_a_diff(db)
    q = open_queue(db)
    info = q.get_diff_info(LEFT, 2)
    q.close()
    assert info is not None

    def drop(t: object) -> None:
        t.delete(Table.DIFF_INFO, codec.diff_info_key(LEFT, 2))  # type: ignore[attr-defined]
        t.delete(Table.DIFF_TAIL, codec.tail_key(LEFT, info.max_message, 2))  # type: ignore[attr-defined]

    _tamper(db, drop)
    assert any("4 stored messages belong to no stored diff" in p for p in verify(db).problems)


def test_statistics_that_count_more_than_the_diff_stored_are_reported(db: Path) -> None:
    """Only a shortfall was tested: ``got != stored`` weakened to ``got < stored``
    passed every test (hand mutation testing, stop 30)."""
    assert verify(db).ok
    q = open_queue(db)
    try:
        key, value = next(iter(q._store.load_table(Table.STATISTICS)))
    finally:
        q.close()
    # every destination of one diff's statistics row counted twice
    _tamper(db, lambda t: t.put(Table.STATISTICS, key, value + value))
    problems = verify(db).problems
    assert any("statistics count" in p for p in problems), problems


def test_a_tail_row_without_its_diff_info_is_reported(db: Path) -> None:
    """What a GC that forgets the info rows would leave; only the reverse (an info row
    without its tail) was tested (hand mutation testing, stop 30)."""
    assert verify(db).ok
    orphan = codec.tail_key(SHARDS[0], QueueKey(10**12, bytes(32)), 77)
    _tamper(db, lambda t: t.put(Table.DIFF_TAIL, orphan, b""))
    problems = verify(db).problems
    assert any("has no diff info" in p for p in problems), problems


# -- GC of one partition: the other partitions' rows outlive the diff's records ---------------


def _gc_of_partition_0(path: Path) -> tuple[bytes, bytes]:
    """LEFT diff 1 sends two messages to HOT (routed to partition 1) and two to others;
    a commit requests a GC bound past it for partition 0 only, and GC deletes the diff's
    records with partition 0's rows: partition 1's messages and statistics stay for
    their own bound (``test_bounds_are_per_partition`` in test_gc.py). Returns the
    statistics row partition 1 kept."""
    hot = address_in(RIGHT, 9)
    q = open_queue(path)
    chain = Chain(q)
    router = PartitionRouter(dst={1: [hot]})
    first = chain.apply(LEFT, [address_in(LEFT, 1), hot, address_in(LEFT, 2), hot], router=router)
    chain.apply(MC, 0, processed_to={LEFT: first.max_message})
    q.commit_diff([top(MC, 1), top(LEFT, 1, 1)], partitions=(0,))
    assert q.run_gc() == 1
    assert q.get_diff_info(LEFT, 1) is None
    kept = list(q._store.load_table(Table.STATISTICS))
    assert q.load_diff_statistics(1, full_range(LEFT)) == {hot: 2}
    q.close()
    assert len(kept) == 1
    return kept[0]


def test_rows_of_a_partition_gc_has_not_reached_are_no_problem(tmp_path: Path) -> None:
    """Partition 1's two messages and statistics row of a diff whose records GC of
    partition 0 deleted: legitimate (and present: the report counts them)."""
    db = tmp_path / "db"
    _gc_of_partition_0(db)
    report = verify(db)
    assert report.ok, report.problems
    assert report.rows["statistics"] == 1
    assert report.rows["messages"] == 2


def test_statistics_of_no_stored_diff_above_every_gc_bound_are_reported(db: Path) -> None:
    """A statistics row naming a diff that is not stored, above every GC bound of its
    shard: nothing deletes a diff's records and keeps its statistics there (hand
    mutation testing, stop 30, found such rows unreported)."""
    orphan = codec.stat_key(SHARDS[0], 0, QueueKey(10**12, bytes(32)), 77)
    _tamper(db, lambda t: t.put(Table.STATISTICS, orphan, b""))
    problems = verify(db).problems
    assert problems == [
        f"statistics of diff {SHARDS[0]}:77 partition 0 (max {QueueKey(10**12, bytes(32))}) "
        "belong to no stored diff (above every GC bound of the shard)"
    ], problems


def test_statistics_left_above_the_gc_bound_of_a_partition_are_reported(tmp_path: Path) -> None:
    """The kept partition 1 row moved above partition 0's bound (a stats row of a diff
    the bound never reached, whose records are gone): reported."""
    db = tmp_path / "db"
    kept, value = _gc_of_partition_0(db)
    moved = codec.stat_key(LEFT, 1, QueueKey(10**12, bytes(32)), 1)

    def move(t: object) -> None:
        t.delete(Table.STATISTICS, kept)  # type: ignore[attr-defined]
        t.put(Table.STATISTICS, moved, value)  # type: ignore[attr-defined]

    _tamper(db, move)
    problems = verify(db).problems
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"statistics of diff {LEFT}:1 partition 1")


# -- diffs whose key spans overlap ----------------------------------------------------------


def _two_diffs(path: Path, first: tuple[int, ...], second: tuple[int, ...]) -> Report:
    """LEFT diffs 1 and 2 with messages at the logical times given (a key per lt), then
    ``imq verify`` of the database."""
    q = open_queue(path)
    src, dst = address_in(LEFT, 1), address_in(RIGHT, 1)
    for seqno, lts in ((1, first), (2, second)):
        diff = make_diff([message(key(lt), src, dst) for lt in lts])
        assert q.apply_diff(diff, block(LEFT, seqno), diff_hash(("two", seqno)))
    q.close()
    return verify(path)


def test_a_diff_spanning_an_earlier_one_is_noted_not_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The queue accepts a diff whose span covers an earlier diff's keys (only a commit
    pointer bounds a new diff from below). ``imq verify`` counted each message in the
    diff whose span starts last below it and reported a sound queue as damaged: '1
    stored messages belong to no stored diff' and 'diff ...:2 partition 0: 1 messages
    stored in its span, the diff record says 2' (found by the state machines once they
    ran verify at the end of every program). Such diffs may share message keys, so their
    rows cannot be counted per diff: a note says so, the exit status stays 0."""
    db = tmp_path / "db"
    report = _two_diffs(db, (103,), (100, 107))
    assert report.ok, report.problems
    assert report.rows["messages"] == 3
    assert report.notes == [
        f"diffs {LEFT}:1, 2 (overlapping spans): messages not counted (a collator never "
        "writes such diffs: logical time grows within a shard)"
    ]
    assert main(["verify", "--no-progress", str(db)]) == 0
    out = capsys.readouterr().out
    assert f"note: diffs {LEFT}:1, 2 (overlapping spans)" in out
    assert "ok: checksums and cross-checks pass" in out


def test_statistics_of_an_earlier_diff_of_the_same_seqno_are_not_counted(tmp_path: Path) -> None:
    """GC of partition 0 collects LEFT diff 1's records; partition 1 keeps its statistics
    row (its bound has not reached it); seqno 1 is then applied again with other
    messages. Its statistics are checked against its own rows only: the earlier diff's
    row (under another max_message) is a legitimate leftover, not a second count."""
    db = tmp_path / "db"
    _gc_of_partition_0(db)
    q = open_queue(db)
    hot = address_in(RIGHT, 9)
    again = [message(key(10_000 + i), address_in(LEFT, 1), hot) for i in range(3)]
    router = PartitionRouter(dst={1: [hot]})
    assert q.apply_diff(make_diff(again, router=router), block(LEFT, 1), diff_hash("again"))
    assert len(list(q._store.load_table(Table.STATISTICS))) == 2
    q.close()
    report = verify(db)
    assert report.ok, report.problems


def test_an_empty_diff_sharing_the_previous_key_keeps_the_count_checked(tmp_path: Path) -> None:
    """On a network an empty diff takes the previous diff's max_message as its whole span:
    the two spans touch, yet the first diff's messages are still counted (a lost one is
    reported), with no note."""
    db = tmp_path / "db"
    q = open_queue(db)
    chain = Chain(q)
    first = chain.apply(LEFT, 3)
    shared = stats(LEFT, first.max_message, first.max_message, {})
    chain.apply(LEFT, 0, statistics=shared)
    assert q.get_diff_info(LEFT, 2).min_message == first.max_message  # type: ignore[union-attr]
    q.close()
    report = verify(db)
    assert report.ok and not report.notes, (report.problems, report.notes)

    lost = codec.message_key(0, LEFT, first.messages[1].key)
    _tamper(db, lambda t: t.delete(Table.MESSAGES, lost))
    report = verify(db)
    assert report.problems == [
        f"diff {LEFT}:1 partition 0: 2 messages stored in its span, the diff record says 3"
    ]
    assert not report.notes


def test_a_diff_starting_at_the_previous_diffs_last_key_is_noted(tmp_path: Path) -> None:
    """Two diffs that share one message key (one row holds both): their spans touch at
    that key, so they are one cluster, noted and not counted (counted apart, the second
    would own the shared row and the first come up one short)."""
    report = _two_diffs(tmp_path / "db", (100, 103), (103, 107))
    assert report.ok, report.problems
    assert report.rows["messages"] == 3
    assert len(report.notes) == 1
    assert report.notes[0].startswith(f"diffs {LEFT}:1, 2 (overlapping spans): ")


def test_progress_counts_the_rows_of_the_streamed_tables(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tables with rows per message, destination or diff are read as a stream
    (memory does not grow with their rows); ``progress(table, rows)`` follows the read,
    and the report counts every row (3 blocks of 4 shards, 20 messages each)."""
    import imq.verify

    monkeypatch.setattr(imq.verify, "_PROGRESS_EVERY", 7)
    seen: list[tuple[str, int]] = []
    report = verify(db, progress=lambda table, rows: seen.append((table, rows)))
    assert report.ok, report.problems
    assert report.rows[Table.MESSAGES.value] == 3 * 4 * 20
    streamed = (Table.MESSAGES, Table.STATISTICS, Table.DIFF_INFO, Table.DIFF_TAIL)
    for table in streamed:
        counts = [n for name, n in seen if name == table.value]
        assert counts == list(range(7, report.rows[table.value] + 1, 7)), (table, counts)
    assert {name for name, _ in seen} == {t.value for t in streamed}
    assert set(report.rows) == {t.value for t in Table}
