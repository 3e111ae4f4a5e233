"""Import into a queue that already holds diffs, then go on as a node does (behaviour
5.3, 5.5 and 5.8). Each test pins a finding of an outside audit of cold starts:

- an uncommitted diff the state does not hold, below the pointer the import sets, was
  committed by the import (a node that crashed while collating a block, then imported
  the network's state, delivered its own version of that block);
- a diff stored under the state's hash but ending above that pointer was "kept" and
  left uncommitted, for the next startup to delete;
- the import wrote no commit record entry, so a first commit that listed the shard with
  a skipped entry dropped it, and GC deleted imported messages the shard had not read;
- ``startup`` after an import by a block id without hashes said the queue was "ahead"
  and advised applying blocks; a conflict with a committed diff advised a clear."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from builders import BASE, MC, address_in, dump, open_queue

from imq import (
    BlockId,
    BlockIdShort,
    CommitError,
    DiffConflictError,
    Message,
    Queue,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    StartupError,
    TopBlock,
)
from imq.state.synth import SynthState, synth_state, write_synth_state

# Diffs 99 and 100; diff s holds messages at lts (s + 1) * 10**6 + 1.. (synth's layout),
# and reads BASE up to max_for_lt((s + 1) * 10**6 - 3).
STATE = synth_state(BASE, top_seqno=100, diffs=2, messages_per_diff=6)
TOP = STATE.diffs[0].tl.max_message


def _bytes(state: SynthState) -> bytes:
    buffer = io.BytesIO()
    write_synth_state(state, buffer)
    return buffer.getvalue()


def _apply(queue: Queue, seqno: int, lt: int, diff_hash: bytes) -> None:
    message = Message(QueueKey(lt, b"\x07" * 32), address_in(BASE, 1), address_in(BASE, 2))
    assert queue.apply_diff(QueueDiff([message]), BlockIdShort(BASE, seqno), diff_hash)


def _refused(queue: Queue, error: type[Exception], match: str) -> None:
    """Importing ``STATE`` raises ``error`` (matching ``match``) and changes no row."""
    before = dump(queue)
    with pytest.raises(error, match=match):
        queue.import_state(io.BytesIO(_bytes(STATE)), STATE.block_id, STATE.top_update)
    assert dump(queue) == before


def _messages(queue: Queue) -> list[QueueKey]:
    with queue.iterator(0, [QueueShardRange(BASE, QueueKey.MIN, QueueKey.MAX)], BASE) as it:
        return [m.message.key for m in it]


def test_an_uncommitted_diff_the_state_lacks_below_its_pointer_is_refused(tmp_path: Path) -> None:
    with open_queue(tmp_path / "q") as queue:
        _apply(queue, 50, 5_000, b"\x50" * 32)  # the node's own block 50, never committed
        _refused(queue, DiffConflictError, r"block 0:8000000000000000:50 .* would commit")
        queue.clear_uncommitted_state(top_shards=[BASE])
        assert queue.import_state(io.BytesIO(_bytes(STATE)), STATE.block_id).written_diffs == 2


def test_an_uncommitted_diff_above_the_states_pointer_stays_uncommitted(tmp_path: Path) -> None:
    with open_queue(tmp_path / "q") as queue:
        _apply(queue, 101, 300_000_000, b"\x65" * 32)
        queue.import_state(io.BytesIO(_bytes(STATE)), STATE.block_id, STATE.top_update)
        assert queue.get_commit_pointers()[BASE].key == TOP
        queue.clear_uncommitted_state(top_shards=[BASE])
        assert not queue.is_diff_exists(BlockIdShort(BASE, 101))
        assert len(_messages(queue)) == 12


def test_a_diff_stored_under_the_states_hash_ending_above_its_pointer_is_refused(
    tmp_path: Path,
) -> None:
    with open_queue(tmp_path / "q") as queue:
        _apply(queue, 100, TOP.lt + 50, STATE.diffs[0].hash)  # the state's hash, other content
        _refused(queue, DiffConflictError, "a hash that is not its own")


def test_the_imported_shard_holds_gc_back_when_the_first_commit_skips_its_entry(
    tmp_path: Path,
) -> None:
    with open_queue(tmp_path / "q") as queue:
        queue.import_state(io.BytesIO(_bytes(STATE)), STATE.block_id, STATE.top_update)
        assert queue.commit_record()[BASE] == dict(STATE.diffs[0].tl.processed_to)
        read_all = QueueDiff([], {BASE: TOP})  # the masterchain has read every message
        assert queue.apply_diff(read_all, BlockIdShort(MC, 1), b"\x01" * 32)
        skipped = TopBlock(BlockId(BASE, 98), 1, updated=False)  # no diff 98: skipped
        assert queue.commit_diff([TopBlock(BlockId(MC, 1), 1), skipped])
        assert BASE in queue.commit_record()
        queue.run_gc()
        # BASE itself has read its own messages only up to diff 99's: diff 100's stay.
        assert _messages(queue) == sorted(m.key for m in STATE.diffs[0].messages)


def test_startup_after_an_import_by_a_block_id_without_hashes_says_how_to_recover(
    tmp_path: Path,
) -> None:
    state = synth_state(MC, top_seqno=90, diffs=1, messages_per_diff=0)
    with open_queue(tmp_path / "q") as queue:
        queue.import_state(io.BytesIO(_bytes(state)), BlockId(MC, 90))
        full = BlockId(MC, 90, b"\x11" * 32, b"\x22" * 32)
        with pytest.raises(StartupError, match=r"without hashes.*full id") as info:
            queue.startup(full, [])
        assert "ahead" not in str(info.value)
        queue.startup(BlockId(MC, 90), [])  # the id it was imported with starts


def test_startup_on_another_block_of_the_same_seqno_is_another_chain(tmp_path: Path) -> None:
    state = synth_state(MC, top_seqno=90, diffs=1, messages_per_diff=0)
    with open_queue(tmp_path / "q") as queue:
        queue.import_state(io.BytesIO(_bytes(state)), BlockId(MC, 90, b"\x01" * 32, b"\x02" * 32))
        with pytest.raises(StartupError, match="another chain of blocks"):
            queue.startup(BlockId(MC, 90, b"\x11" * 32, b"\x22" * 32), [])


def test_a_conflict_with_a_committed_diff_does_not_advise_a_clear(tmp_path: Path) -> None:
    with open_queue(tmp_path / "q") as queue:
        _apply(queue, 100, TOP.lt - 10, b"\x99" * 32)  # another block 100, committed
        assert queue.apply_diff(QueueDiff(), BlockIdShort(MC, 1), b"\x01" * 32)
        assert queue.commit_diff([TopBlock(BlockId(MC, 1), 1), TopBlock(BlockId(BASE, 100), 1)])
        with pytest.raises(DiffConflictError) as info:
            queue.import_state(io.BytesIO(_bytes(STATE)), STATE.block_id, STATE.top_update)
        assert "is committed" in str(info.value) and "new, empty directory" in str(info.value)
        assert "clear the uncommitted zone" not in str(info.value)


def test_a_state_behind_the_queue_is_refused_as_such_before_any_advice_to_clear(
    tmp_path: Path,
) -> None:
    """Checked first: a queue already past the state (a higher committed seqno). A review
    found the uncommitted-diff refusal answering first, advising a clear that deleted
    the node's diff, after which the import failed on the pointer anyway."""
    with open_queue(tmp_path / "q") as queue:
        _apply(queue, 200, 5_000, b"\xc8" * 32)
        assert queue.apply_diff(QueueDiff(), BlockIdShort(MC, 1), b"\x01" * 32)
        assert queue.commit_diff([TopBlock(BlockId(MC, 1), 1), TopBlock(BlockId(BASE, 200), 1)])
        _apply(queue, 201, 20_000_000, b"\xc9" * 32)  # uncommitted, below the state's top
        _refused(queue, CommitError, "backwards")


def test_startup_by_an_id_without_hashes_on_a_queue_committed_on_the_full_id(
    tmp_path: Path,
) -> None:
    state = synth_state(MC, top_seqno=90, diffs=1, messages_per_diff=0)
    with open_queue(tmp_path / "q") as queue:
        queue.import_state(io.BytesIO(_bytes(state)), BlockId(MC, 90, b"\x01" * 32, b"\x02" * 32))
        with pytest.raises(StartupError, match="given without hashes; pass its full id"):
            queue.startup(BlockId(MC, 90), [])


def test_a_committed_diff_of_the_states_seqno_is_a_conflict_before_the_pointer(
    tmp_path: Path,
) -> None:
    """The stored diffs of the state's own seqnos are checked before the pointer: a queue
    that committed another block 100, ending above the state's, gets the conflict (the
    most specific answer, which says a clear cannot help), not "the pointer would move
    back". Found by the state fuzzer (a flipped byte in the newest diff of a state
    imported over itself) after a review had put the pointer check first."""
    with open_queue(tmp_path / "q") as queue:
        _apply(queue, 100, TOP.lt + 10, b"\x99" * 32)
        assert queue.apply_diff(QueueDiff(), BlockIdShort(MC, 1), b"\x01" * 32)
        assert queue.commit_diff([TopBlock(BlockId(MC, 1), 1), TopBlock(BlockId(BASE, 100), 1)])
        _refused(queue, DiffConflictError, "that diff is committed")
