"""The C extension (``imq._speedups``) stays memory-safe and agrees with its pure-Python
twins when its callers' objects misbehave: a failed ``init()``, a type that is not a
plain class over tuple, a callback that changes the list being read, an ``__index__``
that changes the dict being read, arguments out of range.

A scenario that crashed the process (or read freed memory) before its fix runs in a
child process, so that a regression fails this test instead of ending the test run."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import imq

S = pytest.importorskip("imq._speedups")

_ROOT = str(Path(imq.__file__).resolve().parent.parent)

_COMMON = """\
import struct
from imq import _speedups as S
from imq.types import Address, IteratedMessage, Message, QueueKey


def key(lt):
    return struct.pack(">H", 0) + bytes(12) + struct.pack(">Q", lt) + bytes(32)


def value(body=b"body"):
    return bytes([128]) + b"\\x11" * 32 + bytes([128]) + b"\\x22" * 32 + body


"""


def _child(code: str) -> str:
    """Run ``code`` (after the helpers above) in a fresh interpreter that imports this
    imq; its stdout. The child must exit cleanly: a crash fails the test."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _COMMON + textwrap.dedent(code)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# -- init() and value_new(): only classes over tuple, all or nothing ---------------------------


def test_a_failed_init_leaves_the_registered_types_as_they_were() -> None:
    """init() checks its four arguments before it changes anything: a failure on the
    second leaves the first type registered before, not a class with a __dict__ built
    as if it had the plain layout."""
    out = _child(
        """
        class WithDict(tuple):  # a __dict__ and a __weakref__ slot: not the plain layout
            pass

        S.init(IteratedMessage, Message, QueueKey, Address)
        try:
            S.init(WithDict, 1, 2, 3)
        except TypeError:
            print("refused")
        msgs = S.decode_run([key(1)] * 3, [value()] * 3, (0, 0))
        print(type(msgs[0]).__name__, type(msgs[0][1]).__name__)
        del msgs
        """
    )
    assert out.split() == ["refused", "IteratedMessage", "Message"]


def test_init_and_value_new_refuse_a_struct_sequence() -> None:
    """A C struct sequence has a tuple's sizes but hidden fields past its items:
    tuple.__new__ refuses it as unsafe, and so do value_new() and init()."""
    out = _child(
        """
        import os, time
        for cls in (os.stat_result, time.struct_time):
            try:
                tuple.__new__(cls, (1, 2, 3))
            except TypeError:
                print("python refuses")
            try:
                r = S.value_new(cls, (1, 2, 3))
                print("built", r[0], r.st_mtime_ns if cls is os.stat_result else r.tm_zone)
            except TypeError:
                print("C refuses")
        try:
            S.init(os.stat_result, Message, QueueKey, Address)
        except TypeError:
            print("init refuses")
        """
    )
    assert out.split("\n")[:-1] == ["python refuses", "C refuses"] * 2 + ["init refuses"]


def test_value_new_accepts_what_tuple_new_accepts() -> None:
    class Loose(tuple):  # type: ignore[type-arg]
        pass

    class WithNew(tuple):  # type: ignore[type-arg]
        __slots__ = ()

        def __new__(cls, a: int) -> WithNew:
            return tuple.__new__(cls, (a,))

    for cls in (tuple, Loose, WithNew):
        made = S.value_new(cls, (1, 2))
        assert type(made) is cls and made == (1, 2)
    for cls in (list, int, type("Bytes", (bytes,), {})):
        with pytest.raises(TypeError):
            S.value_new(cls, (1, 2))


def test_value_new_keeps_a_value_tracked_while_a_field_can_become_tracked() -> None:
    """An empty dict is untracked by CPython until a container goes in: a value holding
    one must stay tracked, or a cycle through the dict is never collected."""

    class Plain(tuple):  # type: ignore[type-arg]
        __slots__ = ()

    atom = S.value_new(Plain, (1, b"x", "s", 1.5, None, True))
    nested = S.value_new(Plain, (atom, S.value_new(Plain, (2,)), b"y"))
    assert not gc.is_tracked(atom) and not gc.is_tracked(nested)
    for field in ({}, set(), [], frozenset(), Plain((1,)), ({},)):
        assert gc.is_tracked(S.value_new(Plain, (1, field))), field
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection before the one below
    try:
        gc.collect()
        d: dict[str, object] = {}
        cycle = S.value_new(Plain, (d, b""))
        d["self"] = cycle
        del d, cycle
        assert gc.collect() >= 2  # the value and its dict
    finally:
        if enabled:
            gc.enable()
