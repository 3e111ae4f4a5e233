"""Importing persistent queue states into a real RocksDB (SEMANTICS §13.5 with D10, D11,
D13): every real tycho file, the real shard state's messages read back, idempotence,
conflicts and the all-or-nothing rule, and generated states with what the real files
lack (router partitions, masterchain destinations, multi-cell messages, many chunks).

Expected values come from the data README and from oracles that share no code with
``imq.state`` (``state_fixtures``).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
from collections import Counter
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import blake3
import pytest
from builders import address_in, dump, message, open_queue
from state_fixtures import (
    BASE,
    DUMP_STATES,
    FIRST_BLOCK,
    FIRST_DIFF_HASH,
    MASTER_STATE,
    MASTER_TOP,
    MC,
    REAL_BLOCKS,
    REAL_STATES,
    SHARD_BIN,
    SHARD_STATE,
    SHARD_TOP,
    STATE_MAGIC,
    ZSTD_MAGIC,
    RealState,
    block_id,
    boc_root_count,
    expected_info,
    expected_partition,
    full,
    iterate,
    oracle_block,
    oracle_messages,
    parse_state,
    state_bytes,
    top_update,
    write_state,
)

from imq import (
    BlockId,
    BlockIdShort,
    CommitError,
    CommitPointer,
    DiffConflictError,
    DiffZone,
    Queue,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    StateFormatError,
)
from imq.state import importer
from imq.state.block import BlockTopUpdate, parse_block_id_name, read_block_top_update
from imq.state.boc import decode_boc, encode_boc
from imq.state.message import build_internal_message, build_message_with_var_address
from imq.state.synth import SynthState, synth_state
from imq.state.tl import TlDiff, diff_hash, encode_diff
from imq.state.writer import ChunkSpool
from imq.state.writer import write_state as write_raw_state

Logs = list[MutableMapping[str, Any]]
LEFT = ShardIdent(0, 0x4000_0000_0000_0000)


def import_real(queue: Queue, real: RealState) -> None:
    queue.import_state(real.path, block_id(real), top_update(real))


# -- every real file ----------------------------------------------------------------------------


@pytest.mark.parametrize("real", REAL_STATES, ids=lambda r: r.id)
def test_every_real_state_imports_with_its_readme_values(real: RealState, queue: Queue) -> None:
    oracle = parse_state(real.path)
    data = state_bytes(real.path)
    top = top_update(real)
    bid = block_id(real)
    # What the README and the file name say, read by the oracle.
    magic = ZSTD_MAGIC if real.path.suffix == ".queue" else STATE_MAGIC
    assert real.path.read_bytes()[:4] == magic
    assert (bid.shard, bid.seqno) == (oracle.shard, oracle.seqno) == (real.shard, real.seqno)
    assert tuple(d.seqno for d in oracle.diffs) == real.seqnos
    assert tuple(len(d.hashes) for d in oracle.diffs) == real.messages
    assert oracle.diffs[0].hash.hex().startswith(real.top_hash)
    assert oracle.n_chunks == len(oracle.chunks) == real.chunks
    if top is not None:
        assert top == (oracle.diffs[0].hash, real.tail_len)

    report = queue.import_state(real.path, bid, top)

    assert (report.diffs, report.messages) == (real.tail_len, sum(real.messages))
    assert (report.written_diffs, report.kept_diffs) == (real.tail_len, 0)
    assert report.bytes == len(data)
    assert report.source_bytes == real.path.stat().st_size
    assert report.seconds > 0
    dsts = [m.dst for m in oracle_messages(oracle)]
    first = 0
    for i, diff in enumerate(oracle.diffs):
        n = len(diff.hashes)
        info = queue.get_diff_info(real.shard, diff.seqno)
        assert info == expected_info(diff, dsts[first : first + n])
        first += n
        if i + 1 < len(oracle.diffs):
            assert info.prev_hash == oracle.diffs[i + 1].hash
        assert queue.is_diff_exists(BlockIdShort(real.shard, diff.seqno))
        # The imported state counts as committed.
        assert queue.get_diff_info(real.shard, diff.seqno, DiffZone.COMMITTED) == info
        assert queue.get_diff_info(real.shard, diff.seqno, DiffZone.UNCOMMITTED) is None
    assert first == len(dsts)
    assert queue.get_diff_info(real.shard, real.seqno + 1) is None
    assert not queue.is_diff_exists(BlockIdShort(real.shard, real.seqno - real.tail_len))
    newest = oracle.diffs[0]
    assert queue.get_commit_pointers() == {
        real.shard: CommitPointer(newest.max_message, real.seqno)
    }
    assert queue.get_last_committed_mc_block_id() == (bid if real.shard == MC else None)
    assert queue.get_diffs_tail_len(real.shard, QueueKey.MIN) == real.tail_len
    assert queue.get_diffs_tail_len(real.shard, newest.max_message) == 1
    assert queue.get_diffs_tail_len(real.shard, newest.max_message.next_value()) == 0
    assert queue.get_last_applied_seqno(real.shard) == real.seqno


@pytest.mark.parametrize("folder", ["dump", "dump_one_shard"])
def test_a_dump_folder_imports_masterchain_first_then_its_shard_states(
    folder: str, queue: Queue
) -> None:
    states = [s for s in DUMP_STATES if s.path.parent.parent.name == folder]
    (mc,) = [s for s in states if s.shard == MC]
    older, newer = sorted((s for s in states if s.shard == BASE), key=lambda s: s.seqno)
    for real in (mc, older, newer):
        import_real(queue, real)

    # Shard states leave the last committed masterchain block alone.
    assert queue.get_last_committed_mc_block_id() == block_id(mc)
    assert set(queue.get_commit_pointers()) == {MC, BASE}
    assert queue.get_commit_pointers()[BASE].seqno == newer.seqno
    assert queue.get_diffs_tail_len(BASE, QueueKey.MIN) == older.tail_len + newer.tail_len
    # The newer state's diff chains to the older state's top diff (README).
    top_of_older = queue.get_diff_info(BASE, older.seqno)
    assert queue.get_diff_info(BASE, newer.seqno).prev_hash == top_of_older.hash


def test_a_shard_state_after_the_master_state_keeps_the_last_committed_block(
    queue: Queue,
) -> None:
    master = BlockId(MC, 90, b"\x01" * 32, b"\x02" * 32)
    queue.import_state(MASTER_STATE.path, master, MASTER_TOP)
    assert queue.get_last_committed_mc_block_id() == master
    queue.import_state(SHARD_BIN, BlockId(BASE, 160), SHARD_TOP)
    assert queue.get_last_committed_mc_block_id() == master


@pytest.mark.parametrize("block", [*REAL_BLOCKS, FIRST_BLOCK], ids=lambda p: p.name[:24])
def test_real_block_ids_and_top_updates_agree_with_their_names(block: Path) -> None:
    """The oracle's reading of the real blocks, which the import tests rely on."""
    oracle = oracle_block(block)
    if block == FIRST_BLOCK:
        bid = BlockId.parse((block.parent / "first_block_id.txt").read_text().strip())
        assert oracle.diff_hash.hex() == FIRST_DIFF_HASH
    else:
        bid = parse_block_id_name(block.name)
    assert (oracle.root_hash, oracle.file_hash) == (bid.root_hash, bid.file_hash)


@pytest.mark.parametrize("block", [*REAL_BLOCKS, FIRST_BLOCK], ids=lambda p: p.name[:24])
def test_read_block_top_update_reads_the_real_blocks(block: Path) -> None:
    update = read_block_top_update(block.read_bytes())
    oracle = oracle_block(block)
    assert update == BlockTopUpdate(
        oracle.root_hash, oracle.file_hash, oracle.diff_hash, oracle.tail_len
    )
    if block != FIRST_BLOCK:
        bid = parse_block_id_name(block.name)
        assert (update.root_hash, update.file_hash) == (bid.root_hash, bid.file_hash)


# -- the real shard state's messages ------------------------------------------------------------


def test_the_real_shard_state_reads_back_message_by_message(queue: Queue) -> None:
    queue.import_state(SHARD_BIN, BlockId(BASE, 160), SHARD_TOP)
    queue.import_state(MASTER_STATE.path, BlockId(MC, 90), MASTER_TOP)
    oracle = parse_state(SHARD_BIN)
    newest = oracle.diffs[0]
    by_hash = {m.hash: m for m in oracle_messages(oracle)}

    got = iterate(queue, BASE, 0, BASE)

    keys = [m.message.key for m in got]
    assert len(got) == 4300
    assert all(a < b for a, b in itertools.pairwise(keys))
    assert {k.hash for k in keys} == set(newest.hashes)
    assert {m.source for m in got} == {BASE}
    for item in got:
        msg = item.message
        expected = by_hash[msg.key.hash]
        assert (msg.key.lt, msg.src, msg.dst) == (expected.lt, expected.src, expected.dst)
        (root,) = decode_boc(msg.body)
        assert root.hash == msg.key.hash
        assert not root.refs
        assert newest.min_message <= msg.key <= newest.max_message
    dsts = Counter(m.message.dst for m in got)
    assert queue.load_diff_statistics(0, full(BASE)) == dsts
    assert queue.load_separated_diff_statistics([0, 1], full(BASE)) == {
        0: {newest.max_message: dsts},
        1: {},
    }
    assert queue.get_diff_info(BASE, 160).shards_messages_count == {BASE: 4300}
    # No masterchain destinations, nothing outside partition 0, nothing from the masterchain.
    assert iterate(queue, BASE, 0, MC) == []
    assert iterate(queue, BASE, 1, BASE) == []
    assert iterate(queue, MC, 0, BASE) == iterate(queue, MC, 0, MC) == []
    # A sub-shard and a sub-range select exactly their part.
    assert iterate(queue, BASE, 0, LEFT) == [m for m in got if m.message.dst.account[0] < 0x80]
    mid = keys[2150]
    with queue.iterator(0, [QueueShardRange(BASE, mid, QueueKey.MAX)], BASE) as it:
        assert [m.message.key for m in it] == keys[2150:]


# -- idempotence, conflicts, all or nothing -----------------------------------------------------


@pytest.mark.parametrize("real", [SHARD_STATE, MASTER_STATE, DUMP_STATES[4]], ids=lambda r: r.id)
def test_importing_the_same_state_twice_keeps_every_row(real: RealState, queue: Queue) -> None:
    first = queue.import_state(real.path, block_id(real), top_update(real))
    before = dump(queue)

    second = queue.import_state(real.path, block_id(real), top_update(real))

    assert (second.diffs, second.messages) == (first.diffs, first.messages)
    assert (second.written_diffs, second.kept_diffs) == (0, first.diffs)
    assert dump(queue) == before


def _synth(tmp_path: Path, name: str, **kwargs: Any) -> tuple[SynthState, Path]:
    state = synth_state(**kwargs)
    path, _ = write_state(state, tmp_path / name)
    return state, path


def _import(queue: Queue, state: SynthState, path: Path) -> importer.ImportReport:
    return queue.import_state(path, state.block_id, state.top_update)


def test_a_diff_stored_with_another_hash_conflicts_and_nothing_changes(
    tmp_path: Path, queue: Queue
) -> None:
    stored, stored_path = _synth(tmp_path, "a.bin", seed=1)
    other, other_path = _synth(tmp_path, "b.bin", seed=2)
    assert [d.seqno for d in stored.diffs] == [d.seqno for d in other.diffs]
    _import(queue, stored, stored_path)
    before = dump(queue)

    with pytest.raises(DiffConflictError, match=r"0:8000000000000000:100 is already stored"):
        _import(queue, other, other_path)

    assert dump(queue) == before


def test_an_older_state_after_a_newer_one_would_move_the_pointer_back(
    tmp_path: Path, queue: Queue
) -> None:
    newer, newer_path = _synth(tmp_path, "new.bin", top_seqno=100, diffs=2, seed=1)
    older, older_path = _synth(tmp_path, "old.bin", top_seqno=90, diffs=2, seed=2)
    _import(queue, newer, newer_path)
    before = dump(queue)

    with pytest.raises(CommitError, match="move the commit pointer") as refused:
        _import(queue, older, older_path)
    # The next step is an import's, not a commit's (an outside audit found the commit's)
    assert "already past that state: import the state of a newer block" in str(refused.value)
    assert "top blocks" not in str(refused.value)

    assert dump(queue) == before


def test_an_older_real_state_after_a_newer_one_is_refused(queue: Queue) -> None:
    older, newer = DUMP_STATES[1], DUMP_STATES[2]  # dump 0:35 and 0:36
    import_real(queue, newer)
    before = dump(queue)
    with pytest.raises(CommitError):
        import_real(queue, older)
    assert dump(queue) == before


def test_a_diff_overlapping_a_stored_diff_conflicts(tmp_path: Path, queue: Queue) -> None:
    state, path = _synth(tmp_path, "a.bin", diffs=1, messages_per_diff=6)
    inside = state.diffs[0].messages[0].key  # a key inside the state's only diff
    src, dst = address_in(BASE, 1), address_in(BASE, 2)
    queue.apply_diff(QueueDiff([message(inside, src, dst)]), BlockIdShort(BASE, 50), b"\x05" * 32)
    before = dump(queue)

    with pytest.raises(DiffConflictError, match="overlaps a stored diff"):
        _import(queue, state, path)

    assert dump(queue) == before


def test_a_state_failing_after_some_batches_rolls_back_completely(
    tmp_path: Path, logs: Logs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D10: batches are written as the file streams; a late failure removes them all."""
    monkeypatch.setattr(importer, "BATCH_ROWS", 8)
    queue = open_queue(tmp_path / "q")
    try:
        master = BlockId(MC, 90)
        queue.import_state(MASTER_STATE.path, master, MASTER_TOP)
        state, path = _synth(tmp_path, "s.bin", diffs=3, messages_per_diff=20, seed=4)
        write_state(state, path, max_chunk_roots=20)
        data = bytearray(path.read_bytes())
        data[-40] ^= 0xFF  # inside the last chunk: the oldest diff's messages
        path.write_bytes(bytes(data))
        before = dump(queue)
        seen: list[int] = []

        with pytest.raises(StateFormatError, match="chunk 2"):
            queue.import_state(
                path, state.block_id, state.top_update, progress=lambda d, _: seen.append(d)
            )

        assert max(seen) >= 40  # two diffs had been streamed and written
        assert dump(queue) == before
        assert [e["diffs"] for e in logs if e["event"] == "import_rolled_back"] == [[100, 99, 98]]
        # The intact file imports afterwards.
        write_state(state, path, max_chunk_roots=20)
        assert _import(queue, state, path).written_diffs == 3
    finally:
        queue.close()


def _state_with(cells: list[Any], seqno: int = 7) -> tuple[bytes, bytes]:
    """A one-diff state of ``cells`` (any message cells) and its top diff hash."""
    cells = sorted(cells, key=lambda c: c.hash)
    keys = sorted(QueueKey(1000 + i, c.hash) for i, c in enumerate(cells))
    tl = TlDiff(
        prev_hash=bytes(32),
        shard=BASE,
        seqno=seqno,
        processed_to=(),
        min_message=keys[0],
        max_message=keys[-1],
        hashes=b"".join(c.hash for c in cells),
    )
    spool = ChunkSpool()
    out = io.BytesIO()
    try:
        for cell in cells:
            spool.add(encode_boc([cell]))
        write_raw_state(out, BASE, seqno, [encode_diff(tl)], spool)
    finally:
        spool.close()
    return out.getvalue(), blake3.blake3(encode_diff(tl)).digest()


def test_a_message_with_a_var_address_is_rejected_naming_message_and_field(
    tmp_path: Path, queue: Queue
) -> None:
    """D13: the error says which field of which message; nothing is written."""
    src, dst = address_in(BASE, 1), address_in(BASE, 2)
    good = [build_internal_message(src, dst, 1000 + i) for i in range(3)]
    bad = build_message_with_var_address(src, dst, 1001, field="src")
    data, top = _state_with([*good, bad])
    path = tmp_path / "bad.bin"
    path.write_bytes(data)
    index = sorted([*good, bad], key=lambda c: c.hash).index(bad)
    before = dump(queue)

    with pytest.raises(StateFormatError, match=rf"message {index} of diff seqno 7 .*bad src"):
        queue.import_state(path, BlockId(BASE, 7), (top, 1))

    assert dump(queue) == before


# -- generated states: what the real files lack ------------------------------------------------


def test_router_partitions_route_by_destination_then_source(tmp_path: Path, queue: Queue) -> None:
    state, path = _synth(
        tmp_path, "r.bin", diffs=2, messages_per_diff=24, routed_every=3, masterchain_every=5
    )
    _import(queue, state, path)
    expected: dict[int, set[QueueKey]] = {0: set(), 1: set(), 2: set()}
    both = []
    for diff in state.diffs:
        src_routed = {a for _, addrs in diff.tl.router_src for a in addrs}
        dst_routed = {a for _, addrs in diff.tl.router_dst for a in addrs}
        for m in diff.messages:
            expected[expected_partition(state, diff.seqno, m.src, m.dst)].add(m.key)
            if m.src in src_routed and m.dst in dst_routed:
                both.append(m.key)
    assert all(expected.values()) and both  # every case is exercised
    assert all(k in expected[1] for k in both)  # the dst router wins

    for partition, keys in expected.items():
        got = [m.message for f in (BASE, MC) for m in iterate(queue, BASE, partition, f)]
        assert {m.key for m in got} == keys
        assert len(got) == len(keys)
        stats = queue.load_diff_statistics(partition, full(BASE))
        assert stats == Counter(m.dst for m in got)
    assert iterate(queue, BASE, 3, BASE) == []
    for diff in state.diffs:
        info = queue.get_diff_info(BASE, diff.seqno)
        assert info.router_dst == {p: frozenset(a) for p, a in diff.tl.router_dst}
        assert info.router_src == {p: frozenset(a) for p, a in diff.tl.router_src}


def test_masterchain_destinations_are_counted_and_iterable(tmp_path: Path, queue: Queue) -> None:
    state, path = _synth(tmp_path, "m.bin", diffs=2, messages_per_diff=20, masterchain_every=3)
    _import(queue, state, path)
    for diff in state.diffs:
        counts = Counter(ShardIdent.full(m.dst.workchain) for m in diff.messages)
        assert counts[MC] > 0
        assert queue.get_diff_info(BASE, diff.seqno).shards_messages_count == counts
    to_mc = sorted(m.key for m in state.messages if m.dst.workchain == -1)
    assert [m.message.key for m in iterate(queue, BASE, 0, MC)] == to_mc
    to_base = sorted(m.key for m in state.messages if m.dst.workchain == 0)
    assert [m.message.key for m in iterate(queue, BASE, 0, BASE)] == to_base


def test_multi_cell_messages_round_trip_their_bodies(tmp_path: Path, queue: Queue) -> None:
    state, path = _synth(
        tmp_path, "mc.queue", diffs=2, messages_per_diff=15, body_in_ref=True, body_bytes=300
    )
    assert path.read_bytes()[:4] == ZSTD_MAGIC
    report = _import(queue, state, path)
    assert report.messages == 30
    got = {m.message.key: m.message for m in iterate(queue, BASE, 0, BASE)}
    assert got == {m.key: m for m in state.messages}
    for msg in got.values():
        (root,) = decode_boc(msg.body)
        assert root.hash == msg.key.hash
        assert len(list(root.iter_tree())) == 4  # header, then 127 + 127 + 46 body bytes


def test_a_state_of_several_chunks_imports_across_chunk_and_diff_boundaries(
    tmp_path: Path, queue: Queue
) -> None:
    state, path = _synth(tmp_path, "big.bin", diffs=3, messages_per_diff=[12_000, 8_000, 5_000])
    oracle = parse_state(path)
    assert oracle.n_chunks == len(oracle.chunks) == 3
    assert [boc_root_count(c) for c in oracle.chunks] == [10_000, 10_000, 5_000]

    report = _import(queue, state, path)

    assert (report.diffs, report.messages, report.bytes) == (3, 25_000, path.stat().st_size)
    got = iterate(queue, BASE, 0, BASE)
    assert [m.message for m in got] == sorted(state.messages, key=lambda m: m.key)
    for diff in state.diffs:
        assert sum(queue.get_diff_info(BASE, diff.seqno).shards_messages_count.values()) == len(
            diff.messages
        )


def test_chunks_cut_by_size_are_announced_and_imported(tmp_path: Path, queue: Queue) -> None:
    """D11: a chunk closed at 10 MiB before 10,000 roots is counted in the header."""
    state, path = _synth(tmp_path, "large.bin", diffs=1, messages_per_diff=5_200, body_bytes=2_000)
    oracle = parse_state(path)
    assert oracle.n_chunks == len(oracle.chunks) > math.ceil(5_200 / 10_000)
    assert sum(boc_root_count(c) for c in oracle.chunks) == 5_200
    report = _import(queue, state, path)
    assert report.messages == 5_200
    assert len(iterate(queue, BASE, 0, BASE)) + len(iterate(queue, BASE, 0, MC)) == 5_200


def test_many_small_size_cut_chunks(tmp_path: Path, queue: Queue) -> None:
    state = synth_state(diffs=2, messages_per_diff=[40, 25], body_bytes=2_000, seed=9)
    path, chunks = write_state(state, tmp_path / "small.queue", max_chunk_bytes=12_000)
    oracle = parse_state(path)
    assert chunks == oracle.n_chunks == len(oracle.chunks) > 10
    assert all(boc_root_count(c) <= 5 for c in oracle.chunks)
    assert _import(queue, state, path).messages == 65
    got = {m.message.key: m.message for f in (BASE, MC) for m in iterate(queue, BASE, 0, f)}
    assert got == {m.key: m for m in state.messages}


@pytest.mark.parametrize(
    ("top_update", "error"),
    [
        ((b"\x00" * 31, 1), ValueError),
        (("00" * 32, 1), TypeError),
        ((b"\x00" * 32, -1), ValueError),
        ((b"\x00" * 32, True), TypeError),
    ],
)
def test_a_malformed_top_update_is_refused_before_reading(
    queue: Queue, top_update: tuple[object, object], error: type[Exception]
) -> None:
    before = dump(queue)
    with pytest.raises(error, match="top_update"):
        queue.import_state(SHARD_BIN, block_id(SHARD_STATE), top_update)  # type: ignore[arg-type]
    assert dump(queue) == before


def test_an_address_in_two_partitions_of_a_router_half_goes_to_the_lowest(
    tmp_path: Path,
) -> None:
    """A router half listing an address under partitions 1 and 2: the lowest wins, as in
    the original's import (I11): its messages are in partition 1, none in 2."""
    state = synth_state(diffs=2, messages_per_diff=12, routed_every=3, seed=4)
    top = state.diffs[0]
    ((_, routed),) = top.tl.router_dst
    tl = dataclasses.replace(top.tl, router_dst=((1, routed), (2, routed)))
    state.diffs[0] = dataclasses.replace(top, tl=tl, hash=diff_hash(encode_diff(tl)))
    path, _ = write_state(state, tmp_path / "s.bin")
    everything = [QueueShardRange(state.shard, QueueKey.MIN, QueueKey.MAX)]
    with open_queue(tmp_path / "db") as queue:
        queue.import_state(path, state.block_id, state.top_update)
        read = {
            p: [m.message for m in queue.iterator(p, everything, ShardIdent.BASECHAIN)]
            for p in (1, 2)
        }
    hot = [m for m in top.messages if m.dst in routed]
    assert hot and all(m in read[1] for m in hot)
    assert not [m for m in read[2] if m.dst in routed]
