"""Core benchmark: imq against raw rocksdict on the same engine configuration, in one run.

* write: 20 diffs of 10,000 messages through ``Queue.apply_diff``, against the same message
  rows (byte for byte) written with one ``WriteBatch`` per diff (the raw floor);
* read: the merged iterator over 4 source shards, against 4 bounded raw iterators over the
  same key ranges merged with ``heapq.merge``;
* scaling: ``commit_diff``, ``get_diff_info`` and ``get_diffs_tail_len`` with 10^3 to 10^6
  stored messages in diffs of 100 (so the number of diffs grows with the messages).

Garbage collection is off (``gc_enabled=False``) in every queue this benchmark opens: the
timed reads must find what was written, and a GC pass must not run during a timing.

It prints the tables and writes them, with the machine and the method, to
``benchmarks/results/core.md``. Method notes: ``benchmarks/README.md``. From the repo root::

    python -m benchmarks.bench_core                       # full run, a few minutes
    python -m benchmarks.bench_core --quick --out X.md    # smoke run, a few seconds
"""

from __future__ import annotations

import argparse
import gc
import heapq
import math
import os
import platform
import random
import resource
import shutil
import statistics
import sys
import tempfile
import timeit
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from time import perf_counter, perf_counter_ns
from typing import Any

from rocksdict import WriteBatch

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
from imq import iterator as iterator_module
from imq.storage import codec
from imq.storage.tables import Table

# ---------------------------------------------------------------------------------------------
# Sizes, seeds, the workload's shape

SEED = 20_240_601
SOURCE_SHARDS = (  # prefix_len 2: the basechain split in four
    ShardIdent(0, 0x2000_0000_0000_0000),
    ShardIdent(0, 0x6000_0000_0000_0000),
    ShardIdent(0, 0xA000_0000_0000_0000),
    ShardIdent(0, 0xE000_0000_0000_0000),
)
SPLIT_FOR_SHARD = ShardIdent(0, 0x2000_0000_0000_0000)  # accepts ~1/4 of the destinations
BODY_SIZE = 200  # bytes per message body
DST_ACCOUNTS = 4096  # destination pool, spread over the whole basechain
SRC_ACCOUNTS = 256  # per source shard, inside that shard
LT_START = 1_000_000
MC_LT_START = 1 << 40
TAIL_LEN = 2  # get_diffs_tail_len is asked for the same tail length at every size
SCALE_DIFF_SIZE = 100  # messages per diff in the scaling queues
STEPS = ("throughput", "scaling", "types")  # what --only can pick
QK = codec.MESSAGE_PREFIX_LEN  # where the queue key starts in a message key
assert QK == 14, "the raw merge below slices the queue key at byte 14"

# The production defaults (sync commits, 256 MiB cache, 64 MiB memtables) with the
# background GC off: with it on, the first commit requests bounds that let GC collect the
# very diffs the scaling step then looks up (and a pass could land inside a timing).
CONFIG = QueueConfig(gc_enabled=False)
CONFIG_NO_SYNC = QueueConfig(gc_enabled=False, sync_commits=False)


@dataclass(frozen=True, slots=True)
class Sizes:
    diffs: int  # throughput: diffs written and read, round-robin over the source shards
    diff_size: int  # messages per diff
    scale: tuple[int, ...]  # scaling: stored messages per queue, in diffs of SCALE_DIFF_SIZE
    reference: int  # scaling: the size every other size is compared with
    calls: int  # timed calls per operation and queue size
    rounds: int  # the calls are split into rounds that alternate between the two queues
    warmup: int  # untimed calls per operation and queue size before the first round
    micro_number: int  # value-type micro benchmark: constructions per timing


FULL = Sizes(
    diffs=20,
    diff_size=10_000,
    scale=(1_000, 10_000, 100_000, 1_000_000),
    reference=10_000,
    calls=1000,
    rounds=5,
    warmup=50,
    micro_number=200_000,
)
QUICK = Sizes(
    diffs=4,
    diff_size=1_000,
    scale=(1_000, 10_000),
    reference=1_000,
    calls=60,
    rounds=2,
    warmup=5,
    micro_number=20_000,
)

# ---------------------------------------------------------------------------------------------
# Workload


@dataclass(frozen=True, slots=True)
class DiffInput:
    """One block's diff before it becomes a ``QueueDiff``."""

    block: BlockIdShort
    messages: list[Message]
    processed_to: dict[ShardIdent, QueueKey]
    prev_hash: bytes | None
    hash: bytes

    def build(self) -> QueueDiff:
        return QueueDiff(self.messages, self.processed_to, None, self.prev_hash)


class Workload:
    """Deterministic diffs: round-robin over the source shards, lt rising globally,
    destinations from a pool across the basechain, sources inside the source shard.

    By default each diff covers its own lt range (the shards' blocks are disjoint in lt).
    With ``interleave``, each round of one diff per shard shares one lt range, message j of
    the shard at index s at lt ``base + j * shards + s``: the shards' blocks interleave
    message by message, as a live network's shards (each with its own lt clock near the
    others') do."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.dst = [Address(0, self.rng.randbytes(32)) for _ in range(DST_ACCOUNTS)]
        self.src = {
            s: [Address(0, account_in(self.rng, s)) for _ in range(SRC_ACCOUNTS)]
            for s in SOURCE_SHARDS
        }

    def diffs(self, count: int, size: int, *, interleave: bool = False) -> Iterator[DiffInput]:
        rng, dst = self.rng, self.dst
        last_hash: dict[ShardIdent, bytes] = {}
        lt = LT_START
        n = len(SOURCE_SHARDS)
        for i in range(count):
            shard = SOURCE_SHARDS[i % n]
            src = self.src[shard]
            if interleave:  # the round's lt range, this shard's every n-th lt in it
                lt = LT_START + (i // n) * size * n
                lts = [lt + j * n + i % n for j in range(size)]
            else:
                lts = [lt + j for j in range(size)]
            messages = [
                Message(
                    QueueKey(lts[j], rng.randbytes(32)),
                    rng.choice(src),
                    rng.choice(dst),
                    rng.randbytes(BODY_SIZE),
                )
                for j in range(size)
            ]
            processed_to = {s: QueueKey.max_for_lt(lt - 1) for s in SOURCE_SHARDS}
            digest = rng.randbytes(32)
            block = BlockIdShort(shard, i // len(SOURCE_SHARDS) + 1)
            yield DiffInput(block, messages, processed_to, last_hash.get(shard), digest)
            last_hash[shard] = digest
            lt += size


@dataclass(frozen=True, slots=True)
class Prepared:
    """Everything a write run needs, built before any timing."""

    block: BlockIdShort
    hash: bytes
    diff: QueueDiff
    stats: DiffStatistics
    rows: list[tuple[bytes, bytes]]  # the message rows imq writes, for the raw floor
    stat_rows: list[tuple[bytes, bytes]]  # the statistics rows imq writes (informational row)


def prepare(sizes: Sizes, *, interleave: bool = False) -> tuple[list[Prepared], float]:
    """The throughput diffs, and the seconds spent constructing their ``QueueDiff``s."""
    inputs = list(Workload(SEED).diffs(sizes.diffs, sizes.diff_size, interleave=interleave))
    gc.collect()
    started = perf_counter()
    diffs = [d.build() for d in inputs]
    build_seconds = perf_counter() - started
    prepared = []
    for d, diff in zip(inputs, diffs, strict=True):
        stats = DiffStatistics.from_diff(
            diff, d.block.shard, diff.min_message or QueueKey.MIN, diff.max_message or QueueKey.MIN
        )
        rows = list(codec.message_rows(d.block.shard, diff.messages, None))
        stat_rows = [
            (
                codec.stat_key(d.block.shard, partition, stats.max_message, d.block.seqno),
                codec.stat_value(counts),
            )
            for partition, counts in stats.partitions.items()
        ]
        prepared.append(Prepared(d.block, d.hash, diff, stats, rows, stat_rows))
    return prepared, build_seconds


# ---------------------------------------------------------------------------------------------
# The raw floor: bare rocksdict with imq's column families and options


def raw_write(db: RawDb, prepared: Sequence[Prepared], with_stats: bool = False) -> None:
    """One batch per diff: its message rows, and its statistics rows if ``with_stats``."""
    handle, stats_handle = db.handle[Table.MESSAGES], db.handle[Table.STATISTICS]
    write = db.db.write
    for p in prepared:
        batch = WriteBatch(raw_mode=True)
        put = batch.put
        for key, value in p.rows:
            put(key, value, handle)
        if with_stats:
            for key, value in p.stat_rows:
                put(key, value, stats_handle)
        write(batch)


def raw_range_sources(db: RawDb) -> tuple[list[Any], list[Any]]:
    """One raw ``items`` cursor over each source shard's partition-0 message range, and
    what must stay alive while they are read (RocksDB holds raw pointers into the bound
    bytes and their ReadOptions)."""
    keep_alive = []
    sources = []
    for shard in SOURCE_SHARDS:
        lo, hi = codec.message_range(0, shard, QueueKey.MIN, QueueKey.MAX)
        ro = db.scan_options()
        ro.set_iterate_upper_bound(hi)
        keep_alive.append((hi, ro))
        sources.append(db.cf[Table.MESSAGES].items(from_key=lo, read_opt=ro))
    return sources, keep_alive


def raw_merged_read(db: RawDb) -> int:
    """Read the 4 source-shard ranges of partition 0 merged by queue key; rows read."""
    sources, keep_alive = raw_range_sources(db)
    count = sum(1 for _ in heapq.merge(*sources, key=lambda kv: kv[0][14:]))
    del sources, keep_alive
    return count


# ---------------------------------------------------------------------------------------------
# Timing and statistics


def timed(run: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds taken by ``run()`` after a full garbage collection, and its result."""
    gc.collect()
    started = perf_counter()
    result = run()
    return perf_counter() - started, result


def time_calls(
    fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]]
) -> tuple[list[int], list[Any]]:
    """Nanoseconds of each ``fn(*args)``, one timer pair per call, and the results."""
    gc.collect()
    clock = perf_counter_ns
    samples: list[int] = []
    results: list[Any] = []
    for args in calls:
        started = clock()
        result = fn(*args)
        samples.append(clock() - started)
        results.append(result)
    return samples, results


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(pct / 100 * len(ordered))) - 1]


@dataclass
class Throughput:
    name: str
    messages: int  # rows written or read per run
    seconds: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def rate(self) -> float:
        return self.messages / self.median


@dataclass
class Latency:
    name: str
    samples: dict[str, list[int]]  # queue label -> nanoseconds per call


# ---------------------------------------------------------------------------------------------
# Write and read throughput


def _imq_write(path: Path, prepared: Sequence[Prepared], with_stats: bool) -> float:
    queue = Queue.open(path, CONFIG)
    try:

        def run() -> list[bool]:
            apply = queue.apply_diff
            return [
                apply(p.diff, p.block, p.hash, p.stats if with_stats else None) for p in prepared
            ]

        seconds, written = timed(run)
    finally:
        queue.close()
    assert all(written), "every diff must be written"
    return seconds


def _raw_write(path: Path, prepared: Sequence[Prepared], with_stats: bool) -> float:
    db = RawDb(path, CONFIG)
    try:
        seconds, _ = timed(lambda: raw_write(db, prepared, with_stats))
    finally:
        db.close()
    return seconds


def bench_write(
    prepared: Sequence[Prepared], workdir: Path, repeats: int
) -> tuple[list[Throughput], Path, Path]:
    """Fresh databases per run; the last imq and raw databases are kept for the reads."""
    total = sum(len(p.rows) for p in prepared)
    derived = Throughput("apply_diff, statistics derived", total)
    given = Throughput("apply_diff, statistics precomputed", total)
    raw = Throughput("raw WriteBatch + write (floor)", total)
    raw_stats = Throughput("raw + imq's statistics rows (info)", total)
    names = ("imq", "imq-stats", "raw", "raw-stats")
    for run in range(repeats):
        last = run == repeats - 1
        paths = [workdir / f"write-{name}-{run}" for name in names]
        derived.seconds.append(_imq_write(paths[0], prepared, with_stats=False))
        given.seconds.append(_imq_write(paths[1], prepared, with_stats=True))
        raw.seconds.append(_raw_write(paths[2], prepared, with_stats=False))
        raw_stats.seconds.append(_raw_write(paths[3], prepared, with_stats=True))
        for i, path in enumerate(paths):  # keep the last imq and raw databases for the reads
            if not (last and i in (0, 2)):
                shutil.rmtree(path, ignore_errors=True)
    stat_rows = sum(len(p.stat_rows) for p in prepared)
    raw_stats.note = (
        f"floor + {stat_rows:,} statistics rows; apply_diff (derived) reaches "
        f"{derived.rate / raw_stats.rate:.2f} of it"
    )
    return [derived, given, raw, raw_stats], paths[0], paths[2]


def _imq_read(queue: Queue, for_shard: ShardIdent) -> int:
    """One full pass of the merged iterator, consumed directly; messages yielded."""
    ranges = [QueueShardRange(s, QueueKey.MIN, QueueKey.MAX) for s in SOURCE_SHARDS]
    with queue.iterator(0, ranges, for_shard) as it:
        return sum(1 for _ in it)


def _imq_read_pure_python(queue: Queue) -> int:
    """The same pass with the pure-Python decode (what a machine without a C compiler runs)."""
    with iterator_module.pure_python():
        return _imq_read(queue, ShardIdent.BASECHAIN)


def _sst_summary(path: Path) -> str:
    ssts = list(file_sizes(path, "*.sst").values())
    wal = sum(file_sizes(path, "*.log").values())
    return f"{len(ssts)} SST files, {sum(ssts) / 1e6:.1f} MB, WAL {wal / 1e6:.1f} MB"


def bench_read(
    imq_path: Path, raw_path: Path, total: int, repeats: int
) -> tuple[list[Throughput], str]:
    """Reads on the databases of the last write run. Closing them after the write flushed
    every memtable to L0 (no compaction on either side). One untimed warm-up pass each."""
    decode = "compiled (imq._speedups)" if iterator_module.COMPILED else "pure Python"
    state = (
        f"imq: {_sst_summary(imq_path)}; raw: {_sst_summary(raw_path)}; no compaction; "
        f"the iterator's decode: {decode}"
    )
    queue, raw = Queue.open(imq_path, CONFIG), RawDb(raw_path, CONFIG)
    full = Throughput("iterator, 4 shards merged, all accepted", total)
    split = Throughput("iterator, 4 shards merged, split for_shard", total)
    pure = Throughput("iterator, all accepted, pure-Python decode", total)
    floor = Throughput("raw 4 ranges + heapq.merge (floor)", total)
    full.note = (
        "compiled decode (imq._speedups)"
        if iterator_module.COMPILED
        else "pure-Python decode: imq._speedups was not built"
    )
    pure.note = "IMQ_PURE_PYTHON=1, or no C compiler at install"
    try:
        runs: list[tuple[Throughput, Callable[[], int]]] = [
            (full, lambda: _imq_read(queue, ShardIdent.BASECHAIN)),
            (pure, lambda: _imq_read_pure_python(queue)),
            (split, lambda: _imq_read(queue, SPLIT_FOR_SHARD)),
            (floor, lambda: raw_merged_read(raw)),
        ]
        counts = {}
        for result, run in runs:
            counts[result.name] = run()  # warm-up
        for _ in range(repeats):
            for result, run in runs:
                seconds, count = timed(run)
                assert count == counts[result.name], "every pass must read the same rows"
                result.seconds.append(seconds)
    finally:
        queue.close()
        raw.close()
    assert counts[full.name] == counts[floor.name] == total, (counts, total)
    accepted = counts[split.name]
    split.note = f"yields {accepted:,} of {total:,} ({accepted / total:.0%}); rate = rows scanned"
    return [full, pure, split, floor], state


# ---------------------------------------------------------------------------------------------
# Scaling: commit_diff, get_diff_info, get_diffs_tail_len at two queue sizes


@dataclass
class ScaleQueue:
    label: str
    path: Path
    messages: int
    shard_diffs: dict[ShardIdent, list[tuple[int, QueueKey]]]  # (seqno, max_message) in order
    build_seconds: float
    queue: Queue | None = None
    next_mc: int = 1  # next masterchain seqno to commit

    @property
    def diff_count(self) -> int:
        return sum(len(v) for v in self.shard_diffs.values())

    def open(self, config: QueueConfig) -> Queue:
        if self.queue is not None:
            self.queue.close()
        self.queue = Queue.open(self.path, config)
        return self.queue

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
            self.queue = None


def _mc_diff(seqno: int) -> tuple[QueueDiff, DiffStatistics]:
    """An empty masterchain diff whose statistics carry the block's lt range."""
    lt = MC_LT_START + seqno * 1000
    processed_to = {s: QueueKey.max_for_lt(lt) for s in SOURCE_SHARDS}
    stats = DiffStatistics(
        ShardIdent.MASTERCHAIN, QueueKey.min_for_lt(lt), QueueKey.max_for_lt(lt + 999), {}
    )
    return QueueDiff((), processed_to), stats


def build_scale_queue(label: str, path: Path, messages: int, mc_diffs: int) -> ScaleQueue:
    """Apply the shard diffs (built one at a time), then ``mc_diffs`` empty masterchain
    diffs for the commits to come; close and reopen so every table is flushed."""
    started = perf_counter()
    size = SCALE_DIFF_SIZE
    count = messages // size
    shard_diffs: dict[ShardIdent, list[tuple[int, QueueKey]]] = {s: [] for s in SOURCE_SHARDS}
    with Queue.open(path, CONFIG) as queue:
        for d in Workload(SEED).diffs(count, size):
            diff = d.build()
            assert queue.apply_diff(diff, d.block, d.hash)
            assert diff.max_message is not None
            shard_diffs[d.block.shard].append((d.block.seqno, diff.max_message))
        for seqno in range(1, mc_diffs + 1):
            diff, stats = _mc_diff(seqno)
            block = BlockIdShort(ShardIdent.MASTERCHAIN, seqno)
            assert queue.apply_diff(diff, block, seqno.to_bytes(32, "big"), stats)
    scale = ScaleQueue(label, path, count * size, shard_diffs, perf_counter() - started)
    scale.open(CONFIG)
    return scale


def _commit_calls(scale: ScaleQueue, n: int) -> list[tuple[list[TopBlock]]]:
    """``n`` commits, each on the next masterchain block (its empty diff is stored) with the
    4 source shards' newest diffs as top blocks: the same work at every queue size."""
    calls = []
    for _ in range(n):
        mc = scale.next_mc
        scale.next_mc += 1
        tops = [TopBlock(BlockId(ShardIdent.MASTERCHAIN, mc), mc)]
        tops += [
            TopBlock(BlockId(shard, diffs[-1][0]), mc) for shard, diffs in scale.shard_diffs.items()
        ]
        calls.append((tops,))
    return calls


def _diff_info_calls(scale: ScaleQueue, n: int, rng: random.Random) -> list[tuple[ShardIdent, int]]:
    stored = [(s, seqno) for s, diffs in scale.shard_diffs.items() for seqno, _ in diffs]
    return [rng.choice(stored) for _ in range(n)]


def _tail_calls(scale: ScaleQueue, n: int) -> list[tuple[ShardIdent, QueueKey]]:
    """From the max_message of each shard's TAIL_LEN-th newest diff: the tail is TAIL_LEN."""
    shards = list(scale.shard_diffs)
    calls = []
    for i in range(n):
        shard = shards[i % len(shards)]
        calls.append((shard, scale.shard_diffs[shard][-TAIL_LEN][1]))
    return calls


def _expect(name: str, results: list[Any], check: Callable[[Any], bool]) -> None:
    bad = [r for r in results if not check(r)]
    assert not bad, f"{name}: unexpected results {bad[:3]}"


def _measure_round(
    scale: ScaleQueue, n: int, rng: random.Random, ops: set[str]
) -> dict[str, list[int]]:
    queue = scale.queue
    assert queue is not None
    out: dict[str, list[int]] = {}
    if "commit_diff" in ops:
        calls = _commit_calls(scale, n)
        out["commit_diff"], results = time_calls(queue.commit_diff, calls)
        _expect("commit_diff", results, lambda r: r is True)
    if "get_diff_info" in ops:
        out["get_diff_info"], results = time_calls(
            queue.get_diff_info, _diff_info_calls(scale, n, rng)
        )
        _expect("get_diff_info", results, lambda r: r is not None)
    if "get_diffs_tail_len" in ops:
        out["get_diffs_tail_len"], results = time_calls(
            queue.get_diffs_tail_len, _tail_calls(scale, n)
        )
        _expect("get_diffs_tail_len", results, lambda r: r == TAIL_LEN)
    return out


def _alternate(
    queues: Sequence[ScaleQueue], sizes: Sizes, ops: set[str], rng: random.Random
) -> dict[str, dict[str, list[int]]]:
    """Warm up, then ``sizes.rounds`` rounds alternating between the queues."""
    for scale in queues:
        _measure_round(scale, sizes.warmup, rng, ops)
    samples: dict[str, dict[str, list[int]]] = {op: {q.label: [] for q in queues} for op in ops}
    per_round = sizes.calls // sizes.rounds
    for _ in range(sizes.rounds):
        for scale in queues:
            for op, values in _measure_round(scale, per_round, rng, ops).items():
                samples[op][scale.label].extend(values)
    return samples


def bench_scale(workdir: Path, sizes: Sizes) -> tuple[list[Latency], list[ScaleQueue]]:
    mc_diffs = 2 * (sizes.warmup + sizes.calls)  # commits with and without fsync
    queues = []
    for n in sizes.scale:
        print(f"  building the {count_label(n)} queue ...", flush=True)
        queues.append(build_scale_queue(count_label(n), workdir / f"scale-{n}", n, mc_diffs))
    rng = random.Random(SEED + 1)
    try:
        ops = {"commit_diff", "get_diff_info", "get_diffs_tail_len"}
        synced = _alternate(queues, sizes, ops, rng)
        for scale in queues:
            scale.open(CONFIG_NO_SYNC)
        unsynced = _alternate(queues, sizes, {"commit_diff"}, rng)
    finally:
        for scale in queues:
            scale.close()
    rows = [
        Latency("commit_diff (sync_commits=True, default)", synced["commit_diff"]),
        Latency("commit_diff (sync_commits=False)", unsynced["commit_diff"]),
        Latency("get_diff_info (random stored diff)", synced["get_diff_info"]),
        Latency(f"get_diffs_tail_len (tail of {TAIL_LEN})", synced["get_diffs_tail_len"]),
    ]
    return rows, queues


# ---------------------------------------------------------------------------------------------
# Value types: what a tuple subclass saves over a frozen dataclass (imq/types.py cites this)


@dataclass(frozen=True, slots=True)
class _DataclassKey:
    lt: int
    hash: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.lt, int) or isinstance(self.lt, bool):
            raise TypeError("lt")
        if not 0 <= self.lt <= 0xFFFF_FFFF_FFFF_FFFF:
            raise ValueError("lt")
        if not isinstance(self.hash, bytes):
            raise TypeError("hash")
        if len(self.hash) != 32:
            raise ValueError("hash")


@dataclass(frozen=True, slots=True)
class _PlainDataclassKey:
    lt: int
    hash: bytes


def bench_value_types(number: int) -> list[tuple[str, float]]:
    """Nanoseconds per construction: median of 7 timings of ``number`` constructions, minus
    the same loop running ``pass`` (timeit statements, so no wrapper call is counted)."""
    from imq.types import _trusted_queue_key

    names = {
        "QueueKey": QueueKey,
        "trusted": _trusted_queue_key,
        "tnew": tuple.__new__,
        "Checked": _DataclassKey,
        "Plain": _PlainDataclassKey,
        "lt": 123_456_789,
        "digest": bytes(range(32)),
    }
    cases = [
        ("`QueueKey(lt, hash)`: tuple subclass, validated", "QueueKey(lt, digest)"),
        ("`_trusted_queue_key(lt, hash)`: function, no checks", "trusted(lt, digest)"),
        ("`tuple.__new__(QueueKey, (lt, hash))` inline (iterator)", "tnew(QueueKey, (lt, digest))"),
        ("frozen slotted dataclass, same checks in `__post_init__`", "Checked(lt, digest)"),
        ("frozen slotted dataclass, no checks", "Plain(lt, digest)"),
    ]
    empty = statistics.median(timeit.repeat("pass", number=number, repeat=7))
    out = []
    for name, stmt in cases:
        timings = timeit.repeat(stmt, globals=names, number=number, repeat=7)
        out.append((name, (statistics.median(timings) - empty) / number * 1e9))
    return out


# ---------------------------------------------------------------------------------------------
# Report


def _targets(throughput: list[Throughput]) -> dict[str, tuple[Throughput, float]]:
    """Row name -> (floor row, minimum ratio); a floor with ratio 0 is informational."""
    by_name = {t.name: t for t in throughput}
    write_floor = by_name["raw WriteBatch + write (floor)"]
    read_floor = by_name["raw 4 ranges + heapq.merge (floor)"]
    return {
        "apply_diff, statistics derived": (write_floor, 0.5),
        "apply_diff, statistics precomputed": (write_floor, 0.5),
        "iterator, 4 shards merged, all accepted": (read_floor, 0.5),
        "iterator, 4 shards merged, split for_shard": (read_floor, 0.0),
        "iterator, all accepted, pure-Python decode": (read_floor, 0.0),
    }


def throughput_table(rows: list[Throughput]) -> tuple[list[str], list[bool]]:
    targets = _targets(rows)
    lines = [
        "| operation | messages | median s | min..max s | msgs/s | raw floor msgs/s | ratio "
        "| target | result |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    verdicts = []
    for t in rows:
        floor, minimum = targets.get(t.name, (None, 0.0))
        cells = [t.name, f"{t.messages:,}", f"{t.median:.3f}"]
        cells.append(f"{min(t.seconds):.3f}..{max(t.seconds):.3f}")
        cells.append(f"{t.rate / 1e6:.3f} M")
        if floor is None:
            cells += ["—", "—", "—", t.note or "floor"]
        else:
            ratio = t.rate / floor.rate
            cells += [f"{floor.rate / 1e6:.3f} M", f"{ratio:.2f}"]
            if minimum:
                ok = ratio >= minimum
                verdicts.append(ok)
                cells += [f"≥ {minimum}", "PASS" if ok else "FAIL"]
            else:
                cells += ["—", t.note or "info"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines, verdicts


def latency_table(
    rows: list[Latency], queues: list[ScaleQueue], reference: int
) -> tuple[list[str], list[bool]]:
    """One row per operation and size; the ratio of medians against the ``reference``
    size; the target (≤ 1.5) is checked on the largest size."""
    ref = next(q for q in queues if q.messages == reference)
    largest = max(queues, key=lambda q: q.messages)
    lines = [
        "| operation | stored messages | stored shard diffs | calls | median µs | p99 µs "
        f"| median ratio to {ref.label} | target | result |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    verdicts = []
    for row in rows:
        base = statistics.median(row.samples[ref.label])
        for scale in queues:
            values = row.samples[scale.label]
            med = statistics.median(values)
            cells = [row.name, f"{scale.messages:,}", str(scale.diff_count), str(len(values))]
            cells += [f"{med / 1e3:.1f}", f"{percentile(values, 99) / 1e3:.1f}"]
            ratio = med / base
            if scale is largest and scale is not ref:
                ok = ratio <= 1.5
                verdicts.append(ok)
                cells += [f"{ratio:.2f}", "≤ 1.5", "PASS" if ok else "FAIL"]
            else:
                cells += ["" if scale is ref else f"{ratio:.2f}", "", ""]
            lines.append("| " + " | ".join(cells) + " |")
    return lines, verdicts


def machine_lines(command: str, load_start: tuple[float, ...]) -> list[str]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load_end = os.getloadavg()
    return [
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- machine: {os.cpu_count()} CPUs ({cpu}), {mem:.1f} GiB RAM, {platform.system()} "
        f"{platform.release()}",
        f"- python {platform.python_version()}, rocksdict {version('rocksdict')}, "
        f"imq {version('imq')}, msgpack {version('msgpack')}",
        f"- load average (1 min) at start {load_start[0]:.2f}, at end {load_end[0]:.2f}",
        f"- command: `{command}`",
    ]


@dataclass
class Report:
    sizes: Sizes
    quick: bool
    repeats: int
    command: str
    load_start: tuple[float, ...]
    throughput: list[Throughput] = field(default_factory=list)
    build_seconds: float = 0.0
    read_state: str = ""
    latency: list[Latency] = field(default_factory=list)
    queues: list[ScaleQueue] = field(default_factory=list)
    value_types: list[tuple[str, float]] = field(default_factory=list)

    def render(self) -> str:
        s = self.sizes
        _, t_ok = throughput_table(self.throughput) if self.throughput else ([], [])
        l_lines, l_ok = (
            latency_table(self.latency, self.queues, s.reference) if self.queues else ([], [])
        )
        verdicts = t_ok + l_ok
        total = s.diffs * s.diff_size
        out = ["# imq core benchmark", ""]
        if self.quick:
            out += ["**Quick smoke run: sizes are reduced; these numbers are not results.**", ""]
        out += machine_lines(self.command, self.load_start)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out += [f"- peak RSS of the run: {rss:.0f} MiB", "- background GC: off in every queue"]
        out += ["", f"Targets met: **{sum(verdicts)} of {len(verdicts)}**.", ""]
        if self.throughput:
            out += self._throughput_section(total)
        if self.queues:
            out += self._scaling_section(l_lines)
        if self.value_types:
            out += [
                "## Value types: construction cost (imq/types.py cites this)",
                "",
                "| constructor | ns per call |",
                "|---|---:|",
                *[f"| {name} | {ns:.0f} |" for name, ns in self.value_types],
                "",
            ]
        out.append(METHOD)
        return "\n".join(out)

    def _throughput_section(self, total: int) -> list[str]:
        s = self.sizes
        t_lines, _ = throughput_table(self.throughput)
        return [
            f"## Write and read: {s.diffs} diffs of {s.diff_size:,} messages "
            f"({total:,}), 4 source shards",
            "",
            f"Medians of {self.repeats} runs; ratio = imq msgs/s ÷ raw msgs/s.",
            f"Building the {s.diffs} `QueueDiff`s (not in the apply time) took "
            f"{self.build_seconds:.3f} s ({total / self.build_seconds / 1e6:.2f} M msgs/s).",
            f"Reads ran on the last written databases: {self.read_state}.",
            "",
            *t_lines,
            "",
        ]

    def _scaling_section(self, l_lines: list[str]) -> list[str]:
        s = self.sizes
        labels = ", ".join(q.label for q in self.queues)
        return [
            f"## Scaling: {labels} stored messages, in diffs of {SCALE_DIFF_SIZE}",
            "",
            "; ".join(_shape(q) for q in self.queues)
            + f". Each also holds {2 * (s.warmup + s.calls)} empty masterchain diffs, one per "
            f"commit. Calls alternate between the queues in {s.rounds} rounds, after "
            f"{s.warmup} warm-up calls per operation and queue. GC is off, so every diff "
            "stays stored.",
            "",
            *l_lines,
            "",
        ]


def _shape(scale: ScaleQueue) -> str:
    per_diff = scale.messages // scale.diff_count
    return (
        f"{scale.label}: {scale.diff_count} shard diffs of {per_diff:,} messages "
        f"(built in {scale.build_seconds:.1f} s)"
    )


METHOD = """## Method

- Data is generated before any timing from `random.Random(SEED)`: messages round-robin over
  4 source shards (`0:2…`, `0:6…`, `0:a…`, `0:e…`), lt rising globally, 200-byte random
  bodies, destinations from 4,096 basechain accounts, sources inside their source shard.
- Every queue runs with `QueueConfig(gc_enabled=False)`: production settings, background
  GC off, so no pass collects what a timed read looks up or runs inside a timing.
- Write: each run opens a fresh database (production settings, GC off), runs
  `gc.collect()`, then times `apply_diff` for every diff. The raw floor opens a fresh
  rocksdict database with imq's own column families and options (`imq.storage.tables`) and
  times one `WriteBatch(raw_mode=True)` per diff + `db.write`, over the exact message rows imq
  writes (`codec.message_rows`), built before timing. imq's time also covers its checks,
  statistics, diff-tail and diff-info rows. Closing (which flushes) is not timed on either side.
  The informational raw row also writes imq's statistics rows, encoded before timing.
- Read: the databases of the last write run, closed and reopened (memtables flushed to L0,
  no compaction on either side), one untimed warm-up pass each. imq: `Queue.iterator` over
  partition 0 of the 4 shards, fully consumed. Raw: 4 bounded `items()` over the same key
  ranges merged by `heapq.merge(key=lambda kv: kv[0][14:])`. Iterator creation is timed.
- Scaling: per-call `perf_counter_ns`, `gc.collect()` before each batch of calls. Each
  commit is on a new masterchain block whose empty diff was applied beforehand, with the
  newest diff of each of the 4 shards as top blocks, so every commit does the same work.
  `get_diff_info` asks for random stored shard diffs; `get_diffs_tail_len` starts at the
  max_message of a shard's 2nd newest diff, so the answer is 2 at every size. The queues
  hold 10^3 to 10^6 messages in diffs of 100, so the number of diffs grows with them.
- the `imq` logger drops events below WARNING, so `diff_applied` info events are
  not rendered during timing.
- Details and caveats: `benchmarks/README.md`.
"""


# ---------------------------------------------------------------------------------------------
# Main


def run(args: argparse.Namespace, workdir: Path) -> Report:
    sizes = QUICK if args.quick else FULL
    command = " ".join(["python -m benchmarks.bench_core", *sys.argv[1:]])
    report = Report(sizes, args.quick, args.repeats, command, os.getloadavg())
    steps = set(args.only or STEPS)
    if "throughput" in steps:
        print(f"preparing {sizes.diffs} diffs of {sizes.diff_size:,} messages ...", flush=True)
        prepared, report.build_seconds = prepare(sizes)
        print("write ...", flush=True)
        written, imq_db, raw_db = bench_write(prepared, workdir, args.repeats)
        total = sum(len(p.rows) for p in prepared)
        del prepared
        print("read ...", flush=True)
        read, report.read_state = bench_read(imq_db, raw_db, total, args.repeats)
        report.throughput = written + read
        shutil.rmtree(imq_db, ignore_errors=True)
        shutil.rmtree(raw_db, ignore_errors=True)
    if "scaling" in steps:
        print("scaling (builds the queues first) ...", flush=True)
        report.latency, report.queues = bench_scale(workdir, sizes)
    if "types" in steps:
        print("value types ...", flush=True)
        report.value_types = bench_value_types(sizes.micro_number)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(
        argv,
        "core",
        __doc__.split("\n")[0],
        "write/read runs (default 5; 1 with --quick)",
        steps=STEPS,
    )
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    quiet_logs()
    with tempfile.TemporaryDirectory(prefix="imq-bench-", dir=args.dir) as tmp:
        report = run(args, Path(tmp))
    write_report(args.out, report.render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
