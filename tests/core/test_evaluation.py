"""Paired before/after outcomes per test instance, and the paired interval of the gain."""

from __future__ import annotations

import pytest

from core.evaluation import gain_figures, paired_outcomes


def test_paired_outcomes_count_each_instance_once_and_give_a_tighter_interval():
    # 40 instances: 12 solved by both, 14 only after RL, 2 only before, 12 by neither; None is
    # a trajectory without a reward (an infrastructure failure), counted as unsolved.
    before, after = {}, {}
    for index in range(40):
        key = f"story/test/{index}"
        before[key] = 1.0 if index < 12 or 26 <= index < 28 else (None if index == 39 else 0.0)
        after[key] = 1.0 if index < 26 else 0.0
    after["story/test/extra"] = 1.0  # ran only after RL: not a pair
    paired = paired_outcomes(before, after)
    assert (paired["instances"], paired["both"], paired["only_after"], paired["only_before"],
            paired["neither"]) == (40, 12, 14, 2, 12)
    assert paired["gain_low"] < 12 / 40 < paired["gain_high"]
    assert paired["gain_excludes_zero"]
    assert paired["gain"].startswith("30.0% [")
    independent = gain_figures((14, 40), (26, 40))
    assert independent["gain_low"] < paired["gain_low"]
    assert paired["gain_high"] < independent["gain_high"]


def test_no_common_instance_gives_counts_without_an_interval():
    paired = paired_outcomes({"a": 1.0}, {"b": 0.0})
    assert paired == {"instances": 0, "both": 0, "only_after": 0, "only_before": 0,
                      "neither": 0}
    with pytest.raises(KeyError):
        paired["gain"]
