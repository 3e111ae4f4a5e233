"""Integrity checks of a queue database: a full checksum scan and imq's cross-checks.

:func:`verify` reads every row of every table through checked cursors (RocksDB verifies
each block's checksum; a damaged block is reported, not skipped; a block whose rows are
all range-deleted is not read by any scan, so not checked), decodes every row, and
checks what the tables must agree on:

- every diff info has its tail row and every tail row its diff info;
- the statistics of each diff count as many messages as the diff stored, and the
  messages stored inside the diff's key span are that many -- but for what GC deleted.
  GC deletes a (partition, source shard) up to its bound, which may stop inside a diff's
  span (at a ``processed_to``): in a partition whose bound reaches the span only more
  messages than the diff stored is a problem (no record says how many of them lay at or
  below the bound), and a message outside every stored diff is one only above its
  shard's bounds (GC deletes a diff's records once any partition's bound passes it);
  statistics rows of no stored diff likewise. The counts assume a network's history
  (logical time grows within a shard): diffs whose spans overlap, which the API accepts,
  are listed in :attr:`Report.notes` and their messages are not counted;
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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from imq.errors import CorruptDataError, ImqError, StorageError
from imq.storage import Scan, Store, StoreOptions, Table, codec, ops
from imq.storage.backend import StoreProtocol
from imq.storage.queue_state import GcBounds
from imq.storage.rocks import GONE_SINCE_OPEN, import_lock_held
from imq.types import CommitPointer, QueueKey, ShardIdent

__all__ = ["Report", "state_problems", "verify"]


@dataclass
class Report:
    """What :func:`verify` found: rows read per table and the problems, one line each."""

    path: Path
    rows: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    # What could not be checked, and why (no problem: the exit status stays 0)
    notes: list[str] = field(default_factory=list)
    # A file the read-only view opened with was gone when read: a live writer's
    # compaction, most likely (verify opens again and starts over, a few times).
    outdated: bool = field(default=False, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.problems


def _rows(store: Store, table: Table, report: Report) -> list[tuple[bytes, bytes]] | None:
    """Every row of ``table`` (a small one) through a checked cursor; ``None`` (and a
    problem) when RocksDB cannot read it."""
    try:
        return list(_Streamed(store, table, report, None))
    except _UnreadableError as exc:
        exc.report(report)
        return None


def _decode_all(
    rows: Iterable[tuple[bytes, bytes]],
    decode: Callable[[bytes, bytes], Any],
    report: Report,
) -> Iterator[tuple[bytes, Any]]:
    """Each row decoded, one at a time; an undecodable one is a problem, not yielded."""
    for key, value in rows:
        try:
            decoded = decode(key, value)
        except CorruptDataError as exc:
            report.problems.append(str(exc))
            continue
        yield key, decoded


class _Streamed:
    """The rows of one table, read through a checked cursor as they are asked for (so
    that the tables with rows per message, destination or diff are never held whole):
    counted into the report once read to the end, with ``progress(table, rows)`` every
    ``_PROGRESS_EVERY`` rows. A read that cannot reach the table's end raises (an
    ``ImqError``): the caller reports it and draws no conclusion from the part read."""

    def __init__(
        self,
        store: Store,
        table: Table,
        report: Report,
        progress: Callable[[str, int], object] | None,
    ) -> None:
        self._store, self._table, self._report = store, table, report
        self._progress = progress

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        name, progress = self._table.value, self._progress
        n = 0
        try:
            with self._store.snapshot(scans=[Scan(self._table, b"", None)]) as snap:
                for n, row in enumerate(snap.cursors[0], 1):
                    if progress is not None and n % _PROGRESS_EVERY == 0:
                        progress(name, n)
                    yield row
        except ImqError as exc:  # the read's own: the consumer's errors do not come here
            raise _UnreadableError(self._table, exc) from exc
        self._report.rows[name] = n


class _UnreadableError(Exception):
    """A streamed table could not be read to its end (``error``, RocksDB's)."""

    def __init__(self, table: Table, error: ImqError) -> None:
        super().__init__(table, error)
        self.table, self.error = table, error

    def report(self, report: Report) -> None:
        report.outdated |= _outdated(self.error)
        report.problems.append(f"table {self.table.value}: cannot be read to its end: {self.error}")


_PROGRESS_EVERY = 1 << 16  # rows between two progress calls of a streamed table


# Tables with rows per message, per destination or per diff, read as a stream; the others
# (a row per shard or a few in all) are read whole.
_STREAMED = (Table.MESSAGES, Table.STATISTICS, Table.DIFF_INFO, Table.DIFF_TAIL)


class _Span(NamedTuple):
    """Of a stored diff record, what the cross-checks use."""

    min_message: QueueKey
    max_message: QueueKey


_SELF_ADVICE = "; run `imq verify` on it for details"


# Read-only views a live writer's compactions outdated, opened again before the last
# one's findings stand (a writer compacting without pause outdates every one).
_ATTEMPTS = 5


def _outdated(exc: BaseException) -> bool:
    return isinstance(exc, StorageError) and GONE_SINCE_OPEN in exc.hint


def verify(
    path: str | Path,
    options: StoreOptions | None = None,
    *,
    progress: Callable[[str, int], object] | None = None,
) -> Report:
    """Check the database in ``path`` (opened read-only: safe beside a live writer).

    A read-only view reads the files listed at its open; when a writer beside it has
    compacted one of them away before it was read (message bodies in blob files are
    opened only when first read), the check starts over on a new view, up to five
    views in all, then raises :class:`StorageError` (no finding: the writer outran it).

    The tables with rows per message, destination or diff are streamed (memory grows
    with the diffs, about 1.6 KB each, not with the messages); ``progress(table,
    rows)``, when given, is called every 65,536 rows of them."""
    for _ in range(_ATTEMPTS):
        report = Report(Path(path))
        store = _open(Path(path), options)
        # Looked at just before RocksDB's open took the view (the store's open checks
        # before it can take seconds) and after: an import held at either moment was
        # under way as the view was taken, or is the one the view shows starting; one
        # that ended in between is not taken for an interrupted one.
        running = store.import_lock_at_open or import_lock_held(Path(path))
        report.notes += store.log_notes
        try:
            _verify(store, report, progress, import_running=running)
        except StorageError as exc:
            if not _outdated(exc):
                raise
            report.outdated = True
        finally:
            store.close()
        if not report.outdated:
            return report
    # Not a finding about the data: each view was outdated before it was read through.
    raise StorageError(
        Path(path),
        "verify",
        f"a live writer's compactions removed files of each of {_ATTEMPTS} read-only "
        "views before they were read through (nothing was found wrong with what was read)",
        hint="run it again when the writer is less busy, or stop the node and verify the "
        "directory (or a copy of it)",
    )


def _open(path: Path, options: StoreOptions | None) -> Store:
    try:
        return Store(path, options, read_only=True)
    except StorageError as exc:
        # The open's advice to run `imq verify` is no advice when that is what failed.
        if _SELF_ADVICE not in exc.hint:
            raise
        hint = exc.hint.replace(_SELF_ADVICE, "")
        raise StorageError(exc.path, exc.operation, exc.reason, hint) from exc


class _Importing(NamedTuple):
    """An import under way (its marker, and its import lock held): the key spans of the
    diffs it is writing, whose messages may be stored before their diffs are."""

    shard: ShardIdent
    starts: list[bytes]  # each diff's lowest message key, ascending
    ends: list[bytes]  # the same diff's highest

    def holds(self, shard: ShardIdent, key: bytes) -> bool:
        i = bisect.bisect_right(self.starts, key) - 1
        return shard == self.shard and i >= 0 and key <= self.ends[i]


def _check_import_marker(
    marker: bytes | None, report: Report, *, running: bool
) -> _Importing | None:
    """An import's marker. Left by a crash it is a problem, listed first: it explains
    the problems a partial import leaves (messages of no stored diff, a missing tail).
    With the import lock held (``running``, looked at when the view was opened), the
    import is under way: a note, and the spans whose messages of no stored diff yet are
    its batches so far."""
    if marker is None:
        return None
    try:
        block_id, diffs, _partitions = codec.decode_import_marker(marker)
    except CorruptDataError as exc:
        block_id, diffs, block = None, [], f"? ({exc})"
    else:
        block = str(block_id)
    if block_id is not None and running:
        report.notes.insert(
            0,
            f"an import of block {block} is under way (its import lock is held): the "
            "messages inside its diffs' key ranges that no stored diff owns yet are not "
            "counted; verify again once it has finished",
        )
        spans = sorted((codec.key_bytes(lo), codec.key_bytes(hi)) for _s, lo, hi in diffs)
        return _Importing(block_id.shard, [lo for lo, _ in spans], [hi for _, hi in spans])
    report.problems.insert(
        0,
        f"an import of block {block} was interrupted: its diffs and messages are partial "
        "(the problems below may be its); the next writer open rolls it back (e.g. `imq "
        "gc`), then import the state again",
    )
    return None


def _verify(
    store: Store,
    report: Report,
    progress: Callable[[str, int], object] | None = None,
    *,
    import_running: bool = False,
) -> None:
    tables = {t: _rows(store, t, report) for t in Table if t not in _STREAMED}
    infos, counting = _read_diffs(store, report, progress)
    # Without every diff record, rows cannot be counted against them: the rest of the
    # tables is still read through (checksums, decoding), and nothing more is concluded.
    if not counting:
        report.notes.append(
            "the diff records could not all be read: statistics, messages and commit "
            "pointers were read for damage only, not checked against the diffs"
        )
    unowned = _check_statistics(store, infos if counting else None, report, progress)

    # The GC bounds, the last committed block.
    values = dict(tables[Table.VARS] or [])
    importing = _check_import_marker(
        values.get(codec.IMPORT_MARKER), report, running=import_running
    )
    requested = _gc_bounds(values, codec.GC_REQUESTED, report)
    executed = _gc_bounds(values, codec.GC_EXECUTED, report)
    last_mc = None
    try:
        raw = values.get(codec.LAST_COMMITTED_MC_BLOCK)
        last_mc = codec.decode_block_id(raw) if raw is not None else None
    except CorruptDataError as exc:
        report.problems.append(str(exc))

    # Statistics of no stored diff: GC deletes a diff's records once any partition's bound
    # passes its max_message and leaves the other partitions' rows to their own bounds;
    # above every bound of the shard, nothing explains them.
    reach = _gc_reach(requested, executed)
    orphan_reach = _orphan_reach(reach)
    for shard, seqno, partition, max_message in sorted(unowned, key=str):
        bound = orphan_reach.get(shard)
        if bound is None or max_message > bound:
            report.problems.append(
                f"statistics of diff {shard}:{seqno} partition {partition} (max "
                f"{max_message}) belong to no stored diff (above every GC bound of the shard)"
            )

    # Messages inside each diff's span (the counts are compared once every row is read).
    try:
        rows = _Streamed(store, Table.MESSAGES, report, progress)
        if counting:
            _check_messages(rows, infos, reach, orphan_reach, report, importing=importing)
        else:
            for _row in rows:
                pass
    except _UnreadableError as exc:  # raised before any count is compared
        exc.report(report)

    # Commit pointers.
    pointers = dict(
        v for _, v in _decode_all(tables[Table.COMMIT_POINTERS] or [], codec.decode_pointer, report)
    )
    # Against where GC may have deleted (``reach``: executed or requested, the higher): a
    # requested bound can fall below an executed one (a later masterchain block reading
    # less, D7), and the diff the executed bound collected is gone all the same.
    for shard, pointer in sorted(pointers.items() if counting else (), key=str):
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


def _read_diffs(
    store: Store, report: Report, progress: Callable[[str, int], object] | None
) -> tuple[dict[tuple[ShardIdent, int], tuple[_Span, dict[int, int]]], bool]:
    """The diff records by (shard, seqno), each checked against the tail rows; and
    whether every record was read (else the rows cannot be counted against them)."""
    # Of each diff record, what the checks use (the whole record is decoded, and dropped).
    infos: dict[tuple[ShardIdent, int], tuple[_Span, dict[int, int]]] = {}
    infos_whole = tails_whole = True
    try:
        for key, (info, parts) in _decode_all(
            _Streamed(store, Table.DIFF_INFO, report, progress), codec.decode_diff_record, report
        ):
            shard = codec.decode_shard(key[: codec.SHARD_LEN])
            infos[(shard, info.seqno)] = (_Span(info.min_message, info.max_message), parts)
    except _UnreadableError as exc:
        exc.report(report)
        infos_whole = False
    tails: set[tuple[ShardIdent, QueueKey, int]] = set()
    try:
        for key, (max_message, seqno) in _decode_all(
            _Streamed(store, Table.DIFF_TAIL, report, progress),
            lambda k, _v: codec.decode_tail_key(k),
            report,
        ):
            tails.add((codec.decode_shard(key[: codec.SHARD_LEN]), max_message, seqno))
    except _UnreadableError as exc:
        exc.report(report)
        tails_whole = False
    if infos_whole and tails_whole:
        expected_tails = {(s, i.max_message, n) for (s, n), (i, _) in infos.items()}
        for shard, max_message, seqno in sorted(expected_tails - tails, key=str):
            report.problems.append(f"diff {shard}:{seqno} has no tail row (max {max_message})")
        for shard, max_message, seqno in sorted(tails - expected_tails, key=str):
            report.problems.append(f"tail row {shard}:{seqno} (max {max_message}) has no diff info")
    return infos, infos_whole


def _check_statistics(
    store: Store,
    infos: Mapping[tuple[ShardIdent, int], tuple[_Span, dict[int, int]]] | None,
    report: Report,
    progress: Callable[[str, int], object] | None,
) -> list[tuple[ShardIdent, int, int, QueueKey]]:
    """The statistics of each diff against the diff's own message counts (streamed); the
    rows of no stored diff are returned, for the caller to check against the GC bounds.

    A row belongs to the stored diff of its seqno only under that diff's max_message: a
    row under another is an earlier diff's of the same seqno, which GC of another
    partition collected (its records) before this partition's bound reached the row.
    ``infos`` None (the diff records not all read): the rows are read and decoded only."""
    counted: dict[tuple[ShardIdent, int, int], int] = defaultdict(int)
    unowned: list[tuple[ShardIdent, int, int, QueueKey]] = []
    stats_read = True
    try:
        for key, (max_message, entries) in _decode_all(
            _Streamed(store, Table.STATISTICS, report, progress), codec.decode_stat_row, report
        ):
            shard = codec.decode_shard(key[: codec.SHARD_LEN])
            if infos is None:
                continue
            partition = int.from_bytes(key[codec.SHARD_LEN : codec.SHARD_LEN + 2], "big")
            seqno = int.from_bytes(key[-4:], "big")
            owner = infos.get((shard, seqno))
            if owner is None or owner[0].max_message != max_message:
                unowned.append((shard, seqno, partition, max_message))
                continue
            counted[(shard, seqno, partition)] += sum(n for _, n in entries)
    except _UnreadableError as exc:  # the counts of a part say nothing
        exc.report(report)
        stats_read = False
    if stats_read and infos is not None:
        for (shard, seqno), (_info, parts) in sorted(infos.items(), key=str):
            for partition, stored in parts.items():
                got = counted.get((shard, seqno, partition), 0)
                if got != stored:
                    report.problems.append(
                        f"diff {shard}:{seqno} partition {partition}: statistics count {got} "
                        f"messages, the diff stored {stored}"
                    )
        # Rows under a stored diff's key in a partition its record does not list.
        for (shard, seqno, partition), got in sorted(counted.items(), key=str):
            if partition not in infos[(shard, seqno)][1]:
                report.problems.append(
                    f"diff {shard}:{seqno} partition {partition}: statistics count {got} "
                    "messages, the diff stored none in this partition"
                )
    return unowned


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


def _orphan_reach(reach: GcBounds) -> dict[ShardIdent, QueueKey]:
    """Per source shard, the highest GC reach of any partition: GC deletes a diff's
    records once its max_message is at or below the bound of any partition
    (``stage_delete``), and the rows of the other partitions up to there stay behind."""
    highest: dict[ShardIdent, QueueKey] = {}
    for (_partition, shard), bound in reach.items():
        if shard not in highest or bound > highest[shard]:
            highest[shard] = bound
    return highest


@dataclass
class _Cluster:
    """Diffs of one source shard whose key spans overlap, and their union ``[lo, hi]``.

    Spans of one shard's diffs follow one another on a network (logical time grows
    within a shard), but the queue does not require it (only a commit pointer bounds a
    new diff from below), so a diff may span keys of earlier ones: their messages
    interleave in the key space, may share keys, and cannot be counted per diff."""

    lo: QueueKey
    hi: QueueKey
    seqnos: list[int]
    stored: dict[int, int]  # per partition, the first diff's record (counted: one diff only)

    def name(self, shard: ShardIdent) -> str:
        if len(self.seqnos) == 1:
            return f"diff {shard}:{self.seqnos[0]}"
        listed = ", ".join(str(n) for n in sorted(self.seqnos))
        return f"diffs {shard}:{listed} (overlapping spans)"


def _clusters(
    infos: Mapping[tuple[ShardIdent, int], tuple[_Span, dict[int, int]]],
) -> dict[ShardIdent, list[_Cluster]]:
    """Per source shard, its diffs' spans merged where they overlap, in key order. Diffs
    that stored no message own no row: they stay out (on a network an empty diff shares
    the key of the diff before it), and a row in their span alone is a stray."""
    spans: dict[ShardIdent, list[tuple[QueueKey, QueueKey, int, dict[int, int]]]] = defaultdict(
        list
    )
    for (shard, seqno), (info, parts) in infos.items():
        if any(parts.values()):
            spans[shard].append((info.min_message, info.max_message, seqno, parts))
    out: dict[ShardIdent, list[_Cluster]] = {}
    for shard, items in spans.items():
        items.sort(key=lambda item: (item[0], item[1], item[2]))
        merged: list[_Cluster] = []
        for lo, hi, seqno, parts in items:
            if merged and lo <= merged[-1].hi:
                last = merged[-1]
                last.hi = max(last.hi, hi)
                last.seqnos.append(seqno)
            else:
                merged.append(_Cluster(lo, hi, [seqno], parts))
        out[shard] = merged
    return out


def _check_messages(
    rows: Iterable[tuple[bytes, bytes]],
    infos: Mapping[tuple[ShardIdent, int], tuple[_Span, dict[int, int]]],
    reach: GcBounds,
    orphan_reach: Mapping[ShardIdent, QueueKey],
    report: Report,
    *,
    importing: _Importing | None = None,
) -> None:
    """Count the stored messages inside each diff's span (a cluster's, where spans
    overlap), per partition, against the diffs' records; ``reach`` (:func:`_gc_reach`)
    says where GC may have deleted, and ``orphan_reach`` (:func:`_orphan_reach`) up to
    where rows may outlive their diff. Rows of no stored diff inside the diffs of an
    import under way (``importing``) are its batches so far, not strays."""
    clusters = _clusters(infos)
    bounds: dict[ShardIdent, tuple[list[bytes], list[bytes]]] = {
        shard: ([codec.key_bytes(c.lo) for c in cs], [codec.key_bytes(c.hi) for c in cs])
        for shard, cs in clusters.items()
    }
    orphan_bytes = {shard: codec.key_bytes(bound) for shard, bound in orphan_reach.items()}
    found: dict[tuple[ShardIdent, int, int], int] = defaultdict(int)
    # of those, the rows at or below their shard's orphan reach (an older diff's, maybe)
    old: dict[tuple[ShardIdent, int, int], int] = defaultdict(int)
    prefix_len = codec.MESSAGE_PREFIX_LEN
    stray = 0
    shard_of: dict[bytes, ShardIdent] = {}
    for key, _value in rows:
        raw_shard = key[2:prefix_len]
        known = shard_of.get(raw_shard)
        if known is None:
            known = shard_of[raw_shard] = codec.decode_shard(raw_shard)
        qk = key[prefix_len:]
        starts, ends = bounds.get(known, ([], []))
        i = bisect.bisect_right(starts, qk) - 1
        orphan = orphan_bytes.get(known)
        if i < 0 or qk > ends[i]:
            if (orphan is None or qk > orphan) and not (
                importing is not None and importing.holds(known, qk)
            ):
                stray += 1
            continue
        slot = (known, i, int.from_bytes(key[:2], "big"))
        found[slot] += 1
        if orphan is not None and qk <= orphan:
            old[slot] += 1
    if stray:
        report.problems.append(
            f"{stray} stored messages belong to no stored diff (above every GC bound of "
            "their shard)"
        )
    for shard, cs in sorted(clusters.items(), key=lambda item: str(item[0])):
        for i, cluster in enumerate(cs):
            if len(cluster.seqnos) > 1:
                # Diffs that share key space may share message keys (one row for two
                # messages), and a deleted diff's rows that GC of another partition left
                # may lie in a later span: rows cannot be told apart, so not counted.
                report.notes.append(
                    f"{cluster.name(shard)}: messages not counted (a collator never writes "
                    "such diffs: logical time grows within a shard)"
                )
                continue
            for partition, stored in sorted(cluster.stored.items()):
                got = found.get((shard, i, partition), 0)
                problem = _count_problem(cluster.lo, stored, got, reach.get((partition, shard)))
                if problem is not None:
                    report.problems.append(
                        f"{cluster.name(shard)} partition {partition}: {problem}"
                    )
    # Rows of a partition the diff's record does not list: none of them is the diff's.
    # Those at or below the shard's orphan reach may be an older, collected diff's whose
    # span this one's overlaps (a collator never writes such diffs); the rest are found.
    for (shard, i, partition), got in sorted(found.items(), key=str):
        cluster = clusters[shard][i]
        if len(cluster.seqnos) > 1 or partition in cluster.stored:
            continue  # (a cluster of several diffs is not counted, see above)
        fresh = got - old.get((shard, i, partition), 0)
        if fresh:
            report.problems.append(
                f"{cluster.name(shard)} partition {partition}: {fresh} messages stored in "
                "its span, the diff record lists none in this partition"
            )


def _count_problem(
    min_message: QueueKey, stored: int, got: int, gc_bound: QueueKey | None
) -> str | None:
    """What is wrong with ``got`` messages in the span from ``min_message`` of a diff
    that stored ``stored`` in the partition, whose GC bound is ``gc_bound``. Below the
    span, nothing of the diff was collected: the count must match. Inside or above it,
    GC deleted the part at or below the bound, and no record says how many of the diff's
    messages lay there: only an excess shows."""
    if gc_bound is None or gc_bound < min_message:
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
