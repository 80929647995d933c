"""MCP stdio servers as tools: `[[tools.mcp]] command = [...]` in the job config.

A server's tools are listed once when the job starts (`tools/list`) and added, with their
JSON Schemas, to every task instance like our own tools (so they are in the prompt listing and
the content hash). At run time every trajectory gets its own server process, started on its
first call and stopped with the trajectory:

- by default the server runs **inside the trajectory's sandbox** (tool code is untrusted): a
  background process whose stdin and stdout are named pipes under /tmp, spoken to by a small
  stdlib-only JSON-RPC client run with `sandbox.exec` for each call (so the image needs
  python3 and whatever the server needs; the network stays off);
- with `trusted = true` it runs **on the host** as a child process of the orchestrator.

Both speak MCP's stdio transport (newline-delimited JSON-RPC 2.0: `initialize`, then
`notifications/initialized`, then `tools/list` / `tools/call`); stalewise's own client is
used on both sides, the servers may be written with any SDK (the tests use the official one).

What the model sees: a `tools/call` result's text content (other content kinds summarised);
`isError: true` becomes an `Error: ...` observation (`error_type = tool_error`); a server that
exits, does not answer in time or answers with more than `max_reply_mb` becomes an observation
saying so (`mcp_server_exited`, `timeout`, `mcp_reply_too_large`), recorded like every tool
call, and the next call starts a fresh server. A server that exited says what it wrote to
stderr since this request was sent (its last line), or that it wrote nothing during this call;
one that stays silent says how many lines it wrote on stdout that were not a JSON-RPC reply to
the request (stdout must carry only JSON-RPC messages). A reply within `max_reply_mb` reaches
the client whole: in the sandbox, one too long for the exec's output cap is handed over in a
file. A server
that cannot even be started or listed when the job starts stops the job with one line.

Annotations: `readOnlyHint` is exported with the tool (`Tool.read_only_hint`, so `stalewise
tasks tools --format mcp` says what the server says), but the agent loop never runs an MCP tool
concurrently with others because of it (`Tool.read_only` stays False): read-only calls of one
turn run at the same time, and a server's hint is a hint, by MCP's own rules not to be trusted
from an untrusted server, so a wrong one would reorder what the model asked for.
`idempotentHint` only allows retries after a sandbox failure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import IO, Any

import anyio
import anyio.abc

from config.tools import McpServerConfig
from core.sandbox import Sandbox, SandboxError, SandboxSpec
from tasks.api import TaskFamily, TaskInstance
from tasks.tools import Tool, ToolContext, ToolResult

PROTOCOL_VERSION = "2025-06-18"
CLIENT_INFO = {"name": "stalewise", "version": "0.1"}
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CONTEXT = "__stalewise_ctx"


# The agent loop's own time limit on an MCP tool call is only a backstop: the client's limit
# (`timeout_s`) fires first and says which server did not answer. In the sandbox the client
# itself watches `timeout_s`; its exec gets a margin, so the client can still say what it saw.
BACKSTOP_MARGIN_S = 10.0
CLIENT_MARGIN_S = 5.0


class McpError(Exception):
    """The server misbehaved (exited, timed out, answered with a JSON-RPC error)."""

    def __init__(self, message: str, kind: str = "mcp_error") -> None:
        super().__init__(message)
        self.kind = kind


# -- connections -----------------------------------------------------------------------------

class Connection(ABC):
    """One running server for one trajectory; requests one at a time."""

    def __init__(self, server: McpServerConfig) -> None:
        self.server = server
        self.next_id = 0
        self.lock = anyio.Lock()
        self.ready = False

    async def request(self, method: str, params: Mapping[str, Any] | None,
                      timeout_s: float) -> dict[str, Any]:
        async with self.lock:
            if not self.ready:
                await self._start_and_initialize()
            return await self._round_trip(method, params, timeout_s)

    async def _start_and_initialize(self) -> None:
        await self.start()
        await self._round_trip("initialize", {"protocolVersion": PROTOCOL_VERSION,
                                              "capabilities": {}, "clientInfo": CLIENT_INFO},
                               self.server.startup_timeout_s)
        await self.notify("notifications/initialized")
        self.ready = True

    async def _round_trip(self, method: str, params: Mapping[str, Any] | None,
                          timeout_s: float) -> dict[str, Any]:
        self.next_id += 1
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": self.next_id, "method": method}
        if params is not None:
            message["params"] = dict(params)
        try:
            reply = await self.exchange(message, timeout_s)
        except McpError as err:
            if err.kind in _RESTART:
                self.ready = False  # the next call starts a fresh server
                await self.stop()
            raise
        if "error" in reply:
            error = reply["error"] if isinstance(reply["error"], dict) else {}
            raise McpError(f"MCP server {self.server.label} answered {method} with error "
                           f"{error.get('code')}: {error.get('message')}")
        result = reply.get("result")
        if not isinstance(result, dict):
            raise McpError(f"MCP server {self.server.label} answered {method} with a result "
                           f"that is {type(result).__name__} {_shown(result)}, not an object: "
                           f"not an MCP answer; fix the server")
        return result

    @abstractmethod
    async def start(self) -> None:
        """Implemented by the host and in-sandbox connections."""

    @abstractmethod
    async def notify(self, method: str) -> None:
        """Implemented by the host and in-sandbox connections."""

    @abstractmethod
    async def exchange(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Implemented by the host and in-sandbox connections."""

    @abstractmethod
    async def stop(self) -> None:
        """Implemented by the host and in-sandbox connections."""

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.stop()


# Errors after which the server's stdout cannot be trusted to be in step: start a fresh one.
_RESTART = ("mcp_server_exited", "timeout", "mcp_reply_too_large")


class _Ignored:
    """Lines a server wrote on stdout while a request waited that are not a reply to it."""

    def __init__(self) -> None:
        self.count, self.last = 0, b""

    def note(self, line: bytes) -> None:
        self.count += 1
        self.last = line

    def said(self) -> str:
        if not self.count:
            return ""
        return (f"; it wrote {self.count} line(s) on stdout that are not a JSON-RPC reply to "
                f"it (the last: {self.last[:200].decode(errors='replace')!r}): stdout must "
                f"carry only JSON-RPC messages")


def _too_large(server: McpServerConfig, method: str) -> McpError:
    return McpError(f"MCP server {server.label} sent more than {server.max_reply_mb:g} MiB "
                    f"without finishing its answer to {method}; it was stopped (the next call "
                    f"starts a fresh one): make the tool answer less or raise [[tools.mcp]] "
                    f"max_reply_mb", "mcp_reply_too_large")


class HostConnection(Connection):
    """A trusted server as a child process of this process."""

    def __init__(self, server: McpServerConfig) -> None:
        super().__init__(server)
        self.process: anyio.abc.Process | None = None
        self.buffer = bytearray()
        self.scanned = 0  # bytes of `buffer` known to hold no newline
        self.stderr: IO[bytes] | None = None
        self.stderr_mark = 0  # size of its stderr when the current request was sent

    async def start(self) -> None:
        self.stderr = tempfile.TemporaryFile()  # a file, so a chatty server never blocks
        try:
            self.process = await anyio.open_process(
                self.server.command, env={**os.environ, **self.server.env}, stderr=self.stderr)
        except OSError as err:
            raise McpError(f"MCP server {self.server.label}: cannot start "
                           f"{self.server.command}: {err}", "mcp_server_exited") from err
        self.buffer, self.scanned = bytearray(), 0

    async def _send(self, message: dict[str, Any]) -> None:
        assert self.process is not None and self.process.stdin is not None
        if self.stderr is not None:
            self.stderr_mark = os.fstat(self.stderr.fileno()).st_size
        try:
            await self.process.stdin.send(json.dumps(message).encode() + b"\n")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            raise await self._exited(message["method"]) from None

    async def notify(self, method: str) -> None:
        await self._send({"jsonrpc": "2.0", "method": method})

    async def exchange(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        await self._send(message)
        ignored = _Ignored()
        with anyio.move_on_after(timeout_s) as scope:
            while True:
                reply = _reply_to(await self._line(message["method"]), message["id"], ignored)
                if reply is not None:
                    return reply
        assert scope.cancelled_caught
        raise McpError(f"MCP server {self.server.label} did not answer {message['method']} "
                       f"within {timeout_s:g}s{ignored.said()}", "timeout")

    async def _line(self, method: str) -> bytes:
        """The next line of the server's stdout (each byte is looked at once, so a long answer
        costs its length), or `mcp_reply_too_large` once it passes `max_reply_mb`."""
        assert self.process is not None and self.process.stdout is not None
        while True:
            end = self.buffer.find(b"\n", self.scanned)
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[:end + 1]
                self.scanned = 0
                return line
            self.scanned = len(self.buffer)
            if self.scanned > self.server.max_reply_bytes:
                raise _too_large(self.server, method)
            try:
                self.buffer += await self.process.stdout.receive(1 << 20)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                raise await self._exited(method) from None

    async def _exited(self, method: str) -> McpError:
        assert self.process is not None
        with anyio.move_on_after(2):
            await self.process.wait()
        stderr = b""
        if self.stderr is not None:  # what it wrote since this request was sent, the end of it
            self.stderr.seek(max(self.stderr_mark, os.fstat(self.stderr.fileno()).st_size - 2000))
            stderr = self.stderr.read()
        return McpError(_exited_text(self.server.label, self.process.returncode,
                                     stderr.decode(errors="replace"), method),
                        "mcp_server_exited")

    async def stop(self) -> None:
        process, self.process = self.process, None
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None
        if process is None:
            return
        if process.returncode is None:
            process.kill()
        with anyio.move_on_after(5):
            await process.wait()
        await process.aclose()


# The in-sandbox side: a launcher (sh) and a per-request client (python3, stdlib only).
_LAUNCH = r'''d=$1; shift
rm -rf "$d" && mkdir -p "$d" && mkfifo "$d/in" "$d/out" || exit 97
sh -c 'd=$1; shift; exec 3<>"$d/in" 4<>"$d/out"
  "$@" <&3 >&4 2>"$d/stderr"; echo $? >"$d/status.new"; mv "$d/status.new" "$d/status"' \
  sh "$d" "$@" </dev/null >/dev/null 2>&1 &
echo $! >"$d/pid"
'''
_CLIENT = r'''
import json, os, select, sys, time
d, send, want = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
limit, cap = float(sys.argv[4]), int(sys.argv[5])
err = os.path.join(d, "stderr")
def size():
    try:
        return os.path.getsize(err)
    except OSError:
        return 0
mark = size()  # what the server wrote to stderr before this request is not about it
def status():
    try:
        with open(os.path.join(d, "status")) as f:
            return f.read().strip() or "?"
    except OSError:
        return None
def answer(value):
    print(json.dumps(value))
    sys.exit(0)
def exited():
    tail = ""
    try:
        with open(err, "rb") as f:
            f.seek(max(mark, size() - 2000))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        pass
    answer({"exited": status(), "stderr": tail})
if status() is not None:
    exited()
fd = os.open(os.path.join(d, "in"), os.O_WRONLY)
for message in send:
    os.write(fd, (json.dumps(message) + "\n").encode())
os.close(fd)
if want is None:
    answer({})
fd = os.open(os.path.join(d, "out"), os.O_RDONLY | os.O_NONBLOCK)
buf, scanned, ignored, last = bytearray(), 0, 0, b""
deadline = time.monotonic() + limit
while True:
    if time.monotonic() > deadline:
        answer({"silent": True, "ignored": ignored,
                "last": last[:200].decode("utf-8", "replace")})
    ready = select.select([fd], [], [], 0.1)[0]
    chunk = b""
    if ready:
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            chunk = b""
    if not chunk:
        if status() is not None:
            exited()
        if ready:
            time.sleep(0.05)
        continue
    buf += chunk
    while True:
        end = buf.find(b"\n", scanned)
        if end < 0:
            scanned = len(buf)
            break
        line = bytes(buf[:end])
        del buf[:end + 1]
        scanned = 0
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if isinstance(reply, dict) and reply.get("id") == want and (
                "result" in reply or "error" in reply):
            if len(line) <= 512:
                answer({"reply": reply})
            with open(os.path.join(d, "reply"), "wb") as f:  # too long for the exec's output
                f.write(line)
            answer({"reply_file": os.path.join(d, "reply")})
        if not (isinstance(reply, dict) and "method" in reply):
            ignored, last = ignored + 1, line
    if scanned > cap:
        answer({"too_large": scanned})
'''


class SandboxConnection(Connection):
    """An untrusted server inside the trajectory's sandbox, reached through `sandbox.exec`."""

    def __init__(self, server: McpServerConfig, sandbox: Sandbox) -> None:
        super().__init__(server)
        self.sandbox = sandbox
        self.dir = f"/tmp/stalewise-mcp/{server.label}-{time.monotonic_ns()}"

    async def start(self) -> None:
        self.dir = f"/tmp/stalewise-mcp/{self.server.label}-{time.monotonic_ns()}"
        result = await self.sandbox.exec(["sh", "-c", _LAUNCH, "sh", self.dir,
                                          *self.server.command],
                                         env=self.server.env, timeout=self.server.startup_timeout_s)
        if not result.ok:
            raise McpError(f"MCP server {self.server.label}: cannot start it in the sandbox "
                           f"({result.error_type or f'exit {result.exit_code}'}: "
                           f"{(result.stderr or result.stdout).strip()[-300:]})",
                           "mcp_server_exited")

    async def _client(self, send: list[dict[str, Any]], want: int | None,
                      timeout_s: float, method: str) -> dict[str, Any]:
        result = await self.sandbox.exec(  # the client's own limit fires first and says more
            ["python3", "-I", "-S", "-c", _CLIENT, self.dir, json.dumps(send), json.dumps(want),
             repr(timeout_s), str(self.server.max_reply_bytes)],
            timeout=timeout_s + CLIENT_MARGIN_S)
        if result.error_type == "container_died":
            raise SandboxError(result.error_message or "the sandbox died during an MCP call")
        if result.timed_out:
            raise McpError(f"MCP server {self.server.label} did not answer {method} within "
                           f"{timeout_s:g}s", "timeout")
        try:
            answer = json.loads(result.stdout)
        except ValueError:
            raise McpError(f"MCP client in the sandbox failed (exit {result.exit_code}"
                           f"{', output truncated' if result.truncated else ''}): "
                           f"{(result.stderr or result.stdout).strip()[-300:]}") from None
        if "exited" in answer:
            raise McpError(_exited_text(self.server.label, answer["exited"], answer["stderr"],
                                        method), "mcp_server_exited")
        if "silent" in answer:
            ignored = _Ignored()
            ignored.count, ignored.last = int(answer["ignored"]), str(answer["last"]).encode()
            raise McpError(f"MCP server {self.server.label} did not answer {method} within "
                           f"{timeout_s:g}s{ignored.said()}", "timeout")
        if "too_large" in answer:
            raise _too_large(self.server, method)
        return answer

    async def notify(self, method: str) -> None:
        await self._client([{"jsonrpc": "2.0", "method": method}], None,
                           self.server.startup_timeout_s, method)

    async def exchange(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        answer = await self._client([message], message["id"], timeout_s, message["method"])
        if "reply_file" in answer:
            reply = _reply_to(await self.sandbox.read_file(answer["reply_file"]), message["id"])
            if reply is None:
                raise McpError(f"MCP client in the sandbox lost the answer to "
                               f"{message['method']} ({answer['reply_file']} was changed)")
            return reply
        return dict(answer["reply"])

    async def stop(self) -> None:
        try:
            await self.sandbox.exec(["sh", "-c", 'pkill -9 -P "$(cat "$1/pid")" 2>/dev/null; '
                                     'kill -9 "$(cat "$1/pid")" 2>/dev/null; true',
                                     "sh", self.dir], timeout=10)
        except SandboxError:
            pass  # the sandbox is gone, and the server with it


def _reply_to(line: bytes, want: int, ignored: _Ignored | None = None) -> dict[str, Any] | None:
    """The reply to request `want` in `line`, else None; a line that is neither that reply
    nor a message of the server's own (a notification or request) is noted in `ignored`."""
    try:
        reply = json.loads(line)
    except ValueError:
        reply = None
    if isinstance(reply, dict) and reply.get("id") == want and (
            "result" in reply or "error" in reply):
        return reply
    if ignored is not None and not (isinstance(reply, dict) and "method" in reply):
        ignored.note(line)
    return None


def _exited_text(label: str, status: Any, stderr: str, method: str) -> str:
    """Why a call failed: the server exited; `stderr` is what it wrote since the request."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    said = (f"; its last words on stderr: {lines[-1].strip()[:300]}" if lines
            else "; it wrote nothing to stderr during this call")
    return f"MCP server {label} exited (status {status}) before answering {method}{said}"


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:80] + "..."


def connect(server: McpServerConfig, sandbox: Sandbox) -> Connection:
    return HostConnection(server) if server.trusted else SandboxConnection(server, sandbox)


# -- tools -----------------------------------------------------------------------------------

def observation(result: Mapping[str, Any]) -> ToolResult:
    """A `tools/call` result as the model sees it."""
    parts = []
    for item in result.get("content") or []:
        if isinstance(item, dict) and item.get("type") == "text":
            parts.append(str(item.get("text", "")))
        elif isinstance(item, dict):
            parts.append(f"[{item.get('type', 'content')} content]")
    if not parts and "structuredContent" in result:
        parts.append(json.dumps(result["structuredContent"], separators=(",", ":")))
    text = "\n".join(parts) or "(no output)"
    if result.get("isError"):
        return ToolResult(text=f"Error: {text}", error_type="tool_error")
    return ToolResult(text=text)


def mcp_tool(server: McpServerConfig, listed: Mapping[str, Any]) -> Tool:
    """A `Tool` for one entry of the server's `tools/list`."""
    remote = str(listed.get("name", ""))
    name = server.prefix + remote
    if not _NAME.match(name):
        raise McpError(f"MCP server {server.label}: tool name {name!r} does not match "
                       f"{_NAME.pattern}; set a prefix or rename the tool")
    schema = listed.get("inputSchema")
    if not isinstance(schema, dict):
        schema = {"type": "object", "properties": {}}
    state_key = f"mcp:{server.label}"

    async def call(**arguments: Any) -> ToolResult:
        ctx: ToolContext = arguments.pop(_CONTEXT)
        connection = ctx.state.get(state_key)
        if connection is None:
            connection = ctx.state[state_key] = connect(server, ctx.sandbox)
        timeout = min(server.timeout_s, ctx.timeout_s or server.timeout_s)
        try:
            result = await connection.request("tools/call", {"name": remote,
                                                             "arguments": arguments}, timeout)
        except McpError as err:
            return ToolResult(text=f"Error: {err}", error_type=err.kind,
                              timed_out=err.kind == "timeout")
        return observation(result)

    annotations = listed.get("annotations") if isinstance(listed.get("annotations"), dict) else {}
    hint = annotations.get("readOnlyHint")
    return Tool(name=name, description=str(listed.get("description") or remote),
                parameters=dict(schema), fn=call, context_param=_CONTEXT,
                read_only=False,  # never trusted at run time (module docstring, Annotations)
                read_only_hint=hint if isinstance(hint, bool) else None,
                idempotent=bool(annotations.get("idempotentHint", False)),
                timeout_s=server.timeout_s + BACKSTOP_MARGIN_S + CLIENT_MARGIN_S)


async def list_tools(server: McpServerConfig, sandbox: Sandbox) -> list[dict[str, Any]]:
    """The server's `tools/list` (all pages), from a server started just for this."""
    connection = connect(server, sandbox)
    try:
        tools: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            page = await connection.request("tools/list", {"cursor": cursor} if cursor else None,
                                            server.startup_timeout_s)
            tools += [t for t in page.get("tools", []) if isinstance(t, dict)]
            cursor = page.get("nextCursor")
            if not cursor:
                return tools
    finally:
        await connection.aclose()


OpenSandbox = Callable[[SandboxSpec], AbstractAsyncContextManager[Sandbox]]


async def discover_tools(servers: Sequence[McpServerConfig], spec: SandboxSpec,
                         open_sandbox: OpenSandbox) -> list[Tool]:
    """Every server's tools; untrusted servers are listed inside a sandbox of `spec`."""
    tools: list[Tool] = []
    for server in servers:
        try:
            if server.trusted:
                listed = await list_tools(server, _NoSandbox())
            else:
                async with open_sandbox(spec) as sandbox:
                    listed = await list_tools(server, sandbox)
            tools += [mcp_tool(server, entry) for entry in listed]
        except McpError as err:
            raise McpError(f"[[tools.mcp]] {server.label}: {err}; check its command "
                           f"{server.command} (in the task image unless trusted = true)") from None
    names = [t.name for t in tools]
    clash = next((n for n in names if names.count(n) > 1), None)
    if clash:
        raise McpError(f"two MCP tools are named {clash!r}; give a [[tools.mcp]] a prefix")
    return tools


def with_tools(family: TaskFamily, tools: Sequence[Tool]) -> TaskFamily:
    """`family` whose every instance also has `tools` (after its own; names must not clash)."""
    if not tools:
        return family
    extra = tuple(tools)

    def make(index: int, split: str) -> TaskInstance:
        task = family.instance(index, split)
        clash = {t.name for t in task.tools} & {t.name for t in extra}
        if clash:
            raise ValueError(f"MCP tools {sorted(clash)} clash with the task's own tools; "
                             "give the [[tools.mcp]] a prefix")
        return dataclasses.replace(task, tools=task.tools + extra)

    demonstrate: Callable[[TaskInstance, bool], Any] | None = (
        family.demonstration if family.has_demonstrations else None)
    make(0, family.splits[0])  # a name clash shows now, not mid-job
    return TaskFamily(family.name, make, demonstrate=demonstrate, size=family.size,
                      splits=family.splits, description=family.description,
                      options=family.options, split_key=family.split_key,
                      shares=family.shares, diagnose=family.diagnose)


class _NoSandbox:
    """Stands in for the sandbox when a trusted server is listed on the host."""

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        raise SandboxError("a trusted MCP server does not use the sandbox")
