"""What the ``imq`` subcommands share: the argument parser, value types, path checks, the
replacement of a database directory, the check of a queue's close, and a progress
heartbeat.

Ids that start with ``-``. Masterchain shards, block ids and file names start with
``-1``: ``--shard -1:8000000000000000``, ``--block-id -1:8000000000000000:57``,
``-1_8000000000000000_57_....queue``. argparse takes any ``-`` word that is not a
plain negative number for an option; :class:`Parser` widens its "negative number"
pattern to ``-<digits>`` followed by ``:``, ``_`` or ``.``, so such words are values
wherever they appear. A ``--`` right before one of them is accepted and dropped
(:func:`normalize_argv`), so options may still follow it.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from time import monotonic
from types import TracebackType
from typing import Any, Protocol, TextIO

from imq.config import QueueConfig
from imq.errors import FileAccessError, ImqError, StorageError
from imq.queue import Queue
from imq.state.block import parse_block_id_name
from imq.storage.rocks import holds_database_files, wipe_database
from imq.types import BlockId, ShardIdent

__all__ = [
    "Commands",
    "Heartbeat",
    "Parser",
    "PathError",
    "block_id_arg",
    "checked_queue",
    "database_dir",
    "input_file",
    "new_database_dir",
    "normalize_argv",
    "output_file",
    "path_arg",
    "shard_arg",
    "wipe_database",
]

# A plain negative number, or -<digits> then ':', '_' or '.' and anything: an id or a file
# name of the masterchain, never an option of imq.
_HELP_WIDTH = 88
_NEGATIVE_OR_ID = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d+[:_.].*$")


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that takes ``-1:...`` and ``-1_...`` words for values. The
    epilog (examples) is printed as written; a one-paragraph description is wrapped."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        description = kwargs.get("description")
        if description and "\n" not in description:
            kwargs["description"] = textwrap.fill(description, _HELP_WIDTH)
        super().__init__(*args, **kwargs)
        # argparse consults this pattern to tell a value that starts with '-' from an
        # option (it is set per parser in ArgumentParser.__init__; subparsers are built
        # with this same class).
        self._negative_number_matcher = _NEGATIVE_OR_ID


class Commands(Protocol):
    """What ``register(commands)`` gets: argparse's subparsers action."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Drop a ``--`` that comes right before one value: an id-like word (``-1_....queue``,
    a value anyway for :class:`Parser`) or any word not starting with ``-`` (a path), so
    that the options after it still count, as the README promises. Before any other
    word starting with ``-`` it keeps its usual meaning (the rest are positional)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--" and i + 1 < len(argv):
            word = argv[i + 1]
            if not word.startswith("-") or _NEGATIVE_OR_ID.match(word):
                continue
        out.append(arg)
    return out


# -- value types --------------------------------------------------------------------------------


def path_arg(text: str) -> Path:
    """A path given on the command line. An empty word (an unset variable: ``--db "$DB"``)
    is refused, as ``Queue.open`` refuses it, instead of meaning the current directory."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (an unset variable?): pass a path")
    return Path(text)


def shard_arg(text: str) -> ShardIdent:
    """``--shard`` values: ``wc:prefix16``."""
    try:
        return ShardIdent.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def block_id_arg(text: str) -> BlockId:
    """Block ids: ``wc:shard:seqno`` (no hashes), ``wc:shard:seqno:root:file``, or a
    node's file name (``wc_shard_seqno_root_file[.queue]``)."""
    try:
        return BlockId.parse(text)
    except ValueError:
        pass
    try:
        return parse_block_id_name(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a block id: {text!r} (expected wc:shard:seqno or wc:shard:seqno:root:file)"
        ) from None


# -- paths --------------------------------------------------------------------------------------


class PathError(ImqError):
    """A path given to the command cannot be used; the message says why."""


def _holds_database(path: Path) -> bool:
    return (path / "CURRENT").is_file()


def _check_current_not_lost(path: Path) -> None:
    """A directory without CURRENT but with a RocksDB's other files (a MANIFEST, table
    or log files) is a database that lost its CURRENT file (or a deletion cut short):
    say so, rather than that it holds no database."""
    if holds_database_files(p.name for p in path.iterdir()):
        raise PathError(
            f"{path} holds a RocksDB database's files (MANIFEST, table or log files) but no "
            "CURRENT file: the file was lost or damaged, or a deletion of the database was "
            "cut short; restore the directory from a copy (nothing was changed)"
        )


def database_dir(path: Path) -> Path:
    """An existing queue database directory, or one clear :class:`PathError` (or
    :class:`FileAccessError` where this user may not look into it)."""
    try:
        if not path.exists():
            raise PathError(f"no queue database at {path}: the path does not exist")
        if not path.is_dir():
            raise PathError(f"no queue database at {path}: it is a file, not a directory")
        if not _holds_database(path):
            _check_current_not_lost(path)
            raise PathError(f"no queue database at {path}: the directory holds no database")
    except PermissionError as exc:
        raise FileAccessError(path, "open queue database", exc) from None
    return path


def new_database_dir(path: Path) -> Path:
    """Where a database may be created or reused: missing, empty, or a queue database."""
    if path.exists() and not path.is_dir():
        raise PathError(f"{path} is a file, not a queue database directory")
    if path.is_dir() and not _holds_database(path) and any(path.iterdir()):
        _check_current_not_lost(path)
        raise PathError(
            f"{path} holds other files but no queue database; give a new or empty directory"
        )
    return path


def input_file(path: Path, what: str) -> Path:
    """A file to read, or one clear :class:`PathError`."""
    if not path.exists():
        raise PathError(f"{what} {path} does not exist")
    if path.is_dir():
        raise PathError(f"{what} {path} is a directory, not a file")
    return path


def output_file(path: Path) -> Path:
    """A file to write (replaced if it exists), in a directory that exists."""
    if path.is_dir():
        raise PathError(f"output {path} is a directory, not a file")
    parent = path.parent
    if not parent.is_dir():
        blocker = file_in_the_way(parent)
        if blocker is not None:  # not to be reported as missing: it exists
            raise PathError(f"cannot write {path}: {blocker} is a file, not a directory")
        raise PathError(f"cannot write {path}: directory {parent} does not exist")
    return path


def file_in_the_way(directory: Path) -> Path | None:
    """The file (not a directory) that ``directory`` or the nearest of its existing
    ancestors is, if any: the path where a directory is wanted but a file stands."""
    found = next((p for p in (directory, *directory.parents) if p.exists()), None)
    return found if found is not None and not found.is_dir() else None


# -- a queue's close ------------------------------------------------------------------------------


def _damaged_hint(path: Path) -> str:
    return (
        f"run `imq verify {path}`, and if the files are damaged restore the directory from "
        "a copy (or rebuild it from a persistent state in a new directory)"
    )


@contextlib.contextmanager
def checked_queue(path: Path, operation: str) -> Iterator[Queue]:
    """The queue at ``path``, opened for a command that writes (GC off), whose work must
    be known done: when RocksDB reports an error as the queue closes
    (:attr:`Queue.close_error`), raise :class:`~imq.errors.StorageError`. A failed
    background job shows only there: a manual compaction that met a damaged table file
    returns as if it had succeeded. A :class:`~imq.errors.StorageError` raised inside
    for damaged files (a write refused after a background job met them, say) gets the
    same advice instead of the library's "open it again", which would not help."""
    try:
        with Queue.open(path, QueueConfig(gc_enabled=False)) as queue:
            yield queue
    except StorageError as exc:
        if "Corruption" not in exc.reason:
            raise
        raise StorageError(path, exc.operation, exc.reason, _damaged_hint(path)) from exc
    if queue.close_error is not None:
        full = "No space left" in str(queue.close_error)
        raise StorageError(
            path,
            operation,
            f"RocksDB failed as the queue closed: {queue.close_error}",
            hint=(
                f"the disk is full: free space, then run the {operation} again (what it "
                f"already stored counts as stored; `imq verify {path}` checks the directory)"
                if full
                else f"the {operation} may not be done; {_damaged_hint(path)}"
            ),
        )


# -- progress -----------------------------------------------------------------------------------


class Heartbeat:
    """Progress on stderr for work that has no natural count (a GC pass, a compaction):
    nothing for the first second, then the status and the elapsed time, redrawn every
    second on a terminal or printed every ten seconds otherwise, and a last line at the
    end if anything was shown."""

    def __init__(
        self,
        label: str,
        *,
        enabled: bool = True,
        after: float = 1.0,
        stream: TextIO | None = None,
    ) -> None:
        self._label = label
        self._enabled = enabled
        self._after = after
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._every = 1.0 if self._tty else 10.0
        self._status = "working"
        self._shown = False
        self._started = monotonic()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="imq-cli-progress", daemon=True)

    def update(self, status: str) -> None:
        self._status = status

    def progress(self, unit: str) -> Callable[[int, int], None]:
        """A ``(done, total)`` callback that sets the status to ``done/total unit``."""

        def report(done: int, total: int) -> None:
            self.update(f"{done:,}/{total:,} {unit}")

        return report

    def _write(self, final: bool) -> None:
        with self._lock:
            line = f"{self._label}: {self._status} ({monotonic() - self._started:.0f} s)"
            end = "\n" if final or not self._tty else ""
            self._stream.write(f"\r{line}{end}" if self._tty else f"{line}{end}")
            self._stream.flush()
            self._shown = True

    def _loop(self) -> None:
        if self._done.wait(self._after):
            return
        while True:
            self._write(final=False)
            if self._done.wait(self._every):
                return

    def __enter__(self) -> Heartbeat:
        self._started = monotonic()
        if self._enabled:
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._shown:
            self._write(final=True)
