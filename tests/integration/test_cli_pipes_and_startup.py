"""The CLI's edges an audit found, each through a real ``imq`` process: a reader of stdout
that goes away at once, a state or a diff read from a pipe, a Ctrl-C while the command is
still starting, and ``simulate`` options that were not checked.

A command runs as ``python -m imq`` does (or as the ``imq`` console script does), with
Python's own Ctrl-C handler installed even when the test runner was started with SIGINT
ignored (as a background job is).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from state_fixtures import SHARD_BIN

REPO = Path(__file__).resolve().parents[2]
FIRST_DIFF = REPO / "tests/data/tycho/first_block/first_block_queue_diff.bin"

# Python's default SIGINT handler, whatever the parent ignores; then the command.
_PREAMBLE = "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
_MODULE = _PREAMBLE + (
    "sys.argv[0] = 'imq'; runpy.run_module('imq', run_name='__main__', alter_sys=True)"
)
# What the console script `imq` runs (pyproject.toml's [project.scripts]).
_SCRIPT = _PREAMBLE + "from imq.cli.main import main; sys.exit(main())"
# A real SIGINT to the process itself as the named module starts loading: the Ctrl-C of
# a user who changed their mind while the command was still importing.
_INTERRUPT_AT = (
    "import importlib.abc, os, signal, sys\n"
    "class Interrupt(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == os.environ['IMQ_TEST_INTERRUPT_AT']:\n"
    "            os.kill(os.getpid(), signal.SIGINT)\n"
    "        return None\n"
    "sys.meta_path.insert(0, Interrupt())\n"
)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def _imq(
    *argv: str | Path,
    stdin: bytes | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", _MODULE, *map(str, argv)],
        input=stdin,
        capture_output=True,
        env=env or _env(),
        timeout=120,
        check=False,
    )
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode(), done.stderr.decode()
    )


def _into_closed_pipe(
    *argv: str | Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``imq`` with stdout a pipe whose reader is gone before the command writes
    (``imq ... | true``); stderr is captured."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _MODULE, *map(str, argv)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=env or _env(),
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    return subprocess.CompletedProcess(done.args, done.returncode, "", done.stderr.decode())


# -- a reader of stdout that goes away ------------------------------------------------------


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short verified simulation whose stdout reader left at once, unbuffered (every
    print meets the closed pipe): it used to exit 1 before writing report.json."""
    run_dir = tmp_path_factory.mktemp("sim")
    done = _into_closed_pipe(
        "simulate",
        "--dir",
        run_dir,
        "--rounds",
        "20",
        "--shards",
        "2",
        "--no-plot",
        env=_env(PYTHONUNBUFFERED="1"),
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return run_dir


def test_simulate_into_a_closed_pipe_finishes_and_writes_its_report(sim_run: Path) -> None:
    report = json.loads((sim_run / "report.json").read_text())
    assert report["verified"] is True


def test_verify_into_a_closed_pipe_exits_with_its_own_status(sim_run: Path) -> None:
    """A healthy database is healthy whoever reads the verdict: exit 0, no error line."""
    db = sim_run / "queue"
    done = _into_closed_pipe("verify", "--no-progress", db)
    assert (done.returncode, done.stderr) == (0, "")
    # The same with stderr going into the closed pipe too (`2>&1 | true`).
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        both = subprocess.run(
            [sys.executable, "-c", _MODULE, "verify", db],
            stdout=write_end,
            stderr=write_end,
            env=_env(),
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert both.returncode == 0


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["inspect", "{db}"], 0),
        (["inspect", "--json", "{db}"], 0),
        (["dump-diff", str(FIRST_DIFF)], 0),
        (["--help"], 0),
        (["inspect", "{db}-missing"], 1),
    ],
    ids=["inspect", "inspect-json", "dump-diff", "help", "refused"],
)
def test_a_closed_stdout_leaves_the_exit_status_alone(
    argv: list[str], code: int, sim_run: Path
) -> None:
    done = _into_closed_pipe(*(a.format(db=sim_run / "queue") for a in argv))
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    if code:  # a refusal still says why, on stderr
        assert done.stderr.startswith("imq: error: ") and done.stderr.count("\n") == 1


def test_a_stdout_closed_before_the_start_changes_nothing(sim_run: Path) -> None:
    """`imq verify DB >&-`: Python starts with sys.stdout None, which the command used to
    flush (a traceback, exit 1)."""
    done = subprocess.run(
        [
            "sh",
            "-c",
            'exec "$@" >&-',
            "sh",
            sys.executable,
            "-c",
            _MODULE,
            "verify",
            sim_run / "queue",
        ],
        capture_output=True,
        env=_env(),
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, b"")


# -- input from a pipe ------------------------------------------------------------------------


@pytest.mark.parametrize("stdin", ["/dev/stdin", "-"])
@pytest.mark.parametrize("source", [SHARD_BIN, FIRST_DIFF], ids=["state", "diff"])
def test_dump_diff_reads_stdin_as_it_reads_the_file(source: Path, stdin: str) -> None:
    """dump-diff read four bytes, then opened the path again: a pipe was drained by then
    and the state was called 'truncated at offset 0 ... or it is damaged'. ``-`` names
    standard input, as for other Unix tools (an outside review found it taken for a
    file named ``-``)."""
    by_path = _imq("dump-diff", "--json", source)
    by_pipe = _imq("dump-diff", "--json", stdin, stdin=source.read_bytes())
    assert by_path.returncode == 0, by_path.stderr
    assert by_pipe.returncode == 0, by_pipe.stderr
    assert json.loads(by_pipe.stdout) == json.loads(by_path.stdout)


def test_dump_diff_of_a_cut_pipe_names_where_it_ends() -> None:
    done = _imq("dump-diff", "/dev/stdin", stdin=SHARD_BIN.read_bytes()[:1000])
    assert done.returncode == 1
    assert done.stderr.startswith("imq: error: /dev/stdin: truncated at offset 272")


def test_replay_reads_its_log_from_a_pipe() -> None:
    """The replay checked the whole log, then opened it again to replay it: from a pipe
    the second read found nothing ('op log /dev/stdin is empty', exit 1)."""
    log = Path(__file__).parents[1] / "replays" / "sim-2shards-seed7.jsonl"
    by_path = _imq("replay", "--no-progress", log)
    by_pipe = _imq("replay", "--no-progress", "/dev/stdin", stdin=log.read_bytes())
    assert by_path.returncode == 0, by_path.stderr
    assert (by_pipe.returncode, by_pipe.stdout) == (0, by_path.stdout), by_pipe.stderr
    assert "steps agree" in by_pipe.stdout
    cut = _imq("replay", "--no-progress", "/dev/stdin", stdin=log.read_bytes()[:300])
    assert cut.returncode == 1
    assert cut.stderr.startswith("imq: error: op log /dev/stdin line "), cut.stderr


# -- Ctrl-C while the command starts --------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "module"),
    [
        (_MODULE, "imq.cli.main"),
        (_MODULE, "imq.cli.simulate"),
        (_MODULE, "imq.cli.common"),
        (_MODULE, "imq.observability"),
        (_SCRIPT, "imq.cli.state"),
        (_SCRIPT, "imq.sim.child"),
        (_SCRIPT, "imq.queue"),
        (_SCRIPT, "imq.storage.rocks"),
    ],
    ids=[
        "m-main",
        "m-simulate",
        "m-common",
        "m-observability",
        "script-state",
        "script-sim-child",
        "script-queue",
        "script-rocks",
    ],
)
def test_ctrl_c_while_starting_is_one_line_and_130(entry: str, module: str) -> None:
    """A Ctrl-C in the first fraction of a second (the modules still loading) used to end
    in a KeyboardInterrupt traceback and death by SIGINT. The library's modules (imq.queue,
    imq.storage.rocks, imq.observability) load after the command's handler is in place,
    since ``import imq`` loads nothing (the first import of a console script and of
    ``python -m imq``, which no handler of the command can cover)."""
    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_AT + entry, "inspect", "no-such-db"],
        capture_output=True,
        env=_env(IMQ_TEST_INTERRUPT_AT=module),
        timeout=120,
        check=False,
    )
    stderr = done.stderr.decode()
    assert done.returncode == 130, stderr
    assert stderr == "imq: interrupted while starting; nothing was done\n"
    assert done.returncode != -signal.SIGINT


# -- simulate's options -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--nodes", "100000"], "imq: nodes must be in 1..16, got 100000"),
        (["--nodes", "17"], "imq: nodes must be in 1..16, got 17"),
        (["--gc-every", "-1"], "imq: gc_every must be >= 0"),
    ],
    ids=["nodes-100000", "nodes-17", "gc-every-negative"],
)
def test_simulate_refuses_options_out_of_range(
    option: list[str], says: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    done = _imq("simulate", "--dir", run_dir, "--rounds", "5", "--no-plot", *option)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(says) and done.stderr.count("\n") == 1, done.stderr
    assert not run_dir.exists()  # refused before anything was made


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/dev/full", "No space left on device"),
        pytest.param(
            "/proc/version",
            "",
            marks=pytest.mark.skipif(
                os.access("/proc/version", os.W_OK) is False, reason="opens only as root"
            ),
        ),
    ],
    ids=["dev-full", "proc-version"],
)
def test_an_op_log_that_cannot_be_written_is_named(path: str, reason: str, tmp_path: Path) -> None:
    """A file that opens but refuses writes used to print only the reason
    ('imq: error: Input/output error')."""
    done = _imq(
        "simulate",
        "--dir",
        tmp_path,
        "--rounds",
        "5",
        "--shards",
        "1",
        "--no-plot",
        "--record",
        path,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"imq: error: cannot write the op log {path}: {reason}"), line
    assert line.count("cannot write") == 1 and line.count("retry") == 1, line  # named once
