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
from imq.types import Address, Message, QueueKey

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


def _child(code: str, prelude: str = _COMMON) -> str:
    """Run ``code`` (after ``prelude``: by default the helpers above) in a fresh
    interpreter that imports this imq; its stdout. The child must exit cleanly: a crash
    fails the test."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
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


# -- callbacks that change what is being read: the C code holds what it uses ------------------


def test_put_rows_survives_a_put_that_empties_the_messages() -> None:
    out = _child(
        """
        msgs = [tuple(Message(QueueKey(i, b"h" * 32), Address(0, b"s" * 32),
                              Address(0, b"d" * 32), b"b" * 10)) for i in range(50)]
        def put(k, v, t):
            msgs.clear()  # frees the list's items and every message
            msgs.append(None)
        try:
            S.put_rows(put, None, bytes(12), msgs, None, {})
        except RuntimeError as e:
            print(e)
        """
    )
    assert out == "messages changed size during put_rows\n"


@pytest.mark.parametrize("fn", ["put_rows", "encode_diff"])
def test_the_read_ahead_over_messages_survives_odd_shapes_and_a_list_rewritten(fn: str) -> None:
    """The write loop asks the memory for messages up to 8 ahead, reading their tuples
    and those tuples' items: it must look only inside objects of the shapes it checks,
    and only at what the list holds now (a put() may rewrite it)."""
    out = _child(
        f"""
        def msg(i, src=Address(0, b"s" * 32)):
            return tuple(Message(QueueKey(i, b"h" * 32), src, Address(0, b"d" * 32), b"b" * 10))
        def call(msgs, put):
            args = (put, None, bytes(12), msgs, None)
            return S.{fn}(*args, {{}}) if "{fn}" == "put_rows" else S.{fn}(*args)
        odd = [7, None, (1, 2), (1, 2, 3, 4, 5), "abcd", b"abcd", (1, 2, 3, 4),
               ((1,), (2,), (3,), 4), ((1, 2, 3), "s", "d", b""),
               ((1,), (0, b"s" * 32), (0, b"d" * 32), b"")]
        for bad in odd:
            msgs = [msg(i) for i in range(3)] + [bad] + [msg(i) for i in range(4, 20)]
            put = []
            try:
                call(msgs, lambda k, v, t: put.append(k))
            except (TypeError, ValueError):
                pass
            print(len(put), end=" ")
        print()
        # a put that swaps every message ahead for other objects, then for a short list
        msgs = [msg(i) for i in range(40)]
        seen = []
        def rewrite(k, v, t):
            seen.append(k)
            if len(seen) == 2:
                msgs[2:] = [msg(100 + i, src=Address(0, b"x" * 32)) for i in range(38)]
            if len(seen) == 5:
                del msgs[6:]
        try:
            call(msgs, rewrite)
        except RuntimeError as e:
            print(e)
        print(len(seen), int.from_bytes(seen[2][14:22], "big"))
        """
    )
    lines = out.splitlines()
    assert lines[0].split() == ["3"] * 10  # the 3 messages before the bad one, then the error
    assert lines[1:] == [f"messages changed size during {fn}", "6 100"]


def test_message_bounds_survives_a_range_that_empties_the_list() -> None:
    out = _child(
        """
        class R:
            @property
            def shard(self):
                ranges.clear()  # frees the list's items
                return (0, 1 << 63)
            from_key = (1, b"a" * 32)
            to_key = (2, b"b" * 32)
        ranges = [R() for _ in range(8)]
        print(len(S.message_bounds(0, ranges)), len(ranges))
        """
    )
    assert out == "8 0\n"


def test_cache_scan_survives_a_segment_that_empties_the_bounds() -> None:
    out = _child(
        """
        P = bytes(14)
        class Seg:
            @property
            def floor(self):
                bounds.clear()  # frees the pairs and their bytes
                return b""
            firsts = lasts = datas = offss = []
        bounds = [(P + b"\\x01" * 40, P + b"\\x02" * 40) for _ in range(4)]
        print(len(S.cache_scan({P: Seg()}, 14, bounds, None)))
        """
    )
    assert out == "4\n"


@pytest.mark.parametrize("which", ["stat_value", "diff_record"])
def test_a_workchain_index_that_empties_the_dict_is_survived(which: str) -> None:
    out = _child(
        f"""
        class T(tuple):  # freed to malloc, not to the tuple free list
            __slots__ = ()
        d = {{}}
        class WC:
            def __index__(self):
                d.clear()  # frees the key and the value being encoded
                return 0
        try:
            if "{which}" == "stat_value":
                d[T((WC(), b"a" * 32))] = 10
                S.stat_value(d)
            else:
                qk = (1, b"h" * 32)
                d[T((WC(), 0))] = T((5, b"q" * 32))
                S.diff_record(1, qk, qk, {{}}, b"", d, {{}}, {{}}, 1, None, {{}})
        except RuntimeError as e:
            print(e)
        """
    )
    assert out == f"dict changed size during {which}\n"


def test_merge_fill_fails_cleanly_when_a_source_shortens_its_lists() -> None:
    """A source's next() that empties lastkeys, positions and heads: merge_fill raises
    IndexError (it used to return a batch with the exception still set: SystemError)."""
    out = _child(
        """
        S.init(IteratedMessage, Message, QueueKey, Address)
        lastkeys, positions, heads = [None, None], [None, None], [None, None]
        shards = [(0, 0), (0, 0)]
        other = bytes([133]) + value()[1:]  # another workchain: skipped
        class Src:
            def __init__(self, rows, mutate):
                self.rows, self.mutate = iter(rows), mutate
            def __iter__(self):
                return self
            def __next__(self):
                row = next(self.rows)
                if self.mutate:
                    lastkeys.clear(); positions.clear(); heads.clear(); shards.clear()
                return row
        sources = [Src([(key(1), other), (key(2), value())], True),
                   Src([(key(100), value())], False)]
        try:
            S.merge_fill(sources, heads, lastkeys, [0, 1], 16, 128, 0, 0, shards, positions)
        except IndexError as e:
            print(type(e).__name__)
        """
    )
    assert out == "IndexError\n"


# -- the Tee and its pure-Python twin agree; C raises what Python raises -----------------------


def _row(lt: int) -> tuple[bytes, bytes]:
    return bytes(14) + lt.to_bytes(8, "big") + bytes(32), bytes([128]) + bytes(65) + b"body"


def test_the_tee_and_its_twin_agree_on_a_long_prefix_and_on_a_bytearray() -> None:
    from imq.storage import cache

    for cls in (S.Tee, cache._PyTee):
        segments: dict[bytes, list[bytearray]] = {}
        tee = cls(lambda *_: None, segments, 60)
        key, value = _row(1)
        tee(key, value, None)
        assert not tee.invalid and list(segments) == [key], cls
        assert segments[key][0] == key + value
        odd = cls(lambda *_: None, {}, 14)
        odd(key, bytearray(value), None)
        assert odd.invalid, cls
        for bad in (0, 65):
            with pytest.raises(ValueError, match="prefix_len"):
                cls(lambda *_: None, {}, bad)


def test_chunk_rows_and_cache_scan_take_what_the_twin_takes_and_raise_its_errors() -> None:
    from imq.storage import cache

    data, offs = S.chunk_pack([_row(i) for i in range(3)])
    for cls in (S.ChunkRows, cache._PyChunkRows):
        assert len(list(cls([data], [offs], 0, 3, [128, 0, 0]))) == 3, cls
        for want in (-1, 2**64 + 5):
            with pytest.raises(OverflowError):
                list(cls([data], [offs], 0, 3, (128, 8, want)))
    assert S.cache_scan({}, 14, [], [128, 0, 0]) == []
    with pytest.raises(OverflowError):
        S.cache_scan({}, 14, [], (128, 0, -1))
    message = Message(QueueKey(1, bytes(32)), Address(0, bytes(32)), Address(0, bytes(32)), b"")
    for prefix in (-1, 2**64):
        with pytest.raises(OverflowError):
            S.sources_in_shard([message], 0, prefix, 1)


def test_chunk_bisect_reads_an_unchecked_chunk_in_its_bounds() -> None:
    from imq.storage import cache

    for data, offs in [
        (b"x" * 10, (100_000).to_bytes(4, sys.byteorder)),
        (b"a" * 60, (0).to_bytes(4, sys.byteorder) + (30).to_bytes(4, sys.byteorder)),
    ]:
        for key in (b"a" * 54, b"a" * 30, b"z"):
            assert S.chunk_bisect(data, offs, key) == cache._chunk_bisect_py(data, offs, key)
