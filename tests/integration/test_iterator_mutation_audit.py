"""The merge iterator runs each RocksDB cursor's end check when its rows run out: a
scan that RocksDB ends early (rocksdict's row loop ends quietly on a damaged block) raises
``CorruptDataError`` from the iterator instead of reading as the end of the range, on
both merge paths, whether the source ended before the first message, in the middle of
the merge or after every other source. Found by a hand-made mutation audit of the merge
(removing the call of ``finish`` in ``imq.iterator._merge_batches`` failed no test: the
cursor's own check was tested, the merge's use of it was not)."""

from __future__ import annotations

import contextlib
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from builders import BASE, Chain, full_range, quarter_shards, quiet_config

from imq import CorruptDataError, Queue
from imq import iterator as iterator_module
from imq.storage import Table

SOURCES = quarter_shards()


class _StopsEarly:
    """A rocksdict handle whose row loops end after ``n`` rows, as rocksdict's loops end
    when RocksDB's iterator turns invalid on a damaged block; everything else (the raw
    iterator the end check uses) is the real handle's."""

    def __init__(self, db: Any, n: int) -> None:
        self._db = db
        self._n = n

    def items(self, *args: Any, **kwargs: Any) -> Any:
        return islice(self._db.items(*args, **kwargs), self._n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


@pytest.mark.parametrize("pure", [False, True], ids=["default", "pure-python"])
@pytest.mark.parametrize("stop_after", [0, 7, 25])
def test_a_scan_that_rocksdb_ends_early_fails_the_iterator(
    db_path: Path, pure: bool, stop_after: int
) -> None:
    with Queue.open(db_path, quiet_config(message_cache_size=0)) as queue:
        chain = Chain(queue)
        for shard in SOURCES[:2]:
            chain.apply(shard, 15)
            chain.apply(shard, 15)
        ranges = [full_range(s) for s in SOURCES]
        with iterator_module.pure_python() if pure else contextlib.nullcontext():
            whole = list(queue.iterator(0, ranges, BASE))
        assert len(whole) > 0
        tables = queue._store._tables
        real = tables[Table.MESSAGES]
        tables[Table.MESSAGES] = _StopsEarly(real, stop_after)
        try:
            with iterator_module.pure_python() if pure else contextlib.nullcontext():
                it = queue.iterator(0, ranges, BASE)
        finally:
            tables[Table.MESSAGES] = real
        got: list[Any] = []
        with pytest.raises(CorruptDataError, match="ended early"):
            got.extend(it)
        assert len(got) < len(whole)
        it.close()
