"""``imq verify DB`` and the pointer cross-check at open (a warning, never a refusal)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from builders import MC, Chain, open_queue, quarter_shards, top

from imq.cli.main import main
from imq.observability import capture_events
from imq.storage import Table, codec
from imq.types import CommitPointer, QueueKey
from imq.verify import verify

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
    sst = max(db.glob("*.sst"), key=lambda p: p.stat().st_size)
    data = bytearray(sst.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 48):
        data[i] ^= 0xFF
    sst.write_bytes(bytes(data))
    out = io.StringIO()
    report = verify(db)
    assert not report.ok, out.getvalue()
    assert any("cannot be read to its end" in p or "corrupt" in p for p in report.problems)
    shutil.rmtree(db)
