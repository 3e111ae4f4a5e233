"""get_logger binds fields without configuring structlog; configure_for_cli does."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import structlog
from structlog.testing import capture_logs

from imq.observability import configure_for_cli, get_logger


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


def test_get_logger_binds_component_and_fields() -> None:
    log = get_logger("gc", db="queue-db")
    with capture_logs() as events:
        log.info("gc_range_deleted", shard="0:8000000000000000", messages=3)
    assert events == [
        {
            "event": "gc_range_deleted",
            "log_level": "info",
            "component": "gc",
            "db": "queue-db",
            "shard": "0:8000000000000000",
            "messages": 3,
        }
    ]


def test_loggers_are_independent() -> None:
    gc_log = get_logger("gc")
    queue_log = get_logger("queue")
    with capture_logs() as events:
        gc_log.debug("gc_tick_started")
        queue_log.warning("diff_skipped", seqno=7)
    assert [(e["component"], e["event"], e["log_level"]) for e in events] == [
        ("gc", "gc_tick_started", "debug"),
        ("queue", "diff_skipped", "warning"),
    ]


def test_get_logger_does_not_configure_structlog() -> None:
    get_logger("queue").info("queue_opened")
    assert not structlog.is_configured()


def test_configure_for_cli_json_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    configure_for_cli(level="info", json=True)
    log = get_logger("cli")
    log.debug("hidden_event")
    log.info("diff_applied", seqno=12)
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["event"] == "diff_applied"
    assert record["seqno"] == 12
    assert record["component"] == "cli"
    assert record["level"] == "info"
    assert "timestamp" in record


def test_configure_for_cli_console(capsys: pytest.CaptureFixture[str]) -> None:
    configure_for_cli(level="WARNING")
    log = get_logger("cli")
    log.info("hidden_event")
    log.warning("commit_skipped", mc_seqno=5)
    err = capsys.readouterr().err
    assert "hidden_event" not in err
    assert "commit_skipped" in err
    assert "mc_seqno=5" in err


def test_configure_for_cli_rejects_unknown_level() -> None:
    with pytest.raises(ValueError, match="verbose"):
        configure_for_cli(level="verbose")
    assert not structlog.is_configured()
