"""The store-backed `RolloutRecorder`: agent-loop records become `model_calls` / `tool_calls` rows.

Rows go through the job's `StoreWriter`, so recording never waits on the disk; the trajectory's
final row update is written with them and `finish` returns once it is durable. A call that
starts a later training segment carries the reason (`segment_break`) in its `sampling` JSON,
next to the sampling parameters; a call whose context was prefilled again on another engine
replica (failover, `orchestrator.engines.replicas`) carries why as `kv_recompute` there too.

Every text it hands the store is one the store can hold: a NUL character (which PostgreSQL's
text and JSON columns refuse, failing the whole batch with the rows of other trajectories) and a
lone UTF-16 surrogate (which no encoding holds, so both stores' drivers refuse it; a file name's
undecodable bytes as `os.fsdecode` gives them) are written as U+FFFD, in tool observations and
arguments, errors and the reasons above.
"""

from __future__ import annotations

import json
import re
from typing import Any

from core.engine_api import SamplingParams
from core.store.store import model_call_row
from core.text import SURROGATES
from orchestrator.rollout_types import ModelCallRecord, ToolCallRecord, TrajectoryOutcome
from orchestrator.writer import StoreWriter


class SqlRecorder:
    def __init__(self, writer: StoreWriter) -> None:
        self.writer = writer
        self._sampling: dict[SamplingParams, str] = {}  # the loop reuses a few params objects

    def _sampling_json(self, params: SamplingParams) -> str:
        encoded = self._sampling.get(params)
        if encoded is None:
            if len(self._sampling) > 1024:
                self._sampling.clear()
            encoded = self._sampling[params] = params.model_dump_json()
        return encoded

    async def model_call(self, record: ModelCallRecord) -> None:
        sampling: dict[str, Any] | str = self._sampling_json(record.params)
        if record.segment_break is not None:  # rare: the first call of a later segment
            sampling = {**json.loads(sampling), "segment_break": storable(record.segment_break)}
        if record.recompute_reason is not None:  # rare: the session moved to another replica
            sampling = {**(json.loads(sampling) if isinstance(sampling, str) else sampling),
                        "kv_recompute": storable(record.recompute_reason)}
        await self.writer.put_model_call(model_call_row(
            trajectory_id=record.trajectory_id, turn=record.turn, segment=record.segment,
            context_len=record.context_len, prompt_token_ids=record.prompt_token_ids,
            tokens=record.tokens, sampling=sampling,
            engine_id=record.engine_id, finish_reason=record.finish_reason,
            cached_prompt_tokens=record.cached_prompt_tokens, started_at=record.started_at,
            finished_at=record.finished_at))

    async def tool_call(self, record: ToolCallRecord) -> None:
        await self.writer.put_tool_call(dict(
            trajectory_id=record.trajectory_id, turn=record.turn, index=record.index,
            name=storable(record.tool_name or ""), arguments=storable(record.arguments_json),
            observation=storable(record.observation), exit_code=record.exit_code,
            error_type=record.error_type, timed_out=record.timed_out,
            truncated=record.truncated, output_bytes=record.original_bytes or 0,
            started_at=record.started_at, duration_s=record.duration_s, reward=record.reward))


_UNSTORABLE = re.compile("[\x00" + SURROGATES + "]")


def storable(text: str) -> str:
    """`text` with every NUL and every lone surrogate written as U+FFFD (see the module
    docstring)."""
    if text.isascii() and "\x00" not in text:
        return text
    return _UNSTORABLE.sub("\ufffd", text)


def outcome_values(outcome: TrajectoryOutcome) -> dict[str, Any]:
    """The `trajectories` columns an outcome fills in."""
    kv = [int(s.kv_versions[s.loss_mask].min()) for s in outcome.segments if s.num_sampled]
    error = outcome.error
    if outcome.error_type and error:
        error = f"{outcome.error_type}: {error}"
    error = None if error is None else storable(error)
    return dict(
        status=outcome.status.value, stop_reason=outcome.stop_reason.value, reward=outcome.reward,
        reward_breakdown=dict(outcome.reward_breakdown), error=error,
        started_at=outcome.started_at, finished_at=outcome.finished_at,
        engine_s=outcome.engine_s, tools_s=outcome.tools_s, waiting_s=outcome.waiting_s,
        min_version=outcome.min_weights_version, max_version=outcome.max_weights_version,
        min_kv_version=min(kv) if kv else None, num_turns=outcome.turns,
        num_model_calls=outcome.turns, num_tool_calls=outcome.tool_calls,
        num_malformed=outcome.malformed_calls, num_sampled_tokens=outcome.sampled_tokens,
        num_segments=len(outcome.segments))
