"""Estimator specs: the learner's real loss configs plus an advantage estimator; the presets.

An `EstimatorSpec` names everything that makes an update rule: the advantage estimator (the
learner's `grpo`, `dr_grpo`, `rloo`, or `raw` = the reward itself, no baseline), what plays
PPO's pi_old (`proximal`: the trainer's own detached log-probs, as a learner recomputes them at
the start of a step, or the sampler's recorded log-probs, the policy that generated the data),
the learner's `PolicyLossConfig` and optionally its `ScoreCenteringConfig` (added to the policy
loss). `PRESETS` holds the essay's menu. The GSPO presets clip the sequence ratio at 0.2: the
paper's 3e-4 / 4e-4 assume pi_old is recomputed every step, so ratios stay within ~1e-3; against
a stale sampler they would clip almost every sequence (write a custom estimator to see it). With a single gradient step per batch, `cispo`
(pi_old = sampler) and `token_tis` give the same gradient: CISPO's weight is token TIS's.

Guarantees: no torch import (the config loader uses this module); specs are frozen and refuse
unknown keys.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from config.learner import PolicyLossConfig, ScoreCenteringConfig

AdvantageName = Literal["grpo", "dr_grpo", "rloo", "raw"]
INF = float("inf")


class EstimatorSpec(BaseModel):
    """One update rule, as a user writes it in TOML."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    advantage: AdvantageName = Field("rloo", description="grpo | dr_grpo | rloo | raw (no baseline)")
    proximal: Literal["trainer", "sampler"] = Field(
        "trainer", description="pi_old: the trainer's detached log-probs or the sampler's")
    loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    score_centering: ScoreCenteringConfig | None = None
    baseline: Literal["mean", "min_variance"] = Field(
        "mean", description="min_variance: VCPO's baseline, group means weighted by w^2")
    ess_lr: bool = Field(False, description="VCPO: each estimate times its batch's ESS fraction")
    description: str = ""


def _loss(**fields) -> PolicyLossConfig:
    return PolicyLossConfig(**{"aggregation": "seq_mean_token_sum", **fields})


_REINFORCE = {"surrogate": "reinforce"}
_TOKEN_IS = {"correction": "tis", "correction_level": "token", "ratio_base": "current"}
_SEQ_IS = {"correction": "tis", "correction_level": "sequence", "ratio_base": "current"}
_GSPO = {"clip_low": 0.2, "clip_high": 0.2, "aggregation": "seq_mean_token_mean"}

PRESETS: dict[str, EstimatorSpec] = {
    "no_correction": EstimatorSpec(
        loss=_loss(**_REINFORCE), description="REINFORCE + RLOO on sampler data, no correction"),
    "trajectory_is": EstimatorSpec(
        loss=_loss(**_REINFORCE, **_SEQ_IS, correction_high=INF),
        description="exact trajectory IS: prod_t pi/mu, uncapped"),
    "token_is": EstimatorSpec(
        loss=_loss(**_REINFORCE, **_TOKEN_IS, correction_high=INF),
        description="token-level IS: pi/mu per token, uncapped"),
    "token_tis": EstimatorSpec(
        loss=_loss(**_REINFORCE, **_TOKEN_IS, correction_high=2.0),
        description="truncated token IS, cap 2"),
    "sequence_tis": EstimatorSpec(
        loss=_loss(**_REINFORCE, **_SEQ_IS, correction_high=2.0),
        description="truncated trajectory IS, cap 2"),
    "cispo": EstimatorSpec(
        proximal="sampler", loss=_loss(surrogate="cispo", cispo_high=2.0),
        description="CISPO: sg(min(pi/mu, 2)) A log pi"),
    "ppo_clip": EstimatorSpec(
        proximal="sampler", loss=_loss(surrogate="ppo", clip_low=0.2, clip_high=0.2),
        description="PPO clip 0.2 on pi/mu"),
    "dual_clip": EstimatorSpec(
        proximal="sampler", loss=_loss(surrogate="ppo", clip_low=0.2, clip_high=0.2, dual_clip=3.0),
        description="PPO clip 0.2 + dual clip 3"),
    "icepop": EstimatorSpec(
        loss=_loss(surrogate="ppo", correction="mis", correction_level="token",
                   correction_low=0.5, correction_high=2.0),
        description="IcePop: token MIS, keep 0.5 <= pi/mu <= 2"),
    "icepop_entropy": EstimatorSpec(
        loss=_loss(surrogate="ppo", correction="mis", correction_level="token",
                   correction_low=0.5, correction_high=2.0, correction_entropy=True),
        description="IcePop with entropy-conditioned bounds: 0.5 and 2 at 1 nat, "
                    "log-bounds scaled by sqrt((1 - e^-H) / (1 - e^-1))"),
    "vcpo": EstimatorSpec(
        loss=_loss(**_REINFORCE, **_SEQ_IS, correction_high=INF), baseline="min_variance",
        ess_lr=True,
        description="VCPO: trajectory IS, w^2-weighted RLOO baseline, step scaled by the ESS"),
    "gspo": EstimatorSpec(
        proximal="sampler", loss=_loss(surrogate="gspo", **_GSPO),
        description="GSPO: sequence ratio (geometric mean of pi/mu), clip 0.2"),
    "gspo_token": EstimatorSpec(
        proximal="sampler", loss=_loss(surrogate="gspo_token", **_GSPO),
        description="GSPO-token"),
    "score_centering": EstimatorSpec(
        loss=_loss(**_REINFORCE),
        score_centering=ScoreCenteringConfig(aggregation="seq_mean_token_sum"),
        description="REINFORCE + score centering (sampler top-k)"),
    "cispo_score_centering": EstimatorSpec(
        proximal="sampler", loss=_loss(surrogate="cispo", cispo_high=2.0),
        score_centering=ScoreCenteringConfig(weight="tis", weight_high=2.0,
                                             aggregation="seq_mean_token_sum"),
        description="CISPO + score centering, both capped at 2"),
    "grpo": EstimatorSpec(
        advantage="grpo", loss=PolicyLossConfig(**_REINFORCE, aggregation="seq_mean_token_mean"),
        description="GRPO advantages (mean/std), sequence-mean of token-mean"),
    "dr_grpo": EstimatorSpec(
        advantage="dr_grpo", loss=PolicyLossConfig(**_REINFORCE, aggregation="seq_sum_norm",
                                                    norm_constant=1.0),
        description="Dr.GRPO advantages (mean only), constant normaliser"),
    "rloo": EstimatorSpec(
        advantage="rloo", loss=_loss(**_REINFORCE),
        description="RLOO advantages (leave-one-out), token sum"),
}


def resolve(name: str, custom: dict[str, EstimatorSpec] | None = None) -> EstimatorSpec:
    """The preset or custom estimator called `name`; a clear error names the choices."""
    table = {**PRESETS, **(custom or {})}
    if name not in table:
        raise ValueError(f"unknown estimator {name!r}; presets: {', '.join(PRESETS)}"
                         + (f"; custom: {', '.join(custom)}" if custom else "")
                         + " (define your own under [estimators.custom.NAME])")
    return table[name]


PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)
