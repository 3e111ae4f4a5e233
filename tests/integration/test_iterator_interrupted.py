"""An iterator whose read an exception of the host's cut short (a signal handler's
``TimeoutError``, a ``KeyboardInterrupt``), and one iterator pulled by two threads at
once: never a clean end of a range that has messages left (found by an outside audit
of embedding: both ended the range early without a word, 48 of 20,000 messages read)."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from builders import BASE, Chain, full_range, quarter_shards, quiet_config

from imq import (
    CorruptDataError,
    IteratedMessage,
    Queue,
    QueueKey,
    QueueShardRange,
    ReadInterruptedError,
)
from imq import iterator as iterator_module
from imq.storage import rocks

SOURCES = quarter_shards()
MODES = pytest.mark.parametrize("pure", [False, True], ids=["default", "pure-python"])


def _fill_name(pure: bool) -> str:
    """The merge's fill an iterator made now takes (the pure-Python one also where the
    compiled module is off)."""
    return "_py_merge_fill" if pure or iterator_module._merge_fill is None else "_merge_fill"


@contextlib.contextmanager
def _mode(pure: bool) -> Iterator[None]:
    with iterator_module.pure_python() if pure else contextlib.nullcontext():
        yield


def _filled(queue: Queue, diffs: int = 6, per_diff: int = 300) -> list[tuple[object, QueueKey]]:
    chain = Chain(queue)
    for _ in range(diffs):
        for shard in SOURCES:
            chain.apply(shard, per_diff)
    with queue.iterator(0, [full_range(s) for s in SOURCES], BASE) as it:
        return [(m.source, m.message.key) for m in it]


def _rest(queue: Queue, position: dict[Any, QueueKey]) -> list[tuple[object, QueueKey]]:
    """What a new iterator from ``position`` reads (each range starts past the key
    consumed there)."""
    ranges = [
        QueueShardRange(s, position[s].next_value(), QueueKey.MAX)
        if s in position
        else full_range(s)
        for s in SOURCES
    ]
    with queue.iterator(0, ranges, BASE) as it:
        return [(m.source, m.message.key) for m in it]


@MODES
@pytest.mark.parametrize("kind", [TimeoutError, KeyboardInterrupt])
@pytest.mark.parametrize("at_call", [1, 3])
def test_a_host_exception_inside_a_read_is_raised_then_the_iterator_stays_failed(
    db_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    pure: bool,
    kind: type[BaseException],
    at_call: int,
) -> None:
    """The exception lands after a batch's rows were read from RocksDB (the worst
    moment: they are lost with it). It is raised as it came, once; every later pull
    raises ``ReadInterruptedError``, and ``current_position()`` is where the consumer
    stands: a new iterator from it reads exactly the rest, nothing twice or missing."""
    with Queue.open(db_path, quiet_config(message_cache_size=0)) as queue:
        everything = _filled(queue)
        real = getattr(iterator_module, _fill_name(pure))
        calls = [0]

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            calls[0] += 1
            if calls[0] == at_call:
                raise kind("the host's deadline")
            return result

        monkeypatch.setattr(iterator_module, _fill_name(pure), interrupted)
        with _mode(pure):
            it = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
        monkeypatch.undo()
        got: list[IteratedMessage] = []
        with pytest.raises(kind, match="the host's deadline"):
            got.extend(it)
        assert len(got) < len(everything)
        for _ in range(2):
            with pytest.raises(ReadInterruptedError, match=f"cut short by {kind.__name__}"):
                next(it)
        with pytest.raises(ReadInterruptedError, match="current_position"):
            list(it)
        position = it.current_position()
        it.close()
        assert list(it) == []
        assert it.current_position() == position
        read = [(m.source, m.message.key) for m in got]
        assert sorted(read + _rest(queue, position)) == sorted(everything)


@MODES
def test_an_interrupted_iterator_pins_nothing_and_its_queue_closes(
    db_path: Path, monkeypatch: pytest.MonkeyPatch, pure: bool
) -> None:
    """Kept failed (its error kept too, as a host's log would), the iterator holds no
    RocksDB view: the queue closes and the directory opens again."""
    kept: list[BaseException] = []
    with Queue.open(db_path, quiet_config(message_cache_size=0)) as queue:
        _filled(queue, diffs=2)

        def interrupted(*_args: Any, **_kwargs: Any) -> Any:
            raise TimeoutError("deadline")

        monkeypatch.setattr(iterator_module, _fill_name(pure), interrupted)
        with _mode(pure):
            it = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
        monkeypatch.undo()
        for error in (TimeoutError, ReadInterruptedError):
            with pytest.raises(error) as info:
                next(it)
            kept.append(info.value)
    with (
        Queue.open(db_path, quiet_config()) as again,
        again.iterator(0, [full_range(s) for s in SOURCES], BASE) as it,
    ):
        assert next(it, None) is not None
    assert [type(e) for e in kept] == [TimeoutError, ReadInterruptedError]


def _read_once(got: list[IteratedMessage], everything: list[tuple[object, QueueKey]]) -> None:
    """Between them, the reads got every message of ``everything`` exactly once."""
    read = [(m.source, m.message.key) for m in got]
    assert sorted(read) == sorted(everything) and len(set(read)) == len(read)


def _pausing_at_the_second_batch(
    queue: Queue, monkeypatch: pytest.MonkeyPatch, pure: bool
) -> tuple[Iterator[IteratedMessage], threading.Event, threading.Event]:
    """An iterator over the whole partition whose merge, filling its second batch, sets
    the first event and waits for the second: meanwhile another thread pulls."""
    real = getattr(iterator_module, _fill_name(pure))
    inside, release = threading.Event(), threading.Event()
    calls = [0]

    def slow(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            inside.set()
            assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(iterator_module, _fill_name(pure), slow)
    with _mode(pure):
        it = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
    monkeypatch.undo()
    return it, inside, release


@MODES
@pytest.mark.skipif(
    iterator_module._guard_type is None,
    reason="the thread guard is compiled (imq._speedups.Guard): without it a host shares "
    "an iterator under a lock (docs/api.md)",
)
def test_two_threads_pulling_one_iterator_never_end_it_early(
    db_path: Path, monkeypatch: pytest.MonkeyPatch, pure: bool
) -> None:
    """A second thread's pull while the first is producing a batch: the second gets
    ``ValueError`` saying the iterator serves one thread at a time, and the range goes
    on: between them the two threads read every message once, and the second's error
    was its only one (before, the chain
    dropped its source on Python's "generator already executing", and both threads
    then saw a clean end)."""
    with Queue.open(db_path, quiet_config(message_cache_size=0)) as queue:
        everything = _filled(queue, diffs=3)
        it, inside, release = _pausing_at_the_second_batch(queue, monkeypatch, pure)
        got: dict[str, list[IteratedMessage]] = {"a": [], "b": []}
        errors: list[BaseException] = []

        def drain(name: str, take: Callable[[], IteratedMessage]) -> None:
            while True:
                try:
                    got[name].append(take())
                except StopIteration:
                    return
                except ValueError as exc:
                    errors.append(exc)

        a = threading.Thread(target=drain, args=("a", it.__next__))
        a.start()
        try:
            assert inside.wait(30)
            with pytest.raises(ValueError, match="one thread at a time"):
                next(it)
        finally:
            release.set()
            a.join(30)
        assert not a.is_alive()
        drain("b", it.__next__)
        it.close()
        assert errors == []
        _read_once(got["a"] + got["b"], everything)


_GUARDED = pytest.mark.skipif(
    iterator_module._guard_type is None,
    reason="the thread guard is compiled (imq._speedups.Guard): without it a host shares "
    "an iterator under a lock (docs/api.md)",
)


def _hand_off_at_python_calls(when: Callable[[], bool], then: Callable[[], None]) -> None:
    """Trace this thread: at each Python function it enters while ``when()`` holds, run
    ``then()`` (the first time only): the GIL handed to another thread exactly where the
    interpreter may switch threads on its own."""
    done = [False]

    def hook(_frame: FrameType, event: str, _arg: object) -> None:
        if event == "call" and not done[0] and when():
            done[0] = True
            then()

    sys.settrace(hook)


@MODES
@_GUARDED
def test_a_busy_pull_handing_the_gil_over_never_loses_the_other_threads_batch(
    db_path: Path, monkeypatch: pytest.MonkeyPatch, pure: bool
) -> None:
    """The second thread's pull gets the busy marker while the first runs the merge; at
    the first Python code that pull runs, the GIL goes to the first thread, which stores
    its batch in the chain and takes a message. The busy marker must not be stored over
    that batch afterwards: an audit found it was (the marker's ``__iter__`` was Python
    code, run between the guard's return and the chain's store), and the iterator then
    raised "another thread" for good with the rest of its range unread (3 of 300 runs of
    four threads without any hand-off forced)."""
    with Queue.open(db_path, quiet_config(message_cache_size=0)) as queue:
        everything = _filled(queue, diffs=3)
        it, inside, release = _pausing_at_the_second_batch(queue, monkeypatch, pure)
        delivered, pulled = threading.Event(), threading.Event()
        got: list[IteratedMessage] = []
        stuck = [False]

        def drain_a() -> None:
            streak = 0
            while streak < 1000:
                try:
                    got.append(next(it))
                except StopIteration:
                    return
                except ValueError:
                    streak += 1
                    continue
                streak = 0
                if release.is_set() and not delivered.is_set():
                    delivered.set()
                    assert pulled.wait(10)  # the second thread's pull has returned
            stuck[0] = True

        a = threading.Thread(target=drain_a)
        a.start()
        pulling = [False]
        try:
            assert inside.wait(30)

            def hand_over() -> None:
                release.set()
                assert delivered.wait(10)  # the first thread has stored its batch

            _hand_off_at_python_calls(lambda: pulling[0], hand_over)
            try:
                with pytest.raises(ValueError, match="one thread at a time"):
                    pulling[0] = True  # no Python call left before the pull
                    next(it)
            finally:
                sys.settrace(None)
                pulled.set()
        finally:
            pulled.set()
            release.set()
            a.join(60)
        assert not a.is_alive()
        assert not stuck[0], "the iterator raised 'another thread' for good"
        got.extend(it)
        it.close()
        _read_once(got, everything)


@MODES
@_GUARDED
def test_a_busy_pull_whose_error_runs_a_finalizer_never_ends_the_range(
    db_path: Path, monkeypatch: pytest.MonkeyPatch, pure: bool
) -> None:
    """The second thread pulls inside an ``except`` block of its own, where creating the
    generator's "already executing" error can run the cyclic GC and a finalizer; there
    the first thread finishes its batch. The guard asked the generator whether it still
    ran, found it did not, passed the error on, and the chain ended the range for both
    threads (a review: 17 of 3,600 messages read, no error). The guard's own flag says
    busy now: no exception is made on that path."""
    with Queue.open(db_path, quiet_config(message_cache_size=0)) as queue:
        everything = _filled(queue, diffs=3)
        it, inside, release = _pausing_at_the_second_batch(queue, monkeypatch, pure)
        delivered, pulled = threading.Event(), threading.Event()
        got: list[IteratedMessage] = []

        def drain_a() -> None:
            while True:
                try:
                    got.append(next(it))
                except StopIteration:
                    return
                except ValueError:
                    continue
                if release.is_set() and not delivered.is_set():
                    delivered.set()
                    pulled.wait(10)

        class Finalizer:
            def __init__(self) -> None:
                self.me = self  # a cycle: only the cyclic GC frees it

            def __del__(self) -> None:
                if threading.current_thread() is threading.main_thread():  # the puller
                    release.set()
                    delivered.wait(10)  # the first thread finishes its batch meanwhile

        a = threading.Thread(target=drain_a)
        a.start()
        outcome = "none"
        try:
            assert inside.wait(30)
            gc.collect()
            gc.disable()
            Finalizer()
            thresholds = gc.get_threshold()
            try:
                raise KeyError("a handled exception of the host's")
            except KeyError:
                gc.set_threshold(1)
                gc.enable()
                try:
                    next(it)
                    outcome = "message"
                except ValueError:
                    outcome = "busy"
                except StopIteration:
                    outcome = "end"
                finally:
                    gc.set_threshold(*thresholds)
        finally:
            gc.enable()
            pulled.set()
            release.set()
            a.join(60)
        assert not a.is_alive()
        assert outcome in {"busy", "message"}, outcome
        got.extend(it)
        _read_once(got, everything)


@MODES
@_GUARDED
def test_a_failed_read_handing_the_gil_over_is_no_clean_end_for_another_thread(
    db_path: Path, monkeypatch: pytest.MonkeyPatch, pure: bool
) -> None:
    """A read fails; at the first Python code its thread runs once the merge has handed
    out the failure, another thread pulls. It must meet the failure (or the busy
    marker), never a clean end: an audit found the failure's marker had a Python
    ``__iter__``, where the other thread's pull resumed the merge past it, and that
    thread's chain then dropped its source and ended the range."""
    with Queue.open(db_path, quiet_config(message_cache_size=0)) as queue:
        _filled(queue, diffs=3)
        real = getattr(iterator_module, _fill_name(pure))
        calls = [0]

        def failing(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 3:
                raise CorruptDataError("messages", b"", "injected read failure")
            return real(*args, **kwargs)

        monkeypatch.setattr(iterator_module, _fill_name(pure), failing)
        with _mode(pure):
            it = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
        monkeypatch.undo()
        producer = it._producer
        in_window, other_pulled = threading.Event(), threading.Event()
        outcome: dict[str, str] = {}

        def a() -> None:
            def hand_over() -> None:
                in_window.set()
                other_pulled.wait(10)

            # past the failure, and out of the merge (whose own code runs while a second
            # thread's pull gets the busy marker)
            _hand_off_at_python_calls(lambda: calls[0] >= 3 and not producer.gi_running, hand_over)
            try:
                for _ in it:
                    pass
                outcome["a"] = "end"
            except CorruptDataError:
                outcome["a"] = "failed"
            finally:
                sys.settrace(None)
                in_window.set()

        def b() -> None:
            assert in_window.wait(30)
            try:
                next(it)
                outcome["b"] = "message"
            except StopIteration:
                outcome["b"] = "end"
            except CorruptDataError:
                outcome["b"] = "failed"
            except ValueError:
                outcome["b"] = "busy"
            finally:
                other_pulled.set()

        threads = [threading.Thread(target=a), threading.Thread(target=b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert outcome["a"] == "failed"
        assert outcome["b"] in {"failed", "busy"}, outcome
        for _ in range(2):
            with pytest.raises(CorruptDataError):
                next(it)
        it.close()
        assert list(it) == []


def _injected_run(
    queue: Queue,
    pure: bool,
    k: int,
    targets: dict[str, frozenset[str]],
    everything: list[tuple[object, QueueKey]],
) -> tuple[str, int]:
    """Read the whole partition (``everything``, sorted) with a ``TimeoutError`` raised
    at the ``k``-th opcode boundary of the merge's Python code (``sys.settrace``): what
    the consumer saw (none, creation, interrupted), and the boundaries passed."""
    seen = {"n": 0}
    where: list[tuple[str, int]] = []

    def local(frame: FrameType, event: str, _arg: object) -> object:
        if event == "opcode":
            seen["n"] += 1
            if seen["n"] == k:
                where.append((frame.f_code.co_qualname, frame.f_lineno or -1))
                raise TimeoutError("injected")
        return local

    def scope(frame: FrameType, _event: str, _arg: object) -> object:
        code = frame.f_code
        if code.co_name in targets.get(code.co_filename, frozenset()):
            frame.f_trace_opcodes = True
            return local
        return None

    got: list[tuple[object, QueueKey]] = []
    raised = False
    it = None
    sys.settrace(scope)
    try:
        with _mode(pure):
            it = queue.iterator(0, [full_range(s) for s in SOURCES], BASE)
        got.extend((m.source, m.message.key) for m in it)
    except TimeoutError:
        raised = True
    finally:
        sys.settrace(None)
    if not where:
        assert it is not None
        it.close()
        return "none", seen["n"]
    assert raised, f"an exception at {where[0]} ended the read without a word"
    if it is None:  # landed while the iterator was made: Queue.iterator() raised it
        return "creation", seen["n"]
    later = []
    for _ in range(2):
        try:
            next(it)
            later.append("item")
        except StopIteration:
            later.append("end")
        except ReadInterruptedError:
            later.append("interrupted")
    position = it.current_position()
    it.close()
    assert it.current_position() == position
    complete = len(got) == len(everything)
    # after the last batch (the merge's closing code) the range had been read: an end
    assert later == ["interrupted"] * 2 or (complete and later == ["end"] * 2), (where, later)
    assert sorted(got + _rest(queue, position)) == everything, where
    return "interrupted", seen["n"]


@MODES
def test_an_exception_at_any_point_of_the_merge_is_never_a_clean_end(
    db_path: Path, pure: bool
) -> None:
    """A ``TimeoutError`` injected at each opcode boundary of the merge's Python code
    (the generator, the batch loop, the pure-Python fill and decode, the cursors' end
    checks), one per read: every read raises it, or ``Queue.iterator()`` does, then the
    iterator raises ``ReadInterruptedError`` (or ends, when the range had been read),
    and ``current_position()`` is exact. A review found the Python wrapper that first
    guarded the merge against a second thread let 2% of real alarms end a read
    silently; the guard is C now. Every 7th boundary (``IMQ_INJECT_STRIDE=1``: every
    one)."""
    stride = int(os.environ.get("IMQ_INJECT_STRIDE", "7"))
    targets = {
        iterator_module.__file__: frozenset(
            {"_merged", "_merge_batches", "_py_merge_fill", "_read_ahead", "_decode"}
        ),
        rocks.__file__: frozenset({"check", "finish"}),
    }
    with Queue.open(db_path, quiet_config(message_cache_size=0)) as queue:
        everything = sorted(_filled(queue, diffs=2, per_diff=40))
        outcomes: Counter[str] = Counter()
        k = 1
        while True:
            outcome, total = _injected_run(queue, pure, k, targets, everything)
            if outcome == "none":
                break
            outcomes[outcome] += 1
            k += stride
        assert outcomes["interrupted"] > 10 and total > 100, outcomes
