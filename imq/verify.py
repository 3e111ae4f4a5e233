"""Integrity checks of a queue database: a full checksum scan and imq's cross-checks.

:func:`verify` reads every row of every table through checked cursors (RocksDB verifies
each block's checksum; a damaged block is reported, not skipped), decodes every row, and
checks what the tables must agree on:

- every diff info has its tail row and every tail row its diff info;
- the statistics of each diff count as many messages as the diff stored, and the
  messages stored inside the diff's key span are that many -- but for what GC deleted.
  GC deletes a (partition, source shard) up to its bound, which may stop inside a diff's
  span (at a ``processed_to``): in a partition whose bound reaches the span only more
  messages than the diff stored is a problem (no record says how many of them lay at or
  below the bound), and a message outside every stored diff is one only above its
  shard's bounds (GC deletes a diff's records once any partition's bound passes it);
- every commit pointer names a stored diff whose ``max_message`` it equals, or one that
  GC collected (then a requested GC bound of the shard reaches the pointer);
- a masterchain pointer comes with a last committed block.

At open, :func:`state_problems` runs the checks that cost a few point reads (each
commit pointer against its diff, the masterchain pointer against the last committed
block) and the queue logs what it finds as ``integrity_check_failed`` warnings without
refusing to open: the rules allow what GC legitimately does (the property tests found a
GC that collects the pointer's diff and its seqno applied again), and an operator is
better served by a queue that opens and says what looks wrong, then ``imq verify``.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imq.errors import CorruptDataError, ImqError
from imq.storage import Scan, Store, StoreOptions, Table, codec, ops
from imq.storage.backend import StoreProtocol
from imq.storage.queue_state import GcBounds
from imq.types import CommitPointer, QueueKey, ShardIdent

__all__ = ["Report", "state_problems", "verify"]


@dataclass
class Report:
    """What :func:`verify` found: rows read per table and the problems, one line each."""

    path: Path
    rows: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _rows(store: Store, table: Table, report: Report) -> list[tuple[bytes, bytes]] | None:
    """Every row of ``table`` through a checked cursor; ``None`` (and a problem) when
    RocksDB cannot read it."""
    try:
        with store.snapshot(scans=[Scan(table, b"", None)]) as snap:
            rows = list(snap.cursors[0])
    except ImqError as exc:
        report.problems.append(f"table {table.value}: cannot be read to its end: {exc}")
        return None
    report.rows[table.value] = len(rows)
    return rows


def _decode_all(
    rows: list[tuple[bytes, bytes]],
    decode: Callable[[bytes, bytes], Any],
    report: Report,
) -> list[tuple[bytes, Any]]:
    out = []
    for key, value in rows:
        try:
            out.append((key, decode(key, value)))
        except CorruptDataError as exc:
            report.problems.append(str(exc))
    return out


def verify(path: str | Path, options: StoreOptions | None = None) -> Report:
    """Check the database in ``path`` (opened read-only: safe beside a live writer)."""
    report = Report(Path(path))
    store = Store(Path(path), options, read_only=True)
    try:
        _verify(store, report)
    finally:
        store.close()
    return report


def _verify(store: Store, report: Report) -> None:
    tables = {t: _rows(store, t, report) for t in Table}
    infos: dict[tuple[ShardIdent, int], tuple[Any, dict[int, int]]] = {}
    for key, (info, parts) in _decode_all(
        tables[Table.DIFF_INFO] or [], codec.decode_diff_record, report
    ):
        infos[(codec.decode_shard(key[: codec.SHARD_LEN]), info.seqno)] = (info, parts)
    tails: set[tuple[ShardIdent, QueueKey, int]] = set()
    for key, (max_message, seqno) in _decode_all(
        tables[Table.DIFF_TAIL] or [], lambda k, _v: codec.decode_tail_key(k), report
    ):
        tails.add((codec.decode_shard(key[: codec.SHARD_LEN]), max_message, seqno))
    if tables[Table.DIFF_INFO] is not None and tables[Table.DIFF_TAIL] is not None:
        expected_tails = {(s, i.max_message, n) for (s, n), (i, _) in infos.items()}
        for shard, max_message, seqno in sorted(expected_tails - tails, key=str):
            report.problems.append(f"diff {shard}:{seqno} has no tail row (max {max_message})")
        for shard, max_message, seqno in sorted(tails - expected_tails, key=str):
            report.problems.append(f"tail row {shard}:{seqno} (max {max_message}) has no diff info")

    # Statistics per diff against the diff's own message counts.
    counted: dict[tuple[ShardIdent, int, int], int] = defaultdict(int)
    for key, (_max, entries) in _decode_all(
        tables[Table.STATISTICS] or [], codec.decode_stat_row, report
    ):
        shard = codec.decode_shard(key[: codec.SHARD_LEN])
        partition = int.from_bytes(key[codec.SHARD_LEN : codec.SHARD_LEN + 2], "big")
        seqno = int.from_bytes(key[-4:], "big")
        counted[(shard, seqno, partition)] += sum(n for _, n in entries)
    if tables[Table.STATISTICS] is not None:
        for (shard, seqno), (_info, parts) in sorted(infos.items(), key=str):
            for partition, stored in parts.items():
                got = counted.get((shard, seqno, partition), 0)
                if got != stored:
                    report.problems.append(
                        f"diff {shard}:{seqno} partition {partition}: statistics count {got} "
                        f"messages, the diff stored {stored}"
                    )

    # The GC bounds, the last committed block.
    values = dict(tables[Table.VARS] or [])
    requested = _gc_bounds(values, codec.GC_REQUESTED, report)
    executed = _gc_bounds(values, codec.GC_EXECUTED, report)
    last_mc = None
    try:
        raw = values.get(codec.LAST_COMMITTED_MC_BLOCK)
        last_mc = codec.decode_block_id(raw) if raw is not None else None
    except CorruptDataError as exc:
        report.problems.append(str(exc))

    # Messages inside each diff's span.
    message_rows = tables[Table.MESSAGES]
    if message_rows is not None:
        _check_messages(message_rows, infos, _gc_reach(requested, executed), report)

    # Commit pointers.
    pointers = dict(
        v for _, v in _decode_all(tables[Table.COMMIT_POINTERS] or [], codec.decode_pointer, report)
    )
    # Against where GC may have deleted (executed or requested, the higher): a requested
    # bound can fall below an executed one (a later masterchain block reading less, D7),
    # and the diff the executed bound collected is gone all the same.
    reach = _gc_reach(requested, executed)
    for shard, pointer in sorted(pointers.items(), key=str):
        found = infos.get((shard, pointer.seqno))
        problem = _pointer_problem(
            shard, pointer, None if found is None else found[0].max_message, reach
        )
        if problem is not None:
            report.problems.append(problem)
    if last_mc is None and ShardIdent.MASTERCHAIN in pointers:
        report.problems.append("a masterchain commit pointer but no last committed block")


def state_problems(store: StoreProtocol) -> list[str]:
    """The open-time cross-checks: every commit pointer against the diff stored under its
    seqno (or a GC bound that explains a collected one), and a masterchain pointer against
    the last committed block. A few point reads; nothing is decoded beyond the spans."""
    state = store.state
    problems: list[str] = []
    reach = _gc_reach(state.gc_requested, state.gc_executed)
    with ops.view(store, diffs=True) as view:
        for shard, pointer in sorted(state.pointers.items(), key=str):
            span = view.diff_span(shard, pointer.seqno)
            max_message = None if span is None else span[1]
            problem = _pointer_problem(shard, pointer, max_message, reach)
            if problem is not None:
                problems.append(problem)
    if state.last_mc_block is None and ShardIdent.MASTERCHAIN in state.pointers:
        problems.append("a masterchain commit pointer but no last committed block")
    return problems


def _gc_bounds(values: Mapping[bytes, bytes], name: bytes, report: Report) -> GcBounds:
    """The GC bounds stored under ``name`` in the vars table (none: empty)."""
    raw = values.get(name)
    if raw is None:
        return {}
    try:
        return codec.decode_gc_bounds(name, raw)
    except CorruptDataError as exc:
        report.problems.append(str(exc))
        return {}


def _gc_reach(requested: GcBounds, executed: GcBounds) -> GcBounds:
    """Per (partition, source shard), the highest key up to which GC may have deleted
    messages: the executed bound, or the requested one when it is higher. A pass writes
    its deletes before it marks their bound executed, in a later batch, so a snapshot
    taken between the two (``verify`` beside a live node) or a crash there finds rows
    gone up to a bound that is still only requested."""
    reach = dict(executed)
    for entry, bound in requested.items():
        if entry not in reach or bound > reach[entry]:
            reach[entry] = bound
    return reach


def _check_messages(
    rows: list[tuple[bytes, bytes]],
    infos: Mapping[tuple[ShardIdent, int], tuple[Any, dict[int, int]]],
    reach: GcBounds,
    report: Report,
) -> None:
    """Count the stored messages inside each diff's span, per partition, against the
    diff's record; ``reach`` (:func:`_gc_reach`) says where GC may have deleted."""
    spans: dict[ShardIdent, list[tuple[bytes, bytes, int]]] = defaultdict(list)
    for (shard, seqno), (info, _) in infos.items():
        lo, hi = codec.key_bytes(info.min_message), codec.key_bytes(info.max_message)
        spans[shard].append((lo, hi, seqno))
    starts: dict[ShardIdent, list[bytes]] = {}
    for shard, items in spans.items():
        items.sort()
        starts[shard] = [lo for lo, _, _ in items]
    # GC deletes a diff's records once its max_message is at or below the bound of any
    # partition (stage_delete): rows of the other partitions up to there are left behind.
    orphan_reach: dict[ShardIdent, bytes] = {}
    for (_partition, shard), bound in reach.items():
        key = codec.key_bytes(bound)
        orphan_reach[shard] = max(key, orphan_reach.get(shard, key))
    found: dict[tuple[ShardIdent, int, int], int] = defaultdict(int)
    prefix_len = codec.MESSAGE_PREFIX_LEN
    stray = 0
    shard_of: dict[bytes, ShardIdent] = {}
    for key, _value in rows:
        raw_shard = key[2:prefix_len]
        known = shard_of.get(raw_shard)
        if known is None:
            known = shard_of[raw_shard] = codec.decode_shard(raw_shard)
        qk = key[prefix_len:]
        of_shard = spans.get(known, [])
        i = bisect.bisect_right(starts[known], qk) - 1 if of_shard else -1
        if i < 0 or qk > of_shard[i][1]:
            if qk > orphan_reach.get(known, b""):
                stray += 1
            continue
        found[(known, of_shard[i][2], int.from_bytes(key[:2], "big"))] += 1
    if stray:
        report.problems.append(
            f"{stray} stored messages belong to no stored diff (above every GC bound of "
            "their shard)"
        )
    for (shard, seqno), (info, parts) in sorted(infos.items(), key=str):
        for partition, stored in parts.items():
            got = found.get((shard, seqno, partition), 0)
            problem = _count_problem(info, stored, got, reach.get((partition, shard)))
            if problem is not None:
                report.problems.append(f"diff {shard}:{seqno} partition {partition}: {problem}")


def _count_problem(info: Any, stored: int, got: int, gc_bound: QueueKey | None) -> str | None:
    """What is wrong with ``got`` messages in the span of a diff that stored ``stored`` in
    the partition, whose GC bound is ``gc_bound``. Below the span, nothing of the diff
    was collected: the count must match. Inside or above it, GC deleted the part at or
    below the bound, and no record says how many of the diff's messages lay there: only
    an excess shows."""
    if gc_bound is None or gc_bound < info.min_message:
        if got != stored:
            return f"{got} messages stored in its span, the diff record says {stored}"
    elif got > stored:
        return (
            f"{got} messages stored in its span, more than the {stored} the diff record "
            f"says (GC bound {gc_bound} lies inside the span)"
        )
    return None


def _pointer_problem(
    shard: ShardIdent,
    pointer: CommitPointer,
    max_message: QueueKey | None,
    reach: Mapping[tuple[int, ShardIdent], QueueKey],
) -> str | None:
    """What is wrong with ``pointer`` given the ``max_message`` of the diff stored under
    its seqno (``None``: none) and where GC may have deleted (:func:`_gc_reach`)."""
    if max_message == pointer.key:
        return None
    # GC may have collected the diff (and its seqno may hold a newer diff since): only up
    # to a bound requested (written with the commit) or executed for this shard.
    bound = max((k for (_, s), k in reach.items() if s == shard), default=None)
    if bound is not None and bound >= pointer.key:
        return None
    if max_message is None:
        return (
            f"commit pointer of {shard} names diff {pointer.seqno}, which is not stored "
            "and no GC bound of the shard reaches it"
        )
    return (
        f"commit pointer of {shard} ({pointer.key}) differs from the max_message "
        f"{max_message} of its diff {pointer.seqno}"
    )
