"""A real job's two evaluations (tiny model on the embedded engine, a real `stalewise run`: the
session's `real_run`): every evaluation call went out with its own seed, the before and after
calls of one instance and turn with the same one, and the summary pairs the two evaluations
per instance in agreement with their counts."""

from __future__ import annotations

from core.evaluation import latest_by_label
from core.seeds import derived_seed
from core.store.store import Store


def _first_call_seeds(store: Store, run_id: str) -> dict[tuple[int, str], int | None]:
    """(dispatch version, task key) -> the seed recorded with the trajectory's first call."""
    from sqlalchemy import select

    from core.store import schema as s

    t, ti = s.Trajectory.__table__, s.TaskInstance.__table__
    with store.engine.connect() as c:
        rows = c.execute(select(t.c.id, t.c.dispatch_version, ti.c.key)
                         .join(ti, t.c.task_instance_id == ti.c.id)
                         .where(t.c.run_id == run_id, t.c.purpose == "eval")).all()
    return {(version, key): store.model_calls(trajectory_id)[0].sampling["seed"]
            for trajectory_id, version, key in rows}


def test_a_real_jobs_evaluations_are_seeded_and_paired_per_instance(real_run):
    url, run_id = real_run
    store = Store.open(url)
    try:
        summary = store.run(run_id).summary
        evaluations = latest_by_label(store.evaluations(run_id))
        seeds = _first_call_seeds(store, run_id)
    finally:
        store.close()
    before, after = evaluations["before"], evaluations["after"]
    assert before.policy_version < after.policy_version
    for index in range(before.instances):  # run.seed 0 seeds the engine, hence these calls
        expected = derived_seed(derived_seed(0, "test", index), 0)
        key = f"arith/test/{index}"
        assert seeds[before.policy_version, key] == seeds[after.policy_version, key] == expected
    paired = summary["held_out_paired"]
    assert paired["instances"] == before.instances == after.instances
    assert paired["both"] + paired["only_before"] == before.solved
    assert paired["both"] + paired["only_after"] == after.solved
    assert sum(paired[k] for k in ("both", "only_before", "only_after", "neither")) == \
        paired["instances"]
    gain = (paired["only_after"] - paired["only_before"]) / paired["instances"]
    assert paired["gain_low"] - 1e-4 <= gain <= paired["gain_high"] + 1e-4
