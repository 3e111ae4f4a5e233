"""Every byte layout of the database: keys, values, range bounds.

Storage rows are packed and unpacked only here, with one exception by design: the
iterator's decode of message rows (``imq/iterator.py``, and ``imq/_speedups.c``, which
also packs them on the apply path) works on the raw bytes, at the offsets this module
defines (``MESSAGE_*``; a unit test pins the C ``#define``s to them).

Keys are fixed-width big-endian so that byte order equals logical order (D1):
signed numbers are stored offset-binary (value + 2**(bits-1)), so the masterchain
(-1) sorts before the basechain (0) and workchain -128 before 127. Variable records
(diff infos, the commit record, GC bounds) are msgpack positional arrays whose first
element is a record version.

Speed note: ``encode_diff`` (apply with derived statistics) and ``put_message_rows``
are the per-message write path: they pack with precompiled ``struct``s and put in the
same loop, and ``encode_diff`` also counts the destinations there (see the functions'
docstrings). When the optional C extension ``imq._speedups`` is built (and
``IMQ_PURE_PYTHON`` is unset; ``imq._native`` loads it), ``encode_diff``,
``put_message_rows`` and ``stat_value`` run its byte-identical C forms.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from operator import itemgetter
from typing import Any, NamedTuple

import msgpack

from imq import _native as native
from imq.errors import CorruptDataError
from imq.storage.queue_state import CommitRecord, GcBounds
from imq.types import (
    Address,
    BlockId,
    CommitPointer,
    DiffInfo,
    Message,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    _trusted_address,
    _trusted_queue_key,
    check_partition,
)

__all__ = [
    "ACCOUNT_LEN",
    "ADDRESS_LEN",
    "COMMIT_RECORD",
    "DIFF_INFO_KEY_LEN",
    "GC_EXECUTED",
    "GC_REQUESTED",
    "HASH_LEN",
    "IMPORT_MARKER",
    "KEY_LEN",
    "LAST_COMMITTED_MC_BLOCK",
    "LT_LEN",
    "MESSAGE_DST_AT",
    "MESSAGE_KEY_LEN",
    "MESSAGE_KEY_LT_HASH",
    "MESSAGE_LT_END",
    "MESSAGE_PREFIX_LEN",
    "MESSAGE_SRC_AT",
    "MESSAGE_VALUE_HEADER_LEN",
    "SCHEMA_VERSION",
    "SCHEMA_VERSION_KEY",
    "SHARD_LEN",
    "STAT_ENTRY_LEN",
    "STAT_KEY_LEN",
    "STAT_PREFIX_LEN",
    "TAIL_KEY_LEN",
    "Destinations",
    "EncodedDiff",
    "address_bytes",
    "block_id_bytes",
    "commit_record_value",
    "decode_address",
    "decode_block_id",
    "decode_commit_record",
    "decode_diff_info",
    "decode_diff_info_seqno",
    "decode_diff_record",
    "decode_diff_span",
    "decode_gc_bounds",
    "decode_import_marker",
    "decode_key",
    "decode_message",
    "decode_message_export",
    "decode_pointer",
    "decode_shard",
    "decode_stat_row",
    "decode_tail_key",
    "decode_u32",
    "diff_info_key",
    "diff_info_shard_range",
    "diff_info_value",
    "diff_record_value",
    "encode_diff",
    "gc_bounds_value",
    "import_marker_value",
    "key_bytes",
    "message_delete_range",
    "message_key",
    "message_prefix",
    "message_range",
    "message_rows",
    "pointer_value",
    "prefix_end",
    "put_message_rows",
    "put_raw_message_rows",
    "stat_delete_range",
    "stat_key",
    "stat_prefix",
    "stat_range",
    "stat_value",
    "tail_key",
    "tail_range",
    "tail_range_inclusive",
    "u32_value",
    "workchain_byte",
]

SCHEMA_VERSION = 1
_RECORD_VERSION = 1

# vars table keys
SCHEMA_VERSION_KEY = b"schema_version"
LAST_COMMITTED_MC_BLOCK = b"last_committed_mc_block_id"
COMMIT_RECORD = b"commit_record"
GC_REQUESTED = b"gc_requested"
GC_EXECUTED = b"gc_executed"
IMPORT_MARKER = b"import_in_progress"

SHARD_LEN = 12
LT_LEN = 8
HASH_LEN = 32
KEY_LEN = LT_LEN + HASH_LEN  # a queue key: lt u64, hash
ACCOUNT_LEN = 32
ADDRESS_LEN = 1 + ACCOUNT_LEN  # workchain + 128, account
# The message row, the one layout three readers share: this module writes it, the
# iterator and its C decode (imq/_speedups.c, whose #defines a unit test pins to these
# values) read it at these offsets.
#   key   = partition u16 | source shard (12) | lt u64 | hash (32)
#   value = dst address (33) | src address (33) | body
MESSAGE_PREFIX_LEN = 2 + SHARD_LEN  # where the queue key starts in a message key
MESSAGE_LT_END = MESSAGE_PREFIX_LEN + LT_LEN  # where the hash starts
MESSAGE_KEY_LEN = MESSAGE_PREFIX_LEN + KEY_LEN  # 54
MESSAGE_DST_AT = 0
MESSAGE_SRC_AT = ADDRESS_LEN
MESSAGE_VALUE_HEADER_LEN = 2 * ADDRESS_LEN  # where the body starts
STAT_PREFIX_LEN = SHARD_LEN + 2 + KEY_LEN  # 54
STAT_KEY_LEN = STAT_PREFIX_LEN + 4  # 58
TAIL_KEY_LEN = SHARD_LEN + KEY_LEN + 4  # 56
DIFF_INFO_KEY_LEN = SHARD_LEN + 4  # 16

_SHARD = struct.Struct(">IQ")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_STAT_ENTRY = struct.Struct(">B32sQ")  # destination (offset workchain, account), count
STAT_ENTRY_LEN = _STAT_ENTRY.size  # 41
_MESSAGE_KEY = struct.Struct(f">{MESSAGE_PREFIX_LEN}sQ{HASH_LEN}s")  # prefix, lt, hash
_MESSAGE_HEADER = struct.Struct(f">B{ACCOUNT_LEN}sB{ACCOUNT_LEN}s")  # dst wc, account, src ...
MESSAGE_KEY_LT_HASH = struct.Struct(f">{MESSAGE_PREFIX_LEN}xQ{HASH_LEN}s")
"""Unpacks ``(lt, hash)`` from a message key (what the iterator's decode uses)."""
_I32_OFFSET = 1 << 31
_WC_BYTE = {wc: bytes((wc + 128,)) for wc in range(-128, 128)}

_pack = msgpack.Packer(use_bin_type=True).pack
# What decoding a damaged record raises (msgpack's own errors included): reported as
# CorruptDataError. Nothing broader: an exception a signal handler raises inside a decode
# (an alarm's TimeoutError) is no damage and goes to the caller as it is.
_UNDECODABLE = (
    ValueError,
    TypeError,
    IndexError,
    KeyError,
    AttributeError,
    OverflowError,
    struct.error,
    msgpack.UnpackException,
)


def undecodable(exc: BaseException) -> str:
    """A corrupt row's reason: that its value is not what imq writes there, and the
    decoder's or check's own words when it has any (msgpack's ``FormatError`` has none)."""
    text = str(exc)
    return f"the stored value is malformed ({type(exc).__name__}{': ' + text if text else ''})"


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=True)


# ---------------------------------------------------------------------------------------------
# Primitives


@lru_cache(maxsize=4096)
def shard_bytes(shard: ShardIdent) -> bytes:
    return _SHARD.pack(shard.workchain + _I32_OFFSET, shard.prefix)


def decode_shard(data: bytes) -> ShardIdent:
    """Decode 12 shard bytes; raises ``ValueError`` on an invalid shard."""
    offset_wc, prefix = _SHARD.unpack(data)
    return ShardIdent(offset_wc - _I32_OFFSET, prefix)


# A queue key's 40 bytes (lt u64 big-endian, then hash): the key's own byte form.
key_bytes = QueueKey.to_bytes


def decode_key(data: bytes) -> QueueKey:
    if len(data) != KEY_LEN:
        raise ValueError(f"a queue key is {KEY_LEN} bytes, got {len(data)}")
    return _trusted_queue_key(int.from_bytes(data[:8], "big"), data[8:])


def address_bytes(address: Address) -> bytes:
    return _WC_BYTE[address[0]] + address[1]


def decode_address(data: bytes) -> Address:
    if len(data) != ADDRESS_LEN:
        raise ValueError(f"an address is {ADDRESS_LEN} bytes, got {len(data)}")
    return Address(data[0] - 128, data[1:])


def workchain_byte(workchain: int) -> int | None:
    """The stored header byte of an address in ``workchain``; ``None`` outside i8."""
    return workchain + 128 if -128 <= workchain <= 127 else None


def prefix_end(prefix: bytes) -> bytes:
    """The smallest byte string greater than every string that starts with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        raise ValueError("a prefix of only 0xff bytes has no finite end")
    return stripped[:-1] + bytes((stripped[-1] + 1,))


def _inclusive_end(prefix: bytes, key: QueueKey) -> bytes:
    """Exclusive upper bound covering every key in ``prefix`` up to ``key`` inclusive."""
    if key == QueueKey.MAX:
        return prefix_end(prefix)
    return prefix + key_bytes(key.next_value())


# ---------------------------------------------------------------------------------------------
# messages


@lru_cache(maxsize=4096)
def message_prefix(partition: int, shard: ShardIdent) -> bytes:
    return _U16.pack(partition) + shard_bytes(shard)


def message_key(partition: int, shard: ShardIdent, key: QueueKey) -> bytes:
    return message_prefix(partition, shard) + key_bytes(key)


def message_range(
    partition: int, shard: ShardIdent, from_key: QueueKey, to_key: QueueKey
) -> tuple[bytes, bytes]:
    """``[from_key, to_key)`` of one (partition, source shard)."""
    prefix = message_prefix(partition, shard)
    # key_bytes inlined: every iterator builds one range per source shard
    return (
        prefix + from_key[0].to_bytes(8, "big") + from_key[1],
        prefix + to_key[0].to_bytes(8, "big") + to_key[1],
    )


def message_bounds(partition: int, ranges: Sequence[QueueShardRange]) -> list[tuple[bytes, bytes]]:
    """:func:`message_range` of each range, ``hi`` raised to ``lo`` when below it (an
    empty range): the scans of the merge iterator, one per source shard. In C when
    ``imq._speedups`` is built (byte-identical)."""
    if _c_message_bounds is not None:
        bounds: list[tuple[bytes, bytes]] = _c_message_bounds(partition, ranges)
        return bounds
    return _message_bounds_py(partition, ranges)


def _message_bounds_py(
    partition: int, ranges: Sequence[QueueShardRange]
) -> list[tuple[bytes, bytes]]:
    bounds = []
    for r in ranges:
        lo, hi = message_range(partition, r.shard, r.from_key, r.to_key)
        bounds.append((lo, hi if hi > lo else lo))
    return bounds


def message_delete_range(
    partition: int, shard: ShardIdent, first: QueueKey, last: QueueKey
) -> tuple[bytes, bytes]:
    """``[first, last]`` inclusive, as a half-open byte range for ``delete_range``."""
    prefix = message_prefix(partition, shard)
    return prefix + key_bytes(first), _inclusive_end(prefix, last)


PartitionFor = Callable[[Address, Address], int] | dict[Address, int] | None
"""How the encoders pick a message's partition: ``None``, partition 0 for every message;
a dict, a router's destination routes (:meth:`PartitionRouter.destination_routes`:
the partition of each routed destination, 0 for any other), looked up without a call;
else a ``(src, dst) -> partition`` callable (:meth:`PartitionRouter.partition_for`)."""


def _router_call(
    partition_for: Callable[[Address, Address], int] | dict[Address, int],
) -> Callable[[Address, Address], int]:
    """``partition_for`` (not ``None``) as a ``(src, dst) -> partition`` callable."""
    if isinstance(partition_for, dict):
        if type(partition_for) is not dict:  # as C, which looks up an exact dict only
            raise TypeError("destination routes must be a dict, not a subclass")
        routes = partition_for
        return lambda _src, dst: routes.get(dst, 0)
    return partition_for


def _put_message_rows_py(
    put: Callable[[bytes, bytes, Any], object],
    target: Any,
    shard: ShardIdent,
    messages: Iterable[Message],
    partition_for: PartitionFor,
    *,
    counts: dict[int, int] | None = None,
) -> int:
    """Encode ``messages`` of source ``shard`` and hand each row to ``put(key, value,
    target)``; ``partition_for=None`` puts every message in partition 0. ``counts`` (if
    given) receives messages per partition. Returns the number of rows.

    Encoding and putting are one loop: a generator between them cost ~360 ns a row.
    """
    pack_key = _MESSAGE_KEY.pack
    pack_header = _MESSAGE_HEADER.pack
    shard_b = shard_bytes(shard)
    tally: dict[int, int] = {} if counts is None else counts
    n = 0
    if partition_for is None:
        prefix = _U16.pack(0) + shard_b
        for key, src, dst, body in messages:
            put(
                pack_key(prefix, key[0], key[1]),
                pack_header(dst[0] + 128, dst[1], src[0] + 128, src[1]) + body,
                target,
            )
            n += 1
        if n:
            tally[0] = tally.get(0, 0) + n
        return n
    prefixes: dict[int, bytes] = {}
    route = _router_call(partition_for)
    for key, src, dst, body in messages:
        partition = route(src, dst)
        prefix = prefixes.get(partition) or prefixes.setdefault(
            partition, _U16.pack(partition) + shard_b
        )
        tally[partition] = tally.get(partition, 0) + 1
        put(
            pack_key(prefix, key[0], key[1]),
            pack_header(dst[0] + 128, dst[1], src[0] + 128, src[1]) + body,
            target,
        )
        n += 1
    return n


def put_raw_message_rows(
    put: Callable[[bytes, bytes, Any], object],
    target: Any,
    shard: ShardIdent,
    *,
    partitions: Iterable[int] | None,
    headers: Iterable[tuple[int, int, bytes, int, bytes]],
    roots: Iterable[Sequence[Any]],
) -> None:
    """Put message rows given as plain fields, without building ``Message`` objects (the
    import path). ``headers`` are ``(lt, src_wc, src_account, dst_wc, dst_account)``,
    ``roots`` are ``(hash, _, _, body, ...)`` (a state's message roots, ``RootView``s),
    ``partitions`` one per message or ``None`` for partition 0. The bytes equal what
    :func:`put_message_rows` writes for the same message."""
    pack_key = _MESSAGE_KEY.pack
    pack_header = _MESSAGE_HEADER.pack
    shard_b = shard_bytes(shard)
    if partitions is None:
        prefix = _U16.pack(0) + shard_b
        for (lt, src_wc, src_acc, dst_wc, dst_acc), root in zip(headers, roots, strict=True):
            put(
                pack_key(prefix, lt, root[0]),
                pack_header(dst_wc + 128, dst_acc, src_wc + 128, src_acc) + root[3],
                target,
            )
        return
    prefixes: dict[int, bytes] = {}
    for partition, (lt, src_wc, src_acc, dst_wc, dst_acc), root in zip(
        partitions, headers, roots, strict=True
    ):
        prefix = prefixes.get(partition) or prefixes.setdefault(
            partition, _U16.pack(partition) + shard_b
        )
        put(
            pack_key(prefix, lt, root[0]),
            pack_header(dst_wc + 128, dst_acc, src_wc + 128, src_acc) + root[3],
            target,
        )


def decode_message_export(raw_key: bytes, value: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    """(message hash, body, lt, addresses) of a stored row, what an export needs: lt as
    its 8 stored bytes, the addresses as stored (destination, then source), undecoded."""
    if len(raw_key) != MESSAGE_KEY_LEN or len(value) < MESSAGE_VALUE_HEADER_LEN:
        raise CorruptDataError("messages", raw_key, "bad key or value length")
    return (
        raw_key[MESSAGE_LT_END:],
        value[MESSAGE_VALUE_HEADER_LEN:],
        raw_key[MESSAGE_PREFIX_LEN:MESSAGE_LT_END],
        value[:MESSAGE_VALUE_HEADER_LEN],
    )


def message_rows(
    shard: ShardIdent,
    messages: Iterable[Message],
    partition_for: PartitionFor = None,
) -> list[tuple[bytes, bytes]]:
    """The (key, value) rows ``put_message_rows`` writes, as a list."""
    rows: list[tuple[bytes, bytes]] = []
    put_message_rows(lambda k, v, _t: rows.append((k, v)), None, shard, messages, partition_for)
    return rows


def decode_message(raw_key: bytes, value: bytes) -> Message:
    """Rebuild a message from its stored row (the caller checked the lengths)."""
    return Message(
        decode_key(raw_key[MESSAGE_PREFIX_LEN:]),
        decode_address(value[ADDRESS_LEN : 2 * ADDRESS_LEN]),
        decode_address(value[:ADDRESS_LEN]),
        value[2 * ADDRESS_LEN :],
    )


# ---------------------------------------------------------------------------------------------
# statistics


def stat_prefix(shard: ShardIdent, partition: int, max_message: QueueKey) -> bytes:
    return shard_bytes(shard) + _U16.pack(partition) + key_bytes(max_message)


def stat_key(shard: ShardIdent, partition: int, max_message: QueueKey, seqno: int) -> bytes:
    """One row per (diff, partition): statistics are always read a whole diff at a time."""
    return stat_prefix(shard, partition, max_message) + _U32.pack(seqno)


Destinations = Mapping[Address, int] | Mapping[tuple[int, bytes], int]
"""Messages per destination, keyed by ``Address`` or by a plain ``(workchain, account)``."""


def _stat_value_py(counts: Destinations) -> bytes:
    """Packed ``(destination, count)`` entries of one diff in one partition."""
    pack = _STAT_ENTRY.pack
    return b"".join([pack(dst[0] + 128, dst[1], count) for dst, count in counts.items()])


def stat_range(
    shard: ShardIdent, partition: int, from_key: QueueKey, to_key: QueueKey
) -> tuple[bytes, bytes]:
    """Rows of diffs whose max_message lies in ``[from_key, to_key)`` (clean prefix bounds)."""
    return stat_prefix(shard, partition, from_key), stat_prefix(shard, partition, to_key)


def stat_delete_range(
    shard: ShardIdent, partition: int, first: QueueKey, last: QueueKey
) -> tuple[bytes, bytes]:
    """Every row of diffs with ``first <= max_message <= last`` (clean prefix bounds, D4)."""
    prefix = shard_bytes(shard) + _U16.pack(partition)
    return prefix + key_bytes(first), _inclusive_end(prefix, last)


def decode_stat_row(key: bytes, value: bytes) -> tuple[QueueKey, list[tuple[Address, int]]]:
    """(diff max_message, [(destination, count), ...]) of a statistics row."""
    try:
        if len(key) != STAT_KEY_LEN or len(value) % _STAT_ENTRY.size:
            raise ValueError(f"bad lengths: key {len(key)} B, value {len(value)} B")
        max_message = decode_key(key[SHARD_LEN + 2 : STAT_PREFIX_LEN])
        entries = [
            (_trusted_address(wc - 128, account), count)
            for wc, account, count in _STAT_ENTRY.iter_unpack(value)
        ]
        return max_message, entries
    except ValueError as exc:
        raise CorruptDataError("statistics", key, str(exc)) from None


# ---------------------------------------------------------------------------------------------
# diff tail


def tail_key(shard: ShardIdent, max_message: QueueKey, seqno: int) -> bytes:
    return shard_bytes(shard) + key_bytes(max_message) + _U32.pack(seqno)


def tail_range(shard: ShardIdent, from_key: QueueKey) -> tuple[bytes, bytes]:
    """Tail rows of ``shard`` with max_message >= ``from_key`` (up to and including MAX)."""
    prefix = shard_bytes(shard)
    return prefix + key_bytes(from_key), prefix_end(prefix)


def tail_range_inclusive(shard: ShardIdent, first: QueueKey, last: QueueKey) -> tuple[bytes, bytes]:
    """Tail rows of ``shard`` with ``first <= max_message <= last``."""
    prefix = shard_bytes(shard)
    return prefix + key_bytes(first), _inclusive_end(prefix, last)


def decode_tail_key(key: bytes) -> tuple[QueueKey, int]:
    """(max_message, seqno) of a diff-tail row."""
    if len(key) != TAIL_KEY_LEN:
        raise CorruptDataError("diff_tail", key, f"a tail key is {TAIL_KEY_LEN} bytes")
    max_message = decode_key(key[SHARD_LEN : SHARD_LEN + KEY_LEN])
    return max_message, _U32.unpack(key[SHARD_LEN + KEY_LEN :])[0]


# ---------------------------------------------------------------------------------------------
# diff info


def diff_info_key(shard: ShardIdent, seqno: int) -> bytes:
    return shard_bytes(shard) + _U32.pack(seqno)


def diff_info_shard_range(shard: ShardIdent) -> tuple[bytes, bytes]:
    prefix = shard_bytes(shard)
    return prefix, prefix_end(prefix)


def decode_diff_info_seqno(key: bytes) -> int:
    if len(key) != DIFF_INFO_KEY_LEN:
        raise CorruptDataError("diff_info", key, f"a diff-info key is {DIFF_INFO_KEY_LEN} bytes")
    return int(_U32.unpack(key[SHARD_LEN:])[0])


def _router_rows(partitions: Mapping[int, frozenset[Address]]) -> list[list[Any]]:
    return [[p, sorted(address_bytes(a) for a in partitions[p])] for p in sorted(partitions)]


def diff_info_value(info: DiffInfo, partitions: Mapping[int, int]) -> bytes:
    """The stored record of a diff. ``partitions`` maps every partition the diff wrote
    messages or statistics into to its number of messages there, so deletes can find
    all of its rows and say how many messages they removed."""
    return diff_record_value(
        info.min_message,
        info.max_message,
        info.shards_messages_count,
        info.hash,
        info.processed_to,
        info.router_src,
        info.router_dst,
        info.seqno,
        info.prev_hash,
        partitions,
    )


def diff_record_value(  # noqa: PLR0917 - one argument per field of the record
    min_message: QueueKey,
    max_message: QueueKey,
    shards_messages_count: Mapping[ShardIdent, int],
    diff_hash: bytes,
    processed_to: Mapping[ShardIdent, QueueKey],
    router_src: Mapping[int, frozenset[Address]],
    router_dst: Mapping[int, frozenset[Address]],
    seqno: int,
    prev_hash: bytes | None,
    partitions: Mapping[int, int],
) -> bytes:
    """:func:`diff_info_value` of the fields of a :class:`DiffInfo`, without building one
    (the apply path, whose fields are checked already). One C call when
    ``imq._speedups`` is built and the mappings are dicts; else msgpack packs the same
    bytes here."""
    if _c_diff_record is not None and all(
        type(m) is dict
        for m in (shards_messages_count, processed_to, router_src, router_dst, partitions)
    ):
        record: bytes = _c_diff_record(
            _RECORD_VERSION,
            min_message,
            max_message,
            shards_messages_count,
            diff_hash,
            processed_to,
            router_src,
            router_dst,
            seqno,
            prev_hash,
            partitions,
        )
        return record
    return bytes(
        _pack(
            [
                _RECORD_VERSION,
                key_bytes(min_message),
                key_bytes(max_message),
                [[shard_bytes(s), c] for s, c in sorted(shards_messages_count.items())],
                diff_hash,
                # key_bytes inlined: a collator's diff names every shard here
                [
                    [shard_bytes(s), k[0].to_bytes(8, "big") + k[1]]
                    for s, k in sorted(processed_to.items())
                ],
                _router_rows(router_src),
                _router_rows(router_dst),
                seqno,
                prev_hash,
                [[p, partitions[p]] for p in sorted(partitions)],
            ]
        )
    )


def decode_diff_span(key: bytes, value: bytes) -> tuple[QueueKey, QueueKey, dict[int, int]]:
    """(min_message, max_message, messages per partition) of a diff record, without
    building its DiffInfo: what deletes need, at a fraction of the cost."""
    try:
        record = _unpack(value)
        if record[0] != _RECORD_VERSION or len(record) != 11:
            raise ValueError(f"unknown diff-info record version {record[0]!r}")
        partitions: dict[int, int] = {}
        for p, n in record[10]:
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"bad message count {n!r} for partition {p!r}")
            partitions[check_partition(p)] = n
        return decode_key(record[1]), decode_key(record[2]), partitions
    except _UNDECODABLE as exc:
        raise CorruptDataError("diff_info", key, undecodable(exc)) from None


def _decode_router(rows: Any) -> dict[int, frozenset[Address]]:
    return {check_partition(p): frozenset(decode_address(a) for a in addrs) for p, addrs in rows}


def decode_diff_info(key: bytes, value: bytes) -> DiffInfo:
    return decode_diff_record(key, value)[0]


def decode_diff_record(key: bytes, value: bytes) -> tuple[DiffInfo, dict[int, int]]:
    """The diff info, and the partitions the diff wrote rows into with its message
    count in each."""
    try:
        record = _unpack(value)
        if record[0] != _RECORD_VERSION or len(record) != 11:
            raise ValueError(f"unknown diff-info record version {record[0]!r}")
        _, min_b, max_b, counts, hash_, processed, src, dst, seqno, prev_hash, parts = record
        if not isinstance(hash_, bytes) or len(hash_) != 32:
            raise ValueError("hash must be 32 bytes")
        if prev_hash is not None and (not isinstance(prev_hash, bytes) or len(prev_hash) != 32):
            raise ValueError("prev_hash must be 32 bytes or nil")
        info_seqno = decode_diff_info_seqno(key)
        if seqno != info_seqno:
            raise ValueError(f"record seqno {seqno} differs from key seqno {info_seqno}")
        info = DiffInfo(
            min_message=decode_key(min_b),
            max_message=decode_key(max_b),
            shards_messages_count={decode_shard(s): c for s, c in counts},
            hash=hash_,
            processed_to={decode_shard(s): decode_key(k) for s, k in processed},
            router_src=_decode_router(src),
            router_dst=_decode_router(dst),
            seqno=seqno,
            prev_hash=prev_hash,
        )
        partitions: dict[int, int] = {}
        for p, n in parts:
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"bad message count {n!r} for partition {p!r}")
            partitions[check_partition(p)] = n
        return info, partitions
    except _UNDECODABLE as exc:
        raise CorruptDataError("diff_info", key, undecodable(exc)) from None


# ---------------------------------------------------------------------------------------------
# commit pointers, vars


def pointer_value(pointer: CommitPointer) -> bytes:
    return key_bytes(pointer.key) + _U32.pack(pointer.seqno)


def decode_pointer(key: bytes, value: bytes) -> tuple[ShardIdent, CommitPointer]:
    try:
        if len(key) != SHARD_LEN or len(value) != KEY_LEN + 4:
            raise ValueError(f"bad lengths: key {len(key)} B, value {len(value)} B")
        pointer = CommitPointer(decode_key(value[:KEY_LEN]), _U32.unpack(value[KEY_LEN:])[0])
        return decode_shard(key), pointer
    except ValueError as exc:
        raise CorruptDataError("commit_pointers", key, str(exc)) from None


def block_id_bytes(block_id: BlockId) -> bytes:
    return (
        shard_bytes(block_id.shard)
        + _U32.pack(block_id.seqno)
        + block_id.root_hash
        + block_id.file_hash
    )


def decode_block_id(value: bytes) -> BlockId:
    try:
        if len(value) != SHARD_LEN + 4 + 64:
            raise ValueError(f"a block id is 80 bytes, got {len(value)}")
        shard = decode_shard(value[:SHARD_LEN])
        seqno = _U32.unpack(value[SHARD_LEN : SHARD_LEN + 4])[0]
        return BlockId(shard, seqno, value[SHARD_LEN + 4 : SHARD_LEN + 36], value[SHARD_LEN + 36 :])
    except ValueError as exc:
        raise CorruptDataError("vars", LAST_COMMITTED_MC_BLOCK, str(exc)) from None


def u32_value(value: int) -> bytes:
    return _U32.pack(value)


def decode_u32(name: bytes, value: bytes) -> int:
    if len(value) != 4:
        raise CorruptDataError("vars", name, f"expected a 4-byte integer, got {len(value)} B")
    return int(_U32.unpack(value)[0])


def commit_record_value(record: CommitRecord) -> bytes:
    rows = [
        [shard_bytes(top), [[shard_bytes(s), key_bytes(k)] for s, k in sorted(pt.items())]]
        for top, pt in sorted(record.items())
    ]
    return bytes(_pack([_RECORD_VERSION, rows]))


def decode_commit_record(value: bytes) -> dict[ShardIdent, dict[ShardIdent, QueueKey]]:
    try:
        version, rows = _unpack(value)
        if version != _RECORD_VERSION:
            raise ValueError(f"unknown commit record version {version!r}")
        return {
            decode_shard(top): {decode_shard(s): decode_key(k) for s, k in entries}
            for top, entries in rows
        }
    except _UNDECODABLE as exc:
        raise CorruptDataError("vars", COMMIT_RECORD, undecodable(exc)) from None


def gc_bounds_value(bounds: GcBounds) -> bytes:
    rows = [[p, shard_bytes(s), key_bytes(k)] for (p, s), k in sorted(bounds.items())]
    return bytes(_pack([_RECORD_VERSION, rows]))


def decode_gc_bounds(name: bytes, value: bytes) -> dict[tuple[int, ShardIdent], QueueKey]:
    try:
        version, rows = _unpack(value)
        if version != _RECORD_VERSION:
            raise ValueError(f"unknown GC bounds version {version!r}")
        return {(check_partition(p), decode_shard(s)): decode_key(k) for p, s, k in rows}
    except _UNDECODABLE as exc:
        raise CorruptDataError("vars", name, undecodable(exc)) from None


# ---------------------------------------------------------------------------------------------
# the import marker (D10)


def import_marker_value(
    block_id: BlockId,
    diffs: Iterable[tuple[int, QueueKey, QueueKey]],
    partitions: Iterable[int],
) -> bytes:
    """What an import in progress has begun to write: the block, the ``(seqno, min, max)``
    of every diff it writes (all of the block's shard) and every partition it writes to."""
    return bytes(
        _pack(
            [
                _RECORD_VERSION,
                block_id_bytes(block_id),
                [[s, key_bytes(lo), key_bytes(hi)] for s, lo, hi in diffs],
                sorted(partitions),
            ]
        )
    )


def decode_import_marker(
    value: bytes,
) -> tuple[BlockId, list[tuple[int, QueueKey, QueueKey]], list[int]]:
    try:
        record = _unpack(value)
        if record[0] != _RECORD_VERSION or len(record) != 4:
            raise ValueError(f"unknown import marker version {record[0]!r}")
        block_id = decode_block_id(record[1])
        diffs = [(int(s), decode_key(lo), decode_key(hi)) for s, lo, hi in record[2]]
        return block_id, diffs, [check_partition(p) for p in record[3]]
    except _UNDECODABLE as exc:
        raise CorruptDataError("vars", IMPORT_MARKER, undecodable(exc)) from None


# ---------------------------------------------------------------------------------------------
# The compiled write path (optional)


_speedups = native.speedups
_c_put_rows: Any = None if _speedups is None else _speedups.put_rows
_c_stat_value: Any = None if _speedups is None else _speedups.stat_value
_c_encode_diff: Any = None if _speedups is None else _speedups.encode_diff
_c_diff_record: Any = None if _speedups is None else _speedups.diff_record
_c_message_bounds: Any = None if _speedups is None else _speedups.message_bounds


def put_message_rows(
    put: Callable[[bytes, bytes, Any], object],
    target: Any,
    shard: ShardIdent,
    messages: Iterable[Message],
    partition_for: PartitionFor,
    *,
    counts: dict[int, int] | None = None,
) -> int:
    """Encode ``messages`` of source ``shard`` and hand each row to ``put(key, value,
    target)``; ``partition_for=None`` puts every message in partition 0. ``counts`` (if
    given) receives messages per partition. Returns the number of rows.

    Runs in C (one call for the whole diff) when ``imq._speedups`` is built and
    ``messages`` is a tuple or list; the rows are byte-identical either way.
    """
    tally: dict[int, int] = {} if counts is None else counts
    if _c_put_rows is not None and type(messages) in (tuple, list):
        rows: int = _c_put_rows(put, target, shard_bytes(shard), messages, partition_for, tally)
        return rows
    return _put_message_rows_py(put, target, shard, messages, partition_for, counts=tally)


def stat_value(counts: Destinations) -> bytes:
    """Packed ``(destination, count)`` entries of one diff in one partition."""
    if _c_stat_value is not None and type(counts) is dict:
        value: bytes = _c_stat_value(counts)
        return value
    return _stat_value_py(counts)


class EncodedDiff(NamedTuple):
    """What :func:`encode_diff` derives from a diff's messages while it puts their rows."""

    rows: int
    partitions: list[tuple[int, int, bytes]]
    """``(partition, messages, statistics value)`` per partition with messages, ascending;
    the value is what :func:`stat_value` packs for the counts ``DiffStatistics.from_diff``
    takes (destinations in first-seen order)."""
    workchains: list[tuple[int, int]]
    """``(destination workchain, messages)``, ascending (``shards_messages_count``)."""


_dst_of = itemgetter(2)


def _encode_diff_py(
    put: Callable[[bytes, bytes, Any], object],
    target: Any,
    shard: ShardIdent,
    messages: Sequence[Message],
    partition_for: PartitionFor,
) -> EncodedDiff:
    """The pure-Python :func:`encode_diff`."""
    counts: dict[int, dict[Address, int]] = {}
    if partition_for is None:
        n = _put_message_rows_py(put, target, shard, messages, None)
        if n:
            counts[0] = dict(Counter(map(_dst_of, messages)))
    else:
        pack_key = _MESSAGE_KEY.pack
        pack_header = _MESSAGE_HEADER.pack
        shard_b = shard_bytes(shard)
        prefixes: dict[int, bytes] = {}
        n = 0
        route = _router_call(partition_for)
        for key, src, dst, body in messages:
            partition = route(src, dst)
            prefix = prefixes.get(partition) or prefixes.setdefault(
                partition, _U16.pack(check_partition(partition)) + shard_b
            )
            put(
                pack_key(prefix, key[0], key[1]),
                pack_header(dst[0] + 128, dst[1], src[0] + 128, src[1]) + body,
                target,
            )
            bucket = counts.get(partition)
            if bucket is None:
                bucket = counts[partition] = {}
            bucket[dst] = bucket.get(dst, 0) + 1
            n += 1
    per_wc: dict[int, int] = {}
    partitions = []
    for partition in sorted(counts):
        dests = counts[partition]
        total = 0
        for (workchain, _account), count in dests.items():
            per_wc[workchain] = per_wc.get(workchain, 0) + count
            total += count
        partitions.append((partition, total, _stat_value_py(dests)))
    return EncodedDiff(n, partitions, sorted(per_wc.items()))


def encode_diff(
    put: Callable[[bytes, bytes, Any], object],
    target: Any,
    shard: ShardIdent,
    messages: Sequence[Message],
    partition_for: PartitionFor,
) -> EncodedDiff:
    """Put the message rows of a diff of source ``shard`` (as :func:`put_message_rows`)
    and, in the same pass, count its messages per partition, per destination and per
    destination workchain: the rows, statistics values and totals an apply writes when
    it derives the diff's statistics. One C call when ``imq._speedups`` is built and
    ``messages`` is a tuple or list; the bytes and counts are identical either way."""
    if _c_encode_diff is not None and type(messages) in (tuple, list):
        rows, partitions, workchains = _c_encode_diff(
            put, target, shard_bytes(shard), messages, partition_for
        )
        return EncodedDiff(rows, partitions, workchains)
    return _encode_diff_py(put, target, shard, messages, partition_for)
