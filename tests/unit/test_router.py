"""PartitionRouter: lookup order, validation, grouping, copies."""

from __future__ import annotations

import pytest

from imq.diff import QueueDiff
from imq.router import PartitionRouter
from imq.types import Address, Message, QueueKey


def addr(n: int, workchain: int = 0) -> Address:
    return Address(workchain, bytes((n,)) * 32)


A, B, C, D = addr(1), addr(2), addr(3), addr(4)


def test_empty_router_routes_everything_to_zero() -> None:
    router = PartitionRouter()
    assert router.is_empty
    assert router.partition_for(A, B) == 0
    assert router.partition_for(None, B) == 0
    assert router.src_partitions() == {}
    assert router.dst_partitions() == {}
    assert router.partitions() == frozenset({0})


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        (A, B, 2),  # dst map wins over src map
        (C, B, 2),  # dst map only
        (A, C, 1),  # src map only
        (None, B, 2),  # no source: dst map still consulted
        (None, C, 0),  # no source, dst not routed
        (None, A, 0),  # A is only in the src map: not consulted as a destination
        (B, A, 0),  # B is only in the dst map: not consulted as a source
        (C, D, 0),  # neither
        (addr(1, -1), C, 0),  # same account in another workchain is another address
    ],
)
def test_lookup_order_dst_src_default(src: Address | None, dst: Address, expected: int) -> None:
    router = PartitionRouter(src={1: [A]}, dst={2: [B]})
    assert router.partition_for(src, dst) == expected


@pytest.mark.parametrize(
    ("src", "dst"),
    [(None, "0:" + "02" * 32), (A, None), ("0:" + "01" * 32, C), (7, C), ("x", B), (7, B)],
)
def test_partition_for_rejects_what_is_not_an_address(src: object, dst: object) -> None:
    """API.md: values of the wrong type raise TypeError (not a silent partition 0), a
    wrong source also when the destination is routed (``B``)."""
    router = PartitionRouter(src={1: [A]}, dst={2: [B]})
    with pytest.raises(TypeError, match="Address"):
        router.partition_for(src, dst)  # type: ignore[arg-type]


def test_insert_overwrites() -> None:
    router = PartitionRouter()
    router.insert_dst(A, 3)
    router.insert_dst(A, 5)
    router.insert_src(A, 7)
    assert router.partition_for(None, A) == 5
    assert router.partition_for(A, B) == 7
    assert router.dst_partitions() == {5: frozenset({A})}
    assert router.src_partitions() == {7: frozenset({A})}
    assert not router.is_empty
    assert router.partitions() == frozenset({0, 5, 7})


@pytest.mark.parametrize("method", ["insert_src", "insert_dst"])
@pytest.mark.parametrize(
    ("partition", "error"),
    [
        (0, ValueError),
        (-1, ValueError),
        (65536, ValueError),
        (2**32, ValueError),
        (True, TypeError),
        ("1", TypeError),
        (1.0, TypeError),
        (None, TypeError),
    ],
)
def test_insert_rejects_partition(method: str, partition: object, error: type[Exception]) -> None:
    router = PartitionRouter()
    with pytest.raises(error):
        getattr(router, method)(A, partition)
    assert router.is_empty


@pytest.mark.parametrize("method", ["insert_src", "insert_dst"])
def test_insert_accepts_partition_bounds(method: str) -> None:
    router = PartitionRouter()
    getattr(router, method)(A, 1)
    getattr(router, method)(B, 65535)
    assert router.partitions() == frozenset({0, 1, 65535})


@pytest.mark.parametrize("method", ["insert_src", "insert_dst"])
@pytest.mark.parametrize("address", [(0, bytes(32)), "0:" + "00" * 32, None, b"\x00" * 33])
def test_insert_rejects_non_address(method: str, address: object) -> None:
    router = PartitionRouter()
    with pytest.raises(TypeError):
        getattr(router, method)(address, 1)
    assert router.is_empty


@pytest.mark.parametrize("half", ["src", "dst"])
def test_constructor_validates(half: str) -> None:
    with pytest.raises(ValueError):
        PartitionRouter(**{half: {0: [A]}})
    with pytest.raises(ValueError):
        PartitionRouter(**{half: {65536: [A]}})
    with pytest.raises(TypeError):
        PartitionRouter(**{half: {1: [(0, bytes(32))]}})  # type: ignore[arg-type]


def test_constructor_highest_partition_wins_within_a_half() -> None:
    router = PartitionRouter(src={9: [A], 2: [A, B], 5: [A]}, dst={4: [C], 3: [C, D]})
    assert router.partition_for(A, D) == 3  # D's own dst entry is 3
    assert router.partition_for(A, B) == 9
    assert router.partition_for(B, A) == 2
    assert router.partition_for(None, C) == 4
    assert router.src_partitions() == {2: frozenset({B}), 9: frozenset({A})}
    assert router.dst_partitions() == {3: frozenset({D}), 4: frozenset({C})}


def test_constructor_same_address_in_both_halves() -> None:
    router = PartitionRouter(src={1: [A]}, dst={2: [A]})
    assert router.partition_for(A, C) == 1
    assert router.partition_for(C, A) == 2
    assert router.partition_for(A, A) == 2


def test_grouping() -> None:
    router = PartitionRouter(src={1: [A, B], 3: [C]}, dst={1: [D], 2: [A, B, C]})
    src = router.src_partitions()
    dst = router.dst_partitions()
    assert src == {1: frozenset({A, B}), 3: frozenset({C})}
    assert dst == {1: frozenset({D}), 2: frozenset({A, B, C})}
    assert list(src) == sorted(src)
    assert all(isinstance(v, frozenset) for v in (*src.values(), *dst.values()))
    assert router.partitions() == frozenset({0, 1, 2, 3})
    # the groups rebuild an equal router
    assert PartitionRouter(src, dst) == router


def test_constructor_accepts_any_iterables() -> None:
    router = PartitionRouter(src={1: (a for a in [A, B])}, dst={2: frozenset({C})})
    assert router.src_partitions() == {1: frozenset({A, B})}
    assert router.dst_partitions() == {2: frozenset({C})}


def test_copy_is_independent() -> None:
    original = PartitionRouter(src={1: [A]}, dst={2: [B]})
    clone = original.copy()
    assert clone == original
    assert clone is not original
    clone.insert_dst(C, 3)
    clone.insert_src(A, 4)
    assert original.partition_for(None, C) == 0
    assert original.partition_for(A, D) == 1
    original.insert_dst(D, 5)
    assert clone.partition_for(None, D) == 0
    assert clone != original


def test_equality_and_unhashable() -> None:
    assert PartitionRouter() == PartitionRouter()
    assert PartitionRouter(src={1: [A]}) != PartitionRouter(dst={1: [A]})
    assert PartitionRouter(src={1: [A]}) != PartitionRouter(src={2: [A]})
    assert PartitionRouter() != object()
    with pytest.raises(TypeError):
        hash(PartitionRouter())


def test_repr_names_the_partitions() -> None:
    text = repr(PartitionRouter(src={4: [A]}))
    assert "PartitionRouter" in text
    assert "4" in text


def test_diff_keeps_its_own_router_copy() -> None:
    router = PartitionRouter(dst={1: [B]})
    message = Message(QueueKey(1, bytes(32)), A, B)
    diff = QueueDiff([message], router=router)
    assert diff.router == router
    assert diff.router is not router
    router.insert_dst(B, 2)
    router.insert_src(A, 3)
    router.insert_dst(C, 4)
    assert diff.router.partition_for(A, B) == 1
    assert diff.router.partition_for(A, C) == 0
    assert diff.router == PartitionRouter(dst={1: [B]})


def test_diff_without_router_gets_an_empty_one() -> None:
    diff = QueueDiff()
    assert diff.router.is_empty
    with pytest.raises(TypeError, match="read-only"):  # so one empty router serves all
        diff.router.insert_dst(A, 1)
    assert QueueDiff().router.is_empty
