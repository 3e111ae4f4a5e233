"""Rules of ``QueueConfig`` and of imq's observability that hand-made mutants got past
(a mutation audit of ``imq/config.py`` and ``imq/observability/``).

Config (``config/imq.toml``): every bound is inclusive as written (``gc_interval`` at
most 1e9 s, each int setting's minimum and RocksDB's maximum are valid values), a
boolean is not a number of seconds (in TOML nor in the constructor), and a duration
too large for a float is a ``ConfigError``, not an ``OverflowError``.

Observability: a progress line goes to stderr, never stdout (the library never
writes to stdout); it is throttled, but the line of ``done == total`` is always
printed, once; on a terminal it is redrawn in place; with nothing to do it reads 100%.
A latency sample that is NaN is refused; percentiles are nearest rank. The CLI's
handler writes to the current ``sys.stderr``; an event's ``exc_info`` reaches its
record; ``capture_events`` skips records that are not imq events.
"""

from __future__ import annotations

import io
import logging
import math
import sys
from pathlib import Path

import pytest

from imq.config import MAX_SECONDS, QueueConfig, parse_duration
from imq.errors import ConfigError, ConfigTypeError
from imq.observability import (
    LOGGER_NAME,
    Metrics,
    ProgressLine,
    capture_events,
    configure_for_cli,
    get_logger,
)

# -- config -----------------------------------------------------------------------------------


def test_gc_interval_may_be_exactly_its_maximum() -> None:
    """config/imq.toml: gc_interval is "> 0, at most 1e9 s"."""
    assert QueueConfig(gc_interval=MAX_SECONDS).gc_interval == 1e9
    assert QueueConfig.from_mapping({"gc_interval": 1_000_000_000}).gc_interval == 1e9
    with pytest.raises(ConfigError, match="at most"):
        QueueConfig(gc_interval=MAX_SECONDS * 1.000001)


@pytest.mark.parametrize(
    ("name", "lowest"),
    [
        ("block_cache_size", 1),
        ("write_buffer_size", 1),
        ("max_background_jobs", 1),
        ("compaction_debt", 0),
        ("gc_batch_diffs", 1),
        ("message_cache_size", 0),
    ],
)
def test_each_int_setting_takes_its_documented_minimum(name: str, lowest: int) -> None:
    """config/imq.toml: "> 0" sizes take 1, ">= 1" ints take 1, ">= 0" ones take 0; one
    below is refused."""
    assert getattr(QueueConfig.from_mapping({name: lowest}), name) == lowest
    with pytest.raises(ConfigError, match=f">= {lowest}"):
        QueueConfig.from_mapping({name: lowest - 1})


@pytest.mark.parametrize(
    ("name", "highest"),
    [
        ("block_cache_size", 1 << 62),
        ("write_buffer_size", 1 << 40),
        ("max_background_jobs", 1024),
        ("compaction_debt", 1 << 62),
        ("gc_batch_diffs", 1 << 62),
        ("message_cache_size", 1 << 40),
    ],
)
def test_each_int_setting_takes_its_maximum_and_refuses_one_more(name: str, highest: int) -> None:
    assert getattr(QueueConfig.from_mapping({name: highest}), name) == highest
    with pytest.raises(ConfigError, match=f"<= {highest}"):
        QueueConfig.from_mapping({name: highest + 1})


def test_a_boolean_is_not_a_number_of_seconds() -> None:
    """``gc_interval = true`` in TOML (or ``QueueConfig(gc_interval=True)``) is a wrong
    type, not one second."""
    with pytest.raises(ConfigError, match="gc_interval"):
        QueueConfig.from_mapping({"gc_interval": True})
    with pytest.raises(ConfigTypeError):
        QueueConfig(gc_interval=True)


def test_a_duration_too_large_for_a_float_is_a_config_error() -> None:
    huge = "9" * 400 + "y"
    with pytest.raises(ValueError, match="too large"):
        parse_duration(huge)
    with pytest.raises(ConfigError, match="too large"):
        QueueConfig.from_mapping({"gc_interval": huge})


@pytest.mark.parametrize("name", ["intrnal_queues", "internal_qeueu", "internalqueue_"])
def test_a_table_name_two_edits_away_is_refused(tmp_path: Path, name: str) -> None:
    """A misspelt ``[internal_queue]`` (up to two characters' edits) is refused, not read
    as a table of someone else's settings with imq's all left at their defaults."""
    path = tmp_path / "imq.toml"
    path.write_text(f"[{name}]\ngc_interval = '1s'\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"table \[{name}\] is not \[internal_queue\]"):
        QueueConfig.from_toml(path)


@pytest.mark.parametrize("name", ["internal_queue", "internal_queues", "Internal-Queue"])
def test_a_nested_table_named_like_imqs_is_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / "imq.toml"
    path.write_text(f"[node.{name}]\ngc_interval = '1s'\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"\[node\.{name}\] is not \[internal_queue\]"):
        QueueConfig.from_toml(path)


# -- progress lines ---------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_progress_line_goes_to_stderr_never_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    line = ProgressLine("import", unit="messages")
    line(5, 10)
    line(10, 10)
    line.close()
    out, err = capsys.readouterr()
    assert out == ""
    assert "import: 10/10 messages (100.0%)" in err


def test_the_last_line_is_printed_once_even_when_throttled() -> None:
    stream = io.StringIO()
    line = ProgressLine("export", stream=stream)
    line(1, 4)  # the first line is printed at once
    line(2, 4)  # throttled (10 s between lines off a terminal)
    line(4, 4)  # the last one is not
    line(4, 4)
    line.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("export: 1/4 ") and lines[1].startswith("export: 4/4 ")


def test_on_a_terminal_the_line_is_redrawn_in_place_and_ended_by_close() -> None:
    stream = _Terminal()
    line = ProgressLine("import", stream=stream)
    line(1, 2)
    line(2, 2)
    assert stream.getvalue().startswith("\rimport: 1/2 ") and "\n" not in stream.getvalue()
    line.close()
    assert stream.getvalue().endswith("\n")


def test_off_a_terminal_close_adds_nothing() -> None:
    stream = io.StringIO()
    line = ProgressLine("import", stream=stream)
    line(3, 3)
    before = stream.getvalue()
    line.close()
    assert stream.getvalue() == before


def test_nothing_to_do_reads_as_done() -> None:
    stream = io.StringIO()
    ProgressLine("export", stream=stream)(0, 0)
    assert "0/0 messages (100.0%)" in stream.getvalue()


# -- metrics -----------------------------------------------------------------------------------


def test_a_nan_latency_is_refused() -> None:
    metrics = Metrics()
    with pytest.raises(ValueError, match=">= 0"):
        metrics.observe("apply_diff", math.nan)
    assert metrics.percentiles("apply_diff")["count"] == 0


def test_percentiles_are_nearest_rank() -> None:
    """The smallest sample with at least p% of the samples at or below it."""
    metrics = Metrics()
    for seconds in (0.001, 0.002, 0.003):
        metrics.observe("commit_diff", seconds)
    summary = metrics.percentiles("commit_diff")
    assert (summary["p50"], summary["p99"]) == (0.002, 0.003)


# -- logging ------------------------------------------------------------------------------------


def test_the_cli_handler_writes_to_the_stderr_of_each_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``configure_for_cli``'s handler writes to whatever ``sys.stderr`` is when a record
    comes (a host that swaps stderr later still gets imq's lines there)."""
    configure_for_cli("info", json=True)
    try:
        later = io.StringIO()
        monkeypatch.setattr(sys, "stderr", later)
        get_logger("audit").warning("swapped_stream", n=1)
        assert "swapped_stream" in later.getvalue()
    finally:
        _remove_cli_handler()


def _remove_cli_handler() -> None:
    logger = logging.getLogger(LOGGER_NAME)
    for handler in [h for h in logger.handlers if h.get_name() == "imq-cli"]:
        logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True


def test_an_events_exc_info_reaches_the_record() -> None:
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger(LOGGER_NAME)
    handler = _Keep()
    logger.addHandler(handler)
    try:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            get_logger("audit").error("failed_step", exc_info=True)
    finally:
        logger.removeHandler(handler)
    (record,) = records
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError


def test_capture_events_skips_records_that_are_not_imq_events() -> None:
    with capture_events() as events:
        logging.getLogger(LOGGER_NAME).warning("a plain %s record", "stdlib")
        get_logger("audit").info("an_event")
    assert [e["event"] for e in events] == ["an_event"]
