"""The run summary: throughput, the learning curve, admission, rollout dynamics, the bias ledger.

`rollout_dynamics` reads, from the trajectories and decisions of a run, how far rollouts spanned
weight updates (the share of trajectories sampled by more than one weights version, the
weights-version span, the KV-version lag: for each sampled token, its weights version minus the
oldest version in the KV cache it attended to, and a trajectory's lag the largest of its tokens',
so a KV cache recomputed at every update shows lag 0 however many versions the trajectory
spans), how many ran out of time and what admission did with them.
The evaluations come from the store's `evaluations` table (`core.evaluation`), as numbers. `store_ledger` reads every finished training trajectory of a run with its
final admission decision (`core.store.rollouts`), computes the ledger (`orchestrator.ledger`)
and stores its rows; the summary (a JSON-ready dict) goes into `runs.summary`, `report.json`
and a Markdown `report.md` in the run directory.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from statistics import fmean
from typing import Any

from core.selection import DEFAULT_CLIP
from core.store.rollouts import finished_spans, finished_work, insert_ledger, kv_lag_by_trajectory
from core.store.store import Store
from orchestrator.ledger import Generated, LedgerRow, Skew, build_ledger


def generated_work(store: Store, run_id: str) -> list[Generated]:
    return [Generated(family=r.family, difficulty=r.difficulty or "all",
                      duration_s=(r.finished_at or 0.0) - (r.started_at or 0.0),
                      reward=r.reward, sampled_tokens=r.num_sampled_tokens,
                      admitted=r.decision == "admit", reason=r.reason or "undecided",
                      weight=1.0 if r.weight is None else r.weight)
            for r in finished_work(store, run_id)]


# The share of generated work beyond the selection weights from which the run summary says
# so, and what to change (with weights on: below it, the weighted skew comes down).
BEYOND_WEIGHTS_NOTE = 0.05


def beyond_weights_note(share: float, clip: float) -> str | None:
    """The run summary's line where the selection weights cannot correct much of the skew:
    `share` of the generated work sits in buckets that kept under 1/`clip` of the mean
    admitted rate, or nothing (`Skew.beyond_weights_share`); None below BEYOND_WEIGHTS_NOTE."""
    if share < BEYOND_WEIGHTS_NOTE:
        return None
    return (f"  {100 * share:.0f}% of the generated work is beyond the selection weights: its "
            f"buckets (family, difficulty, duration quartile) kept less than 1/{clip:g} of the "
            f"mean admitted rate, or nothing, so no weight up to admission.reweight_clip = "
            f"{clip:g} restores them and their skew stays in training. To keep the slow work "
            "admissible: raise pipeline.reserve toward 1 (\"every\"), set "
            "admission.cancel_stale = false, or loosen admission.max_lag (docs/pipeline.md, "
            "fifth measurement)")


TIMEOUT_STOPS = ("wall_time", "working_time")


def rollout_dynamics(store: Store, run_id: str) -> dict[str, Any]:
    """Version spans, KV lag, timeouts and their admission, over finished train trajectories."""
    rows = finished_spans(store, run_id)
    sampled = [r for r in rows if r.min_version is not None and r.max_version is not None]
    spans = [r.max_version - r.min_version for r in sampled]
    kv_lags = list(kv_lag_by_trajectory(store, run_id).values())
    timeouts = [r for r in rows if r.stop_reason in TIMEOUT_STOPS]
    return {
        "trajectories": len(rows),
        "multi_version_fraction": round(sum(x > 0 for x in spans) / len(spans), 4)
        if spans else None,
        "mean_version_span": round(fmean(spans), 3) if spans else None,
        "max_version_span": max(spans, default=None),
        "mean_kv_lag": round(fmean(kv_lags), 3) if kv_lags else None,
        "max_kv_lag": max(kv_lags, default=None),
        "kv_lagged_fraction": round(sum(x > 0 for x in kv_lags) / len(kv_lags), 4)
        if kv_lags else None,
        "timeouts": len(timeouts),
        "timeout_decisions": dict(Counter(r.reason or "undecided" for r in timeouts)),
    }


def store_ledger(store: Store, run_id: str, *,
                 clip: float = DEFAULT_CLIP) -> tuple[list[LedgerRow], Skew]:
    """The run's ledger, stored; `clip` is the run's `[admission] reweight_clip`."""
    rows, skew = build_ledger(generated_work(store, run_id), clip=clip)
    insert_ledger(store, run_id, [asdict(r) for r in rows], computed_at=time.time())
    return rows, skew


def evaluation_table(evaluations: list[dict[str, Any]]) -> list[str]:
    """report.md's evaluations: one row each, failures of every kind shown."""
    if not evaluations:
        return []
    lines = ["", "## evaluations (infrastructure errors and aborts count as failures)", "",
             "| label | policy version | split | instances | distinct | solved | success | "
             "infrastructure errors | aborted | mean reward | unsolved by failure mode |",
             "|" + "---|" * 11]
    for e in evaluations:
        modes = "; ".join(f"{mode}: {n}" for mode, n in sorted(
            e["failures"].items(), key=lambda item: -item[1])) or "-"
        lines.append(f"| {e['label']} | {e['policy_version']} | {e['split']} | {e['instances']} "
                     f"| {e['distinct']} | {e['solved']} | {100 * e['success_rate']:.1f}% | "
                     f"{e['infra_errors']} | {e['aborted']} | {e['mean_reward']:.3f} | {modes} |")
    return lines


def write_report(summary: dict[str, Any], ledger: list[LedgerRow], run_dir: Path,
                 curve: list[dict[str, Any]] = ()) -> Path:
    """report.json and report.md; `curve` is the learning curve (`audit.learner_steps`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "report.json").write_text(json.dumps(
        {"summary": summary, "learning_curve": list(curve),
         "ledger": [asdict(r) for r in ledger]}, indent=2, default=str))
    lines = [f"# stalewise run {summary['run_id']}", ""]
    for key, value in summary.items():
        if not isinstance(value, (dict, list)):
            lines.append(f"- **{key}**: {value}")
    lines += evaluation_table(summary.get("evaluations", []))
    for key, value in summary.items():
        if isinstance(value, dict):
            lines += ["", f"## {key}", ""] + [f"- {k}: {v}" for k, v in value.items()]
    fmt = lambda v: "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
    if curve:
        columns = list(curve[0])
        lines += ["", "## learning curve (stalewise audit steps)", "",
                  "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(fmt(row[c]) for c in columns) + " |" for row in curve]
    lines += ["", "## bias ledger (generated vs admitted)", "",
              "| family | difficulty | duration quartile | generated | admitted | excluded | "
              "reward admitted | reward excluded | duration admitted (s) | duration excluded (s) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in ledger:
        lines.append("| " + " | ".join(fmt(v) for v in (
            r.family, r.difficulty, r.duration_quantile, r.generated, r.admitted,
            ", ".join(f"{k}={n}" for k, n in r.excluded_by_reason.items()) or "-",
            r.mean_reward_admitted, r.mean_reward_excluded, r.mean_duration_admitted,
            r.mean_duration_excluded)) + " |")
    path = run_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
