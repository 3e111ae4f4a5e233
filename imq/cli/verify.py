"""``imq verify DB``: a full checksum scan plus imq's cross-checks (read-only)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TextIO

from imq.verify import verify

__all__ = ["register", "run"]


def register(commands: Any) -> None:
    """Add the ``verify`` subcommand to the CLI's subparsers."""
    check = commands.add_parser(
        "verify",
        help="check a queue database: every block's checksum and imq's cross-checks "
        "(read-only; exits 1 when something is wrong)",
    )
    check.add_argument("db", type=Path, help="database directory")
    check.set_defaults(run=run)


def run(args: argparse.Namespace, out: TextIO) -> int:
    report = verify(args.db)
    rows = ", ".join(f"{t} {n}" for t, n in sorted(report.rows.items()))
    print(f"queue database {report.path}: rows read: {rows or '-'}", file=out)
    for problem in report.problems:
        print(f"problem: {problem}", file=out)
    if report.ok:
        print("ok: checksums and cross-checks pass", file=out)
        return 0
    print(f"{len(report.problems)} problem(s) found", file=out)
    return 1
