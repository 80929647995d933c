"""`stalewise run` with `[learner] workers = 2`: the learner child starts a second rank (gloo on
127.0.0.1), and the store records learner steps, policy versions and trainer log-probs exactly
as with one worker: steps 1..N over contiguous sequence numbers, one version per step published
by rank 0, and the trainer's log-probs of every trained trajectory (both ranks' shares). A rank
killed mid-job takes the learner down; the job restarts it and every rank resumes from the
last published version."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from sqlalchemy import func, select

from core.store import schema as s
from core.store.store import Store
from tests.orchestrator.test_job_faults import (
    _argv,
    check_exactly_once,
    children_of,
    children_running,
    learner_steps,
    start,
    wait_for,
    write_config,
)

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from engine.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("model") / "tiny")


def test_two_learner_workers_record_steps_and_versions_and_restart_after_a_killed_rank(
        tmp_path, model_dir):
    """SIGKILL of rank 1: rank 0 exits, the job restarts the learner, and both ranks resume from
    the last published version; every step and sequence number is still consumed once, and the
    store holds what one worker would have written (one job, for the suite's time). The job also
    sets `[learner] threads = 1`, which the learner must apply."""
    # Steps enough that the kill after the second always leaves work for a restarted learner:
    # with 4, the learner once finished steps 3 and 4 from queued batches before the kill.
    steps = 8
    config = write_config(tmp_path, model_dir, steps=steps)
    text = config.read_text().replace("[sandbox]\n", '[sandbox]\nbackend = "local"\n')
    config.write_text(text.replace("[learner]\n", "[learner]\nworkers = 2\nthreads = 1\n"))
    proc = start(config)
    try:
        wait_for(lambda: learner_steps(tmp_path) >= 2, 400, "two learner steps", proc)
        rank0 = children_running(proc.pid, "learner")[0]
        rank1 = [p for p in children_of(rank0) if "serve" in _argv(p)]
        assert len(rank1) == 1, "rank 0 starts exactly one peer"
        os.kill(rank1[0], signal.SIGKILL)
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert "learner exited; restarting" in output
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    run_id = store.runs()[0].id
    check_exactly_once(store, run_id, steps=steps)
    log = (tmp_path / "runs" / run_id / "learner.log").read_text()
    started = [json.loads(line) for line in log.splitlines() if '"learner started"' in line]
    assert len(started) == 2 and started[1]["version"] >= 2
    ready = [json.loads(line) for line in log.splitlines() if '"learner worker ready"' in line]
    resumed = [r for r in ready if r["version"] == started[1]["version"]]
    assert sorted(r["rank"] for r in resumed) == [0, 1], "both ranks resumed from the version"
    assert resumed[0]["optimizer_state"] == resumed[1]["optimizer_state"] > 0, \
        "both ranks restored the published optimizer state"
    assert f"learner worker {rank1[0]} exited with code -9" in log
    assert started[0]["workers"] == 2
    assert started[0]["threads"] == 1, "[learner] threads sets the learner's torch threads"
    run = store.runs()[0]
    assert run.status == "finished" and run.summary["learner_steps"] == steps
    reports = store.learner_steps(run_id)
    with store.engine.connect() as c:
        versions = list(c.execute(select(s.PolicyVersion.version, s.PolicyVersion.learner_step,
                                         s.PolicyVersion.last_seq)
                                  .where(s.PolicyVersion.run_id == run_id)
                                  .order_by(s.PolicyVersion.version)))
        consumed = list(c.execute(select(s.StreamEntry.trajectory_id)
                                  .where(s.StreamEntry.run_id == run_id,
                                         s.StreamEntry.seq <= reports[-1].last_seq,
                                         s.StreamEntry.loss_masked.is_(False))))
        with_logprobs = c.execute(
            select(func.count(func.distinct(s.ModelCall.trajectory_id)))
            .join(s.TrainerLogprobs, s.TrainerLogprobs.model_call_id == s.ModelCall.id)
            .where(s.TrainerLogprobs.run_id == run_id)).scalar_one()
    assert [(v.version, v.learner_step) for v in versions] == [(i, i) for i in
                                                                range(1, steps + 1)]
    assert [v.last_seq for v in versions] == [r.last_seq for r in reports]
    assert all(r.num_samples == r.last_seq - r.first_seq + 1 for r in reports), \
        "a step's report counts both ranks' samples"
    assert with_logprobs == len(consumed), "trainer log-probs of one rank's share only"
    store.close()
