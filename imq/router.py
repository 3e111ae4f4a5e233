"""The partition router: which partition a message goes to, by its addresses.

Lookup order (SEMANTICS §12): the destination map, then the source map, then the
default partition 0. Partition 0 is implicit and can never be inserted into.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from imq.types import DEFAULT_PARTITION, Address, check_mapping, check_partition

__all__ = ["PartitionRouter"]


def _check_address(address: object) -> Address:
    if type(address) is not Address:
        raise TypeError(f"router addresses must be Address values, got {type(address).__name__}")
    return address


# The constructor's default: no routes. Read-only, so one object serves every call.
_NO_ROUTES: Mapping[int, Iterable[Address]] = MappingProxyType({})


class PartitionRouter:
    """Maps source and destination accounts to partitions. The one mutable value type."""

    __slots__ = ("_dst", "_src")

    def __init__(
        self,
        src: Mapping[int, Iterable[Address]] | None = _NO_ROUTES,
        dst: Mapping[int, Iterable[Address]] | None = _NO_ROUTES,
    ) -> None:
        self._src: dict[Address, int] = {}
        self._dst: dict[Address, int] = {}
        # Ascending partition order: when an address is listed twice in one half,
        # the highest partition wins, as in the original.
        for name, half, insert in (
            ("src", {} if src is None else src, self.insert_src),
            ("dst", {} if dst is None else dst, self.insert_dst),
        ):
            check_mapping(f"PartitionRouter {name}", half)
            for partition in sorted(half):
                self._check_target(partition)
                for address in half[partition]:
                    insert(address, partition)

    @staticmethod
    def _check_target(partition: int) -> int:
        check_partition(partition)
        if partition == DEFAULT_PARTITION:
            raise ValueError("cannot insert into the default partition 0")
        return partition

    def insert_src(self, address: Address, partition: int) -> None:
        """Route messages *from* ``address`` to ``partition`` (unless the destination is routed)."""
        self._src[_check_address(address)] = self._check_target(partition)

    def insert_dst(self, address: Address, partition: int) -> None:
        """Route messages *to* ``address`` to ``partition``."""
        self._dst[_check_address(address)] = self._check_target(partition)

    def partition_for(self, src: Address | None, dst: Address) -> int:
        if src is not None and type(src) is not Address:
            raise TypeError(f"src must be an Address or None, got {type(src).__name__}")
        if type(dst) is not Address:  # before the lookup: a plain tuple equals an Address
            raise TypeError(f"dst must be an Address, got {type(dst).__name__}")
        partition = self._dst.get(dst)
        if partition is not None:
            return partition
        if src is not None:
            partition = self._src.get(src)
            if partition is not None:
                return partition
        return DEFAULT_PARTITION

    @property
    def is_empty(self) -> bool:
        return not self._src and not self._dst

    def destination_routes(self) -> Mapping[Address, int] | None:
        """When no source is routed, a message's partition depends on its destination
        alone: the destination routes (read-only; absent means partition 0). ``None``
        when some source is routed."""
        return None if self._src else MappingProxyType(self._dst)

    @staticmethod
    def _group(mapping: Mapping[Address, int]) -> dict[int, frozenset[Address]]:
        grouped: dict[int, set[Address]] = {}
        for address, partition in mapping.items():
            grouped.setdefault(partition, set()).add(address)
        return {p: frozenset(grouped[p]) for p in sorted(grouped)}

    def src_partitions(self) -> dict[int, frozenset[Address]]:
        return self._group(self._src)

    def dst_partitions(self) -> dict[int, frozenset[Address]]:
        return self._group(self._dst)

    def partitions(self) -> frozenset[int]:
        """Every partition a message routed by this router can land in (0 included)."""
        return frozenset((DEFAULT_PARTITION, *self._src.values(), *self._dst.values()))

    def copy(self) -> PartitionRouter:
        """A mutable copy (also of a diff's read-only router)."""
        return self._copy_as(PartitionRouter)

    def read_only_copy(self) -> PartitionRouter:
        """A copy whose ``insert_src``/``insert_dst`` raise ``TypeError``: what a
        :class:`~imq.diff.QueueDiff` keeps, so that the diff stays as it was built."""
        return self._copy_as(_ReadOnlyRouter)

    def _copy_as(self, cls: type[PartitionRouter]) -> PartitionRouter:
        clone = cls()
        clone._src = dict(self._src)
        clone._dst = dict(self._dst)
        return clone

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PartitionRouter):
            return NotImplemented
        return self._src == other._src and self._dst == other._dst

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"PartitionRouter(src={self.src_partitions()!r}, dst={self.dst_partitions()!r})"


class _ReadOnlyRouter(PartitionRouter):
    """A diff's router: routes as built. ``copy()`` gives a mutable one."""

    __slots__ = ()

    def insert_src(self, address: Address, partition: int) -> None:
        _refuse_insert()

    def insert_dst(self, address: Address, partition: int) -> None:
        _refuse_insert()


def _refuse_insert() -> None:
    raise TypeError(
        "a QueueDiff's router is read-only (the diff is immutable): take router.copy(), "
        "change the copy and build a new QueueDiff with it"
    )
