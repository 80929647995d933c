"""The one path from model calls to training samples (core/samples.py).

Contract:
- a segment is the concatenation, in call order, of each call's prompt delta and sampled ids;
  the loss mask is True exactly on sampled ids, where the engine's arrays sit, and 0 / -1 / -1
  elsewhere; top-k is cut to the segment's smallest, -inf off the sampled positions;
- segments come out in segment order whatever the order of the calls, with each call's
  position in the list given and [start, stop) of its sampled ids;
- checked against the conversation's own ids, a sampled position that differs raises naming
  the positions, and so does a prompt position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from core.records import SampledTokens
from core.samples import segment_samples


@dataclass(frozen=True)
class Call:
    segment: int
    prompt_token_ids: np.ndarray
    tokens: SampledTokens


def _tokens(ids: list[int], version: int = 3, topk: int = 0) -> SampledTokens:
    n = len(ids)
    kw = {}
    if topk:
        kw = dict(topk_ids=np.tile(np.arange(topk), (n, 1)),
                  topk_logprobs=np.full((n, topk), -1.5))
    return SampledTokens(ids, np.full(n, -0.5), np.full(n, version), np.full(n, version - 1),
                         np.zeros(n), **kw)


def _call(segment: int, prompt: list[int], sampled: list[int], **kw) -> Call:
    return Call(segment, np.asarray(prompt, np.int32), _tokens(sampled, **kw))


def test_a_segment_is_its_prompt_deltas_and_sampled_ids_with_the_call_offsets():
    (segment,) = segment_samples([_call(0, [1, 2, 3], [7, 8], version=4),
                                  _call(0, [9], [5, 6, 4], version=5)])
    assert segment.index == 0 and segment.length == 9
    assert segment.token_ids.tolist() == [1, 2, 3, 7, 8, 9, 5, 6, 4]
    assert segment.loss_mask.astype(int).tolist() == [0, 0, 0, 1, 1, 0, 1, 1, 1]
    assert segment.sampler_logprobs.tolist() == [0, 0, 0, -0.5, -0.5, 0, -0.5, -0.5, -0.5]
    assert segment.weights_versions.tolist() == [-1, -1, -1, 4, 4, -1, 5, 5, 5]
    assert segment.kv_versions.tolist() == [-1, -1, -1, 3, 3, -1, 4, 4, 4]
    assert segment.calls == (0, 1) and segment.call_spans == ((3, 5), (6, 9))
    assert segment.num_sampled == 5 and segment.topk_ids is None
    with pytest.raises(ValueError):
        segment.token_ids[0] = 0


def test_segments_come_in_segment_order_with_each_calls_position():
    calls = [_call(1, [4, 4], [5]), _call(0, [1], [2]), _call(1, [6], [7]), _call(0, [3], [8])]
    first, second = segment_samples(calls)
    assert (first.index, first.calls, first.token_ids.tolist()) == (0, (1, 3), [1, 2, 3, 8])
    assert (second.index, second.calls, second.token_ids.tolist()) == (1, (0, 2), [4, 4, 5, 6, 7])
    assert second.call_spans == ((2, 3), (4, 5))


def test_topk_is_cut_to_the_smallest_and_minus_infinity_off_the_sampled_ids():
    (segment,) = segment_samples([_call(0, [1], [7, 8], topk=3), _call(0, [9], [5], topk=2),
                                  _call(0, [2], [])])  # an aborted call: no tokens, no top-k
    assert segment.topk_ids.shape == segment.topk_logprobs.shape == (6, 2)
    assert segment.topk_ids[1].tolist() == [0, 1]
    assert segment.topk_logprobs[4].tolist() == [-1.5] * 2
    assert np.isinf(segment.topk_logprobs[[0, 3, 5]]).all()
    assert segment.call_spans[-1] == (6, 6)


def test_the_conversations_ids_are_checked_position_by_position():
    calls = [_call(0, [1, 2], [7, 8]), _call(0, [9], [5])]
    segment_samples(calls, [[1, 2, 7, 8, 9, 5, 11, 12]])  # tokens after the last call: fine
    with pytest.raises(AssertionError, match=r"segment 0: positions 2:4 are not the engine's"):
        segment_samples(calls, [[1, 2, 7, 0, 9, 5]])
    with pytest.raises(AssertionError, match=r"segment 0: position 4 is not the prompt's token"):
        segment_samples(calls, [[1, 2, 7, 8, 0, 5]])
    with pytest.raises(AssertionError, match=r"positions 5:6 are not the engine's sampled ids"):
        segment_samples(calls, [[1, 2, 7, 8, 9]])
