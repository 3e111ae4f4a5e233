"""Every id and key the CLI prints reads back: ``parse(str(x)) == x`` for queue keys,
shards, addresses, short and full block ids, and ``QueueKey.from_json(key.to_json())``."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from imq import Address, BlockId, BlockIdShort, QueueKey, ShardIdent

U64 = 2**64 - 1
hashes = st.binary(min_size=32, max_size=32)
keys = st.builds(QueueKey, st.integers(0, U64), hashes) | st.sampled_from(
    [QueueKey.MIN, QueueKey.MAX]
)


@st.composite
def shards(draw: st.DrawFn) -> ShardIdent:
    workchain = draw(st.sampled_from([-1, 0, 1, -(2**31), 2**31 - 1]))
    if workchain == -1:
        return ShardIdent.MASTERCHAIN
    bits = draw(st.integers(0, 60))
    prefix = draw(st.integers(0, 2**bits - 1)) if bits else 0
    return ShardIdent(workchain, (prefix << (64 - bits)) | (1 << (63 - bits)))


short_ids = st.builds(BlockIdShort, shards(), st.integers(0, 2**32 - 1))
full_ids = st.builds(BlockId, shards(), st.integers(0, 2**32 - 1), hashes, hashes)
addresses = st.builds(Address, st.integers(-128, 127), hashes)


@given(keys)
def test_queue_key_round_trip(key: QueueKey) -> None:
    assert QueueKey.parse(str(key)) == key
    assert type(QueueKey.parse(str(key))) is QueueKey
    assert QueueKey.from_json(json.loads(json.dumps(key.to_json()))) == key


@given(shards())
def test_shard_round_trip(shard: ShardIdent) -> None:
    assert ShardIdent.parse(str(shard)) == shard


@given(addresses)
def test_address_round_trip(address: Address) -> None:
    assert Address.parse(str(address)) == address


@given(short_ids)
def test_block_id_short_round_trip(block: BlockIdShort) -> None:
    assert BlockIdShort.parse(str(block)) == block
    # the short form is also a BlockId without hashes
    assert BlockId.parse(str(block)) == BlockId(block.shard, block.seqno)


@given(full_ids)
def test_block_id_round_trip(block: BlockId) -> None:
    assert BlockId.parse(str(block)) == block
    assert BlockId.parse(str(block.short)).short == block.short


def test_queue_key_text_is_lossless() -> None:
    key = QueueKey(1001, bytes(range(32)))
    assert str(key) == "1001:" + bytes(range(32)).hex()
    assert key.to_json() == {"lt": 1001, "hash": bytes(range(32)).hex()}


@pytest.mark.parametrize(
    "text",
    ["", "1", "1:", "-1:" + "00" * 32, "x:" + "00" * 32, "1:" + "00" * 31, f"{2**64}:" + "00" * 32],
)
def test_queue_key_parse_errors(text: str) -> None:
    with pytest.raises(ValueError, match="queue key"):
        QueueKey.parse(text)


@pytest.mark.parametrize(
    "obj", [None, {"lt": 1}, {"lt": 1, "hash": "zz"}, {"lt": "1", "hash": "00" * 32}]
)
def test_queue_key_from_json_errors(obj: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        QueueKey.from_json(obj)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0:8000000000000000",
        "0:8000000000000000:",
        "0:8000000000000000:-1",
        "0:80:1",
        "0:8000000000000000:4294967296",
        "-1:4000000000000000:1",
        "0:8000000000000000:1:2",
    ],
)
def test_block_id_short_parse_errors(text: str) -> None:
    with pytest.raises(ValueError, match="block id"):
        BlockIdShort.parse(text)
