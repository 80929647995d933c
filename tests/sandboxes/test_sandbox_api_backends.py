"""The `Sandbox` API contract, run against both backends (real Docker and local processes).

These properties do not need isolation, so the local backend must pass them too. One sandbox per
backend is shared by the module where a test does not need a fresh one.
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator

import anyio
import pytest

from core.sandbox import Sandbox, SandboxError, SandboxLimits, SandboxSpec
from sandboxes.docker_backend import DockerSandbox
from sandboxes.local_backend import LocalSandbox

pytestmark = pytest.mark.anyio
SPEC = SandboxSpec(limits=SandboxLimits(output_bytes=4096), files={"given.txt": "from spec\n"})


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=[pytest.param("docker", marks=pytest.mark.docker),
                                        "local"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _new(backend: str, spec: SandboxSpec = SPEC, client: Any = None) -> Any:
    return DockerSandbox(spec, client=client, run_id="test-api") if backend == "docker" \
        else LocalSandbox(spec)


async def _file_appears(sandbox: Sandbox, path: str, deadline_s: float = 60) -> bytes:
    """The file's content once it exists (polled; a generous deadline, not a timing claim)."""
    with anyio.fail_after(deadline_s):
        while True:
            try:
                return await sandbox.read_file(path)
            except SandboxError:
                await anyio.sleep(0.05)


@pytest.fixture(scope="module")
async def shared(backend: str, request: pytest.FixtureRequest) -> AsyncIterator[Sandbox]:
    client = request.getfixturevalue("docker_client") if backend == "docker" else None
    async with _new(backend, client=client) as sandbox:
        yield sandbox


async def test_exit_code_and_separate_streams(shared: Sandbox) -> None:
    result = await shared.exec("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert result.error_type is None and not result.ok


async def test_argv_is_not_shell_parsed(shared: Sandbox) -> None:
    result = await shared.exec(["printf", "%s|", "a b", "$HOME", ";"])
    assert result.stdout == "a b|$HOME|;|"


async def test_stdin_env_and_workdir(shared: Sandbox) -> None:
    await shared.exec("mkdir -p sub")
    result = await shared.exec("cat; echo \"[$GREETING]\"; basename \"$PWD\"",
                               stdin=b"piped\n", env={"GREETING": "hi"}, workdir="sub")
    assert result.stdout == "piped\n[hi]\nsub\n"


async def test_large_stdin_is_streamed_in_full(shared: Sandbox) -> None:
    payload = bytes(range(256)) * 20_000  # 5 MB
    result = await shared.exec("sha256sum", stdin=payload)
    assert result.stdout.split()[0] == hashlib.sha256(payload).hexdigest()


async def test_bad_timeout_is_refused(shared: Sandbox) -> None:
    with pytest.raises(ValueError, match="positive number of seconds"):
        await shared.exec("true", timeout=0)


async def test_spec_files_and_file_round_trip(shared: Sandbox, tmp_path: Path) -> None:
    assert (await shared.exec("cat given.txt")).stdout == "from spec\n"
    payload = bytes(range(256)) * 100
    await shared.write_file("deep/dir/blob.bin", payload)
    assert await shared.read_file("deep/dir/blob.bin") == payload
    digest = (await shared.exec("sha256sum deep/dir/blob.bin")).stdout.split()[0]
    assert digest == hashlib.sha256(payload).hexdigest()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("VALUE = 41 + 1\n")
    (tmp_path / "top.txt").write_text("top\n")
    await shared.put_dir(str(tmp_path), "project")
    result = await shared.exec("cat project/top.txt && cd project && python3 -c "
                               "'import pkg.mod; print(pkg.mod.VALUE)'")
    assert result.stdout == "top\n42\n"


async def test_missing_file_is_a_clear_error(shared: Sandbox) -> None:
    with pytest.raises(SandboxError, match="No such file"):
        await shared.read_file("does/not/exist")


async def test_missing_program_is_exec_failed(shared: Sandbox) -> None:
    result = await shared.exec(["definitely-not-a-program"])
    assert result.error_type == "exec_failed" and "definitely-not-a-program" in result.stderr


async def test_large_output_is_capped_with_size_and_hash(shared: Sandbox) -> None:
    result = await shared.exec("seq 1 100000")
    full = "".join(f"{i}\n" for i in range(1, 100001)).encode()
    assert result.truncated and result.stdout_bytes == len(full)
    assert result.stdout_sha256 == hashlib.sha256(full).hexdigest()
    assert result.stdout.startswith("1\n2\n3\n") and result.stdout.endswith("99999\n100000\n")
    assert "bytes cut" in result.stdout and len(result.stdout) < 4096 + 100


async def test_timeout_kills_the_process_group(shared: Sandbox) -> None:
    start = anyio.current_time()
    result = await shared.exec("sleep 1000 & sleep 1000; echo never", timeout=1)
    assert result.timed_out and result.error_type == "timeout" and result.exit_code is None
    assert anyio.current_time() - start < 30  # the 1 s timeout, not the 1000 s sleep
    assert "never" not in result.stdout


async def test_sigterm_ignoring_child_that_left_the_group_is_killed(shared: Sandbox) -> None:
    script = ("import os, signal, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "os.setsid()\n"
              "open('escapee.pid', 'w').write(str(os.getpid()))\n"
              "time.sleep(1000)\n")
    await shared.write_file("escape.py", script)
    result = await shared.exec("python3 escape.py & sleep 1000", timeout=1.5)
    assert result.timed_out
    pid = (await shared.read_file("escapee.pid")).decode()
    alive = await shared.exec(["sh", "-c", f"kill -0 {pid} 2>/dev/null && echo alive || true"])
    assert alive.stdout == ""


async def test_background_job_with_redirected_output_outlives_the_exec(shared: Sandbox) -> None:
    # the job waits for a file only this test writes after the exec returned: an exec that
    # waited for the job would time out instead of exiting 0
    result = await shared.exec("(until [ -e go ]; do sleep 0.05; done; echo late > late.tmp; "
                               "mv late.tmp late.txt) >/dev/null 2>&1 & echo now", timeout=10)
    assert result.stdout == "now\n" and result.exit_code == 0 and not result.timed_out
    await shared.write_file("go", "")
    assert await _file_appears(shared, "late.txt") == b"late\n"


async def test_background_job_holding_stdout_holds_the_exec(shared: Sandbox) -> None:
    result = await shared.exec("(sleep 0.5; echo late) & echo now", timeout=10)
    assert result.stdout == "now\nlate\n" and result.exit_code == 0


async def test_concurrent_execs_in_one_sandbox(shared: Sandbox) -> None:
    results: dict[int, str] = {}

    async def one(i: int) -> None:
        results[i] = (await shared.exec(f"sleep 0.{i % 3}; echo {i}")).stdout

    async with anyio.create_task_group() as tg:
        for i in range(12):
            tg.start_soon(one, i)
    assert results == {i: f"{i}\n" for i in range(12)}


async def test_a_quick_exec_is_not_blocked_by_a_slow_one(shared: Sandbox) -> None:
    # the slow exec runs until this test writes `release`, which it does only after the quick
    # exec returned: were execs serialised, the quick one would never finish
    await shared.exec("rm -f slow-running release")
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(shared.exec, "touch slow-running; until [ -e release ]; do "
                                               "sleep 0.05; done", timeout=60))
            await _file_appears(shared, "slow-running")
            assert (await shared.exec("echo quick")).stdout == "quick\n"
            await shared.write_file("release", "")


async def test_reset_restores_a_clean_state(backend: str, docker_client_or_none: Any) -> None:
    async with _new(backend, client=docker_client_or_none) as sandbox:
        await sandbox.exec("echo dirty > given.txt; echo junk > extra.txt; "
                           "(sleep 4242.5 >/dev/null 2>&1 &)")
        await sandbox.reset()
        assert (await sandbox.exec("cat given.txt; ls")).stdout == "from spec\ngiven.txt\n"
        procs = await sandbox.exec("ps -eo args | grep -c '^sleep 4242.5' || true")
        assert procs.stdout.strip() == "0"


async def test_closed_sandbox_refuses_work(backend: str, docker_client_or_none: Any) -> None:
    sandbox = _new(backend, client=docker_client_or_none)
    await sandbox.start()
    await sandbox.close()
    await sandbox.close()  # idempotent
    with pytest.raises(SandboxError):
        await sandbox.exec("true")


@pytest.fixture
def docker_client_or_none(backend: str, request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("docker_client") if backend == "docker" else None
