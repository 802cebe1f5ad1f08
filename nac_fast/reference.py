"""Plain-PyTorch reference of the NAC losses (NAC_SPEC.md; paper eq. `optimization_objective`
and `momentum_objective`).

This module is three things at once (Apple CCE's pattern): the test oracle every fused backend is
compared against, the fallback that runs on any device and dtype (float64 included, so
``torch.autograd.gradcheck`` works), and the baseline of the microbenchmarks.  It materialises the
n x N logits; the fused kernels never do.

Per query row i, with z = tanh(a), z~ = m * z (m = +-1 channel noise), s = 1/2 log((1-p)/p):

    lse_i  = log sum_j exp(s * z~_i . k_j)          k = keys (in-batch: the n clean codes z,
                                                     self and partner included; MQ: the queue)
    bern_i = 1/2 sum_d [ z~_id r_id + log sig(r_id) + log sig(-r_id) ]
    loss_i = lse_i - log N - bern_i + l2 * ||z_i||^2      (l2 = 0 in-batch, lambda for NAC-MQ)

All computation happens in the input dtype, so the reference run in bf16 is the yardstick for the
"error <= 2x the same-dtype reference" tolerance.  The result is float32 (float64 for float64
inputs).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The losses' output and accumulation dtype for inputs of `dtype`, on every backend."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def bernoulli_term(z_noisy: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """bern_i = 1/2 sum_d [z~_id r_id + log sig(r_id) + log sig(-r_id)], shape (n,).

    It is minus the binary cross-entropy of logits r against soft targets (1 + z~)/2, which is how
    it is written here (exact and numerically stable for large |r|).
    """
    return 0.5 * (z_noisy * r + F.logsigmoid(r) + F.logsigmoid(-r)).sum(1)


def reduce_rows(rows: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return rows.mean()
    if reduction == "sum":
        return rows.sum()
    return rows


def nac_rows_reference(a: torch.Tensor, r: torch.Tensor, noise: torch.Tensor, s: float,
                       keys: torch.Tensor | None = None, l2: float = 0.0) -> torch.Tensor:
    """Per-row loss (n,) in the input dtype; keys=None means the batch's own clean codes."""
    z = torch.tanh(a)
    zt = noise.to(a.dtype) * z
    k = z if keys is None else keys
    lse = torch.logsumexp((zt * s) @ k.t(), dim=1)
    rows = lse - math.log(k.shape[0]) - bernoulli_term(zt, r)
    if l2:
        rows = rows + l2 * (z * z).sum(1)
    return rows


def nac_loss_reference(a, r, noise, s, keys=None, reduction="mean"):
    rows = nac_rows_reference(a, r, noise, s, keys=keys).to(acc_dtype(a.dtype))
    return reduce_rows(rows, reduction)


def nac_mq_loss_reference(a, r_hat, queue, noise, s, l2=0.1, reduction="mean"):
    rows = nac_rows_reference(a, r_hat, noise, s, keys=queue, l2=l2).to(acc_dtype(a.dtype))
    return reduce_rows(rows, reduction)
