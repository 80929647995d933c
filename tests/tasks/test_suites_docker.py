"""Every built-in suite (and the documented example task) through the real Docker sandbox:
the scripted engine replaying the suite's own demonstrations earns reward 1.0, a deliberately
wrong demonstration earns less, and every tool observation is the one the demonstration expects
(so SFT data matches what the tools really say)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import anyio
import pytest

from core.engine_api import SamplingParams
from core.tiny_tokenizer import build_tiny_tokenizer
from orchestrator.engines.scripted import ScriptedEngine, turns_from_texts
from orchestrator.rollout import run_trajectory, start_sandbox
from orchestrator.rollout_types import MemoryRecorder, TrajectoryStatus
from sandboxes.docker_backend import DockerSandbox
from sandboxes.pool import SandboxPool
from tasks import load_family
from tasks.builtin_tools import bash, python, read_file, write_file
from tasks.chat import HermesChatFormat
from tasks.tools import ToolContext, ToolError

pytestmark = [pytest.mark.docker, pytest.mark.anyio]

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "my_task.py")
FAMILIES = {
    "arith": ("arith", {}),
    "story": ("story", {}),
    "codefix": ("codefix", {}),
    "longhaul": ("longhaul", {"max_k": 5, "latency_median_s": 0.005, "latency_max_s": 0.05}),
    "longhaul-sandbox-latency": ("longhaul", {"min_k": 2, "max_k": 3, "latency_in": "sandbox",
                                              "latency_median_s": 0.05}),
    "vault": ("tasks.suites.vault:family", {"depths": [6, 7]}),
    "vault-delay": ("tasks.suites.vault:family", {"depths": [6], "delay_median_s": 0.02,
                                                  "delay_max_s": 0.2}),
    "vault-progress": ("tasks.suites.vault:family", {"depths": [6], "progress_reward": 0.5}),
    "example": (EXAMPLE, {}),
}
FORMAT = HermesChatFormat(build_tiny_tokenizer(), tool_listing="json")
docker_sandbox = start_sandbox(partial(DockerSandbox, run_id="pytest-tasks"))


async def replay(demo):
    engine = ScriptedEngine(turns_from_texts(FORMAT.encode_assistant, demo.assistant_texts))
    recorder = MemoryRecorder()
    outcome = await run_trajectory(task=demo.task, engine=engine, acquire_sandbox=docker_sandbox,
                                   chat_format=FORMAT, params=SamplingParams(max_tokens=1024),
                                   recorder=recorder)
    return outcome, recorder


@pytest.mark.parametrize("name", list(FAMILIES))
async def test_demonstrations_earn_full_reward_and_wrong_ones_less(name):
    ref, options = FAMILIES[name]
    family = load_family(ref, options)
    demos = family.demonstrations(3, start=10) + family.demonstrations(2, wrong_fraction=1.0)
    for demo in demos:
        outcome, recorder = await replay(demo)
        assert outcome.status is TrajectoryStatus.COMPLETED, (demo.task.key, outcome.error)
        expected = [obs for turn in demo.turns for obs in turn.observations]
        assert [r.observation for r in recorder.tool_calls] == expected, demo.task.key
        if demo.correct:
            assert outcome.reward == 1.0, (demo.task.key, outcome.reward_breakdown)
        else:
            assert outcome.reward is not None and outcome.reward < 1.0, demo.task.key
        if name == "vault-progress":  # half the reward is paid per door opened
            opened = len(recorder.tool_calls) / len(demo.task.data["doors"])
            gold = 1.0 if demo.correct else 0.0
            assert outcome.reward == pytest.approx(0.5 * gold + 0.5 * opened), demo.task.key


async def test_builtin_tools_in_a_real_container():
    async with DockerSandbox(run_id="pytest-tasks") as sandbox:
        task = load_family("arith").instance(0)
        ctx = ToolContext(sandbox=sandbox, task=task, timeout_s=30.0)
        assert (await python.invoke(ctx, {"code": "print(6*7)"})).text == "42"
        failed = await python.invoke(ctx, {"code": "raise SystemExit('no')"})
        assert failed.exit_code == 1 and failed.text == "[exit code 1]\nno"
        slow = await python.invoke(ToolContext(sandbox=sandbox, task=task, timeout_s=0.5),
                                   {"code": "import time; time.sleep(5)"})
        assert slow.timed_out and slow.text.startswith("[timed out")
        written = await write_file.invoke(ctx, {"path": "pkg/a.txt", "content": "hi\n"})
        assert written.text == "wrote 3 bytes to pkg/a.txt"
        assert (await read_file.invoke(ctx, {"path": "pkg/a.txt"})).text == "hi"
        assert (await bash.invoke(ctx, {"command": "pwd; ls pkg"})).text == "/work\na.txt"


async def test_write_file_outside_the_work_dir_is_a_tool_error_not_an_infra_error():
    async with DockerSandbox(run_id="pytest-tasks") as sandbox:
        ctx = ToolContext(sandbox=sandbox, task=load_family("arith").instance(0), timeout_s=30.0)
        with pytest.raises(ToolError, match="exit code"):
            await write_file.invoke(ctx, {"path": "/etc/hostname", "content": "x"})



async def test_concurrent_trajectories_through_a_warm_pool():
    """Tasks of one image share a warm pool; each trajectory still gets its own files."""
    family = load_family("codefix")
    demos = family.demonstrations(4, start=20)
    spec = demos[0].task.sandbox.model_copy(update={"files": {}})
    results = {}
    async with SandboxPool(lambda: DockerSandbox(spec, run_id="pytest-tasks"), size=2,
                           max_live=4) as pool:
        async def one(number, demo):
            engine = ScriptedEngine(turns_from_texts(FORMAT.encode_assistant,
                                                     demo.assistant_texts))
            results[number] = await run_trajectory(
                task=demo.task, engine=engine, chat_format=FORMAT, recorder=MemoryRecorder(),
                acquire_sandbox=lambda s, n=number: pool.acquire(trajectory_id=f"pool-{n}"),
                params=SamplingParams(max_tokens=1024), trajectory_id=number)

        async with anyio.create_task_group() as group:
            for number, demo in enumerate(demos):
                group.start_soon(one, number, demo)
    assert [results[n].reward for n in range(4)] == [1.0] * 4, [
        (r.stop_reason, r.error_type, r.error) for r in results.values()]
