"""Fixtures for engine tests: tiny checkpoints (v0 and perturbed v1, v2) and an HF reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SHARP_INIT = 0.2  # peaked next-token distributions, so top-k/top-p actually remove mass


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models: one intra-op thread is fastest, and on a busy 2-core machine extra OpenMP
    threads spin against other processes (a 170-token forward goes from 6 ms to 250 ms)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def perturbed_copy(source: Path, target: Path, seed: int, scale: float = 0.02) -> Path:
    """A new version of `source`'s weights (as the learner would publish): weights + noise."""
    from engine.checkpoint import load_model

    model = load_model(source)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    model.save_pretrained(str(target), safe_serialization=True)
    return target


@pytest.fixture(scope="session")
def make_version():
    """`make_version(source, target, seed)`: publish perturbed weights as a new checkpoint."""
    return perturbed_copy


@pytest.fixture(scope="session")
def model_v0(tmp_path_factory) -> Path:
    from engine.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("tiny") / "v0", seed=0, initializer_range=SHARP_INIT)


@pytest.fixture(scope="session")
def model_v1(model_v0, tmp_path_factory) -> Path:
    return perturbed_copy(model_v0, tmp_path_factory.mktemp("tiny") / "v1", seed=1)


@pytest.fixture(scope="session")
def model_v2(model_v1, tmp_path_factory) -> Path:
    return perturbed_copy(model_v1, tmp_path_factory.mktemp("tiny") / "v2", seed=2)


class Reference:
    """The learner's recomputation: a plain HF forward over the whole sequence, float32, CPU."""

    def __init__(self) -> None:
        self._models: dict[Path, torch.nn.Module] = {}

    def model(self, directory: Path) -> torch.nn.Module:
        if directory not in self._models:
            from engine.checkpoint import load_model

            self._models[directory] = load_model(directory)
        return self._models[directory]

    def raw_logprobs(self, directory: Path, prompt: list[int], sampled: list[int]) -> torch.Tensor:
        """(T, V) log-softmax of the logits that predicted each sampled token."""
        ids = torch.tensor([list(prompt) + list(sampled)])
        with torch.no_grad():
            logits = self.model(directory)(ids).logits[0].float()
        return torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(sampled)], dim=-1)

    def token_logprobs(self, directory: Path, prompt: list[int], sampled: list[int]) -> torch.Tensor:
        raw = self.raw_logprobs(directory, prompt, sampled)
        return raw.gather(1, torch.tensor(sampled).unsqueeze(1)).squeeze(1)


@pytest.fixture(scope="session")
def reference() -> Reference:
    return Reference()
