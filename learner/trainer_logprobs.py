"""Record the learner's own log-prob of every trained token, per model call, in the store.

The learner computes log pi_theta(token) for every sampled token in its no-grad pass (the
"proximal" log-probs, with the weights it trains from). `TrainerLogprobRecorder.observe` takes
them from that pass; when the step's report arrives (`write`, as a metrics sink, after the step
row is stored) it splits each trajectory's values back into its model calls and stores one
packed float32 array per call: the same length as the call's sampled tokens, NaN where the
call's loss mask is 0. The viewer and `stalewise audit show` put them next to the sampler's
log-probs, so sampler/trainer mismatch is visible per token.

Guarantee: a trajectory's values are stored only when their count equals its stored sampled
tokens; a mismatch raises (it would mean the sample was not built from these calls).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from core.records import FLOAT32, pack
from core.store.store import Store
from learner.batch import TrainingSample
from learner.metrics import StepReport


class TrainerLogprobRecorder:
    """An observer of the learner's log-probs and a metrics sink that stores them.

    `every` > 1 records one learner step in `every` (the first step always)."""

    def __init__(self, store: Store, run_id: str, every: int = 1) -> None:
        self.store, self.run_id, self.every = store, run_id, every
        self._pending: dict[int, list[np.ndarray]] = {}
        self._version: int | None = None

    def wants(self, step: int) -> bool:
        return (step - 1) % self.every == 0

    def observe(self, step: int, version: int, samples: Sequence[TrainingSample],
                logprobs_B_T1: torch.Tensor) -> None:
        """`logprobs_B_T1[i, t - 1]` is the learner's log-prob of token t of `samples[i]`."""
        if not self.wants(step):
            return
        values = logprobs_B_T1.detach().float().cpu().numpy()
        self._pending, self._version = {}, version
        for row, sample in enumerate(samples):
            if not isinstance(sample.trajectory_id, int):
                continue  # demonstrations and synthetic samples have no model calls
            positions = np.flatnonzero(sample.loss_mask)
            if positions.size:
                self._pending.setdefault(sample.trajectory_id, []).append(
                    values[row, positions - 1])

    def write(self, report: StepReport) -> None:
        pending, self._pending = self._pending, {}
        if not pending or report.mode != "rl":
            return
        layout = self.store.model_call_layout(list(pending))
        rows = []
        for trajectory_id, pieces in pending.items():
            rows += self._split(trajectory_id, np.concatenate(pieces), layout[trajectory_id],
                                report.step)
        self.store.insert_trainer_logprobs(self.run_id, rows)

    def _split(self, trajectory_id: int, values: np.ndarray,
               calls: list[tuple[int, int, np.ndarray]], step: int) -> list[dict]:
        expected = sum(n for _, n, _ in calls)
        if expected != len(values):
            raise ValueError(f"trainer log-probs: trajectory {trajectory_id} has {expected} "
                             f"stored sampled tokens but the learner trained {len(values)}")
        rows, start = [], 0
        for call_id, n, loss_mask in calls:
            chunk = np.where(loss_mask.astype(bool), values[start:start + n], np.nan)
            rows.append(dict(model_call_id=call_id, learner_step=step,
                             policy_version=self._version, num_tokens=n,
                             logprobs=pack(chunk, FLOAT32)))
            start += n
        return rows

    def close(self) -> None:
        self._pending = {}
