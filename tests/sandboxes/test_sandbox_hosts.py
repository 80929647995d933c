"""Sandboxes on several Docker engines: `[sandbox] hosts`, placement, capacity, a lost engine.

The second engine is a real dockerd on this machine (tests/docker_hosts.py,
scripts/second_dockerd.sh), so placement, image copies, container labels and a lost host are
exercised against two real engines.
"""

from __future__ import annotations

import textwrap
import tomllib
import uuid
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from config.errors import ConfigError
from config.job import parse_config
from config.sandbox_hosts import DockerHostConfig
from core.sandbox import HostUnreachable, SandboxError, SandboxSpec
from sandboxes.backends import open_pool
from sandboxes.cleanup import list_containers
from sandboxes.docker_backend import DockerSandbox
from sandboxes.engine import connect, docker_host
from sandboxes.hosts import HostSet, SshForward, copy_image
from sandboxes.image import build_image, image_exists
from sandboxes.pool import SandboxPool

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the Docker backend's blocking SDK calls run in asyncio worker threads
HOSTS_TOML = """
[sandbox]
hosts = [
  { url = "unix:///var/run/docker.sock", capacity = 16 },
  "tcp://10.0.0.5:2375",
  { url = "ssh://user@gpu-box", capacity = 4 },
]
"""


def test_hosts_setting_takes_urls_and_tables_with_capacity():
    cfg = parse_config(tomllib.loads(HOSTS_TOML)).sandbox
    assert [(h.url, h.capacity) for h in cfg.hosts] == [
        ("unix:///var/run/docker.sock", 16), ("tcp://10.0.0.5:2375", None),
        ("ssh://user@gpu-box", 4)]
    assert parse_config({}).sandbox.hosts == []  # default: the one engine at $DOCKER_HOST


@pytest.mark.parametrize("sandbox, words", [
    ({"hosts": ["http://box:2375"]}, "use unix:///path/to/docker.sock"),
    ({"hosts": ["tcp://"]}, "name the machine"),
    ({"hosts": [{"url": "tcp://a:2375", "capacity": 0}]}, "greater than or equal to 1"),
    ({"hosts": ["tcp://a:2375", {"url": "tcp://a:2375", "capacity": 2}]}, "listed twice"),
    ({"hosts": ["tcp://a:2375"], "backend": "local"}, 'set backend = "docker"'),
])
def test_bad_hosts_are_refused_saying_how_to_fix_them(sandbox, words):
    with pytest.raises(ConfigError) as err:
        parse_config({"sandbox": sandbox})
    assert words in str(err.value)


async def test_when_no_engine_answers_placement_fails_at_once_naming_each(tmp_path):
    hosts = HostSet.from_urls([f"unix://{tmp_path}/a.sock", f"unix://{tmp_path}/b.sock"])
    with pytest.raises(HostUnreachable) as err:
        await hosts.reserve()
    assert "a.sock" in str(err.value) and "b.sock" in str(err.value)
    assert all(h.down and h.live == 0 for h in hosts.hosts)


def test_an_ssh_host_that_refuses_fails_with_the_ssh_error(tmp_path):
    """ssh:// hosts go through a local `ssh -N -L` forward; a host that does not answer is
    a `HostUnreachable` with ssh's own words, and leaves no tunnel or socket behind."""
    forward = SshForward("ssh://nobody@127.0.0.1:1/run/docker.sock")
    assert forward.argv()[-4:] == ["-L", f"{forward.local}:/run/docker.sock", "--",
                                   "nobody@127.0.0.1"]
    with pytest.raises(HostUnreachable) as err:
        forward.open(timeout_s=60)
    assert "ssh tunnel to nobody@127.0.0.1 failed" in str(err.value)
    assert "refused" in str(err.value)
    assert forward._process is None and not Path(forward.local).exists()


def _build_marker_image(tmp_path, tag: str) -> None:
    (tmp_path / "Dockerfile").write_text(textwrap.dedent("""\
        FROM stalewise-base:latest
        USER root
        RUN echo from-host-one > /marker
        USER 1000:1000
        """))
    build_image(tmp_path, tag)


@pytest.mark.docker
@pytest.mark.slow
async def test_a_pool_spreads_over_two_engines_within_capacity_copying_the_image(
        tmp_path, second_docker_host, isolated_installation):
    """Placement by load (live / capacity), a host's capacity across the pool, and the spec's
    image copied to the engine that lacks it."""
    tag = "stalewise-test-hosts:latest"
    _build_marker_image(tmp_path, tag)
    second = second_docker_host.client()
    if image_exists(second, tag):
        second.images.remove(tag, force=True)
    run_id = f"hosts-{uuid.uuid4().hex[:8]}"
    hosts = HostSet([DockerHostConfig(url=docker_host(), capacity=2),
                     DockerHostConfig(url=second_docker_host.url, capacity=3)])
    holding = anyio.Event()
    markers: list[str] = []
    async with open_pool(SandboxSpec(image=tag), run_id=run_id, size=0, max_live=8,
                         hosts=hosts) as pool:
        async def hold(index: int) -> None:
            async with pool.acquire(trajectory_id=f"t{index}") as sandbox:
                markers.append((await sandbox.exec("cat /marker")).stdout.strip())
                await holding.wait()

        async with anyio.create_task_group() as tg:
            for index in range(5):
                tg.start_soon(hold, index)
            with anyio.fail_after(300):  # a hang guard: five starts and one image copy
                while len(markers) < 5:
                    await anyio.sleep(0.2)
            first = connect()
            assert len(list_containers(first, run_id=run_id)) == 2
            assert len(list_containers(second, run_id=run_id)) == 3
            assert [h.live for h in hosts.hosts] == [2, 3]
            sixth = anyio.Event()

            async def one_more() -> None:
                async with pool.acquire(trajectory_id="t6"):
                    sixth.set()

            tg.start_soon(one_more)
            with anyio.fail_after(60):  # hang guard: the pool reserves its slot at once
                while pool.live < 6:
                    await anyio.sleep(0.05)
            await wait_all_tasks_blocked()  # the sixth now waits for a host slot
            assert not sixth.is_set(), "a sixth sandbox started beyond the hosts' capacity"
            assert [h.live for h in hosts.hosts] == [2, 3]
            holding.set()
            with anyio.fail_after(120):
                await sixth.wait()
    assert markers == ["from-host-one"] * 5
    assert hosts.hosts[1].stats["images_copied"] == 1 and image_exists(second, tag)
    assert sum(h.stats["placed"] for h in hosts.hosts) == 6
    second.close()
    first.close()


class _SavedImage:
    """A source engine whose `docker save` stream is the given bytes (the target is real)."""

    def __init__(self, archive: bytes) -> None:
        self.api = self
        self.archive = archive

    def get_image(self, image: str) -> bytes:
        return self.archive


def _archive(name: str, data: bytes) -> bytes:
    """A tar archive of one file."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.mark.docker
@pytest.mark.parametrize("archive, words", [
    (b"not a tar archive", "the target engine said: Error processing tar file"),
    (_archive("manifest.json", b"[]"), "reported no error, yet has no stalewise-test-absent"),
])
def test_an_image_copy_the_target_did_not_load_fails_saying_why(archive, words):
    """The engine reports a failed load (a full disk, a broken stream) in the load's progress
    stream, not in its status: the copy must read it, and check the image arrived, or the
    sandbox that needs the image fails later with a bare 'No such image'."""
    target = connect()
    with pytest.raises(SandboxError, match="copying image stalewise-test-absent:latest") as info:
        copy_image(_SavedImage(archive), target, "stalewise-test-absent:latest")
    assert words in str(info.value)
    assert image_exists(target, "stalewise-test-absent:latest") is None


@pytest.mark.docker
@pytest.mark.slow
async def test_a_lost_engine_fails_its_sandboxes_and_is_retried_with_backoff(
        second_docker_host, isolated_installation):
    """Kill the second engine under a live sandbox: that sandbox's next call reports the
    container gone, the engine is marked down, new sandboxes go to the first engine, and once
    the engine is back (after its backoff) sandboxes are placed on it again."""
    run_id = f"hosts-{uuid.uuid4().hex[:8]}"
    hosts = HostSet([DockerHostConfig(url=docker_host()),
                     DockerHostConfig(url=second_docker_host.url)], base_backoff_s=0.5)
    one, two = hosts.hosts
    async with open_pool(SandboxSpec(), run_id=run_id, size=0, max_live=8,
                         hosts=hosts) as pool:
        async with pool.acquire() as on_one, pool.acquire() as on_two:
            assert (on_one.host, on_two.host) == (one, two)
            second_docker_host.kill()
            lost = await on_two.exec("echo hi")
            assert lost.error_type == "container_died" and second_docker_host.url in \
                lost.error_message
            assert (await on_one.exec("echo hi")).stdout == "hi\n"
        for _ in range(3):
            async with pool.acquire() as sandbox:
                assert sandbox.host is one
        assert two.down and two.stats["went_down"] == 1 and two.stats["lost"] >= 1
        assert one.stats["went_down"] == 0

        second_docker_host.start()
        async with AsyncExitStack() as held:  # hold them all, so the loads keep growing
            with anyio.fail_after(120):  # hang guard: backoff doubles from 0.5 s, capped at 30
                while True:
                    sandbox = await held.enter_async_context(pool.acquire())
                    if sandbox.host is two:
                        assert (await sandbox.exec("echo back")).stdout == "back\n"
                        break
                    await anyio.sleep(0.2)
    assert not two.down and two.stats["came_back"] == 1


class _GatedSandbox(DockerSandbox):
    """Holds its host slot at a gate after placement, so a test can order the race between a
    sandbox started ahead and a trajectory that arrives while it starts."""

    gate: anyio.Event

    async def _start(self) -> None:
        await self.gate.wait()
        await super()._start()


@pytest.mark.docker
@pytest.mark.slow
async def test_an_engine_lost_between_placement_and_create_is_an_infrastructure_error(
        second_docker_host, isolated_installation):
    """The engine dies after a sandbox took its slot and before the container exists: the
    start's first engine call (the image check) fails as `HostUnreachable` naming the engine,
    the engine is marked down and the slot given back. (The requests/urllib3 error escaped
    before, and a job that met it in its last minute exited 1.)"""
    hosts = HostSet([DockerHostConfig(url=second_docker_host.url, capacity=1)])
    sandbox = _GatedSandbox(SandboxSpec(), run_id=f"hosts-{uuid.uuid4().hex[:8]}", hosts=hosts)
    sandbox.gate = anyio.Event()
    host = hosts.hosts[0]
    errors: list[BaseException] = []

    async def start() -> None:
        try:
            await sandbox.start()
        except Exception as exc:  # noqa: BLE001 - the test inspects what came out
            errors.append(exc)

    with anyio.fail_after(120):  # hang guard
        async with anyio.create_task_group() as tg:
            tg.start_soon(start)
            while host.live < 1:  # placed: it holds the engine's only slot, at the gate
                await anyio.sleep(0.01)
            second_docker_host.kill()
            sandbox.gate.set()
    assert len(errors) == 1 and isinstance(errors[0], HostUnreachable), errors
    assert second_docker_host.url in str(errors[0])
    assert host.down and host.stats["went_down"] == 1 and host.live == 0


@pytest.mark.docker
@pytest.mark.slow
async def test_a_trajectory_waiting_for_the_last_slot_gets_it_from_a_warm_sandbox(
        docker_client, isolated_installation):
    """Capacity 1: the pool's start-ahead holds the only slot when a trajectory arrives and
    parks waiting for room. Once that sandbox is warm it is closed for the trajectory, which then
    starts (before, the trajectory waited forever beside an idle warm sandbox)."""
    run_id = f"hosts-{uuid.uuid4().hex[:8]}"
    hosts = HostSet([DockerHostConfig(url=docker_host(), capacity=1)])
    gate = anyio.Event()

    def gated() -> DockerSandbox:
        sandbox = _GatedSandbox(SandboxSpec(), run_id=run_id, hosts=hosts)
        sandbox.gate = gate
        return sandbox

    pool = SandboxPool(gated, size=1, max_live=4, on_warm=hosts.wake)
    hosts.add_idle_source(pool.evict_idle)
    async with pool:
        with anyio.fail_after(60):  # hang guard
            while hosts.hosts[0].live < 1:  # the start-ahead has the slot, held at the gate
                await anyio.sleep(0.01)
        async with anyio.create_task_group() as tg:
            ran: list[str] = []

            async def trajectory() -> None:
                async with pool.acquire(trajectory_id="t1") as sandbox:
                    ran.append((await sandbox.exec("echo ran")).stdout)

            tg.start_soon(trajectory)
            await wait_all_tasks_blocked()  # it waits for the slot (takes no warm: none yet)
            assert pool.stats["cold_starts"] == 1 and not ran
            gate.set()
            with anyio.fail_after(120):  # hang guard: the deadlock this test is about
                while not ran:
                    await anyio.sleep(0.05)
    assert ran == ["ran\n"] and pool.stats["evicted"] == 1


@pytest.mark.docker
@pytest.mark.slow
async def test_warm_sandboxes_of_one_spec_yield_their_slots_to_another_spec(
        docker_client, isolated_installation):
    """Two pools share a host of capacity 2; the first fills both slots with warm sandboxes
    nobody asked for. A trajectory of the second spec still gets a sandbox: a warm one of the
    first pool is closed for it, and the first pool's refill waits behind it."""
    run_id = f"hosts-{uuid.uuid4().hex[:8]}"
    hosts = HostSet([DockerHostConfig(url=docker_host(), capacity=2)])
    async with open_pool(SandboxSpec(), run_id=run_id, size=2, max_live=4,
                         hosts=hosts) as first, \
            open_pool(SandboxSpec(scratch_dirs=("/logs",)), run_id=run_id, size=0, max_live=4,
                      hosts=hosts) as second:
        await first.wait_warm(2)
        assert hosts.hosts[0].live == 2
        with anyio.fail_after(120):  # hang guard
            async with second.acquire(trajectory_id="t1") as sandbox:
                assert (await sandbox.exec("test -d /logs && echo second")).stdout == "second\n"
                assert hosts.hosts[0].live == 2  # within capacity all along
        assert first.stats["evicted"] == 1 and second.stats["cold_starts"] == 1
