"""Jobs of one installation side by side on one Docker engine, each with a database of its own.

Contract (sandboxes.labels): a container is an orphan only when its owner process is provably
gone (or its TTL has passed), never because a job's store has not heard of its run. So:
- two jobs with different databases run at once, one finishes and the other, running all the
  while, stops cleanly when told (SIGTERM), neither with an infrastructure error: neither
  one's start-up sweep removes the other's live sandboxes;
- a third job, started after one of them was SIGKILLed, removes exactly the dead job's
  containers (one is planted with the dead owner's labels before the kill, as a container whose
  agent never noticed its owner die would be) and none of the live job's. (The second job's
  start-up sweep may also come after the kill; what either sweep removes is the dead job's.)
"""

from __future__ import annotations

import os
import re
import signal
import uuid
from pathlib import Path

import docker
import pytest
from sqlalchemy import func, select
from test_job_faults import containers_of, start, wait_for, write_config

from core.store import schema as s
from core.store.db import StaleSchemaError
from core.store.store import Store
from sandboxes import labels as lab
from sandboxes.image import BASE_IMAGE

pytestmark = [pytest.mark.docker, pytest.mark.slow]
REMOVED = re.compile(r"removed orphan sandbox (\S+): (.+)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from engine.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("model") / "tiny")


def _job(tmp_path: Path, name: str, model: Path, *, steps: int, budget_s: float | None = None
         ) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    config = write_config(folder, model, steps=steps)
    if budget_s is not None:
        config.write_text(config.read_text().replace(
            "[pipeline]\n", f"[pipeline]\nbudget_s = {budget_s}\n"))
    return config


def _run_id(folder: Path) -> str | None:
    if not (folder / "store.db").exists():
        return None
    try:
        store = Store.open(f"sqlite:///{folder}/store.db")
    except StaleSchemaError:  # the job has created the file and is still migrating it
        return None
    try:
        runs = store.runs()
        return runs[0].id if runs else None
    finally:
        store.close()


def _live_containers(folder: Path) -> list[dict]:
    run_id = _run_id(folder)
    return containers_of(run_id, running_only=True) if run_id else []


def _infra_errors(folder: Path) -> int:
    store = Store.open(f"sqlite:///{folder}/store.db")
    try:
        with store.engine.connect() as c:
            return c.execute(select(func.count()).select_from(s.Trajectory)
                             .where(s.Trajectory.status == "infra_error")).scalar_one()
    finally:
        store.close()


def _plant(labels: dict[str, str]) -> str:
    """A running container with `labels` and no agent: only a sweep can end it."""
    client = docker.from_env()
    try:
        created = client.api.create_container(
            BASE_IMAGE, command=["sleep", "600"], labels=labels,
            host_config=client.api.create_host_config(network_mode="none", auto_remove=True))
        client.api.start(created["Id"])
        return client.api.inspect_container(created["Id"])["Name"].lstrip("/")
    finally:
        client.close()


def _finish(proc, what: str, code: int = 0) -> str:
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == code, f"{what} failed:\n{output[-4000:]}"
    return output


def _run_status(folder: Path) -> str:
    store = Store.open(f"sqlite:///{folder}/store.db")
    try:
        return store.runs()[0].status
    finally:
        store.close()


def test_jobs_with_their_own_databases_never_remove_each_others_sandboxes(tmp_path, model_dir):
    env = {"STALEWISE_INSTALLATION_ID": f"concurrent-{uuid.uuid4().hex[:8]}"}
    # runs through the whole test and is stopped at its end; its budget is only a backstop.
    # At 100 s it ran out before the other two jobs ended when CI was slow (the test took 77-112
    # s in earlier runs, 122 s in the one that failed)
    live = tmp_path / "live"
    procs = {"live": start(_job(tmp_path, "live", model_dir, steps=10_000, budget_s=900),
                           env=env)}
    try:
        wait_for(lambda: _live_containers(live), 300, "the live job's sandboxes")
        procs["second"] = start(_job(tmp_path, "second", model_dir, steps=2), env=env)
        killed = tmp_path / "killed"
        procs["killed"] = start(_job(tmp_path, "killed", model_dir, steps=10_000), env=env)
        wait_for(lambda: _live_containers(killed), 300, "the doomed job's sandboxes")
        doomed_labels = dict(_live_containers(killed)[0]["Labels"])
        # planted while its owner lives, so no sweep can take it before it runs: the second
        # job's start-up sweep may come after the kill (CI saw it remove the container between
        # create and start)
        planted = _plant(doomed_labels)
        os.killpg(procs["killed"].pid, signal.SIGKILL)  # orchestrator, engine and learner
        procs["killed"].wait()
        third = tmp_path / "third"
        procs["third"] = start(_job(tmp_path, "third", model_dir, steps=2), env=env)
        wait_for(lambda: _live_containers(third), 300, "the third job's sandboxes")
        assert procs["live"].poll() is None, "the live job must still run at the third's sweep"
        assert _live_containers(live), "the live job's sandboxes are still there"
        outputs = {name: _finish(procs[name], name) for name in ("second", "third")}
        assert procs["live"].poll() is None, "the live job ran alongside both to their end"
        procs["live"].send_signal(signal.SIGTERM)  # rather than wait out its budget
        outputs["live"] = _finish(procs["live"], "live", code=143)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    for name in ("live", "second", "third"):
        assert _infra_errors(tmp_path / name) == 0, f"{name}: a sandbox was taken from it"
    assert _run_status(live) == "aborted"  # stopped as told, not failed
    removed = {container: reason for name in outputs
               for container, reason in REMOVED.findall(outputs[name])}
    doomed_run = doomed_labels[lab.RUN_ID]
    assert planted in removed, f"the dead job's planted container was left: {removed}"
    assert all(container.startswith(f"sw-{doomed_run}-") or container == planted
               for container in removed), f"only the dead job's containers go: {removed}"
    assert all("is gone" in reason for reason in removed.values()), removed
    assert containers_of(doomed_run) == [], "nothing of the SIGKILLed job is left"
