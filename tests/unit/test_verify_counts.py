"""verify's count of a diff's messages per partition (``imq.verify._check_messages``),
on rows given directly: which rows of a partition the diff's record does not list are a
problem, and which an older, collected diff may have left (docs/reliability.md,
integrity checks)."""

from __future__ import annotations

from pathlib import Path

from imq import QueueKey, ShardIdent
from imq.storage import codec
from imq.verify import Report, _check_messages, _orphan_reach, _Span

SHARD = ShardIdent(0, 0x4000_0000_0000_0000)


def _row(partition: int, lt: int, hash_: bytes | None = None) -> tuple[bytes, bytes]:
    key = QueueKey(lt, bytes([lt % 256]) * 32 if hash_ is None else hash_)
    return codec.message_key(partition, SHARD, key), b""


def _problems(
    rows: list[tuple[bytes, bytes]], reach: dict[tuple[int, ShardIdent], QueueKey]
) -> list[str]:
    # One stored diff, seqno 2, spanning lts 20..40 with 3 messages in partition 0.
    infos = {(SHARD, 2): (_Span(QueueKey.min_for_lt(20), QueueKey.max_for_lt(40)), {0: 3})}
    report = Report(Path("db"))
    _check_messages(sorted(rows), infos, reach, _orphan_reach(reach), report)
    return report.problems


def test_rows_of_an_unlisted_partition_in_a_diffs_span_are_a_problem() -> None:
    """No GC has run: a partition 1 row inside the span of a diff that stored none in
    partition 1 is no one's (the diff's own partition counts right)."""
    rows = [_row(0, 21), _row(0, 30), _row(0, 39), _row(1, 35)]
    assert _problems(rows, {}) == [
        f"diff {SHARD}:2 partition 1: 1 messages stored in its span, the diff record lists "
        "none in this partition"
    ]
    assert _problems(rows[:3], {}) == []


def test_rows_an_older_collected_diff_may_have_left_are_not_a_problem() -> None:
    """GC of partition 0 reached lt 30, so an older diff whose span ended there lost its
    records while its partition 1 rows stayed (docs/reliability.md: GC deletes a diff's
    records once any partition's bound passes it). Its rows at or below that reach may
    lie in this diff's span (spans may overlap; a collator never writes such diffs):
    they are not counted; a partition 1 row above the reach still is."""
    reach = {(0, SHARD): QueueKey.max_for_lt(30)}
    at_reach = _row(1, 30, b"\xff" * 32)  # the reach itself is inclusive
    rows = [_row(0, 35), _row(0, 36), _row(1, 25), _row(1, 30), at_reach]
    assert _problems(rows, reach) == []
    problems = _problems([*rows, _row(1, 31)], reach)
    assert problems == [
        f"diff {SHARD}:2 partition 1: 1 messages stored in its span, the diff record lists "
        "none in this partition"
    ]
