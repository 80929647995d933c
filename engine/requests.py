"""Value types of the engine core: what a request asks for and what it gets back.

`SamplingSpec` is the engine-internal form of `core.engine_api.SamplingParams`: the same
fields plus greedy decoding (temperature 0, which the OpenAI-compatible route allows) and
`ignore_eos`. `EngineOutput` carries every field of `core.records.SampledTokens` as plain
lists, filled token by token by the engine thread and handed over once, when the request ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from core.engine_api import FinishReason, SamplingParams
from core.records import SampledTokens


class RequestError(ValueError):
    """A request the engine refuses as given (bad ids, too long, bad version); message says why."""


class EngineStopped(RuntimeError):
    """The engine shut down (or failed) before the request finished."""


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1.0 = off
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs_topk: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            problems.append(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                            f"got {self.min_tokens}")
        if self.logprobs_topk < 0:
            problems.append(f"logprobs_topk must be >= 0, got {self.logprobs_topk}")
        if problems:
            raise RequestError("; ".join(problems))

    @classmethod
    def from_params(cls, params: SamplingParams, *, ignore_eos: bool = False) -> SamplingSpec:
        return cls(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                   seed=params.seed, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
                   stop_token_ids=tuple(params.stop_token_ids),
                   logprobs_topk=params.logprobs_topk, ignore_eos=ignore_eos)


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token, as streamed to a listener while the request runs."""

    index: int
    token_id: int
    logprob: float
    weights_version: int
    kv_version: int
    time_offset: float
    topk_ids: list[int] | None
    topk_logprobs: list[float] | None


@dataclass
class EngineOutput:
    request_id: str
    prompt_tokens: int
    cached_prompt_tokens: int
    topk: int
    token_ids: list[int] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    weights_versions: list[int] = field(default_factory=list)
    kv_versions: list[int] = field(default_factory=list)
    time_offsets: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def to_record(self) -> SampledTokens:
        extra = {}
        if self.topk:
            extra = dict(topk_ids=np.asarray(self.topk_ids, dtype=np.int32).reshape(-1, self.topk),
                         topk_logprobs=np.asarray(self.topk_logprobs, dtype=np.float32)
                         .reshape(-1, self.topk))
        return SampledTokens(self.token_ids, self.sampler_logprobs, self.weights_versions,
                             self.kv_versions, self.time_offsets, **extra)
