"""The engine as its own process, over real HTTP, through the orchestrator's client.

Contracts: the vLLM-compatible subset answers in vLLM's format (token-id prompts,
`return_tokens_as_token_ids` -> "token_id:N", logprobs, streaming, usage with cached tokens);
the token-level route returns every SampledTokens field; an in-flight update under 32 concurrent
sessions drops and corrupts nothing and keeps each sequence's weights versions monotone; the
same client drives the server through the vLLM path (completions + pause/collective_rpc/
reset/resume) with correct version attribution; errors surface as EngineError with the
server's message; a cancelled generate is aborted in the engine.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys

import anyio
import httpx
import pytest
import torch

from config.engine import EngineServerConfig
from core.engine_api import (
    EngineError,
    GenerateRequest,
    SamplingParams,
    decode_generate_reply,
)
from orchestrator.engines.embedded import EngineTimeouts, engine_client
from orchestrator.engines.launch import LaunchError, start_engine

pytestmark = pytest.mark.slow

PROMPTS = [[10 + (11 * i + 3 * j) % 90 for j in range(6 + i % 7)] for i in range(32)]


@pytest.fixture(scope="module")
def server(model_v0):
    config = EngineServerConfig(served_model_name="tiny")
    with start_engine(model_v0, config, seed=7) as process:
        yield process


@pytest.fixture(scope="module")
def update_server(model_v0):
    """A server whose weights the tests below update (versions only go up)."""
    with start_engine(model_v0, EngineServerConfig(served_model_name="tiny")) as process:
        yield process


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_health_models_and_info(server):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 2048
    info = httpx.get(f"{server.url}/stalewise/info").json()
    assert info["weights_version"] == 0 and info["vocab_size"] == 107 and info["eos_token_ids"] == [2]


    async def client_view():
        for kind in ("embedded", "vllm"):  # the orchestrator caps task contexts with this
            async with engine_client(server.url, kind=kind) as client:
                assert await client.max_model_len() == 2048
                assert await client.model_name() == "tiny"

    anyio.run(client_view)


COMPLETION = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "min_tokens": 8,
              "temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 11, "logprobs": 3,
              "return_tokens_as_token_ids": True, "ignore_eos": True}


def test_completions_speak_vllms_format_and_match_the_token_route(server):
    reply = post(server.url, "/v1/completions", COMPLETION).json()
    choice = reply["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    assert len(tokens) == 8 and all(re.fullmatch(r"token_id:\d+", t) for t in tokens)
    for label, lp, top in zip(tokens, choice["logprobs"]["token_logprobs"],
                              choice["logprobs"]["top_logprobs"]):
        assert top[label] == pytest.approx(lp) and 3 <= len(top) <= 4
        assert all(re.fullmatch(r"token_id:\d+", k) for k in top)
    assert choice["finish_reason"] == "length"
    assert reply["usage"] == {"prompt_tokens": len(PROMPTS[0]), "completion_tokens": 8,
                              "total_tokens": len(PROMPTS[0]) + 8,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    same = post(server.url, "/stalewise/generate", {
        "prompt_token_ids": PROMPTS[0], "ignore_eos": True,
        "params": {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 11, "max_tokens": 8,
                   "min_tokens": 8, "logprobs_topk": 3}}).json()
    same_tokens = decode_generate_reply(same).tokens
    assert same_tokens.token_ids.tolist() == [int(t.split(":")[1]) for t in tokens]
    assert same_tokens.sampler_logprobs.tolist() == pytest.approx(
        choice["logprobs"]["token_logprobs"], abs=1e-5)


def test_streamed_completion_equals_the_plain_one(server):
    plain = post(server.url, "/v1/completions", COMPLETION).json()["choices"][0]
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    chunks, done = [], False
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert done
    streamed = [t for c in chunks for ch in c["choices"] if ch["logprobs"]
                for t in ch["logprobs"]["tokens"]]
    assert streamed == plain["logprobs"]["tokens"]
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 8


def test_a_streamed_completion_groups_tokens_as_asked_and_carries_the_clients_request_id(server):
    """`stream_interval` as vLLM has it (the first token alone, then that many per event, the
    rest with the end) and `request_id` as the reply's id: what a job's vLLM client sends."""
    plain = post(server.url, "/v1/completions", {**COMPLETION, "max_tokens": 12,
                                                 "min_tokens": 12}).json()["choices"][0]
    body = {**COMPLETION, "max_tokens": 12, "min_tokens": 12, "stream": True,
            "stream_interval": 5, "request_id": "traj-7-call-3"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    groups = [ch["logprobs"]["tokens"] for c in chunks for ch in c["choices"] if ch["logprobs"]]
    assert [len(g) for g in groups] == [1, 5, 5, 1]
    assert [t for g in groups for t in g] == plain["logprobs"]["tokens"]
    assert [lp for c in chunks for ch in c["choices"] if ch["logprobs"]
            for lp in ch["logprobs"]["token_logprobs"]] == pytest.approx(
        plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert {c["id"] for c in chunks} == {"cmpl-traj-7-call-3"}
    assert post(server.url, "/v1/completions",
                {**COMPLETION, "request_id": "r1"}).json()["id"] == "cmpl-r1"
    refused = post(server.url, "/v1/completions", {**body, "stream_interval": 0})
    assert refused.status_code == 400 and "stream_interval" in refused.text


def test_text_prompts_and_refused_options(server):
    reply = post(server.url, "/v1/completions", {"prompt": "hello", "max_tokens": 4,
                                                 "ignore_eos": True}).json()
    assert isinstance(reply["choices"][0]["text"], str) and reply["usage"]["completion_tokens"] == 4
    cases = [({"prompt": [5, 6], "n": 2}, "n/best_of"), ({"prompt": [5, 6], "stop": ["x"]}, "stop_token_ids"),
             ({"prompt": [5, 6], "model": "other"}, "not served here"),
             ({"max_tokens": 3}, "prompt"), ({"prompt": [5, 999]}, "outside the vocabulary"),
             # an HTTP 500 before: a top-k the reply could not hold
             ({"prompt": [5, 6], "logprobs": 10**6}, "more than the vocabulary's")]
    for body, message in cases:
        response = post(server.url, "/v1/completions", body)
        assert response.status_code == 400, body
        assert message in response.json()["error"]["message"], (body, response.json())
    response = httpx.post(f"{server.url}/stalewise/generate", content=b"{not json", timeout=10)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    # JSON may escape a lone surrogate, which no text encoding holds: the tokenizer's TypeError
    # was an HTTP 500
    response = httpx.post(f"{server.url}/v1/completions", timeout=10,
                          content=b'{"prompt": "a\\ud800b", "max_tokens": 2}')
    assert response.status_code == 400
    assert "holds '\\ud800' at character 1, a lone UTF-16 surrogate" in \
        response.json()["error"]["message"]


async def _client_generate_all_fields(url: str) -> None:
    async with engine_client(url, ignore_eos=True) as client:
        params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, logprobs_topk=5)
        first = await client.generate(GenerateRequest(PROMPTS[1], params, session_id="t1"))
        tokens = first.tokens
        assert len(tokens) == 12 and tokens.topk == 5 and first.finish_reason == "length"
        assert first.prompt_tokens == len(PROMPTS[1]) and first.engine_id.startswith("stalewise-")
        assert (tokens.weights_versions == 0).all() and (tokens.kv_versions == 0).all()
        assert (tokens.time_offsets[1:] >= tokens.time_offsets[:-1]).all()
        assert (tokens.sampler_logprobs <= tokens.topk_logprobs[:, 0] + 1e-6).all()
        context = PROMPTS[1] + tokens.token_ids.tolist() + [30, 31]
        second = await client.generate(GenerateRequest(context, params, session_id="t1"))
        assert second.cached_prompt_tokens == len(PROMPTS[1]) + 11
        await client.release_session("t1")
        third = await client.generate(GenerateRequest(context, params, session_id="t1"))
        assert third.cached_prompt_tokens == 0
        metrics = await client.metrics()
        assert metrics["tokens/cache_hit_total"] >= second.cached_prompt_tokens


def test_client_returns_every_sampled_tokens_field(server):
    anyio.run(_client_generate_all_fields, server.url)


async def _client_errors(url: str) -> None:
    async with engine_client(url) as client:
        with pytest.raises(EngineError, match="outside the vocabulary"):
            await client.generate(GenerateRequest([1, 2, 4000], SamplingParams(max_tokens=2)))
        with pytest.raises(EngineError, match="does not exist"):
            await client.update_weights("/nonexistent/ckpt", 5)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with engine_client(dead, retries=1, retry_backoff_s=0.01) as client:
        with pytest.raises(EngineError, match="cannot reach"):
            await client.generate(GenerateRequest([1, 2], SamplingParams(max_tokens=2)))
        assert await client.health() is False
    async with engine_client(url, kind="vllm") as client:
        with pytest.raises(EngineError, match="cancel the generate"):
            await client.abort("x")


def test_errors_are_engine_errors_with_the_reason(server):
    anyio.run(_client_errors, server.url)


async def _cancel_then_check(url: str) -> None:
    async with engine_client(url, ignore_eos=True) as client:
        before = await client.metrics()
        generated, aborted = before["tokens/generated_total"], before["requests/aborted_total"]
        async with anyio.create_task_group() as tg:  # cancelled once the engine is decoding it
            tg.start_soon(client.generate,
                          GenerateRequest(PROMPTS[2], SamplingParams(max_tokens=2000)))
            with anyio.fail_after(60):
                while (await client.metrics())["tokens/generated_total"] <= generated:
                    await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
        with anyio.fail_after(30):
            while True:
                metrics = await client.metrics()
                if metrics["requests/aborted_total"] > aborted and metrics["engine/running"] == 0:
                    return
                await anyio.sleep(0.05)


def test_cancelled_generate_is_aborted_in_the_engine(server):
    anyio.run(_cancel_then_check, server.url)


async def _load_with_updates(url: str, updates: list) -> list:
    """32 concurrent sessions; weight updates land while they decode."""
    params = SamplingParams(max_tokens=160)
    results: list = [None] * len(PROMPTS)
    reports = []
    async with engine_client(url, ignore_eos=True, max_connections=64) as client:
        async def one(i: int) -> None:
            results[i] = await client.generate(GenerateRequest(PROMPTS[i], params))

        async def updater() -> None:
            for threshold, path, version in updates:
                while (await client.metrics())["tokens/generated_total"] < threshold:
                    await anyio.sleep(0.005)
                reports.append(await client.update_weights(str(path), version, kv="recompute"))

        async with anyio.create_task_group() as group:
            for i in range(len(PROMPTS)):
                group.start_soon(one, i)
            group.start_soon(updater)
    return [results, reports]


def test_inflight_update_under_32_sessions_drops_and_corrupts_nothing(
        update_server, model_v0, model_v1, model_v2, tmp_path, reference, make_version):
    n = len(PROMPTS)
    paths = {0: model_v0, 1: model_v1, 2: model_v2}
    start = httpx.get(f"{update_server.url}/stalewise/info").json()["weights_version"]
    for version in (start + 1, start + 2):
        paths.setdefault(version, make_version(paths[version - 1], tmp_path / f"v{version}", version))
    results, reports = anyio.run(_load_with_updates, update_server.url,
                                 [(n * 20, paths[start + 1], start + 1),
                                  (n * 70, paths[start + 2], start + 2)])
    assert [r.version for r in reports] == [start + 1, start + 2]
    assert all(r.in_flight_sequences > 0 for r in reports)
    spanning = 0
    for prompt, result in zip(PROMPTS, results):
        tokens = result.tokens
        assert result.finish_reason == "length" and len(tokens) == 160
        versions = tokens.weights_versions
        assert (versions[1:] >= versions[:-1]).all(), "weights version went backwards"
        assert (tokens.kv_versions == versions).all()
        spanning += len(set(versions.tolist())) > 1
        got = torch.from_numpy(tokens.sampler_logprobs.copy())
        for version in set(versions.tolist()):
            want = reference.token_logprobs(paths[version], prompt, tokens.token_ids.tolist())
            mask = torch.from_numpy(versions == version)
            assert (got[mask] - want[mask]).abs().max() < 1e-4, (prompt, version)
    assert spanning == n, f"only {spanning} of {n} sequences spanned an update"


async def _vllm_path(url: str, old_path, new_path, reference) -> None:
    params = SamplingParams(temperature=0.8, top_k=25, max_tokens=10, seed=9, logprobs_topk=3)
    async with httpx.AsyncClient() as http:
        old = (await http.get(f"{url}/stalewise/info")).json()["weights_version"]
    new = old + 1
    async with engine_client(url, kind="vllm", ignore_eos=True, initial_version=old) as vllm, \
            engine_client(url, ignore_eos=True) as native:
        via_vllm = await vllm.generate(GenerateRequest(PROMPTS[3], params))
        via_native = await native.generate(GenerateRequest(PROMPTS[3], params))
        assert via_vllm.tokens.token_ids.tolist() == via_native.tokens.token_ids.tolist()
        assert abs(via_vllm.tokens.sampler_logprobs - via_native.tokens.sampler_logprobs).max() < 1e-5
        assert via_vllm.tokens.topk_ids.tolist() == via_native.tokens.topk_ids.tolist()
        assert via_vllm.engine_id == f"vllm@{url}" and via_vllm.finish_reason == "length"
        assert (via_vllm.tokens.weights_versions == old).all()

        # an in-flight update through the vLLM routes while a long request streams
        holder = {}

        async def long_request() -> None:
            holder["result"] = await vllm.generate(
                GenerateRequest(PROMPTS[4], SamplingParams(max_tokens=300)))

        generated = (await native.metrics())["tokens/generated_total"]
        async with anyio.create_task_group() as group:
            group.start_soon(long_request)
            while (await native.metrics())["tokens/generated_total"] < generated + 20:
                await anyio.sleep(0.005)
            report = await vllm.update_weights(str(new_path), new, mode="inflight", kv="recompute")
        assert report.kind == "vllm" and vllm.weights_version == new
        tokens = holder["result"].tokens
        versions = tokens.weights_versions
        assert set(versions.tolist()) == {old, new} and (versions[1:] >= versions[:-1]).all()
        assert (tokens.kv_versions == versions).all()
        got = torch.from_numpy(tokens.sampler_logprobs.copy())
        for version, path in ((old, old_path), (new, new_path)):
            want = reference.token_logprobs(path, PROMPTS[4], tokens.token_ids.tolist())
            mask = torch.from_numpy(versions == version)
            assert (got[mask] - want[mask]).abs().max() < 1e-4, version
        metrics = await vllm.metrics()
        assert metrics["stalewise:engine_weights_version"] == float(new)


def test_vllm_client_path_against_the_compatible_server(update_server, tmp_path, reference,
                                                       make_version):
    info = httpx.get(f"{update_server.url}/stalewise/info").json()
    old_path = info["weights_path"]
    from pathlib import Path

    new_path = make_version(Path(old_path), tmp_path / "next", seed=77)
    anyio.run(_vllm_path, update_server.url, Path(old_path), new_path, reference)


def test_launcher_reports_a_model_that_cannot_be_served(tmp_path):
    with pytest.raises(LaunchError, match="does not exist"):
        start_engine(tmp_path / "nothing", startup_timeout=60)


def test_server_stops_cleanly(update_server):
    process = update_server
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the parent sees it; a SIGKILL
    # (-9) would mean the graceful path hung
    assert process.stop(timeout=20) in (0, -signal.SIGTERM)
    assert "Traceback" not in process.log_tail()


def test_client_module_does_not_import_torch():
    code = ("import sys, orchestrator.engines.embedded, orchestrator.engines.launch; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_timeouts_are_explicit():
    timeouts = EngineTimeouts(connect=1, generate=2, admin=3, control=4, pool=5)
    client = engine_client("http://127.0.0.1:9", timeouts=timeouts)
    assert client.http.timeout(timeouts.generate) == httpx.Timeout(connect=1, read=2, write=30, pool=5)
    anyio.run(client.aclose)


def test_cli_exposes_engine_serve():
    from typer.testing import CliRunner

    from engine.cli import engine_app

    result = CliRunner().invoke(engine_app, ["serve", "--help"])
    assert result.exit_code == 0
    for option in ("--model", "--port", "--initial-version", "--max-batch", "--session-cache-mb"):
        assert option in result.output


def _wait_for_abort(url: str, before: float) -> None:
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{url}/stalewise/metrics").json()
        if metrics["requests/aborted_total"] > before and metrics["engine/running"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the engine kept generating for a client that went away")


def _post_and_hang_up_once_decoding(url: str, path: str, body: dict) -> None:
    """POST on a raw socket and close it once the engine has sampled a token more."""
    import time

    metrics_url = f"{url}/stalewise/metrics"
    generated = httpx.get(metrics_url).json()["tokens/generated_total"]
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(head + payload)
        deadline = time.monotonic() + 60
        while httpx.get(metrics_url).json()["tokens/generated_total"] <= generated:
            assert time.monotonic() < deadline, "the engine never started the request"
            time.sleep(0.02)


def test_a_client_that_disconnects_has_its_request_aborted(server):
    """Plain HTTP clients (no explicit abort): closing the connection is enough."""
    aborted = httpx.get(f"{server.url}/stalewise/metrics").json()["requests/aborted_total"]
    body = {"prompt_token_ids": PROMPTS[5], "ignore_eos": True, "params": {"max_tokens": 2000}}
    _post_and_hang_up_once_decoding(server.url, "/stalewise/generate", body)
    _wait_for_abort(server.url, aborted)
    stream = {"prompt": PROMPTS[5], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=stream, timeout=30) as response:
        next(response.iter_lines())  # one token arrived; now hang up
    _wait_for_abort(server.url, aborted + 1)


def test_an_engine_does_not_outlive_a_crashed_parent(model_v0):
    import os
    import time

    code = ("import sys, time; from orchestrator.engines.launch import start_engine; "
            f"p = start_engine({str(model_v0)!r}); print(p.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return  # exited; only waiting for its new parent to reap it
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the engine kept running after its parent was killed")
