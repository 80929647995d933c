"""The tractable policy's exact J and grad J against brute-force enumeration of all responses."""

from __future__ import annotations

import itertools

import pytest
import torch

from lab.policy import (
    ChainReward,
    ChainSpec,
    exact_gradient,
    exact_objective,
    expected_length,
    init_logits,
    sequence_rewards,
)


def _responses(spec: ChainSpec):
    """Every possible response: content tokens then stop, or `horizon` content tokens."""
    content = range(spec.content_vocab)
    for length in range(spec.horizon + 1):
        for body in itertools.product(content, repeat=length):
            if length == spec.horizon:
                yield body, False
            elif spec.stop_id is not None:
                yield body + (spec.stop_id,), True


def _slow_reward(spec: ChainSpec, reward: ChainReward, prompt: int, tokens: tuple,
                 stopped: bool) -> float:
    total, state = 0.0, spec.start_state
    for token in tokens:
        if reward.token_P_S_V is not None:
            total += float(reward.token_P_S_V[prompt, state, token])
        if token == spec.stop_id:
            break
        state = token
    if reward.terminal_P_S is not None:
        total += float(reward.terminal_P_S[prompt, state])
    if reward.truncation_P is not None and not stopped:
        total += float(reward.truncation_P[prompt])
    if reward.pattern:
        body = tokens[:-1] if stopped else tokens
        m = len(reward.pattern)
        hits = sum(1 for i in range(len(body) - m + 1) if tuple(body[i:i + m]) == reward.pattern)
        total += hits * float(reward.pattern_weight_P[prompt])
    return total


def _brute_force(logits, spec, reward):
    logprobs = torch.log_softmax(logits, -1)
    per_prompt = []
    for p in range(spec.num_prompts):
        value = torch.zeros((), dtype=logits.dtype)
        for tokens, stopped in _responses(spec):
            state, lp = spec.start_state, torch.zeros((), dtype=logits.dtype)
            for token in tokens:
                lp = lp + logprobs[p, state, token]
                state = token
            value = value + lp.exp() * _slow_reward(spec, reward, p, tokens, stopped)
        per_prompt.append(value)
    return torch.stack(per_prompt)


def _random_reward(spec: ChainSpec, gen: torch.Generator, pattern=(0, 1, 0)) -> ChainReward:
    return ChainReward(
        token_P_S_V=torch.randn(spec.shape, generator=gen, dtype=torch.float64),
        terminal_P_S=torch.randn(spec.shape[:2], generator=gen, dtype=torch.float64),
        truncation_P=torch.randn(spec.shape[:1], generator=gen, dtype=torch.float64),
        pattern=pattern,
        pattern_weight_P=torch.rand(spec.shape[:1], generator=gen, dtype=torch.float64) + 0.5,
    )


@pytest.mark.parametrize("vocab,horizon,stop", [(3, 1, True), (3, 4, True), (4, 3, True),
                                                 (2, 5, False), (3, 3, False)])
def test_exact_objective_and_gradient_match_enumeration(vocab, horizon, stop):
    spec = ChainSpec(vocab_size=vocab, horizon=horizon, num_prompts=2, stop_token=stop)
    gen = torch.Generator().manual_seed(vocab * 100 + horizon)
    logits = torch.randn(spec.shape, generator=gen, dtype=torch.float64)
    pattern = (0, 1) if horizon >= 2 else (0,)
    reward = _random_reward(spec, gen, pattern)
    leaf = logits.clone().requires_grad_(True)
    brute = _brute_force(leaf, spec, reward)
    (brute_grad,) = torch.autograd.grad(brute.mean(), leaf)
    exact = exact_objective(logits, spec, reward)
    torch.testing.assert_close(exact, brute.detach(), rtol=1e-10, atol=1e-10)
    j, grad = exact_gradient(logits, spec, reward)
    torch.testing.assert_close(j, brute.mean().detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, brute_grad, rtol=1e-9, atol=1e-10)
    assert grad.abs().sum() > 0


def test_stop_state_rows_get_no_gradient_and_length_is_exact():
    spec = ChainSpec(vocab_size=4, horizon=4, num_prompts=1)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(spec.shape, generator=gen, dtype=torch.float64)
    reward = _random_reward(spec, gen, (1, 2))
    _, grad = exact_gradient(logits, spec, reward)
    assert torch.all(grad[:, spec.stop_id] == 0)
    length_reward = ChainReward(token_P_S_V=torch.ones(spec.shape, dtype=torch.float64))
    torch.testing.assert_close(expected_length(logits, spec),
                               exact_objective(logits, spec, length_reward))


def test_sequence_rewards_of_enumerated_responses_match_slow_definition():
    spec = ChainSpec(vocab_size=3, horizon=4, num_prompts=2)
    gen = torch.Generator().manual_seed(5)
    reward = _random_reward(spec, gen, (0, 0))
    rows = [(p, tokens, stopped) for p in range(2) for tokens, stopped in _responses(spec)]
    n = len(rows)
    tokens_N_T = torch.zeros(n, spec.horizon, dtype=torch.long)
    states_N_T = torch.full((n, spec.horizon), spec.start_state, dtype=torch.long)
    for i, (_, tokens, _) in enumerate(rows):
        state = spec.start_state
        for t, token in enumerate(tokens):
            tokens_N_T[i, t], states_N_T[i, t] = token, state
            state = token
    got = sequence_rewards(spec, reward, torch.tensor([r[0] for r in rows]), states_N_T,
                           tokens_N_T, torch.tensor([len(r[1]) for r in rows]),
                           torch.tensor([r[2] for r in rows]))
    want = torch.tensor([_slow_reward(spec, reward, p, tok, st) for p, tok, st in rows],
                        dtype=torch.float64)
    torch.testing.assert_close(got, want)


def test_long_horizon_dp_is_fast_and_finite():
    spec = ChainSpec(vocab_size=16, horizon=256, num_prompts=4)
    gen = torch.Generator().manual_seed(0)
    logits = init_logits(spec, scale=1.0, length_fraction=0.5, generator=gen)
    reward = ChainReward(terminal_P_S=torch.rand(spec.shape[:2], generator=gen,
                                                 dtype=torch.float64))
    j, grad = exact_gradient(logits, spec, reward)
    assert torch.isfinite(grad).all() and 0 < j < 1
    mean_len = expected_length(logits, spec).mean()
    assert 40 < mean_len < 200, "init_logits should give lengths of order length_fraction * T"


def test_reward_shape_errors_name_the_field():
    spec = ChainSpec(vocab_size=4, horizon=3)
    with pytest.raises(ValueError, match="terminal_P_S"):
        exact_objective(torch.zeros(spec.shape), spec,
                        ChainReward(terminal_P_S=torch.zeros(3, 3)))
    with pytest.raises(ValueError, match="stop token"):
        ChainReward(pattern=(3,), pattern_weight_P=torch.ones(1)).check(spec)
