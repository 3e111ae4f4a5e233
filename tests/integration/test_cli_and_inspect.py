"""The read-only open, Queue.summary, and the `imq` command (demo, inspect)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from imq import (
    Address,
    BlockId,
    BlockIdShort,
    ImqError,
    Message,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ReadOnlyError,
    ShardIdent,
    TopBlock,
)
from imq.cli.main import main

MC = ShardIdent.MASTERCHAIN
LEFT = ShardIdent(0, 0x4000_0000_0000_0000)


def _message(lt: int, dst_first: int = 0x90, src_wc: int = 0) -> Message:
    return Message(
        QueueKey(lt, lt.to_bytes(32, "big")),
        Address(src_wc, b"\x10" * 32),  # inside LEFT (0:4000...) or the masterchain
        Address(0, bytes([dst_first]) + b"\x01" * 31),
    )


def _fill(queue: Queue) -> None:
    """Two diffs of LEFT (one committed), one masterchain diff."""
    queue.apply_diff(QueueDiff([_message(10), _message(11)]), BlockIdShort(LEFT, 1), b"\x01" * 32)
    queue.apply_diff(QueueDiff([_message(20)]), BlockIdShort(LEFT, 2), b"\x02" * 32)
    mc_diff = QueueDiff([_message(5, src_wc=-1)], {LEFT: QueueKey.max_for_lt(10)})
    queue.apply_diff(mc_diff, BlockIdShort(MC, 1), b"\x03" * 32)
    queue.commit_diff([TopBlock(BlockId(MC, 1), 1), TopBlock(BlockId(LEFT, 1), 1)])


def test_read_only_open_beside_a_live_writer(tmp_path: Path) -> None:
    db = tmp_path / "db"
    with Queue.open(db, QueueConfig.testing()) as writer:
        _fill(writer)
        with Queue.open(db, read_only=True) as reader:
            assert reader.read_only
            assert reader.get_commit_pointers() == writer.get_commit_pointers()
            assert reader.get_last_committed_mc_block_id() == BlockId(MC, 1)
            ranges = [QueueShardRange(LEFT, QueueKey.MIN, QueueKey.MAX)]
            got = [m.message.key.lt for m in reader.iterator(0, ranges, ShardIdent.BASECHAIN)]
            assert got == [10, 11, 20]
            assert reader.gc_worker is None


def test_read_only_refuses_every_write(tmp_path: Path) -> None:
    db = tmp_path / "db"
    with Queue.open(db, QueueConfig.testing()) as writer:
        _fill(writer)
    with Queue.open(db, read_only=True) as reader:
        calls = {
            "prepare_diff": lambda: reader.prepare_diff(
                QueueDiff(), BlockIdShort(LEFT, 9), b"\x09" * 32
            ),
            "apply_diff": lambda: reader.apply_diff(
                QueueDiff(), BlockIdShort(LEFT, 9), b"\x09" * 32
            ),
            "commit_diff": lambda: reader.commit_diff([TopBlock(BlockId(MC, 5), 5)]),
            "clear_uncommitted_state": reader.clear_uncommitted_state,
            "startup": lambda: reader.startup(BlockId(MC, 1), [LEFT]),
            "run_gc": reader.run_gc,
            "compact": reader.compact,
            "import_state": lambda: reader.import_state(io.BytesIO(b""), BlockId(LEFT, 9)),
        }
        for name, call in calls.items():
            # its own type since an outside review (a plain ImqError before): still one
            with pytest.raises(ReadOnlyError, match=f"{name}: .*read-only"):
                call()
        assert reader.is_diff_exists(BlockIdShort(LEFT, 2))  # nothing was cleared


def test_read_only_open_of_a_missing_database(tmp_path: Path) -> None:
    with pytest.raises(ImqError, match="no queue database"):
        Queue.open(tmp_path / "nothing-here", read_only=True)
    assert not (tmp_path / "nothing-here").exists()


def test_summary(tmp_path: Path) -> None:
    with Queue.open(tmp_path / "db", QueueConfig.testing()) as queue:
        _fill(queue)
        summary = queue.summary()
    assert summary["last_committed_mc_block"] == str(BlockId(MC, 1))
    assert summary["commit_pointers"][str(LEFT)]["seqno"] == 1
    left = summary["shards"][str(LEFT)]
    assert left == {
        "diffs": 2,
        "committed": 1,
        "uncommitted": 1,
        "seqnos": [1, 2],
        "messages": {0: 3},
    }
    assert summary["gc"][f"0/{LEFT}"] == {
        "requested": QueueKey.max_for_lt(10).to_json(),
        "executed": None,
    }
    json.dumps(summary)  # JSON-friendly


def test_cli_inspect_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "db"
    with Queue.open(db, QueueConfig.testing()) as queue:
        _fill(queue)
        assert main(["inspect", str(db)]) == 0  # while the writer holds the database
    text = capsys.readouterr().out
    assert "read-only view" in text
    assert f"{LEFT}" in text and "2 diffs (seqno 1..2; 1 committed, 1 uncommitted)" in text
    assert main(["inspect", str(db), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["shards"][str(LEFT)]["diffs"] == 2


def test_cli_inspect_missing_database(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    assert "no queue database" in capsys.readouterr().err


def test_demo_runs_as_make_run_does(tmp_path: Path) -> None:
    """`make run` is `python -m imq demo`; run it as a real subprocess."""
    db = tmp_path / "demo-db"
    result = subprocess.run(
        [sys.executable, "-m", "imq", "demo", "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for step in ("1. ", "2. ", "3. ", "4. ", "5. ", "done."):
        assert step in out
    assert "run_gc:" in out
    with Queue.open(db, read_only=True) as queue:
        summary = queue.summary()
    assert summary["last_committed_mc_block"] is not None
    assert all(entry["uncommitted"] == 0 for entry in summary["shards"].values())
