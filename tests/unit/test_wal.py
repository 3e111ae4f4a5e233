"""The walk of write-ahead log record headers (`imq.storage.wal`) on logs built here the
way RocksDB's log writer lays them out: 32 KiB blocks, a 7-byte header per fragment,
a record split into FIRST/MIDDLE/LAST fragments at block ends, a block's last 0 to 6
bytes zero padding."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from imq.storage import wal

FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def write_log(records: list[int]) -> tuple[bytes, list[tuple[int, int, int]]]:
    """A log holding records of the given payload lengths, and its headers
    ``(offset, length, type)`` as the writer placed them."""
    out = bytearray()
    headers = []
    for size in records:
        left, first = size, True
        while True:
            room = wal.BLOCK - len(out) % wal.BLOCK
            if room < 7:
                out += bytes(room)
                room = wal.BLOCK
            take = min(left, room - 7)
            last = take == left
            kind = (FULL if last else FIRST) if first else (LAST if last else MIDDLE)
            headers.append((len(out), take, kind))
            out += struct.pack("<IHB", 0xC0FFEE, take, kind) + bytes([7]) * take
            left -= take
            first = False
            if last:
                break
    return bytes(out), headers


SIZES = [30, 100_000, 5, 32_761, 0, 40_000, 7, *[200] * 3_000, 2_000_000, 64]


def test_the_walk_finds_every_header_across_blocks_and_chunks(tmp_path: Path) -> None:
    data, headers = write_log(SIZES)
    assert len(data) > 2 * 32 * wal.BLOCK  # several of the walk's chunks
    (tmp_path / "000009.log").write_bytes(data)
    assert list(wal.record_headers(tmp_path / "000009.log")) == headers
    assert wal.find_log_damage(tmp_path, ["000009.log", "CURRENT"]) is None


# The types RocksDB's recovery spins on (measured), written out, not read from
# wal.RECYCLABLE: a type dropped from the constant must fail here, not drop its case.
@pytest.mark.parametrize("kind", [5, 6, 7, 8, 11])
@pytest.mark.parametrize("pick", [0.0, 0.3, 0.7, 1.0])
def test_a_recycled_logs_type_anywhere_is_found(tmp_path: Path, kind: int, pick: float) -> None:
    data, headers = write_log(SIZES)
    offset = headers[round(pick * (len(headers) - 1))][0]
    damaged = bytearray(data)
    damaged[offset + 6] = kind
    (tmp_path / "000012.log").write_bytes(damaged)
    (tmp_path / "000011.log").write_bytes(data)  # an older, sound log is walked first
    names = ["000012.log", "000011.log", "MANIFEST-000005"]
    assert wal.find_log_damage(tmp_path, names) == wal.LogDamage("000012.log", offset, kind)


def test_a_header_in_a_blocks_last_seven_bytes_is_walked(tmp_path: Path) -> None:
    """With exactly a header's 7 bytes left in a block, RocksDB's writer puts a FIRST
    record of no payload there (it pads only 0 to 6 bytes): the walk reads it, and a
    recycled log's type in it is found."""
    data, headers = write_log([wal.BLOCK - 14, 100])
    assert (wal.BLOCK - 7, 0, 2) in headers
    (tmp_path / "000009.log").write_bytes(data)
    assert list(wal.record_headers(tmp_path / "000009.log")) == headers
    damaged = bytearray(data)
    damaged[wal.BLOCK - 7 + 6] = 5
    (tmp_path / "000009.log").write_bytes(damaged)
    found = wal.find_log_damage(tmp_path, ["000009.log"])
    assert found == wal.LogDamage("000009.log", wal.BLOCK - 7, 5)


def test_a_torn_tail_or_zeros_end_the_walk_without_a_verdict(tmp_path: Path) -> None:
    data, headers = write_log(SIZES)
    log = tmp_path / "000003.log"
    for cut in (len(data) - 3, headers[-1][0] + 3, headers[-1][0]):
        log.write_bytes(data[:cut])
        assert list(wal.record_headers(log)) == [h for h in headers if h[0] + 7 <= cut]
    log.write_bytes(data + bytes(3 * wal.BLOCK))  # preallocated space after the tail
    assert list(wal.record_headers(log)) == headers
    log.write_bytes(b"")
    assert list(wal.record_headers(log)) == []


def test_log_files_are_the_numbered_logs_oldest_first() -> None:
    names = ["000010.log", "LOG", "000009.log", "LOG.old.1", "x.log", "000100.log", "CURRENT"]
    assert wal.log_files(names) == ["000009.log", "000010.log", "000100.log"]
