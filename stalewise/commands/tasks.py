"""`stalewise tasks check REF`: static checks of a Python family, or oracle/no-op runs of Harbor
task folders in real sandboxes (it needs the Docker backend, hence it lives at the top)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from tasks.cli import OPTIONS_HELP, load_or_exit, parse_options


def _is_harbor(ref: str) -> bool:
    return ref.startswith("harbor:") or Path(ref).is_dir()


def check_command(ref: str = typer.Argument(
                      ..., help="family reference (file.py:attr, name) or a Harbor task folder"),
                  options: str = typer.Option("", help=OPTIONS_HELP),
                  config: Path | None = typer.Option(
                      None, help="job config whose [tasks.harbor] settings to use"),
                  count: int = typer.Option(20, min=1, help="instances per split to check")
                  ) -> None:
    """Check a family: Harbor folders run their oracle (must score 1) and a no-op agent (must
    score 0) in Docker; Python families get keys, tool schemas and demonstrations checked.
    Exit 1 on any problem."""
    if _is_harbor(ref):
        _check_harbor(ref if ref.startswith("harbor:") else f"harbor:{ref}",
                      _harbor_options(options, config))
        return
    from tasks.check import check_family

    family = load_or_exit(ref, options)
    problems = check_family(family, count)
    for problem in problems:
        typer.echo(f"problem: {problem}", err=True)
    if problems:
        raise typer.Exit(code=1)
    demos = "with demonstrations" if family.has_demonstrations else "no demonstrations"
    typer.echo(f"ok: {family.name}, {count} instances per split ({', '.join(family.splits)}), "
               f"{demos}")


def _harbor_options(options: str, config: Path | None) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if config is not None:
        from stalewise.commands.run import load_or_exit as load_job

        settings = load_job(config).tasks.harbor.model_dump()
    return {**settings, **parse_options(options)}


def _check_harbor(ref: str, options: dict[str, Any]) -> None:
    import anyio

    from sandboxes.docker_backend import DockerSandbox
    from tasks.harbor_check import check_harbor_family, format_table
    from tasks.loading import TaskLoadError, load_family

    try:
        family = load_family(ref, options)
    except TaskLoadError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(code=1) from None
    rows = anyio.run(check_harbor_family, family,
                     lambda spec: DockerSandbox(spec, run_id="tasks-check"))
    typer.echo(format_table(rows))
    for row in rows:
        for problem in row.problems:
            typer.echo(f"problem: {problem}", err=True)
    if not all(row.passed for row in rows):
        raise typer.Exit(code=1)
