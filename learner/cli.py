"""`stalewise learner ...` commands (heavy imports happen inside commands).

train      RL steps on samples from a JSON-lines file, publishing versions under OUT
sft        supervised warm start on demonstrations, writing the checkpoint to OUT
synth-data write synthetic RL samples and tool-call demonstrations for smoke runs
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from config.learner import LearnerConfig

# `python -m learner` runs as a job's child, whose log tail is what the job reports when it
# dies: plain tracebacks (the whole call chain, grep-able) rather than rich's boxes. The
# `stalewise learner` commands follow the `stalewise` app's own setting.
app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False)


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()


def load_learner_config(path: Path | None, overrides: dict | None = None) -> LearnerConfig:
    """LearnerConfig from a TOML or JSON file (top level, or its [learner] table) plus
    overrides (dotted keys; None leaves the file's value)."""
    from pydantic import ValidationError

    from config.errors import problems_of
    from config.learner import LearnerConfig

    data: dict = {}
    if path is not None:
        try:
            text = path.read_text()
            data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except FileNotFoundError:
            raise typer.BadParameter(f"{path}: file not found") from None
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise typer.BadParameter(f"{path}: not valid TOML or JSON: {exc}") from None
        data = data.get("learner", data)
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        return LearnerConfig.model_validate(data)
    except ValidationError as exc:
        problems = "\n  ".join(problems_of(exc, LearnerConfig))
        raise typer.BadParameter(f"{path or 'learner config'}:\n  {problems}") from None


def _require_inputs(model: Path, data: Path | None) -> None:
    """A missing checkpoint or data file is one line before anything is loaded or written."""
    if not (model / "config.json").is_file():
        raise typer.BadParameter(f"{model} holds no checkpoint (config.json missing); pass a "
                                 "Hugging Face model directory", param_hint="MODEL")
    if data is not None and not data.is_file():
        raise typer.BadParameter(f"{data}: no such file; pass a JSON-lines file",
                                 param_hint="--data")


@app.command("train")
def train_command(
    model: Path = typer.Argument(..., help="HF checkpoint directory to start from"),
    data: Path = typer.Option(..., help="JSON-lines file of TrainingSample objects"),
    out: Path = typer.Option(..., help="publish versions under OUT/v000001, ..."),
    config: Path | None = typer.Option(None, help="TOML learner config ([learner] or top level)"),
    steps: int | None = typer.Option(None, help="stop after this many learner steps"),
    batch_size: int | None = typer.Option(None, help="override learner batch_size"),
    surrogate: str | None = typer.Option(None, help="override loss.surrogate"),
    lr: float | None = typer.Option(None, help="override optimizer.lr"),
    metrics: str = typer.Option("console,jsonl", help="comma-separated sinks"),
) -> None:
    """RL learner steps on a file of admitted trajectories."""
    _quiet_transformers()
    from learner.batch import JsonlSource
    from learner.metrics import make_sinks
    from learner.trainer import Learner

    cfg = load_learner_config(
        config, {"batch_size": batch_size, "loss.surrogate": surrogate, "optimizer.lr": lr}
    )
    if cfg.workers > 1:
        raise typer.BadParameter(
            f"`learner train` runs one process, but the config says workers = {cfg.workers}; "
            "set workers = 1 here (several workers train a job's learner, `learner serve`)")
    _require_inputs(model, data)
    sinks = make_sinks([m for m in metrics.split(",") if m], out)
    published = []

    def mark(version: int, path: Path) -> None:
        published.append(version)
        with (out / "published.jsonl").open("a") as fh:
            fh.write(json.dumps({"version": version, "path": str(path)}) + "\n")

    try:
        source = JsonlSource(data)
        learner = Learner(model, cfg, publish_root=out, mark_published=mark, sinks=sinks)
        reports = learner.run(source, until_step=steps)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    finally:
        for sink in sinks:
            sink.close()
    typer.echo(
        f"{len(reports)} learner steps on {sum(r.num_samples for r in reports)} samples; "
        f"published versions {published or 'none'} under {out}"
    )


@app.command("sft")
def sft_command(
    model: Path = typer.Argument(..., help="HF checkpoint directory to start from"),
    out: Path = typer.Option(..., help="write the fine-tuned checkpoint to this new directory"),
    job: Path | None = typer.Option(
        None, help="a job's warm start as one JSON file (RUN/sft.json: the learner section and "
                   "the family); no other option then"),
    data: Path | None = typer.Option(None, help="JSON lines with token_ids and loss_mask"),
    synthetic: int = typer.Option(0, help="use N synthetic tool-call demonstrations instead"),
    suite: str | None = typer.Option(
        None, help="use a task family's demonstrations instead (entry point or file.py:attr)"),
    options: str = typer.Option("{}", help="JSON options for the --suite family"),
    count: int | None = typer.Option(None, help="override sft.demonstrations (from --suite)"),
    wrong_fraction: float | None = typer.Option(None, help="override sft.wrong_fraction"),
    chat_format: str = typer.Option(
        "auto", help="auto | hermes | template | qwen2.5 | qwen3 | llama3.1 | mistral-v0.3"),
    tool_listing: str = typer.Option("json", help="json | names | none"),
    seed: int | None = typer.Option(None, help="override sft.seed"),
    config: Path | None = typer.Option(None, help="TOML or JSON learner config (its [sft] table)"),
    steps: int | None = typer.Option(None, help="override sft.steps"),
    lr: float | None = typer.Option(None, help="override sft.lr"),
    batch_size: int | None = typer.Option(None, help="override sft.batch_size"),
    metrics: str = typer.Option("console", help="comma-separated sinks"),
) -> None:
    """Supervised warm start (cross-entropy on the demonstrations' loss tokens; learner.warm_start)."""
    _quiet_transformers()
    from learner.metrics import make_sinks
    from learner.synthetic import tool_call_demonstrations
    from learner.warm_start import Formatting, Suite, read_demonstrations, warm_start

    if job is not None:
        given = [name for name, value in (("--data", data), ("--suite", suite),
                                          ("--config", config), ("--seed", seed),
                                          ("--steps", steps), ("--lr", lr)) if value is not None]
        if given or synthetic:
            raise typer.BadParameter(f"--job holds the whole warm start; drop {', '.join(given)}")
        cfg, the_suite = _warm_start_job(job)
        formatting = the_suite.formatting
    else:
        if (data is not None) + (synthetic > 0) + (suite is not None) != 1:
            raise typer.BadParameter("give exactly one of --job FILE, --data FILE, "
                                     "--synthetic N or --suite NAME")
        cfg = load_learner_config(
            config, {"sft.steps": steps, "sft.lr": lr, "sft.batch_size": batch_size,
                     "sft.seed": seed, "sft.demonstrations": count,
                     "sft.wrong_fraction": wrong_fraction})
        formatting = Formatting(chat_format, tool_listing)
        the_suite = Suite(suite, json.loads(options), formatting) if suite is not None else None
    _require_inputs(model, data)
    sinks = make_sinks([m for m in metrics.split(",") if m], out.parent / f"{out.name}-logs")
    try:
        demos = None
        if data is not None:
            demos = read_demonstrations(data)
        elif synthetic:
            from core.tokenizer import load_tokenizer

            demos = tool_call_demonstrations(load_tokenizer(model), synthetic, seed=cfg.sft.seed)
        warm_start(model, out, cfg, suite=the_suite, demonstrations=demos,
                   formatting=formatting, sinks=sinks, log=typer.echo)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    finally:
        for sink in sinks:
            sink.close()


def _warm_start_job(path: Path):
    """The learner config and suite of a job's sft.json; one error line per problem."""
    from config.errors import ConfigError, read_json, validate
    from config.learner import WarmStartJob
    from learner.warm_start import Formatting, Suite

    try:
        job = validate(WarmStartJob, read_json(path, "a warm start (the job's sft.json)"),
                       str(path))
    except ConfigError as exc:
        for problem in exc.problems:
            typer.echo(f"error: {exc.source}: {problem}", err=True)
        raise typer.Exit(2) from None
    return job.learner, Suite(job.family, job.options,
                              Formatting(job.chat_format, job.tool_listing))


@app.command("synth-data")
def synth_data_command(
    model: Path = typer.Argument(..., help="HF checkpoint to sample from"),
    out: Path = typer.Argument(..., help="directory for rl_samples.jsonl and demos.jsonl"),
    groups: int = typer.Option(4, help="prompts (groups)"),
    group_size: int = typer.Option(4, help="completions per prompt"),
    max_new_tokens: int = typer.Option(16),
    topk: int = typer.Option(8, help="record the sampler's top-k (0 = none)"),
    demos: int = typer.Option(32, help="tool-call demonstrations to write"),
    seed: int = typer.Option(0),
) -> None:
    """Write synthetic RL samples (sampled from MODEL, digit-share reward) and demonstrations."""
    _quiet_transformers()
    from dataclasses import replace

    from core.tokenizer import load_tokenizer
    from learner.batch import write_jsonl
    from learner.model import load_policy
    from learner.synthetic import sample_rl_batch, tool_call_demonstrations

    tokenizer = load_tokenizer(model)
    policy = load_policy(model)
    prompts = [f"Write number {i} in digits." for i in range(groups)]
    samples = sample_rl_batch(
        policy, tokenizer, prompts, group_size, max_new_tokens, topk=topk, seed=seed
    )
    samples = [replace(s, sequence=i + 1) for i, s in enumerate(samples)]
    write_jsonl(samples, out / "rl_samples.jsonl")
    with (out / "demos.jsonl").open("w") as fh:
        for ids, mask in tool_call_demonstrations(tokenizer, demos, seed=seed):
            fh.write(json.dumps({"token_ids": ids, "loss_mask": mask}) + "\n")
    typer.echo(f"wrote {len(samples)} RL samples and {demos} demonstrations to {out}")


def _serve_argv() -> list[str]:
    """This `serve` command line as `python -m learner serve ...` (to start peer workers),
    whether it came in through `python -m learner` or the `stalewise learner` entry point."""
    return ["-m", "learner", *sys.argv[sys.argv.index("serve"):]]


@app.command("serve")
def serve_command(
    db: str = typer.Option(..., help="the job's store URL"),
    run: str = typer.Option(..., help="run id"),
    config: Path = typer.Option(..., help="learner config as JSON (the job's [learner] section)"),
    model: Path = typer.Option(..., help="the run's starting checkpoint"),
    publish_root: Path = typer.Option(..., help="versions are published under this directory"),
    steps: int = typer.Option(..., help="stop after this many learner steps in total"),
    poll_s: float = typer.Option(0.2, help="wait between polls of the admission log"),
) -> None:
    """The learner process of a job: train on the run's admission log, publish versions."""
    _quiet_transformers()
    from config.errors import ConfigError, read_json, validate
    from config.learner import LearnerConfig
    from learner.service import serve

    try:
        cfg = validate(LearnerConfig, read_json(config, "a learner config (the job's "
                                                        "learner.json)"), str(config))
    except ConfigError as exc:
        for problem in exc.problems:
            typer.echo(f"error: {exc.source}: {problem}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(serve(db_url=db, run_id=run, cfg=cfg, model_dir=model,
                           publish_root=publish_root, steps=steps, poll_s=poll_s,
                           argv=_serve_argv()))
