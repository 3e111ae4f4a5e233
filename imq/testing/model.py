"""A plain-Python model of the queue's semantics, for the model-based tests.

Written from ``docs/behaviour.md`` (with its decisions) and imq's own
decisions (``docs/architecture.md``, I1-I8), not from imq's internals: no bytes, no
RocksDB, no imq module other than its public value types and errors. Every operation
checks first and mutates only when every check passed, so a raised error leaves the
model unchanged, as the real queue must.

What the model holds:

- ``messages``: ``(partition, source shard, key) -> Message``;
- ``diffs``: ``(shard, seqno) -> ModelDiff`` (its DiffInfo and the partitions it wrote);
- ``stats``: ``(shard, partition, diff max_message, seqno, destination) -> count``;
- ``pointers``, ``last_mc_block``, the commit record (D7);
- the GC bounds (SEMANTICS §7 with D7, D8): ``gc_requested`` (written by commit) and
  ``gc_executed`` (written by a GC pass), both ``(partition, source shard) -> key`` and
  both persisted, so they survive a reopen.

A GC pass (:meth:`QueueModel.run_gc`) runs every ``(partition, shard)`` whose requested
bound is strictly above its executed one (or has none). For each, with bound ``b``
(SEMANTICS §8 with D4, D5): the messages of that partition and source shard with key
``<= b``, the statistics rows of that ``(shard, partition)`` whose diff ``max_message``
is ``<= b``, and every diff of the shard with ``max_message <= b`` (its record, so all
its partitions' bookkeeping, seqno 0 included) go; statistics rows of *other*
partitions of those diffs stay until a bound of their own partition runs. A diff GC
removed is gone from ``diffs``, so a later clear no longer knows which partitions it
wrote (imq's clear reads them from the stored record, which GC deleted too).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from imq import (
    Address,
    BlockId,
    BlockIdShort,
    CommitError,
    CommitPointer,
    DiffBelowCommitPointerError,
    DiffConflictError,
    DiffInfo,
    DiffSequenceError,
    DiffZone,
    IteratedMessage,
    Message,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    StartupError,
    TopBlock,
)
from imq.reads import check_masterchain_block

__all__ = ["DiffInput", "ModelDiff", "ModelIterator", "QueueModel"]

MessageKey = tuple[int, ShardIdent, QueueKey]
StatKey = tuple[ShardIdent, int, QueueKey, int, Address]


@dataclass(frozen=True)
class DiffInput:
    """Everything a test passes to ``prepare_diff`` / ``apply_diff``, in plain values.

    ``router_src`` / ``router_dst`` map an account to its partition (each account once).
    ``bounds`` is the explicit statistics ``(min_message, max_message)``; ``None`` means
    the default (the diff's first and last keys; for an empty diff the shard's resting
    key, see ``QueueModel._resting_key``).
    """

    block: BlockIdShort
    diff_hash: bytes
    messages: tuple[Message, ...]
    processed_to: dict[ShardIdent, QueueKey] = field(default_factory=dict)
    router_src: dict[Address, int] = field(default_factory=dict)
    router_dst: dict[Address, int] = field(default_factory=dict)
    prev_hash: bytes | None = None
    bounds: tuple[QueueKey, QueueKey] | None = None
    span: tuple[int, int] | None = None  # the block's (start_lt, end_lt), if the diff has one
    # The caller's statistics, stored as given (SEMANTICS §5.3; the queue recounts them only
    # in its check_statistics mode): partition -> destination -> count. None: counted here.
    given_statistics: dict[int, dict[Address, int]] | None = None

    def sorted_messages(self) -> list[Message]:
        return sorted(self.messages, key=lambda m: m.key)

    def partition_for(self, message: Message) -> int:
        """SEMANTICS §12: the destination map, then the source map, then 0."""
        if message.dst in self.router_dst:
            return self.router_dst[message.dst]
        return self.router_src.get(message.src, 0)

    def stat_bounds(self) -> tuple[QueueKey, QueueKey]:
        if self.bounds is not None:
            return self.bounds
        msgs = self.sorted_messages()
        if msgs:
            return msgs[0].key, msgs[-1].key
        if self.span is not None:
            return QueueKey.min_for_lt(self.span[0]), QueueKey.max_for_lt(self.span[1])
        return QueueKey.MIN, QueueKey.MIN

    def statistics(self) -> dict[int, dict[Address, int]]:
        """partition -> destination -> count: the caller's, else as
        ``DiffStatistics.from_diff`` counts."""
        if self.given_statistics is not None:
            return {p: dict(c) for p, c in self.given_statistics.items()}
        counts: dict[int, dict[Address, int]] = {}
        for message in self.messages:
            bucket = counts.setdefault(self.partition_for(message), {})
            bucket[message.dst] = bucket.get(message.dst, 0) + 1
        return counts


def _group(mapping: Mapping[Address, int]) -> dict[int, frozenset[Address]]:
    grouped: dict[int, set[Address]] = {}
    for address, partition in mapping.items():
        grouped.setdefault(partition, set()).add(address)
    return {p: frozenset(a) for p, a in grouped.items()}


@dataclass(frozen=True)
class ModelDiff:
    info: DiffInfo
    partitions: frozenset[int]  # where it wrote rows: its messages' and statistics' partitions


def _in_zone(info: DiffInfo, pointer: CommitPointer | None, zone: DiffZone) -> bool:
    """SEMANTICS §6: committed iff a pointer exists and its key >= the diff's max_message."""
    committed = pointer is not None and pointer.key >= info.max_message
    if zone is DiffZone.BOTH:
        return True
    return committed == (zone is DiffZone.COMMITTED)


class ModelIterator:
    """SEMANTICS §11.2: refill every source not in the heap (recording skipped keys),
    then pop the smallest message. ``current_position`` is the last key consumed per
    source shard, skipped ones included."""

    def __init__(
        self,
        messages: Mapping[MessageKey, Message],
        partition: int,
        ranges: Sequence[QueueShardRange],
        for_shard: ShardIdent,
    ) -> None:
        shards = [r.shard for r in ranges]
        if len(set(shards)) != len(shards):
            raise ValueError("two ranges name one source shard")
        self._shards = shards
        # Each range's messages in key order (one pass over the model's messages).
        source = {r.shard: (i, r) for i, r in enumerate(ranges)}
        self._streams: list[list[tuple[QueueKey, Message]]] = [[] for _ in ranges]
        for (p, shard, key), msg in messages.items():
            found = source.get(shard) if p == partition else None
            if found is not None and found[1].from_key <= key < found[1].to_key:
                self._streams[found[0]].append((key, msg))
        for stream in self._streams:
            stream.sort(key=_first)
        self._next = [0] * len(ranges)
        # The heap: one pending message per source, by (key, source index).
        self._heads: list[tuple[QueueKey, int, Message]] = []
        self._refill = list(range(len(ranges)))  # sources with no message in the heap
        self._for_shard = for_shard
        self._accepts: dict[Address, bool] = {}  # for_shard.contains, per destination
        self._position: dict[ShardIdent, QueueKey] = {}

    def __iter__(self) -> Iterator[IteratedMessage]:
        return self

    def __next__(self) -> IteratedMessage:
        for idx in self._refill:
            stream = self._streams[idx]
            at = self._next[idx]
            while at < len(stream):
                key, msg = stream[at]
                at += 1
                accepts = self._accepts.get(msg.dst)
                if accepts is None:
                    accepts = self._accepts[msg.dst] = self._for_shard.contains(msg.dst)
                if accepts:
                    heapq.heappush(self._heads, (key, idx, msg))
                    break
                self._position[self._shards[idx]] = key
            self._next[idx] = at
        self._refill = []
        if not self._heads:
            raise StopIteration
        key, idx, msg = heapq.heappop(self._heads)
        self._refill.append(idx)
        self._position[self._shards[idx]] = key
        return IteratedMessage(self._shards[idx], msg)

    def current_position(self) -> dict[ShardIdent, QueueKey]:
        return dict(self._position)


def _first(pair: tuple[QueueKey, Message]) -> QueueKey:
    return pair[0]


class QueueModel:
    def __init__(self, zerostate_seqno: int = 0) -> None:
        self.zerostate_seqno = zerostate_seqno
        self.messages: dict[MessageKey, Message] = {}
        self.diffs: dict[tuple[ShardIdent, int], ModelDiff] = {}
        self.stats: dict[StatKey, int] = {}
        self.pointers: dict[ShardIdent, CommitPointer] = {}
        self.last_mc_block: BlockId | None = None
        self.commit_record: dict[ShardIdent, dict[ShardIdent, QueueKey]] = {}
        self.gc_requested: dict[tuple[int, ShardIdent], QueueKey] = {}
        self.gc_executed: dict[tuple[int, ShardIdent], QueueKey] = {}

    # -- applying diffs (SEMANTICS §5.3, §5.4) ------------------------------------------------

    def check_diff(self, diff: DiffInput, check_sequence: DiffZone | None) -> bool:
        """The pre-write checks in their exact order; True if the diff would be written,
        False for a no-op (already applied, or skipped by the sequence rule)."""
        shard, seqno = diff.block.shard, diff.block.seqno
        stored = self.diffs.get((shard, seqno))
        if stored is not None:
            if stored.info.hash != diff.diff_hash:
                raise DiffConflictError(f"{diff.block} stored with another hash")
            return False
        if check_sequence is not None:
            last = self.get_last_applied_seqno(shard)
            if last is not None and _in_zone(
                self.diffs[(shard, last)].info, self.pointers.get(shard), check_sequence
            ):
                if seqno <= last:
                    return False
                if seqno != last + 1:
                    raise DiffSequenceError(f"{diff.block} after {last}")
        pointer = self.pointers.get(shard)
        msgs = diff.sorted_messages()
        if pointer is not None and msgs and msgs[0].key <= pointer.key:
            raise DiffBelowCommitPointerError(f"{diff.block} below {pointer}")
        return True

    def apply(self, diff: DiffInput, check_sequence: DiffZone | None) -> bool:
        if not self.check_diff(diff, check_sequence):
            return False
        self._write(diff)
        return True

    def _resting_key(self, shard: ShardIdent, seqno: int) -> QueueKey:
        """Where an empty diff without bounds sits: the key after the higher of the
        shard's pointer and the max_message of its newest stored diff below ``seqno``
        (MIN if neither, or if that is MIN itself)."""
        pointer = self.pointers.get(shard)
        candidates = [] if pointer is None else [pointer.key]
        below = [s for (sh, s) in self.diffs if sh == shard and s < seqno]
        if below:
            candidates.append(self.diffs[(shard, max(below))].info.max_message)
        at = max(candidates, default=QueueKey.MIN)
        return at if at == QueueKey.MIN else at.next_value()

    def _write(self, diff: DiffInput) -> None:
        shard, seqno = diff.block.shard, diff.block.seqno
        if diff.bounds is None and diff.span is None and not diff.messages:
            min_message = max_message = self._resting_key(shard, seqno)
        else:
            min_message, max_message = diff.stat_bounds()
        for message in diff.messages:
            self.messages[(diff.partition_for(message), shard, message.key)] = message
        stats = diff.statistics()
        per_workchain: dict[int, int] = {}
        for partition, counts in stats.items():
            for dst, count in counts.items():
                self.stats[(shard, partition, max_message, seqno, dst)] = count
                per_workchain[dst.workchain] = per_workchain.get(dst.workchain, 0) + count
        info = DiffInfo(
            min_message=min_message,
            max_message=max_message,
            shards_messages_count={ShardIdent.full(wc): n for wc, n in per_workchain.items()},
            hash=diff.diff_hash,
            processed_to=dict(diff.processed_to),
            router_src=_group(diff.router_src),
            router_dst=_group(diff.router_dst),
            seqno=seqno,
            prev_hash=diff.prev_hash,
        )
        partitions = frozenset({*map(diff.partition_for, diff.messages), *stats.keys()})
        self.diffs[(shard, seqno)] = ModelDiff(info, partitions)

    # -- commit (SEMANTICS §5.5 with D6, D7) ---------------------------------------------------

    def commit(self, top_blocks: Sequence[TopBlock], partitions: Iterable[int]) -> bool:
        mc_blocks = [t.block_id for t in top_blocks if t.block_id.is_masterchain]
        if len(mc_blocks) != 1:  # none, or two (I24)
            raise CommitError(f"{len(mc_blocks)} masterchain blocks")
        mc_block = mc_blocks[0]
        mc_pointer = self.pointers.get(ShardIdent.MASTERCHAIN)
        if mc_pointer is not None and mc_pointer.seqno >= mc_block.seqno:
            return False
        # I8 (docs/architecture.md): the last committed block never moves back either.
        if self.last_mc_block is not None and self.last_mc_block.seqno >= mc_block.seqno:
            return False
        moved: dict[ShardIdent, CommitPointer] = {}
        record: dict[ShardIdent, dict[ShardIdent, QueueKey]] = {}
        for top in top_blocks:
            shard = top.block_id.shard
            stored = self.diffs.get((shard, top.block_id.seqno))
            if stored is None:  # skipped before the repeated-shard check (§5.5)
                if top.updated and top.ref_by_mc_seqno > self.zerostate_seqno:
                    raise CommitError(f"diff of {top.block_id} not found")
                if shard in self.commit_record and shard not in moved:
                    record[shard] = self.commit_record[shard]
                continue
            if shard in moved:
                raise CommitError(f"{shard} listed twice with a stored diff each")
            new = CommitPointer(stored.info.max_message, stored.info.seqno)
            old = self.pointers.get(shard)
            if old is not None and (new.key < old.key or new.seqno < old.seqno):
                raise CommitError(f"pointer of {shard} would move backwards")
            moved[shard] = new
            record[shard] = dict(stored.info.processed_to)
        self.pointers.update(moved)
        self.last_mc_block = mc_block
        self.commit_record = record
        bounds = self.gc_bounds()
        for partition in set(partitions):
            for source, key in bounds.items():
                self.gc_requested[(partition, source)] = key
        return True

    def gc_bounds(self) -> dict[ShardIdent, QueueKey]:
        """D7: per source shard, the minimum processed_to over the commit record."""
        bounds: dict[ShardIdent, QueueKey] = {}
        for processed_to in self.commit_record.values():
            for source, key in processed_to.items():
                if source not in bounds or key < bounds[source]:
                    bounds[source] = key
        return bounds

    # -- garbage collection (SEMANTICS §7, §8 with D4, D5, D7, D8) ------------------------------

    def gc_due(self) -> dict[tuple[int, ShardIdent], QueueKey]:
        """Every (partition, shard) whose requested bound is strictly above the executed
        one, or has none: a bound that moved back is kept but not run (§7.4)."""
        return {
            entry: bound
            for entry, bound in self.gc_requested.items()
            if entry not in self.gc_executed or bound > self.gc_executed[entry]
        }

    def run_gc(self) -> int:
        """One GC pass; returns how many (partition, shard) deletions ran."""
        due = self.gc_due()
        for (partition, shard), bound in due.items():
            self.messages = {
                k: m
                for k, m in self.messages.items()
                if not (k[0] == partition and k[1] == shard and k[2] <= bound)
            }
            self.stats = {
                k: n
                for k, n in self.stats.items()
                if not (k[0] == shard and k[1] == partition and k[2] <= bound)
            }
            self.diffs = {
                k: d
                for k, d in self.diffs.items()
                if not (k[0] == shard and d.info.max_message <= bound)
            }
        self.gc_executed.update(due)
        return len(due)

    # -- clear and startup (SEMANTICS §5.6, §14.2) ---------------------------------------------

    def clear(self, partitions: Iterable[int], top_shards: Iterable[ShardIdent]) -> None:
        requested = set(partitions)
        for shard in set(self.pointers) | set(top_shards):
            pointer = self.pointers.get(shard)

            def above(key: QueueKey, pointer: CommitPointer | None = pointer) -> bool:
                return pointer is None or key > pointer.key

            doomed = [
                k for k, d in self.diffs.items() if k[0] == shard and above(d.info.max_message)
            ]
            parts = set(requested)
            for k in doomed:
                parts |= self.diffs.pop(k).partitions
            self.messages = {
                k: m
                for k, m in self.messages.items()
                if not (k[1] == shard and k[0] in parts and above(k[2]))
            }
            self.stats = {
                k: n
                for k, n in self.stats.items()
                if not (k[0] == shard and k[1] in parts and above(k[2]))
            }

    def startup(
        self,
        last_applied_mc_block: BlockId,
        top_shards: Iterable[ShardIdent],
        partitions: Iterable[int],
    ) -> None:
        check_masterchain_block(last_applied_mc_block)
        committed = self.last_mc_block
        if committed is not None and not (
            committed == last_applied_mc_block or committed.seqno < last_applied_mc_block.seqno
        ):
            raise StartupError(f"committed {committed} is ahead of {last_applied_mc_block}")
        tops = list(top_shards)
        if ShardIdent.MASTERCHAIN not in tops:  # the masterchain is a top shard (§14.2)
            tops.insert(0, ShardIdent.MASTERCHAIN)
        self.clear(partitions, tops)

    # -- queries -------------------------------------------------------------------------------

    def iterator(
        self, partition: int, ranges: Sequence[QueueShardRange], for_shard: ShardIdent
    ) -> ModelIterator:
        return ModelIterator(dict(self.messages), partition, ranges, for_shard)

    def get_diff_info(
        self, shard: ShardIdent, seqno: int, zone: DiffZone = DiffZone.BOTH
    ) -> DiffInfo | None:
        stored = self.diffs.get((shard, seqno))
        if stored is None or not _in_zone(stored.info, self.pointers.get(shard), zone):
            return None
        return stored.info

    def is_diff_exists(self, block: BlockIdShort) -> bool:
        return (block.shard, block.seqno) in self.diffs

    def get_diffs_tail_len(self, shard: ShardIdent, from_key: QueueKey) -> int:
        """Stored diffs of ``shard`` with ``max_message >= from_key``, MAX included."""
        return sum(
            1 for (s, _), d in self.diffs.items() if s == shard and d.info.max_message >= from_key
        )

    def _stat_rows(
        self, partition: int, r: QueueShardRange
    ) -> Iterator[tuple[QueueKey, Address, int]]:
        for (shard, p, max_message, _seqno, dst), count in self.stats.items():
            if shard == r.shard and p == partition and r.from_key <= max_message < r.to_key:
                yield max_message, dst, count

    def load_diff_statistics(self, partition: int, r: QueueShardRange) -> dict[Address, int]:
        totals: dict[Address, int] = {}
        for _max, dst, count in self._stat_rows(partition, r):
            totals[dst] = totals.get(dst, 0) + count
        return totals

    def load_separated_diff_statistics(
        self, partitions: Iterable[int], r: QueueShardRange
    ) -> dict[int, dict[QueueKey, dict[Address, int]]]:
        result: dict[int, dict[QueueKey, dict[Address, int]]] = {}
        for partition in set(partitions):
            grouped: dict[QueueKey, dict[Address, int]] = {}
            for max_message, dst, count in self._stat_rows(partition, r):
                bucket = grouped.setdefault(max_message, {})
                bucket[dst] = bucket.get(dst, 0) + count
            result[partition] = grouped
        return result

    def get_last_applied_seqno(self, shard: ShardIdent) -> int | None:
        return max((seqno for s, seqno in self.diffs if s == shard), default=None)

    def get_commit_pointers(self) -> dict[ShardIdent, CommitPointer]:
        return dict(self.pointers)

    def get_last_committed_mc_block_id(self) -> BlockId | None:
        return self.last_mc_block

    def seqnos(self, shard: ShardIdent) -> list[int]:
        return sorted(seqno for s, seqno in self.diffs if s == shard)
