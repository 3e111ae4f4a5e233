"""Value types: queue keys, shards, addresses, block ids, messages, ranges, zones.

Speed note: the five types the iterator and the write path build per message
(``QueueKey``, ``ShardIdent``, ``Address``, ``Message``, ``IteratedMessage``) are
tuple subclasses rather than frozen dataclasses. Building one costs ~150 ns against
~350 ns for a dataclass (``benchmarks/README.md``), and the iterator builds four per
message. They still validate in ``__new__``; the storage layer, which reads only
bytes it wrote itself, uses the module's ``_trusted_*`` constructors to skip that.
Equality, hashing and ordering are the tuple's, implemented in C: a Python-level
``__eq__`` that also compared types made every dict hit 4x slower (491 vs 115 ns),
and statistics are counted in dicts keyed by ``Address``. The price is that a value
equals a plain tuple of the same fields; imq never mixes the two in one container.
The tuple order is the logical order of each type.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, TypeVar

from imq._native import speedups

__all__ = [
    "DEFAULT_PARTITION",
    "LOW_PRIORITY_PARTITION",
    "MAX_PARTITION",
    "Address",
    "BlockId",
    "BlockIdShort",
    "CommitPointer",
    "DiffInfo",
    "DiffZone",
    "IteratedMessage",
    "Message",
    "QueueKey",
    "QueueShardRange",
    "ShardIdent",
    "TopBlock",
    "check_partition",
    "check_partitions",
    "listed",
    "check_u32",
]

DEFAULT_PARTITION = 0
LOW_PRIORITY_PARTITION = 1
MAX_PARTITION = 0xFFFF

U32_MAX = 0xFFFF_FFFF
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
FULL_PREFIX = 0x8000_0000_0000_0000
_V = TypeVar("_V", bound=tuple[object, ...])
_T = TypeVar("_T")
_KEY_BYTES = 40  # QueueKey.to_bytes: lt (8) + hash (32)
_ZERO32 = bytes(32)
_FF32 = b"\xff" * 32
# tuple.__new__, or its compiled twin that leaves the value out of the cyclic GC (a value
# type holds ints, bytes and other values only: it can never be in a reference cycle, and
# a host keeps many of them, which every collection would otherwise walk).
_tuple_new: Callable[[type[_V], tuple[object, ...]], _V] = (
    tuple.__new__ if speedups is None else speedups.value_new
)
_INT = re.compile(r"-?[0-9]+")
_UINT = re.compile(r"[0-9]+")
_HEX16 = re.compile(r"[0-9a-fA-F]{16}")
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in {lo}..={hi}, got {value}")
    return value


def check_mapping(name: str, value: object) -> None:
    """A ``TypeError`` naming ``name`` unless ``value`` is a mapping (a dict)."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping (a dict), got {type(value).__name__}")


def _check_text(what: str, text: object) -> None:
    if not isinstance(text, str):
        raise TypeError(f"{what}.parse takes a str, got {type(text).__name__}")


def _check_bytes32(name: str, value: object) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")
    if len(value) != 32:
        raise ValueError(f"{name} must be exactly 32 bytes, got {len(value)}")
    return value


def check_u32(name: str, value: object) -> int:
    """Validate a plain int in 0..=2^32-1 (``TypeError``, bool too; else ``ValueError``)."""
    return _check_int(name, value, 0, U32_MAX)


def check_partition(partition: object) -> int:
    """Validate a partition index (a plain int in 0..=65535) and return it."""
    return _check_int("partition", partition, 0, MAX_PARTITION)


def listed(name: str, value: Iterable[_T], item: type[_T]) -> list[_T]:
    """The items of the argument ``name`` as a list; a ``TypeError`` naming the argument
    when it is no iterable, or is one ``item`` where a list of them belongs (a
    ``ShardIdent`` is a tuple: iterated, it would read as a list of ints). The items'
    own checks are the caller's."""
    if isinstance(value, item):
        raise TypeError(
            f"{name} must be a list of {item.__name__} values, got one {item.__name__}: "
            "pass it in a list"
        )
    try:
        items = iter(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a list of {item.__name__} values, got {type(value).__name__}"
        ) from None
    return list(items)


def check_partitions(partitions: Iterable[int]) -> frozenset[int]:
    """Validate a ``partitions`` argument (a list of partition indexes; ``TypeError``
    naming it otherwise) and return its distinct partitions."""
    return frozenset(check_partition(p) for p in listed("partitions", partitions, int))


def _validated_make(cls: Callable[..., _V], iterable: Iterable[object]) -> _V:
    """``_make`` of the tuple value types (and so ``_replace``, which calls it): through
    the class's own constructor and its checks. namedtuple's builds the tuple unchecked,
    which would let ``key._replace(lt=-1)`` make a value no constructor accepts."""
    return cls(*iterable)


# ---------------------------------------------------------------------------------------------
# QueueKey


def _key_from_bytes(cls: type[QueueKey], data: bytes) -> QueueKey:
    """``QueueKey.from_bytes`` in Python."""
    if not isinstance(data, bytes):
        raise TypeError(f"QueueKey.from_bytes takes bytes, got {type(data).__name__}")
    if len(data) != _KEY_BYTES:
        raise ValueError(
            f"QueueKey.from_bytes takes {_KEY_BYTES} bytes (lt, 8 big-endian, then the "
            f"32-byte hash), got {len(data)}"
        )
    return cls(int.from_bytes(data[:8], "big"), data[8:])


class _QueueKeyFields(NamedTuple):
    lt: int
    hash: bytes


class QueueKey(_QueueKeyFields):
    """A message's position in the queue: ``(lt, hash)``, ordered lexicographically."""

    __slots__ = ()
    _make = classmethod(_validated_make)  # type: ignore[assignment,var-annotated]
    MIN: ClassVar[QueueKey]
    MAX: ClassVar[QueueKey]

    def __new__(cls, lt: int, hash: bytes) -> QueueKey:
        # The common case checked inline (two calls fewer: a third of the constructor's
        # time); anything else goes through the checks that name what is wrong.
        if not (type(lt) is int and type(hash) is bytes and 0 <= lt <= U64_MAX and len(hash) == 32):
            _check_int("QueueKey.lt", lt, 0, U64_MAX)
            _check_bytes32("QueueKey.hash", hash)
        return _tuple_new(cls, (lt, hash))

    @classmethod
    def min_for_lt(cls, lt: int) -> QueueKey:
        return cls(lt, _ZERO32)

    @classmethod
    def max_for_lt(cls, lt: int) -> QueueKey:
        return cls(lt, _FF32)

    def next_value(self) -> QueueKey:
        """The smallest key strictly greater than this one (saturates at ``MAX``)."""
        lt, h = self
        if h == _FF32:
            if lt == U64_MAX:
                return self
            return _tuple_new(QueueKey, (lt + 1, _ZERO32))
        bumped = (int.from_bytes(h, "big") + 1).to_bytes(32, "big")
        return _tuple_new(QueueKey, (lt, bumped))

    def to_bytes(self) -> bytes:
        """The key's 40-byte form: ``lt`` as 8 bytes big-endian, then ``hash``. Byte order
        of these forms is key order, so they can serve as keys of any byte-ordered store;
        :meth:`from_bytes` reads them back."""
        return self[0].to_bytes(8, "big") + self[1]

    # The key whose to_bytes() is ``data`` (40 bytes): one call instead of slicing and
    # int.from_bytes. ``_from_bytes`` is the Python path (its checks and errors); the
    # compiled from_bytes builds the common case without a Python frame (about 50 ns less a
    # key) and calls ``cls._from_bytes`` for anything else.
    _from_bytes: classmethod[QueueKey, [bytes], QueueKey] = classmethod(_key_from_bytes)
    from_bytes: classmethod[QueueKey, [bytes], QueueKey] = classmethod(
        _key_from_bytes if speedups is None else speedups.key_from_bytes
    )

    def __repr__(self) -> str:
        return f"QueueKey(lt={self.lt}, hash={self.hash.hex()})"

    def __str__(self) -> str:
        """Lossless: ``<lt in decimal>:<hash in 64 hex digits>``; :meth:`parse` reads it."""
        return f"{self.lt}:{self.hash.hex()}"

    @classmethod
    def parse(cls, text: str) -> QueueKey:
        """Read ``<lt>:<64 hex digits>`` (what ``str(key)`` and the CLI print)."""
        _check_text("QueueKey", text)
        lt, sep, hexpart = text.partition(":")
        if not sep or not _HEX64.fullmatch(hexpart) or not _UINT.fullmatch(lt):
            raise ValueError(f"invalid queue key {text!r}: expected '<lt>:<64 hex digits>'")
        try:
            return cls(int(lt), bytes.fromhex(hexpart))
        except ValueError as exc:
            raise ValueError(f"invalid queue key {text!r}: {exc}") from None

    def to_json(self) -> dict[str, int | str]:
        """``{"lt": <int>, "hash": <64 hex digits>}``: the JSON form the CLI prints."""
        return {"lt": self.lt, "hash": self.hash.hex()}

    @classmethod
    def from_json(cls, obj: object) -> QueueKey:
        """Read :meth:`to_json`'s form back."""
        if not isinstance(obj, dict) or set(obj) != {"lt", "hash"}:
            raise ValueError(f"invalid queue key {obj!r}: expected {{'lt': int, 'hash': hex}}")
        lt, hexpart = obj["lt"], obj["hash"]
        if not isinstance(hexpart, str) or not _HEX64.fullmatch(hexpart):
            raise ValueError(f"invalid queue key {obj!r}: 'hash' must be 64 hex digits")
        return cls(lt, bytes.fromhex(hexpart))


QueueKey.MIN = _tuple_new(QueueKey, (0, _ZERO32))
QueueKey.MAX = _tuple_new(QueueKey, (U64_MAX, _FF32))


def _trusted_queue_key(lt: int, hash: bytes) -> QueueKey:
    return _tuple_new(QueueKey, (lt, hash))


# ---------------------------------------------------------------------------------------------
# Address


class _AddressFields(NamedTuple):
    workchain: int
    account: bytes


class Address(_AddressFields):
    """A std internal address: ``workchain`` (i8) and a 32-byte ``account``."""

    __slots__ = ()
    _make = classmethod(_validated_make)  # type: ignore[assignment,var-annotated]

    def __new__(cls, workchain: int, account: bytes) -> Address:
        if not (
            type(workchain) is int
            and type(account) is bytes
            and -128 <= workchain <= 127
            and len(account) == 32
        ):
            _check_int("Address.workchain", workchain, -128, 127)
            _check_bytes32("Address.account", account)
        return _tuple_new(cls, (workchain, account))

    @property
    def prefix(self) -> int:
        """The first 8 account bytes as a big-endian integer."""
        return int.from_bytes(self.account[:8], "big")

    @classmethod
    def parse(cls, text: str) -> Address:
        _check_text("Address", text)
        wc, sep, hexpart = text.partition(":")
        if not sep or not _HEX64.fullmatch(hexpart) or not _INT.fullmatch(wc):
            raise ValueError(f"invalid address {text!r}: expected '<workchain>:<64 hex digits>'")
        try:
            return cls(int(wc), bytes.fromhex(hexpart))
        except ValueError as exc:
            raise ValueError(f"invalid address {text!r}: {exc}") from None

    def __str__(self) -> str:
        return f"{self.workchain}:{self.account.hex()}"

    def __repr__(self) -> str:
        return f"Address({self})"


def _trusted_address(workchain: int, account: bytes) -> Address:
    return _tuple_new(Address, (workchain, account))


# ---------------------------------------------------------------------------------------------
# ShardIdent


class _ShardFields(NamedTuple):
    workchain: int
    prefix: int


class ShardIdent(_ShardFields):
    """A shard: ``workchain`` (i32) and ``prefix`` (u64 with its tag bit)."""

    __slots__ = ()
    _make = classmethod(_validated_make)  # type: ignore[assignment,var-annotated]
    MASTERCHAIN: ClassVar[ShardIdent]
    BASECHAIN: ClassVar[ShardIdent]

    def __new__(cls, workchain: int, prefix: int) -> ShardIdent:
        _check_int("ShardIdent.workchain", workchain, -(2**31), 2**31 - 1)
        _check_int("ShardIdent.prefix", prefix, 0, U64_MAX)
        if prefix == 0 or prefix & 0b111:
            raise ValueError(
                f"invalid shard prefix {prefix:016x}: must be non-zero with the low 3 bits clear"
            )
        if workchain == -1 and prefix != FULL_PREFIX:
            raise ValueError(f"the masterchain cannot be split (prefix {prefix:016x})")
        return _tuple_new(cls, (workchain, prefix))

    @classmethod
    def full(cls, workchain: int) -> ShardIdent:
        return cls(workchain, FULL_PREFIX)

    @property
    def is_masterchain(self) -> bool:
        return self.workchain == -1

    @property
    def is_full(self) -> bool:
        return self.prefix == FULL_PREFIX

    @property
    def prefix_len(self) -> int:
        """Number of significant prefix bits (0 for a full shard)."""
        p = self.prefix
        return 63 - ((p & -p).bit_length() - 1)

    def contains(self, address: Address) -> bool:
        """True if ``address`` belongs to this shard."""
        if type(address) is not Address:
            raise TypeError(f"contains takes an Address, got {type(address).__name__}")
        if address.workchain != self.workchain:
            return False
        return self.contains_prefix(address.prefix)

    def contains_prefix(self, account_prefix: int) -> bool:
        """True if an account whose first 8 bytes are ``account_prefix`` is in this shard
        (the workchain is not checked)."""
        bits = self.prefix_len
        if bits == 0:
            return True
        shift = 64 - bits
        return (account_prefix >> shift) == (self.prefix >> shift)

    @classmethod
    def parse(cls, text: str) -> ShardIdent:
        _check_text("ShardIdent", text)
        wc, sep, hexpart = text.partition(":")
        if not sep or not _HEX16.fullmatch(hexpart) or not _INT.fullmatch(wc):
            raise ValueError(f"invalid shard {text!r}: expected '<workchain>:<16 hex digits>'")
        try:
            return cls(int(wc), int(hexpart, 16))
        except ValueError as exc:
            raise ValueError(f"invalid shard {text!r}: {exc}") from None

    def __str__(self) -> str:
        return f"{self.workchain}:{self.prefix:016x}"

    def __repr__(self) -> str:
        return f"ShardIdent({self})"


ShardIdent.MASTERCHAIN = _tuple_new(ShardIdent, (-1, FULL_PREFIX))
ShardIdent.BASECHAIN = _tuple_new(ShardIdent, (0, FULL_PREFIX))


def _trusted_shard(workchain: int, prefix: int) -> ShardIdent:
    return _tuple_new(ShardIdent, (workchain, prefix))


# ---------------------------------------------------------------------------------------------
# Messages


class _MessageFields(NamedTuple):
    key: QueueKey
    src: Address
    dst: Address
    body: bytes


class Message(_MessageFields):
    """An internal message. ``body`` is opaque to the engine."""

    __slots__ = ()
    _make = classmethod(_validated_make)  # type: ignore[assignment,var-annotated]

    def __new__(cls, key: QueueKey, src: Address, dst: Address, body: bytes = b"") -> Message:
        if type(key) is not QueueKey:
            raise TypeError(f"Message.key must be a QueueKey, got {type(key).__name__}")
        if type(src) is not Address or type(dst) is not Address:
            raise TypeError("Message.src and Message.dst must be Address values")
        if not isinstance(body, bytes):
            raise TypeError(f"Message.body must be bytes, got {type(body).__name__}")
        return _tuple_new(cls, (key, src, dst, body))

    def __repr__(self) -> str:
        return f"Message(key={self.key!r}, src={self.src}, dst={self.dst}, body={len(self.body)}B)"


class _IteratedFields(NamedTuple):
    source: ShardIdent
    message: Message


class IteratedMessage(_IteratedFields):
    """What the iterator yields: the source shard and the message."""

    __slots__ = ()
    _make = classmethod(_validated_make)  # type: ignore[assignment,var-annotated]

    def __new__(cls, source: ShardIdent, message: Message) -> IteratedMessage:
        # The iterator builds its values without this (in C, or by tuple.__new__).
        if type(source) is not ShardIdent:
            raise TypeError(
                f"IteratedMessage.source must be a ShardIdent, got {type(source).__name__}"
            )
        if type(message) is not Message:
            raise TypeError(
                f"IteratedMessage.message must be a Message, got {type(message).__name__}"
            )
        return _tuple_new(cls, (source, message))


# ---------------------------------------------------------------------------------------------
# Blocks


@dataclass(frozen=True, slots=True, order=True)
class BlockIdShort:
    shard: ShardIdent
    seqno: int

    def __post_init__(self) -> None:
        if type(self.shard) is not ShardIdent:
            raise TypeError("BlockIdShort.shard must be a ShardIdent")
        _check_int("seqno", self.seqno, 0, U32_MAX)

    def __str__(self) -> str:
        return f"{self.shard}:{self.seqno}"

    @classmethod
    def parse(cls, text: str) -> BlockIdShort:
        """Read ``wc:prefixhex:seqno`` (what ``str(block)`` prints)."""
        _check_text("BlockIdShort", text)
        shard, seqno = _parse_short(text, "block id")
        return cls(shard, seqno)


def _parse_short(text: str, what: str) -> tuple[ShardIdent, int]:
    wc, _, rest = text.partition(":")
    prefix, sep, seqno = rest.partition(":")
    if not (
        sep
        and _INT.fullmatch(wc)
        and _HEX16.fullmatch(prefix)
        and _UINT.fullmatch(seqno)
        and seqno.isascii()
    ):
        raise ValueError(f"invalid {what} {text!r}: expected wc:prefix16:seqno")
    try:
        shard = ShardIdent(int(wc), int(prefix, 16))
        _check_int("seqno", int(seqno), 0, U32_MAX)
    except ValueError as exc:
        raise ValueError(f"invalid {what} {text!r}: {exc}") from None
    return shard, int(seqno)


@dataclass(frozen=True, slots=True, order=True)
class BlockId:
    shard: ShardIdent
    seqno: int
    root_hash: bytes = _ZERO32
    file_hash: bytes = _ZERO32

    def __post_init__(self) -> None:
        if type(self.shard) is not ShardIdent:
            raise TypeError("BlockId.shard must be a ShardIdent")
        _check_int("seqno", self.seqno, 0, U32_MAX)
        _check_bytes32("BlockId.root_hash", self.root_hash)
        _check_bytes32("BlockId.file_hash", self.file_hash)

    @property
    def short(self) -> BlockIdShort:
        return BlockIdShort(self.shard, self.seqno)

    @property
    def is_masterchain(self) -> bool:
        return self.shard.is_masterchain

    def __str__(self) -> str:
        return f"{self.shard}:{self.seqno}:{self.root_hash.hex()}:{self.file_hash.hex()}"

    @classmethod
    def parse(cls, text: str) -> BlockId:
        """Read ``wc:prefixhex:seqno:roothex:filehex`` (what ``str(block_id)`` prints), or
        ``wc:prefixhex:seqno`` without hashes (both hashes are then zero, as when a
        ``BlockId`` is built without them)."""
        _check_text("BlockId", text)
        parts = text.split(":")
        if len(parts) == 3:
            shard, seqno_ = _parse_short(text, "block id")
            return cls(shard, seqno_)
        if len(parts) != 5:
            raise ValueError(f"invalid block id {text!r}: expected wc:prefix:seqno[:root:file]")
        wc, prefix, seqno, root, file = parts
        if not (
            _INT.fullmatch(wc)
            and _HEX16.fullmatch(prefix)
            and seqno.isdigit()
            and seqno.isascii()
            and _HEX64.fullmatch(root)
            and _HEX64.fullmatch(file)
        ):
            raise ValueError(f"invalid block id {text!r}: expected wc:prefix16:seqno:root64:file64")
        try:
            shard = ShardIdent(int(wc), int(prefix, 16))
            return cls(shard, int(seqno), bytes.fromhex(root), bytes.fromhex(file))
        except ValueError as exc:
            raise ValueError(f"invalid block id {text!r}: {exc}") from None


@dataclass(frozen=True, slots=True)
class TopBlock:
    """One entry of a masterchain block's top-block list, as passed to ``commit_diff``."""

    block_id: BlockId
    ref_by_mc_seqno: int
    updated: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_id, BlockId):
            raise TypeError("TopBlock.block_id must be a BlockId")
        _check_int("ref_by_mc_seqno", self.ref_by_mc_seqno, 0, U32_MAX)
        if not isinstance(self.updated, bool):
            raise TypeError("TopBlock.updated must be a bool")


# ---------------------------------------------------------------------------------------------
# Pointers, zones, ranges, diff info


@dataclass(frozen=True, slots=True, order=True)
class CommitPointer:
    """Where a shard's committed zone ends: its last committed diff's max message and seqno."""

    key: QueueKey
    seqno: int

    def __post_init__(self) -> None:
        if type(self.key) is not QueueKey:
            raise TypeError("CommitPointer.key must be a QueueKey")
        _check_int("seqno", self.seqno, 0, U32_MAX)


class DiffZone(enum.Enum):
    COMMITTED = "committed"
    UNCOMMITTED = "uncommitted"
    BOTH = "both"


@dataclass(frozen=True, slots=True)
class QueueShardRange:
    """Half-open ``[from_key, to_key)`` over the keys of one source shard."""

    shard: ShardIdent
    from_key: QueueKey
    to_key: QueueKey

    def __post_init__(self) -> None:
        if type(self.shard) is not ShardIdent:
            raise TypeError("QueueShardRange.shard must be a ShardIdent")
        if type(self.from_key) is not QueueKey or type(self.to_key) is not QueueKey:
            raise TypeError("QueueShardRange bounds must be QueueKey values")


@dataclass(frozen=True, slots=True)
class DiffInfo:
    """What is stored per applied diff. Compare structurally."""

    min_message: QueueKey
    max_message: QueueKey
    shards_messages_count: dict[ShardIdent, int]
    hash: bytes
    processed_to: dict[ShardIdent, QueueKey]
    router_src: dict[int, frozenset[Address]]
    router_dst: dict[int, frozenset[Address]]
    seqno: int
    prev_hash: bytes | None = field(default=None)

    def __post_init__(self) -> None:
        for name in ("min_message", "max_message"):
            if type(getattr(self, name)) is not QueueKey:
                raise TypeError(f"DiffInfo.{name} must be a QueueKey")
        if self.max_message < self.min_message:
            raise ValueError("DiffInfo.max_message is below min_message")
        _check_bytes32("DiffInfo.hash", self.hash)
        if self.prev_hash is not None:
            _check_bytes32("DiffInfo.prev_hash", self.prev_hash)
        _check_int("DiffInfo.seqno", self.seqno, 0, U32_MAX)
        for name in ("shards_messages_count", "processed_to", "router_src", "router_dst"):
            check_mapping(f"DiffInfo.{name}", getattr(self, name))
        for shard, count in self.shards_messages_count.items():
            if type(shard) is not ShardIdent:
                raise TypeError("DiffInfo.shards_messages_count must be keyed by ShardIdent")
            _check_int(f"message count for {shard}", count, 0, U64_MAX)
        for shard, key in self.processed_to.items():
            if type(shard) is not ShardIdent or type(key) is not QueueKey:
                raise TypeError("DiffInfo.processed_to must map ShardIdent to QueueKey")
        for router in (self.router_src, self.router_dst):
            for partition, addresses in router.items():
                check_partition(partition)
                if not isinstance(addresses, frozenset) or any(
                    type(a) is not Address for a in addresses
                ):
                    raise TypeError("DiffInfo routers must map partitions to frozensets of Address")

    def __hash__(self) -> int:
        # The dataclass hash would hash the dict fields and fail: hash the scalar fields
        # (equal infos still hash equal, and mutating a handed-out dict moves nothing).
        return hash((self.min_message, self.max_message, self.hash, self.seqno, self.prev_hash))

    @property
    def partitions(self) -> frozenset[int]:
        """Every partition this diff's router names, plus the default one."""
        return frozenset((DEFAULT_PARTITION, *self.router_src, *self.router_dst))


if speedups is not None:
    # The value types' compiled constructors (QueueKey(lt, hash), QueueKey.from_bytes,
    # Message(...) of the common types) and deallocs, from the first import of this
    # module: a host that builds diffs before it loads the queue (or never does) gets them
    # too. Measured: QueueKey.from_bytes 108 against 627-656 ns, QueueKey(lt, hash) 68-86
    # against 219-234 ns. Every other call still runs (and is checked by) the Python __new__.
    speedups.init(IteratedMessage, Message, QueueKey, Address)
    speedups.set_constructors()
