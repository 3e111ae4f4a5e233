"""Factories for the integration tests: shards, accounts inside a shard, messages with
increasing lt, diffs, statistics, blocks and top blocks, plus helpers that dump the
stored state of a real queue so a test can assert on exactly what an operation wrote.

Everything is deterministic: accounts and hashes come from SHA-256 of a label, so two
queues fed the same calls hold byte-identical databases.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from imq import (
    Address,
    BlockId,
    BlockIdShort,
    DiffStatistics,
    DiffZone,
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
from imq.storage import Table, codec

FULL_PREFIX = 0x8000_0000_0000_0000
U64_MASK = (1 << 64) - 1
MC = ShardIdent.MASTERCHAIN
BASE = ShardIdent.BASECHAIN


def digest(*parts: object) -> bytes:
    """32 deterministic bytes derived from ``parts``."""
    return hashlib.sha256(repr(parts).encode()).digest()


def diff_hash(label: object) -> bytes:
    """A 32-byte diff hash; different labels give different hashes."""
    return digest("diff-hash", label)


# -- shards and accounts ----------------------------------------------------------------------


def split_shard(workchain: int, prefix_len: int, index: int) -> ShardIdent:
    """The ``index``-th of the ``2**prefix_len`` shards of ``workchain`` (in prefix order)."""
    if prefix_len == 0:
        return ShardIdent.full(workchain)
    if not 0 <= index < 1 << prefix_len:
        raise ValueError(f"index {index} out of range for prefix_len {prefix_len}")
    prefix = (index << (64 - prefix_len)) | (1 << (63 - prefix_len))
    return ShardIdent(workchain, prefix)


def quarter_shards(workchain: int = 0) -> list[ShardIdent]:
    """``wc:2000…``, ``wc:6000…``, ``wc:a000…``, ``wc:e000…``."""
    return [split_shard(workchain, 2, i) for i in range(4)]


def account_in(shard: ShardIdent, n: int = 0) -> bytes:
    """A 32-byte account inside ``shard`` (any account of its workchain for a full shard)."""
    raw = digest("account", shard.workchain, shard.prefix, n)
    bits = shard.prefix_len
    free = int.from_bytes(raw[:8], "big")
    if bits:
        keep = (U64_MASK << (64 - bits)) & U64_MASK
        free = (shard.prefix & keep) | (free & ~keep & U64_MASK)
    return free.to_bytes(8, "big") + raw[8:]


def address_in(shard: ShardIdent, n: int = 0) -> Address:
    address = Address(shard.workchain, account_in(shard, n))
    assert shard.contains(address)
    return address


# -- keys and messages ------------------------------------------------------------------------


def key(lt: int, salt: object = 0) -> QueueKey:
    return QueueKey(lt, digest("key", lt, salt))


class Clock:
    """Hands out strictly increasing lts (thread-safe), shared by every shard of a test."""

    def __init__(self, start: int = 1_000, step: int = 10) -> None:
        self._counter = itertools.count(start, step)
        self._lock = threading.Lock()

    def next_lt(self) -> int:
        with self._lock:
            return next(self._counter)

    def next_key(self) -> QueueKey:
        return key(self.next_lt())


def message(key_: QueueKey, src: Address, dst: Address, body: bytes | None = None) -> Message:
    return Message(key_, src, dst, body if body is not None else b"body-%d" % key_.lt)


def messages(
    clock: Clock,
    src_shard: ShardIdent,
    dsts: Sequence[Address] | int,
    *,
    body: bytes | None = None,
) -> list[Message]:
    """One message per destination (or ``dsts`` messages to one account of the source
    shard), sources inside ``src_shard``, keys from ``clock``."""
    if isinstance(dsts, int):
        dsts = [address_in(src_shard, 1000)] * dsts
    out = []
    for i, dst in enumerate(dsts):
        src = address_in(src_shard, i % 3)
        out.append(message(clock.next_key(), src, dst, body))
    return out


def make_diff(
    msgs: Iterable[Message] = (),
    processed_to: Mapping[ShardIdent, QueueKey] | None = None,
    router: PartitionRouter | None = None,
) -> QueueDiff:
    return QueueDiff(msgs, processed_to or {}, router)


def stats(
    shard: ShardIdent,
    min_message: QueueKey,
    max_message: QueueKey,
    partitions: Mapping[int, Mapping[Address, int]],
) -> DiffStatistics:
    return DiffStatistics(shard, min_message, max_message, partitions)


def derived_stats(diff: QueueDiff, shard: ShardIdent) -> DiffStatistics:
    """What ``prepare_diff(statistics=None)`` uses for a diff with messages, or for an
    empty diff without a span when its shard has no pointer and no earlier diff."""
    return DiffStatistics.from_diff(
        diff, shard, diff.min_message or QueueKey.MIN, diff.max_message or QueueKey.MIN
    )


# -- blocks -----------------------------------------------------------------------------------


def block(shard: ShardIdent, seqno: int) -> BlockIdShort:
    return BlockIdShort(shard, seqno)


def block_id(shard: ShardIdent, seqno: int, tag: object = 0) -> BlockId:
    return BlockId(
        shard, seqno, digest("root", shard, seqno, tag), digest("file", shard, seqno, tag)
    )


def top(
    shard: ShardIdent,
    seqno: int,
    ref_by_mc_seqno: int | None = None,
    updated: bool = True,
    tag: object = 0,
) -> TopBlock:
    """A top block; ``ref_by_mc_seqno`` defaults to ``seqno`` (as for the mc block itself)."""
    return TopBlock(
        block_id(shard, seqno, tag), seqno if ref_by_mc_seqno is None else ref_by_mc_seqno, updated
    )


def full_range(shard: ShardIdent) -> QueueShardRange:
    return QueueShardRange(shard, QueueKey.MIN, QueueKey.MAX)


# -- queues -----------------------------------------------------------------------------------


def quiet_config(**overrides: Any) -> QueueConfig:
    """``QueueConfig.testing()`` with a GC interval long enough that no background GC tick
    (other than the one at open) can change the state a test asserts on."""
    return replace(QueueConfig.testing(), **{"gc_interval": 3600.0, **overrides})


def open_queue(path: Path, **kwargs: Any) -> Queue:
    return Queue.open(path, quiet_config(), **kwargs)


@dataclass(frozen=True)
class Applied:
    """A diff a test applied, with everything needed to re-apply or commit it."""

    block: BlockIdShort
    diff: QueueDiff
    hash: bytes

    @property
    def shard(self) -> ShardIdent:
        return self.block.shard

    @property
    def seqno(self) -> int:
        return self.block.seqno

    @property
    def messages(self) -> tuple[Message, ...]:
        return self.diff.messages

    @property
    def max_message(self) -> QueueKey:
        return self.diff.max_message or QueueKey.MIN

    def top(self, ref_by_mc_seqno: int | None = None, updated: bool = True) -> TopBlock:
        return top(self.shard, self.seqno, ref_by_mc_seqno, updated)

    def iterated(self) -> list[IteratedMessage]:
        return [IteratedMessage(self.shard, m) for m in self.messages]


class Chain:
    """Builds and applies diffs with sensible defaults and remembers the applied ones.

    A built diff takes the next seqno of its shard whether or not it is applied."""

    def __init__(self, queue: Queue, clock: Clock | None = None) -> None:
        self.queue = queue
        self.clock = clock or Clock()
        self.applied: list[Applied] = []
        self._seqnos: dict[ShardIdent, int] = {}

    def build(
        self,
        shard: ShardIdent,
        count: int | Sequence[Address] = 3,
        *,
        seqno: int | None = None,
        processed_to: Mapping[ShardIdent, QueueKey] | None = None,
        router: PartitionRouter | None = None,
        body: bytes | None = None,
        hash_label: object = None,
    ) -> Applied:
        if seqno is None:
            seqno = self._seqnos.get(shard, 0) + 1
        self._seqnos[shard] = max(self._seqnos.get(shard, 0), seqno)  # built = taken
        msgs = messages(self.clock, shard, count, body=body) if count else []
        diff = make_diff(msgs, processed_to, router)
        label = hash_label if hash_label is not None else (shard, seqno)
        return Applied(block(shard, seqno), diff, diff_hash(label))

    def apply(
        self,
        shard: ShardIdent,
        count: int | Sequence[Address] = 3,
        *,
        statistics: DiffStatistics | None = None,
        check_sequence: DiffZone | None = None,
        **kwargs: Any,
    ) -> Applied:
        applied = self.build(shard, count, **kwargs)
        written = self.queue.apply_diff(
            applied.diff, applied.block, applied.hash, statistics, check_sequence
        )
        assert written, f"diff {applied.block} was not written"
        self.record(applied)
        return applied

    def record(self, applied: Applied) -> None:
        self.applied.append(applied)
        self._seqnos[applied.shard] = max(self._seqnos.get(applied.shard, 0), applied.seqno)

    def of(self, shard: ShardIdent) -> list[Applied]:
        return [a for a in self.applied if a.shard == shard]


# -- stored state -----------------------------------------------------------------------------


def dump(queue: Queue) -> dict[str, list[tuple[bytes, bytes]]]:
    """Every stored row of every table, in key order."""
    return {t.value: list(queue._store._tables[t].items()) for t in Table}


def rows(queue: Queue, table: Table) -> list[tuple[bytes, bytes]]:
    return list(queue._store._tables[table].items())


def shard_rows(queue: Queue, table: Table, shard: ShardIdent) -> list[tuple[bytes, bytes]]:
    """Rows of one source shard (messages keys start with the partition, others with the
    shard)."""
    sb = codec.shard_bytes(shard)
    start = 2 if table is Table.MESSAGES else 0
    return [(k, v) for k, v in rows(queue, table) if k[start : start + 12] == sb]


def message_keys(queue: Queue, partition: int, shard: ShardIdent) -> list[QueueKey]:
    """Keys of the stored messages of one (partition, source shard)."""
    prefix = codec.message_prefix(partition, shard)
    return [
        codec.decode_key(k[len(prefix) :])
        for k, _ in rows(queue, Table.MESSAGES)
        if k[:14] == prefix
    ]


def iterate_all(
    queue: Queue,
    shards: Sequence[ShardIdent],
    partition: int = 0,
    for_shard: ShardIdent = BASE,
) -> list[IteratedMessage]:
    with queue.iterator(partition, [full_range(s) for s in shards], for_shard) as it:
        return list(it)


def state(queue: Queue, shards: Sequence[ShardIdent]) -> dict[str, Any]:
    """The observable state through the public API, GC bounds and commit record included."""
    return {
        "pointers": queue.get_commit_pointers(),
        "last_mc": queue.get_last_committed_mc_block_id(),
        "last_applied": {s: queue.get_last_applied_seqno(s) for s in shards},
        "tails": {s: queue.get_diffs_tail_len(s, QueueKey.MIN) for s in shards},
        "gc_requested": dict(queue.gc_bounds()[0]),
        "commit_record": dict(queue.commit_record()),
    }


def damage_largest_table_file(db: Path) -> Path:
    """Flip 48 bytes a third of the way into the largest SST file of a closed database (a
    data block of its biggest table): the file's name."""
    sst = max(db.glob("*.sst"), key=lambda p: p.stat().st_size)
    data = bytearray(sst.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 48):
        data[i] ^= 0xFF
    sst.write_bytes(bytes(data))
    return sst


def pid_namespace_command() -> list[str] | None:
    """A command prefix that runs a command in a PID namespace of its own, with its own
    ``/proc`` (as a container beside the node's would see it), or None where this machine
    allows none: through a user namespace (no root needed where the kernel allows
    unprivileged ones), else, as root, directly."""
    base = ["unshare", "--pid", "--fork", "--mount-proc"]
    tries = [["unshare", "--user", "--map-root-user", *base[1:]]]
    if os.geteuid() == 0:
        tries.append(base)
    for command in tries:
        try:
            done = subprocess.run([*command, "true"], check=False, capture_output=True, timeout=30)
        except OSError:
            return None  # no unshare at all
        if done.returncode == 0:
            return command
    return None


FORK_WARNING = "ignore:This process .* is multi-threaded, use of fork:DeprecationWarning"
"""The filter of Python 3.12+'s warning on forking a process with threads, for the
tests whose fork is the point."""


def run_python(
    script: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with ``args`` in a fresh interpreter (this one's), its output as
    text; the exit status is the caller's to check."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
