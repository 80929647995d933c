"""Controlled mismatch between the sampler mu and the trainer pi_theta.

Each kind builds the sampler's parameter tables (and engine processing) from the trainer's
logits theta at a numeric `level`; level 0 (or temperature 1, top-k 0, top-p 1) is on-policy:

- `stale`:         mu = pi at parameters `level` updates old. The trainer is reached from the
                   sampler by `level` normalised ascent steps on the exact J, each of Frobenius
                   norm `step_norm`; we walk them backwards from theta (the trainer stays fixed
                   across levels, so every level is compared against the same grad J).
- `drift`:         mu = pi at theta + delta, delta a fixed random direction of norm `level`.
- `temperature` / `top_k` / `top_p`: the engine's processing of theta's logits at that value;
                   the recorded sampler log-probs are those of the processed distribution.
- `logit_noise`:   mu's logits = theta + level * eps, eps ~ N(0, 1) fixed per table entry (a
                   stand-in for quantisation and kernel differences).
- `prefix_switch`: retained-KV-style: each sequence is sampled with parameters `level` updates
                   old up to a switch position drawn uniformly from 1..T, then with the
                   trainer's parameters, optionally still off by `kv_residual` of the old ones
                   (the retained KV keeps part of the old computation).
- `duration_drop`: on-policy sampling, then an admission rule drops trajectories whose
                   duration exceeds the (1 - level) quantile of the duration distribution;
                   duration grows with length and with prompt difficulty (`lab.durations`).

Guarantees: the same generator state gives the same sampler; every kind at its neutral level
gives mu = pi exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.levels import NEUTRAL_LEVEL, check_level
from lab.policy import ChainReward, ChainSpec, exact_gradient
from lab.sampler import Processing


@dataclass(frozen=True)
class SamplerSetup:
    """The sampler's tables and processing; `switch` says how positions pick a table."""

    logits_W_P_S_V: torch.Tensor
    processing: Processing
    switch: bool = False

    def table_ids(self, n: int, horizon: int, generator: torch.Generator) -> torch.Tensor:
        """Table of each position, (N, T): all 0, or 0 before a uniform switch in 1..T, then 1."""
        if not self.switch:
            return torch.zeros(n, horizon, dtype=torch.long)
        switch_N = torch.randint(1, horizon + 1, (n,), generator=generator)
        return (torch.arange(horizon).unsqueeze(0) >= switch_N.unsqueeze(1)).long()


def stale_logits(theta_P_S_V: torch.Tensor, spec: ChainSpec, reward: ChainReward, updates: int,
                 step_norm: float) -> torch.Tensor:
    """Parameters `updates` normalised exact-gradient ascent steps before theta."""
    current = theta_P_S_V.detach().clone()
    for _ in range(updates):
        _, grad = exact_gradient(current, spec, reward)
        norm = float(grad.norm())
        if norm < 1e-12:
            raise ValueError("mismatch 'stale' walks back along grad J, which is zero for this "
                             "reward (e.g. a constant reward); use mismatch 'drift' instead")
        current = current - step_norm * grad / norm
    return current


def _reachable_mask(spec: ChainSpec, dtype: torch.dtype) -> torch.Tensor:
    """1 on rows of states that responses can be in (every state but the stop state)."""
    mask = torch.ones(spec.shape, dtype=dtype)
    if spec.stop_id is not None:
        mask[:, spec.stop_id] = 0
    return mask


def random_direction(spec: ChainSpec, generator: torch.Generator,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A unit-norm random direction over the reachable rows of the logit table."""
    direction = torch.randn(spec.shape, generator=generator, dtype=dtype)
    direction = direction * _reachable_mask(spec, dtype)
    return direction / direction.norm()


def build_sampler(kind: str, level: float, theta_P_S_V: torch.Tensor, spec: ChainSpec,
                  reward: ChainReward, generator: torch.Generator, *, step_norm: float = 0.5,
                  kv_residual: float = 0.0) -> SamplerSetup:
    """The sampler for mismatch `kind` at `level` against trainer logits theta."""
    problem = check_level(kind, level, spec.vocab_size)
    if problem:
        raise ValueError(problem)
    theta = theta_P_S_V.detach()
    plain = Processing()
    if kind in ("none", "duration_drop"):
        return SamplerSetup(theta.unsqueeze(0), plain)
    if kind == "stale":
        old = stale_logits(theta, spec, reward, int(level), step_norm)
        return SamplerSetup(old.unsqueeze(0), plain)
    if kind == "drift":
        return SamplerSetup((theta + level * random_direction(spec, generator)).unsqueeze(0),
                            plain)
    if kind == "logit_noise":
        noise = torch.randn(spec.shape, generator=generator, dtype=theta.dtype)
        return SamplerSetup((theta + level * noise).unsqueeze(0), plain)
    if kind == "temperature":
        return SamplerSetup(theta.unsqueeze(0), Processing(temperature=level))
    if kind == "top_k":
        return SamplerSetup(theta.unsqueeze(0), Processing(top_k=int(level)))
    if kind == "top_p":
        return SamplerSetup(theta.unsqueeze(0), Processing(top_p=level))
    if kind == "prefix_switch":
        old = stale_logits(theta, spec, reward, int(level), step_norm)
        after = theta + kv_residual * (old - theta)
        return SamplerSetup(torch.stack([old, after]), plain, switch=True)
    raise ValueError(f"unknown mismatch kind {kind!r}; use one of {sorted(NEUTRAL_LEVEL)}")
