"""Applying a diff: the pre-write checks of SEMANTICS §5.3 and the rows a diff writes.

The checks run against one view, in the original's order: already applied, sequence,
commit pointer. Staging puts every row of the diff into one transaction; nothing is
written until the pending diff is.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator, Sequence
from operator import itemgetter
from typing import Any

from imq import _native as native
from imq.diff import DiffStatistics, QueueDiff
from imq.errors import (
    DiffBelowCommitPointerError,
    DiffConflictError,
    DiffSequenceError,
    ImqError,
)
from imq.storage import TransactionProtocol as Transaction
from imq.storage import codec, ops
from imq.storage.tops import DiffTop
from imq.types import (
    Address,
    BlockIdShort,
    CommitPointer,
    DiffZone,
    QueueKey,
    ShardIdent,
)
from imq.zones import max_in_zone

__all__ = [
    "already_applied",
    "check_above_pointer",
    "check_sources",
    "resting_key",
    "source_outside",
    "sequence_skips",
    "stage_diff",
]

_source = itemgetter(1)
_c_sources_in_shard: Any = None if native.speedups is None else native.speedups.sources_in_shard
_workchain = itemgetter(0)
_account = itemgetter(1)


def check_sources(diff: QueueDiff, block: BlockIdShort) -> None:
    """Every message's source address lies inside the block's shard (run with
    ``QueueConfig.check_sources``; the original's queue does not check). One C pass when
    ``imq._speedups`` is built; otherwise, or when that pass finds a source outside,
    C-level passes of Python that name the address: the accounts of a shard are one
    contiguous byte range, so only the workchains, the smallest and the largest account
    are tested."""
    if not diff.messages:
        return
    shard = block.shard
    if _c_sources_in_shard is not None and _c_sources_in_shard(
        diff.messages, shard.workchain, shard.prefix, shard.prefix_len
    ):
        return
    sources = list(map(_source, diff.messages))
    outside = source_outside(shard, set(map(_workchain, sources)), list(map(_account, sources)))
    if outside is not None:
        raise ValueError(
            f"diff of block {block}: message source {outside} is outside the block's shard "
            "(a shard's diff holds only messages its own accounts sent: apply it under the "
            "block of the shard that sent them)"
        )


def source_outside(
    shard: ShardIdent, workchains: set[int], accounts: Sequence[bytes]
) -> Address | None:
    """A source address outside ``shard`` among messages whose sources have these
    workchains and (non-empty) accounts, else ``None``. The accounts of a shard are one
    contiguous byte range of one workchain, so only the other workchains, the smallest
    and the largest account are tested."""
    wc = shard.workchain
    for w in workchains:
        if w != wc:  # first: a shard's workchain may hold no std address (not in -128..127)
            return Address(w, accounts[0])
    for account in (min(accounts), max(accounts)):
        address = Address(wc, account)
        if not shard.contains(address):
            return address
    return None


def resting_key(
    view: ops.View, previous: ops.LastSeqno, block: BlockIdShort, pointer: CommitPointer | None
) -> QueueKey:
    """Where an empty diff that carries no span (no lt span, no explicit keys) sits, as
    both its ``min_message`` and ``max_message``: just above its shard's newest position,
    the next key after the higher of the shard's commit pointer and the ``max_message``
    of the shard's newest stored diff below ``block`` (``previous`` is
    ``LastSeqno(block.shard, below=block.seqno)``); ``QueueKey.MIN`` when the shard has
    neither or that position is ``MIN`` itself (the original's ``statistics=None`` rule:
    such diffs share ``MIN``, and a pointer may stay at ``MIN`` with a higher seqno).

    Committing it therefore never moves the pointer backwards (D6); above ``MIN``, until
    it is committed it is in the uncommitted zone, like any diff, so clear removes it (at
    ``MIN`` a pointer at ``MIN`` already covers it: SEMANTICS §6, as in the original)."""
    at = None if pointer is None else pointer.key
    seqno = view[previous]
    if seqno is not None:
        info = view.diff_info(block.shard, seqno)
        if info is not None and (at is None or info.max_message > at):
            at = info.max_message
    return QueueKey.MIN if at is None or at == QueueKey.MIN else at.next_value()


def already_applied(view: ops.View, block: BlockIdShort, diff_hash: bytes) -> bool:
    """True if this exact diff is already stored (applying it again is a no-op); the
    block's diff stored with another hash is a conflict."""
    stored = view.diff_info(block.shard, block.seqno)
    if stored is None:
        return False
    if stored.hash != diff_hash:
        raise DiffConflictError(
            f"diff of block {block} is already stored with hash {stored.hash.hex()}, "
            f"not {diff_hash.hex()}"
        )
    return True


def sequence_skips(
    top: DiffTop | None, pointer: CommitPointer | None, block: BlockIdShort, zone: DiffZone
) -> bool:
    """The sequence rule on the shard's highest stored diff ``top`` (``None``: none
    stored): True if the block is at or below it and it is in ``zone``; a gap above it
    is an error."""
    # Only the zone matters here: the record's span, not its whole DiffInfo.
    if top is None or not max_in_zone(top.max_message, pointer, zone):
        return False  # absent or not in zone
    if block.seqno <= top.seqno:
        return True
    if block.seqno != top.seqno + 1:
        stored = "stored" if zone is DiffZone.BOTH else zone.value
        raise DiffSequenceError(
            f"diff of block {block} is not sequential: the last {stored} diff of shard "
            f"{block.shard} has seqno {top.seqno}; apply the diffs of seqnos "
            f"{top.seqno + 1}..{block.seqno - 1} first, in order (or leave check_sequence "
            "off where diffs may arrive with gaps)"
        )
    return False


def check_above_pointer(
    pointer: CommitPointer | None, block: BlockIdShort, diff: QueueDiff
) -> None:
    if pointer is None or not diff.messages:
        return
    first = diff.messages[0].key
    if first <= pointer.key:
        raise DiffBelowCommitPointerError(
            f"diff of block {block}: its smallest message {first} is not above the commit "
            f"pointer of shard {block.shard} ({pointer.key}, seqno {pointer.seqno}); that "
            "part of the shard is committed already: drop this diff, or check that the block "
            "belongs to this queue's network"
        )


@contextlib.contextmanager
def _as_built(block: BlockIdShort) -> Iterator[None]:
    """Staging of a diff's rows: the values were checked when built, so an encoding
    error can only come from a dict one of them handed out (``processed_to``, the
    statistics' counts) and the caller changed since: say so."""
    try:
        yield
    except ImqError:
        raise
    except (struct.error, OverflowError, TypeError, ValueError, AttributeError, KeyError) as exc:
        raise ValueError(
            f"diff of block {block} cannot be stored: {exc!r}; its processed_to or its "
            "statistics were changed after they were built (value types are immutable: "
            "build a new QueueDiff or DiffStatistics instead of editing their dicts)"
        ) from exc


def stage_diff(
    txn: Transaction,
    diff: QueueDiff,
    block: BlockIdShort,
    diff_hash: bytes,
    stats: DiffStatistics | tuple[QueueKey, QueueKey],
) -> None:
    """Put every row of ``diff`` into ``txn``: messages, statistics, tail, diff info.

    ``stats`` is the caller's :class:`DiffStatistics`, used as given, or the diff's
    ``(min_message, max_message)``: the statistics are then derived from the messages,
    counted in the same pass that encodes their rows (``imq.storage.codec.encode_diff``), with
    the counts, rows and bytes ``DiffStatistics.from_diff`` would give. The diff's record
    is what :class:`DiffInfo` would store, packed from the checked parts directly."""
    with _as_built(block):
        shard, seqno = block.shard, block.seqno
        router = diff.router
        # A router of destinations only (the usual one) is a dict the encoder looks up itself.
        routes = router.destination_routes()
        partition_for: ops.PartitionFor = (
            None if router.is_empty else router.partition_for if routes is None else dict(routes)
        )
        per_partition: dict[int, int] = {}
        if isinstance(stats, DiffStatistics):
            ops.put_messages(txn, shard, diff.messages, partition_for, per_partition)
            min_message, max_message = stats.min_message, stats.max_message
            shards_messages_count = stats.shards_messages_count
            stat_values = ops.stat_values(stats.partitions)
        else:
            min_message, max_message = stats
            encoded = ops.put_diff_messages(txn, shard, diff.messages, partition_for)
            stat_values = {}
            for partition, messages, value in encoded.partitions:
                per_partition[partition] = messages
                stat_values[partition] = value
            shards_messages_count = {ShardIdent.full(wc): n for wc, n in encoded.workchains}
        # The partitions this diff writes rows into: its messages' and its statistics'
        # (a clear deletes the diff's rows there, I3). Not the router's partitions nor 0
        # as such: a clear of partition 1 alone must not touch partition 0's rows of
        # other diffs above the pointer (an outside audit found it did).
        written = {p for p, n in per_partition.items() if n} | stat_values.keys()
        record = codec.diff_record_value(
            min_message,
            max_message,
            shards_messages_count,
            diff_hash,
            diff.processed_to,
            router.src_partitions(),
            router.dst_partitions(),
            seqno,
            diff.prev_hash,
            {p: per_partition.get(p, 0) for p in written},
        )
        ops.put_diff_encoded(txn, shard, seqno, max_message, stat_values, record)
