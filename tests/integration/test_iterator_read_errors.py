"""The iterator after a read error: it stays failed (docs/reliability.md: a typed
error or the intact result, never a short read that looks like a smaller range)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
from builders import BASE, Chain, full_range, quarter_shards, quiet_config

from imq import CorruptDataError, Queue, QueueClosedError
from imq import iterator as iterator_module
from imq.storage import Table, codec, rocks

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


@pytest.mark.parametrize("pure", [False, True], ids=["default", "pure-python"])
def test_a_close_between_the_last_fill_and_its_end_checks_is_no_clean_end(
    db_path: Path, monkeypatch: pytest.MonkeyPatch, pure: bool
) -> None:
    """RocksDB's rows stop quietly at a damaged block; the merge's end check of each
    source that ran out tells that from the range's end. A ``Queue.close()`` from another
    thread landing after the fill that found every source ended, and before those checks
    ran, dropped the checks with the cursors, and the read ended cleanly, short (an
    outside audit, on a damaged table file: 11 of 400 such closes). Here the fill closes
    the queue at that point, and the check raises whenever it still runs (a damaged
    block): the read must raise ``QueueClosedError``, not end."""
    fill_name = "_py_merge_fill" if pure or iterator_module._merge_fill is None else "_merge_fill"
    with Queue.open(db_path, quiet_config(message_cache_size=0)) as queue:
        Chain(queue).apply(SOURCES[0], 48)  # batches of 16 and 32: then a fill of none
        real_fill = getattr(iterator_module, fill_name)

        def fill_then_close(*args: Any, **kwargs: Any) -> Any:
            out = real_fill(*args, **kwargs)
            if out[3] and not out[0]:  # every source ended, nothing left to hand out
                queue.close()  # what another thread's close() does at a switch here
            return out

        def damaged_end(self: rocks.Cursor, last_key: bytes | None) -> None:
            if self._end is not None:  # the check still runs: it finds the damage
                raise CorruptDataError("messages", last_key or b"", "a damaged block")

        monkeypatch.setattr(iterator_module, fill_name, fill_then_close)
        monkeypatch.setattr(rocks.Cursor, "finish", damaged_end)
        with iterator_module.pure_python() if pure else contextlib.nullcontext():
            it = queue.iterator(0, [full_range(SOURCES[0])], BASE)
        got = []
        with pytest.raises(QueueClosedError):
            got.extend(it)
        assert len(got) == 48
        with pytest.raises(QueueClosedError):
            next(it)
