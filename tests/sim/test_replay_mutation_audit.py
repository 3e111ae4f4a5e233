"""Checks of the record/replay tooling that hand-made mutants of ``imq.testing`` (replay,
record, codec, model) and of ``imq replay`` got past (a mutation audit).

Each test pins a rule of ``docs/replay-format.md`` (or ``docs/behaviour.md`` for the
model): a comparison the replay makes must be able to fail, a value the log holds must
come back as it went in, and a difference must be named at the step that made it. The
faults are put into the queue under replay (a ``Queue`` method patched) or into the
model, never into the replay itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_replay import Altering

import imq.queue
from imq import (
    Address,
    BlockId,
    BlockIdShort,
    CommitPointer,
    DiffInfo,
    DiffStatistics,
    DiffZone,
    Message,
    PartitionRouter,
    Queue,
    QueueConfig,
    QueueDiff,
    QueueKey,
    QueueShardRange,
    ShardIdent,
    TopBlock,
)
from imq.errors import CommitError, DiffConflictError, StorageError
from imq.testing import (
    MemoryDatabase,
    OpLog,
    OpLogError,
    ReplayDivergenceError,
    replay,
)
from imq.testing import codec as c
from imq.testing.replay import read_log

CONFIG = QueueConfig.testing()
MC = ShardIdent.MASTERCHAIN
SHARD = ShardIdent(0, 0x4000_0000_0000_0000)  # accounts 0x00.. to 0x7f..
READER = ShardIdent(0, 0xC000_0000_0000_0000)  # accounts 0x80.. to 0xff..
INSIDE = Address(0, b"\x10" * 32)  # in SHARD
OUTSIDE = Address(0, b"\x90" * 32)  # in READER
LOW = Address(0, b"\xa0" * 32)  # in READER, routed to partition 1
MC_DST = Address(-1, b"\x33" * 32)


def _key(lt: int) -> QueueKey:
    return QueueKey(lt, bytes([lt % 256]) * 32)


def _block_id(shard: ShardIdent, seqno: int) -> BlockId:
    return BlockId(shard, seqno, bytes(32), bytes(32))


def _record(tmp_path: Path, session: Callable[[Any], None], config: QueueConfig = CONFIG) -> Path:
    """The op log of ``session`` run on a recorded queue (opened and closed around it)."""
    log_path = tmp_path / "ops.jsonl"
    with log_path.open("w") as sink, OpLog(sink).open(Queue.open, tmp_path / "q", config) as q:
        session(q)
    return log_path


def _shard_diff() -> QueueDiff:
    """Three messages of SHARD, to the basechain in partitions 0 and 1 and to the
    masterchain, with a ``processed_to``, a router and a ``prev_hash``."""
    router = PartitionRouter(dst={1: [LOW]})
    msgs = [
        Message(_key(10), INSIDE, OUTSIDE, b"to the basechain"),
        Message(_key(11), INSIDE, LOW, b"low priority"),
        Message(_key(12), INSIDE, MC_DST, b"to the masterchain"),
    ]
    return QueueDiff(msgs, {SHARD: _key(5)}, router, prev_hash=b"\x07" * 32)


def _committed_session(q: Any) -> None:
    """Steps 2 to 4: apply a shard diff, apply a masterchain diff, commit both."""
    assert q.apply_diff(_shard_diff(), BlockIdShort(SHARD, 1), b"\x01" * 32)
    mc_diff = QueueDiff([], {SHARD: _key(10)})
    assert q.apply_diff(mc_diff, BlockIdShort(MC, 1), b"\x02" * 32)
    assert q.commit_diff([TopBlock(_block_id(MC, 1), 1), TopBlock(_block_id(SHARD, 1), 1)])


@pytest.fixture
def committed(tmp_path: Path) -> Path:
    """open (1), apply (2), apply (3), commit (4), close (5)."""
    return _record(tmp_path, _committed_session)


# -- the state comparison sees every observable it lists -------------------------------------

_Patch = Callable[[pytest.MonkeyPatch], None]


def _wrap(monkeypatch: pytest.MonkeyPatch, name: str, change: Callable[..., Any]) -> None:
    """Patch ``Queue.<name>`` so that its result goes through ``change(result, *args)``."""
    original = getattr(imq.queue.Queue, name)

    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        return change(original(self, *args, **kwargs), *args)

    monkeypatch.setattr(imq.queue.Queue, name, patched)


def _info_changed(**fields: Any) -> _Patch:
    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        def change(info: DiffInfo | None, *args: Any) -> DiffInfo | None:
            return None if info is None else dataclasses.replace(info, **fields)

        _wrap(monkeypatch, "get_diff_info", change)

    return patch


def _pointer_seqno_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    _wrap(
        monkeypatch,
        "get_commit_pointers",
        lambda pointers: {s: CommitPointer(p.key, p.seqno + 1) for s, p in pointers.items()},
    )


def _no_last_block(monkeypatch: pytest.MonkeyPatch) -> None:
    _wrap(monkeypatch, "get_last_committed_mc_block_id", lambda block: None)


def _seqno_plus_one(monkeypatch: pytest.MonkeyPatch) -> None:
    _wrap(monkeypatch, "get_last_applied_seqno", lambda n, *a: None if n is None else n + 1)


def _tail_plus_one(monkeypatch: pytest.MonkeyPatch) -> None:
    _wrap(monkeypatch, "get_diffs_tail_len", lambda n, *a: n + 1)


def _never_committed(monkeypatch: pytest.MonkeyPatch) -> None:
    def change(info: DiffInfo | None, shard: Any, seqno: Any, zone: Any = None) -> Any:
        return None if zone is DiffZone.COMMITTED else info

    _wrap(monkeypatch, "get_diff_info", change)


def _altered_when(test: Callable[[int, ShardIdent], bool]) -> _Patch:
    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        original = imq.queue.Queue.iterator

        def iterator(self: Any, partition: int, ranges: Any, for_shard: ShardIdent) -> Any:
            it = original(self, partition, ranges, for_shard)
            return Altering(it) if test(partition, for_shard) else it

        monkeypatch.setattr(imq.queue.Queue, "iterator", iterator)

    return patch


# (what the queue reads wrong, the step that shows it, the difference's start)
STATE_FAULTS: dict[str, tuple[_Patch, int, str]] = {
    "pointer seqno": (_pointer_seqno_moved, 4, "commit pointers"),
    "last committed block": (_no_last_block, 4, "last committed block"),
    "last applied seqno": (_seqno_plus_one, 2, f"last applied seqno of {SHARD}"),
    "tail length": (_tail_plus_one, 2, f"tail length of {SHARD}"),
    "zone COMMITTED": (_never_committed, 4, f"diff {MC}:1 in zone COMMITTED"),
    "prev_hash": (_info_changed(prev_hash=b"\x08" * 32), 2, f"diff {SHARD}:1 in zone BOTH"),
    "hash": (_info_changed(hash=b"\x01" * 31 + b"\x09"), 2, f"diff {SHARD}:1 in zone BOTH"),
    "shards_messages_count": (
        _info_changed(shards_messages_count={}),
        2,
        f"diff {SHARD}:1 in zone BOTH",
    ),
    "router_src": (
        _info_changed(router_src={1: frozenset([INSIDE])}),
        2,
        f"diff {SHARD}:1 in zone BOTH",
    ),
    "messages of partition 1": (
        _altered_when(lambda partition, for_shard: partition == 1),
        2,
        "messages of partition 1 for ",
    ),
    "messages for the masterchain": (
        _altered_when(lambda partition, for_shard: for_shard == MC),
        2,
        f"messages of partition 0 for {MC}",
    ),
}


def _diverges(log: Path, step: int, op: str, says: str) -> None:
    """The replay of ``log`` stops as a divergence at ``step`` (``op``), naming ``says``."""
    with pytest.raises(ReplayDivergenceError) as caught:
        replay(log)
    assert (caught.value.step, caught.value.op) == (step, op)
    assert says in caught.value.difference, caught.value.difference


@pytest.mark.parametrize("fault", sorted(STATE_FAULTS))
def test_the_state_comparison_sees_each_observable_it_lists(
    committed: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """replay-format.md, "What a replay checks": after every state-changing line the
    queue's commit pointers (key and seqno), last committed block, each shard's last
    applied seqno and tail length, every stored diff's DiffInfo (every field) in zones
    BOTH and COMMITTED, and every stored message of partitions 0 and 1 for the
    masterchain and the basechain are compared with the model's; the first difference
    stops the replay at the step that made it. The log holds no read, so only the state
    comparison can see the fault."""
    patch, step, says = STATE_FAULTS[fault]
    assert replay(committed).steps == 5  # the honest queue agrees
    patch(monkeypatch)
    with pytest.raises(ReplayDivergenceError) as caught:
        replay(committed)
    assert (caught.value.step, caught.value.checked_to) == (step, None), caught.value
    assert caught.value.difference.startswith(says), caught.value.difference


# -- a result the queue and the model give differently ---------------------------------------


def test_a_result_the_model_gives_otherwise_is_a_divergence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """replay-format.md, "What a replay checks": for every line the real queue's outcome
    equals the logged one, *and the model's equals the real queue's*. A queue whose
    ``load_diff_statistics`` sums nothing, recorded and replayed with the same fault,
    agrees with its log; only the model can name it (the state comparison reads the
    separated statistics, which are right)."""
    _wrap(monkeypatch, "load_diff_statistics", lambda counts, *a: {})

    def session(q: Any) -> None:
        assert q.apply_diff(_shard_diff(), BlockIdShort(SHARD, 1), b"\x01" * 32)
        assert q.load_diff_statistics(0, QueueShardRange(SHARD, QueueKey.MIN, QueueKey.MAX)) == {}

    _diverges(_record(tmp_path, session), 3, "load_diff_statistics", "the model")


def _lenient_prepare(
    monkeypatch: pytest.MonkeyPatch, change: Callable[[Any, Any, Any], Any]
) -> None:
    """``prepare_diff`` through ``change(original, args, kwargs)``: an engine fault."""
    original = imq.queue.Queue.prepare_diff

    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        return change(lambda: original(self, *args, **kwargs), args, kwargs)

    monkeypatch.setattr(imq.queue.Queue, "prepare_diff", prepare)


def test_a_prepare_the_queue_skips_and_the_model_writes_is_a_divergence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """replay-format.md: the model's outcome of every line equals the queue's
    (behaviour.md 5.2: with no stored diff there is no sequence constraint, so the
    prepare returns a pending diff). A queue that skips a fresh diff, recorded and
    replayed with the same fault, returns what its log says (null); the model would
    have written it."""

    def skip_when_sequenced(prepare: Any, args: Any, kwargs: Any) -> Any:
        pending = prepare()
        if pending is not None and args[4] is not None:  # check_sequence given
            pending.discard()
            return None
        return pending

    _lenient_prepare(monkeypatch, skip_when_sequenced)

    def session(q: Any) -> None:
        assert (
            q.prepare_diff(_shard_diff(), BlockIdShort(SHARD, 1), b"\x01" * 32, None, DiffZone.BOTH)
            is None
        )

    _diverges(_record(tmp_path, session), 2, "prepare_diff", "the model")


def test_a_pending_diff_the_model_skips_is_a_divergence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """replay-format.md: the model's outcome of every line equals the queue's. Behaviour
    5.2, step 2: with ``check_sequence``, a seqno at or below the shard's highest stored
    one (visible in the zone) is skipped. A queue that ignores ``check_sequence``
    returns a pending diff where the model skips: a divergence at the prepare, even
    though the write that follows leaves both states alike."""

    original = imq.queue.Queue.prepare_diff

    def unsequenced(self: Any, diff: Any, block: Any, diff_hash: Any, *rest: Any) -> Any:
        return original(self, diff, block, diff_hash, *rest[:1])  # check_sequence dropped

    monkeypatch.setattr(imq.queue.Queue, "prepare_diff", unsequenced)
    late = QueueDiff([Message(_key(20), INSIDE, OUTSIDE, b"late")])
    early = QueueDiff([Message(_key(30), INSIDE, OUTSIDE, b"early seqno")])

    def session(q: Any) -> None:
        assert q.apply_diff(late, BlockIdShort(SHARD, 5), b"\x05" * 32)
        pending = q.prepare_diff(early, BlockIdShort(SHARD, 3), b"\x03" * 32, None, DiffZone.BOTH)
        assert pending is not None  # the fault: the model skips seqno 3 below 5
        pending.write()

    _diverges(_record(tmp_path, session), 3, "prepare_diff", "the model")


def test_an_iterator_the_queue_refuses_is_a_divergence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """replay-format.md: the real queue's outcome of every line equals the logged one
    (an iterator is created at its step). A queue that refuses an iterator the host got
    diverges at that step, whatever the model answers."""

    def session(q: Any) -> None:
        _committed_session(q)
        full = [QueueShardRange(SHARD, QueueKey.MIN, QueueKey.MAX)]
        with q.iterator(0, full, READER) as it:
            assert len(list(it)) == 1

    log = _record(tmp_path, session)
    original = imq.queue.Queue.iterator

    def iterator(self: Any, partition: int, ranges: Any, for_shard: ShardIdent) -> Any:
        if for_shard == READER:  # the state comparison reads for MC and the basechain
            raise StorageError(self.path, "iterate", OSError(5, "injected"))
        return original(self, partition, ranges, for_shard)

    monkeypatch.setattr(imq.queue.Queue, "iterator", iterator)
    with pytest.raises(ReplayDivergenceError) as caught:
        replay(log)
    assert (caught.value.step, caught.value.op) == (5, "iterate")
    assert "StorageError" in caught.value.difference, caught.value.difference


def test_checked_to_names_the_step_after_which_the_state_agreed_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """replay-format.md, ``--check-every``: with ``open_queue=`` there is no fresh
    database to replay on again, so the error's ``checked_to`` names the step after which
    the state agreed last. With N = 2 the state is compared after steps 2 and 4; a tail
    length that goes wrong from the second diff on (step 3) shows at step 4, and the
    state agreed last after step 2."""

    def session(q: Any) -> None:
        for seqno in (1, 2, 3):
            diff = QueueDiff([Message(_key(10 * seqno), INSIDE, OUTSIDE, b"m")])
            assert q.apply_diff(diff, BlockIdShort(SHARD, seqno), bytes([seqno]) * 32)

    log = _record(tmp_path, session)  # open (1), apply (2, 3, 4), close (5)
    _wrap(monkeypatch, "get_diffs_tail_len", lambda n, *a: n + 1 if n >= 2 else n)
    memory = MemoryDatabase()
    with pytest.raises(ReplayDivergenceError) as caught:
        replay(
            log,
            open_queue=lambda config, zs: memory.open(config, zerostate_seqno=zs),
            check_every=2,
        )
    assert (caught.value.step, caught.value.checked_to) == (4, 2), caught.value
    assert "agreed last after step 2" in str(caught.value)


def test_a_check_statistics_refusal_for_bounds_replays(tmp_path: Path) -> None:
    """replay-format.md: an ``open`` line with ``check_statistics`` makes the replay's
    queue and model run the check too; behaviour.md 5.2: it refuses statistics whose
    bounds leave out one of the diff's messages, even when the counts are right. The
    model refuses it as the queue did, so the honest log replays."""
    diff = QueueDiff([Message(_key(10), INSIDE, OUTSIDE), Message(_key(20), INSIDE, OUTSIDE)])
    right = DiffStatistics.from_diff(diff, SHARD, _key(10), _key(20))
    short = DiffStatistics.from_diff(diff, SHARD, _key(10), _key(15))  # leaves key 20 out
    config = dataclasses.replace(CONFIG, check_statistics=True)

    def session(q: Any) -> None:
        with pytest.raises(ValueError):
            q.apply_diff(diff, BlockIdShort(SHARD, 1), b"\x01" * 32, short)
        assert q.apply_diff(diff, BlockIdShort(SHARD, 1), b"\x01" * 32, right)

    log = _record(tmp_path, session, config)
    assert [s["op"] for s in read_log(log)[1]] == ["open", "apply_diff", "apply_diff", "close"]
    assert read_log(log)[1][1]["error"]["type"] == "ValueError"
    assert replay(log).steps == 4


@pytest.mark.parametrize(
    "result",
    [None, {"messages": []}, {"exhausted": True}, {"messages": {}, "exhausted": True}],
    ids=["null", "no-exhausted", "no-messages", "messages-an-object"],
)
def test_an_iterate_result_without_messages_and_exhausted_is_refused(
    tmp_path: Path, result: object
) -> None:
    """replay-format.md: a replay refuses, before replaying anything, an ``iterate``
    result without a ``messages`` array and an ``exhausted`` boolean (the replay takes
    as many messages as the log's iterator did), naming the file and the line."""
    step = {
        "step": 2,
        "op": "iterate",
        "args": {"partition": 0, "ranges": [], "for_shard": str(ShardIdent.BASECHAIN)},
        "result": result,
    }
    log = tmp_path / "ops.jsonl"
    log.write_text(
        '{"imq_ops":1,"zerostate_seqno":0}\n'
        '{"step":1,"op":"open","args":{},"result":null}\n' + json.dumps(step) + "\n"
    )
    with pytest.raises(OpLogError, match=f"op log {log} line 3: iterate: .*exhausted"):
        replay(log)


# -- a bug found by the audit (fixed) ------------------------------------------------------


def test_a_prepare_the_queue_takes_for_applied_and_the_model_refuses_is_a_divergence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """replay-format.md: the model's outcome of every line equals the real queue's, and
    the first difference stops the replay as a divergence at its step (``imq replay``:
    ``DIVERGED at step N``); ``OpLogError`` is for a log the replay cannot use.
    behaviour.md 5.2, step 1: a stored diff for ``(shard, seqno)`` with another hash is
    ``DiffConflictError``. A queue that takes such a diff for one already applied
    (``None``), recorded and replayed with the same fault, returns what its log says;
    the model raises ``DiffConflictError``: that is a divergence at the prepare."""

    def conflict_taken_for_applied(prepare: Any, args: Any, kwargs: Any) -> Any:
        try:
            return prepare()
        except DiffConflictError:
            return None

    _lenient_prepare(monkeypatch, conflict_taken_for_applied)
    other = QueueDiff([Message(_key(40), INSIDE, OUTSIDE, b"another diff")])

    def session(q: Any) -> None:
        assert q.apply_diff(_shard_diff(), BlockIdShort(SHARD, 1), b"\x01" * 32)
        assert q.prepare_diff(other, BlockIdShort(SHARD, 1), b"\x02" * 32) is None

    _diverges(_record(tmp_path, session), 3, "prepare_diff", "DiffConflictError")


# -- the log's values come back as they went in ----------------------------------------------


def _every_field_diff() -> tuple[QueueDiff, DiffStatistics]:
    """A diff with every field set (a span and explicit keys wider than its messages),
    and statistics as given, with counts above 1 and another partition."""
    router = PartitionRouter(src={2: [INSIDE]}, dst={1: [LOW]})
    msgs = [
        Message(_key(100), INSIDE, OUTSIDE, b"\x00body\xff"),
        Message(_key(101), Address(0, b"\x11" * 32), LOW, b""),
    ]
    diff = QueueDiff(
        msgs,
        {SHARD: _key(90), READER: _key(7)},
        router,
        prev_hash=b"\x0e" * 32,
        start_lt=95,
        end_lt=110,
        min_key=QueueKey.min_for_lt(95),
        max_key=QueueKey.max_for_lt(110),
    )
    stats = DiffStatistics(
        SHARD, QueueKey.min_for_lt(95), QueueKey.max_for_lt(110), {0: {OUTSIDE: 3}, 1: {LOW: 2}}
    )
    return diff, stats


def test_every_recorded_argument_decodes_to_the_value_the_host_passed(tmp_path: Path) -> None:
    """replay-format.md, "Value encodings (lossless)": every field of every value. A
    ``QueueDiff`` (messages and bodies, ``processed_to``, both router halves,
    ``prev_hash``, ``start_lt``/``end_lt``, ``min_key``/``max_key``), a
    ``DiffStatistics`` (shard, bounds, per-partition counts) and a ``TopBlock``
    (``ref_by_mc_seqno``, ``updated``) read back from the log equal what was passed."""
    diff, stats = _every_field_diff()
    tops = [TopBlock(_block_id(MC, 3), 3), TopBlock(_block_id(SHARD, 9), 2, updated=False)]

    def session(q: Any) -> None:
        assert q.apply_diff(diff, BlockIdShort(SHARD, 1), b"\x01" * 32, stats, DiffZone.BOTH)
        with pytest.raises(CommitError):  # no diff of the masterchain block: logged refused
            q.commit_diff(tops, [1, 0])

    _, steps = read_log(_record(tmp_path, session))
    applied = steps[1]["args"]
    assert c.dec_diff(applied["diff"]) == diff
    assert c.dec_statistics(applied["statistics"]) == stats
    assert c.dec_block(applied["block"]) == BlockIdShort(SHARD, 1)
    assert c.dec_hash(applied["hash"]) == b"\x01" * 32
    assert c.dec_zone(applied["check_sequence"]) is DiffZone.BOTH
    committed = steps[2]["args"]
    assert [c.dec_top(t) for t in committed["top_blocks"]] == tops
    assert c.dec_partitions(committed["partitions"]) == [0, 1]


def test_a_replay_rebuilds_the_recorded_database_row_for_row(tmp_path: Path) -> None:
    """replay-format.md: the log is replayed on a fresh database, and its value encodings
    are lossless, so the replayed database holds exactly the rows of the recorded one
    (a field the log dropped would be dropped on both sides of the replay's comparisons,
    and show only here)."""
    diff, stats = _every_field_diff()
    recorded, replayed = MemoryDatabase(), MemoryDatabase()
    log_path = tmp_path / "ops.jsonl"
    with log_path.open("w") as sink:
        q = OpLog(sink).open(lambda _path, config: recorded.open(config), tmp_path, CONFIG)
        with q:
            assert q.apply_diff(diff, BlockIdShort(SHARD, 1), b"\x01" * 32, stats)
            assert q.apply_diff(QueueDiff([], {SHARD: _key(100)}), BlockIdShort(MC, 1), bytes(32))
            top = [TopBlock(_block_id(MC, 1), 1), TopBlock(_block_id(SHARD, 1), 1)]
            assert q.commit_diff(top, [0, 1])
    report = replay(
        log_path, open_queue=lambda config, zs: replayed.open(config, zerostate_seqno=zs)
    )
    assert report.steps == 5
    assert replayed.rows() == recorded.rows()


def _apply_step(**change: Any) -> dict[str, Any]:
    """Step 2 of a log: a well-formed apply_diff of one message, ``change`` applied to
    its arguments (``diff`` and ``statistics`` entries merged into theirs)."""
    msg = Message(_key(10), INSIDE, OUTSIDE, b"\x01\x02")
    diff = c.enc_diff(QueueDiff([msg], router=PartitionRouter(dst={1: [OUTSIDE]})))
    stats = c.enc_statistics(DiffStatistics(SHARD, _key(10), _key(10), {1: {OUTSIDE: 1}}))
    assert stats is not None
    diff.update(change.pop("diff", {}))
    stats.update(change.pop("statistics", {}))
    args = {
        "block": f"{SHARD}:1",
        "diff": diff,
        "hash": "01" * 32,
        "statistics": stats,
        "check_sequence": None,
        **change,
    }
    return {"step": 2, "op": "apply_diff", "args": args, "result": True}


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        ({"hash": "01 " * 31 + "01"}, "hash"),
        ({"hash": " " + "01" * 32}, "hash"),
        ({"diff": {"prev_hash": "0e" * 31 + " 0e"}}, "diff"),
        ({"diff": {"router_dst": {"01": [str(OUTSIDE)]}}}, "diff"),
        ({"statistics": {"partitions": {"01": {str(OUTSIDE): 1}}}}, "statistics"),
    ],
    ids=["hash-spaced", "hash-leading-space", "prev-hash-spaced", "router-01", "stats-01"],
)
def test_hex_and_partition_keys_are_read_only_as_the_recorder_writes_them(
    tmp_path: Path, change: dict[str, Any], argument: str
) -> None:
    """replay-format.md: a replay refuses, before replaying anything, an argument that
    does not decode as the table says: "a partition key of a router or statistics is the
    decimal the recorder writes ("1", not "01") ... hex is two digits a byte" (so no
    spaces, which ``bytes.fromhex`` would skip). The same line as written replays."""
    log = tmp_path / "ops.jsonl"
    header = '{"imq_ops":1,"zerostate_seqno":0}\n{"step":1,"op":"open","args":{},"result":null}\n'
    log.write_text(header + json.dumps(_apply_step()) + "\n")
    assert replay(log).steps == 2
    log.write_text(header + json.dumps(_apply_step(**change)) + "\n")
    with pytest.raises(OpLogError, match=f"line 3: apply_diff: argument '{argument}' is not"):
        replay(log)


# -- the model follows the documented rules (an honest log replays) --------------------------


def test_clear_removes_the_statistics_of_a_partition_only_the_statistics_name(
    tmp_path: Path,
) -> None:
    """behaviour.md 5.4 (I3): a clear deletes the cleared diffs' messages and statistics
    in every partition they wrote rows into, their messages' *and statistics'*
    partitions, besides the requested ones. Statistics given for partition 1 of a diff
    whose messages all went to partition 0 are gone after a clear of partition 0 alone,
    in the queue and in the model: the honest log replays."""
    diff = QueueDiff([Message(_key(10), INSIDE, OUTSIDE, b"m")])
    stats = DiffStatistics(SHARD, _key(10), _key(10), {0: {OUTSIDE: 1}, 1: {LOW: 4}})
    full = QueueShardRange(SHARD, QueueKey.MIN, QueueKey.MAX)

    def session(q: Any) -> None:
        assert q.apply_diff(diff, BlockIdShort(SHARD, 1), b"\x01" * 32, stats)
        q.clear_uncommitted_state([0], [SHARD])
        assert q.load_separated_diff_statistics((0, 1), full) == {0: {}, 1: {}}

    assert replay(_record(tmp_path, session)).steps == 4


def test_an_empty_diff_rests_above_the_newest_diff_below_its_own_seqno(tmp_path: Path) -> None:
    """behaviour.md 2, QueueDiff: an empty diff with neither span nor keys rests just
    above the higher of its shard's commit pointer and the max_message of its newest
    stored diff *below it* (``MIN`` when there is neither). An empty diff of seqno 3
    applied after the shard's seqno 5 has no diff below it and rests at ``MIN``, in the
    queue and in the model: the honest log replays."""
    later = QueueDiff([Message(_key(50), INSIDE, OUTSIDE, b"m")])

    def session(q: Any) -> None:
        assert q.apply_diff(later, BlockIdShort(SHARD, 5), b"\x05" * 32)
        assert q.apply_diff(QueueDiff(), BlockIdShort(SHARD, 3), b"\x03" * 32)
        info = q.get_diff_info(SHARD, 3)
        assert (info.min_message, info.max_message) == (QueueKey.MIN, QueueKey.MIN)

    assert replay(_record(tmp_path, session)).steps == 5


def test_statistics_of_two_diffs_sharing_a_max_message_are_both_kept(tmp_path: Path) -> None:
    """behaviour.md 7 (D3, I2): one statistics row per (diff, partition), its key carries
    the seqno, so two diffs with one ``max_message`` never overwrite each other;
    ``load_separated_diff_statistics`` sums diffs sharing a ``max_message`` (5.6). The
    queue and the model both count 2 + 3: the honest log replays."""
    top = _key(20)
    first = QueueDiff([Message(_key(10), INSIDE, OUTSIDE, b"a")])
    second = QueueDiff([Message(_key(15), INSIDE, OUTSIDE, b"b")])
    full = QueueShardRange(SHARD, QueueKey.MIN, QueueKey.MAX)

    def session(q: Any) -> None:
        stats = DiffStatistics(SHARD, _key(10), top, {0: {OUTSIDE: 2}})
        assert q.apply_diff(first, BlockIdShort(SHARD, 1), b"\x01" * 32, stats)
        stats = DiffStatistics(SHARD, _key(15), top, {0: {OUTSIDE: 3}})
        assert q.apply_diff(second, BlockIdShort(SHARD, 2), b"\x02" * 32, stats)
        assert q.load_separated_diff_statistics((0,), full) == {0: {top: {OUTSIDE: 5}}}

    assert replay(_record(tmp_path, session)).steps == 4


# -- ``imq replay`` ---------------------------------------------------------------------------


def test_the_cli_says_where_the_state_agreed_last_when_the_second_replay_misses_it(
    committed: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """replay-format.md, ``--check-every``: a difference found after unchecked state
    changes is replayed again to name its step; ``ReplayDivergenceError.checked_to``
    names the step after which the state agreed last where that second replay does not
    find it (a replay that does not repeat itself). ``imq replay`` then says so, beside
    ``DIVERGED at step N (op)`` and the first difference, and exits 1. Here the queue
    reads one tail length wrong once: in the first replay's only comparison."""
    from imq.cli.main import main

    calls = itertools.count()
    _wrap(monkeypatch, "get_diffs_tail_len", lambda n, *a: n + 1 if next(calls) == 0 else n)
    argv = ["replay", str(committed), "--check-every", "1000", "--no-progress"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "replay: DIVERGED at step 4 (commit_diff)" in out, out
    assert "first difference: tail length of" in out, out
    assert "the state agreed last after step 0" in out, out
