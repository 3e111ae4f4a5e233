"""Too few file descriptors: RocksDB keeps every table file of the queue open, so a
process under a low ``ulimit -n`` fails the open with "Too many open files". That is the
process's limit, not damage: the error says to raise it (an outside audit found it
telling the operator to restore a sound directory from a copy)."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

from builders import BASE, Chain, Clock, open_queue

_OPEN = """
import sys
from imq import ImqError, Queue
try:
    Queue.open(sys.argv[1]).close()
    print("opened")
except ImqError as exc:
    print(exc)
"""


def _open_with_limit(path: Path, limit: int) -> str:
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    done = subprocess.run(
        [sys.executable, "-c", _OPEN, str(path)],
        capture_output=True,
        text=True,
        preexec_fn=lower,  # sets a limit only, in the child before exec
        timeout=120,
        check=False,
    )
    return (done.stdout + done.stderr).strip()


def test_running_out_of_file_descriptors_is_not_reported_as_damage(tmp_path: Path) -> None:
    path = tmp_path / "db"
    clock = Clock()
    for seqno in range(1, 6):  # table files of every table: a flush per reopen
        with open_queue(path) as queue:
            Chain(queue, clock).apply(BASE, 20, seqno=seqno)
            queue.compact()
    seen = {limit: _open_with_limit(path, limit) for limit in range(8, 40, 2)}
    refused = {limit: text for limit, text in seen.items() if text != "opened"}
    assert refused, seen  # the low limits fail
    assert seen[38] == "opened", seen  # and a higher one opens the same directory
    for text in refused.values():
        if "Too many open files" in text:
            assert "raise its limit" in text, text
            assert "restore" not in text, text
    assert any("Too many open files" in text for text in refused.values()), refused
