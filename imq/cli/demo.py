"""``imq demo``: a short scripted scenario that shows how a diff flows through the queue.

Masterchain plus two basechain shards: apply diffs (uncommitted), commit on a
masterchain block, read one shard's incoming messages, reset the uncommitted zone,
reopen and show that the committed state survived.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import TextIO

from imq.cli.common import Commands, path_arg, wipe_database
from imq.config import QueueConfig
from imq.diff import QueueDiff
from imq.queue import Queue
from imq.router import PartitionRouter
from imq.types import (
    Address,
    BlockId,
    BlockIdShort,
    DiffZone,
    Message,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    TopBlock,
)

__all__ = ["DEFAULT_DB", "register", "run"]

DEFAULT_DB = Path("var") / "demo-db"
EXAMPLES = """\
examples (from the repository root):
  imq demo
  imq demo --db var/demo-db
"""


def register(commands: Commands) -> None:
    demo = commands.add_parser(
        "demo",
        help="run a short scripted scenario on an embedded database and show what it holds",
        description="Apply, commit, read, clear and reopen on a small queue, printing each "
        "step. The database is wiped first: only a directory that holds nothing but an imq "
        "queue database (or nothing), and never one that a running process has open.",
        epilog=EXAMPLES,
    )
    demo.add_argument(
        "--db",
        type=path_arg,
        default=DEFAULT_DB,
        help=f"database directory, wiped first (default: {DEFAULT_DB})",
    )
    demo.set_defaults(
        run=_run_args,
        interrupted="the demo database is left part way: `imq demo` again starts it over",
    )


def _run_args(args: argparse.Namespace, out: TextIO) -> None:
    run(args.db, out)


def _short(key: QueueKey) -> str:
    """A key for the narrative: lt and the first 4 hash bytes (``str(key)`` is lossless)."""
    return f"{key.lt}:{key.hash[:4].hex()}.."


MC = ShardIdent.MASTERCHAIN
LEFT = ShardIdent(0, 0x4000_0000_0000_0000)  # accounts whose first bit is 0
RIGHT = ShardIdent(0, 0xC000_0000_0000_0000)  # accounts whose first bit is 1
SHARDS = (MC, LEFT, RIGHT)
MESSAGES_PER_DIFF = 6
SEQNOS = range(1, 4)


class _Scenario:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.rng = random.Random(7)
        self.lt = 1_000
        self.accounts = {
            LEFT: [self._account(LEFT, 0x10 + i) for i in range(3)],
            RIGHT: [self._account(RIGHT, 0x90 + i) for i in range(3)],
            MC: [self._account(MC, 0x55)],
        }

    def _account(self, shard: ShardIdent, first: int) -> Address:
        return Address(shard.workchain, bytes([first]) + self.rng.randbytes(31))

    def say(self, text: str = "") -> None:
        print(text, file=self.out)

    def diff(self, shard: ShardIdent, processed_to: dict[ShardIdent, QueueKey]) -> QueueDiff:
        messages = []
        for _ in range(MESSAGES_PER_DIFF if shard != MC else 1):
            self.lt += self.rng.randint(1, 3)
            dst_shard = self.rng.choice([s for s in SHARDS if s != shard])
            messages.append(
                Message(
                    QueueKey(self.lt, self.rng.randbytes(32)),
                    self.rng.choice(self.accounts[shard]),
                    self.rng.choice(self.accounts[dst_shard]),
                    b"transfer %d" % self.lt,
                )
            )
        # One busy destination account is routed to the low-priority partition.
        router = PartitionRouter(dst={1: [self.accounts[LEFT][0]]})
        return QueueDiff(messages, processed_to, router)

    def apply_round(self, queue: Queue, seqno: int) -> dict[ShardIdent, QueueKey]:
        """Apply one diff per shard; return each diff's max message."""
        maxima: dict[ShardIdent, QueueKey] = {}
        processed = {s: QueueKey.max_for_lt(self.lt - 4) for s in SHARDS}
        for shard in SHARDS:
            diff = self.diff(shard, processed)
            block = BlockIdShort(shard, seqno)
            applied = queue.apply_diff(diff, block, self.rng.randbytes(32))
            assert diff.min_message is not None and diff.max_message is not None
            maxima[shard] = diff.max_message
            self.say(
                f"  applied {block}: {len(diff.messages)} messages, "
                f"keys {_short(diff.min_message)} .. {_short(diff.max_message)} "
                f"({'new' if applied else 'no-op'})"
            )
        return maxima

    def show_zones(self, queue: Queue, seqnos: range) -> None:
        """One line per shard: the zone of each of its diffs (``-`` once deleted)."""
        for shard in SHARDS:
            zones = []
            for seqno in seqnos:
                committed = queue.get_diff_info(shard, seqno, DiffZone.COMMITTED) is not None
                exists = queue.is_diff_exists(BlockIdShort(shard, seqno))
                zones.append(
                    f"#{seqno}={'committed' if committed else 'uncommitted' if exists else '-'}"
                )
            self.say(f"  {shard!s:22} {' '.join(zones)}")

    def read_incoming(self, queue: Queue, for_shard: ShardIdent) -> None:
        ranges = [QueueShardRange(s, QueueKey.MIN, QueueKey.MAX) for s in SHARDS]
        for partition in (0, 1):
            with queue.iterator(partition, ranges, for_shard) as it:
                got = list(it)
                position = it.current_position()
            self.say(f"  partition {partition}: {len(got)} messages for {for_shard}")
            for item in got[:3]:
                m = item.message
                self.say(f"    {_short(m.key)}  from {item.source}  to {str(m.dst)[:14]}..")
            if len(got) > 3:
                self.say(f"    ... and {len(got) - 3} more")
            if got:
                self.say(
                    "    read position: "
                    + ", ".join(f"{s}@{_short(k)}" for s, k in sorted(position.items()))
                )


def run(db: Path, out: TextIO) -> None:
    """Run the demo on ``db`` (wiped first)."""
    scenario = _Scenario(out)
    say = scenario.say
    wipe_database(db)
    config = QueueConfig(gc_enabled=False)  # the demo runs GC itself, at a chosen step
    with Queue.open(db, config) as queue:
        say(f"imq demo: database {db}")  # once it opened: a refused path prints nothing here
        say("\n1. The collator writes each block's diff at once, uncommitted:")
        for seqno in SEQNOS:
            scenario.apply_round(queue, seqno)
        scenario.show_zones(queue, SEQNOS)

        say("\n2. Masterchain block 2 is applied: commit on it (top blocks: seqno 2).")
        tops = [TopBlock(BlockId(s, 2), 2) for s in SHARDS]
        queue.commit_diff(tops)
        for shard, pointer in sorted(queue.get_commit_pointers().items()):
            say(f"  pointer {shard!s:22} -> {_short(pointer.key)} (seqno {pointer.seqno})")
        scenario.show_zones(queue, SEQNOS)

        say("\n   GC deletes, per source shard, what every reader has processed (the minimum")
        say("   processed_to over the committed diffs):")
        bounds, _ = queue.gc_bounds()
        for (partition, shard), bound in sorted(bounds.items()):
            say(f"  bound p{partition} {shard!s:22} <= {_short(bound)}")
        say(f"  run_gc: {queue.run_gc()} (partition, shard) ranges collected")

        say(f"\n3. Collating {LEFT}: read its incoming messages, merged across sources:")
        scenario.read_incoming(queue, LEFT)
        tail = queue.get_diffs_tail_len(RIGHT, QueueKey.MIN)
        say(f"  diffs of {RIGHT} stored: {tail}")

        say("\n4. The collation is cancelled: reset the uncommitted zone.")
        queue.clear_uncommitted_state(top_shards=SHARDS)
        scenario.show_zones(queue, SEQNOS)

    say("\n5. Restart: reopen the database; the committed state is still there.")
    with Queue.open(db, config) as queue:
        last = queue.get_last_committed_mc_block_id()
        say(f"  last committed masterchain block: {last.short if last else None}")
        scenario.show_zones(queue, SEQNOS)
        scenario.read_incoming(queue, LEFT)
        say("\nLatency of the calls above (this process, after reopen):")
        for op, stats in sorted(queue.metrics.snapshot()["operations"].items()):  # type: ignore[attr-defined]
            say(
                f"  {op:32} n={stats['count']:<4} p50={stats['p50'] * 1e6:8.1f} us "
                f"p99={stats['p99'] * 1e6:8.1f} us"
            )
    say("\ndone.")
