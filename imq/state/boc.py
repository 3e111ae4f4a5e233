"""The bag-of-cells (BOC) container of persistent queue state chunks and blocks.

Owns the BOC byte format (FORMAT.md §3, §4): decoding with full validation, encoding,
and the two hot paths of state import and export, :func:`split_roots` (a multi-root
chunk into one-root BOCs) and :func:`join_roots` (the inverse). Cells and their hashes
are :mod:`imq.state.cells`; their names are re-exported here.

Supported: ordinary and exotic cells of any level (a block's Merkle update over pruned
branches). A state chunk's roots must be level 0, as messages are. Rejected: stored
hashes, absent cells, cells that no root leads to, and the two legacy BOC magics, none
of which tycho writes (unreachable cells would let a few bytes of zstd declare tens of
millions of cells, each costing time and memory before any hash is checked). One
leniency: a root list may name a cell twice (so more roots than cells), which tycho's
decoder rejects; :func:`encode_boc` writes that only for duplicate roots, which a valid
state (hashes strictly ascending) never has.

``BocError.check`` names the failed check: ``magic``, ``flags``, ``header``,
``cell count``, ``root count``, ``absent``, ``cells size``, ``truncated``,
``trailing bytes``, ``crc32c``, ``root index``, ``index``, ``cell refs``, ``ref order``,
``ref range``, ``unreachable`` (a cell no root leads to), ``stored hashes``,
``completion tag``, the cell rules ``exotic cell``, ``cell depth``, ``cell level`` (d1's
level mask is not the computed one), and ``root level`` (a chunk root that is not level 0).

Speed: :func:`split_roots` and :func:`join_roots` trade some clarity for speed. They
never build :class:`Cell` objects for ordinary level-0 leaf roots (every message in real
states): a leaf's BOC bytes are its representation, so its hash is one ``sha256`` of a
slice and its one-root BOC is a constant header plus the same slice. Other roots go
through :class:`Cell` and :func:`encode_boc`. ``benchmarks/`` and the tests measure it.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Callable, Sequence
from typing import NamedTuple

from imq.state.cells import (
    MAX_CELL_BITS,
    MAX_DEPTH,
    MAX_REFS,
    Cell,
    CellBuilder,
    CellError,
    hashed_cell,
)

__all__ = [
    "MAGIC",
    "MAX_CELL_BITS",
    "MAX_DEPTH",
    "MAX_REFS",
    "BocError",
    "Cell",
    "CellBuilder",
    "RootView",
    "boc_cell_size",
    "crc32c",
    "decode_boc",
    "encode_boc",
    "join_roots",
    "root_data",
    "split_roots",
]

MAGIC = b"\xb5\xee\x9c\x72"
_LEGACY_MAGICS = (b"\x68\xff\x65\xf3", b"\xac\xc3\xa7\x28")
_tuple_new = tuple.__new__
_sha256 = hashlib.sha256

# Data bits before the completion tag in a tagged last byte (0 for 0x00, never valid).
_TAG_BITS = bytes([0] + [7 - ((b & -b).bit_length() - 1) for b in range(1, 256)])
# One-root BOC header of a single leaf cell of k serialized bytes (2..130): ref size 1,
# offset size 1, one cell, one root, no absent cells, total size k, root index 0.
_LEAF_PREFIX = MAGIC + b"\x01\x01\x01\x01\x00"
_LEAF_HEADERS = [_LEAF_PREFIX + bytes((k, 0)) if k < 256 else b"" for k in range(256)]


class BocError(ValueError):
    """Malformed BOC. ``offset`` is the byte offset in the BOC; ``check`` names the check."""

    def __init__(self, check: str, offset: int, detail: str = "") -> None:
        message = f"malformed BOC at byte {offset}: {check}"
        super().__init__(f"{message}: {detail}" if detail else message)
        self.check = check
        self.offset = offset
        self.detail = detail


# ---------------------------------------------------------------------------------------------
# CRC32C (Castagnoli), only for BOCs that carry one; tycho writes none.


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C of ``data`` (table driven; about 10 MB/s)."""
    table = _CRC32C_TABLE
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Decoding


class _Layout(NamedTuple):
    """A validated BOC, in a compact table: ``starts[i]`` is where cell i begins
    (``starts[-1]`` is the end of the cells); ``special`` lists, ascending, the cells with
    refs or a non-zero descriptor byte d1 (exotic, or a level mask); ``heights[i]`` is the
    height of cell i's tree (0 for a leaf; ``None`` when no cell has refs), which is its
    representation depth (checked against ``MAX_DEPTH`` while scanning). A few bytes a
    cell: a hostile BOC's millions of cells cost no Python object each before a check
    can refuse them."""

    buf: bytes
    roots: list[int]
    starts: array[int]
    special: array[int]
    heights: array[int] | None
    ref_size: int


def _uint(buf: bytes, at: int, size: int) -> int:
    return int.from_bytes(buf[at : at + size])


def _read_uints(buf: bytes, at: int, count: int, size: int) -> list[int]:
    if size == 1:
        return list(buf[at : at + count])
    if size == 2:
        return list(struct.unpack_from(f">{count}H", buf, at))
    if size == 4:
        return list(struct.unpack_from(f">{count}I", buf, at))
    return [int.from_bytes(buf[p : p + size]) for p in range(at, at + count * size, size)]


def _parse(data: bytes | memoryview, max_roots: int | None, max_cells: int | None) -> _Layout:
    buf = bytes(data)
    size = len(buf)
    if buf[:4] != MAGIC:
        if size < 4 and MAGIC.startswith(buf):
            raise BocError("truncated", size, "BOC shorter than its magic")
        legacy = " (legacy BOC format, unsupported)" if buf[:4] in _LEGACY_MAGICS else ""
        raise BocError("magic", 0, f"expected b5ee9c72, got {buf[:4].hex()}{legacy}")
    if size < 6:
        raise BocError("truncated", size, "BOC header cut short")
    flags, off_size = buf[4], buf[5]
    has_idx, has_crc, has_cache = flags & 0x80, flags & 0x40, flags & 0x20
    ref_size = flags & 7
    if flags & 0x18 or not 1 <= ref_size <= 4 or (has_cache and not has_idx):
        raise BocError("flags", 4, f"invalid flags byte {flags:#04x}")
    if not 1 <= off_size <= 8:
        raise BocError("header", 5, f"offset size {off_size} not in 1..=8")
    p = 6 + 3 * ref_size + off_size
    if size < p:
        raise BocError("truncated", size, "BOC header cut short")
    cells = _uint(buf, 6, ref_size)
    roots = _uint(buf, 6 + ref_size, ref_size)
    absent = _uint(buf, 6 + 2 * ref_size, ref_size)
    total = _uint(buf, 6 + 3 * ref_size, off_size)
    _check_counts(
        cells=cells,
        roots=roots,
        absent=absent,
        total=total,
        ref_size=ref_size,
        max_roots=max_roots,
        max_cells=max_cells,
    )
    cells_at = p + roots * ref_size + (cells * off_size if has_idx else 0)
    end = cells_at + total
    expected = end + (4 if has_crc else 0)
    if size < expected:
        raise BocError("truncated", size, f"BOC needs {expected} bytes, has {size}")
    if size > expected:
        raise BocError("trailing bytes", expected, f"{size - expected} bytes after the BOC")
    if has_crc and crc32c(buf[:end]) != int.from_bytes(buf[end:], "little"):
        raise BocError("crc32c", end, "CRC32C does not match")
    root_list = _read_uints(buf, p, roots, ref_size)
    for k, root in enumerate(root_list):
        if root >= cells:
            raise BocError("root index", p + k * ref_size, f"root {root} >= cell count {cells}")
    starts, special = _scan_cells(buf, cells_at, end, cells, ref_size, roots=root_list)
    if has_idx:
        _check_index(buf, p + roots * ref_size, starts, off_size, bool(has_cache))
    heights = _heights(buf, starts, special, ref_size) if special else None
    return _Layout(buf, root_list, starts, special, heights, ref_size)


def _check_counts(
    *,
    cells: int,
    roots: int,
    absent: int,
    total: int,
    ref_size: int,
    max_roots: int | None,
    max_cells: int | None,
) -> None:
    if cells == 0 or (max_cells is not None and cells > max_cells):
        raise BocError("cell count", 6, f"cell count {cells} not in 1..={max_cells or 'any'}")
    if roots == 0 or (max_roots is not None and roots > max_roots):
        raise BocError("root count", 6 + ref_size, f"root count {roots} not in 1..={max_roots}")
    if absent:
        raise BocError("absent", 6 + 2 * ref_size, f"{absent} absent cells (unsupported)")
    if not 2 * cells <= total <= (130 + 4 * ref_size) * cells:
        raise BocError("cells size", 6 + 3 * ref_size, f"total cells size {total} impossible")


def _scan_cells(
    buf: bytes, p: int, end: int, count: int, ref_size: int, *, roots: list[int]
) -> tuple[array[int], array[int]]:
    """Validate every cell's descriptor and bounds; the hot loop of every decode.

    Every cell must be reachable from a root: refs point only to later cells, so a cell
    that is neither a root nor referenced by a cell before it is referenced by none. A
    BOC padded with such cells is refused at the first of them, before its cells cost
    memory or time (a few bytes of zstd can declare tens of millions of empty cells)."""
    starts = array("I" if end < 1 << 32 else "Q")
    append = starts.append
    special = array("I" if count <= 1 << 32 else "Q")  # a ref is at most 4 bytes
    reached = bytearray(count)  # count <= total size / 2: bounded by the bytes at hand
    for root in roots:
        reached[root] = 1
    for i in range(count):
        if not reached[i]:
            raise BocError(
                "unreachable", p, f"cell {i} is neither a root nor referenced by any cell"
            )
        append(p)
        if p + 2 > end:
            raise BocError("cells size", p, f"cell {i} starts past the total cells size")
        d1 = buf[p]
        d2 = buf[p + 1]
        q = p + 2 + ((d2 + 1) >> 1)
        if q > end:
            raise BocError("cells size", p, f"cell {i} data runs past the total cells size")
        if d2 & 1 and not buf[q - 1] & 0x7F:
            raise BocError("completion tag", q - 1, f"cell {i} lacks its completion tag")
        if d1:
            refs = _cell_refs(buf, p, i, end, count=count, ref_size=ref_size)
            special.append(i)
            for ref in refs:
                reached[ref] = 1
            q += len(refs) * ref_size
        p = q
    append(p)
    if p != end:
        raise BocError("cells size", p, f"cells end at {p}, total cells size says {end}")
    return starts, special


def _cell_refs(
    buf: bytes, p: int, i: int, end: int, *, count: int, ref_size: int
) -> tuple[int, ...]:
    """Check a non-zero d1 and read the cell's ref indices (the refs follow its data)."""
    d1 = buf[p]
    q = p + 2 + ((buf[p + 1] + 1) >> 1)
    nrefs = d1 & 7
    if nrefs > MAX_REFS:
        raise BocError("cell refs", p, f"cell {i} has {nrefs} refs (absent or invalid)")
    if d1 & 16:
        raise BocError("stored hashes", p, f"cell {i} has stored hashes (unsupported)")
    if q + nrefs * ref_size > end:
        raise BocError("cells size", q, f"cell {i} refs run past the total cells size")
    refs = tuple(_uint(buf, q + k * ref_size, ref_size) for k in range(nrefs))
    for k, ref in enumerate(refs):
        if ref >= count:
            raise BocError("ref range", q + k * ref_size, f"cell {i} refs {ref} >= {count}")
        if ref <= i:
            raise BocError("ref order", q + k * ref_size, f"cell {i} refs {ref} (not after it)")
    return refs


def _refs_at(buf: bytes, p: int, ref_size: int) -> list[int]:
    """The ref indices of the (scanned) cell at ``p``."""
    q = p + 2 + ((buf[p + 1] + 1) >> 1)
    return _read_uints(buf, q, buf[p] & 7, ref_size)


def _heights(buf: bytes, starts: array[int], special: array[int], ref_size: int) -> array[int]:
    """Each cell's tree height, children first; a tree deeper than ``MAX_DEPTH`` is
    refused at its deepest cell past the limit, before any cell is built (a chain of
    millions of cells fits in a few KB of zstd). A cell's height is its representation
    depth, whatever its level: a pruned branch, the only leaf whose lower-level depths
    come from its data, has representation depth 0, and every other cell's is one more
    than its refs' largest at its own (or, for Merkle cells, the next) level, which is
    theirs. So every tree this refuses, :class:`Cell` refuses too; the lower-level
    depths a pruned branch stores (which can pass the limit at a smaller height) are
    checked when the cells are built."""
    heights = array("H", bytes(2 * (len(starts) - 1)))
    for i in reversed(special):
        p = starts[i]
        refs = _refs_at(buf, p, ref_size)
        if refs:
            height = 1 + max([heights[r] for r in refs])
            if height > MAX_DEPTH:
                raise BocError(
                    "cell depth", p, f"cell {i}: cell depth {height} exceeds {MAX_DEPTH}"
                )
            heights[i] = height
    return heights


def _check_index(buf: bytes, at: int, starts: array[int], off_size: int, cache: bool) -> None:
    base = starts[0]
    for i in range(len(starts) - 1):
        entry = _uint(buf, at + i * off_size, off_size)
        if cache:
            entry >>= 1
        if entry != starts[i + 1] - base:
            raise BocError("index", at + i * off_size, f"index entry {i} is {entry}")


def _cell_at(
    layout: _Layout, i: int, built: dict[int, Cell], digests: bytearray | None = None
) -> Cell:
    """Cell ``i`` over its built refs; an ordinary one takes its hash from ``digests``
    (the table :func:`_plain_hashes` filled) when given, instead of hashing again."""
    buf, starts = layout.buf, layout.starts
    p = starts[i]
    d1, d2 = buf[p], buf[p + 1]
    q = p + 2 + ((d2 + 1) >> 1)
    bits = d2 * 4 if not d2 & 1 else (d2 - 1) * 4 + _TAG_BITS[buf[q - 1]]
    refs = tuple([built[r] for r in _refs_at(buf, p, layout.ref_size)]) if d1 & 7 else ()
    if digests is not None and not d1 & 8:  # ordinary, level 0 (the table's rule)
        heights = layout.heights
        depth = 0 if heights is None else heights[i]
        return hashed_cell(buf[p + 2 : q], bits, refs, bytes(digests[32 * i : 32 * i + 32]), depth)
    try:
        return Cell.from_serialized(
            buf[p + 2 : q], bits, refs, exotic=bool(d1 & 8), level_mask=d1 >> 5
        )
    except CellError as exc:
        raise BocError(exc.check, p, f"cell {i}: {exc}") from None


def _reached_from(layout: _Layout, wanted: Sequence[int]) -> bytearray:
    """A mark per cell: 1 for ``wanted`` and every cell under them."""
    buf, starts, ref_size = layout.buf, layout.starts, layout.ref_size
    needed = bytearray(len(starts) - 1)
    stack = []
    for i in wanted:
        if not needed[i]:
            needed[i] = 1
            stack.append(i)
    while stack:
        p = starts[stack.pop()]
        if buf[p] & 7:
            for ref in _refs_at(buf, p, ref_size):
                if not needed[ref]:
                    needed[ref] = 1
                    stack.append(ref)
    return needed


def _build_cells(
    layout: _Layout, wanted: Sequence[int], table: _Table | None = None
) -> dict[int, Cell]:
    """Cell objects for ``wanted`` and everything under them, built children first
    (with ``table``, :func:`_plain_hashes`' for the same ``wanted``, from its hashes)."""
    digests, needed = (None, _reached_from(layout, wanted)) if table is None else table
    built: dict[int, Cell] = {}
    for i in range(len(needed) - 1, -1, -1):
        if needed[i]:
            built[i] = _cell_at(layout, i, built, digests)
    return built


def decode_boc(
    data: bytes | memoryview, *, max_roots: int | None = None, max_cells: int | None = None
) -> list[Cell]:
    """Decode and validate a BOC; the roots come in the order of its root list."""
    layout = _parse(data, max_roots, max_cells)
    built = _build_cells(layout, layout.roots)
    return [built[r] for r in layout.roots]


# ---------------------------------------------------------------------------------------------
# Encoding


def _fit(value: int) -> int:
    return max(1, (value.bit_length() + 7) >> 3)


def _post_order(roots: Sequence[Cell]) -> tuple[list[Cell], dict[bytes, int], list[int]]:
    """Distinct cells in DFS post-order (refs in order) and each root's position."""
    position: dict[bytes, int] = {}
    post: list[Cell] = []
    root_pos: list[int] = []
    for root in roots:
        if type(root) is not Cell:
            raise TypeError(f"BOC roots must be Cell values, got {type(root).__name__}")
        if root.hash not in position:
            stack = [(root, iter(root.refs))]
            while stack:
                cell, children = stack[-1]
                for child in children:
                    if child.hash not in position:
                        stack.append((child, iter(child.refs)))
                        break
                else:
                    stack.pop()
                    position[cell.hash] = len(post)
                    post.append(cell)
        root_pos.append(position[root.hash])
    return post, position, root_pos


def _assemble(cell_count: int, root_indices: list[int], cell_bytes: bytes, ref_size: int) -> bytes:
    total = len(cell_bytes)
    off_size = _fit(total)
    header = bytearray(MAGIC)
    header += bytes((ref_size, off_size))
    header += cell_count.to_bytes(ref_size)
    header += len(root_indices).to_bytes(ref_size)
    header += bytes(ref_size)
    header += total.to_bytes(off_size)
    if ref_size == 2:
        header += struct.pack(f">{len(root_indices)}H", *root_indices)
    else:
        header += b"".join([i.to_bytes(ref_size) for i in root_indices])
    return bytes(header) + cell_bytes


def encode_boc(roots: Sequence[Cell]) -> bytes:
    """A standard BOC (no index, no CRC, minimal sizes), cells deduplicated by hash.

    The cell order is tycho's: reverse DFS post-order, so parents precede children and
    a chunk of leaf roots lists its roots n-1, n-2, ..., 0.
    """
    if not roots:
        raise ValueError("a BOC needs at least one root")
    post, position, root_pos = _post_order(roots)
    n = len(post)
    ref_size = _fit(n)
    parts = []
    for cell in reversed(post):
        parts.append(cell.descriptor)
        parts.append(cell.data)
        for child in cell.refs:
            parts.append((n - 1 - position[child.hash]).to_bytes(ref_size))
    return _assemble(n, [n - 1 - k for k in root_pos], b"".join(parts), ref_size)


# ---------------------------------------------------------------------------------------------
# Multi-root chunks: the import and export hot paths


class RootView(NamedTuple):
    """One root of a chunk: what the import stores per message."""

    hash: bytes
    data: bytes
    bits: int
    boc: bytes
    refs: int  # how many cells the root refers to (0: a leaf)
    children: tuple[Cell, ...]  # the cells it refers to (``()`` for a leaf)


def split_roots(
    data: bytes | memoryview,
    *,
    max_roots: int = 10_000,
    expect: Callable[[list[bytes]], None] | None = None,
) -> list[RootView]:
    """Decode a multi-root chunk (validated like :func:`decode_boc`, and every root must
    be level 0) into one view per root, in root-list order; ``boc`` is a standalone
    one-root BOC of the root's tree.

    ``expect``, when given, is called with every root's representation hash, in order,
    before any :class:`Cell` is built (it raises to refuse them): the import's check
    against the diffs' hash lists then costs a forged chunk its compact table and 34
    bytes a cell, not a cell object each. A chunk whose roots lead to a cell of a higher
    level (a pruned branch, under a Merkle proof) builds its cells first."""
    layout = _parse(data, max_roots, None)
    buf, starts = layout.buf, layout.starts
    roots = layout.roots
    slow = [r for r in roots if buf[starts[r]]] if layout.special else []
    sha = _sha256
    built: dict[int, Cell] = {}
    hashes: list[bytes] | None = None  # each root's hash, once expected
    table: _Table | None = None  # every cell's hash under the slow roots, when plain
    if expect is not None:
        if slow:
            table = _plain_hashes(layout, slow)
            if table is None:  # cells of higher levels: their hashes need the cells
                built = _built_roots(layout, slow)
                known = {r: built[r].hash for r in slow}
            else:
                digests = table[0]
                known = {r: bytes(digests[32 * r : 32 * r + 32]) for r in slow}
            hashes = [
                known[r] if r in known else sha(buf[starts[r] : starts[r + 1]]).digest()
                for r in roots
            ]
        else:  # every root a leaf (every message of the networks' states)
            hashes = [sha(buf[starts[r] : starts[r + 1]]).digest() for r in roots]
        expect(hashes)
    if slow and not built:
        built = _built_roots(layout, slow, table)
    views: dict[int, RootView] = {}
    headers, tag_bits, new = _LEAF_HEADERS, _TAG_BITS, _tuple_new
    out = []
    for k, r in enumerate(roots):
        if r in built:
            view = views.get(r)
            if view is None:
                cell = built[r]
                view = views[r] = new(
                    RootView,
                    (
                        cell.hash,
                        cell.data,
                        cell.bits,
                        encode_boc([cell]),
                        len(cell.refs),
                        cell.refs,
                    ),
                )
            out.append(view)
            continue
        st = starts[r]
        en = starts[r + 1]
        raw = buf[st:en]
        d2 = raw[1]
        bits = d2 * 4 if not d2 & 1 else (d2 - 1) * 4 + tag_bits[raw[-1]]
        digest = sha(raw).digest() if hashes is None else hashes[k]
        out.append(new(RootView, (digest, raw[2:], bits, headers[en - st] + raw, 0, ())))
    return out


def _built_roots(layout: _Layout, roots: list[int], table: _Table | None = None) -> dict[int, Cell]:
    built = _build_cells(layout, roots, table)
    for r in roots:
        _check_root_level(layout, built[r], r)
    return built


_Table = tuple[bytearray, bytearray]  # each cell's hash (32 bytes at 32 i), needed marks


def _plain_hashes(layout: _Layout, roots: list[int]) -> _Table | None:
    """The representation hashes of ``roots`` and every cell under them, from the
    compact table, when all those cells are of level 0 (what messages are made of): one
    ``sha256`` of the cell's stored bytes, its refs' depths and hashes, children first,
    into a table of 32 bytes a cell (cell i's at ``32 i``; an exotic cell of level 0
    over level-0 refs, a library or a Merkle proof of a whole tree, hashes so too).
    ``None`` when a level mask is met. Exotic cells are not checked here: a hash the
    caller accepts is followed by the cells' build, which checks them. With the hashes,
    the marks of the cells they were computed for (``roots`` and everything under)."""
    buf, starts, heights, ref_size = layout.buf, layout.starts, layout.heights, layout.ref_size
    assert heights is not None  # roots with refs: the scan measured the heights
    needed = _reached_from(layout, roots)
    digests = bytearray(32 * len(needed))
    sha, read_uints = _sha256, _read_uints
    for i in range(len(needed) - 1, -1, -1):
        if not needed[i]:
            continue
        p = starts[i]
        d1 = buf[p]
        if d1 & 0xE0:  # a level mask (stored hashes were refused in the scan)
            return None
        q = p + 2 + ((buf[p + 1] + 1) >> 1)
        if d1:
            refs = read_uints(buf, q, d1 & 7, ref_size)
            digest = sha(
                buf[p:q]
                + b"".join([heights[r].to_bytes(2) for r in refs])
                + b"".join([digests[32 * r : 32 * r + 32] for r in refs])
            ).digest()
        else:
            digest = sha(buf[p:q]).digest()
        digests[32 * i : 32 * i + 32] = digest
    return digests, needed


def _leaf_cell_of(boc: bytes) -> bytes | None:
    """The cell bytes of a one-root BOC holding one ordinary leaf in the canonical
    (minimal, flag-free) form, else ``None``."""
    size = len(boc)
    if size < 13 or boc[11] or not boc.startswith(_LEAF_PREFIX) or boc[9] != size - 11:
        return None
    d2 = boc[12]
    if boc[10] or size - 13 != (d2 + 1) >> 1 or (d2 & 1 and not boc[-1] & 0x7F):
        return None
    return boc[11:]


def join_roots(bocs: Sequence[bytes], hashes: list[bytes] | None = None) -> bytes:
    """One multi-root BOC holding the level-0 roots of the one-root BOCs ``bocs`` in
    order, identical cells stored once; byte-identical to tycho's encoder. ``hashes``,
    when given, gets each root's cell hash appended, in order (one ``sha256`` of the
    cell for a leaf)."""
    if not bocs:
        raise ValueError("join_roots needs at least one BOC")
    position: dict[bytes, int] = {}
    order = []
    leaf_of = _leaf_cell_of
    for boc in bocs:
        cell = leaf_of(boc)
        if cell is None:
            roots = _decode_each(bocs)
            if hashes is not None:
                hashes.extend([root.hash for root in roots])
            return encode_boc(roots)
        order.append(position.setdefault(cell, len(position)))
    if hashes is not None:
        sha = _sha256
        digests = [sha(cell).digest() for cell in position]  # a leaf's bytes are its repr
        hashes.extend(digests if len(digests) == len(order) else [digests[k] for k in order])
    n = len(position)
    return _assemble(n, [n - 1 - k for k in order], b"".join(reversed(position)), _fit(n))


def root_data(boc: bytes) -> tuple[bytes, int]:
    """``(data, bits)`` of the root cell of a one-root BOC (:class:`BocError` if it is
    none); cheap for the canonical leaf form."""
    buf: bytes | None = _leaf_cell_of(boc)
    p = 0
    if buf is None:
        layout = _parse(boc, 1, None)  # the layout checked, no cell built (nor hashed)
        buf, p = layout.buf, layout.starts[layout.roots[0]]
    d2 = buf[p + 1]
    q = p + 2 + ((d2 + 1) >> 1)
    return buf[p + 2 : q], d2 * 4 if not d2 & 1 else (d2 - 1) * 4 + _TAG_BITS[buf[q - 1]]


def _check_root_level(layout: _Layout, cell: Cell, r: int) -> None:
    if cell.level_mask:
        raise BocError(
            "root level",
            layout.starts[r],
            f"root cell {r} has level mask {cell.level_mask}; chunk roots are level-0 messages",
        )


def _decode_each(bocs: Sequence[bytes]) -> list[Cell]:
    roots = []
    for k, boc in enumerate(bocs):
        try:
            layout = _parse(boc, 1, None)
            r = layout.roots[0]
            roots.append(_build_cells(layout, [r])[r])
            _check_root_level(layout, roots[-1], r)
        except BocError as exc:
            raise BocError(exc.check, exc.offset, f"input BOC #{k}: {exc.detail}") from None
    return roots


def boc_cell_size(boc: bytes) -> int:
    """An upper bound on the bytes a one-root BOC's tree adds to a :func:`join_roots`
    chunk: its cells with 4-byte refs plus a 4-byte root-list entry (shared cells are
    counted in full). Cheap for the canonical leaf form."""
    cell = _leaf_cell_of(boc)
    if cell is not None:
        return len(cell) + 4
    layout = _parse(boc, 1, None)
    buf, starts = layout.buf, layout.starts
    refs = sum([buf[starts[i]] & 7 for i in layout.special])
    return starts[-1] - starts[0] + (4 - layout.ref_size) * refs + 4
