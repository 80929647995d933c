"""Advantage estimators against slow references, and their invariants."""

from __future__ import annotations

import pytest
import torch
from learner_reference_impl import gae_reference, outcome_reference

from learner.advantages import (
    gae,
    masked_whiten,
    outcome_advantages,
    trajectory_advantages,
    zero_variance_groups,
)

DT = torch.float64


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_outcome_estimators_match_reference(estimator):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (23,), generator=g).to(DT) + torch.rand(23, generator=g, dtype=DT)
    groups = torch.randint(0, 7, (23,), generator=g) * 10  # sparse ids, some groups of one
    got = outcome_advantages(rewards, groups, estimator)
    want = outcome_reference(rewards.tolist(), groups.tolist(), estimator)
    torch.testing.assert_close(got, torch.tensor(want, dtype=DT))


def test_group_ids_may_be_strings_and_singletons_get_zero():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.7])
    adv = outcome_advantages(rewards, ["a", "a", "b", "c"], "grpo")
    assert adv[2] == 0 and adv[3] == 0
    assert adv[0] == pytest.approx(0.5 / (0.5**0.5 + 1e-6)) and adv[1] == -adv[0]
    for estimator in ("dr_grpo", "rloo"):
        assert torch.all(outcome_advantages(rewards, ["a", "a", "b", "c"], estimator)[2:] == 0)


def test_grpo_uses_unbiased_std():
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=DT)
    adv = outcome_advantages(rewards, [0, 0, 0, 0], "grpo", eps=0.0)
    std = torch.std(rewards)  # unbiased
    torch.testing.assert_close(adv, (rewards - rewards.mean()) / std)


def test_dr_grpo_is_proportional_to_rloo_with_fixed_group_size():
    g = torch.Generator().manual_seed(1)
    n = 5
    rewards = torch.rand(4 * n, generator=g, dtype=DT)
    groups = torch.arange(4).repeat_interleave(n)
    dr = outcome_advantages(rewards, groups, "dr_grpo")
    rloo = outcome_advantages(rewards, groups, "rloo")
    torch.testing.assert_close(dr, (n - 1) / n * rloo)



@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_a_multi_segment_trajectory_is_one_group_member(estimator):
    # trajectory "t0" was split by its template into three rows; it must weigh as one member
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0], dtype=DT)
    groups = ["a", "a", "a", "a", "a", "b"]
    trajectories = ["t0", "t0", "t0", "t1", "t2", "t3"]
    got = trajectory_advantages(rewards, groups, trajectories, estimator)
    once = outcome_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=DT),
                              ["a", "a", "a", "b"], estimator)
    torch.testing.assert_close(got, once[[0, 0, 0, 1, 2, 3]])
    assert got[0] != outcome_advantages(rewards, groups, estimator)[0]  # counting rows differs


def test_peers_outside_the_batch_enter_only_their_groups_baselines():
    rewards = torch.tensor([1.0, 0.0], dtype=DT)
    got = trajectory_advantages(rewards, ["a", "a"], ["t0", "t1"], "dr_grpo",
                                peers=[("a", 1.0), ("a", 1.0), ("z", 5.0)])
    torch.testing.assert_close(got, torch.tensor([1.0 - 0.75, 0.0 - 0.75], dtype=DT))


def test_unknown_estimator_is_a_clear_error():
    with pytest.raises(ValueError, match="call learner.advantages.gae"):
        outcome_advantages(torch.zeros(2), [0, 0], "gae")
    with pytest.raises(ValueError, match="unknown outcome estimator"):
        outcome_advantages(torch.zeros(2), [0, 0], "ppo")


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.0)])
def test_gae_skips_masked_positions(gamma, lam):
    g = torch.Generator().manual_seed(2)
    B, T = 4, 12
    mask = (torch.rand(B, T, generator=g) > 0.35).long()
    mask[:, 0] = 0
    rewards = torch.zeros(B, T, dtype=DT)
    for b in range(B):  # outcome reward on the last loss token, small shaping elsewhere
        idx = mask[b].nonzero().flatten()
        rewards[b, idx] = torch.randn(len(idx), generator=g, dtype=DT) * 0.1
        rewards[b, idx[-1]] += 1.0
    values = torch.randn(B, T, generator=g, dtype=DT)
    adv, ret = gae(rewards, values, mask, gamma, lam, whiten=False)
    want_adv, want_ret = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=DT))
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=DT))


def test_gae_with_lambda_one_and_no_discount_is_return_minus_value():
    values = torch.tensor([[0.0, 0.3, 9.9, 0.5, 0.2]], dtype=DT)  # 9.9 sits on a tool token
    mask = torch.tensor([[0, 1, 0, 1, 1]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]], dtype=DT)
    adv, ret = gae(rewards, values, mask, 1.0, 1.0, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.7, 0.0, 0.5, 0.8]], dtype=DT))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.0, 0.0, 1.0, 1.0]], dtype=DT))


def test_gae_whitening_uses_masked_mean_and_unbiased_variance():
    g = torch.Generator().manual_seed(3)
    mask = (torch.rand(3, 8, generator=g) > 0.3).long()
    rewards = torch.where(mask.bool(), torch.randn(3, 8, generator=g, dtype=DT), 0.0)
    values = torch.randn(3, 8, generator=g, dtype=DT)
    raw, _ = gae(rewards, values, mask, 0.95, 0.9, whiten=False)
    white, _ = gae(rewards, values, mask, 0.95, 0.9, whiten=True)
    sel = raw[mask.bool()]
    want = (sel - sel.mean()) / torch.sqrt(sel.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(white[mask.bool()], want)
    assert torch.all(white[~mask.bool()] == 0)
    assert masked_whiten(raw, mask)[mask.bool()].mean().abs() < 1e-12


def test_gae_rejects_reward_on_masked_position():
    with pytest.raises(ValueError, match="masked position"):
        gae(torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), torch.tensor([[0, 1]]), 1.0, 1.0)


def test_zero_variance_groups_keeps_only_groups_with_varying_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.2])
    keep = zero_variance_groups(rewards, ["a", "a", "b", "b", "c", "c", "d"])
    assert keep.tolist() == [False, False, True, True, False, False, False]


def test_min_variance_baseline_weights_the_group_means():
    """VCPO's baseline: the group mean weighted by squared importance ratios. Equal weights give
    the plain estimators; all weight on one member makes it the baseline."""
    from learner.advantages import outcome_advantages

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    groups = [0, 0, 0, 0]
    for estimator in ("grpo", "dr_grpo", "rloo"):
        plain = outcome_advantages(rewards, groups, estimator)
        same = outcome_advantages(rewards, groups, estimator,
                                  baseline_weights_B=torch.full((4,), 3.0))
        torch.testing.assert_close(same, plain)
    weights = torch.tensor([4.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    dr = outcome_advantages(rewards, groups, "dr_grpo", baseline_weights_B=weights)
    torch.testing.assert_close(dr, rewards - 4.0 / 6.0)
    loo = outcome_advantages(rewards, groups, "rloo", baseline_weights_B=weights)
    # member 0's others weigh 1, 1, 0 (mean 0); member 3's others weigh 4, 1, 1 (mean 4/6)
    torch.testing.assert_close(loo, torch.tensor([1.0, -0.8, -0.8, 1 - 4 / 6],
                                                 dtype=torch.float64))
    # a member whose others all weigh 0 falls back to their plain mean
    lone = outcome_advantages(rewards[:2], [0, 0], "rloo",
                              baseline_weights_B=torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(lone, torch.tensor([1.0, -1.0], dtype=torch.float64))
