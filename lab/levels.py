"""Mismatch kinds and the levels each accepts (no torch: the config loader checks levels).

`NEUTRAL_LEVEL[kind]` is the level at which the sampler equals the trainer (on-policy).
"""

from __future__ import annotations

import math
from typing import Literal

MismatchKind = Literal["none", "stale", "drift", "temperature", "top_k", "top_p", "logit_noise",
                       "prefix_switch", "duration_drop"]

NEUTRAL_LEVEL: dict[str, float] = {"none": 0.0, "stale": 0.0, "drift": 0.0, "temperature": 1.0,
                                   "top_k": 0.0, "top_p": 1.0, "logit_noise": 0.0,
                                   "prefix_switch": 0.0, "duration_drop": 0.0}


def check_level(kind: str, level: float, vocab_size: int) -> str | None:
    """A message saying what is wrong with `level` for `kind`, or None when it is valid."""
    if kind in ("stale", "prefix_switch") and (level < 0 or level != int(level)):
        return f"{kind} levels count updates: use whole numbers >= 0 (got {level})"
    if kind in ("drift", "logit_noise") and level < 0:
        return f"{kind} levels are norms / standard deviations: use values >= 0 (got {level})"
    if kind == "temperature" and level <= 0:
        return f"temperature levels must be > 0 (got {level})"
    if kind == "top_k" and (level != int(level) or not 0 <= level <= vocab_size):
        return f"top_k levels must be whole numbers in 0..{vocab_size} (0 = off) (got {level})"
    if kind == "top_p" and not 0 < level <= 1:
        return f"top_p levels must be in (0, 1] (1 = off) (got {level})"
    if kind == "duration_drop" and not 0 <= level < 1:
        return f"duration_drop levels are the fraction dropped, in [0, 1) (got {level})"
    if kind == "none" and level != 0:
        return f"mismatch 'none' has the single level 0 (got {level})"
    return None


def mismatch_strength(kind: str, level: float) -> float:
    """How far `level` is from on-policy, for ordering levels (0 = on-policy)."""
    if kind == "temperature":
        return abs(math.log(level))
    if kind == "top_k":
        return 0.0 if level == 0 else 1.0 / level
    if kind == "top_p":
        return 1.0 - level
    return float(level)
