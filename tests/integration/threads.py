"""Threads for the concurrency tests: a worker that keeps its result or exception, a
guard that dumps every thread's stack when a test hangs far past its own timeouts, and a
trace function that acts when a function reaches a given line (a thread switch or a
signal landing there)."""

from __future__ import annotations

import faulthandler
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

TIMEOUT = 15.0  # upper bound for anything that must finish, seconds


class Worker(threading.Thread):
    """Runs ``fn`` in a daemon thread and keeps its result or exception."""

    def __init__(self, fn: Callable[[], Any], name: str = "worker") -> None:
        super().__init__(name=name, daemon=True)
        self._fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.finished.set()

    def outcome(self) -> Any:
        """The result (or the exception, raised) once finished; fails on a hang."""
        assert self.finished.wait(TIMEOUT), f"{self.name} did not finish (deadlock?)"
        self.join(TIMEOUT)
        if self.error is not None:
            raise self.error
        return self.result


def started(fn: Callable[[], Any], name: str = "worker") -> Worker:
    worker = Worker(fn, name)
    worker.start()
    return worker


@contextmanager
def hang_guard(seconds: float = 240.0) -> Iterator[None]:
    """Dump every thread's stack (to stderr) if the block runs ``seconds`` or more."""
    faulthandler.dump_traceback_later(seconds, exit=False)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def guarded(
    fn: Callable[[], None], errors: list[BaseException], stop: threading.Event
) -> Callable[[], None]:
    """``fn`` for a thread of a race: an exception is kept in ``errors`` and sets
    ``stop``, so that the other threads end at their next check of it."""

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)
            stop.set()

    return run


def at_line(function: Any, text: str, action: Callable[[], object]) -> Any:
    """A trace function (for ``sys.settrace``) that calls ``action()`` each time
    ``function`` reaches its one line containing ``text``, before the line runs. What
    ``action`` raises goes into that frame, as a signal handler's exception would, and
    the frame holds what it held there (a patched callee's frame would also hold its
    arguments)."""
    lines, first = inspect.getsourcelines(function)
    (at,) = [first + i for i, line in enumerate(lines) if text in line]
    code = function.__code__

    def local(frame: FrameType, event: str, arg: object) -> Any:
        if event == "line" and frame.f_lineno == at:
            action()
        return local

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code is code else None

    return tracer
