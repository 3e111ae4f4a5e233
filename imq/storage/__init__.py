"""Storage: the only package that imports rocksdict.

``tables`` declares the column families, ``codec`` owns every byte layout, ``rocks``
opens the database and provides atomic transactions and consistent snapshots,
``queue_state`` is the in-memory state published with the writes, and ``ops`` is what
the domain calls: one named write per thing it does to the store, one named read per
question it asks.
"""

from imq.storage.backend import (
    CursorProtocol,
    SnapshotProtocol,
    StoreProtocol,
    TransactionProtocol,
)
from imq.storage.queue_state import CommitRecord, GcBounds, QueueState, StateUpdate
from imq.storage.rocks import Cursor, Scan, Snapshot, Store, Transaction, open_rdict
from imq.storage.tables import TABLES, StoreOptions, Table

__all__ = [
    "TABLES",
    "CommitRecord",
    "Cursor",
    "CursorProtocol",
    "GcBounds",
    "QueueState",
    "Scan",
    "Snapshot",
    "SnapshotProtocol",
    "StateUpdate",
    "Store",
    "StoreOptions",
    "StoreProtocol",
    "Table",
    "Transaction",
    "TransactionProtocol",
    "open_rdict",
]
