"""SFT warm start on every built-in suite's demonstrations lowers the tiny model's loss."""

from __future__ import annotations

import pytest
import torch

from config.learner import LearnerConfig, SftConfig
from engine.tiny import init_tiny
from learner.sft import loss_token_logprobs, run_sft
from learner.trainer import Learner
from tasks import demonstration_samples, load_family
from tasks.chat import make_chat_format

SUITES = {"arith": {}, "codefix": {}, "longhaul": {"max_k": 8},
          "tasks.suites.vault:family": {"depths": [6]}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("suite-sft") / "tiny"
    init_tiny(directory, hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    return directory


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_sft_lowers_the_loss_on_the_suite_demonstrations(tiny, suite, capsys):
    learner = Learner(tiny, LearnerConfig())
    family = load_family(suite, SUITES[suite])
    samples = demonstration_samples(
        family.demonstrations(8, seed=1), make_chat_format(learner.tokenizer)
    )
    demos = [(s.token_ids, s.loss_mask) for s in samples]
    result = run_sft(learner, demos, SftConfig(steps=12, batch_size=4, micro_batch_size=2, lr=5e-3))
    with capsys.disabled():
        print(
            f"\nSFT on {len(demos)} {suite} demonstrations: loss {result.loss_before:.3f} -> "
            f"{result.loss_after:.3f} nats per loss token"
        )
    assert result.loss_after < 0.8 * result.loss_before


def test_loss_token_logprobs_sum_the_log_probabilities_of_the_demonstrated_turns(tiny):
    """What the validation check of `learner sft` exponentiates: per demonstration, the summed
    log-probability of its loss tokens, the same in micro-batches of mixed lengths as alone."""
    learner = Learner(tiny, LearnerConfig())
    family = load_family("arith", {"max_ops": 3})
    samples = demonstration_samples(family.demonstrations(5, seed=1),
                                    make_chat_format(learner.tokenizer))
    pairs = [(s.token_ids, s.loss_mask) for s in samples]
    assert len({len(ids) for ids, _ in pairs}) > 1, "mixed lengths, so padding is exercised"
    sums = loss_token_logprobs(learner, pairs, micro_batch_size=2)
    for (ids, mask), got in zip(pairs, sums):
        with torch.no_grad():
            logits = learner.policy(input_ids=torch.tensor([ids])).logits.float()[0]
        logp = torch.log_softmax(logits[:-1], -1)
        want = sum(logp[t, ids[t + 1]].item() for t in range(len(ids) - 1) if mask[t + 1])
        assert got == pytest.approx(want, abs=1e-3)
        assert got < 0


def test_the_sft_learning_rate_warms_up_then_follows_its_schedule(tiny, monkeypatch):
    import learner.sft as sft_module

    seen: list[float] = []
    step = sft_module.sft_step

    def recording_step(learner, samples, optimizer, sft):
        seen.append(optimizer.param_groups[0]["lr"])
        return step(learner, samples, optimizer, sft)

    monkeypatch.setattr(sft_module, "sft_step", recording_step)
    learner = Learner(tiny, LearnerConfig())
    samples = demonstration_samples(load_family("arith", {}).demonstrations(4, seed=1),
                                    make_chat_format(learner.tokenizer))
    demos = [(s.token_ids, s.loss_mask) for s in samples]
    run_sft(learner, demos, SftConfig(steps=6, batch_size=2, lr=1e-3, warmup_steps=2,
                                      lr_schedule="cosine"))
    assert seen[:2] == pytest.approx([5e-4, 1e-3])  # linear warmup
    # then cosine towards 0 over the 4 steps after warmup: 1, 0.854, 0.5, 0.146 of lr
    assert seen[2:] == pytest.approx([1e-3, 8.536e-4, 5e-4, 1.464e-4], rel=1e-3)
    seen.clear()
    run_sft(learner, demos, SftConfig(steps=3, batch_size=2, lr=1e-3))
    assert seen == pytest.approx([1e-3] * 3)  # the default: constant


def test_checkpoint_selection_keeps_the_weights_of_the_best_scored_step(tiny):
    """`select_every`: the checkpoint is scored every N steps and at the end; the run ends on
    the weights of the best-scored step, not the last, and says which step that was."""
    learner = Learner(tiny, LearnerConfig())
    family = load_family("arith", {"max_ops": 2})
    samples = demonstration_samples(family.demonstrations(8, seed=1),
                                    make_chat_format(learner.tokenizer))
    demos = [(s.token_ids, s.loss_mask) for s in samples]
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    peak = {6: 0.9}  # step 6 scores best; every other scored step scores lower

    def score() -> float:
        snapshots[learner.step] = {k: v.clone() for k, v in learner.policy.state_dict().items()}
        return peak.get(learner.step, 0.1 * learner.step / 10)

    sft = SftConfig(steps=10, batch_size=4, micro_batch_size=2, lr=5e-3, select_every=3)
    result = run_sft(learner, demos, sft, score=score)
    assert sorted(result.scores) == [3, 6, 9, 10], "every 3 steps and at the end"
    assert result.kept_step == 6
    assert len(result.step_losses) == 10
    kept = learner.policy.state_dict()
    assert all(torch.equal(kept[k], snapshots[6][k]) for k in kept)
    assert not all(torch.equal(kept[k], snapshots[10][k]) for k in kept)


def _arith_demos(learner, count=8):
    family = load_family("arith", {"max_ops": 2})
    samples = demonstration_samples(family.demonstrations(count, seed=1),
                                    make_chat_format(learner.tokenizer))
    return [(s.token_ids, s.loss_mask) for s in samples]


def test_a_try_that_stays_below_restart_below_is_followed_by_the_next_retry(tiny):
    """`restart_below`: while the best score so far stays under it, the next `retries` entry
    runs from the weights the run began with, with its own settings; the best try's best step is
    kept, and the step count is that of the kept try."""
    learner = Learner(tiny, LearnerConfig())
    demos = _arith_demos(learner)
    start = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    tries = [0]  # the try being scored
    snapshots: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    ends = {0: 4, 1: 6, 2: 4}  # the steps each try runs

    def score() -> float:  # each try's step 2 beats its others; try 1 scores best
        snapshots[(tries[0], learner.step)] = {k: v.clone() for k, v in
                                               learner.policy.state_dict().items()}
        value = {0: 0.1, 1: 0.2, 2: 0.15}[tries[0]] + 0.01 * (learner.step == 2)
        tries[0] += learner.step == ends[tries[0]]
        return value

    sft = SftConfig(steps=4, batch_size=4, micro_batch_size=2, lr=5e-3, select_every=2,
                    restart_below=0.5, retries=[{"steps": 6}, {"shuffle_seed": 7}])
    result = run_sft(learner, demos, sft, score=score)
    assert tries[0] == 3, "both retries ran, each best below 0.5"
    assert result.tries == [pytest.approx({2: 0.11, 4: 0.1}),
                            pytest.approx({2: 0.21, 4: 0.2, 6: 0.2}),
                            pytest.approx({2: 0.16, 4: 0.15})]
    assert result.kept_try == 1 and result.kept_step == 2
    assert len(result.step_losses) == 6 and learner.step == 6, "the kept try's steps"
    kept = learner.policy.state_dict()
    assert all(torch.equal(kept[k], snapshots[(1, 2)][k]) for k in kept), "try 1, step 2"
    # every try began at the starting weights: try 1 (same order, constant lr, only longer)
    # is where try 0 was at step 2; try 2, in another order, is elsewhere
    assert not all(torch.equal(start[k], snapshots[(0, 2)][k]) for k in kept)
    assert all(torch.equal(snapshots[(0, 2)][k], snapshots[(1, 2)][k]) for k in kept)
    assert not all(torch.equal(snapshots[(0, 2)][k], snapshots[(2, 2)][k]) for k in kept)


def test_retries_stop_once_a_try_reaches_restart_below(tiny):
    learner = Learner(tiny, LearnerConfig())
    scores = iter([0.1, 0.1, 0.6, 0.4])  # try 0: steps 2, 4; try 1: steps 2, 4

    sft = SftConfig(steps=4, batch_size=4, micro_batch_size=2, lr=5e-3, select_every=2,
                    restart_below=0.5, retries=[{"lr": 1e-3}, {"steps": 2}])
    result = run_sft(learner, _arith_demos(learner), sft, score=lambda: next(scores))
    assert len(result.tries) == 2 and result.kept_try == 1 and result.kept_step == 2


def test_a_first_try_above_restart_below_is_the_same_run_as_without_restarts(tiny):
    runs = []
    for restart_below in (0.0, 0.05):
        learner = Learner(tiny, LearnerConfig())
        sft = SftConfig(steps=4, batch_size=4, micro_batch_size=2, lr=5e-3, select_every=2,
                        restart_below=restart_below, retries=[{"steps": 8}], seed=3)
        calls = []
        result = run_sft(learner, _arith_demos(learner), sft,
                         score=lambda: calls.append(1) or 0.1)
        runs.append((result, len(calls), learner.policy.state_dict()))
    (plain, plain_calls, plain_weights), (guarded, guarded_calls, guarded_weights) = runs
    assert plain_calls == guarded_calls == 2, "one try each"
    assert plain.tries == [] and guarded.tries == [{2: 0.1, 4: 0.1}]
    assert plain.step_losses == guarded.step_losses
    assert all(torch.equal(plain_weights[k], guarded_weights[k]) for k in plain_weights)


def test_restart_below_without_selection_or_retries_is_refused_and_names_the_fix():
    with pytest.raises(ValueError, match="set sft.select_every"):
        SftConfig(restart_below=0.3, retries=[{"steps": 8}])
    with pytest.raises(ValueError, match=r"add a \[\[learner.sft.retries\]\] table"):
        SftConfig(restart_below=0.3, select_every=50)
    with pytest.raises(ValueError, match="repeats the first try"):
        SftConfig(restart_below=0.3, select_every=50, retries=[{}])


def test_without_a_score_the_run_keeps_its_last_weights(tiny):
    learner = Learner(tiny, LearnerConfig())
    family = load_family("arith", {"max_ops": 2})
    samples = demonstration_samples(family.demonstrations(4, seed=1),
                                    make_chat_format(learner.tokenizer))
    result = run_sft(learner, [(s.token_ids, s.loss_mask) for s in samples],
                     SftConfig(steps=4, batch_size=2, micro_batch_size=2, select_every=2))
    assert result.kept_step is None and result.scores == {}
