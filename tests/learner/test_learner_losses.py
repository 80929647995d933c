"""Policy losses against slow per-token references (value and gradient), plus invariants."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from learner_reference_impl import (
    agg_coefficients,
    policy_loss_reference,
    score_centering_reference,
    weight_function,
)

from learner.advantages import outcome_advantages
from learner.losses import (
    LossOutput,
    PolicyLossConfig,
    PolicyLossInputs,
    ScoreCenteringConfig,
    ScoreCenteringInputs,
    aggregate,
    aggregation_denominator,
    policy_loss,
    score_centering_loss,
    sequence_tokens,
)

DT = torch.float64


def _batch(seed: int, B: int = 4, T: int = 7, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(B, T, generator=g, dtype=DT) * 3 - 0.05
    old = mu + torch.randn(B, T, generator=g, dtype=DT) * spread
    lp = old + torch.randn(B, T, generator=g, dtype=DT) * spread
    ref = lp + torch.randn(B, T, generator=g, dtype=DT) * spread
    mask = (torch.rand(B, T, generator=g) > 0.3).to(torch.int64)
    mask[:, 0] = 0
    mask[0, 1] = 1
    mask[-1] = 0  # a row without loss tokens must not count in S
    adv_tok = torch.randn(B, T, generator=g, dtype=DT)
    return lp, old, mu, ref, mask, adv_tok


def _run(cfg, lp, old, mu, adv, mask, ref=None):
    lp = lp.clone().requires_grad_(True)
    out = policy_loss(PolicyLossInputs(lp, old, mu, adv, mask, reference_logprobs=ref), cfg)
    out.loss.backward()
    return out, lp.grad


def _compare(cfg, seed, per_sequence_adv=False):
    lp, old, mu, ref, mask, adv_tok = _batch(seed)
    adv = adv_tok[:, 0] if per_sequence_adv else adv_tok
    adv_lists = adv_tok[:, :1].expand_as(adv_tok).tolist() if per_sequence_adv else adv_tok.tolist()
    out, grad = _run(cfg, lp, old, mu, adv, mask, ref if cfg.kl_coef else None)
    want_loss, want_grad = policy_loss_reference(
        lp.tolist(), old.tolist(), mu.tolist(), adv_lists, mask.tolist(), cfg, ref.tolist()
    )
    assert isinstance(out, LossOutput)
    assert out.loss.item() == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=DT), rtol=1e-9, atol=1e-12)
    return out


SURROGATES = ["reinforce", "ppo", "gspo", "gspo_token", "cispo"]
AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_sum_norm"]


@pytest.mark.parametrize("surrogate,aggregation", itertools.product(SURROGATES, AGGREGATIONS))
def test_surrogates_match_reference_for_every_aggregation(surrogate, aggregation):
    cfg = PolicyLossConfig(
        surrogate=surrogate,
        aggregation=aggregation,
        norm_constant=11.0,
        clip_low=0.1,
        clip_high=0.15,
        cispo_low=0.9,
        cispo_high=1.1,
    )
    for seed in range(3):
        _compare(cfg, seed, per_sequence_adv=surrogate.startswith("gspo"))
        _compare(cfg, seed + 10)


def test_ppo_dual_clip_matches_reference_and_bounds_negative_advantage_loss():
    cfg = PolicyLossConfig(surrogate="ppo", dual_clip=1.5, clip_low=0.2, clip_high=0.2)
    lp, old, _, _, mask, adv = _batch(3, spread=0.6)
    out = _compare(cfg, 3)
    ratio = torch.exp(lp - old)
    bound_hit = (adv < 0) & (ratio > 1.5) & mask.bool()
    assert bound_hit.any(), "test data must exercise the dual clip"
    assert out.metrics["loss/dual_clip_frac"] > 0
    per_token = out.per_token
    assert torch.all(per_token[bound_hit] <= -1.5 * adv[bound_hit] + 1e-12)


@pytest.mark.parametrize(
    "correction,level,base",
    itertools.product(["tis", "mis"], ["token", "sequence"], ["proximal", "current"]),
)
def test_behaviour_corrections_match_reference(correction, level, base):
    low, high = (0.8, 1.25) if level == "token" else (0.5, 2.0)
    for surrogate in ("reinforce", "ppo", "cispo"):
        for in_denominator in (True, False):
            cfg = PolicyLossConfig(
                surrogate=surrogate,
                correction=correction,
                correction_level=level,
                ratio_base=base,
                correction_low=low,
                correction_high=high,
                masked_in_denominator=in_denominator,
            )
            for seed in range(3):
                _compare(cfg, seed)


def test_tis_without_floor_matches_reference():
    cfg = PolicyLossConfig(surrogate="reinforce", correction="tis", correction_high=1.1)
    out = _compare(cfg, 5)
    assert out.metrics["loss/is_truncated_frac"] > 0
    assert out.metrics["loss/is_weight_max"] <= 1.1 + 1e-12


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_reference_kl_penalty_matches_reference(estimator):
    cfg = PolicyLossConfig(surrogate="ppo", kl_coef=0.3, kl_estimator=estimator)
    for seed in range(3):
        out = _compare(cfg, seed)
    assert "loss/kl_ref" in out.metrics


def test_kl_without_reference_is_a_clear_error():
    lp, old, mu, _, mask, adv = _batch(0)
    with pytest.raises(ValueError, match="reference_logprobs"):
        policy_loss(PolicyLossInputs(lp, old, mu, adv, mask), PolicyLossConfig(kl_coef=0.1))


def test_mis_excluded_from_denominator_changes_the_normaliser():
    lp, old, mu, _, mask, adv = _batch(1, spread=0.5)
    common = dict(surrogate="reinforce", correction="mis", correction_low=0.8, correction_high=1.25)
    counted = policy_loss(PolicyLossInputs(lp, old, mu, adv, mask), PolicyLossConfig(**common))
    excluded = policy_loss(
        PolicyLossInputs(lp, old, mu, adv, mask),
        PolicyLossConfig(**common, masked_in_denominator=False),
    )
    frac = counted.metrics["loss/masked_frac"]
    assert 0 < frac < 1
    n = mask.sum().item()
    assert excluded.loss.item() == pytest.approx(counted.loss.item() * n / (n * (1 - frac)))


def test_entropy_conditioned_bounds_tighten_sure_tokens_and_widen_exploring_ones():
    from learner.losses import behaviour_weights, entropy_bound_scale

    entropy = torch.tensor([[0.01, 1.0, 2.0, 2.0]], dtype=DT)
    scale = entropy_bound_scale(entropy)
    assert scale[0, 1].item() == pytest.approx(1.0)
    assert scale[0, 0].item() == pytest.approx(math.sqrt(-math.expm1(-0.01) / (1 - math.exp(-1))))
    assert entropy_bound_scale(torch.zeros(1, dtype=DT)).item() == 0.05  # the floor
    # ratios pi_old / mu of 1.5, 1.5, 2.1, 0.47 against IcePop's [0.5, 2]
    mu = torch.zeros(1, 4, dtype=DT)
    old = torch.log(torch.tensor([[1.5, 1.5, 2.1, 0.47]], dtype=DT))
    mask = torch.ones(1, 4, dtype=torch.bool)
    fixed = PolicyLossConfig(correction="mis", correction_low=0.5, correction_high=2.0)
    conditioned = fixed.model_copy(update={"correction_entropy": True})
    _, keep_fixed, _, _ = behaviour_weights(old, old, mu, mask, fixed)
    _, keep_entropy, _, _ = behaviour_weights(old, old, mu, mask, conditioned, entropy)
    assert keep_fixed.tolist() == [[True, True, False, False]]
    # sure token: 1.5 is far outside its tight bounds; at 1 nat the bounds are IcePop's;
    # exploring tokens (2 nats): 2.1 and 0.47 are inside the widened bounds
    assert keep_entropy.tolist() == [[False, True, True, True]]
    with pytest.raises(ValueError, match="proximal_entropy"):
        behaviour_weights(old, old, mu, mask, conditioned)
    tis = PolicyLossConfig(correction="tis", correction_high=2.0, correction_entropy=True)
    weights, _, _, capped = behaviour_weights(old, old, mu, mask, tis, entropy)
    assert capped.tolist() == [[True, False, False, False]]
    assert weights[0, 2].item() == pytest.approx(2.1)
    with pytest.raises(ValueError, match="correction_entropy"):
        PolicyLossConfig(correction="none", correction_entropy=True)
    with pytest.raises(ValueError, match="correction_entropy"):
        PolicyLossConfig(correction="mis", correction_high=2.0, correction_level="sequence",
                         correction_entropy=True)


# ----------------------------------------------------------------------------- invariants


def test_at_ratio_one_ppo_gradient_equals_reinforce_gradient():
    lp, _, mu, _, mask, adv = _batch(2)
    for aggregation in AGGREGATIONS:
        kw = dict(aggregation=aggregation, norm_constant=9.0)
        _, g_ppo = _run(PolicyLossConfig(surrogate="ppo", **kw), lp, lp.clone(), mu, adv, mask)
        _, g_rf = _run(PolicyLossConfig(surrogate="reinforce", **kw), lp, lp.clone(), mu, adv, mask)
        torch.testing.assert_close(g_ppo, g_rf, rtol=1e-12, atol=1e-15)
        assert g_rf.abs().sum() > 0


def test_huge_clip_range_changes_nothing():
    lp, old, mu, _, mask, adv = _batch(4, spread=0.8)
    huge = PolicyLossConfig(surrogate="ppo", clip_low=0.999999, clip_high=1e9)
    out, grad = _run(huge, lp, old, mu, adv, mask)
    lp2 = lp.clone().requires_grad_(True)
    unclipped = -(adv * torch.exp(lp2 - old))
    loss = (unclipped * mask).sum() / mask.sum()
    loss.backward()
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-12)
    torch.testing.assert_close(grad, lp2.grad)
    assert out.metrics["loss/clip_frac_low"] == 0 and out.metrics["loss/clip_frac_high"] == 0


def test_cispo_weight_carries_no_gradient():
    lp, old, mu, _, mask, adv = _batch(6, spread=0.5)
    cfg = PolicyLossConfig(surrogate="cispo", cispo_high=1.2)
    _, grad = _run(cfg, lp, old, mu, adv, mask)
    weight = torch.exp(lp - old).clamp(max=1.2)
    expected = -(weight * adv) * mask / mask.sum()
    torch.testing.assert_close(grad, expected)
    # with the gradient flowing through the weight the result would differ
    lp2 = lp.clone().requires_grad_(True)
    leaky = -(torch.exp(lp2 - old).clamp(max=1.2) * adv * lp2 * mask).sum() / mask.sum()
    leaky.backward()
    assert not torch.allclose(grad, lp2.grad)
    # tokens beyond the cap still get a gradient (unlike PPO's clipped region)
    capped = (torch.exp(lp - old) > 1.2) & mask.bool() & (adv != 0)
    assert capped.any() and torch.all(grad[capped] != 0)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_gspo_and_gspo_token_agree_with_constant_sequence_advantages(aggregation):
    lp, old, mu, _, mask, adv_tok = _batch(7, spread=0.1)
    adv = adv_tok[:, 0]
    kw = dict(aggregation=aggregation, norm_constant=8.0, clip_low=0.05, clip_high=0.05)
    seq, g_seq = _run(PolicyLossConfig(surrogate="gspo", **kw), lp, old, mu, adv, mask)
    tok, g_tok = _run(PolicyLossConfig(surrogate="gspo_token", **kw), lp, old, mu, adv, mask)
    assert seq.loss.item() == pytest.approx(tok.loss.item(), rel=1e-12)
    torch.testing.assert_close(g_seq, g_tok)


def test_zero_advantage_group_contributes_zero_gradient():
    lp, old, mu, _, mask, _ = _batch(8, B=6)
    mask[-1, 2:5] = 1
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, 0.5], dtype=DT)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    for estimator in ("grpo", "dr_grpo", "rloo"):
        adv = outcome_advantages(rewards, groups, estimator)
        for surrogate in SURROGATES:
            for aggregation in AGGREGATIONS:
                cfg = PolicyLossConfig(
                    surrogate=surrogate,
                    aggregation=aggregation,
                    norm_constant=5.0,
                    correction="tis",
                    correction_high=2.0,
                )
                _, grad = _run(cfg, lp, old, mu, adv, mask)
                assert torch.all(grad[3:] == 0), (estimator, surrogate, aggregation)
                assert grad[:3].abs().sum() > 0


def test_masked_positions_get_no_gradient_even_with_nonfinite_values():
    lp, old, mu, _, mask, adv = _batch(9)
    lp = torch.where(mask.bool(), lp, torch.full_like(lp, -torch.inf))
    old = torch.where(mask.bool(), old, torch.full_like(old, torch.nan))
    for surrogate in SURROGATES:
        out, grad = _run(PolicyLossConfig(surrogate=surrogate), lp, old, mu, adv, mask)
        assert math.isfinite(out.loss.item())
        assert torch.all(grad[~mask.bool()] == 0) and torch.isfinite(grad).all()


def test_metrics_report_clip_fractions_separately_and_kl_to_sampler():
    lp, old, mu, _, mask, adv = _batch(10, spread=0.5)
    out = policy_loss(PolicyLossInputs(lp, old, mu, adv, mask), PolicyLossConfig(surrogate="ppo"))
    m = out.metrics
    r = torch.exp(lp - old)
    loss_tokens = mask.bool()
    want_low = ((r < 0.8) & (adv < 0) & loss_tokens).sum().item() / loss_tokens.sum().item()
    want_high = ((r > 1.2) & (adv > 0) & loss_tokens).sum().item() / loss_tokens.sum().item()
    assert m["loss/clip_frac_low"] == pytest.approx(want_low)
    assert m["loss/clip_frac_high"] == pytest.approx(want_high)
    delta = (lp - mu)[loss_tokens]
    assert m["loss/kl_sampler_k1"] == pytest.approx((-delta).mean().item())
    assert m["loss/kl_sampler_k3"] == pytest.approx((torch.exp(delta) - 1 - delta).mean().item())
    assert m["loss/sampler_abs_diff_mean"] == pytest.approx(delta.abs().mean().item())
    assert m["loss/sampler_abs_diff_max"] == pytest.approx(delta.abs().max().item())
    for key in ("loss/is_weight_mean", "loss/is_weight_max", "loss/is_ess", "loss/masked_frac"):
        assert key in m


def test_effective_sample_size_of_weights():
    lp, old, mu, _, mask, adv = _batch(11, spread=0.7)
    cfg = PolicyLossConfig(surrogate="reinforce", correction="tis", correction_high=100.0)
    out = policy_loss(PolicyLossInputs(lp, old, mu, adv, mask), cfg)
    w = torch.exp(old - mu)[mask.bool()]
    ess = (w.sum() ** 2 / (w.numel() * (w * w).sum())).item()
    assert out.metrics["loss/is_ess"] == pytest.approx(ess)
    assert out.metrics["loss/is_weight_mean"] == pytest.approx(w.mean().item())


# ----------------------------------------------------------------------------- aggregation


def test_aggregate_counts_only_sequences_with_loss_tokens():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], dtype=DT)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert aggregate(per_token, mask, "token_mean").item() == pytest.approx(7 / 3)
    assert aggregate(per_token, mask, "seq_mean_token_mean").item() == pytest.approx((1.5 + 4) / 2)
    assert aggregate(per_token, mask, "seq_mean_token_sum").item() == pytest.approx((3 + 4) / 2)
    assert aggregate(per_token, mask, "seq_sum_norm", 10.0).item() == pytest.approx(7 / 20)
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate(per_token, mask, "seq_sum_norm")
    with pytest.raises(ValueError, match="unknown mode"):
        aggregate(per_token, mask, "mean")


def test_aggregate_coefficients_match_reference():
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(5, 6, generator=g) > 0.4).long()
    for mode in AGGREGATIONS:
        x = torch.randn(5, 6, dtype=DT, generator=g, requires_grad=True)
        aggregate(x, mask, mode, 4.0).backward()
        want = torch.tensor(agg_coefficients(mask.tolist(), mode, 4.0), dtype=DT)
        torch.testing.assert_close(x.grad, want)


def test_empty_mask_gives_zero_loss_with_gradient_graph():
    x = torch.randn(2, 3, requires_grad=True)
    loss = aggregate(x, torch.zeros(2, 3), "token_mean")
    loss.backward()
    assert loss.item() == 0 and torch.all(x.grad == 0)


def test_bad_shapes_are_clear_errors():
    lp, old, mu, _, mask, adv = _batch(0)
    with pytest.raises(ValueError, match="advantages must have shape"):
        policy_loss(PolicyLossInputs(lp, old, mu, adv[:, :3], mask), PolicyLossConfig())
    with pytest.raises(ValueError, match=r"one \(B, T\) shape"):
        policy_loss(PolicyLossInputs(lp, old[:, :3], mu, adv, mask), PolicyLossConfig())


# ----------------------------------------------------------------------------- score centering


def _sc_batch(seed: int, B=3, T=5, V=9, K=4, pad_last=True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=DT) * 1.5
    sampler_logits = logits + torch.randn(B, T, V, generator=g, dtype=DT) * 0.5
    mu_logp_all = torch.log_softmax(sampler_logits, -1)
    sampled = torch.multinomial(mu_logp_all.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    mu_logp = mu_logp_all.gather(-1, sampled[..., None]).squeeze(-1)
    top_lp, top_ids = mu_logp_all.topk(K, -1)
    if pad_last:
        top_lp[0, 1, -1] = -torch.inf  # a padded head entry
    mask = (torch.rand(B, T, generator=g) > 0.25).long()
    mask[0, 1] = 1
    adv = torch.randn(B, generator=g, dtype=DT)
    return logits, sampled, mu_logp, top_ids, top_lp, adv, mask


@pytest.mark.parametrize(
    "weight,aggregation",
    itertools.product(
        ["none", "tis", "mis"], ["token_mean", "seq_mean_token_mean", "seq_sum_norm"]
    ),
)
def test_score_centering_matches_reference(weight, aggregation):
    cfg = ScoreCenteringConfig(
        weight=weight,
        weight_low=0.7 if weight == "mis" else None,
        weight_high=1.4,
        aggregation=aggregation,
        norm_constant=6.0,
    )
    for seed in range(3):
        logits, sampled, mu_logp, top_ids, top_lp, adv, mask = _sc_batch(seed)
        x = logits.clone().requires_grad_(True)
        out = score_centering_loss(
            ScoreCenteringInputs(x, sampled, mu_logp, top_ids, top_lp, adv, mask), cfg)
        out.loss.backward()
        adv_rows = adv[:, None].expand(mask.shape).tolist()
        want_loss, want_grad = score_centering_reference(
            logits.tolist(),
            sampled.tolist(),
            mu_logp.tolist(),
            top_ids.tolist(),
            top_lp.tolist(),
            adv_rows,
            mask.tolist(),
            cfg,
        )
        assert out.loss.item() == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
        torch.testing.assert_close(x.grad, torch.tensor(want_grad, dtype=DT), rtol=1e-9, atol=1e-12)
        for key in (
            "score_centering/entropy",
            "score_centering/ess",
            "score_centering/kl_sampler_k3",
            "score_centering/clip_frac_high",
        ):
            assert key in out.metrics


def _expected_centered_gradient(logits_V, mu_V, head_ids, head_logp, sc=None):
    """E_{y ~ mu} of grad_logits [weighted reinforce(y) + score centering(y)], A = 1, exactly.

    The policy term carries the same weight function as the centering term (`sc.weight`)."""
    sc = sc or ScoreCenteringConfig()
    V = logits_V.shape[0]
    total = torch.zeros(V, dtype=DT)
    rf = PolicyLossConfig(surrogate="reinforce", correction=sc.weight,
                          correction_low=sc.weight_low, correction_high=sc.weight_high)
    mask = torch.ones(1, 1)
    for y in range(V):
        x = logits_V.clone()[None, None].requires_grad_(True)
        lp = torch.log_softmax(x, -1)[..., y]
        mu_y = torch.log(mu_V[y]).reshape(1, 1)
        loss = policy_loss(
            PolicyLossInputs(lp, lp.detach(), mu_y, torch.ones(1, dtype=DT), mask), rf).loss
        loss = (
            loss
            + score_centering_loss(
                ScoreCenteringInputs(
                    x,
                    torch.tensor([[y]]),
                    mu_y,
                    head_ids[None, None],
                    head_logp[None, None],
                    torch.ones(1, dtype=DT),
                    mask,
                ),
                sc,
            ).loss
        )
        loss.backward()
        total += mu_V[y] * x.grad[0, 0]
    return total


WEIGHTED_CENTERING = [
    ScoreCenteringConfig(),
    ScoreCenteringConfig(weight="tis", weight_high=1.3),
    ScoreCenteringConfig(weight="tis", weight_low=0.8, weight_high=1.5),
    ScoreCenteringConfig(weight="mis", weight_low=0.6, weight_high=1.6),
]


@pytest.mark.parametrize("sc", WEIGHTED_CENTERING, ids=lambda c: f"{c.weight}-{c.weight_low}")
def test_score_centering_expected_gradient_is_zero_when_head_covers_the_vocabulary(sc):
    g = torch.Generator().manual_seed(3)
    V = 7
    logits = torch.randn(V, generator=g, dtype=DT)
    mu = torch.softmax(logits + torch.randn(V, generator=g, dtype=DT), -1)
    ratios = torch.softmax(logits, -1) / mu
    if sc.weight != "none":  # the weights are really active at this draw
        assert ((ratios > sc.weight_high) | (ratios < (sc.weight_low or 0))).any()
    ids = torch.randperm(V, generator=g)
    expected = _expected_centered_gradient(logits, mu, ids, torch.log(mu[ids]), sc)
    torch.testing.assert_close(expected, torch.zeros(V, dtype=DT), atol=1e-12, rtol=0)
    # without the centering term the same expectation is the weighted drift, which is not zero
    drift = _expected_weighted_score(logits, mu, sc)
    assert drift.abs().max() > 1e-2


def _expected_weighted_score(logits_V, mu_V, sc):
    """E_{y ~ mu}[f(pi(y)/mu(y)) grad_logits log pi(y)], by enumeration."""
    pi = torch.softmax(logits_V, -1)
    total = torch.zeros_like(pi)
    for y in range(pi.shape[0]):
        f = weight_function((pi[y] / mu_V[y]).item(), sc)
        total += mu_V[y] * f * (torch.nn.functional.one_hot(torch.tensor(y), pi.shape[0]) - pi)
    return total


@pytest.mark.parametrize("sc", WEIGHTED_CENTERING, ids=lambda c: f"{c.weight}-{c.weight_low}")
def test_score_centering_is_exact_when_the_sampler_tail_is_the_rescaled_trainer_tail(sc):
    g = torch.Generator().manual_seed(4)
    V, K = 8, 3
    logits = torch.randn(V, generator=g, dtype=DT)
    pi = torch.softmax(logits, -1)
    head = torch.tensor([5, 1, 6])
    tail = torch.tensor([v for v in range(V) if v not in head.tolist()])
    mu = torch.empty(V, dtype=DT)
    mu[head] = torch.tensor([0.3, 0.25, 0.15], dtype=DT)
    mu[tail] = pi[tail] / pi[tail].sum() * (1 - mu[head].sum())
    expected = _expected_centered_gradient(logits, mu, head, torch.log(mu[head]), sc)
    torch.testing.assert_close(expected, torch.zeros(V, dtype=DT), atol=1e-12, rtol=0)
    assert K == head.numel()


def test_score_centering_with_trainer_logsumexp_matches_and_rejects_bad_topk():
    logits, sampled, mu_logp, top_ids, top_lp, adv, mask = _sc_batch(5)
    cfg = ScoreCenteringConfig()
    a = score_centering_loss(
        ScoreCenteringInputs(logits, sampled, mu_logp, top_ids, top_lp, adv, mask), cfg)
    b = score_centering_loss(
        ScoreCenteringInputs(logits, sampled, mu_logp, top_ids, top_lp, adv, mask,
                             trainer_logsumexp=torch.logsumexp(logits, -1)),
        cfg,
        compute_entropy=False,
    )
    assert a.loss.item() == pytest.approx(b.loss.item(), rel=1e-12)
    assert "score_centering/entropy" not in b.metrics
    with pytest.raises(ValueError, match="logprobs_topk"):
        score_centering_loss(
            ScoreCenteringInputs(logits, sampled, mu_logp, top_ids[..., :2], top_lp, adv, mask),
            cfg)


@pytest.mark.parametrize("mode", ["seq_mean_token_mean", "seq_mean_token_sum", "seq_sum_norm"])
def test_a_trajectory_split_into_rows_counts_as_one_sequence(mode):
    """Two rows of one trajectory aggregate exactly like that trajectory in one row."""
    g = torch.Generator().manual_seed(11)
    whole = torch.randn(1, 10, generator=g, dtype=DT)
    other = torch.randn(1, 10, generator=g, dtype=DT)
    mask_whole = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    mask_other = torch.tensor([[0, 1, 1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    one_row = torch.cat([whole, other]), torch.cat([mask_whole, mask_other])
    # the same trajectory as two segments (rows 0 and 1), the other trajectory in row 2
    split = torch.cat([whole[:, :5], whole[:, 5:], other[:, :5]])
    split_mask = torch.cat([mask_whole[:, :5], mask_whole[:, 5:], mask_other[:, :5]])
    index = torch.tensor([0, 0, 1])
    want = aggregate(*one_row, mode, norm_constant=8.0)
    got = aggregate(split, split_mask, mode, 8.0,
                    denominator=aggregation_denominator(split_mask, mode, 8.0, index),
                    sequence_tokens_B=sequence_tokens(split_mask, index))
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    rows_as_sequences = aggregate(split, split_mask, mode, 8.0)
    assert rows_as_sequences.item() != pytest.approx(want.item(), rel=1e-6)
