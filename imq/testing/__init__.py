"""Testing aids for imq and for applications built on it.

- :class:`OpLog` / :class:`RecordingQueue`: record a queue's calls as JSON lines (those
  of the log's format; what it cannot hold raises :class:`UnrecordableCallError`);
- :func:`replay` / :func:`assert_replays`: replay a log on a fresh database and on the
  model, comparing every result and the observable state after every step;
- :class:`QueueModel`: the plain-Python model of the queue's semantics (the oracle);
- :class:`MemoryDatabase`: queues on an in-memory store instead of RocksDB, reopenable
  (the database outlives each queue), for fast tests.

The format is in ``docs/replay-format.md``.
"""

from imq.testing.memory import MemoryDatabase
from imq.testing.model import DiffInput, QueueModel
from imq.testing.record import OpLog, RecordingQueue, UnrecordableCallError
from imq.testing.replay import (
    OpLogError,
    ReplayDivergenceError,
    ReplayReport,
    assert_replays,
    replay,
)

__all__ = [
    "DiffInput",
    "MemoryDatabase",
    "OpLog",
    "OpLogError",
    "QueueModel",
    "RecordingQueue",
    "ReplayDivergenceError",
    "ReplayReport",
    "UnrecordableCallError",
    "assert_replays",
    "replay",
]
