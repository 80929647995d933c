"""Build the lab's policy, starting parameters and reward from the config.

Guarantees: the same config and horizon give the same logits and reward tables (seeded
generators); the reward tables do not depend on the horizon, so rows at different T measure
the same task at a different length; with 0 < terminal_success < 1 every prompt has final
states that succeed and states that fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.config import PolicySection, RewardSection
from lab.policy import ChainReward, ChainSpec, init_logits


@dataclass(frozen=True)
class World:
    spec: ChainSpec
    theta_P_S_V: torch.Tensor
    reward: ChainReward


def build_reward(spec: ChainSpec, section: RewardSection) -> ChainReward:
    gen = torch.Generator().manual_seed(section.seed)
    p, s, v = spec.shape
    scale_P = (torch.tensor(section.prompt_scale, dtype=torch.float64)
               if section.prompt_scale is not None else torch.ones(p, dtype=torch.float64))
    success_P_S = _successes(spec, section.terminal_success, gen)
    terminal_P_S = (section.terminal * success_P_S + section.constant) * scale_P[:, None]
    token_noise = torch.randn(p, s, v, generator=gen, dtype=torch.float64)
    token_P_S_V = (section.per_token * token_noise * scale_P[:, None, None]
                   if section.per_token else None)
    truncation_P = section.truncation * scale_P if section.truncation else None
    pattern = tuple(section.pattern) if section.pattern_weight and section.pattern else ()
    weight_P = section.pattern_weight * scale_P if pattern else None
    reward = ChainReward(token_P_S_V=token_P_S_V, terminal_P_S=terminal_P_S,
                         truncation_P=truncation_P, pattern=pattern, pattern_weight_P=weight_P)
    reward.check(spec)
    return reward


def _successes(spec: ChainSpec, share: float, gen: torch.Generator) -> torch.Tensor:
    """0/1 per (prompt, final state): a random `share` of the states a response can end in
    (content tokens and the start state) succeed; at least one succeeds and one fails unless
    share is exactly 0 or 1, so the reward is never accidentally constant."""
    finals = list(range(spec.content_vocab)) + [spec.start_state]
    count = round(share * len(finals))
    if 0 < share < 1:
        count = min(max(count, 1), len(finals) - 1)
    table = torch.zeros(spec.num_prompts, spec.num_states, dtype=torch.float64)
    for p in range(spec.num_prompts):
        order = torch.randperm(len(finals), generator=gen)[:count]
        table[p, [finals[i] for i in order.tolist()]] = 1.0
    return table


def build_world(policy: PolicySection, reward: RewardSection, horizon: int) -> World:
    spec = ChainSpec(vocab_size=policy.vocab_size, horizon=horizon,
                     num_prompts=policy.num_prompts, stop_token=policy.stop_token)
    gen = torch.Generator().manual_seed(policy.seed)
    theta = init_logits(spec, scale=policy.init_scale, length_fraction=policy.length_fraction,
                        generator=gen)
    return World(spec, theta, build_reward(spec, reward))
