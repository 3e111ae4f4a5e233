"""Exporting the persistent queue state of a block from the store (SEMANTICS §13.2).

The state of block (shard, seqno) with tail length n holds the diffs seqno, seqno-1, ...,
seqno-n+1 of that shard, newest first, and all their messages. Each diff's TL is rebuilt
from its stored info and the hashes of its stored messages; its ``prev_hash`` is the hash
of the exported diff before it (the oldest one's is the stored ``prev_hash``, or zero
when unknown), so the file always passes the reader's hash chain check. It is bit-exact
(every diff hashes to its stored hash) when the stored ``prev_hash`` of the oldest diff
is known, as after an import.

Memory: the message hashes of the exported diffs (32 bytes each), the messages of one
diff at a time, and one chunk; the chunks are spooled to a temporary file because the
header that precedes them lists every message hash and the chunk count.

Nothing is written to the destination before every message is spooled and every diff
encoded: what the format cannot hold, or its import would reject -- a body that is no
message BOC, a body whose root does not hash to its key's hash or whose header names
another lt, source or destination than its row, two messages of one diff with the same
hash, diffs whose messages are not in ascending, disjoint ranges -- raises
:class:`~imq.errors.StateFormatError` naming the block (and the message's key), and the
destination is not touched (a file is not created, a FIFO not opened).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from time import perf_counter
from typing import BinaryIO

from imq.apply import source_outside
from imq.errors import ImqError, StateFormatError
from imq.observability import ImqLogger
from imq.state.boc import BocError, root_data
from imq.state.message import MessageFormatError, parse_internal_header
from imq.state.tl import TlDiff, diff_hash, encode_diff
from imq.state.writer import BadMessageError, ChunkSpool, check_sink, open_sink, write_state
from imq.storage import CursorProtocol as Cursor
from imq.storage import StoreProtocol as Store
from imq.storage import codec, ops
from imq.types import Address, DiffInfo, QueueKey, ShardIdent

__all__ = ["ExportReport", "export_state"]

MAX_TAIL_LEN = 1000
_ZERO_HASH = bytes(32)
_SRC = codec.MESSAGE_SRC_AT  # stored addresses: destination, then source
_ADDRESSES = itemgetter(3)  # a DiffMessages row's stored addresses


@dataclass(frozen=True, slots=True)
class ExportReport:
    """What an export wrote. ``bytes`` counts the state before compression;
    ``bit_exact`` says every exported diff hashes to its stored hash."""

    diffs: int
    messages: int
    chunks: int
    bytes: int
    seconds: float
    bit_exact: bool = True


def export_state(
    store: Store,
    shard: ShardIdent,
    seqno: int,
    tail_len: int,
    dest: str | os.PathLike[str] | BinaryIO,
    *,
    log: ImqLogger,
    progress: Callable[[int, int], object] | None = None,
) -> ExportReport:
    """Write the state of block (``shard``, ``seqno``) to ``dest``. The caller keeps the
    shard's diffs and messages from changing (read lock and the shard's mutex).
    ``progress(messages done, messages in the state)`` is called after each diff."""
    if not 1 <= tail_len <= MAX_TAIL_LEN:
        raise ValueError(f"tail_len must be in 1..={MAX_TAIL_LEN}, got {tail_len}")
    if tail_len > seqno + 1:
        raise ValueError(f"tail_len {tail_len} reaches below seqno 0 from seqno {seqno}")
    check_sink(dest)  # a path that cannot be written fails before the export's work
    started = perf_counter()
    records = _load_infos(store, shard, seqno, tail_len)
    _check_order(shard, seqno, records)
    spool = ChunkSpool()
    try:
        total = sum(sum(parts.values()) for _, parts in records)
        hash_lists = []
        try:
            for i, (info, parts) in enumerate(records, start=1):
                hash_lists.append(_spool_messages(store, shard, info, parts, spool))
                if progress is not None and (spool.messages < total or i == len(records)):
                    progress(spool.messages, total)  # all done is reported once, at the end
            spool.finish()  # the last chunk: its messages are checked before dest is opened
        except BadMessageError as exc:
            raise _bad_message(store, shard, seqno, records, exc) from None
        tls, exact = _encode_chain(shard, seqno, [info for info, _ in records], hash_lists)
        with open_sink(dest) as (_, out):
            write_state(out, shard, seqno, tls, spool)
        written = out.count
    finally:
        spool.close()
    report = ExportReport(
        diffs=len(records),
        messages=spool.messages,
        chunks=spool.chunks,
        bytes=written,
        seconds=perf_counter() - started,
        bit_exact=exact,
    )
    log.info(
        "state_exported",
        block=f"{shard}:{seqno}",
        diffs=report.diffs,
        messages=report.messages,
        chunks=report.chunks,
        bytes=report.bytes,
        bit_exact=report.bit_exact,
        seconds=round(report.seconds, 6),
    )
    return report


# Where an export this queue cannot write can come from instead.
_ELSEWHERE = "this block's state from a node that serves it (its persistent state)"


def _load_infos(
    store: Store, shard: ShardIdent, seqno: int, tail_len: int
) -> list[tuple[DiffInfo, dict[int, int]]]:
    """The stored records of the exported diffs, newest first."""
    records = []
    with ops.view(store, diffs=True) as view:
        for s in range(seqno, seqno - tail_len, -1):
            record = view.diff_record(shard, s)
            if record is None:
                raise ImqError(
                    f"cannot export the state of {shard}:{seqno} with tail_len {tail_len}: "
                    f"the diff of {shard}:{s} is not stored; export a block whose last "
                    f"{tail_len} diffs this queue holds (`imq inspect` lists the stored "
                    "diffs per shard), or a shorter tail_len"
                )
            records.append(record)
    return records


def _check_order(
    shard: ShardIdent, seqno: int, records: list[tuple[DiffInfo, dict[int, int]]]
) -> None:
    """The diffs with messages must lie each wholly below the next newer one, and every
    diff must end at or below the newest one, as the state's reader requires
    (``apply_diff`` checks a diff only against the commit pointer, so a queue can hold
    diffs that break it)."""
    newer: DiffInfo | None = None
    top = records[0][0]
    for info, parts in records:  # newest first
        if any(parts.values()):
            if newer is not None and not info.max_message < newer.min_message:
                raise StateFormatError(
                    f"cannot export the state of {shard}:{seqno}: the messages of the diff "
                    f"of {shard}:{info.seqno} (up to {_keys_text([info.max_message])}) are "
                    f"not below those of the newer diff of {shard}:{newer.seqno} (from "
                    f"{_keys_text([newer.min_message])}); a state's diffs hold ascending, "
                    "disjoint message ranges, and its import would reject this one; export "
                    f"with a tail_len that stops above the diff of {shard}:{info.seqno}, or "
                    f"take {_ELSEWHERE}"
                )
            newer = info
        if info.max_message > top.max_message:  # empty diffs too: the reader's rule
            raise StateFormatError(
                f"cannot export the state of {shard}:{seqno}: the diff of {shard}:"
                f"{info.seqno} ends at {_keys_text([info.max_message])}, above the newest "
                f"diff's {_keys_text([top.max_message])}, which the import of the state "
                "makes the commit pointer, and its import would reject this one; export "
                f"with a tail_len that stops above the diff of {shard}:{info.seqno}, or take "
                f"{_ELSEWHERE}"
            )


def _message_reads(
    shard: ShardIdent, info: DiffInfo, parts: dict[int, int]
) -> list[ops.DiffMessages]:
    return [
        ops.DiffMessages(partition, shard, info.min_message, info.max_message)
        for partition, count in sorted(parts.items())
        if count
    ]


def _spool_messages(
    store: Store, shard: ShardIdent, info: DiffInfo, parts: dict[int, int], spool: ChunkSpool
) -> bytes:
    """Spool one diff's messages in hash order, each to be checked against its key's
    hash; return their hashes, concatenated."""
    expected = sum(parts.values())
    reads = _message_reads(shard, info, parts)
    with ops.view(store, *reads) as view:
        rows = [row for read in reads for row in view[read]]
    if len(rows) != expected:
        raise ImqError(
            f"cannot export the diff of {shard}:{info.seqno}: it wrote {expected} messages, "
            f"{len(rows)} are still stored: GC deletes messages every reader has processed "
            "(or they were deleted outside imq), so this queue can no longer export the "
            f"block; export a newer block whose diffs it holds whole, or take {_ELSEWHERE}"
        )
    rows.sort()
    hashes = [row[0] for row in rows]
    if len(set(hashes)) != len(hashes):
        twin = next(h for h, prev in zip(hashes[1:], hashes, strict=False) if h == prev)
        keys = _keys_of(store, shard, info, parts, twin)
        raise StateFormatError(
            f"cannot export the diff of {shard}:{info.seqno}: its messages {_keys_text(keys)} "
            f"have the same hash; a state lists each message hash of a diff once, so take "
            f"{_ELSEWHERE}"
        )
    _check_sources(shard, rows)
    _check_headers(rows)
    spool.add_checked(rows)
    return b"".join(hashes)


def _check_sources(shard: ShardIdent, rows: list[tuple[bytes, bytes, bytes, bytes]]) -> None:
    """Each message's stored source must lie in ``shard``: the state's import refuses a
    shard's diff with a message from outside it (``apply_diff`` stores one unless
    ``QueueConfig.check_sources`` is on). A :class:`BadMessageError` names the first."""
    if not rows:
        return
    stored = list(map(_ADDRESSES, rows))
    workchains = {addresses[_SRC] - 128 for addresses in stored}
    # A full shard holds every account of its workchain: one account stands for all.
    accounts = [a[_SRC + 1 :] for a in (stored if shard.prefix_len else stored[:1])]
    if source_outside(shard, workchains, accounts) is None:
        return
    for (hash_, *_), addresses in zip(rows, stored, strict=True):
        source = Address(addresses[_SRC] - 128, addresses[_SRC + 1 :])
        if not shard.contains(source):
            raise BadMessageError(hash_, "message source", f"{source}")
    raise AssertionError("unreachable: the range test found a source the scan did not")


def _check_headers(rows: list[tuple[bytes, bytes, bytes, bytes]]) -> None:
    """Each message's body must carry the lt, source and destination its row is stored
    under: the state holds only the body, and its import files the message by the
    body's header. A mismatch is a :class:`BadMessageError`, named as the spool's are
    (a body that is no BOC is left to the spool)."""
    for hash_, body, lt, addresses in rows:
        try:
            header = parse_internal_header(*root_data(body))
        except BocError:
            continue
        except MessageFormatError as exc:
            raise BadMessageError(hash_, "message kind", f"bad {exc.field}: {exc}") from None
        stored = (
            int.from_bytes(lt),
            addresses[_SRC] - 128,
            addresses[_SRC + 1 :],
            addresses[0] - 128,
            addresses[1:_SRC],
        )
        if header != stored:
            raise BadMessageError(
                hash_,
                "message header",
                f"{_header_text(stored)}, but its body says {_header_text(header)}",
            )


def _header_text(header: tuple[int, int, bytes, int, bytes]) -> str:
    lt, src_wc, src, dst_wc, dst = header
    return f"with lt {lt}, source {src_wc}:{src.hex()}, destination {dst_wc}:{dst.hex()}"


class _MessageKeys(ops.Read[list[QueueKey]]):
    """The keys of the messages of one (partition, shard) in a diff's span that have a
    given hash (only for an error message: a rare, second scan)."""

    __slots__ = ("_hash",)

    def __init__(self, rows: ops.DiffMessages, hash_: bytes) -> None:
        super().__init__(rows.scan)
        self._hash = hash_

    def answer(self, cursor: Cursor) -> list[QueueKey]:
        keys = [codec.decode_message(k, v).key for k, v in cursor]
        return [key for key in keys if key.hash == self._hash]


def _keys_of(
    store: Store, shard: ShardIdent, info: DiffInfo, parts: dict[int, int], hash_: bytes
) -> list[QueueKey]:
    """The stored keys of the diff's messages with hash ``hash_``, ascending."""
    reads = [_MessageKeys(rows, hash_) for rows in _message_reads(shard, info, parts)]
    with ops.view(store, *reads) as view:
        return sorted(key for read in reads for key in view[read])


def _keys_text(keys: list[QueueKey]) -> str:
    return ", ".join(f"(lt {key.lt}, hash {key.hash.hex()})" for key in keys)


def _bad_message(
    store: Store,
    shard: ShardIdent,
    seqno: int,
    records: list[tuple[DiffInfo, dict[int, int]]],
    exc: BadMessageError,
) -> StateFormatError:
    """The error for a stored message the state cannot hold, naming its diff and key."""
    where = "a message"
    if exc.hash is not None:
        for info, parts in records:
            keys = _keys_of(store, shard, info, parts, exc.hash)
            if keys:
                where = f"message {_keys_text(keys)} of the diff of {shard}:{info.seqno}"
                break
    if exc.check == "message hash":
        problem = (
            f"{where} is stored with a body whose root cell does not hash to the key's "
            f"hash ({exc.detail}); the state's import would reject it"
        )
    elif exc.check == "message header":
        problem = f"{where} is stored {exc.detail}; the state's import would file it by its body"
    elif exc.check == "message source":
        problem = (
            f"{where} was sent from {exc.detail}, outside the shard (stored as "
            "QueueConfig.check_sources=False allows); the state's import would refuse it"
        )
    elif exc.check == "message kind":
        problem = (
            f"the body of {where} is not an internal message with standard addresses "
            f"({exc.detail}); a state holds only those"
        )
    else:
        problem = (
            f"the stored body of {where} is not a message BOC ({exc.detail}); a state "
            "holds each message as the TON message it is, so this block's state cannot be "
            "written from this queue: take it from a node that serves it (the queues of "
            "`imq demo` and `imq simulate` store bodies that are no messages, and export none)"
        )
    return StateFormatError(f"cannot export the state of {shard}:{seqno}: {problem}")


def _encode_chain(
    shard: ShardIdent, seqno: int, infos: list[DiffInfo], hash_lists: list[bytes]
) -> tuple[list[bytes], bool]:
    """TL of every diff (newest first), chained oldest to newest by hash. Each of
    ``hash_lists`` is emptied once its diff's TL holds the hashes."""
    tls: list[bytes] = [b""] * len(infos)
    exact = True
    prev = infos[-1].prev_hash or _ZERO_HASH
    for i in range(len(infos) - 1, -1, -1):
        try:
            tl = encode_diff(_tl_diff(shard, infos[i], prev, hash_lists[i]))
        except ValueError as exc:
            raise StateFormatError(
                f"cannot export the state of {shard}:{seqno}: the diff of "
                f"{shard}:{infos[i].seqno} does not fit the state format: {exc}; take "
                f"{_ELSEWHERE}"
            ) from None
        tls[i] = tl
        hash_lists[i] = b""  # in the TL now: the hashes are held once
        prev = diff_hash(tl)
        exact = exact and prev == infos[i].hash
    return tls, exact


def _tl_diff(shard: ShardIdent, info: DiffInfo, prev_hash: bytes, hashes: bytes) -> TlDiff:
    return TlDiff(
        prev_hash=prev_hash,
        shard=shard,
        seqno=info.seqno,
        processed_to=tuple(sorted(info.processed_to.items())),
        min_message=info.min_message,
        max_message=info.max_message,
        hashes=hashes,
        router_src=tuple((p, tuple(sorted(a))) for p, a in sorted(info.router_src.items())),
        router_dst=tuple((p, tuple(sorted(a))) for p, a in sorted(info.router_dst.items())),
    )
