"""Concurrent writers on SQLite: no duplicate and no lost rows, contiguous stream numbers."""

from __future__ import annotations

import multiprocessing as mp

from sqlalchemy import func, select

from core.store import schema as s
from core.store.store import Store

WRITERS = 8
PER_WRITER = 40
KEYS = 10  # task keys shared by all writers: get-or-create must not duplicate them


def _writer(url: str, writer: int, barrier) -> None:
    store = Store.open(url)
    barrier.wait()
    for i in range(PER_WRITER):
        key = f"task-{(writer + i) % KEYS}"
        task = store.task_instance_id("run", family="arith", key=key, content_hash=key)
        trajectory = store.create_trajectory("run", group_id=None, task_instance_id=task,
                                             sample_index=i)
        store.admit("run", trajectory, reason=f"writer-{writer}", learner_version=0)
    store.close()


def test_eight_concurrent_writers(sqlite_url):
    store = Store.open(sqlite_url, create=True)
    store.create_run("run", name="concurrency", config={}, pipeline_mode="async")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(WRITERS)
    procs = [ctx.Process(target=_writer, args=(sqlite_url, w, barrier)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * WRITERS

    total = WRITERS * PER_WRITER
    with store.engine.connect() as c:
        keys = c.execute(select(s.TaskInstance.key)).scalars().all()
        seqs = c.execute(select(s.StreamEntry.seq).order_by(s.StreamEntry.seq)).scalars().all()
        streamed = c.execute(select(func.count(func.distinct(s.StreamEntry.trajectory_id)))
                             ).scalar_one()
        decisions = c.execute(select(func.count()).select_from(s.AdmissionDecision)).scalar_one()
    assert sorted(keys) == sorted(f"task-{k}" for k in range(KEYS))
    assert store.count(s.Trajectory) == total
    assert seqs == list(range(1, total + 1))
    assert streamed == total and decisions == total
    assert store.stream_head("run") == total
    store.close()
