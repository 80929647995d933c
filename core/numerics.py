"""Which float type a model's matrix products run in, chosen from what the CPU can do.

`[engine] dtype` and `[learner] dtype` take `"auto"`, `"float32"` or `"bfloat16"`.
`resolve_dtype` turns `"auto"` into one of the other two, read at run time, never assumed:

- on CUDA, bfloat16;
- on a CPU with bfloat16 instructions (`amx_bf16` or `avx512_bf16` in /proc/cpuinfo's flags),
  bfloat16 for a model of at least `BF16_MIN_HIDDEN` hidden units;
- float32 otherwise: a CPU without those instructions emulates bfloat16 products (slower than
  float32), and below that width a product is too small for the conversions to pay
  (`bench/engine.py --dtype` measures both on the tiny model and on SmolLM2).

`cpu_facts` names the CPU and its bfloat16 instructions for the run's record (the engine's
`/stalewise/info` and the learner's numerics). Nothing here imports torch.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Literal

DtypeSetting = Literal["auto", "float32", "bfloat16"]
Dtype = Literal["float32", "bfloat16"]
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
BF16_MIN_HIDDEN = 512


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    path = Path("/proc/cpuinfo")
    if not path.is_file():
        return "unknown", frozenset()
    name, flags = "unknown", frozenset[str]()
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == "unknown":
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = frozenset(value.split())
    return name, flags


def cpu_bf16_instructions() -> tuple[str, ...]:
    """The CPU's bfloat16 instructions among `BF16_FLAGS` (empty: none)."""
    return tuple(flag for flag in BF16_FLAGS if flag in _cpuinfo()[1])


def cpu_facts() -> dict[str, object]:
    """The CPU's name and its bfloat16 instructions, for a run's record."""
    return {"cpu": _cpuinfo()[0], "cpu_bf16": list(cpu_bf16_instructions())}


def model_width(model_dir: str | Path) -> int:
    """`hidden_size` from a checkpoint's config.json (0 where there is none to read)."""
    config = Path(model_dir) / "config.json"
    return int(json.loads(config.read_text()).get("hidden_size", 0)) if config.is_file() else 0


def resolve_dtype(setting: DtypeSetting, *, hidden_size: int, device: str = "cpu",
                  bf16_instructions: tuple[str, ...] | None = None) -> Dtype:
    """`setting` with `"auto"` decided for this machine and model (see module docstring);
    `bf16_instructions` replaces the CPU's own flags (tests)."""
    if setting != "auto":
        return setting
    if device.startswith("cuda"):
        return "bfloat16"
    flags = cpu_bf16_instructions() if bf16_instructions is None else bf16_instructions
    return "bfloat16" if flags and hidden_size >= BF16_MIN_HIDDEN else "float32"
