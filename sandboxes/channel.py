"""Request/reply framing between the orchestrator and the in-sandbox agent.

`AgentChannel` multiplexes concurrent requests over one byte transport with no background task:
whichever caller is waiting reads frames for everyone (one reader at a time) and hands replies
to their owners. Reads are buffered in the channel, so a cancelled caller never loses bytes.
When the transport ends, every waiting and future request raises `AgentGone`.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Callable, Protocol

import anyio

from core.sandbox import SandboxError

HEADER = struct.Struct(">I")


class AgentGone(SandboxError):
    """The agent (and usually its container) stopped; the sandbox cannot be used any more."""


class AgentRequestError(SandboxError):
    """The agent refused or failed one request (bad path, file too large, ...)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class Transport(Protocol):
    async def send(self, data: bytes) -> None: ...

    async def receive(self) -> bytes:
        """The next bytes the agent wrote to stdout; raises anyio.EndOfStream at the end."""
        ...

    async def aclose(self) -> None: ...


class AgentChannel:
    def __init__(self, transport: Transport, why_gone: Callable[[], str]) -> None:
        self._transport = transport
        self._why_gone = why_gone
        self._buffer = bytearray()
        self._next_id = 0
        self._pending: set[int] = set()
        self._replies: dict[int, dict[str, Any]] = {}
        self._waiters: dict[int, anyio.Event] = {}
        self._reading = False
        self._send_lock = anyio.Lock()
        self._gone: str | None = None

    @property
    def gone(self) -> str | None:
        return self._gone

    async def send_raw(self, data: bytes) -> None:
        async with self._send_lock:
            await self._transport.send(data)

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and return its reply; `AgentRequestError` when `ok` is false."""
        if self._gone is not None:
            raise AgentGone(self._gone)
        self._next_id += 1
        rid = self._next_id
        body = json.dumps({"id": rid, "op": op, **fields}, separators=(",", ":")).encode()
        self._pending.add(rid)
        try:
            try:
                await self.send_raw(HEADER.pack(len(body)) + body)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                self._mark_gone(f"{self._why_gone()} (send failed: {exc!r})")
                raise AgentGone(self._gone or "") from exc
            reply = await self._wait(rid)
        finally:
            self._pending.discard(rid)
            self._replies.pop(rid, None)
        if not reply.get("ok"):
            raise AgentRequestError(str(reply.get("error")), str(reply.get("kind")))
        return reply

    async def _wait(self, rid: int) -> dict[str, Any]:
        while True:
            if rid in self._replies:
                return self._replies.pop(rid)
            if self._gone is not None:
                raise AgentGone(self._gone)
            if not self._reading:
                self._reading = True
                try:
                    await self._read_until(rid)
                finally:
                    self._reading = False
                    self._wake_all()  # someone else takes over reading
                continue
            event = anyio.Event()
            self._waiters[rid] = event
            try:
                await event.wait()
            finally:
                self._waiters.pop(rid, None)

    async def _read_until(self, rid: int) -> None:
        while rid not in self._replies:
            frame = await self._read_frame()
            fid = int(frame.get("id", -1))
            if fid in self._pending:  # replies to cancelled requests are dropped
                self._replies[fid] = frame
                if fid in self._waiters:
                    self._waiters[fid].set()

    async def _read_frame(self) -> dict[str, Any]:
        while True:
            if len(self._buffer) >= HEADER.size:
                (size,) = HEADER.unpack_from(self._buffer)
                if len(self._buffer) >= HEADER.size + size:
                    body = bytes(self._buffer[HEADER.size:HEADER.size + size])
                    del self._buffer[:HEADER.size + size]
                    return json.loads(body)
            try:
                chunk = await self._transport.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                    OSError) as exc:
                self._mark_gone(self._why_gone())
                raise AgentGone(self._gone or "") from exc
            self._buffer += chunk

    def _mark_gone(self, reason: str) -> None:
        if self._gone is None:
            self._gone = reason
        self._wake_all()

    def _wake_all(self) -> None:
        for event in self._waiters.values():
            event.set()

    def close(self, reason: str) -> None:
        self._mark_gone(reason)
