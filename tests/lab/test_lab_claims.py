"""The essay's claims as seeded measurements against the exact gradient (issue 8, "Done when").

Every test builds a tractable world, samples from a controlled sampler, runs the learner's
real losses through `lab.estimators.estimate_gradients` and compares with grad J from the
dynamic program. Margins are multiples of measured standard errors (`lab.stats`).
"""

from __future__ import annotations

import pytest
import torch
from labtest_support import lab_config, one_thread  # noqa: F401 (fixture)

from lab.config import MismatchSection
from lab.estimator_lab import batch_rewards, draw_batch, run_cell
from lab.estimator_spec import PRESETS, EstimatorSpec
from lab.estimators import estimate_gradients
from lab.mismatch import build_sampler
from lab.policy import exact_gradient
from lab.stats import gradient_stats, norm_of_mean
from lab.world import build_world
from learner.losses import PolicyLossConfig, ScoreCenteringConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(cfg, horizon, kind, level, names, seed=0, **mismatch):
    world = build_world(cfg.policy, cfg.reward, horizon)
    section = MismatchSection(kind=kind, levels=[level], **mismatch)
    rows = run_cell(cfg, world, section, level, {n: PRESETS[n] for n in names}, seed)
    return {r["estimator"]: r for r in rows}


def _samples(cfg, world, kind, level, count, seed, group_size, topk=0, **mismatch):
    gen = torch.Generator().manual_seed(seed)
    setup = build_sampler(kind, level, world.theta_P_S_V, world.spec, world.reward, gen,
                          **mismatch)
    batch = draw_batch(world, setup.logits_W_P_S_V,
                       lambda n: setup.table_ids(n, world.spec.horizon, gen), setup.processing,
                       count, group_size, topk or world.spec.vocab_size, gen)
    return batch, batch_rewards(world, batch)


IS_FAMILY = ["no_correction", "trajectory_is", "token_is", "token_tis", "sequence_tis", "cispo"]


def test_trajectory_is_unbiased_token_is_biased_no_correction_worst():
    """Under staleness (mu = pi one update of norm 1.5 ago): exact trajectory IS is unbiased
    within 3 SE at T = 4 and T = 64 while its variance grows >= 5x (beyond 3 SE); token-level
    IS, which ignores how the stale policy changed the prefixes (states) it reaches and the
    rest of the response, is biased (bias_z > 5); at T = 4 no correction is the most biased
    of the IS family (gaps beyond 3 combined SE)."""
    policy = {"vocab_size": 6, "num_prompts": 1}
    short_cfg = lab_config(policy=policy, estimators={"batch_size": 8, "group_size": 4,
                                                      "replicates": 8000})
    long_cfg = lab_config(policy=policy, estimators={"batch_size": 8, "group_size": 4,
                                                     "replicates": 4000})
    short = _rows(short_cfg, 4, "stale", 1, IS_FAMILY, step_norm=1.5)
    long = _rows(long_cfg, 64, "stale", 1, ["trajectory_is"], step_norm=1.5)

    for rows in (short, long):
        traj = rows["trajectory_is"]
        assert traj["bias"] <= 3 * traj["bias_se"], traj
    low, high = short["trajectory_is"], long["trajectory_is"]
    assert high["ess_trajectory"] < low["ess_trajectory"]
    assert (high["variance"] - 3 * high["variance_se"]
            >= 5 * (low["variance"] + 3 * low["variance_se"])), (low, high)

    token = short["token_is"]
    assert token["bias_z"] > 5 and token["bias"] > 3 * token["bias_se"], token
    worst = short["no_correction"]
    for name in IS_FAMILY[1:]:
        other = short[name]
        combined_se = (worst["bias_se"] ** 2 + other["bias_se"] ** 2) ** 0.5
        assert worst["bias"] - other["bias"] > 3 * combined_se, name


def test_truncation_and_cispo_trade_variance_for_bias():
    """Caps on the IS weight (token TIS, CISPO at 2; sequence TIS at 2 for trajectory IS) cut
    the variance of the uncapped estimator (beyond 3 SE each) and shift its expectation
    (the paired difference of the estimates is > 5 SE from zero): a measured bias cost.
    The sampler is two updates stale, so a few percent of the weights exceed the cap."""
    cfg = lab_config(policy={"vocab_size": 6, "num_prompts": 1},
                     estimators={"batch_size": 8, "group_size": 4})
    world = build_world(cfg.policy, cfg.reward, 6)
    m, b = 4000, 8
    batch, rewards = _samples(cfg, world, "stale", 2, m * b, seed=3, group_size=4,
                              step_norm=1.0)
    _, grad = exact_gradient(world.theta_P_S_V, world.spec, world.reward)
    nu = float(grad.norm())

    def estimates(name):
        return estimate_gradients(world.spec, world.theta_P_S_V, batch, rewards, PRESETS[name], b)

    for capped, uncapped in (("token_tis", "token_is"), ("cispo", "token_is"),
                             ("sequence_tis", "trajectory_is")):
        g_cap, g_full = estimates(capped), estimates(uncapped)
        assert g_cap.metrics["loss/is_truncated_frac" if capped != "cispo"
                             else "loss/clip_frac_high"] > 0.01
        s_cap = gradient_stats(g_cap.gradients_M_D, grad.reshape(-1))
        s_full = gradient_stats(g_full.gradients_M_D, grad.reshape(-1))
        assert s_cap.variance + 3 * s_cap.variance_se < s_full.variance - 3 * s_full.variance_se
        shift = norm_of_mean(g_cap.gradients_M_D - g_full.gradients_M_D, nu)
        assert shift.mean > 5 * shift.se, (capped, shift)


def test_dr_grpo_parallel_to_rloo_and_grpo_reweights_groups_by_spread():
    """On-policy with a fixed group size, Dr.GRPO's expected update is parallel to RLOO's
    (independent samples, cosine >= 0.999); GRPO's std normalisation lowers the weight of
    the prompt whose rewards spread 4x wider, relative to grad J, while RLOO keeps it."""
    cfg = lab_config(policy={"vocab_size": 4, "num_prompts": 2},
                     reward={"prompt_scale": [1.0, 4.0]},
                     estimators={"batch_size": 16, "group_size": 4})
    world = build_world(cfg.policy, cfg.reward, 4)
    m, b = 10000, 16
    _, grad = exact_gradient(world.theta_P_S_V, world.spec, world.reward)
    mean = {}
    for seed, name in ((1, "dr_grpo"), (2, "rloo")):
        batch, rewards = _samples(cfg, world, "none", 0, m * b, seed=seed, group_size=4)
        mean[name] = estimate_gradients(world.spec, world.theta_P_S_V, batch, rewards,
                                        PRESETS[name], b).gradients_M_D.mean(0)
    cosine = torch.nn.functional.cosine_similarity(mean["dr_grpo"], mean["rloo"], dim=0)
    assert cosine >= 0.999
    to_exact = torch.nn.functional.cosine_similarity(mean["rloo"], grad.reshape(-1), dim=0)
    assert to_exact >= 0.998

    grpo_same_aggregation = EstimatorSpec(
        advantage="grpo", loss=PolicyLossConfig(surrogate="reinforce",
                                                aggregation="seq_mean_token_sum"))
    cfg_g = lab_config(policy={"vocab_size": 4, "num_prompts": 2},
                       reward={"prompt_scale": [1.0, 4.0]},
                       estimators={"batch_size": 16, "group_size": 4, "replicates": 3000})
    rows = run_cell(cfg_g, world, MismatchSection(kind="none", levels=[0]), 0,
                    {"grpo": grpo_same_aggregation, "rloo": PRESETS["rloo"]}, seed=5)
    by_name = {r["estimator"]: r for r in rows}

    def ratio(row):
        (s1, s2), (e1, e2) = row["prompt_scales"], row["prompt_scales_se"]
        return s2 / s1, (s2 / s1) * ((e1 / s1) ** 2 + (e2 / s2) ** 2) ** 0.5

    rloo_ratio, rloo_se = ratio(by_name["rloo"])
    grpo_ratio, grpo_se = ratio(by_name["grpo"])
    assert abs(rloo_ratio - 1.0) < 3 * rloo_se
    assert grpo_ratio + 3 * grpo_se < 0.5


def test_score_centering_removes_drift_under_constant_reward():
    """Constant reward, no baseline, sampler with logit noise: grad J = 0, yet the
    uncorrected expected update is non-zero (drift toward the sampler); adding the learner's
    score-centering term (full sampler head) brings it to zero within standard error."""
    cfg = lab_config(policy={"vocab_size": 6, "num_prompts": 2},
                     reward={"terminal": 0.0, "constant": 1.0},
                     estimators={"batch_size": 8, "group_size": 4})
    world = build_world(cfg.policy, cfg.reward, 6)
    _, grad = exact_gradient(world.theta_P_S_V, world.spec, world.reward)
    assert float(grad.norm()) < 1e-12
    batch, rewards = _samples(cfg, world, "logit_noise", 0.5, 3000 * 8, seed=4, group_size=4)
    reinforce = PolicyLossConfig(surrogate="reinforce", aggregation="seq_mean_token_sum")
    plain = EstimatorSpec(advantage="raw", loss=reinforce)
    centred = EstimatorSpec(advantage="raw", loss=reinforce, score_centering=ScoreCenteringConfig(
        aggregation="seq_mean_token_sum"))
    drift = gradient_stats(estimate_gradients(world.spec, world.theta_P_S_V, batch, rewards,
                                              plain, 8).gradients_M_D, grad.reshape(-1))
    fixed = gradient_stats(estimate_gradients(world.spec, world.theta_P_S_V, batch, rewards,
                                              centred, 8).gradients_M_D, grad.reshape(-1))
    assert drift.normalizer == fixed.normalizer == "absolute"
    assert drift.bias_z > 10 and drift.bias > 5 * drift.bias_se
    assert fixed.bias <= 3 * fixed.bias_se and fixed.bias_z < 3
    assert drift.bias > 10 * fixed.bias


def _perpendicular(estimates_M_D, direction_D):
    unit = direction_D / direction_D.norm()
    return estimates_M_D - (estimates_M_D @ unit).unsqueeze(1) * unit


def test_gspo_one_over_length_factor():
    """On-policy, GSPO's expected update is not parallel to grad J when lengths vary (each
    response's score is divided by its length), and equals grad J / T when every response
    has length T (no stop token) and all ratios are 1."""
    cfg = lab_config(policy={"vocab_size": 5, "num_prompts": 1},
                     estimators={"batch_size": 8, "group_size": 4})
    gspo = PRESETS["gspo"]
    world = build_world(cfg.policy, cfg.reward, 8)
    _, grad = exact_gradient(world.theta_P_S_V, world.spec, world.reward)
    batch, rewards = _samples(cfg, world, "none", 0, 4000 * 8, seed=6, group_size=4)
    varied = estimate_gradients(world.spec, world.theta_P_S_V, batch, rewards, gspo, 8)
    assert batch.lengths_N.unique().numel() > 3
    off_axis = norm_of_mean(_perpendicular(varied.gradients_M_D, grad.reshape(-1)),
                            float(grad.norm()))
    assert off_axis.mean > 5 * off_axis.se, off_axis

    fixed_cfg = lab_config(policy={"vocab_size": 5, "num_prompts": 1, "stop_token": False},
                           estimators={"batch_size": 8, "group_size": 4})
    horizon = 6
    fixed_world = build_world(fixed_cfg.policy, fixed_cfg.reward, horizon)
    _, fixed_grad = exact_gradient(fixed_world.theta_P_S_V, fixed_world.spec, fixed_world.reward)
    batch, rewards = _samples(fixed_cfg, fixed_world, "none", 0, 4000 * 8, seed=7, group_size=4)
    assert bool((batch.lengths_N == horizon).all())
    equal = estimate_gradients(fixed_world.spec, fixed_world.theta_P_S_V, batch, rewards, gspo, 8)
    assert equal.metrics["loss/clip_frac_low"] == equal.metrics["loss/clip_frac_high"] == 0.0
    stats = gradient_stats(horizon * equal.gradients_M_D, fixed_grad.reshape(-1))
    assert stats.bias <= 3 * stats.bias_se, stats
    assert stats.cosine > 0.99


def test_duration_drop_selection_bias_is_reported():
    """Admission that drops the slowest 30% of trajectories, where hard prompts run slower,
    biases the unbiased on-policy estimator (RLOO) measurably; the lab's row reports the
    bias, the dropped fraction and the hard prompt's reduced weight."""
    cfg = lab_config(policy={"vocab_size": 5, "num_prompts": 2},
                     durations={"difficulty_coupling": 2.0},
                     estimators={"batch_size": 8, "group_size": 4, "replicates": 4000})
    kept = _rows(cfg, 8, "duration_drop", 0.0, ["rloo"], seed=8)["rloo"]
    dropped = _rows(cfg, 8, "duration_drop", 0.3, ["rloo"], seed=9)["rloo"]
    assert kept["dropped_frac"] == 0.0 and kept["bias"] <= 3 * kept["bias_se"]
    assert 0.25 < dropped["dropped_frac"] < 0.35
    assert dropped["bias_z"] > 5 and dropped["bias"] > 3 * dropped["bias_se"], dropped
    world = build_world(cfg.policy, cfg.reward, 8)
    from lab.policy import exact_objective
    hard = int(exact_objective(world.theta_P_S_V, world.spec, world.reward).argmin())
    easy = 1 - hard
    scales, ses = dropped["prompt_scales"], dropped["prompt_scales_se"]
    assert scales[hard] + 3 * ses[hard] < scales[easy] - 3 * ses[easy]


def test_entropy_conditioned_icepop_masks_less_under_numerics_noise():
    """Under large logit noise (the sampler's numerics, s = 0.6) at T = 16: entropy-conditioned
    bounds mask fewer tokens than IcePop's fixed [0.5, 2] (the exploring ones keep their
    natural spread) at a higher variance; the bias is no larger (the lab cannot tell the two
    biases apart at this size: their difference is inside the standard errors)."""
    cfg = lab_config(estimators={"replicates": 2000})
    rows = _rows(cfg, 16, "logit_noise", 0.6, ["icepop", "icepop_entropy"])
    fixed, conditioned = rows["icepop"], rows["icepop_entropy"]
    assert 0 < conditioned["masked_frac"] < fixed["masked_frac"]
    gap_se = (fixed["bias_se"] ** 2 + conditioned["bias_se"] ** 2) ** 0.5
    assert conditioned["bias"] < fixed["bias"] + 3 * gap_se, (fixed, conditioned)
    assert conditioned["variance"] > fixed["variance"]


def test_vcpo_baseline_keeps_trajectory_is_unbiased_and_the_ess_step_trades_scale_for_variance():
    """Under a stale sampler (4 updates old) at T = 16: VCPO's w^2-weighted baseline leaves
    exact trajectory IS unbiased and lowers its variance; scaling each step by its batch's ESS
    shrinks the update to about the ESS fraction and cuts the variance by far more, keeping
    its direction."""
    cfg = lab_config(estimators={"replicates": 2000})
    baseline_only = PRESETS["vcpo"].model_copy(update={"ess_lr": False})
    world = build_world(cfg.policy, cfg.reward, 16)
    section = MismatchSection(kind="stale", levels=[4.0], step_norm=1.0)
    rows = {r["estimator"]: r for r in run_cell(
        cfg, world, section, 4.0, {"trajectory_is": PRESETS["trajectory_is"],
                                   "baseline": baseline_only, "vcpo": PRESETS["vcpo"]}, 0)}
    plain, weighted, vcpo = rows["trajectory_is"], rows["baseline"], rows["vcpo"]
    assert abs(weighted["bias_z"]) < 3 and abs(plain["bias_z"]) < 3
    spread = (plain["variance_se"] ** 2 + weighted["variance_se"] ** 2) ** 0.5
    assert plain["variance"] - weighted["variance"] > 3 * spread, (plain, weighted)
    step = vcpo["metrics"]["vcpo/ess_lr_scale"]
    assert 0.3 < step < 0.8
    assert vcpo["scale"] == pytest.approx(step * weighted["scale"], rel=0.1)
    assert vcpo["variance"] < 0.5 * weighted["variance"]
    assert vcpo["cosine"] > plain["cosine"] - 0.01
