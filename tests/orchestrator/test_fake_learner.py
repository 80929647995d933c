"""`orchestrator.testing.FakeLearner`: it consumes the admission log in order, a batch a step,
and records each step's lag from the consumed trajectories' rows unless told not to read them."""

from __future__ import annotations

import anyio
from sqlalchemy import select

from core.store import schema as s
from core.store.store import Store
from orchestrator.testing import FakeLearner


def _admitted_run(store: Store, run_id: str, count: int) -> None:
    store.create_run(run_id, name="fake", config={}, pipeline_mode="async")
    instance = store.task_instance_id(run_id, family="f", key="f/train/0", content_hash="h")
    group = store.create_group(run_id, instance, size=count, dispatch_version=0)
    for index in range(count):
        trajectory = store.create_trajectory(run_id, group_id=group, task_instance_id=instance,
                                             sample_index=index)
        store.update_trajectory(trajectory, status="completed", min_version=0, max_version=0)
        store.admit(run_id, trajectory, reason="ok", learner_version=0, reward=1.0)


def _steps(store: Store, run_id: str, **options) -> list:
    learner = FakeLearner(store, run_id, batch_size=2, max_steps=2, **options)
    anyio.run(learner.run)
    assert learner.batches == [[1, 2], [3, 4]]
    with store.engine.connect() as c:
        return list(c.execute(select(s.LearnerStep).where(s.LearnerStep.run_id == run_id)
                              .order_by(s.LearnerStep.step)))


def test_lags_come_from_the_consumed_rows_unless_turned_off(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/fake.db", create=True)
    _admitted_run(store, "with", 4)
    _admitted_run(store, "without", 4)
    # version 0 trains the first batch, version 1 the second: lags 0, then 1
    assert [(r.mean_lag, r.max_lag) for r in _steps(store, "with")] == [(0.0, 0), (1.0, 1)]
    reads: list[int] = []
    store.trajectory = lambda trajectory_id: reads.append(trajectory_id)  # type: ignore[method-assign]
    assert [(r.mean_lag, r.max_lag) for r in _steps(store, "without", record_lags=False)] \
        == [(None, None), (None, None)]
    assert reads == []
    store.close()
