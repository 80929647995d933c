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

from sandboxes.api import HostUnreachable, SandboxError

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


class _DialStdio(anyio.abc.ByteStream):
    """The engine's socket through `ssh HOST docker system dial-stdio` (as the docker CLI does)."""

    def __init__(self, process: anyio.abc.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self._process = process
        self._stdin = process.stdin
        self._stdout = process.stdout

    async def send(self, item: bytes) -> None:
        await self._stdin.send(item)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self._stdout.receive(max_bytes)

    async def send_eof(self) -> None:
        await self._stdin.aclose()

    async def aclose(self) -> None:
        if self._process.returncode is None:
            self._process.kill()
        await self._process.aclose()


def ssh_dial_argv(docker_host: str) -> list[str]:
    url = urlparse(docker_host)
    target = f"{url.username}@{url.hostname}" if url.username else str(url.hostname)
    port = ["-p", str(url.port)] if url.port else []
    return ["ssh", "-o", "BatchMode=yes", *port, "--", target, "docker", "system", "dial-stdio"]


async def _connect(docker_host: str) -> anyio.abc.ByteStream:
    url = urlparse(docker_host)
    try:
        if url.scheme == "unix":
            return await anyio.connect_unix(url.path)
        if url.scheme in ("tcp", "http"):
            return await anyio.connect_tcp(url.hostname or "localhost", url.port or 2375)
        if url.scheme == "ssh":
            import subprocess

            return _DialStdio(await anyio.open_process(ssh_dial_argv(docker_host),
                                                       stderr=subprocess.DEVNULL))
    except OSError as exc:
        raise HostUnreachable(f"Docker engine at {docker_host} refused the attach: {exc}") from None
    raise SandboxError(f"Docker host {docker_host}: the attach transport supports unix://, "
                       "plain tcp:// and ssh:// engines")


async def open_attach(docker_host: str, api_version: str, container_id: str) -> AttachTransport:
    """Attach to stdin+stdout+stderr of `container_id` (works before the container starts)."""
    stream = await _connect(docker_host)
    request = (
        f"POST /v{api_version}/containers/{container_id}/attach"
        "?stream=1&stdin=1&stdout=1&stderr=1 HTTP/1.1\r\n"
        "Host: docker\r\nContent-Type: text/plain\r\n"
        "Connection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
    ).encode()
    await stream.send(request)
    head = bytearray()
    while b"\r\n\r\n" not in head:
        try:
            head += await stream.receive(65536)
        except anyio.EndOfStream:
            await stream.aclose()
            raise SandboxError(f"engine closed the attach to {container_id[:12]}") from None
        if len(head) > 65536:
            break
    status_line, _, rest = bytes(head).partition(b"\r\n")
    parts = status_line.split()
    if len(parts) < 2 or parts[1] not in (b"101", b"200"):
        await stream.aclose()
        raise SandboxError(f"attach to {container_id[:12]} failed: {bytes(head)[:500]!r}")
    transport = AttachTransport(stream)
    transport._buffer += rest.partition(b"\r\n\r\n")[2]
    return transport
