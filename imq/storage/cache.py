"""The RocksDB store's cache of fresh message rows: reads of recent diffs skip RocksDB.

A collator reads what the other shards wrote a block or two ago. Served by RocksDB, each
such read opens one cursor per source shard (a seek into every memtable and young L0
file) and pulls every row of the range through rocksdict, most of them messages for
other shards. This cache keeps, per *segment* (one partition of one source shard: the
14-byte prefix of a message key), the rows a segment gained since the cache started
watching it, exactly as they are stored, so such a read becomes a few bisections and
one pass over packed bytes.

**Chunks.** What one batch wrote to one segment is one *chunk*: ``data``, the rows back
to back (key, then value), and ``offs``, where each row starts (native uint32s). The
batch's :class:`Tee` fills it as the rows are put (a memcpy a row, no Python objects),
and a read builds ``(key, value)`` pairs only for the rows it returns, one at a time as
the merge asks for them (:class:`imq._speedups.ChunkRows`). A segment's chunks are
disjoint and ascending.

**The invariant.** For a segment the cache knows, it holds a *floor* key and chunks, and
the rows of the segment stored in RocksDB with a key above the floor are exactly the
chunks' rows, byte for byte. Every change to the messages table passes here, under the
store's write gate, right after RocksDB took it:

- rows put: those above the floor join the segment (a key stored again replaces its
  row); those at or below it are not cached, and need not be;
- a range deleted: its rows leave the segment;
- a write whose message rows were not kept (an import, a point delete), or a row that
  is not a message row: the cache forgets every segment.

A segment becomes known when a write or a read first touches it: its floor is then its
greatest stored key, found by one reverse seek just before that write (or at that read),
so the rows the segment had before (written before the queue opened, or before the cache
forgot it) are not claimed, and the rows of that first write are cached. A restarted
collator reads from just past its ``processed_to``, below that floor, so its reads would
go to RocksDB until it had caught up: at the second such declined scan of a segment
(:meth:`MessageCache.missed`), once, the store reads every stored row at or below the
floor, forwards, and if they fit in :attr:`MessageCache.load_limit` (1/64 of the budget)
they join the segment and its floor drops to the prefix (:meth:`MessageCache.extend_down`).
When the cache holds more than its budget, it drops the oldest chunks of its largest
segment and raises that segment's floor past them. A scan is served from the cache only when it lies
inside one known segment, above its floor; any other scan goes to RocksDB. So the cache
never answers for a row it does not hold, and a damaged table is still read (and
reported) by RocksDB for every row the cache did not take (a load that meets damage
loads nothing: the segment stays RocksDB's below its floor).

Snapshots: :meth:`MessageCache.scan` picks the chunk parts it returns under the same
gate as the write path, and chunks are never changed once stored (a delete or an
eviction replaces or drops them), so a reader sees the cache as it was when its
snapshot was opened, whatever is written, collected or cleared afterwards.
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain, compress, islice, repeat
from operator import lt, or_, sub
from typing import Any, NamedTuple

from imq._native import speedups
from imq.storage import codec

__all__ = [
    "CHUNK_OVERHEAD",
    "LOAD_AFTER_MISSES",
    "ROUTE_LEN",
    "ChunkRows",
    "MessageCache",
    "Reader",
    "Tee",
]

Row = tuple[bytes, bytes]
Buffer = bytes | bytearray
Part = tuple[Buffer, Buffer, int, int]  # (data, offs, start row, stop row) of one chunk

Reader = tuple[int, int, int]
"""A merge iterator's destination test: (workchain byte, prefix length, prefix)."""

ROUTE_LEN = 9
"""A cached row's route: its value's first bytes, the destination's workchain + 128 and
the top 8 bytes of its account (what the merge's destination test reads)."""

_LOAD_SHARE = 64  # a segment loads this share of the budget below its floor, at most

LOAD_AFTER_MISSES = 2
"""Declined scans of a known segment after which the store loads its rows below the
floor (:meth:`MessageCache.missed`)."""

CHUNK_OVERHEAD = 256
"""Bytes a chunk costs beyond its two buffers (the objects that hold it), rounded up."""

_KEY_LEN = codec.MESSAGE_KEY_LEN
_HEADER_LEN = codec.MESSAGE_VALUE_HEADER_LEN
_OFF = "I"  # a row's offset in its chunk: a native uint32
if array(_OFF).itemsize != 4:  # pragma: no cover -- every platform CPython builds on
    raise ImportError("imq.storage.cache needs 4-byte unsigned ints")


# -- the chunk primitives, in Python (the C forms are in imq/_speedups.c) ----------------------


def _offsets(offs: Buffer) -> memoryview[int]:
    return memoryview(offs).cast("I")  # _OFF


def _chunk_check_py(data: Buffer, offs: Buffer) -> tuple[int, int, bool]:
    """The pure-Python :func:`imq._speedups.chunk_check`: (rows, value bytes, whether
    the keys strictly ascend); ``ValueError`` unless every row is a message row."""
    if len(offs) % 4:
        raise ValueError("a chunk's offsets must be uint32s")
    n = len(offs) // 4
    if (n and _offsets(offs)[0] != 0) or (not n and len(data)):  # rows start at 0; none, no bytes
        raise ValueError("a cached chunk must hold message rows")
    if not n:
        return 0, 0, True
    buf, starts, ends = _part_rows(data, offs, 0, n)
    # Every row at least a key and a value header long: the offsets then ascend, and the
    # last row (to the data's end) holds them all inside the data.
    if min(map(sub, ends, starts)) < _KEY_LEN + _HEADER_LEN:
        raise ValueError("a cached chunk must hold message rows")
    k = _KEY_LEN
    keys = [buf[at : at + k] for at in starts]
    ascending = all(map(lt, keys, islice(keys, 1, None)))
    return n, len(data) - n * k, ascending


def _chunk_bisect_py(data: Buffer, offs: Buffer, key: bytes) -> int:
    """The pure-Python :func:`imq._speedups.chunk_bisect`: the first row whose key is
    ``>= key``."""
    o = _offsets(offs)
    lo, hi = 0, len(o)
    while lo < hi:
        mid = (lo + hi) // 2
        if bytes(data[o[mid] : o[mid] + _KEY_LEN]) < key:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _part_rows(
    data: Buffer, offs: Buffer, start: int, stop: int
) -> tuple[bytes, list[int], list[int]]:
    """Rows ``start..stop`` (``start < stop``) of a chunk as one bytes copy of their span
    and each row's start and end in it (slicing a bytes object gives bytes, where a
    bytearray's slice would need a second copy)."""
    o = _offsets(offs)
    base = o[start]
    end = o[stop] if stop < len(o) else len(data)
    with memoryview(data) as view, view[base:end] as span:
        buf = bytes(span)
    starts = list(map(sub, o[start:stop], repeat(base)))
    ends = starts[1:]
    ends.append(end - base)
    return buf, starts, ends


def _rows_of(data: Buffer, offs: Buffer, start: int, stop: int) -> Iterator[Row]:
    """Rows ``start..stop`` of a chunk."""
    if start >= stop:
        return iter(())
    buf, starts, ends = _part_rows(data, offs, start, stop)
    k = _KEY_LEN
    return ((buf[at : at + k], buf[at + k : end]) for at, end in zip(starts, ends, strict=True))


def _accepted(buf: bytes, starts: list[int], lo: bytes, hi: bytes) -> list[bool]:
    """Per row (starting at ``starts``), whether its route (:data:`ROUTE_LEN` bytes after
    the key) lies in ``[lo, hi)``: a reader's destination test (its workchain byte, then
    its account prefix) as one range of routes, compared as bytes."""
    a, b = _KEY_LEN, _KEY_LEN + ROUTE_LEN
    return [lo <= buf[at + a : at + b] < hi for at in starts]


def _route_range(wc_byte: int, prefix_len: int, want: int) -> tuple[bytes, bytes]:
    """The routes a reader accepts, ``[lo, hi)``: its workchain byte and account prefix
    as the first :data:`ROUTE_LEN` bytes of a big-endian number, and the next prefix. A
    workchain no stored byte can name (-1: a reader outside every workchain imq stores)
    accepts nothing."""
    if not 0 <= wc_byte <= 0xFF:
        return b"", b""  # no bytes are below b""
    shift = 64 - prefix_len
    lo = (wc_byte << 64) | (want << shift)  # want is 0 when prefix_len is 0
    hi = lo + (1 << shift)
    # Past the last route (workchain byte 255, the last prefix): above every 9-byte route.
    top = hi.to_bytes(ROUTE_LEN, "big") if hi < 1 << 8 * ROUTE_LEN else b"\xff" * (ROUTE_LEN + 1)
    return lo.to_bytes(ROUTE_LEN, "big"), top


class _PyChunkRows:
    """The pure-Python form of :class:`imq._speedups.ChunkRows` (same contract): the rows
    of consecutive chunks (``datas[i]``, ``offss[i]``) from row ``start`` of the first to
    row ``stop`` of the last, lazily; with ``reader``, only every row the reader accepts
    and, of each run of rows it rejects, the last one (``dropped`` counts the others).
    Also the store's cursor interface: ``rows`` and ``items`` are the iterator itself,
    ``finish`` checks nothing, ``close`` ends it."""

    __slots__ = ("_rows", "dropped")

    def __init__(
        self,
        datas: list[Buffer],
        offss: list[Buffer],
        start: int,
        stop: int,
        reader: Reader | None = None,
    ) -> None:
        if len(datas) != len(offss):
            raise ValueError("datas and offss must be as long")
        self.dropped = 0
        last = len(datas) - 1
        parts = [
            (d, o, start if i == 0 else 0, stop if i == last else len(o) // 4)
            for i, (d, o) in enumerate(zip(datas, offss, strict=True))
        ]
        for _, o, a, b in parts:
            if not 0 <= a <= b <= len(o) // 4:
                raise ValueError("start/stop out of the chunk's rows")
        self._rows = self._walk(parts) if reader is None else self._filter(parts, *reader)

    def __iter__(self) -> _PyChunkRows:
        return self

    def __next__(self) -> Row:
        return next(self._rows)

    @property
    def rows(self) -> _PyChunkRows:
        return self

    @property
    def items(self) -> _PyChunkRows:
        return self

    def finish(self, last_key: bytes | None) -> None:
        """Nothing to check: the rows were in memory, nothing can end them early."""

    def close(self) -> None:
        self._rows = iter(())

    def count(self, lo: bytes, hi: bytes) -> int:
        raise ValueError("count needs a seekable cursor")

    @staticmethod
    def _walk(parts: list[Part]) -> Iterator[Row]:
        for d, o, start, stop in parts:
            yield from _rows_of(d, o, start, stop)

    def _filter(self, parts: list[Part], wc_byte: int, prefix_len: int, want: int) -> Iterator[Row]:
        """The rows ``reader`` accepts and the last row of each run it rejects. A part's
        destination tests run as one list comprehension over its rows; the loop runs
        only for the rows yielded. ``dropped`` grows just before the row that follows
        what it counts is yielded, as C's does."""
        lo, hi = _route_range(wc_byte, prefix_len, want)
        pending: Row | None = None  # a part's last row, rejected: kept if the run ends there
        gap = 0  # rows left out since the last row yielded
        for d, o, start, stop in parts:
            if start >= stop:
                continue
            buf, starts, ends = _part_rows(d, o, start, stop)
            accepted = _accepted(buf, starts, lo, hi)
            if pending is not None:
                if accepted[0]:  # the run ended with the previous part
                    self.dropped += gap
                    gap = 0
                    yield pending
                else:
                    gap += 1
                pending = None
            last = len(accepted) - 1
            # A row is yielded when accepted or followed by an accepted row; the part's
            # last row, when rejected, waits for the next part's first verdict.
            shown = map(or_, accepted, chain(islice(accepted, 1, None), (True,)))
            previous = -1
            for i in compress(range(last + 1), shown):
                gap += i - previous - 1
                previous = i
                at = starts[i]
                key_end = at + _KEY_LEN
                row = buf[at:key_end], buf[key_end : ends[i]]
                if i == last and not accepted[i]:
                    pending = row
                else:
                    self.dropped += gap
                    gap = 0
                    yield row
        if pending is not None:
            self.dropped += gap
            yield pending


class _PyTee:
    """The pure-Python form of :class:`imq._speedups.Tee` (same contract): calls
    ``put(key, value, target)``, then appends the row to the ``[data, offs]`` chunk of
    ``segments[key[:prefix_len]]``; ``unordered`` turns true once a row is not above the
    previous row of its chunk, ``invalid`` once a row is not a message row (bytes: a
    bytearray is refused as C refuses it). ``prefix_len`` is 1 to 64 (ValueError else);
    past the key, the prefix is the whole key."""

    __slots__ = ("_prefix_len", "_put", "_segments", "invalid", "unordered")

    def __init__(
        self,
        put: Callable[[bytes, bytes, Any], object],
        segments: dict[bytes, list[bytearray]],
        prefix_len: int,
    ) -> None:
        if not 1 <= prefix_len <= 64:  # the C Tee's range
            raise ValueError("prefix_len must be 1 to 64")
        self._put = put
        self._segments = segments
        self._prefix_len = prefix_len
        self.unordered = False
        self.invalid = False

    def __call__(self, key: bytes, value: bytes, target: Any) -> None:
        self._put(key, value, target)
        if self.invalid:
            return
        if (
            not isinstance(key, bytes)
            or not isinstance(value, bytes)
            or len(key) != _KEY_LEN
            or len(value) < _HEADER_LEN
        ):
            self.invalid = True
            return
        prefix = key[: self._prefix_len]
        chunk = self._segments.get(prefix)
        if chunk is None:
            chunk = self._segments[prefix] = [bytearray(), bytearray()]
        data, offs = chunk
        if offs:
            last = int.from_bytes(offs[-4:], sys.byteorder)
            if data[last : last + _KEY_LEN] >= key:
                self.unordered = True
        offs += len(data).to_bytes(4, sys.byteorder)
        data += key
        data += value


def _pack_py(rows: Sequence[Row]) -> tuple[bytes, bytes]:
    """The pure-Python :func:`imq._speedups.chunk_pack`: a chunk of ``rows`` (message
    rows, in order); ``ValueError`` for a key that is not a message key."""
    offs = array(_OFF)
    data = bytearray()
    for key, value in rows:
        if len(key) != _KEY_LEN:
            raise ValueError("a cached row's key must be a message key")
        offs.append(len(data))
        data += key
        data += value
    return bytes(data), offs.tobytes()


def _chunk_cut_py(data: Buffer, offs: Buffer, i: int, j: int) -> tuple[bytes, bytes]:
    """The pure-Python :func:`imq._speedups.chunk_cut`: the chunk without its rows
    ``[i, j)``, by slicing its buffers (no row objects)."""
    o = _offsets(offs)
    n = len(o)
    if not 0 <= i <= j <= n:
        raise ValueError("rows to cut out of the chunk's range")
    a = o[i] if i < n else len(data)
    b = o[j] if j < n else len(data)
    shift = b - a
    kept = array(_OFF, o[:i])
    kept.extend(x - shift for x in o[j:])
    return bytes(data[:a]) + bytes(data[b:]), kept.tobytes()


_C = speedups
Tee: Any = _PyTee if _C is None else _C.Tee
_chunk_check: Callable[[Buffer, Buffer], tuple[int, int, bool]] = (
    _chunk_check_py if _C is None else _C.chunk_check
)
_chunk_trim: Callable[[Buffer], None] = (lambda buffer: None) if _C is None else _C.chunk_trim
"""Give back a bytearray's slack (the C Tee sizes a chunk's buffer for a whole diff, and
doubles it when it must grow)."""
_chunk_bisect: Callable[[Buffer, Buffer, bytes], int] = (
    _chunk_bisect_py if _C is None else _C.chunk_bisect
)
_chunk_cut: Callable[[Buffer, Buffer, int, int], tuple[bytes, bytes]] = (
    _chunk_cut_py if _C is None else _C.chunk_cut
)
_pack: Callable[[list[Row]], tuple[bytes, bytes]] = _pack_py if _C is None else _C.chunk_pack
ChunkRows: Any = _PyChunkRows if _C is None else _C.ChunkRows
_value_new: Any = tuple.__new__ if _C is None else _C.value_new
_cache_scan: Callable[..., list[Any]] | None = None if _C is None else _C.cache_scan


class _ChunkFields(NamedTuple):
    data: Buffer
    offs: Buffer
    n: int
    first: bytes
    last: bytes
    nbytes: int


class _Chunk(_ChunkFields):
    """One batch's rows of one segment; never changed once made. A tuple of bytes and
    ints, built out of the cyclic GC's way (:func:`imq._speedups.value_new`): a queue
    with a deep backlog holds thousands, which every collection would walk."""

    __slots__ = ()

    def __new__(cls, data: Buffer, offs: Buffer, n: int) -> _Chunk:
        last = int.from_bytes(offs[-4:], sys.byteorder)
        fields = (
            data,
            offs,
            n,
            bytes(data[:_KEY_LEN]),
            bytes(data[last : last + _KEY_LEN]),
            len(data) + len(offs) + CHUNK_OVERHEAD,
        )
        chunk: _Chunk = _value_new(cls, fields)
        return chunk

    @classmethod
    def of(cls, rows: Sequence[Row]) -> _Chunk:
        data, offs = _pack(rows if type(rows) is list else list(rows))
        return cls(data, offs, len(rows))

    def cut(self, i: int, j: int) -> _Chunk:
        """This chunk without its rows ``[i, j)`` (some rows must stay)."""
        data, offs = _chunk_cut(self.data, self.offs, i, j)
        return _Chunk(data, offs, self.n - (j - i))

    def rows(self, start: int = 0, stop: int | None = None) -> list[Row]:
        return list(ChunkRows([self.data], [self.offs], start, self.n if stop is None else stop))

    def bisect(self, key: bytes) -> int:
        """The first row whose key is ``>= key``."""
        return _chunk_bisect(self.data, self.offs, key)


class _Segment:
    __slots__ = ("chunks", "datas", "firsts", "floor", "lasts", "misses", "nbytes", "offss")

    def __init__(self, floor: bytes) -> None:
        self.floor = floor  # rows stored above this key are exactly the chunks' rows
        self.misses = 0  # scans declined since it became known (-1: its load was tried)
        self.chunks: list[_Chunk] = []  # disjoint, ascending
        # In step with ``chunks``: each one's first and last key (for bisection) and its
        # buffers (what a scan hands ChunkRows, as list slices).
        self.firsts: list[bytes] = []
        self.lasts: list[bytes] = []
        self.datas: list[Buffer] = []
        self.offss: list[Buffer] = []
        self.nbytes = 0

    def splice(self, i: int, j: int, chunks: list[_Chunk]) -> int:
        """Replace chunks ``i:j`` with ``chunks``; the change in bytes. Costs what the
        replaced and new chunks are, plus a list splice: not the segment's length."""
        delta = sum(c.nbytes for c in chunks) - sum(c.nbytes for c in self.chunks[i:j])
        self.chunks[i:j] = chunks
        self.firsts[i:j] = [c.first for c in chunks]
        self.lasts[i:j] = [c.last for c in chunks]
        self.datas[i:j] = [c.data for c in chunks]
        self.offss[i:j] = [c.offs for c in chunks]
        self.nbytes += delta
        return delta

    def rows(self) -> list[Row]:
        return [row for c in self.chunks for row in c.rows()]


def _above(floor: bytes) -> bytes:
    """A bound for bisection: every message key above ``floor`` (a key, or the segment's
    prefix) sorts at or above ``floor`` followed by a zero byte; ``floor`` sorts below."""
    return floor + b"\x00"


class MessageCache:
    """Fresh message rows per segment (see the module docstring). Not thread-safe: the
    store calls every method under its write gate."""

    __slots__ = ("_budget", "_load_limit", "_nbytes", "_prefix_len", "_segments", "hits", "misses")

    def __init__(self, budget: int, prefix_len: int, load_limit: int | None = None) -> None:
        if budget < 0:
            raise ValueError("the cache budget must be >= 0 bytes")
        self._budget = budget
        self._load_limit = budget // _LOAD_SHARE if load_limit is None else load_limit
        self._prefix_len = prefix_len
        self._segments: dict[bytes, _Segment] = {}
        self._nbytes = 0
        self.hits = 0  # scans served, and scans left to RocksDB (the store counts them)
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self._budget > 0

    @property
    def nbytes(self) -> int:
        """What the cached chunks take: their buffers plus :data:`CHUNK_OVERHEAD` each."""
        return self._nbytes

    def __len__(self) -> int:
        return sum(c.n for s in self._segments.values() for c in s.chunks)

    def stats(self) -> dict[str, int]:
        """What the cache holds and how it served: its budget and bytes, segments,
        chunks and rows, and the scans it answered (``hits``) or left to RocksDB
        (``misses``; counted by the store)."""
        chunks = [c for s in self._segments.values() for c in s.chunks]
        return {
            "budget": self._budget,
            "bytes": self._nbytes,
            "segments": len(self._segments),
            "chunks": len(chunks),
            "rows": sum(c.n for c in chunks),
            "hits": self.hits,
            "misses": self.misses,
        }

    def segments(self) -> dict[bytes, tuple[bytes, list[Row]]]:
        """Each known segment's floor and its rows (for tests and inspection)."""
        return {p: (s.floor, s.rows()) for p, s in self._segments.items()}

    def check(self) -> None:
        """Raise ``AssertionError`` unless the bookkeeping holds (for tests): chunks
        disjoint and ascending above the floor, each strictly ascending, their first and
        last keys and sizes as recorded."""
        total = 0
        for segment in self._segments.values():
            previous = segment.floor
            for chunk in segment.chunks:
                n, _, ascending = _chunk_check_py(chunk.data, chunk.offs)
                if n != chunk.n or not n or not ascending:
                    raise AssertionError("a chunk is empty, miscounted or out of order")
                rows = chunk.rows()
                if (rows[0][0], rows[-1][0]) != (chunk.first, chunk.last):
                    raise AssertionError("a chunk's first or last key is wrong")
                if chunk.first <= previous:
                    raise AssertionError("chunks overlap, or a row lies at or below the floor")
                previous = chunk.last
            if (
                segment.firsts != [c.first for c in segment.chunks]
                or segment.lasts != [c.last for c in segment.chunks]
                or segment.datas != [c.data for c in segment.chunks]
                or segment.offss != [c.offs for c in segment.chunks]
            ):
                raise AssertionError("the per-chunk lists are out of step with the chunks")
            if segment.nbytes != sum(c.nbytes for c in segment.chunks):
                raise AssertionError("segment size miscounted")
            total += segment.nbytes
        if total != self._nbytes:
            raise AssertionError("cache size miscounted")

    # -- the write path ------------------------------------------------------------------------

    def forget(self) -> None:
        """Forget every segment (after a write whose message rows were not kept)."""
        self._segments.clear()
        self._nbytes = 0

    def unknown(self, prefixes: Iterable[bytes]) -> list[bytes]:
        """Those of ``prefixes`` whose segment the cache does not know (none when off)."""
        if not self.enabled:
            return []
        return [p for p in prefixes if p not in self._segments]

    @property
    def load_limit(self) -> int:
        """How many bytes of stored rows below a segment's floor the store may load into
        it (:meth:`missed`, :meth:`extend_down`): 1/64 of the budget unless given."""
        return self._load_limit

    def establish(self, prefix: bytes, top: bytes | None) -> None:
        """Start watching a segment whose greatest stored key is ``top`` (the prefix
        itself when it holds none): no row above it is stored, so none is cached. With
        ``top=None`` (RocksDB could not tell) the segment stays unknown."""
        if self.enabled and top is not None and prefix not in self._segments:
            self._segments[prefix] = _Segment(top)

    def missed(self, prefix: bytes) -> bytes | None:
        """Count a scan of the known segment ``prefix`` that the cache declined; at the
        :data:`LOAD_AFTER_MISSES`-th, once in the segment's life, its floor: the store
        may then read every stored row at or below it and hand them to
        :meth:`extend_down`. ``None`` otherwise (and when nothing lies below it).

        A restarted collator reads from just past its ``processed_to``, below everything
        written since the restart, so every such read misses until the readers have
        caught up; a one-off read (a reopen that reads one message) never loads."""
        segment = self._segments.get(prefix)
        if segment is None or segment.misses < 0 or segment.floor == prefix:
            return None
        segment.misses += 1
        if segment.misses < LOAD_AFTER_MISSES:
            return None
        segment.misses = -1
        return segment.floor

    def extend_down(self, prefix: bytes, rows: Sequence[Row]) -> None:
        """Take ``rows``, every stored row of the known segment ``prefix`` at or below its
        floor (ascending, read under the same gate): the segment then holds all its rows
        and its floor is the prefix. Rows that are not message rows, or out of order, or
        not at or below the floor, change nothing: the segment stays RocksDB's below its
        floor, which serves (and reports) them."""
        segment = self._segments.get(prefix)
        if segment is None:
            return
        if rows:
            try:
                # A chunk keeps no key lengths: a row is split at the key length, so a
                # stored key of another length (damage) must never enter one.
                if not all(len(k) == _KEY_LEN and len(v) >= _HEADER_LEN for k, v in rows):
                    raise ValueError("not message rows")
                chunk = _Chunk.of(rows)
                n, _, ascending = _chunk_check(chunk.data, chunk.offs)
                if n != len(rows) or not ascending:
                    raise ValueError("rows out of order")
                if chunk.first <= prefix or chunk.last > segment.floor:
                    raise ValueError("rows outside the segment's part below its floor")
            except ValueError:
                return
            self._nbytes += segment.splice(0, 0, [chunk])
        segment.floor = prefix
        if self._nbytes > self._budget:
            self._evict()

    def after_write(
        self,
        kept: Mapping[bytes, Sequence[Buffer]],
        deleted: Iterable[tuple[bytes, bytes]],
        *,
        in_order: bool = True,
    ) -> None:
        """Take one written batch: its deleted ranges of the messages table, then the rows
        it put, a ``[data, offs]`` chunk per segment (what :class:`Tee` builds), each
        strictly ascending when ``in_order``. Rows of a segment the cache does not know
        are not kept (the store establishes the segments a batch writes before writing
        it). A row that is not a message row makes the cache forget everything (it
        never serves what it cannot route)."""
        if not self.enabled:
            return
        try:
            for lo, hi in deleted:
                self._delete_range(lo, hi)
            for prefix, (data, offs) in kept.items():
                segment = self._segments.get(prefix)
                if segment is None or not offs:
                    continue
                _chunk_trim(data)
                _chunk_trim(offs)
                n, _, ascending = _chunk_check(data, offs)  # before anything changes
                chunk = _Chunk(data, offs, n)
                if not (in_order and ascending):  # sort; the last put of a key wins
                    chunk = _Chunk.of(sorted(dict(chunk.rows()).items()))
                self._add(segment, chunk)
        except ValueError:
            self.forget()
            return
        if self._nbytes > self._budget:
            self._evict()

    def _add(self, segment: _Segment, chunk: _Chunk) -> None:
        if chunk.first <= segment.floor:  # rows at or below the floor are not cached
            keep = chunk.bisect(_above(segment.floor))
            if keep == chunk.n:
                return
            chunk = chunk.cut(0, keep)
        chunks = segment.chunks
        n = len(chunks)
        if not chunks or chunk.first > chunks[-1].last:  # the usual case: the next diff
            self._nbytes += segment.splice(n, n, [chunk])
            return
        # Keys at or below the newest cached one: merge, a key put again replaces its row.
        merged = dict(segment.rows())
        merged.update(chunk.rows())
        self._nbytes += segment.splice(0, n, [_Chunk.of(sorted(merged.items()))])

    def _delete_range(self, lo: bytes, hi: bytes) -> None:
        segments: Iterable[_Segment] = self._segments.values()
        pre = lo[: self._prefix_len]
        if len(pre) == self._prefix_len and (hi[: len(pre)] == pre or hi == _prefix_end(pre)):
            # inside one segment (every delete of GC, a clear and an import is)
            one = self._segments.get(pre)
            segments = () if one is None else (one,)
        for segment in segments:
            chunks = segment.chunks
            k = bisect_left(segment.lasts, lo)  # the first chunk not wholly below lo
            m = bisect_left(segment.firsts, hi)  # the first chunk wholly at or above hi
            if k >= m:
                continue
            kept: list[_Chunk] = []
            for chunk in chunks[k:m]:
                i = chunk.bisect(lo) if chunk.first < lo else 0
                j = chunk.bisect(hi) if chunk.last >= hi else chunk.n
                if i >= j:
                    kept.append(chunk)  # nothing of it inside
                elif i > 0 or j < chunk.n:  # cut: a new chunk of what stays (sliced)
                    kept.append(chunk.cut(i, j))
                # else wholly inside: gone
            self._nbytes += segment.splice(k, m, kept)

    def _evict(self) -> None:
        """Drop the oldest chunks of the largest segment, raising its floor past them,
        until the chunks fit in three quarters of the budget."""
        target = self._budget * 3 // 4
        while self._nbytes > target:
            segment = max(self._segments.values(), key=lambda s: s.nbytes)
            if not segment.chunks:  # pragma: no cover -- the sizes are kept exactly
                break
            freed, count = 0, 0
            for chunk in segment.chunks:  # the oldest, as many as this segment can give
                if self._nbytes - freed <= target:
                    break
                freed += chunk.nbytes
                count += 1
            segment.floor = segment.chunks[count - 1].last
            self._nbytes += segment.splice(0, count, [])

    # -- the read path -------------------------------------------------------------------------

    def scan(self, lo: bytes, hi: bytes, reader: Reader | None = None) -> Any:
        """The stored rows with ``lo <= key < hi``, as a lazy iterator of ``(key, value)``
        (a :class:`ChunkRows`, its ``dropped`` the rows it left out), when the cache can
        tell them all (``lo`` above a known segment's floor, ``hi`` within the segment);
        else ``None``: read RocksDB. The iterator holds the chunks as they are now: later
        writes and deletes replace chunks, never change one.

        With ``reader`` (the merge iterator's destination test: workchain byte, prefix
        length, prefix), only the rows the merge can tell apart come: every row the reader
        accepts and of each run of rows it rejects the last one (see
        :class:`imq._speedups.ChunkRows`)."""
        found = self._span(lo, hi)
        if found is None:
            return None
        segment, k0, k1, start, stop = found
        if k0 >= k1:
            return ChunkRows([], [], 0, 0, reader)
        return ChunkRows(segment.datas[k0:k1], segment.offss[k0:k1], start, stop, reader)

    def count(self, lo: bytes, hi: bytes) -> int | None:
        """The number of stored rows with ``lo <= key < hi`` when the cache can tell
        them all (as :meth:`scan`), by bisection: no row is visited. Else ``None``."""
        found = self._span(lo, hi)
        if found is None:
            return None
        segment, k0, k1, start, stop = found
        if k0 >= k1:
            return 0
        chunks = segment.chunks
        return sum(chunks[k].n for k in range(k0, k1 - 1)) + stop - start

    def _span(self, lo: bytes, hi: bytes) -> tuple[_Segment, int, int, int, int] | None:
        """Where ``[lo, hi)`` lies in the cache: its segment, the chunks ``k0:k1`` that
        hold its rows, the first row in chunk ``k0`` and the end row in chunk ``k1 - 1``;
        ``None`` when the cache cannot tell all its rows (``lo`` at or below a known
        segment's floor, or ``hi`` past the segment)."""
        prefix = lo[: self._prefix_len]
        segment = self._segments.get(prefix)
        if (
            segment is None
            or lo <= segment.floor
            or (hi[: self._prefix_len] != prefix and hi != _prefix_end(prefix))
        ):
            return None
        k0 = bisect_left(segment.lasts, lo)  # the first chunk not wholly below lo
        k1 = bisect_left(segment.firsts, hi)  # the first chunk wholly at or above hi
        if k0 >= k1:
            return segment, k0, k1, 0, 0
        first, last = segment.chunks[k0], segment.chunks[k1 - 1]
        start = first.bisect(lo) if first.first < lo else 0
        stop = last.bisect(hi) if last.last >= hi else last.n
        return segment, k0, k1, start, stop

    def scan_many(self, bounds: list[tuple[bytes, bytes]], reader: Reader | None) -> list[Any]:
        """:meth:`scan` of each ``(lo, hi)`` of ``bounds`` (an iterator's ranges), in one
        call to C when it is built (:func:`imq._speedups.cache_scan`)."""
        if _cache_scan is not None:
            return _cache_scan(self._segments, self._prefix_len, bounds, reader)
        return [self.scan(lo, hi, reader) for lo, hi in bounds]


def _prefix_end(prefix: bytes) -> bytes:
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\xff" * (len(prefix) + 1)  # never equal to a scan's bound of this segment
    return stripped[:-1] + bytes((stripped[-1] + 1,))
