"""Logging and metrics: structlog loggers per component, and per-queue metrics."""

from __future__ import annotations

from imq.observability.logging import configure_for_cli, get_logger
from imq.observability.metrics import COUNTERS, OPERATIONS, Metrics
from imq.observability.progress import ProgressLine

__all__ = [
    "COUNTERS",
    "OPERATIONS",
    "Metrics",
    "ProgressLine",
    "configure_for_cli",
    "get_logger",
]
