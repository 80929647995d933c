"""Local engine replicas for real: `[engine] replicas = 2` starts two embedded engine processes;
one SIGKILLed is restarted by the router on a new port, at the newest weights it applied, and
serves again; `stop` leaves no engine behind."""

from __future__ import annotations

import os
import shutil
import signal

import anyio
import pytest

from config.job import parse_config
from core.engine_api import GenerateRequest, SamplingParams
from orchestrator.engines.fleet import EngineFleet, LocalReplicas

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def anyio_backend():
    return "asyncio"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


async def test_a_killed_local_replica_is_restarted_and_serves_again(model_dir, tmp_path):
    cfg = parse_config({"engine": {"replicas": 2, "replica_health_interval_s": 0.2,
                                   "replica_health_failures": 2}}).engine
    local = LocalReplicas(cfg, model_dir=model_dir, version=0, seed=0, run_dir=tmp_path).start()
    first_pids = [p.pid for p in local.processes]
    params = SamplingParams(max_tokens=4, seed=1)
    try:
        async with EngineFleet(cfg, version=0, replicas=local).client() as router:
            async with anyio.create_task_group() as tg:
                await tg.start(router.run)
                before = await router.generate(GenerateRequest([1, 2, 3], params, "a/0"))
                os.kill(first_pids[0], signal.SIGKILL)
                with anyio.fail_after(300):  # hang guard
                    while router.stats.restarts == 0 or not router.replicas[0].up:
                        await anyio.sleep(0.1)
                after = await router.generate(GenerateRequest([1, 2, 3], params, "b/0"))
                tg.cancel_scope.cancel()
        assert before.engine_id != after.engine_id  # the restarted process is a new engine
        assert router.replicas[0].client is not None and len(after.tokens) > 0
        assert local.processes[0].pid != first_pids[0] and alive(local.processes[0].pid)
        assert (tmp_path / "engine-r0.log").exists() and (tmp_path / "engine-r1.log").exists()
    finally:
        local.stop()
    assert not any(alive(p.pid) for p in local.processes)


async def test_a_restart_survives_the_learner_deleting_its_checkpoint(model_dir, tmp_path):
    """The restart loads a hold of the newest checkpoint: the learner pruning that version while
    the engine starts (a restart takes seconds, a learner step far less) changes nothing."""
    version_dir = tmp_path / "policy" / "v000001"
    shutil.copytree(model_dir, version_dir)
    cfg = parse_config({"engine": {"replicas": 2, "replica_health_interval_s": 0.2,
                                   "replica_health_failures": 2}}).engine
    local = LocalReplicas(cfg, model_dir=model_dir, version=0, seed=0, run_dir=tmp_path).start()
    params = SamplingParams(max_tokens=4, seed=1)
    try:
        async with EngineFleet(cfg, version=0, replicas=local).client() as router:
            async with anyio.create_task_group() as tg:
                await tg.start(router.run)
                await router.update_weights(str(version_dir), 1, mode="drain")
                os.kill(local.processes[0].pid, signal.SIGKILL)
                hold = tmp_path / "engine-r0-weights"
                with anyio.fail_after(300):  # hang guard
                    while not hold.is_dir():
                        await anyio.sleep(0.01)
                shutil.rmtree(version_dir)  # pruned by the learner while the replica starts
                with anyio.fail_after(300):
                    while not router.replicas[0].up:
                        await anyio.sleep(0.1)
                served = await router.replicas[0].client.generate(
                    GenerateRequest([1, 2, 3], params, "c/0"))
                tg.cancel_scope.cancel()
        assert router.stats.restarts == 1, "the first restart failed"
        assert set(served.tokens.weights_versions.tolist()) == {1} and len(served.tokens) > 0
    finally:
        local.stop()
    assert not hold.exists(), "stop leaves the hold behind"
