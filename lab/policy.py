"""A tractable autoregressive policy whose expected reward and its gradient are exact.

The policy is a Markov chain over tokens: the next-token logits depend on the prompt and on the
previous token only. Its parameters are a table `logits_P_S_V`:

- P prompts (a prompt is drawn uniformly; it selects its own table),
- S = V + 1 states: state s < V means "the previous token was s", state `V` (`start_state`) is
  the start of the response, before any token,
- V tokens; with `stop_token=True` the last id, V - 1, is the stop token: sampling it ends the
  response (it is part of the response and carries a log-prob: T includes the stop decision).

A response has at most `horizon` tokens; one that reaches the horizon without stopping is
truncated. Rewards that decompose along the chain (`ChainReward`: per-token rewards, a terminal
reward of the final state, a reward on truncation, counts of a token pattern) have an expected
value computed exactly by a forward dynamic program over the state marginals, so
`exact_objective` returns J(theta) per prompt as a differentiable function of the logits and
`exact_gradient` returns grad J by autograd, with no sampling. `sequence_rewards` scores sampled
responses with exactly the same definition, so the DP's J is the mean of what sampling sees.

Guarantees: J and grad J equal brute-force enumeration over all responses (tested for small V
and T); the rows of the stop state never receive gradient (that state cannot be entered).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChainSpec:
    """Shape of a Markov policy: vocabulary, horizon, prompts and whether a stop token exists."""

    vocab_size: int
    horizon: int
    num_prompts: int = 1
    stop_token: bool = True

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {self.vocab_size}")
        if self.horizon < 1:
            raise ValueError(f"horizon must be at least 1, got {self.horizon}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be at least 1, got {self.num_prompts}")

    @property
    def num_states(self) -> int:
        return self.vocab_size + 1

    @property
    def start_state(self) -> int:
        return self.vocab_size

    @property
    def stop_id(self) -> int | None:
        return self.vocab_size - 1 if self.stop_token else None

    @property
    def content_vocab(self) -> int:
        """Tokens that continue the response (all but the stop token)."""
        return self.vocab_size - 1 if self.stop_token else self.vocab_size

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_prompts, self.num_states, self.vocab_size)

    @property
    def dim(self) -> int:
        return self.num_prompts * self.num_states * self.vocab_size


@dataclass(frozen=True)
class ChainReward:
    """A reward that decomposes along the chain; every part defaults to zero.

    token_P_S_V:   reward for emitting token v in state s (the stop token included)
    terminal_P_S:  reward of the final state: the state in which stop was sampled, or the last
                   token of a truncated response (the start state for an empty response)
    truncation_P:  reward added when the response reaches the horizon without stopping
    pattern:       token ids (no stop token); the reward counts its (overlapping) occurrences
                   among the content tokens, each worth pattern_weight_P[prompt]
    """

    token_P_S_V: torch.Tensor | None = None
    terminal_P_S: torch.Tensor | None = None
    truncation_P: torch.Tensor | None = None
    pattern: tuple[int, ...] = ()
    pattern_weight_P: torch.Tensor | None = None

    def check(self, spec: ChainSpec) -> None:
        """Raise ValueError when a table's shape or the pattern does not fit `spec`."""
        expected = {
            "token_P_S_V": spec.shape,
            "terminal_P_S": spec.shape[:2],
            "truncation_P": spec.shape[:1],
            "pattern_weight_P": spec.shape[:1],
        }
        for name, shape in expected.items():
            table = getattr(self, name)
            if table is not None and tuple(table.shape) != shape:
                raise ValueError(f"ChainReward.{name} has shape {tuple(table.shape)}, "
                                 f"expected {shape}")
        if self.pattern:
            if self.pattern_weight_P is None:
                raise ValueError("ChainReward.pattern is set but pattern_weight_P is missing")
            bad = [t for t in self.pattern if not 0 <= t < spec.content_vocab]
            if bad:
                raise ValueError(f"ChainReward.pattern has ids {bad} outside the content "
                                 f"tokens 0..{spec.content_vocab - 1} (the stop token cannot "
                                 "be part of a pattern)")
            if len(self.pattern) > spec.horizon:
                raise ValueError(f"ChainReward.pattern is longer ({len(self.pattern)}) than "
                                 f"the horizon ({spec.horizon})")


def _flows(logprobs_P_S_V: torch.Tensor, spec: ChainSpec):
    """Yield (t, alive_P_S, probs_P_S_V) for each position t, then (T, alive_P_S, None)."""
    probs_P_S_V = logprobs_P_S_V.exp()
    alive_P_S = torch.zeros(spec.num_prompts, spec.num_states, dtype=probs_P_S_V.dtype)
    alive_P_S[:, spec.start_state] = 1.0
    pad = spec.num_states - spec.content_vocab
    for t in range(spec.horizon):
        yield t, alive_P_S, probs_P_S_V
        flow_P_S_V = alive_P_S.unsqueeze(-1) * probs_P_S_V
        continuing_P_C = flow_P_S_V[:, :, : spec.content_vocab].sum(1)
        alive_P_S = torch.nn.functional.pad(continuing_P_C, (0, pad))
    yield spec.horizon, alive_P_S, None


def exact_objective(logits_P_S_V: torch.Tensor, spec: ChainSpec,
                    reward: ChainReward) -> torch.Tensor:
    """J per prompt, shape (P,): the exact expected reward, differentiable in the logits."""
    if tuple(logits_P_S_V.shape) != spec.shape:
        raise ValueError(f"logits have shape {tuple(logits_P_S_V.shape)}, expected {spec.shape}")
    reward.check(spec)
    logprobs_P_S_V = torch.log_softmax(logits_P_S_V, dim=-1)
    total_P = torch.zeros(spec.num_prompts, dtype=logits_P_S_V.dtype)
    pattern_tail_P = _pattern_tail(logprobs_P_S_V.exp(), reward)
    m = len(reward.pattern)
    for t, alive_P_S, probs_P_S_V in _flows(logprobs_P_S_V, spec):
        if probs_P_S_V is None:  # the horizon: truncated responses end here
            if reward.terminal_P_S is not None:
                total_P = total_P + (alive_P_S * reward.terminal_P_S).sum(1)
            if reward.truncation_P is not None:
                total_P = total_P + alive_P_S.sum(1) * reward.truncation_P
            break
        flow_P_S_V = alive_P_S.unsqueeze(-1) * probs_P_S_V
        if reward.token_P_S_V is not None:
            total_P = total_P + (flow_P_S_V * reward.token_P_S_V).sum((1, 2))
        if spec.stop_id is not None and reward.terminal_P_S is not None:
            total_P = total_P + (flow_P_S_V[:, :, spec.stop_id] * reward.terminal_P_S).sum(1)
        if m and t + m <= spec.horizon:
            start_P = (alive_P_S * probs_P_S_V[:, :, reward.pattern[0]]).sum(1)
            total_P = total_P + start_P * pattern_tail_P
    return total_P


def _pattern_tail(probs_P_S_V: torch.Tensor, reward: ChainReward) -> torch.Tensor:
    """Weight x probability that the pattern's tokens after the first follow the first one."""
    if not reward.pattern:
        return torch.zeros(probs_P_S_V.shape[0], dtype=probs_P_S_V.dtype)
    tail_P = reward.pattern_weight_P.to(probs_P_S_V.dtype)
    for prev, nxt in zip(reward.pattern[:-1], reward.pattern[1:]):
        tail_P = tail_P * probs_P_S_V[:, prev, nxt]
    return tail_P


def exact_gradient(logits_P_S_V: torch.Tensor, spec: ChainSpec, reward: ChainReward,
                   prompt_weights_P: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(J, grad J): J = sum_p w_p J_p (uniform w by default) and its gradient, shape P x S x V."""
    leaf = logits_P_S_V.detach().clone().requires_grad_(True)
    weights_P = _prompt_weights(spec, prompt_weights_P, leaf.dtype)
    objective = (exact_objective(leaf, spec, reward) * weights_P).sum()
    (grad_P_S_V,) = torch.autograd.grad(objective, leaf)
    return objective.detach(), grad_P_S_V


def _prompt_weights(spec: ChainSpec, weights_P: torch.Tensor | None,
                    dtype: torch.dtype) -> torch.Tensor:
    if weights_P is None:
        return torch.full((spec.num_prompts,), 1.0 / spec.num_prompts, dtype=dtype)
    return weights_P.to(dtype)


def expected_length(logits_P_S_V: torch.Tensor, spec: ChainSpec) -> torch.Tensor:
    """Expected response length per prompt (stop token included), shape (P,)."""
    logprobs_P_S_V = torch.log_softmax(logits_P_S_V.detach(), dim=-1)
    length_P = torch.zeros(spec.num_prompts, dtype=logits_P_S_V.dtype)
    for _, alive_P_S, probs_P_S_V in _flows(logprobs_P_S_V, spec):
        if probs_P_S_V is not None:
            length_P = length_P + alive_P_S.sum(1)
    return length_P


def sequence_rewards(spec: ChainSpec, reward: ChainReward, prompt_ids_N: torch.Tensor,
                     states_N_T: torch.Tensor, tokens_N_T: torch.Tensor,
                     lengths_N: torch.Tensor, stopped_N: torch.Tensor) -> torch.Tensor:
    """Reward of each sampled response, shape (N,), by the same definition as the DP.

    states_N_T / tokens_N_T: the state before and the token at each position (any valid ids
    beyond the length); lengths_N: tokens in the response, stop included; stopped_N: bool.
    """
    reward.check(spec)
    n, t_max = tokens_N_T.shape
    positions_T = torch.arange(t_max)
    mask_N_T = positions_T.unsqueeze(0) < lengths_N.unsqueeze(1)
    total_N = torch.zeros(n, dtype=torch.float64)
    if reward.token_P_S_V is not None:
        per_token_N_T = reward.token_P_S_V[prompt_ids_N.unsqueeze(1), states_N_T, tokens_N_T]
        total_N += (per_token_N_T.double() * mask_N_T).sum(1)
    last_N = (lengths_N - 1).clamp(min=0).unsqueeze(1)
    final_state_N = torch.where(stopped_N, states_N_T.gather(1, last_N).squeeze(1),
                                tokens_N_T.gather(1, last_N).squeeze(1))
    if reward.terminal_P_S is not None:
        total_N += reward.terminal_P_S[prompt_ids_N, final_state_N].double()
    if reward.truncation_P is not None:
        total_N += reward.truncation_P[prompt_ids_N].double() * (~stopped_N)
    if reward.pattern:
        total_N += _pattern_counts(reward, tokens_N_T, lengths_N - stopped_N.long()) * \
            reward.pattern_weight_P[prompt_ids_N].double()
    return total_N


def _pattern_counts(reward: ChainReward, tokens_N_T: torch.Tensor,
                    content_lengths_N: torch.Tensor) -> torch.Tensor:
    m = len(reward.pattern)
    if tokens_N_T.shape[1] < m:
        return torch.zeros(tokens_N_T.shape[0], dtype=torch.float64)
    windows_N_W_M = tokens_N_T.unfold(1, m, 1)
    pattern_M = torch.tensor(reward.pattern, dtype=tokens_N_T.dtype)
    hit_N_W = (windows_N_W_M == pattern_M).all(-1)
    ends_W = torch.arange(windows_N_W_M.shape[1]) + m
    inside_N_W = ends_W.unsqueeze(0) <= content_lengths_N.unsqueeze(1)
    return (hit_N_W & inside_N_W).sum(1).double()


def init_logits(spec: ChainSpec, *, scale: float, length_fraction: float,
                generator: torch.Generator, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Random logits N(0, scale^2); the stop logit is shifted so that, at uniform other logits,
    a response would stop after about `length_fraction * horizon` tokens."""
    logits_P_S_V = torch.randn(spec.shape, generator=generator, dtype=dtype) * scale
    if spec.stop_id is not None:
        mean_len = max(1.0, length_fraction * spec.horizon)
        # P(stop) = e^b / (e^b + C) = 1 / mean_len  =>  b = log(C / (mean_len - 1))
        others = spec.content_vocab
        bias = torch.log(torch.tensor(others / max(mean_len - 1.0, 1e-3), dtype=dtype))
        logits_P_S_V[:, :, spec.stop_id] += bias
    return logits_P_S_V
