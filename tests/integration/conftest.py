"""Fixtures of the integration tests: a real queue in ``tmp_path``.

This directory goes on ``sys.path`` so the test modules can ``from builders import ...``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from builders import Chain, open_queue  # noqa: E402

from imq import Queue  # noqa: E402


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "queue"


@pytest.fixture
def queue(db_path: Path) -> Iterator[Queue]:
    q = open_queue(db_path)
    try:
        yield q
    finally:
        q.close()


@pytest.fixture
def chain(queue: Queue) -> Chain:
    return Chain(queue)


@pytest.fixture
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Every structlog event (debug and up) while the test runs.

    A queue binds its logger when it is opened, with the level filter configured at that
    moment, so open the queue *after* this fixture is set up (inside the test).
    """
    previous = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs() as entries:
            yield entries
    finally:
        structlog.configure(wrapper_class=previous)
