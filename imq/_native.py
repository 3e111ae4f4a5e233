"""The optional C extension ``imq._speedups``, loaded once for the write path.

``speedups`` is the module when it was built (``setup.py`` builds it when the machine has
a C compiler) and ``IMQ_PURE_PYTHON`` is unset, else ``None``: every caller then runs its
pure-Python form, with identical results (``tests/unit/test_speedups.py``). Callers take
the functions they use into module globals (``None`` when absent), which tests
monkeypatch to run the pure-Python forms in one process. The iterator loads the same
module for its decode (``imq.iterator``).
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["speedups"]


def _load() -> ModuleType | None:
    if os.environ.get("IMQ_PURE_PYTHON"):
        return None
    try:
        from imq import _speedups  # noqa: PLC0415 -- optional, built only with a compiler
    except ImportError:
        return None
    return _speedups


speedups = _load()
