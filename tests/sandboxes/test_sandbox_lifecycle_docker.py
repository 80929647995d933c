"""Orphans: containers outlive no crashed owner or TTL, and a live owner keeps its own; cleanup
touches only ours."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import pytest

from sandboxes import labels as lab
from sandboxes.cleanup import remove_all, remove_orphans
from sandboxes.image import BASE_IMAGE

pytestmark = pytest.mark.docker

CHILD = textwrap.dedent("""
    import sys, anyio
    from sandboxes.docker_backend import DockerSandbox

    async def main() -> None:
        sandboxes = [DockerSandbox(run_id=sys.argv[1], trajectory_id=f"t{i}") for i in range(2)]
        for sandbox in sandboxes:
            await sandbox.start()
        print("ready", flush=True)
        await anyio.sleep(600)

    anyio.run(main)
""")


def _of_run(client: Any, run_id: str) -> list[dict]:
    return client.api.containers(all=True, filters={"label": f"{lab.RUN_ID}={run_id}"})


def _wait_gone(client: Any, run_id: str, timeout_s: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while (left := _of_run(client, run_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_sigkilled_owner_leaves_no_orphans(docker_client: Any, isolated_installation: str) -> None:
    run_id = f"crash-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen([sys.executable, "-c", CHILD, run_id], stdout=subprocess.PIPE,
                             text=True, env=os.environ.copy())
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        running = _of_run(docker_client, run_id)
        assert len(running) == 2
        assert {c["Labels"][lab.OWNER_PID] for c in running} == {str(child.pid)}
        assert {c["Labels"][lab.INSTALLATION] for c in running} == {isolated_installation}
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    # "start stalewise again": a new process runs the start-up cleanup
    restart = subprocess.run(
        [sys.executable, "-c", "from sandboxes.cleanup import remove_orphans; "
         "print(len(remove_orphans()))"], capture_output=True, text=True, env=os.environ.copy())
    assert restart.returncode == 0, restart.stderr
    assert _wait_gone(docker_client, run_id) == []


def _plain_container(client: Any, labels: dict[str, str]) -> str:
    """A running container without an agent (so nothing but cleanup can end it)."""
    created = client.api.create_container(BASE_IMAGE, command=["sleep", "600"], labels=labels,
                                          host_config=client.api.create_host_config(
                                              network_mode="none", auto_remove=True))
    client.api.start(created["Id"])
    return str(created["Id"])


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_cleanup_removes_only_provable_orphans(docker_client: Any,
                                               isolated_installation: str) -> None:
    run_id = f"orph-{uuid.uuid4().hex[:8]}"
    me = lab.Owner.current()
    base = lab.container_labels(run_id=run_id, trajectory_id="t", ttl_s=3600, owner=me)
    dead_owner = _plain_container(docker_client, {**base, lab.OWNER_PID: str(_dead_pid())})
    live_owner = _plain_container(docker_client, base)
    expired = _plain_container(docker_client, {**base, lab.CREATED_AT: f"{time.time() - 7200}"})
    other_install = _plain_container(docker_client, {**base, lab.INSTALLATION: "someone-else",
                                                     lab.OWNER_PID: str(_dead_pid())})
    try:
        removed = {r.container_id: r.reason for r in remove_orphans()}
        assert set(removed) == {dead_owner, expired}
        assert "gone" in removed[dead_owner] and "time to live" in removed[expired]
        assert remove_orphans() == [], "a live owner's container stays, sweep after sweep"
        ids = {c["Id"] for c in docker_client.api.containers(all=True)}
        assert {live_owner, other_install} <= ids
    finally:
        for container in (other_install, live_owner):
            docker_client.api.remove_container(container, force=True)


def test_remove_all_of_one_run(docker_client: Any, isolated_installation: str) -> None:
    me = lab.Owner.current()
    runs = [f"run-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    ids = {run: _plain_container(docker_client, lab.container_labels(
        run_id=run, trajectory_id=None, ttl_s=3600, owner=me)) for run in runs}
    removed = remove_all(run_id=runs[0])
    assert [r.container_id for r in removed] == [ids[runs[0]]]
    assert _wait_gone(docker_client, runs[0]) == []
    assert len(_of_run(docker_client, runs[1])) == 1
