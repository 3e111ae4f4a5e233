"""imq's events go to the standard logger ``imq``, whatever structlog's global
configuration; ``capture_events`` collects them; ``configure_for_cli`` sends them to
stderr."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from imq.observability import LOGGER_NAME, capture_events, configure_for_cli, get_logger


def test_get_logger_binds_component_and_fields() -> None:
    log = get_logger("gc", db="queue-db")
    with capture_events() as events:
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
    with capture_events() as events:
        gc_log.debug("gc_tick_started")
        queue_log.warning("diff_skipped", seqno=7)
    assert [(e["component"], e["event"], e["log_level"]) for e in events] == [
        ("gc", "gc_tick_started", "debug"),
        ("queue", "diff_skipped", "warning"),
    ]


def test_capture_events_honours_its_level_and_restores_the_logger() -> None:
    logger = logging.getLogger(LOGGER_NAME)
    before = (logger.level, list(logger.handlers))
    log = get_logger("queue")
    with capture_events(logging.INFO) as events:
        log.debug("hidden")
        log.info("shown")
    assert [e["event"] for e in events] == ["shown"]
    assert (logger.level, list(logger.handlers)) == before


def test_nothing_is_configured_by_creating_or_using_a_logger() -> None:
    structlog.reset_defaults()
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    get_logger("queue").info("queue_opened")
    get_logger("queue").warning("something")
    assert not structlog.is_configured()
    assert (list(root.handlers), root.level) == before


def test_structlog_global_configuration_is_not_used() -> None:
    """``structlog.configure`` or ``capture_logs`` elsewhere in the process neither
    receives imq's events nor stops them reaching the ``imq`` logger."""
    log = get_logger("queue")
    with capture_logs() as structlog_events, capture_events() as events:
        log.info("diff_applied", seqno=1)
    assert structlog_events == []
    assert [e["event"] for e in events] == ["diff_applied"]


def test_below_the_level_nothing_is_processed() -> None:
    class Loud:
        def __repr__(self) -> str:  # pragma: no cover - must not run
            raise AssertionError("a filtered event was rendered")

    log = get_logger("queue")
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.WARNING)
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    logger.addHandler(Keep())
    log.debug("hidden", value=Loud())
    log.info("hidden", value=Loud())
    assert seen == []


def test_record_text_attributes_and_colliding_field_names() -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    get_logger("queue", db="a b").info(
        "diff_applied", seqno=3, name="clash", module="also", shards={"0": [1]}
    )
    (record,) = records
    assert record.name == LOGGER_NAME  # not overwritten by the field
    assert record.module != "also"
    assert record.seqno == 3  # type: ignore[attr-defined]
    assert record.component == "queue"  # type: ignore[attr-defined]
    event: dict[str, Any] = dict(record.msg)  # type: ignore[call-overload]
    assert event["name"] == "clash" and event["module"] == "also"
    assert record.getMessage() == (
        "diff_applied component=queue db='a b' seqno=3 name=clash module=also shards={'0': [1]}"
    )


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
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "hidden_event" not in captured.err
    assert "commit_skipped" in captured.err
    assert "mc_seqno=5" in captured.err


def test_configure_for_cli_twice_keeps_one_handler_and_touches_only_imq(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    configure_for_cli(level="info")
    configure_for_cli(level="info", json=True)
    get_logger("cli").info("once")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["event"] == "once"
    assert (list(root.handlers), root.level) == before
    assert logging.getLogger(LOGGER_NAME).propagate is False


def test_configure_for_cli_rejects_an_unknown_level() -> None:
    with pytest.raises(ValueError, match="unknown log level"):
        configure_for_cli(level="loud")


def test_the_hosts_structlog_context_variables_reach_imqs_events() -> None:
    """docs/behaviour.md 5.10: what the host bound with ``bind_contextvars`` is in
    imq's events, and unbinding it takes it out again."""
    log = get_logger("queue")
    with structlog.contextvars.bound_contextvars(request_id="r-7"), capture_events() as events:
        log.info("diff_applied", seqno=3)
    with capture_events() as after:
        log.info("diff_applied", seqno=4)
    assert events[0]["request_id"] == "r-7"
    assert "request_id" not in after[0]
