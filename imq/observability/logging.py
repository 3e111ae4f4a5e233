"""imq's log events: structured events sent to the standard ``logging`` logger ``imq``.

The library never configures logging and never writes to stdout. Every event is a
``logging.LogRecord`` of the logger named ``imq`` (:data:`LOGGER_NAME`), so:

- with nothing configured, Python's last-resort handler prints WARNING and above on
  stderr and drops the rest;
- a host that configures :mod:`logging` (``logging.basicConfig``, ``dictConfig``, a
  handler on ``imq``) gets every event it enables. ``record.getMessage()`` reads
  ``diff_applied shard=0:8000000000000000 seqno=3 messages=10 component=queue db=...``;
  every field is also an attribute of the record (``record.seqno``), except a field
  whose name a ``LogRecord`` already uses, and ``record.msg`` is the event as a dict;
- a host that routes logging through structlog's ``ProcessorFormatter`` receives the
  event dict itself (``event``, ``level``, ``timestamp`` and the fields), as from one of
  its own structlog loggers.

imq's loggers are structlog bound loggers built with their own processors: they do
not read structlog's global configuration, so ``structlog.configure`` elsewhere in the
process changes nothing here (and ``structlog.testing.capture_logs`` does not see imq's
events: use :func:`capture_events`). The ``imq`` command calls
:func:`configure_for_cli`, which puts a handler on the ``imq`` logger only.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, Final, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

__all__ = [
    "LOGGER_NAME",
    "ImqLogger",
    "capture_events",
    "configure_for_cli",
    "get_logger",
]

LOGGER_NAME: Final = "imq"
"""The standard-library logger every imq event goes to."""

_LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

# Attributes a LogRecord has (or gets while formatting): a field of the same name stays
# in the event dict only, since ``extra`` may not overwrite them.
_RECORD_ATTRIBUTES: Final = frozenset(logging.makeLogRecord({}).__dict__) | {
    "message",
    "asctime",
    "taskName",
}
# Keys that the record itself shows (level, time): left out of the message text.
_NOT_IN_TEXT: Final = frozenset({"event", "level", "timestamp"})


class _Event(dict[str, Any]):
    """An event dict whose ``str()`` is one readable line: the event name, then
    ``key=value`` for each field. ``LogRecord.getMessage()`` calls it."""

    __slots__ = ()

    def __str__(self) -> str:
        parts = [str(self.get("event"))]
        for name, value in self.items():
            if name not in _NOT_IN_TEXT:
                text = value if isinstance(value, str) and value and " " not in value else None
                parts.append(f"{name}={text if text is not None else repr(value)}")
        return " ".join(parts)


def _to_record(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> Any:
    """The last processor: the arguments of ``logging.Logger.<level>(...)``.

    The record's ``msg`` is the event (see :class:`_Event`); ``_logger`` and ``_name``
    are what structlog's ``ProcessorFormatter`` looks for to treat the record as a
    structlog event; the fields become record attributes.
    """
    exc_info = event_dict.pop("exc_info", None)
    extra = {k: v for k, v in event_dict.items() if k not in _RECORD_ATTRIBUTES}
    extra["_logger"] = logger
    extra["_name"] = method_name
    kwargs: dict[str, Any] = {"extra": extra}
    if exc_info:
        kwargs["exc_info"] = exc_info
    return (_Event(event_dict),), kwargs


_PROCESSORS: Final[list[Processor]] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
    _to_record,
]


class ImqLogger(structlog.stdlib.BoundLogger):
    """A structlog bound logger over the standard logger ``imq``, with imq's own
    processors. A call whose level the ``imq`` logger does not enable returns at once,
    before any processing."""

    def debug(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        if self._logger.isEnabledFor(logging.DEBUG):
            return self._proxy_to_logger("debug", event, *args, **kw)
        return None

    def info(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        if self._logger.isEnabledFor(logging.INFO):
            return self._proxy_to_logger("info", event, *args, **kw)
        return None

    def warning(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        if self._logger.isEnabledFor(logging.WARNING):
            return self._proxy_to_logger("warning", event, *args, **kw)
        return None

    def error(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        if self._logger.isEnabledFor(logging.ERROR):
            return self._proxy_to_logger("error", event, *args, **kw)
        return None


def get_logger(component: str, **bound: object) -> ImqLogger:
    """A logger for one imq component: events go to the standard logger ``imq`` with
    ``component`` and ``bound`` as fields.

    Create it once per object and keep it. It does not depend on structlog's global
    configuration, and nothing is configured by creating or using it.
    """
    return ImqLogger(
        logging.getLogger(LOGGER_NAME),
        processors=_PROCESSORS,
        context={"component": component, **bound},
    )


# --- the CLI ---------------------------------------------------------------------------


class _StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever ``sys.stderr`` is at the time of each record."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_for_cli(level: str = "info", json: bool = False) -> None:
    """Set up the ``imq`` command's output: imq events at ``level`` and above go to
    stderr, as aligned console lines or, with ``json=True``, one JSON object per line.

    Only the standard logger ``imq`` is touched (its level, one handler installed by
    this function and replaced on a second call, no propagation to the root logger);
    nothing is written to stdout. Raises ``ValueError`` on an unknown level.
    """
    levelno = _LEVELS.get(level.lower())
    if levelno is None:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(_LEVELS)}")
    renderer: list[Processor]
    if json:
        renderer = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        renderer = [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
    )
    handler = _StderrHandler(sys.stderr)
    handler.setFormatter(formatter)
    handler.set_name(_CLI_HANDLER)
    logger = logging.getLogger(LOGGER_NAME)
    for old in [h for h in logger.handlers if h.get_name() == _CLI_HANDLER]:
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(levelno)
    logger.propagate = False


_CLI_HANDLER: Final = "imq-cli"


# --- tests -----------------------------------------------------------------------------


class _CaptureHandler(logging.Handler):
    def __init__(self, entries: list[MutableMapping[str, Any]]) -> None:
        super().__init__(logging.DEBUG)
        self._entries = entries
        self._entries_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, _Event):
            return
        entry: dict[str, Any] = {
            k: v for k, v in record.msg.items() if k not in ("level", "timestamp")
        }
        entry["log_level"] = record.levelname.lower()
        with self._entries_lock:
            self._entries.append(entry)


@contextmanager
def capture_events(level: int = logging.DEBUG) -> Iterator[list[MutableMapping[str, Any]]]:
    """Collect the imq events at ``level`` and above emitted inside the block.

    Each entry is shaped as ``structlog.testing.capture_logs`` shapes one: ``event``, the
    fields, and ``log_level``. The ``imq`` logger's level is lowered to ``level`` for the
    block and restored after; other handlers still receive the events.
    """
    entries: list[MutableMapping[str, Any]] = []
    handler = _CaptureHandler(entries)
    logger = logging.getLogger(LOGGER_NAME)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield entries
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
