"""GC pause benchmark: how long a shard's ``apply_diff`` waits while a GC pass deletes that
shard's backlog, for several ``QueueConfig.gc_batch_diffs``.

A GC pass deletes a source shard's diffs under that shard's mutex, which the shard's
apply, commit and clear also take; a backlog is deleted in batches of at most
``gc_batch_diffs`` diffs, the mutex released between them. This benchmark measures what
a collator feels: a backlog of ``DIFFS`` diffs of ``DIFF_SIZE`` messages on each of four
source shards (committed, every message collectable) is built once; then, per setting
and repeat, on a fresh copy of it, a thread applies a one-message diff to the first shard
every ``APPLY_GAP`` seconds (uncommitted, above the commit pointer, as a collator's next
block), and after a lead-in the main thread runs one GC pass (``Queue.run_gc_report``)
that deletes all four backlogs; the applier goes on for a short tail. The reference is
the same applier on a copy with no pass (the apply's own latency). Each latency is one
``apply_diff`` call's wall time; the diff is built before the clock starts.

From the repo root::

    python -m benchmarks.bench_gc_pause                       # full run, about 4 minutes
    python -m benchmarks.bench_gc_pause --quick --out X.md    # smoke run, seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import statistics
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter, sleep

from benchmarks.bench_core import machine_lines, percentile
from benchmarks.common import account_in, parse_args, quiet_logs, temp_workdir, write_report
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
    ShardIdent,
    TopBlock,
)
from imq.storage import Table

SEED = 20_261_206
SHARDS = tuple(ShardIdent(0, (2 * i + 1) << 61) for i in range(4))
MC = ShardIdent.MASTERCHAIN
LT0 = 1_000_000
MC_LT = 1 << 44
BODY = 100
DESTINATIONS = 256
APPLY_GAP = 0.002  # seconds between two applies of the applier thread
LEAD = 0.3  # seconds the applier runs before the pass starts, and after it ends
ALONE = 2.0  # seconds of the reference run (no pass)
ONE_BATCH = 1 << 40  # a gc_batch_diffs no backlog reaches: the whole backlog in one batch


@dataclass(frozen=True, slots=True)
class Sizes:
    diffs: int  # per source shard
    diff_size: int  # messages per diff
    settings: tuple[int, ...]  # gc_batch_diffs values measured (ONE_BATCH: one batch)
    repeats: int  # passes per setting, each on a fresh copy


FULL = Sizes(diffs=62_500, diff_size=4, settings=(1_000, 10_000, ONE_BATCH), repeats=3)
QUICK = Sizes(diffs=300, diff_size=4, settings=(10, ONE_BATCH), repeats=1)
DEFAULT_BATCH = QueueConfig().gc_batch_diffs


def _label(setting: int) -> str:
    if setting == ONE_BATCH:
        return "one batch per shard"
    default = " (default)" if setting == DEFAULT_BATCH else ""
    return f"gc_batch_diffs={setting:,}{default}"


# ---------------------------------------------------------------------------------------------
# The backlog


def build(path: Path, sizes: Sizes) -> tuple[float, int]:
    """Apply ``sizes.diffs`` diffs to each shard round-robin, every one carrying
    ``processed_to`` past the last message of every shard, then one commit on a
    masterchain block whose top blocks are each shard's last diff: the whole backlog is
    committed and collectable. Flush, close; return (seconds, the last lt written)."""
    started = perf_counter()
    rng = random.Random(SEED)
    dst = [Address(0, rng.randbytes(32)) for _ in range(DESTINATIONS)]
    src = {s: [Address(0, account_in(rng, s)) for _ in range(64)] for s in SHARDS}
    bodies = [rng.randbytes(BODY) for _ in range(256)]
    last_lt = LT0 + sizes.diffs * len(SHARDS) * sizes.diff_size - 1
    processed = {s: QueueKey.max_for_lt(last_lt) for s in SHARDS}
    lt = LT0
    config = QueueConfig(gc_enabled=False)
    with Queue.open(path, config) as queue:
        for seqno in range(1, sizes.diffs + 1):
            for shard in SHARDS:
                messages = [
                    Message(
                        QueueKey(lt + j, rng.randbytes(32)),
                        src[shard][j & 63],
                        dst[rng.randrange(DESTINATIONS)],
                        bodies[(lt + j) & 255],
                    )
                    for j in range(sizes.diff_size)
                ]
                lt += sizes.diff_size
                diff = QueueDiff(messages, processed)
                assert queue.apply_diff(diff, BlockIdShort(shard, seqno), rng.randbytes(32))
        stats = DiffStatistics(MC, QueueKey.min_for_lt(MC_LT), QueueKey.max_for_lt(MC_LT), {})
        assert queue.apply_diff(
            QueueDiff((), processed), BlockIdShort(MC, 1), bytes(31) + b"\1", stats
        )
        tops = [TopBlock(BlockId(MC, 1), 1)]
        tops += [TopBlock(BlockId(s, sizes.diffs), 1) for s in SHARDS]
        assert queue.commit_diff(tops)
        queue._store.flush(list(Table))
    return perf_counter() - started, lt - 1


# ---------------------------------------------------------------------------------------------
# Measuring


class Applier(threading.Thread):
    """Applies a one-message diff to ``SHARDS[0]`` every ``APPLY_GAP`` seconds until
    stopped; records each call's start and duration."""

    def __init__(self, queue: Queue, sizes: Sizes, first_lt: int) -> None:
        super().__init__(name="applier", daemon=True)
        self.queue = queue
        self.seqno = sizes.diffs  # the shard's last stored diff
        self.lt = first_lt
        self.rng = random.Random(SEED + 1)
        self.calls: list[tuple[float, float]] = []  # (start, seconds)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.src = Address(0, account_in(self.rng, SHARDS[0]))
        self.dst = Address(0, self.rng.randbytes(32))

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.seqno += 1
                self.lt += 1
                msg = Message(QueueKey(self.lt, self.rng.randbytes(32)), self.src, self.dst, b"x")
                diff, block = QueueDiff([msg]), BlockIdShort(SHARDS[0], self.seqno)
                diff_hash = self.rng.randbytes(32)
                started = perf_counter()
                assert self.queue.apply_diff(diff, block, diff_hash)
                self.calls.append((started, perf_counter() - started))
                sleep(APPLY_GAP)
        except BaseException as exc:  # reported by the main thread
            self.error = exc


@dataclass
class PassRun:
    seconds: float
    messages: int
    waits: list[float]  # latencies of the applies that started during the pass


@dataclass
class SettingResult:
    setting: int
    runs: list[PassRun] = field(default_factory=list)

    @property
    def waits(self) -> list[float]:
        return sorted(w for r in self.runs for w in r.waits)


def measure(base: Path, work: Path, sizes: Sizes, last_lt: int, setting: int | None) -> PassRun:
    """On a fresh copy of ``base``: the applier, and (unless ``setting`` is None) one GC
    pass with ``gc_batch_diffs=setting`` after ``LEAD`` seconds."""
    shutil.copytree(base, work)
    try:
        config = QueueConfig(gc_enabled=False, gc_batch_diffs=setting or DEFAULT_BATCH)
        with Queue.open(work, config) as queue:
            applier = Applier(queue, sizes, last_lt + 1_000_000)
            gc.collect()
            applier.start()
            sleep(LEAD)
            started = perf_counter()
            if setting is None:
                sleep(ALONE)
                messages = 0
            else:
                report = queue.run_gc_report()
                messages = report.messages
                assert report.failed == 0
            ended = perf_counter()
            sleep(LEAD)
            applier.stop.set()
            applier.join()
            if applier.error is not None:
                raise applier.error
        waits = [s for t, s in applier.calls if started <= t < ended]
        return PassRun(ended - started, messages, waits)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Report


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def render(
    sizes: Sizes,
    *,
    quick: bool,
    command: str,
    load: tuple[float, ...],
    build_seconds: float,
    alone: PassRun,
    results: list[SettingResult],
) -> str:
    total = sizes.diffs * len(SHARDS)
    lines = [
        "# imq GC pause benchmark: an apply beside a GC pass of a backlog",
        "",
        *machine_lines(command, load),
    ]
    if quick:
        lines += ["- **quick run: smoke sizes, the numbers mean nothing**"]
    lines += [
        "",
        f"Backlog: {sizes.diffs:,} diffs of {sizes.diff_size} messages ({BODY}-byte bodies) "
        f"on each of {len(SHARDS)} source shards, {total * sizes.diff_size:,} messages in all, "
        f"committed and collectable (built in {build_seconds:.1f} s, flushed, closed). Per "
        f"setting, {sizes.repeats} run(s), each on a fresh copy: a thread applies a "
        f"one-message diff to the first shard every {APPLY_GAP * 1e3:g} ms; after "
        f"{LEAD:g} s one GC pass deletes the four backlogs. *Applies during the pass*: those "
        "that started while it ran (pooled over the runs); each latency is one `apply_diff` "
        "call's wall time. Background GC worker off; production settings otherwise.",
        "",
        "| setting | pass s (median) | messages deleted | applies during the pass | "
        "apply median ms | p99 ms | max ms | max per run ms |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    ref = sorted(alone.waits)
    lines.append(
        f"| no pass (the applier alone, {ALONE:g} s) | — | — | {len(ref):,} | "
        f"{_ms(statistics.median(ref))} | {_ms(percentile(ref, 99))} | {_ms(ref[-1])} | — |"
    )
    for r in results:
        waits = r.waits
        per_run = ", ".join(_ms(max(run.waits)) if run.waits else "—" for run in r.runs)
        lines.append(
            f"| {_label(r.setting)} | {statistics.median(x.seconds for x in r.runs):.2f} | "
            f"{r.runs[0].messages:,} | {len(waits):,} | "
            + (
                f"{_ms(statistics.median(waits))} | {_ms(percentile(waits, 99))} | "
                f"{_ms(waits[-1])} | {per_run} |"
                if waits
                else "— | — | — | — |"
            )
        )
    lines += [
        "",
        "A batch deletes its share of a shard's backlog as one write under the shard's "
        "mutex (and the queue's read lock, which commits and clears wait for); an apply of "
        "that shard waits for the batch under way. Smaller batches shorten the wait and add a "
        "little to the pass (one more seek and write a batch, and a flush of the "
        "range-deleted tables every 256 batches). No raw floor: rocksdict has no mutex of "
        "its own; the reference is the same applier with no pass.",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace, workdir: Path) -> str:
    sizes = QUICK if args.quick else FULL
    if args.repeats is not None:
        sizes = Sizes(sizes.diffs, sizes.diff_size, sizes.settings, args.repeats)
    command = " ".join(["python -m benchmarks.bench_gc_pause", *sys.argv[1:]])
    load = os.getloadavg()
    base = workdir / "base"
    print(f"build {sizes.diffs:,} diffs x {len(SHARDS)} shards ...", flush=True)
    build_seconds, last_lt = build(base, sizes)
    print("the applier alone ...", flush=True)
    alone = measure(base, workdir / "alone", sizes, last_lt, None)
    results = [SettingResult(s) for s in sizes.settings]
    for repeat in range(sizes.repeats):
        for result in results:  # round-robin: drift in the machine's load hits each alike
            one = measure(base, workdir / "work", sizes, last_lt, result.setting)
            result.runs.append(one)
            longest = _ms(max(one.waits)) if one.waits else "—"
            print(
                f"  run {repeat + 1}, {_label(result.setting)}: pass {one.seconds:.2f} s, "
                f"{len(one.waits)} applies during it, longest {longest} ms",
                flush=True,
            )
    return render(
        sizes,
        quick=args.quick,
        command=command,
        load=load,
        build_seconds=build_seconds,
        alone=alone,
        results=results,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(
        argv,
        "gc_pause",
        __doc__.split("\n")[0],
        "passes per setting (default 3; 1 with --quick)",
    )
    quiet_logs()
    with temp_workdir(args, "bench-gc-pause") as workdir:
        text = run(args, workdir)
    write_report(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
