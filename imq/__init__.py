"""imq: the internal message queue of a sharded blockchain collator, on RocksDB.

The public API (``docs/api.md``): value types, the router, diffs and statistics, the
``Queue`` facade with its iterator and pending diffs, the configuration and the errors.

The names load on first use (PEP 562): ``import imq`` itself imports nothing else, so
that a program (the ``imq`` command) that starts by importing it gets control at once,
and a Ctrl-C in its first moments meets its own handler.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from imq.config import QueueConfig
    from imq.diff import DiffStatistics, QueueDiff
    from imq.errors import (
        CommitError,
        ConfigError,
        ConfigTypeError,
        CorruptDataError,
        DatabaseLockedError,
        DiffBelowCommitPointerError,
        DiffConflictError,
        DiffSequenceError,
        FileAccessError,
        ImqError,
        QueueClosedError,
        ReadInterruptedError,
        ReadOnlyError,
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
    "ConfigTypeError",
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
    "ReadInterruptedError",
    "ReadOnlyError",
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

_LAZY: dict[str, str] = {
    "QueueConfig": "imq.config",
    "DiffStatistics": "imq.diff",
    "QueueDiff": "imq.diff",
    "CommitError": "imq.errors",
    "ConfigError": "imq.errors",
    "ConfigTypeError": "imq.errors",
    "CorruptDataError": "imq.errors",
    "DatabaseLockedError": "imq.errors",
    "DiffBelowCommitPointerError": "imq.errors",
    "DiffConflictError": "imq.errors",
    "DiffSequenceError": "imq.errors",
    "FileAccessError": "imq.errors",
    "ImqError": "imq.errors",
    "QueueClosedError": "imq.errors",
    "ReadInterruptedError": "imq.errors",
    "ReadOnlyError": "imq.errors",
    "SchemaVersionError": "imq.errors",
    "StartupError": "imq.errors",
    "StateFormatError": "imq.errors",
    "StorageError": "imq.errors",
    "GcRange": "imq.gc",
    "GcReport": "imq.gc",
    "QueueIterator": "imq.iterator",
    "PendingDiff": "imq.pending",
    "CompactReport": "imq.queue",
    "Queue": "imq.queue",
    "PartitionRouter": "imq.router",
    "ExportReport": "imq.state.exporter",
    "ImportReport": "imq.state.importer",
    "DEFAULT_PARTITION": "imq.types",
    "LOW_PRIORITY_PARTITION": "imq.types",
    "Address": "imq.types",
    "BlockId": "imq.types",
    "BlockIdShort": "imq.types",
    "CommitPointer": "imq.types",
    "DiffInfo": "imq.types",
    "DiffZone": "imq.types",
    "IteratedMessage": "imq.types",
    "Message": "imq.types",
    "QueueKey": "imq.types",
    "QueueShardRange": "imq.types",
    "ShardIdent": "imq.types",
    "TopBlock": "imq.types",
}


if not TYPE_CHECKING:
    # Hidden from type checkers: a module-level ``__getattr__`` they can see makes every
    # unknown ``imq.X`` (a misspelt name) an ``Any`` they accept; the names above are
    # what they check against.

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'imq' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # the next lookup is an ordinary one
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
