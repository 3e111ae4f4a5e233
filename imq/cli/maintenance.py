"""``imq gc DB`` and ``imq compact DB``: one GC pass, and a full manual compaction.

Both open the database for writing (they take its lock: stop the node first) and refuse a
path that holds no queue database rather than create one. Work that failed is an error
(exit status 1), also when RocksDB reports it only as the queue closes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TextIO

from imq.cli.common import Commands, Heartbeat, checked_queue, database_dir, path_arg
from imq.errors import ImqError

__all__ = ["register", "run_compact", "run_gc"]

GC_EXAMPLES = """\
Bounds are requested by commits (the minimum processed_to over the committed diffs);
a pass deletes, per (partition, source shard), everything up to its bound.

examples (from the repository root, after `imq demo`):
  imq gc var/demo-db
"""

COMPACT_EXAMPLES = """\
examples (from the repository root, after `imq demo`):
  imq compact var/demo-db
"""


def register(commands: Commands) -> None:
    """Add ``gc`` and ``compact``."""
    gc = commands.add_parser(
        "gc",
        help="run one garbage-collection pass and print what it deleted",
        description="Run one GC pass now (Queue.run_gc_report) and print, per (partition, "
        "source shard), the bound and the messages and diffs deleted. It opens the database "
        "for writing: stop the node that holds it first.",
        epilog=GC_EXAMPLES,
    )
    gc.add_argument("db", type=path_arg, help="database directory")
    gc.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    gc.set_defaults(
        run=_gc_args,
        interrupted="what the pass deleted stays deleted, and its bounds stay due: "
        "`imq gc` again finishes the pass",
    )
    compact = commands.add_parser(
        "compact",
        help="compact every table of a database fully (reclaims deleted space)",
        description="A full manual compaction of every column family (Queue.compact), "
        "printing the database size before and after. It opens the database for writing: "
        "stop the node that holds it first.",
        epilog=COMPACT_EXAMPLES,
    )
    compact.add_argument("db", type=path_arg, help="database directory")
    compact.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    compact.set_defaults(
        run=_compact_args,
        interrupted="compaction changes no data: `imq compact` again reclaims the space",
    )


def _gc_args(args: argparse.Namespace, out: TextIO) -> None:
    run_gc(args.db, progress=not args.no_progress, out=out)


def _compact_args(args: argparse.Namespace, out: TextIO) -> None:
    run_compact(args.db, progress=not args.no_progress, out=out)


def run_gc(db: Path, *, progress: bool, out: TextIO) -> None:
    database_dir(db)
    with (
        checked_queue(db, "gc") as queue,
        Heartbeat("gc", enabled=progress) as beat,
    ):
        beat.update("collecting")
        report = queue.run_gc_report()
    print(
        f"gc {db}: {report.executed} (partition, shard) ranges deleted, "
        f"{report.messages:,} messages, {report.diffs:,} diffs in {report.seconds:.2f} s"
        + (f"; {report.failed} failed (retried next pass)" if report.failed else ""),
        file=out,
    )
    for r in report.ranges:
        print(
            f"  p{r.partition} {r.shard!s:22} up to {r.bound}: "
            f"{r.messages:,} messages, {r.diffs:,} diffs",
            file=out,
        )
    if report.failed:
        raise ImqError(
            f"gc {db}: {report.failed} (partition, shard) ranges failed (the gc_range_failed "
            f"events say why); they stay due: run `imq verify {db}`, fix what it reports, "
            "and run `imq gc` again"
        )


def run_compact(db: Path, *, progress: bool, out: TextIO) -> None:
    database_dir(db)
    with (
        checked_queue(db, "compaction") as queue,
        Heartbeat("compact", enabled=progress) as beat,
    ):
        report = queue.compact(beat.progress("tables"))
    print(
        f"compacted {db}: {report.tables} tables, {report.bytes_before:,} -> "
        f"{report.bytes_after:,} bytes in {report.seconds:.2f} s",
        file=out,
    )
