"""Pieces of tests/test_bad_input.py: a job run on a real store, an engine behind HTTP whose
reply to one call is broken on purpose, a family whose tool output is chosen by the test, and a
stdlib-only MCP server that misbehaves on request."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from sqlalchemy import select

from config.job import parse_config
from core.engine_api import (
    ABORT_ROUTE,
    GENERATE_ROUTE,
    RELEASE_SESSION_ROUTE,
    UPDATE_WEIGHTS_ROUTE,
    GenerateBody,
    GenerateRequest,
    UpdateWeightsBody,
    UpdateWeightsReply,
    encode_generate_reply,
)
from core.sandbox import ExecResult
from core.store import schema as s
from core.store.store import Store
from orchestrator.engines.scripted import ScriptedEngine, ScriptedTurn, script_key
from orchestrator.pipeline import Pipeline
from orchestrator.testing import FakeLearner
from orchestrator.writer import running_writer
from tasks import Component, Rubric, TaskFamily, TaskInstance, TaskLimits, ToolContext, tool
from tasks.builtin_tools import bash
from tasks.testing import FakeSandbox
from tests.orchestrator.pipeline_fixtures import CHAT, HEADS, coin_engine, heads

VICTIM = "1"  # the first trajectory of a fresh store: the one whose later input is bad
ENGINE_URL = "http://engine.test"


# -- a short job on a real store -------------------------------------------------------------

def run_job(url: str, *, engine: Any, family: TaskFamily,
            sandbox: Callable[[], FakeSandbox] = FakeSandbox) -> Store:
    """One synchronous learner step of `family` (groups of 2, batches of 4) through the real
    pipeline, writer and store at `url`, the fake learner and fake sandboxes; the store after."""
    cfg = parse_config({"rollout": {"group_size": 2, "max_concurrent": 4},
                        "learner": {"batch_size": 4}, "pipeline": {"mode": "sync", "steps": 1}})
    store = Store.open(url, create=True)
    store.create_run("r", name="bad-input", config={}, pipeline_mode="sync")
    learner = FakeLearner(store, "r", batch_size=4, max_steps=1)

    @asynccontextmanager
    async def acquire(spec, trajectory_id):
        yield sandbox()

    async def main() -> None:
        async with running_writer(store) as writer, anyio.create_task_group() as tg:
            await tg.start(learner.run)
            pipeline = Pipeline(run_id="r", cfg=cfg, store=store, writer=writer, engine=engine,
                                family=family, chat_format=CHAT, acquire=acquire,
                                poll_s=0.01)
            with anyio.fail_after(120):
                await pipeline.run()
            tg.cancel_scope.cancel()
        await engine.aclose()

    anyio.run(main)
    return store


def rows(store: Store, table: type, **where: Any) -> list[Any]:
    query = select(table.__table__)
    for column, value in where.items():
        query = query.where(table.__table__.c[column] == value)
    with store.engine.connect() as c:
        return list(c.execute(query))


def trajectory(store: Store, trajectory_id: int) -> Any:
    (row,) = rows(store, s.Trajectory, id=trajectory_id)
    return row


# -- an engine behind HTTP that breaks one reply ----------------------------------------------

Corruption = Callable[[dict], httpx.Response]


class BreakingEngine:
    """The scripted coin engine behind the embedded engine's routes, as an httpx transport for
    the real client; the reply to call number `call` of trajectory `victim` goes through
    `corrupt` first. `sent` holds every good reply's tokens, per trajectory."""

    def __init__(self, corrupt: Corruption, *, victim: str = VICTIM, call: int = 1) -> None:
        self.scripted = coin_engine()
        self.corrupt, self.victim, self.call = corrupt, victim, call
        self.calls: Counter[str] = Counter()
        self.sent: dict[str, list] = {}
        self.transport = httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        if request.url.path == RELEASE_SESSION_ROUTE:
            return httpx.Response(200, json={"session_id": body["session_id"],
                                             "released_tokens": 0})
        if request.url.path == ABORT_ROUTE:
            return httpx.Response(200, json={"aborted": 0})
        if request.url.path == "/health":  # the pipeline asks after an engine error
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "scripted"}]})
        if request.url.path == UPDATE_WEIGHTS_ROUTE:
            update = UpdateWeightsBody.model_validate(body)
            report = await self.scripted.update_weights(update.path, update.version,
                                                        mode=update.mode, kv=update.kv)
            return httpx.Response(200, json=UpdateWeightsReply(
                path=update.path, **{f: getattr(report, f) for f in UpdateWeightsReply.model_fields
                                     if f != "path"}).model_dump(mode="json"))
        assert request.url.path == GENERATE_ROUTE, request.url
        generate = GenerateBody.model_validate(body)
        result = await self.scripted.generate(GenerateRequest(
            generate.prompt_token_ids, generate.params, generate.session_id))
        payload = encode_generate_reply(result, request_id=generate.request_id)
        key = script_key(generate.session_id)
        number, self.calls[key] = self.calls[key], self.calls[key] + 1
        if key == self.victim and number == self.call:
            return self.corrupt(payload)
        self.sent.setdefault(key, []).append(result.tokens)
        return httpx.Response(200, json=payload)


# -- tool output chosen by the test ------------------------------------------------------------

@tool
async def emit(ctx: ToolContext, what: str) -> Any:
    """Return something that is not text, or raise.

    Args:
        what: "raise" raises an error whose message names an undecodable file (as
            os.fsdecode gives it, with a lone surrogate); anything else returns a set.
    """
    if what == "raise":
        raise ValueError("cannot open caf\udce9.txt")
    return {"a", "set"}


def bash_turn(command: str) -> ScriptedTurn:
    return ScriptedTurn(tuple(CHAT.encode_assistant(
        '<tool_call>{"name":"bash","arguments":{"command":"%s"}}</tool_call>' % command)))


EMIT_TURN = ScriptedTurn(tuple(CHAT.encode_assistant(
    '<tool_call>{"name":"emit","arguments":{"what":"x"}}</tool_call>')))
RAISE_TURN = ScriptedTurn(tuple(CHAT.encode_assistant(
    '<tool_call>{"name":"emit","arguments":{"what":"raise"}}</tool_call>')))


def shell_family() -> TaskFamily:
    def make(index: int, split: str) -> TaskInstance:
        return TaskInstance(prompt=f"shell {index}", tools=(bash, emit),
                            verifier=Rubric(Component("heads", heads, 1.0)),
                            limits=TaskLimits(max_turns=4, max_generated_tokens=512,
                                              max_observation_chars=1024),
                            difficulty=f"d{index % 2}")
    return TaskFamily("shell", make)


def shell_engine(victim_turn: ScriptedTurn) -> ScriptedEngine:
    """Every trajectory runs `bash good`, then `bash good` (the victim: `victim_turn`), then
    answers heads (reward 1)."""
    def script(key: str, index: int) -> ScriptedTurn:
        if index == 1 and key == VICTIM:
            return victim_turn
        return bash_turn("good") if index < 2 else HEADS
    return ScriptedEngine(script, keep_requests=False)


def output_sandbox(bad: ExecResult) -> Callable[[], FakeSandbox]:
    """Fake sandboxes whose `bash bad` prints `bad` and `bash good` prints `fine`."""
    def handler(argv: list[str], stdin: bytes | None) -> ExecResult | str:
        return bad if argv[-1] == "bad" else "fine"
    return lambda: FakeSandbox(handler)


# -- an MCP server that misbehaves on request -------------------------------------------------

def _listed(name: str, description: str, read_only: bool, **properties: str) -> dict[str, Any]:
    return {"name": name, "description": description,
            "inputSchema": {"type": "object",
                            "properties": {k: {"type": v} for k, v in properties.items()},
                            "required": list(properties)},
            "annotations": {"readOnlyHint": read_only, "idempotentHint": read_only}}


RAW_TOOLS = [
    _listed("look", "Answer with the text.", True, text="string"),
    _listed("garbage", "Write lines that are not JSON-RPC replies, then nothing.", False),
    _listed("bad_result", "Answer with a result that is not an object.", False),
    _listed("huge", "Answer with MB mebibytes of text.", True, mb="number"),
    _listed("silent", "Never answer.", False),
    _listed("chatty", "Write to stderr, then answer.", False),
    _listed("vanish", "Exit at once, silently.", False),
    _listed("fatal", "Write a last word to stderr, then exit.", False),
]

# Newline-delimited JSON-RPC on stdin/stdout, stdlib only (it runs in the sandbox image too).
RAW_MCP_SERVER = '''
import json, os, sys
TOOLS = json.loads(%r)
def send(message):
    sys.stdout.write(json.dumps(message) + "\\n")
    sys.stdout.flush()
def text(mid, value):
    send({"jsonrpc": "2.0", "id": mid, "result": {"content": [{"type": "text", "text": value}]}})
for line in sys.stdin:
    message = json.loads(line)
    mid, method = message.get("id"), message.get("method")
    if mid is None:
        continue
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {
            "protocolVersion": message["params"]["protocolVersion"],
            "capabilities": {"tools": {}}, "serverInfo": {"name": "raw", "version": "1"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": mid, "result": {"tools": TOOLS}})
    elif method == "tools/call":
        name, args = message["params"]["name"], message["params"].get("arguments") or {}
        if name == "look":
            text(mid, args["text"])
        elif name == "garbage":
            sys.stdout.write("starting up, please wait\\n")
            send({"jsonrpc": "2.0", "id": "someone-else", "result": {}})
        elif name == "bad_result":
            send({"jsonrpc": "2.0", "id": mid, "result": "not an object"})
        elif name == "huge":
            head = '{"jsonrpc": "2.0", "id": %%d, "result": {"content": [{"type": "text", "text": "'
            sys.stdout.write(head %% mid)
            for _ in range(int(args["mb"] * 16)):
                sys.stdout.write("x" * 65536)
            sys.stdout.write('"}]}}\\n')
            sys.stdout.flush()
        elif name == "chatty":
            sys.stderr.write("warming up the cache\\n")
            sys.stderr.flush()
            text(mid, "warm")
        elif name == "vanish":
            os._exit(4)
        elif name == "fatal":
            sys.stderr.write("fatal: the disk is on fire\\n")
            sys.stderr.flush()
            os._exit(5)
''' % json.dumps(RAW_TOOLS)
