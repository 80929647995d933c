"""A raw, async `docker attach` connection: the agent's stdin and stdout over one socket.

The docker SDK's attach returns a blocking socket; for thousands of small exec round trips we
speak the engine's HTTP upgrade ourselves over an anyio stream (unix socket or plain TCP), so a
round trip costs no thread hop. Output is the engine's multiplexed stream (8-byte headers:
stream type, 3 zero bytes, big-endian length); stdout payloads are returned, stderr payloads
(the agent's own diagnostics) are kept, last 64 KiB, for error messages.
"""

from __future__ import annotations

import struct
from urllib.parse import urlparse

import anyio
import anyio.abc

from core.sandbox import HostUnreachable, SandboxError

MUX_HEADER = struct.Struct(">BxxxI")
STDERR_KEEP = 65536


class AttachTransport:
    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self._stream = stream
        self._buffer = bytearray()
        self.stderr_tail = bytearray()

    async def send(self, data: bytes) -> None:
        await self._stream.send(data)

    async def receive(self) -> bytes:
        while True:
            if len(self._buffer) >= MUX_HEADER.size:
                kind, size = MUX_HEADER.unpack_from(self._buffer)
                if len(self._buffer) >= MUX_HEADER.size + size:
                    payload = bytes(self._buffer[MUX_HEADER.size:MUX_HEADER.size + size])
                    del self._buffer[:MUX_HEADER.size + size]
                    if kind == 1:
                        return payload
                    self.stderr_tail += payload
                    del self.stderr_tail[:-STDERR_KEEP]
                    continue
            self._buffer += await self._stream.receive(1 << 20)

    async def aclose(self) -> None:
        await self._stream.aclose()


async def _connect(docker_host: str) -> anyio.abc.ByteStream:
    url = urlparse(docker_host)
    try:
        if url.scheme == "unix":
            return await anyio.connect_unix(url.path)
        if url.scheme in ("tcp", "http"):
            return await anyio.connect_tcp(url.hostname or "localhost", url.port or 2375)
    except OSError as exc:
        raise HostUnreachable(f"Docker engine at {docker_host} refused the attach: {exc}") from None
    raise SandboxError(f"DOCKER_HOST={docker_host}: the attach transport supports unix:// and "
                       "plain tcp:// engines (ssh:// hosts in [sandbox] hosts are forwarded to "
                       "a local unix socket)")


async def open_attach(docker_host: str, api_version: str, container_id: str) -> AttachTransport:
    """Attach to stdin+stdout+stderr of `container_id` (works before the container starts)."""
    stream = await _connect(docker_host)
    request = (
        f"POST /v{api_version}/containers/{container_id}/attach"
        "?stream=1&stdin=1&stdout=1&stderr=1 HTTP/1.1\r\n"
        "Host: docker\r\nContent-Type: text/plain\r\n"
        "Connection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
    ).encode()
    head = bytearray()
    try:
        await stream.send(request)
        while b"\r\n\r\n" not in head:
            head += await stream.receive(65536)
            if len(head) > 65536:
                break
    except anyio.EndOfStream:
        await stream.aclose()
        raise SandboxError(f"engine closed the attach to {container_id[:12]}") from None
    except (anyio.BrokenResourceError, OSError) as exc:
        # the engine went away mid-handshake (reset, killed): an unreachable host, which the
        # backend and its pool handle as such, never an error that stops the job
        await stream.aclose()
        raise HostUnreachable(f"Docker engine at {docker_host} dropped the attach to "
                              f"{container_id[:12]}: {exc.__cause__ or exc!r}") from None
    status_line, _, rest = bytes(head).partition(b"\r\n")
    parts = status_line.split()
    if len(parts) < 2 or parts[1] not in (b"101", b"200"):
        await stream.aclose()
        raise SandboxError(f"attach to {container_id[:12]} failed: {bytes(head)[:500]!r}")
    transport = AttachTransport(stream)
    transport._buffer += rest.partition(b"\r\n\r\n")[2]
    return transport
