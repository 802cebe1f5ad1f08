"""The VAE's likelihood for 8-bit images: a discretised Gaussian over the 256 bins of each
sub-pixel (docs/math.md [M:vae-dgauss]).

    lp = discretized_gaussian_log_prob(x_u8, mean, log_scale)   # (..., C, H, W) log-probabilities
    lp.sum((-3, -2, -1))                                         # log p(x | z) of each image, nats

The decoder predicts, per sub-pixel, a Gaussian N(mean, exp(log_scale)^2) on the [0, 1] scale of
x / 255; the probability of the value k in {0, ..., 255} is that Gaussian's mass on the bin
[(k - 1/2) / 255, (k + 1/2) / 255], with the first and the last bin extended to -inf and +inf
(Salimans et al. 2017 use the same bins with a logistic).  The 256 probabilities sum to 1
exactly, so log p(x | z) <= 0 and the IWAE / ELBO figures are log-probabilities of the 8-bit
data, comparable with any other discrete model of the same images (bits/dim = -log p / (D ln 2)).

The mass Phi(b) - Phi(a) of a bin is computed as exp(log Phi(b)) (1 - exp(log Phi(a) - log Phi(b)))
on the side of the Gaussian's centre where Phi is small (mirrored with Phi(-x) = 1 - Phi(x) on
the other side), so neither tail cancels catastrophically: `log_ndtr` is accurate far into the
tails, and log(-expm1(d)) is accurate for d near 0 (a bin much narrower than the scale) and for
d -> -inf (a bin that holds nearly all of the mass).
"""
from __future__ import annotations

import torch

NUM_BINS = 256
# log of the scale on the [0, 1] pixel scale is clamped to this range: a bin's half-width is
# 1/510, so exp(-9) = 1.2e-4 lets one bin hold 1 - 1e-15 of the mass (no need for less), and
# exp(2) = 7.4 is flatter than uniform over [0, 1] (no need for more).  The clamp keeps the
# standardised bin edges finite and moderate (|edge| < ~1e4), where log_ndtr is accurate.
LOG_SCALE_MIN, LOG_SCALE_MAX = -9.0, 2.0
# Standardised position that stands for -inf / +inf at the first / last bin's open edge: far
# beyond any finite edge (|edge| <= (1 + 1/510 + |mean|) e^9 for the clamped scale, means clamped
# to [-MEAN_BOUND, 1 + MEAN_BOUND]), and finite, so no inf - inf can appear in a gradient.
MEAN_BOUND = 4.0
_FAR = 1.0e6
# -expm1(d) is clamped below by this: a bin whose mass underflows float64/32 still gets a finite
# (very negative) log-probability and a finite gradient.
_TINY = 1.0e-300


def _check(x_u8: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor) -> None:
    if not isinstance(x_u8, torch.Tensor) or x_u8.dtype != torch.uint8:
        raise TypeError(f"x must be a uint8 tensor of 8-bit values, got "
                        f"{getattr(x_u8, 'dtype', type(x_u8).__name__)}")
    for name, t in (("mean", mean), ("log_scale", log_scale)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
    if mean.shape != log_scale.shape:
        raise ValueError(f"mean and log_scale must have the same shape, got {tuple(mean.shape)} "
                         f"and {tuple(log_scale.shape)}")
    try:
        torch.broadcast_shapes(x_u8.shape, mean.shape)
    except RuntimeError:
        raise ValueError(f"x of shape {tuple(x_u8.shape)} does not broadcast with the "
                         f"parameters' shape {tuple(mean.shape)}") from None


def discretized_gaussian_log_prob(x_u8: torch.Tensor, mean: torch.Tensor,
                                  log_scale: torch.Tensor) -> torch.Tensor:
    """log P(x) per element, docs/math.md [M:vae-dgauss].

    x_u8: uint8 values in {0..255}; mean, log_scale: the Gaussian on the [0, 1] scale (x / 255),
    float tensors of one shape that broadcasts with x's.  mean is clamped to
    [-MEAN_BOUND, 1 + MEAN_BOUND] and log_scale to [LOG_SCALE_MIN, LOG_SCALE_MAX] (gradients
    stop outside).  Returns log-probabilities (<= 0) in the parameters' dtype, shape broadcast."""
    _check(x_u8, mean, log_scale)
    mean = mean.clamp(-MEAN_BOUND, 1.0 + MEAN_BOUND)
    log_scale = log_scale.clamp(LOG_SCALE_MIN, LOG_SCALE_MAX)
    k = x_u8.to(mean.dtype)
    inv = torch.exp(-log_scale)
    lo = ((k - 0.5) / (NUM_BINS - 1) - mean) * inv          # standardised bin edges
    hi = ((k + 0.5) / (NUM_BINS - 1) - mean) * inv
    lo = torch.where(x_u8 == 0, torch.full_like(lo, -_FAR), lo)
    hi = torch.where(x_u8 == NUM_BINS - 1, torch.full_like(hi, _FAR), hi)
    # On the side where the bin is (its midpoint's sign), mirror so that the bin lies at or below
    # the centre: mass = Phi(b) - Phi(a) with b = hi, a = lo, or b = -lo, a = -hi.
    upper = (lo + hi) > 0
    b = torch.where(upper, -lo, hi)
    a = torch.where(upper, -hi, lo)
    lb, la = torch.special.log_ndtr(b), torch.special.log_ndtr(a)
    return lb + torch.log(torch.clamp(-torch.expm1(la - lb), min=_TINY))


def decoder_mean(mean: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """The expected value of x / 255 under the discretised Gaussian, approximated by the
    Gaussian's mean clamped to [0, 1] (what the reconstruction PNGs show)."""
    return mean.clamp(0.0, 1.0)


def sample(mean: torch.Tensor, log_scale: torch.Tensor, generator=None) -> torch.Tensor:
    """Exact samples (uint8) of the discretised Gaussian: a Gaussian draw, rounded to the bin
    and clipped into the first / last bin."""
    s = torch.exp(log_scale.clamp(LOG_SCALE_MIN, LOG_SCALE_MAX))
    y = mean.clamp(-MEAN_BOUND, 1.0 + MEAN_BOUND) + s * torch.randn(
        mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    return torch.round(y * (NUM_BINS - 1)).clamp(0, NUM_BINS - 1).to(torch.uint8)
