"""What a tiny default model's folder says about itself: the seed it was made with.

`engine.tiny.init_tiny` writes `TINY_SEED_FILE` beside the checkpoint; the job reads it with
`tiny_seed` (`orchestrator.job.ensure_model`) to tell whether the tiny model on disk is the one
its own seed would make. The weights are a function of the seed alone.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_SEED_FILE = "stalewise-tiny.json"  # {"seed": N}, beside config.json


def tiny_seed(directory: str | Path) -> int | None:
    """The seed the tiny model in `directory` was made with; None for any other checkpoint (or a
    tiny model made before the seed was recorded)."""
    try:
        return int(json.loads((Path(directory) / TINY_SEED_FILE).read_text())["seed"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_tiny_seed(directory: str | Path, seed: int) -> None:
    (Path(directory) / TINY_SEED_FILE).write_text(json.dumps({"seed": seed}) + "\n")
