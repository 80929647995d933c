"""Orchestrator throughput: agent turns per second with 1,000 trajectories in flight, one core.

The real pipeline (scheduler, agent loops, admission, SQL recorder, batched store writer,
learner stream) drives the `longhaul` suite with latency-simulating fakes: the scripted
engine replays each trajectory's demonstration after a fixed per-call latency, tools wait a
lognormal time, the sandbox is in memory, and a fake learner consumes the stream instantly
(without reading the consumed trajectories' rows for its lag figures: the learner's own work, in
its own process in a job). The process is pinned to one CPU. Printed, over the measurement
window: agent turns per second (model calls completed and recorded), trajectories per second,
CPU seconds per turn, store rows written per second (model calls, tool calls, trajectory
updates), peak trajectories in flight, and memory per trajectory in flight (the growth of the
process's resident set from before the pipeline started to its peak, divided by the peak in
flight).

The store is a new SQLite file in a temporary folder, or, with `--db URL` naming a PostgreSQL
server, a new database on that server (`bench_orchestrator_<hex>`, dropped afterwards; the
URL's own database is only used to create and drop it).

With `--replicas 1,2,4` the engine is that many scripted replicas behind the replica router
(`orchestrator.engines.replicas`), each serving `--slots` requests at once (as an engine's
batch; by default enough for every trajectory in flight, so that the engines never hold the
orchestrator back): printed per replica count are the figures above and the router's own CPU
time per request (choosing the replica and its bookkeeping, thread CPU time). Memory is
printed for the first count only: later runs in the same process reuse the memory the first
one took from the system.

With `--engine http` the engine is not in this process: the same scripted engine runs in a
child process on the other core behind the embedded engine's HTTP routes (generate, weight
updates, session release), and the pipeline reaches it through the client a job builds
(`orchestrator.engines.embedded.engine_client`, with a connection per trajectory in flight so
that the pool does not cap the turns). The child finds each trajectory's task in the store, as
the in-process script finds it in the pipeline. The figures are then those of a real job's
orchestrator process: its own CPU per turn holds the engine client (the request, the HTTP
exchange, the reply's decoding) and not the fake engine's work; the child's CPU per turn is
printed beside it.

`--engine vllm` is the same with vLLM's route instead: the child streams each reply as
`vllm serve` does (`/v1/completions`, one server-sent event per `--stream-interval` tokens
(the job's default, 16; the first token alone, as vLLM sends it), in up to 8 writes spread over
the call's latency, then the usage event), answers the weight-update routes a job's vLLM
client calls (pause, `collective_rpc`, prefix-cache reset, resume) at once, and finds each
trajectory by the session id the client sends; the pipeline drives it through the job's
`VllmEngineClient`, with drain updates as a job on vLLM has them (vLLM cannot pin versions).

    .venv/bin/python bench/orchestrator.py [--in-flight 1000] [--seconds 20] [--db URL]
    .venv/bin/python bench/orchestrator.py --engine http|vllm [--in-flight 1000] [--db URL]
    .venv/bin/python bench/orchestrator.py --engine vllm --stream-interval 1
    .venv/bin/python bench/orchestrator.py --in-flight 10000 --replicas 8 [--db URL]
    .venv/bin/python bench/orchestrator.py --replicas 1,2,4 --slots 16 [--seconds 10]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder is first on sys.path, where bench/engine.py and bench/learner.py
# would shadow the packages of the same names: drop it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager  # noqa: E402
from typing import Awaitable, Callable, Iterator  # noqa: E402

import anyio  # noqa: E402

from config.engine import DEFAULT_STREAM_INTERVAL  # noqa: E402
from config.job import parse_config  # noqa: E402
from core.children import cpu_seconds  # noqa: E402
from core.engine_api import INFO_ROUTE, EngineError  # noqa: E402
from core.store.db import normalize_url  # noqa: E402
from core.store.store import Store  # noqa: E402
from core.tiny_tokenizer import build_tiny_tokenizer  # noqa: E402
from orchestrator.engines.embedded import engine_client  # noqa: E402
from orchestrator.engines.replicas import ReplicaRouter  # noqa: E402
from orchestrator.engines.scripted import (  # noqa: E402
    FakeEngineClient,
    LatencyModel,
    ScriptedEngine,
    script_key,
)
from orchestrator.pipeline import Pipeline, tune_gc_for_concurrency  # noqa: E402
from orchestrator.testing import CapacityEngine, DemoScript, FakeLearner  # noqa: E402
from orchestrator.writer import running_writer  # noqa: E402
from tasks.chat import make_chat_format  # noqa: E402
from tasks.suites import longhaul  # noqa: E402
from tasks.testing import FakeSandbox  # noqa: E402


class CountingEngine(FakeEngineClient):
    """The engine (scripted, a router over scripted replicas, or the client of a served one),
    counting completed calls and the errors it raised."""

    def __init__(self, engine) -> None:
        self.engine, self.calls, self.errors = engine, 0, 0
        self.kind, self.can_pin = engine.kind, engine.can_pin  # vLLM's client cannot pin

    async def generate(self, request):
        try:
            result = await self.engine.generate(request)
        except EngineError:
            self.errors += 1
            raise
        self.calls += 1
        return result

    async def release_session(self, session_id: str) -> None:
        await self.engine.release_session(session_id)

    async def update_weights(self, path: str, version: int, *, mode="inflight", kv="recompute"):
        return await self.engine.update_weights(path, version, mode=mode, kv=kv)


def bench_family(tool_s: float):
    return longhaul.family(min_k=4, max_k=20, latency_median_s=tool_s, latency_sigma=0.5,
                           latency_max_s=10 * tool_s)


def bench_chat():
    return make_chat_format(build_tiny_tokenizer(), "hermes", tool_listing="none")


def scripted_engine(script, args) -> ScriptedEngine:
    return ScriptedEngine(script, keep_requests=False,
                          latency=LatencyModel(fixed_s=args.engine_s, jitter_sigma=0.3))


def serve_engine(fd: int, args) -> None:
    """The scripted engine behind the embedded engine's routes (`--engine http`) or vLLM's
    (`--engine vllm`), on the inherited listening socket `fd`, until killed. A trajectory's
    task is read from the store at `args.store_url` (written by the pipeline before the
    trajectory starts)."""
    from sqlalchemy import create_engine, text

    family, chat = bench_family(args.tool_s), bench_chat()
    store = create_engine(args.store_url)
    keys: dict[int, str] = {}

    def task_of(trajectory_id: int):
        if trajectory_id not in keys:
            with store.connect() as c:
                keys[trajectory_id] = c.execute(text(
                    "SELECT ti.key FROM trajectories t JOIN task_instances ti "
                    "ON ti.id = t.task_instance_id WHERE t.id = :id"),
                    {"id": trajectory_id}).scalar_one()
        return family.by_key(keys[trajectory_id])

    script = DemoScript(task_of, family, chat, correct_fraction=0.5)
    serve_routes(fd, vllm_routes(script, args) if args.engine == "vllm" else
                 embedded_routes(scripted_engine(script, args), keys))


# A route's handler: the request's body and the connection's writer -> the JSON body of a 200
# reply, or None when it wrote its reply itself (a stream).
Handler = Callable[[bytes, "asyncio.StreamWriter"], Awaitable["bytes | None"]]


def serve_routes(fd: int, routes: dict[bytes, Handler]) -> None:
    """HTTP/1.1 on the listening socket `fd` with `routes` (by path, without the query), kept
    alive; 404 for any other path. Plain asyncio streams rather than a web framework: a
    stand-in engine must keep up with the orchestrator on one core (behind Starlette and
    uvicorn, the vLLM stand-in spent 1.9 ms of its core a call)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                body = await reader.readexactly(length)
                handler = routes.get(head.split(b" ", 2)[1].split(b"?", 1)[0])
                reply = b'{"detail": "no such route"}' if handler is None else \
                    await handler(body, writer)
                if reply is not None:
                    writer.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s"
                                 % (b"404 Not Found" if handler is None else b"200 OK",
                                    len(reply), reply))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection (a cancelled call, or the end)
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, sock=socket.socket(fileno=fd))
        await server.serve_forever()

    asyncio.run(main())


async def ok(body: bytes, writer: asyncio.StreamWriter) -> bytes:
    return b"{}"


def embedded_routes(engine: ScriptedEngine, keys: dict[int, str]) -> dict[bytes, Handler]:
    """The embedded engine's generate, session-release, weight-update, info and health routes
    over `engine`; a released session's task key is forgotten."""
    from pydantic_core import to_json

    from core.engine_api import (
        GENERATE_ROUTE,
        RELEASE_SESSION_ROUTE,
        UPDATE_WEIGHTS_ROUTE,
        GenerateBody,
        GenerateRequest,
        ReleaseSessionBody,
        ReleaseSessionReply,
        UpdateWeightsBody,
        UpdateWeightsReply,
        encode_generate_reply,
    )

    async def generate(raw: bytes, writer: asyncio.StreamWriter) -> bytes:
        body = GenerateBody.model_validate_json(raw)
        result = await engine.generate(GenerateRequest(
            body.prompt_token_ids, body.params, session_id=body.session_id,
            weights_version=body.weights_version))
        return to_json(encode_generate_reply(result, request_id=body.request_id or ""))

    async def release(raw: bytes, writer: asyncio.StreamWriter) -> bytes:
        body = ReleaseSessionBody.model_validate_json(raw)
        await engine.release_session(body.session_id)
        keys.pop(int(script_key(body.session_id)), None)
        return ReleaseSessionReply(session_id=body.session_id,
                                   released_tokens=0).model_dump_json().encode()

    async def update(raw: bytes, writer: asyncio.StreamWriter) -> bytes:
        body = UpdateWeightsBody.model_validate_json(raw)
        report = await engine.update_weights(body.path, body.version, mode=body.mode,
                                             kv=body.kv)
        return UpdateWeightsReply(
            version=report.version, previous_version=report.previous_version, path=body.path,
            mode=report.mode, kv=report.kv, wait_s=report.wait_s, pause_s=report.pause_s,
            in_flight_sequences=report.in_flight_sequences,
            recomputed_tokens=report.recomputed_tokens,
            invalidated_sessions=report.invalidated_sessions,
            already_applied=report.already_applied,
            resident_versions=report.resident_versions).model_dump_json().encode()

    async def info(raw: bytes, writer: asyncio.StreamWriter) -> bytes:
        return b'{"model": "bench"}'

    return {GENERATE_ROUTE.encode(): generate, RELEASE_SESSION_ROUTE.encode(): release,
            UPDATE_WEIGHTS_ROUTE.encode(): update, INFO_ROUTE.encode(): info, b"/health": ok}


def vllm_routes(script: DemoScript, args, writes: int = 8) -> dict[bytes, Handler]:
    """What a job's vLLM client needs of `vllm serve`: the model card, `/v1/completions`
    streamed (the scripted reply's token events in `writes` chunks spread over a lognormal
    latency of median `args.engine_s`, then the usage event and `[DONE]`), health, and the
    weight-update routes (pause, `collective_rpc`, prefix-cache reset, resume), answered at
    once."""
    import json
    import math
    import random

    from core.engine_api import GenerateRequest, SamplingParams
    from orchestrator.engines.vllm_stream import completion_stream

    engine = ScriptedEngine(script, keep_requests=False)  # no latency: the stream spreads it
    draws = random.Random(1)
    card = b'{"object": "list", "data": [{"id": "bench", "max_model_len": 1048576}]}'

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def complete(raw: bytes, writer: asyncio.StreamWriter) -> None:
        body = json.loads(raw)
        result = await engine.generate(GenerateRequest(
            body["prompt"], SamplingParams(max_tokens=body["max_tokens"],
                                           stop_token_ids=tuple(body["stop_token_ids"])),
            session_id=body.get("session_id")))
        *parts, last = completion_stream(
            result.tokens, writes=writes, request_id=body["request_id"], model="bench",
            stream_interval=body.get("stream_interval", 1), finish_reason=result.finish_reason,
            prompt_tokens=result.prompt_tokens,
            cached_prompt_tokens=result.cached_prompt_tokens)
        pause = args.engine_s * math.exp(draws.gauss(0.0, 0.3)) / len(parts)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for part in parts:
            await asyncio.sleep(pause)
            writer.write(chunk(part))
        writer.write(chunk(last) + b"0\r\n\r\n")
        return None

    async def models(raw: bytes, writer: asyncio.StreamWriter) -> bytes:
        return card

    return {b"/v1/completions": complete, b"/v1/models": models, b"/health": ok,
            **{path: ok for path in (b"/pause", b"/resume", b"/collective_rpc",
                                     b"/reset_prefix_cache")}}


@asynccontextmanager
async def served_engine(args, store: Store):
    """`engine_client` to the scripted engine served by a child process (`serve_engine`) on
    the other core; yields the client and the child's pid."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve-fd", str(listener.fileno()),
         "--store-url", store.engine.url.render_as_string(hide_password=False),
         "--engine-s", str(args.engine_s), "--tool-s", str(args.tool_s),
         "--engine", args.engine]
        + (["--serve-cpu", str(args.serve_cpu)] if args.serve_cpu is not None else []),
        pass_fds=[listener.fileno()])
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        kind = "vllm" if args.engine == "vllm" else "embedded"
        async with engine_client(url, kind=kind, max_connections=args.concurrent,
                                 stream_interval=args.stream_interval) as client:
            await client.wait_ready(60)
            yield client, child.pid
    finally:
        child.kill()
        child.wait()
        listener.close()


@asynccontextmanager
async def memory_sandbox(spec, trajectory_id):
    yield FakeSandbox()


def replica_engine(script: DemoScript, args, replicas: int) -> ReplicaRouter:
    """`replicas` scripted engines of `args.slots` concurrent requests each, behind a router."""
    latency = LatencyModel(fixed_s=args.engine_s, jitter_sigma=0.3)
    slots = args.slots or -(-args.concurrent // replicas)
    return ReplicaRouter([CapacityEngine(ScriptedEngine(script, engine_id=f"r{i}",
                                                        keep_requests=False, latency=latency),
                                         slots=slots, decode_s=0.0)
                          for i in range(replicas)])


def rss_bytes(field: str = "VmRSS") -> int:
    """The process's resident set (`VmRSS`) or its peak so far (`VmHWM`), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


@contextmanager
def bench_store(args, directory: str) -> Iterator[Store]:
    """A new store for one measurement: a SQLite file in `directory`, or a new database on the
    PostgreSQL server of `args.db`, dropped afterwards."""
    if not args.db:
        store = Store.open(f"sqlite:///{directory}/orchestrator.db", create=True)
        try:
            yield store
        finally:
            store.close()
        return
    from sqlalchemy import create_engine, text

    url = normalize_url(args.db)
    name = f"bench_orchestrator_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(f"CREATE DATABASE {name}"))
        store = Store.open(url.rsplit("/", 1)[0] + "/" + name, create=True)
        try:
            yield store
        finally:
            store.close()
            with admin.connect() as c:
                c.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    finally:
        admin.dispose()


async def measure(args, directory: str, replicas: int | None = None) -> dict:
    with bench_store(args, directory) as store:
        return await measure_on(args, store, replicas)


async def measure_on(args, store: Store, replicas: int | None) -> dict:
    cfg = parse_config({
        "rollout": {"group_size": 8, "max_concurrent": args.concurrent},
        "admission": {"max_lag": 1000, "zero_variance": "keep"},
        "learner": {"batch_size": 64},
        "pipeline": {"mode": "async", "steps": 10**6, "max_queue": 10**6},
    })
    store.create_run("bench", name="bench", config={}, pipeline_mode="async")
    family, chat = bench_family(args.tool_s), bench_chat()
    pipelines: list[Pipeline] = []  # the one the script finds its trajectories' tasks in
    script = DemoScript(lambda tid: pipelines[0].task_of(tid), family, chat,
                        correct_fraction=0.5)
    router = replica_engine(script, args, replicas) if replicas else None
    async with AsyncExitStack() as stack:
        served, child = None, None
        if args.engine in ("http", "vllm"):
            served, child = await stack.enter_async_context(served_engine(args, store))
        engine = CountingEngine(router or served or scripted_engine(script, args))
        result = await run_pipeline(args, store, cfg, family, chat, engine, child, pipelines)
    result["route_us"] = (1e6 * router.stats.route_s / max(router.stats.requests, 1)
                          if router else None)
    return result


async def run_pipeline(args, store: Store, cfg, family, chat, engine: CountingEngine,
                       child: int | None, pipelines: list[Pipeline]) -> dict:
    """The pipeline over `engine` (appended to `pipelines`) until the window ends; its
    figures. `child`: the pid of the engine's own process, whose CPU is counted too."""
    learner = FakeLearner(store, "bench", batch_size=64, poll_s=0.05, record_lags=False)
    peak = 0
    window: dict[str, float] = {}
    rss_before = rss_bytes()

    def counters() -> dict[str, float]:
        return dict(calls=engine.calls, finished=pipeline.stats.finished,
                    rows=writer.rows_written, transactions=writer.transactions,
                    dispatched=pipeline.stats.dispatched, wall=time.monotonic(),
                    cpu=time.process_time(), child_cpu=cpu_seconds(child) if child else 0.0)

    async def sample() -> None:
        nonlocal peak
        await anyio.sleep(args.warmup)
        window.update(counters())
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            peak = max(peak, pipeline.in_flight)
            await anyio.sleep(0.1)
        window.update({k: v - window[k] for k, v in counters().items()})
        tg.cancel_scope.cancel()

    async with running_writer(store) as writer:  # it stops after the pipeline
        pipeline = Pipeline(run_id="bench", cfg=cfg, store=store, writer=writer, engine=engine,
                            family=family, chat_format=chat, acquire=memory_sandbox,
                            poll_s=0.5)
        pipelines.append(pipeline)
        async with anyio.create_task_group() as tg:
            await tg.start(learner.run)
            tg.start_soon(pipeline.run)
            tg.start_soon(sample)
    return dict(turns_per_s=window["calls"] / window["wall"],
                trajectories_per_s=window["finished"] / window["wall"],
                cpu_ms_per_turn=1000 * window["cpu"] / max(window["calls"], 1),
                cpu_share=window["cpu"] / window["wall"], peak_in_flight=peak,
                rows_per_s=window["rows"] / window["wall"], rows=writer.rows_written,
                transactions_per_s=window["transactions"] / window["wall"],
                dispatched_per_s=window["dispatched"] / window["wall"],
                kib_per_trajectory=(rss_bytes("VmHWM") - rss_before) / 1024 / max(peak, 1),
                dialect=store.engine.dialect.name,
                engine_cpu_ms_per_turn=1000 * window["child_cpu"] / max(window["calls"], 1),
                engine_errors=engine.errors)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", "--concurrent", dest="concurrent", type=int, default=1000,
                        help="trajectories in flight (rollout.max_concurrent)")
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement window")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring")
    parser.add_argument("--engine-s", type=float, default=0.2, help="latency of a model call")
    parser.add_argument("--tool-s", type=float, default=0.2, help="median latency of a tool call")
    parser.add_argument("--replicas", type=str, default=None,
                        help="comma-separated replica counts, e.g. 1,2,4 (router benchmark)")
    parser.add_argument("--slots", type=int, default=0,
                        help="requests one replica serves at once (with --replicas; default: "
                             "enough for every trajectory in flight)")
    parser.add_argument("--engine", choices=("scripted", "http", "vllm"), default="scripted",
                        help="scripted: the engine in this process; http: in a child process, "
                             "reached through a job's engine client; vllm: the same behind "
                             "vLLM's streamed route, through a job's vLLM client")
    parser.add_argument("--stream-interval", type=int, default=DEFAULT_STREAM_INTERVAL,
                        help="with --engine vllm: tokens per streamed event, as a job's "
                             "[engine] stream_interval (1: one event per token)")
    parser.add_argument("--serve-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve-cpu", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--store-url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--db", default=None,
                        help="a PostgreSQL server's URL (postgresql+psycopg://...); the bench "
                             "makes a database of its own there (default: a new SQLite file)")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.serve_fd is not None:  # the served engine's process (--engine http)
        if args.serve_cpu is not None:
            os.sched_setaffinity(0, {args.serve_cpu})
        return serve_engine(args.serve_fd, args)
    tune_gc_for_concurrency()  # as `stalewise run` does
    if cpus:  # this process on the first core, a served engine on the last
        os.sched_setaffinity(0, {cpus[0]})
        args.serve_cpu = cpus[-1]
    if args.replicas:
        if args.engine != "scripted":
            parser.error("--replicas runs scripted replicas in this process: drop --engine")
        return replica_table(args, [int(n) for n in args.replicas.split(",")])
    with tempfile.TemporaryDirectory() as directory:
        result = anyio.run(measure, args, directory)
    where = {"scripted": "the scripted engine in this process",
             "http": "the scripted engine in a child process over HTTP (the embedded engine's "
                     "routes)",
             "vllm": f"the scripted engine in a child process behind vLLM's streamed route, "
                     f"{args.stream_interval} tokens per event, through a job's vLLM "
                     f"client"}[args.engine]
    print(f"orchestrator benchmark: {args.concurrent} trajectories in flight (peak "
          f"{result['peak_in_flight']}), one core, model call {args.engine_s} s, tool median "
          f"{args.tool_s} s, store {result['dialect']}, {where}")
    print(f"  agent turns/s        {result['turns_per_s']:,.0f}   (target >= 2,000)")
    print(f"  trajectories/s       {result['trajectories_per_s']:,.1f}")
    print(f"  CPU ms per turn      {result['cpu_ms_per_turn']:.3f}")
    if args.engine != "scripted":
        print(f"  engine CPU ms/turn   {result['engine_cpu_ms_per_turn']:.3f}   (the child "
              f"process, on the other core; not in the figure above)")
    print(f"  CPU busy             {100 * result['cpu_share']:.0f}% of one core")
    print(f"  engine errors        {result['engine_errors']:,}   (in the whole run)")
    print(f"  store rows/s         {result['rows_per_s']:,.0f}   ({result['rows']:,} in the run)")
    print(f"  store commits/s      {result['transactions_per_s']:,.1f}   (dispatch waits for one "
          f"per group: {result['dispatched_per_s']:,.1f} trajectories/s dispatched)")
    print(f"  KiB per trajectory   {result['kib_per_trajectory']:,.1f}   (RSS growth / peak "
          f"in flight)")


def replica_table(args, counts: list[int]) -> None:
    slots = f"{args.slots} slots" if args.slots else "slots for all in flight"
    store = "postgresql" if args.db else "sqlite"
    print(f"replica router benchmark: {args.concurrent} trajectories in flight, one core, "
          f"scripted replicas of {slots}, model call {args.engine_s} s, tool median "
          f"{args.tool_s} s, {args.seconds:.0f} s window, store {store}")
    print(f"  {'replicas':>8}  {'turns/s':>9}  {'trajectories/s':>14}  {'CPU ms/turn':>11}  "
          f"{'CPU busy':>8}  {'rows/s':>8}  {'commits/s':>9}  {'dispatched/s':>12}  "
          f"{'peak in flight':>14}  {'KiB/trajectory':>14}  {'routing us/request':>18}")
    for i, count in enumerate(counts):
        with tempfile.TemporaryDirectory() as directory:
            r = anyio.run(measure, args, directory, count)
        memory = f"{r['kib_per_trajectory']:,.1f}" if i == 0 else "-"
        print(f"  {count:>8}  {r['turns_per_s']:>9,.0f}  {r['trajectories_per_s']:>14,.1f}  "
              f"{r['cpu_ms_per_turn']:>11.3f}  {100 * r['cpu_share']:>7.0f}%  "
              f"{r['rows_per_s']:>8,.0f}  {r['transactions_per_s']:>9,.1f}  "
              f"{r['dispatched_per_s']:>12,.1f}  {r['peak_in_flight']:>14,}  {memory:>14}  "
              f"{r['route_us']:>18.1f}", flush=True)


if __name__ == "__main__":
    main()
