"""configs/smollm2-smoke.toml end to end: a real trained model (SmolLM2-135M-Instruct) with its
own chat template, Docker sandboxes, SQLite, two sync learner steps.

Contract: the run finishes; every trained token has lag 0; on these real weights the learner's
recomputed log-probs agree with the engine's recorded sampler log-probs (mean and max absolute
difference per step under 1e-3, measured about 2e-5 and 3e-5; k3 KL under 1e-6); `audit steps`
shows those figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.store.store import Store

pytestmark = [pytest.mark.docker, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_smollm2_smoke_job_log_probs_agree(tmp_path, smollm2_dir):
    text = (ROOT / "configs" / "smollm2-smoke.toml").read_text()
    text = text.replace("var/smollm2-smoke", str(tmp_path)).replace(
        '"var/models/smollm2-135m"', f'"{smollm2_dir}"')
    config = tmp_path / "job.toml"
    config.write_text(text)
    done = subprocess.run([sys.executable, "-m", "stalewise", "run", str(config)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    url = f"sqlite:///{tmp_path}/stalewise.db"
    store = Store.open(url)
    try:
        run_id = store.runs()[0].id
    finally:
        store.close()
    audit = subprocess.run([sys.executable, "-m", "stalewise", "audit", "steps", "--run", run_id,
                            "--url", url, "--json"], cwd=ROOT, capture_output=True, text=True)
    summary = json.loads((tmp_path / "runs" / run_id / "report.json").read_text())["summary"]
    # the config pins float32 on both sides, whatever bfloat16 instructions this CPU has
    assert summary["numerics"]["engine_dtype"] == summary["numerics"]["learner_dtype"] == "float32"
    assert set(summary["numerics"]["cpu_bf16"]) <= {"amx_bf16", "avx512_bf16"}
    steps = json.loads(audit.stdout)
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        assert step["max_lag"] == 0
        assert 0 <= step["lp_diff_mean"] <= step["lp_diff_max"] < 1e-3, step
        assert 0 <= step["kl_sampler"] < 1e-6, step
