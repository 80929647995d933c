"""Version pinning: `async` pipelines keep every token of a trajectory on the version it began with.

Contracts checked here:
- after a `pin` update to v1, a session pinned to v0 keeps generating with v0 (its tokens equal
  a plain HF forward of v0 within 1e-4, weights and KV versions all 0, its retained KV reused),
  while unpinned requests started after the update use v1; a request running at the update
  finishes on its version; each decode step runs one batched forward per version in use;
- old versions stay resident exactly while a running request or a live pinned session uses
  them and are freed once none does; a `pin` update with nothing using the current version
  overwrites it in place;
- at most `max_resident_versions` are held: the oldest is evicted, and a request pinned to an
  evicted (or never loaded) version fails with an error naming it and the resident versions;
- the same over HTTP through the client's `pinned()`, and a clear refusal on the vLLM backend.
"""

from __future__ import annotations

import threading

import anyio
import httpx
import pytest
import torch

from config.engine import EngineServerConfig
from core.engine_api import EngineError, GenerateRequest, SamplingParams
from engine.core import Engine
from engine.requests import EngineOutput, RequestError, SamplingSpec
from engine.versions import VersionNotResident, plan_residency
from orchestrator.engines.embedded import VersionNotResidentError, engine_client
from orchestrator.engines.launch import start_engine

PROMPTS = [[10 + (5 * i + 3 * j) % 90 for j in range(7 + 2 * i)] for i in range(4)]
SPEC = SamplingSpec(max_tokens=24, ignore_eos=True)


@pytest.fixture
def engine(model_v0):
    eng = Engine(model_v0, max_batch=16, seed=99, session_cache_mb=64)
    eng.start()
    yield eng
    eng.stop()


def run(engine: Engine, prompt: list[int], spec: SamplingSpec = SPEC, **kw) -> EngineOutput:
    return engine.submit(prompt, spec, **kw).result(timeout=120)


def pin_update(engine: Engine, path, version: int):
    return engine.update_weights(engine.load_weights(path), version=version, path=str(path),
                                 mode="pin").result(timeout=60)


def assert_exact(reference, path, version: int, prompt: list[int], out: EngineOutput) -> None:
    """Every token came from `version` (weights and KV) and matches a plain HF forward of it."""
    assert set(out.weights_versions) == {version} and set(out.kv_versions) == {version}
    want = reference.token_logprobs(path, prompt, out.token_ids)
    assert (torch.tensor(out.sampler_logprobs) - want).abs().max() < 1e-4


def test_pinned_session_stays_on_its_version_while_new_work_uses_the_new_one(
        engine, model_v0, model_v1, reference):
    first = run(engine, PROMPTS[0], session_id="traj", weights_version=0)
    assert_exact(reference, model_v0, 0, PROMPTS[0], first)

    # the update lands while a pinned turn and an unpinned request are both decoding
    state = engine.load_weights(model_v1)
    holder: dict = {}

    def listener(event) -> None:
        if event.index == 8 and "update" not in holder:
            holder["update"] = engine.update_weights(state, version=1, path=str(model_v1),
                                                     mode="pin")
    second_prompt = PROMPTS[0] + first.token_ids + [40, 41]
    engine.pause().result(timeout=10)
    second = engine.submit(second_prompt, SPEC, session_id="traj", weights_version=0,
                           listener=listener)
    running_unpinned = engine.submit(PROMPTS[1], SPEC)
    engine.resume().result(timeout=10)
    second, running_unpinned = second.result(timeout=120), running_unpinned.result(timeout=120)
    report = holder["update"].result(timeout=60)
    assert report.mode == "pin" and report.version == 1 and report.previous_version == 0
    assert report.resident_versions == (0, 1) and report.in_flight_sequences == 0
    assert engine.resident_versions == (0, 1)
    assert second.cached_prompt_tokens == len(PROMPTS[0]) + len(first.token_ids) - 1
    assert_exact(reference, model_v0, 0, second_prompt, second)
    assert_exact(reference, model_v0, 0, PROMPTS[1], running_unpinned)

    # now a pinned turn (v0) and a new unpinned session (v1) decode side by side
    third_prompt = second_prompt + second.token_ids + [50]
    before = engine.snapshot()
    engine.pause().result(timeout=10)
    third = engine.submit(third_prompt, SPEC, session_id="traj", weights_version=0)
    fresh = engine.submit(PROMPTS[2], SPEC, session_id="other")
    engine.resume().result(timeout=10)
    third, fresh = third.result(timeout=120), fresh.result(timeout=120)
    after = engine.snapshot()
    assert third.cached_prompt_tokens == len(second_prompt) + len(second.token_ids) - 1
    assert_exact(reference, model_v0, 0, third_prompt, third)
    assert_exact(reference, model_v1, 1, PROMPTS[2], fresh)
    steps = after["steps/total"] - before["steps/total"]
    forwards = after["steps/decode_forwards_total"] - before["steps/decode_forwards_total"]
    assert steps == SPEC.max_tokens  # admitted together, finished together
    assert forwards == 2 * (steps - 1), "each decode step: one batched forward per version"

    # a request pinned to the current version shares its weights with unpinned ones
    pinned_new = run(engine, PROMPTS[3], weights_version=1)
    assert_exact(reference, model_v1, 1, PROMPTS[3], pinned_new)
    assert engine.resident_versions == (0, 1)
    assert engine.release_session("traj").result(timeout=10) > 0
    run(engine, [5, 6, 7], SamplingSpec(max_tokens=1))  # a step boundary after the release
    assert engine.resident_versions == (1,)
    assert engine.snapshot()["versions/freed_total"] == 1


def test_versions_are_held_while_referenced_and_freed_after(engine, model_v0, model_v1,
                                                            model_v2, reference):
    # nothing uses v0 at the update: it is overwritten in place, no second copy
    report = pin_update(engine, model_v1, 1)
    assert report.resident_versions == (1,)
    run(engine, PROMPTS[0], session_id="a", weights_version=1)
    report = pin_update(engine, model_v2, 2)
    assert report.resident_versions == (1, 2)   # session a is pinned to 1
    # a running unpinned request keeps v2 resident past the next update, then lets it go
    started = threading.Event()
    long_one = engine.submit(PROMPTS[1], SamplingSpec(max_tokens=200, ignore_eos=True),
                             listener=lambda event: started.set())
    assert started.wait(30)
    report = pin_update(engine, model_v0, 3)    # any checkpoint will do as version 3
    assert report.resident_versions == (1, 2, 3)
    out = long_one.result(timeout=120)
    assert set(out.weights_versions) == {2} and set(out.kv_versions) == {2}
    assert_exact(reference, model_v2, 2, PROMPTS[1], out)
    run(engine, [5, 6, 7], SamplingSpec(max_tokens=1))
    assert engine.resident_versions == (1, 3)
    engine.release_session("a").result(timeout=10)
    run(engine, [5, 6, 7], SamplingSpec(max_tokens=1))
    assert engine.resident_versions == (3,)
    health = engine.snapshot()
    assert health["versions/resident"] == 1 and health["versions/freed_total"] == 2
    # the next version reuses a freed slot's memory; both versions still serve exactly
    run(engine, PROMPTS[2], session_id="d", weights_version=3)
    assert pin_update(engine, model_v1, 4).resident_versions == (3, 4)
    assert_exact(reference, model_v0, 3, PROMPTS[3], run(engine, PROMPTS[3], weights_version=3))
    assert_exact(reference, model_v1, 4, PROMPTS[3], run(engine, PROMPTS[3]))


def test_resident_cap_evicts_the_oldest_and_pinned_requests_fail_clearly(
        model_v0, model_v1, model_v2, reference):
    engine = Engine(model_v0, max_batch=8, seed=3, max_resident_versions=2)
    engine.start()
    try:
        run(engine, PROMPTS[0], session_id="a", weights_version=0)
        pin_update(engine, model_v1, 1)
        run(engine, PROMPTS[1], session_id="b", weights_version=1)
        report = pin_update(engine, model_v2, 2)
        assert report.evicted_versions == (0,) and report.resident_versions == (1, 2)
        with pytest.raises(VersionNotResident) as gone:
            run(engine, PROMPTS[0] + [30], session_id="a", weights_version=0)
        message = str(gone.value)
        assert "weights version 0" in message and "resident versions: [1, 2]" in message
        assert "max_resident_versions=2" in message
        with pytest.raises(VersionNotResident, match="newer than the current version 2"):
            run(engine, PROMPTS[0], weights_version=7)
        with pytest.raises(RequestError, match="weights_version must be"):
            engine.submit(PROMPTS[0], SPEC, weights_version=-1)

        # running when its version is evicted: a pinned request fails with the reason, an
        # unpinned one moves to the current version with its context recomputed
        started = [threading.Event(), threading.Event()]
        long_spec = SamplingSpec(max_tokens=60, ignore_eos=True)
        unpinned = engine.submit(PROMPTS[2], long_spec, listener=lambda e: started[0].set())
        doomed = engine.submit(PROMPTS[1], long_spec, session_id="b", weights_version=1,
                               listener=lambda e: started[1].set())
        assert all(flag.wait(30) for flag in started)
        engine.pause("keep").result(timeout=10)  # updates still apply; decoding waits
        report = pin_update(engine, model_v1, 3)  # 1 and 2 are in use, at most 2 stay
        assert report.evicted_versions == (1,) and report.resident_versions == (2, 3)
        later = engine.submit(PROMPTS[3], SPEC, session_id="c", weights_version=3)
        report = pin_update(engine, model_v0, 4)
        assert report.evicted_versions == (2,) and report.resident_versions == (3, 4)
        engine.resume().result(timeout=10)
        with pytest.raises(VersionNotResident, match="version 1 was evicted .* while this request"):
            doomed.result(timeout=60)
        assert_exact(reference, model_v1, 3, PROMPTS[3], later.result(timeout=60))
        moved = unpinned.result(timeout=60)
        assert len(moved.token_ids) == 60
        versions = torch.tensor(moved.weights_versions)
        assert set(versions.tolist()) == {2, 4} and moved.kv_versions == moved.weights_versions
        got = torch.tensor(moved.sampler_logprobs)
        want = torch.where(versions == 2,
                           reference.token_logprobs(model_v2, PROMPTS[2], moved.token_ids),
                           reference.token_logprobs(model_v0, PROMPTS[2], moved.token_ids))
        assert (got - want).abs().max() < 1e-4
        assert engine.snapshot()["versions/evicted_total"] == 3
    finally:
        engine.stop()


@pytest.mark.parametrize("kv", ["retain", "recompute"])
def test_inflight_update_moves_unpinned_sequences_and_leaves_pinned_ones(
        engine, model_v0, model_v1, reference, kv):
    state = engine.load_weights(model_v1)
    holder: dict = {}

    def listener(event) -> None:
        if event.index == 8 and "update" not in holder:
            holder["update"] = engine.update_weights(state, version=1, path=str(model_v1),
                                                     mode="inflight", kv=kv)
    engine.pause().result(timeout=10)
    pinned = engine.submit(PROMPTS[0], SPEC, session_id="p", weights_version=0,
                           listener=listener)
    follows = engine.submit(PROMPTS[1], SPEC)
    engine.resume().result(timeout=10)
    pinned, follows = pinned.result(timeout=120), follows.result(timeout=120)
    report = holder["update"].result(timeout=60)
    assert report.in_flight_sequences == 1 and report.resident_versions == (0, 1)
    # 9 tokens sampled, the last not fed yet: prompt + 8 positions re-prefilled
    assert report.recomputed_tokens == (0 if kv == "retain" else len(PROMPTS[1]) + 8)
    assert_exact(reference, model_v0, 0, PROMPTS[0], pinned)
    weights = torch.tensor(follows.weights_versions)
    kv_T = torch.tensor(follows.kv_versions)
    assert set(weights.tolist()) == {0, 1} and (weights[1:] >= weights[:-1]).all()
    got = torch.tensor(follows.sampler_logprobs)
    want = torch.where(weights == 0,
                       reference.token_logprobs(model_v0, PROMPTS[1], follows.token_ids),
                       reference.token_logprobs(model_v1, PROMPTS[1], follows.token_ids))
    stale_T = kv_T < weights
    assert bool(stale_T.any()) == (kv == "retain")  # retain: the moved KV keeps its version
    assert torch.equal((got - want).abs() > 1e-4, stale_T)


@pytest.mark.parametrize("resident, current, referenced, cap, freed, evicted", [
    ([0], 0, set(), 4, (), ()),
    ([0, 1, 2], 2, {0}, 4, (1,), ()),
    ([0, 1, 2, 3, 4], 4, {0, 1, 2, 3}, 4, (), (0,)),
    ([0, 1, 2, 3, 4], 4, {0, 2, 3}, 2, (1,), (0, 2)),
    ([3, 5], 5, {3, 5}, 1, (), (3,)),
])
def test_residency_plan(resident, current, referenced, cap, freed, evicted):
    plan = plan_residency(resident, current=current, referenced=referenced, max_resident=cap)
    assert (plan.freed, plan.evicted) == (freed, evicted)


async def _pinned_over_http(url: str, model_v0, model_v1, reference) -> None:
    params = SamplingParams(max_tokens=16, seed=4)
    async with engine_client(url, ignore_eos=True) as client, httpx.AsyncClient() as http:
        trajectory = client.pinned(0)
        first = await trajectory.generate(GenerateRequest(PROMPTS[0], params, session_id="t"))
        report = await client.update_weights(str(model_v1), 1, mode="pin", kv="recompute")
        assert report.mode == "pin" and report.resident_versions == (0, 1)
        health = (await http.get(f"{url}/health")).json()
        assert health["weights_version"] == 1 and health["resident_versions"] == [0, 1]
        context = PROMPTS[0] + first.tokens.token_ids.tolist() + [33]
        second = await trajectory.generate(GenerateRequest(context, params, session_id="t"))
        assert second.cached_prompt_tokens == len(PROMPTS[0]) + len(first.tokens) - 1
        fresh = await client.generate(GenerateRequest(PROMPTS[1], params))
        for prompt, result, path, version in ((PROMPTS[0], first, model_v0, 0),
                                              (context, second, model_v0, 0),
                                              (PROMPTS[1], fresh, model_v1, 1)):
            tokens = result.tokens
            assert set(tokens.weights_versions.tolist()) == {version}
            assert set(tokens.kv_versions.tolist()) == {version}
            want = reference.token_logprobs(path, prompt, tokens.token_ids.tolist())
            assert (torch.from_numpy(tokens.sampler_logprobs.copy()) - want).abs().max() < 1e-4
        await trajectory.release_session("t")
        await client.generate(GenerateRequest([5, 6], SamplingParams(max_tokens=1)))
        assert (await http.get(f"{url}/health")).json()["resident_versions"] == [1]
        assert (await client.metrics())["versions/resident"] == 1
        with pytest.raises(VersionNotResidentError, match=r"weights version 0 .*resident "
                                                          r"versions: \[1\]"):
            await trajectory.generate(GenerateRequest(context, params, session_id="t"))
        bad = await http.post(f"{url}/stalewise/generate",
                              json={"prompt_token_ids": [5], "weights_version": -2})
        assert bad.status_code == 400 and "weights_version" in bad.json()["error"]["message"]


def test_pinned_view_over_http(model_v0, model_v1, reference):
    with start_engine(model_v0, EngineServerConfig(max_resident_versions=3)) as server:
        anyio.run(_pinned_over_http, server.url, model_v0, model_v1, reference)


async def _vllm_refuses_pinning() -> None:
    async with engine_client("http://127.0.0.1:9", kind="vllm") as client:
        with pytest.raises(EngineError, match="needs the embedded engine.*'inflight' or 'drain'"):
            client.pinned(3)
        with pytest.raises(EngineError, match="needs the embedded engine"):
            await client.update_weights("/ckpt", 1, mode="pin")
        with pytest.raises(EngineError, match="pinned to weights version 2.*embedded engine"):
            await client.generate(GenerateRequest([1, 2], SamplingParams(), weights_version=2))


def test_vllm_backend_refuses_pinning_with_a_clear_error():
    anyio.run(_vllm_refuses_pinning)
