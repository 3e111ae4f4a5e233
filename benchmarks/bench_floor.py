"""How close imq's hot paths come to raw rocksdict: apply_diff against a raw write of the
same rows, merged iteration against raw cursors (merged with ``heapq.merge``, and alone).

Python's cyclic GC is off while timing (``gc.collect()`` before each timed run), on both
sides. Runs alternate between variants so drift in machine load hits all alike; the
table gives the median of ``--repeats`` runs and each ratio is taken within this run.
Both tables also give the ratio of the calling thread's CPU time (user + system): both
sides do all of a write's or a read's work in that thread, and on a machine shared with
other processes it varies far less than the wall clock.

Both sides open the database with imq's table options (the raw side through
``RawDb``), so the message table's 32 KiB data blocks serve both alike. The imq side
decodes every field of every message eagerly (key, source, destination, body), as a
consumer gets them; nothing is decoded lazily. Repeated addresses may be shared
``Address`` objects (the compiled path reuses the previous row's, the pure-Python path
keeps its source addresses in a bounded cache per iterator): equal values, built once.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain
from pathlib import Path
from time import perf_counter, thread_time
from typing import Any

from benchmarks.bench_core import (
    CONFIG,
    SOURCE_SHARDS,
    Prepared,
    Sizes,
    machine_lines,
    prepare,
    raw_merged_read,
    raw_range_sources,
    raw_write,
)
from benchmarks.common import RawDb, parse_args, quiet_logs, settle, temp_workdir, write_report
from imq import Queue, QueueConfig, QueueKey, QueueShardRange, ShardIdent
from imq import iterator as iterator_module
from imq.storage import Table, codec

CACHED = replace(CONFIG, message_cache_size=256 << 20)  # 200,000 rows fit
NO_CACHE = replace(CONFIG, message_cache_size=0)
FULL = Sizes(20, 10_000, (0, 0), 0, 0, 0, 0, 0)
QUICK = Sizes(4, 1_000, (0, 0), 0, 0, 0, 0, 0)


@dataclass
class Row:
    name: str
    messages: int
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # CPU time of the calling thread

    @property
    def rate(self) -> float:
        return self.messages / statistics.median(self.seconds)

    @property
    def cpu_rate(self) -> float:
        return self.messages / statistics.median(self.cpu)

    def add(self, timing: tuple[float, float]) -> None:
        self.seconds.append(timing[0])
        self.cpu.append(timing[1])

    @property
    def best(self) -> float:
        return self.messages / min(self.seconds)


def timed_nogc(run: Callable[[], Any]) -> tuple[tuple[float, float], Any]:
    """``((wall seconds, CPU seconds of this thread), result)``. Both sides do all their
    write work in the calling thread (RocksDB's flushes run in its own threads for both),
    so the CPU time leaves out what other processes on the machine take from it."""
    gc.collect()
    gc.disable()
    try:
        started, cpu = perf_counter(), thread_time()
        result = run()
        return (perf_counter() - started, thread_time() - cpu), result
    finally:
        gc.enable()


def imq_write(
    path: Path,
    prepared: Sequence[Prepared],
    config: QueueConfig = CONFIG,
    warm: Sequence[Prepared] = (),
) -> tuple[float, float]:
    """Apply ``prepared`` (timed) on a fresh queue that first applied ``warm`` (untimed:
    with as many rows as the default cache holds, its cache of fresh rows is full and
    evicts, as a long-running collator's is, instead of filling fresh memory)."""
    queue = Queue.open(path, config)
    try:
        for p in warm:
            queue.apply_diff(p.diff, p.block, p.hash)
        apply = queue.apply_diff
        timing, written = timed_nogc(lambda: [apply(p.diff, p.block, p.hash) for p in prepared])
    finally:
        queue.close()
    assert all(written)
    return timing


def raw_encoded_write(path: Path, prepared: Sequence[Prepared]) -> tuple[float, float]:
    """Raw write with the encoding inside the timing (rows built from the messages)."""
    db = RawDb(path, CONFIG)

    def run() -> None:
        from rocksdict import WriteBatch

        handle = db.handle[Table.MESSAGES]
        for p in prepared:
            batch = WriteBatch(raw_mode=True)
            put = batch.put
            for key, value in codec.message_rows(p.block.shard, p.diff.messages):
                put(key, value, handle)
            db.db.write(batch)

    try:
        timing, _ = timed_nogc(run)
    finally:
        db.close()
    return timing


def raw_pre_encoded_write(path: Path, prepared: Sequence[Prepared]) -> tuple[float, float]:
    db = RawDb(path, CONFIG)
    try:
        timing, _ = timed_nogc(lambda: raw_write(db, prepared))
    finally:
        db.close()
    return timing


def imq_read(queue: Queue) -> int:
    ranges = [QueueShardRange(s, QueueKey.MIN, QueueKey.MAX) for s in SOURCE_SHARDS]
    with queue.iterator(0, ranges, ShardIdent.BASECHAIN) as it:
        return sum(1 for _ in it)


def imq_read_pure(queue: Queue) -> int:
    with iterator_module.pure_python():
        return imq_read(queue)


def raw_cursors_alone(db: RawDb) -> int:
    """The second floor: the four ranges read one after another, no merge."""
    sources, keep_alive = raw_range_sources(db)
    count = sum(1 for _ in chain.from_iterable(sources))
    del sources, keep_alive
    return count


def raw_heapq_merge(db: RawDb) -> int:
    return raw_merged_read(db)


def measure_reads(
    imq_path: Path, raw_path: Path, total: int, repeats: int, cached: Queue
) -> list[Row]:
    """The merged read of the written databases: imq compiled, imq pure Python, the
    heapq.merge floor and the cursors alone, round-robin ``repeats`` times after a warm-up.
    The queue is reopened first, so imq reads RocksDB as raw does; ``cached`` (a queue
    that wrote the same messages and still holds them in its cache of fresh rows) gives
    the fifth row."""
    queue, raw = Queue.open(imq_path, CONFIG), RawDb(raw_path, CONFIG)
    # Reads start once neither side has a flush or compaction running or pending (the
    # bulk tables compact in the background), so none lands inside a timed read.
    store = queue._store
    settle(lambda name: sum(store.property_int(t, name) for t in Table))
    settle(lambda name: sum(int(c.property_int_value(name) or 0) for c in raw.cf.values()))
    c_name = "compiled decode" if iterator_module.COMPILED else "pure-Python decode (no C build)"
    r_imq = Row(f"imq iterator, 4 shards merged, {c_name}", total)
    r_pure = Row("imq iterator, pure-Python decode (IMQ_PURE_PYTHON=1)", total)
    r_merge = Row("raw 4 cursors + heapq.merge (floor)", total)
    r_alone = Row("raw 4 cursors alone, no merge (second floor)", total)
    r_cached = Row(f"imq iterator, rows from the cache of fresh rows, {c_name}", total)
    reads: list[tuple[Row, Callable[[], int]]] = [
        (r_imq, lambda: imq_read(queue)),
        (r_pure, lambda: imq_read_pure(queue)),
        (r_merge, lambda: raw_heapq_merge(raw)),
        (r_alone, lambda: raw_cursors_alone(raw)),
        (r_cached, lambda: imq_read(cached)),
    ]
    try:
        for _row, fn in reads:
            assert fn() == total  # warm-up
        for _ in range(repeats):
            for row, fn in reads:
                timing, count = timed_nogc(fn)
                assert count == total
                row.add(timing)
    finally:
        queue.close()
        raw.close()
    return [r_imq, r_pure, r_merge, r_alone, r_cached]


def cached_queue(path: Path, prepared: Sequence[Prepared]) -> Queue:
    """A queue that wrote ``prepared`` (untimed) with a cache of fresh rows large enough
    to keep them all: what a collator reading recent diffs reads from."""
    queue = Queue.open(path, CACHED)
    try:
        for p in prepared:
            queue.apply_diff(p.diff, p.block, p.hash)
    except BaseException:
        queue.close()
        raise
    return queue


def run(args: Any, workdir: Path) -> str:
    sizes = QUICK if args.quick else FULL
    repeats = args.repeats or (1 if args.quick else 9)
    load_start = os.getloadavg()
    # Twice the diffs: the second half is what the steady-state row times, after the
    # first half filled its queue's cache; every other write writes the first half.
    both, _ = prepare(replace(sizes, diffs=2 * sizes.diffs))
    prepared, later = both[: sizes.diffs], both[sizes.diffs :]
    total = sum(len(p.rows) for p in prepared)
    w_imq = Row(
        "apply_diff (statistics derived; default config: rows also kept in the cache, "
        "which fills from empty)",
        total,
    )
    w_steady = Row(
        "apply_diff, default config, the cache already full (a long-running queue: "
        "it evicts as it takes rows)",
        total,
    )
    w_nocache = Row("apply_diff, message_cache_size=0 (no cache of fresh rows)", total)
    w_raw_enc = Row("raw write, rows encoded inside the timing", total)
    w_raw = Row("raw write of pre-encoded rows (floor)", total)
    keep: dict[str, Path] = {}
    for r in range(repeats):
        last = r == repeats - 1
        paths = {n: workdir / f"w-{n}-{r}" for n in ("imq", "steady", "nocache", "enc", "raw")}
        w_imq.add(imq_write(paths["imq"], prepared))
        w_steady.add(imq_write(paths["steady"], later, warm=prepared))
        w_nocache.add(imq_write(paths["nocache"], prepared, NO_CACHE))
        w_raw_enc.add(raw_encoded_write(paths["enc"], prepared))
        w_raw.add(raw_pre_encoded_write(paths["raw"], prepared))
        for n, p in paths.items():
            if last and n in ("imq", "raw"):
                keep[n] = p
            else:
                shutil.rmtree(p, ignore_errors=True)
    with cached_queue(workdir / "cached", prepared) as cached:
        disjoint = measure_reads(keep["imq"], keep["raw"], total, repeats, cached)
    # The same messages' shape with the shards' blocks interleaved in lt, written untimed.
    mixed, _ = prepare(sizes, interleave=True)
    paths = {n: workdir / f"mixed-{n}" for n in ("imq", "raw")}
    imq_write(paths["imq"], mixed)
    raw_pre_encoded_write(paths["raw"], mixed)
    with cached_queue(workdir / "mixed-cached", mixed) as cached:
        interleaved = measure_reads(paths["imq"], paths["raw"], total, repeats, cached)

    def line(row: Row, floor: Row | None = None, second: Row | None = None) -> str:
        ratio = f"{row.rate / floor.rate:.2f}x ({row.best / floor.best:.2f}x)" if floor else ""
        ratio2 = f"{row.rate / second.rate:.2f}x ({row.best / second.best:.2f}x)" if second else ""
        return (
            f"| {row.name} | {row.rate / 1e6:.3f} | {min(row.seconds):.3f}.."
            f"{max(row.seconds):.3f} | {ratio} | {ratio2} |"
        )

    def cpu_line(row: Row, floor: Row) -> str:
        ratio = f"{row.cpu_rate / floor.cpu_rate:.2f}x"
        return line(row, floor).rsplit("|", 2)[0] + f"| {ratio} |"

    def read_table(title: str, rows: list[Row]) -> list[str]:
        r_merge, r_alone = rows[2], rows[3]
        return [
            f"### {title}",
            "",
            "| variant | M msgs/s | seconds min..max | vs heapq.merge floor | vs cursors alone "
            "| CPU time: vs floor | vs cursors alone |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *(
                line(row, r_merge, r_alone)
                + f" {row.cpu_rate / r_merge.cpu_rate:.2f}x"
                + f" | {row.cpu_rate / r_alone.cpu_rate:.2f}x |"
                for row in rows
            ),
            "",
        ]

    out = ["# imq floor benchmark: apply_diff and merged iteration against raw rocksdict", ""]
    if args.quick:
        out += ["**Quick smoke run: sizes are reduced; these numbers are not results.**", ""]
    out += machine_lines(" ".join(["python -m benchmarks.bench_floor", *sys.argv[1:]]), load_start)
    out += [
        "",
        f"{sizes.diffs} diffs of {sizes.diff_size:,} messages ({total:,}), 4 source shards, "
        f"200-byte bodies; median of {repeats} runs; cyclic GC off while timing, both sides. "
        "Ratios: of medians, and in brackets of the best runs (less sensitive to other "
        "processes on a shared machine).",
        "",
        "## Write",
        "",
        "| variant | M msgs/s | seconds min..max | vs floor | vs floor, CPU time |",
        "|---|---:|---:|---:|---:|",
        cpu_line(w_imq, w_raw),
        cpu_line(w_steady, w_raw),
        cpu_line(w_nocache, w_raw),
        cpu_line(w_raw_enc, w_raw),
        cpu_line(w_raw, w_raw),
        "",
        "CPU time: of the calling thread (user + system), which does every write's work on "
        "both sides; it leaves out the time other processes take from a shared machine, "
        "which the wall-clock ratio does not. With the default config an apply also keeps "
        "its rows in the queue's cache of fresh rows (`message_cache_size`, 64 MiB), so "
        "that reads of recent diffs skip RocksDB: the first three rows give that cost. "
        "The first fills an empty cache, so every row it keeps lands in memory the process "
        "touches for the first time; the second writes the same number of rows on a queue "
        "that already wrote as many (untimed), whose cache is full and evicts, as a "
        "long-running collator's is (its RocksDB side also holds twice the rows).",
        "",
        f"apply_diff vs raw write with encoding inside the timing: "
        f"**{w_imq.rate / w_raw_enc.rate:.2f}x**.",
        "",
        "## Merged read",
        "",
        "Two layouts of the same number of messages. *Disjoint*: each diff covers its own lt "
        "range, so one shard's messages follow one another for a whole block (the databases "
        "of the write runs). *Interleaved*: each round's four diffs share one lt range, "
        "message j of the shard at index s at lt base + 4j + s, so the merge changes shard "
        "at every message, as on a live network whose shards' lt clocks run side by side.",
        "",
        *read_table("Disjoint blocks", disjoint),
        *read_table("Interleaved blocks", interleaved),
        "The first four rows read RocksDB: the imq queue is reopened before reading, so its "
        "cache of fresh rows holds none of these messages. The last row reads a queue that "
        "wrote them itself with a 256 MiB cache: every row comes from memory, as a "
        "collator's reads of recent diffs do; RocksDB is not read at all there.",
        "",
        "CPU time: the reading thread's own (`time.thread_time`, user + system; RocksDB "
        "reads run in the calling thread), median of the runs. A read runs on the CPU "
        "throughout, so its CPU time is its wall time, less only what other processes took "
        "of its core; on this VM the two ratios mostly agree, because what slows a run down "
        "(neighbours sharing the CPU's caches and cores) slows its CPU time as much. The "
        "wall-clock ratios before them are the result.",
        "",
        "imq yields decoded `IteratedMessage` values; raw yields `(key, value)` byte pairs. "
        "Iterator creation is inside the timing on both sides; the reads start once neither "
        "side has a flush or compaction running or pending. imq decodes every field of "
        "every message eagerly (key, source, destination, body), nothing lazily; repeated "
        "addresses may be shared `Address` objects (C: the previous row's; Python: source "
        "addresses from a bounded cache per iterator). Both sides use imq's table options "
        "(32 KiB message blocks).",
    ]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(
        argv, "floor", "apply_diff and merged read against raw rocksdict", "runs (default 9)"
    )
    quiet_logs()
    with temp_workdir(args, "floor") as work:
        write_report(args.out, run(args, work))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
