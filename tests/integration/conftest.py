"""Fixtures of the integration tests: a real queue in ``tmp_path``.

This directory goes on ``sys.path`` so the test modules can ``from builders import ...``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from builders import Chain, open_queue  # noqa: E402
from cli_runner import Imq, make_runner  # noqa: E402

from imq import Queue  # noqa: E402
from imq.observability import capture_events  # noqa: E402


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
    """Every imq event (debug and up) while the test runs, shaped as
    ``structlog.testing.capture_logs`` shapes them (``event``, fields, ``log_level``)."""
    with capture_events() as entries:
        yield entries


@pytest.fixture
def imq(capsys: pytest.CaptureFixture[str]) -> Imq:
    """``imq(*argv) -> Run``: the ``imq`` command run in-process (``cli_runner.py``)."""
    return make_runner(capsys)
