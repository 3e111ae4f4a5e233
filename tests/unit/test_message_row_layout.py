"""The message row has one owner, ``imq.storage.codec``: the iterator and the C decode
(``imq/_speedups.c``) read it at codec's offsets. A change on one side only fails here."""

from __future__ import annotations

import re
from pathlib import Path

from imq import iterator
from imq.storage import cache, codec
from imq.types import Address, Message, QueueKey, ShardIdent

C_SOURCE = Path(iterator.__file__).with_name("_speedups.c")

PINNED = {
    "KEY_LEN": codec.MESSAGE_KEY_LEN,
    "QK_AT": codec.MESSAGE_PREFIX_LEN,
    "LT_LEN": codec.LT_LEN,
    "HASH_LEN": codec.HASH_LEN,
    "ADDR_LEN": codec.ADDRESS_LEN,
    "ACCOUNT_LEN": codec.ACCOUNT_LEN,
    "HEADER_LEN": codec.MESSAGE_VALUE_HEADER_LEN,
    "STAT_ENTRY_LEN": codec.STAT_ENTRY_LEN,
    "ROUTE_LEN": cache.ROUTE_LEN,
    "SHARD_LEN": codec.SHARD_LEN,
}


def _c_defines() -> dict[str, int]:
    text = C_SOURCE.read_text(encoding="utf-8")
    return {m[1]: int(m[2]) for m in re.finditer(r"^#define (\w+) (\d+)\b", text, re.M)}


def test_every_c_layout_define_equals_codec() -> None:
    assert _c_defines() == PINNED


def test_a_route_is_the_destination_header_the_merge_tests() -> None:
    # the workchain byte and the top 8 account bytes: all merge_fill's test reads
    assert cache.ROUTE_LEN == 1 + 8
    assert codec.MESSAGE_DST_AT == 0
    assert cache.ROUTE_LEN <= codec.MESSAGE_SRC_AT


def test_the_iterator_reads_at_codec_offsets() -> None:
    assert iterator._QK == codec.MESSAGE_PREFIX_LEN
    assert iterator._LT_END == codec.MESSAGE_LT_END
    assert iterator._KEY_LEN == codec.MESSAGE_KEY_LEN
    assert iterator._HEADER == codec.MESSAGE_VALUE_HEADER_LEN
    assert iterator._ADDR == codec.MESSAGE_SRC_AT


def test_the_offsets_describe_the_rows_codec_writes() -> None:
    shard = ShardIdent(0, 0x8000_0000_0000_0000)
    src, dst = Address(0, b"\x01" * 32), Address(-1, b"\x02" * 32)
    key = QueueKey(0x0102030405060708, b"\x09" * 32)
    [(k, v)] = codec.message_rows(shard, [Message(key, src, dst, b"body")])
    assert len(k) == codec.MESSAGE_KEY_LEN
    assert codec.MESSAGE_KEY_LT_HASH.unpack(k) == (key.lt, key.hash)
    assert k[codec.MESSAGE_LT_END :] == key.hash
    assert codec.decode_address(v[codec.MESSAGE_DST_AT : codec.MESSAGE_SRC_AT]) == dst
    assert codec.decode_address(v[codec.MESSAGE_SRC_AT : codec.MESSAGE_VALUE_HEADER_LEN]) == src
    assert v[codec.MESSAGE_VALUE_HEADER_LEN :] == b"body"
