"""The marks of the compiled path's own tests: skipped where the extension cannot be
built (no C compiler) and where ``IMQ_PURE_PYTHON`` turns it off."""

from __future__ import annotations

import shutil

import pytest

from imq import iterator
from imq._native import pure_python_requested

COMPILED_ONLY = [
    pytest.mark.skipif(
        not iterator.COMPILED and shutil.which("cc") is None,
        reason="no C compiler on this machine, so imq._speedups was not built",
    ),
    pytest.mark.skipif(
        pure_python_requested(),
        reason="IMQ_PURE_PYTHON is set: the compiled paths these tests check are off",
    ),
]
