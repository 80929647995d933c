"""`stalewise run job.toml [--set section.key=value ...] [--dry-run] [--resume RUN]
[--seeds N [--first-seed S]]`.

With `--seeds N` the job runs once per seed S..S+N-1, one after another, each a whole run of
its own (`run.seed` set), and the command ends with each seed's evaluation and the spread of
the gain between seeds (mean, min, max, how many intervals lie above zero): the spread between
RL runs, which a single run's evaluation interval does not hold."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from config.errors import ConfigError


def load_or_exit(path: Path, overrides: list[str] | None = None):
    from config.job import load_config

    try:
        return load_config(path, overrides or ())
    except ConfigError as exc:
        for problem in exc.problems:
            typer.echo(f"error: {exc.source}: {problem}", err=True)
        raise typer.Exit(2) from None


def check_family_or_exit(job, config: Path):
    """Resolve `[tasks] family` (and the SFT stages' families) now, so a bad reference fails
    before any run is created."""
    from tasks.loading import TaskLoadError, load_family

    where = "tasks.family"
    try:
        family = load_family(job.tasks.family, job.tasks.family_options())
        if job.learner.sft.enabled:
            for number, stage in enumerate(job.learner.sft.stages):
                where = f"learner.sft.stages[{number}]"
                load_family(stage.family, stage.options)
        return family
    except TaskLoadError as exc:
        typer.echo(f"error: {config}: {where}: {exc}", err=True)
        raise typer.Exit(2) from None


def build_images_or_exit(job, family, config: Path) -> None:
    """Build the images of a finite family's tasks that come from Dockerfile folders (Harbor
    tasks) now, so a missing FROM image fails before any run is created, in one line."""
    if family.size is None or job.sandbox.backend == "local":
        return
    from core.sandbox import SandboxError
    from sandboxes.image import ensure_image

    tasks = {t.sandbox.image: t for t in family.instances(family.splits[0])
             if t.sandbox.build is not None}
    for image, task in tasks.items():
        name = task.data.get("harbor_task", task.key)
        try:
            ensure_image(image, task.sandbox.build)
        except SandboxError as exc:
            typer.echo(f"error: {config}: tasks.family: task {name}: {exc}", err=True)
            raise typer.Exit(2) from None


def check_paths_or_exit(job, config: Path, *, make: bool) -> None:
    """`model.path` (when no tiny model is to be made there) and `run.output_dir`, checked before
    any run is created: a missing checkpoint or an output folder that cannot be made used to
    fail after the store held a new run (the folder: in a traceback). With `make`, the output
    folder is made now (the job makes it anyway); without (`--dry-run`), nothing is made and
    its nearest existing folder is checked instead."""
    import os

    missing = job.model.missing_checkpoint()
    problems = [] if missing is None else [f"model.path: {missing}"]
    output = Path(job.run.output_dir)
    try:
        if make:
            output.mkdir(parents=True, exist_ok=True)
        else:
            existing = next(p for p in (output, *output.parents) if p.exists())
            if not existing.is_dir():
                raise NotADirectoryError(f"{existing} is a file")
            if not os.access(existing, os.W_OK | os.X_OK):
                raise PermissionError(f"{existing} is not writable")
    except OSError as exc:
        problems.append(f"run.output_dir: cannot make {output} ({exc.strerror or exc}); pass a "
                        "folder you can write to")
    for problem in problems:
        typer.echo(f"error: {config}: {problem}", err=True)
    if problems:
        raise typer.Exit(2)


def open_store_or_exit(job, config: Path) -> None:
    """Open (and for a new store, create) the job's store now, so an unreachable database fails
    in one line before the warm start and the engines, and after the checks that create no
    store (a task image that cannot be built leaves no store behind)."""
    from core.store.db import StoreOpenError
    from core.store.store import Store

    try:
        Store.open(job.run.db_url, create=True).close()
    except StoreOpenError as exc:
        typer.echo(f"error: {config}: run.db_url: {exc}", err=True)
        raise typer.Exit(2) from None


def check_resumable_or_exit(job, run_id: str) -> None:
    from core.store.db import StoreMissingError, StoreOpenError
    from core.store.store import Store
    from orchestrator.resume import ResumeError, check_resumable

    try:
        store = Store.open(job.run.db_url)
    except StoreMissingError as exc:  # `run` has no --url: the config names the store
        typer.echo(f"error: --resume {run_id}: no store at {exc.path}: no such file; the "
                   f"config's run.db_url ({job.run.db_url}) names it: run from the folder the "
                   "job ran in, or pass --set run.db_url=URL", err=True)
        raise typer.Exit(2) from None
    except StoreOpenError as exc:
        typer.echo(f"error: --resume {run_id}: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        check_resumable(store, run_id)
    except ResumeError as exc:
        typer.echo(f"error: --resume: {exc}", err=True)
        raise typer.Exit(2) from None
    finally:
        store.close()


def run_command(config: Path = typer.Argument(..., help="job config (TOML)"),
                dry_run: bool = typer.Option(
                    False, "--dry-run",
                    help="validate the config and its task family, print the resolved config"),
                resume: str | None = typer.Option(None, "--resume", help="resume run RUN"),
                overrides: list[str] | None = typer.Option(
                    None, "--set", help="override a config value: section.key=value "
                                        "(repeatable), e.g. --set run.seed=1"),
                seeds: int | None = typer.Option(
                    None, "--seeds", min=1, help="run the job once per seed S..S+N-1 and print "
                    "the spread of the gain between them"),
                first_seed: int = typer.Option(0, "--first-seed", min=0,
                                               help="S, the first seed of --seeds")) -> None:
    """Run an RL job described by CONFIG."""
    job = load_or_exit(config, overrides)
    if seeds is not None and resume is not None:
        typer.echo("error: --seeds starts new runs; it cannot be combined with --resume",
                   err=True)
        raise typer.Exit(2)
    family = check_family_or_exit(job, config)
    if resume is not None:
        check_resumable_or_exit(job, resume)
    check_paths_or_exit(job, config, make=not dry_run)
    if dry_run:
        typer.echo(json.dumps(job.model_dump(mode="json"), indent=2))
        typer.echo(f"{config}: config is valid", err=True)
        return
    build_images_or_exit(job, family, config)
    if resume is None:
        open_store_or_exit(job, config)
    from orchestrator.job import run_job

    if seeds is None:
        raise typer.Exit(run_job(job, resume=resume))
    raise typer.Exit(run_seeds(job, range(first_seed, first_seed + seeds)))


def run_seeds(job, seeds: range) -> int:
    """The job once per seed, then every seed's evaluation and the spread of the gain."""
    from config.job import with_seed
    from orchestrator.comparison import seed_summary
    from orchestrator.job import run_job

    done = []
    for seed in seeds:
        seeded = with_seed(job, seed)
        code = run_job(seeded)
        done.append((seed, code, seeded))
    lines = seed_summary(done)
    typer.echo("\n".join(lines))
    return 0 if all(code == 0 for _, code, _ in done) else 1
