"""A scripted inference engine: replays given assistant turns as sampled tokens.

It satisfies `stalewise.engine_api.InferenceEngine` and behaves like a real engine where the
agent loop can tell: it honours `max_tokens` (cut, finish "length") and `stop_token_ids` (cut
after the first stop id, finish "stop"), reports cached prompt tokens for a session whose new
prompt extends its previous context, stamps every token with the current weights version and a
KV version (`kv_mode="retain"` keeps the version of the session's oldest KV entry across
updates; `"recompute"` uses the current one), and gives plausible sampler log-probs (and top-k)
drawn from a seeded generator (a window of a fixed table of exponential draws, so a call costs
the same whatever its length). Optional simulated latency (prefill per new prompt token, decode
per token, lognormal jitter) really sleeps, so benchmarks see concurrency. Optional malformed
outputs drop the token before the final stop token (for a tool call, its closing tag).

Scripts are looked up per trajectory: calls are counted per key, the session id up to its last
'/' (the agent loop names sessions `trajectory_id/segment`). Every request is kept in `requests`
for tests to inspect; benchmarks with many long trajectories pass `keep_requests=False`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import anyio
import numpy as np

from stalewise.engine_api import EngineError, FinishReason, GenerateRequest, GenerateResult
from stalewise.records import FLOAT32, INT32, SampledTokens


@dataclass(frozen=True)
class ScriptedTurn:
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None  # None: "stop" if a stop id ends it, else "length"
    error: Exception | None = None  # raised instead of answering
    delay_s: float | None = None  # overrides the latency model for this call


@dataclass(frozen=True)
class LatencyModel:
    fixed_s: float = 0.0
    prefill_s_per_token: float = 0.0  # per uncached prompt token
    decode_s_per_token: float = 0.0
    jitter_sigma: float = 0.0  # lognormal multiplier on the whole call


Script = Mapping[str, Sequence[ScriptedTurn]] | Callable[[str, int], ScriptedTurn]

# Sampler log-probs are windows of this table: -Exp(rate 3) draws, as plausible as a fresh draw.
_LOGPROBS = (-np.random.default_rng(20240601).exponential(1 / 3.0, 4096)).astype(FLOAT32)


def turns_from_texts(encode_assistant: Callable[[str], list[int]],
                     texts: Sequence[str]) -> list[ScriptedTurn]:
    """Scripted turns from assistant texts, e.g. with `chat_format.encode_assistant`."""
    return [ScriptedTurn(tuple(encode_assistant(text))) for text in texts]


def script_key(session_id: str | None) -> str:
    if not session_id:
        return ""
    return session_id.rsplit("/", 1)[0]


class ScriptedEngine:
    def __init__(self, script: Script | Sequence[ScriptedTurn], *, engine_id: str = "scripted",
                 version: int = 0, kv_mode: Literal["retain", "recompute"] = "recompute",
                 latency: LatencyModel | None = None, malformed_rate: float = 0.0,
                 seed: int = 0, topk: int = 0, vocab_size: int = 1024,
                 keep_requests: bool = True) -> None:
        if isinstance(script, Sequence):
            turns = list(script)
            self._script: Callable[[str, int], ScriptedTurn] = _from_list(turns)
        elif isinstance(script, Mapping):
            self._script = _from_mapping(script)
        else:
            self._script = script
        self.engine_id = engine_id
        self.version = version
        self.kv_mode = kv_mode
        self.latency = latency or LatencyModel()
        self.malformed_rate = malformed_rate
        self.seed, self.topk, self.vocab_size = seed, topk, vocab_size
        self.keep_requests = keep_requests
        self.requests: list[GenerateRequest] = []
        self.released: list[str] = []
        self._calls: dict[str, int] = {}
        self._contexts: dict[str, list[int]] = {}
        self._kv_version: dict[str, int] = {}

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.keep_requests:
            self.requests.append(request)
        key = script_key(request.session_id)
        index = self._calls.get(key, 0)
        self._calls[key] = index + 1
        rng = random.Random(f"{self.seed}:{key}:{index}")
        turn = self._script(key, index)
        prompt = list(request.prompt_token_ids)
        cached = self._cached(request.session_id, prompt)
        ids, finish = self._cut(turn, request, rng)
        delay, offsets = self._timing(turn, len(prompt) - cached, len(ids), rng)
        if delay > 0:
            await anyio.sleep(delay)
        if turn.error is not None:
            raise turn.error
        tokens = self._tokens(ids, offsets, request, rng)
        if request.session_id:
            self._contexts[request.session_id] = prompt + ids
        return GenerateResult(tokens=tokens, finish_reason=finish, prompt_tokens=len(prompt),
                              cached_prompt_tokens=cached, engine_id=self.engine_id)

    async def release_session(self, session_id: str) -> None:
        self.released.append(session_id)
        self._contexts.pop(session_id, None)
        self._kv_version.pop(session_id, None)

    def _cached(self, session_id: str | None, prompt: list[int]) -> int:
        previous = self._contexts.get(session_id or "")
        if previous and prompt[:len(previous)] == previous:
            return len(previous)
        if session_id:
            self._kv_version.pop(session_id, None)  # a fresh prefill: no old KV remains
        return 0

    def _cut(self, turn: ScriptedTurn, request: GenerateRequest,
             rng: random.Random) -> tuple[list[int], FinishReason]:
        ids = [int(i) for i in turn.token_ids]
        stops = set(request.params.stop_token_ids)
        if ids and self.malformed_rate > 0 and rng.random() < self.malformed_rate:
            end = len(ids) - 1 if ids[-1] in stops else len(ids)
            if end > 0:
                del ids[end - 1]
        for position, token in enumerate(ids):
            if token in stops:
                ids = ids[:position + 1]
                break
        if len(ids) > request.params.max_tokens:
            return ids[:request.params.max_tokens], "length"
        if turn.finish_reason is not None:
            return ids, turn.finish_reason
        return ids, "stop" if ids and ids[-1] in stops else "length"

    def _timing(self, turn: ScriptedTurn, new_prompt: int, sampled: int,
                rng: random.Random) -> tuple[float, np.ndarray]:
        model = self.latency
        prefill = model.fixed_s + model.prefill_s_per_token * new_prompt
        offsets = prefill + model.decode_s_per_token * np.arange(1, sampled + 1)
        if model.jitter_sigma > 0:
            offsets = offsets * math.exp(rng.gauss(0.0, model.jitter_sigma))
        total = float(offsets[-1]) if sampled else prefill
        if turn.delay_s is not None:
            scale = turn.delay_s / total if total > 0 else 0.0
            offsets = offsets * scale if total > 0 else np.full(sampled, turn.delay_s)
            total = turn.delay_s
        return total, offsets.astype(FLOAT32)

    def _tokens(self, ids: list[int], offsets: np.ndarray, request: GenerateRequest,
                rng: random.Random) -> SampledTokens:
        count = len(ids)
        start = rng.randrange(len(_LOGPROBS))
        logprobs = np.take(_LOGPROBS, np.arange(start, start + count), mode="wrap")
        session = request.session_id or ""
        if self.kv_mode == "retain" and session:
            kv = self._kv_version.setdefault(session, self.version)
        else:
            kv = self.version
        topk = min(self.topk, request.params.logprobs_topk or self.topk)
        topk_ids = topk_lp = None
        if topk:
            topk_ids, topk_lp = self._topk(ids, logprobs, topk, rng)
        return SampledTokens(
            token_ids=np.asarray(ids, dtype=INT32), sampler_logprobs=logprobs,
            weights_versions=np.full(count, self.version, INT32),
            kv_versions=np.full(count, kv, INT32), time_offsets=offsets,
            topk_ids=topk_ids, topk_logprobs=topk_lp)

    def _topk(self, ids: list[int], logprobs: np.ndarray, k: int,
              rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
        topk_ids = np.zeros((len(ids), k), INT32)
        topk_lp = np.zeros((len(ids), k), FLOAT32)
        for row, (token, logprob) in enumerate(zip(ids, logprobs)):
            others = [i for i in rng.sample(range(self.vocab_size), k + 1) if i != token][:k - 1]
            topk_ids[row] = [token, *others]
            topk_lp[row] = [logprob, *sorted((logprob - rng.expovariate(1.0)
                                              for _ in others), reverse=True)]
        return topk_ids, topk_lp


def _from_list(turns: list[ScriptedTurn]) -> Callable[[str, int], ScriptedTurn]:
    def script(key: str, index: int) -> ScriptedTurn:
        if index >= len(turns):
            raise EngineError(f"scripted engine: script has {len(turns)} turns, call {index} "
                              f"of {key or 'the default session'} asked for another")
        return turns[index]
    return script


def _from_mapping(scripts: Mapping[str, Sequence[ScriptedTurn]]) -> Callable[[str, int],
                                                                           ScriptedTurn]:
    def script(key: str, index: int) -> ScriptedTurn:
        if key not in scripts:
            raise EngineError(f"scripted engine: no script for trajectory {key!r}")
        turns = scripts[key]
        if index >= len(turns):
            raise EngineError(f"scripted engine: script has {len(turns)} turns, call {index} "
                              f"of {key or 'the default session'} asked for another")
        return turns[index]
    return script
