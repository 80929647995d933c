"""The agent loop: one trajectory of prompt → generate → parse → tools → append, token in/out.

Contract (locked by tests/orchestrator/test_rollout_semantics.py):

- Tokens: the engine's sampled ids are appended exactly (loss mask 1) and never re-encoded; tool
  results and turn scaffolding come from the chat format (mask 0); each call's prompt extends the
  previous call's prompt + sampled ids exactly, or a new training segment starts.
- Stops: a turn without tool calls is the answer (`answered`, then verified). Limits truncate:
  `max_turns`, `max_tokens` (trajectory budget), `turn_tokens` (one call's max_tokens),
  `context_length` (the task's, capped at the engine's context window when
  `RolloutOptions.model_context` gives it), `wall_time`, `working_time`. Errors: `malformed_tool_calls` (more than
  allowed), `tool_exception` (a tool bug, traceback kept), `sandbox_error`, `engine_error`,
  `engine_abort`.
- Malformed tool calls (bad markup or JSON, unknown tool, arguments failing the schema, too many
  calls in one turn) go back to the model as an error observation and are counted; one more
  than allowed fails the trajectory with reward 0 (the policy's own failure, not verified).
- Verifier failures: `VerifierError` (the verifier could not score) and a `SandboxError` while
  verifying are infrastructure errors (`verifier_error`, `sandbox_error`); any other exception
  or the verifier's timeout fails the trajectory (`verifier_exception`, `verifier_timeout`).
- Rewards: only `answered` trajectories are verified (truncated ones too if the task sets
  `verify_truncated`); truncated, infra-failed and bug-failed trajectories have reward None, so
  admission decides how to treat them.
- `ToolError` is an observation; a tool's own timeout is an observation (`timed_out`);
  `SandboxError` (or an exec whose container died) is retried for idempotent tools, then is an
  infrastructure error.
- Observations: a tool's text is capped to `max_observation_chars` (head and tail kept), terminal
  control sequences are removed and other control characters shown as U+FFFD
  (`clean_observation`); the tool-call record holds exactly what the model saw.
- Engine replies: no tokens, more than `max_tokens`, or a NaN / +inf log-prob
  (`engine_api.bad_logprobs`) is an `engine_invalid_reply` engine error.
- Records: every finished model call and tool call is reported to the recorder when it happens;
  the outcome is returned once, with timings, counts, versions and training segments.
- Timeouts are explicit cancel scopes with `anyio.fail_after` semantics: wall time around the
  turns, working time around every engine and tool call, the tool's timeout, the engine
  timeout, the verifier's. One scope per call carries the nearer of its own timeout and the
  working-time limit, and none is made for a limit the wall-time scope would hit first.
- Cost: a turn's work is proportional to its new tokens (prompt delta, sampled ids, the
  format's continuation), not to the conversation, apart from copying the context into the
  engine request (Hermes, and templates in incremental mode; see `tasks.chat.template`).
- Segments: when the chat format cannot extend the token sequence exactly (a template that
  rewrites the sampled turn or earlier ones), a new training segment starts from the template's
  full render, and the first model call of that segment records why
  (`ModelCallRecord.segment_break`, stored as `segment_break` in the call's `sampling` JSON).
- Sandboxes: the acquirer lends a started sandbox of the task's image and limits (a pool per
  image); the loop writes the task's files into it, and the hidden files after the last turn,
  right before the verifier runs.
- Cancellation by the caller propagates; sessions and the sandbox are released under a shield,
  and so is anything in the tools' per-trajectory state that has an `aclose()` (MCP servers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import sys
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
import numpy as np

from core.engine_api import (
    EngineError,
    GenerateRequest,
    GenerateResult,
    InferenceEngine,
    SamplingParams,
    bad_logprobs,
)
from core.records import INT32, SampledTokens
from core.samples import segment_samples
from core.sandbox import Sandbox, SandboxError, SandboxSpec
from core.seeds import derived_seed
from core.text import SURROGATES
from orchestrator.rollout_types import (
    STATUS_OF,
    ModelCallRecord,
    RolloutRecorder,
    StopReason,
    ToolCallRecord,
    TrajectoryOutcome,
    TrajectoryStatus,
)
from tasks.api import TaskInstance
from tasks.chat.base import ChatFormat, ParsedCall, ParsedTurn
from tasks.chat.conversation import Conversation
from tasks.chat.parsing import extract_answer
from tasks.messages import ChatMessage
from tasks.tools import Tool, ToolArgumentError, ToolContext, ToolError, ToolResult
from tasks.verify import Reward, VerifierError, VerifyContext, as_reward

SandboxAcquirer = Callable[[SandboxSpec], AbstractAsyncContextManager[Sandbox]]
Gate = Callable[[], AbstractAsyncContextManager[Any]]
_Checked = tuple[Tool, dict[str, Any]] | str
# a verifier that could not score: infrastructure, not the policy (kept out of training)
INFRA_VERIFY_ERRORS = frozenset({"sandbox_error", "verifier_error"})


@dataclass(frozen=True)
class RolloutOptions:
    """Loop-level timeouts, configured in one place (task-level limits live in TaskLimits)."""

    engine_timeout_s: float = 600.0  # one engine call
    acquire_timeout_s: float = 600.0  # getting a sandbox
    release_timeout_s: float = 30.0  # releasing sessions / the sandbox, shielded
    tool_grace_s: float = 5.0  # backstop beyond a tool's timeout (exec enforces it first)
    model_context: int | None = None  # the engine's context window: caps a task's context_length
    # Seeds every model call: the call of turn t is sampled with derived_seed(sampling_seed, t),
    # so its tokens do not depend on the requests the engine batched it with (evaluations)
    sampling_seed: int | None = None


class _Stop(Exception):
    def __init__(self, reason: StopReason, error: str | None = None,
                 error_type: str | None = None) -> None:
        super().__init__(reason.value)
        self.reason, self.error = reason, error
        self.error_type = error_type or (reason.value if error is not None else None)


def use_sandbox(sandbox: Sandbox) -> SandboxAcquirer:
    """An acquirer that lends an already started sandbox and leaves it open."""
    @asynccontextmanager
    async def acquire(spec: SandboxSpec) -> AsyncIterator[Sandbox]:
        yield sandbox
    return acquire


def start_sandbox(factory: Callable[[SandboxSpec], Sandbox]) -> SandboxAcquirer:
    """An acquirer that builds a fresh sandbox for the task's image and limits, starts it and
    closes it after (the loop itself writes the task's files)."""
    @asynccontextmanager
    async def acquire(spec: SandboxSpec) -> AsyncIterator[Sandbox]:
        sandbox = factory(spec.model_copy(update={"files": {}}))
        try:
            await sandbox.start()
            yield sandbox
        finally:
            with anyio.CancelScope(shield=True):
                await sandbox.close()
    return acquire


async def run_trajectory(*, task: TaskInstance, engine: InferenceEngine,
                         acquire_sandbox: SandboxAcquirer, chat_format: ChatFormat,
                         params: SamplingParams, recorder: RolloutRecorder,
                         trajectory_id: int | None = None, gate: Gate | None = None,
                         options: RolloutOptions = RolloutOptions()) -> TrajectoryOutcome:
    """Run one trajectory of `task` to its end and return the outcome (see module docstring).
    `trajectory_id` is the store's; without one the records carry None."""
    rollout = _Rollout(task, engine, chat_format, params, recorder, trajectory_id, gate, options)
    return await rollout.run(acquire_sandbox)


_Timeout = tuple[float | None, Callable[[], Exception]]
_ARGUMENTS_JSON = json.JSONEncoder(  # enums as their values, anything else as str
    separators=(",", ":"), sort_keys=True,
    default=lambda value: getattr(value, "value", str(value)))


class _Limit:
    """One cancel scope at the nearest of several time limits (seconds from now; None = none).

    Its own expiry raises that limit's `on_timeout()` (the first listed wins a tie); expiries of
    outer scopes pass through untouched. It is `anyio.fail_after` with the error chosen per
    limit, so two limits on one call cost one scope and one timer. `outer_deadline` is the
    deadline of an enclosing limit: a scope that would expire strictly after it could never
    fire first, so none is made.
    """

    __slots__ = ("_on_timeout", "_scope")

    def __init__(self, now: float, *limits: _Timeout, outer_deadline: float | None = None,
                 scope_type: Callable[..., anyio.CancelScope] = anyio.CancelScope) -> None:
        nearest: _Timeout = (None, _no_timeout)
        for seconds, on_timeout in limits:
            if seconds is not None and (nearest[0] is None or seconds < nearest[0]):
                nearest = (seconds, on_timeout)
        self._on_timeout = nearest[1]
        deadline = None if nearest[0] is None else now + max(nearest[0], 0.0)
        if deadline is not None and outer_deadline is not None and deadline > outer_deadline:
            deadline = None
        self._scope = None if deadline is None else scope_type(deadline=deadline)

    def __enter__(self) -> None:
        if self._scope is not None:
            self._scope.__enter__()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if self._scope is None:
            return False
        swallowed = bool(self._scope.__exit__(exc_type, exc, tb))
        if self._scope.cancelled_caught:
            raise self._on_timeout() from None
        return swallowed


def _no_timeout() -> Exception:
    raise AssertionError("a limit without seconds cannot expire")


def _event_loop_clock() -> Callable[[], float]:
    """`anyio.current_time`, resolved once: the asyncio loop's own clock when on asyncio."""
    try:
        return asyncio.get_running_loop().time
    except RuntimeError:
        return anyio.current_time


# Terminal control sequences (CSI such as colours and cursor moves, OSC such as window titles,
# two-byte ESC sequences), then any other control character but tab, newline and carriage return,
# and lone UTF-16 surrogates (undecodable bytes as `os.fsdecode` gives them, or a JSON escape).
_TERMINAL_SEQUENCE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]|\x9b[0-?]*[ -/]*[@-~]"
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[ -/]*[0-~]?")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f" + SURROGATES + "]+")


def clean_observation(text: str) -> str:
    """`text` as the model sees it and the store keeps it: terminal control sequences removed
    (a tool's colours and cursor moves are not content), every other run of control characters
    (NUL, which PostgreSQL text refuses, included) and of lone surrogates (which no encoding
    holds: the tokenizer and both stores' drivers refuse them) shown as one U+FFFD, like
    undecodable bytes."""
    if _CONTROL.search(text) is None:
        return text
    return _CONTROL.sub("\ufffd", _TERMINAL_SEQUENCE.sub("", text))


def cap_text(text: str, max_chars: int) -> tuple[str, bool]:
    """Head and tail of `text` within `max_chars`, and whether anything was cut."""
    if len(text) <= max_chars:
        return text, False
    keep = max_chars - 40
    head, tail = text[: keep // 2], text[len(text) - (keep - keep // 2):]
    return f"{head}\n[... {len(text) - keep} chars cut ...]\n{tail}", True


class _Rollout:
    def __init__(self, task: TaskInstance, engine: InferenceEngine, chat_format: ChatFormat,
                 params: SamplingParams, recorder: RolloutRecorder, trajectory_id: int | None,
                 gate: Gate | None, options: RolloutOptions) -> None:
        self.task, self.engine, self.format = task, engine, chat_format
        self.limits = task.limits
        self.params, self.recorder, self.id = params, recorder, trajectory_id
        # engine sessions are named by the trajectory: its id, or a fresh name without one
        self.session_name = uuid.uuid4().hex if trajectory_id is None else str(trajectory_id)
        self.gate, self.options = gate, options
        self.conversation: Conversation | None = None
        self.calls: list[ModelCallRecord] = []  # as recorded, in call order
        self.sessions: set[str] = set()
        self.tool_state: dict[str, Any] = {}
        self.turns = self.sampled_tokens = self.tool_calls = self.malformed = 0
        self.engine_s = self.tools_s = self.waiting_s = self.verify_s = 0.0
        self.started_at = time.time()
        self.now = _event_loop_clock()
        self._scope_type = type(anyio.CancelScope())  # the running backend's, resolved once
        self._stops = tuple(dict.fromkeys((*chat_format.stop_token_ids, *params.stop_token_ids)))
        self._params_by_max: dict[int, SamplingParams] = {}
        self._wall_deadline: float | None = None  # of the scope around the turns, once entered

    # -- the trajectory -------------------------------------------------------------------

    async def run(self, acquire_sandbox: SandboxAcquirer) -> TrajectoryOutcome:
        reward: Reward | None = None
        error: _Stop | None = None
        stop: _Stop | None = None
        try:
            async with AsyncExitStack() as stack:
                t0 = self.now()
                with _Limit(t0, (self.options.acquire_timeout_s, lambda: _Stop(
                        StopReason.SANDBOX_ERROR, "timed out acquiring a sandbox",
                        "acquire_timeout"))):
                    sandbox = await stack.enter_async_context(acquire_sandbox(self.task.sandbox))
                    await self._put_files(sandbox, self.task.sandbox.files)
                self.waiting_s += self.now() - t0
                stop = await self._agent(sandbox)
                await self._release_sessions()
                reward, error = await self._maybe_verify(sandbox, stop)
        except _Stop as stopped:
            stop = stopped
        except SandboxError as err:
            # Releasing a sandbox after the agent finished is the acquirer's business (the pool
            # records it); only a failure before that decides the trajectory.
            if stop is None:
                stop = _Stop(StopReason.SANDBOX_ERROR, f"{type(err).__name__}: {err}",
                             "sandbox_error")
        finally:
            await self._release_sessions()
            await self._close_tool_state()
        assert stop is not None
        return self._outcome(stop, reward, error)

    async def _close_tool_state(self) -> None:
        """Close what tools kept per trajectory (an MCP server connection): anything in the
        tool state with an `aclose()`, under a shield, errors ignored."""
        closers = [v for v in self.tool_state.values() if callable(getattr(v, "aclose", None))]
        if not closers:
            return
        with self._scope_type(shield=True, deadline=self.now() + self.options.release_timeout_s):
            for value in closers:
                try:
                    await value.aclose()
                except Exception:  # noqa: BLE001 - closing is best effort; the sandbox goes too
                    pass

    async def _agent(self, sandbox: Sandbox) -> _Stop:
        """The turns, under the wall-time limit; every way out is a `_Stop`."""
        try:
            now = self.now()
            self._wall_deadline = now + max(self.limits.wall_time_s, 0.0)
            with _Limit(now, (self.limits.wall_time_s, lambda: _Stop(StopReason.WALL_TIME))):
                self.conversation = Conversation(self.format, self.task.prompt, self.task.tools)
                return _Stop(await self._turns(sandbox))
        except _Stop as stopped:
            return stopped
        except EngineError as err:
            return _Stop(StopReason.ENGINE_ERROR, f"{type(err).__name__}: {err}", "engine_error")
        except SandboxError as err:
            return _Stop(StopReason.SANDBOX_ERROR, f"{type(err).__name__}: {err}",
                         "sandbox_error")

    async def _turns(self, sandbox: Sandbox) -> StopReason:
        conversation = self.conversation
        assert conversation is not None
        context = min(self.limits.context_length, self.options.model_context or sys.maxsize)
        for turn in range(self.limits.max_turns):
            room = context - len(conversation.token_ids)
            budget = self.limits.max_generated_tokens - self.sampled_tokens
            if room <= 0:
                return StopReason.CONTEXT_LENGTH
            if budget <= 0:
                return StopReason.MAX_TOKENS
            max_tokens = min(self.params.max_tokens, budget, room)
            parsed, checked = await self._model_call(turn, max_tokens)
            if not parsed.ended:
                return self._length_reason(len(self.calls[-1].tokens), budget, room)
            if not parsed.calls:
                return StopReason.ANSWERED
            if turn == self.limits.max_turns - 1:
                return StopReason.MAX_TURNS
            observations = await self._tools(sandbox, turn, parsed, checked)
            conversation.add_messages(observations)
        return StopReason.MAX_TURNS

    def _length_reason(self, sampled: int, budget: int, room: int) -> StopReason:
        if sampled >= budget:
            return StopReason.MAX_TOKENS
        if sampled >= room:
            return StopReason.CONTEXT_LENGTH
        return StopReason.TURN_TOKENS

    # -- model calls ----------------------------------------------------------------------

    async def _model_call(self, turn: int, max_tokens: int) -> tuple[ParsedTurn, list[_Checked]]:
        conversation = self.conversation
        assert conversation is not None
        delta = conversation.take_prompt()
        params = self._params(max_tokens, turn)
        session = f"{self.session_name}/{delta.segment}"
        self.sessions.add(session)
        request = GenerateRequest(list(conversation.token_ids), params, session_id=session)
        started_at = time.time()
        result = await self._generate(request)
        finished_at = time.time()
        self._check_result(result, max_tokens)
        parsed = conversation.add_sampled(result.tokens.token_ids.tolist())
        if result.finish_reason == "stop" and not parsed.ended:
            parsed = dataclasses.replace(parsed, ended=True)  # a caller-given stop id ended it
        self.turns += 1
        self.sampled_tokens += len(result.tokens)
        limit = self.limits.max_tool_calls_per_turn
        checked = [self._check_call(call, i >= limit) for i, call in enumerate(parsed.calls)]
        record = ModelCallRecord(
            trajectory_id=self.id, turn=turn, segment=delta.segment,
            context_len=delta.context_len,
            prompt_token_ids=np.asarray(delta.token_ids, dtype=INT32), tokens=result.tokens,
            params=params, engine_id=result.engine_id, finish_reason=result.finish_reason,
            prompt_tokens=result.prompt_tokens, cached_prompt_tokens=result.cached_prompt_tokens,
            started_at=started_at, finished_at=finished_at, tool_calls=len(parsed.calls),
            malformed_calls=sum(isinstance(c, str) for c in checked),
            segment_break=self._segment_break(delta.segment, delta.context_len),
            recompute_reason=result.recompute_reason)
        self.calls.append(record)
        await self.recorder.model_call(record)
        if result.finish_reason == "abort":
            raise _Stop(StopReason.ENGINE_ABORT, "the engine aborted the request", "engine_abort")
        return parsed, checked

    def _segment_break(self, segment: int, context_len: int) -> str | None:
        """Why this segment started, on its first call (the format's `SegmentBreak`)."""
        conversation = self.conversation
        if conversation is None or segment == 0 or context_len != 0:
            return None
        return str(conversation.segment_breaks[segment])

    def _params(self, max_tokens: int, turn: int) -> SamplingParams:
        """The sampling params as sent: the caller's, with this call's max_tokens and the
        format's stop ids (one copy per distinct max_tokens), and the turn's own seed when the
        options seed the calls."""
        params = self._params_by_max.get(max_tokens)
        if params is None:
            params = self.params.model_copy(update={"max_tokens": max_tokens,
                                                    "stop_token_ids": self._stops})
            self._params_by_max[max_tokens] = params
        if self.options.sampling_seed is not None:
            params = params.model_copy(
                update={"seed": derived_seed(self.options.sampling_seed, turn)})
        return params

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        if self.gate is None:
            return await self._engine_call(request)
        t0 = self.now()
        async with self.gate():
            self.waiting_s += self.now() - t0
            return await self._engine_call(request)

    async def _engine_call(self, request: GenerateRequest) -> GenerateResult:
        """One engine call under the engine timeout and the working-time limit."""
        t0 = self.now()
        timeout = self.options.engine_timeout_s
        try:
            with _Limit(t0, (timeout, lambda: _Stop(
                    StopReason.ENGINE_ERROR, f"engine call exceeded {timeout:g}s",
                    "engine_timeout")), self._working_limit(),
                        outer_deadline=self._wall_deadline, scope_type=self._scope_type):
                return await self.engine.generate(request)
        finally:
            self.engine_s += self.now() - t0

    def _check_result(self, result: GenerateResult, max_tokens: int) -> None:
        problem = None
        if not isinstance(result.tokens, SampledTokens):
            problem = f"tokens is {type(result.tokens).__name__}, not SampledTokens"
        elif len(result.tokens) == 0 and result.finish_reason != "abort":
            problem = "no tokens sampled"
        elif len(result.tokens) > max_tokens:
            problem = f"{len(result.tokens)} tokens sampled, max_tokens was {max_tokens}"
        elif (bad := bad_logprobs(result.tokens)) is not None:
            problem = f"{bad[0]}: {bad[1]}"
        if problem:
            raise _Stop(StopReason.ENGINE_ERROR, f"invalid engine reply: {problem}",
                        "engine_invalid_reply")

    def _working_limit(self) -> _Timeout:
        if self.limits.working_time_s is None:
            return None, _no_timeout
        left = self.limits.working_time_s - self.engine_s - self.tools_s
        return left, lambda: _Stop(StopReason.WORKING_TIME)

    # -- tool calls -----------------------------------------------------------------------

    async def _tools(self, sandbox: Sandbox, turn: int, parsed: ParsedTurn,
                     checked: list[_Checked]) -> list[ChatMessage]:
        """Run the turn's calls in order; consecutive read-only calls run concurrently."""
        results: list[ChatMessage | None] = [None] * len(checked)
        batch: list[tuple[int, Tool, dict[str, Any]]] = []
        for index, (call, check) in enumerate(zip(parsed.calls, checked)):
            if isinstance(check, str):
                await self._run_batch(sandbox, turn, batch, results)
                batch = []
                results[index] = await self._malformed(turn, index, call, check)
                continue
            tool, arguments = check
            if batch and not (tool.read_only and batch[-1][1].read_only):
                await self._run_batch(sandbox, turn, batch, results)
                batch = []
            batch.append((index, tool, arguments))
        await self._run_batch(sandbox, turn, batch, results)
        return [message for message in results if message is not None]

    def _check_call(self, call: ParsedCall, over_limit: bool) -> _Checked:
        """(tool, validated arguments), or the reason the call is malformed."""
        if over_limit:
            return f"too many tool calls in one turn (at most {self.limits.max_tool_calls_per_turn})"
        if call.error is not None:
            return call.error
        tool = self.task.tool(call.name or "")
        assert tool is not None, "the parser only accepts available tools"
        try:
            return tool, tool.validate(call.arguments)
        except ToolArgumentError as err:
            return str(err)

    async def _malformed(self, turn: int, index: int, call: ParsedCall,
                         problem: str) -> ChatMessage:
        self.malformed += 1
        self.tool_calls += 1
        observation = f"Error: {problem}"
        await self.recorder.tool_call(ToolCallRecord(
            trajectory_id=self.id, turn=turn, index=index, tool_name=call.name,
            arguments_json=call.raw if call.arguments is None else call.arguments_json(),
            observation=observation, exit_code=None, error_type="malformed", timed_out=False,
            truncated=False, original_bytes=None, started_at=time.time(), duration_s=0.0))
        if self.malformed > self.limits.max_malformed_calls:
            raise _Stop(StopReason.MALFORMED_TOOL_CALLS,
                        f"{self.malformed} malformed tool calls (allowed "
                        f"{self.limits.max_malformed_calls}); last: {problem}", "malformed")
        return ChatMessage("tool", observation, name=call.name or "error")

    async def _run_batch(self, sandbox: Sandbox, turn: int,
                         batch: list[tuple[int, Tool, dict[str, Any]]],
                         results: list[ChatMessage | None]) -> None:
        if len(batch) == 1:
            index, tool, arguments = batch[0]
            results[index] = await self._tool_call(sandbox, turn, index, tool, arguments)
            return

        async def one(index: int, tool: Tool, arguments: dict[str, Any]) -> None:
            results[index] = await self._tool_call(sandbox, turn, index, tool, arguments)

        async with anyio.create_task_group() as group:
            for index, tool, arguments in batch:
                group.start_soon(one, index, tool, arguments)

    async def _tool_call(self, sandbox: Sandbox, turn: int, index: int, tool: Tool,
                         arguments: dict[str, Any]) -> ChatMessage:
        timeout = tool.timeout_s or self.limits.tool_timeout_s
        ctx = ToolContext(sandbox=sandbox, task=self.task, trajectory_id=self.id, turn=turn,
                          timeout_s=timeout, state=self.tool_state)
        started_at, t0 = time.time(), self.now()
        attempts = 0
        try:
            while True:
                attempts += 1
                try:
                    result = await self._invoke(tool, ctx, arguments, timeout)
                    break
                except SandboxError:
                    if not tool.idempotent or attempts > tool.retries:
                        raise
        finally:
            duration = self.now() - t0
            self.tools_s += duration
        self.tool_calls += 1
        text, capped = cap_text(result.text, self.limits.max_observation_chars)
        text = clean_observation(text)
        original = result.original_bytes if result.truncated else None
        if capped:
            original = max(original or 0, len(result.text.encode()))
        await self.recorder.tool_call(ToolCallRecord(
            trajectory_id=self.id, turn=turn, index=index, tool_name=tool.name,
            arguments_json=_ARGUMENTS_JSON.encode(arguments),
            observation=text, exit_code=result.exit_code, error_type=result.error_type,
            timed_out=result.timed_out, truncated=result.truncated or capped,
            original_bytes=original, started_at=started_at, duration_s=duration,
            attempts=attempts, reward=result.reward))
        return ChatMessage("tool", text, name=tool.name)

    async def _invoke(self, tool: Tool, ctx: ToolContext, arguments: dict[str, Any],
                      timeout: float) -> ToolResult:
        try:
            with _Limit(self.now(), (timeout + self.options.tool_grace_s, _ToolTimeout),
                        self._working_limit(), outer_deadline=self._wall_deadline,
                        scope_type=self._scope_type):
                result = await tool.call(ctx, arguments)
        except _ToolTimeout:
            return ToolResult(text=f"[timed out after {timeout:g}s]", error_type="timeout",
                              timed_out=True)
        except ToolError as err:
            return ToolResult(text=f"Error: {err}", error_type="tool_error")
        except (SandboxError, _Stop):
            raise
        except Exception as err:
            raise _Stop(StopReason.TOOL_EXCEPTION,
                        f"tool {tool.name} raised {type(err).__name__}: {err}\n"
                        + traceback.format_exc(), "tool_exception") from err
        if result.error_type == "container_died":
            raise SandboxError(f"the sandbox died during tool {tool.name}: {result.text}")
        return result

    # -- verification and the outcome -----------------------------------------------------

    async def _maybe_verify(self, sandbox: Sandbox,
                            stop: _Stop) -> tuple[Reward | None, _Stop | None]:
        status = STATUS_OF[stop.reason]
        wanted = status is TrajectoryStatus.COMPLETED or (
            status is TrajectoryStatus.TRUNCATED and self.limits.verify_truncated)
        if not wanted:
            return None, None
        t0 = self.now()
        try:
            with _Limit(t0, (self.limits.verify_timeout_s, _VerifyTimeout)):
                await self._put_files(sandbox, self.task.hidden_files)
                result = await self.task.verifier(self._verify_context(sandbox, stop))
                return as_reward(result), None
        except _VerifyTimeout:
            return None, _Stop(stop.reason, f"verifier exceeded {self.limits.verify_timeout_s:g}s",
                               "verifier_timeout")
        except SandboxError as err:
            return None, _Stop(stop.reason, f"{type(err).__name__}: {err}", "sandbox_error")
        except VerifierError as err:
            return None, _Stop(stop.reason, str(err), "verifier_error")
        except Exception as err:
            return None, _Stop(stop.reason, f"verifier raised {type(err).__name__}: {err}\n"
                               + traceback.format_exc(), "verifier_exception")
        finally:
            self.verify_s += self.now() - t0

    async def _put_files(self, sandbox: Sandbox, files: Mapping[str, str]) -> None:
        workdir = self.task.sandbox.workdir.rstrip("/")
        for path, text in files.items():
            await sandbox.write_file(path if path.startswith("/") else f"{workdir}/{path}", text)

    def _verify_context(self, sandbox: Sandbox, stop: _Stop) -> VerifyContext:
        final = self._final_text()
        return VerifyContext(
            sandbox=sandbox, task=self.task, messages=self._messages(), final_text=final,
            answer=extract_answer(final), stop_reason=stop.reason.value, turns=self.turns,
            tool_calls=self.tool_calls)

    def _messages(self) -> tuple[ChatMessage, ...]:
        return tuple(self.conversation.messages) if self.conversation else tuple(self.task.prompt)

    def _final_text(self) -> str:
        messages = self.conversation.messages if self.conversation else self.task.prompt
        return next((m.content for m in reversed(messages) if m.role == "assistant"), "")

    async def _release_sessions(self) -> None:
        if not self.sessions:
            return
        sessions, self.sessions = self.sessions, set()
        with self._scope_type(shield=True, deadline=self.now() + self.options.release_timeout_s):
            for session in sorted(sessions):
                try:
                    await self.engine.release_session(session)
                except EngineError:
                    pass  # the engine forgets sessions on its own; nothing to repair here

    def _outcome(self, stop: _Stop, reward: Reward | None,
                 verify_error: _Stop | None) -> TrajectoryOutcome:
        status = STATUS_OF[stop.reason]
        error_type, error = stop.error_type, stop.error
        if stop.reason is StopReason.MALFORMED_TOOL_CALLS:
            reward = Reward(0.0, {"malformed_tool_calls": 1.0})  # the policy's own failure
        if verify_error is not None:
            error_type, error = verify_error.error_type, verify_error.error
            status = (TrajectoryStatus.INFRA_ERROR if error_type in INFRA_VERIFY_ERRORS
                      else TrajectoryStatus.FAILED)
        held = None if self.conversation is None else [
            segment.token_ids for segment in self.conversation.segments]
        segments = segment_samples(self.calls, held)
        versions = np.concatenate([s.weights_versions[s.loss_mask] for s in segments]
                                  or [np.zeros(0, INT32)])
        return TrajectoryOutcome(
            trajectory_id=self.id, task_key=self.task.key, task_hash=self.task.content_hash,
            family=self.task.family, difficulty=self.task.difficulty, status=status,
            stop_reason=stop.reason, reward=None if reward is None else reward.value,
            reward_breakdown=dict(reward.breakdown) if reward else {}, error_type=error_type,
            error=error, started_at=self.started_at, finished_at=time.time(),
            engine_s=self.engine_s, tools_s=self.tools_s, waiting_s=self.waiting_s,
            verify_s=self.verify_s, turns=self.turns, sampled_tokens=self.sampled_tokens,
            tool_calls=self.tool_calls, malformed_calls=self.malformed,
            min_weights_version=int(versions.min()) if len(versions) else None,
            max_weights_version=int(versions.max()) if len(versions) else None,
            segments=segments, messages=self._messages(), final_text=self._final_text())


class _ToolTimeout(Exception):
    pass


class _VerifyTimeout(Exception):
    pass
