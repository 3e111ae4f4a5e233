"""Writing a persistent queue state (SEMANTICS §13.2, with D11).

The original writes the chunk count before the chunks, computed as if every chunk held
10,000 roots, and then also cuts chunks at 10 MiB: a state of large messages announces
fewer chunks than it holds and cannot be read back (§16.1). Here chunks are cut by both
rules and spooled to a temporary file; the header, the true count and the chunks are
written once the count is known.

``.queue`` destinations are zstd-compressed (level 9, as the node writes them); a path
is written to ``<dest>.temp`` and renamed when complete, so a reader never sees half a
file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, Protocol

import zstandard

from imq.state.boc import join_roots
from imq.state.tl import MAX_CHUNK_ROOTS, encode_chunk, encode_state_header
from imq.types import ShardIdent

__all__ = [
    "MAX_CHUNK_BYTES",
    "ZSTD_LEVEL",
    "ChunkSpool",
    "Writable",
    "open_sink",
    "write_state",
]

MAX_CHUNK_BYTES = 10 * 2**20  # a chunk is closed before it would pass this size
ZSTD_LEVEL = 9
_COPY_BUFFER = 1 << 20


class Writable(Protocol):
    def write(self, data: bytes, /) -> int: ...


class ChunkSpool:
    """Message BOCs in state order, cut into chunks and spooled to a temporary file."""

    def __init__(
        self, *, max_roots: int = MAX_CHUNK_ROOTS, max_bytes: int = MAX_CHUNK_BYTES
    ) -> None:
        self._file: BinaryIO = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in close()
        self._bocs: list[bytes] = []
        self._size = 0
        self._max_roots = max_roots
        self._max_bytes = max_bytes
        self.chunks = 0
        self.messages = 0

    def add(self, boc: bytes) -> None:
        """Append the next message (a one-root BOC)."""
        if self._bocs and (
            len(self._bocs) >= self._max_roots or self._size + len(boc) > self._max_bytes
        ):
            self._cut()
        self._bocs.append(boc)
        self._size += len(boc)
        self.messages += 1

    def _cut(self) -> None:
        self._file.write(encode_chunk(join_roots(self._bocs)))
        self.chunks += 1
        self._bocs = []
        self._size = 0

    def finish(self) -> None:
        if self._bocs:
            self._cut()
        self._file.seek(0)

    def copy_to(self, out: Writable) -> None:
        shutil.copyfileobj(self._file, out, _COPY_BUFFER)

    def close(self) -> None:
        self._file.close()


def write_state(
    out: Writable,
    shard: ShardIdent,
    seqno: int,
    diffs_tl: Sequence[bytes],
    spool: ChunkSpool,
) -> None:
    """The whole state: header (diffs newest first), the true chunk count, the chunks."""
    spool.finish()
    out.write(encode_state_header(shard, seqno, diffs_tl, spool.chunks))
    spool.copy_to(out)


class _Counting:
    """Counts the bytes written through it (the uncompressed size of a state)."""

    def __init__(self, inner: Writable) -> None:
        self._inner = inner
        self.count = 0

    def write(self, data: bytes) -> int:
        self.count += len(data)
        return self._inner.write(data)


@contextlib.contextmanager
def open_sink(dest: str | os.PathLike[str] | BinaryIO) -> Iterator[tuple[BinaryIO, _Counting]]:
    """Yield ``(file, counter)``: write the state to ``counter`` (it counts the bytes of
    the state); ``file`` is the underlying output. A path ending in ``.queue`` is
    compressed; a path is written to a temporary name and renamed on success."""
    if not isinstance(dest, (str, os.PathLike)):
        counter = _Counting(dest)
        yield dest, counter
        return
    path = Path(dest)
    temp = path.with_name(path.name + ".temp")
    try:
        with open(temp, "wb") as raw:
            if path.suffix == ".queue":
                compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
                with compressor.stream_writer(raw, closefd=False) as zout:
                    counter = _Counting(zout)
                    yield raw, counter
            else:
                counter = _Counting(raw)
                yield raw, counter
            raw.flush()
            os.fsync(raw.fileno())
        temp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
