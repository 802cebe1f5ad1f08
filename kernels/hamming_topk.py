"""The exact top-k of the GPU Hamming engines, shared by the Triton kernels
(kernels/hamming_triton.py) and the CUDA kernels (nac_fast/ops/hamming_cuda.py): ties by gallery
index [M:rank], no Q x G matrix.  Plain PyTorch (no Triton): it sits with the kernels so that
they import nothing of nac_fast.ops (tests/test_layering.py); nac_fast/ops/hamming_topk.py
re-exports it under its former name.

An engine ``E`` (the module or object of one of them) gives
    E.cdist(qw, gw)                                     (Q, G) int32 distances
    E._filter(qw, gview, t, k, expect, capacity=None)   the filter pass: (candidate keys (Q, slots)
                                                        int64, counts below the bound (Q, splits)
                                                        int32, CA slots per split for them)
and its size constants BASE_ROWS, SAMPLE_RATIO, BASE_PAIRS, DIRECT_PAIRS, TOPK_MAX_K (read from E
at each call, so a test may shrink them).

A bound T_q >= the k-th smallest distance of each query comes first: the exact k-th distance over a
strided sample of the gallery (every SAMPLE_RATIO-th code; recursively, the sample's own bound
comes from its sample, down to BASE_ROWS codes whose distances are computed outright).  Then the
filter pass keeps, per (query, slice of the gallery), the first CA items with d < T in gallery order
and the first k items with d == T, as keys d << 40 | index; one torch.topk over each query's
candidates gives the answer: every item of the true top-k is among them (all items with d < T, and
the first k of each slice at d == T), so the result is exact with ties by index.  A slice holding
more than CA items below T (the bound was loose there) is detected; the query runs again with the
k-th distance of its candidates as the bound, which is strictly lower, so the loop ends.
"""
from __future__ import annotations

import math

import torch

KEY_SHIFT = 40                         # top-k candidate key: distance << 40 | gallery index
KEY_INDEX_MASK = (1 << KEY_SHIFT) - 1
EMPTY_KEY = (1 << 63) - 1              # an unused candidate slot


def outright_rows(E, k: int) -> int:
    """A gallery (view) this small gets its k-th distance from the distances outright."""
    return max(E.BASE_ROWS, E.SAMPLE_RATIO * k)


def topk_capacity(k: int, expect: float, nsplit: int) -> int:
    """Slots per (query, slice) for the items below the bound: k, or twice the slice's share of
    `expect` (the items below the bound expected over the whole view) plus 8, if more."""
    return max(int(k), int(math.ceil(2.0 * expect / nsplit)) + 8)


def workspace_bytes(E, Q: int, G: int, k: int, W: int, nsplit_of) -> int:
    """An upper bound of the GPU memory :func:`topk` allocates beyond its outputs: the candidate
    slots and counts of the full pass (keys + torch.topk's copy), of a rerun and of the sample
    levels (each at most as large: 3 x), and the outright step.  nsplit_of(): the engine's
    slices of the filter pass over G rows."""
    if k > E.TOPK_MAX_K or G <= outright_rows(E, k):
        step = max(1, E.DIRECT_PAIRS // max(G, 1))
        return min(Q, step) * G * (4 + 8 + 8) + G * 8
    nsplit = nsplit_of()
    slots = nsplit * (topk_capacity(k, (k - 1) * E.SAMPLE_RATIO, nsplit) + k)
    full = Q * slots * 8 * 2 + Q * nsplit * 4       # keys + topk's copy, counts
    rows = outright_rows(E, k)
    outright = min(Q, max(1, E.BASE_PAIRS // rows)) * (rows * 4 + k * 12) + rows * W * 8
    return 3 * full + outright + Q * 4 * 4         # + the bounds of the levels


def smallest_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(keys, k, dim=1, largest=False, sorted=True).values


def kth_outright(E, qw: torch.Tensor, g: torch.Tensor, k: int) -> torch.Tensor:
    """(Q,) int32: the exact k-th smallest distance of each query over the (small) codes g."""
    step = max(1, E.BASE_PAIRS // g.shape[0])
    out = [torch.topk(E.cdist(qw[s:s + step], g), k, dim=1, largest=False, sorted=True).values[:, -1]
           for s in range(0, qw.shape[0], step)]
    return torch.cat(out)


def kth_bound(E, qw: torch.Tensor, gview: torch.Tensor, k: int) -> torch.Tensor:
    """(Q,) int32 >= the k-th smallest distance over the rows of gview (a view of >= k rows),
    and equal to it unless a slice of the filter pass overflowed: the filter pass over gview under
    the bound of its sample (every SAMPLE_RATIO-th row, recursively); few rows are done outright."""
    S = gview.shape[0]
    if S <= outright_rows(E, k):
        return kth_outright(E, qw, gview.contiguous(), k)
    sample = gview[::E.SAMPLE_RATIO]
    t = kth_bound(E, qw, sample, k)
    keys, _, _ = E._filter(qw, gview, t, k, (k - 1) * S / sample.shape[0])
    # Any k rows' largest distance bounds the k-th smallest: the candidates are real rows even if
    # a slice overflowed, so this holds without checking.
    return (smallest_keys(keys, k)[:, -1] >> KEY_SHIFT).to(torch.int32)


def topk_direct(E, qw: torch.Tensor, gw: torch.Tensor, k: int):
    """Distances in query chunks, then one top-k per chunk on the composite key distance * G +
    index: exact, equal distances in index order.  For k > TOPK_MAX_K and small galleries."""
    G = gw.shape[0]
    dists, idxs = [], []
    step = max(1, E.DIRECT_PAIRS // G)
    ar = torch.arange(G, device=gw.device, dtype=torch.int64)
    for s in range(0, qw.shape[0], step):
        key = E.cdist(qw[s:s + step], gw).to(torch.int64) * G + ar
        kk = torch.topk(key, k, dim=1, largest=False, sorted=True).values
        dists.append(torch.div(kk, G, rounding_mode="floor").to(torch.int32))
        idxs.append(kk % G)
    return torch.cat(dists), torch.cat(idxs)


def topk(E, qw: torch.Tensor, gw: torch.Tensor, k: int):
    """The k nearest rows of gw for each row of qw: (int32 distances, int64 indices), (Q, k),
    nearest first, equal distances in index order.  Exact; no Q x G matrix.
    qw, gw: contiguous int64 words on one device; 1 <= k <= G."""
    G = gw.shape[0]
    if k > E.TOPK_MAX_K or G <= outright_rows(E, k):
        return topk_direct(E, qw, gw, k)
    sample = gw[::E.SAMPLE_RATIO]
    t = kth_bound(E, qw, sample, k)
    expect = (k - 1) * G / sample.shape[0]
    keys, na, ca = E._filter(qw, gw, t, k, expect)
    top = smallest_keys(keys, k)
    over = (na > ca).any(1)
    ca_max = 8 * ca
    while bool(over.any()):  # host sync: a slice held more than CA items below the bound
        rows = over.nonzero()[:, 0]
        # the k-th distance of the candidates: k real rows, all below the old bound, so each
        # round lowers the bound by at least one and the loop ends
        t2 = (top[rows, k - 1] >> KEY_SHIFT).to(torch.int32)
        ca = min(2 * ca, ca_max)
        keys2, na2, ca = E._filter(qw[rows], gw, t2, k, expect, capacity=ca)
        top[rows] = smallest_keys(keys2, k)
        over = torch.zeros_like(over)
        over[rows] = (na2 > ca).any(1)
    return (top >> KEY_SHIFT).to(torch.int32), top & KEY_INDEX_MASK
