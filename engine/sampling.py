"""Turn raw logits into the processed distribution, sample from it, and report its log-probs.

Processing order (the same as `core.engine_api.SamplingParams` documents, and vLLM's):

1. suppressed ids (stop/EOS ids while fewer than `min_tokens` were sampled) get -inf;
2. logits are divided by the temperature (temperature 0 means greedy: all mass on the argmax);
3. top-k keeps the k largest (ties broken by token id, lower first);
4. top-p keeps, among the top-k survivors sorted by probability, the smallest prefix whose
   renormalised mass reaches p (the most likely token is always kept); top_p = 1 keeps all;
5. the survivors are renormalised: `processed_logprobs` is log-softmax over them, -inf elsewhere.

The sampled id is drawn from exactly that distribution by inverse-CDF sampling on one uniform
draw per row (over the sorted distribution when top-k, top-p, greedy rows or a reported top-k
need it; in vocabulary order otherwise, which needs no sort), and its recorded log-prob is the processed log-prob of the drawn id, so
exp(recorded log-prob) is the probability with which it was drawn. Rows with a seed use their
own `torch.Generator`; the others share the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SampleOutput:
    token_ids_B: torch.Tensor          # int64 (B,)
    logprobs_B: torch.Tensor           # float32 (B,) processed log-prob of each sampled id
    topk_ids_B_K: torch.Tensor         # int64 (B, K): most likely ids of the processed distribution
    topk_logprobs_B_K: torch.Tensor    # float32 (B, K): their processed log-probs (-inf if removed)


def processed_sorted(logits_B_V: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor,
                     top_p_B: torch.Tensor, suppress_B_V: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Processed log-probs sorted from most to least likely, and the ids in that order.

    temperature_B: 0 = greedy; top_k_B: 0 = off; top_p_B: 1.0 = off; suppress_B_V: True = -inf.
    Returns (logprobs_B_V sorted descending, ids_B_V).
    """
    vocab = logits_B_V.shape[-1]
    greedy_B = temperature_B <= 0
    scaled = logits_B_V.float() / torch.where(greedy_B, torch.ones_like(temperature_B),
                                              temperature_B).unsqueeze(1)
    if suppress_B_V is not None:
        scaled = scaled.masked_fill(suppress_B_V, float("-inf"))
    sorted_B_V, ids_B_V = torch.sort(scaled, dim=-1, descending=True, stable=True)
    ranks_V = torch.arange(vocab)
    k_B = torch.where(top_k_B > 0, top_k_B, torch.full_like(top_k_B, vocab))
    k_B = torch.where(greedy_B, torch.ones_like(k_B), k_B)
    keep_B_V = ranks_V.unsqueeze(0) < k_B.unsqueeze(1)
    sorted_B_V = sorted_B_V.masked_fill(~keep_B_V, float("-inf"))
    probs_B_V = torch.softmax(sorted_B_V, dim=-1)
    mass_before_B_V = torch.cumsum(probs_B_V, dim=-1) - probs_B_V
    nucleus_B_V = (mass_before_B_V < top_p_B.unsqueeze(1)) | (top_p_B >= 1.0).unsqueeze(1)
    nucleus_B_V[:, 0] = True
    sorted_B_V = sorted_B_V.masked_fill(~nucleus_B_V, float("-inf"))
    return torch.log_softmax(sorted_B_V, dim=-1), ids_B_V


def _unfiltered(temperature_B: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor,
                vocab: int) -> bool:
    """No row needs the sorted distribution: no greedy row, no top-k, no top-p."""
    return bool(((temperature_B > 0) & ((top_k_B <= 0) | (top_k_B >= vocab))
                 & (top_p_B >= 1.0)).all())


def _sample_unfiltered(logits_B_V: torch.Tensor, temperature_B: torch.Tensor,
                       uniforms_B: torch.Tensor, suppress_B_V: torch.Tensor | None
                       ) -> SampleOutput:
    """Inverse-CDF sampling in vocabulary order: the same distribution without sorting it
    (a sort of a 50k vocabulary costs as much as a decode step of a 135M model)."""
    scaled = logits_B_V.float()
    if bool((temperature_B != 1.0).any()):  # x / 1 is x: the division is skipped, not changed
        scaled = scaled / temperature_B.unsqueeze(1)
    if suppress_B_V is not None:
        scaled = scaled.masked_fill(suppress_B_V, float("-inf"))
    logprobs_B_V = torch.log_softmax(scaled, dim=-1)
    cdf_B_V = torch.cumsum(logprobs_B_V.exp(), dim=-1, dtype=torch.float64)
    target_B = uniforms_B.double() * cdf_B_V[:, -1]
    choice_B_1 = torch.searchsorted(cdf_B_V, target_B.unsqueeze(1), right=True)
    picked_B = logprobs_B_V.gather(1, choice_B_1).squeeze(1)
    if not bool(torch.isfinite(picked_B).all()):
        # The first cdf entry above the target adds positive mass, so this is only a guard
        # against rounding past the last id left in (a full scan of the vocabulary, rarely run).
        ranks_V = torch.arange(logprobs_B_V.shape[-1])
        last_valid_B = torch.where(torch.isfinite(logprobs_B_V), ranks_V, 0).amax(dim=-1)
        choice_B_1 = torch.minimum(choice_B_1.squeeze(1), last_valid_B).unsqueeze(1)
        picked_B = logprobs_B_V.gather(1, choice_B_1).squeeze(1)
    empty = torch.empty(logits_B_V.shape[0], 0)
    return SampleOutput(token_ids_B=choice_B_1.squeeze(1), logprobs_B=picked_B,
                        topk_ids_B_K=empty.long(), topk_logprobs_B_K=empty)


def sample(logits_B_V: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor,
           top_p_B: torch.Tensor, uniforms_B: torch.Tensor, topk: int = 0,
           suppress_B_V: torch.Tensor | None = None) -> SampleOutput:
    """Draw one id per row from the processed distribution with the given U[0,1) draws."""
    if topk == 0 and _unfiltered(temperature_B, top_k_B, top_p_B, logits_B_V.shape[-1]):
        return _sample_unfiltered(logits_B_V, temperature_B, uniforms_B, suppress_B_V)
    logprobs_B_V, ids_B_V = processed_sorted(logits_B_V, temperature_B, top_k_B, top_p_B,
                                             suppress_B_V)
    cdf_B_V = torch.cumsum(logprobs_B_V.exp(), dim=-1)
    target_B = uniforms_B.to(cdf_B_V.dtype) * cdf_B_V[:, -1]
    choice_B = torch.searchsorted(cdf_B_V, target_B.unsqueeze(1), right=True).squeeze(1)
    last_valid_B = torch.isfinite(logprobs_B_V).sum(dim=-1) - 1
    choice_B = torch.minimum(choice_B, last_valid_B).unsqueeze(1)
    return SampleOutput(
        token_ids_B=ids_B_V.gather(1, choice_B).squeeze(1),
        logprobs_B=logprobs_B_V.gather(1, choice_B).squeeze(1),
        topk_ids_B_K=ids_B_V[:, :topk],
        topk_logprobs_B_K=logprobs_B_V[:, :topk],
    )


def processed_logprobs(logits_B_V: torch.Tensor, temperature_B: torch.Tensor,
                       top_k_B: torch.Tensor, top_p_B: torch.Tensor,
                       suppress_B_V: torch.Tensor | None = None) -> torch.Tensor:
    """Processed log-probs in vocabulary order (B, V); -inf for removed ids."""
    logprobs_B_V, ids_B_V = processed_sorted(logits_B_V, temperature_B, top_k_B, top_p_B,
                                             suppress_B_V)
    return torch.empty_like(logprobs_B_V).scatter_(1, ids_B_V, logprobs_B_V)
