"""The child of ``test_crash.py``: a random mix of queue calls until it is killed.

``python crash_child.py TESTS_DIR DB SEED MIN_LT`` opens the queue, prints ``ready``, then runs
operations forever. Before each call it prints ``B <json>`` and after the call returns
``A <json>`` (flushed), so the parent knows what was acknowledged and what was in
flight when the SIGKILL came.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from pathlib import Path

import structlog

sys.path.insert(0, sys.argv[1])
sys.path.insert(0, str(Path(sys.argv[1]).parent))

from builders import (
    MC,
    Clock,
    block,
    diff_hash,
    make_diff,
    messages,
    quiet_config,
    top,
)
from state_fixtures import write_state

from imq import DiffZone, Queue, QueueDiff, QueueKey
from imq.state.synth import synth_state
from imq.storage import codec

SHARDS = [
    __import__("imq").ShardIdent(0, 0x2000_0000_0000_0000),
    __import__("imq").ShardIdent(0, 0x6000_0000_0000_0000),
]
IMPORT = synth_state(diffs=3, messages_per_diff=300, body_bytes=40, seed=9)


def say(kind: str, **fields: object) -> None:
    sys.stdout.write(f"{kind} {json.dumps(fields)}\n")
    sys.stdout.flush()


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    db, seed = Path(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    # IMQ_CRASH_UNSYNCED=1: commits without fsync, for test_power_loss.py's control run
    # (a power loss must then lose acknowledged commits, and its checker must say so).
    synced = os.environ.get("IMQ_CRASH_UNSYNCED") != "1"
    queue = Queue.open(db, quiet_config(gc_enabled=False, sync_commits=synced))
    top_lt = max(
        [
            info.max_message.lt
            for s in SHARDS
            if (n := queue.get_last_applied_seqno(s)) is not None
            and (info := queue.get_diff_info(s, n, DiffZone.BOTH)) is not None
        ]
        + [p.key.lt for p in queue.get_commit_pointers().values()]
        + [0]
    )
    # Above every lt an earlier child used (argv[4]): keys derive from lts, so a cleared
    # diff's keys must never come back under the same seqno.
    clock = Clock(start=max(top_lt, int(sys.argv[4]), 10**9 + 2 * 10**8) + 1_000)
    source = db.parent / "import.bin"
    if not source.exists():
        write_state(IMPORT, db.parent / "import.tmp")
        (db.parent / "import.tmp").rename(source)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        op = rng.choices(
            ["apply", "prepare_discard", "prepare_write", "commit", "clear", "gc", "import"],
            [6, 1, 1, 3, 1, 1, 1],
        )[0]
        if op in ("apply", "prepare_discard", "prepare_write"):
            shard = rng.choice(SHARDS)
            seqno = (queue.get_last_applied_seqno(shard) or 0) + 1
            msgs = messages(clock, shard, rng.randint(1, 40))
            # Processed up to the end of an older diff of this shard: commits then request
            # GC bounds on diff boundaries, so GC removes whole committed diffs.
            older = seqno - 2
            done = None if older < 1 else queue.get_diff_info(shard, older, DiffZone.BOTH)
            diff = make_diff(msgs, processed_to={} if done is None else {shard: done.max_message})
            fields = {
                "op": op,
                "shard": str(shard),
                "seqno": seqno,
                "n": len(msgs),
                "min": codec.key_bytes(msgs[0].key).hex(),
                "max": codec.key_bytes(msgs[-1].key).hex(),
            }
            say("B", **fields)
            bid, h = block(shard, seqno), diff_hash(("crash", shard, seqno, seed))
            if op == "apply":
                queue.apply_diff(diff, bid, h)
            else:
                pending = queue.prepare_diff(diff, bid, h)
                assert pending is not None
                if op == "prepare_write":
                    pending.write()
                else:
                    pending.discard()
            say("A", **fields)
        elif op == "commit":
            mc = (queue.get_last_applied_seqno(MC) or 0) + 1
            tops = [top(MC, mc)]
            pointers = {str(MC): [mc, codec.key_bytes(QueueKey.MIN).hex()]}
            for shard in SHARDS:
                n = queue.get_last_applied_seqno(shard)
                info = None if n is None else queue.get_diff_info(shard, n, DiffZone.BOTH)
                if info is not None:
                    tops.append(top(shard, n, mc))
                    pointers[str(shard)] = [n, codec.key_bytes(info.max_message).hex()]
            say("B", op="commit", mc=mc, pointers=pointers)
            # An empty masterchain diff pinned at MIN: the pointer the parent expects.
            mc_diff = QueueDiff(min_key=QueueKey.MIN, max_key=QueueKey.MIN)
            queue.apply_diff(mc_diff, block(MC, mc), diff_hash(("mc", mc, seed)))
            queue.commit_diff(tops)
            say("A", op="commit", mc=mc, pointers=pointers)
        elif op == "clear":
            say("B", op="clear")
            queue.clear_uncommitted_state(top_shards=SHARDS)
            say("A", op="clear")
        elif op == "gc":
            say("B", op="gc")
            queue.run_gc()
            say("A", op="gc")
        elif queue.get_last_applied_seqno(IMPORT.shard) is None:
            diffs = [
                [d.seqno, len(d.messages), codec.key_bytes(d.tl.max_message).hex()]
                for d in IMPORT.diffs
            ]
            say("B", op="import", shard=str(IMPORT.shard), diffs=diffs)
            queue.import_state(source, IMPORT.block_id, IMPORT.top_update)
            say("A", op="import", shard=str(IMPORT.shard), diffs=diffs)


if __name__ == "__main__":
    main()
