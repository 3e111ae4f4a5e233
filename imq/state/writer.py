"""Writing a persistent queue state (SEMANTICS §13.2, with D11).

The original writes the chunk count before the chunks, computed as if every chunk held
10,000 roots, and then also cuts chunks at 10 MiB: a state of large messages announces
fewer chunks than it holds and cannot be read back (§16.1). Here chunks are cut by both
rules and spooled to a temporary file; the header, the true count and the chunks are
written once the count is known.

``.queue`` destinations are zstd-compressed (level 9, as the node writes them). A regular
file (or one that does not exist yet) is written to ``<file>.<random>.temp`` beside it, synced and
renamed over it when complete, so a reader never sees half a file, and the directory is synced
then, so a power loss after the export returned cannot take the name; through a symlink, that
happens beside the symlink's target, which the symlink keeps pointing to. Anything else
that exists -- a FIFO, a character device, a socket, or a file descriptor's alias such as
``/dev/stdout`` -- is opened and written in place: renaming over it would replace it with a
regular file nobody reads. File-system failures raise :class:`~imq.errors.FileAccessError`
naming the destination the caller gave (never the temporary file); a failed write leaves
no temporary file and a replaced file as it was (a file written in place may have
received part of the state). A process killed while it wrote leaves its temporary file:
the next export to the destination removes it (see :func:`_remove_abandoned`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import stat
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, Protocol, cast

import zstandard

from imq._files import sync_directory
from imq.errors import FileAccessError
from imq.state.boc import BocError, join_roots
from imq.state.tl import MAX_CHUNK_ROOTS, encode_chunk, state_header_parts
from imq.types import ShardIdent

__all__ = [
    "MAX_CHUNK_BYTES",
    "ZSTD_LEVEL",
    "BadMessageError",
    "ChunkSpool",
    "Writable",
    "check_sink",
    "open_sink",
    "write_state",
]

MAX_CHUNK_BYTES = 10 * 2**20  # a chunk is closed before it would pass this size
ZSTD_LEVEL = 9
_COPY_BUFFER = 1 << 20
_WRITE = "write the state file"
_SPOOL = (
    "write a temporary file (the chunks of a state being written, about the state's size; "
    "the directory is $TMPDIR's, which may point elsewhere) in"
)
_PIPE_HINT = "the reader of the pipe closed it before the state was complete"
# A file descriptor's alias: opening it opens what the descriptor refers to.
_FD_ALIAS = re.compile(
    r"/dev/(stdin|stdout|stderr|fd/\d+)"
    r"|/proc/(self|thread-self|\d+)(/task/\d+)?/fd/\d+"
)


class Writable(Protocol):
    def write(self, data: bytes, /) -> int: ...


class BadMessageError(ValueError):
    """A message added to a :class:`ChunkSpool` cannot go into a chunk: its BOC is
    malformed (``check`` is the :class:`~imq.state.boc.BocError`'s check) or its root does
    not hash to the hash it was added with (``check`` is ``"message hash"``); the export
    raises it too for a body that is no internal message (``"message kind"``) or whose
    header disagrees with its row (``"message header"``), and for a source outside the
    state's shard (``"message source"``). ``hash`` is the hash it was added with
    (``None`` if none was)."""

    def __init__(self, hash_: bytes | None, check: str, detail: str) -> None:
        super().__init__(f"{check}: {detail}")
        self.hash = hash_
        self.check = check
        self.detail = detail


class ChunkSpool:
    """Message BOCs in state order, cut into chunks and spooled to a temporary file.

    Messages given with their hashes (:meth:`add_checked`) are checked when their chunk is
    cut: each root must hash to its hash (a leaf costs one ``sha256``), else
    :class:`BadMessageError`, as for a malformed BOC.
    """

    def __init__(
        self, *, max_roots: int = MAX_CHUNK_ROOTS, max_bytes: int = MAX_CHUNK_BYTES
    ) -> None:
        try:
            self._file: BinaryIO = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in close()
        except OSError as exc:
            raise _spool_error(exc) from exc
        self._bocs: list[bytes] = []
        self._hashes: list[bytes] = []
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

    def add_checked(self, rows: Sequence[tuple[bytes, ...]]) -> None:
        """Append the next messages, given as rows that start ``(hash, one-root BOC)``
        (more items are ignored): each root must hash to its hash. One call per batch:
        the export's hot path. Do not mix with :meth:`add` in one chunk."""
        max_roots, max_bytes = self._max_roots, self._max_bytes
        count, size, start = len(self._bocs), self._size, 0
        for i, row in enumerate(rows):
            n = len(row[1])
            if count and (count >= max_roots or size + n > max_bytes):
                self._take(rows[start:i])
                self._cut()
                start, count, size = i, 0, 0
            count += 1
            size += n
        self._take(rows[start:])
        self._size = size
        self.messages += len(rows)

    def _take(self, rows: Sequence[tuple[bytes, ...]]) -> None:
        self._hashes += [row[0] for row in rows]
        self._bocs += [row[1] for row in rows]

    def _cut(self) -> None:
        bocs, expected = self._bocs, self._hashes
        if expected and len(expected) != len(bocs):
            raise ValueError("ChunkSpool: a chunk mixes add() and add_checked() messages")
        got: list[bytes] | None = [] if expected else None
        try:
            chunk = encode_chunk(join_roots(bocs, got))
        except BocError:
            raise _malformed(bocs, expected) from None
        if got is not None and got != expected:
            k = next(k for k, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e)
            raise BadMessageError(
                expected[k], "message hash", f"its root cell hashes to {got[k].hex()}"
            )
        try:
            self._file.write(chunk)
        except OSError as exc:
            raise _spool_error(exc) from exc
        self.chunks += 1
        self._bocs = []
        self._hashes = []
        self._size = 0

    def finish(self) -> None:
        """Cut the last chunk (the last check of the messages); the spool is ready to
        copy. Calling it again changes nothing."""
        if self._bocs:
            self._cut()
        try:
            self._file.seek(0)
        except OSError as exc:
            raise _spool_error(exc) from exc

    def copy_to(self, out: Writable) -> None:
        read = self._file.read
        while True:
            try:
                data = read(_COPY_BUFFER)
            except OSError as exc:
                raise _spool_error(exc) from exc
            if not data:
                return
            out.write(data)

    def close(self) -> None:
        self._file.close()


def _malformed(bocs: list[bytes], expected: list[bytes]) -> BadMessageError:
    """The first message of a chunk whose BOC :func:`join_roots` rejects."""
    for k, boc in enumerate(bocs):
        try:
            join_roots([boc])
        except BocError as exc:
            return BadMessageError(expected[k] if expected else None, exc.check, str(exc))
    raise AssertionError("unreachable: join_roots rejected a chunk but none of its BOCs")


def _spool_error(exc: OSError) -> FileAccessError:
    return FileAccessError(tempfile.gettempdir(), _SPOOL, exc)


def write_state(
    out: Writable,
    shard: ShardIdent,
    seqno: int,
    diffs_tl: Sequence[bytes],
    spool: ChunkSpool,
) -> None:
    """The whole state: header (diffs newest first), the true chunk count, the chunks."""
    spool.finish()
    for part in state_header_parts(shard, seqno, diffs_tl, spool.chunks):  # no joined copy
        out.write(part)
    spool.copy_to(out)


class _Counting:
    """Counts the bytes written through it (the uncompressed size of a state)."""

    def __init__(self, inner: Writable) -> None:
        self._inner = inner
        self.count = 0

    def write(self, data: bytes) -> int:
        self.count += len(data)
        return self._inner.write(data)


_STREAM_WRITE_HINT = "the file object given failed to write: check what it writes to and retry"


class _Output:
    """The opened destination of a state: its write errors become
    :class:`~imq.errors.FileAccessError` naming the path the caller gave."""

    __slots__ = ("_file", "_hint", "_path")

    def __init__(self, file: BinaryIO, path: Path | str, hint: str = "") -> None:
        self._file = file
        self._path = path
        self._hint = hint

    def write(self, data: bytes, /) -> int:
        try:
            return self._file.write(data)
        except OSError as exc:
            raise _write_error(self._path, exc, self._hint) from exc

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as exc:
            raise _write_error(self._path, exc, self._hint) from exc


def _write_error(path: Path | str, exc: OSError, hint: str = "") -> FileAccessError:
    if exc.errno == errno.EPIPE:
        hint = _PIPE_HINT
    return FileAccessError(path, _WRITE, exc, hint)


@contextlib.contextmanager
def open_sink(dest: str | os.PathLike[str] | BinaryIO) -> Iterator[tuple[BinaryIO, _Counting]]:
    """Yield ``(file, counter)``: write the state to ``counter`` (it counts the bytes of
    the state); ``file`` is the underlying output. A path ending in ``.queue`` is
    compressed. A regular or missing file is written to a temporary name beside it (or
    beside a symlink's target) and renamed on success; a FIFO, a device or ``/dev/stdout``
    is written in place. File-system errors raise :class:`~imq.errors.FileAccessError`."""
    if not isinstance(dest, (str, os.PathLike)):
        # The caller's stream: its write errors become FileAccessError too, naming it.
        name = getattr(dest, "name", None)
        label = name if isinstance(name, str) else repr(dest)
        counter = _Counting(_Output(dest, label, _STREAM_WRITE_HINT))
        yield dest, counter
        return
    path = Path(dest)
    target = _target(path)
    with _in_place(path) if target is None else _replacing(path, target) as (raw, out):
        if path.suffix == ".queue":
            compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
            with compressor.stream_writer(cast("BinaryIO", out), closefd=False) as zout:
                counter = _Counting(zout)
                yield raw, counter
        else:
            counter = _Counting(out)
            yield raw, counter


def check_sink(dest: str | os.PathLike[str] | BinaryIO) -> None:
    """Refuse now, before any work, a path :func:`open_sink` would refuse once the state
    is ready: a directory, or a file in a directory that does not exist (or is a file)."""
    if not isinstance(dest, (str, os.PathLike)):
        return
    path = Path(dest)
    target = _target(path)  # raises for a directory
    if target is None or target.parent.is_dir():
        return
    code = errno.ENOTDIR if target.parent.exists() else errno.ENOENT
    missing = OSError(code, os.strerror(code), str(target.parent))
    raise _write_error(path, missing) from missing


def _target(path: Path) -> Path | None:
    """The file a state written to ``path`` replaces: the real path of a regular file, or
    of one still missing (a dangling symlink's target); ``None`` for a file written in
    place: an existing FIFO, device or socket, or a file descriptor's alias."""
    try:
        mode: int | None = os.stat(path).st_mode  # through symlinks
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise _write_error(path, exc) from exc
    if mode is not None and stat.S_ISDIR(mode):
        is_dir = IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        raise _write_error(path, is_dir) from is_dir
    if mode is not None and (not stat.S_ISREG(mode) or _FD_ALIAS.fullmatch(os.path.abspath(path))):
        return None
    return Path(os.path.realpath(path))


@contextlib.contextmanager
def _in_place(path: Path) -> Iterator[tuple[BinaryIO, _Output]]:
    """Open ``path`` itself (a FIFO blocks here until a reader opens it). A regular file
    behind a descriptor's alias (``imq export ... /dev/stdout >> file``) is appended to."""
    try:
        raw = open(path, "ab" if stat.S_ISREG(os.stat(path).st_mode) else "wb")  # noqa: SIM115
    except OSError as exc:
        raise _write_error(path, exc) from exc
    try:
        yield raw, _Output(raw, path)
        _close(raw, path)
    except BaseException:
        with contextlib.suppress(OSError):
            raw.close()
        raise


@contextlib.contextmanager
def _replacing(path: Path, target: Path) -> Iterator[tuple[BinaryIO, _Output]]:
    """Write a new ``<target>.<random>.temp``, then sync it and rename it over ``target``;
    on any failure remove it, leaving ``target`` as it was."""
    _remove_abandoned(target)
    raw, temp = _new_temp(path, target)
    try:
        yield raw, _Output(raw, path)
        _close(raw, path)
        try:
            temp.replace(target)
            sync_directory(target.parent)
        except OSError as exc:
            raise _write_error(path, exc) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            raw.close()
        with contextlib.suppress(OSError):
            temp.unlink()
        raise


_ABANDONED_AGE = 60.0  # seconds untouched before another export's temporary file is removed


def _remove_abandoned(target: Path) -> None:
    """Remove the temporary files of exports to ``target`` that were killed (SIGKILL, a
    power loss) before they could remove them: an outside audit found one more left at
    every killed export. One is abandoned when no process holds its lock (a live export
    holds it until its file is renamed into place) and it was not written for a minute
    (so that one just created, not yet locked, is never taken). Best effort: whatever
    cannot be looked at or removed stays."""
    pattern = re.compile(re.escape(target.name) + r"\.[0-9a-f]{8}\.temp")
    try:
        names = [n for n in os.listdir(target.parent) if pattern.fullmatch(n)]
    except OSError:
        return
    for name in names:
        temp = target.parent / name
        try:
            fd = os.open(temp, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or time.time() - info.st_mtime < _ABANDONED_AGE:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its writer lives
            temp.unlink()
        except OSError:
            continue
        finally:
            os.close(fd)


def _new_temp(path: Path, target: Path) -> tuple[BinaryIO, Path]:
    """A temporary file of a name no one else uses, created by this call (``O_EXCL``): two
    exports to one destination each write their own and the last rename wins, where a
    shared name let one truncate or rename away the other's half-written file. Created
    with the mode ``open()`` gives (``0o666`` less the umask), as the destination's."""
    for _ in range(16):
        temp = target.with_name(f"{target.name}.{secrets.token_hex(4)}.temp")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        except OSError as exc:
            raise _write_error(path, exc) from exc
        # Held until the file is closed (renamed into place, or removed): a later export
        # that can take it knows the writer died (see _remove_abandoned).
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return os.fdopen(fd, "wb"), temp
    raise _write_error(path, FileExistsError(errno.EEXIST, "no free temporary file name"))


def _close(raw: BinaryIO, path: Path) -> None:
    """Flush, sync (a regular file: the state must be on disk before it is renamed into
    place) and close."""
    try:
        raw.flush()
        if stat.S_ISREG(os.fstat(raw.fileno()).st_mode):
            os.fsync(raw.fileno())
        raw.close()
    except OSError as exc:
        raise _write_error(path, exc) from exc
