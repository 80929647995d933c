"""Small fakes for the orchestrator's tests and benchmarks: a learner and a weights target.

`FakeLearner` plays the learner process's part of the protocol against the real store: it
consumes the admission log in order, `batch_size` entries per step (optionally taking
`step_s` seconds), records each step with its first and last sequence number, and publishes
version v+1 every `publish_every` steps (publish-then-mark: the row is the only signal). Each
step's mean and max lag read every consumed trajectory's row, as the learner does; with
`record_lags=False` they are left empty and nothing is read (a benchmark of the orchestrator
does not charge it for the learner's reads).
"""

from __future__ import annotations

import time
import zlib

import anyio
from anyio.abc import TaskStatus

from core.engine_api import KvPolicy, UpdateMode, WeightUpdateReport
from core.store.store import Store
from orchestrator.engines.scripted import FakeEngineClient


class FakeLearner:
    def __init__(self, store: Store, run_id: str, *, batch_size: int, publish_every: int = 1,
                 max_steps: int | None = None, step_s: float = 0.0,
                 poll_s: float = 0.01, record_lags: bool = True) -> None:
        self.store, self.run_id = store, run_id
        self.record_lags = record_lags
        self.batch_size, self.publish_every = batch_size, publish_every
        self.max_steps, self.step_s, self.poll_s = max_steps, step_s, poll_s
        self.busy_s = 0.0
        self.batches: list[list[int]] = []  # consumed sequence numbers, per step

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        version, _, step, consumed = self.store.learner_progress(self.run_id)
        task_status.started()
        while self.max_steps is None or step < self.max_steps:
            entries = await anyio.to_thread.run_sync(
                self.store.stream_after, self.run_id, consumed, self.batch_size)
            if len(entries) < self.batch_size:
                await anyio.sleep(self.poll_s)
                continue
            started = time.time()
            if self.step_s:
                await anyio.sleep(self.step_s)
            step += 1
            first, consumed = entries[0].seq, entries[-1].seq
            self.batches.append([e.seq for e in entries])
            lags = [version - t.min_version for t in map(self._trajectory, entries)
                    if t.min_version is not None] if self.record_lags else []
            row = dict(step=step, mode="rl", first_seq=first, last_seq=consumed,
                       num_samples=len(entries), num_tokens=0, loss=0.0, policy_version=version,
                       mean_lag=sum(lags) / len(lags) if lags else None,
                       max_lag=max(lags) if lags else None, metrics={}, started_at=started,
                       finished_at=time.time())
            published = None
            if step % self.publish_every == 0:
                version += 1
                published = dict(version=version, path=f"fake://v{version}", learner_step=step,
                                  last_seq=consumed)
            # the step and the version it publishes in one transaction, as the real learner
            # writes them: a reader between two would see the step done on the old version
            self.store.record_learner_step_and_version(self.run_id, row, published)
            self.busy_s += time.time() - started

    def _trajectory(self, entry):
        return self.store.trajectory(entry.trajectory_id)


def replays_correct(key: str, correct_fraction: float) -> bool:
    """Whether `DemoScript` replays the correct demonstration for trajectory `key` (its id)."""
    return (zlib.crc32(key.encode()) % 1000) / 1000 < correct_fraction


class DemoScript:
    """A scripted-engine script that replays each trajectory's own task demonstration.

    `task_of` maps a trajectory id (the session key) to its task (`Pipeline.task_of`); a
    stable hash of the id decides whether the trajectory replays the correct or a deliberately
    wrong demonstration (`correct_fraction`), so groups have reward variance like a policy's.
    """

    def __init__(self, task_of, family, chat_format, *, correct_fraction: float = 0.5) -> None:
        self.task_of, self.family, self.chat_format = task_of, family, chat_format
        self.correct_fraction = correct_fraction
        self._turns: dict[str, list] = {}
        self._by_task: dict[tuple[str, bool], list] = {}  # group members share their task

    def _trajectory_turns(self, key: str) -> list:
        from orchestrator.engines.scripted import ScriptedTurn

        task = self.task_of(int(key))
        if task is None:
            raise KeyError(f"DemoScript: trajectory {key} is not in flight")
        correct = replays_correct(key, self.correct_fraction)
        turns = self._by_task.get((task.key, correct))
        if turns is None:
            if len(self._by_task) > 4096:
                self._by_task.clear()
            demo = self.family.demonstration(task, correct)
            turns = self._by_task[(task.key, correct)] = [
                ScriptedTurn(tuple(self.chat_format.encode_assistant(text)))
                for text in demo.assistant_texts]
        return turns

    def __call__(self, key: str, index: int):
        turns = self._turns.get(key)
        if turns is None:
            turns = self._turns[key] = self._trajectory_turns(key)
        if index >= len(turns) - 1:
            self._turns.pop(key, None)  # the last turn: forget the script
        return turns[min(index, len(turns) - 1)]


class CapacityEngine(FakeEngineClient):
    """An engine model with finite capacity around the scripted engine, for pipeline studies.

    At most `slots` requests decode at once (continuous batching's batch size); each sampled
    token costs `decode_s` and each uncached prompt token `prefill_s`. Weight updates cost what
    they cost a real engine: `drain` holds new requests until those in progress finish;
    `inflight` with `kv = recompute` stalls decoding while every in-flight context is
    prefilled again; `retain` and `pin` are free. `busy_s` is the time with work in progress.
    """

    def __init__(self, engine, *, slots: int, decode_s: float, prefill_s: float = 0.0,
                 tick_s: float = 0.01) -> None:
        self.engine, self.slots = engine, anyio.CapacityLimiter(slots)
        self.decode_s, self.prefill_s, self.tick_s = decode_s, prefill_s, tick_s
        self.version = 0
        self.busy_s = 0.0
        self.update_pause_s = 0.0
        self._active: dict[int, int] = {}  # request -> context tokens
        self._admit = anyio.Event()  # closed: new requests wait (drain)
        self._admit.set()
        self._decode = anyio.Event()  # closed: decoding stalls (recompute)
        self._decode.set()
        self._busy_since: float | None = None
        self._next = 0

    def _enter(self, context: int) -> int:
        self._next += 1
        if not self._active:
            self._busy_since = time.monotonic()
        self._active[self._next] = context
        return self._next

    def _leave(self, request: int) -> None:
        del self._active[request]
        if not self._active and self._busy_since is not None:
            self.busy_s += time.monotonic() - self._busy_since
            self._busy_since = None

    async def generate(self, request):
        async with self.slots:
            await self._admit.wait()
            handle = self._enter(len(request.prompt_token_ids))
            try:
                self.engine.version = self.version  # pinned requests carry their own version
                result = await self.engine.generate(request)
                work = (len(result.tokens) * self.decode_s
                        + (result.prompt_tokens - result.cached_prompt_tokens) * self.prefill_s)
                while work > 0:  # decode in ticks; a closed gate (an update) stalls it
                    await self._decode.wait()
                    step = min(self.tick_s, work)
                    await anyio.sleep(step)
                    work -= step
                return result
            finally:
                self._leave(handle)

    async def release_session(self, session_id: str) -> None:
        await self.engine.release_session(session_id)

    async def update_weights(self, path: str, version: int, *, mode: UpdateMode = "inflight",
                             kv: KvPolicy = "recompute") -> WeightUpdateReport:
        started = time.monotonic()
        self._admit = anyio.Event()
        stall = mode == "inflight" and kv == "recompute"
        if stall:
            self._decode = anyio.Event()
        try:
            if mode == "drain":
                while self._active:
                    await anyio.sleep(self.tick_s)
            elif stall:
                await anyio.sleep(sum(self._active.values()) * self.prefill_s)
            return await super().update_weights(path, version, mode=mode, kv=kv)
        finally:
            self._admit.set()
            self._decode.set()
            self.update_pause_s += time.monotonic() - started
