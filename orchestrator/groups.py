"""Groups in flight: G samples of one task instance, their outcomes, and when to decide them.

With `group_completion = wait` a group is decided once, when every sample index has a final
outcome (requeued samples come back as new attempts first). With `stream`, each member is
decided as it finishes; the group's first admission waits until `min_group_size` members can be
scored together, later members are admitted on arrival (the learner's baselines use every
admitted member of the group).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio

from orchestrator.admission import MemberOutcome, OutcomeKind
from orchestrator.rollout_types import StopReason, TrajectoryOutcome, TrajectoryStatus
from tasks.api import TaskInstance

TIMEOUT_STOPS = {StopReason.WALL_TIME, StopReason.WORKING_TIME}


def outcome_kind(outcome: TrajectoryOutcome) -> OutcomeKind:
    if outcome.status is TrajectoryStatus.INFRA_ERROR:
        return "verifier_error" if outcome.error_type == "verifier_error" else "infra_error"
    if outcome.status is TrajectoryStatus.FAILED:
        return "failed"
    if outcome.status is TrajectoryStatus.TRUNCATED:
        return "timeout" if outcome.stop_reason in TIMEOUT_STOPS else "overlong"
    return "ok"


def member_outcome(trajectory_id: int, outcome: TrajectoryOutcome, attempt: int) -> MemberOutcome:
    kind = outcome_kind(outcome)
    reward = outcome.reward
    if reward is None and kind in ("failed", "overlong"):
        reward = 0.0  # the policy did not finish the task within its limits
    return MemberOutcome(trajectory_id=trajectory_id, kind=kind, reward=reward,
                         min_version=outcome.min_weights_version,
                         sampled_tokens=outcome.sampled_tokens, attempt=attempt,
                         duration_s=max(0.0, outcome.finished_at - outcome.started_at))


@dataclass
class GroupState:
    group_id: int
    task: TaskInstance
    task_instance_id: int
    size: int
    dispatch_version: int
    finished: dict[int, MemberOutcome] = field(default_factory=dict)  # by sample index
    attempts: dict[int, int] = field(default_factory=dict)  # sample index -> current attempt
    decided_samples: set[int] = field(default_factory=set)  # decisions stored (stream mode)
    admitted: int = 0  # members already in the learner stream (stream mode)
    decided: bool = False
    lock: anyio.Lock = field(default_factory=anyio.Lock)  # one decision at a time per group

    def complete(self) -> bool:
        return len(self.finished) == self.size
