"""Helpers shared by the engine's HTTP routes: errors, body parsing, waiting on the engine.

Guarantees: every refused request becomes an OpenAI-shaped error body
`{"error": {"message", "type", "code"}}`; `until_done_or_disconnect` aborts the request in the
engine when its client disconnects, turns an engine shutdown into a 503 and a request pinned
to a weights version that is not resident into a 409.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.core import Engine
from engine.requests import EngineOutput, EngineStopped, RequestError, SamplingSpec, TokenEvent
from engine.versions import VersionNotResident


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError",
            503: "ServiceUnavailableError"}.get(status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


async def parse(request: Request, schema: type[BaseModel]) -> Any:
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HttpError(400, f"request body is not valid JSON: {exc}") from exc
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        details = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                            for e in exc.errors())
        raise HttpError(400, f"invalid {request.url.path} request: {details}") from exc


async def wait(future: Future) -> Any:
    return await asyncio.wrap_future(future)


def submit(engine: Engine, prompt: list[int], spec: SamplingSpec, *, session_id: str | None,
           request_id: str, listener: Callable[[TokenEvent], None] | None = None,
           weights_version: int | None = None) -> Future:
    try:
        return engine.submit(prompt, spec, session_id=session_id, request_id=request_id,
                             listener=listener, weights_version=weights_version)
    except RequestError as exc:
        raise HttpError(400, str(exc)) from exc


async def until_done_or_disconnect(engine: Engine, request: Request, future: Future,
                                   request_id: str) -> EngineOutput:
    """Wait for the output; abort the request in the engine if the client goes away.

    A request pinned to a version that is not resident (or was evicted while it ran) is a 409;
    an engine that stopped is a 503."""
    result: EngineOutput | None = None
    failure: EngineStopped | None = None
    refused: RequestError | None = None

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                engine.abort(request_id)
                return

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        try:
            result = await wait(future)
        except EngineStopped as exc:
            failure = exc
        except RequestError as exc:
            refused = exc
        finally:
            group.cancel_scope.cancel()
    if refused is not None:
        raise HttpError(409 if isinstance(refused, VersionNotResident) else 400, str(refused))
    if failure is not None or result is None:
        raise HttpError(503, str(failure))
    return result
