"""Shared pieces of the tests that run vLLM itself (marker `vllm`): the interpreter check, the
CPU-build arguments, a perturbed learner checkpoint, and the reference forward pass.

vLLM runs from `.venv-vllm` (scripts/setup_vllm.sh); the tests themselves run in the project's
`.venv` and talk to it over HTTP, as the orchestrator does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# float32 so that vLLM's log-probs can be compared with a float32 transformers forward; a small
# context keeps the CPU build's KV cache small; eager mode skips torch.compile's C++ build of
# the model at start-up (minutes on two busy cores).
VLLM_TEST_ARGS = ("--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "32",
                  "--enforce-eager")
VLLM_STARTUP_S = 900.0   # a hang guard: vLLM's start-up takes about a minute on two busy cores


def require_vllm() -> str:
    """The Python with vLLM, or a failure that says how to build it."""
    from orchestrator.engines.launch import LaunchError, vllm_python

    try:
        return vllm_python()
    except LaunchError as exc:
        pytest.fail(f"{exc}. (`make test` builds it; deselect these tests with -m 'not vllm')")


def perturbed_copy(source: Path, target: Path, *, scale: float = 0.05, seed: int = 1) -> Path:
    """A learner-like checkpoint: every weight of `source` times (1 + scale * noise)."""
    from engine.checkpoint import load_model

    model = load_model(source)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + scale * torch.randn(p.shape, generator=generator))
    model.save_pretrained(str(target), safe_serialization=True)
    return target


class Reference:
    """The learner's view: a float32 transformers forward of each checkpoint, cached."""

    def __init__(self) -> None:
        self._models: dict[Path, torch.nn.Module] = {}

    def model(self, path: Path) -> torch.nn.Module:
        from engine.checkpoint import load_model

        if path not in self._models:
            self._models[path] = load_model(path).float().eval()
        return self._models[path]

    def logits(self, path: Path, prompt: list[int], sampled: list[int]) -> torch.Tensor:
        """(len(sampled), V) logits that predicted each sampled token."""
        ids = torch.tensor([prompt + sampled])
        with torch.no_grad():
            logits = self.model(path)(ids).logits[0].float()
        return logits[len(prompt) - 1: len(prompt) - 1 + len(sampled)]

    def token_logprobs(self, path: Path, prompt: list[int], sampled: list[int], *,
                       temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
                       ) -> torch.Tensor:
        """Log-prob of each sampled token under the processed distribution (T, top-k, top-p)."""
        from engine.sampling import processed_logprobs

        logits = self.logits(path, prompt, sampled)
        n = len(sampled)
        table = processed_logprobs(logits, torch.full((n,), float(temperature)),
                                   torch.full((n,), top_k), torch.full((n,), float(top_p)))
        return table.gather(1, torch.tensor(sampled).unsqueeze(1)).squeeze(1)
