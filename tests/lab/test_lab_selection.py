"""The selection lab (issue 31): a stale drop biases the gradient; propensity weights remove the
bias at a variance cost; pacing trades throughput. Margins are the lab's standard errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from labtest_support import lab_config, one_thread  # noqa: F401 (fixture)
from typer.testing import CliRunner

from lab.selection import admit_probability, run_selection_lab
from stalewise.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")


def test_admit_probability_is_the_poisson_cdf():
    d = torch.tensor([0.0, 0.5, 1.0, 3.0], dtype=torch.float64)
    assert torch.allclose(admit_probability(d, 1.0, 0), torch.exp(-d))
    lam = d / 2.0
    expected = torch.exp(-lam) * (1 + lam + lam**2 / 2)
    assert torch.allclose(admit_probability(d, 2.0, 2), expected)
    assert bool((admit_probability(d, 1.0, 1).diff() < 0).all())


def test_rows_show_the_bias_and_its_correction():
    cfg = lab_config(selection={"replicates": 8000})
    rows = {r["correction"]: r for r in run_selection_lab(cfg)}
    assert list(rows) == ["no_admission", "none", "propensity", "pacing"]
    reference, none, propensity, pacing = (rows[k] for k in rows)
    # the reference keeps everything: no bias beyond noise
    assert abs(reference["bias_z"]) < 3 and reference["admitted_frac"] == 1.0
    # the stale drop keeps about half, skews the mix and biases the gradient
    assert 0.3 < none["admitted_frac"] < 0.8
    assert none["duration_tv"] > 0.1
    assert none["bias_z"] > 5 and none["bias"] > 5 * none["bias_se"]
    # propensity weights: the weighted mix matches, the bias is within noise, variance costs
    assert propensity["duration_tv"] < 0.02 and propensity["prompt_tv"] < 0.02
    assert abs(propensity["bias_z"]) < 3 and propensity["bias"] < 3 * propensity["bias_se"]
    assert propensity["variance"] > none["variance"]
    # pacing: the mix within its bound, paid for in learner steps per unit time
    assert max(pacing["duration_tv"], pacing["prompt_tv"]) <= 0.02
    assert pacing["throughput"] < 1.0
    assert all(math.isfinite(r["mse"]) for r in rows.values())


def test_cli_writes_the_rows(tmp_path):
    config = tmp_path / "lab.toml"
    config.write_text('output_dir = "out"\n[selection]\nreplicates = 300\n')
    out = tmp_path / "sel.json"
    result = CliRunner().invoke(app, ["lab", "selection", str(config), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "propensity" in result.output and "bias_z" in result.output
    rows = json.loads(out.read_text())
    assert [r["correction"] for r in rows] == ["no_admission", "none", "propensity", "pacing"]


def test_bad_selection_config_is_refused(tmp_path):
    config = tmp_path / "lab.toml"
    config.write_text('[selection]\nadvantage = "rloo"\n')
    result = CliRunner().invoke(app, ["lab", "selection", str(config)])
    assert result.exit_code == 2
    assert "group_size >= 2" in result.output
