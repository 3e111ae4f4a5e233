"""A wrong argument's ``TypeError`` names the argument (a user audit: ``commit_diff(None)``
said "'NoneType' object is not iterable", and one ``ShardIdent`` where a list belongs,
iterated as the tuple it is, said "top shard must be a ShardIdent, got int")."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from imq import (
    Address,
    BlockId,
    Message,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    TopBlock,
)

MC_BLOCK = BlockId(ShardIdent.MASTERCHAIN, 1, bytes(32), bytes(32))
TOP = TopBlock(MC_BLOCK, 1)
RANGE = QueueShardRange(ShardIdent.BASECHAIN, QueueKey.MIN, QueueKey.MAX)
MESSAGE = Message(QueueKey(1, bytes(32)), Address(0, bytes(32)), Address(0, bytes(32)))

CALLS: list[tuple[str, Callable[[Queue], Any], str]] = [
    ("commit None", lambda q: q.commit_diff(None), "top_blocks must be a list of TopBlock"),
    ("commit one", lambda q: q.commit_diff(TOP), "got one TopBlock: pass it in a list"),
    ("commit parts", lambda q: q.commit_diff([TOP], 0), "partitions must be a list of int"),
    (
        "clear one shard",
        lambda q: q.clear_uncommitted_state(top_shards=ShardIdent.MASTERCHAIN),
        "top_shards must be a list of ShardIdent values, got one ShardIdent",
    ),
    ("clear parts", lambda q: q.clear_uncommitted_state(None), "partitions must be a list"),
    ("startup None", lambda q: q.startup(MC_BLOCK, None), "top_shards must be a list"),
    (
        "startup one",
        lambda q: q.startup(MC_BLOCK, ShardIdent.BASECHAIN),
        "got one ShardIdent",
    ),
    (
        "iterator None",
        lambda q: q.iterator(0, None, ShardIdent.BASECHAIN),
        "ranges must be a list of QueueShardRange values, got NoneType",
    ),
    (
        "iterator one",
        lambda q: q.iterator(0, RANGE, ShardIdent.BASECHAIN),
        "got one QueueShardRange",
    ),
    (
        "separated stats",
        lambda q: q.load_separated_diff_statistics(5, RANGE),
        "partitions must be a list of int values, got one int: pass it in a list",
    ),
]


@pytest.mark.parametrize(("call", "says"), [c[1:] for c in CALLS], ids=[c[0] for c in CALLS])
def test_a_wrong_list_argument_is_named(
    tmp_path: Path, call: Callable[[Queue], Any], says: str
) -> None:
    with Queue.open(tmp_path / "q", QueueConfig.testing()) as queue:
        with pytest.raises(TypeError, match=says):
            call(queue)
        assert queue.get_commit_pointers() == {}  # nothing happened


@pytest.mark.parametrize("path", [None, 123, b"dir"])
def test_a_path_of_the_wrong_type_is_named(tmp_path: Path, path: object) -> None:
    with pytest.raises(TypeError, match=r"path must be a str or os\.PathLike"):
        Queue.open(path)  # type: ignore[arg-type]


def test_queue_diff_names_its_messages() -> None:
    with pytest.raises(TypeError, match=r"QueueDiff\.messages must be a list of Message"):
        QueueDiff(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got one Message: pass it in a list"):
        QueueDiff(MESSAGE)  # type: ignore[arg-type]
    assert QueueDiff(iter([MESSAGE])).messages == (MESSAGE,)  # any iterable still works
