"""Regression lock for the agent loop (`orchestrator.rollout.run_trajectory`).

Contract, one test (or more) per point, run with the scripted engine and a real sandbox (the
local process backend and, marked `docker`, the Docker backend):

 1. A turn without tool calls is the answer: status completed, stop `answered`, the verifier's
    reward and breakdown are recorded.
 2. Exact prefixes: every model call's prompt is the previous prompt + its sampled ids + the
    format's continuation; records carry only the new prompt tokens (`context_len` before them)
    and reconstruct each training segment exactly; the loss mask is 1 exactly on sampled ids.
 3. Limits truncate with a precise stop reason and reward None: `max_turns` (the last turn's
    tool calls are not run), `max_tokens` (trajectory budget, cut mid-turn), `turn_tokens` (one
    call's max_tokens), `context_length` (no sample ever exceeds it), `wall_time`,
    `working_time` (engine + tool time only: waiting at the gate does not count).
 4. Malformed tool calls (bad JSON, unknown tool, schema-invalid arguments, too many calls in a
    turn) go back to the model as `Error: ...` observations and are counted; one more than
    allowed fails the trajectory (`malformed_tool_calls`, reward 0). Well-formed calls are
    validated once and reach the tool as checked (enum arguments as enum members).
 5. `ToolError` and a tool's own timeout are observations; the trajectory goes on.
 6. Any other exception in a tool fails the trajectory (`tool_exception`) with its traceback.
 7. Sandbox failures are infrastructure errors (`sandbox_error`): on acquisition, on a tool
    call, or a container that died; idempotent tools are retried first.
 8. Engine failures are infrastructure errors: `engine_error` (EngineError, invalid reply),
    `engine_abort`.
 9. Hidden files are absent during the turns and present for the verifier; a verifier that
    raises fails the trajectory (`verifier_exception`) with reward None, one that cannot score
    (`VerifierError`) is an infrastructure error (`verifier_error`); `verify_truncated`
    verifies truncated trajectories too.
10. A template that cannot extend exactly starts a new segment (context_len 0), never a fake
    prefix; the segment's first call records why (`segment_break`).
11. Versions: per-token weights/KV versions are kept; the outcome has min/max weights version.
12. Read-only calls of one turn run concurrently; observations keep call order; long output is
    capped (head and tail) with the original size recorded.
13. Cancellation by the caller propagates; engine sessions are released and the sandbox closed.
"""

from __future__ import annotations

import enum
import time
from contextlib import asynccontextmanager
from functools import partial

import anyio
import numpy as np
import pytest
from trio.testing import MockClock

from core.engine_api import EngineError, SamplingParams
from core.sandbox import SandboxError
from core.tiny_tokenizer import build_tiny_tokenizer
from orchestrator.engines.scripted import ScriptedEngine, ScriptedTurn
from orchestrator.rollout import RolloutOptions, run_trajectory, start_sandbox, use_sandbox
from orchestrator.rollout_types import MemoryRecorder, StopReason, TrajectoryStatus
from sandboxes.docker_backend import DockerSandbox
from sandboxes.local_backend import LocalSandbox
from tasks import Component, Rubric, TaskInstance, TaskLimits, ToolContext, ToolError, tool
from tasks.chat import HermesChatFormat, TemplateChatFormat
from tasks.suites.common import call_text
from tasks.testing import FakeSandbox
from tasks.tools import ToolResult, exec_observation
from tasks.verify import VerifierError

pytestmark = pytest.mark.anyio

TOKENIZER = build_tiny_tokenizer()
FMT = HermesChatFormat(TOKENIZER, tool_listing="none")
ANSWER = "<answer>ok</answer>"


@tool
async def echo(ctx: ToolContext, text: str) -> str:
    """Print text in the sandbox.

    Args:
        text: what to print.
    """
    return exec_observation(await ctx.sandbox.exec(["printf", "%s", text])).text


@tool(read_only=True, timeout_s=0.5)
async def nap(ctx: ToolContext, seconds: float) -> ToolResult:
    """Sleep in the sandbox.

    Args:
        seconds: how long.
    """
    return exec_observation(await ctx.sandbox.exec(["sleep", str(seconds)],
                                                   timeout=ctx.timeout_s))


@tool(read_only=True)
async def slow_nap(ctx: ToolContext, seconds: float) -> str:
    """Sleep in the sandbox, read-only.

    Args:
        seconds: how long.
    """
    await ctx.sandbox.exec(["sleep", str(seconds)])
    return "slept"


@tool
async def refuse(ctx: ToolContext, why: str) -> str:
    """Always refuse.

    Args:
        why: the reason given back.
    """
    raise ToolError(why)


@tool
async def buggy(ctx: ToolContext, n: int) -> str:
    """Divide by n.

    Args:
        n: the divisor.
    """
    return str(1 // n)


@tool
async def peek(ctx: ToolContext) -> str:
    """List the hidden directory."""
    return exec_observation(await ctx.sandbox.exec(["ls", "_hidden"])).text


@tool
async def spew(ctx: ToolContext, n: int) -> str:
    """Print n characters.

    Args:
        n: how many.
    """
    return exec_observation(await ctx.sandbox.exec(
        ["python3", "-c", f"print('a' * {n // 2} + 'b' * {n - n // 2})"])).text


@tool
async def die(ctx: ToolContext) -> str:
    """Close the sandbox under the agent's feet."""
    await ctx.sandbox.close()
    return "closed"


def answered_ok(ctx) -> float:
    return 1.0 if ctx.answer == "ok" else 0.0


def make_task(*tools, verifier=None, hidden=None, **limits) -> TaskInstance:
    return TaskInstance(prompt="Do it.", tools=tools or (echo,),
                        verifier=verifier or Rubric(Component("ok", answered_ok),
                                                    Component("calls", lambda c: c.tool_calls,
                                                              0.0)),
                        limits=TaskLimits(**{"wall_time_s": 60.0, **limits}),
                        hidden_files=hidden or {}, key="test/train/0")


def engine_for(*texts: str, **kwargs) -> ScriptedEngine:
    return ScriptedEngine([ScriptedTurn(tuple(FMT.encode_assistant(t))) for t in texts], **kwargs)


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker)])
def acquire(request):
    if request.param == "local":
        return start_sandbox(LocalSandbox)
    return start_sandbox(partial(DockerSandbox, run_id="pytest-rollout"))


async def run(task, engine, acquire, *, fmt=FMT, params=None, **kwargs):
    recorder = MemoryRecorder()
    outcome = await run_trajectory(task=task, engine=engine, acquire_sandbox=acquire,
                                   chat_format=fmt, recorder=recorder,
                                   params=params or SamplingParams(max_tokens=400), **kwargs)
    return outcome, recorder


def prompt_text(recorder, call: int) -> str:
    return FMT.decode(recorder.model_calls[call].prompt_token_ids)


# 1 -------------------------------------------------------------------------------------------

async def test_answer_completes_and_is_verified(acquire):
    engine = engine_for(call_text("echo", {"text": "hi"}), ANSWER)
    outcome, recorder = await run(make_task(), engine, acquire)
    assert (outcome.status, outcome.stop_reason) == (TrajectoryStatus.COMPLETED,
                                                     StopReason.ANSWERED)
    assert outcome.reward == 1.0 and outcome.reward_breakdown == {"ok": 1.0, "calls": 1.0}
    assert (outcome.turns, outcome.tool_calls, outcome.malformed_calls) == (2, 1, 0)
    assert [r.observation for r in recorder.tool_calls] == ["hi"]
    assert "<tool_response>hi</tool_response>" in prompt_text(recorder, 1)
    assert outcome.error is None and outcome.final_text == ANSWER
    assert outcome.engine_s >= 0 and outcome.tools_s > 0 and outcome.waiting_s > 0


# 2 -------------------------------------------------------------------------------------------

async def test_prompts_extend_exactly_and_records_rebuild_the_segment(acquire):
    engine = engine_for(call_text("echo", {"text": "a"}), call_text("echo", {"text": "bb"}),
                        ANSWER)
    outcome, recorder = await run(make_task(), engine, acquire)
    (segment,) = outcome.segments
    rebuilt: list[int] = []
    for record, request in zip(recorder.model_calls, engine.requests):
        assert record.context_len == len(rebuilt)
        assert list(request.prompt_token_ids) == rebuilt + record.prompt_token_ids.tolist()
        assert record.cached_prompt_tokens == record.context_len
        rebuilt += record.prompt_token_ids.tolist() + record.tokens.token_ids.tolist()
    assert segment.token_ids.tolist() == rebuilt
    sampled = np.concatenate([r.tokens.token_ids for r in recorder.model_calls])
    assert segment.token_ids[segment.loss_mask == 1].tolist() == sampled.tolist()
    logprobs = np.concatenate([r.tokens.sampler_logprobs for r in recorder.model_calls])
    assert np.array_equal(segment.sampler_logprobs[segment.loss_mask == 1], logprobs)
    assert np.all(segment.sampler_logprobs[segment.loss_mask == 0] == 0)
    assert np.all(segment.weights_versions[segment.loss_mask == 0] == -1)
    assert outcome.sampled_tokens == len(sampled) == segment.num_sampled


# 3 -------------------------------------------------------------------------------------------

async def test_max_turns_stops_without_running_the_last_calls(acquire):
    engine = engine_for(*[call_text("echo", {"text": str(i)}) for i in range(5)])
    outcome, recorder = await run(make_task(max_turns=3), engine, acquire)
    assert (outcome.status, outcome.stop_reason) == (TrajectoryStatus.TRUNCATED,
                                                     StopReason.MAX_TURNS)
    assert outcome.turns == 3 and [r.observation for r in recorder.tool_calls] == ["0", "1"]
    assert outcome.reward is None and outcome.reward_breakdown == {}


async def test_max_tokens_is_the_trajectory_budget(acquire):
    first = call_text("echo", {"text": "x"})
    budget = len(FMT.encode_assistant(first)) + 10
    engine = engine_for(first, "<answer>" + "o" * 50 + "</answer>")
    outcome, recorder = await run(make_task(max_generated_tokens=budget), engine, acquire)
    assert outcome.stop_reason is StopReason.MAX_TOKENS
    assert outcome.sampled_tokens == budget
    assert recorder.model_calls[1].params.max_tokens == 10
    assert recorder.model_calls[1].finish_reason == "length"


async def test_turn_tokens_is_one_calls_limit(acquire):
    outcome, _ = await run(make_task(), engine_for("<answer>" + "o" * 50 + "</answer>"), acquire,
                           params=SamplingParams(max_tokens=20))
    assert outcome.stop_reason is StopReason.TURN_TOKENS and outcome.sampled_tokens == 20


async def test_context_length_is_never_exceeded(acquire):
    limit = 180
    engine = engine_for(call_text("echo", {"text": "y" * 30}), "<answer>" + "o" * 60 + "</answer>")
    outcome, recorder = await run(make_task(context_length=limit), engine, acquire)
    assert outcome.stop_reason is StopReason.CONTEXT_LENGTH
    assert all(len(s.token_ids) <= limit for s in outcome.segments)
    _, last = recorder.model_calls
    assert last.context_len + len(last.prompt_token_ids) + len(last.tokens) == limit
    assert last.finish_reason == "length" and 0 < len(last.tokens) < 60



async def test_the_engines_context_window_caps_the_tasks_context_length(acquire):
    # a task written for a long-context model, served by a short one: the loop stops at the
    # window with `context_length` instead of sending a prompt the engine must refuse
    window = 180
    engine = engine_for(call_text("echo", {"text": "y" * 30}), "<answer>" + "o" * 60 + "</answer>")
    outcome, recorder = await run(make_task(context_length=4096), engine, acquire,
                                  options=RolloutOptions(model_context=window))
    assert outcome.stop_reason is StopReason.CONTEXT_LENGTH
    assert all(len(s.token_ids) <= window for s in outcome.segments)
    _, last = recorder.model_calls
    assert last.context_len + len(last.prompt_token_ids) + len(last.tokens) == window


async def test_context_full_before_a_call_stops_without_calling(acquire):
    engine = engine_for(call_text("echo", {"text": "z" * 200}), ANSWER)
    outcome, recorder = await run(make_task(context_length=150), engine, acquire)
    assert outcome.stop_reason is StopReason.CONTEXT_LENGTH
    assert len(recorder.model_calls) == 1 and len(engine.requests) == 1


async def test_wall_time(acquire):
    slow = ScriptedEngine([ScriptedTurn(tuple(FMT.encode_assistant(ANSWER)), delay_s=30)])
    started = time.monotonic()
    outcome, _ = await run(make_task(wall_time_s=0.5), slow, acquire)
    assert outcome.stop_reason is StopReason.WALL_TIME and outcome.reward is None
    assert time.monotonic() - started < 10


def test_waiting_at_the_gate_is_not_working_time():
    """Two gate waits of 100 s each against a 1 s working-time limit, on trio's mock clock:
    the trajectory completes only if waiting is not counted. Virtual time moves only while
    every task waits, so the engine and the in-process tool take exactly no time."""
    @asynccontextmanager
    async def slow_gate():
        await anyio.sleep(100)
        yield

    async def main():
        fake = FakeSandbox()
        fake.handler = lambda argv, stdin: argv[-1]
        engine = engine_for(call_text("echo", {"text": "a"}), ANSWER)
        return await run(make_task(working_time_s=1, wall_time_s=1000), engine, use_sandbox(fake),
                         gate=slow_gate)

    outcome, _ = anyio.run(main, backend="trio",
                           backend_options={"clock": MockClock(autojump_threshold=0)})
    assert outcome.status is TrajectoryStatus.COMPLETED, (outcome.stop_reason, outcome.error)
    assert outcome.waiting_s >= 200 and outcome.engine_s + outcome.tools_s == 0


async def test_working_time_counts_tool_time(acquire):
    engine = engine_for(call_text("slow_nap", {"seconds": 60}), ANSWER)
    outcome, _ = await run(make_task(slow_nap, working_time_s=0.5), engine, acquire)
    assert outcome.stop_reason is StopReason.WORKING_TIME, outcome.error
    assert outcome.tools_s < 30, "the tool was stopped at the limit, not after its 60 s"


# 4 -------------------------------------------------------------------------------------------

async def test_malformed_calls_are_shown_to_the_model_and_counted(acquire):
    engine = engine_for('<tool_call>{"name":"echo","arguments":{"text":"a"}</tool_call>',
                        call_text("nope", {}),
                        call_text("echo", {"text": 3}),
                        call_text("echo", {"text": "a"}) * 3,
                        ANSWER)
    outcome, recorder = await run(make_task(max_malformed_calls=5, max_tool_calls_per_turn=2),
                                  engine, acquire)
    assert outcome.status is TrajectoryStatus.COMPLETED and outcome.reward == 1.0
    assert "Error: tool call is not valid JSON" in prompt_text(recorder, 1)
    assert "Error: unknown tool 'nope'; tools: echo" in prompt_text(recorder, 2)
    assert "Error: bad arguments for echo: text: 3 is not of type 'string'" in prompt_text(
        recorder, 3)
    assert "Error: too many tool calls in one turn (at most 2)" in prompt_text(recorder, 4)
    assert [r.malformed_calls for r in recorder.model_calls] == [1, 1, 1, 1, 0]
    assert outcome.malformed_calls == 4 and outcome.tool_calls == 6
    malformed = [r for r in recorder.tool_calls if r.error_type == "malformed"]
    assert len(malformed) == 4 and malformed[1].tool_name == "nope"


async def test_one_malformed_call_too_many_fails_with_reward_zero(acquire):
    bad = "<tool_call>not json</tool_call>"
    outcome, recorder = await run(make_task(max_malformed_calls=1), engine_for(bad, bad, ANSWER),
                                  acquire)
    assert [r.error_type for r in recorder.tool_calls] == ["malformed", "malformed"]
    assert (outcome.status, outcome.stop_reason) == (TrajectoryStatus.FAILED,
                                                     StopReason.MALFORMED_TOOL_CALLS)
    assert outcome.reward == 0.0 and outcome.turns == 2 and outcome.malformed_calls == 2
    assert "allowed 1" in outcome.error


class Shade(enum.Enum):
    LIGHT = "light"
    DARK = "dark"


@tool
async def paint(ctx: ToolContext, shade: Shade) -> str:
    """Name a shade.

    Args:
        shade: which one.
    """
    assert isinstance(shade, Shade), "the tool gets the enum member"
    return shade.value.upper()


async def test_valid_calls_reach_the_tool_once_checked_with_enum_members(acquire):
    engine = engine_for(call_text("paint", {"shade": "dark"}), ANSWER)
    outcome, recorder = await run(make_task(paint), engine, acquire)
    assert outcome.status is TrajectoryStatus.COMPLETED and outcome.reward == 1.0
    assert [(r.observation, r.arguments_json, r.error_type) for r in recorder.tool_calls] == [
        ("DARK", '{"shade":"dark"}', None)]


# 5, 6 ----------------------------------------------------------------------------------------

async def test_tool_error_and_tool_timeout_are_observations(acquire):
    engine = engine_for(call_text("refuse", {"why": "not today"}),
                        call_text("nap", {"seconds": 60}), ANSWER)
    started = time.monotonic()
    outcome, recorder = await run(make_task(refuse, nap), engine, acquire)
    assert outcome.status is TrajectoryStatus.COMPLETED
    refused, napped = recorder.tool_calls
    assert refused.observation == "Error: not today" and refused.error_type == "tool_error"
    assert napped.timed_out and napped.observation.startswith("[timed out")
    assert time.monotonic() - started < 30, "the tool's 0.5 s timeout, not its 60 s nap"


async def test_a_tool_that_ignores_its_timeout_is_stopped_by_the_loop():
    @tool(timeout_s=0.2)
    async def stubborn(ctx: ToolContext) -> str:
        """Sleep without passing the timeout on."""
        await anyio.sleep(30)
        return "never"

    engine = engine_for(call_text("stubborn", {}), ANSWER)
    started = time.monotonic()
    outcome, recorder = await run(make_task(stubborn), engine, use_sandbox(FakeSandbox()),
                                  options=RolloutOptions(tool_grace_s=0.1))
    assert outcome.status is TrajectoryStatus.COMPLETED
    assert time.monotonic() - started < 20, "the loop's own timeout, not the tool's 30 s sleep"
    assert recorder.tool_calls[0].timed_out
    assert recorder.tool_calls[0].observation == "[timed out after 0.2s]"


async def test_a_tool_bug_fails_the_trajectory_with_its_traceback(acquire):
    outcome, _ = await run(make_task(buggy), engine_for(call_text("buggy", {"n": 0}), ANSWER),
                           acquire)
    assert (outcome.status, outcome.stop_reason) == (TrajectoryStatus.FAILED,
                                                     StopReason.TOOL_EXCEPTION)
    assert "ZeroDivisionError" in outcome.error and "Traceback" in outcome.error
    assert outcome.reward is None


# 7 -------------------------------------------------------------------------------------------

async def test_sandbox_failures_are_infrastructure_errors(acquire):
    @asynccontextmanager
    async def broken(spec):
        raise SandboxError("no engine")
        yield

    outcome, _ = await run(make_task(), engine_for(ANSWER), broken)
    assert (outcome.status, outcome.stop_reason) == (TrajectoryStatus.INFRA_ERROR,
                                                     StopReason.SANDBOX_ERROR)
    assert "no engine" in outcome.error and outcome.turns == 0

    engine = engine_for(call_text("die", {}), call_text("echo", {"text": "x"}), ANSWER)
    outcome, _ = await run(make_task(die, echo), engine, acquire)
    assert outcome.stop_reason is StopReason.SANDBOX_ERROR
    assert outcome.status is TrajectoryStatus.INFRA_ERROR and outcome.turns == 2


async def test_idempotent_tools_are_retried_on_sandbox_errors():
    calls = []

    @tool(idempotent=True, retries=2)
    async def flaky(ctx: ToolContext) -> str:
        """Fail twice, then work."""
        calls.append(1)
        if len(calls) < 3:
            raise SandboxError("hiccup")
        return "fine"

    @tool
    async def fragile(ctx: ToolContext) -> str:
        """Fail once."""
        raise SandboxError("gone")

    fake = FakeSandbox()
    outcome, recorder = await run(make_task(flaky), engine_for(call_text("flaky", {}), ANSWER),
                                  use_sandbox(fake))
    assert outcome.status is TrajectoryStatus.COMPLETED and recorder.tool_calls[0].attempts == 3
    assert not fake.closed, "a lent sandbox stays open"
    outcome, _ = await run(make_task(fragile), engine_for(call_text("fragile", {}), ANSWER),
                           start_sandbox(lambda spec: FakeSandbox()))
    assert outcome.stop_reason is StopReason.SANDBOX_ERROR and "gone" in outcome.error


# 8 -------------------------------------------------------------------------------------------

async def test_engine_failures_are_infrastructure_errors(acquire):
    boom = ScriptedEngine([ScriptedTurn(error=EngineError("connection refused"))])
    outcome, _ = await run(make_task(), boom, acquire)
    assert (outcome.status, outcome.stop_reason) == (TrajectoryStatus.INFRA_ERROR,
                                                     StopReason.ENGINE_ERROR)
    assert "connection refused" in outcome.error

    aborted = ScriptedEngine([ScriptedTurn(tuple(FMT.encode_assistant("<ans")[:3]),
                                           finish_reason="abort")])
    outcome, recorder = await run(make_task(), aborted, acquire)
    assert outcome.stop_reason is StopReason.ENGINE_ABORT and len(recorder.model_calls) == 1

    outcome, _ = await run(make_task(), engine_for(call_text("echo", {"text": "x"})), acquire)
    assert outcome.stop_reason is StopReason.ENGINE_ERROR and "script has 1 turns" in outcome.error


async def test_an_engine_that_hangs_hits_the_engine_timeout():
    hung = ScriptedEngine([ScriptedTurn(tuple(FMT.encode_assistant(ANSWER)), delay_s=30)])
    outcome, _ = await run(make_task(), hung, start_sandbox(lambda spec: FakeSandbox()),
                           options=RolloutOptions(engine_timeout_s=0.2))
    assert outcome.stop_reason is StopReason.ENGINE_ERROR
    assert outcome.error_type == "engine_timeout"


# 9 -------------------------------------------------------------------------------------------

async def test_hidden_files_reach_the_sandbox_only_for_verification(acquire):
    async def sees_hidden(ctx) -> float:
        return float((await ctx.sandbox.read_file("/work/_hidden/key.txt")) == b"secret")

    task = make_task(peek, hidden={"_hidden/key.txt": "secret"},
                     verifier=Rubric(Component("hidden", sees_hidden)))
    outcome, recorder = await run(task, engine_for(call_text("peek", {}), ANSWER), acquire)
    assert recorder.tool_calls[0].exit_code is None
    assert "No such file" in recorder.tool_calls[0].observation
    assert outcome.reward == 1.0


async def test_verifier_errors_and_verify_truncated(acquire):
    def explode(ctx) -> float:
        raise KeyError("missing")

    task = make_task(verifier=Rubric(Component("x", explode)))
    outcome, _ = await run(task, engine_for(ANSWER), acquire)
    assert (outcome.status, outcome.stop_reason) == (TrajectoryStatus.FAILED,
                                                     StopReason.ANSWERED)
    assert outcome.error_type == "verifier_exception" and outcome.reward is None
    assert "KeyError" in outcome.error

    def cannot_score(ctx) -> float:
        raise VerifierError("the test script wrote no reward")

    task = make_task(verifier=Rubric(Component("x", cannot_score)))
    outcome, _ = await run(task, engine_for(ANSWER), acquire)
    assert (outcome.status, outcome.error_type) == (TrajectoryStatus.INFRA_ERROR,
                                                    "verifier_error")
    assert outcome.error == "the test script wrote no reward" and outcome.reward is None

    engine = engine_for(*[call_text("echo", {"text": "a"})] * 2)
    outcome, _ = await run(make_task(max_turns=2, verify_truncated=True), engine, acquire)
    assert outcome.stop_reason is StopReason.MAX_TURNS and outcome.reward == 0.0
    assert outcome.reward_breakdown == {"ok": 0.0, "calls": 1.0}


# 10 ------------------------------------------------------------------------------------------

async def test_a_template_that_rewrites_history_starts_a_new_segment(acquire):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{{ m.content.split('</think>')[-1] }}"
        "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fmt = TemplateChatFormat(tokenizer, tool_listing="none")
    engine = ScriptedEngine([
        ScriptedTurn(tuple(fmt.encode_assistant("<think>hm</think>" + call_text("echo", {"text": "a"})))),
        ScriptedTurn(tuple(fmt.encode_assistant(call_text("echo", {"text": "b"})))),
        ScriptedTurn(tuple(fmt.encode_assistant(ANSWER)))])
    outcome, recorder = await run(make_task(), engine, acquire, fmt=fmt)
    assert outcome.reward == 1.0
    assert [r.segment for r in recorder.model_calls] == [0, 1, 1]
    assert [r.context_len == 0 for r in recorder.model_calls] == [True, True, False]
    breaks = [r.segment_break for r in recorder.model_calls]
    assert breaks[0] is None and breaks[2] is None
    assert breaks[1].startswith("turn_rewritten: at char 2: template '<tool_call>")
    assert "tokens '<think>hm</think>" in breaks[1]
    assert len(outcome.segments) == 2
    for segment in outcome.segments:
        records = [r for r in recorder.model_calls if r.segment == segment.index]
        rebuilt = [t for r in records for t in (*r.prompt_token_ids, *r.tokens.token_ids)]
        assert segment.token_ids.tolist() == rebuilt
    assert "hm" not in fmt.decode(outcome.segments[1].token_ids)


# 11 ------------------------------------------------------------------------------------------

async def test_weights_and_kv_versions_are_kept_per_token(acquire):
    texts = [call_text("echo", {"text": "a"}), ANSWER]
    engine: ScriptedEngine

    def script(key: str, index: int) -> ScriptedTurn:
        engine.version = 3 + index  # a weight update lands between the two calls
        return ScriptedTurn(tuple(FMT.encode_assistant(texts[index])))

    engine = ScriptedEngine(script, kv_mode="retain")
    outcome, recorder = await run(make_task(), engine, acquire)
    (segment,) = outcome.segments
    assert (outcome.min_weights_version, outcome.max_weights_version) == (3, 4)
    second = recorder.model_calls[1].tokens
    assert set(second.weights_versions.tolist()) == {4} and set(second.kv_versions.tolist()) == {3}
    assert set(segment.weights_versions[segment.loss_mask == 1].tolist()) == {3, 4}


# 12 ------------------------------------------------------------------------------------------

@tool(read_only=True)
async def meet(ctx: ToolContext, name: str) -> str:
    """Wait in the sandbox (up to 60 s) until both calls `a` and `b` have started, then 1 s.

    Args:
        name: a or b.
    """
    waited = await ctx.sandbox.exec(
        f"touch {name}; i=0; while [ $i -lt 600 ]; do [ -e a ] && [ -e b ] && sleep 1 "
        f"&& echo {name} met && exit 0; sleep 0.1; i=$((i+1)); done; echo {name} alone",
        timeout=120)
    return waited.stdout.strip()


async def test_read_only_calls_run_together_and_keep_their_order(acquire):
    # each call waits for the other to start: run one after the other, both would say `alone`
    turn = call_text("meet", {"name": "a"}) + call_text("meet", {"name": "b"})
    outcome, recorder = await run(make_task(meet), engine_for(turn, ANSWER), acquire)
    assert outcome.status is TrajectoryStatus.COMPLETED
    calls = sorted(recorder.tool_calls, key=lambda r: r.index)  # recorded as they finish
    assert [(r.index, r.observation) for r in calls] == [(0, "a met"), (1, "b met")]
    shown = prompt_text(recorder, 1)
    assert shown.index("a met") < shown.index("b met"), "observations keep call order"
    assert outcome.tools_s >= 1.9  # summed over calls


async def test_long_observations_are_capped_with_the_original_size(acquire):
    engine = engine_for(call_text("spew", {"n": 5000}), ANSWER)
    outcome, recorder = await run(make_task(spew, max_observation_chars=200), engine, acquire)
    assert outcome.status is TrajectoryStatus.COMPLETED
    record = recorder.tool_calls[0]
    assert record.truncated and record.original_bytes == 5000
    assert len(record.observation) <= 200
    assert record.observation.startswith("aaaa") and record.observation.endswith("bbbb")
    assert "chars cut" in record.observation


# 13 ------------------------------------------------------------------------------------------

async def test_cancellation_propagates_and_releases_everything():
    fake = FakeSandbox()
    engine = ScriptedEngine([ScriptedTurn(tuple(FMT.encode_assistant(call_text("echo", {"text": "a"})))),
                             ScriptedTurn(tuple(FMT.encode_assistant(ANSWER)), delay_s=30)])
    fake.handler = lambda argv, stdin: argv[-1]
    finished = False

    async def trajectory() -> None:
        nonlocal finished
        await run(make_task(), engine, start_sandbox(lambda spec: fake), trajectory_id=9)
        finished = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(trajectory)
        with anyio.fail_after(30):  # cancel during the second engine call (it would take 30 s)
            while len(engine.requests) < 2:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert tg.cancel_scope.cancelled_caught and not finished
    assert engine.released == ["9/0"] and fake.closed
