"""The scripted engine behaves like a real engine where the agent loop can tell."""

from __future__ import annotations

import time

import anyio
import numpy as np
import pytest
from trio.testing import MockClock

from core.engine_api import EngineError, GenerateRequest, SamplingParams
from orchestrator.engines.scripted import LatencyModel, ScriptedEngine, ScriptedTurn

pytestmark = pytest.mark.anyio
STOP = 2


def request(prompt, session="traj/0", **params):
    return GenerateRequest(list(prompt), SamplingParams(stop_token_ids=(STOP,), **params),
                           session_id=session)


async def test_stop_tokens_and_max_tokens_cut_like_a_real_engine():
    engine = ScriptedEngine([ScriptedTurn((5, 6, STOP, 7)), ScriptedTurn((5, 6, 7, 8))])
    first = await engine.generate(request([1, 1]))
    assert first.tokens.token_ids.tolist() == [5, 6, STOP] and first.finish_reason == "stop"
    second = await engine.generate(request([1, 1, 5, 6, STOP, 9], max_tokens=3))
    assert second.tokens.token_ids.tolist() == [5, 6, 7] and second.finish_reason == "length"
    assert second.cached_prompt_tokens == 5 and second.prompt_tokens == 6
    with pytest.raises(EngineError, match="script has 2 turns"):
        await engine.generate(request([1]))


async def test_scripts_are_per_trajectory_and_sessions_are_released():
    engine = ScriptedEngine({"a": [ScriptedTurn((10, STOP))], "b": [ScriptedTurn((11, STOP))]})
    assert (await engine.generate(request([1], "b/0"))).tokens.token_ids[0] == 11
    assert (await engine.generate(request([1], "a/3"))).tokens.token_ids[0] == 10
    with pytest.raises(EngineError, match="no script for trajectory 'c'"):
        await engine.generate(request([1], "c/0"))
    await engine.release_session("a/3")
    assert engine.released == ["a/3"]
    again = ScriptedEngine({"a": [ScriptedTurn((10, STOP)), ScriptedTurn((10, STOP))]})
    await again.generate(request([1], "a/0"))
    await again.release_session("a/0")
    assert (await again.generate(request([1, 10, STOP], "a/0"))).cached_prompt_tokens == 0


async def test_versions_kv_retention_and_plausible_logprobs():
    engine = ScriptedEngine([ScriptedTurn((5, STOP))] * 3, kv_mode="retain", version=1, topk=4)
    first = await engine.generate(request([1], logprobs_topk=4))
    engine.version = 2
    second = await engine.generate(request([1, 5, STOP, 3], logprobs_topk=4))
    assert second.tokens.weights_versions.tolist() == [2, 2]
    assert second.tokens.kv_versions.tolist() == [1, 1]
    assert np.all(first.tokens.sampler_logprobs <= 0) and np.all(first.tokens.sampler_logprobs > -20)
    assert first.tokens.topk == 4 and first.tokens.topk_ids[:, 0].tolist() == [5, STOP]
    assert np.all(np.diff(first.tokens.topk_logprobs, axis=1) <= 0)
    fresh = await engine.generate(request([9, 9], logprobs_topk=4))  # not a prefix: re-prefill
    assert fresh.tokens.kv_versions.tolist() == [2, 2] and fresh.cached_prompt_tokens == 0
    recompute = ScriptedEngine([ScriptedTurn((5, STOP))] * 2, version=1)
    await recompute.generate(request([1]))
    recompute.version = 2
    assert (await recompute.generate(request([1, 5, STOP]))).tokens.kv_versions.tolist() == [2, 2]


LATENCY = LatencyModel(fixed_s=0.05, prefill_s_per_token=0.001, decode_s_per_token=0.01)
CALL_S = 0.05 + 0.1 + 0.21  # 100 new prompt tokens, 21 sampled


def latency_engine() -> ScriptedEngine:
    return ScriptedEngine(lambda key, index: ScriptedTurn(tuple([5] * 20 + [STOP])),
                          latency=LATENCY)


async def test_simulated_latency_really_waits():
    started = time.monotonic()
    result = await latency_engine().generate(request([1] * 100, "solo/0"))
    assert time.monotonic() - started >= 0.9 * CALL_S
    offsets = result.tokens.time_offsets
    assert offsets[0] == pytest.approx(0.16, rel=1e-3) and offsets[-1] == pytest.approx(0.36)


def test_concurrent_calls_overlap():
    """8 calls of 0.36 s take 0.36 s together, not 2.88 s. Timed on trio's mock clock, which
    moves only while every task waits, so a loaded machine cannot change the figure."""
    async def eight_calls() -> float:
        engine = latency_engine()
        started = anyio.current_time()
        async with anyio.create_task_group() as group:
            for n in range(8):
                group.start_soon(engine.generate, request([1] * 100, f"t{n}/0"))
        return anyio.current_time() - started

    elapsed = anyio.run(eight_calls, backend="trio",
                        backend_options={"clock": MockClock(autojump_threshold=0)})
    assert elapsed == pytest.approx(CALL_S), "8 concurrent calls should overlap"


async def test_malformed_outputs_and_errors_on_demand():
    turn = ScriptedTurn((7, 8, 9, STOP))
    engine = ScriptedEngine(lambda key, index: turn, malformed_rate=1.0)
    result = await engine.generate(request([1]))
    assert result.tokens.token_ids.tolist() == [7, 8, STOP]
    failing = ScriptedEngine([ScriptedTurn(error=EngineError("503"))])
    with pytest.raises(EngineError, match="503"):
        await failing.generate(request([1]))
    half = ScriptedEngine(lambda key, index: turn, malformed_rate=0.5, seed=3)
    cut = [len((await half.generate(request([1], f"s{i}/0"))).tokens) for i in range(200)]
    assert 60 < cut.count(3) < 140


async def test_draws_are_deterministic_per_call_and_requests_can_be_forgotten():
    """Log-probs, jitter and top-k depend only on (seed, trajectory, call), not on call order;
    `keep_requests=False` keeps no request (benchmarks with long trajectories)."""
    turn = ScriptedTurn(tuple([5] * 30 + [STOP]))
    model = LatencyModel(decode_s_per_token=1e-4, jitter_sigma=0.5)

    async def draw(engine, keys):
        return {key: (await engine.generate(request([1], f"{key}/0", logprobs_topk=3))).tokens
                for key in keys}

    forward = await draw(ScriptedEngine(lambda k, i: turn, latency=model, seed=7, topk=3),
                         ["a", "b", "c"])
    quiet = ScriptedEngine(lambda k, i: turn, latency=model, seed=7, topk=3, keep_requests=False)
    backward = await draw(quiet, ["c", "b", "a"])
    assert all(forward[key] == backward[key] for key in "abc") and quiet.requests == []
    assert not np.array_equal(forward["a"].sampler_logprobs, forward["b"].sampler_logprobs)
    assert forward["a"].time_offsets[-1] != forward["b"].time_offsets[-1], "jitter per call"
    other_seed = await draw(ScriptedEngine(lambda k, i: turn, latency=model, seed=8, topk=3),
                            ["a"])
    assert not np.array_equal(other_seed["a"].sampler_logprobs, forward["a"].sampler_logprobs)
    lengths = [len(forward[key]) for key in "abc"]
    assert lengths == [31, 31, 31] and np.all(forward["a"].sampler_logprobs < 0)
