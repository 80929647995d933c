"""vLLM worker extension: reload a learner checkpoint into a running `vllm serve`.

Loaded inside vLLM's GPU worker through `vllm serve ... --worker-extension-cls
engine.vllm_ext.StalewiseWorkerExtension` (the launcher sets it, with this repository on
PYTHONPATH). Its methods are called through vLLM's development route `/collective_rpc`
(`VLLM_SERVER_DEV_MODE=1`), whose arguments arrive as strings:

    POST /collective_rpc {"method": "stalewise_load_checkpoint", "args": [PATH, VERSION]}
    POST /collective_rpc {"method": "stalewise_weights_version"}

`stalewise_load_checkpoint` streams every tensor of the HF checkpoint at PATH into the served
model through the model's own `load_weights` (which handles vLLM's fused/sharded layouts), waits
for the device, and records VERSION. It does not pause generation or drop KV: the client
pauses (`/pause?mode=keep` or `mode=wait`) before and resumes after, and resets the prefix cache
(preempting running requests for `kv=recompute`). Nothing here imports vllm at module level.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs of an HF safetensors checkpoint directory, one shard at a time."""
    from safetensors import safe_open

    directory = Path(path)
    if (directory / "model.safetensors").is_file():
        files = [directory / "model.safetensors"]
    elif (directory / "model.safetensors.index.json").is_file():
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        files = [directory / name for name in sorted(set(index["weight_map"].values()))]
    else:
        raise FileNotFoundError(f"{directory} has no model.safetensors(.index.json)")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


class StalewiseWorkerExtension:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's model runner."""

    model_runner: Any

    def stalewise_load_checkpoint(self, path: str, version: str) -> dict[str, Any]:
        import torch

        self.model_runner.model.load_weights(weights=checkpoint_tensors(path))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.stalewise_version = int(version)
        return {"version": int(version), "path": str(path)}

    def stalewise_weights_version(self) -> int:
        default = int(os.environ.get("STALEWISE_INITIAL_VERSION", "0"))
        return int(getattr(self, "stalewise_version", default))
