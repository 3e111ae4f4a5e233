"""``imq inspect DB``: what a queue database holds, read-only (safe beside a live node)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from imq.config import QueueConfig
from imq.queue import Queue

__all__ = ["run"]


def run(db: Path, *, as_json: bool, out: TextIO) -> None:
    with Queue.open(db, QueueConfig(gc_enabled=False), read_only=True) as queue:
        summary = queue.summary()
    if as_json:
        json.dump(summary, out, indent=2, sort_keys=True)
        print(file=out)
        return
    _print_text(summary, out)


def _print_text(summary: dict[str, Any], out: TextIO) -> None:
    def say(text: str = "") -> None:
        print(text, file=out)

    say(f"queue database {summary['path']} (read-only view)")
    say(f"last committed masterchain block: {summary['last_committed_mc_block'] or '-'}")
    say("\ncommit pointers:")
    for shard, pointer in summary["commit_pointers"].items() or [("-", None)]:
        say(f"  {shard:22} {pointer['key']} seqno {pointer['seqno']}" if pointer else "  -")
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
        say(f"  {name}: {bound['requested']} -> {bound['executed'] or '-'}" if bound else "  -")
