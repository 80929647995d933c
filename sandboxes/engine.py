"""Connecting to the Docker engine, with one clear error when it is not reachable.

Guarantees: `connect()` either returns a client whose engine answered a ping or raises
`SandboxError` naming the engine address and the command that starts an engine. The docker SDK
is imported lazily so `import sandboxes` stays light for the CLI.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from core.sandbox import SandboxError

if TYPE_CHECKING:
    import docker

DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
START_HINT = "start one with `scripts/ensure_docker.sh` (installs docker.io and starts dockerd)"


def docker_host() -> str:
    """The engine address the SDK will use: $DOCKER_HOST or the default unix socket."""
    return os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST


def docker_errors() -> Any:
    """`docker.errors`, imported when first needed (the package is heavy to import)."""
    import docker.errors

    return docker.errors


def connect(*, url: str | None = None, timeout_s: float = 60.0,
            max_pool_size: int = 128) -> "docker.DockerClient":
    """A docker client for the engine at `url` (default `docker_host()`), pinged once;
    `SandboxError` if down. For an ssh:// engine use `sandboxes.hosts` (a local forward)."""
    import docker
    import docker.errors

    url = url or docker_host()
    try:
        client = docker.DockerClient(base_url=url, timeout=int(timeout_s),
                                     max_pool_size=max_pool_size)
        client.ping()
    except (docker.errors.DockerException, OSError) as exc:
        raise SandboxError(
            f"Docker engine not reachable at {url}: {exc}. {START_HINT}, "
            "or use the local process backend (`[sandbox] backend = \"local\"` in a job, "
            "`--backend local` on the command line; not isolation)."
        ) from exc
    return client
