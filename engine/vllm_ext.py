"""vLLM worker extension: reload a learner checkpoint into a running `vllm serve`.

Loaded inside vLLM's GPU worker through `vllm serve ... --worker-extension-cls
engine.vllm_ext.StalewiseWorkerExtension` (the launcher sets it, with this repository on
PYTHONPATH). Its methods are called through vLLM's development route `/collective_rpc`
(`VLLM_SERVER_DEV_MODE=1`), whose arguments arrive as strings:

    POST /collective_rpc {"method": "stalewise_load_checkpoint", "args": [PATH, VERSION]}
    POST /collective_rpc {"method": "stalewise_weights_version"}

`stalewise_load_checkpoint` streams every tensor of the HF checkpoint at PATH into the served
model and records VERSION. Where the worker has vLLM's in-place reload (`reload_weights`,
vLLM 0.32 has it; the CPU build needs it, whose linear layers repack their weights after loading
and leave empty parameters behind), it goes through that: the checkpoint-format tensors are
loaded layer by layer and processed into the kernel format again. Otherwise the model's own
`load_weights` (which handles vLLM's fused/sharded layouts). It waits for the device.
It does not pause generation or drop KV: the client pauses (`/pause?mode=keep` or `mode=wait`)
before and resumes after, and resets the prefix cache (preempting running requests for
`kv=recompute`). Nothing here imports vllm at module level.
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


def refresh_cpu_gemm(model: Any) -> None:
    """Re-pack the CPU build's GEMM kernels of layers that keep their weight (the embedding and
    a tied LM head): their packed copy is made once, after loading, and a reload that gives the
    tied head no checkpoint tensor of its own does not re-pack it. No-op on GPU builds."""
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except ImportError:
        return
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (hasattr(module, "cpu_linear") and weight is not None and weight.ndim == 2
                and weight.numel() > 0):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


class StalewiseWorkerExtension:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's model runner."""

    model_runner: Any

    def stalewise_load_checkpoint(self, path: str, version: str) -> dict[str, Any]:
        import torch

        reload = getattr(self, "reload_weights", None)
        if reload is not None:
            reload(weights_iterator=checkpoint_tensors(path), is_checkpoint_format=True)
            refresh_cpu_gemm(self.model_runner.model)
        else:
            self.model_runner.model.load_weights(weights=checkpoint_tensors(path))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.stalewise_version = int(version)
        return {"version": int(version), "path": str(path)}

    def stalewise_weights_version(self) -> int:
        default = int(os.environ.get("STALEWISE_INITIAL_VERSION", "0"))
        return int(getattr(self, "stalewise_version", default))
