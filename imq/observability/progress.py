"""A progress line on stderr for long work (import, export), throttled.

On a terminal the line is redrawn in place; otherwise one line is printed about every
ten seconds, so logs of a non-interactive run stay short.
"""

from __future__ import annotations

import sys
from time import monotonic
from typing import TextIO

__all__ = ["ProgressLine"]


class ProgressLine:
    """Call with ``(done, total)``; :meth:`close` prints the final line."""

    def __init__(self, label: str, unit: str = "messages", stream: TextIO | None = None) -> None:
        self._label = label
        self._unit = unit
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._every = 0.2 if self._tty else 10.0
        self._started = monotonic()
        self._last = -self._every
        self._line = ""
        self._finished = False  # the line of done == total is printed once

    def __call__(self, done: int, total: int) -> None:
        now = monotonic()
        if done >= total:
            if self._finished:
                return
            self._finished = True
        elif now - self._last < self._every:
            return
        self._last = now
        elapsed = max(now - self._started, 1e-9)
        pct = 100.0 * done / total if total else 100.0
        self._line = (
            f"{self._label}: {done:,}/{total:,} {self._unit} ({pct:5.1f}%), "
            f"{done / elapsed:,.0f} {self._unit}/s"
        )
        self._stream.write(f"\r{self._line}" if self._tty else f"{self._line}\n")
        self._stream.flush()

    def close(self) -> None:
        if self._tty and self._line:
            self._stream.write("\n")
            self._stream.flush()
