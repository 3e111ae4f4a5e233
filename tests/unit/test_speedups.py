"""The compiled decode (imq._speedups) builds exactly what the pure-Python decode builds."""

from __future__ import annotations

import ast
import contextlib
import gc
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from itertools import repeat
from typing import Any

import pytest
from compiled_only import COMPILED_ONLY
from hypothesis import given, settings
from hypothesis import strategies as st

from imq import iterator
from imq.diff import QueueDiff
from imq.errors import CorruptDataError
from imq.storage import codec
from imq.testing import MemoryDatabase
from imq.types import (
    Address,
    BlockIdShort,
    IteratedMessage,
    Message,
    QueueKey,
    QueueShardRange,
    ShardIdent,
)

pytestmark = COMPILED_ONLY

SHARD = ShardIdent(0, 0x4000_0000_0000_0000)
ADDR2 = (Address(0, b"\x01" * 32), Address(-1, b"\x02" * 32))

addresses = st.builds(Address, st.integers(-128, 127), st.binary(min_size=32, max_size=32))
messages = st.builds(
    Message,
    st.builds(QueueKey, st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32)),
    addresses,
    addresses,
    st.binary(max_size=300),
)


def test_the_compiled_decode_is_in_use() -> None:
    # A compiler is present (the skip above), so `pip install` must have built it.
    assert iterator.COMPILED


def test_value_types_free_what_they_hold_however_they_were_made() -> None:
    """The value types free their instances through imq's dealloc: every item and the
    type itself are released, for instances tuple's own constructor made (tracked by the
    cyclic GC) and those the C decode made (not tracked), and the same through CPython's
    own dealloc, which ``pure_python()`` switches back to (and then restores)."""
    module = iterator._speedups_module
    body = b"a body shared by every message " + bytes(8)
    row = codec.message_rows(SHARD, [Message(QueueKey(7, bytes(32)), *ADDR2, body)], None)[0]
    with contextlib.ExitStack() as stack:
        for pure in (False, True):
            if pure:
                stack.enter_context(iterator.pure_python())
                assert module.value_deallocs(False) is False  # what pure_python() set
            before = [sys.getrefcount(t) for t in (IteratedMessage, Message, QueueKey, Address)]
            # Built by tuple's own tp_new (the constructors leave values out of the cyclic
            # GC when they can): instances the GC tracks.
            made = [
                tuple.__new__(
                    IteratedMessage,
                    (SHARD, tuple.__new__(Message, (QueueKey(i, bytes(32)), *ADDR2, body))),
                )
                for i in range(500)
            ]
            decoded = iterator._c_decode([row[0]] * 500, [row[1]] * 500, SHARD)
            assert gc.is_tracked(made[0]) and not gc.is_tracked(decoded[0])
            shared = sys.getrefcount(body)
            assert shared >= 500
            del made, decoded
            assert sys.getrefcount(body) == shared - 500
            after = [sys.getrefcount(t) for t in (IteratedMessage, Message, QueueKey, Address)]
            assert after == before
    assert module.value_deallocs(True) is True  # pure_python() put it back


def test_a_deep_nesting_of_value_types_is_freed_without_exhausting_the_stack() -> None:
    """imq's dealloc goes through CPython's trashcan, as tuples do: freeing a million
    nested values (built past the constructors' checks) must not crash the process."""
    code = (
        "from imq import iterator\n"
        "from imq.types import Address, Message, QueueKey\n"
        "assert iterator.COMPILED\n"
        "k, a = QueueKey(1, bytes(32)), Address(0, bytes(32))\n"
        "x = b''\n"
        "for _ in range(1_000_000):\n"
        "    x = tuple.__new__(Message, (k, a, a, x))\n"
        "del x\n"
        "print('freed')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "freed\n"


@given(st.lists(messages, min_size=1, max_size=80), st.integers(0, 65535))
def test_compiled_equals_pure_python(batch: list[Message], partition: int) -> None:
    rows = codec.message_rows(SHARD, batch, lambda _s, _d: partition)
    keys, values = [k for k, _ in rows], [v for _, v in rows]
    compiled = iterator._c_decode(keys, values, SHARD)
    pure = iterator._decode(keys, values, repeat(SHARD), {})
    assert compiled == pure == [IteratedMessage(SHARD, m) for m in batch]
    for c in compiled:
        assert type(c) is IteratedMessage
        assert type(c.message) is Message
        assert type(c.message.key) is QueueKey
        assert type(c.message.src) is type(c.message.dst) is Address


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (b"\x00" * 53, b"\x00" * 66),  # key one byte short
        (b"\x00" * 55, b"\x00" * 66),  # key one byte long
        (b"\x00" * 54, b"\x00" * 65),  # value shorter than its header
        (b"\x00" * 54, b"\x80" * 20),  # shorter than the destination address
        (b"\x00" * 54, b""),  # empty value
    ],
)
def test_bad_rows_raise_corrupt_data_in_both(key: bytes, value: bytes) -> None:
    good_key = codec.message_key(0, SHARD, QueueKey(1, b"\x01" * 32))
    good_value = b"\x80" * 66
    with pytest.raises(CorruptDataError, match="messages"):
        iterator._c_decode([good_key, key], [good_value, value], SHARD)
    with pytest.raises(CorruptDataError, match="messages"):
        iterator._decode([good_key, key], [good_value, value], repeat(SHARD), {})
    # The Python decode finds short values through its address cache (no length pass),
    # also when the cache already holds every whole address of the run.
    cache: dict[bytes, Address] = iterator._AddressCache()
    iterator._decode([good_key], [good_value], repeat(SHARD), cache)
    with pytest.raises(CorruptDataError, match="too short"):
        iterator._decode([good_key, key], [good_value, value], repeat(SHARD), cache)


def test_large_lt_and_extreme_workchains() -> None:
    key = codec.message_key(7, SHARD, QueueKey(2**64 - 1, b"\xff" * 32))
    value = struct.pack(">B32sB32s", 0, b"\x01" * 32, 255, b"\x02" * 32) + b"body"
    (item,) = iterator._c_decode([key], [value], SHARD)
    assert item.message.key == QueueKey(2**64 - 1, b"\xff" * 32)
    assert item.message.dst == Address(-128, b"\x01" * 32)
    assert item.message.src == Address(127, b"\x02" * 32)
    assert item.message.body == b"body"


def _rows(batch: list[Message], partition: int) -> list[tuple[bytes, bytes]]:
    return codec.message_rows(SHARD, sorted(batch), lambda _s, _d: partition)


def _c_merge_fill(*args: object) -> Any:
    return iterator._speedups_module.merge_fill(*args)


# The two implementations of one contract: C, and the pure-Python twin.
FILLS = [pytest.param(_c_merge_fill, id="C"), pytest.param(iterator._py_merge_fill, id="Python")]


def _merge_all(
    sources: list[list[tuple[bytes, bytes]]],
    limit: int,
    wc_byte: int = 128,
    prefix: tuple[int, int] = (0, 0),
    *,
    shards: list[ShardIdent] | None = None,
    fill: Callable[..., Any] = _c_merge_fill,
) -> tuple[list[list[IteratedMessage]], list[object], list[bytes | None], list[int], int]:
    """Drive ``merge_fill`` (or ``fill``) as the iterator does, to the end: (batches,
    final positions, last keys, ended sources in order, rows skipped)."""
    n = len(sources)
    its = [iter(rows) for rows in sources]
    heads: list[object] = [None] * n
    lastkeys: list[bytes | None] = [None] * n
    positions: list[object] = [None] * n
    need = list(range(n))
    batches, ended_all, skipped = [], [], 0
    while True:
        batch, final, _records, ended, need, n_skipped = fill(
            its, heads, lastkeys, need, limit, wc_byte, *prefix, shards or [SHARD] * n, positions
        )
        skipped += n_skipped
        ended_all += ended
        positions[:] = final
        if not batch:
            return batches, positions, lastkeys, ended_all, skipped
        assert len(batch) <= limit
        batches.append(batch)


def _model_merge(
    sources: list[list[tuple[bytes, bytes]]], wc_byte: int = 128, prefix: tuple[int, int] = (0, 0)
) -> tuple[list[bytes], list[bytes | None], int]:
    """SEMANTICS §11.2 on raw rows: the accepted keys in merged order, each source's last
    key read, rows skipped."""
    prefix_len, want = prefix
    accepted: list[tuple[bytes, int]] = []
    last: list[bytes | None] = [None] * len(sources)
    skipped = 0
    for idx, rows in enumerate(sources):
        for k, v in rows:
            top = int.from_bytes(v[1:9], "big") >> (64 - prefix_len) if prefix_len else 0
            if v[0] == wc_byte and top == want:
                accepted.append((k[codec.MESSAGE_PREFIX_LEN :], idx))
            else:
                skipped += 1
            last[idx] = k
    order = sorted(accepted)
    keys = [codec.message_key(0, SHARD, codec.decode_key(qk)) for qk, _ in order]
    return keys, last, skipped


@settings(deadline=None)
@given(
    st.lists(st.lists(messages, max_size=25, unique_by=lambda m: m.key), min_size=1, max_size=4),
    st.integers(1, 9),
    st.sampled_from([(0, 0), (1, 1), (2, 3), (64, 2**63)]),
    st.sampled_from([128, 127, 0, -1]),
)
def test_merge_fill_merges_as_the_model(
    per_source: list[list[Message]], limit: int, prefix: tuple[int, int], wc_byte: int
) -> None:
    """Random sources (lts overlap freely): both merge_fills yield the accepted rows of
    all of them in queue-key order, in batches of at most ``limit``, skip and end each
    source once, leave every source's last key read for its end check, and agree on the
    decoded messages and the final positions."""
    keys_seen = set()
    sources = []
    for batch in per_source:  # one queue key lives in one source only
        fresh = [m for m in batch if m.key not in keys_seen]
        keys_seen.update(m.key for m in fresh)
        sources.append(_rows(fresh, 0))
    want_keys, want_last, want_skipped = _model_merge(sources, wc_byte, prefix)
    outs = []
    for fill in (_c_merge_fill, iterator._py_merge_fill):
        batches, final, lastkeys, ended, skipped = _merge_all(
            sources, limit, wc_byte, prefix, fill=fill
        )
        got = [codec.message_key(0, SHARD, im.message.key) for b in batches for im in b]
        assert got == want_keys
        assert lastkeys == want_last
        assert skipped == want_skipped
        assert sorted(ended) == list(range(len(sources)))
        outs.append(([im for b in batches for im in b], final))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("fill", FILLS)
def test_merge_fill_takes_only_what_no_one_else_holds(fill: Callable[..., Any]) -> None:
    """A row that only the merge holds, as a RocksDB cursor yields them, may give its
    value to the message as the body (C cuts the header off in place); a row that its
    source still holds, or whose value someone else holds, stays as it was. Either way
    the messages are the same, empty bodies included."""
    other = ShardIdent(0, 0xC000_0000_0000_0000)
    batches = [
        [
            Message(
                QueueKey(2 * lt + s, bytes([lt]) * 32),
                Address(0, bytes([s + 1]) * 32),
                Address(0, bytes([lt]) * 32),
                b"body %d " % lt * (lt % 4),  # empty for every fourth
            )
            for lt in range(1, 40)
        ]
        for s in range(2)
    ]
    held = codec.message_rows(SHARD, batches[0], None)  # a list: held while merged
    fresh = codec.message_rows(other, batches[1], None)
    copies = [(k, bytes(memoryview(v))) for k, v in held + fresh]
    shared = {v for _, v in fresh[::3]}  # a third of the fresh rows' values held here too

    def rows_nobody_holds() -> Iterator[tuple[bytes, bytes]]:
        for k, v in fresh:  # a new tuple and, but for the shared ones, a new value
            yield k, (v if v in shared else bytes(memoryview(v)))

    out = []
    for _ in range(2):  # the same held rows merged again: nothing of them was taken
        its: list[Iterator[tuple[bytes, bytes]]] = [iter(held), rows_nobody_holds()]
        heads: list[object] = [None, None]
        lastkeys: list[bytes | None] = [None, None]
        positions: list[object] = [None, None]
        need = [0, 1]
        got: list[IteratedMessage] = []
        while True:
            batch, positions[:], _records, _ended, need, _skipped = fill(
                its, heads, lastkeys, need, 7, 128, 0, 0, [SHARD, other], positions
            )
            if not batch:
                break
            got += batch
        out.append(got)
    want = sorted(
        [IteratedMessage(SHARD, m) for m in batches[0]]
        + [IteratedMessage(other, m) for m in batches[1]],
        key=lambda im: im.message.key,
    )
    assert out[0] == out[1] == want
    assert [(k, bytes(memoryview(v))) for k, v in held + fresh] == copies


@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("prefix", [(0, 0), (2, 1)])
@pytest.mark.parametrize("cut", [False, True])
def test_merge_fill_of_one_workchain(
    fill: Callable[..., Any], prefix: tuple[int, int], cut: bool
) -> None:
    """Every decoded destination is in the accepted workchain (the Python decode then
    reads no workchain byte); rows of another workchain or prefix are skipped; a second
    source's row (``cut``) interrupts the first source's streak."""
    accounts = [bytes([b]) * 32 for b in (0x00, 0x40, 0x80, 0x7F)]  # prefix 01: 0x40, 0x7F
    batch = [
        Message(
            QueueKey(lt, bytes([lt]) * 32),
            Address(0, accounts[(lt + 1) % 4]),
            Address(0 if lt % 3 else -1, accounts[lt % 4]),
            b"body %d" % lt,
        )
        for lt in range(1, 15)
    ]
    prefix_len, want = prefix
    other = ShardIdent(0, 0xC000_0000_0000_0000)
    interrupt = Message(QueueKey(8, b"\xee" * 32), *(Address(0, accounts[1]),) * 2, b"cut")
    sources = [_rows(batch, 0)]
    if cut:
        sources.append(codec.message_rows(other, [interrupt], lambda _s, _d: 0))
    batches, _final, lastkeys, _ended, skipped = _merge_all(
        sources, 64, prefix=prefix, shards=[SHARD, other][: len(sources)], fill=fill
    )
    accepted = [
        IteratedMessage(SHARD, m)
        for m in batch
        if m.dst.workchain == 0 and (not prefix_len or m.dst.account[0] >> 6 == want)
    ]
    if cut:
        accepted.append(IteratedMessage(other, interrupt))
        accepted.sort(key=lambda im: im.message.key)
    assert [im for b in batches for im in b] == accepted
    assert skipped > 0  # some rows were skipped
    assert lastkeys[0] == sources[0][-1][0]


def _bad_key(run: Callable[[], object]) -> bytes:
    """The key a merge_fill names for a bad row: ValueError(what, key) from either fill,
    or CorruptDataError from the Python decode (the iterator turns both into the same
    CorruptDataError)."""
    with pytest.raises((ValueError, CorruptDataError)) as info:
        run()
    error = info.value
    return error.key if isinstance(error, CorruptDataError) else error.args[1]


@pytest.mark.parametrize("fill", FILLS)
def test_merge_fill_reports_the_bad_row(fill: Callable[..., Any]) -> None:
    good = codec.message_rows(
        SHARD, [Message(QueueKey(1, b"\x01" * 32), *(Address(0, b"\x02" * 32),) * 2, b"")]
    )[0]
    bad_key = codec.message_key(0, SHARD, QueueKey(2, b"\x03" * 32))
    assert _bad_key(lambda: _merge_all([[good, (bad_key, b"")]], 10, fill=fill)) == bad_key
    short_key = bad_key[:-1]  # an accepted row's key one byte short
    assert _bad_key(lambda: _merge_all([[good], [(short_key, good[1])]], 10, fill=fill)) in (
        short_key,
        good[0],  # the Python decode names the batch's first row when it cannot tell
    )


def test_merge_fill_refuses_heads_that_are_not_rows_and_leaves_them() -> None:
    """A pending row handed back to the C merge is checked before anything is taken;
    a bad one is a TypeError, and the caller's lists are as they were."""
    fill = iterator._merge_fill
    assert fill is not None
    good = codec.message_rows(
        SHARD, [Message(QueueKey(1, b"\x01" * 32), *(Address(0, b"\x02" * 32),) * 2, b"")]
    )[0]
    heads: list[Any] = [good, (good[0][:-1], good[1])]
    before = list(heads)
    with pytest.raises(TypeError, match="heads"):
        fill([iter([]), iter([])], heads, [None, None], [], 16, 128, 0, 0, [SHARD] * 2, [None] * 2)
    assert heads == before


@given(
    st.lists(messages, max_size=40),
    st.one_of(st.none(), st.integers(0, 65535), st.just(-1), st.just(-2)),
)
def test_put_rows_compiled_equals_pure_python(batch: list[Message], partition: int | None) -> None:
    """The C row encoding writes the bytes the Python one writes, with the same counts."""
    partition_for: Any
    if partition is None:
        partition_for = None
    elif partition == -2:  # destination routes: a dict, absent destinations in 0
        partition_for = {m.dst: 1 + m.dst.account[0] % 2 for m in batch[::2]}
    elif partition == -1:  # a router: the partition depends on the message

        def partition_for(src: Address, dst: Address) -> int:
            return (src.account[0] + dst.account[0]) % 3

    else:

        def partition_for(src: Address, dst: Address) -> int:
            return partition

    rows_c: list[tuple[bytes, bytes]] = []
    rows_py: list[tuple[bytes, bytes]] = []
    counts_c: dict[int, int] = {1: 5}
    counts_py: dict[int, int] = {1: 5}
    for put_rows, rows, counts in (
        (codec.put_message_rows, rows_c, counts_c),
        (codec._put_message_rows_py, rows_py, counts_py),
    ):
        n = put_rows(
            lambda k, v, t, rows=rows: rows.append((k, v)),
            None,
            SHARD,
            tuple(batch),
            partition_for,
            counts=counts,
        )
        assert n == len(batch)
    assert rows_c == rows_py
    assert counts_c == counts_py


def test_compiled_write_path_is_in_use() -> None:
    assert codec._c_put_rows is not None
    assert codec._c_stat_value is not None


@given(st.dictionaries(addresses, st.integers(1, 2**64 - 1), max_size=30))
def test_stat_value_compiled_equals_pure_python(counts: dict[Address, int]) -> None:
    assert codec.stat_value(counts) == codec._stat_value_py(counts)


@st.composite
def shard_ranges(draw: st.DrawFn) -> list[QueueShardRange]:
    """Ranges over shards of the extreme workchains, empty and inverted ones too."""
    keys = st.builds(
        QueueKey, st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32)
    ) | st.sampled_from([QueueKey.MIN, QueueKey.MAX])
    ranges = []
    for workchain in draw(st.lists(st.sampled_from([-(2**31), -1, 0, 1, 2**31 - 1]), max_size=5)):
        bits = 0 if workchain == -1 else draw(st.integers(0, 60))  # the masterchain is whole
        prefix = draw(st.integers(0, 2**bits - 1)) if bits else 0
        shard = ShardIdent(workchain, (prefix << (64 - bits)) | (1 << (63 - bits)))
        ranges.append(QueueShardRange(shard, draw(keys), draw(keys)))
    return ranges


@given(st.integers(0, 0xFFFF), shard_ranges())
def test_message_bounds_compiled_equals_pure_python(
    partition: int, ranges: list[QueueShardRange]
) -> None:
    bounds = codec.message_bounds(partition, ranges)
    assert codec._c_message_bounds is not None
    assert bounds == codec._message_bounds_py(partition, ranges)
    for (lo, hi), r in zip(bounds, ranges, strict=True):
        assert lo == codec.message_key(partition, r.shard, r.from_key)
        assert hi == max(lo, codec.message_key(partition, r.shard, r.to_key))


def test_message_bounds_refuses_what_is_not_a_range() -> None:
    good = QueueShardRange(SHARD, QueueKey.MIN, QueueKey.MAX)
    assert codec._c_message_bounds is not None
    with pytest.raises(ValueError, match="u16"):
        codec._c_message_bounds(0x10000, [good])
    with pytest.raises(AttributeError):
        codec._c_message_bounds(0, [good, (SHARD, QueueKey.MIN, QueueKey.MAX)])
    with pytest.raises(TypeError, match="sequence"):
        codec._c_message_bounds(0, 5)


@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 2), st.binary(max_size=20)),
        min_size=1,
        max_size=40,
    )
)
def test_merge_fill_with_repeated_addresses(picks: list[tuple[int, int, bytes]]) -> None:
    """Consecutive rows that share a source or destination decode to equal messages in
    both paths (the C path reuses the previous row's Address object)."""
    pool = [Address(0, bytes([i]) * 32) for i in range(3)]
    batch = [
        Message(QueueKey(i + 1, bytes(32)), pool[s], pool[d], body)
        for i, (s, d, body) in enumerate(picks)
    ]
    rows = _rows(batch, 0)
    (merged,), *_ = _merge_all([rows], 100)
    (py,), *_ = _merge_all([rows], 100, fill=iterator._py_merge_fill)
    assert merged == py == [IteratedMessage(SHARD, m) for m in batch]


def test_decoded_addresses_are_shared_and_values_untracked() -> None:
    """The C path builds its value types outside the cyclic GC (they hold only ints,
    bytes and such tuples) and, within a run, reuses the previous row's Address objects
    when the next row names the same accounts."""
    src, dst = Address(0, b"\x05" * 32), Address(-1, b"\x06" * 32)
    batch = [Message(QueueKey(i + 1, bytes([i]) * 32), src, dst, b"x" * i) for i in range(5)]
    rows = _rows(batch, 0)
    (first,), *_ = _merge_all([rows], 9, wc_byte=127)
    (again,), *_ = _merge_all([rows], 9, wc_byte=127)
    assert first == again == [IteratedMessage(SHARD, m) for m in batch]
    assert len({id(im.message.src) for im in first}) == 1
    assert len({id(im.message.dst) for im in first}) == 1
    for im in first + again:
        assert not gc.is_tracked(im)
        assert not gc.is_tracked(im.message)
        assert not gc.is_tracked(im.message.key)
        assert not gc.is_tracked(im.message.src)
    del again
    gc.collect()  # the untracked values are freed by reference counting alone
    assert first[0].message.src == src


@pytest.mark.parametrize("length", [0, 1, 9, 65])
@pytest.mark.parametrize("for_this_shard", [True, False])
def test_a_short_value_is_corrupt_in_both_fills(length: int, for_this_shard: bool) -> None:
    """A value shorter than its 66-byte header raises in both paths, whether its row is
    for the iterated shard or would be skipped (it is never counted as a skip)."""
    good = _rows([Message(QueueKey(1, b"\x01" * 32), *(Address(0, b"\x02" * 32),) * 2)], 0)[0]
    bad_key = codec.message_key(0, SHARD, QueueKey(2, b"\x03" * 32))
    bad_value = (b"\x80" if for_this_shard else b"\x7f") + b"\x00" * 80
    bad = (bad_key, bad_value[:length])
    for fill in (_c_merge_fill, iterator._py_merge_fill):
        assert _bad_key(lambda fill=fill: _merge_all([[good, bad]], 10, fill=fill)) == bad_key


# -- the whole iterator: compiled and pure-Python paths agree ----------------------------------

_SOURCES = [ShardIdent(0, 0x2000_0000_0000_0000 + (i << 62)) for i in range(4)]
_FOR_SHARDS = [
    ShardIdent.BASECHAIN,
    ShardIdent(0, 0x6000_0000_0000_0000),
    ShardIdent(0, 0x5000_0000_0000_0000),
    ShardIdent.MASTERCHAIN,
    ShardIdent(7, 0x8000_0000_0000_0000),  # no stored destination lives there
    ShardIdent(1000, 0x8000_0000_0000_0000),  # no std address lives in workchain 1000
]


def _account(prefix: int, salt: int) -> bytes:
    return ((prefix & 0xFF) << 56 | salt).to_bytes(8, "big") + bytes([salt % 251]) * 24


def _source_address(shard: ShardIdent, salt: int) -> Address:
    return Address(0, ((shard.prefix & ~(0xF << 56)) | (salt & 0xFF)).to_bytes(8, "big") * 4)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(  # per diff: source shard, first lt step, messages as (dst wc, dst prefix, salt)
        st.tuples(
            st.integers(0, 3),
            st.integers(1, 5),
            st.lists(
                st.tuples(
                    st.sampled_from([0, 0, 0, -1, 7]), st.integers(0, 255), st.integers(0, 5)
                ),
                min_size=1,
                max_size=40,
            ),
        ),
        min_size=1,
        max_size=8,
    ),
    st.sampled_from(_FOR_SHARDS),
    st.integers(1, 9),
    st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
)
def test_the_iterator_is_the_same_on_both_paths(
    diffs: list[tuple[int, int, list[tuple[int, int, int]]]],
    for_shard: ShardIdent,
    run: int,
    picked: list[int],
) -> None:
    """Random diffs of up to four source shards with overlapping lt spans (so runs end at
    other shards' keys, at the run limit and at skipped rows): the compiled and the
    pure-Python iterator yield equal messages of the same types, and agree on
    ``current_position()`` after every message and at the end."""
    db = MemoryDatabase()
    queue = db.open()
    seqnos = [0] * 4
    lt = 10
    try:
        for n, (source, step, picks) in enumerate(diffs):
            shard = _SOURCES[source]
            msgs = []
            for i, (wc, prefix, salt) in enumerate(picks):
                lt += step if i == 0 else 1 + salt % 2
                dst = Address(wc, _account(prefix, salt))
                msgs.append(
                    Message(
                        QueueKey(lt, bytes([n, i]) * 16),
                        _source_address(shard, salt),
                        dst,
                        bytes(salt),
                    )
                )
            seqnos[source] += 1
            assert queue.apply_diff(
                QueueDiff(msgs), BlockIdShort(shard, seqnos[source]), bytes([n + 1]) * 32
            )
            lt -= len(picks)  # the next diff's span overlaps this one
        ranges = [QueueShardRange(_SOURCES[i], QueueKey.MIN, QueueKey.MAX) for i in picked]
        outputs = []
        saved = iterator._RUN
        iterator._RUN = run
        try:
            for pure in (False, True):
                with iterator.pure_python() if pure else contextlib.nullcontext():
                    steps = []
                    with queue.iterator(0, ranges, for_shard) as it:
                        for item in it:
                            steps.append((item, it.current_position()))
                        steps.append((None, it.current_position()))
                    outputs.append(steps)
        finally:
            iterator._RUN = saved
        assert outputs[0] == outputs[1]
        for item, _ in outputs[0][:-1]:
            assert item is not None
            assert type(item) is IteratedMessage and type(item.message) is Message
            assert type(item.message.key) is QueueKey
            assert type(item.message.src) is type(item.message.dst) is Address
            assert for_shard.contains(item.message.dst)
        keys = [item.message.key for item, _ in outputs[0][:-1] if item is not None]
        assert keys == sorted(keys)
    finally:
        queue.close()


# -- value_new: the value types, built out of the cyclic GC's way ------------------------------


def test_value_new_builds_the_value_untracked_when_it_can_never_be_in_a_cycle() -> None:
    value_new = iterator._speedups_module.value_new
    key = value_new(QueueKey, (5, b"\x01" * 32))
    address = value_new(Address, (0, b"\x02" * 32))
    message = value_new(Message, (key, address, address, b"body"))
    for value, cls, fields in [
        (key, QueueKey, (5, b"\x01" * 32)),
        (address, Address, (0, b"\x02" * 32)),
        (message, Message, (key, address, address, b"body")),
    ]:
        assert type(value) is cls
        assert value == tuple.__new__(cls, fields)
        assert hash(value) == hash(tuple.__new__(cls, fields))
        assert not gc.is_tracked(value)
    # a field the GC tracks (so the value could close a cycle): built by tuple.__new__
    held = value_new(Message, (key, address, address, [1]))
    assert gc.is_tracked(held) and held[3] == [1]

    # a layout with room for attributes: tuple.__new__ too
    class Loose(tuple):  # type: ignore[type-arg]
        pass

    loose = value_new(Loose, (1, 2))
    assert type(loose) is Loose and loose == (1, 2) and gc.is_tracked(loose)
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection before the one below
    try:
        loose.cycle = loose  # type: ignore[attr-defined]
        del loose
        assert gc.collect() >= 1  # the cycle is collected: the value stayed tracked
    finally:
        if enabled:
            gc.enable()
    with pytest.raises(TypeError):
        value_new(list, (1,))
    with pytest.raises(TypeError):
        value_new(QueueKey, [5, b"\x01" * 32])
    with pytest.raises(TypeError):
        value_new(QueueKey)


def test_the_value_types_constructors_leave_their_values_untracked() -> None:
    """What a host builds and keeps (a collator's outgoing messages) is never walked by
    the cyclic GC: the constructors go through value_new when the C extension is built."""
    key = QueueKey(7, b"\x03" * 32)
    address = Address(-1, b"\x04" * 32)
    values = [
        key,
        key.next_value(),
        address,
        ShardIdent(0, 0x4000_0000_0000_0000),
        Message(key, address, address, b"x"),
        QueueKey.parse(str(key)),
    ]
    assert not any(gc.is_tracked(v) for v in values)


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 16])
def test_equal_keys_of_two_sources_come_in_range_order_on_both_paths(limit: int) -> None:
    """Two sources holding rows of one queue key: the merge has no key to order them by,
    so it takes the first range's row first (as the pure-Python twin's stable sort does),
    whatever the batch limit, and both fills yield the same sequence."""
    other = ShardIdent(0, 0xC000_0000_0000_0000)
    dst = Address(0, b"\x00" * 32)
    msgs = [Message(QueueKey(lt, bytes([lt]) * 32), ADDR2[0], dst, b"") for lt in (5, 6, 7)]
    rows = _rows(msgs, 0)
    want = [(shard, m.key) for m in msgs for shard in (SHARD, other)]
    for fill in (_c_merge_fill, iterator._py_merge_fill):
        batches, *_ = _merge_all([rows, rows], limit, 128, shards=[SHARD, other], fill=fill)
        got = [(im[0], im.message.key) for b in batches for im in b]
        assert got == want, (fill, limit)


def test_the_stub_matches_the_compiled_module(tmp_path: Any) -> None:
    """``imq/_speedups.pyi`` (what mypy reads of the extension) names every function the
    module has, with the arguments it takes (an outside audit found three functions
    missing and the two classes' constructors stubbed on ``__init__``)."""
    config = tmp_path / "mypy.ini"
    # msgpack ships no stubs; a cache of its own, apart from the repository's, which
    # `make typecheck` keeps with other options (--strict)
    config.write_text(
        f"[mypy]\nignore_missing_imports = True\ncache_dir = {tmp_path / 'mypy-cache'}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", str(config), "imq._speedups"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_guard_hands_out_busy_where_the_generator_runs_elsewhere() -> None:
    """``Guard(gen, busy)``: gen's items, and ``busy`` for a pull made while gen runs
    (here from inside gen itself, as a second thread's would be); a ValueError of gen's
    own, and gen's end, pass on as they are."""
    module = iterator._speedups_module
    busy = iter(())
    seen: list[object] = []
    holder: list[Any] = []

    def gen() -> Iterator[int]:
        yield 1
        seen.append(next(holder[0]))  # a pull of the running generator
        yield 2
        raise ValueError("gen's own")

    guard = module.Guard(gen(), busy)
    holder.append(guard)
    assert iter(guard) is guard and next(guard) == 1 and next(guard) == 2
    assert seen == [busy]
    with pytest.raises(ValueError, match="gen's own"):
        next(guard)
    with pytest.raises(StopIteration):
        next(guard)
    ended = module.Guard(iter([7]), busy)
    assert list(ended) == [7]
    with pytest.raises(TypeError, match="two iterators"):
        module.Guard([1], busy)


_HOSTILE_PRELUDE = """
import gc, sys
import imq.iterator  # registers the value types with the extension
from imq import _speedups as S
from imq.types import ShardIdent
SHARD = ShardIdent(0, 1 << 63)
def key(lt):
    shard = (2**31).to_bytes(4, "big") + (1 << 63).to_bytes(8, "big")
    return bytes(2) + shard + lt.to_bytes(8, "big") + lt.to_bytes(32, "big")
def value():
    return bytes([128]) + bytes(8) + b"\\x11" * 24 + bytes([128]) + b"\\x22" * 32 + b"x" * 200
"""


def _run_hostile(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _HOSTILE_PRELUDE + code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    return done.stdout


@pytest.mark.parametrize("shrunk", ["sources", "heads", "shards"])
def test_merge_fill_reads_its_numbers_before_its_lists(shrunk: str) -> None:
    """An argument's ``__index__`` is Python code: it ran after the lists' lengths were
    read and could shrink them, and the fill then read past their ends (an audit under
    AddressSanitizer; the plain build crashed for ``sources`` and ``shards``)."""
    out = _run_hostile(
        f"""
n = 8
lists = dict(sources=[iter([(key(i), value())]) for i in range(n)], heads=[None] * n,
             shards=[SHARD] * n)
class Shrinks:
    def __index__(self):
        del lists[{shrunk!r}][1:]
        gc.collect()
        return 128
try:
    S.merge_fill(lists["sources"], lists["heads"], [None] * n, list(range(n)), 16,
                 Shrinks(), 0, 0, lists["shards"], [None] * n)
    print("returned")
except ValueError as exc:
    print("ValueError", exc)
"""
    )
    assert out == "ValueError merge_fill() lists differ in length\n"


@pytest.mark.parametrize("change", ["clear", "shrink", "replace"])
def test_decode_run_owns_each_row_while_a_finalizer_changes_the_lists(change: str) -> None:
    """``decode_run`` allocates per row, an allocation can run the cyclic GC, and a
    finalizer there could change the caller's lists while the decode borrowed their
    rows (an audit under AddressSanitizer: the plain build crashed). It raises now, or
    decodes the rows it holds."""
    out = _run_hostile(
        f"""
class Bomb:
    def __init__(self, keys, values):
        self.me = self  # a cycle: only a collection frees it
        self.lists = (keys, values)
    def __del__(self):
        keys, values = self.lists
        if {change!r} == "clear":
            keys.clear(); values.clear()
        elif {change!r} == "replace":
            keys[:] = [b""] * len(keys); values[:] = [b""] * len(values)
        else:
            del keys[2:]; del values[2:]
outcomes = set()
for threshold in range(3, 40):
    keys = [key(i) for i in range(64)]
    values = [value() for _ in range(64)]
    gc.collect(); gc.disable()
    Bomb(keys, values)
    gc.set_threshold(threshold); gc.enable()
    try:
        outcomes.add(len(S.decode_run(keys, values, SHARD)))
    except (RuntimeError, ValueError) as exc:
        outcomes.add(type(exc).__name__)
    gc.set_threshold(700); gc.collect()
print(sorted(map(str, outcomes)))
"""
    )
    outcomes = set(ast.literal_eval(out))  # the child printed a list of strings
    errors = {o for o in outcomes if not o.isdigit()}  # the rest: rows decoded
    # struck inside the decode at some threshold (before it, the lists were short already)
    assert errors == {"ValueError" if change == "replace" else "RuntimeError"}, out
