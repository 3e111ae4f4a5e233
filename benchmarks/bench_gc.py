"""GC benchmark: reads of a live head after millions of collected messages, and the GC pass
itself against raw rocksdict doing the same deletes and compactions, in one run.

One *lagging* source shard keeps 10,000 live messages (nobody has read them, so every
commit's GC bound for it stays below its first message) while three *producer* shards
write and collect 10^3, 10^4, 10^5 and 10^6 messages. For each size:

* one GC pass (``Queue.run_gc``, worker off) that collects every producer message, against
  the same range deletes + ``compact_range`` with raw rocksdict on a copy of the same
  database (imq's own table options);
* after it: iterator creation + first message, a full read of the live head,
  ``get_diffs_tail_len``, and disk usage against a fresh database holding only the live
  messages.

It writes the tables and a log-log plot to ``benchmarks/results/gc.md`` and ``gc.png``.
Method notes: ``benchmarks/README.md``. From the repo root::

    python -m benchmarks.bench_gc                       # full run, a few minutes
    python -m benchmarks.bench_gc --quick --out X.md    # smoke run, seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from time import perf_counter, perf_counter_ns
from typing import Any

from rocksdict import CompactOptions, ReadOptions, WriteBatch

from benchmarks.bench_core import machine_lines, percentile
from benchmarks.common import (
    RawDb,
    account_in,
    count_label,
    file_sizes,
    parse_args,
    quiet_logs,
    write_report,
)
from imq import (
    Address,
    BlockId,
    BlockIdShort,
    Message,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    TopBlock,
)
from imq.storage import Table, codec

# ---------------------------------------------------------------------------------------------
# Sizes, seeds, the workload's shape

SEED = 20_240_603
LAGGING = ShardIdent(0, 0x2000_0000_0000_0000)  # its messages stay live
PRODUCERS = (  # their messages are collected
    ShardIdent(0, 0x6000_0000_0000_0000),
    ShardIdent(0, 0xA000_0000_0000_0000),
    ShardIdent(0, 0xE000_0000_0000_0000),
)
SOURCES = (LAGGING, *PRODUCERS)
MC = ShardIdent.MASTERCHAIN
LAG_DIFFS = 10  # the lagging shard's diffs ...
LAG_DIFF_SIZE = 1_000  # ... of this many messages: 10,000 live messages
PRODUCER_DIFF_SIZE = 100  # messages per producer diff (so 10,000 diffs at 10^6)
BODY_SIZE = 200  # bytes per message body
DST_ACCOUNTS = 4096  # destination pool over the basechain
LAG_LT = 1_000_000  # the lagging shard's messages come first ...
PRODUCER_LT = 2_000_000  # ... the producers' after them
PARTITIONS = (0, 1)  # commit_diff's default: GC runs per (partition, shard)
BELOW_LAGGING = QueueKey.max_for_lt(LAG_LT - 1)  # every reader's position in the lagging shard

# Production settings except the background worker: GC runs only through run_gc.
CONFIG = QueueConfig(gc_enabled=False)
# The same, compacting the deleted ranges after every pass (space back at once).
EAGER = replace(CONFIG, compact_after_delete=True)


@dataclass(frozen=True, slots=True)
class Sizes:
    collected: tuple[int, ...]  # producer messages written and collected, per database
    gc_repeats: int  # GC passes per size and variant (each on a fresh copy)
    calls: int  # timed calls per point read and size
    full_reads: int  # timed full reads per size
    rounds: int  # the calls are split into rounds that alternate between the databases
    warmup: int  # untimed calls per operation and database before the first round


FULL = Sizes(
    collected=(1_000, 10_000, 100_000, 1_000_000),
    gc_repeats=3,
    calls=1000,
    full_reads=15,
    rounds=5,
    warmup=50,
)
QUICK = Sizes(collected=(1_000, 10_000), gc_repeats=1, calls=60, full_reads=3, rounds=2, warmup=5)

READ_TARGET = 1.5  # a read at the largest size within 1.5x of the smallest
GC_TARGET_SECONDS = 1.0  # a pass collecting 10^6 messages
GC_TARGET_SIZE = 1_000_000
DISK_TARGET = 1.2  # disk after collection within 1.2x of a fresh database


# ---------------------------------------------------------------------------------------------
# Workload


@dataclass(frozen=True, slots=True)
class DiffInput:
    block: BlockIdShort
    diff: QueueDiff
    hash: bytes


class Workload:
    """Deterministic diffs for one size. Every diff's ``processed_to`` says what the final
    commit needs: the lagging shard read below its first message, every producer read up to
    the last producer message of this size (so its whole history is collectable)."""

    def __init__(self, seed: int, collected: int) -> None:
        self.rng = random.Random(seed)
        self.dst = [Address(0, self.rng.randbytes(32)) for _ in range(DST_ACCOUNTS)]
        self.src = {s: [Address(0, account_in(self.rng, s)) for _ in range(64)] for s in SOURCES}
        self.collected = collected
        last_lt = PRODUCER_LT + collected - 1
        self.processed_to = {LAGGING: BELOW_LAGGING}
        self.processed_to.update({p: QueueKey.max_for_lt(last_lt) for p in PRODUCERS})

    def _diff(self, shard: ShardIdent, seqno: int, lt: int, size: int) -> DiffInput:
        rng, src, dst = self.rng, self.src[shard], self.dst
        messages = [
            Message(
                QueueKey(lt + j, rng.randbytes(32)),
                rng.choice(src),
                rng.choice(dst),
                rng.randbytes(BODY_SIZE),
            )
            for j in range(size)
        ]
        diff = QueueDiff(messages, self.processed_to)
        return DiffInput(BlockIdShort(shard, seqno), diff, rng.randbytes(32))

    def lagging(self) -> Iterator[DiffInput]:
        for i in range(LAG_DIFFS):
            yield self._diff(LAGGING, i + 1, LAG_LT + i * LAG_DIFF_SIZE, LAG_DIFF_SIZE)

    def producers(self) -> Iterator[DiffInput]:
        """Round-robin over the producers; returns (via ``last_seqnos``) each one's last."""
        self.last_seqnos: dict[ShardIdent, int] = {}
        lt, i = PRODUCER_LT, 0
        while lt < PRODUCER_LT + self.collected:
            shard = PRODUCERS[i % len(PRODUCERS)]
            size = min(PRODUCER_DIFF_SIZE, PRODUCER_LT + self.collected - lt)
            seqno = i // len(PRODUCERS) + 1
            self.last_seqnos[shard] = seqno
            yield self._diff(shard, seqno, lt, size)
            lt += size
            i += 1

    def commit_tops(self) -> tuple[DiffInput, list[TopBlock]]:
        """The empty masterchain diff to apply, and the one commit's top blocks."""
        mc = DiffInput(BlockIdShort(MC, 1), QueueDiff((), self.processed_to), bytes(31) + b"\1")
        tops = [TopBlock(BlockId(MC, 1), 1), TopBlock(BlockId(LAGGING, LAG_DIFFS), 1)]
        tops += [TopBlock(BlockId(s, n), 1) for s, n in self.last_seqnos.items()]
        return mc, tops


def build(path: Path, collected: int, *, live_only: bool = False) -> float:
    """Apply the lagging diffs, then (unless ``live_only``) the producers' diffs and one
    commit; flush every table and close. Seconds taken."""
    started = perf_counter()
    work = Workload(SEED, collected)
    with Queue.open(path, CONFIG) as queue:
        for d in work.lagging():
            assert queue.apply_diff(d.diff, d.block, d.hash)
        if not live_only:
            for d in work.producers():
                assert queue.apply_diff(d.diff, d.block, d.hash)
            mc, tops = work.commit_tops()
            assert queue.apply_diff(mc.diff, mc.block, mc.hash)
            assert queue.commit_diff(tops)
        queue._store.flush(list(Table))
    return perf_counter() - started


@dataclass(frozen=True, slots=True)
class Task:
    """What one GC pass deletes for a source shard (the commit's bound for it)."""

    shard: ShardIdent
    bound: QueueKey


def gc_tasks(collected: int) -> list[Task]:
    work = Workload(SEED, collected)
    return sorted(
        (Task(s, work.processed_to[s]) for s in SOURCES), key=lambda t: codec.shard_bytes(t.shard)
    )


# ---------------------------------------------------------------------------------------------
# The raw floor: the same deletes and compactions with bare rocksdict


Range = tuple[Table, bytes, bytes]


def raw_stage(db: RawDb, task: Task) -> tuple[Any, list[Range]]:
    """The batch and compaction ranges imq's GC builds for ``task``: a key scan of the
    shard's diff tails up to the bound, a point delete of each found diff's info row, and
    range deletes of the tails and of every partition's messages and statistics."""
    batch = WriteBatch(raw_mode=True)
    ranges: list[Range] = []
    lo, hi = codec.tail_range_inclusive(task.shard, QueueKey.MIN, task.bound)
    ro = ReadOptions()
    ro.set_iterate_upper_bound(hi)
    found = 0
    for tail in db.cf[Table.DIFF_TAIL].keys(from_key=lo, read_opt=ro):
        seqno = codec.decode_tail_key(tail)[1]
        batch.delete(codec.diff_info_key(task.shard, seqno), db.handle[Table.DIFF_INFO])
        found += 1
    if found:
        batch.delete_range(lo, hi, db.handle[Table.DIFF_TAIL])
        ranges.append((Table.DIFF_TAIL, lo, hi))
    for p in PARTITIONS:
        for table, (a, b) in (
            (Table.MESSAGES, codec.message_delete_range(p, task.shard, QueueKey.MIN, task.bound)),
            (Table.STATISTICS, codec.stat_delete_range(task.shard, p, QueueKey.MIN, task.bound)),
        ):
            batch.delete_range(a, b, db.handle[table])
            ranges.append((table, a, b))
    del ro
    return batch, ranges


def raw_gc_floor(db: RawDb, tasks: Sequence[Task]) -> None:
    """Every task's deletes written first, then ``compact_range`` of each deleted range."""
    ranges: list[Range] = []
    for task in tasks:
        batch, task_ranges = raw_stage(db, task)
        db.db.write(batch)
        ranges += task_ranges
    opts = CompactOptions()
    for table, lo, hi in ranges:
        db.cf[table].compact_range(lo, hi, opts)


def raw_gc_task_order(db: RawDb, tasks: Sequence[Task]) -> None:
    """imq's order: per task, write its deletes, then compact its ranges."""
    opts = CompactOptions()
    for task in tasks:
        batch, ranges = raw_stage(db, task)
        db.db.write(batch)
        for table, lo, hi in ranges:
            db.cf[table].compact_range(lo, hi, opts)


# ---------------------------------------------------------------------------------------------
# Measuring


@dataclass
class GcRun:
    seconds: float
    compact_seconds: float = 0.0  # inside Store.compact
    write_seconds: float = 0.0  # inside Store.write (delete batches and executed marks)


@dataclass
class Disk:
    sst: int
    blob: int
    wal: int
    total: int  # every file in the directory (also the info LOG, MANIFEST, OPTIONS)
    per_table: dict[str, int] = field(default_factory=dict)  # live SST bytes per table

    @property
    def data(self) -> int:
        return self.sst + self.blob + self.wal


def disk_usage(path: Path, queue: Queue | None = None) -> Disk:
    size = file_sizes(path)
    per_table = {}
    if queue is not None:
        for t in Table:
            per_table[t.value] = queue._store.property_int(t, "rocksdb.live-sst-files-size")
    return Disk(
        sst=sum(n for f, n in size.items() if f.suffix == ".sst"),
        blob=sum(n for f, n in size.items() if f.suffix == ".blob"),
        wal=sum(n for f, n in size.items() if f.suffix == ".log"),
        total=sum(size.values()),
        per_table=per_table,
    )


def _instrumented_gc(queue: Queue) -> GcRun:
    """``run_gc`` timed, with the time inside ``Store.compact`` and ``Store.write`` summed
    by thin wrappers (instance attributes, removed afterwards)."""
    store = queue._store
    run = GcRun(0.0)
    compact, write = store.compact, store.write

    def timed_compact(ranges: Any) -> None:
        started = perf_counter()
        try:
            compact(ranges)
        finally:
            run.compact_seconds += perf_counter() - started

    def timed_write(txn: Any, **kwargs: Any) -> None:
        started = perf_counter()
        try:
            write(txn, **kwargs)
        finally:
            run.write_seconds += perf_counter() - started

    store.compact = timed_compact  # type: ignore[method-assign]
    store.write = timed_write  # type: ignore[method-assign]
    try:
        gc.collect()
        started = perf_counter()
        executed = queue.run_gc()
        run.seconds = perf_counter() - started
    finally:
        del store.compact, store.write
    assert executed == len(SOURCES) * len(PARTITIONS), executed
    return run


def _raw_timed(path: Path, fn: Callable[[RawDb, Sequence[Task]], None], tasks: list[Task]) -> float:
    db = RawDb(path, CONFIG)
    try:
        gc.collect()
        started = perf_counter()
        fn(db, tasks)
        return perf_counter() - started
    finally:
        db.close()


@dataclass
class SizeResult:
    collected: int
    build_seconds: float
    base_disk: Disk  # before GC
    imq: list[GcRun] = field(default_factory=list)
    eager: list[GcRun] = field(default_factory=list)  # compact_after_delete=True
    raw_floor: list[float] = field(default_factory=list)
    raw_task_order: list[float] = field(default_factory=list)
    disk: Disk | None = None  # after GC and a flush
    eager_disk: Disk | None = None  # the same with compact_after_delete=True
    kept: Path | None = None  # the collected database, kept for the reads

    @property
    def label(self) -> str:
        return count_label(self.collected)


def _gc_on_copy(
    base: Path, work: Path, config: QueueConfig, *, measure_disk: bool
) -> tuple[GcRun, Disk | None]:
    """One timed GC pass on a fresh copy of ``base`` at ``work``; then, if asked, the
    disk usage after a flush of every table."""
    shutil.copytree(base, work)
    queue = Queue.open(work, config)
    try:
        timing = _instrumented_gc(queue)
        if not measure_disk:
            return timing, None
        queue._store.flush(list(Table))
        return timing, disk_usage(work, queue)
    finally:
        queue.close()


def bench_size(collected: int, workdir: Path, sizes: Sizes) -> SizeResult:
    """Build once, then each GC variant on fresh copies of the built database."""
    base = workdir / f"base-{collected}"
    print(f"  build {collected:,} collected + {LAG_DIFFS * LAG_DIFF_SIZE:,} live ...", flush=True)
    result = SizeResult(collected, build(base, collected), disk_usage(base))
    tasks = gc_tasks(collected)
    for run in range(sizes.gc_repeats):
        work = workdir / f"imq-{collected}-{run}"
        timing, disk = _gc_on_copy(base, work, CONFIG, measure_disk=run == 0)
        result.imq.append(timing)
        if run == 0:
            result.disk, result.kept = disk, work
        else:
            shutil.rmtree(work)
        work = workdir / f"eager-{collected}-{run}"
        timing, disk = _gc_on_copy(base, work, EAGER, measure_disk=run == 0)
        result.eager.append(timing)
        result.eager_disk = result.eager_disk or disk
        shutil.rmtree(work)
        for name, fn, out in (
            ("floor", raw_gc_floor, result.raw_floor),
            ("order", raw_gc_task_order, result.raw_task_order),
        ):
            work = workdir / f"raw-{name}-{collected}-{run}"
            shutil.copytree(base, work)
            out.append(_raw_timed(work, fn, tasks))
            shutil.rmtree(work)
        print(
            f"    pass {run + 1}: imq {result.imq[-1].seconds:.3f} s, with compact_after_delete "
            f"{result.eager[-1].seconds:.3f} s, raw floor "
            f"{result.raw_floor[-1]:.3f} s, raw in imq's order {result.raw_task_order[-1]:.3f} s",
            flush=True,
        )
    shutil.rmtree(base)
    return result


# -- reads ------------------------------------------------------------------------------------

RANGES = [QueueShardRange(s, QueueKey.MIN, QueueKey.MAX) for s in SOURCES]
LIVE = LAG_DIFFS * LAG_DIFF_SIZE


def _first_message(queue: Queue) -> Any:
    it = queue.iterator(0, RANGES, ShardIdent.BASECHAIN)
    try:
        return next(it).source
    finally:
        it.close()


def _full_read(queue: Queue) -> int:
    with queue.iterator(0, RANGES, ShardIdent.BASECHAIN) as it:
        return sum(1 for _ in it)


# name -> (kind of call: "point" or "full", the call, its expected result)
READS: dict[str, tuple[str, Callable[[Queue], Any], Any]] = {
    "iterator creation + first message (4 source ranges, MIN..MAX)": (
        "point",
        _first_message,
        LAGGING,
    ),
    "full read of the live head (4 source ranges, 10,000 messages)": ("full", _full_read, LIVE),
    "get_diffs_tail_len(lagging shard, MIN)": (
        "point",
        lambda q: q.get_diffs_tail_len(LAGGING, QueueKey.MIN),
        LAG_DIFFS,
    ),
    "get_diffs_tail_len(collected producer shard, MIN)": (
        "point",
        lambda q: q.get_diffs_tail_len(PRODUCERS[0], QueueKey.MIN),
        0,
    ),
}
EXTRA_READS: dict[str, tuple[str, Callable[[Queue], Any], Any]] = {
    "get_last_applied_seqno(collected producer shard) (extra)": (
        "point",
        lambda q: q.get_last_applied_seqno(PRODUCERS[0]),
        None,
    ),
}
# The extra read is not in the list: it shows the diff-info rows that GC deletes
# with point deletes and never compacts (a reverse seek walks over their tombstones).


def _time_calls(fn: Callable[[Queue], Any], queue: Queue, n: int, expected: Any) -> list[int]:
    gc.collect()
    clock = perf_counter_ns
    samples = []
    for _ in range(n):
        started = clock()
        result = fn(queue)
        samples.append(clock() - started)
        assert result == expected, (result, expected)
    return samples


def bench_reads(dbs: dict[str, Path], sizes: Sizes) -> dict[str, dict[str, list[int]]]:
    """Open every collected database and the fresh one; warm up, then ``sizes.rounds``
    rounds that alternate between them, so drift in machine load hits every size alike."""
    reads = {**READS, **EXTRA_READS}
    queues = {label: Queue.open(path, CONFIG) for label, path in dbs.items()}
    samples: dict[str, dict[str, list[int]]] = {name: {k: [] for k in dbs} for name in reads}
    try:
        for queue in queues.values():
            for _kind, fn, expected in reads.values():
                _time_calls(fn, queue, sizes.warmup if _kind == "point" else 1, expected)
        for _ in range(sizes.rounds):
            for label, queue in queues.items():
                for name, (kind, fn, expected) in reads.items():
                    total = sizes.calls if kind == "point" else sizes.full_reads
                    n = max(1, total // sizes.rounds)
                    samples[name][label] += _time_calls(fn, queue, n, expected)
    finally:
        for queue in queues.values():
            queue.close()
    return samples


# ---------------------------------------------------------------------------------------------
# Report


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


@dataclass
class Report:
    sizes: Sizes
    quick: bool
    command: str
    load_start: tuple[float, ...]
    results: list[SizeResult] = field(default_factory=list)
    fresh_build_seconds: float = 0.0
    fresh_disk: Disk | None = None
    reads: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    plot_note: str = ""

    def gc_table(self) -> tuple[list[str], list[bool]]:
        lines = [
            "| messages collected | build s | imq run_gc median s | min..max s "
            "| of which compaction s | of which writes s | raw floor s | imq ÷ floor "
            "| raw in imq's order s | with compact_after_delete s | ÷ floor | target | result |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        verdicts = []
        for r in self.results:
            imq = [run.seconds for run in r.imq]
            med = statistics.median(imq)
            floor = statistics.median(r.raw_floor)
            cells = [f"{r.collected:,}", f"{r.build_seconds:.1f}", f"{med:.3f}"]
            cells.append(f"{min(imq):.3f}..{max(imq):.3f}")
            cells.append(f"{statistics.median(run.compact_seconds for run in r.imq):.3f}")
            cells.append(f"{statistics.median(run.write_seconds for run in r.imq):.4f}")
            cells += [f"{floor:.3f}", f"{med / floor:.2f}"]
            cells.append(f"{statistics.median(r.raw_task_order):.3f}")
            eager = statistics.median(run.seconds for run in r.eager)
            cells += [f"{eager:.3f}", f"{eager / floor:.2f}"]
            if r.collected == GC_TARGET_SIZE:
                ok = med < GC_TARGET_SECONDS
                verdicts.append(ok)
                cells += [f"< {GC_TARGET_SECONDS:g} s", "PASS" if ok else "FAIL"]
            else:
                cells += ["—", "info"]
            lines.append("| " + " | ".join(cells) + " |")
        return lines, verdicts

    def read_table(self) -> tuple[list[str], list[bool]]:
        small, large = self.results[0].label, self.results[-1].label
        lines = [
            "| read | database | calls | median µs | p99 µs | ratio to "
            f"{small} | target ({large} ÷ {small}) | result |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
        verdicts = []
        for name, per_db in self.reads.items():
            base = statistics.median(per_db[small])
            extra = name.endswith("(extra)")
            for label, values in per_db.items():
                med = statistics.median(values)
                cells = [name, label, str(len(values)), f"{med / 1e3:.1f}"]
                cells += [f"{percentile(values, 99) / 1e3:.1f}", f"{med / base:.2f}"]
                if label == large:
                    ok = med / base <= READ_TARGET
                    if not extra:
                        verdicts.append(ok)
                    verdict = ("PASS" if ok else "FAIL") + (" (extra)" if extra else "")
                    cells += [f"≤ {READ_TARGET}", verdict]
                else:
                    cells += ["", ""]
                lines.append("| " + " | ".join(cells) + " |")
        return lines, verdicts

    def disk_table(self) -> tuple[list[str], list[bool]]:
        fresh = self.fresh_disk
        assert fresh is not None
        lines = [
            "| database | SST MB | blob MB | WAL MB | data (SST+blob+WAL) MB | ÷ fresh "
            "| whole directory MB | ÷ fresh | target (data) | result |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            f"| fresh: only the {LIVE:,} live messages | {_mb(fresh.sst)} | {_mb(fresh.blob)} "
            f"| {_mb(fresh.wal)} | {_mb(fresh.data)} | 1.00 | {_mb(fresh.total)} | 1.00 | | |",
        ]
        verdicts = []
        debt = CONFIG.compaction_debt
        for r in self.results:
            for label, d, judged in (
                ("after GC", r.disk, r.collected >= debt),
                ("after GC with compact_after_delete", r.eager_disk, True),
            ):
                assert d is not None
                ratio = d.data / fresh.data
                ok = ratio <= DISK_TARGET
                if judged:
                    verdicts.append(ok)
                    target, verdict = f"≤ {DISK_TARGET}", "PASS" if ok else "FAIL"
                else:
                    target, verdict = "—", f"info: below compaction_debt ({debt:,})"
                lines.append(
                    f"| {r.collected:,} collected, {label} | {_mb(d.sst)} | {_mb(d.blob)} "
                    f"| {_mb(d.wal)} | {_mb(d.data)} | {ratio:.2f} | {_mb(d.total)} "
                    f"| {d.total / fresh.total:.2f} | {target} | {verdict} |"
                )
        tables = list(fresh.per_table)
        lines += [
            "",
            "Live SST bytes per table (`rocksdb.live-sst-files-size`), and the database before GC:",
            "",
            "| database | before GC, whole directory MB | " + " | ".join(tables) + " |",
            "|---|---:|" + "---:|" * len(tables),
            "| fresh | — | " + " | ".join(f"{fresh.per_table[t]:,}" for t in tables) + " |",
        ]
        for r in self.results:
            d = r.disk
            assert d is not None
            lines.append(
                f"| {r.label} collected | {_mb(r.base_disk.total)} | "
                + " | ".join(f"{d.per_table[t]:,}" for t in tables)
                + " |"
            )
        return lines, verdicts

    def render(self) -> str:
        s = self.sizes
        gc_lines, gc_ok = self.gc_table()
        read_lines, read_ok = self.read_table()
        disk_lines, disk_ok = self.disk_table()
        verdicts = gc_ok + read_ok + disk_ok
        out = ["# imq GC benchmark", ""]
        if self.quick:
            out += ["**Quick smoke run: sizes are reduced; these numbers are not results.**", ""]
        out += machine_lines(self.command, self.load_start)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out += [f"- peak RSS of the run: {rss:.0f} MiB", ""]
        out += [f"Targets met: **{sum(verdicts)} of {len(verdicts)}**.", ""]
        out += [
            "Workload: one lagging source shard (`0:2000…`) holds "
            f"{LAG_DIFFS} diffs of {LAG_DIFF_SIZE:,} messages ({LIVE:,} live); three producer "
            f"shards (`0:6…`, `0:a…`, `0:e…`) write diffs of {PRODUCER_DIFF_SIZE} messages "
            f"round-robin, {BODY_SIZE}-byte bodies, destinations from {DST_ACCOUNTS:,} "
            "basechain accounts (so about one statistics entry per message). One commit names "
            "every shard's last diff; its GC bounds collect every producer message and none "
            "of the lagging shard's. " + (self.plot_note or "Plot: `gc.png` beside this file."),
            "",
            "## GC pass",
            "",
            f"One `run_gc()` per fresh copy of the built database ({s.gc_repeats} copies per "
            "size and variant). It runs 4 (shard, bound) groups x 2 partitions = 8 deletions "
            "(the lagging shard's deletes nothing). Raw floor: the same deletes (tail key "
            "scan, diff-info point deletes, tail/message/statistics range deletes) written "
            "first, then `compact_range` of each deleted range. Raw in imq's order: the same, "
            "but per shard (write its deletes, compact its ranges, next shard), as imq's GC "
            "once did it. imq with production settings compacts only once the pass has "
            f"deleted `compaction_debt` ({CONFIG.compaction_debt:,}) messages; *with "
            "compact_after_delete* it compacts the deleted ranges after every pass, as the raw "
            "floor does. So below `compaction_debt` the *imq ÷ floor* column compares imq "
            "writing tombstones only with a floor that also compacts: not the same work (it "
            "flatters imq); the like-for-like ratio is the *with compact_after_delete* one.",
            "",
            *gc_lines,
            "",
            "## Reads of the live head after collection",
            "",
            f"Every collected database (reopened) and a fresh database holding only the live "
            f"diffs; {s.warmup} warm-up calls each, then {s.rounds} rounds alternating between "
            "the databases. Full reads are timed one per call.",
            "",
            *read_lines,
            "",
            "## Disk usage",
            "",
            "After GC and a flush of every table, against a fresh "
            "database into which only the live diffs were applied, flushed the same way. "
            "With production settings a pass compacts only once it has deleted "
            "`compaction_debt` messages; below that, the space comes back when RocksDB's "
            "background compaction merges the files as writes go on (none do here), so "
            "those rows are not judged. *With compact_after_delete* every pass compacts. "
            "*Data* = SST + blob + WAL files; the whole directory also counts RocksDB's info "
            "LOG, MANIFEST and OPTIONS files.",
            "",
            *disk_lines,
            "",
            METHOD,
        ]
        return "\n".join(out)


METHOD = """## Method

- Data comes from `random.Random(SEED)`, built before each database is written; the lagging
  shard's messages (lt from 1,000,000) come first, the producers' (lt from 2,000,000) after.
  Every diff's `processed_to` names the lagging shard below its first message and every
  producer at its last message of this size; one commit on an empty masterchain diff lists
  the last diff of all four shards, so the GC bounds are exactly "everything of the
  producers, nothing of the lagging shard". `QueueConfig()` production settings with
  `gc_enabled=False`: GC runs only through `run_gc`, so timings are deterministic.
- The built database is flushed and closed, then copied once per GC run: each imq and raw
  run starts from byte-identical files (the SSTs RocksDB's background compaction left).
- imq's GC time is `run_gc()` wall time; the time inside `Store.compact` and `Store.write`
  comes from thin timing wrappers set on the store for the run.
- Reads: the first imq copy of each size is kept after its GC pass and reopened; per-call
  `perf_counter_ns`, `gc.collect()` before each batch, results checked on every call.
- Disk: file sizes in the database directory after `flush` of every table.
- Details: `benchmarks/README.md` (GC benchmark section).
"""


def write_plot(report: Report, path: Path) -> str:
    """A log-log plot of the reads and the GC pass against messages collected."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "No plot: matplotlib is not installed (`pip install -e '.[bench]'`)."
    xs = [r.collected for r in report.results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.6))
    short = {
        next(iter(READS)): "iterator + first message",
        list(READS)[1]: "full read, 10k live",
        list(READS)[2]: "tail_len (lagging)",
        list(READS)[3]: "tail_len (collected)",
        next(iter(EXTRA_READS)): "last_applied_seqno (collected, extra)",
    }
    for name, per_db in report.reads.items():
        ys = [statistics.median(per_db[r.label]) / 1e9 for r in report.results]
        left.plot(xs, ys, marker="o", label=short.get(name, name))
    left.set(xscale="log", yscale="log", xlabel="messages collected", ylabel="median seconds")
    left.set_title("reads after collection")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    med = statistics.median
    series = [
        ("imq run_gc", [med(x.seconds for x in r.imq) for r in report.results]),
        ("imq: inside compaction", [med(x.compact_seconds for x in r.imq) for r in report.results]),
        ("raw floor (deletes, then compactions)", [med(r.raw_floor) for r in report.results]),
        ("raw in imq's order", [med(r.raw_task_order) for r in report.results]),
    ]
    for label, ys in series:
        right.plot(xs, ys, marker="o", label=label)
    right.axhline(GC_TARGET_SECONDS, color="red", linestyle="--", linewidth=1, label="target 1 s")
    right.set(xscale="log", yscale="log", xlabel="messages collected", ylabel="seconds")
    right.set_title("one GC pass")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"Plot: `{path.name}` beside this file."


# ---------------------------------------------------------------------------------------------
# Main


def run(args: argparse.Namespace, workdir: Path) -> Report:
    sizes = QUICK if args.quick else FULL
    if args.repeats is not None:
        sizes = Sizes(**{**sizes.__dict__, "gc_repeats": args.repeats})
    command = " ".join(["python -m benchmarks.bench_gc", *sys.argv[1:]])
    report = Report(sizes, args.quick, command, os.getloadavg())
    for collected in sizes.collected:
        print(f"size {collected:,} ...", flush=True)
        report.results.append(bench_size(collected, workdir, sizes))
    print("fresh database with the live messages only ...", flush=True)
    fresh = workdir / "fresh"
    report.fresh_build_seconds = build(fresh, 0, live_only=True)
    with Queue.open(fresh, CONFIG) as queue:
        queue._store.flush(list(Table))
        report.fresh_disk = disk_usage(fresh, queue)
    print("reads ...", flush=True)
    dbs: dict[str, Path] = {}
    for r in report.results:
        assert r.kept is not None
        dbs[r.label] = r.kept
    dbs["fresh"] = fresh
    report.reads = bench_reads(dbs, sizes)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(
        argv,
        "gc",
        __doc__.split("\n")[0],
        "GC passes per size and variant (default 3)",
        "; the plot goes beside it with the extension .png",
    )
    quiet_logs()
    with tempfile.TemporaryDirectory(prefix="imq-bench-gc-", dir=args.dir) as tmp:
        report = run(args, Path(tmp))
    report.plot_note = write_plot(report, args.out.with_suffix(".png"))
    write_report(args.out, report.render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
