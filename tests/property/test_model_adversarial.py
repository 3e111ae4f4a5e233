"""Adversarial model-based tests: what ``test_queue_machine`` does not generate.

The machine of ``test_queue_machine.py`` drives three shards (the masterchain and two
basechain halves), partitions 0-2 and no persistent states. This one drives the real
queue and :class:`imq.testing.model.QueueModel` through:

- eight source shards, overlapping ones included (the full basechain beside its halves
  and a quarter, a depth-60 shard, the extreme workchains -128 and 127, workchain 1):
  splits and merges are only shard identities to the queue, so a "split" is diffs of
  the halves after diffs of the parent, and commits naming both;
- routers into partitions 1 (low priority), 2, 255, 256 and 65535, and commits,
  clears, startups and reads over those partitions;
- empty diffs whose bounds are shared with the shard's newest diff, with explicit
  ``QueueDiff(min_key=, max_key=)``, with lt spans, and statistics up to ``MAX``;
- masterchain diffs whose ``processed_to`` feeds GC, commits naming shards without
  diffs, duplicate masterchain entries, equal and lower masterchain seqnos;
- a diff prepared and *held* while other steps run: applies and reads of other shards,
  and the calls that must be refused on this thread (commit, clear, startup, GC, import,
  a second prepare of the held shard); then written, discarded, or orphaned by a reopen;
- ``import_state`` of generated persistent states (``imq.state.synth`` building blocks)
  mid-sequence: fresh chains, chains extending an earlier import (kept diffs), seqnos
  colliding with applied diffs, key spans overlapping stored diffs, wrong top updates,
  the wrong block, masterchain states. The model has no import, so
  :func:`model_import` below implements docs/behaviour.md 5.8 on the model's fields;
- reads at the boundaries: tail lengths at every diff's ``min``/``max`` and the keys
  next to them, statistics over ranges that start or end exactly on a diff's span;
- a reopen after any step (``bounce``).

After every step every public read must agree with the model, as in the other machine.
Found divergences are kept at the end as plain regression tests.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from regular_history import RegularModel

from imq import (
    Address,
    BlockId,
    BlockIdShort,
    CommitError,
    CommitPointer,
    DiffConflictError,
    DiffInfo,
    DiffStatistics,
    DiffZone,
    ImqError,
    Message,
    PartitionRouter,
    PendingDiff,
    Queue,
    QueueClosedError,
    QueueConfig,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    StateFormatError,
    TopBlock,
)
from imq.state.boc import encode_boc
from imq.state.message import build_internal_message
from imq.state.synth import SynthDiff, SynthState, write_synth_state
from imq.state.tl import TlDiff, diff_hash, encode_diff
from imq.testing.model import DiffInput, ModelDiff, QueueModel
from imq.verify import state_problems, verify

# ---------------------------------------------------------------------------------------------
# The world

MC = ShardIdent.MASTERCHAIN
BASE = ShardIdent.BASECHAIN
SHARDS: dict[str, ShardIdent] = {
    "mc": MC,
    "base": BASE,
    "left": ShardIdent(0, 0x4000_0000_0000_0000),
    "right": ShardIdent(0, 0xC000_0000_0000_0000),
    "ll": ShardIdent(0, 0x2000_0000_0000_0000),  # a quarter: inside "left" and "base"
    "deep": ShardIdent(0, 0x9234_5678_9ABC_DEF8),  # prefix_len 60
    "w-128": ShardIdent.full(-128),
    "w127": ShardIdent.full(127),
    "w1": ShardIdent.full(1),
}
NON_MC = tuple(n for n in SHARDS if n != "mc")
PARTITIONS = (0, 1, 2, 255, 256, 65535)
ROUTED = (1, 1, 2, 255, 256, 65535)  # partition 1 (low priority) twice as likely
TARGETS = (BASE, MC, ShardIdent.full(1), ShardIdent.full(127), ShardIdent.full(-128))
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
CONFIG = replace(QueueConfig.testing(), gc_enabled=True, gc_interval=3600.0)
ZONES: dict[str | None, DiffZone | None] = {
    None: None,
    "uncommitted": DiffZone.UNCOMMITTED,
    "both": DiffZone.BOTH,
    "committed": DiffZone.COMMITTED,
}


def _account(first: int, tag: int) -> bytes:
    return bytes([first, tag]) + bytes([tag ^ 0x33]) * 30


ACCOUNTS: tuple[Address, ...] = tuple(
    Address(wc, _account(first, tag))
    for tag, (wc, first) in enumerate(
        [
            (0, 0x00),
            (0, 0x21),
            (0, 0x5F),
            (0, 0x92),
            (0, 0xC7),
            (0, 0xFF),
            (-1, 0x10),
            (-1, 0xF0),
            (1, 0x44),
            (127, 0xFF),
            (-128, 0x00),
        ]
    )
)


def inside(address: Address, shard: ShardIdent) -> Address:
    """``address`` moved into ``shard`` (workchain and prefix bits)."""
    bits = shard.prefix_len
    head = int.from_bytes(address.account[:8], "big")
    if bits:
        keep = U64_MAX >> bits
        head = (shard.prefix & ~keep & U64_MAX) | (head & keep)
    return Address(shard.workchain, head.to_bytes(8, "big") + address.account[8:])


def below(key: QueueKey) -> QueueKey | None:
    """The largest key strictly below ``key`` (None for MIN)."""
    if key == QueueKey.MIN:
        return None
    h = int.from_bytes(key.hash, "big")
    if h == 0:
        return QueueKey.max_for_lt(key.lt - 1)
    return QueueKey(key.lt, (h - 1).to_bytes(32, "big"))


def _startup_check(model: QueueModel, block: BlockId) -> None:
    """The check half of the model's startup (it raises StartupError, changes nothing)."""
    probe = QueueModel(model.zerostate_seqno)
    probe.last_mc_block = model.last_mc_block
    probe.startup(block, [], [])


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except (ImqError, ValueError, TypeError) as exc:
        return "raised", type(exc)


OUTCOMES: Counter[str] = Counter()  # every outcome seen, for a look at what runs


def note(operation: str, result: tuple[str, Any]) -> None:
    """Label an outcome for ``--hypothesis-show-statistics``."""
    shown = result[1].__name__ if result[0] == "raised" else repr(result[1])
    OUTCOMES[f"{operation}: {shown}"] += 1
    if currently_in_test_context():
        event(f"{operation}: {shown}")


# ---------------------------------------------------------------------------------------------
# import on the model (docs/behaviour.md 5.8, SEMANTICS §13.5 with I9, I10, I11)


def model_import(
    model: QueueModel,
    state: SynthState,
    block_id: BlockId,
    top_update: tuple[bytes, int] | None,
) -> int:
    """What ``Queue.import_state`` must do, on the model's fields; returns the number of
    diffs written. Checks first, in the documented order, and mutates only after."""
    shard = state.shard
    if shard != block_id.shard or state.seqno != block_id.seqno:
        raise StateFormatError("the state belongs to another block")
    if top_update is not None and top_update != state.top_update:
        raise StateFormatError("top update mismatch")
    top = state.diffs[0]
    newer = None
    for d in state.diffs:  # newest first; the reader refuses diffs out of order (formats.md)
        if d.tl.n_messages:
            if newer is not None and not d.tl.max_message < newer.tl.min_message:
                raise StateFormatError("diffs with messages not in ascending, disjoint ranges")
            newer = d
        if d.tl.max_message > top.tl.max_message:
            raise StateFormatError("a diff ends above the newest diff's max_message")
    new = []  # the stored diffs of the state's seqnos first, then the pointer
    for d in state.diffs:
        stored = model.diffs.get((shard, d.seqno))
        if stored is not None:
            if stored.info.hash != d.hash:
                raise DiffConflictError(f"{shard}:{d.seqno} stored with another hash")
            if stored.info.max_message > top.tl.max_message:
                raise DiffConflictError(f"{shard}:{d.seqno} kept but above the new pointer")
            continue
        new.append(d)
    new_pointer = CommitPointer(top.tl.max_message, top.seqno)
    old = model.pointers.get(shard)
    if old is not None and (new_pointer.key < old.key or new_pointer.seqno < old.seqno):
        raise CommitError("import would move the pointer back")
    last = model.last_mc_block
    if (
        block_id.is_masterchain
        and last is not None
        and last.seqno == block_id.seqno
        and last != block_id
    ):
        raise CommitError("another masterchain block of the last committed seqno")

    def committed(info: DiffInfo) -> bool:
        return old is not None and old.key >= info.max_message

    spans = [
        (m.info.min_message, m.info.max_message) for (s, _), m in model.diffs.items() if s == shard
    ]
    for d in new:
        lo_, hi_ = d.tl.min_message, d.tl.max_message
        if any(lo <= hi_ and lo_ <= hi for lo, hi in spans):
            raise DiffConflictError(f"{shard}:{d.seqno} overlaps a stored diff")
    held = {d.seqno for d in state.diffs}
    for (s, seqno), m in model.diffs.items():
        below = m.info.max_message <= top.tl.max_message
        if s == shard and seqno not in held and below and not committed(m.info):
            raise DiffConflictError(f"{shard}:{seqno} uncommitted below the new pointer")
    partitions = {0} | {p for d in new for p, a in (*d.tl.router_src, *d.tl.router_dst) if a}
    for d in new:  # rows a rollback would delete: a partial GC's leftovers (no record)
        lo_, hi_ = d.tl.min_message, d.tl.max_message
        if any(
            p in partitions and s == shard and lo_ <= key <= hi_ for p, s, key in model.messages
        ) or any(
            p in partitions and s == shard and lo_ <= max_message <= hi_
            for s, p, max_message, _, _ in model.stats
        ):
            raise DiffConflictError(f"{shard}:{d.seqno} spans rows of a diff GC left")
    for d in new:
        route_dst: dict[Address, int] = {}
        route_src: dict[Address, int] = {}
        for route, half in ((route_dst, d.tl.router_dst), (route_src, d.tl.router_src)):
            for partition, addresses in half:
                for a in addresses:
                    route.setdefault(a, partition)  # I11: the lowest partition wins
        written: set[int] = {p for p, _ in (*d.tl.router_src, *d.tl.router_dst)}
        counts: dict[int, dict[Address, int]] = {}
        per_wc: dict[int, int] = {}
        for m in d.messages:
            p = route_dst.get(m.dst, route_src.get(m.src, 0))
            model.messages[(p, shard, m.key)] = m
            bucket = counts.setdefault(p, {})
            bucket[m.dst] = bucket.get(m.dst, 0) + 1
            per_wc[m.dst.workchain] = per_wc.get(m.dst.workchain, 0) + 1
            written.add(p)
        for p, bucket in counts.items():
            for dst, n in bucket.items():
                model.stats[(shard, p, d.tl.max_message, d.seqno, dst)] = n
        info = DiffInfo(
            min_message=d.tl.min_message,
            max_message=d.tl.max_message,
            shards_messages_count={ShardIdent.full(wc): n for wc, n in per_wc.items()},
            hash=d.hash,
            processed_to=dict(d.tl.processed_to),
            router_src={p: frozenset(a) for p, a in d.tl.router_src},
            router_dst={p: frozenset(a) for p, a in d.tl.router_dst},
            seqno=d.seqno,
            prev_hash=d.tl.prev_hash,
        )
        model.diffs[(shard, d.seqno)] = ModelDiff(info, frozenset(written))
    model.pointers[shard] = new_pointer
    model.commit_record[shard] = dict(top.tl.processed_to)  # as a commit of it would
    if block_id.is_masterchain and (
        model.last_mc_block is None or model.last_mc_block.seqno <= block_id.seqno
    ):
        model.last_mc_block = block_id
    return len(new)


def synth_diff(
    shard: ShardIdent,
    seqno: int,
    prev_hash: bytes,
    lts: Sequence[int],
    dsts: Sequence[Address],
    *,
    span: tuple[int, int],
    processed_to: tuple[tuple[ShardIdent, QueueKey], ...] = (),
    router_dst: tuple[tuple[int, tuple[Address, ...]], ...] = (),
    router_src: tuple[tuple[int, tuple[Address, ...]], ...] = (),
) -> SynthDiff:
    """One diff of a generated state: a real message cell per (lt, destination)."""
    messages = []
    for i, (lt, dst) in enumerate(zip(lts, dsts, strict=True)):
        src = inside(ACCOUNTS[i % len(ACCOUNTS)], shard)
        cell = build_internal_message(src, dst, lt, created_at=seqno)
        messages.append(Message(QueueKey(lt, cell.hash), src, dst, encode_boc([cell])))
    messages.sort(key=lambda m: m.key.hash)
    keys = sorted(m.key for m in messages)
    tl = TlDiff(
        prev_hash=prev_hash,
        shard=shard,
        seqno=seqno,
        processed_to=tuple(sorted(processed_to)),
        min_message=keys[0] if keys else QueueKey.min_for_lt(span[0]),
        max_message=keys[-1] if keys else QueueKey.max_for_lt(span[1]),
        hashes=b"".join(m.key.hash for m in messages),
        router_src=router_src,
        router_dst=router_dst,
    )
    return SynthDiff(seqno, tl, diff_hash(encode_diff(tl)), tuple(messages))


def state_bytes(state: SynthState) -> bytes:
    buf = io.BytesIO()
    write_synth_state(state, buf)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# Rule arguments (plain values resolved against the state, so shrunk programs replay)


@dataclass(frozen=True)
class Msg:
    src: int
    dst: int
    lt_mode: str  # next | same | old | at_pointer | at_diff_max
    step: int


@dataclass(frozen=True)
class Diff:
    shard: str
    seqno_mode: str  # next | same | skip | any
    pick: int
    hash_mode: str  # fresh | stored
    zone: str | None
    msgs: tuple[Msg, ...]
    router_src: tuple[tuple[int, int], ...]
    router_dst: tuple[tuple[int, int], ...]
    processed_to: tuple[tuple[str, str, int], ...]
    bounds_mode: str  # default | span | keys | share | max | stats
    dup_route: bool = False  # also list each routed account in partition 1 (I11: highest wins)


@dataclass(frozen=True)
class Top:
    shard: str
    mode: str  # latest | older | missing
    pick: int
    updated: bool
    ref_zero: bool


@dataclass(frozen=True)
class Import:
    shard: str
    counts: tuple[int, ...]  # messages per new diff, oldest first
    seqno_mode: str  # above | at_last | low
    pick: int
    lt_mode: str  # fresh | overlap
    chain: str  # new | extend
    keep: int  # how many diffs of the earlier chain to repeat (extend)
    top_update: str  # ok | none | bad_hash | bad_len
    block: str  # ok | bad_seqno
    routed: tuple[tuple[int, int], ...]  # (destination index, partition)
    processed_to: tuple[tuple[str, str, int], ...]


rarely = st.sampled_from((False, False, False, True))
often = st.sampled_from((True, True, True, False))
partition_sets = st.lists(st.sampled_from(PARTITIONS), unique=True, max_size=4)
shard_names = st.sampled_from(tuple(SHARDS))
shard_sets = st.lists(shard_names, unique=True, max_size=4)
READ_MODES = ("min", "lt_max", "message", "diff_max", "diff_min")
reads = st.lists(
    st.tuples(shard_names, st.sampled_from(READ_MODES), st.integers(0, 6)),
    unique_by=lambda e: e[0],
    max_size=3,
).map(tuple)
routes = st.lists(
    st.tuples(st.integers(0, len(ACCOUNTS) - 1), st.sampled_from(ROUTED)),
    unique_by=lambda e: e[0],
    max_size=3,
).map(tuple)
msgs = st.builds(
    Msg,
    src=st.integers(0, len(ACCOUNTS) - 1),
    dst=st.integers(0, len(ACCOUNTS) - 1),
    lt_mode=st.sampled_from(("next", "next", "next", "same", "old", "at_pointer", "at_diff_max")),
    step=st.integers(0, 3),
)
diffs = st.builds(
    Diff,
    shard=st.sampled_from(("mc", "mc", "base", "left", "right", "ll", "deep", "w-128", "w127")),
    seqno_mode=st.sampled_from(("next", "next", "next", "same", "skip", "any")),
    pick=st.integers(0, 5),
    hash_mode=st.sampled_from(("fresh", "stored")),
    zone=st.sampled_from(tuple(ZONES)),
    msgs=st.lists(msgs, max_size=5).map(tuple),
    router_src=st.one_of(st.just(()), routes),
    router_dst=st.one_of(st.just(()), routes),
    processed_to=reads,
    bounds_mode=st.sampled_from(("default", "default", "span", "keys", "share", "max", "stats")),
    dup_route=rarely,
)
tops = st.builds(
    Top,
    shard=st.sampled_from(NON_MC),
    mode=st.sampled_from(("latest", "latest", "latest", "latest", "older", "missing")),
    pick=st.integers(0, 5),
    updated=often,
    ref_zero=rarely,
)
imports = st.builds(
    Import,
    shard=st.sampled_from(("base", "left", "right", "mc", "deep")),
    counts=st.lists(st.integers(0, 3), min_size=1, max_size=3).map(tuple),
    seqno_mode=st.sampled_from(("above", "above", "at_last", "low")),
    pick=st.integers(0, 3),
    lt_mode=st.sampled_from(("fresh", "fresh", "fresh", "overlap")),
    chain=st.sampled_from(("new", "extend", "extend")),
    keep=st.integers(1, 3),
    top_update=st.sampled_from(("ok",) * 6 + ("none", "bad_hash", "bad_len")),
    block=st.sampled_from(("ok",) * 9 + ("bad_seqno",)),
    routed=st.lists(
        st.tuples(st.integers(0, len(ACCOUNTS) - 1), st.sampled_from(ROUTED)),
        unique=True,
        max_size=4,
    ).map(tuple),
    processed_to=reads,
)
bound_modes = st.tuples(
    st.sampled_from(("min", "max", "pointer", "pointer_next", "diff_max", "diff_min", "message")),
    st.integers(0, 6),
)


# ---------------------------------------------------------------------------------------------
# The machine


class AdversarialMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="imq-adversarial-"))
        self.path = self.tmp / "db"
        self.zerostate_seqno = 0
        self.model = RegularModel()
        self.queue = self._open()
        self.clock = 100
        self.counter = 0
        self.pending: tuple[PendingDiff, DiffInput] | None = None
        self.chains: dict[ShardIdent, list[SynthDiff]] = {}  # newest first

    @initialize(zerostate_seqno=st.sampled_from((0, 0, 1, 3)))
    def open_with_zerostate(self, zerostate_seqno: int) -> None:
        self.zerostate_seqno = zerostate_seqno
        self.model = RegularModel(zerostate_seqno)
        self.queue.close()
        self.queue = self._open()

    def _open(self) -> Queue:
        queue = Queue.open(self.path, CONFIG, zerostate_seqno=self.zerostate_seqno)
        worker = queue.gc_worker
        assert worker is not None
        assert worker.tick(timeout=30)  # at least the pass at open has run
        # The model runs that pass (D7: GC resumes after a reopen without a commit).
        self.model.run_gc()
        return queue

    def teardown(self) -> None:
        try:
            if self.pending is not None:
                self.pending[0].discard()
        except ImqError:
            pass
        try:
            self.queue.close()
            # The whole of ``imq verify`` on what the program left, a state the model
            # agreed with: when its history kept a network's shape (what verify's counts
            # assume, see regular_history.py), a problem is a false alarm or damage the
            # invariants missed; otherwise verify must still run through.
            report = verify(self.path)
            if self.model.regular:
                assert report.ok and not report.notes, (report.problems, report.notes)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- value generation ---------------------------------------------------------------------

    def fresh_hash(self) -> bytes:
        self.counter += 1
        return hashlib.blake2b(self.counter.to_bytes(8, "big"), digest_size=32).digest()

    def _newest_diff(self, shard: ShardIdent) -> DiffInfo | None:
        seqnos = self.model.seqnos(shard)
        return self.model.diffs[(shard, seqnos[-1])].info if seqnos else None

    def _key(self, shard: ShardIdent, m: Msg) -> QueueKey:
        pointer = self.model.pointers.get(shard)
        newest = self._newest_diff(shard)
        if m.lt_mode == "at_pointer" and pointer is not None:
            return pointer.key
        if m.lt_mode == "at_diff_max" and newest is not None:
            return newest.max_message
        if m.lt_mode == "same":
            return QueueKey(max(0, self.clock - m.step), self.fresh_hash())
        if m.lt_mode == "old":
            base = pointer.key.lt if pointer is not None else self.clock
            return QueueKey(max(0, min(base, self.clock) - m.step), self.fresh_hash())
        self.clock += 1 + m.step
        return QueueKey(self.clock, self.fresh_hash())

    def _read_key(self, source: ShardIdent, mode: str, back: int) -> QueueKey:
        keys: list[QueueKey] = []
        if mode == "message":
            keys = sorted({k for (_, s, k) in self.model.messages if s == source})
        elif mode in ("diff_max", "diff_min"):
            attr = "max_message" if mode == "diff_max" else "min_message"
            keys = sorted(
                {getattr(d.info, attr) for (s, _), d in self.model.diffs.items() if s == source}
            )
        if keys:
            return keys[-1 - back % len(keys)]
        if mode == "min":
            return QueueKey.MIN
        return QueueKey.max_for_lt(max(0, self.clock - back))

    def _seqno(self, shard: ShardIdent, mode: str, pick: int) -> int:
        last = self.model.get_last_applied_seqno(shard)
        if mode == "next":
            return 1 if last is None else last + 1
        if mode == "same":
            return last if last is not None else 1
        if mode == "skip":
            return (last or 0) + 2 + pick % 2
        return pick % ((last or 0) + 3)

    def resolve(self, spec: Diff) -> tuple[DiffInput, QueueDiff, DiffStatistics | None]:
        shard = SHARDS[spec.shard]
        seqno = self._seqno(shard, spec.seqno_mode, spec.pick)
        stored = self.model.diffs.get((shard, seqno))
        diff_hash_ = (
            stored.info.hash if stored is not None and spec.hash_mode == "stored" else None
        ) or self.fresh_hash()
        messages: dict[QueueKey, Message] = {}
        for m in spec.msgs:
            key = self._key(shard, m)
            if key in messages:
                continue
            messages[key] = Message(
                key, inside(ACCOUNTS[m.src], shard), ACCOUNTS[m.dst], bytes([m.step])
            )
        processed_to = {
            SHARDS[n]: self._read_key(SHARDS[n], mo, b) for n, mo, b in spec.processed_to
        }
        keys = sorted(messages)
        newest = self._newest_diff(shard)
        pointer = self.model.pointers.get(shard)
        shared = (
            newest.max_message
            if newest is not None
            else (pointer.key if pointer is not None else QueueKey.max_for_lt(self.clock))
        )
        bounds: tuple[QueueKey, QueueKey] | None = None
        span: tuple[int, int] | None = None
        explicit = False  # bounds passed as QueueDiff(min_key=, max_key=)
        with_stats = False  # bounds passed as DiffStatistics
        mode = spec.bounds_mode
        if mode == "span":
            span = (
                (keys[0].lt, min(keys[-1].lt + 1, U64_MAX))
                if keys
                else (shared.lt, min(shared.lt + spec.pick % 2, U64_MAX))
            )
        elif mode == "keys":
            explicit = True
            bounds = (
                (QueueKey.min_for_lt(keys[0].lt), QueueKey.max_for_lt(keys[-1].lt))
                if keys
                else (shared, shared)
            )
        elif mode == "share":
            with_stats = True
            bounds = (keys[0], max(keys[-1], shared)) if keys else (shared, shared)
        elif mode == "max":
            with_stats = True
            bounds = (keys[0] if keys else QueueKey.MIN, QueueKey.MAX)
        elif mode == "stats":
            with_stats = True
            bounds = (keys[0], keys[-1]) if keys else (QueueKey.MIN, QueueKey.MIN)
        d = DiffInput(
            block=BlockIdShort(shard, seqno),
            diff_hash=diff_hash_,
            messages=tuple(messages.values()),
            processed_to=processed_to,
            router_src={inside(ACCOUNTS[i], shard): p for i, p in spec.router_src},
            router_dst={ACCOUNTS[i]: p for i, p in spec.router_dst},
            bounds=bounds,
            span=span,
        )
        router = None
        if d.router_src or d.router_dst:
            src = {p: [a for a, q in d.router_src.items() if q == p] for p in set(ROUTED)}
            dst = {p: [a for a, q in d.router_dst.items() if q == p] for p in set(ROUTED)}
            if spec.dup_route:
                src[1] = list(d.router_src)
                dst[1] = list(d.router_dst)
            router = PartitionRouter(src=src, dst=dst)
        extra: dict[str, Any] = {}
        if span is not None:
            extra = {"start_lt": span[0], "end_lt": span[1]}
        if explicit and bounds is not None:
            extra = {"min_key": bounds[0], "max_key": bounds[1]}
        diff = QueueDiff(d.messages, d.processed_to, router, None, **extra)
        stats = None
        if with_stats and bounds is not None:
            stats = DiffStatistics(shard, bounds[0], bounds[1], d.statistics())
        return d, diff, stats

    # -- rules: diffs -------------------------------------------------------------------------

    def _held(self) -> ShardIdent | None:
        return None if self.pending is None else self.pending[1].block.shard

    @rule(spec=diffs, bounce=rarely)
    def apply_diff(self, spec: Diff, bounce: bool) -> None:
        d, diff, stats = self.resolve(spec)
        zone = ZONES[spec.zone]
        if d.block.shard == self._held():
            # I5: a second prepare of a shard this thread holds is refused.
            with pytest.raises(ImqError) as refused:
                self.queue.apply_diff(diff, d.block, d.diff_hash, stats, zone)
            assert refused.type is ImqError
            return
        expected = outcome(lambda: self.model.apply(d, zone))
        actual = outcome(lambda: self.queue.apply_diff(diff, d.block, d.diff_hash, stats, zone))
        assert actual == expected, f"apply_diff {d.block}: queue {actual}, model {expected}"
        note("apply_diff", expected)
        if bounce:
            self.reopen()

    @precondition(lambda self: self.pending is None)
    @rule(spec=diffs)
    def prepare_and_hold(self, spec: Diff) -> None:
        """Prepare a diff and keep it pending while other rules run."""
        d, diff, stats = self.resolve(spec)
        zone = ZONES[spec.zone]
        expected = outcome(lambda: self.model.check_diff(d, zone))
        actual = outcome(lambda: self.queue.prepare_diff(diff, d.block, d.diff_hash, stats, zone))
        pending = actual[1] if actual[0] == "ok" else None
        shown = ("ok", pending is not None) if actual[0] == "ok" else actual
        assert shown == expected, f"prepare_diff {d.block}: queue {shown}, model {expected}"
        note("prepare_and_hold", expected)
        if pending is not None:
            self.pending = (pending, d)

    @precondition(lambda self: self.pending is not None)
    @rule(write=often)
    def finish_pending(self, write: bool) -> None:
        assert self.pending is not None
        pending, d = self.pending
        self.pending = None
        if write:
            # Nothing of the held shard can have changed meanwhile: the model writes now.
            self.model._write(d)
            pending.write()
        else:
            pending.discard()

    def _refused_while_pending(
        self, call: Callable[[], Any], checked_first: Callable[[], Any] | None = None
    ) -> bool:
        """With a pending diff held, commit, clear, startup, GC and import are refused
        (I5) and change nothing. True if the call was refused. ``checked_first`` is the
        model's side of a check the call may run before it refuses (startup's
        StartupError, API.md: a StartupError changes nothing): either error will do."""
        if self.pending is None:
            return False
        allowed: set[type] = {ImqError}
        if checked_first is not None:
            first = outcome(checked_first)
            if first[0] == "raised":
                allowed.add(first[1])
        with pytest.raises(ImqError) as refused:
            call()
        assert refused.type in allowed, refused.type
        return True

    # -- rules: commit, clear, startup, reopen, GC --------------------------------------------

    def _top(self, spec: Top, mc_seqno: int) -> TopBlock:
        shard = SHARDS[spec.shard]
        seqnos = self.model.seqnos(shard)
        if spec.mode == "latest" and seqnos:
            seqno = seqnos[-1]
        elif spec.mode == "older" and seqnos:
            seqno = seqnos[-1 - spec.pick % len(seqnos)]
        else:
            seqno = seqnos[-1] + 1 if seqnos else 1
        return TopBlock(BlockId(shard, seqno), 0 if spec.ref_zero else mc_seqno, spec.updated)

    def _mc_seqno(self, mode: str, pick: int) -> int:
        seqnos = self.model.seqnos(MC)
        last = seqnos[-1] if seqnos else 0
        if mode == "latest":
            return last if seqnos else 1
        if mode == "missing":
            return last + 1 + pick % 2
        if mode == "stale":
            committed = self.model.last_mc_block
            return max(0, committed.seqno - pick % 2) if committed is not None else pick
        return pick % (last + 3)

    @rule(
        mc_mode=st.sampled_from(("latest", "latest", "latest", "missing", "stale", "any", "none")),
        mc_pick=st.integers(0, 5),
        mc_updated=often,
        mc_ref_zero=rarely,
        top_list=st.lists(tops, unique_by=lambda t: t.shard, max_size=4),
        duplicate=st.sampled_from((None, None, None, None, "shard", "mc")),
        mc_position=st.integers(0, 4),
        partitions=partition_sets,
        bounce=rarely,
    )
    def commit(
        self,
        *,
        mc_mode: str,
        mc_pick: int,
        mc_updated: bool,
        mc_ref_zero: bool,
        top_list: list[Top],
        duplicate: str | None,
        mc_position: int,
        partitions: list[int],
        bounce: bool,
    ) -> None:
        mc_seqno = self._mc_seqno(mc_mode, mc_pick)
        blocks = [self._top(t, mc_seqno) for t in top_list]
        if duplicate == "shard" and top_list:
            blocks.append(self._top(replace(top_list[0], mode="older"), mc_seqno))
        if mc_mode != "none":
            mc = TopBlock(BlockId(MC, mc_seqno), 0 if mc_ref_zero else mc_seqno, mc_updated)
            blocks.insert(min(mc_position, len(blocks)), mc)
            if duplicate == "mc":
                blocks.append(TopBlock(BlockId(MC, mc_seqno + 1), mc_seqno, False))
        if self._refused_while_pending(lambda: self.queue.commit_diff(blocks, partitions)):
            return
        self._commit_both(blocks, partitions, "commit_diff")
        if bounce:
            self.reopen()

    @rule(
        specs=st.lists(diffs, min_size=1, max_size=4),
        mc_reads=st.lists(
            st.tuples(shard_names, st.sampled_from(READ_MODES), st.integers(0, 6)),
            unique_by=lambda e: e[0],
            min_size=1,
            max_size=5,
        ).map(tuple),
        partitions=partition_sets,
        gc_after=st.booleans(),
    )
    def collate_round(
        self,
        specs: list[Diff],
        mc_reads: tuple[tuple[str, str, int], ...],
        partitions: list[int],
        gc_after: bool,
    ) -> None:
        """The happy path over the shards ``specs`` name: their next diffs, the next
        masterchain diff reading ``mc_reads``, a commit naming every shard's newest
        diff, then maybe a GC pass."""
        if self.pending is not None:
            return
        specs = [replace(s, msgs=tuple(replace(m, lt_mode="next") for m in s.msgs)) for s in specs]
        names = []
        for spec in specs:
            if spec.shard == "mc" or spec.shard in names:
                continue
            names.append(spec.shard)
            self.apply_diff(replace(spec, seqno_mode="next", zone="uncommitted"), False)
        mc_spec = replace(
            specs[0], shard="mc", seqno_mode="next", zone="uncommitted", processed_to=mc_reads
        )
        self.apply_diff(mc_spec, False)
        mc_seqno = self._mc_seqno("latest", 0)
        blocks = [TopBlock(BlockId(MC, mc_seqno), mc_seqno)]
        blocks += [self._top(Top(n, "latest", 0, True, False), mc_seqno) for n in names]
        self._commit_both(blocks, partitions, "collate_round commit")
        if gc_after:
            self.gc()

    def _commit_both(self, blocks: list[TopBlock], partitions: list[int], label: str) -> None:
        """Commit ``blocks`` on the model and the queue; both must give the same outcome."""
        expected = outcome(lambda: self.model.commit(blocks, partitions))
        actual = outcome(lambda: self.queue.commit_diff(blocks, partitions))
        assert actual == expected, f"commit_diff {blocks}: queue {actual}, model {expected}"
        note(label, expected)

    @rule(partitions=partition_sets, top_shards=shard_sets)
    def clear(self, partitions: list[int], top_shards: list[str]) -> None:
        shards = [SHARDS[s] for s in top_shards]
        if self._refused_while_pending(
            lambda: self.queue.clear_uncommitted_state(partitions, shards)
        ):
            return
        self.model.clear(partitions, shards)
        self.queue.clear_uncommitted_state(partitions, shards)

    @rule(
        mode=st.sampled_from(("equal", "ahead", "behind", "other_hash")),
        pick=st.integers(0, 5),
        top_shards=shard_sets,
        partitions=partition_sets,
    )
    def startup(self, mode: str, pick: int, top_shards: list[str], partitions: list[int]) -> None:
        committed = self.model.last_mc_block
        if committed is None:
            block = BlockId(MC, pick)
        else:
            seqno, root = committed.seqno, committed.root_hash
            if mode == "ahead":
                seqno += 1 + pick % 2
            elif mode == "behind" and seqno > 0:
                seqno -= 1
            elif mode == "other_hash":
                root = bytes([7]) * 32
            block = BlockId(MC, seqno, root)
        shards = [SHARDS[s] for s in top_shards]
        if self._refused_while_pending(
            lambda: self.queue.startup(block, shards, partitions),
            lambda: _startup_check(self.model, block),
        ):
            return
        expected = outcome(lambda: self.model.startup(block, shards, partitions))
        actual = outcome(lambda: self.queue.startup(block, shards, partitions))
        assert actual == expected, f"startup {block}: queue {actual}, model {expected}"

    @rule()
    def reopen(self) -> None:
        """Close and open again. A diff still pending is orphaned: its write must fail
        and write nothing (the model discards it)."""
        pending = self.pending
        self.pending = None
        self.queue.close()
        if pending is not None:
            with pytest.raises(QueueClosedError):
                pending[0].write()
        self.queue = self._open()

    @rule()
    def gc(self) -> None:
        if self._refused_while_pending(self.queue.run_gc):
            return
        ran = self.model.run_gc()
        assert self.queue.run_gc() == ran
        note("run_gc", ("ok", bool(ran)))

    @precondition(lambda self: self.pending is None)
    @rule()
    def tick(self) -> None:
        worker = self.queue.gc_worker
        assert worker is not None
        before = self.queue.metrics.counter("gc_ranges_deleted")
        assert worker.tick(timeout=30)
        assert self.queue.metrics.counter("gc_ranges_deleted") - before == self.model.run_gc()

    # -- rules: import ------------------------------------------------------------------------

    def build_state(self, spec: Import) -> tuple[SynthState, BlockId, tuple[bytes, int] | None]:
        shard = SHARDS[spec.shard]
        last = self.model.get_last_applied_seqno(shard) or 0
        chain = self.chains.get(shard, []) if spec.chain == "extend" else []
        kept = chain[: spec.keep]
        floor = kept[0].seqno if kept else 0
        if spec.seqno_mode == "above":
            first = max(last, floor) + 1 + spec.pick % 2
        elif spec.seqno_mode == "at_last":
            first = max(last, floor + 1, 1)
        else:
            first = max(floor + 1, 1 + spec.pick % 3)
        newest = self._newest_diff(shard)
        if spec.lt_mode == "overlap" and newest is not None and newest.min_message.lt < 1 << 62:
            lt = newest.min_message.lt
        else:
            self.clock += 10
            lt = self.clock
        prev = kept[0].hash if kept else self.fresh_hash()
        built: list[SynthDiff] = []
        for i, count in enumerate(spec.counts):
            seqno = first + i
            lts = [lt + j for j in range(count)]
            dsts = [ACCOUNTS[(seqno + j) % len(ACCOUNTS)] for j in range(count)]
            span = (lt, lt + max(count, 1))
            lt += max(count, 1) + 1
            self.clock = max(self.clock, lt)
            routed: dict[int, set[Address]] = {}
            for idx, p in spec.routed:  # an account may be listed in several partitions
                routed.setdefault(p, set()).add(ACCOUNTS[idx])
            router_dst = tuple((p, tuple(sorted(a))) for p, a in sorted(routed.items()))
            processed_to = {
                SHARDS[n]: self._read_key(SHARDS[n], mo, b) for n, mo, b in spec.processed_to
            }
            d = synth_diff(
                shard,
                seqno,
                prev,
                lts,
                dsts,
                span=span,
                processed_to=tuple(processed_to.items()),
                router_dst=router_dst,
            )
            prev = d.hash
            built.append(d)
        state = SynthState(shard, [*built[::-1], *kept])
        block_id = state.block_id
        if spec.block == "bad_seqno":
            block_id = BlockId(shard, state.seqno + 1)
        top_update: tuple[bytes, int] | None = state.top_update
        if spec.top_update == "none":
            top_update = None
        elif spec.top_update == "bad_hash":
            top_update = (self.fresh_hash(), len(state.diffs))
        elif spec.top_update == "bad_len":
            top_update = (state.diffs[0].hash, len(state.diffs) + 1)
        return state, block_id, top_update

    @rule(spec=imports, bounce=rarely)
    def import_state(self, spec: Import, bounce: bool) -> None:
        state, block_id, top_update = self.build_state(spec)
        data = state_bytes(state)

        def real() -> int:
            return self.queue.import_state(io.BytesIO(data), block_id, top_update).written_diffs

        if self._refused_while_pending(real):
            return
        new_spans = [
            (d.seqno, d.tl.min_message, d.tl.max_message)
            for d in state.diffs
            if (state.shard, d.seqno) not in self.model.diffs
        ]
        floor_before = self.model.copy_floor(state.shard)
        expected = outcome(lambda: model_import(self.model, state, block_id, top_update))
        actual = outcome(real)
        assert actual == expected, f"import {block_id}: queue {actual}, model {expected}"
        note("import_state", expected)
        if actual[0] == "ok":
            self.model.note_import(state.shard, floor_before, new_spans)
            self.chains[state.shard] = state.diffs
        if bounce:
            self.reopen()

    # -- rules: reads -------------------------------------------------------------------------

    def _bound(self, shard: ShardIdent, mode: str, pick: int) -> QueueKey:
        pointer = self.model.pointers.get(shard)
        if mode == "max":
            return QueueKey.MAX
        if mode in ("pointer", "pointer_next") and pointer is not None:
            return pointer.key if mode == "pointer" else pointer.key.next_value()
        if mode in ("diff_max", "diff_min", "message"):
            return self._read_key(shard, mode, pick)
        return QueueKey.MIN

    @rule(
        partition=st.sampled_from(PARTITIONS),
        ranges=st.lists(
            st.tuples(shard_names, bound_modes, bound_modes), unique_by=lambda r: r[0], max_size=4
        ),
        for_shard=shard_names,
        stop_after=st.none() | st.integers(0, 4),
    )
    def iterate(
        self,
        partition: int,
        ranges: list[tuple[str, tuple[str, int], tuple[str, int]]],
        for_shard: str,
        stop_after: int | None,
    ) -> None:
        shard_ranges = [
            QueueShardRange(SHARDS[n], self._bound(SHARDS[n], *lo), self._bound(SHARDS[n], *hi))
            for n, lo, hi in ranges
        ]
        target = SHARDS[for_shard]
        want_it = self.model.iterator(partition, shard_ranges, target)
        with self.queue.iterator(partition, shard_ranges, target) as it:
            if stop_after is not None:
                got = [m for _, m in zip(range(stop_after), it, strict=False)]
                want = [m for _, m in zip(range(stop_after), want_it, strict=False)]
                assert got == want
                assert it.current_position() == want_it.current_position()
            assert list(it) == list(want_it)
            assert it.current_position() == want_it.current_position()

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def pointers_and_bounds(self) -> None:
        q, m = self.queue, self.model
        assert q.get_commit_pointers() == m.get_commit_pointers()
        assert q.get_last_committed_mc_block_id() == m.get_last_committed_mc_block_id()
        assert q.commit_record() == m.commit_record
        requested, executed = q.gc_bounds()
        assert requested == m.gc_requested
        assert executed == m.gc_executed

    @invariant()
    def integrity_checks_pass(self) -> None:
        """The open-time cross-checks (what ``imq verify`` checks of the pointers) find
        nothing on a queue the model agrees with: a false alarm is a bug too."""
        assert state_problems(self.queue._store) == []

    @invariant()
    def diff_infos(self) -> None:
        q, m = self.queue, self.model
        probes = set(m.diffs)
        for shard in SHARDS.values():
            last = m.get_last_applied_seqno(shard)
            assert q.get_last_applied_seqno(shard) == last, shard
            probes |= {(shard, 0), (shard, (last or 0) + 1)}
        for shard, seqno in sorted(probes):
            for zone in DiffZone:
                got = q.get_diff_info(shard, seqno, zone)
                assert got == m.get_diff_info(shard, seqno, zone), (shard, seqno, zone)
            block = BlockIdShort(shard, seqno)
            assert q.is_diff_exists(block) == m.is_diff_exists(block)

    def _edges(self, shard: ShardIdent) -> set[QueueKey]:
        keys = {QueueKey.MIN, QueueKey.MAX}
        pointer = self.model.pointers.get(shard)
        if pointer is not None:
            keys |= {pointer.key, pointer.key.next_value()}
        for (s, _), d in self.model.diffs.items():
            if s == shard:
                keys |= {d.info.min_message, d.info.max_message, d.info.max_message.next_value()}
                under = below(d.info.max_message)
                if under is not None:
                    keys.add(under)
        return keys

    @invariant()
    def tails_and_statistics(self) -> None:
        q, m = self.queue, self.model
        for shard in SHARDS.values():
            edges = sorted(self._edges(shard))
            for key in edges:
                assert q.get_diffs_tail_len(shard, key) == m.get_diffs_tail_len(shard, key), (
                    shard,
                    key,
                )
            ranges = [QueueShardRange(shard, QueueKey.MIN, QueueKey.MAX)]
            if len(edges) > 2:
                # ranges starting or ending exactly on a diff's bounds
                ranges += [
                    QueueShardRange(shard, a, b) for a, b in zip(edges, edges[2:], strict=False)
                ]
                ranges.append(QueueShardRange(shard, edges[1], edges[1]))
            for r in ranges:
                got = q.load_separated_diff_statistics(PARTITIONS, r)
                assert got == m.load_separated_diff_statistics(PARTITIONS, r), r
            for partition in PARTITIONS:
                r = ranges[-1]
                assert q.load_diff_statistics(partition, r) == m.load_diff_statistics(
                    partition, r
                ), (r, partition)

    @invariant()
    def messages(self) -> None:
        ranges = [QueueShardRange(s, QueueKey.MIN, QueueKey.MAX) for s in SHARDS.values()]
        stored = {}
        for partition in PARTITIONS:
            for target in TARGETS:
                with self.queue.iterator(partition, ranges, target) as it:
                    for source, message in it:
                        stored[(partition, source, message.key)] = message
        # A message keyed QueueKey.MAX is stored but no half-open range reaches it.
        want = {k: m for k, m in self.model.messages.items() if k[2] < QueueKey.MAX}
        assert stored == want


def test_adversarial_machine() -> None:
    """About 30 seconds: 100 programs of 40 steps (more under a bigger profile)."""
    run_state_machine_as_test(
        AdversarialMachine,
        settings=settings(
            settings.default,
            max_examples=max(settings.default.max_examples, 100),
            stateful_step_count=max(settings.default.stateful_step_count, 40),
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


@pytest.mark.slow
def test_adversarial_machine_soak() -> None:
    run_state_machine_as_test(
        AdversarialMachine,
        settings=settings(
            settings.get_profile("thorough"), deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )


# ---------------------------------------------------------------------------------------------
# Regressions: shrunk programs, replayed step by step


def replay(steps: Callable[[AdversarialMachine], None]) -> None:
    machine = AdversarialMachine()
    try:
        steps(machine)
        machine.pointers_and_bounds()
        machine.diff_infos()
        machine.tails_and_statistics()
        machine.messages()
    finally:
        machine.teardown()


def _h(i: int) -> bytes:
    return bytes([i]) * 32


def test_pointer_collected_by_gc_then_bound_lowered_is_not_an_integrity_problem(
    tmp_path: Path,
) -> None:
    """Found by the machine (the open-time ``integrity_check_failed`` warning) and shrunk
    by hand. GC collects the base shard's committed diff (bound max_for_lt(300)); the next
    commit's record names only the masterchain, whose processed_to of base is MIN, so
    the requested bound of base moves back to MIN (allowed, §7.4) while the executed one
    stays at max_for_lt(300). Nothing is wrong with this queue: the model agrees with it
    on every read, but both integrity checks flag the base pointer."""
    from imq import verify
    from imq.observability import capture_events

    config = replace(QueueConfig.testing(), gc_enabled=False)
    src, dst = Address(0, bytes(32)), Address(0, b"\x80" + bytes(31))
    path = tmp_path / "db"
    with Queue.open(path, config) as q:
        q.apply_diff(
            QueueDiff([Message(QueueKey(200, _h(1)), src, dst)]), BlockIdShort(BASE, 1), _h(2)
        )
        read_base = {BASE: QueueKey.max_for_lt(300)}
        q.apply_diff(QueueDiff([], read_base, start_lt=300, end_lt=301), BlockIdShort(MC, 1), _h(3))
        assert q.commit_diff([TopBlock(BlockId(MC, 1), 1), TopBlock(BlockId(BASE, 1), 1)])
        assert q.run_gc() == 2
        assert not q.is_diff_exists(BlockIdShort(BASE, 1))
        read_none = {BASE: QueueKey.MIN}
        q.apply_diff(QueueDiff([], read_none, start_lt=400, end_lt=401), BlockIdShort(MC, 2), _h(4))
        assert q.commit_diff([TopBlock(BlockId(MC, 2), 2)])
        requested, executed = q.gc_bounds()
        assert requested[(0, BASE)] == QueueKey.MIN
        assert executed[(0, BASE)] == QueueKey.max_for_lt(300)
    with capture_events() as events, Queue.open(path, config):
        pass
    warned = [e["problem"] for e in events if e.get("event") == "integrity_check_failed"]
    report = verify.verify(path)
    assert (warned, report.problems) == ([], [])
