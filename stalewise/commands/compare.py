"""`stalewise compare JOB.toml [JOB.toml ...] [--budget SECONDS] [--seeds N] [--first-seed S]
[--out DIR] [--merge EARLIER_DIR ...]`.

Runs each job (each seed in turn, one after another, so they never compete for the machine) on
the same workload, budget and store, then writes, in DIR:

- `compare.md` and `compare.json`: one row per run with test success before and after RL
  (Wilson 95% intervals, from the runs' evaluation records) and the gain (Newcombe 95%
  interval, and its paired interval over the test instances, which the seeded evaluations
  allow even where the run's baseline is another run's), RL wall seconds, sampled tokens, and
  the diagnostics read from the store: mean / max token lag, IS effective sample size, k3 KL
  to the sampler, clip fractions, the share of trajectories spanning several weights
  versions, and the selection skew (difficulty and
  duration TV, excluded token share, and the share of generated work that no selection weight
  within `[admission] reweight_clip` can restore); then one row per recipe over its seeds
  (success after RL and the gain as mean, min, max and standard deviation) and the ranking that
  spread allows (`orchestrator.comparison.ranking`: nothing is ranked on one seed);
- `success-vs-seconds.{png,svg}` and `success-vs-tokens.{png,svg}`: held-out success against
  RL wall-clock seconds and against sampled tokens, one line per run, 95% bars.

The command is a loop over jobs and seeds around `orchestrator.comparison.Comparison`, which
runs each one (in this process, in order, one SQLite store `compare.db` in DIR, so `stalewise
audit` reads any of them afterwards) and says what the runs share: every job gets the same
`--budget` (`pipeline.budget_s`, its `steps` lifted so the budget binds) and seed list; runs
whose SFT warm start would be the same share the first one's checkpoint
(`--no-share-warm-start` makes each run repeat it); `--warm-start DIR` starts every run's RL
from that checkpoint instead (say, the `sft` folder of an earlier run of the same job); runs
that start from the same checkpoint with the same seed and evaluation settings share its
evaluation before RL, so every such row has the same baseline. A run that fails is a row with
its error, never a silent gap.

`--merge EARLIER_DIR` (repeatable) adds the finished runs of earlier comparisons (their
`compare.json`) to the table, so seeds run on different days, or a recipe added later, are
ranked together; with no JOB it runs nothing and only writes the merged table. The runs keep
their own stores (`EARLIER_DIR/compare.db`); compare.md says which folder each came from and
which runs it left out (failed or stopped ones), and refuses two runs with one label. It warns,
and does not refuse, where the merged runs were evaluated on different numbers of instances or
started from different checkpoints: then their rows are not the same experiment.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

from orchestrator.comparison import Comparison, ranking, recipe_spread, run_label
from stalewise.commands.compare_merge import (
    MergeError,
    check_labels,
    merged_runs,
    mixed_conditions,
)
from stalewise.commands.run import check_family_or_exit, check_paths_or_exit, load_or_exit


def compare_command(
    configs: list[Path] = typer.Argument(None, help="job configs (TOML) to compare"),
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
    merge: list[Path] = typer.Option(
        None, "--merge", help="add the finished runs of an earlier comparison's folder to the "
        "table (repeatable); with no JOB, runs nothing"),
) -> None:
    """Run JOBs on the same budget and compare held-out success per second and per token."""
    configs, merge = configs or [], merge or []
    if not configs and not merge:
        typer.echo("error: name the job configs to compare, or earlier comparison folders "
                   "with --merge DIR", err=True)
        raise typer.Exit(2)
    try:
        earlier, merge_notes = merged_runs(merge)
        check_labels(earlier, [run_label(config, seed) for config in configs
                               for seed in range(first_seed, first_seed + seeds)])
    except MergeError as err:
        typer.echo(f"error: --merge: {err}", err=True)
        raise typer.Exit(2) from None
    jobs = []
    for config in configs:
        job = load_or_exit(config)
        check_family_or_exit(job, config)
        check_paths_or_exit(job, config, make=True)
        jobs.append((config, job))
    if warm_start is not None and not (warm_start / "config.json").exists():
        typer.echo(f"error: --warm-start {warm_start}: no checkpoint there (config.json "
                   "missing); pass a model directory such as var/long/runs/RUN/sft", err=True)
        raise typer.Exit(2)
    out = out or Path("var/compare") / time.strftime("%Y%m%d-%H%M%S")
    if any(folder.resolve() == out.resolve() for folder in merge):
        typer.echo(f"error: --merge {out} is also the output folder; write the merged table to "
                   "a new folder with --out", err=True)
        raise typer.Exit(2)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        typer.echo(f"error: --out {out}: cannot make it ({exc.strerror or exc}); pass a folder "
                   "you can write to", err=True)
        raise typer.Exit(2) from None
    comparison = Comparison(out, budget=budget, share_warm_start=share_warm_start,
                            warm_start=warm_start, say=lambda m: typer.echo(m, err=True))
    rows = [comparison.run(job, config, seed)
            for config, job in jobs for seed in range(first_seed, first_seed + seeds)]
    rows = earlier + rows
    warnings = mixed_conditions(rows, out)
    for note in warnings:
        typer.echo(f"warning: {note}", err=True)
    write_outputs(rows, out, merge_notes + [f"warning: {note}" for note in warnings])
    typer.echo((out / "compare.md").read_text())
    failed = [r["label"] for r in rows if r["exit_code"] != 0]
    if failed:
        typer.echo(f"error: {len(failed)} run(s) failed: {', '.join(failed)}; their logs are "
                   f"in {out / 'runs'}", err=True)
        raise typer.Exit(1)


COLUMNS = ("label", "before", "after", "gain [95%]", "paired gain [95%]", "RL s", "tokens",
           "steps", "lag mean", "lag max", "IS ESS", "k3 KL", "clip hi", "clip lo",
           "multi-version", "difficulty TV", "duration TV", "excluded tokens", "beyond weights")


def table_row(row: dict[str, Any]) -> list[str]:
    if "before" not in row:
        return [row["label"], f"failed (exit {row['exit_code']})"] + ["-"] * (len(COLUMNS) - 2)
    fmt = lambda v: "-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))  # noqa: E731
    held = row.get("held_out_95", {})
    paired = row.get("held_out_paired", {})  # absent in runs compared before it existed
    return [row["label"], held.get("before", "-"), held.get("after", "-"), held.get("gain", "-"),
            paired.get("gain", "-"), fmt(row["rl_seconds"]), str(row["sampled_tokens"]),
            str(row["learner_steps"])] + [
        fmt(row.get(k)) for k in ("mean_lag", "max_lag", "is_ess", "kl_sampler_k3", "clip_high",
                                  "clip_low", "multi_version_fraction", "difficulty_tv",
                                  "duration_tv", "excluded_token_share", "beyond_weights_share")]


def spread_lines(spread: list[dict[str, Any]]) -> list[str]:
    """compare.md's table per recipe over seeds, and the ranking the spread allows."""
    pct = lambda s, k: "-" if s is None or s[k] is None else f"{100 * s[k]:.1f}"  # noqa: E731
    lines = ["", "## Per recipe, over seeds", "",
             "| recipe | seeds | after RL: mean [min, max], sd | gain: mean [min, max], sd | "
             "gains outside the noise |", "|---|---|---|---|---|"]
    for r in spread:
        cell = lambda s: "-" if s is None else (  # noqa: E731
            f"{pct(s, 'mean')}% [{pct(s, 'min')}, {pct(s, 'max')}], sd {pct(s, 'sd')}")
        lines.append(f"| {r['recipe']} | {r['seeds']} | {cell(r['after'])} | "
                     f"{cell(r['gain'])} | {r['gains_outside_noise']} of {r['finished']} |")
    ranked = ranking(spread)
    lines += ["", "Ranking (success after RL over seeds; a recipe is above another only where "
              f"Welch's t-test rejects equal means with Holm's correction over the {len(ranked)} "
              "pairs, family-wise 5%):", ""]
    lines += [f"- {line}" for line in ranked] or ["- none: every recipe needs two seeds or more"]
    return lines


def machine_lines(rows: list[dict[str, Any]]) -> list[str]:
    """compare.md's line naming the machines the runs ended on, and the range of the load
    average over 15 minutes at their ends (`orchestrator.comparison.machine_now`)."""
    cpus: dict[str, int] = {}
    for row in rows:
        machine = row.get("machine") or {}
        name = machine.get("cpu", "not recorded")
        if machine.get("cores"):
            name += f", {machine['cores']} cores"
        cpus[name] = cpus.get(name, 0) + 1
    line = "Machine: " + "; ".join(f"{name} ({n} runs)" for name, n in cpus.items())
    loads = [(r["label"], r["machine"]["load_avg_end"][2]) for r in rows
             if (r.get("machine") or {}).get("load_avg_end")]
    if loads:
        low, high = min(loads, key=lambda x: x[1]), max(loads, key=lambda x: x[1])
        line += (f". Load average over 15 minutes at the runs' ends: {low[1]:g} ({low[0]}) to "
                 f"{high[1]:g} ({high[0]}), {len(loads)} of {len(rows)} runs recorded it")
    return ["", line + "."]


def write_outputs(rows: list[dict[str, Any]], out: Path, merge_notes: list[str] = ()) -> None:
    (out / "compare.json").write_text(json.dumps(
        {"runs": rows, "recipes": recipe_spread(rows)}, indent=2, default=str))
    lines = ["# stalewise compare", "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(table_row(r)) + " |" for r in rows]
    if merge_notes:
        lines += ["", "Merged from earlier comparisons (each run's store is its folder's "
                  "compare.db):", ""] + [f"- {note}" for note in merge_notes]
    lines += machine_lines(rows)
    lines += ["", "Success: held-out instances solved before and after RL, Wilson 95% intervals; "
              "gain: Newcombe 95% interval. Plots: success-vs-seconds.png/.svg, "
              "success-vs-tokens.png/.svg."]
    shared = [f"{r['label']} from {r['warm_start_from']}'s" for r in rows
              if r.get("warm_start_from")]
    if shared:
        lines += ["", "Shared SFT warm starts (same checkpoint, so the same model before RL): "
                  + "; ".join(shared) + "."]
    lines += spread_lines(recipe_spread(rows))
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
