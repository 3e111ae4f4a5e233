"""``imq inspect DB``: what a queue database holds, read-only (safe beside a live node)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, TextIO

from imq.cli.common import Commands, Heartbeat, database_dir, path_arg
from imq.config import QueueConfig
from imq.queue import Queue

__all__ = ["register", "run"]

EXAMPLES = """\
JSON: keys as {"lt": int, "hash": hex} (QueueKey.from_json), shards and block ids in the
text that ShardIdent.parse and BlockId.parse read; the GC bounds keyed "<partition>/<shard>".

examples (from the repository root, after `imq demo`):
  imq inspect var/demo-db
  imq inspect var/demo-db --json
"""


def register(commands: Commands) -> None:
    show = commands.add_parser(
        "inspect",
        help="show what a queue database holds (read-only; safe beside a live node)",
        description="Show the commit pointers, the diffs per shard and the GC bounds of a "
        "queue database, through a read-only open that takes no lock and changes no data "
        "(a directory this user cannot write is read through a temporary directory of "
        "links to its files, removed at the end).",
        epilog=EXAMPLES,
    )
    show.add_argument("db", type=path_arg, help="database directory")
    show.add_argument("--json", action="store_true", help="print the summary as JSON")
    show.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    show.set_defaults(run=_run_args, interrupted="nothing was changed")


def _run_args(args: argparse.Namespace, out: TextIO) -> None:
    run(args.db, as_json=args.json, out=out, progress=not args.no_progress)


def run(db: Path, *, as_json: bool, out: TextIO, progress: bool = False) -> None:
    database_dir(db)
    # Every diff record is read: seconds to minutes for 10^5 to 10^6 stored diffs.
    with Heartbeat("inspect", enabled=progress) as beat:
        beat.update(f"reading the diff records of {db}")
        with Queue.open(db, QueueConfig(gc_enabled=False), read_only=True) as queue:
            summary = queue.summary()
    if as_json:
        json.dump(summary, out, indent=2, sort_keys=True)
        print(file=out)
        return
    _print_text(summary, out)


def _key(obj: dict[str, Any] | None) -> str:
    return "-" if obj is None else f"{obj['lt']}:{obj['hash']}"


def _print_text(summary: dict[str, Any], out: TextIO) -> None:
    def say(text: str = "") -> None:
        print(text, file=out)

    say(f"queue database {summary['path']} (read-only view)")
    if summary["unfinished_import"] is not None and summary["import_running"]:
        say(
            f"IMPORT UNDER WAY of block {summary['unfinished_import']}: an import holds the "
            "queue's import lock and is writing it; what is shown holds the batches written "
            "so far: look again once it has finished"
        )
    elif summary["unfinished_import"] is not None:
        say(
            f"UNFINISHED IMPORT of block {summary['unfinished_import']}: it was interrupted "
            "and what it wrote is partial; the next writer open rolls it back (e.g. `imq "
            "gc`), then run `imq import` again"
        )
    say(f"last committed masterchain block: {summary['last_committed_mc_block'] or '-'}")
    say("\ncommit pointers:")
    for shard, pointer in summary["commit_pointers"].items() or [("-", None)]:
        say(f"  {shard:22} {_key(pointer['key'])} seqno {pointer['seqno']}" if pointer else "  -")
    say("\ndiffs per shard:")
    for shard, entry in summary["shards"].items() or [("-", None)]:
        if entry is None:
            say("  -")
            continue
        low, high = entry["seqnos"]
        messages = ", ".join(f"p{p}: {n}" for p, n in sorted(entry["messages"].items()))
        say(
            f"  {shard:22} {entry['diffs']} diffs (seqno {low}..{high}; "
            f"{entry['committed']} committed, {entry['uncommitted']} uncommitted); "
            f"messages {messages or '-'}"
        )
    say("\nGC bounds (partition/shard: requested -> executed):")
    for name, bound in summary["gc"].items() or [("-", None)]:
        if bound is None:
            say("  -")
            continue
        say(f"  {name}: {_key(bound['requested'])} -> {_key(bound['executed'])}")
