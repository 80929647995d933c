"""A warm pool of started sandboxes for one spec (image + limits).

Use:
    async with SandboxPool(factory, size=8, max_live=64) as pool:
        async with pool.acquire(trajectory_id="t-17") as sandbox:
            await sandbox.exec("pytest -q")

Guarantees:
- at most `max_live` sandboxes exist at once (warm, starting, in use and closing together);
- the pool keeps up to `size` started sandboxes ready ("start-ahead"), starting at most
  `start_concurrency` at a time, so `acquire` normally returns without waiting for an engine;
- a warm sandbox that reports `usable = False` (its agent or its Docker host is gone) is closed
  instead of handed out;
- each `acquire` hands out a sandbox nobody used before, and closes it on exit, unless
  `reuse=True`, in which case it is reset (processes killed, work dir and /tmp emptied, spec files
  restored) and returned to the pool, or closed if the reset fails;
- creating a sandbox is retried (`create_attempts`, exponential backoff); `acquire` raises
  `SandboxError` with the last error when it had to start one itself and every attempt failed;
  exec is never retried by the pool (retrying is the tool layer's decision, for idempotent tools);
- `on_start` (for example orphan cleanup) runs once before the first sandbox is created;
- warm sandboxes are a cache: `evict_idle` closes one (for a capacity shared with other
  pools, `sandboxes.hosts`, where a trajectory waiting for room comes before a warm sandbox
  nobody has asked for), and `on_warm` is called whenever one becomes warm. A sandbox started
  ahead has `started_ahead` set (when it has that attribute) before `start()`;
- leaving the `async with` closes every sandbox the pool still holds; every background job
  (start-ahead, closing, container renames) runs in the pool's own task group.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
import anyio.abc

from core.sandbox import Sandbox, SandboxError

log = logging.getLogger("stalewise.sandboxes")


SandboxFactory = Callable[[], Sandbox]


class SandboxPool:
    def __init__(self, factory: SandboxFactory, *, size: int = 4, max_live: int = 16,
                 start_concurrency: int = 4, create_attempts: int = 3,
                 retry_backoff_s: float = 0.5, reuse: bool = False,
                 on_start: Callable[[], Awaitable[Any]] | None = None,
                 on_warm: Callable[[], None] | None = None) -> None:
        if size < 0 or max_live < 1 or size > max_live:
            raise ValueError(f"pool needs 0 <= size <= max_live and max_live >= 1; got "
                             f"size={size}, max_live={max_live}")
        if create_attempts < 1 or start_concurrency < 1:
            raise ValueError("create_attempts and start_concurrency must be at least 1")
        self.factory = factory
        self.size = size
        self.max_live = max_live
        self.create_attempts = create_attempts
        self.retry_backoff_s = retry_backoff_s
        self.reuse = reuse
        self.on_start = on_start
        self.on_warm = on_warm
        self._start_limiter = anyio.Semaphore(start_concurrency)
        self._warm: deque[Sandbox] = deque()
        self._live = 0  # warm + starting + in use + closing
        self._starting = 0
        self._changed = anyio.Event()
        self._last_error: BaseException | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._closing = False
        # cold: started on the acquire path, not ahead; dropped: warm but no longer usable;
        # evicted: warm, closed to give its room to a sandbox someone waits for
        self.stats = {"started": 0, "start_failures": 0, "acquired": 0, "waited": 0,
                      "cold_starts": 0, "dropped_unusable": 0, "evicted": 0}

    # ---- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> "SandboxPool":
        if self.on_start is not None:
            await self.on_start()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        await self._tg.start(self._fill_loop)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        assert self._tg is not None
        self._closing = True
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(*exc_info)
        finally:
            with anyio.CancelScope(shield=True):
                while self._warm:
                    await self._close(self._warm.popleft())

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _fill_loop(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        task_status.started()
        assert self._tg is not None
        while True:
            while (len(self._warm) + self._starting < self.size and self._live < self.max_live
                   and self._last_error is None):
                self._live += 1
                self._starting += 1
                self._tg.start_soon(self._start_ahead)
            changed = self._changed
            if self._last_error is not None:
                with anyio.move_on_after(self.retry_backoff_s * 4):
                    await changed.wait()
                self._last_error = None
                continue
            await changed.wait()

    async def _start_ahead(self) -> None:
        try:
            sandbox = await self._create(ahead=True)
        except SandboxError as exc:
            self._live -= 1
            self._last_error = exc
            log.warning("sandbox pool: start-ahead failed: %s", exc)
        else:
            self._add_warm(sandbox)
        finally:
            self._starting -= 1
            self._notify()

    def _add_warm(self, sandbox: Sandbox) -> None:
        self._warm.append(sandbox)
        self._notify()
        if self.on_warm is not None:
            self.on_warm()

    def evict_idle(self, where: Callable[[Sandbox], bool] = lambda sandbox: True) -> bool:
        """Close the oldest warm sandbox that `where` accepts; False when there is none."""
        if self._tg is None or self._closing:
            return False
        for sandbox in self._warm:
            if where(sandbox):
                self._warm.remove(sandbox)
                self.stats["evicted"] += 1
                self._tg.start_soon(self._close, sandbox)
                return True
        return False

    async def _create(self, *, ahead: bool = False) -> Sandbox:
        """Start one sandbox, retrying; the caller has already reserved a live slot."""
        delay = self.retry_backoff_s
        for attempt in range(1, self.create_attempts + 1):
            sandbox = self.factory()
            if ahead and hasattr(sandbox, "started_ahead"):
                sandbox.started_ahead = True  # type: ignore[attr-defined]
            try:
                async with self._start_limiter:
                    await sandbox.start()
                self.stats["started"] += 1
                return sandbox
            except SandboxError as exc:
                self.stats["start_failures"] += 1
                if attempt == self.create_attempts:
                    raise SandboxError(f"could not start a sandbox after {attempt} attempts: "
                                       f"{exc}") from exc
                log.warning("sandbox start failed (attempt %d/%d), retrying in %.1f s: %s",
                            attempt, self.create_attempts, delay, exc)
                await anyio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    async def _close(self, sandbox: Sandbox) -> None:
        try:
            with anyio.CancelScope(shield=True):
                await sandbox.close()
        except SandboxError as exc:
            log.warning("sandbox pool: close failed: %s", exc)
        finally:
            self._live -= 1
            self._notify()

    # ---- acquire / release -------------------------------------------------------------------
    async def _take(self) -> Sandbox:
        if self._tg is None or self._closing:
            raise SandboxError("pool is not open: use `async with SandboxPool(...) as pool`")
        waited = False
        while True:
            if self._warm:
                sandbox = self._warm.popleft()
                self._notify()  # the fill loop starts a replacement
                if not getattr(sandbox, "usable", True):
                    self.stats["dropped_unusable"] += 1
                    self._tg.start_soon(self._close, sandbox)
                    continue
                break
            if self._live < self.max_live:
                self._live += 1
                self.stats["cold_starts"] += 1
                try:
                    sandbox = await self._create()
                except BaseException:
                    self._live -= 1
                    self._notify()
                    raise
                break
            waited = True
            await self._changed.wait()
        self.stats["acquired"] += 1
        self.stats["waited"] += int(waited)
        return sandbox

    @asynccontextmanager
    async def acquire(self, trajectory_id: str | None = None) -> AsyncIterator[Sandbox]:
        """A started sandbox for one trajectory; released (closed, or reset) on exit."""
        sandbox = await self._take()
        assign = getattr(sandbox, "assign", None)
        if trajectory_id is not None and assign is not None and self._tg is not None:
            self._tg.start_soon(assign, trajectory_id)
        try:
            yield sandbox
        finally:
            await self._release(sandbox)

    async def _release(self, sandbox: Sandbox) -> None:
        with anyio.CancelScope(shield=True):
            if self.reuse and not self._closing and hasattr(sandbox, "reset"):
                try:
                    await sandbox.reset()  # type: ignore[attr-defined]
                except SandboxError as exc:
                    log.warning("sandbox pool: reset failed, closing instead: %s", exc)
                else:
                    self._add_warm(sandbox)
                    return
            if self._tg is not None and not self._closing:
                self._tg.start_soon(self._close, sandbox)
            else:
                await self._close(sandbox)

    @property
    def live(self) -> int:
        return self._live

    @property
    def warm(self) -> int:
        return len(self._warm)

    async def wait_warm(self, count: int | None = None, timeout_s: float = 120.0) -> None:
        """Wait until `count` (default: `size`) sandboxes are started and waiting."""
        target = self.size if count is None else count
        with anyio.fail_after(timeout_s):
            while len(self._warm) < target:
                if self._last_error is not None:
                    raise SandboxError(f"pool cannot start sandboxes: {self._last_error}")
                await self._changed.wait()
