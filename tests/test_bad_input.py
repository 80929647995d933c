"""Bad input at every boundary (issue 27, part 5), one module.

Contract: input that is wrong at a boundary gets one line (no traceback, no newline) that names
what is wrong, where (the field, the file and line, the server) and how to fix it; nothing hangs;
and where a trajectory is running, nothing it already recorded is lost: the earlier rows are in
the store and the trajectory ends with a terminal status and, when it failed, an error type and
the reason.

- Engine replies: truncated base64, a wrong length, an array too short, NaN or +inf log-probs, a
  reply to another request, a body cut off mid-way; decoded alone and mid-trajectory (the real
  HTTP client and pipeline, SQLite).
- Tool output: binary bytes, 100 MB, invalid UTF-8, terminal escape sequences, a value that is
  not text; through a real Docker exec, and through the agent loop into the store (SQLite, and
  PostgreSQL for NUL bytes).
- Task files: an import error, a syntax error, a task with a missing field or values of the
  wrong type.
- Harbor folders: no `tests/`, a Dockerfile that fails to build.
- MCP servers: lines that are not JSON-RPC, a result that is not an object, a 50 MB answer, no
  answer at all (also to `initialize`), a crash whose last words belong to this call only;
  trusted servers on the host and untrusted ones in a Docker sandbox. The server's
  `readOnlyHint` is exported, never trusted at run time.
- Config: a wrong value in every section of the job config, and in the child processes' files.
- The store: a PostgreSQL server that refuses connections, a database that does not exist, a
  SQLite file whose folder cannot be made; for `stalewise run` (before any work), `audit`,
  `db`, `view` and `audit export`, with the password never shown. A SQLite path where no file
  is, given to a command that reads a store: named, and never created.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
import sys
import textwrap
from functools import partial
from pathlib import Path

import anyio
import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from config.errors import ConfigError
from config.job import load_config, parse_config
from core.engine_api import (
    EngineError,
    GenerateResult,
    SamplingParams,
    decode_generate_reply,
    encode_generate_reply,
)
from core.records import FLOAT32, INT32, SampledTokens, pack, unpack
from core.sandbox import ExecResult, SandboxSpec
from core.store import schema as s
from orchestrator.engines.embedded import engine_client
from orchestrator.engines.scripted import ScriptedEngine, turns_from_texts
from orchestrator.rollout import run_trajectory, start_sandbox, use_sandbox
from orchestrator.rollout_types import MemoryRecorder, TrajectoryStatus
from tasks import TaskInstance, TaskLimits
from tasks.loading import TaskLoadError, load_family
from tasks.mcp import McpError, McpServerConfig, discover_tools, mcp_tool
from tasks.tool_export import export_tools
from tests.bad_input_support import (
    EMIT_TURN,
    ENGINE_URL,
    RAISE_TURN,
    RAW_MCP_SERVER,
    RAW_TOOLS,
    VICTIM,
    BreakingEngine,
    bash_turn,
    output_sandbox,
    rows,
    run_job,
    shell_engine,
    shell_family,
    trajectory,
)
from tests.orchestrator.pipeline_fixtures import TOOL_TURN, coin_family
from tests.tasks.harbor_support import copy_task
from tests.tasks.mcp_support import FORMAT, episode, task_with

CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # what no observation may hold
runner = CliRunner()


def small_task(tools: list, spec: SandboxSpec | None = None):
    """A task with the tools whose observations are cut at 512 characters, so that big
    outputs do not end the episode at its context length."""
    return dataclasses.replace(task_with(tools, spec), limits=TaskLimits(
        max_turns=12, max_observation_chars=512, context_length=8192))


def one_line(message: str) -> str:
    assert "\n" not in message and "Traceback" not in message, message
    return message


# == engine replies ===========================================================================

def _reply(topk: int = 0) -> dict:
    extra = {}
    if topk:
        extra = dict(topk_ids=[[5, 6], [7, 8], [9, 1]],
                     topk_logprobs=[[-0.1, -2.0], [-0.2, float("-inf")], [-0.3, -1.0]])
    tokens = SampledTokens([5, 7, 9], [-0.1, -0.2, -0.3], [0, 0, 0], [0, 0, 0],
                           [0.0, 0.01, 0.02], **extra)
    result = GenerateResult(tokens, "stop", 4, 0, "stalewise-test")
    return json.loads(json.dumps(encode_generate_reply(result, request_id="mine")))


def _floats(values: list[float]) -> str:
    return base64.b64encode(pack(values, FLOAT32)).decode()


def _truncated(payload: dict) -> dict:
    return payload | {"token_ids": payload["token_ids"][:-2]}


def _longer(payload: dict) -> dict:
    return payload | {"length": payload["length"] + 1}


def _short_array(payload: dict) -> dict:
    short = base64.b64encode(pack([0] * (payload["length"] - 1), INT32)).decode()
    return payload | {"kv_versions": short}


def _nan_logprob(payload: dict) -> dict:
    logprobs = unpack(base64.b64decode(payload["sampler_logprobs"]), FLOAT32).copy()
    logprobs[1] = np.nan
    return payload | {"sampler_logprobs": _floats(list(logprobs))}


def _another_request(payload: dict) -> dict:
    return payload | {"request_id": "f" * 32}


ENGINE_FAULTS = {
    "truncated base64": (_truncated, "field 'token_ids': not base64"),
    "length disagrees": (_longer, "field 'token_ids': 12 bytes, expected 4 x 4 (length 4, "
                                  "topk 0)"),
    "array too short": (_short_array, "field 'kv_versions': 8 bytes, expected 3 x 4"),
    "NaN log-prob": (_nan_logprob, "field 'sampler_logprobs': nan at token 1 (1 of 3 such "
                                   "values); a log-probability is a number <= 0 or -inf"),
    "another request": (_another_request, "field 'request_id': 'ffffffffffffffffffffffffffffffff'"
                                          " answers another request (this one was 'mine')"),
}


@pytest.mark.parametrize("fault", ENGINE_FAULTS, ids=str)
def test_a_malformed_engine_reply_is_one_line_naming_the_field(fault):
    corrupt, expected = ENGINE_FAULTS[fault]
    with pytest.raises(EngineError) as caught:
        decode_generate_reply(corrupt(_reply()), source="the engine at E", request_id="mine")
    message = one_line(str(caught.value))
    assert message.startswith("the engine at E sent a malformed generate reply: ")
    assert expected in message, message


def test_nan_and_inf_in_the_top_k_name_the_token_and_the_slot():
    payload = _reply(topk=2)
    topk = unpack(base64.b64decode(payload["topk_logprobs"]), FLOAT32).copy()
    topk[3] = np.inf  # token 1, slot 1
    with pytest.raises(EngineError) as caught:
        decode_generate_reply(payload | {"topk_logprobs": _floats(list(topk))})
    assert one_line(str(caught.value)).endswith(
        "field 'topk_logprobs': inf at token 1, slot 1 (1 of 6 such values); a "
        "log-probability is a number <= 0 or -inf")
    assert decode_generate_reply(_reply(topk=2)).tokens.topk == 2  # -inf stays legal


def _http(corrupt):
    return lambda payload: httpx.Response(200, json=corrupt(payload))


HTTP_FAULTS = {  # the reply's own length shows in some messages: only the fixed words here
    "truncated base64": (_http(_truncated), "malformed generate reply: field 'token_ids': not "
                                            "base64"),
    "length disagrees": (_http(_longer), "malformed generate reply: field 'token_ids': "),
    "array too short": (_http(_short_array), "malformed generate reply: field 'kv_versions': "),
    "NaN log-prob": (_http(_nan_logprob), "malformed generate reply: field 'sampler_logprobs': "
                                          "nan at token 1 (1 of "),
    "another request": (_http(_another_request), "malformed generate reply: field 'request_id':"
                                                 " 'ffffffffffffffffffffffffffffffff' answers "
                                                 "another request (this one was '"),
    "body cut off": (lambda payload: httpx.Response(200, content=json.dumps(payload)[:100]),
                     "sent a reply that is not JSON: '{\"request_id\": \""),
}


@pytest.mark.parametrize("fault", HTTP_FAULTS, ids=str)
def test_a_bad_reply_mid_trajectory_keeps_what_the_trajectory_recorded(sqlite_url, fault):
    """Trajectory 1's second model call gets the bad reply: its first call and tool call stay in
    the store exactly as sent, it ends `infra_error` with the engine error naming the route and
    the field, and the job goes on to its learner step with the other trajectories."""
    corrupt, expected = HTTP_FAULTS[fault]
    engine = BreakingEngine(corrupt)
    client = engine_client(ENGINE_URL, transport=engine.transport, retries=0)
    store = run_job(sqlite_url, engine=client, family=coin_family())

    victim = trajectory(store, int(VICTIM))
    assert (victim.status, victim.stop_reason) == ("infra_error", "engine_error")
    error = one_line(victim.error)
    assert error.startswith(f"engine_error: EngineError: the embedded engine at {ENGINE_URL}"
                            f"/stalewise/generate sent "), error
    assert expected in error, error
    (call,) = rows(store, s.ModelCall, trajectory_id=int(VICTIM))
    assert call.turn == 0 and unpack(call.token_ids, INT32).tolist() == list(TOOL_TURN.token_ids)
    assert unpack(call.token_ids, INT32).tolist() == engine.sent[VICTIM][0].token_ids.tolist()
    (tool_call,) = rows(store, s.ToolCall, trajectory_id=int(VICTIM))
    assert (tool_call.name, tool_call.observation) == ("flip", "flipped")
    _the_others_are_whole(store, model_calls=2, tool_calls=1)
    store.close()


def _the_others_are_whole(store, *, model_calls: int, tool_calls: int,
                          victim_trained: bool | None = False) -> None:
    """Every other trajectory ended, each that completed kept all its rows, and the learner got
    its batch (with the victim only if it completed; None: admission's business)."""
    others = [t for t in rows(store, s.Trajectory) if t.id != int(VICTIM)]
    assert {t.status for t in others} <= {"completed", "aborted"}, [t.error for t in others]
    completed = [t.id for t in others if t.status == "completed"]
    assert len(completed) >= 3
    for tid in completed:
        assert len(rows(store, s.ModelCall, trajectory_id=tid)) == model_calls
        assert len(rows(store, s.ToolCall, trajectory_id=tid)) == tool_calls
    stream = {e.trajectory_id for e in rows(store, s.StreamEntry)}
    assert len(stream) >= 4
    assert victim_trained is None or (int(VICTIM) in stream) is victim_trained


class _NanEngine:
    """An in-process engine (no wire, so no decoder) whose second reply has a NaN log-prob."""

    def __init__(self) -> None:
        self.inner = ScriptedEngine(turns_from_texts(FORMAT.encode_assistant, [
            '<tool_call>{"name": "look", "arguments": {"text": "a"}}</tool_call>', "done"]))

    async def generate(self, request):
        result = await self.inner.generate(request)
        if len(self.inner.requests) == 2:
            tokens = result.tokens
            logprobs = np.array(tokens.sampler_logprobs)
            logprobs[-1] = np.nan
            result = GenerateResult(SampledTokens(tokens.token_ids, logprobs,
                                                  tokens.weights_versions, tokens.kv_versions,
                                                  tokens.time_offsets), "stop", 1, 0, "nan")
        return result

    async def release_session(self, session_id):
        pass


def test_an_in_process_engine_with_a_nan_log_prob_is_an_invalid_reply():
    from tasks import tool

    @tool
    def look(text: str) -> str:
        """Look.

        Args:
            text: what to see.
        """
        return text

    recorder = MemoryRecorder()
    outcome = anyio.run(partial(run_trajectory, task=task_with([look]), engine=_NanEngine(),
                                acquire_sandbox=use_sandbox(None), chat_format=FORMAT,
                                recorder=recorder, params=SamplingParams(max_tokens=256)))
    assert outcome.status is TrajectoryStatus.INFRA_ERROR
    assert outcome.error_type == "engine_invalid_reply"
    assert one_line(outcome.error).startswith(
        "invalid engine reply: sampler_logprobs: nan at token ")
    assert len(recorder.model_calls) == 1 and recorder.tool_calls[0].observation == "a"


# == tool output ==============================================================================

ALL_BYTES = bytes(range(256)) * 16
ESCAPES = "\x1b[1;31mred\x1b[0m \x1b]0;pwned\x07text\x1b[2J\x1b[H"


def _exec(stdout: str, raw: int | None = None) -> ExecResult:
    return ExecResult(exit_code=0, stdout=stdout, stderr="", duration_s=0.0,
                      stdout_bytes=len(stdout.encode()) if raw is None else raw)


TOOL_OUTPUTS = {
    # what the sandbox hands the tool for such output (AgentSession decodes with replacement)
    "binary": _exec(ALL_BYTES.decode("utf-8", errors="replace")),
    "100 MB": _exec("x" * 100_000_000),
    "invalid UTF-8": _exec(b"caf\xe9 \xff\xfe ok".decode("utf-8", errors="replace")),
    "terminal escapes": _exec(ESCAPES),
    # a file name's undecodable bytes as os.fsdecode gives them (surrogateescape): no encoding
    # holds a lone surrogate, so the tokenizer and the store's driver both refused it
    "lone surrogates": _exec("ls: caf\udce9.txt \ud800", raw=16),
}


def _check_observation(kind: str, row) -> None:
    text = row.observation
    assert not CONTROL.search(text), repr(text[:200])
    if kind == "binary":
        assert "".join(map(chr, range(32, 127))) in text  # the printable bytes, in order
        assert "\t\n\ufffd\r\ufffd" in text  # tab, newline, CR kept; other controls shown
    elif kind == "100 MB":
        assert row.truncated and row.output_bytes == 100_000_000
        assert len(text) <= 1024 and text.startswith("x" * 400) and text.endswith("x" * 400)
        assert "chars cut" in text
    elif kind == "invalid UTF-8":
        assert text == "caf\ufffd \ufffd\ufffd ok"
    elif kind == "lone surrogates":
        assert text == "ls: caf\ufffd.txt \ufffd"
    else:
        assert text == "red text"


@pytest.mark.parametrize("kind", TOOL_OUTPUTS, ids=str)
def test_bad_tool_output_is_recorded_as_the_model_saw_it(sqlite_url, kind):
    """Trajectory 1's second tool call prints bad output: the observation is stored cleaned and
    capped, both tool calls and all three model calls are there, and it completes."""
    store = run_job(sqlite_url, engine=shell_engine(bash_turn("bad")), family=shell_family(),
                    sandbox=output_sandbox(TOOL_OUTPUTS[kind]))
    victim = trajectory(store, int(VICTIM))
    assert victim.status == "completed" and victim.error is None
    first, second = rows(store, s.ToolCall, trajectory_id=int(VICTIM))
    assert first.observation == "fine"
    _check_observation(kind, second)
    assert [c.turn for c in rows(store, s.ModelCall, trajectory_id=int(VICTIM))] == [0, 1, 2]
    _the_others_are_whole(store, model_calls=3, tool_calls=2, victim_trained=True)
    store.close()


@pytest.mark.postgres
def test_nul_bytes_in_tool_output_reach_postgresql(pg_url):
    """PostgreSQL text refuses NUL: one such observation used to fail the writer's whole batch,
    the rows of every other trajectory in it too."""
    store = run_job(pg_url, engine=shell_engine(bash_turn("bad")), family=shell_family(), sandbox=output_sandbox(_exec("a\x00b\x00\x00c")))
    _, second = rows(store, s.ToolCall, trajectory_id=int(VICTIM))
    assert second.observation == "a\ufffdb\ufffdc"
    assert trajectory(store, int(VICTIM)).status == "completed"
    _the_others_are_whole(store, model_calls=3, tool_calls=2, victim_trained=True)
    store.close()


def test_a_tool_that_returns_no_text_fails_its_trajectory_and_keeps_the_rest(sqlite_url):
    store = run_job(sqlite_url, engine=shell_engine(EMIT_TURN), family=shell_family(), sandbox=output_sandbox(_exec("")))
    victim = trajectory(store, int(VICTIM))
    assert (victim.status, victim.stop_reason) == ("failed", "tool_exception")
    assert victim.error.startswith("tool_exception: tool emit raised TypeError: tool returned "
                                   "set, which is not JSON"), victim.error
    (first,) = rows(store, s.ToolCall, trajectory_id=int(VICTIM))
    assert first.observation == "fine"
    assert [c.turn for c in rows(store, s.ModelCall, trajectory_id=int(VICTIM))] == [0, 1]
    _the_others_are_whole(store, model_calls=3, tool_calls=2, victim_trained=None)
    store.close()


def test_a_tool_error_naming_an_undecodable_file_is_stored(sqlite_url):
    """A lone surrogate in a tool's exception (a file name as os.fsdecode gives it) reached the
    trajectory's error text, which the store's driver refused: the writer failed the job."""
    store = run_job(sqlite_url, engine=shell_engine(RAISE_TURN), family=shell_family())
    victim = trajectory(store, int(VICTIM))
    assert (victim.status, victim.stop_reason) == ("failed", "tool_exception")
    assert victim.error.startswith("tool_exception: tool emit raised ValueError: cannot open "
                                   "caf\ufffd.txt"), victim.error
    _the_others_are_whole(store, model_calls=3, tool_calls=2, victim_trained=None)
    store.close()


@pytest.mark.docker
def test_bad_output_through_a_real_docker_exec_and_the_agent_loop():
    """The sandbox keeps the byte counts and hashes of what a command really printed and caps
    it; the agent loop then shows the model clean text."""
    from sandboxes.docker_backend import DockerSandbox
    from tasks.builtin_tools import bash

    commands = {
        "binary": "python3 -c 'import sys; sys.stdout.buffer.write(bytes(range(256)) * 16)'",
        "100 MB": "head -c 100000000 /dev/zero | tr '\\0' x",
        "invalid UTF-8": r"printf 'caf\351 \377\376 ok'",
        "terminal escapes": r"printf '\033[1;31mred\033[0m \033]0;pwned\007text\033[2J\033[H'",
    }

    async def main():
        sandbox = DockerSandbox(SandboxSpec(), run_id="pytest-bad-input")
        await sandbox.start()
        try:
            results = {kind: await sandbox.exec(["bash", "-c", command], timeout=120)
                       for kind, command in commands.items()}
            texts = [f"<tool_call>{json.dumps({'name': 'bash', 'arguments': {'command': c}})}"
                     "</tool_call>" for c in commands.values()] + ["done"]
            recorder = MemoryRecorder()
            outcome = await run_trajectory(
                task=small_task([bash]), engine=ScriptedEngine(turns_from_texts(
                    FORMAT.encode_assistant, texts)), acquire_sandbox=use_sandbox(sandbox),
                chat_format=FORMAT, recorder=recorder, params=SamplingParams(max_tokens=1024))
            return results, outcome, recorder
        finally:
            await sandbox.close()

    results, outcome, recorder = anyio.run(main)
    binary = results["binary"]
    assert binary.stdout_bytes == len(ALL_BYTES) and not binary.truncated
    assert binary.stdout_sha256 == hashlib.sha256(ALL_BYTES).hexdigest()
    assert binary.stdout == ALL_BYTES.decode("utf-8", errors="replace")
    huge = results["100 MB"]
    assert huge.truncated and huge.stdout_bytes == 100_000_000 and huge.exit_code == 0
    assert len(huge.stdout) <= SandboxSpec().limits.output_bytes + 100
    assert "stalewise: 99934464 bytes cut" in huge.stdout
    assert results["invalid UTF-8"].stdout == "caf\ufffd \ufffd\ufffd ok"
    assert results["terminal escapes"].stdout == ESCAPES  # raw: the loop cleans, not the sandbox
    assert outcome.status is TrajectoryStatus.COMPLETED, outcome.error
    observations = [r.observation for r in recorder.tool_calls]
    assert len(observations) == 4 and not any(CONTROL.search(o) for o in observations)
    assert observations[2:] == ["caf\ufffd \ufffd\ufffd ok", "red text"]
    assert recorder.tool_calls[1].truncated and recorder.tool_calls[1].original_bytes >= 65536


# == task files ===============================================================================

def _family_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "my_tasks.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _task_file(make: str) -> str:
    return f"""\
        from tasks import TaskFamily, TaskInstance, TaskLimits, Rubric, Component

        ok = Rubric(Component("ok", lambda ctx: 1.0))

        def make(index, split):
            return {make}

        family = TaskFamily("broken", make)
        """


TASK_FILES = {
    "import error": ("import nowhere_to_be_found_module\n",
                     "failed at line 1: ModuleNotFoundError: No module named "
                     "'nowhere_to_be_found_module'; install it in this environment or fix the "
                     "import"),
    "error while importing": ("x = 1\n\nraise RuntimeError('no tasks today')\n",
                              "failed at line 3: RuntimeError: no tasks today; fix the file"),
    "syntax error": ("def family(:\n    pass\n", "failed at line 1: SyntaxError"),
    "missing field": (_task_file('TaskInstance(prompt="p", tools=())'),
                      "building train instance 0 of family broken failed: TypeError: "
                      "TaskInstance.__init__() missing 1 required positional argument: "
                      "'verifier'; fix the family's make function"),
    "prompt of the wrong type": (
        _task_file("TaskInstance(prompt=42, tools=(), verifier=ok)"),
        "TypeError: TaskInstance.prompt must be a string or a sequence of ChatMessage, got "
        "int 42"),
    "tools of the wrong type": (
        _task_file('TaskInstance(prompt="p", tools="bash", verifier=ok)'),
        "TaskInstance.tools must be a sequence of @tool functions, got str 'bash'"),
    "limits of the wrong type": (
        _task_file('TaskInstance(prompt="p", tools=(), verifier=ok, '
                   'limits={"max_turns": 3})'),
        "TaskInstance.limits must be a TaskLimits, got dict {'max_turns': 3}; build it with "
        "TaskLimits(max_turns=...)"),
    "a limit out of range": (
        _task_file('TaskInstance(prompt="p", tools=(), verifier=ok, '
                   'limits=TaskLimits(max_turns=0))'),
        "ValidationError: TaskLimits.max_turns: Input should be greater than or equal to 1 "
        "(got 0)"),
    "verifier not callable": (
        _task_file('TaskInstance(prompt="p", tools=(), verifier="yes")'),
        "TaskInstance.verifier must be callable (a Rubric or an async function of "
        "VerifyContext), got str 'yes'"),
}


@pytest.mark.parametrize("case", TASK_FILES, ids=str)
def test_a_task_file_that_cannot_be_used_is_one_line_naming_the_file(tmp_path, case):
    body, expected = TASK_FILES[case]
    path = _family_file(tmp_path, body)
    with pytest.raises(TaskLoadError) as caught:
        load_family(path)
    message = one_line(str(caught.value))
    assert path in message and expected in message, message


def _answered_with_verifier_returning(returned):
    """The outcome of a one-turn answer to a task whose verifier returns `returned`."""
    async def verifier(ctx):
        return returned

    return anyio.run(partial(
        run_trajectory, task=TaskInstance(prompt="p", tools=(), verifier=verifier),
        engine=ScriptedEngine(turns_from_texts(FORMAT.encode_assistant, ["done"])),
        acquire_sandbox=use_sandbox(None), chat_format=FORMAT, recorder=MemoryRecorder(),
        params=SamplingParams(max_tokens=64)))


@pytest.mark.parametrize("returned, said", [
    (None, "the verifier returned NoneType None, not a Reward; return Reward(score) or a number "
           "(a verifier without a return statement returns None)"),
    ("1.0", "the verifier returned str '1.0', not a Reward; return Reward(score) or a number"),
    ({"value": 1}, "the verifier returned dict {'value': 1}, not a Reward; return "
                   "Reward(score) or a number"),
], ids=["None", "a string", "a dict"])
def test_a_verifier_that_returns_no_reward_fails_its_trajectory_in_one_line(returned, said):
    """A verifier returning None left a completed trajectory with no reward; a string or a dict
    raised AttributeError out of the agent loop."""
    outcome = _answered_with_verifier_returning(returned)
    assert (outcome.status, outcome.error_type) == (TrajectoryStatus.FAILED, "verifier_exception")
    assert outcome.reward is None
    assert outcome.error.splitlines()[0] == f"verifier raised TypeError: {said}"


@pytest.mark.parametrize("returned", [1, 0.5, True, np.float32(0.25)], ids=repr)
def test_a_verifier_may_return_a_plain_number(returned):
    outcome = _answered_with_verifier_returning(returned)
    assert outcome.status is TrajectoryStatus.COMPLETED and outcome.reward == float(returned)


def test_the_run_command_names_the_config_field_of_a_bad_task_file(tmp_path):
    path = _family_file(tmp_path, "import nowhere_to_be_found_module\n")
    config = tmp_path / "job.toml"
    config.write_text(f'[tasks]\nfamily = "{path}"\n')
    from stalewise.cli import app

    result = runner.invoke(app, ["run", str(config), "--dry-run"])
    assert result.exit_code == 2
    (line,) = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: {config}: tasks.family: importing task file {path} failed "
                           "at line 1: ModuleNotFoundError"), line


# == Harbor folders ===========================================================================

def test_a_harbor_task_without_tests_is_one_line(tmp_path):
    import shutil

    task = copy_task(tmp_path, to="no-tests")
    shutil.rmtree(task / "tests")
    with pytest.raises(TaskLoadError) as caught:
        load_family(f"harbor:{tmp_path / 'tasks'}")
    assert one_line(str(caught.value)) == (
        f"harbor task no-tests ({task}): tests/test.sh is missing; add a script that writes "
        "/logs/verifier/reward.txt")


@pytest.mark.parametrize("relative, said", [
    ("instruction.md", "instruction.md is not UTF-8 text (byte 0); save it as UTF-8"),
    ("task.toml", "task.toml is not UTF-8 text (byte 0); save it as UTF-8"),
    ("environment/Dockerfile", "environment/Dockerfile is not UTF-8 text (byte 0); save it as "
                               "UTF-8"),
], ids=["instruction", "task.toml", "Dockerfile"])
def test_a_harbor_file_that_is_not_utf8_is_one_line(tmp_path, relative, said):
    """A Latin-1 or UTF-16 file used to end the load in UnicodeDecodeError's traceback."""
    task = copy_task(tmp_path, to="latin")
    (task / relative).write_bytes(b"\xff\xfe" + (task / relative).read_bytes())
    with pytest.raises(TaskLoadError) as caught:
        load_family(f"harbor:{tmp_path / 'tasks'}")
    assert one_line(str(caught.value)) == f"harbor task latin ({task}): {said}"


def test_a_harbor_task_toml_that_is_a_folder_is_named_so(tmp_path):
    task = copy_task(tmp_path, to="folder")
    (task / "task.toml").unlink()
    (task / "task.toml").mkdir()
    with pytest.raises(TaskLoadError) as caught:
        load_family(f"harbor:{tmp_path / 'tasks'}")
    assert one_line(str(caught.value)) == (f"harbor task folder ({task}): task.toml is a folder; "
                                           "make it a file")


@pytest.mark.docker
def test_a_dockerfile_that_fails_to_build_is_one_line_in_the_check_and_the_episode(tmp_path):
    from sandboxes.docker_backend import DockerSandbox
    from tasks.harbor_check import check_harbor_family

    task = copy_task(tmp_path, to="bad-build")
    dockerfile = task / "environment" / "Dockerfile"
    dockerfile.write_text("FROM stalewise-base\nRUN echo 'E: Unable to locate package nope' "
                          ">&2 && exit 7\n")
    family = load_family(f"harbor:{task}")
    docker = start_sandbox(partial(DockerSandbox, run_id="pytest-bad-input"))
    (row,) = anyio.run(check_harbor_family, family, docker)
    (problem,) = row.problems  # the oracle and the no-op fail alike: said once
    expected = (f"harbor task bad-build: building {family.instance(0).sandbox.image} from "
                f"{dockerfile} failed: The command '/bin/sh -c echo 'E: Unable to locate "
                f"package nope' >&2 && exit 7' returned a non-zero code: 7; its last output: "
                f"'E: Unable to locate package nope'; fix the Dockerfile (`docker build "
                f"{task / 'environment'}` shows the whole log)")
    assert one_line(problem) == expected, problem
    recorder = MemoryRecorder()
    outcome = anyio.run(partial(
        run_trajectory, task=family.instance(0), acquire_sandbox=docker, chat_format=FORMAT,
        engine=ScriptedEngine(turns_from_texts(FORMAT.encode_assistant, ["done"])),
        recorder=recorder, params=SamplingParams(max_tokens=64)))
    assert outcome.status is TrajectoryStatus.INFRA_ERROR
    assert outcome.error_type == "sandbox_error"
    assert "returned a non-zero code: 7" in one_line(outcome.error), outcome.error


# == MCP servers ==============================================================================

def _raw(tmp_path: Path, **settings) -> McpServerConfig:
    server = tmp_path / "raw_mcp_server.py"
    server.write_text(RAW_MCP_SERVER)
    return McpServerConfig(command=[sys.executable, str(server)], trusted=True, name="raw",
                           **settings)


def _no_sandbox(spec):
    raise AssertionError("trusted servers are listed without a sandbox")


def _host_episode(server: McpServerConfig, script: list) -> tuple:
    async def main():
        tools = await discover_tools([server], None, _no_sandbox)
        return await episode(task_with(tools), use_sandbox(None), script=script)
    return anyio.run(main)


def test_mcp_answers_that_are_not_json_rpc_are_observations_and_the_episode_goes_on(tmp_path):
    outcome, recorder = _host_episode(_raw(tmp_path, timeout_s=1), [
        ("look", {"text": "a"}), ("garbage", {}), ("bad_result", {}), ("silent", {}),
        ("look", {"text": "b"})])
    assert outcome.status is TrajectoryStatus.COMPLETED, outcome.error
    first, garbage, bad_result, silent, last = recorder.tool_calls
    assert (first.observation, last.observation) == ("a", "b")  # a fresh server after each
    assert garbage.timed_out and garbage.error_type == "timeout"
    assert garbage.observation == (
        "Error: MCP server raw did not answer tools/call within 1s; it wrote 2 line(s) on "
        "stdout that are not a JSON-RPC reply to it (the last: '{\"jsonrpc\": \"2.0\", \"id\": "
        "\"someone-else\", \"result\": {}}'): stdout must carry only JSON-RPC messages")
    assert bad_result.error_type == "mcp_error"
    assert bad_result.observation == (
        "Error: MCP server raw answered tools/call with a result that is str \"not an "
        "object\", not an object: not an MCP answer; fix the server")
    assert silent.observation == "Error: MCP server raw did not answer tools/call within 1s"


def test_a_50_mb_mcp_answer_is_refused_by_default_and_capped_when_allowed(tmp_path):
    _, refused = _host_episode(_raw(tmp_path), [("huge", {"mb": 50}), ("look", {"text": "a"})])
    big, after = refused.tool_calls
    assert big.error_type == "mcp_reply_too_large"
    assert big.observation == (
        "Error: MCP server raw sent more than 16 MiB without finishing its answer to "
        "tools/call; it was stopped (the next call starts a fresh one): make the tool answer "
        "less or raise [[tools.mcp]] max_reply_mb")
    assert after.observation == "a"
    _, allowed = _host_episode(_raw(tmp_path, max_reply_mb=64), [("huge", {"mb": 50})])
    (big,) = allowed.tool_calls
    assert big.error_type is None and big.truncated and big.original_bytes == 50 * 2**20
    assert big.observation.startswith("x" * 1000) and "chars cut" in big.observation


@pytest.mark.parametrize("command, said", [
    ("import sys; sys.stdin.read()", ""),
    ("import sys; print('listening on stdio', flush=True); sys.stdin.read()",
     "; it wrote 1 line(s) on stdout that are not a JSON-RPC reply to it (the last: "
     "'listening on stdio'): stdout must carry only JSON-RPC messages"),
], ids=["silent", "logs on stdout"])
def test_an_mcp_server_that_never_answers_initialize_stops_the_job_with_one_line(command, said):
    server = McpServerConfig(command=[sys.executable, "-c", command], trusted=True, name="mute",
                             startup_timeout_s=1)
    with pytest.raises(McpError) as caught:
        anyio.run(discover_tools, [server], None, _no_sandbox)
    assert one_line(str(caught.value)) == (
        f"[[tools.mcp]] mute: MCP server mute did not answer initialize within 1s{said}; check "
        f"its command {server.command} (in the task image unless trusted = true)")


def _last_words_checks(recorder: MemoryRecorder, exited_with: tuple[int, int]) -> None:
    chatty, vanished, chatty_again, fatal, after = recorder.tool_calls
    assert chatty.observation == chatty_again.observation == after.observation == "warm"
    assert vanished.error_type == fatal.error_type == "mcp_server_exited"
    assert vanished.observation == (
        f"Error: MCP server raw exited (status {exited_with[0]}) before answering tools/call; "
        f"it wrote nothing to stderr during this call")  # not the earlier call's "warming up"
    assert fatal.observation == (
        f"Error: MCP server raw exited (status {exited_with[1]}) before answering tools/call; "
        f"its last words on stderr: fatal: the disk is on fire")


LAST_WORDS = [("chatty", {}), ("vanish", {}), ("chatty", {}), ("fatal", {}), ("chatty", {})]


def test_a_crashed_mcp_servers_last_words_are_from_this_call_only(tmp_path):
    outcome, recorder = _host_episode(_raw(tmp_path), LAST_WORDS)
    assert outcome.status is TrajectoryStatus.COMPLETED, outcome.error
    _last_words_checks(recorder, (4, 5))


def test_the_servers_read_only_hint_is_exported_but_not_trusted_at_run_time(tmp_path):
    tools = anyio.run(discover_tools, [_raw(tmp_path)], None, _no_sandbox)
    hints = {d["name"]: d["annotations"]["readOnlyHint"] for d in export_tools(tools, "mcp")}
    assert hints == {t["name"]: t["annotations"]["readOnlyHint"] for t in RAW_TOOLS}
    assert hints["look"] is True and hints["vanish"] is False
    assert not any(t.read_only for t in tools)  # read-only calls would run concurrently
    assert {t.name: t.idempotent for t in tools}["look"] is True
    plain = mcp_tool(McpServerConfig(command=["x"]), {"name": "plain"})
    assert export_tools([plain], "mcp")[0]["annotations"]["readOnlyHint"] is False


@pytest.mark.docker
def test_an_mcp_server_in_the_sandbox_behaves_the_same(tmp_path):
    """In the sandbox the client is a script run per call: an answer longer than the exec's
    output cap (64 KiB) still arrives, a 50 MB one is refused, a silent server is a timeout,
    and the last words are this call's."""
    from sandboxes.docker_backend import DockerSandbox

    server = McpServerConfig(command=["python3", "/work/raw_mcp_server.py"], name="raw",
                             timeout_s=3)
    tools = [mcp_tool(server, entry) for entry in RAW_TOOLS]
    spec = SandboxSpec(files={"raw_mcp_server.py": RAW_MCP_SERVER})
    script = [("huge", {"mb": 0.25}), ("huge", {"mb": 50}), ("garbage", {}), *LAST_WORDS]
    outcome, recorder = anyio.run(episode, small_task(tools, spec),
                                  start_sandbox(partial(DockerSandbox, run_id="pytest-bad-input")),
                                  script)
    assert outcome.status is TrajectoryStatus.COMPLETED, outcome.error
    long, too_long, garbage = recorder.tool_calls[:3]
    assert long.error_type is None and long.original_bytes == 2**18, long.observation[:300]
    assert long.observation.startswith("x" * 200) and long.truncated
    assert too_long.error_type == "mcp_reply_too_large"
    assert "sent more than 16 MiB without finishing its answer" in too_long.observation
    assert garbage.error_type == "timeout" and garbage.observation.startswith(
        "Error: MCP server raw did not answer tools/call within 3s; it wrote 2 line(s) on "
        "stdout that are not a JSON-RPC reply to it")
    recorder.tool_calls[:] = recorder.tool_calls[3:]
    _last_words_checks(recorder, (4, 5))


# == config sections ==========================================================================

CONFIG_CASES = [
    ({"run": {"progress_every_s": "fast"}},
     "run.progress_every_s: Input should be a valid number, unable to parse string as a number "
     "(got 'fast')"),
    ({"run": 3}, "run: expected a table of key = value settings, got 3"),
    ({"model": {"chat_format": "chatml"}},
     "model.chat_format: got 'chatml'; allowed values: 'auto', 'hermes', 'template', "
     "'qwen2.5', 'qwen3', 'llama3.1' or 'mistral-v0.3'"),
    ({"engine": {"max_batch": 0}},
     "engine.max_batch: Input should be greater than or equal to 1 (got 0)"),
    ({"engine": {"url": "http://a", "urls": ["http://b"]}},
     "engine: engine.url and engine.urls are both set: list every running engine in urls (one "
     "replica each) and remove url"),
    ({"sandbox": {"pool_size": 9, "max_live": 2}},
     "sandbox: sandbox.pool_size (9) exceeds sandbox.max_live (2); lower pool_size or raise "
     "max_live"),
    ({"sandbox": {"hosts": ["http://docker"]}},
     "sandbox.hosts[0].url: Docker host 'http://docker': use unix:///path/to/docker.sock, "
     "tcp://HOST:PORT or ssh://USER@HOST (got 'http://docker')"),
    ({"sandbox": {"hosts": [{"url": "tcp://h:2375", "capacty": 3}]}},
     "sandbox.hosts[0].capacty: unknown field; did you mean 'capacity'? allowed fields: capacity, "
     "url"),
    ({"tasks": {"eval_instances": -1}},
     "tasks.eval_instances: Input should be greater than or equal to 0 (got -1)"),
    # passed until the job's first engine request, after the warm start
    ({"rollout": {"temperature": float("inf")}},
     "rollout.temperature: Input should be a finite number (got inf)"),
    ({"learner": {"optimizer": {"lr": float("nan")}}},
     "learner.optimizer.lr: Input should be a finite number (got nan)"),
    # the start of the run's id and of its folder: '../x' put the folder outside output_dir
    ({"run": {"name": "../x"}},
     "run.name: a run name is 1-64 letters, digits, '_', '.' or '-', starting with a letter or "
     "digit: it starts the run's id and its folder under run.output_dir (got '../x')"),
    # -1 is "a random seed" in other tools; here it was a fixed seed, and NumPy refuses it
    ({"run": {"seed": -1}},
     "run.seed: Input should be greater than or equal to 0 (got -1)"),
    ({"learner": {"sft": {"seed": 2**64}}},
     "learner.sft.seed: Input should be less than or equal to 9223372036854775807 (got "
     "18446744073709551616)"),
    ({"tasks": {"harbor": {"max_cpu": 2}}},
     "tasks.harbor.max_cpu: unknown field; did you mean 'max_cpus'? allowed fields: "
     "allow_network, base_image_map, limits, max_cpus, max_memory_mb, output_bytes, "
     "tool_timeout_s"),
    ({"tools": {"mcp": [{"command": "server.py"}]}},
     "tools.mcp[0].command: expected a list, got 'server.py'; write it in brackets, e.g. "
     "['server.py']"),
    ({"tools": {"mcp": [{"command": ["s"], "timeout": 5}]}},
     "tools.mcp[0].timeout: unknown field; did you mean 'timeout_s'? allowed fields: command, "
     "env, max_reply_mb, name, prefix, startup_timeout_s, timeout_s, trusted"),
    ({"rollout": {"group_size": "four"}},
     "rollout.group_size: Input should be a valid integer, unable to parse string as an "
     "integer (got 'four')"),
    ({"admission": {"stale": "maybe"}},
     "admission.stale: got 'maybe'; allowed values: 'drop', 'requeue' or 'keep'"),
    ({"learner": {"loss": {"clip_low": 2}}},
     "learner.loss.clip_low: Input should be less than 1 (got 2)"),
    ({"learner": {"advantage": {"estimator": "ppo"}}},
     "learner.advantage.estimator: got 'ppo'; allowed values: 'grpo', 'dr_grpo', 'rloo', "
     "'gae', 'turn_leave_one_out' or 'turn_index_normalised'"),
    ({"learner": {"sft": {"stages": [{"family": "arith", "step": 3}]}}},
     "learner.sft.stages[0].step: unknown field; did you mean 'steps'? allowed fields: "),
    ({"pipeline": {"steps": 0}},
     "pipeline.steps: Input should be greater than or equal to 1 (got 0)"),
    ({"pipeline": {"reserve": 1.5}},
     "pipeline.reserve: use \"every\", \"expected\" or a number from 0 to 1 (the least share "
     "of a stream position that each trajectory in flight reserves) (got 1.5)"),
    ({"cluster": {"engine": {"resources": {"engine_node": 0}}}},
     "cluster.engine.resources: custom resource amounts must be > 0, got {'engine_node': "
     "0.0}; drop the key instead of asking for 0"),
    ({"cluster": {"backend": "ray"}},
     "cluster.backend = 'ray' needs one store every node reaches, but run.db_url = "
     "'sqlite:///var/stalewise.db' is SQLite (a file on this machine); set run.db_url to a "
     "PostgreSQL URL, e.g. 'postgresql+psycopg://USER@HOST:5432/DB'"),
    ({"runs": {}}, "runs: unknown field; did you mean 'run'? allowed fields: admission, "
                   "cluster, engine, learner, model, pipeline, rollout, run, sandbox, tasks, "
                   "tools"),
]


@pytest.mark.parametrize("data, expected", CONFIG_CASES,
                         ids=[next(iter(data)) + "." + str(i) for i, (data, _) in
                              enumerate(CONFIG_CASES)])
def test_every_config_section_says_what_is_wrong_where_and_how_to_fix_it(data, expected):
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "job.toml")
    problems = caught.value.problems
    sft_stage = [p for p in problems if "stages[0].steps: required" not in p]
    (problem,) = sft_stage
    assert one_line(problem).startswith(expected), problem
    assert str(caught.value).startswith("job.toml: ")


@pytest.mark.parametrize("make, said", [
    (lambda path: path.mkdir(), "is a folder, not a file; pass the path of a TOML job config"),
    (lambda path: path.write_bytes(b"\x8a\x01 binary"),
     "not valid TOML: not UTF-8 text (byte 0); pass the path of a TOML job config"),
], ids=["a folder", "not text"])
@pytest.mark.parametrize("command", [["run"], ["run", "--dry-run"], ["compare", "--budget", "5"]],
                         ids=" ".join)
def test_a_job_config_that_is_not_a_toml_file_is_one_line(tmp_path, make, said, command):
    """A folder given as the config used to end in IsADirectoryError's traceback, and a binary
    file in UnicodeDecodeError's."""
    from stalewise.cli import app

    config = tmp_path / "job"
    make(config)
    result = runner.invoke(app, [command[0], str(config), *command[1:]])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {config}: {said}"
    assert sorted(tmp_path.iterdir()) == [config]


def test_a_job_file_with_bad_sections_gets_one_line_each_with_the_file(tmp_path):
    from stalewise.cli import app

    config = tmp_path / "job.toml"
    config.write_text('[pipeline]\nmode = "fast"\n[learner.optimizer]\nlr = "high"\n')
    result = runner.invoke(app, ["run", str(config), "--dry-run"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert sorted(lines) == sorted([
        f"error: {config}: pipeline.mode: got 'fast'; allowed values: 'sync', 'async' or "
        f"'inflight'",
        f"error: {config}: learner.optimizer.lr: Input should be a valid number, unable to "
        f"parse string as a number (got 'high')"]), result.output
    with pytest.raises(ConfigError, match=r"not valid TOML"):
        config.write_text("[pipeline\n")
        load_config(config)


@pytest.mark.parametrize("text, expected", [
    ("{not json", "not valid JSON: Expecting property name enclosed in double quotes: line 1 "
                  "column 2 (char 1); the job writes this file, so start the job again or fix "
                  "it by hand"),
    ('{"max_batch": "many"}', "max_batch: Input should be a valid integer, unable to parse "
                              "string as an integer (got 'many')"),
    ("[1, 2]", "expected a JSON object of settings, got list"),
], ids=["not JSON", "bad field", "not an object"])
def test_the_engine_childs_config_file_gets_one_line(tmp_path, text, expected):
    from stalewise.cli import app

    config = tmp_path / "engine.json"
    config.write_text(text)
    result = runner.invoke(app, ["engine", "serve", "--model", str(tmp_path), "--config",
                                 str(config)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {config}: {expected}"


def test_an_engine_port_in_use_is_one_line_before_the_model_loads(tmp_path, monkeypatch,
                                                                   port_in_use):
    """A port in use used to be reported only after the model had loaded (minutes for a real
    one): the socket is now bound first."""
    import uvicorn

    import engine.server
    from engine.tiny import init_tiny
    from stalewise.cli import app

    def served(*args, **kwargs):
        raise AssertionError("the engine served although its socket could not be bound")

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was bound")

    monkeypatch.setattr(uvicorn.Server, "run", served)
    monkeypatch.setattr(engine.server, "Engine", loaded)
    model = init_tiny(tmp_path / "tiny", hidden=32, layers=1)
    result = runner.invoke(app, ["engine", "serve", "--model", str(model), "--port", port_in_use])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (f"error: 127.0.0.1:{port_in_use} is already in use "
                                     "(another server, or an earlier one still running); pass "
                                     "another --port, or --port 0 for a free one")


def test_the_learner_childs_config_file_gets_one_line(tmp_path):
    from stalewise.cli import app

    config = tmp_path / "learner.json"
    config.write_text('{"batch_size": 0, "optimizer": {"lr": -1}}')
    result = runner.invoke(app, ["learner", "serve", "--db", "sqlite:///nowhere.db", "--run",
                                 "r", "--config", str(config), "--model", str(tmp_path),
                                 "--publish-root", str(tmp_path), "--steps", "1"])
    assert result.exit_code == 2, result.output
    assert sorted(result.output.strip().splitlines()) == [
        f"error: {config}: batch_size: Input should be greater than or equal to 1 (got 0)",
        f"error: {config}: optimizer.lr: Input should be greater than 0 (got -1)"]


# == the store ================================================================================

@pytest.fixture
def refused_pg_url():
    """A PostgreSQL URL (with a password) whose port refuses connections: bound, never
    listening."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    yield f"postgresql+psycopg://stalewise:s3cret@127.0.0.1:{port}/runs"
    holder.close()


def test_a_job_whose_store_is_unreachable_stops_at_once_with_one_line(tmp_path, refused_pg_url):
    """Before any image is built or warm start trained: the field, the store (password hidden),
    the driver's reason and what to check."""
    from stalewise.cli import app

    config = tmp_path / "job.toml"
    config.write_text(f'[run]\ndb_url = "{refused_pg_url}"\n\n[tasks]\nfamily = "arith"\n')
    result = runner.invoke(app, ["run", str(config)])
    assert result.exit_code == 2, result.output
    line = one_line(result.output.strip())
    shown = refused_pg_url.replace("s3cret", "***")
    assert line.startswith(f"error: {config}: run.db_url: cannot open the store at {shown}: "
                           "connection failed: "), line
    assert "Connection refused" in line and "s3cret" not in line
    assert line.endswith("check that the PostgreSQL server is running there and that the host, "
                         "port, user, password and database name are right"), line


@pytest.mark.parametrize("command", [["run"], ["run", "--dry-run"], ["compare", "--budget", "5"]],
                         ids=" ".join)
def test_a_missing_checkpoint_and_an_output_folder_that_cannot_be_made_fail_before_any_run(
        tmp_path, command):
    """Both used to pass the checks: the job then created its run in the store and failed
    (the output folder in a traceback); `--dry-run` said the config was valid."""
    from stalewise.cli import app

    (tmp_path / "a-file").write_text("")
    config = tmp_path / "job.toml"
    config.write_text(f'[run]\ndb_url = "sqlite:///{tmp_path}/store.db"\n'
                      f'output_dir = "{tmp_path}/a-file/runs"\n\n'
                      f'[model]\npath = "{tmp_path}/no-model"\ncreate_tiny = false\n\n'
                      '[tasks]\nfamily = "arith"\n')
    result = runner.invoke(app, [command[0], str(config), *command[1:]])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[0] == (f"error: {config}: model.path: {tmp_path}/no-model holds no checkpoint "
                        "(config.json missing); point it at a Hugging Face model directory or "
                        "set model.create_tiny = true")
    assert lines[1].startswith(f"error: {config}: run.output_dir: cannot make "
                               f"{tmp_path}/a-file/runs ("), lines[1]
    assert lines[1].endswith("); pass a folder you can write to") and len(lines) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "job.toml"]


def test_a_comparison_folder_that_cannot_be_made_is_one_line(tmp_path):
    from stalewise.cli import app

    (tmp_path / "a-file").write_text("")
    config = tmp_path / "job.toml"
    config.write_text(f'[run]\ndb_url = "sqlite:///{tmp_path}/store.db"\n'
                      f'output_dir = "{tmp_path}/runs"\n\n[tasks]\nfamily = "arith"\n')
    result = runner.invoke(app, ["compare", str(config), "--budget", "5", "--out",
                                 str(tmp_path / "a-file" / "cmp")])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (f"error: --out {tmp_path}/a-file/cmp: cannot make it (Not "
                                     "a directory); pass a folder you can write to")
    assert not (tmp_path / "store.db").exists()


def test_a_sqlite_store_whose_folder_cannot_be_made_is_one_line(tmp_path):
    from stalewise.cli import app

    (tmp_path / "a-file").write_text("")
    url = f"sqlite:///{tmp_path}/a-file/store.db"
    config = tmp_path / "job.toml"
    config.write_text(f'[run]\ndb_url = "{url}"\n\n[tasks]\nfamily = "arith"\n')
    result = runner.invoke(app, ["run", str(config)])
    assert result.exit_code == 2, result.output
    line = one_line(result.output.strip())
    assert line.startswith(f"error: {config}: run.db_url: cannot open the store at {url}: "), line
    assert line.endswith("; check that its folder exists and is writable, or pass another "
                         "path"), line


@pytest.mark.parametrize("command", [["audit", "runs"], ["db", "check"], ["db", "upgrade"],
                                     ["audit", "export", "OUT", "--run", "r", "--format", "jsonl"],
                                     ["view"]],
                         ids=" ".join)
def test_the_commands_that_read_a_store_say_it_is_unreachable_in_one_line(
        tmp_path, refused_pg_url, command):
    from stalewise.cli import app

    command = [str(tmp_path / "out.jsonl") if word == "OUT" else word for word in command]
    result = runner.invoke(app, [*command, "--url", refused_pg_url])
    assert result.exit_code == 1, result.output
    line = one_line(result.output.strip())
    assert line.startswith("error: cannot open the store at "
                           f"{refused_pg_url.replace('s3cret', '***')}: "), line
    assert "Connection refused" in line and "s3cret" not in line


@pytest.mark.parametrize("command", [["audit", "runs"], ["audit", "show", "1"],
                                     ["audit", "steps", "--run", "r"], ["db", "check"],
                                     ["db", "downgrade", "base"],
                                     ["audit", "export", "OUT", "--run", "r", "--format", "jsonl"],
                                     ["view"]],
                         ids=" ".join)
@pytest.mark.parametrize("form", ["path", "url"])
def test_a_sqlite_store_that_is_not_there_is_named_and_not_created(tmp_path, monkeypatch,
                                                                   command, form):
    """A typo, or a relative path given from another folder, used to create an empty database
    there and then say it needed `db upgrade`: the message names the absolute path looked at."""
    from stalewise.cli import app

    monkeypatch.chdir(tmp_path)
    command = [str(tmp_path / "out.jsonl") if word == "OUT" else word for word in command]
    url = "var/typo/stalewise.db" if form == "path" else "sqlite:///var/typo/stalewise.db"
    result = runner.invoke(app, [*command, "--url", url])
    assert result.exit_code == 1, result.output
    line = one_line(result.output.strip())
    assert line.startswith(f"error: no store at {tmp_path}/var/typo/stalewise.db: no such "
                           "file; pass --url with the store a job wrote"), line
    assert not (tmp_path / "var").exists()


def test_db_upgrade_still_creates_a_new_sqlite_store(tmp_path):
    from stalewise.cli import app

    url = f"sqlite:///{tmp_path}/new/stalewise.db"
    assert runner.invoke(app, ["db", "upgrade", "--url", url]).exit_code == 0
    result = runner.invoke(app, ["db", "check", "--url", url])
    assert result.exit_code == 0 and "schema at head" in result.output, result.output


def _new_store(tmp_path: Path) -> str:
    from stalewise.cli import app

    url = f"sqlite:///{tmp_path}/stalewise.db"
    assert runner.invoke(app, ["db", "upgrade", "--url", url]).exit_code == 0
    return url


@pytest.mark.parametrize("command", [["audit", "trajectories"], ["audit", "steps"],
                                     ["audit", "steps", "--json"],
                                     ["audit", "export", "OUT", "--format", "jsonl"]],
                         ids=" ".join)
def test_a_run_the_store_does_not_hold_is_named_not_shown_empty(tmp_path, command):
    """A mistyped run id used to print an empty table (or `[]`) as if the run had nothing in it,
    and the export added a second line, `error: 1`."""
    from stalewise.cli import app

    url = _new_store(tmp_path)
    command = [str(tmp_path / "out.jsonl") if word == "OUT" else word for word in command]
    result = runner.invoke(app, [*command, "--run", "typo-run", "--url", url])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (f"error: no run 'typo-run' in {url}; list runs with: "
                                     f"stalewise audit runs --url {url}"), result.output
    assert not (tmp_path / "out.jsonl").exists()


def test_a_migration_target_the_store_cannot_reach_is_one_line_and_changes_nothing(tmp_path):
    """`db upgrade 0002` on a store at 0003 used to print "at revision 0002" and leave it at
    0003; an unknown revision was Alembic's traceback."""
    from stalewise.cli import app

    url = _new_store(tmp_path)
    assert runner.invoke(app, ["db", "downgrade", "0003", "--url", url]).output.strip() == \
        f"{url}: at revision 0003"
    result = runner.invoke(app, ["db", "upgrade", "0002", "--url", url])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (f"error: {url} is at revision 0003, not 0002: `db upgrade` "
                                     f"only moves up; run: stalewise db downgrade 0002 --url "
                                     f"{url}"), result.output
    for command in (["downgrade", "nonsense"], ["upgrade", "nonsense"], ["downgrade", "0005"]):
        result = runner.invoke(app, ["db", *command, "--url", url])
        assert result.exit_code == 1, result.output
        line = one_line(result.output.strip())
        assert line.startswith(f"error: cannot migrate {url} to '{command[1]}': "), line
        assert line.endswith("the revisions are base, 0001, 0002, 0003, 0004, 0005, 0006 "
                             "(head); `stalewise db check` says where the store is"), line
    result = runner.invoke(app, ["db", "check", "--url", url])
    assert "is at revision 0003" in result.output, result.output
    assert runner.invoke(app, ["db", "upgrade", "--url", url]).output.strip() == \
        f"{url}: at revision 0006"


def test_resuming_from_a_folder_without_the_store_names_the_configs_url(tmp_path, monkeypatch):
    """`run` has no --url: the hint names the config's run.db_url and --set."""
    from stalewise.cli import app

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "job.toml"
    config.write_text('[run]\ndb_url = "sqlite:///var/job.db"\n\n[tasks]\nfamily = "arith"\n')
    result = runner.invoke(app, ["run", str(config), "--resume", "job-1"])
    assert result.exit_code == 2, result.output
    assert one_line(result.output.strip()) == (
        f"error: --resume job-1: no store at {tmp_path}/var/job.db: no such file; the config's "
        "run.db_url (sqlite:///var/job.db) names it: run from the folder the job ran in, or "
        "pass --set run.db_url=URL")
    assert not (tmp_path / "var").exists()


def test_a_split_the_family_lacks_is_named_with_the_ones_it_has():
    from stalewise.cli import app

    result = runner.invoke(app, ["tasks", "show", "arith", "--split", "tset"])
    assert result.exit_code == 2, result.output
    assert "arith has the splits train, validation, test, not 'tset'" in \
        " ".join(result.output.replace("│", " ").split()), result.output


def test_sandbox_limits_out_of_range_are_one_line_in_the_flags_names():
    """Used to be pydantic's five-line dump, in the field names (`exec_timeout_s`)."""
    from stalewise.cli import app

    result = runner.invoke(app, ["sandbox", "run", "--timeout", "-3", "--cpus", "0", "--",
                                 "true"])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == ("error: --cpus 0.0: input should be greater than 0; "
                                     "--timeout -3.0: input should be greater than 0")


def test_a_tiny_model_folder_that_cannot_be_made_is_one_line(tmp_path):
    from stalewise.cli import app

    (tmp_path / "a-file").write_text("")
    result = runner.invoke(app, ["model", "init-tiny", str(tmp_path / "a-file" / "tiny")])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (f"error: cannot write the tiny model to "
                                     f"{tmp_path}/a-file/tiny: Not a directory; pass a folder "
                                     "you can write to")


@pytest.fixture
def port_in_use():
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    yield str(taken.getsockname()[1])
    taken.close()


@pytest.mark.parametrize("where, said", [
    (["--port", "99999"], "port 99999 is not a TCP port (0-65535); pass --port with one, or "
                          "--port 0 for a free one"),
    (["--port", "-1"], "port -1 is not a TCP port (0-65535)"),
    (["--port", "IN_USE"], "127.0.0.1:IN_USE is already in use (another server, or an earlier "
                           "one still running); pass another --port, or --port 0 for a free one"),
    (["--host", "192.0.2.1"], "cannot listen on 192.0.2.1:8321: this machine has no address "
                              "192.0.2.1; pass --host with one of its addresses (127.0.0.1 "
                              "keeps it local)"),
    (["--host", "no-such-host.invalid"], "cannot listen on 'no-such-host.invalid': "),
], ids=["out-of-range", "negative", "in-use", "not-this-machine", "unknown-name"])
def test_a_viewer_address_that_cannot_be_bound_is_one_line_before_any_url(
        tmp_path, monkeypatch, port_in_use, where, said):
    """Port 99999 used to print its URL and then hang, listening nowhere; a port in use printed
    the URL and then uvicorn's errno. Now nothing is served and no URL is printed."""
    import uvicorn

    from stalewise.cli import app

    def served(*args, **kwargs):
        raise AssertionError("the viewer served although its socket could not be bound")

    monkeypatch.setattr(uvicorn.Server, "run", served)
    url = _new_store(tmp_path)
    where = [port_in_use if word == "IN_USE" else word for word in where]
    result = runner.invoke(app, ["view", "--url", url, *where])
    assert result.exit_code == 1, result.output
    line = one_line(result.output.strip())
    assert line.startswith("error: " + said.replace("IN_USE", port_in_use)), line


@pytest.mark.postgres
def test_a_database_that_does_not_exist_is_named(pg_url):
    from core.store.db import StoreUnreachableError
    from core.store.store import Store

    missing = pg_url + "_missing"
    with pytest.raises(StoreUnreachableError) as caught:
        Store.open(missing, create=True)
    line = one_line(str(caught.value))
    assert f'database "{missing.rsplit("/", 1)[1]}" does not exist' in line, line
