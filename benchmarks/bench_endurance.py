"""Endurance: a producer-consumer steady state with GC on, sampled over time.

Four source shards each apply a diff per round; an empty masterchain diff then commits
the round, carrying the consumer's read positions as ``processed_to``; the consumer reads
the new messages of all four shards through the merge iterator (``for_shard`` = the
basechain). The queue's own GC worker runs (``QueueConfig()`` defaults, a pass every 5
s) and collects everything the consumer has read and the commits cover. Rounds are paced
to a fixed message rate, so throughput measures whether the queue keeps up, and latency
whether it slows down.

The full run warms up for 10 minutes, then measures 30 minutes of steady state
(``--quick``: 20 s, then 100 s). Every sample interval (60 s in the full run, 10 s in
``--quick``) the benchmark records: apply and read throughput (messages/s), p50 and p99
latency of ``apply_diff`` and of one consumer read, L0 file count and live SST size of
each column family, disk use of the directory, the process RSS and RocksDB's own memory,
and the time of a fixed reference task that does not touch the queue (the machine's own
speed at that moment: a shared machine's speed drifts over 40 minutes, and the trend
reports imq's latencies both as measured and relative to it).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.bench_core import machine_lines
from benchmarks.common import (
    account_in,
    file_sizes,
    parse_args,
    quiet_logs,
    temp_workdir,
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

SEED = 20_261_203
SHARDS = tuple(ShardIdent(0, (2 * i + 1) << 61) for i in range(4))
MC = ShardIdent.MASTERCHAIN
BODY = 200
LT0 = 1_000_000
MC_LT0 = 1 << 44
CONFIG = QueueConfig()  # production defaults: GC worker on


@dataclass(frozen=True)
class Plan:
    seconds: float  # the steady state measured after the warm-up
    interval: float
    warmup: float
    rate: int  # target messages/s, all shards together
    diff_size: int  # messages per shard diff


# The full run's warm-up: two periods of the messages table's flush-and-compaction cycle
# (about 5 minutes here: L0 1 -> 3 files, then compacted) and 120 GC passes. Until
# 2026-12-04 the warm-up waited for the block cache to fill (90%, 540 s in the runs of
# 2026-12-02). With the current read path it no longer fills: the consumer's reads come
# from the cache of fresh rows, the block cache takes only GC's scans and the small
# tables' blocks (23 of 256 MiB after 50 minutes in the run of 2026-12-04, whose warm-up
# ran to its 20-minute limit).
FULL = Plan(seconds=1800, interval=60, warmup=600, rate=20_000, diff_size=500)
QUICK = Plan(seconds=100, interval=10, warmup=20, rate=20_000, diff_size=500)
# The reference task: a fixed mix of Python object work, a sort, memory copies and C
# hashing, about 15-20 ms here, timed REFERENCE_RUNS times at every sample (the median is kept).
REFERENCE_ROWS = 5_000
REFERENCE_RUNS = 5


@dataclass
class Sample:
    t: float
    applied: int = 0
    read: int = 0
    apply_ns: list[int] = field(default_factory=list)
    read_ns: list[int] = field(default_factory=list)
    behind_s: float = 0.0  # how far the rounds ran behind their schedule at the end
    l0: dict[str, int] = field(default_factory=dict)
    sst_mb: dict[str, float] = field(default_factory=dict)
    disk_mb: float = 0.0
    rss_mb: float = 0.0
    # RocksDB's own memory, MB: memtables and table readers summed over every table, and
    # the block cache all tables share (what explains the RSS and bounds it).
    memtables_mb: float = 0.0
    cache_mb: float = 0.0
    readers_mb: float = 0.0
    reference_ms: float = 0.0  # the reference task's median time at the sample
    # Where the rest of the RSS is: the queue's cache of fresh rows, and glibc's heap
    # (every malloc of the process, RocksDB's and Python's): in use, and free but kept.
    fresh_mb: float = 0.0
    malloc_used_mb: float = float("nan")
    malloc_free_mb: float = float("nan")


# The reference task, run in a child process so that it shares no interpreter lock, heap
# or cache with the queue (imq's GC thread could otherwise stretch it): it competes for
# the machine's cores as any other process does. It prints the median of its runs, ms.
_REFERENCE_TASK = """
import hashlib, random, statistics, sys, time
rows_n, runs, seed = map(int, sys.argv[1:])
data = random.Random(seed).randbytes(1 << 16)
times = []
for _ in range(runs):
    t0 = time.perf_counter()
    rows = [(i.to_bytes(8, "big"), data[(i * 7919) % 65000 :][:200]) for i in range(rows_n)]
    rows.sort(key=lambda row: row[1])
    hashlib.blake2b(b"".join(k + v for k, v in rows)).digest()
    times.append(time.perf_counter() - t0)
print(statistics.median(times) * 1e3)
"""


def reference_ms(runs: int = REFERENCE_RUNS) -> float:
    """The median time (ms) of a fixed task that does not touch the queue, timed inside a
    child process: the machine's speed at this moment, against which latencies taken at
    different times compare."""
    args = [str(REFERENCE_ROWS), str(runs), str(SEED)]
    done = subprocess.run(
        [sys.executable, "-c", _REFERENCE_TASK, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return float(done.stdout)


def rss_mb() -> float:
    with open("/proc/self/status", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_mb() -> tuple[float, float]:
    """glibc's heap, MB: (in use, including mmapped blocks; free but kept), or NaNs where
    ``mallinfo2`` is missing (not glibc, or glibc before 2.33)."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return float("nan"), float("nan")
    fn.restype = _Mallinfo2
    info = fn()
    return (info.uordblks + info.hblkhd) / 1e6, info.fordblks / 1e6


def disk_mb(path: Path) -> float:
    return sum(file_sizes(path).values()) / 1e6


def pct(values: Sequence[int], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1] / 1e6  # ms


class Producer:
    def __init__(self) -> None:
        self.rng = random.Random(SEED)
        self.dst = [Address(0, self.rng.randbytes(32)) for _ in range(4096)]
        self.src = {s: [Address(0, account_in(self.rng, s)) for _ in range(64)] for s in SHARDS}
        self.lt = LT0
        self.seqno = dict.fromkeys(SHARDS, 0)
        self.mc = 0

    def diff(self, shard: ShardIdent, size: int) -> tuple[BlockIdShort, QueueDiff, bytes]:
        rng = self.rng
        msgs = [
            Message(
                QueueKey(self.lt + j, rng.randbytes(32)),
                rng.choice(self.src[shard]),
                rng.choice(self.dst),
                rng.randbytes(BODY),
            )
            for j in range(size)
        ]
        self.lt += size
        self.seqno[shard] += 1
        return BlockIdShort(shard, self.seqno[shard]), QueueDiff(msgs, {}), rng.randbytes(32)

    def mc_diff(
        self, processed: dict[ShardIdent, QueueKey]
    ) -> tuple[BlockIdShort, QueueDiff, bytes, DiffStatistics]:
        self.mc += 1
        lt = MC_LT0 + self.mc * 1000
        stats = DiffStatistics(MC, QueueKey.min_for_lt(lt), QueueKey.max_for_lt(lt + 999), {})
        return (
            BlockIdShort(MC, self.mc),
            QueueDiff((), processed),
            self.mc.to_bytes(32, "big"),
            stats,
        )


def run(args: argparse.Namespace, workdir: Path) -> tuple[str, list[Sample]]:
    plan = QUICK if args.quick else FULL
    if args.minutes is not None:
        plan = dataclasses.replace(plan, seconds=args.minutes * 60)
    if args.warmup is not None:
        plan = dataclasses.replace(plan, warmup=args.warmup)
    if args.interval is not None:
        plan = dataclasses.replace(plan, interval=args.interval)
    load_start = os.getloadavg()
    path = workdir / "q"
    config = CONFIG
    if args.block_cache_mib is not None:
        config = dataclasses.replace(CONFIG, block_cache_size=args.block_cache_mib << 20)
    queue = Queue.open(path, config)
    prod = Producer()
    positions: dict[ShardIdent, QueueKey] = {}
    round_msgs = plan.diff_size * len(SHARDS)
    round_s = round_msgs / plan.rate
    samples: list[Sample] = []
    started = time.perf_counter()
    current = Sample(0.0)
    next_sample = plan.interval
    warm_at: float | None = None  # when the warm-up ended
    rounds = 0
    clock = time.perf_counter_ns
    try:
        while True:
            now = time.perf_counter() - started
            if now >= next_sample:
                finish_sample(current, queue, path, now, rounds * round_s - now)
                samples.append(current)
                print(
                    f"t={now:5.0f}s applied {current.applied / plan.interval:,.0f}/s "
                    f"p99 apply {pct(current.apply_ns, 0.99):.1f} ms rss {current.rss_mb:.0f} MB",
                    file=sys.stderr,
                )
                current = Sample(now)
                next_sample += plan.interval
                if warm_at is None and warmed_up(plan, samples[-1]):
                    warm_at = now
                if warm_at is not None and now >= warm_at + plan.seconds:
                    break
            # pace: round k starts at k * round_s
            wait = rounds * round_s - (time.perf_counter() - started)
            if wait > 0:
                time.sleep(wait)
            rounds += 1
            gc.disable()  # Python's cyclic GC off inside a round (on between rounds)
            try:
                for shard in SHARDS:
                    block, diff, digest = prod.diff(shard, plan.diff_size)
                    t0 = clock()
                    assert queue.apply_diff(diff, block, digest)
                    current.apply_ns.append(clock() - t0)
                    current.applied += len(diff.messages)
                mc_block, mc_diff, mc_hash, stats = prod.mc_diff(dict(positions))
                assert queue.apply_diff(mc_diff, mc_block, mc_hash, stats)
                tops = [TopBlock(BlockId(MC, prod.mc), prod.mc)]
                tops += [TopBlock(BlockId(s, prod.seqno[s]), prod.mc) for s in SHARDS]
                assert queue.commit_diff(tops)
                ranges = [
                    QueueShardRange(
                        s,
                        positions[s].next_value() if s in positions else QueueKey.MIN,
                        QueueKey.MAX,
                    )
                    for s in SHARDS
                ]
                t0 = clock()
                with queue.iterator(0, ranges, ShardIdent.BASECHAIN) as it:
                    n = sum(1 for _ in it)
                    positions.update(it.current_position())
                current.read_ns.append(clock() - t0)
                current.read += n
            finally:
                gc.enable()
    finally:
        queue.close()
    assert warm_at is not None
    return render(args, plan, samples, load_start, warm_at), samples


def warmed_up(plan: Plan, sample: Sample) -> bool:
    """Whether the warm-up ends with ``sample``."""
    return sample.t >= plan.warmup


def finish_sample(s: Sample, queue: Queue, path: Path, now: float, ahead: float) -> None:
    s.behind_s = max(0.0, -ahead)
    store: Any = queue._store
    for table in (Table.MESSAGES, Table.STATISTICS, Table.DIFF_TAIL, Table.DIFF_INFO):
        s.l0[table.value] = store.property_int(table, "rocksdb.num-files-at-level0")
        s.sst_mb[table.value] = store.property_int(table, "rocksdb.live-sst-files-size") / 1e6
    s.memtables_mb = (
        sum(store.property_int(t, "rocksdb.cur-size-all-mem-tables") for t in Table) / 1e6
    )
    s.readers_mb = (
        sum(store.property_int(t, "rocksdb.estimate-table-readers-mem") for t in Table) / 1e6
    )
    s.cache_mb = store.property_int(Table.MESSAGES, "rocksdb.block-cache-usage") / 1e6
    s.disk_mb = disk_mb(path)
    s.rss_mb = rss_mb()
    s.malloc_used_mb, s.malloc_free_mb = malloc_mb()
    s.fresh_mb = queue.message_cache_stats().get("bytes", 0) / 1e6
    s.reference_ms = reference_ms()
    s.t = now


def _window(samples: list[Sample], lo: float, hi: float) -> list[Sample]:
    return [s for s in samples if lo <= s.t <= hi]


def render(
    args: argparse.Namespace,
    plan: Plan,
    samples: list[Sample],
    load_start: tuple[float, ...],
    warm_at: float,
) -> str:
    out = ["# imq endurance benchmark: producer-consumer steady state, GC on", ""]
    if args.quick:
        out += [
            f"**Quick run: {plan.seconds:g} s instead of 30 minutes after the warm-up; a "
            f"{plan.warmup:g} s warm-up; the trend comparison covers seconds, not the "
            "issue's 10-minute windows.**",
            "",
        ]
    out += machine_lines(
        " ".join(["python -m benchmarks.bench_endurance", *sys.argv[1:]]), load_start
    )
    out += [
        "",
        f"Target rate {plan.rate:,} messages/s: rounds of {len(SHARDS)} shard diffs of "
        f"{plan.diff_size} messages, an empty masterchain diff and a commit carrying the "
        f"consumer's positions, then one consumer read of the new messages. "
        f"A warm-up of {warm_at:.0f} s, then {plan.seconds:.0f} s of steady state; "
        f"a sample every {plan.interval:.0f} s. Warm-up samples are marked *w*. "
        f"*Reference ms*: the median time of a fixed task that does not touch the queue "
        f"({REFERENCE_RUNS} runs in a child process at the sample), the machine's own "
        "speed at that moment.",
        "",
        "| t s | apply msgs/s | read msgs/s | apply p50 / p99 ms | read p99 ms | behind s | "
        "L0 files msgs/stats/tail/info | SST MB msgs/stats | disk MB | RSS MB | "
        "memtables / block cache / table readers MB | fresh rows MB | "
        "malloc in use / free MB | reference ms |",
        "|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---|---:|---|---:|",
    ]
    for s in samples:
        dur = plan.interval
        out.append(
            f"| {s.t:.0f}{' *w*' if s.t <= warm_at else ''} | "
            f"{s.applied / dur:,.0f} | {s.read / dur:,.0f} | "
            f"{pct(s.apply_ns, 0.5):.2f} / {pct(s.apply_ns, 0.99):.2f} | "
            f"{pct(s.read_ns, 0.99):.2f} | {s.behind_s:.1f} | "
            f"{'/'.join(str(v) for v in s.l0.values())} | "
            f"{s.sst_mb.get('messages', 0):.0f}/{s.sst_mb.get('statistics', 0):.1f} | "
            f"{s.disk_mb:.0f} | {s.rss_mb:.0f} | "
            f"{s.memtables_mb:.0f} / {s.cache_mb:.0f} / {s.readers_mb:.1f} | "
            f"{s.fresh_mb:.1f} | {s.malloc_used_mb:.0f} / {s.malloc_free_mb:.0f} | "
            f"{s.reference_ms:.1f} |"
        )
    steady = [s for s in samples if s.t > warm_at]
    verdict: list[str] = []
    if len(steady) >= 2:
        span = max(1, len(steady) // 3)
        first, last = steady[:span], steady[-span:]

        def mean(xs: list[float]) -> float:
            return statistics.fmean(xs) if xs else float("nan")

        def p99_of(group: list[Sample], read: bool = False) -> float:
            return pct([ns for s in group for ns in (s.read_ns if read else s.apply_ns)], 0.99)

        def verdict_of(a: float, b: float) -> str:
            ok = "PASS" if abs(b / a - 1) <= 0.10 else "FAIL"
            return f"({b / a - 1:+.1%}); target within 10%: {ok}"

        thr_a = mean([s.applied / plan.interval for s in first])
        thr_b = mean([s.applied / plan.interval for s in last])
        p_a, p_b = p99_of(first), p99_of(last)
        r_a, r_b = p99_of(first, read=True), p99_of(last, read=True)
        ref_a = statistics.median(s.reference_ms for s in first)
        ref_b = statistics.median(s.reference_ms for s in last)
        speed = ref_b / ref_a  # > 1: the machine was slower at the end
        ref_lo = min(s.reference_ms for s in steady)
        ref_hi = max(s.reference_ms for s in steady)
        verdict += [
            "",
            f"Trend (first third of the steady samples vs the last third, the warm-up's "
            f"{warm_at:.0f} s excluded; p99 over every call of the window):",
            "",
            f"- apply throughput {thr_a:,.0f} → {thr_b:,.0f} msgs/s {verdict_of(thr_a, thr_b)}",
            f"- apply p99 {p_a:.2f} → {p_b:.2f} ms {verdict_of(p_a, p_b)}",
            f"- consumer read p99 {r_a:.2f} → {r_b:.2f} ms {verdict_of(r_a, r_b)}",
            f"- the machine's reference task {ref_a:.1f} → {ref_b:.1f} ms ({speed - 1:+.1%}, "
            f"median of each window's samples; single steady samples {ref_lo:.1f}-"
            f"{ref_hi:.1f} ms); the p99s divided by it, for information (the target is the "
            f"lines above): apply {p_b / speed / p_a - 1:+.1%}, consumer read "
            f"{r_b / speed / r_a - 1:+.1%}",
            f"- disk {steady[0].disk_mb:.0f} → {steady[-1].disk_mb:.0f} MB, RSS "
            f"{steady[0].rss_mb:.0f} → {steady[-1].rss_mb:.0f} MB (steady samples "
            f"{min(s.rss_mb for s in steady):.0f}-{max(s.rss_mb for s in steady):.0f}; "
            f"malloc in use {steady[0].malloc_used_mb:.0f} → {steady[-1].malloc_used_mb:.0f} "
            f"MB, block cache {steady[0].cache_mb:.0f} → {steady[-1].cache_mb:.0f} MB), "
            f"L0 files of messages max {max(s.l0.get('messages', 0) for s in steady)}",
        ]
    out += verdict
    out += ["", METHOD]
    return "\n".join(out)


METHOD = """## Method

- `QueueConfig()` production defaults: the GC worker collects every 5 s what the commits'
  `processed_to` (the consumer's positions) allow; commits fsync.
- Rounds are paced: round k starts at k * round messages / target rate; "behind" says
  how far the schedule slipped (0 = the queue kept up). Throughput is messages applied
  (read) per sample interval.
- Latencies: each `apply_diff` call, and one consumer read (iterator creation, reading
  every new message, `current_position`).
- L0 files: `rocksdb.num-files-at-level0` of each bulk table; SST size:
  `rocksdb.live-sst-files-size`; disk: every file in the database directory; RSS: VmRSS.
- RocksDB's memory: `rocksdb.cur-size-all-mem-tables` and
  `rocksdb.estimate-table-readers-mem` summed over the six tables, and
  `rocksdb.block-cache-usage` of the one cache they share. Their configured ceilings
  (`QueueConfig()`): 64 MiB memtables, two per bulk table; a 256 MiB block cache
  (`--block-cache-mib` sets another, to watch the RSS once the cache is full).
- The rest of the RSS: the queue's cache of fresh rows (`message_cache_stats()`, bytes;
  64 MiB at most), and glibc's `mallinfo2()`: the bytes every allocation of the process
  holds (Python's and RocksDB's, mmapped blocks included) and the free bytes the heap
  keeps rather than returning them to the system.
- Python's cyclic GC is off inside a round and runs between rounds.
- Reference task: at every sample, a fixed piece of work that does not touch the queue
  (5,000 small tuples built and sorted, their 1 MB joined and hashed with BLAKE2b), run
  5 times in a child process (no interpreter lock or heap shared with the queue); the
  median says how fast the machine was then, and each p99 trend is also given divided by
  the reference's change between the same windows. For information only: the target is
  the trend as measured, and the reference moves by up to half from one sample to the
  next on this shared VM (its window medians by 7-16% in the runs of 2026-12-04), which
  is as much as the drifts it would correct.
"""


def write_plot(samples: list[Sample], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib not installed"
    if not samples:
        return "plot skipped: no samples"
    t = [s.t / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    ax = axes[0][0]
    dur = (samples[1].t - samples[0].t) if len(samples) > 1 else samples[0].t
    ax.plot(t, [s.applied / dur for s in samples], marker="o", label="apply")
    ax.plot(t, [s.read / dur for s in samples], marker="x", label="read")
    ax.set_ylabel("messages/s")
    ax.legend()
    ax = axes[0][1]
    ax.plot(t, [pct(s.apply_ns, 0.99) for s in samples], marker="o", label="apply_diff p99")
    ax.plot(t, [pct(s.read_ns, 0.99) for s in samples], marker="x", label="consumer read p99")
    ax.plot(t, [s.reference_ms / 4 for s in samples], linestyle=":", label="reference task / 4")
    ax.set_ylabel("ms")
    ax.legend()
    ax = axes[1][0]
    for name in ("messages", "statistics", "diff_tail", "diff_info"):
        ax.plot(t, [s.l0.get(name, 0) for s in samples], marker=".", label=f"L0 {name}")
    ax.set_ylabel("L0 files")
    ax.set_xlabel("minutes")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    ax.plot(t, [s.disk_mb for s in samples], marker="o", label="disk MB")
    ax.plot(t, [s.rss_mb for s in samples], marker="x", label="RSS MB")
    ax.set_xlabel("minutes")
    ax.legend()
    fig.suptitle("imq endurance: 4 shards, GC on")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path.name}"


def main(argv: Sequence[str] | None = None) -> int:
    def own(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--minutes", type=float, default=None, help="measured minutes (default 30; 2 quick)"
        )
        parser.add_argument(
            "--warmup",
            type=float,
            default=None,
            help="warm-up seconds (default 600; 20 quick)",
        )
        parser.add_argument(
            "--interval",
            type=float,
            default=None,
            help="seconds between two samples (default 60; 10 quick)",
        )
        parser.add_argument(
            "--block-cache-mib",
            type=int,
            default=None,
            help="the queue's block cache in MiB (default: the benchmark's config), to watch "
            "the RSS once the cache is full",
        )

    args = parse_args(argv, "endurance", "producer-consumer steady state", "unused", extra=own)
    quiet_logs()
    with temp_workdir(args, "endurance") as work:
        text, samples = run(args, work)
        note = write_plot(samples, args.out.with_suffix(".png"))
        write_report(args.out, text + f"\n\n{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
