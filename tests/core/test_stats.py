"""Wilson and Newcombe intervals against published values and their coverage."""

from __future__ import annotations

import random

import pytest

from core.stats import newcombe_difference, wilson


def test_wilson_matches_published_values():
    # Newcombe (1998), Statistics in Medicine 17, table I: 81/263 -> 0.2553 to 0.3662.
    interval = wilson(81, 263)
    assert interval.low == pytest.approx(0.2553, abs=5e-4)
    assert interval.high == pytest.approx(0.3662, abs=5e-4)
    assert wilson(0, 10).low == 0.0 and wilson(0, 10).high == pytest.approx(0.2775, abs=5e-4)
    assert wilson(10, 10).high == pytest.approx(1.0) and wilson(10, 10).low < 1.0


def test_newcombe_matches_published_values():
    # Newcombe (1998), Statistics in Medicine 17, table II, example (a): 56/70 vs 48/80,
    # method 10 -> 0.0524 to 0.3339 for p1 - p2.
    interval = newcombe_difference(48, 80, 56, 70)
    assert interval.estimate == pytest.approx(0.2)
    assert interval.low == pytest.approx(0.0524, abs=5e-4)
    assert interval.high == pytest.approx(0.3339, abs=5e-4)
    assert interval.excludes_zero()
    assert not newcombe_difference(30, 100, 35, 100).excludes_zero()


def test_newcombe_covers_the_true_difference_about_95_percent_of_the_time():
    rng = random.Random(7)
    hits = 0
    for _ in range(2000):
        a = sum(rng.random() < 0.3 for _ in range(128))
        b = sum(rng.random() < 0.45 for _ in range(128))
        interval = newcombe_difference(a, 128, b, 128)
        hits += interval.low <= 0.15 <= interval.high
    assert 0.93 <= hits / 2000 <= 0.97


def test_bad_counts_say_what_is_wrong():
    with pytest.raises(ValueError, match="n >= 1"):
        wilson(0, 0)
    with pytest.raises(ValueError, match="successes"):
        wilson(5, 3)
