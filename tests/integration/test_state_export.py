"""Exporting persistent queue states from a real RocksDB (SEMANTICS §13.2 with D11): the
real states come out byte for byte, generated states survive export then import into a
fresh queue unchanged, diffs applied through ``apply_diff`` export, and every refusal
(missing diff, bad tail length, messages collected by GC, bodies that are no message)
raises without leaving a file behind.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from builders import address_in, block, dump, message, open_queue, split_shard, top
from state_fixtures import (
    BASE,
    MC,
    REAL_STATES,
    SHARD_BIN,
    SHARD_TOP,
    ZSTD_MAGIC,
    RealState,
    block_id,
    boc_root_count,
    iterate,
    observable,
    parse_state,
    state_bytes,
    top_update,
    write_state,
)

from imq import (
    Address,
    BlockId,
    BlockIdShort,
    DiffStatistics,
    FileAccessError,
    ImqError,
    Message,
    Queue,
    QueueDiff,
    QueueKey,
    ShardIdent,
    StateFormatError,
)
from imq.state.boc import encode_boc
from imq.state.message import build_external_in_message, build_internal_message
from imq.state.synth import SynthState, synth_state


def _import_synth(queue: Queue, tmp_path: Path, **kwargs: Any) -> tuple[SynthState, Path]:
    state = synth_state(**kwargs)
    path, _ = write_state(state, tmp_path / "in.bin")
    queue.import_state(path, state.block_id, state.top_update)
    return state, path


def _fresh(tmp_path: Path, name: str) -> Queue:
    return open_queue(tmp_path / name)


def _no_leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".temp"))


# -- real states --------------------------------------------------------------------------------


def test_the_real_shard_state_exports_byte_identical(tmp_path: Path, queue: Queue) -> None:
    queue.import_state(SHARD_BIN, BlockId(BASE, 160), SHARD_TOP)
    original = SHARD_BIN.read_bytes()
    out = tmp_path / "out"
    out.mkdir()

    raw = queue.export_state(BASE, 160, 3, out / "state.bin")
    packed = queue.export_state(BASE, 160, 3, out / "state.queue")
    buffer = io.BytesIO()
    in_memory = queue.export_state(BASE, 160, 3, buffer)

    assert (out / "state.bin").read_bytes() == original
    assert buffer.getvalue() == original
    assert (out / "state.queue").read_bytes()[:4] == ZSTD_MAGIC
    assert state_bytes(out / "state.queue") == original
    for report in (raw, packed, in_memory):
        assert (report.diffs, report.messages, report.chunks) == (3, 4300, 1)
        assert report.bytes == len(original) == 538_308
        assert report.bit_exact
    assert _no_leftovers(out) == []
    with _fresh(tmp_path, "again") as again:
        report = again.import_state(out / "state.queue", BlockId(BASE, 160), SHARD_TOP)
        assert (report.diffs, report.messages) == (3, 4300)
        assert observable(again, BASE, (158, 159, 160)) == observable(queue, BASE, (158, 159, 160))


@pytest.mark.parametrize("real", REAL_STATES, ids=lambda r: r.id)
def test_every_real_state_exports_as_it_was_read(
    real: RealState, tmp_path: Path, queue: Queue
) -> None:
    queue.import_state(real.path, block_id(real), top_update(real))
    out = tmp_path / "out.bin"
    report = queue.export_state(real.shard, real.seqno, real.tail_len, out)
    assert out.read_bytes() == state_bytes(real.path)
    assert (report.diffs, report.messages, report.chunks) == (
        real.tail_len,
        sum(real.messages),
        real.chunks,
    )
    assert report.bit_exact


# -- generated states ---------------------------------------------------------------------------

SYNTH_CASES = {  # name: (synth_state arguments, chunks of the export)
    "routers-and-masterchain": (
        {"diffs": 3, "messages_per_diff": 20, "routed_every": 3, "masterchain_every": 4},
        1,
    ),
    "multi-cell": (
        {"diffs": 2, "messages_per_diff": 10, "body_in_ref": True, "body_bytes": 300},
        1,
    ),
    # Messages carrying a StateInit, inline and in a ref (the import walks it).
    "state-inits": ({"diffs": 2, "messages_per_diff": 12, "init_every": 2, "body_bytes": 40}, 1),
    "multi-chunk-with-an-empty-diff": ({"diffs": 3, "messages_per_diff": [7_000, 0, 5_000]}, 2),
    # D11: cut at 10 MiB; the original would announce ceil(5,200 / 10,000) = 1 chunk.
    "size-cut-chunks": ({"diffs": 1, "messages_per_diff": 5_200, "body_bytes": 2_000}, 2),
}


@pytest.mark.parametrize("case", list(SYNTH_CASES))
def test_generated_states_round_trip_through_export_and_import(
    case: str, tmp_path: Path, queue: Queue
) -> None:
    kwargs, chunks = SYNTH_CASES[case]
    state, original = _import_synth(queue, tmp_path, seed=11, **kwargs)
    seqnos = [d.seqno for d in state.diffs]
    out = tmp_path / "out.queue"

    report = queue.export_state(BASE, state.seqno, len(seqnos), out)

    assert out.read_bytes()[:4] == ZSTD_MAGIC
    oracle = parse_state(out)
    assert report.chunks == oracle.n_chunks == len(oracle.chunks) == chunks
    assert sum(boc_root_count(c) for c in oracle.chunks) == report.messages
    assert (report.diffs, report.messages) == (len(seqnos), len(state.messages))
    assert report.bytes == len(state_bytes(out))
    assert report.bit_exact
    assert state_bytes(out) == original.read_bytes()
    with _fresh(tmp_path, "again") as again:
        again.import_state(out, state.block_id, state.top_update)
        assert observable(again, BASE, seqnos) == observable(queue, BASE, seqnos)


def test_a_shorter_tail_exports_the_newest_diffs_and_extends_back(
    tmp_path: Path, queue: Queue
) -> None:
    state, _ = _import_synth(queue, tmp_path, diffs=3, messages_per_diff=8, routed_every=2)
    hashes = {d.seqno: d.hash for d in state.diffs}
    newest, older = tmp_path / "newest.bin", tmp_path / "older.bin"

    assert queue.export_state(BASE, 100, 2, newest).bit_exact
    assert queue.export_state(BASE, 99, 2, older).bit_exact

    assert [(d.seqno, d.hash) for d in parse_state(newest).diffs] == [
        (100, hashes[100]),
        (99, hashes[99]),
    ]
    assert [(d.seqno, d.hash) for d in parse_state(older).diffs] == [
        (99, hashes[99]),
        (98, hashes[98]),
    ]
    with _fresh(tmp_path, "older") as q:
        q.import_state(older, BlockId(BASE, 99), (hashes[99], 2))
        assert {s: q.get_diff_info(BASE, s) for s in (98, 99)} == {
            s: queue.get_diff_info(BASE, s) for s in (98, 99)
        }
    # The two newest, then the whole state: the stored diffs are kept, the third written,
    # and the database ends exactly as after importing the whole state at once.
    with _fresh(tmp_path, "grown") as q:
        q.import_state(newest, state.block_id, (hashes[100], 2))
        report = q.import_state(tmp_path / "in.bin", state.block_id, state.top_update)
        assert (report.diffs, report.written_diffs, report.kept_diffs) == (3, 1, 2)
        assert dump(q) == dump(queue)


# -- diffs applied through apply_diff ------------------------------------------------------------


def _real_messages(first_lt: int, dsts: list[Address]) -> list[Message]:
    src = address_in(BASE, 7)
    out = []
    for i, dst in enumerate(dsts):
        lt = first_lt + i
        cell = build_internal_message(src, dst, lt, value=1_000 + i, body=b"hi %d" % i)
        out.append(Message(QueueKey(lt, cell.hash), src, dst, encode_boc([cell])))
    return out


def test_applied_diffs_with_message_bocs_export_and_import_back(
    tmp_path: Path, queue: Queue
) -> None:
    dsts = [address_in(BASE, 1), address_in(MC, 2), address_in(BASE, 3)]
    first = _real_messages(1_000, dsts)
    second = _real_messages(2_000, dsts[::-1])
    processed = {MC: QueueKey.max_for_lt(5), BASE: QueueKey.max_for_lt(900)}
    queue.apply_diff(QueueDiff(first, processed), BlockIdShort(BASE, 10), b"\x0a" * 32)
    queue.apply_diff(QueueDiff(second, processed), BlockIdShort(BASE, 11), b"\x0b" * 32)
    out = tmp_path / "applied.bin"

    report = queue.export_state(BASE, 11, 2, out)

    assert (report.diffs, report.messages, report.chunks) == (2, 6, 1)
    assert not report.bit_exact  # the applied diffs' hashes are not the hashes of their TL
    oracle = parse_state(out)
    assert oracle.diffs[1].prev_hash == bytes(32)  # unknown: zero
    assert oracle.diffs[0].prev_hash == oracle.diffs[1].hash
    with _fresh(tmp_path, "imported") as q:
        q.import_state(out, BlockId(BASE, 11), (oracle.diffs[0].hash, 2))
        got = [m.message for f in (BASE, MC) for m in iterate(q, BASE, 0, f)]
        assert sorted(got, key=lambda m: m.key) == sorted(first + second, key=lambda m: m.key)
        for seqno, diff in zip((11, 10), oracle.diffs, strict=True):
            mine, theirs = q.get_diff_info(BASE, seqno), queue.get_diff_info(BASE, seqno)
            assert (mine.hash, mine.prev_hash) == (diff.hash, diff.prev_hash)
            assert (mine.min_message, mine.max_message, mine.processed_to) == (
                theirs.min_message,
                theirs.max_message,
                theirs.processed_to,
            )
            assert mine.shards_messages_count == theirs.shards_messages_count == {BASE: 2, MC: 1}
        again = io.BytesIO()
        assert q.export_state(BASE, 11, 2, again).bit_exact
        assert again.getvalue() == out.read_bytes()


# -- refusals -------------------------------------------------------------------------------------


def test_a_missing_diff_is_named(tmp_path: Path, queue: Queue) -> None:
    _import_synth(queue, tmp_path, diffs=3)  # seqnos 98..100
    out = tmp_path / "out.bin"
    with pytest.raises(ImqError, match=r"the diff of 0:8000000000000000:101 is not stored"):
        queue.export_state(BASE, 101, 1, out)
    with pytest.raises(ImqError, match=r"the diff of 0:8000000000000000:97 is not stored"):
        queue.export_state(BASE, 100, 4, out)
    with pytest.raises(ImqError, match=r"-1:8000000000000000:100 is not stored"):
        queue.export_state(MC, 100, 1, out)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["in.bin"]


@pytest.mark.parametrize(("seqno", "tail_len"), [(100, 0), (100, -1), (3, 5), (2_000, 1_001)])
def test_a_bad_tail_length_is_a_value_error(
    seqno: int, tail_len: int, tmp_path: Path, queue: Queue
) -> None:
    with pytest.raises(ValueError, match="tail_len"):
        queue.export_state(BASE, seqno, tail_len, tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()


@pytest.mark.parametrize("where", ["missing directory", "under a file", "a directory"])
def test_a_destination_that_cannot_be_written_fails_before_the_export(
    tmp_path: Path, queue: Queue, where: str
) -> None:
    """The library checked the path only once the state was ready: a queue whose bodies
    are no messages said so (StateFormatError) instead of naming the missing directory,
    and a good one did the whole export's work first (an outside walkthrough found it;
    the CLI checked already)."""
    src, dst = address_in(BASE, 1), address_in(BASE, 2)
    queue.apply_diff(
        QueueDiff([message(QueueKey(7, b"\x07" * 32), src, dst)]), block(BASE, 1), b"\x01" * 32
    )
    (tmp_path / "afile").write_text("x")
    before = sorted(p.name for p in tmp_path.iterdir())  # the queue's directory, the file
    dest = {
        "missing directory": tmp_path / "nowhere" / "out.queue",
        "under a file": tmp_path / "afile" / "out.queue",
        "a directory": tmp_path,
    }[where]
    with pytest.raises(FileAccessError, match="cannot write the state file"):
        queue.export_state(BASE, 1, 1, dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_messages_collected_by_gc_refuse_the_export(tmp_path: Path, queue: Queue) -> None:
    state, _ = _import_synth(queue, tmp_path, diffs=1, messages_per_diff=10, seed=3)
    bound = sorted(m.key for m in state.messages)[4]
    later = message(QueueKey(200_000_000, b"\x11" * 32), address_in(BASE, 1), address_in(BASE, 2))
    queue.apply_diff(
        QueueDiff([later], {BASE: bound, MC: QueueKey.MIN}), BlockIdShort(BASE, 101), b"\x22" * 32
    )
    queue.apply_diff(QueueDiff([], {BASE: bound}), BlockIdShort(MC, 5), b"\x33" * 32)
    assert queue.commit_diff([top(MC, 5), top(BASE, 101, 5)])
    assert queue.run_gc() > 0
    assert len(iterate(queue, BASE, 0, BASE)) == 5 + 1  # the upper half and the later diff

    with pytest.raises(ImqError, match=r"0:8000000000000000:100: it wrote 10 messages, 5 are") as e:
        queue.export_state(BASE, 100, 1, tmp_path / "out.queue")
    assert "export a newer block whose diffs it holds whole, or take this block's" in str(e.value)

    assert not (tmp_path / "out.queue").exists()
    assert _no_leftovers(tmp_path) == []


def test_a_body_that_is_no_message_fails_without_leaving_a_file(
    tmp_path: Path, queue: Queue
) -> None:
    src, dst = address_in(BASE, 1), address_in(BASE, 2)
    plain = [message(QueueKey(1_000 + i, bytes([i + 1]) * 32), src, dst) for i in range(3)]
    queue.apply_diff(QueueDiff(plain), BlockIdShort(BASE, 1), b"\x01" * 32)
    existing = tmp_path / "old.queue"
    existing.write_bytes(b"previous export")

    for dest in (tmp_path / "new.queue", tmp_path / "new.bin", existing):
        with pytest.raises(StateFormatError, match="not a message BOC") as info:
            queue.export_state(BASE, 1, 1, dest)
        assert f"message (lt 1000, hash {'01' * 32}) of the diff of {BASE}:1" in str(info.value)

    assert not (tmp_path / "new.queue").exists()
    assert not (tmp_path / "new.bin").exists()
    assert existing.read_bytes() == b"previous export"
    assert _no_leftovers(tmp_path) == []


def _refused_everywhere(queue: Queue, tmp_path: Path, seqno: int, says: str) -> None:
    """The export of ``seqno`` raises ``StateFormatError`` saying ``says`` for every kind of
    destination, which it leaves untouched: nothing created, nothing written, the old file
    as it was."""
    existing = tmp_path / "old.queue"
    existing.write_bytes(b"previous export")
    buffer = io.BytesIO()
    for dest in (tmp_path / "new.queue", tmp_path / "new.bin", existing, buffer):
        with pytest.raises(StateFormatError) as info:
            queue.export_state(BASE, seqno, 1, dest)
        assert says in str(info.value)
    assert buffer.getvalue() == b""
    assert existing.read_bytes() == b"previous export"
    assert not (tmp_path / "new.queue").exists()
    assert not (tmp_path / "new.bin").exists()
    assert _no_leftovers(tmp_path) == []


def test_two_messages_with_one_hash_refuse_the_export(tmp_path: Path, queue: Queue) -> None:
    src, dst = address_in(BASE, 1), address_in(BASE, 2)
    cell = build_internal_message(src, dst, 1_000)
    twins = [
        Message(QueueKey(lt, cell.hash), src, dst, encode_boc([cell])) for lt in (1_000, 1_001)
    ]
    queue.apply_diff(QueueDiff([*_real_messages(900, [dst]), *twins]), block(BASE, 1), b"\x01" * 32)
    h = cell.hash.hex()
    _refused_everywhere(
        queue,
        tmp_path,
        1,
        f"the diff of {BASE}:1: its messages (lt 1000, hash {h}), (lt 1001, hash {h}) have "
        "the same hash",
    )


@pytest.mark.parametrize("body_in_ref", [False, True], ids=["one-cell", "multi-cell"])
def test_a_body_that_does_not_hash_to_its_key_refuses_the_export(
    body_in_ref: bool, tmp_path: Path, queue: Queue
) -> None:
    src, dst = address_in(BASE, 1), address_in(BASE, 2)
    good = _real_messages(1_000, [dst, dst])
    cell = build_internal_message(src, dst, 1_100, body=b"x" * 40, body_in_ref=body_in_ref)
    assert bool(cell.refs) == body_in_ref
    wrong = Message(QueueKey(1_100, b"\x01" * 32), src, dst, encode_boc([cell]))
    queue.apply_diff(QueueDiff([*good, wrong]), block(BASE, 1), b"\x01" * 32)
    queue.apply_diff(QueueDiff(_real_messages(2_000, [dst])), block(BASE, 2), b"\x02" * 32)

    _refused_everywhere(
        queue,
        tmp_path,
        1,
        f"message (lt 1100, hash {'01' * 32}) of the diff of {BASE}:1 is stored with a body "
        f"whose root cell does not hash to the key's hash (its root cell hashes to "
        f"{cell.hash.hex()})",
    )
    with pytest.raises(StateFormatError, match=f"of the diff of {BASE}:1 is stored"):
        queue.export_state(BASE, 2, 2, io.BytesIO())  # found in an older diff of the tail
    assert queue.export_state(BASE, 2, 1, io.BytesIO()).messages == 1  # the newer diff alone


@pytest.mark.parametrize("field", ["destination", "source", "lt"])
def test_a_row_its_body_does_not_describe_refuses_the_export(
    field: str, tmp_path: Path, queue: Queue
) -> None:
    """A state holds only the bodies, and its import files each message by its body's
    header: a row stored under another lt, source or destination than its body names
    would come back elsewhere (or not at all), so the export refuses it."""
    src, dst = address_in(BASE, 1), address_in(BASE, 2)
    cell = build_internal_message(src, dst, 1_100, body=b"mine")
    stored = {
        "destination": (QueueKey(1_100, cell.hash), src, address_in(MC, 3)),
        "source": (QueueKey(1_100, cell.hash), address_in(BASE, 4), dst),
        "lt": (QueueKey(1_101, cell.hash), src, dst),
    }[field]
    wrong = Message(*stored, encode_boc([cell]))
    queue.apply_diff(
        QueueDiff([*_real_messages(1_000, [dst]), wrong]), block(BASE, 1), b"\x01" * 32
    )
    key = stored[0]
    _refused_everywhere(
        queue,
        tmp_path,
        1,
        f"message (lt {key.lt}, hash {key.hash.hex()}) of the diff of {BASE}:1 is stored with "
        f"lt {key.lt}, source {stored[1]}, destination {stored[2]}, but its body says with lt "
        f"1100, source {src}, destination {dst}",
    )


@pytest.mark.parametrize("where", ["another workchain", "the other half", "no std workchain"])
def test_a_source_outside_the_shard_refuses_the_export(
    tmp_path: Path, queue: Queue, where: str
) -> None:
    """``apply_diff`` stores a message sent from outside its block's shard (as the
    original does; ``QueueConfig.check_sources`` refuses it), but a state's import refuses
    one: so does the export, naming the message and its source."""
    if where == "another workchain":
        shard, src = MC, address_in(BASE, 1)
    elif where == "no std workchain":  # a shard whose workchain no std address has
        shard, src = ShardIdent.full(128), address_in(BASE, 1)
    else:  # 0:4000..: a source in 0:c000.., after one from inside
        shard, src = split_shard(0, 1, 0), address_in(split_shard(0, 1, 1), 1)
    inside = []
    if where == "the other half":
        own, to = address_in(shard, 7), address_in(MC, 3)
        first = build_internal_message(own, to, 1_000)
        inside = [Message(QueueKey(1_000, first.hash), own, to, encode_boc([first]))]
    dst = address_in(MC, 2)
    cell = build_internal_message(src, dst, 1_100, body=b"from outside")
    stranger = Message(QueueKey(1_100, cell.hash), src, dst, encode_boc([cell]))
    assert queue.apply_diff(QueueDiff([*inside, stranger]), block(shard, 1), b"\x01" * 32)
    buffer = io.BytesIO()
    with pytest.raises(StateFormatError) as info:
        queue.export_state(shard, 1, 1, buffer)
    assert str(info.value) == (
        f"cannot export the state of {shard}:1: message (lt 1100, hash {cell.hash.hex()}) of "
        f"the diff of {shard}:1 was sent from {src}, outside the shard (stored as "
        "QueueConfig.check_sources=False allows); the state's import would refuse it"
    )
    assert buffer.getvalue() == b""
    assert _no_leftovers(tmp_path) == []


def test_a_body_that_is_no_internal_message_refuses_the_export(
    tmp_path: Path, queue: Queue
) -> None:
    """A valid message BOC whose root hashes to the key, but an external message: the
    state's import reads only internal messages with standard addresses."""
    dst = address_in(BASE, 2)
    cell = build_external_in_message(dst, body=b"from outside")
    wrong = Message(QueueKey(1_100, cell.hash), address_in(BASE, 1), dst, encode_boc([cell]))
    queue.apply_diff(QueueDiff([wrong]), block(BASE, 1), b"\x01" * 32)
    _refused_everywhere(
        queue, tmp_path, 1, "is not an internal message with standard addresses (bad info:"
    )


def test_diffs_out_of_order_refuse_the_export(tmp_path: Path, queue: Queue) -> None:
    """``apply_diff`` checks a diff only against the commit pointer, so a queue can hold an
    older diff above a newer one; a state's reader refuses that, so the export does."""
    dst = address_in(BASE, 2)
    queue.apply_diff(QueueDiff(_real_messages(5_000, [dst])), block(BASE, 1), b"\x01" * 32)
    queue.apply_diff(QueueDiff(_real_messages(1_000, [dst])), block(BASE, 2), b"\x02" * 32)
    out = tmp_path / "out.bin"
    with pytest.raises(StateFormatError, match="ascending, disjoint message ranges") as info:
        queue.export_state(BASE, 2, 2, out)
    assert f"the diff of {BASE}:1 (up to (lt 5000, " in str(info.value)
    assert f"with a tail_len that stops above the diff of {BASE}:1" in str(info.value)
    assert not out.exists() and _no_leftovers(tmp_path) == []
    assert queue.export_state(BASE, 2, 1, io.BytesIO()).messages == 1  # each alone exports
    assert queue.export_state(BASE, 1, 1, io.BytesIO()).messages == 1


def test_an_older_empty_diff_ending_above_the_newest_refuses_the_export(
    tmp_path: Path, queue: Queue
) -> None:
    """An empty diff stored with explicit statistics bounds can end above a newer diff;
    the state's reader refuses a state holding that (its import would leave the older diff
    above the pointer it sets), so the export does, naming the diff."""
    dst = address_in(BASE, 2)
    high = QueueKey.max_for_lt(9_000)
    stats = DiffStatistics(BASE, QueueKey.min_for_lt(8_000), high, {})
    assert queue.apply_diff(QueueDiff(), block(BASE, 1), b"\x01" * 32, stats)
    queue.apply_diff(QueueDiff(_real_messages(1_000, [dst])), block(BASE, 2), b"\x02" * 32)
    out = tmp_path / "out.bin"
    with pytest.raises(StateFormatError, match="which the import of the state makes the commit"):
        queue.export_state(BASE, 2, 2, out)
    assert not out.exists() and _no_leftovers(tmp_path) == []
    assert queue.export_state(BASE, 2, 1, io.BytesIO()).messages == 1


def test_a_diff_past_the_formats_processed_to_limit_is_kept_and_refuses_the_export(
    tmp_path: Path, queue: Queue
) -> None:
    """I20: a diff with more ``processed_to`` entries than a state file holds (1,000) is
    stored and read back whole (the original writes it and then cannot read it); only its
    export is refused, and leaves nothing behind."""
    shards = [ShardIdent(0, (i << 54) | (1 << 53)) for i in range(1_001)]  # depth 10
    processed = {shard: QueueKey.min_for_lt(i + 1) for i, shard in enumerate(shards)}
    dst = address_in(BASE, 2)
    diff = QueueDiff(_real_messages(900, [dst]), processed)
    assert queue.apply_diff(diff, block(BASE, 1), b"\x01" * 32)
    info = queue.get_diff_info(BASE, 1)
    assert info is not None and info.processed_to == processed
    _refused_everywhere(queue, tmp_path, 1, "1001 processed_to entries, max 1000")
