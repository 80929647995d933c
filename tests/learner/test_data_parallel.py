"""Data-parallel learner: two gloo workers on 127.0.0.1 produce the single-process gradient.

Contract (learner.distributed): for every aggregation mode (and with GAE, for the critic and
with advantages whitened over the whole batch), a learner step with W workers, each on its own
share of whole groups, leaves the same summed gradient, loss and counts as one process on the
same batch; a rank left with no group (every other group dropped for zero
variance) still takes part and adds nothing. The modes are read from the config's `Literal`,
so a new mode is covered without editing this file.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
import torch

from config.learner import Aggregation, LearnerConfig
from core.children import child_env, free_port
from engine.tiny import init_tiny
from learner.batch import TrainingSample
from learner.distributed import combine_metrics, shard_groups, split_rows
from learner.trainer import Learner

WORKER = Path(__file__).with_name("data_parallel_worker.py")
MODES = typing.get_args(Aggregation)
HANG_GUARD_S = 900


def _sample(rng, *, group, trajectory, reward, prompt, answer, sequence, masked=False):
    tokens = rng.integers(5, 90, prompt + answer)
    mask = np.r_[np.zeros(prompt, bool), np.ones(answer, bool)] & (not masked)
    logprobs = np.where(mask, -rng.uniform(0.5, 4.0, prompt + answer), 0.0)
    versions = np.where(mask, 0, -1)
    return TrainingSample(tokens, mask, logprobs, versions, reward, group, trajectory, sequence)


def _batch(seed: int = 0) -> list[TrainingSample]:
    """Five groups of uneven sizes and lengths (so shares and micro-batches are uneven), a
    trajectory split into two segments (rows), and a loss-masked member."""
    rng = np.random.default_rng(seed)
    samples, sequence, trajectory = [], 0, 0
    for group, size in enumerate([4, 3, 4, 2, 3]):
        for member in range(size):
            sequence += 1
            trajectory += 1
            segments = 2 if (group, member) == (1, 0) else 1
            for _ in range(segments):
                samples.append(_sample(
                    rng, group=group, trajectory=trajectory, reward=float((member + group) % 2),
                    prompt=int(rng.integers(3, 8)), answer=int(rng.integers(2, 12)),
                    sequence=sequence, masked=(group, member) == (2, 3)))
    return samples


def _one_group_varies(samples: list[TrainingSample]) -> list[TrainingSample]:
    """Every group but group 3 gets equal rewards: with drop_zero_variance_groups one group is
    left, so one of two ranks has nothing of its own to train on."""
    from dataclasses import replace
    return [s if s.group_id == 3 else replace(s, reward=1.0) for s in samples]


def _cases() -> list[dict]:
    samples = _batch()
    base = dict(optimizer=dict(lr=1e-3, max_grad_norm=None), batch_size=len(samples),
                micro_batch_size=3, workers=2, record_trainer_logprobs=False)
    cases = []
    for mode in MODES:
        loss = dict(aggregation=mode, norm_constant=16.0 if mode == "seq_sum_norm" else None)
        cases.append(dict(name=f"{mode}-ppo", samples=samples,
                          config={**base, "loss": {**loss, "kl_coef": 0.05}}))
        cases.append(dict(name=f"{mode}-mis", samples=samples, config={**base, "loss": {
            **loss, "correction": "mis", "correction_low": 0.6, "correction_high": 1.5,
            "masked_in_denominator": False}}))
    for mode in ("token_mean", "seq_mean_token_mean"):  # the critic's gradient too
        cases.append(dict(name=f"{mode}-gae", samples=samples, config={
            **base, "advantage": {"estimator": "gae", "lam": 0.9},
            "loss": {"aggregation": mode}}))
    cases.append(dict(name="mini-batches", samples=samples, config={
        **base, "mini_batch_size": 6, "epochs": 2}))
    cases.append(dict(name="one-group-left", samples=_one_group_varies(samples), config={
        **base, "advantage": {"drop_zero_variance_groups": True}}))
    return cases


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("dp") / "tiny"
    init_tiny(directory, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64)
    return directory


@pytest.fixture(scope="module")
def two_workers(tiny, tmp_path_factory) -> Path:
    """Every case run once by two gloo workers; their gradients and reports are in the dir."""
    out = tmp_path_factory.mktemp("dp-out")
    cases_path = out / "cases.pkl"
    cases_path.write_bytes(pickle.dumps(_cases()))
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-P", str(WORKER), str(tiny), str(cases_path),
                               str(out)], env=child_env({**env, "RANK": str(r)}),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    logs = [p.communicate(timeout=HANG_GUARD_S)[0].decode(errors="replace") for p in procs]
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"
    return out


def _single_process(tiny: Path, case: dict) -> tuple[dict[str, torch.Tensor], dict]:
    cfg = LearnerConfig.model_validate({**case["config"], "workers": 1})
    learner = Learner(tiny, cfg)
    report = learner.rl_step(case["samples"])
    gradients = {n: p.grad.clone() for n, p in learner.policy.named_parameters()
                 if p.grad is not None}
    if learner.critic is not None:
        gradients.update({f"critic.{n}": p.grad.clone()
                          for n, p in learner.critic.named_parameters() if p.grad is not None})
    return gradients, report.to_json()


def _gradient_cases() -> list[dict]:
    return [c for c in _cases() if c["name"] != "mini-batches"]


@pytest.mark.slow
@pytest.mark.parametrize("case", _gradient_cases(), ids=lambda c: c["name"])
def test_two_workers_give_the_single_process_gradient(tiny, two_workers, case):
    expected, expected_report = _single_process(tiny, case)
    assert any(g.abs().sum() > 0 for g in expected.values()), "the batch must move the policy"
    for rank in range(2):
        saved = torch.load(two_workers / f"{case['name']}-rank{rank}.pt")
        gradients = saved["gradients"]
        assert gradients.keys() == expected.keys()
        for name, grad in expected.items():
            torch.testing.assert_close(gradients[name], grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
    report = torch.load(two_workers / f"{case['name']}-rank0.pt")["report"]
    for key in ("num_samples", "num_tokens", "first_seq", "last_seq"):
        assert report[key] == expected_report[key], key
    assert report["loss"] == pytest.approx(expected_report["loss"], rel=1e-5, abs=1e-7)
    assert report["metrics"]["learner/samples"] == expected_report["metrics"]["learner/samples"]
    assert report["metrics"]["learner/tokens"] == expected_report["metrics"]["learner/tokens"]


def test_shards_are_whole_groups_that_cover_the_batch_once():
    samples = _batch()
    shares = [shard_groups(samples, rank, 3) for rank in range(3)]
    assert sorted(id(s) for share in shares for s in share) == sorted(id(s) for s in samples)
    owners = {}
    for rank, share in enumerate(shares):
        for s in share:
            assert owners.setdefault(s.group_id, rank) == rank, "a group was split"
    assert all(shares), "five groups over three ranks leave no rank empty"
    tokens = [sum(s.length for s in share) for share in shares]
    assert max(tokens) - min(tokens) <= max(
        sum(s.length for s in samples if s.group_id == g) for g in owners)


def test_split_rows_gives_every_part_a_row_when_it_can():
    assert split_rows(7, 3) == [slice(0, 3), slice(3, 5), slice(5, 7)]
    assert [s.stop - s.start for s in split_rows(3, 3)] == [1, 1, 1]


def test_combined_metrics_add_losses_and_counts_and_weight_means_by_tokens():
    ranks = [{"loss/policy": 0.25, "learner/loss_tokens": 30.0, "loss/clip_frac": 0.1,
              "lag/max": 1.0, "learner/grad_norm_max": 2.0},
             {"loss/policy": 0.5, "learner/loss_tokens": 10.0, "loss/clip_frac": 0.5,
              "lag/max": 3.0, "learner/grad_norm_max": 2.0}]
    out = combine_metrics(ranks, summed=("loss/policy",))
    assert out["loss/policy"] == 0.75 and out["learner/loss_tokens"] == 40.0
    assert out["loss/clip_frac"] == pytest.approx(0.2)
    assert out["lag/max"] == 3.0 and out["learner/grad_norm_max"] == 2.0


def test_a_launcher_world_size_that_differs_from_the_config_is_refused(monkeypatch):
    from learner.distributed import workers_from_env
    monkeypatch.setitem(os.environ, "WORLD_SIZE", "3")
    monkeypatch.setitem(os.environ, "RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE=3 but \\[learner\\] workers = 2"):
        workers_from_env(2)


@pytest.mark.slow
@pytest.mark.parametrize("name", [c["name"] for c in _cases()])
def test_the_ranks_end_every_step_with_the_same_weights(two_workers, name):
    ranks = [torch.load(two_workers / f"{name}-rank{rank}.pt") for rank in range(2)]
    for key, value in ranks[0]["parameters"].items():
        assert torch.equal(value, ranks[1]["parameters"][key]), key


@pytest.mark.slow
def test_mini_batches_run_the_single_process_number_of_optimizer_steps(tiny, two_workers):
    """With mini_batch_size, each rank splits its share into as many optimizer steps as one
    process takes (ceil(rows / mini_batch_size) per epoch), so the ranks stay in step."""
    case = next(c for c in _cases() if c["name"] == "mini-batches")
    _, expected_report = _single_process(tiny, case)
    report = torch.load(two_workers / "mini-batches-rank0.pt")["report"]
    steps = report["metrics"]["learner/optimizer_steps"]
    assert steps == expected_report["metrics"]["learner/optimizer_steps"] == 2 * 3
    assert report["num_samples"] == expected_report["num_samples"]


def test_ranks_sharing_one_log_file_write_whole_lines(tmp_path):
    """The ranks of a data-parallel learner inherit one log file; with unbuffered stdout (as
    many CI runners set it) every line must still reach it in one piece, or the JSON lines the
    job reads back run together."""
    script = ("import json, sys\nfrom learner.distributed import log_line\n"
              "for i in range(3000):\n"
              "    log_line(json.dumps({'event': 'learner worker ready', 'rank': sys.argv[1], "
              "'i': i}))\n")
    log = tmp_path / "learner.log"
    with open(log, "ab") as out:
        ranks = [subprocess.Popen([sys.executable, "-c", script, str(rank)], stdout=out,
                                  env=child_env({"PYTHONUNBUFFERED": "1"})) for rank in (0, 1)]
        assert [rank.wait(60) for rank in ranks] == [0, 0]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted((line["rank"], line["i"]) for line in lines) == sorted(
        (rank, i) for rank in ("0", "1") for i in range(3000))


@pytest.mark.slow
def test_leaving_the_group_refuses_while_a_ddp_wrapper_is_alive(tiny, tmp_path):
    """`leave_process_group` is the orderly end of a rank (learner.distributed): with a
    `Learner` not yet closed it raises before any collective, naming the fix; after `close()`
    it leaves, and the process exits 0 (a wrapper alive at exit can abort it, SIGABRT)."""
    script = (
        "import sys\nfrom config.learner import LearnerConfig\n"
        "from learner.distributed import init_process_group, leave_process_group, Workers\n"
        "from learner.trainer import Learner\n"
        "workers = Workers(rank=0, world_size=1)\n"
        "init_process_group(workers, 'cpu')\n"
        "learner = Learner(sys.argv[1], LearnerConfig(), workers=Workers(rank=0, world_size=2))\n"
        "try:\n    leave_process_group()\nexcept RuntimeError as exc:\n    print('refused:', exc)\n"
        "learner.close()\nleave_process_group()\nprint('left')\n")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, "-P", "-c", script, str(tiny)], env=child_env(env),
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "refused: leave_process_group: 1 DistributedDataParallel wrapper(s) still alive; " \
           "close every Learner" in done.stdout
    assert done.stdout.rstrip().endswith("left")
