"""Gradient estimates of an estimator (`lab.estimator_spec`) through the learner's real losses.

`estimate_gradients` turns a batch of M x B sampled responses into M independent gradient
estimates g_m = -grad_theta loss_m, each the gradient of the real `learner.losses` loss of one
batch of B responses, backpropagated through the tractable policy's logits (so score
centering, which needs logits, is exact too). Each replicate reads its log-probs from its own
copy of theta (a leaf of shape M x P x S x V), so one backward pass yields all M gradients.
Vectorisation: every loss term of the learner is separable across rows (a row's per-token
losses depend on that row only) and divided by a batch-level denominator, so one loss call
over all M x B rows with denominator 1, followed by dividing each replicate's gradient by its
own batch's `aggregation_denominator`, gives exactly the M per-batch gradients
(`mode="loop"`, one loss call per batch, is the reference this is tested against).

Guarantees: the lab never reimplements a loss; gradients are exact autograd gradients of the
learner's losses; replicate m uses rows m*B .. (m+1)*B - 1 only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch

from lab.estimator_spec import EstimatorSpec
from lab.policy import ChainSpec
from lab.sampler import SampledBatch, trajectory_log_weights
from learner.advantages import outcome_advantages
from learner.losses import (
    LossOutput,
    PolicyLossInputs,
    ScoreCenteringInputs,
    aggregation_denominator,
    behaviour_weights,
    policy_loss,
    score_centering_loss,
)


@dataclass(frozen=True)
class Estimates:
    """M gradient estimates (ascent directions, -grad loss) flattened to P*S*V, and metrics."""

    gradients_M_D: torch.Tensor
    metrics: dict[str, float]
    seconds: float


def advantages_for(estimator: EstimatorSpec, rewards_N: torch.Tensor,
                   group_ids_N: torch.Tensor, log_ratio_N: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Per-row advantages; groups are never shared between replicates. `log_ratio_N` (log
    pi / mu per response) weights the baselines with `baseline = "min_variance"`."""
    if estimator.advantage == "raw":
        return rewards_N.double()
    weights = None
    if estimator.baseline == "min_variance":
        weights = torch.exp(2.0 * (log_ratio_N - log_ratio_N.max()))
    return outcome_advantages(rewards_N.double(), group_ids_N, estimator.advantage,
                              baseline_weights_B=weights).double()


def estimate_gradients(spec: ChainSpec, theta_P_S_V: torch.Tensor, batch: SampledBatch,
                       rewards_N: torch.Tensor, estimator: EstimatorSpec, replicate_size: int,
                       keep_N: torch.Tensor | None = None,
                       weights_N: torch.Tensor | None = None,
                       advantages_N: torch.Tensor | None = None,
                       mode: Literal["vectorised", "loop"] = "vectorised",
                       max_chunk_elements: int = 4_000_000) -> Estimates:
    """M = N / replicate_size gradient estimates of `estimator` (see the module docstring).

    keep_N: rows an admission rule kept (default all); dropped rows leave their group (the
    baseline uses the kept members) and contribute no loss tokens.
    weights_N: per-row selection weights (`core.selection`), multiplying each row's advantage
    as the learner multiplies a trajectory's (default 1).
    advantages_N: per-row (N,) or per-token (N, T) advantages to use instead of the
    estimator's own (per-turn credit, `lab.turns`).
    """
    n = batch.size
    if n % replicate_size:
        raise ValueError(f"batch of {n} rows is not a whole number of replicates of "
                         f"{replicate_size}")
    keep_N = torch.ones(n, dtype=torch.bool) if keep_N is None else keep_N
    group_ids_N = torch.where(keep_N, batch.group_ids_N, -1 - torch.arange(n))
    log_ratio_N = None
    if estimator.baseline == "min_variance" or estimator.ess_lr:
        log_ratio_N = trajectory_log_weights(batch, theta_P_S_V.detach()).double().clamp(-50, 50)
    if advantages_N is None:
        advantages_N = advantages_for(estimator, rewards_N, group_ids_N, log_ratio_N)
    else:
        advantages_N = advantages_N.double()
    if weights_N is not None:
        scale = weights_N.double()
        advantages_N = advantages_N * (scale if advantages_N.dim() == 1 else scale[:, None])
    mask_N_T = batch.mask_N_T & keep_N.unsqueeze(1)
    replicates = n // replicate_size
    per_chunk = max(1, max_chunk_elements // (replicate_size * spec.horizon * spec.vocab_size))
    started = time.perf_counter()
    gradients, metric_sums, metric_weights = [], {}, 0.0
    for first in range(0, replicates, per_chunk):
        rows = slice(first * replicate_size, min(replicates, first + per_chunk) * replicate_size)
        chunk = _Chunk(batch, rows, mask_N_T[rows], advantages_N[rows])
        grads, metrics = (_chunk_gradients_vectorised if mode == "vectorised"
                          else _chunk_gradients_loop)(theta_P_S_V, chunk, estimator,
                                                      replicate_size)
        gradients.append(grads)
        weight = float(rows.stop - rows.start)
        for key, value in metrics.items():
            metric_sums[key] = metric_sums.get(key, 0.0) + value * weight
        metric_weights += weight
    metrics = {k: v / metric_weights for k, v in metric_sums.items()}
    gradients_M_D = torch.cat(gradients)
    if estimator.ess_lr:  # VCPO: each estimate (one step's update) times its batch's ESS
        w_M_B = torch.exp(log_ratio_N - log_ratio_N.max()).where(
            keep_N, torch.zeros_like(log_ratio_N)).reshape(replicates, replicate_size)
        kept_M = keep_N.reshape(replicates, replicate_size).sum(1).clamp(min=1).double()
        ess_M = w_M_B.sum(1) ** 2 / (kept_M * (w_M_B * w_M_B).sum(1)).clamp(min=1e-300)
        gradients_M_D = gradients_M_D * ess_M[:, None]
        metrics["vcpo/ess_lr_scale"] = float(ess_M.mean())
    return Estimates(gradients_M_D, metrics, time.perf_counter() - started)


@dataclass(frozen=True)
class _Chunk:
    batch: SampledBatch
    rows: slice
    mask_N_T: torch.Tensor
    advantages_N: torch.Tensor


@dataclass(frozen=True)
class _LossInputs:
    table_M_P_S_V: torch.Tensor  # one copy of theta per replicate: the gradient's leaf
    trainer_N_T: torch.Tensor
    proximal_N_T: torch.Tensor
    sampler_N_T: torch.Tensor
    tokens_N_T: torch.Tensor
    topk_ids_N_T_K: torch.Tensor
    topk_logprobs_N_T_K: torch.Tensor
    logits_N_T_V: torch.Tensor | None  # gathered from the leaf, for score centering
    entropy_N_T: torch.Tensor | None  # the trainer's entropy per position (correction_entropy)


def _loss_inputs(theta_P_S_V: torch.Tensor, chunk: _Chunk, estimator: EstimatorSpec,
                 replicate_size: int) -> _LossInputs:
    """Trainer log-probs of each row from its own replicate's copy of theta."""
    batch, rows = chunk.batch, chunk.rows
    n = rows.stop - rows.start
    m = n // replicate_size
    table = theta_P_S_V.detach().double().expand(m, *theta_P_S_V.shape).clone()
    table.requires_grad_(True)
    replicate_N_1 = (torch.arange(n) // replicate_size).unsqueeze(1)
    prompts_N_1 = batch.prompt_ids_N[rows].unsqueeze(1)
    states_N_T, tokens_N_T = batch.states_N_T[rows], batch.tokens_N_T[rows]
    logprobs_M_P_S_V = torch.log_softmax(table, -1)
    trainer_N_T = logprobs_M_P_S_V[replicate_N_1, prompts_N_1, states_N_T, tokens_N_T]
    sampler_N_T = batch.sampler_logprobs_N_T[rows].double()
    proximal_N_T = sampler_N_T if estimator.proximal == "sampler" else trainer_N_T.detach()
    logits_N_T_V = (table[replicate_N_1, prompts_N_1, states_N_T]
                    if estimator.score_centering is not None else None)
    entropy_N_T = None
    if estimator.loss.correction_entropy:
        lp = logprobs_M_P_S_V.detach()[replicate_N_1, prompts_N_1, states_N_T]
        entropy_N_T = -(lp.exp() * lp).sum(-1)
    return _LossInputs(table, trainer_N_T, proximal_N_T, sampler_N_T, tokens_N_T,
                       batch.sampler_topk_ids_N_T_K[rows],
                       batch.sampler_topk_logprobs_N_T_K[rows].double(), logits_N_T_V,
                       entropy_N_T)


def _losses(inputs: _LossInputs, rows: slice, mask_N_T: torch.Tensor,
            advantages_N: torch.Tensor, estimator: EstimatorSpec,
            denominator: float | None) -> tuple[LossOutput, LossOutput | None]:
    """The learner's policy loss (and score-centering term) on `rows` of the inputs."""
    policy = policy_loss(
        PolicyLossInputs(trainer_logprobs=inputs.trainer_N_T[rows],
                         proximal_logprobs=inputs.proximal_N_T[rows],
                         sampler_logprobs=inputs.sampler_N_T[rows],
                         advantages=advantages_N[rows], mask=mask_N_T[rows],
                         proximal_entropy=None if inputs.entropy_N_T is None
                         else inputs.entropy_N_T[rows]),
        estimator.loss, denominator=denominator)
    if estimator.score_centering is None:
        return policy, None
    if inputs.topk_ids_N_T_K.shape[-1] == 0:
        raise ValueError("score centering needs the sampler's top-k: set topk >= 1 "
                         "(topk = vocab_size gives the exact head)")
    centering = score_centering_loss(
        ScoreCenteringInputs(trainer_logits=inputs.logits_N_T_V[rows],
                             sampled_ids=inputs.tokens_N_T[rows],
                             sampler_logprobs=inputs.sampler_N_T[rows],
                             sampler_topk_ids=inputs.topk_ids_N_T_K[rows],
                             sampler_topk_logprobs=inputs.topk_logprobs_N_T_K[rows],
                             advantages=advantages_N[rows], mask=mask_N_T[rows]),
        estimator.score_centering, compute_entropy=False, denominator=denominator)
    return policy, centering


def replicate_denominators(mask_N_T: torch.Tensor, replicate_size: int, aggregation: str,
                           norm_constant: float | None) -> torch.Tensor:
    """Each replicate's aggregation denominator, shape (M,), as `aggregation_denominator`
    computes it for that replicate alone (checked against it on the first and last one)."""
    mask_M_B_T = mask_N_T.reshape(-1, replicate_size, mask_N_T.shape[-1])
    if aggregation == "token_mean":
        dens_M = mask_M_B_T.sum((1, 2)).double()
    else:
        dens_M = mask_M_B_T.any(-1).sum(1).double() * (
            float(norm_constant) if aggregation == "seq_sum_norm" else 1.0)
    for i in {0, dens_M.shape[0] - 1}:
        reference = float(aggregation_denominator(mask_M_B_T[i], aggregation, norm_constant))
        if abs(reference - float(dens_M[i])) > 1e-9 * max(1.0, reference):
            raise RuntimeError(f"learner.losses.aggregation_denominator gives {reference} for "
                               f"'{aggregation}' where the lab computes {float(dens_M[i])}; the "
                               "lab's vectorised estimates need updating (use mode='loop')")
    return torch.where(dens_M > 0, dens_M, torch.ones_like(dens_M))


def _flat(grad_M_P_S_V: torch.Tensor) -> torch.Tensor:
    """Ascent direction -dloss/dtheta of each replicate, flattened to (M, P*S*V)."""
    return -grad_M_P_S_V.reshape(grad_M_P_S_V.shape[0], -1)


def _chunk_gradients_vectorised(theta_P_S_V: torch.Tensor, chunk: _Chunk,
                                estimator: EstimatorSpec, replicate_size: int
                                ) -> tuple[torch.Tensor, dict[str, float]]:
    inputs = _loss_inputs(theta_P_S_V, chunk, estimator, replicate_size)
    everything = slice(None)
    policy, centering = _losses(inputs, everything, chunk.mask_N_T, chunk.advantages_N,
                                estimator, denominator=1.0)
    cfg = estimator.loss
    policy_mask = chunk.mask_N_T
    if not cfg.masked_in_denominator:
        _, keep, _, _ = behaviour_weights(inputs.trainer_N_T, inputs.proximal_N_T,
                                          inputs.sampler_N_T, chunk.mask_N_T, cfg,
                                          inputs.entropy_N_T)
        policy_mask = chunk.mask_N_T & keep
    dens_M = replicate_denominators(policy_mask, replicate_size, cfg.aggregation,
                                    cfg.norm_constant)
    (grad,) = torch.autograd.grad(policy.loss, inputs.table_M_P_S_V,
                                  retain_graph=centering is not None)
    grad = grad / dens_M[:, None, None, None]
    metrics = dict(policy.metrics)
    if centering is not None:
        sc = estimator.score_centering
        (grad_sc,) = torch.autograd.grad(centering.loss, inputs.table_M_P_S_V)
        dens_sc_M = replicate_denominators(chunk.mask_N_T, replicate_size, sc.aggregation,
                                           sc.norm_constant)
        grad = grad + grad_sc / dens_sc_M[:, None, None, None]
        metrics.update(centering.metrics)
    return _flat(grad), metrics


def _chunk_gradients_loop(theta_P_S_V: torch.Tensor, chunk: _Chunk, estimator: EstimatorSpec,
                          replicate_size: int) -> tuple[torch.Tensor, dict[str, float]]:
    inputs = _loss_inputs(theta_P_S_V, chunk, estimator, replicate_size)
    n = chunk.mask_N_T.shape[0]
    total = torch.zeros((), dtype=torch.float64)
    metric_sums: dict[str, float] = {}
    for first in range(0, n, replicate_size):
        rows = slice(first, first + replicate_size)
        policy, centering = _losses(inputs, rows, chunk.mask_N_T, chunk.advantages_N, estimator,
                                    denominator=None)
        total = total + policy.loss + (centering.loss if centering is not None else 0.0)
        for out in (policy, centering):
            for key, value in (out.metrics if out is not None else {}).items():
                metric_sums[key] = metric_sums.get(key, 0.0) + value
    (grad,) = torch.autograd.grad(total, inputs.table_M_P_S_V)
    count = n // replicate_size
    return _flat(grad), {k: v / count for k, v in metric_sums.items()}
