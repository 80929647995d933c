"""A listening TCP socket for a server we start (`stalewise view`, `stalewise engine serve`),
bound before anything says where it listens, and an error that names the cause and the fix
when it cannot be bound (a port in use, an address this machine does not have, a privileged
port)."""

from __future__ import annotations

import errno
import socket


class ListenError(Exception):
    """The socket could not be bound; the message says why and what to pass instead."""


def listen(host: str, port: int, *, backlog: int = 128) -> socket.socket:
    """A socket listening on `host`:`port` (0 = a free port: read it from `getsockname()`)."""
    if not 0 <= port <= 65535:
        raise ListenError(f"port {port} is not a TCP port (0-65535); pass --port with one, "
                          "or --port 0 for a free one")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host!r}: {exc.strerror}; pass --host with an "
                          "address of this machine (127.0.0.1 keeps it local)") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise ListenError(_reason(host, port, exc)) from None
    return sock


def _reason(host: str, port: int, exc: OSError) -> str:
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return (f"{where} is already in use (another server, or an earlier one still "
                "running); pass another --port, or --port 0 for a free one")
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"cannot listen on {where}: this machine has no address {host}; pass --host "
                "with one of its addresses (127.0.0.1 keeps it local)")
    if exc.errno == errno.EACCES:
        return (f"cannot listen on {where}: ports below 1024 need root; pass --port above "
                "1023, or --port 0 for a free one")
    return f"cannot listen on {where}: {exc.strerror or exc}"
