"""`stalewise run` with `[engine] kind = "vllm"`: the job starts vLLM itself (the CPU build in
.venv-vllm) and trains through it, with Docker sandboxes and SQLite.

Contract (one job, since each vLLM start costs minutes on CPU): SmolLM2-135M-Instruct, sync
mode, three learner steps, vLLM killed after the first:
- the run fails saying the engine process exited, leaving no open trajectory, and no process of
  vLLM's (engine core, workers) outlives it;
- `--resume` starts vLLM again on the last published checkpoint (at its version) and the run
  finishes with every learner step once;
- every trained token has lag 0, and vLLM's recorded sampler log-probs agree with the learner's
  recomputation on the same weights (mean and max |diff| per step under 1e-3; k3 KL under
  1e-6): on the starting weights, on a checkpoint vLLM started from, and after a weight update
  through the worker extension.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from test_job_faults import alive, check_exactly_once, children_of, learner_steps, wait_for

from core.children import group_members
from core.store import schema as s
from core.store.store import Store

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def vllm_job_config(tmp_path: Path, model: Path, *, steps: int) -> Path:
    """configs/smollm2-smoke.toml with the engine switched to vLLM (float32, small context)."""
    text = (ROOT / "configs" / "smollm2-smoke.toml").read_text()
    text = text.replace("sqlite:///var/smollm2-smoke/stalewise.db",
                        f"sqlite:///{tmp_path}/store.db")
    text = text.replace("var/smollm2-smoke", str(tmp_path))
    text = text.replace('"var/models/smollm2-135m"', f'"{model}"')
    text = text.replace("[engine]\nmax_batch = 8\n", """[engine]
kind = "vllm"
startup_timeout_s = 900.0
extra_args = ["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "16",
              "--enforce-eager"]
""")
    text = text.replace("steps = 2", f"steps = {steps}")
    assert 'kind = "vllm"' in text and f"steps = {steps}" in text
    config = tmp_path / "job.toml"
    config.write_text(text)
    return config


def require_vllm() -> None:
    from orchestrator.engines.launch import LaunchError, vllm_python

    try:
        vllm_python()
    except LaunchError as exc:
        pytest.fail(f"{exc}. (`make test` builds it; deselect these tests with -m 'not vllm')")


def run(config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stalewise", "run", str(config), *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def vllm_children(pid: int) -> list[int]:
    return [p for p in children_of(pid)
            if "vllm.entrypoints.openai.api_server" in Path(f"/proc/{p}/cmdline").read_bytes()
            .decode(errors="replace").split("\0")]


def test_vllm_killed_mid_run_fails_clearly_then_resume_finishes_with_agreeing_log_probs(
        tmp_path, smollm2_dir):
    require_vllm()
    config = vllm_job_config(tmp_path, smollm2_dir, steps=3)
    proc = run(config)
    try:
        wait_for(lambda: learner_steps(tmp_path) >= 1, 1200, "a learner step", proc)
        engines = vllm_children(proc.pid)
        assert len(engines) == 1, children_of(proc.pid)
        os.kill(engines[0], signal.SIGKILL)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, output[-4000:]
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    try:
        failed = store.runs()[0]
        assert failed.status == "failed" and "the engine process exited" in failed.error
        with store.engine.connect() as c:
            open_ = c.execute(select(s.Trajectory.id).where(
                s.Trajectory.run_id == failed.id,
                s.Trajectory.status.in_(("queued", "running")))).all()
        assert not open_
    finally:
        store.close()
    wait_for(lambda: not any(alive(p) for p in engines), 60, "vLLM to exit")
    # its engine core and workers too (they outlived a SIGKILLed server: 3.7 GB left behind)
    assert not group_members(engines[0]), [Path(f"/proc/{p}/cmdline").read_bytes()
                                           for p in group_members(engines[0])]

    resumed = run(config, "--resume", failed.id)
    output, _ = resumed.communicate(timeout=1800)
    assert resumed.returncode == 0, output[-4000:]
    store = Store.open(f"sqlite:///{tmp_path}/store.db")
    try:
        done = store.runs()[0]
        assert done.status == "finished"
        check_exactly_once(store, done.id, steps=3)
    finally:
        store.close()
    # step 1 sampled on the starting weights, step 2 on the checkpoint vLLM was restarted on,
    # step 3 after a weight update through the worker extension
    audit = subprocess.run([sys.executable, "-m", "stalewise", "audit", "steps", "--run", done.id,
                            "--url", f"sqlite:///{tmp_path}/store.db", "--json"], cwd=ROOT,
                           capture_output=True, text=True, check=True)
    steps = json.loads(audit.stdout)
    print(json.dumps(steps))
    assert [step["step"] for step in steps] == [1, 2, 3]
    for step in steps:
        assert step["max_lag"] == 0
        assert 0 <= step["lp_diff_mean"] <= step["lp_diff_max"] < 1e-3, step
        assert 0 <= step["kl_sampler"] < 1e-6, step
