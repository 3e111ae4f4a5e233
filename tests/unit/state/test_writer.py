"""The chunk spool's checks of the messages it is given (imq.state.writer): a message
added with its hash must hash to it; a malformed BOC is named by that hash; a failing
temporary file is a ``FileAccessError``."""

from __future__ import annotations

import errno
import io
import tempfile

import pytest

from imq.errors import FileAccessError
from imq.state.boc import encode_boc, split_roots
from imq.state.message import build_internal_message
from imq.state.writer import BadMessageError, ChunkSpool
from imq.types import Address

SRC, DST = Address(0, b"\x11" * 32), Address(0, b"\x22" * 32)


def _bocs(n: int, *, multi_cell: bool = False) -> list[tuple[bytes, bytes]]:
    """``n`` (hash, one-root BOC) message pairs."""
    cells = [
        build_internal_message(SRC, DST, 1_000 + i, body=b"b" * 8, body_in_ref=multi_cell)
        for i in range(n)
    ]
    return [(c.hash, encode_boc([c])) for c in cells]


def _chunks(spool: ChunkSpool) -> bytes:
    out = bytearray()

    class Sink:
        def write(self, data: bytes, /) -> int:
            out.extend(data)
            return len(data)

    spool.copy_to(Sink())
    return bytes(out)


@pytest.mark.parametrize("multi_cell", [False, True])
def test_messages_that_hash_to_their_hashes_are_spooled(multi_cell: bool) -> None:
    spool = ChunkSpool(max_roots=3)
    messages = _bocs(7, multi_cell=multi_cell)
    spool.add_checked(messages[:2])  # batches that do not end at a chunk's end
    spool.add_checked(messages[2:])
    spool.finish()
    spool.finish()  # again: nothing changes
    assert (spool.messages, spool.chunks) == (7, 3)
    data = _chunks(spool)
    spool.close()
    first = split_roots(data[4 : 4 + int.from_bytes(data[:4], "little")])
    assert [v.hash for v in first] == [h for h, _ in messages[:3]]


@pytest.mark.parametrize(("max_roots", "max_bytes"), [(3, 10**6), (100, 400), (4, 300)])
def test_add_checked_cuts_chunks_as_add_does(max_roots: int, max_bytes: int) -> None:
    messages = _bocs(11) + _bocs(3, multi_cell=True)
    one = ChunkSpool(max_roots=max_roots, max_bytes=max_bytes)
    for _, boc in messages:
        one.add(boc)
    batched = ChunkSpool(max_roots=max_roots, max_bytes=max_bytes)
    for start in range(0, len(messages), 5):
        batched.add_checked(messages[start : start + 5])
    for spool in (one, batched):
        spool.finish()
    assert (batched.messages, batched.chunks) == (one.messages, one.chunks)
    assert one.chunks > 2
    assert _chunks(batched) == _chunks(one)
    one.close()
    batched.close()


@pytest.mark.parametrize("multi_cell", [False, True])
@pytest.mark.parametrize("at", [0, 4, 6])
def test_a_message_that_does_not_hash_to_its_hash_is_named(at: int, multi_cell: bool) -> None:
    spool = ChunkSpool(max_roots=3)
    messages = _bocs(7, multi_cell=multi_cell)
    wrong = b"\x01" * 32
    rows = [(wrong if i == at else h, boc) for i, (h, boc) in enumerate(messages)]
    with pytest.raises(BadMessageError) as info:
        spool.add_checked(rows)
        spool.finish()
    spool.close()
    assert (info.value.hash, info.value.check) == (wrong, "message hash")
    assert info.value.detail == f"its root cell hashes to {messages[at][0].hex()}"


def test_a_malformed_boc_is_named_by_its_hash() -> None:
    spool = ChunkSpool()
    messages = _bocs(3)
    with pytest.raises(BadMessageError) as info:
        spool.add_checked([messages[0], (b"\x02" * 32, b"no boc"), messages[2]])
        spool.finish()
    spool.close()
    assert (info.value.hash, info.value.check) == (b"\x02" * 32, "magic")


def test_messages_without_hashes_are_not_checked_and_mixing_is_misuse() -> None:
    spool = ChunkSpool()
    (h, boc), (_, other) = _bocs(2)
    spool.add(boc)
    spool.add(other)
    spool.finish()
    assert spool.chunks == 1
    spool.close()
    mixed = ChunkSpool()
    mixed.add_checked([(h, boc)])
    mixed.add(other)
    with pytest.raises(ValueError, match="mixes add"):
        mixed.finish()
    mixed.close()


class _FullFile(io.BytesIO):
    def write(self, data: object, /) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_temporary_directory_is_a_file_access_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tempfile, "TemporaryFile", _FullFile)
    spool = ChunkSpool()
    (h, boc), *_ = _bocs(1)
    spool.add_checked([(h, boc)])
    with pytest.raises(FileAccessError, match="the disk is full") as info:
        spool.finish()
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == tempfile.gettempdir()
    assert isinstance(info.value.__cause__, OSError)

    def refused() -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", refused)
    with pytest.raises(FileAccessError, match="read-only"):
        ChunkSpool()
