"""An evaluation as numbers: one record, one success rule, one way to put intervals on it.

`Evaluation` is what the job stores in the `evaluations` table after each evaluation and what
every reader takes from there: the job summary, report.md, the viewer and `compare`. The rule
is the same everywhere: an instance counts as solved when its reward is at least `SUCCESS`;
infrastructure errors and aborted trajectories count as failures (an evaluation cannot drop
what it could not solve) and are shown beside the rate. `distinct` counts the different task
identities evaluated (split keys, or content hashes where the family has none), so a small
test pool that repeats itself is visible.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from core.stats import Interval, newcombe_difference, newcombe_paired_difference, wilson

SUCCESS = 0.999  # a reward at or above this counts as solved


def solved(reward: float | None) -> bool:
    return reward is not None and reward >= SUCCESS


@dataclass(frozen=True)
class Evaluation:
    """One evaluation of a run: `label` ("before" / "after" RL), the weights version, the
    split it read, and its counts. `instances` is every trajectory started, whatever its end;
    `failures` counts the unsolved ones that ended normally by the family's failure mode
    (`TaskFamily.failure_mode`), so two evaluations show what changed between them."""

    label: str
    policy_version: int
    split: str
    instances: int
    distinct: int
    solved: int
    infra_errors: int
    aborted: int
    mean_reward: float
    failures: Mapping[str, int] = field(default_factory=dict)  # failure mode -> trajectories

    def __post_init__(self) -> None:
        counts = (self.distinct, self.solved, self.infra_errors, self.aborted)
        if min(counts + (self.instances,)) < 0 or max(counts) > self.instances \
                or self.solved + self.infra_errors + self.aborted > self.instances:
            raise ValueError(f"evaluation {self.label}: counts {counts} do not fit "
                             f"{self.instances} instances")

    @property
    def success_rate(self) -> float:
        return self.solved / self.instances if self.instances else 0.0

    @property
    def counts(self) -> tuple[int, int]:
        """(solved, instances): what the intervals are computed from."""
        return self.solved, self.instances

    def interval(self) -> Interval:
        """Wilson 95% interval of the success rate."""
        return wilson(self.solved, self.instances)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "failures": dict(self.failures),
                "success_rate": round(self.success_rate, 4)}


def gain_figures(before: tuple[int, int], after: tuple[int, int]) -> dict[str, Any]:
    """Wilson intervals of success before and after RL and the Newcombe interval of the gain
    (independent samples, so conservative), from (solved, instances) pairs, as the summary,
    report and compare print them."""
    return {"before": wilson(*before).percent(), "after": wilson(*after).percent(),
            **_gain_fields(newcombe_difference(*before, *after))}


def _gain_fields(gain: Interval) -> dict[str, Any]:
    """A gain's interval as the summary, report and compare give it."""
    return {"gain": gain.percent(), "gain_excludes_zero": gain.excludes_zero(),
            "gain_low": round(gain.low, 4), "gain_high": round(gain.high, 4)}


def paired_outcomes(before: Mapping[str, float | None],
                    after: Mapping[str, float | None]) -> dict[str, Any]:
    """Over the instances both evaluations ran (rewards by task key; None: no reward, a
    failure): how many were solved by both, only after RL, only before it, and by neither, and
    the paired 95% interval of the gain over them (`gain`, Newcombe's paired method).
    The two evaluations draw an instance with the same seeds (orchestrator/evaluate.py), so
    where RL changed its distribution little the two draws agree, and "only before" is mostly
    what RL made worse rather than the luck of two independent draws."""
    keys = before.keys() & after.keys()
    pairs = [(solved(before[key]), solved(after[key])) for key in keys]
    counts = {"instances": len(pairs), "both": pairs.count((True, True)),
              "only_after": pairs.count((False, True)),
              "only_before": pairs.count((True, False)), "neither": pairs.count((False, False))}
    if not pairs:
        return counts
    return {**counts, **_gain_fields(newcombe_paired_difference(
        counts["both"], counts["only_after"], counts["only_before"], counts["neither"]))}


def latest_by_label(evaluations: list[Evaluation]) -> dict[str, Evaluation]:
    """Each label's latest evaluation that ran to its end, else its latest one (a resumed run
    may hold an evaluation cut short and the one that replaced it)."""
    out: dict[str, Evaluation] = {}
    for evaluation in evaluations:
        kept = out.get(evaluation.label)
        if kept is None or evaluation.aborted == 0 or kept.aborted > 0:
            out[evaluation.label] = evaluation
    return out


def failure_changes(before: Evaluation, after: Evaluation) -> list[tuple[str, int, int]]:
    """(failure mode, count before, count after) for every mode either evaluation saw, the
    largest change first: what RL changed, in the family's own words."""
    modes = set(before.failures) | set(after.failures)
    rows = [(mode, before.failures.get(mode, 0), after.failures.get(mode, 0)) for mode in modes]
    return sorted(rows, key=lambda r: (-abs(r[2] - r[1]), r[0]))
