"""The lean HTTP/1.1 client against real TCP servers on loopback that answer with exact bytes.

Contracts: a request is one well-formed write (path prefix, query, Host, compact JSON body);
a reply is read by Content-Length, by chunks, or to the end of the connection, whole or as it
arrives (vLLM's streamed completions); a connection is used again only after a whole reply
that keeps it alive; a server that closes, stalls, refuses or answers garbage is httpx's error
class for it, and the engine client's policy turns those into the same `EngineError`s as over
httpx. Real servers (uvicorn) are in
tests/engine/test_engine_http.py and bench/engine_client.py.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from collections.abc import Awaitable, Callable

import anyio
import httpx
import pytest

from core.engine_api import (
    EngineError,
    GenerateRequest,
    SamplingParams,
    VersionNotResidentError,
)
from orchestrator.engines.embedded import engine_client
from orchestrator.engines import http1
from orchestrator.engines.http1 import Http1Client

TIMEOUT = httpx.Timeout(5.0)


class Server:
    """A loopback TCP server: `reply(request_bytes, connection_index)` gives what to send back
    for each request (None: close the connection instead; `(bytes, "close")`: send, then
    close; an async function of the connection's reader and writer: it answers, and returns
    whether to keep the connection); counts connections and requests."""

    def __init__(self, reply: Callable[[bytes, int], Awaitable[bytes | None] | bytes | None]
                 ) -> None:
        self.reply, self.connections, self.requests = reply, 0, []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self.connections
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                answer = self.reply(request, index)
                if asyncio.iscoroutine(answer):
                    answer = await answer
                if answer is None:
                    break
                if callable(answer):
                    if not await answer(reader, writer):
                        break
                    continue
                closing = isinstance(answer, tuple)  # (bytes, "close"): send, then close
                writer.write(answer[0] if closing else answer)
                await writer.drain()
                if closing:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self._server.close()


def ok(body: bytes = b'{"ok":true}', extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (len(body), extra) + body)


def run(main):
    return anyio.run(main)


def test_a_request_is_one_well_formed_write_and_a_kept_alive_connection_is_used_again():
    server = Server(lambda request, i: ok())

    async def main():
        async with server as url:
            client = Http1Client(url + "/prefix/")
            first = await client.request("POST", "/a", json={"x": [1, 2], "s": "é"},
                                         timeout=TIMEOUT)
            second = await client.request("GET", "/b", params={"mode": "keep", "n": 2},
                                          timeout=TIMEOUT)
            await client.aclose()
            return url, first, second

    url, first, second = run(main)
    assert first.status_code == 200 and first.json() == {"ok": True} and second.json()
    assert server.connections == 1 and len(server.requests) == 2
    head, body = server.requests[0].split(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /prefix/a HTTP/1.1"
    assert b"Host: " + url.removeprefix("http://").encode() in lines
    assert b"Content-Type: application/json" in lines and b"Content-Length: %d" % len(body) \
        in lines
    assert body == '{"x":[1,2],"s":"é"}'.encode()
    assert server.requests[1].startswith(b"GET /prefix/b?mode=keep&n=2 HTTP/1.1\r\n")


def test_replies_are_read_by_chunks_to_the_end_of_the_connection_and_after_interim_replies():
    replies = iter([
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"4;ext=1\r\n{\"a\"\r\n5\r\n:[1]}\r\n0\r\nX-Trailer: t\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b'{"b":2}'),
        b"HTTP/1.1 204 No Content\r\n\r\n",
        (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nto the end", "close"),
    ])
    server = Server(lambda request, i: next(replies))

    async def main():
        async with server as url:
            client = Http1Client(url)
            got = [await client.request("GET", "/", timeout=TIMEOUT) for _ in range(4)]
            again = await client.request("GET", "/", timeout=TIMEOUT)  # a new connection
            await client.aclose()
            return got, again

    replies = iter([*replies, ok()])
    got, again = run(main)
    assert got[0].json() == {"a": [1]} and "transfer-encoding" not in got[0].headers
    assert got[1].json() == {"b": 2}
    assert got[2].status_code == 204 and got[2].content == b""
    assert got[3].text == "to the end"
    assert again.json() == {"ok": True}
    assert server.connections == 2  # the reply that ran to the end closed the first one


def test_a_connection_the_server_closes_is_not_used_again():
    server = Server(lambda request, i: ok(extra=b"Connection: close\r\n") if i == 0 else ok())

    async def main():
        async with server as url:
            client = Http1Client(url)
            await client.request("GET", "/", timeout=TIMEOUT)
            await client.request("GET", "/", timeout=TIMEOUT)
            await anyio.sleep(0.05)
            await client.aclose()

    run(main)
    assert server.connections == 2


def test_an_idle_connection_the_server_dropped_is_replaced_without_an_error():
    server = Server(lambda request, i: ok())

    async def main():
        async with server as url:
            client = Http1Client(url)
            await client.request("GET", "/", timeout=TIMEOUT)
            (idle,) = client._idle
            idle.transport.close()  # as if the server closed it while it sat idle
            await anyio.sleep(0.05)
            second = await client.request("GET", "/", timeout=TIMEOUT)
            await client.aclose()
            return second

    assert run(main).json() == {"ok": True}
    assert server.connections == 2


class CutShort(Server):
    """Sends its one answer, then closes the connection."""

    def __init__(self, answer: bytes) -> None:
        super().__init__(lambda request, i: answer)

    async def handle(self, reader, writer) -> None:
        self.requests.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(self.reply(b"", 0))
        await writer.drain()
        writer.close()


@pytest.mark.parametrize("server, message", [
    (Server(lambda request, i: None), "closed the connection without sending a reply"),
    (CutShort(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"),
     "closed the connection mid-reply"),
    (Server(lambda request, i: b"SMTP ready\r\n\r\n"), "not an HTTP/1.1 reply: 'SMTP ready'"),
    (Server(lambda request, i: b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"),
     "malformed Content-Length 'x'"),
    (CutShort(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
     "malformed chunk size b'zz'"),
    (CutShort(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nabc"),
     "malformed chunk size b'-5'"),
    (Server(lambda request, i: b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n"),
     "malformed Content-Length '-3'"),
], ids=["no reply", "cut short", "not http", "bad length", "bad chunk", "negative chunk",
        "negative length"])
def test_a_broken_reply_is_the_http_error_for_it_and_its_connection_is_dropped(server, message):
    async def main():
        async with server as url:
            client = Http1Client(url)
            try:
                with pytest.raises(httpx.RemoteProtocolError, match=message):
                    await client.request("GET", "/", timeout=TIMEOUT)
                assert client._idle == []
            finally:
                await client.aclose()

    run(main)


def test_a_server_that_stalls_is_a_read_timeout_and_its_connection_is_dropped():
    async def stall(request, i):
        if i == 0:
            await anyio.sleep(10)
        return ok()

    server = Server(stall)

    async def main():
        async with server as url:
            client = Http1Client(url)
            with pytest.raises(httpx.ReadTimeout, match="no reply within 0.2s"):
                await client.request("GET", "/", timeout=httpx.Timeout(5.0, read=0.2))
            assert client._idle == []
            after = await client.request("GET", "/", timeout=TIMEOUT)
            await client.aclose()
            return after

    assert run(main).json() == {"ok": True}
    assert server.connections == 2


def test_a_cancelled_request_closes_its_connection_so_no_late_reply_is_read_as_the_next():
    received, release = asyncio.Event(), asyncio.Event()

    async def late(request, i):
        if i == 0:  # holds the first request's reply until the client has given up on it
            received.set()
            await release.wait()
        return ok(b'{"late":%d}' % i)

    server = Server(late)

    async def main():
        async with server as url:
            client = Http1Client(url)
            scope = anyio.CancelScope()

            async def first() -> None:
                with scope:
                    await client.request("GET", "/", timeout=TIMEOUT)

            async with anyio.create_task_group() as tg:
                tg.start_soon(first)
                await received.wait()
                scope.cancel()
            release.set()  # the late reply goes to a connection the client closed
            after = await client.request("GET", "/", timeout=TIMEOUT)
            await client.aclose()
            return after

    assert run(main).json() == {"late": 1}
    assert server.connections == 2


def test_a_refused_connection_is_a_connect_error_the_engine_client_retries_then_names():
    async def main():
        async with Server(lambda request, i: ok()) as url:
            pass  # the port is free again: nothing listens there now
        client = Http1Client(url)
        with pytest.raises(httpx.ConnectError):
            await client.request("GET", "/", timeout=TIMEOUT)
        async with engine_client(url, retries=1, retry_backoff_s=0.0) as engine:
            assert engine.http._pools.lean is not None  # the lean client serves this URL
            with pytest.raises(EngineError, match=r"cannot reach the embedded engine at "
                                                  r".*/stalewise/generate after 2 attempts"):
                await engine.generate(GenerateRequest([1], SamplingParams()))

    run(main)


def test_a_generate_whose_connection_dies_unanswered_is_never_retried():
    server = Server(lambda request, i: None)

    async def main():
        async with server as url, engine_client(url, retries=2, retry_backoff_s=0.0) as engine:
            with pytest.raises(EngineError, match=r"connection to the embedded engine at .* "
                                                  r"failed mid-request \(RemoteProtocolError"):
                await engine.generate(GenerateRequest([1], SamplingParams()))
            assert len(server.requests) == 1
            with pytest.raises(EngineError, match="failed mid-request"):
                await engine.metrics()  # idempotent: retried twice first
            assert len(server.requests) == 1 + 3

    run(main)


def test_only_plain_http_urls_without_a_proxy_take_the_lean_client(monkeypatch):
    assert engine_client("http://127.0.0.1:1").http._pools.lean is not None
    assert engine_client("https://engine.example:443").http._pools.lean is None
    monkeypatch.setenv("http_proxy", "http://proxy.example:3128")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert engine_client("http://engine.example:8000").http._pools.lean is None
    with pytest.raises(ValueError, match="speaks plain http://, not https://"):
        Http1Client("https://engine.example")


def test_json_bodies_are_written_as_httpx_writes_them():
    server = Server(lambda request, i: ok())

    async def main():
        async with server as url:
            client = Http1Client(url)
            with pytest.raises(ValueError, match="Out of range float values"):
                await client.request("POST", "/", json={"x": float("nan")}, timeout=TIMEOUT)
            await client.aclose()

    run(main)
    assert server.requests == []  # nothing was sent


def test_the_generate_bodies_both_clients_send_are_json_with_one_content_type():
    """The engine clients hand the transport bodies pydantic already wrote (bytes): they go out
    as they are, typed as JSON once (over httpx: tests/orchestrator/engines/test_clients.py)."""
    from core.engine_api import GENERATE_ROUTE, GenerateResult, encode_generate_reply
    from core.records import SampledTokens

    result = GenerateResult(SampledTokens([7], [-0.5], [0], [0], [0.1]), "stop", 2, 0, "e")
    reply = json.dumps(encode_generate_reply(result, request_id="")).encode()

    def answer(request: bytes, i: int) -> bytes:
        if b"/v1/models" in request:
            return ok(b'{"data": [{"id": "tiny"}]}')
        if GENERATE_ROUTE.encode() in request:
            rid = json.loads(request.split(b"\r\n\r\n", 1)[1])["request_id"]
            return ok(reply.replace(b'"request_id": ""', b'"request_id": "%s"' % rid.encode()))
        return ok(STREAM_EVENTS, extra=b"Content-Type: text/event-stream\r\n")

    server = Server(answer)

    async def main():
        async with server as url:
            for kind in ("embedded", "vllm"):
                async with engine_client(url, kind=kind, retries=0) as engine:
                    request = GenerateRequest([3, 4], SamplingParams(max_tokens=3))
                    assert (await engine.generate(request)).tokens.token_ids.tolist() == [7]

    run(main)
    bodies = [r for r in server.requests if r.startswith(b"POST")]
    assert len(bodies) == 2
    for request in bodies:
        head, body = request.split(b"\r\n\r\n", 1)
        assert head.lower().count(b"content-type: application/json") == 1
        assert b"Content-Length: %d" % len(body) in head.split(b"\r\n")
        sent = json.loads(body)
        assert sent.get("prompt_token_ids", sent.get("prompt")) == [3, 4]


STREAM_EVENTS = (b'data: {"choices": [{"logprobs": {"tokens": ["token_id:7"], '
                 b'"token_logprobs": [-0.5]}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')


def test_error_replies_read_as_over_httpx():
    """Status, message and class of an error reply are the ones the transport gives over
    httpx: the server's own message, or the status's phrase for an empty reply."""
    replies = iter([
        b"HTTP/1.1 409 Conflict\r\nContent-Type: application/json\r\nContent-Length: 48\r\n\r\n"
        b'{"error": {"message": "weights version 1 left"}}',
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain; charset=latin-1\r\n"
        b"Content-Length: 5\r\n\r\nboum\xe9",
    ])
    server = Server(lambda request, i: next(replies))

    async def main():
        async with server as url, engine_client(url, retries=0) as engine:
            request = GenerateRequest([1], SamplingParams(), weights_version=1)
            with pytest.raises(VersionNotResidentError, match="weights version 1 left"):
                await engine.generate(request)
            for reason in ("answered 503: Service Unavailable", "answered 500: boum\u00e9"):
                with pytest.raises(EngineError, match=reason):
                    await engine.generate(request)

    run(main)


def test_on_trio_the_engine_client_goes_through_httpx():
    """The lean client is asyncio's; under trio the same calls take httpx, with the same
    replies."""
    server_replies: list[bytes] = []

    async def main(url: str):
        async with engine_client(url, retries=0) as engine:
            return await engine.metrics()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802 - the stdlib's name
            body = b'{"tokens/generated_total": 2.0}'
            server_replies.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert anyio.run(main, url, backend="trio") == {"tokens/generated_total": 2.0}
        assert anyio.run(main, url) == {"tokens/generated_total": 2.0}
    finally:
        server.shutdown()
    assert len(server_replies) == 2


# ---- streamed replies (vLLM's server-sent events) ----------------------------------------------

def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")


def test_a_streamed_reply_is_read_as_it_arrives_and_its_connection_used_again():
    """Events come out as their bytes arrive (the second part is only sent once the client has
    read the first event), whatever the chunks' bounds and line ends, those that arrived
    together in one list; a stream read to its end leaves its connection kept alive."""
    first_read = asyncio.Event()

    async def events(reader, writer) -> bool:
        writer.write(STREAM_HEAD + chunk(b'data: {"i": 0}\r\n\r\n: a comment\n\ndata: {"i"'))
        await writer.drain()
        await first_read.wait()
        writer.write(chunk(b': 1}\n\ndata:{"i": 2}\n\n') + chunk(b"data: [DONE]\n\n")
                     + b"0\r\n\r\n")
        await writer.drain()
        return True

    server = Server(lambda request, i: events if b"/v1/completions" in request else ok())

    async def main():
        async with server as url:
            client = Http1Client(url)
            batches = []
            async with client.stream("POST", "/v1/completions", json={"stream": True},
                                     timeout=TIMEOUT) as reply:
                assert reply.status_code == 200
                assert reply.headers["content-type"] == "text/event-stream"
                async for batch in reply.aiter_data():
                    batches.append(batch)
                    first_read.set()
            after = await client.request("GET", "/health", timeout=TIMEOUT)
            await client.aclose()
            return batches, after

    batches, after = run(main)
    assert sum(batches, []) == [b'{"i": 0}', b'{"i": 1}', b'{"i": 2}', b"[DONE]"]
    assert batches[0] == [b'{"i": 0}']  # alone: the rest was sent after it was read
    assert after.json() == {"ok": True}
    assert server.connections == 1


@pytest.mark.parametrize("framing", ["length", "to the end"])
def test_a_streamed_reply_without_chunks_is_read_by_its_length_or_to_the_end(framing):
    lines = b"data: 1\r\n\r\ndata: 2\n\ndata: last"
    length = b"Content-Length: %d\r\n" % len(lines) if framing == "length" else b""

    async def send(reader, writer) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n%s\r\n" % length + lines[:9])
        await writer.drain()
        await anyio.sleep(0.05)
        writer.write(lines[9:])
        await writer.drain()
        return framing == "length"

    server = Server(lambda request, i: send)

    async def main():
        async with server as url:
            client = Http1Client(url)
            async with client.stream("GET", "/", timeout=TIMEOUT) as reply:
                got = [data async for batch in reply.aiter_data() for data in batch]
            kept = len(client._idle)
            await client.aclose()
            return got, kept

    got, kept = run(main)
    assert got == [b"1", b"2", b"last"]
    assert kept == (1 if framing == "length" else 0)


def test_a_stream_left_before_its_end_keeps_its_connection_only_if_the_end_comes_soon(
        monkeypatch):
    """vLLM sends `[DONE]`, then ends the body: the client stops reading at `[DONE]`, and the
    connection carries the next request once the end has come. A server that leaves the body
    open past `FINISH_S` has its connection closed instead."""
    monkeypatch.setattr(http1, "FINISH_S", 0.2)
    ended = asyncio.Event()

    def events(then_end: bool):
        async def send(reader, writer) -> bool:
            writer.write(STREAM_HEAD + chunk(b"data: [DONE]\n\n"))
            await writer.drain()
            if not then_end:  # holds the body open until the client gives the connection up
                assert await reader.read() == b""
                ended.set()
                return False
            await anyio.sleep(0.05)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        return send

    plan = iter([events(then_end=True), ok(), events(then_end=False), ok()])
    server = Server(lambda request, i: next(plan))

    async def main():
        async with server as url:
            client = Http1Client(url)
            seen = []
            for _ in range(2):
                async with client.stream("POST", "/", timeout=TIMEOUT) as reply:
                    async for batch in reply.aiter_data():
                        if batch == [b"[DONE]"]:
                            break
                seen.append(server.connections)
                await client.request("GET", "/", timeout=TIMEOUT)
                seen.append(server.connections)
            with anyio.fail_after(10):
                await ended.wait()
            await client.aclose()
            return seen

    assert run(main) == [1, 1, 1, 2]


@pytest.mark.parametrize("read_whole", [True, False])
def test_a_stream_whose_block_raises_keeps_its_connection_only_if_the_reply_was_read_whole(
        read_whole):
    """An error reply to a stream, read whole and then raised as the engine's error (as the
    engine client does with a 400 or 503), leaves its connection for the next request; a block
    that raises before the body's end closes it, since the rest would be read as the next
    reply."""
    body = b'{"error": {"message": "prompt too long"}}'
    replies = iter([b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body) + body, ok()])
    server = Server(lambda request, i: next(replies))

    async def main():
        async with server as url:
            client = Http1Client(url)
            with pytest.raises(EngineError, match="answered 400"):
                async with client.stream("POST", "/v1/completions", json={"stream": True},
                                         timeout=TIMEOUT) as reply:
                    if read_whole:
                        assert await reply.aread() == body
                    raise EngineError(f"answered {reply.status_code}")
            after = await client.request("GET", "/health", timeout=TIMEOUT)
            await client.aclose()
            return after

    assert run(main).json() == {"ok": True}
    assert server.connections == (1 if read_whole else 2)


def test_cancelling_a_stream_closes_its_connection_which_is_how_vllm_aborts():
    closed = asyncio.Event()

    async def endless(reader, writer) -> bool:
        writer.write(STREAM_HEAD + chunk(b"data: {}\n\n"))
        await writer.drain()
        assert await reader.read() == b""  # the client closed its side
        closed.set()
        return False

    server = Server(lambda request, i: endless)

    async def main():
        async with server as url:
            client = Http1Client(url)
            with anyio.CancelScope() as scope:
                async with client.stream("POST", "/", timeout=TIMEOUT) as reply:
                    async for _ in reply.aiter_data():
                        scope.cancel()
            with anyio.fail_after(10):
                await closed.wait()
            assert client._idle == []

    run(main)


def test_the_vllm_client_streams_a_completion_through_the_lean_client():
    """A real `/v1/completions` stream over loopback: tokens, log-probs, top-k, usage and the
    finish reason as vLLM sends them, one kept-alive connection for the model card and two
    calls; a 400 is the server's own message; a stream cut short is a broken stream, not
    retried; a field that is not one JSON object is a malformed chunk."""
    sse = [
        {"choices": [{"index": 0, "text": "a", "logprobs": {
            "tokens": ["token_id:7"], "token_logprobs": [-0.25],
            "top_logprobs": [{"token_id:7": -0.25, "token_id:3": -9999.0}]},
            "finish_reason": None}], "usage": None},
        {"choices": [{"index": 0, "text": "b", "logprobs": {
            "tokens": ["token_id:8"], "token_logprobs": [-1.5],
            "top_logprobs": [{"token_id:8": -1.5}]}, "finish_reason": "length"}],
         "usage": None},
        {"choices": [], "usage": {"prompt_tokens": 2, "prompt_tokens_details": {
            "cached_tokens": 1}}}]
    body = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in sse)

    async def stream(reader, writer) -> bool:
        writer.write(STREAM_HEAD)
        for part in (body[:70], body[70:], b"data: [DONE]\n\n"):
            writer.write(chunk(part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        return True

    async def cut_short(reader, writer) -> bool:
        writer.write(STREAM_HEAD + chunk(body[:70]))
        await writer.drain()
        return False

    def malformed(data: bytes):
        async def send(reader, writer) -> bool:
            writer.write(STREAM_HEAD + chunk(data + b"\n\ndata: {}\n\n") + b"0\r\n\r\n")
            return True
        return send

    def reply(request: bytes, i: int):
        if b"/v1/models" in request:
            return ok(b'{"data": [{"id": "tiny", "max_model_len": 64}]}')
        prompt = json.loads(request.split(b"\r\n\r\n", 1)[1])["prompt"]
        if prompt == [400]:
            message = b'{"error": {"message": "prompt too long"}}'
            return (b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(message), message))
        if prompt == [1]:  # two values in one field, sent together with a good one
            return malformed(b'data: {"choices": []}, {"choices": []}')
        if prompt == [2]:
            return malformed(b"data: 7")
        return cut_short if prompt == [0] else stream

    server = Server(reply)

    async def main():
        async with server as url, engine_client(url, kind="vllm", retries=2,
                                                initial_version=6) as engine:
            assert engine.http._pools.lean is not None
            request = GenerateRequest([1, 2], SamplingParams(max_tokens=2, logprobs_topk=2))
            results = [await engine.generate(request) for _ in range(2)]
            assert server.connections == 1
            with pytest.raises(EngineError, match="answered 400: prompt too long"):
                await engine.generate(GenerateRequest([400], SamplingParams()))
            before = len(server.requests)
            with pytest.raises(EngineError, match=r"stream from the vllm engine at .* broke "
                                                  r"\(RemoteProtocolError"):
                await engine.generate(GenerateRequest([0], SamplingParams()))
            assert len(server.requests) == before + 1  # not retried
            for prompt, what in (([1], "2 data fields held 3 JSON values"),
                                 ([2], "AttributeError")):
                with pytest.raises(EngineError, match=rf"sent a malformed stream chunk "
                                                      rf"\(.*{what}"):
                    await engine.generate(GenerateRequest(prompt, SamplingParams()))
            return results

    for result in run(main):
        tokens = result.tokens
        assert tokens.token_ids.tolist() == [7, 8] and result.finish_reason == "length"
        assert (result.prompt_tokens, result.cached_prompt_tokens) == (2, 1)
        assert tokens.sampler_logprobs.tolist() == [-0.25, -1.5]
        assert tokens.weights_versions.tolist() == [6, 6]
        assert tokens.topk_ids.tolist() == [[7, 3], [8, -1]]
