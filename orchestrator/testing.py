"""Small fakes for the orchestrator's tests and benchmarks: a learner and a weights target.

`FakeLearner` plays the learner process's part of the protocol against the real store: it
consumes the admission log in order, `batch_size` entries per step (optionally taking
`step_s` seconds), records each step with its first and last sequence number, and publishes
version v+1 every `publish_every` steps (publish-then-mark: the row is the only signal).
`VersionedEngine` lets the scripted engine follow published versions like a real engine.
"""

from __future__ import annotations

import time

import anyio
from anyio.abc import TaskStatus

from stalewise.store.store import Store


class FakeLearner:
    def __init__(self, store: Store, run_id: str, *, batch_size: int, publish_every: int = 1,
                 max_steps: int | None = None, step_s: float = 0.0,
                 poll_s: float = 0.01) -> None:
        self.store, self.run_id = store, run_id
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
                    if t.min_version is not None]
            self.store.record_learner_step(
                self.run_id, step=step, mode="rl", first_seq=first, last_seq=consumed,
                num_samples=len(entries), num_tokens=0, loss=0.0, policy_version=version,
                mean_lag=sum(lags) / len(lags) if lags else None,
                max_lag=max(lags) if lags else None, metrics={}, started_at=started,
                finished_at=time.time())
            self.busy_s += time.time() - started
            if step % self.publish_every == 0:
                version += 1
                self.store.publish_version(self.run_id, version, f"fake://v{version}",
                                           learner_step=step, last_seq=consumed)

    def _trajectory(self, entry):
        return self.store.trajectory(entry.trajectory_id)


class VersionedEngine:
    """A `WeightsTarget` for engines with a settable `version` (the scripted engine)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.updates: list[tuple[int, str, str]] = []

    async def update_weights(self, path: str, version: int, *, mode: str, kv: str) -> None:
        self.engine.version = version
        self.updates.append((version, mode, kv))
