"""`stalewise audit runs|trajectories|show|steps|template`: rich tables on a terminal, `--json` for scripts."""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import typer
from rich.console import Console
from rich.table import Table

from core.store.db import DEFAULT_URL
from stalewise.commands.export import export_command, require_run

app = typer.Typer(no_args_is_help=True)
app.command("export")(export_command)
URL = typer.Option(DEFAULT_URL, "--url", help="SQLite path/URL or PostgreSQL URL")
JSON = typer.Option(False, "--json", help="print JSON instead of tables")


def _open(url: str):
    from core.store.db import StoreOpenError
    from core.store.store import Store

    try:
        return Store.open(url)
    except StoreOpenError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _when(stamp: float | None) -> str:
    return "-" if stamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def _console() -> Console:
    """A terminal's own width; piped output is not cut to 80 columns (ids must stay whole)."""
    console = Console()
    return console if console.is_terminal else Console(width=240)


def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> Table:
    table = Table(title=title)
    for column in columns:  # ids are copied into the next command: never cut or wrapped
        table.add_column(column, no_wrap=column == "id")
    for row in rows:
        table.add_row(*[_fmt(row.get(c)) for c in columns])
    return table


def _query(url: str, query: Callable[[Any], list[dict[str, Any]]], as_json: bool,
           run: str | None = None) -> list[dict[str, Any]] | None:
    """Rows of `query(store)`; printed as JSON (and None returned) when `as_json`. With `run`,
    a run the store does not hold is an error, not an empty table."""
    store = _open(url)
    try:
        if run is not None:
            require_run(store, run, url)
        rows = query(store)
    finally:
        store.close()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return None
    return rows


@app.command("runs")
def runs_command(url: str = URL, as_json: bool = JSON, limit: int = 50) -> None:
    """List runs, newest first."""
    from core.store import audit

    rows = _query(url, lambda store: audit.runs(store, limit), as_json)
    if rows is None:
        return
    for row in rows:
        row["created"] = _when(row["created_at"])
    _console().print(_table("runs", rows, ["id", "name", "status", "mode", "created",
                                          "trajectories", "admitted", "mean_reward"]))


@app.command("steps")
def steps_command(run: str = typer.Option(..., "--run", help="run id"), url: str = URL,
                  as_json: bool = JSON) -> None:
    """A run's learning curve: reward, loss, KL to the sampler, clipping, lag per learner step."""
    from core.store import audit

    rows = _query(url, lambda store: audit.learner_steps(store, run), as_json, run)
    if rows is None:
        return
    columns = ["step", "samples", "tokens", *(name for name, _ in audit.CURVE_METRICS),
               "mean_lag", "max_lag", "seconds"]
    _console().print(_table(f"learner steps of {run}", rows, columns))


@app.command("trajectories")
def trajectories_command(run: str = typer.Option(..., "--run", help="run id"),
                         status: str | None = typer.Option(None, help="only this status"),
                         min_lag: int | None = typer.Option(None, help="admitted with lag >= N"),
                         reward_below: float | None = typer.Option(None, help="reward < X"),
                         purpose: str | None = typer.Option(None, help="train or eval"),
                         decision: str | None = typer.Option(
                             None, help="admission decision: admit, drop, requeue or mask"),
                         limit: int = 200, url: str = URL, as_json: bool = JSON) -> None:
    """List a run's trajectories, with filters."""
    from core.store import audit

    for name, value, allowed in (("--purpose", purpose, ("train", "eval")),
                                 ("--decision", decision, ("admit", "drop", "requeue", "mask"))):
        if value is not None and value not in allowed:
            typer.echo(f"error: {name} {value!r} is not one of {', '.join(allowed)}", err=True)
            raise typer.Exit(2)
    rows = _query(url, lambda store: audit.trajectories(
        store, run, status=status, min_lag=min_lag, reward_below=reward_below, purpose=purpose,
        decision=decision, limit=limit), as_json, run)
    if rows is None:
        return
    _console().print(_table(f"trajectories of {run}", rows,
                           ["id", "task", "difficulty", "group", "sample", "status",
                            "stop_reason", "reward", "turns", "tokens", "versions", "lag",
                            "decision", "duration_s"]))


@app.command("show")
def show_command(trajectory_id: int, url: str = URL, as_json: bool = JSON,
                 tokenizer: str | None = typer.Option(None, help="model dir for token text"),
                 max_tokens: int = typer.Option(0, help="tokens shown per turn (0 = all)")) -> None:
    """One trajectory: turns, tool calls and the per-token table."""
    from core.store import audit

    store = _open(url)
    detail = audit.trajectory_detail(store, trajectory_id, tokenizer_dir=tokenizer)
    store.close()
    if detail is None:
        typer.echo(f"error: no trajectory {trajectory_id} in {url}", err=True)
        raise typer.Exit(1)
    if as_json:
        typer.echo(json.dumps(detail, indent=2, default=str))
        return
    console = _console()
    info = detail["trajectory"]
    console.print(f"[bold]trajectory {info['id']}[/] run {info['run_id']}  status "
                  f"{info['status']} ({info['stop_reason']})  reward {_fmt(info['reward'])}  "
                  f"versions {info['min_version']}..{info['max_version']}  turns "
                  f"{info['num_turns']}  breakdown {info['reward_breakdown']}")
    if info["error"]:
        console.print(f"[red]error:[/] {info['error']}")
    for decision in detail["admission"]:
        console.print(f"admission: {decision['decision']} ({decision['reason']}), lag "
                      f"{decision['lag']}, learner version {decision['learner_version']}")
    for turn in detail["turns"]:
        console.print(f"\n[bold]turn {turn['turn']}[/] segment {turn['segment']}: "
                      f"{turn['prompt_tokens']} prompt tokens ({turn['cached_prompt_tokens']} "
                      f"cached), {len(turn['tokens'])} sampled, finish {turn['finish_reason']}, "
                      f"{turn['duration_s']:.3f} s")
        segment_break = (turn["sampling"] or {}).get("segment_break")
        if segment_break:
            console.print(f"  new segment: the chat template is not append-only here "
                          f"({segment_break})")
        tokens = turn["tokens"][:max_tokens] if max_tokens else turn["tokens"]
        table = Table(show_edge=False)
        for column in ("pos", "id", "text", "sampler logprob", "trainer logprob", "log-ratio",
                       "version", "kv version", "t (s)"):
            table.add_column(column)
        for tok in tokens:
            table.add_row(str(tok["position"]), str(tok["id"]),
                          repr(tok["text"]) if tok["text"] is not None else "",
                          f"{tok['sampler_logprob']:.4f}", _fmt(tok["trainer_logprob"]),
                          _fmt(tok["log_ratio"]), str(tok["version"]),
                          str(tok["kv_version"]), f"{tok['time_s']:.4f}")
        console.print(table)
        for call in turn["tool_calls"]:
            console.print(f"  tool {call['name']}({json.dumps(call['arguments'])}) -> exit "
                          f"{call['exit_code']} {call['error_type'] or ''} "
                          f"{call['duration_s']:.3f} s: {call['observation'][:200]!r}")


@app.command("template")
def template_command(run: str = typer.Option(..., "--run", help="run id"), url: str = URL,
                     tokenizer: str | None = typer.Option(
                         None, help="model dir (default: the run's model.path)"),
                     as_json: bool = JSON) -> None:
    """Re-render a run's trajectories with its chat template; flag those whose tokens differ
    (exit 1 when any does)."""
    from stalewise.commands.template_audit import AuditError, audit_run

    store = _open(url)
    try:
        report = audit_run(store, run, tokenizer_dir=tokenizer)
    except AuditError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    finally:
        store.close()
    flagged = [row for row in report["trajectories"] if row["status"] == "mismatch"]
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        console = _console()
        counts = report["counts"]
        console.print(f"run {run}: format {report['format']}, tokenizer {report['tokenizer']}: "
                      f"{counts['exact']} exact, {counts['sampled_noncanonical']} with sampled "
                      f"ids tokenized differently (kept as sampled), {counts['mismatch']} "
                      "differing from the template")
        breaks = sum(len(row["breaks"]) for row in report["trajectories"])
        if breaks:
            console.print(f"{breaks} new segments started where the template was not "
                          "append-only (reasons in `audit show`, sampling.segment_break)")
        if flagged:
            console.print(_table("trajectories whose tokens differ from the template", flagged,
                                 ["id", "task", "turn", "difference"]))
    if flagged:
        raise typer.Exit(1)
