"""What a queue state is checked against: a tycho block's id and top update (FORMAT §3).

A tycho ``Block`` root cell holds ``u32 0x11ef55bb, i32 global_id`` with refs
``[info, value_flow, X, extra]``; ``X`` starts with ``OutMsgQueueUpdates``: a 4-bit tag
``#1``, ``diff_hash: bits256`` and ``tail_len: u32`` (read whenever 32 bits remain).
Only that much of a block is decoded here. The block's root hash is its root cell's
representation hash, which takes TON's level-aware hashing (:mod:`imq.state.cells`):
``X.refs[0]`` is a Merkle update over pruned branches. Its file hash is BLAKE3 of the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import blake3

from imq.errors import StateFormatError
from imq.state.boc import BocError, decode_boc
from imq.types import BlockId, ShardIdent

__all__ = [
    "BLOCK_TAG",
    "BlockTopUpdate",
    "check_block_id",
    "parse_block_id_name",
    "read_block_top_update",
]

BLOCK_TAG = 0x11EF55BB
_ZERO32 = bytes(32)
_UPDATES_TAG = 0x1
_NAME = re.compile(
    r"^(-?\d+)[_:]([0-9a-fA-F]{16})[_:](\d+)[_:]([0-9a-fA-F]{64})[_:]([0-9a-fA-F]{64})"
    r"(?:\.(?:queue|block|bin))?$"
)


@dataclass(frozen=True, slots=True)
class BlockTopUpdate:
    """A block's id (root hash and BLAKE3 file hash computed from its bytes) and its
    ``out_msg_queue_updates``: the hash of its queue diff and the queue's tail length."""

    root_hash: bytes
    file_hash: bytes
    diff_hash: bytes
    tail_len: int | None


def _bits(data: bytes, bits: int, start: int, count: int) -> int:
    if start + count > bits:
        raise StateFormatError(f"block cell has {bits} bits, {start + count} needed")
    value = int.from_bytes(data, "big") >> (len(data) * 8 - start - count)
    return value & ((1 << count) - 1)


def read_block_top_update(data: bytes) -> BlockTopUpdate:
    """Decode the parts of a block BOC that a state import checks against."""
    try:
        roots = decode_boc(data, max_roots=1)
    except BocError as exc:
        raise StateFormatError(f"block BOC: {exc.check} at offset {exc.offset}: {exc}") from None
    root = roots[0]
    if _bits(root.data, root.bits, 0, 32) != BLOCK_TAG:
        raise StateFormatError("not a tycho block: the root cell's tag is not 0x11ef55bb")
    if len(root.refs) < 3:
        raise StateFormatError(f"tycho block root has {len(root.refs)} refs, expected 4")
    extra = root.refs[2]
    if _bits(extra.data, extra.bits, 0, 4) != _UPDATES_TAG:
        raise StateFormatError("tycho block: out_msg_queue_updates tag is not #1")
    diff_hash = _bits(extra.data, extra.bits, 4, 256).to_bytes(32, "big")
    tail_len = _bits(extra.data, extra.bits, 260, 32) if extra.bits >= 292 else None
    return BlockTopUpdate(root.hash, blake3.blake3(data).digest(), diff_hash, tail_len)


def check_block_id(update: BlockTopUpdate, block_id: BlockId) -> None:
    """Check that ``block_id`` names the block ``update`` was read from: each of its root
    and file hashes must be the block's, unless it is zero (unknown)."""
    if type(update) is not BlockTopUpdate or type(block_id) is not BlockId:
        raise TypeError("check_block_id takes a BlockTopUpdate and a BlockId")
    for what, named, actual in (
        ("root hash", block_id.root_hash, update.root_hash),
        ("file hash", block_id.file_hash, update.file_hash),
    ):
        if named not in (_ZERO32, actual):
            raise StateFormatError(
                f"block id check: block {block_id.shard}:{block_id.seqno} has {what} "
                f"{named.hex()}, the block file's is {actual.hex()}"
            )


def parse_block_id_name(name: str) -> BlockId:
    """The block id in a node's file name ``wc:shard:seqno:root:file`` (``_`` or ``:``
    separated, with or without a ``.queue``/``.block`` suffix)."""
    match = _NAME.match(name)
    if match is None:
        raise ValueError(f"not a block id file name: {name!r}")
    wc, shard, seqno, root, file = match.groups()
    return BlockId(
        ShardIdent(int(wc), int(shard, 16)),
        int(seqno),
        bytes.fromhex(root),
        bytes.fromhex(file),
    )
