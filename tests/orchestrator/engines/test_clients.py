"""The engine clients against fake servers (httpx.MockTransport: real HTTP objects, no sockets).

Contracts: the factory builds one client class per kind; the embedded client sends a body the
server's schema accepts and returns the reply decoded exactly; a malformed reply is an
`EngineError` naming the route and the field; 409 is `VersionNotResidentError`; the retry policy
retries connection failures and idempotent calls only; the vLLM client reads a streamed
completion with -9999 mapped back to -inf and its own version attribution. The real server is
exercised in tests/engine/test_engine_http.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import anyio
import anyio.lowlevel
import httpx
import numpy as np
import pytest

from core.engine_api import (
    EngineError,
    GenerateBody,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    UpdateWeightsBody,
    VersionNotResidentError,
    encode_generate_reply,
)
from core.records import SampledTokens
from orchestrator.engines.embedded import (
    EmbeddedEngineClient,
    VllmEngineClient,
    engine_client,
)
from orchestrator.engines.http import EngineTimeouts
from orchestrator.engines.vllm_stream import completion_chunks, completion_stream

URL = "http://engine.test"
Handler = Callable[[httpx.Request], httpx.Response]


def client(handler: Handler, kind: str = "embedded", **options) -> object:
    return engine_client(URL, kind=kind, transport=httpx.MockTransport(handler),
                         retry_backoff_s=0.0, **options)


def run(kind: str, handler: Handler, call, **options):
    async def main():
        async with client(handler, kind, **options) as engine:
            return await call(engine)
    return anyio.run(main)


RESULT = GenerateResult(
    SampledTokens([5, 9], [-0.5, -1.25], [2, 3], [2, 2], [0.01, 0.02],
                  topk_ids=[[5, 1], [9, 4]], topk_logprobs=[[-0.5, float("-inf")], [-1.25, -3.0]]),
    "length", 3, 1, "stalewise-x")


def test_the_factory_builds_one_client_per_kind():
    assert isinstance(client(lambda r: httpx.Response(200)), EmbeddedEngineClient)
    assert isinstance(client(lambda r: httpx.Response(200), "vllm"), VllmEngineClient)
    with pytest.raises(ValueError, match="kind must be one of 'embedded', 'vllm', got 'tgi'"):
        engine_client(URL, kind="tgi")  # type: ignore[arg-type]


def test_embedded_generate_sends_the_schema_and_decodes_the_reply_exactly():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = GenerateBody.model_validate(json.loads(request.content))  # the server's schema
        assert request.headers["content-type"] == "application/json"
        seen.append(body)
        return httpx.Response(200, json=encode_generate_reply(RESULT, request_id=body.request_id))

    async def call(engine):
        got = await engine.generate(GenerateRequest(
            [1, 2, 3], SamplingParams(max_tokens=2, logprobs_topk=2), "s/0", weights_version=2))
        return got, engine.weights_version

    got, version = run("embedded", handler, call, ignore_eos=True)
    assert got == RESULT and version == 3
    (body,) = seen
    assert body.prompt_token_ids == [1, 2, 3] and body.session_id == "s/0"
    assert body.weights_version == 2 and body.ignore_eos and body.params.logprobs_topk == 2


def test_a_malformed_reply_names_the_route_and_the_field():
    def handler(request: httpx.Request) -> httpx.Response:
        body = GenerateBody.model_validate(json.loads(request.content))
        reply = encode_generate_reply(RESULT, request_id=body.request_id)
        return httpx.Response(200, json=reply | {"weights_versions": reply["kv_versions"][:4]})

    with pytest.raises(EngineError, match=r"embedded engine at http://engine.test/stalewise/"
                                          r"generate sent a malformed generate reply: field "
                                          r"'weights_versions': 3 bytes, expected 2 x 4"):
        run("embedded", handler,
            lambda e: e.generate(GenerateRequest([1], SamplingParams())))


def test_update_replies_are_decoded_and_409_means_not_resident():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/stalewise/generate":
            return httpx.Response(409, json={"error": {"message": "weights version 1 left"}})
        body = UpdateWeightsBody.model_validate(json.loads(request.content))
        reply = dict(version=body.version, previous_version=0, path=body.path, mode=body.mode,
                     kv=body.kv, wait_s=0.0, pause_s=0.001, in_flight_sequences=2,
                     recomputed_tokens=7, invalidated_sessions=1, resident_versions=[0, 4])
        if body.version == 5:
            del reply["pause_s"]
        return httpx.Response(200, json=reply)

    async def call(engine):
        report = await engine.update_weights("/ckpt/4", 4, mode="pin", kv="retain")
        assert (report.version, report.mode, report.kv, report.kind) == (4, "pin", "retain",
                                                                         "embedded")
        assert report.resident_versions == (0, 4) and engine.weights_version == 4
        with pytest.raises(EngineError, match="update_weights reply: field 'pause_s': Field "
                                              "required"):
            await engine.update_weights("/ckpt/5", 5)
        with pytest.raises(VersionNotResidentError, match="answered 409: weights version 1 left"):
            await engine.pinned(1).generate(GenerateRequest([1], SamplingParams()))
        with pytest.raises(ValueError, match=r"mode must be inflight\|drain\|pin"):
            await engine.update_weights("/ckpt/6", 6, mode="later")  # type: ignore[arg-type]

    run("embedded", handler, call)


def failing(error: type[httpx.TransportError], calls: list, *, succeed_after: int = 99) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) > succeed_after:
            return httpx.Response(200, json={"tokens/generated_total": 1})
        raise error("boom", request=request)
    return handler


def test_connection_failures_are_retried_then_named():
    calls: list = []
    with pytest.raises(EngineError, match=r"cannot reach the embedded engine at "
                                          r"http://engine.test/stalewise/generate after 3 "
                                          r"attempts .*`stalewise engine serve`"):
        run("embedded", failing(httpx.ConnectError, calls),
            lambda e: e.generate(GenerateRequest([1], SamplingParams())), retries=2)
    assert calls == ["/stalewise/generate"] * 3


def test_a_generate_that_may_have_started_is_never_retried():
    calls: list = []
    with pytest.raises(EngineError, match="did not answer within .* not retried"):
        run("embedded", failing(httpx.ReadTimeout, calls),
            lambda e: e.generate(GenerateRequest([1], SamplingParams())), retries=2)
    assert calls == ["/stalewise/generate"]


def test_idempotent_calls_are_retried_after_a_timeout():
    calls: list = []
    metrics = run("embedded", failing(httpx.ReadTimeout, calls, succeed_after=2),
                  lambda e: e.metrics(), retries=2)
    assert metrics == {"tokens/generated_total": 1.0} and len(calls) == 3


def replying(gate: anyio.Event | None = None, open_now: list[int] | None = None):
    """An async handler answering RESULT; it counts the requests open at once in `open_now`
    ([now, most]) and, given `gate`, holds each until the gate is set."""
    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if open_now is not None:
            open_now[0] += 1
            open_now[1] = max(open_now[1], open_now[0])
        try:
            if gate is not None:
                await gate.wait()
            for _ in range(3):
                await anyio.lowlevel.checkpoint()
        finally:
            if open_now is not None:
                open_now[0] -= 1
        return httpx.Response(200, json=encode_generate_reply(
            RESULT, request_id=body["request_id"]))
    return handler


@pytest.mark.parametrize("limit", [1, 20, 40])
def test_no_more_calls_are_open_at_once_than_the_client_has_connections(limit):
    """The client queues calls beyond `max_connections` itself (its connections are split
    over several small pools): 100 calls at once all finish, `limit` of them open at a time."""
    open_now = [0, 0]

    async def main():
        async with engine_client(URL, transport=httpx.MockTransport(replying(
                open_now=open_now)), max_connections=limit) as engine:
            results = []

            async def one(i: int) -> None:
                results.append(await engine.generate(GenerateRequest([1, i], SamplingParams())))

            async with anyio.create_task_group() as tg:
                for i in range(100):
                    tg.start_soon(one, i)
            return results

    results = anyio.run(main)
    assert len(results) == 100 and all(r == RESULT for r in results)
    assert open_now == [0, limit]


def test_a_call_that_finds_every_connection_busy_too_long_was_not_sent():
    """Waiting for a connection is bounded by `EngineTimeouts.pool`; the call never left, so
    it is retried, then named."""
    gate = anyio.Event()

    async def main():
        with anyio.fail_after(10):
            await calls()

    async def calls():
        async with engine_client(URL, transport=httpx.MockTransport(replying(gate)),
                                 max_connections=1, retries=1, retry_backoff_s=0.0,
                                 timeouts=EngineTimeouts(pool=0.05)) as engine:
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.generate, GenerateRequest([1], SamplingParams()))
                await anyio.sleep(0.01)  # the first call holds the only connection
                try:
                    with pytest.raises(EngineError, match=r"cannot reach the embedded engine "
                                       r"at http://engine.test/stalewise/generate after 2 "
                                       r"attempts \(all 1 connections stayed busy for 0.05s\)"):
                        await engine.generate(GenerateRequest([2], SamplingParams()))
                finally:
                    gate.set()  # the first call then finishes

    anyio.run(main)


def test_a_client_needs_a_connection():
    with pytest.raises(ValueError, match="max_connections must be at least 1, got 0"):
        engine_client(URL, max_connections=0)


def sse(*events: dict) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def test_the_vllm_client_reads_a_streamed_completion():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 64}]})
        body = json.loads(request.content)
        assert body["prompt"] == [1, 2] and body["logprobs"] == 2 and body["stream"]
        chunks = [{"choices": [{"logprobs": {
                      "tokens": ["token_id:7"], "token_logprobs": [-0.25],
                      "top_logprobs": [{"token_id:7": -0.25, "token_id:3": -9999.0}]}}]},
                  {"choices": [{"logprobs": {
                      "tokens": ["token_id:8"], "token_logprobs": [-1.5],
                      "top_logprobs": [{"token_id:8": -1.5}]}, "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": 2,
                                            "prompt_tokens_details": {"cached_tokens": 1}}}]
        return httpx.Response(200, content=sse(*chunks),
                              headers={"content-type": "text/event-stream"})

    result = run("vllm", handler, lambda e: e.generate(
        GenerateRequest([1, 2], SamplingParams(max_tokens=2, logprobs_topk=2))),
        initial_version=6)
    tokens = result.tokens
    assert tokens.token_ids.tolist() == [7, 8] and result.finish_reason == "length"
    assert (result.prompt_tokens, result.cached_prompt_tokens) == (2, 1)
    assert tokens.weights_versions.tolist() == [6, 6] and tokens.kv_versions.tolist() == [6, 6]
    assert tokens.topk_ids.tolist() == [[7, 3], [8, -1]]
    assert np.isneginf(tokens.topk_logprobs[:, 1]).all()
    assert result.engine_id == "vllm@http://engine.test"


def test_a_vllm_request_names_itself_and_its_session_and_reads_vllms_chunks_back():
    """Each call has a request id of its own and, when the request has one, the trajectory's
    session; the chunks `completion_chunks` writes (what the benches' stand-ins for vLLM
    stream) read back as the tokens they were made of."""
    tokens = SampledTokens([7, 8, 9], [-0.25, -1.5, -0.125], [0, 0, 0], [0, 0, 0],
                           [0.0, 0.0, 0.0])
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 64}]})
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=sse(*completion_chunks(
            tokens, request_id=bodies[-1]["request_id"], model="tiny", finish_reason="stop",
            prompt_tokens=2, cached_prompt_tokens=1)),
            headers={"content-type": "text/event-stream"})

    prompts = ([1, 2], np.array([1, 2]), [np.int64(1), np.int32(2)])  # numpy ids written too

    async def calls(engine):
        return [await engine.generate(GenerateRequest(prompt, SamplingParams(max_tokens=3),
                                                      session_id=session))
                for prompt, session in zip(prompts, ("t/0", "t/0", None))]

    results = run("vllm", handler, calls, initial_version=3)
    assert [b.get("session_id") for b in bodies] == ["t/0", "t/0", None]
    assert len({b["request_id"] for b in bodies}) == 3
    assert [b["prompt"] for b in bodies] == [[1, 2]] * 3
    for result in results:
        assert result.tokens.token_ids.tolist() == [7, 8, 9]
        assert result.tokens.sampler_logprobs.tolist() == [-0.25, -1.5, -0.125]
        assert (result.finish_reason, result.prompt_tokens, result.cached_prompt_tokens) == (
            "stop", 2, 1)


def test_a_stand_ins_stream_splits_the_token_events_evenly_and_ends_with_usage_and_done():
    tokens = SampledTokens(list(range(10)), [-0.5] * 10, [0] * 10, [0] * 10, [0.0] * 10)
    args = dict(request_id="r", model="tiny", finish_reason="stop", prompt_tokens=4)
    parts = completion_stream(tokens, writes=4, **args)
    assert [part.count(b"data: ") for part in parts] == [2, 3, 2, 3, 2]
    assert parts[-1].endswith(b"data: [DONE]\n\n") and b'"completion_tokens":10' in parts[-1]
    events = [json.loads(line[len(b"data: "):]) for line in b"".join(parts).split(b"\n\n")
              if line.startswith(b"data: {")]
    assert events == completion_chunks(tokens, **args)
    assert len(completion_stream(tokens, writes=50, **args)) == 11  # one token per write


def test_every_engine_the_orchestrator_drives_keeps_the_one_client_contract():
    """`core.engine_api.EngineClient` is the contract of the pipeline's one engine: the HTTP
    clients of both kinds, the router over replicas, and the fakes tests inject."""
    from core.engine_api import EngineClient
    from orchestrator.engines.replicas import ReplicaRouter
    from orchestrator.engines.scripted import ScriptedEngine, ScriptedTurn
    from orchestrator.testing import CapacityEngine

    scripted = ScriptedEngine([ScriptedTurn((5,))])
    engines = [client(lambda r: httpx.Response(200)), client(lambda r: httpx.Response(200), "vllm"),
               scripted, CapacityEngine(scripted, slots=1, decode_s=0.0),
               ReplicaRouter([ScriptedEngine([ScriptedTurn((5,))]) for _ in range(2)])]
    for engine in engines:
        assert isinstance(engine, EngineClient), type(engine).__name__
    assert [e.kind for e in engines] == ["embedded", "vllm", "embedded", "embedded", "embedded"]
    assert [e.can_pin for e in engines] == [True, False, True, True, True]
    with pytest.raises(ValueError, match="of one kind"):
        ReplicaRouter([client(lambda r: httpx.Response(200)),
                       client(lambda r: httpx.Response(200), "vllm")])
