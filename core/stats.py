"""Intervals for success rates: Wilson for one proportion, Newcombe for a difference of two
(independent samples, or two outcomes of the same instances).

Both are closed-form score intervals (no resampling), accurate at the sample sizes and
success rates held-out evaluations have (tens to hundreds of instances, rates near 0 or 1
included), where the normal approximation is too narrow. Guarantees: every bound lies in
[0, 1] for one proportion and in [-1, 1] for a difference; the point estimate lies inside its
interval; `n == 0` raises instead of inventing an interval.

`newcombe_difference` treats the two samples as independent. A before/after evaluation on
the same instances is paired; when the two outcomes of one instance are positively correlated
(the usual case), the independent interval is wider than the paired one
(`newcombe_paired_difference`), so its "excludes zero" is the conservative claim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z95 = 1.959963984540054  # two-sided 95% standard normal quantile


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float

    def excludes_zero(self) -> bool:
        return self.low > 0.0 or self.high < 0.0

    def percent(self) -> str:
        """`12.3% [4.5%, 20.1%]`, the form summaries print."""
        return f"{100 * self.estimate:.1f}% [{100 * self.low:.1f}%, {100 * self.high:.1f}%]"


def wilson(successes: int, n: int, z: float = Z95) -> Interval:
    """Wilson score interval of a proportion `successes / n`."""
    if n <= 0:
        raise ValueError(f"a proportion needs n >= 1 trials, got n = {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in 0..n = {n}, got {successes}")
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half))


def newcombe_difference(successes_a: int, n_a: int, successes_b: int, n_b: int,
                        z: float = Z95) -> Interval:
    """Interval of p_b - p_a (for example after minus before), Newcombe's hybrid score method
    (his method 10): each side combines the two Wilson intervals' distances."""
    a, b = wilson(successes_a, n_a, z), wilson(successes_b, n_b, z)
    difference = b.estimate - a.estimate
    low = difference - math.sqrt((b.estimate - b.low) ** 2 + (a.high - a.estimate) ** 2)
    high = difference + math.sqrt((b.high - b.estimate) ** 2 + (a.estimate - a.low) ** 2)
    return Interval(difference, max(-1.0, low), min(1.0, high))


def newcombe_paired_difference(both: int, only_b: int, only_a: int, neither: int,
                               z: float = Z95) -> Interval:
    """Interval of p_b - p_a for two outcomes of the same instances (for example solved after
    and before RL, each test instance drawn with the same seeds), from the paired counts:
    Newcombe's paired method 10. It combines the Wilson intervals of the two rates as the
    independent method does, less twice their product times the outcomes' correlation (phi of
    the 2x2 table; a positive one lowered by n/2 first, his continuity correction). Where no
    instance changed outcome the interval is narrow but not empty of doubt: the Wilson widths
    remain."""
    counts = (both, only_b, only_a, neither)
    if min(counts) < 0:
        raise ValueError(f"paired counts must be >= 0, got {counts}")
    n = sum(counts)
    a, b = wilson(both + only_a, n, z), wilson(both + only_b, n, z)
    difference = b.estimate - a.estimate
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    cross = both * neither - only_a * only_b
    if margins == 0:
        phi = 0.0
    else:
        phi = (cross if cross <= 0 else max(cross - n / 2, 0.0)) / math.sqrt(margins)
    below_b, above_a = b.estimate - b.low, a.high - a.estimate
    above_b, below_a = b.high - b.estimate, a.estimate - a.low
    low = difference - math.sqrt(max(0.0, below_b ** 2 - 2 * phi * below_b * above_a
                                     + above_a ** 2))
    high = difference + math.sqrt(max(0.0, above_b ** 2 - 2 * phi * above_b * below_a
                                      + below_a ** 2))
    return Interval(difference, max(-1.0, low), min(1.0, high))


def welch_p_value(mean_a: float, sd_a: float, n_a: int, mean_b: float, sd_b: float,
                  n_b: int) -> tuple[float, float, float]:
    """(t, degrees of freedom, two-sided p) of Welch's t-test that two means differ, from each
    sample's mean, standard deviation and size (two or more each). Where both spreads are zero
    the p-value is 0 for different means and 1 for equal ones."""
    if n_a < 2 or n_b < 2:
        raise ValueError(f"Welch's test needs two or more values a side, got {n_a} and {n_b}")
    va, vb = sd_a * sd_a / n_a, sd_b * sd_b / n_b
    if va + vb == 0.0:
        return (math.inf if mean_a != mean_b else 0.0), math.inf, float(mean_a == mean_b)
    t = (mean_a - mean_b) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va * va / (n_a - 1) + vb * vb / (n_b - 1))
    # P(|T| > t) for Student's t with df degrees of freedom is I_x(df/2, 1/2), x = df/(df+t^2)
    return t, df, _incomplete_beta(df / (df + t * t), df / 2, 0.5)


def holm(p_values: list[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down procedure: which of the hypotheses to reject while keeping the chance
    of any false rejection among all of them at most `alpha`."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    rejected = [False] * len(p_values)
    for rank, i in enumerate(order):
        if p_values[i] > alpha / (len(p_values) - rank):
            break
        rejected[i] = True
    return rejected


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularised incomplete beta function I_x(a, b), by its continued fraction
    (modified Lentz), on the side of x where the fraction converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _incomplete_beta(1.0 - x, b, a)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-14:
            break
    return front * fraction
