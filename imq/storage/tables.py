"""The six column families, each declared once: name, key layout, value, RocksDB options.

Byte layouts themselves live in :mod:`imq.storage.codec`; this module says what each
table holds and how RocksDB should treat it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rocksdict import BlockBasedOptions, Cache, DataBlockIndexType, DBCompressionType, Options

__all__ = ["TABLES", "StoreOptions", "Table", "TableSpec", "table_options"]


class Table(enum.Enum):
    MESSAGES = "messages"
    STATISTICS = "statistics"
    DIFF_TAIL = "diff_tail"
    DIFF_INFO = "diff_info"
    COMMIT_POINTERS = "commit_pointers"
    VARS = "vars"


@dataclass(frozen=True, slots=True)
class TableSpec:
    table: Table
    key: str
    value: str
    bulk: bool  # written in large batches, shrunk by GC's and clear's deletes
    blobs: bool = False  # large values go to blob files
    point_deletes: bool = False  # rows are deleted one by one (not by range tombstones)
    # Data block size; None: RocksDB's 4 KiB. The message table is read in long forward
    # scans (the merge iterator), where each block costs a block-cache lookup, insert and
    # eviction, a read and a checksum: 32 KiB blocks cut a scan's RocksDB time by about a
    # third (1,000,000 rows of 320 B through imq: 1.7 -> 2.5 M msgs/s, 64 KiB no better).
    block_size: int | None = None


TABLES: dict[Table, TableSpec] = {
    spec.table: spec
    for spec in (
        TableSpec(
            Table.MESSAGES,
            key="partition u16 | source shard (12) | lt u64 | hash (32)        = 54 B",
            value="dst wc (1) | dst account (32) | src wc (1) | src account (32) | body",
            bulk=True,
            blobs=True,
            block_size=32 << 10,
        ),
        TableSpec(
            Table.STATISTICS,
            key="source shard (12) | partition u16 | diff max_message (40) | seqno u32 = 58 B",
            value="per destination: wc (1) | account (32) | count u64, packed",
            bulk=True,
        ),
        TableSpec(
            Table.DIFF_TAIL,
            key="shard (12) | diff max_message (40) | seqno u32                   = 56 B",
            value="empty",
            bulk=True,
        ),
        TableSpec(
            Table.DIFF_INFO,
            key="shard (12) | seqno u32                                          = 16 B",
            value="msgpack DiffInfo record",
            bulk=True,
            point_deletes=True,
        ),
        TableSpec(
            Table.COMMIT_POINTERS,
            key="shard (12)",
            value="max_message (40) | seqno u32",
            bulk=False,
        ),
        TableSpec(
            Table.VARS,
            key="ASCII name",
            value="per name: schema version, last committed mc block, commit record, GC bounds",
            bulk=False,
        ),
    )
}


@dataclass(frozen=True, slots=True)
class StoreOptions:
    block_cache_size: int = 256 << 20
    write_buffer_size: int = 64 << 20
    max_background_jobs: int = 2
    min_blob_size: int = 32 << 10
    max_total_wal_size: int = 256 << 20
    message_cache_size: int = 64 << 20  # fresh message rows kept in memory (0: none)
    message_scans_fill_cache: bool = True  # QueueConfig.message_scans_fill_cache


def table_options(spec: TableSpec, cache: Cache, opts: StoreOptions) -> Options:
    """RocksDB options for one table.

    Bulk tables: RocksDB's own levelled compaction in its background threads (it keeps
    the L0 files bounded and drops what GC's range tombstones cover as the data moves
    down), no compression (CPU on the write path), large memtables. The original turns
    automatic compaction off and compacts each deleted range by hand (SEMANTICS §3):
    measured here, every such compaction rewrote whole L0 and bottom files, so one GC
    pass cost 0.9 s at 10^6 stored messages against 0.6 ms without it, and with nothing
    collected the L0 files grew without bound (``benchmarks/results/scaling.md``).
    Point tables: bloom filters and a hash index, normal compaction.
    """
    o = Options(raw_mode=True)
    bbo = BlockBasedOptions()
    bbo.set_block_cache(cache)
    bbo.set_format_version(6)
    if spec.block_size is not None:
        bbo.set_block_size(spec.block_size)
    o.set_level_compaction_dynamic_level_bytes(True)
    if spec.bulk:
        o.set_compression_type(DBCompressionType.none())
        o.set_write_buffer_size(opts.write_buffer_size)
        o.set_max_write_buffer_number(2)
        if spec.blobs:
            o.set_enable_blob_files(True)
            o.set_min_blob_size(opts.min_blob_size)
            o.set_enable_blob_gc(True)
            o.set_blob_compression_type(DBCompressionType.none())
        if spec.point_deletes:
            # Point tombstones slow every seek that crosses them until a compaction drops
            # them: mark a file for compaction once a window of its rows is mostly deletes.
            o.add_compact_on_deletion_collector_factory(128, 64, 0.5)
    else:
        bbo.set_bloom_filter(10, False)
        bbo.set_data_block_index_type(DataBlockIndexType.binary_and_hash())
        bbo.set_data_block_hash_ratio(0.75)
        o.set_optimize_filters_for_hits(True)
        o.set_memtable_whole_key_filtering(True)
        o.set_write_buffer_size(4 << 20)
    o.set_block_based_table_factory(bbo)
    return o
