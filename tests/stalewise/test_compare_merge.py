"""`stalewise compare --merge`: the runs of earlier comparisons in one table, ranked together,
with what was left out and where the merged runs are not the same experiment."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from stalewise.cli import app


def run_row(label: str, config: str, before: int, after: int, *, exit_code: int = 0,
            n: int = 100, **extra) -> dict:
    return {"label": label, "config": f"configs/{config}.toml", "run_id": f"{label}-id",
            "exit_code": exit_code, "before": [before, n] if exit_code == 0 else [0, 0],
            "after": [after, n] if exit_code == 0 else [0, 0], "rl_seconds": 10.0,
            "sampled_tokens": 1000, "learner_steps": 4, "mean_lag": 1.0, "max_lag": 2,
            "is_ess": 1.0, "kl_sampler_k3": 0.0, "clip_high": 0.0, "clip_low": 0.0,
            "multi_version_fraction": 0.0, "difficulty_tv": 0.01, "duration_tv": 0.01,
            "excluded_token_share": 0.0,
            "held_out_95": {"before": f"{before}%", "after": f"{after}%", "gain": "+",
                            "gain_excludes_zero": after - before > 14}, **extra}


def comparison(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "compare.json").write_text(json.dumps({"runs": rows, "recipes": []}))
    return folder


def checkpoint(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def merge(*args: str):
    return CliRunner().invoke(app, ["compare", *args])


def merged_table(a: Path, b: Path, out: Path):
    """Merge folders a and b into out: the command's result and compare.md."""
    result = merge("--merge", str(a), "--merge", str(b), "--out", str(out))
    assert result.exit_code == 0, result.output
    return result, (out / "compare.md").read_text()


def test_merged_runs_are_ranked_together_and_stopped_runs_are_left_out(tmp_path):
    warm = checkpoint(tmp_path / "warm", b"weights")
    copy = checkpoint(tmp_path / "elsewhere" / "sft", b"weights")  # the same checkpoint, copied
    first = comparison(tmp_path / "first", [
        run_row(f"steady-s{i}", "steady", 50, a, warm_start_from=str(warm))
        for i, a in enumerate((80, 81))] + [
        run_row("low-s0", "low", 50, 60, warm_start_from=str(copy)),
        run_row("low-s1", "low", 0, 0, exit_code=143)])
    second = comparison(tmp_path / "second", [
        run_row("steady-s2", "steady", 50, 79, warm_start_from=str(warm))] + [
        run_row(f"low-s{i}", "low", 50, a, warm_start_from=str(warm))
        for i, a in ((1, 61), (2, 59))])
    out = tmp_path / "merged"
    result, table = merged_table(first, second, out)
    written = json.loads((out / "compare.json").read_text())
    assert [r["label"] for r in written["runs"]] == [
        "steady-s0", "steady-s1", "low-s0", "steady-s2", "low-s1", "low-s2"]
    assert {r["recipe"]: (r["seeds"], r["after"]["mean"]) for r in written["recipes"]} == {
        "steady": (3, 0.8), "low": (3, 0.6)}
    assert f"{first}: 3 of 4 runs; left out: low-s1 (exit 143)" in table
    assert f"{second}: 3 of 3 runs" in table
    assert "- steady above low" in table
    assert "warning" not in result.output, "one checkpoint in two folders is one start"
    assert (out / "success-vs-seconds.png").exists() and not (out / "compare.db").exists()


def test_merging_runs_of_different_starts_or_test_sizes_warns_in_the_table(tmp_path):
    a = comparison(tmp_path / "a", [run_row("x-s0", "x", 50, 70, warm_start_from=str(
        checkpoint(tmp_path / "warm-a", b"one")))])
    b = comparison(tmp_path / "b", [run_row("x-s1", "x", 50, 70, n=200, warm_start_from=str(
        checkpoint(tmp_path / "warm-b", b"two")))])
    out = tmp_path / "merged"
    result, table = merged_table(a, b, out)
    assert "different numbers of test instances (100, 200)" in table
    assert "different checkpoints (x-s0; x-s1)" in table
    assert "warning: the runs started RL from different checkpoints" in result.output


def test_a_label_twice_or_a_folder_without_a_comparison_is_refused_before_anything_runs(
        tmp_path):
    a = comparison(tmp_path / "a", [run_row("x-s0", "x", 50, 70)])
    b = comparison(tmp_path / "b", [run_row("x-s0", "x", 50, 75)])
    result = merge("--merge", str(a), "--merge", str(b), "--out", str(tmp_path / "o1"))
    assert result.exit_code == 2 and "two runs are labelled x-s0" in result.output
    assert not (tmp_path / "o1").exists()
    job = tmp_path / "x.toml"
    job.write_text("this is not read: the labels clash first\n")
    result = merge(str(job), "--merge", str(a), "--out", str(tmp_path / "o2"))
    assert result.exit_code == 2 and "this comparison's jobs" in result.output
    result = merge("--merge", str(tmp_path / "nothing"), "--out", str(tmp_path / "o3"))
    assert result.exit_code == 2 and "compare.json does not exist" in result.output
    broken = comparison(tmp_path / "broken", [{"label": "x-s5", "exit_code": 0}])
    result = merge("--merge", str(broken), "--out", str(tmp_path / "o4"))
    assert result.exit_code == 2 and "run x-s5 has no config, run_id, before, after" in \
        result.output
    result = merge("--merge", str(a), "--out", str(a))
    assert result.exit_code == 2 and "also the output folder" in result.output
    result = merge()
    assert result.exit_code == 2 and "name the job configs" in result.output


def test_the_table_names_each_runs_machine_and_warns_where_the_cpus_differ(tmp_path):
    a = comparison(tmp_path / "a", [run_row("x-s0", "x", 50, 70, machine={
        "cpu": "Intel Xeon", "cores": 2, "load_avg_end": [2.0, 2.1, 2.2]})])
    b = comparison(tmp_path / "b", [run_row("x-s1", "x", 50, 71)])  # before `machine`
    report = tmp_path / "b" / "runs" / "x-s1-id" / "report.json"
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({"summary": {"numerics": {"cpu": "AMD EPYC"}}}))
    out = tmp_path / "merged"
    result, table = merged_table(a, b, out)
    assert "Machine: Intel Xeon, 2 cores (1 runs); AMD EPYC (1 runs)" in table
    assert "at the runs' ends: 2.2 (x-s0) to 2.2 (x-s0), 1 of 2 runs recorded it" in table
    assert "different CPUs (AMD EPYC, Intel Xeon)" in table
    rows = json.loads((out / "compare.json").read_text())["runs"]
    assert rows[1]["machine"] == {"cpu": "AMD EPYC"}


def test_runs_from_before_the_beyond_weights_figure_merge_with_a_dash_in_its_column(tmp_path):
    a = comparison(tmp_path / "a", [run_row("x-s0", "x", 50, 70)])  # before the figure
    b = comparison(tmp_path / "b", [run_row("x-s1", "x", 50, 71, beyond_weights_share=0.1875)])
    _, table = merged_table(a, b, tmp_path / "merged")
    header = next(line for line in table.splitlines() if line.startswith("| label |"))
    column = header.strip("| ").split(" | ").index("beyond weights")
    cells = {line.strip("| ").split(" | ")[0]: line.strip("| ").split(" | ")[column]
             for line in table.splitlines() if line.startswith("| x-s")}
    assert cells == {"x-s0": "-", "x-s1": "0.188"}
