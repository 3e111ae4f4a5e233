"""Running the ``imq`` command in-process for the CLI tests: ``imq(*argv) -> Run``.

The fixture itself is registered in ``conftest.py``; test modules import ``Run`` and
``Imq`` from here for their annotations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from imq.cli.main import main

__all__ = ["Imq", "Run", "make_runner"]


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str


Imq = Callable[..., Run]


def make_runner(capsys: pytest.CaptureFixture[str]) -> Imq:
    """``run(*argv)``: call ``imq.cli.main.main`` and capture its exit status and output
    (argparse's ``SystemExit`` included). The CLI's logging setup touches only the
    ``imq`` logger, which ``tests/conftest.py`` restores after each test."""

    def run(*argv: str | Path) -> Run:
        capsys.readouterr()
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run
