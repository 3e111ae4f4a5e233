"""``imq simulate``: run the collating network, verify exactly-once, report.

Registered by :func:`register`; prints a live progress bar on stderr, then the verdict,
the summary table and where the JSON and the picture are on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO, cast

from imq.cli.common import PathError, file_in_the_way, path_arg
from imq.config import QueueConfig
from imq.errors import FileAccessError, ImqError
from imq.observability import configure_for_cli
from imq.sim import SimConfig, SimQueue, SimResult, Simulation
from imq.sim.child import ChildQueue
from imq.sim.engine import MAX_NODES, Opener, default_opener, frozen_startup_heap
from imq.sim.report import PlotUnavailableError, table, write_json, write_plot
from imq.testing.record import OpLog, RecordingQueue

__all__ = ["register", "run"]

DEFAULT_DIR = Path("var") / "sim"
DEFAULT_ROUNDS = 4000

EXAMPLES = """\
Exit status 1 when a committed message was not executed exactly once, when the queue's
answer about its own state disagreed with what the run wrote (a failed state check), or
when the run stopped on an error (the verdict line then says NOT VERIFIED).

examples (from the repository root):
  imq simulate --fresh --rounds 200 --no-plot
  imq simulate --fresh --rounds 100 --kill --no-plot
  imq simulate --fresh --rounds 20 --shards 2 --no-plot --record var/sim/ops.jsonl
"""


def register(commands: Any) -> None:
    """Add ``simulate`` to the ``imq`` sub-command parser."""
    sim = commands.add_parser(
        "simulate",
        help="run a seeded collating network on one queue and verify exactly-once delivery",
        description="Masterchain plus N basechain shards collate on one queue: read, execute, "
        "write diffs, commit, reset, restart and collect garbage; then drain and verify that "
        "every committed message was executed exactly once.",
        epilog=EXAMPLES,
    )
    sim.add_argument(
        "--dir",
        type=path_arg,
        default=DEFAULT_DIR,
        help=f"run directory: queue/, report.json, report.png (default: {DEFAULT_DIR})",
    )
    sim.add_argument("--fresh", action="store_true", help="delete a previous run's queue first")
    sim.add_argument(
        "--shards", type=int, default=4, help="basechain shards, a power of 2 (default 4)"
    )
    length = sim.add_mutually_exclusive_group()
    length.add_argument("--rounds", type=int, default=None, help="rounds (default 4000)")
    length.add_argument("--duration", type=float, default=None, help="seconds instead of rounds")
    sim.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    sim.add_argument(
        "--fanout", type=int, default=2, help="max messages sent per executed one (default 2)"
    )
    sim.add_argument(
        "--commit-every", type=int, default=4, help="rounds per masterchain block (default 4)"
    )
    sim.add_argument(
        "--gc-every",
        type=int,
        default=0,
        help="explicit GC every N rounds instead of the background worker (0, the default: "
        "background)",
    )
    sim.add_argument(
        "--kill",
        action="store_true",
        help="run the queue in a child process and kill it (SIGKILL) at restarts",
    )
    sim.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="node processes, each with its own queue: one collates each shard, the others "
        f"apply its diffs; at the end all must agree (default 1: one in-process queue; at "
        f"most {MAX_NODES})",
    )
    sim.add_argument(
        "--record",
        type=path_arg,
        help="record every queue call to this JSON-lines log (with --nodes: node 0's queue)",
    )
    sim.add_argument("--no-plot", action="store_true", help="do not draw report.png")
    sim.set_defaults(
        run=run,
        interrupted="the run stopped part way and was not verified; its queue stays in "
        "the run directory (`imq simulate --fresh` starts over)",
    )


class _Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line every 5 s otherwise."""

    def __init__(self, total: int | None, duration: float | None, stream: TextIO) -> None:
        self.total = total
        self.duration = duration
        self.stream = stream
        self.tty = stream.isatty()
        self.every = 0.1 if self.tty else 5.0
        self.started = time.monotonic()
        self.last = 0.0
        self.drawn = False

    def __call__(self, result: SimResult, drain: bool) -> None:
        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last = now
        elapsed = now - self.started
        if self.total:
            frac = min(1.0, result.rounds / self.total)
        elif self.duration:
            frac = min(1.0, elapsed / self.duration)
        else:
            frac = 0.0
        bar = "#" * int(frac * 30)
        phase = "draining" if drain else f"round {result.rounds:,}"
        line = (
            f"[{bar:<30}] {frac * 100:5.1f}%  {phase}  blocks {result.blocks:,}  "
            f"delivered {result.messages_delivered:,}  restarts {result.restarts}  "
            f"{elapsed:,.0f}s"
        )
        self.stream.write(f"\r{line}" if self.tty else f"{line}\n")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


_WRITE_LOG = "write the op log"


class _OpLogFile:
    """The ``--record`` file, whose write errors name it: a file that opens but refuses
    writes (``/proc/version``; ``/dev/full``, a full disk) fails in a write or at the
    close, where the ``OSError`` names no path."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._file = path.open("w", encoding="utf-8")

    def write(self, text: str) -> int:
        with self._naming():
            return self._file.write(text)

    def flush(self) -> None:
        with self._naming():
            self._file.flush()

    def __enter__(self) -> _OpLogFile:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is not None:  # the run's own error (or a Ctrl-C) is the one to tell
            with contextlib.suppress(OSError):
                self._file.close()
            return
        with self._naming():
            self._file.close()

    @contextlib.contextmanager
    def _naming(self) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            if isinstance(exc, FileAccessError):
                raise
            raise FileAccessError(self._path, _WRITE_LOG, exc) from exc


def _check_paths(directory: Path, record: Path | None) -> None:
    """Refuse a run directory or op log that cannot be made, before anything is."""
    blocker = file_in_the_way(directory)
    if blocker is not None:
        where = "is a file" if blocker == directory else f"is under {blocker}, a file"
        raise PathError(
            f"--dir {directory} {where}; give a directory (the run's queue/, report.json "
            "and report.png go there)"
        )
    if record is None:
        return
    if record.is_dir():
        exc = IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(record))
        raise FileAccessError(record, _WRITE_LOG, exc)
    blocker = file_in_the_way(record.parent)
    if blocker is not None:
        raise PathError(f"cannot write the op log {record}: {blocker} is a file, not a directory")


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    rounds = args.rounds if args.rounds is not None or args.duration is not None else DEFAULT_ROUNDS
    config = SimConfig(
        directory=args.dir,
        shards=args.shards,
        rounds=rounds,
        duration=args.duration,
        seed=args.seed,
        fanout=args.fanout,
        fresh=args.fresh,
        commit_every=args.commit_every,
        # A recording needs GC at chosen points, not on a timer, to replay step by step.
        gc_every=args.gc_every or (5 if args.record is not None else 0),
        nodes=args.nodes,
    )
    _check_paths(args.dir, args.record)
    progress = _Progress(rounds, args.duration, err)
    with contextlib.ExitStack() as stack:
        log: OpLog | None = None

        def recording() -> OpLog:
            """The op log, its file created (or emptied) at the recorded queue's first
            open: after the run's own checks, so a refused run leaves the file alone."""
            nonlocal log
            if log is None:
                try:
                    args.record.parent.mkdir(parents=True, exist_ok=True)
                    sink = stack.enter_context(_OpLogFile(args.record))
                except OSError as exc:
                    raise FileAccessError(args.record, _WRITE_LOG, exc) from exc
                log = OpLog(cast("TextIO", sink))
            return log

        sim = _build(config, args, progress, recording if args.record is not None else None)
        try:
            try:
                with frozen_startup_heap():  # this command is the host process
                    result = sim.run()
            finally:
                progress.close()
        except Exception as exc:
            if sim.started:  # the verdict, with what the checks found until the error
                print(sim.result.stopped_verdict(exc), file=out)
                if isinstance(exc, ValueError | TypeError) and not isinstance(exc, ImqError):
                    # a call the queue refused mid-run stopped it (1), not the command
                    # line (2, which a bare ValueError means to imq's main)
                    print(f"imq: error: {' '.join(str(exc).split())}", file=err)
                    return 1
            raise
    print(result.verdict(), file=out)
    if config.nodes > 1 and not result.disagreements:
        print(
            f"nodes: {config.nodes} agree (pointers, last committed block, "
            f"{result.agreed_contents_messages:,} stored messages read back alike, "
            f"{result.agreed_exports} byte-identical top-block exports per node)",
            file=out,
        )
    print(table(result), file=out)
    json_path = config.directory / "report.json"
    write_json(result, json_path)
    print(f"\n  JSON:    {json_path}", file=out)
    if not args.no_plot:
        png = config.directory / "report.png"
        try:
            write_plot(result, png)
            print(f"  picture: {png}", file=out)
        except PlotUnavailableError as exc:
            print(f"  picture: none ({exc})", file=out)
    if args.record is not None:
        print(f"  op log:  {args.record}", file=out)
    return 0 if result.verified else 1


def _quiet_child() -> None:
    """The queue process logs warnings only, as the command does by default."""
    configure_for_cli("warning")


def _kill(queue: SimQueue) -> None:
    if isinstance(queue, ChildQueue | RecordingQueue):
        queue.kill()
    else:  # pragma: no cover - only a ChildQueue is ever given
        queue.close()


def _child(path: Path, queue_config: QueueConfig) -> SimQueue:
    return ChildQueue(path, queue_config, setup=_quiet_child)


def _build(
    config: SimConfig,
    args: argparse.Namespace,
    progress: _Progress,
    log: Callable[[], OpLog] | None,
) -> Simulation:
    base: Opener = _child if args.kill or args.nodes > 1 else default_opener
    opener = base
    if log is not None:
        # A log replays one queue: with --nodes, node 0's (directory "queue", see
        # Simulation.db_paths), which collates some shards and applies the others' diffs.
        def opener(path: Path, queue_config: QueueConfig) -> SimQueue:
            if path.name != "queue":
                return base(path, queue_config)
            return log().open(base, path, queue_config)

    crash = _kill if args.kill else None  # with --nodes alone, restarts close cleanly
    return Simulation(config, opener=opener, on_round=progress, crash=crash)
