"""The lab's config and commands: the shipped config parses, errors say how to fix them, and
both quick commands finish in time and write their table, JSON and plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from config.errors import ConfigError
from lab.config import load_lab_config, parse_lab_config
from lab.estimator_spec import PRESETS
from stalewise.cli import app

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs" / "lab.toml"


def test_shipped_config_parses_and_quick_overrides_apply():
    cfg = load_lab_config(SHIPPED)
    assert set(cfg.estimators.presets) == set(PRESETS)
    quick = cfg.quick()
    assert quick.estimators.horizons == [4, 16, 64] and quick.estimators.replicates == 200
    assert all(len(m.levels) <= 2 for m in quick.estimators.mismatch)
    assert quick.learning.updates == 50 and quick.learning.seeds == 2
    assert cfg.estimators.mismatch == load_lab_config(SHIPPED).estimators.mismatch


@pytest.mark.parametrize("data,fragments", [
    ({"policy": {"vocab_sise": 8}}, ["policy.vocab_sise", "did you mean 'vocab_size'"]),
    ({"estimators": {"mismatch": [{"kind": "stalee", "levels": [1]}]}},
     ["estimators.mismatch[0].kind", "'stale'"]),
    ({"estimators": {"presets": ["token_tiss"]}}, ["estimators.presets", "token_tis"]),
    ({"estimators": {"batch_size": 10, "group_size": 4}}, ["batch_size (10)", "multiple"]),
    ({"reward": {"prompt_scale": [1.0]}}, ["prompt_scale", "one per prompt"]),
    ({"estimators": {"mismatch": [{"kind": "top_k", "levels": [2.5]}]}},
     ["mismatch[0].levels", "whole numbers"]),
    ({"learning": {"modes": [{"name": "sync", "max_lag": 2}]}}, ["sync", "remove max_lag"]),
    ({"estimators": {"custom": {"mine": {"loss": {"correction": "tis"}}}}},
     ["correction_high"]),
    ({"learning": {"optimizer": "rmsprop"}}, ["learning.optimizer", "'adam'"]),
])
def test_config_errors_name_the_field_and_the_fix(data, fragments):
    with pytest.raises(ConfigError) as info:
        parse_lab_config(data, "lab.toml")
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message


def test_custom_estimators_are_usable_by_name():
    cfg = parse_lab_config({"estimators": {
        "presets": ["mine"],
        "custom": {"mine": {"advantage": "dr_grpo", "proximal": "sampler",
                            "loss": {"surrogate": "cispo", "cispo_high": 3.0}}}},
        "learning": {"presets": ["mine", "rloo"]}})
    assert cfg.estimators.custom["mine"].loss.cispo_high == 3.0


def test_bad_config_exits_2_with_one_line_per_problem(tmp_path):
    bad = tmp_path / "lab.toml"
    bad.write_text('[policy]\nvocab_size = 1\n[learning]\noptimizer = "rms"\n')
    result = CliRunner().invoke(app, ["lab", "estimators", str(bad)])
    assert result.exit_code == 2
    assert "policy.vocab_size" in result.output and "learning.optimizer" in result.output
    missing = CliRunner().invoke(app, ["lab", "learning", str(tmp_path / "nope.toml")])
    assert missing.exit_code == 2 and "file not found" in missing.output


HANG_GUARD_S = 900  # only stops a hung command; how long --quick takes is the CLI's printout


def _run_cli(args: list[str]) -> str:
    done = subprocess.run([sys.executable, "-m", "stalewise", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _smaller_quick(tmp_path: Path) -> Path:
    """The shipped config with a smaller `--quick` (these tests check what the commands write,
    not the figures; the shipped quick run takes about a minute each on 2 cores)."""
    text = SHIPPED.read_text()
    for old, new in (("horizons = [4, 16, 64]\nreplicates = 200", "horizons = [4, 8]\nreplicates = 30"),
                     ("updates = 50\nseeds = 2", "updates = 10\nseeds = 2")):
        assert old in text, f"configs/lab.toml's quick section changed: update {old!r} here"
        text = text.replace(old, new)
    (tmp_path / "lab.toml").write_text(text)
    return tmp_path / "lab.toml"


def _png(path: Path) -> bool:
    return path.stat().st_size > 10_000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quick_estimators_command_writes_table_json_and_plots(tmp_path):
    out = tmp_path / "out"
    config = _smaller_quick(tmp_path)
    stdout = _run_cli(["lab", "estimators", str(config), "--quick", "--json",
                       str(tmp_path / "rows.json"), "--out-dir", str(out)])
    rows = json.loads((tmp_path / "rows.json").read_text())
    cfg = load_lab_config(config).quick()
    cells = sum(len(m.levels) for m in cfg.estimators.mismatch) * len(cfg.estimators.horizons)
    assert len(rows) == cells * len(cfg.estimators.presets)
    for key in ("estimator", "T", "mismatch", "level", "bias", "bias_se", "variance", "mse",
                "cosine"):
        assert all(key in row for row in rows), key
    assert {row["estimator"] for row in rows} == set(cfg.estimators.presets)
    header = stdout.splitlines()[0].split()
    assert header[:4] == ["estimator", "T", "mismatch", "level"] and len(stdout.splitlines()) > len(rows)
    for name in ("bias_variance.png", "vs_T.png", "vs_level.png"):
        assert _png(out / name), name


@pytest.mark.slow
def test_quick_learning_command_writes_table_json_and_plots(tmp_path):
    config = _smaller_quick(tmp_path)
    stdout = _run_cli(["lab", "learning", str(config), "--quick", "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "learning.json").read_text())
    cfg = load_lab_config(config).quick()
    setups = len(cfg.learning.modes) * len(cfg.learning.presets)
    assert len(data["setups"]) == setups
    assert len(data["curves"]) == setups * cfg.learning.seeds
    assert data["target"] > data["initial_return"]
    assert "time_to_target" in stdout and "target J" in stdout
    for name in ("learning_time.png", "learning_updates.png"):
        assert _png(tmp_path / name), name
