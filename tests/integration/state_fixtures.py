"""Shared helpers of the state import/export tests: the real tycho files with the values
their README lists, and oracles that share no code with ``imq.state`` -- a small TL
parser written from FORMAT.md §3, ``zstandard`` for ``.queue`` files and pytoniq-core for
message cells and blocks -- so a test compares imq against something independent --
and builders of crafted states (made with ``imq.state``'s own encoders, for bad input).
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import zstandard
from pytoniq_core import Cell as OracleCell
from pytoniq_core import MessageAny
from tycho_data import TYCHO

from imq import (
    Address,
    BlockId,
    DiffInfo,
    IteratedMessage,
    Queue,
    QueueKey,
    QueueShardRange,
    ShardIdent,
)
from imq.state.block import parse_block_id_name
from imq.state.boc import Cell, encode_boc, join_roots
from imq.state.synth import SynthState, write_synth_state
from imq.state.tl import TlDiff, diff_hash, encode_chunk, encode_diff, encode_state_header

BASE = ShardIdent.BASECHAIN
MC = ShardIdent.MASTERCHAIN
ZSTD_MAGIC = bytes.fromhex("28b52ffd")
STATE_MAGIC = bytes.fromhex("ccd96436")
SHARD_BIN = TYCHO / "persistent_state" / "shard.bin"
MASTER_BIN = TYCHO / "persistent_state" / "master.bin"
FIRST_DIFF = TYCHO / "first_block" / "first_block_queue_diff.bin"
FIRST_BLOCK = TYCHO / "first_block" / "first_block.bin"
FIRST_DIFF_HASH = "7a4b22a73454e3ca511f5a6a3af6befd52d6a61b66ae5f7a5077c5b309ebc68a"
SHARD_TOP_HASH = "794fe9ce31b7919d2b6ca9ae0f97501f4017382a273b8f3ee512dcfcb5b14482"
MASTER_TOP_HASH = "5795ca5d1b8d0c1ce96394eef851bde718ff2e14fd2840098ed2bb7640f278c5"
SHARD_TOP = (bytes.fromhex(SHARD_TOP_HASH), 3)
MASTER_TOP = (bytes.fromhex(MASTER_TOP_HASH), 1)


def _one(folder: str, pattern: str) -> Path:
    (path,) = (TYCHO / folder).glob(pattern)
    return path


@dataclass(frozen=True)
class RealState:
    """One real state file and what the README says about it."""

    path: Path
    shard: ShardIdent
    seqnos: tuple[int, ...]  # newest first
    messages: tuple[int, ...]  # per diff
    top_hash: str  # hex: the full hash or the README's prefix ("" when none is listed)
    chunks: int
    block: Path | None = None  # the block whose top update the state matches

    @property
    def id(self) -> str:
        folder = self.path.parent.parent if self.path.suffix == ".queue" else self.path.parent
        return f"{folder.name}/{self.shard.workchain}:{self.seqnos[0]}"

    @property
    def seqno(self) -> int:
        return self.seqnos[0]

    @property
    def tail_len(self) -> int:
        return len(self.seqnos)


def _dump(folder: str, wc: int, seqno: int, seqnos: tuple[int, ...], top: str) -> RealState:
    name = f"{wc}_8000000000000000_{seqno}_*"
    queue = _one(f"{folder}/queues", f"{name}.queue")
    blocks = list((TYCHO / folder / "blocks").glob(f"{name}.block"))
    shard = MC if wc == -1 else BASE
    return RealState(queue, shard, seqnos, (0,) * len(seqnos), top, 0, *blocks[:1])


SHARD_STATE = RealState(SHARD_BIN, BASE, (160, 159, 158), (4300, 0, 0), SHARD_TOP_HASH, 1)
MASTER_STATE = RealState(MASTER_BIN, MC, (90,), (0,), MASTER_TOP_HASH, 0)
DUMP_STATES = (
    _dump("dump", -1, 57, (57,), "0ece7b3b"),
    _dump("dump", 0, 35, (35,), "f7aac545"),
    _dump("dump", 0, 36, (36,), "a881a8c8"),
    _dump("dump_one_shard", -1, 76, (76,), "664e9df5"),
    _dump("dump_one_shard", 0, 83, (83, 82), "86fe3fde"),
    _dump("dump_one_shard", 0, 84, (84,), ""),
)
REAL_STATES = (SHARD_STATE, MASTER_STATE, *DUMP_STATES)
REAL_BLOCKS = tuple(s.block for s in DUMP_STATES if s.block is not None)


def block_id(real: RealState) -> BlockId:
    """The block id a real state is imported as: from its file name when it has one."""
    if real.path.suffix == ".queue":
        return parse_block_id_name(real.path.name)
    return BlockId(real.shard, real.seqno)


def top_update(real: RealState) -> tuple[bytes, int] | None:
    """The update a real state is checked against: its block's (read by the oracle), else
    the README's."""
    if real.block is not None:
        block = oracle_block(real.block)
        return block.diff_hash, block.tail_len
    if len(real.top_hash) == 64:
        return bytes.fromhex(real.top_hash), real.tail_len
    return None


# -- an independent reader of the TL layout (FORMAT.md §3) --------------------------------------


@dataclass(frozen=True)
class OracleDiff:
    raw: bytes
    prev_hash: bytes
    shard: ShardIdent
    seqno: int
    processed_to: dict[ShardIdent, QueueKey]
    min_message: QueueKey
    max_message: QueueKey
    hashes: tuple[bytes, ...]
    router_src: dict[int, frozenset[Address]]
    router_dst: dict[int, frozenset[Address]]

    @property
    def hash(self) -> bytes:
        return blake3.blake3(self.raw).digest()


@dataclass(frozen=True)
class OracleState:
    shard: ShardIdent
    seqno: int
    diffs: tuple[OracleDiff, ...]
    n_chunks: int  # as announced in the header
    chunks: tuple[bytes, ...]  # every chunk actually present


class _Cursor:
    def __init__(self, data: bytes, at: int = 0) -> None:
        self.data = data
        self.at = at

    def take(self, n: int) -> bytes:
        out = self.data[self.at : self.at + n]
        assert len(out) == n, f"truncated at {self.at}"
        self.at += n
        return out

    def u32(self) -> int:
        value: int = struct.unpack("<I", self.take(4))[0]
        return value

    def shard(self) -> ShardIdent:
        wc, prefix = struct.unpack("<iQ", self.take(12))
        return ShardIdent(wc, prefix)

    def key(self) -> QueueKey:
        lt = struct.unpack("<Q", self.take(8))[0]
        return QueueKey(lt, self.take(32))

    def router(self) -> dict[int, frozenset[Address]]:
        out = {}
        for _ in range(self.u32()):
            partition = self.u32()
            accounts = []
            for _ in range(self.u32()):
                wc = struct.unpack("<i", self.take(4))[0]
                accounts.append(Address(wc, self.take(32)))
            out[partition] = frozenset(accounts)
        return out


def _diff(cur: _Cursor) -> OracleDiff:
    start = cur.at
    assert cur.take(4) == bytes.fromhex("b2a32060")
    prev_hash, shard, seqno = cur.take(32), cur.shard(), cur.u32()
    processed_to = {}
    for _ in range(cur.u32()):
        s = cur.shard()
        processed_to[s] = cur.key()
    lo, hi = cur.key(), cur.key()
    hashes = tuple(cur.take(32) for _ in range(cur.u32()))
    src, dst = cur.router(), cur.router()
    raw = cur.data[start : cur.at]
    return OracleDiff(raw, prev_hash, shard, seqno, processed_to, lo, hi, hashes, src, dst)


def parse_diff(data: bytes) -> OracleDiff:
    cur = _Cursor(data)
    diff = _diff(cur)
    assert cur.at == len(data)
    return diff


def state_bytes(source: Path | bytes) -> bytes:
    """The decompressed state (``.queue`` files are zstd frames without a content size)."""
    data = source.read_bytes() if isinstance(source, Path) else source
    if data[:4] == ZSTD_MAGIC:
        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            return reader.read()
    return data


def parse_state(source: Path | bytes) -> OracleState:
    cur = _Cursor(state_bytes(source))
    assert cur.take(8) == bytes.fromhex("ccd96436654b01d4")
    shard, seqno = cur.shard(), cur.u32()
    diffs = tuple(_diff(cur) for _ in range(cur.u32()))
    n_chunks = cur.u32()
    chunks = []
    while cur.at < len(cur.data):
        size = cur.u32()
        chunks.append(cur.take(size))
        assert cur.take(-size % 4) == bytes(-size % 4)
    return OracleState(shard, seqno, diffs, n_chunks, tuple(chunks))


def boc_root_count(boc: bytes) -> int:
    """The root count from a BOC header: magic, flags (ref size in the low 3 bits),
    offset size, then cell count and root count of ref-size bytes each."""
    assert boc[:4] == bytes.fromhex("b5ee9c72")
    size = boc[4] & 7
    return int.from_bytes(boc[6 + size : 6 + 2 * size], "big")


@dataclass(frozen=True)
class OracleMessage:
    hash: bytes
    lt: int
    src: Address
    dst: Address


def _address(addr: object) -> Address:
    return Address(addr.wc, addr.hash_part)  # type: ignore[attr-defined]


def oracle_messages(state: OracleState) -> list[OracleMessage]:
    """Every message root of the state's chunks in root-list order, decoded by pytoniq-core."""
    out = []
    for chunk in state.chunks:
        for root in OracleCell.from_boc(chunk):
            info = MessageAny.deserialize(root.begin_parse()).info
            out.append(
                OracleMessage(root.hash, info.created_lt, _address(info.src), _address(info.dest))
            )
    return out


@dataclass(frozen=True)
class OracleBlock:
    root_hash: bytes
    file_hash: bytes
    diff_hash: bytes
    tail_len: int


def oracle_block(path: Path) -> OracleBlock:
    """A tycho block's id hashes and ``out_msg_queue_updates`` (FORMAT.md §3, §4)."""
    data = path.read_bytes()
    root = OracleCell.one_from_boc(data)
    updates = root.refs[2].begin_parse()
    assert updates.load_uint(4) == 1
    diff_hash = updates.load_bytes(32)
    tail_len = updates.load_uint(32)
    return OracleBlock(root.hash, blake3.blake3(data).digest(), diff_hash, tail_len)


def expected_info(diff: OracleDiff, dsts: Iterable[Address]) -> DiffInfo:
    """The DiffInfo an import must store for ``diff`` whose messages go to ``dsts``."""
    counts = Counter(ShardIdent.full(a.workchain) for a in dsts)
    return DiffInfo(
        min_message=diff.min_message,
        max_message=diff.max_message,
        shards_messages_count=dict(counts),
        hash=diff.hash,
        processed_to=diff.processed_to,
        router_src=diff.router_src,
        router_dst=diff.router_dst,
        seqno=diff.seqno,
        prev_hash=diff.prev_hash,
    )


# -- queue helpers ----------------------------------------------------------------------------


def full(shard: ShardIdent) -> QueueShardRange:
    return QueueShardRange(shard, QueueKey.MIN, QueueKey.MAX)


def iterate(
    queue: Queue, shard: ShardIdent, partition: int, for_shard: ShardIdent
) -> list[IteratedMessage]:
    with queue.iterator(partition, [full(shard)], for_shard) as it:
        return list(it)


def partition_contents(
    queue: Queue,
    shard: ShardIdent,
    partitions: Sequence[int] = (0, 1, 2),
    for_shards: Sequence[ShardIdent] = (BASE, MC),
) -> dict[tuple[int, ShardIdent], list[IteratedMessage]]:
    """What the iterator yields for every (partition, destination workchain)."""
    return {(p, f): iterate(queue, shard, p, f) for p in partitions for f in for_shards}


def observable(queue: Queue, shard: ShardIdent, seqnos: Iterable[int]) -> dict[str, object]:
    """What a test compares between two queues holding the same state."""
    return {
        "infos": {s: queue.get_diff_info(shard, s) for s in seqnos},
        "pointers": queue.get_commit_pointers(),
        "last_mc": queue.get_last_committed_mc_block_id(),
        "tail": queue.get_diffs_tail_len(shard, QueueKey.MIN),
        "messages": partition_contents(queue, shard),
        "stats": {p: queue.load_diff_statistics(p, full(shard)) for p in (0, 1, 2)},
    }


def write_state(state: SynthState, path: Path, **limits: int) -> tuple[Path, int]:
    """Write a synthetic state; return the path and the chunk count the writer reported."""
    return path, write_synth_state(state, path, **limits)


def expected_partition(state: SynthState, seqno: int, src: Address, dst: Address) -> int:
    """The import's rule (SEMANTICS §13.5): the dst router first, then src, else 0."""
    (diff,) = [d for d in state.diffs if d.seqno == seqno]
    for half, address in ((diff.tl.router_dst, dst), (diff.tl.router_src, src)):
        for partition, addresses in half:
            if address in addresses:
                return partition
    return 0


# -- crafted states ---------------------------------------------------------------------------


def assemble(
    shard: ShardIdent,
    diffs_tl: Sequence[bytes],
    chunks: Sequence[Sequence[bytes]],
    *,
    n_chunks: int | None = None,
    tail: bytes = b"",
) -> bytes:
    """A state from boxed diffs (newest first) and chunks given as lists of one-root
    BOCs; ``n_chunks`` overrides the announced count."""
    seqno = struct.unpack_from("<I", diffs_tl[0], 48)[0]
    announced = len(chunks) if n_chunks is None else n_chunks
    parts = [encode_state_header(shard, seqno, diffs_tl, announced)]
    parts += [encode_chunk(join_roots(list(bocs))) for bocs in chunks]
    return b"".join(parts) + tail


@dataclass(frozen=True)
class CraftedDiff:
    tl: bytes
    bocs: list[bytes]  # file order: ascending by hash


def craft_diffs(
    shard: ShardIdent,
    first_seqno: int,
    cells: Sequence[Sequence[Cell]],
    *,
    processed_to: tuple[tuple[ShardIdent, QueueKey], ...] = ((BASE, QueueKey.max_for_lt(1)),),
    spans: dict[int, tuple[QueueKey, QueueKey]] | None = None,
    **routers: Any,
) -> list[CraftedDiff]:
    """Diffs (newest first) of consecutive seqnos listing ``cells`` (oldest diff first);
    diff ``s`` spans lts ``1000 s ..= 1000 s + 999`` whatever its cells hold, unless
    ``spans`` gives diff ``i`` (counted from the oldest) another span. ``routers``
    (``router_src``, ``router_dst``) go into every diff."""
    prev = bytes(32)
    out = []
    for i, group in enumerate(cells):
        seqno = first_seqno + i
        ordered = sorted(group, key=lambda c: c.hash)
        lo, hi = QueueKey.min_for_lt(seqno * 1000), QueueKey.max_for_lt(seqno * 1000 + 999)
        lo, hi = (spans or {}).get(i, (lo, hi))
        tl = encode_diff(
            TlDiff(
                prev_hash=prev,
                shard=shard,
                seqno=seqno,
                processed_to=processed_to,
                min_message=lo,
                max_message=hi,
                hashes=b"".join(c.hash for c in ordered),
                **routers,
            )
        )
        prev = diff_hash(tl)
        out.append(CraftedDiff(tl, [encode_boc([c]) for c in ordered]))
    return out[::-1]
