"""The code gain "auto" (train.py --a-gain auto; docs/math.md [M:gain-auto]): the output gain of
the learning heads that starts the codes at the magnitude where the in-batch NAC loss of an
ideal encoder is lowest, for the run's flip probability, code length and batch.

    t = ideal_code_magnitude(p, dim, images)   # the ideal encoder's best mean |tanh a| ([M:floor])
    g = gain_for_magnitude(t, dim)             # a = BN(g(h)) * g / sqrt(D) has E|tanh a| = t
    g = auto_code_gain(p, dim, images)         # both

At p = 0.1, D = 128, 256 images this is 3 (the fixed value the learning heads were introduced
with); a noisier channel moves the optimum to larger codes (p = 0.35: about 11), where a fixed 3
leaves the codes small and the first epochs slow (docs/results.md).
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from ..ops.loss import nac_loss
from ..ops.noise import channel_scale, draw_noise

MAX_IMAGES = 1024   # the batch the ideal loss is evaluated at is capped (it enters through log n)


def ideal_loss(t: float, images: int, dim: int, p: float, seed: int = 0) -> tuple:
    """(contrastive part mean(lse - log n), Bernoulli part -mean(bern), loss) of the in-batch NAC
    loss for the ideal encoder of docs/math.md [M:floor]: `images` images with distinct random
    sign patterns, both views the same code z = t * sign, the best inference logits for that
    code (r = 2 atanh((1 - 2p) z)), one channel sample; float64, reference backend, seeded."""
    gen = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (images, dim), generator=gen, dtype=torch.float64) * 2 - 1
    z = t * torch.cat([sign, sign])  # both views of an image share the code
    q = (1 - 2 * p) * z  # E[z~] given the clean code
    r = torch.log1p(q) - torch.log1p(-q)
    a = torch.atanh(z.clamp(-1 + 1e-12, 1 - 1e-12))  # tanh(a) = z
    noise = draw_noise(a.shape, p, generator=gen, dtype=torch.float64)
    per_row = nac_loss(a, r, p, noise=noise, reduction="none", backend="reference")
    lse = torch.logsumexp(channel_scale(p) * (noise * z) @ z.T, dim=1) - math.log(2 * images)
    return float(lse.mean()), float((per_row - lse).mean()), float(per_row.mean())


def _check(p, dim, images):
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p < 0.5:
        raise ValueError(f"p must lie in (0, 0.5), got {p!r}")
    for name, v in (("dim", dim), ("images", images)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


@lru_cache(maxsize=64)
def ideal_code_magnitude(p: float, dim: int, images: int, seed: int = 0) -> float:
    """The code magnitude t in [0.05, 0.95] where `ideal_loss` is lowest: a grid of step 0.05,
    then a golden-section search around its best point (the same seeded codes and noise at
    every t, so the curve is smooth); `images` capped at MAX_IMAGES."""
    _check(p, dim, images)
    n = min(images, MAX_IMAGES)

    def f(t):
        return ideal_loss(t, n, dim, float(p), seed)[2]

    grid = [0.05 * k for k in range(1, 20)]
    k = min(range(len(grid)), key=lambda i: f(grid[i]))
    lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    g = (math.sqrt(5) - 1) / 2
    x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
    f1, f2 = f(x1), f(x2)
    for _ in range(20):
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - g * (hi - lo)
            f1 = f(x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + g * (hi - lo)
            f2 = f(x2)
    return round((lo + hi) / 2, 4)


def _mean_abs_tanh(sigma: float) -> float:
    """E|tanh(sigma xi)|, xi ~ N(0, 1), by 80-point Gauss-Hermite quadrature."""
    import numpy as np
    x, w = np.polynomial.hermite.hermgauss(80)
    return float((w * np.abs(np.tanh(sigma * math.sqrt(2) * x))).sum() / math.sqrt(math.pi))


def gain_for_magnitude(t: float, dim: int) -> float:
    """The gain g for which a = x * g / sqrt(dim), x ~ N(0, 1) (a batch-normalised head output),
    has E|tanh a| = t (bisection; t in (0, 1))."""
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 < t < 1.0:
        raise ValueError(f"t must lie in (0, 1), got {t!r}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValueError(f"dim must be a positive int, got {dim!r}")
    lo, hi = 0.0, 1.0
    while _mean_abs_tanh(hi) < t:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _mean_abs_tanh(mid) < t else (lo, mid)
    return round((lo + hi) / 2 * math.sqrt(dim), 3)


def auto_code_gain(p: float, dim: int, images: int) -> float:
    """--a-gain auto: gain_for_magnitude(ideal_code_magnitude(p, dim, images), dim)."""
    return gain_for_magnitude(ideal_code_magnitude(p, dim, images), dim)
