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
    from collections.abc import Callable

    from config.learner import LearnerConfig, SftConfig

app = typer.Typer(no_args_is_help=True)


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


def _read_demonstrations(path: Path) -> list[tuple[list[int], list[int]]]:
    demos = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if "token_ids" not in item or "loss_mask" not in item:
            raise typer.BadParameter(f"{path}:{number}: each line needs token_ids and loss_mask")
        demos.append((item["token_ids"], item["loss_mask"]))
    return demos


def _suite_demonstrations(
    suite: str, count: int, tokenizer: object, seed: int, *, options: dict | None = None,
    wrong_fraction: float = 0.0, chat_format: str = "auto", tool_listing: str = "json",
) -> list[tuple[list[int], list[int]]]:
    """(token_ids, loss_mask) of a task family's demonstrations in the checkpoint's chat format
    (the same format the job's agent loop uses, so SFT teaches exactly what RL samples)."""
    from tasks import demonstration_samples, load_family
    from tasks.chat import make_chat_format

    family = load_family(suite, options or {})
    samples = demonstration_samples(
        family.demonstrations(count, wrong_fraction=wrong_fraction, seed=seed),
        make_chat_format(tokenizer, chat_format, tool_listing=tool_listing),
    )
    return [(list(s.token_ids), list(s.loss_mask)) for s in samples]


def _correct_demo_samples(
    suite: str, tokenizer: object, options: dict, chat_format: str, tool_listing: str,
    split: str = "eval", start: int = 0, count: int = 64,
) -> list | None:
    """The correct demonstrations of `count` `split` instances from `start`, tokenised in the
    job's chat format; None for a family without that split or demonstrations."""
    from tasks import demonstration_samples, load_family
    from tasks.chat import make_chat_format

    family = load_family(suite, options)
    if split not in family.splits or not family.has_demonstrations:
        return None
    demos = [family.demonstration(task, True)
             for task in family.instances(split, start, count)]
    return demonstration_samples(
        demos, make_chat_format(tokenizer, chat_format, tool_listing=tool_listing))


def _demo_probability(learner: object, samples: list) -> tuple[int, float] | None:
    """(instances, mean probability) that a temperature-1 sample of the checkpoint reproduces
    each instance's correct demonstration in `samples`, every turn of it. A lower bound on
    success (other answers may be right too) that needs no sandbox: a warm start near 0 gives
    RL nothing."""
    import math
    from collections import defaultdict

    from learner.sft import loss_token_logprobs

    sums = loss_token_logprobs(learner, [(s.token_ids, s.loss_mask) for s in samples])
    per_task: dict[str, float] = defaultdict(float)
    for sample, logprob in zip(samples, sums):
        per_task[sample.task_key] += logprob  # a demonstration may span several segments
    if not per_task:
        return None
    return len(per_task), sum(math.exp(v) for v in per_task.values()) / len(per_task)


def _run_stages(learner: object, cfg: LearnerConfig, chat_format: str,
                tool_listing: str) -> list[dict]:
    """The `[[sft.stages]]` curriculum, in order, before the main demonstrations; each stage
    prints its loss and returns a summary for the checkpoint's stalewise.json."""
    from learner.sft import run_sft

    done = []
    for number, stage in enumerate(cfg.sft.stages):
        stage_cfg = cfg.sft.for_stage(stage)
        try:
            demos = _suite_demonstrations(stage.family, stage_cfg.demonstrations,
                                          learner.tokenizer, cfg.sft.seed,
                                          options=stage.options,
                                          wrong_fraction=stage_cfg.wrong_fraction,
                                          chat_format=chat_format, tool_listing=tool_listing)
            result = run_sft(learner, demos, stage_cfg)
        except ValueError as exc:
            raise ValueError(f"sft.stages[{number}] ({stage.family}): {exc}") from None
        typer.echo(f"sft stage {number} ({stage.family}) on {len(demos)} demonstrations, "
                   f"{stage_cfg.steps} steps: loss {result.loss_before:.4f} -> "
                   f"{result.loss_after:.4f}")
        done.append({"family": stage.family, "steps": stage_cfg.steps,
                     "loss_before": result.loss_before, "loss_after": result.loss_after})
    return done


def _try_settings(sft: SftConfig) -> list[dict]:
    """What each try of `run_sft` may run with: the schedule and order of `sft.tries()`."""
    return [{"steps": t.steps, "lr": t.lr, "lr_schedule": t.lr_schedule,
             "warmup_steps": t.warmup_steps, "shuffle_seed": t.seed} for t in sft.tries()]


def _describe(settings: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in settings.items())


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
    """Supervised warm start (cross-entropy on the demonstrations' loss tokens)."""
    _quiet_transformers()
    from learner.metrics import make_sinks
    from learner.publish import machine_numerics, write_checkpoint
    from learner.sft import run_sft
    from learner.synthetic import tool_call_demonstrations
    from learner.trainer import Learner

    if (data is not None) + (synthetic > 0) + (suite is not None) != 1:
        raise typer.BadParameter("give exactly one of --data FILE, --synthetic N or --suite NAME")
    cfg = load_learner_config(
        config, {"sft.steps": steps, "sft.lr": lr, "sft.batch_size": batch_size, "sft.seed": seed,
                 "sft.demonstrations": count, "sft.wrong_fraction": wrong_fraction}
    )
    sinks = make_sinks([m for m in metrics.split(",") if m], out.parent / f"{out.name}-logs")
    try:
        learner = Learner(model, cfg, sinks=sinks)
        stages = _run_stages(learner, cfg, chat_format, tool_listing)
        if data is not None:
            demos = _read_demonstrations(data)
        elif suite is not None:
            demos = _suite_demonstrations(suite, cfg.sft.demonstrations, learner.tokenizer,
                                          cfg.sft.seed, options=json.loads(options),
                                          wrong_fraction=cfg.sft.wrong_fraction,
                                          chat_format=chat_format,
                                          tool_listing=tool_listing)
        else:
            demos = tool_call_demonstrations(learner.tokenizer, synthetic, seed=cfg.sft.seed)
        score: Callable[[], float] | None = None
        if suite is not None and cfg.sft.select_every > 0:
            # train instances after the demonstrated ones (demonstrations take train 0..N-1):
            # never demonstrated, and never eval instances, so the held-out check stays clean;
            # tokenised once, scored at every selection step
            unseen = _correct_demo_samples(suite, learner.tokenizer, json.loads(options),
                                           chat_format, tool_listing, "train",
                                           cfg.sft.demonstrations, cfg.sft.select_instances)
            if not unseen:
                raise ValueError(f"sft.select_every needs a family with demonstrations; "
                                 f"{suite} has none")

            first = learner.step  # after the stages; select_scores count from here

            def score() -> float:  # printed as it goes: a long SFT shows whether the skill forms
                value = _demo_probability(learner, unseen)[1]
                typer.echo(f"step {learner.step} [select] {suite} step {learner.step - first}: "
                           f"mean probability of the correct demonstration on {len(unseen)} "
                           f"never-demonstrated train instances: {value:.1%}")
                return value

        result = run_sft(learner, demos, score=score)
        tried = _try_settings(cfg.sft)
        heldout = None
        if suite is not None:
            held = _correct_demo_samples(suite, learner.tokenizer, json.loads(options),
                                         chat_format, tool_listing)
            heldout = _demo_probability(learner, held) if held else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    finally:
        for sink in sinks:
            sink.close()
    write_checkpoint(
        learner.policy,
        model,
        out,
        {
            "sft_steps": tried[result.kept_try or 0]["steps"],
            "loss_before": result.loss_before,
            "loss_after": result.loss_after,
            "stages": stages,
            "numerics": machine_numerics(),
            **({"select_scores": result.scores, "kept_step": result.kept_step}
               if result.kept_step is not None else {}),
            **({"tries": [{"settings": settings, "scores": scores} for settings, scores in
                          zip(tried, result.tries)],
                "kept_try": result.kept_try} if result.tries else {}),
            **({"heldout_instances": heldout[0], "heldout_demo_probability": heldout[1]}
               if heldout else {}),
        },
    )
    if result.kept_step is not None:
        typer.echo(
            "checkpoint selection on never-demonstrated train instances (step: mean probability "
            "of the correct demonstration): "
            + ", ".join(f"{step}: {value:.1%}" for step, value in result.scores.items())
            + f"; kept step {result.kept_step}")
    if len(result.tries) > 1:
        typer.echo(
            f"sft retries (a try whose best score stays below restart_below = "
            f"{cfg.sft.restart_below:.0%} starts the next): "
            + "; ".join(f"try {number} ({_describe(settings)}) best {max(scores.values()):.1%}"
                        for number, (settings, scores) in
                        enumerate(zip(tried, result.tries)))
            + f"; kept try {result.kept_try} (its scores above)")
    if heldout:
        typer.echo(
            f"held-out check: a temperature-1 sample reproduces the correct demonstration of "
            f"{heldout[0]} eval instances with mean probability {heldout[1]:.1%} (a lower "
            "bound on success; near 0 means RL will see no reward: train longer or change lr)"
        )
    typer.echo(
        f"sft on {len(demos)} demonstrations: loss {result.loss_before:.4f} -> "
        f"{result.loss_after:.4f} (nats per loss token); checkpoint in {out}"
    )


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
