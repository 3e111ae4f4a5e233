"""imq against what a Python developer would pick instead, on one simple queue workload.

Systems: imq (the defaults: fsync per commit) and imq with ``sync_commits=False``; raw
rocksdict (the floor, imq's own table options); plain ``sqlite3`` (WAL, BLOB primary key,
WITHOUT ROWID, ``executemany``, one transaction per batch) with ``synchronous=NORMAL``
and with ``synchronous=FULL``; persist-queue's ``SQLiteAckQueue`` and its file ``Queue``;
``diskcache.Deque``. The append is also compared at equal durability, in two pairs: imq
(fsync per commit) with sqlite3 FULL (fsync per transaction), and imq without fsync with
sqlite3 NORMAL (no fsync per transaction).

Workload, the same bytes for every system: ``N`` messages, each a 40-byte ordering key
(lt u64 big-endian + 32-byte hash) and a 200-byte body, appended in batches; then

1. **append** all ``N`` in batches (imq: one diff of one source shard per batch, applied,
   then committed on an empty masterchain diff);
2. **read** all ``N`` back in order;
3. **delete** the consumed prefix, the first half (imq: commit ``processed_to`` past it,
   then one GC pass);
4. **reopen** and read the first remaining message (open time included).

Slow peers run at a smaller ``N`` (said in the table); compare rates per message. The
systems at full ``N`` run ``--repeats`` times (default 3) in turn, round-robin, and the
tables give the median.
Python's cyclic GC is off while timing (after a ``gc.collect()``), for every system.
The peers are in the ``bench`` extra (``pip install -e '.[bench]'``); a missing one is
reported as skipped.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import shutil
import sqlite3
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from time import perf_counter
from typing import Any

from rocksdict import WriteBatch

from benchmarks.bench_core import machine_lines
from benchmarks.common import RawDb, parse_args, quiet_logs, settle, temp_workdir, write_report
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

SEED = 20_261_201
BODY = 200
SHARD = ShardIdent(0, 0x6000_0000_0000_0000)  # prefix 01 (length 2): accounts 0x4..-0x7..
LT0 = 1_000_000
MC_LT0 = 1 << 40
CONFIG = QueueConfig(gc_enabled=False)  # production settings; GC only through run_gc()
CONFIG_UNSYNCED = QueueConfig(gc_enabled=False, sync_commits=False)  # no fsync at all


@dataclass(frozen=True)
class Sizes:
    n: int  # messages for imq, raw rocksdict and sqlite3
    slow_n: int  # diskcache
    slowest_n: int  # persist-queue (about 1,000 appends/s here)
    batch: int


FULL = Sizes(1_000_000, 100_000, 20_000, 10_000)
QUICK = Sizes(20_000, 2_000, 1_000, 1_000)


def workload(n: int, seed: int = SEED) -> list[tuple[bytes, bytes]]:
    """(40-byte key, 200-byte body) in key order."""
    rng = random.Random(seed)
    return [
        ((LT0 + i).to_bytes(8, "big") + rng.randbytes(32), rng.randbytes(BODY)) for i in range(n)
    ]


def batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


@dataclass
class Result:
    system: str
    n: int
    durability: str
    label: str
    runs: list[dict[str, float]] = field(default_factory=list)
    note: str = ""

    @property
    def seconds(self) -> dict[str, float]:
        """The median of the runs, per step."""
        return {
            step: statistics.median(r[step] for r in self.runs)
            for step in self.runs[0]
            if step in STEPS
        }

    @property
    def settle(self) -> float | None:
        """The median of the runs' waits for RocksDB's background work after the append,
        where recorded (seconds)."""
        if SETTLE not in self.runs[0]:
            return None
        return statistics.median(r[SETTLE] for r in self.runs)

    def append_settled(self, run: dict[str, float]) -> float:
        """One run's append seconds with the background work it left included."""
        return run["append"] + run.get(SETTLE, 0.0)

    @property
    def settled_rate(self) -> float:
        """Messages/s of the append with its background work included (the median run)."""
        return self.n / statistics.median(self.append_settled(r) for r in self.runs)

    @property
    def read_faults(self) -> float | None:
        """The median of the runs' minor page faults during the read, where recorded."""
        if READ_FAULTS not in self.runs[0]:
            return None
        return statistics.median(r[READ_FAULTS] for r in self.runs)

    def rate(self, step: str) -> float:
        count = self.n // 2 if step == "delete" else self.n
        return count / self.seconds[step]

    def rate_range(self, step: str) -> str:
        """The slowest and the fastest run's rate (msgs/s), when there are several."""
        if len(self.runs) < 2:
            return ""
        count = self.n // 2 if step == "delete" else self.n
        rates = [count / r[step] for r in self.runs]
        return f"{min(rates):,.0f}..{max(rates):,.0f}"


def timed_faults(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """(seconds, the process's minor page faults meanwhile, ``fn()``), cyclic GC off."""
    gc.collect()
    gc.disable()
    try:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = perf_counter()
        out = fn()
        seconds = perf_counter() - started
        return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, out
    finally:
        gc.enable()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    seconds, _, out = timed_faults(fn)
    return seconds, out


STEPS = ("append", "read", "delete", "reopen")
# Recorded beside the steps by the RocksDB systems: the seconds the flushes and
# compactions that the append left running (or pending) took to finish after it returned.
# The read starts once they are done, so that it measures the read, not the read sharing
# two cores with a compaction of the data just appended.
SETTLE = "settle"
SETTLE_LIMIT = 300.0  # seconds


# Recorded beside the steps by the systems at the full N: the process's minor page faults
# (every thread's, RocksDB's included) during the read, i.e. fresh memory touched.
READ_FAULTS = "read faults"
REOPENS = 5  # reopens per run of the systems at the full N; the step is their median


def timed_reopens(
    reopen: Callable[[], Any], close: Callable[[Any], None], n: int = REOPENS
) -> tuple[float, Any]:
    """``timed(reopen)`` ``n`` times, closing each but the last: (median seconds, the
    last result). One open is a few milliseconds, which a shared machine moves by half."""
    times: list[float] = []
    result: Any = None
    for i in range(n):
        seconds, result = timed(reopen)
        times.append(seconds)
        if i < n - 1:
            close(result)
    return statistics.median(times), result


# ---------------------------------------------------------------------------------------------
# Systems: each returns {step: seconds}; every step checks its result.


def run_imq(
    path: Path, items: list[tuple[bytes, bytes]], batch: int, config: QueueConfig = CONFIG
) -> dict[str, float]:
    src = Address(0, (0x4 << 60).to_bytes(8, "big") + bytes(24))
    dst = Address(0, bytes(32))
    chunks = list(batches(items, batch))

    # The workload's 40-byte keys are QueueKey's byte form (lt big-endian, then hash).
    key_of = QueueKey.from_bytes

    mc = ShardIdent.MASTERCHAIN
    out: dict[str, float] = {}

    def mc_diff(seqno: int, processed: QueueKey | None) -> tuple[QueueDiff, DiffStatistics]:
        lt = MC_LT0 + seqno * 1000
        stats = DiffStatistics(mc, QueueKey.min_for_lt(lt), QueueKey.max_for_lt(lt + 999), {})
        return QueueDiff((), {SHARD: processed} if processed else {}), stats

    queue = Queue.open(path, config)

    def append() -> None:
        for i, chunk in enumerate(chunks, 1):
            # imq's input is its value types: building them from the (key, body) pairs
            # every system is given is part of imq's append, as a peer's own encoding is
            msgs = [Message(key_of(k), src, dst, b) for k, b in chunk]
            diff = QueueDiff(msgs, {})
            assert queue.apply_diff(diff, BlockIdShort(SHARD, i), i.to_bytes(32, "big"))
            d, s = mc_diff(i, None)
            assert queue.apply_diff(d, BlockIdShort(mc, i), (i + 1 << 128).to_bytes(32, "big"), s)
            assert queue.commit_diff([TopBlock(BlockId(mc, i), i), TopBlock(BlockId(SHARD, i), i)])

    ranges = [QueueShardRange(SHARD, QueueKey.MIN, QueueKey.MAX)]

    def read() -> int:
        with queue.iterator(0, ranges, ShardIdent.BASECHAIN) as it:
            return sum(1 for _ in it)

    half = len(items) // 2

    def delete() -> int:
        i = len(chunks) + 1
        d, s = mc_diff(i, key_of(items[half - 1][0]))
        assert queue.apply_diff(d, BlockIdShort(mc, i), (i + 1 << 128).to_bytes(32, "big"), s)
        assert queue.commit_diff(
            [TopBlock(BlockId(mc, i), i), TopBlock(BlockId(SHARD, len(chunks)), i)]
        )
        return queue.run_gc()

    out["append"], _ = timed(append)
    store = queue._store  # RocksDB's properties: what the benchmark waits on
    out[SETTLE] = settle(lambda name: sum(store.property_int(t, name) for t in Table), SETTLE_LIMIT)
    out["read"], out[READ_FAULTS], count = timed_faults(read)
    assert count == len(items), count
    out["delete"], executed = timed(delete)
    assert executed > 0
    queue.close()

    def reopen() -> tuple[Queue, Any]:
        q = Queue.open(path, config)
        with q.iterator(0, ranges, ShardIdent.BASECHAIN) as it:
            return q, next(it)

    out["reopen"], (queue, first) = timed_reopens(reopen, lambda r: r[0].close())
    assert first.message.key == key_of(items[half][0]), first.message.key
    with queue.iterator(0, ranges, ShardIdent.BASECHAIN) as it:
        assert sum(1 for _ in it) == len(items) - half
    queue.close()
    return out


def run_imq_unsynced(path: Path, items: list[tuple[bytes, bytes]], batch: int) -> dict[str, float]:
    return run_imq(path, items, batch, CONFIG_UNSYNCED)


def run_raw(path: Path, items: list[tuple[bytes, bytes]], batch: int) -> dict[str, float]:
    out: dict[str, float] = {}
    db = RawDb(path, CONFIG)
    cf, handle = db.cf[Table.MESSAGES], db.handle[Table.MESSAGES]

    def append() -> None:
        for chunk in batches(items, batch):
            wb = WriteBatch(raw_mode=True)
            put = wb.put
            for k, v in chunk:
                put(k, v, handle)
            db.db.write(wb)

    def read() -> int:
        ro = db.scan_options()  # as imq's scans of its message table
        return sum(1 for _ in cf.items(read_opt=ro))

    half = len(items) // 2

    def delete() -> None:
        cf.delete_range(items[0][0], items[half][0])

    out["append"], _ = timed(append)
    out[SETTLE] = settle(
        lambda name: sum(int(c.property_int_value(name) or 0) for c in db.cf.values()),
        SETTLE_LIMIT,
    )
    out["read"], out[READ_FAULTS], count = timed_faults(read)
    assert count == len(items)
    out["delete"], _ = timed(delete)
    cf = handle = None  # a live column family keeps RocksDB open
    db.close()

    def reopen() -> tuple[RawDb, Any]:
        again = RawDb(path, CONFIG)
        ro = again.scan_options()
        return again, next(iter(again.cf[Table.MESSAGES].items(read_opt=ro)))

    out["reopen"], (db, first) = timed_reopens(reopen, lambda r: r[0].close())
    assert first[0] == items[half][0]
    db.close()
    return out


def _sqlite_connect(path: Path, synchronous: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    return conn


def run_sqlite(
    path: Path, items: list[tuple[bytes, bytes]], batch: int, synchronous: str = "NORMAL"
) -> dict[str, float]:
    out: dict[str, float] = {}
    path.mkdir(parents=True, exist_ok=True)
    file = path / "q.db"
    conn = _sqlite_connect(file, synchronous)
    conn.execute("CREATE TABLE q (k BLOB PRIMARY KEY, v BLOB NOT NULL) WITHOUT ROWID")

    def append() -> None:
        for chunk in batches(items, batch):
            conn.execute("BEGIN")
            conn.executemany("INSERT INTO q VALUES (?, ?)", chunk)
            conn.execute("COMMIT")

    def read() -> int:
        return sum(1 for _ in conn.execute("SELECT k, v FROM q ORDER BY k"))

    half = len(items) // 2

    def delete() -> None:
        conn.execute("BEGIN")
        conn.execute("DELETE FROM q WHERE k < ?", (items[half][0],))
        conn.execute("COMMIT")

    out["append"], _ = timed(append)
    out["read"], out[READ_FAULTS], count = timed_faults(read)
    assert count == len(items)
    out["delete"], _ = timed(delete)
    conn.close()

    def reopen() -> tuple[sqlite3.Connection, Any]:
        c = _sqlite_connect(file, synchronous)
        return c, c.execute("SELECT k, v FROM q ORDER BY k LIMIT 1").fetchone()

    out["reopen"], (conn, first) = timed_reopens(reopen, lambda r: r[0].close())
    assert first[0] == items[half][0]
    conn.close()
    return out


def run_sqlite_full(path: Path, items: list[tuple[bytes, bytes]], batch: int) -> dict[str, float]:
    return run_sqlite(path, items, batch, "FULL")


def run_pq_ack(path: Path, items: list[tuple[bytes, bytes]], batch: int) -> dict[str, float]:
    from persistqueue import SQLiteAckQueue

    out: dict[str, float] = {}
    q = SQLiteAckQueue(str(path), multithreading=False)
    ids: list[int] = []

    def append() -> None:
        for chunk in batches(items, batch):
            for item in chunk:
                q.put(item)
            q.task_done()  # a no-op with auto_commit (the ack queue supports no other)

    def read() -> int:
        n = 0
        for chunk in batches(items, batch):
            for _ in chunk:
                row = q.get(block=False, raw=True)
                ids.append(row["pqid"])
                n += 1
            q.task_done()
        return n

    half = len(items) // 2

    def delete() -> None:
        for chunk in batches(ids[:half], batch):
            for pqid in chunk:
                q.ack(id=pqid)
            q.task_done()
        q.clear_acked_data(max_delete=half + 1, keep_latest=0)

    out["append"], _ = timed(append)
    out["read"], count = timed(read)
    assert count == len(items)
    out["delete"], _ = timed(delete)
    q.close()

    def reopen() -> Any:
        again = SQLiteAckQueue(str(path), multithreading=False)
        first = again.get(block=False)
        again.close()
        return first

    out["reopen"], first = timed(reopen)
    assert first == items[half], "first remaining message"
    return out


def run_pq_file(path: Path, items: list[tuple[bytes, bytes]], batch: int) -> dict[str, float]:
    from persistqueue import Queue as FileQueue

    out: dict[str, float] = {}
    q = FileQueue(str(path), tempdir=str(path.parent))
    half = len(items) // 2

    def append() -> None:
        for item in items:
            q.put(item)

    def read_half() -> int:
        return sum(1 for _ in range(half) if q.get(block=False) is not None)

    def read_rest() -> int:
        return sum(1 for _ in range(len(items) - half) if q.get(block=False) is not None)

    out["append"], _ = timed(append)
    seconds1, n1 = timed(read_half)
    out["delete"], _ = timed(q.task_done)  # persists the read position, drops read chunks
    seconds2, n2 = timed(read_rest)
    out["read"] = seconds1 + seconds2
    assert n1 + n2 == len(items)
    q = None  # the file queue has no close; drop it before reopening

    def reopen() -> Any:
        again = FileQueue(str(path), tempdir=str(path.parent))
        return again.get(block=False)

    out["reopen"], first = timed(reopen)
    assert first == items[half]
    return out


def run_diskcache(path: Path, items: list[tuple[bytes, bytes]], batch: int) -> dict[str, float]:
    from diskcache import Deque

    out: dict[str, float] = {}
    dq = Deque(directory=str(path))

    def append() -> None:
        for chunk in batches(items, batch):
            dq.extend(chunk)

    def read() -> int:
        return sum(1 for _ in dq)

    half = len(items) // 2

    def delete() -> None:
        pop = dq.popleft
        for _ in range(half):
            pop()

    out["append"], _ = timed(append)
    out["read"], count = timed(read)
    assert count == len(items)
    out["delete"], _ = timed(delete)
    dq._cache.close()  # Deque has no close of its own

    def reopen() -> Any:
        again = Deque(directory=str(path))
        first = again.peekleft()
        again._cache.close()
        return first

    out["reopen"], first = timed(reopen)
    assert first == items[half]
    return out


@dataclass(frozen=True)
class System:
    name: str
    package: str | None
    slow: int  # 0: full N, 1: slow_n, 2: slowest_n
    run: Callable[[Path, list[tuple[bytes, bytes]], int], dict[str, float]]
    durability: str
    label: str  # the durability in a few words, for the tables


FSYNC_PER_BATCH = "fsync per batch"
NO_FSYNC = "no fsync per batch"

SYSTEMS = (
    System(
        "imq",
        None,
        0,
        run_imq,
        f"{FSYNC_PER_BATCH}: each diff reaches RocksDB's WAL with one write() (no fsync); "
        "each commit_diff fsyncs the WAL (QueueConfig() defaults: sync_commits=True; GC "
        "worker off), which makes the batch and every diff before it survive power loss or "
        "an OS crash once the commit returns; a process crash loses nothing applied",
        FSYNC_PER_BATCH,
    ),
    System(
        "imq, sync_commits=False",
        None,
        0,
        run_imq_unsynced,
        f"{NO_FSYNC}: the same WAL writes, never an fsync (QueueConfig(sync_commits=False)): "
        "a process crash loses nothing applied; an OS crash or power loss can lose the "
        "batches the OS had not yet written back. The guarantee of sqlite3 WAL with "
        "synchronous=NORMAL",
        NO_FSYNC,
    ),
    System(
        "raw rocksdict (floor)",
        None,
        0,
        run_raw,
        f"{NO_FSYNC}: WAL on, no fsync (as imq with sync_commits=False); imq's table "
        "options; delete = one delete_range",
        NO_FSYNC,
    ),
    System(
        "sqlite3",
        None,
        0,
        run_sqlite,
        f"{NO_FSYNC}: WAL, synchronous=NORMAL (each COMMIT writes the WAL without fsync; "
        "fsync at checkpoints only): a process crash loses no committed transaction, an OS "
        "crash or power loss can roll back recent ones; WITHOUT ROWID, executemany, one "
        "transaction per batch",
        NO_FSYNC,
    ),
    System(
        "sqlite3, synchronous=FULL",
        None,
        0,
        run_sqlite_full,
        f"{FSYNC_PER_BATCH}: WAL, synchronous=FULL (each COMMIT fsyncs the WAL): a "
        "committed batch survives power loss or an OS crash, as imq's committed batches "
        "do; otherwise as sqlite3",
        FSYNC_PER_BATCH,
    ),
    System(
        "persist-queue SQLiteAckQueue",
        "persist-queue",
        2,
        run_pq_ack,
        "SQLite defaults (rollback journal, synchronous=FULL); one commit per put, get "
        "and ack (the ack queue refuses auto_commit=False); pickled items",
        "fsync per put",
    ),
    System(
        "persist-queue Queue (file)",
        "persist-queue",
        2,
        run_pq_file,
        "flush per put, info file rewritten per put, fsync per chunk of 100 (defaults); "
        "pickled items",
        "fsync per 100 puts",
    ),
    System(
        "diskcache.Deque",
        "diskcache",
        1,
        run_diskcache,
        "SQLite WAL, synchronous=NORMAL (diskcache defaults), extend() per batch; pickled items",
        NO_FSYNC,
    ),
)

# The two comparisons at equal durability: (imq row, sqlite3 row, what both do).
EQUAL_DURABILITY = (
    ("imq", "sqlite3, synchronous=FULL", FSYNC_PER_BATCH),
    ("imq, sync_commits=False", "sqlite3", NO_FSYNC),
)


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def run(args: argparse.Namespace, workdir: Path) -> tuple[str, list[Result]]:
    sizes = QUICK if args.quick else FULL
    repeats = args.repeats or (1 if args.quick else 3)
    load_start = os.getloadavg()
    items = workload(sizes.n)
    results: dict[str, Result] = {}
    skipped: list[str] = []
    present = []
    for system in SYSTEMS:
        if system.package is not None and _version(system.package) is None:
            skipped.append(f"{system.name} ({system.package} not installed)")
            continue
        n = (sizes.n, sizes.slow_n, sizes.slowest_n)[system.slow]
        results[system.name] = Result(system.name, n, system.durability, system.label)
        present.append(system)
    # The systems at full N run `repeats` times, round-robin, so that a change in the
    # machine's load hits them alike; the slow peers run once.
    order = [s for _ in range(repeats) for s in present if s.slow == 0]
    order += [s for s in present if s.slow != 0]
    for i, system in enumerate(order):
        result = results[system.name]
        path = workdir / f"{i}-{system.name.split()[0].replace('.', '-').rstrip(',')}"
        print(f"{system.name}: {result.n:,} messages ...", file=sys.stderr)
        result.runs.append(system.run(path, items[: result.n], sizes.batch))
        shutil.rmtree(path, ignore_errors=True)
    ordered = [results[s.name] for s in present]
    return render(args, sizes, ordered, skipped, load_start, repeats=repeats), ordered


def render(
    args: argparse.Namespace,
    sizes: Sizes,
    results: list[Result],
    skipped: list[str],
    load_start: tuple[float, ...],
    *,
    repeats: int,
) -> str:
    imq = results[0]
    by_name = {r.system: r for r in results}
    out = ["# imq against other Python queues (bench_peers)", ""]
    if args.quick:
        out += ["**Quick smoke run: sizes are reduced; these numbers are not results.**", ""]
    out += machine_lines(" ".join(["python -m benchmarks.bench_peers", *sys.argv[1:]]), load_start)
    versions = ", ".join(
        f"{p} {_version(p)}" for p in ("persist-queue", "diskcache") if _version(p) is not None
    )
    out += [f"- peers: {versions or 'none installed'}, sqlite {sqlite3.sqlite_version}", ""]
    out += [
        f"Messages: 40-byte ordering key + {BODY}-byte body; batches of {sizes.batch:,}. "
        "Steps in order: append all, read all in order, delete the consumed prefix "
        "(the first half), reopen and read the first remaining message (reopen with half "
        "the messages stored). Rates are messages/s (delete: messages deleted/s, a logical "
        "delete for the RocksDB systems: range tombstones whose space a later compaction "
        "gives back, untimed; sqlite3 and the libraries remove their rows at once, so the "
        "delete ratios compare different work, see Method); reopen is "
        f"in milliseconds (at the full N: the median of {REOPENS} reopens a run). Cyclic GC "
        f"off while timing. The systems at the full N ran "
        f"{repeats} time{'s' if repeats != 1 else ''}, round-robin; each figure is the "
        "median of those runs (append: slowest..fastest run in brackets). The queue "
        "libraries ran once.",
        "",
        "| system | N | append msgs/s | background work after it s | append with it msgs/s "
        "| read msgs/s | delete msgs/s | reopen + first ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        spread = r.rate_range("append")
        waited = r.settle
        out.append(
            f"| {r.system} | {r.n:,} | {r.rate('append'):,.0f}"
            f"{f' ({spread})' if spread else ''} | "
            f"{'—' if waited is None else f'{waited:.2f}'} | "
            f"{'—' if waited is None else f'{r.settled_rate:,.0f}'} | "
            f"{r.rate('read'):,.0f} | "
            f"{r.rate('delete'):,.0f} | {r.seconds['reopen'] * 1e3:.1f} |"
        )
    out += [
        "",
        "*Background work after it*: for the RocksDB systems, how long the flushes and "
        "compactions the append left running or pending took to finish after it returned "
        "(the median run); the read starts only then, so it times the read alone, not the "
        "read sharing this machine's two cores with a compaction of the data just written. "
        "*Append with it*: the append's rate with that wait counted, the fair figure for "
        "the work an append costs. The other systems leave no background work (sqlite3 "
        "checkpoints its WAL inside a COMMIT): their append is already all of it.",
    ]
    faults = [(r.system, r.read_faults) for r in results if r.read_faults is not None]
    if faults:
        out += [
            "",
            "Minor page faults during the read (the median of the runs; the whole process, "
            "RocksDB's threads included), i.e. memory the read touched for the first time: "
            + ", ".join(f"{name} {count:,.0f}" for name, count in faults)
            + ". The systems run one after another in one process, so a later one may "
            "reuse memory an earlier one freed.",
        ]
    out += [
        "",
        "## Append at equal durability",
        "",
        "Each pair gives its committed batches the same guarantee (see *Durability of each "
        "system*). Ratio: of the medians; per round: each round's imq run against the same "
        "round's sqlite3 run, sorted.",
        "",
        "| durability | imq | imq append msgs/s | sqlite3 | sqlite3 append msgs/s | ratio "
        "| ratio per round | ratio, imq's background work counted |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for mine, theirs, label in EQUAL_DURABILITY:
        a, b = by_name.get(mine), by_name.get(theirs)
        if a is None or b is None:
            continue
        # Round i of each ran minutes apart at most: a paired ratio per round is less
        # sensitive to the machine's load drifting than the ratio of the medians.
        paired = sorted(y["append"] / x["append"] for x, y in zip(a.runs, b.runs, strict=True))
        per_round = ", ".join(f"{r:.2f}x" for r in paired)
        out.append(
            f"| {label} | {a.system} | {a.rate('append'):,.0f} | {b.system} | "
            f"{b.rate('append'):,.0f} | **{a.rate('append') / b.rate('append'):.2f}x** | "
            f"{per_round} | {a.settled_rate / b.settled_rate:.2f}x |"
        )
    out += [
        "",
        "## imq's ratio to each (rate per message; reopen: their time ÷ imq's)",
        "",
        f"imq here is the default row ({FSYNC_PER_BATCH}); the rows marked "
        f"*{NO_FSYNC}* give their batches a weaker guarantee, so their ratios are not at "
        "equal durability (the table above is).",
        "",
        "| system | durability | append | append, background work counted | read | delete "
        "| reopen |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results[1:]:
        out.append(
            f"| {r.system} | {r.label} | {imq.rate('append') / r.rate('append'):.2f}x | "
            f"{imq.settled_rate / r.settled_rate:.2f}x | "
            f"{imq.rate('read') / r.rate('read'):.2f}x | "
            f"{imq.rate('delete') / r.rate('delete'):.2f}x | "
            f"{r.seconds['reopen'] / imq.seconds['reopen']:.2f}x |"
        )
    out += ["", "## Durability of each system", ""]
    out += [f"- **{r.system}** ({r.n:,} messages): {r.durability}" for r in results]
    if skipped:
        out += ["", "Skipped: " + "; ".join(skipped)]
    out += ["", METHOD]
    return "\n".join(out)


METHOD = """## Method

- One process, systems in turn, each run on a fresh directory under the temp dir. The
  systems at the full N run `--repeats` times (3 by default) round-robin, so that a
  change in the machine's load hits each alike; every figure is the median of its runs,
  and the append column gives the slowest and fastest run too. The queue libraries run
  once (the full run takes minutes; repeat it to see their spread).
- Durability: imq's default commits with fsync and sqlite3 NORMAL does not, so their
  ratio is not at equal durability. Two pairs are: imq (fsync per commit, i.e. per
  batch) with sqlite3 `synchronous=FULL` (fsync per transaction, i.e. per batch), and
  imq with `sync_commits=False` with sqlite3 `synchronous=NORMAL` (neither fsyncs a
  batch; both survive a process crash, not necessarily a power loss). The section
  *Durability of each system* says what each row does.
- The queue libraries (persist-queue, diskcache) run at the smaller N; their per-message
  rates are compared with imq's at the full N. A smaller N favours them (smaller files,
  warmer caches).
- imq's messages carry source and destination addresses (66 more bytes per row) that
  the peers do not store; every other system stores the same key and body bytes.
- imq append: per batch, the `Message` values built from the (key, body) pairs every
  system is given (until stop 33 they were built before the timing, which no other
  system was spared: about 0.9 s of 1,000,000 messages, a third to a half of imq's
  append), `QueueDiff` construction, `apply_diff` of one source shard's
  diff, `apply_diff` of an empty masterchain diff and `commit_diff` (fsync, or none with
  `sync_commits=False`). The batches arrive in key order, as a collator's messages do, so
  `QueueDiff` checks the order in one pass and sorts nothing. Read: one
  iterator over the source shard. Delete: an empty masterchain diff whose `processed_to`
  names the last message of the first half, its commit, and one `run_gc()` pass.
  Reopen: `Queue.open` (RocksDB open, cache warm-up, startup checks) + iterator + `next`.
- After the append, imq and raw rocksdict wait until RocksDB runs no flush or compaction
  and has none pending (`rocksdb.num-running-compactions`, `num-running-flushes`,
  `compaction-pending`, `num-immutable-mem-table`, summed over the tables, polled every
  10 ms); the wait is reported, and counted in the *append with it* figures. Before this
  wait was added (stop 26) the read overlapped the flush and L0 compaction that imq's
  append had just started (its 320-byte rows filled four 64 MiB memtables, RocksDB's
  trigger of four L0 files: in one run the compaction moved three files down and
  rewrote one, 60 MB read and 119 MB written with the last flush, 0.56 s; raw
  rocksdict's 240-byte rows left three L0 files and a flush). The read step then read
  521 MB from files against raw's 123 MB (`/proc/self/io`, the background work's reads
  included) and imq read at 0.40x of raw rocksdict; with the wait, 0.69x. Against sqlite3
  the ratio barely moved (0.82x before, 0.78x after, in runs at different hours): sqlite3
  builds three objects a row, imq about twice as many.
- Reopen, for imq, raw rocksdict and sqlite3: the median of 5 reopens (`REOPENS`) in each run
  (each closed before the next), then the median over the runs; the queue libraries
  reopen once.
- Delete on RocksDB (imq's GC pass, raw rocksdict's `delete_range`) writes range
  tombstones: the rows stop being readable at once and their space comes back when a
  background compaction merges the files (not waited for, not timed; imq compacts the
  ranges itself once they hold `compaction_debt` messages, 1,000,000 by default, which
  this step does not reach). sqlite3's `DELETE` takes the rows out of its B-tree inside
  the timing. The delete ratios are therefore those of a logical delete against a
  physical one, not of the same work.
- raw rocksdict: the floor, with imq's column-family options; delete is one
  `delete_range` (no compaction); reopen is an open of the same directory + the first item.
- Reads of the RocksDB systems: raw rocksdict reads with the `ReadOptions` imq's scans
  of its message table use under the same config (`QueueConfig.message_scans_fill_cache`,
  on by default: the blocks go into the block cache). The first read in a process then
  pays a page fault for each 4 KiB of the cache it fills for the first time (counted
  below the table); with that setting off both read around the cache.
- persist-queue file `Queue`: it has no partial acknowledgement, so the read runs in two
  halves with `task_done()` (which persists the read position and deletes consumed chunk
  files) between them; that `task_done()` is its delete.
- persist-queue `SQLiteAckQueue`: read = `get` (marks a row unacked, one commit each),
  delete = `ack` per message + `clear_acked_data`; reopen resumes unacked rows.
"""


def write_plot(results: list[Result], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib not installed"
    fig, ax = plt.subplots(figsize=(10, 5))
    steps = ("append", "read", "delete")
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        xs = [s + i * width for s in range(len(steps))]
        ax.bar(xs, [r.rate(s) for s in steps], width, label=f"{r.system} (N={r.n:,})")
    ax.set_xticks([s + 0.4 - width / 2 for s in range(len(steps))], steps)
    ax.set_yscale("log")
    ax.set_ylabel("messages/s (log)")
    ax.set_title("imq vs Python queues: 240-byte messages, batches of 10k")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path.name}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(
        argv,
        "peers",
        "imq against other Python queues",
        "runs of the systems at full N, round-robin (default 3; 1 with --quick)",
    )
    quiet_logs()
    with temp_workdir(args, "peers") as work:
        text, results = run(args, work)
        note = write_plot(results, args.out.with_suffix(".png"))
        write_report(args.out, text + f"\n{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
