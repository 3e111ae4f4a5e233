"""The model, also noting whether its history keeps the shape a network writes.

``imq verify`` counts each diff's messages and statistics rows against its record. That
is sound for the histories a network produces: within a source shard, logical time
grows, so every diff written lies above every key written before it (an empty diff may
share the previous diff's key), and seqnos are reused only after a clear, which deletes
a diff's rows in every partition. The queue also accepts other histories (a diff below
or across earlier keys, one sharing their keys, a seqno written again after GC of one
partition collected its diff and left another partition's rows), as the original
does, and ``imq verify`` cannot attribute their rows one by one. The state
machines run ``imq verify`` at the end of every program and require a clean report
when :attr:`RegularModel.regular` still holds.
"""

from __future__ import annotations

from collections.abc import Iterable

from imq.testing.model import DiffInput, QueueModel
from imq.types import QueueKey, ShardIdent

__all__ = ["RegularModel"]


class RegularModel(QueueModel):
    """:class:`QueueModel` plus :attr:`regular`: every diff it wrote lay above all keys
    of its shard written before (or, empty, shared the highest of them)."""

    def __init__(self, zerostate_seqno: int = 0) -> None:
        super().__init__(zerostate_seqno)
        self.regular = True
        # Per source shard, the highest max_message of a diff GC collected: rows of other
        # partitions may remain up to there.
        self._collected: dict[ShardIdent, QueueKey] = {}
        # The blocks of the diffs GC collected: a network commits a seqno once, and GC
        # collects only committed diffs, so their seqnos never come again (another
        # partition's statistics row may remain under the same key a new empty diff of
        # that seqno sharing the collected max_message would own)
        self._collected_blocks: set[tuple[ShardIdent, int]] = set()

    def _floor(self, shard: ShardIdent) -> QueueKey | None:
        """The highest key of ``shard`` a stored diff spans or a collected one left."""
        keys = [d.info.max_message for (s, _), d in self.diffs.items() if s == shard]
        if shard in self._collected:
            keys.append(self._collected[shard])
        return max(keys, default=None)

    def _write(self, diff: DiffInput) -> None:
        shard = diff.block.shard
        floor = self._floor(shard)
        replaced = (shard, diff.block.seqno) in self.diffs
        replaced |= (shard, diff.block.seqno) in self._collected_blocks
        super()._write(diff)
        info = self.diffs[(shard, diff.block.seqno)].info
        above = floor is None or info.min_message > floor
        shares = not diff.messages and info.min_message == info.max_message == floor
        if replaced or not (above or shares):
            self.regular = False

    def copy_floor(self, shard: ShardIdent) -> QueueKey | None:
        """What :meth:`note_import` needs, taken before the import."""
        return self._floor(shard)

    def note_import(
        self,
        shard: ShardIdent,
        floor: QueueKey | None,
        diffs: Iterable[tuple[int, QueueKey, QueueKey]],
    ) -> None:
        """The ``(seqno, min_message, max_message)`` of the diffs an import wrote (the
        model's import writes its fields directly); ``floor``: :meth:`copy_floor` of
        their shard before it."""
        for seqno, lo, _hi in diffs:
            if (floor is not None and lo <= floor) or (shard, seqno) in self._collected_blocks:
                self.regular = False

    def run_gc(self) -> int:
        before = dict(self.diffs)
        executed = super().run_gc()
        for (shard, seqno), diff in before.items():
            if (shard, seqno) not in self.diffs:
                self._collected_blocks.add((shard, seqno))
                top = self._collected.get(shard)
                if top is None or diff.info.max_message > top:
                    self._collected[shard] = diff.info.max_message
        return executed
