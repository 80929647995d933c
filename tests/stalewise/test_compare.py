"""`stalewise compare` end to end on two tiny jobs (sync and async) with a very small budget:
both run on one store, the table holds a row per run with its diagnostics, and the plots are
written as PNG and SVG."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from core.store.store import Store
from stalewise.cli import app

pytestmark = [pytest.mark.slow]


def tiny_job(tmp_path: Path, model: Path, mode: str) -> Path:
    config = tmp_path / f"{mode}.toml"
    config.write_text(f"""
[run]
name = "{mode}"
progress_every_s = 5.0
[model]
path = "{model}"
create_tiny = false
chat_format = "hermes"
tool_listing = "none"
[engine]
startup_timeout_s = 900
[sandbox]
backend = "local"
[tasks]
family = "arith"
options = {{ max_ops = 1 }}
eval_instances = 4
[rollout]
group_size = 2
max_concurrent = 4
max_tokens_per_turn = 16
[learner]
batch_size = 4
micro_batch_size = 4
[learner.sft]
enabled = true
demonstrations = 8
steps = 2
batch_size = 4
[pipeline]
mode = "{mode}"
steps = 2
""")
    return config


def test_compare_two_tiny_jobs(tmp_path):
    from engine.tiny import init_tiny

    model = init_tiny(tmp_path / "model" / "tiny")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [
        "compare", str(tiny_job(tmp_path, model, "sync")), str(tiny_job(tmp_path, model, "async")),
        "--budget", "8", "--first-seed", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads((out / "compare.json").read_text())
    rows = written["runs"]
    assert [r["label"] for r in rows] == ["sync-s3", "async-s3"]
    assert [(r["recipe"], r["seeds"]) for r in written["recipes"]] == [("sync", 1), ("async", 1)]
    # one warm start, made by the first run; the second starts RL from its checkpoint
    made = out / "runs" / rows[0]["run_id"] / "sft"
    assert (made / "config.json").exists() and "warm_start_from" not in rows[0]
    assert rows[1]["warm_start_from"] == "sync-s3"
    assert not (out / "runs" / rows[1]["run_id"] / "sft").exists()
    # the run's report names the warm start and the machine numerics it depends on
    report = json.loads((out / "runs" / rows[0]["run_id"] / "report.json").read_text())
    warm = report["summary"]["warm_start"]
    assert warm["sft_steps"] == 2 and warm["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
    assert "warm_start" not in json.loads(
        (out / "runs" / rows[1]["run_id"] / "report.json").read_text())["summary"]
    store = Store.open(f"sqlite:///{out / 'compare.db'}")
    second = store.run(rows[1]["run_id"]).config
    store.close()
    assert second["model"]["path"] == str(made) and not second["learner"]["sft"]["enabled"]
    assert second["run"]["seed"] == 3
    # the same checkpoint, seed and evaluation settings: one evaluation before RL serves both
    assert not second["tasks"]["eval_before"] and rows[1]["before_from"] == "sync-s3"
    assert rows[1]["before"] == rows[0]["before"] and "before_from" not in rows[0]
    assert eval_trajectories(out, rows[0]["run_id"]) == 8  # before and after
    assert eval_trajectories(out, rows[1]["run_id"]) == 4  # after only
    assert "distinct): after RL" in result.output and "tasks.eval_before = false" in result.output
    for row in rows:
        assert row["exit_code"] == 0 and row["run_id"]
        assert row["before"][1] == row["after"][1] == 4
        assert row["sampled_tokens"] > 0 and row["rl_seconds"] > 0
        assert "held_out_95" in row and "multi_version_fraction" in row
        # paired per test instance with the baseline's evaluation, the first run's for both
        paired = row["held_out_paired"]
        assert paired["instances"] == 4
        assert paired["both"] + paired["only_before"] == rows[0]["before"][0]
        assert paired["both"] + paired["only_after"] == row["after"][0]
        assert 0.0 <= row["beyond_weights_share"] <= 1.0
        assert row["machine"]["cores"] == os.cpu_count() and len(row["machine"]["load_avg_end"]) == 3
        assert row["machine"]["cpu"] == report["summary"]["numerics"]["cpu"]
    table = (out / "compare.md").read_text()
    assert "| sync-s3 |" in table and "| async-s3 |" in table and "IS ESS" in table
    assert "| excluded tokens | beyond weights |" in table
    assert "| gain [95%] | paired gain [95%] |" in table
    assert "async-s3 from sync-s3's" in table and "async-s3 uses sync-s3's" in table
    assert f"Machine: {rows[0]['machine']['cpu']}, {os.cpu_count()} cores (2 runs)" in table
    assert "| sync | 1 |" in table and "none: every recipe needs two seeds or more" in table
    for name in ("success-vs-seconds", "success-vs-tokens"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
        assert "<svg" in (out / f"{name}.svg").read_text()


def eval_trajectories(out: Path, run_id: str) -> int:
    from sqlalchemy import func, select

    from core.store import schema as s

    t = s.Trajectory.__table__
    store = Store.open(f"sqlite:///{out / 'compare.db'}")
    try:
        with store.engine.connect() as c:
            return c.execute(select(func.count()).where(
                t.c.run_id == run_id, t.c.purpose == "eval")).scalar()
    finally:
        store.close()


def test_compare_refuses_a_warm_start_that_is_not_a_checkpoint(tmp_path):
    job = tiny_job(tmp_path, tmp_path / "model", "sync")
    result = CliRunner().invoke(app, ["compare", str(job), "--warm-start", str(tmp_path),
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "config.json missing" in result.output
    assert not (tmp_path / "out" / "compare.db").exists()


def test_recipes_are_ranked_only_where_the_spread_between_seeds_allows_it():
    from orchestrator.comparison import ranking, recipe_spread

    def run(config, before, after):
        return {"config": f"configs/{config}.toml", "before": (before, 100),
                "after": (after, 100), "held_out_95": {"gain_excludes_zero": after - before > 14}}

    rows = ([run("steady", 50, a) for a in (80, 81, 79)]
            + [run("noisy", 50, a) for a in (95, 55, 70)]
            + [run("low", 50, a) for a in (60, 61, 59)])
    spread = {r["recipe"]: r for r in recipe_spread(rows)}
    assert spread["steady"]["after"] == {"mean": 0.8, "min": 0.79, "max": 0.81, "sd": 0.01,
                                         "n": 3}
    assert spread["steady"]["gains_outside_noise"] == 3
    assert spread["low"]["gains_outside_noise"] == 0
    lines = ranking(list(spread.values()))
    assert any(line.startswith("steady above low: +20.0 points, Welch t 24.49") for line in lines)
    assert any(line.startswith("steady not separated from noisy") for line in lines)
    assert any(line.startswith("noisy not separated from low") for line in lines)
    assert ranking(recipe_spread([run("one", 50, 90), run("other", 50, 10)])) == []


def test_a_ranking_among_many_recipes_corrects_for_the_number_of_pairs():
    """Two recipes 4 points apart with a 1.5-point spread over 3 seeds (p 0.03) are told apart
    alone, and not once twenty other pairs are tested beside them."""
    from orchestrator.comparison import ranking

    def recipe(name, mean, sd=0.015, n=3):
        return {"recipe": name, "after": {"mean": mean, "sd": sd, "n": n}}

    alone = ranking([recipe("a", 0.84), recipe("b", 0.80)])
    assert alone[0].startswith("a above b: +4.0 points") and "p 0.0" in alone[0]
    crowd = ranking([recipe("a", 0.84), recipe("b", 0.80)]
                    + [recipe(f"r{i}", 0.82 + 0.001 * i, sd=0.05) for i in range(5)])
    assert len(crowd) == 21
    assert any(line.startswith("a not separated from b: +4.0 points") for line in crowd)


def test_run_with_seeds_runs_each_seed_and_prints_the_spread_of_the_gain(tmp_path):
    from engine.tiny import init_tiny

    model = init_tiny(tmp_path / "model" / "tiny")
    config = tiny_job(tmp_path, model, "sync")
    result = CliRunner().invoke(app, [
        "run", str(config), "--seeds", "2", "--first-seed", "1",
        "--set", f"run.db_url=sqlite:///{tmp_path / 'seeds.db'}",
        "--set", f"run.output_dir={tmp_path / 'runs'}", "--set", "pipeline.steps=1"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("seed ")] == [
        "seed 1", "seed 2"]
    assert lines[-1].startswith("spread over 2 seeds: gain mean ")
    store = Store.open(f"sqlite:///{tmp_path / 'seeds.db'}")
    try:
        seeds = sorted(store.run(r["id"]).config["learner"]["sft"]["seed"]
                       for r in audit_runs(store))
    finally:
        store.close()
    assert seeds == [1, 2], "each seed's warm start is seeded by it"


def audit_runs(store):
    from core.store import audit

    return audit.runs(store, limit=10)
