"""imq: the internal message queue of a sharded blockchain collator, on RocksDB.

The public API (``docs/api.md``): value types, the router, diffs and statistics, the
``Queue`` facade with its iterator and pending diffs, the configuration and the errors.
"""

from imq.config import QueueConfig
from imq.diff import DiffStatistics, QueueDiff
from imq.errors import (
    CommitError,
    ConfigError,
    CorruptDataError,
    DatabaseLockedError,
    DiffBelowCommitPointerError,
    DiffConflictError,
    DiffSequenceError,
    FileAccessError,
    ImqError,
    QueueClosedError,
    SchemaVersionError,
    StartupError,
    StateFormatError,
    StorageError,
)
from imq.gc import GcRange, GcReport
from imq.iterator import QueueIterator
from imq.pending import PendingDiff
from imq.queue import CompactReport, Queue
from imq.router import PartitionRouter
from imq.state.exporter import ExportReport
from imq.state.importer import ImportReport
from imq.types import (
    DEFAULT_PARTITION,
    LOW_PRIORITY_PARTITION,
    Address,
    BlockId,
    BlockIdShort,
    CommitPointer,
    DiffInfo,
    DiffZone,
    IteratedMessage,
    Message,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    TopBlock,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PARTITION",
    "LOW_PRIORITY_PARTITION",
    "Address",
    "BlockId",
    "BlockIdShort",
    "CommitError",
    "CommitPointer",
    "CompactReport",
    "ConfigError",
    "CorruptDataError",
    "DatabaseLockedError",
    "DiffBelowCommitPointerError",
    "DiffConflictError",
    "DiffInfo",
    "DiffSequenceError",
    "FileAccessError",
    "DiffStatistics",
    "DiffZone",
    "ExportReport",
    "GcRange",
    "GcReport",
    "ImportReport",
    "ImqError",
    "IteratedMessage",
    "Message",
    "PartitionRouter",
    "PendingDiff",
    "Queue",
    "QueueClosedError",
    "QueueConfig",
    "QueueDiff",
    "QueueIterator",
    "QueueKey",
    "QueueShardRange",
    "SchemaVersionError",
    "StorageError",
    "ShardIdent",
    "StartupError",
    "StateFormatError",
    "TopBlock",
]
