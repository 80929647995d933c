"""Held-out evaluation: run the family's `test` split (`[tasks] eval_split`: `validation` while
tuning) once per instance at the engine's weights.

Evaluation trajectories are recorded like any other (purpose `eval`, no group, never admitted),
so the before/after figures of a run can be audited token by token; the evaluation itself is
one row of numbers in `evaluations` (`core.evaluation.Evaluation`), which every reader uses.
A trajectory that ends in an infrastructure error counts as a failure (an evaluation cannot
drop what it could not solve), and so does one the run stopped (`aborted`,
orchestrator.inflight): an evaluation cut short is still recorded, with its aborted count.
The test split is read here and nowhere else: RL dispatches train instances, and the warm
start's selection and check read validation ones. `distinct` counts different instances
(content hashes), so a test pool that repeats itself shows in every summary.

A job seeds its evaluations' model calls from `[engine] seed` (`seed` below). Without that, the
engine drew every row from one generator in the order requests reached its batches, so the
same weights scored differently from run to run with the timing. Two evaluations of one seed
draw each instance with the same random numbers, so `paired_gain` pairs them per instance,
within a run or across two runs of one store (`stalewise compare`, where one run's evaluation
before RL serves the runs that start from the same checkpoint).
"""

from __future__ import annotations

import dataclasses
from statistics import fmean

import anyio

from core.engine_api import InferenceEngine, SamplingParams
from core.evaluation import Evaluation, paired_outcomes, solved
from core.log import get_logger
from core.seeds import derived_seed
from core.store.rollouts import evaluation_rewards
from core.store.store import Store
from orchestrator.inflight import InFlight
from orchestrator.recorder import SqlRecorder, outcome_values
from orchestrator.rollout import RolloutOptions, run_trajectory
from orchestrator.rollout_types import TrajectoryOutcome
from orchestrator.writer import StoreWriter
from tasks.api import TaskFamily, TaskInstance
from tasks.chat.base import ChatFormat

log = get_logger("stalewise.evaluate")


async def evaluate(*, label: str, run_id: str, version: int, store: Store, writer: StoreWriter,
                   engine: InferenceEngine, family: TaskFamily, chat_format: ChatFormat,
                   acquire, params: SamplingParams, instances: int, concurrency: int,
                   options: RolloutOptions = RolloutOptions(), split: str = "test",
                   seed: int | None = None) -> Evaluation:
    """Evaluate `instances` instances (0..) of `split` at weights `version`; the `Evaluation`
    is recorded in the store before it is returned (also when the run stops during it).

    With a `seed`, the model calls of instance i are seeded from (seed, split, i) and their
    turn: the engine then draws them whatever it batches them with, so an evaluation of the
    same weights repeats, and the before and after evaluations draw instance i's samples with
    the same random numbers."""
    limiter = anyio.CapacityLimiter(concurrency)
    if family.size is not None:  # a finite family (Harbor folders): each instance once at most
        instances = min(instances, family.size)
    tally = _Tally(family, split)
    unfinished: InFlight[int] = InFlight(store, writer)

    async def one(index: int) -> None:
        task = family.instance(index, split)
        with anyio.CancelScope(shield=True):  # row and registration together (inflight)
            trajectory_id = await anyio.to_thread.run_sync(lambda: store.create_trajectory(
                run_id, group_id=None, task_instance_id=store.task_instance_id(
                    run_id, family=task.family, key=task.key, content_hash=task.content_hash,
                    difficulty=task.difficulty, prompt=task.prompt[-1].content),
                dispatch_version=version, purpose="eval"))
            unfinished.add(trajectory_id, index)
            tally.started(task)
        seeded = options if seed is None else dataclasses.replace(
            options, sampling_seed=derived_seed(seed, split, index))
        async with limiter:
            outcome = await run_trajectory(
                task=task, engine=engine,
                acquire_sandbox=lambda spec: acquire(spec, trajectory_id),
                chat_format=chat_format, params=params, recorder=SqlRecorder(writer),
                trajectory_id=trajectory_id, options=seeded)
        await writer.put_trajectory_update(trajectory_id, outcome_values(outcome))
        unfinished.ended(trajectory_id)
        tally.ended(task, outcome)

    try:
        async with anyio.create_task_group() as tg:
            for index in range(instances):
                tg.start_soon(one, index)
    except BaseException:
        with anyio.CancelScope(shield=True):
            aborted = len(unfinished)
            await unfinished.abort_all(f"the run stopped during the {label} evaluation")
            await _record_cut_short(store, run_id, tally.record(label, version, aborted))
        raise
    await writer.flush()
    result = tally.record(label, version, aborted=0)
    await anyio.to_thread.run_sync(store.record_evaluation, run_id, result)
    return result


class _Tally:
    """Counts of one evaluation as its trajectories start and end."""

    def __init__(self, family: TaskFamily, split: str) -> None:
        self.family, self.split = family, split
        self.identities: set[str] = set()
        self.instances = self.solved = self.infra_errors = 0
        self.rewards: list[float] = []
        self.failures: dict[str, int] = {}

    def started(self, task: TaskInstance) -> None:
        self.instances += 1
        self.identities.add(task.content_hash)

    def ended(self, task: TaskInstance, outcome: TrajectoryOutcome) -> None:
        infra = outcome.status.value == "infra_error"
        self.infra_errors += infra
        if not infra and solved(outcome.reward):
            self.solved += 1
        elif not infra:
            mode = self.family.failure_mode(task, outcome.messages)
            self.failures[mode] = self.failures.get(mode, 0) + 1
        self.rewards.append(0.0 if infra else outcome.reward or 0.0)

    def record(self, label: str, version: int, aborted: int) -> Evaluation:
        return Evaluation(label=label, policy_version=version, split=self.split,
                          instances=self.instances, distinct=len(self.identities),
                          solved=self.solved, infra_errors=self.infra_errors, aborted=aborted,
                          mean_reward=round(fmean(self.rewards), 6) if self.rewards else 0.0,
                          failures=dict(self.failures))


async def _record_cut_short(store: Store, run_id: str, evaluation: Evaluation) -> None:
    """Record an evaluation the run stopped, if the store still answers (the run's own error
    or cancellation is what the caller re-raises, never this one)."""
    try:
        await anyio.to_thread.run_sync(store.record_evaluation, run_id, evaluation)
    except Exception as exc:
        log.warning("could not record the evaluation that was cut short", label=evaluation.label,
                    error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def paired_gain(store: Store, before: tuple[str, Evaluation],
                after: tuple[str, Evaluation]) -> dict | None:
    """`core.evaluation.paired_outcomes` of two evaluations, each given as (run id, its
    evaluation record): per test instance, solved by both, only after, only before, neither,
    and the paired interval of the gain. None where it cannot pair them: the same run at one
    weights version (its trajectories of both would mix), another split, or no instance that
    both ran."""
    (before_run, first), (after_run, second) = before, after
    if first.split != second.split or (before_run == after_run
                                       and first.policy_version == second.policy_version):
        return None
    paired = paired_outcomes(evaluation_rewards(store, before_run, first.policy_version),
                             evaluation_rewards(store, after_run, second.policy_version))
    return paired if paired["instances"] else None
