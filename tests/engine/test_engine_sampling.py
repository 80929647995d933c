"""The sampler draws from the processed distribution and reports its exact log-probs.

Contract: processing is temperature -> top-k -> top-p (over the top-k survivors) -> renormalise;
a recorded log-prob is log P(id) under exactly that distribution; removed ids are never drawn.
Checked against a slow per-row reference written from the definition.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from engine.sampling import processed_logprobs, sample


def reference_processed(logits: list[float], temperature: float, top_k: int, top_p: float,
                        banned: set[int] = frozenset()) -> list[float]:
    """Per-row reference: a direct transcription of the documented processing order."""
    vocab = len(logits)
    if temperature == 0:
        best = max(range(vocab), key=lambda i: (logits[i], -i))
        return [0.0 if i == best else -math.inf for i in range(vocab)]
    scaled = [-math.inf if i in banned else x / temperature for i, x in enumerate(logits)]
    order = sorted(range(vocab), key=lambda i: (-scaled[i], i))
    kept = order[:top_k] if top_k > 0 else order
    m = max(scaled[i] for i in kept)
    z = sum(math.exp(scaled[i] - m) for i in kept)
    if top_p < 1.0:
        nucleus, mass = [], 0.0
        for i in kept:
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += math.exp(scaled[i] - m) / z
        kept = nucleus
    m = max(scaled[i] for i in kept)
    z = sum(math.exp(scaled[i] - m) for i in kept)
    keep = set(kept)
    return [scaled[i] - m - math.log(z) if i in keep else -math.inf for i in range(vocab)]


CASES = [(1.0, 0, 1.0), (0.7, 20, 0.9), (0.7, 0, 0.5), (1.3, 5, 1.0), (0.5, 50, 0.95), (0.0, 0, 1.0)]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_processed_logprobs_match_the_definition(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 64, generator=generator) * 3
    got = processed_logprobs(logits, torch.full((6,), temperature), torch.full((6,), top_k),
                             torch.full((6,), top_p))
    for row in range(6):
        want = reference_processed(logits[row].tolist(), temperature, top_k, top_p)
        for i, w in enumerate(want):
            if w == -math.inf:
                assert got[row, i] == -math.inf, (row, i)
            else:
                assert abs(got[row, i].item() - w) < 1e-5, (row, i, got[row, i].item(), w)


def test_no_processing_keeps_every_token_even_with_tiny_mass():
    logits = torch.tensor([[30.0, 0.0, -30.0, -60.0]])
    got = processed_logprobs(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1))
    assert torch.allclose(got, torch.log_softmax(logits, -1))
    assert torch.isfinite(got).all()


def test_rows_are_processed_with_their_own_settings():
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(3))
    temps, ks, ps = [1.0, 0.6, 0.0], [0, 4, 0], [0.8, 1.0, 1.0]
    got = processed_logprobs(logits, torch.tensor(temps), torch.tensor(ks), torch.tensor(ps))
    for row in range(3):
        want = torch.tensor(reference_processed(logits[row].tolist(), temps[row], ks[row], ps[row]))
        assert torch.equal(torch.isfinite(got[row]), torch.isfinite(want))
        finite = torch.isfinite(want)
        assert torch.allclose(got[row][finite], want[finite].float(), atol=1e-5)


def test_suppressed_ids_are_never_drawn_and_get_no_mass():
    logits = torch.zeros(1, 8)
    logits[0, 3] = 10.0  # would be drawn almost always
    suppress = torch.zeros(1, 8, dtype=torch.bool)
    suppress[0, 3] = True
    for u in torch.linspace(0, 0.999, 50):
        out = sample(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1),
                     u.reshape(1).double(), suppress_B_V=suppress)
        assert out.token_ids_B.item() != 3
        assert abs(out.logprobs_B.item() - math.log(1 / 7)) < 1e-6


def test_greedy_takes_the_argmax_with_log_prob_zero():
    logits = torch.tensor([[0.1, 2.0, 1.9, -1.0]])
    out = sample(logits, torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1),
                 torch.tensor([0.99], dtype=torch.float64), topk=2)
    assert out.token_ids_B.item() == 1 and out.logprobs_B.item() == 0.0
    assert out.topk_ids_B_K.tolist() == [[1, 2]]
    assert out.topk_logprobs_B_K[0, 1].item() == -math.inf


def test_uniform_draw_maps_to_the_inverse_cdf():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    one, none_k, one_p = torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1)
    pick = [sample(logits, one, none_k, one_p, torch.tensor([u], dtype=torch.float64))
            .token_ids_B.item() for u in (0.0, 0.49, 0.51, 0.79, 0.81, 0.999999)]
    assert pick == [0, 0, 1, 1, 2, 2]


def test_empirical_frequencies_match_recorded_probabilities_chi_square():
    """20k draws at T=0.7, top-k 20, top-p 0.9: frequencies match exp(recorded log-prob)."""
    generator = torch.Generator().manual_seed(1234)
    logits = torch.randn(1, 100, generator=generator) * 2
    n = 20_000
    out = sample(logits.expand(n, -1), torch.full((n,), 0.7), torch.full((n,), 20),
                 torch.full((n,), 0.9), torch.rand(n, generator=generator, dtype=torch.float64))
    processed = processed_logprobs(logits, torch.full((1,), 0.7), torch.full((1,), 20),
                                   torch.full((1,), 0.9))[0]
    # each draw's recorded log-prob is the processed log-prob of its id
    assert torch.allclose(out.logprobs_B, processed[out.token_ids_B])
    kept = torch.isfinite(processed).nonzero().squeeze(1)
    assert 2 <= len(kept) <= 20
    counts = torch.bincount(out.token_ids_B, minlength=100).double()
    assert counts[~torch.isfinite(processed)].sum() == 0, "a removed token was drawn"
    probs = processed[kept].double().exp()
    assert abs(probs.sum().item() - 1.0) < 1e-5
    expected = probs / probs.sum() * n  # renormalise float32 rounding so the totals agree
    result = chisquare(counts[kept].numpy(), expected.numpy())
    assert result.pvalue > 1e-3, result


def test_unfiltered_rows_sample_without_sorting_from_the_same_distribution():
    """T=1.3, no top-k/top-p (the path that skips the sort): 20k draws over unsorted logits
    match exp(recorded log-prob), and each recorded log-prob is the processed one."""
    generator = torch.Generator().manual_seed(99)
    logits = torch.randn(1, 60, generator=generator) * 2
    n = 20_000
    temperature, no_k, no_p = torch.full((n,), 1.3), torch.zeros(n, dtype=torch.long), torch.ones(n)
    out = sample(logits.expand(n, -1), temperature, no_k, no_p,
                 torch.rand(n, generator=generator, dtype=torch.float64))
    processed = processed_logprobs(logits, temperature[:1], no_k[:1], no_p[:1])[0]
    assert torch.allclose(out.logprobs_B, processed[out.token_ids_B], atol=1e-6)
    counts = torch.bincount(out.token_ids_B, minlength=60).double()
    expected = processed.double().exp()
    result = chisquare(counts.numpy(), (expected / expected.sum() * n).numpy())
    assert result.pvalue > 1e-3, result
