"""`stalewise run` with sandboxes on two Docker engines, one of which is lost mid-job.

Contract: with `[sandbox] hosts` listing the first engine (capacity 2: scarce once the other
is gone, with 4 trajectories in flight and warm pools) and a second dockerd (capacity 8),
containers run on both; SIGKILLing the second engine (dockerd, containerd, shims
and containers) while a trajectory uses it marks the host down and counts its sandboxes as
lost; a trajectory that still needed its lost sandbox ends as an infrastructure error
(`infra_error`, naming the host) and none of them reaches the learner, the job finishes on the
first engine with every learner step done and each admitted trajectory consumed exactly once,
and the run's summary counts the lost host.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import select
from test_job_faults import (
    check_exactly_once,
    learner_steps,
    open_store,
    running,
    start,
    wait_for,
    write_config,
)

from core.store import schema as s
from sandboxes.cleanup import list_containers
from sandboxes.labels import RUN_ID

pytestmark = [pytest.mark.docker, pytest.mark.slow]
STEPS = 6  # steps left after the loss: trajectories in flight still need their sandbox


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from engine.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("model") / "tiny")


def _containers_on(engine, run_id: str) -> list[dict]:
    client = engine.client()
    try:
        return client.api.containers(filters={"label": f"{RUN_ID}={run_id}"})
    finally:
        client.close()


def test_losing_the_second_docker_engine_mid_job_fails_only_its_trajectories(
        tmp_path, model_dir, second_docker_host):
    # docs/tasks.md's example family: its trajectories write files into their sandbox when
    # they start and read one back to verify, so a lost sandbox cannot go unnoticed
    example = Path(__file__).resolve().parents[2] / "examples" / "my_task.py"
    config = write_config(tmp_path, model_dir, steps=STEPS, family=f"{example}:family",
                          options="{ max_lines = 6 }")
    text = config.read_text().replace("[sandbox]\n", "[sandbox]\nhosts = [\n"
                                      '  { url = "unix:///var/run/docker.sock", capacity = 2 },\n'
                                      f'  {{ url = "{second_docker_host.url}", capacity = 8 }},\n'
                                      "]\n")
    config.write_text(text)
    proc = start(config)
    try:
        wait_for(lambda: open_store(tmp_path) is not None and learner_steps(tmp_path) >= 1
                 and running(tmp_path), 300, "a learner step with trajectories in flight", proc)
        store = open_store(tmp_path)
        run_id = store.runs()[0].id
        # a container serving a trajectory (renamed from its pool name when assigned)
        wait_for(lambda: any(not any("-pool-" in name for name in c["Names"])
                             for c in _containers_on(second_docker_host, run_id)), 120,
                 "a trajectory's container on the second engine", proc)
        second_docker_host.kill()
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    run = store.run(run_id)
    assert run.status == "finished" and run.summary["learner_steps"] == STEPS
    check_exactly_once(store, run_id, steps=STEPS)
    with store.engine.connect() as c:
        lost = c.execute(select(s.Trajectory.id, s.Trajectory.error).where(
            s.Trajectory.run_id == run_id, s.Trajectory.status == "infra_error")).all()
        admitted = set(c.execute(select(s.StreamEntry.trajectory_id)
                                 .where(s.StreamEntry.run_id == run_id)).scalars())
        statuses = c.execute(select(s.Trajectory.status, s.Trajectory.error).where(
            s.Trajectory.run_id == run_id)).all()
    hosts = run.summary["sandbox_hosts"]
    # the loss is noticed and counted: the sandboxes live there are lost with it. Whether a
    # lost sandbox's trajectory still needed it (a tool call or the verifier after the kill)
    # depends on the untrained model (a truncated trajectory is never verified); those that
    # did are infrastructure errors naming the host, and none of them reaches the learner
    # (the sandbox-level failure itself: tests/sandboxes/test_sandbox_hosts.py)
    assert hosts[second_docker_host.url]["lost"] >= 1, (hosts, statuses, output[-3000:])
    assert all(second_docker_host.url in (t.error or "") for t in lost), [t.error for t in lost]
    assert not admitted & {t.id for t in lost}, "an infrastructure error reached the learner"
    assert hosts[second_docker_host.url]["went_down"] == 1
    assert hosts["unix:///var/run/docker.sock"]["went_down"] == 0
    report = json.loads((tmp_path / "runs" / run_id / "report.json").read_text())
    if lost:
        assert any("infra_error" in k for k in run.summary["admission"]), run.summary["admission"]
    assert report["summary"]["sandbox_hosts"] == hosts
    from sandboxes.engine import connect

    first = connect()
    wait_for(lambda: not list_containers(first, run_id=run_id), 60,
             "the run's containers on the first engine to be removed")
    first.close()
    store.close()
