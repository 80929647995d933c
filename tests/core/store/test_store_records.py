"""Per-token arrays round-trip exactly through the store, and bad records are refused."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.records import FLOAT32, INT32, SampledTokens, pack, unpack
from core.store.store import Store, model_call_row


def _tokens(rng: np.random.Generator, length: int, topk: int) -> SampledTokens:
    kw = {}
    if topk:
        kw = dict(topk_ids=rng.integers(0, 2**31 - 1, (length, topk)),
                  topk_logprobs=rng.standard_normal((length, topk)).astype(np.float32))
    return SampledTokens(rng.integers(-2**31, 2**31 - 1, length),
                         rng.standard_normal(length).astype(np.float32),
                         rng.integers(0, 1000, length), rng.integers(0, 1000, length),
                         rng.random(length).astype(np.float32), **kw)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), max_size=300))
def test_pack_round_trip_is_exact(values):
    assert np.array_equal(unpack(pack(values, FLOAT32), FLOAT32), np.asarray(values, FLOAT32))


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_model_calls_round_trip(backend, request):
    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    store = Store.open(url, create=True)
    store.create_run("r", name="r", config={}, pipeline_mode="sync")
    trajectory = store.create_trajectory("r", group_id=None, task_instance_id=None)
    rng = np.random.default_rng(0)
    written = [(_tokens(rng, n, k), rng.integers(0, 100, p)) for n, k, p in
               [(0, 0, 5), (1, 8, 0), (37, 0, 3), (200, 8, 40)]]
    stamp = time.time()
    store.insert_model_calls([model_call_row(
        trajectory_id=trajectory, turn=i, segment=0, context_len=10 * i, prompt_token_ids=prompt,
        tokens=tokens, sampling={"temperature": 0.7}, engine_id="e", finish_reason="stop",
        cached_prompt_tokens=i, started_at=stamp, finished_at=stamp + 1)
        for i, (tokens, prompt) in enumerate(written)])
    read = store.model_calls(trajectory)
    assert [c.turn for c in read] == [0, 1, 2, 3]
    for call, (tokens, prompt) in zip(read, written):
        assert call.tokens == tokens
        assert np.array_equal(call.prompt_token_ids, prompt.astype(INT32))
        assert call.sampling == {"temperature": 0.7}
    store.close()


def test_record_lengths_are_checked():
    with pytest.raises(ValueError, match="sampler_logprobs has shape"):
        SampledTokens([1, 2, 3], [0.0, 0.0], [0, 0, 0], [0, 0, 0], [0, 0, 0])
    with pytest.raises(ValueError, match="given together"):
        SampledTokens([1], [0.0], [0], [0], [0.0], topk_ids=[[1, 2]])


def test_a_record_of_no_tokens_keeps_its_top_k_width():
    """An engine request aborted before its first token still has a top-k width."""
    assert SampledTokens.empty(topk=3).topk == 3
    tokens = SampledTokens([], [], [], [], [], topk_ids=np.zeros((0, 2)),
                           topk_logprobs=np.zeros((0, 2)))
    assert tokens.topk_ids.shape == (0, 2) and len(tokens) == 0
    with pytest.raises(ValueError, match="topk_ids has 2 rows, expected 1"):
        SampledTokens([1], [0.0], [0], [0], [0.0], topk_ids=np.zeros((2, 2)),
                      topk_logprobs=np.zeros((2, 2)))
