"""Padded tensors from samples, in the shifted space the losses use.

`collate` right-pads a list of `TrainingSample`s into (B, T) input tensors and gives every
per-token quantity in the shifted space (B, T-1), named `_B_Tm1`: entry j is about token j + 1,
the token the logits at position j predict (so `policy_outputs(...).logprobs_B_Tm1` of the model
line up with them). Padding has loss mask 0; padded top-k entries have log-prob -inf (which the
score-centering loss treats as absent). Rows of one trajectory (a template split it into
segments) share a `trajectory_index_B` entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from learner.batch import TrainingSample


@dataclass(frozen=True)
class PaddedBatch:
    input_ids_B_T: torch.Tensor  # (B, T) long, right-padded
    attention_mask_B_T: torch.Tensor  # (B, T) long
    loss_mask_B_Tm1: torch.Tensor  # (B, T-1) bool, shifted
    sampler_logprobs_B_Tm1: torch.Tensor  # (B, T-1) float32, shifted
    weights_versions_B_Tm1: torch.Tensor  # (B, T-1) long, shifted (-1 off the mask)
    group_ids: tuple  # (B,) group ids
    trajectory_ids: tuple  # (B,) each row's (kind, trajectory id): a multi-segment trajectory
                           # spans rows
    trajectory_index_B: torch.Tensor  # (B,) long, 0.. per distinct trajectory id
    topk_ids_B_Tm1_K: torch.Tensor | None  # (B, T-1, K) long, shifted
    topk_logprobs_B_Tm1_K: torch.Tensor | None  # (B, T-1, K) float32, shifted

    @property
    def size(self) -> int:
        return int(self.input_ids_B_T.shape[0])

    def rows(self, start: int, stop: int) -> PaddedBatch:
        """Rows [start, stop), trimmed to the longest of them."""
        length = int(self.attention_mask_B_T[start:stop].sum(-1).max().item())
        length = max(length, 2)

        def cut(t: torch.Tensor | None, shifted: bool) -> torch.Tensor | None:
            if t is None:
                return None
            return t[start:stop, : length - 1 if shifted else length]

        return PaddedBatch(
            input_ids_B_T=cut(self.input_ids_B_T, False),
            attention_mask_B_T=cut(self.attention_mask_B_T, False),
            loss_mask_B_Tm1=cut(self.loss_mask_B_Tm1, True),
            sampler_logprobs_B_Tm1=cut(self.sampler_logprobs_B_Tm1, True),
            weights_versions_B_Tm1=cut(self.weights_versions_B_Tm1, True),
            group_ids=self.group_ids[start:stop],
            trajectory_ids=self.trajectory_ids[start:stop],
            trajectory_index_B=self.trajectory_index_B[start:stop],
            topk_ids_B_Tm1_K=cut(self.topk_ids_B_Tm1_K, True),
            topk_logprobs_B_Tm1_K=cut(self.topk_logprobs_B_Tm1_K, True),
        )


def collate(
    samples: Sequence[TrainingSample],
    pad_id: int,
    device: str | torch.device = "cpu",
    need_topk: bool = False,
) -> PaddedBatch:
    if not samples:
        raise ValueError("collate: no samples")
    B = len(samples)
    T = max(max(s.length for s in samples), 2)
    ids = np.full((B, T), pad_id, np.int64)
    attention = np.zeros((B, T), np.int64)
    mask = np.zeros((B, T), np.bool_)
    sampler = np.zeros((B, T), np.float32)
    versions = np.full((B, T), -1, np.int64)
    topks = {s.topk for s in samples}
    if need_topk and 0 in topks:
        missing = next(s for s in samples if s.topk == 0)
        raise ValueError(
            f"score centering needs the sampler's top-k log-probs, but trajectory "
            f"{missing.trajectory_id} has none; sample with rollout.logprobs_topk > 0 "
            "or disable learner.score_centering"
        )
    K = max(topks) if need_topk else 0
    topk_ids = np.zeros((B, T, K), np.int64)
    topk_lp = np.full((B, T, K), -np.inf, np.float32)
    for i, s in enumerate(samples):
        n = s.length
        ids[i, :n] = s.token_ids
        attention[i, :n] = 1
        mask[i, :n] = s.loss_mask
        sampler[i, :n] = np.where(s.loss_mask, s.sampler_logprobs, 0.0)
        versions[i, :n] = s.weights_versions
        if K:
            k = s.topk
            topk_ids[i, :n, :k] = s.sampler_topk_ids
            topk_lp[i, :n, :k] = s.sampler_topk_logprobs
    as_t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return PaddedBatch(
        input_ids_B_T=as_t(ids),
        attention_mask_B_T=as_t(attention),
        loss_mask_B_Tm1=as_t(mask[:, 1:]),
        sampler_logprobs_B_Tm1=as_t(sampler[:, 1:]),
        weights_versions_B_Tm1=as_t(versions[:, 1:]),
        group_ids=tuple(s.group_id for s in samples),
        trajectory_ids=tuple(s.member for s in samples),
        trajectory_index_B=_index_of([s.member for s in samples], device),
        topk_ids_B_Tm1_K=as_t(topk_ids[:, 1:]) if K else None,
        topk_logprobs_B_Tm1_K=as_t(topk_lp[:, 1:]) if K else None,
    )


def _index_of(ids: Sequence[object], device: str | torch.device) -> torch.Tensor:
    first_seen: dict[object, int] = {}
    return torch.tensor([first_seen.setdefault(i, len(first_seen)) for i in ids],
                        dtype=torch.long, device=device)
