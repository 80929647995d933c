"""Engine views that keep a trajectory on one weights version (`async` pipelines).

`PinnedEngine(engine, v)` is an `InferenceEngine` whose every request carries
`weights_version=v`; `PinOnFirstCall` pins a trajectory to the version the engine serves when
its first request goes out. Both wrap any engine with `generate` / `release_session` (and, for
`PinOnFirstCall`, `pinned(version)`): the embedded engine's client, the scripted fake in tests.
An engine that no longer holds the version raises `VersionNotResidentError`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import anyio

from core.engine_api import (
    EngineClient,
    GenerateRequest,
    GenerateResult,
    InferenceEngine,
    VersionNotResidentError,
)


class PinnedEngine:
    """`InferenceEngine` view of one engine: every request is served with one weights version.

    The orchestrator hands this to the agent loop for a trajectory that must stay on the version
    it started with; the loop itself is unchanged. `release_session` also drops the session's
    pin, which lets the engine free the version once nothing else uses it."""

    def __init__(self, engine: InferenceEngine, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"weights version must be an int >= 0, got {version!r}")
        self.engine = engine
        self.version = version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.weights_version not in (None, self.version):
            raise ValueError(f"request is pinned to weights version {request.weights_version} "
                             f"but this engine view serves version {self.version}")
        pinned = dataclasses.replace(request, weights_version=self.version)
        return await self.engine.generate(pinned)

    async def release_session(self, session_id: str) -> None:
        await self.engine.release_session(session_id)


class PinOnFirstCall:
    """One trajectory's engine in `async` mode: its first request is pinned to the version the
    engine serves at that moment, and every later request of the trajectory to the same one.

    An update can free the version read here before the first request reaches the engine (the
    engine has moved on; the pipeline hears of it when the update call returns). Nothing has
    been sampled yet, so the first request waits for the newer version and is pinned to it;
    a later request refused that way is an engine error, as the trajectory cannot move."""

    def __init__(self, engine: EngineClient, current_version: Callable[[], int], *,
                 repin_wait_s: float = 30.0, poll_s: float = 0.005) -> None:
        self.engine, self.current_version = engine, current_version
        self.repin_wait_s, self.poll_s = repin_wait_s, poll_s
        self.view: InferenceEngine | None = None

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.view is not None:
            return await self.view.generate(request)
        version = self.current_version()
        while True:
            view = self.engine.pinned(version)
            try:
                result = await view.generate(request)
            except VersionNotResidentError:
                version = await self._newer_than(version)
                continue
            self.view = view
            return result

    async def _newer_than(self, version: int) -> int:
        deadline = time.monotonic() + self.repin_wait_s
        while (current := self.current_version()) <= version:
            if time.monotonic() > deadline:
                raise VersionNotResidentError(
                    f"the engine no longer holds weights version {version} and the pipeline "
                    f"heard of no newer one within {self.repin_wait_s:.0f}s")
            await anyio.sleep(self.poll_s)
        return current

    async def release_session(self, session_id: str) -> None:
        await (self.view or self.engine).release_session(session_id)
