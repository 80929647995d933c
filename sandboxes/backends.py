"""Choosing a backend and building pools: the entry points the orchestrator uses.

`make_sandbox(spec, backend=...)` returns an unstarted sandbox; `open_pool(spec, ...)` returns a
`SandboxPool` whose `on_start` removes this installation's orphaned containers. Given a
`HostSet` (`hosts=`), Docker sandboxes are spread over its engines and orphans are removed on
each of them. Backend "auto"
uses Docker when the engine answers and otherwise falls back to the local process backend,
logging a loud warning that the fallback is not isolation.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

from core.sandbox import Sandbox, SandboxError, SandboxSpec
from sandboxes.hosts import HostSet
from sandboxes.pool import SandboxPool

if TYPE_CHECKING:
    import docker

Backend = Literal["docker", "local", "auto"]
log = logging.getLogger("stalewise.sandboxes")


def resolve_backend(backend: Backend) -> tuple[Literal["docker", "local"],
                                               "docker.DockerClient | None"]:
    """The concrete backend and, for Docker, a connected client."""
    from sandboxes.engine import connect

    if backend == "local":
        return "local", None
    try:
        return "docker", connect()
    except SandboxError as exc:
        if backend == "docker":
            raise
        log.warning("no Docker engine (%s); FALLING BACK TO THE LOCAL PROCESS BACKEND, WHICH IS "
                    "NOT ISOLATION", exc)
        return "local", None


def make_sandbox(spec: SandboxSpec | None = None, *, backend: Backend = "docker",
                 run_id: str = "adhoc", trajectory_id: str | None = None,
                 client: "docker.DockerClient | None" = None,
                 runtime: str | None = None, hosts: HostSet | None = None) -> Sandbox:
    """An unstarted sandbox; use it with `async with` (or `start()` / `close()`)."""
    spec = spec or SandboxSpec()
    if hosts is not None and backend != "local":
        from sandboxes.docker_backend import DockerSandbox

        return DockerSandbox(spec, run_id=run_id, trajectory_id=trajectory_id, runtime=runtime,
                             hosts=hosts)
    kind = "docker" if client is not None and backend != "local" else None
    if kind is None:
        kind, client = resolve_backend(backend)
    if kind == "local":
        from sandboxes.local_backend import LocalSandbox

        return LocalSandbox(spec)
    from sandboxes.docker_backend import DockerSandbox

    return DockerSandbox(spec, client=client, run_id=run_id, trajectory_id=trajectory_id,
                         runtime=runtime)


def open_pool(spec: SandboxSpec | None = None, *, backend: Backend = "docker",
              run_id: str = "adhoc", size: int = 4, max_live: int = 16,
              reuse: bool = False,
              runtime: str | None = None, start_concurrency: int = 4,
              hosts: HostSet | None = None) -> SandboxPool:
    """A pool for `spec`; enter it with `async with`. Orphans are removed when it opens."""
    spec = spec or SandboxSpec()
    if hosts is not None and backend != "local":
        def on_hosts() -> Sandbox:
            return make_sandbox(spec, run_id=run_id, runtime=runtime, hosts=hosts)

        pool = SandboxPool(on_hosts, size=size, max_live=max_live, reuse=reuse,
                           on_start=hosts.remove_orphans, start_concurrency=start_concurrency,
                           on_warm=hosts.wake)
        hosts.add_idle_source(pool.evict_idle)  # its warm sandboxes yield to waiting ones
        return pool
    kind, client = resolve_backend(backend)

    def factory() -> Sandbox:
        return make_sandbox(spec, backend=kind, run_id=run_id, client=client, runtime=runtime)

    on_start = None
    if kind == "docker":
        from sandboxes.cleanup import remove_orphans_async

        async def remove_orphans() -> None:
            for removal in await remove_orphans_async(client):
                log.warning("removed orphan sandbox %s: %s", removal.name, removal.reason)

        on_start = remove_orphans

    return SandboxPool(factory, size=size, max_live=max_live, reuse=reuse, on_start=on_start,
                       start_concurrency=start_concurrency)
