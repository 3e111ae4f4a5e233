"""The facade's signatures say what API.md says: precise types, no ``Any`` where a
precise type exists (``summary`` is a JSON document and stays ``dict[str, Any]``)."""

from __future__ import annotations

import inspect
import typing
from typing import Any

from imq import Address, Queue, QueueKey


def test_statistics_reads_return_address_keyed_maps() -> None:
    assert typing.get_type_hints(Queue.load_diff_statistics)["return"] == dict[Address, int]
    assert (
        typing.get_type_hints(Queue.load_separated_diff_statistics)["return"]
        == dict[int, dict[QueueKey, dict[Address, int]]]
    )


def _mentions_any(hint: object) -> bool:
    return hint is Any or any(_mentions_any(arg) for arg in typing.get_args(hint))


def test_no_public_queue_method_uses_any() -> None:
    offenders = []
    for name, member in inspect.getmembers(Queue, inspect.isfunction):
        if name.startswith("_") or name == "summary":
            continue
        for param, hint in typing.get_type_hints(member).items():
            if _mentions_any(hint):
                offenders.append(f"{name}: {param}")
    assert offenders == []
