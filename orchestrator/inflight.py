"""Trajectories in flight, and the promise that each one ends with a terminal status.

`InFlight` holds the trajectories a pipeline or an evaluation has created and not yet recorded
an outcome for. Callers create a trajectory's row and `add` it here under one
`anyio.CancelScope(shield=True)`, so a cancellation can never leave a row that nobody will
close; `abort_all` gives every one left the status `aborted` with its reason: through the
writer (after the rows the writer still holds for them), or, when the writer has stopped,
directly in the store.
"""

from __future__ import annotations

import time
from typing import Generic, TypeVar

import anyio

from core.store.store import Store
from orchestrator.writer import StoreWriter, WriterStopped

T = TypeVar("T")
ABORT_WRITE_S = 30.0  # how long the writer may take before the store is written directly


class InFlight(Generic[T]):
    """Trajectory id -> what its loop needs (its task), for the trajectories not yet ended."""

    def __init__(self, store: Store, writer: StoreWriter) -> None:
        self.store, self.writer = store, writer
        self._items: dict[int, T] = {}

    def __len__(self) -> int:
        return len(self._items)

    def get(self, trajectory_id: int) -> T | None:
        return self._items.get(trajectory_id)

    def add(self, trajectory_id: int, item: T) -> None:
        self._items[trajectory_id] = item

    def ended(self, trajectory_id: int) -> None:
        """Its outcome has been handed to the writer."""
        self._items.pop(trajectory_id, None)

    async def abort_all(self, reason: str) -> None:
        """Every trajectory still here ends as `aborted` with `reason`. Shielded."""
        if not self._items:
            return
        values = dict(status="aborted", error=reason, finished_at=time.time())
        ids = sorted(self._items)
        self._items.clear()
        with anyio.CancelScope(shield=True):
            written = False
            with anyio.move_on_after(ABORT_WRITE_S):
                try:
                    for trajectory_id in ids:
                        await self.writer.put_trajectory_update(trajectory_id, values)
                    await self.writer.flush()
                    written = True
                except WriterStopped:  # the job is failing: the store may still answer
                    pass
            if not written:
                await anyio.to_thread.run_sync(lambda: [
                    self.store.update_trajectory(tid, **values) for tid in ids])
