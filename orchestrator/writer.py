"""Batched store writes off the event loop.

Agent loops hand rows to `StoreWriter.put_*` (no waiting on disk); one long-lived loop in the
job's task group writes what has accumulated in a single transaction in a worker thread, at most
`max_delay_s` after the first pending row. `transact(work)` runs `work(connection)` in that same
transaction, after the rows submitted before it, and returns its result: group creation and
admission decisions ride along with the calls they depend on instead of opening transactions
of their own.

Guarantees: rows are written in submission order per table, and before any `transact` work
submitted after them (so an admitted trajectory's calls are committed with or before its
stream entry); `flush()` returns once everything submitted before it is committed; when `run`
ends (closing or cancellation) it writes whatever is pending, so no recorded data is lost when
the job shuts down. Memory is bounded: `put_*` waits when `max_pending` rows are queued.
A store that cannot write for a while (disk full, PostgreSQL restarting) is tried again, with
backoff, for up to `outage_s`, while the rows wait in memory; then the writer fails.

Lifetime: `running_writer(store)` is the writer of a job. It outlives the body of its `async
with`: a cancellation from outside does not stop it; it stops when the body has ended (and with
it every task the body started and waited for), after writing what is pending. So nothing the
body submits ever meets a closed writer, as long as the writer itself has not failed; once it
has, every later submission raises `WriterStopped`, naming the failure.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, TypeVar

import anyio
from anyio.abc import TaskStatus

from core.log import get_logger
from core.store.outage import Outage, StoreUnavailable
from core.store.store import Connection, Store

T = TypeVar("T")
log = get_logger("stalewise.writer")


class WriterStopped(RuntimeError):
    """A row or a transaction was submitted after the writer stopped."""


class _Work:
    def __init__(self, work: Callable[[Connection], Any]) -> None:
        self.work = work
        self.done = anyio.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class StoreWriter:
    def __init__(self, store: Store, *, max_delay_s: float = 0.05, max_pending: int = 20_000,
                 outage_s: float = 120.0) -> None:
        self.store = store
        self.outage_s = outage_s
        self.max_delay_s = max_delay_s
        self.max_pending = max_pending
        self._model_calls: list[dict[str, Any]] = []
        self._tool_calls: list[dict[str, Any]] = []
        self._updates: list[tuple[int, dict[str, Any]]] = []
        self._work: list[_Work] = []
        self._wake = anyio.Event()
        self._urgent = anyio.Event()
        self._room = anyio.Condition()
        self._written = anyio.Condition()
        self._submitted = 0
        self._committed = 0
        self._closed = False
        self._stopping = False
        self._ended = False  # the last write is done (or failed): nothing more will commit
        self._failure: BaseException | None = None
        self.rows_written = 0
        self.transactions = 0

    @property
    def pending(self) -> int:
        return len(self._model_calls) + len(self._tool_calls) + len(self._updates)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            cause = f": {self._failure!r}" if self._failure is not None else ""
            raise WriterStopped(f"the store writer has stopped{cause}; nothing more can be "
                                "recorded in this run")

    async def _admit(self) -> None:
        self._refuse_if_closed()
        if self.pending >= self.max_pending:  # the lock only when full: puts are the hot path
            async with self._room:
                while self.pending >= self.max_pending:
                    self._refuse_if_ended()
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

    async def transact(self, work: Callable[[Connection], T], *, urgent: bool = False) -> T:
        """Run `work(connection)` in the next batch transaction, after everything submitted
        before it; returns its result (or raises its error). `urgent` skips the batching delay."""
        self._refuse_if_closed()
        item = _Work(work)
        self._work.append(item)
        self._submitted += 1
        self._wake.set()
        if urgent:
            self._urgent.set()
        await item.done.wait()
        if item.error is not None:
            raise item.error
        return item.result

    def _refuse_if_ended(self) -> None:
        if self._ended:
            self._refuse_if_closed()

    async def flush(self) -> None:
        """Return once everything submitted before this call is committed (`WriterStopped` if
        the writer stopped before it could be)."""
        target = self._submitted
        self._wake.set()
        self._urgent.set()
        async with self._written:
            while self._committed < target:
                self._refuse_if_ended()
                await self._written.wait()

    async def _write_pending(self) -> None:
        model_calls, tool_calls, updates = self._model_calls, self._tool_calls, self._updates
        work = self._work
        self._model_calls, self._tool_calls, self._updates, self._work = [], [], [], []
        target = self._submitted
        try:
            if model_calls or tool_calls or updates or work:
                results = await self._riding_out_outages(lambda: self.store.write_batch(
                    model_calls=model_calls, tool_calls=tool_calls, trajectory_updates=updates,
                    then=[item.work for item in work]))
                self.transactions += 1
                self.rows_written += len(model_calls) + len(tool_calls) + len(updates)
                for item, result in zip(work, results):
                    item.result = result
        except Exception as exc:
            if not work or isinstance(exc, StoreUnavailable):
                raise
            # The work broke the transaction: keep the rows (write them alone; if even that
            # fails the job fails), and hand the error to the work's callers.
            for item in work:
                item.error = exc
            await self._riding_out_outages(lambda: self.store.write_batch(
                model_calls=model_calls, tool_calls=tool_calls, trajectory_updates=updates))
            self.rows_written += len(model_calls) + len(tool_calls) + len(updates)
        finally:
            for item in work:
                item.done.set()
        if self._failure is None:  # after a failed write nothing counts as committed
            self._committed = target
        async with self._room:
            self._room.notify_all()
        async with self._written:
            self._written.notify_all()

    async def _riding_out_outages(self, write: Callable[[], T]) -> T:
        """`write()` in a worker thread, tried again while the store is briefly unavailable
        (`core.store.outage`) for up to `outage_s`; the rows wait in memory meanwhile
        (and `put_*` waits once `max_pending` are queued)."""
        outage = Outage(self.outage_s)
        while True:
            try:
                result = await anyio.to_thread.run_sync(write)
            except StoreUnavailable as exc:
                first = not outage.started
                delay = outage.failed(exc)
                if first:
                    log.warning("the store cannot write; the rows wait in memory and the write "
                                "is tried again", error=str(exc), for_up_to_s=self.outage_s)
                await anyio.sleep(delay)
                continue
            lasted = outage.recovered()
            if lasted is not None:
                log.warning("the store writes again", outage_s=round(lasted, 1))
            return result

    def close(self) -> None:
        """Stop `run` once it has written what is pending (it ends by itself; not awaited)."""
        self._stopping = True
        self._wake.set()
        self._urgent.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Write batches until `close()` or cancellation, then what is still pending."""
        task_status.started()
        try:
            while not self._stopping:
                await self._wake.wait()
                self._wake = anyio.Event()
                with anyio.move_on_after(self.max_delay_s):
                    await self._urgent.wait()  # a flush() or close() cuts the delay short
                self._urgent = anyio.Event()
                await self._write_pending()
        except Exception as exc:
            self._failure = exc
            raise
        finally:
            self._closed = True
            with anyio.CancelScope(shield=True):
                try:
                    await self._write_pending()
                finally:
                    self._ended = True
                    for waiters in (self._room, self._written):
                        async with waiters:
                            waiters.notify_all()

    async def _run_shielded(self, *,
                            task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.CancelScope(shield=True):  # it ends by close(), after the body
            await self.run(task_status=task_status)


@asynccontextmanager
async def running_writer(store: Store, **options: Any) -> AsyncIterator[StoreWriter]:
    """A `StoreWriter` running for the body of the `async with`, and until the body has ended
    (module docstring). A write in progress is never abandoned: the store's own timeouts
    (SQLite's busy timeout, PostgreSQL's connection and statement timeouts) bound it."""
    writer = StoreWriter(store, **options)
    async with anyio.create_task_group() as tg:
        await tg.start(writer._run_shielded)
        try:
            yield writer
        finally:
            writer.close()
