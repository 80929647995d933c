"""One path from a trajectory's model calls to its training samples.

Every model call gives the tokens its chat segment gained since the segment's previous call
(`prompt_token_ids`; the whole prompt on a segment's first call) and the tokens it sampled
(`SampledTokens`). `segment_samples` lays each segment out as the model saw it: the
concatenation, in call order, of each call's prompt delta and sampled tokens. The learner builds
its training samples from it, the trainer-log-prob write-back splits a sample back into its
calls with the offsets kept here, and the orchestrator takes a finished trajectory's numbers from
it. Both sides give their own records (the agent loop's in memory, the store's decoded rows):
anything with `segment`, `prompt_token_ids` and `tokens` will do.

Guarantees:
- one `SegmentSample` per segment that has calls, in segment order, the calls of a segment in
  the order given; every array has length T (top-k: (T, K)) and is read-only;
- `loss_mask` is True exactly on sampled tokens; there the sampler log-probs, versions and top-k
  are the engine's, elsewhere 0, -1, -1 and (id 0, log-prob -inf);
- K is the smallest top-k among the segment's calls that sampled tokens (0: no top-k), each
  call's top-k cut to it;
- `call_spans[j]` is [start, stop) of the segment's j-th call's sampled tokens and `calls[j]`
  that call's position in the list given;
- given the conversation's own ids per segment (`conversation`), every position must hold them,
  so the sampled positions hold exactly the engine's ids: a mismatch raises naming the segment
  and the positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from core.records import FLOAT32, INT32, SampledTokens


class ModelCallTokens(Protocol):
    """What a model call gives the one path (`ModelCallRecord`, `StoredModelCall`)."""

    @property
    def segment(self) -> int: ...

    @property
    def prompt_token_ids(self) -> np.ndarray: ...

    @property
    def tokens(self) -> SampledTokens: ...


@dataclass(frozen=True, eq=False)
class SegmentSample:
    """One segment of a trajectory as the model saw it, aligned to token positions.

    token_ids (T,) int32           prompt deltas and sampled tokens, in call order
    loss_mask (T,) bool            True exactly on sampled tokens
    sampler_logprobs (T,) float32  the engine's log mu of each sampled token, 0 elsewhere
    weights_versions (T,) int32    weights version that sampled each token, -1 elsewhere
    kv_versions (T,) int32         oldest KV version each sampled token attended to, -1 elsewhere
    calls, call_spans              each call's position in the list given, and [start, stop)
    topk_ids / topk_logprobs       (T, K) the sampler's top-k, or None when K is 0
    """

    index: int
    token_ids: np.ndarray
    loss_mask: np.ndarray
    sampler_logprobs: np.ndarray
    weights_versions: np.ndarray
    kv_versions: np.ndarray
    calls: tuple[int, ...]
    call_spans: tuple[tuple[int, int], ...]
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None

    def __post_init__(self) -> None:
        length = len(self.token_ids)
        for name in ("loss_mask", "sampler_logprobs", "weights_versions", "kv_versions"):
            if getattr(self, name).shape != (length,):
                raise ValueError(f"SegmentSample.{name} must have shape ({length},)")
        if len(self.calls) != len(self.call_spans):
            raise ValueError(f"SegmentSample: {len(self.calls)} calls for "
                             f"{len(self.call_spans)} spans")
        for name in ("token_ids", "loss_mask", "sampler_logprobs", "weights_versions",
                     "kv_versions", "topk_ids", "topk_logprobs"):
            array = getattr(self, name)
            if array is not None:
                array.setflags(write=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def num_sampled(self) -> int:
        return int(self.loss_mask.sum())


def segment_samples(calls: Sequence[ModelCallTokens],
                    conversation: Sequence[Sequence[int]] | None = None
                    ) -> tuple[SegmentSample, ...]:
    """The samples of a trajectory's `calls` (see the module docstring); `conversation[i]`, when
    given, is segment i's ids as the conversation holds them (longer is fine: tokens after the
    last call were never part of one)."""
    positions: dict[int, list[int]] = {}
    for position, call in enumerate(calls):
        positions.setdefault(call.segment, []).append(position)
    samples = []
    for index, members in sorted(positions.items()):
        sample = _segment(index, [calls[p] for p in members], tuple(members))
        if conversation is not None:
            _check(sample, conversation[index])
        samples.append(sample)
    return tuple(samples)


def _segment(index: int, calls: Sequence[ModelCallTokens],
             positions: tuple[int, ...]) -> SegmentSample:
    pieces, spans, end = [], [], 0
    for call in calls:
        prompt = np.asarray(call.prompt_token_ids, INT32).reshape(-1)
        pieces += [prompt, call.tokens.token_ids]
        start = end + len(prompt)
        end = start + len(call.tokens)
        spans.append((start, end))
    ids = np.concatenate(pieces) if pieces else np.zeros(0, INT32)
    sampled = np.zeros(end, bool)
    for start, stop in spans:
        sampled[start:stop] = True
    logprobs = np.zeros(end, FLOAT32)
    weights = np.full(end, -1, INT32)
    kv = np.full(end, -1, INT32)
    if calls:
        logprobs[sampled] = _joined(calls, "sampler_logprobs")
        weights[sampled] = _joined(calls, "weights_versions")
        kv[sampled] = _joined(calls, "kv_versions")
    k = min((c.tokens.topk for c in calls if len(c.tokens)), default=0)
    topk_ids = topk_lp = None
    if k:
        topk_ids = np.zeros((end, k), INT32)
        topk_lp = np.full((end, k), -np.inf, FLOAT32)
        for (start, stop), call in zip(spans, calls):
            if stop > start:
                topk_ids[start:stop] = call.tokens.topk_ids[:, :k]
                topk_lp[start:stop] = call.tokens.topk_logprobs[:, :k]
    return SegmentSample(index, ids, sampled, logprobs, weights, kv, positions, tuple(spans),
                         topk_ids, topk_lp)


def _joined(calls: Sequence[ModelCallTokens], name: str) -> np.ndarray:
    return np.concatenate([getattr(call.tokens, name) for call in calls])


def _check(sample: SegmentSample, conversation: Sequence[int]) -> None:
    held = np.asarray(conversation[:sample.length], INT32)
    if len(held) == sample.length and np.array_equal(held, sample.token_ids):
        return
    for start, stop in sample.call_spans:
        if not np.array_equal(held[start:stop], sample.token_ids[start:stop]):
            raise AssertionError(f"segment {sample.index}: positions {start}:{stop} are not the "
                                 "engine's sampled ids")
    if len(held) < sample.length:
        raise AssertionError(f"segment {sample.index}: the conversation holds {len(held)} "
                             f"tokens, the calls {sample.length}")
    first = int(np.flatnonzero(held != sample.token_ids)[0])
    raise AssertionError(f"segment {sample.index}: position {first} is not the prompt's token")
