"""The trainer's models: the policy (any local HF causal LM) and the optional critic.

Position convention (the "shifted" space every loss works in): for a sequence of T tokens the
logits at position t predict token t + 1, so per-token quantities have length T - 1 and entry
j describes token j + 1 of the sequence. `policy_outputs` returns the logits of positions
0 .. T-2, their logsumexp and the log-probabilities of tokens 1 .. T-1, in float32 whatever
the dtype of the products.

Weights are float32 (the master copy the optimizer updates); `Precision` runs the products in
bfloat16 where `[learner] dtype` chose it (torch autocast: matrix products in bfloat16,
reductions and norms in float32), so gradients and optimizer state stay float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from core.numerics import Dtype, DtypeSetting, model_width, resolve_dtype


@dataclass(frozen=True)
class Precision:
    """The dtype of a learner's products, resolved for this machine and model."""

    dtype: Dtype
    device: str = "cpu"

    @classmethod
    def resolve(cls, setting: DtypeSetting, model_dir: str | Path, device: str = "cpu"
                ) -> Precision:
        return cls(resolve_dtype(setting, hidden_size=model_width(model_dir), device=device),
                   device)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Forward (and the backward of what it builds) in this precision."""
        device_type = torch.device(self.device).type
        with torch.autocast(device_type, dtype=torch.bfloat16,
                            enabled=self.dtype == "bfloat16"):
            yield


def load_policy(path: str | Path, device: str = "cpu") -> nn.Module:
    """The float32 causal LM of checkpoint `path` on `device`."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path} is not a Hugging Face checkpoint (no config.json); create "
            f"the tiny model with `stalewise model init-tiny {path}`"
        )
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.to(device)


@dataclass(frozen=True)
class PolicyOutputs:
    """The policy on the shifted positions of (B, T) input ids: entry j is about token j + 1."""

    logits_B_Tm1_V: torch.Tensor  # (B, T-1, V) float32, position j predicts token j + 1
    logsumexp_B_Tm1: torch.Tensor  # (B, T-1)
    logprobs_B_Tm1: torch.Tensor  # (B, T-1) log pi(token j + 1 | tokens <= j)


def policy_outputs(
    model: nn.Module, input_ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor
) -> PolicyOutputs:
    logits = (
        model(input_ids=input_ids_B_T, attention_mask=attention_mask_B_T, use_cache=False)
        .logits[:, :-1]
        .float()
    )
    lse = torch.logsumexp(logits, -1)
    targets = input_ids_B_T[:, 1:]
    logprobs = logits.gather(-1, targets[..., None]).squeeze(-1) - lse
    return PolicyOutputs(logits, lse, logprobs)


class ValueModel(nn.Module):
    """A critic: the policy checkpoint's trunk with a zero-initialised scalar head.

    forward returns values (B, T-1) in the shifted space: entry j is V(state before token j+1).
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        from transformers import AutoModel

        self.trunk = AutoModel.from_pretrained(str(path), dtype=torch.float32)
        hidden = self.trunk.config.hidden_size
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(
        self, input_ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.trunk(
            input_ids=input_ids_B_T, attention_mask=attention_mask_B_T, use_cache=False
        ).last_hidden_state
        return self.head(hidden[:, :-1].float()).squeeze(-1)
