"""The bias ledger counts selection exactly and its skew figures respond to selection."""

from __future__ import annotations


import pytest

from core.selection import weighted_tv
from orchestrator.ledger import Generated, build_ledger


def g(difficulty, duration, reward, admitted, reason="fresh", tokens=10, family="arith",
      weight=1.0):
    return Generated(family, difficulty, duration, reward, tokens, admitted, reason, weight)


def test_no_selection_means_no_skew():
    items = [g("easy", 1.0, 1.0, True), g("hard", 10.0, 0.0, True)]
    rows, skew = build_ledger(items)
    assert skew.difficulty_tv == 0.0 and skew.duration_tv == 0.0 and skew.reward_shift == 0.0
    assert skew.excluded_token_share == 0.0
    easy = next(r for r in rows if r.difficulty == "easy")
    assert (easy.generated, easy.admitted, easy.excluded_by_reason) == (1, 1, {})


def test_dropping_slow_hard_work_is_measured():
    """Duration correlates with difficulty; a timeout drop removes the hard tail."""
    items = ([g("easy", 1.0 + i * 0.01, 1.0, True) for i in range(6)]
             + [g("hard", 50.0 + i, 0.0, False, "timeout_drop", tokens=30) for i in range(3)]
             + [g("hard", 20.0, 1.0, True)])
    rows, skew = build_ledger(items)
    # generated: easy 6/10, hard 4/10; admitted: easy 6/7, hard 1/7
    assert skew.difficulty_tv == pytest.approx(abs(6 / 10 - 6 / 7))
    assert skew.duration_tv > 0
    assert skew.reward_shift == pytest.approx(1.0 - 0.7)
    assert skew.excluded_token_share == pytest.approx(90 / (60 + 90 + 10))
    hard = next(r for r in rows if r.difficulty == "hard")
    assert hard.generated == 4 and hard.admitted == 1
    assert hard.excluded_by_reason == {"timeout_drop": 3}
    assert hard.mean_reward_admitted == 1.0 and hard.mean_reward_excluded == 0.0
    assert hard.mean_duration_excluded == pytest.approx(51.0)
    quartile_rows = [r for r in rows if r.duration_quantile is not None]
    assert sum(r.generated for r in quartile_rows) == len(items)
    top = max(quartile_rows, key=lambda r: r.duration_quantile)
    assert top.admitted < top.generated


def test_total_variation():
    assert weighted_tv(["a", "b"], ["a"]) == pytest.approx(0.5)
    assert weighted_tv(["a"] * 3, ["b"] * 2) == 1.0
    assert weighted_tv([], ["a"]) == 0.0


def test_selection_weights_give_the_weighted_skew():
    """The hard task admitted 1 in 4 and weighted 4x: the weighted mix is the generated one."""
    items = ([g("easy", 1.0, 1.0, True, weight=0.7) for _ in range(6)]
             + [g("hard", 50.0, 0.0, False, "stale_drop") for _ in range(3)]
             + [g("hard", 50.0, 1.0, True, weight=2.8)])
    _, skew = build_ledger(items)
    assert skew.difficulty_tv == pytest.approx(abs(6 / 10 - 6 / 7))
    # weighted admitted: easy 6 x 0.7 = 4.2, hard 2.8: shares 0.6 / 0.4 as generated
    assert skew.weighted_difficulty_tv == pytest.approx(0.0, abs=1e-12)
    unweighted = build_ledger([g("easy", 1.0, 1.0, True), g("hard", 9.0, 0.0, False)])[1]
    assert unweighted.weighted_difficulty_tv == unweighted.difficulty_tv == 0.5


def test_the_ledger_says_how_much_work_is_beyond_the_weights():
    """A hard tail dropped whole cannot be weighted back; one admitted at a quarter can, unless
    the clip is too tight for it."""
    easy = [g("easy", 1.0, 1.0, True) for _ in range(6)]
    whole = build_ledger(easy + [g("hard", 50.0, 0.0, False, "stale_drop") for _ in range(4)])[1]
    assert whole.beyond_weights_share == pytest.approx(0.4)
    quarter = easy + [g("hard", 50.0, 0.0, False, "stale_drop") for _ in range(3)] \
        + [g("hard", 50.0, 1.0, True)]
    # mean rate 0.7, the hard bucket's 0.25: a weight of 2.8 restores it under the clip of 5
    assert build_ledger(quarter)[1].beyond_weights_share == 0.0
    assert build_ledger(quarter, clip=2.0)[1].beyond_weights_share == pytest.approx(0.4)
    assert build_ledger(easy)[1].beyond_weights_share == 0.0


def summary_with_skew(beyond: float) -> dict:
    skew = dict(difficulty_tv=0.2, duration_tv=0.2, weighted_difficulty_tv=0.19,
                weighted_duration_tv=0.2, beyond_weights_share=beyond, excluded_token_share=0.4)
    return {"run_id": "r", "wall_s": 10.0, "learner_steps": 4, "mean_token_lag": 0.5,
            "held_out": True, "admission_reweight": "propensity", "selection_skew": skew,
            "numerics": {"engine_dtype": None, "learner_dtype": "float32", "cpu": "a CPU",
                         "cpu_bf16": []},
            "rollout_dynamics": {"multi_version_fraction": 0.0, "mean_kv_lag": 0,
                                 "max_kv_lag": 0, "timeouts": 0, "timeout_decisions": {}},
            "report": "report.md", "db": "sqlite:///x.db"}


def test_the_summary_says_what_to_change_when_the_weights_cannot_restore_much_work(capsys):
    from config.job import parse_config
    from orchestrator.job import print_summary

    job = parse_config({"admission": {"reweight": "propensity", "reweight_clip": 4.0}})
    print_summary(summary_with_skew(0.2), [], job)
    out = capsys.readouterr().out
    assert "generated work beyond the weights 0.200" in out
    assert ("20% of the generated work is beyond the selection weights: its buckets (family, "
            "difficulty, duration quartile) kept less than 1/4 of the mean admitted rate") in out
    assert "raise pipeline.reserve toward 1" in out and "admission.max_lag" in out
    print_summary(summary_with_skew(0.03), [], job)  # the weights restore nearly everything
    assert "beyond the selection weights" not in capsys.readouterr().out
