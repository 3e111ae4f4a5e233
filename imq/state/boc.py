"""TON cells and the bag-of-cells (BOC) container of persistent queue state chunks.

Owns the byte format of cells and BOCs (FORMAT.md §3, §4, §7): decoding with full
validation, encoding, cell representation hashes, and the two hot paths of state import
and export, :func:`split_roots` (a multi-root chunk into one-root BOCs) and
:func:`join_roots` (the inverse).

``Cell.data`` is the serialized form: ``ceil(bits / 8)`` bytes, and when ``bits % 8 != 0``
the last byte carries the completion tag (a 1 bit, then zeros) after the data bits. That
is what a BOC stores and what the representation hash covers, so a leaf cell's hash is
``sha256(d1 d2 data)`` with no conversion.

Supported: ordinary cells and level-0 exotic cells (library, Merkle proof and update
over level-0 trees). Rejected: any cell with a non-zero level mask (pruned branches and
everything above them), stored hashes, absent cells, and the two legacy BOC magics,
none of which tycho writes. One leniency: a root list may name a cell twice (so
more roots than cells), which tycho's decoder rejects; :func:`encode_boc` writes that
only for duplicate roots, which a valid state (hashes strictly ascending) never has.

``BocError.check`` names the failed check: ``magic``, ``flags``, ``header``,
``cell count``, ``root count``, ``absent``, ``cells size``, ``truncated``,
``trailing bytes``, ``crc32c``, ``root index``, ``index``, ``cell refs``, ``ref order``,
``ref range``, ``stored hashes``, ``cell level``, ``completion tag``, ``exotic cell``,
``cell depth``.

Speed: :func:`split_roots` and :func:`join_roots` trade some clarity for speed. They
never build :class:`Cell` objects for ordinary leaf roots (every message in real
states): a leaf's BOC bytes are its representation, so its hash is one ``sha256`` of a
slice and its one-root BOC is a constant header plus the same slice. Roots with refs go
through :class:`Cell` and :func:`encode_boc`. ``benchmarks/`` and the tests measure it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from typing import NamedTuple

__all__ = [
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
    "split_roots",
]

MAGIC = b"\xb5\xee\x9c\x72"
_LEGACY_MAGICS = (b"\x68\xff\x65\xf3", b"\xac\xc3\xa7\x28")
MAX_CELL_BITS = 1023
MAX_REFS = 4
MAX_DEPTH = 1024
_tuple_new = tuple.__new__
_sha256 = hashlib.sha256

# Data bits before the completion tag in a tagged last byte (0 for 0x00, never valid).
_TAG_BITS = bytes([0] + [7 - ((b & -b).bit_length() - 1) for b in range(1, 256)])
# One-root BOC header of a single leaf cell of k serialized bytes (2..130): ref size 1,
# offset size 1, one cell, one root, no absent cells, total size k, root index 0.
_LEAF_PREFIX = MAGIC + b"\x01\x01\x01\x01\x00"
_LEAF_HEADERS = [_LEAF_PREFIX + bytes((k, 0)) if k < 256 else b"" for k in range(256)]
# Merkle/library exotic cells: type byte -> (bits, refs). Type 1 (pruned) has level > 0.
_EXOTIC_SHAPES = {2: (8 + 256, 0), 3: (8 + 256 + 16, 1), 4: (8 + 512 + 32, 2)}


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
# Cells


def _exotic_problem(data: bytes, bits: int, refs: tuple[Cell, ...]) -> str | None:
    if bits < 8:
        return "an exotic cell needs an 8-bit type"
    kind = data[0]
    if kind == 1:
        return "pruned branch cells have a non-zero level (unsupported)"
    shape = _EXOTIC_SHAPES.get(kind)
    if shape is None:
        return f"unknown exotic cell type {kind}"
    if (bits, len(refs)) != shape:
        return f"exotic type {kind} needs {shape[0]} bits and {shape[1]} refs"
    for i, child in enumerate(refs):  # Merkle cells store each child's hash and depth
        stored_hash = data[1 + 32 * i : 33 + 32 * i]
        at = 1 + 32 * len(refs) + 2 * i
        if stored_hash != child._hash or int.from_bytes(data[at : at + 2]) != child._depth:
            return f"Merkle cell's stored hash or depth of ref {i} does not match the ref"
    return None


class Cell:
    """An immutable cell of up to 1023 bits and 4 refs, with its hash and depth computed
    once at construction (children first, so no recursion on deep trees).

    ``data`` may be given with anything after the first ``bits`` bits; it is stored in the
    serialized form (completion tag added). Equality is by representation hash.
    """

    __slots__ = ("_bits", "_data", "_depth", "_exotic", "_hash", "_refs")

    _bits: int
    _data: bytes
    _depth: int
    _exotic: bool
    _hash: bytes
    _refs: tuple[Cell, ...]

    def __init__(
        self, data: bytes, bits: int, refs: Sequence[Cell] = (), *, exotic: bool = False
    ) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"Cell data must be bytes, got {type(data).__name__}")
        if not isinstance(bits, int) or not 0 <= bits <= MAX_CELL_BITS:
            raise ValueError(f"Cell bits must be in 0..={MAX_CELL_BITS}, got {bits!r}")
        if len(data) != (bits + 7) // 8:
            raise ValueError(f"{bits} bits need {(bits + 7) // 8} data bytes, got {len(data)}")
        ref_tuple = tuple(refs)
        if len(ref_tuple) > MAX_REFS:
            raise ValueError(f"a cell has at most {MAX_REFS} refs, got {len(ref_tuple)}")
        if not all(type(r) is Cell for r in ref_tuple):
            raise TypeError("Cell refs must be Cell values")
        payload = _normalize(bytes(data), bits)
        problem = _depth_problem(ref_tuple)
        if exotic and problem is None:
            problem = _exotic_problem(payload, bits, ref_tuple)
        if problem is not None:
            raise ValueError(problem)
        _init_cell(self, payload, bits, ref_tuple, bool(exotic))

    @property
    def data(self) -> bytes:
        return self._data

    @property
    def bits(self) -> int:
        return self._bits

    @property
    def refs(self) -> tuple[Cell, ...]:
        return self._refs

    @property
    def exotic(self) -> bool:
        return self._exotic

    @property
    def level(self) -> int:
        """The level mask; always 0, as cells with another level are rejected."""
        return 0

    @property
    def hash(self) -> bytes:
        """The 32-byte representation hash."""
        return self._hash

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def descriptor(self) -> bytes:
        """The two descriptor bytes d1, d2 (without the stored-hashes flag)."""
        bits = self._bits
        return bytes((len(self._refs) | (8 if self._exotic else 0), (bits >> 3) + (bits + 7 >> 3)))

    def iter_tree(self) -> Iterator[Cell]:
        """Each distinct cell of the tree once, parents before children."""
        seen = {self._hash}
        stack = [self]
        while stack:
            cell = stack.pop()
            yield cell
            for child in reversed(cell._refs):
                if child._hash not in seen:
                    seen.add(child._hash)
                    stack.append(child)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Cell):
            return NotImplemented
        return self._hash == other._hash

    def __hash__(self) -> int:
        return int.from_bytes(self._hash[:8])

    def __repr__(self) -> str:
        return f"Cell(bits={self._bits}, refs={len(self._refs)}, hash={self._hash.hex()})"


def _normalize(data: bytes, bits: int) -> bytes:
    rem = bits & 7
    if not rem:
        return data
    last = (data[-1] & (0xFF00 >> rem) & 0xFF) | (0x80 >> rem)
    return data[:-1] + bytes((last,))


def _depth_problem(refs: tuple[Cell, ...]) -> str | None:
    if refs and (depth := 1 + max(r._depth for r in refs)) > MAX_DEPTH:
        return f"cell depth {depth} exceeds {MAX_DEPTH}"
    return None


def _init_cell(cell: Cell, data: bytes, bits: int, refs: tuple[Cell, ...], exotic: bool) -> None:
    """Set the fields and compute hash and depth; the caller has validated everything."""
    head = bytes((len(refs) | (8 if exotic else 0), (bits >> 3) + (bits + 7 >> 3)))
    if refs:
        depth = 1 + max(r._depth for r in refs)
        depths = b"".join(r._depth.to_bytes(2) for r in refs)
        digest = _sha256(head + data + depths + b"".join(r._hash for r in refs)).digest()
    else:
        depth = 0
        digest = _sha256(head + data).digest()
    cell._data = data
    cell._bits = bits
    cell._refs = refs
    cell._exotic = exotic
    cell._hash = digest
    cell._depth = depth


def _trusted_cell(data: bytes, bits: int, refs: tuple[Cell, ...], exotic: bool) -> Cell:
    """A cell from already-normalized, already-checked data."""
    cell = Cell.__new__(Cell)
    _init_cell(cell, data, bits, refs, exotic)
    return cell


class CellBuilder:
    """Builds a cell bit by bit; every ``store_*`` returns the builder."""

    __slots__ = ("_acc", "_bits", "_refs")

    def __init__(self) -> None:
        self._acc = 0
        self._bits = 0
        self._refs: list[Cell] = []

    @property
    def bits(self) -> int:
        return self._bits

    @property
    def bits_left(self) -> int:
        return MAX_CELL_BITS - self._bits

    def store_uint(self, value: int, bits: int) -> CellBuilder:
        if bits < 0 or not 0 <= value < (1 << bits):
            raise ValueError(f"{value} does not fit in {bits} unsigned bits")
        if self._bits + bits > MAX_CELL_BITS:
            raise ValueError(f"cell overflow: {self._bits} + {bits} bits > {MAX_CELL_BITS}")
        self._acc = (self._acc << bits) | value
        self._bits += bits
        return self

    def store_int(self, value: int, bits: int) -> CellBuilder:
        if bits <= 0 or not -(1 << (bits - 1)) <= value < (1 << (bits - 1)):
            raise ValueError(f"{value} does not fit in {bits} signed bits")
        return self.store_uint(value & ((1 << bits) - 1), bits)

    def store_bit(self, bit: bool | int) -> CellBuilder:
        return self.store_uint(1 if bit else 0, 1)

    def store_bytes(self, data: bytes) -> CellBuilder:
        return self.store_uint(int.from_bytes(data), 8 * len(data))

    def store_ref(self, cell: Cell) -> CellBuilder:
        if type(cell) is not Cell:
            raise TypeError(f"store_ref needs a Cell, got {type(cell).__name__}")
        if len(self._refs) >= MAX_REFS:
            raise ValueError(f"a cell has at most {MAX_REFS} refs")
        self._refs.append(cell)
        return self

    def end(self) -> Cell:
        bits = self._bits
        pad = -bits & 7
        value = ((self._acc << 1 | 1) << (pad - 1)) if pad else self._acc
        refs = tuple(self._refs)
        if (problem := _depth_problem(refs)) is not None:
            raise ValueError(problem)
        return _trusted_cell(value.to_bytes((bits + 7) >> 3), bits, refs, False)


# ---------------------------------------------------------------------------------------------
# Decoding


class _Layout(NamedTuple):
    """A validated BOC: ``starts[i]`` is where cell i begins (``starts[-1]`` is the end of the
    cells); ``special`` maps each cell that has refs or is exotic to its ref indices."""

    buf: bytes
    roots: list[int]
    starts: list[int]
    special: dict[int, tuple[int, ...]]
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
    starts, special = _scan_cells(buf, cells_at, end, cells, ref_size)
    if has_idx:
        _check_index(buf, p + roots * ref_size, starts, off_size, bool(has_cache))
    return _Layout(buf, root_list, starts, special, ref_size)


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
    buf: bytes, p: int, end: int, count: int, ref_size: int
) -> tuple[list[int], dict[int, tuple[int, ...]]]:
    """Validate every cell's descriptor and bounds; the hot loop of every decode."""
    starts = [0] * (count + 1)
    special: dict[int, tuple[int, ...]] = {}
    for i in range(count):
        starts[i] = p
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
            special[i] = refs
            q += len(refs) * ref_size
        p = q
    starts[count] = p
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
    if d1 >> 5:
        raise BocError("cell level", p, f"cell {i} has level mask {d1 >> 5} (unsupported)")
    if q + nrefs * ref_size > end:
        raise BocError("cells size", q, f"cell {i} refs run past the total cells size")
    refs = tuple(_uint(buf, q + k * ref_size, ref_size) for k in range(nrefs))
    for k, ref in enumerate(refs):
        if ref >= count:
            raise BocError("ref range", q + k * ref_size, f"cell {i} refs {ref} >= {count}")
        if ref <= i:
            raise BocError("ref order", q + k * ref_size, f"cell {i} refs {ref} (not after it)")
    return refs


def _check_index(buf: bytes, at: int, starts: list[int], off_size: int, cache: bool) -> None:
    base = starts[0]
    for i in range(len(starts) - 1):
        entry = _uint(buf, at + i * off_size, off_size)
        if cache:
            entry >>= 1
        if entry != starts[i + 1] - base:
            raise BocError("index", at + i * off_size, f"index entry {i} is {entry}")


def _cell_at(layout: _Layout, i: int, built: dict[int, Cell]) -> Cell:
    buf, starts = layout.buf, layout.starts
    p = starts[i]
    d1, d2 = buf[p], buf[p + 1]
    q = p + 2 + ((d2 + 1) >> 1)
    bits = d2 * 4 if not d2 & 1 else (d2 - 1) * 4 + _TAG_BITS[buf[q - 1]]
    refs = tuple(built[r] for r in layout.special.get(i, ()))
    data = buf[p + 2 : q]
    if (problem := _depth_problem(refs)) is not None:
        raise BocError("cell depth", p, f"cell {i}: {problem}")
    if d1 & 8 and (problem := _exotic_problem(data, bits, refs)) is not None:
        raise BocError("exotic cell", p, f"cell {i}: {problem}")
    return _trusted_cell(data, bits, refs, bool(d1 & 8))


def _build_cells(layout: _Layout, wanted: Sequence[int]) -> dict[int, Cell]:
    """Cell objects for ``wanted`` and everything under them, built children first."""
    needed = set(wanted)
    stack = list(needed)
    special = layout.special
    while stack:
        for ref in special.get(stack.pop(), ()):
            if ref not in needed:
                needed.add(ref)
                stack.append(ref)
    built: dict[int, Cell] = {}
    for i in sorted(needed, reverse=True):
        built[i] = _cell_at(layout, i, built)
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
        if root._hash not in position:
            stack = [(root, iter(root._refs))]
            while stack:
                cell, children = stack[-1]
                for child in children:
                    if child._hash not in position:
                        stack.append((child, iter(child._refs)))
                        break
                else:
                    stack.pop()
                    position[cell._hash] = len(post)
                    post.append(cell)
        root_pos.append(position[root._hash])
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
        parts.append(cell._data)
        for child in cell._refs:
            parts.append((n - 1 - position[child._hash]).to_bytes(ref_size))
    return _assemble(n, [n - 1 - k for k in root_pos], b"".join(parts), ref_size)


# ---------------------------------------------------------------------------------------------
# Multi-root chunks: the import and export hot paths


class RootView(NamedTuple):
    """One root of a chunk: what the import stores per message."""

    hash: bytes
    data: bytes
    bits: int
    boc: bytes


def split_roots(data: bytes | memoryview, *, max_roots: int = 10_000) -> list[RootView]:
    """Decode a multi-root chunk (validated like :func:`decode_boc`) into one view per
    root, in root-list order; ``boc`` is a standalone one-root BOC of the root's tree."""
    layout = _parse(data, max_roots, None)
    buf, starts, special = layout.buf, layout.starts, layout.special
    slow = [r for r in layout.roots if r in special] if special else []
    built = _build_cells(layout, slow) if slow else {}
    views: dict[int, RootView] = {}
    headers, tag_bits, sha, new = _LEAF_HEADERS, _TAG_BITS, _sha256, _tuple_new
    out = []
    for r in layout.roots:
        if r in built:
            view = views.get(r)
            if view is None:
                cell = built[r]
                view = views[r] = new(
                    RootView, (cell.hash, cell.data, cell.bits, encode_boc([cell]))
                )
            out.append(view)
            continue
        st = starts[r]
        en = starts[r + 1]
        raw = buf[st:en]
        d2 = raw[1]
        bits = d2 * 4 if not d2 & 1 else (d2 - 1) * 4 + tag_bits[raw[-1]]
        out.append(new(RootView, (sha(raw).digest(), raw[2:], bits, headers[en - st] + raw)))
    return out


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


def join_roots(bocs: Sequence[bytes]) -> bytes:
    """One multi-root BOC holding the roots of the one-root BOCs ``bocs`` in order,
    identical cells stored once; byte-identical to tycho's encoder."""
    if not bocs:
        raise ValueError("join_roots needs at least one BOC")
    position: dict[bytes, int] = {}
    order = []
    leaf_of = _leaf_cell_of
    for boc in bocs:
        cell = leaf_of(boc)
        if cell is None:
            return encode_boc(_decode_each(bocs))
        order.append(position.setdefault(cell, len(position)))
    n = len(position)
    return _assemble(n, [n - 1 - k for k in order], b"".join(reversed(position)), _fit(n))


def _decode_each(bocs: Sequence[bytes]) -> list[Cell]:
    roots = []
    for k, boc in enumerate(bocs):
        try:
            roots.append(decode_boc(boc, max_roots=1)[0])
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
    refs = sum(len(r) for r in layout.special.values())
    return layout.starts[-1] - layout.starts[0] + (4 - layout.ref_size) * refs + 4
