"""What a hand-made mutation audit of ``imq._speedups`` (the C merge, decode, chunk
helpers, ``ChunkRows``, ``cache_scan``, ``Tee``) found no test to pin, pinned here:

- the C merge rejects every malformed row the pure-Python merge rejects, with the same
  error (a key longer than a message key, a one-byte value) and survives arguments out
  of range (``limit`` 0, ``prefix_len`` 65, a ``need`` index past the sources);
- ties: rows whose queue keys differ only in the hash's last byte, and equal queue keys
  in three sources, come in the pure-Python merge's order;
- a source that runs out at its first refill is reported as ended (its end check runs:
  a cursor that stopped early raises instead of reading as the end of its range);
- the chunk helpers agree with their pure-Python forms on the edges: equal keys in one
  chunk are not ascending (``chunk_check`` and the ``Tee``), a key longer than a message
  key is refused (``chunk_pack``), rows to cut or a start row below 0 are refused
  (``chunk_cut``, ``ChunkRows``), a stop row below 0 is refused at once;
- ``cache_scan`` answers exactly as ``MessageCache.scan`` where a bound meets a chunk's
  first or last key or the floor, and for a segment whose prefix ends in 0xff bytes;
- the C merge reads a ``ChunkRows`` in place only when it is filtered for the merge's
  own reader.

Two tests reproduce defects the audit found in the C code (fixed in stop 48): a
``ChunkRows`` over chunks that never passed ``chunk_check`` read rows where their
offsets said (out of bounds), and the merge's in-place read of a cached chunk decoded
a value shorter than its header past its end. A scenario that may crash the process
runs in a child process, as in ``test_speedups_safety.py``."""

from __future__ import annotations

import contextlib
import gc
import struct
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from compiled_only import COMPILED_ONLY
from test_speedups_safety import _child as _safety_child

from imq import iterator
from imq.errors import CorruptDataError
from imq.storage import cache as cache_mod
from imq.storage import codec
from imq.types import Address, Message, QueueKey, QueueShardRange, ShardIdent

pytestmark = COMPILED_ONLY

S: Any = pytest.importorskip("imq._speedups")

SHARD = ShardIdent(0, 0x4000_0000_0000_0000)
OTHER = ShardIdent(0, 0xC000_0000_0000_0000)
SRC = Address(0, b"\x01" * 32)
Row = tuple[bytes, bytes]


def _c_fill(*args: object) -> Any:
    return S.merge_fill(*args)


FILLS: list[tuple[str, Callable[..., Any]]] = [("C", _c_fill), ("Python", iterator._py_merge_fill)]


def _rows(messages: list[Message], shard: ShardIdent = SHARD) -> list[Row]:
    return codec.message_rows(shard, sorted(messages), None)


def _message(lt: int, hash_: bytes | None = None, dst_top: int = 0, wc: int = 0) -> Message:
    dst = Address(wc, bytes([dst_top]) + bytes(31))
    return Message(QueueKey(lt, hash_ or lt.to_bytes(32, "big")), SRC, dst, b"body")


def _merge_all(
    sources: list[Any],
    limit: int,
    fill: Callable[..., Any],
    reader: tuple[int, int, int] = (128, 0, 0),
    shards: list[ShardIdent] | None = None,
) -> tuple[list[Any], list[Any], list[Any], list[int], int]:
    """Drive a merge_fill as the iterator does, to the end: (messages, final positions,
    last keys, ended sources, rows skipped)."""
    n = len(sources)
    its = [iter(s) for s in sources]
    heads: list[Any] = [None] * n
    lastkeys: list[Any] = [None] * n
    positions: list[Any] = [None] * n
    need = list(range(n))
    out: list[Any] = []
    ended_all: list[int] = []
    skipped = 0
    while True:
        batch, final, _records, ended, need, n_skipped = fill(
            its, heads, lastkeys, need, limit, *reader, shards or [SHARD] * n, positions
        )
        skipped += n_skipped
        ended_all += ended
        positions[:] = final
        if not batch:
            return out, positions, lastkeys, ended_all, skipped
        out += batch


def _error_of(run: Callable[[], object]) -> tuple[type[BaseException], tuple[Any, ...]]:
    with pytest.raises(Exception) as info:
        run()
    return type(info.value), info.value.args


def _child(code: str) -> str:
    """Run ``code`` in a fresh interpreter that imports this imq; its stdout. The child
    must exit cleanly: a crash fails the test instead of ending the run."""
    return _safety_child(code, prelude="")


# -- malformed rows: the same error on both paths ----------------------------------------------


def test_an_accepted_row_with_a_key_longer_than_a_message_key_is_corrupt_in_both() -> None:
    """The C merge compares an accepted row's key in place, so it checks its length:
    a key one byte too long is as corrupt as one a byte short (the Python decode's
    struct refuses it)."""
    good = _rows([_message(1)])[0]
    long_key = _rows([_message(2)])[0][0] + b"\x00"
    for name, fill in FILLS:
        with pytest.raises((ValueError, CorruptDataError)) as info:
            _merge_all([[good, (long_key, good[1])]], 10, fill)
        error = info.value
        bad = error.key if isinstance(error, CorruptDataError) else error.args[1]
        assert bad == long_key, name


def test_a_one_byte_value_is_reported_as_python_reports_it() -> None:
    """The error names an empty value as empty and any other short value as too short,
    in the same words on both paths (a 1-byte value is not empty)."""
    key = _rows([_message(2)])[0][0]
    for value in (b"", b"\x80", b"\x80" * 65):
        rows = [(key, value)]
        errors = [_error_of(lambda f=fill, r=rows: _merge_all([r], 10, f)) for _, fill in FILLS]
        assert errors[0] == errors[1], value


def test_merge_fill_with_limit_zero_takes_one_message_a_call() -> None:
    """A limit below 1 is taken as 1 (the batch list is allocated at the limit; a batch
    of 0 would be written past its end)."""
    out = _child(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_speedups_mutation_audit import _c_fill, _merge_all, _message, _rows
        rows = _rows([_message(lt) for lt in range(1, 40)])
        a = _merge_all([rows], 0, _c_fill)
        b = _merge_all([rows], 1, _c_fill)
        print(a == b, len(a[0]))
        """
    )
    assert out.split() == ["True", "39"]


def test_merge_fill_refuses_a_prefix_length_past_64_and_a_need_past_the_sources() -> None:
    rows = _rows([_message(1)])
    with pytest.raises(ValueError, match="prefix_len"):
        S.merge_fill([iter(rows)], [None], [None], [0], 16, 128, 65, 0, [SHARD], [None])
    out = _child(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_speedups_mutation_audit import SHARD, S, _message, _rows
        rows = _rows([_message(1)])
        for need in ([1], [-1], [5]):
            try:
                S.merge_fill([iter(rows)], [None], [None], need, 16, 128, 0, 0, [SHARD], [None])
                print("taken")
            except IndexError:
                print("IndexError")
        """
    )
    assert out.split() == ["IndexError"] * 3


def test_merge_fill_refuses_a_source_that_is_not_an_iterator() -> None:
    """A list of rows (iterable, not an iterator) is a TypeError, not a crash. The check
    is ``PyIter_Check``: Python 3.13 took ``_PyObject_NextNotImplemented``, which the
    first form compared against, out of its headers, and the extension stopped building
    there (silently: it is optional)."""
    rows = _rows([_message(1)])
    for source in (rows, tuple(rows), object()):
        with pytest.raises(TypeError, match="sources must be iterators"):
            S.merge_fill([source], [None], [None], [0], 16, 128, 0, 0, [SHARD], [None])


# -- ordering: ties --------------------------------------------------------------------------


def test_keys_differing_only_in_the_hashs_last_byte_merge_in_key_order() -> None:
    """Two sources whose queue keys share the lt and all but the last hash byte: the
    whole 32-byte hash decides, on both paths."""
    base = b"\x07" * 31
    a = _rows([_message(5, base + b"\x02"), _message(5, base + b"\x04")], SHARD)
    b = _rows([_message(5, base + b"\x01"), _message(5, base + b"\x03")], OTHER)
    want = [base + bytes([i]) for i in (1, 2, 3, 4)]
    for name, fill in FILLS:
        for limit in (1, 2, 16):
            messages, *_ = _merge_all([a, b], limit, fill, shards=[SHARD, OTHER])
            assert [m.message.key.hash for m in messages] == want, (name, limit)


def test_equal_keys_in_three_sources_come_in_range_order() -> None:
    """One queue key in three sources, behind a lower key in the middle one: after the
    middle source's first row, the first source's row of the shared key comes before
    the middle source's own (the lower range first), then the third's."""
    shards = [SHARD, OTHER, ShardIdent(0, 0x2000_0000_0000_0000)]
    shared = _message(9)
    sources = [_rows([shared], shards[0]), _rows([_message(3), shared], shards[1])]
    sources.append(_rows([shared], shards[2]))
    want = [(shards[1], 3), (shards[0], 9), (shards[1], 9), (shards[2], 9)]
    for name, fill in FILLS:
        for limit in (1, 2, 16):
            messages, *_ = _merge_all(sources, limit, fill, shards=shards)
            assert [(m[0], m.message.key.lt) for m in messages] == want, (name, limit)


# -- the end check of a source that ends at once -----------------------------------------------


def test_a_source_that_ends_at_its_first_refill_is_reported_ended() -> None:
    """Every source whose rows run out is in ``ended`` (the iterator runs its end check:
    a RocksDB cursor cut short raises there), also one that ran out before the first
    message and one whose every row was skipped."""
    rows = _rows([_message(1), _message(2)])
    skipped_only = _rows([_message(5, dst_top=0xFF)], OTHER)
    for name, fill in FILLS:
        *_, ended, _ = _merge_all([[], rows, skipped_only], 16, fill, (128, 1, 0))
        assert sorted(ended) == [0, 1, 2], name


# -- the chunk helpers against their pure-Python forms -----------------------------------------


def test_equal_keys_in_one_chunk_are_not_ascending() -> None:
    """A key put twice in one batch: ``chunk_check`` and the ``Tee`` both say the chunk is
    not strictly ascending, as their Python forms do (the cache then sorts it, the last
    put winning)."""
    row = _rows([_message(1)])[0]
    data, offs = S.chunk_pack([row, row])
    assert S.chunk_check(data, offs) == cache_mod._chunk_check_py(data, offs) == (2, 2 * 70, False)
    for cls in (S.Tee, cache_mod._PyTee):
        tee = cls(lambda *_: None, {}, codec.MESSAGE_PREFIX_LEN)
        tee(*row, None)
        assert not tee.unordered, cls
        tee(*row, None)
        assert tee.unordered, cls


def test_chunk_pack_refuses_a_key_longer_than_a_message_key() -> None:
    key, value = _rows([_message(1)])[0]
    for pack in (S.chunk_pack, cache_mod._pack_py):
        with pytest.raises(ValueError, match="message key"):
            pack([(key + b"\x00", value)])


def test_a_negative_row_index_is_refused_by_chunk_cut_and_chunk_rows() -> None:
    """Row indexes below 0 are refused (ValueError) as the Python forms refuse them,
    never read before the offsets; a stop row below 0 is refused when the scan is
    made, not when it reaches the last chunk."""
    out = _child(
        """
        from imq import _speedups as S
        from imq.storage import cache
        from imq.storage import codec
        from imq.types import Address, Message, QueueKey, ShardIdent
        src = Address(0, b"\\x01" * 32)
        rows = codec.message_rows(
            ShardIdent(0, 1 << 62),
            [Message(QueueKey(lt, bytes(32)), src, src, b"x") for lt in (1, 2, 3)],
            None,
        )
        data, offs = S.chunk_pack(rows)
        view = memoryview(bytes(4) + offs)[4:]  # offsets with four zero bytes before them
        for name, call in [
            ("cut C", lambda: S.chunk_cut(data, offs, -1, 0)),
            ("cut Python", lambda: cache._chunk_cut_py(data, offs, -1, 0)),
            ("cut C", lambda: S.chunk_cut(data, view, -1, 1)),
            ("cut Python", lambda: cache._chunk_cut_py(data, view, -1, 1)),
            ("rows C", lambda: list(S.ChunkRows([data], [offs], -1, 3))),
            ("rows Python", lambda: list(cache._PyChunkRows([data], [offs], -1, 3))),
            ("stop C", lambda: S.ChunkRows([data, data], [offs, offs], 0, -1)),
            ("stop Python", lambda: cache._PyChunkRows([data, data], [offs, offs], 0, -1)),
        ]:
            try:
                call()
                print(name, "taken")
            except ValueError:
                print(name, "refused")
        """
    )
    assert [line.split()[-1] for line in out.splitlines()] == ["refused"] * 8, out


def test_chunk_bisect_of_an_empty_key_in_an_unchecked_chunk_agrees() -> None:
    """A row starting past the data holds an empty key: an empty key is not above it."""
    for data, offs in [
        (b"x" * 10, (100_000).to_bytes(4, sys.byteorder)),
        (b"", (0).to_bytes(4, sys.byteorder)),
    ]:
        assert S.chunk_bisect(data, offs, b"") == cache_mod._chunk_bisect_py(data, offs, b"") == 0


# -- cache_scan: the bounds at a chunk's edges, the floor, a prefix ending in 0xff -------------


def _filled_cache(pre: bytes) -> cache_mod.MessageCache:
    """A cache whose segment ``pre`` (any 14 bytes) holds three chunks of rows with lts
    10..12, 20..22 and 30..32 above a floor at lt 5, half of them for the reader
    (128, 1, 0)."""
    cache = cache_mod.MessageCache(1 << 20, codec.MESSAGE_PREFIX_LEN)
    cache.establish(pre, pre + QueueKey(5, bytes(32)).to_bytes())
    for base in (10, 20, 30):
        msgs = [_message(lt, dst_top=0xFF * (lt % 2)) for lt in range(base, base + 3)]
        rows = [(pre + k[len(pre) :], v) for k, v in _rows(msgs)]
        data, offs = S.chunk_pack(rows)
        cache.after_write({pre: [bytearray(data), bytearray(offs)]}, [])
    cache.check()
    return cache


def _probes(cache: cache_mod.MessageCache, pre: bytes) -> list[bytes]:
    """Keys at, just below and just above every cached key and the floor, the prefix and
    the bound past the segment."""
    keys = [k for _, rows in cache.segments().values() for k, _ in rows]
    floor = cache.segments()[pre][0]
    out = [pre, cache_mod._prefix_end(pre), pre + b"\xff" * 40]
    for k in [*keys, floor]:
        out += [k, k + b"\x00", k[:-1] + bytes([k[-1] - 1]) if k[-1] else k[:-1]]
    return out


_PREFIXES = [
    codec.message_prefix(0, SHARD),
    codec.message_prefix(3, SHARD)[:-2] + b"\x10\xff",  # a prefix that ends in 0xff
    b"\x00" * 13 + b"\xff",
]


@pytest.mark.parametrize("pre", _PREFIXES, ids=["shard", "ends-in-ff", "zeros-then-ff"])
@pytest.mark.parametrize("reader", [None, (128, 1, 0)])
def test_cache_scan_answers_exactly_as_the_python_scan(
    pre: bytes, reader: tuple[int, int, int] | None
) -> None:
    """Every (lo, hi) pair of the probe keys: the C scan serves exactly the ranges the
    Python scan serves (None where it declines) with the same rows, and refuses the
    inverted ranges inside one chunk that it refuses (ValueError)."""
    cache = _filled_cache(pre)
    probes = _probes(cache, pre)
    for lo in probes:
        for hi in probes:
            got = _scan_result(
                lambda lo=lo, hi=hi: S.cache_scan(
                    cache._segments, codec.MESSAGE_PREFIX_LEN, [(lo, hi)], reader
                )[0]
            )
            want = _scan_result(lambda lo=lo, hi=hi: cache.scan(lo, hi, reader))
            assert got == want, (lo.hex(), hi.hex())


def _scan_result(scan: Callable[[], Any]) -> object:
    """A scan's rows, None where the cache declines, or the type of its error."""
    try:
        rows = scan()
    except ValueError as error:
        return type(error)
    return None if rows is None else list(rows)


@pytest.mark.parametrize("pre", _PREFIXES, ids=["shard", "ends-in-ff", "zeros-then-ff"])
def test_a_scan_to_the_segments_end_is_served_and_one_from_the_floor_is_not(pre: bytes) -> None:
    cache = _filled_cache(pre)
    floor = cache.segments()[pre][0]
    end = cache_mod._prefix_end(pre)
    assert end != pre
    rows = [r for _, rs in cache.segments().values() for r in rs]
    above = floor + b"\x00"
    [served, declined] = S.cache_scan(
        cache._segments, codec.MESSAGE_PREFIX_LEN, [(above, end), (floor, end)], None
    )
    assert list(served) == rows
    assert declined is None


# -- the C merge reads a ChunkRows in place only when it is its own ----------------------------


def _chunk_sources(rows: list[Row], reader: tuple[int, int, int]) -> list[Any]:
    data, offs = S.chunk_pack(rows)
    return [
        S.ChunkRows([data], [offs], 0, len(rows), reader),
        cache_mod._PyChunkRows([data], [offs], 0, len(rows), reader),
    ]


@pytest.mark.parametrize("scan_reader", [(128, 1, 1), (128, 2, 0), (127, 1, 0), (128, 0, 0)])
def test_a_scan_filtered_for_another_reader_merges_as_its_rows(
    scan_reader: tuple[int, int, int],
) -> None:
    """A ChunkRows filtered for another reader than the merge's is pulled row by row, as
    any source: the merge yields the messages of the rows it hands out that the merge's
    own reader accepts, as the Python merge does over the Python form."""
    tops = [0x00, 0x80, 0x40, 0xC0, 0x00, 0x00, 0x80, 0x40]
    rows = _rows([_message(lt, dst_top=top) for lt, top in enumerate(tops, 1)])
    reader = (128, 1, 0)
    outs = []
    for source, (name, fill) in zip(_chunk_sources(rows, scan_reader), FILLS, strict=True):
        handed = list(_chunk_sources(rows, scan_reader)[0 if name == "C" else 1])
        messages, *_ = _merge_all([source], 4, fill, reader)
        want, *_ = _merge_all([handed], 4, iterator._py_merge_fill, reader)
        assert messages == want, name
        outs.append(messages)
    assert outs[0] == outs[1]


def test_a_scan_holding_a_row_for_its_next_pull_is_pulled_on() -> None:
    """A filtered ChunkRows whose last pull returned a rejected row (the end of a run)
    holds the accepted row after it: a merge then pulls it on instead of reading the
    chunk in place past that row."""
    tops = [0x80, 0x80, 0x00, 0x00, 0x80, 0x00]
    rows = _rows([_message(lt, dst_top=top) for lt, top in enumerate(tops, 1)])
    reader = (128, 1, 0)
    outs = []
    for source, (name, fill) in zip(_chunk_sources(rows, reader), FILLS, strict=True):
        first = next(source)  # the run's last rejected row; the accepted one is held
        assert first == rows[1], name
        messages, *_ = _merge_all([source], 16, fill, reader)
        assert [m.message.key.lt for m in messages] == [3, 4, 6], name
        outs.append(messages)
    assert outs[0] == outs[1]


def test_a_body_of_a_bytes_subclass_value_is_copied() -> None:
    """A source's row whose value is a bytes subclass (held by nothing else) gives a
    body equal to it, of type bytes: the value is not cut in place as a plain bytes
    object's would be."""
    out = _child(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_speedups_mutation_audit import _c_fill, _merge_all, _message, _rows

        class Value(bytes):
            pass

        key, value = _rows([_message(1)])[0]

        def source():
            yield key, Value(value)

        messages, *_ = _merge_all([source()], 16, _c_fill)
        body = messages[0].message.body
        print(type(body).__name__, body == value[66:])
        """
    )
    assert out.split() == ["bytes", "True"]


# -- defects of the unmodified C code ----------------------------------------------------------


def test_chunk_rows_over_an_offset_past_the_data_stay_in_bounds() -> None:
    """An offset past the chunk's data: C refuses the row (``ValueError``) where the
    Python form reads empty slices; before the fix C read out of bounds (SIGSEGV)."""
    out = _child(
        """
        import sys
        from imq import _speedups as S
        from imq.storage import cache
        data, offs = b"x" * 10, (0xFFFF_FF00).to_bytes(4, sys.byteorder)
        for reader in (None, (128, 0, 0)):
            want = list(cache._PyChunkRows([data], [offs], 0, 1, reader))
            try:
                print(list(S.ChunkRows([data], [offs], 0, 1, reader)) == want)
            except ValueError:
                print("refused")
        """
    )
    assert out.split() in (["True", "True"], ["refused", "refused"])


def test_a_short_row_in_a_chunk_read_in_place_is_corrupt_as_in_python() -> None:
    """A cached row whose value is shorter than its header, read in place by the C merge,
    raises the Python merge's ``ValueError("message row too short", key)``; before the
    fix C decoded the header past the value's end (``SystemError``)."""
    out = _child(
        """
        import sys
        from imq import _speedups as S, iterator
        from imq.storage import cache
        from imq.types import ShardIdent
        key, value = bytes(54), bytes([128]) + bytes(9)
        data, offs = key + value, (0).to_bytes(4, sys.byteorder)
        shard = ShardIdent(0, 1 << 63)
        for fill, rows in [
            (S.merge_fill, cache.ChunkRows([data], [offs], 0, 1, (128, 0, 0))),
            (iterator._py_merge_fill, cache._PyChunkRows([data], [offs], 0, 1, (128, 0, 0))),
        ]:
            try:
                fill([rows], [None], [None], [0], 16, 128, 0, 0, [shard], [None])
                print("taken")
            except Exception as error:
                print(type(error).__name__, error.args == ("message row too short", key))
        """
    )
    assert out.split() == ["ValueError", "True"] * 2


# -- references: nothing a call makes or is given outlives it ----------------------------------


def _growth(call: Callable[[], object], rounds: int = 1000) -> int:
    """Bytes that ``rounds`` more calls of ``call`` leave allocated (tracemalloc), after
    a warm-up that fills the allocator's and the caches' free lists."""
    for _ in range(50):
        call()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(rounds):
            call()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_merge_fill_keeps_no_reference_to_what_it_is_given_or_makes() -> None:
    """Sources that interleave, skip rows inside a streak and before the first message,
    and fill several batches: no call leaves a reference to a shard, a key or an
    address behind, whether it succeeds or fails on a bad row."""
    shards = [SHARD, OTHER]
    tops = [0x80, 0x00, 0x80, 0x80, 0x00, 0x00, 0x80, 0x00]
    a = _rows([_message(2 * i + 1, dst_top=t, wc=0) for i, t in enumerate(tops)], SHARD)
    b = _rows([_message(2 * i + 20, dst_top=t, wc=0) for i, t in enumerate(tops)], OTHER)
    bad = [*a[:3], (a[3][0], b"\x80")]
    # a streak of the first source ends before the second's short row fails the call
    first = _rows([_message(1), _message(10)], SHARD)
    second = _rows([_message(5), _message(7)], OTHER)
    second[1] = (second[1][0], b"\x80")

    def merge() -> None:
        _merge_all([a, b], 3, _c_fill, (128, 1, 0), shards)

    def fail() -> None:
        with pytest.raises(ValueError, match="short"):
            _merge_all([bad, b], 2, _c_fill, (128, 1, 0), shards)
        with pytest.raises(ValueError, match="short"):
            _merge_all([first, second], 16, _c_fill, (128, 0, 0), shards)

    held = [*shards, *(x for row in [*a, *b, bad[-1], *first, *second] for x in row)]
    # Garbage from earlier tests may still refer to the (shared) shard objects: collected
    # first, or _growth's collection would lower their counts.
    gc.collect()
    before = [sys.getrefcount(x) for x in held]
    assert _growth(merge) < 16_000
    assert _growth(fail) < 16_000
    assert [sys.getrefcount(x) for x in held] == before


def test_cache_scan_and_message_bounds_keep_no_reference() -> None:
    pre = _PREFIXES[0]
    cache = _filled_cache(pre)
    segment = cache._segments[pre]
    floor = segment.floor
    pairs = [(floor + b"\x01", cache_mod._prefix_end(pre)), (floor, floor + b"\x01")]
    ranges = tuple(
        QueueShardRange(SHARD, QueueKey(lt, bytes(32)), QueueKey(lt + 5, bytes(32)))
        for lt in range(4)
    )
    objects = [floor, segment.firsts, segment.datas, pairs[0], pairs[1], ranges, ranges[0]]
    gc.collect()  # as above: only this test's references are counted
    before = [sys.getrefcount(o) for o in objects]

    def scan() -> None:
        for rows in S.cache_scan(cache._segments, codec.MESSAGE_PREFIX_LEN, pairs, (128, 1, 0)):
            list(rows or ())
        S.message_bounds(1, ranges)

    assert _growth(scan) < 16_000
    assert [sys.getrefcount(o) for o in objects] == before


def test_a_source_with_a_pending_row_is_not_refilled_over_it() -> None:
    """A source named in ``need`` that still has its pending row keeps it: the row is
    the first message, the source's other rows follow."""
    rows = _rows([_message(lt) for lt in (1, 2, 3)])
    heads: list[Any] = [rows[0]]
    batch, *_ = S.merge_fill([iter(rows[1:])], heads, [None], [0], 16, 128, 0, 0, [SHARD], [None])
    assert [m.message.key.lt for m in batch] == [1, 2, 3]


def test_a_pending_row_with_a_value_short_of_its_header_is_refused() -> None:
    key, value = _rows([_message(1)])[0]
    for short in (value[:65], b""):
        heads: list[Any] = [(key, short)]
        with pytest.raises(TypeError, match="heads"):
            S.merge_fill([iter([])], heads, [None], [], 16, 128, 0, 0, [SHARD], [None])
        assert heads == [(key, short)]


@pytest.mark.parametrize("check", [S.chunk_check, cache_mod._chunk_check_py], ids=["C", "Python"])
def test_chunk_check_takes_a_bare_header_and_refuses_one_byte_less(check: Any) -> None:
    """A row of a key and a 66-byte value (an empty body) is a message row; 65 bytes of
    value are not, whether the row is the last one or not."""
    key, value = _rows([_message(1)])[0]
    key2 = _rows([_message(2)])[0][0]
    header = value[: codec.MESSAGE_VALUE_HEADER_LEN]
    assert check(*S.chunk_pack([(key, header), (key2, header)])) == (2, 132, True)
    for rows in ([(key, header[:-1])], [(key, header[:-1]), (key2, header)]):
        with pytest.raises(ValueError, match="chunk"):
            check(*S.chunk_pack(rows))


def test_message_bounds_refuses_a_workchain_outside_i32() -> None:
    """A shard whose workchain is not an i32 (no ShardIdent holds one; a tuple
    subclass built around the check) is refused, by C with ValueError, by the Python
    form's struct with its own error, never wrapped around."""
    for wc in (2**31, -(2**31) - 1):
        shard = tuple.__new__(ShardIdent, (wc, 1 << 63))
        ranges = [_FakeRange(shard, QueueKey(1, bytes(32)), QueueKey(2, bytes(32)))]
        with pytest.raises(ValueError, match="i32"):
            S.message_bounds(0, ranges)
        with pytest.raises(struct.error):
            codec._message_bounds_py(0, ranges)


class _FakeRange(NamedTuple):
    shard: ShardIdent
    from_key: QueueKey
    to_key: QueueKey


@pytest.mark.parametrize("cls", [S.Tee, cache_mod._PyTee], ids=["C", "Python"])
def test_a_tee_marks_a_value_one_byte_short_of_its_header_invalid(cls: Any) -> None:
    key, value = _rows([_message(1)])[0]
    header = value[: codec.MESSAGE_VALUE_HEADER_LEN]
    tee = cls(lambda *_: None, {}, codec.MESSAGE_PREFIX_LEN)
    tee(key, header, None)
    assert not tee.invalid
    tee(_rows([_message(2)])[0][0], header[:-1], None)
    assert tee.invalid


def test_consecutive_addresses_differing_in_the_last_byte_are_not_shared() -> None:
    """The C merge reuses the previous row's Address only for the same 33 bytes: accounts
    that differ in their last byte alone decode to their own addresses."""
    accounts = [bytes(31) + bytes([i]) for i in (1, 2, 2, 3)]
    msgs = [
        Message(QueueKey(lt, bytes(32)), Address(0, acc), Address(0, acc), b"")
        for lt, acc in enumerate(accounts, 1)
    ]
    rows = _rows(msgs)
    for name, fill in FILLS:
        got, *_ = _merge_all([rows], 16, fill)
        assert [m.message for m in got] == msgs, name


class _ReadError(Exception):
    pass


@pytest.mark.parametrize("name", ["C", "Python"])
@pytest.mark.parametrize("after", [0, 3])
def test_an_error_raised_by_a_source_is_raised_never_an_end(name: str, after: int) -> None:
    """A source whose next() raises (a cursor's read error, a closed queue) fails the
    merge with that error, before the first message or inside a batch; only
    StopIteration ends a source."""
    fill = dict(FILLS)[name]
    rows = _rows([_message(lt) for lt in range(1, 6)])

    def source() -> Any:
        yield from rows[:after]
        raise _ReadError("read failed")

    with pytest.raises(_ReadError):
        _merge_all([source(), rows], 16, fill, shards=[SHARD, OTHER])


class _Cursor:
    """A store cursor over a list of rows (the iterator's interface)."""

    dropped = 0

    def __init__(self, rows: list[Any]) -> None:
        self.rows = iter(rows)

    def finish(self, last_key: bytes | None) -> None:
        pass

    def close(self) -> None:
        self.rows = iter(())


class _Snap:
    def __init__(self, cursors: list[_Cursor]) -> None:
        self.cursors = cursors
        self.state = None

    def check_usable(self) -> None:
        pass

    def close(self) -> None:
        for cursor in self.cursors:
            cursor.close()


@pytest.mark.parametrize("pure", [False, True], ids=["C", "Python"])
@pytest.mark.parametrize("bad", ["str key", "str value"])
def test_a_row_that_is_not_bytes_fails_the_iterator_with_corrupt_data(pure: bool, bad: str) -> None:
    """Whatever a source hands the merge that is not a (bytes, bytes) row is the
    store's damage as the iterator reports it: CorruptDataError, never a bare TypeError."""
    key, value = _rows([_message(2)])[0]
    row: Any = {
        "str key": (key.decode("latin-1"), value),
        "str value": (key, value.decode("latin-1")),
    }[bad]
    rows = [_rows([_message(1)])[0], row]
    ranges = [QueueShardRange(SHARD, QueueKey.MIN, QueueKey.MAX)]
    with iterator.pure_python() if pure else contextlib.nullcontext():
        it = iterator.QueueIterator(_Snap([_Cursor(rows)]), ranges, ShardIdent.BASECHAIN)
    with pytest.raises(CorruptDataError):
        list(it)
    it.close()


@pytest.mark.parametrize("prefix", [(0, 0), (1, 0)])
def test_a_reader_in_workchain_minus_128_gets_its_rows(prefix: tuple[int, int]) -> None:
    """Workchain -128 is stored as byte 0: a reader there accepts its rows on both
    paths (byte 0 is a workchain, not the reader outside every workchain)."""
    msgs = [_message(lt, wc=-128 if lt % 2 else 0) for lt in range(1, 9)]
    rows = _rows(msgs)
    for name, fill in FILLS:
        got, *_ = _merge_all([rows], 16, fill, (0, *prefix))
        assert [m.message for m in got] == [m for m in msgs if m.dst.workchain == -128], name


@pytest.mark.parametrize("pure", [False, True], ids=["C", "Python"])
def test_the_position_at_the_end_passes_the_rows_skipped_after_the_last_message(
    pure: bool,
) -> None:
    """Once every source has run out, each source's position is its last stored row,
    also when that row (and the run before it) was for another shard."""
    tops = [0x40, 0x40, 0xFF, 0xFF]
    msgs = [_message(lt, dst_top=top) for lt, top in enumerate(tops, 1)]
    ranges = [QueueShardRange(SHARD, QueueKey.MIN, QueueKey.MAX)]
    for_shard = ShardIdent(0, 0x4000_0000_0000_0000)  # accounts whose top 2 bits are 01
    with iterator.pure_python() if pure else contextlib.nullcontext():
        it = iterator.QueueIterator(_Snap([_Cursor(_rows(msgs))]), ranges, for_shard)
    assert [m.message.key.lt for m in it] == [1, 2]
    assert it.current_position() == {SHARD: msgs[-1].key}
    it.close()
    assert it.current_position() == {SHARD: msgs[-1].key}


def test_eviction_takes_the_largest_segments_oldest_chunks() -> None:
    """Past the budget, the largest segment gives its oldest chunks (its floor rising
    past them) until the cache fits in three quarters of the budget; a small segment
    keeps its rows."""
    big_pre, small_pre = (codec.message_prefix(p, SHARD) for p in (1, 2))
    cache = cache_mod.MessageCache(6_000, codec.MESSAGE_PREFIX_LEN)
    for pre in (big_pre, small_pre):
        cache.establish(pre, pre)

    def put(pre: bytes, lts: range) -> None:
        rows = [(pre + k[len(pre) :], v) for k, v in _rows([_message(lt) for lt in lts])]
        data, offs = S.chunk_pack(rows)
        cache.after_write({pre: [bytearray(data), bytearray(offs)]}, [])

    put(small_pre, range(1, 3))
    small = cache.segments()[small_pre]
    for base in range(10, 200, 10):
        put(big_pre, range(base, base + 5))
    cache.check()
    assert cache.nbytes <= 6_000 * 3 // 4
    assert cache.segments()[small_pre] == small
    floor, rows = cache.segments()[big_pre]
    assert floor > big_pre
    assert rows[0][0] > floor
    assert rows[-1][0][len(big_pre) :] == QueueKey(194, (194).to_bytes(32, "big")).to_bytes()


def test_a_batch_starting_at_the_newest_cached_key_replaces_that_row() -> None:
    """A batch whose first key is the newest cached one (a key stored again): the row
    is replaced, not cached twice, and the chunks stay disjoint."""
    pre = codec.message_prefix(0, SHARD)
    cache = cache_mod.MessageCache(1 << 20, codec.MESSAGE_PREFIX_LEN)
    cache.establish(pre, pre)
    old = _rows([_message(lt) for lt in (1, 2, 3)])
    new = _rows([Message(_message(3).key, SRC, SRC, b"again"), _message(4)])
    for rows in (old, new):
        data, offs = S.chunk_pack(rows)
        cache.after_write({pre: [bytearray(data), bytearray(offs)]}, [])
    cache.check()
    assert cache.segments()[pre][1] == [*old[:2], *new]
    assert list(cache.scan(pre + b"\x00", cache_mod._prefix_end(pre))) == [*old[:2], *new]


def test_a_load_below_the_floor_takes_messages_with_an_empty_body() -> None:
    """A message row is a key and a value of at least its 66-byte header: rows of
    empty-bodied messages below the floor are loaded like any other."""
    pre = codec.message_prefix(0, SHARD)
    below = _rows([Message(_message(lt).key, SRC, SRC, b"") for lt in (1, 2, 3)])
    cache = cache_mod.MessageCache(1 << 20, codec.MESSAGE_PREFIX_LEN)
    cache.establish(pre, below[-1][0])
    cache.extend_down(pre, below)
    assert cache.segments()[pre] == (pre, below)
    cache.check()


def test_a_delete_whose_end_is_a_cached_key_keeps_that_row() -> None:
    """A deleted range ``[lo, hi)`` ends before ``hi``: a cached row at ``hi`` (the last
    of its chunk, or inside it) stays, as it stays in RocksDB."""
    pre = codec.message_prefix(0, SHARD)
    rows = _rows([_message(lt) for lt in range(1, 7)])
    for hi_row in (2, 5):  # inside the chunk, its last row
        cache = cache_mod.MessageCache(1 << 20, codec.MESSAGE_PREFIX_LEN)
        cache.establish(pre, pre)
        for part in (rows[:3], rows[3:]):
            data, offs = S.chunk_pack(part)
            cache.after_write({pre: [bytearray(data), bytearray(offs)]}, [])
        cache.after_write({}, [(rows[0][0], rows[hi_row][0])])
        cache.check()
        assert cache.segments()[pre][1] == rows[hi_row:], hi_row


@pytest.mark.parametrize(
    "reader",
    [(128, 1, 0), (128, 0, 0), (255, 0, 0), (255, 8, 0xFF), (128, 64, 2**63 - 1), (0, 0, 0)],
)
def test_a_filtered_scan_accepts_the_last_route_of_its_readers_range(
    reader: tuple[int, int, int],
) -> None:
    """Destinations whose account's top 64 bits are all ones below the reader's prefix
    (the greatest route it accepts) and the ones just past it: C and Python agree."""
    accounts = [
        (0x7FFF_FFFF_FFFF_FFFF).to_bytes(8, "big"),
        (0x8000_0000_0000_0000).to_bytes(8, "big"),
        b"\xff" * 8,
        bytes(8),
    ]
    msgs = []
    for lt, (wc, top) in enumerate(((wc, top) for wc in (-128, 0, 127) for top in accounts), 1):
        msgs.append(Message(QueueKey(lt, bytes(32)), SRC, Address(wc, top + bytes(24)), b""))
    rows = _rows(msgs)
    data, offs = S.chunk_pack(rows)
    want = list(cache_mod._PyChunkRows([data], [offs], 0, len(rows), reader))
    got = list(S.ChunkRows([data], [offs], 0, len(rows), reader))
    assert got == want
    accepted, *_ = _merge_all([rows], 16, iterator._py_merge_fill, reader)
    keys = {codec.message_key(0, SHARD, m.message.key) for m in accepted}
    assert keys  # the greatest route of each reader is stored
    assert keys <= {k for k, _ in want}


def test_a_segment_with_nothing_below_its_floor_never_asks_for_a_load() -> None:
    """A segment whose floor is its prefix holds every stored row: its declined scans
    (ranges past the segment) never ask the store to load what lies below."""
    pre = codec.message_prefix(0, SHARD)
    cache = cache_mod.MessageCache(1 << 20, codec.MESSAGE_PREFIX_LEN)
    cache.establish(pre, pre)
    assert [cache.missed(pre) for _ in range(3)] == [None] * 3
