"""The inference-engine boundary: token ids in, sampled tokens with provenance out.

Two halves, both torch-free and shared by the engine (`engine/`) and the orchestrator:

- In process: every engine (the embedded CPU engine and vLLM through the HTTP clients, the
  scripted fake in tests) satisfies `InferenceEngine`. The agent loop sends the whole context as
  token ids on every turn, tagged with a session id; an engine that keeps a per-session KV cache
  prefills only what is new and reports how many prompt tokens it found cached.
- On the wire: the embedded engine's `/stalewise/*` routes. The server validates request bodies
  with the `*Body` models and writes replies with the `*Reply` models and
  `encode_generate_reply`; the client builds bodies with the same models and reads replies with
  `decode_generate_reply` / `decode_reply`. Per-token arrays travel as base64 of little-endian
  int32/float32 (exact, compact, and -inf survives). A reply that does not match its schema is
  an `EngineError` naming the field; so is a log-prob that is NaN or +inf (`bad_logprobs`, which
  the agent loop also applies to in-process engines) and a reply whose `request_id` is not the
  request's. Fields a newer engine adds are ignored.

The update-mode, KV-policy and pause-mode names are defined here once for every process.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, Protocol, Sequence, TypeVar, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from core.records import FLOAT32, INT32, SampledTokens, pack

FinishReason = Literal["stop", "length", "abort"]
UpdateMode = Literal["inflight", "drain", "pin"]   # what running requests do at a weight update
KvPolicy = Literal["retain", "recompute"]          # what happens to KV built by older weights
PauseMode = Literal["keep", "wait", "abort"]       # what running requests do at a pause

GENERATE_ROUTE = "/stalewise/generate"
UPDATE_WEIGHTS_ROUTE = "/stalewise/update_weights"
ABORT_ROUTE = "/stalewise/abort"
RELEASE_SESSION_ROUTE = "/stalewise/release_session"
METRICS_ROUTE = "/stalewise/metrics"
INFO_ROUTE = "/stalewise/info"
ARRAY_ENCODING = "base64-le"


class SamplingParams(BaseModel):
    """Sampling settings of one request; the processed distribution is what log-probs describe.

    Processing order: logits / temperature, then top-k, then top-p (nucleus over the top-k
    survivors), renormalised. `top_k = 0` and `top_p = 1.0` switch those filters off.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(1.0, gt=0.0, allow_inf_nan=False,
                               description="softmax temperature (> 0)")
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
    # Set by a client-side router (orchestrator.engines.replicas) when this call's context had to be
    # prefilled again on another replica: why (the replica that went down). Not on the wire.
    recompute_reason: str | None = None


class EngineError(Exception):
    """The engine could not serve a request (unreachable, overloaded, aborted, bad reply)."""


class VersionNotResidentError(EngineError):
    """A request was pinned to a weights version the engine does not hold (any more): HTTP 409."""


class InferenceEngine(Protocol):
    """What an agent loop needs of an engine: generate, and let a session go."""

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    async def release_session(self, session_id: str) -> None:
        """Forget a session's retained KV cache (the trajectory ended)."""
        ...


EngineKind = Literal["embedded", "vllm"]  # `[engine] kind`, and what every client reports


@dataclass(frozen=True)
class WeightUpdateReport:
    """What one `update_weights` did: on one engine, or on every replica behind a router (then
    `replicas` holds each one's report, counts are summed and pauses are the longest; vLLM
    reports -1 for counts it does not know)."""

    version: int
    previous_version: int
    mode: UpdateMode
    kv: KvPolicy
    pause_s: float
    wait_s: float
    in_flight_sequences: int
    recomputed_tokens: int
    invalidated_sessions: int
    already_applied: bool
    kind: EngineKind
    resident_versions: tuple[int, ...] = ()   # held by the engine after the update
    evicted_versions: tuple[int, ...] = ()    # dropped while still pinned (resident cap)
    replicas: tuple[WeightUpdateReport, ...] = ()  # behind a router: one per replica updated
    skipped_replicas: tuple[int, ...] = ()    # behind a router: down meanwhile, catch up later

    @classmethod
    def from_reply(cls, reply: UpdateWeightsReply, kind: EngineKind) -> WeightUpdateReport:
        return cls(version=reply.version, previous_version=reply.previous_version,
                   mode=reply.mode, kv=reply.kv, pause_s=reply.pause_s, wait_s=reply.wait_s,
                   in_flight_sequences=reply.in_flight_sequences,
                   recomputed_tokens=reply.recomputed_tokens,
                   invalidated_sessions=reply.invalidated_sessions,
                   already_applied=reply.already_applied, kind=kind,
                   resident_versions=reply.resident_versions,
                   evicted_versions=reply.evicted_versions)

    @classmethod
    def combined(cls, reports: Sequence[WeightUpdateReport], skipped: Sequence[int] = ()
                 ) -> WeightUpdateReport:
        """The report of a router: every replica's `reports` (at least one) in one."""
        first = reports[0]
        return cls(version=first.version,
                   previous_version=min(r.previous_version for r in reports),
                   mode=first.mode, kv=first.kv, pause_s=max(r.pause_s for r in reports),
                   wait_s=max(r.wait_s for r in reports),
                   in_flight_sequences=sum(r.in_flight_sequences for r in reports),
                   recomputed_tokens=sum(r.recomputed_tokens for r in reports),
                   invalidated_sessions=sum(r.invalidated_sessions for r in reports),
                   already_applied=all(r.already_applied for r in reports), kind=first.kind,
                   replicas=tuple(reports), skipped_replicas=tuple(skipped))


@runtime_checkable
class EngineClient(InferenceEngine, Protocol):
    """The one contract of everything the orchestrator drives as an engine: the HTTP clients of
    the embedded engine and of vLLM (`orchestrator.engines`), the router over replicas, and the
    scripted engine tests inject. `can_pin`: whether `pinned(version)` and `mode="pin"` work
    (the embedded engine keeps older versions resident; vLLM serves one at a time)."""

    kind: EngineKind
    can_pin: bool

    async def update_weights(self, path: str, version: int, *, mode: UpdateMode = "inflight",
                             kv: KvPolicy = "recompute") -> WeightUpdateReport:
        """Make the engine serve the checkpoint at `path` as policy `version` (`inflight`: running
        requests continue under the new weights, their KV retained or recomputed; `drain`: they
        finish first; `pin`: older versions stay resident for pinned requests)."""
        ...

    def pinned(self, version: int) -> InferenceEngine:
        """An engine whose every request is served with weights `version`."""
        ...

    async def health(self) -> bool:
        """Whether the engine answers now; never raises."""
        ...

    async def wait_ready(self, timeout: float = 120.0) -> None: ...

    async def max_model_len(self) -> int | None:
        """The served model's context window in tokens, or None when unknown."""
        ...

    async def aclose(self) -> None: ...


# ---- wire: request bodies (validated by the server; extra fields are refused) ---------------
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

    @classmethod
    def of(cls, request: GenerateRequest, *, request_id: str, ignore_eos: bool) -> GenerateBody:
        """The body for `request`; an invalid one is an `EngineError` naming the field."""
        try:
            return cls(prompt_token_ids=request.prompt_token_ids,  # numpy ids validate too
                       params=request.params, session_id=request.session_id,
                       request_id=request_id, ignore_eos=ignore_eos,
                       weights_version=request.weights_version)
        except ValidationError as exc:
            raise EngineError(f"invalid generate request: {_fields(exc)}") from exc


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="HF checkpoint directory written by the learner")
    version: int = Field(ge=0, description="policy version of these weights")
    mode: UpdateMode = "inflight"
    kv: KvPolicy = "recompute"


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str | None = Field(None, description="request to abort; omit with all=true")
    all: bool = False


class ReleaseSessionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str


# ---- wire: replies (written by the server, decoded by the client) ---------------------------
class _Reply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class GenerateReply(_Reply):
    """`/stalewise/generate`: every `SampledTokens` field, arrays base64 little-endian."""

    request_id: str
    engine_id: str
    finish_reason: FinishReason
    prompt_tokens: int = Field(ge=0)
    cached_prompt_tokens: int = Field(ge=0)
    encoding: Literal["base64-le"]
    length: int = Field(ge=0, description="sampled tokens T")
    topk: int = Field(ge=0, description="K of the top-k arrays; 0 = none sent")
    token_ids: str                       # int32 (T,)
    sampler_logprobs: str                # float32 (T,)
    weights_versions: str                # int32 (T,)
    kv_versions: str                     # int32 (T,)
    time_offsets: str                    # float32 (T,)
    topk_ids: str | None = None          # int32 (T, K), row-major
    topk_logprobs: str | None = None     # float32 (T, K), row-major


class UpdateWeightsReply(_Reply):
    """`/stalewise/update_weights`: what the update did; times in seconds."""

    version: int
    previous_version: int
    path: str
    mode: UpdateMode
    kv: KvPolicy
    wait_s: float                # from the engine receiving it to the swap (drain waits here)
    pause_s: float               # decoding stopped: swap plus recompute prefill
    in_flight_sequences: int     # sequences that continue under the new weights
    recomputed_tokens: int       # positions re-prefilled (kv=recompute)
    invalidated_sessions: int    # retained session caches dropped (kv=recompute)
    already_applied: bool = False
    resident_versions: tuple[int, ...] = ()   # weights versions held after the update
    evicted_versions: tuple[int, ...] = ()    # still referenced, dropped for the resident cap


class AbortReply(_Reply):
    aborted: int = Field(ge=0)


class ReleaseSessionReply(_Reply):
    session_id: str
    released_tokens: int = Field(ge=0)


def _b64(array: np.ndarray, dtype: np.dtype) -> str:
    return base64.b64encode(pack(array, dtype)).decode("ascii")


def encode_generate_reply(result: GenerateResult, *, request_id: str) -> dict[str, Any]:
    """The JSON body of a `/stalewise/generate` reply (the inverse of `decode_generate_reply`)."""
    tokens = result.tokens
    topk = tokens.topk
    return GenerateReply(
        request_id=request_id, engine_id=result.engine_id, finish_reason=result.finish_reason,
        prompt_tokens=result.prompt_tokens, cached_prompt_tokens=result.cached_prompt_tokens,
        encoding=ARRAY_ENCODING, length=len(tokens), topk=topk,
        token_ids=_b64(tokens.token_ids, INT32),
        sampler_logprobs=_b64(tokens.sampler_logprobs, FLOAT32),
        weights_versions=_b64(tokens.weights_versions, INT32),
        kv_versions=_b64(tokens.kv_versions, INT32),
        time_offsets=_b64(tokens.time_offsets, FLOAT32),
        topk_ids=_b64(tokens.topk_ids, INT32) if topk else None,
        topk_logprobs=_b64(tokens.topk_logprobs, FLOAT32) if topk else None,
    ).model_dump(mode="json")


def decode_generate_reply(payload: Any, *, source: str = "the engine",
                          request_id: str | None = None) -> GenerateResult:
    """A `/stalewise/generate` reply as a `GenerateResult`, exactly as the engine recorded it.

    Raises `EngineError("<source> sent a malformed generate reply: field '<name>': <why>")` for a
    missing or ill-typed field, bad base64, an array whose length disagrees with `length` and
    `topk`, a log-prob that is NaN or +inf, or (given `request_id`) a reply to another
    request."""
    reply = decode_reply(GenerateReply, payload, source=source)
    if request_id is not None and reply.request_id != request_id:
        raise _malformed(source, "generate", "request_id",
                         f"{reply.request_id!r} answers another request (this one was "
                         f"{request_id!r}); is something between us and the engine mixing up "
                         f"replies?")
    length, topk = reply.length, reply.topk

    def array(name: str, dtype: np.dtype, width: int = 1) -> np.ndarray:
        return _array(reply, name, dtype, length * width, source)

    per_token = (array("token_ids", INT32), array("sampler_logprobs", FLOAT32),
                 array("weights_versions", INT32), array("kv_versions", INT32),
                 array("time_offsets", FLOAT32))
    if not topk and (reply.topk_ids is not None or reply.topk_logprobs is not None):
        raise _malformed(source, "generate", "topk_ids", "top-k arrays sent with topk 0")
    extra = {}
    if topk:
        extra = dict(topk_ids=array("topk_ids", INT32, topk).reshape(length, topk),
                     topk_logprobs=array("topk_logprobs", FLOAT32, topk).reshape(length, topk))
    tokens = SampledTokens(*per_token, **extra)
    problem = bad_logprobs(tokens)
    if problem:
        raise _malformed(source, "generate", *problem)
    return GenerateResult(tokens=tokens, finish_reason=reply.finish_reason,
                          prompt_tokens=reply.prompt_tokens,
                          cached_prompt_tokens=reply.cached_prompt_tokens,
                          engine_id=reply.engine_id)


def bad_logprobs(tokens: SampledTokens) -> tuple[str, str] | None:
    """(field, why) for the first log-prob of `tokens` that is NaN or +inf, else None.

    A log-probability is a number <= 0, or -inf (a top-k slot the sampler's filters removed);
    a NaN would train the learner on garbage, so no engine's reply may carry one."""
    arrays = [("sampler_logprobs", tokens.sampler_logprobs)]
    if tokens.topk_logprobs is not None:
        arrays.append(("topk_logprobs", tokens.topk_logprobs.reshape(-1)))
    for name, values in arrays:
        if not values.size or values.max() < np.inf:  # NaN and +inf both fail it: one pass
            continue
        bad = np.flatnonzero(np.isnan(values) | np.isposinf(values))
        if bad.size:
            at = int(bad[0])
            where = f"token {at}" if name == "sampler_logprobs" else (
                f"token {at // tokens.topk}, slot {at % tokens.topk}")
            return name, (f"{values[at]} at {where} ({bad.size} of {values.size} such values); "
                          f"a log-probability is a number <= 0 or -inf")
    return None


def _array(reply: GenerateReply, name: str, dtype: np.dtype, count: int,
           source: str) -> np.ndarray:
    data = getattr(reply, name)
    if data is None:
        raise _malformed(source, "generate", name, f"missing (topk is {reply.topk})")
    try:
        raw = binascii.a2b_base64(data, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise _malformed(source, "generate", name, f"not base64 ({exc})") from exc
    if len(raw) != count * dtype.itemsize:
        raise _malformed(source, "generate", name,
                         f"{len(raw)} bytes, expected {count} x {dtype.itemsize} "
                         f"(length {reply.length}, topk {reply.topk})")
    return np.frombuffer(raw, dtype=dtype)


Decoded = TypeVar("Decoded")


@lru_cache(maxsize=None)
def _adapter(schema: Any) -> TypeAdapter:
    return TypeAdapter(schema)


def decode_reply(schema: type[Decoded], payload: Any, *, source: str = "the engine") -> Decoded:
    """`payload` validated as `schema` (a reply model, or a type such as `dict[str, float]`);
    a mismatch is an `EngineError` naming every offending field."""
    try:
        return _adapter(schema).validate_python(payload)
    except ValidationError as exc:
        what = getattr(schema, "__name__", str(schema)).removesuffix("Reply")
        raise EngineError(f"{source} sent a malformed {_snake(what)} reply: "
                          f"{_fields(exc)}") from exc


def _malformed(source: str, what: str, field: str, why: str) -> EngineError:
    return EngineError(f"{source} sent a malformed {what} reply: field {field!r}: {why}")


def _fields(exc: ValidationError) -> str:
    return "; ".join(f"field {'.'.join(str(p) for p in e['loc']) or '(body)'!r}: {e['msg']}"
                     for e in exc.errors())


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower()
                   for i, c in enumerate(name))
