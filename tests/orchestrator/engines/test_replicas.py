"""The replica router: session affinity, least outstanding tokens, weight fan-out, failover.

Replicas are scripted engines behind a small fake client that can be killed (requests fail,
`/health` refuses), silenced (requests and `/health` hang) and revived, injected into
`ReplicaRouter`; nothing is patched.
"""

from __future__ import annotations

import anyio
import pytest

from core.engine_api import (
    EngineError,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    VersionNotResidentError,
    WeightUpdateReport,
)
from orchestrator.engines.pinning import PinOnFirstCall
from orchestrator.engines.replicas import ReplicaRouter
from orchestrator.engines.scripted import FakeEngineClient, ScriptedEngine, ScriptedTurn

pytestmark = pytest.mark.anyio
STOP = 2


class FakeReplica(FakeEngineClient):
    """A scripted engine as one replica: answers, dies, goes silent, or holds a request."""

    def __init__(self, name: str) -> None:
        self.engine = ScriptedEngine(lambda key, i: ScriptedTurn((5, 6, STOP)), engine_id=name)
        self.name = name
        self.dead = self.silent = False
        self.gate: anyio.Event | None = None  # set: requests wait for it
        self.applied: list[tuple[str, int, str, str]] = []
        self.resident: set[int] = {0}
        self.weights_version = 0
        self.fail_next: EngineError | None = None

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.dead:
            raise EngineError(f"cannot reach {self.name}")
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        if request.weights_version is not None and request.weights_version not in self.resident:
            raise VersionNotResidentError(f"{self.name} holds {sorted(self.resident)}")
        if self.gate is not None:
            await self.gate.wait()
        if self.silent:
            await anyio.sleep_forever()
        if self.dead:
            raise EngineError(f"{self.name} died mid-request")
        return await self.engine.generate(request)

    async def release_session(self, session_id: str) -> None:
        if self.dead:
            raise EngineError(f"cannot reach {self.name}")
        await self.engine.release_session(session_id)

    async def update_weights(self, path: str, version: int, *, mode: str = "inflight",
                             kv: str = "recompute") -> WeightUpdateReport:
        if self.dead:
            raise EngineError(f"cannot reach {self.name}")
        self.applied.append((path, version, mode, kv))
        self.engine.version = self.weights_version = version
        self.resident = self.resident | {version} if mode == "pin" else {version}
        return await super().update_weights(path, version, mode=mode, kv=kv)

    async def health(self) -> bool:
        if self.silent:
            await anyio.sleep_forever()
        return not self.dead


def turn(session: str, prompt: list[int], max_tokens: int = 16) -> GenerateRequest:
    return GenerateRequest(prompt, SamplingParams(stop_token_ids=(STOP,), max_tokens=max_tokens),
                           session_id=session)


async def conversation(router, session: str, turns: int,
                       prompt: list[int] | None = None) -> list[GenerateResult]:
    """`turns` calls of one session, each prompt extending the last context exactly."""
    context = list(prompt or [1, 1, 1])
    results = []
    for _ in range(turns):
        result = await router.generate(turn(session, list(context)))
        results.append(result)
        context += result.tokens.token_ids.tolist() + [9]
    return results


def router_of(n: int, **options) -> tuple[ReplicaRouter, list[FakeReplica]]:
    fakes = [FakeReplica(f"r{i}") for i in range(n)]
    options.setdefault("health_interval_s", 0.01)
    options.setdefault("probe_timeout_s", 0.2)
    return ReplicaRouter(fakes, **options), fakes


async def test_a_session_sticks_to_its_replica_and_reuses_its_kv():
    router, _ = router_of(3)
    for s in range(6):
        results = await conversation(router, f"t{s}/0", turns=4)
        assert len({r.engine_id for r in results}) == 1, "a session changed replica"
        assert all(r.cached_prompt_tokens == r.prompt_tokens - 1 for r in results[1:])
        assert all(r.recompute_reason is None for r in results)
    assert router.stats.moved_sessions == 0 and router.stats.retries == 0


async def test_new_sessions_go_to_the_replica_with_fewest_outstanding_tokens():
    router, fakes = router_of(3)
    fakes[0].gate, fakes[1].gate = anyio.Event(), anyio.Event()
    served: dict[str, str] = {}

    async def call(session: str, prompt_len: int, max_tokens: int) -> None:
        result = await router.generate(turn(session, [1] * prompt_len, max_tokens))
        served[session] = result.engine_id

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "big/0", 500, 100)       # all idle: lowest index, r0 (600 out)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(call, "small/0", 10, 10)      # r1 (20 outstanding)
        await anyio.wait_all_tasks_blocked()
        assert [r.outstanding_tokens for r in router.replicas] == [600, 20, 0]
        await call("third/0", 50, 50)               # r2 idle: served at once
        fakes[2].gate = anyio.Event()
        tg.start_soon(call, "fourth/0", 1000, 50)   # r2 idle again -> r2 (1050)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(call, "fifth/0", 5, 5)        # 600 / 20 / 1050 -> r1
        await anyio.wait_all_tasks_blocked()
        assert [r.outstanding_tokens for r in router.replicas] == [600, 30, 1050]
        for fake in fakes:
            fake.gate.set()
    assert served == {"big/0": "r0", "small/0": "r1", "third/0": "r2", "fourth/0": "r2",
                      "fifth/0": "r1"}
    assert [r.outstanding_tokens for r in router.replicas] == [0, 0, 0]


async def test_a_session_costs_only_its_uncached_tokens_on_its_replica():
    router, fakes = router_of(2)
    await conversation(router, "long/0", turns=1, prompt=[1] * 400)   # r0 holds 403 tokens
    fakes[0].gate = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(router.generate, turn("long/0", [1] * 400 + [5, 6, STOP, 9], 8))
        await anyio.wait_all_tasks_blocked()
        assert router.replicas[0].outstanding_tokens == 1 + 8  # one new token + max_tokens
        fakes[0].gate.set()


async def test_weight_updates_reach_every_replica_and_tokens_carry_its_version():
    router, fakes = router_of(3)
    sessions = [f"t{i}/0" for i in range(3)]
    for s in sessions:
        await conversation(router, s, turns=1)
    report = await router.update_weights("/ckpt/v1", 1, mode="inflight", kv="retain")
    assert report.version == 1 and [r.version for r in report.replicas] == [1, 1, 1]
    assert report.skipped_replicas == () and report.previous_version == 0
    assert all(f.applied == [("/ckpt/v1", 1, "inflight", "retain")] for f in fakes)
    assert router.weights_version == 1
    for s in sessions:
        result = (await conversation(router, s, turns=1))[0]
        assert set(result.tokens.weights_versions.tolist()) == {1}


async def test_async_pinning_works_across_replicas():
    """`pin` updates go to every replica; a trajectory pinned to v0 stays on v0 after v1."""
    router, fakes = router_of(2)
    engine = PinOnFirstCall(router, lambda: router.weights_version)
    first = await engine.generate(turn("a/0", [1, 1]))
    await router.update_weights("/ckpt/v1", 1, mode="pin", kv="recompute")
    assert all(f.resident == {0, 1} for f in fakes)
    later = await engine.generate(turn("a/0", [1, 1, 5, 6, STOP, 9]))
    fresh = await PinOnFirstCall(router, lambda: router.weights_version).generate(
        turn("b/0", [1, 1]))
    assert set(first.tokens.weights_versions.tolist()) == {0}
    assert set(later.tokens.weights_versions.tolist()) == {0}
    assert set(fresh.tokens.weights_versions.tolist()) == {1}


async def test_a_dead_replicas_sessions_move_and_are_recorded_as_recomputed():
    router, fakes = router_of(2)
    await conversation(router, "a/0", turns=1)          # on r0
    await conversation(router, "b/0", turns=1)          # on r1
    fakes[0].dead = True
    moved = await conversation(router, "a/0", turns=2)
    assert [r.engine_id for r in moved] == ["r1", "r1"]
    assert moved[0].cached_prompt_tokens == 0, "the new replica must prefill the context"
    assert moved[0].recompute_reason.startswith("replica_failover: replica 0 went down")
    assert moved[1].recompute_reason is None and moved[1].cached_prompt_tokens > 0
    assert not router.replicas[0].up and router.stats.moved_sessions == 1
    assert router.stats.retries == 1  # the request that found r0 dead was retried once
    await router.release_session("a/0")  # released on r1, nothing sent to the dead r0
    assert fakes[1].engine.released == ["a/0"]


async def test_a_silent_replicas_in_flight_request_is_retried_once_elsewhere():
    router, fakes = router_of(2, health_failures=2)
    fakes[0].silent = True
    async with anyio.create_task_group() as tg:
        await tg.start(router.run)
        result = await router.generate(turn("a/0", [1, 1, 1]))  # r0 hangs until marked down
        tg.cancel_scope.cancel()
    assert result.engine_id == "r1" and result.recompute_reason is not None
    assert "did not answer /health 2 times in a row" in result.recompute_reason
    assert router.stats.retries == 1 and not router.replicas[0].up
    assert router.replicas[0].outstanding_tokens == 0 and not router.replicas[0].in_flight


async def test_a_request_that_fails_on_its_retry_too_is_an_engine_error():
    router, fakes = router_of(2)
    fakes[0].dead = fakes[1].dead = True
    with pytest.raises(EngineError, match=r"replica 0 failed .* retry on replica 1 failed too"):
        await router.generate(turn("a/0", [1]))
    with pytest.raises(EngineError, match="no engine replica is up"):
        await router.generate(turn("b/0", [1]))
    assert not await router.health()


async def test_an_error_from_a_healthy_replica_is_not_a_failover():
    router, fakes = router_of(2)
    await conversation(router, "a/0", turns=1)
    fakes[0].fail_next = EngineError("the engine answered 400: prompt too long")
    with pytest.raises(EngineError, match="prompt too long"):
        await conversation(router, "a/0", turns=1)
    assert router.replicas[0].up and router.stats.retries == 0
    assert (await conversation(router, "a/0", turns=1))[0].engine_id == "r0"


async def test_a_restarted_replica_comes_back_at_the_newest_weights():
    fresh = FakeReplica("r0-restarted")
    asked: list = []

    async def restart(index, newest):
        asked.append((index, newest))
        return fresh

    router, fakes = router_of(2, restart=restart)
    await conversation(router, "before/0", turns=1)  # on r0
    await router.update_weights("/ckpt/v3", 3, mode="inflight", kv="recompute")
    fakes[0].dead = True
    async with anyio.create_task_group() as tg:
        await tg.start(router.run)
        with anyio.fail_after(60):  # hang guard
            while not (router.replicas[0].up and router.replicas[0].client is fresh):
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert asked == [(0, ("/ckpt/v3", 3))]
    assert fresh.applied == [("/ckpt/v3", 3, "drain", "recompute")]  # it started at v0 here
    assert router.stats.restarts == 1
    result = (await conversation(router, "new/0", turns=1))[0]
    assert result.engine_id == "r0-restarted"
    assert set(result.tokens.weights_versions.tolist()) == {3}
    # a session of the old r0 is a recompute wherever it continues, the restarted r0 included
    resumed = (await conversation(router, "before/0", turns=1))[0]
    assert resumed.cached_prompt_tokens == 0
    assert resumed.recompute_reason.startswith("replica_failover: replica 0 went down "
                                               "(did not answer /health 3 times in a row)")


async def test_a_replica_is_restarted_at_most_max_restarts_times_in_all():
    """Each replica's `RestartBudget`: failed restarts count, and once `max_restarts` are spent
    the replica stays down (the others serve) however long the job runs."""
    attempts: list[int] = []

    async def restart(index, newest):
        attempts.append(index)
        raise EngineError("the replica did not come up")

    router, fakes = router_of(2, restart=restart, max_restarts=2)
    fakes[0].dead = True
    async with anyio.create_task_group() as tg:
        await tg.start(router.run)
        with anyio.fail_after(60):  # hang guard
            while len(attempts) < 2:
                await anyio.sleep(0.01)
        await anyio.sleep(0.5)  # fifty more supervisor rounds: no third attempt
        tg.cancel_scope.cancel()
    assert attempts == [0, 0] and router.stats.restarts == 2
    assert not router.replicas[0].up and router.replicas[1].up
    assert (await conversation(router, "a/0", turns=1))[0].engine_id == "r1"


@pytest.mark.parametrize("found", ["while supervised", "before the supervisors run"])
async def test_a_replica_found_dead_by_a_call_is_restarted_without_waiting_for_a_probe(found):
    """A job can end seconds after a replica dies: its restart must not wait a probe interval,
    also when the call finds it dead before its supervisor's first step (trio may run the
    supervisors after the caller's next call)."""
    restarted = anyio.Event()

    async def restart(index, newest):
        restarted.set()
        return FakeReplica("r0-restarted")

    router, fakes = router_of(2, restart=restart, health_interval_s=3600.0)
    await conversation(router, "a/0", turns=1)          # on r0
    fakes[0].dead = True
    if found == "before the supervisors run":
        await conversation(router, "a/0", turns=1)      # finds r0 dead, moves to r1
    async with anyio.create_task_group() as tg:
        await tg.start(router.run)
        if found == "while supervised":
            await conversation(router, "a/0", turns=1)
        with anyio.fail_after(30):  # hang guard: with the bug it waits the hour-long interval
            await restarted.wait()
        tg.cancel_scope.cancel()
    assert router.stats.restarts == 1


async def test_an_external_replica_that_answers_again_is_taken_back_after_catching_up():
    router, fakes = router_of(2)
    fakes[1].dead = True
    await conversation(router, "a/0", turns=1)
    await conversation(router, "b/0", turns=1)  # r1 found dead, retried on r0
    assert not router.replicas[1].up
    report = await router.update_weights("/ckpt/v1", 1, mode="inflight", kv="recompute")
    assert len(report.replicas) == 1 and report.skipped_replicas == (1,)
    fakes[1].dead = False
    async with anyio.create_task_group() as tg:
        await tg.start(router.run)
        with anyio.fail_after(60):  # hang guard
            while not router.replicas[1].up:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert fakes[1].applied == [("/ckpt/v1", 1, "drain", "recompute")]


async def test_an_update_refused_by_an_answering_replica_is_an_error():
    router, fakes = router_of(2)

    async def refuse(path, version, *, mode, kv):
        raise EngineError("checkpoint not found")

    fakes[1].update_weights = refuse
    with pytest.raises(EngineError, match="not applied on every replica: checkpoint not found"):
        await router.update_weights("/missing", 1, mode="inflight", kv="recompute")
    assert router.weights_version == 0 and router.replicas[1].up


async def test_a_pinned_request_prefers_a_replica_that_holds_its_version():
    """A restarted replica holds only the newest version: a new trajectory pinned to an older
    one goes to a replica that still holds it, though the restarted one is first in line."""
    router, fakes = router_of(3)
    await router.update_weights("/ckpt/v1", 1, mode="pin", kv="recompute")
    fakes[0].resident = {1}
    router.replicas[0].versions = {1}             # as after a restart at v1
    old = await router.pinned(0).generate(turn("old/0", [1, 1]))  # all idle: r0 would win
    assert old.engine_id == "r1" and set(old.tokens.weights_versions.tolist()) == {0}
    fakes[1].dead = fakes[2].dead = True
    with pytest.raises(EngineError, match="retry on replica 2 failed too"):
        await router.pinned(0).generate(turn("old/0", [1, 1, 5, 6, STOP, 9]))
    with pytest.raises(VersionNotResidentError):  # only r0 is left, and it lacks v0
        await router.pinned(0).generate(turn("old/0", [1, 1, 5, 6, STOP, 9]))
