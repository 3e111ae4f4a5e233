"""Importing a persistent queue state into the store (SEMANTICS §13.5, with D10, D11, D13).

Memory stays bounded: the file is streamed chunk by chunk and written in batches. The
caller sees all or nothing because of a marker in the variables table:

1. plan under the facade's write lock: the header's checks, the block id, the top
   update, diffs already stored (same hash: kept; another hash: ``DiffConflictError``),
   the commit pointer (D6) and the last committed block, overlap with stored diffs,
   uncommitted diffs the import would commit, rows a partial GC left where a rollback
   would delete -- nothing is written yet;
2. write the marker (synced): the block, the span of every diff the import will write,
   and the partitions it writes into;
3. stream the messages in batches; finish each diff with its statistics, tail and info;
4. one synced batch sets the commit pointer (and, for a masterchain state, the last
   committed block), enters the newest diff's ``processed_to`` into the commit record,
   and removes the marker.

Any failure after step 2 deletes what was written (:func:`rollback_import`); a crash
leaves the marker, and the next open rolls back the same way.

Hot path: ``_stage_segment`` runs once per message root; it keeps plain tuples and
counts in dicts, and builds the API's value types only once per diff.
"""

from __future__ import annotations

import contextlib
import os
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import accumulate
from operator import itemgetter
from time import perf_counter
from typing import BinaryIO, NoReturn

from imq.apply import source_outside
from imq.commit import check_forward
from imq.delete import DeleteRange, stage_delete, tail_rows
from imq.errors import CommitError, DiffConflictError, StateFormatError, StorageError
from imq.observability import ImqLogger
from imq.state.message import MessageFormatError, parse_internal_header
from imq.state.reader import Segment, StateReader, header_check
from imq.state.source import open_source
from imq.state.tl import TlDiff
from imq.storage import StoreProtocol as Store
from imq.storage import TransactionProtocol as Transaction
from imq.storage import ops
from imq.storage.rocks import import_lock_held
from imq.types import (
    Address,
    BlockId,
    CommitPointer,
    DiffInfo,
    QueueKey,
    ShardIdent,
)

__all__ = [
    "ImportReport",
    "Progress",
    "import_state",
    "rollback_import",
    "rollback_import_at_open",
]

_Header = tuple[int, int, bytes, int, bytes]  # lt, src wc, src account, dst wc, dst account
_DESTINATION = itemgetter(3, 4)
_SOURCE_WORKCHAIN = itemgetter(1)
_SOURCE_ACCOUNT = itemgetter(2)
BATCH_ROWS = 16_384  # messages per write batch: a few MiB, bounded memory
Progress = Callable[[int, int], None]  # (messages done, messages in the state)


@dataclass(frozen=True, slots=True)
class ImportReport:
    """What an import did. ``messages`` and ``diffs`` count what the state holds (every
    message was read and checked); ``written_diffs`` were written, ``kept_diffs`` were
    already stored with the same hash and left as they were. ``bytes`` counts the
    decompressed state, ``source_bytes`` what was read from the source."""

    diffs: int
    messages: int
    bytes: int
    seconds: float
    written_diffs: int = 0
    kept_diffs: int = 0
    source_bytes: int = 0


@dataclass(slots=True)
class _DiffWork:
    """A diff being imported: its routing and the counts its rows need."""

    diff: TlDiff
    hash: bytes
    write: bool
    route_dst: dict[tuple[int, bytes], int]
    route_src: dict[tuple[int, bytes], int]
    stats: dict[int, Counter[tuple[int, bytes]]] = field(default_factory=dict)


def import_state(
    store: Store,
    source: str | os.PathLike[str] | BinaryIO,
    block_id: BlockId,
    top_update: tuple[bytes, int] | None,
    *,
    log: ImqLogger,
    progress: Progress | None = None,
) -> ImportReport:
    """Import ``source`` as the queue state of ``block_id``. The caller holds the
    facade's write lock."""
    started = perf_counter()
    expected = None if top_update is None else _check_top_update(top_update)
    # The block and the top update are checked as soon as the newest diff is read, before
    # any older diff is parsed (a forged header costs one diff's memory, not every one's).
    on_top = header_check(block_id, expected)
    with open_source(source) as src:
        reader = StateReader(src, on_top=on_top)
        header = reader.header
        works = _plan(store, reader, block_id)
        new = [w for w in works if w.write]
        # Held from before the marker to the finish or the rollback (a failed write's
        # too): readers tell this import from one a crash left (Queue.import_running).
        with store.importing():
            if new:
                _write_marker(store, block_id, new)
            try:
                messages = _stream(store, reader, works, block_id.shard, progress)
                _finish(store, block_id, header.diffs[0])
            except BaseException as exc:
                if new and store.dead is None:
                    stopped = not isinstance(exc, Exception)  # a Ctrl-C, SIGTERM in the CLI
                    reason = "interrupted" if stopped else "failed"
                    if not rollback_import(store, log, reason=reason):
                        # No marker: the last batch had been written (the exception, a
                        # Ctrl-C say, landed just after it): the import is complete.
                        exc.add_note(
                            f"the import of {block_id.short} had finished before this "
                            "exception: the queue holds the whole state"
                        )
                elif new and isinstance(exc, StorageError):
                    # A dead handle (a failed write) cannot roll back: the marker stays and
                    # the next open rolls the import back. Say so: the data is not as before.
                    if exc.operation == StorageError.UNSYNCED_OPERATION:  # the batch may stand
                        next_step = (
                            "; the import had written part of the state, or all of it if "
                            "this was its last batch: after that open (for writing) the "
                            "import is complete or rolled back (get_diff_info of the "
                            "state's top diff, or `imq inspect`, tells): import the state "
                            "again only if it was rolled back"
                        )
                    else:
                        next_step = (
                            "; the import had written part of the state: that open (for "
                            "writing) rolls it back, then import the state again"
                        )
                    raise StorageError(
                        exc.path,
                        f"import of block {block_id.short}",
                        exc.reason,
                        exc.hint + next_step,
                    ) from exc
                raise
        report = ImportReport(
            diffs=len(works),
            messages=messages,
            bytes=src.offset,
            seconds=perf_counter() - started,
            written_diffs=len(new),
            kept_diffs=len(works) - len(new),
            source_bytes=src.raw_bytes_read,
        )
    log.info(
        "state_imported",
        block=str(block_id),
        diffs=report.diffs,
        written_diffs=report.written_diffs,
        messages=report.messages,
        bytes=report.bytes,
        seconds=round(report.seconds, 6),
    )
    return report


# ---------------------------------------------------------------------------------------------
# planning: every check that needs no message, before anything is written


_U32_MAX = (1 << 32) - 1


def _check_top_update(top_update: tuple[bytes, int]) -> tuple[bytes, int]:
    diff_hash: object = None
    tail_len: object = None
    with contextlib.suppress(TypeError, ValueError):
        diff_hash, tail_len = top_update
    if not isinstance(diff_hash, bytes) or type(tail_len) is not int:
        raise TypeError("top_update must be (diff hash: bytes, tail_len: int)")
    if len(diff_hash) != 32 or not 0 <= tail_len <= _U32_MAX:
        raise ValueError(
            "top_update must be a 32-byte hash and a tail_len in 0..2**32-1 (a block's "
            f"queue tail length is a u32), got {len(diff_hash)} bytes and {tail_len}"
        )
    return diff_hash, tail_len


def _plan(store: Store, reader: StateReader, block_id: BlockId) -> list[_DiffWork]:
    header = reader.header
    shard = header.shard
    shard_diffs = ops.ShardDiffs(shard)
    with ops.view(store, shard_diffs) as view:
        stored = view[shard_diffs]
    # First the stored diffs of the state's own seqnos (a conflict there is the most
    # specific answer, and its advice says whether a clear can help), then where the
    # queue stands (no advice to clear or collect helps a queue already past the
    # state), then the other stored diffs, then rows (reads).
    pointer = store.state.pointers.get(shard)
    works = []
    for diff, diff_hash in zip(header.diffs, header.diff_hashes, strict=True):
        record = stored.get(diff.seqno)
        if record is not None:
            _check_kept(shard, diff, diff_hash, record[0], pointer=pointer, top=header.diffs[0])
        works.append(_DiffWork(diff, diff_hash, record is None, *_routes(diff)))
    _check_pointer(store, shard, header.diffs[0])
    _check_last_committed(store, block_id)
    # A rollback deletes the spans of the diffs it wrote: they must not hold stored rows.
    spans = Spans((info.min_message, info.max_message) for info, _ in stored.values())
    for work in works:
        d = work.diff
        if work.write and spans.meet(d.min_message, d.max_message):
            raise DiffConflictError(
                f"diff of block {shard}:{d.seqno} ({d.min_message}..{d.max_message}) overlaps "
                f"a stored diff of the same shard"
            )
    _check_no_other_diff_below(shard, header.diffs, stored, pointer)
    _check_spans_hold_no_rows(store, shard, [w for w in works if w.write])
    return works


_OTHER_HISTORY = (
    "that diff is committed, so this queue holds another history of the shard than the "
    "state: import into a new, empty directory, or restore the queue that belongs to "
    "this node's blocks"
)


def _check_kept(
    shard: ShardIdent,
    diff: TlDiff,
    diff_hash: bytes,
    info: DiffInfo,
    *,
    pointer: CommitPointer | None,
    top: TlDiff,
) -> None:
    """A stored diff of a seqno the state holds is kept as it is when it carries the
    state's hash; it must then end at or below the pointer the import sets (the newest
    diff's ``max_message``), as the state's own diffs do, or it would stay uncommitted
    after an import that counts it as imported, for the next clear to delete (a diff
    stored under a hash that is not its own)."""
    committed = pointer is not None and pointer.key >= info.max_message
    if info.hash != diff_hash:
        raise DiffConflictError(
            f"diff of block {shard}:{diff.seqno} is already stored with hash "
            f"{info.hash.hex()}; the state's diff hashes to {diff_hash.hex()}",
            next_step=_OTHER_HISTORY if committed else None,
        )
    if info.max_message > top.max_message:
        raise DiffConflictError(
            f"diff of block {shard}:{diff.seqno} is stored with the state's hash "
            f"{diff_hash.hex()}, but it ends at {info.max_message}, above the commit "
            f"pointer the import sets ({top.max_message}, seqno {top.seqno}), where the "
            f"state's diff ends at {diff.max_message}: the stored diff was written under a "
            "hash that is not its own",
            next_step=_OTHER_HISTORY
            if committed
            else "clear the uncommitted zone (clear_uncommitted_state, or startup after a "
            "restart), then import again",
        )


def _check_no_other_diff_below(
    shard: ShardIdent,
    diffs: tuple[TlDiff, ...],
    stored: dict[int, tuple[DiffInfo, dict[int, int]]],
    pointer: CommitPointer | None,
) -> None:
    """No uncommitted diff the state does not hold ends at or below the pointer the
    import sets: the import would commit it (a node that crashed while collating a block
    and then imports the network's state would deliver its own version of that block)."""
    top = diffs[0].max_message
    held = {d.seqno for d in diffs}
    for seqno, (info, _) in sorted(stored.items()):
        if seqno in held or info.max_message > top:
            continue
        if pointer is not None and pointer.key >= info.max_message:
            continue  # committed already
        raise DiffConflictError(
            f"the uncommitted diff of block {shard}:{seqno} ({info.min_message}.."
            f"{info.max_message}) is not in the state, and the commit pointer the import "
            f"sets ({top}, seqno {diffs[0].seqno}) would commit it",
            next_step="clear the uncommitted zone first (clear_uncommitted_state with the "
            "shard in top_shards, or startup after a restart), then import again",
        )


def _check_spans_hold_no_rows(store: Store, shard: ShardIdent, new: list[_DiffWork]) -> None:
    """The spans of the diffs to write hold no message or statistics row of the shard in
    any partition the import writes into, which a rollback deletes whole. Rows of stored
    diffs are found above by their records; this finds rows whose diff's records are
    gone: a GC of some partitions deletes a diff's records and leaves its rows in the
    others until a GC of those reaches them (behaviour 5.7). They are the shard's
    messages at keys its state claims for another diff: the queue and the state disagree."""
    if not new:
        return
    partitions = sorted(_partitions(new))
    messages, statistics = ops.MessageCounter(), ops.StatisticsCounter()
    with ops.view(store, messages, statistics) as view:
        found_messages, found_statistics = view[messages], view[statistics]
        for work in new:
            d = work.diff
            for partition in partitions:
                rows = ops.partition_rows(
                    found_messages,
                    found_statistics,
                    shard,
                    partition,
                    first=d.min_message,
                    last=d.max_message,
                )
                if rows:
                    raise DiffConflictError(
                        f"diff of block {shard}:{d.seqno} ({d.min_message}..{d.max_message}) "
                        f"overlaps {rows} stored rows of the same shard in partition "
                        f"{partition} whose diff is no longer stored (a GC of other "
                        "partitions left them)",
                        next_step="the queue and the state disagree: import into a new, "
                        f"empty directory, or let GC collect them first (a commit_diff whose "
                        f"partitions include {partition}, then run_gc)",
                    )


def _partitions(new: list[_DiffWork]) -> set[int]:
    """The partitions the diffs ``new`` write into, 0 always: what the marker lists and
    a rollback clears."""
    partitions = {0}
    for work in new:
        partitions.update(work.route_dst.values(), work.route_src.values())
    return partitions


class Spans:
    """Key spans ``[lo, hi]`` (both included), asked whether any meets a given one: one
    bisection a question, however many spans (a scan of every stored span per diff of a
    state made an import beside 10^5 stored diffs quadratic: 20 s)."""

    def __init__(self, spans: Iterable[tuple[QueueKey, QueueKey]]) -> None:
        ordered = sorted(spans)
        self._starts = [lo for lo, _ in ordered]
        # the furthest end among the spans up to each one, in the order of their starts
        self._reach = list(accumulate((hi for _, hi in ordered), max))

    def meet(self, lo: QueueKey, hi: QueueKey) -> bool:
        """Whether a span ``[a, b]`` has ``a <= hi`` and ``b >= lo``: of the spans that
        start at or below ``hi`` (a prefix), the furthest end reaches ``lo``."""
        below = bisect_right(self._starts, hi)
        return below > 0 and self._reach[below - 1] >= lo


def _check_last_committed(store: Store, block_id: BlockId) -> None:
    """A masterchain state of the last committed block's seqno must be that block: the
    import would replace it with another block of the same seqno (a commit of an equal
    seqno is skipped instead)."""
    last = store.state.last_mc_block
    if (
        block_id.is_masterchain
        and last is not None
        and last.seqno == block_id.seqno
        and last != block_id
    ):
        raise CommitError(
            f"the state of {block_id} is not the last committed masterchain block {last} "
            "of the same seqno; import the state of that block, or of a later one"
        )


def _routes(diff: TlDiff) -> tuple[dict[tuple[int, bytes], int], dict[tuple[int, bytes], int]]:
    """Address -> partition for each router half; the lowest partition listing an
    address wins, as in the original import (§13.5)."""
    halves = []
    for half in (diff.router_dst, diff.router_src):
        route: dict[tuple[int, bytes], int] = {}
        for partition, addresses in half:
            for address in addresses:
                route.setdefault((address[0], address[1]), partition)
        halves.append(route)
    return halves[0], halves[1]


def _check_pointer(store: Store, shard: ShardIdent, top: TlDiff) -> None:
    check_forward(
        shard,
        store.state.pointers.get(shard),
        CommitPointer(top.max_message, top.seqno),
        operation=f"importing the state of {shard}:{top.seqno}",
        hint="this queue is already past that state: import the state of a newer block "
        "of the shard, or import into a new, empty directory",
    )


def _write_marker(store: Store, block_id: BlockId, new: list[_DiffWork]) -> None:
    txn = store.transaction()
    spans = [(w.diff.seqno, w.diff.min_message, w.diff.max_message) for w in new]
    ops.put_import_marker(txn, block_id, spans, _partitions(new))
    store.write(txn, sync=True)


# ---------------------------------------------------------------------------------------------
# streaming the messages


def _stream(
    store: Store,
    reader: StateReader,
    works: list[_DiffWork],
    shard: ShardIdent,
    progress: Progress | None,
) -> int:
    total = reader.total_messages
    done = 0
    batch: list[Transaction] = [store.transaction()]
    pending = 0
    try:
        for segment in reader.segments():
            work = works[segment.diff_index]
            partitions, headers = _stage_segment(segment, work)
            if work.write:
                ops.put_raw_messages(
                    batch[0],
                    shard,
                    partitions=partitions,
                    headers=headers,
                    roots=segment.roots,
                )
                pending += len(headers)
            if segment.last and work.write:
                _stage_diff_rows(batch[0], shard, work)
            done += len(headers)
            if pending >= BATCH_ROWS:
                store.write(batch[0])
                batch[0], pending = store.transaction(), 0
            if progress is not None and headers:
                progress(done, total)
        store.write(batch[0])
    finally:
        # A failed batch holds column-family handles, and RocksDB stays open (and
        # locked) while any handle lives: a caller keeping the exception, whose
        # traceback keeps this frame, must not keep the database open after close().
        batch.clear()
    if progress is not None:
        progress(done, total)
    return done


def _stage_segment(segment: Segment, work: _DiffWork) -> tuple[list[int] | None, list[_Header]]:
    """Parse and check a segment's messages; count them if the diff is written. Returns
    each message's partition (``None``: all in partition 0) and header."""
    roots = segment.roots
    parse = parse_internal_header
    try:
        headers = [parse(r.data, r.bits, r.refs, r.children) for r in roots]
    except MessageFormatError:
        _raise_bad_message(segment, work.diff)
    _check_range(segment, work.diff, headers)
    _check_sources(segment, work.diff, headers)
    partitions = None
    if work.route_dst or work.route_src:
        dst_map, src_map = work.route_dst, work.route_src
        partitions = [
            p if (p := dst_map.get((h[3], h[4]), -1)) >= 0 else src_map.get((h[1], h[2]), 0)
            for h in headers
        ]
    if work.write and headers:
        stats = work.stats
        if partitions is None:
            counter = stats.get(0) or stats.setdefault(0, Counter())
            counter.update(map(_DESTINATION, headers))
        else:
            for partition, header in zip(partitions, headers, strict=True):
                stats.setdefault(partition, Counter())[_DESTINATION(header)] += 1
    return partitions, headers


def _raise_bad_message(segment: Segment, diff: TlDiff) -> NoReturn:
    for i, root in enumerate(segment.roots):
        try:
            parse_internal_header(root.data, root.bits, root.refs, root.children)
        except MessageFormatError as exc:
            raise _message_error(segment, i, diff, f"bad {exc.field}: {exc}") from None
    raise AssertionError("unreachable: a message failed to parse once only")


def _check_range(segment: Segment, diff: TlDiff, headers: list[_Header]) -> None:
    """Every message key must lie in the diff's [min_message, max_message] (a rollback
    deletes that span). Checked on lts first; keys are compared only at the edges."""
    if not headers:
        return
    lo, hi = diff.min_message, diff.max_message
    lts = [h[0] for h in headers]
    if lo[0] < min(lts) and max(lts) < hi[0]:
        return
    for i, (lt, root) in enumerate(zip(lts, segment.roots, strict=True)):
        if not lo <= (lt, root.hash) <= hi:
            raise _message_error(
                segment, i, diff, f"key ({lt}, {root.hash.hex()}) outside the diff's range"
            )


def _check_sources(segment: Segment, diff: TlDiff, headers: list[_Header]) -> None:
    """Every message's source lies in the state's shard, as ``apply_diff`` requires with
    ``QueueConfig.check_sources`` (the same test): a shard's diff holds only what its
    accounts sent (and the export refuses to write anything else). The error names the
    first message from outside."""
    if not headers:
        return
    shard = diff.shard
    workchains = set(map(_SOURCE_WORKCHAIN, headers))
    if source_outside(shard, workchains, list(map(_SOURCE_ACCOUNT, headers))) is None:
        return
    for i, header in enumerate(headers):
        source = Address(header[1], header[2])
        if not shard.contains(source):
            raise _message_error(
                segment,
                i,
                diff,
                f"source {source} is outside the state's shard {shard} (a shard's diff holds "
                "only messages its own accounts sent)",
            )
    raise AssertionError("unreachable: the range test found a source the scan did not")


def _message_error(segment: Segment, i: int, diff: TlDiff, what: str) -> StateFormatError:
    return StateFormatError(
        f"message {segment.first + i} of diff seqno {diff.seqno} (chunk {segment.chunk_index} "
        f"at offset {segment.chunk_offset}, root {segment.root_index + i}): {what}"
    )


def _stage_diff_rows(txn: Transaction, shard: ShardIdent, work: _DiffWork) -> None:
    """The statistics, tail and info rows of a completely read diff."""
    diff = work.diff
    messages: dict[int, int] = {}
    per_workchain: Counter[int] = Counter()
    for partition, counter in work.stats.items():
        messages[partition] = counter.total()
        for (wc, _), count in counter.items():
            per_workchain[wc] += count
    info = DiffInfo(
        min_message=diff.min_message,
        max_message=diff.max_message,
        shards_messages_count={ShardIdent.full(wc): n for wc, n in per_workchain.items()},
        hash=work.hash,
        processed_to=dict(diff.processed_to),
        router_src={p: frozenset(a) for p, a in diff.router_src},
        router_dst={p: frozenset(a) for p, a in diff.router_dst},
        seqno=diff.seqno,
        prev_hash=diff.prev_hash,
    )
    # The partitions the diff's rows went to (statistics are counted from the messages,
    # so their partitions are the messages'), as apply_diff lists them.
    ops.put_diff(txn, shard, info, work.stats, messages)
    work.stats = {}


def _finish(store: Store, block_id: BlockId, top: TlDiff) -> None:
    """The pointer, the last committed masterchain block, the commit record's entry of
    the shard, and the marker gone: one synced batch, after which the import is
    complete."""
    txn = store.transaction()
    pointer = CommitPointer(top.max_message, top.seqno)
    mc_block = None
    if block_id.is_masterchain:
        last = store.state.last_mc_block
        if last is None or last.seqno <= block_id.seqno:
            mc_block = block_id
    # The imported block is the shard's newest committed diff: its processed_to enters
    # the commit record (D7) as a commit's would, so GC holds back what the shard has not
    # read until a commit lists the shard with a diff of its own (a first commit after a
    # cold start that skips the shard's entry keeps it, as for any listed shard).
    record = {**store.state.commit_record, block_id.shard: dict(top.processed_to)}
    ops.put_commit_state(txn, {block_id.shard: pointer}, mc_block, record)
    ops.delete_import_marker(txn)
    store.write(txn, sync=True)


# ---------------------------------------------------------------------------------------------
# rollback


def rollback_import_at_open(store: Store, log: ImqLogger) -> bool:
    """At open: remove what an import interrupted by a crash wrote (D10) and say so. A
    read-only open cannot, and warns that the view holds a partial import."""
    if store.read_only:
        if ops.read_import_marker(store) is not None:
            if import_lock_held(store.path):  # not left by a crash: an import writes now
                log.info("import_under_way", detail="the view holds the batches written so far")
            else:
                log.warning("import_incomplete", detail="a writer's next open will roll it back")
        return False
    return rollback_import(store, log, reason="interrupted")


def rollback_import(store: Store, log: ImqLogger, *, reason: str) -> bool:
    """Delete everything an unfinished import wrote, and its marker; False if there was
    no unfinished import. Used after a failed import and at open after a crash."""
    marker = ops.read_import_marker(store)
    if marker is None:
        return False
    block_id, spans, partitions = marker
    shard = block_id.shard
    ranges = [DeleteRange(shard, lo, hi, frozenset(partitions), True) for _, lo, hi in spans]
    txn = store.transaction()
    # A diff's tail and info rows are written in one batch, and its tail key (its
    # max_message) lies in its span, so the tail scan finds every info row to delete.
    tails = [tail_rows(r) for r in ranges]
    with ops.view(store, *tails, diffs=True) as view:
        for tail, r in zip(tails, ranges, strict=True):
            stage_delete(view, tail, txn, r)
    ops.delete_import_marker(txn)
    store.write(txn, sync=True)
    store.compact(txn.deleted_ranges)
    log.warning(
        "import_rolled_back",
        block=str(block_id),
        reason=reason,
        diffs=[s for s, _, _ in spans],
    )
    return True
