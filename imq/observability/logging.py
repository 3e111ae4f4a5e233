"""structlog loggers for imq components, and the CLI's logging setup.

The library only creates loggers; it never calls ``structlog.configure``. Applications
configure structlog themselves; the ``imq`` command calls :func:`configure_for_cli`.
"""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.typing import FilteringBoundLogger, Processor

__all__ = [
    "configure_for_cli",
    "get_logger",
]

LOGGER_NAME = "imq"

_LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def get_logger(component: str, **bound: object) -> FilteringBoundLogger:
    """A logger named ``imq`` with ``component`` and ``bound`` bound as fields.

    Create it once per object and keep it: binding is done here, so each later call
    costs about as much as a plain function call when its level is filtered out.
    """
    logger: FilteringBoundLogger = structlog.get_logger(LOGGER_NAME)
    return logger.bind(component=component, **bound)


def configure_for_cli(level: str = "info", json: bool = False) -> None:
    """Configure structlog globally for the ``imq`` command: events at ``level`` and
    above go to stderr, as aligned console lines or, with ``json=True``, one JSON
    object per line. Raises ``ValueError`` on an unknown level.
    """
    levelno = _LEVELS.get(level.lower())
    if levelno is None:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(_LEVELS)}")
    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        processors += [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(levelno),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
