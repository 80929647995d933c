"""Read-only audit queries: runs, trajectories with filters, and one trajectory in full.

Every function returns plain dicts (JSON-ready), so the CLI can print them as tables or JSON and
scripts can use them directly.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from sqlalchemy import func, select

from core.records import FLOAT32, unpack
from core.store import schema as s
from core.store.store import Store


def runs(store: Store, limit: int = 50) -> list[dict[str, Any]]:
    t, traj = s.Run.__table__, s.Trajectory.__table__
    counts = (select(traj.c.run_id, func.count().label("trajectories"),
                     func.avg(traj.c.reward).label("mean_reward"))
              .group_by(traj.c.run_id).subquery())
    query = (select(t.c.id, t.c.name, t.c.status, t.c.pipeline_mode, t.c.created_at,
                    t.c.finished_at, t.c.stream_head, counts.c.trajectories, counts.c.mean_reward)
             .select_from(t.outerjoin(counts, counts.c.run_id == t.c.id))
             .order_by(t.c.created_at.desc()).limit(limit))
    with store.engine.connect() as c:
        return [dict(id=r.id, name=r.name, status=r.status, mode=r.pipeline_mode,
                     created_at=r.created_at, finished_at=r.finished_at,
                     trajectories=r.trajectories or 0, admitted=r.stream_head,
                     mean_reward=r.mean_reward) for r in c.execute(query)]


# (column, metric key) of the learning curve: what an RL engineer checks first at each step
CURVE_METRICS = (
    ("reward", "reward/mean"), ("loss", "loss/policy"), ("kl_sampler", "loss/kl_sampler_k3"),
    ("lp_diff_mean", "loss/sampler_abs_diff_mean"), ("lp_diff_max", "loss/sampler_abs_diff_max"),
    ("clip_high", "loss/clip_frac_high"), ("clip_low", "loss/clip_frac_low"),
    ("is_ess", "loss/is_ess"), ("entropy", "loss/entropy"), ("grad_norm", "learner/grad_norm"),
)


def learner_steps(store: Store, run_id: str) -> list[dict[str, Any]]:
    """The learning curve: one dict per learner step with the curve's metrics, lag and time.

    A metric the step did not report (a step that trained nothing) is None."""
    rows = []
    for r in store.learner_steps(run_id):
        metrics = r.metrics or {}
        rows.append(dict(step=r.step, version=r.policy_version, samples=r.num_samples,
                         tokens=r.num_tokens, mean_lag=r.mean_lag, max_lag=r.max_lag,
                         **{name: metrics.get(key) for name, key in CURVE_METRICS},
                         seconds=r.finished_at - r.started_at))
    return rows


@dataclass(frozen=True)
class TrajectoryFilter:
    """The filters of `audit trajectories` and the viewer's table; None means no filter.

    `search` matches, ignoring case, the task's prompt or any of the trajectory's tool
    arguments and outputs."""

    status: str | None = None
    purpose: str | None = None
    decision: str | None = None
    min_lag: int | None = None
    reward_min: float | None = None
    reward_below: float | None = None
    task: str | None = None
    difficulty: str | None = None
    stop_reason: str | None = None
    search: str | None = None


SORT_KEYS = ("id", "reward", "lag", "tokens", "turns", "duration", "status")


def _filtered_trajectories(run_id: str, f: TrajectoryFilter):
    t, d, ti = s.Trajectory.__table__, s.AdmissionDecision.__table__, s.TaskInstance.__table__
    tc = s.ToolCall.__table__
    lag = (select(d.c.trajectory_id, func.max(d.c.lag).label("lag"),
                  func.max(d.c.decision).label("decision"))
           .where(d.c.run_id == run_id).group_by(d.c.trajectory_id).subquery())
    duration = (t.c.finished_at - t.c.started_at).label("duration")
    query = (select(t, lag.c.lag, lag.c.decision, ti.c.family, ti.c.key, ti.c.difficulty,
                    duration)
             .select_from(t.outerjoin(lag, lag.c.trajectory_id == t.c.id)
                          .outerjoin(ti, ti.c.id == t.c.task_instance_id))
             .where(t.c.run_id == run_id))
    equal = ((t.c.status, f.status), (t.c.purpose, f.purpose), (lag.c.decision, f.decision),
             (ti.c.key, f.task), (ti.c.difficulty, f.difficulty), (t.c.stop_reason, f.stop_reason))
    for column, value in equal:
        if value is not None:
            query = query.where(column == value)
    if f.min_lag is not None:
        query = query.where(lag.c.lag >= f.min_lag)
    if f.reward_min is not None:
        query = query.where(t.c.reward >= f.reward_min)
    if f.reward_below is not None:
        query = query.where(t.c.reward < f.reward_below)
    if f.search:
        pattern = f"%{f.search}%"
        in_tools = (select(tc.c.id).where(tc.c.trajectory_id == t.c.id)
                    .where(tc.c.observation.ilike(pattern) | tc.c.arguments.ilike(pattern))
                    .exists())
        query = query.where(ti.c.prompt.ilike(pattern) | in_tools)
    columns = dict(id=t.c.id, reward=t.c.reward, lag=lag.c.lag, tokens=t.c.num_sampled_tokens,
                   turns=t.c.num_turns, duration=duration, status=t.c.status)
    return query, columns


def trajectories(store: Store, run_id: str, *, status: str | None = None,
                 min_lag: int | None = None, reward_below: float | None = None,
                 purpose: str | None = None, decision: str | None = None,
                 limit: int = 200, where: TrajectoryFilter | None = None, sort: str = "id",
                 descending: bool = False, offset: int = 0) -> list[dict[str, Any]]:
    """A run's trajectories with their task, lag and admission decision. `where` carries every
    filter (the keyword filters are the CLI's short form); `sort` is one of SORT_KEYS."""
    if sort not in SORT_KEYS:
        raise ValueError(f"sort {sort!r} is not one of {', '.join(SORT_KEYS)}")
    f = where or TrajectoryFilter(status=status, min_lag=min_lag, reward_below=reward_below,
                                  purpose=purpose, decision=decision)
    query, columns = _filtered_trajectories(run_id, f)
    key = columns[sort].desc() if descending else columns[sort].asc()
    query = query.order_by(key.nulls_last(), columns["id"]).limit(limit).offset(offset)
    with store.engine.connect() as c:
        return [dict(id=r.id, task=r.key, purpose=r.purpose,
                     difficulty=r.difficulty, group=r.group_id, sample=r.sample_index,
                     status=r.status, stop_reason=r.stop_reason, reward=r.reward,
                     turns=r.num_turns, tokens=r.num_sampled_tokens,
                     versions=[r.min_version, r.max_version], lag=r.lag, decision=r.decision,
                     duration_s=(r.finished_at - r.started_at)
                     if r.finished_at and r.started_at else None)
                for r in c.execute(query)]


def count_trajectories(store: Store, run_id: str, where: TrajectoryFilter) -> int:
    query, _ = _filtered_trajectories(run_id, where)
    with store.engine.connect() as c:
        return c.execute(select(func.count()).select_from(query.subquery())).scalar_one()


def filter_choices(store: Store, run_id: str) -> dict[str, list[str]]:
    """The distinct values a run has for the table's choice filters (for drop-down menus)."""
    t, ti = s.Trajectory.__table__, s.TaskInstance.__table__
    d = s.AdmissionDecision.__table__
    queries = dict(
        status=select(t.c.status).where(t.c.run_id == run_id),
        purpose=select(t.c.purpose).where(t.c.run_id == run_id),
        stop_reason=select(t.c.stop_reason).where(t.c.run_id == run_id),
        decision=select(d.c.decision).where(d.c.run_id == run_id),
        difficulty=select(ti.c.difficulty).where(ti.c.run_id == run_id),
        task=select(ti.c.key).where(ti.c.run_id == run_id))
    with store.engine.connect() as c:
        return {name: sorted({v for v in c.execute(q.distinct()).scalars() if v is not None})
                for name, q in queries.items()}


def _tokenizer(store: Store, run_id: str, tokenizer_dir: str | None):
    """The run's tokenizer (from its model directory), or None when there is none."""
    if tokenizer_dir is None:
        run = store.run(run_id)
        tokenizer_dir = ((run.config or {}).get("model") or {}).get("path") if run else None
    path = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir else None
    if path is None or not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def token_decoder(store: Store, run_id: str,
                  tokenizer_dir: str | None) -> Callable[[int], str] | None:
    """A function id -> text from the run's model directory, or None when there is none."""
    tokenizer = _tokenizer(store, run_id, tokenizer_dir)
    if tokenizer is None:
        return None

    @functools.lru_cache(maxsize=1 << 18)  # a trajectory repeats ids; the top-k even more
    def decode(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return lambda token_id: decode(int(token_id))


def text_decoder(store: Store, run_id: str,
                 tokenizer_dir: str | None) -> Callable[[Sequence[int]], str] | None:
    """A function ids -> text (whole sequences decode multi-byte characters correctly)."""
    tokenizer = _tokenizer(store, run_id, tokenizer_dir)
    if tokenizer is None:
        return None
    return lambda ids: tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def trainer_logprobs(store: Store, model_call_ids: Sequence[int]) -> dict[int, np.ndarray]:
    """The learner's log-probs per model call (the latest row of each), float32 arrays with
    NaN where the token was not trained; calls the learner has not recorded are absent."""
    table = s.TrainerLogprobs.__table__
    out: dict[int, np.ndarray] = {}
    if not model_call_ids:
        return out
    with store.engine.connect() as c:
        rows = c.execute(select(table.c.model_call_id, table.c.logprobs)
                         .where(table.c.model_call_id.in_(list(model_call_ids)))
                         .order_by(table.c.id))
        for row in rows:
            out[row.model_call_id] = unpack(row.logprobs, FLOAT32)
    return out


def _optional(value: float) -> float | None:
    return None if math.isnan(value) else value


def trajectory_detail(store: Store, trajectory_id: int, *,
                      tokenizer_dir: str | None = None) -> dict[str, Any] | None:
    row = store.trajectory(trajectory_id)
    if row is None:
        return None
    decode = token_decoder(store, row.run_id, tokenizer_dir)
    calls, tools = store.model_calls(trajectory_id), store.tool_calls(trajectory_id)
    learner = trainer_logprobs(store, [call.id for call in calls])
    with store.engine.connect() as c:
        d = s.AdmissionDecision.__table__
        decisions = [dict(decision=r.decision, reason=r.reason, lag=r.lag,
                          learner_version=r.learner_version, details=r.details)
                     for r in c.execute(select(d).where(d.c.trajectory_id == trajectory_id)
                                        .order_by(d.c.id))]
    turns = []
    for call in calls:
        tok = call.tokens
        trained = learner.get(call.id, np.full(len(tok), np.nan, dtype=np.float32))
        tokens = [dict(position=call.context_len + len(call.prompt_token_ids) + i,
                       id=int(tok.token_ids[i]),
                       text=decode(tok.token_ids[i]) if decode else None,
                       sampler_logprob=float(tok.sampler_logprobs[i]),
                       version=int(tok.weights_versions[i]), kv_version=int(tok.kv_versions[i]),
                       time_s=float(tok.time_offsets[i]),
                       loss_mask=1,  # a call's tokens are all sampled (core.samples)
                       trainer_logprob=_optional(float(trained[i])),
                       log_ratio=_optional(float(trained[i] - tok.sampler_logprobs[i])))
                  for i in range(len(tok))]
        turns.append(dict(
            turn=call.turn, segment=call.segment, context_len=call.context_len,
            prompt_tokens=len(call.prompt_token_ids), cached_prompt_tokens=call.cached_prompt_tokens,
            prompt_text="".join(decode(i) for i in call.prompt_token_ids) if decode else None,
            finish_reason=call.finish_reason, engine_id=call.engine_id, sampling=call.sampling,
            duration_s=call.finished_at - call.started_at, topk=tok.topk, tokens=tokens,
            tool_calls=[dict(name=t.name, arguments=_json_or_text(t.arguments),
                             observation=t.observation, exit_code=t.exit_code,
                             error_type=t.error_type, timed_out=t.timed_out,
                             truncated=t.truncated, duration_s=t.duration_s)
                        for t in tools if t.turn == call.turn]))
    info = {k: getattr(row, k) for k in row._fields}
    return dict(trajectory=info, admission=decisions, turns=turns)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def trajectory_tasks(store: Store, run_id: str) -> list[dict[str, Any]]:
    """A run's trajectories with their task keys, in id order (for re-rendering them)."""
    t, ti = s.Trajectory.__table__, s.TaskInstance.__table__
    query = (select(t.c.id, t.c.status, ti.c.key)
             .select_from(t.outerjoin(ti, ti.c.id == t.c.task_instance_id))
             .where(t.c.run_id == run_id).order_by(t.c.id))
    with store.engine.connect() as c:
        return [dict(id=r.id, status=r.status, task=r.key) for r in c.execute(query)]
