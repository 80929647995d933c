"""Learner step reports and the sinks they go to; no torch.

Every learner step produces one `StepReport` whose fields match the store's learner_steps
row, plus namespaced diagnostics (`loss/clip_frac_low`, `learner/grad_norm`, `time/step_s`,
...). A `MetricsSink` receives each report once, in step order. Console and JSON-lines sinks
are always available; TensorBoard and Weights & Biases sinks exist only when their packages
import (`available_sinks()` says which); asking for a missing one is an error naming the
package to install.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO


@dataclass(frozen=True)
class StepReport:
    step: int  # learner step number, 1, 2, ...
    mode: str  # "rl" or "sft"
    num_samples: int
    num_tokens: int  # loss tokens trained on
    loss: float
    policy_version: int | None  # version the step trained from
    metrics: dict[str, float] = field(default_factory=dict)
    first_seq: int | None = None  # admission-log sequence numbers consumed
    last_seq: int | None = None
    mean_lag: float | None = None  # policy_version - weights_version over loss tokens
    max_lag: int | None = None
    published_version: int | None = None
    published_path: str | None = None
    started_at: float = 0.0
    finished_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class MetricsSink(Protocol):
    def write(self, report: StepReport) -> None: ...

    def close(self) -> None: ...


CONSOLE_KEYS = (
    "reward/mean",
    "loss/clip_frac_low",
    "loss/clip_frac_high",
    "loss/is_ess",
    "loss/kl_sampler_k3",
    "loss/entropy",
    "learner/grad_norm",
    "perf/tokens_per_s",
)


class ConsoleSink:
    """One line per step: the loss and a few key diagnostics (all of them with verbose=True)."""

    def __init__(self, stream: TextIO | None = None, verbose: bool = False) -> None:
        self._stream = stream
        self._verbose = verbose

    def write(self, report: StepReport) -> None:
        keys = (
            sorted(report.metrics)
            if self._verbose
            else [k for k in CONSOLE_KEYS if k in report.metrics]
        )
        parts = [
            f"step {report.step} [{report.mode}]",
            f"loss={report.loss:.4g}",
            f"tokens={report.num_tokens}",
        ]
        parts += [f"{k}={report.metrics[k]:.4g}" for k in keys]
        if report.published_version is not None:
            parts.append(f"published v{report.published_version}")
        stream = self._stream or sys.stdout
        stream.write("  ".join(parts) + "\n")  # one write: other ranks share this log
        stream.flush()

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends each report as one JSON object per line."""

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self._path.open("a")

    def write(self, report: StepReport) -> None:
        self._fh.write(json.dumps(report.to_json()) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class TensorBoardSink:
    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir))

    def write(self, report: StepReport) -> None:
        self._writer.add_scalar("loss/total", report.loss, report.step)
        for key, value in report.metrics.items():
            self._writer.add_scalar(key, value, report.step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(
        self, project: str, run_name: str | None = None, config: Mapping[str, Any] | None = None
    ) -> None:
        import wandb

        self._run = wandb.init(project=project, name=run_name, config=dict(config or {}))

    def write(self, report: StepReport) -> None:
        self._run.log({"loss/total": report.loss, **report.metrics}, step=report.step)

    def close(self) -> None:
        self._run.finish()


def available_sinks() -> list[str]:
    names = ["console", "jsonl"]
    if importlib.util.find_spec("tensorboard") is not None:
        names.append("tensorboard")
    if importlib.util.find_spec("wandb") is not None:
        names.append("wandb")
    return names


def make_sinks(
    names: Sequence[str], log_dir: str | Path, project: str = "stalewise"
) -> list[MetricsSink]:
    """Sinks by name: console, jsonl (log_dir/metrics.jsonl), tensorboard, wandb."""
    available = available_sinks()
    sinks: list[MetricsSink] = []
    for name in names:
        if name not in ("console", "jsonl", "tensorboard", "wandb"):
            raise ValueError(
                f"unknown metrics sink '{name}'; choose from console, jsonl, tensorboard, wandb"
            )
        if name not in available:
            raise ValueError(
                f"metrics sink '{name}' needs the '{name}' package; install it "
                f"(pip install {name}) or choose from {', '.join(available)}"
            )
        if name == "console":
            sinks.append(ConsoleSink())
        elif name == "jsonl":
            sinks.append(JsonlSink(Path(log_dir) / "metrics.jsonl"))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(Path(log_dir) / "tensorboard"))
        else:
            sinks.append(WandbSink(project))
    return sinks
