"""The header of a message cell (FORMAT.md §7): a fast parser for the import, and
builders of valid and deliberately invalid messages for tests and synthetic states.

Header of ``int_msg_info$0`` (bit offsets from the start of the cell)::

    0     0                        tag
    1     ihr_disabled bounce bounced
    4     src  addr_std$10 anycast:0 workchain:int8 account:bits256   (267 bits)
    271   dst  addr_std$10 anycast:0 workchain:int8 account:bits256   (267 bits)
    538   value:Grams (len:uint4, len bytes) extra_currencies:(Maybe ^Cell)
          ihr_fee:Grams fwd_fee:Grams created_lt:uint64 created_at:uint32
          init:(Maybe ...) body:(Either X ^X)   -- at least 2 more bits

``MessageFormatError.field`` names what is wrong: ``info`` (not an internal message),
``src`` or ``dst`` (not ``addr_std``, or an anycast prefix: imq addresses are std only),
``truncated`` (the cell ends inside the header; the message says in which field); with
the cell's reference count given, also ``init`` (the cell ends inside the init or before
the body's bit, or an init in a ref is no ``StateInit``) and ``refs`` (the header, init
and body name more referenced cells than the cell has).

Speed: :func:`parse_internal_header` turns the cell into one int and reads every field
with a shift and a mask (about 1.2 us per call here, against 1.8 us for byte slicing);
only to explain a failure does it walk the header bit by bit (:func:`_diagnose`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NoReturn

from imq.state.boc import Cell, CellBuilder
from imq.types import Address

__all__ = [
    "MessageFormatError",
    "build_external_in_message",
    "build_internal_message",
    "build_state_init",
    "build_message_with_var_address",
    "parse_internal_header",
]

_MASK64 = (1 << 64) - 1
_MASK256 = (1 << 256) - 1
_I8 = tuple(range(128)) + tuple(range(-128, 0))
_VALUE_AT = 538
_from_bytes = int.from_bytes
_BODY_BYTES_PER_CELL = 127


class MessageFormatError(ValueError):
    """A message cell is not an internal message with std addresses. ``field`` names the
    part that is wrong; the message text says how."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(detail)
        self.field = field
        self.detail = detail


def parse_internal_header(
    data: bytes, bits: int, refs: int | None = None, children: Sequence[Cell] = ()
) -> tuple[int, int, bytes, int, bytes]:
    """``(created_lt, src_workchain, src_account, dst_workchain, dst_account)`` of an
    internal message cell given its data bytes and bit length.

    With ``refs``, the cell's number of references, what follows the header is checked
    as the node parses it: ``init:(Maybe (Either StateInit ^StateInit))`` then
    ``body:(Either X ^X)``. A cell that ends inside them (``field`` ``init``), or whose
    header, init and body name more referenced cells than it has (``field`` ``refs``),
    is no message. ``children``, the cell's references when the caller has them, lets
    an init "in a ref" be checked the same way (``field`` ``init``); without them only
    its presence is counted."""
    size = len(data) * 8
    try:
        x = _from_bytes(data, "big")
        p = size - 542  # shift that brings the value's len:uint4 to the lowest bits
        p -= ((x >> p) & 15) * 8 + 5  # skip value and the extra-currencies bit
        extra_currencies = (x >> (p + 4)) & 1  # Maybe ^Cell: the bit before ihr_fee
        p -= ((x >> p) & 15) * 8 + 4  # skip ihr_fee
        p -= ((x >> p) & 15) * 8 + 64  # skip fwd_fee
        lt = (x >> p) & _MASK64
        head = x >> (size - _VALUE_AT)  # info, src and dst: 538 bits
    except ValueError:  # a negative shift: the cell is too short
        p = size
        head = 0
        extra_currencies = 0
    # tag 0 and src "10" + anycast 0; dst "10" + anycast 0; then created_at, init, body
    if (head >> 531) & 0x47 != 0x04 or (head >> 264) & 7 != 4 or not size - p + 34 <= bits <= size:
        _diagnose(data, bits)
    if refs is not None:
        if (x >> (p - 33)) & 1:  # an init: walk it (rare; the common case is two bits)
            _check_init_and_body(x, p - 34, size - bits, extra_currencies, refs, children)
        elif extra_currencies + ((x >> (p - 34)) & 1) > refs:  # the body's bit: in a ref
            _refuse_refs(extra_currencies + ((x >> (p - 34)) & 1), refs)
    return (
        lt,
        _I8[(head >> 523) & 255],
        ((head >> 267) & _MASK256).to_bytes(32, "big"),
        _I8[(head >> 256) & 255],
        (head & _MASK256).to_bytes(32, "big"),
    )


def _check_init_and_body(  # noqa: PLR0917 - the parser's state
    x: int, s: int, pad: int, named: int, refs: int, children: Sequence[Cell]
) -> None:
    """Walk an init and the body's bit from shift ``s`` (the init's Either bit) down to
    ``pad`` (the bits below the cell's data), counting the references they name after
    the ``named`` ones before them."""
    if (x >> s) & 1:  # ^StateInit: the next reference
        if named < len(children):
            _check_state_init(children[named])
        named += 1
        s -= 1
    else:
        named, s = _walk_state_init(x, s - 1, pad, named, "the cell")
    if s < pad:
        raise MessageFormatError("init", "the cell ends before the body's bit: not a message")
    named += (x >> s) & 1  # the body in a ref
    if named > refs:
        _refuse_refs(named, refs)


def _walk_state_init(x: int, s: int, pad: int, named: int, where: str) -> tuple[int, int]:
    """Read a ``StateInit`` (split_depth:(Maybe (## 5)) special:(Maybe TickTock)
    code:(Maybe ^Cell) data:(Maybe ^Cell) library:(Maybe ^Cell)) from shift ``s``:
    (the references named so far, the shift after it). The library dictionary's root is
    a reference the node loads lazily; its contents are not parsed, nor the code's.
    ``where`` names the cell in an error. A split_depth or special value cut short is
    found at the next Maybe bit, which is always read."""
    for width in (5, 2):  # split_depth, special: a Maybe bit, then the value
        if s < pad:
            _init_ends(where)
        s -= 1 + width if (x >> s) & 1 else 1
    for _ in range(3):  # code, data, library: Maybe ^Cell
        if s < pad:
            _init_ends(where)
        named += (x >> s) & 1
        s -= 1
    return named, s


def _check_state_init(cell: Cell) -> None:
    """An init "in a ref" is an ordinary cell holding a whole ``StateInit``."""
    if cell.exotic:
        raise MessageFormatError("init", "the init's cell is exotic, not a StateInit")
    data, bits = cell.data, cell.bits
    size = len(data) * 8
    named, _ = _walk_state_init(
        _from_bytes(data, "big"), size - 1, size - bits, 0, "the init's cell"
    )
    if named > len(cell.refs):
        raise MessageFormatError(
            "init",
            f"the init names {named} referenced cells (code, data, library), its cell has "
            f"{len(cell.refs)}: not a StateInit",
        )


def _init_ends(where: str) -> NoReturn:
    raise MessageFormatError("init", f"{where} ends inside the StateInit: not a message")


def _refuse_refs(needed: int, refs: int) -> NoReturn:
    raise MessageFormatError(
        "refs",
        f"the header names {needed} referenced cell{'s' if needed != 1 else ''} (extra "
        f"currencies, init, body in a ref), the cell has {refs}: not a message",
    )


class _Bits:
    """A bit reader that names the field being read when the cell runs out."""

    def __init__(self, data: bytes, bits: int) -> None:
        self.size = bits
        self.value = int.from_bytes(data) >> (8 * len(data) - self.size)
        self.pos = 0

    def read(self, width: int, field: str) -> int:
        end = self.pos + width
        if end > self.size:
            raise MessageFormatError(
                "truncated", f"the cell ends in {field} (needs bit {end}, has {self.size} bits)"
            )
        self.pos = end
        return (self.value >> (self.size - end)) & ((1 << width) - 1)


def _diagnose(data: bytes, bits: int) -> NoReturn:
    """Walk the header and raise the precise error (called only on a failed fast path)."""
    if not 0 <= bits <= 8 * len(data):
        raise ValueError(f"{bits} bits do not fit in {len(data)} data bytes")
    reader = _Bits(data, bits)
    if reader.read(1, "info"):
        raise MessageFormatError("info", "info is not int_msg_info$0 (not an internal message)")
    reader.read(3, "info flags")
    for field in ("src", "dst"):
        tag = reader.read(2, field)
        if tag != 0b10:
            kinds = {0: "addr_none", 1: "addr_extern", 3: "addr_var"}
            raise MessageFormatError(field, f"{field} is {kinds[tag]}, not addr_std")
        if reader.read(1, field):
            raise MessageFormatError(field, f"{field} has an anycast prefix (unsupported)")
        reader.read(8 + 256, field)
    for field in ("value", "ihr_fee", "fwd_fee"):
        reader.read(8 * reader.read(4, field), field)
        if field == "value":
            reader.read(1, "value")
    reader.read(64, "created_lt")
    reader.read(32, "created_at")
    reader.read(2, "init and body")
    raise MessageFormatError("truncated", "malformed header")  # unreachable for valid input


# ---------------------------------------------------------------------------------------------
# Builders


def _store_std(builder: CellBuilder, address: Address) -> None:
    if type(address) is not Address:
        raise TypeError(f"expected an Address, got {type(address).__name__}")
    builder.store_uint(0b100, 3).store_int(address.workchain, 8).store_bytes(address.account)


def _store_grams(builder: CellBuilder, amount: int) -> None:
    size = (amount.bit_length() + 7) // 8
    if amount < 0 or size > 15:
        raise ValueError(f"Grams amount {amount} not in 0..2**120")
    builder.store_uint(size, 4).store_uint(amount, 8 * size)


def _filler(k: int) -> bytes:
    """127 bytes unique to ``k``: extra body cells are never deduplicated."""
    return (k.to_bytes(4) * 32)[:_BODY_BYTES_PER_CELL]


def _body_chain(body: bytes, extra_cells: int) -> Cell:
    step = _BODY_BYTES_PER_CELL
    chunks = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
    chunks += [_filler(k) for k in range(extra_cells)]
    cell: Cell | None = None
    for chunk in reversed(chunks):
        builder = CellBuilder().store_bytes(chunk)
        if cell is not None:
            builder.store_ref(cell)
        cell = builder.end()
    assert cell is not None
    return cell


def _store_body(
    builder: CellBuilder, body: bytes, body_in_ref: bool | None, extra_cells: int
) -> Cell:
    if extra_cells < 0:
        raise ValueError(f"extra_cells must be >= 0, got {extra_cells}")
    fits = 1 + 8 * len(body) <= builder.bits_left
    if body_in_ref is False and (extra_cells or not fits):
        raise ValueError("the body does not fit inline (or extra cells were asked for)")
    if body_in_ref or extra_cells or not fits:
        builder.store_bit(1).store_ref(_body_chain(body, extra_cells))
    else:
        builder.store_bit(0).store_bytes(body)
    return builder.end()


def build_internal_message(
    src: Address,
    dst: Address,
    created_lt: int,
    *,
    value: int = 0,
    created_at: int = 0,
    bounce: bool = False,
    bounced: bool = False,
    ihr_fee: int = 0,
    fwd_fee: int = 0,
    body: bytes = b"",
    body_in_ref: bool | None = None,
    extra_cells: int = 0,
    init: Cell | None = None,
    init_in_ref: bool = False,
) -> Cell:
    """A valid ``int_msg_info$0`` message. The body (whole bytes) is inline when it fits
    and ``body_in_ref`` is not True, else a chain of ref cells of 127 bytes each,
    followed by ``extra_cells`` more filler cells. ``init``, a ``StateInit`` cell (not
    checked), is written inline (its bits and references) unless ``init_in_ref``."""
    builder = CellBuilder().store_uint(0, 1).store_bit(1).store_bit(bounce).store_bit(bounced)
    _store_std(builder, src)
    _store_std(builder, dst)
    _store_grams(builder, value)
    builder.store_bit(0)
    _store_grams(builder, ihr_fee)
    _store_grams(builder, fwd_fee)
    builder.store_uint(created_lt, 64).store_uint(created_at, 32)
    if init is None:
        builder.store_bit(0)
    elif init_in_ref:
        builder.store_bit(1).store_bit(1).store_ref(init)
    else:
        builder.store_bit(1).store_bit(0)
        builder.store_uint(_from_bytes(init.data) >> (len(init.data) * 8 - init.bits), init.bits)
        for ref in init.refs:
            builder.store_ref(ref)
    return _store_body(builder, body, body_in_ref, extra_cells)


def build_state_init(
    *, split_depth: int | None = None, special: int | None = None, refs: Sequence[Cell] = ()
) -> Cell:
    """A ``StateInit`` cell: ``split_depth`` (5 bits) and ``special`` (tick-tock, 2 bits)
    when given, then code, data and library, each present when ``refs`` holds a cell
    for it (in that order, up to three)."""
    if len(refs) > 3:
        raise ValueError(f"a StateInit holds at most 3 references, got {len(refs)}")
    builder = CellBuilder()
    for value, width in ((split_depth, 5), (special, 2)):
        if value is None:
            builder.store_bit(0)
        else:
            builder.store_bit(1).store_uint(value, width)
    for i in range(3):
        builder.store_bit(i < len(refs))
    for ref in refs:
        builder.store_ref(ref)
    return builder.end()


def build_external_in_message(dst: Address, *, import_fee: int = 0, body: bytes = b"") -> Cell:
    """An ``ext_in_msg_info$10`` message from ``addr_none``: never valid in a queue state."""
    builder = CellBuilder().store_uint(0b10, 2).store_uint(0b00, 2)
    _store_std(builder, dst)
    _store_grams(builder, import_fee)
    builder.store_bit(0)
    return _store_body(builder, body, None, 0)


def build_message_with_var_address(
    src: Address,
    dst: Address,
    created_lt: int,
    *,
    field: Literal["src", "dst"] = "src",
    anycast: bool = False,
) -> Cell:
    """An internal message whose ``field`` address is ``addr_var$11`` (or, with
    ``anycast``, ``addr_std`` with an anycast prefix): never valid in a queue state."""
    if field not in ("src", "dst"):
        raise ValueError(f"field must be 'src' or 'dst', got {field!r}")
    builder = CellBuilder().store_uint(0b0100, 4)
    for name, address in (("src", src), ("dst", dst)):
        if name != field:
            _store_std(builder, address)
        elif anycast:  # anycast_info depth:(#<= 30) = 1, rewrite_pfx:(bits 1)
            builder.store_uint(0b10, 2).store_bit(1).store_uint(1, 5).store_bit(1)
            builder.store_int(address.workchain, 8).store_bytes(address.account)
        else:  # addr_var$11 anycast:0 addr_len:(## 9) workchain_id:int32 address:bits
            builder.store_uint(0b11, 2).store_bit(0).store_uint(256, 9)
            builder.store_int(address.workchain, 32).store_bytes(address.account)
    _store_grams(builder, 0)
    builder.store_bit(0)
    _store_grams(builder, 0)
    _store_grams(builder, 0)
    builder.store_uint(created_lt, 64).store_uint(0, 32).store_bit(0)
    return _store_body(builder, b"", None, 0)
