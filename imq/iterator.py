"""The merge iterator (SEMANTICS §5.2, §11): one partition, several source shards.

One RocksDB cursor per source shard, all opened under one snapshot. A heap holds at
most one pending message per shard, ordered by the raw 40-byte queue key (byte order
equals key order, D1). A message whose destination is not in ``for_shard`` is skipped
by reading only its fixed destination header (D2); its key still counts as consumed
for ``current_position()``, which records the last key taken from each shard.

Speed note: ``_merge`` is the per-message hot path. It inlines the destination test,
merges on raw bytes (no key function), caches decoded addresses and builds the
tuple-based value types directly; see ``benchmarks/bench_core.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from heapq import heapify, heappop, heapreplace
from types import TracebackType
from typing import Any

from imq.errors import CorruptDataError, QueueClosedError
from imq.storage import Snapshot, codec
from imq.types import (
    Address,
    IteratedMessage,
    Message,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    _trusted_queue_key,
)

__all__ = ["QueueIterator"]

_QK = codec.MESSAGE_PREFIX_LEN  # where the queue key starts in a message key
_LT_END = _QK + 8
_HEADER = codec.MESSAGE_VALUE_HEADER_LEN
_ADDR = codec.ADDRESS_LEN
_ADDRESS_CACHE_LIMIT = 1 << 16
_tnew = tuple.__new__


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
        self._yielded = 0
        self._skipped = 0
        self._closed_by_queue = False
        self._merged: Iterator[IteratedMessage] | None = self._guarded()

    # -- public -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[IteratedMessage]:
        return self

    def __next__(self) -> IteratedMessage:
        if self._merged is None:
            if self._closed_by_queue:
                raise QueueClosedError("the queue was closed while this iterator was open")
            raise StopIteration
        return next(self._merged)

    def current_position(self) -> dict[ShardIdent, QueueKey]:
        """Last key consumed per source shard, skipped messages included."""
        return {
            shard: codec.decode_key(raw[_QK:])
            for shard, raw in zip(self._shards, self._positions, strict=True)
            if raw is not None
        }

    def close(self) -> None:
        merged, self._merged = self._merged, None
        if merged is not None:
            # ValueError: another thread is inside next() right now; its generator ends
            # when that step returns and the object is dropped.
            with contextlib.suppress(ValueError):
                merged.close()  # type: ignore[attr-defined]
        self._snap.close()

    def close_for_queue(self) -> None:
        """Called when the queue closes: later ``next()`` calls raise ``QueueClosedError``."""
        self._closed_by_queue = True
        self.close()

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

    def _guarded(self) -> Iterator[IteratedMessage]:
        try:
            yield from self._merge()
        finally:
            if self._on_done is not None:
                on_done, self._on_done = self._on_done, None
                on_done(self._yielded, self._skipped)
        if self._closed_by_queue:
            raise QueueClosedError("the queue was closed while this iterator was open")
        self._merged = None

    def _merge(self) -> Iterator[IteratedMessage]:
        wc_byte = codec.workchain_byte(self._for_shard.workchain)
        if wc_byte is None:  # no std address lives in this workchain: skip everything
            wc_byte = -1
        full = self._for_shard.is_full
        shift = 64 - self._for_shard.prefix_len
        want = self._for_shard.prefix >> shift
        from_bytes = int.from_bytes
        positions = self._positions
        shards = self._shards
        sources: list[Iterator[Any]] = [c.items for c in self._snap.cursors]
        addresses: dict[bytes, Address] = {}
        skipped = 0

        def address(raw: bytes) -> Address:
            found = addresses.get(raw)
            if found is None:
                if len(addresses) >= _ADDRESS_CACHE_LIMIT:
                    addresses.clear()
                found = addresses[raw] = _tnew(Address, (raw[0] - 128, raw[1:]))
            return found

        heap: list[tuple[bytes, int, bytes, bytes]] = []
        k = b""
        try:
            for idx, source in enumerate(sources):
                for k, v in source:
                    if v[0] == wc_byte and (full or from_bytes(v[1:9], "big") >> shift == want):
                        heap.append((k[_QK:], idx, k, v))
                        break
                    positions[idx] = k
                    skipped += 1
            heapify(heap)

            while heap:
                _qk, idx, k, v = heap[0]
                positions[idx] = k
                if len(v) < _HEADER or len(k) != codec.MESSAGE_KEY_LEN:
                    raise CorruptDataError(
                        "messages", k, f"row too short ({len(k)} B key, {len(v)} B value)"
                    )
                dst = addresses.get(v[:_ADDR]) or address(v[:_ADDR])
                src = addresses.get(v[_ADDR:_HEADER]) or address(v[_ADDR:_HEADER])
                key = _trusted_queue_key(from_bytes(k[_QK:_LT_END], "big"), k[_LT_END:])
                self._yielded += 1
                self._skipped = skipped
                yield _tnew(
                    IteratedMessage, (shards[idx], _tnew(Message, (key, src, dst, v[_HEADER:])))
                )
                for k, v in sources[idx]:  # advance this shard's cursor
                    if v[0] == wc_byte and (full or from_bytes(v[1:9], "big") >> shift == want):
                        heapreplace(heap, (k[_QK:], idx, k, v))
                        break
                    positions[idx] = k
                    skipped += 1
                else:
                    heappop(heap)
        except IndexError:  # v[0] of an empty value: the row at key k (a 3.11 try is free)
            raise CorruptDataError("messages", k, "empty message value") from None
        self._skipped = skipped
