"""What the benchmarks share: the raw rocksdict floor, opened as imq opens its store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from imq import QueueConfig
from imq.storage import StoreOptions, Table, open_rdict

__all__ = ["RawDb"]


class RawDb:
    """Bare rocksdict with imq's column families and options (``open_rdict``), so the
    floor runs on the same engine configuration as imq."""

    def __init__(self, path: Path, config: QueueConfig) -> None:
        opts = StoreOptions(
            block_cache_size=config.block_cache_size,
            write_buffer_size=config.write_buffer_size,
            max_background_jobs=config.max_background_jobs,
        )
        self.db: Any = open_rdict(path, opts)
        self.cf: dict[Table, Any] = {t: self.db.get_column_family(t.value) for t in Table}
        self.handle: dict[Table, Any] = {
            t: self.db.get_column_family_handle(t.value) for t in Table
        }

    def close(self) -> None:
        # A live column-family object keeps RocksDB open: drop them before closing.
        self.cf.clear()
        self.handle.clear()
        self.db.close()
