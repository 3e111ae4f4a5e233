"""RocksDB and the in-memory store agree (``imq.storage.memory``); the state machine on
the in-memory store.

The queue state machine (``test_queue_machine.py``) drives a queue on RocksDB with random
operation sequences and records each one. Every recorded sequence is then replayed on a
queue over the in-memory store: each result (return value or error) must equal what the
RocksDB queue returned at that step, and after every write every public read must equal
the model's. Last, both stores replay the same sequences once more and must end up
holding byte-identical rows in every table.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from test_queue_machine import CONFIG, QueueMachine

from imq import Queue, QueueConfig
from imq.storage import Store, Table
from imq.testing import MemoryDatabase, replay


def _machine_logs(examples: int, steps: int) -> list[str]:
    QueueMachine.every_log = []
    try:
        run_state_machine_as_test(
            QueueMachine,
            settings=settings(
                max_examples=examples,
                stateful_step_count=steps,
                database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
        return list(QueueMachine.every_log)
    finally:
        QueueMachine.every_log = None


def _opener(memory: MemoryDatabase) -> Callable[[QueueConfig, int], Queue]:
    return lambda config, zerostate: memory.open(config, zerostate_seqno=zerostate)


def _rocks_rows(db: Path) -> dict[Table, list[tuple[bytes, bytes]]]:
    store = Store(db)
    try:
        return {t: store.load_table(t) for t in Table}
    finally:
        store.close()


def test_random_sequences_agree_on_rocksdb_and_in_memory(tmp_path: Path) -> None:
    logs = _machine_logs(examples=10, steps=40)
    assert logs
    for i, text in enumerate(logs):
        log = tmp_path / f"machine-{i}.jsonl"
        log.write_text(text, encoding="utf-8")
        memory = MemoryDatabase()
        report = replay(log, open_queue=_opener(memory))
        assert report.steps == len(text.splitlines()) - 1
        rocks_db = tmp_path / f"rocks-{i}"
        replay(log, rocks_db)
        assert memory.rows() == _rocks_rows(rocks_db), f"example {i}: the stored rows differ"


class MemoryQueueMachine(QueueMachine):
    """The state machine on the in-memory store: the same rules and invariants against
    the model, without RocksDB, so it runs many more steps in the same time."""

    RECORD = False
    verify_at_end = False  # nothing on disk to verify

    def __init__(self) -> None:
        self.memory = MemoryDatabase()
        super().__init__()

    def _open_queue(self) -> Queue:
        return self.memory.open(CONFIG, zerostate_seqno=self.zerostate_seqno)


def test_the_queue_machine_in_memory() -> None:
    run_state_machine_as_test(
        MemoryQueueMachine,
        settings=settings(
            max_examples=25,
            stateful_step_count=60,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


def test_a_memory_database_reopens_with_its_rows() -> None:
    db = MemoryDatabase()
    with db.open() as queue:
        assert queue.get_commit_pointers() == {}
    rows = db.rows()
    with db.open() as queue:
        assert queue.summary()["shards"] == {}
    assert db.rows() == rows
    assert rows[Table.VARS]  # the schema version, as RocksDB stores it
