"""The byte source of a persistent-state import: exact reads over a raw or zstd stream.

A state file can be gigabytes, so it is never loaded whole: :class:`ByteSource` reads the
file in buffers of :data:`BUFFER_SIZE` and counts the decompressed offset, which every
:class:`~imq.errors.StateFormatError` names. Tycho writes ``.queue`` files as zstd frames
without a content size, so they are decompressed as a stream. The zstd library ends a
stream that stops inside a frame silently, so a small walker over the frame structure
(block headers only, no decoding) tells a truncated file from a complete one.
"""

from __future__ import annotations

import errno
import io
import os
from types import TracebackType
from typing import BinaryIO, Protocol, cast

import zstandard

from imq.errors import FileAccessError, StateFormatError

__all__ = [
    "BUFFER_SIZE",
    "DIFF_MAGIC",
    "STATE_MAGIC",
    "STREAM_READ_HINT",
    "ZSTD_MAGIC",
    "ByteSource",
    "open_source",
]

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
STATE_MAGIC = bytes.fromhex("ccd96436")
DIFF_MAGIC = bytes.fromhex("b2a32060")
BUFFER_SIZE = 1 << 20
"""Bytes pulled from the stream per refill; a read this large or larger bypasses the buffer."""
_MAX_PULL = 8 << 20
"""Largest single read from the stream: readers allocate the size asked for up front, and a
corrupt length field must not make them allocate hundreds of megabytes for a short file."""
_READ = "read the state file"


class _Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class _ZstdFrames:
    """Follows the frame layout of a zstd stream (RFC 8878 §3.1) to know where frames end.

    It only parses headers and skips block contents by their declared size, so it costs
    nothing next to decompression. ``complete`` is true between frames.
    """

    _SKIPPABLE_LO = 0x184D2A50
    _SKIPPABLE_HI = 0x184D2A5F
    _MAGIC = int.from_bytes(ZSTD_MAGIC, "little")

    def __init__(self) -> None:
        self._state = "magic"
        self._want = 4
        self._hdr = bytearray()
        self._skip = 0
        self._checksum = False
        self.frames = 0
        self.invalid = False

    @property
    def complete(self) -> bool:
        return self._state == "magic" and not self._hdr and not self._skip and self.frames > 0

    def feed(self, data: bytes) -> None:
        pos, end = 0, len(data)
        while pos < end and not self.invalid:
            if self._skip:
                step = min(self._skip, end - pos)
                self._skip -= step
                pos += step
                continue
            step = min(self._want - len(self._hdr), end - pos)
            self._hdr += data[pos : pos + step]
            pos += step
            if len(self._hdr) == self._want:
                header = bytes(self._hdr)
                self._hdr.clear()
                self._on_header(header)

    def _expect(self, state: str, want: int, skip: int = 0) -> None:
        self._state, self._want, self._skip = state, want, skip

    def _on_header(self, header: bytes) -> None:
        value = int.from_bytes(header, "little")
        if self._state == "magic":
            if value == self._MAGIC:
                self._expect("descriptor", 1)
            elif self._SKIPPABLE_LO <= value <= self._SKIPPABLE_HI:
                self._expect("skippable", 4)
            else:
                self.invalid = True
        elif self._state == "skippable":
            self.frames += 1
            self._expect("magic", 4, value)
        elif self._state == "descriptor":
            fcs_flag, single, dict_flag = value >> 6, (value >> 5) & 1, value & 3
            self._checksum = bool(value & 0b100)
            fcs_len = (1 if single else 0, 2, 4, 8)[fcs_flag]
            rest = (0 if single else 1) + (0, 1, 2, 4)[dict_flag] + fcs_len
            self._expect("block", 3, rest)
        elif self._state == "block":
            last, kind, size = value & 1, (value >> 1) & 3, value >> 3
            if kind == 3:
                self.invalid = True
                return
            content = 1 if kind == 1 else size
            if not last:
                self._expect("block", 3, content)
            else:
                self.frames += 1
                self._expect("magic", 4, content + (4 if self._checksum else 0))


class _CompressedInput:
    """What the zstd reader reads from: replays the sniffed magic, counts, walks frames."""

    def __init__(self, raw: _Readable, head: bytes) -> None:
        self._raw = raw
        self._head = head
        self.bytes_read = 0
        self.frames = _ZstdFrames()

    def read(self, n: int = -1, /) -> bytes:
        if self._head:
            data = self._head if n < 0 else self._head[:n]
            self._head = self._head[len(data) :]
        else:
            data = self._raw.read(n)
        self.bytes_read += len(data)
        self.frames.feed(data)
        return data


class ByteSource:
    """Exact reads over a raw or zstd stream, counting the (decompressed) offset.

    Never holds the whole file: at most one buffer plus the bytes a caller asked for.
    """

    def __init__(
        self,
        raw: _Readable,
        *,
        head: bytes = b"",
        compressed: bool = False,
        owned: BinaryIO | None = None,
        total_raw_bytes: int | None = None,
    ) -> None:
        self.offset = 0
        self.compressed = compressed
        self.total_raw_bytes = total_raw_bytes
        self._owned = owned
        self._raw_count = 0
        self._eof = False
        self._closed = False
        self._zstd_input: _CompressedInput | None = None
        self._reader: _Readable
        if compressed:
            self._zstd_input = _CompressedInput(raw, head)
            self._reader = zstandard.ZstdDecompressor().stream_reader(
                cast("BinaryIO", self._zstd_input), read_across_frames=True, closefd=False
            )
            self._buf = b""
        else:
            self._reader = raw
            self._buf = head
            self._raw_count = len(head)
        self._pos = 0

    @classmethod
    def from_bytes(cls, data: bytes) -> ByteSource:
        """A raw source over bytes already in memory (no zstd detection)."""
        return cls(io.BytesIO(data), total_raw_bytes=len(data))

    @property
    def raw_bytes_read(self) -> int:
        """Bytes taken from the underlying file so far (the compressed size for zstd)."""
        if self._zstd_input is not None:
            return self._zstd_input.bytes_read
        return self._raw_count

    def read(self, n: int, what: str) -> bytes:
        """Exactly ``n`` bytes, else :class:`StateFormatError` naming the offset and ``what``."""
        if n < 0:
            raise ValueError(f"cannot read a negative number of bytes ({n})")
        pos = self._pos
        if pos + n <= len(self._buf):
            self._pos = pos + n
            self.offset += n
            return self._buf[pos : pos + n]
        parts = [self._buf[pos:]]
        have = len(parts[0])
        self._buf, self._pos = b"", 0
        while have < n:
            need = n - have
            chunk = self._pull(max(need, BUFFER_SIZE), what, self.offset + have)
            if not chunk:
                self._buf = b"".join(parts)
                raise StateFormatError(
                    f"truncated at offset {self.offset} while reading {what}: "
                    f"needed {n} bytes, {have} left"
                )
            if len(chunk) > need:
                self._buf, self._pos = chunk, need
                chunk = chunk[:need]
            parts.append(chunk)
            have += len(chunk)
        self.offset += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def at_eof(self) -> bool:
        """True if no byte remains; reads ahead at most one buffer."""
        if self._pos < len(self._buf):
            return False
        self._buf, self._pos = self._pull(BUFFER_SIZE, "the end of the input", self.offset), 0
        return not self._buf

    def _pull(self, n: int, what: str, at: int) -> bytes:
        """Up to ``n`` bytes from the stream, whose next byte is at offset ``at``;
        ``b""`` only at a verified end."""
        if self._eof:
            return b""
        if self._closed:
            raise ValueError("read from a closed ByteSource")
        out: list[bytes] = []
        got = 0
        while got < n:
            try:
                chunk = self._reader.read(min(n - got, _MAX_PULL))
            except zstandard.ZstdError as exc:
                raise StateFormatError(
                    f"zstd stream corrupt at or after offset {at + got} "
                    f"(compressed offset ~{self.raw_bytes_read}) while reading {what}: {exc}"
                ) from None
            if not chunk:
                self._on_end(at + got, what, at)
                break
            out.append(chunk)
            got += len(chunk)
        if self._zstd_input is None:
            self._raw_count += got
        return out[0] if len(out) == 1 else b"".join(out)

    def _on_end(self, offset: int, what: str, start: int) -> None:
        self._eof = True
        if self._zstd_input is None:
            return
        frames = self._zstd_input.frames
        # A read pulls a whole buffer ahead: say where the data ends and where the read
        # that found it began, so a small read far before the end is not blamed alone.
        where = (
            f"after {self._zstd_input.bytes_read} compressed bytes (the data ends at "
            f"offset {offset}; found while reading {what}, from offset {start})"
        )
        if frames.invalid:
            raise StateFormatError(f"zstd stream corrupt: an invalid frame or block header {where}")
        if not frames.complete:
            raise StateFormatError(f"zstd stream truncated: the input ends inside a frame {where}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.compressed:
            close = getattr(self._reader, "close", None)
            if close is not None:
                close()
        if self._owned is not None:
            self._owned.close()

    def __enter__(self) -> ByteSource:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _remaining_size(f: BinaryIO) -> int | None:
    try:
        return os.fstat(f.fileno()).st_size - f.tell()
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        pass
    try:
        if not f.seekable():
            return None
        here = f.tell()
        end = f.seek(0, io.SEEK_END)
        f.seek(here)
        return end - here
    except (OSError, AttributeError, ValueError):
        return None


STREAM_READ_HINT = "the file object given failed to read: check what it reads from and retry"


class _FileInput:
    """A state file imq opened: its read errors become :class:`FileAccessError` naming
    the path."""

    __slots__ = ("_file", "_hint", "_path")

    def __init__(self, file: BinaryIO, path: str | os.PathLike[str], hint: str = "") -> None:
        self._file = file
        self._path = path
        self._hint = hint

    def read(self, n: int = -1, /) -> bytes:
        try:
            data = self._file.read(n)
        except OSError as exc:
            raise FileAccessError(self._path, _READ, exc, self._hint) from exc
        if data is None:  # a non-blocking stream with nothing to read yet
            raise FileAccessError(
                self._path,
                _READ,
                BlockingIOError(errno.EAGAIN, "a non-blocking stream had no data ready"),
                "pass a blocking file object (or the path): a state is read in one pass",
            )
        if type(data) is bytes:
            return data
        if isinstance(data, bytes | bytearray | memoryview):  # a buffer: its bytes
            return bytes(data)
        if isinstance(data, str):  # a text stream that is no io.TextIOBase (codecs.open)
            raise TypeError(
                f"the file object given returned text (str) from read(): open the state "
                f"file in binary mode ('rb'), or pass its path ({self._path})"
            )
        raise TypeError(
            f"the file object given returned {type(data).__name__} from read(), not bytes: "
            f"pass a binary file object, or the path ({self._path})"
        )


def open_source(source: str | os.PathLike[str] | BinaryIO) -> ByteSource:
    """Open a path (closed with the source) or wrap a binary file object (left open).

    zstd is detected by its magic; any other first bytes are left for the TL reader to judge.
    A path that cannot be opened or read (missing, a directory, not permitted, an I/O
    error) raises :class:`FileAccessError`, and so does a file object's ``OSError``
    (named by its ``name``, else its repr).
    """
    owned: BinaryIO | None = None
    raw: _Readable
    if isinstance(source, (str, os.PathLike)):
        try:
            f: BinaryIO = open(source, "rb")  # noqa: SIM115 - closed by ByteSource.close
        except OSError as exc:
            raise FileAccessError(source, _READ, exc) from exc
        owned = f
        raw = _FileInput(f, source)
    else:
        f = source
        name = getattr(source, "name", None)
        raw = _FileInput(source, name if isinstance(name, str) else repr(source), STREAM_READ_HINT)
    try:
        total = _remaining_size(f)
        head = b""
        while len(head) < 4:
            chunk = raw.read(4 - len(head))
            if not chunk:
                break
            head += chunk
        return ByteSource(
            raw,
            head=head,
            compressed=head[:4] == ZSTD_MAGIC,  # a read may return more than it was asked
            owned=owned,
            total_raw_bytes=total,
        )
    except BaseException:
        if owned is not None:
            owned.close()
        raise
