"""The TL codec of queue diffs and queue-state headers, and the BLAKE3 diff hash.

Owns the bytes of tycho's ``block.queueDiff``, ``block.queueStateHeader`` and the
``bigBytes`` chunks of ``block.queueState`` (FORMAT.md §3, SEMANTICS §2.5, §13.1). The
reader applies every check of the Rust reader and names the absolute offset of the failing
field; the encoder checks the same invariants (``ValueError``) and is bit-exact, because a
diff's hash is BLAKE3 over its TL bytes.

Speed note: a diff can list 10 million hashes, so a hash list is read in one call and its
order is checked by comparing two ``struct.iter_unpack`` streams in C (about 0.13 s per
million hashes, no list of a million ``bytes`` objects).
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from imq.errors import StateFormatError
from imq.state.source import DIFF_MAGIC, STATE_MAGIC, ByteSource
from imq.types import Address, QueueKey, ShardIdent, _trusted_address

__all__ = [
    "MAX_ACCOUNTS",
    "MAX_CHUNKS",
    "MAX_CHUNK_ROOTS",
    "MAX_CHUNK_SIZE",
    "MAX_DIFFS",
    "MAX_MESSAGES",
    "MAX_PARTITIONS",
    "MAX_PROCESSED_TO",
    "QUEUE_DIFF_ID",
    "QUEUE_STATE_HEADER_ID",
    "QUEUE_STATE_ID",
    "StateHeader",
    "TlDiff",
    "decode_diff",
    "diff_hash",
    "encode_chunk",
    "encode_diff",
    "encode_state_header",
    "state_header_parts",
    "read_chunk",
    "read_diff",
    "read_state_header",
]

QUEUE_DIFF_ID = 0x6020A3B2
QUEUE_STATE_ID = 0x3664D9CC
QUEUE_STATE_HEADER_ID = 0xD4014B65

MAX_DIFFS = 1000
MAX_CHUNKS = 10_000_000
MAX_CHUNK_SIZE = 100 * 2**20
MAX_CHUNK_ROOTS = 10_000
MAX_MESSAGES = 10_000_000
MAX_PROCESSED_TO = 1000
MAX_PARTITIONS = 65536
MAX_ACCOUNTS = 10_000_000

_U32 = struct.Struct("<I")
_SHARD = struct.Struct("<iQ")
_KEY = struct.Struct("<Q32s")
_PROCESSED = struct.Struct("<iQQ32s")
_PARTITION = struct.Struct("<II")
_ROUTER_ADDR = struct.Struct("<i32s")
_HASH = struct.Struct("32s")
_HEADER_IDS = _U32.pack(QUEUE_STATE_ID) + _U32.pack(QUEUE_STATE_HEADER_ID)
_ZERO32 = bytes(32)
_U32_MAX = 0xFFFF_FFFF
# Field offsets inside a boxed diff, for error messages.
_AT_PREV_HASH, _AT_SHARD, _AT_SEQNO = 4, 36, 48

Router = tuple[tuple[int, tuple[Address, ...]], ...]


@dataclass(frozen=True, slots=True)
class TlDiff:
    """One ``block.queueDiff`` as it is on the wire.

    Construction checks only shapes and types; the order invariants (processed_to by
    shard, hashes, partitions, accounts) are checked by :func:`encode_diff` and
    :func:`read_diff`, so a read diff's million hashes are not checked twice.
    """

    prev_hash: bytes
    shard: ShardIdent
    seqno: int
    processed_to: tuple[tuple[ShardIdent, QueueKey], ...]
    min_message: QueueKey
    max_message: QueueKey
    hashes: bytes
    router_src: Router = ()
    router_dst: Router = ()

    def __post_init__(self) -> None:
        if not isinstance(self.prev_hash, bytes) or len(self.prev_hash) != 32:
            raise ValueError("TlDiff.prev_hash must be 32 bytes")
        if type(self.shard) is not ShardIdent:
            raise TypeError("TlDiff.shard must be a ShardIdent")
        if not isinstance(self.seqno, int) or not 0 <= self.seqno <= _U32_MAX:
            raise ValueError(f"TlDiff.seqno must be a u32, got {self.seqno!r}")
        if type(self.min_message) is not QueueKey or type(self.max_message) is not QueueKey:
            raise TypeError("TlDiff.min_message and max_message must be QueueKey values")
        if not isinstance(self.hashes, bytes) or len(self.hashes) % 32:
            raise ValueError("TlDiff.hashes must be bytes holding whole 32-byte hashes")
        for name in ("processed_to", "router_src", "router_dst"):
            if not isinstance(getattr(self, name), tuple):
                raise TypeError(f"TlDiff.{name} must be a tuple")

    @property
    def n_messages(self) -> int:
        return len(self.hashes) // 32

    def hash_at(self, i: int) -> bytes:
        """The hash of message ``i`` (file order: ascending)."""
        if not 0 <= i < self.n_messages:
            raise IndexError(f"message index {i} out of range 0..{self.n_messages}")
        return self.hashes[32 * i : 32 * i + 32]

    def iter_hashes(self) -> Iterator[bytes]:
        return (h for (h,) in _HASH.iter_unpack(self.hashes))


def diff_hash(tl_bytes: bytes) -> bytes:
    """The diff hash: BLAKE3 over the boxed TL bytes (FORMAT §4)."""
    return blake3(tl_bytes).digest()


# ---------------------------------------------------------------------------------------------
# Order checks shared by the encoder and the reader


def _first_unsorted(items: Sequence[Any]) -> int | None:
    """The first index ``i`` with ``items[i] <= items[i - 1]``, or None if strictly ascending."""
    for i in range(1, len(items)):
        if not items[i - 1] < items[i]:
            return i
    return None


def _first_bad_hash(hashes: bytes) -> tuple[int, str] | None:
    """The first hash that is zero or not above its predecessor, with the reason."""
    if not hashes:
        return None
    if hashes[:32] == _ZERO32:
        return 0, "zero message hash"
    view = memoryview(hashes)
    if all(map(operator.lt, _HASH.iter_unpack(view), _HASH.iter_unpack(view[32:]))):
        return None
    prev = hashes[:32]
    for i in range(1, len(hashes) // 32):
        cur = hashes[32 * i : 32 * i + 32]
        if not prev < cur:
            return i, "message hashes not strictly ascending"
        prev = cur
    raise AssertionError("unreachable: the fast check found a descent the scan did not")


# ---------------------------------------------------------------------------------------------
# Encoding


def _check_router(name: str, router: Router) -> None:
    if len(router) > MAX_PARTITIONS:
        raise ValueError(f"{name}: {len(router)} partitions, the limit is {MAX_PARTITIONS}")
    indexes = [index for index, _ in router]
    for index in indexes:
        if not isinstance(index, int) or not 0 <= index <= 0xFFFF:
            raise ValueError(f"{name}: partition index {index!r} does not fit u16")
    bad = _first_unsorted(indexes)
    if bad is not None:
        raise ValueError(f"{name}: partition indexes not strictly ascending at {indexes[bad]}")
    for index, accounts in router:
        if not isinstance(accounts, tuple) or any(type(a) is not Address for a in accounts):
            raise TypeError(f"{name}: partition {index} must be a tuple of Address values")
        if len(accounts) > MAX_ACCOUNTS:
            raise ValueError(f"{name}: partition {index} has more than {MAX_ACCOUNTS} accounts")
        bad = _first_unsorted(accounts)
        if bad is not None:
            raise ValueError(f"{name}: partition {index} accounts not strictly ascending at {bad}")


def _check_diff(diff: TlDiff) -> None:
    """Every invariant the reader enforces, as ``ValueError``."""
    if len(diff.processed_to) > MAX_PROCESSED_TO:
        raise ValueError(f"{len(diff.processed_to)} processed_to entries, max {MAX_PROCESSED_TO}")
    for shard, key in diff.processed_to:
        if type(shard) is not ShardIdent or type(key) is not QueueKey:
            raise TypeError("processed_to entries must be (ShardIdent, QueueKey) pairs")
    shards = [shard for shard, _ in diff.processed_to]
    bad = _first_unsorted(shards)
    if bad is not None:
        raise ValueError(f"processed_to shards not strictly ascending at {shards[bad]}")
    if diff.max_message < diff.min_message:
        raise ValueError("max_message is below min_message")
    if diff.n_messages > MAX_MESSAGES:
        raise ValueError(f"{diff.n_messages} messages, the limit is {MAX_MESSAGES}")
    bad_hash = _first_bad_hash(diff.hashes)
    if bad_hash is not None:
        raise ValueError(f"{bad_hash[1]} (message {bad_hash[0]})")
    _check_router("router_src", diff.router_src)
    _check_router("router_dst", diff.router_dst)


def _encode_router(router: Router) -> list[bytes]:
    parts = [_U32.pack(len(router))]
    for index, accounts in router:
        parts.append(_PARTITION.pack(index, len(accounts)))
        parts.extend(_ROUTER_ADDR.pack(wc, account) for wc, account in accounts)
    return parts


def encode_diff(diff: TlDiff) -> bytes:
    """The boxed TL bytes of ``diff``, bit-exact with tycho (hash them with :func:`diff_hash`)."""
    _check_diff(diff)
    parts = [
        DIFF_MAGIC,
        diff.prev_hash,
        _SHARD.pack(*diff.shard),
        _U32.pack(diff.seqno),
        _U32.pack(len(diff.processed_to)),
    ]
    parts.extend(_PROCESSED.pack(*shard, *key) for shard, key in diff.processed_to)
    parts += [
        _KEY.pack(*diff.min_message),
        _KEY.pack(*diff.max_message),
        _U32.pack(diff.n_messages),
        diff.hashes,
    ]
    parts += _encode_router(diff.router_src)
    parts += _encode_router(diff.router_dst)
    return b"".join(parts)


def encode_state_header(
    shard: ShardIdent, seqno: int, diffs_tl: Sequence[bytes], n_chunks: int
) -> bytes:
    """The state ids, the header and the chunk count; the chunks follow (:func:`encode_chunk`).

    ``diffs_tl`` are boxed diffs, newest first. The list rules the reader enforces (count,
    seqno order, shard, hash chain) are checked here from the diffs' fixed-offset fields.
    """
    return b"".join(state_header_parts(shard, seqno, diffs_tl, n_chunks))


def state_header_parts(
    shard: ShardIdent, seqno: int, diffs_tl: Sequence[bytes], n_chunks: int
) -> list[bytes]:
    """:func:`encode_state_header` in the pieces it joins (the diffs' own bytes among
    them), checked alike: a writer writes them one by one, with no copy of the header."""
    if type(shard) is not ShardIdent:
        raise TypeError("shard must be a ShardIdent")
    if not isinstance(seqno, int) or not 0 <= seqno <= _U32_MAX:
        raise ValueError(f"seqno must be a u32, got {seqno!r}")
    if not 1 <= len(diffs_tl) <= MAX_DIFFS:
        raise ValueError(f"a state holds 1..={MAX_DIFFS} diffs, got {len(diffs_tl)}")
    if not isinstance(n_chunks, int) or not 0 <= n_chunks <= MAX_CHUNKS:
        raise ValueError(f"n_chunks must be in 0..={MAX_CHUNKS}, got {n_chunks!r}")
    expected_seqno, shard_bytes = seqno, _SHARD.pack(*shard)
    for i, tl in enumerate(diffs_tl):
        if tl[:4] != DIFF_MAGIC or len(tl) < _AT_SEQNO + 4:
            raise ValueError(f"diff {i} is not a boxed block.queueDiff")
        if tl[_AT_SHARD:_AT_SEQNO] != shard_bytes:
            raise ValueError(f"diff {i} belongs to another shard than {shard}")
        (diff_seqno,) = _U32.unpack_from(tl, _AT_SEQNO)
        if (i == 0 and diff_seqno != seqno) or (i > 0 and diff_seqno >= expected_seqno):
            raise ValueError(f"diff {i} has seqno {diff_seqno}: not the header seqno or not DESC")
        expected_seqno = diff_seqno
        if i > 0 and diffs_tl[i - 1][_AT_PREV_HASH:_AT_SHARD] != diff_hash(tl):
            raise ValueError(f"diff {i - 1}'s prev_hash is not the hash of diff {i}")
    return [
        _HEADER_IDS,
        shard_bytes,
        _U32.pack(seqno),
        _U32.pack(len(diffs_tl)),
        *diffs_tl,
        _U32.pack(n_chunks),
    ]


def encode_chunk(boc: bytes) -> bytes:
    """One ``bigBytes`` chunk: u32 length, the BOC, zero padding to a multiple of 4."""
    if not 0 < len(boc) <= MAX_CHUNK_SIZE:
        raise ValueError(f"a chunk holds 1..={MAX_CHUNK_SIZE} bytes, got {len(boc)}")
    return _U32.pack(len(boc)) + boc + bytes(-len(boc) % 4)


# ---------------------------------------------------------------------------------------------
# Reading


class _DiffReader:
    """Reads the fields of one diff, keeping its bytes for the hash."""

    __slots__ = ("parts", "src", "start")

    def __init__(self, src: ByteSource) -> None:
        self.src = src
        self.start = src.offset
        self.parts: list[bytes] = []

    def take(self, n: int, field: str) -> bytes:
        data = self.src.read(n, f"{field} of the queue diff at offset {self.start}")
        self.parts.append(data)
        return data

    def u32(self, field: str) -> int:
        value: int = _U32.unpack(self.take(4, field))[0]
        return value

    def fail(self, at: int, check: str) -> StateFormatError:
        return StateFormatError(f"queue diff at offset {self.start}: {check} at offset {at}")

    def shard(self, field: str) -> ShardIdent:
        at = self.src.offset
        return _shard(self.take(12, field), lambda msg: self.fail(at, f"{field}: {msg}"))

    def key(self, field: str) -> QueueKey:
        return QueueKey(*_KEY.unpack(self.take(40, field)))

    def count(self, field: str, limit: int) -> int:
        at = self.src.offset
        n = self.u32(field)
        if n > limit:
            raise self.fail(at, f"{field} is {n}, the limit is {limit}")
        return n


def _shard(data: bytes, fail: Callable[[str], StateFormatError]) -> ShardIdent:
    try:
        return ShardIdent(*_SHARD.unpack(data))
    except ValueError as exc:
        raise fail(f"invalid shard ({exc})") from None


def _read_processed_to(r: _DiffReader) -> tuple[tuple[ShardIdent, QueueKey], ...]:
    n = r.count("processed_to count", MAX_PROCESSED_TO)
    entries: list[tuple[ShardIdent, QueueKey]] = []
    for i in range(n):
        at = r.src.offset
        shard = r.shard(f"processed_to entry {i} shard")
        if entries and not entries[-1][0] < shard:
            raise r.fail(
                at, f"processed_to shards not strictly ascending ({shard} after {entries[-1][0]})"
            )
        entries.append((shard, r.key(f"processed_to entry {i} key")))
    return tuple(entries)


# Hash and account lists are read and checked a slice at a time: a few KiB of zstd can
# declare ten million zero hashes or accounts (an outside audit: 1.9 GB of memory for an
# 11 KB file), which must fail at the first slice, not once all of it was read and an
# object built per entry. Memory then follows the bytes that were checked.
_HASHES_A_SLICE = (1 << 20) // 32
_ACCOUNTS_A_SLICE = (1 << 20) // 36


def _read_hashes(r: _DiffReader) -> bytes:
    n = r.count("message count", MAX_MESSAGES)
    at = r.src.offset
    pieces: list[bytes] = []
    last = b""  # the previous slice's last hash: the order check crosses slices
    for first in range(0, n, _HASHES_A_SLICE):
        piece = r.take(32 * min(_HASHES_A_SLICE, n - first), f"{n} message hashes")
        bad = _first_bad_hash(last + piece)
        if bad is not None:
            index, check = bad
            index += first - len(last) // 32
            raise r.fail(at + 32 * index, f"{check} (message {index})")
        pieces.append(piece)
        last = piece[-32:]
    return b"".join(pieces)


def _read_router(r: _DiffReader, name: str) -> Router:
    n = r.count(f"{name} partition count", MAX_PARTITIONS)
    partitions: list[tuple[int, tuple[Address, ...]]] = []
    for _ in range(n):
        at = r.src.offset
        index = r.u32(f"{name} partition index")
        if index > 0xFFFF:
            raise r.fail(at, f"{name}: partition index {index} does not fit u16")
        if partitions and index <= partitions[-1][0]:
            raise r.fail(
                at,
                f"{name}: partition indexes not strictly ascending ({index} after "
                f"{partitions[-1][0]})",
            )
        count = r.count(f"{name} partition {index} account count", MAX_ACCOUNTS)
        base = r.src.offset
        accounts: list[tuple[int, bytes]] = []
        for first in range(0, count, _ACCOUNTS_A_SLICE):
            size = min(_ACCOUNTS_A_SLICE, count - first)
            data = r.take(36 * size, f"{name} partition {index} accounts")
            piece = list(_ROUTER_ADDR.iter_unpack(data))
            for i, (wc, _) in enumerate(piece, first):
                if not -128 <= wc <= 127:
                    raise r.fail(base + 36 * i, f"{name}: account workchain {wc} does not fit i8")
            before = accounts[-1:]  # the order check crosses slices
            bad = _first_unsorted(before + piece)
            if bad is not None:
                raise r.fail(
                    base + 36 * (first + bad - len(before)),
                    f"{name}: partition {index} accounts not strictly ascending",
                )
            accounts += piece
        partitions.append((index, tuple(_trusted_address(wc, acc) for wc, acc in accounts)))
    return tuple(partitions)


def _read_diff_parts(src: ByteSource) -> tuple[TlDiff, list[bytes]]:
    r = _DiffReader(src)
    magic = r.take(4, "constructor id")
    if magic != DIFF_MAGIC:
        raise r.fail(r.start, f"constructor id {magic.hex()} is not block.queueDiff (b2a32060)")
    prev_hash = r.take(32, "prev_hash")
    shard = r.shard("shard_ident")
    seqno = r.u32("seqno")
    processed_to = _read_processed_to(r)
    min_message = r.key("min_message")
    at = src.offset
    max_message = r.key("max_message")
    if max_message < min_message:
        raise r.fail(at, f"max_message {max_message} is below min_message {min_message}")
    hashes = _read_hashes(r)
    router_src = _read_router(r, "router_partitions_src")
    router_dst = _read_router(r, "router_partitions_dst")
    diff = TlDiff(
        prev_hash=prev_hash,
        shard=shard,
        seqno=seqno,
        processed_to=processed_to,
        min_message=min_message,
        max_message=max_message,
        hashes=hashes,
        router_src=router_src,
        router_dst=router_dst,
    )
    return diff, r.parts


def read_diff(src: ByteSource) -> tuple[TlDiff, bytes]:
    """Read one boxed diff with every check of FORMAT §3; return it and its exact TL bytes."""
    diff, parts = _read_diff_parts(src)
    return diff, b"".join(parts)


def decode_diff(data: bytes) -> TlDiff:
    """A whole boxed diff (e.g. a ``queue_diff.bin`` file); trailing bytes are an error."""
    src = ByteSource.from_bytes(data)
    diff, _ = read_diff(src)
    if not src.at_eof():
        raise StateFormatError(
            f"{len(data) - src.offset} trailing bytes after the queue diff at offset {src.offset}"
        )
    return diff


@dataclass(frozen=True, slots=True)
class StateHeader:
    """A state's header: the block it belongs to and its diffs, newest first."""

    shard: ShardIdent
    seqno: int
    diffs: tuple[TlDiff, ...]
    diff_hashes: tuple[bytes, ...]
    diff_offsets: tuple[int, ...]
    n_chunks: int


def _read_u32(src: ByteSource, what: str) -> int:
    value: int = _U32.unpack(src.read(4, what))[0]
    return value


def _read_ids(src: ByteSource) -> None:
    at = src.offset
    magic = src.read(4, "the queue state id")
    if magic == DIFF_MAGIC:
        raise StateFormatError(
            f"offset {at}: this is a queue diff, not a queue state (id b2a32060, expected "
            "block.queueState ccd96436)"
        )
    if magic != STATE_MAGIC:
        raise StateFormatError(
            f"offset {at}: unknown id {magic.hex()}, expected block.queueState (ccd96436)"
        )
    at = src.offset
    magic = src.read(4, "the queue state header id")
    if magic != _HEADER_IDS[4:]:
        raise StateFormatError(
            f"offset {at}: id {magic.hex()} is not block.queueStateHeader (654b01d4)"
        )


def _check_link(
    header: tuple[ShardIdent, int], diffs: list[TlDiff], offsets: list[int], hashes: list[bytes]
) -> None:
    """The list rules for the diff just read (the last of ``diffs``)."""
    i, diff, at = len(diffs) - 1, diffs[-1], offsets[-1]
    where = f"queue diff {i} at offset {at}"
    if diff.shard != header[0]:
        raise StateFormatError(
            f"{where}: shard {diff.shard} is not the state's shard {header[0]} at offset "
            f"{at + _AT_SHARD}"
        )
    if i == 0 and diff.seqno != header[1]:
        raise StateFormatError(
            f"{where}: seqno {diff.seqno} is not the state's seqno {header[1]} at offset "
            f"{at + _AT_SEQNO}"
        )
    if i > 0 and diff.seqno >= diffs[i - 1].seqno:
        raise StateFormatError(
            f"{where}: seqno {diff.seqno} not strictly below the previous diff's "
            f"{diffs[i - 1].seqno} at offset {at + _AT_SEQNO}"
        )
    if i > 0 and diffs[i - 1].prev_hash != hashes[i]:
        raise StateFormatError(
            f"queue diff {i - 1} at offset {offsets[i - 1]}: prev_hash "
            f"{diffs[i - 1].prev_hash.hex()} is not the hash {hashes[i].hex()} of the next "
            f"diff (seqno {diff.seqno}) at offset {offsets[i - 1] + _AT_PREV_HASH}"
        )


def _check_order(diff: TlDiff, at: int, newer: TlDiff | None) -> None:
    """A diff with messages lies wholly below the next newer diff with messages: a
    shard's blocks take ascending, disjoint lt ranges. (Empty diffs are left out: their
    spans are whatever their collator or test chose.) A state breaking this would list a
    message twice, or hold an older diff above the commit pointer its import sets."""
    if newer is not None and not diff.max_message < newer.min_message:
        raise StateFormatError(
            f"queue diff seqno {diff.seqno} at offset {at}: its messages end at "
            f"{_key_text(diff.max_message)}, not below the first message "
            f"{_key_text(newer.min_message)} of the newer diff seqno {newer.seqno}; a "
            "shard's diffs hold ascending, disjoint message ranges"
        )


def _check_below_top(diff: TlDiff, at: int, top: TlDiff) -> None:
    """An older diff ends at or below the newest diff's ``max_message``, empty diffs
    included: an import makes that key the shard's commit pointer, and a diff ending
    above it would be left uncommitted, for the next clear (a node's startup) to delete
    with its messages, after an import that said it succeeded."""
    if diff.max_message > top.max_message:
        raise StateFormatError(
            f"queue diff seqno {diff.seqno} at offset {at}: its max_message "
            f"{_key_text(diff.max_message)} lies above {_key_text(top.max_message)}, the "
            f"max_message of the newest diff (seqno {top.seqno}), which an import makes the "
            "commit pointer; a shard's older diffs end below its newer ones"
        )


def _key_text(key: QueueKey) -> str:
    return f"(lt {key.lt}, hash {key.hash.hex()})"


TopCheck = Callable[[ShardIdent, int, int, TlDiff, bytes, int], None]
"""Called once the newest diff is read: (shard, seqno, diff count, newest diff, its hash,
its offset); raises to stop before any older diff is parsed."""


def read_state_header(src: ByteSource, *, on_top: TopCheck | None = None) -> StateHeader:
    """Read the state's ids and header with every list check; stop before the first chunk.
    ``on_top`` checks the newest diff as soon as it is read (a top update: a forged
    header then costs the memory of one diff before it is refused, not of every one)."""
    _read_ids(src)
    at = src.offset
    shard = _shard(
        src.read(12, "the state's shard_ident"),
        lambda msg: StateFormatError(f"state header: shard_ident at offset {at}: {msg}"),
    )
    seqno = _read_u32(src, "the state's seqno")
    at = src.offset
    n_diffs = _read_u32(src, "the diff count")
    if not 1 <= n_diffs <= MAX_DIFFS:
        raise StateFormatError(
            f"state header: diff count {n_diffs} at offset {at} is not in 1..={MAX_DIFFS}"
        )
    diffs: list[TlDiff] = []
    hashes: list[bytes] = []
    offsets: list[int] = []
    newer: TlDiff | None = None  # the oldest diff read so far that has messages
    for _ in range(n_diffs):
        offsets.append(src.offset)
        diff, parts = _read_diff_parts(src)  # hashed part by part: no copy of a big hash list
        hasher = blake3()
        for part in parts:
            hasher.update(part)
        diffs.append(diff)
        hashes.append(hasher.digest())
        _check_link((shard, seqno), diffs, offsets, hashes)
        if on_top is not None and len(diffs) == 1:
            on_top(shard, seqno, n_diffs, diff, hashes[0], offsets[0])
        if diff.n_messages:
            _check_order(diff, offsets[-1], newer)
            newer = diff
        _check_below_top(diff, offsets[-1], diffs[0])
    at = src.offset
    n_chunks = _read_u32(src, "the chunk count")
    if n_chunks > MAX_CHUNKS:
        raise StateFormatError(
            f"state header: chunk count {n_chunks} at offset {at} exceeds {MAX_CHUNKS}"
        )
    return StateHeader(shard, seqno, tuple(diffs), tuple(hashes), tuple(offsets), n_chunks)


def read_chunk(src: ByteSource, index: int) -> bytes:
    """One ``bigBytes`` chunk: its BOC bytes, the zero padding checked and skipped."""
    at = src.offset
    size = _read_u32(src, f"the length of chunk {index}")
    if not 0 < size <= MAX_CHUNK_SIZE:
        raise StateFormatError(
            f"chunk {index} at offset {at}: length {size} is not in 1..={MAX_CHUNK_SIZE}"
        )
    data = src.read(size, f"chunk {index} ({size} bytes from offset {at})")
    pad = -size % 4
    if pad:
        pad_at = src.offset
        if src.read(pad, f"the padding of chunk {index}") != bytes(pad):
            raise StateFormatError(
                f"chunk {index} at offset {at}: chunk padding is not zero at offset {pad_at}"
            )
    return data
