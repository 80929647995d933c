"""core.selection: the propensity weights that undo admission's selection, on known mixes."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from core.selection import (
    Finished,
    OnlineWeights,
    beyond_weights_share,
    bucket_weights,
    buckets,
    propensity_weights,
    quartile,
    quartile_cuts,
    weighted_tv,
)


def test_quartiles_match_the_ledger_rule():
    cuts = quartile_cuts([float(i) for i in range(1, 101)])
    assert cuts == [26.0, 51.0, 76.0]
    assert [quartile(d, cuts) for d in (1.0, 26.0, 26.5, 51.0, 99.0)] == [0, 0, 1, 1, 3]
    assert quartile_cuts([]) == []


def test_unclipped_weights_restore_the_generated_mix_exactly():
    # bucket a: 100 generated, 80 admitted; bucket b: 100 generated, 20 admitted
    generated = Counter({"a": 100, "b": 100})
    admitted = Counter({"a": 80, "b": 20})
    w = bucket_weights(generated, admitted, clip=100.0, prior=0.0)
    assert w["a"] == pytest.approx(0.5 / 0.8)
    assert w["b"] == pytest.approx(0.5 / 0.2)
    # the admitted mix, weighted, is 50/50 like the generated one, and the weights average 1
    assert 80 * w["a"] == pytest.approx(20 * w["b"])
    assert (80 * w["a"] + 20 * w["b"]) / 100 == pytest.approx(1.0)
    assert weighted_tv(["a"] * 100 + ["b"] * 100, ["a"] * 80 + ["b"] * 20) == pytest.approx(0.3)
    assert weighted_tv(["a"] * 100 + ["b"] * 100, ["a"] * 80 + ["b"] * 20,
                       [w["a"]] * 80 + [w["b"]] * 20) == pytest.approx(0.0, abs=1e-12)


def test_clip_and_prior_bound_the_weights():
    generated = Counter({"rare": 50, "common": 950})
    admitted = Counter({"rare": 1, "common": 949})
    raw = bucket_weights(generated, admitted, clip=1000.0, prior=0.0)
    assert raw["rare"] > 40  # 0.95 / 0.02
    assert bucket_weights(generated, admitted, clip=5.0, prior=0.0)["rare"] == 5.0
    shrunk = bucket_weights(generated, admitted, clip=1000.0, prior=10.0)
    assert 1.0 < shrunk["rare"] < raw["rare"]
    with pytest.raises(ValueError, match="clip must be >= 1"):
        bucket_weights(generated, admitted, clip=0.5)
    assert bucket_weights(Counter({"a": 3}), Counter()) == {}


def test_beyond_weights_share_is_the_work_no_clipped_weight_can_restore():
    """A bucket that kept nothing, or under 1/clip of the mean admitted rate, is beyond the
    weights; one that kept enough is not, however skewed the unweighted mix."""
    generated = Counter({"fast": 600, "slow": 300, "slowest": 100})
    # mean rate 0.5: at clip 5 a bucket needs a rate of at least 0.1
    admitted = Counter({"fast": 460, "slow": 40, "slowest": 0})
    assert beyond_weights_share(generated, admitted, clip=5.0) == pytest.approx(0.1)
    # the slow bucket keeps 0.133: above the floor at clip 4 (0.125), under it at clip 3 (0.167)
    assert beyond_weights_share(generated, admitted, clip=4.0) == pytest.approx(0.1)
    assert beyond_weights_share(generated, admitted, clip=3.0) == pytest.approx(0.4)
    # where the weights can restore every bucket, nothing is beyond them
    kept_some = Counter({"fast": 400, "slow": 80, "slowest": 20})
    assert beyond_weights_share(generated, kept_some, clip=5.0) == 0.0
    w = bucket_weights(generated, kept_some, clip=5.0, prior=0.0)
    assert max(w.values()) <= 5.0 and w["slowest"] == pytest.approx(0.5 / 0.2)
    # nothing admitted: all of it; nothing generated: nothing
    assert beyond_weights_share(generated, Counter(), clip=5.0) == 1.0
    assert beyond_weights_share(Counter(), Counter()) == 0.0


def test_propensity_weights_put_slow_work_back():
    """Slow trajectories admitted a quarter as often as fast ones come back with 4x the weight."""
    rng = random.Random(0)
    items = []
    for _ in range(4000):
        duration = rng.expovariate(1.0)
        admit = rng.random() < (0.8 if duration < 0.7 else 0.2)
        items.append(Finished(("arith", "easy"), duration, admit))
    weights = propensity_weights(items, clip=100.0, prior=0.0)
    assert all(w == 0.0 for w, f in zip(weights, items) if not f.admitted)
    keys = buckets(items)
    admitted_keys = [k for k, f in zip(keys, items) if f.admitted]
    admitted_weights = [w for w, f in zip(weights, items) if f.admitted]
    assert weighted_tv(keys, admitted_keys) > 0.15
    assert weighted_tv(keys, admitted_keys, admitted_weights) < 1e-9


def test_online_weights_follow_a_window():
    online = OnlineWeights(clip=100.0, prior=0.0, window=400)
    for i in range(400):  # fast ones always admitted, slow ones half the time
        online.observe(Finished("k", 1.0 + i % 4, i % 4 < 2 or i % 8 in (2, 3)))
    fast, slow = online.weights([("k", 1.0), ("k", 4.0)])
    assert slow == pytest.approx(2 * fast)
    for i in range(400):  # the window forgets: now everything is admitted
        online.observe(Finished("k", 1.0 + i % 4, True))
    assert len(online) == 400
    assert online.weights([("k", 1.0), ("k", 4.0)]) == pytest.approx([1.0, 1.0])
    assert online.weights([("unseen", 1.0)]) == [1.0]
    with pytest.raises(ValueError, match="window"):
        OnlineWeights(window=2)
