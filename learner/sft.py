"""Supervised warm start: cross-entropy on the loss tokens of demonstrations.

`run_sft` takes (token_ids, loss_mask) pairs (the task suites' demonstration generators, or
`learner.synthetic.tool_call_demonstrations`), trains the `Learner`'s policy with its own
AdamW for `SftConfig.steps` steps of `batch_size` demonstrations (reshuffled each pass, split
into micro-batches that share the batch's token count as denominator) and reports the mean
cross-entropy per loss token over all demonstrations before and after. Each step's report goes
to the learner's sinks with mode "sft".

With `SftConfig.select_every` and a `score` function (higher is better, measured on instances
the demonstrations do not cover), the checkpoint is scored every `select_every` steps and at
the end, and the best-scoring weights are kept: a warm start that has begun to fit its own
demonstrations at the expense of new instances goes back to the step where it generalised best.

With `SftConfig.restart_below` and `retries` as well, a try whose best score stays below it is
followed by another from the same starting weights with the next retry's settings (another
schedule length, lr or order), and the best try is kept. A tiny model learning a long task can
settle in a plateau under one schedule that another escapes (docs/tasks.md shows one); the
score reads train instances only, so the choice never looks at the eval split.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from config.learner import SftConfig
from learner.batch import TrainingSample, demonstration
from learner.losses import aggregate
from learner.metrics import StepReport
from learner.model import policy_outputs
from learner.tensors import collate
from learner.trainer import Learner


@dataclass(frozen=True)
class SftResult:
    loss_before: float  # nats per loss token over all demonstrations
    loss_after: float
    step_losses: list[float]
    scores: dict[int, float] = field(default_factory=dict)  # step -> score, when selecting
    kept_step: int | None = None  # the step whose weights were kept, when selecting
    tries: list[dict[int, float]] = field(default_factory=list)  # each try's scores, retrying
    kept_try: int | None = None  # index into `tries` of the try whose weights were kept


def sft_loss(
    learner: Learner, samples: Sequence[TrainingSample], micro_batch_size: int = 16
) -> float:
    """Mean cross-entropy per loss token over `samples`, without gradient."""
    count = sum(float(sum(s.loss_mask[1:])) for s in samples)
    return -sum(_loss_token_sums(learner, samples, micro_batch_size)) / max(count, 1.0)


def loss_token_logprobs(
    learner: Learner, demonstrations: Sequence[tuple[Sequence[int], Sequence[int]]],
    micro_batch_size: int = 16,
) -> list[float]:
    """Per (token_ids, loss_mask): the summed log-probability of its loss tokens given the rest.

    exp of it is the probability that sampling at temperature 1 writes exactly those tokens
    (the demonstrated assistant turns, with the demonstrated observations in between)."""
    samples = [demonstration(ids, mask, i) for i, (ids, mask) in enumerate(demonstrations)]
    return _loss_token_sums(learner, samples, micro_batch_size)


def _loss_token_sums(learner: Learner, samples: Sequence[TrainingSample],
                     micro_batch_size: int) -> list[float]:
    if not samples:
        return []
    batch = collate(samples, learner.pad_id, learner.device)
    sums: list[float] = []
    learner.policy.eval()
    with torch.no_grad(), learner.precision.compute():
        for start in range(0, batch.size, micro_batch_size):
            sub = batch.rows(start, min(start + micro_batch_size, batch.size))
            out = policy_outputs(learner.policy, sub.input_ids_B_T, sub.attention_mask_B_T)
            picked = out.logprobs_B_Tm1.masked_fill(~sub.loss_mask_B_Tm1, 0.0)
            sums.extend(picked.sum(-1).tolist())
    learner.policy.train()
    return sums


def sft_step(
    learner: Learner,
    samples: Sequence[TrainingSample],
    optimizer: torch.optim.Optimizer,
    sft: SftConfig,
) -> StepReport:
    """One optimizer step of token-mean cross-entropy over `samples`."""
    started, t0 = time.time(), time.perf_counter()
    batch = collate(samples, learner.pad_id, learner.device)
    denominator = batch.loss_mask_B_Tm1.sum().clamp(min=1)
    optimizer.zero_grad(set_to_none=True)
    loss_value = 0.0
    for start in range(0, batch.size, sft.micro_batch_size):
        sub = batch.rows(start, min(start + sft.micro_batch_size, batch.size))
        with learner.precision.compute():
            out = policy_outputs(learner.policy, sub.input_ids_B_T, sub.attention_mask_B_T)
        loss = aggregate(-out.logprobs_B_Tm1, sub.loss_mask_B_Tm1, "token_mean",
                         denominator=denominator)
        loss.backward()
        loss_value += loss.item()
    norm = torch.nn.utils.clip_grad_norm_(
        learner.policy.parameters(), sft.max_grad_norm or math.inf
    )
    optimizer.step()
    elapsed = time.perf_counter() - t0
    learner.step += 1
    report = StepReport(
        step=learner.step,
        mode="sft",
        num_samples=batch.size,
        num_tokens=int(batch.loss_mask_B_Tm1.sum().item()),
        loss=loss_value,
        policy_version=learner.version,
        metrics={
            "sft/loss": loss_value,
            "learner/grad_norm": float(norm),
            "time/step_s": elapsed,
            "perf/tokens_per_s": int(batch.attention_mask_B_T.sum()) / elapsed,
        },
        started_at=started,
        finished_at=time.time(),
    )
    for sink in learner.sinks:
        sink.write(report)
    return report


def lr_factor(sft: SftConfig, step: int) -> float:
    """The multiple of `sft.lr` used by optimizer step `step` (0-based)."""
    if step < sft.warmup_steps:
        return (step + 1) / sft.warmup_steps
    if sft.lr_schedule == "constant":
        return 1.0
    decay_steps = max(1, sft.steps - sft.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - sft.warmup_steps) / decay_steps)))


def run_sft(
    learner: Learner,
    demonstrations: Sequence[tuple[Sequence[int], Sequence[int]]],
    sft: SftConfig | None = None,
    score: Callable[[], float] | None = None,
) -> SftResult:
    """Supervised warm start on (token_ids, loss_mask) pairs; with `score` and
    `sft.select_every`, the best-scoring of the checkpoints every `select_every` steps, and with
    `sft.restart_below`, a further try with each of `sft.retries`' settings in turn while the
    best score so far stays below it (the best try is kept)."""
    sft = sft or learner.cfg.sft
    selecting = score is not None and sft.select_every > 0
    samples = [demonstration(ids, mask, i) for i, (ids, mask) in enumerate(demonstrations)]
    if not samples:
        raise ValueError("run_sft: no demonstrations")
    before = sft_loss(learner, samples)
    retrying = selecting and sft.restart_below > 0
    settings = sft.tries() if retrying else [sft]
    start = (learner.step, _weights(learner)) if retrying else None
    tries: list[_Try] = []
    for number, cfg in enumerate(settings):
        if number:
            assert start is not None
            learner.step = start[0]
            learner.policy.load_state_dict(start[1])
        tries.append(_one_try(learner, samples, cfg, score if selecting else None))
        if not retrying or max(t.best_score for t in tries) >= sft.restart_below:
            break
    kept = max(range(len(tries)), key=lambda i: tries[i].best_score)
    best = tries[kept]
    if best.weights is not None:
        learner.policy.load_state_dict(best.weights)
    if start is not None:
        learner.step = start[0] + len(best.losses)
    return SftResult(before, sft_loss(learner, samples), best.losses, best.scores,
                     best.kept_step, [t.scores for t in tries] if retrying else [],
                     kept if retrying else None)


@dataclass
class _Try:
    losses: list[float]
    scores: dict[int, float]
    kept_step: int | None
    weights: dict[str, torch.Tensor] | None  # the kept step's (None when not selecting)

    @property
    def best_score(self) -> float:
        return max(self.scores.values(), default=-math.inf)


def _weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.policy.state_dict().items()}


def _one_try(learner: Learner, samples: list[TrainingSample], sft: SftConfig,
             score: Callable[[], float] | None) -> _Try:
    optimizer = torch.optim.AdamW(
        learner.policy.parameters(), lr=sft.lr, weight_decay=sft.weight_decay
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, sft))
    generator = torch.Generator().manual_seed(sft.seed)
    losses: list[float] = []
    order: list[int] = []
    scores: dict[int, float] = {}
    kept: tuple[int, dict[str, torch.Tensor]] | None = None  # (step, weights) scoring best
    for _ in range(sft.steps):
        if len(order) < sft.batch_size:
            order += torch.randperm(len(samples), generator=generator).tolist()
        picked, order = order[: sft.batch_size], order[sft.batch_size :]
        losses.append(sft_step(learner, [samples[i] for i in picked], optimizer, sft).loss)
        schedule.step()
        done = len(losses)
        if score is not None and (done % sft.select_every == 0 or done == sft.steps):
            scores[done] = score()
            if kept is None or scores[done] > scores[kept[0]]:
                kept = (done, _weights(learner))
    return _Try(losses, scores, *(kept or (None, None)))
