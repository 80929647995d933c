"""The SQL recorder stores why a training segment started with the segment's first call, next
to the sampling parameters, and why a call's context was prefilled again on another engine
replica (`kv_recompute`), and nothing extra on other calls (real SQLite)."""

from __future__ import annotations

import dataclasses
import time

import anyio
import numpy as np

from core.engine_api import SamplingParams
from core.records import SampledTokens
from core.store.store import Store
from orchestrator.recorder import SqlRecorder
from orchestrator.rollout_types import ModelCallRecord
from orchestrator.writer import StoreWriter


def _record(tid: int, turn: int, segment_break: str | None) -> ModelCallRecord:
    return ModelCallRecord(
        trajectory_id=tid, turn=turn, segment=turn, context_len=0,
        prompt_token_ids=np.asarray([1, 2], dtype=np.int32),
        tokens=SampledTokens([3], [-0.5], [0], [0], [0.0]),
        params=SamplingParams(max_tokens=8), engine_id="e", finish_reason="stop",
        prompt_tokens=2, cached_prompt_tokens=0, started_at=time.time(),
        finished_at=time.time(), tool_calls=0, malformed_calls=0, segment_break=segment_break)


def _stored_calls(sqlite_url: str, records) -> tuple[Store, list]:
    """Write `records(tid)` through the SQL recorder and read the trajectory's calls back."""
    store = Store.open(sqlite_url, create=True)
    store.create_run("r", name="r", config={}, pipeline_mode="async")
    tid = store.create_trajectory("r", group_id=None, task_instance_id=None)

    async def main():
        writer = StoreWriter(store)
        recorder = SqlRecorder(writer)
        async with anyio.create_task_group() as tg:
            await tg.start(writer.run)
            for record in records(tid):
                await recorder.model_call(record)
            await writer.flush()
            tg.cancel_scope.cancel()

    anyio.run(main)
    return store, store.model_calls(tid)


def test_segment_break_is_stored_with_the_sampling(sqlite_url):
    store, (first, second) = _stored_calls(sqlite_url, lambda tid: [
        _record(tid, 0, None), _record(tid, 1, "history_rewritten: at char 4: …")])
    assert "segment_break" not in first.sampling and first.sampling["max_tokens"] == 8
    assert second.sampling["segment_break"] == "history_rewritten: at char 4: …"
    assert second.sampling["max_tokens"] == 8
    store.close()


def test_a_failover_recompute_reason_is_stored_with_the_sampling(sqlite_url):
    reason = "replica_failover: replica 1 went down (refused); context prefilled again"
    store, (first, second) = _stored_calls(sqlite_url, lambda tid: [
        _record(tid, 0, None),
        dataclasses.replace(_record(tid, 1, "rewritten"), recompute_reason=reason)])
    assert "kv_recompute" not in first.sampling
    assert second.sampling["kv_recompute"] == reason
    assert second.sampling["segment_break"] == "rewritten" and second.sampling["max_tokens"] == 8
    store.close()
