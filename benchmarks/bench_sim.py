"""End-to-end throughput of ``imq simulate`` and the share of wall time inside imq.

    python -m benchmarks.bench_sim [--rounds-4 N] [--rounds-16 N] [--profile]
                                   [--quick] [--out FILE] [--dir DIR]

Runs the simulation (seed 1, background GC, the default fault rates) with 4 and with 16
basechain shards and prints a Markdown report: delivered messages per second, and the
time spent inside queue calls (the simulation times every call) as a share of wall
time. With ``--profile``, the 4-shard run is repeated under cProfile and the report
splits the main thread's own time between imq (the engine) and the simulated
collator, shared code (C, the standard library, imq's value types) by caller, and lists
the functions with the most own time with imq's part of each.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

from benchmarks.bench_core import machine_lines
from imq import Queue, QueueConfig
from imq.sim import SimConfig, Simulation
from imq.sim.engine import SimResult, frozen_startup_heap, percentiles


def _thread_cpu(native_id: int | None) -> float:
    """CPU seconds a live thread of this process has run (Linux ``schedstat``), else 0."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat", encoding="ascii") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


class _GcCpuQueue(Queue):
    """A queue that, when closed, adds the CPU time its background GC thread ran to
    ``gc_cpu``: mostly time that thread held the GIL (its Python code, rocksdict's reads
    and writes hold it; only a synced write's log sync, ``flush_wal``, lets it go), during
    which the collator's thread could not run."""

    gc_cpu = 0.0

    def close(self) -> None:
        worker = self.gc_worker
        for thread in threading.enumerate():
            if worker is not None and thread.name == "imq-gc" and thread.is_alive():
                _GcCpuQueue.gc_cpu += _thread_cpu(thread.native_id)
        super().close()


def _open(path: Path, config: QueueConfig) -> Queue:
    return _GcCpuQueue.open(path, config)


def _run(
    shards: int, rounds: int, where: Path | None, frozen: bool, gc_every: int = 0
) -> tuple[SimResult, float]:
    """The run's result and the CPU seconds imq's background GC threads ran; ``frozen``:
    with the start-up heap frozen out of the cyclic GC, as ``imq simulate`` runs;
    ``gc_every``: no GC thread, a ``run_gc`` (timed as a queue call) every so many rounds."""
    _GcCpuQueue.gc_cpu = 0.0
    with tempfile.TemporaryDirectory(prefix="imq-bench-sim-", dir=where) as tmp:
        # The network's work alone: the run's state checks (queue calls that verify, not
        # collate) would add untimed wall time and so lower the share inside queue calls.
        config = SimConfig(
            directory=Path(tmp), shards=shards, rounds=rounds, gc_every=gc_every, check_state=False
        )
        with frozen_startup_heap() if frozen else contextlib.nullcontext():
            result = Simulation(config, opener=_open).run()
    return result, _GcCpuQueue.gc_cpu


Func = tuple[str, int, str]


# imq's value types and encoders, which a collator calls itself (it builds keys, diffs
# and routers, and hashes its TL diff) as the engine does inside its calls.
_SHARED = ("/imq/types.py", "/imq/diff.py", "/imq/router.py", "/imq/state/tl.py")


def _own_kind(filename: str) -> str | None:
    """Who a function's own time belongs to whoever calls it, or ``None`` for shared
    code (C functions, the standard library, third-party Python, and ``_SHARED``)."""
    if "/imq/sim/" in filename:
        return "sim"
    if "/imq/" in filename and not filename.endswith(_SHARED):
        return "imq"
    return None


def _attribute(stats: dict[Func, Any]) -> dict[Func, dict[str, float]]:
    """Per function, the share of its own time that belongs to imq and to the simulation.

    imq's and the simulation's own functions are theirs; a shared function's own time is
    split among its callers in proportion to the own time each call site accounts for
    (cProfile records it per caller), recursively: ``bytes.hex`` called by a log line in
    ``imq/queue.py`` is imq's, ``ShardIdent.__str__`` called by the simulation's
    ``message_key`` is the simulation's. Time with no caller (the profiled run itself) and
    cycles go to the simulation."""
    memo: dict[Func, dict[str, float]] = {}
    active: set[Func] = set()

    def share(func: Func) -> dict[str, float]:
        if func in memo:
            return memo[func]
        kind = _own_kind(func[0])
        if kind is not None:
            memo[func] = {kind: 1.0}
            return memo[func]
        if func in active or func not in stats:
            return {"sim": 1.0}
        active.add(func)
        callers = stats[func][4]
        total = sum(v[2] for v in callers.values())
        result: dict[str, float] = {}
        for caller, value in callers.items():
            weight = value[2] / total if total > 0 else 1.0 / len(callers)
            for k, part in share(caller).items():
                result[k] = result.get(k, 0.0) + weight * part
        active.discard(func)
        memo[func] = result or {"sim": 1.0}
        return memo[func]

    return {func: share(func) for func in stats}


def _engine_share(
    rounds: int, where: Path | None
) -> tuple[dict[str, float], float, list[tuple[str, float]]]:
    """Own time (main thread) by owner: imq or the simulation, shared code split by
    caller; also how much of it is C (builtins and extensions, RocksDB and BLAKE3
    included) called on imq's behalf; and the functions with the most own time."""
    profile = cProfile.Profile()
    profile.enable()
    _run(4, rounds, where, frozen=True)
    profile.disable()
    stats: dict[Func, Any] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    shares = _attribute(stats)
    owners: dict[str, float] = {}
    imq_c = 0.0
    rows: list[tuple[str, float]] = []
    for func, value in stats.items():
        tottime = value[2]
        imq_part = shares[func].get("imq", 0.0)
        for k, part in shares[func].items():
            owners[k] = owners.get(k, 0.0) + part * tottime
        if func[0] == "~":
            imq_c += imq_part * tottime
        filename, line, name = func
        rows.append((f"{100 * imq_part:.0f}% | {Path(filename).name}:{line} {name}", tottime))
    rows.sort(key=lambda r: -r[1])
    return owners, imq_c, rows[:15]


GC_PASSES = 36  # GC passes a run when the collator runs them (the thread's 0.25 s, 9 s)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_sim")
    parser.add_argument("--rounds-4", type=int, default=1500)
    parser.add_argument("--rounds-16", type=int, default=400)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a few rounds (seconds)")
    parser.add_argument("--out", type=Path, default=None, help="results file (default: print only)")
    parser.add_argument("--dir", type=Path, default=None, help="where the runs go (temp)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each configuration, round-robin"
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds_4, args.rounds_16, args.repeats = 40, 10, 1
    load_start = os.getloadavg()
    command = (
        "python -m benchmarks.bench_sim"
        + (" --profile" if args.profile else "")
        + (" --quick" if args.quick else "")
        + (f" --repeats {args.repeats}" if args.repeats != 3 and not args.quick else "")
    )
    lines = [
        "# imq simulate: end-to-end throughput",
        "",
        # (the machine, versions and load lines go here once the runs are done)
        "",
        "| shards | start-up heap | GC | rounds | blocks | messages delivered | wall s "
        "| messages/s | inside queue calls (runs) | of it, restarts | with GC thread "
        "| prepare p50/p99 ms | read p50/p99 ms | verdict |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    # (shards, rounds, frozen, gc_every): GC in the background thread (0), as `imq
    # simulate` runs, and in the collator's thread, so that all of it is timed.
    configs = [
        (s, r, f, 0) for s, r in ((4, args.rounds_4), (16, args.rounds_16)) for f in (True, False)
    ]
    configs += [
        (s, r, True, max(1, r // GC_PASSES)) for s, r in ((4, args.rounds_4), (16, args.rounds_16))
    ]
    runs: dict[tuple[int, int, bool, int], list[tuple[SimResult, float]]] = {c: [] for c in configs}
    for _ in range(max(1, args.repeats)):  # round-robin: a slow minute hits every config
        for shards, rounds, frozen, gc_every in configs:
            runs[shards, rounds, frozen, gc_every].append(
                _run(shards, rounds, args.dir, frozen, gc_every)
            )
    for (shards, rounds, frozen, gc_every), done in runs.items():
        shares = sorted(100 * r.queue_seconds / r.seconds for r, _ in done)
        # the run with the median share speaks for the configuration
        r, gc_cpu = min(
            done,
            key=lambda d: abs(100 * d[0].queue_seconds / d[0].seconds - statistics.median(shares)),
        )
        share = statistics.median(shares)
        spread = f" ({', '.join(f'{x:.1f}' for x in shares)})" if len(shares) > 1 else ""
        with_gc = 100 * min(r.seconds, r.queue_seconds + gc_cpu) / r.seconds
        restarts = sum(sum(r.latencies.get(op, ())) for op in ("open", "close"))
        gc_mode = f"every {gc_every} rounds, timed" if gc_every else "background"
        prep = percentiles(r.latencies["prepare_diff"])
        read = percentiles(r.latencies["read"])
        lines.append(
            f"| {shards} | {'frozen' if frozen else 'walked'} | {gc_mode} | {rounds:,} "
            f"| {r.blocks:,} "
            f"| {r.messages_delivered:,} "
            f"| {r.seconds:.1f} | {r.messages_per_second:,.0f} | {share:.1f}%{spread} "
            f"| {100 * restarts / r.seconds:.1f}% ({r.restarts}) "
            f"| {f'{with_gc:.1f}%' if not gc_every else '—'} "
            f"| {prep[0] * 1e3:.2f} / {prep[1] * 1e3:.2f} "
            f"| {read[0] * 1e3:.2f} / {read[1] * 1e3:.2f} "
            f"| {'verified' if all(d[0].verified for d in done) else 'FAILED'} |"
        )
    lines += [
        f"\nLoad average (1 min) at end {os.getloadavg()[0]:.2f}.",
        "",
        f"Each configuration ran {max(1, args.repeats)} times, round-robin; a row is the run "
        "with the median share of wall time inside queue calls, with every run's share in "
        "brackets (a shared machine moves single runs by several points). "
        "*Inside queue calls*: wall time in queue calls (the simulation times each) over "
        "wall time. *Of it, restarts*: the part spent in `Queue.open` and `close`, the "
        "first open and the last close included (the number of restarts in brackets: "
        "the simulation restarts its node after 2% of its "
        "rounds, to exercise recovery, far more often than a node restarts). "
        "*With GC thread*: the share inside queue calls plus the CPU time of imq's GC "
        "thread (it holds the GIL throughout, rocksdict's writes included, so the "
        "collator's thread may wait for it): an upper bound of imq's share, since some of "
        "that CPU time overlapped queue calls. *GC*: *background*, imq's GC thread collects every "
        "0.25 s (`imq simulate`'s setting); *every N rounds, timed*: no GC thread, the "
        "collator calls `run_gc` every "
        f"N rounds (about {GC_PASSES} passes a run, as many as the thread makes in about 9 s), "
        "so all of GC's work is inside the timed queue calls: the share without the "
        "bounds' guesswork. *Start-up heap*: *frozen*, the objects that exist before the run (the "
        "imports' modules, classes and functions, about 28,000) are kept out of Python's "
        "full cyclic-GC passes, as `imq simulate` runs (`imq.sim.engine."
        "frozen_startup_heap`, `gc.freeze`), the way a long-running Python host would; "
        "*walked*, Python's default: every full pass walks them again, inside whichever "
        "call triggered it (queue calls included).",
    ]
    if args.profile:
        prof_rounds = max(args.rounds_4 // 3, 100)
        owners, imq_c, rows = _engine_share(prof_rounds, args.dir)
        total = sum(owners.values()) or 1.0
        imq_t, sim_t = owners.get("imq", 0.0), owners.get("sim", 0.0)
        lines += [
            "",
            f"## cProfile, 4 shards, {prof_rounds} rounds (main thread)",
            "",
            f"Own time by owner: imq {100 * imq_t / total:.0f}% "
            f"(of which C called by imq {100 * imq_c / total:.0f}%), "
            f"simulated collator {100 * sim_t / total:.0f}%. "
            "Shared code (C, the standard library, imq's value types and TL encoder) is "
            "split by caller; "
            "the background GC thread is not profiled.",
            "",
            "| imq's part | function | own s |",
            "|---:|---|---:|",
            *(f"| {name} | {t:.2f} |" for name, t in rows),
        ]
    lines += [
        "",
        "Measurements and analysis across stops (hand-written, not regenerated): "
        "`sim-analysis.md`.",
    ]
    lines[2:2] = machine_lines(command, load_start)
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
