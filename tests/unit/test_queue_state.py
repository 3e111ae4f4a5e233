"""The queue state (D14): one frozen value, changed only by making a new one."""

from __future__ import annotations

import dataclasses

import pytest

from imq.storage import QueueState
from imq.types import BlockId, CommitPointer, QueueKey, ShardIdent

MC = ShardIdent.MASTERCHAIN
S1 = ShardIdent(0, 0x4000_0000_0000_0000)
S2 = ShardIdent(0, 0xC000_0000_0000_0000)


def key(lt: int) -> QueueKey:
    return QueueKey(lt, bytes(32))


def block(seqno: int) -> BlockId:
    return BlockId(MC, seqno, bytes(32), bytes(32))


def test_an_empty_state_has_nothing() -> None:
    state = QueueState()
    assert state.pointers == {}
    assert state.last_mc_block is None
    assert state.commit_record == {}
    assert state.gc_requested == {} and state.gc_executed == {}


def test_the_state_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        QueueState().last_mc_block = block(1)  # type: ignore[misc]


def test_a_commit_moves_only_the_listed_pointers_and_keeps_the_executed_bounds() -> None:
    before = QueueState(
        pointers={S1: CommitPointer(key(1), 1), S2: CommitPointer(key(2), 1)},
        gc_executed={(0, S1): key(1)},
    )
    after = before.committed(
        {S1: CommitPointer(key(5), 2)}, block(3), {S1: {S1: key(4)}}, {(0, S1): key(4)}
    )
    assert after.pointers == {S1: CommitPointer(key(5), 2), S2: CommitPointer(key(2), 1)}
    assert after.last_mc_block == block(3)
    assert after.commit_record == {S1: {S1: key(4)}}
    assert after.gc_requested == {(0, S1): key(4)}
    assert after.gc_executed == {(0, S1): key(1)}
    assert before.pointers[S1] == CommitPointer(key(1), 1)  # the old value is unchanged


def test_what_is_not_given_stays() -> None:
    before = QueueState(last_mc_block=block(2))
    assert before.committed({S1: CommitPointer(key(3), 3)}, None).last_mc_block == block(2)
    after = before.committed({MC: CommitPointer(key(3), 3)}, block(3))
    assert after.last_mc_block == block(3)
    assert after.pointers == {MC: CommitPointer(key(3), 3)}


def test_a_gc_mark_changes_only_the_executed_bounds() -> None:
    before = QueueState(gc_requested={(0, S1): key(9)})
    after = before.gc_marked({(0, S1): key(9)})
    assert after.gc_executed == {(0, S1): key(9)}
    assert after.gc_requested == before.gc_requested
