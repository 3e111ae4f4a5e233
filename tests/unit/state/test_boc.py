"""BOCs (imq.state.boc), checked against the real tycho chunk and against
pytoniq-core as an independent implementation."""

from __future__ import annotations

import contextlib
import functools
import struct
import tracemalloc
from pathlib import Path
from typing import NoReturn

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pytoniq_core import Cell as PCell
from pytoniq_core.crypto.crc import crc32c as p_crc32c
from pytoniq_oracle import to_pytoniq
from tycho_data import TYCHO

from imq.state import boc as boc_module
from imq.state.boc import (
    MAGIC,
    BocError,
    Cell,
    RootView,
    boc_cell_size,
    crc32c,
    decode_boc,
    encode_boc,
    join_roots,
    root_data,
    split_roots,
)
from imq.state.message import build_internal_message
from imq.types import Address

BLOCKS = [
    TYCHO / "first_block" / "first_block.bin",
    *sorted((TYCHO / "dump" / "blocks").glob("*.block")),
    *sorted((TYCHO / "dump_one_shard" / "blocks").glob("*.block")),
]


@functools.cache
def real_state() -> tuple[list[list[bytes]], list[bytes]]:
    """The message hash lists of the diffs and the chunks of ``shard.bin`` (FORMAT.md §3),
    read with a minimal TL walk of its own."""
    data = (TYCHO / "persistent_state" / "shard.bin").read_bytes()
    u32 = functools.partial(struct.unpack_from, "<I", data)
    at = 4 + 4 + 12 + 4
    (n_diffs,) = u32(at)
    at += 4
    hash_lists = []
    for _ in range(n_diffs):
        at += 4 + 32 + 12 + 4
        (n_processed,) = u32(at)
        at += 4 + 52 * n_processed + 40 + 40
        (n_messages,) = u32(at)
        at += 4
        hash_lists.append([data[at + 32 * i : at + 32 * i + 32] for i in range(n_messages)])
        at += 32 * n_messages
        for _router in range(2):
            (n_partitions,) = u32(at)
            at += 4
            for _ in range(n_partitions):
                (n_accounts,) = u32(at + 4)
                at += 8 + 36 * n_accounts
    (n_chunks,) = u32(at)
    at += 4
    chunks = []
    for _ in range(n_chunks):
        (size,) = u32(at)
        chunks.append(data[at + 4 : at + 4 + size])
        at += 4 + size + (-size % 4)
    assert at == len(data)
    return hash_lists, chunks


def real_chunk() -> bytes:
    return real_state()[1][0]


def leaf(value: int, bits: int, *refs: Cell) -> Cell:
    return Cell((value << (-bits % 8)).to_bytes((bits + 7) // 8), bits, refs)


def boc_fields(boc: bytes) -> tuple[int, int, int, int, int, list[tuple[int, int]]]:
    """(ref size, offset size, roots, root-list offset, cells offset, cell spans) of a
    flag-free BOC, parsed independently of the module under test."""
    s, o = boc[4] & 7, boc[5]
    cells = int.from_bytes(boc[6 : 6 + s])
    roots = int.from_bytes(boc[6 + s : 6 + 2 * s])
    roots_at = 6 + 3 * s + o
    p = cells_at = roots_at + roots * s
    spans = []
    for _ in range(cells):
        d1, d2 = boc[p], boc[p + 1]
        q = p + 2 + (d2 + 1) // 2 + (d1 & 7) * s
        spans.append((p, q))
        p = q
    return s, o, roots, roots_at, cells_at, spans


def with_extras(
    boc: bytes, *, index: bool = False, crc: bool = False, cache: bool = False
) -> bytes:
    """The same BOC with an index (cumulative end offsets, shifted with cache bits) and/or
    a CRC32C, as the TON reference encoder writes them."""
    s, o, _roots, roots_at, cells_at, spans = boc_fields(boc)
    flags = boc[4] | (0x80 if index else 0) | (0x40 if crc else 0) | (0x20 if cache else 0)
    total = spans[-1][1] - cells_at
    entries = [((end - cells_at) << 1 | 1) if cache else end - cells_at for _, end in spans]
    o2 = max(o, (max(entries).bit_length() + 7) // 8) if index else o
    out = bytearray(MAGIC + bytes((flags, o2)) + boc[6 : 6 + 3 * s] + total.to_bytes(o2))
    out += boc[roots_at:cells_at]
    if index:
        out += b"".join(entry.to_bytes(o2) for entry in entries)
    out += boc[cells_at:]
    if crc:
        out += crc32c(bytes(out)).to_bytes(4, "little")
    return bytes(out)


def small_boc() -> bytes:
    """root(8 bits, refs [a, b]); a: 4 bits; b: 16 bits -> cells root=0, b=1, a=2."""
    a = leaf(0b1010, 4)
    b = leaf(0xBEEF, 16)
    return encode_boc([leaf(0xAB, 8, a, b)])


def expect_split(check: str, data: bytes, **kwargs: int) -> BocError:
    with pytest.raises(BocError) as info:
        split_roots(data, **kwargs)
    assert info.value.check == check, info.value
    return info.value


def expect(check: str, data: bytes, **kwargs: int) -> BocError:
    with pytest.raises(BocError) as info:
        decode_boc(data, **kwargs)
    assert info.value.check == check, info.value
    expect_split(check, data, **kwargs)
    return info.value


# ---------------------------------------------------------------------------------------------
# strategies


@st.composite
def forests(draw: st.DrawFn, max_roots: int = 6) -> list[Cell]:
    """Roots drawn from a random DAG of depth <= 4 (cells share subtrees)."""
    pool: list[Cell] = []
    for _level in range(draw(st.integers(1, 5))):
        new = []
        for _ in range(draw(st.integers(1, 3))):
            bits = draw(st.one_of(st.integers(0, 24), st.integers(0, 1023)))
            value = draw(st.integers(0, (1 << bits) - 1))
            n_refs = draw(st.integers(0, min(4, len(pool))))
            refs = [draw(st.sampled_from(pool)) for _ in range(n_refs)]
            new.append(leaf(value, bits, *refs))
        pool += new
    return draw(st.lists(st.sampled_from(pool), min_size=1, max_size=max_roots))


# ---------------------------------------------------------------------------------------------
# the real chunk


def test_real_chunk_roots_are_the_listed_messages() -> None:
    hash_lists, chunks = real_state()
    assert [len(h) for h in hash_lists] == [4300, 0, 0] and len(chunks) == 1
    views = split_roots(chunks[0])
    assert len(views) == 4300
    assert [v.hash for v in views] == hash_lists[0]
    assert all(type(v) is RootView for v in views)


def test_real_chunk_agrees_with_pytoniq() -> None:
    chunk = real_chunk()
    theirs = PCell.from_boc(chunk)
    views = split_roots(chunk)
    ours = decode_boc(chunk)
    assert [v.hash for v in views] == [c.hash for c in theirs] == [c.hash for c in ours]
    for view, their, our in zip(views, theirs, ours, strict=True):
        assert view.bits == len(their.bits) == our.bits
        assert view.data == their.data == our.data
        assert our.depth == their.get_depth() == 0
        assert PCell.one_from_boc(view.boc).hash == view.hash


def test_real_chunk_is_reproduced_byte_for_byte() -> None:
    chunk = real_chunk()
    assert chunk[:6] == MAGIC + b"\x02\x03"
    assert join_roots([v.boc for v in split_roots(chunk)]) == chunk
    hashes: list[bytes] = []
    assert join_roots([v.boc for v in split_roots(chunk)], hashes) == chunk
    assert hashes == real_state()[0][0]  # the leaf path's root hashes: the diff's list
    assert encode_boc(decode_boc(chunk)) == chunk
    assert split_roots(memoryview(chunk)) == split_roots(chunk)


def test_real_chunk_root_list_is_descending() -> None:
    s, _o, roots, roots_at, _cells_at, _spans = boc_fields(real_chunk())
    chunk = real_chunk()
    indices = [int.from_bytes(chunk[roots_at + s * i : roots_at + s * (i + 1)]) for i in range(5)]
    assert roots == 4300 and indices == [4299, 4298, 4297, 4296, 4295]


def test_real_leaf_boc_and_size() -> None:
    view = split_roots(real_chunk())[0]
    cell = decode_boc(view.boc)[0]
    assert encode_boc([cell]) == view.boc
    assert (
        view.boc
        == MAGIC + bytes((1, 1, 1, 1, 0, len(view.data) + 2, 0)) + cell.descriptor + view.data
    )
    assert boc_cell_size(view.boc) == 2 + len(view.data) + 4


# ---------------------------------------------------------------------------------------------
# encode / decode


def test_encode_layout_is_tycho_order() -> None:
    boc = small_boc()
    s, o, roots, _roots_at, cells_at, spans = boc_fields(boc)
    assert (boc[4], s, o, roots, len(spans)) == (1, 1, 1, 1, 3)
    root, b, a = (boc[p:q] for p, q in spans)
    assert root == b"\x02\x02\xab\x02\x01" and b == b"\x00\x04\xbe\xef" and a == b"\x00\x01\xa8"
    assert boc[cells_at - 1] == 0


@given(forests())
def test_encode_decode_round_trip_against_pytoniq(roots: list[Cell]) -> None:
    boc = encode_boc(roots)
    decoded = decode_boc(boc)
    assert [c.hash for c in decoded] == [c.hash for c in roots]
    assert [c.depth for c in decoded] == [c.depth for c in roots]
    memo: dict[bytes, PCell] = {}
    theirs = [to_pytoniq(r, memo) for r in roots]
    assert [t.hash for t in theirs] == [r.hash for r in roots]
    assert [t.get_depth() for t in theirs] == [r.depth for r in roots]
    assert [c.hash for c in PCell.from_boc(boc)] == [r.hash for r in roots]
    assert decode_boc(theirs[0].to_boc())[0].hash == roots[0].hash
    assert encode_boc(decoded) == boc


@given(forests(max_roots=3), st.booleans(), st.booleans(), st.booleans())
def test_index_crc_and_cache_bits_are_accepted(
    roots: list[Cell], index: bool, crc: bool, cache: bool
) -> None:
    boc = with_extras(encode_boc(roots), index=index or cache, crc=crc, cache=cache)
    assert [c.hash for c in decode_boc(boc)] == [r.hash for r in roots]
    assert [v.hash for v in split_roots(boc)] == [r.hash for r in roots]


def test_crc32c_matches_the_reference() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    data = bytes(range(256)) * 3
    assert crc32c(data).to_bytes(4, "little") == p_crc32c(data)


def test_encode_needs_roots() -> None:
    with pytest.raises(ValueError):
        encode_boc([])
    with pytest.raises(TypeError):
        encode_boc([b"x"])  # type: ignore[list-item]


# ---------------------------------------------------------------------------------------------
# split / join


def _messages() -> list[Cell]:
    a = Address(0, bytes(range(32)))
    b = Address(-1, b"\xee" * 32)
    shared = b"shared body " * 20
    return [
        build_internal_message(a, b, 10, body=b"inline"),
        build_internal_message(a, b, 11, body=shared),  # a 2-cell chain
        build_internal_message(b, a, 12, body=shared),  # shares the chain with the previous
        build_internal_message(a, a, 13, body=b"x" * 1500, extra_cells=3),
        build_internal_message(a, b, 14, body_in_ref=True),
        build_internal_message(a, b, 10, body=b"inline"),  # a duplicate root
    ]


def test_multi_cell_messages_split_and_join() -> None:
    messages = _messages()
    assert [m.depth for m in messages] == [0, 2, 2, 15, 1, 0]
    bocs = [encode_boc([m]) for m in messages]
    joined = join_roots(bocs)
    views = split_roots(joined)
    assert [v.hash for v in views] == [m.hash for m in messages]
    hashes: list[bytes] = [b"kept"]
    assert join_roots(bocs, hashes) == joined
    assert hashes == [b"kept"] + [m.hash for m in messages]  # appended, duplicates too
    assert [(v.data, v.bits) for v in views] == [(m.data, m.bits) for m in messages]
    assert [v.boc for v in views] == bocs
    assert join_roots([v.boc for v in views]) == joined
    assert [c.hash for c in PCell.from_boc(joined)] == [m.hash for m in messages]
    # the shared chain and the duplicate root are stored once
    distinct = {c.hash for m in messages for c in m.iter_tree()}
    assert len(boc_fields(joined)[5]) == len(distinct)
    assert len(joined) < sum(len(b) for b in bocs)
    assert encode_boc(messages) == joined


@given(forests(max_roots=8))
def test_join_split_round_trip(roots: list[Cell]) -> None:
    bocs = [encode_boc([r]) for r in roots]
    joined = join_roots(bocs)
    assert joined == encode_boc(roots)
    hashes: list[bytes] = []
    assert join_roots(bocs, hashes) == joined
    assert hashes == [r.hash for r in roots]
    views = split_roots(joined)
    assert [v.hash for v in views] == [r.hash for r in roots]
    assert [v.bits for v in views] == [r.bits for r in roots]
    assert [v.boc for v in views] == bocs
    assert join_roots([v.boc for v in views]) == joined
    assert [decode_boc(v.boc)[0].depth for v in views] == [r.depth for r in roots]
    header_max = 4 + 2 + 4 * 3 + 8 + 4 * len(roots)
    assert len(joined) <= header_max + sum(boc_cell_size(b) for b in bocs)


def test_join_accepts_non_canonical_one_root_bocs() -> None:
    cell = leaf(0x1234, 16)
    plain = encode_boc([cell])
    fancy = with_extras(plain, index=True, crc=True)
    assert join_roots([fancy, plain]) == join_roots([plain, plain])
    assert boc_cell_size(fancy) == boc_cell_size(plain) == 4 + 4


def test_join_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        join_roots([])
    two = encode_boc([leaf(1, 8), leaf(2, 8)])
    with pytest.raises(BocError) as info:
        join_roots([encode_boc([leaf(1, 8)]), two])
    assert info.value.check == "root count" and "#1" in str(info.value)
    with pytest.raises(BocError):
        join_roots([b"\xb5\xee"])


def test_split_respects_max_roots() -> None:
    boc = encode_boc([leaf(i, 8) for i in range(5)])
    assert len(split_roots(boc, max_roots=5)) == 5
    expect("root count", boc, max_roots=4)


# ---------------------------------------------------------------------------------------------
# malformed BOCs


@pytest.mark.parametrize("extras", [{}, {"index": True, "crc": True}])
def test_every_truncation_is_reported(extras: dict[str, bool]) -> None:
    boc = with_extras(small_boc(), **extras)
    decode_boc(boc)
    for cut in range(len(boc)):
        err = expect("truncated", boc[:cut])
        assert err.offset == cut


def test_header_checks() -> None:
    boc = bytearray(small_boc())
    assert expect("magic", b"\xb5\xee\x9c\x73" + boc[4:]).offset == 0
    assert "legacy" in str(expect("magic", b"\x68\xff\x65\xf3" + boc[4:]))
    expect("magic", b"\xac\xc3\xa7\x28" + boc[4:])
    for flags in (0x09, 0x11, 0x00, 0x05, 0x21):  # reserved bits, ref size 0/5, cache w/o index
        expect("flags", bytes(boc[:4]) + bytes((flags,)) + bytes(boc[5:]))
    for off_size in (0, 9):
        expect("header", bytes(boc[:5]) + bytes((off_size,)) + bytes(boc[6:]))


@pytest.mark.parametrize(
    ("position", "value", "check"),
    [
        (6, 0, "cell count"),  # cells
        (7, 0, "root count"),  # roots
        (8, 1, "absent"),
        (9, 5, "cells size"),  # total < 2 per cell
        (10, 3, "root index"),
        (14, 0, "ref order"),  # the root refs itself
        (15, 0, "ref order"),
        (14, 3, "ref range"),
        (11, 0x07, "cell refs"),  # absent-cell descriptor
        (11, 0x05, "cell refs"),
        (11, 0x12, "stored hashes"),
        (11, 0x22, "cell level"),
        (11, 0x0A, "exotic cell"),  # an 8-bit exotic cell
        (22, 0x80, "completion tag"),  # a's tagged byte without data bits
        (22, 0x00, "completion tag"),
    ],
)
def test_field_checks(position: int, value: int, check: str) -> None:
    boc = bytearray(small_boc())
    assert boc[11:16] == b"\x02\x02\xab\x02\x01" and boc[17] == 4 and boc[22] == 0xA8
    boc[position] = value
    err = expect(check, bytes(boc))
    if check in ("ref order", "ref range", "completion tag", "root index"):
        assert err.offset == position
    assert str(err).startswith(f"malformed BOC at byte {err.offset}: {check}")


def test_a_cell_no_root_leads_to_is_refused() -> None:
    """Refs point only forwards, so a cell that is no root and no earlier cell refers to
    is garbage: refused where it starts, before the cells after it are read."""
    boc = bytearray(small_boc())
    assert boc[6:10] == b"\x03\x01\x00\x0c" and boc[14:16] == b"\x02\x01"
    boc[15] = 2  # the root's second ref: cell 2 again, so cell 1 hangs from nothing
    err = expect("unreachable", bytes(boc))
    assert err.offset == 16 and "cell 1 " in str(err)
    # junk cells declared in the header and appended: the first of them is refused
    junk = 100
    padded = bytearray(small_boc()) + b"\x00\x00" * junk
    padded[6], padded[9] = 3 + junk, 12 + 2 * junk
    err = expect("unreachable", bytes(padded))
    assert "cell 3 " in str(err) and err.offset == len(small_boc())
    # a root after a cell that nothing before it refers to
    two = encode_boc([leaf(1, 8), leaf(2, 8)])
    assert two[7] == 2 and two[10:12] == b"\x01\x00"
    one_root = two[:7] + b"\x01" + two[8:10] + two[10:11] + two[12:]  # names cell 1 only
    assert expect("unreachable", one_root).offset == 11


@pytest.mark.parametrize("d2", [6, 2, 1])
def test_data_length_disagreeing_with_d2(d2: int) -> None:
    boc = bytearray(encode_boc([leaf(0xBEEF, 16)]))
    assert boc[11:] == b"\x00\x04\xbe\xef"
    boc[12] = d2  # 6: 3 data bytes, past the total size; 2 or 1: one byte, ending early
    err = expect("cells size", bytes(boc))
    assert err.offset == (11 if d2 == 6 else 14)


def test_trailing_bytes_crc_and_index() -> None:
    boc = small_boc()
    assert expect("trailing bytes", boc + b"\x00").offset == len(boc)
    with_crc = bytearray(with_extras(boc, crc=True))
    with_crc[-1] ^= 1
    assert expect("crc32c", bytes(with_crc)).offset == len(boc)
    with_crc = bytearray(with_extras(boc, crc=True))
    with_crc[12] ^= 1
    expect("crc32c", bytes(with_crc))
    indexed = bytearray(with_extras(boc, index=True))
    indexed[11] += 1
    expect("index", bytes(indexed))
    cached = bytearray(with_extras(boc, index=True, cache=True))
    cached[11] += 2
    expect("index", bytes(cached))


def chain_boc(n: int) -> bytes:
    """One root over a chain of ``n`` cells: depth ``n - 1``."""
    body = b"".join(b"\x01\x00" + (i + 1).to_bytes(2) for i in range(n - 1)) + b"\x00\x00"
    header = MAGIC + b"\x02\x02" + n.to_bytes(2) + b"\x00\x01\x00\x00" + len(body).to_bytes(2)
    return header + b"\x00\x00" + body


def not_built(*_args: object) -> NoReturn:
    raise AssertionError("a cell object was built")


def test_boc_deeper_than_the_limit_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused by the scan, before any cell object exists (a chain of millions of cells
    fits in a few KB of zstd); at the limit, decoded."""
    with monkeypatch.context() as patched:
        patched.setattr(boc_module, "_cell_at", not_built)
        err = expect("cell depth", chain_boc(1026))
    assert "cell 0: cell depth 1025 exceeds 1024" in str(err)
    (root,) = decode_boc(chain_boc(1025))
    assert root.depth == 1024
    assert [v.hash for v in split_roots(chain_boc(1025))] == [root.hash]


def wide_tree_boc(n: int) -> bytes:
    """One root over ``n`` empty cells, cell i referring to cells 4i+1..4i+4: every cell
    reachable, the depth small (what a forged chunk can hide under one message)."""
    parts = []
    for i in range(n):
        refs = range(4 * i + 1, min(4 * i + 5, n))
        parts.append(bytes((len(refs), 0)) + b"".join(r.to_bytes(3) for r in refs))
    body = b"".join(parts)
    return (
        MAGIC
        + b"\x03\x04"
        + n.to_bytes(3)
        + b"\x00\x00\x01"
        + bytes(3)
        + len(body).to_bytes(4)
        + bytes(3)
        + body
    )


def test_a_forged_tree_costs_a_compact_table_not_a_cell_object_each() -> None:
    """The memory a chunk's cells cost before ``expect`` can refuse their root's hash:
    a few tens of bytes a cell (the table, the heights, 32 bytes of hash), where cell
    objects took about 500."""
    n = 20_000
    data = wide_tree_boc(n)
    (root,) = decode_boc(data)  # a valid tree; its hash is what expect is shown

    class RefusedError(Exception):
        pass

    def refuse(hashes: list[bytes]) -> None:
        assert hashes == [root.hash]
        raise RefusedError

    tracemalloc.start()
    try:
        with pytest.raises(RefusedError):
            split_roots(data, expect=refuse)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * n, f"{peak / n:.0f} bytes a cell"


@pytest.mark.parametrize("path", BLOCKS, ids=lambda p: p.name[:24])
def test_a_cells_height_is_its_depth_at_every_level(path: Path) -> None:
    """The scan's heights (what the depth limit is checked on) are the cells' depths, in
    real blocks' Merkle updates over pruned branches too."""
    layout = boc_module._parse(path.read_bytes(), None, None)
    built = boc_module._build_cells(layout, layout.roots)
    assert layout.heights is not None and len(built) == len(layout.starts) - 1
    assert {c.level_mask for c in built.values()} == {0, 1}
    assert [layout.heights[i] for i in sorted(built)] == [built[i].depth for i in sorted(built)]


def _fields(cell: Cell) -> tuple[object, ...]:
    levels = range(4)
    return (
        cell.data,
        cell.bits,
        cell.exotic,
        cell.level_mask,
        cell.descriptor,
        [cell.get_hash(i) for i in levels],
        [cell.get_depth(i) for i in levels],
        [r.hash for r in cell.refs],
    )


@given(forests())
def test_expect_gets_the_root_hashes_before_any_cell_is_built(roots: list[Cell]) -> None:
    boc = encode_boc(roots)
    seen: list[list[bytes]] = []

    class RefusedError(Exception):
        pass

    def refuse(hashes: list[bytes]) -> None:
        seen.append(hashes)
        raise RefusedError

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(boc_module, "_cell_at", not_built)
        with pytest.raises(RefusedError):
            split_roots(boc, expect=refuse)
    assert seen == [[r.hash for r in roots]]
    views = split_roots(boc, expect=seen.append)
    assert views == split_roots(boc)
    assert seen[1] == seen[0]
    # the cells built from the table's hashes are the cells a plain decode builds
    for view, root in zip(views, roots, strict=True):
        for mine, theirs in zip(
            (c for child in view.children for c in child.iter_tree()),
            (c for child in root.refs for c in child.iter_tree()),
            strict=True,
        ):
            assert _fields(mine) == _fields(theirs)
    layout = boc_module._parse(boc, None, None)
    depths = {c.hash: c.depth for root in roots for c in root.iter_tree()}
    if layout.heights is not None:
        pairs = zip(layout.roots, seen[0], strict=True)
        assert all(layout.heights[r] == depths[h] for r, h in pairs)


def test_max_cells() -> None:
    boc = small_boc()
    assert len(decode_boc(boc, max_cells=3)) == 1
    with pytest.raises(BocError) as info:
        decode_boc(boc, max_cells=2)
    assert info.value.check == "cell count"


def _pruned_boc(d1: int) -> bytes:
    """A one-cell BOC of a pruned branch (level mask 1) with descriptor byte ``d1``."""
    pruned = b"\x01\x01" + bytes(32) + b"\x00\x00"
    cell = bytes((d1, 2 * len(pruned))) + pruned
    return MAGIC + b"\x01\x01\x01\x01\x00" + bytes((len(cell),)) + b"\x00" + cell


def test_cells_of_any_level_decode_but_chunk_roots_are_level_0() -> None:
    boc = _pruned_boc(0x28)
    (pruned,) = decode_boc(boc)
    assert pruned.level_mask == 1 and pruned.get_hash(0) == bytes(32)
    assert encode_boc([pruned]) == boc
    assert expect_split("root level", boc).offset == 11
    with pytest.raises(BocError) as info:
        join_roots([encode_boc([leaf(1, 8)]), boc])
    assert info.value.check == "root level" and "#1" in str(info.value)
    assert expect("cell level", _pruned_boc(0x08)).offset == 11  # d1 says level 0
    expect("cell level", _pruned_boc(0x48))  # d1 says mask 2, the data 1
    # a level-0 root over level-1 cells (a Merkle proof of a pruned tree) is a valid root
    tree = leaf(1, 8, pruned)
    proof = Cell(b"\x03" + tree.get_hash(0) + b"\x00\x01", 280, [tree], exotic=True)
    seen: list[list[bytes]] = []  # a level-1 cell: the hashes come from built cells
    views = split_roots(join_roots([encode_boc([proof])]), expect=seen.append)
    assert [v.hash for v in views] == [proof.hash] and proof.level_mask == 0
    assert seen == [[proof.hash]]


def test_exotic_cells_of_level_0_are_hashed_from_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library cell, and a Merkle proof of a whole (level-0) tree: level-0 exotic
    cells hash as ordinary ones do, so ``expect`` sees them before any cell is built;
    an invalid one is refused by the build that follows an accepted hash."""
    library = Cell(b"\x02" + bytes(range(32)), 264, exotic=True)
    tree = leaf(1, 8, leaf(2, 8), library)
    proof = Cell(b"\x03" + tree.get_hash(0) + tree.depth.to_bytes(2), 280, [tree], exotic=True)
    assert (library.level_mask, proof.level_mask, tree.level_mask) == (0, 0, 0)
    chunk = join_roots([encode_boc([proof]), encode_boc([library])])
    seen: list[list[bytes]] = []
    with monkeypatch.context() as patched:
        patched.setattr(boc_module, "_cell_at", not_built)
        with pytest.raises(AssertionError, match="a cell object was built"):
            split_roots(chunk, expect=seen.append)
    assert seen == [[proof.hash, library.hash]]
    views = split_roots(chunk, expect=seen.append)
    assert [v.hash for v in views] == [proof.hash, library.hash] == seen[1]
    # a Merkle proof naming another hash: its table hash is accepted, its build refuses it
    forged = bytearray(chunk)
    at = forged.index(tree.get_hash(0))
    forged[at] ^= 1
    with pytest.raises(BocError) as info:
        split_roots(bytes(forged), expect=seen.append)
    assert info.value.check == "exotic cell" and len(seen) == 3
    assert [c.hash for c in PCell.from_boc(views[0].boc)] == [proof.hash]


@pytest.mark.parametrize("path", BLOCKS, ids=lambda p: p.name[:24])
def test_real_blocks_decode_and_encode_byte_for_byte(path: Path) -> None:
    data = path.read_bytes()
    (root,) = decode_boc(data, max_roots=1)
    assert root.hash == PCell.one_from_boc(data).hash and root.level_mask == 0
    assert encode_boc([root]) == data


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    forests(max_roots=3),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    st.sampled_from(["flip", "insert", "delete", "cut"]),
    st.booleans(),
)
def test_corrupted_bocs_raise_only_boc_error(
    roots: list[Cell], edits: list[tuple[int, int]], how: str, extras: bool
) -> None:
    data = bytearray(with_extras(encode_boc(roots), index=extras, crc=False))
    for at, value in edits:
        if not data:
            break
        i = at % len(data)
        if how == "flip":
            data[i] ^= value or 1
        elif how == "insert":
            data.insert(i, value)
        elif how == "delete" and len(data) > 1:
            del data[i]
        else:
            del data[i:]
    for call in (decode_boc, split_roots, lambda b: join_roots([b]), boc_cell_size):
        with contextlib.suppress(BocError):
            call(bytes(data))


@given(st.binary(max_size=64))
def test_random_bytes_raise_only_boc_error(data: bytes) -> None:
    for prefix in (b"", MAGIC):
        with contextlib.suppress(BocError):
            decode_boc(prefix + data)


def test_root_data_is_the_root_cells_data_and_bits() -> None:
    """The export reads each message's header from its root cell without building (or
    hashing) the tree: the same data and bit length as the decoded root's."""
    for root in (leaf(0xAB, 8), leaf(0b101, 3), small_boc_root(), leaf(0x1234, 13, leaf(1, 1))):
        boc = encode_boc([root])
        assert root_data(boc) == (root.data, root.bits)
        assert root_data(with_extras(boc, index=True, crc=True)) == (root.data, root.bits)
    with pytest.raises(BocError):
        root_data(b"not a BOC")


def small_boc_root() -> Cell:
    return decode_boc(small_boc())[0]
