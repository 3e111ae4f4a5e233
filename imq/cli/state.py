"""``imq import``, ``imq export`` and ``imq dump-diff``: persistent queue states for operators."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TextIO, cast

from imq.cli.common import (
    Commands,
    Heartbeat,
    block_id_arg,
    checked_queue,
    database_dir,
    input_file,
    new_database_dir,
    output_file,
    path_arg,
    shard_arg,
)
from imq.config import QueueConfig
from imq.errors import (
    CommitError,
    DiffConflictError,
    FileAccessError,
    ImqError,
    StateFormatError,
    StorageError,
)
from imq.queue import Queue
from imq.state.block import check_block_id, parse_block_id_name, read_block_top_update
from imq.state.exporter import MAX_TAIL_LEN
from imq.state.reader import StateReader, header_check
from imq.state.source import DIFF_MAGIC, STREAM_READ_HINT, open_source
from imq.state.tl import TlDiff, decode_diff, diff_hash
from imq.storage.rocks import LOCK_FILE, says_disk_full, wipe_database
from imq.types import BlockId, BlockIdShort, ShardIdent

if TYPE_CHECKING:
    from imq.state.importer import ImportReport

__all__ = [
    "diff_json",
    "dump_diff",
    "parse_top_update",
    "register",
    "resolve_block_id",
    "run_export",
    "run_import",
]

_SHARD_160 = "tests/data/tycho/persistent_state/shard.bin"
_MASTER_90 = "tests/data/tycho/persistent_state/master.bin"
_FIRST_DIFF = "tests/data/tycho/first_block/first_block_queue_diff.bin"
_TOP_160 = "794fe9ce31b7919d2b6ca9ae0f97501f4017382a273b8f3ee512dcfcb5b14482"
_TOP_90 = "5795ca5d1b8d0c1ce96394eef851bde718ff2e14fd2840098ed2bb7640f278c5"

IMPORT_EXAMPLES = f"""\
The block id comes from the file's name (a node names its states
wc_shard_seqno_roothash_filehash.queue) unless --block-id gives it. A masterchain name
or id starts with '-': it is a value all the same (or put the file after '--'). The
file may be a pipe (- or /dev/stdin, a FIFO, <(...)): it is read once.

examples (from the repository root):
  imq import var/tycho-db {_SHARD_160} --block-id 0:8000000000000000:160 --top-update {_TOP_160}:3
  imq import var/tycho-db {_MASTER_90} --block-id -1:8000000000000000:90 --top-update={_TOP_90}:1
"""

EXPORT_EXAMPLES = """\
examples (from the repository root, after the import examples):
  imq export var/tycho-db --shard 0:8000000000000000 --seqno 160 --tail-len 3 var/160.queue
  imq export var/tycho-db --shard -1:8000000000000000 --seqno 90 --tail-len 1 var/90.bin
"""

DUMP_EXAMPLES = f"""\
JSON: always a list of diffs (one for a bare diff), with full keys ({{"lt": int,
"hash": hex}}) and ids (QueueKey.from_json, ShardIdent.parse, BlockIdShort.parse read them).

examples (from the repository root):
  imq dump-diff {_FIRST_DIFF}
  imq dump-diff --json {_SHARD_160}
"""


def register(commands: Commands) -> None:
    """Add ``import``, ``export`` and ``dump-diff``."""
    load = commands.add_parser(
        "import",
        help="import a persistent queue state file (raw or zstd .queue) into a database",
        description="Cold start: import a state all or nothing. The database is created "
        "only once the file's header has been read and checked, and removed again if the "
        "import fails.",
        epilog=IMPORT_EXAMPLES,
    )
    load.add_argument("db", type=path_arg, help="database directory (created if missing)")
    load.add_argument(
        "file", type=input_arg, help="state file (.queue = zstd, or raw; - reads stdin)"
    )
    load.add_argument(
        "--block-id",
        type=block_id_arg,
        help="wc:shard:seqno[:roothash:filehash] (default: taken from the file's name)",
    )
    checks = load.add_mutually_exclusive_group()
    checks.add_argument(
        "--top-update", help="HASH:TAIL the state must match (top diff hash, tail length)"
    )
    checks.add_argument(
        "--block",
        type=path_arg,
        help="a block file whose out_msg_queue_updates the state must match",
    )
    load.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    load.set_defaults(
        run=_import_command,
        interrupted="the import was rolled back (or is, at the database's next open): "
        "the database keeps nothing of the state (a directory the import created is "
        "removed)",
    )

    save = commands.add_parser(
        "export",
        help="write the persistent queue state of a block (zstd when OUT ends in .queue)",
        description="Write the state of block (--shard, --seqno) with its --tail-len diffs. "
        "Reads the database without changing its data (safe beside a live node, and on a "
        "directory this user cannot write).",
        epilog=EXPORT_EXAMPLES,
    )
    save.add_argument("db", type=path_arg, help="database directory")
    save.add_argument(
        "--shard", required=True, type=shard_arg, help="block shard, e.g. 0:8000000000000000"
    )
    save.add_argument("--seqno", required=True, type=int, help="block seqno")
    save.add_argument(
        "--tail-len", required=True, type=_tail_len, help="number of diffs to include"
    )
    save.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    save.add_argument("out", type=path_arg, help="output file")
    save.set_defaults(
        run=_export_command,
        interrupted="nothing was written to the output (a partial file is removed) and "
        "the database is unchanged",
    )

    dump = commands.add_parser(
        "dump-diff",
        help="print a queue diff (or a state's diffs) with the computed hash",
        description="Print a bare queue diff (.bin) or every diff of a queue state file "
        "(the whole state file is read and checked: a file cut short or damaged fails).",
        epilog=DUMP_EXAMPLES,
    )
    dump.add_argument(
        "file", type=input_arg, help="queue diff (.bin) or queue state file (- reads stdin)"
    )
    dump.add_argument("--json", action="store_true", help="print JSON (a list of diffs)")
    dump.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    dump.set_defaults(run=_dump_command, interrupted="nothing was changed")


def _tail_len(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 1 <= n <= MAX_TAIL_LEN:
        raise argparse.ArgumentTypeError(f"tail_len must be in 1..={MAX_TAIL_LEN}, got {n}")
    return n


def _import_command(args: argparse.Namespace, out: TextIO) -> None:
    top = None if args.top_update is None else parse_top_update(args.top_update)
    run_import(
        args.db,
        args.file,
        block_id=args.block_id,
        top_update=top,
        block_file=args.block,
        progress=not args.no_progress,
        out=out,
    )


def _export_command(args: argparse.Namespace, out: TextIO) -> None:
    run_export(
        args.db,
        args.shard,
        args.seqno,
        args.tail_len,
        args.out,
        progress=not args.no_progress,
        out=out,
    )


def _dump_command(args: argparse.Namespace, out: TextIO) -> None:
    dump_diff(args.file, as_json=args.json, out=out, progress=not args.no_progress)


def input_arg(text: str) -> Path:
    """A file argument to read: ``-`` is standard input (``/dev/stdin``), as Unix tools
    take it; anything else as ``path_arg``."""
    return Path("/dev/stdin") if text == "-" else path_arg(text)


def resolve_block_id(text: str | None, file: Path) -> BlockId:
    """``--block-id`` (``wc:shard:seqno[:root:file]`` or a file name), or else the id in
    the file's name."""
    if text is not None:
        try:
            return BlockId.parse(text)
        except ValueError:
            return parse_block_id_name(text)
    try:
        return parse_block_id_name(file.name)
    except ValueError:
        raise ValueError(
            f"{file.name} does not name its block; give --block-id wc:shard:seqno[:root:file]"
        ) from None


def parse_top_update(text: str) -> tuple[bytes, int]:
    """``HASH:TAIL``: the top diff's hash in hex and the tail length."""
    hash_hex, sep, tail = text.rpartition(":")
    try:
        diff_hash_ = bytes.fromhex(hash_hex)
        tail_len = int(tail)
    except ValueError:
        raise ValueError(f"--top-update must be HASH:TAIL, got {text!r}") from None
    if not sep or len(diff_hash_) != 32 or not 0 <= tail_len < 1 << 32:
        raise ValueError(
            "--top-update must be a 64-hex-digit hash, ':' and a tail length in 0..2**32-1"
        )
    return diff_hash_, tail_len


# A state file carries no checksum: each diff is checked against the next one's
# ``prev_hash`` and each message against its hash, but the newest diff only against the
# block's top update.
_UNCHECKED_TOP = (
    "imq import: note: no --block or --top-update given, so the newest diff's own fields "
    "(its bounds and processed_to) are not checked against the block; pass one of them "
    "to detect damage there"
)


def run_import(
    db: Path,
    file: Path,
    *,
    block_id: BlockId | None,
    top_update: tuple[bytes, int] | None,
    block_file: Path | None,
    progress: bool,
    out: TextIO,
) -> None:
    """Check every path, the block file and the state's header; only then open (and so
    create) the database and import. ``block_id`` ``None``: the one the file's name
    gives (read once the file is known to exist)."""
    input_file(file, "state file")
    if block_id is None:
        block_id = resolve_block_id(None, file)
    new_database_dir(db)
    if block_file is not None:
        input_file(block_file, "block file")
        with (
            _reading(block_file, "read block file"),
            _naming(block_file, f"the block {block_id.short} (a block file of the node)"),
        ):
            update = read_block_top_update(block_file.read_bytes())
            if update.tail_len is None:
                raise StateFormatError("the block has no tail length")
        check_block_id(update, block_id)
        top_update = (update.diff_hash, update.tail_len)
        # A block id given without hashes takes the block file's (checked just above).
        block_id = BlockId(
            block_id.shard,
            block_id.seqno,
            block_id.root_hash if any(block_id.root_hash) else update.root_hash,
            block_id.file_hash if any(block_id.file_hash) else update.file_hash,
        )
        print(
            f"top update from {block_file.name}: {update.diff_hash.hex()}:{update.tail_len}",
            file=out,
        )
    try:
        raw = open(file, "rb")  # noqa: SIM115 - closed below, after the import
    except OSError as exc:
        raise FileAccessError(file, "read state file", exc) from exc
    report: ImportReport | None = None
    try:
        with raw, _reading(file, "read state file", only_reads=False):
            with _naming(file, f"the queue state of {block_id.short}"):
                state = _StateInput(raw)
                _check_header(state, block_id, top_update)
            # The import's own errors name the file and say what to do already.
            created = _first_missing(db)
            was_empty = created is None and _is_empty_directory(db)
            ours = False  # the queue this import opened is one it created: undo it on failure
            try:
                with checked_queue(db, "import") as queue:
                    # Decided under the queue's lock: another process may have created (and
                    # filled) the directory since it was looked at. A queue holding nothing
                    # is this import's (or an empty one, which loses nothing if removed).
                    ours = (created is not None or was_empty) and _holds_nothing(queue)
                    try:
                        report = queue.import_state(
                            state.again(), block_id, top_update, progress=progress
                        )
                    except (CommitError, DiffConflictError) as exc:
                        # The library's next step is a collator's; an operator's is another place.
                        raise ImqError(
                            f"{exc}. From `imq import`: this queue already holds newer or "
                            f"different diffs of {block_id.shard}; import the state into a new "
                            "directory, or use the queue as it is"
                        ) from exc
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt) and _holds_state(db, block_id):
                    # Ctrl-C after the import's last batch: the state is in, and stays.
                    exc.args = (_COMPLETE.format(file=file.name, db=db),)
                    raise
                if ours:  # a failed open (DatabaseLockedError: another writer) made nothing
                    _undo_created(db, created, was_empty, exc)
                raise
        rate = report.messages / report.seconds if report.seconds else 0.0
        print(
            f"imported {file.name} into {db}: {report.diffs} diffs "
            f"({report.written_diffs} written, {report.kept_diffs} already stored), "
            f"{report.messages:,} messages, {report.bytes:,} bytes in "
            f"{report.seconds:.2f} s ({rate:,.0f} messages/s)",
            file=out,
        )
        if top_update is None:  # after the import: a failure stays one line
            print(_UNCHECKED_TOP, file=sys.stderr)
    except KeyboardInterrupt as exc:
        if report is not None:  # the import is done (an audit: "rolled back" was said)
            exc.args = (_COMPLETE.format(file=file.name, db=db),)
        raise


_COMPLETE = "the import of {file} into {db} was complete: the database holds the whole state"


def _holds_state(db: Path, block_id: BlockId) -> bool:
    """After a Ctrl-C during an import: whether ``db`` holds the whole state of
    ``block_id`` (the interrupt came after the import's last batch, or the state was
    there before). Opening it first rolls back an import left unfinished."""
    if not (db / "CURRENT").is_file():
        return False
    try:
        with Queue.open(db, QueueConfig(gc_enabled=False)) as queue:
            pointer = queue.get_commit_pointers().get(block_id.shard)
            return (
                queue.unfinished_import() is None
                and pointer is not None
                and pointer.seqno == block_id.seqno
                and queue.get_diff_info(block_id.shard, block_id.seqno) is not None
            )
    except (ImqError, OSError):
        return False


def _first_missing(db: Path) -> Path | None:
    """The outermost directory of ``db``'s path that does not exist yet (``db`` itself, or
    a parent the import will create with it), or None when ``db`` exists."""
    if db.exists():
        return None
    first = db
    for parent in db.parents:
        if parent.exists():
            break
        first = parent
    return first


def _undo_created(db: Path, created: Path | None, was_empty: bool, exc: BaseException) -> None:
    """All or nothing: after a failed import, remove what it made (the directories it
    created, or the database it created in an empty directory, which stays). A storage
    failure is raised again with a hint for what is left; any other error is the
    caller's to raise."""
    gone = None
    if created is not None:
        _remove_created(db, created)
        gone = None if db.exists() else "the directory this import created was removed"
    elif was_empty:
        _empty_again(db)
        if _is_empty_directory(db):
            gone = f"the database this import created in {db} was removed"
    if gone is not None and isinstance(exc, StorageError):
        # The library's hint is a host's (close, reopen, the open rolls back); here
        # nothing is left to reopen.
        full = says_disk_full(exc.reason)
        raise StorageError(
            exc.path,
            exc.operation,
            exc.reason,
            f"{'the disk is full: ' if full else ''}{gone}; free the space (or fix the "
            "fault) and run the import again",
        ) from exc


def _holds_nothing(queue: Queue) -> bool:
    summary = queue.summary()
    return not (
        summary["shards"] or summary["commit_pointers"] or summary["last_committed_mc_block"]
    )


def _is_empty_directory(db: Path) -> bool:
    try:
        with os.scandir(db) as entries:
            return next(entries, None) is None
    except OSError:  # not a directory, or unreadable: the open says why
        return False


def _empty_again(db: Path) -> None:
    """Remove the database a failed import created in ``db`` (its files only, under its
    lock: :func:`wipe_database`, then the lock file), leaving the directory; anything
    unexpected leaves it as it is."""
    with contextlib.suppress(OSError, ImqError):
        wipe_database(db)
        (db / LOCK_FILE).unlink()


def _remove_created(db: Path, first: Path) -> None:
    """Remove the queue directory a failed import created (its database's files only,
    under its lock: :func:`wipe_database`), then the parents it created for it, up to
    ``first``, each only while empty; anything unexpected leaves it as it is."""
    _empty_again(db)
    with contextlib.suppress(OSError):  # a directory left non-empty stays, and its parents
        db.rmdir()
        if first == db:
            return
        for parent in db.parents:  # first is one of them
            parent.rmdir()  # only an empty directory goes (OSError ends the loop)
            if parent == first:
                return


class _StateInput:
    """The state file, opened once and read twice: by the header check, before any
    database exists, then from its start again by the import. A file that can seek is
    rewound; a pipe (a FIFO, ``/dev/stdin``, ``<(...)``) cannot be, and opening its path
    again would find it drained, so the bytes the check read are kept and read first."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self.name = raw.name  # what the readers' errors name
        self._seekable = raw.seekable()
        self._start = raw.tell() if self._seekable else 0
        self._kept: bytearray | None = None if self._seekable else bytearray()
        self._replay = b""
        self._pos = 0

    def read(self, n: int = -1, /) -> bytes:
        if self._pos < len(self._replay):
            end = len(self._replay) if n < 0 else min(len(self._replay), self._pos + n)
            data = self._replay[self._pos : end]
            self._pos = end
            return data + self._raw.read() if n < 0 else data
        data = self._raw.read(n)
        if self._kept is not None:
            self._kept += data
        return data

    def again(self) -> BinaryIO:
        """The input from its start once more (call it once, after the check)."""
        if self._seekable:
            self._raw.seek(self._start)
            return self._raw
        self._replay, self._kept, self._pos = bytes(self._kept or b""), None, 0
        return cast("BinaryIO", self)  # read() is all that open_source uses


@contextlib.contextmanager
def _reading(file: Path, operation: str, *, only_reads: bool = True) -> Iterator[None]:
    """An ``OSError`` while reading ``file`` (an I/O error: a read's own names no file)
    as a :class:`FileAccessError` naming it and saying what to do. The library's error
    for a file object the command handed it gets the advice for a path. ``only_reads``:
    the block holds nothing but reads of ``file`` (else other ``OSError`` pass as they
    are)."""
    try:
        yield
    except FileAccessError as exc:
        cause = exc.__cause__
        if STREAM_READ_HINT in str(exc) and isinstance(cause, OSError):
            raise FileAccessError(file, operation, cause) from cause
        raise
    except OSError as exc:
        if not only_reads:
            raise
        raise FileAccessError(file, operation, exc) from exc


@contextlib.contextmanager
def _naming(file: Path, what: str) -> Iterator[None]:
    """A :class:`StateFormatError` from reading ``file`` names it (the readers name only
    the offset) and says what to do."""
    try:
        yield
    except StateFormatError as exc:
        raise StateFormatError(
            f"{file}: {exc}; the file is not {what}, or it is damaged: check the path, "
            "or fetch the file again"
        ) from exc


def _check_header(
    state: _StateInput, block_id: BlockId, top_update: tuple[bytes, int] | None
) -> None:
    """Check the state's header (block, top update) before any database exists; the
    import checks it again, with everything else."""
    with open_source(cast("BinaryIO", state)) as src:
        StateReader(src, on_top=header_check(block_id, top_update))


def run_export(
    db: Path,
    shard: ShardIdent,
    seqno: int,
    tail_len: int,
    dest: Path,
    *,
    progress: bool = False,
    out: TextIO,
) -> None:
    """Export through a read-only open: nothing is created or changed in ``db``."""
    database_dir(db)
    output_file(dest)
    with Queue.open(db, QueueConfig(gc_enabled=False), read_only=True) as queue:
        report = queue.export_state(shard, seqno, tail_len, dest, progress=progress)
    print(
        f"exported {shard}:{seqno} to {dest}: {report.diffs} diffs, {report.messages:,} messages, "
        f"{report.chunks} chunks, {report.bytes:,} bytes"
        f"{'' if report.bit_exact else ' (not bit-exact: a prev_hash was unknown)'} "
        f"in {report.seconds:.2f} s",
        file=sys.stderr if _is_stream(dest, out) else out,
    )


def _is_stream(dest: Path, out: TextIO) -> bool:
    """Whether ``dest`` is the command's own output (``/dev/stdout``, or the file or pipe
    stdout goes to): its summary must not land among the state's bytes."""
    try:
        ours, theirs = os.stat(dest), os.fstat(out.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return False  # no file behind ``out`` (a test's buffer), or dest is gone
    return (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino)


def diff_json(diff: TlDiff, digest: bytes, hashes: int | None = None) -> dict[str, Any]:
    """One diff as JSON, lossless: keys as ``{"lt": int, "hash": hex}``
    (``QueueKey.from_json``), shards and block ids in their ``parse``-able text.
    ``hashes``: only the first this many message hashes (the text form shows three)."""
    shown = diff.n_messages if hashes is None else min(hashes, diff.n_messages)
    return {
        "block": str(BlockIdShort(diff.shard, diff.seqno)),
        "shard": str(diff.shard),
        "seqno": diff.seqno,
        "hash": digest.hex(),
        "prev_hash": diff.prev_hash.hex(),
        "processed_to": {str(s): k.to_json() for s, k in diff.processed_to},
        "min_message": diff.min_message.to_json(),
        "max_message": diff.max_message.to_json(),
        "messages": diff.n_messages,
        "message_hashes": [diff.hash_at(i).hex() for i in range(shown)],
        "router_src": {str(p): [str(a) for a in addrs] for p, addrs in diff.router_src},
        "router_dst": {str(p): [str(a) for a in addrs] for p, addrs in diff.router_dst},
    }


def dump_diff(file: Path, *, as_json: bool, out: TextIO, progress: bool = False) -> None:
    """Print a bare queue diff, or every diff in a state's header, with computed hashes.
    JSON is always a list of diffs, so both kinds of file read back the same way. A
    state's messages are all checked first; ``progress`` shows how far on stderr."""
    input_file(file, "file")
    try:
        raw = open(file, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise FileAccessError(file, "read the file", exc) from exc
    # Opened once and read once: a pipe (/dev/stdin, a FIFO) is drained by a first read,
    # so its first bytes, which tell a diff from a state, are kept and read again.
    with raw, _reading(file, "read the file"):
        given = _StateInput(raw)
        head = b""
        while len(head) < len(DIFF_MAGIC) and (more := given.read(len(DIFF_MAGIC) - len(head))):
            head += more  # a pipe may hand the first bytes over in pieces
        if head == DIFF_MAGIC:
            data = head + raw.read()
            with _naming(file, "a queue diff"):
                diff = decode_diff(data)
            diffs = [(diff, diff_hash(data))]
            title = f"queue diff {file.name}"
        else:
            with (
                _naming(file, "a queue diff or a queue state"),
                open_source(given.again()) as src,
            ):
                reader = StateReader(src)
                # The whole file, not only its header: a state cut short or damaged in its
                # chunks must not be shown as sound (each message against its diff's hashes).
                total, done = reader.total_messages, 0
                with Heartbeat(f"checking {file.name}", enabled=progress) as beat:
                    for segment in reader.segments():
                        done += len(segment.roots)
                        beat.update(f"{done:,}/{total:,} messages")
            header = reader.header
            diffs = list(zip(header.diffs, header.diff_hashes, strict=True))
            title = (
                f"queue state {file.name}: {header.shard}:{header.seqno}, {header.n_chunks} "
                f"chunks, {reader.total_messages} messages checked against their diffs' hashes"
            )
    # One diff's entry at a time: a state's message hashes are never all in text at once.
    if as_json:  # as json.dump(entries, out, indent=2) writes the list
        out.write("[")
        for i, (d, h) in enumerate(diffs):
            text = json.dumps(diff_json(d, h), indent=2).replace("\n", "\n  ")
            out.write(("," if i else "") + "\n  " + text)
        print("\n]" if diffs else "]", file=out)
        return
    print(title, file=out)
    for d, h in diffs:
        _print_diff(diff_json(d, h, hashes=_TEXT_HASHES), out)


_TEXT_HASHES = 3  # message hashes the text form shows of each diff


def _key_text(obj: dict[str, Any]) -> str:
    return f"{obj['lt']}:{obj['hash']}"


def _print_diff(entry: dict[str, Any], out: TextIO) -> None:
    def say(text: str) -> None:
        print(text, file=out)

    say(f"\ndiff {entry['block']}")
    say(f"  hash (blake3)   {entry['hash']}")
    say(f"  prev_hash       {entry['prev_hash']}")
    say(f"  min_message     {_key_text(entry['min_message'])}")
    say(f"  max_message     {_key_text(entry['max_message'])}")
    processed = entry["processed_to"]
    say("  processed_to    " + ("-" if not processed else ""))
    for shard, key in processed.items():
        say(f"    {shard} -> {_key_text(key)}")
    hashes = entry["message_hashes"]
    shown = ", ".join(h[:16] for h in hashes[:_TEXT_HASHES]) + (
        ", ..." if entry["messages"] > _TEXT_HASHES else ""
    )
    say(f"  messages        {entry['messages']}" + (f" ({shown})" if hashes else ""))
    for half in ("router_src", "router_dst"):
        parts = entry[half]
        say(
            f"  {half:15} "
            + (", ".join(f"p{p}: {len(a)} accounts" for p, a in parts.items()) or "-")
        )
