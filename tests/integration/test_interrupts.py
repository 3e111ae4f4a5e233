"""A Ctrl-C (``KeyboardInterrupt``) that lands inside a queue call, in a host that
catches it and goes on (a REPL, a node whose signal handler unwinds the current call).

rocksdict holds the GIL through a write, so Python raises the interrupt at the first
bytecode after RocksDB took the batch: the disk has the write, the handle's memory (its
state, its cache of fresh rows) does not. An outside audit found the live queue then
serving 20 of 30 messages without an error, and forgetting a commit, so that the next
clear deleted a committed diff. Now the interrupted handle is dead: every later call
says so, and a reopen reads what the disk holds.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from builders import BASE, MC, Chain, full_range, open_queue, top

from imq import Queue, StorageError
from imq.verify import verify


class _SignalAfterWrite:
    """rocksdict's handle, whose ``write`` raises SIGINT right after RocksDB took the
    batch: the moment a real Ctrl-C during a write is handled."""

    def __init__(self, db: Any) -> None:
        self._db = db
        self.armed = False

    def write(self, *args: Any) -> Any:
        result = self._db.write(*args)
        if self.armed:
            self.armed = False
            signal.raise_signal(signal.SIGINT)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def _later_calls(queue: Queue, chain: Chain) -> dict[str, Any]:
    third = chain.build(BASE, 5)
    return {
        "get_commit_pointers": queue.get_commit_pointers,
        "get_last_committed_mc_block_id": queue.get_last_committed_mc_block_id,
        "iterator": lambda: list(queue.iterator(0, [full_range(BASE)], BASE)),
        "get_diffs_tail_len": lambda: queue.get_diffs_tail_len(BASE, full_range(BASE).from_key),
        "clear_uncommitted_state": queue.clear_uncommitted_state,
        "apply_diff": lambda: queue.apply_diff(third.diff, third.block, third.hash),
    }


@pytest.mark.parametrize("call", ["apply_diff", "commit_diff"])
def test_a_ctrl_c_during_a_write_kills_the_handle(tmp_path: Path, call: str) -> None:
    path = tmp_path / "db"
    queue = open_queue(path)
    chain = Chain(queue)
    first = chain.apply(BASE, 10)
    mc = chain.apply(MC, 0)
    second = chain.build(BASE, 10)
    proxy = _SignalAfterWrite(queue._store._db)  # type: ignore[attr-defined]
    queue._store._db = proxy  # type: ignore[attr-defined]
    proxy.armed = True
    with pytest.raises(KeyboardInterrupt):
        if call == "apply_diff":
            queue.apply_diff(second.diff, second.block, second.hash)
        else:
            queue.commit_diff([top(MC, mc.seqno), top(BASE, first.seqno, mc.seqno)])
    for name, later in _later_calls(queue, chain).items():  # none served from memory
        try:
            later()
        except StorageError as exc:
            assert "this handle is dead" in str(exc), (name, exc)
            assert "interrupted" in str(exc), (name, exc)
        else:
            pytest.fail(f"{name} answered on a handle whose write was interrupted")
    queue.close()
    with open_queue(path) as again:  # what the disk holds: the whole interrupted call
        messages = list(again.iterator(0, [full_range(BASE)], BASE))
        if call == "apply_diff":
            assert len(messages) == 20
        else:
            assert again.get_commit_pointers()[BASE].seqno == first.seqno
            assert again.get_last_committed_mc_block_id() == top(MC, mc.seqno).block_id
            again.clear_uncommitted_state()
            assert len(list(again.iterator(0, [full_range(BASE)], BASE))) == 10
    report = verify(path)
    assert report.ok, report.problems
