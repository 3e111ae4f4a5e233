"""The optional C extension ``imq._speedups``, loaded once for the write path.

``speedups`` is the module when it was built (``setup.py`` builds it when the machine has
a C compiler) and ``IMQ_PURE_PYTHON`` does not ask for pure Python (any value but
empty, ``0``, ``false``, ``no`` or ``off`` does: :func:`pure_python_requested`), else
``None``: every caller then runs its pure-Python form, with identical results
(``tests/unit/test_speedups.py``). Callers take the functions they use into module
globals (``None`` when absent), which tests monkeypatch to run the pure-Python forms in
one process. The iterator loads the same module for its decode (``imq.iterator``).
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["pure_python_requested", "speedups", "speedups_status"]

_OFF = frozenset({"", "0", "false", "no", "off"})


def pure_python_requested() -> bool:
    """Whether ``IMQ_PURE_PYTHON`` asks for the pure-Python paths (``1``, ``yes``...; unset,
    empty, ``0``, ``false``, ``no`` and ``off`` do not)."""
    return os.environ.get("IMQ_PURE_PYTHON", "").strip().lower() not in _OFF


def _load() -> ModuleType | None:
    if pure_python_requested():
        return None
    try:
        from imq import _speedups  # noqa: PLC0415 -- optional, built only with a compiler
    except ImportError:
        return None
    return _speedups


speedups = _load()


def speedups_status() -> str:
    """One line for ``imq --version``: whether the compiled paths run, and if not, why.
    A C build that failed is silent at install time (the extension is optional, so pip
    goes on); this is where an operator sees that the queue runs its slower
    pure-Python paths."""
    if speedups is not None:
        return "compiled speedups: on"
    if pure_python_requested():
        return "compiled speedups: off (IMQ_PURE_PYTHON is set)"
    return (
        "compiled speedups: not built (no C compiler at install, or the build failed): "
        "pure-Python paths, about half the read speed; reinstall with a C compiler"
    )
