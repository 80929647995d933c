"""Every `stalewise learner` command end to end on a tiny model."""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from engine.tiny import init_tiny
from stalewise.cli import app


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("learner-cli")
    init_tiny(root / "tiny", hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    return root


def _run(*args: str):
    result = CliRunner().invoke(app, ["learner", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_synth_data_then_train_publishes_versions(workdir):
    out = _run(
        "synth-data",
        str(workdir / "tiny"),
        str(workdir / "data"),
        "--groups",
        "2",
        "--group-size",
        "3",
        "--max-new-tokens",
        "6",
        "--demos",
        "4",
    )
    assert "wrote 6 RL samples" in out
    config = workdir / "learner.toml"
    config.write_text(
        '[learner]\nmicro_batch_size = 2\n[learner.loss]\nsurrogate = "cispo"\n'
        '[learner.score_centering]\nweight = "none"\n'
    )
    out = _run(
        "train",
        str(workdir / "tiny"),
        "--data",
        str(workdir / "data" / "rl_samples.jsonl"),
        "--out",
        str(workdir / "versions"),
        "--config",
        str(config),
        "--batch-size",
        "3",
        "--lr",
        "1e-3",
    )
    assert "2 learner steps on 6 samples; published versions [1, 2]" in out
    assert (workdir / "versions" / "v000002" / "model.safetensors").exists()
    rows = [
        json.loads(line)
        for line in (workdir / "versions" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2] and "score_centering/loss" in rows[0]["metrics"]


def test_sft_prints_the_loss_drop_and_writes_a_checkpoint(workdir):
    out = _run(
        "sft",
        str(workdir / "tiny"),
        "--out",
        str(workdir / "sft"),
        "--synthetic",
        "8",
        "--steps",
        "15",
        "--batch-size",
        "4",
        "--lr",
        "5e-3",
    )
    line = out.strip().splitlines()[-1]
    before, after = (float(x) for x in line.split("loss ")[1].split(" (")[0].split(" -> "))
    assert after < before
    assert (workdir / "sft" / "model.safetensors").exists()


def test_sft_on_a_task_suite(workdir):
    out = _run(
        "sft",
        str(workdir / "tiny"),
        "--out",
        str(workdir / "sft-arith"),
        "--suite",
        "arith",
        "--count",
        "4",
        "--steps",
        "6",
        "--batch-size",
        "2",
        "--lr",
        "5e-3",
    )
    assert "sft on 4 demonstrations" in out and (workdir / "sft-arith" / "config.json").exists()
    check = next(line for line in out.splitlines() if line.startswith("validation check"))
    assert "of 64 validation instances with mean probability" in check
    assert float(check.split("mean probability ")[1].split("%")[0]) < 1.0, \
        "six SFT steps cannot make the tiny model reproduce held-out demonstrations"


def test_sft_stages_run_first_on_their_own_family_and_settings(workdir):
    config = workdir / "stages.toml"
    config.write_text('[sft]\nbatch_size = 2\nlr = 5e-3\n'
                      '[[sft.stages]]\nfamily = "arith"\noptions = { max_ops = 1 }\n'
                      'demonstrations = 6\nsteps = 3\n')
    out = _run("sft", str(workdir / "tiny"), "--out", str(workdir / "sft-staged"),
               "--suite", "vault", "--count", "2", "--steps", "2", "--config", str(config))
    lines = out.splitlines()
    stage = next(i for i, line in enumerate(lines) if line.startswith("sft stage 0 (arith)"))
    main = next(i for i, line in enumerate(lines) if line.startswith("sft on 2 demonstrations"))
    assert stage < main and "on 6 demonstrations, 3 steps" in lines[stage]
    done = json.loads((workdir / "sft-staged" / "stalewise.json").read_text())
    assert [(s["family"], s["steps"]) for s in done["stages"]] == [("arith", 3)]
    assert done["sft_steps"] == 2
    # the machine facts the SFT path depends on, recorded next to its figures
    assert done["numerics"]["torch"] == torch.__version__
    assert done["numerics"]["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
    assert done["numerics"]["torch_threads"] == torch.get_num_threads() >= 1
    assert done["numerics"]["cpu"]


def test_a_bad_sft_stage_names_the_stage(workdir):
    config = workdir / "bad-stage.toml"
    config.write_text('[[sft.stages]]\nfamily = "no-such-family"\nsteps = 3\n')
    result = CliRunner().invoke(app, ["learner", "sft", str(workdir / "tiny"), "--out",
                                      str(workdir / "never"), "--synthetic", "4",
                                      "--config", str(config)])
    assert result.exit_code != 0
    assert "sft.stages[0] (no-such-family)" in result.output and "not found" in result.output
    assert not (workdir / "never").exists()


def test_bad_config_is_reported_with_the_field_and_fix(workdir):
    config = workdir / "bad.toml"
    config.write_text('[loss]\naggregation = "seq_sum_norm"\n')
    result = CliRunner().invoke(
        app,
        [
            "learner",
            "train",
            str(workdir / "tiny"),
            "--data",
            str(workdir / "missing.jsonl"),
            "--out",
            str(workdir / "x"),
            "--config",
            str(config),
        ],
    )
    assert result.exit_code != 0
    assert "norm_constant" in result.output


def test_train_refuses_several_workers_and_names_the_fix(workdir):
    config = workdir / "workers.toml"
    config.write_text("[learner]\nworkers = 2\n")
    result = CliRunner().invoke(app, ["learner", "train", str(workdir / "tiny"), "--data",
                                      str(workdir / "missing.jsonl"), "--out",
                                      str(workdir / "y"), "--config", str(config)])
    assert result.exit_code != 0
    words = " ".join(result.output.replace("│", " ").split())  # the error box wraps lines
    assert "workers = 2" in words and "set workers = 1" in words, result.output


def test_sft_selection_scores_validation_instances(workdir):
    """`sft.select_every` from a config file: the command prints every scored step and the kept
    one, and stalewise.json records them; the check of the kept checkpoint reads validation
    instances too (tests/learner/test_warm_start_splits.py: which ones)."""
    config = workdir / "select.toml"
    config.write_text('[sft]\nbatch_size = 2\nlr = 5e-3\nselect_every = 2\nselect_instances = 8\n')
    out = _run("sft", str(workdir / "tiny"), "--out", str(workdir / "sft-select"),
               "--suite", "arith", "--count", "4", "--steps", "5", "--config", str(config))
    line = next(line for line in out.splitlines() if line.startswith("checkpoint selection"))
    done = json.loads((workdir / "sft-select" / "stalewise.json").read_text())
    assert sorted(int(step) for step in done["select_scores"]) == [2, 4, 5]
    assert done["kept_step"] in (2, 4, 5) and line.endswith(f"kept step {done['kept_step']}")
    best = max(done["select_scores"].values())
    assert done["select_scores"][str(done["kept_step"])] == best
    as_it_went = [line for line in out.splitlines() if "[select]" in line]
    assert [line.split()[1] for line in as_it_went] == ["2", "4", "5"]
    assert as_it_went[-1].endswith(f"{done['select_scores']['5']:.1%}")
    assert "of 64 validation instances" in next(
        line for line in out.splitlines() if line.startswith("validation check"))


def test_sft_retries_are_printed_and_recorded_with_their_settings(workdir):
    """`restart_below` above any reachable score: every retry runs; stalewise.json records each
    try's settings and scores, the kept try, and the kept try's step count."""
    config = workdir / "retry.toml"
    config.write_text('[sft]\nbatch_size = 2\nlr = 5e-3\nselect_every = 2\nselect_instances = 8\n'
                      'restart_below = 1.0\n[[sft.retries]]\nsteps = 3\n')
    out = _run("sft", str(workdir / "tiny"), "--out", str(workdir / "sft-retry"),
               "--suite", "arith", "--count", "4", "--steps", "5", "--config", str(config))
    done = json.loads((workdir / "sft-retry" / "stalewise.json").read_text())
    assert [t["settings"]["steps"] for t in done["tries"]] == [5, 3]
    assert [sorted(int(s) for s in t["scores"]) for t in done["tries"]] == [[2, 4, 5], [2, 3]]
    kept = done["tries"][done["kept_try"]]
    assert max(kept["scores"].values()) == max(max(t["scores"].values()) for t in done["tries"])
    assert done["sft_steps"] == kept["settings"]["steps"]
    line = next(line for line in out.splitlines() if line.startswith("sft retries"))
    assert "try 1 (steps 3," in line and line.endswith(f"kept try {done['kept_try']} (its "
                                                       "scores above)")


def test_a_jobs_warm_start_is_one_file_whose_seed_is_recorded(workdir):
    """The job's SFT child gets one file (RUN/sft.json, `config.learner.WarmStartJob`): the
    same SFT as the flags would run, the resolved seed in the checkpoint's stalewise.json, and
    no second way to set a setting beside it."""
    from config.job import parse_config
    from config.learner import WarmStartJob

    job = parse_config({"run": {"seed": 5}, "learner": {"sft": {"steps": 2, "batch_size": 2,
                                                                 "demonstrations": 4}},
                        "tasks": {"family": "arith"}, "model": {"chat_format": "hermes"}})
    section = WarmStartJob(learner=job.learner, family="arith", options={},
                           chat_format="hermes", tool_listing="json")
    path = workdir / "sft.json"
    path.write_text(section.model_dump_json())
    out = _run("sft", str(workdir / "tiny"), "--out", str(workdir / "sft-job"), "--job", str(path))
    assert "sft on 4 demonstrations" in out
    done = json.loads((workdir / "sft-job" / "stalewise.json").read_text())
    assert done["seed"] == 5 and done["sft_steps"] == 2
    twice = CliRunner().invoke(app, ["learner", "sft", str(workdir / "tiny"), "--out",
                                     str(workdir / "never"), "--job", str(path), "--seed", "1"])
    assert twice.exit_code != 0 and "--job holds the whole warm start; drop --seed" in twice.output


def test_the_learner_child_fails_with_a_plain_traceback_its_job_can_quote(workdir):
    """`python -m learner` is a job's child: when it dies, the job reports the last 4,000
    characters of its log. A plain traceback fits the whole call chain and ends on the error;
    rich's boxes (typer's default) fill that with the innermost frame's source."""
    import subprocess
    import sys

    (workdir / "a-file").write_text("")
    done = subprocess.run([sys.executable, "-m", "learner", "sft", str(workdir / "tiny"),
                           "--out", str(workdir / "a-file" / "sft"), "--synthetic", "4",
                           "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "Traceback (most recent call last)" in done.stderr and "│" not in done.stderr
    assert "in warm_start" in done.stderr  # the chain, not only the innermost frame
    assert done.stderr.rstrip().splitlines()[-1].startswith("FileExistsError")


def test_a_missing_checkpoint_or_data_file_and_a_bad_line_are_one_line_each(workdir):
    """A missing --data file was FileNotFoundError's traceback; a line of the demonstrations
    that is not JSON was json's message without the file and line."""
    def squash(text: str) -> str:  # the error box wraps lines, long paths included
        return re.sub(r"[\s│]", "", text)

    def error(*args: str) -> str:
        result = CliRunner().invoke(app, ["learner", *args])
        assert result.exit_code == 2, result.output
        return squash(result.output)

    tiny, missing = str(workdir / "tiny"), str(workdir / "missing.jsonl")
    assert squash(f"Invalid value for --data: {missing}: no such file; pass a JSON-lines file") \
        in error("train", tiny, "--data", missing, "--out", str(workdir / "t1"))
    assert squash(f"Invalid value for MODEL: {workdir / 'none'} holds no checkpoint (config.json "
                  "missing)") in error("sft", str(workdir / "none"), "--synthetic", "4", "--out",
                                       str(workdir / "s1"))
    demos = workdir / "demos-bad.jsonl"
    demos.write_text('{"token_ids": [1, 2], "loss_mask": [0, 1]}\nnot json\n')
    assert squash(f"{demos}:2: not JSON (Expecting value)") \
        in error("sft", tiny, "--data", str(demos), "--out", str(workdir / "s2"))
    assert not (workdir / "t1").exists() and not (workdir / "s2").exists()
