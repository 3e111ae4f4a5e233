"""The merge iterator (SEMANTICS §5.2, §11): one partition, several source shards.

One source per source shard, all opened under one snapshot: a RocksDB cursor, or the
store's cache of fresh rows when it holds the whole range (``imq.storage.cache``: it
hands over only the reader's rows and the last row of each run of others', which the
merge below treats exactly as the whole range). A heap holds at
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
- one ``merge_fill`` call fills a batch from every source: ``imq._speedups.merge_fill``
  in C when built, else ``_py_merge_fill`` (``pure_python()`` and ``IMQ_PURE_PYTHON=1``
  select it too), with one contract and identical results. C takes the pending row with
  the smallest queue key (compared in place, no slicing), then streams the same source's
  rows while they stay below the runner-up without another comparison: blocks of one
  shard cost one merge step per block, and shards whose blocks interleave in lt (a live
  network's shards, whose lt clocks run side by side) one step per message, as cheap as
  ``heapq.merge`` over raw rows. Python cannot afford a step per message, so it merges
  whole runs: each source's rows are read ahead in chunks and filtered in C passes, and
  every row below the lowest of the live sources' last rows is ordered by one stable
  ``sorted`` of the queue keys (one source's rows alone: no sort); its batches may be
  ``_PY_RUN_FACTOR`` times longer. The skips inside a batch are recorded, so
  ``current_position()`` there is exact;
- the destination test, key decoding and value-type construction happen in that call,
  at the message row's offsets from :mod:`imq.storage.codec`; decoded addresses may be
  shared (in C, the previous row's, which a row naming the same account reuses: a
  process-wide cache was slower; in Python, source addresses from a bounded cache per
  iterator, destinations built afresh: see ``_decode``); C builds the value
  types without ``tp_alloc`` and outside the cyclic GC, Python in one ``map``/``zip``
  pipeline with no bytecode per message;
- the merge pulls each cursor's bare rows (``Cursor.rows``) and runs the cursor's end
  check itself when they run out (``Cursor.finish``), so a damaged table still raises
  instead of ending the scan, with no bookkeeping per row; the C merge reads a source
  served by the cache of fresh rows in place, in its chunks, building no row objects
  (a skipped row's key only where a position needs it);
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
import struct
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from functools import partial
from itertools import chain, compress, count, islice, repeat, starmap
from operator import and_, eq, rshift
from types import TracebackType
from typing import Any, NoReturn, cast

from imq._native import speedups
from imq.errors import CorruptDataError, ImqError, QueueClosedError, ReadInterruptedError
from imq.storage import SnapshotProtocol as Snapshot
from imq.storage import codec
from imq.storage.rocks import drop_frame_locals
from imq.types import (
    Address,
    IteratedMessage,
    Message,
    QueueKey,
    QueueShardRange,
    ShardIdent,
)

__all__ = ["QueueIterator", "destination_test", "pure_python"]

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


# What the merge and the guard hand the chain are iterators whose ``__iter__`` is C's
# (lists' iterators, and ``iter(pull, _NEVER)`` for the markers below): the chain runs
# ``iter()`` on what its source returned before it stores it, and a Python ``__iter__``
# there is a point where the GIL passes to another thread pulling the same chain (an
# audit: a second thread's busy marker stored over the first one's batch, the iterator
# then raising for good with the rest of its range unread; a failed read's marker let a
# second thread find the source ended and see a clean end).
_NEVER = object()  # no pull returns it: such an iterator ends by StopIteration only


class _Failed:
    """The state of a failed read: the chain holds ``iter(failed.pull, _NEVER)``, whose
    every pull raises that error again (a chain keeps an iterator that raised, so the
    iterator stays failed instead of ending as if its ranges were complete), until
    :meth:`QueueIterator.close` ends it. ``first``, when given, is what the first pull
    raises instead: the exception of the host's that cut the read short, passed on as it
    was raised."""

    __slots__ = ("error", "first", "raised")

    def __init__(self, error: ImqError, first: BaseException | None = None) -> None:
        self.error: ImqError | None = error
        self.first = first
        self.raised = False

    def pull(self) -> NoReturn:
        error = self.error
        if error is None:
            raise StopIteration
        first = self.first
        if first is not None:
            self.first = None
            raise first
        if self.raised:  # again: a fresh traceback (the first one shows where it failed)
            error = error.with_traceback(None)
        self.raised = True
        raise error


def _busy() -> NoReturn:
    raise ValueError(
        "this iterator is being read by another thread at the same time: an iterator "
        "serves one thread at a time (guard it with a lock, or open one per thread)"
    )


# What a pull of the merge gets while another thread runs it (from the compiled
# ``Guard``): an iterator that raises. The chain keeps it until that thread's batch
# replaces it, so the range goes on for both threads. One for all: a chain overwrites
# the one it holds without freeing it.
_BUSY: Iterator[Any] = iter(_busy, _NEVER)


_EXHAUSTED: Iterator[Any] = iter(())  # what a source becomes once the merge has run out


class QueueIterator(chain[IteratedMessage]):
    """Messages of one partition from several source shards, merged by key.

    A Python iterator of :class:`IteratedMessage` (``iter(it) is it``); also a context
    manager. It is an ``itertools.chain`` of decoded batches, so ``next()`` runs in C: the
    Python merge code runs once per batch, not once per message.
    """

    _snap: Snapshot
    _shards: list[ShardIdent]
    # Per source, the last stored key consumed before the current batch
    _positions: list[bytes | QueueKey | None]
    _for_shard: ShardIdent
    _sources: list[Iterator[Any]]
    _closed_by_queue: bool
    # Shared with the merge generator (which holds no reference to the iterator, so that
    # a dropped iterator is freed at once, with its cursors, by reference counting):
    # [0] the batch the consumer is inside: (the batch, its list iterator, the merge's
    # skip records; see current_position), or None; [1] how many messages of that batch
    # the consumer had taken when the iterator closed inside it (for the metrics); [2]
    # the read error the merge stopped on (a _Failed), or None
    _box: list[Any]
    # What the consumer took of the batch it was inside when the iterator closed, and that
    # batch's skip records: replayed onto _positions only if current_position() asks
    # (a bounded read closes inside a batch every time; few ask where it stopped)
    _kept: tuple[list[IteratedMessage], list[Any]] | None
    _producer: Generator[Iterator[IteratedMessage], None, None]

    def __new__(
        cls,
        snap: Snapshot,
        ranges: Sequence[QueueShardRange],
        for_shard: ShardIdent,
        on_done: Callable[[int, int], None] | None = None,
    ) -> QueueIterator:
        merge_fill, longest = _merge_fill, _RUN
        if merge_fill is None:  # the pure-Python merge caches source addresses per iterator
            merge_fill = partial(_py_merge_fill, _cache=_AddressCache())
            longest *= _PY_RUN_FACTOR
        shards = [r.shard for r in ranges]
        positions: list[bytes | QueueKey | None] = [None] * len(ranges)
        # The bare rows: the merge knows the last key it read from each source, so it
        # runs each cursor's end check itself when its rows run out (``finish``).
        sources = [c.rows for c in snap.cursors]
        box: list[Any] = [None, 0, None]
        producer = _merged(
            box, merge_fill, longest, for_shard, shards, positions, sources, snap, on_done
        )
        # Primed: the merge runs up to its first yield, inside its handler, so no
        # exception of the host's can escape it later (a chain drops a source that
        # raised, and then ends as if the range were complete).
        primed = next(producer)
        if primed is not _EXHAUSTED:  # the host's exception landed while priming
            next(primed)  # raises it, from Queue.iterator()
        guard = _guard_type
        self = cast(
            QueueIterator,
            cls.from_iterable(producer if guard is None else guard(producer, _BUSY)),
        )
        self._snap = snap
        self._shards = shards
        self._positions = positions
        self._for_shard = for_shard
        self._sources = sources
        self._closed_by_queue = False
        self._box = box
        self._kept = None
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
        """Last key consumed per source shard, skipped messages included; what was consumed
        stays consumed once the iterator or its queue is closed."""
        return {
            shard: raw if isinstance(raw, QueueKey) else _position_key(raw)
            for shard, raw in zip(self._shards, self._consumed(), strict=True)
            if raw is not None
        }

    def _consumed(self) -> list[bytes | QueueKey | None]:
        """Per source, the last key consumed (a stored key or a decoded one): the positions
        before the batch the consumer is (or was, when closed) inside, plus what it took
        of that batch."""
        positions: list[bytes | QueueKey | None] = list(self._positions)
        current = self._box[0]
        if current is not None:  # inside a batch: replay what the consumer took of it
            batch, run, records = current
            self._replay(positions, batch, len(batch) - operator.length_hint(run), records)
        elif self._kept is not None:  # closed inside a batch
            taken, records = self._kept
            self._replay(positions, taken, len(taken), records)
        return positions

    def _replay(
        self,
        positions: list[bytes | QueueKey | None],
        batch: list[IteratedMessage],
        taken: int,
        records: list[Any],
    ) -> None:
        """Move ``positions`` past the first ``taken`` messages of ``batch`` and the skips
        ``records`` places before them."""
        index = {shard: i for i, shard in enumerate(self._shards)}
        pending = iter(records)  # (j, source, key): a skip just before message j
        record = next(pending, None)
        for j in range(taken):
            while record is not None and record[0] <= j:
                positions[record[1]] = record[2]
                record = next(pending, None)
            message = batch[j]
            positions[index[message[0]]] = message[1][0]

    def close(self) -> None:
        """Release the cursors; the iterator is then exhausted."""
        self._stop_run()
        failed = self._box[2]
        if failed is not None:  # a read error: the iterator ends now instead
            failed.error = None
        # ValueError: another thread is producing a batch right now; dropping the sources
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
        # The chain holds the current batch's list iterator: emptying the list ends it now.
        # What the consumer took of the batch is kept first (a copy of that part; the
        # replay waits for a current_position() call): current_position() counts the
        # taken part of a live batch from the batch's length, which emptying it zeroes.
        box = self._box
        run = box[0]
        if run is not None:
            batch, it, records = run
            taken = len(batch) - operator.length_hint(it)
            self._kept = (batch[:taken], records)
            box[0] = None
            box[1] = taken
            batch.clear()

    def _release(self, replacement: Iterator[Any]) -> None:
        # The merge reads ``self._sources[idx]`` afresh for every batch, so swapping the
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


def _position_key(raw: bytes) -> QueueKey:
    """The queue key of a stored row a position stopped at. A skipped row is read no
    further than its destination header, so a damaged key shows here first."""
    if len(raw) != _KEY_LEN:
        raise CorruptDataError("messages", raw, f"message key of {len(raw)} bytes, not {_KEY_LEN}")
    return codec.decode_key(raw[_QK:])


def destination_test(for_shard: ShardIdent) -> tuple[int, int, int]:
    """``(workchain byte, prefix length, prefix)``: a stored row is for ``for_shard`` when
    its destination's workchain byte is the first and the top ``prefix length`` bits of
    its account are the prefix (byte -1: no std address lives in this workchain, so
    every row is skipped)."""
    wc_byte = codec.workchain_byte(for_shard.workchain)
    prefix_len = for_shard.prefix_len
    want = for_shard.prefix >> (64 - prefix_len) if prefix_len else 0
    return (-1 if wc_byte is None else wc_byte), prefix_len, want


def _merged(  # noqa: PLR0917 - the iterator's state, shared with it
    box: list[Any],
    merge_fill: Callable[..., Any],
    longest: int,
    for_shard: ShardIdent,
    shards: list[ShardIdent],
    positions: list[Any],
    sources: list[Iterator[Any]],
    snap: Snapshot,
    on_done: Callable[[int, int], None] | None,
) -> Generator[Iterator[IteratedMessage], None, None]:
    """The merge: yields list iterators of merged batches, which the chain hands out.

    ``merge_fill`` (C, or its Python twin) fills each batch from every source; this
    generator keeps the state between batches, runs each source's end check when its rows
    run out, and applies a batch's positions once the consumer has taken all of it. It
    shares the iterator's lists (and ``box``) but never refers to the iterator itself, so
    the two form no reference cycle. Once every source has run out it releases the
    cursors: an iterator kept for its position pins no RocksDB version."""
    counts = [0, 0]  # messages yielded, rows skipped
    try:
        try:
            wc_byte, prefix_len, want = destination_test(for_shard)
            yield _EXHAUSTED  # primed by QueueIterator: every later resume is in here
            yield from _merge_batches(
                box,
                merge_fill,
                longest,
                wc_byte,
                prefix_len,
                want,
                shards,
                positions,
                sources,
                snap,
                counts,
            )
        except BaseException as exc:
            if isinstance(exc, GeneratorExit | QueueClosedError):  # closed: it ends or raises
                raise
            # Nothing more is read: the cursors go now, and the finished frames the
            # error's traceback keeps lose their locals (the view, RocksDB's iterators),
            # so that a host keeping the error does not keep the database open after
            # close().
            for idx in range(len(sources)):  # no loop variable left holding a source
                if type(sources[idx]) is not _Closed:
                    sources[idx] = _EXHAUSTED
            snap.close()
            drop_frame_locals(exc)
            # The chain drops a producer that raised and then reports the end: hand it an
            # iterator that raises instead, so that asking again never reads as the end.
            # An exception that is not imq's (a signal handler's, KeyboardInterrupt) is
            # raised once as it came; the rows read ahead are lost with it, so the later
            # pulls raise ReadInterruptedError.
            if isinstance(exc, ImqError):
                failed = box[2] = _Failed(exc)
            else:
                failed = box[2] = _Failed(
                    ReadInterruptedError(
                        f"this iterator's read was cut short by {type(exc).__name__}, "
                        "and the rows it had read ahead of its consumer are lost with it"
                    ),
                    first=exc,
                )
            del exc
            yield iter(failed.pull, _NEVER)
    finally:
        current, box[0] = box[0], None
        if current is not None:  # dropped inside a batch: what the consumer took of it
            counts[0] += len(current[0]) - operator.length_hint(current[1])
        else:  # closed inside a batch (its part taken), or between batches (0)
            counts[0] += box[1]
        if on_done is not None:
            # with the rows cached scans left out (runs of other shards' rows that the
            # merge would have skipped, see imq.storage.cache)
            on_done(counts[0], counts[1] + sum(c.dropped for c in snap.cursors))


def _merge_batches(  # noqa: PLR0917 - the merge's state
    box: list[Any],
    merge_fill: Callable[..., Any],
    longest: int,
    wc_byte: int,
    prefix_len: int,
    want: int,
    shards: list[ShardIdent],
    positions: list[Any],
    sources: list[Iterator[Any]],
    snap: Snapshot,
    counts: list[int],
) -> Generator[Iterator[IteratedMessage], None, None]:
    """The batches of :func:`_merged`; ``counts``: messages yielded, rows skipped."""
    finish = [c.finish for c in snap.cursors]
    n = len(sources)
    heads: list[tuple[bytes, bytes] | None] = [None] * n
    lastkeys: list[bytes | None] = [None] * n
    need = list(range(n))
    limit = min(_RUN_FIRST, longest)  # batches grow: the first message comes soon
    usable = snap.check_usable
    while True:
        usable()  # a forked child reads nothing of its parent's RocksDB
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
        counts[1] += n_skipped
        for idx in ended:  # rows ran out: raises unless at the range's end
            finish[idx](lastkeys[idx])
        if not batch:
            if any(type(source) is _Closed for source in sources):
                # The queue closed from another thread: its close dropped the cursors'
                # end checks, perhaps before the ones above ran, and rows that stopped
                # at a damaged block would read as the range's end (an audit: 11 of 400
                # closes during such a read ended it cleanly, short).
                raise QueueClosedError("the queue was closed while this iterator was open")
            positions[:] = final
            # Every source ran out: nothing more is read (a close() or a queue's
            # close racing this from another thread has swapped them already).
            for idx in range(n):
                if type(sources[idx]) is not _Closed:
                    sources[idx] = _EXHAUSTED
            snap.close()
            return
        limit = min(2 * limit, longest)
        run = iter(batch)
        box[0] = (batch, run, records)
        yield run
        # The consumer asked for the next message: the batch is consumed. The positions
        # move first: an exception landing before the batch leaves ``box`` finds it still
        # there, and current_position() replays it, which moves nothing past it.
        positions[:] = final
        box[0] = None
        counts[0] += len(batch)


_RUN = 256  # messages per batch, at most (re-measure with benchmarks/bench_floor.py)
_RUN_FIRST = 16  # the first batch's limit; each next batch's doubles, up to _RUN
# The pure-Python merge's batches may be this many times longer: each costs it a Python
# step per source, so a long run of one shard is read ahead in larger pieces.
_PY_RUN_FACTOR = 4
_AHEAD_MIN = 8  # rows the pure-Python merge reads of a source at a time, at least
_unpack_key = codec.MESSAGE_KEY_LT_HASH.unpack
_src_of = operator.itemgetter(slice(_ADDR, _HEADER))
_dst_workchain_byte = operator.itemgetter(0)
_dst_account = operator.itemgetter(slice(1, _ADDR))
_workchain_of_byte = tuple(range(-128, 128)).__getitem__  # a stored workchain byte is wc + 128
_body_of = operator.itemgetter(slice(_HEADER, None))
_dst_top = operator.itemgetter(slice(1, 9))  # the destination account's top 64 bits
_queue_key_of = operator.itemgetter(slice(_QK, None))
_first_item = operator.itemgetter(0)
_from_bytes: Callable[..., int] = int.from_bytes
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
    owners: Iterable[ShardIdent],
    cache: dict[bytes, Address],
    dst_workchain: int | None = None,
) -> list[IteratedMessage]:
    """Build the messages of a batch (the per-message hot path of the pure-Python decode).

    One pipeline of ``map``/``zip``/``starmap`` over the batch, so that no Python bytecode
    runs per message: the key's (lt, hash) by ``struct``, each value's fields by slicing
    ``itemgetter``s, and each value type by ``tuple.__new__`` (``zip`` reuses its tuple
    once ``tuple.__new__`` has copied it). Source addresses come from ``cache``: a source
    shard's few senders stay in the processor's caches. Destination addresses are built
    afresh, as in C: they spread over the whole workchain, and a lookup in a cache of
    thousands of them missed the processor's caches and cost more than building one.
    ``dst_workchain``, when given, is every row's destination workchain (the merge
    accepts only rows of one workchain), so no row's workchain byte is read.
    ``owners`` is each row's source shard (``repeat(shard)`` when one shard owns them all).
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
        # Not strict: ``owners`` may be a ``repeat`` (the messages' own zip is strict).
        return list(_new_each(zip(repeat(IteratedMessage), zip(owners, messages, strict=False))))
    # A key of the wrong length (struct), a value shorter than its header (the source
    # address's lookup, or the destination's workchain byte of an empty value).
    except (struct.error, ValueError, IndexError):
        _corrupt(keys, values)


class _Ahead:
    """What the pure-Python merge has read of one source and not handed out yet: its
    accepted rows (for this shard) in order, and the keys of skipped rows that the
    source's position must still pass (``current_position()`` counts them consumed)."""

    __slots__ = ("base", "keys", "live", "skips", "tail", "values")

    def __init__(self) -> None:
        self.keys: list[bytes] = []  # accepted rows not yet handed out
        self.values: list[bytes] = []
        self.base = 0  # the running number of keys[0] among the source's accepted rows
        # running number of an accepted row -> the key of the last row skipped just before
        # it: the position moves there once the accepted row before it is taken
        self.skips: dict[int, bytes] = {}
        self.tail: bytes | None = None  # the last row skipped after keys[-1]
        self.live = True  # the source may have more rows


def _read_ahead(  # noqa: PLR0917 - the merge's state
    source: Iterator[tuple[bytes, bytes]],
    ahead: _Ahead,
    size: int,
    wc_byte: int,
    prefix_len: int,
    want: int,
) -> tuple[int, bytes | None]:
    """Read up to ``size`` rows of ``source`` into ``ahead``: (rows skipped, the last key
    read or None). The length check and the destination test run over the whole chunk
    in C; bytecode runs per row only in a chunk that mixes accepted and skipped rows (one
    step per accepted row, to note the skip before it)."""
    rows = list(islice(source, size))
    if len(rows) < size:
        ahead.live = False
        if not rows:
            return 0, None
    keys, values = zip(*rows, strict=True)
    if min(map(len, values)) < _HEADER:  # corrupt, whether for this shard or not
        _short_row(keys, values)
    mask: list[bool] | None
    if 0 <= wc_byte < 256:  # a byte (-1: no std address lives in this workchain)
        firsts = bytes(map(_dst_workchain_byte, values))
        if prefix_len:
            tops = map(_from_bytes, map(_dst_top, values), repeat("big"))
            in_prefix = map(eq, map(rshift, tops, repeat(64 - prefix_len)), repeat(want))
            mask = list(map(and_, map(eq, firsts, repeat(wc_byte)), in_prefix))
            accepted = mask.count(True)
        else:
            accepted = firsts.count(wc_byte)
            mask = None if accepted == len(keys) else list(map(eq, firsts, repeat(wc_byte)))
    else:  # no std address lives in this workchain: every row is skipped
        accepted, mask = 0, []
    if mask is None:  # every row is for this shard
        if ahead.tail is not None:
            ahead.skips[ahead.base + len(ahead.keys)] = ahead.tail
            ahead.tail = None
        ahead.keys += keys
        ahead.values += values
        return 0, keys[-1]
    if accepted:
        number = ahead.base + len(ahead.keys)
        skips, tail = ahead.skips, ahead.tail
        for i in compress(range(len(keys)), mask):
            if i:
                if not mask[i - 1]:
                    skips[number] = keys[i - 1]
            elif tail is not None:
                skips[number] = tail
            number += 1
        ahead.keys += compress(keys, mask)
        ahead.values += compress(values, mask)
        ahead.tail = None if mask[-1] else keys[-1]
    else:
        ahead.tail = keys[-1]
    return len(keys) - accepted, keys[-1]


def _py_merge_fill(  # noqa: PLR0915, PLR0917 - one merge step
    sources: list[Iterator[tuple[bytes, bytes]]],
    heads: list[Any],
    lastkeys: list[bytes | None],
    need: list[int],  # C's: this merge tops every source up itself
    limit: int,
    wc_byte: int,
    prefix_len: int,
    want: int,
    shards: list[ShardIdent],
    positions: list[Any],
    _cache: dict[bytes, Address] | None = None,
) -> tuple[list[IteratedMessage], list[Any], list[Any], list[int], list[int], int]:
    """The pure-Python ``imq._speedups.merge_fill``: same arguments, same contract (see
    ``merge_fill`` in ``imq/_speedups.c``), the same messages and positions. ``heads``
    holds each source's :class:`_Ahead` instead of one pending row; ``need`` is not used.

    C takes one message at a time; here a batch is built from whole runs so that C does
    the per-row work. Each source's rows are read ahead in chunks and filtered at once
    (:func:`_read_ahead`); the *bound* is the lowest of the live sources' last accepted
    rows, below which no source can still bring a row; every row up to it (at most
    ``limit``) is merged by one stable sort of the queue keys, which finds each source's
    run already in order (rows of one source only: no sort). The batch ends at the bound,
    so a source whose rows read ahead ran out is read again before any later message, as
    in C; each run of skipped rows is recorded after the message after which C reads it.
    A batch may hold fewer messages than C's (each source reads ahead about ``limit``
    divided by the live sources), never different ones. What the read-ahead does show:
    a damaged row (or a damaged table's end check) raises a batch sooner or later than
    in C, so a bounded read just before one can succeed on one path and fail on the
    other (C too loses the whole batch it was filling; both raise, neither ends early);
    after such an error ``current_position()`` may be behind C's (never ahead); and the
    skipped-rows count of an iterator closed early includes rows read ahead.
    """
    n = len(sources)
    final = list(positions)
    records: list[tuple[int, int, bytes]] = []
    ended: list[int] = []
    skipped = 0
    live = [a is None or a.live for a in heads].count(True)
    size = max(limit // max(live, 1), _AHEAD_MIN)
    bound: tuple[bytes, int] | None = None  # (queue key, source) of the lowest live last row
    for idx in range(n):
        ahead = heads[idx]
        if ahead is None:
            ahead = heads[idx] = _Ahead()
        if ahead.live and len(ahead.keys) < size:
            empty = not ahead.keys
            while True:
                n_skipped, last_read = _read_ahead(
                    sources[idx], ahead, size, wc_byte, prefix_len, want
                )
                skipped += n_skipped
                if last_read is not None:
                    lastkeys[idx] = last_read
                if ahead.keys or not ahead.live:
                    break
            if not ahead.live:
                ended.append(idx)
            if empty:  # read before this call's first message: the position moves now
                if ahead.keys:
                    skip = ahead.skips.pop(ahead.base, None)
                else:
                    skip, ahead.tail = ahead.tail, None
                if skip is not None:
                    final[idx] = positions[idx] = skip
        if ahead.live:
            last = (ahead.keys[-1][_QK:], idx)
            if bound is None or last < bound:
                bound = last
    # (source, rows it hands out, where they start among all the batch's rows)
    parts: list[tuple[int, int, int]] = []
    total = 0
    for idx in range(n):
        keys = heads[idx].keys
        if not keys:
            continue
        if bound is None:
            taken = len(keys)
        else:  # whole stored keys compared: a source's keys share their prefix
            edge = keys[0][:_QK] + bound[0]
            taken = (bisect_right if idx <= bound[1] else bisect_left)(keys, edge)
        if taken:
            parts.append((idx, taken, total))
            total += taken
    if not parts:  # every source ran out
        return [], final, records, ended, [], skipped
    order: list[int] | None  # the batch's rows by their index among all rows (None: as is)
    owners: Iterable[ShardIdent]
    if len(parts) == 1:
        idx, taken, _ = parts[0]
        taken = min(taken, limit)
        parts = [(idx, taken, 0)]
        ahead = heads[idx]
        batch_keys, batch_values = ahead.keys[:taken], ahead.values[:taken]
        owners, order = repeat(shards[idx]), None
    else:
        all_keys: list[bytes] = []
        all_values: list[bytes] = []
        source_of: list[int] = []
        for idx, taken, _ in parts:
            ahead = heads[idx]
            all_keys += ahead.keys[:taken]
            all_values += ahead.values[:taken]
            source_of += repeat(idx, taken)
        queue_keys = list(map(_queue_key_of, all_keys))
        # Stable: equal queue keys keep the source order (the lower source first, as C).
        order = sorted(range(total), key=queue_keys.__getitem__)
        if total > limit:  # each source's share of the first `limit` is still a prefix
            del order[limit:]
            counts = Counter(map(source_of.__getitem__, order))
            parts = [(idx, counts[idx], start) for idx, _, start in parts if counts[idx]]
        batch_keys = list(map(all_keys.__getitem__, order))
        batch_values = list(map(all_values.__getitem__, order))
        owners = map(shards.__getitem__, map(source_of.__getitem__, order))
    # A row's batch index from its index among all rows: built once a record needs it.
    index: dict[int, int] | None = None
    # Positions: the skips between (and after) the rows each source hands out.
    for idx, taken, start in parts:
        ahead = heads[idx]
        first = ahead.base
        final[idx] = ahead.keys[taken - 1]
        due = [r for r in ahead.skips if r <= first + taken]  # read once row r - 1 is taken
        tail = ahead.tail if taken == len(ahead.keys) else None
        for r, key in [*((r, ahead.skips.pop(r)) for r in due), (first + taken, tail)]:
            if key is None:
                continue
            j = r - 1 - first  # the row it follows
            if order is not None:
                if index is None:
                    index = dict(zip(order, count(), strict=False))
                j = index[start + j]
            records.append((j + 1, idx, key))
            if r == first + taken:
                final[idx] = key
        if tail is not None:
            ahead.tail = None
        del ahead.keys[:taken], ahead.values[:taken]
        ahead.base = first + taken
    if len(parts) > 1:
        records.sort(key=_first_item)
    cache = _AddressCache() if _cache is None else _cache
    # Every accepted row names a destination in the workchain of `wc_byte`.
    batch = _decode(batch_keys, batch_values, owners, cache, wc_byte - 128)
    return batch, final, records, ended, [], skipped


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


# ``imq._speedups`` when it was built (and not disabled with ``IMQ_PURE_PYTHON=1``);
# ``imq.types`` registered the value types with it and gave them its constructors.
_speedups_module: Any = speedups


def _c_decode(keys: list[bytes], values: list[bytes], shard: ShardIdent) -> list[IteratedMessage]:
    """The C per-row decode that ``merge_fill`` runs, over rows that all belong to ``shard``:
    it returns exactly what :func:`_decode` returns (tests compare the two directly)."""
    try:
        result: list[IteratedMessage] = _speedups_module.decode_run(keys, values, shard)
    except (ValueError, TypeError):
        _corrupt(keys, values)
    return result


_merge_fill: Callable[..., Any] | None = (
    None if _speedups_module is None else _speedups_module.merge_fill
)
# Pulls the merge for the chain, turning a second thread's pull into ``_BUSY`` (a chain
# drops a source that raised: both threads then saw the range end). In C: a Python frame
# there would be a place for a signal handler's exception to escape the merge's handler.
# Without the compiled module the host shares an iterator between threads under a lock.
_guard_type: Callable[..., Iterator[Iterator[IteratedMessage]]] | None = (
    None if _speedups_module is None else _speedups_module.Guard
)
COMPILED = _speedups_module is not None
"""True when the compiled merge and decode are in use (reported by the benchmarks)."""


@contextlib.contextmanager
def pure_python() -> Iterator[None]:
    """Within this block, new iterators use the pure-Python path, ``QueueKey`` and
    ``Message`` run their Python constructors and the value types free their instances
    through CPython's own dealloc, as on a machine without the compiled module
    (benchmarks, tests)."""
    global _merge_fill  # noqa: PLW0603 - the switch tests and benchmarks flip
    saved, _merge_fill = _merge_fill, None
    module = _speedups_module
    deallocs = module is not None and module.value_deallocs(False)
    constructors = module is not None and module.value_constructors(False)
    try:
        yield
    finally:
        _merge_fill = saved
        if module is not None:
            module.value_deallocs(deallocs)
            module.value_constructors(constructors)
