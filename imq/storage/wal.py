"""Checks of RocksDB's write-ahead log files and MANIFEST (written in the same record
format), made before RocksDB opens the directory.

Damage RocksDB's own open does not report (it hangs, or opens less than was written):

- **A record type imq never writes.** RocksDB's log is a sequence of 32 KiB blocks of
  physical records, each behind a 7-byte header: a masked CRC32C (4 bytes), the payload
  length (2 bytes, little-endian) and a type (1 byte; a block's last 0 to 6 bytes are
  zero padding). imq never recycles log files (RocksDB turns recycling off under the
  recovery mode imq uses), so the *recyclable* types, whose header is 11 bytes (5 to 8,
  and 11), never occur in its logs. One flipped bit turns a full record (type 1) into
  type 5, and RocksDB 9.8's recovery then loops for ever at 100% CPU, deaf to Ctrl-C
  (facebook/rocksdb#13333; measured here for types 5, 6, 7, 8 and 11, while 9, 10, 12 and
  above fail the open as checksum mismatches). The header walk below finds such a record
  first and the open fails instead.
- **A missing log.** A RocksDB database always holds its current log file (RocksDB
  creates it before the tables at the first open and replaces it only by a newer one). A
  directory whose MANIFEST lists imq's tables but that holds no ``.log`` file lost the
  log, and with it every write not yet in a table file: opened, it would look like an
  emptier queue, or a new one.
- **An older log cut short.** A crash cuts only the log being written, the newest one
  holding data; RocksDB's recovery (in the mode imq uses) skips the cut end of any log
  in silence and replays the newer ones, so a log cut short with a newer one after it
  lost the writes in between, committed ones included. Such a log is refused.
- **A log lost between two others.** RocksDB numbers every entry it writes, one log
  after the other, and imq writes every batch to the log: a log whose first write batch
  does not take the sequence numbers up where the log before it left them follows a
  lost log (or an older log cut exactly at a record boundary). Refused.
- **The newest log lost.** Each flush records in the MANIFEST the number of the log its
  table's unflushed writes continue in (RocksDB creates that log before it records the
  number, and deletes a log only once every table's number is past it), so a directory
  must hold a log numbered at least the highest number the MANIFEST records
  (:func:`newest_log_number`). One that holds only older logs lost its newest one, and
  with it every write not yet in a table file, committed diffs included. Refused.
- **A length field that points past the log's end.** RocksDB's recovery (in the mode
  imq uses, which tolerates a write cut short by a crash) takes a record in the log's last
  block whose length runs past the end of the file for such a torn write, and silently
  drops it and every record after it: one enlarged length field lost acknowledged,
  synced commits (measured by an outside audit). A torn write's payload is cut short, so
  no prefix of it matches the record's checksum; a damaged length's record is whole, at
  a shorter length where its checksum matches (the checksum covers the type and the
  payload, not the length). Where the walk ends on a record running past the end, the
  checksum is tried at every shorter length: a match followed by nothing, zeros or a
  well-formed header is damage, and the open fails instead.

The walk also gives where each log's write batches start and end (:class:`LogSpan`) and
the MANIFEST's highest last sequence number (:func:`manifest_facts`), from which the store
refuses logs that do not take up the writes where the MANIFEST leaves them or that lost
synced writes (``Store._check_log_spans`` in :mod:`imq.storage.rocks`).

The walk reads each log once, in 1 MiB chunks into one buffer, and looks at the headers
only: 7 to 12 ms for a 62 MB log of 10,000-message batches, 40 ms for a 68 MB log of
100,000 one-message records (measured beside another job), against 300 to 390 ms for
RocksDB to replay either. An empty log, what a clean close leaves, costs one open.
"""

from __future__ import annotations

import io
import itertools
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

__all__ = [
    "LogDamage",
    "LogSpan",
    "ManifestFacts",
    "crc32c",
    "find_file_damage",
    "find_log_damage",
    "log_files",
    "manifest_facts",
    "newest_log_number",
    "record_headers",
]

BLOCK = 32 * 1024
_CHUNK = 32 * BLOCK  # read at once: whole blocks
_HEADER = struct.Struct("<IHB")  # masked crc32c, payload length, type
_HEADER_LEN = _HEADER.size
_ZERO = 0  # a zero header: preallocated or padded space, not a record
# Record types of recycled logs (an 11-byte header with the log number): imq never
# writes them, and RocksDB's recovery does not return when it meets one.
RECYCLABLE = frozenset((5, 6, 7, 8, 11))


# The record types RocksDB 9's log writer writes (full, first, middle, last; compression
# type and timestamp size records): what a well-formed header after a record may hold.
_WRITTEN = frozenset((1, 2, 3, 4, 9, 10))
_MASK_DELTA = 0xA282EAD8  # RocksDB stores a log record's CRC32C rotated and offset


def _crc_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)  # Castagnoli, reflected
        table.append(crc)
    return tuple(table)


_CRC_TABLE = _crc_table()


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C (Castagnoli) of ``data``, the checksum of RocksDB's log records."""
    crc, table = 0xFFFFFFFF, _CRC_TABLE
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _unmask(masked: int) -> int:
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


class LogSpan(NamedTuple):
    """The sequence numbers a log's write batches hold: ``first``, where its first batch
    starts, and ``last``, where its last whole batch ends (``None`` where the log holds
    no such batch whose head could be read)."""

    name: str
    first: int | None
    last: int | None


class LogDamage(NamedTuple):
    """A damaged record: the log file, the record's offset, its type, and for a record
    whose length field runs past the log's end, the length at which it is whole
    (``whole_length``; ``None`` for a record of a type imq never writes, or for the
    record a log other than the newest is cut short in: ``cut``). ``gap``: the log's
    first write batch does not continue the sequence numbers of the log before it
    (``(expected, found)``; ``offset`` is that batch's)."""

    name: str
    offset: int
    kind: int
    whole_length: int | None = None
    cut: bool = False
    gap: tuple[int, int] | None = None


def log_files(names: Iterable[str]) -> list[str]:
    """The write-ahead log files among a directory's file names, oldest first."""
    logs = [n for n in names if n.endswith(".log") and n[:-4].isascii() and n[:-4].isdigit()]
    return sorted(logs, key=lambda n: int(n[:-4]))


def find_log_damage(
    directory: Path,
    names: Iterable[str],
    zeroed: list[tuple[str, int]] | None = None,
    *,
    skip_vanished: bool = False,
    spans: list[LogSpan] | None = None,
) -> LogDamage | None:
    """The first damaged record of the directory's log files, or ``None``: a record of
    a recyclable type, or a last record whose length runs past its log's end although
    the record is whole at a shorter length (``whole_length``).

    Raises ``FileNotFoundError`` when a log file disappears while it is read (a live
    writer deleted it: only a read-only open beside one sees that), unless
    ``skip_vanished`` (then that file is passed over: an open after the check cannot
    read it either), and ``OSError`` when one cannot be read. Where a header is cut
    short or its length runs past its block, the walk of that file stops there: a torn
    tail (a record cut short, which no shorter length makes whole: nothing to report),
    damage RocksDB itself reports (a length past a whole block), or a whole record's
    damaged length, reported here. A writer's last record, read while it is appended, is
    whole at its own length by the time it is checked, or not yet whole at any: never
    reported. After a crash the check of a cut record costs up to 5 ms (a 32 KiB block's
    checksum, byte by byte in Python).

    A log other than the newest one holding data must end in a whole record: a crash
    cuts only the log being written, and RocksDB writes to one log at a time (a flush
    also syncs the logs before the current one). RocksDB's recovery skips the cut end of
    an older log in silence and replays the newer ones, losing the writes in between,
    committed ones included (measured by an outside audit): such a log is damage
    (``cut``), as is one whose last record is the first or a middle fragment of a
    record split across blocks.

    ``zeroed``, when given, receives ``(file, offset)`` of each zero header with data
    after it in its block (see :func:`record_headers`), in the files walked: not damage
    for certain (a power loss can leave that), but records RocksDB did not replay.

    ``spans``, when given, receives a :class:`LogSpan` for each log holding a write
    batch, oldest first: what the logs hold, and what RocksDB's replay of them can
    recover at most."""
    logs = log_files(names)
    newest = _newest_with_data(directory, logs)
    batches: list[tuple[str, _Batches]] = []
    for name in logs:
        found: list[_Batches] = []
        try:
            damage = find_file_damage(directory, name, zeroed, whole=name != newest, batches=found)
        except FileNotFoundError:
            if skip_vanished and not os.path.lexists(directory / name):
                continue
            raise
        if damage is not None:
            return damage
        batches += ((name, heads) for heads in found)
    if spans is not None:
        spans += (
            LogSpan(
                name,
                None if first is None else first[1],
                None if last is None else last[1] + last[2] - 1,
            )
            for name, (first, last) in batches
        )
    return _sequence_gap(batches)


_Batch = tuple[int, int, int]  # a write batch's record offset, sequence number, entry count
_BATCH_HEAD = struct.Struct("<QI")  # a write batch starts with its sequence and entry count


class _Batches(NamedTuple):
    """A log's first write batch and its last whole one (every record of it in the
    file), each ``None`` where its head cannot be read (its first record not whole in
    the file, or the head not in it)."""

    first: _Batch | None
    last: _Batch | None


def _sequence_gap(logs: list[tuple[str, _Batches]]) -> LogDamage | None:
    """Damage where a log's first write batch does not take the sequence numbers up where
    the batches of the log before it left them. RocksDB numbers every entry it writes,
    one log after another, and writes every batch to the log (imq never turns the log
    off): a log between them was lost (deleted), or the older one lost whole records at
    its end (cut at a record boundary), and RocksDB's recovery would replay the rest in
    silence. Logs whose batches could not be read are left out of the comparison."""
    for (_, older), (name, newer) in itertools.pairwise(logs):
        if older.last is None or newer.first is None:
            continue
        _, seq, count = older.last
        offset, first, _ = newer.first
        if first != seq + count:
            return LogDamage(name, offset, 0, gap=(seq + count, first))
    return None


def _newest_with_data(directory: Path, logs: list[str]) -> str | None:
    """The newest of ``logs`` (oldest first) that is not empty: the one a crash may have
    cut. A log that cannot be looked at counts as holding data (its walk reports it)."""
    for name in reversed(logs):
        try:
            if os.stat(directory / name).st_size:
                return name
        except OSError:
            return name
    return None


_FULL, _LAST = 1, 4  # a record whole in one fragment; the last fragment of a split one
_FIRST, _MIDDLE = 2, 3  # fragments of a record split across blocks, not its last


def find_file_damage(
    directory: Path,
    name: str,
    zeroed: list[tuple[str, int]] | None = None,
    *,
    whole: bool = False,
    batches: list[_Batches] | None = None,
) -> LogDamage | None:
    """:func:`find_log_damage` of one file in RocksDB's log format: a write-ahead log,
    or a MANIFEST (RocksDB writes its edits as such records and reads them back with
    the same tolerance of a cut tail). ``whole``: the file must end in a whole record
    (a log older than the newest one holding data). ``batches``, when given, receives
    the file's first and last write batches (:class:`_Batches`) if it holds any."""
    last = None
    first: tuple[int, int] | None = None  # the record the first batch starts in
    split: tuple[int, int] | None = None  # the record a batch split into fragments starts in
    # The last two batches a record ends: (the record the batch starts in, where it ends).
    ended: list[tuple[tuple[int, int], int]] = []
    offsets: list[int] | None = None if zeroed is None else []
    path = directory / name
    for offset, length, kind in record_headers(path, offsets):
        if kind in RECYCLABLE:
            return LogDamage(name, offset, kind)
        last = offset, length, kind
        if kind in _BATCH_STARTS and first is None:
            first = offset, length
        if kind == _FULL:
            ended[:] = [*ended[-1:], ((offset, length), offset + _HEADER_LEN + length)]
        elif kind == _FIRST:
            split = offset, length
        elif kind == _LAST and split is not None:
            ended[:] = [*ended[-1:], (split, offset + _HEADER_LEN + length)]
            split = None
    if zeroed is not None and offsets:
        zeroed += ((name, offset) for offset in offsets)
    size = os.stat(path).st_size  # after the walk: a live writer's log may have grown
    if last is not None:
        whole_length = _whole_length(path, size, *last)
        if whole_length is not None:
            return LogDamage(name, last[0], last[2], whole_length)
    if whole:
        cut = _cut_at(path, size, last)
        if cut is not None:
            return LogDamage(name, cut, 0 if last is None or cut != last[0] else last[2], cut=True)
    if batches is not None and first is not None:
        # Added even when neither head can be read, so that the logs around this one are
        # not compared with each other as if it held no batch. The last batch is the last
        # whole one: only the file's last record can run past its end (a torn tail).
        complete = [start for start, end in ended if end <= size]
        batches.append(_read_batches(path, size, first, complete[-1] if complete else None))
    return None


_BATCH_STARTS = frozenset((_FULL, _FIRST))  # a batch starts in a full record or a first fragment


def _read_batches(
    path: Path, size: int, first: tuple[int, int], last: tuple[int, int] | None
) -> _Batches:
    """The heads of the batches that start in the records ``first`` and ``last``
    (``(offset, payload length)``; ``last`` None: no whole batch) of the log ``path`` of
    ``size`` bytes."""
    with open(path, "rb", buffering=0) as file:
        head = _batch_head(file, size, first)
        return _Batches(head, None if last is None else _batch_head(file, size, last))


def _batch_head(file: BinaryIO, size: int, start: tuple[int, int]) -> _Batch | None:
    """The batch starting in the record at ``start`` (``(offset, payload length)``): its
    offset, sequence number and count, when the record is in the file and the 12 bytes
    of the batch's head are too; else ``None``. A batch that starts in a block's last 18
    bytes has its head split: the rest is at the start of the next fragment, after the
    next block's first header (an outside audit: about 1 batch in 2,700, and a healthy
    queue killed just after one was refused as if its log had lost it)."""
    offset, length = start
    if offset + _HEADER_LEN + length > size:
        return None
    file.seek(offset + _HEADER_LEN)
    head = file.read(min(length, _BATCH_HEAD.size))
    if len(head) < _BATCH_HEAD.size:  # the rest in the next fragment, if it is one
        after = offset - offset % BLOCK + BLOCK
        if offset + _HEADER_LEN + length != after:  # not a fragment that fills its block
            return None
        file.seek(after)
        header = file.read(_HEADER_LEN)
        if len(header) < _HEADER_LEN:
            return None
        _, more, kind = _HEADER.unpack(header)
        if kind not in (_MIDDLE, _LAST):
            return None
        head += file.read(min(more, _BATCH_HEAD.size - len(head)))
        if len(head) < _BATCH_HEAD.size:
            return None
    seq, count = _BATCH_HEAD.unpack(head)
    return offset, seq, count


def _cut_at(path: Path, size: int, last: tuple[int, int, int] | None) -> int | None:
    """Where the log ``path`` of ``size`` bytes is cut short, given its last record
    header ``last`` (from :func:`record_headers`), or ``None`` when it ends in a whole
    record: the offset of a last record that runs past the end or is only a record's
    first or middle fragment, or of a header cut short by the end (fewer than 7 bytes,
    not all zero)."""
    if last is None:
        end = 0
    else:
        offset, length, kind = last
        end = offset + _HEADER_LEN + length
        if end > size or kind in (_FIRST, _MIDDLE):
            return offset
    left = BLOCK - end % BLOCK
    rest = size - end
    if 0 < rest < _HEADER_LEN <= left:  # a header cut short by the end of the file
        with open(path, "rb", buffering=0) as file:
            file.seek(end)
            if any(file.read(rest)):
                return end
    return None


def _whole_length(path: Path, size: int, offset: int, length: int, kind: int) -> int | None:
    """For the last record header of a log of ``size`` bytes: ``None`` unless the record
    runs past the file's end inside its block (what RocksDB's recovery takes for a torn
    write) and yet is whole at a shorter payload length ``n`` (its checksum matches
    there, and what follows it up to the end is nothing, zeros or a well-formed header):
    then ``n``."""
    if offset + _HEADER_LEN + length <= size:
        return None  # it ends inside the file (a sound log: nothing more to read)
    room = BLOCK - offset % BLOCK  # the header and payload must fit in the block
    with open(path, "rb", buffering=0) as file:
        file.seek(offset)
        record = file.read(room)
    if len(record) == room or _HEADER_LEN + length <= len(record):
        return None  # it ends inside the file, or the block is whole: RocksDB reports it
    masked, _, _ = _HEADER.unpack_from(record, 0)
    want = _unmask(masked) ^ 0xFFFFFFFF  # compared with the running state, not finalized
    crc, table = _CRC_TABLE[(0xFFFFFFFF ^ kind) & 0xFF] ^ (0xFFFFFFFF >> 8), _CRC_TABLE
    end = len(record)
    for at in range(_HEADER_LEN, end + 1):
        if crc == want and _ends_well(record, at, room):
            return at - _HEADER_LEN
        if at < end:
            crc = table[(crc ^ record[at]) & 0xFF] ^ (crc >> 8)
    return None


def _ends_well(record: bytes, at: int, room: int) -> bool:
    """Whether the bytes of ``record`` (a block's last ``room`` bytes, cut short by the
    file's end) from ``at`` on are what a log can hold after a record: nothing, zeros
    (padding, preallocated space), a header cut short by the end (fewer than 7 bytes: a
    crash in the middle of the next header) or the start of a header of a type RocksDB
    writes, whose payload fits in the block (it may itself be cut short by the end)."""
    rest = len(record) - at
    if rest < _HEADER_LEN or not any(record[at:]):
        return True  # nothing, zeros, or a next header cut short by the end (a torn write)
    _, length, kind = _HEADER.unpack_from(record, at)
    return kind in _WRITTEN and at + _HEADER_LEN + length <= room


def record_headers(path: Path, zeroed: list[int] | None = None) -> Iterator[tuple[int, int, int]]:
    """``(offset, payload length, type)`` of each record header of the log file ``path``,
    in order, up to its end or to a header that cannot be one (cut short, or running
    past its block).

    A zero header (length and type 0) is read as padding or preallocated space, as
    RocksDB reads it: the rest of its block is skipped. Where that rest holds data (what
    RocksDB's writer never leaves: a zeroed header of a record, or zeros a power loss
    left in the unsynced end of a log on some file systems), its offset is added to
    ``zeroed`` when given.

    The file is read in chunks of whole blocks (a record never crosses a block), not
    mapped: a mapped file that shrinks under the reader kills the process (SIGBUS)."""
    with open(path, "rb", buffering=0) as file:
        yield from _walk_headers(file, os.fstat(file.fileno()).st_size, zeroed)


def _walk_headers(
    file: io.RawIOBase | io.BufferedIOBase, length_hint: int, zeroed: list[int] | None = None
) -> Iterator[tuple[int, int, int]]:
    """:func:`record_headers` of what ``file`` holds from its position on (about
    ``length_hint`` bytes: the buffer's size)."""
    unpack = _HEADER.unpack_from
    # One buffer, refilled: no fresh memory per chunk; no larger than the file's whole
    # blocks (a fresh MANIFEST or log is a few KiB).
    blocks = -(-length_hint // BLOCK)
    chunk = bytearray(BLOCK * min(max(blocks, 1), _CHUNK // BLOCK))
    base = 0
    while size := file.readinto(chunk):
        pos = 0
        while pos + _HEADER_LEN <= size:
            left = BLOCK - pos % BLOCK
            if left < _HEADER_LEN:  # a block's trailer: zero padding
                pos += left
                continue
            _, length, kind = unpack(chunk, pos)
            if kind == _ZERO and length == 0:  # padding or preallocated space
                end = min(pos + left, size)
                if zeroed is not None and chunk.count(0, pos, end) < end - pos:
                    zeroed.append(base + pos)  # data after it: RocksDB skips it too
                pos += left
                continue
            yield base + pos, length, kind
            if kind in RECYCLABLE or length > left - _HEADER_LEN:
                return  # a recycled log's header is longer: nothing to walk on
            pos += _HEADER_LEN + length
        if size < len(chunk):
            return  # the end of the file (a header cut short there is a torn tail)
        base += size


# A version edit's leading fields, in the order RocksDB's VersionEdit::EncodeTo writes
# them: the database id and the comparator's name (each a length-prefixed string), then
# the log number, the previous log number, the next file number, the highest column
# family, the lowest log number to keep (each a varint) and the last sequence number;
# every field whose length would need more decoding to step over comes after them.
_DB_ID, _COMPARATOR, _LOG_NUMBER, _LAST_SEQUENCE = 8193, 1, 2, 4
_STRINGS = frozenset((_DB_ID, _COMPARATOR))
# tag -> its place (previous log number 9, next file number 3, highest column family 203,
# lowest log number to keep 10); a field out of this order ends the decoding of an edit
_LEADING = {tag: at for at, tag in enumerate((_DB_ID, _COMPARATOR, _LOG_NUMBER, 9, 3, 203, 10))}


class ManifestFacts(NamedTuple):
    """What a MANIFEST's version edits record, read from their leading fields only:
    the highest write-ahead log number (each flush records the log its table's unflushed
    writes continue in) and the highest last sequence number (RocksDB records the
    database's with each edit it writes), each ``None`` where no edit records one or the
    file cannot be read as expected (nothing is then concluded from it)."""

    newest_log: int | None
    last_sequence: int | None


def manifest_facts(path: Path) -> ManifestFacts:
    """:class:`ManifestFacts` of the MANIFEST ``path``: one read of the file, and only the
    start of each version edit decoded (measured: 1,516 edits of a 190 KB MANIFEST in
    under 2 ms)."""
    logs: list[int] = []
    sequences: list[int] = []
    try:
        for edit in _records(path):
            log, sequence = _leading_fields(edit)
            if log is not None:
                logs.append(log)
            if sequence is not None:
                sequences.append(sequence)
    except (OSError, IndexError, ValueError):  # unreadable, or not an edit as expected
        return ManifestFacts(None, None)
    return ManifestFacts(max(logs, default=None), max(sequences, default=None))


def newest_log_number(path: Path) -> int | None:
    """The highest write-ahead log number the MANIFEST ``path`` records, or ``None``
    (:func:`manifest_facts`)."""
    return manifest_facts(path).newest_log


def _records(path: Path) -> Iterator[bytes]:
    """The logical records of a file in RocksDB's log format, fragments joined, found by
    :func:`record_headers` in one read of the file; they end at a header that cannot be
    one (what RocksDB's reader reports, or a torn tail)."""
    with open(path, "rb") as file:
        data = file.read()
    parts: list[bytes] | None = None
    # The headers of the bytes read (one read of the file, however it changes meanwhile).
    for offset, length, kind in _walk_headers(io.BytesIO(data), len(data)):
        start = offset + _HEADER_LEN
        if offset % BLOCK + _HEADER_LEN + length > BLOCK or start + length > len(data):
            return  # past its block, or past what was read (a file still growing)
        payload = data[start : start + length]
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            parts = [payload]
        elif kind == _MIDDLE and parts is not None:
            parts.append(payload)
        elif kind == _LAST and parts is not None:
            parts.append(payload)
            yield b"".join(parts)
            parts = None
        else:
            return


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """A varint at ``at``: its value and the offset after it; ``IndexError`` if cut."""
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def _leading_fields(edit: bytes) -> tuple[int | None, int | None]:
    """The log number and the last sequence number of a version edit (``None``: it
    records none among its leading fields); ``IndexError`` or ``ValueError`` where its
    start cannot be decoded."""
    at = 0
    log = None
    place = -1
    while at < len(edit):
        tag, at = _varint(edit, at)
        if tag == _LAST_SEQUENCE:
            return log, _varint(edit, at)[0]
        if _LEADING.get(tag, -1) <= place:  # a later field, or out of order: no more
            break
        place = _LEADING[tag]
        if tag in _STRINGS:
            length, at = _varint(edit, at)
            at += length
            if at > len(edit):
                raise ValueError("a string runs past the edit's end")
        else:
            value, at = _varint(edit, at)
            if tag == _LOG_NUMBER:
                log = value
    return log, None
