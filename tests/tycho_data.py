"""Where the real tycho test files are: ``tests/data/tycho`` inside the repository.

They are copies of broxus/tycho's test data (MIT OR Apache-2.0); ``tests/data/tycho/README.md``
gives their provenance and sha256 sums. ``IMQ_TYCHO_DATA`` may point elsewhere for a
one-off run. A missing directory is an error, never a skip: these files are what the
state format is checked against.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IN_REPO = REPO / "tests" / "data" / "tycho"


def _locate() -> Path:
    override = os.environ.get("IMQ_TYCHO_DATA")
    path = Path(override) if override else IN_REPO
    if not (path / "persistent_state" / "shard.bin").is_file():
        raise FileNotFoundError(
            f"the real tycho files are not at {path}; they ship in tests/data/tycho "
            "(restore them from git) or set IMQ_TYCHO_DATA to such a directory"
        )
    return path


TYCHO = _locate()
