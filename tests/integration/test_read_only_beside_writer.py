"""A read-only open beside a live writer: what `imq inspect` and `imq verify` do on a
running node.

RocksDB's read-only open reads the MANIFEST, then the logs; the writer's flushes and
compactions meanwhile delete table files and logs. An outside audit ran `imq inspect` and
`imq verify` beside a writer that compacted after every diff: 4 and 11 of about 100 opens
failed ("Can't access 000123.sst") or read a view torn across tables, which `imq verify`
reported as damage ("50 stored messages belong to no stored diff"). The open is now
tried again while the writer changed its files (``Store._open_read_only``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from builders import (
    BASE,
    Chain,
    damage_largest_table_file,
    full_range,
    open_queue,
    quarter_shards,
    quiet_config,
    run_python,
)

from imq import CorruptDataError, Queue, StorageError
from imq.storage import rocks, shadow
from imq.verify import verify

_HERE = Path(__file__).resolve().parent

# The writer: a diff of 50 messages, then a full compaction, as fast as it can, for
# argv[3] seconds. Every compaction rewrites table files and deletes the old ones; every
# flush (a compaction starts with one) switches the log. It stops early once the file
# argv[4] exists.
_WRITER = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from builders import Clock, address_in, block, diff_hash, messages, quarter_shards, quiet_config
from imq import Queue, QueueDiff
queue = Queue.open(sys.argv[2], quiet_config())
shard, other = quarter_shards()[:2]
clock = Clock(start=10_000_000)
seqno = 0
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline and not os.path.exists(sys.argv[4]):
    seqno += 1
    dsts = [address_in(other, k) for k in range(50)]
    diff = QueueDiff(messages(clock, shard, dsts))
    queue.apply_diff(diff, block(shard, seqno), diff_hash(("w", seqno)))
    queue.compact()
    if seqno == 20:
        print("ready", flush=True)
queue.close()
print("wrote", seqno, flush=True)
"""


@pytest.fixture(params=["in place", "through links"])
def links(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Each test runs twice: the read-only open in the directory itself, and as for a
    directory this process cannot write (another user's node, a read-only mount), where
    RocksDB opens a temporary directory of links to the database's files. Every such
    directory is gone by the end of the test."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    linked: list[Path] = []
    if request.param == "through links":
        monkeypatch.setattr(shadow, "writable_for_rocksdict", lambda path: False)
        real = shadow.Shadow.link

        def link(shadow: Any) -> Path:
            linked.append(real(shadow))
            return linked[-1]

        monkeypatch.setattr(shadow.Shadow, "link", link)
    yield request.param
    assert os.listdir(scratch) == []
    assert bool(linked) == (request.param == "through links")
    assert all(p.parent == scratch for p in linked)


def test_read_only_opens_beside_a_compacting_writer_see_whole_queues(
    tmp_path: Path, links: str
) -> None:
    db = tmp_path / "db"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(_HERE), str(db), "60", str(tmp_path / "stop")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "ready", writer.stderr.read()
        opens = 0
        deadline = time.monotonic() + 8
        # For 8 s, and at least 10 opens while the writer runs: on a loaded machine (the
        # whole suite on 2 cores beside other work) one verify and one open took 2 s.
        while time.monotonic() < deadline or (opens < 10 and writer.poll() is None):
            report = verify(db)
            assert report.ok, report.problems
            with Queue.open(db, read_only=True) as queue:
                summary = queue.summary()
            assert summary["shards"], summary
            opens += 2
        (tmp_path / "stop").touch()
        out, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err
        assert opens >= 10, opens
        assert int(out.split()[-1]) > 20, out  # the writer kept changing its files
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


def test_a_writer_that_never_pauses_ends_the_read_only_open_with_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: str
) -> None:
    """Every attempt torn (a log deleted during each): the open gives up when its time is
    out, with a ``StorageError`` that says what to do, and holds nothing open."""
    db = tmp_path / "db"
    Queue.open(db, quiet_config()).close()
    monkeypatch.setattr(rocks, "_READ_ONLY_BUDGET", 0.3)
    monkeypatch.setattr(rocks, "_no_log_deleted", lambda before, after: False)
    with pytest.raises(
        StorageError, match=r"changed the database's files during each of \d+ attempts in 0\.3 s"
    ) as info:
        Queue.open(db, read_only=True)
    assert "try again, or open a copy" in str(info.value)
    assert _files_open_in(db) == []  # every attempt's RocksDB handle was closed


def _files_open_in(path: Path) -> list[str]:
    fds = Path("/proc/self/fd")
    targets = (os.readlink(fd) for fd in fds.iterdir() if fd.is_symlink())
    return [t for t in targets if t.startswith(str(path))]


# -- the directory of links of an unwritable directory's read-only open (shadow) -------------


def _scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary directory of this test's own: where the directories of links go."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


def _dead_links(scratch: Path, target: Path) -> Path:
    """A directory of links a killed process left, older than the sweep spares."""
    left = scratch / "imq-read-only-1-dead"
    left.mkdir()
    (left / "CURRENT").symlink_to(target / "CURRENT")
    old = time.time() - 2 * shadow._SWEEP_AGE
    os.utime(left, (old, old))
    return left


def test_a_live_views_links_survive_a_sweep_however_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live read-only view holds an ``flock`` on its directory of links, and a sweep
    (another open's: a lock is per open file, so this process's own sweep is refused
    too) leaves it however old it looks, while it removes an unlocked one as old. Without
    the lock, a view that had read for a minute lost its links to the next open."""
    scratch = _scratch(tmp_path, monkeypatch)
    db = tmp_path / "db"
    Queue.open(db, quiet_config()).close()
    live = shadow.Shadow(db)
    try:
        live.link()
        dead = _dead_links(scratch, db)
        old = time.time() - 2 * shadow._SWEEP_AGE
        os.utime(live.path, (old, old))

        shadow._sweep_shadows(str(scratch))

        assert (live.path / "CURRENT").is_symlink()
        assert not dead.exists()
    finally:
        live.remove()
    assert os.listdir(scratch) == []


def test_the_sweep_leaves_another_users_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only this user's dead directories of links are swept: another user's (a shared
    /tmp, where root may remove anything) is theirs. Faked by a different effective uid
    for the sweep: the same directory is swept once the uid is this process's again."""
    scratch = _scratch(tmp_path, monkeypatch)
    left = _dead_links(scratch, tmp_path / "db")
    me = os.geteuid()
    with monkeypatch.context() as m:
        m.setattr(shadow.os, "geteuid", lambda: me + 1)
        shadow._sweep_shadows(str(scratch))
    assert (left / "CURRENT").is_symlink()
    shadow._sweep_shadows(str(scratch))
    assert not left.exists()


def test_an_unwritable_config_file_means_an_open_through_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rocksdict writes its config file at every open, read-only ones too: a directory
    this user may write whose ``rocksdict-config.json`` it may not (another user's file)
    is opened through links as well. As root every open for writing is allowed, so the
    refusal is faked for that file alone; with no file, the directory decides."""
    db = tmp_path / "db"
    Queue.open(db, quiet_config()).close()
    config = db / shadow.ROCKSDICT_CONFIG
    assert config.exists()
    assert shadow.writable_for_rocksdict(db) is True
    real = os.open

    def refusing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if Path(path) == config and config.exists() and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(shadow.os, "open", refusing)
    assert shadow.writable_for_rocksdict(db) is False
    config.unlink()
    assert shadow.writable_for_rocksdict(db) is True


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_config_file_that_is_not_a_file_sends_the_open_through_links(
    tmp_path: Path, kind: str
) -> None:
    """rocksdict writes its config file at every open, through a link too: a database
    whose ``rocksdict-config.json`` is a link (another user's, pointing at a file root
    may write) is opened through links, and its target is left untouched; a FIFO there
    would hang the check's open for writing (no reader): it is not opened."""
    db = tmp_path / "db"
    with open_queue(db) as queue:
        Chain(queue).apply(BASE)
    config = db / shadow.ROCKSDICT_CONFIG
    config.unlink()
    target = tmp_path / "elsewhere"
    if kind == "link":
        target.write_text("not rocksdict's")
        config.symlink_to(target)
    else:
        os.mkfifo(config)
    assert shadow.writable_for_rocksdict(db) is False
    with Queue.open(db, read_only=True) as viewer:
        assert viewer.get_last_applied_seqno(BASE) == 1
        assert viewer._store._shadow is not None  # through links
    if kind == "link":
        assert target.read_text() == "not rocksdict's"
    assert config.is_symlink() == (kind == "link")


LANDLOCKED = """
import ctypes, os, struct, sys, tempfile
from pathlib import Path
from imq import Queue
libc = ctypes.CDLL(None, use_errno=True)
CREATE, ADD_RULE, RESTRICT = 444, 445, 446  # the landlock syscalls (x86-64, arm64 alike)
abi = libc.syscall(CREATE, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
if abi < 1:
    print("unsupported"); sys.exit(0)
# every write right Landlock knows: write_file, remove_*, make_*, (truncate from ABI 3)
writes = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12)) | ((1 << 14) if abi >= 3 else 0)
attr = struct.pack("=Q", writes)
ruleset = libc.syscall(CREATE, attr, len(attr), 0)
assert ruleset >= 0, ctypes.get_errno()
for allowed in (tempfile.gettempdir(), "/dev"):  # writes allowed there only
    fd = os.open(allowed, os.O_PATH)
    assert libc.syscall(ADD_RULE, ruleset, 1, struct.pack("=Qi", writes, fd), 0) == 0
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.syscall(RESTRICT, ruleset, 0) == 0, ctypes.get_errno()
path = Path(sys.argv[1])
try:
    (path / "probe").write_text("")
    print("not confined")
except PermissionError:
    with Queue.open(path, read_only=True) as queue:
        print("opened", queue.get_last_committed_mc_block_id())
"""


def test_a_confined_reader_opens_through_links(tmp_path: Path) -> None:
    """A reader confined by a security module (here Landlock: no writes outside the
    temporary directory), whose user may write the database by its mode bits: an open
    of rocksdict's config file for writing is refused although ``access()`` allows it.
    The read-only open goes through links (an outside audit found it failing with "a
    file of the database cannot be read", since ``access()`` alone decided)."""
    db = tmp_path / "db"
    Queue.open(db, quiet_config()).close()
    db.parent.chmod(0o755)
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    done = run_python(LANDLOCKED, str(db), env=env)
    if done.stdout.strip() == "unsupported":
        pytest.skip("this kernel has no Landlock")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "opened None", done.stdout


def test_an_error_read_through_links_names_the_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RocksDB names the files it reads as it opened them: through the links, in the
    private temporary directory, gone at close. A read-only view's error (here a damaged
    table's) names the database's own files instead, which the user can find and repair."""
    scratch = _scratch(tmp_path, monkeypatch)
    db = tmp_path / "db"
    shards = quarter_shards()
    with Queue.open(db, quiet_config()) as queue:
        chain = Chain(queue)
        for _ in range(3):
            for s in shards:
                chain.apply(s, 20)
        queue.compact()
    damaged = damage_largest_table_file(db)
    monkeypatch.setattr(shadow, "writable_for_rocksdict", lambda path: False)
    with pytest.raises(CorruptDataError) as info, Queue.open(db, read_only=True) as queue:
        assert len(os.listdir(scratch)) == 1  # read through links
        with queue.iterator(0, [full_range(s) for s in shards], BASE) as it:
            list(it)
    assert str(damaged) in str(info.value)
    assert "imq-read-only-" not in str(info.value)
    assert os.listdir(scratch) == []
