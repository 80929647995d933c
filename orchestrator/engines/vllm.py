"""The engine client for `vllm serve`: OpenAI-compatible completions and vLLM's dev routes.

Generation: `/v1/completions` with a token-id prompt, `logprobs`, `return_tokens_as_token_ids`
and streaming (parsed by `orchestrator.engines.vllm_stream`). vLLM reports processed log-probs when
started with `--logprobs-mode processed_logprobs` (the launcher does). It does not report
versions or times, so the client attributes them: a token's weights version is the version
this client had published when the token arrived; its KV version is the version at the
request's start, raised to the new version by each `kv=recompute` or `drain` update during the
request; its time offset is its arrival time at the client. This is exact when every update
goes through this client instance (updates pause the engine, so no token is produced during a
swap) and a streamed token never takes longer in transit than the swap.

`stream_interval` (a job's `[engine] stream_interval`) asks vLLM to stream that many tokens per
event instead of one: a call of a few hundred tokens is then a handful of JSON events for the
client to read, not hundreds. Tokens then arrive, and take their time offsets, in groups. With
`drain` updates (a job's `async` and `sync` pipelines on vLLM) every request in flight finishes
before the swap, so the versions stay exact; an `inflight` update would let tokens sampled
before the swap arrive after it, so a client with an interval above 1 refuses one.

A paused vLLM (0.32) holds new requests in every pause mode and starts them at `/resume`. It
refuses a request with HTTP 503 before generating anything when its queue is full
(`--max-num-queued-reqs`); `generate` then sends the request again once this client's update
is over, or after a short back-off, up to the admin timeout.

Weight updates pause the engine (`/pause`), reload through the stalewise worker extension
(`/collective_rpc`), reset the prefix cache (preempting running requests for `recompute`) and
resume. vLLM serves one version at a time: `pinned()`, `mode="pin"` and requests carrying a
`weights_version` raise `EngineError`. `release_session` is a no-op (vLLM's prefix cache is keyed
by content) and `abort` is refused (closing the connection aborts: cancel the `generate`).
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import pydantic_core

from core.engine_api import (
    EngineError,
    GenerateRequest,
    GenerateResult,
    InferenceEngine,
    KvPolicy,
    UpdateMode,
    WeightUpdateReport,
)
from orchestrator.engines.http import HttpEngineClient
from orchestrator.engines.vllm_stream import CompletionStream, completion_body

COMPLETIONS_ROUTE = "/v1/completions"
PAUSED_RETRY_S = 0.2   # back-off before resending a request vLLM refused with 503
VLLM_CANNOT_PIN = ("async version pinning needs the embedded engine ([engine] kind = 'embedded'), which "
                   "keeps several weights versions resident; vLLM serves one version at a time. "
                   "With vLLM use update mode 'inflight' or 'drain' (pipeline mode 'inflight', "
                   "or 'sync')")


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels} value` lines of a Prometheus exposition, keyed by `name{labels}`."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            samples[key] = float(value)
        except ValueError:
            continue
    return samples


class EngineUnavailable(EngineError):
    """vLLM answered 503 (its queue is full, or it is not ready): nothing ran."""


class VllmEngineClient(HttpEngineClient):
    """`vllm serve` (see module docstring)."""

    kind = "vllm"
    serve_hint = "`vllm serve`"
    can_pin = False

    def __init__(self, base_url: str, *, stream_interval: int = 1, **options: Any) -> None:
        super().__init__(base_url, **options)
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self.stream_interval = stream_interval
        # (version, kv policy) of every update this client made: the KV-version attribution
        self._update_log: list[tuple[int, KvPolicy]] = []
        self._unpaused = anyio.Event()   # set while no update of this client pauses vLLM
        self._unpaused.set()

    async def _wait_unpaused(self) -> None:
        """Until this client's own update is over, or a short back-off when it made none."""
        if self._unpaused.is_set():
            await anyio.sleep(PAUSED_RETRY_S)
        else:
            await self._unpaused.wait()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.weights_version is not None:
            raise EngineError(f"request pinned to weights version {request.weights_version} "
                              f"cannot be served by the {self.http.where('')}: {VLLM_CANNOT_PIN}")
        # pydantic's serialiser writes the body (a long prompt of ids) several times faster
        # than json.dumps; `fallback=int` writes numpy ints, which it does not know
        body = pydantic_core.to_json(
            completion_body(request, await self.model_name(), self.ignore_eos,
                            self.stream_interval), fallback=int)
        unavailable_since: float | None = None
        while True:
            stream = CompletionStream(request.params.logprobs_topk, self._version,
                                      len(self._update_log))
            try:
                await self.http.stream_events(
                    COMPLETIONS_ROUTE, body,
                    lambda chunk, stream=stream: stream.add_chunk(chunk, self._version,
                                                                  self._update_log),
                    errors={503: EngineUnavailable})
                break
            except EngineUnavailable as exc:
                # 503: vLLM refused the request before generating anything (its queue is
                # full), so it is sent again once there may be room.
                now = time.monotonic()
                unavailable_since = unavailable_since or now
                if now - unavailable_since > self.timeouts.admin:
                    raise EngineError(f"{exc}; still refused after {self.timeouts.admin:.0f}s "
                                      f"(raise vLLM's --max-num-queued-reqs, or lower the "
                                      f"job's concurrency)") from exc
                await self._wait_unpaused()
        if stream.finish_reason is None:
            raise EngineError(f"the {self.http.where(COMPLETIONS_ROUTE)} stream ended without "
                              f"a finish_reason")
        return GenerateResult(tokens=stream.record(), finish_reason=stream.finish_reason,
                              prompt_tokens=stream.prompt_tokens or len(request.prompt_token_ids),
                              cached_prompt_tokens=stream.cached_tokens,
                              engine_id=f"vllm@{self.base_url}")

    async def release_session(self, session_id: str) -> None:
        return  # vLLM's prefix cache is automatic and keyed by content, not by session

    def pinned(self, version: int) -> InferenceEngine:
        raise EngineError(f"cannot pin the {self.http.where('')} to weights version {version}: "
                          f"{VLLM_CANNOT_PIN}")

    async def update_weights(self, path: str, version: int, *, mode: UpdateMode = "inflight",
                             kv: KvPolicy = "recompute") -> WeightUpdateReport:
        self._check_update_args(mode, kv)
        if mode == "pin":
            raise EngineError(f"weight update mode 'pin' is not available on the "
                              f"{self.http.where('')}: {VLLM_CANNOT_PIN}")
        if mode == "inflight" and self.stream_interval > 1:
            raise EngineError(f"an 'inflight' weight update needs a client with stream_interval "
                              f"1, not {self.stream_interval}: vLLM holds up to that many "
                              f"sampled tokens before streaming them, so tokens sampled before "
                              f"the swap would arrive after it and be recorded under the new "
                              f"version (set [engine] stream_interval = 1, or use 'drain')")
        if version == self._version:
            return WeightUpdateReport(version, version, mode, kv, 0.0, 0.0, 0, 0, 0, True, "vllm")
        if version < self._version:
            raise EngineError(f"weights version {version} is older than {self._version}, "
                              f"which this client already published")
        previous = self._version
        started = time.monotonic()
        self._unpaused = anyio.Event()
        try:
            await self.pause("wait" if mode == "drain" else "keep")
        except BaseException:
            self._unpaused.set()
            raise
        paused_at = time.monotonic()
        try:
            await self.http.call("POST", "/collective_rpc", read_timeout=self.timeouts.admin,
                                 json_body={"method": "stalewise_load_checkpoint",
                                            "args": [str(path), str(int(version))]})
            if mode == "drain" or kv == "recompute":
                await self.http.call("POST", "/reset_prefix_cache",
                                     read_timeout=self.timeouts.admin,
                                     params={"reset_running_requests": "true"})
            self._update_log.append((int(version), "recompute" if mode == "drain" else kv))
            self._version = int(version)
        finally:
            try:
                await self.resume()
            finally:
                self._unpaused.set()
        return WeightUpdateReport(version, previous, mode, kv,
                                  pause_s=time.monotonic() - paused_at,
                                  wait_s=paused_at - started, in_flight_sequences=-1,
                                  recomputed_tokens=-1, invalidated_sessions=-1,
                                  already_applied=False, kind="vllm",
                                  resident_versions=(int(version),))

    async def abort(self, request_id: str | None = None) -> int:
        raise EngineError("vLLM aborts a request when its connection closes: cancel the "
                          "generate call instead")

    async def metrics(self) -> dict[str, float]:
        response = await self.http.send("GET", "/metrics", read_timeout=self.timeouts.control,
                                        idempotent=True)
        self.http.raise_for_status(response, "/metrics")
        return parse_prometheus(response.text)
