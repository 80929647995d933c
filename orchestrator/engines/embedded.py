"""The orchestrator's HTTP clients for inference engines: the embedded engine or `vllm serve`.

`engine_client(url, kind=...)` builds one. Every client implements `core.engine_api.EngineClient`
(`generate`, `release_session`, `update_weights`, `pinned`, `health`, ...) plus the admin
calls both servers have (`pause`, `resume`, `abort`, `metrics`), over one retrying transport
(`orchestrator.engines.http.HttpEngineClient`). It never imports torch.

Kinds, one class each (`[engine] kind`):

- `kind="embedded"`, `EmbeddedEngineClient` (this module): `/stalewise/generate` returns
  every per-token field (ids, processed log-probs, weights and KV versions, time offsets,
  top-k) exactly as the engine recorded them; bodies and replies are `core.engine_api`'s
  schemas, the same ones the server uses. Weight updates go to `/stalewise/update_weights`.
- `kind="vllm"`, `orchestrator.engines.vllm.VllmEngineClient`: `/v1/completions` streamed,
  with client-side attribution of versions and times (the rules are in that module), and
  weight updates through vLLM's pause / collective_rpc / reset_prefix_cache / resume routes.

Version pinning (async pipelines): `update_weights(path, version, mode="pin")` makes `version`
current while the embedded engine keeps older versions resident for the trajectories pinned to
them; `client.pinned(version)` is an `InferenceEngine` (`orchestrator.engines.pinning.PinnedEngine`)
whose every request carries `weights_version=version`, so a trajectory's turns all come from
the version it started with. A request pinned to a version the engine no longer holds raises
`VersionNotResidentError`. vLLM serves one version at a time: `pinned()`, `mode="pin"` and
pinned requests raise `EngineError` there (use `inflight` or `drain` with vLLM).

Failure policy (`orchestrator.engines.http`): every failure is an `EngineError` whose message
names the engine, the route and what to do; timeouts are explicit per call class
(`EngineTimeouts`); the connection pool is bounded; retries happen only where they cannot
duplicate work: connection failures (the request never left), and idempotent calls (health,
metrics, release, weight updates, which the engine deduplicates by version and path). A
`generate` that may have started is never retried; if the caller cancels it, the connection is
closed (the engine aborts the request on disconnect) and, for the embedded engine, an explicit
abort is sent as well.
"""

from __future__ import annotations

import secrets

import anyio
import httpx
import numpy as np

from core.engine_api import (
    ABORT_ROUTE,
    GENERATE_ROUTE,
    METRICS_ROUTE,
    RELEASE_SESSION_ROUTE,
    UPDATE_WEIGHTS_ROUTE,
    AbortBody,
    AbortReply,
    EngineError,
    EngineKind,
    GenerateBody,
    GenerateRequest,
    GenerateResult,
    KvPolicy,
    ReleaseSessionBody,
    UpdateMode,
    UpdateWeightsBody,
    UpdateWeightsReply,
    VersionNotResidentError,
    WeightUpdateReport,
    decode_generate_reply,
    decode_reply,
)
from orchestrator.engines.http import EngineTimeouts, HttpEngineClient
from orchestrator.engines.pinning import PinnedEngine
from orchestrator.engines.vllm import VllmEngineClient

__all__ = ["EmbeddedEngineClient", "EngineTimeouts", "HttpEngineClient",
           "VersionNotResidentError", "VllmEngineClient", "engine_client"]


class EmbeddedEngineClient(HttpEngineClient):
    """The embedded engine's `/stalewise/*` routes (see module docstring)."""

    kind = "embedded"
    serve_hint = "`stalewise engine serve`"
    can_pin = True

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        request_id = secrets.token_hex(16)  # 128 random bits, as uuid4 has, at a fifth of its cost
        body = GenerateBody.of(request, request_id=request_id, ignore_eos=self.ignore_eos)
        try:
            payload = await self.http.call(
                "POST", GENERATE_ROUTE, idempotent=False, read_timeout=self.timeouts.generate,
                json_body=body.model_dump_json().encode(),
                errors={409: VersionNotResidentError})
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.timeouts.control):
                try:
                    await self.abort(request_id)
                except EngineError:
                    pass  # the engine also aborts on disconnect
            raise
        result = decode_generate_reply(payload, source=self.http.sender(GENERATE_ROUTE),
                                       request_id=request_id)
        self._saw_versions(result.tokens.weights_versions)
        return result

    def _saw_versions(self, weights_versions: np.ndarray) -> None:
        if weights_versions.size:
            self._version = max(self._version, int(weights_versions.max()))

    async def release_session(self, session_id: str) -> None:
        await self.http.call("POST", RELEASE_SESSION_ROUTE,
                             json_body=ReleaseSessionBody(session_id=session_id).model_dump())

    def pinned(self, version: int) -> PinnedEngine:
        return PinnedEngine(self, version)

    async def update_weights(self, path: str, version: int, *, mode: UpdateMode = "inflight",
                             kv: KvPolicy = "recompute") -> WeightUpdateReport:
        self._check_update_args(mode, kv)
        body = UpdateWeightsBody(path=str(path), version=int(version), mode=mode, kv=kv)
        payload = await self.http.call("POST", UPDATE_WEIGHTS_ROUTE,
                                       read_timeout=self.timeouts.admin,
                                       json_body=body.model_dump(mode="json"))
        reply = decode_reply(UpdateWeightsReply, payload,
                             source=self.http.sender(UPDATE_WEIGHTS_ROUTE))
        self._version = reply.version
        return WeightUpdateReport.from_reply(reply, self.kind)

    async def abort(self, request_id: str | None = None) -> int:
        body = AbortBody(all=True) if request_id is None else AbortBody(request_id=request_id)
        payload = await self.http.call("POST", ABORT_ROUTE,
                                       json_body=body.model_dump(exclude_defaults=True))
        return decode_reply(AbortReply, payload,
                            source=self.http.sender(ABORT_ROUTE)).aborted

    async def metrics(self) -> dict[str, float]:
        payload = await self.http.call("GET", METRICS_ROUTE)
        return decode_reply(dict[str, float], payload,
                            source=self.http.sender(METRICS_ROUTE))


CLIENTS: dict[str, type[HttpEngineClient]] = {EmbeddedEngineClient.kind: EmbeddedEngineClient,
                                             VllmEngineClient.kind: VllmEngineClient}


# a client's connections when not told (a job's: JobConfig.engine_connections)
DEFAULT_CONNECTIONS = 256


def engine_client(base_url: str, *, kind: EngineKind = "embedded", model: str | None = None,
                  timeouts: EngineTimeouts | None = None,
                  max_connections: int = DEFAULT_CONNECTIONS,
                  retries: int = 3, retry_backoff_s: float = 0.2, ignore_eos: bool = False,
                  initial_version: int = 0, transport: httpx.AsyncBaseTransport | None = None,
                  stream_interval: int = 1) -> HttpEngineClient:
    """The client for the engine at `base_url`: `kind` "embedded" (the embedded engine) or
    "vllm". `model` names the served model (default: the first of `/v1/models`);
    `initial_version` is the weights version the engine serves now; `transport` replaces the
    network (tests); `stream_interval` is the tokens vLLM streams per event (vLLM only: the
    embedded engine answers a call in one reply)."""
    if kind not in CLIENTS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, CLIENTS))}, got {kind!r}")
    streaming = {"stream_interval": stream_interval} if kind == VllmEngineClient.kind else {}
    return CLIENTS[kind](base_url, model=model, timeouts=timeouts,
                         max_connections=max_connections, retries=retries,
                         retry_backoff_s=retry_backoff_s, ignore_eos=ignore_eos,
                         initial_version=initial_version, transport=transport, **streaming)
