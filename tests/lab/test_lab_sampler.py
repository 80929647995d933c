"""The lab's sampler records what an engine records: processed log-probs and top-k."""

from __future__ import annotations

import math

import pytest
import torch
from labtest_support import one_thread  # noqa: F401 (fixture)

from lab.mismatch import SamplerSetup
from lab.policy import ChainReward, ChainSpec, exact_objective, init_logits, sequence_rewards
from lab.sampler import (
    Processing,
    grouped_prompts,
    processed_logprobs,
    sample_batch,
    token_logprobs,
    trajectory_log_weights,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _slow_processed(logits: list[float], temperature: float, top_k: int, top_p: float):
    """Temperature, then top-k, then nucleus over the survivors: a plain-Python reference."""
    scores = [x / temperature for x in logits]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    keep = set(order[:top_k] if top_k else order)
    z = sum(math.exp(scores[i]) for i in keep)
    probs = {i: math.exp(scores[i]) / z for i in keep}
    if top_p < 1.0:
        mass, nucleus = 0.0, set()
        for i in order:
            if i in keep and mass < top_p:
                nucleus.add(i)
                mass += probs[i]
        keep = nucleus
    z = sum(math.exp(scores[i]) for i in keep)
    return [math.log(math.exp(scores[i]) / z) if i in keep else -math.inf
            for i in range(len(scores))]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.7, 3, 1.0),
                                                     (1.0, 0, 0.6), (0.8, 4, 0.7), (1.0, 1, 1.0)])
def test_processed_logprobs_match_reference(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    got = processed_logprobs(logits, Processing(temperature, top_k, top_p))
    for row in range(5):
        want = _slow_processed(logits[row].tolist(), temperature, top_k, top_p)
        for g, w in zip(got[row].tolist(), want):
            assert (g == w == -math.inf) or abs(g - w) < 1e-12


def test_sampled_frequencies_follow_processed_distribution_and_logprobs_are_recorded():
    spec = ChainSpec(vocab_size=5, horizon=3, num_prompts=1)
    gen = torch.Generator().manual_seed(2)
    theta = torch.randn(spec.shape, generator=gen, dtype=torch.float64)
    processing = Processing(temperature=0.8, top_k=3)
    n = 40000
    batch = sample_batch(spec, theta.unsqueeze(0), torch.zeros(n, 3, dtype=torch.long),
                         torch.zeros(n, dtype=torch.long), torch.arange(n), processing, 4, gen)
    first_lp = processed_logprobs(theta[0, spec.start_state].unsqueeze(0), processing)[0]
    counts = torch.bincount(batch.tokens_N_T[:, 0], minlength=5).double()
    probs = first_lp.exp()
    se = torch.sqrt(probs * (1 - probs) / n)
    assert torch.all((counts / n - probs).abs() <= 4 * se + 1e-12)
    assert torch.all(counts[first_lp == -math.inf] == 0)
    assert torch.allclose(batch.sampler_logprobs_N_T[:, 0], first_lp[batch.tokens_N_T[:, 0]])
    assert torch.isfinite(batch.sampler_logprobs_N_T[batch.mask_N_T]).all()
    top = first_lp.topk(4)
    assert torch.equal(batch.sampler_topk_ids_N_T_K[0, 0], top.indices)


def test_sample_mean_reward_matches_exact_objective():
    spec = ChainSpec(vocab_size=4, horizon=6, num_prompts=2)
    gen = torch.Generator().manual_seed(3)
    theta = init_logits(spec, scale=1.0, length_fraction=0.5, generator=gen)
    reward = ChainReward(token_P_S_V=torch.randn(spec.shape, generator=gen, dtype=torch.float64),
                         terminal_P_S=torch.rand(spec.shape[:2], generator=gen, dtype=torch.float64),
                         truncation_P=torch.tensor([0.5, -1.0], dtype=torch.float64),
                         pattern=(0, 1), pattern_weight_P=torch.tensor([1.0, 2.0], dtype=torch.float64))
    n = 60000
    prompts, groups = grouped_prompts(n, 1, 2, gen)
    batch = sample_batch(spec, theta.unsqueeze(0), torch.zeros(n, 6, dtype=torch.long), prompts,
                         groups, Processing(), 0, gen)
    rewards = sequence_rewards(spec, reward, batch.prompt_ids_N, batch.states_N_T,
                               batch.tokens_N_T, batch.lengths_N, batch.stopped_N)
    exact = exact_objective(theta, spec, reward)
    for p in range(2):
        sel = rewards[batch.prompt_ids_N == p]
        assert abs(float(sel.mean()) - float(exact[p])) < 4 * float(sel.std()) / math.sqrt(len(sel))
    stops = batch.stopped_N
    assert torch.all(batch.tokens_N_T[stops, :].gather(1, (batch.lengths_N[stops] - 1)
                                                       .unsqueeze(1)) == spec.stop_id)
    assert torch.all(batch.lengths_N[~stops] == spec.horizon)


def test_prefix_switch_uses_each_table_on_its_side_of_the_switch():
    spec = ChainSpec(vocab_size=3, horizon=8, num_prompts=1, stop_token=False)
    old = torch.zeros(spec.shape, dtype=torch.float64)
    old[..., 0] = 30.0   # the old parameters always emit token 0
    new = torch.zeros(spec.shape, dtype=torch.float64)
    new[..., 1] = 30.0   # the new ones always emit token 1
    setup = SamplerSetup(torch.stack([old, new]), Processing(), switch=True)
    gen = torch.Generator().manual_seed(4)
    ids = setup.table_ids(500, spec.horizon, gen)
    assert ids[:, 0].eq(0).all() and (ids.diff(dim=1) >= 0).all()
    batch = sample_batch(spec, setup.logits_W_P_S_V, ids, torch.zeros(500, dtype=torch.long),
                         torch.arange(500), Processing(), 0, gen)
    assert torch.equal(batch.tokens_N_T, ids)
    log_w = trajectory_log_weights(batch, new)
    stale_tokens = (ids == 0).sum(1).double()
    assert torch.allclose(log_w, stale_tokens * float(token_logprobs(new, batch)[0, 0]), atol=1e-6)


def test_same_seed_same_batch():
    spec = ChainSpec(vocab_size=6, horizon=10, num_prompts=3)
    theta = init_logits(spec, scale=1.0, length_fraction=0.5,
                        generator=torch.Generator().manual_seed(0)).unsqueeze(0)

    def draw(seed):
        gen = torch.Generator().manual_seed(seed)
        prompts, groups = grouped_prompts(50, 4, 3, gen)
        return sample_batch(spec, theta, torch.zeros(200, 10, dtype=torch.long), prompts, groups,
                            Processing(top_p=0.9), 2, gen)

    a, b, c = draw(7), draw(7), draw(8)
    assert torch.equal(a.tokens_N_T, b.tokens_N_T) and torch.equal(a.group_ids_N, b.group_ids_N)
    assert not torch.equal(a.tokens_N_T, c.tokens_N_T)
