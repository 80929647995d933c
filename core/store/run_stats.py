"""Read-only figures of one run for dashboards: throughput over time, lag histograms,
admission decisions by reason, the latest bias ledger and evaluations with intervals.

Every function reads the store only (it never writes) and returns JSON-ready values. Token lag is
computed from the per-token weights versions of admitted trajectories against the learner
version the admission decision expected to train them, so it is the lag the learner saw.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from sqlalchemy import func, select

from core.records import INT32, unpack
from core.store import schema as s
from core.store.store import Store



def throughput(store: Store, run_id: str, buckets: int = 30) -> list[dict[str, float]]:
    """Finished trajectories per time bucket since the run began: trajectories/s, sampled
    tokens/s and the share of trajectory time spent in the engine, in tools and waiting."""
    run, t = store.run(run_id), s.Trajectory.__table__
    if run is None:
        return []
    query = (select(t.c.finished_at, t.c.num_sampled_tokens, t.c.engine_s, t.c.tools_s,
                    t.c.waiting_s)
             .where(t.c.run_id == run_id, t.c.finished_at.is_not(None)))
    with store.engine.connect() as c:
        rows = list(c.execute(query))
    if not rows:
        return []
    start = run.created_at
    span = max(max(r.finished_at for r in rows) - start, 1e-6)
    width = span / buckets
    out = [dict(t=(i + 1) * width, trajectories=0.0, tokens=0.0, engine_s=0.0, tools_s=0.0,
                waiting_s=0.0) for i in range(buckets)]
    for r in rows:
        b = out[min(int((r.finished_at - start) / width), buckets - 1)]
        b["trajectories"] += 1
        b["tokens"] += r.num_sampled_tokens
        for key in ("engine_s", "tools_s", "waiting_s"):
            b[key] += getattr(r, key) or 0.0
    for b in out:
        b["trajectories_per_s"] = b["trajectories"] / width
        b["tokens_per_s"] = b["tokens"] / width
    return out


def admission_by_reason(store: Store, run_id: str) -> list[dict[str, Any]]:
    d = s.AdmissionDecision.__table__
    query = (select(d.c.decision, d.c.reason, func.count().label("n"))
             .where(d.c.run_id == run_id).group_by(d.c.decision, d.c.reason)
             .order_by(func.count().desc()))
    with store.engine.connect() as c:
        return [dict(decision=r.decision, reason=r.reason, count=r.n) for r in c.execute(query)]


def lag_histograms(store: Store, run_id: str) -> dict[str, dict[int, int]]:
    """{"trajectory": {lag: count}, "token": {lag: count}} over admitted trajectories."""
    d, m = s.AdmissionDecision.__table__, s.ModelCall.__table__
    admitted = (select(d.c.trajectory_id, d.c.lag, d.c.learner_version)
                .where(d.c.run_id == run_id, d.c.decision == "admit",
                       d.c.trajectory_id.is_not(None)))
    with store.engine.connect() as c:
        decisions = {r.trajectory_id: r for r in c.execute(admitted)}
        token_lags: Counter[int] = Counter()
        if decisions:
            calls = c.execute(select(m.c.trajectory_id, m.c.weights_versions)
                              .where(m.c.trajectory_id.in_(list(decisions))))
            for call in calls:
                versions = unpack(call.weights_versions, INT32)
                lags, counts = np.unique(decisions[call.trajectory_id].learner_version - versions,
                                         return_counts=True)
                token_lags.update(dict(zip(lags.tolist(), counts.tolist())))
    trajectory_lags = Counter(r.lag for r in decisions.values() if r.lag is not None)
    return {"trajectory": dict(sorted(trajectory_lags.items())),
            "token": dict(sorted(token_lags.items()))}


def bias_ledger(store: Store, run_id: str) -> list[dict[str, Any]]:
    """The most recently computed ledger rows (generated vs admitted per family, difficulty)."""
    b = s.BiasLedgerRow.__table__
    with store.engine.connect() as c:
        latest = c.execute(select(func.max(b.c.computed_at)).where(b.c.run_id == run_id)).scalar()
        if latest is None:
            return []
        rows = c.execute(select(b).where(b.c.run_id == run_id, b.c.computed_at == latest)
                         .order_by(b.c.family, b.c.difficulty, b.c.duration_quantile))
        return [{k: v for k, v in r._mapping.items() if k not in ("id", "run_id")} for r in rows]


def evaluations(store: Store, run_id: str) -> list[dict[str, Any]]:
    """The run's evaluation records (`core.evaluation`, the same numbers the job summary and
    compare print) with the success rate's Wilson 95% interval."""
    out = []
    for evaluation in store.evaluations(run_id):
        interval = evaluation.interval() if evaluation.instances else None
        out.append({**evaluation.as_dict(),
                    "success_interval": (interval.low, interval.high) if interval else None})
    return out
