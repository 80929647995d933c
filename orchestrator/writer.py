"""Batched store writes off the event loop.

Agent loops hand rows to `StoreWriter.put_*` (no waiting on disk); one long-lived loop in the
job's task group writes what has accumulated in a single transaction in a worker thread, at most
`max_delay_s` after the first pending row. Guarantees: rows are written in submission order per
table; `flush()` returns once everything submitted before it is committed; when `run` ends
(closing or cancellation) it writes whatever is pending, so no recorded data is lost when the
job shuts down. Memory is bounded: `put_*` waits when `max_pending` rows are queued.
"""

from __future__ import annotations

from typing import Any

import anyio
from anyio.abc import TaskStatus

from stalewise.store.store import Store


class StoreWriter:
    def __init__(self, store: Store, *, max_delay_s: float = 0.05, max_pending: int = 20_000) -> None:
        self.store = store
        self.max_delay_s = max_delay_s
        self.max_pending = max_pending
        self._model_calls: list[dict[str, Any]] = []
        self._tool_calls: list[dict[str, Any]] = []
        self._updates: list[tuple[int, dict[str, Any]]] = []
        self._wake = anyio.Event()
        self._urgent = anyio.Event()
        self._room = anyio.Condition()
        self._written = anyio.Condition()
        self._submitted = 0
        self._committed = 0
        self._closed = False
        self.rows_written = 0

    @property
    def pending(self) -> int:
        return len(self._model_calls) + len(self._tool_calls) + len(self._updates)

    async def _admit(self) -> None:
        if self._closed:
            raise RuntimeError("StoreWriter is closed")
        async with self._room:
            while self.pending >= self.max_pending:
                await self._room.wait()
        self._submitted += 1
        self._wake.set()

    async def put_model_call(self, row: dict[str, Any]) -> None:
        await self._admit()
        self._model_calls.append(row)

    async def put_tool_call(self, row: dict[str, Any]) -> None:
        await self._admit()
        self._tool_calls.append(row)

    async def put_trajectory_update(self, trajectory_id: int, values: dict[str, Any]) -> None:
        await self._admit()
        self._updates.append((trajectory_id, values))

    async def flush(self) -> None:
        target = self._submitted
        self._wake.set()
        self._urgent.set()
        async with self._written:
            while self._committed < target:
                await self._written.wait()

    async def _write_pending(self) -> None:
        model_calls, tool_calls, updates = self._model_calls, self._tool_calls, self._updates
        self._model_calls, self._tool_calls, self._updates = [], [], []
        target = self._submitted
        if model_calls or tool_calls or updates:
            await anyio.to_thread.run_sync(lambda: self.store.write_batch(
                model_calls=model_calls, tool_calls=tool_calls, trajectory_updates=updates))
            self.rows_written += len(model_calls) + len(tool_calls) + len(updates)
        self._committed = target
        async with self._room:
            self._room.notify_all()
        async with self._written:
            self._written.notify_all()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                with anyio.move_on_after(self.max_delay_s):
                    await self._urgent.wait()  # a flush() cuts the batching delay short
                self._urgent = anyio.Event()
                await self._write_pending()
        finally:
            self._closed = True
            with anyio.CancelScope(shield=True):
                await self._write_pending()
