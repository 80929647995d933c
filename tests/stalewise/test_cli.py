"""Every store/config CLI command runs end to end on a tiny real database."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from core.records import SampledTokens
from core.store.store import Store, model_call_row
from core.tiny_tokenizer import save_tiny_tokenizer
from stalewise.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def _synthetic_run(url: str, model_dir: Path) -> int:
    tokenizer = save_tiny_tokenizer(model_dir)
    store = Store.open(url, create=True)
    store.create_run("r1", name="demo", config={"model": {"path": str(model_dir)}},
                     pipeline_mode="inflight")
    task = store.task_instance_id("r1", family="arith", key="a1", content_hash="h",
                                  difficulty="easy")
    trajectory = store.create_trajectory("r1", group_id=None, task_instance_id=task)
    ids = tokenizer.encode("<answer>42</answer>", add_special_tokens=False)
    n = len(ids)
    tokens = SampledTokens(ids, np.full(n, -0.25), [3] * n, [2] * (n - 1) + [3],
                           np.arange(n) * 0.01)
    store.insert_model_calls([model_call_row(
        trajectory_id=trajectory, turn=0, segment=0, context_len=0,
        prompt_token_ids=tokenizer.encode("What is 6*7?", add_special_tokens=False),
        tokens=tokens, sampling={}, engine_id="e", finish_reason="stop",
        cached_prompt_tokens=0, started_at=1.0, finished_at=2.0)])
    store.update_trajectory(trajectory, status="completed", stop_reason="answered", reward=1.0,
                            min_version=3, max_version=3, num_turns=1)
    store.admit("r1", trajectory, reason="fresh", learner_version=4, lag=1)
    store.close()
    return trajectory


def test_db_upgrade_and_check(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    result = runner.invoke(app, ["db", "check", "--url", url])
    assert result.exit_code == 1 and f"no store at {tmp_path / 'a.db'}" in result.output
    assert not (tmp_path / "a.db").exists()
    sqlite3.connect(tmp_path / "a.db").close()  # a database without our schema
    result = runner.invoke(app, ["db", "check", "--url", url])
    assert result.exit_code == 1
    assert f"stalewise db upgrade --url {url}" in result.output
    assert _invoke("db", "upgrade", "--url", url).exit_code == 0
    assert "schema at head" in _invoke("db", "check", "--url", url).output


def test_audit_commands(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    trajectory = _synthetic_run(url, tmp_path / "model")
    runs = json.loads(_invoke("audit", "runs", "--url", url, "--json").output)
    assert runs[0]["id"] == "r1" and runs[0]["admitted"] == 1

    listed = json.loads(_invoke("audit", "trajectories", "--run", "r1", "--url", url,
                                "--min-lag", "1", "--json").output)
    assert [t["id"] for t in listed] == [trajectory]
    assert json.loads(_invoke("audit", "trajectories", "--run", "r1", "--url", url,
                              "--min-lag", "2", "--json").output) == []
    assert json.loads(_invoke("audit", "trajectories", "--run", "r1", "--url", url,
                              "--reward-below", "0.5", "--json").output) == []
    for flag, value, expected in (("--purpose", "train", [trajectory]), ("--purpose", "eval", []),
                                  ("--decision", "admit", [trajectory]),
                                  ("--decision", "drop", [])):
        listed = json.loads(_invoke("audit", "trajectories", "--run", "r1", "--url", url,
                                    flag, value, "--json").output)
        assert [t["id"] for t in listed] == expected, (flag, value)
    bad = runner.invoke(app, ["audit", "trajectories", "--run", "r1", "--url", url,
                              "--decision", "admitted"])
    assert bad.exit_code == 2 and "admit, drop, requeue, mask" in bad.output

    detail = json.loads(_invoke("audit", "show", str(trajectory), "--url", url, "--json").output)
    tokens = detail["turns"][0]["tokens"]
    assert "".join(t["text"] for t in tokens) == "<answer>42</answer>"
    assert [t["kv_version"] for t in tokens][-2:] == [2, 3]
    assert tokens[0]["position"] == len("What is 6*7?")

    table = _invoke("audit", "show", str(trajectory), "--url", url).output
    assert "sampler logprob" in table and "-0.2500" in table and "'<answer>'" in table


def test_audit_show_puts_the_trainer_logprob_next_to_the_sampler(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    trajectory = _synthetic_run(url, tmp_path / "model")
    store = Store.open(url)
    (call,) = store.model_calls(trajectory)
    n = len(call.tokens)
    trained = np.full(n, -0.5, np.float32)
    trained[0] = np.nan  # a token the learner did not train
    store.insert_trainer_logprobs("r1", [dict(model_call_id=call.id, learner_step=1,
                                              policy_version=3, num_tokens=n,
                                              logprobs=trained.tobytes())])
    store.close()
    detail = json.loads(_invoke("audit", "show", str(trajectory), "--url", url, "--json").output)
    tokens = detail["turns"][0]["tokens"]
    assert tokens[0]["trainer_logprob"] is None and tokens[0]["log_ratio"] is None
    assert tokens[1]["trainer_logprob"] == -0.5 and tokens[1]["log_ratio"] == -0.25
    table = _invoke("audit", "show", str(trajectory), "--url", url).output
    assert "trainer logprob" in table and "log-ratio" in table and "-0.25" in table


def test_view_refuses_a_missing_database(tmp_path):
    result = runner.invoke(app, ["view", "--url", str(tmp_path / "none.db")])
    assert result.exit_code == 1 and f"no store at {tmp_path / 'none.db'}" in result.output


def test_export_refuses_an_unknown_format_and_run(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    _synthetic_run(url, tmp_path / "model")
    bad = runner.invoke(app, ["audit", "export", "--run", "r1", "--url", url, "--format", "csv",
                              str(tmp_path / "out")])
    assert bad.exit_code == 2 and "inspect, parquet, jsonl" in bad.output
    missing = runner.invoke(app, ["audit", "export", "--run", "r9", "--url", url, "--format",
                                  "jsonl", str(tmp_path / "out.jsonl")])
    assert missing.exit_code == 1 and "no run 'r9'" in missing.output




def test_audit_steps_prints_the_learning_curve(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    store = Store.open(url, create=True)
    store.create_run("r1", name="t", config={}, pipeline_mode="async")
    for step, reward in ((1, 0.25), (2, 0.5)):
        store.record_learner_step_and_version("r1", dict(
            step=step, mode="rl", first_seq=step, last_seq=step, num_samples=4, num_tokens=40,
            loss=0.1, policy_version=step - 1, mean_lag=0.5, max_lag=1,
            metrics={"reward/mean": reward, "loss/kl_sampler_k3": 1e-3,
                     "loss/sampler_abs_diff_max": 2e-5},
            started_at=10.0 * step, finished_at=10.0 * step + 2.5), None)
    store.close()
    rows = json.loads(_invoke("audit", "steps", "--run", "r1", "--url", url, "--json").output)
    assert [(r["step"], r["reward"], r["kl_sampler"], r["seconds"]) for r in rows] == [
        (1, 0.25, 1e-3, 2.5), (2, 0.5, 1e-3, 2.5)]
    assert rows[0]["clip_high"] is None  # not reported by that step
    assert rows[0]["lp_diff_max"] == 2e-5
    table = _invoke("audit", "steps", "--run", "r1", "--url", url).output
    assert "kl_sampler" in table and "0.25" in table


def test_audit_tables_keep_run_ids_whole_when_piped(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    store = Store.open(url, create=True)
    run_id = "an-rl-job-with-a-long-name-20261129-113425-911f"
    store.create_run(run_id, name="an-rl-job-with-a-long-name", config={}, pipeline_mode="async")
    store.close()
    table = _invoke("audit", "runs", "--url", url).output  # not a terminal: piped to a script
    assert run_id in table


def test_audit_show_unknown_trajectory(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    Store.open(url, create=True).close()
    result = runner.invoke(app, ["audit", "show", "99", "--url", url])
    assert result.exit_code == 1 and "no trajectory 99" in result.output


def test_run_dry_run_prints_resolved_config(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[pipeline]\nmode = "sync"\n[learner.loss]\nsurrogate = "cispo"\n')
    result = _invoke("run", "--dry-run", str(job))
    assert result.exit_code == 0
    resolved = json.loads(result.stdout)
    assert resolved["pipeline"]["mode"] == "sync"
    assert resolved["learner"]["loss"]["surrogate"] == "cispo"
    assert resolved["admission"]["max_lag"] == 2  # defaults are filled in



def test_a_task_family_that_does_not_load_fails_before_any_run(tmp_path):
    (tmp_path / "broken.py").write_text("def family(:\n")
    db = tmp_path / "runs.db"
    for family, says in (("missing.py:family", "does not exist"),
                         ("broken.py:family", "SyntaxError")):
        job = tmp_path / "job.toml"
        job.write_text(f'[run]\ndb_url = "sqlite:///{db}"\n'
                       f'[tasks]\nfamily = "{tmp_path / family}"\n')
        for args in (["run", "--dry-run", str(job)], ["run", str(job)]):
            result = runner.invoke(app, args)
            assert result.exit_code == 2, result.output
            assert "tasks.family:" in result.output and says in result.output
    assert not db.exists()  # no run was created


def test_an_sft_stage_family_that_does_not_load_fails_before_any_run(tmp_path):
    db = tmp_path / "runs.db"
    job = tmp_path / "job.toml"
    job.write_text(f'[run]\ndb_url = "sqlite:///{db}"\n[learner.sft]\nenabled = true\n'
                   '[[learner.sft.stages]]\nfamily = "arith"\nsteps = 10\n'
                   '[[learner.sft.stages]]\nfamily = "arith"\nsteps = 10\n'
                   'options = { max_opz = 1 }\n')
    result = runner.invoke(app, ["run", str(job)])
    assert result.exit_code == 2, result.output
    assert "learner.sft.stages[1]:" in result.output and "max_opz" in result.output
    assert not db.exists()


@pytest.mark.docker
def test_a_harbor_task_whose_from_image_is_missing_fails_before_any_run(tmp_path):
    tasks = tmp_path / "tasks"
    shutil.copytree(ROOT / "examples" / "harbor" / "sum-numbers", tasks / "sums")
    db = tmp_path / "runs.db"
    job = tmp_path / "job.toml"
    job.write_text(f'[run]\ndb_url = "sqlite:///{db}"\n[tasks]\nfamily = "harbor:{tasks}"\n')
    result = runner.invoke(app, ["run", str(job)])
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert "tasks.family: task stalewise/sum-numbers:" in line
    assert '[tasks.harbor] base_image_map = { "python:3.12-slim" = "stalewise-base" }' in line
    assert not db.exists()  # no run was created


def test_bad_config_prints_one_line_per_problem(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[pipeline]\nmode = "fast"\n[rollout]\ntemprature = 0.7\n')
    proc = subprocess.run([sys.executable, "-m", "stalewise", "run", "--dry-run", str(job)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert sorted(lines) == [
        f"error: {job}: pipeline.mode: got 'fast'; allowed values: 'sync', 'async' or 'inflight'",
        f"error: {job}: rollout.temprature: unknown field; did you mean 'temperature'? allowed "
        "fields: group_size, logprobs_topk, max_concurrent, max_malformed, max_tokens_per_turn, "
        "max_turns, temperature, top_k, top_p, wall_time_s",
    ]
