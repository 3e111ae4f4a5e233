"""The real tycho files in tests/data/tycho are the bytes their README vouches for."""

from __future__ import annotations

import hashlib
import re

import pytest
from tycho_data import IN_REPO

_SUM = re.compile(r"^([0-9a-f]{64})  (\S+)$")


def _listed() -> list[tuple[str, str]]:
    text = (IN_REPO / "README.md").read_text()
    return [(m[2], m[1]) for line in text.splitlines() if (m := _SUM.match(line))]


def test_readme_lists_every_file_once() -> None:
    listed = [name for name, _ in _listed()]
    on_disk = sorted(
        str(p.relative_to(IN_REPO))
        for p in IN_REPO.rglob("*")
        if p.is_file() and p.name != "README.md"
    )
    assert len(listed) == len(set(listed)) == 16
    assert sorted(listed) == on_disk


@pytest.mark.parametrize(("name", "digest"), _listed())
def test_file_matches_its_sha256(name: str, digest: str) -> None:
    assert hashlib.sha256((IN_REPO / name).read_bytes()).hexdigest() == digest
