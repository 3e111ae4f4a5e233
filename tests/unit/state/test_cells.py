"""Cells and their level-aware hashes (imq.state.cells), checked against the real tycho
blocks and against pytoniq-core as an independent implementation."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pytoniq_core import Builder as PBuilder
from pytoniq_core import Cell as PCell
from pytoniq_oracle import to_pytoniq
from tycho_data import TYCHO

from imq.state import boc
from imq.state.boc import decode_boc, encode_boc
from imq.state.cells import MAX_DEPTH, Cell, CellBuilder, CellError

BLOCKS = [
    TYCHO / "first_block" / "first_block.bin",
    *sorted((TYCHO / "dump" / "blocks").glob("*.block")),
    *sorted((TYCHO / "dump_one_shard" / "blocks").glob("*.block")),
]
PRUNED, LIBRARY, PROOF, UPDATE = 1, 2, 3, 4


def leaf(value: int, bits: int, *refs: Cell) -> Cell:
    return Cell((value << (-bits % 8)).to_bytes((bits + 7) // 8), bits, refs)


def pruned(mask: int, hashes: list[bytes], depths: list[int]) -> Cell:
    data = bytes((PRUNED, mask)) + b"".join(hashes) + b"".join(d.to_bytes(2) for d in depths)
    return Cell(data, 8 * len(data), exotic=True)


def prune(cell: Cell) -> Cell:
    """The level-1 pruned branch standing for ``cell`` (a level-0 cell)."""
    return pruned(1, [cell.hash], [cell.depth])


def merkle(kind: int, *children: Cell) -> Cell:
    data = bytes((kind,)) + b"".join(c.get_hash(0) for c in children)
    data += b"".join(c.get_depth(0).to_bytes(2) for c in children)
    return Cell(data, 8 * len(data), children, exotic=True)


def assert_agrees(ours: Cell, theirs: PCell) -> None:
    assert ours.hash == theirs.hash
    assert ours.level_mask == theirs.level_mask.mask
    for level in range(4):
        assert ours.get_hash(level) == theirs.get_hash(level), level
        assert ours.get_depth(level) == theirs.get_depth(level), level


@functools.cache
def block_cells(path: Path) -> list[Cell]:
    return list(decode_boc(path.read_bytes())[0].iter_tree())


# ---------------------------------------------------------------------------------------------
# level-0 cells and the builder


def test_cell_hash_depth_and_serialized_data() -> None:
    a = leaf(0b101, 3)
    assert a.data == bytes([0b1011_0000]) and a.bits == 3
    assert a.descriptor == b"\x00\x01"
    assert a.hash == hashlib.sha256(b"\x00\x01\xb0").digest()
    root = leaf(0xFF, 8, a, a)
    assert root.depth == 1 and root.refs == (a, a) and not root.exotic
    assert root.level == root.level_mask == 0
    expected = b"\x02\x02\xff" + b"\x00\x00" * 2 + a.hash * 2
    assert root.hash == hashlib.sha256(expected).digest()
    assert [root.get_hash(i) for i in range(4)] == [root.hash] * 4
    assert [root.get_depth(i) for i in range(4)] == [1] * 4
    assert root.hash == to_pytoniq(root).hash
    assert list(root.iter_tree()) == [root, a]


def test_cell_normalizes_bits_past_the_length() -> None:
    assert Cell(b"\xff", 3) == Cell(b"\xe0", 3) == leaf(0b111, 3)
    assert Cell(b"\xff", 3).data == b"\xf0"
    assert Cell(b"", 0).data == b"" and Cell(b"", 0).depth == 0
    assert hash(Cell(b"\xff", 3)) == hash(Cell(b"\xe1", 3))
    assert Cell(b"\x00", 8) != Cell(b"\x00", 7)
    assert Cell(b"\x00", 8) != b"\x00"
    assert "bits=3" in repr(Cell(b"\xff", 3)) and "level" not in repr(Cell(b"\xff", 3))


@pytest.mark.parametrize(
    ("args", "kwargs", "error"),
    [
        ((b"\x00" * 128, 1024), {}, ValueError),
        ((b"\x00", -1), {}, ValueError),
        ((b"\x00", 9), {}, ValueError),
        ((b"\x00\x00", 8), {}, ValueError),
        ((b"", 0, [Cell(b"", 0)] * 5), {}, ValueError),
        ((b"", 0, ["x"]), {}, TypeError),
        (("ab", 16), {}, TypeError),
        ((b"", 0), {"exotic": True}, CellError),  # no type byte
        ((b"\x01", 8), {"exotic": True}, CellError),  # a pruned branch without a mask
        ((b"\x01\x00", 16), {"exotic": True}, CellError),  # mask 0
        ((b"\x01\x08", 16), {"exotic": True}, CellError),  # mask past level 3
        ((b"\x01\x01", 16), {"exotic": True}, CellError),  # mask 1 needs one hash + depth
        ((b"\x01\x01" + bytes(34), 288, [Cell(b"", 0)]), {"exotic": True}, CellError),
        ((b"\x01\x03" + bytes(34), 288), {"exotic": True}, CellError),  # mask 3: two
        ((b"\x02", 8), {"exotic": True}, CellError),
        ((b"\x09", 8), {"exotic": True}, CellError),
        ((b"\x00", 8), {"exotic": True}, CellError),
    ],
)
def test_cell_rejects_bad_arguments(
    args: tuple[object, ...], kwargs: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error) as info:
        Cell(*args, **kwargs)  # type: ignore[arg-type]
    if error is CellError:
        assert info.value.check == "exotic cell"  # type: ignore[attr-defined]


def test_cell_depth_limit() -> None:
    cell = Cell(b"", 0)
    for _ in range(MAX_DEPTH):
        cell = Cell(b"", 0, [cell])
    assert cell.depth == MAX_DEPTH
    with pytest.raises(CellError, match="depth") as info:
        Cell(b"", 0, [cell])
    assert info.value.check == "cell depth"
    with pytest.raises(ValueError, match="depth"):
        CellBuilder().store_ref(cell).end()
    decoded = decode_boc(encode_boc([cell]))[0]
    assert decoded.depth == MAX_DEPTH and decoded.hash == cell.hash


def test_builder_matches_pytoniq() -> None:
    ref = CellBuilder().store_bytes(b"hello").end()
    ours = (
        CellBuilder()
        .store_uint(5, 3)
        .store_int(-1, 8)
        .store_int(-128, 8)
        .store_bit(True)
        .store_bit(0)
        .store_bytes(b"\x01\x02")
        .store_ref(ref)
        .end()
    )
    theirs = (
        PBuilder()
        .store_uint(5, 3)
        .store_int(-1, 8)
        .store_int(-128, 8)
        .store_bit(1)
        .store_bit(0)
        .store_bytes(b"\x01\x02")
        .store_ref(PBuilder().store_bytes(b"hello").end_cell())
        .end_cell()
    )
    assert ours.bits == 3 + 8 + 8 + 2 + 16 and ours.hash == theirs.hash


def test_builder_rejects_overflow_and_bad_values() -> None:
    with pytest.raises(ValueError):
        CellBuilder().store_uint(8, 3)
    with pytest.raises(ValueError):
        CellBuilder().store_uint(-1, 3)
    with pytest.raises(ValueError):
        CellBuilder().store_int(128, 8)
    with pytest.raises(ValueError):
        CellBuilder().store_uint(0, 1000).store_uint(0, 24)
    builder = CellBuilder().store_uint(0, 1000).store_uint(0, 23)
    assert builder.bits == 1023 and builder.bits_left == 0 and builder.end().bits == 1023
    full = CellBuilder()
    for _ in range(4):
        full.store_ref(Cell(b"", 0))
    with pytest.raises(ValueError):
        full.store_ref(Cell(b"", 0))
    with pytest.raises(TypeError):
        CellBuilder().store_ref(b"")  # type: ignore[arg-type]


def test_boc_re_exports_the_cell_names() -> None:
    assert boc.Cell is Cell and boc.CellBuilder is CellBuilder and boc.MAX_DEPTH == MAX_DEPTH


# ---------------------------------------------------------------------------------------------
# exotic cells and levels


def test_library_and_merkle_proof_over_level_0_match_pytoniq() -> None:
    library = Cell(b"\x02" + bytes(range(32)), 264, exotic=True)
    p_library = PCell(PBuilder().store_bytes(b"\x02" + bytes(range(32))).bits, [], LIBRARY)
    assert library.exotic and library.hash == p_library.hash and library.level_mask == 0
    inner = leaf(0xABCDEF, 24, leaf(1, 1))
    proof = merkle(PROOF, inner)
    assert proof.data == b"\x03" + inner.hash + b"\x00\x01" and proof.bits == 280
    p_proof = PCell(PBuilder().store_bytes(proof.data).bits, [to_pytoniq(inner)], PROOF)
    assert proof.hash == p_proof.hash and proof.depth == 2 and proof.level_mask == 0
    decoded = decode_boc(encode_boc([proof, library]))
    assert [c.hash for c in decoded] == [proof.hash, library.hash]
    assert all(c.exotic for c in decoded)
    with pytest.raises(CellError, match="stored hash") as info:
        Cell(b"\x03" + bytes(32) + b"\x00\x01", 280, [inner], exotic=True)
    assert info.value.check == "exotic cell"
    with pytest.raises(CellError, match="stored hash"):  # right hash, wrong depth
        Cell(b"\x03" + inner.hash + b"\x00\x02", 280, [inner], exotic=True)


def test_pruned_branch_keeps_the_hash_it_stands_for() -> None:
    subtree = leaf(0xBEEF, 16, leaf(1, 3))
    cut = prune(subtree)
    assert cut.exotic and cut.refs == () and cut.bits == 288
    assert (cut.level, cut.level_mask) == (1, 1)
    assert cut.descriptor == b"\x28\x48"  # exotic, level mask 1 in d1's top bits; 36 bytes
    assert cut.get_hash(0) == subtree.hash and cut.get_depth(0) == subtree.depth == 1
    top = hashlib.sha256(cut.descriptor + cut.data).digest()
    assert cut.hash == top == cut.get_hash(1) == cut.get_hash(3)
    assert cut.depth == cut.get_depth(1) == 0
    assert "level_mask=1" in repr(cut)
    assert_agrees(cut, to_pytoniq(cut))


def test_a_pruned_tree_hashes_at_level_0_like_the_full_tree() -> None:
    """Level 0 of a tree with pruned branches is the hash of the tree they were cut from:
    what makes a Merkle proof's stored hash the real one."""
    shared = leaf(7, 8)
    left, right = leaf(0xAA, 8, shared), leaf(0xBB, 8, leaf(0xCC, 8, shared))
    full = leaf(0x1234, 16, left, right)
    partial = leaf(0x1234, 16, left, prune(right))
    assert partial.level_mask == 1 and partial.hash != full.hash
    assert partial.get_hash(0) == full.hash and partial.get_depth(0) == full.depth == 3
    assert partial.get_depth(1) == 2  # left's depth + 1; the pruned branch counts 0
    assert partial.get_hash(1) == partial.hash
    expected = hashlib.sha256(  # level 1 hashes the level-0 hash instead of the data
        b"\x22\x04" + full.hash + b"\x00\x01\x00\x00" + left.hash + prune(right).hash
    ).digest()
    assert partial.hash == expected
    proof = merkle(PROOF, partial)
    assert proof.level_mask == 0 and proof.data[1:33] == full.hash
    assert_agrees(partial, to_pytoniq(partial))
    assert_agrees(proof, to_pytoniq(proof))
    with pytest.raises(CellError, match="stored hash"):  # the representation hash is wrong
        Cell(b"\x03" + partial.hash + b"\x00\x03", 280, [partial], exotic=True)


def test_merkle_update_between_two_pruned_trees() -> None:
    kept = leaf(0xEE, 8, leaf(1, 8))
    old = leaf(0, 8, prune(kept), leaf(1, 8))
    new = leaf(0, 8, prune(kept), leaf(2, 8))
    update = merkle(UPDATE, old, new)
    assert update.bits == 552 and update.level_mask == 0 and update.depth == 2
    assert update.data[1:65] == old.get_hash(0) + new.get_hash(0)
    assert_agrees(update, to_pytoniq(update))
    around = leaf(5, 8, update)  # a level-0 parent of the update, as in a block
    assert around.level_mask == 0 and around.depth == 3
    assert_agrees(around, to_pytoniq(around))


# pytoniq-core 0.2.1 cannot hash a pruned branch of mask 6 (levels 2 and 3): it compares a
# level where TON compares a hash index. That mask is checked against the rule by hand.
ORACLE_MASKS = (1, 2, 3, 4, 5, 7)


def test_pruned_branch_of_mask_6_by_hand() -> None:
    cut = pruned(6, [b"\x01" * 32, b"\x02" * 32], [5, 6])
    assert cut.descriptor == bytes((0xC8, 2 * 70)) and cut.level == 3
    assert cut.hash == hashlib.sha256(cut.descriptor + cut.data).digest()
    assert [cut.get_hash(i) for i in range(4)] == [b"\x01" * 32] * 2 + [b"\x02" * 32, cut.hash]
    assert [cut.get_depth(i) for i in range(4)] == [5, 5, 6, 0]
    parent = leaf(1, 1, cut)  # data 0xc0: one bit and the completion tag
    assert parent.level_mask == 6
    # level 0 hashes the data; the significant levels 2 and 3 hash the hash before them
    expected = [hashlib.sha256(b"\x01\x01\xc0" + b"\x00\x05" + b"\x01" * 32).digest()]
    for level, child_depth, child_hash in ((2, 6, b"\x02" * 32), (3, 0, cut.hash)):
        d1 = 1 | (6 & ((1 << level) - 1)) << 5
        body = bytes((d1, 1)) + expected[-1] + child_depth.to_bytes(2) + child_hash
        expected.append(hashlib.sha256(body).digest())
    assert [parent.get_hash(i) for i in range(4)] == [expected[0], *expected]
    assert [parent.get_depth(i) for i in range(4)] == [6, 6, 7, 1]


@pytest.mark.parametrize("mask", ORACLE_MASKS)
def test_pruned_branches_of_every_mask_match_pytoniq(mask: int) -> None:
    stored = mask.bit_count()
    hashes = [hashlib.sha256(bytes((mask, k))).digest() for k in range(stored)]
    cut = pruned(mask, hashes, [10 + k for k in range(stored)])
    assert cut.level_mask == mask and cut.level == mask.bit_length()
    for level in range(4):
        index = (mask & ((1 << level) - 1)).bit_count()
        assert cut.get_hash(level) == [*hashes, cut.hash][index]
        assert cut.get_depth(level) == [*range(10, 10 + stored), 0][index]
    assert_agrees(cut, to_pytoniq(cut))
    parent = leaf(3, 2, cut, leaf(1, 1))
    assert parent.level_mask == mask
    assert_agrees(parent, to_pytoniq(parent))
    proof = merkle(PROOF, parent)
    assert proof.level_mask == mask >> 1
    assert_agrees(proof, to_pytoniq(proof))


def test_pruned_branch_depth_over_the_limit() -> None:
    with pytest.raises(CellError) as info:
        pruned(1, [bytes(32)], [MAX_DEPTH + 1])
    assert info.value.check == "cell depth"
    deepest = pruned(1, [bytes(32)], [MAX_DEPTH])
    assert deepest.get_depth(0) == MAX_DEPTH and deepest.depth == 0
    with pytest.raises(CellError, match="depth"):  # the limit holds at every level
        leaf(0, 1, deepest)


def test_get_hash_rejects_bad_levels() -> None:
    cell = leaf(1, 8)
    for level in (-1, 4, "1", 1.0):
        with pytest.raises(ValueError):
            cell.get_hash(level)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            cell.get_depth(level)  # type: ignore[arg-type]


def test_from_serialized() -> None:
    cut = prune(leaf(1, 8))
    again = Cell.from_serialized(cut.data, cut.bits, exotic=True, level_mask=1)
    assert again == cut and again.level_mask == 1
    assert Cell.from_serialized(b"\xb0", 3) == leaf(0b101, 3)
    with pytest.raises(CellError) as info:
        Cell.from_serialized(cut.data, cut.bits, exotic=True, level_mask=0)
    assert info.value.check == "cell level"
    with pytest.raises(CellError):
        Cell.from_serialized(b"", 0, (cut,), level_mask=0)
    with pytest.raises(ValueError, match="completion tag"):
        Cell.from_serialized(b"\xa0", 3)  # bits past the tag position
    with pytest.raises(ValueError):
        Cell.from_serialized(b"\xb0", 9)
    with pytest.raises(TypeError):
        Cell.from_serialized(bytearray(b"\xb0"), 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Cell.from_serialized(b"", 0, [cut])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Cell.from_serialized(b"", 0, (b"",))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# random trees with levels


@st.composite
def level_forests(draw: st.DrawFn) -> list[Cell]:
    """Cells of random kinds (ordinary, pruned of any mask, library, Merkle proof and
    update), each over cells drawn before it."""
    pool: list[Cell] = []
    for _ in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["ordinary", "ordinary", "pruned", "library", "proof"]))
        kind = "update" if kind == "proof" and pool and draw(st.booleans()) else kind
        if kind == "pruned":
            mask = draw(st.sampled_from(ORACLE_MASKS))
            hashes = [draw(st.binary(min_size=32, max_size=32)) for _ in range(mask.bit_count())]
            depths = [draw(st.integers(0, 900)) for _ in range(mask.bit_count())]
            pool.append(pruned(mask, hashes, depths))
        elif kind == "library":
            pool.append(Cell(b"\x02" + draw(st.binary(min_size=32, max_size=32)), 264, exotic=True))
        elif kind in ("proof", "update") and pool:
            n = 1 if kind == "proof" else 2
            pool.append(
                merkle(
                    PROOF if n == 1 else UPDATE,
                    *draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n)),
                )
            )
        else:
            bits = draw(st.integers(0, 40))
            refs = draw(st.lists(st.sampled_from(pool), max_size=4)) if pool else []
            pool.append(leaf(draw(st.integers(0, (1 << bits) - 1)), bits, *refs))
    return pool


@given(level_forests())
def test_random_level_trees_match_pytoniq_and_round_trip(pool: list[Cell]) -> None:
    memo: dict[bytes, PCell] = {}
    for cell in pool:
        assert_agrees(cell, to_pytoniq(cell, memo))
    data = encode_boc(pool)
    decoded = decode_boc(data)
    for ours, original in zip(decoded, pool, strict=True):
        assert ours.level_mask == original.level_mask
        assert [ours.get_hash(i) for i in range(4)] == [original.get_hash(i) for i in range(4)]
        assert [ours.get_depth(i) for i in range(4)] == [original.get_depth(i) for i in range(4)]
    assert encode_boc(decoded) == data
    assert [c.hash for c in PCell.from_boc(data)] == [c.hash for c in pool]


# ---------------------------------------------------------------------------------------------
# the real blocks


@pytest.mark.parametrize("path", BLOCKS, ids=lambda p: p.name[:24])
def test_real_block_cells_match_pytoniq_at_every_level(path: Path) -> None:
    cells = block_cells(path)
    theirs: dict[bytes, PCell] = {}
    stack = [PCell.one_from_boc(path.read_bytes())]
    while stack:
        cell = stack.pop()
        if cell.hash not in theirs:
            theirs[cell.hash] = cell
            stack.extend(cell.refs)
    assert len(theirs) == len(cells)
    for cell in cells:
        assert_agrees(cell, theirs[cell.hash])
    kinds = {(c.exotic and c.data[0], c.level_mask) for c in cells}
    assert {(PRUNED, 1), (False, 1), (UPDATE, 0), (False, 0)} == kinds
    assert cells[0].level_mask == 0
