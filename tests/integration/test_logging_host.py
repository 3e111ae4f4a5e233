"""The library is silent unless its host asks (issue 8): nothing on stdout, ever; with no
logging configured nothing below WARNING on stderr; a host that configures ``logging``
(or structlog through it) receives every event, with its fields, on the logger ``imq``.

The silent runs are subprocesses, so no test fixture, pytest plugin or earlier test has
configured anything."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import structlog
from builders import MC, Chain, open_queue

from imq import ShardIdent

S = ShardIdent.BASECHAIN

# Every kind of call: open, apply (empty and not, with and without prepare), commit,
# iterate, the read calls, clear, GC (the worker's tick at open, and run_gc), import, export, a
# read-only open and close. Nothing may reach stdout; at the end one warning is logged
# through imq's own logger, to show that WARNING and above do reach stderr.
_WORKLOAD = """
import sys
from pathlib import Path

from imq import (
    Address, BlockId, BlockIdShort, Message, Queue, QueueConfig, QueueDiff, QueueKey,
    QueueShardRange, ShardIdent, TopBlock,
)
from imq.observability import get_logger
from imq.state.synth import synth_state, write_synth_state

SETUP
root = Path(sys.argv[1])
S, MC = ShardIdent.BASECHAIN, ShardIdent.MASTERCHAIN
src, dst = Address(0, b"\\x11" * 32), Address(0, b"\\x22" * 32)
config = QueueConfig(3600.0, sync_commits=False)  # the worker runs its tick at open only


def msgs(lt0, n):
    return [Message(QueueKey(lt0 + i, bytes([i + 1]) * 32), src, dst, b"body") for i in range(n)]


with Queue.open(root / "db", config) as q:
    first = msgs(1_000, 5)
    read = {S: first[-1].key}
    assert q.apply_diff(QueueDiff(first, read), BlockIdShort(S, 1), b"\\x01" * 32)
    assert not q.apply_diff(QueueDiff(first, read), BlockIdShort(S, 1), b"\\x01" * 32)
    mc = QueueDiff((), read, start_lt=2_000, end_lt=2_100)
    assert q.apply_diff(mc, BlockIdShort(MC, 1), b"\\x02" * 32)
    assert q.commit_diff([TopBlock(BlockId(MC, 1), 1), TopBlock(BlockId(S, 1), 1)])
    assert not q.commit_diff([TopBlock(BlockId(MC, 1), 1)])
    whole = QueueShardRange(S, QueueKey.MIN, QueueKey.MAX)
    with q.iterator(0, [whole], S) as it:
        assert len(list(it)) == 5
    assert q.load_diff_statistics(0, whole) == {dst: 5}
    assert q.get_diffs_tail_len(S, QueueKey.MIN) == 1
    q.summary()
    pending = q.prepare_diff(QueueDiff(msgs(3_000, 2)), BlockIdShort(S, 2), b"\\x03" * 32)
    assert pending is not None
    pending.write()
    assert q.apply_diff(QueueDiff(), BlockIdShort(S, 3), b"\\x04" * 32)
    q.clear_uncommitted_state()
    assert q.get_last_applied_seqno(S) == 1
    assert q.run_gc() >= 0
with Queue.open(root / "db", config, read_only=True) as q:
    q.summary()

state = synth_state(diffs=3, messages_per_diff=[4, 0, 6])
write_synth_state(state, root / "in.queue")
with Queue.open(root / "db2", config) as q:
    report = q.import_state(root / "in.queue", state.block_id, state.top_update)
    assert report.messages == 10
    exported = q.export_state(state.shard, state.seqno, len(state.diffs), root / "out.queue")
    assert exported.messages == 10
    q.run_gc()

get_logger("probe").warning("probe_warning", n=1)
"""


def _run(tmp_path: Path, setup: str = "") -> subprocess.CompletedProcess[str]:
    script = _WORKLOAD.replace("SETUP", setup)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IMQ_", "PYTHON"))}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )


def test_with_no_logging_configured_nothing_reaches_stdout_and_only_warnings_stderr(
    tmp_path: Path,
) -> None:
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    # The whole workload logs nothing at WARNING or above; the probe shows that a
    # warning would be printed (Python's last-resort handler), as one readable line.
    assert done.stderr == "probe_warning component=probe n=1\n"


def test_a_host_basic_config_gets_every_event_with_its_fields(tmp_path: Path) -> None:
    setup = (
        "import logging\n"
        "logging.basicConfig(level=logging.DEBUG, format='%(levelname)s %(name)s %(message)s')\n"
    )
    done = _run(tmp_path, setup)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    imq_lines = [line for line in lines if line.split(" ", 2)[1:2] == ["imq"]]
    events = {line.split(" ")[2] for line in imq_lines}
    assert {
        "queue_opened",
        "diff_applied",
        "diff_skipped",
        "diff_committed",
        "commit_skipped",
        "uncommitted_cleared",
        "state_imported",
        "state_exported",
        "gc_pass_finished",
        "queue_closed",
        "probe_warning",
    } <= events
    applied = next(line for line in imq_lines if " diff_applied " in line)
    assert applied.startswith("INFO imq diff_applied ")
    assert f"shard={S}" in applied and "seqno=1" in applied and "messages=5" in applied
    assert "component=queue" in applied


def test_a_handler_on_the_imq_logger_receives_records_with_their_fields(db_path: Path) -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    stream = io.StringIO()
    text = logging.StreamHandler(stream)
    text.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
    logger = logging.getLogger("imq")
    logger.addHandler(Keep())
    logger.addHandler(text)
    logger.setLevel(logging.INFO)  # the autouse fixture restores the logger afterwards

    with open_queue(db_path) as queue:
        chain = Chain(queue)
        a = chain.apply(S, 3)
        chain.apply(MC, 1)

    applied = [r for r in records if r.msg["event"] == "diff_applied"]  # type: ignore[index]
    assert len(applied) == 2
    first = applied[0]
    assert first.name == "imq"
    assert first.levelno == logging.INFO
    assert first.shard == str(S)  # type: ignore[attr-defined]
    assert first.seqno == a.seqno  # type: ignore[attr-defined]
    assert first.messages == 3  # type: ignore[attr-defined]
    assert first.component == "queue"  # type: ignore[attr-defined]
    assert first.db == str(db_path)  # type: ignore[attr-defined]
    event = dict(first.msg)  # type: ignore[call-overload]
    assert event["event"] == "diff_applied"
    assert event["level"] == "info"
    assert "timestamp" in event
    assert first.getMessage().startswith(f"diff_applied component=queue db={db_path} ")
    assert not any(r.levelno < logging.INFO for r in records)
    assert f"INFO:imq:diff_applied component=queue db={db_path} shard={S} seqno=1" in (
        stream.getvalue()
    )


def test_a_structlog_host_through_processor_formatter_gets_the_event_dicts(
    db_path: Path,
) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.JSONRenderer(),
            ]
        )
    )
    logger = logging.getLogger("imq")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    with open_queue(db_path) as queue:
        Chain(queue).apply(S, 2)
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    (applied,) = [e for e in events if e["event"] == "diff_applied"]
    assert applied["shard"] == str(S)
    assert applied["seqno"] == 1
    assert applied["messages"] == 2
    assert applied["component"] == "queue"
    assert applied["level"] == "info"
    assert "timestamp" in applied


def test_structlog_global_configuration_does_not_route_imq_events(
    db_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A host that configures structlog for itself (here: print everything to stdout)
    still gets nothing from imq on stdout."""
    structlog.configure(
        processors=[structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
    )
    with open_queue(db_path) as queue:
        Chain(queue).apply(S, 2)
    assert capsys.readouterr().out == ""
