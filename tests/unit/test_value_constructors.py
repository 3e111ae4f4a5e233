"""The compiled constructors of ``QueueKey`` and ``Message`` (``imq._speedups``
``set_constructors``): the common case is built in C, every other call goes to the
Python ``__new__``; either way the same value, or the same error, as the Python
constructor alone gives (``value_constructors(False)``, what a machine without the
extension runs)."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from compiled_only import COMPILED_ONLY
from hypothesis import given
from hypothesis import strategies as st

from imq import iterator
from imq.types import Address, Message, QueueKey

pytestmark = COMPILED_ONLY

H = bytes(range(32))
A = Address(0, b"\x11" * 32)
B = Address(-1, b"\x22" * 32)


@contextmanager
def python_constructors() -> Iterator[None]:
    module = iterator._speedups_module
    was = module.value_constructors(False)
    try:
        yield
    finally:
        module.value_constructors(was)


def outcome(make: Callable[[], Any]) -> tuple[Any, ...]:
    """What a call gives: the value with its type and whether the cyclic GC tracks it,
    or the error's type and message."""
    try:
        value = make()
    except Exception as exc:  # compared, not handled
        return ("error", type(exc), str(exc))
    return ("value", type(value), tuple(value), gc.is_tracked(value))


def both(make: Callable[[], Any]) -> tuple[Any, ...]:
    """``make()`` with the compiled constructors, checked against the Python ones."""
    compiled = outcome(make)
    with python_constructors():
        python = outcome(make)
    assert compiled == python
    return compiled


def python_new_calls(make: Callable[[], Any]) -> int:
    """How many times ``make()`` runs a Python ``__new__`` of ``imq.types``."""
    calls = 0

    def profile(frame: Any, event: str, _arg: object) -> None:
        nonlocal calls
        code = frame.f_code
        if event == "call" and code.co_name == "__new__" and code.co_filename.endswith("types.py"):
            calls += 1

    sys.setprofile(profile)
    try:
        make()
    finally:
        sys.setprofile(None)
    return calls


def test_the_common_case_runs_no_python() -> None:
    key = QueueKey(7, H)
    assert python_new_calls(lambda: QueueKey(7, H)) == 0
    assert python_new_calls(lambda: Message(key, A, B, b"x")) == 0
    assert python_new_calls(lambda: Message(key, A, B)) == 0
    with python_constructors():
        assert python_new_calls(lambda: QueueKey(7, H)) == 1
        assert python_new_calls(lambda: Message(key, A, B)) == 1
    # Keywords take the Python constructor, which accepts them.
    assert python_new_calls(lambda: QueueKey(lt=7, hash=H)) == 1


def test_from_bytes_builds_the_python_paths_key_in_c() -> None:
    form = QueueKey(2**64 - 1, H).to_bytes()
    assert python_new_calls(lambda: QueueKey.from_bytes(form)) == 0
    assert both(lambda: QueueKey.from_bytes(form)) == ("value", QueueKey, (2**64 - 1, H), False)
    for data in (bytes(39), bytearray(40), "x" * 40):
        both(lambda data=data: QueueKey.from_bytes(data))  # the same errors
    with python_constructors():  # pure_python(): from_bytes through the Python __new__
        assert python_new_calls(lambda: QueueKey.from_bytes(form)) == 1


def test_from_bytes_honours_a_changed_class() -> None:
    form = QueueKey(7, H).to_bytes()

    def fake_new(cls: type, lt: int, hash_: bytes) -> str:
        return f"fake {lt}"

    with class_attribute(QueueKey, "__new__", fake_new):
        assert QueueKey.from_bytes(form) == "fake 7"
    assert QueueKey.from_bytes(form) == QueueKey(7, H)


@given(st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32))
def test_from_bytes_agrees_with_the_constructor(lt: int, hash_: bytes) -> None:
    key = QueueKey(lt, hash_)
    assert both(lambda: QueueKey.from_bytes(key.to_bytes()))[2] == (lt, hash_)


def test_values_are_the_python_constructors_values() -> None:
    key = both(lambda: QueueKey(7, H))
    assert key == ("value", QueueKey, (7, H), False)
    assert both(lambda: QueueKey(0, H))[2] == (0, H)
    assert both(lambda: QueueKey(2**64 - 1, H))[2] == (2**64 - 1, H)
    k = QueueKey(7, H)
    assert both(lambda: Message(k, A, B, b"body")) == (
        "value",
        Message,
        (k, A, B, b"body"),
        False,
    )
    assert both(lambda: Message(k, A, B))[2] == (k, A, B, b"")
    assert both(lambda: Message(k, A, B, body=b"kw"))[2] == (k, A, B, b"kw")
    assert both(lambda: QueueKey(lt=7, hash=H))[2] == (7, H)


class _Int(int):
    pass


class _Bytes(bytes):
    pass


class _Key(QueueKey):
    __slots__ = ()


class _Message(Message):
    __slots__ = ()


BAD_KEY_ARGS: list[tuple[Any, ...]] = [
    (-1, H),
    (2**64, H),
    (2**200, H),
    (-(2**70), H),
    (True, H),
    (1.0, H),
    ("1", H),
    (None, H),
    (7, H[:31]),
    (7, H + b"\x00"),
    (7, bytearray(H)),
    (7, memoryview(H)),
    (7, "x" * 32),
    (7,),
    (7, H, 1),
    (),
]


@pytest.mark.parametrize("args", BAD_KEY_ARGS, ids=repr)
def test_refused_keys_raise_as_the_python_constructor(args: tuple[Any, ...]) -> None:
    assert both(lambda: QueueKey(*args))[0] == "error"


def test_subclass_values_take_the_python_path_alike() -> None:
    # Accepted by the Python checks (isinstance), stored as given: the same here.
    assert both(lambda: QueueKey(_Int(7), H))[2] == (7, H)
    assert type(QueueKey(_Int(7), H).lt) is _Int
    assert type(QueueKey(7, _Bytes(H)).hash) is _Bytes
    both(lambda: QueueKey(7, _Bytes(H)))
    assert both(lambda: _Key(7, H))[1] is _Key
    k = QueueKey(7, H)
    assert both(lambda: _Message(k, A, B, b"x"))[1] is _Message
    assert both(lambda: Message(k, A, B, _Bytes(b"x")))[0] == "value"


BAD_MESSAGE_ARGS: list[tuple[Any, ...]] = [
    ((7, H), A, B, b""),
    (QueueKey(7, H), (0, b"\x11" * 32), B, b""),
    (QueueKey(7, H), A, None, b""),
    (QueueKey(7, H), A, B, "text"),
    (QueueKey(7, H), A, B, bytearray(b"x")),
    (QueueKey(7, H), A, B, None),
    (QueueKey(7, H), A),
    (QueueKey(7, H), A, B, b"", b""),
    (_Key(7, H), A, B, b""),
]


@pytest.mark.parametrize("args", BAD_MESSAGE_ARGS, ids=repr)
def test_refused_messages_raise_as_the_python_constructor(args: tuple[Any, ...]) -> None:
    assert both(lambda: Message(*args))[0] == "error"


def test_a_field_the_gc_tracks_keeps_the_message_tracked() -> None:
    """A QueueKey built by ``tuple.__new__`` is tracked by the cyclic GC; a message
    holding it must be too, as the Python constructor leaves it."""
    tracked = tuple.__new__(QueueKey, (7, H))
    assert gc.is_tracked(tracked)
    assert both(lambda: Message(tracked, A, B, b"x"))[3] is True


@given(
    lt=st.one_of(st.integers(min_value=-(2**65), max_value=2**65), st.booleans()),
    hash_=st.binary(min_size=30, max_size=34),
)
def test_keys_agree_on_any_int_and_bytes(lt: int, hash_: bytes) -> None:
    both(lambda: QueueKey(lt, hash_))


def test_values_survive_pickle_copy_and_super() -> None:
    k = QueueKey(9, H)
    m = Message(k, A, B, b"payload")
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert pickle.loads(pickle.dumps(m, protocol)) == m
        assert type(pickle.loads(pickle.dumps(k, protocol))) is QueueKey
    # namedtuple's own constructors, checked through the classes' constructors.
    assert QueueKey._make((9, H)) == k
    assert m._replace(body=b"other") == Message(k, A, B, b"other")
    assert type(m._replace(body=b"other")) is Message
    assert copy.copy(k) == k
    assert copy.deepcopy(m) == m
    assert QueueKey.__new__(QueueKey, 9, H) == k  # the Python __new__, called directly

    class Sub(QueueKey):
        __slots__ = ()

        def __new__(cls, lt: int) -> Sub:
            return super().__new__(cls, lt, H)

    assert Sub(9) == k
    assert type(Sub(9)) is Sub
    with pytest.raises(ValueError, match=r"QueueKey\.lt"):
        Sub(-1)


def test_no_reference_leaks_on_either_path() -> None:
    lt, hash_, body = 10**12 + 12345, bytes(31) + b"\x01", b"leak-check" * 3
    key = QueueKey(lt, hash_)
    before = [sys.getrefcount(o) for o in (lt, hash_, body, key, A, B)]
    form = key.to_bytes()
    for _ in range(2000):
        QueueKey(lt, hash_)
        QueueKey.from_bytes(form)
        with pytest.raises(ValueError):
            QueueKey.from_bytes(form[1:])
        Message(key, A, B, body)
        with pytest.raises(ValueError):
            QueueKey(-lt, hash_)
        with pytest.raises(ValueError):
            QueueKey(lt, hash_[1:])
        with pytest.raises(TypeError):
            Message(key, A, B, bytearray(body))
    after = [sys.getrefcount(o) for o in (lt, hash_, body, key, A, B)]
    assert after == before


def test_harmless_class_changes_leave_the_compiled_path_on() -> None:
    """Harmless changes to a class (the first read of ``__annotations__`` stores an
    empty dict in a class without annotations, as hypothesis's ``builds`` does; copyreg
    stores ``__slotnames__`` at the first pickle) leave the compiled path on."""
    assert Message.__annotations__ == {}
    assert Address.__annotations__ == {}
    k = QueueKey(7, H)
    pickle.loads(pickle.dumps(Message(k, A, B, b"x")))
    assert "__slotnames__" in Message.__dict__
    assert python_new_calls(lambda: Message(k, A, B, b"x")) == 0
    assert python_new_calls(lambda: QueueKey(7, H)) == 0


def test_set_constructors_takes_the_registered_classes_again() -> None:
    module = iterator._speedups_module
    with pytest.raises(TypeError):
        module.set_constructors(QueueKey.__new__)  # takes nothing: the registered classes
    # Installed again: still the compiled path, same values.
    module.set_constructors()
    assert python_new_calls(lambda: QueueKey(7, H)) == 0
    assert both(lambda: QueueKey(7, H))[2] == (7, H)


@contextmanager
def class_attribute(cls: type, name: str, value: Any) -> Iterator[None]:
    """``cls.name = value`` within the block; afterwards the attribute as it was."""
    saved = cls.__dict__.get(name)
    setattr(cls, name, value)
    try:
        yield
    finally:
        if saved is None:
            delattr(cls, name)
        else:
            setattr(cls, name, saved)


def test_a_class_changed_after_installation_is_called_as_python_would() -> None:
    """A ``__new__`` or ``__init__`` assigned to the class later (a mock, a patch) is
    honoured: the compiled path holds only while the class is as it was installed."""
    k = QueueKey(7, H)

    def fake_new(cls: type, lt: int, hash_: bytes) -> str:
        return f"fake {lt}"

    with class_attribute(QueueKey, "__new__", fake_new):
        assert QueueKey(7, H) == "fake 7"
    assert QueueKey(7, H) == k
    assert python_new_calls(lambda: QueueKey(7, H)) == 0  # the same __new__ again

    inits: list[tuple[Any, ...]] = []

    def recording_init(self: Message, *args: Any) -> None:
        inits.append(args)

    with class_attribute(Message, "__init__", recording_init):
        assert Message(k, A, B, b"x") == (k, A, B, b"x")
    assert inits == [(k, A, B, b"x")]
    assert python_new_calls(lambda: Message(k, A, B)) == 0


def test_the_types_alone_get_the_compiled_constructors() -> None:
    """A host that imports only the value types (to build diffs before, or without,
    loading the queue) gets the compiled constructors and deallocs too: ``imq.types``
    registers them, not the iterator (before, they came with ``imq.iterator``, and a
    bare import ran the Python ``__new__``, two to six times slower)."""
    code = (
        "import sys\n"
        "from imq.types import Message, QueueKey\n"
        "from imq._native import speedups\n"
        "assert 'imq.iterator' not in sys.modules\n"
        "assert speedups is not None\n"
        # each switch answers whether it was on
        "print(speedups.value_constructors(True), speedups.value_deallocs(True))\n"
    )
    root = str(Path(__file__).resolve().parents[2])  # this tree's imq, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    )
    assert done.stdout.split() == ["True", "True"], done.stdout + done.stderr
