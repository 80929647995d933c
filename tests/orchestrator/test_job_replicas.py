"""`stalewise run` with two embedded engine replicas, one of them SIGKILLed mid-job.

Contract (the replica is killed while it generates): the job finishes; the sessions that were
on the killed replica move to the other one and their next model call is recorded with
`cached_prompt_tokens` 0 and the reason (`sampling.kv_recompute`); nothing is admitted twice and the learner's sequence numbers stay
contiguous; every sampled token carries the weights version of the replica that produced it;
the killed replica is restarted (whether it is back before the job ends depends on the machine's
load; `engines/test_fleet.py` checks that a restarted replica serves).
Real processes: two engine servers, the learner, SQLite; sandboxes on the local backend.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select
from test_job_faults import (
    check_exactly_once,
    children_running,
    model_dir,  # noqa: F401  (the module's tiny checkpoint fixture)
    open_store,
    start,
    wait_for,
    write_config,
)

from core.engine_api import METRICS_ROUTE
from core.records import INT32, unpack
from core.store import schema as s

pytestmark = pytest.mark.slow
STEPS = 5  # long enough that the job outlives the kill by a few seconds on a fast machine


def replica_config(tmp_path, model):
    config = write_config(tmp_path, model, steps=STEPS, mode="async")
    text = config.read_text().replace("[sandbox]\n", '[sandbox]\nbackend = "local"\n')
    text = text.replace("max_concurrent = 4", "max_concurrent = 8")
    # calls of 64 tokens: long enough that a replica seen generating is still generating when
    # the kill lands on a loaded machine
    text = text.replace("max_tokens_per_turn = 24", "max_tokens_per_turn = 64")
    config.write_text(text + "\n[engine]\nreplicas = 2\nreplica_health_interval_s = 0.5\n"
                             "replica_health_failures = 2\n")
    return config


def engines_serving(tmp_path) -> int:
    """How many engine replicas have a model call stored."""
    store = open_store(tmp_path)
    if store is None:
        return 0
    try:
        with store.engine.connect() as c:
            return len(c.execute(select(s.ModelCall.engine_id).distinct()).all())
    finally:
        store.close()


def model_calls(store, run_id: str) -> list:
    with store.engine.connect() as c:
        return list(c.execute(
            select(s.ModelCall.engine_id, s.ModelCall.sampling, s.ModelCall.cached_prompt_tokens,
                   s.ModelCall.weights_versions, s.ModelCall.num_tokens, s.ModelCall.turn)
            .join(s.Trajectory, s.Trajectory.id == s.ModelCall.trajectory_id)
            .where(s.Trajectory.run_id == run_id)))


def running_requests(pid: int) -> int:
    """Requests the engine process `pid` is generating now (its /stalewise/metrics)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    port = Path(argv[argv.index("--port-file") + 1]).read_text().strip()
    try:
        return int(httpx.get(f"http://127.0.0.1:{port}{METRICS_ROUTE}", timeout=2).json()
                   ["engine/running"])
    except httpx.HTTPError:
        return 0


def kill_while_generating(pids: list[int], deadline: float) -> int:
    """SIGKILL the first replica seen with requests in flight, whose sessions must then move
    (between two batches no replica has any, and a kill there moves nothing); the kill follows
    the reading at once, before another replica is asked, so the requests are still running."""
    while time.monotonic() < deadline:  # polled without a pause: a batch takes under a second
        for pid in pids:
            if running_requests(pid) > 0:
                os.kill(pid, signal.SIGKILL)
                return pid
    raise AssertionError("no replica was ever generating")


def test_a_killed_replica_fails_over_and_the_job_finishes(tmp_path, model_dir):  # noqa: F811
    proc = start(replica_config(tmp_path, model_dir))
    try:
        wait_for(lambda: len(children_running(proc.pid, "engine")) == 2, 240,
                 "two engine replicas", proc)
        first = children_running(proc.pid, "engine")
        # early, so that on an idle machine the restarted replica serves part of the job; after
        # both replicas have served (a kill before the victim's first call finishes would leave
        # every stored call on the survivor)
        wait_for(lambda: engines_serving(tmp_path) >= 2, 300, "model calls from both replicas",
                 proc)
        kill_while_generating(first, time.monotonic() + 300)
        output, _ = proc.communicate(timeout=600)  # hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    # the restart itself is timed by the machine's load (tests/orchestrator/
    # engines/test_fleet.py checks that a restarted replica serves again)
    assert "engine replica down" in output and "restarting engine replica" in output, output
    store = open_store(tmp_path)
    run = store.runs()[0]
    assert run.status == "finished" and run.summary["learner_steps"] == STEPS
    check_exactly_once(store, run.id, steps=STEPS)

    calls = model_calls(store, run.id)
    moved = [c for c in calls if "kv_recompute" in c.sampling]
    assert moved, f"no model call was recorded as recomputed after the failover:\n{output}"
    assert len({c.sampling["kv_recompute"].split(" went down")[0] for c in moved}) == 1
    for call in moved:
        assert call.sampling["kv_recompute"].startswith("replica_failover: replica ")
        assert call.cached_prompt_tokens == 0, "a moved session's context was not prefilled"
    assert len({c.engine_id for c in calls}) >= 2
    final_version = run.summary["policy_version"]
    versions = set()
    for call in calls:
        per_token = unpack(call.weights_versions, INT32)
        assert len(per_token) == call.num_tokens
        versions |= set(per_token.tolist())
    assert min(versions) == 0 and 0 < max(versions) <= final_version
    store.close()
