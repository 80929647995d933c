"""What a run's finished training trajectories were, read for its summary and bias ledger.

Every reader (the run summary and report, `stalewise compare`, the soak) takes these numbers
from here, over the same trajectories: the run's training trajectories that ended, that is
neither still queued or running nor aborted (`UNFINISHED`). Each row carries its final admission
decision (the last one stored for it), or None while undecided.

The work the bias ledger reads (`finished_work`) also holds the trajectories stopped in flight
as certain stale drops (`admission.cancel_stale`: aborted, and decided `stale_cancel`), so
cancelling the slow work does not hide it from the generated mix. Their duration is the time
they ran, a lower bound of what they would have taken.
"""

from __future__ import annotations

from typing import Any, Sequence

from sqlalchemy import func, insert, select

from core.records import INT32, unpack
from core.store import schema as s
from core.store.store import Store

UNFINISHED = ("queued", "running", "aborted")  # trajectory statuses the summary leaves out
STALE_CANCEL = "stale_cancel"  # the decision of an aborted trajectory the ledger still counts


def _final_decisions(run_id: str):
    d = s.AdmissionDecision.__table__
    return (select(d.c.trajectory_id, func.max(d.c.id).label("id"))
            .where(d.c.run_id == run_id).group_by(d.c.trajectory_id).subquery())


def finished_work(store: Store, run_id: str) -> list[Any]:
    """Rows of (family, difficulty, started_at, finished_at, reward, num_sampled_tokens,
    decision, reason, weight) for every finished training trajectory of the run (weight: its
    stream entry's selection weight, None when it has none)."""
    t, d, ti = s.Trajectory.__table__, s.AdmissionDecision.__table__, s.TaskInstance.__table__
    ls = s.StreamEntry.__table__
    last = _final_decisions(run_id)
    query = (select(ti.c.family, ti.c.difficulty, t.c.started_at, t.c.finished_at, t.c.reward,
                    t.c.num_sampled_tokens, d.c.decision, d.c.reason, ls.c.weight)
             .select_from(t.join(ti, ti.c.id == t.c.task_instance_id)
                          .outerjoin(last, last.c.trajectory_id == t.c.id)
                          .outerjoin(d, d.c.id == last.c.id)
                          .outerjoin(ls, (ls.c.run_id == run_id) & (ls.c.trajectory_id == t.c.id)))
             .where(t.c.run_id == run_id, t.c.purpose == "train",
                    t.c.status.notin_(UNFINISHED) | (d.c.reason == STALE_CANCEL)))
    with store.engine.connect() as c:
        return list(c.execute(query))


def finished_spans(store: Store, run_id: str) -> list[Any]:
    """Rows of (min_version, max_version, stop_reason, reason of the final decision) for every
    finished training trajectory of the run."""
    t, d = s.Trajectory.__table__, s.AdmissionDecision.__table__
    last = _final_decisions(run_id)
    query = (select(t.c.min_version, t.c.max_version, t.c.stop_reason, d.c.reason)
             .select_from(t.outerjoin(last, last.c.trajectory_id == t.c.id)
                          .outerjoin(d, d.c.id == last.c.id))
             .where(t.c.run_id == run_id, t.c.purpose == "train",
                    t.c.status.notin_(UNFINISHED)))
    with store.engine.connect() as c:
        return list(c.execute(query))


def kv_lag_by_trajectory(store: Store, run_id: str) -> dict[int, int]:
    """For each finished train trajectory with sampled tokens: the largest, over its tokens, of
    weights version minus the oldest KV version the token attended to."""
    t, m = s.Trajectory.__table__, s.ModelCall.__table__
    query = (select(m.c.trajectory_id, m.c.weights_versions, m.c.kv_versions)
             .select_from(m.join(t, t.c.id == m.c.trajectory_id))
             .where(t.c.run_id == run_id, t.c.purpose == "train", m.c.num_tokens > 0,
                    t.c.status.notin_(UNFINISHED)))
    lags: dict[int, int] = {}
    with store.engine.connect() as c:
        for r in c.execute(query):
            lag = int((unpack(r.weights_versions, INT32) - unpack(r.kv_versions, INT32)).max())
            lags[r.trajectory_id] = max(lag, lags.get(r.trajectory_id, lag))
    return lags


def insert_ledger(store: Store, run_id: str, rows: Sequence[dict[str, Any]],
                  computed_at: float) -> None:
    """One computation of the run's bias ledger (`bias_ledger` rows, one `computed_at`)."""
    if rows:
        with store.engine.begin() as c:
            c.execute(insert(s.BiasLedgerRow.__table__),
                      [dict(run_id=run_id, computed_at=computed_at, **r) for r in rows])


def evaluation_rewards(store: Store, run_id: str, version: int) -> dict[str, float | None]:
    """The reward of every evaluation trajectory the run dispatched at weights `version`, by
    task key (None: none, a failure); where an evaluation was repeated at that version (one cut
    short, then run again), a key's latest trajectory."""
    t, ti = s.Trajectory.__table__, s.TaskInstance.__table__
    query = (select(ti.c.key, t.c.reward).select_from(t.join(ti, ti.c.id == t.c.task_instance_id))
             .where(t.c.run_id == run_id, t.c.purpose == "eval",
                    t.c.dispatch_version == version).order_by(t.c.id))
    with store.engine.connect() as c:
        return {key: reward for key, reward in c.execute(query)}
