"""The bias ledger: what was generated versus what reached the learner, and how it differs.

Admission rules (dropping stale or slow work, dynamic sampling) change the data the model learns
from. The ledger makes that selection visible: per task family and difficulty bucket, and per
duration quartile, it counts generated and admitted trajectories, exclusions by reason, and
compares mean reward and duration of admitted versus excluded work. The run-level skew figures
are total-variation distances between the generated and admitted distributions over difficulty
buckets and over duration quartiles (0 = no selection effect, 1 = disjoint), plus the shift in
mean reward and the share of generation compute spent on excluded work. With `[admission]
reweight = "propensity"` the same two TVs are also given for the admitted mix weighted by each
trajectory's selection weight (`core.selection`): what the learner's loss sees. Whatever the
weights, the share of generated work beyond them (buckets of task and duration quartile that
kept under 1/clip of the mean admitted rate, or nothing) says how much of the skew no
reweighting can undo.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from statistics import fmean
from typing import Iterable, Sequence

from core.selection import DEFAULT_CLIP, beyond_weights_share, quartile, quartile_cuts, weighted_tv


@dataclass(frozen=True)
class Generated:
    """One finished trajectory and what admission made of it."""

    family: str
    difficulty: str
    duration_s: float
    reward: float | None
    sampled_tokens: int
    admitted: bool  # reached the learner's loss (masked members are not admitted)
    reason: str  # the final decision's reason, or "undecided"
    weight: float = 1.0  # selection weight of an admitted trajectory (core.selection)


@dataclass
class LedgerRow:
    family: str
    difficulty: str
    duration_quantile: int | None
    generated: int = 0
    admitted: int = 0
    excluded_by_reason: dict[str, int] = field(default_factory=dict)
    mean_reward_admitted: float | None = None
    mean_reward_excluded: float | None = None
    mean_duration_admitted: float | None = None
    mean_duration_excluded: float | None = None


@dataclass(frozen=True)
class Skew:
    difficulty_tv: float
    duration_tv: float
    reward_shift: float | None  # mean reward admitted - mean reward generated
    generated: int
    admitted: int
    excluded_token_share: float  # sampled tokens of excluded work / all sampled tokens
    # the same TVs for the admitted mix weighted by the selection weights (= the above when
    # every weight is 1)
    weighted_difficulty_tv: float = 0.0
    weighted_duration_tv: float = 0.0
    # generated work in (task, duration quartile) buckets that selection weights clipped at
    # `clip` cannot restore (core.selection.beyond_weights_share)
    beyond_weights_share: float = 0.0


def _mean(values: Iterable[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return fmean(values) if values else None


def _row(family: str, difficulty: str, quantile: int | None,
         items: Sequence[Generated]) -> LedgerRow:
    admitted = [g for g in items if g.admitted]
    excluded = [g for g in items if not g.admitted]
    return LedgerRow(
        family=family, difficulty=difficulty, duration_quantile=quantile,
        generated=len(items), admitted=len(admitted),
        excluded_by_reason=dict(Counter(g.reason for g in excluded)),
        mean_reward_admitted=_mean(g.reward for g in admitted),
        mean_reward_excluded=_mean(g.reward for g in excluded),
        mean_duration_admitted=_mean(g.duration_s for g in admitted),
        mean_duration_excluded=_mean(g.duration_s for g in excluded))


def build_ledger(items: Sequence[Generated], *,
                 clip: float = DEFAULT_CLIP) -> tuple[list[LedgerRow], Skew]:
    """The ledger's rows and the run's skew; `clip` is the largest selection weight
    (`[admission] reweight_clip`), for `Skew.beyond_weights_share`."""
    by_bucket: dict[tuple[str, str], list[Generated]] = defaultdict(list)
    for g in items:
        by_bucket[(g.family, g.difficulty)].append(g)
    rows = [_row(f, d, None, group) for (f, d), group in sorted(by_bucket.items())]

    cuts = quartile_cuts([g.duration_s for g in items])
    by_quartile: dict[tuple[str, int], list[Generated]] = defaultdict(list)
    for g in items:
        by_quartile[(g.family, quartile(g.duration_s, cuts))].append(g)
    rows += [_row(f, "*", q, group) for (f, q), group in sorted(by_quartile.items())]

    admitted = [g for g in items if g.admitted]
    total_tokens = sum(g.sampled_tokens for g in items)
    mean_generated, mean_admitted = _mean(g.reward for g in items), _mean(g.reward for g in admitted)
    def tasks(gs: Sequence[Generated]) -> list[tuple[str, str]]:
        return [(g.family, g.difficulty) for g in gs]

    def quartiles(gs: Sequence[Generated]) -> list[int]:
        return [quartile(g.duration_s, cuts) for g in gs]

    weights = [g.weight for g in admitted]
    joint = list(zip(tasks(items), quartiles(items)))  # the selection weights' buckets
    kept = [bucket for bucket, g in zip(joint, items) if g.admitted]
    skew = Skew(
        difficulty_tv=weighted_tv(tasks(items), tasks(admitted)),
        duration_tv=weighted_tv(quartiles(items), quartiles(admitted)),
        weighted_difficulty_tv=weighted_tv(tasks(items), tasks(admitted), weights),
        weighted_duration_tv=weighted_tv(quartiles(items), quartiles(admitted), weights),
        beyond_weights_share=beyond_weights_share(Counter(joint), Counter(kept), clip=clip),
        reward_shift=None if mean_generated is None or mean_admitted is None
        else mean_admitted - mean_generated,
        generated=len(items), admitted=len(admitted),
        excluded_token_share=(sum(g.sampled_tokens for g in items if not g.admitted) / total_tokens
                              if total_tokens else 0.0))
    return rows, skew
