"""``imq replay LOG``: replay an op log on a fresh database and on the model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from imq.cli.common import Heartbeat, PathError, input_file, path_arg
from imq.testing.replay import OpLogError, ReplayDivergenceError, replay

__all__ = ["OpLogError", "register", "run"]

EXAMPLES = """\
A log comes from `imq simulate --record` (or imq.testing.record); docs/replay-format.md
describes it. Exit status 1 when the log is malformed or the replay diverges.

examples (from the repository root; the second after `imq simulate ... --record`):
  imq replay tests/replays/sim-2shards-seed7.jsonl
  imq replay var/sim/ops.jsonl
"""


def register(commands: Any) -> None:
    """Add ``replay`` to the ``imq`` sub-command parser."""
    cmd = commands.add_parser(
        "replay",
        help="replay a recorded op log on a fresh database and on the model, comparing each step",
        description="Replay every call of an op log on a fresh database and on the model of "
        "the queue, comparing each result with the log's and the database with the model.",
        epilog=EXAMPLES,
    )
    cmd.add_argument("log", type=path_arg, help="op log (JSON lines, docs/replay-format.md)")
    cmd.add_argument(
        "--db", type=path_arg, help="fresh database directory (default: a temporary one)"
    )
    cmd.add_argument(
        "--check-every",
        type=_at_least_one,
        default=1,
        metavar="N",
        help="compare the whole state of the queue and the model after every N-th "
        "state-changing step, before each close and at the end (default 1: after every "
        "one; a long log replays several times faster with 10 or more, and a difference "
        "found is replayed again to name its step)",
    )
    cmd.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    cmd.set_defaults(
        run=run,
        interrupted="the replay stopped part way (a temporary database is removed; a --db "
        "one holds the steps replayed so far)",
    )


def _at_least_one(text: str) -> int:
    """``--check-every``: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {text!r}")
    return value


def _fresh_dir(db: Path) -> None:
    """``--db``: a directory to create, or an empty one."""
    if db.exists() and not db.is_dir():
        raise PathError(f"--db {db} is a file; give a new or empty directory")
    if db.is_dir() and any(db.iterdir()):
        raise PathError(
            f"--db {db} is not empty: a replay needs a fresh database; give a new or empty "
            "directory (or leave --db out for a temporary one)"
        )


def _checking(done: int, size: int) -> str:
    """The check's progress: bytes of the log read (of its size, for a file)."""
    mb = 1 << 20
    if size:
        return f"checking the log: {done / mb:,.0f} of {size / mb:,.0f} MiB"
    return f"checking the log: {done / mb:,.0f} MiB"


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    input_file(args.log, "op log")
    if args.db is not None:
        _fresh_dir(args.db)
    try:
        with Heartbeat("replay", enabled=not args.no_progress) as beat:
            # The log is checked whole, then each step is read again as it replays (a
            # pipe, which cannot be read twice, is held in memory).
            report = replay(
                args.log,
                args.db,
                checking=lambda done, size: beat.update(_checking(done, size)),
                checked=lambda steps: beat.update(f"{steps:,} steps checked"),
                progress=lambda done, total: beat.update(f"step {done:,} of {total:,}"),
                check_every=args.check_every,
            )
    except ReplayDivergenceError as exc:
        print(f"replay: DIVERGED at step {exc.step} ({exc.op})", file=out)
        print(f"  first difference: {exc.difference}", file=out)
        if exc.checked_to is not None:  # the second replay did not find it again
            print(f"  the state agreed last after step {exc.checked_to}", file=out)
        return 1
    except OpLogError:  # it names the file, the line and the step
        raise
    except (
        KeyError,
        IndexError,
        TypeError,
        ValueError,
        RuntimeError,
        AttributeError,
        ArithmeticError,
    ) as exc:
        raise OpLogError(
            f"op log {args.log} could not be replayed ({type(exc).__name__}: {exc}); "
            "check it against docs/replay-format.md"
        ) from exc
    every = "" if report.check_every == 1 else f", every {report.check_every:,} state changes"
    print(
        f"replay: {report.steps:,} steps agree with the log and the model "
        f"({report.checks:,} state comparisons{every})",
        file=out,
    )
    return 0
