"""Triton kernels of the Hamming retrieval engine (nac_fast/ops/search.py and
nac_fast/ops/retrieval.py, backend="triton").

Codes are packed in int64 words (nac_fast.ops.codes.PackedCodes); distances are popcounts of
XORed words, docs/math.md [M:hamming].

    hamming_cdist(q, g)             (Q, G) int32 distances             grid (Q tiles, G tiles)
    hamming_average_precision(...)  per-query AP over the full ranking [M:ap], ties by gallery
                                    index [M:rank]

AP without sorting, by counting sort over the D + 1 distances, docs/math.md [M:ap-count] (the
same algorithm as csrc/hamming.cpp).  One program owns one query and makes two passes over the
gallery in index order: pass 1 counts the items and the relevant items per distance; pass 2 walks
the tiles again carrying per-distance counters, and gets the within-tile order of equal distances
from a cumulative sum over a one-hot (tile x bins) matrix.  Nothing of size Q x G exists.  The
sums are float64, like the reference and the C++ kernel.

The popcount is SWAR on the two 32-bit halves of each word (every intermediate non-negative), the
form the interpreter (TRITON_INTERPRET=1, what CI runs on CPU tensors) can execute; the reference
backend of nac_fast/ops/search.py uses the same formula in torch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, cdiv, run

# Bins of the per-distance counters are a power of two >= D + 1; beyond this the one-hot tile no
# longer fits in registers and nac_fast/ops/search.py falls back to the reference backend.
MAX_BITS = 1023


@triton.jit
def _popcount32(x):
    # x: int64 holding a value in [0, 2^32)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    return x & 0x3F


@triton.jit
def _popcount64(x):
    # the arithmetic shift's sign copies are masked off, so a set sign bit is counted once
    return _popcount32(x & 0xFFFFFFFF) + _popcount32((x >> 32) & 0xFFFFFFFF)


@triton.jit
def _cdist_kernel(q_ptr, g_ptr, out_ptr, Q, G, W,
                  BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr):
    rq = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rg = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    mq = rq < Q
    mg = rg < G
    rq64 = rq.to(tl.int64)
    rg64 = rg.to(tl.int64)
    acc = tl.zeros((BLOCK_Q, BLOCK_G), dtype=tl.int32)
    for w in range(0, W):
        qw = tl.load(q_ptr + rq64 * W + w, mask=mq, other=0)
        gw = tl.load(g_ptr + rg64 * W + w, mask=mg, other=0)
        acc += _popcount64(qw[:, None] ^ gw[None, :]).to(tl.int32)
    tl.store(out_ptr + rq64[:, None] * G + rg64[None, :], acc, mask=mq[:, None] & mg[None, :])


@triton.jit
def _tile_dist_rel(q_ptr, g_ptr, ql_ptr, gl_ptr, qrow, rg, mg, W, LW, MULTI: tl.constexpr):
    """Distances (-1 outside the gallery) and relevance of one query against one gallery tile."""
    rg64 = rg.to(tl.int64)
    d = tl.zeros(rg.shape, dtype=tl.int32)
    for w in range(0, W):
        qw = tl.load(q_ptr + qrow * W + w)
        gw = tl.load(g_ptr + rg64 * W + w, mask=mg, other=0)
        d += _popcount64(qw ^ gw).to(tl.int32)
    if MULTI:  # multi-hot labels packed in LW words: relevant = shares a label
        hit = tl.zeros(rg.shape, dtype=tl.int32)
        for w in range(0, LW):
            qlw = tl.load(ql_ptr + qrow * LW + w)
            glw = tl.load(gl_ptr + rg64 * LW + w, mask=mg, other=0)
            hit |= ((qlw & glw) != 0).to(tl.int32)
        rel = (hit != 0) & mg
    else:
        rel = (tl.load(gl_ptr + rg64, mask=mg, other=0) == tl.load(ql_ptr + qrow)) & mg
    return tl.where(mg, d, -1), rel


@triton.jit
def _tile_onehot(q_ptr, g_ptr, ql_ptr, gl_ptr, qrow, g0, G, bins, W, LW, MULTI: tl.constexpr,
                 BLOCK_G: tl.constexpr):
    """(one-hot of each tile item's distance over the bins (BLOCK_G x NB int32, all zero past the
    gallery's end), relevance) for the gallery tile starting at g0."""
    rg = g0 + tl.arange(0, BLOCK_G)
    d, rel = _tile_dist_rel(q_ptr, g_ptr, ql_ptr, gl_ptr, qrow, rg, rg < G, W, LW, MULTI)
    return (d[:, None] == bins[None, :]).to(tl.int32), rel


@triton.jit
def _ap_kernel(q_ptr, g_ptr, ql_ptr, gl_ptr, ap_ptr, nrel_ptr, G, W, LW,
               MULTI: tl.constexpr, NB: tl.constexpr, BLOCK_G: tl.constexpr):
    qrow = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, NB)
    cnt = tl.zeros((NB,), dtype=tl.int32)
    rcnt = tl.zeros((NB,), dtype=tl.int32)
    # pass 1: per-distance counts of all and of relevant items
    for g0 in range(0, G, BLOCK_G):
        oh, rel = _tile_onehot(q_ptr, g_ptr, ql_ptr, gl_ptr, qrow, g0, G, bins, W, LW, MULTI,
                               BLOCK_G)
        cnt += tl.sum(oh, axis=0)
        rcnt += tl.sum(oh * rel.to(tl.int32)[:, None], axis=0)
    R = tl.sum(rcnt, axis=0)
    # counters carried across tiles: items ranked before the current tile's items of distance d
    seen = tl.cumsum(cnt, axis=0) - cnt
    rseen = tl.cumsum(rcnt, axis=0) - rcnt
    psum = tl.zeros((BLOCK_G,), dtype=tl.float64)
    # pass 2: rank and hits of every relevant item, in gallery order
    for g0 in range(0, G, BLOCK_G):
        oh, rel = _tile_onehot(q_ptr, g_ptr, ql_ptr, gl_ptr, qrow, g0, G, bins, W, LW, MULTI,
                               BLOCK_G)
        roh = oh * rel.to(tl.int32)[:, None]
        # inclusive count of same-distance (relevant) items up to each row of the tile
        rank = tl.sum(oh * (tl.cumsum(oh, axis=0) + seen[None, :]), axis=1)
        hits = tl.sum(oh * (tl.cumsum(roh, axis=0) + rseen[None, :]), axis=1)
        psum += tl.where(rel, hits.to(tl.float64) / tl.maximum(rank, 1).to(tl.float64), 0.0)
        seen += tl.sum(oh, axis=0)
        rseen += tl.sum(roh, axis=0)
    total = tl.sum(psum, axis=0)
    ap = tl.where(R > 0, total / tl.maximum(R, 1).to(tl.float64), float("nan"))
    tl.store(ap_ptr + qrow, ap)
    tl.store(nrel_ptr + qrow, R.to(tl.int64))


def _num_bins(nbits: int) -> int:
    return triton.next_power_of_2(nbits + 1)


CDIST_BLOCKS = (32, 64)      # (queries, gallery items) per program
AP_TILE_ELEMS = 8192         # one-hot tile of BLOCK_G x NB int32 in registers


def cdist_plan(qw: torch.Tensor, gw: torch.Tensor, out: torch.Tensor):
    Q, W = qw.shape
    G = gw.shape[0]
    BQ, BG = CDIST_BLOCKS
    return [Launch(_cdist_kernel, (cdiv(Q, BQ), cdiv(G, BG)), (qw, gw, out, Q, G, W),
                   dict(BLOCK_Q=BQ, BLOCK_G=BG), 4, 1, "hamming_cdist")]


def ap_plan(qw, gw, ql, gl, nbits: int, ap: torch.Tensor, nrel: torch.Tensor):
    Q, W = qw.shape
    G = gw.shape[0]
    multi = ql.dim() == 2
    NB = _num_bins(nbits)
    return [Launch(_ap_kernel, (Q,), (qw, gw, ql, gl, ap, nrel, G, W, ql.shape[1] if multi else 1),
                   dict(MULTI=multi, NB=NB, BLOCK_G=max(16, AP_TILE_ELEMS // NB)), 4, 1,
                   "hamming_ap")]


def cdist(qw: torch.Tensor, gw: torch.Tensor) -> torch.Tensor:
    """(Q, G) int32 Hamming distances of packed codes (int64 words, same word count)."""
    out = torch.empty((qw.shape[0], gw.shape[0]), dtype=torch.int32, device=qw.device)
    run(cdist_plan(qw.contiguous(), gw.contiguous(), out))
    return out


def average_precision(qw, gw, ql, gl, nbits: int):
    """(ap float64 (Q,), num_relevant int64 (Q,)) over the full Hamming ranking, ties by gallery
    index.  ql/gl: int64 (n,) class ids, or int64 (n, LW) packed multi-hot words."""
    if nbits > MAX_BITS:
        raise ValueError(f"the Triton AP kernel handles codes of at most {MAX_BITS} bits, got "
                         f"{nbits}")
    Q = qw.shape[0]
    ap = torch.empty(Q, dtype=torch.float64, device=qw.device)
    nrel = torch.empty(Q, dtype=torch.int64, device=qw.device)
    run(ap_plan(qw.contiguous(), gw.contiguous(), ql.contiguous(), gl.contiguous(), nbits, ap,
                nrel))
    return ap, nrel
