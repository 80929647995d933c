"""The store writer batches rows, flushes on demand, and loses nothing on shutdown."""

from __future__ import annotations

import sqlite3
import time

import anyio
import numpy as np
import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from core.records import SampledTokens
from core.store.outage import Outage, StoreUnavailable, transient
from core.store.store import Store, model_call_row
from orchestrator.writer import StoreWriter, WriterStopped, running_writer


def _row(trajectory_id: int, turn: int) -> dict:
    tokens = SampledTokens([turn], [-0.5], [0], [0], [0.0])
    return model_call_row(trajectory_id=trajectory_id, turn=turn, segment=0, context_len=0,
                          prompt_token_ids=[1], tokens=tokens, sampling={}, engine_id="e",
                          finish_reason="stop", cached_prompt_tokens=0, started_at=time.time(),
                          finished_at=time.time())


def _store(url: str) -> tuple[Store, int]:
    store = Store.open(url, create=True)
    store.create_run("r", name="r", config={}, pipeline_mode="async")
    return store, store.create_trajectory("r", group_id=None, task_instance_id=None)


def test_flush_makes_rows_durable(sqlite_url):
    store, tid = _store(sqlite_url)

    async def main():
        writer = StoreWriter(store, max_delay_s=10.0)  # only flush() can write in time
        async with anyio.create_task_group() as tg:
            await tg.start(writer.run)
            for turn in range(5):
                await writer.put_model_call(_row(tid, turn))
            await writer.put_trajectory_update(tid, {"status": "completed", "num_turns": 5})
            await writer.flush()
            assert [c.turn for c in store.model_calls(tid)] == [0, 1, 2, 3, 4]
            assert store.trajectory(tid).status == "completed"
            tg.cancel_scope.cancel()

    anyio.run(main)
    store.close()


def test_pending_rows_are_written_on_cancel(sqlite_url):
    store, tid = _store(sqlite_url)

    async def main():
        writer = StoreWriter(store, max_delay_s=10.0)
        async with anyio.create_task_group() as tg:
            await tg.start(writer.run)
            for turn in range(300):
                await writer.put_model_call(_row(tid, turn))
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert len(store.model_calls(tid)) == 300
    store.close()


def test_backpressure_bounds_pending_rows(sqlite_url):
    store, tid = _store(sqlite_url)
    peak = 0

    async def main():
        nonlocal peak
        writer = StoreWriter(store, max_delay_s=0.001, max_pending=8)
        async with anyio.create_task_group() as tg:
            await tg.start(writer.run)
            for turn in range(100):
                await writer.put_model_call(_row(tid, turn))
                peak = max(peak, writer.pending)
            await writer.flush()
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert peak <= 8
    assert len(store.model_calls(tid)) == 100
    assert np.array_equal(store.model_calls(tid)[99].tokens.token_ids, [99])
    store.close()


def test_transact_runs_after_earlier_rows_and_a_failure_keeps_them(sqlite_url):
    from sqlalchemy import text

    store, tid = _store(sqlite_url)

    async def main():
        writer = StoreWriter(store, max_delay_s=10.0)
        async with anyio.create_task_group() as tg:
            await tg.start(writer.run)
            await writer.put_model_call(_row(tid, 0))
            seen = await writer.transact(lambda c: c.execute(text(
                "SELECT count(*) FROM model_calls WHERE trajectory_id = :t"), {"t": tid})
                .scalar_one(), urgent=True)
            assert seen == 1  # the row submitted before the work is visible to it
            await writer.put_model_call(_row(tid, 1))
            with pytest.raises(Exception, match="no such table"):
                await writer.transact(lambda c: c.execute(text("SELECT * FROM missing")),
                                      urgent=True)
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert [c.turn for c in store.model_calls(tid)] == [0, 1]  # the failed work lost no rows
    store.close()


def test_running_writer_outlives_a_body_cancelled_from_outside(sqlite_url):
    """`running_writer`: a cancellation from outside reaches the body, not the writer, so the
    body's shielded clean-up can still record rows; they are committed when the block ends."""
    store, tid = _store(sqlite_url)

    async def main():
        with anyio.CancelScope() as outside:
            async with running_writer(store, max_delay_s=10.0) as writer:
                try:
                    outside.cancel()
                    await anyio.sleep_forever()
                finally:
                    with anyio.CancelScope(shield=True):
                        await anyio.sleep(0.1)  # the writer's loop has seen the cancel
                        await writer.put_model_call(_row(tid, 0))
                        await writer.put_trajectory_update(tid, {"status": "aborted"})

    anyio.run(main)
    assert [c.turn for c in store.model_calls(tid)] == [0]
    assert store.trajectory(tid).status == "aborted"


def test_after_a_failed_write_every_submission_names_the_failure(sqlite_url):
    """A writer whose store write failed ends the block (the body is cancelled); shielded
    clean-up in the body that still submits rows, flushes or transactions gets `WriterStopped`
    naming the write's error, never a hang."""
    store, tid = _store(sqlite_url)
    refused = []

    async def main():
        async with running_writer(store, max_delay_s=0.0) as writer:
            try:
                await writer.put_model_call(_row(tid + 1000, 0))  # no such trajectory: FK error
                await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True):
                    for submit in (writer.flush, lambda: writer.put_model_call(_row(tid, 1)),
                                   lambda: writer.transact(lambda c: None)):
                        with pytest.raises(WriterStopped) as caught:
                            await submit()
                        refused.append(str(caught.value))

    with pytest.raises(BaseExceptionGroup) as group:
        anyio.run(main)
    assert group.value.subgroup(lambda e: "FOREIGN KEY" in str(e)) is not None
    assert len(refused) == 3 and all("has stopped: IntegrityError" in t for t in refused)


class _DiskFullFor:
    """The store, whose first `failures` batch writes fail as a full disk does (fake by
    injection: the real disk-full case is bench/soak.py's `disk_full` fault)."""

    def __init__(self, store: Store, failures: int) -> None:
        self.store, self.failures, self.tries = store, failures, 0

    def write_batch(self, **batch):
        self.tries += 1
        if self.tries <= self.failures:
            error = OperationalError("INSERT", {}, sqlite3.OperationalError(
                "database or disk is full"))
            raise StoreUnavailable(error, retry_safe=True)
        return self.store.write_batch(**batch)


def test_the_writer_rides_out_a_store_that_cannot_write_for_a_while(sqlite_url):
    store, tid = _store(sqlite_url)
    flaky = _DiskFullFor(store, failures=3)

    async def main():
        async with running_writer(flaky, max_delay_s=0.0, outage_s=60.0) as writer:
            await writer.put_model_call(_row(tid, 0))
            await writer.flush()

    anyio.run(main)
    assert flaky.tries == 4 and [c.turn for c in store.model_calls(tid)] == [0]


def test_an_outage_longer_than_outage_s_fails_the_writer_saying_why(sqlite_url):
    store, tid = _store(sqlite_url)
    flaky = _DiskFullFor(store, failures=10**6)

    async def main():
        async with running_writer(flaky, max_delay_s=0.0, outage_s=1.0) as writer:
            await writer.put_model_call(_row(tid, 0))
            await anyio.sleep_forever()

    with pytest.raises(BaseExceptionGroup) as group:
        anyio.run(main)
    assert group.value.subgroup(
        lambda e: "the store cannot write now: database or disk is full" in str(e)) is not None


def test_transient_store_errors_are_told_from_errors_a_retry_cannot_fix():
    def wrapped(error, kind=OperationalError, invalidated=False):
        return kind("SQL", {}, error, connection_invalidated=invalidated)

    assert transient(wrapped(sqlite3.OperationalError("database or disk is full")))
    assert transient(wrapped(sqlite3.OperationalError("database is locked")))
    assert not transient(wrapped(sqlite3.OperationalError("no such table: runs")))
    assert not transient(wrapped(sqlite3.IntegrityError("FOREIGN KEY constraint failed"),
                                 IntegrityError))
    assert transient(wrapped(RuntimeError("server closed the connection"), invalidated=True))
    assert not transient(ValueError("not a database error"))
    outage = Outage(10.0, clock=lambda: 0.0)
    with pytest.raises(StoreUnavailable):
        outage.failed(StoreUnavailable(wrapped(RuntimeError("lost")), retry_safe=False))
