"""The engine wire protocol shared by server and client (`core.engine_api`).

Contracts: a generate reply round-trips exactly through JSON (ids, float32 log-probs with -inf
in the top-k, weights and KV versions, time offsets, counts, finish reason); a reply that is
malformed in any one field is an `EngineError` whose message names that field; update replies
decode into their schema and refuse a bad mode by name.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from pydantic import ValidationError

from core.engine_api import (
    EngineError,
    GenerateBody,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    UpdateWeightsReply,
    bad_logprobs,
    decode_generate_reply,
    decode_reply,
    encode_generate_reply,
)
from core.records import SampledTokens

NEG_INF = float("-inf")


def result(topk: int = 3) -> GenerateResult:
    extra = {}
    if topk:
        extra = dict(topk_ids=[[7, 8, -1], [9, 4, 5]],
                     topk_logprobs=[[-0.1, -2.5, NEG_INF], [-1e-7, -3.25, NEG_INF]])
    tokens = SampledTokens([7, 2**31 - 1], [np.float32(-0.1), np.float32(-1e-7)], [3, 4],
                           [2, 4], [np.float32(0.001), np.float32(1234.5678)], **extra)
    return GenerateResult(tokens=tokens, finish_reason="stop", prompt_tokens=11,
                          cached_prompt_tokens=5, engine_id="stalewise-abc")


def wire(payload: dict) -> dict:
    return json.loads(json.dumps(payload))  # what really crosses HTTP


@pytest.mark.parametrize("topk", [3, 0])
def test_a_generate_reply_round_trips_exactly(topk):
    sent = result(topk)
    got = decode_generate_reply(wire(encode_generate_reply(sent, request_id="r1")))
    assert got == sent  # every field; SampledTokens compares arrays exactly
    assert got.tokens.topk == topk and got.tokens.token_ids.dtype == np.dtype("<i4")
    if topk:
        assert np.isneginf(got.tokens.topk_logprobs[:, 2]).all()
        assert got.tokens.topk_logprobs.dtype == np.dtype("<f4")
    assert got.tokens.sampler_logprobs.tobytes() == sent.tokens.sampler_logprobs.tobytes()
    assert got.tokens.time_offsets.tobytes() == sent.tokens.time_offsets.tobytes()


def test_only_nan_and_plus_inf_log_probs_are_bad_and_the_first_is_named():
    tokens = result().tokens
    assert bad_logprobs(tokens) is None  # -inf in a top-k slot is a filtered token
    assert bad_logprobs(SampledTokens([], [], [], [], [])) is None
    sampled = dataclasses.replace(tokens, sampler_logprobs=[-0.5, np.inf])
    assert bad_logprobs(sampled) == ("sampler_logprobs", "inf at token 1 (1 of 2 such values); "
                                     "a log-probability is a number <= 0 or -inf")
    topk = dataclasses.replace(tokens, topk_logprobs=[[-0.1, np.inf, NEG_INF],
                                                      [-1e-7, -3.25, np.nan]])
    assert bad_logprobs(topk) == ("topk_logprobs", "inf at token 0, slot 1 (2 of 6 such "
                                  "values); a log-probability is a number <= 0 or -inf")


def test_an_empty_reply_round_trips():
    sent = GenerateResult(SampledTokens.empty(2), "abort", 4, 0, "e")
    assert decode_generate_reply(wire(encode_generate_reply(sent, request_id="r"))) == sent


def _broken(**change) -> dict:
    payload = wire(encode_generate_reply(result(), request_id="r1"))
    for key, value in change.items():
        if value is None:
            del payload[key]
        else:
            payload[key] = value
    return payload


@pytest.mark.parametrize("change, field, why", [
    (dict(token_ids=None), "token_ids", "Field required"),
    (dict(sampler_logprobs="%%%"), "sampler_logprobs", "not base64"),
    (dict(length=3), "token_ids", "8 bytes, expected 3 x 4"),
    (dict(kv_versions="AAAAAA=="), "kv_versions", "4 bytes, expected 2 x 4"),
    (dict(topk_ids=None), "topk_ids", "missing (topk is 3)"),
    (dict(topk=0), "topk_ids", "top-k arrays sent with topk 0"),
    (dict(topk=2), "topk_ids", "24 bytes, expected 4 x 4"),
    (dict(encoding="base64-be"), "encoding", "Input should be 'base64-le'"),
    (dict(finish_reason="done"), "finish_reason", "Input should be 'stop', 'length' or 'abort'"),
    (dict(prompt_tokens=-1), "prompt_tokens", "greater than or equal to 0"),
    (dict(engine_id=[1]), "engine_id", "valid string"),
])
def test_a_malformed_generate_reply_is_an_engine_error_naming_the_field(change, field, why):
    with pytest.raises(EngineError) as info:
        decode_generate_reply(_broken(**change), source="the stalewise engine at X")
    message = str(info.value)
    assert message.startswith("the stalewise engine at X sent a malformed generate reply: ")
    assert f"field {field!r}" in message and why in message, message


def test_a_reply_that_is_not_an_object_is_refused():
    with pytest.raises(EngineError, match="malformed generate reply"):
        decode_generate_reply(["not", "a", "reply"])


def test_update_replies_decode_and_refuse_an_unknown_mode():
    payload = dict(version=3, previous_version=2, path="/ckpt", mode="pin", kv="retain",
                   wait_s=0.5, pause_s=0.01, in_flight_sequences=4, recomputed_tokens=0,
                   invalidated_sessions=0, resident_versions=[2, 3], evicted_versions=[],
                   added_by_a_newer_engine=True)
    reply = decode_reply(UpdateWeightsReply, payload)
    assert (reply.version, reply.mode, reply.resident_versions) == (3, "pin", (2, 3))
    with pytest.raises(EngineError, match=r"malformed update_weights reply: field 'mode': "
                                          r"Input should be 'inflight', 'drain' or 'pin'"):
        decode_reply(UpdateWeightsReply, payload | {"mode": "later"})


def test_a_generate_body_carries_the_request_and_refuses_an_empty_prompt():
    params = SamplingParams(max_tokens=4, stop_token_ids=(2,))
    body = GenerateBody.of(GenerateRequest(np.array([5, 6], np.int64), params, "s", 1),
                           request_id="r", ignore_eos=True)
    assert GenerateBody.model_validate(wire(body.model_dump(mode="json"))) == body
    assert body.prompt_token_ids == [5, 6] and body.weights_version == 1
    with pytest.raises(EngineError, match="field 'prompt_token_ids'"):
        GenerateBody.of(GenerateRequest([], params), request_id="r", ignore_eos=False)
    with pytest.raises(EngineError, match="field 'prompt_token_ids.1'"):  # not truncated
        GenerateBody.of(GenerateRequest([5, 6.5], params), request_id="r", ignore_eos=False)
    # the engine client writes the body with pydantic's serialiser: the JSON json.dumps gives
    assert json.loads(body.model_dump_json()) == body.model_dump(mode="json")
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(temperature=float("inf"))
