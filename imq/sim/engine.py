"""The simulated network: collators writing, committing, reading, resetting and collecting
diffs on one imq queue, and the ledger that verifies exactly-once delivery.

Only the public API of ``imq`` is used (plus ``imq.state.tl`` for the real diff hash).
Every random choice comes from :func:`imq.sim.world.derive_rng` keyed by the seed, the
round and the shard, so one seed gives one run (except ``duration``, which stops on the
clock, and the background GC's timing, which changes what is stored but not what a
collator reads: it reads only above its own ``processed_to``).
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import itertools
import math
import os
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any, Protocol

from imq import (
    BlockId,
    BlockIdShort,
    CommitPointer,
    DiffInfo,
    DiffStatistics,
    DiffZone,
    ImqError,
    IteratedMessage,
    Message,
    PartitionRouter,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    TopBlock,
)
from imq.sim.world import ZERO_HASH, World, busiest_router, derive_rng, diff_hash_of, message_key
from imq.storage.rocks import DATABASE_FILE, LOCK_FILE, wipe_database

__all__ = [
    "MAX_NODES",
    "MessageId",
    "Opener",
    "PendingLike",
    "SimConfig",
    "SimQueue",
    "SimResult",
    "Simulation",
    "SimulationError",
    "Violation",
    "default_opener",
    "frozen_startup_heap",
    "percentiles",
]


@contextlib.contextmanager
def frozen_startup_heap() -> Iterator[None]:
    """While the block runs, leave the objects that exist when it starts out of Python's
    full cyclic-GC passes (``gc.freeze``; ``gc.unfreeze`` after): the modules, classes and
    functions the imports made, about 28,000 objects here, which every full pass would
    walk again (about 5 ms each, inside whichever call's allocation triggered it). A
    long-running Python host does this once after start-up; ``imq simulate`` is the host
    of its network, so it does it for its run. A library never does: the process is not
    its own. ``benchmarks/bench_sim.py`` measures the run both ways."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


MC = ShardIdent.MASTERCHAIN
PARTITIONS = (0, 1)
# Message body sizes, drawn evenly: empty bodies too (a mutant that dropped them went
# unseen while every body was 8 bytes), and a few large ones.
_BODY_SIZES = (0, 8, 8, 8, 8, 8, 8, 64, 64, 512)


def _body(rng: Any) -> bytes:
    return bytes(rng.randbytes(rng.choice(_BODY_SIZES)))


_message_key = attrgetter("message.key")  # the collator's merge order of its two partitions
MessageId = tuple[ShardIdent, QueueKey]  # (source shard, key): unique in the network
START_LT = 1_000
# How often a commit lists a shard's second-newest block as its top, leaving the newest
# uncommitted above the new pointer (a real network's masterchain lags its shards): a
# commit then moves a pointer past uncommitted diffs, and clears and GC run beside them.
LAG_RATE = 0.25


class SimulationError(ImqError):
    """The simulation could not go on: an operation returned what no correct queue returns."""


class PendingLike(Protocol):
    """A prepared diff: :class:`imq.PendingDiff` or a stand-in for one."""

    def write(self) -> None: ...

    def discard(self) -> None: ...


class SimQueue(Protocol):
    """What the simulation calls on a queue: a :class:`imq.Queue` or a wrapper of one."""

    def prepare_diff(
        self,
        diff: QueueDiff,
        block: BlockIdShort,
        diff_hash: bytes,
        statistics: DiffStatistics | None = None,
        check_sequence: DiffZone | None = None,
    ) -> PendingLike | None: ...

    def commit_diff(
        self, top_blocks: Sequence[TopBlock], partitions: Sequence[int] = PARTITIONS
    ) -> bool: ...

    def clear_uncommitted_state(
        self, partitions: Sequence[int] = PARTITIONS, top_shards: Sequence[ShardIdent] = ()
    ) -> None: ...

    def startup(
        self,
        last_applied_mc_block: BlockId,
        top_shards: Sequence[ShardIdent],
        partitions: Sequence[int] = PARTITIONS,
    ) -> None: ...

    def iterator(
        self, partition: int, ranges: Sequence[QueueShardRange], for_shard: ShardIdent
    ) -> Any: ...

    def get_commit_pointers(self) -> dict[ShardIdent, CommitPointer]: ...

    def load_diff_statistics(self, partition: int, range: QueueShardRange) -> dict[Any, int]: ...

    def run_gc(self) -> int: ...

    def close(self) -> None: ...

    def apply_diff(
        self,
        diff: QueueDiff,
        block: BlockIdShort,
        diff_hash: bytes,
        statistics: DiffStatistics | None = None,
        check_sequence: DiffZone | None = None,
    ) -> bool: ...

    def get_diffs_tail_len(self, shard: ShardIdent, from_key: QueueKey) -> int: ...

    def get_diff_info(
        self, shard: ShardIdent, seqno: int, zone: DiffZone = DiffZone.BOTH
    ) -> DiffInfo | None: ...

    def get_last_committed_mc_block_id(self) -> BlockId | None: ...

    def export_state(self, shard: ShardIdent, seqno: int, tail_len: int, dest: Any) -> Any: ...


Opener = Callable[[Path, QueueConfig], SimQueue]


def default_opener(path: Path, config: QueueConfig) -> SimQueue:
    return Queue.open(path, config)


# Each node is a process with a queue of its own (block cache, write buffers, cache of
# fresh rows) that every round waits on: beyond 16 a run measures the machine, not imq.
MAX_NODES = 16


@dataclass(frozen=True)
class SimConfig:
    """One simulation run. ``rounds`` or ``duration`` (seconds) bounds the main phase."""

    directory: Path = Path("var") / "sim"
    shards: int = 4
    rounds: int | None = 200
    duration: float | None = None
    seed: int = 1
    fanout: int = 2
    fresh: bool = False
    commit_every: int = 4
    read_limit: int = 96
    inject: int = 6  # new (external) messages per basechain block
    mc_share: float = 0.05  # share of new messages addressed to the masterchain
    cancel_rate: float = 0.05  # share of collations discarded after prepare
    restart_rate: float = 0.02  # share of rounds ending in a node restart
    reset_rate: float = 0.01  # share of rounds ending in a clear of the uncommitted zone
    gc_every: int = 0  # 0: background GC on its interval; n: an explicit run_gc every n rounds
    gc_interval: float = 0.25
    nodes: int = 1  # node processes: one collates each shard, the others apply its diffs
    max_drain_rounds: int = 5_000
    # Compare the queue's answers about its own state (pointers, stored diffs, statistics,
    # what GC leaves) with what the run wrote; off only to time the network's work alone.
    check_state: bool = True

    def __post_init__(self) -> None:
        if self.rounds is None and self.duration is None:
            raise ValueError("give rounds or duration")
        if self.rounds is not None and self.rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {self.rounds}")
        if self.duration is not None and not 0 < self.duration < math.inf:
            raise ValueError(f"duration must be a positive number of seconds, got {self.duration}")
        if self.fanout < 0:
            raise ValueError(f"fanout must be >= 0, got {self.fanout}")
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes must be in 1..{MAX_NODES}, got {self.nodes}")
        if self.gc_every < 0:
            raise ValueError(
                f"gc_every must be >= 0 (0: the background worker collects), got {self.gc_every}"
            )
        if self.commit_every < 1:
            raise ValueError(f"commit_every must be at least 1, got {self.commit_every}")
        if self.read_limit < 1:
            raise ValueError(f"read_limit must be at least 1, got {self.read_limit}")

    def queue_config(self) -> QueueConfig:
        return QueueConfig(
            gc_enabled=self.gc_every == 0,
            gc_interval=self.gc_interval,
            sync_commits=False,
            check_sources=True,  # every block's messages come from its own accounts
            block_cache_size=32 << 20,
            write_buffer_size=16 << 20,
        )


@dataclass(frozen=True)
class ShardState:
    """A collator's state after its last block."""

    seqno: int = 0
    lt: int = START_LT
    top_hash: bytes = ZERO_HASH
    top_max: QueueKey | None = None
    processed_to: tuple[tuple[ShardIdent, QueueKey], ...] = ()


@dataclass
class BlockRecord:
    shard: ShardIdent
    seqno: int
    created: list[Message]
    executed: list[IteratedMessage]
    state: ShardState
    router: PartitionRouter = field(default_factory=PartitionRouter)
    executed_low: frozenset[MessageId] = frozenset()  # read from the low-priority partition


@dataclass(frozen=True)
class Violation:
    message: MessageId
    kind: str  # "lost" | "duplicated" | "misdelivered" | "misrouted" | "phantom" | "stored"
    detail: str

    def __str__(self) -> str:
        src, key = self.message
        return f"message {key.lt}:{key.hash.hex()} from {src} {self.kind}: {self.detail}"


@dataclass
class Sample:
    """One point of the report's time series (after a round)."""

    round: int
    seconds: float
    committed_depth: dict[str, int]  # destination shard -> committed, not yet executed
    uncommitted: dict[str, int]  # source shard -> messages in uncommitted diffs
    gc_collected: int


@dataclass
class SimResult:
    config: SimConfig
    rounds: int = 0
    drain_rounds: int = 0
    blocks: int = 0
    blocks_committed: int = 0
    commits: int = 0
    messages_created: int = 0
    messages_delivered: int = 0
    restarts: int = 0
    kills: int = 0
    clears: int = 0  # clear_uncommitted_state calls (a cancelled collation's reset)
    rolled_back_blocks: int = 0
    cancelled: int = 0
    gc_passes: int = 0
    gc_deletions: int = 0
    gc_collected: int = 0
    seconds: float = 0.0
    lost: int = 0
    duplicated: int = 0
    violations: list[Violation] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)  # between nodes (--nodes)
    # What the queue answered about its own state (pointers, diffs, statistics, tails)
    # against what the run wrote: each check made, and each one that failed.
    state_checks: int = 0
    state_errors: list[str] = field(default_factory=list)
    check_seconds: float = 0.0  # wall time of the state checks (inside the run's)
    agreed_exports: int = 0
    agreed_contents_messages: int = 0  # stored messages every node read back alike
    # Per operation, each call's seconds: arrays of doubles, not lists of floats, which the
    # host's cyclic GC would walk (every float) at each full collection of a long run.
    latencies: dict[str, array[float]] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)

    @property
    def resets(self) -> int:
        """Resets of the uncommitted zone: the clears, and the startup of every restart."""
        return self.clears + self.restarts

    @property
    def verified(self) -> bool:
        return not self.violations and not self.disagreements and not self.state_errors

    def stopped_verdict(self, error: BaseException) -> str:
        """The verdict line of a run that stopped on ``error`` (the caller shows it): not
        verified, with what the checks had found until then."""
        line = (
            f"exactly-once: NOT VERIFIED, the run stopped on {type(error).__name__} after "
            f"{self.messages_delivered:,} messages delivered"
        )
        if self.violations:
            line += f"; {len(self.violations):,} violations before it, first: {self.violations[0]}"
        if self.state_errors:
            line += (
                f"; {len(self.state_errors):,} failed state checks before it, first: "
                f"{self.state_errors[0]}"
            )
        return line

    @property
    def queue_seconds(self) -> float:
        """Wall time spent inside queue calls (every timed operation)."""
        return sum(sum(samples) for samples in self.latencies.values())

    @property
    def messages_per_second(self) -> float:
        return self.messages_delivered / self.seconds if self.seconds > 0 else 0.0

    def verdict(self) -> str:
        head = "verified" if self.verified else "VIOLATED"
        kinds = Counter(v.kind for v in self.violations)
        counts = [f"{self.lost:,} lost", f"{self.duplicated:,} duplicated"]
        counts += [f"{n:,} {kind}" for kind, n in sorted(kinds.items()) if kind not in _HEADLINE]
        if self.state_errors:
            counts.append(f"{len(self.state_errors):,} failed state checks")
        line = f"exactly-once: {head}, {self.messages_delivered:,} messages, " + ", ".join(counts)
        if self.violations:
            line += f"; first: {self.violations[0]}"
        elif self.state_errors:
            line += f"; first failed state check: {self.state_errors[0]}"
        elif self.disagreements:
            line += f"; nodes disagree: {self.disagreements[0]}"
        return line


_HEADLINE = ("lost", "duplicated")


def _statistics_of(blocks: Sequence[BlockRecord]) -> dict[int, Counter[Any]]:
    """Per partition, the destinations of the blocks' messages, as each block's router
    sent them: what ``load_diff_statistics`` over those diffs must count."""
    expected: dict[int, Counter[Any]] = {p: Counter() for p in PARTITIONS}
    for block in blocks:
        for m in block.created:
            expected[block.router.partition_for(m.src, m.dst)][m.dst] += 1
    return expected


def _percentile(samples: Sequence[float], percent: float) -> float:
    ordered = sorted(samples)
    if not ordered:
        return 0.0
    index = min(len(ordered) - 1, max(0, round(percent / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def percentiles(samples: Sequence[float]) -> tuple[float, float]:
    """(p50, p99) of ``samples`` in seconds, nearest rank."""
    return _percentile(samples, 50), _percentile(samples, 99)


class Simulation:
    """One node with a collator per shard on one queue.

    ``opener`` opens the queue (a recording wrapper in ``--record``); ``on_round`` is
    called after every round with the result so far (the CLI draws its progress bar).
    ``kill`` is called instead of a clean close for a restart the run chooses to be a
    crash; it must return a freshly opened queue.
    """

    def __init__(
        self,
        config: SimConfig,
        *,
        opener: Opener = default_opener,
        on_round: Callable[[SimResult, bool], None] | None = None,
        crash: Callable[[SimQueue], None] | None = None,
    ) -> None:
        self.config = config
        self.world = World.build(config.seed, config.shards)
        self.opener = opener
        self.on_round = on_round
        self.crash = crash
        self.result = SimResult(config)
        self.queue: SimQueue | None = None  # node 0
        self.followers: list[SimQueue] = []  # nodes 1..M-1
        # Every collator names every source shard in processed_to from its first block on:
        # a shard it leaves out does not hold GC back, so GC could take its unread messages.
        start = tuple(sorted((s, QueueKey.MIN) for s in self.world.shards))
        self.current = {s: ShardState(processed_to=start) for s in self.world.shards}
        self.committed: dict[ShardIdent, ShardState] = dict(self.current)
        self.uncommitted: dict[ShardIdent, list[BlockRecord]] = {s: [] for s in self.world.shards}
        self.last_mc: BlockId | None = None
        self.owed: dict[MessageId, Message] = {}  # committed, not yet executed
        # The owed messages whose block's router sent them to another partition than 0.
        self.owed_partition: dict[MessageId, int] = {}
        # Per shard, the max_message and seqno of each committed diff with messages: the
        # final GC keeps those above its bound and deletes the others, records included.
        self.committed_tops: dict[ShardIdent, list[tuple[QueueKey, int]]] = {
            s: [] for s in self.world.shards
        }
        # Hashes of messages executed by committed blocks: a dict of bytes to None, not a
        # set, because CPython's cyclic GC stops walking a dict that holds only such
        # values (a set it walks entry by entry at every full collection: a long run's
        # 240,000 hashes cost the host about 15 ms a collection).
        self.delivered: dict[bytes, None] = {}
        self.committed_depth: dict[ShardIdent, int] = {s: 0 for s in self.world.shards}
        self._gc_base = 0
        self._gc_deletions_base = 0
        self._gc_passes_base = 0
        self._started = 0.0
        self._accounts = {s: self.world.accounts(s) for s in self.world.shards}

    # -- queue calls, timed ------------------------------------------------------------------

    def _q(self) -> SimQueue:
        if self.queue is None:
            raise SimulationError("the queue is not open")
        return self.queue

    def _timed(self, op: str, started: float) -> None:
        seconds = time.perf_counter() - started
        samples = self.result.latencies.get(op)
        if samples is None:
            samples = self.result.latencies[op] = array("d")
        samples.append(seconds)

    def _nodes(self) -> list[SimQueue]:
        return [self._q(), *self.followers]

    def _node(self, shard: ShardIdent) -> SimQueue:
        """The node that collates ``shard``."""
        return self._nodes()[self.world.shards.index(shard) % self.config.nodes]

    def _open(self) -> None:
        last = self.last_mc if self.last_mc is not None else BlockId(MC, 0)
        opened: list[SimQueue] = []
        for node, path in enumerate(self.db_paths):
            started = time.perf_counter()
            queue = self.opener(path, self.config.queue_config())
            self._timed("open", started)
            if self.config.check_state:
                with self._checking():
                    self._check_reopened(queue, node)
            started = time.perf_counter()
            queue.startup(last, list(self.world.shards))
            self._timed("startup", started)
            if self.config.check_state:
                with self._checking():
                    self._check_started(queue, node)
            opened.append(queue)
        self.queue, self.followers = opened[0], opened[1:]
        self._roll_back()

    # -- the queue's own state against the run's record ------------------------------------

    def _check_reopened(self, queue: SimQueue, node: int) -> None:
        """What a node's queue holds as it opens, before startup resets its uncommitted
        zone: the last committed block, the commit pointers, and every diff written since
        the last commit, as the run wrote them. A restart loses nothing written, a kill
        neither: each write reached RocksDB's log before it returned."""
        where = f"node {node}, reopened"
        last = queue.get_last_committed_mc_block_id()
        if not self._check(last == self.last_mc):
            self._state_error(
                f"{where}: last committed block {last}, the run committed {self.last_mc}"
            )
        self._check_pointers(queue.get_commit_pointers(), where)
        for shard, blocks in self.uncommitted.items():
            for block in blocks:
                info = queue.get_diff_info(shard, block.seqno, DiffZone.UNCOMMITTED)
                self._check_diff(info, block, f"{where}: uncommitted diff of {shard}:{block.seqno}")

    def _check_started(self, queue: SimQueue, node: int) -> None:
        """After startup no diff written since the last commit is stored."""
        for shard, blocks in self.uncommitted.items():
            for block in blocks:
                info = queue.get_diff_info(shard, block.seqno, DiffZone.BOTH)
                if not self._check(info is None):
                    self._state_error(
                        f"node {node}: startup kept the uncommitted diff of "
                        f"{block.shard}:{block.seqno}"
                    )

    def _check_pointers(self, pointers: dict[ShardIdent, CommitPointer], where: str) -> None:
        """Each committed shard's pointer names its last committed diff's max message."""
        expected = {
            shard: CommitPointer(state.top_max, state.seqno)
            for shard, state in self.committed.items()
            if state.top_max is not None
        }
        if not self._check(pointers == expected):
            self._state_error(
                f"{where}: commit pointers "
                + "; ".join(
                    f"{s}: {pointers.get(s)}, the run committed {expected.get(s)}"
                    for s in sorted({*pointers, *expected})
                    if pointers.get(s) != expected.get(s)
                )
            )

    def _check_diff(self, info: DiffInfo | None, block: BlockRecord, what: str) -> None:
        """The stored diff is the one the run wrote: its seqno, hash, last message and
        processed_to."""
        state = block.state
        if info is None:
            self._check(False)
            self._state_error(f"{what} is not stored")
        elif not self._check(
            info.seqno == block.seqno
            and info.hash == state.top_hash
            and info.max_message == state.top_max
            and info.processed_to == dict(state.processed_to)
        ):
            self._state_error(
                f"{what} is stored as seqno {info.seqno}, max message {info.max_message}, "
                f"processed_to {info.processed_to}; the run wrote seqno {block.seqno}, max "
                f"message {state.top_max}, processed_to {dict(state.processed_to)}"
                + ("" if info.hash == state.top_hash else ", and another hash")
            )

    def _check_committed(
        self, shard: ShardIdent, blocks: list[BlockRecord], *, above: int = 0
    ) -> None:
        """Right after a commit on ``blocks`` of ``shard``, on every node: its new top diff
        is stored as written, the tail lengths from the committed diffs' max messages
        count them (and the ``above`` uncommitted diffs the commit left above them: a
        tail counts both zones), and the statistics of the committed diffs count, per
        partition, the destinations of their messages as each block's router sent them.
        (GC cannot have touched them yet: no other shard has read them.)"""
        top = blocks[-1]
        before, last = self.committed[shard].top_max, top.state.top_max
        if last is None:  # pragma: no cover - a written block always has its max message
            raise SimulationError(f"no max message for the block {shard}:{top.seqno}")
        committed = QueueShardRange(
            shard, QueueKey.MIN if before is None else before.next_value(), last.next_value()
        )
        expected = _statistics_of(blocks)
        # The tail from a diff's own max message counts that diff (">=", not ">"): from
        # the new top's, just it; from the first committed now, all of them.
        starts = ((last, 1 + above), (blocks[0].state.top_max, len(blocks) + above))
        for node in self._nodes():
            info = node.get_diff_info(shard, top.seqno, DiffZone.COMMITTED)
            if info is None and node.get_diff_info(shard, top.seqno, DiffZone.UNCOMMITTED):
                self._check(False)
                self._state_error(
                    f"the diff of {shard}:{top.seqno} is still uncommitted after the commit "
                    f"on masterchain block {self.current[MC].seqno}"
                )
            else:
                self._check_diff(info, top, f"committed diff of {shard}:{top.seqno}")
            self._check_tails_and_statistics(
                node,
                shard,
                starts,
                f"right after the commit of diffs {blocks[0].seqno}..{top.seqno}",
                (committed, expected, f"diffs {blocks[0].seqno}..{top.seqno}"),
            )

    def _check_tails_and_statistics(
        self,
        node: SimQueue,
        shard: ShardIdent,
        starts: Sequence[tuple[QueueKey | None, int]],
        when: str,
        statistics: tuple[QueueShardRange, dict[int, Counter[Any]], str],
    ) -> None:
        """``get_diffs_tail_len`` from each start key counts its number of diffs, and
        ``load_diff_statistics`` over the range counts, per partition, the expected
        destinations (``statistics``: the range, those counts, the diffs named)."""
        for key, want in starts:
            tail = None if key is None else node.get_diffs_tail_len(shard, key)
            if not self._check(tail == want):
                self._state_error(
                    f"get_diffs_tail_len({shard}, {key}) {when}: {tail}, the run stored "
                    f"{want} diffs from there on"
                )
        span, expected, named = statistics
        for partition in PARTITIONS:
            stats = node.load_diff_statistics(partition, span)
            if not self._check(stats == expected[partition]):
                self._state_error(
                    f"statistics of {shard}'s {named}, partition {partition}: "
                    f"{sum(stats.values())} messages to {len(stats)} accounts; the diffs "
                    f"hold {sum(expected[partition].values())} to {len(expected[partition])}"
                )

    def _check_written(self, shard: ShardIdent, blocks: list[BlockRecord]) -> None:
        """Right after a block's diff is written, on every node, while it is uncommitted
        (``blocks``: the shard's uncommitted blocks, oldest first, the new one last): the
        diff is stored uncommitted as written; ``get_diffs_tail_len`` from a key inside
        the new diff (its first message's), and from inside the first uncommitted one,
        counts those uncommitted diffs (the tail counts both zones); and
        ``load_diff_statistics`` over the uncommitted diffs counts the destinations of
        their messages per partition. (GC's bounds come from committed diffs'
        ``processed_to`` only, which never pass a commit pointer: it cannot have touched
        them.)"""
        top = blocks[-1]
        last = top.state.top_max
        if last is None:  # pragma: no cover - a written block always has its max message
            raise SimulationError(f"no max message for the block {shard}:{top.seqno}")
        before = self.committed[shard].top_max
        pending = QueueShardRange(
            shard, QueueKey.MIN if before is None else before.next_value(), last.next_value()
        )
        expected = _statistics_of(blocks)
        # A key inside a diff: its first message's (its max message when it has none).
        first = blocks[0]
        starts = (
            (top.created[0].key if top.created else last, 1),
            (first.created[0].key if first.created else first.state.top_max, len(blocks)),
        )
        for node in self._nodes():
            info = node.get_diff_info(shard, top.seqno, DiffZone.UNCOMMITTED)
            self._check_diff(info, top, f"uncommitted diff of {shard}:{top.seqno}")
            self._check_tails_and_statistics(
                node,
                shard,
                starts,
                f"right after the write of the uncommitted diff {shard}:{top.seqno}",
                (pending, expected, f"uncommitted diffs {first.seqno}..{top.seqno}"),
            )

    def _gc_counters(self) -> tuple[int, int, int]:
        metrics = getattr(self.queue, "metrics", None)
        worker = getattr(self.queue, "gc_worker", None)
        passes = worker.passes if worker is not None else 0
        if metrics is None:
            return 0, 0, passes
        return metrics.counter("messages_deleted"), metrics.counter("gc_ranges_deleted"), passes

    def _close(self, *, crash: bool = False) -> None:
        if self.queue is None:
            return
        # An in-process queue is read after closing, so a GC pass that finishes while
        # close() waits for it counts; a child process's queue must be read before.
        in_process = isinstance(self.queue, Queue)
        counters = None if in_process else self._gc_counters()
        for queue in [self.queue, *self.followers]:
            started = time.perf_counter()
            if crash and self.crash is not None:
                self.crash(queue)
            else:
                queue.close()
            self._timed("close", started)
        collected, deletions, passes = counters or self._gc_counters()
        self._gc_base += collected
        self._gc_deletions_base += deletions
        self._gc_passes_base += passes
        self.queue = None
        self.followers = []

    def _update_gc_totals(self) -> None:
        collected, deletions, passes = self._gc_counters()
        self.result.gc_collected = self._gc_base + collected
        self.result.gc_deletions = self._gc_deletions_base + deletions
        self.result.gc_passes = self._gc_passes_base + passes + self._explicit_gc

    _explicit_gc = 0

    # -- the run -----------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        """Whether the run got past its directory checks (a failure after it stops a run)."""
        return self._started > 0.0

    @property
    def db_paths(self) -> list[Path]:
        """``queue`` for node 0, ``queue-node<i>`` for the others."""
        d = self.config.directory
        return [d / "queue" if i == 0 else d / f"queue-node{i}" for i in range(self.config.nodes)]

    @property
    def db_path(self) -> Path:
        return self.db_paths[0]

    def run(self) -> SimResult:
        directory = self.config.directory
        for path in self.db_paths:
            if self.config.fresh:  # only a queue database, and never a live one
                wipe_database(path)
        directory.mkdir(parents=True, exist_ok=True)
        for path in self.db_paths:
            if path.is_dir() and any(
                name != LOCK_FILE and DATABASE_FILE.fullmatch(name) for name in os.listdir(path)
            ):
                raise SimulationError(
                    f"{path} holds the queue of a previous run (or what a cut-short "
                    "deletion left of one); use --fresh to start over"
                )
        self._started = time.perf_counter()
        try:
            self._open()
            self._main_phase()
            if self.followers:  # while the tails still hold messages, uncommitted ones too
                self._agree_contents("before the drain")
            self._drain()
            self._final_check()
            if self.followers:
                self._agree_contents("after the final GC")
                self._agree("after the final GC")
        except BaseException:  # a failure or a Ctrl-C: close, and let nothing hide it
            with contextlib.suppress(Exception):
                self._wind_down()
            raise
        self._wind_down()
        self._verify()
        return self.result

    def _wind_down(self) -> None:
        try:
            self._update_gc_totals()
        finally:
            try:
                self._close()
            finally:  # the final close is a timed queue call too: inside the run's time
                self.result.seconds = time.perf_counter() - self._started

    def _main_phase(self) -> None:
        cfg = self.config
        for round_no in itertools.count(1):
            if cfg.rounds is not None and round_no > cfg.rounds:
                break
            if cfg.duration is not None and time.perf_counter() - self._started >= cfg.duration:
                break
            self._round(round_no, drain=False)
            self.result.rounds = round_no

    def _drain(self) -> None:
        """Rounds with no new messages and a commit each, until nothing is owed (then three
        more, so every processed_to passes every message and GC can take them all), or
        until ten rounds in a row deliver nothing although something is owed: what is
        still owed then is lost, and verification says so."""
        extra = idle = 0
        base = self.result.rounds
        for n in range(1, self.config.max_drain_rounds + 1):
            before = self.result.messages_delivered
            self._round(base + n, drain=True)
            self.result.drain_rounds = n
            if self._outstanding() == 0:
                # The first round that owes nothing, then three more.
                extra += 1
                if extra > 3:
                    return
            elif self.result.messages_delivered == before:
                idle += 1
                if idle >= 10:
                    return
            else:
                idle = 0
        raise SimulationError(
            f"the network did not drain in {self.config.max_drain_rounds} rounds: "
            f"{self._outstanding()} messages outstanding"
        )

    def _outstanding(self) -> int:
        pending = sum(len(b.created) for blocks in self.uncommitted.values() for b in blocks)
        return sum(self.committed_depth.values()) + pending

    def _round(self, round_no: int, *, drain: bool) -> None:
        cfg = self.config
        rng = derive_rng(cfg.seed, "round", round_no)
        started = time.perf_counter()
        pointers = self._q().get_commit_pointers()
        self._timed("get_commit_pointers", started)
        if cfg.check_state:
            with self._checking():
                self._check_pointers(pointers, f"round {round_no}")
        for i, node in enumerate(self.followers, start=1):
            if node.get_commit_pointers() != pointers:
                raise SimulationError(f"node {i} disagrees with node 0 on the commit pointers")
        fault = 1.0 if drain else rng.random()
        restart = fault < cfg.restart_rate
        for shard in self.world.basechain:
            self._collate(shard, round_no, pointers, drain=drain)
        if not restart and fault < cfg.restart_rate + cfg.reset_rate:
            # Before the masterchain block: the shards' new blocks are uncommitted, so
            # the reset always has something to clear (after a commit it had nothing).
            self._reset()
        if drain or round_no % cfg.commit_every == 0:
            self._collate(MC, round_no, pointers, drain=drain)
            self._commit(lag=not drain)
        if cfg.gc_every and round_no % cfg.gc_every == 0:
            for node in self._nodes():
                started = time.perf_counter()
                node.run_gc()
                self._timed("run_gc", started)
            self._explicit_gc += 1
        if restart:
            self._restart(round_no, crash=rng.random() < 0.5)
        self._sample(round_no)
        if self.on_round is not None:
            self.on_round(self.result, drain)

    # -- faults ------------------------------------------------------------------------------

    def _restart(self, round_no: int, *, crash: bool) -> None:
        self.result.restarts += 1
        if crash and self.crash is not None:
            self.result.kills += 1
            # Killed mid-collation: one shard has prepared its next diff, not written it.
            rng = derive_rng(self.config.seed, "crash", round_no)
            shard = self.world.basechain[rng.randrange(len(self.world.basechain))]
            pointers = self._q().get_commit_pointers()
            self._collate(shard, round_no, pointers, drain=False, crash_pending=True)
        self._close(crash=crash)
        self._open()

    def _reset(self) -> None:
        for node in self._nodes():
            started = time.perf_counter()
            node.clear_uncommitted_state(PARTITIONS, list(self.world.shards))
            self._timed("clear_uncommitted_state", started)
            if self.config.check_state:
                with self._checking():
                    self._check_cleared(node)
        self.result.clears += 1
        self._roll_back()

    def _check_cleared(self, queue: SimQueue) -> None:
        """After a reset nothing is stored above any commit pointer, in any partition
        (a cache of fresh rows that kept the cleared rows would serve them here)."""
        pointers = queue.get_commit_pointers()
        ranges = [
            QueueShardRange(
                s, pointers[s].key.next_value() if s in pointers else QueueKey.MIN, QueueKey.MAX
            )
            for s in self.world.shards
        ]
        self._none_stored(queue, ranges, "above the commit pointer after a reset")

    def _none_stored(self, queue: SimQueue, ranges: list[QueueShardRange], when: str) -> None:
        """No message in ``ranges``, in any partition, for any destination: the first
        found is a ``stored`` violation per partition."""
        for partition in PARTITIONS:
            for for_shard in (MC, ShardIdent.BASECHAIN):
                with queue.iterator(partition, ranges, for_shard) as it:
                    for item in it:
                        self._violate(
                            (item.source, item.message.key),
                            "stored",
                            f"still in partition {partition} {when}",
                        )
                        break

    def _roll_back(self) -> None:
        for shard, blocks in self.uncommitted.items():
            self.result.rolled_back_blocks += len(blocks)
            blocks.clear()
            self.current[shard] = self.committed[shard]

    # -- collation ---------------------------------------------------------------------------

    def _ranges(
        self, shard: ShardIdent, pointers: dict[ShardIdent, CommitPointer]
    ) -> tuple[list[QueueShardRange], dict[ShardIdent, QueueKey]]:
        """The ranges a collator may read (committed diffs of every shard, its own
        uncommitted ones) from just past its processed_to, and each source's horizon."""
        state = self.current[shard]
        processed = dict(state.processed_to)
        ranges: list[QueueShardRange] = []
        horizons: dict[ShardIdent, QueueKey] = {}
        for source in self.world.shards:
            if source == shard:
                horizon = state.top_max
            else:
                pointer = pointers.get(source)
                horizon = pointer.key if pointer is not None else None
            if horizon is None:
                continue
            horizons[source] = horizon
            start = processed.get(source)
            from_key = start.next_value() if start is not None else QueueKey.MIN
            to_key = horizon.next_value()
            if from_key < to_key:
                ranges.append(QueueShardRange(source, from_key, to_key))
        return ranges, horizons

    def _read(
        self, shard: ShardIdent, ranges: list[QueueShardRange], limit: int
    ) -> tuple[list[IteratedMessage], frozenset[MessageId]]:
        """The first ``limit`` messages for ``shard`` in ``ranges``, both partitions
        merged by key. Each partition's iterator is read up to ``limit`` on its own (a
        collator buffers its partitions separately), and only that is timed as the
        queue's ``read``; merging the two is the collator's work. (Merging the iterators
        lazily put the merge's generator step and Python key call, about 250 ns a message
        here, inside the queue's time: ``read`` took a tenth less without them,
        ``benchmarks/results/sim-analysis.md``, Stop 24.) Also returned: which of the
        messages came from the low-priority partition."""
        if not ranges:
            return [], frozenset()
        started = time.perf_counter()
        queue = self._node(shard)
        parts: list[list[IteratedMessage]] = []
        iterators: list[Any] = []
        try:
            for partition in PARTITIONS:
                it = queue.iterator(partition, ranges, shard)
                iterators.append(it)
                parts.append(list(itertools.islice(it, limit)))
            self._timed("read", started)
            if self.config.check_state:
                with self._checking():
                    for partition, it, got in zip(PARTITIONS, iterators, parts, strict=True):
                        self._check_read(shard, partition, ranges, it, got)
        finally:
            for it in iterators:
                it.close()
        normal, low = parts
        from_low = frozenset((m.source, m.message.key) for m in low)
        if not (normal and low):
            return normal or low, from_low
        return list(itertools.islice(heapq.merge(normal, low, key=_message_key), limit)), from_low

    def _check_read(
        self,
        shard: ShardIdent,
        partition: int,
        ranges: list[QueueShardRange],
        it: Any,
        got: list[IteratedMessage],
    ) -> None:
        """What a collator relies on besides the messages themselves (mutation testing
        found the run blind to it): each message lies in its source's range, the
        iterator's position has passed every message it yielded, and not the next one
        it would yield (a collator takes its processed_to from the position)."""
        bounds = {r.shard: r for r in ranges}
        last: dict[ShardIdent, QueueKey] = {}
        for m in got:
            r = bounds.get(m.source)
            key = m.message.key
            if not self._check(r is not None and r.from_key <= key < r.to_key):
                self._state_error(
                    f"read for {shard}, partition {partition}: message {key} of {m.source} "
                    f"outside its range {r}"
                )
            last[m.source] = key
        position = it.current_position()
        for source, key in last.items():
            at = position.get(source)
            if not self._check(at is not None and at >= key):
                self._state_error(
                    f"read for {shard}, partition {partition}: position of {source} is "
                    f"{at}, behind its last message read, {key}"
                )
        following = next(it, None)
        if following is not None:
            at = position.get(following.source)
            if not self._check(at is None or at < following.message.key):
                self._state_error(
                    f"read for {shard}, partition {partition}: position of "
                    f"{following.source} is {at}, past the message {following.message.key} "
                    "not read yet"
                )
        # A range's end is excluded: read again up to the source's last message read, that
        # message is not among them. (A source the read did not ask for has no range to
        # read again: the range check above named it.)
        asked = ((source, key) for source, key in last.items() if source in bounds)
        for source, key in itertools.islice(asked, 1):
            again = self._node(shard).iterator(
                partition, [QueueShardRange(source, bounds[source].from_key, key)], shard
            )
            try:
                keys = [m.message.key for m in itertools.islice(again, len(got) + 1)]
            finally:
                again.close()
            if not self._check(key not in keys):
                self._state_error(
                    f"read for {shard}, partition {partition}: the range of {source} ending at "
                    f"{key} yielded the message at {key}"
                )

    def _collate(
        self,
        shard: ShardIdent,
        round_no: int,
        pointers: dict[ShardIdent, CommitPointer],
        *,
        drain: bool,
        crash_pending: bool = False,
    ) -> None:
        """Collate one block of ``shard``; with ``crash_pending``, stop after the prepare
        and leave the diff pending (the process is about to be killed)."""
        cfg = self.config
        rng = derive_rng(cfg.seed, "collate", round_no, shard, crash_pending)
        state = self.current[shard]
        ranges, horizons = self._ranges(shard, pointers)
        limit = cfg.read_limit
        taken, from_low = self._read(shard, ranges, limit)
        processed = dict(state.processed_to)
        cut = taken[-1].message.key if len(taken) >= limit else None
        for source, horizon in horizons.items():
            new = horizon if cut is None else min(cut, horizon)
            old = processed.get(source)
            if old is None or new > old:
                processed[source] = new
        start_lt = max([state.lt, *(m.message.key.lt for m in taken)]) + 1
        created = [] if drain else self._execute(shard, taken, start_lt, rng)
        end_lt = created[-1].key.lt if created else start_lt
        dsts: dict[Any, int] = {}
        for m in created:
            dsts[m.dst] = dsts.get(m.dst, 0) + 1
        router = busiest_router(dsts, threshold=3, top=2)
        seqno = state.seqno + 1
        # The block's real lt span: an empty block stores min_for_lt(start)..max_for_lt(end).
        diff = QueueDiff(
            created, processed, router, state.top_hash, start_lt=start_lt, end_lt=end_lt
        )
        bounds = diff.bounds
        if bounds is None:  # pragma: no cover - a diff with a span always has bounds
            raise SimulationError(f"no bounds for the diff of {shard}:{seqno}")
        high = bounds[1]
        digest = diff_hash_of(diff, shard, seqno, bounds)
        block = BlockIdShort(shard, seqno)
        started = time.perf_counter()
        pending = self._node(shard).prepare_diff(diff, block, digest, None, DiffZone.UNCOMMITTED)
        self._timed("prepare_diff", started)
        if pending is None:
            raise SimulationError(f"prepare_diff of {block} was skipped as already applied")
        if crash_pending:
            return
        if not drain and not shard.is_masterchain and rng.random() < cfg.cancel_rate:
            started = time.perf_counter()
            pending.discard()
            self._timed("discard", started)
            self.result.cancelled += 1
            return
        started = time.perf_counter()
        pending.write()
        self._timed("write", started)
        for node in self._nodes():
            if node is not self._node(shard):  # the other nodes apply the block's diff
                started = time.perf_counter()
                if not node.apply_diff(diff, block, digest, None, DiffZone.UNCOMMITTED):
                    raise SimulationError(f"a node skipped the diff of {block} as applied")
                self._timed("apply_diff", started)
        new_state = ShardState(
            seqno=seqno,
            lt=end_lt,
            top_hash=digest,
            top_max=high,
            processed_to=tuple(sorted(processed.items())),
        )
        self.current[shard] = new_state
        self._written(BlockRecord(shard, seqno, created, taken, new_state, router, from_low))

    def _written(self, block: BlockRecord) -> None:
        """A block's diff is written (uncommitted): remember it, and check what the queue
        says of it."""
        blocks = self.uncommitted[block.shard]
        blocks.append(block)
        self.result.blocks += 1
        if self.config.check_state:
            with self._checking():
                self._check_written(block.shard, blocks)

    def _execute(
        self, shard: ShardIdent, taken: list[IteratedMessage], start_lt: int, rng: Any
    ) -> list[Message]:
        """Each message read may send new ones (to its own recipient's account, so the
        source is in this shard); a basechain block also creates some of its own."""
        cfg = self.config
        p_out = min(1.0, 0.9 / cfg.fanout) if cfg.fanout else 0.0
        senders: list[Any] = []
        for incoming in taken:
            outs = sum(1 for _ in range(cfg.fanout) if rng.random() < p_out)
            senders.extend([incoming.message.dst] * outs)
        if not shard.is_masterchain:
            own = self._accounts[shard]
            senders.extend(rng.choice(own) for _ in range(cfg.inject))
        return [
            Message(message_key(shard, lt), src, self._destination(rng), _body(rng))
            for lt, src in enumerate(senders, start=start_lt)
        ]

    def _destination(self, rng: Any) -> Any:
        cfg = self.config
        if rng.random() < cfg.mc_share:
            shard = MC
        else:
            shard = self.world.basechain[rng.randrange(len(self.world.basechain))]
        accounts = self._accounts[shard]
        # Pareto ranks: account 0 is hot, so the router has something to move.
        index = min(int(rng.paretovariate(1.2)) - 1, len(accounts) - 1)
        return accounts[index]

    # -- commit ------------------------------------------------------------------------------

    def _commit(self, *, lag: bool = False) -> None:
        mc_state = self.current[MC]
        if mc_state.seqno == 0 or (
            self.last_mc is not None and self.last_mc.seqno >= mc_state.seqno
        ):
            return  # the masterchain block was cancelled: nothing new to commit on
        mc_seqno = mc_state.seqno
        rng = derive_rng(self.config.seed, "lag", mc_seqno)
        tops = [TopBlock(BlockId(MC, mc_seqno), mc_seqno)]
        # Per shard, how many of its uncommitted blocks this commit takes: all, or with
        # ``lag`` now and then all but the newest (which stays uncommitted).
        taken: dict[ShardIdent, int] = {MC: len(self.uncommitted[MC])}
        for shard in self.world.basechain:
            blocks = self.uncommitted[shard]
            taken[shard] = len(blocks)
            if lag and len(blocks) >= 2 and rng.random() < LAG_RATE:
                taken[shard] -= 1
            state = blocks[taken[shard] - 1].state if blocks else self.current[shard]
            if state.seqno == 0:
                continue
            updated = state.seqno != self.committed[shard].seqno
            tops.append(TopBlock(BlockId(shard, state.seqno), mc_seqno, updated))
        for node in self._nodes():
            started = time.perf_counter()
            done = node.commit_diff(tops, PARTITIONS)
            self._timed("commit_diff", started)
            if not done:
                raise SimulationError(f"commit on masterchain block {mc_seqno} was skipped")
        if self.config.check_state:
            with self._checking():
                for shard, blocks in self.uncommitted.items():
                    if taken[shard]:
                        self._check_committed(
                            shard, blocks[: taken[shard]], above=len(blocks) - taken[shard]
                        )
        self.last_mc = BlockId(MC, mc_seqno)
        self.result.commits += 1
        for shard, blocks in self.uncommitted.items():
            now = blocks[: taken[shard]]
            for block in now:
                self._commit_block(block)
                if block.state.top_max is not None:
                    self.committed_tops[shard].append((block.state.top_max, block.seqno))
            self.result.blocks_committed += len(now)
            del blocks[: taken[shard]]
            if now:
                self.committed[shard] = now[-1].state

    def _commit_block(self, block: BlockRecord) -> None:
        """The block is final: its messages are owed a delivery, and what it executed is
        checked against what is owed (exactly once, unchanged, by the right shard)."""
        for m in block.created:
            mid = (block.shard, m.key)
            if mid in self.owed or m.key.hash in self.delivered:
                self._violate(mid, "duplicated", f"created again by {block.shard}:{block.seqno}")
            self.owed[mid] = m
            partition = block.router.partition_for(m.src, m.dst)
            if partition:
                self.owed_partition[mid] = partition
            self.committed_depth[self.world.shard_of(m.dst)] += 1
        self.result.messages_created += len(block.created)
        where = f"{block.shard}:{block.seqno}"  # once a block, not once a message
        for item in block.executed:
            mid = (item.source, item.message.key)
            expected = self.owed.pop(mid, None)
            if expected is None:
                if item.message.key.hash in self.delivered:
                    self._violate(mid, "duplicated", f"executed again by block {where}")
                else:
                    self._violate(
                        mid, "phantom", f"executed by {where}, no committed block created it"
                    )
                continue
            self.delivered[item.message.key.hash] = None
            self.committed_depth[block.shard] -= 1
            self.result.messages_delivered += 1
            routed = self.owed_partition.pop(mid, 0)
            read = PARTITIONS[1] if mid in block.executed_low else 0
            if read != routed:
                self._violate(
                    mid,
                    "misrouted",
                    f"block {where} read it from partition {read}; its block's router sent "
                    f"it to partition {routed}",
                )
            if expected != item.message:
                self._violate(mid, "misdelivered", f"block {where} read it back different")
            elif not block.shard.contains(expected.dst):
                self._violate(mid, "misdelivered", f"executed by {where}, not its destination")

    def _violate(self, mid: MessageId, kind: str, detail: str) -> None:
        if kind == "lost":
            self.result.lost += 1
        elif kind == "duplicated":
            self.result.duplicated += 1
        self.result.violations.append(Violation(mid, kind, detail))

    @contextlib.contextmanager
    def _checking(self) -> Iterator[None]:
        """Time the block's state checks apart from the collators' queue calls: they are
        the proof's work, not the network's."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.result.check_seconds += time.perf_counter() - started

    def _check(self, ok: bool) -> bool:
        """Count one check of the queue's answer about its own state against the run's
        record; ``ok`` is its outcome (a failed one is then told to :meth:`_state_error`)."""
        self.result.state_checks += 1
        return ok

    def _state_error(self, what: str) -> None:
        self.result.state_errors.append(what)

    # -- the end -----------------------------------------------------------------------------

    def _sample(self, round_no: int) -> None:
        uncommitted = {
            str(s): sum(len(b.created) for b in blocks) for s, blocks in self.uncommitted.items()
        }
        self._update_gc_totals()
        self.result.samples.append(
            Sample(
                round=round_no,
                seconds=time.perf_counter() - self._started,
                committed_depth={str(s): n for s, n in self.committed_depth.items()},
                uncommitted=uncommitted,
                gc_collected=self.result.gc_collected,
            )
        )

    def _final_check(self) -> None:
        for node in self._nodes():
            self._final_check_node(node)

    def _contents(self, queue: SimQueue) -> tuple[list[object], list[object]]:
        """What a node's queue holds, as readers see it: every shard's tail length and
        statistics, and every stored message (source, key, addresses, body) of both
        partitions, in the iterator's order."""
        everything = [QueueShardRange(s, QueueKey.MIN, QueueKey.MAX) for s in self.world.shards]
        summary: list[object] = [
            ("tail", s, queue.get_diffs_tail_len(s, QueueKey.MIN)) for s in self.world.shards
        ]
        messages: list[object] = []
        for partition in PARTITIONS:
            for r in everything:
                stats = queue.load_diff_statistics(partition, r)
                summary.append(("statistics", partition, r.shard, sorted(stats.items())))
            for for_shard in (MC, ShardIdent.BASECHAIN):
                with queue.iterator(partition, everything, for_shard) as it:
                    messages.extend((partition, m.source, m.message) for m in it)
        return summary, messages

    def _agree_contents(self, stage: str) -> None:
        """Every node's queue reads the same: tails, statistics and every message. Each
        node's GC runs on its own clock, so first every node runs a pass: their requested
        bounds are the same (the same commits), so after it they must hold the same."""
        for node in self._nodes():
            started = time.perf_counter()
            node.run_gc()
            self._timed("run_gc", started)
            self._explicit_gc += 1
        summary, messages = self._contents(self._q())
        leader = summary + messages
        self.result.agreed_contents_messages += len(messages)
        for i, node in enumerate(self.followers, start=1):
            theirs_summary, theirs_messages = self._contents(node)
            theirs = theirs_summary + theirs_messages
            if theirs != leader:
                first = next(
                    (n for n, (a, b) in enumerate(zip(leader, theirs, strict=False)) if a != b),
                    min(len(leader), len(theirs)),
                )
                self.result.disagreements.append(
                    f"node {i}: its queue reads differently from node 0's ({stage}), from "
                    f"item {first} on"
                )

    def _agree(self, stage: str) -> None:
        """Every node holds the same queue: byte-identical exports of every shard's top
        block with its whole stored tail, pointers and last committed block. (Exports need
        message BOCs, which the simulated bodies are not: they run once the tails hold no
        messages, after the final GC; ``_agree_contents`` compares messages earlier.)"""
        leader = self._q()
        for i, node in enumerate(self.followers, start=1):
            checks = [
                ("commit pointers", leader.get_commit_pointers(), node.get_commit_pointers()),
                (
                    "last committed block",
                    leader.get_last_committed_mc_block_id(),
                    node.get_last_committed_mc_block_id(),
                ),
            ]
            for what, mine, theirs in checks:
                if mine != theirs:
                    self.result.disagreements.append(
                        f"node {i}: {what} differ from node 0's ({stage})"
                    )
        for shard in self.world.shards:
            seqno = self.current[shard].seqno
            if seqno == 0:
                continue
            tail = leader.get_diffs_tail_len(shard, QueueKey.MIN)
            exports: list[bytes] = []
            for i, node in enumerate(self._nodes()):
                path = self.config.directory / f"export-node{i}-{str(shard).replace(':', '_')}.bin"
                node.export_state(shard, seqno, tail, path)
                exports.append(path.read_bytes())
                path.unlink()
            for i, data in enumerate(exports[1:], start=1):
                if data != exports[0]:
                    self.result.disagreements.append(
                        f"node {i}: the export of {shard}:{seqno} (tail {tail}) differs from "
                        f"node 0's ({stage})"
                    )
            self.result.agreed_exports += 1

    def _final_check_node(self, queue: SimQueue) -> None:
        """After the drain's last commit: one GC pass, then nothing may remain stored."""
        started = time.perf_counter()
        queue.run_gc()
        self._timed("run_gc", started)
        self._explicit_gc += 1
        everything = [QueueShardRange(s, QueueKey.MIN, QueueKey.MAX) for s in self.world.shards]
        self._none_stored(queue, everything, "after the final commit and GC")
        for partition in PARTITIONS:
            for r in everything:
                left = queue.load_diff_statistics(partition, r)
                if not self._check(not left):
                    self._state_error(
                        f"statistics of {r.shard} partition {partition} remain after "
                        f"the final GC: {len(left)} accounts"
                    )
        # GC deletes, per source shard, every diff up to the lowest processed_to of the
        # last commit's top blocks; the committed diffs above it stay.
        for shard in self.world.shards:
            bound = self._gc_bound(shard)
            tops = self.committed_tops[shard]
            kept = sum(1 for top, _ in tops if bound is None or top > bound)
            stored = queue.get_diffs_tail_len(shard, QueueKey.MIN)
            if not self._check(stored == kept):
                self._state_error(
                    f"{stored} diffs of {shard} stored after the final GC; the run "
                    f"committed {kept} above its GC bound {bound}"
                )
            # and the records of the diffs it collected are gone (their diff info)
            for top, seqno in tops:
                if bound is not None and top <= bound:
                    info = queue.get_diff_info(shard, seqno, DiffZone.BOTH)
                    if not self._check(info is None):
                        self._state_error(
                            f"the diff {shard}:{seqno} is still stored after the final GC "
                            f"(its max_message {top} is at or below the GC bound {bound})"
                        )
                        break

    def _gc_bound(self, source: ShardIdent) -> QueueKey | None:
        """The lowest processed_to of ``source`` over the committed top blocks."""
        keys = [
            key
            for state in self.committed.values()
            if state.seqno > 0
            for shard, key in state.processed_to
            if shard == source
        ]
        return min(keys, default=None)

    def _verify(self) -> None:
        """What is still owed at the end was lost: created by a committed block, never
        executed by one."""
        for mid in sorted(self.owed, key=lambda m: (m[1], m[0])):
            self._violate(mid, "lost", "created by a committed block, never executed")
