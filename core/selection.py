"""Selection-bias weights: undo, on average, what an admission rule does to the training mix.

Admission (stale drops, timeouts, dynamic sampling) keeps some trajectories and not others, and
the ones it keeps are not a random sample: slow trajectories are dropped more often, and slow
ones come from hard tasks. The bias ledger measures the shift; these weights correct it.

Every finished trajectory falls in a bucket, (family, difficulty, duration quartile), with the
quartile cut points taken over the same trajectories. With g_b generated and a_b admitted in
bucket b, G and A in all, the admission rate of the bucket is estimated as

    p_b = (a_b + s * A / G) / (g_b + s)          (s = `prior`: shrinkage toward the mean rate)

and an admitted trajectory of bucket b gets the weight

    w_b = clip((A / G) / p_b, 1 / clip, clip).

Without shrinkage or clipping, sum_b a_b w_b / A = 1 and the admitted mix weighted by w equals
the generated one exactly; the learner multiplies each trajectory's advantage by its weight,
which turns its average over admitted work into an inverse-propensity estimate of the average
over generated work (Horvitz-Thompson, with the propensity estimated per bucket). The
correction is exact when, inside a bucket, being admitted does not depend on the trajectory's
gradient; the finer the buckets, the closer to that. A bucket nothing was admitted from cannot
be corrected (its weight would be infinite); `clip` bounds what one trajectory may count for.

Guarantees: pure functions of their inputs; no imports of ours, no torch.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

Bucket = tuple[Hashable, int]  # (task key such as (family, difficulty), duration quartile)

DEFAULT_CLIP = 5.0
DEFAULT_PRIOR = 2.0


@dataclass(frozen=True)
class Finished:
    """One finished trajectory as the weights see it."""

    key: Hashable  # what the task says about itself: (family, difficulty) in a job
    duration_s: float
    admitted: bool  # reached the learner's loss


def quartile_cuts(durations: Sequence[float], bins: int = 4) -> list[float]:
    """The bins - 1 cut points splitting durations into equally populated bins (4: the ledger's
    quartiles)."""
    ordered = sorted(durations)
    if not ordered:
        return []
    return [ordered[min(len(ordered) - 1, int(len(ordered) * i / bins))] for i in range(1, bins)]


def quartile(duration: float, cuts: Sequence[float]) -> int:
    """0..3: how many cut points the duration lies above."""
    return bisect_left(list(cuts), duration)


def buckets(items: Sequence[Finished]) -> list[Bucket]:
    cuts = quartile_cuts([f.duration_s for f in items])
    return [(f.key, quartile(f.duration_s, cuts)) for f in items]


def bucket_weights(generated: Counter, admitted: Counter, *, clip: float = DEFAULT_CLIP,
                   prior: float = DEFAULT_PRIOR) -> dict[Hashable, float]:
    """w_b for every bucket with an admission (module docstring)."""
    if clip < 1.0:
        raise ValueError(f"clip must be >= 1 (the largest weight one trajectory may get), "
                         f"got {clip}")
    if prior < 0.0:
        raise ValueError(f"prior must be >= 0 (pseudo-counts of the mean rate), got {prior}")
    total_generated, total_admitted = sum(generated.values()), sum(admitted.values())
    if not total_admitted:
        return {}
    rate = total_admitted / total_generated
    weights = {}
    for bucket, count in admitted.items():
        if not count:
            continue
        p = (count + prior * rate) / (generated[bucket] + prior)
        weights[bucket] = min(clip, max(1.0 / clip, rate / p))
    return weights


def beyond_weights_share(generated: Counter, admitted: Counter, *,
                         clip: float = DEFAULT_CLIP) -> float:
    """The share of generated work in buckets no weight within `clip` can restore: those
    nothing was admitted from, and those admitted at under 1/clip of the mean rate (a full
    correction would take a weight above `clip`). Rates are the raw counts' (no shrinkage,
    which would only raise the weights wanted), so this is a lower bound for the weights'
    own table. 0 when every bucket keeps enough of its work; 1 when nothing was admitted."""
    total_generated, total_admitted = sum(generated.values()), sum(admitted.values())
    if not total_generated:
        return 0.0
    floor = total_admitted / total_generated / clip
    beyond = sum(count for bucket, count in generated.items()
                 if not admitted[bucket] or admitted[bucket] < floor * count)
    return beyond / total_generated


def propensity_weights(items: Sequence[Finished], *, clip: float = DEFAULT_CLIP,
                       prior: float = DEFAULT_PRIOR) -> list[float]:
    """One weight per item: its bucket's w_b where admitted, 0 where not."""
    keys = buckets(items)
    generated = Counter(keys)
    admitted = Counter(k for k, f in zip(keys, items) if f.admitted)
    table = bucket_weights(generated, admitted, clip=clip, prior=prior)
    return [table[k] if f.admitted else 0.0 for k, f in zip(keys, items)]


def weighted_tv(generated: Sequence[Hashable], admitted: Sequence[Hashable],
                weights: Sequence[float] | None = None) -> float:
    """Total-variation distance between the generated mix and the (weighted) admitted mix."""
    weights = [1.0] * len(admitted) if weights is None else list(weights)
    if len(weights) != len(admitted):
        raise ValueError(f"{len(weights)} weights for {len(admitted)} admitted items")
    total_generated, total_weight = len(generated), sum(weights)
    if not total_generated or total_weight <= 0:
        return 0.0
    p = Counter(generated)
    q: Counter = Counter()
    for key, w in zip(admitted, weights):
        q[key] += w
    return 0.5 * sum(abs(p[k] / total_generated - q[k] / total_weight) for k in set(p) | set(q))


class OnlineWeights:
    """The job's weights, estimated from a sliding window of the trajectories finished so far.

    `observe` every decided trajectory (admitted or not); `weights` gives admitted ones their
    buckets' weights over the window, themselves included (observe them first). Trajectories
    still running are not in the window yet, so the first weights lean toward the fast ones;
    the window (default 4,096 trajectories) lets the estimate follow a policy whose durations
    change as it trains.
    """

    def __init__(self, *, clip: float = DEFAULT_CLIP, prior: float = DEFAULT_PRIOR,
                 window: int = 4096, bins: int = 4) -> None:
        if window < 8:
            raise ValueError(f"window must hold at least 8 trajectories, got {window}")
        self.clip, self.prior, self.window, self.bins = clip, prior, window, bins
        self._items: list[Finished] = []

    def observe(self, item: Finished) -> None:
        self._items.append(item)
        if len(self._items) > self.window:
            del self._items[: len(self._items) - self.window]

    def weights(self, finished: Sequence[tuple[Hashable, float]]) -> list[float]:
        """The weight of each (key, duration) of admitted trajectories, over the window (one
        table for the lot: a group's members are weighted together)."""
        cuts = quartile_cuts([f.duration_s for f in self._items], self.bins)
        keys = [(f.key, quartile(f.duration_s, cuts)) for f in self._items]
        generated = Counter(keys)
        admitted = Counter(k for k, f in zip(keys, self._items) if f.admitted)
        table = bucket_weights(generated, admitted, clip=self.clip, prior=self.prior)
        return [table.get((key, quartile(duration, cuts)), 1.0) for key, duration in finished]

    def skew(self, last: int | None = None) -> tuple[float, float]:
        """(key TV, duration-quartile TV) between the generated and the admitted mix of the
        latest `last` trajectories of the window (all of it by default): what pacing holds
        within its bound."""
        items = self._items[-last:] if last else self._items
        cuts = quartile_cuts([f.duration_s for f in items])
        admitted = [f for f in items if f.admitted]
        return (weighted_tv([f.key for f in items], [f.key for f in admitted]),
                weighted_tv([quartile(f.duration_s, cuts) for f in items],
                            [quartile(f.duration_s, cuts) for f in admitted]))

    def __len__(self) -> int:
        return len(self._items)
