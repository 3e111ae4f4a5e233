"""The compaction debt's range union (``imq.gc.union``): the merged ranges cover exactly
the points the given ranges cover, per table, and never overlap or touch each other."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from imq.gc import union
from imq.storage import Table

TABLES = (Table.MESSAGES, Table.DIFF_INFO)
POINT = st.integers(0, 40)


def _key(n: int) -> bytes:
    return n.to_bytes(2, "big")


@st.composite
def _ranges(draw: st.DrawFn) -> list[tuple[Table, bytes, bytes]]:
    out = []
    for _ in range(draw(st.integers(0, 12))):
        lo = draw(POINT)
        hi = draw(st.integers(lo + 1, 41))
        out.append((draw(st.sampled_from(TABLES)), _key(lo), _key(hi)))
    return out


def _points(ranges: list[tuple[Table, bytes, bytes]]) -> set[tuple[Table, int]]:
    return {
        (t, n)
        for t, lo, hi in ranges
        for n in range(int.from_bytes(lo, "big"), int.from_bytes(hi, "big"))
    }


@given(_ranges())
def test_union_covers_the_same_points_with_disjoint_ranges(
    ranges: list[tuple[Table, bytes, bytes]],
) -> None:
    merged = union(ranges)
    assert _points(merged) == _points(ranges)
    for (t1, _, hi1), (t2, lo2, _) in itertools.pairwise(merged):
        assert (t1.value, hi1) < (t2.value, lo2) if t1 is t2 else t1.value < t2.value


def test_touching_ranges_merge_and_tables_stay_apart() -> None:
    a, b, c = _key(1), _key(5), _key(9)
    assert union([(Table.DIFF_INFO, b, c), (Table.DIFF_INFO, a, b)]) == [(Table.DIFF_INFO, a, c)]
    assert union([(Table.MESSAGES, a, b), (Table.DIFF_INFO, a, b)]) == [
        (Table.DIFF_INFO, a, b),
        (Table.MESSAGES, a, b),
    ]
