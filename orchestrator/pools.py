"""Warm sandbox pools, one per (image, limits), opened on first use and closed with the job.

Pools are async context managers that own background tasks, so they must be entered and left
by the same task: `PoolSet.run` is that task (started in the job's task group); trajectories
ask it for the pool of their task's spec and then acquire a container from it. Each trajectory
gets its own fresh container (or a reset one with `reuse`). With `[sandbox] hosts`, every pool
places its containers through one shared `HostSet`, so a host's capacity counts all specs.
"""

from __future__ import annotations

from contextlib import AsyncExitStack, asynccontextmanager
from typing import AsyncIterator

import anyio
from anyio.abc import TaskStatus

from config.job import SandboxConfig
from core.sandbox import Sandbox, SandboxSpec
from sandboxes.backends import open_pool
from sandboxes.hosts import HostSet
from sandboxes.pool import SandboxPool


def _key(spec: SandboxSpec) -> str:
    return spec.model_copy(update={"files": {}}).model_dump_json()


class PoolSet:
    def __init__(self, cfg: SandboxConfig, run_id: str) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.hosts = HostSet(cfg.hosts) if cfg.hosts and cfg.backend == "docker" else None
        self._pools: dict[str, SandboxPool] = {}
        self._opening: dict[str, anyio.Event] = {}
        self._send, self._receive = anyio.create_memory_object_stream[tuple[str, SandboxSpec]](64)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with AsyncExitStack() as stack, self._receive:
            if self.hosts is not None:
                stack.callback(self.hosts.close)  # after every pool has closed
            task_status.started()
            async for key, spec in self._receive:
                pool = open_pool(spec.model_copy(update={"files": {}}), backend=self.cfg.backend,
                                 run_id=self.run_id, size=self.cfg.pool_size,
                                 max_live=self.cfg.max_live, reuse=self.cfg.reuse,
                                 hosts=self.hosts)
                self._pools[key] = await stack.enter_async_context(pool)
                self._opening.pop(key).set()

    async def pool_for(self, spec: SandboxSpec) -> SandboxPool:
        key = _key(spec)
        while key not in self._pools:
            opening = self._opening.get(key)
            if opening is None:
                opening = self._opening[key] = anyio.Event()
                await self._send.send((key, spec))
            await opening.wait()
        return self._pools[key]

    @asynccontextmanager
    async def acquire(self, spec: SandboxSpec, trajectory_id: int) -> AsyncIterator[Sandbox]:
        pool = await self.pool_for(spec)
        async with pool.acquire(trajectory_id=str(trajectory_id)) as sandbox:  # a Docker label
            yield sandbox
