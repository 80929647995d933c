"""Held-out evaluation: run the family's `eval` split once per instance at the engine's weights.

Evaluation trajectories are recorded like any other (purpose `eval`, no group, never admitted),
so the before/after figures of a run can be audited token by token. A trajectory that ends in
an infrastructure error counts as a failure in the success rate (an evaluation cannot drop
what it could not solve); `infra_errors` says how many there were. If the run stops during
an evaluation, its unfinished trajectories end as `aborted` (orchestrator.inflight).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean

import anyio

from core.engine_api import InferenceEngine, SamplingParams
from core.store.store import Store
from orchestrator.inflight import InFlight
from orchestrator.recorder import SqlRecorder, outcome_values
from orchestrator.rollout import RolloutOptions, run_trajectory
from orchestrator.writer import StoreWriter
from tasks.api import TaskFamily
from tasks.chat.base import ChatFormat

SUCCESS = 0.999  # a reward at or above this counts as solved


@dataclass(frozen=True)
class EvalResult:
    label: str
    version: int
    instances: int
    success_rate: float
    mean_reward: float
    infra_errors: int


async def evaluate(*, label: str, run_id: str, version: int, store: Store, writer: StoreWriter,
                   engine: InferenceEngine, family: TaskFamily, chat_format: ChatFormat,
                   acquire, params: SamplingParams, instances: int, concurrency: int,
                   options: RolloutOptions = RolloutOptions()) -> EvalResult:
    limiter = anyio.CapacityLimiter(concurrency)
    if family.size is not None:  # a finite family (Harbor folders): each instance once at most
        instances = min(instances, family.size)
    rewards: list[float] = []
    infra = 0

    unfinished: InFlight[int] = InFlight(store, writer)

    async def one(index: int) -> None:
        nonlocal infra
        task = family.instance(index, "eval")
        with anyio.CancelScope(shield=True):  # row and registration together (inflight)
            trajectory_id = await anyio.to_thread.run_sync(lambda: store.create_trajectory(
                run_id, group_id=None, task_instance_id=store.task_instance_id(
                    run_id, family=task.family, key=task.key, content_hash=task.content_hash,
                    difficulty=task.difficulty, prompt=task.prompt[-1].content),
                dispatch_version=version, purpose="eval"))
            unfinished.add(trajectory_id, index)
        async with limiter:
            outcome = await run_trajectory(
                task=task, engine=engine,
                acquire_sandbox=lambda spec: acquire(spec, trajectory_id),
                chat_format=chat_format, params=params, recorder=SqlRecorder(writer),
                trajectory_id=trajectory_id, options=options)
        await writer.put_trajectory_update(trajectory_id, outcome_values(outcome))
        unfinished.ended(trajectory_id)
        if outcome.status.value == "infra_error":
            infra += 1
            rewards.append(0.0)
        else:
            rewards.append(outcome.reward or 0.0)

    try:
        async with anyio.create_task_group() as tg:
            for index in range(instances):
                tg.start_soon(one, index)
    finally:
        await unfinished.abort_all(f"the run stopped during the {label} evaluation")
    await writer.flush()
    return EvalResult(label=label, version=version, instances=instances,
                      success_rate=fmean(r >= SUCCESS for r in rewards) if rewards else 0.0,
                      mean_reward=fmean(rewards) if rewards else 0.0, infra_errors=infra)
