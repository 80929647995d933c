"""vLLM/OpenAI-compatible completion routes of the embedded engine.

`/v1/models` and `/v1/completions` in vLLM's format: token-id (or text) prompts; `logprobs`
(top-n of the processed distribution, the sampled token's log-prob always included, -inf
clamped to -9999 as vLLM does); `return_tokens_as_token_ids` renders tokens as `token_id:N`;
`min_tokens`, `stop_token_ids`, `ignore_eos`, `seed`, `top_k`; `stream` with server-sent
events and `stream_options.include_usage`, `stream_interval` tokens per event as vLLM groups
them (the first token alone, the rest with the end); `request_id` names the request (the reply's
id is `cmpl-` + it, as vLLM's); usage carries `prompt_tokens_details.cached_tokens`.
Options the engine does not implement are refused with 400, never silently ignored. A
streaming client that hangs up has its request aborted. The request schema (`CompletionBody`)
is vLLM's, so it lives here; stalewise's own wire protocol is `core.engine_api`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine.core import Engine
from engine.http_util import HttpError, parse, submit, until_done_or_disconnect
from engine.requests import EngineOutput, EngineStopped, RequestError, SamplingSpec, TokenEvent


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class CompletionBody(BaseModel):
    """The subset of vLLM's completion request the embedded engine serves."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off")
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0)
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    stream_interval: int | None = Field(None, ge=1, description="tokens per streamed event")
    request_id: str | None = Field(None, min_length=1, max_length=200,
                                   description="the reply's id is `cmpl-` + it")
    n: int = 1
    best_of: int | None = None
    echo: bool = False
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    session_id: str | None = Field(None, description="stalewise extension: retain KV per session")

    def unsupported(self) -> list[str]:
        """Requested features the embedded engine does not implement."""
        problems = []
        if self.n != 1 or (self.best_of or 1) != 1:
            problems.append("n/best_of must be 1 (send one request per sample)")
        if self.echo:
            problems.append("echo is not supported")
        if self.stop:
            problems.append("stop strings are not supported; use stop_token_ids")
        if self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0:
            problems.append("presence/frequency/repetition penalties are not supported")
        if self.logit_bias:
            problems.append("logit_bias is not supported")
        if self.suffix:
            problems.append("suffix is not supported")
        return problems


class Completions:
    """Completion handlers bound to one engine, its served name and tokenizer."""

    def __init__(self, engine: Engine, *, model_name: str, tokenizer: Any | None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.created = int(time.time())

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "stalewise", "root": str(self.engine.model_dir), "parent": None,
            "max_model_len": self.engine.max_len}]})

    def _completion_prompt(self, body: CompletionBody) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            if len(prompt) != 1:
                raise HttpError(400, f"got {len(prompt)} prompts; send one prompt per request")
            prompt = prompt[0]  # type: ignore[assignment]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise HttpError(400, "this model directory has no tokenizer; send token ids")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # the tokenizer's own error was an HTTP 500
                raise HttpError(400, f"the prompt holds {prompt[exc.start]!r} at character "
                                f"{exc.start}, a lone UTF-16 surrogate that no text encoding "
                                "holds; send valid Unicode text, or token ids") from None
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return list(prompt)  # type: ignore[arg-type]

    def _completion_spec(self, body: CompletionBody) -> SamplingSpec:
        problems = body.unsupported()
        if body.model is not None and body.model != self.model_name:
            problems.append(f"model {body.model!r} is not served here (serving {self.model_name!r})")
        if problems:
            raise HttpError(400, "; ".join(problems))
        try:
            return SamplingSpec(
                temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p,
                seed=body.seed, max_tokens=body.max_tokens, min_tokens=body.min_tokens,
                stop_token_ids=tuple(body.stop_token_ids), logprobs_topk=body.logprobs or 0,
                ignore_eos=body.ignore_eos)
        except RequestError as exc:
            raise HttpError(400, str(exc)) from exc

    def _token_label(self, token_id: int, as_ids: bool) -> str:
        if as_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _text(self, token_ids: list[int], skip_special: bool) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special)

    def _logprobs_block(self, body: CompletionBody, token_ids: list[int], logprobs: list[float],
                        topk_ids: list[list[int]], topk_lps: list[list[float]],
                        offset: int) -> dict | None:
        if body.logprobs is None:
            return None
        as_ids = body.return_tokens_as_token_ids
        tops = []
        for i, token in enumerate(token_ids):
            top = {self._token_label(t, as_ids): max(lp, -9999.0)
                   for t, lp in zip(topk_ids[i] if topk_ids else [], topk_lps[i] if topk_lps else [])}
            top.setdefault(self._token_label(token, as_ids), max(logprobs[i], -9999.0))
            tops.append(top)
        offsets, position = [], offset
        for token in token_ids:
            offsets.append(position)
            position += len(self._text([token], body.skip_special_tokens))
        return {"tokens": [self._token_label(t, as_ids) for t in token_ids],
                "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def completions(self, request: Request) -> Response:
        body: CompletionBody = await parse(request, CompletionBody)
        prompt = self._completion_prompt(body)
        spec = self._completion_spec(body)
        # the engine's own id stays unique (it aborts by it); the reply carries the client's
        request_id = f"cmpl-{uuid.uuid4().hex}"
        reply_id = f"cmpl-{body.request_id}" if body.request_id else request_id
        if body.stream:
            return self._stream_completion(body, prompt, spec, request_id, reply_id)
        future = submit(self.engine, prompt, spec, session_id=body.session_id,
                        request_id=request_id)
        out = await until_done_or_disconnect(self.engine, request, future, request_id)
        choice = {"index": 0, "text": self._text(out.token_ids, body.skip_special_tokens),
                  "logprobs": self._logprobs_block(body, out.token_ids, out.sampler_logprobs,
                                                   out.topk_ids, out.topk_logprobs, 0),
                  "finish_reason": out.finish_reason, "stop_reason": self._stop_reason(out)}
        return JSONResponse({
            "id": reply_id, "object": "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": [choice],
            "usage": self._usage(out.prompt_tokens, len(out.token_ids), out.cached_prompt_tokens)})

    @staticmethod
    def _stop_reason(out: EngineOutput) -> int | None:
        if out.finish_reason == "stop" and out.token_ids:
            return out.token_ids[-1]
        return None

    def _stream_completion(self, body: CompletionBody, prompt: list[int], spec: SamplingSpec,
                           request_id: str, reply_id: str) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        future = submit(self.engine, prompt, spec, session_id=body.session_id,
                        request_id=request_id,
                        listener=lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
        return StreamingResponse(self._sse(body, future, events, request_id, reply_id),
                                 media_type="text/event-stream")

    async def _sse(self, body: CompletionBody, future: Future, events: asyncio.Queue,
                   request_id: str, reply_id: str) -> AsyncIterator[str]:
        created, offset, done = int(time.time()), 0, asyncio.wrap_future(future)
        finished = False

        held: list[TokenEvent] = []  # tokens not yet sent
        limit = 1  # as vLLM: the first token alone, then `stream_interval` to an event

        def token_chunk(events: list[TokenEvent]) -> str:
            nonlocal offset
            ids = [event.token_id for event in events]
            text = self._text(ids, body.skip_special_tokens)
            block = self._logprobs_block(
                body, ids, [event.logprob for event in events],
                [event.topk_ids for event in events] if events[0].topk_ids else [],
                [event.topk_logprobs for event in events] if events[0].topk_logprobs else [],
                offset)
            offset += len(text)
            return self._chunk(reply_id, created, [{"index": 0, "text": text, "logprobs": block,
                                                      "finish_reason": None, "stop_reason": None}])

        try:
            while True:
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    break
                held.append(getter.result())
                if len(held) >= limit:
                    yield token_chunk(held)
                    held, limit = [], body.stream_interval or 1
            while not events.empty():  # tokens queued just before the final result
                held.append(events.get_nowait())
                if len(held) >= limit:
                    yield token_chunk(held)
                    held, limit = [], body.stream_interval or 1
            if held:
                yield token_chunk(held)
            try:
                out: EngineOutput = done.result()
            except EngineStopped as exc:
                yield "data: " + json.dumps({"error": {"message": str(exc), "code": 503}}) + "\n\n"
                return
            finished = True
            yield self._chunk(reply_id, created, [{"index": 0, "text": "", "logprobs": None,
                              "finish_reason": out.finish_reason,
                              "stop_reason": self._stop_reason(out)}])
            if body.stream_options is not None and body.stream_options.include_usage:
                yield self._chunk(reply_id, created, [], usage=self._usage(
                    out.prompt_tokens, len(out.token_ids), out.cached_prompt_tokens))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                self.engine.abort(request_id)

    def _chunk(self, reply_id: str, created: int, choices: list, usage: dict | None = None) -> str:
        return "data: " + json.dumps({"id": reply_id, "object": "text_completion",
                                      "created": created, "model": self.model_name,
                                      "choices": choices, "usage": usage}) + "\n\n"
