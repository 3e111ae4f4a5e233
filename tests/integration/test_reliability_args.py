"""Wrong arguments found by the reliability campaign: each gets a typed error and leaves
the database unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import BASE, block_id, dump, open_queue

from imq import ImqError, Queue, QueueConfig
from imq.errors import ConfigError


@pytest.mark.parametrize("source", [None, 12345, 1.5, object()])
def test_import_state_refuses_a_source_that_is_neither_a_path_nor_a_file(
    queue: Queue, source: object
) -> None:
    before = dump(queue)
    with pytest.raises(TypeError, match="source must be a path or a binary file object"):
        queue.import_state(source, block_id(BASE, 10))  # type: ignore[arg-type]
    assert dump(queue) == before


@pytest.mark.parametrize("field", ["block_cache_size", "write_buffer_size", "max_background_jobs"])
def test_sizes_rocksdb_cannot_take_are_refused_at_construction(field: str) -> None:
    with pytest.raises((ValueError, ConfigError), match=field):
        QueueConfig(**{field: 2**70})


def test_opening_a_regular_file_is_a_typed_error(tmp_path: Path) -> None:
    file = tmp_path / "not-a-dir"
    file.write_bytes(b"hello")
    with pytest.raises(ImqError, match="not a directory"):
        Queue.open(file)
    assert file.read_bytes() == b"hello"


def test_a_damaged_lock_free_directory_reopens_after_a_failed_open(tmp_path: Path) -> None:
    """A failed open (here: a file where the directory should be) holds nothing."""
    file = tmp_path / "x"
    file.write_bytes(b"")
    with pytest.raises(ImqError):
        Queue.open(file)
    file.unlink()
    open_queue(file).close()
