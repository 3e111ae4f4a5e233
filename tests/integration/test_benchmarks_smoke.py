"""The benchmarks still run (their --quick form) to the end; their numbers are not checked
here: speed targets live in benchmarks/results, never in tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# Extra flags keep the smoke runs of the longer benchmarks to seconds.
QUICK_FLAGS = {
    "benchmarks.bench_core": [],
    "benchmarks.bench_gc": [],
    "benchmarks.bench_gc_pause": [],
    "benchmarks.bench_state": [],
    "benchmarks.bench_floor": [],
    "benchmarks.bench_peers": [],
    "benchmarks.bench_scaling": [],
    "benchmarks.bench_endurance": [
        "--minutes",
        "0.05",
        "--warmup",
        "2",
        "--interval",
        "1",
        "--block-cache-mib",
        "8",
    ],
    "benchmarks.bench_sim": [],
}


def _quick(module: str, tmp_path: Path, *extra: str) -> str:
    out = tmp_path / "report.md"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            module,
            "--quick",
            *QUICK_FLAGS[module],
            "--out",
            str(out),
            "--dir",
            str(tmp_path),
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    return out.read_text()


@pytest.mark.parametrize("module", sorted(QUICK_FLAGS))
def test_benchmark_quick_run_writes_its_report(module: str, tmp_path: Path) -> None:
    report = _quick(module, tmp_path)
    assert report.startswith("# imq")
    assert "| " in report  # at least one table


def test_core_benchmark_reads_with_gc_off_and_scales_diffs_with_messages(tmp_path: Path) -> None:
    """The scaling step looks up every diff it wrote (GC off), and its queues hold diffs of
    100 messages, so the number of diffs grows with the number of messages."""
    report = _quick("benchmarks.bench_core", tmp_path, "--only", "scaling")
    assert "background GC: off" in report
    assert "1k: 10 shard diffs of 100 messages" in report
    assert "10k: 100 shard diffs of 100 messages" in report
    assert "## Write and read" not in report  # --only ran one step
