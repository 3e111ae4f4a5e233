"""State benchmark: import and export of a 1,000,000-message persistent queue state, and
parsing the real ``shard.bin`` against pytoniq-core, in one run.

* generate once (``imq.state.synth``): 100 diffs of 10,000 messages, 4 destination shards,
  written as a zstd ``.queue`` (as the node writes it) and as a raw ``.bin``;
* import: ``Queue.import_state`` of each file into a fresh database, one subprocess per
  run so its peak RSS is the import's alone; against the raw floor, the same rows put with
  bare rocksdict ``WriteBatch``es, and a per-stage breakdown of the real import;
* export: ``Queue.export_state`` of the imported database to ``.bin`` and ``.queue``,
  with zstd level 9 alone on the same bytes;
* parse ``shard.bin`` (header, diffs, every root hashed and checked, message headers)
  with imq and with pytoniq-core.

It prints the tables and writes them, with the machine and the method, to
``benchmarks/results/state.md``. Method notes: ``benchmarks/README.md``. From the repo root::

    python -m benchmarks.bench_state                       # full run, several minutes
    python -m benchmarks.bench_state --cache DIR           # keep the generated state in DIR
    python -m benchmarks.bench_state --quick --out X.md    # smoke run, seconds
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

from benchmarks.bench_core import machine_lines, timed
from benchmarks.common import RawDb, file_sizes, parse_args, quiet_logs, write_report
from imq import BlockId, Queue, QueueConfig, ShardIdent

# ---------------------------------------------------------------------------------------------
# Sizes, seeds, targets

SEED = 20_240_601
ROOT = Path(__file__).resolve().parents[1]
TYCHO = Path(os.environ.get("IMQ_TYCHO_DATA") or ROOT / "tests" / "data" / "tycho")
SHARD_BIN = TYCHO / "persistent_state" / "shard.bin"
CONFIG = QueueConfig()  # production defaults, as a node would import with
# Exports time reads: the background GC is off so no pass runs inside a timing (an import
# requests no GC bound, so with it on a pass would find nothing; off, it cannot run at all).
READ_CONFIG = QueueConfig(gc_enabled=False)

IMPORT_RATE = 100_000  # messages/s, end to end
EXPORT_RATE = 100_000  # messages/s
RSS_LIMIT = 400 * 10**6  # bytes: "400 MB", read as 10^6 bytes (stricter than MiB)
PARSE_RATIO = 5.0  # imq at least this many times faster than pytoniq-core
MB = 10**6
COPY_PIECE = 1 << 20  # the exporter copies its chunk spool in pieces of this size


@dataclass(frozen=True, slots=True)
class Sizes:
    diffs: int
    per_diff: int
    dst_shards: int
    parse_rounds: int  # timed rounds of the shard.bin comparison (after one warm-up round)
    small_diffs: int  # memory check: the same state with this many diffs

    @property
    def small(self) -> Sizes:
        return Sizes(self.small_diffs, self.per_diff, self.dst_shards, 0, self.small_diffs)


FULL = Sizes(diffs=100, per_diff=10_000, dst_shards=4, parse_rounds=15, small_diffs=10)
QUICK = Sizes(diffs=4, per_diff=500, dst_shards=4, parse_rounds=3, small_diffs=1)


@dataclass(frozen=True, slots=True)
class StateFiles:
    """The generated state: both files and what an import needs to know about them."""

    queue: Path
    bin: Path
    block_id: BlockId
    top_update: tuple[bytes, int]
    messages: int
    chunks: int
    generation: dict[str, float]  # synth, write .queue, write .bin: seconds
    cached: bool

    @property
    def params(self) -> dict[str, Any]:
        b = self.block_id
        return {
            "workchain": b.shard.workchain,
            "prefix": b.shard.prefix,
            "seqno": b.seqno,
            "top_hash": self.top_update[0].hex(),
            "tail_len": self.top_update[1],
        }


def _block(p: dict[str, Any]) -> BlockId:
    return BlockId(ShardIdent(p["workchain"], p["prefix"]), p["seqno"])


# ---------------------------------------------------------------------------------------------
# Subprocesses: every measurement whose memory or heap matters runs in a child of its own.
# The child runs one task and prints its result as one JSON line, with its peak RSS: the
# high-water mark of its own address space (VmHWM), interpreter included. Not ru_maxrss:
# Linux carries the parent's high-water mark into a child across (v)fork and exec, so
# ru_maxrss reads the parent's peak when the parent was the larger process.


_CHILD_CODE = "import sys; from benchmarks.bench_state import child_main; child_main(sys.argv[1])"


@dataclass(frozen=True, slots=True)
class ChildResult:
    out: dict[str, Any]
    wall: float
    maxrss: int  # bytes: the child's VmHWM at exit


def run_child(task: str, scratch: Path, **params: Any) -> ChildResult:
    """Run one task in a fresh interpreter started from the repo root; the wall time
    covers the whole process (start, imports, the task, exit)."""
    args = [sys.executable, "-c", _CHILD_CODE, json.dumps({"task": task, **params})]
    out_path, err_path = scratch / "child.out", scratch / "child.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        started = perf_counter()
        code = subprocess.run(args, cwd=ROOT, stdout=out, stderr=err, check=False).returncode
        wall = perf_counter() - started
    if code != 0:
        stderr = err_path.read_text(encoding="utf-8")
        raise RuntimeError(f"task {task} failed ({code}):\n{stderr[-3000:]}")
    result = json.loads(out_path.read_text(encoding="utf-8").strip().splitlines()[-1])
    # The kernel syncs per-thread RSS counters lazily: take the larger of the two reads.
    return ChildResult(result, wall, max(result["peak_rss"], result.get("rss_after_import", 0)))


def peak_rss() -> int:
    """Bytes: the high-water mark of this process's own address space."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # Elsewhere ru_maxrss (kB on Linux, bytes on macOS), which may include the parent's.
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return usage if sys.platform == "darwin" else usage * 1024


def child_main(arg: str) -> None:
    params = json.loads(arg)
    quiet_logs()
    task = _TASKS[params.pop("task")]
    out = task(**params)
    out["peak_rss"] = peak_rss()
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------------------
# Child tasks


def task_generate(
    directory: str, diffs: int, per_diff: int, dst_shards: int, seed: int
) -> dict[str, Any]:
    from imq.state.synth import synth_state, write_synth_state

    d = Path(directory)
    synth_s, state = timed(
        lambda: synth_state(
            diffs=diffs, messages_per_diff=per_diff, dst_shards=dst_shards, seed=seed
        )
    )
    queue_s, chunks = timed(lambda: write_synth_state(state, d / "state.queue"))
    bin_s, _ = timed(lambda: write_synth_state(state, d / "state.bin"))
    block = state.block_id
    top_hash, tail_len = state.top_update
    return {
        "workchain": block.shard.workchain,
        "prefix": block.shard.prefix,
        "seqno": block.seqno,
        "top_hash": top_hash.hex(),
        "tail_len": tail_len,
        "messages": sum(len(x.messages) for x in state.diffs),
        "chunks": chunks,
        "generation": {"synth_state": synth_s, "write .queue": queue_s, "write .bin": bin_s},
    }


def task_open(db: str) -> dict[str, Any]:
    """The RSS baseline: the same imports and an open database, no import."""
    from imq.state import importer  # noqa: F401 -- loaded by the import children too

    Queue.open(db, CONFIG).close()
    shutil.rmtree(db, ignore_errors=True)
    return {}


def task_import(db: str, source: str, keep: bool, **p: Any) -> dict[str, Any]:
    queue = Queue.open(db, CONFIG)
    try:
        seconds, report = timed(
            lambda: queue.import_state(
                Path(source), _block(p), (bytes.fromhex(p["top_hash"]), p["tail_len"])
            )
        )
        rss_after_import = peak_rss()
    finally:
        started = perf_counter()
        queue.close()
        close_s = perf_counter() - started
    disk = sum(file_sizes(Path(db)).values())
    if not keep:
        shutil.rmtree(db, ignore_errors=True)
    return {
        "seconds": seconds,
        "report_seconds": report.seconds,
        "messages": report.messages,
        "bytes": report.bytes,
        "source_bytes": report.source_bytes,
        "close_s": close_s,
        "rss_after_import": rss_after_import,
        "disk": disk,
    }


def task_import_heap(db: str, source: str, **p: Any) -> dict[str, Any]:
    """One more import under ``tracemalloc``: the peak of the Python heap, to tell what
    Python holds (the state must never be whole in memory) from RocksDB's native memory.
    tracemalloc slows the import several times, so its time is not a result."""
    import tracemalloc

    with Queue.open(db, CONFIG) as queue:
        tracemalloc.start()
        queue.import_state(Path(source), _block(p), (bytes.fromhex(p["top_hash"]), p["tail_len"]))
        _, heap_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    shutil.rmtree(db, ignore_errors=True)
    return {"heap_peak": heap_peak}


def task_cli(args: list[str]) -> dict[str, Any]:
    """``python -m imq`` in this process: the parent times the whole child."""
    from imq.cli.main import main

    code = main(args)
    assert code == 0, f"imq {args} exited with {code}"
    return {}


def _instrument(targets: Sequence[tuple[Any, str, str]]) -> dict[str, float]:
    """Wrap each ``owner.name`` so the seconds spent inside it add up under its label; a
    function this version of imq lacks is left out (reported as n/a)."""
    totals: dict[str, float] = {}
    for owner, name, label in targets:
        fn = getattr(owner, name, None)
        if fn is None:
            continue
        totals[label] = 0.0

        def wrapper(*args: Any, _fn: Any = fn, _label: str = label, **kwargs: Any) -> Any:
            started = perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                totals[_label] += perf_counter() - started

        setattr(owner, name, wrapper)
    return totals


IMPORT_STAGES = (
    "header read (file + zstd + TL)",
    "chunk read (file + zstd + TL framing)",
    "BOC split + sha256 + one-root BOCs (split_roots, the hash check below inside)",
    "… of which: hash check against the diffs' lists (StateReader._check_chunk)",
    "plan (stored diffs, routes, pointer)",
    "message header parse + range check + counts (_stage_segment)",
    "message row encoding into the WriteBatch",
    "per-diff statistics, tail and info rows",
    "DB writes (Store.write: WriteBatch → RocksDB)",
)


def task_import_breakdown(db: str, source: str, **p: Any) -> dict[str, Any]:
    """The real import with a timer around each stage (wrapped once per chunk, segment or
    batch, so the wrappers cost microseconds in total)."""
    from imq.state import importer, reader
    from imq.storage import codec, rocks

    totals = _instrument(
        [
            (reader, "read_state_header", IMPORT_STAGES[0]),
            (reader, "read_chunk", IMPORT_STAGES[1]),
            (reader, "split_roots", IMPORT_STAGES[2]),
            (reader.StateReader, "_check_chunk", IMPORT_STAGES[3]),
            (importer, "_plan", IMPORT_STAGES[4]),
            (importer, "_stage_segment", IMPORT_STAGES[5]),
            (codec, "put_raw_message_rows", IMPORT_STAGES[6]),
            (importer, "_stage_diff_rows", IMPORT_STAGES[7]),
            (rocks.Store, "write", IMPORT_STAGES[8]),
        ]
    )
    out = task_import(db, source, keep=False, **p)
    out["stages"] = totals
    return out


READ_PASSES = (
    "zstd stream decompression alone",
    "file + zstd + TL framing: header, every chunk read",
    "+ split_roots, hash check (StateReader.segments())",
    "+ parse_internal_header per root",
)


def task_read_passes(source: str, runs: int) -> dict[str, Any]:
    """The import's reading parts run on their own, without a database."""
    import zstandard

    from imq.state.message import parse_internal_header
    from imq.state.reader import StateReader
    from imq.state.source import open_source
    from imq.state.tl import read_chunk, read_state_header

    def decompress() -> int:
        with open(source, "rb") as f:
            reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
            n = 0
            while piece := reader.read(COPY_PIECE):
                n += len(piece)
            return n

    def framing() -> int:
        with open_source(source) as src:
            header = read_state_header(src)
            n = sum(len(read_chunk(src, i)) for i in range(header.n_chunks))
            assert src.at_eof()
            return n

    def segments() -> int:
        with open_source(source) as src:
            return sum(len(s.roots) for s in StateReader(src).segments())

    def parsed() -> int:
        with open_source(source) as src:
            n = 0
            for s in StateReader(src).segments():
                for root in s.roots:
                    parse_internal_header(root.data, root.bits)
                    n += 1
            return n

    passes = dict(zip(READ_PASSES, (decompress, framing, segments, parsed), strict=True))
    if not source.endswith(".queue"):
        del passes[READ_PASSES[0]]
    seconds: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(runs):
        for name, fn in passes.items():
            seconds[name].append(timed(fn)[0])
    return {"seconds": seconds}


def _floor_batches(
    bin_path: str, ref: RawDb
) -> tuple[list[list[tuple[Any, bytes, bytes]]], int, int]:
    """The rows imq's import wrote, read back from ``ref`` (the database of an import of
    the same file), in the import's order and batches: each diff's message rows in file
    order, then its statistics, tail and info rows; a batch is cut after a diff once it
    holds BATCH_ROWS message rows, as ``importer._stream`` does (one segment per diff here:
    chunks and diffs both hold 10,000 roots). Every stored row is used exactly once."""
    from imq import QueueKey
    from imq.state.importer import BATCH_ROWS
    from imq.state.message import parse_internal_header
    from imq.state.reader import StateReader
    from imq.state.source import open_source
    from imq.storage import Table, codec

    msg_t, stat_t, tail_t, info_t, ptr_t = (
        Table.MESSAGES,
        Table.STATISTICS,
        Table.DIFF_TAIL,
        Table.DIFF_INFO,
        Table.COMMIT_POINTERS,
    )
    stored = {t: dict(ref.cf[t].items()) for t in (msg_t, stat_t, tail_t, info_t, ptr_t)}
    batches: list[list[tuple[Any, bytes, bytes]]] = []
    batch: list[tuple[Any, bytes, bytes]] = []
    pending = messages = 0
    with open_source(bin_path) as src:
        reader = StateReader(src)
        header = reader.header
        shard = header.shard
        assert all(not d.router_src and not d.router_dst for d in header.diffs), "partition 0"
        rows = stored[msg_t]
        for segment in reader.segments():
            for root in segment.roots:
                lt = parse_internal_header(root.data, root.bits)[0]
                key = codec.message_key(0, shard, QueueKey(lt, root.hash))
                batch.append((msg_t, key, rows.pop(key)))
            pending += len(segment.roots)
            messages += len(segment.roots)
            if segment.last:
                d = header.diffs[segment.diff_index]
                for table, key in (
                    (stat_t, codec.stat_key(shard, 0, d.max_message, d.seqno)),
                    (tail_t, codec.tail_key(shard, d.max_message, d.seqno)),
                    (info_t, codec.diff_info_key(shard, d.seqno)),
                ):
                    batch.append((table, key, stored[table].pop(key)))
            if pending >= BATCH_ROWS:
                batches.append(batch)
                batch, pending = [], 0
    batch.extend((ptr_t, k, v) for k, v in stored.pop(ptr_t).items())
    batches.append(batch)
    left = {t.value: len(r) for t, r in stored.items() if r}
    assert not left, f"rows of the import not in the floor: {left}"
    return batches, messages, sum(len(b) for b in batches)


def task_floor(ref_db: str, bin_path: str, work: str, runs: int) -> dict[str, Any]:
    """The raw floor: the rows of an import, precomputed, written with bare rocksdict on
    imq's engine configuration."""
    from rocksdict import WriteBatch

    ref = RawDb(Path(ref_db), CONFIG)
    try:
        batches, messages, rows = _floor_batches(bin_path, ref)
    finally:
        ref.close()
    seconds = []
    for run in range(runs):
        path = Path(work) / f"floor-{run}"
        db = RawDb(path, CONFIG)
        try:
            plan = [[(db.handle[t], k, v) for t, k, v in b] for b in batches]
            write = db.db.write

            def put_all(
                db_plan: list[list[tuple[Any, bytes, bytes]]] = plan, write: Any = write
            ) -> None:
                for rows_ in db_plan:
                    wb = WriteBatch(raw_mode=True)
                    put = wb.put
                    for handle, key, value in rows_:
                        put(key, value, handle)
                    write(wb)

            seconds.append(timed(put_all)[0])
            del plan
        finally:
            db.close()
        shutil.rmtree(path, ignore_errors=True)
    return {"seconds": seconds, "messages": messages, "rows": rows, "batches": len(batches)}


EXPORT_STAGES = (
    "load diff infos",
    "read messages from the DB, sort, spool (_spool_messages)",
    "… of which chunk encoding: join_roots + encode_chunk + spool write",
    "diff TL + blake3 chain (_encode_chain)",
    "header + chunk copy to the output; zstd for .queue (write_state)",
)


def task_export(db: str, dest: str, breakdown: bool, verify: str, **p: Any) -> dict[str, Any]:
    from imq.state import exporter, writer

    totals: dict[str, float] = {}
    if breakdown:
        totals = _instrument(
            [
                (exporter, "_load_infos", EXPORT_STAGES[0]),
                (exporter, "_spool_messages", EXPORT_STAGES[1]),
                (writer.ChunkSpool, "_cut", EXPORT_STAGES[2]),
                (exporter, "_encode_chain", EXPORT_STAGES[3]),
                (exporter, "write_state", EXPORT_STAGES[4]),
            ]
        )
    block = _block(p)
    with Queue.open(db, READ_CONFIG) as queue:
        seconds, report = timed(
            lambda: queue.export_state(block.shard, block.seqno, p["tail_len"], Path(dest))
        )
    out: dict[str, Any] = {
        "seconds": seconds,
        "messages": report.messages,
        "bytes": report.bytes,
        "file_bytes": Path(dest).stat().st_size,
        "bit_exact": report.bit_exact,
        "stages": totals,
    }
    if verify:
        out["identical"] = _sha256_state(dest) == verify
    os.unlink(dest)
    return out


def _sha256_state(path: str) -> str:
    """sha256 of the state's bytes (decompressed for .queue)."""
    import zstandard

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        stream: Any = f
        if path.endswith(".queue"):
            stream = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
        while piece := stream.read(COPY_PIECE):
            digest.update(piece)
    return digest.hexdigest()


ZSTD_VARIANTS = (
    ("level 9, 1 thread (what the exporter does)", 9, 0),
    ("level 9, 2 threads (info)", 9, 2),
    ("level 3, 1 thread (info)", 3, 0),
)


def task_zstd(source: str, dest: str, runs: int) -> dict[str, Any]:
    """zstd alone on the bytes of the state, written as the exporter writes them."""
    import zstandard

    seconds: dict[str, list[float]] = {name: [] for name, _, _ in ZSTD_VARIANTS}
    sizes: dict[str, int] = {}
    for _ in range(runs):
        for name, level, threads in ZSTD_VARIANTS:

            def compress(level: int = level, threads: int = threads) -> None:
                compressor = zstandard.ZstdCompressor(level=level, threads=threads)
                with (
                    open(source, "rb") as src,
                    open(dest, "wb") as raw,
                    compressor.stream_writer(raw, closefd=False) as out,
                ):
                    shutil.copyfileobj(src, out, COPY_PIECE)

            seconds[name].append(timed(compress)[0])
            sizes[name] = os.path.getsize(dest)
    os.unlink(dest)
    return {"seconds": seconds, "sizes": sizes}


_TASKS: dict[str, Callable[..., dict[str, Any]]] = {
    "generate": task_generate,
    "open": task_open,
    "import": task_import,
    "import_heap": task_import_heap,
    "cli": task_cli,
    "import_breakdown": task_import_breakdown,
    "read_passes": task_read_passes,
    "floor": task_floor,
    "export": task_export,
    "zstd": task_zstd,
}


# ---------------------------------------------------------------------------------------------
# Parsing shard.bin: imq against pytoniq-core (in the parent: a small file, no database)

Header = tuple[int, int, bytes, int, bytes]  # created_lt, src wc, src account, dst wc, dst acc


def parse_imq(path: Path) -> list[Header]:
    """The whole state with imq: header, every diff, every root hashed and checked against
    its diff's list, and each message's header."""
    from imq.state.message import parse_internal_header
    from imq.state.reader import StateReader
    from imq.state.source import open_source

    out = []
    with open_source(path) as src:
        for segment in StateReader(src).segments():
            for root in segment.roots:
                out.append(parse_internal_header(root.data, root.bits))
    return out


def parse_pytoniq(path: Path) -> list[Header]:
    """The same with pytoniq-core for the BOCs, hashes and message headers; the TL parts
    (state header, diffs, chunk framing) use imq's reader, as pytoniq has no TL for them."""
    from pytoniq_core.boc.cell import Cell
    from pytoniq_core.tlb.transaction import CommonMsgInfo, InternalMsgInfo

    from imq.state.source import open_source
    from imq.state.tl import read_chunk, read_state_header

    out = []
    with open_source(path) as src:
        header = read_state_header(src)
        expected = b"".join(d.hashes for d in header.diffs)
        at = 0
        for index in range(header.n_chunks):
            roots = Cell.from_boc(read_chunk(src, index))
            got = b"".join([c.hash for c in roots])
            if got != expected[at : at + len(got)]:
                raise ValueError(f"hash mismatch in chunk {index}")
            at += len(got)
            for cell in roots:
                info = CommonMsgInfo.deserialize(cell.begin_parse())  # type: ignore[no-untyped-call]
                if not isinstance(info, InternalMsgInfo):
                    raise ValueError("not an internal message")
                src_a, dst_a = info.src, info.dest
                out.append((info.created_lt, src_a.wc, src_a.hash_part, dst_a.wc, dst_a.hash_part))
        if at != len(expected) or not src.at_eof():
            raise ValueError("message count or trailing bytes")
    return out


Chunks = list[tuple[bytes, bytes]]  # (chunk BOC, the hashes its roots must have)


def read_chunks(path: Path) -> Chunks:
    """The chunk BOCs and their expected hashes, for the BOC-only comparison."""
    from imq.state.boc import split_roots
    from imq.state.source import open_source
    from imq.state.tl import MAX_CHUNK_ROOTS, read_chunk, read_state_header

    with open_source(path) as src:
        header = read_state_header(src)
        expected = b"".join(d.hashes for d in header.diffs)
        chunks = [read_chunk(src, i) for i in range(header.n_chunks)]
    out, at = [], 0
    for data in chunks:
        n = len(split_roots(data, max_roots=MAX_CHUNK_ROOTS))
        out.append((data, expected[at : at + 32 * n]))
        at += 32 * n
    return out


def parse_boc_imq(chunks: Chunks) -> list[Header]:
    from imq.state.boc import split_roots
    from imq.state.message import parse_internal_header
    from imq.state.tl import MAX_CHUNK_ROOTS

    out = []
    for data, expected in chunks:
        roots = split_roots(data, max_roots=MAX_CHUNK_ROOTS)
        if b"".join([r.hash for r in roots]) != expected:
            raise ValueError("hash mismatch")
        for root in roots:
            out.append(parse_internal_header(root.data, root.bits))
    return out


def _parse_boc_pytoniq(chunks: Chunks, info_of: Callable[[Any], Any]) -> list[Header]:
    from pytoniq_core.boc.cell import Cell
    from pytoniq_core.tlb.transaction import InternalMsgInfo

    out = []
    for data, expected in chunks:
        roots = Cell.from_boc(data)
        if b"".join([c.hash for c in roots]) != expected:
            raise ValueError("hash mismatch")
        for cell in roots:
            info = info_of(cell.begin_parse())  # type: ignore[no-untyped-call]
            if not isinstance(info, InternalMsgInfo):
                raise ValueError("not an internal message")
            src_a, dst_a = info.src, info.dest
            out.append((info.created_lt, src_a.wc, src_a.hash_part, dst_a.wc, dst_a.hash_part))
    return out


def parse_boc_pytoniq(chunks: Chunks) -> list[Header]:
    """The header only (``CommonMsgInfo``), as imq parses it."""
    from pytoniq_core.tlb.transaction import CommonMsgInfo

    return _parse_boc_pytoniq(chunks, CommonMsgInfo.deserialize)


def parse_boc_pytoniq_full(chunks: Chunks) -> list[Header]:
    """Informational: the whole message (``MessageAny``: header, init, body) per root."""
    from pytoniq_core.tlb.transaction import MessageAny

    return _parse_boc_pytoniq(chunks, lambda s: MessageAny.deserialize(s).info)


PARSE_VARIANTS = (
    "imq, whole file",
    "pytoniq-core, whole file",
    "imq, BOC + hash + header only",
    "pytoniq-core, BOC + hash + header only",
    "pytoniq-core, BOC + hash + whole MessageAny (info)",
)


def bench_parse(rounds: int) -> tuple[dict[str, list[float]], int]:
    """One warm-up round, then ``rounds`` rounds running every variant in turn."""
    chunks = read_chunks(SHARD_BIN)
    fns: dict[str, Callable[[], list[Header]]] = dict(
        zip(
            PARSE_VARIANTS,
            (
                lambda: parse_imq(SHARD_BIN),
                lambda: parse_pytoniq(SHARD_BIN),
                lambda: parse_boc_imq(chunks),
                lambda: parse_boc_pytoniq(chunks),
                lambda: parse_boc_pytoniq_full(chunks),
            ),
            strict=True,
        )
    )
    reference = fns[PARSE_VARIANTS[0]]()
    for name, fn in fns.items():  # the warm-up round also checks that every side agrees
        assert fn() == reference, f"{name} parses shard.bin differently"
    seconds: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            seconds[name].append(timed(fn)[0])
    return seconds, len(reference)


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class Report:
    sizes: Sizes
    quick: bool
    repeats: int
    command: str
    load_start: tuple[float, ...]
    files: StateFiles | None = None
    file_sizes: dict[str, int] = field(default_factory=dict)
    parse: dict[str, list[float]] = field(default_factory=dict)
    parse_messages: int = 0
    baseline_rss: list[int] = field(default_factory=list)
    imports: dict[str, list[ChildResult]] = field(default_factory=dict)
    small: StateFiles | None = None
    small_imports: list[ChildResult] = field(default_factory=list)
    cli: list[ChildResult] = field(default_factory=list)
    heap_peak: int = 0
    floor: dict[str, Any] = field(default_factory=dict)
    breakdown: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    read_passes: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    exports: dict[str, list[ChildResult]] = field(default_factory=dict)
    zstd: dict[str, Any] = field(default_factory=dict)


def _code_stamp() -> str:
    """Changes when imq's state code changes, so a cached state is not reused after."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "imq" / "state").glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def generate(sizes: Sizes, directory: Path, scratch: Path, cached: bool) -> StateFiles:
    """Generate the state into ``directory`` (in a child), or reuse it if ``cached`` and
    its description matches these sizes, seed and code."""
    meta_path = directory / "state.json"
    want = {
        "diffs": sizes.diffs,
        "per_diff": sizes.per_diff,
        "dst_shards": sizes.dst_shards,
        "seed": SEED,
        "code": _code_stamp(),
    }
    meta: dict[str, Any] | None = None
    reused = False
    if cached and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("want") == want and all(
            (directory / n).exists() for n in ("state.queue", "state.bin")
        ):
            reused = True
        else:
            meta = None
    if meta is None:
        directory.mkdir(parents=True, exist_ok=True)
        meta = {
            "want": want,
            **run_child(
                "generate",
                scratch,
                directory=str(directory),
                diffs=sizes.diffs,
                per_diff=sizes.per_diff,
                dst_shards=sizes.dst_shards,
                seed=SEED,
            ).out,
        }
        meta.pop("peak_rss", None)
        meta["sha256_bin"] = _sha256_state(str(directory / "state.bin"))
        meta_path.write_text(json.dumps(meta, indent=1))
    return StateFiles(
        queue=directory / "state.queue",
        bin=directory / "state.bin",
        block_id=_block(meta),
        top_update=(bytes.fromhex(meta["top_hash"]), meta["tail_len"]),
        messages=meta["messages"],
        chunks=meta["chunks"],
        generation=meta["generation"],
        cached=reused,
    )


def bench_imports(
    report: Report, files: StateFiles, work: Path, scratch: Path, repeats: int
) -> Path:
    """Import runs alternating between the two files, one child each; the database of the
    last ``.queue`` run is kept (returned) for the floor check and the exports."""
    report.baseline_rss = [
        run_child("open", scratch, db=str(work / f"open-{i}")).maxrss for i in range(repeats)
    ]
    ref = work / "imported"
    report.imports = {".queue": [], ".bin": []}
    for run in range(repeats):
        for suffix, path in ((".queue", files.queue), (".bin", files.bin)):
            keep = suffix == ".queue" and run == repeats - 1
            db = ref if keep else work / f"import-{run}{suffix}"
            print(f"  import {suffix} run {run + 1}/{repeats} ...", flush=True)
            result = run_child(
                "import", scratch, db=str(db), source=str(path), keep=keep, **files.params
            )
            assert result.out["messages"] == files.messages
            report.imports[suffix].append(result)
    assert report.small is not None
    small = report.small
    for run in range(repeats):
        print(
            f"  import .queue of {small.messages:,} (memory check) {run + 1}/{repeats}", flush=True
        )
        db = work / f"small-{run}"
        result = run_child(
            "import", scratch, db=str(db), source=str(small.queue), keep=False, **small.params
        )
        assert result.out["messages"] == small.messages
        report.small_imports.append(result)
    print("  import .queue under tracemalloc (Python heap peak) ...", flush=True)
    report.heap_peak = run_child(
        "import_heap", scratch, db=str(work / "heap"), source=str(files.queue), **files.params
    ).out["heap_peak"]
    top_hash, tail_len = files.top_update
    for run in range(repeats):
        db = work / f"cli-{run}"
        print(f"  python -m imq import (.queue) run {run + 1}/{repeats} ...", flush=True)
        args = ["import", str(db), str(files.queue), "--block-id", str(files.block_id)]
        args += ["--top-update", f"{top_hash.hex()}:{tail_len}", "--no-progress"]
        report.cli.append(run_child("cli", scratch, args=args))
        shutil.rmtree(db, ignore_errors=True)
    return ref


def bench_breakdown(
    report: Report, files: StateFiles, work: Path, scratch: Path, repeats: int
) -> None:
    for suffix, path in ((".queue", files.queue), (".bin", files.bin)):
        print(f"  breakdown {suffix} ...", flush=True)
        report.breakdown[suffix] = [
            run_child(
                "import_breakdown",
                scratch,
                db=str(work / f"breakdown-{run}{suffix}"),
                source=str(path),
                **files.params,
            ).out
            for run in range(repeats)
        ]
        report.read_passes[suffix] = run_child(
            "read_passes", scratch, source=str(path), runs=repeats
        ).out["seconds"]


def bench_exports(
    report: Report, files: StateFiles, ref: Path, *, work: Path, scratch: Path, repeats: int
) -> None:
    expected = json.loads((files.bin.parent / "state.json").read_text())["sha256_bin"]
    report.exports = {".queue": [], ".bin": []}
    for run in range(repeats):
        for suffix in (".queue", ".bin"):
            print(f"  export {suffix} run {run + 1}/{repeats} ...", flush=True)
            result = run_child(
                "export",
                scratch,
                db=str(ref),
                dest=str(work / f"export{suffix}"),
                breakdown=run == repeats - 1,
                verify=expected if run == 0 else "",
                **files.params,
            )
            assert result.out["messages"] == files.messages
            report.exports[suffix].append(result)
    print("  zstd alone ...", flush=True)
    report.zstd = run_child(
        "zstd", scratch, source=str(files.bin), dest=str(work / "zstd.out"), runs=repeats
    ).out


def run(args: argparse.Namespace, work: Path, cache: Path | None) -> Report:
    sizes = QUICK if args.quick else FULL
    command = " ".join(["python -m benchmarks.bench_state", *sys.argv[1:]])
    report = Report(sizes, args.quick, args.repeats, command, os.getloadavg())
    scratch = work / "scratch"
    scratch.mkdir()
    total = sizes.diffs * sizes.per_diff
    where = cache if cache is not None else work / "state"
    print(f"state of {sizes.diffs} diffs x {sizes.per_diff:,} = {total:,} messages ...", flush=True)
    files = report.files = generate(sizes, where, scratch, cached=cache is not None)
    report.file_sizes = {".queue": files.queue.stat().st_size, ".bin": files.bin.stat().st_size}
    small = sizes.small
    print(f"memory check state: {small.diffs * small.per_diff:,} messages ...", flush=True)
    report.small = generate(small, where / "small", scratch, cached=cache is not None)
    print(f"parse shard.bin: imq vs pytoniq-core, {sizes.parse_rounds} rounds ...", flush=True)
    report.parse, report.parse_messages = bench_parse(sizes.parse_rounds)
    print("import ...", flush=True)
    ref = bench_imports(report, files, work, scratch, args.repeats)
    print("raw floor ...", flush=True)
    report.floor = run_child(
        "floor",
        scratch,
        ref_db=str(ref),
        bin_path=str(files.bin),
        work=str(work),
        runs=args.repeats,
    ).out
    print("import breakdown ...", flush=True)
    bench_breakdown(report, files, work, scratch, args.repeats)
    print("export ...", flush=True)
    bench_exports(report, files, ref, work=work, scratch=scratch, repeats=args.repeats)
    return report


# ---------------------------------------------------------------------------------------------
# Report


def _med(values: Sequence[float]) -> float:
    return statistics.median(values)


def _runs(values: Iterator[float] | Sequence[float], fmt: str = "{:.2f}") -> str:
    return ", ".join(fmt.format(v) for v in values)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


class Render:
    """The results file, built from a finished :class:`Report`."""

    def __init__(self, report: Report) -> None:
        self.r = report
        assert report.files is not None
        self.files: StateFiles = report.files
        self.n = report.files.messages
        self.verdicts: list[bool] = []

    def rate(self, seconds: Sequence[float]) -> float:
        return self.n / _med(seconds)

    def targets(self) -> list[str]:
        r = self.r
        lines = [
            "| metric | value | target | result |",
            "|---|---:|---:|---|",
        ]

        def row(metric: str, value: str, target: str, ok: bool) -> None:
            self.verdicts.append(ok)
            lines.append(f"| {metric} | {value} | {target} | {_verdict(ok)} |")

        for suffix in (".queue", ".bin"):
            runs = r.imports[suffix]
            rate = self.rate([c.out["seconds"] for c in runs])
            row(
                f"import {suffix}, end to end",
                f"{rate:,.0f} msgs/s",
                "≥ 100,000 msgs/s",
                rate >= IMPORT_RATE,
            )
            peak = max(c.maxrss for c in runs)
            row(
                f"import {suffix}, peak RSS of the importing process (max of {len(runs)})",
                f"{peak / MB:.0f} MB",
                "< 400 MB",
                peak < RSS_LIMIT,
            )
        for suffix in (".queue", ".bin"):
            rate = self.rate([c.out["seconds"] for c in r.exports[suffix]])
            row(f"export {suffix}", f"{rate:,.0f} msgs/s", "≥ 100,000 msgs/s", rate >= EXPORT_RATE)
        p = {k: _med(v) for k, v in r.parse.items()}
        whole = p[PARSE_VARIANTS[1]] / p[PARSE_VARIANTS[0]]
        boc = p[PARSE_VARIANTS[3]] / p[PARSE_VARIANTS[2]]
        row(
            "parse shard.bin, whole file: pytoniq-core time ÷ imq time",
            f"{whole:.1f}x",
            "≥ 5x",
            whole >= PARSE_RATIO,
        )
        row(
            "parse shard.bin, BOC + hash + header only: pytoniq-core ÷ imq",
            f"{boc:.1f}x",
            "≥ 5x",
            boc >= PARSE_RATIO,
        )
        return lines

    def imports(self) -> list[str]:
        r, n = self.r, self.n
        fl = r.floor
        floor_rate = self.rate(fl["seconds"])
        lines = [
            "| run | messages | median s | runs s | msgs/s | ratio to raw floor "
            "| peak RSS MB (runs) | RSS at end of import MB | close s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for suffix in (".queue", ".bin"):
            runs = r.imports[suffix]
            sec = [c.out["seconds"] for c in runs]
            rate = self.rate(sec)
            lines.append(
                f"| `Queue.import_state`, {suffix} | {n:,} | {_med(sec):.2f} | {_runs(sec)} | "
                f"{rate:,.0f} | {rate / floor_rate:.2f} | "
                f"{_runs((c.maxrss / MB for c in runs), '{:.0f}')} | "
                f"{_runs((c.out['rss_after_import'] / MB for c in runs), '{:.0f}')} | "
                f"{_runs(c.out['close_s'] for c in runs)} |"
            )
        small = r.small
        assert small is not None
        sec = [c.out["seconds"] for c in r.small_imports]
        lines.append(
            f"| `Queue.import_state`, .queue, a {small.messages:,}-message state (same "
            f"generator and seed; memory check) | {small.messages:,} | {_med(sec):.2f} | "
            f"{_runs(sec)} | "
            f"{small.messages / _med(sec):,.0f} | — | "
            f"{_runs((c.maxrss / MB for c in r.small_imports), '{:.0f}')} | "
            f"{_runs((c.out['rss_after_import'] / MB for c in r.small_imports), '{:.0f}')} | "
            f"{_runs(c.out['close_s'] for c in r.small_imports)} |"
        )
        cli = [c.wall for c in r.cli]
        lines.append(
            f"| `imq import` CLI (.queue), the whole child process: interpreter start, "
            f"imports, open, import, close (info) | {n:,} | {_med(cli):.2f} | {_runs(cli)} | "
            f"{self.rate(cli):,.0f} | {self.rate(cli) / floor_rate:.2f} | "
            f"{_runs((c.maxrss / MB for c in r.cli), '{:.0f}')} | — | — |"
        )
        fsec = fl["seconds"]
        lines.append(
            f"| raw floor: the same {fl['rows']:,} rows, precomputed, {fl['batches']} "
            f"`WriteBatch`es | {n:,} | {_med(fsec):.2f} | {_runs(fsec)} | {floor_rate:,.0f} "
            f"| 1.00 | — | — | — |"
        )
        base = r.baseline_rss
        last = r.imports[".queue"][-1].out
        big_rss = _med([c.maxrss for c in r.imports[".queue"]])
        small_rss = _med([c.maxrss for c in r.small_imports])
        lines += [
            "",
            f"Baseline: a process that imports the same modules and only opens and closes the "
            f"queue peaks at {_runs((b / MB for b in base), '{:.0f}')} MB. The import's median "
            f"peak RSS is {small_rss / MB:.0f} MB for {small.messages:,} messages and "
            f"{big_rss / MB:.0f} MB for {n:,} ({(big_rss - small_rss) / MB:+.0f} MB). "
            f"The Python heap peaks at {r.heap_peak / MB:.0f} MB during the import "
            f"(`tracemalloc`, one extra run whose time is not reported); the rest above the "
            f"baseline is native memory: RocksDB (memtables of up to 2 x 64 MiB for the "
            f"message table) and the allocator. "
            f"The state is "
            f"{r.file_sizes['.bin'] / MB:.1f} MB raw ({r.file_sizes['.queue'] / MB:.1f} MB as "
            f"zstd `.queue`); the database after the import takes {last['disk'] / MB:.1f} MB "
            f"(closed). Peak RSS is the child's own high-water mark (`VmHWM`), interpreter "
            f'included, read at exit; "at end of import" is the same mark read right after '
            f"`import_state` returned, before the close flushed the memtables.",
        ]
        return lines

    def breakdown(self) -> list[str]:
        r = self.r
        lines = [
            "| stage | .queue s | .bin s | share of .queue |",
            "|---|---:|---:|---:|",
        ]
        med = {
            s: {st: _med([b["stages"][st] for b in runs]) for st in runs[0]["stages"]}
            for s, runs in r.breakdown.items()
        }
        tot = {s: _med([b["seconds"] for b in runs]) for s, runs in r.breakdown.items()}
        for st in IMPORT_STAGES:
            if st not in med[".queue"]:
                lines.append(f"| {st} | n/a | n/a | |")
                continue
            q, b = med[".queue"][st], med[".bin"][st]
            lines.append(f"| {st} | {q:.2f} | {b:.2f} | {q / tot['.queue']:.0%} |")
        # "…" stages run inside the stage above them: not counted twice
        rest = {
            s: tot[s] - sum(v for st, v in med[s].items() if not st.startswith("…")) for s in tot
        }
        lines.append(
            f"| rest: generators, loop, progress, marker, finish | {rest['.queue']:.2f} | "
            f"{rest['.bin']:.2f} | {rest['.queue'] / tot['.queue']:.0%} |"
        )
        lines.append(
            f"| **total `import_state` with timers** | **{tot['.queue']:.2f}** | "
            f"**{tot['.bin']:.2f}** | 100% |"
        )
        lines += [
            "",
            "The same reading work on its own, without a database (medians; each line adds "
            "a step to the one above):",
            "",
            "| pass | .queue s | .bin s |",
            "|---|---:|---:|",
        ]
        for name in READ_PASSES:
            vals = [r.read_passes[s].get(name) for s in (".queue", ".bin")]
            cells = [f"{_med(v):.2f}" if v else "—" for v in vals]
            lines.append(f"| {name} | {' | '.join(cells)} |")
        return lines

    def exports(self) -> list[str]:
        r, n = self.r, self.n
        lines = [
            "| export | messages | median s | runs s | msgs/s | file MB | peak RSS MB "
            "| bit-exact | identical to the generated state |",
            "|---|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for suffix in (".queue", ".bin"):
            runs = r.exports[suffix]
            sec = [c.out["seconds"] for c in runs]
            first = runs[0].out
            lines.append(
                f"| `Queue.export_state` → {suffix} | {n:,} | {_med(sec):.2f} | {_runs(sec)} | "
                f"{self.rate(sec):,.0f} | {first['file_bytes'] / MB:.1f} | "
                f"{max(c.maxrss for c in runs) / MB:.0f} | {first['bit_exact']} | "
                f"{first.get('identical')} |"
            )
        stages = {s: r.exports[s][-1].out["stages"] for s in (".queue", ".bin")}
        totals = {s: r.exports[s][-1].out["seconds"] for s in (".queue", ".bin")}
        lines += [
            "",
            "Where an export's time goes (the last run of each, with a timer around each stage):",
            "",
            "| stage | .queue s | .bin s |",
            "|---|---:|---:|",
        ]
        for st in EXPORT_STAGES:
            if st not in stages[".queue"]:
                lines.append(f"| {st} | n/a | n/a |")
                continue
            lines.append(f"| {st} | {stages['.queue'][st]:.2f} | {stages['.bin'][st]:.2f} |")
        top = [st for st in EXPORT_STAGES if not st.startswith("…")]
        rest = {s: totals[s] - sum(stages[s].get(st, 0.0) for st in top) for s in totals}
        lines.append(
            f"| rest: snapshot, zstd frame end, fsync, rename | {rest['.queue']:.2f} | "
            f"{rest['.bin']:.2f} |"
        )
        lines.append(f"| **total** | **{totals['.queue']:.2f}** | **{totals['.bin']:.2f}** |")
        z = r.zstd
        lines += [
            "",
            f"zstd alone on the same {r.file_sizes['.bin'] / MB:.1f} MB (the state's bytes, "
            f"copied through `stream_writer` in 1 MiB pieces, as `write_state` does):",
            "",
            "| compression | median s | runs s | MB/s in | output MB | msgs/s if it were all |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, _, _ in ZSTD_VARIANTS:
            sec = z["seconds"][name]
            lines.append(
                f"| {name} | {_med(sec):.2f} | {_runs(sec)} | "
                f"{r.file_sizes['.bin'] / MB / _med(sec):.0f} | {z['sizes'][name] / MB:.1f} | "
                f"{self.rate(sec):,.0f} |"
            )
        return lines

    def parse(self) -> list[str]:
        r = self.r
        p = {k: _med(v) for k, v in r.parse.items()}
        lines = [
            "| variant | median ms | min..max ms | µs per message | pytoniq ÷ imq |",
            "|---|---:|---:|---:|---:|",
        ]
        pairs = {
            PARSE_VARIANTS[1]: PARSE_VARIANTS[0],
            PARSE_VARIANTS[3]: PARSE_VARIANTS[2],
            PARSE_VARIANTS[4]: PARSE_VARIANTS[2],
        }
        for name in PARSE_VARIANTS:
            v = r.parse[name]
            ratio = f"{p[name] / p[pairs[name]]:.1f}x" if name in pairs else ""
            lines.append(
                f"| {name} | {p[name] * 1e3:.1f} | {min(v) * 1e3:.1f}..{max(v) * 1e3:.1f} | "
                f"{p[name] / r.parse_messages * 1e6:.1f} | {ratio} |"
            )
        return lines

    def render(self) -> str:
        r, f, s = self.r, self.files, self.r.sizes
        target_lines = self.targets()
        out = ["# imq state benchmark", ""]
        if r.quick:
            out += ["**Quick smoke run: sizes are reduced; these numbers are not results.**", ""]
        out += machine_lines(r.command, r.load_start)
        out += [
            "- the machine has 2 cores; RocksDB's flush threads share them with Python",
            f"- imq/state code stamp (sha256 of `imq/state/*.py`, first 16 hex digits): "
            f"`{_code_stamp()}`",
            "",
            f"Targets met: **{sum(self.verdicts)} of {len(self.verdicts)}**.",
            "",
            *target_lines,
            "",
            f"## The state: {s.diffs} diffs x {s.per_diff:,} messages = {self.n:,}",
            "",
            f"`synth_state(diffs={s.diffs}, messages_per_diff={s.per_diff:,}, "
            f"dst_shards={s.dst_shards}, seed={SEED})` of shard `{f.block_id.shard}`, seqno "
            f"{f.block_id.seqno}: single-cell internal messages without body, like the real "
            f"data; {f.chunks} chunks. `.bin` {r.file_sizes['.bin']:,} bytes, `.queue` (zstd "
            f"level 9) {r.file_sizes['.queue']:,} bytes. "
            + (
                "Reused from the cache directory (generated by an earlier run); generation "
                "times below are that run's: "
                if f.cached
                else "Generated in a child process (not part of any target): "
            )
            + ", ".join(f"{k} {v:.1f} s" for k, v in f.generation.items())
            + ".",
            "",
            "## Import",
            "",
            f"Medians of {r.repeats} runs, each in a fresh process on a fresh database "
            f"(production `QueueConfig()`); the `.queue` and `.bin` runs alternate. "
            f"Rate = messages ÷ the `import_state` call's wall time.",
            "",
            *self.imports(),
            "",
            "### Where the import's time goes",
            "",
            f"The real `Queue.import_state`, {r.repeats} more runs per file, with a timer around "
            f"each stage (the wrapped functions run once per chunk, segment or batch); medians.",
            "",
            *self.breakdown(),
            "",
            "## Export",
            "",
            f"`Queue.export_state(shard, {f.block_id.seqno}, {f.top_update[1]}, dest)` from the "
            f"database of the last `.queue` import, opened with the background GC off; a "
            f"fresh process per run, the two formats alternating; medians of {r.repeats}.",
            "",
            *self.exports(),
            "",
            f"## Parsing the real shard.bin ({self.n_parse()} messages)",
            "",
            f"One warm-up round checks that every variant returns the same "
            f"(created_lt, src, dst) list; then {s.parse_rounds} rounds run the variants in "
            f"turn. Medians.",
            "",
            *self.parse(),
            "",
            METHOD,
        ]
        return "\n".join(out)

    def n_parse(self) -> str:
        return f"{self.r.parse_messages:,}"


METHOD = """## Method

- Every measurement that touches the big state runs in its own child process (`python -c`
  calling `benchmarks.bench_state.child_main`); the child reports its peak RSS as the
  high-water mark of its own address space (`VmHWM` in `/proc/self/status`): interpreter,
  imports, RocksDB and the work. Not `ru_maxrss`: Linux carries the parent's high-water
  mark into a child across (v)fork and exec. The parent never holds the state.
- Import: `Queue.open(fresh dir, QueueConfig())`, `gc.collect()`, then the timed
  `import_state(path, block_id, top_update)`; the close (which flushes) is timed apart.
- Raw floor: one child reads back every row the import wrote (messages, statistics, tail,
  info and pointer rows: each used exactly once), orders them as the import does (message
  rows in file order, a diff's other rows after its messages, the same batches), then puts
  them with bare rocksdict (`RawDb`: imq's options and column families), WAL on, no fsync.
  It is the cost of RocksDB alone; everything above it is imq's reading, checking and
  encoding.
- Breakdown: the same import with a timer wrapped around each stage function; the read
  passes run the reading parts alone, each adding one step.
- Export: `Queue.export_state` into a fresh path (`.queue` = zstd level 9, like the node),
  on a queue opened with `QueueConfig(gc_enabled=False)` (no GC pass inside a timing);
  the first run checks the output is byte-identical to the generated state. zstd alone
  compresses the same bytes with `zstandard`, streamed as the exporter does.
- Parsing: imq = `StateReader(open_source(path)).segments()` + `parse_internal_header`
  per root; pytoniq-core = imq's TL reader for the state header, diffs and chunk framing
  (pytoniq has no TL for them), then `Cell.from_boc` per chunk, `cell.hash` checked against
  the diff's list, `CommonMsgInfo.deserialize(cell.begin_parse())` (internal only). The
  BOC-only rows start from the chunk bytes already in memory.
- Details and caveats: `benchmarks/README.md`.
"""


# ---------------------------------------------------------------------------------------------
# Main


def main(argv: Sequence[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--cache", type=Path, default=None)
    known, rest = pre.parse_known_args(argv)
    args = parse_args(
        rest,
        "state",
        __doc__.split("\n")[0] + " --cache DIR keeps the generated state files between runs.",
        "import, export, floor and breakdown runs (default 3; 1 with --quick)",
    )
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    quiet_logs()
    with tempfile.TemporaryDirectory(prefix="imq-bench-state-", dir=args.dir) as tmp:
        report = run(args, Path(tmp), known.cache)
        text = Render(report).render()
    write_report(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
