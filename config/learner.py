"""Typed learner configuration; pydantic only, no torch, so the job config can embed it.

Every choice of the essay is a `Literal` field; users write these names in TOML. A model
refuses unknown keys and inconsistent combinations with a message that says which value to
change and to what. `learner.losses` re-exports `PolicyLossConfig` and `ScoreCenteringConfig`.

Conventions that differ from verl or TRL are listed in docs/losses.md; the defaults here are
PPO with a symmetric 0.2 clip, no dual clip, no behaviour correction and token-mean
aggregation.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from config.base import ConfigSection as _Strict
from config.base import Seed

Surrogate = Literal["reinforce", "ppo", "gspo", "gspo_token", "cispo"]
Correction = Literal["none", "tis", "mis"]
CorrectionLevel = Literal["token", "sequence"]
RatioBase = Literal["proximal", "current"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_sum_norm"]
KlEstimator = Literal["k1", "k3"]
Estimator = Literal["grpo", "dr_grpo", "rloo", "gae", "turn_leave_one_out",
                    "turn_index_normalised"]
OutcomeEstimator = Literal["grpo", "dr_grpo", "rloo"]


def _check_norm_constant(owner: str, aggregation: str, norm_constant: float | None) -> None:
    if aggregation == "seq_sum_norm" and norm_constant is None:
        raise ValueError(
            f"{owner}: aggregation 'seq_sum_norm' divides by S * norm_constant; set norm_constant "
            "to a fixed number such as the maximum generation length (e.g. norm_constant = 1024)"
        )


def _check_weight_bounds(
    owner: str, mode: str, low_name: str, low: float | None, high_name: str, high: float | None
) -> None:
    if mode == "tis" and high is None:
        raise ValueError(
            f"{owner}: truncated IS ('tis') caps the weight at {high_name}; set {high_name} "
            f"(e.g. {high_name} = 2.0), and optionally {low_name} as a floor"
        )
    if mode == "mis" and low is None and high is None:
        raise ValueError(
            f"{owner}: masked IS ('mis') keeps tokens with {low_name} <= weight <= {high_name}; "
            f"set at least one of them (IcePop uses {low_name} = 0.5, {high_name} = 2.0)"
        )
    if low is not None and high is not None and low >= high:
        raise ValueError(f"{owner}: {low_name} ({low}) must be below {high_name} ({high})")


class PolicyLossConfig(_Strict):
    """The policy loss: surrogate, behaviour correction, aggregation and KL penalty."""

    surrogate: Surrogate = Field("ppo", description="reinforce | ppo | gspo | gspo_token | cispo")
    clip_low: float = Field(
        0.2, ge=0.0, lt=1.0, description="ppo/gspo: ratio is clipped below at 1 - clip_low"
    )
    clip_high: float = Field(
        0.2,
        ge=0.0,
        description="ppo/gspo: ratio is clipped above at 1 + clip_high "
        "(DAPO's clip-higher uses 0.28)",
    )
    dual_clip: float | None = Field(
        None,
        gt=1.0,
        description="ppo: for A < 0 the loss is at most -dual_clip * A; "
        "None = off (verl's default is 3.0)",
    )
    cispo_low: float | None = Field(
        None, ge=0.0, description="cispo: absolute floor of the detached ratio; None = none"
    )
    cispo_high: float = Field(5.0, gt=0.0, description="cispo: absolute cap of the detached ratio")
    correction: Correction = Field("none", description="behaviour correction: none | tis | mis")
    correction_level: CorrectionLevel = Field("token", description="token | sequence")
    correction_low: float | None = Field(
        None, ge=0.0, description="tis: optional floor; mis: lower keep bound"
    )
    correction_high: float | None = Field(  # inf: no cap (nan fails gt)
        None, gt=0.0, allow_inf_nan=True, description="tis: cap; mis: upper keep bound"
    )
    correction_entropy: bool = Field(
        False,
        description="token-level tis/mis: scale the bounds' logs per token by "
        "s(H) = sqrt((1 - exp(-H)) / (1 - exp(-1))) (floor 0.05), H the entropy of pi_old there: "
        "tighter where the policy is sure, wider where it explores (docs/losses.md)",
    )
    ratio_base: RatioBase = Field(
        "proximal",
        description="behaviour ratio from pi_old (proximal) or the detached current pi (current)",
    )
    masked_in_denominator: bool = Field(
        True, description="tokens zeroed by mis still count in the aggregation's denominators"
    )
    aggregation: Aggregation = Field("token_mean", description="how per-token losses are combined")
    norm_constant: float | None = Field(
        None, gt=0.0, description="seq_sum_norm's constant (Dr.GRPO), e.g. max tokens"
    )
    kl_coef: float = Field(
        0.0, ge=0.0, description="coefficient of the KL penalty to the reference"
    )
    kl_estimator: KlEstimator = Field("k3", description="k1 (log ratio) or k3 (low-variance, >= 0)")

    @model_validator(mode="after")
    def _consistent(self) -> PolicyLossConfig:
        _check_norm_constant("PolicyLossConfig", self.aggregation, self.norm_constant)
        _check_weight_bounds(
            "PolicyLossConfig",
            self.correction,
            "correction_low",
            self.correction_low,
            "correction_high",
            self.correction_high,
        )
        if self.correction_entropy and (self.correction == "none"
                                        or self.correction_level != "token"):
            raise ValueError(
                "PolicyLossConfig: correction_entropy scales token-level bounds; set correction "
                "= 'tis' or 'mis' and correction_level = 'token', or remove correction_entropy"
            )
        if self.cispo_low is not None and self.cispo_low >= self.cispo_high:
            raise ValueError(
                f"PolicyLossConfig: cispo_low ({self.cispo_low}) must be below "
                f"cispo_high ({self.cispo_high}); these are absolute ratio bounds"
            )
        if self.dual_clip is not None and self.surrogate != "ppo":
            raise ValueError(
                f"PolicyLossConfig: dual_clip applies to surrogate 'ppo' only; remove "
                f"it or set surrogate = 'ppo' (got '{self.surrogate}')"
            )
        return self


class ScoreCenteringConfig(_Strict):
    """Score centering: subtract the sampler's expected score at every position."""

    weight: Correction = Field(
        "none", description="weight of pi_trainer/mu_sampler: none | tis | mis"
    )
    weight_low: float | None = Field(
        None, ge=0.0, description="tis: optional floor; mis: lower bound"
    )
    weight_high: float | None = Field(None, gt=0.0, description="tis: cap; mis: upper bound")
    aggregation: Aggregation = Field(
        "token_mean",
        description="use the policy loss's aggregation so the two "
        "terms add up to the centered estimator",
    )
    norm_constant: float | None = Field(None, gt=0.0, description="seq_sum_norm's constant")

    @model_validator(mode="after")
    def _consistent(self) -> ScoreCenteringConfig:
        _check_norm_constant("ScoreCenteringConfig", self.aggregation, self.norm_constant)
        _check_weight_bounds(
            "ScoreCenteringConfig",
            self.weight,
            "weight_low",
            self.weight_low,
            "weight_high",
            self.weight_high,
        )
        return self


class AdvantageConfig(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "overlong" in data:
            raise ValueError(
                "learner.advantage.overlong moved to [admission]: overlong = 'penalize', "
                "overlong_cache_len and overlong_factor (the penalty is judged against each "
                "task's token budget and recorded in the admission decision)")
        return data

    estimator: Estimator = Field(
        "grpo", description="grpo | dr_grpo | rloo | gae (needs the critic) | turn_leave_one_out "
        "(per-turn credit from the tools' per-turn rewards, unbiased) | turn_index_normalised "
        "(per-turn rewards z-scored by turn index: biased, a length bonus; for comparison)"
    )
    eps: float = Field(1e-6, gt=0.0, description="grpo: added to the group std")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="gae discount")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="gae lambda")
    whiten: bool = Field(True, description="gae: whiten advantages over the batch's loss tokens")
    drop_zero_variance_groups: bool = Field(
        False, description="drop groups whose rewards are all equal before the update"
    )
    baseline: Literal["mean", "min_variance"] = Field(
        "mean",
        description="min_variance (VCPO): group baselines weighted by each trajectory's squared "
        "importance ratio pi_old / mu over its sampled tokens, the variance-minimising constant "
        "baseline for off-policy data; grpo, dr_grpo and rloo only",
    )

    @model_validator(mode="after")
    def _baseline_needs_groups(self) -> AdvantageConfig:
        if self.baseline != "mean" and self.estimator not in ("grpo", "dr_grpo", "rloo"):
            raise ValueError(f"learner.advantage.baseline = 'min_variance' weights the group "
                             f"baselines of grpo, dr_grpo and rloo; estimator "
                             f"{self.estimator!r} has none of them (use one of those three)")
        return self


class OptimizerConfig(_Strict):
    lr: float = Field(1e-5, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="None = no clipping")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up of the lr over optimizer steps")
    ess_lr: bool = Field(
        False,
        description="VCPO: each learner step's lr times the effective-sample-size fraction "
        "(sum w)^2 / (n sum w^2) of its trajectories' importance ratios pi_old / mu",
    )


class CriticConfig(_Strict):
    """The value model for `gae`: the policy's trunk architecture with a scalar head."""

    lr: float = Field(1e-4, gt=0.0)
    loss_coef: float = Field(0.5, gt=0.0, description="multiplies the squared error")
    value_clip: float | None = Field(None, gt=0.0, description="PPO value clipping; None = off")
    max_grad_norm: float | None = Field(1.0, gt=0.0)


LrSchedule = Literal["constant", "cosine"]


class SftStage(_Strict):
    """An SFT stage on another task family's demonstrations, run before the job family's own
    (a curriculum): a short task can teach the chat format and copying values out of tool
    output, which a long task's sparse signal teaches slowly. Unset fields take the [sft]
    table's values."""

    family: str = Field(..., description="task family (entry point or file.py:attr)")
    options: dict[str, Any] = Field(default_factory=dict, description="the family's options")
    demonstrations: int | None = Field(None, ge=1)
    wrong_fraction: float | None = Field(None, ge=0.0, le=1.0)
    steps: int = Field(..., ge=1)
    lr: float | None = Field(None, gt=0.0)
    batch_size: int | None = Field(None, ge=1)
    lr_schedule: LrSchedule | None = None
    warmup_steps: int | None = Field(None, ge=0)


class SftRetry(_Strict):
    """The settings of a further SFT try (`restart_below`); unset fields keep the [sft] table's.
    On a small model the same demonstrations can form a skill under one schedule and stall under
    another (docs/tasks.md), so a retry changes the schedule or the order, not the data."""

    steps: int | None = Field(None, ge=1)
    lr: float | None = Field(None, gt=0.0)
    lr_schedule: LrSchedule | None = None
    warmup_steps: int | None = Field(None, ge=0)
    shuffle_seed: Seed | None = Field(None, description="the demonstration order's seed")

    @model_validator(mode="after")
    def _changes_something(self) -> SftRetry:
        if not self.model_dump(exclude_none=True):
            raise ValueError("an sft retry with no settings repeats the first try: set steps, "
                             "lr, lr_schedule, warmup_steps or shuffle_seed")
        return self


class SftConfig(_Strict):
    """Supervised fine-tuning: the job's warm start (`enabled`) on the task family's
    demonstrations, and `stalewise learner sft`."""

    enabled: bool = Field(False, description="warm-start a job by SFT before RL")
    demonstrations: int = Field(256, ge=1, description="demonstrations the warm start takes")
    wrong_fraction: float = Field(0.0, ge=0.0, le=1.0, description="share of wrong demonstrations")
    lr: float = Field(3e-3, gt=0.0)
    steps: int = Field(200, ge=1)
    batch_size: int = Field(16, ge=1, description="demonstrations per optimizer step")
    micro_batch_size: int = Field(8, ge=1)
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    lr_schedule: LrSchedule = Field(
        "constant", description="constant, or cosine decay to 0 over the steps after warmup")
    warmup_steps: int = Field(0, ge=0, description="linear warmup from 0 to lr")
    select_every: int = Field(
        0, ge=0, description="every N steps (and at the end) score the checkpoint on "
        "`select_instances` instances of the validation split, and keep the best-scoring "
        "one instead of the last (0 = keep the last); the family's own demonstrations only, not "
        "stages")
    select_instances: int = Field(64, ge=1, description="instances `select_every` scores on")
    restart_below: float = Field(
        0.0, ge=0.0, le=1.0, description="with select_every and retries: when a try's best score "
        "stays below this, train again from the same starting weights with the next "
        "`[[sft.retries]]` settings, and keep the best try (0 = never)")
    retries: list[SftRetry] = Field(
        default_factory=list, description="the settings of each further try `restart_below` "
        "starts, in order (`[[learner.sft.retries]]`)")
    seed: Seed = Field(0, description="the demonstrations' and their order's seed; in a job, "
                      "the learner's seed unless set here")
    stages: list[SftStage] = Field(
        default_factory=list,
        description="earlier stages on other task families, in order (`[[learner.sft.stages]]`)")

    @model_validator(mode="after")
    def _restart_needs_selection(self) -> SftConfig:
        if self.restart_below > 0 and self.select_every == 0:
            raise ValueError(
                f"sft.restart_below = {self.restart_below} needs a score to compare with it: set "
                "sft.select_every (for example 50) and select_instances, or restart_below = 0")
        if self.restart_below > 0 and not self.retries:
            raise ValueError(
                f"sft.restart_below = {self.restart_below} has no further try to start: add a "
                "[[learner.sft.retries]] table (for example steps = 800), or restart_below = 0")
        return self

    def tries(self) -> list[SftConfig]:
        """The settings of every try `restart_below` may run: this table's, then each retry's
        in its place (`shuffle_seed` as `seed`)."""
        tries = [self]
        for retry in self.retries:
            own = retry.model_dump(exclude={"shuffle_seed"}, exclude_none=True)
            if retry.shuffle_seed is not None:
                own["seed"] = retry.shuffle_seed
            tries.append(self.model_copy(update={**own, "retries": []}))
        return tries

    def for_stage(self, stage: SftStage) -> SftConfig:
        """This table with a stage's settings in place of its own."""
        own = stage.model_dump(exclude={"family", "options"}, exclude_none=True)
        return self.model_copy(update={**own, "stages": []})


class LearnerConfig(_Strict):
    """Everything the trainer process needs besides its model directory and data source."""

    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    score_centering: ScoreCenteringConfig | None = Field(
        None, description="score centering on top of the policy loss; needs sampler top-k"
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    sft: SftConfig = Field(default_factory=SftConfig)
    batch_size: int = Field(32, ge=1, description="samples consumed per learner step")
    mini_batch_size: int | None = Field(
        None, ge=1, description="samples per optimizer step; None = the batch"
    )
    micro_batch_size: int = Field(8, ge=1, description="samples per forward/backward")
    epochs: int = Field(1, ge=1, description="passes over each batch")
    publish_every: int = Field(1, ge=1, description="publish weights every N learner steps")
    keep_checkpoints: int = Field(
        3, ge=0, description="published versions kept on disk, newest first (older directories "
        "are deleted; only the newest keeps its optimizer state); 0 keeps every version"
    )
    reference_model: str | None = Field(
        None, description="checkpoint for the KL reference; None = the starting checkpoint"
    )
    device: str = Field("cpu", description="torch device, e.g. 'cpu' or 'cuda'")
    threads: int | None = Field(
        None, ge=1, description="torch CPU threads of `learner serve` (the job's learner); None "
        "= torch's default, one per core. Where the engine and sandboxes share the cores, 1 "
        "avoids oversubscription (bench/learner_threads.py measures it)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="the products of the forward and backward passes (torch autocast); "
        "weights, gradients and optimizer state stay float32. 'auto': bfloat16 on CUDA and on a "
        "CPU with bfloat16 instructions for a model at least 512 wide, else float32 "
        "(core.numerics)")
    gap_probe: bool = Field(
        False, description="each step, measure the sampler/trainer log-prob gap of the lag-0 "
        "tokens (sampled with the weights being trained) under float32 and under bfloat16 "
        "products: metrics numerics/gap_<dtype>_mean|p99|max (one extra no-grad forward, in "
        "the precision the learner does not train in)")
    seed: Seed = Field(0, description="torch's seed in the learner; in a job, run.seed unless "
                      "set here")
    record_trainer_logprobs: bool = Field(
        True, description="store the learner's log-prob of every trained token (per model "
        "call) for the viewer and `audit show`")
    trainer_logprobs_every: int = Field(
        1, ge=1, description="record the trainer's log-probs on one learner step in N")
    workers: int = Field(
        1, ge=1, description="data-parallel learner processes (torch.distributed: gloo on CPU, "
        "NCCL on CUDA); each trains on a share of every batch's groups (learner.distributed)")

    @model_validator(mode="after")
    def _consistent(self) -> LearnerConfig:
        if self.mini_batch_size is not None and self.mini_batch_size < self.micro_batch_size:
            raise ValueError(
                f"LearnerConfig: mini_batch_size ({self.mini_batch_size}) must be at "
                f"least micro_batch_size ({self.micro_batch_size})"
            )
        sc = self.score_centering
        if sc is not None and sc.aggregation != self.loss.aggregation:
            raise ValueError(
                f"LearnerConfig: score_centering.aggregation ('{sc.aggregation}') differs from "
                f"loss.aggregation ('{self.loss.aggregation}'); set them equal so the correction "
                "centers the policy gradient it is added to"
            )
        if sc is not None and sc.norm_constant != self.loss.norm_constant:
            raise ValueError(
                f"LearnerConfig: score_centering.norm_constant ({sc.norm_constant}) differs from "
                f"loss.norm_constant ({self.loss.norm_constant}); set them equal"
            )
        return self


class WarmStartJob(_Strict):
    """What a job's SFT child is given, as its one file (RUN/sft.json): the learner section (the
    `[sft]` table with its resolved seed) and the task family whose demonstrations it trains on,
    in the job's chat format (`python -m learner sft MODEL --out OUT --job RUN/sft.json`)."""

    learner: LearnerConfig
    family: str
    options: dict[str, Any] = Field(default_factory=dict)
    chat_format: str = "auto"
    tool_listing: str = "json"
