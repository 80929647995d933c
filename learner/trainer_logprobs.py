"""Record the learner's own log-prob of every trained token, per model call, in the store.

The learner computes log pi_theta(token) for every sampled token in its no-grad pass (the
"proximal" log-probs, with the weights it trains from). `TrainerLogprobRecorder.observe` takes
them from that pass and splits each sample back into its model calls by the offsets the sample
kept from the one path (`TrainingSample.model_call_ids`, `call_spans`); when the step's report
arrives (`write`, as a metrics sink, after the step row is stored) it stores one packed float32
array per call: the same length as the call's sampled tokens, NaN where the sample's loss mask
is 0. The viewer and `stalewise audit show` put them next to the sampler's log-probs, so
sampler/trainer mismatch is visible per token.

Guarantee: a call's values are the log-probs at exactly its sampled positions in the sample the
learner trained; log-probs that do not cover a sample raise instead of being stored short.
Samples without model calls (demonstrations, synthetic or loss-masked samples) store nothing.
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
        self._pending: list[tuple[int, np.ndarray]] = []  # (model call id, its values)
        self._version: int | None = None

    def wants(self, step: int) -> bool:
        return (step - 1) % self.every == 0

    def observe(self, step: int, version: int, samples: Sequence[TrainingSample],
                logprobs_B_T1: torch.Tensor) -> None:
        """`logprobs_B_T1[i, t - 1]` is the learner's log-prob of token t of `samples[i]`."""
        if not self.wants(step):
            return
        values = logprobs_B_T1.detach().float().cpu().numpy()
        self._pending, self._version = [], version
        for row, sample in enumerate(samples):
            if sample.model_call_ids:
                self._pending += per_call(sample, values[row])

    def write(self, report: StepReport) -> None:
        pending, self._pending = self._pending, []
        if not pending or report.mode != "rl":
            return
        self.store.insert_trainer_logprobs(self.run_id, [
            dict(model_call_id=call_id, learner_step=report.step, policy_version=self._version,
                 num_tokens=len(chunk), logprobs=pack(chunk, FLOAT32))
            for call_id, chunk in pending])

    def close(self) -> None:
        self._pending = []


def per_call(sample: TrainingSample, values_T1: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(model call id, the log-probs of its sampled tokens) for each of the sample's calls;
    `values_T1[t - 1]` is token t's, NaN where the sample's loss mask is 0 (and on token 0,
    which nothing predicts)."""
    if sample.length - 1 > len(values_T1):
        raise ValueError(f"trainer log-probs: trajectory {sample.trajectory_id}'s sample has "
                         f"{sample.length} tokens but the learner's log-probs cover "
                         f"{len(values_T1) + 1}")
    shifted = np.r_[np.float32(np.nan), values_T1[:sample.length - 1]].astype(np.float32)
    trained = np.where(sample.loss_mask, shifted, np.float32(np.nan))
    return [(call_id, trained[start:stop])
            for call_id, (start, stop) in zip(sample.model_call_ids, sample.call_spans)]
