"""The merge iterator (SEMANTICS §5.2, §11): one partition, several source shards.

One RocksDB cursor per source shard, all opened under one snapshot. A heap holds at
most one pending message per shard, ordered by the raw 40-byte queue key (byte order
equals key order, D1). A message whose destination is not in ``for_shard`` is skipped
by reading only its fixed destination header (D2); its key still counts as consumed
for ``current_position()``, which records the last key taken from each shard.

Speed note: ``_runs`` is the per-message hot path and trades some clarity for speed
(``benchmarks/bench_core.py`` measures it against raw rocksdict):

- ``iter(queue_iterator)`` hands out the merge generator itself, so a ``for`` loop pays
  no Python-level ``__next__`` per message;
- it merges on raw key bytes (no key function) and *gallops*: while the shard it just
  read from stays below every other shard's pending key, it yields without touching
  the heap, which is the common case of blocks covering disjoint lt ranges;
- the destination test, key decoding and value-type construction are inlined, and
  decoded addresses are cached per iterator;
- closing swaps the cursors for ones that raise, instead of checking a flag per row.
"""

from __future__ import annotations

import contextlib
import operator
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from heapq import heapify, heappop, heapreplace
from itertools import chain
from types import TracebackType
from typing import Any, NoReturn

from imq.errors import CorruptDataError, QueueClosedError
from imq.storage import SnapshotProtocol as Snapshot
from imq.storage import codec
from imq.types import (
    Address,
    IteratedMessage,
    Message,
    QueueKey,
    QueueShardRange,
    ShardIdent,
)

__all__ = ["QueueIterator"]

_QK = codec.MESSAGE_PREFIX_LEN  # where the queue key starts in a message key
_LT_END = _QK + 8
_KEY_LEN = codec.MESSAGE_KEY_LEN
_HEADER = codec.MESSAGE_VALUE_HEADER_LEN
_ADDR = codec.ADDRESS_LEN
_ADDRESS_CACHE_LIMIT = 1 << 16
_tnew = tuple.__new__


class _Closed:
    """What the cursors become when the queue closes: every pull raises."""

    def __iter__(self) -> _Closed:
        return self

    def __next__(self) -> NoReturn:
        raise QueueClosedError("the queue was closed while this iterator was open")


def _address(cache: dict[bytes, Address], raw: bytes) -> Address:
    if len(cache) >= _ADDRESS_CACHE_LIMIT:
        cache.clear()
    found: Address = _tnew(Address, (raw[0] - 128, raw[1:]))
    cache[raw] = found
    return found


class QueueIterator:
    """Messages of one partition from several source shards, merged by key.

    A Python iterator of :class:`IteratedMessage`; also a context manager.
    """

    def __init__(
        self,
        snap: Snapshot,
        ranges: Sequence[QueueShardRange],
        for_shard: ShardIdent,
        on_done: Callable[[int, int], None] | None = None,
    ) -> None:
        self._snap = snap
        self._shards = [r.shard for r in ranges]
        self._positions: list[bytes | None] = [None] * len(ranges)
        self._for_shard = for_shard
        self._on_done = on_done
        self._sources: list[Iterator[Any]] = [c.items for c in snap.cursors]
        self._closed_by_queue = False
        self._run: tuple[int, list[bytes], Iterator[IteratedMessage]] | None = None
        # Runs are handed out as list iterators and chained in C, so a message passes to
        # the consumer without resuming a Python frame.
        self._producer = self._runs()
        self._merged: Iterator[IteratedMessage] = chain.from_iterable(self._producer)

    # -- public -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[IteratedMessage]:
        if self._closed_by_queue:
            return _Closed()
        return self._merged

    def __next__(self) -> IteratedMessage:
        if self._closed_by_queue:
            raise QueueClosedError("the queue was closed while this iterator was open")
        return next(self._merged)

    def current_position(self) -> dict[ShardIdent, QueueKey]:
        """Last key consumed per source shard, skipped messages included."""
        positions = list(self._positions)
        if self._run is not None:  # inside a decoded run: count what the consumer took
            idx, keys, run = self._run
            taken = len(keys) - operator.length_hint(run)
            if taken > 0:
                positions[idx] = keys[taken - 1]
        return {
            shard: codec.decode_key(raw[_QK:])
            for shard, raw in zip(self._shards, positions, strict=True)
            if raw is not None
        }

    def close(self) -> None:
        """Release the cursors; the iterator is then exhausted."""
        self._merged = iter(())
        # ValueError: another thread is producing a run right now; dropping the sources
        # below still ends it at its next pull.
        with contextlib.suppress(ValueError):
            self._producer.close()  # type: ignore[attr-defined]
        self._release(iter(()))

    def close_for_queue(self) -> None:
        """Called when the queue closes: later ``next()`` calls raise ``QueueClosedError``."""
        self._closed_by_queue = True
        self._release(_Closed())

    def _release(self, replacement: Iterator[Any]) -> None:
        # The merge reads ``self._sources[idx]`` afresh after every yield, so swapping the
        # entries drops the RocksDB iterators and decides what its next pull does.
        for idx in range(len(self._sources)):
            self._sources[idx] = replacement
        self._snap.close()

    def __enter__(self) -> QueueIterator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the merge ----------------------------------------------------------------------------

    def _runs(self) -> Iterator[Iterator[IteratedMessage]]:  # noqa: PLR0915 - one hot loop
        for_shard = self._for_shard
        wc_byte = codec.workchain_byte(for_shard.workchain)
        if wc_byte is None:  # no std address lives in this workchain: skip everything
            wc_byte = -1
        full = for_shard.is_full
        shift = 64 - for_shard.prefix_len
        want = for_shard.prefix >> shift
        from_bytes = int.from_bytes
        positions = self._positions
        shards = self._shards
        sources = self._sources
        cache: dict[bytes, Address] = {}
        yielded = skipped = 0
        heap: list[tuple[bytes, int, bytes, bytes]] = []
        k = b""
        try:
            for idx in range(len(sources)):
                for k, v in sources[idx]:
                    if v[0] == wc_byte and (full or from_bytes(v[1:9], "big") >> shift == want):
                        heap.append((k[_QK:], idx, k, v))
                        break
                    positions[idx] = k
                    skipped += 1
            heapify(heap)
            while heap:
                # A run: this shard's accepted rows below every other shard's pending key.
                _qk, idx, k, v = heap[0]
                n = len(heap)
                bound = None if n == 1 else heap[1][0] if n == 2 else min(heap[1][0], heap[2][0])
                keys = [k]
                values = [v]
                trailing_skip = None
                pending = None
                for k, v in sources[idx]:
                    if v[0] == wc_byte and (full or from_bytes(v[1:9], "big") >> shift == want):
                        if len(keys) == _RUN or (bound is not None and k[_QK:] >= bound):
                            pending = (k, v)
                            break
                        keys.append(k)
                        values.append(v)
                        trailing_skip = None
                    else:
                        trailing_skip = k
                        skipped += 1
                batch = _decode_run(keys, values, shards[idx], cache)
                run = iter(batch)
                self._run = (idx, keys, run)
                yield run
                # The consumer asked for the next message: the run is consumed, and its
                # trailing skips count as consumed now (as the original records them).
                self._run = None
                yielded += len(batch)
                positions[idx] = keys[-1] if trailing_skip is None else trailing_skip
                if pending is None:
                    heappop(heap)
                else:
                    k, v = pending
                    heapreplace(heap, (k[_QK:], idx, k, v))
        except IndexError:  # v[0] of an empty value: the row at key k (a 3.11 try is free)
            raise CorruptDataError("messages", k, "empty message value") from None
        finally:
            self._run = None
            if self._on_done is not None:
                on_done, self._on_done = self._on_done, None
                on_done(yielded, skipped)


_RUN = 64  # rows decoded at once; best of 4..2048 measured (larger runs lose to GC and caches)
_unpack_key = struct.Struct(">14xQ32s").unpack


def _decode(
    keys: list[bytes], values: list[bytes], shard: ShardIdent, cache: dict[bytes, Address]
) -> list[IteratedMessage]:
    """Build the messages of a run in one comprehension (the per-message hot path)."""
    if min(map(len, values)) < _HEADER:
        _corrupt(keys, values)
    get = cache.get
    try:
        return [
            _tnew(
                IteratedMessage,
                (
                    shard,
                    _tnew(
                        Message,
                        (
                            _tnew(QueueKey, _unpack_key(k)),
                            get(src := v[_ADDR:_HEADER]) or _address(cache, src),
                            get(dst := v[:_ADDR]) or _address(cache, dst),
                            v[_HEADER:],
                        ),
                    ),
                ),
            )
            for k, v in zip(keys, values, strict=True)
        ]
    except struct.error:  # a key of the wrong length
        _corrupt(keys, values)


def _compiled_decoder() -> Callable[..., list[IteratedMessage]] | None:
    """The C decode of ``imq._speedups`` when it was built (and not disabled with
    ``IMQ_PURE_PYTHON=1``); it returns exactly what :func:`_decode` returns."""
    if os.environ.get("IMQ_PURE_PYTHON"):
        return None
    try:
        from imq import _speedups  # noqa: PLC0415 -- optional, built only with a compiler
    except ImportError:
        return None
    _speedups.init(IteratedMessage, Message, QueueKey, Address)
    decode_run = _speedups.decode_run

    def decode(
        keys: list[bytes], values: list[bytes], shard: ShardIdent, _cache: dict[bytes, Address]
    ) -> list[IteratedMessage]:
        try:
            return decode_run(keys, values, shard)
        except (ValueError, TypeError):
            _corrupt(keys, values)

    return decode


def _corrupt(keys: list[bytes], values: list[bytes]) -> NoReturn:
    for k, v in zip(keys, values, strict=True):
        if len(k) != _KEY_LEN or len(v) < _HEADER:
            raise CorruptDataError(
                "messages", k, f"row too short ({len(k)} B key, {len(v)} B value)"
            )
    raise CorruptDataError("messages", keys[0], "undecodable message rows")


_decode_run: Callable[..., list[IteratedMessage]] = _compiled_decoder() or _decode
COMPILED = _decode_run is not _decode
"""True when the compiled decode is in use (reported by the benchmarks)."""
