"""``imq/__init__.py`` loads its public names on first use (PEP 562): its name list, its
map of lazy names and what each name resolves to must agree, since the type checker
reads the imports under ``TYPE_CHECKING`` and the interpreter reads the map."""

from __future__ import annotations

import importlib
import subprocess
import sys

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
