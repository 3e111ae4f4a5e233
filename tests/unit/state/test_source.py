"""The byte source: raw and zstd input, exact reads, offsets, truncation and corruption."""

from __future__ import annotations

import io
import os
import random
import struct
from pathlib import Path

import pytest
import zstandard
from tycho_data import TYCHO

from imq.errors import FileAccessError, ImqError, StateFormatError
from imq.state.source import BUFFER_SIZE, STATE_MAGIC, ZSTD_MAGIC, ByteSource, open_source

SHARD_BIN = TYCHO / "persistent_state" / "shard.bin"
QUEUES = sorted([*TYCHO.glob("dump/queues/*.queue"), *TYCHO.glob("dump_one_shard/queues/*.queue")])
HEADER_IDS = STATE_MAGIC + bytes.fromhex("654b01d4")


def drain(src: ByteSource, step: int = 1000) -> bytes:
    """Everything left, read in ``step``-byte reads (the last one exact)."""
    out = bytearray()
    while not src.at_eof():
        try:
            out += src.read(step, "drain")
        except StateFormatError as exc:
            if step == 1 or not str(exc).startswith("truncated at offset"):
                raise
            out += drain(src, 1)
    return bytes(out)


def zstd_stream(data: bytes, **params: object) -> bytes:
    """zstd frames without a content size, as tycho's stream writer makes them."""
    sink = io.BytesIO()
    cctx = zstandard.ZstdCompressor(level=9, **params)  # type: ignore[arg-type]
    with cctx.stream_writer(sink, closefd=False) as writer:
        writer.write(data)
    return sink.getvalue()


class ShortReads(io.RawIOBase):
    """A stream that returns at most ``limit`` bytes per read, like a pipe."""

    def __init__(self, data: bytes, limit: int) -> None:
        self._data = data
        self._pos = 0
        self._limit = limit

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1, /) -> bytes:
        n = self._limit if n < 0 else min(n, self._limit)
        out = self._data[self._pos : self._pos + n]
        self._pos += len(out)
        return out


def test_queue_fixtures_present() -> None:
    assert len(QUEUES) == 6
    assert SHARD_BIN.stat().st_size == 538_308


# ---------------------------------------------------------------------------------------------
# Raw input


def test_raw_path() -> None:
    data = SHARD_BIN.read_bytes()
    with open_source(SHARD_BIN) as src:
        assert not src.compressed
        assert src.total_raw_bytes == len(data)
        assert src.read(8, "ids") == HEADER_IDS
        assert src.offset == 8
        assert drain(src, 4096) == data[8:]
        assert src.offset == len(data)
        assert src.raw_bytes_read == len(data)
        assert src.at_eof()


def test_path_as_str_and_closed_on_close() -> None:
    src = open_source(str(SHARD_BIN))
    src.read(4, "id")
    src.close()
    src.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        src.read(BUFFER_SIZE * 2, "more")


def test_file_object_is_used_as_is_and_left_open() -> None:
    with SHARD_BIN.open("rb") as f:
        f.seek(4)
        with open_source(f) as src:
            assert not src.compressed
            assert src.total_raw_bytes == SHARD_BIN.stat().st_size - 4
            assert src.read(4, "header id") == HEADER_IDS[4:]
            assert src.offset == 4  # offsets count from where the source starts
        assert not f.closed


def test_bytes_io_and_from_bytes() -> None:
    data = bytes(range(256)) * 10
    with open_source(io.BytesIO(data)) as src:
        assert src.total_raw_bytes == len(data)
        assert drain(src, 7) == data
    src = ByteSource.from_bytes(data)
    assert src.read(len(data), "all") == data
    assert src.at_eof()


def test_non_seekable_stream_has_no_total() -> None:
    with open_source(ShortReads(b"abcdefgh", 3)) as src:  # type: ignore[arg-type]
        assert src.total_raw_bytes is None
        assert src.read(8, "all") == b"abcdefgh"
        assert src.at_eof()


def test_empty_input() -> None:
    with open_source(io.BytesIO(b"")) as src:
        assert not src.compressed
        assert src.at_eof()
        assert src.read(0, "nothing") == b""
        with pytest.raises(StateFormatError, match="truncated at offset 0 while reading the id"):
            src.read(4, "the id")


def test_negative_read_is_misuse() -> None:
    with pytest.raises(ValueError):
        ByteSource.from_bytes(b"abc").read(-1, "x")


def test_truncation_names_offset_and_field_and_keeps_position() -> None:
    src = ByteSource.from_bytes(b"0123456789")
    assert src.read(6, "a") == b"012345"
    with pytest.raises(StateFormatError) as err:
        src.read(5, "the seqno of diff 2")
    assert "truncated at offset 6 while reading the seqno of diff 2" in str(err.value)
    assert "4 left" in str(err.value)
    assert src.offset == 6
    assert src.read(4, "rest") == b"6789"
    assert src.at_eof()


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "zstd"])
def test_reads_across_buffer_boundaries(compress: bool) -> None:
    rng = random.Random(7)
    data = rng.randbytes(3 * BUFFER_SIZE + 12345)
    blob = zstd_stream(data) if compress else data
    sizes = [1, 3, BUFFER_SIZE - 5, 4, 10, 2 * BUFFER_SIZE + 1, 0, 32, BUFFER_SIZE]
    with open_source(io.BytesIO(blob)) as src:
        assert src.compressed is compress
        pos = 0
        for n in sizes:
            if pos + n > len(data):
                break
            assert src.read(n, "part") == data[pos : pos + n]
            pos += n
            assert src.offset == pos
        assert drain(src, 4093) == data[pos:]
        assert src.raw_bytes_read == len(blob)


@pytest.mark.parametrize("limit", [1, 5, 4096])
def test_short_reads_from_the_stream(limit: int) -> None:
    data = SHARD_BIN.read_bytes()[: 100_000 if limit == 1 else None]
    for blob in (data, zstd_stream(data)):
        with open_source(ShortReads(blob, limit)) as src:  # type: ignore[arg-type]
            assert src.read(len(data) - 10, "most") == data[:-10]
            assert drain(src, 3) == data[-10:]


def test_random_read_pattern_matches_slices() -> None:
    rng = random.Random(11)
    data = rng.randbytes(5 * BUFFER_SIZE // 2)
    for blob in (data, zstd_stream(data)):
        with open_source(io.BytesIO(blob)) as src:
            pos = 0
            while pos < len(data):
                n = min(rng.choice([1, 4, 32, 1000, 70_000, BUFFER_SIZE + 3]), len(data) - pos)
                assert src.read(n, "part") == data[pos : pos + n]
                pos += n
            assert src.at_eof()


# ---------------------------------------------------------------------------------------------
# zstd input


@pytest.mark.parametrize("path", QUEUES, ids=lambda p: p.name[:24])
def test_real_queue_files_decompress(path: Path) -> None:
    blob = path.read_bytes()
    assert blob[:4] == ZSTD_MAGIC
    expected = zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True).read()
    with open_source(path) as src:
        assert src.compressed
        assert src.total_raw_bytes == len(blob)
        assert src.read(8, "ids") == HEADER_IDS
        assert src.offset == 8
        rest = drain(src, 5)
        assert HEADER_IDS + rest == expected
        assert src.offset == len(expected)  # decompressed bytes
        assert src.raw_bytes_read == len(blob)  # compressed bytes


def test_zstd_of_a_big_state_with_and_without_checksum() -> None:
    data = SHARD_BIN.read_bytes()
    for blob in (zstd_stream(data), zstd_stream(data, write_checksum=True)):
        with open_source(io.BytesIO(blob)) as src:
            assert src.compressed
            assert src.read(len(data), "all") == data
            assert src.at_eof()


def test_several_frames_and_a_skippable_frame() -> None:
    skippable = struct.pack("<II", 0x184D2A53, 5) + b"hello"
    one, two = zstd_stream(b"first;"), zstd_stream(b"second")
    with open_source(io.BytesIO(one + skippable + two)) as src:
        assert src.read(12, "both") == b"first;second"
        assert src.at_eof()


def test_truncated_zstd_raises_at_every_cut() -> None:
    for path in QUEUES:
        blob = path.read_bytes()
        for cut in range(4, len(blob)):
            with open_source(io.BytesIO(blob[:cut])) as src, pytest.raises(StateFormatError):
                drain(src)


def test_truncated_zstd_that_lost_only_its_checksum() -> None:
    data = SHARD_BIN.read_bytes()
    blob = zstd_stream(data, write_checksum=True)
    with open_source(io.BytesIO(blob[:-2])) as src, pytest.raises(StateFormatError) as err:
        src.read(len(data), "all")
        src.at_eof()
    assert "zstd stream truncated" in str(err.value)
    assert "compressed bytes" in str(err.value)


def test_truncated_zstd_message() -> None:
    blob = zstd_stream(SHARD_BIN.read_bytes())
    src = open_source(io.BytesIO(blob[: len(blob) // 2]))
    with src, pytest.raises(StateFormatError) as err:
        src.read(SHARD_BIN.stat().st_size, "everything")
    message = str(err.value)
    assert "zstd stream truncated" in message
    assert "while reading everything" in message


def test_corrupt_zstd_in_the_middle_of_a_real_queue() -> None:
    """Flipping a byte either breaks the stream (StateFormatError) or changes the data;
    tycho's frames carry no checksum, so the TL reader catches the rest."""
    blob = QUEUES[4].read_bytes()  # the 2-diff state, 169 bytes
    expected = zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True).read()
    zstd_errors = 0
    for pos in range(4, len(blob)):
        bad = bytearray(blob)
        bad[pos] ^= 0xFF
        with open_source(io.BytesIO(bytes(bad))) as src:
            try:
                out = drain(src)
            except StateFormatError as exc:
                zstd_errors += "zstd" in str(exc)
                assert "offset" in str(exc)
                continue
        assert out != expected or pos == len(blob) - 1
    assert zstd_errors > 0


def test_corrupt_zstd_with_checksum_is_detected() -> None:
    data = SHARD_BIN.read_bytes()
    blob = bytearray(zstd_stream(data, write_checksum=True))
    rng = random.Random(3)
    for _ in range(20):
        bad = bytearray(blob)
        pos = rng.randrange(len(blob) // 4, len(blob) - 8)
        bad[pos] ^= 1 << rng.randrange(8)
        with open_source(io.BytesIO(bytes(bad))) as src, pytest.raises(StateFormatError) as err:
            src.read(len(data), "all")
            src.at_eof()
        assert "zstd" in str(err.value)


def test_garbage_after_a_frame() -> None:
    blob = zstd_stream(b"payload") + b"not zstd"
    with open_source(io.BytesIO(blob)) as src, pytest.raises(StateFormatError, match="zstd"):
        drain(src)


def test_reserved_block_type_is_corrupt() -> None:
    frame = bytearray(zstd_stream(b"payload"))
    # magic(4) + descriptor(1) + window(1) for a streamed frame, then the first block header
    assert frame[4] & 0b0010_0000 == 0
    frame[6] |= 0b110  # block type 3 (reserved)
    with open_source(io.BytesIO(bytes(frame))) as src, pytest.raises(StateFormatError):
        drain(src)


def test_zstd_magic_only_is_truncated() -> None:
    with open_source(io.BytesIO(ZSTD_MAGIC)) as src:
        assert src.compressed
        with pytest.raises(StateFormatError, match="truncated"):
            src.at_eof()


def test_temp_file_path(tmp_path: Path) -> None:
    data = os.urandom(1000)
    path = tmp_path / "x.queue"
    path.write_bytes(zstd_stream(data))
    with open_source(path) as src:
        assert src.compressed
        assert src.read(1000, "all") == data
        assert src.at_eof()


def test_a_path_that_cannot_be_opened_is_a_file_access_error(tmp_path: Path) -> None:
    missing = tmp_path / "missing.queue"
    for path, cause in ((missing, FileNotFoundError), (tmp_path, IsADirectoryError)):
        with pytest.raises(FileAccessError) as info:
            open_source(path)
        assert isinstance(info.value, ImqError)
        assert isinstance(info.value.__cause__, cause)
        assert info.value.errno == info.value.__cause__.errno
        assert info.value.filename == str(path)
        assert str(info.value).startswith(f"cannot read the state file {path}: ")


def test_a_failing_read_of_an_opened_path_is_a_file_access_error() -> None:
    # /proc/self/mem opens, and its first page (address 0, never mapped) fails to read
    with pytest.raises(FileAccessError) as info:
        open_source("/proc/self/mem")
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.filename == "/proc/self/mem"


def test_a_file_objects_os_errors_become_file_access_errors() -> None:
    """A caller's stream failing: the typed error (still an ``OSError``, its errno kept,
    the original as its cause), naming the stream and what to check."""

    class Failing(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer: object) -> int:
            raise OSError(5, "injected")

    with pytest.raises(FileAccessError, match="the file object given failed to read") as info:
        open_source(Failing())  # type: ignore[arg-type]
    assert info.value.errno == 5
    assert isinstance(info.value.__cause__, OSError)
    assert "Failing" in str(info.value)
