"""The message header parser and builders (imq.state.message), checked against the real
tycho messages and against pytoniq-core's TL-B message parser and serializer."""

from __future__ import annotations

import functools
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pytoniq_core import Address as PAddress
from pytoniq_core import Builder as PBuilder
from pytoniq_core import Cell as PCell
from pytoniq_core.tlb.account import StateInit
from pytoniq_core.tlb.block import CurrencyCollection, ExtraCurrencyCollection
from pytoniq_core.tlb.transaction import InternalMsgInfo, MessageAny
from tycho_data import TYCHO

from imq.state.boc import Cell, CellBuilder, decode_boc, encode_boc, split_roots
from imq.state.message import (
    MessageFormatError,
    build_external_in_message,
    build_internal_message,
    build_message_with_var_address,
    parse_internal_header,
)
from imq.types import Address

A = Address(0, bytes(range(32)))
B = Address(-1, b"\xfe" * 32)
C = Address(-128, b"\x80" + bytes(31))
accounts = st.builds(Address, st.integers(-128, 127), st.binary(min_size=32, max_size=32))
grams = st.one_of(st.integers(0, 300), st.integers(0, 2**120 - 1))


@functools.cache
def real_chunk() -> bytes:
    """The only message chunk of ``shard.bin``: its last bigBytes item (FORMAT.md §3)."""
    data = (TYCHO / "persistent_state" / "shard.bin").read_bytes()
    size = 399_915  # the README's chunk size; its u32 length sits right before the chunk
    at = len(data) - size - (-size % 4)
    assert struct.unpack_from("<I", data, at - 4)[0] == size
    return data[at : at + size]


def parse(cell: Cell) -> tuple[int, int, bytes, int, bytes]:
    return parse_internal_header(cell.data, cell.bits)


def pytoniq_info(cell: Cell | PCell) -> InternalMsgInfo:
    pcell = cell if isinstance(cell, PCell) else PCell.one_from_boc(encode_boc([cell]))
    info = MessageAny.deserialize(pcell.begin_parse()).info
    assert isinstance(info, InternalMsgInfo)
    return info


def fails(cell: Cell, field: str) -> MessageFormatError:
    with pytest.raises(MessageFormatError) as info:
        parse(cell)
    assert info.value.field == field, info.value
    return info.value


def body_bytes(cell: Cell) -> bytes:
    """The bytes of a body stored as a snake of ref cells."""
    out = b""
    current: Cell | None = cell
    while current is not None:
        out += current.data
        current = current.refs[0] if current.refs else None
    return out


# ---------------------------------------------------------------------------------------------
# the real messages


def test_every_real_message_matches_pytoniq() -> None:
    chunk = real_chunk()
    views = split_roots(chunk)
    theirs = PCell.from_boc(chunk)
    assert len(views) == len(theirs) == 4300
    lts = set()
    for view, their in zip(views, theirs, strict=True):
        info = pytoniq_info(their)
        expected = (info.created_lt, info.src.wc, info.src.hash_part)
        expected += (info.dest.wc, info.dest.hash_part)
        assert parse_internal_header(view.data, view.bits) == expected
        assert parse_internal_header(view.data, view.bits, view.refs) == expected
        lts.add(info.created_lt)
    assert len(lts) < 4300  # created_lt is not unique (FORMAT.md §8.5)


# ---------------------------------------------------------------------------------------------
# the builder against pytoniq


def pytoniq_new_info(
    src: Address,
    dst: Address,
    lt: int,
    *,
    value: int,
    at: int,
    bounce: bool = False,
    extra: dict[int, int] | None = None,
) -> InternalMsgInfo:
    return InternalMsgInfo(
        ihr_disabled=True,
        bounce=bounce,
        bounced=False,
        src=PAddress((src.workchain, src.account)),
        dest=PAddress((dst.workchain, dst.account)),
        value=CurrencyCollection(value, ExtraCurrencyCollection(extra) if extra else None),
        ihr_fee=0,
        fwd_fee=0,
        created_lt=lt,
        created_at=at,
    )


def pytoniq_message(
    src: Address, dst: Address, lt: int, *, value: int, at: int, bounce: bool, body: PCell
) -> PCell:
    info = pytoniq_new_info(src, dst, lt, value=value, at=at, bounce=bounce)
    return MessageAny(info, None, body).serialize()


@pytest.mark.parametrize(
    ("value", "body"),
    [(0, b""), (1, b"hi"), (10**9, b"x" * 40), (2**120 - 1, b"y" * 100), (5, b"z" * 300)],
)
def test_built_message_hash_matches_pytoniq(value: int, body: bytes) -> None:
    ours = build_internal_message(A, B, 123_456, value=value, created_at=77, bounce=True, body=body)
    if ours.refs:
        their_body = PCell.one_from_boc(encode_boc([ours.refs[0]]))
    else:
        their_body = PBuilder().store_bytes(body).end_cell()
    theirs = pytoniq_message(A, B, 123_456, value=value, at=77, bounce=True, body=their_body)
    assert ours.hash == theirs.hash
    assert parse(ours) == (123_456, 0, A.account, -1, B.account)


@given(
    src=accounts,
    dst=accounts,
    lt=st.integers(0, 2**64 - 1),
    at=st.integers(0, 2**32 - 1),
    value=grams,
    ihr_fee=grams,
    fwd_fee=grams,
    bounce=st.booleans(),
    body=st.binary(max_size=200),
    body_in_ref=st.sampled_from([None, True]),
)
def test_header_fields_round_trip(
    *,
    src: Address,
    dst: Address,
    lt: int,
    at: int,
    value: int,
    ihr_fee: int,
    fwd_fee: int,
    bounce: bool,
    body: bytes,
    body_in_ref: bool | None,
) -> None:
    cell = build_internal_message(
        src,
        dst,
        lt,
        value=value,
        created_at=at,
        bounce=bounce,
        ihr_fee=ihr_fee,
        fwd_fee=fwd_fee,
        body=body,
        body_in_ref=body_in_ref,
    )
    assert parse(cell) == (lt, src.workchain, src.account, dst.workchain, dst.account)
    info = pytoniq_info(cell)
    assert (info.value_coins, info.ihr_fee, info.fwd_fee) == (value, ihr_fee, fwd_fee)
    assert (info.created_lt, info.created_at, info.bounce) == (lt, at, bounce)
    assert (info.src.wc, info.src.hash_part) == src
    assert (info.dest.wc, info.dest.hash_part) == dst
    assert decode_boc(encode_boc([cell]))[0].hash == cell.hash


def test_longest_grams_and_extreme_fields() -> None:
    top = 2**120 - 1
    cell = build_internal_message(
        C, B, 2**64 - 1, value=top, ihr_fee=top, fwd_fee=top, created_at=2**32 - 1
    )
    assert cell.bits == 4 + 2 * 267 + 3 * (4 + 120) + 1 + 64 + 32 + 2
    assert parse(cell) == (2**64 - 1, -128, C.account, -1, B.account)
    with pytest.raises(ValueError):
        build_internal_message(A, B, 1, value=2**120)
    with pytest.raises(ValueError):
        build_internal_message(A, B, 1, fwd_fee=-1)


def test_bodies_in_ref_chains() -> None:
    big = bytes(range(256)) * 8
    chained = build_internal_message(A, B, 9, body=big)
    assert len(chained.refs) == 1 and chained.depth == 17  # 2048 bytes in 127-byte cells
    assert body_bytes(chained.refs[0]) == big
    padded = build_internal_message(A, B, 9, body=b"abc", extra_cells=4)
    assert padded.depth == 5 and body_bytes(padded.refs[0])[:3] == b"abc"
    assert len({c.hash for c in padded.iter_tree()}) == 6
    in_ref = build_internal_message(A, B, 9, body=b"abc", body_in_ref=True)
    assert in_ref.refs[0].data == b"abc" and in_ref.depth == 1
    inline = build_internal_message(A, B, 9, body=b"abc")
    assert not inline.refs and inline.bits == 4 + 2 * 267 + 4 + 1 + 4 + 4 + 64 + 32 + 2 + 24
    for cell in (chained, padded, in_ref, inline):
        assert parse(cell)[0] == 9
        assert len(encode_boc([cell])) > 0 and pytoniq_info(cell).created_lt == 9
    with pytest.raises(ValueError):
        build_internal_message(A, B, 9, body=big, body_in_ref=False)
    with pytest.raises(ValueError):
        build_internal_message(A, B, 9, extra_cells=1, body_in_ref=False)
    with pytest.raises(ValueError):
        build_internal_message(A, B, 9, extra_cells=-1)
    with pytest.raises(TypeError):
        build_internal_message((0, bytes(32)), B, 9)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# rejected messages


def test_external_messages_are_not_internal() -> None:
    ext_in = build_external_in_message(B, import_fee=5, body=b"ping")
    assert fails(ext_in, "info").detail.startswith("info is not int_msg_info")
    ext_out = (
        CellBuilder()
        .store_uint(0b11, 2)
        .store_uint(0b100, 3)
        .store_int(0, 8)
        .store_bytes(A.account)
        .store_uint(0, 2)
        .store_uint(5, 64)
        .store_uint(0, 32)
        .store_uint(0, 2)
        .end()
    )
    fails(ext_out, "info")


@pytest.mark.parametrize("field", ["src", "dst"])
def test_var_and_anycast_addresses_name_the_field(field: str) -> None:
    var = build_message_with_var_address(A, B, 5, field=field)  # type: ignore[arg-type]
    assert f"{field} is addr_var" in str(fails(var, field))
    anycast = build_message_with_var_address(A, B, 5, field=field, anycast=True)  # type: ignore[arg-type]
    assert "anycast" in str(fails(anycast, field))
    info = pytoniq_info(anycast)  # still valid TL-B: pytoniq reads the anycast prefix
    address = info.src if field == "src" else info.dest
    assert address.anycast is not None and address.hash_part == (A if field == "src" else B)[1]
    with pytest.raises(ValueError):
        build_message_with_var_address(A, B, 5, field="value")  # type: ignore[arg-type]


@pytest.mark.parametrize(("tag", "name"), [(0b00, "addr_none"), (0b01, "addr_extern")])
def test_external_address_kinds_in_src(tag: int, name: str) -> None:
    cell = CellBuilder().store_uint(0b0000, 4).store_uint(tag, 2).store_uint(0, 600).end()
    assert f"src is {name}" in str(fails(cell, "src"))


def test_every_truncated_header_is_reported() -> None:
    cell = build_internal_message(A, B, 7, value=10**9, fwd_fee=300, body=b"tail")
    end = 4 + 2 * 267 + (4 + 32) + 1 + 4 + (4 + 16) + 64 + 32 + 2
    assert parse_internal_header(cell.data[: (end + 7) // 8], end)[0] == 7
    for bits in range(end):
        data = cell.data[: (bits + 7) // 8]
        with pytest.raises(MessageFormatError) as info:
            parse_internal_header(data, bits)
        assert info.value.field == "truncated" and "the cell ends in" in str(info.value)
    with pytest.raises(MessageFormatError, match="created_lt"):
        parse_internal_header(cell.data, 600)


def test_inconsistent_arguments_are_a_plain_value_error() -> None:
    cell = build_internal_message(A, B, 7)
    with pytest.raises(ValueError) as info:
        parse_internal_header(cell.data[:10], cell.bits)
    assert not isinstance(info.value, MessageFormatError)


def test_error_type() -> None:
    err = MessageFormatError("dst", "dst is addr_var, not addr_std")
    assert isinstance(err, ValueError) and err.field == "dst" and str(err) == err.detail


# ---------------------------------------------------------------------------------------------
# the references a header names (FORMAT.md §6: the node parses each message whole)


def _laid_out(*, ec: bool, init: str | None, body_ref: bool) -> PCell:
    """A valid message (pytoniq builds the parts) whose extra currencies, init (none,
    inline or in a ref) and body (inline or in a ref) sit where asked."""
    info = pytoniq_new_info(A, B, 77, value=5, at=1, extra={7: 9} if ec else None)
    builder = PBuilder().store_cell(info.serialize())
    leaf = PBuilder().store_uint(3, 8).end_cell()
    if init is None:
        builder.store_bit(0)
    else:
        state = StateInit(code=leaf, data=leaf).serialize()
        builder.store_bit(1)
        if init == "inline":
            builder.store_bit(0).store_cell(state)
        else:
            builder.store_bit(1).store_ref(state)
    body = PBuilder().store_uint(42, 32).end_cell()
    if body_ref:
        builder.store_bit(1).store_ref(body)
    else:
        builder.store_bit(0).store_cell(body)
    return builder.end_cell()


@pytest.mark.parametrize("ec", [False, True])
@pytest.mark.parametrize("init", [None, "inline", "ref"])
@pytest.mark.parametrize("body_ref", [False, True])
def test_a_header_naming_more_references_than_the_cell_has_is_refused(
    ec: bool, init: str | None, body_ref: bool
) -> None:
    """With the cell's reference count, the parser refuses a header whose extra
    currencies, init or body "in a ref" name a cell that is not there (an outside audit:
    such a state imported, and the node refuses it). Every valid layout (pytoniq parses
    it) passes with its own count; an inline init hides where the body starts, so its
    references are never counted (a lower bound: no false refusal)."""
    cell = _laid_out(ec=ec, init=init, body_ref=body_ref)
    MessageAny.deserialize(cell.begin_parse())  # valid, by pytoniq
    (root,) = decode_boc(cell.to_boc())
    expected = (77, A.workchain, A.account, B.workchain, B.account)
    assert parse_internal_header(root.data, root.bits, len(root.refs)) == expected
    named = ec + (init == "ref") + (body_ref and init != "inline")
    for refs in range(len(root.refs)):
        if refs < named:
            with pytest.raises(MessageFormatError, match="names") as info:
                parse_internal_header(root.data, root.bits, refs)
            assert info.value.field == "refs"
        else:
            assert parse_internal_header(root.data, root.bits, refs) == expected
