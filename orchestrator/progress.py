"""Live progress of a job: a rich live panel on a terminal, plain periodic lines otherwise."""

from __future__ import annotations

import sys
import time
from statistics import fmean
from typing import Callable

import anyio
from rich.console import Console
from rich.live import Live
from rich.table import Table

from orchestrator.pipeline import Pipeline


def snapshot(pipeline: Pipeline) -> dict[str, float | int | str]:
    stats, learner = pipeline.stats, pipeline.learner
    elapsed = max(time.monotonic() - stats.started, 1e-9)
    recent = stats.rewards[-200:]
    lags = stats.admitted_lags[-200:]
    excluded = stats.excluded
    return {
        "elapsed_s": round(elapsed, 1),
        "trajectories": stats.finished,
        "traj_per_s": round(stats.finished / elapsed, 2),
        "tokens_per_s": round(stats.sampled_tokens / elapsed, 1),
        "reward": round(fmean(recent), 3) if recent else "-",
        "learner_step": learner.steps,
        "policy_version": learner.version,
        "engine_version": pipeline.engine_version,
        "mean_lag": round(fmean(lags), 2) if lags else "-",
        "in_flight": pipeline.in_flight,
        "queued_for_learner": pipeline.stream_head - learner.consumed_seq,
        "admitted": stats.admitted,
        "excluded": " ".join(f"{k}={v}" for k, v in sorted(excluded.items())) or "-",
    }


def _table(values: dict) -> Table:
    table = Table(show_header=False, box=None, title="stalewise run")
    for key, value in values.items():
        table.add_row(key, str(value))
    return table


async def show_progress(pipeline: Pipeline, *, every_s: float, header: Callable[[], str],
                        tty: bool | None = None) -> None:
    """Runs until cancelled."""
    tty = sys.stderr.isatty() if tty is None else tty
    if tty:
        console = Console(stderr=True)
        with Live(_table(snapshot(pipeline)), console=console, refresh_per_second=2) as live:
            while True:
                await anyio.sleep(0.5)
                live.update(_table({"run": header(), **snapshot(pipeline)}))
    while True:
        await anyio.sleep(every_s)
        values = snapshot(pipeline)
        print(f"[{header()}] " + " ".join(f"{k}={v}" for k, v in values.items()),
              file=sys.stderr, flush=True)
