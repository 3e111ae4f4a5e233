"""Shared test setup: hypothesis profiles, quiet logging, a ``queue`` fixture.

Hypothesis profiles (pick one with ``HYPOTHESIS_PROFILE=<name>``; otherwise ``ci`` when
the ``CI`` environment variable is set, else ``dev``):

- ``dev``: quick local runs;
- ``ci``: hypothesis' own ``ci`` profile (derandomized, no example database) with more
  examples;
- ``thorough``: bug hunting, minutes per state machine.

The tests directory is put on ``sys.path`` so test modules can ``import model``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from hypothesis import settings

from imq import Queue, QueueConfig

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

settings.register_profile("dev", max_examples=30, deadline=None, stateful_step_count=25)
settings.register_profile(
    "ci",
    settings.get_profile("ci"),
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
)
settings.register_profile("thorough", max_examples=500, stateful_step_count=80, deadline=None)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)


def _quiet_structlog() -> None:
    # No cache_logger_on_first_use: structlog.testing.capture_logs must keep working.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


_quiet_structlog()

# Python turns SIGINT into KeyboardInterrupt only if SIGINT was not ignored when it
# started, and a background job of a non-interactive shell (``make test &`` in a script,
# some CI runners) starts with it ignored: the tests of a Ctrl-C then saw nothing raised.
# The run gets Python's own handler, as an interactive one has.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _structlog_restored() -> Iterator[None]:
    """Each test starts quiet and leaves structlog and the standard logger ``imq`` as it
    found them: a test that runs the CLI in-process puts a handler on ``imq``."""
    if not structlog.is_configured():
        _quiet_structlog()
    saved = structlog.get_config()
    imq_logger = logging.getLogger("imq")
    handlers, level, propagate = list(imq_logger.handlers), imq_logger.level, imq_logger.propagate
    yield
    structlog.configure(**saved)
    imq_logger.handlers[:] = handlers
    imq_logger.setLevel(level)
    imq_logger.propagate = propagate


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[Queue]:
    q = Queue.open(tmp_path / "db", QueueConfig.testing())
    try:
        yield q
    finally:
        q.close()
