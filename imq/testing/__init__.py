"""Testing aids for imq and for applications built on it.

- :class:`OpLog` / :class:`RecordingQueue`: record every queue call as JSON lines;
- :func:`replay` / :func:`assert_replays`: replay a log on a fresh database and on the
  model, comparing every result and the observable state after every step;
- :class:`QueueModel`: the plain-Python model of the queue's semantics (the oracle);
- :class:`MemoryDatabase`: queues on an in-memory store instead of RocksDB, reopenable
  (the database outlives each queue), for fast tests.

The format is in ``docs/replay-format.md``.
"""

from imq.testing.memory import MemoryDatabase
from imq.testing.model import DiffInput, QueueModel
from imq.testing.record import OpLog, RecordingQueue
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
    "assert_replays",
    "replay",
]
