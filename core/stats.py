"""Intervals for success rates: Wilson for one proportion, Newcombe for a difference of two.

Both are closed-form score intervals (no resampling), accurate at the sample sizes and
success rates held-out evaluations have (tens to hundreds of instances, rates near 0 or 1
included), where the normal approximation is too narrow. Guarantees: every bound lies in
[0, 1] for one proportion and in [-1, 1] for a difference; the point estimate lies inside its
interval; `n == 0` raises instead of inventing an interval.

The difference interval treats the two samples as independent. A before/after evaluation on
the same instances is paired; when the two outcomes of one instance are positively correlated
(the usual case), the independent interval is wider than a paired one, so "excludes zero"
stays a conservative claim.
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
