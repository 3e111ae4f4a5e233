"""Checks of the persistent-state reader, import and export that a mutation audit of
``imq.state`` found no test for (FORMAT.md §3/§4, docs/formats.md §2, SEMANTICS §13).

Each test names the rule it pins; a failing one means the state code accepts a file the
format forbids, or loses or misfiles data."""

from __future__ import annotations

import io
import struct
from collections.abc import Sequence
from typing import Any

import pytest
from builders import dump, message_keys, rows
from state_fixtures import assemble, craft_diffs
from tycho_data import TYCHO

from imq import (
    Address,
    BlockId,
    BlockIdShort,
    DiffStatistics,
    Message,
    Queue,
    QueueDiff,
    QueueKey,
    ShardIdent,
    TopBlock,
)
from imq.errors import StateFormatError
from imq.state import importer
from imq.state.boc import Cell, encode_boc
from imq.state.message import build_internal_message, build_state_init
from imq.state.source import BUFFER_SIZE, ByteSource
from imq.state.tl import (
    TlDiff,
    decode_diff,
    diff_hash,
    encode_diff,
    read_state_header,
)
from imq.storage import Table

BASE = ShardIdent.BASECHAIN
_HASHES_AT = 4 + 32 + 12 + 4 + 4 + 40 + 40 + 4  # boxed diff without processed_to


def _h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _diff(hashes: bytes = b"", **kw: object) -> TlDiff:
    fields: dict[str, object] = {
        "prev_hash": bytes(32),
        "shard": BASE,
        "seqno": 7,
        "processed_to": (),
        "min_message": QueueKey.min_for_lt(1),
        "max_message": QueueKey.max_for_lt(2),
        "hashes": hashes,
    }
    fields.update(kw)
    return TlDiff(**fields)  # type: ignore[arg-type]


# -- TL reader: lists read a slice at a time ----------------------------------------------------


def test_hash_order_is_checked_across_the_readers_slices() -> None:
    """A diff's message hashes are strictly ascending (FORMAT §3). The reader checks a big
    list a slice of 32768 hashes at a time; a repeat exactly at a slice boundary must
    still be refused, or a file listing a message twice is accepted."""
    n = (1 << 20) // 32 + 1
    good = encode_diff(_diff(b"".join(_h(i + 1) for i in range(n))))
    last = _HASHES_AT + 32 * (n - 1)  # the first hash of the second slice
    bad = good[:last] + _h(n - 1) + good[last + 32 :]  # repeats its predecessor
    assert decode_diff(good).n_messages == n
    with pytest.raises(StateFormatError, match="not strictly ascending"):
        decode_diff(bad)


def test_router_account_order_is_checked_across_the_readers_slices() -> None:
    """Router accounts are strictly ascending by (wc, account) (FORMAT §3). The reader
    reads them 29127 at a time; a repeat straddling two slices must be refused."""
    per_slice = (1 << 20) // 36
    n = per_slice + 1
    head = encode_diff(_diff())[:-8]  # without the two empty router counts
    accounts = [struct.pack("<i32s", 0, _h(i + 1)) for i in range(n)]
    tail = struct.pack("<I", 0)  # router_dst: empty
    good = head + struct.pack("<III", 1, 1, n) + b"".join(accounts) + tail
    accounts[per_slice] = accounts[per_slice - 1]  # a repeat across the slice boundary
    bad = head + struct.pack("<III", 1, 1, n) + b"".join(accounts) + tail
    assert len(decode_diff(good).router_src[0][1]) == n
    with pytest.raises(StateFormatError, match="accounts not strictly ascending"):
        decode_diff(bad)


# -- states built here --------------------------------------------------------------------------


def _src(n: int) -> Address:
    return Address(0, bytes([0x10, n]) + bytes(30))


def _dst(n: int) -> Address:
    return Address(0, bytes([0x90, n]) + bytes(30))


def _message(n: int, lt: int, body_bytes: int = 0) -> Cell:
    """A valid internal message; ``body_bytes`` > 0 gives it a chain of body cells of its
    own (unique bytes: no cell is shared with another message)."""
    if not body_bytes:
        return build_internal_message(_src(n), _dst(n), lt, body=b"msg %d" % n)
    body = (n.to_bytes(4, "big") * (body_bytes // 4 + 1))[:body_bytes]
    return build_internal_message(_src(n % 200), _dst(n % 200), lt, body=body, body_in_ref=True)


def _state(
    groups: Sequence[Sequence[Cell]],
    *,
    first_seqno: int = 10,
    shard: ShardIdent = BASE,
    spans: dict[int, tuple[QueueKey, QueueKey]] | None = None,
    **routers: object,
) -> tuple[bytes, BlockId, tuple[bytes, int]]:
    """A state of one diff per group (oldest group first; diff ``s`` spans lts
    ``1000 s ..= 1000 s + 999`` unless ``spans`` gives group ``i`` another span), all
    messages in one chunk, with its block id and top update. ``routers``
    (``router_src``, ``router_dst``) go into every diff."""
    diffs = craft_diffs(shard, first_seqno, groups, processed_to=(), spans=spans, **routers)
    roots = [boc for diff in diffs for boc in diff.bocs]
    data = assemble(shard, [diff.tl for diff in diffs], [roots] if roots else [])
    block = BlockId(shard, first_seqno + len(groups) - 1)
    return data, block, (diff_hash(diffs[0].tl), len(diffs))


def _with_bit(cell: Cell, bit: int, value: int) -> Cell:
    """``cell`` with data bit ``bit`` (from the start) set to ``value``."""
    data = bytearray(cell.data)
    mask = 0x80 >> (bit % 8)
    data[bit // 8] = data[bit // 8] | mask if value else data[bit // 8] & ~mask
    return Cell(bytes(data), cell.bits, cell.refs)


def _refused(queue: Queue, data: bytes, block: BlockId, top: tuple[bytes, int], match: str) -> None:
    """The import fails with ``StateFormatError`` and the queue is as it was."""
    then = dump(queue)
    with pytest.raises(StateFormatError, match=match):
        queue.import_state(io.BytesIO(data), block, top)
    assert dump(queue) == then


def test_the_states_builder_makes_importable_states(queue: Queue) -> None:
    """The helper below the message tests builds a state that imports (a control)."""
    data, block, top = _state([[_message(1, 10_001), _message(2, 10_002)]])
    report = queue.import_state(io.BytesIO(data), block, top)
    assert report.messages == 2


# -- message headers (docs/formats.md §2.5, FORMAT §6: only int_msg_info with addr_std) --------


def test_a_message_whose_info_tag_is_not_internal_is_refused(queue: Queue) -> None:
    """A message cell starting with bit 1 is no ``int_msg_info$0`` (it is an external
    message's tag): the import must refuse it, even when every later field has the
    lengths of an internal message's header."""
    bad = _with_bit(_message(1, 10_001), 0, 1)
    data, block, top = _state([[bad]])
    _refused(queue, data, block, top, "bad info")


def test_a_message_whose_destination_is_not_addr_std_is_refused(queue: Queue) -> None:
    """The destination must be ``addr_std$10``: a dst tagged ``00`` (addr_none) with the
    length of a std address is refused, not filed under a made-up destination."""
    bad = _with_bit(_message(1, 10_001), 4 + 267, 0)  # the dst tag's first bit
    data, block, top = _state([[bad]])
    _refused(queue, data, block, top, "bad dst")


def test_a_message_whose_source_claims_an_anycast_prefix_is_refused(queue: Queue) -> None:
    """imq addresses are ``addr_std`` without anycast (docs/formats.md §2.5): a source
    whose anycast bit is set is refused, even when no anycast data follows it (so the
    header's length is that of a plain std address)."""
    bad = _with_bit(_message(1, 10_001), 4 + 2, 1)  # src: tag "10", then the anycast bit
    data, block, top = _state([[bad]])
    _refused(queue, data, block, top, "bad src")


# Found by this audit (not a mutant): FORMAT.md §6 says the Rust import parses each
# message as a whole ``Message`` and fails the import when it cannot; imq parsed only the
# header (docs/formats.md §2.5), so a message cell whose header promises a ref that is not
# there imported (pytoniq-core cannot parse such a cell either). The import now counts
# the references the header names against the cell's.
@pytest.mark.parametrize(("bit", "field"), [(542, "extra currencies"), (648, "body in a ref")])
def test_a_message_missing_the_ref_its_header_names_is_refused(
    queue: Queue, bit: int, field: str
) -> None:
    """FORMAT §6: every message of a state parses as a ``Message``, else the whole import
    fails. A message whose ``extra_currencies`` (Maybe ^Cell) or body (Either X ^X) bit
    says "in a ref" while the cell has no ref is no valid ``Message``: it must be refused."""
    plain = _message(1, 10_001)  # no refs; 689 bits: the body bit is bit 648
    assert plain.bits == 689 and not plain.refs
    data, block, top = _state([[_with_bit(plain, bit, 1)]])
    _refused(queue, data, block, top, "bad refs")


def _with_init(n: int, lt: int, init: Cell, *, in_ref: bool) -> Cell:
    return build_internal_message(
        _src(n), _dst(n), lt, body=b"init %d" % n, init=init, init_in_ref=in_ref
    )


_LEAF = Cell(b"\x2a", 8)


def test_messages_carrying_an_init_import_and_export_back_bit_exactly(queue: Queue) -> None:
    """A message may carry a StateInit, inline or in a ref (FORMAT.md §7): the import
    walks it (stop 47) and files the message like any other; the export writes the
    same bytes back."""
    full = build_state_init(split_depth=5, special=1, refs=[_LEAF, Cell(b"\x2b", 8), _LEAF])
    messages = [
        _with_init(1, 10_001, full, in_ref=False),
        _with_init(2, 10_002, full, in_ref=True),
        _with_init(3, 10_003, build_state_init(), in_ref=False),
    ]
    data, block, top = _state([messages])
    assert queue.import_state(io.BytesIO(data), block, top).messages == 3
    out = io.BytesIO()
    assert queue.export_state(BASE, block.seqno, 1, out).bit_exact
    assert out.getvalue() == data


def test_a_message_whose_inline_init_names_a_missing_ref_is_refused(queue: Queue) -> None:
    """An inline init's code, data and library bits each name a reference: a message
    whose init says "code present" while the cell holds no reference for it is no
    ``Message`` (FORMAT §6): refused, the queue as it was."""
    plain = _with_init(1, 10_001, build_state_init(), in_ref=False)
    code_bit = plain.bits - 1 - 8 * len(b"init 1") - 3  # code, data, library, body bit
    data, block, top = _state([[_with_bit(plain, code_bit, 1)]])
    _refused(queue, data, block, top, "bad refs")


def test_a_message_whose_init_in_a_ref_is_no_state_init_is_refused(queue: Queue) -> None:
    """An init "in a ref" must be a StateInit: a 3-bit cell there (fewer than its five
    Maybe bits) makes the message unparseable, so the import refuses the state."""
    bad = _with_init(1, 10_001, Cell(b"\xa0", 3), in_ref=True)
    data, block, top = _state([[bad]])
    _refused(queue, data, block, top, "bad init")


# -- zstd input (docs/formats.md §2.3: streamed, frame structure walked) ------------------------

MASTER_BIN = (TYCHO / "persistent_state" / "master.bin").read_bytes()
MASTER_BLOCK = BlockId(ShardIdent.MASTERCHAIN, 90)
MASTER_TOP = (bytes.fromhex("5795ca5d1b8d0c1ce96394eef851bde718ff2e14fd2840098ed2bb7640f278c5"), 1)


def _zstd_frame(blocks: Sequence[tuple[int, bytes, int]]) -> bytes:
    """One zstd frame (RFC 8878) written by hand: no content size, a 2 MiB window, no
    checksum; ``blocks`` are (type, content, regenerated size): 0 raw, 1 RLE."""
    out = bytearray(b"\x28\xb5\x2f\xfd\x00\x58")
    for i, (kind, content, size) in enumerate(blocks):
        last = int(i == len(blocks) - 1)
        out += (last | kind << 1 | size << 3).to_bytes(3, "little") + content
    return bytes(out)


def test_a_zstd_state_with_rle_blocks_imports(queue: Queue) -> None:
    """Any valid zstd stream of a state imports: an RLE block (RFC 8878 §3.1.1.2.2: one
    byte of content standing for ``size`` bytes) is a block like any other for the frame
    walker that tells a complete stream from a cut one."""
    run = MASTER_BIN.index(bytes(16))
    frame = _zstd_frame(
        [
            (0, MASTER_BIN[:run], run),
            (1, b"\x00", 16),
            (0, MASTER_BIN[run + 16 :], len(MASTER_BIN) - run - 16),
        ]
    )
    report = queue.import_state(io.BytesIO(frame), MASTER_BLOCK, MASTER_TOP)
    assert (report.diffs, report.bytes, report.source_bytes) == (1, len(MASTER_BIN), len(frame))


# -- the end of the file (docs/formats.md §2.3: trailing bytes are an error, D11) ---------------


@pytest.fixture(scope="module")
def big_chunk_state() -> tuple[bytes, BlockId, tuple[bytes, int]]:
    """A state whose only chunk is so large (over 2 MiB) that the reader reads its end
    past its 1 MiB buffer; its length is a multiple of 4 (no padding read follows), so
    the end of the file is found by a fresh read of the input."""
    cells = [_message(k, 10_001 + k % 900, body_bytes=2031) for k in range(1001)]
    data, block, top = _state([cells])
    src = ByteSource.from_bytes(data)
    header = read_state_header(src)
    (chunk_len,) = struct.unpack_from("<I", data, src.offset)
    assert header.n_chunks == 1 and src.offset + chunk_len > 2 * BUFFER_SIZE and chunk_len % 4 == 0
    return data, block, top


def test_trailing_bytes_after_a_chunk_bigger_than_the_read_buffer(
    queue: Queue, big_chunk_state: tuple[bytes, BlockId, tuple[bytes, int]]
) -> None:
    """Bytes after the last chunk are refused (D11, FORMAT §3: "the Rust reader rejects
    trailing bytes"), also when the last chunk was read in one piece past the buffer and
    nothing of the file is buffered any more."""
    data, block, top = big_chunk_state
    _refused(queue, data + b"\x00" * 4, block, top, "trailing bytes")
    assert queue.import_state(io.BytesIO(data), block, top).messages == 1001


# -- diffs already stored (API.md import_state: "kept as is") -----------------------------------


def test_a_diff_stored_with_the_same_hash_keeps_its_message_rows(queue: Queue) -> None:
    """A diff already stored with the state's hash is kept as is (API.md, import_state):
    the import reads and checks its messages but writes none of them, so rows the node
    stored when it applied the diff itself (with its own bodies) stay byte for byte."""
    lts = (10_001, 10_002)
    cells = [_message(n, lt) for n, lt in enumerate(lts)]
    data, block, top = _state([cells])
    applied = QueueDiff(
        [
            Message(QueueKey(lt, c.hash), _src(n), _dst(n), b"applied")
            for n, (lt, c) in enumerate(zip(lts, cells, strict=True))
        ],
        prev_hash=bytes(32),
    )
    assert queue.apply_diff(applied, BlockIdShort(BASE, 10), top[0])
    stored = rows(queue, Table.MESSAGES)

    report = queue.import_state(io.BytesIO(data), block, top)

    assert (report.written_diffs, report.kept_diffs, report.messages) == (0, 1, 2)
    assert rows(queue, Table.MESSAGES) == stored


# -- partitions (FORMAT §6: the dst router first, then src, else 0) -----------------------------


def test_a_destination_listed_in_partition_0_is_not_looked_up_in_the_src_router(
    queue: Queue,
) -> None:
    """The partition is the first dst-router partition listing the destination; only a
    destination the dst router does not list goes to the src router (FORMAT §6). A file
    may list an address in partition 0 (the index fits u16): that is a match, and the
    message stays in partition 0 even though its source is routed to partition 2."""
    cell = _message(1, 10_001)
    data, block, top = _state(
        [[cell]], router_dst=((0, (_dst(1),)),), router_src=((2, (_src(1),)),)
    )
    queue.import_state(io.BytesIO(data), block, top)
    assert message_keys(queue, 0, BASE) == [QueueKey(10_001, cell.hash)]
    assert message_keys(queue, 2, BASE) == []


# -- all or nothing (D10: the import marker) and the last committed block (I8) ------------------


def test_a_one_diff_import_that_fails_after_writing_is_rolled_back(
    queue: Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An import is all or nothing (D10, docs/behaviour.md §5.8) also for a state of a
    single diff: its messages are written in batches under the import marker, and a
    failure found only at the end of the file (trailing bytes) removes them again."""
    monkeypatch.setattr(importer, "BATCH_ROWS", 1)
    store = queue._store
    write, written = store.write, []

    def spy(txn: Any, *, sync: bool = False) -> None:
        write(txn, sync=sync)
        written.append(len(rows(queue, Table.MESSAGES)))

    monkeypatch.setattr(store, "write", spy)
    data, block, top = _state([[_message(n, 10_001 + n) for n in range(3)]])
    _refused(queue, data + bytes(4), block, top, "trailing bytes")
    assert max(written) == 3  # the messages had reached the database


def test_an_older_masterchain_state_leaves_the_last_committed_block(queue: Queue) -> None:
    """The last committed masterchain block never moves back (decision I8): a commit
    whose masterchain diff is absent sets it without a masterchain pointer, and a later
    import of an older masterchain state sets that shard's pointer but keeps the block."""
    newer = BlockId(ShardIdent.MASTERCHAIN, 95)
    assert queue.commit_diff([TopBlock(newer, 95, updated=False)])
    report = queue.import_state(io.BytesIO(MASTER_BIN), MASTER_BLOCK, MASTER_TOP)
    assert report.written_diffs == 1
    assert queue.get_last_committed_mc_block_id() == newer
    assert queue.get_commit_pointers()[ShardIdent.MASTERCHAIN].seqno == 90


# -- export (docs/formats.md §2.3, exporter: what its import would reject is refused) -----------


def test_export_refuses_diffs_whose_spans_touch(queue: Queue) -> None:
    """A state's diffs with messages hold ascending, disjoint key ranges: an older diff's
    ``max_message`` must lie strictly below the newer one's ``min_message`` (the reader
    refuses equality, docs/formats.md §2.3). Diffs applied with explicit statistics whose
    spans meet at one key cannot be exported: their file would not import."""
    touch = QueueKey.max_for_lt(20_000)
    for seqno, lt, lo, hi in ((1, 10_001, None, touch), (2, 30_001, touch, None)):
        cell = _message(seqno, lt)
        key = QueueKey(lt, cell.hash)
        message = Message(key, _src(seqno), _dst(seqno), encode_boc([cell]))
        stats = DiffStatistics(BASE, lo or key, hi or key, {0: {_dst(seqno): 1}})
        diff = QueueDiff([message], prev_hash=bytes(32))
        assert queue.apply_diff(diff, BlockIdShort(BASE, seqno), bytes([seqno]) * 32, stats)
    out = io.BytesIO()
    with pytest.raises(StateFormatError, match="ascending, disjoint message ranges"):
        queue.export_state(BASE, 2, 2, out)
    assert out.getvalue() == b""


def test_an_empty_diff_with_any_span_exports_back_bit_exactly(queue: Queue) -> None:
    """Empty diffs are left out of the ascending, disjoint ranges rule (docs/formats.md
    §2.3, I15: their spans are whatever their collator or a test chose). A state whose
    empty middle diff spans MIN..MIN imports, and exports back byte for byte."""
    groups = [[_message(1, 10_001)], [], [_message(2, 12_001)]]
    data, block, top = _state(groups, spans={1: (QueueKey.MIN, QueueKey.MIN)})
    queue.import_state(io.BytesIO(data), block, top)
    out = io.BytesIO()
    report = queue.export_state(BASE, 12, 3, out)
    assert report.bit_exact
    assert out.getvalue() == data
