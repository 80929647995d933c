"""Load Hugging Face checkpoint directories for the embedded engine.

A checkpoint directory is what `save_pretrained` writes: `config.json` plus `model.safetensors`
(or shards listed in `model.safetensors.index.json`). The learner publishes every policy
version this way. Guarantees:

- `load_model` returns a float32 (or the asked bfloat16) causal LM in eval mode on CPU, or
  raises `CheckpointError` saying which file is missing or which architecture is unsupported.
- `read_state_dict` returns float32 tensors keyed like the model's own parameters, after
  checking that every parameter the model has is present with the same shape and that the
  checkpoint holds nothing the model does not; a mismatch names the tensor and the two shapes.
  Tied output embeddings (`lm_head.weight` absent) are accepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory cannot be served: missing files, wrong shapes, unsupported model."""


def _check_dir(directory: Path) -> None:
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist; create one with "
                              f"`stalewise model init-tiny {directory}` or point at a saved model")
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory} has no config.json; is it a Hugging Face checkpoint?")
    if not (directory / WEIGHTS_FILE).is_file() and not (directory / WEIGHTS_INDEX).is_file():
        raise CheckpointError(f"{directory} has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX}; save "
                              f"it with `model.save_pretrained(dir, safe_serialization=True)`")


def read_config(directory: str | Path) -> dict:
    directory = Path(directory)
    _check_dir(directory)
    config = json.loads((directory / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{directory}: model_type {model_type!r} is not supported by the "
                              f"embedded engine (supported: {', '.join(SUPPORTED_MODEL_TYPES)}); "
                              f"serve it with vLLM instead")
    return config


def load_model(directory: str | Path, dtype: str = "float32") -> PreTrainedModel:
    """The checkpoint as an eval-mode causal LM on CPU, in `dtype` ("float32" or "bfloat16")."""
    import torch
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    read_config(directory)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=getattr(torch, dtype))
    model.eval()
    model.requires_grad_(False)
    return model


def _safetensor_files(directory: Path) -> list[Path]:
    if (directory / WEIGHTS_FILE).is_file():
        return [directory / WEIGHTS_FILE]
    index = json.loads((directory / WEIGHTS_INDEX).read_text())
    return [directory / name for name in sorted(set(index["weight_map"].values()))]


def read_state_dict(directory: str | Path, model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Float32 tensors of `directory`, validated against `model`'s parameters."""
    import torch
    from safetensors.torch import load_file

    directory = Path(directory)
    _check_dir(directory)
    loaded: dict[str, torch.Tensor] = {}
    for path in _safetensor_files(directory):
        if not path.is_file():
            raise CheckpointError(f"{directory}: shard {path.name} listed in {WEIGHTS_INDEX} is missing")
        loaded.update(load_file(str(path)))
    expected = dict(model.named_parameters())
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in loaded.items():
        if name not in expected:
            if tied and name == "lm_head.weight":
                continue
            raise CheckpointError(f"{directory}: tensor {name!r} does not exist in the served model "
                                  f"({model.config.model_type}); was it saved from another architecture?")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{directory}: tensor {name!r} has shape {tuple(tensor.shape)}, the "
                                  f"served model has {tuple(expected[name].shape)}; restart the engine "
                                  f"to change the architecture")
        out[name] = tensor.to(torch.float32)
    missing = [name for name in expected if name not in out
               and not (tied and name == "lm_head.weight")]
    if missing:
        raise CheckpointError(f"{directory}: missing {len(missing)} tensors, e.g. {missing[0]!r}")
    return out


def assign_state_dict(model: PreTrainedModel, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into `model`'s parameters in place (the storage, and so every view, is kept)."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


def eos_token_ids(directory: str | Path, model: PreTrainedModel) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's, else config.json's (vLLM does the same)."""
    ids: object = None
    gen_path = Path(directory) / "generation_config.json"
    if gen_path.is_file():
        ids = json.loads(gen_path.read_text()).get("eos_token_id")
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None:
        return ()
    return tuple(int(i) for i in (ids if isinstance(ids, list) else [ids]))
