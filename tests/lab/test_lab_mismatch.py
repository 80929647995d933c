"""Mismatch sources: neutral levels are on-policy; each kind moves the sampler as documented."""

from __future__ import annotations

import pytest
import torch
from labtest_support import one_thread  # noqa: F401 (fixture)

from lab.levels import NEUTRAL_LEVEL, check_level
from lab.mismatch import build_sampler, random_direction, stale_logits
from lab.policy import ChainReward, ChainSpec, exact_gradient, exact_objective, init_logits
from lab.sampler import processed_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = ChainSpec(vocab_size=5, horizon=6, num_prompts=2)


def _world():
    gen = torch.Generator().manual_seed(0)
    theta = init_logits(SPEC, scale=1.0, length_fraction=0.5, generator=gen)
    reward = ChainReward(terminal_P_S=(torch.rand(SPEC.shape[:2], generator=gen) < 0.5).double())
    return theta, reward


def _distribution(setup, row: int = 0):
    """The sampler's processed next-token distribution at every (prompt, state)."""
    logits = setup.logits_W_P_S_V[row].reshape(-1, SPEC.vocab_size)
    return processed_logprobs(logits, setup.processing).exp()


@pytest.mark.parametrize("kind", sorted(NEUTRAL_LEVEL))
def test_neutral_level_is_on_policy(kind):
    theta, reward = _world()
    setup = build_sampler(kind, NEUTRAL_LEVEL[kind], theta, SPEC, reward,
                          torch.Generator().manual_seed(1))
    want = torch.softmax(theta, -1).reshape(-1, SPEC.vocab_size)
    for row in range(setup.logits_W_P_S_V.shape[0]):
        torch.testing.assert_close(_distribution(setup, row), want)


def test_stale_walks_back_along_the_exact_gradient():
    theta, reward = _world()
    old = stale_logits(theta, SPEC, reward, 3, step_norm=0.4)
    assert abs(float((theta - old).norm()) - 1.2) < 0.05
    j_now = exact_objective(theta, SPEC, reward).mean()
    assert exact_objective(old, SPEC, reward).mean() < j_now
    _, grad = exact_gradient(theta, SPEC, reward)
    one = stale_logits(theta, SPEC, reward, 1, step_norm=0.4)
    torch.testing.assert_close(theta - one, 0.4 * grad / grad.norm())


def test_drift_and_noise_have_the_requested_size():
    theta, reward = _world()
    gen = torch.Generator().manual_seed(2)
    drift = build_sampler("drift", 0.7, theta, SPEC, reward, gen)
    assert abs(float((drift.logits_W_P_S_V[0] - theta).norm()) - 0.7) < 1e-9
    assert torch.all(random_direction(SPEC, gen)[:, SPEC.stop_id] == 0)
    noise = build_sampler("logit_noise", 0.3, theta, SPEC, reward, gen)
    spread = float((noise.logits_W_P_S_V[0] - theta).std())
    assert 0.2 < spread < 0.4


def test_processing_kinds_filter_tokens():
    theta, reward = _world()
    gen = torch.Generator().manual_seed(3)
    top2 = _distribution(build_sampler("top_k", 2, theta, SPEC, reward, gen))
    assert torch.all((top2 > 0).sum(-1) == 2)
    nucleus = _distribution(build_sampler("top_p", 0.5, theta, SPEC, reward, gen))
    assert torch.all((nucleus > 0).sum(-1) < SPEC.vocab_size)
    cold = _distribution(build_sampler("temperature", 0.5, theta, SPEC, reward, gen))
    warm = torch.softmax(theta, -1).reshape(-1, SPEC.vocab_size)
    assert torch.all(cold.max(-1).values >= warm.max(-1).values - 1e-12)


def test_prefix_switch_tables_and_kv_residual():
    theta, reward = _world()
    gen = torch.Generator().manual_seed(4)
    setup = build_sampler("prefix_switch", 2, theta, SPEC, reward, gen, step_norm=0.5,
                          kv_residual=0.25)
    old = stale_logits(theta, SPEC, reward, 2, 0.5)
    torch.testing.assert_close(setup.logits_W_P_S_V[0], old)
    torch.testing.assert_close(setup.logits_W_P_S_V[1], theta + 0.25 * (old - theta))
    ids = setup.table_ids(4000, SPEC.horizon, gen)
    switch_positions = (ids == 0).sum(1)
    assert switch_positions.min() >= 1 and switch_positions.max() == SPEC.horizon


@pytest.mark.parametrize("kind,level,fragment", [
    ("stale", 1.5, "whole numbers"), ("top_k", 9, "0..5"), ("top_p", 0.0, "(0, 1]"),
    ("temperature", 0.0, "> 0"), ("duration_drop", 1.0, "fraction dropped"),
    ("drift", -1.0, ">= 0"), ("none", 1.0, "single level")])
def test_bad_levels_are_explained(kind, level, fragment):
    message = check_level(kind, level, vocab_size=5)
    assert message is not None and fragment in message
    theta, reward = _world()
    with pytest.raises(ValueError, match="levels|level"):
        build_sampler(kind, level, theta, SPEC, reward, torch.Generator())


def test_stale_refuses_a_constant_reward():
    theta, _ = _world()
    constant = ChainReward(terminal_P_S=torch.ones(SPEC.shape[:2], dtype=torch.float64))
    with pytest.raises(ValueError, match="drift"):
        build_sampler("stale", 1, theta, SPEC, constant, torch.Generator())
