"""Power loss: what the disk holds after it, not what the page cache held.

A SIGKILL (``test_crash.py``) keeps every byte the process wrote: the kernel writes it
back later. A power loss keeps only what was synced. imq promises (``docs/
reliability.md``) that a commit which returned survives it with every diff before it,
and that whatever survives is a state the queue passed through: the writes up to some
point, never a mixture. This test checks that promise on real files, without a special
file system or a kernel module:

1. The writer (``crash_child.py``, the crash campaign's random mix of applies, prepared
   diffs, commits, clears, GC and imports) runs with ``powerloss_shim.c`` preloaded,
   which copies every file at each successful ``fsync``/``fdatasync`` and lists the
   directory at each fsync of the directory (POSIX's whole promise about a crash).
2. The writer is killed at a random moment. The directory a power loss would have left
   is built from the records alone: each name of the last listing, holding its file's
   last synced content (empty if never synced). Anything written but not synced is gone.
3. The queue opens there, and the crash campaign's checker must accept the database as
   the state after some prefix of the child's operations, no shorter than its last
   acknowledged synced one (a commit or an import), with no diff of a later call
   stored. The next round runs on that directory.

A second campaign rebuilds a disk that also kept part of what was not synced (each
appended file cut at any byte, some of its pages zeros; ``_written_back``), the open
after it seeing a new boot of the machine. Targeted tests cover a new queue's
directories, an export and an import cut by the power loss, and a log garbled after
or before its last fsync, with and without a restart.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from builders import MC, Clock, block, diff_hash, make_diff, messages, quiet_config, top
from test_corruption import _copy_live, _files, _flip
from test_crash import HERE, Model, _lts, _run_child, _stored_max, check
from test_state_crash import (
    Child,
    Crash,
    assert_rolled_back,
    build_prior,
    make_crash_state,
    marker,
    reaped_children,
    start_child,
)

from imq import DiffZone, Queue, QueueDiff, QueueKey, QueueShardRange, ShardIdent
from imq.errors import StorageError
from imq.storage import rocks
from imq.verify import verify

SHIM_SOURCE = HERE / "powerloss_shim.c"
SYNCED_OPS = ('"op": "commit"', '"op": "import"')

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="the recorder reads /proc and uses statx"),
    pytest.mark.skipif(
        shutil.which("cc") is None, reason="no C compiler to build the power-loss recorder"
    ),
]


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shim") / "powerloss_shim.so"
    subprocess.run(
        ["cc", "-O1", "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(out), str(SHIM_SOURCE)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


def _recorder(shim: Path, watch: Path, shadow: Path) -> dict[str, str]:
    """The environment that preloads the recorder, watching ``watch``."""
    return {"LD_PRELOAD": str(shim), "IMQ_PL_WATCH": str(watch), "IMQ_PL_SHADOW": str(shadow)}


def _env(shim: Path, watch: Path, shadow: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **_recorder(shim, watch, shadow)}


def _seed(shim: Path, db: Path, shadow: Path) -> None:
    """Record what is already on disk as synced: a round starts from the directory the
    previous power loss left, whose files are the disk's."""
    script = (
        "import os, sys\n"
        "d = sys.argv[1]\n"
        "for name in sorted(os.listdir(d)):\n"
        "    fd = os.open(os.path.join(d, name), os.O_RDONLY)\n"
        "    os.fsync(fd)\n"
        "    os.close(fd)\n"
        "fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.fsync(fd)\n"
        "os.close(fd)\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(db)],
        env=_env(shim, db, shadow),
        check=True,
        timeout=60,
    )


PAGE = 4096


def _written_back(synced: bytes, live: bytes, rng: random.Random) -> bytes:
    """What a disk may hold of a file the writer appended to after its last sync: the
    synced bytes, then some of the unsynced tail, as the kernel's write-back left it.
    The tail is cut at any byte (a write torn mid-record), and each of its pages is on
    the disk or not: a page that did not make it, below the end, reads as zeros."""
    tail = live[len(synced) :]
    kept = bytearray(tail[: rng.randint(0, len(tail))])
    if rng.random() < 0.5:
        first = -len(synced) % PAGE  # the tail's bytes up to the next page boundary
        for at in range(first, len(kept), PAGE):
            if rng.random() < 0.3:
                end = min(at + PAGE, len(kept))
                kept[at:end] = bytes(end - at)
    return synced + bytes(kept)


def _rebuild(
    shadow: Path, ident: str, out: Path, live: Path, rng: random.Random | None = None
) -> int:
    """Fill the directory ``out`` as a power loss leaves the directory ``ident`` (whose
    page-cache view is ``live``): its last synced listing, each file with its last
    synced content (empty if never synced), each directory likewise. With ``rng``, the
    disk also kept some of what was not synced (``_written_back``; a file rewritten in
    place: its synced or its newest content). The number of entries whose rebuilt form
    differs from the live one (data lost)."""
    listing = shadow / f"{ident}.dir"
    live_names = set(os.listdir(live)) if live.is_dir() else set()
    if not listing.exists():
        return len(live_names)
    lost = 0
    kept = set()
    for line in listing.read_text().splitlines():
        entry, kind, name = line.split(" ", 2)
        kept.add(name)
        if kind == "d":
            (out / name).mkdir()
            lost += _rebuild(shadow, entry, out / name, live / name, rng)
            continue
        synced = shadow / entry
        data = synced.read_bytes() if synced.exists() else b""
        now = live / name
        same = now.is_file() and str(now.stat().st_ino) == entry.split("-", 1)[0]
        current = now.read_bytes() if same else None
        if rng is not None and current is not None and current != data:
            if current.startswith(data):
                data = _written_back(data, current, rng)
            elif rng.random() < 0.5:
                data = current
        (out / name).write_bytes(data)
        if current != data:
            lost += 1
    return lost + len(live_names - kept)


def _after_power_loss(db: Path, shadow: Path, out: Path, rng: random.Random | None = None) -> int:
    """Build in ``out`` the directory a power loss leaves of ``db`` (with ``rng``: a disk
    that also kept some unsynced writes); the number of entries whose content differs
    from what the page cache held (data lost)."""
    out.mkdir()
    root = shadow / "root"
    if not root.exists():  # nothing was ever synced below it
        return len(os.listdir(db))
    return _rebuild(shadow, root.read_text().strip(), out, db, rng)


def _cuts(lines: list[str]) -> list[list[str]]:
    """Every history the database may show after a power loss, longest first: the
    child's lines up to some point at or after its last acknowledged synced operation
    (a trailing ``B`` line is an operation in flight, whole or absent)."""
    synced = max(
        (
            i
            for i, line in enumerate(lines)
            if line.startswith("A ") and any(s in line for s in SYNCED_OPS)
        ),
        default=0,
    )
    ends = [k for k in range(len(lines), synced, -1) if lines[k - 1][:2] in ("A ", "B ", "re")]
    return [lines[:k] for k in ends]


def _nothing_after(queue: Queue, later: list[str]) -> None:
    """No diff the writer began after the cut is stored (``check`` looks only at what
    the history before the cut holds): a state with a hole (an operation lost, a later
    one kept) is no prefix. An operation begun inside the cut (its ``A`` line after it)
    was in flight there, and ``check`` judged it."""
    for line in later:
        if not line.startswith("B "):
            continue
        ev = json.loads(line[2:])
        if ev["op"] in ("apply", "prepare_write"):
            stored = _stored_max(queue, ev["shard"], ev["seqno"])
            assert stored != ev["max"], (
                f"diff {ev['shard']}:{ev['seqno']} of a later call is stored"
            )


def _matching_cut(queue: Queue, model: Model, lines: list[str]) -> tuple[Model, int]:
    """The model after the longest history the database is, and how many operations
    past it were acknowledged but lost (not synced)."""
    failures = []
    acked = sum(1 for line in lines if line.startswith("A "))
    for cut in _cuts(lines):
        candidate = copy.deepcopy(model)
        try:
            check(queue, candidate, cut)
            _nothing_after(queue, lines[len(cut) :])
        except AssertionError as exc:
            failures.append(f"{len(cut)} lines: {exc}")
            continue
        return candidate, acked - sum(1 for line in cut if line.startswith("A "))
    raise AssertionError(
        "the database after the power loss is no state the writer passed through at or "
        "after its last synced operation:\n" + "\n".join(failures[:8])
    )


def _campaign(  # noqa: PLR0917 - the campaign's settings
    shim: Path,
    tmp_path: Path,
    rounds: int,
    seed: int,
    unsynced: bool = False,
    written_back: bool = False,
) -> dict[str, int]:
    rng = random.Random(seed)
    db = tmp_path / "db0"
    db.mkdir()
    model = Model()
    min_lt = 0
    totals = {"rounds": rounds, "acked": 0, "lost_ops": 0, "lost_files": 0}
    for i in range(rounds):
        shadow = tmp_path / f"shadow{i}"
        shadow.mkdir()
        _seed(shim, db, shadow)
        lines = _run_child(
            db,
            seed * 100_000 + i,
            rng,
            min_lt,
            extra_env={
                **_recorder(shim, db, shadow),
                "IMQ_CRASH_UNSYNCED": "1" if unsynced else "0",
            },
            window=(0.05, 0.6),
        )
        min_lt = max([min_lt, *_lts(lines)])
        after = tmp_path / f"db{i + 1}"
        disk = random.Random(rng.random()) if written_back else None
        totals["lost_files"] += _after_power_loss(db, shadow, after, disk)
        shutil.rmtree(db)
        shutil.rmtree(shadow)
        db = after
        # The power came back: a new boot of the machine, as the open sees it.
        boot = f"00000000-0000-4000-8000-{i:012d}"
        with mock.patch.object(rocks, "_boot_id", lambda boot=boot: boot):
            queue = Queue.open(db, quiet_config(gc_enabled=False))
        try:
            model, lost = _matching_cut(queue, model, lines)
        finally:
            queue.close()
        totals["acked"] += sum(1 for line in lines if line.startswith("A "))
        totals["lost_ops"] += lost
    report = verify(db)
    assert report.ok, report.problems
    return totals


def test_power_loss_campaign(shim: Path, tmp_path: Path) -> None:
    totals = _campaign(shim, tmp_path, 12, seed=1)
    assert totals["acked"] > totals["rounds"]
    # The power loss did take something away, so the test is about power loss at all.
    assert totals["lost_files"] > 0, totals


def test_the_prefix_search_on_a_kill_without_power_loss(tmp_path: Path) -> None:
    """A SIGKILL keeps everything: the search must settle on the whole history (nothing
    lost), and a diff of a call after a shorter cut must be seen as stored."""
    db = tmp_path / "db"
    lines = _run_child(db, 5, random.Random(5), window=(0.5, 0.8))
    with Queue.open(db, quiet_config(gc_enabled=False)) as queue:
        _model, lost = _matching_cut(queue, Model(), lines)
        assert lost == 0
        stored = [
            line
            for line in lines
            if line.startswith("A ")
            and (ev := json.loads(line[2:]))["op"] in ("apply", "prepare_write")
            and _stored_max(queue, ev["shard"], ev["seqno"]) == ev["max"]
        ]
        assert stored, "the child left no applied diff"
        began = "B " + stored[-1][2:]
        with pytest.raises(AssertionError, match="of a later call is stored"):
            _nothing_after(queue, [began])


def test_power_loss_with_unsynced_writes_partly_on_disk(shim: Path, tmp_path: Path) -> None:
    """The disk also kept some of what was not synced, as write-back left it: each log's
    unsynced end cut at any byte, some of its pages zeros (``_written_back``). About 1
    in 10 to 20 such power losses leaves a log RocksDB's strict recovery refuses; the open
    after the restart replays it up to the damage, and the state is still a prefix."""
    totals = _campaign(shim, tmp_path, 20, seed=3, written_back=True)
    assert totals["acked"] > totals["rounds"]


def test_power_loss_checker_sees_a_lost_commit(shim: Path, tmp_path: Path) -> None:
    """The control: the same campaign with commits that are not fsynced
    (``sync_commits=False``). A power loss then takes acknowledged commits away, and the
    checker must refuse the state. Were the recorder to keep unsynced data, or the
    checker to accept any state, this would pass the campaign instead."""
    with pytest.raises(AssertionError, match="no state the writer passed through"):
        _campaign(shim, tmp_path, 12, seed=1, unsynced=True)


def _until_said(
    shim: Path, watch: Path, shadow: Path, script: str, word: str, *args: str
) -> list[str]:
    """Run ``script`` (with ``args`` after its two own) with the recorder watching
    ``watch``; SIGKILL it once it printed a line starting with ``word`` (the call before
    it returned), as a power loss would stop the machine. The line's words."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(HERE), str(watch), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(shim, watch, shadow),
    )
    assert proc.stdout is not None
    try:
        said = proc.stdout.readline().decode().split()
    finally:
        proc.kill()
        _out, err = proc.communicate(timeout=60)
    assert said[:1] == [word], err.decode(errors="replace")[-3000:]
    return said


def _power_lost_after(shim: Path, tmp_path: Path, script: str, word: str) -> tuple[Path, Path]:
    """Run ``script`` on a fresh watched directory until it says ``word``, cut the
    power; the watched directory (as the page cache holds it) and the rebuilt one."""
    watch, shadow, after = tmp_path / "disk", tmp_path / "shadow", tmp_path / "after"
    watch.mkdir()
    shadow.mkdir()
    _until_said(shim, watch, shadow, script, word)
    _after_power_loss(watch, shadow, after)
    return watch, after


CREATE = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from builders import MC, block, diff_hash, make_diff, messages, Clock, quiet_config, top
from imq import Queue, QueueDiff, QueueKey, ShardIdent
shard = ShardIdent(0, 0x8000_0000_0000_0000)
config = quiet_config(gc_enabled=False, sync_commits=True)  # testing() does not fsync
queue = Queue.open(Path(sys.argv[2]) / "new" / "db", config)
queue.apply_diff(make_diff(messages(Clock(), shard, 25)), block(shard, 1), diff_hash("d"))
empty = QueueDiff(min_key=QueueKey.MIN, max_key=QueueKey.MIN)
queue.apply_diff(empty, block(MC, 1), diff_hash("mc"))
queue.commit_diff([top(MC, 1), top(shard, 1, 1)])
print("committed", flush=True)
import time
time.sleep(600)
"""


def test_a_new_queues_directory_survives_a_power_loss(shim: Path, tmp_path: Path) -> None:
    """A queue created in directories that did not exist, one commit, then the power
    goes. RocksDB syncs its files, and each directory it writes them to, but not the
    new directories' entries in their parents: before imq synced those (``Queue.open``
    of a new path), the rebuilt tree held no queue at all, and the commit that had
    returned was gone with it."""
    _watch, after = _power_lost_after(shim, tmp_path, CREATE, "committed")
    assert (after / "new" / "db").is_dir(), "the new queue's directory did not survive"
    with Queue.open(after / "new" / "db", quiet_config(gc_enabled=False)) as queue:
        block_id = queue.get_last_committed_mc_block_id()
        assert block_id is not None and block_id.seqno == 1
        shard = ShardIdent(0, 0x8000_0000_0000_0000)
        assert queue.get_last_applied_seqno(shard) == 1
        assert queue.get_diffs_tail_len(shard, QueueKey.MIN) == 1
        everything = [QueueShardRange(shard, QueueKey.MIN, QueueKey.MAX)]
        with queue.iterator(0, everything, shard) as it:
            assert len(list(it)) == 25


EXPORT = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, str(Path(sys.argv[1]).parent))
from state_fixtures import write_state
from builders import MC, Clock, block, diff_hash, make_diff, messages, quiet_config, top
from imq import DiffZone, Queue, QueueDiff, QueueKey, QueueShardRange, ShardIdent
from imq.errors import StorageError
from imq.storage import rocks
from imq.state.synth import synth_state
out = Path(sys.argv[2])
state = synth_state(diffs=3, messages_per_diff=50, seed=4)
source = out.parent / "source.bin"  # outside the watched directory
write_state(state, source)
with Queue.open(out.parent / "db", quiet_config(gc_enabled=False)) as queue:
    queue.import_state(source, state.block_id, state.top_update)
    queue.export_state(state.shard, state.seqno, len(state.diffs), out / "state.bin")
print("exported", flush=True)
import time
time.sleep(600)
"""


def test_an_exported_state_survives_a_power_loss(shim: Path, tmp_path: Path) -> None:
    """``export_state`` returned, then the power went: the file must be there, whole.
    The export synced the file before renaming it into place, but not the directory
    that holds the new name; before it did, the rebuilt directory held no state."""
    watch, after = _power_lost_after(shim, tmp_path, EXPORT, "exported")
    assert sorted(os.listdir(after)) == ["state.bin"]
    assert (after / "state.bin").read_bytes() == (watch / "state.bin").read_bytes()


def _torn_after_commit(tmp_path: Path, synced_part: bool) -> tuple[Path, int]:
    """A crash image of a queue whose log holds a synced commit, then unsynced diffs,
    with 48 bytes garbled: in the unsynced end (what a power loss can leave), or, with
    ``synced_part``, before the commit (what only a storage fault can). The image and
    the committed masterchain seqno."""
    path = tmp_path / "db"
    shard = ShardIdent(0, 0x8000_0000_0000_0000)
    queue = Queue.open(path, quiet_config(gc_enabled=False, sync_commits=True))
    clock = Clock()
    for seqno in (1, 2):
        queue.apply_diff(
            make_diff(messages(clock, shard, 40)), block(shard, seqno), diff_hash(seqno)
        )
        empty = QueueDiff(min_key=QueueKey.MIN, max_key=QueueKey.MIN)
        queue.apply_diff(empty, block(MC, seqno), diff_hash(("mc", seqno)))
        queue.commit_diff([top(MC, seqno), top(shard, seqno, seqno)])
    (log,) = _files(path, ".log")
    synced = (path / log).stat().st_size  # the commit's fsync covered the log up to here
    for seqno in range(3, 9):  # applied, never committed: not synced
        queue.apply_diff(
            make_diff(messages(clock, shard, 40)), block(shard, seqno), diff_hash(seqno)
        )
    image = tmp_path / "image"
    _copy_live(queue, path, image)
    queue.close()
    size = (image / log).stat().st_size
    assert size - synced > 6 * 40 * 100, "the unsynced diffs are not in this log"
    _flip(image / log, synced // 2 if synced_part else synced + (size - synced) // 3)
    return image, 2


def _restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees another boot of the machine than the queue's last writer did."""
    monkeypatch.setattr(rocks, "_boot_id", lambda: "00000000-0000-4000-8000-000000000001")


def test_a_log_torn_after_its_last_fsync_is_refused_without_a_restart(tmp_path: Path) -> None:
    """No restart since the queue's last writer: nothing but a storage fault can have
    garbled the log, so the open refuses it, as every damaged log."""
    image, _ = _torn_after_commit(tmp_path, synced_part=False)
    with pytest.raises(StorageError, match="Corruption"):
        Queue.open(image, quiet_config(gc_enabled=False))


def test_a_read_only_open_of_a_torn_log_names_the_writers_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only open (``imq verify``, ``inspect``) cannot write the replay: it refuses
    the log, and says that after a power loss a writer's open replays it."""
    image, _ = _torn_after_commit(tmp_path, synced_part=False)
    _restarted(monkeypatch)
    with pytest.raises(StorageError, match="Corruption") as refused:
        Queue.open(image, read_only=True)
    assert "open it for writing first" in refused.value.hint


def test_a_log_torn_after_its_last_fsync_opens_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: list[MutableMapping[str, Any]]
) -> None:
    """After a restart (a power loss, which on some file systems leaves the unsynced end
    of a log torn: about 1 in 10 to 20 of the simulated power losses with partial
    write-back), the writer's open replays the log up to the damage and says so.
    Refused before, the node could not start again without rebuilding its queue. The
    commit is whole."""
    image, committed = _torn_after_commit(tmp_path, synced_part=False)
    _restarted(monkeypatch)
    with Queue.open(image, quiet_config(gc_enabled=False)) as queue:
        block_id = queue.get_last_committed_mc_block_id()
        assert block_id is not None and block_id.seqno == committed
        shard = ShardIdent(0, 0x8000_0000_0000_0000)
        applied = queue.get_last_applied_seqno(shard)
        assert applied is not None and committed <= applied < 8  # the damaged end dropped
    (note,) = [e for e in logs if e["event"] == "write_ahead_log_not_replayed_in_full"]
    assert "replayed up to its first damaged record" in note["detail"]
    # The replay made the log whole again: the next open needs no restart to pass.
    monkeypatch.undo()
    with Queue.open(image, quiet_config(gc_enabled=False)) as queue:
        assert queue.get_last_applied_seqno(shard) == applied


def test_a_log_garbled_before_its_last_fsync_is_refused_even_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Damage before a synced commit is no power loss's doing: the replay would end
    short of the synced writes the mark names, and the open refuses it."""
    image, _ = _torn_after_commit(tmp_path, synced_part=True)
    _restarted(monkeypatch)
    with pytest.raises(StorageError, match="had been synced to disk"):
        Queue.open(image, quiet_config(gc_enabled=False))


MARKED = """
import sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from builders import MC, block, diff_hash, make_diff, messages, Clock, quiet_config, top
from imq import Queue, QueueDiff, QueueKey, ShardIdent
from imq.storage import rocks
path = Path(sys.argv[2]) / "db"
shard = ShardIdent(0, 0x8000_0000_0000_0000)
queue = Queue.open(path, quiet_config(gc_enabled=False, sync_commits=True))
clock = Clock()
ends = []
idle = sys.argv[3] == "idle"
if idle:  # the second commit surely comes before the first's mark is due
    rocks.MARK_SYNC_INTERVAL = 3.0
for seqno in (1, 2):
    if seqno == 2 and not idle:
        time.sleep(rocks.MARK_SYNC_INTERVAL + 0.1)  # the mark's last fsync is that old
    queue.apply_diff(make_diff(messages(clock, shard, 40)), block(shard, seqno), diff_hash(seqno))
    empty = QueueDiff(min_key=QueueKey.MIN, max_key=QueueKey.MIN)
    queue.apply_diff(empty, block(MC, seqno), diff_hash(("mc", seqno)))
    queue.commit_diff([top(MC, seqno), top(shard, seqno, seqno)])
    (log,) = sorted(path.glob("*.log"))
    ends.append(log.stat().st_size)
if idle:  # the second commit came too soon to sync the mark: the queue then sits idle
    timer = queue._store._mark_timer
    assert timer is not None, "the second commit's mark was synced at once"
    timer.join(60)  # until the timer has run (its fsync is what the test is about)
    assert not timer.is_alive()
print("committed", queue._store._db.latest_sequence_number(), log.name, *ends, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("timing", ["apart", "idle"])
def test_the_mark_of_synced_writes_survives_a_power_loss(
    shim: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, timing: str
) -> None:
    """Two commits, then the power goes, then a storage fault garbles the log between
    the two commits (inside its synced part). The mark of synced writes is synced at most
    once a second: at the second commit when they are a second apart (``apart``), or by
    the mark's timer a second after the first when the second comes at once and the queue
    then sits idle (``idle``). Either way the rebuilt disk's mark names the second
    commit, and the open after the restart refuses the replay that would end before it.
    Before the mark was synced only at close, the rebuilt disk had none; before the timer,
    an idle queue's mark named the first commit: either way the open replayed the log up
    to the damage and lost the second commit, which had returned, without a word."""
    watch, shadow, after = tmp_path / "disk", tmp_path / "shadow", tmp_path / "after"
    watch.mkdir()
    shadow.mkdir()
    said = _until_said(shim, watch, shadow, MARKED, "committed", timing)
    sequence, log, first_end, second_end = int(said[1]), said[2], int(said[3]), int(said[4])
    _after_power_loss(watch, shadow, after)
    db = after / "db"
    assert rocks.read_synced_mark(db) == sequence, "the mark lags the synced commit"
    assert (db / log).stat().st_size == second_end  # the commit's fsync covered its log
    intact = tmp_path / "intact"
    shutil.copytree(db, intact)
    _flip(db / log, (first_end + second_end) // 2)
    _restarted(monkeypatch)
    with pytest.raises(StorageError, match="had been synced to disk"):
        Queue.open(db, quiet_config(gc_enabled=False))
    # The same disk without the fault opens whole after the restart.
    with Queue.open(intact, quiet_config(gc_enabled=False)) as queue:
        block_id = queue.get_last_committed_mc_block_id()
        assert block_id is not None and block_id.seqno == 2


@pytest.fixture(scope="module")
def crash_state(tmp_path_factory: pytest.TempPathFactory) -> Crash:
    return make_crash_state(tmp_path_factory)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    yield from reaped_children()


@pytest.mark.parametrize(
    ("threshold", "hold"),
    [(1, True), (20_000, True), (1, False)],
    ids=["marker-only", "mid-import", "returned"],
)
def test_an_import_and_a_power_loss(  # noqa: PLR0917 - fixtures and parameters
    shim: Path,
    tmp_path: Path,
    crash_state: Crash,
    children: list[Child],
    logs: list[MutableMapping[str, Any]],
    threshold: int,
    hold: bool,
) -> None:
    """``import_state`` of 30,000 messages into a queue holding data, and the power goes:
    with only its marker written, halfway through, or after it returned. The first two
    must roll back to exactly the data before it (the marker, synced first, survives
    and names the import to undo, whatever part of its unsynced batches is gone); the
    third must be whole."""
    db = tmp_path / "db"
    prior = build_prior(db)
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    _seed(shim, db, shadow)
    recorder = _recorder(shim, db, shadow)
    child = start_child(tmp_path, db, crash_state, threshold, hold=hold, extra_env=recorder)
    children.append(child)
    child.wait_for("started" if hold else "finished")
    child.kill()
    after = tmp_path / "after"
    _after_power_loss(db, shadow, after)
    state = crash_state.state
    with Queue.open(after, quiet_config(gc_enabled=False)) as queue:
        if hold:
            # The import was there to undo: its synced marker survived the power loss.
            (event,) = [e for e in logs if e["event"] == "import_rolled_back"]
            assert event["reason"] == "interrupted"
            assert_rolled_back(queue, prior)
        else:
            assert marker(queue) is None
            assert queue.get_commit_pointers()[state.shard].seqno == state.seqno
            for diff in state.diffs:
                stored = queue.get_diff_info(state.shard, diff.seqno, DiffZone.BOTH)
                assert stored is not None
                assert sum(stored.shards_messages_count.values()) == len(diff.messages)
    report = verify(after)
    assert report.ok, report.problems


@pytest.mark.slow
def test_power_loss_campaign_soak(shim: Path, tmp_path: Path) -> None:
    _campaign(shim, tmp_path, 200, seed=2)
    (tmp_path / "written-back").mkdir()
    _campaign(shim, tmp_path / "written-back", 200, seed=4, written_back=True)
