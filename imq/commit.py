"""Committing the queue on a masterchain block (SEMANTICS §5.5 with D6 and D7).

``plan_commit`` is pure: given the top blocks, the stored state it needs and a diff
lookup, it decides the new pointers, the commit record and the GC bounds, or raises
``CommitError`` before anything is written. ``stage_commit`` turns a plan into rows.

The commit record (D7) holds, for every shard listed in the top blocks, the
``processed_to`` of that shard's newest committed diff; a listed shard whose diff is
gone keeps its previous entry, and shards no longer listed drop out (an import enters
its shard's newest diff as a commit of it would). The GC bound of a
source shard is the minimum of its ``processed_to`` over the record's entries, so an
idle shard holds back the deletion of messages it has not read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from imq.errors import CommitError
from imq.storage import TransactionProtocol as Transaction
from imq.storage import ops
from imq.storage.queue_state import CommitRecord, GcBounds
from imq.types import BlockId, CommitPointer, DiffInfo, QueueKey, ShardIdent, TopBlock

__all__ = [
    "check_forward",
    "CommitPlan",
    "gc_bounds",
    "masterchain_block",
    "plan_commit",
    "stage_commit",
]

DiffLookup = Callable[[ShardIdent, int], DiffInfo | None]


@dataclass(frozen=True, slots=True)
class CommitPlan:
    mc_block: BlockId
    moved: dict[ShardIdent, CommitPointer]  # pointers this commit writes
    pointers: dict[ShardIdent, CommitPointer]  # every pointer after the commit
    record: CommitRecord
    gc_requested: GcBounds


def masterchain_block(top_blocks: Sequence[TopBlock]) -> BlockId:
    """The masterchain block being committed: the one masterchain entry. None is
    ``CommitError``, as in the original; so are two (I24: the original takes the first,
    and a second with a diff then moves the masterchain pointer past the block
    committed, so that the commit of the block between them is skipped)."""
    blocks = [top.block_id for top in top_blocks if top.block_id.is_masterchain]
    if not blocks:
        raise CommitError(
            "no masterchain block in the top blocks given to commit_diff; list the "
            "masterchain block being committed among them, with each shard's top block"
        )
    if len(blocks) > 1:
        raise CommitError(
            f"the masterchain is listed twice in commit_diff ({blocks[0]} and {blocks[1]}); "
            "list the masterchain block being committed once, with each shard's top block"
        )
    return blocks[0]


_COMMIT_HINT = "pass the top blocks of a masterchain block newer than the one last committed"


def check_forward(
    shard: ShardIdent,
    old: CommitPointer | None,
    new: CommitPointer,
    operation: str = "commit",
    hint: str = _COMMIT_HINT,
) -> None:
    """D6: a commit pointer never moves backwards (commit, and import, which sets one).
    ``hint``: what the caller of ``operation`` can do instead."""
    if old is not None and (new.key < old.key or new.seqno < old.seqno):
        raise CommitError(
            f"{operation} would move the commit pointer of shard {shard} backwards: from "
            f"({old.key}, seqno {old.seqno}) to ({new.key}, seqno {new.seqno}); {hint}"
        )


def gc_bounds(record: CommitRecord) -> dict[ShardIdent, QueueKey]:
    """Per source shard: the minimum ``processed_to`` over all record entries naming it."""
    bounds: dict[ShardIdent, QueueKey] = {}
    for processed_to in record.values():
        for shard, key in processed_to.items():
            current = bounds.get(shard)
            if current is None or key < current:
                bounds[shard] = key
    return bounds


def plan_commit(
    top_blocks: Sequence[TopBlock],
    partitions: Iterable[int],
    *,
    pointers: Mapping[ShardIdent, CommitPointer],
    last_mc_block: BlockId | None,
    record: CommitRecord,
    gc_requested: GcBounds,
    find_diff: DiffLookup,
    zerostate_seqno: int,
) -> CommitPlan | None:
    """The commit's effects, or ``None`` when an equal or later masterchain block was
    already committed (the commit is then skipped).

    The original skips only by the masterchain pointer's seqno; imq also skips by the
    last committed block (decision I8), which a commit whose masterchain diff is absent
    sets without moving that pointer, so the last committed block never moves back.
    """
    mc_block = masterchain_block(top_blocks)
    mc_pointer = pointers.get(ShardIdent.MASTERCHAIN)
    if mc_pointer is not None and mc_pointer.seqno >= mc_block.seqno:
        return None
    if last_mc_block is not None and last_mc_block.seqno >= mc_block.seqno:
        return None

    moved: dict[ShardIdent, CommitPointer] = {}
    new_record: dict[ShardIdent, Mapping[ShardIdent, QueueKey]] = {}
    for top in top_blocks:
        block = top.block_id
        info = find_diff(block.shard, block.seqno)
        if info is None:
            if top.updated and top.ref_by_mc_seqno > zerostate_seqno:
                raise CommitError(
                    f"diff not found for block {block.shard}:{block.seqno} "
                    f"(ref_by_mc_seqno {top.ref_by_mc_seqno}, zerostate seqno {zerostate_seqno}); "
                    "apply that block's diff first, then commit again (a top block that did not "
                    "change since the last masterchain block is passed with updated=False)"
                )
            # Skipped, as in the original, before any check of a repeated shard. A shard
            # this commit also finds a diff of takes that diff's entry, in either order.
            if block.shard in record and block.shard not in moved:
                new_record[block.shard] = record[block.shard]
            continue
        if block.shard in moved:
            # SEMANTICS §5.5: only entries with a diff set a pointer, so only two of them
            # make a shard "listed twice"; a skipped entry never does.
            raise CommitError(
                f"shard {block.shard} is listed twice in commit_diff with a stored diff each "
                f"(block {block}); list each shard once, with its top block"
            )
        pointer = CommitPointer(info.max_message, info.seqno)
        check_forward(block.shard, pointers.get(block.shard), pointer)
        moved[block.shard] = pointer
        new_record[block.shard] = dict(info.processed_to)

    requested: dict[tuple[int, ShardIdent], QueueKey] = dict(gc_requested)
    bounds = gc_bounds(new_record)
    for partition in partitions:
        for shard, key in bounds.items():
            requested[(partition, shard)] = key
    return CommitPlan(
        mc_block=mc_block,
        moved=moved,
        pointers={**pointers, **moved},
        record=new_record,
        gc_requested=requested,
    )


def stage_commit(txn: Transaction, plan: CommitPlan) -> None:
    ops.put_commit_state(txn, plan.moved, plan.mc_block, plan.record, plan.gc_requested)
