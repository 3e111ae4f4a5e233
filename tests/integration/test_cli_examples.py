"""The CLI keeps its word: every example in README.md and in every ``--help`` text runs as
written, from a directory laid out like the repository root.

The working directory is a fresh ``tmp_path`` holding a copy of ``tests/data/tycho`` and
``tests/replays`` (the examples' input files) and an ``imq`` command (a two-line shim that runs this
interpreter's ``python -m imq``, standing in for the script ``pip install`` puts in
``.venv/bin``). Two README commands are not run: ``make test`` is this very suite, and
``make run`` is ``python -m imq simulate --fresh`` (Makefile), which runs here as a short
simulation of the same kind.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from tycho_data import TYCHO

import imq
from imq._native import speedups_status
from imq.cli.main import build_parser, main

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
_HELP_EXAMPLE = re.compile(r"^  (imq .*)$", re.M)
_INLINE_IMQ = re.compile(r"`((?:\.venv/bin/)?imq [^`]+)`")
# Makefile: run -> python -m imq simulate --fresh (4,000 rounds); here a short run of it
_MAKE_STANDS_FOR = {"make run": "imq simulate --fresh --rounds 40 --no-plot"}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A directory laid out like the repository root for the examples."""
    shutil.copytree(TYCHO, tmp_path / "tests" / "data" / "tycho")
    shutil.copytree(REPO / "tests" / "replays", tmp_path / "tests" / "replays")
    for bin_dir in (tmp_path / "bin", tmp_path / ".venv" / "bin"):
        bin_dir.mkdir(parents=True)
        shim = bin_dir / "imq"
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m imq "$@"\n')
        shim.chmod(0o755)
    return tmp_path


def _shell(root: Path, script: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PATH": f"{root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
    }
    return subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _readme_blocks(language: str) -> list[str]:
    return [body for lang, body in _FENCE.findall(README) if lang == language]


def test_readme_shell_examples_run_as_written(root: Path) -> None:
    blocks = _readme_blocks("sh")
    assert len(blocks) >= 2
    commands = []
    for block in blocks:
        for line in block.splitlines():
            command = line.split("#", 1)[0].strip() if line.startswith("make") else line
            if command == "make test":
                continue  # this suite
            commands.append(_MAKE_STANDS_FOR.get(command, command))
            if command == "make run":  # the README mentions the demo and what it leaves
                commands += ["imq demo"]
                commands += [m for m in _INLINE_IMQ.findall(README) if "demo-db" in m]
    assert any("-- -1_" in c for c in commands)  # the masterchain name after '--'
    assert any("--block-id -1:" in c for c in commands)
    for command in commands:
        done = _shell(root, command)
        assert done.returncode == 0, f"{command}\n{done.stderr}"
        assert "Traceback" not in done.stderr


def test_readme_python_example_runs_as_written(root: Path) -> None:
    (example,) = _readme_blocks("python")
    script = root / "example.py"
    script.write_text(example)
    done = _shell(root, f"{shlex.quote(sys.executable)} example.py")
    assert done.returncode == 0, done.stderr
    assert "0:4000000000000000" in done.stdout  # it printed the message's source


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    subparsers = next(
        a for a in parser._actions if isinstance(a.choices, dict) and "demo" in a.choices
    )
    return dict(subparsers.choices)


def _help_examples() -> list[tuple[str, str]]:
    """(command, example line) of the top-level help and every subcommand's help, in the
    order the commands are registered (each command's examples may use what an earlier
    one made), the top-level ones last."""
    parser = build_parser()
    out = []
    for name, sub in _subcommands().items():
        out += [(name, line) for line in _HELP_EXAMPLE.findall(sub.format_help())]
    out += [("imq", line) for line in _HELP_EXAMPLE.findall(parser.format_help())]
    return out


@pytest.fixture
def in_process(capsys: pytest.CaptureFixture[str]) -> Iterator[pytest.CaptureFixture[str]]:
    saved = structlog.get_config()
    yield capsys
    structlog.configure(**saved)


def test_every_help_example_runs_as_written(
    root: Path, monkeypatch: pytest.MonkeyPatch, in_process: pytest.CaptureFixture[str]
) -> None:
    examples = _help_examples()
    named = {name for name, _ in examples}
    assert set(_subcommands()) <= named  # every command has examples
    monkeypatch.chdir(root)
    for _, line in examples:
        argv = shlex.split(line)
        assert argv[0] == "imq"
        code = main(argv[1:])
        captured = in_process.readouterr()
        assert code == 0, f"{line}\n{captured.err}"


def test_help_and_readme_examples_run_in_one_checkout(
    root: Path, monkeypatch: pytest.MonkeyPatch, in_process: pytest.CaptureFixture[str]
) -> None:
    """A docs audit: after the ``--help`` examples, the README's cold start failed (both
    imported into var/state-db, the help's newer state first). A user runs both, in
    either order, in one checkout."""
    monkeypatch.chdir(root)
    for _, line in _help_examples():
        assert main(shlex.split(line)[1:]) == 0, in_process.readouterr().err
    cold_start = [
        line
        for block in _readme_blocks("sh")
        for line in block.splitlines()
        if line.startswith(("imq import", "imq export", "(cd tests/data"))
    ]
    assert len(cold_start) >= 3
    for command in cold_start:
        done = _shell(root, command)
        assert done.returncode == 0, f"{command}\n{done.stderr}"


def test_help_examples_run_as_a_real_command(root: Path) -> None:
    """Two of them through the real entry point, as a user types them."""
    lines = [line for _, line in _help_examples() if line.startswith(("imq demo", "imq gc"))]
    done = _shell(root, "\n".join(lines))
    assert done.returncode == 0, done.stderr
    assert "ranges deleted" in done.stdout


def test_every_command_help_ends_with_examples() -> None:
    """README: every `imq COMMAND --help` ends with examples (simulate, replay and verify
    had none)."""
    for name, sub in _subcommands().items():
        lines = sub.format_help().rstrip().splitlines()
        assert _HELP_EXAMPLE.fullmatch(lines[-1]), f"imq {name} --help ends with {lines[-1]!r}"
        assert any(line.startswith("examples (") for line in lines), name


def test_version_names_the_package_version(root: Path) -> None:
    done = _shell(root, "imq --version")
    assert done.returncode == 0, done.stderr
    # The second line: whether the compiled paths run, as this process (same install,
    # same environment) finds them.
    assert done.stdout.splitlines() == [f"imq {imq.__version__}", speedups_status()]
