"""Records of one agent trajectory: model calls, tool calls, and the outcome with training samples.

Everything here is frozen data, reported by the agent loop as it happens (`RolloutRecorder`) and
mapped one-to-one to store rows. Guarantees:

- `ModelCallRecord.prompt_token_ids` are only the tokens appended since the previous call of the
  same segment (the whole prompt on a segment's first call), so for every segment the
  concatenation over its calls of `prompt_token_ids + tokens.token_ids` is exactly the segment's
  `token_ids`;
- a `TrajectoryOutcome`'s segments are its model calls laid out by the one path
  (`core.samples.segment_samples`), checked against the conversation's own ids;
- `StopReason` says precisely why the loop stopped; `STATUS_OF` maps it to the trajectory status.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from core.engine_api import FinishReason, SamplingParams
from core.records import SampledTokens
from core.samples import SegmentSample
from tasks.messages import ChatMessage


class TrajectoryStatus(str, enum.Enum):
    COMPLETED = "completed"  # the model answered; the verifier scored it
    TRUNCATED = "truncated"  # a limit stopped it (turns, tokens, context, time)
    FAILED = "failed"  # the policy or task code failed (malformed calls, tool bug, verifier bug)
    INFRA_ERROR = "infra_error"  # the engine or the sandbox failed


class StopReason(str, enum.Enum):
    ANSWERED = "answered"  # a turn ended without tool calls: the final answer
    MAX_TURNS = "max_turns"  # the last allowed turn still asked for tools (not run)
    MAX_TOKENS = "max_tokens"  # the trajectory's sampled-token budget ran out mid-turn
    TURN_TOKENS = "turn_tokens"  # one call hit SamplingParams.max_tokens without ending its turn
    CONTEXT_LENGTH = "context_length"  # the sample reached the context length
    WALL_TIME = "wall_time"  # wall-clock limit (engine, tools and waiting)
    WORKING_TIME = "working_time"  # engine-plus-tool time limit (no queueing)
    MALFORMED_TOOL_CALLS = "malformed_tool_calls"  # more malformed calls than allowed
    TOOL_EXCEPTION = "tool_exception"  # a tool raised something other than ToolError (a bug)
    SANDBOX_ERROR = "sandbox_error"  # SandboxError while acquiring or using the sandbox
    ENGINE_ERROR = "engine_error"  # EngineError, an engine timeout or an invalid reply
    ENGINE_ABORT = "engine_abort"  # the engine aborted the request


STATUS_OF: Mapping[StopReason, TrajectoryStatus] = {
    StopReason.ANSWERED: TrajectoryStatus.COMPLETED,
    StopReason.MAX_TURNS: TrajectoryStatus.TRUNCATED,
    StopReason.MAX_TOKENS: TrajectoryStatus.TRUNCATED,
    StopReason.TURN_TOKENS: TrajectoryStatus.TRUNCATED,
    StopReason.CONTEXT_LENGTH: TrajectoryStatus.TRUNCATED,
    StopReason.WALL_TIME: TrajectoryStatus.TRUNCATED,
    StopReason.WORKING_TIME: TrajectoryStatus.TRUNCATED,
    StopReason.MALFORMED_TOOL_CALLS: TrajectoryStatus.FAILED,
    StopReason.TOOL_EXCEPTION: TrajectoryStatus.FAILED,
    StopReason.SANDBOX_ERROR: TrajectoryStatus.INFRA_ERROR,
    StopReason.ENGINE_ERROR: TrajectoryStatus.INFRA_ERROR,
    StopReason.ENGINE_ABORT: TrajectoryStatus.INFRA_ERROR,
}


@dataclass(frozen=True, eq=False)
class ModelCallRecord:
    trajectory_id: int | None  # the store's id; None for a trajectory run outside a store
    turn: int
    segment: int  # index of the training sample within the trajectory
    context_len: int  # tokens of the segment before this call's prompt delta
    prompt_token_ids: np.ndarray  # int32, only the tokens new since the previous call
    tokens: SampledTokens
    params: SamplingParams  # as sent (max_tokens already cut to the remaining budget)
    engine_id: str
    finish_reason: FinishReason
    prompt_tokens: int  # the whole prompt = context_len + len(prompt_token_ids)
    cached_prompt_tokens: int
    started_at: float  # wall-clock seconds (time.time())
    finished_at: float
    tool_calls: int  # calls parsed from this turn, malformed ones included
    malformed_calls: int
    segment_break: str | None = None  # on a later segment's first call: why it started
    recompute_reason: str | None = None  # context prefilled again elsewhere (replica failover)


@dataclass(frozen=True)
class ToolCallRecord:
    trajectory_id: int | None
    turn: int
    index: int  # position among the calls of this turn
    tool_name: str | None  # None when no name could be parsed
    arguments_json: str  # the arguments, or the raw call text when malformed
    observation: str  # exactly what the model is shown
    exit_code: int | None
    error_type: str | None  # malformed | tool_error | timeout | sandbox exec error type | None
    timed_out: bool
    truncated: bool
    original_bytes: int | None  # size before truncation, when truncated
    started_at: float
    duration_s: float
    attempts: int = 1
    reward: float | None = None  # the tool's per-turn reward (ToolResult.reward)


@dataclass(frozen=True, eq=False)
class TrajectoryOutcome:
    trajectory_id: int | None
    task_key: str
    task_hash: str
    family: str
    difficulty: str
    status: TrajectoryStatus
    stop_reason: StopReason
    reward: float | None  # None: not verified (truncated, infra error, bug); 0 for malformed
    reward_breakdown: Mapping[str, float]
    error_type: str | None  # set when status is failed or infra_error
    error: str | None  # message or traceback
    started_at: float
    finished_at: float
    engine_s: float  # inside engine calls
    tools_s: float  # inside tool calls
    waiting_s: float  # acquiring and preparing the sandbox, waiting at the engine gate
    verify_s: float
    turns: int
    sampled_tokens: int
    tool_calls: int
    malformed_calls: int
    min_weights_version: int | None
    max_weights_version: int | None
    segments: tuple[SegmentSample, ...]  # core.samples.segment_samples of its model calls
    messages: tuple[ChatMessage, ...] = field(default=())
    final_text: str = ""


class RolloutRecorder(Protocol):
    """Where the agent loop reports records as they happen (the store, or memory in tests)."""

    async def model_call(self, record: ModelCallRecord) -> None: ...

    async def tool_call(self, record: ToolCallRecord) -> None: ...


class MemoryRecorder:
    """Keeps every record in lists, in the order reported."""

    def __init__(self) -> None:
        self.model_calls: list[ModelCallRecord] = []
        self.tool_calls: list[ToolCallRecord] = []

    async def model_call(self, record: ModelCallRecord) -> None:
        self.model_calls.append(record)

    async def tool_call(self, record: ToolCallRecord) -> None:
        self.tool_calls.append(record)
