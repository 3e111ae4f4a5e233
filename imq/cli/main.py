"""Entry point of the ``imq`` command.

Every subcommand lives in its own module, which exposes ``register(commands)``: it adds
its parser to ``commands`` (argparse's subparsers) and sets ``run`` with
``set_defaults(run=fn)``, where ``fn(args, out)`` does the work, prints to ``out`` and
returns its exit status (``None`` counts as 0).
Adding a command is one module and one entry in :data:`COMMANDS`.

A command may also set ``interrupted`` (``set_defaults(interrupted=text)``): the state
Ctrl-C leaves behind, printed as ``imq: interrupted; <text>`` instead of a traceback.

Exit status: 0 done; 1 refused by imq (a typed ``ImqError``, or a path that cannot be
used), with one line on stderr; 2 bad arguments; 130 interrupted (Ctrl-C), also while
the command is still starting (importing its modules); 143 terminated (SIGTERM), which
stops a command as Ctrl-C does, with the same clean-up. A reader of stdout or stderr that
goes away (``imq ... | head``) changes nothing: the command finishes its work and exits
with its own status; what it would have printed there is dropped.

The subcommands' modules are imported by :func:`main`, not at the import of this one (a
console script imports it before calling ``main``): a Ctrl-C while they load is then an
interrupt like any other. This module imports only ``imq`` and ``imq.errors``; the
interrupt of ``import imq`` itself, which a console script and ``python -m imq`` both
run first, no code of the command can catch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO, cast

import imq
from imq._native import speedups_status
from imq.errors import ImqError

__all__ = ["COMMANDS", "build_parser", "command", "main"]

# One module of imq.cli per group of subcommands, in the order `imq --help` lists them.
COMMANDS: tuple[str, ...] = (
    "simulate",
    "replay",
    "demo",
    "inspect",
    "state",
    "maintenance",
    "verify",
)

EXAMPLES = """\
examples (from the repository root):
  imq demo
  imq inspect var/demo-db
  imq --log-level info gc var/demo-db

`imq COMMAND --help` shows each command's options and examples.
"""


def build_parser() -> argparse.ArgumentParser:
    from imq.cli.common import Parser  # noqa: PLC0415 - see the module docstring

    parser = Parser(
        prog="imq",
        description="The internal message queue of a sharded blockchain collator.",
        epilog=EXAMPLES,
    )
    _log_options(parser, default_level="warning", default_json=False)
    parser.add_argument(
        "--version",
        action="version",
        version=f"imq {imq.__version__}\n{speedups_status()}",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"imq.cli.{name}").register(commands)
    # The log options also after the command's name (`imq import ... --log-level error`):
    # given there, they override the ones before it; absent, they leave those as they are.
    for command in commands.choices.values():
        _log_options(command, default_level=argparse.SUPPRESS, default_json=argparse.SUPPRESS)
    return parser


def _command_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The subcommand ``name``'s own parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return cast("argparse.ArgumentParser", action.choices[name])
    return parser


def _log_options(parser: argparse.ArgumentParser, *, default_level: str, default_json: Any) -> None:
    parser.add_argument(
        "--log-level",
        default=default_level,
        help="level of the events written to stderr (default: warning)",
    )
    parser.add_argument(
        "--log-json", action="store_true", default=default_json, help="log events as JSON lines"
    )


def _os_error(exc: OSError) -> str:
    """One line for a failed file operation: what, where, why."""
    reason = exc.strerror or str(exc)
    return f"{exc.filename}: {reason}" if exc.filename else reason


def _one_line(text: str) -> str:
    """An error message on one line: RocksDB's own texts may span several."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
_TERMINATED = 143  # 128 + SIGTERM


class _Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, systemd, ``docker stop``, ``timeout``), raised where the command
    is: it stops the command as Ctrl-C does, so the same clean-up runs (an import rolled
    back, a temporary database removed), and the exit status says which signal it was."""


@contextlib.contextmanager
def _sigterm_stops_like_ctrl_c() -> Iterator[None]:
    """SIGTERM raises :class:`_Terminated` while the command runs (main thread only;
    the previous handler is put back after, for a host that calls :func:`main`)."""

    def stop(_signum: int, _frame: object) -> None:
        raise _Terminated

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: the host's handling stays as it is
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stopped(exc: KeyboardInterrupt) -> tuple[str, int]:
    if isinstance(exc, _Terminated):
        return "terminated", _TERMINATED
    return "interrupted", _INTERRUPTED


_STARTING = "imq: interrupted while starting; nothing was done"


class _ReaderMayLeave:
    """stdout or stderr, whose reader may close it before the command is done (`imq
    verify DB | head -1`, a monitor that stops reading). The command's outcome must not
    depend on it: a write or flush that finds the pipe closed stops all further output
    to the stream, and the work goes on. The stream's file is pointed at /dev/null (the
    Python docs' recipe for SIGPIPE) so that what is still buffered, and Python's own
    flush at exit, find no closed pipe either."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                self._stream.write(text)
            except BrokenPipeError:
                self._leave()
        return len(text)

    def writelines(self, lines: Iterator[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._leave()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self._stream, name)

    def _leave(self) -> None:
        self._gone = True
        # No file behind the stream (a test's buffer) never gets here; one that cannot be
        # redirected keeps its buffer, which is then simply never written.
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)


@contextlib.contextmanager
def _outputs_whose_reader_may_leave() -> Iterator[TextIO]:
    """``sys.stdout`` and ``sys.stderr`` wrapped in :class:`_ReaderMayLeave` for the
    command's run (its prints, its progress lines, the log handler, argparse's help);
    yields the new stdout, flushed before the originals come back."""
    saved = sys.stdout, sys.stderr
    with contextlib.ExitStack() as stack:
        # Python makes a stream None when its file was closed before it started (`imq
        # ... >&-`): then there is no reader from the start.
        out, err = (
            cast("TextIO", _ReaderMayLeave(stream))
            if stream is not None
            else stack.enter_context(open(os.devnull, "w", encoding="utf-8"))
            for stream in saved
        )
        sys.stdout, sys.stderr = out, err
        try:
            yield out
        finally:
            out.flush()
            err.flush()
            sys.stdout, sys.stderr = saved


def command(argv: Sequence[str] | None = None) -> int:
    """The ``imq`` process's entry point (the console script and ``python -m imq``):
    :func:`main`, then Ctrl-C and SIGTERM are ignored. The work is done and said by then,
    and a signal during the interpreter's teardown (tens of milliseconds of native
    finalizers) would make the exit status the signal's, without a word, or print a
    traceback (an outside audit: 20 of 40 such signals). A host calling :func:`main`
    keeps its own handlers."""
    try:
        # What main() puts back after its own SIGTERM handler: a no-op, not the default
        # (which would end the process by the signal between the two).
        signal.signal(signal.SIGTERM, lambda _signum, _frame: None)
    except ValueError:  # not the main thread
        return main(argv)
    code = main(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    with _outputs_whose_reader_may_leave() as out, _sigterm_stops_like_ctrl_c():
        try:
            return _main(sys.argv[1:] if argv is None else argv, out)
        except KeyboardInterrupt as exc:
            # Ctrl-C before the command began (its modules were loading): one line too.
            word, code = _stopped(exc)
            print(_STARTING.replace("interrupted", word), file=sys.stderr)
            return code


def _main(argv: Sequence[str], out: TextIO) -> int:
    from imq.cli.common import normalize_argv  # noqa: PLC0415 - see the module docstring
    from imq.observability import configure_for_cli  # noqa: PLC0415

    parser = build_parser()
    args, extra = parser.parse_known_args(normalize_argv(argv))
    if extra:  # argparse would show the top-level usage; the command's says more
        _command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        configure_for_cli(args.log_level, json=args.log_json)
    except ValueError as exc:
        print(f"imq: {exc}", file=sys.stderr)
        return 2
    try:
        code = args.run(args, out)  # None or 0: success; a command may return 1
        out.flush()
        return int(code or 0)
    except KeyboardInterrupt as exc:
        # Ctrl-C or SIGTERM: one line saying what state the command leaves, no traceback.
        # The command's word on the state it leaves; one it set on the interrupt itself
        # (what it found once stopped) takes precedence.
        said = exc.args[0] if exc.args and isinstance(exc.args[0], str) else ""
        what = said or getattr(args, "interrupted", "")
        word, code = _stopped(exc)
        print(f"imq: {word}{'; ' + what if what else ''}", file=sys.stderr)
        return code
    except ImqError as exc:
        print(f"imq: error: {_one_line(str(exc))}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"imq: error: {_one_line(_os_error(exc))}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"imq: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except MemoryError:
        # What a command holds is dropped with the frames of the traceback, so a line
        # can still be printed (an outside audit met a traceback under `ulimit -v`).
        print(
            "imq: error: out of memory; nothing more was done: raise the memory limit "
            "(`ulimit -v`) or free memory, then run the command again",
            file=sys.stderr,
        )
        return 1
