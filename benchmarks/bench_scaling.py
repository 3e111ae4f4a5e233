"""Latency of the per-block operations as the queue grows: 10^3 .. 10^7 stored messages.

One queue grows in 100-message diffs, round-robin over 4 source shards of the basechain
(200-byte bodies); at each size (a power of ten) the benchmark times, call by call:

- ``commit_diff`` of the next (stored, empty) masterchain block with the newest diff of
  each shard as top blocks;
- ``get_diff_info`` of a random stored shard diff;
- ``get_diffs_tail_len`` from the 3rd newest diff of a shard (the answer is 3 at every
  size);
- iterator creation + first message, over the 4 shards from ``QueueKey.MIN``;
- ``load_diff_statistics`` of one random diff (its key range);
- one GC pass (``run_gc``) collecting the oldest remaining diff of one shard (the commit
  that moves the bound is not timed);
- ``clear_uncommitted_state`` of one freshly applied (uncommitted) 100-message diff.

The queue's GC worker is off, and so is its cache of fresh message rows (see ``CONFIG``);
Python's cyclic GC is off while timing. The report gives
median and p99 per size, the log-log slope of the medians (least squares over the
sizes), and a PNG. A slope under 0.05 means "does not grow with the queue".
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import random
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter, perf_counter_ns
from typing import Any

from benchmarks.bench_core import machine_lines
from benchmarks.common import (
    account_in,
    parse_args,
    quiet_logs,
    temp_workdir,
    wait_for_background,
    write_report,
)
from imq import (
    Address,
    BlockId,
    BlockIdShort,
    DiffStatistics,
    Message,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    TopBlock,
)
from imq.storage import Table

SEED = 20_261_202
SHARDS = tuple(ShardIdent(0, (2 * i + 1) << 61) for i in range(4))  # 0:2000.. 0:e000..
MC = ShardIdent.MASTERCHAIN
DIFF = 100
BODY = 200
LT0 = 1_000_000
MC_LT0 = 1 << 44
# The cache of fresh message rows is off: these rows time RocksDB's paths, which must not
# grow with the stored size. With it on, a small queue's iterator is served from memory
# (everything it holds was written since the open) and a large one's from RocksDB, so the
# iterator row would time two paths at once; bench_floor times the cached read.
CONFIG = QueueConfig(gc_enabled=False, message_cache_size=0)

OPS = (
    "commit_diff",
    "get_diff_info",
    "get_diffs_tail_len",
    "iterator + first message",
    "load_diff_statistics (one diff)",
    "GC pass (one diff)",
    "clear_uncommitted_state (one diff)",
)
FLAT_EXPECTED = set(OPS)  # every one of them should be independent of the queue's size


@dataclass
class Plan:
    exponents: tuple[int, ...]
    calls: int
    slow_calls: int  # GC and clear
    warmup: int
    # Measuring passes per size, each after the background work settled: a pass lasts
    # about a second, so one flush or compaction landing in it moved a whole row's
    # median (a slope of 0.13 in one run, 0.03 in the next, on the same code).
    rounds: int = 1


FULL = Plan((3, 4, 5, 6, 7), calls=200, slow_calls=5, warmup=10, rounds=3)
QUICK = Plan((3, 4), calls=5, slow_calls=2, warmup=1)


class Grower:
    """Applies 100-message diffs round-robin over the shards; keeps what the calls need."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue
        self.rng = random.Random(SEED)
        self.dst = [Address(0, self.rng.randbytes(32)) for _ in range(4096)]
        self.src = {s: [Address(0, account_in(self.rng, s)) for _ in range(64)] for s in SHARDS}
        self.lt = LT0
        self.i = 0
        self.stored = 0
        self.seqno = dict.fromkeys(SHARDS, 0)
        self.diffs: dict[ShardIdent, list[tuple[int, QueueKey, QueueKey]]] = {s: [] for s in SHARDS}
        self.mc_seqno = 0
        self.processed: dict[ShardIdent, QueueKey] = {}

    def messages(self, shard: ShardIdent) -> list[Message]:
        rng, src, dst = self.rng, self.src[shard], self.dst
        out = [
            Message(
                QueueKey(self.lt + j, rng.randbytes(32)),
                rng.choice(src),
                rng.choice(dst),
                rng.randbytes(BODY),
            )
            for j in range(DIFF)
        ]
        self.lt += DIFF
        return out

    def apply_next(self, shard: ShardIdent) -> tuple[int, QueueDiff]:
        seqno = self.seqno[shard] + 1
        diff = QueueDiff(self.messages(shard), {})
        assert self.queue.apply_diff(diff, BlockIdShort(shard, seqno), self.rng.randbytes(32))
        self.seqno[shard] = seqno
        return seqno, diff

    def grow_to(self, total: int) -> None:
        while self.stored < total:
            shard = SHARDS[self.i % len(SHARDS)]
            self.i += 1
            seqno, diff = self.apply_next(shard)
            assert diff.min_message is not None and diff.max_message is not None
            self.diffs[shard].append((seqno, diff.min_message, diff.max_message))
            self.stored += DIFF

    def mc_block(self) -> int:
        """Apply the next empty masterchain diff (lt span as its bounds); its seqno."""
        self.mc_seqno += 1
        n = self.mc_seqno
        lt = MC_LT0 + n * 1000
        stats = DiffStatistics(MC, QueueKey.min_for_lt(lt), QueueKey.max_for_lt(lt + 999), {})
        diff = QueueDiff((), dict(self.processed))
        assert self.queue.apply_diff(diff, BlockIdShort(MC, n), n.to_bytes(32, "big"), stats)
        return n

    def tops(self, mc: int) -> list[TopBlock]:
        out = [TopBlock(BlockId(MC, mc), mc)]
        out += [TopBlock(BlockId(s, self.diffs[s][-1][0]), mc) for s in SHARDS]
        return out


def settle(queue: Queue, limit: float = 300.0) -> float:
    """Wait until RocksDB runs no flush or compaction and has none pending in any table
    (the growth just wrote up to 10^7 messages; its compaction debt is paid in the
    background); seconds waited. The latencies are then those of the stored size, not of
    a compaction running beside them (``bench_endurance`` measures that case)."""
    store = queue._store
    waited, _idle = wait_for_background(
        lambda name: sum(store.property_int(t, name) for t in Table), limit=limit
    )
    return waited


@contextlib.contextmanager
def cyclic_gc_off() -> Iterator[None]:
    """Collect once, then keep Python's cyclic GC off for the block (on again after)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def time_call(fn: Callable[[], Any]) -> tuple[int, Any]:
    started = perf_counter_ns()
    out = fn()
    return perf_counter_ns() - started, out


@dataclass
class Size:
    stored: int
    samples: dict[str, list[int]] = field(default_factory=dict)


def measure(g: Grower, plan: Plan, rng: random.Random) -> Size:
    q = g.queue
    size = Size(g.stored)
    n = plan.calls + plan.warmup

    def record(op: str, fn: Callable[[], Any], calls: int, warmup: int, check: Any = None) -> None:
        samples = []
        with cyclic_gc_off():
            for i in range(calls + warmup):
                ns, out = time_call(fn)
                if check is not None:
                    assert check(out), (op, out)
                if i >= warmup:
                    samples.append(ns)
        size.samples[op] = samples

    # commit_diff: the masterchain blocks are stored first (untimed).
    blocks = [g.mc_block() for _ in range(n)]
    pending = iter(blocks)
    record(
        "commit_diff",
        lambda: q.commit_diff(g.tops(next(pending))),
        plan.calls,
        plan.warmup,
        check=lambda ok: ok is True,
    )
    stored = [(s, seqno) for s in SHARDS for seqno, _, _ in g.diffs[s]]
    record(
        "get_diff_info",
        lambda: q.get_diff_info(*rng.choice(stored)),
        plan.calls,
        plan.warmup,
        check=lambda info: info is not None,
    )
    shard = SHARDS[1]
    from_key = g.diffs[shard][-3][2]
    record(
        "get_diffs_tail_len",
        lambda: q.get_diffs_tail_len(shard, from_key),
        plan.calls,
        plan.warmup,
        check=lambda n: n == 3,
    )
    ranges = [QueueShardRange(s, QueueKey.MIN, QueueKey.MAX) for s in SHARDS]

    def first() -> Any:
        with q.iterator(0, ranges, ShardIdent.BASECHAIN) as it:
            return next(it)

    record(
        "iterator + first message", first, plan.calls, plan.warmup, check=lambda m: m is not None
    )

    def stats() -> Any:
        s = SHARDS[2]
        _seqno, lo, hi = rng.choice(g.diffs[s])
        return q.load_diff_statistics(0, QueueShardRange(s, lo, hi.next_value()))

    record(
        "load_diff_statistics (one diff)",
        stats,
        plan.calls,
        plan.warmup,
        check=lambda d: sum(d.values()) == DIFF,
    )

    # GC: each pass collects the oldest remaining diff of shard 0; the commit that moves
    # its bound is not timed. Cyclic GC is collected once and off for the whole loop, as
    # in ``record``: a full collection before each call walks this benchmark's own heap
    # (which grows with the size) and leaves the CPU caches cold for the call after it.
    gc_samples = []
    victim = SHARDS[0]
    with cyclic_gc_off():
        for _ in range(plan.slow_calls):
            if len(g.diffs[victim]) < 2:
                break
            _seqno, _lo, hi = g.diffs[victim].pop(0)
            g.stored -= DIFF
            g.processed[victim] = hi
            mc = g.mc_block()
            assert q.commit_diff(g.tops(mc))
            ns, executed = time_call(q.run_gc)
            assert executed > 0
            gc_samples.append(ns)
    size.samples["GC pass (one diff)"] = gc_samples

    # clear: one uncommitted diff of shard 3 (applied untimed), then the clear.
    clear_samples = []
    s3 = SHARDS[3]
    with cyclic_gc_off():
        for _ in range(plan.slow_calls):
            seqno, _diff = g.apply_next(s3)
            ns, _ = time_call(q.clear_uncommitted_state)
            assert q.get_diff_info(s3, seqno) is None
            g.seqno[s3] = seqno - 1
            clear_samples.append(ns)
    size.samples["clear_uncommitted_state (one diff)"] = clear_samples
    return size


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    lx = [math.log10(x) for x in xs]
    ly = [math.log10(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / den if den else 0.0


def p99(values: Sequence[int]) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(0.99 * len(ordered))) - 1]


def run(args: argparse.Namespace, workdir: Path) -> tuple[str, list[Size], list[str]]:
    plan = QUICK if args.quick else FULL
    if args.max_exp is not None:
        plan = Plan(
            tuple(e for e in plan.exponents if e <= args.max_exp),
            plan.calls,
            plan.slow_calls,
            plan.warmup,
            plan.rounds,
        )
    load_start = os.getloadavg()
    rng = random.Random(SEED + 1)
    sizes: list[Size] = []
    build_notes: list[str] = []
    queue = Queue.open(workdir / "q", CONFIG)
    try:
        g = Grower(queue)
        for e in plan.exponents:
            started = perf_counter()
            g.grow_to(10**e)
            built = perf_counter() - started
            settled = settle(queue)
            print(
                f"10^{e}: grown in {built:.1f} s, compactions settled in {settled:.1f} s; "
                "measuring ...",
                file=sys.stderr,
            )
            started = perf_counter()
            size = measure(g, plan, rng)
            for _ in range(plan.rounds - 1):
                settle(queue)
                for op, samples in measure(g, plan, rng).samples.items():
                    size.samples.setdefault(op, []).extend(samples)
            sizes.append(size)
            build_notes.append(
                f"10^{e}: grown in {built:.1f} s, background compactions settled in "
                f"{settled:.1f} s, measured in {perf_counter() - started:.1f} s, "
                f"load {os.getloadavg()[0]:.2f}"
            )
    finally:
        queue.close()
    return render(args, plan, sizes, build_notes, load_start), sizes, build_notes


def render(
    args: argparse.Namespace,
    plan: Plan,
    sizes: list[Size],
    notes: list[str],
    load_start: tuple[float, ...],
) -> str:
    out = ["# imq scaling benchmark: per-block operations from 10^3 stored messages up", ""]
    if args.quick:
        out += ["**Quick smoke run: sizes are reduced; these numbers are not results.**", ""]
    out += machine_lines(
        " ".join(["python -m benchmarks.bench_scaling", *sys.argv[1:]]), load_start
    )
    out += [
        "",
        f"100-message diffs over 4 source shards; {plan.calls} timed calls per operation and "
        f"size after {plan.warmup} warm-up calls ({plan.slow_calls} for GC and clear), in "
        f"{plan.rounds} measuring pass{'es' if plan.rounds > 1 else ''} per size, each after "
        "RocksDB's background work settled. "
        "Median (p99) over every pass's calls, in µs. Slope: least-squares fit of "
        "log10(median) on log10(size). "
        "Target: slope < 0.05.",
        "",
        "| operation | " + " | ".join(f"{s.stored:,}" for s in sizes) + " | slope | target |",
        "|---|" + "---:|" * len(sizes) + "---:|---|",
    ]
    for op in OPS:
        cells = []
        meds = []
        for s in sizes:
            v = s.samples.get(op) or []
            if v:
                med = statistics.median(v) / 1e3
                meds.append((s.stored, med))
                cells.append(f"{med:,.0f} ({p99(v) / 1e3:,.0f})")
            else:
                cells.append("n/a")
        sl = slope([m[0] for m in meds], [m[1] for m in meds]) if len(meds) > 1 else float("nan")
        verdict = "PASS" if sl < 0.05 else "FAIL"
        out.append(f"| {op} | " + " | ".join(cells) + f" | {sl:.3f} | {verdict} |")
    out += ["", "Build and measure times:", "", *[f"- {n}" for n in notes], "", METHOD]
    return "\n".join(out)


METHOD = """## Method

- One queue (`QueueConfig(gc_enabled=False, message_cache_size=0)`, production settings
  otherwise: no GC worker, no cache of fresh message rows, so every row times RocksDB's
  path; `bench_floor` times the cached read) grows from one size to the next; every
  size is measured on the same database, so the numbers also carry what the earlier
  measurements left (committed pointers, a few collected diffs of shard 0). The GC rows
  collect real diffs: at 10^3 there are only a few per shard, so fewer passes run there.
- After growing to each size the run waits until RocksDB has no flush or compaction
  running or pending in any table (the bulk tables compact in the background; the wait
  is in the notes), so each size is measured as stored, not beside the compaction of
  what was just written (`bench_endurance` measures latencies with it running).
- Each size is measured in three passes (`--quick`: one), the run waiting for the
  background work to settle again before each; a row's median and p99 are over the
  calls of every pass. A pass lasts about a second, and with one pass a single flush or
  compaction landing in it (the passes write too: commits, GC, clears) moved a whole
  row: two runs of the same code 40 seconds apart gave slopes of 0.10-0.13 and 0.01-0.05
  for the same rows.
- Calls run one at a time with `perf_counter_ns`; `gc.collect()` then `gc.disable()`
  around each operation's calls (once per operation, never before each call: a full
  collection walks this benchmark's own heap, which grows with the size, and left the
  next call's CPU caches cold: GC pass and clear read 3x slower at 10^7 that way).
- Every result is checked (commit returns True, the diff info exists, the tail length
  is 3, the statistics of a diff sum to 100, the GC pass executed a deletion, the clear
  removed the diff).
"""


def write_plot(sizes: list[Size], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib not installed"
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for op in OPS:
        pts = [
            (s.stored, statistics.median(s.samples[op]) / 1e3) for s in sizes if s.samples.get(op)
        ]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=op)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("stored messages")
    ax.set_ylabel("median latency, µs")
    ax.set_title("imq: latency against queue size (100-message diffs, 4 shards)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path.name}"


def main(argv: Sequence[str] | None = None) -> int:
    def own(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--max-exp", type=int, default=None, help="largest size as a power of ten (default 7)"
        )

    args = parse_args(argv, "scaling", "latency against queue size", "unused", extra=own)
    quiet_logs()
    with temp_workdir(args, "scaling") as work:
        text, sizes, _ = run(args, work)
        note = write_plot(sizes, args.out.with_suffix(".png"))
        write_report(args.out, text + f"\n\n{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
