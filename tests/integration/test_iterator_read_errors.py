"""The iterator after a read error: it stays failed (docs/reliability.md: a typed
error or the intact result, never a short read that looks like a smaller range)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from builders import BASE, Chain, full_range, quarter_shards, quiet_config

from imq import CorruptDataError, Queue
from imq import iterator as iterator_module
from imq.storage import Table, codec

SOURCES = quarter_shards()


@pytest.mark.parametrize("pure", [False, True], ids=["default", "pure-python"])
def test_an_iterator_that_met_a_damaged_row_keeps_raising(db_path: Path, pure: bool) -> None:
    """A stored message row too short to hold its header stops the merge with
    ``CorruptDataError``. A caller that catches it and asks again must get the error
    again, not ``StopIteration``: that would read as the range's true end, the messages
    after the damaged row silently missing (it did, in both decode paths). Closing the
    iterator still ends it."""
    with Queue.open(db_path, quiet_config(message_cache_size=0)) as queue:
        chain = Chain(queue)
        first = chain.apply(SOURCES[0], 20)
        chain.apply(SOURCES[0], 20)
        bad = codec.message_prefix(0, SOURCES[0]) + codec.key_bytes(first.messages[-1].key)
        queue._store._tables[Table.MESSAGES][bad] = b"\x80"  # damaged: 1 byte
        with iterator_module.pure_python() if pure else contextlib.nullcontext():
            it = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
        got = []
        with pytest.raises(CorruptDataError):
            got.extend(it)
        assert len(got) < 19
        position = it.current_position()
        for _ in range(2):
            with pytest.raises(CorruptDataError):
                next(it)
        with pytest.raises(CorruptDataError):
            list(it)
        assert it.current_position() == position
        it.close()
        assert list(it) == []
        assert it.current_position() == position


@pytest.mark.parametrize("pure", [False, True], ids=["default", "pure-python"])
def test_a_skipped_row_with_a_damaged_key_is_corrupt_data_in_the_position(
    db_path: Path, pure: bool
) -> None:
    """A row for another shard is read no further than its destination header, so a key
    one byte short is skipped like any other; the position then stops at it, and
    ``current_position()`` raised a bare ``ValueError`` from the key's decode (found by
    an outside review of the merge). It is ``CorruptDataError``, as the row's damage."""
    with Queue.open(db_path, quiet_config(message_cache_size=0)) as queue:
        chain = Chain(queue)
        first = chain.apply(SOURCES[0], 3)
        good = codec.message_prefix(0, SOURCES[0]) + codec.key_bytes(first.messages[-1].key)
        value = queue._store._tables[Table.MESSAGES][good]
        prefix = codec.message_prefix(0, SOURCES[0])
        short = prefix + b"\xff" * (codec.MESSAGE_KEY_LEN - len(prefix) - 1)  # after the rest
        other = bytes([value[0] ^ 0x01]) + value[1:]  # another workchain: skipped
        queue._store._tables[Table.MESSAGES][short] = other
        with iterator_module.pure_python() if pure else contextlib.nullcontext():
            it = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
        with pytest.raises(CorruptDataError, match="message key of 53 bytes"):
            list(it)
            it.current_position()
