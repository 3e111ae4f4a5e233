"""The crash campaign: SIGKILL a child running a random mix of apply, prepare/discard,
prepare/write, commit, clear, GC and import at random moments; after each kill check
the database against what the child acknowledged.

After each kill the checker opens the queue (which rolls back an interrupted import) and
verifies, looking only at what changed since the last check:

- every acknowledged diff is there and whole (its info, its tail row, all its messages),
  unless an acknowledged clear or GC was allowed to remove it;
- the diff in flight is whole or absent (never partly present);
- the commit pointers equal those of the last acknowledged commit (or the one in
  flight), and the last committed masterchain block matches;
- nothing deleted reappears;
- an interrupted import left all of its diffs or none.

``test_checker_is_not_vacuous`` feeds the checker wrong models. CI runs >= 50 kills;
``make soak`` (``slow``) runs 1,000.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from builders import MC, quiet_config

from imq import DiffZone, Queue, ShardIdent
from imq.storage import Scan, Table, codec
from imq.verify import verify

HERE = Path(__file__).resolve().parent
CHILD = HERE / "crash_child.py"

DiffId = tuple[str, int, str]  # (shard, seqno, max key hex)


@dataclass
class Model:
    """What the children acknowledged, as far as the checks need it."""

    present: dict[tuple[str, int], tuple[str, str, int]] = field(default_factory=dict)
    deleted: set[DiffId] = field(default_factory=set)
    pointers: dict[str, list[Any]] = field(default_factory=dict)
    last_mc: int | None = None
    imported: bool = False


def _shard(text: str) -> ShardIdent:
    wc, prefix = text.split(":")
    return ShardIdent(int(wc), int(prefix, 16))


def _messages_in_span(queue: Queue, shard: ShardIdent, lo_hex: str, hi_hex: str) -> int:
    prefix = codec.message_prefix(0, shard)
    lo, hi = prefix + bytes.fromhex(lo_hex), prefix + bytes.fromhex(hi_hex) + b"\x00"
    with queue._store.snapshot(scans=[Scan(Table.MESSAGES, lo, hi, keys_only=True)]) as snap:
        return sum(1 for _ in snap.cursors[0])


def _stored_max(queue: Queue, shard: str, seqno: int) -> str | None:
    info = queue.get_diff_info(_shard(shard), seqno, DiffZone.BOTH)
    return None if info is None else codec.key_bytes(info.max_message).hex()


def check(queue: Queue, model: Model, lines: list[str]) -> None:
    """Replay the child's log onto ``model`` and check the database; raises
    ``AssertionError`` on any violation. ``model`` is updated to the checked state."""
    events = [(line[0], json.loads(line[2:])) for line in lines if line[:2] in ("B ", "A ")]
    may_vanish: set[tuple[str, int]] = set()
    must_vanish: set[tuple[str, int]] = set()
    in_flight: dict[str, Any] | None = None
    pointers, last_mc = dict(model.pointers), model.last_mc
    flight_pointers: tuple[dict[str, list[Any]], int | None] | None = None
    present = dict(model.present)
    for kind, ev in events:
        op = ev["op"]
        if kind == "B":
            in_flight = ev
            if op == "clear":
                may_vanish |= {
                    (s, n) for (s, n) in present if s not in pointers or n > pointers[s][0]
                }
            elif op == "gc":
                may_vanish |= {
                    (s, n) for (s, n) in present if s in pointers and n <= pointers[s][0]
                }
            elif op == "commit":
                flight_pointers = ({**pointers, **ev["pointers"]}, ev["mc"])
            continue
        in_flight = None
        flight_pointers = None
        if op in ("apply", "prepare_write"):
            # A seqno freed by a clear is used again by a new diff.
            must_vanish.discard((ev["shard"], ev["seqno"]))
            may_vanish.discard((ev["shard"], ev["seqno"]))
            old = present.get((ev["shard"], ev["seqno"]))
            if old is not None and old[1] != ev["max"]:
                model.deleted.add((ev["shard"], ev["seqno"], old[1]))
            present[(ev["shard"], ev["seqno"])] = (ev["min"], ev["max"], ev["n"])
        elif op == "commit":
            pointers.update(ev["pointers"])
            last_mc = ev["mc"]
        elif op == "clear":
            must_vanish |= {(s, n) for (s, n) in present if s not in pointers or n > pointers[s][0]}
        elif op == "import":
            newest = ev["diffs"][0]
            pointers[ev["shard"]] = [newest[0], newest[2]]
            for seqno, n, max_hex in ev["diffs"]:
                present[(ev["shard"], seqno)] = ("", max_hex, n)

    # Pointers and the last committed block.
    got = {
        str(s): [p.seqno, codec.key_bytes(p.key).hex()]
        for s, p in queue.get_commit_pointers().items()
    }
    mc_block = queue.get_last_committed_mc_block_id()
    got_mc = None if mc_block is None else mc_block.seqno
    allowed = [(pointers, last_mc)]
    if flight_pointers is not None:
        allowed.append(flight_pointers)
    if in_flight is not None and in_flight["op"] == "import":
        newest = in_flight["diffs"][0]
        allowed.append(({**pointers, in_flight["shard"]: [newest[0], newest[2]]}, last_mc))
    assert (got, got_mc) in allowed, f"pointers {got} @ {got_mc} match no acknowledged commit"

    # Every acknowledged diff: there and whole, or allowed to vanish.
    checked: dict[tuple[str, int], tuple[str, str, int]] = {}
    for (shard, seqno), (lo, hi, n) in present.items():
        changed = (shard, seqno) not in model.present or (shard, seqno) in may_vanish
        stored = _stored_max(queue, shard, seqno) if changed else hi
        if stored == hi:
            assert (shard, seqno) not in must_vanish, f"cleared diff {shard}:{seqno} is still there"
            if changed and lo:
                count = _messages_in_span(queue, _shard(shard), lo, hi)
                assert count == n, f"diff {shard}:{seqno} holds {count} of {n} messages"
            checked[(shard, seqno)] = (lo, hi, n)
        else:
            assert (shard, seqno) in may_vanish, f"acknowledged diff {shard}:{seqno} is lost"
            model.deleted.add((shard, seqno, hi))
    # The diff in flight: whole or absent.
    if in_flight is not None and in_flight["op"] in ("apply", "prepare_write", "prepare_discard"):
        shard, seqno = in_flight["shard"], in_flight["seqno"]
        stored = _stored_max(queue, shard, seqno)
        count = _messages_in_span(queue, _shard(shard), in_flight["min"], in_flight["max"])
        if stored == in_flight["max"] and in_flight["op"] != "prepare_discard":
            assert count == in_flight["n"], f"diff {shard}:{seqno} partly present"
            checked[(shard, seqno)] = (in_flight["min"], in_flight["max"], in_flight["n"])
        else:
            assert stored is None or stored != in_flight["max"], "a discarded diff was written"
            assert count == 0, f"{count} messages of the unwritten diff {shard}:{seqno} stored"
    if in_flight is not None and in_flight["op"] == "import":
        there = [_stored_max(queue, in_flight["shard"], s) == m for s, _n, m in in_flight["diffs"]]
        assert all(there) or not any(there), "an interrupted import left a trace"
        if all(there):
            pointers[in_flight["shard"]] = [in_flight["diffs"][0][0], in_flight["diffs"][0][2]]
            for seqno, n, max_hex in in_flight["diffs"]:
                checked[(in_flight["shard"], seqno)] = ("", max_hex, n)
    # Nothing deleted reappears (the same seqno may hold a new diff: compare max keys).
    for shard, seqno, hi in model.deleted:
        assert _stored_max(queue, shard, seqno) != hi, f"deleted diff {shard}:{seqno} reappeared"
    model.present = checked
    model.pointers = got
    model.last_mc = got_mc


def _run_child(
    db: Path,
    seed: int,
    rng: random.Random,
    min_lt: int = 0,
    *,
    extra_env: dict[str, str] | None = None,
    window: tuple[float, float] = (0.0, 0.4),
) -> list[str]:
    """Run ``crash_child.py`` on ``db`` and SIGKILL it a random time in ``window``
    (seconds) after it is ready; every line it printed. ``extra_env`` is added to its
    environment (``test_power_loss.py`` preloads its recorder that way)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    errors = db.parent / f"{db.name}.child-stderr"
    with errors.open("wb") as err_file:
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(HERE), str(db), str(seed), str(min_lt)],
            stdout=subprocess.PIPE,
            stderr=err_file,
            env=env,
        )
    assert proc.stdout is not None
    lines: list[str] = []
    buffer = b""
    deadline = None
    started = time.monotonic()
    while deadline is None or time.monotonic() < deadline:
        assert time.monotonic() - started < 120, "the child never became ready"
        ready, _, _ = select.select([proc.stdout], [], [], 0.01)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            for raw in complete:
                lines.append(raw.decode())
                if raw == b"ready" and deadline is None:
                    deadline = time.monotonic() + rng.uniform(*window)
    proc.send_signal(signal.SIGKILL)
    rest = proc.stdout.read()
    proc.wait()
    proc.stdout.close()
    lines += [raw.decode() for raw in (buffer + rest).split(b"\n") if raw]
    err = errors.read_text(errors="replace")
    errors.unlink()
    assert "powerloss_shim" not in err, err  # the recorder could not write a record
    assert proc.returncode == -signal.SIGKILL, f"the child ended by itself: {err[-2000:]}"
    return lines


def _lts(lines: list[str]) -> list[int]:
    """The lts of every diff a child began (acknowledged or not)."""
    return [
        int(json.loads(line[2:])["max"][:16], 16)
        for line in lines
        if line.startswith("B ") and '"max"' in line
    ]


def _campaign(tmp_path: Path, kills: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    db = tmp_path / "db"
    model = Model()
    acked = 0
    min_lt = 0
    for i in range(kills):
        lines = _run_child(db, seed * 100_000 + i, rng, min_lt)
        min_lt = max([min_lt, *_lts(lines)])
        acked += sum(1 for line in lines if line.startswith("A "))
        queue = Queue.open(db, quiet_config(gc_enabled=False))
        try:
            check(queue, model, lines)
        finally:
            queue.close()
    report = verify(db)
    assert report.ok, report.problems
    assert acked > kills  # the children did acknowledge work
    return {"kills": kills, "acked": acked}


def test_crash_campaign(tmp_path: Path) -> None:
    _campaign(tmp_path, 50, seed=1)


@pytest.mark.slow
def test_crash_campaign_soak(tmp_path: Path) -> None:
    _campaign(tmp_path, 1000, seed=2)


def test_checker_is_not_vacuous(tmp_path: Path) -> None:
    """Wrong models and tampered databases must fail the checker."""
    db = tmp_path / "db"
    model = Model()
    lines = _run_child(db, 7, random.Random(3))
    queue = Queue.open(db, quiet_config(gc_enabled=False))
    try:
        check(queue, model, lines)
        assert model.present, "the child acknowledged no diff"
        (shard, seqno), (lo, hi, n) = next((k, v) for k, v in model.present.items() if v[0])
        # 1. An acknowledged diff the database does not hold.
        wrong = Model(dict(model.present), set(), dict(model.pointers), model.last_mc)
        line = dict(op="apply", shard=shard, seqno=10_000, n=n, min=lo, max=hi)
        with pytest.raises(AssertionError, match="lost"):
            check(queue, wrong, [f"A {json.dumps(line)}"])
        # 2. Pointers of a commit that was never acknowledged.
        wrong = Model(dict(model.present), set(), {str(MC): [99, hi]}, 99)
        with pytest.raises(AssertionError, match="match no acknowledged commit"):
            check(queue, wrong, [])
        # 3. A deleted diff that is still there.
        wrong = Model(
            dict(model.present), {(shard, seqno, hi)}, dict(model.pointers), model.last_mc
        )
        with pytest.raises(AssertionError, match="reappeared"):
            check(queue, wrong, [])
        # 4. A diff partly present: drop one of its messages behind the checker's back.
        prefix = codec.message_prefix(0, _shard(shard))
        txn = queue._store.transaction()
        txn.delete(Table.MESSAGES, prefix + bytes.fromhex(hi))
        queue._store.write(txn)
        fresh = Model({}, set(), dict(model.pointers), model.last_mc)
        fresh.present = {}
        line = dict(op="apply", shard=shard, seqno=seqno, n=n, min=lo, max=hi)
        with pytest.raises(AssertionError, match=f"holds {n - 1} of {n}"):
            check(queue, fresh, [f"A {json.dumps(line)}"])
    finally:
        queue.close()
