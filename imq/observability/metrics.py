"""Every imq metric name, and the per-queue :class:`Metrics` that records them.

Operations get a latency histogram (count, sum, max, counts per Prometheus bucket and
the most recent :data:`WINDOW` samples for percentiles); events get a counter. Names are
declared once here; an undeclared name raises ``KeyError``. When ``prometheus_client`` is
installed, one process-wide collector exports every queue's figures, summed, as
``imq_operation_seconds{operation}`` (a histogram) and ``imq_events_total{event}``: it
reads them when the registry is scraped, so recording a figure costs no Prometheus call
(about 1 us each, several per block). A queue's figures stay in the sums after the queue
is gone, so the exported counters never go down.
"""

from __future__ import annotations

import threading
import weakref
from bisect import bisect_left
from collections import deque
from collections.abc import Iterator
from time import perf_counter
from types import TracebackType
from typing import Any, Final, cast

__all__ = [
    "COUNTERS",
    "OPERATIONS",
    "WINDOW",
    "Histogram",
    "Metrics",
]

OPERATIONS: Final[tuple[str, ...]] = (
    "prepare_diff",
    "apply_diff",
    "write_diff",
    "commit_diff",
    "clear_uncommitted_state",
    "iterator_create",
    "get_diff_info",
    "is_diff_exists",
    "get_diffs_tail_len",
    "load_diff_statistics",
    "load_separated_diff_statistics",
    "get_commit_pointers",
    "get_last_applied_seqno",
    "get_last_committed_mc_block_id",
    "startup",
    "run_gc",
    "import_state",
    "export_state",
)
"""Facade operations timed by :meth:`Metrics.time`."""

COUNTERS: Final[tuple[str, ...]] = (
    "diffs_applied",
    "diffs_skipped",
    "messages_written",
    "messages_iterated",
    "messages_skipped_by_iterator",
    "commits",
    "commits_skipped",
    "uncommitted_cleared",
    "messages_deleted",
    "gc_ranges_deleted",
    "gc_ranges_failed",
    "states_imported",
    "messages_imported",
    "states_exported",
    "imports_rolled_back",
)
"""Events counted by :meth:`Metrics.inc`."""

WINDOW: Final = 4096
"""How many recent samples each histogram keeps for percentiles."""

# Latency buckets of the Prometheus histogram, seconds: 10 µs to 60 s.
_PROM_BUCKETS: Final = (
    1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0,
)  # fmt: skip


class _Exporter:
    """The Prometheus collector of every :class:`Metrics` in the process (registered once,
    when ``prometheus_client`` is importable): at a scrape, the figures of the live ones,
    each read under its own lock, plus those of the ones gone (folded in when each was
    collected by Python, so that no exported counter goes down)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # id(metrics) -> (counters, histograms, lock): the Metrics' own dicts, not the
        # object, so that its finalizer can fold them in
        self._live: dict[int, tuple[dict[str, int], dict[str, Histogram], threading.Lock]] = {}
        self._gone_counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._gone_histograms: dict[str, Histogram] = {op: Histogram() for op in OPERATIONS}

    def add(self, metrics: Metrics) -> None:
        parts = (metrics._counters, metrics._histograms, metrics._lock)
        key = id(metrics)
        with self._lock:
            self._live[key] = parts
        weakref.finalize(metrics, self._fold, key, *parts)

    def _fold(
        self,
        key: int,
        counters: dict[str, int],
        histograms: dict[str, Histogram],
        lock: threading.Lock,
    ) -> None:
        with self._lock, lock:
            self._live.pop(key, None)
            _add_figures(self._gone_counters, self._gone_histograms, counters, histograms)

    def figures(self) -> tuple[dict[str, int], dict[str, Histogram]]:
        """The process-wide sums: counters and histograms (count, sum, buckets)."""
        with self._lock:
            counters = dict(self._gone_counters)
            histograms = {op: h.copy(samples=False) for op, h in self._gone_histograms.items()}
            for live_counters, live_histograms, lock in self._live.values():
                with lock:
                    _add_figures(counters, histograms, live_counters, live_histograms)
        return counters, histograms

    def describe(self) -> Iterator[Any]:
        from prometheus_client.core import (  # noqa: PLC0415 - optional dependency
            CounterMetricFamily,
            HistogramMetricFamily,
        )

        yield HistogramMetricFamily("imq_operation_seconds", _HISTOGRAM_HELP, labels=["operation"])
        yield CounterMetricFamily("imq_events", _COUNTER_HELP, labels=["event"])

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (  # noqa: PLC0415 - optional dependency
            CounterMetricFamily,
            HistogramMetricFamily,
        )
        from prometheus_client.utils import floatToGoString  # noqa: PLC0415

        counters, histograms = self.figures()
        latency = HistogramMetricFamily(
            "imq_operation_seconds", _HISTOGRAM_HELP, labels=["operation"]
        )
        bounds = [floatToGoString(b) for b in _PROM_BUCKETS] + ["+Inf"]  # type: ignore[no-untyped-call]
        for op in OPERATIONS:
            h = histograms[op]
            cumulative, total = [], 0
            for bound, n in zip(bounds, h.buckets, strict=True):
                total += n
                cumulative.append((bound, total))
            latency.add_metric([op], buckets=cumulative, sum_value=h.sum)
        yield latency
        events = CounterMetricFamily("imq_events", _COUNTER_HELP, labels=["event"])
        for name in COUNTERS:
            events.add_metric([name], counters[name])
        yield events


_HISTOGRAM_HELP: Final = "Latency of imq queue operations, seconds."
_COUNTER_HELP: Final = "Counts of imq queue events."


def _add_figures(
    counters: dict[str, int],
    histograms: dict[str, Histogram],
    more_counters: dict[str, int],
    more_histograms: dict[str, Histogram],
) -> None:
    for name, n in more_counters.items():
        counters[name] += n
    for op, h in more_histograms.items():
        into = histograms[op]
        into.count += h.count
        into.sum += h.sum
        into.buckets = [a + b for a, b in zip(into.buckets, h.buckets, strict=True)]


def _prometheus_exporter() -> _Exporter | None:
    """Register the process-wide collector, or find the one registered already (this
    module imported a second time, e.g. reloaded); ``None`` without prometheus_client,
    or when the host registered a metric of one of imq's names: imq's figures then stay
    unexported (``Queue.metrics`` still has them), and importing imq, opening a queue
    and the host's own metric work as before."""
    try:
        import prometheus_client  # noqa: PLC0415 - optional dependency
    except ImportError:
        return None
    found = prometheus_client.REGISTRY._names_to_collectors.get("imq_operation_seconds")
    if found is not None:
        kind = type(found)
        if kind.__name__ == _Exporter.__name__ and kind.__module__ == __name__:
            return cast(_Exporter, found)  # ours, from an earlier import of this module
        return None  # the host's
    exporter = _Exporter()
    try:
        prometheus_client.REGISTRY.register(exporter)
    except ValueError:  # a name of imq's is taken ("Duplicated timeseries")
        return None
    return exporter


class Histogram:
    """Latency samples of one operation: count, sum, max, and a window of recent samples.

    Not locked itself; :class:`Metrics` serialises access.
    """

    __slots__ = ("buckets", "count", "max", "samples", "sum")

    def __init__(self) -> None:
        self.count = 0
        self.sum = 0.0
        self.max = 0.0
        self.samples: deque[float] = deque(maxlen=WINDOW)
        # samples per Prometheus bucket (at most its bound, above the previous one), the
        # last past every bound
        self.buckets = [0] * (len(_PROM_BUCKETS) + 1)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.sum += seconds
        self.max = max(self.max, seconds)
        self.samples.append(seconds)
        self.buckets[bisect_left(_PROM_BUCKETS, seconds)] += 1

    def copy(self, *, samples: bool = True) -> Histogram:
        clone = Histogram()
        clone.count, clone.sum, clone.max = self.count, self.sum, self.max
        clone.buckets = list(self.buckets)
        if samples:
            clone.samples.extend(self.samples)
        return clone

    def percentiles(self) -> dict[str, float]:
        """``count``, ``mean`` and ``max`` over all samples; ``p50``, ``p99`` over the window.

        Percentiles use the nearest-rank method. All values are 0 when empty.
        """
        if self.count == 0:
            return {"count": 0, "mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
        ordered = sorted(self.samples)
        return {
            "count": self.count,
            "mean": self.sum / self.count,
            "p50": _nearest_rank(ordered, 50),
            "p99": _nearest_rank(ordered, 99),
            "max": self.max,
        }


def _nearest_rank(ordered: list[float], percent: int) -> float:
    # Smallest sample with at least `percent`% of the samples at or below it.
    rank = -(-percent * len(ordered) // 100)  # ceil without floats
    return ordered[max(rank, 1) - 1]


class _Timer:
    # Hot path: a slotted class holding its histogram and lock directly, instead of
    # @contextmanager plus Metrics.observe: about 1.2 µs per use instead of 2.2.
    __slots__ = ("_histogram", "_lock", "_start")

    def __init__(self, histogram: Histogram, lock: threading.Lock) -> None:
        self._histogram = histogram
        self._lock = lock
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = perf_counter()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        seconds = perf_counter() - self._start
        with self._lock:
            self._histogram.add(seconds)


class Metrics:
    """Histograms and counters of one open queue. Thread-safe.

    Usage::

        with metrics.time("apply_diff"):
            ...
        metrics.inc("messages_written", len(messages))
    """

    __slots__ = ("__weakref__", "_counters", "_histograms", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._histograms: dict[str, Histogram] = {op: Histogram() for op in OPERATIONS}
        self._counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        if _EXPORTER is not None:
            _EXPORTER.add(self)

    def time(self, op: str) -> _Timer:
        """A context manager recording the wall time of its block under ``op``.

        Raises ``KeyError`` at once if ``op`` is not in :data:`OPERATIONS`. The time is
        recorded even when the block raises.
        """
        histogram = self._histograms.get(op)
        if histogram is None:
            raise KeyError(f"unknown operation {op!r}; declare it in OPERATIONS")
        return _Timer(histogram, self._lock)

    def observe(self, op: str, seconds: float) -> None:
        """Record one latency sample of ``op``; ``KeyError`` if ``op`` is undeclared."""
        histogram = self._histograms.get(op)
        if histogram is None:
            raise KeyError(f"unknown operation {op!r}; declare it in OPERATIONS")
        if not seconds >= 0.0:  # also rejects NaN
            raise ValueError(f"latency must be >= 0 seconds, got {seconds!r}")
        with self._lock:
            histogram.add(seconds)

    def inc(self, counter: str, n: int = 1) -> None:
        """Add ``n`` (>= 0) to ``counter``; ``KeyError`` if it is undeclared."""
        if counter not in self._counters:
            raise KeyError(f"unknown counter {counter!r}; declare it in COUNTERS")
        if n < 0:
            raise ValueError(f"counter increments must be >= 0, got {n!r}")
        with self._lock:
            self._counters[counter] += n

    def counter(self, name: str) -> int:
        """The current value of one counter; ``KeyError`` if it is undeclared."""
        with self._lock:
            return self._counters[name]

    def percentiles(self, op: str) -> dict[str, float]:
        """Latency summary of one operation, seconds (see :meth:`Histogram.percentiles`)."""
        histogram = self._histograms[op]
        with self._lock:
            frozen = histogram.copy()
        return frozen.percentiles()

    def snapshot(self) -> dict[str, object]:
        """``{"operations": {op: percentiles}, "counters": {name: value}}``.

        Only operations with at least one sample appear; every counter appears.
        """
        with self._lock:  # copy under the lock, sort outside it
            frozen = {op: h.copy() for op, h in self._histograms.items() if h.count}
            counters = dict(self._counters)
        operations = {op: h.percentiles() for op, h in frozen.items()}
        return {"operations": operations, "counters": counters}


_EXPORTER: Final = _prometheus_exporter()
