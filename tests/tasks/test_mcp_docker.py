"""MCP servers inside the sandbox (the default, untrusted mode), through real Docker: a server
written with the official `mcp` SDK runs in the trajectory's container (no network), reached
by our stdlib client over named pipes; a crash mid-episode is a recorded tool error and the
episode goes on with a fresh server; the server dies with the container."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from core.sandbox import ImageBuild, SandboxLimits, SandboxSpec
from orchestrator.rollout import start_sandbox
from orchestrator.rollout_types import TrajectoryStatus
from sandboxes.docker_backend import DockerSandbox
from sandboxes.engine import connect
from sandboxes.image import ensure_image, image_exists
from tasks.mcp import McpServerConfig, discover_tools
from tests.tasks.mcp_support import EXPECTED_ERRORS, SERVER, episode, task_with

pytestmark = [pytest.mark.docker, pytest.mark.anyio]
ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "var" / "mcp-sdk"
IN_SANDBOX = McpServerConfig(command=["python3", "/opt/notes_server.py"], name="notes",
                             env={"PYTHONPATH": "/opt/mcp-sdk"}, timeout_s=30,
                             startup_timeout_s=60)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # both backends are covered by test_mcp.py; containers are slow


@pytest.fixture(scope="module")
def mcp_image(tmp_path_factory) -> str:
    """stalewise-base plus the MCP SDK folder and the test server (built once per content)."""
    subprocess.run(["bash", str(ROOT / "scripts" / "ensure_mcp_sdk.sh"), sys.executable],
                   check=True, cwd=ROOT)
    digest = hashlib.sha256(SERVER.read_bytes() + b"mcp==2.3.0").hexdigest()[:16]
    tag = f"stalewise-test-mcp:{digest}"
    client = connect()
    if image_exists(client, tag) is None:
        context = tmp_path_factory.mktemp("mcp-image")
        shutil.copytree(SDK, context / "mcp-sdk")
        shutil.copy(SERVER, context / "notes_server.py")
        (context / "Dockerfile").write_text("FROM stalewise-base\nCOPY mcp-sdk /opt/mcp-sdk\n"
                                            "COPY notes_server.py /opt/notes_server.py\n")
        ensure_image(tag, ImageBuild(context=str(context)), client=client)
    client.close()
    return tag


async def test_a_server_in_the_sandbox_serves_a_whole_episode_and_survives_a_crash(mcp_image):
    spec = SandboxSpec(image=mcp_image, limits=SandboxLimits(memory_mb=512))
    tools = await discover_tools([IN_SANDBOX], spec,
                                 lambda s: DockerSandbox(s, run_id="pytest-mcp"))
    assert [t.name for t in tools] == ["add_note", "notes", "divide", "slow", "crash"]
    outcome, recorder = await episode(task_with(tools, spec),
                                      start_sandbox(partial(DockerSandbox, run_id="pytest-mcp")))
    assert outcome.status is TrajectoryStatus.COMPLETED, outcome.error
    observations = [r.observation for r in recorder.tool_calls]
    assert observations[:3] == ["1 notes", "2 notes", "alpha\nbeta"]
    assert "cannot divide by zero" in observations[3]
    assert observations[4].startswith("Error: MCP server notes exited (status 3)")
    assert observations[5] == "(none)"
    assert [r.error_type for r in recorder.tool_calls] == EXPECTED_ERRORS


async def test_the_sandbox_keeps_its_network_off_and_a_missing_server_is_one_line(mcp_image):
    spec = SandboxSpec(image=mcp_image)
    assert spec.limits.network is False
    missing = McpServerConfig(command=["python3", "/opt/absent.py"], name="absent",
                              startup_timeout_s=20)
    with pytest.raises(Exception) as caught:
        await discover_tools([missing], spec, lambda s: DockerSandbox(s, run_id="pytest-mcp"))
    message = str(caught.value)
    assert message.startswith("[[tools.mcp]] absent: MCP server absent exited (status 2)")
    assert "/opt/absent.py" in message and "\n" not in message
