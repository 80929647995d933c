"""The lab's config: one TOML file (`configs/lab.toml`), one typed tree.

Sections: `[policy]` (the tractable Markov policy), `[reward]`, `[durations]` (the long-tail
duration model), `[estimators]` (the bias/variance grid; `[[estimators.mismatch]]` entries and
`[estimators.custom.NAME]` user-defined estimators), `[learning]` (the learning-per-compute
simulation; `[[learning.modes]]` entries) and `[selection]` (admission's selection bias and its
corrections) and `[turns]` (per-turn rewards and their baselines). Each of the last four has a
`quick` table whose set
fields replace the full run's values under `--quick`.

Guarantees: unknown keys, bad choices and inconsistent values are refused with one line per
problem naming the field and how to fix it (`config.errors.ConfigError`); estimator
names are checked against the presets and custom estimators; this module imports no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from config.base import ConfigSection as _Section
from config.errors import read_toml, validate
from lab.estimator_spec import PRESET_NAMES, EstimatorSpec
from lab.levels import MismatchKind, check_level


class PolicySection(_Section):
    vocab_size: int = Field(8, ge=2, le=64, description="tokens, the stop token included (4-16 "
                                                         "keeps exact enumeration tests cheap)")
    num_prompts: int = Field(4, ge=1, le=64, description="prompts; each has its own logit table")
    stop_token: bool = Field(True, description="id vocab_size - 1 ends a response (variable length)")
    init_scale: float = Field(1.0, ge=0.0, description="std of the random initial logits")
    length_fraction: float = Field(0.5, gt=0.0, le=1.0,
                                   description="initial stop logit gives lengths ~ fraction * T")
    seed: int = 0


class RewardSection(_Section):
    terminal: float = Field(1.0, description="weight of a random 0/1 reward of the final state")
    terminal_success: float = Field(0.5, ge=0.0, le=1.0,
                                    description="share of final states that earn the terminal reward")
    per_token: float = Field(0.0, description="weight of random N(0, 1) per-token rewards")
    pattern: list[int] = Field(default_factory=list, description="token ids whose occurrences count")
    pattern_weight: float = Field(0.0, description="reward per occurrence of `pattern`")
    truncation: float = Field(0.0, description="added when a response hits the horizon")
    constant: float = Field(0.0, description="added to every response (grad J stays the same)")
    prompt_scale: list[float] | None = Field(
        None, description="per-prompt multipliers of every reward (different reward spread per "
                          "group); one entry per prompt")
    seed: int = 1


class DurationsSection(_Section):
    per_token: float = Field(1.0, gt=0.0, description="time units per token at full speed")
    tail_index: float = Field(2.0, gt=1.0, description="Pareto index of the slowdown (smaller = "
                                                       "longer tail; > 1)")
    difficulty_coupling: float = Field(1.0, ge=0.0,
                                       description="log-slowdown of the hardest prompt")


class MismatchSection(_Section):
    kind: MismatchKind
    levels: list[float] = Field(..., min_length=1)
    step_norm: float = Field(0.5, gt=0.0, description="stale/prefix_switch: norm of one update")
    kv_residual: float = Field(0.0, ge=0.0, le=1.0,
                               description="prefix_switch: share of the old logits kept after "
                                           "the switch (retained KV); 0 = recomputed")


class EstimatorsQuick(_Section):
    presets: list[str] | None = None
    horizons: list[int] | None = None
    replicates: int | None = Field(None, ge=2)
    max_levels: int | None = Field(None, ge=1, description="keep this many levels per mismatch "
                                                           "(evenly spaced, first and last kept)")


class EstimatorsSection(_Section):
    presets: list[str] = Field(default_factory=lambda: list(PRESET_NAMES))
    custom: dict[str, EstimatorSpec] = Field(default_factory=dict)
    horizons: list[int] = Field(default_factory=lambda: [4, 16, 64], min_length=1)
    group_size: int = Field(4, ge=1)
    batch_size: int = Field(16, ge=1, description="responses per estimate; a multiple of group_size")
    replicates: int = Field(1000, ge=2, description="independent estimates per row")
    topk: int = Field(0, ge=0, description="sampler top-k recorded for score centering; 0 = vocab")
    mismatch: list[MismatchSection] = Field(
        default_factory=lambda: [MismatchSection(kind="stale", levels=[0, 1, 2, 4])])
    seed: int = 0
    quick: EstimatorsQuick = Field(default_factory=EstimatorsQuick)

    @model_validator(mode="after")
    def _consistent(self) -> EstimatorsSection:
        if self.batch_size % self.group_size:
            raise ValueError(f"estimators.batch_size ({self.batch_size}) must be a multiple of "
                             f"estimators.group_size ({self.group_size})")
        if any(h < 1 or h > 4096 for h in self.horizons):
            raise ValueError(f"estimators.horizons must be in 1..4096, got {self.horizons}")
        return self


class ModeSection(_Section):
    name: Literal["sync", "async", "inflight"]
    max_lag: int = Field(0, ge=0, description="async/inflight: drop groups older than this many "
                                              "versions when the learner takes them")
    kv_residual: float = Field(0.0, ge=0.0, le=1.0,
                               description="inflight: share of the old logits kept after a "
                                           "weight update (retained KV); 0 = recomputed")
    label: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ModeSection:
        if self.name == "sync" and self.max_lag:
            raise ValueError("learning.modes: 'sync' trains only on fresh data; remove max_lag")
        if self.name != "inflight" and self.kv_residual:
            raise ValueError("learning.modes: kv_residual applies to 'inflight' only")
        return self

    @property
    def title(self) -> str:
        if self.label:
            return self.label
        if self.name == "sync":
            return "sync"
        suffix = f"+kv{self.kv_residual:g}" if self.kv_residual else ""
        return f"{self.name}(L={self.max_lag}){suffix}"


class SamplerSection(_Section):
    temperature: float = Field(1.0, gt=0.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    logit_noise: float = Field(0.0, ge=0.0, description="fixed N(0, s^2) added to the sampler's "
                                                        "logits (quantisation stand-in)")


class LearningQuick(_Section):
    presets: list[str] | None = None
    updates: int | None = Field(None, ge=1)
    seeds: int | None = Field(None, ge=1)


class LearningSection(_Section):
    presets: list[str] = Field(default_factory=lambda: ["no_correction", "token_tis", "cispo",
                                                        "trajectory_is"])
    modes: list[ModeSection] = Field(default_factory=lambda: [
        ModeSection(name="sync"), ModeSection(name="async", max_lag=2),
        ModeSection(name="inflight", max_lag=2)], min_length=1)
    horizon: int = Field(16, ge=1, le=1024)
    batch_size: int = Field(32, ge=1, description="responses per update; a multiple of group_size")
    group_size: int = Field(4, ge=1)
    slots: int = Field(32, ge=1, description="trajectories generated concurrently")
    train_time: float = Field(8.0, ge=0.0, description="time units per learner update")
    updates: int = Field(150, ge=1)
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = Field(0.05, gt=0.0)
    seeds: int = Field(2, ge=1)
    topk: int = Field(0, ge=0, description="sampler top-k recorded; 0 = vocab")
    target_fraction: float = Field(0.8, gt=0.0, le=1.0,
                                   description="target J = J0 + fraction * (J_best - J0)")
    target_return: float | None = Field(None, description="absolute target J (overrides fraction)")
    sampler: SamplerSection = Field(default_factory=SamplerSection)
    quick: LearningQuick = Field(default_factory=LearningQuick)

    @model_validator(mode="after")
    def _consistent(self) -> LearningSection:
        if self.batch_size % self.group_size:
            raise ValueError(f"learning.batch_size ({self.batch_size}) must be a multiple of "
                             f"learning.group_size ({self.group_size})")
        titles = [m.title for m in self.modes]
        if len(set(titles)) != len(titles):
            raise ValueError(f"learning.modes has duplicates {titles}; give each a distinct label")
        return self


class SelectionQuick(_Section):
    replicates: int | None = Field(None, ge=2)


class SelectionSection(_Section):
    """`stalewise lab selection`: admission's selection bias and its corrections
    (lab/selection.py)."""

    horizon: int = Field(16, ge=1, le=1024)
    estimator: str = Field("no_correction", description="preset or custom estimator whose loss "
                                                         "is used")
    advantage: Literal["grpo", "dr_grpo", "rloo", "raw"] = Field(
        "raw", description="raw (no baseline) keeps the uncorrected rows free of baseline "
                           "effects of partial groups; rloo etc. need group_size >= 2")
    group_size: int = Field(1, ge=1)
    batch_size: int = Field(16, ge=1, description="responses generated per estimate")
    replicates: int = Field(2000, ge=2, description="independent estimates per row")
    steps_per_trajectory: float = Field(
        1.0, gt=0.0, description="learner steps during a trajectory of mean duration (the "
                                 "step rate); higher drops more slow work")
    max_lag: int = Field(0, ge=0, le=16, description="steps a trajectory may span and be admitted")
    clip: float = Field(5.0, ge=1.0, description="largest propensity weight (core.selection)")
    prior: float = Field(2.0, ge=0.0, description="pseudo-counts shrinking each bucket's "
                                                  "admission rate toward the mean")
    pacing_tv: float = Field(0.02, gt=0.0, lt=1.0, description="pacing's bound on the admitted "
                                                               "mix's TV")
    pacing_factors: list[float] = Field(
        default_factory=lambda: [1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0],
        min_length=1, description="learner slow-downs pacing tries, smallest first")
    seed: int = 0
    quick: SelectionQuick = Field(default_factory=SelectionQuick)

    @model_validator(mode="after")
    def _consistent(self) -> SelectionSection:
        if self.batch_size % self.group_size:
            raise ValueError(f"selection.batch_size ({self.batch_size}) must be a multiple of "
                             f"selection.group_size ({self.group_size})")
        if self.advantage != "raw" and self.group_size < 2:
            raise ValueError(f"selection.advantage = {self.advantage!r} needs group_size >= 2 "
                             "(a baseline from the other members); use advantage = \"raw\"")
        if any(f < 1.0 for f in self.pacing_factors) or \
                self.pacing_factors != sorted(self.pacing_factors):
            raise ValueError(f"selection.pacing_factors must be >= 1 and ascending, got "
                             f"{self.pacing_factors}")
        return self


class TurnsQuick(_Section):
    replicates: int | None = Field(None, ge=2)


class TurnsSection(_Section):
    """`stalewise lab turns`: per-turn rewards and their baselines (lab/turns.py)."""

    horizon: int = Field(8, ge=2, le=256, description="turns (tokens) at most")
    per_token: float = Field(1.0, gt=0.0, description="scale of the N(0, 1) reward of each turn")
    turn_means: list[float] = Field(
        default_factory=lambda: [0.0, -0.3, 0.3], min_length=1,
        description="added to every turn's reward, one world each: < 0 a cost per turn, > 0 a "
                    "gain per turn")
    group_size: int = Field(4, ge=2)
    batch_size: int = Field(16, ge=2, description="responses per estimate")
    replicates: int = Field(4000, ge=2)
    seed: int = 0
    quick: TurnsQuick = Field(default_factory=TurnsQuick)

    @model_validator(mode="after")
    def _consistent(self) -> TurnsSection:
        if self.batch_size % self.group_size:
            raise ValueError(f"turns.batch_size ({self.batch_size}) must be a multiple of "
                             f"turns.group_size ({self.group_size})")
        return self


class LabConfig(_Section):
    policy: PolicySection = Field(default_factory=PolicySection)
    reward: RewardSection = Field(default_factory=RewardSection)
    durations: DurationsSection = Field(default_factory=DurationsSection)
    estimators: EstimatorsSection = Field(default_factory=EstimatorsSection)
    learning: LearningSection = Field(default_factory=LearningSection)
    selection: SelectionSection = Field(default_factory=SelectionSection)
    turns: TurnsSection = Field(default_factory=TurnsSection)
    output_dir: str = Field("var/lab", description="JSON and plots are written here")

    @model_validator(mode="after")
    def _consistent(self) -> LabConfig:
        policy, reward = self.policy, self.reward
        if reward.prompt_scale is not None and len(reward.prompt_scale) != policy.num_prompts:
            raise ValueError(f"reward.prompt_scale has {len(reward.prompt_scale)} entries but "
                             f"policy.num_prompts is {policy.num_prompts}; give one per prompt")
        content = policy.vocab_size - 1 if policy.stop_token else policy.vocab_size
        if any(not 0 <= t < content for t in reward.pattern):
            raise ValueError(f"reward.pattern ids must be content tokens 0..{content - 1} (the "
                             f"stop token cannot be part of a pattern), got {reward.pattern}")
        known = set(PRESET_NAMES) | set(self.estimators.custom)
        for where, names in (("estimators.presets", self.estimators.presets),
                             ("estimators.quick.presets", self.estimators.quick.presets or []),
                             ("learning.presets", self.learning.presets),
                             ("learning.quick.presets", self.learning.quick.presets or []),
                             ("selection.estimator", [self.selection.estimator])):
            unknown = [n for n in names if n not in known]
            if unknown:
                raise ValueError(f"{where}: unknown estimators {unknown}; choose from "
                                 f"{sorted(known)} or define [estimators.custom.NAME]")
        for topk_owner, topk in (("estimators.topk", self.estimators.topk),
                                 ("learning.topk", self.learning.topk)):
            if topk > policy.vocab_size:
                raise ValueError(f"{topk_owner} ({topk}) exceeds policy.vocab_size "
                                 f"({policy.vocab_size}); use 0 for the whole vocabulary")
        _check_levels(self.estimators.mismatch, policy.vocab_size)
        return self

    def quick(self) -> LabConfig:
        """The config with each section's `quick` overrides applied."""
        est, learn = self.estimators, self.learning
        est_update = {k: v for k, v in est.quick.model_dump().items()
                      if v is not None and k != "max_levels"}
        if est.quick.max_levels is not None:
            est_update["mismatch"] = [m.model_copy(update={"levels": thin_levels(
                m.levels, est.quick.max_levels)}) for m in est.mismatch]
        learn_update = {k: v for k, v in learn.quick.model_dump().items() if v is not None}
        sel, turns = self.selection, self.turns
        sel_update = {k: v for k, v in sel.quick.model_dump().items() if v is not None}
        turns_update = {k: v for k, v in turns.quick.model_dump().items() if v is not None}
        return self.model_copy(update={"estimators": est.model_copy(update=est_update),
                                       "learning": learn.model_copy(update=learn_update),
                                       "selection": sel.model_copy(update=sel_update),
                                       "turns": turns.model_copy(update=turns_update)})


def thin_levels(levels: list[float], keep: int) -> list[float]:
    """At most `keep` levels, evenly spaced, first and last kept."""
    if len(levels) <= keep:
        return list(levels)
    if keep == 1:
        return [levels[-1]]
    step = (len(levels) - 1) / (keep - 1)
    return [levels[round(i * step)] for i in range(keep)]


def _check_levels(mismatches: list[MismatchSection], vocab_size: int) -> None:
    for i, m in enumerate(mismatches):
        for level in m.levels:
            problem = check_level(m.kind, level, vocab_size)
            if problem:
                raise ValueError(f"estimators.mismatch[{i}].levels: {problem}")


def parse_lab_config(data: dict[str, Any], source: str = "<lab config>") -> LabConfig:
    return validate(LabConfig, data, source)


def load_lab_config(path: str | Path) -> LabConfig:
    return parse_lab_config(read_toml(path, "a lab TOML config such as configs/lab.toml"),
                            str(path))
