"""Vectorised sampling from the Markov policy, recording what an inference engine records.

The sampler draws every response of a batch at once, one position per step. Its logits come
from a stack of parameter tables (`sampler_logits_W_P_S_V`); `table_ids_N_T` says which table
produced each position, so one sequence can switch parameters partway (a weight update reaching
a sequence in flight). The logits are processed like an engine does it (temperature, then
top-k, then top-p over the top-k survivors, renormalised, the order of
`core.engine_api.SamplingParams`), and the batch records, for every position, the sampled
id, its log-probability under the processed distribution (`sampler_logprobs_N_T`) and the top-k
ids/log-probs of that processed distribution.

Guarantees: a sampled id always has finite sampler log-prob; positions after the response's end
hold finite, valid values (the chain keeps running from the stop state) and are excluded by
`mask_N_T`; the same generator seed gives the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.policy import ChainSpec


@dataclass(frozen=True)
class Processing:
    """Engine-side processing of the sampler's logits (1.0 / 0 / 1.0 switch each off)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")


def processed_logprobs(logits_N_V: torch.Tensor, processing: Processing) -> torch.Tensor:
    """Log-probs of the distribution the engine samples from; filtered tokens get -inf."""
    scores_N_V = logits_N_V / processing.temperature
    vocab = scores_N_V.shape[-1]
    if 0 < processing.top_k < vocab:
        kth_N_1 = scores_N_V.topk(processing.top_k, dim=-1).values[..., -1:]
        scores_N_V = scores_N_V.masked_fill(scores_N_V < kth_N_1, float("-inf"))
    if processing.top_p < 1.0:
        probs_N_V = torch.softmax(scores_N_V, dim=-1)
        sorted_N_V, order_N_V = probs_N_V.sort(dim=-1, descending=True)
        mass_before_N_V = sorted_N_V.cumsum(-1) - sorted_N_V
        drop_sorted_N_V = mass_before_N_V >= processing.top_p
        drop_N_V = torch.zeros_like(drop_sorted_N_V).scatter(-1, order_N_V, drop_sorted_N_V)
        scores_N_V = scores_N_V.masked_fill(drop_N_V, float("-inf"))
    return torch.log_softmax(scores_N_V, dim=-1)


@dataclass(frozen=True)
class SampledBatch:
    """N sampled responses, padded to the horizon T; K is the recorded sampler top-k."""

    prompt_ids_N: torch.Tensor
    group_ids_N: torch.Tensor
    states_N_T: torch.Tensor
    tokens_N_T: torch.Tensor
    mask_N_T: torch.Tensor
    lengths_N: torch.Tensor
    stopped_N: torch.Tensor
    sampler_logprobs_N_T: torch.Tensor
    sampler_topk_ids_N_T_K: torch.Tensor
    sampler_topk_logprobs_N_T_K: torch.Tensor
    table_ids_N_T: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.prompt_ids_N.shape[0])

    def select(self, index_N: torch.Tensor) -> SampledBatch:
        """The rows `index_N` (a long index or bool mask), every field alike."""
        return SampledBatch(**{name: getattr(self, name)[index_N]
                               for name in self.__dataclass_fields__})


def grouped_prompts(num_groups: int, group_size: int, num_prompts: int,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_ids_N, group_ids_N): i.i.d. uniform prompts, each repeated for its G members."""
    prompts_G = torch.randint(num_prompts, (num_groups,), generator=generator)
    groups_N = torch.arange(num_groups).repeat_interleave(group_size)
    return prompts_G[groups_N], groups_N


def sample_batch(spec: ChainSpec, sampler_logits_W_P_S_V: torch.Tensor,
                 table_ids_N_T: torch.Tensor, prompt_ids_N: torch.Tensor,
                 group_ids_N: torch.Tensor, processing: Processing, topk: int,
                 generator: torch.Generator) -> SampledBatch:
    """Sample N responses; position t of row n uses table `table_ids_N_T[n, t]`."""
    n, horizon = prompt_ids_N.shape[0], spec.horizon
    if tuple(table_ids_N_T.shape) != (n, horizon):
        raise ValueError(f"table_ids_N_T has shape {tuple(table_ids_N_T.shape)}, "
                         f"expected {(n, horizon)}")
    if not 0 <= topk <= spec.vocab_size:
        raise ValueError(f"topk must be in 0..{spec.vocab_size}, got {topk}")
    tables = sampler_logits_W_P_S_V
    states_N_T = torch.empty(n, horizon, dtype=torch.long)
    tokens_N_T = torch.empty(n, horizon, dtype=torch.long)
    logprobs_N_T = torch.empty(n, horizon, dtype=tables.dtype)
    topk_ids_N_T_K = torch.empty(n, horizon, topk, dtype=torch.long)
    topk_lp_N_T_K = torch.empty(n, horizon, topk, dtype=tables.dtype)
    state_N = torch.full((n,), spec.start_state, dtype=torch.long)
    alive_N = torch.ones(n, dtype=torch.bool)
    lengths_N = torch.zeros(n, dtype=torch.long)
    stopped_N = torch.zeros(n, dtype=torch.bool)
    for t in range(horizon):
        logits_N_V = tables[table_ids_N_T[:, t], prompt_ids_N, state_N]
        logprobs_N_V = processed_logprobs(logits_N_V, processing)
        uniform_N_V = torch.rand(logprobs_N_V.shape, generator=generator,
                                 dtype=logprobs_N_V.dtype).clamp_min(1e-300)
        token_N = (logprobs_N_V - torch.log(-torch.log(uniform_N_V))).argmax(-1)
        states_N_T[:, t] = state_N
        tokens_N_T[:, t] = token_N
        logprobs_N_T[:, t] = logprobs_N_V.gather(1, token_N.unsqueeze(1)).squeeze(1)
        if topk:
            top = logprobs_N_V.topk(topk, dim=-1)
            topk_ids_N_T_K[:, t], topk_lp_N_T_K[:, t] = top.indices, top.values
        lengths_N += alive_N.long()
        if spec.stop_id is not None:
            ended_N = alive_N & (token_N == spec.stop_id)
            stopped_N |= ended_N
            alive_N &= ~ended_N
        state_N = token_N
    mask_N_T = torch.arange(horizon).unsqueeze(0) < lengths_N.unsqueeze(1)
    return SampledBatch(prompt_ids_N, group_ids_N, states_N_T, tokens_N_T, mask_N_T, lengths_N,
                        stopped_N, logprobs_N_T, topk_ids_N_T_K, topk_lp_N_T_K, table_ids_N_T)


def trajectory_log_weights(batch: SampledBatch, trainer_logits_P_S_V: torch.Tensor
                           ) -> torch.Tensor:
    """log prod_t pi(y_t)/mu(y_t) of each response, shape (N,): the exact trajectory IS weight."""
    trainer_lp_N_T = token_logprobs(trainer_logits_P_S_V, batch)
    return ((trainer_lp_N_T - batch.sampler_logprobs_N_T) * batch.mask_N_T).sum(1)


def token_logprobs(logits_P_S_V: torch.Tensor, batch: SampledBatch) -> torch.Tensor:
    """log pi(y_t | state) of each sampled token under `logits_P_S_V`, shape (N, T)."""
    logprobs_P_S_V = torch.log_softmax(logits_P_S_V, dim=-1)
    return logprobs_P_S_V[batch.prompt_ids_N.unsqueeze(1), batch.states_N_T, batch.tokens_N_T]
