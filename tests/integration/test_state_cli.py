"""The ``imq import``, ``imq export`` and ``imq dump-diff`` commands on the real files:
block ids from file names (masterchain names as they are, after ``--`` or as ``./-1_...``),
the top update from ``--top-update`` or ``--block``, the progress line, JSON and text
dumps, and exit codes (0 done, 1 refused by imq, 2 bad arguments).

Most runs call ``imq.cli.main.main`` in-process; one test runs ``python -m imq``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import blake3
import pytest
from builders import dump
from cli_runner import Imq
from state_fixtures import (
    BASE,
    DUMP_STATES,
    FIRST_DIFF,
    FIRST_DIFF_HASH,
    MC,
    SHARD_BIN,
    SHARD_TOP_HASH,
    oracle_block,
    parse_state,
    state_bytes,
)

from imq import BlockId, Queue, QueueConfig
from imq.state.block import parse_block_id_name
from imq.state.boc import CellBuilder, encode_boc
from imq.state.synth import default_name, synth_state, write_synth_state

REPO = Path(__file__).resolve().parents[2]
ZERO = "0" * 64
SHARD_ID = f"0:8000000000000000:160:{ZERO}:{ZERO}"
MC57 = DUMP_STATES[0]
DUMP35 = DUMP_STATES[1]
assert MC57.block is not None and DUMP35.block is not None


def _open(db: Path) -> Queue:
    return Queue.open(db, QueueConfig(gc_enabled=False))


def _block_file(path: Path, diff_hash: bytes, tail_len: int) -> Path:
    """A minimal tycho block: tag, global id, refs [info, value_flow, X, extra] with
    ``X = #1 diff_hash tail_len`` (FORMAT.md §3)."""
    empty = CellBuilder().end()
    updates = CellBuilder().store_uint(1, 4).store_bytes(diff_hash).store_uint(tail_len, 32).end()
    root = CellBuilder().store_uint(0x11EF55BB, 32).store_int(-239, 32)
    for ref in (empty, empty, updates, empty):
        root.store_ref(ref)
    path.write_bytes(encode_boc([root.end()]))
    return path


# -- import -------------------------------------------------------------------------------------


def test_a_masterchain_state_is_imported_under_the_id_in_its_name(
    imq: Imq, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = MC57.path.name
    expected = parse_block_id_name(name)
    size = len(state_bytes(MC57.path))
    monkeypatch.chdir(MC57.path.parent)
    top = f"{oracle_block(MC57.block).diff_hash.hex()}:1"
    for db, argv in (
        (tmp_path / "a", ["--", name]),
        (tmp_path / "b", [f"./{name}"]),
        (tmp_path / "c", [name]),  # a leading '-' then digits is a value, never an option
        (tmp_path / "d", ["--", name, "--top-update", top]),  # options may follow '--' NAME
        (tmp_path / "e", ["--top-update", top, name]),
        # Any path after '--', with options after it (an outside audit: these failed).
        (tmp_path / "f", ["--", f"./{name}", "--top-update", top]),
        (tmp_path / "g", ["--", str(MC57.path), "--top-update", top]),
    ):
        run = imq("import", db, *argv)
        assert run.code == 0, run.err
        assert run.out.startswith(f"imported {name} into {db}: 1 diffs (1 written, 0 already")
        assert f"0 messages, {size:,} bytes" in run.out
        with _open(db) as queue:
            assert queue.get_last_committed_mc_block_id() == expected
            info = queue.get_diff_info(MC, 57)
            assert info is not None
            assert info.hash == oracle_block(MC57.block).diff_hash


def test_top_update_option_is_checked(imq: Imq, tmp_path: Path) -> None:
    db = tmp_path / "db"
    good = imq(
        "import", db, SHARD_BIN, "--block-id", SHARD_ID, "--top-update", f"{SHARD_TOP_HASH}:3"
    )
    assert good.code == 0, good.err
    assert "3 diffs (3 written, 0 already stored), 4,300 messages, 538,308 bytes" in good.out
    again = imq(
        "import", db, SHARD_BIN, "--block-id", SHARD_ID, "--top-update", f"{SHARD_TOP_HASH}:3"
    )
    assert again.code == 0
    assert "3 diffs (0 written, 3 already stored)" in again.out

    other = "6" + SHARD_TOP_HASH[1:]
    for update, error in (
        (f"{other}:3", "top queue diff hash mismatch"),
        (
            f"{SHARD_TOP_HASH}:2",
            "queue diffs count mismatch",
        ),
    ):
        fresh = tmp_path / f"fresh-{update[-1]}"
        run = imq("import", fresh, SHARD_BIN, "--block-id", SHARD_ID, "--top-update", update)
        assert run.code == 1
        assert run.err.startswith("imq: error: ")
        assert error in run.err
        assert run.out == ""
        with _open(fresh) as queue:
            assert queue.get_diff_info(BASE, 160) is None
            assert queue.get_commit_pointers() == {}


def test_block_option_takes_the_top_update_from_a_block_file(imq: Imq, tmp_path: Path) -> None:
    state = synth_state(diffs=2, messages_per_diff=5, seed=5)
    path = tmp_path / default_name(state)
    write_synth_state(state, path)
    top_hash, tail = state.top_update
    block = _block_file(tmp_path / "top.block", top_hash, tail)
    wrong = _block_file(tmp_path / "wrong.block", top_hash, tail + 1)

    bad = imq("import", tmp_path / "x", path, "--block", wrong)
    assert bad.code == 1
    assert "queue diffs count mismatch" in bad.err
    run = imq("import", tmp_path / "db", path, "--block", block)
    assert run.code == 0, run.err
    assert f"top update from top.block: {top_hash.hex()}:{tail}" in run.out
    assert "2 diffs (2 written" in run.out
    with _open(tmp_path / "db") as queue:
        assert queue.get_diff_info(BASE, state.seqno).hash == top_hash


def test_block_option_with_a_real_block(imq: Imq, tmp_path: Path) -> None:
    run = imq("import", tmp_path / "db", DUMP35.path, "--block", DUMP35.block)
    assert run.code == 0, run.err
    diff_hash = oracle_block(DUMP35.block).diff_hash
    assert f"{diff_hash.hex()}:1" in run.out


def test_block_option_refuses_a_block_that_is_not_the_imported_one(
    imq: Imq, tmp_path: Path
) -> None:
    # The dump's block 36 is a real block, but the state imported is block 35's.
    block36 = next(DUMP35.block.parent.glob("0_8000000000000000_36_*.block"))
    run = imq("import", tmp_path / "db", DUMP35.path, "--block", block36)
    assert run.code == 1
    assert "root hash" in run.err or "file hash" in run.err, run.err
    assert not (tmp_path / "db").exists()  # refused before the database is opened


def test_a_file_named_after_another_block_is_refused(imq: Imq, tmp_path: Path) -> None:
    renamed = tmp_path / DUMP35.path.name.replace("_35_", "_37_")
    shutil.copy(DUMP35.path, renamed)
    run = imq("import", tmp_path / "db", renamed)
    assert run.code == 1
    assert "belongs to block 0:8000000000000000:35" in run.err


def test_progress_goes_to_stderr_unless_turned_off(imq: Imq, tmp_path: Path) -> None:
    shown = imq("import", tmp_path / "a", SHARD_BIN, "--block-id", SHARD_ID)
    assert shown.code == 0
    assert "import 0:8000000000000000:160: 4,300/4,300 messages (100.0%)" in shown.err
    assert shown.err.count("4,300/4,300") == 1, shown.err  # the final line once
    assert "4,300/4,300" not in shown.out
    quiet = imq("import", tmp_path / "b", SHARD_BIN, "--block-id", SHARD_ID, "--no-progress")
    assert quiet.code == 0
    assert "messages (" not in quiet.err
    assert "4,300 messages" in quiet.out


def test_an_import_without_a_top_update_says_what_went_unchecked(imq: Imq, tmp_path: Path) -> None:
    """A state file has no checksum: its newest diff is checked only against the block's
    top update, so an import without one says so (stderr) and how to check it."""
    bare = imq("import", tmp_path / "a", SHARD_BIN, "--block-id", SHARD_ID, "--no-progress")
    assert bare.code == 0, bare.err
    assert "note: no --block or --top-update given" in bare.err
    assert "note:" not in bare.out
    update = f"{SHARD_TOP_HASH}:3"
    checked = imq(
        "import", tmp_path / "b", SHARD_BIN, "--block-id", SHARD_ID, "--top-update", update
    )
    assert checked.code == 0, checked.err
    assert "note:" not in checked.err


# -- export and dump-diff -----------------------------------------------------------------------


def test_export_then_dump_the_exported_state(imq: Imq, tmp_path: Path) -> None:
    db, out = tmp_path / "db", tmp_path / "out.queue"
    assert imq("import", db, SHARD_BIN, "--block-id", SHARD_ID, "--no-progress").code == 0
    export = ("export", db, "--shard", "0:8000000000000000", "--seqno")

    run = imq(*export, "160", "--tail-len", "3", out)

    assert run.code == 0, run.err
    assert run.out.startswith(f"exported 0:8000000000000000:160 to {out}: 3 diffs, 4,300 ")
    assert "1 chunks, 538,308 bytes" in run.out
    assert "not bit-exact" not in run.out
    assert out.read_bytes()[:4] == bytes.fromhex("28b52ffd")
    assert state_bytes(out) == SHARD_BIN.read_bytes()
    oracle = parse_state(SHARD_BIN)

    dumped = imq("dump-diff", out, "--json")
    assert dumped.code == 0
    entries = json.loads(dumped.out)
    assert [e["hash"] for e in entries] == [d.hash.hex() for d in oracle.diffs]
    assert entries[0]["hash"] == SHARD_TOP_HASH
    assert [e["seqno"] for e in entries] == [160, 159, 158]
    assert [e["messages"] for e in entries] == [4300, 0, 0]
    assert [e["prev_hash"] for e in entries] == [d.prev_hash.hex() for d in oracle.diffs]
    assert entries[0]["message_hashes"] == [h.hex() for h in oracle.diffs[0].hashes]
    assert {e["shard"] for e in entries} == {"0:8000000000000000"}

    text = imq("dump-diff", out)
    assert text.code == 0
    assert text.out.startswith("queue state out.queue: 0:8000000000000000:160, 1 chunks")
    for diff in oracle.diffs:
        assert f"hash (blake3)   {diff.hash.hex()}" in text.out
    assert "messages        4300 (" in text.out

    missing = imq(*export, "161", "--tail-len", "1", tmp_path / "missing.queue")
    assert missing.code == 1
    assert "0:8000000000000000:161 is not stored" in missing.err
    assert not (tmp_path / "missing.queue").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db", "out.queue"]


def test_dump_diff_of_a_bare_diff(imq: Imq) -> None:
    assert blake3.blake3(FIRST_DIFF.read_bytes()).hexdigest() == FIRST_DIFF_HASH
    run = imq("dump-diff", "--json", FIRST_DIFF)
    assert run.code == 0
    (entry,) = json.loads(run.out)  # always a list, as for a state
    assert entry["hash"] == FIRST_DIFF_HASH
    assert (entry["shard"], entry["seqno"]) == ("-1:8000000000000000", 1)
    assert entry["prev_hash"] == ZERO
    assert (entry["messages"], entry["message_hashes"]) == (0, [])
    assert (entry["router_src"], entry["router_dst"]) == ({}, {})
    assert set(entry["processed_to"]) == {"-1:8000000000000000", "0:8000000000000000"}

    text = imq("dump-diff", FIRST_DIFF)
    assert text.code == 0
    assert text.out.startswith("queue diff first_block_queue_diff.bin")
    assert "diff -1:8000000000000000:1" in text.out
    assert FIRST_DIFF_HASH in text.out


# -- bad arguments ------------------------------------------------------------------------------

_SHARD = ["import", "{db}", str(SHARD_BIN), "--block-id", SHARD_ID]
_EXPORT = ["export", "{db}", "--shard"]
BAD_ARGUMENTS = [
    pytest.param(["import"], "required", id="import-without-arguments"),
    pytest.param(_SHARD[:3], "does not name its block", id="no-block-id"),
    pytest.param([*_SHARD[:4], "nonsense"], "not a block id", id="bad-block-id"),
    pytest.param([*_SHARD, "--top-update", "zz:3"], "--top-update must be", id="top-not-hex"),
    pytest.param([*_SHARD, "--top-update", "ab:3"], "--top-update must be", id="top-short"),
    pytest.param(
        ["import", "{db}", str(DUMP35.path), "--top-update", f"{ZERO}:1", "--block", "b"],
        "not allowed with",
        id="top-update-and-block",
    ),
    pytest.param(
        [*_EXPORT, "bogus", "--seqno", "1", "--tail-len", "1", "o.bin"], "bogus", id="bad-shard"
    ),
    pytest.param(
        [*_EXPORT, str(BASE), "--seqno", "x", "--tail-len", "1", "o"],
        "invalid int value",
        id="bad-seqno",
    ),
    pytest.param(
        [*_EXPORT, str(BASE), "--seqno", "5", "--tail-len", "0", "o"], "tail_len", id="tail-0"
    ),
    pytest.param(
        ["--log-level", "loud", "dump-diff", str(FIRST_DIFF)],
        "unknown log level",
        id="bad-log-level",
    ),
    pytest.param(["frobnicate"], "invalid choice", id="unknown-command"),
]


@pytest.mark.parametrize(("argv", "says"), BAD_ARGUMENTS)
def test_bad_arguments_exit_with_code_2(
    argv: list[str], says: str, imq: Imq, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = [a.format(db=tmp_path / "db", tmp=tmp_path) for a in argv]
    run = imq(*args)
    assert run.code == 2
    assert says in run.err
    assert run.out == ""


# -- the real command -------------------------------------------------------------------------


def test_python_dash_m_imq_imports_and_dumps(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def imq_command(*argv: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "imq", *map(str, argv)],
            cwd=MC57.path.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    name = MC57.path.name
    done = imq_command("import", tmp_path / "db", "--no-progress", "--", name)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"imported {name}")
    dumped = imq_command("dump-diff", "--json", f"./{name}")
    assert dumped.returncode == 0, dumped.stderr
    (entry,) = json.loads(dumped.stdout)
    assert entry["hash"] == oracle_block(MC57.block).diff_hash.hex()
    other = imq_command("import", tmp_path / "other", "--no-progress", name)
    assert other.returncode == 0, other.stderr
    with _open(tmp_path / "db") as queue:
        assert queue.get_last_committed_mc_block_id() == parse_block_id_name(name)
        assert isinstance(queue.get_last_committed_mc_block_id(), BlockId)


@pytest.mark.parametrize("into", ["file", "pipe"])
def test_export_to_dev_stdout_writes_the_state_alone(imq: Imq, tmp_path: Path, into: str) -> None:
    """`imq export ... /dev/stdout` wrote its summary line to stdout too: piped, after
    the state; redirected to a file, over the state's first bytes (an outside audit).
    The summary goes to stderr when the destination is the command's own stdout."""
    db = tmp_path / "db"
    assert imq("import", db, SHARD_BIN, "--block-id", SHARD_ID, "--no-progress").code == 0
    argv = [sys.executable, "-m", "imq", "export", str(db), "--shard", "0:8000000000000000"]
    argv += ["--seqno", "160", "--tail-len", "3", "--no-progress", "/dev/stdout"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "out.bin"
    if into == "file":
        with out.open("wb") as sink:
            done = subprocess.run(
                argv, stdout=sink, stderr=subprocess.PIPE, env=env, timeout=60, check=False
            )
        data = out.read_bytes()
    else:
        done = subprocess.run(argv, capture_output=True, env=env, timeout=60, check=False)
        data = done.stdout
    assert done.returncode == 0, done.stderr
    assert data == SHARD_BIN.read_bytes()  # bit-exact, and nothing else
    assert b"exported 0:8000000000000000:160 to /dev/stdout" in done.stderr


def test_an_older_state_into_a_newer_queue_says_what_an_operator_can_do(
    imq: Imq, tmp_path: Path
) -> None:
    """An outside audit: the refusal's next step was a collator's ("pass the top blocks
    of a newer masterchain block"); from the command line it names another directory."""
    db = tmp_path / "db"
    assert imq("import", db, SHARD_BIN, "--block-id", SHARD_ID).code == 0
    with _open(db) as queue:
        before = dump(queue)
    older = next(s for s in DUMP_STATES if s.path.name.startswith("0_8000000000000000_36_"))
    run = imq("import", db, older.path)
    assert run.code == 1, run
    assert "would move the commit pointer of shard 0:8000000000000000 backwards" in run.err
    assert "import the state into a new directory" in run.err
    with _open(db) as queue:
        assert queue.get_commit_pointers()[BASE].seqno == 160
        assert dump(queue) == before


def test_a_failed_import_never_removes_a_queue_another_process_made(
    imq: Imq, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory was empty (or missing) when the import looked, and another process
    created a queue there before the import opened it (an outside review): the import's
    open fails (DatabaseLockedError), or it opens a queue that holds data, and either
    way it removes nothing. Decided under the queue's lock, not from the first look."""
    import imq.cli.state as state_cli

    monkeypatch.setattr(state_cli, "_is_empty_directory", lambda db: True)  # the first look
    db = tmp_path / "db"
    assert imq("import", db, SHARD_BIN, "--block-id", SHARD_ID).code == 0  # the other's
    with _open(db) as holder:
        run = imq("import", db, SHARD_BIN, "--block-id", SHARD_ID)
        assert run.code == 1 and "already open" in run.err, run
        before = dump(holder)
    cut = tmp_path / "cut.bin"
    cut.write_bytes(SHARD_BIN.read_bytes()[:400_000])
    run = imq("import", db, cut, "--block-id", SHARD_ID)
    assert run.code == 1, run
    with _open(db) as queue:
        assert dump(queue) == before


def test_a_failed_import_removes_the_directory_it_created(imq: Imq, tmp_path: Path) -> None:
    """A state whose header is sound but whose chunk is cut short fails after the queue
    was created: the new directory goes with the import (all or nothing); an existing
    queue stays, as it was."""
    cut = tmp_path / "cut.bin"
    cut.write_bytes(SHARD_BIN.read_bytes()[:400_000])
    db = tmp_path / "new" / "db"
    run = imq("import", db, cut, "--block-id", SHARD_ID)
    assert run.code == 1 and "truncated at offset" in run.err, run
    assert not db.exists()
    # An empty directory given to it stays, empty again (`import --help`: the database
    # is "removed again if the import fails").
    empty = tmp_path / "empty"
    empty.mkdir()
    run = imq("import", empty, cut, "--block-id", SHARD_ID)
    assert run.code == 1 and "truncated at offset" in run.err, run
    assert empty.is_dir() and list(empty.iterdir()) == []
    assert imq("import", empty, SHARD_BIN, "--block-id", SHARD_ID).code == 0  # and is usable
    kept = tmp_path / "kept"
    assert imq("import", kept, SHARD_BIN, "--block-id", SHARD_ID).code == 0
    with _open(kept) as queue:
        before = dump(queue)
    other = next(s for s in DUMP_STATES if s.path.name.startswith("0_8000000000000000_36_"))
    assert imq("import", kept, other.path).code == 1
    with _open(kept) as queue:
        assert dump(queue) == before
