"""An import next to rows a GC of other partitions left (D10, behaviour 5.7 and 5.8).

A GC of some partitions deletes a diff's records (tail and info) and its rows in those
partitions, and leaves its rows in the others until a GC of those reaches them. Such
rows have no record, so a state whose diff claims their keys was not seen to overlap
anything; its import wrote the marker, and a failure (or a crash and the next open)
rolled it back by deleting the diff's whole span in every partition the import wrote
into: the leftover rows with it, which the import had never written (an outside audit).
The import now finds such rows before it writes anything and refuses, naming them."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
from builders import BASE, MC, dump, open_queue, top

from imq import (
    Address,
    BlockIdShort,
    DiffConflictError,
    Message,
    PartitionRouter,
    Queue,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    StateFormatError,
)
from imq.state.synth import SynthState, synth_state, write_synth_state
from imq.storage import Table


def _state(routed: bool) -> SynthState:
    # Diff 99's messages lie in lts 100_000_001.. (synth: (seqno + 1) * 10**6 + 1 + j // 3).
    return synth_state(
        BASE, top_seqno=100, diffs=2, messages_per_diff=6, routed_every=2 if routed else 0
    )


def _leave_rows(queue: Queue, state: SynthState, kept: int) -> None:
    """A stored diff of BASE with one message in partition 0 and one in partition 1, both
    inside the state's diff 99; then a commit asking GC of the other partition only, and
    a GC pass: the diff's records go, its row in partition ``kept`` stays."""
    older = state.diffs[1].tl
    first = older.min_message.next_value()  # two keys inside diff 99's span
    second = first.next_value()
    assert second < older.max_message
    src = Address(0, bytes([0x10]) + bytes(31))
    to_p1 = Address(0, bytes([0x20]) + bytes(31))
    to_p0 = Address(0, bytes([0x30]) + bytes(31))
    router = PartitionRouter(dst={1: [to_p1]})
    diff = QueueDiff(
        [
            Message(first, src, to_p1, b"p1"),
            Message(second, src, to_p0, b"p0"),
        ],
        router=router,
    )
    assert queue.apply_diff(diff, BlockIdShort(BASE, 1), b"\x0b" * 32)
    read_to = QueueDiff([], {BASE: second})
    assert queue.apply_diff(read_to, BlockIdShort(MC, 1), b"\x0c" * 32)
    assert queue.commit_diff([top(MC, 1), top(BASE, 1)], partitions=(1 - kept,))
    queue.run_gc()
    assert queue.get_diff_info(BASE, 1) is None  # the records are gone
    with queue.iterator(kept, [QueueShardRange(BASE, QueueKey.MIN, QueueKey.MAX)], BASE) as it:
        assert [m.message.body for m in it] == [b"p1" if kept == 1 else b"p0"]


def _damaged(data: bytes) -> bytes:
    """The state with one bit of its last message's BOC flipped: the message's hash no
    longer matches, which the stream finds after the marker is written."""
    bad = bytearray(data)
    bad[-6] ^= 1
    return bytes(bad)


@pytest.mark.parametrize("kept", [0, 1], ids=["left-in-partition-0", "left-in-partition-1"])
@pytest.mark.parametrize("damaged", [False, True], ids=["whole", "damaged"])
def test_a_state_claiming_keys_of_leftover_rows_is_refused_and_nothing_changes(
    tmp_path: Path, kept: int, damaged: bool
) -> None:
    state = _state(routed=True)  # writes into partitions 0, 1 and 2
    buffer = io.BytesIO()
    write_synth_state(state, buffer)
    data = _damaged(buffer.getvalue()) if damaged else buffer.getvalue()
    with open_queue(tmp_path / "q") as queue:
        _leave_rows(queue, state, kept)
        before = dump(queue)
        with pytest.raises(DiffConflictError, match=rf"partition {kept} whose diff is no longer"):
            queue.import_state(io.BytesIO(data), state.block_id, state.top_update)
        assert dump(queue) == before
    with open_queue(tmp_path / "q") as queue:  # and nothing is rolled back at the next open
        assert dump(queue) == before


def test_leftover_rows_in_a_partition_the_state_does_not_write_stay_and_it_imports(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rollback deletes only in the partitions the import writes into (partition 0
    here): rows left in partition 1 are neither a conflict nor touched, and a failed
    import still rolls back exactly what it wrote."""
    state = _state(routed=False)
    buffer = io.BytesIO()
    write_synth_state(state, buffer)
    with open_queue(tmp_path / "q") as queue:
        _leave_rows(queue, state, kept=1)
        left = [(k, v) for k, v in dump(queue)[Table.MESSAGES.value]]
        before = dump(queue)
        with caplog.at_level(logging.WARNING, logger="imq"), pytest.raises(StateFormatError):
            queue.import_state(io.BytesIO(_damaged(buffer.getvalue())), state.block_id)
        assert "import_rolled_back" in caplog.text
        assert dump(queue) == before
        report = queue.import_state(io.BytesIO(buffer.getvalue()), state.block_id)
        assert report.written_diffs == 2
        stored = dump(queue)[Table.MESSAGES.value]
        assert set(left) <= set(stored)
        assert len(stored) == len(left) + len(state.messages)
