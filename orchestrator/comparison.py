"""One comparison of RL recipes: each job, each seed, run in turn on one store (`Comparison`).

`Comparison(out, budget=..., share_warm_start=..., warm_start=...).run(job, config, seed)` runs
one job at one seed in this process and returns its row: the label, the run id, the exit code,
held-out success before and after RL (with the gain's interval, and its paired interval over
the test instances), RL seconds and sampled tokens, and the diagnostics read
from the store (token lag, IS effective sample size, k3 KL to the sampler, clip fractions, the
share of trajectories spanning several weights versions, the selection skew). The command
`stalewise compare` is a loop over jobs and seeds around it, plus the table and plots.

Guarantees: every run gets the comparison's budget (`pipeline.budget_s`; its `steps` are lifted
so the budget binds), store (`OUT/compare.db`), folder and its seed. With `share_warm_start`,
runs whose SFT warm start would be the same (same model, task family and options,
`[learner.sft]`, device, dtype and seed) share the first one's checkpoint; with `warm_start`
every run starts RL from that checkpoint. Runs that start from the same checkpoint with the
same seed and evaluation settings share its evaluation before RL: the first measures it, the
others skip theirs (`tasks.eval_before = false`) and report the first's figure. A run that
fails is a row with its exit code, never a gap.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.selection import DEFAULT_CLIP

UNBOUNDED_STEPS = 1_000_000


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr)


class Comparison:
    """The runs of one comparison and what they share (module docstring)."""

    def __init__(self, out: Path, *, budget: float | None = None, share_warm_start: bool = True,
                 warm_start: Path | None = None,
                 say: Callable[[str], None] = _to_stderr) -> None:
        self.out, self.budget, self.share_warm_start = out, budget, share_warm_start
        self.warm_start, self.say = warm_start, say
        self.warm_starts: dict[str, tuple[Path, str]] = {}  # key -> (checkpoint, made by)
        # key -> (before, the label and run id of the run that measured it)
        self.baselines: dict[str, tuple[tuple[int, int], str, str]] = {}

    def run(self, job, config: Path, seed: int) -> dict[str, Any]:
        """Run `job` at `seed`; its row."""
        label = run_label(config, seed)
        self.say(f"compare: running {label} (budget {self.budget or 'steps'} s)")
        prepared = prepare(job, label, seed, self.budget, self.out)
        key = warm_start_key(prepared) if self.share_warm_start else None
        shared = ((self.warm_start, str(self.warm_start)) if self.warm_start
                  else self.warm_starts.get(key) if key else None)
        if shared:
            self.say(f"compare: {label} starts RL from {shared[0]}")
            prepared = from_checkpoint(prepared, shared[0])
        baseline = self.baselines.get(before_eval_key(prepared)) if shared else None
        if baseline:
            self.say(f"compare: {label} reuses {baseline[1]}'s evaluation before RL "
                     "(same checkpoint, seed and evaluation settings)")
            prepared = without_before_eval(prepared)
        row = run_one(prepared, label, config, before=baseline[0] if baseline else None,
                      before_run=baseline[2] if baseline else None)
        start = shared[0] if shared else None  # the checkpoint RL started from
        if shared:
            row["warm_start_from"] = shared[1]
        elif key and row["run_id"]:
            made = Path(prepared.run.output_dir) / row["run_id"] / "sft"
            if (made / "config.json").exists():
                self.warm_starts[key] = (made, label)
                start = made
        if baseline:
            row["before_from"] = baseline[1]
        elif start is not None and row.get("before", (0, 0))[1]:
            self.baselines[before_eval_key(from_checkpoint(prepared, start))] = (
                row["before"], label, row["run_id"])
        return row


def run_label(config: Path, seed: int) -> str:
    """A run's label in a comparison: its job file's name and its seed (`long-sync-s2`)."""
    return f"{config.stem}-s{seed}"


def edited(job, change):
    """A validated copy of the job whose plain data `change` has edited in place (the seeds
    the job derived from `run.seed` stay derived)."""
    data = job.model_dump(mode="json")
    change(data)
    out = type(job).model_validate(data)
    out._seeds_from_run = job._seeds_from_run
    return out


def prepare(job, label: str, seed: int, budget: float | None, out: Path):
    """The job with the comparison's store, folder, seed (every seed derived from `run.seed`
    follows it: the warm start, the learner, the engine) and budget."""
    from config.job import with_seed

    def change(data):
        data["run"].update(name=label, db_url=f"sqlite:///{out / 'compare.db'}",
                           output_dir=str(out / "runs"))
        if budget is not None:
            data["pipeline"].update(budget_s=budget, steps=UNBOUNDED_STEPS)
    return with_seed(edited(job, change), seed)


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


def run_one(job, label: str, config: Path, before: tuple[int, int] | None = None,
            before_run: str | None = None) -> dict[str, Any]:
    """Run the job; `before` is the evaluation before RL measured by an earlier run (of id
    `before_run`, in the same store) when this run skips its own."""
    from core.store.store import Store
    from orchestrator.job import run_job

    code = run_job(job)
    store = Store.open(job.run.db_url)
    try:
        run_id = latest_run(store, label)
        row = {"label": label, "config": str(config), "run_id": run_id, "exit_code": code,
               "machine": machine_now()}
        if run_id is not None:
            row.update(run_figures(store, run_id, before, before_run=before_run,
                                   reweight_clip=job.admission.reweight_clip))
        return row
    finally:
        store.close()


def machine_now() -> dict[str, Any]:
    """The machine a run ended on: its CPU, its cores and the load average (1, 5 and 15
    minutes) at that moment, so a table names the CPU beside its figures. The load counts the
    run's own engine, learner and sandboxes too (a `long` job alone keeps 2 cores near 9), so
    read it against the other runs of the same job: one that shared the machine reads higher."""
    from core.numerics import cpu_facts

    return {"cpu": cpu_facts()["cpu"], "cores": os.cpu_count(),
            "load_avg_end": [round(x, 2) for x in os.getloadavg()]}


def latest_run(store, name: str) -> str | None:
    from core.store.reads import latest_run_named

    return latest_run_named(store, name)


def run_figures(store, run_id: str, before: tuple[int, int] | None = None, *,
                before_run: str | None = None,
                reweight_clip: float = DEFAULT_CLIP) -> dict[str, Any]:
    """Held-out success before/after, RL seconds and tokens, and diagnostics, from the store;
    `before` given means the run did not evaluate before RL itself (run `before_run` did);
    `reweight_clip` is the job's `[admission] reweight_clip` (the largest selection weight,
    for the share of work beyond the weights). With both evaluations in the store, the gain
    is also paired per test instance (`held_out_paired`: the evaluations of one seed draw an
    instance with the same random numbers, whichever run made them)."""
    from core.evaluation import gain_figures
    from core.store import audit
    from orchestrator.ledger import build_ledger
    from orchestrator.report import generated_work, rollout_dynamics

    own_before, after = eval_counts(store, run_id)
    before = before or own_before
    seconds, tokens = rl_extent(store, run_id)
    curve = audit.learner_steps(store, run_id)
    _, skew = build_ledger(generated_work(store, run_id), clip=reweight_clip)
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
        "beyond_weights_share": skew.beyond_weights_share,
    }
    if before[1] and after[1]:
        figures["held_out_95"] = gain_figures(before, after)
        paired = paired_against(store, before_run or run_id, run_id)
        if paired is not None:
            figures["held_out_paired"] = paired
    return figures


def paired_against(store, before_run: str, run_id: str) -> dict[str, Any] | None:
    """The paired figures of run `run_id`'s evaluation after RL against run `before_run`'s
    before it (`orchestrator.evaluate.paired_gain`); None where either is missing."""
    from core.evaluation import latest_by_label
    from orchestrator.evaluate import paired_gain

    before = latest_by_label(store.evaluations(before_run)).get("before")
    after = latest_by_label(store.evaluations(run_id)).get("after")
    if before is None or after is None:
        return None
    return paired_gain(store, (before_run, before), (run_id, after))


def eval_counts(store, run_id: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """(solved, instances) of the run's evaluations before and after RL, from the store's
    evaluation records ((0, 0) where the run has none); infrastructure errors and aborts
    count as failures (`core.evaluation`)."""
    from core.evaluation import latest_by_label

    by_label = latest_by_label(store.evaluations(run_id))
    counts = {label: e.counts for label, e in by_label.items()}
    return counts.get("before", (0, 0)), counts.get("after", (0, 0))


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


def recipe_spread(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per job (recipe), over its seeds: success after RL and the gain as mean, min, max and
    standard deviation between seeds, and how many seeds' gain intervals exclude zero. The
    spread between seeds is what a ranking must beat, not only each run's evaluation noise."""
    by_recipe: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_recipe.setdefault(str(row["config"]), []).append(row)
    out = []
    for config, runs in by_recipe.items():
        done = [r for r in runs if r.get("after", (0, 0))[1] and r.get("before", (0, 0))[1]]
        after = [r["after"][0] / r["after"][1] for r in done]
        gains = [a - r["before"][0] / r["before"][1] for a, r in zip(after, done)]
        out.append({"recipe": Path(config).stem, "seeds": len(runs), "finished": len(done),
                    "after": _spread(after), "gain": _spread(gains),
                    "gains_outside_noise": sum(bool(r.get("held_out_95", {}).get(
                        "gain_excludes_zero")) and g > 0 for r, g in zip(done, gains))})
    return out


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    mean = sum(values) / len(values)
    sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 \
        if len(values) > 1 else None
    return {"mean": round(mean, 4), "min": round(min(values), 4), "max": round(max(values), 4),
            "sd": round(sd, 4) if sd is not None else None, "n": len(values)}


def ranking(spread: list[dict[str, Any]], alpha: float = 0.05) -> list[str]:
    """Every pair of recipes with two seeds or more, tested with Welch's t-test on their seeds'
    success after RL; a recipe is named above another only where Holm's procedure over all the
    pairs rejects "no difference" at `alpha`, so that with many recipes the chance of any false
    ranking stays at most `alpha`. Other pairs are named as not separated. Nothing is ranked on
    one seed."""
    from core.stats import holm, welch_p_value

    ranked = sorted((r for r in spread if r["after"] and r["after"]["sd"] is not None),
                    key=lambda r: -r["after"]["mean"])
    pairs = [(a, b) for i, a in enumerate(ranked) for b in ranked[i + 1:]]
    tests = [welch_p_value(a["after"]["mean"], a["after"]["sd"], a["after"]["n"],
                           b["after"]["mean"], b["after"]["sd"], b["after"]["n"])
             for a, b in pairs]
    separated = holm([p for _, _, p in tests], alpha)
    lines = []
    for (a, b), (t, df, p), apart in zip(pairs, tests, separated):
        difference = a["after"]["mean"] - b["after"]["mean"]
        lines.append(f"{a['recipe']} {'above' if apart else 'not separated from'} "
                     f"{b['recipe']}: {100 * difference:+.1f} points, Welch t {t:.2f} "
                     f"(df {df:.1f}), p {p:.3g}")
    return lines


def seed_summary(runs: list[tuple[int, int, Any]]) -> list[str]:
    """`stalewise run --seeds`: one line per (seed, exit code, job) with its evaluation, then
    the spread of the gain between seeds, from each run's evaluation records."""
    from core.evaluation import gain_figures, latest_by_label
    from core.store.reads import latest_run_named
    from core.store.store import Store

    lines, rows = [], []
    for seed, code, job in runs:
        store = Store.open(job.run.db_url)
        try:
            run_id = latest_run_named(store, job.run.name)
            found = latest_by_label(store.evaluations(run_id)) if run_id else {}
        finally:
            store.close()
        if code != 0 or not {"before", "after"} <= set(found):
            lines.append(f"seed {seed}: run {run_id or '-'} exit {code}, no before/after "
                         "evaluation")
            continue
        before, after = found["before"].counts, found["after"].counts
        held = gain_figures(before, after)
        rows.append({"config": job.run.name, "before": before, "after": after,
                     "held_out_95": held})
        lines.append(f"seed {seed}: run {run_id}: {held['before']} -> {held['after']}, gain "
                     f"{held['gain']}")
    [spread] = recipe_spread(rows) or [None]
    if spread is not None and spread["gain"] is not None:
        gain = spread["gain"]
        lines.append(f"spread over {gain['n']} seeds: gain mean {100 * gain['mean']:+.1f}, min "
                     f"{100 * gain['min']:+.1f}, max {100 * gain['max']:+.1f} points; "
                     f"{spread['gains_outside_noise']} of {gain['n']} with the gain's 95% "
                     "interval above zero")
    return lines
