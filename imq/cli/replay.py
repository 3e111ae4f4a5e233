"""``imq replay LOG``: replay an op log on a fresh database and on the model."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from imq.cli.common import Heartbeat, PathError, input_file
from imq.testing import codec as c
from imq.testing.replay import OpLogError, ReplayDivergenceError, replay
from imq.types import BlockId, DiffZone

__all__ = ["OpLogError", "check_log", "register", "run"]

EXAMPLES = """\
A log comes from `imq simulate --record` (or imq.testing.record); docs/replay-format.md
describes it. Exit status 1 when the log is malformed or the replay diverges.

examples (from the repository root; the second after `imq simulate ... --record`):
  imq replay tests/replays/sim-2shards-seed7.jsonl
  imq replay var/sim/ops.jsonl
"""


def register(commands: Any) -> None:
    """Add ``replay`` to the ``imq`` sub-command parser."""
    cmd = commands.add_parser(
        "replay",
        help="replay a recorded op log on a fresh database and on the model, comparing each step",
        description="Replay every call of an op log on a fresh database and on the model of "
        "the queue, comparing each result with the log's and the database with the model.",
        epilog=EXAMPLES,
    )
    cmd.add_argument("log", type=Path, help="op log (JSON lines, docs/replay-format.md)")
    cmd.add_argument("--db", type=Path, help="fresh database directory (default: a temporary one)")
    cmd.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    cmd.set_defaults(
        run=run,
        interrupted="the replay stopped part way (a temporary database is removed; a --db "
        "one holds the steps replayed so far)",
    )


# What the replay reads of each op's arguments (docs/replay-format.md, "Operations"): the
# name and a decoder that raises on a malformed value (None: only required).
_Check = Callable[[Any], object] | None


def _each(decode: Callable[[Any], object]) -> Callable[[Any], object]:
    def check(values: Any) -> object:
        if not isinstance(values, list):
            raise TypeError(f"expected a list, got {type(values).__name__}")
        return [decode(v) for v in values]

    return check


def _hash(text: Any) -> object:
    return bytes.fromhex(text)


def _zone(text: Any) -> object:
    if text is not None and text not in DiffZone.__members__:
        raise ValueError(f"expected one of {', '.join(DiffZone.__members__)} or null")
    return c.dec_zone(text)


_DIFF_ARGS: dict[str, _Check] = {
    "block": c.dec_block,
    "diff": c.dec_diff,
    "hash": _hash,
    "statistics": c.dec_statistics,
    "check_sequence": _zone,
}
_ARGS: dict[str, dict[str, _Check]] = {
    "open": {},
    "close": {},
    "kill": {},
    "prepare_diff": _DIFF_ARGS,
    "apply_diff": _DIFF_ARGS,
    "write": {"pending": int},
    "discard": {"pending": int},
    "commit_diff": {"top_blocks": _each(c.dec_top), "partitions": None},
    "clear_uncommitted_state": {"partitions": None, "top_shards": _each(c.dec_shard)},
    "startup": {
        "last_applied_mc_block": BlockId.parse,
        "top_shards": _each(c.dec_shard),
        "partitions": None,
    },
    "iterate": {"partition": int, "ranges": _each(c.dec_range), "for_shard": c.dec_shard},
    "run_gc": {},
    "get_commit_pointers": {},
    "get_last_committed_mc_block_id": {},
    "get_diff_info": {"shard": c.dec_shard, "seqno": int, "zone": _zone},
    "get_diffs_tail_len": {"shard": c.dec_shard, "from_key": c.dec_key},
    "get_last_applied_seqno": {"shard": c.dec_shard},
    "load_diff_statistics": {"partition": int, "range": c.dec_range},
}
# Ops on the pending diff of an earlier prepare (they need no open queue of their own).
_PENDING_OPS = {"write", "discard"}


def _check_step(line: dict[str, Any], where: str) -> None:
    """One step line holds what the replay reads: a known op, its arguments (each one
    decodable), and a result or an error with a type."""
    op = line.get("op")
    if op not in _ARGS:
        raise OpLogError(
            f"{where}: unknown op {op!r} (the ops are listed in docs/replay-format.md)"
        )
    args = line.get("args", {})
    if not isinstance(args, dict):
        raise OpLogError(f'{where}: {op}: "args" is a JSON {type(args).__name__}, not an object')
    for name, decode in _ARGS[op].items():
        if name not in args:
            raise OpLogError(f"{where}: {op} without its argument {name!r}")
        if decode is None:
            continue
        try:
            decode(args[name])
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            reason = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
            raise OpLogError(f"{where}: {op}: argument {name!r} is not valid ({reason})") from None
    error = line.get("error")
    if "error" in line and not (isinstance(error, dict) and isinstance(error.get("type"), str)):
        raise OpLogError(f'{where}: {op}: "error" must be an object with a "type" string')


def check_log(path: Path) -> int:
    """Every line of the log is a JSON object: a version-1 header, then steps with distinct
    integer ``step`` numbers, each a known op with the arguments the replay reads; else
    :class:`OpLogError` naming the file and the line (the replay's reader would name
    neither). Blank lines after the header are allowed, as the reader allows them.

    A call the replay cannot make is refused here too, naming its step (see
    :func:`_check_order`). Returns the number of steps."""
    input_file(path, "op log")
    steps: list[tuple[int, int, dict[str, Any]]] = []  # (step, line number, line)
    seen: dict[int, int] = {}
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number > 1 and not raw.strip():
                continue
            where = f"op log {path} line {number}"
            try:
                line = json.loads(raw.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError as exc:
                raise OpLogError(f"{where}: not UTF-8 text ({exc.reason})") from None
            except json.JSONDecodeError as exc:
                raise OpLogError(f"{where}: not JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(line, dict):
                raise OpLogError(f"{where}: a JSON {type(line).__name__}, not an object")
            if number == 1:
                if line.get("imq_ops") != c.FORMAT_VERSION:
                    raise OpLogError(
                        f"{where}: not an op log header of version {c.FORMAT_VERSION} "
                        f'("imq_ops": {json.dumps(line.get("imq_ops"))}); this imq reads '
                        f"version {c.FORMAT_VERSION} only"
                    )
                if not isinstance(line.get("zerostate_seqno", 0), int):
                    raise OpLogError(f'{where}: "zerostate_seqno" is not an integer')
                continue
            step = line.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                raise OpLogError(f'{where}: a step without an integer "step"')
            if step in seen:
                raise OpLogError(f"{where}: step {step} again (first on line {seen[step]})")
            seen[step] = number
            _check_step(line, where)
            steps.append((step, number, line))
        if f.tell() == 0:
            raise OpLogError(f"op log {path} is empty")
    _check_order(path, sorted(steps, key=lambda s: s[0]))
    return len(steps)


def _check_order(path: Path, steps: list[tuple[int, int, dict[str, Any]]]) -> None:
    """In step order (the replay's): no queue call before the first open, no second open
    before a close (a replay has one queue), and pending diffs only from an earlier
    prepare. Calls after a close are fine: they replay to the host's QueueClosedError."""
    state = "never opened"
    pending: set[int] = set()
    for step, number, line in steps:
        op = line["op"]
        where = f"op log {path} line {number} (step {step}, {op})"
        if op == "open":
            if state == "open":
                raise OpLogError(
                    f"{where}: the queue is opened again without a close; imq replay "
                    "replays one queue at a time"
                )
            state = "open"
        elif op in ("close", "kill"):
            if state == "open":
                state = "closed"
        elif op in _PENDING_OPS:
            token = int(line["args"]["pending"])
            if token not in pending:
                raise OpLogError(
                    f"{where}: pending diff {token} was not returned by an earlier prepare_diff"
                )
        elif state == "never opened":
            raise OpLogError(f"{where}: a queue call before the log opens its queue")
        elif op == "prepare_diff":
            result = line.get("result")
            if isinstance(result, dict) and isinstance(result.get("pending"), int):
                pending.add(result["pending"])


def _fresh_dir(db: Path) -> None:
    """``--db``: a directory to create, or an empty one."""
    if db.exists() and not db.is_dir():
        raise PathError(f"--db {db} is a file; give a new or empty directory")
    if db.is_dir() and any(db.iterdir()):
        raise PathError(
            f"--db {db} is not empty: a replay needs a fresh database; give a new or empty "
            "directory (or leave --db out for a temporary one)"
        )


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    steps = check_log(args.log)
    if args.db is not None:
        _fresh_dir(args.db)
    try:
        with Heartbeat("replay", enabled=not args.no_progress) as beat:
            beat.update(f"{steps:,} steps")
            report = replay(args.log, args.db)
    except ReplayDivergenceError as exc:
        print(f"replay: DIVERGED at step {exc.step} ({exc.op})", file=out)
        print(f"  first difference: {exc.difference}", file=out)
        return 1
    except OpLogError as exc:  # the replay names the step
        raise OpLogError(f"op log {args.log}: {exc}") from exc
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise OpLogError(
            f"op log {args.log} could not be replayed ({type(exc).__name__}: {exc}); "
            "check it against docs/replay-format.md"
        ) from exc
    print(
        f"replay: {report.steps:,} steps agree with the log and the model "
        f"({report.checks:,} state comparisons)",
        file=out,
    )
    return 0
