"""An evaluation's model calls carry seeds of their own, derived from the job's engine seed, the
split, the instance and the turn, and recorded with each call: so an evaluation of the same
weights draws the same samples whatever the engine batches its requests with (the engine side:
tests/engine/test_engine_core.py::test_seeded_requests_reproduce_whatever_the_batch), and the
before and after evaluations of a run draw instance i with the same random numbers."""

from __future__ import annotations

import anyio
from pipeline_fixtures import CHAT, coin_script, fake_sandbox, held_out_coin_family
from sqlalchemy import select

from core.engine_api import SamplingParams
from core.seeds import derived_seed
from core.store import schema as s
from core.store.store import Store
from orchestrator.engines.scripted import ScriptedEngine
from orchestrator.evaluate import evaluate
from orchestrator.writer import running_writer

INSTANCES = 6


def _evaluate_three_times(sqlite_url) -> Store:
    """Evaluations "before" and "after" seeded with 7 (concurrency 1 and 6), and "plain" with
    no seed."""
    store = Store.open(sqlite_url, create=True)
    store.create_run("r", name="t", config={}, pipeline_mode="async")
    family, engine = held_out_coin_family(), ScriptedEngine(coin_script, keep_requests=False)

    async def main():
        with anyio.fail_after(60):
            async with running_writer(store) as writer:
                await run_all(writer)

    async def run_all(writer):
        for label, seed, concurrency in (("before", 7, 1), ("after", 7, 6), ("plain", None, 6)):
            await evaluate(label=label, run_id="r", version=0, store=store, writer=writer,
                           engine=engine, family=family, chat_format=CHAT,
                           acquire=fake_sandbox, params=SamplingParams(max_tokens=64),
                           instances=INSTANCES, concurrency=concurrency, seed=seed)

    anyio.run(main)
    return store


def _seeds_by_evaluation(store: Store) -> list[dict[tuple[str, int], int | None]]:
    """Per evaluation, in order: (task key, turn) -> the seed recorded with that model call."""
    t, ti = s.Trajectory.__table__, s.TaskInstance.__table__
    with store.engine.connect() as c:
        rows = c.execute(select(t.c.id, ti.c.key).join(ti, t.c.task_instance_id == ti.c.id)
                         .where(t.c.purpose == "eval").order_by(t.c.id)).all()
    evaluations: list[dict[tuple[str, int], int | None]] = [{}, {}, {}]
    for position, (trajectory_id, key) in enumerate(rows):
        for call in store.model_calls(trajectory_id):
            evaluations[position // INSTANCES][key, call.turn] = call.sampling["seed"]
    return evaluations


def test_evaluation_calls_are_seeded_per_instance_and_turn_and_repeat_across_evaluations(
        sqlite_url):
    store = _evaluate_three_times(sqlite_url)
    before, after, plain = _seeds_by_evaluation(store)
    family = held_out_coin_family()
    expected = {(family.instance(i, "test").key, turn): derived_seed(derived_seed(7, "test", i),
                                                                     turn)
                for i in range(INSTANCES) for turn in (0, 1)}  # a tool call, then the answer
    assert before == expected
    assert after == before  # the same instance and turn: the same seed, whatever the order
    assert len(set(before.values())) == len(before)  # no two calls share random numbers
    assert set(plain) == set(before) and set(plain.values()) == {None}
    assert [e.label for e in store.evaluations("r")] == ["before", "after", "plain"]
