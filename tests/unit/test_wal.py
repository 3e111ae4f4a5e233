"""The walk of write-ahead log record headers (`imq.storage.wal`) on logs built here the
way RocksDB's log writer lays them out: 32 KiB blocks, a 7-byte header per fragment,
a record split into FIRST/MIDDLE/LAST fragments at block ends, a block's last 0 to 6
bytes zero padding."""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from imq.storage import wal

FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def masked_crc(kind: int, payload: bytes) -> int:
    """The checksum field RocksDB writes: CRC32C of the type byte and the payload,
    rotated right by 15 bits and offset."""
    crc = wal.crc32c(bytes([kind]) + payload)
    return ((crc >> 15 | crc << 17) + 0xA282EAD8) & 0xFFFFFFFF


def lay_out(
    sizes: Iterable[int], fill: Callable[[int, int, int, int], bytes]
) -> tuple[bytes, list[tuple[int, int, int]]]:
    """Records of the given payload lengths laid out as RocksDB's log writer does, with
    their true checksums, and their headers ``(offset, length, type)``. ``fill(offset,
    record, at, length)`` gives the bytes of the fragment at ``offset`` in the file:
    ``length`` bytes from ``at`` in record number ``record``."""
    out = bytearray()
    headers = []
    for record, size in enumerate(sizes):
        left, first, at = size, True, 0
        while True:
            room = wal.BLOCK - len(out) % wal.BLOCK
            if room < 7:
                out += bytes(room)
                room = wal.BLOCK
            take = min(left, room - 7)
            last = take == left
            kind = (FULL if last else FIRST) if first else (LAST if last else MIDDLE)
            headers.append((len(out), take, kind))
            payload = fill(len(out), record, at, take)
            out += struct.pack("<IHB", masked_crc(kind, payload), take, kind) + payload
            left, at, first = left - take, at + take, False
            if last:
                break
    return bytes(out), headers


@functools.cache
def write_log(records: tuple[int, ...]) -> tuple[bytes, list[tuple[int, int, int]]]:
    """A log holding records of the given payload lengths (each payload's bytes count
    up from its offset), with their true checksums, and its headers ``(offset, length,
    type)`` as the writer placed them."""
    return lay_out(
        records, lambda offset, _r, _at, take: bytes((offset + i) % 251 for i in range(take))
    )


SIZES = (30, 100_000, 5, 32_761, 0, 40_000, 7, *[200] * 3_000, 2_000_000, 64)


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
    data, headers = write_log((wal.BLOCK - 14, 100))
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
    # str.isdigit() takes these for digits; int() fails on the first, RocksDB takes neither
    assert wal.log_files(["\u00b2.log", "\u0663.log", "000010.log"]) == ["000010.log"]


def test_crc32c_is_castagnolis() -> None:
    assert wal.crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert wal.crc32c(b"") == 0


def _with_length(data: bytes, offset: int, length: int) -> bytes:
    damaged = bytearray(data)
    damaged[offset + 4 : offset + 6] = length.to_bytes(2, "little")
    return bytes(damaged)


# A log whose last block is partial and holds several records: the ones RocksDB's
# recovery drops in silence when a length field there runs past the end.
TAIL = (100_000, 300, 5_000, 64, 2_000)


@pytest.mark.parametrize("back", [1, 2, 3, 4])
@pytest.mark.parametrize("extra", [1, 700, 0x4000])
def test_a_length_run_past_the_end_of_a_whole_record_is_damage(
    tmp_path: Path, back: int, extra: int
) -> None:
    """The last block's record ``back`` from the end, its length field enlarged so that
    it runs past the file's end (by ``extra`` bytes, or to the block's size): found, with
    the length at which it is whole, whatever follows it."""
    data, headers = write_log(TAIL)
    offset, length, kind = headers[-back]
    assert offset // wal.BLOCK == (len(data) - 1) // wal.BLOCK  # in the last block
    room = wal.BLOCK - offset % wal.BLOCK - 7
    bad = min(len(data) - offset - 7 + extra, room, 0xFFFF)
    log = tmp_path / "000007.log"
    log.write_bytes(_with_length(data, offset, bad))
    assert wal.find_log_damage(tmp_path, [log.name]) == wal.LogDamage(
        log.name, offset, kind, length
    )
    # The same with the writer's next record cut short after it (a crash meanwhile).
    log.write_bytes(_with_length(data, offset, bad)[: len(data) - 3])
    if back > 1:
        found = wal.find_log_damage(tmp_path, [log.name])
        assert found == wal.LogDamage(log.name, offset, kind, length)


@pytest.mark.parametrize("written", [1, 3, 6])
def test_a_damaged_length_before_a_header_cut_short_is_damage(tmp_path: Path, written: int) -> None:
    """A crash cut the log inside its last header (``written`` of its 7 bytes); the
    record before it, whole, then has its length enlarged past the end: RocksDB drops it
    in silence all the same (measured: 50 of 750 messages gone)."""
    data, headers = write_log(TAIL)
    offset, length, kind = headers[-2]
    cut = headers[-1][0] + written
    log = tmp_path / "000007.log"
    log.write_bytes(_with_length(data[:cut], offset, cut - offset))
    assert wal.find_log_damage(tmp_path, [log.name]) == wal.LogDamage(
        log.name, offset, kind, length
    )


@pytest.mark.parametrize("cut", [1, 7, 8, 50, 1_999, 2_006])
def test_a_torn_write_is_no_damage(tmp_path: Path, cut: int) -> None:
    """A write cut short by a crash: the last record's payload ends early, its length
    field intact. No shorter length matches its checksum: not damage (RocksDB drops it,
    rightly: only writes after the last fsync can be there)."""
    data, _ = write_log(TAIL)
    log = tmp_path / "000007.log"
    log.write_bytes(data[: len(data) - cut])
    assert wal.find_log_damage(tmp_path, [log.name]) is None
    log.write_bytes(data[: len(data) - cut] + bytes(100))  # zeros after it: the same
    assert wal.find_log_damage(tmp_path, [log.name]) is None


def test_whole_logs_and_full_blocks_are_no_damage(tmp_path: Path) -> None:
    """A record that ends where its length says (a writer's log read while it appends:
    the walk's last record may be whole by the time it is checked), and a length run
    past a full block (RocksDB reports that one itself)."""
    data, _ = write_log(TAIL)
    log = tmp_path / "000007.log"
    log.write_bytes(data)
    assert wal.find_log_damage(tmp_path, [log.name]) is None
    full, _ = write_log((wal.BLOCK - 7,))
    assert len(full) == wal.BLOCK
    log.write_bytes(_with_length(full, 0, wal.BLOCK))
    assert wal.find_log_damage(tmp_path, [log.name]) is None


@pytest.mark.parametrize(
    ("cut", "at"),
    [
        ("at a block's end, after a first fragment", wal.BLOCK),
        ("inside a payload", 100),
        ("inside a header", "header"),
    ],
)
def test_an_older_log_must_end_in_a_whole_record(
    tmp_path: Path, cut: str, at: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the newest log holding data may be cut (a crash); an older one cut short, even
    at a block boundary after the first fragment of a record, is damage."""
    # These logs' payloads are no write batches: their sequence numbers are not checked.
    monkeypatch.setattr(wal, "_sequence_gap", lambda logs: None)
    data, headers = write_log((30, 100_000, 64))
    if at == "header":
        end = headers[-1][0] + 3  # 3 bytes of the last record's header
    else:
        end = at if isinstance(at, int) and at != 100 else headers[1][0] + 100
    (tmp_path / "000007.log").write_bytes(data[:end])
    (tmp_path / "000009.log").write_bytes(data)  # the newest
    names = ["000007.log", "000009.log"]
    found = wal.find_log_damage(tmp_path, names)
    assert found is not None and found.cut and found.name == "000007.log", (cut, found)
    assert found.offset == (headers[-1][0] if at == "header" else headers[1][0])
    # The newest log cut the same way is a crash's doing: no damage.
    (tmp_path / "000009.log").write_bytes(data[:end])
    (tmp_path / "000007.log").write_bytes(data)
    assert wal.find_log_damage(tmp_path, names) is None
    # An empty newer log does not make the cut one older.
    (tmp_path / "000007.log").write_bytes(data[:end])
    (tmp_path / "000009.log").write_bytes(b"")
    assert wal.find_log_damage(tmp_path, names) is None


def _batches_log(*heads: tuple[int, int]) -> bytes:
    """A log of small write batches (full records) with these (sequence, count) heads."""
    out = b""
    for seq, count in heads:
        payload = struct.pack("<QI", seq, count) + bytes(20)
        out += struct.pack("<IHB", masked_crc(FULL, payload), len(payload), FULL) + payload
    return out


@pytest.mark.parametrize(
    ("older", "newer", "gap"),
    [
        (((1, 5), (6, 3)), ((9, 2),), None),  # 6 + 3 = 9: continued
        (((1, 5), (6, 3)), ((20, 2),), (9, 20)),  # a log lost between them
        (((1, 5),), ((9, 2),), (6, 9)),  # the older one lost its last batch, whole
        (((1, 5), (6, 3)), ((7, 1),), (9, 7)),  # numbers taken twice: not one history
    ],
)
def test_logs_must_continue_each_others_sequence_numbers(
    tmp_path: Path,
    older: tuple[tuple[int, int], ...],
    newer: tuple[tuple[int, int], ...],
    gap: tuple[int, int] | None,
) -> None:
    (tmp_path / "000004.log").write_bytes(_batches_log(*older))
    (tmp_path / "000006.log").write_bytes(b"")  # an empty log between them is no gap
    (tmp_path / "000007.log").write_bytes(_batches_log(*newer))
    found = wal.find_log_damage(tmp_path, ["000004.log", "000006.log", "000007.log"])
    if gap is None:
        assert found is None
    else:
        assert found == wal.LogDamage("000007.log", 0, 0, gap=gap)


def _split_batches_log(*heads: tuple[int, int], size: int = 50_000) -> bytes:
    """A log of write batches of ``size`` bytes each (split across blocks) with these
    (sequence, count) heads."""
    data = [struct.pack("<QI", seq, count) + bytes(size - 12) for seq, count in heads]
    return lay_out([size] * len(heads), lambda _o, r, at, take: data[r][at : at + take])[0]


@pytest.mark.parametrize("in_first", [0, 1, 11, 12])
def test_a_batch_head_split_across_two_fragments_is_read(tmp_path: Path, in_first: int) -> None:
    """A batch that starts in a block's last 7 to 18 bytes has its 12-byte head split
    between its first fragment (0 to 11 bytes) and the next block's. Its sequence
    numbers still count: before, the log's end was taken as unknown, and a healthy queue
    killed just after such a commit was refused as if its log had lost it (an outside
    audit: 1 batch in about 2,700)."""
    heads = [(1, 5), (6, 3)]
    first_size = wal.BLOCK - 2 * 7 - in_first  # leaves room for a header and `in_first`
    data = [struct.pack("<QI", seq, count) for seq, count in heads]
    data[0] += bytes(first_size - 12)
    data[1] += bytes(28)
    log, headers = lay_out([len(d) for d in data], lambda _o, r, at, take: data[r][at : at + take])
    assert headers[1][1:] == (in_first, FIRST)  # the second batch starts split
    (tmp_path / "000007.log").write_bytes(log)
    spans: list[wal.LogSpan] = []
    assert wal.find_log_damage(tmp_path, ["000007.log"], spans=spans) is None
    assert spans == [wal.LogSpan("000007.log", 1, 8)]
    # cut inside the rest of its head: no whole batch there, the first one counts
    (tmp_path / "000007.log").write_bytes(log[: wal.BLOCK + 7 + (12 - in_first) - 1])
    spans.clear()
    assert wal.find_log_damage(tmp_path, ["000007.log"], spans=spans) is None
    assert spans == [wal.LogSpan("000007.log", 1, 5)]


def test_log_spans_give_the_first_batch_and_the_last_whole_one(tmp_path: Path) -> None:
    """``spans``: each log's first sequence number and the last one of its last whole
    batch, the newest log's too; a batch a crash cut short (which RocksDB's replay
    drops), in one record or split across blocks, counts for nothing."""
    names = ["000004.log", "000006.log", "000007.log"]
    (tmp_path / names[0]).write_bytes(_batches_log((1, 5), (6, 3)))
    (tmp_path / names[1]).write_bytes(b"")  # an empty log: no span
    newest = _batches_log((9, 2), (11, 40))
    cases = [
        (newest, wal.LogSpan(names[2], 9, 50)),
        (newest[:-5], wal.LogSpan(names[2], 9, 10)),  # its last batch cut short
        (newest[:20], wal.LogSpan(names[2], None, None)),  # not even its first batch
        (_split_batches_log((9, 2), (11, 40)), wal.LogSpan(names[2], 9, 50)),
        # the second batch's first fragments whole, its last one cut off
        (_split_batches_log((9, 2), (11, 40))[:-20_000], wal.LogSpan(names[2], 9, 10)),
    ]
    for data, span in cases:
        (tmp_path / names[2]).write_bytes(data)
        spans: list[wal.LogSpan] = []
        assert wal.find_log_damage(tmp_path, names, spans=spans) is None
        assert spans == [wal.LogSpan(names[0], 1, 8), span], span
    (tmp_path / names[2]).write_bytes(b"")
    spans = []
    assert wal.find_log_damage(tmp_path, names, spans=spans) is None
    assert spans == [wal.LogSpan(names[0], 1, 8)]


def test_a_log_whose_batch_heads_cannot_be_read_stops_the_comparison(tmp_path: Path) -> None:
    """A log between two others whose batches' heads are not in their first fragments
    (fewer than 12 bytes there): its neighbours are not compared with each other."""
    short = b"\x01" * 8
    middle = struct.pack("<IHB", masked_crc(FULL, short), len(short), FULL) + short
    (tmp_path / "000004.log").write_bytes(_batches_log((1, 5)))
    (tmp_path / "000005.log").write_bytes(middle)
    (tmp_path / "000007.log").write_bytes(_batches_log((90, 2)))
    assert wal.find_log_damage(tmp_path, ["000004.log", "000005.log", "000007.log"]) is None


def test_whole_older_logs_are_no_damage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wal, "_sequence_gap", lambda logs: None)  # no write batches here
    data, _ = write_log(SIZES)
    for name in ("000003.log", "000005.log"):
        (tmp_path / name).write_bytes(data)
    assert wal.find_log_damage(tmp_path, ["000003.log", "000005.log"]) is None


def test_a_log_deleted_before_it_is_read_is_passed_over_only_when_asked(tmp_path: Path) -> None:
    """A read-only open's check beside a live writer passes over a log the writer deleted
    after the listing (the open cannot read it either); a dangling link is no deleted
    log, and the writer's own open never passes one over."""
    data, headers = write_log(TAIL)
    (tmp_path / "000009.log").write_bytes(data)
    names = ["000008.log", "000009.log"]  # 000008.log was listed, then deleted
    with pytest.raises(FileNotFoundError):
        wal.find_log_damage(tmp_path, names)
    assert wal.find_log_damage(tmp_path, names, skip_vanished=True) is None
    offset, length, kind = headers[-1]  # the next log is still checked
    (tmp_path / "000009.log").write_bytes(_with_length(data, offset, length + 1))
    found = wal.find_log_damage(tmp_path, names, skip_vanished=True)
    assert found == wal.LogDamage("000009.log", offset, kind, length)
    (tmp_path / "000008.log").symlink_to(tmp_path / "nowhere.log")
    with pytest.raises(FileNotFoundError):
        wal.find_log_damage(tmp_path, names, skip_vanished=True)


def test_a_zero_header_with_data_after_it_in_its_block_is_reported(tmp_path: Path) -> None:
    """RocksDB reads a zero header (length and type 0) as padding and skips the rest of
    its block in silence; its writer never leaves one with data after it. The walk skips
    it too, and reports where it is (not as damage: a power loss can leave zeros in a
    log's unsynced end on some file systems)."""
    data, headers = write_log(TAIL)
    offset = headers[-2][0]
    zeroed_data = bytearray(data)
    zeroed_data[offset + 4 : offset + 7] = bytes(3)
    log = tmp_path / "000007.log"
    log.write_bytes(zeroed_data)
    found: list[tuple[str, int]] = []
    assert wal.find_log_damage(tmp_path, [log.name], found) is None
    assert found == [(log.name, offset)]
    offsets: list[int] = []
    assert list(wal.record_headers(log, offsets)) == headers[:-2]  # the block's rest skipped
    assert offsets == [offset]
    # Zeros to the end (preallocated space, a block's padding) are no such header.
    log.write_bytes(data + bytes(3 * wal.BLOCK))
    found.clear()
    assert wal.find_log_damage(tmp_path, [log.name], found) is None
    assert found == []


def test_an_older_log_cut_inside_a_header_in_a_blocks_last_seven_bytes_is_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With exactly 7 bytes left in a block the writer puts a header there (a FIRST
    record of no payload), so an older log ending in 1 to 6 bytes of it is cut short,
    as it is anywhere else in a block."""
    monkeypatch.setattr(wal, "_sequence_gap", lambda logs: None)
    data, headers = write_log((wal.BLOCK - 14, 100))
    assert (wal.BLOCK - 7, 0, FIRST) in headers
    cut = wal.BLOCK - 7 + 3
    assert any(data[wal.BLOCK - 7 : cut])
    (tmp_path / "000007.log").write_bytes(data[:cut])
    (tmp_path / "000009.log").write_bytes(data)  # the newest
    found = wal.find_log_damage(tmp_path, ["000007.log", "000009.log"])
    assert found == wal.LogDamage("000007.log", wal.BLOCK - 7, 0, cut=True)


def _record(kind: int, payload: bytes) -> bytes:
    """One physical record: its header (true checksum) and payload."""
    return struct.pack("<IHB", masked_crc(kind, payload), len(payload), kind) + payload


@pytest.mark.parametrize(
    ("end", "kind"),
    [(wal.BLOCK, FIRST), (2 * wal.BLOCK, MIDDLE)],
    ids=["after the first fragment", "after a middle fragment"],
)
def test_an_older_log_ending_in_a_fragment_is_cut_at_that_fragment(
    tmp_path: Path, end: int, kind: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older log that ends right after the first or a middle fragment of a record split
    across 3 blocks lost that record's end (RocksDB would skip it in silence): ``cut`` at
    that fragment, with the fragment's type."""
    monkeypatch.setattr(wal, "_sequence_gap", lambda logs: None)  # no write batches here
    data, headers = write_log((30, 100_000, 64))
    assert [h[2] for h in headers[1:5]] == [FIRST, MIDDLE, MIDDLE, LAST]
    offset = next(h[0] for h in headers if h[0] + 7 + h[1] == end)
    (tmp_path / "000007.log").write_bytes(data[:end])
    (tmp_path / "000009.log").write_bytes(data)  # the newest
    found = wal.find_log_damage(tmp_path, ["000007.log", "000009.log"])
    assert found == wal.LogDamage("000007.log", offset, kind, cut=True)


def test_an_older_log_ending_in_zeros_shorter_than_a_header_is_whole(tmp_path: Path) -> None:
    """An older log whose whole records are followed by 1 to 6 zero bytes ends in padding,
    not in a header cut short: no damage (only non-zero bytes there are a cut)."""
    names = ["000004.log", "000005.log"]
    older = _batches_log((1, 5), (6, 3))
    (tmp_path / names[1]).write_bytes(_batches_log((9, 2)))  # the newest
    for zeros in (1, 3, 6):
        (tmp_path / names[0]).write_bytes(older + bytes(zeros))
        assert wal.find_log_damage(tmp_path, names) is None, zeros
    (tmp_path / names[0]).write_bytes(older + b"\0\x01\0")  # not all zero: a header cut
    found = wal.find_log_damage(tmp_path, names)
    assert found == wal.LogDamage(names[0], len(older), 0, cut=True)


def _enlarged_before(after: bytes) -> bytes:
    """A log of a full record of 100 bytes followed by ``after`` (the end of the file), the
    record's length field enlarged past the file's end."""
    data = _record(FULL, bytes(range(1, 101))) + after
    return _with_length(data, 0, len(data))


def test_a_header_of_a_type_never_written_after_a_damaged_length_is_no_evidence(
    tmp_path: Path,
) -> None:
    """After a record whose length runs past the end, only a header of a type RocksDB
    writes shows the record is whole at a shorter length: one of type 12 (a checksum
    mismatch RocksDB reports itself) does not, and nothing is concluded."""
    log = tmp_path / "000007.log"
    log.write_bytes(_enlarged_before(struct.pack("<IHB", 0x1234, 10, 12) + bytes(range(1, 11))))
    assert wal.find_log_damage(tmp_path, [log.name]) is None
    log.write_bytes(_enlarged_before(struct.pack("<IHB", 0x1234, 10, FULL) + bytes(range(1, 11))))
    assert wal.find_log_damage(tmp_path, [log.name]) == wal.LogDamage(log.name, 0, FULL, 100)


def test_exactly_a_header_of_a_type_never_written_after_a_damaged_length_is_no_evidence(
    tmp_path: Path,
) -> None:
    """7 bytes after the whole record are a whole header, not one cut short by the end:
    of type 12, it is no well-formed header, and nothing is concluded."""
    log = tmp_path / "000007.log"
    log.write_bytes(_enlarged_before(struct.pack("<IHB", 0x1234, 10, 12)))
    assert wal.find_log_damage(tmp_path, [log.name]) is None
    log.write_bytes(_enlarged_before(struct.pack("<IHB", 0x1234, 10, 12)[:6]))  # cut short
    assert wal.find_log_damage(tmp_path, [log.name]) == wal.LogDamage(log.name, 0, FULL, 100)


def test_a_next_record_that_fills_its_block_exactly_is_well_formed(tmp_path: Path) -> None:
    """The header after the whole record may announce a payload that ends exactly at the
    block's end (the writer fills blocks so): well-formed, the length damage is found; a
    payload one byte longer cannot be in the block, and nothing is concluded."""
    log = tmp_path / "000007.log"
    fills = wal.BLOCK - 2 * (7 + 100) + 100  # after the 107-byte record and its own header
    log.write_bytes(_enlarged_before(struct.pack("<IHB", 0x1234, fills, FULL) + bytes(50)))
    assert wal.find_log_damage(tmp_path, [log.name]) == wal.LogDamage(log.name, 0, FULL, 100)
    log.write_bytes(_enlarged_before(struct.pack("<IHB", 0x1234, fills + 1, FULL) + bytes(50)))
    assert wal.find_log_damage(tmp_path, [log.name]) is None


def test_a_type_zero_header_with_a_length_is_a_record_not_padding(tmp_path: Path) -> None:
    """Only a header of length and type 0 is padding (its block's rest skipped); one of
    type 0 with a length is walked as a record, and the records after it are found."""
    log = tmp_path / "000007.log"
    zero_type = struct.pack("<IHB", 0x1234, 5, 0) + bytes(range(1, 6))
    log.write_bytes(zero_type + _record(FULL, b"x" * 30))
    offsets: list[int] = []
    assert list(wal.record_headers(log, offsets)) == [(0, 5, 0), (12, 30, FULL)]
    assert offsets == []


def test_a_gap_after_a_log_whose_batch_heads_cannot_be_read_is_found(tmp_path: Path) -> None:
    """A log whose batch heads cannot be read (a record of fewer than 12 bytes) is left
    out of the comparison, and the logs after it are still compared: a gap between the
    next two is found."""
    short = b"\x01" * 8
    names = ["000004.log", "000005.log", "000007.log", "000008.log"]
    (tmp_path / names[0]).write_bytes(_batches_log((1, 5)))
    (tmp_path / names[1]).write_bytes(_record(FULL, short))
    (tmp_path / names[2]).write_bytes(_batches_log((90, 2)))
    (tmp_path / names[3]).write_bytes(_batches_log((95, 1)))  # 92 expected
    assert wal.find_log_damage(tmp_path, names) == wal.LogDamage(names[3], 0, 0, gap=(92, 95))


def test_every_zero_header_with_data_after_it_is_reported(tmp_path: Path) -> None:
    """Zero headers with data after them in two blocks: both are reported, in order."""
    data, headers = write_log((200,) * 400)
    in_block = [h[0] for h in headers if h[0] + 7 + h[1] < wal.BLOCK * 2 - 500]
    first, second = in_block[10], next(o for o in in_block if o > wal.BLOCK + 100)
    zeroed_data = bytearray(data)
    for offset in (first, second):
        zeroed_data[offset + 4 : offset + 7] = bytes(3)
    log = tmp_path / "000007.log"
    log.write_bytes(zeroed_data)
    found: list[tuple[str, int]] = []
    assert wal.find_log_damage(tmp_path, [log.name], found) is None
    assert found == [(log.name, first), (log.name, second)]


def test_data_in_a_blocks_last_byte_after_a_zero_header_is_reported(tmp_path: Path) -> None:
    """After a zero header, data only in its block's very last byte is data all the
    same: the header is reported."""
    data = bytearray(_record(FULL, b"x" * 30) + bytes(wal.BLOCK - 37))
    log = tmp_path / "000007.log"
    log.write_bytes(data)
    found: list[tuple[str, int]] = []
    assert wal.find_log_damage(tmp_path, [log.name], found) is None
    assert found == []  # zeros to the block's end: padding
    data[wal.BLOCK - 1] = 1
    log.write_bytes(data)
    assert wal.find_log_damage(tmp_path, [log.name], found) is None
    assert found == [(log.name, 37)]


def test_a_last_fragment_whose_first_one_was_skipped_ends_no_batch(tmp_path: Path) -> None:
    """A zero header skips the rest of its block, a batch's first fragment with it: the
    last fragment in the next block ends no batch (neither the one it belongs to nor the
    split batch before it), and the log's last whole batch is the one before."""
    data = [struct.pack("<QI", seq, count) + bytes(40_000 - 12) for seq, count in ((1, 5), (9, 4))]
    sizes = [40_000, 32, 40_000]
    batch = _batches_log((6, 3))
    fill = [data[0], batch[7:], data[1]]
    log_data, headers = lay_out(sizes, lambda _o, r, at, take: fill[r][at : at + take])
    assert [h[2] for h in headers] == [FIRST, LAST, FULL, FIRST, LAST]
    damaged = bytearray(log_data)
    damaged[headers[3][0] + 4 : headers[3][0] + 7] = bytes(3)  # the second split batch's head
    log = tmp_path / "000007.log"
    log.write_bytes(damaged)
    spans: list[wal.LogSpan] = []
    assert wal.find_log_damage(tmp_path, [log.name], spans=spans) is None
    assert spans == [wal.LogSpan(log.name, 1, 8)]


@pytest.mark.parametrize("cut", [1, 5, 7, 100])
def test_a_split_batch_whose_last_fragment_is_cut_short_counts_for_nothing(
    tmp_path: Path, cut: int
) -> None:
    """A crash cut the last fragment of the log's last batch by ``cut`` bytes (its header
    and some payload still there): that batch is not whole, and the last whole one is
    the batch before it."""
    log = tmp_path / "000007.log"
    log.write_bytes(_split_batches_log((9, 2), (11, 40))[:-cut])
    spans: list[wal.LogSpan] = []
    assert wal.find_log_damage(tmp_path, [log.name], spans=spans) is None
    assert spans == [wal.LogSpan(log.name, 9, 10)]


def test_a_batch_head_filling_its_first_fragment_exactly_is_read(tmp_path: Path) -> None:
    """A batch split across blocks whose first fragment holds exactly the 12 bytes of its
    head (the writer starts it 19 bytes before a block's end): the head is read there."""
    sizes = [wal.BLOCK - 26, 5_000]
    batches = [struct.pack("<QI", 1, 5), struct.pack("<QI", 6, 3)]
    batches = [head + bytes(size - 12) for head, size in zip(batches, sizes, strict=True)]
    data, headers = lay_out(sizes, lambda _o, r, at, take: batches[r][at : at + take])
    assert headers[1] == (wal.BLOCK - 19, 12, FIRST)
    log = tmp_path / "000007.log"
    log.write_bytes(data)
    spans: list[wal.LogSpan] = []
    assert wal.find_log_damage(tmp_path, [log.name], spans=spans) is None
    assert spans == [wal.LogSpan(log.name, 1, 8)]


# -- the newest log number a MANIFEST records ---------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _edit(*fields: tuple[int, bytes | int]) -> bytes:
    """A version edit: a varint tag per field, then a varint number or a length-prefixed
    string."""
    out = bytearray()
    for tag, value in fields:
        out += _varint(tag)
        out += _varint(value) if isinstance(value, int) else _varint(len(value)) + value
    return bytes(out)


def _manifest(edits: list[bytes]) -> bytes:
    """``edits`` as records of RocksDB's log format, split into fragments at block ends."""
    sizes = [len(edit) for edit in edits]
    return lay_out(sizes, lambda _offset, r, at, take: edits[r][at : at + take])[0]


DB_ID, COMPARATOR, LOG_NUMBER, NEXT_FILE, LAST_SEQUENCE, COLUMN_FAMILY = 8193, 1, 2, 3, 4, 200


def test_the_newest_log_number_is_the_highest_an_edit_starts_with(tmp_path: Path) -> None:
    """RocksDB writes an edit's log number right after its optional database id and
    comparator name. The highest counts, wherever it is (flushes of two tables can end
    out of order), also in an edit split across blocks; an edit that starts with any
    other field records none (a log number after one is not read as such)."""
    edits = [
        _edit((DB_ID, b"3f2a-database-id"), (COMPARATOR, b"leveldb.BytewiseComparator")),
        _edit((LOG_NUMBER, 5), (NEXT_FILE, 9), (LAST_SEQUENCE, 120)),
        _edit((COMPARATOR, bytes(40_000)), (LOG_NUMBER, 300), (NEXT_FILE, 301)),  # 2 blocks
        _edit((LOG_NUMBER, 17), (COLUMN_FAMILY, 3)),
        _edit((NEXT_FILE, 9_999), (LOG_NUMBER, 9_000)),  # not where an edit records it
    ]
    path = tmp_path / "MANIFEST-000007"
    path.write_bytes(_manifest(edits))
    assert wal.newest_log_number(path) == 300
    path.write_bytes(_manifest(edits[:2] + edits[3:]))
    assert wal.newest_log_number(path) == 17
    path.write_bytes(_manifest(edits[:1]))
    assert wal.newest_log_number(path) is None  # records no log number


@pytest.mark.parametrize(
    "edit",
    [
        bytes([LOG_NUMBER, 0x80]),  # its number cut short
        _edit((COMPARATOR, b"name"))[:-2],  # a string past the edit's end
        bytes([0x80] * 12),  # a tag that never ends
    ],
    ids=["number cut", "string cut", "endless varint"],
)
def test_an_edit_that_cannot_be_decoded_concludes_nothing(tmp_path: Path, edit: bytes) -> None:
    """A start that cannot be decoded is no evidence of a lost log: ``None``, whatever
    the other edits record (the open then checks nothing against it)."""
    path = tmp_path / "MANIFEST-000007"
    path.write_bytes(_manifest([_edit((LOG_NUMBER, 40)), edit, _edit((LOG_NUMBER, 41))]))
    assert wal.newest_log_number(path) is None
    assert wal.newest_log_number(tmp_path / "MANIFEST-000008") is None  # no such file
    assert wal.manifest_facts(path) == wal.ManifestFacts(None, None)


PREV_LOG, MAX_COLUMN_FAMILY, MIN_LOG_TO_KEEP, NEW_FILE4 = 9, 203, 10, 103


def test_the_last_sequence_is_the_highest_an_edit_records_among_its_leading_fields(
    tmp_path: Path,
) -> None:
    """RocksDB writes the last sequence number after the edit's database id, comparator,
    log numbers, next file number, highest column family and lowest log to keep, in that
    order: read there only, the highest counts (two tables' edits can end out of order);
    past a field out of that order, or after a later field, nothing more is read."""
    edits = [
        _edit((DB_ID, b"id"), (COMPARATOR, b"leveldb.BytewiseComparator"), (LAST_SEQUENCE, 7)),
        _edit(
            (LOG_NUMBER, 12),
            (PREV_LOG, 0),
            (NEXT_FILE, 30),
            (MAX_COLUMN_FAMILY, 6),
            (MIN_LOG_TO_KEEP, 11),
            (LAST_SEQUENCE, 4_100),
        ),
        _edit((COMPARATOR, bytes(40_000)), (NEXT_FILE, 31), (LAST_SEQUENCE, 3_900)),  # 2 blocks
        _edit((NEXT_FILE, 32), (LOG_NUMBER, 13), (LAST_SEQUENCE, 9_000)),  # out of order
        _edit((LOG_NUMBER, 13), (NEW_FILE4, b"a table"), (LAST_SEQUENCE, 9_001)),  # after one
        _edit((LOG_NUMBER, 13), (COLUMN_FAMILY, 2)),  # records none
    ]
    path = tmp_path / "MANIFEST-000007"
    path.write_bytes(_manifest(edits))
    assert wal.manifest_facts(path) == wal.ManifestFacts(newest_log=13, last_sequence=4_100)
    path.write_bytes(_manifest([edits[0], edits[2]]))
    assert wal.manifest_facts(path) == wal.ManifestFacts(None, 3_900)
    path.write_bytes(_manifest(edits[3:]))
    assert wal.manifest_facts(path) == wal.ManifestFacts(13, None)


def test_an_edit_starting_with_a_later_field_records_nothing(tmp_path: Path) -> None:
    """An edit whose first field is none of the leading ones (a new table file, tag 103)
    records neither number there: ``(None, None)``, not an error, and the other edits
    still count."""
    assert wal._leading_fields(bytes([NEW_FILE4, 1, 2, 3])) == (None, None)
    assert wal._leading_fields(_edit((COLUMN_FAMILY, 2), (LOG_NUMBER, 9))) == (None, None)
    edits = [
        _edit((LOG_NUMBER, 40), (LAST_SEQUENCE, 700)),
        _edit((NEW_FILE4, b"a table"), (LOG_NUMBER, 90), (LAST_SEQUENCE, 900)),
    ]
    path = tmp_path / "MANIFEST-000007"
    path.write_bytes(_manifest(edits))
    assert wal.manifest_facts(path) == wal.ManifestFacts(40, 700)


def test_a_stray_middle_and_last_fragment_after_a_split_record_join_into_nothing(
    tmp_path: Path,
) -> None:
    """A record's last fragment ends it: a middle and a last fragment after it, with no
    first one, are no record (the reading ends there), not joined to the one before."""
    path = tmp_path / "MANIFEST-000007"
    path.write_bytes(
        _record(FIRST, b"ab")
        + _record(LAST, b"cd")
        + _record(MIDDLE, b"ef")
        + _record(LAST, b"gh")
        + _record(FULL, b"ij")
    )
    assert list(wal._records(path)) == [b"abcd"]
