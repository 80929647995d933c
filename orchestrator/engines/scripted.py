"""A scripted inference engine: replays given assistant turns as sampled tokens.

It is a `core.engine_api.EngineClient` (`FakeEngineClient`: weight updates make the new version
current and are kept in `updates`) and behaves like a real engine where the agent loop can
tell: it honours `max_tokens` (cut, finish "length") and `stop_token_ids` (cut
after the first stop id, finish "stop"), reports cached prompt tokens for a session whose new
prompt extends its previous context, stamps every token with the current weights version and a
KV version (`kv_mode="retain"` keeps the version of the session's oldest KV entry across
updates; `"recompute"` uses the current one), and gives plausible sampler log-probs (and top-k)
drawn deterministically per (seed, trajectory, call) (a window of a fixed table of exponential
draws, so a call costs the same whatever its length). Optional simulated latency (prefill per
new prompt token, decode per token, lognormal jitter) really sleeps, so benchmarks see
concurrency. Optional malformed outputs drop the token before the final stop token (for a tool
call, its closing tag).

Scripts are looked up per trajectory: calls are counted per key, the session id up to its last
'/' (the agent loop names sessions `trajectory_id/segment`). Every request is kept in `requests`
for tests to inspect; benchmarks with many long trajectories pass `keep_requests=False`. A
session's context is kept by reference to the request's prompt (the agent loop sends a fresh list
every call), so a caller must not change a prompt list after sending it.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import anyio
import numpy as np

from core.engine_api import (
    EngineError,
    EngineKind,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    KvPolicy,
    UpdateMode,
    WeightUpdateReport,
)
from core.records import FLOAT32, INT32, SampledTokens
from orchestrator.engines.pinning import PinnedEngine
from tasks.chat.codec import int_list


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
_LOGPROBS.setflags(write=False)
_STEPS = np.arange(1, 4097, dtype=FLOAT32)  # 1, 2, ... : decode steps of the sampled tokens


def turns_from_texts(encode_assistant: Callable[[str], list[int]],
                     texts: Sequence[str]) -> list[ScriptedTurn]:
    """Scripted turns from assistant texts, e.g. with `chat_format.encode_assistant`."""
    return [ScriptedTurn(tuple(encode_assistant(text))) for text in texts]


def script_key(session_id: str | None) -> str:
    if not session_id:
        return ""
    return session_id.rsplit("/", 1)[0]


class FakeEngineClient:
    """The `EngineClient` surface an engine made for tests and benchmarks shares: it answers,
    knows no context window, closes for free, and serves pinned views (it stamps a request's
    `weights_version` on its tokens, as the embedded engine does). `update_weights` makes
    `version` current and records `(version, mode, kv)` in `updates`; an engine that models an
    update's cost overrides it and calls this one at the end."""

    kind: EngineKind = "embedded"
    can_pin = True
    version = 0

    @property
    def updates(self) -> list[tuple[int, str, str]]:
        if "_updates" not in self.__dict__:
            self._updates: list[tuple[int, str, str]] = []
        return self._updates

    async def update_weights(self, path: str, version: int, *, mode: UpdateMode = "inflight",
                             kv: KvPolicy = "recompute") -> WeightUpdateReport:
        previous, self.version = self.version, int(version)
        self.updates.append((int(version), mode, kv))
        return WeightUpdateReport(int(version), previous, mode, kv, pause_s=0.0, wait_s=0.0,
                                  in_flight_sequences=0, recomputed_tokens=0,
                                  invalidated_sessions=0, already_applied=False, kind=self.kind)

    def pinned(self, version: int) -> PinnedEngine:
        return PinnedEngine(self, version)

    async def health(self) -> bool:
        return True

    async def wait_ready(self, timeout: float = 120.0) -> None:
        return None

    async def max_model_len(self) -> int | None:
        return None

    async def aclose(self) -> None:
        return None


class ScriptedEngine(FakeEngineClient):
    def __init__(self, script: Script | Sequence[ScriptedTurn], *, engine_id: str = "scripted",
                 version: int = 0, kv_mode: KvPolicy = "recompute",
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
        self._contexts: dict[str, tuple[Sequence[int], list[int]]] = {}  # prompt, sampled
        self._kv_version: dict[str, int] = {}
        self._constants: dict[tuple[int, int], np.ndarray] = {}  # read-only np.full arrays

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.keep_requests:
            self.requests.append(request)
        key = script_key(request.session_id)
        index = self._calls.get(key, 0)
        self._calls[key] = index + 1
        rng = _Draws(f"{self.seed}:{key}:{index}")
        turn = self._script(key, index)
        prompt = request.prompt_token_ids
        cached = self._cached(request.session_id, prompt)
        ids, finish = self._cut(turn, request, rng)
        delay, offsets = self._timing(turn, len(prompt) - cached, len(ids), rng)
        if delay > 0:
            await anyio.sleep(delay)
        if turn.error is not None:
            raise turn.error
        tokens = self._tokens(ids, offsets, request, rng)
        if request.session_id:
            self._contexts[request.session_id] = (prompt, ids)
        return GenerateResult(tokens=tokens, finish_reason=finish, prompt_tokens=len(prompt),
                              cached_prompt_tokens=cached, engine_id=self.engine_id)

    async def release_session(self, session_id: str) -> None:
        self.released.append(session_id)
        self._contexts.pop(session_id, None)
        self._kv_version.pop(session_id, None)

    def _cached(self, session_id: str | None, prompt: Sequence[int]) -> int:
        """Tokens of `prompt` the session's KV holds: its previous prompt + sampled ids, when the
        new prompt starts with them."""
        previous = self._contexts.get(session_id or "")
        if previous is not None:
            before, sampled = previous
            length = len(before) + len(sampled)
            if length and len(prompt) >= length and _starts_with(prompt, before, 0) \
                    and _starts_with(prompt, sampled, len(before)):
                return length
        if session_id:
            self._kv_version.pop(session_id, None)  # a fresh prefill: no old KV remains
        return 0

    def _cut(self, turn: ScriptedTurn, request: GenerateRequest,
             rng: _Draws) -> tuple[list[int], FinishReason]:
        ids = int_list(list(turn.token_ids))
        stops = request.params.stop_token_ids
        if ids and self.malformed_rate > 0 and rng.random() < self.malformed_rate:
            end = len(ids) - 1 if ids[-1] in stops else len(ids)
            if end > 0:
                del ids[end - 1]
        first_stop = min((ids.index(stop) for stop in stops if stop in ids), default=None)
        if first_stop is not None:
            ids = ids[:first_stop + 1]
        if len(ids) > request.params.max_tokens:
            return ids[:request.params.max_tokens], "length"
        if turn.finish_reason is not None:
            return ids, turn.finish_reason
        return ids, "stop" if ids and ids[-1] in stops else "length"

    def _timing(self, turn: ScriptedTurn, new_prompt: int, sampled: int,
                rng: _Draws) -> tuple[float, np.ndarray]:
        model = self.latency
        prefill = model.fixed_s + model.prefill_s_per_token * new_prompt
        jitter = math.exp(rng.gauss(0.0, model.jitter_sigma)) if model.jitter_sigma > 0 else 1.0
        steps = _STEPS[:sampled] if sampled <= len(_STEPS) else np.arange(
            1, sampled + 1, dtype=FLOAT32)
        offsets = steps * FLOAT32.type(model.decode_s_per_token * jitter) + FLOAT32.type(
            prefill * jitter)
        total = float(offsets[-1]) if sampled else prefill
        if turn.delay_s is not None:
            scale = turn.delay_s / total if total > 0 else 0.0
            offsets = offsets * FLOAT32.type(scale) if total > 0 else np.full(
                sampled, turn.delay_s, FLOAT32)
            total = turn.delay_s
        return total, offsets

    def _tokens(self, ids: list[int], offsets: np.ndarray, request: GenerateRequest,
                rng: _Draws) -> SampledTokens:
        count = len(ids)
        start = rng.randrange(len(_LOGPROBS))
        logprobs = (_LOGPROBS[start:start + count] if start + count <= len(_LOGPROBS)
                    else np.take(_LOGPROBS, np.arange(start, start + count), mode="wrap"))
        session = request.session_id or ""
        version = self.version if request.weights_version is None else request.weights_version
        if self.kv_mode == "retain" and session:
            kv = self._kv_version.setdefault(session, version)
        else:
            kv = version
        topk = min(self.topk, request.params.logprobs_topk or self.topk)
        topk_ids = topk_lp = None
        if topk:
            topk_ids, topk_lp = self._topk(ids, logprobs, topk, rng.rng)
        return SampledTokens(
            token_ids=np.asarray(ids, dtype=INT32), sampler_logprobs=logprobs,
            weights_versions=self._constant(count, version),
            kv_versions=self._constant(count, kv), time_offsets=offsets,
            topk_ids=topk_ids, topk_logprobs=topk_lp)

    def _constant(self, count: int, value: int) -> np.ndarray:
        """A read-only int32 array of `count` times `value`, shared between records."""
        array = self._constants.get((count, value))
        if array is None:
            if len(self._constants) > 4096:
                self._constants.clear()
            array = np.full(count, value, INT32)
            array.setflags(write=False)
            self._constants[(count, value)] = array
        return array

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


class _Draws:
    """Deterministic random numbers for one call: the first four uniforms come from one hash of
    the label; more, and a full `random.Random` (`rng`, for top-k), come from a generator seeded
    with that hash on first use (seeding a Mersenne twister costs more than the rest of a call).
    """

    def __init__(self, label: str) -> None:
        digest = hashlib.blake2b(label.encode(), digest_size=32).digest()
        self._words = struct.unpack("<4Q", digest)
        self._used = 0
        self._rng: random.Random | None = None

    @property
    def rng(self) -> random.Random:
        if self._rng is None:
            self._rng = random.Random(int.from_bytes(struct.pack("<4Q", *self._words), "little"))
        return self._rng

    def random(self) -> float:
        """Uniform on [0, 1)."""
        if self._used < len(self._words):
            word = self._words[self._used]
            self._used += 1
            return (word >> 11) * 2.0 ** -53
        return self.rng.random()

    def randrange(self, stop: int) -> int:
        return min(stop - 1, int(self.random() * stop))

    def gauss(self, mu: float, sigma: float) -> float:
        """Normal by the Box-Muller transform of two uniforms."""
        radius = math.sqrt(-2.0 * math.log(1.0 - self.random()))
        return mu + sigma * radius * math.cos(2.0 * math.pi * self.random())


def _starts_with(sequence: Sequence[int], part: Sequence[int], at: int) -> bool:
    """sequence[at:at + len(part)] == part; plain lists are compared by slices (C speed)."""
    if isinstance(sequence, list) and isinstance(part, list):
        return sequence[at:at + len(part)] == part
    return all(int(a) == int(b) for a, b in zip(sequence[at:at + len(part)], part)) \
        and len(sequence) >= at + len(part)


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
