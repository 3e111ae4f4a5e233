"""The storage codec: round trips of every layout, corrupt bytes, range bounds."""

from __future__ import annotations

import msgpack
import pytest

from imq.errors import CorruptDataError
from imq.storage import codec
from imq.types import Address, BlockId, CommitPointer, DiffInfo, Message, QueueKey, ShardIdent

FULL = 0x8000_0000_0000_0000
H1 = bytes(31) + b"\x01"
LEFT = ShardIdent(0, 0x4000_0000_0000_0000)
RIGHT = ShardIdent(0, 0xC000_0000_0000_0000)

SHARDS = [
    ShardIdent.MASTERCHAIN,
    ShardIdent.BASECHAIN,
    LEFT,
    RIGHT,
    ShardIdent(0, 8),
    ShardIdent(-(2**31), FULL),
    ShardIdent(2**31 - 1, 0xFFFF_FFFF_FFFF_FFF8),
    ShardIdent(-2, 0x2000_0000_0000_0000),
]
KEYS = [
    QueueKey.MIN,
    QueueKey.MAX,
    QueueKey(1, H1),
    QueueKey(2**63, b"\x80" + bytes(31)),
    QueueKey.max_for_lt(7),
]
ADDRESSES = [
    Address(0, bytes(32)),
    Address(-1, b"\xff" * 32),
    Address(-128, bytes(range(32))),
    Address(127, bytes(range(32, 64))),
]
A, B, C, D = ADDRESSES


def k(lt: int, last: int = 0) -> QueueKey:
    return QueueKey(lt, bytes(31) + bytes((last,)))


# --- primitives -----------------------------------------------------------------------


@pytest.mark.parametrize("shard", SHARDS)
def test_shard_round_trip(shard: ShardIdent) -> None:
    raw = codec.shard_bytes(shard)
    assert len(raw) == codec.SHARD_LEN == 12
    assert codec.decode_shard(raw) == shard
    assert type(codec.decode_shard(raw)) is ShardIdent


def test_shard_bytes_layout() -> None:
    # offset-binary workchain (value + 2**31), then the prefix, both big-endian
    assert codec.shard_bytes(ShardIdent.BASECHAIN) == bytes.fromhex("80000000" + "8000000000000000")
    assert codec.shard_bytes(ShardIdent.MASTERCHAIN) == bytes.fromhex(
        "7fffffff" + "8000000000000000"
    )
    assert codec.shard_bytes(ShardIdent.MASTERCHAIN) < codec.shard_bytes(ShardIdent.BASECHAIN)


@pytest.mark.parametrize(
    "raw",
    [
        bytes.fromhex("80000000" + "0000000000000000"),  # prefix 0
        bytes.fromhex("80000000" + "8000000000000001"),  # low bits set
        bytes.fromhex("7fffffff" + "4000000000000000"),  # split masterchain
    ],
)
def test_decode_shard_rejects_invalid(raw: bytes) -> None:
    with pytest.raises(ValueError):
        codec.decode_shard(raw)


@pytest.mark.parametrize("key", KEYS)
def test_key_round_trip(key: QueueKey) -> None:
    raw = codec.key_bytes(key)
    assert len(raw) == codec.KEY_LEN == 40
    assert raw[:8] == key.lt.to_bytes(8, "big")
    assert raw[8:] == key.hash
    decoded = codec.decode_key(raw)
    assert decoded == key
    assert type(decoded) is QueueKey


@pytest.mark.parametrize("length", [0, 39, 41])
def test_decode_key_length(length: int) -> None:
    with pytest.raises(ValueError):
        codec.decode_key(bytes(length))


@pytest.mark.parametrize("address", ADDRESSES)
def test_address_round_trip(address: Address) -> None:
    raw = codec.address_bytes(address)
    assert len(raw) == codec.ADDRESS_LEN == 33
    assert raw[0] == address.workchain + 128
    assert raw[1:] == address.account
    assert codec.decode_address(raw) == address
    assert type(codec.decode_address(raw)) is Address


@pytest.mark.parametrize("length", [0, 32, 34])
def test_decode_address_length(length: int) -> None:
    with pytest.raises(ValueError):
        codec.decode_address(bytes(length))


@pytest.mark.parametrize(
    ("workchain", "byte"), [(-128, 0), (-1, 127), (0, 128), (127, 255), (-129, None), (128, None)]
)
def test_workchain_byte(workchain: int, byte: int | None) -> None:
    assert codec.workchain_byte(workchain) == byte


# --- prefix_end -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "end"),
    [
        (b"\x00", b"\x01"),
        (b"\x00\x00", b"\x00\x01"),
        (b"ab", b"ac"),
        (b"a\xff", b"b"),
        (b"\x01\xff\xff", b"\x02"),
        (b"\xfe", b"\xff"),
        (b"\x00\xfe\xff", b"\x00\xff"),
    ],
)
def test_prefix_end(prefix: bytes, end: bytes) -> None:
    assert codec.prefix_end(prefix) == end
    assert prefix < end
    assert prefix + b"\xff" * 64 < end
    assert not end.startswith(prefix)


@pytest.mark.parametrize("prefix", [b"", b"\xff", b"\xff\xff\xff"])
def test_prefix_end_unbounded(prefix: bytes) -> None:
    with pytest.raises(ValueError):
        codec.prefix_end(prefix)


# --- messages -------------------------------------------------------------------------


def test_message_key_layout() -> None:
    raw = codec.message_key(0x0102, LEFT, k(5))
    assert len(raw) == codec.MESSAGE_KEY_LEN == 54
    assert raw[:2] == b"\x01\x02"
    assert raw[2:14] == codec.shard_bytes(LEFT)
    assert raw[14:] == codec.key_bytes(k(5))
    assert codec.message_prefix(0x0102, LEFT) == raw[:14]


MESSAGES = [
    Message(k(1), A, B),
    Message(k(2), B, A, b"body"),
    Message(k(3), C, D, bytes(range(256)) * 4),
    Message(QueueKey.MAX, D, C, b"\x00"),
]


def test_message_rows_default_partition_round_trip() -> None:
    rows = list(codec.message_rows(LEFT, MESSAGES, None))
    assert len(rows) == len(MESSAGES)
    for (raw_key, value), message in zip(rows, MESSAGES, strict=True):
        assert raw_key == codec.message_key(0, LEFT, message.key)
        # D2: a fixed-size destination header first
        assert value[: codec.ADDRESS_LEN] == codec.address_bytes(message.dst)
        assert len(value) == codec.MESSAGE_VALUE_HEADER_LEN + len(message.body)
        decoded = codec.decode_message(raw_key, value)
        assert decoded == message
        assert type(decoded) is Message
        assert type(decoded.key) is QueueKey


def test_message_rows_with_partitions() -> None:
    def partition_for(src: Address, dst: Address) -> int:
        return {A: 1, B: 0, C: 65535}.get(src, 7)

    rows = list(codec.message_rows(RIGHT, MESSAGES, partition_for))
    expected_partitions = [1, 0, 65535, 7]
    for (raw_key, value), message, partition in zip(
        rows, MESSAGES, expected_partitions, strict=True
    ):
        assert raw_key == codec.message_key(partition, RIGHT, message.key)
        assert codec.decode_message(raw_key, value) == message


def test_message_range() -> None:
    lo, hi = codec.message_range(3, LEFT, k(1), k(9))
    assert lo == codec.message_key(3, LEFT, k(1))
    assert hi == codec.message_key(3, LEFT, k(9))


def test_message_delete_range_inclusive() -> None:
    lo, hi = codec.message_delete_range(3, LEFT, k(2), k(5))
    assert lo == codec.message_key(3, LEFT, k(2))
    assert lo <= codec.message_key(3, LEFT, k(5)) < hi
    assert codec.message_key(3, LEFT, k(5).next_value()) >= hi
    assert codec.message_key(3, LEFT, k(2, 0)) >= lo
    assert codec.message_key(3, LEFT, QueueKey(1, b"\xff" * 32)) < lo


@pytest.mark.parametrize("partition", [0, 1, 65534, 65535])
@pytest.mark.parametrize("shard", SHARDS)
def test_message_delete_range_up_to_max(partition: int, shard: ShardIdent) -> None:
    lo, hi = codec.message_delete_range(partition, shard, QueueKey.MIN, QueueKey.MAX)
    inside = [codec.message_key(partition, shard, key) for key in KEYS]
    assert all(lo <= raw < hi for raw in inside)
    assert lo <= codec.message_key(partition, shard, QueueKey.MAX) < hi
    # nothing of any other shard or partition
    for other_shard in SHARDS:
        for other_partition in {0, 1, partition - 1, partition + 1} & set(range(65536)):
            if (other_partition, other_shard) == (partition, shard):
                continue
            for key in (QueueKey.MIN, QueueKey.MAX):
                raw = codec.message_key(other_partition, other_shard, key)
                assert not lo <= raw < hi


# --- statistics -----------------------------------------------------------------------


def test_stat_key_layout() -> None:
    raw = codec.stat_key(LEFT, 2, k(7), 9)
    assert len(raw) == codec.STAT_KEY_LEN == 58
    assert raw[:12] == codec.shard_bytes(LEFT)
    assert raw[12:14] == b"\x00\x02"
    assert raw[14:54] == codec.key_bytes(k(7))
    assert raw[54:58] == (9).to_bytes(4, "big")


def test_stat_value_layout() -> None:
    value = codec.stat_value({A: 5})
    assert len(value) == 41
    assert value[:33] == codec.address_bytes(A)
    assert value[33:] == (5).to_bytes(8, "big")
    assert codec.stat_value({}) == b""


def test_stat_row_round_trip() -> None:
    counts = {A: 1, B: 2**40, C: 3, D: 2**64 - 1}
    raw_key = codec.stat_key(LEFT, 5, k(7), 11)
    max_message, entries = codec.decode_stat_row(raw_key, codec.stat_value(counts))
    assert max_message == k(7)
    assert dict(entries) == counts
    assert [dst for dst, _ in entries] == list(counts)
    assert all(type(dst) is Address for dst, _ in entries)


@pytest.mark.parametrize(
    ("key_len", "value_len"),
    [(57, 41), (59, 41), (0, 41), (58, 40), (58, 42), (58, 1)],
)
def test_decode_stat_row_lengths(key_len: int, value_len: int) -> None:
    with pytest.raises(CorruptDataError) as info:
        codec.decode_stat_row(bytes(key_len), bytes(value_len))
    assert info.value.table == "statistics"
    assert info.value.key == bytes(key_len)
    assert "statistics" in str(info.value)


def test_stat_range_selects_diffs_by_max_message() -> None:
    lo, hi = codec.stat_range(LEFT, 1, k(3), k(8))
    assert lo == codec.stat_prefix(LEFT, 1, k(3))
    assert hi == codec.stat_prefix(LEFT, 1, k(8))
    assert lo <= codec.stat_key(LEFT, 1, k(3), 0) < hi
    assert lo <= codec.stat_key(LEFT, 1, k(7, 255), 2**32 - 1) < hi
    assert not lo <= codec.stat_key(LEFT, 1, k(8), 0) < hi
    assert not lo <= codec.stat_key(LEFT, 2, k(5), 0) < hi
    assert not lo <= codec.stat_key(RIGHT, 1, k(5), 0) < hi


def test_stat_delete_range_inclusive() -> None:
    lo, hi = codec.stat_delete_range(LEFT, 1, k(3), k(5))
    assert lo <= codec.stat_key(LEFT, 1, k(3), 0) < hi
    assert lo <= codec.stat_key(LEFT, 1, k(5), 2**32 - 1) < hi
    assert not lo <= codec.stat_key(LEFT, 1, k(5).next_value(), 0) < hi
    assert not lo <= codec.stat_key(LEFT, 1, QueueKey.max_for_lt(2), 2**32 - 1) < hi


@pytest.mark.parametrize("partition", [0, 1, 65535])
@pytest.mark.parametrize("shard", SHARDS)
def test_stat_delete_range_up_to_max(partition: int, shard: ShardIdent) -> None:
    lo, hi = codec.stat_delete_range(shard, partition, QueueKey.MIN, QueueKey.MAX)
    for seqno in (0, 2**32 - 1):
        assert lo <= codec.stat_key(shard, partition, QueueKey.MAX, seqno) < hi
        assert lo <= codec.stat_key(shard, partition, QueueKey.MIN, seqno) < hi
    for other_shard in SHARDS:
        for other_partition in {0, 1, partition - 1, partition + 1} & set(range(65536)):
            if (other_partition, other_shard) == (partition, shard):
                continue
            for key in (QueueKey.MIN, QueueKey.MAX):
                raw = codec.stat_key(other_shard, other_partition, key, 0)
                assert not lo <= raw < hi


# --- diff tail ------------------------------------------------------------------------


@pytest.mark.parametrize("seqno", [0, 1, 2**32 - 1])
@pytest.mark.parametrize("key", KEYS)
def test_tail_key_round_trip(key: QueueKey, seqno: int) -> None:
    raw = codec.tail_key(RIGHT, key, seqno)
    assert len(raw) == codec.TAIL_KEY_LEN == 56
    assert raw[:12] == codec.shard_bytes(RIGHT)
    assert codec.decode_tail_key(raw) == (key, seqno)


@pytest.mark.parametrize("length", [0, 55, 57, 16])
def test_decode_tail_key_length(length: int) -> None:
    with pytest.raises(CorruptDataError) as info:
        codec.decode_tail_key(bytes(length))
    assert info.value.table == "diff_tail"


def test_tail_range_covers_max() -> None:
    lo, hi = codec.tail_range(LEFT, k(5))
    assert lo <= codec.tail_key(LEFT, k(5), 0) < hi
    assert lo <= codec.tail_key(LEFT, QueueKey.MAX, 2**32 - 1) < hi
    assert not lo <= codec.tail_key(LEFT, k(4, 255), 2**32 - 1) < hi
    for other in SHARDS:
        if other != LEFT:
            assert not lo <= codec.tail_key(other, QueueKey.MIN, 0) < hi
            assert not lo <= codec.tail_key(other, QueueKey.MAX, 2**32 - 1) < hi


def test_tail_range_inclusive() -> None:
    lo, hi = codec.tail_range_inclusive(LEFT, k(2), k(5))
    assert lo <= codec.tail_key(LEFT, k(2), 0) < hi
    assert lo <= codec.tail_key(LEFT, k(5), 2**32 - 1) < hi
    assert not lo <= codec.tail_key(LEFT, k(5).next_value(), 0) < hi
    assert not lo <= codec.tail_key(LEFT, QueueKey.max_for_lt(1), 2**32 - 1) < hi


@pytest.mark.parametrize("shard", SHARDS)
def test_tail_range_inclusive_up_to_max(shard: ShardIdent) -> None:
    lo, hi = codec.tail_range_inclusive(shard, QueueKey.MIN, QueueKey.MAX)
    assert lo <= codec.tail_key(shard, QueueKey.MIN, 0) < hi
    assert lo <= codec.tail_key(shard, QueueKey.MAX, 0) < hi
    assert lo <= codec.tail_key(shard, QueueKey.MAX, 2**32 - 1) < hi
    for other in SHARDS:
        if other != shard:
            assert not lo <= codec.tail_key(other, QueueKey.MIN, 0) < hi
            assert not lo <= codec.tail_key(other, QueueKey.MAX, 2**32 - 1) < hi


# --- diff info ------------------------------------------------------------------------


def make_info(seqno: int = 7, prev_hash: bytes | None = None) -> DiffInfo:
    return DiffInfo(
        min_message=k(1),
        max_message=QueueKey.MAX,
        shards_messages_count={ShardIdent.MASTERCHAIN: 1, ShardIdent.BASECHAIN: 2**40},
        hash=b"\x11" * 32,
        processed_to={LEFT: k(3), ShardIdent.MASTERCHAIN: QueueKey.MIN, RIGHT: QueueKey.MAX},
        router_src={1: frozenset({A, B}), 65535: frozenset({C})},
        router_dst={2: frozenset({D}), 3: frozenset()},
        seqno=seqno,
        prev_hash=prev_hash,
    )


@pytest.mark.parametrize("seqno", [0, 7, 2**32 - 1])
def test_diff_info_key(seqno: int) -> None:
    raw = codec.diff_info_key(RIGHT, seqno)
    assert len(raw) == codec.DIFF_INFO_KEY_LEN == 16
    assert codec.decode_diff_info_seqno(raw) == seqno
    lo, hi = codec.diff_info_shard_range(RIGHT)
    assert lo <= raw < hi
    assert not lo <= codec.diff_info_key(LEFT, seqno) < hi


@pytest.mark.parametrize("length", [0, 12, 15, 17])
def test_decode_diff_info_seqno_length(length: int) -> None:
    with pytest.raises(CorruptDataError) as info:
        codec.decode_diff_info_seqno(bytes(length))
    assert info.value.table == "diff_info"


@pytest.mark.parametrize("prev_hash", [None, b"\x22" * 32])
@pytest.mark.parametrize("partitions", [{}, {0: 3}, {0: 0, 1: 5, 2: 1, 65535: 0}])
def test_diff_info_round_trip(prev_hash: bytes | None, partitions: dict[int, int]) -> None:
    info = make_info(prev_hash=prev_hash)
    key = codec.diff_info_key(LEFT, info.seqno)
    value = codec.diff_info_value(info, partitions)
    decoded, decoded_partitions = codec.decode_diff_record(key, value)
    assert decoded == info
    assert decoded.prev_hash == prev_hash
    assert decoded_partitions == partitions
    assert codec.decode_diff_info(key, value) == info
    assert type(decoded.min_message) is QueueKey
    assert all(type(s) is ShardIdent for s in decoded.processed_to)
    assert all(type(a) is Address for addrs in decoded.router_src.values() for a in addrs)


def test_diff_info_value_is_deterministic() -> None:
    a = make_info()
    # same content, dicts built in another order
    b = DiffInfo(
        min_message=a.min_message,
        max_message=a.max_message,
        shards_messages_count=dict(reversed(a.shards_messages_count.items())),
        hash=a.hash,
        processed_to=dict(reversed(a.processed_to.items())),
        router_src=dict(reversed(a.router_src.items())),
        router_dst=dict(reversed(a.router_dst.items())),
        seqno=a.seqno,
    )
    assert codec.diff_info_value(a, {2: 0, 0: 4, 1: 1}) == codec.diff_info_value(
        b, {0: 4, 1: 1, 2: 0}
    )


def test_diff_info_empty_maps_round_trip() -> None:
    info = DiffInfo(QueueKey.MIN, QueueKey.MIN, {}, bytes(32), {}, {}, {}, 0)
    key = codec.diff_info_key(ShardIdent.MASTERCHAIN, 0)
    assert codec.decode_diff_record(key, codec.diff_info_value(info, {0: 1})) == (
        info,
        {0: 1},
    )


def _corrupt(key: bytes, value: bytes) -> None:
    with pytest.raises(CorruptDataError) as info:
        codec.decode_diff_record(key, value)
    assert info.value.table == "diff_info"
    assert info.value.key == key
    assert "diff_info" in str(info.value)
    assert key.hex() in str(info.value)


def test_diff_info_truncated_anywhere() -> None:
    info = make_info(prev_hash=b"\x33" * 32)
    key = codec.diff_info_key(LEFT, info.seqno)
    value = codec.diff_info_value(info, [0, 1])
    for length in range(len(value)):
        _corrupt(key, value[:length])


def test_diff_info_trailing_bytes() -> None:
    info = make_info()
    key = codec.diff_info_key(LEFT, info.seqno)
    _corrupt(key, codec.diff_info_value(info, {0: 1}) + b"\x00")


def test_diff_info_flipped_bytes_never_crash() -> None:
    info = make_info(prev_hash=b"\x33" * 32)
    key = codec.diff_info_key(LEFT, info.seqno)
    value = codec.diff_info_value(info, [0, 1])
    for position in range(len(value)):
        for mask in (0x01, 0x80, 0xFF):
            damaged = bytearray(value)
            damaged[position] ^= mask
            try:
                decoded, _ = codec.decode_diff_record(key, bytes(damaged))
            except CorruptDataError as exc:
                assert exc.table == "diff_info"
            else:
                assert isinstance(decoded, DiffInfo)


def test_diff_info_wrong_key() -> None:
    info = make_info(seqno=7)
    value = codec.diff_info_value(info, {0: 1})
    _corrupt(codec.diff_info_key(LEFT, 8), value)  # seqno differs from the key's
    _corrupt(codec.diff_info_key(LEFT, 7)[:-1], value)  # key too short


def _record(**changes: object) -> list[object]:
    """A valid raw record of make_info(), with fields replaced."""
    info = make_info()
    fields = list(msgpack.unpackb(codec.diff_info_value(info, {0: 1}), raw=False))
    names = [
        "version",
        "min",
        "max",
        "counts",
        "hash",
        "processed",
        "src",
        "dst",
        "seqno",
        "prev_hash",
        "partitions",
    ]
    for name, value in changes.items():
        fields[names.index(name)] = value
    return fields


@pytest.mark.parametrize(
    "record",
    [
        _record(version=2),
        _record(version=None),
        _record()[:10],
        [*_record(), None],
        _record(min=bytes(39)),
        _record(max="x"),
        _record(counts=[[bytes(11), 1]]),
        _record(counts=[[codec.shard_bytes(LEFT), None]]),
        _record(counts=[[bytes.fromhex("80000000" + "0000000000000000"), 1]]),
        _record(counts=5),
        _record(hash=bytes(31)),
        _record(hash=None),
        _record(processed=[[codec.shard_bytes(LEFT), bytes(41)]]),
        _record(processed=[[codec.shard_bytes(LEFT)]]),
        _record(src=[[70000, []]]),
        _record(src=[[1, [bytes(32)]]]),
        _record(dst=[[-1, []]]),
        _record(dst=[["1", []]]),
        _record(seqno="7"),
        _record(seqno=None),
        _record(prev_hash=bytes(31)),
        _record(prev_hash="x" * 32),
        _record(partitions=[[65536, 1]]),
        _record(partitions=[[0, -1]]),
        _record(partitions=[[0, True]]),
        _record(partitions=[0]),
        _record(partitions=None),
        {"a": 1},
        5,
        None,
        "record",
    ],
)
def test_diff_info_bad_records(record: object) -> None:
    key = codec.diff_info_key(LEFT, 7)
    _corrupt(key, msgpack.packb(record, use_bin_type=True))


@pytest.mark.parametrize("count", [-1, 1.5, "7", b"7", True])
def test_diff_info_bad_message_count(count: object) -> None:
    # A message count is a u64; anything else in its place is a corrupt record.
    key = codec.diff_info_key(LEFT, 7)
    record = _record(counts=[[codec.shard_bytes(LEFT), count]])
    _corrupt(key, msgpack.packb(record, use_bin_type=True))


@pytest.mark.parametrize("value", [b"", b"\xc1", b"\xff" * 10, b"\x9b", b"\x91\x01"])
def test_diff_info_garbage(value: bytes) -> None:
    _corrupt(codec.diff_info_key(LEFT, 7), value)


# --- commit pointers ------------------------------------------------------------------


@pytest.mark.parametrize("shard", SHARDS)
@pytest.mark.parametrize(
    "pointer", [CommitPointer(QueueKey.MIN, 0), CommitPointer(QueueKey.MAX, 2**32 - 1)]
)
def test_pointer_round_trip(shard: ShardIdent, pointer: CommitPointer) -> None:
    value = codec.pointer_value(pointer)
    assert len(value) == 44
    assert codec.decode_pointer(codec.shard_bytes(shard), value) == (shard, pointer)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (bytes(11), bytes(44)),
        (bytes(13), bytes(44)),
        (codec.shard_bytes(LEFT), bytes(43)),
        (codec.shard_bytes(LEFT), bytes(45)),
        (codec.shard_bytes(LEFT), b""),
        (bytes.fromhex("80000000" + "0000000000000000"), bytes(44)),  # invalid shard
    ],
)
def test_decode_pointer_corrupt(key: bytes, value: bytes) -> None:
    with pytest.raises(CorruptDataError) as info:
        codec.decode_pointer(key, value)
    assert info.value.table == "commit_pointers"
    assert info.value.key == key


# --- vars -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "block",
    [
        BlockId(ShardIdent.MASTERCHAIN, 0),
        BlockId(ShardIdent.MASTERCHAIN, 2**32 - 1, b"\x01" * 32, b"\x02" * 32),
        BlockId(LEFT, 12, bytes(range(32)), b"\xff" * 32),
    ],
)
def test_block_id_round_trip(block: BlockId) -> None:
    raw = codec.block_id_bytes(block)
    assert len(raw) == 80
    assert codec.decode_block_id(raw) == block


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        bytes(79),
        bytes(81),
        bytes.fromhex("80000000" + "0000000000000000") + bytes(68),  # invalid shard
    ],
)
def test_decode_block_id_corrupt(raw: bytes) -> None:
    with pytest.raises(CorruptDataError) as info:
        codec.decode_block_id(raw)
    assert info.value.table == "vars"
    assert info.value.key == codec.LAST_COMMITTED_MC_BLOCK


@pytest.mark.parametrize("value", [0, 1, 2**32 - 1])
def test_u32_round_trip(value: int) -> None:
    raw = codec.u32_value(value)
    assert len(raw) == 4
    assert codec.decode_u32(b"name", raw) == value


@pytest.mark.parametrize("length", [0, 3, 5, 8])
def test_decode_u32_corrupt(length: int) -> None:
    with pytest.raises(CorruptDataError) as info:
        codec.decode_u32(codec.SCHEMA_VERSION_KEY, bytes(length))
    assert info.value.table == "vars"
    assert info.value.key == codec.SCHEMA_VERSION_KEY


@pytest.mark.parametrize(
    "record",
    [
        {},
        {ShardIdent.MASTERCHAIN: {}},
        {
            ShardIdent.MASTERCHAIN: {ShardIdent.MASTERCHAIN: k(1), LEFT: k(2)},
            LEFT: {LEFT: QueueKey.MAX, RIGHT: QueueKey.MIN},
            RIGHT: {ShardIdent.MASTERCHAIN: k(9)},
        },
    ],
)
def test_commit_record_round_trip(record: dict[ShardIdent, dict[ShardIdent, QueueKey]]) -> None:
    decoded = codec.decode_commit_record(codec.commit_record_value(record))
    assert decoded == record
    assert all(type(s) is ShardIdent for s in decoded)


def _bad_commit_records() -> list[bytes]:
    good = codec.commit_record_value({LEFT: {RIGHT: k(1)}})
    return [
        b"",
        b"\xc1",
        good[:-1],
        good + b"\x00",
        msgpack.packb([2, []]),
        msgpack.packb([1]),
        msgpack.packb([1, [[bytes(12), []]]]),  # invalid shard
        msgpack.packb([1, [[codec.shard_bytes(LEFT), [[codec.shard_bytes(RIGHT), bytes(39)]]]]]),
        msgpack.packb(None),
    ]


@pytest.mark.parametrize("value", _bad_commit_records())
def test_decode_commit_record_corrupt(value: bytes) -> None:
    with pytest.raises(CorruptDataError) as info:
        codec.decode_commit_record(value)
    assert info.value.table == "vars"
    assert info.value.key == codec.COMMIT_RECORD
    assert info.value.reason.startswith("the stored value is malformed (")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"\xc1", "(FormatError)"),  # msgpack's error has no words of its own
        (b"\x81\xa1\x61\x01", "(KeyError: 0)"),
        (b"\x00\x00", "(ExtraData: unpack(b) received extra data.)"),
    ],
)
def test_an_undecodable_row_says_so_in_words(value: bytes, reason: str) -> None:
    """A corrupt diff-info row's reason says what is wrong before the decoder's terms
    (an outside audit saw "FormatError: " with nothing after it)."""
    key = codec.diff_info_key(LEFT, 1)
    with pytest.raises(CorruptDataError) as info:
        codec.decode_diff_info(key, value)
    assert info.value.reason == f"the stored value is malformed {reason}"
    assert f"at key {key.hex()}: the stored value is malformed {reason}; " in str(info.value)


@pytest.mark.parametrize(
    "bounds",
    [
        {},
        {(0, LEFT): k(1), (1, LEFT): k(1), (65535, ShardIdent.MASTERCHAIN): QueueKey.MAX},
        {(0, ShardIdent.MASTERCHAIN): QueueKey.MIN, (0, RIGHT): k(4)},
    ],
)
def test_gc_bounds_round_trip(bounds: dict[tuple[int, ShardIdent], QueueKey]) -> None:
    for name in (codec.GC_REQUESTED, codec.GC_EXECUTED):
        assert codec.decode_gc_bounds(name, codec.gc_bounds_value(bounds)) == bounds


def _bad_gc_bounds() -> list[bytes]:
    good = codec.gc_bounds_value({(0, LEFT): k(1)})
    return [
        b"",
        good[:-1],
        good + b"\x00",
        msgpack.packb([2, []]),
        msgpack.packb([1, [[70000, codec.shard_bytes(LEFT), codec.key_bytes(k(1))]]]),
        msgpack.packb([1, [[-1, codec.shard_bytes(LEFT), codec.key_bytes(k(1))]]]),
        msgpack.packb([1, [[0, bytes(12), codec.key_bytes(k(1))]]]),
        msgpack.packb([1, [[0, codec.shard_bytes(LEFT), bytes(8)]]]),
        msgpack.packb([1, [[0, codec.shard_bytes(LEFT)]]]),
        msgpack.packb("x"),
    ]


@pytest.mark.parametrize("value", _bad_gc_bounds())
@pytest.mark.parametrize("name", [codec.GC_REQUESTED, codec.GC_EXECUTED])
def test_decode_gc_bounds_corrupt(name: bytes, value: bytes) -> None:
    with pytest.raises(CorruptDataError) as info:
        codec.decode_gc_bounds(name, value)
    assert info.value.table == "vars"
    assert info.value.key == name
