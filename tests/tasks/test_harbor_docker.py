"""Harbor tasks through real Docker: images built from their environment/ folders, episodes
scored by their own tests/test.sh, `stalewise tasks check` (oracle 1, no-op 0), and the
verifier failures that are infrastructure errors, not reward 0."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import anyio
import pytest
from typer.testing import CliRunner

from config.job import AdmissionConfig
from core.engine_api import SamplingParams
from core.tiny_tokenizer import build_tiny_tokenizer
from orchestrator.admission import decide_group
from orchestrator.engines.scripted import ScriptedEngine, turns_from_texts
from orchestrator.groups import member_outcome
from orchestrator.rollout import run_trajectory, start_sandbox
from orchestrator.rollout_types import MemoryRecorder, TrajectoryStatus
from sandboxes.docker_backend import DockerSandbox
from stalewise.cli import app
from tasks import load_family
from tasks.chat import HermesChatFormat
from tests.tasks.harbor_support import BASE_MAP, EXAMPLES, copy_task

pytestmark = [pytest.mark.docker]
FORMAT = HermesChatFormat(build_tiny_tokenizer(), tool_listing="json")
docker_sandbox = start_sandbox(partial(DockerSandbox, run_id="pytest-harbor"))
runner = CliRunner()


def call(name: str, **arguments: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def episode(task, *turns: str):
    async def go():
        engine = ScriptedEngine(turns_from_texts(FORMAT.encode_assistant, list(turns)))
        recorder = MemoryRecorder()
        outcome = await run_trajectory(task=task, engine=engine, acquire_sandbox=docker_sandbox,
                                       chat_format=FORMAT, recorder=recorder,
                                       params=SamplingParams(max_tokens=1024))
        return outcome, recorder
    return anyio.run(go)


def examples() -> dict:
    family = load_family(f"harbor:{EXAMPLES}", {"base_image_map": BASE_MAP})
    return {t.data["harbor_task"]: t for t in family.instances("train")}


def test_episodes_are_scored_by_each_tasks_own_tests():
    tasks = examples()
    outcome, recorder = episode(
        tasks["hello-file"],
        call("bash", command="ls -A /tests /solution; echo listed"),
        call("write_file", path="greeting.txt", content="hello"), "done")
    assert outcome.status is TrajectoryStatus.COMPLETED, outcome.error
    assert outcome.reward == 1.0 and outcome.reward_breakdown == {"reward": 1.0}
    # the tests and the solution are not in the sandbox while the agent works
    assert recorder.tool_calls[0].observation.splitlines() == ["/solution:", "", "/tests:",
                                                               "listed"]
    outcome, _ = episode(tasks["count-lines"],
                         call("bash", command="pwd; wc -l < events.log > count.txt"), "done")
    assert outcome.reward == 1.0, outcome.error  # the image's /app, seeded into the work dir
    outcome, _ = episode(tasks["stalewise/sum-numbers"],
                         call("write_file", path="total.txt", content="51"), "done")
    assert outcome.reward == 0.0 and outcome.reward_breakdown == {"reward": 0.0,
                                                                  "wrote_file": 1.0}


def test_tasks_check_runs_oracle_and_no_op_for_every_example():
    result = runner.invoke(app, ["tasks", "check", str(EXAMPLES), "--options",
                                 json.dumps({"base_image_map": BASE_MAP})])
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines()[1:]]
    assert sorted(rows) == [["count-lines", "1", "0", "yes"], ["hello-file", "1", "0", "yes"],
                            ["stalewise/sum-numbers", "1", "0", "yes"]]


def test_tasks_check_names_each_bad_task_and_the_fix(tmp_path):
    copy_task(tmp_path, "sum-numbers")  # FROM python:3.12-slim, and no map given
    (copy_task(tmp_path, to="silent") / "tests" / "test.sh").write_text("#!/bin/bash\ntrue\n")
    (copy_task(tmp_path, to="generous") / "tests" / "test.sh").write_text(
        "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    (copy_task(tmp_path, to="wrong-oracle") / "solution" / "solve.sh").write_text("true\n")
    result = runner.invoke(app, ["tasks", "check", str(tmp_path / "tasks")])
    assert result.exit_code == 1
    table = {line.split()[0]: line.split()[1:] for line in result.output.splitlines()[1:5]}
    assert table == {"generous": ["1", "1", "NO"], "silent": ["error", "error", "NO"],
                     "stalewise/sum-numbers": ["error", "error", "NO"],
                     "wrong-oracle": ["0", "0", "NO"]}
    problems = [line for line in result.output.splitlines() if line.startswith("problem: ")]
    assert any("harbor task stalewise/sum-numbers" in p and "FROM image 'python:3.12-slim'" in p
               and '[tasks.harbor] base_image_map = { "python:3.12-slim" = "stalewise-base" }'
               in p for p in problems), problems
    assert any("harbor task silent: tests/test.sh (exit 0) wrote no /logs/verifier/reward.txt"
               in p and "echo 1 > /logs/verifier/reward.txt" in p for p in problems), problems
    assert any("harbor task generous: doing nothing scored 1" in p for p in problems)
    assert any("harbor task wrong-oracle: the oracle (solution/solve.sh) scored 0" in p
               for p in problems)


@pytest.mark.parametrize("script, timeout, words", [
    ("#!/bin/bash\nexit 3\n", 30, "tests/test.sh (exit 3) wrote no /logs/verifier/reward.txt"),
    ("#!/bin/bash\nsleep 60\n", 1, "tests/test.sh ran past its 1s; raise [verifier] timeout_sec"),
    ("#!/bin/bash\necho lots > /logs/verifier/reward.txt\n", 30, "not a reward"),
])
def test_a_verifier_that_cannot_score_is_a_recorded_infrastructure_error(tmp_path, script,
                                                                         timeout, words):
    task_dir = copy_task(tmp_path, to="flaky")
    (task_dir / "tests" / "test.sh").write_text(script)
    toml = task_dir / "task.toml"
    toml.write_text(toml.read_text().replace("timeout_sec = 30.0", f"timeout_sec = {timeout}"))
    task = load_family(f"harbor:{task_dir}").instance(0)
    outcome, recorder = episode(task, call("write_file", path="greeting.txt", content="hello"),
                                "done")
    assert outcome.status is TrajectoryStatus.INFRA_ERROR and outcome.reward is None
    assert outcome.error_type == "verifier_error"
    assert "harbor task flaky" in outcome.error and words in outcome.error, outcome.error
    assert "\n" not in outcome.error
    # what the episode recorded is all there
    assert len(recorder.model_calls) == 2 and len(recorder.tool_calls) == 1
    assert outcome.segments and outcome.turns == 2
    # admission keeps it out of training and says why
    member = member_outcome(7, outcome, attempt=0)
    decision = decide_group([member], AdmissionConfig(min_group_size=1), 0, max_tokens=64)[0]
    assert (decision.action, decision.reason) == ("drop", "verifier_error")


def test_an_unmapped_from_image_fails_the_sandbox_start_with_one_line(tmp_path):
    task = load_family(f"harbor:{copy_task(tmp_path, 'sum-numbers')}").instance(0)
    outcome, _ = episode(task, "done")
    assert outcome.status is TrajectoryStatus.INFRA_ERROR
    assert "FROM image 'python:3.12-slim' is not in the local Docker engine" in outcome.error
    assert Path(task.sandbox.build.context).name == "environment"
