"""Wilson and Newcombe intervals against published values and their coverage."""

from __future__ import annotations

import random

import pytest

from core.stats import newcombe_difference, newcombe_paired_difference, wilson


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


def test_paired_newcombe_matches_published_values():
    # Fagerland, Lydersen and Laake (2017), Statistical Analysis of Contingency Tables, chapter
    # 8: complete response before and after consolidation therapy (Cavo et al., 2012), 59 both,
    # 6 only before, 16 only after, 80 neither; the Newcombe square-and-add interval of
    # p(before) - p(after) is -0.1186 to -0.0046.
    interval = newcombe_paired_difference(59, 6, 16, 80)
    assert interval.estimate == pytest.approx(-10 / 161)
    assert interval.low == pytest.approx(-0.1186, abs=5e-5)
    assert interval.high == pytest.approx(-0.0046, abs=5e-5)
    # uncorrelated outcomes (ad == bc): the independent interval on the same margins
    assert newcombe_paired_difference(10, 10, 10, 10) == newcombe_difference(20, 40, 20, 40)


def test_paired_newcombe_covers_and_is_narrower_than_the_independent_interval():
    # before solved with p 0.35; after RL a solved instance stays solved with p 0.9 and an
    # unsolved one becomes solved with p 0.3: p(after) 0.51, a gain of 0.16, correlated pairs
    rng = random.Random(11)
    hits = narrower = 0
    for _ in range(2000):
        counts = {(True, True): 0, (False, True): 0, (True, False): 0, (False, False): 0}
        for _ in range(128):
            before = rng.random() < 0.35
            counts[before, rng.random() < (0.9 if before else 0.3)] += 1
        both, only_after = counts[True, True], counts[False, True]
        only_before, neither = counts[True, False], counts[False, False]
        paired = newcombe_paired_difference(both, only_after, only_before, neither)
        independent = newcombe_difference(both + only_before, 128, both + only_after, 128)
        assert paired.estimate == pytest.approx(independent.estimate)
        hits += paired.low <= 0.16 <= paired.high
        narrower += paired.high - paired.low < independent.high - independent.low
    assert 0.93 <= hits / 2000 <= 0.98
    assert narrower == 2000


def test_bad_counts_say_what_is_wrong():
    with pytest.raises(ValueError, match="n >= 1"):
        wilson(0, 0)
    with pytest.raises(ValueError, match="successes"):
        wilson(5, 3)
    with pytest.raises(ValueError, match="paired counts"):
        newcombe_paired_difference(3, -1, 2, 4)


def test_welch_p_values_match_scipy_and_holm_keeps_the_family_wise_rate():
    import statistics

    from scipy import stats

    from core.stats import holm, welch_p_value

    rng = random.Random(7)
    for _ in range(300):
        xs = [rng.gauss(0.8, 0.03) for _ in range(rng.randint(2, 6))]
        ys = [rng.gauss(0.82, rng.uniform(0.001, 0.1)) for _ in range(rng.randint(2, 6))]
        t, _, p = welch_p_value(statistics.mean(xs), statistics.stdev(xs), len(xs),
                                statistics.mean(ys), statistics.stdev(ys), len(ys))
        reference = stats.ttest_ind(xs, ys, equal_var=False)
        assert t == pytest.approx(reference.statistic, rel=1e-9)
        assert p == pytest.approx(reference.pvalue, rel=1e-7, abs=1e-12)
    assert welch_p_value(0.5, 0.0, 3, 0.5, 0.0, 3)[2] == 1.0
    assert welch_p_value(0.6, 0.0, 3, 0.5, 0.0, 3)[2] == 0.0
    with pytest.raises(ValueError, match="two or more"):
        welch_p_value(0.5, 0.1, 1, 0.4, 0.1, 3)
    # Holm: 0.01 < 0.05/3 is rejected, then 0.02 < 0.05/2 is, then 0.04 < 0.05 is
    assert holm([0.04, 0.01, 0.02]) == [True, True, True]
    # the step-down stops at the first that fails: 0.03 > 0.05/2, so 0.04 stays too
    assert holm([0.01, 0.03, 0.04]) == [True, False, False]
    # twenty null pairs: any false rejection in at most 5% of families
    false_families = sum(any(holm([rng.random() for _ in range(20)])) for _ in range(4000))
    assert false_families / 4000 < 0.06
