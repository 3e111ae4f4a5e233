"""Where ``export_state`` writes and how export and import fail on the file system.

A regular or missing destination is written to a new ``<file>.<random>.temp``, synced
and renamed over it; through a symlink that happens beside the target (the symlink
stays); a destination that exists and is no regular file -- a FIFO, a character device,
a descriptor's alias such as ``/dev/fd/N`` -- is written in place, never replaced by a
regular file. Every file-system failure of either direction raises
:class:`FileAccessError` (an ``ImqError`` and an ``OSError``) naming the caller's path,
the original error as its cause; a failed export leaves no temporary file and the old
destination as it was.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import io
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard
from builders import open_queue
from cli_runner import Imq
from state_fixtures import BASE, SHARD_BIN, SHARD_TOP

from imq import BlockId, FileAccessError, ImqError, Queue, ShardIdent
from imq.state import exporter, writer
from imq.state.exporter import ExportReport
from imq.state.synth import synth_state, write_synth_state

SHARD_ID = f"0:8000000000000000:160:{'0' * 64}:{'0' * 64}"
OLD = b"previous export"


@pytest.fixture
def shard_queue(queue: Queue) -> Queue:
    queue.import_state(SHARD_BIN, BlockId(BASE, 160), SHARD_TOP)
    return queue


def _export(queue: Queue, dest: object) -> None:
    queue.export_state(BASE, 160, 3, dest)  # type: ignore[arg-type]


def _temps(*folders: Path) -> list[str]:
    return sorted(p.name for folder in folders for p in folder.iterdir() if ".temp" in p.name)


def test_two_exports_to_one_path_each_write_their_own_temporary_file(
    tmp_path: Path, shard_queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second export to the same path runs while the first is writing (here: from
    inside the first's write, with another queue holding another state): each has its
    own temporary file, both succeed, and the path holds the whole state of the export
    that renamed last. With one shared ``<file>.temp`` the second truncated and renamed
    away the first's file, which then failed or wrote into the published one. A file
    the user had at ``<file>.temp`` is left alone."""
    dest = tmp_path / "state.bin"
    users = tmp_path / "state.bin.temp"
    users.write_bytes(b"mine")
    other = open_queue(tmp_path / "other")
    shard = ShardIdent.MASTERCHAIN
    state = synth_state(shard, top_seqno=9, diffs=2, messages_per_diff=4, seed=3)
    data = io.BytesIO()
    write_synth_state(state, data)
    other.import_state(io.BytesIO(data.getvalue()), state.block_id, state.top_update)
    write_state = writer.write_state
    inner_done: list[ExportReport] = []
    outer = threading.current_thread()

    def interleaved(*args: object, **kwargs: object) -> None:
        if threading.current_thread() is outer:  # the inner export runs in another thread
            inner = threading.Thread(
                target=lambda: inner_done.append(other.export_state(shard, 9, 2, dest))
            )
            inner.start()
            inner.join()
        write_state(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(exporter, "write_state", interleaved)
    try:
        _export(shard_queue, dest)
    finally:
        other.close()
    assert inner_done[0].messages == 8
    assert dest.read_bytes() == SHARD_BIN.read_bytes()  # the outer export renamed last
    assert users.read_bytes() == b"mine"
    assert _temps(tmp_path) == ["state.bin.temp"]


_HOLD_TEMP = """
import sys, time
from pathlib import Path
from imq.state import writer
raw, temp = writer._new_temp(Path(sys.argv[1]), Path(sys.argv[1]))
raw.write(b"half a state")
raw.flush()
print(temp.name, flush=True)
time.sleep(600)
"""


def test_a_killed_exports_temporary_file_is_removed_by_the_next_export(
    tmp_path: Path, shard_queue: Queue
) -> None:
    """An export killed while it wrote (SIGKILL) left its ``<file>.<random>.temp`` for
    good, one more at every kill (an outside audit). The next export to the path removes
    one whose writer is gone (nobody holds its lock) and that was not written for a
    minute; a live export's (locked), a fresh one and the user's own files stay."""
    dest = tmp_path / "state.bin"
    killed = subprocess.Popen(
        [sys.executable, "-c", _HOLD_TEMP, str(dest)], stdout=subprocess.PIPE, text=True
    )
    live = subprocess.Popen(
        [sys.executable, "-c", _HOLD_TEMP, str(dest)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert killed.stdout is not None and live.stdout is not None
        abandoned, held = killed.stdout.readline().strip(), live.stdout.readline().strip()
        killed.kill()
        killed.wait()
        fresh = tmp_path / "state.bin.0123abcd.temp"  # unlocked, but written just now
        fresh.write_bytes(b"x")
        users = tmp_path / "state.bin.feedf00d.temp.keep"
        users.write_bytes(b"mine")
        old = time.time() - 120
        for name in (abandoned, held):
            os.utime(tmp_path / name, (old, old))
        _export(shard_queue, dest)
        assert dest.read_bytes() == SHARD_BIN.read_bytes()
        assert sorted(p.name for p in tmp_path.glob("state.bin*")) == sorted(
            ["state.bin", held, fresh.name, users.name]
        )
    finally:
        for child in (killed, live):
            child.kill()
            child.wait()


def _check_error(
    exc: FileAccessError, path: Path, code: int, cause: type[OSError] = OSError
) -> None:
    assert isinstance(exc, ImqError)
    assert isinstance(exc, OSError)
    assert exc.errno == code
    assert exc.filename == str(path)
    assert str(path) in str(exc)
    assert ".temp" not in str(exc)
    assert isinstance(exc.__cause__, cause)
    assert exc.__cause__.errno == code


class _Reader(threading.Thread):
    """Reads a FIFO (or a pipe's read end) to its end, as a consumer of an export would."""

    def __init__(self, source: Path | int) -> None:
        super().__init__(daemon=True)  # a reader never fed must not keep pytest alive
        self._source = source
        self.data: bytes | None = None

    def run(self) -> None:
        with open(self._source, "rb") as f:  # a FIFO's open waits for its writer
            self.data = f.read()

    def result(self) -> bytes:
        self.join(timeout=30)
        assert not self.is_alive(), "the reader got no end of file: nothing wrote the FIFO"
        assert self.data is not None
        return self.data


# -- where a state is written ------------------------------------------------------------------


def test_a_symlink_is_written_at_its_target_which_is_replaced_beside_itself(
    tmp_path: Path, shard_queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    links, targets = tmp_path / "links", tmp_path / "targets"
    links.mkdir()
    targets.mkdir()
    target = targets / "state.bin"
    target.write_bytes(OLD)
    link = links / "state.bin"
    link.symlink_to(target)
    renames: list[tuple[str, str]] = []
    replace = os.replace

    def spy(src: str, dst: str) -> None:
        renames.append((os.fspath(src), os.fspath(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)

    _export(shard_queue, link)

    assert link.is_symlink()
    assert os.readlink(link) == str(target)
    assert target.read_bytes() == SHARD_BIN.read_bytes()
    assert [(Path(src).parent, dst) for src, dst in renames] == [(targets, str(target))]
    assert re.fullmatch(r"state\.bin\.[0-9a-f]{8}\.temp", Path(renames[0][0]).name)
    assert _temps(links, targets) == []


def test_a_dangling_symlink_creates_its_target(tmp_path: Path, shard_queue: Queue) -> None:
    target = tmp_path / "new.bin"
    link = tmp_path / "link.bin"
    link.symlink_to(target)

    _export(shard_queue, link)

    assert link.is_symlink()
    assert target.read_bytes() == SHARD_BIN.read_bytes()
    assert _temps(tmp_path) == []


@pytest.mark.parametrize("name", ["fifo", "fifo.queue"])
def test_a_fifo_is_written_in_place_and_its_reader_gets_the_state(
    name: str, tmp_path: Path, shard_queue: Queue
) -> None:
    expected = io.BytesIO()
    _export(shard_queue, expected)
    fifo = tmp_path / name
    os.mkfifo(fifo)
    reader = _Reader(fifo)
    reader.start()

    _export(shard_queue, fifo)

    data = reader.result()
    if name.endswith(".queue"):
        data = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
    assert data == expected.getvalue() == SHARD_BIN.read_bytes()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert _temps(tmp_path) == []


def test_imq_export_to_a_fifo_feeds_its_reader(imq: Imq, tmp_path: Path) -> None:
    db = tmp_path / "db"
    assert imq("import", db, SHARD_BIN, "--block-id", SHARD_ID, "--no-progress").code == 0
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = _Reader(fifo)
    reader.start()

    run = imq("export", db, "--shard", str(BASE), "--seqno", "160", "--tail-len", "3", fifo)

    assert run.code == 0, run.err
    assert reader.result() == SHARD_BIN.read_bytes()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_descriptor_alias_of_a_pipe_is_written_in_place(
    tmp_path: Path, shard_queue: Queue
) -> None:
    read_end, write_end = os.pipe()
    reader = _Reader(read_end)
    reader.start()
    try:
        _export(shard_queue, f"/dev/fd/{write_end}")  # what /dev/stdout is, under a pipe
    finally:
        os.close(write_end)
    assert reader.result() == SHARD_BIN.read_bytes()


def test_a_descriptor_alias_of_a_file_is_appended_to(tmp_path: Path, shard_queue: Queue) -> None:
    # `imq export ... /dev/stdout >> log`: the file the descriptor holds, not a new one
    log = tmp_path / "log"
    log.write_bytes(OLD)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    try:
        _export(shard_queue, f"/dev/fd/{fd}")
    finally:
        os.close(fd)
    assert log.read_bytes() == OLD + SHARD_BIN.read_bytes()
    assert _temps(tmp_path) == []


def test_a_character_device_is_written_in_place(tmp_path: Path, shard_queue: Queue) -> None:
    null = tmp_path / "null"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a /dev/null of our own
    except OSError as exc:
        pytest.skip(f"cannot create a character device here (needs root): {exc}")
    _export(shard_queue, null)
    assert stat.S_ISCHR(os.lstat(null).st_mode)
    assert _temps(tmp_path) == []


def test_a_socket_is_not_replaced(tmp_path: Path, shard_queue: Queue) -> None:
    path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        with pytest.raises(FileAccessError) as info:
            _export(shard_queue, path)
    _check_error(info.value, path, errno.ENXIO)
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    assert _temps(tmp_path) == []


# -- file-system failures -----------------------------------------------------------------------


def test_importing_a_missing_file_or_a_directory_is_a_file_access_error(
    tmp_path: Path, queue: Queue
) -> None:
    missing = tmp_path / "missing.queue"
    with pytest.raises(FileAccessError, match="does not exist") as info:
        queue.import_state(missing, BlockId(BASE, 160))
    _check_error(info.value, missing, errno.ENOENT, FileNotFoundError)

    with pytest.raises(FileAccessError, match="is a directory") as info:
        queue.import_state(tmp_path, BlockId(BASE, 160))
    _check_error(info.value, tmp_path, errno.EISDIR, IsADirectoryError)
    assert queue.get_diff_info(BASE, 160) is None


def test_exporting_into_a_missing_directory_names_the_destination(
    tmp_path: Path, shard_queue: Queue
) -> None:
    dest = tmp_path / "nowhere" / "x.queue"
    with pytest.raises(FileAccessError) as info:
        _export(shard_queue, dest)
    _check_error(info.value, dest, errno.ENOENT, FileNotFoundError)


def test_exporting_onto_a_directory_fails_before_writing(
    tmp_path: Path, shard_queue: Queue
) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    link = tmp_path / "link"
    link.symlink_to(folder)
    for dest in (folder, link):
        with pytest.raises(FileAccessError, match="is a directory") as info:
            _export(shard_queue, dest)
        _check_error(info.value, dest, errno.EISDIR, IsADirectoryError)
    assert list(folder.iterdir()) == []
    assert _temps(tmp_path) == []


@contextlib.contextmanager
def _tmpfs(root: Path, size: str) -> Iterator[None]:
    """A small tmpfs at ``root`` (root only), unmounted at the end."""
    root.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(root)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip() or 'not root'}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def test_exporting_into_a_read_only_directory_keeps_the_old_file(
    tmp_path: Path, shard_queue: Queue
) -> None:
    folder = tmp_path / "ro"
    with contextlib.ExitStack() as stack:
        if os.geteuid() == 0:  # permissions do not stop root: a read-only file system does
            stack.enter_context(_tmpfs(folder, "1m"))
            (folder / "state.bin").write_bytes(OLD)
            remount = ["mount", "-o", "remount,ro", str(folder)]
            subprocess.run(remount, check=True, capture_output=True)
            code = errno.EROFS
        else:
            folder.mkdir()
            (folder / "state.bin").write_bytes(OLD)
            folder.chmod(0o555)
            stack.callback(folder.chmod, 0o755)
            code = errno.EACCES
        dest = folder / "state.bin"

        with pytest.raises(FileAccessError) as info:
            _export(shard_queue, dest)

        _check_error(info.value, dest, code)
        assert dest.read_bytes() == OLD
        assert _temps(folder) == []


def _fill(filler: Path, *, leave: int) -> None:
    """Fill the disk of ``filler``, then free ``leave`` bytes of it."""
    with open(filler, "wb", buffering=0) as out:
        with contextlib.suppress(OSError):
            while True:
                out.write(b"\0" * 65536)
        size = out.tell()
    os.truncate(filler, max(0, size - leave))


@pytest.mark.parametrize("name", ["state.bin", "state.queue"])
def test_exporting_onto_a_full_disk_keeps_the_old_file(
    name: str, tmp_path: Path, shard_queue: Queue
) -> None:
    disk = tmp_path / "full"
    with _tmpfs(disk, "1m"):
        dest = disk / name
        dest.write_bytes(OLD)
        _fill(disk / "filler", leave=64 * 1024)  # less than the state needs, raw or zstd

        with pytest.raises(FileAccessError, match="the disk is full") as info:
            _export(shard_queue, dest)

        _check_error(info.value, dest, errno.ENOSPC)
        assert dest.read_bytes() == OLD
        assert _temps(disk) == []
        (disk / "filler").unlink()
        _export(shard_queue, dest)  # space freed: the same export works
        assert dest.stat().st_size > len(OLD)


def test_a_non_blocking_stream_without_data_is_named(shard_queue: Queue) -> None:
    """A non-blocking stream whose ``read`` returns ``None`` (no data yet) read as an
    empty file: 'truncated at offset 0'."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        with (
            os.fdopen(r, "rb", buffering=0) as stream,
            pytest.raises(FileAccessError, match="non-blocking stream had no data"),
        ):
            shard_queue.import_state(stream, BlockId(BASE, 161))
    finally:
        os.close(w)


class _BufferReader(io.RawIOBase):
    """A binary reader over ``data`` whose ``read(n)`` returns ``shape(up to 3 n bytes)``:
    more than asked, as some wrappers do, and as another buffer type."""

    def __init__(self, data: bytes, shape: type) -> None:
        self._data, self._at, self._shape = data, 0, shape

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> object:  # type: ignore[override]
        size = len(self._data) if n < 0 else 3 * max(n, 1)
        out = self._data[self._at : self._at + size]
        self._at += len(out)
        return self._shape(out)


@pytest.mark.parametrize("shape", [bytes, bytearray, memoryview])
@pytest.mark.parametrize("compressed", [False, True], ids=["raw", "zstd"])
def test_a_reader_returning_more_than_asked_or_another_buffer_imports_the_state(
    tmp_path: Path, shape: type, compressed: bool
) -> None:
    """An outside audit: a reader returning more bytes than asked hid the zstd magic
    ("unknown id 28b52ffd"), and one returning a bytearray or a memoryview failed with
    an untyped ``ValueError`` about a TL field, from a valid state."""
    state = synth_state(diffs=2, messages_per_diff=40)
    buffer = io.BytesIO()
    write_synth_state(state, buffer)
    data = buffer.getvalue()
    if compressed:
        data = zstandard.ZstdCompressor(level=3).compress(data)
    with Queue.open(tmp_path / "q") as queue:
        report = queue.import_state(_BufferReader(data, shape), state.block_id, state.top_update)
    assert report.messages == 80


def test_a_text_reader_that_is_no_text_io_is_told_to_open_the_file_in_binary(
    tmp_path: Path,
) -> None:
    """``codecs.open`` gives a text reader that is no ``io.TextIOBase``: its ``str`` reads
    failed with "can't concat str to bytes"; now a ``TypeError`` says what to do."""
    path = tmp_path / "state.bin"
    state = synth_state(diffs=1, messages_per_diff=3)
    write_synth_state(state, path)
    with Queue.open(tmp_path / "q") as queue, codecs.open(str(path), "r", "latin-1") as text:
        with pytest.raises(TypeError, match=r"binary mode \('rb'\)"):
            queue.import_state(text, state.block_id)
        assert queue.get_commit_pointers() == {}
