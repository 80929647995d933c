"""How many sampled tokens vLLM streams per event to a job's client (`[engine] stream_interval`).

Contracts: a job on vLLM asks for 16 tokens per event unless it says otherwise, and for one in
an `inflight` pipeline, whose weight swaps may fall inside a call (a larger interval there is a
config error, as is the setting on the embedded engine); the client sends the interval (and
leaves it out at 1, vLLM's default), reads grouped events back as exactly the tokens they
carry, stamps a group's tokens with the one arrival they had, and refuses an `inflight` update
it could not attribute. The real vLLM's grouping is checked in tests/engine/test_vllm_backend.py.
"""

from __future__ import annotations

import json
from itertools import groupby

import anyio
import httpx
import pytest

from config.errors import ConfigError
from config.job import parse_config
from core.engine_api import EngineError, GenerateRequest, SamplingParams
from core.records import SampledTokens
from orchestrator.engines.embedded import engine_client
from orchestrator.engines.fleet import EngineFleet
from orchestrator.engines.vllm_stream import completion_chunks, stream_groups

URL = "http://vllm.test"
TOKENS = SampledTokens(list(range(40, 80)), [-(i + 1) / 64 for i in range(40)], [0] * 40,
                       [0] * 40, [0.0] * 40)


def vllm_job(**engine) -> dict:
    return {"engine": {"kind": "vllm", "url": URL, **engine}}


def test_a_vllm_job_streams_16_tokens_per_event_and_one_when_swaps_fall_inside_calls():
    assert parse_config(vllm_job()).engine_stream_interval() == 16
    assert parse_config({**vllm_job(), "pipeline": {"mode": "sync"}}).engine_stream_interval() == 16
    inflight = {**vllm_job(), "pipeline": {"mode": "inflight"}}
    assert parse_config(inflight).engine_stream_interval() == 1
    assert parse_config(vllm_job(stream_interval=4)).engine_stream_interval() == 4
    assert parse_config({}).engine_stream_interval() == 1  # the embedded engine: no stream
    assert parse_config({**vllm_job(stream_interval=1),
                         "pipeline": {"mode": "inflight"}}).engine_stream_interval() == 1
    # the fleet hands the resolved interval to the job's client
    client = EngineFleet(parse_config(vllm_job()).engine.model_copy(
        update={"stream_interval": 16}), version=0).client()
    assert client.stream_interval == 16


@pytest.mark.parametrize("config, words", [
    ({**vllm_job(stream_interval=8), "pipeline": {"mode": "inflight"}},
     ["engine.stream_interval = 8", "pipeline.mode = 'inflight'", "engine.stream_interval = 1"]),
    ({"engine": {"stream_interval": 8}},
     ["engine.kind = 'embedded'", "remove engine.stream_interval"]),
    (vllm_job(stream_interval=0), ["stream_interval", "greater than or equal to 1"]),
], ids=["inflight", "embedded", "zero"])
def test_a_stream_interval_that_cannot_work_is_a_config_error_saying_what_to_set(config, words):
    with pytest.raises(ConfigError) as caught:
        parse_config(config)
    for word in words:
        assert word in str(caught.value)


@pytest.mark.parametrize("count, interval, sizes", [
    (1, 16, [1]), (2, 16, [1, 1]), (17, 16, [1, 16]), (18, 16, [1, 16, 1]),
    (42, 16, [1, 16, 16, 9]), (3, 1, [1, 1, 1]), (0, 16, [])])
def test_vllm_sends_the_first_token_alone_then_every_interval_and_the_rest_with_the_last(
        count, interval, sizes):
    groups = stream_groups(count, interval)
    assert [len(g) for g in groups] == sizes
    assert [i for g in groups for i in g] == list(range(count))


class GroupedServer:
    """vLLM's streamed completion of `TOKENS` at the interval each request asks for, one event
    per write, with a pause between writes (so each event arrives at its own time)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 999}]})
        if request.url.path != "/v1/completions":
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        self.bodies.append(body)
        chunks = completion_chunks(TOKENS, request_id=body["request_id"], model="tiny",
                                   finish_reason="length", prompt_tokens=2,
                                   stream_interval=body.get("stream_interval", 1))

        async def events():
            for chunk in chunks:
                await anyio.sleep(0.002)
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=events(),
                              headers={"content-type": "text/event-stream"})


def generate(server: GroupedServer, interval: int):
    async def main():
        async with engine_client(URL, kind="vllm", stream_interval=interval,
                                 transport=httpx.MockTransport(server.handle)) as engine:
            return await engine.generate(GenerateRequest([1, 2], SamplingParams(max_tokens=40)))
    return anyio.run(main)


def test_the_client_asks_for_the_interval_and_reads_the_groups_back_exactly():
    server = GroupedServer()
    grouped, single = generate(server, 16), generate(server, 1)
    assert server.bodies[0]["stream_interval"] == 16
    assert "stream_interval" not in server.bodies[1]  # vLLM's default, for any version of it
    for result in (grouped, single):
        assert result.tokens.token_ids.tolist() == TOKENS.token_ids.tolist()
        assert result.tokens.sampler_logprobs.tolist() == TOKENS.sampler_logprobs.tolist()
        assert (result.finish_reason, result.prompt_tokens) == ("length", 2)
    # a token's time is its event's arrival: 4 distinct times in groups of 1, 16, 16, 7
    offsets = grouped.tokens.time_offsets.tolist()
    assert [len(list(same)) for _, same in groupby(offsets)] == [1, 16, 16, 7]
    assert len(set(single.tokens.time_offsets.tolist())) == 40


def test_a_client_streaming_groups_refuses_an_inflight_update_and_takes_a_drain():
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(200, json={})

    async def update(interval: int, mode: str):
        async with engine_client(URL, kind="vllm", stream_interval=interval,
                                 transport=httpx.MockTransport(handler)) as engine:
            return await engine.update_weights("/ckpt/v1", 1, mode=mode)

    with pytest.raises(EngineError, match="stream_interval 1, not 16"):
        anyio.run(update, 16, "inflight")
    assert calls == []  # refused before vLLM was paused
    assert anyio.run(update, 16, "drain").version == 1
    assert anyio.run(update, 1, "inflight").version == 1
    assert calls.count("/pause") == 2 and calls.count("/resume") == 2


def test_a_grouped_chunk_whose_lists_disagree_is_refused_not_cut_to_the_shortest():
    """Tokens, log-probs and top-k entries of one event come in lists of one length; a chunk
    where they differ is malformed (zipping them would silently drop tokens)."""
    chunk = {"choices": [{"logprobs": {"tokens": ["token_id:7", "token_id:8"],
                                       "token_logprobs": [-0.5],
                                       "top_logprobs": [{"token_id:7": -0.5}] * 2},
                          "finish_reason": "length"}]}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 999}]})
        return httpx.Response(200, content=b"data: " + json.dumps(chunk).encode()
                              + b"\n\ndata: [DONE]\n\n",
                              headers={"content-type": "text/event-stream"})

    async def main():
        async with engine_client(URL, kind="vllm", stream_interval=16,
                                 transport=httpx.MockTransport(handler)) as engine:
            await engine.generate(GenerateRequest([1, 2], SamplingParams(max_tokens=2)))

    with pytest.raises(EngineError, match=r"malformed stream chunk .*2 tokens, 1 log-probs "
                                          r"and 2 top-k entries"):
        anyio.run(main)
