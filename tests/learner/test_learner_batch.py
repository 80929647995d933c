"""Training samples, sources, padding and the metrics sinks."""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from learner.batch import (
    InMemorySource,
    JsonlSource,
    TrainingSample,
    demonstration,
    samples_from_calls,
    take_batch,
    write_jsonl,
)
from learner.metrics import ConsoleSink, JsonlSink, StepReport, available_sinks, make_sinks
from learner.tensors import collate


@dataclass(frozen=True)
class _Call:  # a stored model call as the one path reads it
    id: int
    segment: int
    prompt_token_ids: np.ndarray
    tokens: object
    turn: int = 0


def _sample(n: int = 6, seq: int = 0, group: str = "g", topk: int = 0, reward: float = 1.0):
    mask = np.r_[np.zeros(2, bool), np.ones(n - 2, bool)]
    kw = {}
    if topk:
        kw = dict(
            sampler_topk_ids=np.arange(n * topk).reshape(n, topk) % 50,
            sampler_topk_logprobs=np.full((n, topk), -1.0, np.float32),
        )
        kw["sampler_topk_logprobs"][0, -1] = -np.inf
    return TrainingSample(
        token_ids=np.arange(n) + 5,
        loss_mask=mask,
        sampler_logprobs=np.where(mask, -0.5, 0.0),
        weights_versions=np.where(mask, 3, -1),
        reward=reward,
        group_id=group,
        trajectory_id=seq,
        sequence=seq,
        **kw,
    )


def test_sample_validation_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match="loss_mask has shape"):
        TrainingSample([1, 2, 3], [0, 1], [0, 0, 0], [0, 0, 0], 1.0, "g", 1)
    with pytest.raises(ValueError, match="first token has no prefix"):
        TrainingSample([1, 2], [1, 1], [0, 0], [0, 0], 1.0, "g", 1)
    with pytest.raises(ValueError, match="finite on every loss token"):
        TrainingSample([1, 2], [0, 1], [0, float("nan")], [0, 0], 1.0, "g", 1)
    with pytest.raises(ValueError, match="given together"):
        TrainingSample([1, 2], [0, 1], [0, 0], [0, 0], 1.0, "g", 1, sampler_topk_ids=[[1], [2]])
    with pytest.raises(ValueError, match="trajectory_id 'demo-1' is not an int"):
        TrainingSample([1, 2], [0, 1], [0, 0], [0, 0], 1.0, "g", "demo-1")
    with pytest.raises(ValueError, match="kind 'demo' is not one of rollout, demonstration"):
        TrainingSample([1, 2], [0, 1], [0, 0], [0, 0], 1.0, "g", 1, kind="demo")


def test_samples_are_frozen():
    s = _sample()
    with pytest.raises(ValueError):
        s.token_ids[0] = 9
    with pytest.raises(AttributeError):
        s.reward = 2.0  # type: ignore[misc]


def test_jsonl_round_trip_keeps_everything_including_padded_topk(tmp_path):
    samples = [_sample(seq=i + 1, topk=3) for i in range(3)]
    path = write_jsonl(samples, tmp_path / "s.jsonl")
    loaded = JsonlSource(path).read(0, 10)
    for a, b in zip(samples, loaded):
        for name in (
            "token_ids",
            "loss_mask",
            "sampler_logprobs",
            "weights_versions",
            "sampler_topk_ids",
            "sampler_topk_logprobs",
        ):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert (a.reward, a.group_id, a.sequence) == (b.reward, b.group_id, b.sequence)
    assert math.isinf(loaded[0].sampler_topk_logprobs[0, -1])


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps(_sample(seq=1).to_json()) + "\n" + json.dumps({"token_ids": [1]}) + "\n"
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2: sample is missing loss_mask"):
        JsonlSource(path)


def test_in_memory_source_reads_after_a_sequence_and_knows_when_it_is_finished():
    source = InMemorySource([_sample(), _sample(), _sample()])
    assert [s.sequence for s in source.read(0, 2)] == [1, 2]
    assert [s.sequence for s in source.read(2, 5)] == [3]
    assert not source.finished(2) and source.finished(3)
    with pytest.raises(ValueError, match="strictly increasing"):
        InMemorySource([_sample(seq=2), _sample(seq=1)])


def test_take_batch_extends_to_finish_the_last_group():
    groups = ["a", "a", "b", "b", "b", "c"]
    source = InMemorySource([_sample(seq=i + 1, group=g) for i, g in enumerate(groups)])
    assert [s.group_id for s in take_batch(source, 0, 3)] == ["a", "a", "b", "b", "b"]
    assert [s.sequence for s in take_batch(source, 5, 3)] == [6]
    assert [s.sequence for s in take_batch(source, 0, 2)] == [1, 2]


def test_collate_pads_right_and_shifts_per_token_data():
    batch = collate([_sample(6, topk=2), _sample(4, topk=2)], pad_id=0, need_topk=True)
    assert batch.input_ids_B_T.shape == (2, 6) and batch.loss_mask_B_Tm1.shape == (2, 5)
    assert batch.attention_mask_B_T[1].tolist() == [1, 1, 1, 1, 0, 0]
    # shifted: entry j is token j + 1, so the first loss token (position 2) is entry 1
    assert batch.loss_mask_B_Tm1[0].tolist() == [False, True, True, True, True]
    assert batch.loss_mask_B_Tm1[1].tolist() == [False, True, True, False, False]
    assert torch.all(batch.sampler_logprobs_B_Tm1[batch.loss_mask_B_Tm1] == -0.5)
    assert batch.topk_ids_B_Tm1_K.shape == (2, 5, 2) and torch.isinf(batch.topk_logprobs_B_Tm1_K[1, -1]).all()
    sub = batch.rows(1, 2)
    assert sub.input_ids_B_T.shape == (1, 4) and sub.loss_mask_B_Tm1.shape == (1, 3)


def test_demonstration_is_a_sample_with_its_own_group():
    s = demonstration([1, 2, 3], [0, 1, 1], index=4)
    assert s.group_id == "demo-4" and s.num_loss_tokens == 2
    assert s.member == ("demonstration", 4)  # not a rollout with id 4


def test_console_and_jsonl_sinks(tmp_path):
    report = StepReport(
        step=3,
        mode="rl",
        num_samples=8,
        num_tokens=100,
        loss=0.25,
        policy_version=2,
        metrics={"loss/clip_frac_high": 0.125, "reward/mean": 0.5},
        published_version=3,
    )
    out = io.StringIO()
    ConsoleSink(out).write(report)
    line = out.getvalue()
    assert "step 3" in line and "loss/clip_frac_high=0.125" in line and "published v3" in line
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.write(report)
    sink.close()
    assert json.loads((tmp_path / "m.jsonl").read_text())["metrics"]["reward/mean"] == 0.5


def test_missing_sink_packages_are_a_clear_error(tmp_path):
    assert {"console", "jsonl"} <= set(available_sinks())
    for name in ("tensorboard", "wandb"):
        if name not in available_sinks():
            with pytest.raises(ValueError, match=f"pip install {name}"):
                make_sinks([name], tmp_path)
    with pytest.raises(ValueError, match="unknown metrics sink"):
        make_sinks(["stdout"], tmp_path)


def test_samples_from_calls_lay_out_context_and_model_calls():
    from core.records import SampledTokens

    call = SampledTokens(
        token_ids=[7, 8],
        sampler_logprobs=[-0.1, -0.2],
        weights_versions=[4, 5],
        kv_versions=[4, 4],
        time_offsets=[0.0, 0.1],
        topk_ids=[[7, 1], [8, 2]],
        topk_logprobs=[[-0.1, -3.0], [-0.2, -2.5]],
    )
    calls = [_Call(21, 0, np.array([1, 2, 3]), call, 0), _Call(22, 0, np.array([9]), call, 2)]
    (sample,) = samples_from_calls(
        calls, reward=1.0, group_id=3, trajectory_id=11, sequence=5, turn_rewards={0: 0.5}
    )
    assert sample.call_turns == (0, 2) and sample.turn_rewards == (0.5, 0.0, 0.0)
    assert sample.token_ids.tolist() == [1, 2, 3, 7, 8, 9, 7, 8]
    assert sample.loss_mask.astype(int).tolist() == [0, 0, 0, 1, 1, 0, 1, 1]
    assert sample.weights_versions.tolist() == [-1, -1, -1, 4, 5, -1, 4, 5]
    np.testing.assert_allclose(sample.sampler_logprobs[3:5], [-0.1, -0.2])
    assert sample.topk == 2 and np.isinf(sample.sampler_topk_logprobs[5]).all()
    assert sample.model_call_ids == (21, 22) and sample.call_spans == ((3, 5), (6, 8))
    (masked,) = samples_from_calls(
        calls[:1], reward=0.0, group_id=3, trajectory_id=12, trainable=False
    )
    assert masked.num_loss_tokens == 0 and masked.turn_rewards == ()
