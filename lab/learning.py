"""Run the learning-per-compute comparison and summarise it.

Every (pipeline mode, estimator) pair trains from the same starting parameters for
`learning.updates` updates with `learning.seeds` seeds. The summary answers the essay's
deciding question: which setup reaches the target return soonest, in simulated time and in
updates. The target is `learning.target_return` if set, else J0 + target_fraction x
(J_best - J0), where J_best is the best mean final return over all setups.

Guarantees: runs are seeded (seed s of every setup uses the same generator seed); the
summary reports a setup's time to target only when every seed reached it, with the count.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from lab.config import LabConfig
from lab.durations import DurationModel
from lab.estimator_spec import resolve
from lab.pipeline import PipelineSimulation, RunResult
from lab.threads import torch_threads
from lab.world import build_world


@dataclass(frozen=True)
class LearningReport:
    initial_return: float
    target: float
    runs: list[RunResult]
    setups: list[dict[str, object]]


def first_time_at(result: RunResult, target: float) -> tuple[float, int] | None:
    """(time, update) of the first recorded return >= target, or None."""
    for t, u, j in zip(result.times, result.updates, result.returns):
        if j >= target:
            return t, u
    return None


def summarise(runs: list[RunResult], target: float) -> list[dict[str, object]]:
    setups: dict[tuple[str, str], list[RunResult]] = {}
    for run in runs:
        setups.setdefault((run.mode, run.estimator), []).append(run)
    out = []
    for (mode, estimator), group in setups.items():
        reached = [first_time_at(r, target) for r in group]
        finals = [r.returns[-1] for r in group]
        stats = [r.summary() for r in group]

        def mean(key: str, stats: list[dict[str, float]] = stats) -> float:
            return sum(s[key] for s in stats) / len(stats)

        all_reached = all(x is not None for x in reached)
        out.append({
            "mode": mode, "estimator": estimator, "seeds": len(group),
            "reached": sum(x is not None for x in reached),
            "time_to_target": (sum(x[0] for x in reached) / len(reached)
                               if all_reached else None),
            "updates_to_target": (sum(x[1] for x in reached) / len(reached)
                                  if all_reached else None),
            "final_return": sum(finals) / len(finals),
            "final_return_se": (_std(finals) / math.sqrt(len(finals))) if len(finals) > 1 else 0.0,
            "sim_time": mean("sim_time"), "throughput": mean("throughput"),
            "admitted_per_time": mean("admitted_per_time"),
            "dropped_frac": mean("dropped_frac"), "mean_lag": mean("mean_lag"),
            "max_lag": max(s["max_lag"] for s in stats),
        })
    return sorted(out, key=lambda s: (s["time_to_target"] is None,
                                      s["time_to_target"] or math.inf))


def _std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def run_learning(cfg: LabConfig, progress: Callable[[str], None] | None = None
                 ) -> LearningReport:
    """Train every (mode, estimator, seed) of `cfg.learning` (apply `cfg.quick()` first)."""
    learn = cfg.learning
    world = build_world(cfg.policy, cfg.reward, learn.horizon)
    durations = DurationModel(cfg.durations.per_token, cfg.durations.tail_index,
                              cfg.durations.difficulty_coupling)
    runs: list[RunResult] = []
    with torch_threads(1):
        for mode in learn.modes:
            for name in learn.presets:
                estimator = resolve(name, cfg.estimators.custom)
                started = time.perf_counter()
                for seed in range(learn.seeds):
                    sim = PipelineSimulation(world, name, estimator, mode, learn, durations,
                                             seed=1000 * seed + 17)
                    runs.append(sim.run(learn.updates))
                if progress:
                    last = runs[-learn.seeds:]
                    final = sum(r.returns[-1] for r in last) / len(last)
                    progress(f"{mode.title:>16} {name:<22} final J {final:.3f} "
                             f"({time.perf_counter() - started:.1f}s)")
    initial = runs[0].returns[0]
    if learn.target_return is not None:
        target = learn.target_return
    else:
        best = max(s["final_return"] for s in summarise(runs, math.inf))
        target = initial + learn.target_fraction * (best - initial)
    return LearningReport(initial, target, runs, summarise(runs, target))
