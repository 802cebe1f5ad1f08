"""Hamming-space retrieval and code statistics for NAC's binary codes (docs/math.md [M:code]).

    import nac_fast.ops.hamming as H
    m = H.mean_average_precision(query_codes, query_labels, gallery_codes, gallery_labels)
    d, idx = H.topk(query_codes, gallery_codes, k=100)       # nearest first, ties by gallery index
    d, idx = H.rank(query_codes, gallery_codes)              # the full ranking (Q x G)
    packed = H.pack_codes(codes)                             # (n, ceil(D/64)) int64 words + nbits
    stats = H.code_statistics(a)                             # expressivity: distinct codes, ...

Conventions (docs/math.md):

* Codes are +-1 tensors (any real or integer dtype; bool means False = -1, True = +1), or 0/1
  tensors when ``zero_one=True`` (1 = +1, 0 = -1), or a :class:`PackedCodes` [M:hamming].
* The gallery is ranked by **Hamming distance**, ties broken by gallery index [M:rank]; not by
  the dot product of {0,1} codes as in the authors' code [M:bug2].
* Relevance: same class, or shares a label for (n, L) multi-hot labels [M:relevance].
* AP over the whole ranking (mAP@all), queries with no relevant item skipped [M:ap].
* Code statistics [M:stats]: the fields of :class:`CodeStatistics` are named as in docs/math.md.

Backends (``backend=``): ``"cpu"`` is the compiled kernel ``torch.ops.nac_fast.hamming_*`` of
``nac_fast._C`` (csrc/hamming.cpp: packed words, AVX-512 VPOPCNTDQ chosen at run time, AP from
distance buckets in O(G) memory per thread, no Q x G matrix); ``"reference"`` is plain PyTorch,
runs on any device (CUDA tensors included) and works in query chunks of bounded memory.
``"triton"`` (kernels/hamming_triton.py) runs on CUDA tensors (and on CPU tensors under
``TRITON_INTERPRET=1``, which is how CI tests it): distances tile by tile, AP by a per-query
counting sort over the D + 1 distances, codes of at most 1023 bits.  ``"auto"`` picks ``"cpu"``
for CPU tensors when the extension is built, ``"triton"`` for CUDA tensors when Triton imports,
else ``"reference"``.
Timings: ``python bench/bench_hamming.py`` (10,000 x 50,000 x 128 bits, mAP@all), results in
bench/results/hamming_cpu.csv.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import NamedTuple

import numpy as np
import torch

from . import dispatch

__all__ = [
    "PackedCodes", "CodeStatistics", "pack_codes", "unpack_codes", "hamming_distance", "topk",
    "rank", "average_precision", "mean_average_precision", "code_statistics",
    "available_backends",
]

# The C++ kernel stores distances as uint16; 1023 words is the most that fits.
MAX_BITS = 1023 * 64
# The reference backend works on this many (query, gallery) pairs at a time (int64/float64
# temporaries of ~8 bytes each: ~8 MiB per temporary), so memory stays bounded for any Q.  Larger
# chunks were no faster; the peak RSS varies widely from run to run with the allocator's
# fragmentation (bench/results/cpu_micro.md, "Reference chunk size").
_REF_PAIRS_PER_CHUNK = 1 << 20


class PackedCodes(NamedTuple):
    """Binary codes packed into 64-bit words.

    ``words``: (n, ceil(nbits / 64)) int64; bit j of a code is bit j % 64 of word j // 64 (a set
    bit means +1); padding bits past ``nbits`` are 0.  The int64 dtype only stores the bit pattern.
    """

    words: torch.Tensor
    nbits: int


# --------------------------------------------------------------------------------------------
# Backend choice
# --------------------------------------------------------------------------------------------

def _triton_kernels():
    """kernels/hamming_triton.py (whether it imports: nac_fast.ops.dispatch)."""
    from ..kernels import hamming_triton
    return hamming_triton


def available_backends(device: str | torch.device = "cpu") -> list[str]:
    """Backends of the Hamming engine that can run for tensors on ``device``."""
    return dispatch.available_backends(device, op="hamming")


def _resolve_backend(backend, words: torch.Tensor, nbits: int | None = None) -> str:
    """The dispatcher's choice for the packed words' device; codes wider than the Triton
    kernels' limit go to the reference under "auto" and are refused by an explicit "triton"."""
    be = dispatch.resolve_backend(backend, words, op="hamming")
    if be == "triton" and nbits is not None and nbits > _triton_kernels().MAX_BITS:
        if backend == "auto":
            return "reference"  # torch ops, chunked, no host round trip
        raise ValueError(f"backend 'triton' handles codes of at most "
                         f"{_triton_kernels().MAX_BITS} bits, got {nbits}; use 'reference'")
    return be


# --------------------------------------------------------------------------------------------
# Argument checking and packing
# --------------------------------------------------------------------------------------------

def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or PackedCodes, got {type(t).__name__}")


def _code_bits(name: str, codes: torch.Tensor, zero_one: bool, *, check: bool = True) -> torch.Tensor:
    """(n, D) codes -> (n, D) bool, True meaning +1; checks the values."""
    _check_tensor(name, codes)
    if codes.dim() != 2:
        raise ValueError(f"{name} must be 2-D (n, bits), got shape {tuple(codes.shape)}")
    if codes.shape[1] < 1:
        raise ValueError(f"{name} must have at least one bit per code, got shape {tuple(codes.shape)}")
    if codes.shape[1] > MAX_BITS:
        raise ValueError(f"{name} has {codes.shape[1]} bits; at most {MAX_BITS} are supported")
    if codes.dtype == torch.bool:
        return codes
    if codes.is_complex() or not (codes.is_floating_point() or _is_integer(codes.dtype)):
        raise TypeError(f"{name} must have a real or bool dtype, got {codes.dtype}")
    codes = codes.detach()
    if zero_one:
        pos = codes == 1
        if check and not bool((pos | (codes == 0)).all()):
            raise ValueError(f"{name} must contain only 0 and 1 (zero_one=True)")
    else:
        pos = codes == 1
        if check and not bool((pos | (codes == -1)).all()):
            hint = (" (it looks like 0/1 codes: pass zero_one=True)"
                    if bool(((codes == 0) | (codes == 1)).all()) else
                    " (take the sign first, e.g. torch.where(a >= 0, 1, -1))")
            raise ValueError(f"{name} must contain only -1 and +1{hint}")
    return pos


def _is_integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(n, D) bool -> (n, ceil(D/64)) int64 words (layout of PackedCodes).

    CPU tensors go through numpy.packbits, several times faster than the torch version
    (bench/results/cpu_micro.md, "Code statistics")."""
    n, d = bits.shape
    nw = (d + 63) // 64
    if n == 0:  # (numpy gives a zero-size array stride 0, which torch cannot view as int64)
        return torch.zeros((0, nw), dtype=torch.int64, device=bits.device)
    if bits.device.type != "cpu":
        return _pack_bits_torch(bits)
    by = np.packbits(bits.numpy(), axis=1, bitorder="little")  # bit j -> byte j//8, bit j%8
    out = np.zeros((n, nw * 8), dtype=np.uint8)
    out[:, :by.shape[1]] = by
    if sys.byteorder != "little":  # pragma: no cover - no big-endian machine to test on
        out = out.reshape(n, nw, 8)[:, :, ::-1].reshape(n, nw * 8).copy()
    return torch.from_numpy(out).view(torch.int64)


def _pack_bits_torch(bits: torch.Tensor) -> torch.Tensor:
    """The same packing in torch ops, for tensors on other devices."""
    n, d = bits.shape
    nw = (d + 63) // 64
    padded = torch.zeros((n, nw * 64), dtype=torch.uint8, device=bits.device)
    padded[:, :d] = bits
    p = padded.view(n, nw * 8, 8)  # byte b of a word holds bits 8b..8b+7
    by = p[..., 0].clone()
    for b in range(1, 8):
        by |= p[..., b] << b
    if sys.byteorder != "little":  # pragma: no cover
        by = by.view(n, nw, 8).flip(-1).reshape(n, nw * 8)
    return by.contiguous().view(torch.int64)


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


def _unpack_bits(words: torch.Tensor, nbits: int) -> torch.Tensor:
    n, nw = words.shape
    by = words.contiguous().view(torch.uint8).view(n, nw * 8)
    if sys.byteorder != "little":  # pragma: no cover
        by = by.view(n, nw, 8).flip(-1).reshape(n, nw * 8)
    shifts = torch.arange(8, device=words.device, dtype=torch.uint8)
    bits = (by.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(n, nw * 64)[:, :nbits].bool()


def _check_packed(name: str, p: PackedCodes) -> PackedCodes:
    words, nbits = p
    _check_tensor(f"{name}.words", words)
    if isinstance(nbits, bool) or not isinstance(nbits, int) or not 1 <= nbits <= MAX_BITS:
        raise ValueError(f"{name}.nbits must be an int in [1, {MAX_BITS}], got {nbits!r}")
    if words.dtype != torch.int64:
        raise TypeError(f"{name}.words must be int64, got {words.dtype}")
    if words.dim() != 2 or words.shape[1] != (nbits + 63) // 64:
        raise ValueError(f"{name}.words must have shape (n, {(nbits + 63) // 64}) for "
                         f"nbits={nbits}, got {tuple(words.shape)}")
    if nbits % 64 and words.shape[0]:
        # Padding bits must be 0, or they would add to every distance.
        pad_mask = ~((1 << (nbits % 64)) - 1) & 0xFFFFFFFFFFFFFFFF
        pad_mask -= (1 << 64) if pad_mask >= (1 << 63) else 0  # as a signed int64
        if bool(((words[:, -1] & pad_mask) != 0).any()):
            raise ValueError(f"{name}.words has set padding bits past nbits={nbits}")
    return p


def pack_codes(codes: torch.Tensor, *, zero_one: bool = False) -> PackedCodes:
    """Pack (n, D) binary codes into (n, ceil(D/64)) int64 words: 128 bits -> 2 words.

    ``codes``: +-1 values (or bool), or 0/1 with ``zero_one=True``; anything else is a
    ValueError.  Bit j of a code is bit j % 64 of word j // 64, set for +1; padding bits are 0.
    """
    if isinstance(codes, PackedCodes):
        return _check_packed("codes", codes)
    bits = _code_bits("codes", codes, zero_one)
    return PackedCodes(_pack_bits(bits), int(bits.shape[1]))


def unpack_codes(packed: PackedCodes, *, zero_one: bool = False,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: (n, nbits) codes of ``dtype``, +-1 (or 0/1 with
    ``zero_one=True``; bool dtype gives True for +1)."""
    if not isinstance(packed, PackedCodes):
        raise TypeError(f"packed must be PackedCodes, got {type(packed).__name__}")
    words, nbits = _check_packed("packed", packed)
    bits = _unpack_bits(words, nbits)
    if dtype == torch.bool:
        return bits
    if zero_one:
        return bits.to(dtype)
    return bits.to(dtype) * 2 - 1


def _as_packed(name: str, codes, zero_one: bool) -> PackedCodes:
    if isinstance(codes, PackedCodes):
        return _check_packed(name, codes)
    bits = _code_bits(name, codes, zero_one)
    return PackedCodes(_pack_bits(bits), int(bits.shape[1]))


def _pair(query_codes, gallery_codes, zero_one: bool, *, allow_empty_query: bool = False):
    q = _as_packed("query_codes", query_codes, zero_one)
    g = _as_packed("gallery_codes", gallery_codes, zero_one)
    if q.nbits != g.nbits:
        raise ValueError(f"query_codes have {q.nbits} bits but gallery_codes have {g.nbits}")
    if q.words.device != g.words.device:
        raise ValueError(f"query_codes are on {q.words.device} but gallery_codes on "
                         f"{g.words.device}")
    if q.words.shape[0] == 0 and not allow_empty_query:
        raise ValueError("query_codes is empty (0 codes)")
    if g.words.shape[0] == 0:
        raise ValueError("gallery_codes is empty (0 codes)")
    return q, g


# --------------------------------------------------------------------------------------------
# Reference backend (plain torch, any device, bounded memory)
# --------------------------------------------------------------------------------------------

def _ref_popcount64(x: torch.Tensor) -> torch.Tensor:
    """Bit count of int64 words (SWAR), done on the two 32-bit halves so that every intermediate
    is non-negative and below 2^33: no signed overflow whatever the sign bit."""
    lo = x & 0xFFFFFFFF
    hi = (x >> 32) & 0xFFFFFFFF  # the arithmetic shift's sign copies are masked off
    return _ref_popcount32(lo) + _ref_popcount32(hi)


def _ref_popcount32(x: torch.Tensor) -> torch.Tensor:
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    return x & 0x3F


def _ref_chunk_rows(g_rows: int, width: int = 1) -> int:
    return max(1, _REF_PAIRS_PER_CHUNK // max(1, g_rows * width))


def _ref_cdist(qw: torch.Tensor, gw: torch.Tensor) -> torch.Tensor:
    out = torch.empty((qw.shape[0], gw.shape[0]), dtype=torch.int32, device=qw.device)
    step = _ref_chunk_rows(gw.shape[0], gw.shape[1])
    for s in range(0, qw.shape[0], step):
        x = qw[s:s + step, None, :] ^ gw[None, :, :]
        out[s:s + step] = _ref_popcount64(x).sum(-1, dtype=torch.int32)
    return out


def _ref_topk(qw, gw, k: int):
    dists, idxs = [], []
    step = _ref_chunk_rows(gw.shape[0], gw.shape[1])
    for s in range(0, qw.shape[0], step):
        d = _ref_cdist(qw[s:s + step], gw)
        sd, si = torch.sort(d, dim=1, stable=True)  # stable: equal distances keep index order
        dists.append(sd[:, :k])
        idxs.append(si[:, :k])
    return torch.cat(dists), torch.cat(idxs)


def _triton_topk(qw, gw, k: int):
    """Distances from the Triton kernel, then one top-k per query chunk on the composite key
    distance * G + index: exact, and equal distances come out in gallery-index order."""
    G = gw.shape[0]
    dists, idxs = [], []
    step = max(1, (1 << 26) // max(1, G))  # int32 + int64 key: ~0.75 GiB per chunk at most
    ar = torch.arange(G, device=gw.device, dtype=torch.int64)
    for s in range(0, qw.shape[0], step):
        key = _triton_kernels().cdist(qw[s:s + step], gw).to(torch.int64) * G + ar
        kk = torch.topk(key, k, dim=1, largest=False, sorted=True).values
        dists.append(torch.div(kk, G, rounding_mode="floor").to(torch.int32))
        idxs.append(kk % G)
    return torch.cat(dists), torch.cat(idxs)


def _ref_relevance(ql: torch.Tensor, gl: torch.Tensor) -> torch.Tensor:
    if ql.dim() == 1:
        return ql[:, None] == gl[None, :]
    return (ql.to(torch.float32) @ gl.to(torch.float32).T) > 0.5  # 0/1 counts: exact in fp32


def _ref_average_precision(qw, gw, ql, gl):
    G = gw.shape[0]
    aps, nrels = [], []
    ranks = torch.arange(1, G + 1, device=qw.device, dtype=torch.float64)
    step = _ref_chunk_rows(G, max(gw.shape[1], 2))
    for s in range(0, qw.shape[0], step):
        d = _ref_cdist(qw[s:s + step], gw)
        order = torch.sort(d, dim=1, stable=True).indices
        rel = torch.gather(_ref_relevance(ql[s:s + step], gl), 1, order)
        nrel = rel.sum(1)
        hits = rel.to(torch.float64)
        prec_sum = (hits.cumsum(1) / ranks * hits).sum(1)
        ap = torch.where(nrel > 0, prec_sum / nrel.clamp(min=1), torch.nan)
        aps.append(ap)
        nrels.append(nrel.to(torch.int64))
    return torch.cat(aps), torch.cat(nrels)


# --------------------------------------------------------------------------------------------
# Public search API
# --------------------------------------------------------------------------------------------

def hamming_distance(query_codes, gallery_codes, *, zero_one: bool = False,
                     backend: str = "auto") -> torch.Tensor:
    """(Q, G) int32 matrix of Hamming distances (number of differing bits).

    This materialises Q x G integers: meant for small sets and tests.  Use :func:`topk` or
    :func:`mean_average_precision` on large ones."""
    q, g = _pair(query_codes, gallery_codes, zero_one)
    be = _resolve_backend(backend, q.words)
    if be == "cpu":
        return torch.ops.nac_fast.hamming_cdist(q.words, g.words)
    if be == "triton":
        return _triton_kernels().cdist(q.words, g.words)
    return _ref_cdist(q.words, g.words)


def topk(query_codes, gallery_codes, k: int, *, zero_one: bool = False, backend: str = "auto"):
    """The k nearest gallery items of each query by Hamming distance.

    Returns ``(distances, indices)``: int32 and int64 tensors of shape (Q, k), nearest first,
    equal distances in increasing gallery index (the order of a stable sort).  ``k`` must be in
    [1, G]."""
    q, g = _pair(query_codes, gallery_codes, zero_one)
    G = g.words.shape[0]
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 1 <= k <= G:
        raise ValueError(f"k must be in [1, {G}] (the gallery size), got {k}")
    be = _resolve_backend(backend, q.words)
    if be == "cpu":
        return torch.ops.nac_fast.hamming_topk(q.words, g.words, k)
    if be == "triton":
        return _triton_topk(q.words, g.words, k)
    return _ref_topk(q.words, g.words, k)


def rank(query_codes, gallery_codes, *, zero_one: bool = False, backend: str = "auto"):
    """The full ranking of the gallery for every query: :func:`topk` with k = G
    (Q x G int32 distances and int64 indices: 12 bytes per pair, so chunk large query sets)."""
    q, g = _pair(query_codes, gallery_codes, zero_one)
    return topk(q, g, g.words.shape[0], backend=backend)


def _labels(name: str, labels, n: int, n_name: str) -> torch.Tensor:
    """Validate labels; returns int64 (n,) class ids or bool (n, L) multi-hot."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dim() not in (1, 2):
        raise ValueError(f"{name} must be (n,) class ids or (n, L) multi-hot, got shape "
                         f"{tuple(labels.shape)}")
    if labels.shape[0] != n:
        raise ValueError(f"{name} has {labels.shape[0]} rows but {n_name} has {n} codes")
    labels = labels.detach()
    if labels.dim() == 1:
        if not _is_integer(labels.dtype):
            raise TypeError(f"{name} (1-D class ids) must have an integer dtype, got {labels.dtype}"
                            " (multi-label relevance needs (n, L) multi-hot)")
        return labels.to(torch.int64)
    if labels.shape[1] < 1:
        raise ValueError(f"{name} multi-hot must have at least one label column")
    if labels.dtype == torch.bool:
        return labels
    if labels.is_complex() or not (labels.is_floating_point() or _is_integer(labels.dtype)):
        raise TypeError(f"{name} must have an integer, float or bool dtype, got {labels.dtype}")
    if not bool(((labels == 0) | (labels == 1)).all()):
        raise ValueError(f"{name} (n, L) multi-hot must contain only 0 and 1")
    return labels == 1


def average_precision(query_codes, query_labels, gallery_codes, gallery_labels, *,
                      zero_one: bool = False, backend: str = "auto"):
    """Per-query average precision over the whole Hamming ranking (ties by gallery index).

    Returns ``(ap, num_relevant)``: float64 (Q,) and int64 (Q,) CPU-or-input-device tensors;
    ``ap`` is NaN for a query with no relevant gallery item.  Arguments as in
    :func:`mean_average_precision`."""
    q, g = _pair(query_codes, gallery_codes, zero_one)
    ql = _labels("query_labels", query_labels, q.words.shape[0], "query_codes")
    gl = _labels("gallery_labels", gallery_labels, g.words.shape[0], "gallery_codes")
    if ql.dim() != gl.dim() or (ql.dim() == 2 and ql.shape[1] != gl.shape[1]):
        raise ValueError(f"query_labels {tuple(ql.shape)} and gallery_labels {tuple(gl.shape)} "
                         "must both be (n,) class ids or both (n, L) multi-hot with the same L")
    if ql.device != q.words.device or gl.device != q.words.device:
        raise ValueError("labels must be on the same device as the codes")
    be = _resolve_backend(backend, q.words, q.nbits)
    if be == "cpu":
        if ql.dim() == 2:  # multi-hot -> packed words, relevance = (q & g) != 0
            ql, gl = _pack_bits(ql), _pack_bits(gl)
        return torch.ops.nac_fast.hamming_average_precision(q.words, g.words, ql, gl)
    if be == "triton":
        if ql.dim() == 2:
            ql, gl = _pack_bits_torch(ql), _pack_bits_torch(gl)
        return _triton_kernels().average_precision(q.words, g.words, ql, gl, q.nbits)
    return _ref_average_precision(q.words, g.words, ql, gl)


def mean_average_precision(query_codes, query_labels, gallery_codes, gallery_labels, *,
                           zero_one: bool = False, backend: str = "auto",
                           return_num_queries: bool = False):
    """mAP@all of Hamming-ranking retrieval, as in the paper's hashing tables (docs/math.md [M:ap]).

    query_codes (Q, D), gallery_codes (G, D): +-1 codes (bool: True = +1), or 0/1 with
    ``zero_one=True``, or :class:`PackedCodes`.  query_labels / gallery_labels: (n,) integer
    class ids (relevant = same class) or (n, L) 0/1 multi-hot (relevant = shares a label).
    Each query ranks the whole gallery by Hamming distance, ties broken by gallery index
    [M:rank], and its AP is the precision averaged over its R relevant items [M:ap].

    Queries with no relevant gallery item (R = 0) have no AP and are **skipped**: the mean is over
    the other queries.  With ``return_num_queries=True`` the result is ``(map, num_used)``.  If
    no query has a relevant item the mAP is NaN.

    Errors: TypeError / ValueError naming the argument for non-tensors, wrong dtypes, codes that
    are not +-1 (or 0/1), mismatched bit counts, label shapes that do not match the codes, and
    empty query or gallery sets.
    """
    ap, nrel = average_precision(query_codes, query_labels, gallery_codes, gallery_labels,
                                 zero_one=zero_one, backend=backend)
    used = nrel > 0
    n_used = int(used.sum())
    m = float(ap[used].sum() / n_used) if n_used else math.nan
    return (m, n_used) if return_num_queries else m


# --------------------------------------------------------------------------------------------
# Expressivity statistics
# --------------------------------------------------------------------------------------------

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

    # Names before the rename of docs/math.md [M:stats] (read-only, not in as_dict()).
    @property
    def bit_balance(self) -> torch.Tensor:
        """Old name of bit_freq [M:bit-freq]."""
        return self.bit_freq

    @property
    def balance_mean_abs_deviation(self) -> float:
        """Old name of balance_dev [M:balance-dev]."""
        return self.balance_dev

    @property
    def balance_min(self) -> float:
        """Old name of bit_freq_min [M:bit-freq]."""
        return self.bit_freq_min

    @property
    def balance_max(self) -> float:
        """Old name of bit_freq_max [M:bit-freq]."""
        return self.bit_freq_max


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
            words, nbits = _check_packed("codes", codes)
            bits = _unpack_bits(words, nbits)
        else:
            _check_tensor("codes", codes)
            if codes.dim() != 2:
                raise ValueError(f"codes must be 2-D (n, D), got shape {tuple(codes.shape)}")
            if codes.dtype == torch.bool:
                bits = codes
            elif zero_one:
                bits = _code_bits("codes", codes, True)
            else:
                if codes.is_complex() or not (codes.is_floating_point() or _is_integer(codes.dtype)):
                    raise TypeError(f"codes must have a real or bool dtype, got {codes.dtype}")
                if codes.is_floating_point() and not bool(torch.isfinite(codes).all()):
                    raise ValueError("codes contains NaN or inf")
                bits = codes.detach() >= 0
            if bits.shape[0] < 1 or bits.shape[1] < 1:
                raise ValueError(f"codes must be non-empty, got shape {tuple(bits.shape)}")
            words = _pack_bits(bits)
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
