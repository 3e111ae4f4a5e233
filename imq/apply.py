"""Applying a diff: the pre-write checks of SEMANTICS §5.3 and the rows a diff writes.

The checks run against one snapshot, in the original's order: duplicate, sequence,
commit pointer. Staging builds every row of the diff into one transaction; nothing is
written until the pending diff is.
"""

from __future__ import annotations

from operator import itemgetter

from imq import reads
from imq.diff import DiffStatistics, QueueDiff
from imq.errors import DiffBelowCommitPointerError, DiffConflictError, DiffSequenceError
from imq.storage import Scan, Snapshot, Table, Transaction, codec
from imq.types import (
    Address,
    BlockIdShort,
    CommitPointer,
    DiffInfo,
    DiffZone,
    QueueKey,
    ShardIdent,
)

__all__ = [
    "check_above_pointer",
    "check_duplicate",
    "check_sources",
    "check_sequence",
    "last_seqno",
    "last_seqno_scan",
    "previous_diff_scan",
    "resting_key",
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


def last_seqno_scan(shard: ShardIdent) -> Scan:
    """A reverse key scan whose first row is the shard's highest stored seqno."""
    lo, hi = codec.diff_info_shard_range(shard)
    return Scan(Table.DIFF_INFO, lo, hi, keys_only=True, reverse=True)


def last_seqno(snap: Snapshot, cursor_index: int) -> int | None:
    for key in snap.cursors[cursor_index]:
        return codec.decode_diff_info_seqno(key)
    return None


def previous_diff_scan(block: BlockIdShort) -> Scan:
    """A reverse key scan whose first row is the shard's newest stored diff below
    ``block``'s seqno."""
    lo, _ = codec.diff_info_shard_range(block.shard)
    hi = codec.diff_info_key(block.shard, block.seqno)
    return Scan(Table.DIFF_INFO, lo, hi, keys_only=True, reverse=True)


def resting_key(
    snap: Snapshot, cursor_index: int, block: BlockIdShort, pointer: CommitPointer | None
) -> QueueKey:
    """Where an empty diff that carries no span (no lt span, no explicit keys) sits, as
    both its ``min_message`` and ``max_message``: just above its shard's newest position,
    the next key after the higher of the shard's commit pointer and the ``max_message``
    of the shard's newest stored diff below ``block`` (read from the previous-diff scan
    at ``cursor_index``); ``QueueKey.MIN`` when the shard has neither.

    Committing it therefore never moves the pointer backwards (D6), and until it is
    committed it is in the uncommitted zone, like any diff, so clear removes it."""
    at = None if pointer is None else pointer.key
    seqno = last_seqno(snap, cursor_index)
    if seqno is not None:
        previous = reads.diff_info(snap, block.shard, seqno)
        if previous is not None and (at is None or previous.max_message > at):
            at = previous.max_message
    return QueueKey.MIN if at is None else at.next_value()


def check_duplicate(snap: Snapshot, block: BlockIdShort, diff_hash: bytes) -> bool:
    """True if this exact diff is already stored; a different hash is a conflict."""
    stored = reads.diff_info(snap, block.shard, block.seqno)
    if stored is None:
        return False
    if stored.hash != diff_hash:
        raise DiffConflictError(
            f"diff of block {block} is already stored with hash {stored.hash.hex()}, "
            f"not {diff_hash.hex()}"
        )
    return True


def check_sequence(snap: Snapshot, cursor_index: int, block: BlockIdShort, zone: DiffZone) -> bool:
    """True if the diff is at or below the last one visible in ``zone`` (skip it)."""
    last = last_seqno(snap, cursor_index)
    if last is None:
        return False
    if reads.diff_info(snap, block.shard, last, zone) is None:  # absent or not in zone
        return False
    if block.seqno <= last:
        return True
    if block.seqno != last + 1:
        raise DiffSequenceError(
            f"diff of block {block} is not sequential: the last {zone.value} diff of shard "
            f"{block.shard} has seqno {last}"
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
    put, target = txn.writer(Table.MESSAGES)
    codec.put_message_rows(put, target, shard, diff.messages, partition_for, counts=per_partition)
    for partition, counts in stats.partitions.items():
        txn.put(
            Table.STATISTICS,
            codec.stat_key(shard, partition, stats.max_message, seqno),
            codec.stat_value(counts),
        )
    txn.put(Table.DIFF_TAIL, codec.tail_key(shard, stats.max_message, seqno), b"")
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
    txn.put(
        Table.DIFF_INFO,
        codec.diff_info_key(shard, seqno),
        codec.diff_info_value(info, partitions),
    )
    return info
