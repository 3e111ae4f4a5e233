"""Where the real tycho test files are: ``../shared/data/tycho`` beside the checkout.

``IMQ_TYCHO_DATA`` overrides it (a checkout placed elsewhere). A missing directory is an
error, never a skip: these files are what the state format is checked against.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _locate() -> Path:
    override = os.environ.get("IMQ_TYCHO_DATA")
    path = Path(override) if override else REPO.parent / "shared" / "data" / "tycho"
    if not (path / "persistent_state" / "shard.bin").is_file():
        raise FileNotFoundError(
            f"the real tycho files are not at {path}; put the project's shared/ folder "
            "beside the checkout or set IMQ_TYCHO_DATA to its data/tycho directory"
        )
    return path


TYCHO = _locate()
