"""The learning-per-compute simulation: lag, throughput and accounting of each pipeline mode."""

from __future__ import annotations

import pytest
from labtest_support import lab_config, one_thread  # noqa: F401 (fixture)

from lab.config import ModeSection
from lab.durations import DurationModel
from lab.estimator_spec import PRESETS
from lab.learning import run_learning
from lab.pipeline import PipelineSimulation
from lab.world import build_world

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = lab_config(policy={"vocab_size": 6, "num_prompts": 3},
                 learning={"horizon": 8, "batch_size": 16, "group_size": 4, "slots": 16,
                           "train_time": 4.0, "lr": 0.1})
WORLD = build_world(CFG.policy, CFG.reward, CFG.learning.horizon)
DURATIONS = DurationModel(tail_index=1.5, difficulty_coupling=1.0)


def _run(mode: ModeSection, estimator: str = "token_tis", updates: int = 25, seed: int = 0):
    sim = PipelineSimulation(WORLD, estimator, PRESETS[estimator], mode, CFG.learning,
                             DURATIONS, seed)
    result = sim.run(updates)
    return sim, result


def _accounted(sim, result) -> int:
    in_flight = int(sim.slots.active.sum())
    waiting = sum(len(g.members) for g in sim.groups.values())
    return result.admitted + result.dropped_stale + in_flight + waiting


def test_sync_trains_on_fresh_data_and_idles_generation():
    sim, result = _run(ModeSection(name="sync"))
    assert result.updates == list(range(26)) and len(result.returns) == 26
    assert set(result.lags) == {0} and result.dropped_stale == 0
    assert result.admitted == 25 * CFG.learning.batch_size
    utilisation = result.busy_slot_time / (CFG.learning.slots * result.sim_time)
    assert utilisation < 0.6, "sync waits for the slowest trajectory and for the learner"
    assert result.generated == _accounted(sim, result)
    assert result.returns[-1] > result.returns[0] + 0.05


def test_async_bounds_lag_drops_stale_groups_and_beats_sync_throughput():
    sync = _run(ModeSection(name="sync"))[1]
    sim, result = _run(ModeSection(name="async", max_lag=1))
    assert max(result.lags) <= 1 and any(lag == 1 for lag in result.lags)
    assert result.generated == _accounted(sim, result)
    assert result.summary()["throughput"] > 2 * sync.summary()["throughput"]
    assert result.sim_time < sync.sim_time
    assert result.spanning == 0, "async samples each trajectory with one version"
    loose = _run(ModeSection(name="async", max_lag=8))[1]
    assert loose.dropped_stale < result.dropped_stale


def test_inflight_trajectories_span_versions():
    sim, result = _run(ModeSection(name="inflight", max_lag=2))
    assert result.summary()["spanning_frac"] > 0.05
    assert max(result.lags) <= 2
    assert result.generated == _accounted(sim, result)
    retained = _run(ModeSection(name="inflight", max_lag=2, kv_residual=0.5))[1]
    assert retained.returns != result.returns


def test_runs_are_deterministic_per_seed():
    a = _run(ModeSection(name="async", max_lag=2), "cispo_score_centering", updates=10, seed=3)[1]
    b = _run(ModeSection(name="async", max_lag=2), "cispo_score_centering", updates=10, seed=3)[1]
    c = _run(ModeSection(name="async", max_lag=2), "cispo_score_centering", updates=10, seed=4)[1]
    assert a.returns == b.returns and a.times == b.times
    assert a.returns != c.returns


def test_run_learning_summarises_time_to_target():
    cfg = lab_config(policy={"vocab_size": 6, "num_prompts": 3},
                     learning={"horizon": 8, "batch_size": 16, "group_size": 4, "slots": 16,
                               "updates": 15, "seeds": 2, "lr": 0.1,
                               "presets": ["no_correction", "trajectory_is"],
                               "modes": [{"name": "sync"}, {"name": "async", "max_lag": 2}]})
    report = run_learning(cfg)
    assert len(report.runs) == 2 * 2 * 2 and len(report.setups) == 4
    assert report.initial_return < report.target
    reached = [s for s in report.setups if s["time_to_target"] is not None]
    assert reached and all(s["reached"] == 2 for s in reached)
    times = [s["time_to_target"] for s in reached]
    assert times == sorted(times)
    for s in reached:
        run = next(r for r in report.runs if r.mode == s["mode"] and r.estimator == s["estimator"])
        assert any(j >= report.target for j in run.returns)
