"""Zones (SEMANTICS §6): which side of its shard's commit pointer a diff lies on.

A diff is committed iff its shard has a pointer and the pointer's key is at or above
the diff's ``max_message``. The pointer's seqno plays no part in zones.
"""

from __future__ import annotations

from imq.types import CommitPointer, DiffInfo, DiffZone, QueueKey

__all__ = ["in_zone", "max_in_zone"]


def max_in_zone(max_message: QueueKey, pointer: CommitPointer | None, zone: DiffZone) -> bool:
    """The zone test on a diff's ``max_message`` alone (no :class:`DiffInfo` needed)."""
    if zone is DiffZone.BOTH:
        return True
    committed = pointer is not None and pointer.key >= max_message
    return committed == (zone is DiffZone.COMMITTED)


def in_zone(info: DiffInfo, pointer: CommitPointer | None, zone: DiffZone) -> bool:
    return max_in_zone(info.max_message, pointer, zone)
