"""The orchestrator's HTTP client for inference engines: the embedded engine or `vllm serve`.

`EngineClient` implements `stalewise.engine_api.InferenceEngine` (`generate`,
`release_session`) plus the admin calls the weight-sync loop needs (`update_weights`, `pause`,
`resume`, `abort`, `metrics`, `health`). It never imports torch.

Backends, one client:

- `backend="stalewise"` (the embedded engine): `/stalewise/generate` returns every per-token
  field (ids, processed log-probs, weights and KV versions, time offsets, top-k) exactly as the
  engine recorded them; weight updates go to `/stalewise/update_weights`.
- `backend="vllm"`: `/v1/completions` with a token-id prompt, `logprobs`,
  `return_tokens_as_token_ids` and streaming (parsed by `orchestrator.vllm_stream`). vLLM
  reports processed log-probs when started with `--logprobs-mode processed_logprobs` (the
  launcher does). It does not report versions
  or times, so the client attributes them: a token's weights version is the version this client
  had published when the token arrived; its KV version is the version at the request's start,
  raised to the new version by each `kv=recompute` or `drain` update during the request; its
  time offset is its arrival time at the client. This is exact when every update goes through
  this client instance (updates pause the engine, so no token is produced during a swap) and a
  streamed token never takes longer in transit than the swap. Weight updates pause the engine
  (`/pause`), reload through the stalewise worker extension (`/collective_rpc`), reset the prefix
  cache (preempting running requests for `recompute`) and resume.

Version pinning (async pipelines): `update_weights(path, version, mode="pin")` makes `version`
current while the embedded engine keeps older versions resident for the trajectories pinned to
them; `client.pinned(version)` is an `InferenceEngine` whose every request carries
`weights_version=version`, so a trajectory's turns all come from the version it started with.
A request pinned to a version the engine no longer holds raises `VersionNotResidentError`. vLLM
serves one version at a time: `pinned()`, `mode="pin"` and pinned requests raise `EngineError`
there (use `inflight` or `drain` with vLLM).

Failure policy: every failure is an `EngineError` whose message names the engine, the route
and what to do. Timeouts are explicit per call class (`EngineTimeouts`); the connection pool is
bounded. Retries happen only where they cannot duplicate work: connection failures (the request
never left), and idempotent calls (health, metrics, release, weight updates, which the engine
deduplicates by version and path). A `generate` that may have started is never retried; if the
caller cancels it, the connection is closed (the engine aborts the request on disconnect) and,
for the embedded engine, an explicit abort is sent as well.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import httpx
import numpy as np

from orchestrator.vllm_stream import CompletionStream, completion_body
from stalewise.engine_api import EngineError, GenerateRequest, GenerateResult
from stalewise.records import FLOAT32, INT32, SampledTokens

Backend = Literal["stalewise", "vllm"]
UpdateMode = Literal["inflight", "drain", "pin"]
KvPolicy = Literal["retain", "recompute"]
PauseMode = Literal["keep", "wait", "abort"]
GENERATE_PATH = "/stalewise/generate"
VLLM_CANNOT_PIN = ("async version pinning needs the embedded engine (backend='stalewise'), which "
                   "keeps several weights versions resident; vLLM serves one version at a time. "
                   "With vLLM use update mode 'inflight' or 'drain' (pipeline mode 'inflight', "
                   "or 'sync')")


class VersionNotResidentError(EngineError):
    """A request was pinned to a weights version the engine does not hold (any more)."""


@dataclass(frozen=True)
class EngineTimeouts:
    """Seconds. `generate` bounds the wait for one generate reply (or one streamed chunk)."""

    connect: float = 5.0
    generate: float = 900.0
    admin: float = 600.0      # weight updates (a drain waits for running sequences), pause(wait)
    control: float = 15.0     # health, metrics, abort, release, resume
    pool: float = 900.0       # waiting for a free pooled connection


@dataclass(frozen=True)
class WeightUpdateReport:
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
    backend: Backend
    resident_versions: tuple[int, ...] = ()   # held by the engine after the update
    evicted_versions: tuple[int, ...] = ()    # dropped while still pinned (resident cap)


class _NotSent(Exception):
    """The request never reached the engine (safe to retry anything)."""


def _decode(data: str | None, dtype: np.dtype) -> np.ndarray:
    if data is None:
        raise EngineError("engine reply is missing an array field")
    return np.frombuffer(base64.b64decode(data), dtype=dtype)


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


class EngineClient:
    """HTTP client for one engine server (see module docstring)."""

    def __init__(self, base_url: str, *, backend: Backend = "stalewise", model: str | None = None,
                 timeouts: EngineTimeouts | None = None, max_connections: int = 256,
                 retries: int = 3, retry_backoff_s: float = 0.2, ignore_eos: bool = False,
                 initial_version: int = 0, transport: httpx.AsyncBaseTransport | None = None
                 ) -> None:
        if backend not in ("stalewise", "vllm"):
            raise ValueError(f"backend must be 'stalewise' or 'vllm', got {backend!r}")
        self.base_url = base_url.rstrip("/")
        self.backend: Backend = backend
        self.timeouts = timeouts or EngineTimeouts()
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.ignore_eos = ignore_eos
        self._model = model
        self._card: dict | None = None
        self._version = initial_version
        self._update_log: list[tuple[int, KvPolicy]] = []
        self._http = httpx.AsyncClient(
            base_url=self.base_url, transport=transport,
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections),
            timeout=self._timeout(self.timeouts.control))

    # ---- lifecycle -------------------------------------------------------------------------
    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def weights_version(self) -> int:
        """The version this client last published (vLLM) or saw applied (embedded engine)."""
        return self._version

    # ---- transport ---------------------------------------------------------------------------
    def _timeout(self, read: float) -> httpx.Timeout:
        t = self.timeouts
        return httpx.Timeout(connect=t.connect, read=read, write=max(t.control, 30.0), pool=t.pool)

    def _where(self, path: str) -> str:
        return f"{self.backend} engine at {self.base_url}{path}"

    async def _send(self, method: str, path: str, *, read_timeout: float, idempotent: bool,
                    json_body: Any = None, params: dict | None = None) -> httpx.Response:
        attempt = 0
        while True:
            try:
                try:
                    return await self._http.request(method, path, json=json_body, params=params,
                                                    timeout=self._timeout(read_timeout))
                except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                    raise _NotSent(str(exc) or type(exc).__name__) from exc
            except _NotSent as exc:
                if attempt >= self.retries:
                    raise EngineError(f"cannot reach the {self._where(path)} after "
                                      f"{attempt + 1} attempts ({exc}); is the engine running "
                                      f"(`stalewise engine serve`) and the URL right?") from exc
            except httpx.TimeoutException as exc:
                if not idempotent or attempt >= self.retries:
                    raise EngineError(f"the {self._where(path)} did not answer within "
                                      f"{read_timeout:.0f}s ({type(exc).__name__}); not retried: "
                                      f"the request may still be running there") from exc
            except httpx.TransportError as exc:
                if not idempotent or attempt >= self.retries:
                    raise EngineError(f"connection to the {self._where(path)} failed mid-request "
                                      f"({type(exc).__name__}: {exc}); not retried") from exc
            attempt += 1
            await anyio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))

    def _check(self, response: httpx.Response, path: str) -> Any:
        if response.status_code == 409 and path == GENERATE_PATH:
            raise VersionNotResidentError(f"the {self._where(path)} answered 409: "
                                          f"{self._error_message(response)}")
        if response.status_code >= 400:
            raise EngineError(f"the {self._where(path)} answered {response.status_code}: "
                              f"{self._error_message(response)}")
        if not response.content:
            return None
        try:
            return response.json()
        except json.JSONDecodeError as exc:
            raise EngineError(f"the {self._where(path)} sent a reply that is not JSON: "
                              f"{response.text[:200]!r}") from exc

    @staticmethod
    def _error_message(response: httpx.Response) -> str:
        try:
            body = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return response.text[:500] or response.reason_phrase
        if isinstance(body, dict):
            error = body.get("error")
            if isinstance(error, dict) and "message" in error:
                return str(error["message"])
            if isinstance(error, str):
                return error
            if "detail" in body:
                return str(body["detail"])
            if "message" in body:
                return str(body["message"])
        return json.dumps(body)[:500]

    async def _call(self, method: str, path: str, *, read_timeout: float | None = None,
                    idempotent: bool = True, json_body: Any = None,
                    params: dict | None = None) -> Any:
        response = await self._send(method, path, read_timeout=read_timeout or self.timeouts.control,
                                    idempotent=idempotent, json_body=json_body, params=params)
        return self._check(response, path)

    # ---- InferenceEngine -----------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.backend == "vllm":
            if request.weights_version is not None:
                raise EngineError(f"request pinned to weights version {request.weights_version} "
                                  f"cannot be served by the {self._where('')}: {VLLM_CANNOT_PIN}")
            return await self._generate_vllm(request)
        request_id = uuid.uuid4().hex
        body = {"prompt_token_ids": [int(t) for t in request.prompt_token_ids],
                "params": request.params.model_dump(mode="json"),
                "session_id": request.session_id, "request_id": request_id,
                "ignore_eos": self.ignore_eos}
        if request.weights_version is not None:
            body["weights_version"] = int(request.weights_version)
        try:
            reply = await self._call("POST", GENERATE_PATH, idempotent=False,
                                     read_timeout=self.timeouts.generate, json_body=body)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.timeouts.control):
                try:
                    await self.abort(request_id)
                except EngineError:
                    pass  # the engine also aborts on disconnect
            raise
        return self._result_from_reply(reply)

    def _result_from_reply(self, reply: Any) -> GenerateResult:
        where = self._where(GENERATE_PATH)
        try:
            if reply.get("encoding") != "base64-le":
                raise EngineError(f"{where} used array encoding {reply.get('encoding')!r}; "
                                  f"this client reads 'base64-le'")
            topk = int(reply["topk"])
            extra = {}
            if topk:
                extra = dict(topk_ids=_decode(reply["topk_ids"], INT32),
                             topk_logprobs=_decode(reply["topk_logprobs"], FLOAT32))
            tokens = SampledTokens(
                token_ids=_decode(reply["token_ids"], INT32),
                sampler_logprobs=_decode(reply["sampler_logprobs"], FLOAT32),
                weights_versions=_decode(reply["weights_versions"], INT32),
                kv_versions=_decode(reply["kv_versions"], INT32),
                time_offsets=_decode(reply["time_offsets"], FLOAT32), **extra)
            if len(tokens) != int(reply["length"]):
                raise EngineError(f"{where} announced {reply['length']} tokens but sent "
                                  f"{len(tokens)}")
            if tokens.weights_versions.size:
                self._version = max(self._version, int(tokens.weights_versions.max()))
            return GenerateResult(tokens=tokens, finish_reason=reply["finish_reason"],
                                  prompt_tokens=int(reply["prompt_tokens"]),
                                  cached_prompt_tokens=int(reply["cached_prompt_tokens"]),
                                  engine_id=str(reply["engine_id"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise EngineError(f"{where} sent a malformed reply ({type(exc).__name__}: {exc})") from exc

    async def release_session(self, session_id: str) -> None:
        """Forget the session's retained KV and, on the embedded engine, its version pin."""
        if self.backend == "vllm":
            return  # vLLM's prefix cache is automatic and keyed by content, not by session
        await self._call("POST", "/stalewise/release_session", json_body={"session_id": session_id})

    def pinned(self, version: int) -> PinnedEngine:
        """An `InferenceEngine` serving every request with weights `version` (embedded engine)."""
        if self.backend == "vllm":
            raise EngineError(f"cannot pin the {self._where('')} to weights version {version}: "
                              f"{VLLM_CANNOT_PIN}")
        return PinnedEngine(self, version)

    async def _model_card(self) -> dict:
        """The served model's `/v1/models` entry, fetched once."""
        if self._card is None:
            reply = await self._call("GET", "/v1/models")
            try:
                card = dict(reply["data"][0])
                card["id"] = str(card["id"])
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise EngineError(f"the {self._where('/v1/models')} lists no model") from exc
            self._card = card
        return self._card

    async def max_model_len(self) -> int | None:
        """The served model's context window in tokens (both backends report it), or None."""
        value = (await self._model_card()).get("max_model_len")
        return int(value) if isinstance(value, int) and value > 0 else None

    # ---- vLLM path -------------------------------------------------------------------------------
    async def model_name(self) -> str:
        if self._model is None:
            self._model = (await self._model_card())["id"]
        return self._model

    async def _generate_vllm(self, request: GenerateRequest) -> GenerateResult:
        path = "/v1/completions"
        body = completion_body(request, await self.model_name(), self.ignore_eos)
        topk = request.params.logprobs_topk
        acc = CompletionStream(topk, self._version, len(self._update_log))
        attempt = 0
        while True:
            try:
                await self._stream_vllm(path, body, acc)
                break
            except _NotSent as exc:
                if attempt >= self.retries:
                    raise EngineError(f"cannot reach the {self._where(path)} ({exc}); is "
                                      f"`vllm serve` running?") from exc
                attempt += 1
                await anyio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
        if acc.finish_reason is None:
            raise EngineError(f"the {self._where(path)} stream ended without a finish_reason")
        return GenerateResult(tokens=acc.record(), finish_reason=acc.finish_reason,
                              prompt_tokens=acc.prompt_tokens or len(request.prompt_token_ids),
                              cached_prompt_tokens=acc.cached_tokens,
                              engine_id=f"vllm@{self.base_url}")

    async def _stream_vllm(self, path: str, body: dict, acc: CompletionStream) -> None:
        try:
            async with self._http.stream("POST", path, json=body,
                                         timeout=self._timeout(self.timeouts.generate)) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise EngineError(f"the {self._where(path)} answered {response.status_code}: "
                                      f"{self._error_message(response)}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    acc.add_chunk(json.loads(data), self._version, self._update_log)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise _NotSent(str(exc) or type(exc).__name__) from exc
        except httpx.TimeoutException as exc:
            raise EngineError(f"the {self._where(path)} sent nothing for "
                              f"{self.timeouts.generate:.0f}s; not retried") from exc
        except httpx.TransportError as exc:
            raise EngineError(f"stream from the {self._where(path)} broke "
                              f"({type(exc).__name__}: {exc}); not retried") from exc
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"the {self._where(path)} sent a malformed stream chunk "
                              f"({type(exc).__name__}: {exc})") from exc

    # ---- admin ---------------------------------------------------------------------------------
    async def update_weights(self, path: str, version: int, *, mode: UpdateMode = "inflight",
                             kv: KvPolicy = "recompute") -> WeightUpdateReport:
        """Make the engine serve the checkpoint at `path` as policy `version`.

        `inflight`: running unpinned requests continue under the new weights (`kv` retain or
        recompute their cache); `drain`: they finish under the old ones first; `pin` (embedded
        engine only): the new version becomes current, older ones stay resident while requests
        or sessions are pinned to them, and nothing running changes weights."""
        if mode not in ("inflight", "drain", "pin") or kv not in ("retain", "recompute"):
            raise ValueError(f"mode must be inflight|drain|pin and kv retain|recompute, "
                             f"got {mode}/{kv}")
        if self.backend == "vllm":
            if mode == "pin":
                raise EngineError(f"weight update mode 'pin' is not available on the "
                                  f"{self._where('')}: {VLLM_CANNOT_PIN}")
            return await self._update_vllm(path, version, mode, kv)
        reply = await self._call("POST", "/stalewise/update_weights",
                                 read_timeout=self.timeouts.admin, json_body={
                                     "path": str(path), "version": int(version),
                                     "mode": mode, "kv": kv})
        self._version = int(reply["version"])
        return WeightUpdateReport(
            version=int(reply["version"]), previous_version=int(reply["previous_version"]),
            mode=reply["mode"], kv=reply["kv"], pause_s=float(reply["pause_s"]),
            wait_s=float(reply["wait_s"]), in_flight_sequences=int(reply["in_flight_sequences"]),
            recomputed_tokens=int(reply["recomputed_tokens"]),
            invalidated_sessions=int(reply["invalidated_sessions"]),
            already_applied=bool(reply.get("already_applied", False)), backend="stalewise",
            resident_versions=tuple(int(v) for v in reply.get("resident_versions") or ()),
            evicted_versions=tuple(int(v) for v in reply.get("evicted_versions") or ()))

    async def _update_vllm(self, path: str, version: int, mode: UpdateMode,
                           kv: KvPolicy) -> WeightUpdateReport:
        if version == self._version:
            return WeightUpdateReport(version, version, mode, kv, 0.0, 0.0, 0, 0, 0, True, "vllm")
        if version < self._version:
            raise EngineError(f"weights version {version} is older than {self._version}, "
                              f"which this client already published")
        previous = self._version
        started = time.monotonic()
        await self.pause("wait" if mode == "drain" else "keep")
        paused_at = time.monotonic()
        try:
            await self._call("POST", "/collective_rpc", read_timeout=self.timeouts.admin,
                             json_body={"method": "stalewise_load_checkpoint",
                                        "args": [str(path), str(int(version))]})
            if mode == "drain" or kv == "recompute":
                await self._call("POST", "/reset_prefix_cache", read_timeout=self.timeouts.admin,
                                 params={"reset_running_requests": "true"})
            self._update_log.append((int(version), "recompute" if mode == "drain" else kv))
            self._version = int(version)
        finally:
            await self.resume()
        return WeightUpdateReport(version, previous, mode, kv,
                                  pause_s=time.monotonic() - paused_at,
                                  wait_s=paused_at - started, in_flight_sequences=-1,
                                  recomputed_tokens=-1, invalidated_sessions=-1,
                                  already_applied=False, backend="vllm",
                                  resident_versions=(int(version),))

    async def pause(self, mode: PauseMode = "keep") -> None:
        """Stop generating (`keep`: freeze running requests; `wait`: let them finish first;
        `abort`: abort them). New requests queue until `resume`."""
        await self._call("POST", "/pause", params={"mode": mode}, read_timeout=self.timeouts.admin)

    async def resume(self) -> None:
        await self._call("POST", "/resume")

    async def abort(self, request_id: str | None = None) -> int:
        """Abort one request, or all (None). Embedded engine only; returns how many."""
        if self.backend == "vllm":
            raise EngineError("vLLM aborts a request when its connection closes: cancel the "
                              "generate call instead")
        body = {"all": True} if request_id is None else {"request_id": request_id}
        reply = await self._call("POST", "/stalewise/abort", json_body=body)
        return int(reply["aborted"])

    async def metrics(self) -> dict[str, float]:
        if self.backend == "vllm":
            response = await self._send("GET", "/metrics", read_timeout=self.timeouts.control,
                                        idempotent=True)
            if response.status_code >= 400:
                raise EngineError(f"the {self._where('/metrics')} answered {response.status_code}")
            return parse_prometheus(response.text)
        return {str(k): float(v) for k, v in (await self._call("GET", "/stalewise/metrics")).items()}

    async def health(self) -> bool:
        """True when the engine answers /health with 200; never raises."""
        try:
            response = await self._http.get("/health", timeout=self._timeout(self.timeouts.control))
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def wait_ready(self, timeout: float = 120.0) -> None:
        with anyio.move_on_after(timeout):
            while not await self.health():
                await anyio.sleep(0.2)
            return
        raise EngineError(f"the {self._where('/health')} did not become healthy in {timeout:.0f}s")


class PinnedEngine:
    """`InferenceEngine` view of one client: every request is served with one weights version.

    The orchestrator hands this to the agent loop for a trajectory that must stay on the version
    it started with; the loop itself is unchanged. `release_session` also drops the session's
    pin, which lets the engine free the version once nothing else uses it."""

    def __init__(self, client: EngineClient, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weights version must be an int >= 0, got {version!r}")
        self.client = client
        self.version = version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.weights_version not in (None, self.version):
            raise ValueError(f"request is pinned to weights version {request.weights_version} "
                             f"but this engine view serves version {self.version}")
        return await self.client.generate(dataclasses.replace(request, weights_version=self.version))

    async def release_session(self, session_id: str) -> None:
        await self.client.release_session(session_id)
