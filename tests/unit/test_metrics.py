"""Metrics: declared names, histograms and percentiles, counters, snapshot, Prometheus."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from imq.observability import COUNTERS, OPERATIONS, Metrics
from imq.observability import metrics as metrics_module
from imq.observability.metrics import WINDOW, Histogram


def test_names_are_unique_and_snake_case() -> None:
    for names in (OPERATIONS, COUNTERS):
        assert len(set(names)) == len(names)
        assert all(name.isidentifier() and name == name.lower() for name in names)
    assert "apply_diff" in OPERATIONS
    assert "gc_ranges_deleted" in COUNTERS


def test_empty_histogram_is_all_zeros() -> None:
    assert Histogram().percentiles() == {
        "count": 0,
        "mean": 0.0,
        "p50": 0.0,
        "p99": 0.0,
        "max": 0.0,
    }


def test_percentiles_of_known_samples() -> None:
    metrics = Metrics()
    for ms in range(1, 101):  # 100 ms down to 1 ms: insertion order must not matter
        metrics.observe("apply_diff", (101 - ms) / 1000)
    summary = metrics.percentiles("apply_diff")
    assert summary["count"] == 100
    assert summary["mean"] == pytest.approx(0.0505)
    assert summary["p50"] == pytest.approx(0.050)
    assert summary["p99"] == pytest.approx(0.099)
    assert summary["max"] == pytest.approx(0.100)


def test_single_sample() -> None:
    metrics = Metrics()
    metrics.observe("startup", 0.25)
    assert metrics.percentiles("startup") == {
        "count": 1,
        "mean": 0.25,
        "p50": 0.25,
        "p99": 0.25,
        "max": 0.25,
    }


def test_window_keeps_recent_samples_but_totals_keep_all() -> None:
    metrics = Metrics()
    metrics.observe("run_gc", 10.0)  # falls out of the window
    for _ in range(WINDOW):
        metrics.observe("run_gc", 1.0)
    summary = metrics.percentiles("run_gc")
    assert summary["count"] == WINDOW + 1
    assert summary["p99"] == 1.0
    assert summary["max"] == 10.0
    assert summary["mean"] == pytest.approx((10.0 + WINDOW) / (WINDOW + 1))


def test_time_records_elapsed_seconds() -> None:
    metrics = Metrics()
    with metrics.time("commit_diff"):
        time.sleep(0.01)
    summary = metrics.percentiles("commit_diff")
    assert summary["count"] == 1
    assert 0.005 <= summary["max"] < 5.0


def test_time_records_even_when_the_block_raises() -> None:
    metrics = Metrics()
    with pytest.raises(RuntimeError), metrics.time("write_diff"):
        raise RuntimeError("boom")
    assert metrics.percentiles("write_diff")["count"] == 1


def test_unknown_names_raise_key_error() -> None:
    metrics = Metrics()
    with pytest.raises(KeyError, match="apply_dif"):
        metrics.time("apply_dif")
    with pytest.raises(KeyError):
        metrics.observe("nope", 1.0)
    with pytest.raises(KeyError, match="commit"):
        metrics.inc("commit")
    with pytest.raises(KeyError):
        metrics.counter("nope")
    with pytest.raises(KeyError):
        metrics.percentiles("nope")


def test_rejects_negative_values() -> None:
    metrics = Metrics()
    with pytest.raises(ValueError):
        metrics.observe("apply_diff", -1.0)
    with pytest.raises(ValueError):
        metrics.observe("apply_diff", float("nan"))
    with pytest.raises(ValueError):
        metrics.inc("commits", -1)


def test_counters() -> None:
    metrics = Metrics()
    metrics.inc("commits")
    metrics.inc("messages_written", 10)
    metrics.inc("messages_written", 0)
    assert metrics.counter("commits") == 1
    assert metrics.counter("messages_written") == 10
    assert metrics.counter("diffs_skipped") == 0


def test_snapshot_shape() -> None:
    metrics = Metrics()
    assert metrics.snapshot() == {
        "operations": {},
        "counters": dict.fromkeys(COUNTERS, 0),
    }
    metrics.observe("apply_diff", 0.002)
    metrics.inc("diffs_applied", 2)
    snapshot = metrics.snapshot()
    assert set(snapshot) == {"operations", "counters"}
    operations = snapshot["operations"]
    assert isinstance(operations, dict)
    assert list(operations) == ["apply_diff"]
    assert set(operations["apply_diff"]) == {"count", "mean", "p50", "p99", "max"}
    counters = snapshot["counters"]
    assert isinstance(counters, dict)
    assert counters["diffs_applied"] == 2
    assert list(counters) == list(COUNTERS)


def test_snapshot_is_a_copy() -> None:
    metrics = Metrics()
    snapshot = metrics.snapshot()
    metrics.inc("commits")
    counters = snapshot["counters"]
    assert isinstance(counters, dict)
    assert counters["commits"] == 0


def test_instances_are_independent() -> None:
    first, second = Metrics(), Metrics()
    first.inc("commits")
    assert second.counter("commits") == 0


def test_thread_safety_smoke() -> None:
    metrics = Metrics()
    threads_n, per_thread = 8, 5_000
    barrier = threading.Barrier(threads_n)

    def work() -> None:
        barrier.wait()
        for _ in range(per_thread):
            metrics.inc("messages_written", 2)
            metrics.observe("iterator_create", 0.001)
            with metrics.time("get_diff_info"):
                pass

    threads = [threading.Thread(target=work) for _ in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = threads_n * per_thread
    assert metrics.counter("messages_written") == 2 * total
    assert metrics.percentiles("iterator_create")["count"] == total
    assert metrics.percentiles("iterator_create")["mean"] == pytest.approx(0.001)
    assert metrics.percentiles("get_diff_info")["count"] == total


# --- Prometheus export ----------------------------------------------------------------


def _sample(name: str, **labels: str) -> float:
    prometheus_client: Any = pytest.importorskip("prometheus_client")
    value = prometheus_client.REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)


def test_every_queues_figures_are_exported_summed_at_scrape_time() -> None:
    """One collector exports the sum over every Metrics in the process: counters, and
    each operation's histogram (count, sum, cumulative buckets)."""
    before = {
        "commits": _sample("imq_events_total", event="commits"),
        "count": _sample("imq_operation_seconds_count", operation="apply_diff"),
        "sum": _sample("imq_operation_seconds_sum", operation="apply_diff"),
        "le 1e-4": _sample("imq_operation_seconds_bucket", operation="apply_diff", le="0.0001"),
        "le 1": _sample("imq_operation_seconds_bucket", operation="apply_diff", le="1.0"),
        "inf": _sample("imq_operation_seconds_bucket", operation="apply_diff", le="+Inf"),
    }
    a, b = Metrics(), Metrics()
    a.inc("commits", 3)
    b.inc("commits", 2)
    a.observe("apply_diff", 0.5)
    b.observe("apply_diff", 0.00005)
    b.observe("apply_diff", 100.0)
    with a.time("apply_diff"):
        pass
    assert _sample("imq_events_total", event="commits") == before["commits"] + 5
    assert _sample("imq_operation_seconds_count", operation="apply_diff") == before["count"] + 4
    got_sum = _sample("imq_operation_seconds_sum", operation="apply_diff") - before["sum"]
    assert 100.50005 <= got_sum < 100.6
    le = {"operation": "apply_diff"}
    assert _sample("imq_operation_seconds_bucket", **le, le="0.0001") >= before["le 1e-4"] + 1
    assert _sample("imq_operation_seconds_bucket", **le, le="1.0") >= before["le 1"] + 3
    assert _sample("imq_operation_seconds_bucket", **le, le="+Inf") == before["inf"] + 4


def test_a_queues_figures_stay_exported_after_it_is_gone() -> None:
    """Counters never go down: a Metrics that Python collected stays in the sums."""
    before = _sample("imq_events_total", event="gc_ranges_failed")
    gone = Metrics()
    gone.inc("gc_ranges_failed", 7)
    assert _sample("imq_events_total", event="gc_ranges_failed") == before + 7
    del gone
    gc.collect()
    assert _sample("imq_events_total", event="gc_ranges_failed") == before + 7
    Metrics().inc("gc_ranges_failed", 1)
    gc.collect()
    assert _sample("imq_events_total", event="gc_ranges_failed") == before + 8


def test_histogram_buckets_follow_prometheus_le() -> None:
    h = metrics_module.Histogram()
    for seconds in (0.0, 1e-5, 1.1e-5, 60.0, 61.0):
        h.add(seconds)
    assert h.buckets[0] == 2  # le 1e-05: at most the bound
    assert h.buckets[1] == 1
    assert h.buckets[-2] == 1  # le 60
    assert h.buckets[-1] == 1  # past every bound
    assert sum(h.buckets) == h.count


def test_without_prometheus_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "prometheus_client", None)
    assert metrics_module._prometheus_exporter() is None


def test_real_prometheus_client_survives_reimport() -> None:
    pytest.importorskip("prometheus_client")
    # A second import of the module runs this again while the collector is registered.
    assert metrics_module._prometheus_exporter() is metrics_module._EXPORTER
    labels = {"event": "gc_ranges_failed"}
    before = _sample("imq_events_total", **labels)
    Metrics().inc("gc_ranges_failed", 2)
    assert _sample("imq_events_total", **labels) == before + 2


_HOST_CLASH = """
import sys, tempfile
import prometheus_client
kind = sys.argv[1]
if kind == "counter":
    host = prometheus_client.Counter("imq_events", "the host's own")
else:
    host = prometheus_client.Histogram("imq_operation_seconds", "the host's own")
import imq
from imq.observability import metrics
assert metrics._EXPORTER is None, metrics._EXPORTER
with imq.Queue.open(tempfile.mkdtemp(), imq.QueueConfig.testing()) as queue:
    queue.metrics.inc("gc_ranges_failed")
    assert queue.metrics.snapshot()["counters"]["gc_ranges_failed"] == 1
host.inc() if kind == "counter" else host.observe(1.0)
print("ok")
"""


@pytest.mark.parametrize("kind", ["counter", "histogram"])
def test_a_host_metric_named_like_imqs_leaves_imq_unexported_not_broken(kind: str) -> None:
    """A host that registered a metric of one of imq's names first: importing imq and
    opening a queue work, the host's metric is its own, imq's figures stay in
    ``Queue.metrics`` (a fresh process: the registry is process-wide)."""
    pytest.importorskip("prometheus_client")
    done = subprocess.run(
        [sys.executable, "-c", _HOST_CLASH, kind],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "ok\n", "")
