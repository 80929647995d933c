"""Gradient estimates through the learner's losses: vectorised == per-batch loop == slow
per-sample references written here."""

from __future__ import annotations

import math

import pytest
import torch
from labtest_support import one_thread  # noqa: F401 (fixture)

from lab.estimator_spec import PRESETS, EstimatorSpec, resolve
from lab.estimators import estimate_gradients
from lab.mismatch import build_sampler
from lab.policy import ChainReward, ChainSpec, init_logits, sequence_rewards
from lab.sampler import grouped_prompts, sample_batch
from learner.losses import PolicyLossConfig, ScoreCenteringConfig

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = ChainSpec(vocab_size=5, horizon=5, num_prompts=2)
B, G = 8, 4


def _setup(m: int, kind: str = "stale", level: float = 2, seed: int = 0, topk: int = 5):
    gen = torch.Generator().manual_seed(seed)
    theta = init_logits(SPEC, scale=1.0, length_fraction=0.6, generator=gen)
    reward = ChainReward(terminal_P_S=(torch.rand(SPEC.shape[:2], generator=gen) < 0.5).double(),
                         token_P_S_V=0.1 * torch.randn(SPEC.shape, generator=gen,
                                                       dtype=torch.float64))
    setup = build_sampler(kind, level, theta, SPEC, reward, gen, step_norm=1.0)
    prompts, groups = grouped_prompts(m * B // G, G, SPEC.num_prompts, gen)
    batch = sample_batch(SPEC, setup.logits_W_P_S_V, setup.table_ids(m * B, SPEC.horizon, gen),
                         prompts, groups, setup.processing, topk, gen)
    rewards = sequence_rewards(SPEC, reward, batch.prompt_ids_N, batch.states_N_T,
                               batch.tokens_N_T, batch.lengths_N, batch.stopped_N)
    return theta, batch, rewards


CUSTOM = {
    "mis_not_in_denominator": EstimatorSpec(loss=PolicyLossConfig(
        surrogate="reinforce", correction="mis", correction_low=0.8, correction_high=1.25,
        masked_in_denominator=False, aggregation="token_mean")),
    "sequence_mis": EstimatorSpec(advantage="grpo", loss=PolicyLossConfig(
        surrogate="ppo", correction="mis", correction_level="sequence", correction_high=1.5,
        aggregation="seq_mean_token_mean")),
    "kl_free_score_centering_mis": EstimatorSpec(
        advantage="raw", proximal="sampler", loss=PolicyLossConfig(surrogate="cispo",
                                                                   aggregation="token_mean"),
        score_centering=ScoreCenteringConfig(weight="mis", weight_low=0.5, weight_high=2.0,
                                             aggregation="token_mean")),
}


@pytest.mark.parametrize("name", list(PRESETS) + list(CUSTOM))
def test_vectorised_estimates_equal_one_loss_call_per_batch(name):
    """Every preset's vectorised gradients equal calling the learner once per batch."""
    theta, batch, rewards = _setup(m=12)
    estimator = CUSTOM.get(name) or PRESETS[name]
    keep = torch.ones(batch.size, dtype=torch.bool)
    keep[::7] = False
    fast = estimate_gradients(SPEC, theta, batch, rewards, estimator, B, keep_N=keep,
                              max_chunk_elements=2000)
    slow = estimate_gradients(SPEC, theta, batch, rewards, estimator, B, keep_N=keep, mode="loop")
    assert fast.gradients_M_D.shape == (12, SPEC.dim)
    torch.testing.assert_close(fast.gradients_M_D, slow.gradients_M_D, rtol=1e-9, atol=1e-12)
    assert fast.gradients_M_D.abs().sum() > 0


def _per_sample_scores(theta, batch, row):
    """grad_theta log pi(y_t | s_t) of each loss token of `row`, by autograd on theta."""
    leaf = theta.clone().requires_grad_(True)
    logprobs = torch.log_softmax(leaf, -1)
    p = int(batch.prompt_ids_N[row])
    scores = []
    for t in range(int(batch.lengths_N[row])):
        s, y = int(batch.states_N_T[row, t]), int(batch.tokens_N_T[row, t])
        (g,) = torch.autograd.grad(logprobs[p, s, y], leaf, retain_graph=True)
        scores.append(g.reshape(-1))
    return scores


def _rloo(rewards, groups):
    out = torch.zeros_like(rewards)
    for i in range(len(rewards)):
        others = [float(rewards[j]) for j in range(len(rewards))
                  if groups[j] == groups[i] and j != i]
        out[i] = rewards[i] - sum(others) / len(others)
    return out


def test_trajectory_is_matches_per_sample_reference():
    """g_m = (1/B) sum_i w_i A_i sum_t grad log pi(y_it), w_i = prod_t pi/mu, A = RLOO."""
    theta, batch, rewards = _setup(m=3)
    got = estimate_gradients(SPEC, theta, batch, rewards, PRESETS["trajectory_is"], B)
    trainer_lp = torch.log_softmax(theta, -1)[batch.prompt_ids_N.unsqueeze(1), batch.states_N_T,
                                              batch.tokens_N_T]
    for m in range(3):
        rows = range(m * B, (m + 1) * B)
        adv = _rloo(rewards[m * B:(m + 1) * B], batch.group_ids_N[m * B:(m + 1) * B].tolist())
        want = torch.zeros(SPEC.dim, dtype=torch.float64)
        for k, row in enumerate(rows):
            n = int(batch.lengths_N[row])
            log_w = float((trainer_lp[row, :n] - batch.sampler_logprobs_N_T[row, :n]).sum())
            for score in _per_sample_scores(theta, batch, row):
                want += math.exp(log_w) * adv[k] * score / B
        torch.testing.assert_close(got.gradients_M_D[m], want, rtol=1e-8, atol=1e-12)


def test_score_centering_matches_per_sample_reference():
    """With the full sampler head: g = (1/N_tok) sum_t A (grad log pi(y_t) - E_mu grad log pi)."""
    theta, batch, rewards = _setup(m=2, kind="logit_noise", level=0.5)
    spec_ = EstimatorSpec(advantage="raw", loss=PolicyLossConfig(surrogate="reinforce"),
                          score_centering=ScoreCenteringConfig())
    got = estimate_gradients(SPEC, theta, batch, rewards, spec_, B)
    for m in range(2):
        want = torch.zeros(SPEC.dim, dtype=torch.float64)
        tokens = 0
        for row in range(m * B, (m + 1) * B):
            p = int(batch.prompt_ids_N[row])
            for t, score in enumerate(_per_sample_scores(theta, batch, row)):
                s = int(batch.states_N_T[row, t])
                mu = torch.zeros(SPEC.vocab_size, dtype=torch.float64)
                mu[batch.sampler_topk_ids_N_T_K[row, t]] = batch.sampler_topk_logprobs_N_T_K[row, t].exp()
                pi = torch.softmax(theta[p, s], -1)
                expected = torch.zeros(SPEC.shape, dtype=torch.float64)
                expected[p, s] = mu - pi  # E_mu[grad_logits log pi(v)] = mu - pi on row (p, s)
                want += float(rewards[row]) * (score - expected.reshape(-1))
                tokens += 1
        torch.testing.assert_close(got.gradients_M_D[m], want / tokens, rtol=1e-8, atol=1e-12)


def test_dropped_rows_equal_estimating_without_them():
    theta, batch, rewards = _setup(m=1, kind="none", level=0)
    keep = torch.tensor([True, False, True, True, True, True, False, True])
    with_drop = estimate_gradients(SPEC, theta, batch, rewards, PRESETS["rloo"], B, keep_N=keep)
    kept = batch.select(keep)
    subset = estimate_gradients(SPEC, theta, kept, rewards[keep], PRESETS["rloo"], int(keep.sum()))
    torch.testing.assert_close(with_drop.gradients_M_D, subset.gradients_M_D)


def test_unknown_estimator_lists_choices():
    with pytest.raises(ValueError, match="token_tis.*estimators.custom"):
        resolve("token_tiss")
    custom = {"mine": PRESETS["rloo"]}
    assert resolve("mine", custom) is custom["mine"]


def test_score_centering_without_topk_is_explained():
    theta, batch, rewards = _setup(m=1, topk=0)
    with pytest.raises(ValueError, match="top-k"):
        estimate_gradients(SPEC, theta, batch, rewards, PRESETS["score_centering"], B)
