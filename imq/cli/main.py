"""Entry point of the ``imq`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from imq.cli import demo, inspect
from imq.errors import ImqError
from imq.observability import configure_for_cli

__all__ = ["main"]

DEFAULT_DEMO_DB = Path("var") / "demo-db"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="imq", description="The internal message queue of a sharded blockchain collator."
    )
    parser.add_argument(
        "--log-level", default="warning", help="structlog level for events on stderr"
    )
    parser.add_argument("--log-json", action="store_true", help="log events as JSON lines")
    commands = parser.add_subparsers(dest="command", required=True)
    run_demo = commands.add_parser(
        "demo",
        help="run a short scripted scenario on an embedded database and show what it holds",
    )
    run_demo.add_argument(
        "--db",
        type=Path,
        default=DEFAULT_DEMO_DB,
        help=f"database directory, wiped first (default: {DEFAULT_DEMO_DB})",
    )
    show = commands.add_parser(
        "inspect", help="show what a queue database holds (read-only; safe beside a live node)"
    )
    show.add_argument("db", type=Path, help="database directory")
    show.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        configure_for_cli(args.log_level, json=args.log_json)
    except ValueError as exc:
        print(f"imq: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "demo":
            demo.run(args.db, out=sys.stdout)
        elif args.command == "inspect":
            inspect.run(args.db, as_json=args.json, out=sys.stdout)
    except ImqError as exc:
        print(f"imq: error: {exc}", file=sys.stderr)
        return 1
    return 0
