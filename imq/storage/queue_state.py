"""The queue's small state, kept in memory beside the tables (D14): one frozen value.

:class:`QueueState` holds the commit pointers, the last committed masterchain block, the
commit record and the GC bounds. The store keeps exactly one, loaded at open, and
replaces it under its write gate in the same step as the write that changed the rows it
mirrors; a snapshot carries the value current when it was opened. A transaction says
how it changes the state with :class:`StateUpdate` functions, applied to whatever value
is current at write time (so a GC mark and a commit never undo each other's fields).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from imq.types import BlockId, CommitPointer, QueueKey, ShardIdent

__all__ = ["CommitRecord", "GcBounds", "QueueState", "StateUpdate"]

CommitRecord = Mapping[ShardIdent, Mapping[ShardIdent, QueueKey]]
"""Per top shard listed in the last commit: the ``processed_to`` of its newest diff (D7)."""

GcBounds = Mapping[tuple[int, ShardIdent], QueueKey]
"""Per (partition, source shard): the highest key GC deletes up to, inclusive."""


@dataclass(frozen=True, slots=True)
class QueueState:
    """Commit pointers, last committed block, commit record and GC bounds, as stored.

    Never mutated: every change makes a new value (the mappings are not copied, so a
    holder must not change them either; mypy sees them as read-only ``Mapping``s)."""

    pointers: Mapping[ShardIdent, CommitPointer] = field(default_factory=dict)
    last_mc_block: BlockId | None = None
    commit_record: CommitRecord = field(default_factory=dict)
    gc_requested: GcBounds = field(default_factory=dict)
    gc_executed: GcBounds = field(default_factory=dict)

    def committed(
        self,
        moved: Mapping[ShardIdent, CommitPointer],
        mc_block: BlockId | None,
        record: CommitRecord | None = None,
        gc_requested: GcBounds | None = None,
    ) -> QueueState:
        """After a commit (or an import): the ``moved`` pointers, and the block, record
        and requested bounds that are given; what is ``None`` stays as it was."""
        return replace(
            self,
            pointers={**self.pointers, **moved},
            last_mc_block=self.last_mc_block if mc_block is None else mc_block,
            commit_record=self.commit_record if record is None else record,
            gc_requested=self.gc_requested if gc_requested is None else gc_requested,
        )

    def gc_marked(self, executed: GcBounds) -> QueueState:
        """After GC marked bounds executed."""
        return replace(self, gc_executed=executed)


StateUpdate = Callable[[QueueState], QueueState]
