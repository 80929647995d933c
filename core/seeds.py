"""Seeds derived from a base seed and a few labels, for requests that must draw the same
samples whatever else is going on (an evaluation's model calls: see orchestrator/evaluate.py).

`derived_seed(7, "test", 12, 3)` is a fixed function of its parts (a hash, not Python's `hash`,
which varies between processes), in 0..2**63-1 like every seed of a job, and unrelated to the
seed of any other parts.
"""

from __future__ import annotations

import hashlib


def derived_seed(*parts: int | str) -> int:
    text = "\x1f".join(str(part) for part in parts)
    digest = hashlib.blake2b(text.encode(), digest_size=8, person=b"stalewise-seed").digest()
    return int.from_bytes(digest, "little") >> 1
