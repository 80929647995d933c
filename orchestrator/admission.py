"""Admission: which finished trajectories reach the learner, and why. Pure decision functions.

`decide_group` takes the members of one group (or, with `group_completion = stream`, the members
finished so far) and returns one `Decision` per member. Every decision carries a reason string
that is stored verbatim in `admission_decisions.reason`, so the audit and the bias ledger can
count exactly why work was excluded. Rules, in order:

1. member rules, each member on its own
   - `infra_error` (sandbox or engine failure): always excluded and never scored; the group's
     statistics are computed without it (reason `infra_error`); a verifier that could not
     score (crashed, timed out, wrote no reward) is treated the same (reason `verifier_error`)
   - `timeout` (wall or working time ran out): `fail` trains on it with reward 0
     (`timeout_fail`), `mask` keeps it in the group's statistics but out of the loss
     (`timeout_mask`), `drop` excludes it (`timeout_drop`)
   - `overlong` (token or context limit): `keep` (`overlong_keep`), `mask` (`overlong_mask`),
     `drop` (`overlong_drop`); `penalize` adds DAPO's soft punishment to the reward of every
     member whose sampled tokens reach into the last `overlong_cache_len` of the budget
     (`overlong_penalty`)
   - staleness: lag = learner version - oldest weights version in the trajectory; above
     `max_lag`, `drop` (`stale_drop`), `requeue` (`stale_requeue`, generate it again, up to
     `max_attempts`), `keep` (`stale_keep`: train on it with the configured corrections)
2. group rules, over the members still in
   - fewer than `min_group_size` scoring members: the group is dropped (`group_too_small`)
   - all scoring rewards equal (zero variance: every group-centred advantage is 0):
     `zero_variance = drop` drops the group (`zero_variance`), `keep` admits it
3. the rest are admitted (`fresh` when lag is 0, else `lagged`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Sequence

from config.job import AdmissionConfig
from core.store.rollouts import STALE_CANCEL

# stale_cancelled: stopped in flight once it could no longer be admitted (admission.cancel_stale)
OutcomeKind = Literal["ok", "timeout", "overlong", "infra_error", "verifier_error", "failed",
                      "stale_cancelled"]
Action = Literal["admit", "mask", "drop", "requeue"]


@dataclass(frozen=True)
class MemberOutcome:
    trajectory_id: int
    kind: OutcomeKind
    reward: float | None
    min_version: int | None  # oldest weights version that produced one of its tokens
    sampled_tokens: int = 0
    attempt: int = 0
    duration_s: float = 0.0  # wall time from start to finish (the ledger's duration)


@dataclass(frozen=True)
class Decision:
    trajectory_id: int
    action: Action
    reason: str
    lag: int | None
    reward: float | None  # the reward the learner uses (after fail-to-zero or penalties)

    @property
    def streamed(self) -> bool:
        """Admitted and masked members go to the learner stream (masked: statistics only)."""
        return self.action in ("admit", "mask")


def lag_of(member: MemberOutcome, learner_version: int) -> int | None:
    return None if member.min_version is None else max(0, learner_version - member.min_version)


def overlong_penalty(tokens: int, max_len: int, cache_len: int, factor: float) -> float:
    """DAPO soft overlong punishment: 0 up to max_len - cache_len, linear to -factor at max_len."""
    start = max_len - cache_len
    if tokens <= start:
        return 0.0
    if tokens >= max_len or cache_len == 0:
        return -factor
    return -factor * (tokens - start) / cache_len


def decide_member(member: MemberOutcome, cfg: AdmissionConfig, learner_version: int, *,
                  max_tokens: int, max_attempts: int = 3) -> Decision:
    lag = lag_of(member, learner_version)
    reward = member.reward
    if member.kind == "failed" and reward is None:
        # The policy broke the trajectory (e.g. too many malformed tool calls): scored 0.
        reward = 0.0

    def decision(action: Action, reason: str, reward: float | None = reward) -> Decision:
        return Decision(member.trajectory_id, action, reason, lag, reward)

    if member.kind in ("infra_error", "verifier_error"):
        return decision("drop", member.kind, None)
    if member.kind == "stale_cancelled":
        return decision("drop", STALE_CANCEL, None)
    if member.kind == "timeout":
        if cfg.timeout == "fail":
            return decision("admit", "timeout_fail", 0.0)
        if cfg.timeout == "mask":
            return decision("mask", "timeout_mask", 0.0)
        return decision("drop", "timeout_drop")
    stale = lag is not None and lag > cfg.max_lag
    if stale and cfg.stale == "drop":
        return decision("drop", "stale_drop")
    if stale and cfg.stale == "requeue":
        if member.attempt + 1 < max_attempts:
            return decision("requeue", "stale_requeue")
        return decision("drop", "requeue_limit")
    if member.kind == "overlong" and cfg.overlong == "drop":
        return decision("drop", "overlong_drop")
    if member.kind == "overlong" and cfg.overlong == "mask":
        return decision("mask", "overlong_mask")
    if cfg.overlong == "penalize":
        # DAPO: every response inside the last cache_len tokens of the budget is punished.
        penalty = overlong_penalty(member.sampled_tokens, max_tokens, cfg.overlong_cache_len,
                                   cfg.overlong_factor)
        if penalty:
            reason = "stale_keep" if stale else "overlong_penalty"
            return decision("admit", reason, (reward or 0.0) + penalty)
    if stale:
        return decision("admit", "stale_keep")
    if member.kind == "overlong":
        return decision("admit", "overlong_keep")
    return decision("admit", "lagged" if lag else "fresh")


def decide_group(members: Sequence[MemberOutcome], cfg: AdmissionConfig, learner_version: int,
                 *, max_tokens: int, max_attempts: int = 3) -> list[Decision]:
    """One decision per member, member rules first, then the group rules."""
    decisions = [decide_member(m, cfg, learner_version, max_tokens=max_tokens,
                               max_attempts=max_attempts) for m in members]
    if any(d.action == "requeue" for d in decisions):
        return decisions  # the group is incomplete until the requeued members come back
    scoring = [d for d in decisions if d.streamed]
    if len(scoring) < cfg.min_group_size:
        return [replace(d, action="drop", reason="group_too_small") if d.streamed else d
                for d in decisions]
    rewards = {d.reward for d in scoring}
    if cfg.zero_variance == "drop" and len(rewards) == 1:
        return [replace(d, action="drop", reason="zero_variance") if d.streamed else d
                for d in decisions]
    return decisions
