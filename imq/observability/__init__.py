"""Logging and metrics: structured events on the standard logger ``imq``, and per-queue
metrics."""

from __future__ import annotations

from imq.observability.logging import (
    LOGGER_NAME,
    ImqLogger,
    capture_events,
    configure_for_cli,
    get_logger,
)
from imq.observability.metrics import COUNTERS, OPERATIONS, Metrics
from imq.observability.progress import ProgressLine

__all__ = [
    "COUNTERS",
    "LOGGER_NAME",
    "OPERATIONS",
    "ImqLogger",
    "Metrics",
    "ProgressLine",
    "capture_events",
    "configure_for_cli",
    "get_logger",
]
