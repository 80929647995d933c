"""What a hostile command cannot do in a Docker sandbox: one property per test, real engine.

(The last test checks the other side of a read-only image: how a task image seeds /work.)

A shared sandbox is used where the property does not need a fresh container (the sandbox must
survive the attack anyway); attacks that change limits get their own container.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
import pytest

from core.sandbox import SandboxError, SandboxLimits, SandboxSpec
from sandboxes.docker_backend import DockerSandbox

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def shared(docker_client: Any) -> AsyncIterator[DockerSandbox]:
    async with DockerSandbox(client=docker_client, run_id="test-isolation") as sandbox:
        yield sandbox


def _cgroup_file(docker_client: Any, container_id: str, controller: str, name: str) -> Path:
    """The host-side cgroup file of a container (v1 or v2), found via its init's /proc entry."""
    pid = docker_client.api.inspect_container(container_id)["State"]["Pid"]
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return Path(f"/sys/fs/cgroup/{controller}{path}/{name}")
        if controllers == "" and Path(f"/sys/fs/cgroup{path}/{name}").exists():
            return Path(f"/sys/fs/cgroup{path}/{name}")
    raise AssertionError(f"no {controller} cgroup for container {container_id[:12]}")


async def test_no_network_dns_or_raw_ip(shared: DockerSandbox) -> None:
    probe = ("import socket\n"
             "try:\n socket.getaddrinfo('deb.debian.org', 80); print('dns ok')\n"
             "except OSError as e:\n print('dns failed', type(e).__name__)\n"
             "for ip in ('1.1.1.1', '8.8.8.8', '172.17.0.1'):\n"
             " s = socket.socket(); s.settimeout(2)\n"
             " try:\n  s.connect((ip, 53)); print('ip ok', ip)\n"
             " except OSError as e:\n  print('ip failed', ip, e.errno)\n")
    result = await shared.exec(["python3", "-c", probe])
    assert result.exit_code == 0, result.stderr
    assert "dns failed" in result.stdout and "dns ok" not in result.stdout
    assert result.stdout.count("ip failed") == 3 and "ip ok" not in result.stdout
    interfaces = await shared.exec("ls /sys/class/net")
    assert interfaces.stdout.split() == ["lo"]


@pytest.mark.slow
async def test_fork_bomb_is_contained_and_host_stays_responsive(docker_client: Any) -> None:
    spec = SandboxSpec(limits=SandboxLimits(pids=64))
    async with DockerSandbox(spec, client=docker_client, run_id="test-forkbomb") as sandbox:
        assert sandbox.container_id is not None
        pids_current = _cgroup_file(docker_client, sandbox.container_id, "pids", "pids.current")
        peak = 0
        worst_lag = 0.0
        host_spawn_s = 0.0

        async def bomb() -> Any:
            return await sandbox.exec("bomb() { bomb | bomb & }; bomb", timeout=4)

        async with anyio.create_task_group() as tg:
            result_box: list[Any] = []
            tg.start_soon(lambda: _collect(bomb, result_box))
            deadline = time.monotonic() + 3.5
            while time.monotonic() < deadline:
                before = time.monotonic()
                await anyio.sleep(0.05)
                worst_lag = max(worst_lag, time.monotonic() - before - 0.05)
                peak = max(peak, int(pids_current.read_text()))
            t0 = time.monotonic()
            subprocess.run(["true"], check=True)
            host_spawn_s = time.monotonic() - t0
        result = result_box[0]
        assert result.timed_out
        assert 32 <= peak <= 64, f"pids in the container peaked at {peak}"
        # catastrophic-stall bounds only: a loaded 2-core host lags on its own
        assert worst_lag < 5.0, f"host event loop stalled {worst_lag:.2f} s"
        assert host_spawn_s < 5.0, f"spawning `true` on the host took {host_spawn_s:.2f} s"
        after = await sandbox.exec("echo recovered")
        assert after.stdout == "recovered\n"
        assert int(pids_current.read_text()) < 10


async def _collect(fn: Any, box: list[Any]) -> None:
    box.append(await fn())


async def test_memory_bomb_is_oom_killed_and_reported(docker_client: Any) -> None:
    spec = SandboxSpec(limits=SandboxLimits(memory_mb=96))
    async with DockerSandbox(spec, client=docker_client, run_id="test-oom") as sandbox:
        result = await sandbox.exec(["python3", "-c", "x = b'x' * (512 << 20)"], timeout=30)
        assert result.oom_killed and result.error_type == "oom"
        assert result.exit_code == 137 and not result.timed_out
        assert (await sandbox.exec("echo alive")).stdout == "alive\n"


async def test_disk_fill_stops_at_the_tmpfs_limit(docker_client: Any) -> None:
    spec = SandboxSpec(limits=SandboxLimits(workdir_mb=16))
    async with DockerSandbox(spec, client=docker_client, run_id="test-disk") as sandbox:
        result = await sandbox.exec("head -c 64M /dev/zero > fill; echo rc=$?; stat -c %s fill")
        assert "No space left on device" in result.stderr
        rc, size = result.stdout.split()
        assert rc != "rc=0" and int(size) <= 16 * 1024 * 1024
        root = await sandbox.exec("touch /usr/x /etc/x /x 2>&1; true")
        assert root.stdout.count("Read-only file system") == 3


async def test_100mb_stdout_is_capped_and_rss_stays_flat(shared: DockerSandbox) -> None:
    size = 100_000_000
    with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
    rss_before = _status_kib("VmRSS")
    result = await shared.exec(f"yes 0123456789 | head -c {size}", timeout=60)
    peak_growth_mb = (_status_kib("VmHWM") - rss_before) / 1024
    assert peak_growth_mb < 50, f"orchestrator peak RSS grew {peak_growth_mb:.1f} MB"
    assert result.exit_code == 0 and result.truncated and result.stdout_bytes == size
    assert len(result.stdout) <= shared.spec.limits.output_bytes + 100
    assert result.stdout.startswith("0123456789\n0123456789\n") and "bytes cut" in result.stdout
    sha = hashlib.sha256()
    line = b"0123456789\n"
    block = line * 100_000
    for _ in range(size // len(block)):
        sha.update(block)
    rest = size % len(block)
    sha.update((line * (rest // len(line) + 1))[:rest])
    assert result.stdout_sha256 == sha.hexdigest()


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(key)


async def test_sleep_timeout_returns_fast_and_leaves_no_process(shared: DockerSandbox) -> None:
    start = time.monotonic()
    result = await shared.exec("sleep 1000", timeout=2)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.error_type == "timeout"
    assert elapsed < 30, "the 2 s timeout, not the 1000 s sleep"
    ps = await shared.exec(["ps", "-eo", "args"])
    commands = [line.split()[0] for line in ps.stdout.splitlines()[1:]]
    assert not any("sleep" in c for c in commands), ps.stdout
    assert sorted(commands) == sorted(["/sbin/docker-init", "timeout", "python3", "ps"])


async def test_sigterm_ignoring_child_is_killed(shared: DockerSandbox) -> None:
    result = await shared.exec("trap '' TERM; (trap '' TERM; exec sleep 777) & sleep 777",
                               timeout=1)
    assert result.timed_out
    ps = await shared.exec(["ps", "-eo", "args"])
    assert "sleep 777" not in ps.stdout


async def test_host_environment_and_files_are_invisible(shared: DockerSandbox,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    secret = f"host-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("STALEWISE_TEST_SECRET", secret)
    host_file = tmp_path / "secret.txt"
    host_file.write_text(secret)
    result = await shared.exec(f"env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'; "
                               f"cat {host_file} {Path(__file__)} 2>&1; ls / /work")
    assert secret not in result.stdout and "STALEWISE_TEST_SECRET" not in result.stdout
    assert result.stdout.count("No such file or directory") == 2
    assert "pyproject.toml" not in result.stdout


async def test_non_root_and_setuid_does_not_regain_root(docker_client: Any,
                                                        task_image: str) -> None:
    spec = SandboxSpec(image=task_image)
    async with DockerSandbox(spec, client=docker_client, run_id="test-setuid") as sandbox:
        result = await sandbox.exec(
            "id -u; stat -c '%U %A' /usr/local/bin/suid-python; "
            "suid-python -c 'import os; print(os.geteuid(), os.getuid())'; "
            "su -c true root </dev/null >/dev/null 2>&1 && echo su-worked || echo su-failed")
        assert result.stdout.splitlines() == ["1000", "root -rwsr-xr-x", "1000 1000",
                                              "su-failed"], result.stdout + result.stderr


async def test_container_killed_mid_exec_is_a_clear_error(docker_client: Any) -> None:
    async with DockerSandbox(client=docker_client, run_id="test-killed") as sandbox:
        async with anyio.create_task_group() as tg:
            box: list[Any] = []
            tg.start_soon(lambda: _collect(
                lambda: sandbox.exec("touch running; sleep 30", timeout=60), box))
            with anyio.fail_after(60):  # kill it mid-exec, once the command runs
                while (await sandbox.exec("test -e running")).exit_code != 0:
                    await anyio.sleep(0.05)
            start = time.monotonic()
            await anyio.to_thread.run_sync(docker_client.api.kill, sandbox.container_id)
        result = box[0]
        assert time.monotonic() - start < 20, "the kill, not the end of the 30 s sleep"
        assert result.error_type == "container_died" and result.exit_code is None
        assert "stopped" in result.error_message
        with pytest.raises(SandboxError, match="gone"):
            await sandbox.exec("true")


async def test_hard_ttl_kills_the_container(docker_client: Any) -> None:
    spec = SandboxSpec(limits=SandboxLimits(ttl_s=2))
    async with DockerSandbox(spec, client=docker_client, run_id="test-ttl") as sandbox:
        start = time.monotonic()
        result = await sandbox.exec("sleep 30", timeout=60)
        assert result.error_type == "container_died"
        assert time.monotonic() - start < 20, "the 2 s TTL, not the end of the 30 s sleep"


async def test_missing_image_is_a_clear_error(docker_client: Any) -> None:
    spec = SandboxSpec(image="stalewise-no-such-image:latest")
    with pytest.raises(SandboxError, match="not found"):
        async with DockerSandbox(spec, client=docker_client, run_id="test-noimage"):
            pass


def test_orchestrator_module_does_not_need_docker_sdk_at_import() -> None:
    code = ("import sys; import core.sandbox, sandboxes.cli, sandboxes.pool; "
            "print('docker' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def test_commands_cannot_reach_the_agents_pipes(shared: DockerSandbox) -> None:
    result = await shared.exec("ls /proc/$PPID/fd 2>&1; cat /proc/$PPID/environ 2>&1; "
                               "echo spoof > /proc/$PPID/fd/1 2>&1; true")
    said = result.stdout + result.stderr  # a failed redirection reports on the shell's stderr
    assert said.count("Permission denied") == 3, said
    assert (await shared.exec("echo still-fine")).stdout == "still-fine\n"


async def test_killing_every_process_ends_the_sandbox_with_a_clear_error(
        docker_client: Any) -> None:
    async with DockerSandbox(client=docker_client, run_id="test-kill-all") as sandbox:
        result = await sandbox.exec("kill -9 -1; sleep 5", timeout=10)
        assert result.error_type == "container_died" and "stopped" in result.error_message


async def test_task_image_seed_is_the_work_dir_snapshot(docker_client: Any,
                                                        task_image: str) -> None:
    spec = SandboxSpec(image=task_image)
    async with DockerSandbox(spec, client=docker_client, run_id="test-seed") as sandbox:
        check = "cd pkg && python3 -c 'import task; print(task.ANSWER)'"
        assert (await sandbox.exec(check)).stdout == "42\n"
        await sandbox.exec("rm -r pkg; echo junk > junk.txt")
        await sandbox.reset()
        assert (await sandbox.exec("ls")).stdout == "pkg\n"
        assert (await sandbox.exec(check)).stdout == "42\n"
