"""``imq/__init__.py`` loads its public names on first use (PEP 562): its name list, its
map of lazy names and what each name resolves to must agree, since the type checker
reads the imports under ``TYPE_CHECKING`` and the interpreter reads the map."""

from __future__ import annotations

import importlib
import subprocess
import sys
import uuid
from pathlib import Path

from mypy import api as mypy_api

import imq


def test_every_public_name_is_lazy_and_resolves_to_its_module() -> None:
    assert set(imq.__all__) == set(imq._LAZY)
    for name, module in imq._LAZY.items():
        assert getattr(imq, name) is getattr(importlib.import_module(module), name)


def test_import_imq_loads_no_submodule_and_star_import_gets_every_name() -> None:
    code = (
        "import sys, imq\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('imq.'))\n"
        "ns = {}\n"
        "exec('from imq import *', ns)\n"
        "print(loaded, sorted(set(imq.__all__) - set(ns)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[] []", done.stdout + done.stderr


def test_a_misspelt_top_level_name_is_a_type_error(tmp_path: Path) -> None:
    """A module-level ``__getattr__`` that type checkers can see makes every unknown
    ``imq.X`` an ``Any``: ``mypy --strict`` then accepted ``from imq import QueueConfg``
    and ``imq.Queu.open(...)``, which fail only when run (an outside audit)."""
    # A module name of its own each run: mypy's cache keeps a module by its name, and a
    # second run of the same file under another directory was taken for the cached one,
    # whose errors it did not all report again (seen in `make test`).
    user = tmp_path / f"user_{uuid.uuid4().hex}.py"
    user.write_text(
        "import imq\n"
        "from imq import QueueConfg\n"
        "def open_it(path: str) -> None:\n"
        "    imq.Queu.open(path)\n"
        "    imq.Queue.open(path).close()\n"
    )
    cache = Path(__file__).resolve().parents[2] / ".mypy_cache"  # make typecheck's, when there
    report, errors, status = mypy_api.run(
        ["--strict", "--cache-dir", str(cache), "--no-error-summary", str(user)]
    )
    lines = sorted(
        line.split(": error: ")[0] for line in report.splitlines() if ": error: " in line
    )
    assert lines == [f"{user}:2", f"{user}:4"], report + errors
    assert status == 1


def test_every_error_class_is_in_the_errors_module_names() -> None:
    """``from imq.errors import *`` gives every error ``docs/api.md`` lists there."""
    errors = importlib.import_module("imq.errors")
    classes = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type)
        and issubclass(value, errors.ImqError)
        and value.__module__ == "imq.errors"
        and not name.startswith("_")
    }
    assert classes <= set(errors.__all__), sorted(classes - set(errors.__all__))
    assert set(errors.__all__) <= set(imq.__all__)
