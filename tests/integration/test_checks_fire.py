"""Checks that must fire: each test here makes one of imq's own checks meet the fault it
exists for (a scan's end check, the import's synced marker). Written after a round of
hand mutation testing (stop 30): each of these checks could be broken without any other
test failing (verify's own such tests are in test_verify.py).
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from builders import open_queue
from rocksdict import Options, Rdict
from state_fixtures import write_state

from imq.errors import CorruptDataError
from imq.state.synth import synth_state
from imq.storage import Table, ops
from imq.storage.rocks import Cursor, Scan

# -- the end check of a scan (imq/storage/rocks.py, _EndCheck) -------------------------------


class _StopsEarly:
    """A rocksdict handle whose row loops end after ``n`` rows, as rocksdict's loops end
    quietly when RocksDB's iterator turns invalid on a damaged block; the raw iterator
    (``iter``, which the end check uses) is the real one."""

    def __init__(self, db: Rdict, n: int) -> None:
        self._db = db
        self._n = n

    def items(self, *args: Any, **kwargs: Any) -> Any:
        return islice(self._db.items(*args, **kwargs), self._n)

    def keys(self, *args: Any, **kwargs: Any) -> Any:
        return islice(self._db.keys(*args, **kwargs), self._n)

    def iter(self, *args: Any) -> Any:
        return self._db.iter(*args)


@pytest.fixture
def rdict(tmp_path: Path) -> Any:
    db = Rdict(str(tmp_path / "raw"), Options(raw_mode=True))
    for i in range(5):
        db[b"k%d" % i] = b"v%d" % i
    yield db
    db.close()


@pytest.mark.parametrize("keys_only", [False, True])
def test_a_scan_that_ends_early_raises_instead_of_reading_short(
    rdict: Any, keys_only: bool
) -> None:
    scan = Scan(Table.MESSAGES, b"k", b"l", keys_only=keys_only)
    assert len(list(Cursor(rdict, scan).items)) == 5  # the whole range: no error
    with pytest.raises(CorruptDataError, match="ended early"):
        list(Cursor(_StopsEarly(rdict, 2), scan).items)


def test_the_merge_path_end_check_raises_when_rows_end_early(rdict: Any) -> None:
    """The merge iterator pulls ``Cursor.rows`` and calls ``finish(last_key)`` itself."""
    cursor = Cursor(_StopsEarly(rdict, 2), Scan(Table.MESSAGES, b"k", b"l"))
    rows = list(cursor.rows)
    assert [k for k, _ in rows] == [b"k0", b"k1"]
    with pytest.raises(CorruptDataError, match="ended early"):
        cursor.finish(rows[-1][0])


# -- import durability (imq/state/importer.py) --------------------------------------------


def test_the_import_marker_and_the_final_batch_are_synced(tmp_path: Path) -> None:
    """docs/architecture.md: the import-in-progress marker is written with fsync before
    any row of the import, and the last batch (pointer, marker removed) too. A lost fsync
    cannot be seen by a process kill (the log stays in the page cache), only by watching
    the writes."""
    state = synth_state(diffs=2, messages_per_diff=[30, 20], seed=3)
    path, _ = write_state(state, tmp_path / "s.bin")
    queue = open_queue(tmp_path / "db")
    try:
        store = queue._store
        original = store.write
        writes: list[tuple[bool, bool]] = []  # (sync, the marker is stored after it)

        def write(txn: Any, *, sync: bool = False) -> None:
            original(txn, sync=sync)
            writes.append((sync, ops.read_import_marker(store) is not None))

        store.write = write  # type: ignore[method-assign]
        try:
            queue.import_state(path, state.block_id, state.top_update)
        finally:
            del store.write
        assert len(writes) >= 3
        first_sync, marker_stored = writes[0]
        assert marker_stored and first_sync, writes  # the marker, synced, comes first
        last_sync, marker_left = writes[-1]
        assert last_sync and not marker_left, writes
    finally:
        queue.close()
