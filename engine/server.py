"""The engine's HTTP server: starlette routes over one `Engine`, served by uvicorn.

Routes (the `/stalewise/*` schemas are `core.engine_api`'s, shared with the client; the
vLLM-compatible ones are in `engine.completions`; all described in docs/engine.md):

    GET  /health  /v1/models  /is_paused  /metrics  /stalewise/metrics  /stalewise/info
    POST /v1/completions        vLLM-compatible; token-id prompts, logprobs, token_id:N tokens
    POST /stalewise/generate    token-level; every field of SampledTokens; optional weights_version
    POST /stalewise/update_weights  /stalewise/abort  /stalewise/release_session
    POST /pause?mode=keep|wait|abort  /resume  /reset_prefix_cache  /collective_rpc  (vLLM's)

Guarantees: a request whose client disconnects is aborted in the engine (its row is freed at
the next step boundary); bad input gets a 400 with an OpenAI-style error body
`{"error": {"message", "type", "code"}}` whose message says what to change; a generate pinned
to a weights version that is not resident gets a 409 naming the version and the resident ones;
a failed engine answers 503 on every route, including /health.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from config.engine import EngineServerConfig
from core.engine_api import (
    ABORT_ROUTE,
    GENERATE_ROUTE,
    INFO_ROUTE,
    METRICS_ROUTE,
    RELEASE_SESSION_ROUTE,
    UPDATE_WEIGHTS_ROUTE,
    AbortBody,
    AbortReply,
    GenerateBody,
    GenerateResult,
    KvPolicy,
    ReleaseSessionBody,
    ReleaseSessionReply,
    UpdateMode,
    UpdateWeightsBody,
    UpdateWeightsReply,
    encode_generate_reply,
)
from core.listen import listen
from core.tokenizer import has_tokenizer, load_tokenizer
from engine.checkpoint import CheckpointError
from engine.completions import Completions
from engine.core import Engine
from engine.http_util import (
    HttpError,
    error_response,
    parse,
    submit,
    until_done_or_disconnect,
    wait,
)
from engine.requests import EngineStopped, RequestError, SamplingSpec

RPC_METHODS = ("stalewise_load_checkpoint", "stalewise_weights_version")


class EngineApp:
    """The stalewise and control route handlers, bound to one engine."""

    def __init__(self, engine: Engine, *, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def _check_alive(self) -> None:
        if self.engine.failure is not None:
            raise HttpError(503, f"engine failed: {self.engine.failure!r}; restart it")

    # ---- stalewise routes ------------------------------------------------------------------
    async def generate(self, request: Request) -> Response:
        body: GenerateBody = await parse(request, GenerateBody)
        try:
            spec = SamplingSpec.from_params(body.params, ignore_eos=body.ignore_eos)
        except RequestError as exc:
            raise HttpError(400, str(exc)) from exc
        request_id = body.request_id or uuid.uuid4().hex
        future = submit(self.engine, body.prompt_token_ids, spec, session_id=body.session_id,
                        request_id=request_id, weights_version=body.weights_version)
        output = await until_done_or_disconnect(self.engine, request, future, request_id)
        result = GenerateResult(
            tokens=output.to_record(), finish_reason=output.finish_reason or "abort",
            prompt_tokens=output.prompt_tokens, cached_prompt_tokens=output.cached_prompt_tokens,
            engine_id=self.engine.engine_id)
        return JSONResponse(encode_generate_reply(result, request_id=request_id))

    async def update_weights(self, request: Request) -> Response:
        body: UpdateWeightsBody = await parse(request, UpdateWeightsBody)
        report = await self._update(body.path, body.version, body.mode, body.kv)
        return JSONResponse(report)

    async def _update(self, path: str, version: int, mode: UpdateMode, kv: KvPolicy) -> dict:
        self._check_alive()
        try:
            state = await anyio.to_thread.run_sync(self.engine.load_weights, path)
            report: UpdateWeightsReply = await wait(self.engine.update_weights(
                state, version=version, path=path, mode=mode, kv=kv))
        except (CheckpointError, RequestError) as exc:
            raise HttpError(400, str(exc)) from exc
        except EngineStopped as exc:
            raise HttpError(503, str(exc)) from exc
        return report.model_dump(mode="json")

    async def abort(self, request: Request) -> Response:
        body: AbortBody = await parse(request, AbortBody)
        if body.request_id is None and not body.all:
            raise HttpError(400, "give request_id, or all=true to abort every request")
        count = await wait(self.engine.abort(None if body.all else body.request_id))
        return JSONResponse(AbortReply(aborted=count).model_dump(mode="json"))

    async def release_session(self, request: Request) -> Response:
        body: ReleaseSessionBody = await parse(request, ReleaseSessionBody)
        tokens = await wait(self.engine.release_session(body.session_id))
        return JSONResponse(ReleaseSessionReply(session_id=body.session_id,
                                                released_tokens=tokens).model_dump(mode="json"))

    async def metrics_json(self, request: Request) -> Response:
        return JSONResponse(self.engine.snapshot())

    async def metrics_text(self, request: Request) -> Response:
        lines = []
        for key, value in self.engine.snapshot().items():
            name = "stalewise:" + key.replace("/", "_")
            lines.append(f"# TYPE {name} gauge\n{name} {value}")
        return PlainTextResponse("\n".join(lines) + "\n")

    async def info(self, request: Request) -> Response:
        return JSONResponse({
            "engine_id": self.engine.engine_id, "model": self.model_name,
            "model_dir": str(self.engine.model_dir), "weights_path": self.engine.weights_path,
            "weights_version": self.engine.version, "max_model_len": self.engine.max_len,
            "vocab_size": self.engine.vocab_size, "eos_token_ids": sorted(self.engine.eos_ids),
            "paused": self.engine.paused,
            "resident_versions": list(self.engine.resident_versions),
            "config": self._config(),
        })

    def _config(self) -> dict:
        """The EngineServerConfig fields as the running engine holds them."""
        import torch

        engine = self.engine
        return {"max_batch": engine.max_batch, "session_cache_mb": engine.session_cache_mb,
                "max_resident_versions": engine.max_resident_versions,
                "max_model_len": engine.max_len, "max_prefill_tokens": engine.max_prefill_tokens,
                "threads": torch.get_num_threads(), "dtype": engine.dtype,
                "served_model_name": self.model_name,
                "log_level": logging.getLevelName(logging.getLogger("uvicorn.error").level).lower()}

    async def health(self, request: Request) -> Response:
        self._check_alive()
        return JSONResponse({"status": "ok", "engine_id": self.engine.engine_id,
                             "weights_version": self.engine.version,
                             "resident_versions": list(self.engine.resident_versions)})

    # ---- vLLM-compatible control routes --------------------------------------------------------
    async def pause(self, request: Request) -> Response:
        mode = request.query_params.get("mode")
        if mode is None:
            legacy_wait = request.query_params.get("wait_for_inflight_requests", "false")
            mode = "wait" if legacy_wait.lower() == "true" else "keep"
        try:
            await wait(self.engine.pause(mode))  # type: ignore[arg-type]
        except RequestError as exc:
            raise HttpError(400, str(exc)) from exc
        return JSONResponse({"status": "paused"})

    async def resume(self, request: Request) -> Response:
        await wait(self.engine.resume())
        return JSONResponse({"status": "resumed"})

    async def is_paused(self, request: Request) -> Response:
        return JSONResponse({"is_paused": self.engine.paused})

    async def reset_prefix_cache(self, request: Request) -> Response:
        running = request.query_params.get("reset_running_requests", "false").lower() == "true"
        result = await wait(self.engine.reset_cache(reset_running=running))
        return JSONResponse({"status": "ok", **result})

    async def collective_rpc(self, request: Request) -> Response:
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            raise HttpError(400, f"request body is not valid JSON: {exc}") from exc
        method, args = body.get("method"), list(body.get("args") or [])
        if method == "stalewise_weights_version":
            return JSONResponse({"results": [self.engine.version]})
        if method == "stalewise_load_checkpoint":
            if len(args) != 2:
                raise HttpError(400, "stalewise_load_checkpoint takes args [path, version]")
            try:
                version = int(args[1])
            except ValueError as exc:
                raise HttpError(400, f"version {args[1]!r} is not an integer") from exc
            report = await self._update(str(args[0]), version, "inflight", "retain")
            return JSONResponse({"results": [report]})
        raise HttpError(400, f"method {method!r} is not available on the embedded engine; "
                             f"supported: {', '.join(RPC_METHODS)}")

def _guard(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except HttpError as exc:
            return error_response(exc.status, exc.message)
        except EngineStopped as exc:
            return error_response(503, str(exc))
    return guarded


def build_app(engine: Engine, *, model_name: str, tokenizer: Any | None = None,
              manage_engine: bool = True) -> Starlette:
    """The starlette app; with `manage_engine`, its lifespan starts and stops the engine."""
    api = EngineApp(engine, model_name=model_name)
    completions = Completions(engine, model_name=model_name, tokenizer=tokenizer)
    get, post = ["GET"], ["POST"]
    routes = [
        Route("/health", _guard(api.health), methods=get),
        Route("/v1/models", _guard(completions.models), methods=get),
        Route("/v1/completions", _guard(completions.completions), methods=post),
        Route("/metrics", _guard(api.metrics_text), methods=get),
        Route("/pause", _guard(api.pause), methods=post),
        Route("/resume", _guard(api.resume), methods=post),
        Route("/is_paused", _guard(api.is_paused), methods=get),
        Route("/reset_prefix_cache", _guard(api.reset_prefix_cache), methods=post),
        Route("/collective_rpc", _guard(api.collective_rpc), methods=post),
        Route(GENERATE_ROUTE, _guard(api.generate), methods=post),
        Route(UPDATE_WEIGHTS_ROUTE, _guard(api.update_weights), methods=post),
        Route(ABORT_ROUTE, _guard(api.abort), methods=post),
        Route(RELEASE_SESSION_ROUTE, _guard(api.release_session), methods=post),
        Route(METRICS_ROUTE, _guard(api.metrics_json), methods=get),
        Route(INFO_ROUTE, _guard(api.info), methods=get),
    ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await anyio.to_thread.run_sync(engine.stop)

    return Starlette(routes=routes, lifespan=lifespan)


def _load_tokenizer(model_dir: Path) -> Any | None:
    return load_tokenizer(model_dir) if has_tokenizer(model_dir) else None


def serve(model_dir: str | Path, cfg: EngineServerConfig | None = None, *,
          host: str = "127.0.0.1", port: int = 8000, port_file: str | Path | None = None,
          version: int = 0, seed: int = 0) -> None:
    """Bind the port (0 = any free port), load the model, write the bound port to `port_file`,
    serve. The port is bound first, so that a port in use (or one this machine cannot bind)
    fails at once rather than after a load that can take minutes; a connection made during the
    load waits in the socket's backlog until the model is served. `port_file` is written only
    once the model has loaded: what waits on it (a job's launcher) then finds a server."""
    import torch
    import uvicorn
    from transformers.utils import logging as hf_logging

    cfg = cfg or EngineServerConfig()
    sock = listen(host, port, backlog=2048)
    try:
        hf_logging.disable_progress_bar()
        torch.set_num_threads(cfg.threads)
        model_dir = Path(model_dir)
        engine = Engine(model_dir, version=version, max_batch=cfg.max_batch,
                        session_cache_mb=cfg.session_cache_mb, seed=seed,
                        max_prefill_tokens=cfg.max_prefill_tokens,
                        max_model_len=cfg.max_model_len,
                        max_resident_versions=cfg.max_resident_versions, dtype=cfg.dtype)
        app = build_app(engine, model_name=cfg.served_model_name or str(model_dir),
                        tokenizer=_load_tokenizer(model_dir))
    except BaseException:
        sock.close()
        raise
    log_level = cfg.log_level
    if port_file is not None:
        tmp = Path(f"{port_file}.tmp")
        tmp.write_text(str(sock.getsockname()[1]))
        os.replace(tmp, port_file)
    # Keep idle connections longer than the client does (httpx: 5 s), so the server never
    # closes a connection the client is about to reuse (a ReadError on a request it sent).
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5,
                            timeout_keep_alive=75)
    uvicorn.Server(config).run(sockets=[sock])
