"""The TL codec: real tycho files, bit-exact round trips, every reader check, fuzzing."""

from __future__ import annotations

import contextlib
import io
import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st
from tycho_data import TYCHO

from imq.errors import StateFormatError
from imq.state import tl
from imq.state.source import ByteSource, open_source
from imq.state.tl import (
    MAX_CHUNK_SIZE,
    QUEUE_DIFF_ID,
    StateHeader,
    TlDiff,
    decode_diff,
    diff_hash,
    encode_chunk,
    encode_diff,
    encode_state_header,
    read_chunk,
    read_diff,
    read_state_header,
)
from imq.types import Address, QueueKey, ShardIdent

FIRST_DIFF = TYCHO / "first_block" / "first_block_queue_diff.bin"
SHARD_BIN = TYCHO / "persistent_state" / "shard.bin"
MASTER_BIN = TYCHO / "persistent_state" / "master.bin"
QUEUES = sorted([*TYCHO.glob("dump/queues/*.queue"), *TYCHO.glob("dump_one_shard/queues/*.queue")])
# README: file name prefix -> (top diff hash prefix or None, tail_len)
QUEUE_EXPECTED = {
    "-1_8000000000000000_57_": ("0ece7b3b", 1),
    "0_8000000000000000_35_": ("f7aac545", 1),
    "0_8000000000000000_36_": ("a881a8c8", 1),
    "-1_8000000000000000_76_": ("664e9df5", 1),
    "0_8000000000000000_83_": ("86fe3fde", 2),
    "0_8000000000000000_84_": (None, 1),
}

MC, BC = ShardIdent.MASTERCHAIN, ShardIdent.BASECHAIN
FULL = 0x8000_0000_0000_0000
ZERO, FF = bytes(32), b"\xff" * 32
U32 = struct.Struct("<I")


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def decompressed(path: Path) -> bytes:
    blob = path.read_bytes()
    if path.suffix == ".queue":
        return zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True).read()
    return blob


def parse_all(blob: bytes) -> tuple[StateHeader, list[bytes]]:
    """The whole state: header, every chunk, nothing after."""
    with open_source(io.BytesIO(blob)) as src:
        header = read_state_header(src)
        chunks = [read_chunk(src, i) for i in range(header.n_chunks)]
        if not src.at_eof():
            raise StateFormatError(f"trailing bytes at offset {src.offset}")
    return header, chunks


def raw_state(shard: ShardIdent, seqno: int, diffs_tl: list[bytes], n_chunks: int) -> bytes:
    """A state header without the encoder's checks, to build invalid ones."""
    return b"".join(
        [
            bytes.fromhex("ccd96436654b01d4"),
            struct.pack("<iQII", shard.workchain, shard.prefix, seqno, len(diffs_tl)),
            *diffs_tl,
            U32.pack(n_chunks),
        ]
    )


def empty_diff(shard: ShardIdent, seqno: int, prev_hash: bytes = ZERO, **kw: object) -> TlDiff:
    fields: dict[str, object] = {
        "prev_hash": prev_hash,
        "shard": shard,
        "seqno": seqno,
        "processed_to": ((MC, QueueKey.max_for_lt(seqno)), (BC, QueueKey.max_for_lt(seqno))),
        "min_message": QueueKey.min_for_lt(1000 * seqno),
        "max_message": QueueKey.max_for_lt(1000 * seqno + 4),
        "hashes": b"",
    }
    fields.update(kw)
    return TlDiff(**fields)  # type: ignore[arg-type]


def chain(shard: ShardIdent, seqnos: list[int], **kw: object) -> list[bytes]:
    """Boxed diffs newest first, linked by prev_hash, for seqnos given newest first."""
    out: list[bytes] = []
    prev = ZERO
    for seqno in reversed(seqnos):
        data = encode_diff(empty_diff(shard, seqno, prev, **kw))
        out.append(data)
        prev = diff_hash(data)
    return out[::-1]


# ---------------------------------------------------------------------------------------------
# Real files


def test_first_block_queue_diff() -> None:
    data = FIRST_DIFF.read_bytes()
    assert len(data) == 252
    diff = decode_diff(data)
    assert diff_hash(data).hex() == (
        "7a4b22a73454e3ca511f5a6a3af6befd52d6a61b66ae5f7a5077c5b309ebc68a"
    )
    assert diff.shard == MC
    assert diff.seqno == 1
    assert diff.prev_hash == ZERO
    assert diff.n_messages == 0
    assert diff.router_src == diff.router_dst == ()
    assert encode_diff(diff) == data


def test_shard_bin_header() -> None:
    with open_source(SHARD_BIN) as src:
        header = read_state_header(src)
        assert header.shard == ShardIdent.parse("0:8000000000000000")
        assert header.seqno == 160
        assert [d.seqno for d in header.diffs] == [160, 159, 158]
        assert header.diff_hashes[0].hex() == (
            "794fe9ce31b7919d2b6ca9ae0f97501f4017382a273b8f3ee512dcfcb5b14482"
        )
        assert [d.n_messages for d in header.diffs] == [4300, 0, 0]
        assert header.diff_offsets[0] == 28
        assert header.n_chunks == 1
        chunk = read_chunk(src, 0)
        assert len(chunk) == 399_915
        assert chunk[:4] == bytes.fromhex("b5ee9c72")
        assert src.at_eof()
    top = header.diffs[0]
    hashes = list(top.iter_hashes())
    assert hashes == sorted(hashes) and len(set(hashes)) == 4300
    assert top.hash_at(4299) == hashes[-1]
    with pytest.raises(IndexError):
        top.hash_at(4300)


def test_master_bin_header() -> None:
    header, chunks = parse_all(MASTER_BIN.read_bytes())
    assert header.shard == MC
    assert header.seqno == 90
    assert len(header.diffs) == 1
    assert header.diff_hashes[0].hex() == (
        "5795ca5d1b8d0c1ce96394eef851bde718ff2e14fd2840098ed2bb7640f278c5"
    )
    assert header.n_chunks == 0 and chunks == []


@pytest.mark.parametrize("path", QUEUES, ids=lambda p: p.name[:24])
def test_real_queue_files(path: Path) -> None:
    (prefix,) = [p for p in QUEUE_EXPECTED if path.name.startswith(p)]
    top_hash, tail_len = QUEUE_EXPECTED[prefix]
    with open_source(path) as src:
        assert src.compressed
        header = read_state_header(src)
        assert header.n_chunks == 0
        assert src.at_eof()
    wc, _, seqno = prefix.rstrip("_").split("_")
    assert header.shard == ShardIdent.full(int(wc))
    assert header.seqno == int(seqno)
    assert len(header.diffs) == tail_len
    if top_hash is not None:
        assert header.diff_hashes[0].hex().startswith(top_hash)


def queue_header(seqno_prefix: str) -> StateHeader:
    (path,) = [p for p in QUEUES if p.name.startswith(seqno_prefix)]
    with open_source(path) as src:
        return read_state_header(src)


def test_real_prev_hash_links_across_files() -> None:
    assert (
        queue_header("0_8000000000000000_36_").diffs[0].prev_hash
        == (queue_header("0_8000000000000000_35_").diff_hashes[0])
    )
    assert (
        queue_header("0_8000000000000000_84_").diffs[0].prev_hash
        == (queue_header("0_8000000000000000_83_").diff_hashes[0])
    )


ALL_STATES = [SHARD_BIN, MASTER_BIN, *QUEUES]


@pytest.mark.parametrize("path", ALL_STATES, ids=lambda p: p.name[:24])
def test_real_states_reencode_bit_exactly(path: Path) -> None:
    data = decompressed(path)
    header, chunks = parse_all(data)
    diffs_tl = []
    for diff, offset, expected_hash in zip(
        header.diffs, header.diff_offsets, header.diff_hashes, strict=True
    ):
        encoded = encode_diff(diff)
        assert data[offset : offset + len(encoded)] == encoded
        assert diff_hash(encoded) == expected_hash
        diffs_tl.append(encoded)
    rebuilt = encode_state_header(header.shard, header.seqno, diffs_tl, header.n_chunks)
    rebuilt += b"".join(encode_chunk(c) for c in chunks)
    assert rebuilt == data


@pytest.mark.parametrize("path", ALL_STATES, ids=lambda p: p.name[:24])
def test_real_empty_diff_conventions(path: Path) -> None:
    """Empty diffs: min = (start_lt, 00..), max = (end_lt, ff..); processed_to keys are the
    two full shards with max_for_lt values."""
    header, _ = parse_all(decompressed(path))
    for diff in header.diffs:
        assert [shard for shard, _ in diff.processed_to] == [MC, BC]
        assert all(key.hash == FF for _, key in diff.processed_to)
        assert diff.router_src == diff.router_dst == ()
        if diff.n_messages == 0:
            assert diff.min_message.hash == ZERO
            assert diff.max_message.hash == FF
            assert diff.min_message.lt <= diff.max_message.lt


def test_real_state_read_one_byte_at_a_time() -> None:
    class OneByte(io.RawIOBase):
        def __init__(self, data: bytes) -> None:
            self._data, self._pos = data, 0

        def readable(self) -> bool:
            return True

        def read(self, n: int = -1, /) -> bytes:
            out = self._data[self._pos : self._pos + 1]
            self._pos += len(out)
            return out

    data = SHARD_BIN.read_bytes()
    with open_source(OneByte(data)) as src:  # type: ignore[arg-type]
        header = read_state_header(src)
        assert header.diff_hashes == parse_all(data)[0].diff_hashes
        read_chunk(src, 0)
        assert src.at_eof()


# ---------------------------------------------------------------------------------------------
# Generated diffs: sizes, routers, round trips

A1 = Address(-1, h(5))
A2 = Address(0, h(1))
A3 = Address(0, h(2))
A4 = Address(127, ZERO)
ROUTED = TlDiff(
    prev_hash=h(99),
    shard=BC,
    seqno=7,
    processed_to=((MC, QueueKey.max_for_lt(5)), (BC, QueueKey.max_for_lt(6))),
    min_message=QueueKey(10, h(1)),
    max_message=QueueKey(20, h(3)),
    hashes=h(1) + h(2) + h(3),
    router_src=((1, (A2, A3)),),
    router_dst=((0, (A1,)), (3, (A1, A4))),
)
# Offsets of ROUTED's fields (FORMAT §3)
AT_SHARD, AT_SEQNO, AT_PT_COUNT, AT_PT = 36, 48, 52, 56
AT_MIN = AT_PT + 2 * 52
AT_MAX = AT_MIN + 40
AT_NMSG = AT_MAX + 40
AT_HASHES = AT_NMSG + 4
AT_SRC = AT_HASHES + 3 * 32
AT_SRC_ACCOUNTS = AT_SRC + 12
AT_DST = AT_SRC_ACCOUNTS + 2 * 36
AT_DST_P1 = AT_DST + 4 + 8 + 36


def expected_size(diff: TlDiff) -> int:
    routers = sum(
        4 + sum(8 + 36 * len(a) for _, a in r) for r in (diff.router_src, diff.router_dst)
    )
    return (
        4 + 32 + 12 + 4 + 4 + 52 * len(diff.processed_to) + 80 + 4 + 32 * diff.n_messages + routers
    )


def test_empty_diff_is_252_bytes() -> None:
    data = encode_diff(empty_diff(BC, 3))
    assert len(data) == 252
    assert data[-8:] == bytes(8)  # a u32 count for each empty router


def test_routed_diff_round_trip() -> None:
    data = encode_diff(ROUTED)
    assert len(data) == expected_size(ROUTED) == AT_DST_P1 + 8 + 72
    assert decode_diff(data) == ROUTED
    assert data[AT_SRC : AT_SRC + 8] == struct.pack("<II", 1, 1)
    assert data[AT_DST_P1 : AT_DST_P1 + 8] == struct.pack("<II", 3, 2)
    assert data[AT_DST + 12 : AT_DST + 16] == b"\xff\xff\xff\xff"  # workchain -1 as i32
    src = ByteSource.from_bytes(data + b"tail")
    diff, tl_bytes = read_diff(src)
    assert diff == ROUTED and tl_bytes == data and src.offset == len(data)


def test_processed_to_entries_are_ordered_by_signed_workchain() -> None:
    pt = (
        (ShardIdent(-5, FULL), QueueKey.MIN),
        (MC, QueueKey.MAX),
        (ShardIdent(0, 0x4000_0000_0000_0000), QueueKey.max_for_lt(1)),
        (BC, QueueKey.max_for_lt(2)),
        (ShardIdent(0, 0xC000_0000_0000_0000), QueueKey.max_for_lt(3)),
        (ShardIdent(7, FULL), QueueKey.max_for_lt(4)),
    )
    diff = empty_diff(BC, 1, processed_to=pt)
    assert decode_diff(encode_diff(diff)).processed_to == pt
    with pytest.raises(ValueError, match="processed_to"):
        encode_diff(empty_diff(BC, 1, processed_to=(pt[1], pt[0])))


def test_generated_state_with_routers_through_zstd() -> None:
    below = {"min_message": QueueKey.min_for_lt(1), "max_message": QueueKey.max_for_lt(5)}
    older = encode_diff(empty_diff(BC, 6, h(7), router_src=((2, (A2,)),), **below))
    newer_diff = TlDiff(
        diff_hash(older), BC, 7, ROUTED.processed_to, ROUTED.min_message,
        ROUTED.max_message, ROUTED.hashes, ROUTED.router_src, ROUTED.router_dst,
    )  # fmt: skip
    newer = encode_diff(newer_diff)
    blob = encode_state_header(BC, 7, [newer, older], 1) + encode_chunk(b"\xb5\xee\x9c\x72\x01")
    assert len(encode_chunk(b"12345")) == 12
    compressed = zstandard.ZstdCompressor(level=9).compress(blob)
    with open_source(io.BytesIO(compressed)) as src:
        header = read_state_header(src)
        assert header.diffs[0] == newer_diff
        assert header.diffs[1].router_src == ((2, (A2,)),)
        assert header.diff_hashes == (diff_hash(newer), diff_hash(older))
        assert header.diff_offsets == (28, 28 + len(newer))
        assert read_chunk(src, 0) == b"\xb5\xee\x9c\x72\x01"
        assert src.at_eof()


# Hypothesis: random valid diffs

shards = st.one_of(
    st.just(MC),
    st.builds(
        lambda wc, depth, bits: ShardIdent(
            wc, ((bits << (64 - depth)) | (1 << (63 - depth))) & (2**64 - 1)
        ),
        st.integers(-(2**31), 2**31 - 1).filter(lambda wc: wc != -1),
        st.integers(0, 60),
        st.integers(0, 2**60 - 1),
    ),
)
keys = st.builds(
    QueueKey,
    st.integers(0, 2**64 - 1),
    st.one_of(st.just(ZERO), st.just(FF), st.binary(min_size=32, max_size=32)),
)
addresses = st.builds(Address, st.integers(-128, 127), st.binary(min_size=32, max_size=32))
routers = st.dictionaries(st.integers(0, 0xFFFF), st.sets(addresses, max_size=4), max_size=4).map(
    lambda d: tuple((p, tuple(sorted(a))) for p, a in sorted(d.items()))
)


@st.composite
def tl_diffs(draw: st.DrawFn) -> TlDiff:
    pt = draw(st.dictionaries(shards, keys, max_size=5))
    lo, hi = sorted([draw(keys), draw(keys)])
    hashes = draw(st.sets(st.binary(min_size=32, max_size=32).filter(lambda b: b != ZERO)))
    return TlDiff(
        prev_hash=draw(st.binary(min_size=32, max_size=32)),
        shard=draw(shards),
        seqno=draw(st.integers(0, 2**32 - 1)),
        processed_to=tuple(sorted(pt.items())),
        min_message=lo,
        max_message=hi,
        hashes=b"".join(sorted(hashes)),
        router_src=draw(routers),
        router_dst=draw(routers),
    )


@given(tl_diffs())
def test_random_diffs_round_trip(diff: TlDiff) -> None:
    data = encode_diff(diff)
    assert len(data) == expected_size(diff)
    back = decode_diff(data)
    assert back == diff
    assert encode_diff(back) == data


# ---------------------------------------------------------------------------------------------
# Encoder and constructor checks


def replace(diff: TlDiff, **kw: object) -> TlDiff:
    fields = {name: getattr(diff, name) for name in TlDiff.__dataclass_fields__}
    fields.update(kw)
    return TlDiff(**fields)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"prev_hash": b"x"}, ValueError),
        ({"shard": (0, FULL)}, TypeError),
        ({"seqno": -1}, ValueError),
        ({"seqno": 2**32}, ValueError),
        ({"min_message": (0, ZERO)}, TypeError),
        ({"hashes": b"abc"}, ValueError),
        ({"processed_to": []}, TypeError),
        ({"router_dst": {}}, TypeError),
    ],
)
def test_constructor_rejects_bad_shapes(change: dict[str, object], error: type) -> None:
    with pytest.raises(error):
        replace(ROUTED, **change)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"processed_to": ((BC, QueueKey.MIN), (BC, QueueKey.MAX))}, "processed_to"),
        ({"processed_to": ((BC, QueueKey.MIN), (MC, QueueKey.MAX))}, "processed_to"),
        ({"max_message": QueueKey(9, FF)}, "below min_message"),
        ({"hashes": h(2) + h(1)}, "not strictly ascending"),
        ({"hashes": h(1) + h(1)}, "not strictly ascending"),
        ({"hashes": ZERO + h(1)}, "zero message hash"),
        ({"router_src": ((0x10000, ()),)}, "u16"),
        ({"router_src": ((-1, ()),)}, "u16"),
        ({"router_src": ((2, ()), (1, ()))}, "not strictly ascending"),
        ({"router_src": ((2, ()), (2, ()))}, "not strictly ascending"),
        ({"router_dst": ((0, (A3, A2)),)}, "accounts not strictly ascending"),
        ({"router_dst": ((0, (A2, A2)),)}, "accounts not strictly ascending"),
    ],
)
def test_encoder_checks_invariants(change: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_diff(replace(ROUTED, **change))


def test_encoder_checks_types_inside_tuples() -> None:
    with pytest.raises(TypeError):
        encode_diff(replace(ROUTED, processed_to=((BC, (1, ZERO)),)))
    with pytest.raises(TypeError):
        encode_diff(replace(ROUTED, router_src=((0, ((0, ZERO),)),)))
    with pytest.raises(TypeError):
        encode_diff(replace(ROUTED, router_src=((0, [A2]),)))


def test_encoder_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="processed_to"):
        encode_diff(
            replace(
                ROUTED, processed_to=tuple((ShardIdent.full(i), QueueKey.MIN) for i in range(1001))
            )
        )
    with pytest.raises(ValueError, match="partitions"):
        encode_diff(replace(ROUTED, router_src=tuple((i, ()) for i in range(65537))))
    monkeypatch.setattr(tl, "MAX_MESSAGES", 2)
    with pytest.raises(ValueError, match="messages"):
        encode_diff(ROUTED)
    monkeypatch.setattr(tl, "MAX_ACCOUNTS", 1)
    with pytest.raises(ValueError, match="accounts"):
        encode_diff(replace(ROUTED, hashes=b""))


def test_encode_state_header_checks() -> None:
    diffs = chain(BC, [5, 4, 3])
    encode_state_header(BC, 5, diffs, 0)
    with pytest.raises(ValueError, match=r"1\.\.=1000"):
        encode_state_header(BC, 5, [], 0)
    with pytest.raises(ValueError, match=r"1\.\.=1000"):
        encode_state_header(BC, 5, diffs * 334, 0)
    with pytest.raises(ValueError, match="n_chunks"):
        encode_state_header(BC, 5, diffs, 10_000_001)
    with pytest.raises(ValueError, match="seqno"):
        encode_state_header(BC, 6, diffs, 0)
    with pytest.raises(ValueError, match="seqno"):
        encode_state_header(BC, 5, chain(BC, [5, 6]), 0)
    with pytest.raises(ValueError, match="prev_hash"):
        encode_state_header(BC, 5, [diffs[0], diffs[2]], 0)
    with pytest.raises(ValueError, match="another shard"):
        encode_state_header(MC, 5, diffs, 0)
    with pytest.raises(ValueError, match="queueDiff"):
        encode_state_header(BC, 5, [b"\x00" * 60], 0)
    with pytest.raises(TypeError):
        encode_state_header((0, FULL), 5, diffs, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="u32"):
        encode_state_header(BC, -1, diffs, 0)


def test_encode_chunk_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert encode_chunk(b"abcd") == b"\x04\x00\x00\x00abcd"
    assert encode_chunk(b"a") == b"\x01\x00\x00\x00a\x00\x00\x00"
    with pytest.raises(ValueError):
        encode_chunk(b"")
    monkeypatch.setattr(tl, "MAX_CHUNK_SIZE", 3)
    with pytest.raises(ValueError):
        encode_chunk(b"abcd")


# ---------------------------------------------------------------------------------------------
# Reader checks: one hand-made bad input per check, each naming its offset

ROUTED_TL = encode_diff(ROUTED)


def patch(at: int, new: bytes) -> Callable[[bytes], bytes]:
    return lambda data: data[:at] + new + data[at + len(new) :]


def account(wc: int, acc: bytes) -> bytes:
    return struct.pack("<i32s", wc, acc)


DIFF_CHECKS = [
    ("id", patch(0, b"\x00\x00\x00\x00"), 0, "constructor id 00000000"),
    ("shard prefix 0", patch(AT_SHARD, struct.pack("<iQ", 0, 0)), AT_SHARD, "invalid shard"),
    ("shard low bits", patch(AT_SHARD, struct.pack("<iQ", 0, FULL | 4)), AT_SHARD, "invalid shard"),
    ("mc split", patch(AT_SHARD, struct.pack("<iQ", -1, FULL >> 1)), AT_SHARD, "invalid shard"),
    ("pt count", patch(AT_PT_COUNT, U32.pack(1001)), AT_PT_COUNT, "processed_to count is 1001"),
    ("pt repeat", patch(AT_PT + 52, struct.pack("<iQ", -1, FULL)), AT_PT + 52, "not strictly"),
    ("pt descent", patch(AT_PT, struct.pack("<iQ", 1, FULL)), AT_PT + 52, "not strictly"),
    ("pt shard", patch(AT_PT, struct.pack("<iQ", -1, 8)), AT_PT, "invalid shard"),
    ("max < min", patch(AT_MAX, struct.pack("<Q", 9)), AT_MAX, "below min_message"),
    ("n messages", patch(AT_NMSG, U32.pack(10_000_001)), AT_NMSG, "message count is 10000001"),
    ("zero hash", patch(AT_HASHES, ZERO), AT_HASHES, "zero message hash"),
    ("hash repeat", patch(AT_HASHES + 32, h(1)), AT_HASHES + 32, "not strictly ascending"),
    ("hash descent", patch(AT_HASHES + 64, h(2)), AT_HASHES + 64, "not strictly ascending"),
    ("partitions", patch(AT_SRC, U32.pack(65537)), AT_SRC, "partition count is 65537"),
    ("index u16", patch(AT_SRC + 4, U32.pack(0x10000)), AT_SRC + 4, "does not fit u16"),
    ("index repeat", patch(AT_DST_P1, U32.pack(0)), AT_DST_P1, "not strictly ascending"),
    ("n accounts", patch(AT_SRC + 8, U32.pack(10_000_001)), AT_SRC + 8, "count is 10000001"),
    ("wc 128", patch(AT_SRC_ACCOUNTS, struct.pack("<i", 128)), AT_SRC_ACCOUNTS, "fit i8"),
    ("wc -129", patch(AT_SRC_ACCOUNTS + 36, struct.pack("<i", -129)), AT_SRC_ACCOUNTS + 36, "i8"),
    (
        "account order",
        patch(AT_SRC_ACCOUNTS, account(0, h(2)) + account(0, h(1))),
        AT_SRC_ACCOUNTS + 36,
        "accounts not strictly ascending",
    ),
    (
        "account repeat",
        patch(AT_SRC_ACCOUNTS + 36, account(0, h(1))),
        AT_SRC_ACCOUNTS + 36,
        "accounts not strictly ascending",
    ),
    ("truncated", lambda d: d[:-1], AT_DST_P1 + 8, "truncated at offset"),
    ("trailing", lambda d: d + b"\x00", len(ROUTED_TL), "trailing bytes"),
]


@pytest.mark.parametrize(
    ("mutate", "at", "match"), [c[1:] for c in DIFF_CHECKS], ids=[c[0] for c in DIFF_CHECKS]
)
def test_diff_reader_checks(mutate: Callable[[bytes], bytes], at: int, match: str) -> None:
    bad = mutate(ROUTED_TL)
    with pytest.raises(StateFormatError, match=match) as err:
        decode_diff(bad)
    assert f"offset {at}" in str(err.value)


def test_diff_reader_offsets_are_absolute() -> None:
    """Inside a state the offsets count from the start of the file, not of the diff."""
    bad = patch(AT_HASHES + 32, h(1))(ROUTED_TL)
    src = ByteSource.from_bytes(b"\x00" * 100 + bad)
    src.read(100, "padding")
    with pytest.raises(StateFormatError) as err:
        read_diff(src)
    assert f"queue diff at offset 100: message hashes not strictly ascending (message 1) " \
        f"at offset {100 + AT_HASHES + 32}" == str(err.value)  # fmt: skip


GOOD_CHAIN = chain(BC, [9, 8])
HEADER_AT_SHARD, HEADER_AT_SEQNO, HEADER_AT_N, FIRST_DIFF_AT = 8, 20, 24, 28


def state_with(
    shard: ShardIdent = BC, seqno: int = 9, diffs: list[bytes] | None = None, n_chunks: int = 0
) -> bytes:
    return raw_state(shard, seqno, GOOD_CHAIN if diffs is None else diffs, n_chunks)


def test_good_state_parses() -> None:
    header, _ = parse_all(state_with())
    assert [d.seqno for d in header.diffs] == [9, 8]
    assert header.diff_offsets == (FIRST_DIFF_AT, FIRST_DIFF_AT + 252)


STATE_CHECKS = [
    ("a bare diff", ROUTED_TL, 0, "this is a queue diff, not a queue state"),
    ("unknown id", b"\x01\x02\x03\x04" + state_with()[4:], 0, "unknown id 01020304"),
    ("header id", patch(4, b"\x00" * 4)(state_with()), 4, "not block.queueStateHeader"),
    ("shard", patch(8, struct.pack("<iQ", -1, 0x10))(state_with()), HEADER_AT_SHARD, "invalid"),
    ("no diffs", state_with(diffs=[]), HEADER_AT_N, "diff count 0"),
    ("1001 diffs", patch(HEADER_AT_N, U32.pack(1001))(state_with()), HEADER_AT_N, "count 1001"),
    ("top seqno", state_with(seqno=10), FIRST_DIFF_AT + 48, "not the state's seqno 10"),
    ("diff shard", state_with(shard=ShardIdent(0, FULL >> 1)), FIRST_DIFF_AT + 36, "shard"),
    (
        "seqno order",
        state_with(seqno=9, diffs=chain(BC, [9, 9])),
        FIRST_DIFF_AT + 252 + 48,
        "not strictly below",
    ),
    (
        "seqno ascending",
        state_with(seqno=8, diffs=chain(BC, [8, 9])),
        FIRST_DIFF_AT + 252 + 48,
        "not strictly below",
    ),
    (
        "prev_hash chain",
        state_with(diffs=[patch(4, h(1))(GOOD_CHAIN[0]), GOOD_CHAIN[1]]),
        FIRST_DIFF_AT + 4,
        "prev_hash",
    ),
    ("diff inside", state_with(diffs=[GOOD_CHAIN[0], b"\x00" * 252]), FIRST_DIFF_AT + 252, "id"),
    ("n chunks", state_with(n_chunks=10_000_001), FIRST_DIFF_AT + 504, "chunk count 10000001"),
    ("truncated", state_with()[:-1], FIRST_DIFF_AT + 504, "truncated"),
]


@pytest.mark.parametrize(
    ("blob", "at", "match"), [c[1:] for c in STATE_CHECKS], ids=[c[0] for c in STATE_CHECKS]
)
def test_state_header_checks(blob: bytes, at: int, match: str) -> None:
    with pytest.raises(StateFormatError, match=match) as err:
        read_state_header(ByteSource.from_bytes(blob))
    assert f"offset {at}" in str(err.value)


CHUNK_CHECKS = [
    ("empty", U32.pack(0), "length 0"),
    ("too big", U32.pack(MAX_CHUNK_SIZE + 1), f"length {MAX_CHUNK_SIZE + 1}"),
    ("padding", U32.pack(5) + b"abcde\x00\x01\x00", "chunk padding is not zero at offset 9"),
    ("body", U32.pack(5) + b"abc", "truncated at offset 4 while reading chunk 3"),
    ("pad cut", U32.pack(5) + b"abcde\x00", "truncated at offset 9 while reading the padding"),
    ("length", b"\x05\x00", "truncated at offset 0 while reading the length of chunk 3"),
]


@pytest.mark.parametrize(
    ("blob", "match"), [c[1:] for c in CHUNK_CHECKS], ids=[c[0] for c in CHUNK_CHECKS]
)
def test_chunk_checks(blob: bytes, match: str) -> None:
    with pytest.raises(StateFormatError, match=match) as err:
        read_chunk(ByteSource.from_bytes(blob), 3)
    assert "offset" in str(err.value)


def test_chunk_padding_read_and_skipped() -> None:
    src = ByteSource.from_bytes(encode_chunk(b"abcde") + encode_chunk(b"xy"))
    assert read_chunk(src, 0) == b"abcde"
    assert src.offset == 12
    assert read_chunk(src, 1) == b"xy"
    assert src.at_eof()


# ---------------------------------------------------------------------------------------------
# Truncation at every offset, and fuzzing


def test_first_diff_truncated_at_every_offset() -> None:
    data = FIRST_DIFF.read_bytes()
    for cut in range(len(data)):
        with pytest.raises(StateFormatError, match="truncated at offset") as err:
            decode_diff(data[:cut])
        field_at = int(str(err.value).split()[3])
        assert cut - 40 <= field_at <= cut


def test_master_bin_truncated_at_every_offset() -> None:
    data = MASTER_BIN.read_bytes()
    for cut in range(len(data)):
        with pytest.raises(StateFormatError, match="truncated"):
            parse_all(data[:cut])


def test_shard_bin_truncated_at_many_offsets() -> None:
    data = SHARD_BIN.read_bytes()
    header_end = FIRST_DIFF_AT + sum(len(encode_diff(d)) for d in parse_all(data)[0].diffs) + 4
    cuts = {
        *range(0, 1024),
        *range(0, header_end + 16, 97),
        *range(header_end - 16, header_end + 16),
    }
    cuts |= {*range(header_end, len(data), 4099), len(data) - 4, len(data) - 1}
    for cut in sorted(cuts):
        with pytest.raises(StateFormatError):
            parse_all(data[:cut])


MASTER = MASTER_BIN.read_bytes()
SHARD = SHARD_BIN.read_bytes()
SHARD_HEADER_END = 28 + 252 * 2 + (252 + 4300 * 32) + 4


def flip(data: bytes, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, mask in flips:
        out[pos % len(out)] ^= mask
    return bytes(out)


@given(st.lists(st.tuples(st.integers(0, len(MASTER) - 1), st.integers(1, 255)), min_size=1))
def test_fuzz_master_bin_flips(flips: list[tuple[int, int]]) -> None:
    with contextlib.suppress(StateFormatError):
        parse_all(flip(MASTER, flips))


@given(
    st.lists(
        st.tuples(
            st.one_of(st.integers(0, 300), st.integers(0, SHARD_HEADER_END - 1)),
            st.integers(1, 255),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_fuzz_shard_bin_header_flips(flips: list[tuple[int, int]]) -> None:
    with contextlib.suppress(StateFormatError):
        parse_all(flip(SHARD, flips))


def test_every_single_byte_flip_of_master_bin() -> None:
    """Exhaustive over positions: a flip either fails cleanly or is a valid state."""
    accepted = 0
    for pos in range(len(MASTER)):
        for mask in (0x01, 0x80, 0xFF):
            try:
                parse_all(flip(MASTER, [(pos, mask)]))
                accepted += 1
            except StateFormatError:
                pass
    assert accepted > 0  # flips inside hashes and lts are valid bytes


class _Zeros(io.RawIOBase):
    """``head``, then ``n`` zero bytes made as they are read (never all in memory)."""

    def __init__(self, head: bytes, n: int) -> None:
        self._head = head
        self._left = n

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if self._head:
            k = min(len(buffer), len(self._head))
            buffer[:k] = self._head[:k]
            self._head = self._head[k:]
            return k
        k = min(len(buffer), self._left)
        buffer[:k] = bytes(k)
        self._left -= k
        return k


_U32 = struct.Struct("<I")
_DIFF_HEAD = (
    _U32.pack(QUEUE_DIFF_ID)
    + bytes(32)
    + struct.pack("<iQ", 0, 1 << 63)
    + _U32.pack(5)
    + _U32.pack(0)  # no processed_to
    + struct.pack("<Q32s", 1, bytes(32))
    + struct.pack("<Q32s", 2, b"\xff" * 32)
)


@pytest.mark.parametrize(
    ("tail", "entry", "says"),
    [
        (_U32.pack(10_000_000), 32, "zero message hash (message 0) at offset 140"),
        (
            _U32.pack(0) + _U32.pack(1) + _U32.pack(1) + _U32.pack(10_000_000),
            36,
            "accounts not strictly ascending at offset 188",
        ),
    ],
    ids=["hashes", "router"],
)
def test_a_declared_list_of_zeros_fails_at_its_first_slice(
    tail: bytes, entry: int, says: str
) -> None:
    """An outside audit: an 11 KB zstd file declaring 10 million zero router accounts
    (360 MB) took 1.9 GB of memory before it was refused (a bare MemoryError under
    `ulimit -v`); 10 million zero hashes, 750 MB. Checked a slice at a time, the read
    stops after the first one."""
    declared = 10_000_000 * entry
    src = ByteSource(_Zeros(_DIFF_HEAD + tail, declared))
    with pytest.raises(StateFormatError, match=re.escape(says)):
        tl.read_diff(src)
    assert src.raw_bytes_read < 4 << 20, src.raw_bytes_read
