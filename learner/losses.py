"""Policy losses: surrogate, behaviour correction and aggregation, composed in one place.

Pure functions of tensors. Three log-probabilities of the same sampled tokens meet here:

- `trainer_logprobs` (log pi): the policy being updated; the only input with a gradient;
- `proximal_logprobs` (log pi_old): the policy at the start of this learner step, recomputed
  by the trainer without gradient (PPO's "old" policy);
- `sampler_logprobs` (log mu): the behaviour policy, recorded by the engine at generation.

`policy_loss` computes   per_token = surrogate(pi / pi_old, A) * w + kl_coef * KL_ref
and aggregates it over the loss mask. w is the detached behaviour weight (TIS / MIS / none,
token or sequence level, from pi_old / mu or sg(pi) / mu) and multiplies after clipping.
`score_centering_loss` is an additive term: added to the policy loss it replaces each token's
weighted score f(pi/mu)(y_t) grad log pi(y_t) by that minus its expectation under mu, with the
weight f applied per head token, the expectation over the sampler's recorded top-k head and a
tail modelled as the trainer's distribution rescaled to the sampler's tail mass, so only the k
head tokens are gathered.

Inputs come as one frozen record per loss (`PolicyLossInputs`, `ScoreCenteringInputs`).
Shapes: B rows; T the scored positions of a row, one per predicted token, so every (B, T)
tensor here is already shifted by one against the model's input ids (entry t is the token the
logits at input position t predict; `learner.tensors` shifts once and calls these `_B_Tm1`);
V the vocabulary; K the sampler's recorded top-k.

Guarantees: masked positions contribute exactly zero value and zero gradient (NaN-safe);
weights and clip decisions carry no gradient; every function returns `LossOutput` with
namespaced metrics (`loss/...`, `score_centering/...`). Formulas and the conventions that
differ from verl and TRL: docs/losses.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from config.learner import Aggregation, Correction, PolicyLossConfig, ScoreCenteringConfig

__all__ = [
    "LossOutput",
    "PolicyLossConfig",
    "PolicyLossInputs",
    "ScoreCenteringConfig",
    "ScoreCenteringInputs",
    "aggregate",
    "aggregation_denominator",
    "behaviour_weights",
    "policy_loss",
    "score_centering_loss",
    "sequence_tokens",
    "token_entropy",
]

LOG_RATIO_CLAMP = 20.0
TAIL_MASS_FLOOR = 1e-6


@dataclass(frozen=True)
class LossOutput:
    """loss: scalar with gradient; per_token: (B, T) loss before aggregation, 0 off the mask;
    metrics: detached floats with namespaced keys."""

    loss: torch.Tensor
    per_token: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyLossInputs:
    """What `policy_loss` reads, every (B, T) tensor on the shifted positions (module docstring).

    trainer_logprobs: log pi of the sampled tokens, the only input with a gradient;
    proximal_logprobs: log pi_old (the policy at the start of the learner step), detached;
    sampler_logprobs: log mu, recorded by the engine; detached;
    advantages: (B,) per sequence or (B, T) per token;
    mask: the loss mask (off it, the log-probs may hold anything, even -inf or NaN);
    reference_logprobs: log-probs under the KL reference, needed when `kl_coef` > 0;
    entropy: the policy's entropy at each position, for the metrics only;
    proximal_entropy: pi_old's entropy at each position, detached; needed when
    `correction_entropy` is on (it sets each token's bounds).
    Shapes are checked when the record is made."""

    trainer_logprobs: torch.Tensor
    proximal_logprobs: torch.Tensor
    sampler_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    reference_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    proximal_entropy: torch.Tensor | None = None

    def __post_init__(self) -> None:
        shape = _check_shapes(trainer_logprobs=self.trainer_logprobs,
                              proximal_logprobs=self.proximal_logprobs,
                              sampler_logprobs=self.sampler_logprobs, mask=self.mask)
        _advantages_B_T(self.advantages, shape)
        for name in ("reference_logprobs", "entropy", "proximal_entropy"):
            value = getattr(self, name)
            if value is not None and value.shape != shape:
                raise ValueError(f"PolicyLossInputs: {name} {tuple(value.shape)} is not the "
                                 f"(B, T) = {tuple(shape)} of trainer_logprobs")

    @property
    def shape(self) -> torch.Size:
        return self.mask.shape


@dataclass(frozen=True)
class ScoreCenteringInputs:
    """What `score_centering_loss` reads, on the shifted positions (module docstring).

    trainer_logits: (B, T, V), the only input with a gradient; sampled_ids: (B, T) the tokens
    sampled; sampler_logprobs: (B, T) log mu of them; sampler_topk_ids and
    sampler_topk_logprobs: (B, T, K) the sampler's recorded head (entries with log-prob -inf
    are padding); advantages: (B,) or (B, T); mask: (B, T); trainer_logsumexp: (B, T), the
    logits' log-sum-exp when the caller has it already. Shapes are checked when the record is
    made."""

    trainer_logits: torch.Tensor
    sampled_ids: torch.Tensor
    sampler_logprobs: torch.Tensor
    sampler_topk_ids: torch.Tensor
    sampler_topk_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    trainer_logsumexp: torch.Tensor | None = None

    def __post_init__(self) -> None:
        shape = _check_centering_shapes(self.trainer_logits, self.sampled_ids,
                                        self.sampler_logprobs, self.sampler_topk_ids,
                                        self.sampler_topk_logprobs, self.mask)
        _advantages_B_T(self.advantages, shape)

    @property
    def shape(self) -> torch.Size:
        return self.mask.shape


# ----------------------------------------------------------------------------- aggregation


def sequence_tokens(
    mask_B_T: torch.Tensor, sequence_index_B: torch.Tensor | None = None
) -> torch.Tensor:
    """Loss tokens of each row's sequence, (B,): the row's own, or, with `sequence_index_B`,
    those of every row with the same index (a trajectory a chat template split into rows)."""
    row_tokens = mask_B_T.to(torch.bool).sum(-1)
    if sequence_index_B is None or row_tokens.numel() == 0:
        return row_tokens
    index = sequence_index_B.to(device=row_tokens.device, dtype=torch.long)
    totals = torch.zeros(int(index.max()) + 1, dtype=row_tokens.dtype, device=row_tokens.device)
    return totals.index_add_(0, index, row_tokens)[index]


def _sequence_count(mask_B_T: torch.Tensor, sequence_index_B: torch.Tensor | None) -> torch.Tensor:
    has_tokens = mask_B_T.to(torch.bool).any(-1)
    if sequence_index_B is None:
        return has_tokens.to(torch.float32).sum()
    index = sequence_index_B.to(has_tokens.device)[has_tokens]
    return torch.tensor(float(torch.unique(index).numel()), device=has_tokens.device)


def aggregation_denominator(
    mask_B_T: torch.Tensor, mode: Aggregation | str, norm_constant: float | None = None,
    sequence_index_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """The denominator `aggregate` divides by: N tokens, S sequences, or S * norm_constant.

    S counts only sequences with at least one loss token; rows that share an entry of
    `sequence_index_B` are one sequence (the segments of one trajectory count once). Exposed
    so a trainer that splits a batch into micro-batches can divide every micro-batch by the
    whole batch's denominator.
    """
    mask = mask_B_T.to(torch.float32)
    if mode == "token_mean":
        return mask.sum()
    sequences = _sequence_count(mask_B_T, sequence_index_B)
    if mode in ("seq_mean_token_mean", "seq_mean_token_sum"):
        return sequences
    if mode == "seq_sum_norm":
        if norm_constant is None:
            raise ValueError(
                "aggregate: mode 'seq_sum_norm' needs norm_constant (the Dr.GRPO "
                "constant, e.g. the maximum generation length)"
            )
        return sequences * float(norm_constant)
    raise ValueError(
        f"aggregate: unknown mode '{mode}'; use token_mean, seq_mean_token_mean, "
        "seq_mean_token_sum or seq_sum_norm"
    )


def aggregate(
    per_token_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    mode: Aggregation | str,
    norm_constant: float | None = None,
    *,
    denominator: torch.Tensor | float | None = None,
    sequence_tokens_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Combine per-token losses into a scalar.

    token_mean:          sum m*L / sum m
    seq_mean_token_mean: (1/S) sum_i (sum_t m*L / n_i)
    seq_mean_token_sum:  (1/S) sum_i sum_t m*L
    seq_sum_norm:        sum m*L / (S * norm_constant)
    With `denominator` given, it replaces N, S or S * norm_constant (micro-batching); with
    `sequence_tokens_B` (see `sequence_tokens`), n_i is the loss tokens of row i's whole
    sequence, so a sequence split over several rows counts once.
    An empty mask gives 0 (with a graph, so backward works).
    """
    if per_token_B_T.shape != mask_B_T.shape:
        raise ValueError(
            f"aggregate: per_token {tuple(per_token_B_T.shape)} and mask "
            f"{tuple(mask_B_T.shape)} differ in shape"
        )
    mask = mask_B_T.to(torch.bool)
    masked = torch.where(mask, per_token_B_T, torch.zeros_like(per_token_B_T))
    if mode == "seq_mean_token_mean":
        lengths_B = mask.sum(-1) if sequence_tokens_B is None else sequence_tokens_B
        lengths_B = lengths_B.to(device=masked.device, dtype=per_token_B_T.dtype).clamp(min=1)
        numerator = (masked.sum(-1) / lengths_B).sum()
    else:
        numerator = masked.sum()
    if denominator is None:
        denominator = aggregation_denominator(mask, mode, norm_constant)
    else:
        aggregation_denominator(mask, mode, norm_constant)  # validates mode / norm_constant
    denominator = torch.as_tensor(
        denominator, dtype=per_token_B_T.dtype, device=per_token_B_T.device
    )
    return numerator / torch.where(denominator > 0, denominator, torch.ones_like(denominator))


# ----------------------------------------------------------------------------- helpers


def _check_shapes(**tensors: torch.Tensor) -> torch.Size:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(tensors.values())).shape
    if len(first) != 2 or any(t.shape != first for t in tensors.values()):
        raise ValueError(f"expected tensors of one (B, T) shape, got {shapes}")
    return first


def _advantages_B_T(advantages: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    advantages = advantages.detach()
    if advantages.shape == shape:
        return advantages
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        return advantages[:, None].expand(shape)
    raise ValueError(
        f"advantages must have shape (B,) = ({shape[0]},) or (B, T) = "
        f"{tuple(shape)}, got {tuple(advantages.shape)}"
    )


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1)


def _log_bound(bound: float | None, default: float) -> float:
    if bound is None:
        return default
    return math.log(bound) if bound > 0 else -math.inf


ENTROPY_SCALE_FLOOR = 0.05


def entropy_bound_scale(entropy_B_T: torch.Tensor) -> torch.Tensor:
    """s(H) = sqrt((1 - e^-H) / (1 - e^-1)), at least 0.05: how wide a token's log-ratio bounds
    are relative to a token of 1 nat (`correction_entropy`).

    Why this shape: a small logit perturbation e (the sampler's numerics, a stale update) moves
    the sampled token's log-prob by e_y - sum_j p_j e_j, whose variance for independent e_j of
    variance v is v (1 - 2 p_y + sum_j p_j^2). For a distribution spread evenly over its
    support that is v (1 - e^-H) in expectation over y: a sure token (H -> 0) barely moves, a
    uniform one over many tokens moves by about sqrt(v). So the natural spread of the ratio grows
    as sqrt(1 - e^-H), and fixed bounds are too wide for sure tokens and too tight for
    exploring ones."""
    spread = -torch.expm1(-entropy_B_T.double().clamp(min=0.0))
    scale = torch.sqrt(spread / (1.0 - math.exp(-1.0)))
    return scale.clamp(min=ENTROPY_SCALE_FLOOR).to(entropy_B_T.dtype)


def _correction_weights(
    mode: Correction | str, log_rho: torch.Tensor, low: float | None, high: float | None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, keep, floored, capped) from a detached log ratio; computed in log space.
    `scale` (per token) multiplies the bounds' logs (`entropy_bound_scale`)."""
    ones = torch.ones_like(log_rho, dtype=torch.bool)
    if mode == "none":
        return torch.ones_like(log_rho), ones, ~ones, ~ones
    log_low, log_high = _log_bound(low, -math.inf), _log_bound(high, math.inf)
    if scale is not None:
        scale = scale.to(log_rho.dtype)
        log_low = torch.full_like(log_rho, log_low) * scale
        log_high = torch.full_like(log_rho, log_high) * scale
    if mode == "tis":
        capped = log_rho > log_high
        floored = log_rho < log_low
        weights = torch.exp(log_rho.clamp(min=log_low, max=log_high))
        return weights, ones, floored, capped
    if mode == "mis":
        keep = (log_rho >= log_low) & (log_rho <= log_high)
        weights = torch.where(
            keep, torch.exp(log_rho.clamp(max=LOG_RATIO_CLAMP)), torch.zeros_like(log_rho)
        )
        return weights, keep, ~ones, ~ones
    raise ValueError(f"unknown correction '{mode}'; use none, tis or mis")


def _weight_metrics(
    prefix: str, weights: torch.Tensor, units: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Mean, max and effective-sample-size fraction (sum w)^2 / (n sum w^2) over `units`."""
    w = torch.where(units, weights, torch.zeros_like(weights))
    n = units.sum().clamp(min=1).to(w.dtype)
    total, squares = w.sum(), (w * w).sum()
    ess = torch.where(squares > 0, total * total / (n * squares), torch.zeros_like(total))
    return {
        f"{prefix}weight_mean": total / n,
        f"{prefix}weight_max": w.max() if w.numel() else torch.zeros(()),
        f"{prefix}ess": ess,
    }


def _kl_metrics(
    prefix: str, log_ratio: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """k1 and k3 estimates of KL(q || p) from log_ratio = log p - log q at tokens drawn from q."""
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    return {
        f"{prefix}_k1": _masked_mean(-log_ratio, mask),
        f"{prefix}_k3": _masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
    }


def _floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    if not metrics:
        return {}
    values = torch.stack([v.detach().to(torch.float64).reshape(()).cpu() for v in metrics.values()])
    return dict(zip(metrics.keys(), values.tolist()))


def token_entropy(
    logits_B_T_V: torch.Tensor, logsumexp_B_T: torch.Tensor | None = None
) -> torch.Tensor:
    """Entropy of softmax(logits) at every position, without gradient."""
    with torch.no_grad():
        logits = logits_B_T_V.float()
        lse = torch.logsumexp(logits, -1) if logsumexp_B_T is None else logsumexp_B_T.float()
        probs = torch.exp(logits - lse[..., None])
        return lse - (probs * logits).sum(-1)


# ----------------------------------------------------------------------------- policy loss


def behaviour_weights(
    trainer_logprobs_B_T: torch.Tensor,
    proximal_logprobs_B_T: torch.Tensor,
    sampler_logprobs_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    cfg: PolicyLossConfig,
    proximal_entropy_B_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Detached behaviour weights of `cfg.correction`.

    Returns (weights_B_T, keep_B_T, floored_B_T, capped_B_T). The log ratio is
    log pi_old - log mu (`ratio_base = proximal`) or sg(log pi) - log mu (`current`), summed
    over the row's loss tokens at `correction_level = sequence`. keep is False where `mis`
    zeroes a token (its whole row at sequence level). With `correction_entropy` the bounds of
    each token are scaled by `entropy_bound_scale` of pi_old's entropy there.
    """
    mask = mask_B_T.to(torch.bool)
    base = proximal_logprobs_B_T if cfg.ratio_base == "proximal" else trainer_logprobs_B_T
    log_rho = torch.where(
        mask,
        base.detach() - sampler_logprobs_B_T.detach(),
        torch.zeros_like(sampler_logprobs_B_T, dtype=base.dtype),
    )
    if cfg.correction_level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    scale = None
    if cfg.correction_entropy:
        if proximal_entropy_B_T is None:
            raise ValueError("behaviour_weights: correction_entropy needs pi_old's entropy at "
                             "each position (PolicyLossInputs.proximal_entropy)")
        scale = entropy_bound_scale(proximal_entropy_B_T.detach())
    return _correction_weights(cfg.correction, log_rho, cfg.correction_low, cfg.correction_high,
                               scale)


def trajectory_log_ratios(
    proximal_logprobs_B_T: torch.Tensor,
    sampler_logprobs_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    trajectory_index_B: torch.Tensor,
) -> torch.Tensor:
    """log prod_t pi_old / mu over each trajectory's sampled tokens (all its rows), given on
    every row of it, float64, clamped to +-50 (VCPO's ratios: its baseline and ESS)."""
    mask = mask_B_T.to(torch.bool)
    per_row = torch.where(
        mask, proximal_logprobs_B_T.detach().double() - sampler_logprobs_B_T.detach().double(),
        torch.zeros((), dtype=torch.float64, device=mask.device)).sum(-1)
    count = int(trajectory_index_B.max().item()) + 1 if trajectory_index_B.numel() else 0
    per_trajectory = torch.zeros(count, dtype=torch.float64, device=mask.device).index_add_(
        0, trajectory_index_B, per_row)
    return per_trajectory[trajectory_index_B].clamp(-50.0, 50.0)


def ess_sums(log_ratio_B: torch.Tensor, trajectory_index_B: torch.Tensor) -> torch.Tensor:
    """(n, sum w, sum w^2) over the distinct trajectories of the rows, w = exp(log ratio):
    summed over data-parallel ranks, they give the ESS fraction (sum w)^2 / (n sum w^2)."""
    first = torch.zeros(int(trajectory_index_B.max().item()) + 1 if trajectory_index_B.numel()
                        else 0, dtype=torch.float64, device=log_ratio_B.device)
    first = first.index_copy(0, trajectory_index_B, log_ratio_B.double())
    w = torch.exp(first)
    return torch.stack([torch.tensor(float(w.numel()), dtype=torch.float64, device=w.device),
                        w.sum(), (w * w).sum()])


def ess_fraction(sums: torch.Tensor) -> float:
    n, total, squares = (float(x) for x in sums)
    return total * total / (n * squares) if n > 0 and squares > 0 else 1.0


def _clipped_ratio_loss(
    ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float, dual_clip: float | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    r = ratio.detach()
    flags = {"clip_low": (r < 1.0 - low) & (adv < 0), "clip_high": (r > 1.0 + high) & (adv > 0)}
    if dual_clip is not None:
        bound = -adv * dual_clip
        flags["dual_clip"] = (adv < 0) & (r > dual_clip)
        per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
    return per_token, flags


def _surrogate(
    cfg: PolicyLossConfig,
    trainer: torch.Tensor,
    proximal: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token surrogate loss (before weights), the ratio it used, and its clip flags."""
    log_ratio = torch.where(mask, trainer - proximal, torch.zeros_like(trainer))
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if cfg.surrogate == "reinforce":
        return -adv * trainer, torch.exp(log_ratio.detach()), {}
    if cfg.surrogate == "ppo":
        ratio = torch.exp(log_ratio)
        per_token, flags = _clipped_ratio_loss(
            ratio, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip
        )
        return per_token, ratio, flags
    if cfg.surrogate == "cispo":
        ratio = torch.exp(log_ratio.detach())
        weight = ratio.clamp(min=cfg.cispo_low, max=cfg.cispo_high)
        flags = {"clip_high": ratio > cfg.cispo_high}
        if cfg.cispo_low is not None:
            flags["clip_low"] = ratio < cfg.cispo_low
        return -weight * adv * trainer, ratio, flags
    if cfg.surrogate in ("gspo", "gspo_token"):
        lengths_B = mask.sum(-1, keepdim=True).clamp(min=1).to(trainer.dtype)
        log_s = (log_ratio.sum(-1, keepdim=True) / lengths_B).clamp(
            -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
        )
        if cfg.surrogate == "gspo":
            ratio = torch.exp(log_s).expand_as(trainer)
        else:
            ratio = torch.exp(log_s.detach() + trainer - trainer.detach())
        per_token, flags = _clipped_ratio_loss(ratio, adv, cfg.clip_low, cfg.clip_high, None)
        return per_token, ratio, flags
    raise ValueError(
        f"unknown surrogate '{cfg.surrogate}'; use reinforce, ppo, gspo, gspo_token or cispo"
    )


def _reference_kl(trainer: torch.Tensor, reference: torch.Tensor, estimator: str) -> torch.Tensor:
    log_ratio = (reference.detach() - trainer).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown kl_estimator '{estimator}'; use k1 or k3")


def _policy_metrics(
    cfg: PolicyLossConfig, loss: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
    ratio: torch.Tensor, flags: dict[str, torch.Tensor], weights: torch.Tensor,
    keep: torch.Tensor, floored: torch.Tensor, capped: torch.Tensor, trainer: torch.Tensor,
    proximal: torch.Tensor, sampler: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """policy_loss's diagnostics (no gradient): clipping, masking, ratios, IS weights, KLs."""
    dtype = trainer.dtype
    units = mask
    if cfg.correction_level == "sequence":
        units = torch.zeros_like(mask)
        units[:, 0] = mask.any(-1)
    metrics = {
        "loss/policy": loss.detach(),
        "loss/tokens": mask.sum().to(torch.float64),
        "loss/clip_frac_low": _masked_mean(flags.get("clip_low", ~mask).to(dtype), mask),
        "loss/clip_frac_high": _masked_mean(flags.get("clip_high", ~mask).to(dtype), mask),
        "loss/masked_frac": _masked_mean((~keep).to(dtype), mask),
        "loss/is_truncated_frac": _masked_mean((capped | floored).to(dtype), mask),
        "loss/ratio_mean": _masked_mean(ratio.detach(), mask),
        "loss/ratio_max": torch.where(mask, ratio.detach(), torch.zeros_like(ratio)).amax()
        if mask.numel()
        else torch.zeros(()),
        "loss/advantage_mean": _masked_mean(adv, mask),
    }
    if "dual_clip" in flags:
        metrics["loss/dual_clip_frac"] = _masked_mean(flags["dual_clip"].to(dtype), mask)
    metrics.update(_weight_metrics("loss/is_", weights, units))
    metrics.update(_kl_metrics("loss/kl_sampler", trainer.detach() - sampler, mask))
    metrics.update(_kl_metrics("loss/kl_proximal", trainer.detach() - proximal, mask))
    metrics.update(_gap_metrics("loss/sampler_abs_diff", trainer.detach() - sampler, mask))
    return metrics


def _gap_metrics(prefix: str, diff: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean and max |trainer - sampler| log-prob over loss tokens: at lag 0 the numerical
    mismatch between the engine and the learner's recomputation."""
    gap = torch.where(mask, diff.abs(), torch.zeros_like(diff))
    return {f"{prefix}_mean": _masked_mean(gap, mask),
            f"{prefix}_max": gap.amax() if gap.numel() else torch.zeros(())}


def policy_loss(
    inputs: PolicyLossInputs,
    cfg: PolicyLossConfig,
    *,
    denominator: torch.Tensor | float | None = None,
    sequence_tokens_B: torch.Tensor | None = None,
) -> LossOutput:
    """The configured policy loss; gradient flows through `inputs.trainer_logprobs` only.

    `inputs.reference_logprobs` is required when `cfg.kl_coef > 0`. `denominator` overrides
    the aggregation denominator (see `aggregation_denominator`) and `sequence_tokens_B` the
    per-sequence token counts (see `sequence_tokens`).
    """
    shape = inputs.shape
    trainer_logprobs_B_T, mask_B_T = inputs.trainer_logprobs, inputs.mask
    mask = mask_B_T.to(torch.bool)
    zero = torch.zeros((), dtype=trainer_logprobs_B_T.dtype, device=trainer_logprobs_B_T.device)
    # off-mask entries (prompt, tool output, padding) may hold anything, even -inf or NaN
    trainer = torch.where(mask, trainer_logprobs_B_T, zero)
    proximal = torch.where(mask, inputs.proximal_logprobs.detach().to(trainer.dtype), zero)
    sampler = torch.where(mask, inputs.sampler_logprobs.detach().to(trainer.dtype), zero)
    adv = _advantages_B_T(inputs.advantages, shape).to(trainer.dtype)

    surrogate_B_T, ratio, flags = _surrogate(cfg, trainer, proximal, adv, mask)
    weights, keep, floored, capped = behaviour_weights(trainer, proximal, sampler, mask, cfg,
                                                       inputs.proximal_entropy)
    per_token = surrogate_B_T * weights
    metrics: dict[str, torch.Tensor] = {}
    if cfg.kl_coef > 0:
        if inputs.reference_logprobs is None:
            raise ValueError(
                "policy_loss: kl_coef > 0 needs PolicyLossInputs.reference_logprobs (log-probs "
                "of the sampled tokens under the reference model); or set kl_coef = 0"
            )
        reference = torch.where(mask, inputs.reference_logprobs.detach().to(trainer.dtype),
                                zero)
        kl_ref = _reference_kl(trainer, reference, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl_ref
        metrics["loss/kl_ref"] = _masked_mean(kl_ref.detach(), mask)
    aggregation_mask = mask if cfg.masked_in_denominator else mask & keep
    per_token = torch.where(aggregation_mask, per_token, torch.zeros_like(per_token))
    loss = aggregate(per_token, aggregation_mask, cfg.aggregation, cfg.norm_constant,
                     denominator=denominator, sequence_tokens_B=sequence_tokens_B)

    with torch.no_grad():
        metrics.update(_policy_metrics(cfg, loss, mask, adv, ratio, flags, weights, keep,
                                       floored, capped, trainer, proximal, sampler))
        if inputs.entropy is not None:
            metrics["loss/entropy"] = _masked_mean(inputs.entropy.detach().to(trainer.dtype),
                                                   mask)
    return LossOutput(loss=loss, per_token=per_token, metrics=_floats(metrics))


# ----------------------------------------------------------------------------- score centering


def _check_centering_shapes(
    logits_B_T_V: torch.Tensor, sampled_ids_B_T: torch.Tensor, sampler_logprobs_B_T: torch.Tensor,
    topk_ids_B_T_K: torch.Tensor, topk_logprobs_B_T_K: torch.Tensor, mask_B_T: torch.Tensor,
) -> torch.Size:
    shape = _check_shapes(
        sampled_ids=sampled_ids_B_T, sampler_logprobs=sampler_logprobs_B_T, mask=mask_B_T
    )
    if logits_B_T_V.shape[:2] != shape:
        raise ValueError(
            f"score_centering_loss: logits {tuple(logits_B_T_V.shape)} do not "
            f"start with the (B, T) = {tuple(shape)} of sampled_ids"
        )
    if topk_ids_B_T_K.shape != topk_logprobs_B_T_K.shape or topk_ids_B_T_K.shape[:2] != shape:
        raise ValueError(
            f"score_centering_loss: sampler top-k ids "
            f"{tuple(topk_ids_B_T_K.shape)} and log-probs "
            f"{tuple(topk_logprobs_B_T_K.shape)} must both be (B, T, K) with "
            f"(B, T) = {tuple(shape)}; record top-k with SamplingParams.logprobs_topk"
        )
    return shape


def _centering_coefficients(
    head_logp: torch.Tensor, sampler_head_logp: torch.Tensor, valid: torch.Tensor,
    cfg: ScoreCenteringConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """(mu on the head, pi's head mass, c_v, head weights); all detached.

    c_v = mu(v) f(pi(v)/mu(v)) - alpha pi(v) with alpha = rho f(1/rho), rho = m_mu / m_pi, and
    f the `cfg.weight` function; the head weights are (f, keep, floored, capped) per entry.
    """
    zero = torch.zeros((), dtype=head_logp.dtype, device=head_logp.device)
    mu_head = torch.where(valid, torch.exp(sampler_head_logp), zero)
    head_logp = torch.where(valid, head_logp, torch.full_like(head_logp, -torch.inf))
    log_head_mass_pi = torch.logsumexp(head_logp, -1)
    tail_mu = (1.0 - mu_head.sum(-1)).clamp(min=0.0)
    tail_pi = (-torch.expm1(log_head_mass_pi.clamp(max=0.0))).clamp(min=TAIL_MASS_FLOOR)
    pi_head = torch.exp(head_logp)
    head_log_ratio = torch.where(valid, head_logp - sampler_head_logp, torch.zeros_like(mu_head))
    weights = _correction_weights(cfg.weight, head_log_ratio, cfg.weight_low, cfg.weight_high)
    has_tail = tail_mu > 0
    inverse_rho_log = torch.log(tail_pi) - torch.log(torch.where(has_tail, tail_mu, 1.0))
    f_inverse_rho = _correction_weights(cfg.weight, inverse_rho_log, cfg.weight_low,
                                        cfg.weight_high)[0]
    alpha = torch.where(has_tail, tail_mu / tail_pi * f_inverse_rho, zero)
    coef = torch.where(valid, mu_head * weights[0] - alpha[..., None] * pi_head,
                       torch.zeros_like(mu_head))
    return mu_head, torch.exp(log_head_mass_pi), coef, weights


def score_centering_loss(
    inputs: ScoreCenteringInputs,
    cfg: ScoreCenteringConfig,
    *,
    compute_entropy: bool = True,
    denominator: torch.Tensor | float | None = None,
    sequence_tokens_B: torch.Tensor | None = None,
) -> LossOutput:
    """The score-centering term; add it to the policy loss.

    At each loss position with head H (the sampler's recorded top-k, entries with log-prob
    -inf are padding), tail masses m_mu = 1 - sum_H mu, m_pi = 1 - sum_H pi, rho = m_mu / m_pi
    and f the weight function of `cfg.weight` (none: 1; tis: clip(r, low, high); mis:
    r if low <= r <= high else 0):

        c_v = mu(v) f(pi(v)/mu(v)) - rho f(1/rho) pi(v)     for v in H   (detached)
        per_token = A * sum_{v in H} c_v * log pi(v)

    The policy term it is added to is -A f(pi(y)/mu(y)) log pi(y) (REINFORCE with the same
    `tis`/`mis` correction); the sum's expectation under mu is E_mu[f(pi/mu) grad log pi] with
    the tail modelled as pi rescaled to mass m_mu (exact when H is the whole vocabulary), so the
    two terms together have expectation zero under the sampler: the weight is applied per head
    token, not to the sampled token. Gradient flows through the logits only. Give the trainer's
    `inputs.trainer_logsumexp` to reuse it; m_pi is floored at 1e-6 (float32 cannot resolve
    smaller tail masses). Weight metrics are over the valid head entries.
    """
    shape = inputs.shape
    mask = inputs.mask.to(torch.bool)
    logits = inputs.trainer_logits
    sampled_ids_B_T, sampler_logprobs_B_T = inputs.sampled_ids, inputs.sampler_logprobs
    sampler_topk_ids_B_T_K = inputs.sampler_topk_ids
    sampler_topk_logprobs_B_T_K = inputs.sampler_topk_logprobs
    trainer_logsumexp_B_T = inputs.trainer_logsumexp
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lse = (
        torch.logsumexp(logits.to(dtype), -1)
        if trainer_logsumexp_B_T is None
        else trainer_logsumexp_B_T.to(dtype)
    )
    head_logp = logits.gather(-1, sampler_topk_ids_B_T_K.long()).to(dtype) - lse[..., None]
    adv = _advantages_B_T(inputs.advantages, shape).to(dtype)

    with torch.no_grad():
        valid = torch.isfinite(sampler_topk_logprobs_B_T_K) & mask[..., None]
        mu_head, pi_head_mass, coef, (weights, keep, floored, capped) = _centering_coefficients(
            head_logp.detach(), sampler_topk_logprobs_B_T_K.to(dtype), valid, cfg)
        sampled_logp = (
            logits.detach().gather(-1, sampled_ids_B_T.long()[..., None]).squeeze(-1).to(dtype)
            - lse.detach()
        )
        log_rho = torch.where(
            mask, sampled_logp - sampler_logprobs_B_T.to(dtype), torch.zeros_like(sampled_logp)
        )

    expected_score = (coef * torch.where(valid, head_logp, torch.zeros_like(head_logp))).sum(-1)
    per_token = torch.where(mask, adv * expected_score, torch.zeros_like(expected_score))
    loss = aggregate(per_token, mask, cfg.aggregation, cfg.norm_constant,
                     denominator=denominator, sequence_tokens_B=sequence_tokens_B)

    with torch.no_grad():
        metrics = {
            "score_centering/loss": loss.detach(),
            "score_centering/clip_frac_low": _masked_mean(floored.to(dtype), valid),
            "score_centering/clip_frac_high": _masked_mean(capped.to(dtype), valid),
            "score_centering/masked_frac": _masked_mean((~keep).to(dtype), valid),
            "score_centering/head_mass_sampler": _masked_mean(mu_head.sum(-1), mask),
            "score_centering/head_mass_trainer": _masked_mean(pi_head_mass, mask),
        }
        metrics.update(_weight_metrics("score_centering/", weights, valid))
        metrics.update(_kl_metrics("score_centering/kl_sampler", log_rho, mask))
        if compute_entropy:
            metrics["score_centering/entropy"] = _masked_mean(
                token_entropy(logits, lse).to(dtype), mask
            )
    return LossOutput(loss=loss, per_token=per_token, metrics=_floats(metrics))
