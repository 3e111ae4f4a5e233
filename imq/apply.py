"""Applying a diff: the pre-write checks of SEMANTICS §5.3 and the rows a diff writes.

The checks run against one view, in the original's order: already applied, sequence,
commit pointer. Staging puts every row of the diff into one transaction; nothing is
written until the pending diff is.
"""

from __future__ import annotations

from operator import itemgetter

from imq.diff import DiffStatistics, QueueDiff
from imq.errors import DiffBelowCommitPointerError, DiffConflictError, DiffSequenceError
from imq.storage import TransactionProtocol as Transaction
from imq.storage import ops
from imq.types import Address, BlockIdShort, CommitPointer, DiffInfo, DiffZone, QueueKey
from imq.zones import max_in_zone

__all__ = [
    "already_applied",
    "check_above_pointer",
    "check_sources",
    "resting_key",
    "skipped_by_sequence",
    "stage_diff",
]

_source = itemgetter(1)
_workchain = itemgetter(0)
_account = itemgetter(1)


def check_sources(diff: QueueDiff, block: BlockIdShort) -> None:
    """Every message's source address lies inside the block's shard (the original
    asserts it). C-level passes only: the accounts of a shard are one contiguous byte
    range, so only the workchains, the smallest and the largest account are tested."""
    if not diff.messages:
        return
    sources = list(map(_source, diff.messages))
    shard = block.shard
    workchains = set(map(_workchain, sources))
    accounts = list(map(_account, sources))
    wc = shard.workchain
    for src in (
        *(Address(w, accounts[0]) for w in workchains if w != wc),
        min(accounts),
        max(accounts),
    ):
        address = src if isinstance(src, Address) else Address(wc, src)
        if not shard.contains(address):
            raise ValueError(
                f"diff of block {block}: message source {address} is outside the block's shard"
            )


def resting_key(
    view: ops.View, previous: ops.LastSeqno, block: BlockIdShort, pointer: CommitPointer | None
) -> QueueKey:
    """Where an empty diff that carries no span (no lt span, no explicit keys) sits, as
    both its ``min_message`` and ``max_message``: just above its shard's newest position,
    the next key after the higher of the shard's commit pointer and the ``max_message``
    of the shard's newest stored diff below ``block`` (``previous`` is
    ``LastSeqno(block.shard, below=block.seqno)``); ``QueueKey.MIN`` when the shard has
    neither.

    Committing it therefore never moves the pointer backwards (D6), and until it is
    committed it is in the uncommitted zone, like any diff, so clear removes it."""
    at = None if pointer is None else pointer.key
    seqno = view[previous]
    if seqno is not None:
        info = view.diff_info(block.shard, seqno)
        if info is not None and (at is None or info.max_message > at):
            at = info.max_message
    return QueueKey.MIN if at is None else at.next_value()


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


def skipped_by_sequence(
    view: ops.View, last: ops.LastSeqno, block: BlockIdShort, zone: DiffZone
) -> bool:
    """True if the sequence rule skips the diff: it is at or below the last one visible
    in ``zone`` (``last`` is ``LastSeqno(block.shard)``); a gap is an error."""
    seqno = view[last]
    if seqno is None:
        return False
    # Only the zone matters here: read the record's span, not its whole DiffInfo.
    span = view.diff_span(block.shard, seqno)
    if span is None or not max_in_zone(span[1], view.state.pointers.get(block.shard), zone):
        return False  # absent or not in zone
    if block.seqno <= seqno:
        return True
    if block.seqno != seqno + 1:
        raise DiffSequenceError(
            f"diff of block {block} is not sequential: the last {zone.value} diff of shard "
            f"{block.shard} has seqno {seqno}"
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
            f"pointer of shard {block.shard} ({pointer.key}, seqno {pointer.seqno})"
        )


def stage_diff(
    txn: Transaction,
    diff: QueueDiff,
    block: BlockIdShort,
    diff_hash: bytes,
    stats: DiffStatistics,
) -> DiffInfo:
    """Put every row of ``diff`` into ``txn``: messages, statistics, tail, diff info."""
    shard, seqno = block.shard, block.seqno
    router = diff.router
    partition_for = None if router.is_empty else router.partition_for
    per_partition: dict[int, int] = {}
    ops.put_messages(txn, shard, diff.messages, partition_for, per_partition)
    info = DiffInfo(
        min_message=stats.min_message,
        max_message=stats.max_message,
        shards_messages_count=stats.shards_messages_count,
        hash=diff_hash,
        processed_to=dict(diff.processed_to),
        router_src=router.src_partitions(),
        router_dst=router.dst_partitions(),
        seqno=seqno,
        prev_hash=diff.prev_hash,
    )
    written = router.partitions() | stats.partitions.keys()
    partitions = {p: per_partition.get(p, 0) for p in written}
    ops.put_diff(txn, shard, info, stats.partitions, partitions)
    return info
