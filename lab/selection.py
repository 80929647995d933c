"""The selection lab: the gradient bias an admission rule causes, and what corrects it.

The world: the lab's tractable policy samples responses on policy (no sampler mismatch), each
with a duration from `lab.durations` (harder prompts and longer responses take longer, with a
Pareto tail). Learner steps arrive as a Poisson process; a trajectory is admitted when at most
`max_lag` steps land while it generates, so P(admit | duration d) = P(Poisson(d / tau) <=
max_lag), tau the mean time between steps. This is the async pipeline's stale drop, and it
keeps fast (easy, short) work more often than slow work. The gradient of slow work differs (a
different prompt, another length), so the average over admitted work is a biased estimate of
grad J.

Corrections, each one row:
- `no_admission`: every trajectory kept (the reference: unbiased by construction);
- `none`: the admitted trajectories as they are;
- `propensity`: admitted trajectories weighted by `core.selection` (the same function the
  orchestrator uses with `[admission] reweight = "propensity"`): buckets (prompt, duration
  quartile), weights estimated from all M x B generated trajectories (the job's window);
- `pacing`: the learner waits, tau stretched by the smallest factor from `pacing_factors`
  that brings the admitted mix within `pacing_tv` of the generated one in both the prompt and
  the duration TV; its `throughput` is 1 / factor (learner steps per unit time, relative).

Rows carry `correction`, `bias`, `bias_se`, `bias_z`, `variance`, `mse`, `cosine` (against the
exact grad J, `lab.stats`), `admitted_frac`, `prompt_tv` and `duration_tv` (the admitted mix,
weighted for `propensity`, against the generated one), `throughput` and `factor`.

Guarantees: every row is computed on the same sampled responses and durations (common random
numbers); the same config gives the same rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from core.selection import Finished, buckets, propensity_weights, weighted_tv
from lab.config import LabConfig
from lab.durations import DurationModel
from lab.estimator_lab import draw_batch
from lab.estimator_spec import resolve
from lab.estimators import estimate_gradients
from lab.policy import exact_gradient, exact_objective, sequence_rewards
from lab.sampler import Processing
from lab.stats import gradient_stats
from lab.threads import torch_threads
from lab.world import build_world

Row = dict[str, object]


def admit_probability(durations_N: torch.Tensor, tau: float, max_lag: int) -> torch.Tensor:
    """P(Poisson(d / tau) <= max_lag) per trajectory."""
    rate_N = durations_N.double() / tau
    term_N = torch.exp(-rate_N)
    total_N = term_N.clone()
    for k in range(1, max_lag + 1):
        term_N = term_N * rate_N / k
        total_N = total_N + term_N
    return total_N.clamp(0.0, 1.0)


def mix_tvs(prompts_N: torch.Tensor, quartiles_N: list[int], keep_N: torch.Tensor,
            weights_N: torch.Tensor | None = None) -> tuple[float, float]:
    """(prompt TV, duration-quartile TV) of the kept, optionally weighted, mix vs all."""
    kept = keep_N.tolist()
    prompts, kept_prompts = prompts_N.tolist(), [p for p, k in zip(prompts_N.tolist(), kept) if k]
    kept_quartiles = [q for q, k in zip(quartiles_N, kept) if k]
    weights = None if weights_N is None else [w for w, k in zip(weights_N.tolist(), kept) if k]
    return (weighted_tv(prompts, kept_prompts, weights),
            weighted_tv(quartiles_N, kept_quartiles, weights))


def run_selection_lab(cfg: LabConfig, progress: Callable[[str], None] | None = None
                      ) -> list[Row]:
    sel = cfg.selection
    with torch_threads(1):
        world = build_world(cfg.policy, cfg.reward, sel.horizon)
        spec = world.spec
        estimator = resolve(sel.estimator, cfg.estimators.custom).model_copy(
            update={"advantage": sel.advantage})
        gen = torch.Generator().manual_seed(sel.seed)
        count = sel.replicates * sel.batch_size
        theta = world.theta_P_S_V.unsqueeze(0)
        batch = draw_batch(world, theta,
                           lambda n: torch.zeros(n, spec.horizon, dtype=torch.long),
                           Processing(), count, sel.group_size, spec.vocab_size, gen)
        rewards_N = sequence_rewards(spec, world.reward, batch.prompt_ids_N, batch.states_N_T,
                                     batch.tokens_N_T, batch.lengths_N, batch.stopped_N)
        d = cfg.durations
        model = DurationModel(d.per_token, d.tail_index, d.difficulty_coupling)
        factors_P = model.prompt_factors(exact_objective(world.theta_P_S_V, spec, world.reward))
        durations_N = model.durations(batch.lengths_N,
                                      model.slowdowns(batch.prompt_ids_N, factors_P, gen))
        tau = float(durations_N.mean()) / sel.steps_per_trajectory
        uniform_N = torch.rand(count, generator=gen, dtype=torch.float64)
        prompts = batch.prompt_ids_N.tolist()
        quartiles = [q for _, q in buckets([Finished(p, float(t), True)
                                            for p, t in zip(prompts, durations_N.tolist())])]
        _, grad_P_S_V = exact_gradient(world.theta_P_S_V, spec, world.reward)
        target = grad_P_S_V.reshape(-1)

        def keep_at(factor: float) -> torch.Tensor:
            return uniform_N < admit_probability(durations_N, tau * factor, sel.max_lag)

        def row(correction: str, keep_N: torch.Tensor, weights_N: torch.Tensor | None = None,
                factor: float = 1.0) -> Row:
            estimates = estimate_gradients(spec, world.theta_P_S_V, batch, rewards_N, estimator,
                                           sel.batch_size, keep_N=keep_N, weights_N=weights_N)
            prompt_tv, duration_tv = mix_tvs(batch.prompt_ids_N, quartiles, keep_N, weights_N)
            stats = gradient_stats(estimates.gradients_M_D, target).as_dict()
            out: Row = {"correction": correction, **stats,
                        "admitted_frac": float(keep_N.double().mean()),
                        "prompt_tv": prompt_tv, "duration_tv": duration_tv,
                        "throughput": 1.0 / factor, "factor": factor,
                        "steps_per_trajectory": sel.steps_per_trajectory,
                        "max_lag": sel.max_lag, "T": spec.horizon,
                        "replicates": sel.replicates, "batch_size": sel.batch_size}
            if progress:
                progress(f"{correction}: bias {out['bias']:.4f} ({out['bias_z']:+.1f} z), "
                         f"variance {out['variance']:.4f}, admitted {out['admitted_frac']:.2f}")
            return out

        keep_N = keep_at(1.0)
        finished = [Finished(p, float(t), bool(k))
                    for p, t, k in zip(prompts, durations_N.tolist(), keep_N.tolist())]
        weights_N = torch.tensor(propensity_weights(finished, clip=sel.clip, prior=sel.prior),
                                 dtype=torch.float64)
        rows = [row("no_admission", torch.ones(count, dtype=torch.bool)),
                row("none", keep_N),
                row("propensity", keep_N, weights_N)]
        for factor in sel.pacing_factors:
            paced = keep_at(factor)
            if max(mix_tvs(batch.prompt_ids_N, quartiles, paced)) <= sel.pacing_tv:
                rows.append(row("pacing", paced, factor=factor))
                break
        else:
            factor = sel.pacing_factors[-1]
            rows.append(row("pacing", keep_at(factor), factor=factor))
    return rows
