"""Bad persistent states: every one raises ``StateFormatError`` and leaves the queue as it
was (SEMANTICS §13.3, §13.5, D10, D11, D13).

Before each bad import the queue already holds data: the real masterchain state, a
synthetic state of another shard and two applied diffs (``prior``). "Unchanged" means the
same rows in every table, the same cached commit pointers and last committed masterchain
block, and no import marker. Some failures come only after the importer has written
batches (a late bad message, an extra chunk, trailing bytes): those tests shrink the batch
size, prove that rows reached the database, and check that the rollback removed exactly
them, also when the prior data holds diffs of the imported shard.
"""

from __future__ import annotations

import io
import re
import struct
import zlib
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zstandard
from builders import BASE, MC, Chain, dump, open_queue, shard_rows
from state_fixtures import CraftedDiff, assemble, craft_diffs
from tycho_data import TYCHO

from imq import Address, BlockId, CommitPointer, Queue, QueueKey, ShardIdent
from imq.errors import CommitError, StateFormatError
from imq.state import importer
from imq.state.boc import BocError, Cell, encode_boc, join_roots
from imq.state.message import (
    build_external_in_message,
    build_internal_message,
    build_message_with_var_address,
    parse_internal_header,
)
from imq.state.source import ByteSource
from imq.state.synth import SynthState, synth_state, write_synth_state
from imq.state.tl import (
    encode_chunk,
    encode_diff,
    encode_state_header,
    read_state_header,
)
from imq.storage import Table, codec

SHARD_BIN = (TYCHO / "persistent_state" / "shard.bin").read_bytes()
MASTER_BIN = (TYCHO / "persistent_state" / "master.bin").read_bytes()
QUEUE_83 = next((TYCHO / "dump_one_shard" / "queues").glob("0_8000000000000000_83_*.queue"))

SHARD_BLOCK = BlockId(BASE, 160)
SHARD_TOP = (bytes.fromhex("794fe9ce31b7919d2b6ca9ae0f97501f4017382a273b8f3ee512dcfcb5b14482"), 3)
MASTER_BLOCK = BlockId(MC, 90)
MASTER_TOP = (bytes.fromhex("5795ca5d1b8d0c1ce96394eef851bde718ff2e14fd2840098ed2bb7640f278c5"), 1)

# shard.bin layout (FORMAT §3): ids, shard, seqno, n_diffs, then the diffs at these offsets
DIFF_AT = (28, 137880, 138132)
N_CHUNKS_AT = 138384
CHUNK_AT = 138388  # the u32 length; the BOC follows
BOC_AT = CHUNK_AT + 4
HASHES_AT = DIFF_AT[0] + 244  # 4 id + 32 prev + 12 shard + 4 seqno + 4 + 2*52 + 40 + 40 + 4
N_MESSAGES_AT = HASHES_AT - 4

OTHER = ShardIdent(0, 0x2000_0000_0000_0000)  # a quarter shard the prior data lives in
APPLIED = ShardIdent(0, 0xA000_0000_0000_0000)

Logs = list[MutableMapping[str, Any]]


# -- the queue before and after -----------------------------------------------------------------


@dataclass(frozen=True)
class Before:
    rows: dict[str, list[tuple[bytes, bytes]]]
    pointers: dict[ShardIdent, CommitPointer]
    last_mc: BlockId | None


def before(queue: Queue) -> Before:
    return Before(dump(queue), queue.get_commit_pointers(), queue.get_last_committed_mc_block_id())


def assert_unchanged(queue: Queue, then: Before) -> None:
    assert queue._store.get_latest(Table.VARS, codec.IMPORT_MARKER) is None
    assert queue.get_commit_pointers() == then.pointers
    assert queue.get_last_committed_mc_block_id() == then.last_mc
    now = dump(queue)
    for table, rows in then.rows.items():
        assert now[table] == rows, f"table {table} changed"


def rejected(
    queue: Queue,
    data: bytes | Path,
    block_id: BlockId,
    top_update: tuple[bytes, int] | None = None,
    *,
    match: str,
) -> StateFormatError:
    """Import ``data``: it must fail with ``StateFormatError`` matching ``match`` (a regex)
    and leave ``queue`` exactly as it was."""
    then = before(queue)
    source = data if isinstance(data, Path) else io.BytesIO(data)
    with pytest.raises(StateFormatError, match=match) as info:
        queue.import_state(source, block_id, top_update)
    assert type(info.value) is StateFormatError
    assert_unchanged(queue, then)
    return info.value


@pytest.fixture
def prior(db_path: Path, logs: Logs) -> Iterator[Queue]:
    """A queue holding the real masterchain state, a synthetic state of shard ``OTHER``
    and two applied (uncommitted) diffs of shard ``APPLIED``."""
    queue = open_queue(db_path)
    try:
        queue.import_state(io.BytesIO(MASTER_BIN), MASTER_BLOCK, MASTER_TOP)
        other = synth_state(OTHER, top_seqno=40, diffs=2, messages_per_diff=6, seed=7)
        queue.import_state(io.BytesIO(state_bytes(other)), other.block_id, other.top_update)
        chain = Chain(queue)
        chain.apply(APPLIED, 3)
        chain.apply(APPLIED, 2)
        yield queue
    finally:
        queue.close()


def rolled_back(logs: Logs) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == "import_rolled_back"]


class WriteSpy:
    """Counts the stored message rows of ``shard`` after each write of the store, to prove
    that a failed import had written rows before it was rolled back."""

    def __init__(self, queue: Queue, shard: ShardIdent, monkeypatch: pytest.MonkeyPatch) -> None:
        store = queue._store
        original = store.write
        self.counts: list[int] = []

        def write(txn: Any, *, sync: bool = False) -> None:
            original(txn, sync=sync)
            self.counts.append(len(shard_rows(queue, Table.MESSAGES, shard)))

        monkeypatch.setattr(store, "write", write)

    @property
    def peak(self) -> int:
        return max(self.counts, default=0)


# -- building states ------------------------------------------------------------------------


def state_bytes(state: SynthState, max_chunk_roots: int = 10_000) -> bytes:
    out = io.BytesIO()
    write_synth_state(state, out, max_chunk_roots=max_chunk_roots)
    return out.getvalue()


def cut(items: Sequence[bytes], size: int) -> list[list[bytes]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def synth_parts(state: SynthState) -> tuple[list[bytes], list[bytes]]:
    """The boxed diffs (newest first) and the message BOCs in file order."""
    return [encode_diff(d.tl) for d in state.diffs], [m.body for m in state.messages]


def src_in(shard: ShardIdent, n: int) -> Address:
    account = (shard.prefix & 0xE000_0000_0000_0000).to_bytes(8, "big") + bytes(23) + bytes([n])
    return Address(shard.workchain, account)


def dst_of(n: int) -> Address:
    return Address(0, bytes([n % 256]) * 32)


def internals(shard: ShardIdent, seqno: int, count: int) -> list[Cell]:
    """``count`` valid messages whose lts lie in the range :func:`craft_diffs` gives
    diff ``seqno``."""
    return [
        build_internal_message(src_in(shard, k), dst_of(k), seqno * 1000 + 1 + k, body=b"m%d" % k)
        for k in range(count)
    ]


def read_header(data: bytes) -> tuple[Any, int]:
    src = ByteSource.from_bytes(data)
    header = read_state_header(src)
    return header, src.offset


def chunk_spans(data: bytes) -> list[tuple[int, int]]:
    """(offset of the BOC, its length) of every chunk of a state."""
    header, at = read_header(data)
    spans = []
    for _ in range(header.n_chunks):
        (size,) = struct.unpack_from("<I", data, at)
        spans.append((at + 4, size))
        at += 4 + size + (-size % 4)
    assert at == len(data)
    return spans


def cell_data_offsets(boc: bytes) -> list[int]:
    """Offset of each cell's data bytes in a BOC without index or CRC (tycho's form)."""
    ref_size = boc[4] & 7
    off_size = boc[5]
    at = 6
    cells = int.from_bytes(boc[at : at + ref_size])
    roots = int.from_bytes(boc[at + ref_size : at + 2 * ref_size])
    at += 3 * ref_size + off_size + roots * ref_size
    out = []
    for _ in range(cells):
        d1, d2 = boc[at], boc[at + 1]
        out.append(at + 2)
        at += 2 + (d2 + 1) // 2 + (d1 & 7) * ref_size
    assert at == len(boc)
    return out


def flip(data: bytes, at: int, mask: int = 0x01) -> bytes:
    return data[:at] + bytes([data[at] ^ mask]) + data[at + 1 :]


def put(data: bytes, at: int, value: bytes) -> bytes:
    return data[:at] + value + data[at + len(value) :]


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


# -- the fixtures are what the tests think they are ---------------------------------------------


def test_shard_bin_layout_is_as_assumed() -> None:
    header, end = read_header(SHARD_BIN)
    assert header.diff_offsets == DIFF_AT
    assert end == CHUNK_AT and header.n_chunks == 1
    assert header.diff_hashes[0] == SHARD_TOP[0] and len(header.diffs) == SHARD_TOP[1]
    assert SHARD_BIN[HASHES_AT : HASHES_AT + 32] == header.diffs[0].hash_at(0)
    assert struct.unpack_from("<I", SHARD_BIN, N_MESSAGES_AT)[0] == 4300
    assert struct.unpack_from("<I", SHARD_BIN, CHUNK_AT)[0] == len(SHARD_BIN) - BOC_AT - 1


def test_good_imports_still_work_on_the_prior_queue(prior: Queue) -> None:
    """The control: the unmodified file imports into the same queue."""
    report = prior.import_state(io.BytesIO(SHARD_BIN), SHARD_BLOCK, SHARD_TOP)
    assert report.messages == 4300
    assert prior.get_commit_pointers()[BASE].seqno == 160


# -- truncation -----------------------------------------------------------------------------


TRUNCATED = re.compile(r"truncated at offset (?P<at>\d+) while reading .*, (?P<left>\d+) left")


def truncation_offsets(size: int, landmarks: Sequence[int], spread: int) -> list[int]:
    picks = {o + d for o in landmarks for d in (-1, 0, 1, 2, 3)}
    picks.update(size * k // spread for k in range(spread))
    picks.update(range(0, 33))
    picks.add(size - 1)
    return sorted(o for o in picks if 0 <= o < size)


def test_truncated_shard_bin_at_many_offsets(prior: Queue) -> None:
    landmarks = [
        8,
        20,
        24,
        *DIFF_AT,
        HASHES_AT,
        N_MESSAGES_AT,
        DIFF_AT[1] - 8,
        N_CHUNKS_AT,
        CHUNK_AT,
        BOC_AT,
        BOC_AT + 20,
        len(SHARD_BIN) - 2,
    ]
    offsets = truncation_offsets(len(SHARD_BIN), landmarks, 130)
    assert len(offsets) >= 200
    for size in offsets:
        for top in (SHARD_TOP, None):
            exc = rejected(prior, SHARD_BIN[:size], SHARD_BLOCK, top, match="truncated")
            found = TRUNCATED.search(str(exc))
            assert found is not None, str(exc)
            at, left = int(found["at"]), int(found["left"])
            assert at + left == size, (size, str(exc))


def test_truncated_shard_bin_as_a_file(prior: Queue, tmp_path: Path) -> None:
    path = tmp_path / "shard.bin"
    for size in (0, 27, CHUNK_AT, BOC_AT + 1000, len(SHARD_BIN) - 1):
        path.write_bytes(SHARD_BIN[:size])
        rejected(prior, path, SHARD_BLOCK, SHARD_TOP, match="truncated")


def test_truncated_real_queue_file_at_every_offset(prior: Queue) -> None:
    data = QUEUE_83.read_bytes()
    block = BlockId(BASE, 83)
    for size in range(len(data)):
        rejected(prior, data[:size], block, match="truncated")


def test_truncated_synth_queue_file(prior: Queue, tmp_path: Path) -> None:
    """A zstd state of several chunks, cut inside the compressed stream."""
    state = synth_state(BASE, diffs=3, messages_per_diff=40, seed=3)
    path = tmp_path / "s.queue"
    assert write_synth_state(state, path, max_chunk_roots=25) == 5
    data = path.read_bytes()
    assert data[:4] == b"\x28\xb5\x2f\xfd"
    for size in truncation_offsets(len(data), [4, 8, len(data) - 4], 40):
        rejected(prior, data[:size], state.block_id, state.top_update, match="truncated")
    prior.import_state(io.BytesIO(data), state.block_id, state.top_update)


# -- flipped bytes in the header --------------------------------------------------------------


@pytest.mark.parametrize(
    ("at", "mask", "match"),
    [
        (0, 0x01, "unknown id"),
        (3, 0x80, "unknown id"),
        (4, 0x01, "not block.queueStateHeader"),
        (8, 0x01, "is not the state's shard 1:8000000000000000"),  # header workchain
        (12, 0x01, "shard_ident at offset 8: invalid shard"),  # prefix low bits
        (19, 0x80, "shard_ident at offset 8: invalid shard"),  # prefix 0
        (20, 0x01, "seqno 160 is not the state's seqno 161"),
        # 3 -> 1 diffs: the top update's diff count is checked once the newest diff is
        # read (without one, the next diff's id is read as the chunk count: see below)
        (24, 0x02, "queue diffs count mismatch: the state holds 1 diffs"),
        (24, 0x03, "diff count 0 at offset 24"),
        (27, 0x80, "diff count 2147483651"),
        (24, 0x07, "the state holds 4 diffs"),  # 3 -> 4 (without a top update: below)
    ],
)
def test_flipped_header_byte(prior: Queue, at: int, mask: int, match: str) -> None:
    rejected(prior, flip(SHARD_BIN, at, mask), SHARD_BLOCK, SHARD_TOP, match=match)


def test_header_diff_count_one_reads_a_diff_id_as_chunk_count(prior: Queue) -> None:
    exc = rejected(prior, put(SHARD_BIN, 24, u32(1)), SHARD_BLOCK, match="chunk count")
    assert f"offset {DIFF_AT[1]}" in str(exc)
    rejected(prior, put(SHARD_BIN, 24, u32(4)), SHARD_BLOCK, match="is not block.queueDiff")


def test_the_top_update_is_checked_before_an_older_diff_is_parsed(prior: Queue) -> None:
    """A wrong top update stops the read once the newest diff is read: an older diff,
    however damaged (or large: a forged router), is not parsed (docs/reliability.md)."""
    damaged = flip(SHARD_BIN, DIFF_AT[1] + 4)  # the next diff's prev_hash
    rejected(prior, damaged, SHARD_BLOCK, match="prev_hash")
    wrong = (bytes(32), 3)
    rejected(prior, damaged, SHARD_BLOCK, wrong, match="top queue diff hash mismatch")


# -- flipped bytes inside a diff ----------------------------------------------------------------


def test_flipped_prev_hash_breaks_the_chain(prior: Queue) -> None:
    for at in (DIFF_AT[0] + 4, DIFF_AT[0] + 35, DIFF_AT[1] + 4):
        # No top update: a flip in the newest diff changes its hash, which a top update
        # (checked first) would refuse before the chain is followed.
        exc = rejected(prior, flip(SHARD_BIN, at), SHARD_BLOCK, match="prev_hash")
        assert "is not the hash" in str(exc)
    top = rejected(prior, flip(SHARD_BIN, DIFF_AT[0] + 4), SHARD_BLOCK, SHARD_TOP, match="top")
    assert "top queue diff hash mismatch" in str(top)


def test_flipped_old_diff_body_breaks_the_chain(prior: Queue) -> None:
    """Any byte of an older diff changes its hash: the newer diff's prev_hash no longer
    matches, even when the byte itself is a valid value (a processed_to lt)."""
    at = DIFF_AT[1] + 56 + 12 + 2  # processed_to entry 0's key lt
    rejected(prior, flip(SHARD_BIN, at), SHARD_BLOCK, match="prev_hash .* is not the hash")


@pytest.mark.parametrize(
    ("at", "match"),
    [
        (DIFF_AT[0], "constructor id .* is not block.queueDiff"),
        (DIFF_AT[0] + 36, "shard .* is not the state's shard"),
        (DIFF_AT[0] + 48, "seqno 161 is not the state's seqno 160"),
        (DIFF_AT[1] + 48, "seqno 158 not strictly below the previous diff's|prev_hash"),
        (DIFF_AT[2] + 48, "seqno 159 not strictly below the previous diff's 159"),
        (DIFF_AT[0] + 52, "max_message .* is below min_message"),  # 2 -> 3 processed_to
    ],
)
def test_flipped_diff_field(prior: Queue, at: int, match: str) -> None:
    rejected(prior, flip(SHARD_BIN, at), SHARD_BLOCK, SHARD_TOP, match=match)


def test_flipped_diff_counts(prior: Queue) -> None:
    big = put(SHARD_BIN, N_MESSAGES_AT, u32(0xFFFF_FFFF))
    exc = rejected(prior, big, SHARD_BLOCK, match="message count is 4294967295, the limit")
    assert f"offset {N_MESSAGES_AT}" in str(exc)
    # one message fewer: the last hash is read as the router, its first 4 bytes a count
    fewer = put(SHARD_BIN, N_MESSAGES_AT, u32(4299))
    rejected(prior, fewer, SHARD_BLOCK, match="partition count is .* the limit is 65536")
    big_pt = put(SHARD_BIN, DIFF_AT[0] + 52, u32(1001))
    rejected(prior, big_pt, SHARD_BLOCK, match="processed_to count is 1001, the limit is 1000")
    src_router = HASHES_AT + 32 * 4300
    assert SHARD_BIN[src_router : src_router + 8] == bytes(8)
    many = put(SHARD_BIN, src_router, u32(65537))
    rejected(prior, many, SHARD_BLOCK, match="router_partitions_src partition count is 65537")
    one = put(SHARD_BIN, src_router, u32(1))  # one partition: its index is the dst count 0
    rejected(prior, one, SHARD_BLOCK, match="partition 0 account count is 1612751794, the limit")


def test_flipped_message_hash_in_the_list(prior: Queue) -> None:
    first_byte = HASHES_AT + 32 * 100
    rejected(
        prior, put(SHARD_BIN, first_byte, b"\xff"), SHARD_BLOCK, match="not strictly ascending"
    )
    rejected(prior, put(SHARD_BIN, HASHES_AT, bytes(32)), SHARD_BLOCK, match="zero message hash")
    # the last byte keeps the order: the diff hash changes, then the message hash fails
    last_byte = HASHES_AT + 32 * 100 + 31
    data = flip(SHARD_BIN, last_byte)
    rejected(prior, data, SHARD_BLOCK, SHARD_TOP, match="top queue diff hash mismatch")
    exc = rejected(prior, data, SHARD_BLOCK, match="message hash mismatch: message 100 ")
    assert "diff seqno 160" in str(exc) and f"offset {CHUNK_AT}" in str(exc)


def test_max_message_below_min_message(prior: Queue) -> None:
    min_lt_at = DIFF_AT[0] + 56 + 2 * 52
    data = put(SHARD_BIN, min_lt_at, struct.pack("<Q", 2**64 - 1))
    rejected(prior, data, SHARD_BLOCK, match="max_message .* is below min_message")


def test_key_range_narrowed_in_the_top_diff(prior: Queue) -> None:
    """A top diff whose min_message is above its messages: without the top update
    the file is consistent, and the import itself must refuse the first message."""
    header, _ = read_header(SHARD_BIN)
    max_lt = header.diffs[0].max_message.lt
    min_at = DIFF_AT[0] + 56 + 2 * 52
    data = put(SHARD_BIN, min_at, struct.pack("<Q", max_lt))
    exc = rejected(prior, data, SHARD_BLOCK, match="outside the diff's range")
    assert "diff seqno 160" in str(exc)


def test_a_message_below_min_message_by_its_hash_alone_is_refused(prior: Queue) -> None:
    """min_message at the first message's lt but with a hash above every message's: the
    message lies below the diff's range by its hash only (the range check's fast path
    compares lts strictly for that)."""
    header, _ = read_header(SHARD_BIN)
    lt = header.diffs[0].min_message.lt
    min_at = DIFF_AT[0] + 56 + 2 * 52
    data = put(SHARD_BIN, min_at, struct.pack("<Q", lt) + b"\xff" * 32)
    exc = rejected(prior, data, SHARD_BLOCK, match="outside the diff's range")
    assert "diff seqno 160" in str(exc)


# -- flipped bytes inside a message cell --------------------------------------------------------


def test_flipped_message_cell_byte(prior: Queue) -> None:
    boc = SHARD_BIN[BOC_AT : len(SHARD_BIN) - 1]
    cells = cell_data_offsets(boc)
    assert len(cells) == 4300
    for cell in (0, 1234, 4299):
        for delta in (0, 10, 40, 70):
            at = BOC_AT + cells[cell] + delta
            data = flip(SHARD_BIN, at, 0x10)
            exc = rejected(prior, data, SHARD_BLOCK, SHARD_TOP, match="message hash mismatch")
            # the real chunk lists its roots last cell first (FORMAT §3)
            assert f"message {4299 - cell} of diff seqno 160 " in str(exc)


def test_corrupt_chunk_boc(prior: Queue) -> None:
    rejected(prior, flip(SHARD_BIN, BOC_AT), SHARD_BLOCK, SHARD_TOP, match=r"bad BOC \(magic\)")
    # a cell's descriptor: the BOC structure no longer adds up
    cells = cell_data_offsets(SHARD_BIN[BOC_AT : len(SHARD_BIN) - 1])
    at = BOC_AT + cells[2000] - 1  # d2 of cell 2000
    rejected(prior, flip(SHARD_BIN, at, 0x02), SHARD_BLOCK, match="bad BOC|hash mismatch")
    rejected(prior, put(SHARD_BIN, len(SHARD_BIN) - 1, b"\x01"), SHARD_BLOCK, match="padding")
    size = struct.unpack_from("<I", SHARD_BIN, CHUNK_AT)[0]
    rejected(prior, put(SHARD_BIN, CHUNK_AT, u32(0)), SHARD_BLOCK, match="length 0 is not in")
    rejected(prior, put(SHARD_BIN, CHUNK_AT, u32(size + 8)), SHARD_BLOCK, match="truncated")
    rejected(prior, put(SHARD_BIN, CHUNK_AT, u32(size - 1)), SHARD_BLOCK, match="BOC|padding")


def test_junk_cells_in_a_chunk_are_refused_before_they_cost_memory(prior: Queue) -> None:
    """The real header (so the top update passes) and the real chunk, re-encoded with
    4-byte refs and followed by a million empty cells that no root leads to: a few hundred
    bytes of zstd could declare tens of millions of them. Refused at the first one."""
    boc = SHARD_BIN[BOC_AT : len(SHARD_BIN) - 1]
    assert boc[4:6] == b"\x02\x03"  # ref size 2, offset size 3
    cells, roots = struct.unpack_from(">HH", boc, 6)
    total = int.from_bytes(boc[12:15])
    root_list = struct.unpack_from(f">{roots}H", boc, 15)
    junk = 1_000_000
    widened = b"".join(
        [
            boc[:4],
            b"\x04\x04",
            struct.pack(">IIII", cells + junk, roots, 0, total + 2 * junk),
            struct.pack(f">{roots}I", *root_list),
            boc[15 + 2 * roots :],  # the cells: leaves, no refs to widen
            b"\x00\x00" * junk,
        ]
    )
    _, end = read_header(SHARD_BIN)
    data = SHARD_BIN[:end] + encode_chunk(widened)
    exc = rejected(prior, data, SHARD_BLOCK, SHARD_TOP, match=r"bad BOC \(unreachable\)")
    assert f"cell {cells} is neither a root" in str(exc)


def test_a_message_from_outside_the_states_shard_is_refused(prior: Queue) -> None:
    """``apply_diff`` refuses a message whose source lies outside the block's shard; an
    import must too (a shard's diff holds only what its own accounts sent)."""
    seqno = 52
    shard = ShardIdent(0, 0x6000_0000_0000_0000)  # accounts 0x40.. to 0x7f..
    inside = internals(shard, seqno, 4)
    stranger = Address(0, b"\xe0" + bytes(31))
    outside = build_internal_message(stranger, dst_of(9), seqno * 1000 + 50)
    masterchain = build_internal_message(Address(-1, b"\x50" * 32), dst_of(9), seqno * 1000 + 60)
    for foreign in (outside, masterchain):
        (diff,) = craft_diffs(shard, seqno, [[*inside, foreign]])
        data = assemble(shard, [diff.tl], [diff.bocs])
        position = sorted(c.hash for c in [*inside, foreign]).index(foreign.hash)
        exc = rejected(prior, data, BlockId(shard, seqno), match="outside the state's shard")
        assert f"message {position} of diff seqno {seqno}" in str(exc)
    # the same messages, all from inside: imported
    (diff,) = craft_diffs(shard, seqno, [inside])
    assert prior.import_state(
        io.BytesIO(assemble(shard, [diff.tl], [diff.bocs])), BlockId(shard, seqno)
    )


def test_a_state_of_a_workchain_without_std_addresses_refuses_its_messages(
    prior: Queue,
) -> None:
    """A shard's workchain may lie outside -128..127, where no std address lives: every
    message's source is then outside it. Refused as such (an audit: the source test
    built an address of the shard's workchain first, and the import raised a bare
    ``ValueError`` from ``Address``)."""
    seqno = 52
    shard = ShardIdent.full(128)
    foreign = build_internal_message(Address(0, b"\x50" * 32), dst_of(9), seqno * 1000 + 50)
    (diff,) = craft_diffs(shard, seqno, [[foreign]])
    data = assemble(shard, [diff.tl], [diff.bocs])
    exc = rejected(prior, data, BlockId(shard, seqno), match="outside the state's shard")
    assert f"message 0 of diff seqno {seqno}" in str(exc)


def _diffs_spanning(
    shard: ShardIdent, first_seqno: int, groups: Sequence[Sequence[Cell]]
) -> list[CraftedDiff]:
    """:func:`craft_diffs` of ``groups`` (oldest first, consecutive seqnos from
    ``first_seqno``), each diff spanning exactly its messages' keys."""
    spans = {}
    for i, cells in enumerate(groups):
        keys = sorted(QueueKey(message_lt(c), c.hash) for c in cells)
        spans[i] = (keys[0], keys[-1])
    return craft_diffs(shard, first_seqno, groups, processed_to=(), spans=spans)


def message_lt(cell: Cell) -> int:
    return parse_internal_header(cell.data, cell.bits)[0]


def test_diffs_out_of_order_or_sharing_a_message_are_refused(prior: Queue) -> None:
    """The diffs of one state with messages must hold ascending, disjoint key ranges: an
    older diff above a newer one would stay above the pointer the import sets (a later
    clear would delete it), and a message listed by two diffs would be counted twice."""
    seqno = 70
    high = internals(BASE, seqno + 9, 3)  # lts 79,001..
    low = internals(BASE, seqno, 3)  # lts 70,001..
    cases = {
        "older above newer": [high, low],
        "one message in both": [low, [low[-1], *high]],
    }
    for name, groups in cases.items():
        diffs = _diffs_spanning(BASE, seqno, groups)
        data = assemble(BASE, [d.tl for d in diffs], [[b for d in diffs for b in d.bocs]])
        exc = rejected(
            prior, data, BlockId(BASE, seqno + 1), match="ascending, disjoint message ranges"
        )
        assert f"queue diff seqno {seqno} " in str(exc), name
    diffs = _diffs_spanning(BASE, seqno, [low, high])
    data = assemble(BASE, [d.tl for d in diffs], [[b for d in diffs for b in d.bocs]])
    assert prior.import_state(io.BytesIO(data), BlockId(BASE, seqno + 1)).messages == 6


@pytest.mark.parametrize(
    "case", ["newest empty at MIN", "newest empty below", "older empty above the newest"]
)
def test_a_diff_ending_above_the_newest_is_refused_empty_ones_too(prior: Queue, case: str) -> None:
    """The import makes the newest diff's ``max_message`` the shard's commit pointer, so
    every older diff must end at or below it, empty or not: a state whose newest diff was
    empty and spanned MIN..MIN imported "successfully" with its older diff's messages
    above the pointer, uncommitted, and the node's next startup cleared them (an outside
    audit; the order check of diffs with messages left empty diffs out)."""
    seqno = 70
    low = internals(BASE, seqno, 3)  # lts 70,001..
    at_min = (QueueKey.MIN, QueueKey.MIN)
    below = (QueueKey.min_for_lt(500), QueueKey.max_for_lt(600))
    above = (QueueKey.min_for_lt(90_000), QueueKey.max_for_lt(90_999))
    groups, spans = {
        "newest empty at MIN": ([low, []], {1: at_min}),
        "newest empty below": ([low, []], {1: below}),
        "older empty above the newest": ([[], low], {0: above}),
    }[case]
    for i, cells in enumerate(groups):
        if cells:
            keys = sorted(QueueKey(message_lt(c), c.hash) for c in cells)
            spans[i] = (keys[0], keys[-1])
    diffs = craft_diffs(BASE, seqno, groups, processed_to=(), spans=spans)
    data = assemble(BASE, [d.tl for d in diffs], [[b for d in diffs for b in d.bocs]])
    exc = rejected(prior, data, BlockId(BASE, seqno + 1), match="which an import makes the commit")
    assert f"queue diff seqno {seqno} " in str(exc)


def test_non_boc_chunk(prior: Queue) -> None:
    _, end = read_header(SHARD_BIN)
    for garbage in (b"not a bag of cells", b"\x00", b"\xb5\xee\x9c\x72", bytes(64)):
        data = SHARD_BIN[:end] + encode_chunk(garbage)
        exc = rejected(prior, data, SHARD_BLOCK, SHARD_TOP, match="bad BOC")
        assert not isinstance(exc, BocError) and exc.__cause__ is None


# -- the top update -----------------------------------------------------------------------------


def test_wrong_top_hash(prior: Queue) -> None:
    exc = rejected(prior, SHARD_BIN, SHARD_BLOCK, (bytes(32), 3), match="top queue diff hash")
    assert SHARD_TOP[0].hex() in str(exc)
    wrong = (SHARD_TOP[0][:-1] + b"\x00", 3)
    rejected(prior, MASTER_BIN, MASTER_BLOCK, wrong, match="top queue diff hash mismatch")


@pytest.mark.parametrize("tail_len", [0, 1, 2, 4, 1000])
def test_wrong_tail_length(prior: Queue, tail_len: int) -> None:
    top = (SHARD_TOP[0], tail_len)
    exc = rejected(prior, SHARD_BIN, SHARD_BLOCK, top, match="queue diffs count mismatch")
    assert f"tail_len {tail_len}" in str(exc)


def test_top_update_of_another_file(prior: Queue) -> None:
    rejected(prior, SHARD_BIN, SHARD_BLOCK, MASTER_TOP, match="top queue diff hash mismatch")


# -- the end of the file ------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [b"\x00", b"\x00\x00\x00\x00", b"junk" * 100])
def test_trailing_bytes(prior: Queue, extra: bytes) -> None:
    exc = rejected(prior, SHARD_BIN + extra, SHARD_BLOCK, SHARD_TOP, match="trailing")
    assert f"offset {len(SHARD_BIN)}" in str(exc)
    rejected(prior, MASTER_BIN + extra, MASTER_BLOCK, MASTER_TOP, match="trailing")


def test_a_wrong_top_update_is_found_before_trailing_bytes(prior: Queue) -> None:
    """I22: the reader streams, so it checks the top update right after the header and
    meets trailing bytes only at the end; the original parses the whole file first and
    reports the leftover bytes. Either way the import is refused and writes nothing."""
    rejected(prior, SHARD_BIN + b"junk", SHARD_BLOCK, MASTER_TOP, match="top queue diff hash")
    wrong_len = (SHARD_TOP[0], SHARD_TOP[1] + 1)
    rejected(prior, SHARD_BIN + b"junk", SHARD_BLOCK, wrong_len, match="diffs count mismatch")


def test_trailing_frame_in_a_queue_file(prior: Queue) -> None:
    """A second zstd frame after the state decompresses to trailing bytes."""
    data = QUEUE_83.read_bytes() + zstandard.ZstdCompressor().compress(b"more")
    rejected(prior, data, BlockId(BASE, 83), match="trailing")
    junk = QUEUE_83.read_bytes() + b"\x00" * 3
    rejected(prior, junk, BlockId(BASE, 83), match="zstd")


def test_extra_chunk(prior: Queue) -> None:
    state = synth_state(BASE, diffs=3, messages_per_diff=9, seed=11)
    diffs_tl, bocs = synth_parts(state)
    chunks = cut(bocs, 10)
    extra = [bocs[0]]
    data = assemble(BASE, diffs_tl, [*chunks, extra])
    exc = rejected(prior, data, state.block_id, state.top_update, match="extra chunk")
    assert "announces 4 chunks" in str(exc)
    # the same chunk, not announced: trailing bytes
    data = assemble(BASE, diffs_tl, chunks) + encode_chunk(join_roots(extra))
    rejected(prior, data, state.block_id, state.top_update, match="trailing")
    # announced but absent: the messages end first
    data = assemble(BASE, diffs_tl, chunks, n_chunks=4)
    rejected(prior, data, state.block_id, state.top_update, match="extra chunk")


def test_extra_chunk_of_an_empty_state(prior: Queue) -> None:
    """master.bin holds no message: any chunk it announces is extra."""
    header, end = read_header(MASTER_BIN)
    assert header.n_chunks == 0
    boc = encode_boc(internals(MC, 90, 1))
    data = put(MASTER_BIN[:end], end - 4, u32(1)) + encode_chunk(boc)
    exc = rejected(prior, data, MASTER_BLOCK, MASTER_TOP, match="extra chunk")
    assert "announces 1 chunks but its diffs list no messages" in str(exc)
    assert "chunk -1" not in str(exc)  # the wording an outside audit found


def test_too_many_roots_in_the_last_chunk(prior: Queue) -> None:
    state = synth_state(BASE, diffs=2, messages_per_diff=8, seed=12)
    diffs_tl, bocs = synth_parts(state)
    data = assemble(BASE, diffs_tl, [bocs[:10], [*bocs[10:], bocs[0]]])
    rejected(prior, data, state.block_id, state.top_update, match="too many messages")


def test_missing_messages(prior: Queue) -> None:
    """The diffs list more hashes than the chunks hold."""
    state = synth_state(BASE, diffs=2, messages_per_diff=10, seed=13)
    diffs_tl, bocs = synth_parts(state)
    short = assemble(BASE, diffs_tl, cut(bocs[:15], 5))
    exc = rejected(prior, short, state.block_id, state.top_update, match="not enough messages")
    assert f"diff seqno {state.diffs[1].seqno}" in str(exc) and "after 5 of them" in str(exc)
    # a whole diff missing: the reader runs out at its first message
    top_only = assemble(BASE, diffs_tl, [bocs[:10]])
    exc = rejected(prior, top_only, state.block_id, match="not enough messages")
    assert "after 0 of them" in str(exc)
    # no chunk at all
    none = encode_state_header(BASE, state.seqno, diffs_tl, 0)
    rejected(prior, none, state.block_id, match="not enough messages")


def test_partly_read_diff_then_a_different_message(prior: Queue) -> None:
    """The chunks hold the right number of roots, but the second diff's last one is a
    message it does not list: the diff is never completely read."""
    state = synth_state(BASE, diffs=2, messages_per_diff=6, seed=14)
    diffs_tl, bocs = synth_parts(state)
    stranger = encode_boc(internals(BASE, 5, 1))
    data = assemble(BASE, diffs_tl, [bocs[:7], [*bocs[7:11], stranger]])
    exc = rejected(prior, data, state.block_id, state.top_update, match="message hash mismatch")
    assert f"message 5 of diff seqno {state.diffs[1].seqno}" in str(exc)


def test_a_forged_message_tree_is_refused_before_its_cells_are_built(
    prior: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root with refs that the diff does not list (a forged chunk's tree, as large as
    it likes) is refused from the chunk's compact table: its hash is computed and
    compared before any cell object is built."""
    state = synth_state(BASE, diffs=2, messages_per_diff=6, seed=14)
    diffs_tl, bocs = synth_parts(state)
    tree = Cell(b"\x01", 8, [Cell(b"\x02", 8, [Cell(b"", 0)] * 4)] * 4)
    data = assemble(BASE, diffs_tl, [[*bocs[:11], encode_boc([tree])]])

    def built(*_args: object) -> None:
        raise AssertionError("a cell was built before the hashes were checked")

    monkeypatch.setattr("imq.state.boc._cell_at", built)
    exc = rejected(prior, data, state.block_id, state.top_update, match="message hash mismatch")
    assert f"message 5 of diff seqno {state.diffs[1].seqno}" in str(exc) and "root 11)" in str(exc)
    assert tree.hash.hex() in str(exc)


def test_diff_order_swapped_in_chunks(prior: Queue) -> None:
    """The messages of the two diffs in the wrong order (oldest first)."""
    state = synth_state(BASE, diffs=2, messages_per_diff=6, seed=15)
    diffs_tl, bocs = synth_parts(state)
    data = assemble(BASE, diffs_tl, [bocs[6:] + bocs[:6]])
    rejected(prior, data, state.block_id, state.top_update, match="message hash mismatch")


# -- messages that are not internal with std addresses (D13) ------------------------------------

BadBuilder = Callable[[ShardIdent, int], Cell]


def external(shard: ShardIdent, lt: int) -> Cell:
    return build_external_in_message(dst_of(3), body=b"ext%d" % lt)


def var_src(shard: ShardIdent, lt: int) -> Cell:
    return build_message_with_var_address(src_in(shard, 1), dst_of(1), lt, field="src")


def var_dst(shard: ShardIdent, lt: int) -> Cell:
    return build_message_with_var_address(src_in(shard, 1), dst_of(1), lt, field="dst")


def anycast_src(shard: ShardIdent, lt: int) -> Cell:
    return build_message_with_var_address(
        src_in(shard, 1), dst_of(1), lt, field="src", anycast=True
    )


def anycast_dst(shard: ShardIdent, lt: int) -> Cell:
    return build_message_with_var_address(
        src_in(shard, 1), dst_of(1), lt, field="dst", anycast=True
    )


BAD_MESSAGES: list[tuple[BadBuilder, str]] = [
    (external, r"bad info: .*not an internal message"),
    (var_src, r"bad src: src is addr_var, not addr_std"),
    (var_dst, r"bad dst: dst is addr_var, not addr_std"),
    (anycast_src, r"bad src: src has an anycast prefix"),
    (anycast_dst, r"bad dst: dst has an anycast prefix"),
]


@pytest.mark.parametrize(
    ("build", "match"), BAD_MESSAGES, ids=[b.__name__ for b, _ in BAD_MESSAGES]
)
def test_bad_message_in_a_single_chunk(prior: Queue, build: BadBuilder, match: str) -> None:
    seqno = 50
    cells = [*internals(BASE, seqno, 5), build(BASE, seqno * 1000 + 9)]
    (diff,) = craft_diffs(BASE, seqno, [cells])
    data = assemble(BASE, [diff.tl], [diff.bocs])
    position = sorted(c.hash for c in cells).index(cells[-1].hash)
    exc = rejected(prior, data, BlockId(BASE, seqno), match=match)
    assert f"message {position} of diff seqno {seqno}" in str(exc)
    other = "dst" if "bad src" in match else "src"
    assert f"bad {other}" not in str(exc)


@pytest.mark.parametrize(
    ("build", "match"), BAD_MESSAGES, ids=[b.__name__ for b, _ in BAD_MESSAGES]
)
def test_bad_message_in_a_late_chunk_is_rolled_back(
    prior: Queue, logs: Logs, monkeypatch: pytest.MonkeyPatch, build: BadBuilder, match: str
) -> None:
    """The bad message is in the oldest diff, the last chunk: the newer diffs' rows and
    many messages were written in batches before it is found."""
    monkeypatch.setattr(importer, "BATCH_ROWS", 8)
    spy = WriteSpy(prior, BASE, monkeypatch)
    cells = [internals(BASE, s, 12) for s in (60, 61, 62)]
    cells[0].append(build(BASE, 60_500))
    diffs = craft_diffs(BASE, 60, cells)
    bocs = [b for d in diffs for b in d.bocs]
    data = assemble(BASE, [d.tl for d in diffs], cut(bocs, 5))
    position = bocs.index(encode_boc([cells[0][-1]]))
    assert position >= 24 and position // 5 >= 4
    exc = rejected(prior, data, BlockId(BASE, 62), match=match)
    assert f"message {position - 24} of diff seqno 60 (chunk {position // 5} " in str(exc)
    assert spy.peak >= 16 and spy.counts[-1] == 0
    assert [e["reason"] for e in rolled_back(logs)] == ["failed"]


# -- the block id --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "block_id"),
    [
        (SHARD_BIN, BlockId(BASE, 161)),
        (SHARD_BIN, BlockId(BASE, 159)),
        (SHARD_BIN, BlockId(ShardIdent(0, 0x4000_0000_0000_0000), 160)),
        (SHARD_BIN, BlockId(MC, 160)),
        (MASTER_BIN, BlockId(BASE, 90)),
        (MASTER_BIN, BlockId(MC, 91)),
    ],
)
def test_block_id_mismatch(prior: Queue, data: bytes, block_id: BlockId) -> None:
    exc = rejected(prior, data, block_id, match="the state belongs to block")
    assert str(block_id.shard) in str(exc)


def test_a_queue_diff_is_not_a_state(prior: Queue) -> None:
    diff = (TYCHO / "first_block" / "first_block_queue_diff.bin").read_bytes()
    rejected(prior, diff, BlockId(MC, 1), match="this is a queue diff, not a queue state")
    rejected(prior, zlib.compress(SHARD_BIN), SHARD_BLOCK, match="unknown id")


# -- failures after batches were written: the rollback is exact ---------------------------------


@pytest.fixture(scope="module")
def big_state() -> tuple[SynthState, bytes]:
    """24,000 messages in 24 chunks: more than one real batch before the last chunks."""
    state = synth_state(BASE, top_seqno=300, diffs=3, messages_per_diff=8000, seed=21)
    return state, state_bytes(state, max_chunk_roots=1000)


def test_late_hash_mismatch_with_real_batch_size(
    prior: Queue, logs: Logs, monkeypatch: pytest.MonkeyPatch, big_state: tuple[SynthState, bytes]
) -> None:
    state, data = big_state
    spy = WriteSpy(prior, BASE, monkeypatch)
    spans = chunk_spans(data)
    assert len(spans) == 24
    boc_at, size = spans[21]
    cells = cell_data_offsets(data[boc_at : boc_at + size])
    bad = flip(data, boc_at + cells[500] + 20, 0x40)
    exc = rejected(prior, bad, state.block_id, state.top_update, match="message hash mismatch")
    assert "chunk 21" in str(exc)
    assert spy.peak >= importer.BATCH_ROWS
    assert spy.counts[-1] == 0
    assert [e["reason"] for e in rolled_back(logs)] == ["failed"]
    prior.import_state(io.BytesIO(data), state.block_id, state.top_update)
    assert len(shard_rows(prior, Table.MESSAGES, BASE)) == 24_000


def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importer, "BATCH_ROWS", 7)


def multi_chunk() -> tuple[SynthState, list[bytes], list[bytes]]:
    state = synth_state(
        BASE,
        top_seqno=120,
        diffs=4,
        messages_per_diff=[15, 0, 20, 12],
        routed_every=3,
        masterchain_every=5,
        body_bytes=200,
        seed=22,
    )
    diffs_tl, bocs = synth_parts(state)
    return state, diffs_tl, bocs


@pytest.mark.parametrize(
    ("how", "match"),
    [
        ("extra chunk", "extra chunk"),
        ("trailing", "trailing"),
        ("too many", "too many messages"),
        ("late mismatch", "message hash mismatch"),
        ("late flip", "message hash mismatch|bad BOC"),
        ("bad padding", "padding"),
        ("truncated", "truncated"),
        ("missing", "not enough messages"),
    ],
)
def test_late_failure_rolls_back_every_written_row(
    prior: Queue, logs: Logs, monkeypatch: pytest.MonkeyPatch, how: str, match: str
) -> None:
    """Multi-cell messages, routed partitions and masterchain destinations: the rows of
    every partition and table the import touched are deleted."""
    small_batches(monkeypatch)
    spy = WriteSpy(prior, BASE, monkeypatch)
    state, diffs_tl, bocs = multi_chunk()
    chunks = cut(bocs, 6)
    if how == "extra chunk":
        data = assemble(BASE, diffs_tl, [*chunks, [bocs[3]]])
    elif how == "trailing":
        data = assemble(BASE, diffs_tl, chunks, tail=b"\x00" * 4)
    elif how == "too many":
        data = assemble(BASE, diffs_tl, [*chunks[:-1], [*chunks[-1], bocs[0]]])
    elif how == "late mismatch":
        chunks[-1][-1] = encode_boc(internals(BASE, 117, 1))
        data = assemble(BASE, diffs_tl, chunks)
    elif how == "late flip":
        data = assemble(BASE, diffs_tl, chunks)
        boc_at, size = chunk_spans(data)[-2]
        cells = cell_data_offsets(data[boc_at : boc_at + size])
        data = flip(data, boc_at + cells[len(cells) // 2] + 5, 0x08)
    elif how == "bad padding":
        data = assemble(BASE, diffs_tl, chunks)
        boc_at, size = chunk_spans(data)[-1]
        assert size % 4, "the last chunk needs padding for this case"
        data = put(data, len(data) - 1, b"\x07")
    elif how == "truncated":
        data = assemble(BASE, diffs_tl, chunks)[:-30]
    else:
        data = assemble(BASE, diffs_tl, chunks[:-1], n_chunks=len(chunks) - 1)
    rejected(prior, data, state.block_id, state.top_update, match=match)
    assert spy.peak > 0 and spy.counts[-1] == 0
    assert [e["reason"] for e in rolled_back(logs)] == ["failed"]
    # and the intact file imports into the same queue afterwards
    good = assemble(BASE, diffs_tl, chunks if how != "late mismatch" else cut(bocs, 6))
    prior.import_state(io.BytesIO(good), state.block_id, state.top_update)
    assert len(shard_rows(prior, Table.MESSAGES, BASE)) == len(bocs)


def test_late_failure_keeps_stored_diffs_of_the_same_shard(
    prior: Queue, logs: Logs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queue holds diffs 96..98 of the shard; the state lists 96..100. The import
    keeps 96..98, writes 99 and 100, then fails in diff 96's messages: the rollback
    deletes 99 and 100 and nothing of 96..98."""
    small_batches(monkeypatch)
    old = synth_state(BASE, top_seqno=98, diffs=3, messages_per_diff=9, seed=23)
    new = synth_state(BASE, top_seqno=100, diffs=5, messages_per_diff=9, seed=23)
    assert [d.hash for d in new.diffs[2:]] == [d.hash for d in old.diffs]
    prior.import_state(io.BytesIO(state_bytes(old)), old.block_id, old.top_update)
    stored = len(shard_rows(prior, Table.MESSAGES, BASE))
    assert stored == 27
    spy = WriteSpy(prior, BASE, monkeypatch)
    diffs_tl, bocs = synth_parts(new)
    chunks = cut(bocs, 4)
    chunks[-1][-1] = encode_boc(internals(BASE, 96, 1))
    data = assemble(BASE, diffs_tl, chunks)
    exc = rejected(prior, data, new.block_id, new.top_update, match="message hash mismatch")
    assert "diff seqno 96" in str(exc)
    assert spy.peak > stored and spy.counts[-1] == stored
    (event,) = rolled_back(logs)
    assert event["reason"] == "failed" and sorted(event["diffs"]) == [99, 100]
    report = prior.import_state(io.BytesIO(state_bytes(new)), new.block_id, new.top_update)
    assert (report.written_diffs, report.kept_diffs) == (2, 3)


def test_failures_before_writing_leave_no_rollback(prior: Queue, logs: Logs) -> None:
    """A header failure is found before the marker: nothing to roll back."""
    rejected(prior, SHARD_BIN, SHARD_BLOCK, (bytes(32), 3), match="top queue diff")
    rejected(prior, SHARD_BIN[:1000], SHARD_BLOCK, match="truncated")
    assert rolled_back(logs) == []


def test_the_queue_reopens_clean_after_failures(
    prior: Queue, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small_batches(monkeypatch)
    state, diffs_tl, bocs = multi_chunk()
    rejected(prior, assemble(BASE, diffs_tl, cut(bocs, 6), tail=b"x"), state.block_id, match=".")
    then = before(prior)
    prior.close()
    with open_queue(db_path) as again:
        assert_unchanged(again, then)


def test_a_kept_import_error_does_not_keep_the_database_open(db_path: Path) -> None:
    """A caller that keeps the exception of a failed import (a list of errors, a log
    record) must still be able to close the queue and open it again."""
    state = synth_state(BASE, diffs=2, messages_per_diff=10, seed=24)
    data = state_bytes(state, max_chunk_roots=5) + b"x"
    queue = open_queue(db_path)
    errors: list[Exception] = []
    try:
        queue.import_state(io.BytesIO(data), state.block_id)
    except StateFormatError as exc:
        errors.append(exc)
    queue.close()
    assert len(errors) == 1
    with open_queue(db_path) as again:
        assert again.get_commit_pointers() == {}


def test_a_bad_file_given_by_path_is_named_with_what_to_do(prior: Queue, tmp_path: Path) -> None:
    """The readers name an offset; a caller who passed a path gets the path and the next
    step too, and so does one who passed a file object (by its name when it has one: a
    user audit found both missing there)."""
    cut = tmp_path / "shard-cut.bin"
    cut.write_bytes(SHARD_BIN[: len(SHARD_BIN) // 2])
    error = rejected(prior, cut, SHARD_BLOCK, SHARD_TOP, match="offset")
    message = str(error)
    assert message.startswith(f"{cut}: "), message
    assert f"not the queue state of {SHARD_BLOCK.short}" in message
    assert message.endswith("check the path, or fetch it again"), message
    bare = rejected(prior, SHARD_BIN[: len(SHARD_BIN) // 2], SHARD_BLOCK, SHARD_TOP, match="offset")
    assert str(bare).startswith("truncated at offset"), bare
    assert str(bare).endswith("check what was passed, or fetch the state again"), bare
    with cut.open("rb") as opened, pytest.raises(StateFormatError) as info:
        prior.import_state(opened, SHARD_BLOCK, SHARD_TOP)
    assert str(info.value).startswith(f"{cut}: truncated at offset"), info.value
    assert str(info.value).endswith("or fetch the state again"), info.value


def test_a_master_state_of_the_committed_seqno_but_another_block_is_refused(
    prior: Queue,
) -> None:
    """The prior queue's last committed block is the imported master state's. The same
    state under another block id of that seqno would replace the last committed block
    with a different one (a commit of an equal seqno is skipped instead): refused before
    anything is written. The same block again is fine (its diffs are kept)."""
    assert prior.get_last_committed_mc_block_id() == MASTER_BLOCK
    other = BlockId(MC, MASTER_BLOCK.seqno, b"\x01" * 32)
    then = before(prior)
    with pytest.raises(CommitError, match="not the last committed masterchain block"):
        prior.import_state(io.BytesIO(MASTER_BIN), other, MASTER_TOP)
    assert_unchanged(prior, then)
    prior.import_state(io.BytesIO(MASTER_BIN), MASTER_BLOCK, MASTER_TOP)
    assert prior.get_last_committed_mc_block_id() == MASTER_BLOCK
