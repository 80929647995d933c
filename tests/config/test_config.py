"""The job config: every shipped file parses; bad values get one clear line each."""

from __future__ import annotations

from pathlib import Path

import pytest

from config.errors import ConfigError
from config.job import JobConfig, load_config, parse_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
JOB_CONFIGS = sorted(p for p in CONFIGS.rglob("*.toml") if p.name != "lab.toml")


def test_there_are_shipped_job_configs():
    assert JOB_CONFIGS, f"no job configs found in {CONFIGS}"


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_shipped_job_config_parses(path):
    assert isinstance(load_config(path), JobConfig)


def test_shipped_lab_config_parses():
    from lab.config import load_lab_config

    load_lab_config(CONFIGS / "lab.toml")


def test_defaults_are_valid():
    config = parse_config({})
    assert config.pipeline.mode == "async"
    assert config.sandbox.backend == "docker" and config.sandbox.reuse is False


def _problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, "job.toml")
    return info.value.problems


def test_bad_choice_names_field_value_and_allowed_values():
    (problem,) = _problems({"pipeline": {"mode": "fast"}})
    assert problem == "pipeline.mode: got 'fast'; allowed values: 'sync', 'async' or 'inflight'"


def test_unknown_key_suggests_the_closest_field():
    (problem,) = _problems({"admission": {"max_lagg": 3}})
    assert problem.startswith("admission.max_lagg: unknown field; did you mean 'max_lag'?")


def test_every_problem_is_reported_on_its_own():
    problems = _problems({"pipeline": {"mode": "x"}, "learner": {"loss": {"surrogate": "y"}},
                          "sandbox": {"max_live": 0}})
    assert len(problems) == 3
    assert any(p.startswith("learner.loss.surrogate: got 'y'") for p in problems)
    assert any(p.startswith("sandbox.max_live:") and "1" in p for p in problems)


def test_cross_field_rule_says_how_to_fix():
    (problem,) = _problems({"rollout": {"group_size": 1}})
    assert "raise rollout.group_size" in problem


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nname = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_set_overrides_apply_before_validation_and_name_bad_items(tmp_path):
    from config.job import load_config

    path = tmp_path / "job.toml"
    path.write_text('[run]\nseed = 0\n[learner.sft]\nenabled = true\n')
    job = load_config(path, ["run.seed=7", "learner.sft.steps=12", "run.name=seven",
                             "pipeline.mode=sync"])
    assert (job.run.seed, job.learner.sft.steps, job.run.name) == (7, 12, "seven")
    assert job.pipeline.mode == "sync" and job.learner.sft.enabled
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(path, ["run.seed"])
    with pytest.raises(ConfigError, match="pipeline.mode"):
        load_config(path, ["pipeline.mode=sometimes"])


def test_extends_merges_tables_and_replaces_other_values(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "long.toml").write_text(
        '[run]\nname = "long"\nseed = 3\n[tasks]\nfamily = "vault"\n'
        'options = { depths = [6, 8], delay_median_s = 0.1 }\n'
        '[[learner.sft.stages]]\nfamily = "arith"\nsteps = 5\n'
        '[pipeline]\nmode = "inflight"\nkv = "retain"\n')
    variant = tmp_path / "variant.toml"
    variant.write_text('extends = "base/long.toml"\n[run]\nname = "sync"\n'
                       '[tasks]\noptions = { depths = [6] }\n[pipeline]\nmode = "sync"\n')
    job = load_config(variant, ["run.seed=4"])
    assert (job.run.name, job.run.seed, job.tasks.family) == ("sync", 4, "vault")
    assert job.tasks.options == {"depths": [6], "delay_median_s": 0.1}  # merged key by key
    assert job.pipeline.mode == "sync" and job.learner.sft.stages[0].family == "arith"
    chained = tmp_path / "chained.toml"
    chained.write_text('extends = "variant.toml"\n[pipeline]\nsteps = 3\n')
    assert load_config(chained).pipeline.mode == "sync" and load_config(chained).pipeline.steps == 3


def test_extends_errors_name_the_file_and_the_fix(tmp_path):
    loop_a, loop_b = tmp_path / "a.toml", tmp_path / "b.toml"
    loop_a.write_text('extends = "b.toml"\n')
    loop_b.write_text('extends = "a.toml"\n')
    with pytest.raises(ConfigError, match="in a loop"):
        load_config(loop_a)
    missing = tmp_path / "m.toml"
    missing.write_text('extends = "nowhere.toml"\n')
    with pytest.raises(ConfigError, match="does not exist .the path is relative to"):
        load_config(missing)
    wrong = tmp_path / "w.toml"
    wrong.write_text("extends = 3\n")
    with pytest.raises(ConfigError, match="as a string"):
        load_config(wrong)


def test_run_seed_seeds_every_process_unless_a_section_sets_its_own():
    job = parse_config({"run": {"seed": 3}})
    assert (job.learner.seed, job.learner.sft.seed, job.engine.seed) == (3, 3, 3)
    own = parse_config({"run": {"seed": 3}, "learner": {"sft": {"seed": 7}},
                        "engine": {"seed": 5}})
    assert (own.learner.seed, own.learner.sft.seed, own.engine.seed) == (3, 7, 5)
    learner_only = parse_config({"run": {"seed": 3}, "learner": {"seed": 4}})
    assert (learner_only.learner.seed, learner_only.learner.sft.seed) == (4, 4)
    assert parse_config({}).learner.seed == 0


def test_a_new_run_seed_reseeds_what_was_derived_from_it_and_nothing_else():
    """`with_seed` is what `stalewise run --seeds` and `compare` use for each seed: the same as
    `--set run.seed=N` on the command line, however the job was copied in between."""
    from config.job import with_seed
    from orchestrator.comparison import prepare

    derived = with_seed(parse_config({"run": {"seed": 3}}), 8)
    assert (derived.run.seed, derived.learner.seed, derived.learner.sft.seed,
            derived.engine.seed) == (8, 8, 8, 8)
    own = with_seed(parse_config({"run": {"seed": 3}, "learner": {"sft": {"seed": 7}},
                                  "engine": {"seed": 5}}), 8)
    assert (own.learner.seed, own.learner.sft.seed, own.engine.seed) == (8, 7, 5)
    copied = prepare(parse_config({"engine": {"seed": 5}}), "label", 2, None, Path("/tmp/out"))
    assert (copied.run.seed, copied.learner.seed, copied.learner.sft.seed,
            copied.engine.seed) == (2, 2, 2, 5)
