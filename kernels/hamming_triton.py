"""Triton kernels of the Hamming retrieval engine (nac_fast/ops/search.py and
nac_fast/ops/retrieval.py, backend="triton"; nac_fast.HashIndex on a GPU).

Codes are packed in int64 words (nac_fast.ops.codes.PackedCodes); distances are popcounts of
XORed words, docs/math.md [M:hamming].  Nothing of size Q x G exists in the top-k or the
retrieval pass; only :func:`cdist` (hamming_distance, whose output is the Q x G matrix) and the
small exact steps below write distances.

    cdist(q, g)                (Q, G) int32 distances          grid (Q tiles x G tiles,), 1-D
    topk(q, g, k)              the k nearest, ties by gallery index [M:rank], exact
    retrieval(q, g, ...)       per-query AP over the full ranking [M:ap] by counting sort
                               [M:ap-count], the hits and precision sums at rank cut-offs
                               ([M:ap-at-k], [M:precision-at-n]) and the distance histograms
                               ([M:radius], [M:pr-curve]): what the C++ hamming_retrieval returns
    average_precision(...)     retrieval's AP alone

**Top-k** (exact, ties by index [M:rank]; the host side below is kernels/hamming_topk.py,
shared with the CUDA engine nac_fast/ops/hamming_cuda.py, which runs its own filter kernel).  A bound T_q >= the k-th smallest distance of each query
comes first: the exact k-th distance over a strided sample of the gallery (every
SAMPLE_RATIO-th code; recursively, the sample's own bound comes from its sample, down to
BASE_ROWS codes whose distances are computed outright).  Then one pass over the gallery
(``_topk_filter_kernel``: a program owns a block of queries and a contiguous slice of the gallery,
walking it tile by tile) keeps, per (query, slice), the first CA items with d < T in gallery order
and the first k items with d == T; a tile with no such item (the usual case once T is tight) costs
one compare per pair and one branch.  The candidates are keys (d << 40 | index), and one
torch.topk over each query's few candidate slots gives the answer: every item of the true top-k is
among them (all items with d < T, and the first k of each slice at d == T), so the result is
exact with ties by index.  A slice holding more than CA items below T (the bound was loose there)
is detected; the query runs again with the k-th distance of its candidates as the bound, which is
strictly lower, so the loop ends.  Memory: the candidate slots, Q x splits x (CA + k) int64, and
the bound's small sample distances; never Q x G.

**Retrieval / AP.**  One program owns a block of BQ queries, one per lane, and a slice of the
gallery; it reads each gallery code once (a broadcast load) for all its queries and walks the
slice in gallery order.  Pass 1 (``_ap_hist_kernel``) counts, per (slice, distance, query), the
items and the relevant items (packed in one int64: count + relevant << 32) in a scratch buffer that
each lane updates at its own address, so no two lanes touch the same word and no atomics are
needed.  Between the passes, torch turns the counts into each slice's starting counters: items of
smaller distance anywhere, plus items of the same distance in earlier slices.  Pass 2
(``_ap_rank_kernel``) walks the slice again from those counters: an item's rank and hits are its
distance's counter after the increment, exactly [M:ap-count]; hits / rank is summed in float64 for
the relevant items (and per rank cut-off).  The sums over slices are taken in a fixed order.

The popcount is ``popc.b64`` (PTX, ``tl.inline_asm_elementwise``) on a GPU, and SWAR on the two
32-bit halves of each word under the interpreter (TRITON_INTERPRET=1, what CI runs on CPU tensors;
it cannot run inline assembly): the constexpr ASM picks, from the tensors' device (a meta tensor,
as tools/compile_check.py plans with, counts as a GPU).  The reference backend of
nac_fast/ops/search.py uses the same SWAR formula in torch ops.
"""
from __future__ import annotations

import math
import sys

import torch
import triton
import triton.language as tl

from . import hamming_topk
from .hamming_topk import EMPTY_KEY, KEY_INDEX_MASK, KEY_SHIFT  # noqa: F401

from .launch import INT32_ROWS_MAX, Launch, cdiv, run, target_of

# The kernels' integer arguments (sizes, slice lengths, slot counts) change from call to call:
# do_not_specialize keeps one compiled kernel per code length and configuration, instead of one
# per pattern of "equals 1 / divisible by 16" among them.

# Bins of the retrieval pass are D + 1 counters per query and gallery slice; nac_fast/ops/search.py
# sends longer codes to the reference backend (distances and top-k have no such limit).
MAX_BITS = 1023

TOPK_MAX_K = 1024                      # larger k: chunked cdist + torch.topk (rank() is Q x G)
SAMPLE_RATIO = 16                      # the bound's sample: every 16th code (+1/16 of the work)
BASE_ROWS = 4096                       # a sample this small: its distances outright
BASE_PAIRS = 1 << 22                   # queries x codes of one outright step (16 MiB int32)
DIRECT_PAIRS = 1 << 24                 # the chunk of the k > TOPK_MAX_K path (12 B a pair)


# --------------------------------------------------------------------------------------------
# Popcount
# --------------------------------------------------------------------------------------------

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
def _popc(x, ASM: tl.constexpr):
    """int32 bit count of int64 words: the POPC instruction on a GPU, SWAR in the interpreter."""
    if ASM:
        c = tl.inline_asm_elementwise("popc.b64 $0, $1;", "=r,l", [x], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        c = _popcount64(x).to(tl.int32)
    return c


# --------------------------------------------------------------------------------------------
# Distances (Q x G): hamming_distance, and the bound's small sample
# --------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["Q", "G"])
def _cdist_kernel(q_ptr, g_ptr, out_ptr, Q, G, W,
                  BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, ASM: tl.constexpr):
    # a 1-D grid over (query tile, gallery tile), query tiles fastest (`cdist_plan`): CUDA caps a
    # grid's second dimension at 65535 blocks, which a (Q tiles, G tiles) grid passed at
    # G > 65535 x BLOCK_G (4.2M codes: hamming_distance, the top-k's chunked path for large k)
    pid = tl.program_id(0)
    nq = tl.cdiv(Q, BLOCK_Q)
    rq = (pid % nq) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rg = (pid // nq) * BLOCK_G + tl.arange(0, BLOCK_G)
    mq = rq < Q
    mg = rg < G
    rq64 = rq.to(tl.int64)
    rg64 = rg.to(tl.int64)
    acc = tl.zeros((BLOCK_Q, BLOCK_G), dtype=tl.int32)
    for w in range(0, W):
        qw = tl.load(q_ptr + rq64 * W + w, mask=mq, other=0)
        gw = tl.load(g_ptr + rg64 * W + w, mask=mg, other=0)
        acc += _popc(qw[:, None] ^ gw[None, :], ASM)
    tl.store(out_ptr + rq64[:, None] * G + rg64[None, :], acc, mask=mq[:, None] & mg[None, :])


# --------------------------------------------------------------------------------------------
# Retrieval: the two passes, one query per lane
# --------------------------------------------------------------------------------------------

@triton.jit
def _lane_words(ptr, rq64, mq, W: tl.constexpr):
    """The first four words of each lane's row (copies of word 0 past W): kept in registers."""
    w0 = tl.load(ptr + rq64 * W, mask=mq, other=0)
    w1 = w0
    w2 = w0
    w3 = w0
    if W > 1:
        w1 = tl.load(ptr + rq64 * W + 1, mask=mq, other=0)
    if W > 2:
        w2 = tl.load(ptr + rq64 * W + 2, mask=mq, other=0)
    if W > 3:
        w3 = tl.load(ptr + rq64 * W + 3, mask=mq, other=0)
    return w0, w1, w2, w3


@triton.jit
def _tile_dist(q_ptr, rq64, mq, q0, q1, q2, q3, g_ptr, rg64, GS, mg, W: tl.constexpr,
               ASM: tl.constexpr):
    """(BQ, U) int32 distances of the lanes' queries to gallery rows rg64 (row stride GS words;
    -1 where not mg)."""
    gb = g_ptr + rg64 * GS
    d = _popc(q0[:, None] ^ tl.load(gb, mask=mg, other=0)[None, :], ASM)
    if W > 1:
        d += _popc(q1[:, None] ^ tl.load(gb + 1, mask=mg, other=0)[None, :], ASM)
    if W > 2:
        d += _popc(q2[:, None] ^ tl.load(gb + 2, mask=mg, other=0)[None, :], ASM)
    if W > 3:
        d += _popc(q3[:, None] ^ tl.load(gb + 3, mask=mg, other=0)[None, :], ASM)
    if W > 4:
        for w in range(4, W):
            qw = tl.load(q_ptr + rq64 * W + w, mask=mq, other=0)
            d += _popc(qw[:, None] ^ tl.load(gb + w, mask=mg, other=0)[None, :], ASM)
    return tl.where(mg[None, :], d, -1)


@triton.jit
def _tile_rel(ql_ptr, rq64, mq, l0, l1, gl_ptr, rg64, mg, LW: tl.constexpr, MULTI: tl.constexpr):
    """(BQ, U) bool: gallery row relevant to the lane's query (same class id; or, multi-hot packed
    in LW words, a shared label) [M:relevance]; False where not mg."""
    if MULTI:
        gb = gl_ptr + rg64 * LW
        hit = l0[:, None] & tl.load(gb, mask=mg, other=0)[None, :]
        if LW > 1:
            hit |= l1[:, None] & tl.load(gb + 1, mask=mg, other=0)[None, :]
        if LW > 2:
            for w in range(2, LW):
                qlw = tl.load(ql_ptr + rq64 * LW + w, mask=mq, other=0)
                hit |= qlw[:, None] & tl.load(gb + w, mask=mg, other=0)[None, :]
        rel = hit != 0
    else:
        rel = l0[:, None] == tl.load(gl_ptr + rg64, mask=mg, other=0)[None, :]
    return rel & mg[None, :]


@triton.jit
def _tile_counts(d, rel, U: tl.constexpr):
    """Within a tile of U rows in gallery order, for each (lane, row): the earlier rows of the
    same distance, those of them that are relevant, all rows of that distance, and the relevant
    ones.  U = 1 (the GPU's step): 0, 0, 1, rel."""
    same = d[:, :, None] == d[:, None, :]                                    # (BQ, U, U)
    u = tl.arange(0, U)
    before = u[None, :, None] > u[None, None, :]
    relv = rel[:, None, :]
    e_all = tl.sum((same & before).to(tl.int64), axis=2)
    e_rel = tl.sum((same & before & relv).to(tl.int64), axis=2)
    n_all = tl.sum(same.to(tl.int64), axis=2)
    n_rel = tl.sum((same & relv).to(tl.int64), axis=2)
    return e_all, e_rel, n_all, n_rel


# --------------------------------------------------------------------------------------------
# Top-k: the filter pass
# --------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["Q", "G", "GS", "L", "CA", "KB", "NSPLIT"])
def _topk_filter_kernel(q_ptr, g_ptr, t_ptr, key_ptr, na_ptr, Q, G, GS, L, CA, KB, NSPLIT,
                        W: tl.constexpr, BQ: tl.constexpr, BG: tl.constexpr,
                        ASM: tl.constexpr):
    """Program (query block, slice s): rows [s L, s L + L) of the gallery view (row stride GS
    words).  Keys d << 40 | row of the first CA rows with d < T and the first KB rows with d == T,
    in row order, into key_ptr[q, s, 0:CA] and [q, s, CA:CA+KB]; the count of rows with d < T
    into na_ptr[q, s]."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    rq = pid * BQ + tl.arange(0, BQ)
    mq = rq < Q
    rq64 = rq.to(tl.int64)
    t = tl.load(t_ptr + rq, mask=mq, other=-1)  # -1: a padding lane takes nothing
    q0, q1, q2, q3 = _lane_words(q_ptr, rq64, mq, W)
    slot0 = key_ptr + (rq64 * NSPLIT + s) * (CA + KB)
    start = s * L
    end = start + tl.minimum(L, G - start)  # not min(s L + L, G): s L + L may pass 2^31 - 1
    cnt_a = tl.zeros([BQ], dtype=tl.int32)
    cnt_b = tl.zeros([BQ], dtype=tl.int32)
    # rows in int32: the gallery is at most MAX_ROWS rows, whose margin keeps g0 + BG and
    # g0 + arange below 2^31 (int64 rows cost a block per SM under Triton 3.6: 128 -> 161
    # registers at 128 bits on sm_90)
    for g0 in range(start, end, BG):
        rg = g0 + tl.arange(0, BG)
        mg = rg < end
        rg64 = rg.to(tl.int64)
        d = _tile_dist(q_ptr, rq64, mq, q0, q1, q2, q3, g_ptr, rg64, GS, mg, W, ASM)
        d = tl.where(mg[None, :], d, 1 << 30)
        lt = d < t[:, None]
        eq = d == t[:, None]
        if tl.max(tl.max((lt | eq).to(tl.int32), axis=1), axis=0) > 0:
            # positions in row order: a running count per query plus the count within the tile
            c = tl.cumsum(lt.to(tl.int32) + (eq.to(tl.int32) << 16), axis=1)
            pa = cnt_a[:, None] + (c & 0xFFFF) - 1
            pb = cnt_b[:, None] + (c >> 16) - 1
            key = (d.to(tl.int64) << 40) | rg64[None, :]
            tl.store(slot0[:, None] + pa, key, mask=lt & (pa < CA))
            tl.store(slot0[:, None] + CA + pb, key, mask=eq & (pb < KB))
            cnt_a += tl.sum(lt.to(tl.int32), axis=1)
            cnt_b += tl.sum(eq.to(tl.int32), axis=1)
    tl.store(na_ptr + rq64 * NSPLIT + s, cnt_a, mask=mq)


@triton.jit(do_not_specialize=["Q", "G", "L", "QP", "NB"])
def _ap_hist_kernel(q_ptr, g_ptr, ql_ptr, gl_ptr, h_ptr, Q, G, L, QP, NB,
                    W: tl.constexpr, LW: tl.constexpr, MULTI: tl.constexpr, BQ: tl.constexpr,
                    U: tl.constexpr, ASM: tl.constexpr):
    """Pass 1.  h[s, d, q] += 1 + (relevant << 32) for every row of slice s (h zeroed); in a
    tile, the last row of each distance adds the tile's count for it, so no two lanes or rows
    write one counter at once."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    rq = pid * BQ + tl.arange(0, BQ)
    mq = rq < Q
    rq64 = rq.to(tl.int64)
    q0, q1, q2, q3 = _lane_words(q_ptr, rq64, mq, W)
    if MULTI:
        l0, l1, l2, l3 = _lane_words(ql_ptr, rq64, mq, LW)
    else:
        l0 = tl.load(ql_ptr + rq64, mask=mq, other=0)
        l1 = l0
    row = h_ptr + s.to(tl.int64) * NB * QP + rq64
    start = s * L
    end = start + tl.minimum(L, G - start)  # not min(s L + L, G): s L + L may pass 2^31 - 1
    for g0 in range(start, end, U):
        rg = g0 + tl.arange(0, U)
        mg = rg < end
        rg64 = rg.to(tl.int64)
        d = _tile_dist(q_ptr, rq64, mq, q0, q1, q2, q3, g_ptr, rg64, W, mg, W, ASM)
        rel = _tile_rel(ql_ptr, rq64, mq, l0, l1, gl_ptr, rg64, mg, LW, MULTI)
        e_all, e_rel, n_all, n_rel = _tile_counts(d, rel, U)
        ok = mq[:, None] & mg[None, :]
        p = row[:, None] + tl.maximum(d, 0).to(tl.int64) * QP
        v = tl.load(p, mask=ok, other=0)
        tl.store(p, v + n_all + (n_rel << 32), mask=ok & (e_all + 1 == n_all))


@triton.jit(do_not_specialize=["Q", "G", "L", "QP", "NB"])
def _ap_rank_kernel(q_ptr, g_ptr, ql_ptr, gl_ptr, c_ptr, psum_ptr, cut_ptr, cps_ptr, chit_ptr,
                    Q, G, L, QP, NB,
                    W: tl.constexpr, LW: tl.constexpr, MULTI: tl.constexpr, NCUT: tl.constexpr,
                    BQ: tl.constexpr, U: tl.constexpr, ASM: tl.constexpr):
    """Pass 2.  c[s, d, q] holds, packed as in pass 1, the items (relevant items) ranked before
    slice s's first item of distance d; walking the slice in order, an item's rank (hits) is its
    distance's counter plus the earlier items of that distance in its tile, plus one (plus one
    if relevant) [M:ap-count].  psum[s, q] = sum over the relevant items of hits / rank; per
    cut-off K (cut_ptr, NCUT of them) cps / chit[s, c, q]: that sum and the count over the
    relevant items of rank <= K (both zeroed)."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    rq = pid * BQ + tl.arange(0, BQ)
    mq = rq < Q
    rq64 = rq.to(tl.int64)
    s64 = s.to(tl.int64)
    q0, q1, q2, q3 = _lane_words(q_ptr, rq64, mq, W)
    if MULTI:
        l0, l1, l2, l3 = _lane_words(ql_ptr, rq64, mq, LW)
    else:
        l0 = tl.load(ql_ptr + rq64, mask=mq, other=0)
        l1 = l0
    row = c_ptr + s64 * NB * QP + rq64
    psum = tl.zeros([BQ], dtype=tl.float64)
    start = s * L
    end = start + tl.minimum(L, G - start)  # not min(s L + L, G): s L + L may pass 2^31 - 1
    for g0 in range(start, end, U):
        rg = g0 + tl.arange(0, U)
        mg = rg < end
        rg64 = rg.to(tl.int64)
        d = _tile_dist(q_ptr, rq64, mq, q0, q1, q2, q3, g_ptr, rg64, W, mg, W, ASM)
        rel = _tile_rel(ql_ptr, rq64, mq, l0, l1, gl_ptr, rg64, mg, LW, MULTI)
        e_all, e_rel, n_all, n_rel = _tile_counts(d, rel, U)
        ok = mq[:, None] & mg[None, :]
        p = row[:, None] + tl.maximum(d, 0).to(tl.int64) * QP
        v = tl.load(p, mask=ok, other=0)
        tl.store(p, v + n_all + (n_rel << 32), mask=ok & (e_all + 1 == n_all))
        take = rel & ok
        rank = (v & 0xFFFFFFFF) + e_all + 1
        hits = (v >> 32) + e_rel + 1
        term = tl.where(take, hits.to(tl.float64) / rank.to(tl.float64), 0.0)
        psum += tl.sum(term, axis=1)
        if NCUT > 0:
            for c in tl.static_range(NCUT):
                m = take & (rank <= tl.load(cut_ptr + c))
                n = tl.sum(m.to(tl.int64), axis=1)
                add = tl.sum(tl.where(m, term, 0.0), axis=1)
                hit = mq & (n > 0)
                pc = cps_ptr + (s64 * NCUT + c) * QP + rq64
                tl.store(pc, tl.load(pc, mask=hit, other=0.0) + add, mask=hit)
                ph = chit_ptr + (s64 * NCUT + c) * QP + rq64
                tl.store(ph, tl.load(ph, mask=hit, other=0) + n, mask=hit)
    tl.store(psum_ptr + s64 * QP + rq64, psum, mask=mq)


# --------------------------------------------------------------------------------------------
# Configurations and plans (kernels/launch.py: the op runs its plan; tools/compile_check.py
# compiles the same plans for sm_80 / sm_90 from meta tensors)
# --------------------------------------------------------------------------------------------

CDIST_BLOCKS = (32, 64)      # (queries, gallery items) per program
# top-k filter: (BQ, BG, warps); the interpreter takes wide numpy steps
TOPK_CONFIG = {"gpu": (32, 32, 4), "interpreter": (32, 256, 1)}
# retrieval passes: (BQ queries = lanes, U gallery rows per loop step, warps): the GPU walks one
# row at a time (U = 1: each lane one counter update a row), the interpreter takes wide numpy
# steps; GPU programs per SM the split aims for (their counters stay in L1 / L2)
AP_CONFIG = {"gpu": (128, 1, 4), "interpreter": (32, 64, 1)}
AP_PROGRAMS_PER_SM = 4
TOPK_WAVES = 2               # top-k programs: two waves of what the GPU keeps resident
TOPK_MIN_TILES = 4           # a top-k slice spans at least this many tiles


def _asm(device: torch.device) -> bool:
    """Inline-PTX popcount: on a GPU (and for the compile check's meta tensors), not in the
    interpreter (CPU tensors)."""
    return device.type != "cpu"


def _target(device: torch.device, target=None):
    if target is not None:
        return target
    if device.type == "meta":  # only planned, for the compile check: an H100
        from .launch import SM90
        return SM90
    return target_of(device)


def _kind(target) -> str:
    return "interpreter" if target.arch == 0 else "gpu"


def cdist_plan(qw: torch.Tensor, gw: torch.Tensor, out: torch.Tensor):
    Q, W = qw.shape
    G = gw.shape[0]
    BQ, BG = CDIST_BLOCKS
    # one grid dimension (gridDim.x: up to 2^31 - 1 programs; y and z stop at 65535)
    return [Launch(_cdist_kernel, (cdiv(Q, BQ) * cdiv(G, BG),), (qw, gw, out, Q, G, W),
                   dict(BLOCK_Q=BQ, BLOCK_G=BG, ASM=_asm(qw.device)), 4, 1, "hamming_cdist")]


def topk_split(Q: int, G: int, programs: int, bq: int, bg: int) -> int:
    """Gallery slices of the filter pass: `programs` programs in all (two waves of what the GPU
    keeps resident), each slice at least TOPK_MIN_TILES tiles long."""
    return max(1, min(cdiv(programs, cdiv(Q, bq)), cdiv(G, bg * TOPK_MIN_TILES)))


def _topk_programs(tg, qw, gview, t) -> int:
    if tg.arch == 0:
        return tg.sms
    bq, bg, warps = TOPK_CONFIG["gpu"]
    one = torch.empty(1, dtype=torch.int64, device=qw.device)
    probe = Launch(_topk_filter_kernel, (1, 1), (qw, gview, t, one, one.to(torch.int32), 1, 1,
                                                  gview.stride(0), bg, 1, 1, 1),
                   dict(W=qw.shape[1], BQ=bq, BG=bg, ASM=_asm(qw.device)), warps, 1)
    return TOPK_WAVES * tg.programs(probe)


topk_capacity = hamming_topk.topk_capacity


def topk_plan(qw, gview, t, k: int, expect: float, target=None, capacity=None):
    """(launches, keys (Q, splits * (CA + k)) int64, na (Q, splits) int32, CA) of the filter pass
    over the gallery view `gview` (rows of W words, any row stride) with bounds t (Q,) int32."""
    Q, W = qw.shape
    G = gview.shape[0]
    tg = _target(qw.device, target)
    bq, bg, warps = TOPK_CONFIG[_kind(tg)]
    nsplit = topk_split(Q, G, _topk_programs(tg, qw, gview, t), bq, bg)
    L = cdiv(cdiv(G, nsplit), bg) * bg
    nsplit = cdiv(G, L)
    ca = capacity if capacity is not None else topk_capacity(k, expect, nsplit)
    keys = torch.full((Q, nsplit * (ca + k)), EMPTY_KEY, dtype=torch.int64, device=qw.device)
    na = torch.empty((Q, nsplit), dtype=torch.int32, device=qw.device)
    L_ = Launch(_topk_filter_kernel, (cdiv(Q, bq), nsplit),
                (qw, gview, t, keys, na, Q, G, gview.stride(0), L, ca, k, nsplit),
                dict(W=W, BQ=bq, BG=bg, ASM=_asm(qw.device)), warps, 1, "hamming_topk")
    return [L_], keys, na, ca


def ap_split(Q: int, G: int, target, bq: int, u: int) -> int:
    programs = target.sms * (1 if target.arch == 0 else AP_PROGRAMS_PER_SM)
    return max(1, min(cdiv(programs, cdiv(Q, bq)), cdiv(G, 16 * u)))


def retrieval_plan(qw, gw, ql, gl, nbits: int, cuts=(), target=None):
    """The two passes' launches and buffers: (hist launch, rank launch, buffers dict).  The rank
    launch reads buffers["start"], which the caller fills from buffers["hist"] between them
    (:func:`retrieval`)."""
    Q, W = qw.shape
    G = gw.shape[0]
    multi = ql.dim() == 2
    LW = ql.shape[1] if multi else 1
    tg = _target(qw.device, target)
    bq, u, warps = AP_CONFIG[_kind(tg)]
    nsplit = ap_split(Q, G, tg, bq, u)
    L = cdiv(cdiv(G, nsplit), u) * u
    nsplit = cdiv(G, L)
    NB = nbits + 1
    QP = cdiv(Q, bq) * bq
    dev = qw.device
    ncut = len(cuts)
    buf = dict(hist=torch.zeros((nsplit, NB, QP), dtype=torch.int64, device=dev),
               start=torch.empty((nsplit, NB, QP), dtype=torch.int64, device=dev),
               psum=torch.empty((nsplit, QP), dtype=torch.float64, device=dev),
               cuts=torch.tensor(list(cuts) or [0], dtype=torch.int64).to(dev),
               cps=torch.zeros((nsplit, max(ncut, 1), QP), dtype=torch.float64, device=dev),
               chit=torch.zeros((nsplit, max(ncut, 1), QP), dtype=torch.int64, device=dev),
               nsplit=nsplit, QP=QP)
    grid = (cdiv(Q, bq), nsplit)
    common = dict(W=W, LW=LW, MULTI=multi, BQ=bq, U=u, ASM=_asm(dev))
    hist = Launch(_ap_hist_kernel, grid, (qw, gw, ql, gl, buf["hist"], Q, G, L, QP, NB),
                  common, warps, 1, "hamming_ap_hist")
    rank = Launch(_ap_rank_kernel, grid,
                  (qw, gw, ql, gl, buf["start"], buf["psum"], buf["cuts"], buf["cps"],
                   buf["chit"], Q, G, L, QP, NB), dict(common, NCUT=ncut), warps, 1,
                  "hamming_ap")
    return hist, rank, buf


def ap_plan(qw, gw, ql, gl, nbits: int, ap: torch.Tensor, nrel: torch.Tensor, target=None):
    """The launches of :func:`average_precision` (both passes; ap / nrel are filled from their
    buffers by torch ops)."""
    hist, rank, _ = retrieval_plan(qw, gw, ql, gl, nbits, (), target)
    return [hist, rank]


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

def cdist(qw: torch.Tensor, gw: torch.Tensor) -> torch.Tensor:
    """(Q, G) int32 Hamming distances of packed codes (int64 words, same word count)."""
    out = torch.empty((qw.shape[0], gw.shape[0]), dtype=torch.int32, device=qw.device)
    run(cdist_plan(qw.contiguous(), gw.contiguous(), out))
    return out


# gallery rows are int32 in the kernels (and counts in 32-bit halves); the margin of 2^16 keeps
# a tile's rows past the gallery's end (the filter's g0 + BG and g0 + arange) below 2^31
MAX_ROWS = INT32_ROWS_MAX


def _check_rows(G: int) -> None:
    if G > MAX_ROWS:
        raise ValueError(f"the Triton Hamming kernels handle galleries of at most {MAX_ROWS:,} "
                         f"codes, got {G:,}: split the gallery")


def _filter(qw, gview, t, k: int, expect: float, capacity=None):
    """The filter pass: (candidate keys (Q, slots), counts below the bound (Q, splits), CA)."""
    launches, keys, na, ca = topk_plan(qw, gview, t, k, expect, capacity=capacity)
    run(launches)
    return keys, na, ca


def _engine():
    """This module as the engine of kernels/hamming_topk.py (its constants read at each call,
    so a test may shrink them)."""
    return sys.modules[__name__]


def kth_bound(qw: torch.Tensor, gview: torch.Tensor, k: int) -> torch.Tensor:
    """(Q,) int32 >= the k-th smallest distance over the rows of gview (hamming_topk.kth_bound).
    gview may stride its rows, not its words; qw is made contiguous."""
    if gview.shape[1] > 1 and gview.stride(1) != 1:
        gview = gview.contiguous()
    return hamming_topk.kth_bound(_engine(), qw.contiguous(), gview, k)


def topk_workspace_bytes(Q: int, G: int, k: int, W: int, device: torch.device) -> int:
    """An upper bound of the GPU memory :func:`topk` allocates beyond its outputs
    (hamming_topk.workspace_bytes), the filter's slices at most MAX_BLOCKS_PER_SM programs per SM,
    whatever the kernel's figure."""
    def nsplit():
        tg = _target(device)
        bq, bg, _ = TOPK_CONFIG[_kind(tg)]
        return topk_split(Q, G, TOPK_WAVES * tg.sms * (1 if tg.arch == 0 else 32), bq, bg)
    return hamming_topk.workspace_bytes(_engine(), Q, G, k, W, nsplit)


def topk(qw: torch.Tensor, gw: torch.Tensor, k: int):
    """The k nearest rows of gw for each row of qw: (int32 distances, int64 indices), (Q, k),
    nearest first, equal distances in index order; exact, no Q x G matrix
    (kernels/hamming_topk.py).  qw, gw: int64 words on one device (any strides: the filter
    kernel reads a query row at qw + row * W and a gallery word at row * stride(0) + w, so both
    are made contiguous here); 1 <= k <= G."""
    _check_rows(gw.shape[0])
    return hamming_topk.topk(_engine(), qw.contiguous(), gw.contiguous(), k)


def retrieval(qw, gw, ql, gl, nbits: int, cuts=(), hist: bool = False):
    """What the C++ ``hamming_retrieval`` returns, on the tensors' device: (ap float64 (Q,) NaN
    without a relevant item, nrel int64 (Q,), hits int64 (Q, C), psum float64 (Q, C),
    hist int64 (Q, nbits + 1), relhist int64 (Q, nbits + 1)); the histograms are (0, nbits + 1)
    unless ``hist``.  ql / gl: int64 (n,) class ids, or int64 (n, LW) packed multi-hot words;
    ``cuts``: rank cut-offs, each in [1, G]."""
    if nbits > MAX_BITS:
        raise ValueError(f"the Triton retrieval kernels handle codes of at most {MAX_BITS} bits, "
                         f"got {nbits}")
    _check_rows(gw.shape[0])
    Q = qw.shape[0]
    qw, gw, ql, gl = (t.contiguous() for t in (qw, gw, ql, gl))
    h_launch, r_launch, buf = retrieval_plan(qw, gw, ql, gl, nbits, tuple(cuts))
    run([h_launch])
    h = buf["hist"]
    # Sums of packed counters are the packed sums (each low half stays below G < 2^31): ranked
    # before slice s's first item of distance d are all items of smaller distance, plus the
    # items of distance d in earlier slices.
    tot = h.sum(0)                                              # (NB, QP)
    torch.cumsum(h, 0, out=buf["start"])
    buf["start"].sub_(h).add_((tot.cumsum(0) - tot)[None])
    run([r_launch])
    tot_c, tot_r = tot & 0xFFFFFFFF, tot >> 32
    nrel = tot_r.sum(0)[:Q]
    psum = buf["psum"].sum(0)[:Q]
    ap = torch.where(nrel > 0, psum / nrel.clamp(min=1).to(torch.float64), math.nan)
    C = len(cuts)
    hits = buf["chit"].sum(0)[:C, :Q].T.contiguous()
    cps = buf["cps"].sum(0)[:C, :Q].T.contiguous()
    NB = nbits + 1
    if hist:
        hh, rh = tot_c[:, :Q].T.contiguous(), tot_r[:, :Q].T.contiguous()
    else:
        hh = torch.zeros((0, NB), dtype=torch.int64, device=qw.device)
        rh = torch.zeros((0, NB), dtype=torch.int64, device=qw.device)
    return ap, nrel, hits, cps, hh, rh


def average_precision(qw, gw, ql, gl, nbits: int):
    """(ap float64 (Q,), num_relevant int64 (Q,)) over the full Hamming ranking, ties by gallery
    index.  ql/gl: int64 (n,) class ids, or int64 (n, LW) packed multi-hot words."""
    return retrieval(qw, gw, ql, gl, nbits)[:2]


# --------------------------------------------------------------------------------------------
# Top-k on the tensor cores (issue 56): the filter pass as int8 products of +-1 codes
# --------------------------------------------------------------------------------------------
#
# (Kept below every other kernel of this file: Triton's compile-cache key holds a kernel's first
# line, and the compile check reuses the committed figures of each unchanged launch by that key.)
#
# A code bit b maps to +1 (clear) or -1 (set); over D real bits, <a, b> = D - 2 d(a, b), so the
# Hamming distance is (D - <a, b>) / 2, exactly, from an int8 x int8 -> int32 product
# [M:hamming].  The queries are unpacked once per filter pass (`unpack_pm1`, torch: (Q, 64 W)
# int8, their padding bits 0 so that those products are 0 whatever the gallery's padding holds);
# the gallery is unpacked on the fly, 32 bits of a word at a time (two int8 products of K = 32 per
# word), from the packed words the popcount kernels read.  The candidates need no scan and no
# branch: every distance below the bound T reserves a slot of its query's pool by an atomic add on
# the query's counter, every distance equal to T one of its tie pool; the counters say how many
# there were.  A pool that overflows is detected from its counter: too many below T, and the
# query runs again with a lower bound, as the popcount engine's does (hamming_topk.topk); too many
# at T (and not below), and the kept ties, taken in no particular order, may miss the first by
# index, so those queries run the ordered popcount filter (`_filter`) at the same bound, whose
# slots for the items below T hold them all (so the answer is exact, ties by index).

TOPK_METHODS = ("popc", "mma")
# The switch point of method="auto" (`topk_method`): codes of at least MMA_MIN_BITS bits take the
# tensor-core filter on a GPU.  None: never, until the GPU suite's `hamming` stage has measured
# both methods on one GPU (hamming_gpu.csv, engine triton-mma; docs/evaluation.md).
MMA_MIN_BITS = None
# (BQ, BG, warps) of the tensor-core filter: BQ >= 16 and BG >= 16 (tl.dot); on sm_90 a warp group
# of 4 warps takes an m64 product
MMA_CONFIG = {"gpu": (64, 64, 4), "interpreter": (16, 64, 1)}


def topk_method(nbits: int, device: torch.device) -> str:
    """What method="auto" runs: "mma" on a GPU for codes of at least MMA_MIN_BITS bits (when it
    is set), else "popc"."""
    if device.type == "cuda" and MMA_MIN_BITS is not None and nbits >= MMA_MIN_BITS:
        return "mma"
    return "popc"


@triton.jit
def _pm1_bits(x, j):
    """(32, n) int8: bit j of each int32 x (n,) as -1 (set) or +1 (clear)."""
    v = ((x[None, :] << (31 - j)[:, None]) >> 31) | 1
    return v.to(tl.int8)


@triton.jit(do_not_specialize=["Q", "G", "GS", "L", "CAP", "NB"])
def _topk_mma_kernel(qb_ptr, g_ptr, t_ptr, pool_ptr, cnt_ptr, Q, G, GS, L, CAP, NB,
                     W: tl.constexpr, BQ: tl.constexpr, BG: tl.constexpr):
    """Program (query block, slice s): rows [s L, s L + L) of the gallery view (row stride GS
    words).  The distance of (query, row) is (NB - <q, g>) / 2 over int8 +-1 bits (qb: (Q, 64 W)
    int8, padding 0).  A row with d < T takes slot cnt[q, 0]++ of pool[q, 0:CAP], one with
    d == T slot cnt[q, 1]++ of pool[q, CAP:2 CAP] (atomic adds, no order), as key d << 40 | row;
    the counters end at the number of such rows (they may exceed CAP: an overflow)."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    rq = pid * BQ + tl.arange(0, BQ)
    mq = rq < Q
    rq64 = rq.to(tl.int64)
    t = tl.load(t_ptr + rq, mask=mq, other=-1)  # -1: a padding lane takes nothing
    j = tl.arange(0, 32)
    qrow = qb_ptr + rq64[:, None] * (64 * W) + j[None, :]
    pool = pool_ptr + rq64 * (2 * CAP)
    start = s * L
    end = start + tl.minimum(L, G - start)  # not min(s L + L, G): s L + L may pass 2^31 - 1
    for g0 in range(start, end, BG):
        rg = g0 + tl.arange(0, BG)
        mg = rg < end
        rg64 = rg.to(tl.int64)
        dot = tl.zeros((BQ, BG), dtype=tl.int32)
        for w in range(0, W):
            word = tl.load(g_ptr + rg64 * GS + w, mask=mg, other=0)
            qa = tl.load(qrow + 64 * w, mask=mq[:, None], other=0)
            dot = tl.dot(qa, _pm1_bits(word.to(tl.int32), j), dot, out_dtype=tl.int32)
            qb = tl.load(qrow + (64 * w + 32), mask=mq[:, None], other=0)
            dot = tl.dot(qb, _pm1_bits((word >> 32).to(tl.int32), j), dot, out_dtype=tl.int32)
        d = tl.where(mg[None, :], (NB - dot) >> 1, 1 << 30)
        lt = d < t[:, None]
        eq = d == t[:, None]
        key = (d.to(tl.int64) << 40) | rg64[None, :]
        cnt = cnt_ptr + rq64[:, None] * 2 + (eq.to(tl.int64))
        slot = tl.atomic_add(cnt, 1, mask=lt | eq, sem="relaxed")
        tl.store(pool[:, None] + eq.to(tl.int64) * CAP + slot, key, mask=(lt | eq) & (slot < CAP))


def unpack_pm1(qw: torch.Tensor, nbits: int) -> torch.Tensor:
    """(Q, 64 W) int8 of packed codes (Q, W) int64: bit b of the code (bit b % 64 of word b // 64)
    as -1 (set) or +1 (clear), 0 past nbits (the padding)."""
    Q, W = qw.shape
    sh = torch.arange(64, device=qw.device, dtype=torch.int64)
    bits = ((qw[:, :, None] >> sh) & 1).reshape(Q, 64 * W).to(torch.int8)
    out = 1 - 2 * bits
    out[:, nbits:] = 0
    return out


def mma_capacity(k: int, expect: float) -> int:
    """Slots of each query's pool (below the bound; its tie pool as many): k, or twice `expect`
    (the items below the bound expected over the whole view) plus 8, if more."""
    return hamming_topk.topk_capacity(k, expect, 1)


def topk_mma_plan(qw, gview, t, k: int, expect: float, nbits: int, target=None, capacity=None):
    """(launches, pool (Q, 2 CAP) int64, counters (Q, 2) int32, CAP, unpacked queries) of the
    tensor-core filter pass over the gallery view `gview` with bounds t (Q,) int32."""
    Q, W = qw.shape
    G = gview.shape[0]
    tg = _target(qw.device, target)
    bq, bg, warps = MMA_CONFIG[_kind(tg)]
    qb = torch.empty((Q, 64 * W), dtype=torch.int8, device=qw.device)
    if qw.device.type != "meta":
        qb.copy_(unpack_pm1(qw, nbits))
    cap = capacity if capacity is not None else mma_capacity(k, expect)
    pool = torch.full((Q, 2 * cap), EMPTY_KEY, dtype=torch.int64, device=qw.device)
    cnt = torch.zeros((Q, 2), dtype=torch.int32, device=qw.device)
    programs = tg.sms if tg.arch == 0 else TOPK_WAVES * tg.programs(
        Launch(_topk_mma_kernel, (1, 1), (qb, gview, t, pool, cnt, 1, 1, gview.stride(0), bg, 1,
                                          nbits), dict(W=W, BQ=bq, BG=bg), warps, 1))
    nsplit = topk_split(Q, G, programs, bq, bg)
    L = cdiv(cdiv(G, nsplit), bg) * bg
    nsplit = cdiv(G, L)
    launch = Launch(_topk_mma_kernel, (cdiv(Q, bq), nsplit),
                    (qb, gview, t, pool, cnt, Q, G, gview.stride(0), L, cap, nbits),
                    dict(W=W, BQ=bq, BG=bg), warps, 1, "hamming_topk_mma")
    return [launch], pool, cnt, cap, qb


def _filter_mma(qw, gview, t, k: int, expect: float, capacity=None, nbits=None):
    """The tensor-core filter pass, as `_filter` answers: (candidate keys (Q, slots), the count
    below the bound (Q, 1), CAP).  Queries whose tie pool overflowed (with none below the bound
    lost) get the k smallest keys of the ordered popcount filter at the same bound instead."""
    nbits = qw.shape[1] * 64 if nbits is None else nbits
    t = t.contiguous()  # the kernel reads t[q] at t + q
    launches, pool, cnt, cap, _ = topk_mma_plan(qw, gview, t, k, expect, nbits,
                                                capacity=capacity)
    run(launches)
    ties_over = (cnt[:, 1] > cap) & (cnt[:, 0] <= cap)
    if bool(ties_over.any()):  # host sync: more items tie at the bound than the tie pool holds
        rows = ties_over.nonzero()[:, 0]
        # slots for every item below the bound in each slice (there are at most cap): exact
        keys, _, _ = _filter(qw[rows], gview, t[rows], k, expect, capacity=cap)
        pool[rows] = EMPTY_KEY
        pool[rows, :k] = hamming_topk.smallest_keys(keys, k)
    return pool, cnt[:, :1], cap


def topk_mma_workspace_bytes(Q: int, G: int, k: int, W: int, device: torch.device) -> int:
    """An upper bound of the GPU memory ``topk_with(..., method="mma")`` allocates beyond its
    outputs: the popcount engine's (:func:`topk_workspace_bytes`: its outright step, and the
    ordered filter of queries whose tie pool overflowed, at most all of them), plus, for the full
    pass, a rerun and the sample levels (3 x), the pools (2 CAP keys a query, and torch.topk's
    copy), the counters and the unpacked queries (with unpack_pm1's int64 bits)."""
    cap = mma_capacity(k, (k - 1) * SAMPLE_RATIO)
    per_query = 2 * cap * 8 * 2 + 2 * 4 + 64 * W * (8 + 1 + 1 + 1)
    return topk_workspace_bytes(Q, G, k, W, device) + 3 * Q * per_query


class _MmaEngine:
    """This module as the engine of kernels/hamming_topk.py with the tensor-core filter:
    the module's constants and distances (the outright base of the bound), `_filter_mma` as the
    filter pass (the sampled bound's levels and the full pass)."""

    def __init__(self, nbits: int):
        self.nbits = nbits

    def __getattr__(self, name):
        return getattr(sys.modules[__name__], name)

    def _filter(self, qw, gview, t, k, expect, capacity=None):
        return sys.modules[__name__]._filter_mma(qw, gview, t, k, expect, capacity, self.nbits)


def _check_method(method) -> str:
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, got {type(method).__name__}")
    if method not in TOPK_METHODS + ("auto",):
        raise ValueError(f"method must be one of {TOPK_METHODS + ('auto',)}, got {method!r}")
    return method


def topk_with(qw: torch.Tensor, gw: torch.Tensor, k: int, method: str = "auto",
              nbits: int | None = None):
    """:func:`topk` by a named method: "popc" (the popcount filter), "mma" (the tensor-core
    filter: int8 products of +-1 codes), "auto" (`topk_method`).  nbits: the codes' real bits
    (default all 64 W; bits past them must be equal in the query and gallery words for "popc",
    and are ignored by "mma")."""
    method = _check_method(method)
    W = qw.shape[1]
    nbits = W * 64 if nbits is None else int(nbits)
    if not 1 <= nbits <= 64 * W:
        raise ValueError(f"nbits must be in [1, {64 * W}] for {W}-word codes, got {nbits}")
    if method == "auto":
        method = topk_method(nbits, qw.device)
    if method == "popc":
        return topk(qw, gw, k)
    _check_rows(gw.shape[0])
    return hamming_topk.topk(_MmaEngine(nbits), qw.contiguous(), gw.contiguous(), k)
