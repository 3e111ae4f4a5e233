"""A full disk during apply, commit, clear, GC, import and export.

The queue lives on a small tmpfs (mounted by the test: CI runs as root). Where mounting
is not allowed the same faults are injected: the database's write raises RocksDB's
``IO error: No space left on device``. Each test fills the disk, runs one operation and
checks: a typed ``StorageError``, the handle dead (later calls say so), ``close()``
releasing the directory without raising, and, once space is freed and the queue reopened
in the same process, the state exactly as before the failed call and the call working.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from builders import (
    BASE,
    MC,
    Chain,
    Clock,
    block,
    diff_hash,
    full_range,
    iterate_all,
    make_diff,
    messages,
    open_queue,
    quarter_shards,
    quiet_config,
    state,
    top,
)
from cli_runner import Imq
from state_fixtures import write_state

from imq import Queue
from imq.errors import StorageError
from imq.state.synth import synth_state

SHARDS = quarter_shards()
NO_GC = quiet_config(gc_enabled=False)  # no GC pass at open: the state must stay as it was
ROUNDS = 4


class Disk:
    """A small disk that can be filled and freed: a real tmpfs, or injected faults."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mounted = False
        self.full = False
        root.mkdir()
        if os.geteuid() == 0 and not os.environ.get("IMQ_TEST_INJECT_ENOSPC"):
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(root)],
                capture_output=True,
                check=False,
            )
            self.mounted = done.returncode == 0

    def fill(self, queue: Queue) -> None:
        self.full = True
        if not self.mounted:
            store = queue._store
            store._db = _Faulty(store._db, self)
            return
        with open(self.root / "filler", "ab") as out:
            chunk = b"\0" * (1 << 16)
            try:
                while True:
                    out.write(chunk)
                    out.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC

    def free(self) -> None:
        self.full = False
        with contextlib.suppress(FileNotFoundError):
            (self.root / "filler").unlink()

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.root)], check=False)


class _Faulty:
    """The injected fault: the database's write fails while the disk is 'full'."""

    def __init__(self, db: Any, disk: Disk) -> None:
        self._db = db
        self._disk = disk

    def write(self, *args: Any) -> None:
        if self._disk.full:
            raise Exception("IO error: No space left on device (injected)")
        self._db.write(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


class _FullFile(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    d = Disk(tmp_path / "disk")
    try:
        yield d
    finally:
        d.unmount()


def _setup(queue: Queue) -> Chain:
    """Four shards with ``ROUNDS`` diffs each, every diff processing the previous round,
    masterchain blocks on top; the first two rounds committed (so GC has work)."""
    chain = Chain(queue)
    previous: dict[Any, Any] = {}
    for _ in range(ROUNDS):
        current = {s: chain.apply(s, 30, processed_to=previous) for s in SHARDS}
        chain.apply(MC, 0, processed_to=previous)
        previous = {s: a.max_message for s, a in current.items()}
    queue.commit_diff(_tops(chain, 2))
    return chain


def _tops(chain: Chain, seqno: int) -> list[Any]:
    return [top(MC, seqno)] + [
        a.top(seqno) for a in chain.applied if a.seqno == seqno and a.shard != MC
    ]


def _observed(queue: Queue) -> Any:
    return (state(queue, [*SHARDS, MC, BASE]), iterate_all(queue, [*SHARDS, BASE]))


def _apply(queue: Queue, chain: Chain, tmp: Path) -> Any:
    msgs = messages(Clock(start=1_000_000), SHARDS[0], 200, body=b"x" * 200)
    return queue.apply_diff(make_diff(msgs), block(SHARDS[0], ROUNDS + 1), diff_hash("big"))


def _commit(queue: Queue, chain: Chain, tmp: Path) -> Any:
    return queue.commit_diff(_tops(chain, 3))


def _clear(queue: Queue, chain: Chain, tmp: Path) -> Any:
    return queue.clear_uncommitted_state(top_shards=SHARDS)


def _gc(queue: Queue, chain: Chain, tmp: Path) -> Any:
    assert queue.gc_bounds()[0], "the setup leaves GC work"
    return queue.run_gc()


def _import(queue: Queue, chain: Chain, tmp: Path) -> Any:
    synth = synth_state(diffs=3, messages_per_diff=400, body_bytes=300, seed=3)
    path, _ = write_state(synth, tmp / "in.bin")
    return queue.import_state(path, synth.block_id, synth.top_update)


OPERATIONS: dict[str, Callable[[Queue, Chain, Path], Any]] = {
    "apply": _apply,
    "commit": _commit,
    "clear": _clear,
    "gc": _gc,
    "import": _import,
}


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_full_disk_fails_cleanly_and_a_reopen_recovers(
    disk: Disk, tmp_path: Path, name: str
) -> None:
    op = OPERATIONS[name]
    path = disk.root / "db"
    queue = Queue.open(path, NO_GC)
    chain = _setup(queue)
    before = _observed(queue)
    disk.fill(queue)
    with pytest.raises(StorageError) as info:
        op(queue, chain, tmp_path)
    assert str(path) in str(info.value)
    assert "open it again" in str(info.value)
    assert "the disk is full: free space" in str(info.value)
    if name == "import":  # the disk filled after the import began to write
        assert "the import had written part of the state" in str(info.value), info.value
    # The handle is dead: every later call says so, even once space is back.
    disk.free()
    with pytest.raises(StorageError, match="dead"):
        chain.apply(SHARDS[1], 1)
    queue.close()  # never raises, releases the directory
    queue.close()  # idempotent
    assert queue.closed

    again = Queue.open(path, NO_GC)  # same process: the directory is free
    try:
        if name != "gc":  # GC writes one batch per shard: the ones before the fault stay
            assert _observed(again) == before, "a failed call left something behind"
        chain.queue = again
        op(again, chain, tmp_path)  # works now
        assert _observed(again) == _reference(tmp_path, name)
    finally:
        again.close()


def _reference(tmp_path: Path, name: str) -> Any:
    """The same calls on a disk that never filled."""
    queue = Queue.open(tmp_path / "reference", NO_GC)
    try:
        OPERATIONS[name](queue, _setup(queue), tmp_path)
        return _observed(queue)
    finally:
        queue.close()


def test_export_to_a_full_disk_leaves_no_file_and_the_queue_usable(
    disk: Disk, tmp_path: Path
) -> None:
    queue = open_queue(tmp_path / "db")  # the database itself is not on the full disk
    try:
        synth = synth_state(diffs=3, messages_per_diff=300, body_bytes=300, seed=4)
        src, _ = write_state(synth, tmp_path / "in.bin")
        queue.import_state(src, synth.block_id, synth.top_update)
        dest = disk.root / "state.bin"
        with pytest.raises(OSError) as info:
            if disk.mounted:
                disk.fill(queue)
                queue.export_state(BASE, synth.seqno, 3, dest)
            else:  # injected: a destination that refuses every write
                queue.export_state(BASE, synth.seqno, 3, _FullFile())
        assert info.value.errno == errno.ENOSPC
        assert sorted(os.listdir(disk.root)) == (["filler"] if disk.mounted else [])
        disk.free()
        report = queue.export_state(BASE, synth.seqno, 3, dest)
        assert report.messages == 900
    finally:
        queue.close()


def test_imq_import_on_a_full_disk_says_what_an_operator_does(
    disk: Disk, tmp_path: Path, imq: Imq
) -> None:
    """A user audit: on a full disk `imq import` removed the directory it had created,
    then told the operator to close the queue and reopen it so that the open rolls the
    import back. It says what is left to do: free space, import again."""
    if not disk.mounted:
        pytest.skip("needs a small tmpfs (root): the command's own RocksDB must hit ENOSPC")
    synth = synth_state(diffs=2, messages_per_diff=2_000, body_bytes=600, seed=5)
    src, _ = write_state(synth, tmp_path / "in.bin")
    with open(disk.root / "filler", "wb") as out:  # leave about 1 MB free
        out.write(b"\0" * (23 << 20))
    db = disk.root / "db"
    run = imq("import", db, src, "--block-id", str(synth.block_id), "--no-progress")
    assert run.code == 1, run
    (line,) = run.err.strip().splitlines()[-1:]
    assert "the directory this import created was removed" in line, line
    assert "run the import again" in line and "close the queue" not in line, line
    assert not db.exists()
    # Into an empty directory given to it: the database goes, the directory stays.
    db.mkdir()
    run = imq("import", db, src, "--block-id", str(synth.block_id), "--no-progress")
    assert run.code == 1, run
    (line,) = run.err.strip().splitlines()[-1:]
    assert f"the database this import created in {db} was removed" in line, line
    assert "run the import again" in line and "close the queue" not in line, line
    assert list(db.iterdir()) == []


def test_a_compaction_on_a_full_disk_raises_instead_of_reporting_success(disk: Disk) -> None:
    """rocksdict's ``compact_range`` returns no error: ``compact()`` returned a report of
    success on a full disk and the next write failed (an outside audit). RocksDB's count
    of background errors tells; the handle is dead as after a failed write, and a reopen
    once space is back holds every message."""
    if not disk.mounted:
        pytest.skip("needs a real tmpfs (root): an injected write fault cannot fail a compaction")
    path = disk.root / "db"
    config = quiet_config(gc_enabled=False, write_buffer_size=512 * 1024, message_cache_size=0)
    queue = Queue.open(path, config)
    chain = Chain(queue)
    for i in range(24):
        chain.apply(SHARDS[i % 4], 300, body=bytes(range(200)))
    disk.fill(queue)
    with pytest.raises(StorageError, match="during compaction: IO error: No space left") as info:
        queue.compact()
    assert "the disk is full: free space" in str(info.value)
    with pytest.raises(StorageError, match="dead"):
        chain.apply(SHARDS[0], 1)
    queue.close()
    disk.free()
    with Queue.open(path, config) as again:
        for shard in SHARDS:
            assert sum(1 for _ in again.iterator(0, [full_range(shard)], BASE)) == 6 * 300
        assert again.compact().bytes_after > 0
