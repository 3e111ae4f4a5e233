"""Checks of RocksDB's write-ahead log files, made before RocksDB opens the directory.

Two kinds of damage RocksDB's own open does not report:

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

The walk reads each log once, in 1 MiB chunks into one buffer, and looks at the headers
only: 7 to 12 ms for a 62 MB log of 10,000-message batches, 40 ms for a 68 MB log of
100,000 one-message records (measured beside another job), against 300 to 390 ms for
RocksDB to replay either. An empty log, what a clean close leaves, costs one open.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

__all__ = ["LogDamage", "find_log_damage", "log_files", "record_headers"]

BLOCK = 32 * 1024
_CHUNK = 32 * BLOCK  # read at once: whole blocks
_HEADER = struct.Struct("<IHB")  # masked crc32c, payload length, type
_HEADER_LEN = _HEADER.size
_ZERO = 0  # a zero header: preallocated or padded space, not a record
# Record types of recycled logs (an 11-byte header with the log number): imq never
# writes them, and RocksDB's recovery does not return when it meets one.
RECYCLABLE = frozenset((5, 6, 7, 8, 11))


class LogDamage(NamedTuple):
    """A record of a type imq never writes: the log file, the record's offset, its type."""

    name: str
    offset: int
    kind: int


def log_files(names: Iterable[str]) -> list[str]:
    """The write-ahead log files among a directory's file names, oldest first."""
    logs = [n for n in names if n.endswith(".log") and n[:-4].isdigit()]
    return sorted(logs, key=lambda n: int(n[:-4]))


def find_log_damage(directory: Path, names: Iterable[str]) -> LogDamage | None:
    """The first record of a recyclable type in the directory's log files, or ``None``.

    Raises ``FileNotFoundError`` when a log file disappears while it is read (a live
    writer deleted it: only a read-only open beside one sees that) and ``OSError`` when
    one cannot be read. Where a header is cut short or its length runs past its block
    (a torn tail, or damage RocksDB itself reports), the walk of that file stops there:
    it has nothing more to say about it."""
    for name in log_files(names):
        for offset, _, kind in record_headers(directory / name):
            if kind in RECYCLABLE:
                return LogDamage(name, offset, kind)
    return None


def record_headers(path: Path) -> Iterator[tuple[int, int, int]]:
    """``(offset, payload length, type)`` of each record header of the log file ``path``,
    in order, up to its end or to a header that cannot be one (cut short, or running
    past its block).

    The file is read in chunks of whole blocks (a record never crosses a block), not
    mapped: a mapped file that shrinks under the reader kills the process (SIGBUS)."""
    unpack = _HEADER.unpack_from
    chunk = bytearray(_CHUNK)  # one buffer, refilled: no fresh memory per chunk
    with open(path, "rb", buffering=0) as file:
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
                    pos += left
                    continue
                yield base + pos, length, kind
                if kind in RECYCLABLE or length > left - _HEADER_LEN:
                    return  # a recycled log's header is longer: nothing to walk on
                pos += _HEADER_LEN + length
            if size < _CHUNK:
                return  # the end of the file (a header cut short there is a torn tail)
            base += size
