"""Small reads that the CLI commands, exports and the viewer share (the store's SQL, so that
none of them writes a query of its own): a run by name, the extent of its RL phase, its trajectories' ids and task instances, and one trajectory's
admission decisions."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

from core.store import schema as s
from core.store.store import Store


def latest_run_named(store: Store, name: str) -> str | None:
    """The id of the newest run called `name` (`[run] name`), or None."""
    runs = s.Run.__table__
    with store.engine.connect() as c:
        return c.execute(select(runs.c.id).where(runs.c.name == name)
                         .order_by(runs.c.created_at.desc()).limit(1)).scalar()


def rl_phase(store: Store, run_id: str) -> tuple[float | None, float | None, int, float | None]:
    """(first train trajectory's start, last one's finish, tokens they sampled, last learner
    step's finish) of the run."""
    t, steps = s.Trajectory.__table__, s.LearnerStep.__table__
    with store.engine.connect() as c:
        first, last_trajectory, tokens = c.execute(select(
            func.min(t.c.started_at), func.max(t.c.finished_at),
            func.sum(t.c.num_sampled_tokens)).where(
            t.c.run_id == run_id, t.c.purpose == "train")).one()
        last_step = c.execute(select(func.max(steps.c.finished_at))
                              .where(steps.c.run_id == run_id)).scalar()
    return first, last_trajectory, int(tokens or 0), last_step


def trajectory_ids(store: Store, run_id: str) -> list[int]:
    t = s.Trajectory.__table__
    with store.engine.connect() as c:
        return list(c.execute(select(t.c.id).where(t.c.run_id == run_id)
                              .order_by(t.c.id)).scalars())


def task_instances(store: Store, run_id: str) -> dict[int, Any]:
    """The run's task instance rows by id."""
    ti = s.TaskInstance.__table__
    with store.engine.connect() as c:
        return {r.id: r for r in c.execute(select(ti).where(ti.c.run_id == run_id))}


def task_instance(store: Store, task_instance_id: int) -> Any | None:
    ti = s.TaskInstance.__table__
    with store.engine.connect() as c:
        return c.execute(select(ti).where(ti.c.id == task_instance_id)).first()


def decisions_of(store: Store, trajectory_id: int) -> list[Any]:
    """The admission decision rows of one trajectory, oldest first."""
    d = s.AdmissionDecision.__table__
    with store.engine.connect() as c:
        return list(c.execute(select(d).where(d.c.trajectory_id == trajectory_id)
                              .order_by(d.c.id)))
