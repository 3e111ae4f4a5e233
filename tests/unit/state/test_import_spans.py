"""The import's overlap check of a state's diffs against the stored diffs' key spans."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from imq.state.importer import Spans
from imq.types import QueueKey

# Few distinct keys, so that spans touch, nest and share ends often.
keys = st.builds(QueueKey, st.integers(0, 12), st.sampled_from([bytes(32), b"\xff" * 32]))
spans = st.lists(st.tuples(keys, keys).map(sorted).map(tuple), max_size=12)


@given(spans, keys, keys)
def test_meet_is_the_plain_overlap_test(
    stored: list[tuple[QueueKey, QueueKey]], a: QueueKey, b: QueueKey
) -> None:
    lo, hi = min(a, b), max(a, b)
    plain = any(s <= hi and lo <= e for s, e in stored)
    assert Spans(stored).meet(lo, hi) == plain


def test_examples() -> None:
    k = [QueueKey(lt, bytes(32)) for lt in range(10)]
    stored = Spans([(k[1], k[2]), (k[5], k[8]), (k[6], k[6])])
    assert stored.meet(k[2], k[2])  # a shared end
    assert stored.meet(k[0], k[9])  # covers them all
    assert stored.meet(k[7], k[7])  # inside the long span, past the nested one
    assert not stored.meet(k[3], k[4])  # the gap
    assert not stored.meet(k[9], k[9])  # above every span
    assert not Spans([]).meet(k[0], k[9])
