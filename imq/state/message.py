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
``truncated`` (the cell ends inside the header; the message says in which field).

Speed: :func:`parse_internal_header` turns the cell into one int and reads every field
with a shift and a mask (about 1.2 us per call here, against 1.8 us for byte slicing);
only to explain a failure does it walk the header bit by bit (:func:`_diagnose`).
"""

from __future__ import annotations

from typing import Literal, NoReturn

from imq.state.boc import Cell, CellBuilder
from imq.types import Address

__all__ = [
    "MessageFormatError",
    "build_external_in_message",
    "build_internal_message",
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
    data: bytes, bits: int, refs: int | None = None
) -> tuple[int, int, bytes, int, bytes]:
    """``(created_lt, src_workchain, src_account, dst_workchain, dst_account)`` of an
    internal message cell given its data bytes and bit length. With ``refs``, the cell's
    number of references, a header that names more referenced cells than that (its
    extra currencies, a state init or a body "in a ref") is refused too: no such cell
    parses as a message (``field`` ``refs``)."""
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
        _check_refs(x, p, size - bits, extra_currencies, refs)
    return (
        lt,
        _I8[(head >> 523) & 255],
        ((head >> 267) & _MASK256).to_bytes(32, "big"),
        _I8[(head >> 256) & 255],
        (head & _MASK256).to_bytes(32, "big"),
    )


def _check_refs(x: int, p: int, pad: int, extra_currencies: int, refs: int) -> None:
    """Refuse a header that names more referenced cells than the cell has. ``p``: the
    shift of created_lt's lowest bit in ``x``; ``pad``: the bits below the cell's data.
    After created_at (32 bits) come init:(Maybe (Either StateInit ^StateInit)) and
    body:(Either X ^X); an init inline hides where the body starts, so neither its
    references nor the body's are counted then (a lower bound, never a false refusal)."""
    init = (x >> (p - 33)) & 1
    needed = extra_currencies
    if not init:
        needed += (x >> (p - 34)) & 1  # the body in a ref
    elif (x >> (p - 34)) & 1:  # the init in a ref, then the body's bit, when present
        needed += 1
        if p - 35 >= pad:
            needed += (x >> (p - 35)) & 1
    if needed > refs:
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
) -> Cell:
    """A valid ``int_msg_info$0`` message without init. The body (whole bytes) is inline
    when it fits and ``body_in_ref`` is not True, else a chain of ref cells of 127 bytes
    each, followed by ``extra_cells`` more filler cells."""
    builder = CellBuilder().store_uint(0, 1).store_bit(1).store_bit(bounce).store_bit(bounced)
    _store_std(builder, src)
    _store_std(builder, dst)
    _store_grams(builder, value)
    builder.store_bit(0)
    _store_grams(builder, ihr_fee)
    _store_grams(builder, fwd_fee)
    builder.store_uint(created_lt, 64).store_uint(created_at, 32).store_bit(0)
    return _store_body(builder, body, body_in_ref, extra_cells)


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
