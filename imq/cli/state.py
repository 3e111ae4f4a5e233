"""``imq import``, ``imq export`` and ``imq dump-diff``: persistent queue states for operators."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from imq.config import QueueConfig
from imq.errors import StateFormatError
from imq.queue import Queue
from imq.state.block import check_block_id, parse_block_id_name, read_block_top_update
from imq.state.source import DIFF_MAGIC, open_source
from imq.state.tl import TlDiff, decode_diff, diff_hash, read_state_header
from imq.types import BlockId, ShardIdent

__all__ = ["dump_diff", "parse_top_update", "resolve_block_id", "run_export", "run_import"]


def resolve_block_id(text: str | None, file: Path) -> BlockId:
    """``--block-id`` as ``wc:shard:seqno:root:file``, or else the id in the file's name."""
    if text is not None:
        try:
            return BlockId.parse(text)
        except ValueError:
            return parse_block_id_name(text)
    try:
        return parse_block_id_name(file.name)
    except ValueError:
        raise ValueError(
            f"{file.name} does not name its block; give --block-id wc:shard:seqno:root:file"
        ) from None


def parse_top_update(text: str) -> tuple[bytes, int]:
    """``HASH:TAIL``: the top diff's hash in hex and the tail length."""
    hash_hex, sep, tail = text.rpartition(":")
    try:
        diff_hash_ = bytes.fromhex(hash_hex)
        tail_len = int(tail)
    except ValueError:
        raise ValueError(f"--top-update must be HASH:TAIL, got {text!r}") from None
    if not sep or len(diff_hash_) != 32 or tail_len < 0:
        raise ValueError("--top-update must be a 64-hex-digit hash, ':' and a tail length")
    return diff_hash_, tail_len


def run_import(
    db: Path,
    file: Path,
    *,
    block_id: BlockId,
    top_update: tuple[bytes, int] | None,
    block_file: Path | None,
    progress: bool,
    out: TextIO,
) -> None:
    if block_file is not None:
        update = read_block_top_update(block_file.read_bytes())
        check_block_id(update, block_id)
        if update.tail_len is None:
            raise StateFormatError(f"block {block_file.name} has no tail length")
        top_update = (update.diff_hash, update.tail_len)
        print(
            f"top update from {block_file.name}: {update.diff_hash.hex()}:{update.tail_len}",
            file=out,
        )
    with Queue.open(db, QueueConfig(gc_enabled=False)) as queue:
        report = queue.import_state(file, block_id, top_update, progress=progress)
    rate = report.messages / report.seconds if report.seconds else 0.0
    print(
        f"imported {file.name} into {db}: {report.diffs} diffs ({report.written_diffs} written, "
        f"{report.kept_diffs} already stored), {report.messages:,} messages, "
        f"{report.bytes:,} bytes in {report.seconds:.2f} s ({rate:,.0f} messages/s)",
        file=out,
    )


def run_export(
    db: Path, shard: ShardIdent, seqno: int, tail_len: int, dest: Path, *, out: TextIO
) -> None:
    with Queue.open(db, QueueConfig(gc_enabled=False)) as queue:
        report = queue.export_state(shard, seqno, tail_len, dest)
    print(
        f"exported {shard}:{seqno} to {dest}: {report.diffs} diffs, {report.messages:,} messages, "
        f"{report.chunks} chunks, {report.bytes:,} bytes"
        f"{'' if report.bit_exact else ' (not bit-exact: a prev_hash was unknown)'} "
        f"in {report.seconds:.2f} s",
        file=out,
    )


def _diff_json(diff: TlDiff, digest: bytes) -> dict[str, Any]:
    return {
        "hash": digest.hex(),
        "prev_hash": diff.prev_hash.hex(),
        "shard": str(diff.shard),
        "seqno": diff.seqno,
        "processed_to": {str(s): str(k) for s, k in diff.processed_to},
        "min_message": str(diff.min_message),
        "max_message": str(diff.max_message),
        "messages": diff.n_messages,
        "message_hashes": [diff.hash_at(i).hex() for i in range(diff.n_messages)],
        "router_src": {str(p): [str(a) for a in addrs] for p, addrs in diff.router_src},
        "router_dst": {str(p): [str(a) for a in addrs] for p, addrs in diff.router_dst},
    }


def dump_diff(file: Path, *, as_json: bool, out: TextIO) -> None:
    """Print a bare queue diff, or every diff in a state's header, with computed hashes."""
    with open(file, "rb") as f:
        head = f.read(4)
    if head == DIFF_MAGIC:
        data = file.read_bytes()
        diff = decode_diff(data)
        entries = [_diff_json(diff, diff_hash(data))]
        title = f"queue diff {file.name}"
    else:
        with open_source(file) as src:
            header = read_state_header(src)
        entries = [_diff_json(d, h) for d, h in zip(header.diffs, header.diff_hashes, strict=True)]
        title = f"queue state {file.name}: {header.shard}:{header.seqno}, {header.n_chunks} chunks"
    if as_json:
        json.dump(entries[0] if head == DIFF_MAGIC else entries, out, indent=2)
        print(file=out)
        return
    print(title, file=out)
    for entry in entries:
        _print_diff(entry, out)


def _print_diff(entry: dict[str, Any], out: TextIO) -> None:
    def say(text: str) -> None:
        print(text, file=out)

    say(f"\ndiff {entry['shard']}:{entry['seqno']}")
    say(f"  hash (blake3)   {entry['hash']}")
    say(f"  prev_hash       {entry['prev_hash']}")
    say(f"  min_message     {entry['min_message']}")
    say(f"  max_message     {entry['max_message']}")
    say(
        "  processed_to    "
        + (", ".join(f"{s} -> {k}" for s, k in entry["processed_to"].items()) or "-")
    )
    hashes = entry["message_hashes"]
    shown = ", ".join(h[:16] for h in hashes[:3]) + (", ..." if len(hashes) > 3 else "")
    say(f"  messages        {entry['messages']}" + (f" ({shown})" if hashes else ""))
    for half in ("router_src", "router_dst"):
        parts = entry[half]
        say(
            f"  {half:15} "
            + (", ".join(f"p{p}: {len(a)} accounts" for p, a in parts.items()) or "-")
        )
