"""MCP stdio servers as tools, the trusted (host) mode: our own JSON-RPC client against a
server written with the official `mcp` SDK. Listing, calls, `isError`, a crash mid-episode (a
recorded tool error; the trajectory goes on with a fresh server), a timeout, and the server
stopped with the trajectory. The in-sandbox mode is in test_mcp_docker.py."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from config.job import parse_config
from orchestrator.rollout import use_sandbox
from orchestrator.rollout_types import TrajectoryStatus
from tasks import load_family
from tasks.mcp import McpServerConfig, discover_tools, mcp_tool, observation, with_tools
from tasks.testing import FakeSandbox
from tests.tasks.mcp_support import EXPECTED_ERRORS, SERVER, episode, task_with

pytestmark = pytest.mark.anyio


def no_sandbox(spec):
    raise AssertionError("a trusted server is listed without a sandbox")


async def test_a_trusted_server_runs_on_the_host_for_a_whole_episode(tmp_path):
    server_file = tmp_path / "notes_server_copy.py"  # a unique path, to find its processes
    shutil.copy(SERVER, server_file)
    server = McpServerConfig(command=[sys.executable, str(server_file)], trusted=True,
                             timeout_s=20, name="notes")
    tools = await discover_tools([server], None, no_sandbox)
    assert [t.name for t in tools] == ["add_note", "notes", "divide", "slow", "crash"]
    divide = next(t for t in tools if t.name == "divide")
    assert divide.parameters["required"] == ["a", "b"] and divide.description == "Divide a by b."
    outcome, recorder = await episode(task_with(tools), use_sandbox(FakeSandbox()))
    assert outcome.status is TrajectoryStatus.COMPLETED, outcome.error
    observations = [r.observation for r in recorder.tool_calls]
    assert observations[:4] == ["1 notes", "2 notes", "alpha\nbeta",
                                "Error: Error executing tool divide: cannot divide by zero"]
    assert observations[4].startswith("Error: MCP server notes exited (status 3)")
    assert observations[5] == "(none)"  # the next call started a fresh server
    assert [r.error_type for r in recorder.tool_calls] == EXPECTED_ERRORS
    found = subprocess.run(["pgrep", "-f", str(server_file)], capture_output=True, text=True)
    assert found.stdout.strip() == "", "the server outlived its trajectory"


async def test_a_server_that_does_not_answer_in_time_is_a_timed_out_tool_call():
    server = McpServerConfig(command=[sys.executable, str(SERVER)], trusted=True, timeout_s=1,
                             name="notes")
    tools = await discover_tools([server], None, no_sandbox)
    outcome, recorder = await episode(task_with(tools), use_sandbox(FakeSandbox()),
                                      script=[("slow", {"seconds": 30}), ("add_note",
                                                                          {"text": "x"})])
    assert outcome.status is TrajectoryStatus.COMPLETED
    late, after = recorder.tool_calls
    assert late.timed_out and late.error_type == "timeout"
    assert "MCP server notes did not answer tools/call within 1s" in late.observation
    assert after.observation == "1 notes"  # a fresh server after the timeout


async def test_a_server_that_cannot_start_stops_the_job_with_one_line():
    server = McpServerConfig(command=["/no/such/server"], trusted=True, name="ghost")
    with pytest.raises(Exception) as caught:
        await discover_tools([server], None, no_sandbox)
    message = str(caught.value)
    assert message.startswith("[[tools.mcp]] ghost: MCP server ghost: cannot start")
    assert "\n" not in message


def test_observations_and_names():
    assert observation({"content": [{"type": "text", "text": "a"},
                                    {"type": "image", "data": "..."}]}).text == "a\n[image content]"
    failed = observation({"content": [{"type": "text", "text": "no"}], "isError": True})
    assert failed.text == "Error: no" and failed.error_type == "tool_error"
    server = McpServerConfig(command=["x"], prefix="fs_")
    assert mcp_tool(server, {"name": "read", "inputSchema": {"type": "object"}}).name == "fs_read"
    with pytest.raises(Exception, match="does not match"):
        mcp_tool(McpServerConfig(command=["x"]), {"name": "a.b"})


def test_job_config_and_family_with_mcp_tools():
    job = parse_config({"tools": {"mcp": [{"command": ["python3", "server.py"],
                                           "trusted": True}]}})
    assert job.tools.mcp[0].label == "python3" and job.tools.mcp[0].trusted
    with pytest.raises(ValueError, match=r"tools\.mcp\[0\]\.command: List should have at least 1"):
        parse_config({"tools": {"mcp": [{"command": []}]}})
    family = load_family("arith")
    extra = mcp_tool(McpServerConfig(command=["x"]), {"name": "note", "inputSchema": {
        "type": "object", "properties": {}}})
    extended = with_tools(family, [extra])
    task = extended.instance(3)
    assert [t.name for t in task.tools] == ["python", "note"]
    assert task.key == family.instance(3).key
    assert task.content_hash != family.instance(3).content_hash
    assert extended.by_key(task.key).content_hash == task.content_hash
    clashing = mcp_tool(McpServerConfig(command=["x"]), {"name": "python"})
    with pytest.raises(ValueError, match=r"MCP tools \['python'\] clash.*prefix"):
        with_tools(family, [clashing])
