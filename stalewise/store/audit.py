"""Read-only audit queries: runs, trajectories with filters, and one trajectory in full.

Every function returns plain dicts (JSON-ready), so the CLI can print them as tables or JSON and
scripts can use them directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from stalewise.store import schema as s
from stalewise.store.store import Store


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


def trajectories(store: Store, run_id: str, *, status: str | None = None,
                 min_lag: int | None = None, reward_below: float | None = None,
                 purpose: str | None = None, decision: str | None = None,
                 limit: int = 200) -> list[dict[str, Any]]:
    t, d, ti = s.Trajectory.__table__, s.AdmissionDecision.__table__, s.TaskInstance.__table__
    lag = (select(d.c.trajectory_id, func.max(d.c.lag).label("lag"),
                  func.max(d.c.decision).label("decision"))
           .where(d.c.run_id == run_id).group_by(d.c.trajectory_id).subquery())
    query = (select(t, lag.c.lag, lag.c.decision, ti.c.family, ti.c.key, ti.c.difficulty)
             .select_from(t.outerjoin(lag, lag.c.trajectory_id == t.c.id)
                          .outerjoin(ti, ti.c.id == t.c.task_instance_id))
             .where(t.c.run_id == run_id).order_by(t.c.id).limit(limit))
    if status is not None:
        query = query.where(t.c.status == status)
    if min_lag is not None:
        query = query.where(lag.c.lag >= min_lag)
    if reward_below is not None:
        query = query.where(t.c.reward < reward_below)
    if purpose is not None:
        query = query.where(t.c.purpose == purpose)
    if decision is not None:
        query = query.where(lag.c.decision == decision)
    with store.engine.connect() as c:
        return [dict(id=r.id, task=r.key, purpose=r.purpose,
                     difficulty=r.difficulty, group=r.group_id, sample=r.sample_index,
                     status=r.status, stop_reason=r.stop_reason, reward=r.reward,
                     turns=r.num_turns, tokens=r.num_sampled_tokens,
                     versions=[r.min_version, r.max_version], lag=r.lag, decision=r.decision,
                     duration_s=(r.finished_at - r.started_at)
                     if r.finished_at and r.started_at else None)
                for r in c.execute(query)]


def _token_decoder(store: Store, run_id: str, tokenizer_dir: str | None):
    """A function id -> text from the run's model directory, or None when there is none."""
    if tokenizer_dir is None:
        run = store.run(run_id)
        tokenizer_dir = ((run.config or {}).get("model") or {}).get("path") if run else None
    path = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir else None
    if path is None or not path.exists():
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return lambda token_id: tokenizer.decode([int(token_id)], skip_special_tokens=False)


def trajectory_detail(store: Store, trajectory_id: int, *,
                      tokenizer_dir: str | None = None) -> dict[str, Any] | None:
    row = store.trajectory(trajectory_id)
    if row is None:
        return None
    decode = _token_decoder(store, row.run_id, tokenizer_dir)
    calls, tools = store.model_calls(trajectory_id), store.tool_calls(trajectory_id)
    with store.engine.connect() as c:
        d = s.AdmissionDecision.__table__
        decisions = [dict(decision=r.decision, reason=r.reason, lag=r.lag,
                          learner_version=r.learner_version, details=r.details)
                     for r in c.execute(select(d).where(d.c.trajectory_id == trajectory_id)
                                        .order_by(d.c.id))]
    turns = []
    for call in calls:
        tok = call.tokens
        tokens = [dict(position=call.context_len + len(call.prompt_token_ids) + i,
                       id=int(tok.token_ids[i]),
                       text=decode(tok.token_ids[i]) if decode else None,
                       sampler_logprob=float(tok.sampler_logprobs[i]),
                       version=int(tok.weights_versions[i]), kv_version=int(tok.kv_versions[i]),
                       time_s=float(tok.time_offsets[i]), loss_mask=int(call.loss_mask[i]))
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
