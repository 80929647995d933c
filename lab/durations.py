"""A simple long-tail model of how long a trajectory takes to generate.

duration = length x per_token x slowdown, where slowdown = prompt_factor x U^(-1 / tail_index)
(a Pareto tail: most trajectories run near full speed, a few take many times longer, as tool
calls and long generations do), and prompt_factor = exp(difficulty_coupling x d_p) with
d_p in [0, 1] the prompt's difficulty rank (0 = the prompt with the highest expected reward,
1 = the lowest). Harder prompts therefore take longer, so an admission rule that drops slow
trajectories drops hard prompts more often: the selection bias the lab measures.

Guarantees: slowdown >= 1 (a trajectory never decodes faster than one token per time unit at
per_token = 1); the mean of the Pareto factor is tail_index / (tail_index - 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DurationModel:
    per_token: float = 1.0
    tail_index: float = 2.0
    difficulty_coupling: float = 1.0

    def __post_init__(self) -> None:
        if self.per_token <= 0:
            raise ValueError(f"per_token must be > 0, got {self.per_token}")
        if self.tail_index <= 1:
            raise ValueError(f"tail_index must be > 1 (a finite mean), got {self.tail_index}")
        if self.difficulty_coupling < 0:
            raise ValueError(f"difficulty_coupling must be >= 0, got {self.difficulty_coupling}")

    def prompt_factors(self, objective_P: torch.Tensor) -> torch.Tensor:
        """exp(coupling x difficulty rank) per prompt; rank from the expected rewards J_p."""
        count = objective_P.shape[0]
        if count == 1:
            return torch.ones(1, dtype=torch.float64)
        order = torch.argsort(objective_P.detach(), descending=True)
        rank_P = torch.empty(count, dtype=torch.float64)
        rank_P[order] = torch.arange(count, dtype=torch.float64) / (count - 1)
        return torch.exp(self.difficulty_coupling * rank_P)

    def slowdowns(self, prompt_ids_N: torch.Tensor, prompt_factors_P: torch.Tensor,
                  generator: torch.Generator) -> torch.Tensor:
        """Per-trajectory slowdown >= 1, shape (N,)."""
        uniform_N = torch.rand(prompt_ids_N.shape, generator=generator, dtype=torch.float64)
        pareto_N = uniform_N.clamp_min(1e-12).pow(-1.0 / self.tail_index)
        return prompt_factors_P[prompt_ids_N] * pareto_N

    def durations(self, lengths_N: torch.Tensor, slowdowns_N: torch.Tensor) -> torch.Tensor:
        return lengths_N.double() * self.per_token * slowdowns_N
