"""The simulation's ledger catches a duplicate: a queue that delivers one message twice
must be reported as ``duplicated``, naming the message (only a loss was tested before)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from imq import IteratedMessage, Queue, QueueConfig, QueueShardRange, ShardIdent
from imq.sim import SimConfig, Simulation


class _RepeatingQueue:
    """A queue whose iterator yields one message twice: a duplicated delivery."""

    def __init__(self, queue: Queue) -> None:
        self._queue = queue
        self.repeated: IteratedMessage | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)

    def iterator(
        self, partition: int, ranges: Sequence[QueueShardRange], for_shard: ShardIdent
    ) -> Any:
        inner = self._queue.iterator(partition, ranges, for_shard)
        outer = self

        class _It:
            def __iter__(self) -> Iterator[IteratedMessage]:
                for item in inner:
                    yield item
                    if outer.repeated is None and not for_shard.is_masterchain:
                        outer.repeated = item
                        yield item

            def close(self) -> None:
                inner.close()

            def __enter__(self) -> _It:
                return self

            def __exit__(self, *exc: object) -> None:
                inner.close()

        return _It()


def test_a_repeated_message_is_named(tmp_path: Path) -> None:
    """Breaking the ledger's duplicate count let every other test pass (mutation
    testing, stop 30)."""
    wrappers: list[_RepeatingQueue] = []

    def opener(path: Path, config: QueueConfig) -> Any:
        wrapper = _RepeatingQueue(Queue.open(path, config))
        if wrappers and wrappers[0].repeated is not None:
            wrapper.repeated = wrappers[0].repeated  # repeat one message in the whole run
        wrappers.insert(0, wrapper)
        return wrapper

    # no cancelled collations: the block that read the message twice must be committed
    config = SimConfig(directory=tmp_path, rounds=30, restart_rate=0, reset_rate=0, cancel_rate=0)
    result = Simulation(config, opener=opener).run()
    repeated = wrappers[0].repeated
    assert repeated is not None
    assert not result.verified, result.verdict()
    assert result.duplicated >= 1
    dup = [v for v in result.violations if "duplicated" in str(v)]
    assert dup and repeated.message.key.hash.hex() in str(dup[0])
