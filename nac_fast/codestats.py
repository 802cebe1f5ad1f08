"""Code statistics: how expressive a set of binary codes is (docs/math.md [M:stats]).

    import nac_fast
    s = nac_fast.code_statistics(a)     # pre-activations or codes: distinct codes, mean pairwise
    s.as_dict()                         # Hamming distance, bit balance, bit entropy

Not an op: statistics of codes for the training log (nac_fast/train/methods.py ``code_stats``)
and the evaluation's expressivity task.  It sits above nac_fast.ops (it uses the packing of
ops/codes.py) and below nac_fast.train, so both train and eval import it.  Exact and O(nD): cheap
enough for a training logger (timings: bench/results/cpu_micro.md, "Code statistics").
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from .ops.codes import (PackedCodes, check_packed, check_tensor, code_bits, is_integer_dtype,
                        pack_bits, unpack_bits)

__all__ = ["CodeStatistics", "code_statistics"]


def _bit_counts(bits: torch.Tensor) -> torch.Tensor:
    """Number of set bits per column, int64 (numpy on CPU: several times faster than torch's bool
    column sum, bench/results/cpu_micro.md)."""
    if bits.device.type == "cpu":
        return torch.from_numpy(bits.numpy().sum(0, dtype=np.int64))
    return bits.sum(0, dtype=torch.int64)


def _num_distinct_rows(words: torch.Tensor) -> int:
    """Distinct rows of an int64 matrix by successive stable sorts on each column (LSD order),
    faster than torch.unique(dim=0) (bench/results/cpu_micro.md)."""
    order = torch.argsort(words[:, -1], stable=True)
    for c in range(words.shape[1] - 2, -1, -1):
        order = order[torch.argsort(words[order, c], stable=True)]
    s = words[order]
    return int((s[1:] != s[:-1]).any(1).sum()) + 1


@dataclasses.dataclass(frozen=True)
class CodeStatistics:
    """Expressivity of a set of n binary codes of D bits (the paper's central claim), each field
    named and defined as in docs/math.md [M:stats]:

    num_distinct, fraction_distinct                 [M:distinct]
    mean_pairwise_hamming (NaN when n < 2),
    normalized_mean_pairwise_hamming (/ num_bits)   [M:mean-hamming], exact, O(nD)
    bit_freq: the (D,) fraction of +1 per bit;
    bit_freq_min, bit_freq_max: its min and max     [M:bit-freq]
    balance_dev: mean_b |bit_freq_b - 1/2|          [M:balance-dev]  (0 = every bit balanced)
    bit_entropy_mean                                [M:bit-entropy]  (1 = every bit balanced)
    """

    num_codes: int
    num_bits: int
    num_distinct: int
    fraction_distinct: float
    mean_pairwise_hamming: float
    normalized_mean_pairwise_hamming: float  # / num_bits; 0.5 for independent balanced bits
    bit_freq: torch.Tensor
    balance_dev: float
    bit_freq_min: float
    bit_freq_max: float
    bit_entropy_mean: float

    def as_dict(self) -> dict:
        """Scalar statistics only (for a training logger / JSON report)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "bit_freq"}


def code_statistics(codes, *, zero_one: bool = False) -> CodeStatistics:
    """Expressivity statistics of (n, D) codes (:class:`CodeStatistics`, docs/math.md [M:stats]).

    ``codes`` may be pre-activations a or codes: the code is sgn(a) with **0 mapped to +1**
    (so +-1 codes are unchanged, [M:code]); bool means True = +1; with ``zero_one=True`` values
    must be 0/1 (1 = +1); a :class:`PackedCodes` is used as is.  Gradients are not tracked.
    Cost: one comparison and one column sum, plus ceil(D/64) stable sorts of the packed rows for
    the distinct count, all O(nD): cheap enough for a training logger (timings:
    bench/results/cpu_micro.md, "Code statistics").
    """
    with torch.no_grad():
        if isinstance(codes, PackedCodes):
            words, nbits = check_packed("codes", codes)
            bits = unpack_bits(words, nbits)
        else:
            check_tensor("codes", codes)
            if codes.dim() != 2:
                raise ValueError(f"codes must be 2-D (n, D), got shape {tuple(codes.shape)}")
            if codes.dtype == torch.bool:
                bits = codes
            elif zero_one:
                bits = code_bits("codes", codes, True)
            else:
                if codes.is_complex() or not (codes.is_floating_point() or is_integer_dtype(codes.dtype)):
                    raise TypeError(f"codes must have a real or bool dtype, got {codes.dtype}")
                if codes.is_floating_point() and not bool(torch.isfinite(codes).all()):
                    raise ValueError("codes contains NaN or inf")
                bits = codes.detach() >= 0
            if bits.shape[0] < 1 or bits.shape[1] < 1:
                raise ValueError(f"codes must be non-empty, got shape {tuple(bits.shape)}")
            words = pack_bits(bits)
        n, d = bits.shape
        k = _bit_counts(bits)  # +1 count per bit
        # Exact integer numerator: k (n - k) <= n^2 / 4 per bit.
        num = int((2 * k * (n - k)).sum())
        mph = num / (n * (n - 1)) if n >= 2 else math.nan
        distinct = _num_distinct_rows(words)
        frac = k.to(torch.float64) / n
        p = frac.clamp(1e-300, 1.0)
        q = (1.0 - frac).clamp(1e-300, 1.0)
        ent = -(frac * torch.log2(p) + (1.0 - frac) * torch.log2(q))
        return CodeStatistics(
            num_codes=n,
            num_bits=d,
            num_distinct=distinct,
            fraction_distinct=distinct / n,
            mean_pairwise_hamming=mph,
            normalized_mean_pairwise_hamming=mph / d,
            bit_freq=frac.cpu(),
            balance_dev=float((frac - 0.5).abs().mean()),
            bit_freq_min=float(frac.min()),
            bit_freq_max=float(frac.max()),
            bit_entropy_mean=float(ent.mean()),
        )
