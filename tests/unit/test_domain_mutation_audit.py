"""Tests from a mutation audit of the value types, diffs and router (``imq/types.py``,
``imq/diff.py``, ``imq/router.py``): each pins a rule of ``docs/api.md``,
``docs/behaviour.md`` section 2 or ``docs/formats.md`` that a small change to that code
broke without any other test failing, or reproduces a bug the audit found (each fixed;
its test fails on the code before the fix).

The audit made 176 mutants (bounds of lts, seqnos, partitions and workchains, dropped
type and range checks, swapped fields, sorting and dedupe removed, equality and hashing
changed, error types changed); 132 were killed by the existing tests (two of them, in
the pure-Python twin of a compiled path, only with ``IMQ_PURE_PYTHON=1``), 19 are
equivalent and 25 changed documented behaviour with no test failing: the tests below
kill each of them. Three bugs were found (stop 49): a diff's read-only router could be changed
through ``destination_routes()``, a falsy non-mapping (``[]``, ``0``, ``""``)
was taken for "no entries" where a mapping belongs, and ``partition_for`` took a plain
tuple as a routed destination.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import MappingProxyType

import pytest

from imq import QueueConfig
from imq.diff import DiffStatistics, QueueDiff
from imq.queue import Queue
from imq.router import PartitionRouter
from imq.testing import MemoryDatabase
from imq.types import (
    U64_MAX,
    Address,
    BlockId,
    DiffInfo,
    IteratedMessage,
    Message,
    QueueKey,
    ShardIdent,
    check_partitions,
)

S1 = ShardIdent(0, 0x4000_0000_0000_0000)
SRC = Address(0, bytes([0x20]) + bytes(31))
DST = Address(0, bytes([0x10]) + bytes(31))
OTHER = Address(0, bytes([0x30]) + bytes(31))


def key(lt: int) -> QueueKey:
    return QueueKey(lt, lt.to_bytes(32, "big"))


def msg(lt: int, src: Address = SRC, dst: Address = DST) -> Message:
    return Message(key(lt), src, dst, b"m%d" % lt)


@pytest.fixture
def queue() -> Iterator[Queue]:
    with MemoryDatabase().open(QueueConfig.testing()) as q:
        yield q


# --- arguments: mappings, lists, partitions ------------------------------------------------


def test_any_mapping_is_accepted_where_a_mapping_is_declared() -> None:
    """docs/api.md: ``processed_to``, the router halves and the statistics' partitions are
    mappings; a read-only mapping (not a dict) is one and must be accepted."""
    processed = MappingProxyType({S1: key(5)})
    diff = QueueDiff([msg(10)], processed)
    assert diff.processed_to == {S1: key(5)}
    router = PartitionRouter(dst=MappingProxyType({7: [DST]}))
    assert router.partition_for(SRC, DST) == 7
    stats = DiffStatistics(S1, key(1), key(2), MappingProxyType({0: MappingProxyType({DST: 3})}))
    assert stats.total == 3


def test_one_value_where_a_list_belongs_says_to_pass_a_list(queue: Queue) -> None:
    """docs/api.md: error messages say what to do next. A ``Message`` or a ``ShardIdent``
    is a tuple: passed alone where a list belongs, the error says to pass it in a list
    rather than complaining about its fields."""
    with pytest.raises(TypeError, match="pass it in a list"):
        QueueDiff(msg(10))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pass it in a list"):
        queue.clear_uncommitted_state(top_shards=S1)  # type: ignore[arg-type]


def test_a_partitions_argument_that_is_no_list_is_a_type_error(queue: Queue) -> None:
    """docs/api.md: values of the wrong type raise ``TypeError``: something that is not
    iterable where a list belongs (partitions, messages)."""
    with pytest.raises(TypeError, match="partitions must be a list"):
        check_partitions(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="partitions must be a list"):
        queue.clear_uncommitted_state(partitions=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="messages must be a list"):
        QueueDiff(5)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 65536])
def test_each_listed_partition_is_checked(queue: Queue, bad: int) -> None:
    """docs/api.md: partitions are plain ints in ``0..=65535``; one outside is a
    ``ValueError`` however the list is passed."""
    with pytest.raises(ValueError, match="partition"):
        check_partitions([0, bad])
    with pytest.raises(ValueError, match="partition"):
        queue.clear_uncommitted_state(partitions=[0, bad])


def test_replace_and_make_go_through_the_checks() -> None:
    """docs/api.md: namedtuple's ``_replace`` and ``_make`` go through the constructor's
    checks: no value a constructor refuses can be made."""
    with pytest.raises(ValueError):
        key(1)._replace(lt=-1)
    with pytest.raises(ValueError):
        QueueKey._make([1, b"short"])
    with pytest.raises(ValueError):
        S1._replace(prefix=0)
    with pytest.raises(TypeError):
        msg(1)._replace(src="x")


# --- text and JSON forms, value types -------------------------------------------------------


def test_key_json_form_takes_exactly_lt_and_hash() -> None:
    """docs/api.md / ``QueueKey.from_json``: reads back exactly ``to_json``'s form
    ``{"lt": <int>, "hash": <64 hex digits>}``; an extra field is a ``ValueError``."""
    good = key(7).to_json()
    assert QueueKey.from_json(good) == key(7)
    with pytest.raises(ValueError, match="invalid queue key"):
        QueueKey.from_json({**good, "extra": 1})


@pytest.mark.parametrize(
    "bad_hash",
    [" ".join(["00"] * 32), "00" * 31, "0x" + "00" * 31, "00" * 32 + " "],
)
def test_key_json_hash_must_be_64_hex_digits(bad_hash: str) -> None:
    """``QueueKey.from_json``: ``hash`` is 64 hex digits, nothing else (a spaced form that
    ``bytes.fromhex`` would read is refused too), with the message naming the field."""
    with pytest.raises(ValueError, match="'hash' must be 64 hex digits"):
        QueueKey.from_json({"lt": 1, "hash": bad_hash})


def test_only_workchain_minus_one_is_the_masterchain() -> None:
    """docs/behaviour.md section 2: the masterchain is workchain -1; another negative
    workchain is an ordinary one."""
    other = ShardIdent.full(-2)
    assert not other.is_masterchain
    assert not BlockId(other, 1).is_masterchain
    assert ShardIdent.MASTERCHAIN.is_masterchain
    assert BlockId(ShardIdent.MASTERCHAIN, 1).is_masterchain


def test_iterated_message_checks_its_field_types() -> None:
    """docs/api.md: ``IteratedMessage(source, message)``: other field types are a
    ``TypeError``."""
    with pytest.raises(TypeError, match="source must be a ShardIdent"):
        IteratedMessage((0, S1.prefix), msg(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="message must be a Message"):
        IteratedMessage(S1, tuple(msg(1)))  # type: ignore[arg-type]
    assert IteratedMessage(S1, msg(1)).message == msg(1)


@pytest.mark.parametrize("seqno", ["\u0663", "\uff13", "\u00b3"])
def test_block_id_text_takes_ascii_decimal_seqnos_only(seqno: str) -> None:
    """docs/api.md: ``BlockId.parse`` reads ``wc:prefixhex:seqno:roothex:filehex`` as
    ``str(block_id)`` prints it: a seqno in another script's digits (which ``int()``
    would read) is a ``ValueError``, in the long form as in the short one."""
    hashes = ":" + "00" * 32 + ":" + "11" * 32
    assert BlockId.parse("0:8000000000000000:3" + hashes).seqno == 3
    with pytest.raises(ValueError, match="invalid block id"):
        BlockId.parse("0:8000000000000000:" + seqno + hashes)
    with pytest.raises(ValueError, match="invalid block id"):
        BlockId.parse("0:8000000000000000:" + seqno)


def _info(**fields: object) -> DiffInfo:
    base: dict[str, object] = {
        "min_message": key(1),
        "max_message": key(2),
        "shards_messages_count": {},
        "hash": bytes(32),
        "processed_to": {},
        "router_src": {},
        "router_dst": {},
        "seqno": 1,
    }
    base.update(fields)
    return DiffInfo(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("count", [0, 1, U64_MAX])
def test_diff_info_counts_are_any_u64(count: int) -> None:
    """docs/formats.md 1.3: a diff record's per-shard counts are u64 integers; a stored
    record (0 included) must build its ``DiffInfo``, and a count past a u64 must not."""
    info = _info(shards_messages_count={ShardIdent.BASECHAIN: count})
    assert info.shards_messages_count == {ShardIdent.BASECHAIN: count}
    with pytest.raises(ValueError):
        _info(shards_messages_count={ShardIdent.BASECHAIN: U64_MAX + 1})


def test_diff_info_checks_processed_to_values() -> None:
    """docs/api.md: value types are validated on construction; ``DiffInfo.processed_to``
    maps ``ShardIdent`` to ``QueueKey`` (a plain tuple equal to a key is a ``TypeError``)."""
    assert _info(processed_to={S1: key(3)}).processed_to == {S1: key(3)}
    with pytest.raises(TypeError, match="processed_to"):
        _info(processed_to={S1: (3, key(3).hash)})
    with pytest.raises(TypeError, match="processed_to"):
        _info(processed_to={S1: "3:00"})


def test_a_diffs_lt_span_takes_the_whole_u64_range() -> None:
    """docs/behaviour.md section 2 / ``QueueDiff``: ``start_lt``/``end_lt`` are lts (u64),
    ``U64_MAX`` included; one past it is a ``ValueError``."""
    diff = QueueDiff([msg(10)], start_lt=0, end_lt=U64_MAX)
    assert diff.bounds == (key(10), key(10))
    empty = QueueDiff(start_lt=U64_MAX, end_lt=U64_MAX)
    assert empty.bounds == (QueueKey.min_for_lt(U64_MAX), QueueKey.MAX)
    with pytest.raises(ValueError, match="u64"):
        QueueDiff(start_lt=0, end_lt=U64_MAX + 1)


def test_a_diffs_explicit_keys_must_both_be_queue_keys() -> None:
    """docs/api.md: values of the wrong type raise ``TypeError``: ``min_key`` and
    ``max_key`` are ``QueueKey`` values, each of them (a plain tuple that compares like a
    key is refused as ``max_key`` as well as ``min_key``)."""
    as_tuple = (20, key(20).hash)
    with pytest.raises(TypeError, match="min_key and max_key"):
        QueueDiff([msg(10)], min_key=key(1), max_key=as_tuple)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="min_key and max_key"):
        QueueDiff([msg(10)], min_key=as_tuple, max_key=key(30))  # type: ignore[arg-type]


def test_every_message_must_lie_within_the_explicit_keys_bounds_included() -> None:
    """docs/behaviour.md section 2: with ``min_key``/``max_key``, every message must lie
    between them (``ValueError``); both bounds are inclusive."""
    diff = QueueDiff([msg(10), msg(20)], min_key=key(10), max_key=key(20))
    assert diff.bounds == (key(10), key(20))
    with pytest.raises(ValueError, match=r"outside min_key\.\.max_key"):
        QueueDiff([msg(10), msg(21)], min_key=key(10), max_key=key(20))
    with pytest.raises(ValueError, match=r"outside min_key\.\.max_key"):
        QueueDiff([msg(9), msg(20)], min_key=key(10), max_key=key(20))


def test_diffs_that_store_different_bounds_are_not_equal() -> None:
    """docs/api.md: value types compare by value; two diffs whose spans or explicit keys
    differ store different bounds (``.bounds``), so they must not be equal."""
    base = QueueDiff(start_lt=10, end_lt=20)
    assert base == QueueDiff(start_lt=10, end_lt=20)
    assert base != QueueDiff(start_lt=11, end_lt=20)
    assert base != QueueDiff(start_lt=10, end_lt=21)
    keyed = QueueDiff([msg(10)], min_key=key(5), max_key=key(15))
    assert keyed == QueueDiff([msg(10)], min_key=key(5), max_key=key(15))
    assert keyed != QueueDiff([msg(10)], min_key=key(5), max_key=key(16))
    assert keyed != QueueDiff([msg(10)], min_key=key(4), max_key=key(15))


def test_diff_info_seqno_is_a_u32() -> None:
    """docs/api.md: block seqnos are u32 (``BlockIdShort``); a ``DiffInfo`` is one
    block's diff, so its seqno past ``2**32 - 1`` is a ``ValueError``."""
    assert _info(seqno=2**32 - 1).seqno == 2**32 - 1
    with pytest.raises(ValueError, match="seqno"):
        _info(seqno=2**32)


def test_diff_info_counts_are_keyed_by_shard_ident() -> None:
    """docs/api.md: value types are validated on construction; ``shards_messages_count``
    is keyed by ``ShardIdent`` (a plain tuple equal to one is a ``TypeError``)."""
    with pytest.raises(TypeError, match="keyed by ShardIdent"):
        _info(shards_messages_count={(0, 0x8000_0000_0000_0000): 1})


@pytest.mark.parametrize("obj", [["lt", "hash"], ("hash", "lt"), None, 5])
def test_key_json_form_must_be_an_object(obj: object) -> None:
    """``QueueKey.from_json`` reads ``{"lt": ..., "hash": ...}``; anything that is not
    such an object (a list of the two names included) is a ``ValueError`` saying what
    was expected, not a stray error from indexing it."""
    with pytest.raises(ValueError, match="invalid queue key"):
        QueueKey.from_json(obj)


def test_check_partitions_returns_the_distinct_partitions() -> None:
    """``check_partitions`` (used by every call taking ``partitions``) returns the
    distinct partitions of its argument: a repeated one counts once."""
    assert check_partitions([1, 0, 1, 0]) == frozenset({0, 1})
    assert len(check_partitions([7, 7, 7])) == 1


# --- the router and statistics ----------------------------------------------------------------


def test_a_source_only_router_has_no_destination_routes_and_counts_by_source() -> None:
    """docs/api.md: ``destination_routes()`` is the destination map when no source is
    routed, else ``None``; docs/behaviour.md section 2: statistics are derived from the
    diff and its router (lookup: dst map, then src map, then 0)."""
    router = PartitionRouter(src={3: [SRC]})
    assert router.destination_routes() is None
    assert PartitionRouter().destination_routes() == {}
    diff = QueueDiff([msg(10), msg(11, src=OTHER)], router=router)
    stats = DiffStatistics.from_diff(diff, S1, key(10), key(11))
    assert stats.partitions == {0: {DST: 1}, 3: {DST: 1}}


def test_router_halves_list_partitions_in_ascending_order() -> None:
    """Ordering is exact: ``src_partitions()``/``dst_partitions()`` (what a diff's record
    and ``DiffInfo`` keep) list partitions in ascending order, whatever the insert order."""
    router = PartitionRouter()
    for partition, byte in ((9, 1), (2, 2), (5, 3)):
        router.insert_src(Address(0, bytes([byte]) * 32), partition)
        router.insert_dst(Address(0, bytes([byte]) * 32), partition)
    assert list(router.src_partitions()) == [2, 5, 9]
    assert list(router.dst_partitions()) == [2, 5, 9]


def test_router_halves_of_none_mean_no_routes() -> None:
    """The signature ``PartitionRouter(src: Mapping | None, dst: Mapping | None)``:
    ``None`` for either half is no routes, as ``{}`` is."""
    assert PartitionRouter(src=None, dst=None) == PartitionRouter()
    assert PartitionRouter(dst=None).is_empty
    assert PartitionRouter(src={2: [SRC]}, dst=None).partition_for(SRC, DST) == 2


# --- bugs found by the audit ---------------------------------------------------------------


def test_a_diffs_router_cannot_be_changed_through_destination_routes() -> None:
    """docs/api.md: the diff keeps a read-only copy of the router, so statistics computed
    from a diff stay true of it; ``destination_routes()`` is documented read-only."""
    diff = QueueDiff([msg(10, dst=OTHER)], router=PartitionRouter(dst={5: [DST]}))
    routes = diff.router.destination_routes()
    assert routes is not None
    with contextlib.suppress(TypeError):  # a read-only mapping refusing is fine
        routes[OTHER] = 7  # type: ignore[index]
    assert diff.router.partition_for(SRC, OTHER) == 0
    stats = DiffStatistics.from_diff(diff, S1, key(10), key(10))
    assert stats.partitions == {0: {OTHER: 1}}


@pytest.mark.parametrize("bad", [[], (), 0, "", False])
def test_a_falsy_non_mapping_is_a_type_error(bad: object) -> None:
    """docs/api.md: values of the wrong type raise ``TypeError``; ``processed_to`` and
    the router halves are mappings (``None`` means none), and ``[SHARD]`` is refused."""
    with pytest.raises(TypeError, match="mapping"):
        QueueDiff([msg(10)], bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mapping"):
        PartitionRouter(src=bad)  # type: ignore[arg-type]


def test_partition_for_refuses_a_plain_tuple_destination() -> None:
    """docs/api.md: values of the wrong type raise ``TypeError``; ``partition_for(src,
    dst)`` raises it for a tuple dst that is not routed, and must for a routed one too."""
    router = PartitionRouter(dst={5: [DST]})
    with pytest.raises(TypeError, match="dst must be an Address"):
        router.partition_for(None, (0, bytes([0x30]) + bytes(31)))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dst must be an Address"):
        router.partition_for(None, (DST.workchain, DST.account))  # type: ignore[arg-type]
