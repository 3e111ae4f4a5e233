"""``imq replay LOG``: replay an op log on a fresh database and on the model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from imq.testing.replay import ReplayDivergenceError, replay

__all__ = ["register", "run"]


def register(commands: Any) -> None:
    """Add ``replay`` to the ``imq`` sub-command parser."""
    cmd = commands.add_parser(
        "replay",
        help="replay a recorded op log on a fresh database and on the model, comparing each step",
    )
    cmd.add_argument("log", type=Path, help="op log (JSON lines, docs/replay-format.md)")
    cmd.add_argument("--db", type=Path, help="fresh database directory (default: a temporary one)")
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    try:
        report = replay(args.log, args.db)
    except ReplayDivergenceError as exc:
        print(f"replay: DIVERGED at step {exc.step} ({exc.op})", file=out)
        print(f"  first difference: {exc.difference}", file=out)
        return 1
    print(
        f"replay: {report.steps:,} steps agree with the log and the model "
        f"({report.checks:,} state comparisons)",
        file=out,
    )
    return 0
