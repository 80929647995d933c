"""Bias, variance and their standard errors of gradient estimates against an exact gradient.

Given M independent estimates g_m (rows of `estimates_M_D`) of a target gradient g, with
nu = ||g|| (or 1 when g = 0, e.g. a constant reward: then every figure is absolute):

- bias      = ||mean_m g_m - g|| / nu
- bias_se   = sqrt(tr Cov / M) / nu: the typical norm of the mean's own noise. An unbiased
              estimator shows bias of about 1 bias_se (not 0: a norm is never negative).
- bias_z    = (M ||mean - g||^2 - tr Cov) / sqrt(2 tr Cov^2): the excess of the squared bias
              over what noise alone gives, in standard deviations of that noise (Gaussian
              approximation of the mean). bias_z > 3 means the bias is statistically non-zero.
- variance  = E||g_m - mean||^2 / nu^2 = tr Cov / nu^2, with variance_se from the spread of the
              per-estimate squared deviations
- mse       = mean_m ||g_m - g||^2 / nu^2
- cosine    = cos(mean, g), the direction of the expected update; cosine_single = the mean
              cosine of one estimate; scale = <mean, g> / ||g||^2 (0 when g = 0).

Guarantees: pure functions of their inputs; float64 throughout.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

ZERO_GRADIENT = 1e-12


@dataclass(frozen=True)
class GradientStats:
    bias: float
    bias_se: float
    bias_z: float
    variance: float
    variance_se: float
    mse: float
    cosine: float
    cosine_single: float
    scale: float
    grad_norm: float
    normalizer: str

    def as_dict(self) -> dict[str, float | str]:
        return asdict(self)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    denominator = float(a.norm() * b.norm())
    return float(a @ b) / denominator if denominator > 0 else 0.0


def _noise_terms(centered_M_D: torch.Tensor) -> tuple[float, float]:
    """(tr Cov, tr Cov^2) of the sample covariance, via the smaller of C^T C and C C^T."""
    m, d = centered_M_D.shape
    gram = centered_M_D.T @ centered_M_D if d <= m else centered_M_D @ centered_M_D.T
    trace = float(gram.trace()) / (m - 1)
    trace_sq = float((gram * gram).sum()) / (m - 1) ** 2
    return trace, trace_sq


def gradient_stats(estimates_M_D: torch.Tensor, target_D: torch.Tensor) -> GradientStats:
    """Statistics of M estimates against the exact gradient `target_D`."""
    estimates = estimates_M_D.double()
    target = target_D.double().reshape(-1)
    m = estimates.shape[0]
    if m < 2:
        raise ValueError(f"need at least 2 estimates for standard errors, got {m}")
    grad_norm = float(target.norm())
    absolute = grad_norm < ZERO_GRADIENT
    nu = 1.0 if absolute else grad_norm
    mean_D = estimates.mean(0)
    centered = estimates - mean_D
    trace, trace_sq = _noise_terms(centered)
    diff = mean_D - target
    squared_dev_M = (centered * centered).sum(1)
    z_scale = math.sqrt(2.0 * trace_sq) if trace_sq > 0 else float("inf")
    cosines_M = torch.nn.functional.cosine_similarity(estimates, target.unsqueeze(0), dim=1)
    return GradientStats(
        bias=float(diff.norm()) / nu,
        bias_se=math.sqrt(trace / m) / nu,
        bias_z=(m * float(diff @ diff) - trace) / z_scale,
        variance=trace / nu**2,
        variance_se=float(squared_dev_M.std()) / math.sqrt(m) / nu**2,
        mse=float(((estimates - target) ** 2).sum(1).mean()) / nu**2,
        cosine=0.0 if absolute else _cos(mean_D, target),
        cosine_single=0.0 if absolute else float(cosines_M.mean()),
        scale=0.0 if absolute else float(mean_D @ target) / grad_norm**2,
        grad_norm=grad_norm,
        normalizer="absolute" if absolute else "grad_norm",
    )


@dataclass(frozen=True)
class MeanWithError:
    mean: float
    se: float


def norm_of_mean(samples_M_D: torch.Tensor, normalizer: float = 1.0) -> MeanWithError:
    """||mean|| / normalizer with its noise floor sqrt(tr Cov / M) / normalizer."""
    samples = samples_M_D.double()
    m = samples.shape[0]
    centered = samples - samples.mean(0)
    trace = float((centered * centered).sum()) / (m - 1)
    return MeanWithError(float(samples.mean(0).norm()) / normalizer,
                         math.sqrt(trace / m) / normalizer)


def scalar_mean(samples_M: torch.Tensor) -> MeanWithError:
    samples = samples_M.double()
    return MeanWithError(float(samples.mean()), float(samples.std()) / math.sqrt(samples.numel()))


def block_scales(estimates_M_D: torch.Tensor, target_D: torch.Tensor,
                 blocks: int) -> list[MeanWithError]:
    """Per-block scale <g_m|block, g|block> / ||g|block||^2 (mean and SE over m).

    With one block per prompt this is the weight an estimator gives each prompt's group
    relative to the exact gradient: equal scales mean the relative weights are preserved.
    """
    estimates = estimates_M_D.double().reshape(estimates_M_D.shape[0], blocks, -1)
    target = target_D.double().reshape(blocks, -1)
    out = []
    for b in range(blocks):
        norm_sq = float(target[b] @ target[b])
        if norm_sq < ZERO_GRADIENT**2:
            out.append(MeanWithError(float("nan"), float("nan")))
            continue
        out.append(scalar_mean(estimates[:, b] @ target[b] / norm_sq))
    return out


def normalised_ess(log_weights_M_B: torch.Tensor) -> torch.Tensor:
    """(sum w)^2 / (B sum w^2) of each row's weights, from log weights (stable)."""
    shifted = log_weights_M_B - log_weights_M_B.max(dim=1, keepdim=True).values
    w = shifted.exp()
    return w.sum(1) ** 2 / (w.shape[1] * (w * w).sum(1))
