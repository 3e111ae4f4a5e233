"""The compiled decode (imq._speedups) builds exactly what the pure-Python decode builds."""

from __future__ import annotations

import shutil
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from imq import iterator
from imq.errors import CorruptDataError
from imq.storage import codec
from imq.types import Address, IteratedMessage, Message, QueueKey, ShardIdent

pytestmark = pytest.mark.skipif(
    not iterator.COMPILED and shutil.which("cc") is None,
    reason="no C compiler on this machine, so imq._speedups was not built",
)

SHARD = ShardIdent(0, 0x4000_0000_0000_0000)

addresses = st.builds(Address, st.integers(-128, 127), st.binary(min_size=32, max_size=32))
messages = st.builds(
    Message,
    st.builds(QueueKey, st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32)),
    addresses,
    addresses,
    st.binary(max_size=300),
)


def test_the_compiled_decode_is_in_use() -> None:
    # A compiler is present (the skip above), so `pip install` must have built it.
    assert iterator.COMPILED


@given(st.lists(messages, min_size=1, max_size=80), st.integers(0, 65535))
def test_compiled_equals_pure_python(batch: list[Message], partition: int) -> None:
    rows = codec.message_rows(SHARD, batch, lambda _s, _d: partition)
    keys, values = [k for k, _ in rows], [v for _, v in rows]
    compiled = iterator._decode_run(keys, values, SHARD, {})
    pure = iterator._decode(keys, values, SHARD, {})
    assert compiled == pure == [IteratedMessage(SHARD, m) for m in batch]
    for c in compiled:
        assert type(c) is IteratedMessage
        assert type(c.message) is Message
        assert type(c.message.key) is QueueKey
        assert type(c.message.src) is type(c.message.dst) is Address


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (b"\x00" * 53, b"\x00" * 66),  # key one byte short
        (b"\x00" * 55, b"\x00" * 66),  # key one byte long
        (b"\x00" * 54, b"\x00" * 65),  # value shorter than its header
    ],
)
def test_bad_rows_raise_corrupt_data_in_both(key: bytes, value: bytes) -> None:
    good_key = codec.message_key(0, SHARD, QueueKey(1, b"\x01" * 32))
    good_value = b"\x80" * 66
    for decode in (iterator._decode_run, iterator._decode):
        with pytest.raises(CorruptDataError, match="messages"):
            decode([good_key, key], [good_value, value], SHARD, {})


def test_large_lt_and_extreme_workchains() -> None:
    key = codec.message_key(7, SHARD, QueueKey(2**64 - 1, b"\xff" * 32))
    value = struct.pack(">B32sB32s", 0, b"\x01" * 32, 255, b"\x02" * 32) + b"body"
    (item,) = iterator._decode_run([key], [value], SHARD, {})
    assert item.message.key == QueueKey(2**64 - 1, b"\xff" * 32)
    assert item.message.dst == Address(-128, b"\x01" * 32)
    assert item.message.src == Address(127, b"\x02" * 32)
    assert item.message.body == b"body"
