"""Queue settings: the :class:`QueueConfig` value type and its strict TOML loader.

Settings live in the ``[internal_queue]`` table of a TOML file (see ``config/imq.toml``).
Durations are strings such as ``"5s"`` or ``"1m30s"`` (a bare number means seconds);
sizes are byte counts or strings such as ``"256MiB"``. Unknown keys are rejected.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from decimal import Decimal
from fractions import Fraction
from typing import Self

from imq.errors import ConfigError, ConfigTypeError

__all__ = [
    "QueueConfig",
    "parse_duration",
    "parse_size",
]

TABLE = "internal_queue"

_MIB = 1024**2
# The longest interval a setting in seconds takes: a thread waits at most
# ``threading.TIMEOUT_MAX`` (about 292 years) at once.
MAX_SECONDS = 1e9

# Seconds per duration unit: those of the original's config (Rust's humantime), short and
# long forms, and "µs". As there, a compound duration is the sum of its parts in any order
# ("1h30m", "30m 1h" and "45m45m" are all 90 minutes). A month
# and a year are humantime's 30.44 and 365.25 days. Exact fractions: a duration is summed
# exactly and rounded once, so "700ms" is the float 0.7 (not 700 * 1e-3 = 0.7000000000000001).
_DURATION_UNITS: dict[str, Fraction] = {
    **dict.fromkeys(("years", "year", "y"), Fraction(31_557_600)),
    **dict.fromkeys(("months", "month", "M"), Fraction(2_630_016)),
    **dict.fromkeys(("weeks", "week", "w"), Fraction(604_800)),
    **dict.fromkeys(("days", "day", "d"), Fraction(86_400)),
    **dict.fromkeys(("hours", "hour", "hrs", "hr", "h"), Fraction(3_600)),
    **dict.fromkeys(("minutes", "minute", "mins", "min", "m"), Fraction(60)),
    **dict.fromkeys(("seconds", "second", "secs", "sec", "s"), Fraction(1)),
    **dict.fromkeys(("millis", "msec", "ms"), Fraction(1, 1_000)),
    **dict.fromkeys(("usec", "us", "µs"), Fraction(1, 1_000_000)),
    **dict.fromkeys(("nanos", "nsec", "ns"), Fraction(1, 1_000_000_000)),
}
_BARE_NUMBER = re.compile(r"\d+(?:\.\d+)?")
# Longest unit first, so that "5ms" is not 5 m and an "s"; a unit ends where letters do.
_DURATION_PART = re.compile(
    r"\s*(\d+(?:\.\d+)?)\s*("
    + "|".join(sorted(map(re.escape, _DURATION_UNITS), key=len, reverse=True))
    + r")(?![A-Za-zµ])"
)

_SIZE_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)")


def parse_duration(text: str) -> float:
    """Parse a human duration (``"500ms"``, ``"1m30s"``, ``"2h"``, ``"250us"``) into seconds.

    Units: ``ns``, ``us`` (or ``µs``), ``ms``, ``s``, ``m``, ``h``, ``d``, ``w``, ``M``
    (month), ``y``, and the long forms of the original's humantime (``nanos``/``nsec``,
    ``usec``, ``millis``/``msec``, ``sec(s)``/``second(s)``, ``min(s)``/``minute(s)``,
    ``hr(s)``/``hour(s)``, ``day(s)``, ``week(s)``, ``month(s)``, ``year(s)``). A unit is
    required; a compound duration is the sum of its parts, in any order, as humantime
    reads it (humantime also reads spaces inside a number, ``"1 000s"``; imq does not).
    Beyond humantime, a part may have a fraction (``"1.5s"``). Raises ``ValueError`` on an
    empty, negative or malformed duration.
    """
    if not isinstance(text, str):
        raise TypeError(f"duration must be a string, got {type(text).__name__}")
    stripped = text.strip()
    if not stripped:
        raise ValueError("empty duration")
    if stripped.startswith("-"):
        raise ValueError(f"negative duration {text!r}: a duration is positive, e.g. '500ms', '5s'")
    if _BARE_NUMBER.fullmatch(stripped):
        raise ValueError(f"duration {text!r} needs a unit, e.g. '5s' or '500ms'")
    total = Fraction(0)
    pos = 0
    while pos < len(stripped):
        match = _DURATION_PART.match(stripped, pos)
        if match is None:
            raise ValueError(
                f"malformed duration {text!r}: expected <number><unit> parts with units "
                "ns, us, ms, s, m, h, d, w (or their long forms: sec, min, hours, ...; "
                "e.g. '500ms', '1m30s', '5sec')"
            )
        number, unit = match.groups()
        try:
            total += Fraction(number) * _DURATION_UNITS[unit]
        except ValueError:  # over 4,300 digits: Python's int() refuses to read it
            raise ValueError(f"duration {_clipped(text)!r} is too large") from None
        pos = match.end()
    try:
        return float(total)
    except OverflowError:
        raise ValueError(f"duration {_clipped(text)!r} is too large") from None


def _clipped(text: str) -> str:
    """``text`` as an error message quotes it: its first 40 characters."""
    return text if len(text) <= 40 else text[:40] + "..."


def parse_size(text: str) -> int:
    """Parse a human byte size (``"256MiB"``, ``"64 MiB"``, ``"10MB"``, ``"1000000B"``).

    Units (case-insensitive, optional space before): ``B``; decimal ``KB``, ``MB``, ``GB``,
    ``TB``; binary ``KiB``, ``MiB``, ``GiB``, ``TiB``. A bare number means bytes. A fraction
    is allowed when the result is a whole number of bytes (``"1.5KiB"``). Raises ``ValueError``
    on an empty, negative or malformed size, or an unknown unit.
    """
    if not isinstance(text, str):
        raise TypeError(f"size must be a string, got {type(text).__name__}")
    stripped = text.strip()
    if not stripped:
        raise ValueError("empty size")
    if stripped.startswith("-"):
        raise ValueError(f"negative size {text!r}")
    match = _SIZE.fullmatch(stripped)
    if match is None:
        raise ValueError(f"malformed size {text!r}: expected <number><unit>, e.g. '256MiB'")
    number, unit = match.groups()
    multiplier = _SIZE_UNITS.get(unit.lower() or "b")
    if multiplier is None:
        raise ValueError(
            f"unknown size unit {unit!r} in {text!r}: use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
        )
    value = Decimal(number) * multiplier
    if value != value.to_integral_value():
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


# --- per-field checks, shared by __post_init__ and from_mapping -----------------------


def _shown(value: int | float) -> str:
    """A number as an error message says it: an int of more than 30 digits by its size
    (Python refuses to print one of more than 4,300)."""
    if isinstance(value, int) and value.bit_length() > 100:
        sign = "a negative" if value < 0 else "an"
        return f"{sign} int of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return repr(value)


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigTypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    # Not math.isfinite on an int: one past a float's range raised OverflowError (an audit).
    if (isinstance(value, float) and not math.isfinite(value)) or value <= 0:
        raise ConfigError(
            f"{name} must be finite and > 0 seconds, got {_shown(value)}; to turn background GC "
            "off, set gc_enabled to false"
        )
    if value > MAX_SECONDS:  # a thread's wait takes at most threading.TIMEOUT_MAX
        raise ConfigError(
            f"{name} must be at most {MAX_SECONDS:.0e} seconds (about 30 years), got "
            f"{_shown(value)}; to turn background GC off, set gc_enabled to false"
        )


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigTypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_int_between(minimum: int, maximum: int) -> Callable[[str, object], None]:
    """An int in ``[minimum, maximum]``: the maximum is what RocksDB can take (a size_t
    or an int), so a value it would refuse fails here, not at open."""

    def check(name: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigTypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < minimum:
            raise ConfigError(f"{name} must be >= {minimum}, got {_shown(value)}")
        if value > maximum:
            raise ConfigError(f"{name} must be <= {maximum}, got {_shown(value)}")

    return check


# --- TOML value converters -------------------------------------------------------------


def _duration_from_toml(value: object) -> object:
    if isinstance(value, str):
        return parse_duration(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value  # checked as it is (an int past a float's range too), then made a float
    raise TypeError(
        f"expected a duration string like '5s' or a number of seconds, got {type(value).__name__}"
    )


def _size_from_toml(value: object) -> object:
    if isinstance(value, str):
        return parse_size(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(
        f"expected a byte count or a size string like '256MiB', got {type(value).__name__}"
    )


def _as_is(value: object) -> object:
    return value


_Rule = tuple[Callable[[object], object], Callable[[str, object], None]]

_RULES: dict[str, _Rule] = {
    "gc_interval": (_duration_from_toml, _check_seconds),
    "gc_enabled": (_as_is, _check_bool),
    "sync_commits": (_as_is, _check_bool),
    "block_cache_size": (_size_from_toml, _check_int_between(1, 1 << 62)),
    "write_buffer_size": (_size_from_toml, _check_int_between(1, 1 << 40)),
    "max_background_jobs": (_as_is, _check_int_between(1, 1024)),
    "compact_after_delete": (_as_is, _check_bool),
    "compaction_debt": (_as_is, _check_int_between(0, 1 << 62)),
    "gc_batch_diffs": (_as_is, _check_int_between(1, 1 << 62)),
    "check_statistics": (_as_is, _check_bool),
    "check_sources": (_as_is, _check_bool),
    "message_cache_size": (_size_from_toml, _check_int_between(0, 1 << 40)),
    "message_scans_fill_cache": (_as_is, _check_bool),
}


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """Settings of one open queue.

    - ``gc_interval``: seconds between GC ticks (the first positional field, as in API.md:
      ``QueueConfig(1.0)``).
    - ``gc_enabled``: run the background GC worker (``Queue.run_gc`` works either way).
    - ``sync_commits``: write commits with fsync (diffs are never fsynced).
    - ``block_cache_size``: RocksDB block cache, bytes.
    - ``write_buffer_size``: memtable size of each bulk column family, bytes.
    - ``max_background_jobs``: RocksDB flush and compaction threads.
    - ``compact_after_delete``: after a GC pass (and a clear of 256 diffs or more), also
      compact exactly the deleted key ranges, so space comes back at once rather than
      when RocksDB's background compaction reaches them. Off by default: it rewrites
      whole SST files (one GC pass: 0.9 s at 10^6 stored messages, 0.6 ms without).
    - ``compaction_debt``: a GC pass also compacts every range deleted since the last
      such compaction once they hold at least this many messages (0: never), so the
      space of a large collection comes back even on a node that writes nothing more
      (on a node that keeps writing, RocksDB's background compaction reclaims it).
    - ``gc_batch_diffs``: a GC pass deletes a shard's backlog in batches of at most this
      many diffs, each under the shard's mutex, which that shard's ``apply_diff`` waits
      for (and under the queue's read lock, which every ``commit_diff`` and
      ``clear_uncommitted_state`` waits for). A backlog of 62,500 diffs a shard made an
      apply wait at most 50-55 ms with 10,000, 23-33 ms with 1,000, 162-417 ms in one
      batch (``benchmarks/results/gc_pause.md``). Smaller batches leave more range
      tombstones in the memtables until they flush (a deletion flushes them every 256
      batches): an iterator's creation took 0.50-0.86 ms after that pass with 1,000,
      0.13-0.23 ms with 10,000 (measured in stop 43, not by a benchmark).
    - ``check_statistics``: debug mode: ``apply_diff``/``prepare_diff`` recount the
      messages and refuse ``statistics`` that differ in any count, or whose bounds leave
      out a message (about 6% of an apply, so off by default: statistics are then used
      as given).
    - ``check_sources``: ``apply_diff``/``prepare_diff`` refuse a message whose source
      address lies outside the block's shard (``ValueError``), which no real block holds.
      Off by default, as in the original, whose queue stores a message under the block's
      shard whatever its source (its own tests send from ``0:00..`` in masterchain
      diffs). Such a message cannot be exported: a state's import refuses it.
    - ``message_cache_size``: bytes of freshly written message rows kept in memory, so
      that reads of recent diffs (what collators read) skip RocksDB (0: none; see
      ``imq.storage.cache``). Rows leave it when GC or a clear deletes them, or, past
      the budget, oldest first. A segment (partition and source shard) read below what
      the cache holds a second time loads its older stored rows if they fit in 1/64 of
      this budget (a restarted collator's reads).
    - ``message_scans_fill_cache``: whether scans of stored messages (an iterator's, an
      export's, verify's) put the blocks they read into the block cache. On by default.
      Off, a scan reads each block from the OS's page cache instead: it no longer evicts
      the point tables' blocks nor pays the cache's insert and eviction a block, and a
      process's first long scan does not fault in the cache's memory (a page fault per
      4 KiB). But every scan's seek then reads its first blocks from the files too,
      which is what a collator's many short reads pay. Measured on the benchmark VM, ns
      a message through the iterator, 10^6 stored messages (306 MB, 256 MiB cache): the
      first read in a process 523-632 on, 394-404 off; later reads 412-476 on, 390-402
      off; a re-read of a range that fits in the cache 350 on, 385 off. Iterator
      creation and first message at 10^6 and 10^7 stored messages: 61 and 76 us on
      (``benchmarks/results/scaling.md``), 115-136 off in a run with it off (at 10^3:
      about 45 either way). Off suits a host whose reads are mostly long
      catch-up scans.

    Constructing with a wrong type raises ``TypeError``, with a bad value ``ValueError``.
    """

    gc_interval: float = 5.0
    gc_enabled: bool = True
    sync_commits: bool = True
    block_cache_size: int = 256 * _MIB
    write_buffer_size: int = 64 * _MIB
    max_background_jobs: int = 2
    compact_after_delete: bool = False
    compaction_debt: int = 1_000_000
    gc_batch_diffs: int = 10_000
    check_statistics: bool = False
    check_sources: bool = False
    message_cache_size: int = 64 * _MIB
    message_scans_fill_cache: bool = True

    def __post_init__(self) -> None:
        for name, (_, check) in _RULES.items():
            check(name, getattr(self, name))
        if not isinstance(self.gc_interval, float):
            object.__setattr__(self, "gc_interval", float(self.gc_interval))

    @classmethod
    def testing(cls) -> Self:
        """A tiny, fast profile for tests: no background GC (tests that want it turn it on,
        and ``run_gc`` works anyway), 50 ms ticks when on, no fsync, small caches."""
        return cls(
            gc_enabled=False,
            gc_interval=0.05,
            sync_commits=False,
            block_cache_size=8 * _MIB,
            write_buffer_size=4 * _MIB,
        )

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, object], source: str = "<mapping>") -> Self:
        """Build from the contents of an ``[internal_queue]`` table.

        Missing keys take their defaults. An unknown key, a wrong type or a bad value raises
        ``ConfigError`` naming ``source`` and the key.
        """
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"{source}: [{TABLE}] must be a table, got {type(mapping).__name__}")
        values: dict[str, object] = {}
        for key, raw in mapping.items():
            rule = _RULES.get(key)
            if rule is None:
                known = ", ".join(_RULES)
                raise ConfigError(f"{source}: unknown key {TABLE}.{key!s} (known keys: {known})")
            convert, check = rule
            try:
                value = convert(raw)
                check(key, value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{source}: invalid {TABLE}.{key}: {exc}") from exc
            values[key] = value
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> Self:
        """Read the ``[internal_queue]`` table of the TOML file at ``path``.

        A missing table or key takes the default. An unreadable or malformed file, an unknown
        key, a wrong type, a bad duration or size, a misspelt table name, a nested one
        (``[node.internal_queue]``) or imq's settings above any table (whether or not the
        file also holds ``[internal_queue]``) raise ``ConfigError`` naming the file.
        """
        if not isinstance(path, str | bytes | os.PathLike):
            raise TypeError(
                "from_toml takes the path of a TOML file (a str or os.PathLike), got "
                f"{type(path).__name__}"
            )
        source = os.fspath(path)
        try:
            with open(source, "rb") as fh:
                document = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(
                f"{source}: cannot read config file: {exc.strerror or exc}; give the path of a "
                "readable TOML file (config/imq.toml in the repository lists every key)"
            ) from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{source}: not UTF-8 text, so not TOML: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(
                f"{source}: malformed TOML: {exc}; fix the file's syntax there (see "
                "config/imq.toml for every key with its default)"
            ) from exc
        except ValueError as exc:  # tomllib's own int(): a number of over 4,300 digits
            raise ConfigError(
                f"{source}: a number TOML cannot read ({exc.args[0].split(':')[0]}); no "
                "setting takes a number that long (see config/imq.toml for every key "
                "with its limits)"
            ) from exc
        _check_no_misplaced_keys(document, source)
        table = document.get(TABLE, {})
        return cls.from_mapping(table, source=source)


def _check_no_misplaced_keys(document: Mapping[str, object], source: str) -> None:
    """Settings imq would not read: a misspelt table name or settings written above any
    table would be left out without a word (every default, or the ``[internal_queue]``
    table's alone): refuse them, since a typo must not look like a file read as
    written (an outside audit: ``gc_interval`` above the table, or an
    ``[internal_queues]`` table beside it, dropped)."""
    names = {f.name for f in fields(QueueConfig)}
    loose = sorted(key for key in document if key in names)
    if loose:
        raise ConfigError(
            f"{source}: {', '.join(loose)} outside any table: imq reads its settings from "
            f"the [{TABLE}] table; put them under a [{TABLE}] line"
        )
    for key, value in document.items():
        if key == TABLE:
            continue
        spelt = _spelt(key)
        holds_settings = isinstance(value, dict) and any(k in names for k in value)
        if _near_table_name(spelt) or (spelt == "imq" and holds_settings):
            raise ConfigError(
                f"{source}: table [{key}] is not [{TABLE}], which imq reads: rename it [{TABLE}]"
            )
    nested = _nested_table(document)
    if nested:
        raise ConfigError(
            f"{source}: table [{nested}] is not [{TABLE}]: imq reads the top-level "
            f"[{TABLE}] table only; move its settings there"
        )


def _spelt(key: str) -> str:
    return key.lower().replace("-", "_").replace(" ", "_")


def _near_table_name(spelt: str) -> bool:
    """``[internal_queue]`` spelt another way or mistyped (``internalqueue``,
    ``internal_queues``, ``intenal_queue``): at most two characters' edits away."""
    return _edits(spelt, TABLE, limit=2) <= 2


def _edits(a: str, b: str, *, limit: int) -> int:
    """Levenshtein distance of ``a`` and ``b``, or ``limit + 1`` once it is over limit."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
        if min(row) > limit:
            return limit + 1
    return row[-1]


def _nested_table(table: Mapping[str, object], path: str = "") -> str | None:
    """The dotted name of a table named like ``internal_queue`` below the top level
    (``[node.internal_queue]``), or None."""
    for key, value in table.items():
        if not isinstance(value, dict):
            continue
        name = f"{path}.{key}" if path else key
        if path and _near_table_name(_spelt(key)):
            return name
        found = _nested_table(value, name)
        if found:
            return found
    return None


# Every dataclass field has exactly one rule, in field order; a field added without one
# fails at import.
if [f.name for f in fields(QueueConfig)] != list(_RULES):  # pragma: no cover
    raise RuntimeError("QueueConfig fields and _RULES are out of sync")
