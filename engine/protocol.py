"""Wire schemas of the engine's HTTP API (validated request bodies; documented in docs/engine.md).

Two families:

- vLLM/OpenAI-compatible: `/v1/completions` (token-id or text prompts, `logprobs`,
  `return_tokens_as_token_ids`, `min_tokens`, `stop_token_ids`, `seed`, `top_k`, `ignore_eos`,
  `stream`), plus vLLM's development routes `/pause`, `/resume`, `/is_paused`,
  `/reset_prefix_cache` and `/collective_rpc` (for the stalewise worker-extension methods only).
- stalewise: `/stalewise/generate` returns every field of `stalewise.records.SampledTokens`,
  arrays as base64 of little-endian int32/float32 (exact, compact, and -inf survives), with an
  optional `weights_version` that pins the request (and its session) to a resident version;
  `/stalewise/update_weights`, `/stalewise/abort`, `/stalewise/release_session`,
  `/stalewise/metrics`, `/stalewise/info`.

Fields the engine does not implement are refused with a message that names them, not ignored.
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from stalewise.engine_api import SamplingParams
from stalewise.records import FLOAT32, INT32, SampledTokens, pack

ARRAY_ENCODING = "base64-le"


def b64(array: np.ndarray | list, dtype: np.dtype) -> str:
    return base64.b64encode(pack(array, dtype)).decode("ascii")


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int] = Field(min_length=1)
    params: SamplingParams = Field(default_factory=SamplingParams)
    session_id: str | None = None
    request_id: str | None = None
    ignore_eos: bool = False
    weights_version: int | None = Field(
        None, ge=0, description="serve with this resident weights version (pins the session "
                                "until release); None = the current version")


def generate_reply(*, request_id: str, engine_id: str, finish_reason: str, prompt_tokens: int,
                   cached_prompt_tokens: int, tokens: SampledTokens) -> dict:
    topk = tokens.topk
    return {
        "request_id": request_id,
        "engine_id": engine_id,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached_prompt_tokens,
        "encoding": ARRAY_ENCODING,
        "length": len(tokens),
        "topk": topk,
        "token_ids": b64(tokens.token_ids, INT32),
        "sampler_logprobs": b64(tokens.sampler_logprobs, FLOAT32),
        "weights_versions": b64(tokens.weights_versions, INT32),
        "kv_versions": b64(tokens.kv_versions, INT32),
        "time_offsets": b64(tokens.time_offsets, FLOAT32),
        "topk_ids": b64(tokens.topk_ids, INT32) if topk else None,
        "topk_logprobs": b64(tokens.topk_logprobs, FLOAT32) if topk else None,
    }


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="HF checkpoint directory written by the learner")
    version: int = Field(ge=0, description="policy version of these weights")
    mode: Literal["inflight", "drain", "pin"] = "inflight"
    kv: Literal["retain", "recompute"] = "recompute"


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str | None = Field(None, description="request to abort; omit with all=true")
    all: bool = False


class ReleaseSessionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class CompletionBody(BaseModel):
    """The subset of vLLM's completion request the embedded engine serves."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off")
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0)
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    best_of: int | None = None
    echo: bool = False
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    session_id: str | None = Field(None, description="stalewise extension: retain KV per session")

    def unsupported(self) -> list[str]:
        """Requested features the embedded engine does not implement."""
        problems = []
        if self.n != 1 or (self.best_of or 1) != 1:
            problems.append("n/best_of must be 1 (send one request per sample)")
        if self.echo:
            problems.append("echo is not supported")
        if self.stop:
            problems.append("stop strings are not supported; use stop_token_ids")
        if self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0:
            problems.append("presence/frequency/repetition penalties are not supported")
        if self.logit_bias:
            problems.append("logit_bias is not supported")
        if self.suffix:
            problems.append("suffix is not supported")
        return problems
