"""What every engine client shares: one retrying HTTP transport and the routes both backends serve.

`EngineTransport` owns the connection pool and the failure policy; the clients of each kind
(`orchestrator.engines.embedded.EmbeddedEngineClient`, `orchestrator.engines.vllm.VllmEngineClient`)
only say which route to call and how to read the reply. `HttpEngineClient` is their common base
(the `core.engine_api.EngineClient` contract over HTTP): lifecycle, the version this client
knows, `/health`, `/v1/models`, `/pause` and `/resume`.

Failure policy (every client inherits it):
- Every failure is an `EngineError` whose message names the kind, the URL and route, and
  what to do.
- Timeouts are explicit per call class (`EngineTimeouts`); the connection pool is bounded.
- Retries (`retries` more attempts, backoff `retry_backoff_s * 2**k`) happen only where they
  cannot duplicate work: connection failures (the request never left) for every call, and read
  timeouts or broken connections only for calls marked idempotent. A streamed call is retried
  only before its response started.
No torch here.
"""

from __future__ import annotations

import json
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, get_args

import anyio
import httpx
import sniffio
from pydantic_core import from_json

from core.engine_api import (
    EngineError,
    EngineKind,
    GenerateRequest,
    GenerateResult,
    InferenceEngine,
    KvPolicy,
    PauseMode,
    UpdateMode,
    WeightUpdateReport,
)
from orchestrator.engines.http1 import Http1Client, Reply, StreamedReply


@dataclass(frozen=True)
class EngineTimeouts:
    """Seconds. `generate` bounds the wait for one generate reply (or one streamed chunk)."""

    connect: float = 5.0
    generate: float = 900.0
    admin: float = 600.0      # weight updates (a drain waits for running sequences), pause(wait)
    control: float = 15.0     # health, metrics, abort, release, resume
    pool: float = 900.0       # waiting for a free pooled connection


class _NotSent(Exception):
    """The request never reached the engine (safe to retry anything)."""


_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


# httpcore's pool (1.0.9) goes over all its connections and queued requests each time a request
# starts or ends, so a call's CPU grows with the pool: with 256 connections and 1,000 calls in
# flight, one call cost the orchestrator 20-40 ms (bench/engine_client.py). So the httpx
# connections are split into pools of at most this many, and calls queue for a connection in
# the transport's own queue: no pool ever holds a queued request.
POOL_SIZE = 8


class _Pools:
    """`limit` connections to one server behind one first-come-first-served queue for a free
    connection. Requests to an `http://` server on asyncio go through the lean client
    (`orchestrator.engines.http1`); to `https://` or a proxied server, through an injected
    `transport` (tests) or on another event loop (trio), through httpx clients of at most
    `POOL_SIZE` connections each, made on first use."""

    def __init__(self, base_url: str, limit: int, timeout: httpx.Timeout,
                 transport: httpx.AsyncBaseTransport | None) -> None:
        if limit < 1:
            raise ValueError(f"max_connections must be at least 1, got {limit}")
        self.base_url, self.limit, self._timeout, self._transport = (
            base_url, limit, timeout, transport)
        url = httpx.URL(base_url)
        self.lean = (Http1Client(base_url)
                     if transport is None and url.scheme == "http" and not _proxied(url.host)
                     else None)
        self.clients: list[httpx.AsyncClient] = []
        self.free: list[int] = []  # connections not in use, per httpx client
        self._slots = anyio.Semaphore(limit)

    @asynccontextmanager
    async def connection(self, wait_s: float) -> AsyncIterator[Http1Client | httpx.AsyncClient]:
        """A client with a connection free for one request, held until the block ends (the lean
        one where it can serve); waits at most `wait_s` for a connection (then
        `httpx.PoolTimeout`: the request was not sent)."""
        try:
            self._slots.acquire_nowait()
        except anyio.WouldBlock:
            with anyio.move_on_after(wait_s) as waiting:
                await self._slots.acquire()
            if waiting.cancelled_caught:
                raise httpx.PoolTimeout(f"all {self.limit} connections stayed busy for "
                                        f"{wait_s:g}s") from None
        try:
            if self.lean is not None and sniffio.current_async_library() == "asyncio":
                yield self.lean
                return
            # The first httpx client with a free connection: at low load every call shares one
            # pool's kept-alive connections, as one client would.
            index = self._free_client()
            self.free[index] -= 1
            try:
                yield self.clients[index]
            finally:
                self.free[index] += 1
        finally:
            self._slots.release()

    def _free_client(self) -> int:
        if not self.clients:
            sizes = [min(POOL_SIZE, self.limit - start)
                     for start in range(0, self.limit, POOL_SIZE)]
            verify = httpx.create_ssl_context()  # one for all the clients: each costs ~25 ms
            self.clients = [httpx.AsyncClient(
                base_url=self.base_url, transport=self._transport, timeout=self._timeout,
                verify=verify,
                limits=httpx.Limits(max_connections=size, max_keepalive_connections=size))
                for size in sizes]
            self.free = sizes
        return next(i for i, free in enumerate(self.free) if free)

    async def aclose(self) -> None:
        if self.lean is not None:
            await self.lean.aclose()
        for client in self.clients:
            await client.aclose()


def _proxied(host: str) -> bool:
    """Whether httpx (which reads the proxy environment) would send to `host` through a proxy."""
    proxies = urllib.request.getproxies()
    return bool(proxies.get("http") or proxies.get("all")) and not urllib.request.proxy_bypass(
        host)


class EngineTransport:
    """HTTP to one engine server with the failure policy of the module docstring."""

    def __init__(self, base_url: str, *, kind: EngineKind, serve_hint: str,
                 timeouts: EngineTimeouts, max_connections: int, retries: int,
                 retry_backoff_s: float, transport: httpx.AsyncBaseTransport | None = None
                 ) -> None:
        self.base_url = base_url.rstrip("/")
        self.kind = kind
        self.serve_hint = serve_hint  # the command that starts this kind of engine
        self.timeouts = timeouts
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self._pools = _Pools(self.base_url, max_connections, self.timeout(timeouts.control),
                             transport)

    async def aclose(self) -> None:
        await self._pools.aclose()

    def timeout(self, read: float) -> httpx.Timeout:
        t = self.timeouts
        return httpx.Timeout(connect=t.connect, read=read, write=max(t.control, 30.0), pool=t.pool)

    def where(self, path: str) -> str:
        return f"{self.kind} engine at {self.base_url}{path}"

    def sender(self, path: str) -> str:
        """Who sent a reply, for `core.engine_api`'s decoding errors."""
        return f"the {self.where(path)}"

    # ---- one request -----------------------------------------------------------------------
    async def send(self, method: str, path: str, *, read_timeout: float, idempotent: bool,
                   json_body: Any = None, params: dict | None = None) -> httpx.Response | Reply:
        """The response, whatever its status; retried as the module docstring says."""
        attempt = 0
        while True:
            try:
                try:
                    async with self._pools.connection(self.timeouts.pool) as http:
                        return await http.request(method, path, params=params,
                                                  timeout=self.timeout(read_timeout),
                                                  **_body(json_body))
                except _NOT_SENT as exc:
                    raise _NotSent(str(exc) or type(exc).__name__) from exc
            except _NotSent as exc:
                if attempt >= self.retries:
                    raise self._unreachable(path, attempt, exc) from exc
            except httpx.TimeoutException as exc:
                if not idempotent or attempt >= self.retries:
                    raise EngineError(f"the {self.where(path)} did not answer within "
                                      f"{read_timeout:.0f}s ({type(exc).__name__}); not retried: "
                                      f"the request may still be running there") from exc
            except httpx.TransportError as exc:
                if not idempotent or attempt >= self.retries:
                    raise EngineError(f"connection to the {self.where(path)} failed mid-request "
                                      f"({type(exc).__name__}: {exc}); not retried") from exc
            attempt += 1
            await self._backoff(attempt)

    async def call(self, method: str, path: str, *, read_timeout: float | None = None,
                   idempotent: bool = True, json_body: Any = None, params: dict | None = None,
                   errors: Mapping[int, type[EngineError]] | None = None) -> Any:
        """The JSON reply (None when empty). A status >= 400 raises `errors[status]`, or
        `EngineError`, with the server's own message."""
        response = await self.send(method, path, idempotent=idempotent, json_body=json_body,
                                   params=params,
                                   read_timeout=read_timeout or self.timeouts.control)
        self.raise_for_status(response, path, errors)
        if not response.content:
            return None
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EngineError(f"the {self.where(path)} sent a reply that is not JSON: "
                              f"{response.text[:200]!r}") from exc

    def raise_for_status(self, response: httpx.Response | Reply, path: str,
                         errors: Mapping[int, type[EngineError]] | None = None) -> None:
        if response.status_code >= 400:
            error = (errors or {}).get(response.status_code, EngineError)
            raise error(f"the {self.where(path)} answered {response.status_code}: "
                        f"{error_message(response)}")

    # ---- one streamed request (server-sent events) -------------------------------------------
    async def stream_events(self, path: str, json_body: Any,
                            on_event: Callable[[dict], None],
                            errors: Mapping[int, type[EngineError]] | None = None) -> None:
        """POST, then call `on_event` with each `data:` JSON object until `[DONE]` or the end.

        Retried only when the request never left; a chunk `on_event` cannot read (KeyError,
        TypeError, ValueError) is an `EngineError` naming the route. A status >= 400 before the
        stream starts raises `errors[status]`, or `EngineError`."""
        attempt = 0
        while True:
            try:
                return await self._stream_once(path, json_body, on_event, errors)
            except _NotSent as exc:
                if attempt >= self.retries:
                    raise self._unreachable(path, attempt, exc) from exc
            attempt += 1
            await self._backoff(attempt)

    async def _stream_once(self, path: str, json_body: Any, on_event: Callable[[dict], None],
                           errors: Mapping[int, type[EngineError]] | None) -> None:
        read = self.timeouts.generate
        try:
            async with self._pools.connection(self.timeouts.pool) as http, \
                    http.stream(
                    "POST", path, timeout=self.timeout(read), **_body(json_body)) as response:
                if response.status_code >= 400:
                    await response.aread()
                    self.raise_for_status(response, path, errors)
                batches = (response.aiter_data() if isinstance(response, StreamedReply)
                           else _data_fields(response))
                async with aclosing(batches):  # closed here, not by the loop's finalizer
                    async for batch in batches:
                        if _DONE in batch:
                            _parse_events(batch[:batch.index(_DONE)], on_event)
                            return
                        _parse_events(batch, on_event)
        except _NOT_SENT as exc:
            raise _NotSent(str(exc) or type(exc).__name__) from exc
        except httpx.TimeoutException as exc:
            raise EngineError(f"the {self.where(path)} sent nothing for {read:.0f}s; "
                              f"not retried") from exc
        except httpx.TransportError as exc:
            raise EngineError(f"stream from the {self.where(path)} broke "
                              f"({type(exc).__name__}: {exc}); not retried") from exc
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"the {self.where(path)} sent a malformed stream chunk "
                              f"({type(exc).__name__}: {exc})") from exc

    # ---- health ------------------------------------------------------------------------------
    async def healthy(self) -> bool:
        """True when `/health` answers 200; never raises, never retries."""
        try:
            async with self._pools.connection(self.timeouts.pool) as http:
                response = await http.request("GET", "/health",
                                              timeout=self.timeout(self.timeouts.control))
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def _unreachable(self, path: str, attempt: int, exc: Exception) -> EngineError:
        return EngineError(f"cannot reach the {self.where(path)} after {attempt + 1} attempts "
                           f"({exc}); is the engine running ({self.serve_hint}) and the URL "
                           f"right?")

    async def _backoff(self, attempt: int) -> None:
        await anyio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))


_JSON_CONTENT = {"Content-Type": "application/json"}


def _body(json_body: Any) -> dict[str, Any]:
    """The request keywords for `json_body`: a value to write as JSON, or `bytes` that are its
    JSON already (a body pydantic serialised, several times faster than `json.dumps`)."""
    if isinstance(json_body, bytes):
        return {"content": json_body, "headers": _JSON_CONTENT}
    return {"json": json_body}


_DONE = b"[DONE]"  # the data of the event that ends an OpenAI-style stream


async def _data_fields(response: httpx.Response) -> AsyncIterator[list[bytes]]:
    """The `data:` fields of a server-sent event stream read by httpx, one to a list."""
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            yield [line[5:].strip().encode()]


def _parse_events(batch: list[bytes], on_event: Callable[[Any], None]) -> None:
    """`on_event` with each `data:` field of `batch` read as JSON: parsed as one array, which
    costs about a quarter less than one parse each, by pydantic's parser (jiter), which reads
    vLLM's chunks in half the time `json.loads` takes (an invalid field is its ValueError)."""
    if len(batch) == 1:
        on_event(from_json(batch[0]))
        return
    events = from_json(b"[" + b",".join(batch) + b"]")
    if len(events) != len(batch):  # a field held more than one value
        raise ValueError(f"{len(batch)} data fields held {len(events)} JSON values")
    for event in events:
        on_event(event)


def error_message(response: httpx.Response | Reply) -> str:
    """The message of an error reply: OpenAI's `{"error": {"message"}}`, FastAPI's `detail`..."""
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


class HttpEngineClient(ABC):
    """`core.engine_api.EngineClient` over HTTP, with the admin calls both servers have.

    Subclasses are the kinds; build one with `orchestrator.engines.embedded.engine_client`."""

    kind: ClassVar[EngineKind]
    serve_hint: ClassVar[str]
    can_pin: ClassVar[bool]   # keeps several weights versions resident (`pinned`, mode "pin")

    def __init__(self, base_url: str, *, model: str | None = None,
                 timeouts: EngineTimeouts | None = None, max_connections: int = 256,
                 retries: int = 3, retry_backoff_s: float = 0.2, ignore_eos: bool = False,
                 initial_version: int = 0, transport: httpx.AsyncBaseTransport | None = None
                 ) -> None:
        self.http = EngineTransport(base_url, kind=self.kind, serve_hint=self.serve_hint,
                                    timeouts=timeouts or EngineTimeouts(),
                                    max_connections=max_connections, retries=retries,
                                    retry_backoff_s=retry_backoff_s, transport=transport)
        self.ignore_eos = ignore_eos
        self._model = model
        self._card: dict | None = None
        self._version = initial_version

    # ---- lifecycle ---------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return self.http.base_url

    @property
    def timeouts(self) -> EngineTimeouts:
        return self.http.timeouts

    @property
    def weights_version(self) -> int:
        """The version this client last published (vLLM) or saw applied (embedded engine)."""
        return self._version

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> HttpEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- per backend -------------------------------------------------------------------------
    @abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    @abstractmethod
    async def release_session(self, session_id: str) -> None:
        """Forget the session's retained KV and, on the embedded engine, its version pin."""

    @abstractmethod
    async def update_weights(self, path: str, version: int, *, mode: UpdateMode = "inflight",
                             kv: KvPolicy = "recompute") -> WeightUpdateReport:
        """Make the engine serve the checkpoint at `path` as policy `version`.

        `inflight`: running unpinned requests continue under the new weights (`kv` retain or
        recompute their cache); `drain`: they finish under the old ones first; `pin` (engines
        with `can_pin`): the new version becomes current, older ones stay resident while
        requests or sessions are pinned to them, and nothing running changes weights."""

    @abstractmethod
    async def abort(self, request_id: str | None = None) -> int:
        """Abort one request, or all (None); returns how many."""

    @abstractmethod
    async def metrics(self) -> dict[str, float]: ...

    @abstractmethod
    def pinned(self, version: int) -> InferenceEngine:
        """An `InferenceEngine` serving every request with weights `version`."""

    # ---- routes both backends serve ----------------------------------------------------------
    async def pause(self, mode: PauseMode = "keep") -> None:
        """Stop generating (`keep`: freeze running requests; `wait`: let them finish first;
        `abort`: abort them). New requests queue until `resume`."""
        await self.http.call("POST", "/pause", params={"mode": mode},
                             read_timeout=self.timeouts.admin)

    async def resume(self) -> None:
        await self.http.call("POST", "/resume")

    async def health(self) -> bool:
        """True when the engine answers /health with 200; never raises."""
        return await self.http.healthy()

    async def wait_ready(self, timeout: float = 120.0) -> None:
        with anyio.move_on_after(timeout):
            while not await self.health():
                await anyio.sleep(0.2)
            return
        raise EngineError(f"the {self.http.where('/health')} did not become healthy in "
                          f"{timeout:.0f}s")

    async def model_name(self) -> str:
        if self._model is None:
            self._model = (await self._model_card())["id"]
        return self._model

    async def max_model_len(self) -> int | None:
        """The served model's context window in tokens (both backends report it), or None."""
        value = (await self._model_card()).get("max_model_len")
        return int(value) if isinstance(value, int) and value > 0 else None

    async def _model_card(self) -> dict:
        """The served model's `/v1/models` entry, fetched once."""
        if self._card is None:
            reply = await self.http.call("GET", "/v1/models")
            try:
                card = dict(reply["data"][0])
                card["id"] = str(card["id"])
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise EngineError(f"the {self.http.where('/v1/models')} lists no model") from exc
            self._card = card
        return self._card

    @staticmethod
    def _check_update_args(mode: str, kv: str) -> None:
        if mode not in get_args(UpdateMode) or kv not in get_args(KvPolicy):
            raise ValueError(f"mode must be inflight|drain|pin and kv retain|recompute, "
                             f"got {mode}/{kv}")
