"""The inference-engine boundary: token ids in, sampled tokens with provenance out.

Every engine (the embedded CPU engine, vLLM through the same HTTP client, the scripted fake in
tests) satisfies `InferenceEngine`. The agent loop sends the whole context as token ids on every
turn, tagged with a session id; an engine that keeps a per-session KV cache prefills only what
is new and reports how many prompt tokens it found cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field

from stalewise.records import SampledTokens

FinishReason = Literal["stop", "length", "abort"]


class SamplingParams(BaseModel):
    """Sampling settings of one request; the processed distribution is what log-probs describe.

    Processing order: logits / temperature, then top-k, then top-p (nucleus over the top-k
    survivors), renormalised. `top_k = 0` and `top_p = 1.0` switch those filters off.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(1.0, gt=0.0, description="softmax temperature (> 0)")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass; 1.0 = off")
    seed: int | None = Field(None, description="per-request sampling seed")
    max_tokens: int = Field(256, ge=1, description="tokens to sample at most")
    min_tokens: int = Field(0, ge=0, description="stop tokens are suppressed before this many")
    stop_token_ids: tuple[int, ...] = Field((), description="sampling one of these ends the call")
    logprobs_topk: int = Field(0, ge=0, description="record the sampler's top-k ids/log-probs")


@dataclass(frozen=True)
class GenerateRequest:
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    session_id: str | None = None
    # Serve this request with the weights of that version (the trajectory's pinned version);
    # None = the current version. Only engines that keep several versions resident honour it.
    weights_version: int | None = None


@dataclass(frozen=True)
class GenerateResult:
    tokens: SampledTokens
    finish_reason: FinishReason
    prompt_tokens: int
    cached_prompt_tokens: int
    engine_id: str


class EngineError(Exception):
    """The engine could not serve a request (unreachable, overloaded, aborted, bad reply)."""


class InferenceEngine(Protocol):
    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    async def release_session(self, session_id: str) -> None:
        """Forget a session's retained KV cache (the trajectory ended)."""
        ...
