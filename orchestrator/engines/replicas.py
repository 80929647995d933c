"""Several engine replicas behind one engine client: session affinity, weight fan-out, failover.

`ReplicaRouter(clients)` is a `core.engine_api.EngineClient` like the ones
`orchestrator.engines.embedded.engine_client()` builds (plus `pause`, `resume`, `abort`,
`metrics`, `model_name`), over N replicas, each an `EngineClient` of its own (embedded engine,
vLLM, or the scripted fake in tests), all of one kind. Its `update_weights` returns one
`WeightUpdateReport` that holds every replica's.

Guarantees:
- Affinity: a session (`GenerateRequest.session_id`) is served by one replica while that
  replica is up, so the KV it retained between turns is reused. A session's first request, and
  a request without a session, goes to the up replica with the fewest outstanding tokens (for
  each request in flight there: prompt tokens the replica has not cached yet + `max_tokens`;
  ties go to the replica with fewer sessions, then the lower index).
- Weights: `update_weights` goes to every up replica at once and returns when all have applied
  it. Each replica stamps its own tokens with its own weights and KV versions, exactly as a
  single engine does; `pinned(v)` views and `inflight` updates work unchanged on every replica.
- Failure: a replica is down when a request to it fails and its `/health` does not answer, or
  when `health_failures` health probes in a row fail (the `run` task probes every
  `health_interval_s`; a probe that takes longer than `probe_timeout_s` fails). Going down
  cancels its requests in flight; each is retried once, on another up replica. Its sessions
  lose their replica at once: the next request of each (which sends the whole context anyway)
  goes to the least loaded up replica, possibly the same one restarted, which prefills it
  (`cached_prompt_tokens` 0), and that result carries `recompute_reason` (recorded on the
  model call as `kv_recompute`). A request whose retry
  fails too, or that finds no replica up, raises `EngineError`; the job's pipeline then pauses
  dispatch while `health()` (any replica up) is False.
- Recovery: with a `restart` callback the `run` task restarts a down replica (at most
  `max_restarts` times in all: each replica's `RestartBudget`) at the newest weights this
  router applied, and takes it back; without one it keeps probing and takes the replica back
  when it answers again (an externally run server that came back), first bringing it to the
  newest weights.
- A restarted replica holds only the newest version: a session pinned (`async`) to an older
  version that moves there fails with `VersionNotResidentError` unless another up replica still
  holds that version (moved sessions prefer the replica they can be served by).
No torch here.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskStatus

from core.children import RestartBudget
from core.engine_api import (
    EngineClient,
    EngineError,
    EngineKind,
    GenerateRequest,
    GenerateResult,
    KvPolicy,
    PauseMode,
    UpdateMode,
    VersionNotResidentError,
    WeightUpdateReport,
)
from core.log import get_logger
from orchestrator.engines.pinning import PinnedEngine

log = get_logger("stalewise.replicas")


# restart(index, newest) -> a ready client of a fresh replica; newest = (path, version) or None
Restart = Callable[[int, "tuple[str, int] | None"], Awaitable[EngineClient]]


@dataclass(eq=False)
class Replica:
    index: int
    client: EngineClient
    up: bool = True
    down_reason: str = ""
    outstanding_tokens: int = 0
    sessions: int = 0
    budget: RestartBudget = field(default_factory=lambda: RestartBudget(0, math.inf))
    probe_failures: int = 0
    in_flight: set[anyio.CancelScope] = field(default_factory=set)
    # weights versions this replica may hold (pinning): updated by fan-outs and restarts
    versions: set[int] = field(default_factory=set)

    @property
    def name(self) -> str:
        url = getattr(self.client, "base_url", None)
        return f"replica {self.index}" + (f" ({url})" if url else "")


@dataclass
class RouterStats:
    """Counters for tests, the benchmark and the run log."""

    requests: int = 0
    # the router's own CPU time: generate's less the replicas' (thread CPU time, so other
    # processes on a loaded machine do not count; other tasks' time inside the await cancels)
    route_s: float = 0.0
    retries: int = 0                # in-flight requests retried on another replica
    moved_sessions: int = 0
    replicas_down: int = 0
    restarts: int = 0
    per_replica: dict[int, int] = field(default_factory=dict)  # requests served


class _ReplicaFailed(Exception):
    def __init__(self, replica: Replica, reason: str) -> None:
        super().__init__(reason)
        self.replica, self.reason = replica, reason


class ReplicaRouter:
    """Engine client over several replicas (see module docstring)."""

    def __init__(self, clients: Sequence[EngineClient], *, restart: Restart | None = None,
                 max_restarts: int = 3, health_interval_s: float = 2.0,
                 health_failures: int = 3, probe_timeout_s: float = 5.0,
                 initial_version: int = 0) -> None:
        if not clients:
            raise ValueError("a ReplicaRouter needs at least one replica client")
        kinds = {c.kind for c in clients}
        if len(kinds) != 1:
            raise ValueError(f"the replicas behind one router are of one kind, got {sorted(kinds)}")
        self.kind: EngineKind = kinds.pop()
        self.replicas = [Replica(i, c, versions={initial_version},
                                 budget=RestartBudget(max_restarts, window_s=math.inf))
                         for i, c in enumerate(clients)]
        self.restart, self.max_restarts = restart, max_restarts
        self.health_interval_s, self.health_failures = health_interval_s, health_failures
        self.probe_timeout_s = probe_timeout_s
        self.stats = RouterStats()
        self._session_replica: dict[str, Replica] = {}
        self._session_context: dict[str, int] = {}   # tokens the replica holds for a session
        self._moved: dict[str, str] = {}              # session -> why it moved (until served)
        self._newest: tuple[str, int] | None = None   # (path, version) of the last update
        self._version = initial_version
        self._updates = anyio.Lock()                  # fan-outs and catch-ups, one at a time
        self._wake: dict[int, anyio.Event] = {}       # replica index -> set when it goes down

    # ---- InferenceEngine -------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        started, in_replicas = time.thread_time(), [0.0]
        try:
            return await self._generate(request, in_replicas)
        finally:
            self.stats.route_s += time.thread_time() - started - in_replicas[0]

    async def _generate(self, request: GenerateRequest, in_replicas: list[float]
                        ) -> GenerateResult:
        self.stats.requests += 1
        replica = self._route(request)
        try:
            return await self._serve(replica, request, in_replicas)
        except _ReplicaFailed as failure:
            self.stats.retries += 1
            self._move(request.session_id, failure)
            retry = self._route(request)
            try:
                return await self._serve(retry, request, in_replicas)
            except _ReplicaFailed as second:
                raise EngineError(f"{failure.replica.name} failed ({failure.reason}) and the "
                                  f"retry on {second.replica.name} failed too "
                                  f"({second.reason})") from second

    async def release_session(self, session_id: str) -> None:
        replica = self._session_replica.pop(session_id, None)
        self._session_context.pop(session_id, None)
        self._moved.pop(session_id, None)
        if replica is None:
            return
        replica.sessions -= 1
        if not replica.up:
            return  # its KV is gone with it
        try:
            await replica.client.release_session(session_id)
        except EngineError as exc:
            if await self._still_up(replica, exc):
                raise

    def pinned(self, version: int) -> PinnedEngine:
        return PinnedEngine(self, version)

    # ---- routing -------------------------------------------------------------------------
    def _route(self, request: GenerateRequest) -> Replica:
        """The replica for `request`: its session's, else the one with the fewest outstanding
        tokens (the session then sticks to it). Raises `EngineError` when no replica is up."""
        session = request.session_id
        replica = self._session_replica.get(session) if session else None
        if replica is None or not replica.up:
            if replica is not None:  # its replica went down between turns
                self._move(session, _ReplicaFailed(replica, replica.down_reason))
            replica = self._least_loaded(request.weights_version)
            if session:
                self._session_replica[session] = replica
                replica.sessions += 1
        return replica

    def _least_loaded(self, version: int | None) -> Replica:
        up = [r for r in self.replicas if r.up]
        if not up:
            raise EngineError(f"no engine replica is up ({self._why_down()})")
        if version is not None:  # a pinned request prefers replicas holding its version
            up = [r for r in up if version in r.versions] or up
        return min(up, key=lambda r: (r.outstanding_tokens, r.sessions, r.index))

    def _move(self, session: str | None, failure: _ReplicaFailed) -> None:
        if not session:
            return
        old = self._session_replica.pop(session, None)
        if old is not None:
            old.sessions -= 1
        self._session_context.pop(session, None)
        if session not in self._moved:
            self.stats.moved_sessions += 1
            self._moved[session] = (f"replica_failover: {failure.replica.name} went down "
                                    f"({failure.reason}); context prefilled again on another "
                                    f"replica")

    def _cost(self, replica: Replica, request: GenerateRequest) -> int:
        cached = 0
        if request.session_id and self._session_replica.get(request.session_id) is replica:
            cached = self._session_context.get(request.session_id, 0)
        return max(len(request.prompt_token_ids) - cached, 0) + request.params.max_tokens

    async def _serve(self, replica: Replica, request: GenerateRequest,
                     in_replicas: list[float]) -> GenerateResult:
        cost = self._cost(replica, request)
        replica.outstanding_tokens += cost
        scope = anyio.CancelScope()
        replica.in_flight.add(scope)
        sent = time.thread_time()
        try:
            with scope:
                result = await replica.client.generate(request)
        except VersionNotResidentError:
            raise
        except EngineError as exc:
            in_replicas[0] += time.thread_time() - sent  # the probe below counts as replica time
            sent = time.thread_time()
            if await self._still_up(replica, exc):
                raise
            raise _ReplicaFailed(replica, replica.down_reason) from exc
        finally:
            in_replicas[0] += time.thread_time() - sent
            replica.outstanding_tokens -= cost
            replica.in_flight.discard(scope)
        if scope.cancelled_caught:  # the replica went down while this request ran
            raise _ReplicaFailed(replica, replica.down_reason)
        self.stats.per_replica[replica.index] = self.stats.per_replica.get(replica.index, 0) + 1
        session = request.session_id
        if session:
            self._session_context[session] = result.prompt_tokens + len(result.tokens)
            reason = self._moved.pop(session, None)
            if reason is not None:
                result = dataclasses.replace(result, recompute_reason=reason)
        return result

    # ---- health --------------------------------------------------------------------------
    async def _still_up(self, replica: Replica, exc: BaseException) -> bool:
        """After a failed call: is the replica still answering? If not, mark it down."""
        if not replica.up:
            return False
        if await self._probe(replica):
            return True
        self._mark_down(replica, f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        return False

    async def _probe(self, replica: Replica) -> bool:
        with anyio.move_on_after(self.probe_timeout_s):
            return bool(await replica.client.health())
        return False

    def _mark_down(self, replica: Replica, reason: str) -> None:
        if not replica.up:
            return
        replica.up, replica.down_reason = False, reason
        self.stats.replicas_down += 1
        log.warning("engine replica down; its sessions move to the others", replica=replica.name,
                    reason=reason, in_flight=len(replica.in_flight), sessions=replica.sessions)
        # moved now, not on their next turn: the replica may be back (restarted, its KV gone)
        # by then, and their next call must still be recorded as a recompute
        failure = _ReplicaFailed(replica, reason)
        for session in [s for s, r in self._session_replica.items() if r is replica]:
            self._move(session, failure)
        for scope in list(replica.in_flight):
            scope.cancel()
        if replica.index in self._wake:  # its supervisor restarts it now, not a probe later
            self._wake[replica.index].set()

    def _why_down(self) -> str:
        return "; ".join(f"{r.name}: {r.down_reason}" for r in self.replicas if not r.up)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Probe every replica, mark silent ones down, restart or take back down ones. Runs
        until cancelled (start it in the job's task group)."""
        # the wake events exist before any supervisor runs: a replica marked down between
        # started() and its supervisor's first step (trio runs new tasks later) is not missed,
        # and one already down when the job starts is dealt with at once
        for replica in self.replicas:
            self._wake[replica.index] = anyio.Event()
            if not replica.up:
                self._wake[replica.index].set()
        async with anyio.create_task_group() as tg:
            for replica in self.replicas:
                tg.start_soon(self._supervise, replica)
            task_status.started()

    async def _supervise(self, replica: Replica) -> None:
        wake = self._wake[replica.index]
        while True:
            with anyio.move_on_after(self.health_interval_s):
                await wake.wait()
            if wake.is_set():
                wake = self._wake[replica.index] = anyio.Event()
            if replica.up:
                if await self._probe(replica):
                    replica.probe_failures = 0
                    continue
                replica.probe_failures += 1
                if replica.probe_failures >= self.health_failures:
                    self._mark_down(replica, f"did not answer /health {self.health_failures} "
                                             f"times in a row")
            elif self.restart is not None:
                if replica.budget.allow():
                    await self._restart(replica)
            elif await self._probe(replica):
                await self._take_back(replica, replica.client)

    async def _restart(self, replica: Replica) -> None:
        self.stats.restarts += 1
        log.warning("restarting engine replica", replica=replica.name,
                    restart=replica.budget.restarts, of=self.max_restarts)
        assert self.restart is not None
        try:
            client = await self.restart(replica.index, self._newest)
        except Exception as exc:  # a failed restart is retried on the next round
            log.warning("engine replica did not restart", replica=replica.name, error=str(exc))
            return
        old = replica.client
        await self._take_back(replica, client)
        if old is not client and hasattr(old, "aclose"):
            await old.aclose()

    async def _take_back(self, replica: Replica, client: EngineClient) -> None:
        """Bring a replica that answers again to the newest weights, then route to it."""
        async with self._updates:
            replica.client = client
            newest = self._newest
            if newest is not None and getattr(client, "weights_version", -1) != newest[1]:
                try:
                    await client.update_weights(newest[0], newest[1], mode="drain",
                                                kv="recompute")
                except EngineError as exc:
                    log.warning("engine replica answers but could not load the newest "
                                "weights", replica=replica.name, error=str(exc))
                    return
            replica.versions = {newest[1] if newest else self._version}
            replica.probe_failures = 0
            replica.up, replica.down_reason = True, ""
        log.info("engine replica back", replica=replica.name, version=self._version)

    # ---- admin: fan out ------------------------------------------------------------------
    async def update_weights(self, path: str, version: int, *, mode: UpdateMode = "inflight",
                             kv: KvPolicy = "recompute") -> WeightUpdateReport:
        """Apply the update on every up replica concurrently; a replica that fails and no
        longer answers is marked down (it catches up when it comes back). Raises
        `EngineError` when no replica applied it."""
        async with self._updates:
            targets = [r for r in self.replicas if r.up]
            reports: dict[int, WeightUpdateReport] = {}
            errors: dict[int, EngineError] = {}

            async def one(replica: Replica) -> None:
                try:
                    reports[replica.index] = await replica.client.update_weights(
                        path, version, mode=mode, kv=kv)
                except EngineError as exc:
                    errors[replica.index] = exc
                    await self._still_up(replica, exc)  # marks it down if it is silent

            async with anyio.create_task_group() as tg:
                for replica in targets:
                    tg.start_soon(one, replica)
            answering = [i for i, exc in errors.items() if self.replicas[i].up]
            if answering or not reports:
                first = errors[answering[0]] if answering else None
                raise EngineError(f"weights version {version} was not applied on every "
                                  f"replica: {first or self._why_down() or 'no replica is up'}")
            self._newest, self._version = (str(path), int(version)), int(version)
            for index in reports:
                replica = self.replicas[index]
                replica.versions = ({version} if mode != "pin"
                                    else replica.versions | {version})
            return WeightUpdateReport.combined(  # skipped: down, they catch up when back
                [reports[i] for i in sorted(reports)],
                skipped=[r.index for r in self.replicas if r.index not in reports])

    async def _each(self, call: Callable[[Any], Awaitable[Any]]) -> dict[int, Any]:
        """`call(client)` on every up replica at once: results by replica index."""
        results: dict[int, Any] = {}

        async def one(replica: Replica) -> None:
            results[replica.index] = await call(replica.client)

        async with anyio.create_task_group() as tg:
            for replica in self.replicas:
                if replica.up:
                    tg.start_soon(one, replica)
        return results

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self._each(lambda c: c.pause(mode))

    async def resume(self) -> None:
        await self._each(lambda c: c.resume())

    async def abort(self, request_id: str | None = None) -> int:
        return sum((await self._each(lambda c: c.abort(request_id))).values())

    async def metrics(self) -> dict[str, float]:
        """Every replica's metrics, keyed `replica<i>/<name>`, and the router's counters."""
        merged: dict[str, float] = {}
        for index, values in sorted((await self._each(lambda c: c.metrics())).items()):
            merged.update({f"replica{index}/{k}": v for k, v in values.items()})
        merged.update({"router/replicas_up": float(sum(r.up for r in self.replicas)),
                       "router/retries": float(self.stats.retries),
                       "router/moved_sessions": float(self.stats.moved_sessions),
                       "router/restarts": float(self.stats.restarts)})
        return merged

    async def health(self) -> bool:
        """True while at least one replica is up and answers."""
        for replica in self.replicas:
            if replica.up and await self._probe(replica):
                return True
        return False

    async def wait_ready(self, timeout: float = 120.0) -> None:
        await self._each(lambda c: c.wait_ready(timeout))

    # ---- what the job reads once --------------------------------------------------------
    @property
    def can_pin(self) -> bool:
        return all(r.client.can_pin for r in self.replicas)

    @property
    def weights_version(self) -> int:
        return self._version

    async def model_name(self) -> str:
        client: Any = self.replicas[0].client
        return await client.model_name()

    async def max_model_len(self) -> int | None:
        """The smallest context window of the replicas (None when none reports one)."""
        lengths = [n for n in (await self._each(lambda c: c.max_model_len())).values()
                   if n is not None]
        return min(lengths) if lengths else None

    async def aclose(self) -> None:
        for replica in self.replicas:
            await replica.client.aclose()

    async def __aenter__(self) -> ReplicaRouter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
