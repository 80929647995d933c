"""`stalewise compare JOB.toml [JOB.toml ...] [--budget SECONDS] [--seeds N] [--first-seed S]
[--out DIR]`.

Runs each job (each seed in turn, one after another, so they never compete for the machine) on
the same workload, budget and store, then writes, in DIR:

- `compare.md` and `compare.json`: one row per run with held-out success before and after RL
  (Wilson 95% intervals) and the gain (Newcombe 95% interval), RL wall seconds, sampled
  tokens, and the diagnostics read from the store: mean / max token lag, IS effective sample
  size, k3 KL to the sampler, clip fractions, the share of trajectories spanning several
  weights versions, and the selection skew (difficulty and duration TV, excluded token share);
- `success-vs-seconds.{png,svg}` and `success-vs-tokens.{png,svg}`: held-out success against
  RL wall-clock seconds and against sampled tokens, one line per run, 95% bars.

Guarantees: every job gets the same `--budget` (`pipeline.budget_s`; its `steps` are lifted so
the budget binds) and the same seed list; all runs go to one SQLite store in DIR
(`compare.db`), so `stalewise audit` reads any of them afterwards. Runs happen in this
process, in order; a run that fails is a row with its error, never a silent gap. Jobs whose
SFT warm start would be the same (same model, task family and options, `[learner.sft]` table
and seed) share it: the first run of a seed makes it, the others start RL from its checkpoint,
so every recipe starts from the same model and the machine's time goes to RL
(`--no-share-warm-start` makes each run repeat it). `--warm-start DIR` starts every run's RL
from that checkpoint instead (say, the `sft` folder of an earlier run of the same job). Runs
that start from the same checkpoint with the same seed and evaluation settings (model, engine,
sandbox, tasks and rollout sections) also share its evaluation before RL: the first measures
it, the others skip it (`tasks.eval_before = false`) and report the first's figure, so every
such row has the same baseline.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

from stalewise.commands.run import check_family_or_exit, load_or_exit

SUCCESS = 0.999
UNBOUNDED_STEPS = 1_000_000


def compare_command(
    configs: list[Path] = typer.Argument(..., help="job configs (TOML) to compare"),
    budget: float | None = typer.Option(None, "--budget", min=1.0,
                                        help="seconds of RL per run (default: each job's steps)"),
    seeds: int = typer.Option(1, "--seeds", min=1, help="runs per job, seeds S..S+N-1"),
    first_seed: int = typer.Option(0, "--first-seed", min=0,
                                   help="S, the first seed (default 0)"),
    out: Path | None = typer.Option(None, "--out", help="output folder (default "
                                    "var/compare/<time>)"),
    share_warm_start: bool = typer.Option(
        True, "--share-warm-start/--no-share-warm-start",
        help="runs whose SFT warm start would be the same reuse the first one's checkpoint"),
    warm_start: Path | None = typer.Option(
        None, "--warm-start", help="start every run's RL from this checkpoint (e.g. an earlier "
        "run's RUN/sft) instead of each job's own model and warm start"),
) -> None:
    """Run JOBs on the same budget and compare held-out success per second and per token."""
    jobs = []
    for config in configs:
        job = load_or_exit(config)
        check_family_or_exit(job, config)
        jobs.append((config, job))
    if warm_start is not None and not (warm_start / "config.json").exists():
        typer.echo(f"error: --warm-start {warm_start}: no checkpoint there (config.json "
                   "missing); pass a model directory such as var/long/runs/RUN/sft", err=True)
        raise typer.Exit(2)
    out = out or Path("var/compare") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    warm_starts: dict[str, tuple[Path, str]] = {}  # warm-start key -> (checkpoint, made by)
    baselines: dict[str, tuple[tuple[int, int], str]] = {}  # eval key -> (before, measured by)
    for config, job in jobs:
        for seed in range(first_seed, first_seed + seeds):
            label = f"{config.stem}-s{seed}"
            typer.echo(f"compare: running {label} (budget {budget or 'steps'} s)", err=True)
            prepared = prepare(job, label, seed, budget, out)
            key = warm_start_key(prepared) if share_warm_start else None
            shared = (warm_start, str(warm_start)) if warm_start else warm_starts.get(key)
            if shared:
                typer.echo(f"compare: {label} starts RL from {shared[0]}", err=True)
                prepared = from_checkpoint(prepared, shared[0])
            baseline = baselines.get(before_eval_key(prepared)) if shared else None
            if baseline:
                typer.echo(f"compare: {label} reuses {baseline[1]}'s evaluation before RL "
                           "(same checkpoint, seed and evaluation settings)", err=True)
                prepared = without_before_eval(prepared)
            row = run_one(prepared, label, config, out, before=baseline[0] if baseline else None)
            start = shared[0] if shared else None  # the checkpoint RL started from
            if shared:
                row["warm_start_from"] = shared[1]
            elif key and row["run_id"]:
                made = Path(prepared.run.output_dir) / row["run_id"] / "sft"
                if (made / "config.json").exists():
                    warm_starts[key] = (made, label)
                    start = made
            if baseline:
                row["before_from"] = baseline[1]
            elif start is not None and row.get("before", (0, 0))[1]:
                baselines[before_eval_key(from_checkpoint(prepared, start))] = (
                    row["before"], label)
            rows.append(row)
    write_outputs(rows, out)
    typer.echo((out / "compare.md").read_text())
    failed = [r["label"] for r in rows if r["exit_code"] != 0]
    if failed:
        typer.echo(f"error: {len(failed)} run(s) failed: {', '.join(failed)}; their logs are "
                   f"in {out / 'runs'}", err=True)
        raise typer.Exit(1)


def edited(job, change):
    """A validated copy of the job whose plain data `change` has edited in place."""
    data = job.model_dump(mode="json")
    change(data)
    return type(job).model_validate(data)


def prepare(job, label: str, seed: int, budget: float | None, out: Path):
    """The job with the comparison's store, folder, seed and budget."""
    def change(data):
        data["run"].update(name=label, seed=seed, db_url=f"sqlite:///{out / 'compare.db'}",
                           output_dir=str(out / "runs"))
        if budget is not None:
            data["pipeline"].update(budget_s=budget, steps=UNBOUNDED_STEPS)
    return edited(job, change)


def warm_start_key(job) -> str | None:
    """What the job's SFT warm start depends on, as a string; None without one."""
    if not job.learner.sft.enabled:
        return None
    return json.dumps([job.model.model_dump(mode="json"), job.tasks.family, job.tasks.options,
                       job.learner.sft.model_dump(mode="json"), job.learner.device,
                       job.learner.dtype, job.run.seed], sort_keys=True)


def from_checkpoint(job, checkpoint: Path):
    """The job starting RL from an existing warm-start checkpoint instead of making its own."""
    def change(data):
        data["model"].update(path=str(checkpoint), create_tiny=False)
        data["learner"]["sft"]["enabled"] = False
    return edited(job, change)


def before_eval_key(job) -> str:
    """What a run's evaluation before RL depends on: the starting model, the seed (it picks the
    held-out instances) and the sections that shape a trajectory. Runs with equal keys measure
    the same thing before RL, so one measurement serves them all."""
    data = job.model_dump(mode="json")
    return json.dumps([data[k] for k in ("model", "engine", "sandbox", "tasks", "rollout")]
                      + [job.run.seed], sort_keys=True)


def without_before_eval(job):
    return edited(job, lambda data: data["tasks"].update(eval_before=False))


def run_one(job, label: str, config: Path, out: Path,
            before: tuple[int, int] | None = None) -> dict[str, Any]:
    """Run the job; `before` is the evaluation before RL measured by an earlier run when this
    run skips its own."""
    from core.store.store import Store
    from orchestrator.job import run_job

    code = run_job(job)
    store = Store.open(job.run.db_url)
    try:
        run_id = latest_run(store, label)
        row = {"label": label, "config": str(config), "run_id": run_id, "exit_code": code}
        if run_id is not None:
            row.update(run_figures(store, run_id, before))
        return row
    finally:
        store.close()


def latest_run(store, name: str) -> str | None:
    from core.store.reads import latest_run_named

    return latest_run_named(store, name)


def run_figures(store, run_id: str, before: tuple[int, int] | None = None) -> dict[str, Any]:
    """Held-out success before/after, RL seconds and tokens, and diagnostics, from the store;
    `before` given means the run did not evaluate before RL itself."""
    from core.store import audit
    from orchestrator.ledger import build_ledger
    from orchestrator.report import generated_work, held_out_gain, rollout_dynamics

    own_before, after = eval_counts(store, run_id, has_before=before is None)
    before = before or own_before
    seconds, tokens = rl_extent(store, run_id)
    curve = audit.learner_steps(store, run_id)
    _, skew = build_ledger(generated_work(store, run_id))
    dynamics = rollout_dynamics(store, run_id)
    figures: dict[str, Any] = {
        "before": before, "after": after, "rl_seconds": seconds, "sampled_tokens": tokens,
        "learner_steps": len(curve),
        "mean_lag": mean_of(curve, "mean_lag"), "max_lag": max_of(curve, "max_lag"),
        "is_ess": mean_of(curve, "is_ess"), "kl_sampler_k3": mean_of(curve, "kl_sampler"),
        "clip_high": mean_of(curve, "clip_high"), "clip_low": mean_of(curve, "clip_low"),
        "multi_version_fraction": dynamics["multi_version_fraction"],
        "difficulty_tv": skew.difficulty_tv, "duration_tv": skew.duration_tv,
        "excluded_token_share": skew.excluded_token_share,
    }
    if before[1] and after[1]:
        figures["held_out_95"] = held_out_gain(before, after)
    return figures


def eval_counts(store, run_id: str, has_before: bool = True
                ) -> tuple[tuple[int, int], tuple[int, int]]:
    """(successes, instances) of the before and after evaluations: the run's eval trajectories
    in id order, first half before RL (all after RL when the run has no evaluation before);
    infrastructure errors count as failures."""
    from core.store.reads import eval_rewards

    rewards = eval_rewards(store, run_id)
    half = len(rewards) // 2 if has_before else 0
    solved = [r is not None and r >= SUCCESS for r in rewards]
    return (sum(solved[:half]), half), (sum(solved[half:]), len(rewards) - half)


def rl_extent(store, run_id: str) -> tuple[float, int]:
    """Seconds from the first train trajectory's start to the end of the RL phase (the last
    learner step or train trajectory to finish), and the tokens sampled by train trajectories."""
    from core.store.reads import rl_phase

    first, last_trajectory, tokens, last_step = rl_phase(store, run_id)
    ends = [e for e in (last_trajectory, last_step) if e is not None]
    seconds = (max(ends) - first) if first is not None and ends else 0.0
    return round(seconds, 1), tokens


def mean_of(curve: list[dict], key: str) -> float | None:
    values = [r[key] for r in curve if r.get(key) is not None]
    return round(sum(values) / len(values), 4) if values else None


def max_of(curve: list[dict], key: str) -> float | None:
    return max((r[key] for r in curve if r.get(key) is not None), default=None)


COLUMNS = ("label", "before", "after", "gain [95%]", "RL s", "tokens", "steps", "lag mean",
           "lag max", "IS ESS", "k3 KL", "clip hi", "clip lo", "multi-version", "difficulty TV",
           "duration TV", "excluded tokens")


def table_row(row: dict[str, Any]) -> list[str]:
    if "before" not in row:
        return [row["label"], f"failed (exit {row['exit_code']})"] + ["-"] * (len(COLUMNS) - 2)
    fmt = lambda v: "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
    held = row.get("held_out_95", {})
    return [row["label"], held.get("before", "-"), held.get("after", "-"), held.get("gain", "-"),
            fmt(row["rl_seconds"]), str(row["sampled_tokens"]), str(row["learner_steps"])] + [
        fmt(row[k]) for k in ("mean_lag", "max_lag", "is_ess", "kl_sampler_k3", "clip_high",
                              "clip_low", "multi_version_fraction", "difficulty_tv",
                              "duration_tv", "excluded_token_share")]


def write_outputs(rows: list[dict[str, Any]], out: Path) -> None:
    (out / "compare.json").write_text(json.dumps(rows, indent=2, default=str))
    lines = ["# stalewise compare", "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(table_row(r)) + " |" for r in rows]
    lines += ["", "Success: held-out instances solved before and after RL, Wilson 95% intervals; "
              "gain: Newcombe 95% interval. Plots: success-vs-seconds.png/.svg, "
              "success-vs-tokens.png/.svg."]
    shared = [f"{r['label']} from {r['warm_start_from']}'s" for r in rows
              if r.get("warm_start_from")]
    if shared:
        lines += ["", "Shared SFT warm starts (same checkpoint, so the same model before RL): "
                  + "; ".join(shared) + "."]
    reused = [f"{r['label']} uses {r['before_from']}'s" for r in rows if r.get("before_from")]
    if reused:
        lines += ["", "Shared evaluations before RL (same checkpoint, seed and evaluation "
                  "settings, measured once): " + "; ".join(reused) + "."]
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    plot(rows, out)


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from core.stats import wilson

    for axis, key, name in (("RL wall-clock seconds", "rl_seconds", "success-vs-seconds"),
                            ("sampled tokens (train)", "sampled_tokens", "success-vs-tokens")):
        figure, ax = plt.subplots(figsize=(6.4, 4.2))
        for row in rows:
            if "before" not in row or not row["before"][1] or not row["after"][1]:
                continue
            points = [wilson(*row["before"]), wilson(*row["after"])]
            xs = [0, row[key]]
            ax.errorbar(xs, [100 * p.estimate for p in points],
                        yerr=[[100 * (p.estimate - p.low) for p in points],
                              [100 * (p.high - p.estimate) for p in points]],
                        marker="o", capsize=3, label=row["label"])
        ax.set_xlabel(axis)
        ax.set_ylabel("held-out success (%)")
        ax.set_title("held-out success before and after RL (95% intervals)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        figure.tight_layout()
        for suffix in ("png", "svg"):
            figure.savefig(out / f"{name}.{suffix}")
        plt.close(figure)
