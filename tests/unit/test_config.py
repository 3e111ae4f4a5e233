"""QueueConfig: validation, the TOML loader, and the duration and size parsers."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from imq import _native as native
from imq._native import pure_python_requested
from imq.config import QueueConfig, parse_duration, parse_size
from imq.errors import ConfigError, ConfigTypeError

SHIPPED_CONFIG = Path(__file__).parents[2] / "config" / "imq.toml"
MIB = 1024**2


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "imq.toml"
    path.write_text(text, encoding="utf-8")
    return path


def load_table(tmp_path: Path, body: str) -> QueueConfig:
    return QueueConfig.from_toml(write_toml(tmp_path, "[internal_queue]\n" + body))


# --- parse_duration -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("5s", 5.0),
        ("500ms", 0.5),
        ("1m", 60.0),
        ("1m30s", 90.0),
        ("2h", 7200.0),
        ("250us", 250e-6),
        ("250µs", 250e-6),
        ("10ns", 10e-9),
        ("1d", 86400.0),
        ("1.5s", 1.5),
        ("0s", 0.0),
        ("1h 30m", 5400.0),
        ("1d2h3m4s5ms", 86400 + 7200 + 180 + 4 + 0.005),
        ("  5s  ", 5.0),
        # the long forms of the original's humantime
        ("5sec", 5.0),
        ("5 seconds", 5.0),
        ("1min", 60.0),
        ("2 minutes 3 secs", 123.0),
        ("1hr 30min", 5400.0),
        ("2days", 172800.0),
        ("1w", 604800.0),
        ("1M", 2_630_016.0),  # humantime's month: 30.44 days; "m" is a minute
        ("1y", 31_557_600.0),
        ("500msec", 0.5),
        ("250usec", 250e-6),
        ("10nsec", 10e-9),
        ("5000millis", 5.0),
        ("17nanos", 17e-9),
        ("20 min 17 nsec ", 1200 + 17e-9),
        # humantime sums the parts in any order, a unit repeated too
        ("30m 1h", 5400.0),
        ("30s1m", 90.0),
        ("1s 2s", 3.0),
        ("1min1m", 120.0),
        ("1us1µs", 2e-6),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("700ms", 0.7), ("9ms", 0.009), ("100us", 0.0001), ("1.1s", 1.1), ("1s100ms", 1.1)],
)
def test_parse_duration_rounds_once_to_the_nearest_float(text: str, seconds: float) -> None:
    """Summed exactly, then rounded: "700ms" is the float 0.7, as a user writing
    ``gc_interval == 0.7`` expects (700 * 1e-3 is 0.7000000000000001)."""
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("-5s", "negative"),
        ("5", "needs a unit"),
        ("1.5", "needs a unit"),
        ("5S", "malformed"),
        ("5secx", "malformed"),
        ("5mss", "malformed"),
        ("five seconds", "malformed"),
        ("s", "malformed"),
        ("1e3s", "malformed"),
        ("+5s", "malformed"),
        ("9" * 400 + "s", "too large"),
    ],
)
def test_parse_duration_rejects(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_duration(text)


def test_parse_duration_rejects_non_strings() -> None:
    with pytest.raises(TypeError):
        parse_duration(5)  # type: ignore[arg-type]


# --- parse_size -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("256MiB", 256 * MIB),
        ("1GiB", 1024**3),
        ("64 MiB", 64 * MIB),
        ("512KiB", 512 * 1024),
        ("1TiB", 1024**4),
        ("1000000B", 1_000_000),
        ("10MB", 10_000_000),
        ("1KB", 1000),
        ("2GB", 2_000_000_000),
        ("1TB", 10**12),
        ("256mib", 256 * MIB),
        ("256MIB", 256 * MIB),
        ("10 mb", 10_000_000),
        ("12", 12),
        ("1.5KiB", 1536),
        ("0B", 0),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("-1MiB", "negative"),
        ("MiB", "malformed"),
        ("1 2MiB", "malformed"),
        ("1e3B", "malformed"),
        ("1K", "unknown size unit"),
        ("1M", "unknown size unit"),
        ("12 parsecs", "unknown size unit"),
        ("0.3B", "whole number"),
    ],
)
def test_parse_size_rejects(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_size(text)


# --- QueueConfig, Python API ----------------------------------------------------------


def test_defaults() -> None:
    config = QueueConfig()
    assert config.gc_interval == 5.0
    assert config.sync_commits is True
    assert config.block_cache_size == 256 * MIB
    assert config.write_buffer_size == 64 * MIB
    assert config.max_background_jobs == 2
    assert config.compact_after_delete is False


def test_testing_profile() -> None:
    config = QueueConfig.testing()
    assert config.gc_interval == 0.05
    assert config.sync_commits is False
    assert config.block_cache_size == 8 * MIB
    assert config.write_buffer_size == 4 * MIB


def test_frozen_and_slotted() -> None:
    config = QueueConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.gc_interval = 1.0  # type: ignore[misc]
    assert not hasattr(config, "__dict__")


def test_gc_interval_is_the_first_positional_field() -> None:
    """API.md: ``QueueConfig(gc_interval: float = 5.0, ...)``."""
    assert [f.name for f in dataclasses.fields(QueueConfig)][:2] == ["gc_interval", "gc_enabled"]
    config = QueueConfig(1.0)
    assert config.gc_interval == 1.0
    assert config.gc_enabled is True
    assert QueueConfig(0.5, False) == QueueConfig(gc_interval=0.5, gc_enabled=False)


def test_int_gc_interval_is_stored_as_float() -> None:
    config = QueueConfig(gc_interval=2)
    assert isinstance(config.gc_interval, float)
    assert config.gc_interval == 2.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gc_interval", 0),
        ("gc_interval", -1.0),
        ("gc_interval", math.inf),
        ("gc_interval", math.nan),
        ("block_cache_size", 0),
        ("block_cache_size", -1),
        ("write_buffer_size", 0),
        ("max_background_jobs", 0),
    ],
)
def test_bad_values_raise_value_error(field: str, value: object) -> None:
    # A ValueError (the API's rule for constructors) and a ConfigError (its errors table
    # for an invalid configuration value): an outside audit found a bare ValueError.
    with pytest.raises(ValueError, match=field) as caught:
        QueueConfig(**{field: value})  # type: ignore[arg-type]
    assert isinstance(caught.value, ConfigError)
    assert not isinstance(caught.value, TypeError)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gc_interval", "5s"),
        ("gc_interval", True),
        ("sync_commits", 1),
        ("sync_commits", "true"),
        ("compact_after_delete", None),
        ("block_cache_size", 1.0),
        ("block_cache_size", "1MiB"),
        ("write_buffer_size", True),
        ("max_background_jobs", 2.0),
    ],
)
def test_wrong_types_raise_type_error(field: str, value: object) -> None:
    with pytest.raises(TypeError, match=field) as caught:
        QueueConfig(**{field: value})  # type: ignore[arg-type]
    assert isinstance(caught.value, ConfigError)
    assert isinstance(caught.value, ConfigTypeError)


# --- from_toml / from_mapping ---------------------------------------------------------


def test_shipped_config_equals_defaults() -> None:
    assert QueueConfig.from_toml(SHIPPED_CONFIG) == QueueConfig()


def test_shipped_config_lists_every_setting() -> None:
    text = SHIPPED_CONFIG.read_text(encoding="utf-8")
    for field in dataclasses.fields(QueueConfig):
        assert f"\n{field.name} = " in text


def test_missing_table_gives_defaults(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[other]\ngc_interval = "1s"\n')
    assert QueueConfig.from_toml(path) == QueueConfig()


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert QueueConfig.from_toml(write_toml(tmp_path, "")) == QueueConfig()


def test_missing_keys_take_defaults(tmp_path: Path) -> None:
    config = load_table(tmp_path, 'gc_interval = "500ms"\nblock_cache_size = "1GiB"\n')
    assert config == dataclasses.replace(QueueConfig(), gc_interval=0.5, block_cache_size=1024**3)


def test_every_key(tmp_path: Path) -> None:
    config = load_table(
        tmp_path,
        'gc_interval = "1m30s"\n'
        "sync_commits = false\n"
        'block_cache_size = "10MB"\n'
        "write_buffer_size = 4194304\n"
        "max_background_jobs = 8\n"
        "compact_after_delete = true\n"
        "message_scans_fill_cache = true\n",
    )
    assert config == QueueConfig(
        gc_interval=90.0,
        sync_commits=False,
        block_cache_size=10_000_000,
        write_buffer_size=4 * MIB,
        max_background_jobs=8,
        compact_after_delete=True,
        message_scans_fill_cache=True,
    )


@pytest.mark.parametrize(("raw", "seconds"), [("2", 2.0), ("0.25", 0.25)])
def test_bare_number_duration_means_seconds(tmp_path: Path, raw: str, seconds: float) -> None:
    assert load_table(tmp_path, f"gc_interval = {raw}\n").gc_interval == seconds


def test_accepts_path_and_str(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[internal_queue]\nmax_background_jobs = 3\n")
    assert QueueConfig.from_toml(path) == QueueConfig.from_toml(str(path))


def test_unknown_key(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[internal_queue]\ngc_intreval = "5s"\n')
    with pytest.raises(ConfigError, match=r"unknown key internal_queue\.gc_intreval") as info:
        QueueConfig.from_toml(path)
    assert str(path) in str(info.value)
    assert "gc_interval" in str(info.value)  # lists the known keys


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_bytes(b"[internal_queue]\ngc_interval = '\xff\xfe'\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        QueueConfig.from_toml(path)


def test_malformed_toml(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "[internal_queue\ngc_interval = 5s\n")
    with pytest.raises(ConfigError, match="malformed TOML") as info:
        QueueConfig.from_toml(path)
    assert str(path) in str(info.value)
    assert "fix the file's syntax" in str(info.value)  # what to do next


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match="cannot read") as info:
        QueueConfig.from_toml(path)
    assert str(path) in str(info.value)
    assert "give the path of a readable TOML file" in str(info.value)  # what to do next
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('gc_interval = "-5s"', "a duration is positive"),
        ("gc_interval = 0", "set gc_enabled to false"),
    ],
)
def test_a_bad_duration_says_what_to_write(tmp_path: Path, text: str, says: str) -> None:
    path = write_toml(tmp_path, f"[internal_queue]\n{text}\n")
    with pytest.raises(ConfigError, match=says):
        QueueConfig.from_toml(path)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        QueueConfig.from_toml(tmp_path)


def test_table_of_wrong_type(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "internal_queue = 5\n")
    with pytest.raises(ConfigError, match=r"\[internal_queue\] must be a table"):
        QueueConfig.from_toml(path)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        # durations
        ('gc_interval = "-5s"', "negative"),
        ('gc_interval = "5"', "needs a unit"),
        ('gc_interval = "soon"', "malformed"),
        ('gc_interval = "0s"', "> 0"),
        ("gc_interval = 0", "> 0"),
        ("gc_interval = -1", "> 0"),
        ("gc_interval = nan", "> 0"),
        ("gc_interval = inf", "> 0"),
        ("gc_interval = true", "duration string"),
        ("gc_interval = [5]", "duration string"),
        # sizes
        ('block_cache_size = "-1MiB"', "negative"),
        ('block_cache_size = "12 parsecs"', "unknown size unit"),
        ('block_cache_size = "0B"', ">= 1"),
        ("block_cache_size = 0", ">= 1"),
        ("write_buffer_size = -5", ">= 1"),
        ("write_buffer_size = 1.5", "byte count"),
        ("write_buffer_size = true", "byte count"),
        # bools and ints
        ('sync_commits = "yes"', "must be a bool"),
        ("sync_commits = 1", "must be a bool"),
        ("compact_after_delete = 0", "must be a bool"),
        ("max_background_jobs = 0", ">= 1"),
        ('max_background_jobs = "2"', "must be an int"),
        ("max_background_jobs = 2.0", "must be an int"),
        ("max_background_jobs = true", "must be an int"),
    ],
)
def test_invalid_values(tmp_path: Path, line: str, reason: str) -> None:
    key = line.split(" = ", maxsplit=1)[0]
    path = write_toml(tmp_path, f"[internal_queue]\n{line}\n")
    with pytest.raises(ConfigError, match=reason) as info:
        QueueConfig.from_toml(path)
    message = str(info.value)
    assert str(path) in message
    assert f"internal_queue.{key}" in message
    assert isinstance(info.value.__cause__, TypeError | ValueError)


def test_from_mapping_names_its_source() -> None:
    with pytest.raises(ConfigError, match=r"^<mapping>: unknown key internal_queue.bogus"):
        QueueConfig.from_mapping({"bogus": 1})
    with pytest.raises(ConfigError, match=r"^env: invalid internal_queue.gc_interval"):
        QueueConfig.from_mapping({"gc_interval": "x"}, source="env")


def test_from_mapping_empty_is_default() -> None:
    assert QueueConfig.from_mapping({}) == QueueConfig()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[internal-queue]\ngc_interval = '1s'\n", "table [internal-queue] is not"),
        ("[Internal_Queue]\ngc_interval = '1s'\n", "table [Internal_Queue] is not"),
        ("[imq]\ngc_interval = '1s'\n", "table [imq] is not"),
        # a docs audit: a plural or a typo gave every default
        ("[internal_queues]\ngc_interval = '1s'\n", "table [internal_queues] is not"),
        ("[intenal_queue]\ngc_interval = '1s'\n", "table [intenal_queue] is not"),
        ("[node.internal_queue]\ngc_interval = '1s'\n", "table [node.internal_queue] is"),
        ("[a.b.internal-queue]\ngc_interval = '1s'\n", "table [a.b.internal-queue] is"),
        ("gc_interval = '1s'\n[node]\nname = 'a'\n", "gc_interval outside any table"),
        # an acceptance audit: beside the real table, these were dropped without a word
        ("gc_interval = '7s'\n[internal_queue]\nsync_commits = true\n", "gc_interval outside"),
        (
            "[internal_queue]\nsync_commits = true\n[internal_queues]\ngc_interval = '7s'\n",
            "table [internal_queues] is not",
        ),
        ("[internal_queue]\n[Internal-Queue]\ngc_interval = '7s'\n", "table [Internal-Queue]"),
        ("[internal_queue]\n[node.internal_queue]\ngc_interval = '7s'\n", "[node.internal_q"),
    ],
)
def test_settings_imq_would_not_read_are_refused(tmp_path: Path, text: str, says: str) -> None:
    """A user audit: a misspelt table or settings above any table gave every default
    without a word, the same as a file without imq's table."""
    path = write_toml(tmp_path, text)
    with pytest.raises(ConfigError, match=r"\[internal_queue\]") as info:
        QueueConfig.from_toml(path)
    assert says in str(info.value)
    assert str(path) in str(info.value)


def test_other_tables_of_a_node_config_are_left_alone(tmp_path: Path) -> None:
    """A node's config file holds other components' tables, some with keys imq also
    uses: without [internal_queue], every default, as documented."""
    path = write_toml(
        tmp_path, "[storage]\ngc_interval = 3\n[imq]\nother = 1\n[queue]\nsize = 2\n[node.queue]\n"
    )
    assert QueueConfig.from_toml(path) == QueueConfig()


@pytest.mark.parametrize(
    ("value", "pure"),
    [
        (None, False),
        ("", False),
        ("0", False),
        ("false", False),
        (" No ", False),
        ("off", False),
        ("1", True),
        ("yes", True),
        ("TRUE", True),
        ("on", True),
    ],
)
def test_imq_pure_python_reads_as_a_switch(
    value: str | None, pure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A docs audit: ``IMQ_PURE_PYTHON=0`` also turned the compiled paths off."""
    if value is None:
        monkeypatch.delenv("IMQ_PURE_PYTHON", raising=False)
    else:
        monkeypatch.setenv("IMQ_PURE_PYTHON", value)
    assert pure_python_requested() is pure


def test_speedups_status_says_which_paths_run_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """``imq --version``'s second line. A C build that failed is silent at install (the
    extension is optional), so this line is where an operator learns that the queue runs
    its pure-Python paths, and why."""
    monkeypatch.delenv("IMQ_PURE_PYTHON", raising=False)
    monkeypatch.setattr(native, "speedups", object())
    assert native.speedups_status() == "compiled speedups: on"
    monkeypatch.setattr(native, "speedups", None)
    missing = native.speedups_status()
    assert missing.startswith("compiled speedups: not built")
    assert "reinstall with a C compiler" in missing
    monkeypatch.setenv("IMQ_PURE_PYTHON", "1")
    assert native.speedups_status() == "compiled speedups: off (IMQ_PURE_PYTHON is set)"


@pytest.mark.parametrize("digits", [400, 5_000])
@pytest.mark.parametrize("name", ["gc_interval", "message_cache_size"])
def test_numbers_too_long_for_a_float_or_a_string_are_config_errors(
    tmp_path: Path, name: str, digits: int
) -> None:
    """An outside audit: an int past a float's range raised ``OverflowError`` from the
    seconds' check, and one of over 4,300 digits a plain ``ValueError`` from the error
    message's own formatting (or from TOML's reader). Each is a ``ConfigError`` now,
    the number said by its size."""
    huge = 10**digits
    for value in (huge, -huge):
        with pytest.raises(ConfigError, match=rf"{name} must be .* int of about \d+ digits"):
            QueueConfig(**{name: value})
    path = write_toml(tmp_path, f"[internal_queue]\n{name} = 1{'0' * digits}\n")
    with pytest.raises(ConfigError) as info:
        QueueConfig.from_toml(path)
    assert str(path) in str(info.value)
    assert "set_int_max_str_digits" not in str(info.value)
    if name == "gc_interval":  # a duration string of as many digits
        with pytest.raises(ConfigError, match=r"duration '10+\.\.\.' is too large"):
            QueueConfig.from_mapping({name: f"1{'0' * digits}s"})
