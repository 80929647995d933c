"""The trajectory store: typed, synchronous writes and reads over SQLAlchemy Core.

Guarantees:
- every write method is one transaction (on SQLite it takes the write lock up front);
- `admit` inserts the decision row and the learner-stream entry in one transaction, with a
  sequence number drawn atomically from `runs.stream_head`: admitted trajectories are numbered
  1, 2, 3, ... with no gap and no repeat, whatever the number of concurrent writers;
- `insert_model_calls` checks that every per-token array of a call has the same length.

Async callers run these methods in a worker thread (`anyio.to_thread.run_sync`); the orchestrator
batches its writes through `StoreWriter` so that the event loop never waits on the disk.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import socket
import time
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from sqlalchemy import Connection, Engine, bindparam, func, insert, select, update
from sqlalchemy.exc import DBAPIError

from core.evaluation import Evaluation
from core.records import FLOAT32, INT32, SampledTokens, pack, unpack
from core.store import schema as s
from core.store.db import DEFAULT_URL, normalize_url, open_readonly_engine, open_store_engine
from core.store.outage import StoreUnavailable, transient


def now() -> float:
    return time.time()


def evaluation_values(evaluation: Evaluation) -> dict[str, Any]:
    return {**asdict(evaluation), "failures": dict(evaluation.failures)}


def model_call_row(*, trajectory_id: int, turn: int, segment: int, context_len: int,
                   prompt_token_ids: Sequence[int] | np.ndarray, tokens: SampledTokens,
                   sampling: dict[str, Any] | str, engine_id: str, finish_reason: str,
                   cached_prompt_tokens: int, started_at: float, finished_at: float
                   ) -> dict[str, Any]:
    """One `model_calls` row. `sampling` is the request's sampling parameters, as a dict or
    already encoded as JSON."""
    return dict(
        trajectory_id=trajectory_id, turn=turn, segment=segment, context_len=context_len,
        num_tokens=len(tokens),
        prompt_token_ids=pack(prompt_token_ids, INT32),
        token_ids=tokens.token_ids.tobytes(),
        sampler_logprobs=tokens.sampler_logprobs.tobytes(),
        weights_versions=tokens.weights_versions.tobytes(),
        kv_versions=tokens.kv_versions.tobytes(),
        time_offsets=tokens.time_offsets.tobytes(),
        topk=tokens.topk,
        topk_ids=None if tokens.topk_ids is None else tokens.topk_ids.tobytes(),
        topk_logprobs=None if tokens.topk_logprobs is None else tokens.topk_logprobs.tobytes(),
        sampling=sampling, engine_id=engine_id, finish_reason=finish_reason,
        cached_prompt_tokens=cached_prompt_tokens, started_at=started_at, finished_at=finished_at,
    )


@dataclass(frozen=True)
class StoredModelCall:
    """A decoded `model_calls` row."""

    id: int
    trajectory_id: int
    turn: int
    segment: int
    context_len: int
    prompt_token_ids: np.ndarray
    tokens: SampledTokens
    sampling: dict[str, Any]
    engine_id: str
    finish_reason: str
    cached_prompt_tokens: int
    started_at: float
    finished_at: float


def decode_model_call(row: Any) -> StoredModelCall:
    k = row.topk
    tokens = SampledTokens(
        token_ids=unpack(row.token_ids, INT32),
        sampler_logprobs=unpack(row.sampler_logprobs, FLOAT32),
        weights_versions=unpack(row.weights_versions, INT32),
        kv_versions=unpack(row.kv_versions, INT32),
        time_offsets=unpack(row.time_offsets, FLOAT32),
        topk_ids=unpack(row.topk_ids, INT32, k) if k else None,
        topk_logprobs=unpack(row.topk_logprobs, FLOAT32, k) if k else None,
    )
    return StoredModelCall(
        id=row.id, trajectory_id=row.trajectory_id, turn=row.turn, segment=row.segment,
        context_len=row.context_len, prompt_token_ids=unpack(row.prompt_token_ids, INT32),
        tokens=tokens, sampling=row.sampling,
        engine_id=row.engine_id, finish_reason=row.finish_reason,
        cached_prompt_tokens=row.cached_prompt_tokens, started_at=row.started_at,
        finished_at=row.finished_at,
    )


class _RawInsert:
    """The INSERT of one table's rows as the DB-API's own `executemany` of tuples, with no
    per-row work by SQLAlchemy (the hot path: thousands of rows per second; on SQLite,
    SQLAlchemy's parameter processing was half of the writer's CPU). Rows are dicts with every
    column but `id`, except that a column with a scalar default or a nullable one may be left
    out (its default, or NULL); extra keys are ignored, and a missing required column is a
    KeyError naming it. Values must already be driver-ready (bytes, numbers, text), except the
    `json_columns`, which may also be dicts and are encoded here. Executed on a SQLAlchemy
    connection, so errors are still SQLAlchemy's (`DBAPIError`, which `outage.transient`
    reads) and the transaction is the caller's."""

    def __init__(self, table: Any, json_columns: Sequence[str] = ()) -> None:
        self.table = table.name
        self.columns = tuple(c.name for c in table.columns if c.name != "id")
        self._values = operator.itemgetter(*self.columns)
        self._optional = {c.name: c.default.arg if c.default is not None and c.default.is_scalar
                          else None for c in table.columns
                          if c.name != "id" and (c.nullable or (c.default is not None
                                                                 and c.default.is_scalar))}
        self._json_at = tuple(self.columns.index(c) for c in json_columns)
        self._statements: dict[str, str] = {}

    def statement(self, paramstyle: str) -> str:
        """The INSERT in the driver's placeholder style (`?` for sqlite3, `%s` for psycopg)."""
        if paramstyle not in self._statements:
            marker = {"qmark": "?", "format": "%s", "pyformat": "%s"}[paramstyle]
            names = ", ".join(f'"{c}"' for c in self.columns)
            self._statements[paramstyle] = (f"INSERT INTO {self.table} ({names}) "
                                            f"VALUES ({', '.join([marker] * len(self.columns))})")
        return self._statements[paramstyle]

    def _row(self, row: dict[str, Any]) -> tuple[Any, ...]:
        try:
            return self._values(row)  # the hot path: every column given
        except KeyError:
            missing = [c for c in self.columns if c not in row and c not in self._optional]
            if missing:
                raise KeyError(f"{self.table} row lacks {', '.join(missing)}") from None
            return tuple(row[c] if c in row else self._optional[c] for c in self.columns)

    def values(self, rows: Sequence[dict[str, Any]]) -> list[tuple[Any, ...]]:
        out = [self._row(row) for row in rows]
        for at in self._json_at:
            for i, values in enumerate(out):
                value = values[at]
                if value is not None and not isinstance(value, str):
                    out[i] = values[:at] + (json.dumps(value),) + values[at + 1:]
        return out

    def execute(self, c: Connection, rows: Sequence[dict[str, Any]]) -> None:
        if rows:
            c.exec_driver_sql(self.statement(c.dialect.paramstyle), self.values(rows))


_INSERT_MODEL_CALLS = _RawInsert(s.ModelCall.__table__, json_columns=("sampling",))
_INSERT_TOOL_CALLS = _RawInsert(s.ToolCall.__table__)
_INSERT_DECISIONS = _RawInsert(s.AdmissionDecision.__table__, json_columns=("details",))
_INSERT_STREAM = _RawInsert(s.StreamEntry.__table__)

# The statements a dispatch and an admission run, built once, with the decisions and stream
# entries on the raw insert path: building a statement per call (and SQLAlchemy's cache key for
# it) cost more than running it. On SQLite a group's creation took 0.63 ms against 0.30, a
# group of 8 decisions 0.54 ms against 0.20 (side by side, Intel Xeon @ 2.80GHz).
_TASKS, _GROUPS, _TRAJECTORIES, _RUNS = (s.TaskInstance.__table__, s.Group.__table__,
                                         s.Trajectory.__table__, s.Run.__table__)
_FIND_INSTANCE = select(_TASKS.c.id).where(
    (_TASKS.c.run_id == bindparam("run_id")) & (_TASKS.c.family == bindparam("family"))
    & (_TASKS.c.key == bindparam("key")))
_INSERT_INSTANCE = insert(_TASKS)
_INSERT_GROUP = insert(_GROUPS)
_INSERT_MEMBERS = insert(_TRAJECTORIES).returning(_TRAJECTORIES.c.id,
                                                  sort_by_parameter_order=True)
_CLOSE_GROUP = (update(_GROUPS).where(_GROUPS.c.id == bindparam("_id"))
                .values(status=bindparam("status"), completed_at=bindparam("completed_at")))
_ADVANCE_STREAM = (update(_RUNS).where(_RUNS.c.id == bindparam("_id"))
                   .values(stream_head=_RUNS.c.stream_head + bindparam("_count"))
                   .returning(_RUNS.c.stream_head))


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


class Store:
    """All reads and writes of one database. Thread-safe (one connection per call)."""

    def __init__(self, engine: Engine, url: str = DEFAULT_URL) -> None:
        self.engine = engine
        self.url = url

    @classmethod
    def open(cls, url: str = DEFAULT_URL, *, create: bool = False) -> "Store":
        url = normalize_url(url)
        return cls(open_store_engine(url, create=create), url)

    @classmethod
    def open_readonly(cls, url: str = DEFAULT_URL) -> "Store":
        """A store whose every write fails (the database refuses it): for viewers."""
        url = normalize_url(url)
        return cls(open_readonly_engine(url), url)

    def close(self) -> None:
        self.engine.dispose()

    # ---------------------------------------------------------------- runs
    def create_run(self, run_id: str, *, name: str, config: dict[str, Any],
                   pipeline_mode: str) -> None:
        with self.engine.begin() as c:
            c.execute(insert(s.Run.__table__).values(
                id=run_id, name=name, status="running", pipeline_mode=pipeline_mode,
                config=config, config_hash=config_hash(config), created_at=now(),
                host=socket.gethostname(), pid=os.getpid(), stream_head=0))

    def close_in_flight(self, run_id: str, *, reason: str) -> dict[str, int]:
        """After its orchestrator died, in one transaction: the run's trajectories still queued
        or running become `aborted` with `reason`, its open groups `aborted` (members already
        admitted stay in the append-only learner stream), its live sandbox rows `orphaned`."""
        stamp = now()
        t, g, sb = s.Trajectory.__table__, s.Group.__table__, s.SandboxRow.__table__
        with self.engine.begin() as c:
            aborted = c.execute(update(t).where(t.c.run_id == run_id,
                                                t.c.status.in_(("queued", "running")))
                                .values(status="aborted", error=reason,
                                        finished_at=stamp)).rowcount
            groups = c.execute(update(g).where(g.c.run_id == run_id, g.c.status == "open")
                               .values(status="aborted", completed_at=stamp)).rowcount
            c.execute(update(sb).where(sb.c.run_id == run_id, sb.c.status == "live")
                      .values(status="orphaned", released_at=stamp))
        return {"aborted_trajectories": aborted, "aborted_groups": groups}

    def set_run_status(self, run_id: str, status: str, *, error: str | None = None,
                       summary: dict[str, Any] | None = None, pid: int | None = None,
                       host: str | None = None) -> None:
        values: dict[str, Any] = {"status": status}
        if status in ("finished", "failed", "aborted"):
            values["finished_at"] = now()
        if error is not None:
            values["error"] = error
        if summary is not None:
            values["summary"] = summary
        if pid is not None:
            values["pid"] = pid
        if host is not None:
            values["host"] = host
        with self.engine.begin() as c:
            c.execute(update(s.Run.__table__).where(s.Run.id == run_id).values(**values))

    def run(self, run_id: str) -> Any | None:
        with self.engine.connect() as c:
            return c.execute(select(s.Run.__table__).where(s.Run.id == run_id)).first()

    def runs(self, limit: int = 50) -> list[Any]:
        with self.engine.connect() as c:
            return list(c.execute(select(s.Run.__table__)
                                  .order_by(s.Run.created_at.desc()).limit(limit)))

    def run_is_finished(self, run_id: str) -> bool:
        """Nothing more will come from this run here: it ended, or this store never saw it
        (the learner's question). Not a test of who owns a container (sandboxes.labels)."""
        row = self.run(run_id)
        return row is None or row.status != "running"

    # ---------------------------------------------------------------- tasks and groups
    def task_instance_id(self, run_id: str, *, family: str, key: str, content_hash: str,
                         difficulty: str = "", prompt: str = "",
                         meta: dict[str, Any] | None = None) -> int:
        """Get or create the row of a task instance (unique per run, family and key)."""
        table = s.TaskInstance.__table__
        where = (table.c.run_id == run_id) & (table.c.family == family) & (table.c.key == key)
        with self.engine.begin() as c:
            existing = c.execute(select(table.c.id).where(where)).scalar()
            if existing is not None:
                return existing
            return c.execute(insert(table).values(
                run_id=run_id, family=family, key=key, content_hash=content_hash,
                difficulty=difficulty, prompt=prompt, meta=meta)).inserted_primary_key[0]

    def create_group(self, run_id: str, task_instance_id: int, *, size: int,
                     dispatch_version: int) -> int:
        with self.engine.begin() as c:
            return c.execute(insert(s.Group.__table__).values(
                run_id=run_id, task_instance_id=task_instance_id, size=size, status="open",
                dispatch_version=dispatch_version, created_at=now())).inserted_primary_key[0]

    @staticmethod
    def create_group_in(c: Connection, run_id: str, *, family: str, key: str, content_hash: str,
                        difficulty: str, prompt: str, size: int,
                        dispatch_version: int) -> tuple[int, int, list[int]]:
        stamp = now()
        instance = c.execute(_FIND_INSTANCE, dict(run_id=run_id, family=family, key=key)).scalar()
        if instance is None:
            instance = c.execute(_INSERT_INSTANCE, dict(
                run_id=run_id, family=family, key=key, content_hash=content_hash,
                difficulty=difficulty, prompt=prompt)).inserted_primary_key[0]
        group = c.execute(_INSERT_GROUP, dict(
            run_id=run_id, task_instance_id=instance, size=size, status="open",
            dispatch_version=dispatch_version, created_at=stamp)).inserted_primary_key[0]
        rows = [dict(run_id=run_id, group_id=group, task_instance_id=instance, sample_index=i,
                     attempt=0, status="queued", queued_at=stamp,
                     dispatch_version=dispatch_version, purpose="train") for i in range(size)]
        ids = c.execute(_INSERT_MEMBERS, rows).scalars().all()
        return instance, group, list(ids)

    def count_groups(self, run_id: str) -> int:
        return self.count(s.Group, run_id=run_id)

    # ---------------------------------------------------------------- trajectories
    def create_trajectory(self, run_id: str, **kw: Any) -> int:
        with self.engine.begin() as c:
            return self.create_trajectory_in(c, run_id, **kw)

    @staticmethod
    def create_trajectory_in(c: Connection, run_id: str, *, group_id: int | None,
                             task_instance_id: int | None, sample_index: int = 0,
                             attempt: int = 0, dispatch_version: int = 0,
                             status: str = "queued", purpose: str = "train") -> int:
        return c.execute(insert(s.Trajectory.__table__).values(
            run_id=run_id, group_id=group_id, task_instance_id=task_instance_id,
            sample_index=sample_index, attempt=attempt, status=status, queued_at=now(),
            dispatch_version=dispatch_version, purpose=purpose)).inserted_primary_key[0]

    def update_trajectory(self, trajectory_id: int, **values: Any) -> None:
        with self.engine.begin() as c:
            c.execute(update(s.Trajectory.__table__)
                      .where(s.Trajectory.id == trajectory_id).values(**values))

    def insert_trajectories(self, rows: Sequence[dict[str, Any]]) -> None:
        """Bulk insert of complete trajectory rows with explicit ids (tools, benchmarks)."""
        with self.engine.begin() as c:
            c.execute(insert(s.Trajectory.__table__), list(rows))

    def trajectory(self, trajectory_id: int) -> Any | None:
        with self.engine.connect() as c:
            return c.execute(select(s.Trajectory.__table__)
                             .where(s.Trajectory.id == trajectory_id)).first()

    # ---------------------------------------------------------------- model and tool calls
    def insert_model_calls(self, rows: Sequence[dict[str, Any]]) -> None:
        self.write_batch(model_calls=rows)

    def insert_tool_calls(self, rows: Sequence[dict[str, Any]]) -> None:
        self.write_batch(tool_calls=rows)

    def write_batch(self, *, model_calls: Sequence[dict[str, Any]] = (),
                    tool_calls: Sequence[dict[str, Any]] = (),
                    trajectory_updates: Iterable[tuple[int, dict[str, Any]]] = (),
                    then: Sequence[Callable[[Connection], Any]] = ()) -> list[Any]:
        """Model calls, tool calls, trajectory updates, then the `then` callables (in order), all
        in one transaction; returns the callables' results. Model-call and tool-call rows (from
        `model_call_row` and the recorder) take the raw insert path. A transient failure (disk
        full, server gone: `outage.transient`) raises `StoreUnavailable`, saying whether the
        transaction can be retried."""
        body_done = False
        try:
            with self.engine.begin() as c:
                self._write_rows(c, model_calls, tool_calls, trajectory_updates)
                results = [work(c) for work in then]
                body_done = True
        except DBAPIError as exc:
            if not transient(exc):
                raise
            sqlite = self.engine.dialect.name == "sqlite"  # a failed COMMIT there is rolled back
            raise StoreUnavailable(exc, retry_safe=not body_done or sqlite) from exc
        return results

    @staticmethod
    def _write_rows(c: Connection, model_calls: Sequence[dict[str, Any]],
                    tool_calls: Sequence[dict[str, Any]],
                    trajectory_updates: Iterable[tuple[int, dict[str, Any]]]) -> None:
        _INSERT_MODEL_CALLS.execute(c, model_calls)
        _INSERT_TOOL_CALLS.execute(c, tool_calls)
        # One executemany per set of updated columns (updates to a trajectory keep their order:
        # a later update of the same columns comes later in its group, and the outcome's
        # columns are a superset of the status-only update).
        by_columns: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for trajectory_id, values in trajectory_updates:
            by_columns.setdefault(tuple(sorted(values)), []).append(
                {"_id": trajectory_id, **values})
        table = s.Trajectory.__table__
        for columns, rows in sorted(by_columns.items(), key=lambda item: len(item[0])):
            statement = (update(table).where(table.c.id == bindparam("_id"))
                         .values({name: bindparam(name) for name in columns}))
            c.execute(statement, rows)

    def model_calls(self, trajectory_id: int) -> list[StoredModelCall]:
        table = s.ModelCall.__table__
        with self.engine.connect() as c:
            rows = c.execute(select(table).where(table.c.trajectory_id == trajectory_id)
                             .order_by(table.c.segment, table.c.turn, table.c.id))
            return [decode_model_call(r) for r in rows]

    def model_calls_for(self, trajectory_ids: Sequence[int]) -> dict[int, list[StoredModelCall]]:
        """Decoded model calls of several trajectories, each list in (segment, turn) order."""
        table = s.ModelCall.__table__
        out: dict[int, list[StoredModelCall]] = {tid: [] for tid in trajectory_ids}
        with self.engine.connect() as c:
            rows = c.execute(select(table).where(table.c.trajectory_id.in_(list(trajectory_ids)))
                             .order_by(table.c.trajectory_id, table.c.segment, table.c.turn,
                                       table.c.id))
            for row in rows:
                out[row.trajectory_id].append(decode_model_call(row))
        return out

    def turn_rewards_for(self, trajectory_ids: Sequence[int]) -> dict[int, dict[int, float]]:
        """{trajectory id: {turn: the sum of its tool calls' rewards}}, for the turns whose calls
        granted one (`ToolResult.reward`); a trajectory without any maps to {}."""
        table = s.ToolCall.__table__
        out: dict[int, dict[int, float]] = {tid: {} for tid in trajectory_ids}
        with self.engine.connect() as c:
            rows = c.execute(select(table.c.trajectory_id, table.c.turn,
                                    func.sum(table.c.reward)).where(
                table.c.trajectory_id.in_(list(trajectory_ids)) & table.c.reward.is_not(None))
                .group_by(table.c.trajectory_id, table.c.turn))
            for trajectory_id, turn, total in rows:
                out[trajectory_id][int(turn)] = float(total)
        return out

    def stream_peers(self, run_id: str, group_ids: Sequence[int],
                     exclude_seqs: Sequence[int]) -> list[tuple[int, float]]:
        """(group_id, reward) of admitted members of these groups outside `exclude_seqs`."""
        table = s.StreamEntry.__table__
        with self.engine.connect() as c:
            rows = c.execute(select(table.c.group_id, table.c.reward, table.c.seq).where(
                (table.c.run_id == run_id) & table.c.group_id.in_(list(group_ids))))
            excluded = set(exclude_seqs)
            return [(r.group_id, r.reward) for r in rows if r.seq not in excluded]

    def record_learner_step_and_version(self, run_id: str, step: dict[str, Any],
                                        version: dict[str, Any] | None) -> None:
        """A learner step row and, when it published, its version row, in one transaction."""
        with self.engine.begin() as c:
            c.execute(insert(s.LearnerStep.__table__).values(run_id=run_id, **step))
            if version is not None:
                c.execute(insert(s.PolicyVersion.__table__).values(
                    run_id=run_id, created_at=now(), **version))

    def forget_learner_steps_after(self, run_id: str, step: int) -> int:
        """Delete step rows beyond the last published checkpoint (undone by a learner crash)."""
        table = s.LearnerStep.__table__
        with self.engine.begin() as c:
            return c.execute(table.delete().where((table.c.run_id == run_id)
                                                  & (table.c.step > step))).rowcount

    def tool_calls(self, trajectory_id: int) -> list[Any]:
        table = s.ToolCall.__table__
        with self.engine.connect() as c:
            return list(c.execute(select(table).where(table.c.trajectory_id == trajectory_id)
                                  .order_by(table.c.turn, table.c.index)))

    # ---------------------------------------------------------------- admission and stream
    def record_decision(self, run_id: str, *, decision: str, reason: str, learner_version: int,
                        trajectory_id: int | None = None, group_id: int | None = None,
                        lag: int | None = None, details: dict[str, Any] | None = None) -> None:
        """A non-admitting decision (drop, requeue, mask without admission)."""
        with self.engine.begin() as c:
            c.execute(insert(s.AdmissionDecision.__table__).values(
                run_id=run_id, trajectory_id=trajectory_id, group_id=group_id,
                decision=decision, reason=reason, learner_version=learner_version, lag=lag,
                details=details, created_at=now()))

    def admit(self, run_id: str, trajectory_id: int, *, reason: str, learner_version: int,
              reward: float = 0.0, group_id: int | None = None, lag: int | None = None,
              loss_masked: bool = False, details: dict[str, Any] | None = None) -> int:
        """Admit one trajectory to the learner stream; returns its sequence number."""
        return self.decide(run_id, [dict(trajectory_id=trajectory_id, group_id=group_id,
                                         action="mask" if loss_masked else "admit",
                                         reason=reason, lag=lag, reward=reward,
                                         details=details)],
                           learner_version=learner_version)[0]

    def decide(self, run_id: str, decisions: Sequence[dict[str, Any]], *,
               learner_version: int, group_id: int | None = None,
               group_status: str | None = None) -> list[int]:
        """Store a batch of decisions (e.g. a whole group's) in one transaction.

        Each item: trajectory_id, group_id, action (admit|mask|drop|requeue), reason, lag,
        reward, details, and optionally weight (the selection-bias weight, default 1). `admit`
        and `mask` items also enter the learner stream (masked ones for group statistics only)
        with contiguous sequence numbers, returned in order.
        `group_status`, when given, closes the group in the same transaction.
        """
        with self.engine.begin() as c:
            return self.decide_in(c, run_id, decisions, learner_version=learner_version,
                                  group_id=group_id, group_status=group_status)

    @staticmethod
    def decide_in(c: Connection, run_id: str, decisions: Sequence[dict[str, Any]], *,
                  learner_version: int, group_id: int | None = None,
                  group_status: str | None = None) -> list[int]:
        stamp = now()
        if group_status is not None and group_id is not None:
            c.execute(_CLOSE_GROUP, dict(_id=group_id, status=group_status, completed_at=stamp))
        if not decisions:
            return []
        streamed = [d for d in decisions if d["action"] in ("admit", "mask")]
        _INSERT_DECISIONS.execute(c, [dict(
            run_id=run_id, trajectory_id=d["trajectory_id"], group_id=d.get("group_id"),
            decision=d["action"], reason=d["reason"], learner_version=learner_version,
            lag=d.get("lag"), details=d.get("details"), created_at=stamp) for d in decisions])
        if not streamed:
            return []
        head = c.execute(_ADVANCE_STREAM, dict(_id=run_id, _count=len(streamed))).scalar_one()
        first = head - len(streamed) + 1
        _INSERT_STREAM.execute(c, [dict(
            run_id=run_id, seq=first + i, trajectory_id=d["trajectory_id"],
            group_id=d.get("group_id"), reward=float(d["reward"]),
            loss_masked=d["action"] == "mask", admitted_at=stamp,
            weight=float(d.get("weight", 1.0))) for i, d in enumerate(streamed)])
        return list(range(first, head + 1))

    def stream_after(self, run_id: str, after_seq: int, limit: int = 1000) -> list[Any]:
        table = s.StreamEntry.__table__
        with self.engine.connect() as c:
            return list(c.execute(select(table).where(
                (table.c.run_id == run_id) & (table.c.seq > after_seq))
                .order_by(table.c.seq).limit(limit)))

    def stream_head(self, run_id: str) -> int:
        row = self.run(run_id)
        return 0 if row is None else row.stream_head

    # ---------------------------------------------------------------- learner side
    def publish_version(self, run_id: str, version: int, path: str, *,
                        learner_step: int | None = None, last_seq: int | None = None) -> None:
        """Mark a checkpoint as published; call only after it is completely on disk."""
        with self.engine.begin() as c:
            c.execute(insert(s.PolicyVersion.__table__).values(
                run_id=run_id, version=version, path=path, learner_step=learner_step,
                last_seq=last_seq, created_at=now()))

    def latest_version(self, run_id: str) -> Any | None:
        table = s.PolicyVersion.__table__
        with self.engine.connect() as c:
            return c.execute(select(table).where(table.c.run_id == run_id)
                             .order_by(table.c.version.desc()).limit(1)).first()

    def learner_progress(self, run_id: str) -> tuple[int, str | None, int, int]:
        """(latest published version, its path, learner steps done, last consumed seq)."""
        versions, steps = s.PolicyVersion.__table__, s.LearnerStep.__table__
        with self.engine.connect() as c:
            latest = c.execute(select(versions.c.version, versions.c.path)
                               .where(versions.c.run_id == run_id)
                               .order_by(versions.c.version.desc()).limit(1)).first()
            done = c.execute(select(func.count(), func.max(steps.c.last_seq))
                             .where(steps.c.run_id == run_id)).first()
        version, path = (latest.version, latest.path) if latest else (0, None)
        return version, path, int(done[0] or 0), int(done[1] or 0)

    def learner_steps(self, run_id: str) -> list[Any]:
        table = s.LearnerStep.__table__
        with self.engine.connect() as c:
            return list(c.execute(select(table).where(table.c.run_id == run_id)
                                  .order_by(table.c.step)))

    # ---------------------------------------------------------------- evaluations
    def record_evaluation(self, run_id: str, evaluation: Evaluation) -> None:
        with self.engine.begin() as c:
            c.execute(insert(s.EvaluationRow.__table__).values(
                run_id=run_id, created_at=now(), **evaluation_values(evaluation)))

    def evaluations(self, run_id: str) -> list[Evaluation]:
        """The run's evaluations in the order they were recorded."""
        table = s.EvaluationRow.__table__
        fields = [f.name for f in dataclass_fields(Evaluation)]
        with self.engine.connect() as c:
            rows = c.execute(select(*(table.c[name] for name in fields))
                             .where(table.c.run_id == run_id).order_by(table.c.id))
            return [Evaluation(**r._mapping) for r in rows]

    # ---------------------------------------------------------------- trainer log-probs
    def insert_trainer_logprobs(self, run_id: str, rows: Sequence[dict[str, Any]]) -> None:
        """Rows of `trainer_logprobs` (model_call_id, learner_step, policy_version, num_tokens,
        logprobs as packed float32), in one transaction."""
        if not rows:
            return
        stamp = now()
        with self.engine.begin() as c:
            c.execute(insert(s.TrainerLogprobs.__table__),
                      [dict(run_id=run_id, created_at=stamp, **row) for row in rows])

    def count(self, model: type[s.Base], **where: Any) -> int:
        table = model.__table__
        clause = [table.c[k] == v for k, v in where.items()]
        with self.engine.connect() as c:
            return c.execute(select(func.count()).select_from(table).where(*clause)).scalar_one()
