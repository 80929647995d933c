"""Shared pieces of the MCP tests: the test server, a task using its tools, a scripted episode."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from core.engine_api import SamplingParams
from core.sandbox import SandboxSpec
from core.tiny_tokenizer import build_tiny_tokenizer
from orchestrator.engines.scripted import ScriptedEngine, turns_from_texts
from orchestrator.rollout import SandboxAcquirer, run_trajectory
from orchestrator.rollout_types import MemoryRecorder, TrajectoryOutcome
from tasks import Component, Rubric, TaskInstance
from tasks.chat import HermesChatFormat
from tasks.tools import Tool

SERVER = Path(__file__).resolve().parent / "mcp_servers" / "notes_server.py"
HOST_COMMAND = [sys.executable, str(SERVER)]
FORMAT = HermesChatFormat(build_tiny_tokenizer(), tool_listing="json")
# add two notes, list them, divide by zero, crash the server, list again (a fresh server)
SCRIPT = [("add_note", {"text": "alpha"}), ("add_note", {"text": "beta"}), ("notes", {}),
          ("divide", {"a": 1, "b": 0}), ("crash", {}), ("notes", {})]
EXPECTED_ERRORS = [None, None, None, "tool_error", "mcp_server_exited", None]


def call(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def task_with(tools: list[Tool], spec: SandboxSpec | None = None) -> TaskInstance:
    return TaskInstance(prompt="Take notes.", tools=tuple(tools),
                        verifier=Rubric(Component("done", lambda ctx: 1.0)),
                        sandbox=spec or SandboxSpec(), family="mcp", key="mcp/train/0")


async def episode(task: TaskInstance, acquire: SandboxAcquirer,
                  script=SCRIPT) -> tuple[TrajectoryOutcome, MemoryRecorder]:
    turns = [call(name, arguments) for name, arguments in script] + ["<answer>done</answer>"]
    engine = ScriptedEngine(turns_from_texts(FORMAT.encode_assistant, turns))
    recorder = MemoryRecorder()
    outcome = await run_trajectory(task=task, engine=engine, acquire_sandbox=acquire,
                                   chat_format=FORMAT, recorder=recorder,
                                   params=SamplingParams(max_tokens=1024))
    return outcome, recorder
