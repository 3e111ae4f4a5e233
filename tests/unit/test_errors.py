"""imq's errors: typed, with a message that says what to do, and intact across a process
boundary (the simulation's child queue sends them to its parent through a pipe)."""

from __future__ import annotations

import errno
import pickle

import pytest

import imq
from imq import errors

MADE = [
    errors.ImqError("plain"),
    errors.StateFormatError("bad chunk"),
    errors.DiffConflictError("diff of block 0:8000000000000000:1 is already stored"),
    errors.QueueClosedError("queue database q is closed"),
    errors.ReadInterruptedError("this iterator's read was cut short by TimeoutError"),
    errors.DatabaseLockedError("queue database q is already open"),
    errors.CorruptDataError("messages", b"\x01\x02", "bad row"),
    errors.StorageError("q", "open", "IO error", hint="free space"),
    errors.StorageError("q", "write", "IO error"),
    errors.FileAccessError("q/x.queue", "write the state file", OSError(errno.ENOSPC, "full")),
]


@pytest.mark.parametrize("error", MADE, ids=lambda e: type(e).__name__)
def test_every_error_pickles_as_it_was_raised(error: errors.ImqError) -> None:
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert str(again) == str(error)
    assert again.args == error.args
    assert {k: repr(v) for k, v in vars(again).items()} == {
        k: repr(v) for k, v in vars(error).items()
    }


def test_a_file_access_error_is_an_os_error_with_a_hint_by_errno() -> None:
    error = errors.FileAccessError("q/x.queue", "write the state file", OSError(errno.ENOSPC, "x"))
    assert isinstance(error, OSError) and isinstance(error, imq.ImqError)
    assert error.errno == errno.ENOSPC
    assert error.filename == "q/x.queue"
    assert str(error).startswith("cannot write the state file q/x.queue: x; the disk is full")
    unknown = errors.FileAccessError("p", "read", OSError(errno.EIO, "I/O error"))
    assert str(unknown).endswith("check the path and retry")


def test_an_error_given_its_own_next_step_carries_it_once_and_pickles_as_raised() -> None:
    conflict = errors.DiffConflictError
    advised = conflict("diff of block 0:8000000000000000:7 conflicts", next_step="do x")
    assert str(advised) == "diff of block 0:8000000000000000:7 conflicts; do x"
    again = pickle.loads(pickle.dumps(advised))
    assert type(again) is conflict and str(again) == str(advised)
    usual = conflict("diff of block 0:8000000000000000:7 conflicts")
    assert str(usual).endswith(conflict.next_step)
    assert str(pickle.loads(pickle.dumps(usual))) == str(usual)
    bare = conflict("diff of block 0:8000000000000000:7 conflicts", next_step="")
    assert str(bare) == "diff of block 0:8000000000000000:7 conflicts"
    assert str(pickle.loads(pickle.dumps(bare))) == str(bare)
