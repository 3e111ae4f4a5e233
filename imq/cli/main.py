"""Entry point of the ``imq`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from imq.cli import demo, inspect, state, verify
from imq.errors import ImqError
from imq.observability import configure_for_cli
from imq.types import ShardIdent

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
    _state_commands(commands)
    verify.register(commands)
    return parser


def _state_commands(commands: Any) -> None:
    load = commands.add_parser(
        "import",
        help="import a persistent queue state file (raw or zstd .queue) into a database",
        description="Cold start: import a state all or nothing. Masterchain file names start "
        "with '-': put them after '--'.",
    )
    load.add_argument("db", type=Path, help="database directory (created if missing)")
    load.add_argument("file", type=Path, help="state file (.queue = zstd, or raw)")
    load.add_argument(
        "--block-id",
        help="wc:shard:seqno:roothash:filehash (default: taken from the file's name)",
    )
    checks = load.add_mutually_exclusive_group()
    checks.add_argument(
        "--top-update", help="HASH:TAIL the state must match (top diff hash, tail length)"
    )
    checks.add_argument(
        "--block", type=Path, help="a block file whose out_msg_queue_updates the state must match"
    )
    load.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    save = commands.add_parser(
        "export", help="write the persistent queue state of a block (zstd when OUT ends in .queue)"
    )
    save.add_argument("db", type=Path, help="database directory")
    save.add_argument("--shard", required=True, help="block shard, e.g. 0:8000000000000000")
    save.add_argument("--seqno", required=True, type=int, help="block seqno")
    save.add_argument("--tail-len", required=True, type=int, help="number of diffs to include")
    save.add_argument("out", type=Path, help="output file")
    dump = commands.add_parser(
        "dump-diff", help="print a queue diff (or a state's diffs) with the computed hash"
    )
    dump.add_argument("file", type=Path, help="queue diff (.bin) or queue state file")
    dump.add_argument("--json", action="store_true", help="print JSON")


def _run_state_command(args: argparse.Namespace) -> None:
    if args.command == "import":
        top = None if args.top_update is None else state.parse_top_update(args.top_update)
        state.run_import(
            args.db,
            args.file,
            block_id=state.resolve_block_id(args.block_id, args.file),
            top_update=top,
            block_file=args.block,
            progress=not args.no_progress,
            out=sys.stdout,
        )
    elif args.command == "export":
        shard = ShardIdent.parse(args.shard)
        state.run_export(args.db, shard, args.seqno, args.tail_len, args.out, out=sys.stdout)
    else:
        state.dump_diff(args.file, as_json=args.json, out=sys.stdout)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        configure_for_cli(args.log_level, json=args.log_json)
    except ValueError as exc:
        print(f"imq: {exc}", file=sys.stderr)
        return 2
    try:
        if getattr(args, "run", None) is not None:  # commands that register themselves
            return int(args.run(args, sys.stdout))
        if args.command == "demo":
            demo.run(args.db, out=sys.stdout)
        elif args.command == "inspect":
            inspect.run(args.db, as_json=args.json, out=sys.stdout)
        else:
            _run_state_command(args)
    except ImqError as exc:
        print(f"imq: error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"imq: {exc}", file=sys.stderr)
        return 2
    return 0
