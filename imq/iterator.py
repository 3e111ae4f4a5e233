"""The merge iterator (SEMANTICS §5.2, §11): one partition, several source shards.

One RocksDB cursor per source shard, all opened under one snapshot. A heap holds at
most one pending message per shard, ordered by the raw 40-byte queue key (byte order
equals key order, D1). A message whose destination is not in ``for_shard`` is skipped
by reading only its fixed destination header (D2); its key still counts as consumed
for ``current_position()``, which records the last key taken from each shard.

Speed note: the merge is the per-message hot path and trades some clarity for speed
(``benchmarks/bench_floor.py`` measures it against raw rocksdict and ``heapq.merge``):

- the iterator is an ``itertools.chain`` of *batches*, so ``next()`` runs in C and the
  Python merge code runs once per batch, not once per message; the first batch is
  ``_RUN_FIRST`` messages and each next one twice as long, up to ``_RUN``, so the first
  message comes after a few rows' decode and a long scan pays the Python per 256;
- compiled (``_merged``): one ``_speedups.merge_fill`` call merges every source into a
  batch, in C: the smallest pending row by its queue key bytes in place (no slicing), and
  while the same source's next row stays below the runner-up, its rows stream without a
  new comparison. So sources whose blocks interleave (a live network's shards share an lt
  range) cost what disjoint ones do; skips are recorded so that ``current_position()``
  inside a batch is exact;
- pure Python (``_runs``, also what ``pure_python()`` and ``IMQ_PURE_PYTHON=1`` select): a
  *run* is up to ``_RUN`` accepted rows of the heap's top shard that stay below every
  other shard's pending key, collected by ``_py_fill_run`` without touching the heap
  (fast on disjoint blocks, one Python merge step per few rows on interleaved ones);
- the destination test, key decoding and value-type construction happen in that call,
  at the message row's offsets from :mod:`imq.storage.codec`; decoded addresses may be
  shared (in C, the previous row's, which a row naming the same account reuses: a
  process-wide cache was slower; in Python, source addresses from a bounded cache per
  iterator, destinations built afresh: see ``_decode``); C builds the value
  types without ``tp_alloc`` and outside the cyclic GC, Python in one ``map``/``zip``
  pipeline with no bytecode per message;
- the merge pulls each cursor's bare rows (``Cursor.rows``) and runs the cursor's end
  check itself when they run out (``Cursor.finish``), so a damaged table still raises
  instead of ending the scan, with no bookkeeping per row;
- closing swaps the cursors for ones that raise, instead of checking a flag per row.

Profile of a 1,000,000-message single-shard scan (perf, compiled path): about a third
of the time is RocksDB and rocksdict's per-row wrapper (``valid``/``key``/``value``/
``next``), a sixth the kernel copying blocks from the page cache, and most of the rest
allocating and freeing the six objects of each message (``IteratedMessage``,
``Message``, ``QueueKey``, its lt and hash, the body) and rocksdict's three (the row
tuple, key and value); the merge and the decode logic are a few percent.
"""

from __future__ import annotations

import contextlib
import operator
import os
import struct
from collections.abc import Callable, Generator, Iterator, Sequence
from functools import partial
from heapq import heapify, heappop, heapreplace
from itertools import chain, islice, repeat, starmap
from types import TracebackType
from typing import Any, NoReturn, cast

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

__all__ = ["QueueIterator", "pure_python"]

# The message row's layout is codec's (see its "message row" comment): offsets only here.
_QK = codec.MESSAGE_PREFIX_LEN  # where the queue key starts in a message key
_LT_END = codec.MESSAGE_LT_END
_KEY_LEN = codec.MESSAGE_KEY_LEN
_HEADER = codec.MESSAGE_VALUE_HEADER_LEN  # where the body starts
_ADDR = codec.MESSAGE_SRC_AT  # dst is [0, _ADDR), src [_ADDR, _HEADER)
_ADDRESS_CACHE_LIMIT = 1 << 16
_tnew = tuple.__new__


class _Closed:
    """What the cursors become when the queue closes: every pull raises."""

    def __iter__(self) -> _Closed:
        return self

    def __next__(self) -> NoReturn:
        raise QueueClosedError("the queue was closed while this iterator was open")


class QueueIterator(chain[IteratedMessage]):
    """Messages of one partition from several source shards, merged by key.

    A Python iterator of :class:`IteratedMessage` (``iter(it) is it``); also a context
    manager. It is an ``itertools.chain`` of decoded runs, so ``next()`` runs in C: the
    Python merge code runs once per run, not once per message.
    """

    _snap: Snapshot
    _shards: list[ShardIdent]
    _positions: list[bytes | None]
    _for_shard: ShardIdent
    _on_done: Callable[[int, int], None] | None
    _sources: list[Iterator[Any]]
    _finish: list[Callable[[bytes | None], None]]
    _closed_by_queue: bool
    # The batch the consumer is inside: (source index, or -1 for a batch of the k-way
    # merge; the batch; its list iterator; the merge's skip records, see current_position)
    _run: tuple[int, list[IteratedMessage], Iterator[IteratedMessage], list[Any] | None] | None
    _producer: Generator[Iterator[IteratedMessage], None, None]

    def __new__(
        cls,
        snap: Snapshot,
        ranges: Sequence[QueueShardRange],
        for_shard: ShardIdent,
        on_done: Callable[[int, int], None] | None = None,
    ) -> QueueIterator:
        cell: list[QueueIterator] = []
        producer = _runs(cell) if _merge_fill is None else _merged(cell, _merge_fill)
        self = cast(QueueIterator, cls.from_iterable(producer))
        cell.append(self)
        self._snap = snap
        self._shards = [r.shard for r in ranges]
        self._positions = [None] * len(ranges)
        self._for_shard = for_shard
        self._on_done = on_done
        # The bare rows: the merge knows the last key it read from each source, so it
        # runs each cursor's end check itself when its rows run out (``finish``).
        self._sources = [c.rows for c in snap.cursors]
        self._finish = [c.finish for c in snap.cursors]
        self._closed_by_queue = False
        self._run = None
        self._producer = producer
        return self

    def __init__(
        self,
        snap: Snapshot,
        ranges: Sequence[QueueShardRange],
        for_shard: ShardIdent,
        on_done: Callable[[int, int], None] | None = None,
    ) -> None:
        pass  # everything is set in __new__ (itertools.chain takes no __init__ arguments)

    # -- public -------------------------------------------------------------------------------

    def current_position(self) -> dict[ShardIdent, QueueKey]:
        """Last key consumed per source shard, skipped messages included."""
        positions: list[bytes | QueueKey | None] = list(self._positions)
        if self._run is not None:  # inside a decoded run: count what the consumer took
            idx, batch, run, records = self._run
            taken = len(batch) - operator.length_hint(run)
            if records is None:  # one source's run
                if taken > 0:
                    positions[idx] = batch[taken - 1][1][0]
            else:  # a merged batch: replay its first `taken` messages and their skips
                index = {shard: i for i, shard in enumerate(self._shards)}
                pending = iter(records)
                record = next(pending, None)
                for j in range(taken):
                    while record is not None and record[0] <= j:
                        positions[record[1]] = record[2]
                        record = next(pending, None)
                    message = batch[j]
                    positions[index[message[0]]] = message[1][0]
        return {
            shard: raw if isinstance(raw, QueueKey) else codec.decode_key(raw[_QK:])
            for shard, raw in zip(self._shards, positions, strict=True)
            if raw is not None
        }

    def close(self) -> None:
        """Release the cursors; the iterator is then exhausted."""
        self._stop_run()
        # ValueError: another thread is producing a run right now; dropping the sources
        # below still ends it at its next pull.
        with contextlib.suppress(ValueError):
            self._producer.close()
        self._release(iter(()))

    def close_for_queue(self) -> None:
        """Called when the queue closes: later ``next()`` calls raise ``QueueClosedError``."""
        self._closed_by_queue = True
        self._stop_run()
        # ``next()`` must raise from now on, even on an exhausted chain: switch this object
        # to a subclass whose ``__next__`` raises (same layout, so the switch is allowed).
        self.__class__ = _ClosedQueueIterator
        self._release(_Closed())

    def _stop_run(self) -> None:
        # The chain holds the current run's list iterator: emptying the list ends it now.
        run = self._run
        if run is not None:
            run[1].clear()

    def _release(self, replacement: Iterator[Any]) -> None:
        # The merge reads ``self._sources[idx]`` afresh for every run, so swapping the
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


class _ClosedQueueIterator(QueueIterator):
    """What a :class:`QueueIterator` becomes when its queue closes."""

    def __next__(self) -> NoReturn:
        raise QueueClosedError("the queue was closed while this iterator was open")


# -- the merge --------------------------------------------------------------------------------


def _runs(  # noqa: PLR0915 - one hot loop
    cell: list[QueueIterator],
) -> Generator[Iterator[IteratedMessage], None, None]:
    """The pure-Python merge: yields list iterators of decoded runs, which the chain hands
    out.

    A run is one shard's accepted rows below every other shard's pending key (the common
    case when blocks cover disjoint lt ranges): while it lasts no heap is touched. The
    bound is compared with whole stored keys (the other shard's queue key under this
    shard's key prefix), so no key is sliced per row.
    """
    self = cell.pop()
    # The pure-Python decode caches addresses per iterator.
    fill_run: Callable[..., Any] = partial(_py_fill_run, _cache=_AddressCache())
    for_shard = self._for_shard
    wc_byte = codec.workchain_byte(for_shard.workchain)
    if wc_byte is None:  # no std address lives in this workchain: skip everything
        wc_byte = -1
    prefix_len = for_shard.prefix_len
    shift = 64 - prefix_len
    want = for_shard.prefix >> shift if prefix_len else 0
    from_bytes = int.from_bytes
    positions = self._positions
    shards = self._shards
    sources = self._sources
    finish = self._finish
    yielded = skipped = 0
    limit = min(_RUN_FIRST, _RUN)  # runs grow: the first message comes soon, later runs long
    heap: list[tuple[bytes, int, bytes, bytes]] = []
    prefixes: list[bytes] = []
    k = b""

    def first_accepted(idx: int) -> tuple[bytes, bytes] | None:
        nonlocal skipped, k
        for k, v in sources[idx]:
            if len(v) < _HEADER:  # corrupt, whether for this shard or not
                raise CorruptDataError("messages", k, _short_what(v))
            if v[0] == wc_byte and (not prefix_len or from_bytes(v[1:9], "big") >> shift == want):
                return k, v
            positions[idx] = k
            skipped += 1
        finish[idx](positions[idx])  # the rows ran out: raises unless at the range's end
        return None

    try:
        for idx in range(len(sources)):
            found = first_accepted(idx)
            prefixes.append(b"" if found is None else found[0][:_QK])
            if found is not None:
                heap.append((found[0][_QK:], idx, found[0], found[1]))
        heapify(heap)
        while heap:
            _qk, idx, k, v = heap[0]
            n = len(heap)
            other = None if n == 1 else heap[1][0] if n == 2 else min(heap[1][0], heap[2][0])
            bound = None if other is None else prefixes[idx] + other
            try:
                batch, last, pk, pv, n_skipped, more = fill_run(
                    sources[idx], k, v, bound, limit, wc_byte, prefix_len, want, shards[idx]
                )
            except (ValueError, TypeError) as exc:
                bad = exc.args[1] if len(exc.args) > 1 else k
                raise CorruptDataError("messages", bad, str(exc.args[0])) from None
            skipped += n_skipped
            limit = min(2 * limit, _RUN)
            if pk is None and not more:  # the rows ran out: raises unless at the range's end
                finish[idx](last)
            run = iter(batch)
            self._run = (idx, batch, run, None)
            yield run
            # The consumer asked for the next message: the run is consumed, and its
            # trailing skips count as consumed now (as the original records them).
            self._run = None
            yielded += len(batch)
            positions[idx] = last
            if pk is None and more:
                found = first_accepted(idx)
                if found is not None:
                    pk, pv = found
            if pk is None:
                heappop(heap)
            else:
                heapreplace(heap, (pk[_QK:], idx, pk, pv))
    finally:
        self._run = None
        if self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done(yielded, skipped)


def _merged(
    cell: list[QueueIterator], merge_fill: Callable[..., Any]
) -> Generator[Iterator[IteratedMessage], None, None]:
    """The compiled merge: yields list iterators of merged batches, which the chain hands
    out. ``_speedups.merge_fill`` does the k-way merge of every source in C, one batch per
    call, so interleaved sources (blocks of different shards over the same lt range, the
    usual case on a live network) cost no Python per message, as disjoint ones do not."""
    self = cell.pop()
    for_shard = self._for_shard
    wc_byte = codec.workchain_byte(for_shard.workchain)
    if wc_byte is None:  # no std address lives in this workchain: skip everything
        wc_byte = -1
    prefix_len = for_shard.prefix_len
    want = for_shard.prefix >> (64 - prefix_len) if prefix_len else 0
    positions = self._positions
    shards = self._shards
    sources = self._sources
    finish = self._finish
    n = len(sources)
    heads: list[tuple[bytes, bytes] | None] = [None] * n
    lastkeys: list[bytes | None] = [None] * n
    need = list(range(n))
    yielded = skipped = 0
    limit = min(_RUN_FIRST, _RUN)  # batches grow: the first message comes soon
    try:
        while True:
            try:
                batch, final, records, ended, need, n_skipped = merge_fill(
                    sources,
                    heads,
                    lastkeys,
                    need,
                    limit,
                    wc_byte,
                    prefix_len,
                    want,
                    shards,
                    positions,
                )
            except (ValueError, TypeError) as exc:
                bad = exc.args[1] if len(exc.args) > 1 else b""
                raise CorruptDataError("messages", bad, str(exc.args[0])) from None
            skipped += n_skipped
            for idx in ended:  # rows ran out: raises unless at the range's end
                finish[idx](lastkeys[idx])
            if not batch:
                positions[:] = final
                return
            limit = min(2 * limit, _RUN)
            run = iter(batch)
            self._run = (-1, batch, run, records)
            yield run
            # The consumer asked for the next message: the batch is consumed.
            self._run = None
            yielded += len(batch)
            positions[:] = final
    finally:
        self._run = None
        if self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done(yielded, skipped)


_NO_BOUND = b"\xff" * (_KEY_LEN + 1)  # above every message key
_RUN = 256  # accepted rows per run, at most (re-measure with benchmarks/bench_floor.py)
_RUN_FIRST = 16  # the first run's limit; each next run's doubles, up to _RUN
_unpack_key = codec.MESSAGE_KEY_LT_HASH.unpack
_src_of = operator.itemgetter(slice(_ADDR, _HEADER))
_dst_workchain_byte = operator.itemgetter(0)
_dst_account = operator.itemgetter(slice(1, _ADDR))
_workchain_of_byte = tuple(range(-128, 128)).__getitem__  # a stored workchain byte is wc + 128
_body_of = operator.itemgetter(slice(_HEADER, None))
# ``_new_each(zip(repeat(cls), fields))`` makes each fields tuple a ``cls``. starmap passes
# zip's (cls, fields) tuple on as the arguments of ``tuple.__new__``, where
# ``map(tuple.__new__, repeat(cls), fields)`` builds an argument tuple per call (measured:
# a few per cent of the pure-Python read).
_new_each = partial(starmap, _tnew)


class _AddressCache(dict[bytes, Address]):
    """Decoded source addresses by their 33 stored bytes; a miss decodes and keeps one
    (bounded: the cache empties itself when full). Looked up through ``__getitem__`` from
    C (``map``), so a hit runs no Python code."""

    __slots__ = ()

    def __missing__(self, raw: bytes) -> Address:
        # Only whole addresses are kept, so every slice of a value shorter than its
        # header comes here: the decode needs no pass of its own over the lengths.
        if len(raw) != _ADDR:
            raise ValueError("message row too short")
        if len(self) >= _ADDRESS_CACHE_LIMIT:
            self.clear()
        found: Address = _tnew(Address, (raw[0] - 128, raw[1:]))
        self[raw] = found
        return found


def _decode(
    keys: Sequence[bytes],
    values: Sequence[bytes],
    shard: ShardIdent,
    cache: dict[bytes, Address],
    dst_workchain: int | None = None,
) -> list[IteratedMessage]:
    """Build the messages of a run (the per-message hot path of the pure-Python decode).

    One pipeline of ``map``/``zip``/``starmap`` over the run, so that no Python bytecode
    runs per message: the key's (lt, hash) by ``struct``, each value's fields by slicing
    ``itemgetter``s, and each value type by ``tuple.__new__`` (``zip`` reuses its tuple
    once ``tuple.__new__`` has copied it). Source addresses come from ``cache``: a source
    shard's few senders stay in the processor's caches. Destination addresses are built
    afresh, as in C: they spread over the whole workchain, and a lookup in a cache of
    thousands of them missed the processor's caches and cost more than building one.
    ``dst_workchain``, when given, is every row's destination workchain (the fill run
    accepts only rows of one workchain), so no row's workchain byte is read.
    """
    if type(cache) is not _AddressCache:  # a plain dict (tests): decode through a wrapper
        cache = _AddressCache(cache)
    workchains = (
        map(_workchain_of_byte, map(_dst_workchain_byte, values))
        if dst_workchain is None
        else repeat(dst_workchain)
    )
    # Not strict where ``repeat`` never ends.
    dst = _new_each(zip(repeat(Address), zip(workchains, map(_dst_account, values), strict=False)))
    qks = _new_each(zip(repeat(QueueKey), map(_unpack_key, keys)))
    src = map(cache.__getitem__, map(_src_of, values))
    fields = zip(qks, src, dst, map(_body_of, values), strict=True)
    messages = _new_each(zip(repeat(Message), fields))
    try:
        return list(_new_each(zip(repeat(IteratedMessage), zip(repeat(shard), messages))))
    # A key of the wrong length (struct), a value shorter than its header (the source
    # address's lookup, or the destination's workchain byte of an empty value).
    except (struct.error, ValueError, IndexError):
        _corrupt(keys, values)


def _py_fill_run(  # noqa: PLR0917 - one hot loop
    source: Iterator[tuple[bytes, bytes]],
    head_key: bytes,
    head_value: bytes,
    bound: bytes | None,
    limit: int,
    wc_byte: int,
    prefix_len: int,
    want: int,
    shard: ShardIdent,
    _cache: dict[bytes, Address] | None = None,
) -> tuple[list[IteratedMessage], bytes, bytes | None, bytes | None, int, bool]:
    """One run of the pure-Python merge: decode the head row, then pull rows from
    ``source`` while they stay below ``bound`` (a whole message key in this source's key
    space, or None). A row is accepted when its destination workchain byte is ``wc_byte``
    and (``prefix_len`` 0, or the top ``prefix_len`` bits of its destination account equal
    ``want``); others are skipped (counted). Returns ``(batch, last_key, pending_key,
    pending_value, skipped, more)``: the first accepted row at or past the bound is
    pending; ``last_key`` is the key of the last row consumed.

    Reads at most ``limit - 1`` rows after the head (``islice``, so the loop does no count
    of its own), so a run never holds more than ``limit`` messages; when they run out
    without reaching the bound, ``more`` says the source may hold more. An accepted row's
    length is checked by the decode, a skipped row's here (a value shorter than its header
    is corrupt either way, as in C).
    """
    keys = [head_key]
    values = [head_value]
    append_k = keys.append
    append_v = values.append
    if bound is None:
        bound = _NO_BOUND
    last = head_key
    skipped = 0
    pk = pv = None
    k = head_key
    try:
        if prefix_len == 0:
            for k, v in islice(source, limit - 1):
                if v[0] == wc_byte:
                    if k >= bound:
                        pk, pv = k, v
                        break
                    append_k(k)
                    append_v(v)
                else:
                    if len(v) < _HEADER:
                        _short_row((k,), (v,))
                    skipped += 1
                    last = k
        else:
            shift = 64 - prefix_len
            from_bytes = int.from_bytes
            for k, v in islice(source, limit - 1):
                if v[0] == wc_byte and from_bytes(v[1:9], "big") >> shift == want:
                    if k >= bound:
                        pk, pv = k, v
                        break
                    append_k(k)
                    append_v(v)
                else:
                    if len(v) < _HEADER:
                        _short_row((k,), (v,))
                    skipped += 1
                    last = k
    except IndexError:  # v[0] of an empty value (a 3.11 try is free)
        raise ValueError("empty message value", k) from None
    if pv is not None and len(pv) < _HEADER:  # the pending row: not decoded here
        _short_row((pk or b"",), (pv,))
    # Keys rise within a source: the last row consumed is the later of the two.
    last = max(last, keys[-1])
    more = pk is None and len(keys) - 1 + skipped == limit - 1
    # Every row after the head matched ``wc_byte``; so did the head, unless a caller gave
    # another one (tests): then all destinations are in one workchain.
    dst_workchain = wc_byte - 128 if head_value and head_value[0] == wc_byte else None
    cache = _AddressCache() if _cache is None else _cache
    batch = _decode(keys, values, shard, cache, dst_workchain)
    return batch, last, pk, pv, skipped, more


def _short_row(keys: Sequence[bytes], values: Sequence[bytes]) -> NoReturn:
    """A value shorter than its header, accepted or not: ValueError(what, key), as C."""
    for k, v in zip(keys, values, strict=True):
        if len(v) < _HEADER:
            raise ValueError(_short_what(v), k)
    raise AssertionError("no short row")


def _short_what(value: bytes) -> str:
    return "empty message value" if not value else "message row too short"


def _corrupt(keys: Sequence[bytes], values: Sequence[bytes]) -> NoReturn:
    for k, v in zip(keys, values, strict=True):
        if len(k) != _KEY_LEN or len(v) < _HEADER:
            raise CorruptDataError(
                "messages", k, f"row too short ({len(k)} B key, {len(v)} B value)"
            )
    raise CorruptDataError("messages", keys[0], "undecodable message rows")


_decode_py = _decode


def _compiled() -> Any:
    """``imq._speedups`` when it was built (and not disabled with ``IMQ_PURE_PYTHON=1``)."""
    if os.environ.get("IMQ_PURE_PYTHON"):
        return None
    try:
        from imq import _speedups  # noqa: PLC0415 -- optional, built only with a compiler
    except ImportError:
        return None
    _speedups.init(IteratedMessage, Message, QueueKey, Address)
    return _speedups


_speedups_module = _compiled()


def _c_decode(
    keys: list[bytes], values: list[bytes], shard: ShardIdent, _cache: dict[bytes, Address]
) -> list[IteratedMessage]:
    """The C decode of a run; it returns exactly what :func:`_decode` returns."""
    try:
        result: list[IteratedMessage] = _speedups_module.decode_run(keys, values, shard)
    except (ValueError, TypeError):
        _corrupt(keys, values)
    return result


_decode_run: Callable[..., list[IteratedMessage]] = (
    _decode if _speedups_module is None else _c_decode
)
_merge_fill: Callable[..., Any] | None = (
    None if _speedups_module is None else _speedups_module.merge_fill
)
COMPILED = _speedups_module is not None
"""True when the compiled merge and decode are in use (reported by the benchmarks)."""


@contextlib.contextmanager
def pure_python() -> Iterator[None]:
    """Within this block, new iterators use the pure-Python path (benchmarks, tests)."""
    global _decode_run, _merge_fill
    saved = _decode_run, _merge_fill
    _decode_run, _merge_fill = _decode, None
    try:
        yield
    finally:
        _decode_run, _merge_fill = saved
