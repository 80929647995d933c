"""The per-turn credit lab (issue 31): the leave-one-out turn baseline is unbiased; z-scoring
rewards per turn index is biased and ignores a per-turn cost, which becomes a length bonus."""

from __future__ import annotations

import pytest
import torch
from labtest_support import lab_config, one_thread  # noqa: F401 (fixture)

from lab.turns import run_turns_lab
from learner.advantages import turn_advantages

pytestmark = pytest.mark.usefixtures("one_thread")


def test_turn_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    loo = turn_advantages(rewards, mask, [0, 0], "leave_one_out")
    # to go: member 0 [3, 2, 2], member 1 [1, 1, 0]; each minus the other's at the same turn
    torch.testing.assert_close(loo, torch.tensor([[2.0, 1.0, 2.0], [-2.0, -1.0, 0.0]],
                                                 dtype=torch.float64))
    normalised = turn_advantages(rewards, mask, [0, 0], "turn_index_normalised")
    assert normalised[0, 2] == 0.0  # alone at turn 2: its reward z-scores to 0
    assert normalised[1, 2] == 0.0  # off the mask
    torch.testing.assert_close(turn_advantages(rewards[:1], mask[:1], [0], "leave_one_out"),
                               torch.zeros(1, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="leave_one_out"):
        turn_advantages(rewards, mask, [0, 0], "per_index")


def test_the_leave_one_out_baseline_is_unbiased_and_normalising_hides_a_turn_cost():
    cfg = lab_config(turns={"replicates": 3000, "turn_means": [0.0, -0.3]})
    rows = {(r["turn_mean"], r["advantage"]): r for r in run_turns_lab(cfg)}
    for mean in (0.0, -0.3):
        outcome, loo = rows[(mean, "outcome")], rows[(mean, "leave_one_out")]
        normalised = rows[(mean, "turn_index_normalised")]
        assert abs(outcome["bias_z"]) < 3 and abs(loo["bias_z"]) < 3
        assert loo["variance"] < outcome["variance"]  # credit where the reward came
        assert normalised["bias_z"] > 5
    # the normalised variant pushes length the same whatever the per-turn cost...
    free, costly = rows[(0.0, "turn_index_normalised")], rows[(-0.3, "turn_index_normalised")]
    assert costly["length_push"] == pytest.approx(free["length_push"], abs=1e-9)
    # ...so where each turn costs, it lengthens responses against the objective
    bonus = costly["length_bonus"]
    assert bonus > 5 * costly["length_push_se"]
    assert abs(rows[(-0.3, "leave_one_out")]["length_bonus"]) < 3 * rows[
        (-0.3, "leave_one_out")]["length_push_se"]


def test_cli_writes_the_turn_rows(tmp_path):
    from typer.testing import CliRunner

    from stalewise.cli import app

    config = tmp_path / "lab.toml"
    config.write_text('output_dir = "out"\n[turns]\nreplicates = 200\nturn_means = [0.0]\n')
    out = tmp_path / "turns.json"
    result = CliRunner().invoke(app, ["lab", "turns", str(config), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "leave_one_out" in result.output and out.exists()
