"""Native memory a long-lived host would lose: calls a monitor or a collator repeats all
day must not leak C heap (glibc's ``mallinfo2``: bytes in use, the only figure that sees
RocksDB's and rocksdict's allocations)."""

from __future__ import annotations

import ctypes

import pytest

from imq import Queue

_MALLINFO2_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
)


def _native_heap() -> int | None:
    """Bytes of the C heap in use (glibc's ``mallinfo2``), or ``None`` elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]

    mallinfo2.restype = Info
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def test_the_open_check_of_a_directory_leaks_no_native_memory(queue: Queue) -> None:
    """Every open of an existing database reads its list of tables; rocksdict's
    ``list_cf`` without options of its own leaked ~200 bytes of C heap a call, which a
    monitor opening the queue read-only every second would pay all day."""
    if _native_heap() is None:
        pytest.skip("needs glibc's mallinfo2")
    check = queue._store._check_directory  # type: ignore[attr-defined]
    for _ in range(200):  # warm: one-off allocations
        check()
    # Three windows of 3,000 calls: a leak grows the heap in each, while a one-off step
    # (Python's allocator taking one more 1 MiB arena in a suite's fragmented heap: 320
    # bytes "a call" in one window, measured, with no Python object left behind per
    # call under tracemalloc) shows in one only.
    grown = []
    for _ in range(3):
        before = _native_heap()
        for _ in range(3_000):
            check()
        grown.append(_native_heap() - before)  # type: ignore[operator]
    assert min(grown) < 3_000 * 20, [f"{g / 3_000:.0f} bytes a call" for g in grown]
