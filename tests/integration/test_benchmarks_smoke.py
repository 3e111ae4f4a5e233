"""The benchmarks still run (their --quick form); their numbers are not checked here:
speed targets live in benchmarks/results, never in tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# Extra flags keep the smoke runs of the newer benchmarks to seconds.
QUICK_FLAGS = {
    "benchmarks.bench_core": [],
    "benchmarks.bench_gc": [],
    "benchmarks.bench_state": [],
    "benchmarks.bench_floor": [],
    "benchmarks.bench_peers": [],
    "benchmarks.bench_scaling": [],
    "benchmarks.bench_endurance": ["--minutes", "0.1"],
}


@pytest.mark.parametrize("module", sorted(QUICK_FLAGS))
def test_benchmark_quick_run_writes_its_report(module: str, tmp_path: Path) -> None:
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
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = out.read_text()
    assert report.startswith("# imq")
    assert "| " in report  # at least one table
