"""The learner process's core: RL steps on admitted trajectories, and weight publishing.

`Learner` owns the policy, its optimizer, the optional critic and KL reference; supervised
warm starts on the same `Learner` are in `learner.sft`. One RL learner step, read top to
bottom in `rl_step`:
1. rewards (DAPO's overlong penalty is admission's), optional removal of zero-variance groups;
2. padded tensors with loss masks from the samples' per-token data;
3. `StepTensors`: a no-grad pass at the current weights (proximal log-probs pi_old, reference
   log-probs when kl_coef > 0, critic values for gae), then advantages (group baselines, or
   GAE from the critic's values);
4. `epochs` passes; each mini-batch is one optimizer step, accumulated over micro-batches.
   Every micro-batch divides by the whole mini-batch's `Denominators`, so the gradient equals
   the unsplit mini-batch's gradient whatever the micro-batch size; the segments of one
   trajectory count as one sequence in every `seq_*` aggregation;
   With `[learner] workers` > 1 (`learner.distributed`) each rank trains on whole groups of
   the batch, the `Denominators` are summed over the ranks and DDP sums the gradients, so each
   optimizer step's gradient is the single-process gradient of the rows it covers;
5. AdamW with gradient clipping and linear warm-up; the critic has its own AdamW;
6. a `StepReport` with the loss diagnostics to every sink, then, every `publish_every`
   steps, publish-then-mark of the next policy version.

Guarantees: samples are consumed in sequence order, each once (`last_sequence` advances only
after a completed step); the version a step trained from is in its report; a version is
marked only after its directory is complete.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from config.learner import LearnerConfig
from core.tokenizer import load_tokenizer
from learner.advantages import (
    gae,
    masked_whiten,
    trajectory_advantages,
    zero_variance_groups,
)
from learner.batch import SampleSource, TrainingSample, take_batch
from learner.distributed import (
    SINGLE,
    Workers,
    combine_metrics,
    placeholder,
    shard_groups,
    split_rows,
)
from learner.losses import (
    PolicyLossInputs,
    ScoreCenteringInputs,
    aggregate,
    aggregation_denominator,
    behaviour_weights,
    ess_fraction,
    ess_sums,
    policy_loss,
    score_centering_loss,
    sequence_tokens,
    token_entropy,
    trajectory_log_ratios,
)
from learner.metrics import MetricsSink, StepReport
from learner.model import Precision, ValueModel, load_policy, policy_outputs
from learner.publish import MarkPublished, publish_version, read_tokenizer_files
from learner.tensors import PaddedBatch, collate
from learner.turn_credit import TURN_ESTIMATORS, token_turn_advantages

SUMMED_PER_OPTIMIZER_STEP = ("loss/policy", "score_centering/loss", "critic/loss")


class _MetricMean:
    """Token-weighted mean over micro-batches; `*_max` keys take the max."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict[str, float], weight: float) -> None:
        for key, value in metrics.items():
            if key in SUMMED_PER_OPTIMIZER_STEP or key == "loss/tokens":
                continue
            if key.endswith("_max"):
                self.sums[key] = max(self.sums.get(key, -math.inf), value)
                self.weights[key] = 1.0
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value * weight
                self.weights[key] = self.weights.get(key, 0.0) + weight

    def result(self) -> dict[str, float]:
        return {
            k: (v if k.endswith("_max") else v / max(self.weights[k], 1e-12))
            for k, v in self.sums.items()
        }


def _cut(t: torch.Tensor | None, rows: slice, length: int) -> torch.Tensor | None:
    return None if t is None else t[rows, :length]


def _sum_gradients(_state, bucket):  # DDP checks these annotations at run time: none
    """DDP communication hook: gradients are summed over the ranks, not averaged (every rank's
    loss is already divided by the whole batch's denominators)."""
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


@dataclass(frozen=True)
class StepTensors:
    """What one learner step computes once, before its optimizer steps.

    Per-token tensors are in the batch's shifted space (`_B_Tm1`, see `learner.tensors`);
    `advantages` is (B,) for group baselines or (B, T-1) for GAE.
    """

    batch: PaddedBatch
    proximal_logprobs_B_Tm1: torch.Tensor
    reference_logprobs_B_Tm1: torch.Tensor | None
    old_values_B_Tm1: torch.Tensor | None
    advantages: torch.Tensor
    returns_B_Tm1: torch.Tensor | None
    proximal_entropy_B_Tm1: torch.Tensor | None = None  # with `loss.correction_entropy`
    # each row's trajectory's log importance ratio log pi_old - log mu over its sampled tokens
    # (VCPO: `advantage.baseline = "min_variance"`, `optimizer.ess_lr`)
    trajectory_log_ratio_B: torch.Tensor | None = None

    def advantages_of(self, rows: slice, length: int) -> torch.Tensor:
        a = self.advantages
        return a[rows] if a.dim() == 1 else a[rows, :length]


@dataclass(frozen=True)
class Denominators:
    """One optimizer step's normalisers, shared by its micro-batches so that their gradients
    add up to the unsplit mini-batch's. `*_sequence_tokens_B` are indexed by batch row and
    count a trajectory's loss tokens over all its rows (per-trajectory aggregation)."""

    policy: torch.Tensor
    policy_sequence_tokens_B: torch.Tensor
    centering: torch.Tensor | None
    centering_sequence_tokens_B: torch.Tensor
    value: torch.Tensor


class Learner:
    """Owns the policy, its optimizer, the optional critic and reference model. With several
    workers, `close()` it before the process group is left."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: LearnerConfig,
        *,
        publish_root: str | Path | None = None,
        mark_published: MarkPublished | None = None,
        sinks: Sequence[MetricsSink] = (),
        version: int = 0,
        step: int = 0,
        last_sequence: int = 0,
        workers: Workers = SINGLE,
    ) -> None:
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.tokenizer = load_tokenizer(model_dir)
        # read now: a restarted learner starts from a published version that pruning deletes
        self.tokenizer_files = read_tokenizer_files(model_dir)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        self.precision = Precision.resolve(cfg.dtype, model_dir, cfg.device)
        self.policy = load_policy(model_dir, cfg.device)
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(),
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        self.workers = workers
        # forward passes that build a graph go through DDP when data-parallel (learner.distributed)
        self.train_policy: torch.nn.Module = self._data_parallel(self.policy)
        self.reference: torch.nn.Module | None = None
        if cfg.loss.kl_coef > 0:
            self.reference = load_policy(cfg.reference_model or model_dir, cfg.device)
            self.reference.eval().requires_grad_(False)
        self.critic: ValueModel | None = None
        if cfg.advantage.estimator == "gae":
            self.critic = ValueModel(model_dir).to(self.device)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=cfg.critic.lr)
        self.train_critic = None if self.critic is None else self._data_parallel(self.critic)
        self.publish_root = Path(publish_root) if publish_root is not None else None
        self.mark_published = mark_published
        self.sinks = list(sinks)
        self.version = version
        self.step = step
        self.last_sequence = last_sequence
        self.optimizer_steps = 0
        self.lr_scale = 1.0  # VCPO (`optimizer.ess_lr`): set per learner step
        # called with (step, version, samples, log-probs B x T-1) after each no-grad pass
        self.logprob_observers: list[Callable[..., None]] = []

    def _data_parallel(self, module: torch.nn.Module) -> torch.nn.Module:
        """`module` itself, or with several workers a DDP wrapper that sums its gradients."""
        if not self.workers.parallel:
            return module
        cuda = self.device.type == "cuda"
        wrapped = DistributedDataParallel(
            module, device_ids=[self.device] if cuda else None, broadcast_buffers=False)
        wrapped.register_comm_hook(None, _sum_gradients)
        return wrapped

    def close(self) -> None:
        """Let go of the DDP wrappers, which hold the process group's backend: a data-parallel
        rank calls this before `learner.distributed.leave_process_group`, after its last step
        (a closed data-parallel learner would no longer sum gradients over the ranks).
        Idempotent."""
        self.train_policy = self.policy
        self.train_critic = self.critic

    # ------------------------------------------------------------------ the batch loop
    def run(
        self,
        source: SampleSource | None,
        *,
        until_step: int | None = None,
        train_partial_last_batch: bool = True,
        poll_s: float = 0.5,
        on_report: Callable[[StepReport], None] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> list[StepReport]:
        """Consume `source` batch by batch from `last_sequence` until step `until_step` (None:
        until the source is finished).

        A batch short of `batch_size` waits for more samples; once the source says nothing
        more will come, it is trained on (`train_partial_last_batch`) or the loop ends."""
        reports: list[StepReport] = []
        while until_step is None or self.step < until_step:
            action, batch, peers = self.workers.broadcast(
                self._next_batch(source, train_partial_last_batch)
                if self.workers.is_main else None)
            if action == "wait":
                time.sleep(poll_s)
                continue
            if action == "stop":
                if log is not None and self.workers.is_main:
                    log("stream finished before the last step")
                break
            report = self.rl_step(batch, baseline_peers=peers)
            reports.append(report)
            if on_report is not None:
                on_report(report)
        return reports

    def _next_batch(self, source: SampleSource | None, train_partial_last_batch: bool
                    ) -> tuple[str, list[TrainingSample], list[tuple[object, float]]]:
        """What to do next: ("train", batch, baseline peers), ("wait", ...) or ("stop", ...).
        Only rank 0 reads the source; the other ranks receive its decision."""
        if source is None:
            raise ValueError("Learner.run: rank 0 needs a sample source")
        batch = take_batch(source, self.last_sequence, self.cfg.batch_size)
        if len(batch) < self.cfg.batch_size:
            if not source.finished(batch[-1].sequence if batch else self.last_sequence):
                return "wait", [], []
            if not (batch and train_partial_last_batch):
                return "stop", [], []
        return "train", batch, list(source.peers(batch))

    # ------------------------------------------------------------------ one RL step
    def rl_step(self, samples: Sequence[TrainingSample], *,
                baseline_peers: Sequence[tuple[object, float]] = ()) -> StepReport:
        """One learner step on `samples` (a whole batch); returns its report.

        `baseline_peers` are (group_id, reward) of other admitted members of the batch's groups
        that are not in this batch (streamed groups): they enter the group baselines only."""
        started = time.time()
        consumed = list(samples)
        if not consumed:
            raise ValueError("rl_step: no samples")
        kept, rewards, extra = self._rewards(consumed)
        if not kept:  # every group had zero variance and was dropped: nothing to train on
            return self._finish(self._report(consumed, extra, started), consumed, updated=False)

        mini_batches = self._mini_batch_count(len(kept))
        kept, rewards, placeholders = self._share(kept, rewards, mini_batches)
        batch = collate(
            kept, self.pad_id, self.device, need_topk=self.cfg.score_centering is not None
        )
        t0 = time.perf_counter()
        selection_B = torch.tensor([s.selection_weight for s in kept], dtype=torch.float32)
        turn_B_Tm1 = None
        if self.cfg.advantage.estimator in TURN_ESTIMATORS:  # per-turn credit, token by token
            turn_B_Tm1 = token_turn_advantages(
                kept, batch.input_ids_B_T.shape[1], self.cfg.advantage.estimator,
                self.cfg.advantage.eps)[:, 1:].to(self.device)
        step = self._step_tensors(batch, rewards.to(self.device), baseline_peers,
                                  selection_B.to(self.device), turn_B_Tm1)
        t_proximal = time.perf_counter() - t0
        self._observe_logprobs(kept[:len(kept) - placeholders], step.proximal_logprobs_B_Tm1)
        self.lr_scale = 1.0
        if self.cfg.optimizer.ess_lr:  # VCPO: the step's lr times its ratios' ESS fraction
            real = batch.size - placeholders
            self.lr_scale = ess_fraction(self.workers.sum(ess_sums(
                step.trajectory_log_ratio_B[:real], batch.trajectory_index_B[:real])))
        gaps = self._precision_gaps(step) if self.cfg.gap_probe else {}

        t0 = time.perf_counter()
        totals = _MetricMean()
        step_losses: list[dict[str, float]] = []
        grad_norms: list[float] = []
        for epoch in range(self.cfg.epochs):
            for index, rows in enumerate(self._mini_batches(batch.size, mini_batches)):
                losses, grad_norm = self._optimizer_step(
                    step, rows, totals, first_update=epoch == 0 and index == 0)
                step_losses.append(losses)
                grad_norms.append(grad_norm)
        t_update = time.perf_counter() - t0

        metrics = {
            **totals.result(),
            **extra,
            **self._step_metrics(step, step_losses, grad_norms),
            **gaps,
            **({"learner/ess_lr_scale": self.lr_scale} if self.cfg.optimizer.ess_lr else {}),
            "time/proximal_s": t_proximal,
            "time/update_s": t_update,
            "perf/tokens_per_s": self.cfg.epochs
            * float(batch.attention_mask_B_T.sum() - placeholders)
            / max(t_update, 1e-9),
        }
        if self.workers.parallel:  # this rank's share of the batch, then the whole batch's
            metrics["learner/samples"] -= placeholders
            metrics["learner/tokens"] -= placeholders
            metrics = combine_metrics(self.workers.gather(metrics), SUMMED_PER_OPTIMIZER_STEP)
        report = self._report(consumed, metrics, started, batch)
        return self._finish(report, consumed, updated=True)

    # ------------------------------------------------------------------ data parallelism
    def _mini_batch_count(self, rows: int) -> int:
        return math.ceil(rows / (self.cfg.mini_batch_size or rows))

    def _share(self, kept: list[TrainingSample], rewards: torch.Tensor, mini_batches: int
               ) -> tuple[list[TrainingSample], torch.Tensor, int]:
        """This rank's whole groups of the batch, padded with placeholder rows to at least one
        row per mini-batch; returns them, their rewards and the number of placeholders."""
        if not self.workers.parallel:
            return kept, rewards, 0
        rank, world = self.workers.rank, self.workers.world_size
        mine = shard_groups(kept, rank, world)
        chosen = {id(s) for s in mine}
        mine_rewards = rewards[[i for i, s in enumerate(kept) if id(s) in chosen]]
        fill = max(0, mini_batches - len(mine))
        mine += [placeholder(kept[0], self.pad_id, i, rank) for i in range(fill)]
        return mine, torch.cat([mine_rewards, torch.zeros(fill)]), fill

    def _mini_batches(self, rows: int, count: int) -> list[slice]:
        """The row ranges of the optimizer steps: `mini_batch_size` rows each on one process;
        with several workers, each rank's share in `count` near-equal parts, so that every
        rank runs the same number of optimizer steps."""
        if self.workers.parallel:
            return split_rows(rows, count)
        mini = self.cfg.mini_batch_size or rows
        return [slice(start, min(start + mini, rows)) for start in range(0, rows, mini)]

    def _observe_logprobs(self, samples: list[TrainingSample], logprobs_B_Tm1: torch.Tensor
                          ) -> None:
        """Give the observers (rank 0's) the trainer log-probs of the whole batch's samples."""
        if not self.workers.parallel:
            for observe in self.logprob_observers:  # e.g. learner.trainer_logprobs
                observe(self.step + 1, self.version, samples, logprobs_B_Tm1)
            return
        if not self.cfg.record_trainer_logprobs or self.step % self.cfg.trainer_logprobs_every:
            return  # the same decision on every rank: the gather is collective
        pieces = self.workers.gather((samples, logprobs_B_Tm1[:len(samples)].cpu()))
        if not self.workers.is_main or not self.logprob_observers:
            return
        width = max(p.shape[1] for _, p in pieces)
        every = [s for group, _ in pieces for s in group]
        logprobs = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]))
                              for _, p in pieces])
        for observe in self.logprob_observers:
            observe(self.step + 1, self.version, every, logprobs)

    def _report(self, consumed: Sequence[TrainingSample], metrics: dict[str, float],
                started: float, batch: PaddedBatch | None = None) -> StepReport:
        return StepReport(
            step=self.step + 1,
            mode="rl",
            num_samples=0 if batch is None else int(metrics["learner/samples"]),
            num_tokens=0 if batch is None else int(metrics["learner/loss_tokens"]),
            loss=metrics.get("loss/policy", 0.0) + metrics.get("score_centering/loss", 0.0),
            policy_version=self.version,
            metrics=metrics,
            first_seq=consumed[0].sequence,
            last_seq=consumed[-1].sequence,
            mean_lag=metrics.get("lag/mean"),
            max_lag=int(metrics["lag/max"]) if "lag/max" in metrics else None,
            started_at=started,
        )

    def _rewards(
        self, samples: list[TrainingSample]
    ) -> tuple[list[TrainingSample], torch.Tensor, dict[str, float]]:
        """Rewards (DAPO's overlong penalty, if configured, was added at admission); drops
        zero-variance groups when configured."""
        a = self.cfg.advantage
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        extra = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item() if len(samples) > 1 else 0.0,
        }
        weights = [s.selection_weight for s in samples]
        if any(w != 1.0 for w in weights):  # [admission] reweight: what the weights did
            extra["selection/weight_mean"] = sum(weights) / len(weights)
            extra["selection/weight_max"] = max(weights)
        if a.drop_zero_variance_groups:
            keep = zero_variance_groups(rewards, [s.group_id for s in samples])
            extra["learner/zero_variance_dropped"] = float((~keep).sum().item())
            samples = [s for s, k in zip(samples, keep.tolist()) if k]
            rewards = rewards[keep]
        return samples, rewards, extra

    @torch.no_grad()
    def _step_tensors(self, batch: PaddedBatch, rewards_B: torch.Tensor,
                      baseline_peers: Sequence[tuple[object, float]],
                      selection_B: torch.Tensor | None = None,
                      turn_B_Tm1: torch.Tensor | None = None) -> StepTensors:
        """The no-grad pass at the current weights, then the advantages (`turn_B_Tm1`: the
        per-turn estimators' token advantages, computed from the samples), each row's scaled by
        its selection weight (`selection_B`, admission's reweighting; 1 = unchanged)."""
        mb = self.cfg.micro_batch_size
        proximal, reference, values, entropy = [], [], [], []
        self.policy.eval()
        for start in range(0, batch.size, mb):
            rows = slice(start, start + mb)
            ids, attn = batch.input_ids_B_T[rows], batch.attention_mask_B_T[rows]
            with self.precision.compute():
                out = policy_outputs(self.policy, ids, attn)
                proximal.append(out.logprobs_B_Tm1)
                if self.cfg.loss.correction_entropy:
                    entropy.append(token_entropy(out.logits_B_Tm1_V, out.logsumexp_B_Tm1))
                if self.reference is not None:
                    reference.append(policy_outputs(self.reference, ids, attn).logprobs_B_Tm1)
                if self.critic is not None:
                    values.append(self.critic(ids, attn).float())
        self.policy.train()
        cat = lambda xs: torch.cat(xs) if xs else None  # noqa: E731
        old_values = cat(values)
        log_ratio_B = None
        if self.cfg.advantage.baseline == "min_variance" or self.cfg.optimizer.ess_lr:
            log_ratio_B = trajectory_log_ratios(cat(proximal), batch.sampler_logprobs_B_Tm1,
                                                batch.loss_mask_B_Tm1, batch.trajectory_index_B)
        if turn_B_Tm1 is not None:
            advantages, returns = turn_B_Tm1, None
        else:
            advantages, returns = self._advantages(batch, rewards_B, old_values, baseline_peers,
                                                   log_ratio_B)
        if selection_B is not None and bool((selection_B != 1).any()):
            scale = selection_B.to(advantages.dtype)
            advantages = advantages * (scale if advantages.dim() == 1 else scale[:, None])
        return StepTensors(batch, cat(proximal), cat(reference), old_values, advantages, returns,
                           cat(entropy), log_ratio_B)

    def _advantages(
        self, batch: PaddedBatch, rewards_B: torch.Tensor, old_values: torch.Tensor | None,
        baseline_peers: Sequence[tuple[object, float]],
        log_ratio_B: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        a = self.cfg.advantage
        if a.estimator != "gae":
            weights = None
            if a.baseline == "min_variance":  # w^2, scaled by the largest for range
                weights = torch.exp(2.0 * (log_ratio_B - log_ratio_B.max())).to(rewards_B.dtype)
            advantages = trajectory_advantages(rewards_B, batch.group_ids, batch.trajectory_ids,
                                               a.estimator, a.eps, baseline_peers, weights)
            return advantages, None
        assert old_values is not None
        mask = batch.loss_mask_B_Tm1
        token_rewards = torch.zeros_like(old_values)
        positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(-1)
        has_tokens = last >= 0
        rows = torch.arange(mask.shape[0], device=mask.device)[has_tokens]
        token_rewards[rows, last[has_tokens]] = rewards_B[has_tokens]
        values = torch.where(mask, old_values, torch.zeros_like(old_values))
        advantages, returns = gae(token_rewards, values, mask, a.gamma, a.lam, whiten=False)
        return (self._whiten(advantages, mask) if a.whiten else advantages), returns

    def _whiten(self, values_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
        """`masked_whiten` over the loss tokens of the whole batch, on every rank's share."""
        if not self.workers.parallel:
            return masked_whiten(values_B_T, mask_B_T)
        mask = mask_B_T.to(values_B_T.dtype)
        count, total = self.workers.sum(torch.stack([mask.sum(), (values_B_T * mask).sum()]))
        centered = (values_B_T - total / count.clamp(min=1)) * mask
        if count < 2:
            return centered
        variance = self.workers.sum((centered**2).sum()) / (count - 1)
        return centered * torch.rsqrt(variance + 1e-8)

    # ------------------------------------------------------------------ one optimizer step
    def _optimizer_step(self, step: StepTensors, rows: slice, totals: _MetricMean,
                        first_update: bool) -> tuple[dict[str, float], float]:
        denominators = self._denominators(step, rows, first_update)
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
        losses: dict[str, float] = {}
        starts = range(rows.start, rows.stop, self.cfg.micro_batch_size)
        for start in starts:
            micro = slice(start, min(start + self.cfg.micro_batch_size, rows.stop))
            with self._gradient_sync(last=start == starts[-1]):
                metrics = self.accumulate_gradients(step, micro, denominators)
            for key in SUMMED_PER_OPTIMIZER_STEP:
                if key in metrics:
                    losses[key] = losses.get(key, 0.0) + metrics[key]
            totals.add(metrics, weight=metrics.get("loss/tokens", 1.0))
        return losses, self._clip_and_step()

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Data-parallel: gradients are summed over the ranks in the mini-batch's last backward
        only (every rank has at least one micro-batch per mini-batch, see `_share`)."""
        stack = contextlib.ExitStack()
        if not last:
            for module in (self.train_policy, self.train_critic):
                if isinstance(module, DistributedDataParallel):
                    stack.enter_context(module.no_sync())
        return stack

    def _denominators(self, step: StepTensors, rows: slice, first_update: bool) -> Denominators:
        """Normalisers of the mini-batch `rows`, computed on all of it before its micro-batches.

        With `mis` and `masked_in_denominator = False`, tokens the weights zero leave the
        policy's denominator; at `ratio_base = current` after the first update that needs the
        current policy's log-probs (a no-grad forward of the mini-batch)."""
        batch, loss_cfg = step.batch, self.cfg.loss
        mask = batch.loss_mask_B_Tm1[rows]
        index = batch.trajectory_index_B[rows]
        if not loss_cfg.masked_in_denominator and loss_cfg.correction == "mis":
            current = step.proximal_logprobs_B_Tm1[rows]
            if loss_cfg.ratio_base == "current" and not first_update:
                sub = batch.rows(rows.start, rows.stop)
                with torch.no_grad(), self.precision.compute():
                    current = policy_outputs(
                        self.policy, sub.input_ids_B_T, sub.attention_mask_B_T
                    ).logprobs_B_Tm1
                current = torch.nn.functional.pad(current, (0, mask.shape[1] - current.shape[1]))
            entropy = (None if step.proximal_entropy_B_Tm1 is None
                       else step.proximal_entropy_B_Tm1[rows])
            _, keep, _, _ = behaviour_weights(
                current, step.proximal_logprobs_B_Tm1[rows], batch.sampler_logprobs_B_Tm1[rows],
                mask, loss_cfg, entropy)
            mask = mask & keep
        sc = self.cfg.score_centering
        full_mask = batch.loss_mask_B_Tm1[rows]
        policy = aggregation_denominator(mask, loss_cfg.aggregation, loss_cfg.norm_constant, index)
        centering = policy if sc is None else aggregation_denominator(
            full_mask, sc.aggregation, sc.norm_constant, index)
        # whole trajectories live on one rank, so tokens and sequences add up over the ranks
        policy, centering, value = self.workers.sum(
            torch.stack([policy, centering, full_mask.sum().to(policy.dtype)]))
        return Denominators(
            policy=policy,
            policy_sequence_tokens_B=self._by_row(sequence_tokens(mask, index), rows, batch.size),
            centering=None if sc is None else centering,
            centering_sequence_tokens_B=self._by_row(
                sequence_tokens(full_mask, index), rows, batch.size),
            value=value.clamp(min=1),
        )

    @staticmethod
    def _by_row(values: torch.Tensor, rows: slice, size: int) -> torch.Tensor:
        out = torch.zeros(size, dtype=values.dtype, device=values.device)
        out[rows] = values
        return out

    def accumulate_gradients(self, step: StepTensors, rows: slice,
                             denominators: Denominators) -> dict[str, float]:
        """Forward and backward of the micro-batch `rows`; gradients add into .grad."""
        cfg = self.cfg
        sub = step.batch.rows(rows.start, rows.stop)
        length = sub.loss_mask_B_Tm1.shape[1]
        with self.precision.compute():
            out = policy_outputs(self.train_policy, sub.input_ids_B_T, sub.attention_mask_B_T)
        advantages = step.advantages_of(rows, length)
        loss_out = policy_loss(
            PolicyLossInputs(
                trainer_logprobs=out.logprobs_B_Tm1,
                proximal_logprobs=_cut(step.proximal_logprobs_B_Tm1, rows, length),
                sampler_logprobs=sub.sampler_logprobs_B_Tm1,
                advantages=advantages,
                mask=sub.loss_mask_B_Tm1,
                reference_logprobs=_cut(step.reference_logprobs_B_Tm1, rows, length),
                entropy=token_entropy(out.logits_B_Tm1_V, out.logsumexp_B_Tm1),
                proximal_entropy=_cut(step.proximal_entropy_B_Tm1, rows, length),
            ),
            cfg.loss,
            denominator=denominators.policy,
            sequence_tokens_B=denominators.policy_sequence_tokens_B[rows],
        )
        total = loss_out.loss
        metrics = dict(loss_out.metrics)
        if cfg.score_centering is not None:
            sc_out = score_centering_loss(
                ScoreCenteringInputs(
                    trainer_logits=out.logits_B_Tm1_V,
                    sampled_ids=sub.input_ids_B_T[:, 1:],
                    sampler_logprobs=sub.sampler_logprobs_B_Tm1,
                    sampler_topk_ids=sub.topk_ids_B_Tm1_K,
                    sampler_topk_logprobs=sub.topk_logprobs_B_Tm1_K,
                    advantages=advantages,
                    mask=sub.loss_mask_B_Tm1,
                    trainer_logsumexp=out.logsumexp_B_Tm1,
                ),
                cfg.score_centering,
                compute_entropy=False,
                denominator=denominators.centering,
                sequence_tokens_B=denominators.centering_sequence_tokens_B[rows],
            )
            total = total + sc_out.loss
            metrics.update(sc_out.metrics)
        total.backward()
        if self.critic is not None:
            metrics["critic/loss"] = self._critic_backward(step, sub, rows, denominators.value)
        return metrics

    def _critic_backward(self, step: StepTensors, sub: PaddedBatch, rows: slice,
                         denominator: torch.Tensor) -> float:
        assert self.train_critic is not None
        assert step.old_values_B_Tm1 is not None and step.returns_B_Tm1 is not None
        length = sub.loss_mask_B_Tm1.shape[1]
        with self.precision.compute():
            values = self.train_critic(sub.input_ids_B_T, sub.attention_mask_B_T)
        old_values = _cut(step.old_values_B_Tm1, rows, length)
        returns = _cut(step.returns_B_Tm1, rows, length)
        error = (values - returns) ** 2
        clip = self.cfg.critic.value_clip
        if clip is not None:
            clipped = old_values + (values - old_values).clamp(-clip, clip)
            error = torch.maximum(error, (clipped - returns) ** 2)
        value_loss = aggregate(error, sub.loss_mask_B_Tm1, "token_mean", denominator=denominator)
        (self.cfg.critic.loss_coef * value_loss).backward()
        return value_loss.item()

    def _clip_and_step(self) -> float:
        opt = self.cfg.optimizer
        self.optimizer_steps += 1
        if opt.warmup_steps or opt.ess_lr:
            scale = min(1.0, self.optimizer_steps / opt.warmup_steps) if opt.warmup_steps else 1.0
            for group in self.optimizer.param_groups:
                group["lr"] = opt.lr * scale * self.lr_scale
        norm = torch.nn.utils.clip_grad_norm_(
            self.policy.parameters(), opt.max_grad_norm or math.inf
        )
        self.optimizer.step()
        if self.critic is not None:
            torch.nn.utils.clip_grad_norm_(
                self.critic.parameters(), self.cfg.critic.max_grad_norm or math.inf
            )
            self.critic_optimizer.step()
        return float(norm)

    @torch.no_grad()
    def _precision_gaps(self, step: StepTensors) -> dict[str, float]:
        """|trainer - sampler| log-prob over the lag-0 loss tokens (sampled with the weights of
        this step), under the learner's own precision (the proximal pass) and the other one."""
        batch = step.batch
        lag0 = batch.loss_mask_B_Tm1 & (batch.weights_versions_B_Tm1 == self.version)
        if not bool(lag0.any()):
            return {}
        other = Precision("float32" if self.precision.dtype == "bfloat16" else "bfloat16",
                          self.precision.device)
        recomputed = []
        self.policy.eval()
        for start in range(0, batch.size, self.cfg.micro_batch_size):
            rows = slice(start, start + self.cfg.micro_batch_size)
            with other.compute():
                recomputed.append(policy_outputs(self.policy, batch.input_ids_B_T[rows],
                                                 batch.attention_mask_B_T[rows]).logprobs_B_Tm1)
        self.policy.train()
        metrics = {"numerics/gap_tokens": float(lag0.sum())}
        for dtype, logprobs in ((self.precision.dtype, step.proximal_logprobs_B_Tm1),
                                (other.dtype, torch.cat(recomputed))):
            gap = (logprobs - batch.sampler_logprobs_B_Tm1)[lag0].abs().float()
            metrics[f"numerics/gap_{dtype}_mean"] = gap.mean().item()
            metrics[f"numerics/gap_{dtype}_p99"] = torch.quantile(gap, 0.99).item()
            metrics[f"numerics/gap_{dtype}_max"] = gap.max().item()
        return metrics

    # ------------------------------------------------------------------ bookkeeping
    def _step_metrics(self, step: StepTensors, step_losses: list[dict[str, float]],
                      grad_norms: list[float]) -> dict[str, float]:
        batch, mask = step.batch, step.batch.loss_mask_B_Tm1
        metrics: dict[str, float] = {}
        for key in SUMMED_PER_OPTIMIZER_STEP:
            values = [d[key] for d in step_losses if key in d]
            if values:
                metrics[key] = sum(values) / len(values)
        adv = self._masked(step.advantages, mask)
        metrics.update(
            {
                "learner/grad_norm": sum(grad_norms) / len(grad_norms),
                "learner/grad_norm_max": max(grad_norms),
                "learner/lr": self.optimizer.param_groups[0]["lr"],
                "learner/optimizer_steps": float(len(grad_norms)),
                "learner/samples": float(batch.size),
                "learner/loss_tokens": float(mask.sum()),
                "learner/tokens": float(batch.attention_mask_B_T.sum()),
                "advantage/mean": adv.mean().item() if adv.numel() else 0.0,
                "advantage/abs_mean": adv.abs().mean().item() if adv.numel() else 0.0,
            }
        )
        lag = (self.version - batch.weights_versions_B_Tm1)[mask].float()
        if lag.numel():
            metrics["lag/mean"], metrics["lag/max"] = lag.mean().item(), lag.max().item()
        if step.old_values_B_Tm1 is not None and step.returns_B_Tm1 is not None:
            metrics["critic/explained_variance"] = self._explained_variance(
                step.old_values_B_Tm1, step.returns_B_Tm1, mask)
        return metrics

    @staticmethod
    def _masked(values: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
        if values.dim() == 1:
            values = values[:, None].expand_as(mask_B_T)
        return values[mask_B_T]

    @staticmethod
    def _explained_variance(
        values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
    ) -> float:
        v, r = values[mask], returns[mask]
        if r.numel() < 2 or r.var() == 0:
            return 0.0
        return (1.0 - (r - v).var() / r.var()).item()

    def _finish(
        self, report: StepReport, consumed: Sequence[TrainingSample], updated: bool
    ) -> StepReport:
        self.step = report.step
        self.last_sequence = max(self.last_sequence, consumed[-1].sequence)
        published_version, published_path = None, None
        publishes = updated and self.step % self.cfg.publish_every == 0
        if publishes and self.publish_root is not None and self.workers.is_main:
            published_path = str(
                self.publish(metadata={"learner_step": self.step, "last_seq": self.last_sequence})
            )
            published_version = self.version
        elif publishes and self.publish_root is not None:
            self.version += 1  # rank 0 published these same weights
        report = StepReport(
            **{
                **report.to_json(),
                "published_version": published_version,
                "published_path": published_path,
                "finished_at": time.time(),
            }
        )
        for sink in self.sinks:
            sink.write(report)
        return report

    def publish(self, metadata: dict | None = None) -> Path:
        """Publish the current weights as version + 1 (publish-then-mark)."""
        if self.publish_root is None:
            raise ValueError("publish: this learner has no publish_root")
        path = publish_version(
            self.policy,
            self.tokenizer_files,
            self.publish_root,
            self.version + 1,
            self.mark_published,
            metadata,
        )
        self.version += 1
        return path
