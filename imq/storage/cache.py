"""The RocksDB store's cache of fresh message rows: reads of recent diffs skip RocksDB.

A collator reads what the other shards wrote a block or two ago. Served by RocksDB, each
such read opens one cursor per source shard (a seek into every memtable and young L0
file) and pulls every row of the range through rocksdict, most of them messages for
other shards. This cache keeps, per *segment* (one partition of one source shard: the
14-byte prefix of a message key), the rows a segment gained since the cache started
watching it, exactly as they are stored, so such a read becomes two bisections and a
list slice.

**The invariant.** For a segment the cache knows, it holds a *floor* key and a sorted
list of rows, and the rows of the segment stored in RocksDB with a key above the floor
are exactly those rows, byte for byte. Every change to the messages table passes here,
under the store's write gate, right after RocksDB took it:

- rows put (kept by the batch's :class:`~imq._speedups.Tee`): those above the floor join
  the list (a key stored again replaces its row); those at or below it are not cached,
  and need not be;
- a range deleted: its rows leave the list;
- a write whose message rows were not kept (an import, a point delete): the cache
  forgets every segment.

A segment becomes known when a write or a read first touches it: its floor is then its
greatest stored key, found by one reverse seek just before that write (or at that read),
so the rows the segment had before (written before the queue opened, or before the cache
forgot it) are never claimed, and the rows of that first write are cached.
When the cache holds more than its budget, it raises the floor of its largest segment
past the older half of that segment's rows. A scan is served from the cache only when
it lies inside one known segment, above its floor; any other scan goes to RocksDB. So
the cache never answers for a row it does not hold, and a damaged table is still read
(and reported) by RocksDB for every row written before the cache started watching.

Snapshots: :meth:`MessageCache.scan` copies the slice it returns under the same gate
as the write path, so a reader sees the cache as it was when its snapshot was opened,
whatever is written, collected or cleared afterwards.
"""

from __future__ import annotations

import operator
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from imq._native import speedups
from imq.storage import codec

__all__ = ["ROUTE_LEN", "ROW_OVERHEAD", "MessageCache", "Reader", "Tee"]

Row = tuple[bytes, bytes]

ROW_OVERHEAD = 160
"""Bytes a cached row costs beyond its key and value: two bytes objects' headers (33
each), the row tuple (56) and its slot in the list (8), rounded up."""

Reader = tuple[int, int, int]
"""A merge iterator's destination test: (workchain byte, prefix length, prefix)."""

ROUTE_LEN = 9
"""A cached row's route: its value's first bytes, the destination's workchain + 128 and
the top 8 bytes of its account (what the merge's destination test reads)."""

_KEY_LEN = codec.MESSAGE_KEY_LEN
_HEADER_LEN = codec.MESSAGE_VALUE_HEADER_LEN
_key = operator.itemgetter(0)
_value = operator.itemgetter(1)


class _PyTee:
    """The pure-Python form of :class:`imq._speedups.Tee` (same contract): calls
    ``put(key, value, target)``, then appends ``(key, value)`` to
    ``segments[key[:prefix_len]]``; ``unordered`` turns true once a row is not above the
    last row of its list."""

    __slots__ = ("_prefix_len", "_put", "_segments", "unordered")

    def __init__(
        self,
        put: Callable[[bytes, bytes, Any], object],
        segments: dict[bytes, list[Row]],
        prefix_len: int,
    ) -> None:
        self._put = put
        self._segments = segments
        self._prefix_len = prefix_len
        self.unordered = False

    def __call__(self, key: bytes, value: bytes, target: Any) -> None:
        self._put(key, value, target)
        rows = self._segments.setdefault(key[: self._prefix_len], [])
        if rows and rows[-1][0] >= key:
            self.unordered = True
        rows.append((key, value))


Tee: Any = _PyTee if speedups is None else speedups.Tee


class _Segment:
    __slots__ = ("floor", "keys", "nbytes", "routes", "rows")

    def __init__(self, floor: bytes) -> None:
        self.floor = floor  # rows stored above this key are exactly ``rows``
        self.rows: list[Row] = []
        self.keys: list[bytes] = []  # the rows' keys, for bisection
        self.routes = bytearray()  # ROUTE_LEN bytes a row, in step with ``rows``
        self.nbytes = 0


def _size(rows: Sequence[Row]) -> int:
    """What ``rows`` cost by the cache's accounting (their keys are message keys, of
    one length: :func:`_routes` checked them)."""
    return len(rows) * (_KEY_LEN + ROW_OVERHEAD + ROUTE_LEN) + sum(map(len, map(_value, rows)))


def _routes_py(rows: list[Row], start: int) -> tuple[bytes, int]:
    """The pure-Python :func:`imq._speedups.routes`: the routes of ``rows[start:]`` and
    the sum of their values' lengths."""
    out = bytearray()
    value_bytes = 0
    for key, value in rows[start:]:
        if len(key) != _KEY_LEN or len(value) < _HEADER_LEN:
            raise ValueError("a cached row must be a message row")
        out += value[:ROUTE_LEN]
        value_bytes += len(value)
    return bytes(out), value_bytes


def _sized(n: int, value_bytes: int) -> int:
    """What ``n`` rows whose values hold ``value_bytes`` cost by the cache's accounting."""
    return n * (_KEY_LEN + ROW_OVERHEAD + ROUTE_LEN) + value_bytes


def _filter_rows_py(  # noqa: PLR0917 -- the C function's positional signature
    rows: list[Row],
    routes: bytes | bytearray,
    start: int,
    stop: int,
    wc_byte: int,
    prefix_len: int,
    want: int,
) -> tuple[list[Row], int]:
    """The pure-Python :func:`imq._speedups.filter_rows`: every row of ``rows[start:stop]``
    the reader accepts, and of each run of rows it rejects only the last one."""
    kept: list[Row] = []
    pending = -1
    dropped = 0
    shift = 64 - prefix_len
    for i in range(start, stop):
        at = i * ROUTE_LEN
        accepted = routes[at] == wc_byte and (
            prefix_len == 0
            or int.from_bytes(routes[at + 1 : at + ROUTE_LEN], "big") >> shift == want
        )
        if accepted:
            if pending >= 0:
                kept.append(rows[pending])
                pending = -1
            kept.append(rows[i])
        else:
            if pending >= 0:
                dropped += 1
            pending = i
    if pending >= 0:
        kept.append(rows[pending])
    return kept, dropped


_routes: Callable[[list[Row], int], tuple[bytes, int]] = (
    _routes_py if speedups is None else speedups.routes
)
_filter_rows: Callable[..., tuple[list[Row], int]] = (
    _filter_rows_py if speedups is None else speedups.filter_rows
)


class MessageCache:
    """Fresh message rows per segment (see the module docstring). Not thread-safe: the
    store calls every method under its write gate."""

    __slots__ = ("_budget", "_nbytes", "_prefix_len", "_segments", "hits", "misses")

    def __init__(self, budget: int, prefix_len: int) -> None:
        if budget < 0:
            raise ValueError("the cache budget must be >= 0 bytes")
        self._budget = budget
        self._prefix_len = prefix_len
        self._segments: dict[bytes, _Segment] = {}
        self._nbytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self._budget > 0

    @property
    def nbytes(self) -> int:
        """What the cached rows cost, by :data:`ROW_OVERHEAD`'s accounting."""
        return self._nbytes

    def __len__(self) -> int:
        return sum(len(s.rows) for s in self._segments.values())

    def segments(self) -> dict[bytes, tuple[bytes, list[Row]]]:
        """Each known segment's floor and a copy of its rows (for tests and inspection)."""
        return {p: (s.floor, list(s.rows)) for p, s in self._segments.items()}

    def check(self) -> None:
        """Raise ``AssertionError`` unless the bookkeeping holds (for tests): keys and
        routes in step with the rows, rows strictly ascending above the floor, sizes
        summed exactly."""
        total = 0
        for segment in self._segments.values():
            rows = segment.rows
            if segment.keys != [r[0] for r in rows]:
                raise AssertionError("keys out of step with the rows")
            if bytes(segment.routes) != _routes_py(rows, 0)[0]:
                raise AssertionError("routes out of step with the rows")
            if any(a >= b for a, b in zip(segment.keys, segment.keys[1:], strict=False)):
                raise AssertionError("rows not strictly ascending")
            if rows and rows[0][0] <= segment.floor:
                raise AssertionError("a row at or below the floor")
            if segment.nbytes != _size(rows):
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

    def establish(self, prefix: bytes, top: bytes | None) -> None:
        """Start watching a segment whose greatest stored key is ``top`` (the prefix
        itself when it holds none): no row above it is stored, so none is cached. With
        ``top=None`` (RocksDB could not tell) the segment stays unknown."""
        if self.enabled and top is not None and prefix not in self._segments:
            self._segments[prefix] = _Segment(top)

    def after_write(
        self,
        kept: Mapping[bytes, list[Row]],
        deleted: Iterable[tuple[bytes, bytes]],
        *,
        in_order: bool = True,
    ) -> None:
        """Take one written batch: its deleted ranges of the messages table, then the rows
        it put, per segment, in the order put (each list strictly ascending when
        ``in_order``). Rows of a segment the cache does not know are not kept (the store
        establishes the segments a batch writes before writing it). A row that is not a
        message row makes the cache forget everything (it never serves what it cannot
        route)."""
        if not self.enabled:
            return
        try:
            for lo, hi in deleted:
                self._delete_range(lo, hi)
            for prefix, put in kept.items():
                segment = self._segments.get(prefix)
                if segment is None or not put:
                    continue
                # Out of order: sort, and the last put of a key wins, as in the batch.
                self._add(segment, put if in_order else sorted(dict(put).items()))
        except ValueError:
            self.forget()
            return
        if self._nbytes > self._budget:
            self._evict()

    def _add(self, segment: _Segment, rows: list[Row]) -> None:
        cached = segment.rows
        floor = segment.floor
        if rows[0][0] <= floor:
            rows = rows[bisect_right(rows, floor, key=_key) :]
            if not rows:
                return
        if not cached or rows[0][0] > cached[-1][0]:
            routes, value_bytes = _routes(rows, 0)  # checks every row before any change
            cached.extend(rows)  # the usual case: a shard's next diff
            segment.keys.extend(map(_key, rows))
            segment.routes += routes
            added = _sized(len(rows), value_bytes)
        else:  # keys at or below the newest cached one: merge, a key put again replaces
            merged = dict(cached)
            merged.update(rows)
            rebuilt = sorted(merged.items())
            routes, _ = _routes(rebuilt, 0)
            before = segment.nbytes
            cached[:] = rebuilt
            segment.keys[:] = map(_key, rebuilt)
            segment.routes[:] = routes
            segment.nbytes = _size(rebuilt)
            added = segment.nbytes - before
            self._nbytes += added
            return
        segment.nbytes += added
        self._nbytes += added

    def _delete_range(self, lo: bytes, hi: bytes) -> None:
        for segment in self._segments.values():
            rows = segment.rows
            if not rows or rows[-1][0] < lo or rows[0][0] >= hi:
                continue
            keys = segment.keys
            i = bisect_left(keys, lo)
            j = bisect_left(keys, hi)
            if i < j:
                gone = _size(rows[i:j])
                del rows[i:j]
                del keys[i:j]
                del segment.routes[i * ROUTE_LEN : j * ROUTE_LEN]
                segment.nbytes -= gone
                self._nbytes -= gone

    def _evict(self) -> None:
        """Raise floors until the rows fit in three quarters of the budget: each step
        drops the older half of the largest segment's rows."""
        target = self._budget * 3 // 4
        while self._nbytes > target:
            segment = max(self._segments.values(), key=lambda s: s.nbytes)
            rows = segment.rows
            if not rows:  # pragma: no cover -- the sizes are kept exactly
                break
            cut = max(1, len(rows) // 2)
            gone = _size(rows[:cut])
            segment.floor = rows[cut - 1][0]
            del rows[:cut]
            del segment.keys[:cut]
            del segment.routes[: cut * ROUTE_LEN]
            segment.nbytes -= gone
            self._nbytes -= gone

    # -- the read path -------------------------------------------------------------------------

    def scan(
        self, lo: bytes, hi: bytes, reader: Reader | None = None
    ) -> tuple[list[Row], int] | None:
        """The stored rows with ``lo <= key < hi`` as a new list, and how many were left
        out, when the cache can tell them all (``lo`` above a known segment's floor,
        ``hi`` within the segment); else ``None``: read RocksDB.

        With ``reader`` (the merge iterator's destination test: workchain byte, prefix
        length, prefix), only the rows the merge can tell apart are returned: every row
        the reader accepts and of each run of rows it rejects the last one (see
        :func:`imq._speedups.filter_rows`)."""
        prefix = lo[: self._prefix_len]
        segment = self._segments.get(prefix)
        if (
            segment is None
            or lo <= segment.floor
            or (hi[: self._prefix_len] != prefix and hi != _prefix_end(prefix))
        ):
            self.misses += 1
            return None
        self.hits += 1
        rows = segment.rows
        keys = segment.keys
        if not keys or hi <= keys[0] or lo > keys[-1]:
            return [], 0
        i = bisect_left(keys, lo)
        j = bisect_left(keys, hi)
        if reader is None:
            return rows[i:j], 0
        return _filter_rows(rows, segment.routes, i, j, *reader)


def _prefix_end(prefix: bytes) -> bytes:
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\xff" * (len(prefix) + 1)  # never equal to a scan's bound of this segment
    return stripped[:-1] + bytes((stripped[-1] + 1,))
