"""Value types: constructor validation, keys and their bounds, text forms, shards, ordering."""

from __future__ import annotations

import dataclasses

import pytest

from imq.types import (
    DEFAULT_PARTITION,
    Address,
    BlockId,
    BlockIdShort,
    CommitPointer,
    DiffInfo,
    DiffZone,
    IteratedMessage,
    Message,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    TopBlock,
    check_partition,
)

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
FULL = 0x8000_0000_0000_0000
ZERO32 = bytes(32)
FF32 = b"\xff" * 32
H1 = bytes(31) + b"\x01"
ACCOUNT = bytes(range(32))


def account(first: int, fill: int = 0) -> bytes:
    return bytes((first,)) + bytes((fill,)) * 31


# --- QueueKey -------------------------------------------------------------------------


@pytest.mark.parametrize("lt", [0, 1, 2**32, U64_MAX])
def test_queue_key_accepts_u64_range(lt: int) -> None:
    key = QueueKey(lt, H1)
    assert key.lt == lt
    assert key.hash == H1
    assert key == (lt, H1)


@pytest.mark.parametrize(
    ("lt", "hash_", "error"),
    [
        (-1, ZERO32, ValueError),
        (2**64, ZERO32, ValueError),
        (True, ZERO32, TypeError),
        (False, ZERO32, TypeError),
        (1.0, ZERO32, TypeError),
        ("1", ZERO32, TypeError),
        (None, ZERO32, TypeError),
        (1, bytes(31), ValueError),
        (1, bytes(33), ValueError),
        (1, b"", ValueError),
        (1, bytearray(32), TypeError),
        (1, memoryview(bytes(32)), TypeError),
        (1, "00" * 32, TypeError),
        (1, None, TypeError),
    ],
)
def test_queue_key_rejects(lt: object, hash_: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        QueueKey(lt, hash_)  # type: ignore[arg-type]


def test_queue_key_constants() -> None:
    assert QueueKey(0, ZERO32) == QueueKey.MIN
    assert QueueKey(U64_MAX, FF32) == QueueKey.MAX
    assert type(QueueKey.MIN) is QueueKey
    assert type(QueueKey.MAX) is QueueKey
    assert QueueKey.MIN < QueueKey.MAX


@pytest.mark.parametrize("lt", [0, 7, U64_MAX])
def test_min_max_for_lt(lt: int) -> None:
    lo, hi = QueueKey.min_for_lt(lt), QueueKey.max_for_lt(lt)
    assert lo == QueueKey(lt, ZERO32)
    assert hi == QueueKey(lt, FF32)
    assert type(lo) is QueueKey
    assert type(hi) is QueueKey
    assert lo <= QueueKey(lt, H1) <= hi


@pytest.mark.parametrize("lt", [-1, 2**64])
def test_min_max_for_lt_validate(lt: int) -> None:
    with pytest.raises(ValueError):
        QueueKey.min_for_lt(lt)
    with pytest.raises(ValueError):
        QueueKey.max_for_lt(lt)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (QueueKey(5, ZERO32), QueueKey(5, H1)),
        (QueueKey(5, bytes(31) + b"\xfe"), QueueKey(5, bytes(31) + b"\xff")),
        # a carry into byte 30
        (QueueKey(5, bytes(31) + b"\xff"), QueueKey(5, bytes(30) + b"\x01\x00")),
        # a carry across several bytes
        (QueueKey(5, b"\x12" + b"\xff" * 31), QueueKey(5, b"\x13" + bytes(31))),
        (QueueKey(5, b"\xab\xcd" + b"\xff" * 30), QueueKey(5, b"\xab\xce" + bytes(30))),
        # all-0xff hash rolls over into the next lt
        (QueueKey(5, FF32), QueueKey(6, ZERO32)),
        (QueueKey(U64_MAX - 1, FF32), QueueKey(U64_MAX, ZERO32)),
        (QueueKey.MIN, QueueKey(0, H1)),
        (QueueKey(U64_MAX, b"\xff" * 31 + b"\xfe"), QueueKey.MAX),
        # saturation
        (QueueKey.MAX, QueueKey.MAX),
    ],
)
def test_next_value(before: QueueKey, after: QueueKey) -> None:
    nxt = before.next_value()
    assert nxt == after
    assert type(nxt) is QueueKey
    assert len(nxt.hash) == 32
    if before != QueueKey.MAX:
        assert before < nxt


def test_queue_key_order_is_lt_then_hash() -> None:
    keys = [
        QueueKey(2, ZERO32),
        QueueKey(1, FF32),
        QueueKey(1, H1),
        QueueKey(1, ZERO32),
        QueueKey(0, FF32),
    ]
    assert sorted(keys) == keys[::-1]
    assert QueueKey(1, FF32) < QueueKey(2, ZERO32)
    # the hash compares as raw bytes, first byte first
    assert QueueKey(1, b"\x01" + bytes(31)) > QueueKey(1, bytes(31) + b"\xff")


def test_queue_key_text_forms() -> None:
    key = QueueKey(42, bytes.fromhex("deadbeef") + bytes(28))
    assert str(key) == "42:deadbeef" + "00" * 28  # lossless, see test_text_forms.py
    assert "42" in repr(key)
    assert "deadbeef" + "00" * 28 in repr(key)


def test_queue_key_byte_form_round_trips_in_key_order() -> None:
    keys = [QueueKey(0, ZERO32), QueueKey(1, ZERO32), QueueKey(1, H1), QueueKey(U64_MAX, FF32)]
    forms = [k.to_bytes() for k in keys]
    assert forms[1] == (1).to_bytes(8, "big") + ZERO32
    assert all(len(f) == 40 for f in forms)
    assert sorted(forms) == forms  # byte order is key order
    for key, form in zip(keys, forms, strict=True):
        back = QueueKey.from_bytes(form)
        assert back == key
        assert type(back) is QueueKey
        assert type(back.lt) is int
        assert type(back.hash) is bytes


def test_queue_key_from_bytes_calls_as_a_python_classmethod_would() -> None:
    key = QueueKey(3, H1)
    assert QueueKey.from_bytes(data=key.to_bytes()) == key
    assert key.from_bytes(key.to_bytes()) == key  # through an instance: its class
    with pytest.raises(TypeError):
        QueueKey.from_bytes()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        QueueKey.from_bytes(key.to_bytes(), key.to_bytes())  # type: ignore[call-arg]


class _Key(bytes):
    pass


def test_queue_key_from_bytes_takes_bytes_subclasses_and_subclasses_build_their_own() -> None:
    key = QueueKey(9, H1)
    back = QueueKey.from_bytes(_Key(key.to_bytes()))
    assert back == key
    assert type(back.hash) is bytes

    class Sub(QueueKey):
        __slots__ = ()

    assert type(Sub.from_bytes(key.to_bytes())) is Sub


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        (bytes(39), ValueError, "40 bytes.*got 39"),
        (bytes(41), ValueError, "40 bytes.*got 41"),
        (b"", ValueError, "got 0"),
        (bytearray(40), TypeError, "takes bytes, got bytearray"),
        (memoryview(bytes(40)), TypeError, "got memoryview"),
        ("0" * 40, TypeError, "got str"),
        (None, TypeError, "got NoneType"),
    ],
)
def test_queue_key_from_bytes_rejects(data: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        QueueKey.from_bytes(data)  # type: ignore[arg-type]


def test_queue_key_is_immutable_and_hashable() -> None:
    key = QueueKey(1, H1)
    with pytest.raises(AttributeError):
        key.lt = 2  # type: ignore[misc]
    assert {key: 1}[QueueKey(1, H1)] == 1
    assert len({QueueKey(1, H1), QueueKey(1, H1), QueueKey(2, H1)}) == 2


# --- Address --------------------------------------------------------------------------


@pytest.mark.parametrize("workchain", [-128, -1, 0, 127])
def test_address_accepts_i8(workchain: int) -> None:
    address = Address(workchain, ACCOUNT)
    assert address.workchain == workchain
    assert address.account == ACCOUNT


@pytest.mark.parametrize(
    ("workchain", "account_", "error"),
    [
        (-129, ACCOUNT, ValueError),
        (128, ACCOUNT, ValueError),
        (2**31, ACCOUNT, ValueError),
        (True, ACCOUNT, TypeError),
        (0.0, ACCOUNT, TypeError),
        ("0", ACCOUNT, TypeError),
        (0, bytes(31), ValueError),
        (0, bytes(33), ValueError),
        (0, bytearray(32), TypeError),
        (0, "00" * 32, TypeError),
    ],
)
def test_address_rejects(workchain: object, account_: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        Address(workchain, account_)  # type: ignore[arg-type]


def test_address_prefix() -> None:
    address = Address(0, bytes.fromhex("0102030405060708") + b"\xff" * 24)
    assert address.prefix == 0x0102030405060708
    assert Address(0, ZERO32).prefix == 0
    assert Address(0, FF32).prefix == U64_MAX


@pytest.mark.parametrize("workchain", [-128, -1, 0, 5, 127])
def test_address_text_round_trip(workchain: int) -> None:
    address = Address(workchain, ACCOUNT)
    text = str(address)
    assert text == f"{workchain}:{ACCOUNT.hex()}"
    assert Address.parse(text) == address
    assert type(Address.parse(text)) is Address


def test_address_parse_accepts_upper_case_hex() -> None:
    assert Address.parse("0:" + ACCOUNT.hex().upper()) == Address(0, ACCOUNT)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0",
        ACCOUNT.hex(),
        "0:",
        "0:" + "00" * 31,
        "0:" + "00" * 33,
        "0:" + "zz" * 32,
        "x:" + "00" * 32,
        ":" + "00" * 32,
        "128:" + "00" * 32,
        "-129:" + "00" * 32,
        "0:" + "00" * 31 + "0",
    ],
)
def test_address_parse_errors(text: str) -> None:
    with pytest.raises(ValueError):
        Address.parse(text)


def test_address_order_is_signed_workchain_then_account() -> None:
    addresses = [
        Address(127, ZERO32),
        Address(0, FF32),
        Address(0, ZERO32),
        Address(-1, FF32),
        Address(-1, ZERO32),
        Address(-128, FF32),
    ]
    assert sorted(addresses) == addresses[::-1]


# --- ShardIdent -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workchain", "prefix"),
    [
        (0, FULL),
        (-1, FULL),
        (0, 0x4000_0000_0000_0000),
        (0, 0xC000_0000_0000_0000),
        (0, 0x0000_0000_0000_0008),
        (0, 0xFFFF_FFFF_FFFF_FFF8),
        (-(2**31), FULL),
        (2**31 - 1, 0x2000_0000_0000_0000),
        (-2, 0x6000_0000_0000_0000),
    ],
)
def test_shard_accepts(workchain: int, prefix: int) -> None:
    shard = ShardIdent(workchain, prefix)
    assert (shard.workchain, shard.prefix) == (workchain, prefix)


@pytest.mark.parametrize(
    ("workchain", "prefix", "error"),
    [
        (0, 0, ValueError),
        (0, 0x8000_0000_0000_0001, ValueError),
        (0, 0x8000_0000_0000_0002, ValueError),
        (0, 0x8000_0000_0000_0004, ValueError),
        (0, 0x4, ValueError),
        (0, 2**64, ValueError),
        (0, 2**64 + FULL, ValueError),
        (0, -FULL, ValueError),
        (2**31, FULL, ValueError),
        (-(2**31) - 1, FULL, ValueError),
        (-1, 0x4000_0000_0000_0000, ValueError),
        (-1, 0xC000_0000_0000_0000, ValueError),
        (True, FULL, TypeError),
        (0, True, TypeError),
        (0.0, FULL, TypeError),
        (0, float(FULL), TypeError),
        ("0", FULL, TypeError),
        (0, "8000000000000000", TypeError),
    ],
)
def test_shard_rejects(workchain: object, prefix: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        ShardIdent(workchain, prefix)  # type: ignore[arg-type]


def test_shard_constants() -> None:
    assert ShardIdent(-1, FULL) == ShardIdent.MASTERCHAIN
    assert ShardIdent(0, FULL) == ShardIdent.BASECHAIN
    assert type(ShardIdent.MASTERCHAIN) is ShardIdent
    assert ShardIdent.full(0) == ShardIdent.BASECHAIN
    assert ShardIdent.full(-1) == ShardIdent.MASTERCHAIN
    assert ShardIdent.full(7) == ShardIdent(7, FULL)
    assert ShardIdent.MASTERCHAIN.is_masterchain
    assert not ShardIdent.BASECHAIN.is_masterchain
    assert ShardIdent.BASECHAIN.is_full
    assert not ShardIdent(0, 0x4000_0000_0000_0000).is_full
    with pytest.raises(ValueError):
        ShardIdent.full(2**31)


@pytest.mark.parametrize(
    ("prefix", "length"),
    [
        (FULL, 0),
        (0x4000_0000_0000_0000, 1),
        (0xC000_0000_0000_0000, 1),
        (0x2000_0000_0000_0000, 2),
        (0x6000_0000_0000_0000, 2),
        (0xE000_0000_0000_0000, 2),
        (0x1000_0000_0000_0000, 3),
        (0x0000_0000_0000_0010, 59),
        (0x0000_0000_0000_0008, 60),
        (0xFFFF_FFFF_FFFF_FFF8, 60),
    ],
)
def test_prefix_len(prefix: int, length: int) -> None:
    assert ShardIdent(0, prefix).prefix_len == length


LEFT = ShardIdent(0, 0x4000_0000_0000_0000)  # accounts 0x00.. - 0x7f..
RIGHT = ShardIdent(0, 0xC000_0000_0000_0000)  # accounts 0x80.. - 0xff..
QUARTER_1 = ShardIdent(0, 0x6000_0000_0000_0000)  # accounts 0x40.. - 0x7f..


@pytest.mark.parametrize(
    ("shard", "address", "expected"),
    [
        (ShardIdent.BASECHAIN, Address(0, ZERO32), True),
        (ShardIdent.BASECHAIN, Address(0, FF32), True),
        (ShardIdent.BASECHAIN, Address(-1, ZERO32), False),
        (ShardIdent.BASECHAIN, Address(1, ZERO32), False),
        (ShardIdent.MASTERCHAIN, Address(-1, FF32), True),
        (ShardIdent.MASTERCHAIN, Address(0, FF32), False),
        (ShardIdent.full(5), Address(5, account(0x33)), True),
        (LEFT, Address(0, ZERO32), True),
        (LEFT, Address(0, account(0x7F, 0xFF)), True),
        (LEFT, Address(0, account(0x80)), False),
        (LEFT, Address(-1, ZERO32), False),
        (RIGHT, Address(0, account(0x80)), True),
        (RIGHT, Address(0, FF32), True),
        (RIGHT, Address(0, account(0x7F, 0xFF)), False),
        (QUARTER_1, Address(0, account(0x40)), True),
        (QUARTER_1, Address(0, account(0x7F, 0xFF)), True),
        (QUARTER_1, Address(0, account(0x3F, 0xFF)), False),
        (QUARTER_1, Address(0, account(0x80)), False),
        (ShardIdent(3, 0x6000_0000_0000_0000), Address(3, account(0x50)), True),
        (ShardIdent(3, 0x6000_0000_0000_0000), Address(0, account(0x50)), False),
        # the deepest shard: 60 prefix bits
        (
            ShardIdent(0, 0x1234_5678_9ABC_DEF8),
            Address(0, bytes.fromhex("123456789abcdef0") + FF32[:24]),
            True,
        ),
        (
            ShardIdent(0, 0x1234_5678_9ABC_DEF8),
            Address(0, bytes.fromhex("123456789abcdeff") + ZERO32[:24]),
            True,
        ),
        (
            ShardIdent(0, 0x1234_5678_9ABC_DEF8),
            Address(0, bytes.fromhex("123456789abcdee0") + ZERO32[:24]),
            False,
        ),
    ],
)
def test_contains(shard: ShardIdent, address: Address, expected: bool) -> None:
    assert shard.contains(address) is expected


@pytest.mark.parametrize("address", ["0:" + "00" * 32, None, (0, ZERO32)])
def test_contains_rejects_what_is_not_an_address(address: object) -> None:
    with pytest.raises(TypeError, match="Address"):
        ShardIdent.BASECHAIN.contains(address)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("shard", "account_prefix", "expected"),
    [
        (ShardIdent.BASECHAIN, 0, True),
        (ShardIdent.BASECHAIN, U64_MAX, True),
        (LEFT, 0x7FFF_FFFF_FFFF_FFFF, True),
        (LEFT, 0x8000_0000_0000_0000, False),
        (RIGHT, 0x8000_0000_0000_0000, True),
        (RIGHT, 0x7FFF_FFFF_FFFF_FFFF, False),
        (QUARTER_1, 0x4000_0000_0000_0000, True),
        (QUARTER_1, 0x3FFF_FFFF_FFFF_FFFF, False),
        # the workchain is not checked
        (ShardIdent(7, 0x4000_0000_0000_0000), 0x1000_0000_0000_0000, True),
        (ShardIdent.MASTERCHAIN, 0x1000_0000_0000_0000, True),
    ],
)
def test_contains_prefix(shard: ShardIdent, account_prefix: int, expected: bool) -> None:
    assert shard.contains_prefix(account_prefix) is expected


def test_split_halves_partition_the_accounts() -> None:
    for first in range(256):
        address = Address(0, account(first, first))
        assert LEFT.contains(address) != RIGHT.contains(address)
        assert ShardIdent.BASECHAIN.contains(address)


@pytest.mark.parametrize(
    ("shard", "text"),
    [
        (ShardIdent.BASECHAIN, "0:8000000000000000"),
        (ShardIdent.MASTERCHAIN, "-1:8000000000000000"),
        (LEFT, "0:4000000000000000"),
        (ShardIdent(0, 8), "0:0000000000000008"),
        (ShardIdent(-(2**31), FULL), "-2147483648:8000000000000000"),
        (ShardIdent(2**31 - 1, 0xFFFF_FFFF_FFFF_FFF8), "2147483647:fffffffffffffff8"),
    ],
)
def test_shard_text_round_trip(shard: ShardIdent, text: str) -> None:
    assert str(shard) == text
    parsed = ShardIdent.parse(text)
    assert parsed == shard
    assert type(parsed) is ShardIdent


def test_shard_parse_accepts_upper_case_hex() -> None:
    assert ShardIdent.parse("0:C000000000000000") == RIGHT


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0",
        "0:",
        ":8000000000000000",
        "x:8000000000000000",
        "0:xyz",
        "0:0000000000000000",
        "0:8000000000000001",
        "-1:4000000000000000",
        "0:10000000000000000",
        "2147483648:8000000000000000",
    ],
)
def test_shard_parse_errors(text: str) -> None:
    with pytest.raises(ValueError):
        ShardIdent.parse(text)


def test_shard_order_is_signed_workchain_then_prefix() -> None:
    assert ShardIdent.MASTERCHAIN < ShardIdent.BASECHAIN
    shards = [
        ShardIdent(1, 0x4000_0000_0000_0000),
        ShardIdent(0, 0xC000_0000_0000_0000),
        ShardIdent(0, FULL),
        ShardIdent(0, 0x4000_0000_0000_0000),
        ShardIdent(-1, FULL),
        ShardIdent(-(2**31), FULL),
    ]
    assert sorted(shards) == shards[::-1]


def test_shard_text_forms() -> None:
    assert repr(ShardIdent.BASECHAIN) == "ShardIdent(0:8000000000000000)"
    assert repr(Address(0, ZERO32)) == f"Address(0:{'00' * 32})"


# --- partitions -----------------------------------------------------------------------


@pytest.mark.parametrize("partition", [0, 1, 65535])
def test_check_partition_accepts(partition: int) -> None:
    assert check_partition(partition) == partition


@pytest.mark.parametrize(
    ("partition", "error"),
    [(-1, ValueError), (65536, ValueError), (True, TypeError), ("1", TypeError), (1.0, TypeError)],
)
def test_check_partition_rejects(partition: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        check_partition(partition)


# --- blocks ---------------------------------------------------------------------------


@pytest.mark.parametrize("seqno", [0, 1, U32_MAX])
def test_block_ids_accept_u32_seqno(seqno: int) -> None:
    assert BlockIdShort(ShardIdent.BASECHAIN, seqno).seqno == seqno
    assert BlockId(ShardIdent.BASECHAIN, seqno).seqno == seqno


@pytest.mark.parametrize(
    ("seqno", "error"),
    [(-1, ValueError), (2**32, ValueError), (True, TypeError), (1.0, TypeError), ("1", TypeError)],
)
def test_block_ids_reject_seqno(seqno: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        BlockIdShort(ShardIdent.BASECHAIN, seqno)  # type: ignore[arg-type]
    with pytest.raises(error):
        BlockId(ShardIdent.BASECHAIN, seqno)  # type: ignore[arg-type]


@pytest.mark.parametrize("shard", [(0, FULL), "0:8000000000000000", None])
def test_block_ids_reject_shard(shard: object) -> None:
    with pytest.raises(TypeError):
        BlockIdShort(shard, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BlockId(shard, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("root", "file", "error"),
    [
        (bytes(31), ZERO32, ValueError),
        (ZERO32, bytes(33), ValueError),
        (bytearray(32), ZERO32, TypeError),
        (ZERO32, "00" * 32, TypeError),
    ],
)
def test_block_id_rejects_hashes(root: object, file: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        BlockId(ShardIdent.BASECHAIN, 1, root, file)  # type: ignore[arg-type]


def test_block_id_defaults_short_and_masterchain() -> None:
    block = BlockId(ShardIdent.BASECHAIN, 5)
    assert block.root_hash == ZERO32
    assert block.file_hash == ZERO32
    assert block.short == BlockIdShort(ShardIdent.BASECHAIN, 5)
    assert not block.is_masterchain
    assert BlockId(ShardIdent.MASTERCHAIN, 5).is_masterchain
    assert str(BlockIdShort(LEFT, 9)) == "0:4000000000000000:9"


@pytest.mark.parametrize(
    "block",
    [
        BlockId(ShardIdent.BASECHAIN, 0),
        BlockId(ShardIdent.MASTERCHAIN, U32_MAX, FF32, ACCOUNT),
        BlockId(ShardIdent(-7, 0x0000_0000_0000_0008), 12345, ACCOUNT, H1),
    ],
)
def test_block_id_text_round_trip(block: BlockId) -> None:
    text = str(block)
    wc, prefix, seqno, root, file = text.split(":")
    assert (int(wc), int(prefix, 16), int(seqno)) == (
        block.shard.workchain,
        block.shard.prefix,
        block.seqno,
    )
    assert len(prefix) == 16
    assert (root, file) == (block.root_hash.hex(), block.file_hash.hex())
    assert BlockId.parse(text) == block


def test_block_id_text_exact() -> None:
    block = BlockId(ShardIdent.BASECHAIN, 7, ACCOUNT, FF32)
    assert str(block) == f"0:8000000000000000:7:{ACCOUNT.hex()}:{'ff' * 32}"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0:8000000000000000",
        f"0:8000000000000000:7:{'00' * 32}",
        f"0:8000000000000000:7:{'00' * 32}:{'00' * 32}:extra",
        f"0:8000000000000000:x:{'00' * 32}:{'00' * 32}",
        f"0:8000000000000000:-1:{'00' * 32}:{'00' * 32}",
        f"0:8000000000000000:4294967296:{'00' * 32}:{'00' * 32}",
        f"0:0000000000000000:7:{'00' * 32}:{'00' * 32}",
        f"-1:4000000000000000:7:{'00' * 32}:{'00' * 32}",
        f"x:8000000000000000:7:{'00' * 32}:{'00' * 32}",
        f"0:8000000000000000:7:{'00' * 31}:{'00' * 32}",
        f"0:8000000000000000:7:{'00' * 32}:{'zz' * 32}",
    ],
)
def test_block_id_parse_errors(text: str) -> None:
    with pytest.raises(ValueError):
        BlockId.parse(text)


def test_block_id_order_and_hash() -> None:
    a = BlockId(ShardIdent.MASTERCHAIN, 9)
    b = BlockId(ShardIdent.BASECHAIN, 1)
    c = BlockId(ShardIdent.BASECHAIN, 2)
    assert sorted([c, b, a]) == [a, b, c]
    assert BlockIdShort(ShardIdent.MASTERCHAIN, 9) < BlockIdShort(ShardIdent.BASECHAIN, 1)
    assert len({a, BlockId(ShardIdent.MASTERCHAIN, 9), b}) == 2
    assert {a.short: 1}[BlockIdShort(ShardIdent.MASTERCHAIN, 9)] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.seqno = 3  # type: ignore[misc]


# --- TopBlock, CommitPointer, ranges, messages ------------------------------------------


def test_top_block() -> None:
    block = BlockId(ShardIdent.BASECHAIN, 3)
    top = TopBlock(block, 10)
    assert top.updated is True
    assert TopBlock(block, 10, updated=False).updated is False
    assert hash(top) == hash(TopBlock(block, 10))


@pytest.mark.parametrize(
    ("block", "ref", "updated", "error"),
    [
        (BlockIdShort(ShardIdent.BASECHAIN, 3), 1, True, TypeError),
        (BlockId(ShardIdent.BASECHAIN, 3), -1, True, ValueError),
        (BlockId(ShardIdent.BASECHAIN, 3), 2**32, True, ValueError),
        (BlockId(ShardIdent.BASECHAIN, 3), True, True, TypeError),
        (BlockId(ShardIdent.BASECHAIN, 3), 1, 1, TypeError),
        (BlockId(ShardIdent.BASECHAIN, 3), 1, None, TypeError),
    ],
)
def test_top_block_rejects(
    block: object, ref: object, updated: object, error: type[Exception]
) -> None:
    with pytest.raises(error):
        TopBlock(block, ref, updated)  # type: ignore[arg-type]


def test_commit_pointer() -> None:
    pointer = CommitPointer(QueueKey(1, H1), 4)
    assert pointer == CommitPointer(QueueKey(1, H1), 4)
    assert {pointer} == {CommitPointer(QueueKey(1, H1), 4)}
    assert CommitPointer(QueueKey(1, H1), 9) < CommitPointer(QueueKey(2, ZERO32), 0)
    with pytest.raises(TypeError):
        CommitPointer((1, H1), 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CommitPointer(QueueKey(1, H1), -1)
    with pytest.raises(ValueError):
        CommitPointer(QueueKey(1, H1), 2**32)
    with pytest.raises(TypeError):
        CommitPointer(QueueKey(1, H1), True)


def test_queue_shard_range() -> None:
    r = QueueShardRange(ShardIdent.BASECHAIN, QueueKey.MIN, QueueKey.MAX)
    assert (r.shard, r.from_key, r.to_key) == (ShardIdent.BASECHAIN, QueueKey.MIN, QueueKey.MAX)
    assert hash(r) == hash(QueueShardRange(ShardIdent.BASECHAIN, QueueKey.MIN, QueueKey.MAX))
    with pytest.raises(TypeError):
        QueueShardRange((0, FULL), QueueKey.MIN, QueueKey.MAX)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        QueueShardRange(ShardIdent.BASECHAIN, (0, ZERO32), QueueKey.MAX)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        QueueShardRange(ShardIdent.BASECHAIN, QueueKey.MIN, None)  # type: ignore[arg-type]


SRC = Address(0, account(1))
DST = Address(-1, account(2))


def test_message() -> None:
    key = QueueKey(3, H1)
    message = Message(key, SRC, DST)
    assert message.body == b""
    assert (message.key, message.src, message.dst) == (key, SRC, DST)
    assert Message(key, SRC, DST, b"x").body == b"x"
    assert hash(message) == hash(Message(key, SRC, DST))
    assert "1B" in repr(Message(key, SRC, DST, b"x"))
    item = IteratedMessage(ShardIdent.BASECHAIN, message)
    assert item.source == ShardIdent.BASECHAIN
    assert item.message == message


@pytest.mark.parametrize(
    ("key", "src", "dst", "body"),
    [
        ((3, H1), SRC, DST, b""),
        (QueueKey(3, H1), (0, account(1)), DST, b""),
        (QueueKey(3, H1), SRC, (0, account(2)), b""),
        (QueueKey(3, H1), SRC, DST, bytearray(b"x")),
        (QueueKey(3, H1), SRC, DST, "x"),
        (QueueKey(3, H1), SRC, DST, None),
    ],
)
def test_message_rejects(key: object, src: object, dst: object, body: object) -> None:
    with pytest.raises(TypeError):
        Message(key, src, dst, body)  # type: ignore[arg-type]


def test_diff_zone() -> None:
    assert {z.name for z in DiffZone} == {"COMMITTED", "UNCOMMITTED", "BOTH"}


# --- DiffInfo -------------------------------------------------------------------------


def make_info(
    router_src: dict[int, frozenset[Address]], router_dst: dict[int, frozenset[Address]]
) -> DiffInfo:
    return DiffInfo(
        min_message=QueueKey(1, ZERO32),
        max_message=QueueKey(2, ZERO32),
        shards_messages_count={ShardIdent.BASECHAIN: 2},
        hash=H1,
        processed_to={ShardIdent.BASECHAIN: QueueKey(1, ZERO32)},
        router_src=router_src,
        router_dst=router_dst,
        seqno=4,
    )


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        ({}, {}, {0}),
        ({1: frozenset({SRC})}, {}, {0, 1}),
        ({}, {7: frozenset({DST})}, {0, 7}),
        (
            {2: frozenset({SRC}), 3: frozenset({DST})},
            {3: frozenset({SRC}), 9: frozenset()},
            {0, 2, 3, 9},
        ),
    ],
)
def test_diff_info_partitions(
    src: dict[int, frozenset[Address]], dst: dict[int, frozenset[Address]], expected: set[int]
) -> None:
    info = make_info(src, dst)
    assert info.partitions == frozenset(expected)
    assert DEFAULT_PARTITION in info.partitions


def test_diff_info_compares_structurally() -> None:
    a = make_info({1: frozenset({SRC})}, {})
    b = make_info({1: frozenset({SRC})}, {})
    assert a == b
    assert a.prev_hash is None
    assert a != make_info({2: frozenset({SRC})}, {})
    assert a != dataclasses.replace(a, prev_hash=H1)
    # API.md: value types are hashable (equal infos hash equal, dict fields and all).
    assert hash(a) == hash(b)
    assert len({a, b, dataclasses.replace(a, seqno=5)}) == 2


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"seqno": -1}, ValueError),
        ({"seqno": True}, TypeError),
        ({"hash": bytes(31)}, ValueError),
        ({"min_message": (1, ZERO32)}, TypeError),
        ({"prev_hash": bytes(5)}, ValueError),
        ({"shards_messages_count": {ShardIdent.BASECHAIN: -1}}, ValueError),
        ({"router_dst": {70000: frozenset({SRC})}}, ValueError),
    ],
    ids=[
        "seqno-negative",
        "seqno-bool",
        "hash-31",
        "min-tuple",
        "prev-hash-5",
        "count-neg",
        "part",
    ],
)
def test_diff_info_validates(changes: dict[str, object], error: type[Exception]) -> None:
    # API.md: value types are "validated on construction"; DiffInfo is one of them.
    base = make_info({}, {})
    with pytest.raises(error):
        dataclasses.replace(base, **changes)  # type: ignore[arg-type]


# --- wrong types get a TypeError naming them, never an AttributeError or IndexError ----


@pytest.mark.parametrize("parse", [QueueKey, ShardIdent, Address, BlockIdShort, BlockId])
@pytest.mark.parametrize("text", [None, b"0:8000000000000000", 12])
def test_parse_takes_text_only(parse: type, text: object) -> None:
    with pytest.raises(TypeError, match=rf"{parse.__name__}\.parse takes a str"):
        parse.parse(text)


def test_contains_takes_an_address_only() -> None:
    shard = ShardIdent(0, FULL)
    assert shard.contains(Address(0, ACCOUNT))
    for other in (ShardIdent(0, FULL), (0, ACCOUNT), None):
        with pytest.raises(TypeError, match="contains takes an Address"):
            shard.contains(other)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field", ["shards_messages_count", "processed_to", "router_src", "router_dst"]
)
@pytest.mark.parametrize("value", [None, [1], "x"])
def test_diff_info_dict_fields_must_be_mappings(field: str, value: object) -> None:
    with pytest.raises(TypeError, match=rf"DiffInfo\.{field} must be a mapping"):
        dataclasses.replace(make_info({}, {}), **{field: value})  # type: ignore[arg-type]
