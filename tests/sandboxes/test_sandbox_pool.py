"""The warm pool: start-ahead, fresh sandbox per trajectory, max live, retries, reuse, shutdown."""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import pytest

from core.sandbox import Sandbox, SandboxError, SandboxSpec
from sandboxes import labels as lab
from sandboxes.docker_backend import DockerSandbox
from sandboxes.local_backend import LocalSandbox
from sandboxes.pool import SandboxPool

pytestmark = pytest.mark.anyio
SPEC = SandboxSpec(files={"seed.txt": "seed\n"})


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _run_containers(client: Any, run_id: str) -> list[dict]:
    return client.api.containers(all=True, filters={"label": f"{lab.RUN_ID}={run_id}"})


@pytest.mark.docker
async def test_warm_pool_hands_out_fresh_started_containers(docker_client: Any) -> None:
    run_id = f"test-pool-{uuid.uuid4().hex[:8]}"
    pool = SandboxPool(lambda: DockerSandbox(SPEC, client=docker_client, run_id=run_id),
                       size=2, max_live=4)
    async with pool:
        await pool.wait_warm()
        started_ahead = {c["Id"] for c in _run_containers(docker_client, run_id)}
        async with pool.acquire(trajectory_id="traj-1") as first:
            assert isinstance(first, DockerSandbox)
            await first.write_file("mine.txt", "trajectory 1")
            first_id = first.container_id
        # handed out from the warm set, not started on the acquire path (latency: bench/sandbox.py)
        assert first_id in started_ahead
        assert pool.stats["cold_starts"] == 0 and pool.stats["waited"] == 0
        async with pool.acquire(trajectory_id="traj-2") as second:
            assert isinstance(second, DockerSandbox) and second.container_id != first_id
            listing = await second.exec("ls")
            assert listing.stdout == "seed.txt\n"
            assert second.trajectory_id == "traj-2"
            with anyio.fail_after(30):  # the container is renamed in the background
                while "traj-2" not in docker_client.api.inspect_container(
                        second.container_id)["Name"]:
                    await anyio.sleep(0.05)
        with anyio.fail_after(10):
            while any(c["Id"] == first_id for c in _run_containers(docker_client, run_id)):
                await anyio.sleep(0.1)
        assert len(_run_containers(docker_client, run_id)) <= pool.max_live
    with anyio.fail_after(10):
        while _run_containers(docker_client, run_id):
            await anyio.sleep(0.1)


class CountingSandbox(LocalSandbox):
    """A local sandbox that records how many instances are alive at once: from the end of a
    start to the close. (A start cancelled part-way, as the pool cancels its start-ahead at
    shutdown, closes itself without having counted: it is not counted out either.)"""

    alive = 0
    peak = 0
    failures_left = 0
    counted = False

    async def start(self) -> None:
        if CountingSandbox.failures_left > 0:
            CountingSandbox.failures_left -= 1
            raise SandboxError("injected start failure")
        await super().start()
        self.counted = True
        CountingSandbox.alive += 1
        CountingSandbox.peak = max(CountingSandbox.peak, CountingSandbox.alive)

    async def close(self) -> None:
        if self.counted:
            self.counted = False
            CountingSandbox.alive -= 1
        await super().close()


@pytest.fixture
def counting() -> type[CountingSandbox]:
    CountingSandbox.alive = CountingSandbox.peak = CountingSandbox.failures_left = 0
    return CountingSandbox


async def test_max_live_bounds_concurrent_sandboxes(counting: type[CountingSandbox]) -> None:
    done = []

    async def trajectory(pool: SandboxPool, i: int) -> None:
        async with pool.acquire(trajectory_id=str(i)) as sandbox:
            result = await sandbox.exec(f"sleep 0.2; echo {i}")
            done.append(result.stdout)

    async with SandboxPool(lambda: counting(SPEC), size=1, max_live=2) as pool:
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(trajectory, pool, i)
        assert pool.stats["waited"] >= 1
    assert sorted(done) == sorted(f"{i}\n" for i in range(6))
    assert counting.peak <= 2 and counting.alive == 0


async def test_creation_is_retried(counting: type[CountingSandbox]) -> None:
    counting.failures_left = 2
    async with SandboxPool(lambda: counting(SPEC), size=0, max_live=2, create_attempts=3,
                           retry_backoff_s=0.01) as pool:
        async with pool.acquire() as sandbox:
            assert (await sandbox.exec("cat seed.txt")).stdout == "seed\n"
        assert pool.stats["start_failures"] == 2


async def test_creation_gives_up_with_the_last_error(counting: type[CountingSandbox]) -> None:
    counting.failures_left = 10
    async with SandboxPool(lambda: counting(SPEC), size=0, max_live=2, create_attempts=2,
                           retry_backoff_s=0.01) as pool:
        with pytest.raises(SandboxError, match="after 2 attempts: injected start failure"):
            async with pool.acquire():
                pass
        assert pool.live == 0


async def test_reuse_resets_to_a_clean_snapshot(counting: type[CountingSandbox]) -> None:
    async with SandboxPool(lambda: counting(SPEC), size=1, max_live=1, reuse=True) as pool:
        async with pool.acquire() as first:
            await first.exec("echo changed > seed.txt; echo x > extra.txt")
        async with pool.acquire() as second:
            assert second is first
            assert (await second.exec("ls; cat seed.txt")).stdout == "seed.txt\nseed\n"
        assert pool.stats["started"] == 1


async def test_on_start_runs_before_the_first_sandbox(counting: type[CountingSandbox]) -> None:
    events: list[str] = []

    async def on_start() -> None:
        events.append(f"cleanup with {counting.alive} alive")

    def factory() -> Sandbox:
        events.append("create")
        return counting(SPEC)

    async with SandboxPool(factory, size=1, max_live=1, on_start=on_start) as pool:
        await pool.wait_warm()
    assert events[:2] == ["cleanup with 0 alive", "create"] and counting.alive == 0


def test_pool_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="size <= max_live"):
        SandboxPool(lambda: LocalSandbox(), size=5, max_live=2)
