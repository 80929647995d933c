"""`stalewise run` end to end, and its fault tolerance, with real processes, Docker and SQLite.

- short async jobs finish, two at once on one new store, SQLite and PostgreSQL: learner steps
  done, report written, no containers left;
- a user's task family in one Python file runs when the config names its path;
- SIGKILL of the orchestrator mid-run, then `--resume`: every trajectory stored once, none
  admitted twice, the learner's consumed sequence numbers contiguous, no orphans;
- SIGKILL of the learner: it is restarted from its last checkpoint and the run finishes;
- the engine killed mid-run: the run fails with a clear message and leaves nothing behind;
- SIGTERM during the SFT warm start: the run is aborted at once and the SFT child stops;
- Docker unreachable: the run fails at once (before any SFT), saying why, with no traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import docker
import pytest
from sqlalchemy import select

from core.store import schema as s
from core.store.store import Store
from sandboxes.labels import RUN_ID

pytestmark = [pytest.mark.docker, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from engine.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("model") / "tiny")


def write_config(tmp_path: Path, model: Path, *, steps: int, mode: str = "async",
                 family: str = "arith", options: str = "{ max_ops = 1 }",
                 db_url: str | None = None) -> Path:
    config = tmp_path / "job.toml"
    config.write_text(f"""
[run]
name = "fault"
db_url = "{db_url or f'sqlite:///{tmp_path}/store.db'}"
output_dir = "{tmp_path}/runs"
progress_every_s = 2.0

[model]
path = "{model}"
create_tiny = false
chat_format = "hermes"
tool_listing = "none"

[tasks]
family = "{family}"
options = {options}
eval_instances = 0

[rollout]
group_size = 2
max_concurrent = 4
max_tokens_per_turn = 24

[sandbox]
pool_size = 2
max_live = 8

[learner]
batch_size = 4
micro_batch_size = 4

[pipeline]
mode = "{mode}"
steps = {steps}
""")
    return config


def start(config: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stalewise", "run", str(config), *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})


def wait_for(predicate, timeout: float, what: str,
             job: subprocess.Popen | None = None) -> None:
    """Poll `predicate` until it holds. With `job` (a `stalewise run` that must still be
    running meanwhile), a job that exits first fails the wait at once with its output, where
    polling on would only time out without saying why."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if job is not None and job.poll() is not None:
            output = job.communicate()[0] or ""
            raise AssertionError(f"the job exited (code {job.returncode}) before {what}:\n"
                                 f"{output[-4000:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def open_store(tmp_path: Path) -> Store | None:
    try:
        return Store.open(f"sqlite:///{tmp_path}/store.db")
    except Exception:  # not created yet
        return None


def learner_steps(tmp_path: Path) -> int:
    store = open_store(tmp_path)
    if store is None:
        return 0
    try:
        runs = store.runs()
        return len(store.learner_steps(runs[0].id)) if runs else 0
    finally:
        store.close()


def running(tmp_path: Path) -> bool:
    store = open_store(tmp_path)
    try:
        with store.engine.connect() as c:
            return c.execute(select(s.Trajectory.id).where(s.Trajectory.status == "running")
                             .limit(1)).first() is not None
    finally:
        store.close()


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def children_running(pid: int, word: str) -> list[int]:
    """Children of `pid` with `word` (engine, learner, sft) as one of their arguments: a whole
    argument, since paths in a command line (a test's tmp dir) can contain the word too."""
    return [p for p in children_of(pid) if word in _argv(p)]


def _argv(pid: int) -> list[str]:
    """The process's arguments; none for one that exited since it was listed (a short-lived
    child, such as a Docker or pgrep call, can go between `pgrep` and this read)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (FileNotFoundError, ProcessLookupError):
        return []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() else "X"
    return state != "Z"


def containers_of(run_id: str, *, running_only: bool = False) -> list[dict]:
    """The run's containers as Docker lists them (one call: a container removed meanwhile is
    simply absent, where list-then-inspect would raise NotFound)."""
    client = docker.from_env()
    try:
        return client.api.containers(all=not running_only,
                                     filters={"label": f"{RUN_ID}={run_id}"})
    finally:
        client.close()


def check_exactly_once(store: Store, run_id: str, steps: int) -> None:
    with store.engine.connect() as c:
        stream = list(c.execute(select(s.StreamEntry.seq, s.StreamEntry.trajectory_id)
                                .where(s.StreamEntry.run_id == run_id)
                                .order_by(s.StreamEntry.seq)))
        trajectories = list(c.execute(select(s.Trajectory.id, s.Trajectory.status)
                                      .where(s.Trajectory.run_id == run_id)))
    assert [e.seq for e in stream] == list(range(1, len(stream) + 1))
    assert len({e.trajectory_id for e in stream}) == len(stream), "a trajectory admitted twice"
    assert len({t.id for t in trajectories}) == len(trajectories)
    assert not [t for t in trajectories if t.status in ("queued", "running")]
    learner = store.learner_steps(run_id)
    assert [r.step for r in learner] == list(range(1, steps + 1))
    assert learner[0].first_seq == 1
    for before, after in zip(learner, learner[1:]):
        assert after.first_seq == before.last_seq + 1, "gap or repeat in consumed sequences"


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_two_jobs_at_once_on_one_store(tmp_path, model_dir, backend, request):
    """Two short jobs started together on one new store, as two experiments in one checkout
    share the default store (SQLite), or a team's PostgreSQL database: both create it at once
    (its migrations take turns), both finish with their own run, stream, learner steps and
    report, and leave no container. Each summary names the model it started from, and (with
    selection weights on) the weighted skew and the work beyond the weights."""
    db_url = (f"sqlite:///{tmp_path}/shared.db" if backend == "sqlite"
              else request.getfixturevalue("pg_url"))
    jobs = {}
    for name in ("job-a", "job-b"):
        folder = tmp_path / name
        folder.mkdir()
        config = write_config(folder, model_dir, steps=2, db_url=db_url)
        config.write_text(config.read_text().replace('name = "fault"', f'name = "{name}"')
                          + '\n[admission]\nreweight = "propensity"\n')
        jobs[name] = start(config)
    outputs = {name: job.communicate(timeout=420)[0] for name, job in jobs.items()}
    for name, job in jobs.items():
        assert job.returncode == 0, f"{name}:\n{outputs[name]}"
    store = Store.open(db_url)
    runs = {run.name: run for run in store.runs()}
    assert sorted(runs) == ["job-a", "job-b"]
    for name, run in runs.items():
        assert run.status == "finished" and run.summary["learner_steps"] == 2
        assert run.summary["start_model"] == {"path": str(model_dir), "tiny_seed": 0}
        skew = run.summary["selection_skew"]
        assert 0.0 <= skew["beyond_weights_share"] <= 1.0
        assert f"generated work beyond the weights {skew['beyond_weights_share']:.3f}" in \
            outputs[name]
        check_exactly_once(store, run.id, steps=2)
        report = json.loads((tmp_path / name / "runs" / run.id / "report.json").read_text())
        assert [row["step"] for row in report["learning_curve"]] == [1, 2]
        assert "## learning curve" in (tmp_path / name / "runs" / run.id / "report.md").read_text()
        wait_for(lambda run_id=run.id: not containers_of(run_id), 60,
                 f"{name}'s containers to be removed")
    store.close()


def test_user_task_file_runs(tmp_path, model_dir):
    """docs/tasks.md's example: a task family in one Python file, named by path in the config;
    on SQLite and Docker the run writes its report and leaves no container behind."""
    example = ROOT / "examples" / "my_task.py"
    proc = start(write_config(tmp_path, model_dir, steps=1, family=f"{example}:family",
                              options="{ max_lines = 6 }"))
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    store = open_store(tmp_path)
    run = store.runs()[0]
    assert run.status == "finished" and run.summary["learner_steps"] == 1
    check_exactly_once(store, run.id, steps=1)
    with store.engine.connect() as c:
        families = set(c.execute(select(s.TaskInstance.family)
                                 .where(s.TaskInstance.run_id == run.id)).scalars())
    assert families == {"logcount"}
    report = json.loads((tmp_path / "runs" / run.id / "report.json").read_text())
    assert [row["step"] for row in report["learning_curve"]] == [1]
    assert "## learning curve" in (tmp_path / "runs" / run.id / "report.md").read_text()
    wait_for(lambda: not containers_of(run.id), 60, "the run's containers to be removed")
    store.close()


def test_sigkill_orchestrator_then_resume(tmp_path, model_dir):
    config = write_config(tmp_path, model_dir, steps=5)
    proc = start(config)
    try:
        wait_for(lambda: learner_steps(tmp_path) >= 2 and running(tmp_path), 240,
                 "two learner steps with trajectories in flight", proc)
        kids = children_of(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for(lambda: not any(alive(k) for k in kids), 30, "engine and learner to exit")
    store = open_store(tmp_path)
    run_id = store.runs()[0].id
    assert store.run(run_id).status == "running"  # nobody could record anything else
    # running containers die with their owner (their agent sees EOF); one the owner had created
    # but not yet attached never starts, and the resume's orphan cleanup removes it (below)
    wait_for(lambda: not containers_of(run_id, running_only=True), 60,
             "the dead owner's running containers to go")

    resumed = start(config, "--resume", run_id)
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    assert store.run(run_id).status == "finished"
    check_exactly_once(store, run_id, steps=5)
    with store.engine.connect() as c:
        aborted = c.execute(select(s.Trajectory.error).where(
            s.Trajectory.run_id == run_id, s.Trajectory.status == "aborted")).scalars().all()
    assert aborted and any("orchestrator stopped" in (e or "") for e in aborted)
    wait_for(lambda: not containers_of(run_id), 60, "the run's containers to be removed")
    store.close()


def test_sigkill_learner_restarts_from_checkpoint(tmp_path, model_dir):
    proc = start(write_config(tmp_path, model_dir, steps=5))
    try:
        wait_for(lambda: learner_steps(tmp_path) >= 2, 240, "two learner steps", proc)
        os.kill(children_running(proc.pid, "learner")[0], signal.SIGKILL)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert "learner exited; restarting" in output
    store = open_store(tmp_path)
    run_id = store.runs()[0].id
    check_exactly_once(store, run_id, steps=5)
    log = (tmp_path / "runs" / run_id / "learner.log").read_text()
    assert log.count('"event": "learner started"') == 2
    store.close()


def test_engine_killed_fails_clearly(tmp_path, model_dir):
    proc = start(write_config(tmp_path, model_dir, steps=50))
    try:
        wait_for(lambda: learner_steps(tmp_path) >= 1, 240, "a learner step", proc)
        kids = children_of(proc.pid)
        os.kill(children_running(proc.pid, "engine")[0], signal.SIGKILL)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, output
    store = open_store(tmp_path)
    run = store.runs()[0]
    assert run.status == "failed"
    assert "the engine process exited" in run.error
    wait_for(lambda: not any(alive(k) for k in kids), 30, "children to exit")
    wait_for(lambda: not containers_of(run.id), 60, "the run's containers to be removed")
    with store.engine.connect() as c:
        open_ = c.execute(select(s.Trajectory.id).where(
            s.Trajectory.run_id == run.id, s.Trajectory.status.in_(("queued", "running")))).all()
    assert not open_
    store.close()


def test_sigterm_during_the_warm_start_aborts_and_stops_the_sft_child(tmp_path, model_dir):
    config = write_config(tmp_path, model_dir, steps=1)
    config.write_text(config.read_text() + "\n[learner.sft]\nenabled = true\n"
                      "demonstrations = 16\nsteps = 100000\n")
    proc = start(config)
    try:
        wait_for(lambda: children_running(proc.pid, "sft"), 120, "the SFT child to start", proc)
        sft = children_running(proc.pid, "sft")
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)  # not the SFT's 100,000 steps
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, output
    wait_for(lambda: not any(alive(p) for p in sft), 60, "the SFT child to stop")
    store = open_store(tmp_path)
    assert store.runs()[0].status == "aborted"
    store.close()


def test_an_unreachable_docker_fails_the_run_at_once_with_its_reason(tmp_path, model_dir):
    config = write_config(tmp_path, model_dir, steps=1)
    config.write_text(config.read_text() + "\n[learner.sft]\nenabled = true\n")
    proc = start(config, env={"DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock"})
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    assert "Traceback" not in output and "supervised warm start" not in output
    store = open_store(tmp_path)
    run = store.runs()[0]
    assert run.status == "failed" and "Docker engine not reachable" in run.error
    assert '[sandbox] backend = "local"' in run.error  # the way out, in a job's terms
    store.close()
