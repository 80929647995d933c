"""Tables, JSON and PNG plots of the lab's results (matplotlib with the Agg backend).

Estimator files: `estimators.json` (a list, one object per row, see `lab.estimator_lab`),
`bias_variance.png` (bias against variance, one colour per estimator, one panel per mismatch
kind), `vs_T.png` (bias and variance against the horizon T at each kind's strongest level) and
`vs_level.png` (bias and variance against the mismatch level at the middle horizon, where
the standard errors are still small).
Learning files: `learning.json` (target, setups, curves), `learning_time.png` (J against
simulated time, one panel per estimator, one line per pipeline mode) and
`learning_updates.png` (J against updates, one panel per mode, one line per estimator).

Guarantees: JSON holds only finite numbers or null (non-finite values become null); every
plot function returns the paths it wrote.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from lab.learning import LearningReport
from lab.levels import mismatch_strength
from lab.pipeline import RunResult

TABLE_COLUMNS = ("estimator", "T", "mismatch", "level", "bias", "bias_se", "bias_z", "variance",
                 "mse", "cosine", "ess", "clip_frac", "masked_frac", "cost_ms")


def _clean(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(data: object, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(data), indent=1))
    return path


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.2e}"
    return str(value)


def estimator_table(rows: Sequence[dict]) -> list[list[str]]:
    """Header plus one line per row, as strings."""
    return [list(TABLE_COLUMNS)] + [[_fmt(r.get(c)) for c in TABLE_COLUMNS] for r in rows]


SELECTION_COLUMNS = ("correction", "bias", "bias_se", "bias_z", "variance", "mse", "cosine",
                     "admitted_frac", "prompt_tv", "duration_tv", "throughput")


def selection_table(rows: Sequence[dict]) -> list[list[str]]:
    """Header plus one line per correction (`lab.selection`)."""
    return [list(SELECTION_COLUMNS)] + [[_fmt(r.get(c)) for c in SELECTION_COLUMNS]
                                        for r in rows]


TURNS_COLUMNS = ("turn_mean", "advantage", "bias", "bias_se", "bias_z", "variance", "mse", "cosine",
                 "length_push", "exact_length_push", "length_bonus", "length_push_se")


def turns_table(rows: Sequence[dict]) -> list[list[str]]:
    """Header plus one line per advantage (`lab.turns`)."""
    return [list(TURNS_COLUMNS)] + [[_fmt(r.get(c)) for c in TURNS_COLUMNS] for r in rows]


def learning_table(report: LearningReport) -> list[list[str]]:
    columns = ("mode", "estimator", "time_to_target", "updates_to_target", "reached",
               "final_return", "throughput", "mean_lag", "dropped_frac")
    return [list(columns)] + [[_fmt(s.get(c)) if s.get(c) is not None else "-" for c in columns]
                              for s in report.setups]


def render(table: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


Style = tuple[dict[str, object], dict[str, str]]  # colour and marker per name
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")


def _colours(names: Sequence[str]) -> dict[str, object]:
    plt = _pyplot()
    cmap = plt.get_cmap("tab10")
    return {name: cmap(i % 10) for i, name in enumerate(names)}


def _markers(names: Sequence[str]) -> dict[str, str]:
    return {name: MARKERS[(i // 10 + i) % len(MARKERS)] for i, name in enumerate(names)}


def _lower_errors(values: list[float], errors: list[float]) -> list[float]:
    """Error bars that stay above zero on a log axis."""
    return [min(e, 0.9 * v) if v > 0 else 0.0 for v, e in zip(values, errors)]


def _positive(values: list[float]) -> list[float]:
    return [max(v, 1e-6) if v is not None and math.isfinite(v) else float("nan") for v in values]


def plot_estimators(rows: Sequence[dict], out_dir: Path) -> list[Path]:
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys(r["estimator"] for r in rows))
    kinds = list(dict.fromkeys(r["mismatch"] for r in rows))
    style = (_colours(names), _markers(names))
    paths = [_plot_bias_variance(plt, rows, names, kinds, style, out_dir / "bias_variance.png"),
             _plot_against(plt, rows, names, kinds, style, "T", out_dir / "vs_T.png"),
             _plot_against(plt, rows, names, kinds, style, "level", out_dir / "vs_level.png")]
    return paths


def _plot_bias_variance(plt: ModuleType, rows: Sequence[dict], names: list[str],
                        kinds: list[str], style: Style, path: Path) -> Path:
    colours, markers = style
    cols = min(3, len(kinds))
    lines = math.ceil(len(kinds) / cols)
    fig, axes = plt.subplots(lines, cols, figsize=(5 * cols, 4 * lines), squeeze=False)
    for ax, kind in zip(axes.flat, kinds):
        for name in names:
            sel = [r for r in rows if r["mismatch"] == kind and r["estimator"] == name]
            ax.scatter(_positive([r["variance"] for r in sel]),
                       _positive([r["bias"] for r in sel]),
                       s=[12 + 4 * math.log2(max(r["T"], 1)) ** 2 for r in sel],
                       color=colours[name], marker=markers[name], label=name, alpha=0.75)
        ax.set(xscale="log", yscale="log", title=f"mismatch: {kind}",
               xlabel="variance / |grad J|^2", ylabel="bias / |grad J|")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(kinds):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.suptitle("Bias against variance (marker size grows with T)")
    fig.tight_layout(rect=(0, 0, 0.85, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _plot_against(plt: ModuleType, rows: Sequence[dict], names: list[str], kinds: list[str],
                  style: Style, axis: str, path: Path) -> Path:
    colours, markers = style
    fig, axes = plt.subplots(len(kinds), 2, figsize=(11, 3.2 * len(kinds)), squeeze=False)
    for line, kind in enumerate(kinds):
        kind_rows = [r for r in rows if r["mismatch"] == kind]
        if axis == "T":
            fixed = max((r["level"] for r in kind_rows),
                        key=lambda level: mismatch_strength(kind, level))
            sel = [r for r in kind_rows if r["level"] == fixed]
            where = f"level {fixed:g}"
        else:
            horizons = sorted({r["T"] for r in kind_rows})
            fixed = horizons[(len(horizons) - 1) // 2]
            sel = [r for r in kind_rows if r["T"] == fixed]
            where = f"T = {fixed}"
        for name in names:
            pts = sorted((r[axis], r) for r in sel if r["estimator"] == name)
            if not pts:
                continue
            xs = [x for x, _ in pts]
            bias = _positive([r["bias"] for _, r in pts])
            se = [r["bias_se"] for _, r in pts]
            axes[line, 0].errorbar(xs, bias, yerr=[_lower_errors(bias, se), se],
                                   color=colours[name], label=name, marker=markers[name], ms=4,
                                   capsize=2, lw=1)
            axes[line, 1].plot(xs, _positive([r["variance"] for _, r in pts]),
                               color=colours[name], marker=markers[name], ms=4, lw=1)
        for col, what in enumerate(("bias / |grad J|", "variance / |grad J|^2")):
            ax = axes[line, col]
            ax.set(yscale="log", xlabel=axis, ylabel=what, title=f"{kind} ({where})")
            if axis == "T":
                ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def learning_data(report: LearningReport) -> dict[str, object]:
    return {
        "initial_return": report.initial_return,
        "target": report.target,
        "setups": report.setups,
        "curves": [{"mode": r.mode, "estimator": r.estimator, "seed": r.seed, "times": r.times,
                    "updates": r.updates, "returns": r.returns, **r.summary()}
                   for r in report.runs],
    }


def _mean_curve(runs: list[RunResult], axis: str, grid: list[float]) -> list[float]:
    """Mean over runs of J at each grid point (J of the last update at or before it)."""
    values = []
    for x in grid:
        per_run = []
        for r in runs:
            xs = r.times if axis == "time" else r.updates
            j = r.returns[0]
            for xi, ji in zip(xs, r.returns):
                if xi > x:
                    break
                j = ji
            per_run.append(j)
        values.append(sum(per_run) / len(per_run))
    return values


def plot_learning(report: LearningReport, out_dir: Path) -> list[Path]:
    """J against time (a panel per estimator, a line per mode: which pipeline gets there
    first) and J against updates (a panel per mode, a line per estimator: update quality)."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    modes = list(dict.fromkeys(r.mode for r in report.runs))
    names = list(dict.fromkeys(r.estimator for r in report.runs))
    paths = []
    for axis, panels, lines, filename, label in (
            ("time", names, modes, "learning_time.png", "simulated time"),
            ("updates", modes, names, "learning_updates.png", "learner updates")):
        colours = _colours(lines)
        fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8),
                                 squeeze=False, sharey=True)
        for ax, panel in zip(axes[0], panels):
            for line in lines:
                runs = [r for r in report.runs
                        if (r.estimator, r.mode) in ((panel, line), (line, panel))]
                if not runs:
                    continue
                end = min((r.times[-1] if axis == "time" else r.updates[-1]) for r in runs)
                grid = [end * i / 200 for i in range(201)]
                ax.plot(grid, _mean_curve(runs, axis, grid), color=colours[line], label=line)
            ax.axhline(report.target, color="grey", ls="--", lw=1)
            ax.set(title=panel, xlabel=label, ylabel="J (exact)")
            ax.grid(alpha=0.3)
        axes[0, 0].legend(fontsize=8)
        fig.suptitle(f"Exact return against {label} (mean over seeds; dashed: target "
                     f"{report.target:.3f})")
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths
