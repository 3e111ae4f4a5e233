"""Tycho blocks as a state import reads them (imq.state.block): the six real blocks of the
test data, and synthetic blocks for the failure paths."""

from __future__ import annotations

from pathlib import Path

import blake3
import pytest
from tycho_data import TYCHO

from imq.errors import StateFormatError
from imq.state.block import (
    BLOCK_TAG,
    BlockTopUpdate,
    check_block_id,
    parse_block_id_name,
    read_block_top_update,
)
from imq.state.boc import Cell, CellBuilder, decode_boc, encode_boc
from imq.types import BlockId, ShardIdent

FIRST_BLOCK = TYCHO / "first_block" / "first_block.bin"
# (file, diff hash prefix, tail_len) as the data README states them
REAL = [
    (FIRST_BLOCK, "7a4b22a7", 1),
    (next((TYCHO / "dump" / "blocks").glob("-1_*_57_*.block")), "0ece7b3b", 1),
    (next((TYCHO / "dump" / "blocks").glob("0_*_35_*.block")), "f7aac545", 1),
    (next((TYCHO / "dump" / "blocks").glob("0_*_36_*.block")), "a881a8c8", 1),
    (next((TYCHO / "dump_one_shard" / "blocks").glob("-1_*_76_*.block")), "664e9df5", 1),
    (next((TYCHO / "dump_one_shard" / "blocks").glob("0_*_83_*.block")), "86fe3fde", 2),
]
MC = ShardIdent(-1, 0x8000000000000000)


def block_id_of(path: Path) -> BlockId:
    if path == FIRST_BLOCK:
        return BlockId.parse((path.parent / "first_block_id.txt").read_text().strip())
    return parse_block_id_name(path.name)


def synthetic_block(*, tag: int = BLOCK_TAG, refs: int = 4, extra: Cell | None = None) -> bytes:
    """A block BOC with the given root tag, ref count and ``X`` cell (ref 2)."""
    if extra is None:
        extra = CellBuilder().store_uint(1, 4).store_bytes(b"\xab" * 32).store_uint(5, 32).end()
    root = CellBuilder().store_uint(tag, 32).store_int(-239, 32)
    for k in range(refs):
        root.store_ref(extra if k == 2 else CellBuilder().store_uint(k, 8).end())
    return encode_boc([root.end()])


@pytest.mark.parametrize(("path", "diff_prefix", "tail_len"), REAL, ids=lambda v: str(v)[-30:])
def test_real_blocks_give_their_top_update_and_id(
    path: Path, diff_prefix: str, tail_len: int
) -> None:
    data = path.read_bytes()
    update = read_block_top_update(data)
    block_id = block_id_of(path)
    assert update.diff_hash.hex().startswith(diff_prefix) and update.tail_len == tail_len
    assert (update.root_hash, update.file_hash) == (block_id.root_hash, block_id.file_hash)
    assert update.file_hash == blake3.blake3(data).digest()
    check_block_id(update, block_id)


def test_first_block_diff_hash_is_its_queue_diff_file_hash() -> None:
    update = read_block_top_update(FIRST_BLOCK.read_bytes())
    diff = (FIRST_BLOCK.parent / "first_block_queue_diff.bin").read_bytes()
    assert update.diff_hash == blake3.blake3(diff).digest()
    block_id = block_id_of(FIRST_BLOCK)
    assert (block_id.shard, block_id.seqno, block_id.root_hash) == (MC, 1, update.root_hash)


def test_check_block_id() -> None:
    path = REAL[2][0]
    update = read_block_top_update(path.read_bytes())
    real = block_id_of(path)
    check_block_id(update, BlockId(real.shard, real.seqno))  # zero hashes: unknown
    check_block_id(update, BlockId(real.shard, real.seqno, real.root_hash))
    check_block_id(update, BlockId(real.shard, real.seqno, file_hash=real.file_hash))
    with pytest.raises(StateFormatError, match="root hash"):
        check_block_id(update, BlockId(real.shard, real.seqno, b"\x01" * 32, real.file_hash))
    with pytest.raises(StateFormatError, match=f"file hash {'02' * 32}"):
        check_block_id(update, BlockId(real.shard, real.seqno, real.root_hash, b"\x02" * 32))
    other = block_id_of(REAL[3][0])  # another real block's id
    with pytest.raises(StateFormatError):
        check_block_id(update, other)
    with pytest.raises(TypeError):
        check_block_id(update, str(real))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        check_block_id((1, 2), real)  # type: ignore[arg-type]


def test_synthetic_block_with_and_without_tail_len() -> None:
    data = synthetic_block()
    assert read_block_top_update(data) == BlockTopUpdate(
        decode_boc(data)[0].hash, blake3.blake3(data).digest(), b"\xab" * 32, 5
    )
    short = CellBuilder().store_uint(1, 4).store_bytes(b"\xcd" * 32).end()  # no tail_len
    update = read_block_top_update(synthetic_block(extra=short))
    assert (update.diff_hash, update.tail_len) == (b"\xcd" * 32, None)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (encode_boc([CellBuilder().store_bytes(b"not a block").end()]), "tag"),
        (synthetic_block(tag=BLOCK_TAG + 1), "tag"),
        (encode_boc([CellBuilder().store_uint(BLOCK_TAG >> 8, 24).end()]), "bits"),
        (synthetic_block(refs=2), "refs"),
        (synthetic_block(extra=CellBuilder().store_uint(2, 4).end()), "tag is not #1"),
        (synthetic_block(extra=CellBuilder().store_uint(1, 4).end()), "bits"),
        (encode_boc([Cell(b"", 0), Cell(b"\x01", 8)]), "root count"),
        (b"", "truncated"),
        (b"\x00" * 40, "magic"),
    ],
)
def test_not_a_block(data: bytes, match: str) -> None:
    with pytest.raises(StateFormatError, match=match):
        read_block_top_update(data)


def test_truncated_real_block() -> None:
    data = FIRST_BLOCK.read_bytes()
    for cut in [*range(0, 64), *range(64, len(data), 37), len(data) - 1]:
        with pytest.raises(StateFormatError, match=f"truncated at offset {cut}"):
            read_block_top_update(data[:cut])
    with pytest.raises(StateFormatError, match="trailing bytes"):
        read_block_top_update(data + b"\x00")


def test_parse_block_id_name() -> None:
    path = REAL[1][0]
    block_id = parse_block_id_name(path.name)
    assert (block_id.shard, block_id.seqno) == (MC, 57)
    assert parse_block_id_name(str(block_id)) == block_id
    assert parse_block_id_name(path.name.replace(".block", ".queue")) == block_id
    assert parse_block_id_name(path.name.removesuffix(".block")) == block_id
    for bad in ("", "x", path.name + ".zip", str(block_id)[:-1], "0:8000000000000000:1"):
        with pytest.raises(ValueError):
            parse_block_id_name(bad)
