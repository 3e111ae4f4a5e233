"""A persistent queue state as a checked stream (SEMANTICS §13.3, with D11).

The header (every diff with its hash list) is read first; then chunks are read one at
a time and their roots handed out as *segments*: consecutive message roots of one diff,
each root's representation hash already checked against the diff's list. Memory is one
chunk plus the header, never the file.

Checks beyond the original reader (D11): a diff read only partway, a chunk that is never
needed, and bytes after the last chunk are all errors.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from imq.errors import StateFormatError
from imq.state.boc import BocError, RootView, split_roots
from imq.state.source import ByteSource
from imq.state.tl import (
    MAX_CHUNK_ROOTS,
    StateHeader,
    TlDiff,
    TopCheck,
    read_chunk,
    read_state_header,
)
from imq.types import BlockId, ShardIdent

__all__ = ["Segment", "StateReader", "header_check"]


@dataclass(frozen=True, slots=True)
class Segment:
    """Consecutive message roots of diff ``diff_index`` (an index into the header's
    diffs, newest first), starting at message ``first`` of that diff. ``last`` is True
    when the segment completes the diff; an empty diff yields one empty, last segment."""

    diff_index: int
    first: int
    roots: list[RootView]
    last: bool
    chunk_index: int
    chunk_offset: int
    root_index: int  # position of roots[0] in its chunk's root list


class StateReader:
    """Reads one state from ``src``; ``header`` is available at once."""

    def __init__(self, src: ByteSource, *, on_top: TopCheck | None = None) -> None:
        """``on_top``: see :func:`read_state_header` (:func:`header_check` makes one)."""
        self._src = src
        self.header: StateHeader = read_state_header(src, on_top=on_top)
        self.chunks_read = 0

    @property
    def total_messages(self) -> int:
        return sum(d.n_messages for d in self.header.diffs)

    def segments(self) -> Iterator[Segment]:
        """Every diff's message roots in file order, then the end-of-file checks."""
        roots: list[RootView] = []
        pos = 0  # next unread root of the current chunk
        chunk_offset = 0
        chunk_index = -1
        for index, diff in enumerate(self.header.diffs):
            done = 0
            need = diff.n_messages
            if need == 0:
                yield Segment(index, 0, [], True, chunk_index, chunk_offset, pos)
                continue
            while done < need:
                if pos == len(roots):
                    chunk_index, chunk_offset, roots = self._next_chunk(index, done)
                    pos = 0
                take = min(need - done, len(roots) - pos)
                part = roots[pos : pos + take]
                yield Segment(
                    index, done, part, done + take == need, chunk_index, chunk_offset, pos
                )
                done += take
                pos += take
        self._check_end()

    def _next_chunk(self, diff_index: int, done: int) -> tuple[int, int, list[RootView]]:
        index = self.chunks_read
        diff = self.header.diffs[diff_index]
        if index >= self.header.n_chunks:
            raise StateFormatError(
                f"not enough messages: diff seqno {diff.seqno} lists {diff.n_messages} messages "
                f"but the {self.header.n_chunks} chunks end after {done} of them "
                f"(offset {self._src.offset})"
            )
        offset = self._src.offset
        data = read_chunk(self._src, index)
        self.chunks_read += 1

        def expect(hashes: list[bytes]) -> None:
            self._check_chunk(hashes, diff_index, done, chunk_index=index, chunk_offset=offset)

        try:
            roots = split_roots(data, max_roots=MAX_CHUNK_ROOTS, expect=expect)
        except BocError as exc:
            raise StateFormatError(
                f"chunk {index} at offset {offset}: bad BOC ({exc.check}) at offset "
                f"{offset + 4 + exc.offset}: {exc}"
            ) from None
        return index, offset, roots

    def _check_chunk(
        self,
        hashes: list[bytes],
        diff_index: int,
        first: int,
        *,
        chunk_index: int,
        chunk_offset: int,
    ) -> None:
        """A chunk's root hashes against the diffs' lists, from message ``first`` of
        diff ``diff_index`` on (called before the chunk's cells are built)."""
        pos = 0
        diffs = self.header.diffs
        while pos < len(hashes) and diff_index < len(diffs):
            diff = diffs[diff_index]
            take = min(diff.n_messages - first, len(hashes) - pos)
            expected = diff.hashes[first * 32 : (first + take) * 32]
            if b"".join(hashes[pos : pos + take]) != expected:
                for i in range(take):
                    if hashes[pos + i] != expected[i * 32 : i * 32 + 32]:
                        raise StateFormatError(
                            f"message hash mismatch: message {first + i} of diff seqno "
                            f"{diff.seqno} (chunk {chunk_index} at offset {chunk_offset}, "
                            f"root {pos + i}) hashes to {hashes[pos + i].hex()}, the diff "
                            f"lists {expected[i * 32 : i * 32 + 32].hex()}"
                        )
            pos += take
            diff_index += 1
            first = 0
        if pos != len(hashes):
            raise StateFormatError(
                f"too many messages: chunk {chunk_index} (offset {chunk_offset}) has "
                f"{len(hashes) - pos} roots after the last message of the last diff"
            )

    def _check_end(self) -> None:
        if self.chunks_read < self.header.n_chunks:
            end = (
                "its diffs list no messages"
                if self.chunks_read == 0
                else f"its messages end in chunk {self.chunks_read - 1}"
            )
            raise StateFormatError(
                f"extra chunk announced: the state announces {self.header.n_chunks} chunks "
                f"but {end} (offset {self._src.offset}); a state's chunks hold exactly its "
                "diffs' messages, so its chunk count is wrong or a chunk holds no message"
            )
        if not self._src.at_eof():
            raise StateFormatError(
                f"data not fully read: trailing bytes after the last chunk at offset "
                f"{self._src.offset}"
            )


def header_check(block_id: BlockId, top_update: tuple[bytes, int] | None) -> TopCheck:
    """The checks of a state's header against the block it is read as, a
    :data:`TopCheck` (made as soon as the newest diff is read): the header's shard and
    seqno are the block's (I10), then, when given, the top update's diff hash and diff
    count."""

    def check(  # noqa: PLR0917 - the TopCheck signature
        shard: ShardIdent, seqno: int, n_diffs: int, top: TlDiff, top_hash: bytes, at: int
    ) -> None:
        if shard != block_id.shard or seqno != block_id.seqno:
            raise StateFormatError(
                f"the state belongs to block {shard}:{seqno}, not to {block_id.shard}:"
                f"{block_id.seqno} (header at offset 8)"
            )
        if top_update is None:
            return
        diff_hash, tail_len = top_update
        if top_hash != diff_hash:
            raise StateFormatError(
                f"top queue diff hash mismatch: the state's newest diff (seqno "
                f"{top.seqno}, offset {at}) hashes to {top_hash.hex()}, the top update says "
                f"{diff_hash.hex()}"
            )
        if n_diffs != tail_len:
            raise StateFormatError(
                f"queue diffs count mismatch: the state holds {n_diffs} diffs, the top "
                f"update says tail_len {tail_len}"
            )

    return check
