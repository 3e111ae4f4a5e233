"""Zones (SEMANTICS §6): which side of its shard's commit pointer a diff lies on.

A diff is committed iff its shard has a pointer and the pointer's key is at or above
the diff's ``max_message``. The pointer's seqno plays no part in zones.
"""

from __future__ import annotations

from imq.types import CommitPointer, DiffInfo, DiffZone

__all__ = ["in_zone", "is_committed"]


def is_committed(info: DiffInfo, pointer: CommitPointer | None) -> bool:
    return pointer is not None and pointer.key >= info.max_message


def in_zone(info: DiffInfo, pointer: CommitPointer | None, zone: DiffZone) -> bool:
    if zone is DiffZone.BOTH:
        return True
    return is_committed(info, pointer) == (zone is DiffZone.COMMITTED)
