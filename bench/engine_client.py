"""What a model call costs the orchestrator's CPU with a real engine client, over real HTTP.

`bench/orchestrator.py` runs the scripted engine in the orchestrator's process, so its CPU per
turn holds the fake's work where a real job pays the engine client's: building the request
body, the HTTP exchange, and decoding the reply. This bench measures both, side by side in one
run, with the same conversations in flight on one core:

- `http`: `EmbeddedEngineClient.generate` (the client a job builds for `stalewise engine serve`)
  against a server in a child process, pinned to another core, that speaks the
  `/stalewise/generate` wire format and answers after the call's latency with a canned reply;
- `vllm`: `VllmEngineClient.generate` (the client a job builds for `vllm serve`) against the
  same server's `/v1/completions`, which streams the reply as vLLM does: one server-sent event
  per `--stream-interval` tokens (a job's `[engine] stream_interval`, default 16; the first
  token alone) with their log-probs, then a usage event and `[DONE]`, the events sent in up to
  `--stream-writes` writes spread over the call's latency (a decoding engine's pace);
- `vllm1`: the same with one event per token (`stream_interval = 1`, vLLM's own default, and
  a job's with pipeline mode `inflight`);
- `scripted`: the in-process `ScriptedEngine` that `bench/orchestrator.py` uses;
- `floor`: an engine that only sleeps the latency and returns a prepared result: what the
  conversations themselves cost (growing the prompt, counting).

Each conversation starts from `--prompt` tokens and grows by the reply and `--tool-tokens` per
turn, for `--turns` turns, then starts again: the defaults give prompts of about 465 tokens on
average and 42-token replies, as `bench/orchestrator.py`'s `longhaul` trajectories have.
Printed per contender (median of `--repeats` windows, the contenders alternating): calls per
second, the client process's CPU ms per call, and that minus the floor, which is what the engine
side of a turn costs the orchestrator. For `http`, also the server's CPU ms per call (its own
core; not the orchestrator's). The client keeps at most `--connections` requests open; by
default one per conversation, as a job's engine client does (`engine.max_connections`, default
`rollout.max_concurrent`). With fewer (`--connections 256`, a job's fixed pool before
2026-12-06) the rest wait in its pool, and `http` and `vllm` make fewer calls per second.

    .venv/bin/python bench/engine_client.py [--in-flight 1000] [--latency-s 0.4]
        [--connections N] [--seconds 10] [--repeats 3] [--engines floor,scripted,http,vllm,vllm1]
        [--stream-interval 16]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder is first on sys.path, where bench/engine.py and bench/learner.py
# would shadow the packages of the same names: drop it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import AsyncIterator  # noqa: E402

import anyio  # noqa: E402
import numpy as np  # noqa: E402

from config.engine import DEFAULT_STREAM_INTERVAL  # noqa: E402
from core.children import cpu_seconds  # noqa: E402
from core.engine_api import (  # noqa: E402
    GENERATE_ROUTE,
    INFO_ROUTE,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    encode_generate_reply,
)
from core.records import FLOAT32, INT32, SampledTokens  # noqa: E402
from orchestrator.engines.embedded import engine_client  # noqa: E402
from orchestrator.engines.scripted import LatencyModel, ScriptedEngine, ScriptedTurn  # noqa: E402
from orchestrator.engines.vllm_stream import completion_stream  # noqa: E402
from orchestrator.pipeline import tune_gc_for_concurrency  # noqa: E402


def reply_tokens(count: int) -> SampledTokens:
    """A reply of `count` tokens, as the engine records one (no top-k)."""
    rng = np.random.default_rng(0)
    return SampledTokens(
        token_ids=rng.integers(3, 200, count).astype(INT32),
        sampler_logprobs=(-rng.exponential(1 / 3.0, count)).astype(FLOAT32),
        weights_versions=np.zeros(count, INT32), kv_versions=np.zeros(count, INT32),
        time_offsets=np.linspace(0.01, 0.2, count, dtype=FLOAT32))


# ---- the server (child process) ----------------------------------------------------------------

def serve(fd: int, args: argparse.Namespace) -> None:
    """Answer `/stalewise/generate` on the inherited listening socket `fd` until killed."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    result = GenerateResult(tokens=reply_tokens(args.reply_tokens), finish_reason="stop",
                            prompt_tokens=0, cached_prompt_tokens=0, engine_id="bench")
    canned = encode_generate_reply(result, request_id="")
    draws = random.Random(1)

    async def generate(request: Request) -> Response:
        try:
            body = await request.json()
        except ClientDisconnect:  # the bench cancels its calls at the end of a window
            return Response(status_code=499)
        await anyio.sleep(args.latency_s * math.exp(draws.gauss(0.0, 0.3)))
        return JSONResponse({**canned, "request_id": body["request_id"],
                             "prompt_tokens": len(body["prompt_token_ids"])})

    async def info(request: Request) -> JSONResponse:
        return JSONResponse({"model": "bench"})

    streams: dict[int, list[bytes]] = {}  # the reply's writes, per stream interval

    async def completions(request: Request) -> Response:
        try:
            interval = (await request.json()).get("stream_interval", 1)
        except ClientDisconnect:
            return Response(status_code=499)
        if interval not in streams:
            streams[interval] = completion_stream(
                result.tokens, writes=args.stream_writes, request_id="bench", model="bench",
                finish_reason="stop", prompt_tokens=0, stream_interval=interval)
        *groups, usage_and_done = streams[interval]
        pause = args.latency_s * math.exp(draws.gauss(0.0, 0.3)) / len(groups)

        async def stream() -> AsyncIterator[bytes]:
            for group in groups:
                await anyio.sleep(pause)
                yield group
            yield usage_and_done

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "bench", "max_model_len": 4096}]})

    app = Starlette(routes=[Route(GENERATE_ROUTE, generate, methods=["POST"]),
                            Route(INFO_ROUTE, info, methods=["GET"]),
                            Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/models", models, methods=["GET"])])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           backlog=4096, timeout_keep_alive=60))
    server.run(sockets=[socket.socket(fileno=fd)])


# ---- the client side ---------------------------------------------------------------------------

class FloorEngine:
    """Sleeps the call's latency and returns one prepared result: the conversations' own cost."""

    def __init__(self, latency_s: float, tokens: SampledTokens) -> None:
        self.latency_s, self.draws = latency_s, random.Random(1)
        self.result = GenerateResult(tokens=tokens, finish_reason="stop", prompt_tokens=0,
                                     cached_prompt_tokens=0, engine_id="floor")

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await anyio.sleep(self.latency_s * math.exp(self.draws.gauss(0.0, 0.3)))
        return self.result


async def window(engine, args: argparse.Namespace,
                 server_pid: int | None = None) -> dict[str, float]:
    """`args.in_flight` conversations against `engine` for the window: calls/s, CPU ms per call
    (this process), and the server's CPU ms per call (process `server_pid`, if given)."""
    params = SamplingParams(max_tokens=256, stop_token_ids=(2,))
    tool = list(range(100, 100 + args.tool_tokens))
    calls = 0
    counting = False

    async def conversation(i: int) -> None:
        nonlocal calls
        trajectory = 0
        while True:
            prompt = list(range(3, 3 + args.prompt))
            trajectory += 1
            for _ in range(args.turns):
                result = await engine.generate(GenerateRequest(
                    prompt_token_ids=prompt, params=params, session_id=f"{i}-{trajectory}"))
                prompt = prompt + result.tokens.token_ids.tolist() + tool
                if counting:
                    calls += 1

    async with anyio.create_task_group() as tg:
        for i in range(args.in_flight):
            tg.start_soon(conversation, i)
        await anyio.sleep(args.warmup)
        server = cpu_seconds(server_pid) if server_pid else 0.0
        counting, wall, cpu = True, time.monotonic(), time.process_time()
        await anyio.sleep(args.seconds)
        counting, wall, cpu = False, time.monotonic() - wall, time.process_time() - cpu
        server = cpu_seconds(server_pid) - server if server_pid else 0.0
        tg.cancel_scope.cancel()
    return {"calls_per_s": calls / wall, "cpu_ms": 1000 * cpu / max(calls, 1),
            "server_cpu_ms": 1000 * server / max(calls, 1)}


async def http_window(base_url: str, server_pid: int, args: argparse.Namespace,
                      kind: str, stream_interval: int = 1) -> dict:
    async with engine_client(base_url, kind=kind, max_connections=args.connections,
                             stream_interval=stream_interval) as client:
        return await window(client, args, server_pid)


ENGINES = ("floor", "scripted", "http", "vllm", "vllm1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", type=int, default=1000, help="conversations at once")
    parser.add_argument("--latency-s", type=float, default=0.4,
                        help="median latency of a call (lognormal, sigma 0.3)")
    parser.add_argument("--prompt", type=int, default=150, help="a conversation's first prompt")
    parser.add_argument("--reply-tokens", type=int, default=42, help="tokens in each reply")
    parser.add_argument("--tool-tokens", type=int, default=20,
                        help="tokens a turn adds after the reply (the tool's result)")
    parser.add_argument("--turns", type=int, default=12, help="calls per conversation")
    parser.add_argument("--connections", type=int, default=None,
                        help="the client's connection pool (default: --in-flight, one per "
                        "conversation, as a job's engine client has)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measurement window")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    parser.add_argument("--repeats", type=int, default=3, help="windows per contender")
    parser.add_argument("--stream-writes", type=int, default=8,
                        help="writes the vllm server spreads a reply's events over")
    parser.add_argument("--stream-interval", type=int, default=DEFAULT_STREAM_INTERVAL,
                        help="tokens per streamed event for the vllm contender (vllm1: 1)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="the contenders, comma-separated (floor is always measured)")
    parser.add_argument("--serve-fd", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.connections is None:
        args.connections = args.in_flight
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.serve_fd is not None:
        if len(cpus) > 1:
            os.sched_setaffinity(0, {cpus[1]})
        return serve(args.serve_fd, args)
    tune_gc_for_concurrency()  # as `stalewise run` does
    listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve-fd", str(listener.fileno()),
         "--latency-s", str(args.latency_s), "--reply-tokens", str(args.reply_tokens),
         "--stream-writes", str(args.stream_writes)],
        pass_fds=[listener.fileno()])
    if cpus:
        os.sched_setaffinity(0, {cpus[0]})
    base_url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    tokens = reply_tokens(args.reply_tokens)
    scripted_turn = ScriptedTurn(tuple(int(t) for t in tokens.token_ids), finish_reason="stop")
    engines = ["floor"] + [e for e in dict.fromkeys(args.engines.split(",")) if e != "floor"]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        parser.error(f"--engines: unknown {', '.join(sorted(unknown))} "
                     f"(choose from {', '.join(ENGINES)})")
    try:
        rows: dict[str, list[dict]] = {engine: [] for engine in engines}
        for _ in range(args.repeats):
            for engine in engines:
                if engine == "floor":
                    run = anyio.run(window, FloorEngine(args.latency_s, tokens), args)
                elif engine == "scripted":
                    scripted = ScriptedEngine(lambda key, index: scripted_turn,
                                              keep_requests=False,
                                              latency=LatencyModel(fixed_s=args.latency_s,
                                                                   jitter_sigma=0.3))
                    run = anyio.run(window, scripted, args)
                else:
                    kind = "embedded" if engine == "http" else "vllm"
                    interval = args.stream_interval if engine == "vllm" else 1
                    run = anyio.run(http_window, base_url, server.pid, args, kind, interval)
                rows[engine].append(run)
    finally:
        server.kill()
        server.wait()
    growth = args.reply_tokens + args.tool_tokens
    print(f"engine client benchmark: {args.in_flight} conversations in flight, one core, call "
          f"latency {args.latency_s} s, prompts {args.prompt} + {growth} per turn over "
          f"{args.turns} turns, {args.reply_tokens}-token replies, "
          f"{args.connections} connections, vllm {args.stream_interval} tokens per event, "
          f"median of {args.repeats} windows of {args.seconds:g} s")
    floor = statistics.median(r["cpu_ms"] for r in rows["floor"])
    print(f"  {'engine':>8}  {'calls/s':>8}  {'CPU ms/call':>11}  {'over floor':>10}  "
          f"{'runs (CPU ms/call)':>24}  {'server CPU ms/call':>18}")
    for name, runs in rows.items():
        cpu = statistics.median(r["cpu_ms"] for r in runs)
        spread = " / ".join(f"{r['cpu_ms']:.3f}" for r in runs)
        server_ms = (f"{statistics.median(r['server_cpu_ms'] for r in runs):.3f}"
                     if name in ("http", "vllm", "vllm1") else "-")
        print(f"  {name:>8}  {statistics.median(r['calls_per_s'] for r in runs):>8,.0f}  "
              f"{cpu:>11.3f}  {cpu - floor:>10.3f}  {spread:>24}  {server_ms:>18}")


if __name__ == "__main__":
    main()
