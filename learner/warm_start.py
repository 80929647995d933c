"""The warm start: supervised fine-tuning on demonstrations, from the checkpoint to a new one.

`warm_start(model, out, cfg, demonstrations)` runs the `[[sft.stages]]` curriculum, then SFT on
the demonstrations (`learner.sft.run_sft`: checkpoint selection and retries included), and
writes the checkpoint to `out` with what it measured in `stalewise.json` (steps, losses, the
selection scores and the kept step, every try, the validation check and the machine numerics
the path depends on). The demonstrations come from a task family (`Suite`: the job's warm start,
and `stalewise learner sft --suite`), a JSON-lines file, or the synthetic tool-call set.

A suite's demonstrations are tokenised in the job's chat format, so SFT teaches exactly what
RL samples. Both measurements read the validation split, never train or test: checkpoint
selection scores validation instances 0..`select_instances`, and the validation check of the
kept checkpoint reads the `CHECK_INSTANCES` after them (so the figure is not the maximum
selection chose). `log` gets each line a user
reads while it runs (each selection score as it is measured, then the summary).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from config.learner import LearnerConfig, SftConfig
from learner.trainer import Learner

Demonstration = tuple[list[int], list[int]]  # token ids, loss mask
CHECK_INSTANCES = 64  # validation instances of the check of the kept checkpoint


@dataclass(frozen=True)
class Formatting:
    """The chat format demonstrations are tokenised in (what the job's agent loop uses)."""

    chat_format: str = "auto"
    tool_listing: str = "json"

    def demonstrations(self, tokenizer: object, family: str, options: dict[str, Any],
                       count: int, seed: int, wrong_fraction: float = 0.0
                       ) -> list[Demonstration]:
        """`count` demonstrations of `family`."""
        from tasks import demonstration_samples, load_family

        loaded = load_family(family, options)
        samples = demonstration_samples(
            loaded.demonstrations(count, wrong_fraction=wrong_fraction, seed=seed),
            self._of(tokenizer))
        return [(list(s.token_ids), list(s.loss_mask)) for s in samples]

    def correct_samples(self, tokenizer: object, family: str, options: dict[str, Any],
                        split: str, start: int, count: int) -> list | None:
        """The correct demonstrations of `count` `split` instances of `family` from `start`;
        None for a family without that split or without demonstrations."""
        from tasks import demonstration_samples, load_family

        loaded = load_family(family, options)
        if split not in loaded.splits or not loaded.has_demonstrations:
            return None
        demos = [loaded.demonstration(task, True)
                 for task in loaded.instances(split, start, count)]
        return demonstration_samples(demos, self._of(tokenizer))

    def _of(self, tokenizer: object):
        from tasks.chat import make_chat_format

        return make_chat_format(tokenizer, self.chat_format, tool_listing=self.tool_listing)


@dataclass(frozen=True)
class Suite:
    """The task family whose demonstrations the warm start trains on."""

    family: str
    options: dict[str, Any]
    formatting: Formatting = Formatting()

    def demonstrations(self, tokenizer: object, count: int, seed: int,
                       wrong_fraction: float = 0.0) -> list[Demonstration]:
        return self.formatting.demonstrations(tokenizer, self.family, self.options, count,
                                              seed, wrong_fraction)

    def correct_samples(self, tokenizer: object, split: str, start: int,
                        count: int) -> list | None:
        return self.formatting.correct_samples(tokenizer, self.family, self.options, split,
                                               start, count)


def read_demonstrations(path: Path) -> list[Demonstration]:
    """JSON lines with `token_ids` and `loss_mask`; a bad line is a ValueError naming it."""
    demos = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict) or "token_ids" not in item or "loss_mask" not in item:
            raise ValueError(f"{path}:{number}: each line needs token_ids and loss_mask")
        demos.append((item["token_ids"], item["loss_mask"]))
    return demos


def demo_probability(learner: Learner, samples: list) -> tuple[int, float] | None:
    """(instances, mean probability) that a temperature-1 sample of the checkpoint reproduces
    each instance's correct demonstration in `samples`, every turn of it. A lower bound on
    success (other answers may be right too) that needs no sandbox: a warm start near 0 gives
    RL nothing."""
    from learner.sft import loss_token_logprobs

    sums = loss_token_logprobs(learner, [(s.token_ids, s.loss_mask) for s in samples])
    per_task: dict[str, float] = defaultdict(float)
    for sample, logprob in zip(samples, sums):
        per_task[sample.task_key] += logprob  # a demonstration may span several segments
    if not per_task:
        return None
    return len(per_task), sum(math.exp(v) for v in per_task.values()) / len(per_task)


def run_stages(learner: Learner, cfg: LearnerConfig, formatting: Formatting,
               log: Callable[[str], None]) -> list[dict]:
    """The `[[sft.stages]]` curriculum, in order, before the main demonstrations; a summary of
    each for the checkpoint's stalewise.json."""
    from learner.sft import run_sft

    done = []
    for number, stage in enumerate(cfg.sft.stages):
        stage_cfg = cfg.sft.for_stage(stage)
        try:
            demos = formatting.demonstrations(learner.tokenizer, stage.family, stage.options,
                                              stage_cfg.demonstrations, cfg.sft.seed,
                                              stage_cfg.wrong_fraction)
            result = run_sft(learner, demos, stage_cfg)
        except ValueError as exc:
            raise ValueError(f"sft.stages[{number}] ({stage.family}): {exc}") from None
        log(f"sft stage {number} ({stage.family}) on {len(demos)} demonstrations, "
            f"{stage_cfg.steps} steps: loss {result.loss_before:.4f} -> {result.loss_after:.4f}")
        done.append({"family": stage.family, "steps": stage_cfg.steps,
                     "loss_before": result.loss_before, "loss_after": result.loss_after})
    return done


def try_settings(sft: SftConfig) -> list[dict]:
    """What each try of `run_sft` may run with: the schedule and order of `sft.tries()`."""
    return [{"steps": t.steps, "lr": t.lr, "lr_schedule": t.lr_schedule,
             "warmup_steps": t.warmup_steps, "shuffle_seed": t.seed} for t in sft.tries()]


def _selection_score(learner: Learner, cfg: LearnerConfig, suite: Suite,
                     log: Callable[[str], None]) -> Callable[[], float]:
    """The checkpoint-selection score: the mean probability of the correct demonstration on
    validation instances (tokenised once, scored at every selection step, printed as it goes:
    a long SFT shows whether the skill forms)."""
    unseen = suite.correct_samples(learner.tokenizer, "validation", 0, cfg.sft.select_instances)
    if not unseen:
        raise ValueError(f"sft.select_every needs a family with demonstrations; "
                         f"{suite.family} has none")
    first = learner.step  # after the stages; select_scores count from here

    def score() -> float:
        value = demo_probability(learner, unseen)[1]
        log(f"step {learner.step} [select] {suite.family} step {learner.step - first}: mean "
            f"probability of the correct demonstration on {len(unseen)} validation "
            f"instances: {value:.1%}")
        return value

    return score


def warm_start(model: Path, out: Path, cfg: LearnerConfig, *, suite: Suite | None = None,
               demonstrations: Sequence[Demonstration] | None = None,
               formatting: Formatting | None = None, sinks: Sequence = (),
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """SFT from `model` to a checkpoint in `out` (module docstring); returns what was written
    to its stalewise.json. Without `demonstrations`, `suite` gives them; the stages are
    tokenised in `formatting` (the suite's by default)."""
    from learner.publish import machine_numerics, write_checkpoint
    from learner.sft import run_sft

    learner = Learner(model, cfg, sinks=sinks)
    formatting = formatting or (suite.formatting if suite is not None else Formatting())
    stages = run_stages(learner, cfg, formatting, log)
    if demonstrations is None:
        assert suite is not None, "give demonstrations or a suite"
        demonstrations = suite.demonstrations(learner.tokenizer, cfg.sft.demonstrations,
                                              cfg.sft.seed, wrong_fraction=cfg.sft.wrong_fraction)
    score = (_selection_score(learner, cfg, suite, log)
             if suite is not None and cfg.sft.select_every > 0 else None)
    result = run_sft(learner, demonstrations, score=score)
    tried = try_settings(cfg.sft)
    held = (suite.correct_samples(learner.tokenizer, "validation", cfg.sft.select_instances,
                                  CHECK_INSTANCES) if suite is not None else None)
    checked = demo_probability(learner, held) if held else None
    facts = {
        "sft_steps": tried[result.kept_try or 0]["steps"],
        "loss_before": result.loss_before, "loss_after": result.loss_after,
        "stages": stages, "numerics": machine_numerics(learner.precision.dtype), "seed": cfg.sft.seed,
        **({"select_scores": result.scores, "kept_step": result.kept_step}
           if result.kept_step is not None else {}),
        **({"tries": [{"settings": settings, "scores": scores} for settings, scores in
                      zip(tried, result.tries)], "kept_try": result.kept_try}
           if result.tries else {}),
        **({"validation_instances": checked[0], "validation_demo_probability": checked[1]}
           if checked else {}),
    }
    write_checkpoint(learner.policy, model, out, facts)
    _summarise(result, tried, cfg.sft, checked, len(demonstrations), out, log)
    return facts


def _summarise(result, tried: list[dict], sft: SftConfig, checked: tuple[int, float] | None,
               count: int, out: Path, log: Callable[[str], None]) -> None:
    if result.kept_step is not None:
        log("checkpoint selection on validation instances (step: mean probability "
            "of the correct demonstration): "
            + ", ".join(f"{step}: {value:.1%}" for step, value in result.scores.items())
            + f"; kept step {result.kept_step}")
    if len(result.tries) > 1:
        describe = lambda settings: ", ".join(f"{k} {v}" for k, v in settings.items())  # noqa: E731
        log(f"sft retries (a try whose best score stays below restart_below = "
            f"{sft.restart_below:.0%} starts the next): "
            + "; ".join(f"try {number} ({describe(settings)}) best {max(scores.values()):.1%}"
                        for number, (settings, scores) in enumerate(zip(tried, result.tries)))
            + f"; kept try {result.kept_try} (its scores above)")
    if checked:
        log(f"validation check: a temperature-1 sample reproduces the correct demonstration of "
            f"{checked[0]} validation instances with mean probability {checked[1]:.1%} (a lower "
            "bound on success; near 0 means RL will see no reward: train longer or change lr)")
    log(f"sft on {count} demonstrations: loss {result.loss_before:.4f} -> "
        f"{result.loss_after:.4f} (nats per loss token); checkpoint in {out}")
