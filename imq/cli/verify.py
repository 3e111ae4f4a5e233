"""``imq verify DB``: a full checksum scan plus imq's cross-checks (read-only)."""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from imq.cli.common import Heartbeat, database_dir, path_arg
from imq.verify import verify

__all__ = ["register", "run"]

EXAMPLES = """\
Exit status 1 when a problem is found: stop the node, then restore the directory from a
copy or rebuild it from a persistent state in a new directory (`imq import`). `note:`
lines say what could not be checked and why (diffs whose key spans overlap, which a
network never writes); they leave the exit status 0.

examples (from the repository root, after `imq demo` and the `imq import` examples):
  imq verify var/demo-db
  imq verify var/tycho-db
"""


def register(commands: Any) -> None:
    """Add the ``verify`` subcommand to the CLI's subparsers."""
    check = commands.add_parser(
        "verify",
        help="check a queue database: every block's checksum and imq's cross-checks "
        "(read-only; exits 1 when something is wrong)",
        description="Read every row of every table through checksum-verified reads and "
        "cross-check the tables: diff records, tail rows, statistics, the messages in each "
        "diff's span (up to what GC has deleted), commit pointers. A read-only open: safe "
        "beside a live node.",
        epilog=EXAMPLES,
    )
    check.add_argument("db", type=path_arg, help="database directory")
    check.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    check.set_defaults(run=run, interrupted="nothing was changed")


def run(args: argparse.Namespace, out: TextIO) -> int:
    database_dir(args.db)  # named as inspect, gc and compact name it
    with Heartbeat("verify", enabled=not args.no_progress) as beat:
        beat.update(f"reading and cross-checking {args.db}")
        report = verify(
            args.db,
            progress=lambda table, rows: beat.update(
                f"reading and cross-checking {args.db}: {rows:,} rows of {table}"
            ),
        )
    rows = ", ".join(f"{t} {n}" for t, n in sorted(report.rows.items()))
    print(f"queue database {report.path}: rows read: {rows or '-'}", file=out)
    for note in report.notes:
        print(f"note: {note}", file=out)
    for problem in report.problems:
        print(f"problem: {problem}", file=out)
    if report.ok:
        print("ok: checksums and cross-checks pass", file=out)
        return 0
    print(f"{len(report.problems)} problem(s) found", file=out)
    return 1
