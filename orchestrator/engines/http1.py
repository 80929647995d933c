"""A lean HTTP/1.1 client for an engine's routes: kept-alive connections to one server, each
request in one write, each reply read by its `Content-Length`, its chunks, or to the end of the
connection, whole (`request`) or as it arrives (`stream`: vLLM's server-sent events).

A model call through httpx costs the orchestrator about 1.3 ms of CPU (its client, httpcore,
h11 and anyio's streams, per call), and a streamed vLLM completion 2.5 ms; this client does the
same exchanges in a fraction of that (`bench/engine_client.py`), and the engine client is most
of what a turn costs a real job. `orchestrator.engines.http.EngineTransport` sends its plain
`http://` requests through it; `https://` and proxied URLs stay on httpx.

Failures are httpx's exception classes, so the transport's failure policy reads both clients
alike: `ConnectError`/`ConnectTimeout` (the request never left), `ReadTimeout` (no reply in
time), `RemoteProtocolError` (the server closed the connection or sent something that is not
HTTP/1.1). A request that ends any other way than with a whole reply (cancelled, timed out,
broken) closes its connection; only a connection whose exchange completed is used again.
asyncio only (the orchestrator's event loop).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any
from urllib.parse import urlencode

import httpx

_HEAD_END = b"\r\n\r\n"
_HEX = re.compile(rb"[0-9a-fA-F]{1,16}")  # a chunk's size
_NO_BODY = frozenset({204, 304})
# How long a stream left before its end (vLLM's `[DONE]` comes just before the end of its body)
# may take to end, so that its connection can carry another request; past it the connection is
# closed instead.
FINISH_S = 1.0


class Reply:
    """A whole reply, under the names httpx's `Response` gives what the transport reads."""

    __slots__ = ("status_code", "headers", "content")

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code, self.headers, self.content = status_code, headers, content

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        _, _, charset = self.headers.get("content-type", "").partition("charset=")
        try:
            return self.content.decode(charset.split(";")[0].strip() or "utf-8", "replace")
        except LookupError:  # a charset Python does not know
            return self.content.decode("utf-8", "replace")

    @property
    def reason_phrase(self) -> str:
        try:
            return HTTPStatus(self.status_code).phrase
        except ValueError:
            return ""


class StreamedReply(Reply):
    """A reply whose body is read as it arrives (`aiter_data`: server-sent events), or whole
    (`aread`, as with httpx's streamed `Response`)."""

    __slots__ = ("body",)

    def __init__(self, status_code: int, headers: dict[str, str], body: _Body) -> None:
        super().__init__(status_code, headers, b"")
        self.body = body

    async def aread(self) -> bytes:
        self.content = await self.body.read_all()
        return self.content

    async def aiter_data(self) -> AsyncIterator[list[bytes]]:
        """The server-sent events' `data:` fields as they arrive, those of each piece of body
        together (one list per piece), each without its field name and surrounding blanks."""
        pending = b""
        while piece := await self.body.piece():
            lines = (pending + piece).split(b"\n")
            pending = lines.pop()
            data = [line[5:].strip() for line in lines if line.startswith(b"data:")]
            if data:
                yield data
        if pending.startswith(b"data:"):
            yield [pending[5:].strip()]


class _Connection(asyncio.Protocol):
    """One TCP connection: the bytes received and not yet read, and a waiter for more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False  # the server closed its side, or the connection is gone
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def more(self, timeout: float | None) -> None:
        """Wait until more bytes arrive or the connection ends; `httpx.ReadTimeout` after
        `timeout` seconds without either."""
        if self.closed:
            raise httpx.RemoteProtocolError("the server closed the connection mid-reply")
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _expire, waiter, timeout)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def fill(self, size: int, timeout: float | None) -> None:
        """Wait until at least `size` bytes are buffered (errors as `more`)."""
        while len(self.buffer) < size:
            await self.more(timeout)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Body:
    """The body of one reply, read from its connection as it arrives: `length` bytes, chunks
    (`chunked`), or up to the end of the connection (neither)."""

    __slots__ = ("connection", "timeout", "chunked", "to_end", "left", "done")

    def __init__(self, connection: _Connection, timeout: float | None, *, length: int | None,
                 chunked: bool) -> None:
        self.connection, self.timeout, self.chunked = connection, timeout, chunked
        self.to_end = length is None and not chunked
        self.left = length or 0  # bytes left in the body, or in the chunk being read
        self.done = not chunked and length == 0

    async def piece(self) -> bytes:
        """The body's next bytes, as many as have arrived (at least one); b"" at its end."""
        if self.done:
            return b""
        connection, buffer = self.connection, self.connection.buffer
        if self.to_end:
            while not buffer and not connection.closed:
                await connection.more(self.timeout)
            piece = bytes(buffer)
            buffer.clear()
            self.done = not piece
            return piece
        if self.chunked and not self.left:
            self.left = await self._chunk_size()
            if not self.left:
                await self._trailers()
                self.done = True
                return b""
        while not buffer:
            await connection.more(self.timeout)
        piece = bytes(buffer[:self.left])
        del buffer[:len(piece)]
        self.left -= len(piece)
        if not self.left:
            if self.chunked:  # the chunk's own line end
                await connection.fill(2, self.timeout)
                del buffer[:2]
            else:
                self.done = True
        return piece

    async def read_all(self) -> bytes:
        """The rest of the body."""
        if not self.chunked and not self.to_end and not self.done:
            await self.connection.fill(self.left, self.timeout)
            buffer = self.connection.buffer
            content = bytes(buffer[:self.left])
            del buffer[:self.left]
            self.left, self.done = 0, True
            return content
        parts = []
        while piece := await self.piece():
            parts.append(piece)
        return b"".join(parts)

    async def finish(self, wait_s: float) -> bool:
        """Read the rest of the body for at most `wait_s` seconds, dropping it; whether it
        ended in time (and the connection can carry another request)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        self.timeout = wait_s
        try:
            while await self.piece():
                if loop.time() > deadline:
                    return False
        except httpx.HTTPError:
            return False
        return True

    async def _chunk_size(self) -> int:
        connection, buffer = self.connection, self.connection.buffer
        end = buffer.find(b"\r\n")
        while end < 0:
            await connection.more(self.timeout)
            end = buffer.find(b"\r\n")
        size_text = bytes(buffer[:end]).split(b";", 1)[0].strip()
        if not _HEX.fullmatch(size_text):
            raise httpx.RemoteProtocolError(f"malformed chunk size {size_text[:20]!r}")
        del buffer[:end + 2]
        return int(size_text, 16)

    async def _trailers(self) -> None:
        """Skip the trailer fields after the last chunk, up to the empty line that ends them."""
        connection, buffer = self.connection, self.connection.buffer
        while (end := buffer.find(b"\r\n")) != 0:
            if end < 0:
                await connection.more(self.timeout)
            else:
                del buffer[:end + 2]
        del buffer[:2]


def _expire(waiter: asyncio.Future[None], timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout(f"no reply within {timeout:g}s"))


class Http1Client:
    """Requests to the server at `base_url` (`http://host:port/prefix`, paths are appended to
    it); the caller bounds how many run at once (each holds one connection; a connection is
    opened when none is idle)."""

    def __init__(self, base_url: str) -> None:
        url = httpx.URL(base_url)
        if url.scheme != "http":
            raise ValueError(f"Http1Client speaks plain http://, not {url.scheme}://")
        self.host, self.port = url.host, url.port or 80
        self.path_prefix = url.raw_path.decode("ascii").rstrip("/")
        self._host_header = b"Host: " + url.netloc + b"\r\n"
        self._idle: list[_Connection] = []

    async def request(self, method: str, path: str, *, json: Any = None,  # noqa: A002
                      content: bytes | None = None, headers: Mapping[str, str] | None = None,
                      params: dict | None = None, timeout: httpx.Timeout) -> Reply:
        """`method path` with `json` as its body (or the bytes `content`, with `headers`);
        the whole reply. Same keywords as `httpx.AsyncClient.request` for the ones the
        transport uses."""
        message = self._message(method, path, json, content, headers, params)
        connection, reply, keep = await self._send(message, method, timeout)
        try:
            content = await reply.body.read_all()
        except BaseException:
            connection.close()
            raise
        self._done_with(connection, keep)
        return Reply(reply.status_code, reply.headers, content)

    @asynccontextmanager
    async def stream(self, method: str, path: str, *, json: Any = None,  # noqa: A002
                     content: bytes | None = None, headers: Mapping[str, str] | None = None,
                     timeout: httpx.Timeout) -> AsyncIterator[StreamedReply]:
        """`method path` with its body as for `request`; the reply with its body unread, for
        the block. `timeout.read` bounds each wait for more of it. A block that leaves the
        body unread waits up to `FINISH_S` for its end, then the connection is closed. A block
        that raises closes it unless the body was read to its end (an error reply read whole,
        then raised as the engine's error, leaves the connection for the next request)."""
        message = self._message(method, path, json, content, headers, None)
        connection, reply, keep = await self._send(message, method, timeout)
        try:
            yield reply
            if not reply.body.done:
                keep = await reply.body.finish(FINISH_S) and keep
        except BaseException:
            self._done_with(connection, keep and reply.body.done)
            raise
        self._done_with(connection, keep)

    async def _send(self, message: bytes, method: str, timeout: httpx.Timeout
                    ) -> tuple[_Connection, StreamedReply, bool]:
        """Send the request `message` on a connection; the connection, the reply's head (its
        body unread) and whether the connection can carry another request after it."""
        connection = await self._connection(timeout.connect)
        try:
            assert connection.transport is not None
            connection.transport.write(message)
            reply, keep = await _read_head(connection, timeout.read, method)
        except BaseException:
            connection.close()
            raise
        return connection, reply, keep

    def _message(self, method: str, path: str, json: Any,  # noqa: A002
                 content: bytes | None, headers: Mapping[str, str] | None,
                 params: dict | None) -> bytes:
        path = self.path_prefix + path
        if params:
            path = f"{path}?{urlencode(params)}"
        head = [f"{method} {path} HTTP/1.1\r\n".encode("latin-1"), self._host_header,
                b"Accept-Encoding: identity\r\n"]
        head += [f"{name}: {value}\r\n".encode("latin-1") for name, value in
                 (headers or {}).items()]
        body = b"" if content is None else content
        if json is not None:
            body = _dumps(json)
            head.append(b"Content-Type: application/json\r\n")
        if body or method in ("POST", "PUT", "PATCH"):
            head.append(b"Content-Length: %d\r\n" % len(body))
        head.append(b"\r\n")
        return b"".join(head) + body

    async def _connection(self, timeout: float | None) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and not connection.buffer:
                return connection
            connection.close()  # closed by the server while idle, or sent bytes unasked
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port), timeout)
        except asyncio.TimeoutError as exc:
            raise httpx.ConnectTimeout(f"no connection to {self.host}:{self.port} within "
                                       f"{timeout:g}s") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}") from exc
        return connection

    def _done_with(self, connection: _Connection, keep: bool) -> None:
        """Keep `connection` for another request, or close it."""
        if keep and not connection.closed:
            self._idle.append(connection)
        else:
            connection.close()

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()


def _dumps(value: Any) -> bytes:
    """JSON as httpx writes a `json=` body: compact, UTF-8, no NaN."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                      allow_nan=False).encode("utf-8")


async def _read_head(connection: _Connection, timeout: float | None,
                     method: str) -> tuple[StreamedReply, bool]:
    """The next reply's status and header fields on `connection` (informational 1xx replies
    skipped), its body unread, and whether the connection can carry another request."""
    buffer = connection.buffer
    while True:
        end = buffer.find(_HEAD_END)
        while end < 0:
            if connection.closed:
                raise httpx.RemoteProtocolError(
                    "the server closed the connection without sending a reply"
                    if not buffer else "the server closed the connection mid-reply")
            await connection.more(timeout)
            end = buffer.find(_HEAD_END)
        lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
        del buffer[:end + len(_HEAD_END)]
        version, status = _status_line(lines[0])
        if 100 <= status < 200:
            continue
        break
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon:
            raise httpx.RemoteProtocolError(f"malformed reply header {line[:80]!r}")
        fields[name.strip().lower()] = value.strip()
    tokens = {t.strip().lower() for t in fields.get("connection", "").split(",")}
    keep = "close" not in tokens and (version == "HTTP/1.1" or "keep-alive" in tokens)
    chunked = "chunked" in fields.pop("transfer-encoding", "").lower()  # the chunks are joined
    length: int | None = None
    if method == "HEAD" or status in _NO_BODY:
        length, chunked = 0, False
    elif not chunked and "content-length" in fields:
        text = fields["content-length"]
        if not text.isdigit():
            raise httpx.RemoteProtocolError(f"malformed Content-Length {text!r}")
        length = int(text)
    elif not chunked:  # the body runs to the end of the connection
        keep = False
    body = _Body(connection, timeout, length=length, chunked=chunked)
    return StreamedReply(status, fields, body), keep


def _status_line(line: str) -> tuple[str, int]:
    version, _, rest = line.partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise httpx.RemoteProtocolError(f"not an HTTP/1.1 reply: {line[:80]!r}")
    return version, int(code)
