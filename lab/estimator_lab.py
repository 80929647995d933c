"""The estimator grid: bias and variance of every estimator, horizon and mismatch level.

For each cell (horizon T, mismatch kind, level) the lab computes the exact grad J of the
trainer, samples M x B responses from the mismatched sampler once, and evaluates every
estimator on those same responses (common random numbers: differences between estimators
are not sampling noise between cells). Each estimator gives M independent estimates, one per
batch of B responses, summarised by `lab.stats`.

Rows (one dict per estimator and cell) carry the keys `estimator`, `T`, `mismatch`, `level`,
`bias`, `bias_se`, `variance`, `mse`, `cosine` and further diagnostics: `bias_z`,
`variance_se`, `cosine_single`, `scale`, `grad_norm`, `prompt_scales` (the per-prompt weight
relative to grad J), `ess` (the loss's IS-weight ESS fraction, pooled over the M batches),
`ess_trajectory` (of the exact trajectory weights, per batch, averaged), clip / mask / truncation fractions, `kl_sampler`, `dropped_frac`
(admission), `cost_ms` (loss + backward per estimate) and `tokens` (loss tokens per estimate).

Guarantees: a cell's rows depend only on the config and the cell (seeded per cell), not on
which other cells or estimators run.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

import torch

from lab.config import DurationsSection, LabConfig, MismatchSection
from lab.durations import DurationModel
from lab.estimator_spec import EstimatorSpec, resolve
from lab.estimators import estimate_gradients
from lab.mismatch import build_sampler
from lab.policy import exact_gradient, exact_objective, sequence_rewards
from lab.sampler import (
    Processing,
    SampledBatch,
    grouped_prompts,
    sample_batch,
    trajectory_log_weights,
)
from lab.stats import block_scales, gradient_stats, normalised_ess
from lab.threads import torch_threads
from lab.world import World, build_world

PILOT_SIZE = 8192
Row = dict[str, object]


def cell_seed(base: int, horizon: int, kind: str, level: float) -> int:
    return zlib.crc32(f"{base}/{horizon}/{kind}/{level!r}".encode())


def draw_batch(world: World, sampler_logits_W_P_S_V: torch.Tensor,
               table_ids_fn: Callable[[int], torch.Tensor], processing: Processing, count: int,
               group_size: int, topk: int, gen: torch.Generator) -> SampledBatch:
    """`count` responses in groups of `group_size` (i.i.d. uniform prompt per group)."""
    prompts_N, groups_N = grouped_prompts(count // group_size, group_size,
                                          world.spec.num_prompts, gen)
    return sample_batch(world.spec, sampler_logits_W_P_S_V, table_ids_fn(count), prompts_N,
                        groups_N, processing, topk, gen)


def batch_rewards(world: World, batch: SampledBatch) -> torch.Tensor:
    return sequence_rewards(world.spec, world.reward, batch.prompt_ids_N, batch.states_N_T,
                            batch.tokens_N_T, batch.lengths_N, batch.stopped_N)


def duration_keep(world: World, durations: DurationsSection, batch: SampledBatch, drop: float,
                  gen: torch.Generator) -> torch.Tensor:
    """Admission by duration: keep trajectories at or below the (1 - drop) duration quantile.

    The threshold is fixed from an on-policy pilot sample, so the rule is a fixed function of
    the trajectory, as a timeout is.
    """
    model = DurationModel(durations.per_token, durations.tail_index,
                          durations.difficulty_coupling)
    factors_P = model.prompt_factors(exact_objective(world.theta_P_S_V, world.spec, world.reward))
    theta = world.theta_P_S_V.unsqueeze(0)
    pilot = draw_batch(world, theta, lambda n: torch.zeros(n, world.spec.horizon, dtype=torch.long),
                       Processing(), PILOT_SIZE, 1, 0, gen)
    pilot_durations = model.durations(pilot.lengths_N,
                                      model.slowdowns(pilot.prompt_ids_N, factors_P, gen))
    threshold = float(torch.quantile(pilot_durations, 1.0 - drop))
    durations_N = model.durations(batch.lengths_N,
                                  model.slowdowns(batch.prompt_ids_N, factors_P, gen))
    return durations_N <= threshold


def run_cell(cfg: LabConfig, world: World, mismatch: MismatchSection, level: float,
             estimators: dict[str, EstimatorSpec], seed: int,
             replicates: int | None = None) -> list[Row]:
    """Rows of every estimator for one (T, mismatch, level) cell."""
    est = cfg.estimators
    spec = world.spec
    m = replicates or est.replicates
    count = m * est.batch_size
    gen = torch.Generator().manual_seed(seed)
    setup = build_sampler(mismatch.kind, level, world.theta_P_S_V, spec, world.reward, gen,
                          step_norm=mismatch.step_norm, kv_residual=mismatch.kv_residual)
    _, grad_P_S_V = exact_gradient(world.theta_P_S_V, spec, world.reward)
    topk = est.topk or spec.vocab_size
    batch = draw_batch(world, setup.logits_W_P_S_V,
                       lambda n: setup.table_ids(n, spec.horizon, gen), setup.processing, count,
                       est.group_size, topk, gen)
    rewards_N = batch_rewards(world, batch)
    keep_N = None
    if mismatch.kind == "duration_drop" and level > 0:
        keep_N = duration_keep(world, cfg.durations, batch, level, gen)
    log_w_M_B = trajectory_log_weights(batch, world.theta_P_S_V).reshape(m, est.batch_size)
    kept_mask_N_T = batch.mask_N_T if keep_N is None else batch.mask_N_T & keep_N.unsqueeze(1)
    tokens_per_estimate = float(kept_mask_N_T.sum()) / m
    common = {
        "T": spec.horizon, "mismatch": mismatch.kind, "level": level,
        "replicates": m, "batch_size": est.batch_size, "group_size": est.group_size,
        "ess_trajectory": float(normalised_ess(log_w_M_B).mean()),
        "mean_length": float(batch.lengths_N.double().mean()),
        "dropped_frac": 0.0 if keep_N is None else float(1 - keep_N.double().mean()),
    }
    rows = []
    for name, estimator in estimators.items():
        estimates = estimate_gradients(spec, world.theta_P_S_V, batch, rewards_N, estimator,
                                       est.batch_size, keep_N=keep_N)
        stats = gradient_stats(estimates.gradients_M_D, grad_P_S_V.reshape(-1))
        scales = block_scales(estimates.gradients_M_D, grad_P_S_V.reshape(-1), spec.num_prompts)
        metrics = estimates.metrics
        rows.append({
            "estimator": name, **common, **stats.as_dict(),
            "prompt_scales": [s.mean for s in scales],
            "prompt_scales_se": [s.se for s in scales],
            "ess": metrics.get("loss/is_ess", 1.0),
            "clip_frac": metrics.get("loss/clip_frac_low", 0.0)
            + metrics.get("loss/clip_frac_high", 0.0),
            "masked_frac": metrics.get("loss/masked_frac", 0.0),
            "truncated_frac": metrics.get("loss/is_truncated_frac", 0.0),
            "kl_sampler": metrics.get("loss/kl_sampler_k3", 0.0),
            "cost_ms": 1000.0 * estimates.seconds / m,
            "tokens": tokens_per_estimate,
            "metrics": metrics,
        })
    return rows


def grid(cfg: LabConfig) -> list[tuple[int, MismatchSection, float]]:
    return [(h, mm, level) for h in cfg.estimators.horizons for mm in cfg.estimators.mismatch
            for level in mm.levels]


def run_estimator_lab(cfg: LabConfig, progress: Callable[[str], None] | None = None
                      ) -> list[Row]:
    """Every row of the grid `cfg.estimators` describes (apply `cfg.quick()` first if wanted)."""
    est = cfg.estimators
    estimators = {name: resolve(name, est.custom) for name in est.presets}
    worlds: dict[int, World] = {}
    rows: list[Row] = []
    cells = grid(cfg)
    with torch_threads(1):
        for i, (horizon, mismatch, level) in enumerate(cells):
            world = worlds.setdefault(horizon, build_world(cfg.policy, cfg.reward, horizon))
            started = time.perf_counter()
            rows += run_cell(cfg, world, mismatch, level, estimators,
                             cell_seed(est.seed, horizon, mismatch.kind, level))
            if progress:
                progress(f"[{i + 1}/{len(cells)}] T={horizon} {mismatch.kind}={level:g}: "
                         f"{len(estimators)} estimators in {time.perf_counter() - started:.1f}s")
    return rows
