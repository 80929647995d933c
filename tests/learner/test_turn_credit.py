"""Per-turn credit: the tools' per-turn rewards become token advantages of the turn that earned
them (learner.turn_credit), and a learner step trains on them."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from config.learner import LearnerConfig
from engine.tiny import init_tiny
from learner.advantages import trajectory_advantages
from learner.batch import TrainingSample
from learner.model import policy_outputs
from learner.tensors import collate
from learner.trainer import Learner
from learner.turn_credit import token_turn_advantages
from tasks.tools import ToolResult

# prompt (3 tokens), call 0 samples 2, a tool observation of 2, call 1 samples 2
TWO_TURNS = dict(token_ids=[5, 6, 7, 10, 11, 8, 9, 12, 13],
                 loss_mask=[0, 0, 0, 1, 1, 0, 0, 1, 1], call_spans=((3, 5), (7, 9)),
                 call_turns=(0, 1), model_call_ids=(1, 2))
ONE_TURN = dict(token_ids=[5, 6, 7, 10, 11], loss_mask=[0, 0, 0, 1, 1], call_spans=((3, 5),),
                call_turns=(0,), model_call_ids=(1,))


def _sample(trajectory_id: int, shape: dict, reward: float, turn_rewards=(), group=1,
            **extra) -> TrainingSample:
    n = len(shape["token_ids"])
    return TrainingSample(**{**shape, **extra}, sampler_logprobs=[-1.0] * n,
                          weights_versions=[0 if m else -1 for m in shape["loss_mask"]],
                          reward=reward, group_id=group, trajectory_id=trajectory_id,
                          turn_rewards=turn_rewards)


def _group() -> list[TrainingSample]:
    # A: a tool reward at turn 0 and the outcome 1 at turn 1; B: nothing; C: one turn, both
    return [_sample(1, TWO_TURNS, 1.0, (0.5, 0.0)), _sample(2, TWO_TURNS, 0.0, (0.0, 0.0)),
            _sample(3, ONE_TURN, 1.0, (0.5,))]


def test_each_turns_tokens_get_its_leave_one_out_reward_to_go():
    # rewards to go G: A [1.5, 1], B [0, 0], C [1.5, -] (C ended: 0 at turn 1)
    out = token_turn_advantages(_group(), 9, "turn_leave_one_out")
    a, b, c = out.tolist()
    assert a == pytest.approx([0, 0, 0, 0.75, 0.75, 0, 0, 1.0, 1.0])  # 1.5 - (0+1.5)/2; 1 - 0
    assert b == pytest.approx([0, 0, 0, -1.5, -1.5, 0, 0, -0.5, -0.5])  # 0 - 1.5; 0 - (1+0)/2
    assert c == pytest.approx([0, 0, 0, 0.75, 0.75, 0, 0, 0, 0])  # 1.5 - (1.5+0)/2


def test_a_trajectory_on_two_rows_is_one_member():
    first = dict(token_ids=TWO_TURNS["token_ids"][:5], loss_mask=TWO_TURNS["loss_mask"][:5],
                 call_spans=((3, 5),), call_turns=(0,), model_call_ids=(1,))
    second = dict(token_ids=[5, 8, 9, 12, 13], loss_mask=[0, 0, 0, 1, 1],
                  call_spans=((3, 5),), call_turns=(1,), model_call_ids=(2,))
    group = _group()
    split = [_sample(1, first, 1.0, (0.5, 0.0)), _sample(1, second, 1.0, (0.5, 0.0))]
    out = token_turn_advantages(split + group[1:], 9, "turn_leave_one_out")
    assert out[0, 3:5].tolist() == pytest.approx([0.75, 0.75])
    assert out[1, 3:5].tolist() == pytest.approx([1.0, 1.0])
    assert out[2, 3].item() == pytest.approx(-1.5) and out[3, 3].item() == pytest.approx(0.75)


def test_without_tool_rewards_one_turn_trajectories_get_rloo():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    samples = [_sample(i, ONE_TURN, r, group=i // 3) for i, r in enumerate(rewards)]
    out = token_turn_advantages(samples, 5, "turn_leave_one_out")
    rloo = trajectory_advantages(torch.tensor(rewards), [s.group_id for s in samples],
                                 [s.member for s in samples], "rloo")
    assert torch.allclose(out[:, 3], rloo.float()) and torch.allclose(out[:, 4], rloo.float())
    assert out[:, :3].abs().sum() == 0


def test_turn_index_normalisation_is_offered_for_comparison():
    out = token_turn_advantages(_group(), 9, "turn_index_normalised")
    assert out.abs().sum() > 0 and not torch.allclose(
        out, token_turn_advantages(_group(), 9, "turn_leave_one_out"))


def test_bad_turn_data_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="call_turns"):
        _sample(1, {**TWO_TURNS, "call_turns": (0,)}, 1.0)
    with pytest.raises(ValueError, match="turn_rewards"):
        _sample(1, TWO_TURNS, 1.0, (math.nan, 0.0))
    with pytest.raises(ValueError, match="ToolResult.reward"):
        ToolResult(text="x", reward=float("inf"))
    with pytest.raises(ValueError, match="ToolResult.reward"):
        ToolResult(text="x", reward="1")  # type: ignore[arg-type]
    sample = _sample(1, TWO_TURNS, 1.0, (0.5, 0.0))
    again = TrainingSample.from_json(sample.to_json())
    assert again.call_turns == (0, 1) and again.turn_rewards == (0.5, 0.0)


def test_config_refuses_the_min_variance_baseline_with_a_turn_estimator():
    with pytest.raises(ValueError, match="min_variance"):
        LearnerConfig.model_validate({"advantage": {"estimator": "turn_leave_one_out",
                                                    "baseline": "min_variance"}})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("turns") / "tiny"
    init_tiny(directory, hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    return directory


def test_a_learner_step_raises_the_turn_that_earned_a_reward(tiny):
    """Two members with the same outcome; one's first turn earned a tool reward. Per-turn
    credit raises that turn's tokens and lowers the other member's first turn, and leaves the
    second turns (equal rewards to go) alone; outcome-only RLOO would not move anything."""
    learner = Learner(tiny, LearnerConfig.model_validate(dict(
        optimizer=dict(lr=3e-3, max_grad_norm=None), micro_batch_size=4, batch_size=2,
        advantage=dict(estimator="turn_leave_one_out"),
        loss=dict(surrogate="reinforce", aggregation="seq_mean_token_mean"))))
    samples = [_sample(1, TWO_TURNS, 1.0, (1.0, 0.0)), _sample(2, TWO_TURNS, 1.0, (0.0, 0.0),
                                                              token_ids=[5, 6, 7, 14, 15, 8, 9,
                                                                         12, 13])]
    batch = collate(samples, learner.pad_id)

    def turn_logprobs() -> np.ndarray:
        with torch.no_grad():
            lp = policy_outputs(learner.policy, batch.input_ids_B_T,
                                batch.attention_mask_B_T).logprobs_B_Tm1
        return np.stack([lp[:, 2:4].mean(-1).numpy(), lp[:, 6:8].mean(-1).numpy()], 1)

    turns = token_turn_advantages(samples, batch.input_ids_B_T.shape[1],
                                  "turn_leave_one_out")[:, 1:]
    step = learner._step_tensors(batch, torch.tensor([1.0, 1.0]), (), None, turns)
    assert step.advantages[:, 2:4].tolist() == [[1.0, 1.0], [-1.0, -1.0]]  # the tool's turn
    assert step.advantages[:, 6:8].abs().sum() == 0  # the answer's turn: the same outcome
    before = turn_logprobs()
    report = learner.rl_step(samples)
    change = turn_logprobs() - before
    assert change[0, 0] > 0 > change[1, 0], change
    assert report.metrics["advantage/abs_mean"] > 0
