"""End-to-end throughput of ``imq simulate`` and the share of wall time inside imq.

    python -m benchmarks.bench_sim [--rounds-4 N] [--rounds-16 N] [--profile]

Runs the simulation (seed 1, background GC, the default fault rates) with 4 and with 16
basechain shards and prints a Markdown report: delivered messages per second, and the
time spent inside queue calls (the simulation times every call) as a share of wall
time. With ``--profile``, the 4-shard run is repeated under cProfile and the report
adds the functions with the most own time, split into imq (the engine) and the rest.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import tempfile
import time
from pathlib import Path

from imq.sim import SimConfig, Simulation
from imq.sim.engine import SimResult, percentiles


def _run(shards: int, rounds: int) -> SimResult:
    with tempfile.TemporaryDirectory(prefix="imq-bench-sim-") as tmp:
        return Simulation(SimConfig(directory=Path(tmp), shards=shards, rounds=rounds)).run()


def _kind(filename: str) -> str:
    if filename == "~":
        return "C"
    if "/imq/" in filename and "/imq/sim/" not in filename:
        return "imq"
    return "sim/other"


def _engine_share(rounds: int) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Own time by kind: imq's Python, C functions (builtins, RocksDB, BLAKE3, ...) and
    the rest (the simulated collator, the standard library)."""
    profile = cProfile.Profile()
    profile.enable()
    _run(4, rounds)
    profile.disable()
    stats = pstats.Stats(profile)
    kinds: dict[str, float] = {}
    rows: list[tuple[str, float]] = []
    for (filename, line, name), value in stats.stats.items():  # type: ignore[attr-defined]
        tottime = value[2]
        kind = _kind(filename)
        kinds[kind] = kinds.get(kind, 0.0) + tottime
        rows.append((f"{kind}: {Path(filename).name}:{line} {name}", tottime))
    rows.sort(key=lambda r: -r[1])
    return kinds, rows[:15]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds-4", type=int, default=1500)
    parser.add_argument("--rounds-16", type=int, default=400)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    lines = [
        "# imq simulate: end-to-end throughput",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- machine: {os.cpu_count()} CPUs, python {platform.python_version()}",
        f"- load average (1 min) at start {load_start:.2f}",
        "- command: `python -m benchmarks.bench_sim" + (" --profile" if args.profile else "") + "`",
        "",
        "| shards | rounds | blocks | messages delivered | wall s | messages/s "
        "| inside queue calls | prepare p50/p99 ms | read p50/p99 ms | verdict |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for shards, rounds in ((4, args.rounds_4), (16, args.rounds_16)):
        r = _run(shards, rounds)
        share = 100 * r.queue_seconds / r.seconds
        prep = percentiles(r.latencies["prepare_diff"])
        read = percentiles(r.latencies["read"])
        lines.append(
            f"| {shards} | {rounds:,} | {r.blocks:,} | {r.messages_delivered:,} "
            f"| {r.seconds:.1f} | {r.messages_per_second:,.0f} | {share:.0f}% "
            f"| {prep[0] * 1e3:.2f} / {prep[1] * 1e3:.2f} "
            f"| {read[0] * 1e3:.2f} / {read[1] * 1e3:.2f} "
            f"| {'verified' if r.verified else 'FAILED'} |"
        )
    lines.append(f"\nLoad average (1 min) at end {os.getloadavg()[0]:.2f}.")
    if args.profile:
        kinds, rows = _engine_share(max(args.rounds_4 // 3, 100))
        total = sum(kinds.values()) or 1.0
        split = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(kinds.items()))
        lines += [
            "",
            f"## cProfile, 4 shards, {max(args.rounds_4 // 3, 100)} rounds",
            "",
            f"Own time by kind: {split} (imq = Python under `imq/` but `imq/sim/`; "
            "C = builtins and extensions, RocksDB and BLAKE3 included, whoever calls them).",
            "",
            "| function | own s |",
            "|---|---:|",
            *(f"| {name} | {t:.2f} |" for name, t in rows),
        ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
