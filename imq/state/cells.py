"""TON cells and their hashes.

Owns what a cell is: its data bits and refs, the exotic-cell rules (pruned branch,
library, Merkle proof, Merkle update) and the level-aware hashes and depths TON defines
for every cell (FORMAT.md §4). The bag-of-cells container is :mod:`imq.state.boc`.

``Cell.data`` is the serialized form: ``ceil(bits / 8)`` bytes, and when ``bits % 8 != 0``
the last byte carries the completion tag (a 1 bit, then zeros) after the data bits. That
is what a BOC stores and what the hashes cover, so a level-0 leaf's hash is
``sha256(d1 d2 data)`` with no conversion.

Levels, as TON defines them (they matter only for Merkle trees: real tycho blocks hold a
Merkle update whose subtrees end in pruned branches):

* A cell has a 3-bit level mask; level 0 is always significant, level ``i`` in 1..3 is
  significant when bit ``i - 1`` is set. There is one hash and one depth per significant
  level; ``get_hash(i)`` is that of the highest significant level ``<= i``, and the
  representation hash (:attr:`Cell.hash`) is that of the highest one.
* The mask of an ordinary cell is the OR of its refs' masks; of a Merkle proof or update,
  that OR shifted right by one; of a library cell, 0; of a pruned branch, its data byte 1.
* The hash at significant level ``i`` is ``sha256(d1 d2 X depths hashes)``: ``d1`` has the
  mask cut to the levels below ``i``; ``X`` is the data at the first significant level and
  the previous level's hash after that; ``depths`` (2 bytes each) and ``hashes`` are the
  refs' at level ``i``, or ``i + 1`` for Merkle cells. The depth is 1 + the largest of
  those depths, 0 without refs.
* A pruned branch stands for a cut-off subtree: its data is its type (1), its mask, then
  the pruned cell's hashes and depths at its significant levels below the top. Only its
  top hash is computed (from the data); the lower ones are read from the data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

__all__ = [
    "MAX_CELL_BITS",
    "MAX_DEPTH",
    "MAX_LEVEL",
    "MAX_REFS",
    "Cell",
    "CellBuilder",
    "CellError",
]

MAX_CELL_BITS = 1023
MAX_REFS = 4
MAX_DEPTH = 1024
MAX_LEVEL = 3
_sha256 = hashlib.sha256

PRUNED_BRANCH, LIBRARY, MERKLE_PROOF, MERKLE_UPDATE = 1, 2, 3, 4
# Exotic cell type -> (bits, refs) for the fixed-shape types; pruned branches vary.
_EXOTIC_SHAPES = {
    LIBRARY: (8 + 256, 0),
    MERKLE_PROOF: (8 + 256 + 16, 1),
    MERKLE_UPDATE: (8 + 512 + 32, 2),
}
# _HASH_INDEX[mask][level]: which of a cell's hashes (and depths) is its one at ``level``.
_HASH_INDEX = tuple(
    tuple((mask & ((1 << level) - 1)).bit_count() for level in range(MAX_LEVEL + 2))
    for mask in range(1 << MAX_LEVEL)
)


class CellError(ValueError):
    """An invalid cell. ``check`` names the rule: ``exotic cell``, ``cell depth`` or
    ``cell level``."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(detail)
        self.check = check


class Cell:
    """An immutable cell of up to 1023 bits and 4 refs, with its hashes and depths
    computed once at construction (children first, so no recursion on deep trees).

    ``data`` may be given with anything after the first ``bits`` bits; it is stored in the
    serialized form (completion tag added). Equality is by representation hash.
    """

    __slots__ = (
        "_bits",
        "_data",
        "_depth",
        "_depths",
        "_exotic",
        "_hash",
        "_hashes",
        "_mask",
        "_refs",
    )

    _bits: int
    _data: bytes
    _depth: int
    _depths: tuple[int, ...]
    _exotic: bool
    _hash: bytes
    _hashes: tuple[bytes, ...]
    _mask: int
    _refs: tuple[Cell, ...]

    def __init__(
        self, data: bytes, bits: int, refs: Sequence[Cell] = (), *, exotic: bool = False
    ) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"Cell data must be bytes, got {type(data).__name__}")
        _check_shape(data, bits, refs)
        _init_cell(self, _normalize(bytes(data), bits), bits, tuple(refs), bool(exotic))

    @classmethod
    def from_serialized(
        cls,
        data: bytes,
        bits: int,
        refs: tuple[Cell, ...] = (),
        *,
        exotic: bool = False,
        level_mask: int | None = None,
    ) -> Cell:
        """The cell a BOC stores as ``data`` (already serialized: completion tag present)
        with ``refs``; ``level_mask``, when given, must be the one the cell's rules give."""
        rem = bits & 7 if type(bits) is int else 0
        if (
            type(data) is not bytes
            or type(refs) is not tuple
            or not 0 <= bits <= MAX_CELL_BITS
            or len(data) != (bits + 7) >> 3
            or (rem and data[-1] & (0xFF >> rem) != 0x80 >> rem)
            or (refs and (len(refs) > MAX_REFS or any(type(r) is not Cell for r in refs)))
        ):  # one test on the decoder's path; the precise error when it fails
            if type(data) is not bytes or type(refs) is not tuple:
                raise TypeError("from_serialized takes bytes data and a tuple of refs")
            _check_shape(data, bits, refs)
            raise ValueError(f"the last data byte {data[-1]:#04x} lacks the completion tag")
        cell = Cell.__new__(Cell)
        _init_cell(cell, data, bits, refs, exotic)
        if level_mask is not None and level_mask != cell._mask:
            raise CellError(
                "cell level",
                f"level mask {level_mask} given, the refs and type give {cell._mask}",
            )
        return cell

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
    def level_mask(self) -> int:
        """The 3-bit mask of the cell's significant levels above 0."""
        return self._mask

    @property
    def level(self) -> int:
        """The highest significant level (0..3)."""
        return self._mask.bit_length()

    @property
    def hash(self) -> bytes:
        """The 32-byte representation hash (the hash at the highest level)."""
        return self._hash

    @property
    def depth(self) -> int:
        """The representation depth (the depth at the highest level)."""
        return self._depth

    def get_hash(self, level: int) -> bytes:
        """The hash at ``level`` (0..3)."""
        return self._hashes[_HASH_INDEX[self._mask][_level_arg(level)]]

    def get_depth(self, level: int) -> int:
        """The depth at ``level`` (0..3)."""
        return self._depths[_HASH_INDEX[self._mask][_level_arg(level)]]

    @property
    def descriptor(self) -> bytes:
        """The two descriptor bytes d1, d2 (without the stored-hashes flag)."""
        bits = self._bits
        d1 = len(self._refs) | (8 if self._exotic else 0) | self._mask << 5
        return bytes((d1, (bits >> 3) + (bits + 7 >> 3)))

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
        level = f", level_mask={self._mask}" if self._mask else ""
        return f"Cell(bits={self._bits}, refs={len(self._refs)}{level}, hash={self._hash.hex()})"


def _level_arg(level: int) -> int:
    if type(level) is not int or not 0 <= level <= MAX_LEVEL:
        raise ValueError(f"a cell level is in 0..={MAX_LEVEL}, got {level!r}")
    return level


def _check_shape(data: bytes | bytearray | memoryview, bits: int, refs: Sequence[Cell]) -> None:
    if type(bits) is not int or not 0 <= bits <= MAX_CELL_BITS:
        raise ValueError(f"Cell bits must be in 0..={MAX_CELL_BITS}, got {bits!r}")
    if len(data) != (bits + 7) >> 3:
        raise ValueError(f"{bits} bits need {(bits + 7) >> 3} data bytes, got {len(data)}")
    if len(refs) > MAX_REFS:
        raise ValueError(f"a cell has at most {MAX_REFS} refs, got {len(refs)}")
    for ref in refs:
        if type(ref) is not Cell:
            raise TypeError(f"Cell refs must be Cell values, got {type(ref).__name__}")


def _normalize(data: bytes, bits: int) -> bytes:
    rem = bits & 7
    if not rem:
        return data
    last = (data[-1] & (0xFF00 >> rem) & 0xFF) | (0x80 >> rem)
    return data[:-1] + bytes((last,))


def _exotic_problem(data: bytes, bits: int, refs: tuple[Cell, ...]) -> str | None:
    if bits < 8:
        return "an exotic cell needs an 8-bit type"
    kind = data[0]
    if kind == PRUNED_BRANCH:
        return _pruned_problem(data, bits, refs)
    shape = _EXOTIC_SHAPES.get(kind)
    if shape is None:
        return f"unknown exotic cell type {kind}"
    if (bits, len(refs)) != shape:
        return f"exotic type {kind} needs {shape[0]} bits and {shape[1]} refs"
    for i, child in enumerate(refs):  # Merkle cells store each child's level-0 hash and depth
        stored_hash = data[1 + 32 * i : 33 + 32 * i]
        at = 1 + 32 * len(refs) + 2 * i
        if stored_hash != child._hashes[0] or int.from_bytes(data[at : at + 2]) != child._depths[0]:
            return f"Merkle cell's stored hash or depth of ref {i} does not match the ref"
    return None


def _pruned_problem(data: bytes, bits: int, refs: tuple[Cell, ...]) -> str | None:
    if refs:
        return "a pruned branch has no refs"
    if bits < 16 or not 1 <= data[1] < 1 << MAX_LEVEL:
        return "a pruned branch needs a level mask in 1..=7 after its type"
    stored = data[1].bit_count()
    if bits != 16 + stored * (256 + 16):
        return f"a pruned branch of level mask {data[1]} needs {16 + stored * 272} bits"
    return None


def _init_cell(cell: Cell, data: bytes, bits: int, refs: tuple[Cell, ...], exotic: bool) -> None:
    """Check the exotic rules and the depth, set the fields and the hashes; the caller
    has checked the shape and serialized the data."""
    if exotic and (problem := _exotic_problem(data, bits, refs)) is not None:
        raise CellError("exotic cell", problem)
    mask = 0
    for ref in refs:
        mask |= ref._mask
    if mask or (exotic and data[0] == PRUNED_BRANCH):
        mask, hashes, depths = _level_hashes(data, bits, refs, exotic)
        depth = max(depths)
    else:  # level 0 with level-0 refs: one hash, as for every message cell
        head = bytes((len(refs) | (8 if exotic else 0), (bits >> 3) + (bits + 7 >> 3)))
        if refs:
            depth = 1 + max([r._depth for r in refs])
            depth_bytes = b"".join([r._depth.to_bytes(2) for r in refs])
            digest = _sha256(head + data + depth_bytes + b"".join([r._hash for r in refs]))
        else:
            depth = 0
            digest = _sha256(head + data)
        hashes = (digest.digest(),)
        depths = (depth,)
    if depth > MAX_DEPTH:
        raise CellError("cell depth", f"cell depth {depth} exceeds {MAX_DEPTH}")
    _set_fields(cell, data, bits, refs, exotic, mask, hashes, depths)


def _set_fields(  # noqa: PLR0917 - every field of a cell
    cell: Cell,
    data: bytes,
    bits: int,
    refs: tuple[Cell, ...],
    exotic: bool,
    mask: int,
    hashes: tuple[bytes, ...],
    depths: tuple[int, ...],
) -> None:
    cell._data = data
    cell._bits = bits
    cell._refs = refs
    cell._exotic = exotic
    cell._mask = mask
    cell._hashes = hashes
    cell._depths = depths
    cell._hash = hashes[-1]
    cell._depth = depths[-1]


def hashed_cell(data: bytes, bits: int, refs: tuple[Cell, ...], digest: bytes, depth: int) -> Cell:
    """An ordinary cell of level 0 whose shape, refs, hash and depth a decoder has
    checked and computed already (:mod:`imq.state.boc`'s compact table): built without
    hashing it again. Not for anything else: nothing here is checked."""
    cell = Cell.__new__(Cell)
    _set_fields(cell, data, bits, refs, False, 0, (digest,), (depth,))
    return cell


def _level_hashes(
    data: bytes, bits: int, refs: tuple[Cell, ...], exotic: bool
) -> tuple[int, tuple[bytes, ...], tuple[int, ...]]:
    """The level mask and the hashes and depths at each significant level."""
    d2 = (bits >> 3) + (bits + 7 >> 3)
    kind = data[0] if exotic else 0
    if kind == PRUNED_BRANCH:
        mask = data[1]
        stored = mask.bit_count()
        hashes = [data[2 + 32 * k : 34 + 32 * k] for k in range(stored)]
        hashes.append(_sha256(bytes((8 | mask << 5, d2)) + data).digest())
        at = 2 + 32 * stored
        depths = [int.from_bytes(data[at + 2 * k : at + 2 * k + 2]) for k in range(stored)]
        return mask, tuple(hashes), (*depths, 0)
    shift = 1 if kind in (MERKLE_PROOF, MERKLE_UPDATE) else 0
    mask = 0
    for ref in refs:
        mask |= ref._mask
    mask >>= shift
    d1 = len(refs) | (8 if exotic else 0)
    hashes, depths = [], []
    for level in range(mask.bit_length() + 1):
        if level and not mask >> (level - 1) & 1:
            continue
        at = level + shift
        ref_depths = [r._depths[_HASH_INDEX[r._mask][at]] for r in refs]
        ref_hashes = [r._hashes[_HASH_INDEX[r._mask][at]] for r in refs]
        head = bytes((d1 | (mask & ((1 << level) - 1)) << 5, d2))
        body = hashes[-1] if hashes else data
        depth_bytes = b"".join([d.to_bytes(2) for d in ref_depths])
        hashes.append(_sha256(head + body + depth_bytes + b"".join(ref_hashes)).digest())
        depths.append(1 + max(ref_depths) if refs else 0)
    return mask, tuple(hashes), tuple(depths)


class CellBuilder:
    """Builds an ordinary cell bit by bit; every ``store_*`` returns the builder."""

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
        cell = Cell.__new__(Cell)
        _init_cell(cell, value.to_bytes((bits + 7) >> 3), bits, tuple(self._refs), False)
        return cell
