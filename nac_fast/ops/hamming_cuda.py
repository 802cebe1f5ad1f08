"""The Hamming engine's "cuda" backend (op "hamming" of nac_fast/ops/dispatch.py): the CUDA kernels
of csrc/hamming_cuda.cu, through the ops ``torch.ops.nac_fast.hamming_lanes_*``
(csrc/hamming_lanes.cpp).

Each kernel gives a thread one query and a slice of the gallery, walked in index order
(csrc/hamming_lanes.h).  The retrieval passes keep a query's per-distance counters in its thread's
own column of shared memory, so a (query, gallery item) pair costs its popcounts and one
conflict-free shared-memory update, where the Triton kernels (kernels/hamming_triton.py) read and
write an int64 counter in global memory.  docs/gpu.md "The CUDA Hamming engine" has the
design, its floors and predictions.

On CPU tensors the same ops run the kernels' lane functions in emulation: every function here runs
in CI on CPU tensors (tests/test_hamming_cuda.py), on CUDA tensors in the GPU suite's test stage.

    cdist(qw, gw)                                   (Q, G) int32 distances
    topk(qw, gw, k)                                 exact, ties by index (nac_fast/ops/hamming_topk.py)
    retrieval(qw, gw, ql, gl, nbits, cuts, hist)    what the C++ hamming_retrieval returns
    average_precision(qw, gw, ql, gl, nbits)        its AP and relevant counts
"""
from __future__ import annotations

import functools
import math
import sys

import torch

from . import hamming_topk

MAX_BITS = 1024              # 16 words: the kernels' query registers (csrc/hamming_lanes.h)
MAX_ROWS = (1 << 31) - 1     # gallery rows are below 2^31 (counters are 32-bit)
MAX_SLICES = 65535           # gridDim.y

# top-k: the sizes of nac_fast/ops/hamming_topk.py (the Triton engine's)
BASE_ROWS = 4096             # a sample this small: its distances outright
SAMPLE_RATIO = 16            # the bound's sample: every 16th code
BASE_PAIRS = 1 << 22         # queries x codes of one outright step (16 MiB int32)
DIRECT_PAIRS = 1 << 24       # the chunk of the k > TOPK_MAX_K path
TOPK_MAX_K = 1024

FILTER_LANES = 128           # threads per block of the filter pass
FILTER_BLOCKS_PER_SM = 8     # the filter's blocks per SM (32 warps: enough to keep POPC busy;
                             # more would only multiply the candidate slots, Q x slices x (CA + k))
AP_LANES = 32                # threads per block of the retrieval passes: one warp, its own columns
WAVES = 2                    # retrieval blocks: two waves of what the GPU keeps resident
MIN_SLICE_ROWS = 256         # a slice is at least this long (its queries' loads amortised)
THREADS_PER_SM = 2048        # sm_80 / sm_90
BLOCKS_PER_SM = 32
EMULATED_SMS = 4             # CPU tensors: the emulation plans for a 4-SM device (several slices)
EMULATED_SMEM = (227 * 1024, 228 * 1024)   # an H100's per-block opt-in and per-SM shared memory


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _device_props(device: torch.device) -> tuple:
    """(SMs, shared memory per block (opt-in), shared memory per SM) of the tensors' device."""
    if device.type != "cuda":
        return (EMULATED_SMS,) + EMULATED_SMEM
    p = torch.cuda.get_device_properties(device)
    return (p.multi_processor_count, p.shared_memory_per_block_optin,
            p.shared_memory_per_multiprocessor)


def _props(dev: torch.device) -> tuple:
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _device_props(dev)


def _resident(smem_per_block: int, lanes: int, smem_per_sm: int) -> int:
    """Blocks of `lanes` threads one SM keeps resident (threads, blocks, shared memory)."""
    by_smem = smem_per_sm // smem_per_block if smem_per_block else BLOCKS_PER_SM
    return max(1, min(BLOCKS_PER_SM, THREADS_PER_SM // lanes, by_smem))


def _split(Q: int, G: int, lanes: int, resident: int, sms: int, waves: int = WAVES) -> int:
    """Rows per gallery slice: enough (query block, slice) blocks for `waves` waves of `resident`
    blocks per SM, each slice at least MIN_SLICE_ROWS rows, at most MAX_SLICES slices."""
    want = cdiv(waves * resident * sms, cdiv(Q, lanes))
    nsplit = max(1, min(want, cdiv(G, MIN_SLICE_ROWS)))
    L = cdiv(G, nsplit)
    return max(L, cdiv(G, MAX_SLICES))


def check_codes(nbits: int, G: int) -> None:
    if nbits > MAX_BITS:
        raise ValueError(f"backend 'cuda' handles codes of at most {MAX_BITS} bits, got {nbits}; "
                         "use 'triton' or 'reference'")
    if G > MAX_ROWS:
        raise ValueError(f"backend 'cuda' handles galleries of at most {MAX_ROWS:,} codes, got "
                         f"{G:,}: split the gallery")


# --------------------------------------------------------------------------------------------
# Distances and top-k
# --------------------------------------------------------------------------------------------

def cdist(qw: torch.Tensor, gw: torch.Tensor) -> torch.Tensor:
    """(Q, G) int32 Hamming distances of packed codes (int64 words, same word count)."""
    return torch.ops.nac_fast.hamming_lanes_cdist(qw.contiguous(), gw.contiguous())


topk_capacity = hamming_topk.topk_capacity


def filter_slices(Q: int, G: int, device: torch.device) -> int:
    """Rows per slice of the filter pass: one wave of FILTER_BLOCKS_PER_SM blocks per SM."""
    sms, _, _ = _props(device)
    return _split(Q, G, FILTER_LANES, FILTER_BLOCKS_PER_SM, sms, waves=1)


def _filter(qw, gview, t, k: int, expect: float, capacity=None):
    """The filter pass (nac_fast/ops/hamming_topk.py): (candidate keys (Q, slots) int64, counts
    below the bound (Q, splits) int32, CA)."""
    Q, G = qw.shape[0], gview.shape[0]
    L = filter_slices(Q, G, qw.device)
    nsplit = cdiv(G, L)
    ca = capacity if capacity is not None else topk_capacity(k, expect, nsplit)
    keys, na = torch.ops.nac_fast.hamming_lanes_filter(qw, gview, t, L, ca, k, FILTER_LANES)
    return keys, na, ca


def _engine():
    return sys.modules[__name__]


def topk(qw: torch.Tensor, gw: torch.Tensor, k: int):
    """The k nearest rows of gw for each row of qw: (int32 distances, int64 indices), (Q, k),
    nearest first, equal distances in index order; exact, no Q x G matrix."""
    check_codes(qw.shape[1] * 64, gw.shape[0])
    return hamming_topk.topk(_engine(), qw.contiguous(), gw.contiguous(), k)


def topk_workspace_bytes(Q: int, G: int, k: int, W: int, device: torch.device) -> int:
    """An upper bound of the GPU memory :func:`topk` allocates beyond its outputs
    (hamming_topk.workspace_bytes, the Triton engine's formula)."""
    return hamming_topk.workspace_bytes(_engine(), Q, G, k, W,
                                        lambda: cdiv(G, filter_slices(Q, G, device)))


# --------------------------------------------------------------------------------------------
# Retrieval: the two passes [M:ap-count]
# --------------------------------------------------------------------------------------------

def retrieval_lanes(W: int, device: torch.device) -> tuple:
    """(lanes of pass 1, lanes of pass 2): one warp per block, half a warp when a warp's pass-2
    columns (8 bytes per distance and lane) exceed the device's shared memory per block."""
    _, optin, _ = _props(device)
    NB = W * 64 + 1
    rank = AP_LANES
    while rank > 1 and 8 * NB * rank > optin:
        rank //= 2
    hist = AP_LANES
    while hist > 1 and 4 * NB * hist > optin:
        hist //= 2
    return hist, rank


def retrieval_slices(Q: int, G: int, W: int, device: torch.device) -> int:
    """Rows per slice of both passes: blocks for WAVES waves of what pass 2 (the longer, with the
    larger columns) keeps resident."""
    sms, _, per_sm = _props(device)
    _, rank = retrieval_lanes(W, device)
    return _split(Q, G, rank, _resident(8 * (W * 64 + 1) * rank, rank, per_sm), sms)


def retrieval(qw, gw, ql, gl, nbits: int, cuts=(), hist: bool = False):
    """What the C++ ``hamming_retrieval`` returns, on the tensors' device: (ap float64 (Q,) NaN
    without a relevant item, nrel int64 (Q,), hits int64 (Q, C), psum float64 (Q, C),
    hist int64 (Q, nbits + 1), relhist int64 (Q, nbits + 1)); the histograms are (0, nbits + 1)
    unless ``hist``.  ql / gl: int64 (n,) class ids, or int64 (n, LW) packed multi-hot words;
    ``cuts``: rank cut-offs, each in [1, G]."""
    G = gw.shape[0]
    check_codes(nbits, G)
    Q, W = qw.shape
    qw, gw, ql, gl = (x.contiguous() for x in (qw, gw, ql, gl))
    dev = qw.device
    L = retrieval_slices(Q, G, W, dev)
    lanes_hist, lanes_rank = retrieval_lanes(W, dev)
    h = torch.ops.nac_fast.hamming_lanes_ap_hist(qw, gw, ql, gl, L, lanes_hist)   # (S, NB, Q)
    # Sums of packed counters are the packed sums (each low half stays below G < 2^31): ranked
    # before slice s's first item of distance d are all items of smaller distance, plus the
    # items of distance d in earlier slices.
    tot = h.sum(0)                                                               # (NB, Q)
    start = torch.cumsum(h, 0).sub_(h).add_((tot.cumsum(0) - tot)[None])
    del h
    uniq = sorted(set(int(c) for c in cuts))
    cut_t = torch.tensor(uniq, dtype=torch.int64).to(dev)
    psum, cps, chit = torch.ops.nac_fast.hamming_lanes_ap_rank(qw, gw, ql, gl, start, cut_t, L,
                                                              lanes_rank)
    tot_c, tot_r = tot & 0xFFFFFFFF, tot >> 32
    nrel = tot_r.sum(0)
    ap = torch.where(nrel > 0, psum.sum(0) / nrel.clamp(min=1).to(torch.float64), math.nan)
    # bucket c holds the relevant items whose first cut-off at or above their rank is uniq[c]:
    # cut-off c's sums are the buckets' cumulative sums
    order = torch.tensor([uniq.index(int(c)) for c in cuts], dtype=torch.int64).to(dev)
    hits = chit.sum(0).cumsum(0).index_select(0, order).T.contiguous()
    cps_out = cps.sum(0).cumsum(0).index_select(0, order).T.contiguous()
    NB = nbits + 1
    if hist:
        hh, rh = tot_c[:NB].T.contiguous(), tot_r[:NB].T.contiguous()
    else:
        hh = torch.zeros((0, NB), dtype=torch.int64, device=dev)
        rh = torch.zeros((0, NB), dtype=torch.int64, device=dev)
    return ap, nrel, hits, cps_out, hh, rh


def average_precision(qw, gw, ql, gl, nbits: int):
    """(ap float64 (Q,), num_relevant int64 (Q,)) over the full Hamming ranking, ties by gallery
    index.  ql/gl: int64 (n,) class ids, or int64 (n, LW) packed multi-hot words."""
    return retrieval(qw, gw, ql, gl, nbits)[:2]
