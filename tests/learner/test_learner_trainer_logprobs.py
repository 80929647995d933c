"""The learner stores its own log-prob of every trained token, per model call.

Contract (learner/trainer_logprobs.py):
- after an RL step on store-sourced samples, every trained trajectory's model calls have one
  `trainer_logprobs` row: as many values as the call's sampled tokens, equal to the policy's
  log-probs under the weights the step trained from (computed here independently, one sample
  at a time), NaN where the sample's loss mask is 0;
- multi-call and multi-segment trajectories split back to the right calls;
- `trainer_logprobs_every = 2` records steps 1, 3, ... only;
- log-probs that do not cover a sample raise instead of being stored short.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from config.learner import LearnerConfig
from core.records import FLOAT32, SampledTokens, unpack
from core.store.store import Store, model_call_row
from learner.model import policy_outputs
from learner.store_source import StoreSource
from learner.trainer import Learner
from learner.trainer_logprobs import TrainerLogprobRecorder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("model") / "tiny")


def _call(trajectory: int, turn: int, segment: int, prompt: list[int], sampled: list[int]
          ) -> dict:
    n = len(sampled)
    tokens = SampledTokens(sampled, np.full(n, -1.0), np.zeros(n), np.zeros(n), np.zeros(n))
    return model_call_row(trajectory_id=trajectory, turn=turn, segment=segment, context_len=0,
                          prompt_token_ids=prompt, tokens=tokens, sampling={}, engine_id="e",
                          finish_reason="stop", cached_prompt_tokens=0, started_at=0.0,
                          finished_at=1.0)


def _stored_run(url: str, rounds: int = 1) -> Store:
    """Groups of two trajectories (rewards 0 and 1), one with two turns, one with two
    segments; `rounds` batches of them, admitted in order."""
    store = Store.open(url, create=True)
    store.create_run("r", name="r", config={}, pipeline_mode="async")
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(10, 60, n).tolist()  # noqa: E731
    for _ in range(rounds):
        for group_index in range(2):
            task = store.task_instance_id("r", family="f", key=f"k{rng.integers(1e9)}",
                                          content_hash="h")
            group = store.create_group("r", task, size=2, dispatch_version=0)
            for reward in (0.0, 1.0):
                t = store.create_trajectory("r", group_id=group, task_instance_id=task)
                if reward == 0.0:
                    calls = [_call(t, 0, 0, ids(5), ids(4)),
                             _call(t, 1, 0, ids(3), ids(6))]
                else:
                    calls = [_call(t, 0, 0, ids(4), ids(5)), _call(t, 1, 1, ids(7), ids(3))]
                store.insert_model_calls(calls)
                store.admit("r", t, reason="fresh", learner_version=0, reward=reward,
                            group_id=group, lag=0)
    return store


def _stored(store: Store) -> dict[int, tuple[int, int, np.ndarray]]:
    from sqlalchemy import select

    from core.store import schema as s

    table = s.TrainerLogprobs.__table__
    with store.engine.connect() as c:
        return {r.model_call_id: (r.learner_step, r.policy_version, unpack(r.logprobs, FLOAT32))
                for r in c.execute(select(table))}


def test_every_trained_token_gets_the_learners_logprob(model_dir, tmp_path):
    store = _stored_run(f"sqlite:///{tmp_path / 's.db'}")
    learner = Learner(model_dir, LearnerConfig(batch_size=6, micro_batch_size=3))
    recorder = TrainerLogprobRecorder(store, "r")
    learner.sinks.append(recorder)
    learner.logprob_observers.append(recorder.observe)
    samples = StoreSource(store, "r", learner.pad_id).read(0, 100)
    expected: dict[int, list[np.ndarray]] = {}
    with torch.no_grad():  # the weights the step trains from, one sample at a time
        learner.policy.eval()
        for sample in samples:
            ids = torch.tensor(sample.token_ids)[None]
            lp = policy_outputs(learner.policy, ids, torch.ones_like(ids)).logprobs_B_Tm1[0]
            positions = np.flatnonzero(sample.loss_mask)
            expected.setdefault(sample.trajectory_id, []).append(lp.numpy()[positions - 1])
        learner.policy.train()
    masked = np.flatnonzero(samples[0].loss_mask)[1]  # one sampled token the step does not train
    samples[0] = replace(samples[0], loss_mask=samples[0].loss_mask
                         & (np.arange(samples[0].length) != masked))
    expected[samples[0].trajectory_id][0][1] = np.nan
    learner.rl_step(samples)
    rows = _stored(store)
    calls = {t: store.model_calls(t) for t in expected}
    assert len(rows) == sum(len(c) for c in calls.values()) == 8
    for trajectory, stored in calls.items():
        values, start = np.concatenate(expected[trajectory]), 0
        for call in stored:
            n = len(call.tokens)
            step, version, got = rows[call.id]
            assert (step, version, len(got)) == (1, 0, n)
            np.testing.assert_allclose(got, values[start:start + n], rtol=1e-4, atol=1e-5)
            start += n
    assert any(np.isnan(v).any() for _, _, v in rows.values())  # the masked token
    store.close()


def test_every_n_records_one_step_in_n(model_dir, tmp_path):
    store = _stored_run(f"sqlite:///{tmp_path / 's.db'}", rounds=3)
    learner = Learner(model_dir, LearnerConfig(batch_size=4, micro_batch_size=4))
    recorder = TrainerLogprobRecorder(store, "r", every=2)
    learner.sinks.append(recorder)
    learner.logprob_observers.append(recorder.observe)
    source = StoreSource(store, "r", learner.pad_id)
    for _ in range(3):
        learner.rl_step(source.read(learner.last_sequence, 4))
    assert sorted({step for step, _, _ in _stored(store).values()}) == [1, 3]
    store.close()


def test_logprobs_that_do_not_cover_a_sample_raise(tmp_path):
    store = _stored_run(f"sqlite:///{tmp_path / 's.db'}")
    recorder = TrainerLogprobRecorder(store, "r")
    samples = StoreSource(store, "r").read(0, 100)
    with pytest.raises(ValueError, match="tokens but the learner's log-probs cover 4"):
        recorder.observe(1, 0, samples, torch.zeros(len(samples), 3))
    store.close()
