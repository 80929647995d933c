"""`vllm serve`'s streamed `/v1/completions`, read as stalewise per-token records.

`completion_body` asks for exactly what the agent loop needs: a token-id prompt, the sampled
tokens as ids (`return_tokens_as_token_ids`), their log-probs with an optional top-k, and the
usage block (prompt and cached-prompt token counts). It names the request (`request_id`, which
vLLM's logs and its reply ids carry) and the trajectory's session (`session_id`, which vLLM
puts on the KV-cache events it publishes). With a `stream_interval` above 1 it asks for that
many tokens per streamed event (vLLM 0.32 takes it per request and sends the first token
alone, the last with whatever is left: `stream_groups`); one JSON event per token is the
largest part of what a call costs the client.

`CompletionStream` collects the chunks of one request; `completion_chunks` writes the chunks
vLLM streams for given tokens, and `completion_stream` their bytes in a number of writes (for
servers that stand in for vLLM: benchmarks, tests). vLLM reports no versions or times, so they
are attributed as the client sees them (the rules are in `orchestrator.engines.vllm`): a token's
weights version is the client's version when the chunk arrived; its KV version is the version
at the request's start, raised by every `recompute` update since; its time offset is its
arrival time. No torch here.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import numpy as np
from pydantic_core import to_json

from core.engine_api import EngineError, GenerateRequest
from core.records import SampledTokens

VLLM_LOGPROB_FLOOR = -9999.0  # vLLM clamps -inf to this in JSON


def completion_body(request: GenerateRequest, model: str, ignore_eos: bool,
                    stream_interval: int = 1) -> dict:
    """The request's body; its prompt is the request's own list of ids, not a copy (write it
    with `pydantic_core.to_json(body, fallback=int)`, which writes numpy ints too)."""
    params = request.params
    extra = {"session_id": request.session_id} if request.session_id else {}
    if stream_interval > 1:  # left out at 1, vLLM's default, for versions without the field
        extra["stream_interval"] = stream_interval
    ids = request.prompt_token_ids
    prompt = (ids.tolist() if isinstance(ids, np.ndarray) else
              ids if isinstance(ids, (list, tuple)) else list(ids))
    return {"model": model, "request_id": secrets.token_hex(16), **extra, "prompt": prompt,
            "max_tokens": params.max_tokens, "min_tokens": params.min_tokens,
            "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1, "seed": params.seed,
            "stop_token_ids": list(params.stop_token_ids), "ignore_eos": ignore_eos,
            "logprobs": params.logprobs_topk, "return_tokens_as_token_ids": True,
            "skip_special_tokens": False, "stream": True,
            "stream_options": {"include_usage": True}}


def token_id(label: str) -> int:
    if not label.startswith("token_id:"):
        raise EngineError(f"vLLM returned token {label!r}; the client needs "
                          f"return_tokens_as_token_ids (vLLM >= 0.6.4)")
    return int(label.split(":", 1)[1])


class CompletionStream:
    """Collects streamed completion chunks into per-token arrays with client-side provenance."""

    def __init__(self, topk: int, start_version: int, log_start: int) -> None:
        self.topk = topk
        self.sent = time.monotonic()
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.weights: list[int] = []
        self.kvs: list[int] = []
        self.offsets: list[float] = []
        self.topk_ids: list[list[int]] = []
        self.topk_lps: list[list[float]] = []
        self.finish_reason: Any = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._kv, self._log_read = start_version, log_start

    def _kv_floor(self, update_log: list[tuple[int, str]]) -> int:
        """The version at the request's start, raised by every `recompute` update since (the
        log is read again only when it grew)."""
        if len(update_log) != self._log_read:
            for version, policy in update_log[self._log_read:]:
                if policy == "recompute":
                    self._kv = version
            self._log_read = len(update_log)
        return self._kv

    def add_chunk(self, chunk: dict, version: int, update_log: list[tuple[int, str]]) -> None:
        usage = chunk.get("usage")
        if usage:
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            self.cached_tokens = int(details.get("cached_tokens") or 0)
        for choice in chunk.get("choices") or []:
            block = choice.get("logprobs")
            if block:
                now = time.monotonic() - self.sent
                kv = min(self._kv_floor(update_log), version)
                labels, logprobs = block["tokens"], block["token_logprobs"]
                tops = block.get("top_logprobs") or [None] * len(labels)
                if not len(labels) == len(logprobs) == len(tops):  # zip would drop tokens
                    raise ValueError(f"a chunk with {len(labels)} tokens, {len(logprobs)} "
                                     f"log-probs and {len(tops)} top-k entries")
                for label, logprob, top in zip(labels, logprobs, tops):
                    self.ids.append(int(label[9:]) if label[:9] == "token_id:" else
                                    token_id(label))  # which raises, naming the label
                    self.logprobs.append(float(logprob))
                    self.weights.append(version)
                    self.kvs.append(kv)
                    self.offsets.append(now)
                    if self.topk:
                        self._add_top(top or {})
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]

    def _add_top(self, top: dict[str, float]) -> None:
        pairs = sorted(((float(lp), token_id(label)) for label, lp in top.items()),
                       key=lambda p: -p[0])[: self.topk]
        pairs += [(float("-inf"), -1)] * (self.topk - len(pairs))
        self.topk_ids.append([i for _, i in pairs])
        self.topk_lps.append([lp if lp > VLLM_LOGPROB_FLOOR else float("-inf") for lp, _ in pairs])

    def record(self) -> SampledTokens:
        extra = {}
        if self.topk:
            extra = dict(topk_ids=np.asarray(self.topk_ids, np.int32).reshape(-1, self.topk),
                         topk_logprobs=np.asarray(self.topk_lps, np.float32).reshape(-1, self.topk))
        return SampledTokens(self.ids, self.logprobs, self.weights, self.kvs, self.offsets, **extra)


def stream_groups(count: int, stream_interval: int = 1) -> list[range]:
    """Which of `count` sampled tokens each streamed event of vLLM carries: the first token
    alone, then every `stream_interval` tokens, and whatever is left with the last."""
    if count == 0:
        return []
    starts = [0, *range(1, count, max(1, stream_interval))]
    return [range(a, b) for a, b in zip(starts, [*starts[1:], count])]


def completion_chunks(tokens: SampledTokens, *, request_id: str, model: str,
                      finish_reason: str, prompt_tokens: int, cached_prompt_tokens: int = 0,
                      stream_interval: int = 1) -> list[dict]:
    """The chunks `vllm serve` streams for `tokens` of a request `completion_body` made with
    `logprobs = 0` (`return_tokens_as_token_ids`; grouped as `stream_groups` says), then the
    usage chunk (`stream_options.include_usage`): what `CompletionStream` reads."""
    head = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": 1780000000,
            "model": model}
    ids, logprobs = tokens.token_ids.tolist(), tokens.sampler_logprobs.tolist()
    chunks = []
    groups = stream_groups(len(ids), stream_interval)
    for group in groups:
        labels = [f"token_id:{ids[i]}" for i in group]
        chunks.append({**head, "choices": [{
            "index": 0, "text": "".join(f"t{ids[i]}" for i in group),
            "logprobs": {"text_offset": list(group),
                         "token_logprobs": [logprobs[i] for i in group], "tokens": labels,
                         "top_logprobs": [{label: logprobs[i]} for label, i in zip(labels, group)]},
            "finish_reason": finish_reason if group is groups[-1] else None,
            "stop_reason": None}],
            "usage": None})
    chunks.append({**head, "choices": [], "usage": {
        "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + len(tokens),
        "completion_tokens": len(tokens),
        "prompt_tokens_details": {"cached_tokens": cached_prompt_tokens}}})
    return chunks


def completion_stream(tokens: SampledTokens, *, writes: int, **chunk_args: Any) -> list[bytes]:
    """The server-sent events of `completion_chunks(tokens, **chunk_args)` as `vllm serve`
    writes them, in `writes` parts (fewer for fewer tokens) that split the token events evenly,
    then one more part: the usage event and `[DONE]`."""
    events = [b"data: " + to_json(chunk) + b"\n\n"
              for chunk in completion_chunks(tokens, **chunk_args)]
    token_events, usage = events[:-1], events[-1]
    parts = max(1, min(writes, len(token_events)))
    bounds = [len(token_events) * i // parts for i in range(parts + 1)]
    return ([b"".join(token_events[a:b]) for a, b in zip(bounds, bounds[1:])]
            + [usage + b"data: [DONE]\n\n"])
