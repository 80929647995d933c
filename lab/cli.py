"""`stalewise lab ...` commands (heavy imports happen inside commands).

    stalewise lab estimators CONFIG [--quick] [--json OUT] [--out-dir DIR]
    stalewise lab learning CONFIG [--quick] [--json OUT] [--out-dir DIR]
    stalewise lab selection CONFIG [--quick] [--json OUT] [--out-dir DIR]
    stalewise lab turns CONFIG [--quick] [--json OUT] [--out-dir DIR]

Each prints a table and writes JSON (the first two also PNG plots) (default directory: the config's
`output_dir`). A bad config exits with status 2 and one line per problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from lab.config import LabConfig

app = typer.Typer(no_args_is_help=True)

CONFIG_ARG = typer.Argument(..., help="lab TOML config, e.g. configs/lab.toml")
QUICK_OPT = typer.Option(False, "--quick", help="apply the config's [*.quick] overrides")
JSON_OPT = typer.Option(None, "--json", help="JSON output path (default OUT_DIR/<command>.json)")
OUT_OPT = typer.Option(None, "--out-dir", help="directory for plots (default: output_dir)")


def _load(config: Path, quick: bool) -> LabConfig:
    from config.errors import ConfigError
    from lab.config import load_lab_config

    try:
        cfg = load_lab_config(config)
    except ConfigError as exc:
        typer.echo(f"error: bad lab config {exc.source}:", err=True)
        for problem in exc.problems:
            typer.echo(f"  - {problem}", err=True)
        raise typer.Exit(2) from None
    return cfg.quick() if quick else cfg


def _progress(line: str) -> None:
    typer.echo(line, err=True)


@app.command("estimators")
def estimators(config: Path = CONFIG_ARG, quick: bool = QUICK_OPT,
               json_out: Path | None = JSON_OPT, out_dir: Path | None = OUT_OPT) -> None:
    """Bias, variance, MSE and cosine of every estimator against the exact gradient."""
    cfg = _load(config, quick)
    from lab.estimator_lab import run_estimator_lab
    from lab.report import estimator_table, plot_estimators, render, write_json

    directory = out_dir or Path(cfg.output_dir)
    rows = run_estimator_lab(cfg, progress=_progress)
    typer.echo(render(estimator_table(rows)))
    written = [write_json(rows, json_out or directory / "estimators.json")]
    written += plot_estimators(rows, directory)
    typer.echo("wrote " + ", ".join(str(p) for p in written))


@app.command("learning")
def learning(config: Path = CONFIG_ARG, quick: bool = QUICK_OPT,
             json_out: Path | None = JSON_OPT, out_dir: Path | None = OUT_OPT) -> None:
    """Train the tractable policy under each pipeline mode and estimator; J against compute."""
    cfg = _load(config, quick)
    from lab.learning import run_learning
    from lab.report import learning_data, learning_table, plot_learning, render, write_json

    directory = out_dir or Path(cfg.output_dir)
    report = run_learning(cfg, progress=_progress)
    typer.echo(f"initial J {report.initial_return:.4f}, target J {report.target:.4f}")
    typer.echo(render(learning_table(report)))
    written = [write_json(learning_data(report), json_out or directory / "learning.json")]
    written += plot_learning(report, directory)
    typer.echo("wrote " + ", ".join(str(p) for p in written))


def _rows_command(config: Path, quick: bool, json_out: Path | None, out_dir: Path | None,
                  name: str) -> None:
    """A study that prints one table and writes its rows as `name`.json (selection, turns)."""
    cfg = _load(config, quick)
    from lab import report
    from lab.selection import run_selection_lab
    from lab.turns import run_turns_lab

    run, table = {"selection": (run_selection_lab, report.selection_table),
                  "turns": (run_turns_lab, report.turns_table)}[name]
    rows = run(cfg, progress=_progress)
    typer.echo(report.render(table(rows)))
    path = json_out or (out_dir or Path(cfg.output_dir)) / f"{name}.json"
    typer.echo("wrote " + str(report.write_json(rows, path)))


@app.command("selection")
def selection(config: Path = CONFIG_ARG, quick: bool = QUICK_OPT,
              json_out: Path | None = JSON_OPT, out_dir: Path | None = OUT_OPT) -> None:
    """Admission's selection bias against the exact gradient: none, propensity, pacing."""
    _rows_command(config, quick, json_out, out_dir, "selection")


@app.command("turns")
def turns(config: Path = CONFIG_ARG, quick: bool = QUICK_OPT,
          json_out: Path | None = JSON_OPT, out_dir: Path | None = OUT_OPT) -> None:
    """Per-turn rewards: bias and length bonus of each per-turn baseline."""
    _rows_command(config, quick, json_out, out_dir, "turns")
