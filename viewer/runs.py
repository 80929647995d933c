"""The runs list (`/`) and a run's dashboard (`/runs/{id}`): plots as inline SVG."""

from __future__ import annotations

import time
from typing import Any

from core.store import audit, run_stats
from core.store.store import Store
from viewer.html import esc, fmt, link, page, table
from viewer.svg import bar_chart, line_chart


def _when(stamp: float | None) -> str:
    return "–" if stamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def _eval_cell(evals: list[dict[str, Any]], label: str) -> str:
    row = next((e for e in reversed(evals) if e["label"] == label and e["instances"]), None)
    if row is None:
        return "–"
    lo, hi = row["success_interval"]
    return esc(f"{row['success_rate']:.2f} [{lo:.2f}, {hi:.2f}] (v{row['policy_version']})")


def runs_page(store: Store) -> str:
    rows = []
    for run in audit.runs(store, limit=500):
        steps = len(store.learner_steps(run["id"]))
        wall = (run["finished_at"] - run["created_at"]) if run["finished_at"] else None
        evals = run_stats.evaluations(store, run["id"])
        rows.append([link(f"/runs/{run['id']}", run["id"]), esc(run["name"]), esc(run["mode"]),
                     f'<span class="st-{esc(run["status"])}">{esc(run["status"])}</span>',
                     esc(_when(run["created_at"])), fmt(wall, 3), esc(steps),
                     esc(run["trajectories"]), esc(run["admitted"]), fmt(run["mean_reward"]),
                     _eval_cell(evals, "before"), _eval_cell(evals, "after"),
                     link(f"/runs/{run['id']}/trajectories", "trajectories")])
    body = table(["run", "name", "mode", "status", "created", "wall s", "learner steps",
                  "trajectories", "admitted", "mean reward", "eval before", "eval after", ""],
                 rows, css="runs") if rows else "<p>No runs in this database.</p>"
    return page("runs", body)


def _curve_charts(curve: list[dict[str, Any]]) -> str:
    steps = [r["step"] for r in curve]
    panels = [("reward", {"reward": [r["reward"] for r in curve]}),
              ("policy loss", {"loss": [r["loss"] for r in curve]}),
              ("KL to the sampler (k3)", {"kl": [r["kl_sampler"] for r in curve]}),
              ("IS effective sample size", {"ess": [r["is_ess"] for r in curve]}),
              ("clip fractions", {"high": [r["clip_high"] for r in curve],
                                  "low": [r["clip_low"] for r in curve]}),
              ("entropy", {"entropy": [r["entropy"] for r in curve]}),
              ("grad norm", {"grad norm": [r["grad_norm"] for r in curve]}),
              ("lag (mean, max)", {"mean": [r["mean_lag"] for r in curve],
                                   "max": [r["max_lag"] for r in curve]})]
    return "".join(line_chart(title, steps, series, "learner step") for title, series in panels)


def _throughput_charts(buckets: list[dict[str, float]]) -> str:
    ts = [b["t"] for b in buckets]
    return (line_chart("trajectories/s", ts, {"traj/s": [b["trajectories_per_s"] for b in buckets]},
                       "seconds since start")
            + line_chart("sampled tokens/s", ts, {"tok/s": [b["tokens_per_s"] for b in buckets]},
                         "seconds since start")
            + line_chart("trajectory time by phase (s)", ts,
                         {"engine": [b["engine_s"] for b in buckets],
                          "tools": [b["tools_s"] for b in buckets],
                          "waiting": [b["waiting_s"] for b in buckets]}, "seconds since start"))


def _lag_charts(lags: dict[str, dict[int, int]]) -> str:
    return "".join(bar_chart(f"{kind} lag (admitted)", [str(k) for k in hist],
                             list(hist.values()), "versions behind the learner")
                   for kind, hist in (("trajectory", lags["trajectory"]),
                                      ("token", lags["token"])))


def _eval_table(evals: list[dict[str, Any]]) -> str:
    if not evals:
        return "<p>No evaluation in this run.</p>"
    rows = [[esc(e["label"]), esc(e["policy_version"]), esc(e["split"]), esc(e["instances"]),
             esc(e["distinct"]), fmt(e["success_rate"], 3),
             esc("[{:.3f}, {:.3f}]".format(*e["success_interval"]) if e["success_interval"]
                 else "–"), esc(e["infra_errors"]), esc(e["aborted"]), fmt(e["mean_reward"], 3)]
            for e in evals]
    return table(["", "policy version", "split", "instances", "distinct", "success",
                  "95% interval", "infrastructure errors", "aborted", "mean reward"], rows,
                 css="evals")


def _ledger(ledger: list[dict[str, Any]], skew: dict[str, Any] | None) -> str:
    if not ledger:
        return "<p>No bias ledger computed yet (it is written when a run finishes).</p>"
    rows = [[esc(r["family"]), esc(r["difficulty"]), fmt(r["duration_quantile"]),
             esc(r["generated"]), esc(r["admitted"]),
             esc(", ".join(f"{k}: {v}" for k, v in (r["excluded_by_reason"] or {}).items())),
             fmt(r["mean_reward_admitted"], 3), fmt(r["mean_reward_excluded"], 3),
             fmt(r["mean_duration_admitted"], 3), fmt(r["mean_duration_excluded"], 3)]
            for r in ledger]
    html = table(["family", "difficulty", "duration quantile", "generated", "admitted",
                  "excluded by reason", "reward admitted", "reward excluded",
                  "duration admitted", "duration excluded"], rows, css="ledger")
    if skew:
        figures = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in skew.items())
        html += f"<p>selection skew: {esc(figures)}</p>"
    return html


def dashboard_page(store: Store, run_id: str) -> str | None:
    run = store.run(run_id)
    if run is None:
        return None
    curve = audit.learner_steps(store, run_id)
    decisions = run_stats.admission_by_reason(store, run_id)
    summary = run.summary or {}
    info = table(["mode", "status", "created", "finished", "learner steps", "admitted",
                  "error"],
                 [[esc(run.pipeline_mode), esc(run.status), esc(_when(run.created_at)),
                   esc(_when(run.finished_at)), esc(len(curve)), esc(run.stream_head),
                   esc(run.error or "")]], css="info")
    body = (f'{info}<p>{link(f"/runs/{run_id}/trajectories", "all trajectories")}</p>'
            f'<h2>learning curve</h2><div class="charts">{_curve_charts(curve)}</div>'
            f'<h2>evaluation before / after</h2>{_eval_table(run_stats.evaluations(store, run_id))}'
            f'<h2>throughput</h2><div class="charts">'
            f'{_throughput_charts(run_stats.throughput(store, run_id))}</div>'
            f'<h2>lag</h2><div class="charts">'
            f'{_lag_charts(run_stats.lag_histograms(store, run_id))}</div><h2>admission decisions by reason</h2><div class="charts">'
            + bar_chart("decisions", [f"{d['decision']}/{d['reason']}" for d in decisions],
                        [d["count"] for d in decisions])
            + "</div>"
            + table(["decision", "reason", "count"],
                    [[link(f"/runs/{run_id}/trajectories", d["decision"], decision=d["decision"]),
                      esc(d["reason"]), esc(d["count"])] for d in decisions], css="decisions")
            + f'<h2>bias ledger</h2>'
            f'{_ledger(run_stats.bias_ledger(store, run_id), summary.get("selection_skew"))}')
    return page(f"run {run.name} ({run_id})", body, crumbs=[(f"/runs/{run_id}", run_id)])
