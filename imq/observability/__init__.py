"""Logging and metrics: structlog loggers per component, and per-queue metrics."""

from __future__ import annotations

from imq.observability.logging import configure_for_cli, get_logger
from imq.observability.metrics import COUNTERS, OPERATIONS, Metrics

__all__ = [
    "COUNTERS",
    "OPERATIONS",
    "Metrics",
    "configure_for_cli",
    "get_logger",
]
