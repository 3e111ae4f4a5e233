"""Each shard's highest stored diff, as the store's own writes left it.

``prepare_diff`` of a collator's next block asks two things of the shard's diffs: its
highest stored seqno (the block lies above it, so its own record needs no point read)
and, for the sequence rule, that diff's ``max_message``. Answered from RocksDB, that
is a snapshot, a reverse seek over the diff records and a decode of one record: about a
third of a prepare in the simulation. A store remembers the answer here instead, per
shard, once a prepare has read it (:meth:`DiffTops.remember`), and keeps it true
through its own writes (:meth:`DiffTops.after_write`):

- a diff record put by an apply (:meth:`put_diff_record` of a transaction) above the
  remembered one becomes the shard's top;
- any other change to the diff records (a clear, a GC pass, an import, a point delete)
  makes the store forget every shard: the next prepare of each reads RocksDB again.

What is remembered is never trusted blindly: the prepare reads the top record's stored
bytes (one point read) and takes the RocksDB path whenever they differ from the bytes
remembered, so a record damaged under a live queue still fails the next apply, as it
did before this shortcut.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import NamedTuple

from imq.types import QueueKey, ShardIdent

__all__ = ["DiffTop", "DiffTops"]


class DiffTop(NamedTuple):
    """A shard's highest stored diff: its seqno, record key and bytes, and span end."""

    seqno: int
    key: bytes
    record: bytes
    max_message: QueueKey


class DiffTops:
    """The remembered tops, per shard: a :class:`DiffTop`, or ``None`` for a shard with
    no stored diff; a shard not in the map is not known. Thread-safe."""

    __slots__ = ("_epoch", "_known", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[ShardIdent, DiffTop | None] = {}
        self._epoch = 0  # bumped whenever everything is forgotten

    def lookup(self, shard: ShardIdent) -> tuple[int, bool, DiffTop | None]:
        """``(epoch, known, top)``: pass ``epoch`` back to :meth:`remember` when the
        shard is not known and its top was read from the store."""
        with self._lock:
            known = self._known
            return self._epoch, shard in known, known.get(shard)

    def remember(self, shard: ShardIdent, epoch: int, top: DiffTop | None) -> None:
        """Take ``top``, read from the store while the caller held the shard's write
        lock, unless the store forgot everything since :meth:`lookup` gave ``epoch``
        (the read may predate that write) or the shard became known meanwhile."""
        with self._lock:
            if epoch == self._epoch and shard not in self._known:
                self._known[shard] = top

    def after_write(self, blind: bool, written: Iterable[tuple[ShardIdent, DiffTop]]) -> None:
        """Follow a written batch (under the store's write gate): ``blind``, it changed
        diff records some other way, and every shard is forgotten; otherwise each
        record it put above its known shard's top becomes that top."""
        with self._lock:
            if blind:
                self._known.clear()
                self._epoch += 1
                return
            known = self._known
            for shard, top in written:
                if shard in known:
                    current = known[shard]
                    if current is None or top.seqno >= current.seqno:
                        known[shard] = top

    def forget(self) -> None:
        """Forget every shard (a failed write, a close)."""
        self.after_write(True, ())

    def __len__(self) -> int:
        with self._lock:
            return len(self._known)
