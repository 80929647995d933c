"""The trainer on the tiny model: RL steps move log-probs the right way, micro-batching is
exact, the critic learns, SFT lowers the demonstration loss, sources are consumed in order."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from config.learner import LearnerConfig
from core.tokenizer import load_tokenizer
from engine.tiny import init_tiny
from learner.batch import InMemorySource, take_batch
from learner.model import policy_outputs
from learner.sft import run_sft
from learner.synthetic import sample_rl_batch, tool_call_demonstrations
from learner.tensors import collate
from learner.trainer import Learner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("learner") / "tiny"
    init_tiny(directory, hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    return directory


@pytest.fixture(scope="module")
def rl_samples(tiny):
    learner = Learner(tiny, LearnerConfig())
    prompts = ["Write 42.", "Count to 3.", "Say hi.", "Add 2 and 2."]
    samples = sample_rl_batch(
        learner.policy, learner.tokenizer, prompts, group_size=4, max_new_tokens=10, topk=8, seed=1
    )
    # reward variation in every group: half of each group succeeds
    return [replace(s, reward=float(i % 2)) for i, s in enumerate(samples)]


def _sequence_logprobs(learner: Learner, samples) -> torch.Tensor:
    """Mean log-prob of each sample's loss tokens under the learner's current weights."""
    batch = collate(samples, learner.pad_id)
    with torch.no_grad():
        lp = policy_outputs(
            learner.policy, batch.input_ids_B_T, batch.attention_mask_B_T
        ).logprobs_B_Tm1
    mask = batch.loss_mask_B_Tm1.float()
    return (lp * mask).sum(-1) / mask.sum(-1)


def _config(**overrides) -> LearnerConfig:
    base = dict(optimizer=dict(lr=3e-3, max_grad_norm=None), micro_batch_size=4, batch_size=16)
    base.update(overrides)
    return LearnerConfig.model_validate(base)


@pytest.mark.parametrize("surrogate", ["reinforce", "ppo", "gspo", "gspo_token", "cispo"])
def test_rl_step_raises_logprobs_of_positive_advantage_tokens(tiny, rl_samples, surrogate):
    cfg = _config(loss=dict(surrogate=surrogate, aggregation="seq_mean_token_mean"))
    learner = Learner(tiny, cfg)
    before = _sequence_logprobs(learner, rl_samples)
    report = learner.rl_step(rl_samples)
    after = _sequence_logprobs(learner, rl_samples)
    positive = torch.tensor([s.reward > 0 for s in rl_samples])
    change = after - before
    assert change[positive].mean() > 0 > change[~positive].mean(), change
    assert report.num_samples == 16 and report.policy_version == 0
    assert report.metrics["learner/grad_norm"] > 0
    for key in (
        "loss/clip_frac_low",
        "loss/clip_frac_high",
        "loss/kl_sampler_k3",
        "loss/entropy",
        "loss/is_ess",
        "time/update_s",
        "perf/tokens_per_s",
    ):
        assert key in report.metrics


def test_rl_step_with_score_centering_correction_and_reference_kl(tiny, rl_samples):
    cfg = _config(
        loss=dict(surrogate="cispo", correction="tis", correction_high=2.0, kl_coef=0.01),
        score_centering=dict(weight="tis", weight_high=2.0),
    )
    learner = Learner(tiny, cfg)
    before = _sequence_logprobs(learner, rl_samples)
    report = learner.rl_step(rl_samples)
    change = _sequence_logprobs(learner, rl_samples) - before
    positive = torch.tensor([s.reward > 0 for s in rl_samples])
    assert change[positive].mean() > 0 > change[~positive].mean()
    assert report.metrics["loss/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # reference = start
    assert 0 < report.metrics["score_centering/head_mass_sampler"] <= 1


def test_score_centering_needs_sampler_topk(tiny, rl_samples):
    bare = [replace(s, sampler_topk_ids=None, sampler_topk_logprobs=None) for s in rl_samples]
    learner = Learner(tiny, _config(score_centering=dict()))
    with pytest.raises(ValueError, match="logprobs_topk"):
        learner.rl_step(bare)


def _gradients(learner: Learner, samples, micro: int, mini: int | None = None):
    """Policy gradients of one optimizer step over `samples` with the given micro-batch size."""
    cfg = learner.cfg.model_copy(update={"micro_batch_size": micro})
    learner.cfg = cfg
    batch = collate(samples, learner.pad_id, need_topk=cfg.score_centering is not None)
    rewards = torch.tensor([s.reward for s in samples])
    step = learner._step_tensors(batch, rewards, ())
    denominators = learner._denominators(step, slice(0, batch.size), first_update=True)
    learner.policy.zero_grad(set_to_none=True)
    for start in range(0, batch.size, micro):
        learner.accumulate_gradients(step, slice(start, min(start + micro, batch.size)),
                                     denominators)
    return [p.grad.clone() for p in learner.policy.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    "loss",
    [
        dict(aggregation="token_mean"),
        dict(aggregation="seq_mean_token_mean", surrogate="gspo"),
        dict(aggregation="seq_sum_norm", norm_constant=16.0, surrogate="cispo"),
        dict(
            correction="mis", correction_low=0.9, correction_high=1.1, masked_in_denominator=False
        ),
    ],
)
def test_micro_batching_gives_the_unsplit_gradient(tiny, rl_samples, loss):
    # samples of different lengths, so the micro-batches' own denominators would differ
    samples = [
        replace(s, loss_mask=np.r_[s.loss_mask[:-i], np.zeros(i, bool)]) if i else s
        for i, s in zip([0, 3, 5, 1] * 4, rl_samples)
    ]
    samples = [
        replace(s, sampler_logprobs=s.sampler_logprobs - 0.2 * (k % 3))
        for k, s in enumerate(samples)
    ]
    sc = {
        "score_centering": dict(
            aggregation=loss.get("aggregation", "token_mean"),
            norm_constant=loss.get("norm_constant"),
        )
    }
    learner = Learner(tiny, _config(loss=loss, **sc))
    whole = _gradients(learner, samples, micro=16)
    split = _gradients(learner, samples, micro=3)
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=1e-6)


def test_gae_with_critic_learns_values_and_moves_policy(tiny, rl_samples):
    cfg = _config(advantage=dict(estimator="gae", gamma=1.0, lam=0.95), critic=dict(lr=3e-3))
    learner = Learner(tiny, cfg)
    before = _sequence_logprobs(learner, rl_samples)
    first = learner.rl_step(rl_samples)
    change = _sequence_logprobs(learner, rl_samples) - before
    positive = torch.tensor([s.reward > 0 for s in rl_samples])
    assert change[positive].mean() > change[~positive].mean()
    reports = [learner.rl_step(rl_samples) for _ in range(4)]
    assert reports[-1].metrics["critic/loss"] < first.metrics["critic/loss"]
    assert "critic/explained_variance" in reports[-1].metrics


def test_sft_lowers_the_loss_on_tool_call_demonstrations(tiny, capsys):
    tokenizer = load_tokenizer(tiny)
    demos = tool_call_demonstrations(tokenizer, 24, seed=0)
    cfg = LearnerConfig(sft=dict(steps=30, batch_size=8, micro_batch_size=4, lr=3e-3))
    learner = Learner(tiny, cfg)
    result = run_sft(learner, demos)
    with capsys.disabled():
        print(
            f"\nSFT on {len(demos)} synthetic tool-call demonstrations: "
            f"loss {result.loss_before:.3f} -> {result.loss_after:.3f} nats/token"
        )
    assert result.loss_after < 0.7 * result.loss_before
    assert len(result.step_losses) == 30


def test_run_consumes_source_in_order_without_splitting_groups(tiny, rl_samples, tmp_path):
    published = []

    def mark(version, path):
        assert (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()
        published.append((version, path.name))

    source = InMemorySource(rl_samples[:14])  # groups of 4, 4, 4, 2
    learner = Learner(
        tiny, _config(batch_size=6, publish_every=2), publish_root=tmp_path, mark_published=mark
    )
    reports = learner.run(source)
    assert [(r.first_seq, r.last_seq) for r in reports] == [(1, 8), (9, 14)]
    assert learner.last_sequence == 14 and learner.version == 1
    assert published == [(1, "v000001")]
    assert reports[1].published_version == 1 and reports[0].published_version is None
    # resuming after the last consumed sequence finds nothing left
    assert take_batch(source, learner.last_sequence, 6) == []


def test_a_learner_publishes_after_the_checkpoint_it_started_from_is_deleted(tiny, tmp_path):
    """A restarted learner starts from a published version, and pruning later deletes that
    version (`[learner] keep_checkpoints`): its next publish must still carry the tokenizer. It
    used to copy the files from the deleted folder and fail with FileNotFoundError (the
    data-parallel restart test with 8 steps, 2026-12-05)."""
    import shutil

    start = tmp_path / "v000003"
    shutil.copytree(tiny, start)
    learner = Learner(start, _config(), publish_root=tmp_path / "policy")
    shutil.rmtree(start)
    path = learner.publish()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (path / name).read_bytes() == (tiny / name).read_bytes()
    assert load_tokenizer(path).encode("a b", add_special_tokens=False)


def test_a_partial_batch_waits_until_the_source_is_finished(tiny, rl_samples):
    class Growing(InMemorySource):
        polls = 0

        def finished(self, after_sequence: int) -> bool:
            Growing.polls += 1
            return Growing.polls > 3

    learner = Learner(tiny, _config(batch_size=32))
    reports = learner.run(Growing(rl_samples), poll_s=0.0)
    assert Growing.polls > 3, "the learner must not train on a partial batch early"
    assert [r.num_samples for r in reports] == [16]


def test_zero_variance_groups_can_be_dropped(tiny, rl_samples):
    samples = [replace(s, reward=1.0) if s.group_id == "g0" else s for s in rl_samples]
    learner = Learner(tiny, _config(advantage=dict(drop_zero_variance_groups=True)))
    report = learner.rl_step(samples)
    assert report.num_samples == 12
    assert report.metrics["learner/zero_variance_dropped"] == 4


def test_the_segments_of_one_trajectory_count_once_in_the_step_denominators(tiny, rl_samples):
    """Rows sharing a trajectory id (a template split the trajectory) are one sequence."""
    first = rl_samples[0].trajectory_id
    merged = [replace(s, trajectory_id=first) if i < 2 else s for i, s in enumerate(rl_samples)]
    cfg = _config(loss=dict(aggregation="seq_mean_token_mean"))
    learner = Learner(tiny, cfg)
    batch = collate(merged, learner.pad_id)
    step = learner._step_tensors(batch, torch.tensor([s.reward for s in merged]), ())
    den = learner._denominators(step, slice(0, batch.size), first_update=True)
    assert den.policy.item() == len(rl_samples) - 1
    both = batch.loss_mask_B_Tm1[:2].sum()
    assert den.policy_sequence_tokens_B[:2].tolist() == [both.item()] * 2
    assert den.policy_sequence_tokens_B[2].item() == batch.loss_mask_B_Tm1[2].sum().item()


def test_bfloat16_products_keep_float32_weights_gradients_and_optimizer_state(tiny, rl_samples):
    """`[learner] dtype = "bfloat16"`: the forward's products run in bfloat16 (its log-probs
    differ from float32's by bfloat16 rounding), while weights, gradients and Adam's moments stay
    float32, and the step still moves log-probs the right way."""
    learner = Learner(tiny, _config(dtype="bfloat16"))
    assert learner.precision.dtype == "bfloat16"
    batch = collate(rl_samples, learner.pad_id)
    with torch.no_grad():
        plain = policy_outputs(learner.policy, batch.input_ids_B_T, batch.attention_mask_B_T)
        with learner.precision.compute():
            mixed = policy_outputs(learner.policy, batch.input_ids_B_T, batch.attention_mask_B_T)
    assert mixed.logprobs_B_Tm1.dtype == torch.float32
    gap = (mixed.logprobs_B_Tm1 - plain.logprobs_B_Tm1).abs()[batch.loss_mask_B_Tm1]
    assert 1e-4 < float(gap.max()) < 0.5, "bfloat16 products, within bfloat16 rounding"
    before = _sequence_logprobs(learner, rl_samples)
    learner.rl_step(rl_samples)
    change = _sequence_logprobs(learner, rl_samples) - before
    positive = torch.tensor([s.reward > 0 for s in rl_samples])
    assert change[positive].mean() > 0 > change[~positive].mean(), change
    for param in learner.policy.parameters():
        assert param.dtype == torch.float32
        assert param.grad is None or param.grad.dtype == torch.float32
        state = learner.optimizer.state[param]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_auto_keeps_a_narrow_model_in_float32(tiny):
    assert Learner(tiny, _config()).precision.dtype == "float32"  # 64 wide: bfloat16 would not pay


def test_the_gap_probe_measures_both_precisions_on_lag_zero_tokens(tiny, rl_samples):
    """`gap_probe`: the sampled tokens (sampled by the float32 model the learner starts from,
    so lag 0 and float32 on both sides) are recomputed in float32 and in bfloat16: the float32
    gap is rounding, the bfloat16 one is bfloat16's."""
    learner = Learner(tiny, _config(gap_probe=True))
    metrics = learner.rl_step(rl_samples).metrics
    assert metrics["numerics/gap_tokens"] == metrics["learner/loss_tokens"]
    assert metrics["numerics/gap_float32_max"] < 1e-3
    assert metrics["numerics/gap_bfloat16_max"] > 10 * metrics["numerics/gap_float32_max"]
    for dtype in ("float32", "bfloat16"):
        mean, p99, top = (metrics[f"numerics/gap_{dtype}_{k}"] for k in ("mean", "p99", "max"))
        assert 0 <= mean <= p99 <= top
    assert not any(k.startswith("numerics/") for k in Learner(tiny, _config()).rl_step(
        rl_samples).metrics)


def test_selection_weights_scale_each_trajectorys_advantage(tiny, rl_samples):
    """[admission] reweight: the stored weight multiplies the trajectory's advantage, so a
    trajectory of a bucket admitted half as often counts twice in the update."""
    learner = Learner(tiny, _config(advantage=dict(estimator="dr_grpo")))
    weights = [0.5 + (i % 3) for i in range(len(rl_samples))]
    batch = collate(rl_samples, learner.pad_id)
    rewards = torch.tensor([s.reward for s in rl_samples])
    plain = learner._step_tensors(batch, rewards, ())
    scaled = learner._step_tensors(batch, rewards, (), torch.tensor(weights))
    assert torch.allclose(scaled.advantages, plain.advantages * torch.tensor(weights))
    assert plain.advantages.abs().sum() > 0
    weighted = [replace(s, selection_weight=w) for s, w in zip(rl_samples, weights)]
    report = learner.rl_step(weighted)
    assert report.metrics["selection/weight_max"] == 2.5
    assert report.metrics["selection/weight_mean"] == pytest.approx(sum(weights) / len(weights))
    assert "selection/weight_mean" not in Learner(tiny, _config()).rl_step(rl_samples).metrics
    with pytest.raises(ValueError, match="selection_weight"):
        replace(rl_samples[0], selection_weight=0.0)


def test_entropy_conditioned_mask_uses_pi_old_entropy(tiny, rl_samples):
    """`loss.correction_entropy`: the no-grad pass keeps pi_old's entropy per token, and the
    step's masks use it (the same tokens are masked whatever the micro-batch size)."""
    loss = dict(surrogate="ppo", correction="mis", correction_low=0.9, correction_high=1.1,
                correction_entropy=True, masked_in_denominator=False)
    learner = Learner(tiny, _config(loss=loss))
    batch = collate(rl_samples, learner.pad_id)
    step = learner._step_tensors(batch, torch.tensor([s.reward for s in rl_samples]), ())
    assert step.proximal_entropy_B_Tm1 is not None
    assert step.proximal_entropy_B_Tm1.shape == step.proximal_logprobs_B_Tm1.shape
    assert float(step.proximal_entropy_B_Tm1[batch.loss_mask_B_Tm1].min()) >= 0
    report = learner.rl_step(rl_samples)
    assert "loss/masked_frac" in report.metrics
    assert Learner(tiny, _config())._step_tensors(
        batch, torch.tensor([s.reward for s in rl_samples]), ()).proximal_entropy_B_Tm1 is None


def _off_policy(samples, seed=3, spread=0.4):
    """The samples with their sampler log-probs shifted per token, as a stale sampler's."""
    g = np.random.default_rng(seed)
    out = []
    for s in samples:
        noise = g.normal(0.0, spread, s.sampler_logprobs.shape).astype(np.float32)
        out.append(replace(s, sampler_logprobs=s.sampler_logprobs + noise * s.loss_mask))
    return out


def test_vcpo_min_variance_baseline_and_ess_scaled_lr(tiny, rl_samples):
    """VCPO: off-policy ratios change the group baselines and shrink the step's lr by the ESS
    fraction of the trajectories' ratios; on-policy samples leave both as they were."""
    stale = _off_policy(rl_samples)
    rewards = torch.tensor([s.reward for s in rl_samples])
    mean_cfg = _config(advantage=dict(estimator="dr_grpo"))
    vcpo_cfg = _config(advantage=dict(estimator="dr_grpo", baseline="min_variance"),
                       optimizer=dict(lr=3e-3, max_grad_norm=None, ess_lr=True))
    plain = Learner(tiny, mean_cfg)._step_tensors(collate(stale, 0), rewards, ())
    vcpo_learner = Learner(tiny, vcpo_cfg)
    vcpo = vcpo_learner._step_tensors(collate(stale, vcpo_learner.pad_id), rewards, ())
    assert not torch.allclose(vcpo.advantages, plain.advantages)
    assert vcpo.trajectory_log_ratio_B is not None
    report = vcpo_learner.rl_step(stale)
    scale = report.metrics["learner/ess_lr_scale"]
    assert 0 < scale < 0.9
    assert vcpo_learner.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * scale)
    on_policy = Learner(tiny, vcpo_cfg).rl_step(rl_samples)
    assert on_policy.metrics["learner/ess_lr_scale"] > 0.99
    with pytest.raises(ValueError, match="min_variance"):
        _config(advantage=dict(estimator="gae", baseline="min_variance"))
