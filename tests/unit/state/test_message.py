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
from pytoniq_oracle import to_pytoniq
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
    it) passes with its own count; an inline init (code and data here) is walked, so its
    references and the body's after it count too."""
    cell = _laid_out(ec=ec, init=init, body_ref=body_ref)
    MessageAny.deserialize(cell.begin_parse())  # valid, by pytoniq
    (root,) = decode_boc(cell.to_boc())
    expected = (77, A.workchain, A.account, B.workchain, B.account)
    assert parse_internal_header(root.data, root.bits, len(root.refs)) == expected
    named = ec + {None: 0, "inline": 2, "ref": 1}[init] + body_ref
    assert named == len(root.refs)
    for refs in range(len(root.refs)):
        if refs < named:
            with pytest.raises(MessageFormatError, match="names") as info:
                parse_internal_header(root.data, root.bits, refs)
            assert info.value.field == "refs"
        else:
            assert parse_internal_header(root.data, root.bits, refs) == expected


def _message_with(tail: PBuilder, *, ec: bool = False) -> PCell:
    """A message whose header (pytoniq's, extra currencies when ``ec``) is followed by
    ``tail``'s bits and references as they are: its init and body, valid or not."""
    info = pytoniq_new_info(A, B, 77, value=5, at=1, extra={7: 9} if ec else None)
    return PBuilder().store_cell(info.serialize()).store_cell(tail.end_cell()).end_cell()


def _state_init(split: bool, special: bool, code: bool, data: bool, library: bool) -> PBuilder:
    """A StateInit's bits and references written field by field (TL-B: split_depth,
    special, code, data, library; the library root is any cell: the node loads a
    dictionary's root lazily)."""
    leaf = PBuilder().store_uint(3, 8).end_cell()
    out = PBuilder()
    out.store_bit(1).store_uint(17, 5) if split else out.store_bit(0)
    out.store_bit(1).store_uint(0b10, 2) if special else out.store_bit(0)
    for present, tag in ((code, 1), (data, 2), (library, 3)):
        if present:
            out.store_bit(1).store_ref(PBuilder().store_uint(tag, 8).store_ref(leaf).end_cell())
        else:
            out.store_bit(0)
    return out


def _imq(cell: PCell) -> Cell:
    (root,) = decode_boc(cell.to_boc())
    return root


_FLAGS = [
    (split, special, code, data, library)
    for split in (False, True)
    for special in (False, True)
    for code in (False, True)
    for data in (False, True)
    for library in (False, True)
]


@pytest.mark.parametrize("flags", _FLAGS)
@pytest.mark.parametrize("body_ref", [False, True])
def test_an_inline_init_is_walked_and_its_references_counted(
    flags: tuple[bool, bool, bool, bool, bool], body_ref: bool
) -> None:
    """FORMAT.md §6: the node parses each message whole. An init written inline is read
    field by field (split_depth and special change its length), so the references its
    code, data and library name, and the body's after it, are counted exactly: the
    cell's own count passes, one fewer is refused."""
    tail = PBuilder().store_bit(1).store_bit(0).store_cell(_state_init(*flags).end_cell())
    body = PBuilder().store_uint(42, 32).end_cell()
    tail.store_bit(1).store_ref(body) if body_ref else tail.store_bit(0).store_cell(body)
    for ec in (False, True):
        named = ec + sum(flags[2:]) + body_ref
        if named > 4:  # a cell has at most four references
            continue
        cell = _message_with(tail, ec=ec)
        if not flags[4]:  # pytoniq parses a library as a dictionary: only without one
            MessageAny.deserialize(cell.begin_parse())
        root = _imq(cell)
        assert len(root.refs) == named
        expected = (77, A.workchain, A.account, B.workchain, B.account)
        assert parse_internal_header(root.data, root.bits, named) == expected
        if named:
            with pytest.raises(MessageFormatError, match="names") as info:
                parse_internal_header(root.data, root.bits, named - 1)
            assert info.value.field == "refs"


def test_a_cell_ending_inside_its_inline_init_is_refused() -> None:
    """Cut anywhere inside an inline init, or before the body's bit after it, the cell
    is no message (pytoniq cannot parse it either): refused as ``init``, with every
    reference the init names still there (the cut, not a count, is what is wrong)."""
    tail = PBuilder().store_bit(1).store_bit(0)
    tail.store_cell(_state_init(True, True, True, True, False).end_cell()).store_bit(0)
    whole = _imq(_message_with(tail))
    assert parse_internal_header(whole.data, whole.bits, 2) == parse(whole)
    init_at = whole.bits - 1 - (1 + 5 + 1 + 2 + 3) - 2  # the init's Maybe bit
    for bits in range(init_at + 2, whole.bits):
        cut = Cell(whole.data[: (bits + 7) // 8], bits, whole.refs)
        with pytest.raises(Exception):  # noqa: B017 - any failure of pytoniq's parse
            MessageAny.deserialize(to_pytoniq(cut).begin_parse())
        with pytest.raises(MessageFormatError, match="ends") as info:
            parse_internal_header(cut.data, cut.bits, 4)
        assert info.value.field == "init", bits


def _ref_init(child: Cell, *, ec: bool) -> Cell:
    """A message whose init is ``child``, in a ref (after the extra currencies' when
    ``ec``), then a body in a ref."""
    body = PBuilder().store_uint(42, 32).end_cell()
    tail = PBuilder().store_bit(1).store_bit(1).store_ref(to_pytoniq(child))
    return _imq(_message_with(tail.store_bit(1).store_ref(body), ec=ec))


def test_an_init_in_a_ref_must_hold_a_state_init() -> None:
    """An init "in a ref" is an ordinary cell holding a whole StateInit: with the cell's
    references given, one too short for its Maybe bits, one missing a reference its
    fields name, or an exotic one is refused as ``init``; a valid one passes (pytoniq
    agrees on each ordinary case), also behind an extra currencies' reference. Without
    the references only the count is checked."""
    good = _imq(_state_init(False, False, True, True, False).end_cell())
    expected = (77, A.workchain, A.account, B.workchain, B.account)
    short = CellBuilder().store_uint(0, 4).end()  # five Maybe bits at least
    missing = Cell(good.data, good.bits, good.refs[:1])  # names code and data, holds one
    library = Cell(bytes([2]) + bytes(32), 8 + 256, (), exotic=True)
    for ec in (False, True):
        cell = _ref_init(good, ec=ec)
        MessageAny.deserialize(to_pytoniq(cell).begin_parse())
        assert parse_internal_header(cell.data, cell.bits, 2 + ec, cell.refs) == expected
        for child, ordinary in ((short, True), (missing, True), (library, False)):
            cell = _ref_init(child, ec=ec)
            if ordinary:
                with pytest.raises(Exception):  # noqa: B017 - any failure of pytoniq's parse
                    MessageAny.deserialize(to_pytoniq(cell).begin_parse())
            with pytest.raises(MessageFormatError) as info:
                parse_internal_header(cell.data, cell.bits, 2 + ec, cell.refs)
            assert info.value.field == "init", child
            assert parse_internal_header(cell.data, cell.bits, 2 + ec) == expected
