"""The per-turn credit lab: rewards that arrive turn by turn, and which baseline keeps the
gradient unbiased.

The world: the lab's policy with a reward at every token (`per_token`, N(0, 1) draws per
prompt, state and token, scaled, plus a constant `turn_mean` per turn: a cost when negative)
and the 0/1 terminal reward, one world per entry of `turn_means`; each token is one turn, so a
response's per-turn rewards are its token rewards with the terminal (and truncation) reward on
its last turn. Responses are sampled on policy in groups. Three advantages feed the learner's
REINFORCE loss (sum over turns, mean over responses):

- `outcome`: every turn gets the response's total reward minus the RLOO group baseline (the
  outcome-only estimator; unbiased, ignores when rewards came);
- `leave_one_out`: reward still to come minus the other members' reward still to come at the
  same turn (`learner.advantages.turn_advantages`; unbiased);
- `turn_index_normalised`: each turn's reward z-scored among the members that reached that
  turn, then summed to the end (verl RFC 7244's variant; biased).

Rows carry `advantage`, `bias`, `bias_se`, `bias_z`, `variance`, `mse`, `cosine` against the
exact grad J (`lab.stats`), and the length push: <E[g], grad E[L]> / ||grad E[L]|| for the
estimator (`length_push`) and for grad J itself (`exact_length_push`), their difference being
`length_bonus` (positive: the update lengthens responses more than the objective asks).

Guarantees: every row uses the same sampled responses; the same config gives the same rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lab.config import LabConfig
from lab.estimator_lab import draw_batch
from lab.estimator_spec import resolve
from lab.estimators import estimate_gradients
from lab.policy import ChainReward, exact_gradient, sequence_rewards
from lab.sampler import Processing, SampledBatch
from lab.stats import gradient_stats
from lab.threads import torch_threads
from lab.world import World, build_world
from learner.advantages import outcome_advantages, turn_advantages

Row = dict[str, object]
MODES = ("outcome", "leave_one_out", "turn_index_normalised")


def turn_rewards(world: World, batch: SampledBatch) -> torch.Tensor:
    """(N, T) per-turn rewards: each token's reward, the final ones on the last turn; they sum
    to `sequence_rewards`."""
    reward, spec = world.reward, world.spec
    if reward.pattern:
        raise ValueError("the per-turn lab has no turn to put pattern rewards on; set "
                         "reward.pattern_weight = 0")
    n, horizon = batch.tokens_N_T.shape
    out = torch.zeros(n, horizon, dtype=torch.float64)
    if reward.token_P_S_V is not None:
        out += reward.token_P_S_V[batch.prompt_ids_N.unsqueeze(1), batch.states_N_T,
                                  batch.tokens_N_T].double() * batch.mask_N_T
    final = sequence_rewards(spec, ChainReward(terminal_P_S=reward.terminal_P_S,
                                               truncation_P=reward.truncation_P),
                             batch.prompt_ids_N, batch.states_N_T, batch.tokens_N_T,
                             batch.lengths_N, batch.stopped_N)
    last = (batch.lengths_N - 1).clamp(min=0)
    out[torch.arange(n), last] += final
    return out


def run_turns_lab(cfg: LabConfig, progress: Callable[[str], None] | None = None) -> list[Row]:
    with torch_threads(1):
        return [row for mean in cfg.turns.turn_means for row in _rows(cfg, mean, progress)]


def _rows(cfg: LabConfig, turn_mean: float, progress: Callable[[str], None] | None) -> list[Row]:
    sec = cfg.turns
    reward = cfg.reward.model_copy(update={"per_token": sec.per_token, "pattern_weight": 0.0})
    base = build_world(cfg.policy, reward, sec.horizon)
    world = World(base.spec, base.theta_P_S_V, ChainReward(
        token_P_S_V=base.reward.token_P_S_V + turn_mean, terminal_P_S=base.reward.terminal_P_S,
        truncation_P=base.reward.truncation_P))
    spec = world.spec
    gen = torch.Generator().manual_seed(sec.seed)
    count = sec.replicates * sec.batch_size
    batch = draw_batch(world, world.theta_P_S_V.unsqueeze(0),
                       lambda n: torch.zeros(n, spec.horizon, dtype=torch.long),
                       Processing(), count, sec.group_size, spec.vocab_size, gen)
    per_turn = turn_rewards(world, batch)
    totals = per_turn.sum(1)
    _, grad = exact_gradient(world.theta_P_S_V, spec, world.reward)
    length = ChainReward(token_P_S_V=torch.ones(spec.shape, dtype=torch.float64))
    _, grad_length = exact_gradient(world.theta_P_S_V, spec, length)
    unit = grad_length.reshape(-1) / grad_length.norm()
    exact_push = float(grad.reshape(-1) @ unit)
    estimator = resolve("no_correction")
    rows = []
    for mode in MODES:
        if mode == "outcome":
            advantages = outcome_advantages(totals, batch.group_ids_N, "rloo")
            advantages = advantages.unsqueeze(1) * batch.mask_N_T
        else:
            advantages = turn_advantages(per_turn, batch.mask_N_T, batch.group_ids_N, mode)
        estimates = estimate_gradients(spec, world.theta_P_S_V, batch, totals, estimator,
                                       sec.batch_size, advantages_N=advantages)
        stats = gradient_stats(estimates.gradients_M_D, grad.reshape(-1)).as_dict()
        push = float(estimates.gradients_M_D.mean(0) @ unit)
        push_se = float((estimates.gradients_M_D @ unit).std()) / sec.replicates ** 0.5
        row: Row = {"advantage": mode, "turn_mean": turn_mean, **stats, "length_push": push,
                    "length_push_se": push_se, "exact_length_push": exact_push,
                    "length_bonus": push - exact_push, "T": spec.horizon,
                    "replicates": sec.replicates, "batch_size": sec.batch_size,
                    "group_size": sec.group_size, "per_token": sec.per_token}
        rows.append(row)
        if progress:
            progress(f"turn mean {turn_mean:+g}, {mode}: bias {row['bias']:.4f} "
                     f"(z {row['bias_z']:+.1f}), length bonus {row['length_bonus']:+.4f} "
                     f"(se {push_se:.4f})")
    return rows
