"""Every `stalewise sandbox` command, end to end through the installed entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from sandboxes import labels as lab

STALEWISE = str(Path(sys.executable).parent / "stalewise")


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([STALEWISE, "sandbox", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())


@pytest.mark.docker
def test_run_json_reports_every_field(docker_client: Any) -> None:
    done = _cli("run", "--json", "--memory", "256m", "--pids", "32", "--", "sh", "-c",
                "echo hi; echo oops >&2; cat /sys/fs/cgroup/pids/pids.max; exit 7")
    assert done.returncode == 7, done.stderr
    result = json.loads(done.stdout)
    assert result["stdout"] == "hi\n32\n" and result["stderr"] == "oops\n"
    assert result["exit_code"] == 7
    for key in ("timed_out", "oom_killed", "truncated"):
        assert result[key] is False
    assert result["duration_s"] > 0


@pytest.mark.docker
def test_run_timeout_exits_124(docker_client: Any) -> None:
    start = time.monotonic()
    done = _cli("run", "--timeout", "1", "--", "sleep", "100")
    assert done.returncode == 124 and "timed_out" in done.stderr
    assert time.monotonic() - start < 60, "the 1 s timeout, not the 100 s sleep"


def test_run_local_backend_warns_loudly() -> None:
    done = _cli("run", "--backend", "local", "--", "sh", "-c", "echo local")
    assert done.returncode == 0 and done.stdout == "local\n"
    assert "NOT isolation" in done.stderr


def test_run_rejects_bad_limits() -> None:
    done = _cli("run", "--pids", "2", "--", "true")
    assert done.returncode == 1 and "pids" in done.stderr and "greater than or equal" in done.stderr


@pytest.mark.docker
def test_doctor_passes_on_this_machine(docker_client: Any) -> None:
    done = _cli("doctor")
    assert done.returncode == 0, done.stdout + done.stderr
    for check in ("non-root user", "network off", "read-only root", "memory limit", "swap off",
                  "pids limit", "cpu quota", "no-new-privileges", "no capabilities"):
        assert f"OK   {check}:" in done.stdout


@pytest.mark.docker
def test_build_base_is_cached(docker_client: Any) -> None:
    start = time.monotonic()
    done = _cli("build-base")
    assert done.returncode == 0 and "already present" in done.stdout
    assert time.monotonic() - start < 120, "no rebuild"


@pytest.mark.docker
def test_cleanup_run_removes_that_run(docker_client: Any, isolated_installation: str) -> None:
    run_id = f"cli-{uuid.uuid4().hex[:8]}"
    labels = lab.container_labels(run_id=run_id, trajectory_id=None, ttl_s=3600)
    created = docker_client.api.create_container("stalewise-base:latest", command=["sleep", "600"],
                                                 labels=labels)
    docker_client.api.start(created["Id"])
    orphans = _cli("cleanup")
    assert orphans.returncode == 0 and "0 container(s) removed" in orphans.stdout  # owner alive
    done = _cli("cleanup", "--run", run_id)
    assert done.returncode == 0 and "1 container(s) removed" in done.stdout
    assert created["Id"][:12] in done.stdout
    assert not docker_client.api.containers(all=True, filters={"id": created["Id"]})


def test_cleanup_without_engine_is_a_clear_error() -> None:
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    done = subprocess.run([STALEWISE, "sandbox", "cleanup"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 1
    assert "not reachable" in done.stderr and "ensure_docker.sh" in done.stderr
