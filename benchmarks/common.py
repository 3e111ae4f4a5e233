"""What the benchmarks share: the raw rocksdict floor, opened as imq opens its store."""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from time import perf_counter, sleep
from typing import Any

from rocksdict import ReadOptions

from imq import QueueConfig, ShardIdent
from imq.queue import store_options
from imq.storage import Table, open_rdict

__all__ = [
    "RawDb",
    "account_in",
    "count_label",
    "parse_args",
    "quiet_logs",
    "temp_workdir",
    "write_report",
]

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(
    argv: Sequence[str] | None,
    name: str,
    description: str,
    repeats_help: str,
    out_note: str = "",
    *,
    steps: Sequence[str] = (),
    extra: Callable[[argparse.ArgumentParser], object] | None = None,
) -> argparse.Namespace:
    """The flags every benchmark takes: --quick, --repeats, --out, --dir, and --only when
    the benchmark names its ``steps``; ``extra`` adds the benchmark's own (listed by
    --help with the rest). ``--out`` defaults to ``results/<name>.md``
    (``<name>-quick.md`` with --quick)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks.bench_{name}", description=description
    )
    parser.add_argument("--quick", action="store_true", help="small smoke sizes (seconds)")
    parser.add_argument("--repeats", type=int, default=None, help=repeats_help)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"results file (default benchmarks/results/{name}.md; {name}-quick.md with --quick)"
        + out_note,
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the temporary databases go (system temp)"
    )
    if steps:
        parser.add_argument(
            "--only",
            action="append",
            choices=steps,
            help="run only this step (repeatable; default: every step)",
        )
    if extra is not None:
        extra(parser)
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.out is None:
        args.out = RESULTS / (f"{name}-quick.md" if args.quick else f"{name}.md")
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    return args


def file_sizes(path: Path, pattern: str = "*") -> dict[Path, int]:
    """Bytes of each file under ``path`` matching ``pattern``. RocksDB deletes obsolete
    files from its background threads while a benchmark samples a live database, so a
    file listed but gone by the time it is measured is left out instead of raising."""
    sizes = {}
    for f in path.rglob(pattern):
        try:
            st = f.stat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            sizes[f] = st.st_size
    return sizes


def write_report(out: Path, text: str) -> None:
    print()
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n", encoding="utf-8")
    print(f"\nwritten to {out}")


def quiet_logs() -> None:
    """Drop imq's events below WARNING, as a production service would for per-diff info
    events. imq logs to the standard logger ``imq`` and never reads structlog's global
    configuration, so that logger's level is what decides."""
    logging.getLogger("imq").setLevel(logging.WARNING)


@contextlib.contextmanager
def temp_workdir(args: argparse.Namespace, name: str) -> Iterator[Path]:
    """A fresh temporary directory under ``--dir`` (system temp by default) for one
    benchmark's databases, removed afterwards whatever happened."""
    path = Path(tempfile.mkdtemp(prefix=f"imq-{name}-", dir=args.dir))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# RocksDB integer properties that are non-zero while a flush or compaction runs or waits.
ROCKSDB_BUSY = (
    "rocksdb.num-running-compactions",
    "rocksdb.num-running-flushes",
    "rocksdb.compaction-pending",
)


def wait_for_background(
    busy: Callable[[str], int],
    names: Sequence[str] = ROCKSDB_BUSY,
    limit: float = 300.0,
    poll: float = 0.05,
) -> tuple[float, bool]:
    """Poll ``busy(name)`` (a RocksDB integer property, summed over the tables the caller
    watches) every ``poll`` seconds until every one of ``names`` is 0 or ``limit`` seconds
    have passed: ``(seconds waited, whether RocksDB went idle)``."""
    started = perf_counter()
    while True:
        waited = perf_counter() - started
        if not any(busy(name) for name in names):
            return waited, True
        if waited >= limit:
            return waited, False
        sleep(poll)


def settle(busy: Callable[[str], int], limit: float = 300.0) -> float:
    """Wait until no table has a flush or compaction running or pending, nor a memtable
    waiting to be flushed (``busy(name)``: a RocksDB integer property summed over the
    tables); the seconds waited. ``RuntimeError`` if RocksDB is still busy after
    ``limit`` seconds."""
    waited, idle = wait_for_background(
        busy, (*ROCKSDB_BUSY, "rocksdb.num-immutable-mem-table"), limit, poll=0.01
    )
    if not idle:
        raise RuntimeError(f"RocksDB still busy {limit:.0f} s after the writes")
    return waited


def account_in(rng: random.Random, shard: ShardIdent) -> bytes:
    """A random 32-byte account whose leading bits put it inside ``shard``."""
    shift = 64 - shard.prefix_len
    head = int.from_bytes(rng.randbytes(8), "big") & ((1 << shift) - 1)
    head |= (shard.prefix >> shift) << shift
    return head.to_bytes(8, "big") + rng.randbytes(24)


def count_label(n: int) -> str:
    """1000 -> "1k", 1000000 -> "1M"."""
    return f"{n // 1_000_000}M" if n >= 1_000_000 and n % 1_000_000 == 0 else f"{n / 1000:g}k"


class RawDb:
    """Bare rocksdict with imq's column families and options (``open_rdict``), so the
    floor runs on the same engine configuration as imq."""

    def __init__(self, path: Path, config: QueueConfig) -> None:
        self.config = config
        self.db: Any = open_rdict(path, store_options(config))
        self.cf: dict[Table, Any] = {t: self.db.get_column_family(t.value) for t in Table}
        self.handle: dict[Table, Any] = {
            t: self.db.get_column_family_handle(t.value) for t in Table
        }

    def scan_options(self) -> ReadOptions:
        """``ReadOptions`` for a raw scan of the message table set as imq's scans of it
        are under the same config (they fill the block cache unless
        ``message_scans_fill_cache`` is off), so that the floor's read does the same work
        as imq's."""
        ro = ReadOptions()
        if not self.config.message_scans_fill_cache:
            ro.fill_cache(False)
        return ro

    def close(self) -> None:
        # A live column-family object keeps RocksDB open: drop them before closing.
        self.cf.clear()
        self.handle.clear()
        self.db.close()
