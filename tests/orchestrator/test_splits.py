"""Each split is read only where it belongs, on the real pipeline and evaluation code: RL
dispatches train instances only, and the evaluations a job reports read test instances only
(checked from the task instances the store recorded for each trajectory)."""

from __future__ import annotations

import anyio
from pipeline_fixtures import CHAT, coin_engine, fake_sandbox, held_out_coin_family
from sqlalchemy import select

from config.job import parse_config
from core.store import schema as s
from core.store.store import Store
from orchestrator.evaluate import evaluate
from orchestrator.pipeline import Pipeline
from orchestrator.testing import FakeLearner
from orchestrator.writer import running_writer


def _stored_splits(store, family, purpose: str) -> set[str]:
    """The splits of the task instances a run's trajectories of `purpose` used, by their key
    and by where their identity lives (both must agree)."""
    t, ti = s.Trajectory.__table__, s.TaskInstance.__table__
    with store.engine.connect() as c:
        keys = list(c.execute(select(ti.c.key).join(t, t.c.task_instance_id == ti.c.id)
                              .where(t.c.purpose == purpose)).scalars())
    assert keys
    named = {key.split("/")[1] for key in keys}
    homes = {family.shares.of(family.name, family.split_key(family.by_key(key))) for key in keys}
    assert named == homes
    return named


def test_rl_dispatches_train_instances_and_the_evaluation_reads_test_ones(sqlite_url):
    family = held_out_coin_family()
    cfg = parse_config({"rollout": {"group_size": 2, "max_concurrent": 8},
                        "learner": {"batch_size": 4}, "pipeline": {"steps": 2}})
    store = Store.open(sqlite_url, create=True)
    store.create_run("r", name="t", config={}, pipeline_mode=cfg.pipeline.mode)
    learner = FakeLearner(store, "r", batch_size=4, max_steps=2)
    engine = coin_engine()

    async def main():
        async with running_writer(store) as writer, anyio.create_task_group() as tg:
            await tg.start(learner.run)
            pipeline = Pipeline(run_id="r", cfg=cfg, store=store, writer=writer, engine=engine,
                                family=family, chat_format=CHAT, acquire=fake_sandbox,
                                poll_s=0.01)
            with anyio.fail_after(60):
                await pipeline.run()
                await evaluate(label="after", run_id="r", version=0, store=store,
                               writer=writer, engine=engine, family=family, chat_format=CHAT,
                               acquire=fake_sandbox, params=pipeline.params, instances=12,
                               concurrency=4)
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert _stored_splits(store, family, "train") == {"train"}
    assert _stored_splits(store, family, "eval") == {"test"}
    [record] = store.evaluations("r")
    assert (record.split, record.instances, record.label) == ("test", 12, "after")
    assert 0 < record.solved < 12 and record.failures == {"unsolved": 12 - record.solved}
