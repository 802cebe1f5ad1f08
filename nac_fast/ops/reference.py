"""Plain-PyTorch reference of the NAC losses: the per-row function docs/math.md [M:rows], for the
in-batch loss [M:inbatch] and NAC-MQ [M:mq], and the Philox channel noise [M:philox].

This module is three things at once (Apple CCE's pattern): the test oracle every fused backend is
compared against, the fallback that runs on any device and dtype (float64 included, so
``torch.autograd.gradcheck`` works), and the baseline of the microbenchmarks.  It materialises the
n x N logits; the fused kernels never do.

All computation happens in the input dtype, so the reference run in bf16 is the yardstick for the
"error <= 2x the same-dtype reference" tolerance.  The result is float32 (float64 for float64
inputs).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from .._tensors import acc_dtype  # the output / accumulation dtype rule of every backend


def bernoulli_term(z_noisy: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The Bernoulli term bern_i of docs/math.md [M:bern], shape (n,), written with log-sigmoids
    (exact and numerically stable for large |r|)."""
    return 0.5 * (z_noisy * r + F.logsigmoid(r) + F.logsigmoid(-r)).sum(1)


def reduce_rows(rows: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return rows.mean()
    if reduction == "sum":
        return rows.sum()
    return rows


LIKELIHOODS = ("dot", "multilinear")  # the relaxed likelihood: [M:channel], [M:multilinear]
# The row's own clean code among its keys ([M:self-key]): "include" (the paper's) or "exclude"
# (a leave-one-out denominator, not the paper's)
SELF_KEYS = ("include", "exclude")
# The backends that run what no fused kernel computes (likelihood "multilinear"): this
# reference, which "auto" picks for it (self_key "exclude" runs on every backend)
REFERENCE_BACKENDS = ("auto", "reference")
MULTILINEAR_MAX_TERMS = 1024


def multilinear_terms(t: float, eps: float) -> int:
    """The number T of terms of log(1 + t x) = sum_m (-1)^(m+1) t^m x^m / m, |x| <= 1, whose tail
    is below `eps` per bit: sum_{m > T} t^m / m <= t^(T+1) / ((T+1) (1-t)) (docs/math.md
    [M:multilinear]).  ValueError naming p when more than MULTILINEAR_MAX_TERMS are needed."""
    if not 0.0 < t < 1.0:
        raise ValueError(f"the multilinear likelihood needs 0 < p < 0.5 (t = 1 - 2p = {t})")
    T = 1
    while t ** (T + 1) / ((T + 1) * (1.0 - t)) > eps:
        T += 1
        if T > MULTILINEAR_MAX_TERMS:
            raise ValueError(f"p = {(1 - t) / 2:g}: the multilinear likelihood's series needs "
                             f"more than {MULTILINEAR_MAX_TERMS} terms at this precision; use "
                             "p >= 0.02 or the dot likelihood")
    return T


def multilinear_logits(q: torch.Tensor, k: torch.Tensor, t: float) -> torch.Tensor:
    """L_ij = sum_d log(1 + t q_id k_jd) (docs/math.md [M:multilinear]) for |q|, |k| <= 1, as ONE
    matmul of the series' features: L = Q K^T with Q = [c_m q^m]_m, K = [k^m]_m, c_m = (-1)^(m+1)
    t^m / m, m = 1..T (T: multilinear_terms at the accumulation dtype's precision).  Computed in
    float32 (float64 for float64 inputs): the powers are too coarse in 16 bits.  (n, N)."""
    acc = acc_dtype(q.dtype)
    q, k = q.to(acc), k.to(acc)
    T = multilinear_terms(t, torch.finfo(acc).eps / 2)
    coef = torch.tensor([(-1.0) ** (m + 1) * t ** m / m for m in range(1, T + 1)],
                        dtype=acc, device=q.device)
    qp = torch.cumprod(q.unsqueeze(1).expand(-1, T, -1), dim=1)  # (n, T, D): q^1 .. q^T
    kp = torch.cumprod(k.unsqueeze(1).expand(-1, T, -1), dim=1)
    return (qp * coef[:, None]).flatten(1) @ kp.flatten(1).t()


def multilinear_logits_exact(q: torch.Tensor, k: torch.Tensor, t: float) -> torch.Tensor:
    """The same L_ij element by element, log1p over an (n, N, D) tensor: the tests' oracle."""
    return torch.log1p(t * q[:, None, :] * k[None, :, :]).sum(-1)


def nac_rows_reference(a: torch.Tensor, r: torch.Tensor, noise: torch.Tensor, s: float,
                       keys: torch.Tensor | None = None, l2: float = 0.0,
                       likelihood: str = "dot", self_offset: int | None = None) -> torch.Tensor:
    """Per-row loss (n,) in the input dtype; keys=None means the batch's own clean codes.
    likelihood "dot": the logits s z~ . k ([M:channel]); "multilinear": sum_d log(1 + (1-2p)
    z~_d k_d) ([M:multilinear], 1 - 2p = tanh(s); float32 logits for 16-bit inputs).
    self_offset: None = every key in row i's logsumexp (the paper's); an int o = row i's own
    clean code, key o + i, is left out and the constant is log(N - 1) ([M:self-key]).
    Autocast is off inside (as in the fused losses and nac_vi_loss): under it the logits' matmul
    ran in the autocast dtype, so fp32 inputs got bf16-precision rows (7.6e-4 off float64 at
    n = 64, D = 128, where the fused kernels are 1e-7 off) and the multilinear series' float32
    matmul ran in bf16 (4.2e-4)."""
    with _autocast_off(a.device.type):
        return _rows(a, r, noise, s, keys, l2, likelihood, self_offset)


def _autocast_off(device_type: str):
    """A context that disables autocast on `device_type` if it is on there (else a no-op)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _rows(a, r, noise, s, keys, l2, likelihood, self_offset=None):
    z = torch.tanh(a)
    zt = noise.to(a.dtype) * z
    k = z if keys is None else keys
    if likelihood == "multilinear":
        logits = multilinear_logits(zt, k, math.tanh(s))
    else:
        logits = (zt * s) @ k.t()
    count = k.shape[0]
    if self_offset is not None:  # [M:self-key]: row i's own code, key self_offset + i, left out
        idx = torch.arange(a.shape[0], device=a.device)
        logits = logits.index_put((idx, idx + self_offset), logits.new_tensor(float("-inf")))
        count -= 1
    lse = torch.logsumexp(logits, dim=1)
    rows = lse - math.log(count) - bernoulli_term(zt, r)
    if l2:
        rows = rows + l2 * (z * z).sum(1)
    return rows


def nac_loss_reference(a, r, noise, s, keys=None, reduction="mean", likelihood="dot",
                       self_offset=None):
    rows = nac_rows_reference(a, r, noise, s, keys=keys, likelihood=likelihood,
                              self_offset=self_offset)
    return reduce_rows(rows.to(acc_dtype(a.dtype)), reduction)


def nac_mq_loss_reference(a, r_hat, queue, noise, s, l2=0.1, reduction="mean", likelihood="dot"):
    rows = nac_rows_reference(a, r_hat, noise, s, keys=queue, l2=l2, likelihood=likelihood)
    return reduce_rows(rows.to(acc_dtype(a.dtype)), reduction)


# ---- channel noise from a seed (the reference of the nac_noise ops) ----------------------------
# Philox4x32-10, docs/math.md [M:philox]: the same function as csrc/nac_math.h (noise_sign) and
# kernels/nac_noise_triton.py, written in int64 torch ops with every intermediate below 2^63, so it
# is exact on every device.
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _mulhilo32(x: torch.Tensor, m: int):
    """(hi, lo) 32-bit words of x * m for x in [0, 2^32), m < 2^32, without 64-bit overflow:
    m = mh 2^16 + ml, so x*ml and x*mh stay below 2^48."""
    mh, ml = m >> 16, m & 0xFFFF
    t = x * ml
    u = x * mh
    hi = (u + (t >> 16)) >> 16
    lo = (((u & 0xFFFF) << 16) + t) & _MASK32
    return hi & _MASK32, lo


def philox_first_word(counter: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """First output word (int64 in [0, 2^32)) of Philox4x32-10 for int64 counters >= 0 and a
    one-element int64 seed (any value; its two's-complement bits are the key)."""
    c0, c1 = counter & _MASK32, (counter >> 32) & _MASK32
    c2 = c3 = torch.zeros_like(counter)
    seed = seed.reshape(())
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        hi0, lo0 = _mulhilo32(c0, _PHILOX_M0)
        hi1, lo1 = _mulhilo32(c2, _PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W0) & _MASK32, (k1 + _PHILOX_W1) & _MASK32
    return c0


def philox_uniform(word: torch.Tensor) -> torch.Tensor:
    """Triton's uint_to_uniform_float, the word -> uniform step of docs/math.md [M:philox]."""
    v = torch.where(word >= 2 ** 31, _MASK32 - word, word)  # ~int32(w) for the negative ones
    return v.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32,
                                              device=word.device)


def philox_noise(like: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """Channel noise of like's shape, dtype and device (docs/math.md [M:philox])."""
    e = torch.arange(like.numel(), device=like.device, dtype=torch.int64).reshape(like.shape)
    u = philox_uniform(philox_first_word(e, seed.to(like.device, torch.int64)))
    return torch.where(u < torch.tensor(p, dtype=torch.float32, device=like.device), -1.0,
                       1.0).to(like.dtype)
