"""Entry point of the ``imq`` command.

Every subcommand lives in its own module, which exposes ``register(commands)``: it adds
its parser to ``commands`` (argparse's subparsers) and sets ``run`` with
``set_defaults(run=fn)``, where ``fn(args, out)`` does the work, prints to ``out`` and
returns its exit status (``None`` counts as 0).
Adding a command is one module and one entry in :data:`COMMANDS`.

A command may also set ``interrupted`` (``set_defaults(interrupted=text)``): the state
Ctrl-C leaves behind, printed as ``imq: interrupted; <text>`` instead of a traceback.

Exit status: 0 done; 1 refused by imq (a typed ``ImqError``, or a path that cannot be
used), with one line on stderr; 2 bad arguments; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from types import ModuleType

import imq
from imq.cli import demo, inspect, maintenance, replay, simulate, state, verify
from imq.cli.common import Parser, normalize_argv
from imq.errors import ImqError
from imq.observability import configure_for_cli

__all__ = ["COMMANDS", "build_parser", "main"]

# One module per group of subcommands, in the order `imq --help` lists them.
COMMANDS: tuple[ModuleType, ...] = (simulate, replay, demo, inspect, state, maintenance, verify)

EXAMPLES = """\
examples (from the repository root):
  imq demo
  imq inspect var/demo-db
  imq --log-level info gc var/demo-db

`imq COMMAND --help` shows each command's options and examples.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="imq",
        description="The internal message queue of a sharded blockchain collator.",
        epilog=EXAMPLES,
    )
    parser.add_argument(
        "--log-level", default="warning", help="structlog level for events on stderr"
    )
    parser.add_argument("--log-json", action="store_true", help="log events as JSON lines")
    parser.add_argument("--version", action="version", version=f"imq {imq.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.register(commands)
    return parser


def _os_error(exc: OSError) -> str:
    """One line for a failed file operation: what, where, why."""
    reason = exc.strerror or str(exc)
    return f"{exc.filename}: {reason}" if exc.filename else reason


def _one_line(text: str) -> str:
    """An error message on one line: RocksDB's own texts may span several."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(normalize_argv(sys.argv[1:] if argv is None else argv))
    try:
        configure_for_cli(args.log_level, json=args.log_json)
    except ValueError as exc:
        print(f"imq: {exc}", file=sys.stderr)
        return 2
    try:
        code = args.run(args, sys.stdout)  # None or 0: success; a command may return 1
        sys.stdout.flush()
        return int(code or 0)
    except KeyboardInterrupt:
        # Ctrl-C: one line saying what state the command leaves, not a traceback.
        what = getattr(args, "interrupted", "")
        print(f"imq: interrupted{'; ' + what if what else ''}", file=sys.stderr)
        return _INTERRUPTED
    except BrokenPipeError:
        # The reader of stdout went away (`imq ... | head`): stop quietly, and keep Python
        # from reporting the same error again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except ImqError as exc:
        print(f"imq: error: {_one_line(str(exc))}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"imq: error: {_one_line(_os_error(exc))}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"imq: {_one_line(str(exc))}", file=sys.stderr)
        return 2
