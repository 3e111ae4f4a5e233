"""DiffTops: what a store remembers of each shard's highest stored diff."""

from __future__ import annotations

from imq import QueueKey, ShardIdent
from imq.storage.tops import DiffTop, DiffTops

A = ShardIdent(0, 0x4000_0000_0000_0000)
B = ShardIdent(0, 0xC000_0000_0000_0000)


def top(seqno: int) -> DiffTop:
    return DiffTop(seqno, b"key%d" % seqno, b"record%d" % seqno, QueueKey(seqno * 10, bytes(32)))


def test_a_shard_is_unknown_until_remembered() -> None:
    tops = DiffTops()
    epoch, known, value = tops.lookup(A)
    assert (known, value) == (False, None)
    tops.remember(A, epoch, top(3))
    assert tops.lookup(A)[1:] == (True, top(3))
    tops.remember(B, epoch, None)  # known: no stored diff
    assert tops.lookup(B)[1:] == (True, None)
    assert len(tops) == 2


def test_a_write_moves_a_known_top_up_only() -> None:
    tops = DiffTops()
    tops.remember(A, tops.lookup(A)[0], top(3))
    tops.after_write(False, [(A, top(4))])
    assert tops.lookup(A)[2] == top(4)
    tops.after_write(False, [(A, top(2))])  # below the top: the top stays
    assert tops.lookup(A)[2] == top(4)
    tops.remember(B, tops.lookup(B)[0], None)
    tops.after_write(False, [(B, top(1))])  # the first diff of a shard known empty
    assert tops.lookup(B)[2] == top(1)


def test_a_write_does_not_make_an_unknown_shard_known() -> None:
    tops = DiffTops()
    tops.after_write(False, [(A, top(5))])  # a higher diff may be stored: still unknown
    assert tops.lookup(A)[1] is False


def test_a_blind_write_forgets_every_shard_and_stale_reads() -> None:
    tops = DiffTops()
    epoch = tops.lookup(A)[0]
    tops.remember(B, epoch, top(1))
    tops.after_write(True, [(A, top(9))])  # blind wins over what the batch also put
    assert tops.lookup(A)[1] is False
    assert tops.lookup(B)[1] is False
    # A read that started before the blind write is not taken.
    tops.remember(A, epoch, top(7))
    assert tops.lookup(A)[1] is False
    tops.remember(A, tops.lookup(A)[0], top(7))
    assert tops.lookup(A)[2] == top(7)
    tops.forget()
    assert len(tops) == 0


def test_remember_keeps_what_a_write_set_meanwhile() -> None:
    tops = DiffTops()
    epoch = tops.lookup(A)[0]
    tops.remember(A, epoch, top(1))
    tops.after_write(False, [(A, top(2))])
    tops.remember(A, epoch, top(1))  # a late, older answer does not win
    assert tops.lookup(A)[2] == top(2)
