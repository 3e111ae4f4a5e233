"""``imq replay LOG``: replay an op log on a fresh database and on the model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from imq.cli.common import input_file
from imq.errors import ImqError
from imq.testing.replay import ReplayDivergenceError, replay

__all__ = ["OpLogError", "check_log", "register", "run"]

EXAMPLES = """\
A log comes from `imq simulate --record` (or imq.testing.record); docs/replay-format.md
describes it. Exit status 1 when the replay diverges.

examples (from the repository root; the second after `imq simulate ... --record`):
  imq replay tests/replays/sim-2shards-seed7.jsonl
  imq replay var/sim/ops.jsonl
"""


class OpLogError(ImqError):
    """The op log is not one: the message names the file and the line."""


def register(commands: Any) -> None:
    """Add ``replay`` to the ``imq`` sub-command parser."""
    cmd = commands.add_parser(
        "replay",
        help="replay a recorded op log on a fresh database and on the model, comparing each step",
        description="Replay every call of an op log on a fresh database and on the model of "
        "the queue, comparing each result with the log's and the database with the model.",
        epilog=EXAMPLES,
    )
    cmd.add_argument("log", type=Path, help="op log (JSON lines, docs/replay-format.md)")
    cmd.add_argument("--db", type=Path, help="fresh database directory (default: a temporary one)")
    cmd.set_defaults(
        run=run,
        interrupted="the replay stopped part way (a temporary database is removed; a --db "
        "one holds the steps replayed so far)",
    )


def check_log(path: Path) -> None:
    """Every line of the log is a JSON object, and every step has a ``step`` number; else
    :class:`OpLogError` naming the file and the line (the replay's reader would name
    neither). Blank lines after the header are allowed, as the reader allows them."""
    input_file(path, "op log")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number > 1 and not raw.strip():
                continue
            where = f"op log {path} line {number}"
            try:
                line = json.loads(raw.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError as exc:
                raise OpLogError(f"{where}: not UTF-8 text ({exc.reason})") from None
            except json.JSONDecodeError as exc:
                raise OpLogError(f"{where}: not JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(line, dict):
                raise OpLogError(f"{where}: a JSON {type(line).__name__}, not an object")
            if number > 1 and not isinstance(line.get("step"), int):
                raise OpLogError(f'{where}: a step without an integer "step"')
        if f.tell() == 0:
            raise OpLogError(f"op log {path} is empty")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    check_log(args.log)
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
