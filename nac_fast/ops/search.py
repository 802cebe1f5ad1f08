"""Hamming search: distances, the k nearest, the full ranking (docs/math.md [M:hamming], [M:rank]).

    import nac_fast
    d = nac_fast.hamming_distance(query_codes, gallery_codes)      # (Q, G) int32, small sets only
    d, idx = nac_fast.topk(query_codes, gallery_codes, k=10)       # nearest first, ties by index
    d, idx = nac_fast.rank(query_codes, gallery_codes)             # the full ranking (Q x G)

Codes as in nac_fast/ops/codes.py (+-1, bool, 0/1 with ``zero_one=True``, or PackedCodes).  The
gallery is ranked by **Hamming distance**, ties broken by gallery index [M:rank]; not by the dot
product of {0,1} codes as in the authors' code [M:bug2].  For a saved, searchable collection of
codes with paths and labels, see nac_fast.HashIndex (nac_fast/index).

Backends (``backend=``, chosen by the one dispatcher nac_fast/ops/dispatch.py, op "hamming"):
``"cpu"`` is the compiled kernel ``torch.ops.nac_fast.hamming_*`` of ``nac_fast._C``
(csrc/hamming.cpp: packed words, the best instruction-set level of the CPU chosen at run time:
AVX-512 VPOPCNTDQ, else AVX-512BW or AVX2 nibble-table popcounts, else scalar POPCNT; top-k with
k <= 128 scans query blocks x gallery tiles and rejects a candidate with one compare against the
k-th distance);
``"reference"`` is plain PyTorch, runs on any device and works in query chunks of bounded memory;
``"triton"`` (kernels/hamming_triton.py) runs on CUDA tensors (and on CPU tensors under
``TRITON_INTERPRET=1``, which is how CI tests it); ``"cuda"`` (csrc/hamming_cuda.cu through
nac_fast/ops/hamming_cuda.py: a query per thread, its counters in shared memory) runs on CUDA
tensors when the extension is built with CUDA (CI tests its kernels' lane functions in emulation on
CPU tensors).  ``"auto"`` picks ``"cpu"`` for CPU tensors when the extension is built, ``"triton"``
for CUDA tensors when Triton imports, then ``"cuda"``, else ``"reference"``.
Timings: ``python bench/bench_hamming.py --index`` (top-k over 1M codes) and ``python bench/bench_hamming.py``
(mAP@all), results in bench/results/.

The C++ engine's instruction-set level (every level returns the same integers; what differs is
the speed): the environment variable ``NAC_FAST_HAMMING_ISA`` forces one, read at every call:
``portable`` (plain C++, what a non-x86 CPU runs), ``scalar`` (POPCNT), ``avx2``, ``avx512bw``,
``avx512vpopcnt``, or ``auto`` / unset (the best the CPU has).  A level the CPU lacks, or an
unknown name, is a ValueError naming the variable when a "cpu" search runs.
:func:`cpu_isa_levels` lists the levels this CPU runs, best last.
"""
from __future__ import annotations

import os

import torch

from .. import _checks
from . import dispatch
from .codes import as_packed

__all__ = ["hamming_distance", "topk", "rank", "cpu_isa_levels", "HAMMING_ISA_ENV", "ISA_LEVELS"]

# The C++ engine's instruction-set levels, lowest first: the position is the `simd` argument of
# the torch.ops.nac_fast.hamming_* ops (csrc/hamming.cpp), and each level needs those below it.
ISA_LEVELS = ("portable", "scalar", "avx2", "avx512bw", "avx512vpopcnt")
HAMMING_ISA_ENV = "NAC_FAST_HAMMING_ISA"

# The reference backend works on this many (query, gallery) pairs at a time (int64/float64
# temporaries of ~8 bytes each: ~8 MiB per temporary), so memory stays bounded for any Q.  Larger
# chunks were no faster; the peak RSS varies widely from run to run with the allocator's
# fragmentation (bench/results/cpu_micro.md, "Reference chunk size").
_REF_PAIRS_PER_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------------
# Backend choice
# --------------------------------------------------------------------------------------------

def triton_kernels():
    """kernels/hamming_triton.py (whether it imports: nac_fast.ops.dispatch)."""
    from ..kernels import hamming_triton
    return hamming_triton


def cuda_kernels():
    """nac_fast/ops/hamming_cuda.py: the "cuda" backend's host side."""
    from . import hamming_cuda
    return hamming_cuda


def resolve_backend(backend, words: torch.Tensor, nbits: int | None = None) -> str:
    """The dispatcher's choice for the packed words' device; codes wider than the Triton or CUDA
    kernels' limit go to the reference under "auto" and are refused by an explicit "triton" or
    "cuda"."""
    be = dispatch.resolve_backend(backend, words, op="hamming")
    if be == "cuda":
        width = nbits if nbits is not None else words.shape[-1] * 64
        if width > cuda_kernels().MAX_BITS:
            if backend == "auto":
                return "reference"
            raise ValueError(f"backend 'cuda' handles codes of at most {cuda_kernels().MAX_BITS} "
                             f"bits, got {width}; use 'reference'")
    if be == "triton" and nbits is not None and nbits > triton_kernels().MAX_BITS:
        if backend == "auto":
            return "reference"  # torch ops, chunked, no host round trip
        raise ValueError(f"backend 'triton' handles codes of at most "
                         f"{triton_kernels().MAX_BITS} bits, got {nbits}; use 'reference'")
    return be


def pair(query_codes, gallery_codes, zero_one: bool, *, allow_empty_query: bool = False):
    q = as_packed("query_codes", query_codes, zero_one)
    g = as_packed("gallery_codes", gallery_codes, zero_one)
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


def cpu_isa_levels() -> tuple:
    """The instruction-set levels of the C++ engine this CPU runs, lowest first (the last is what
    ``NAC_FAST_HAMMING_ISA`` unset or ``auto`` runs).  RuntimeError when the extension is not
    built (dispatch.available_backends says why)."""
    why = dispatch.available_backends("cpu", op="hamming", reasons=True)["cpu"]
    if why is not None:
        raise RuntimeError(f"the C++ Hamming engine is not available: {why}")
    return ISA_LEVELS[:int(torch.ops.nac_fast.hamming_simd_level()) + 1]


def cpu_simd() -> int:
    """The `simd` argument for the C++ ops: -1 (the best level) unless ``NAC_FAST_HAMMING_ISA``
    names one; ValueError naming the variable for an unknown name or a level this CPU lacks."""
    name = os.environ.get(HAMMING_ISA_ENV, "").strip().lower()
    if name in ("", "auto"):
        return -1
    if name not in ISA_LEVELS:
        raise ValueError(f"{HAMMING_ISA_ENV} must be one of auto, {', '.join(ISA_LEVELS)}; "
                         f"got {os.environ[HAMMING_ISA_ENV]!r}")
    runs = cpu_isa_levels()
    if name not in runs:
        raise ValueError(f"{HAMMING_ISA_ENV}={name} but this CPU runs only {', '.join(runs)} "
                         f"(best last)")
    return ISA_LEVELS.index(name)


# --------------------------------------------------------------------------------------------
# Reference and Triton search helpers
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


def ref_chunk_rows(g_rows: int, width: int = 1) -> int:
    return max(1, _REF_PAIRS_PER_CHUNK // max(1, g_rows * width))


def ref_cdist(qw: torch.Tensor, gw: torch.Tensor) -> torch.Tensor:
    out = torch.empty((qw.shape[0], gw.shape[0]), dtype=torch.int32, device=qw.device)
    step = ref_chunk_rows(gw.shape[0], gw.shape[1])
    for s in range(0, qw.shape[0], step):
        x = qw[s:s + step, None, :] ^ gw[None, :, :]
        out[s:s + step] = _ref_popcount64(x).sum(-1, dtype=torch.int32)
    return out


def cdist_words(qw: torch.Tensor, gw: torch.Tensor, backend: str) -> torch.Tensor:
    """(Q, G) int32 distances of packed words by a resolved backend (no argument checks)."""
    if backend == "cpu":
        return torch.ops.nac_fast.hamming_cdist(qw, gw, cpu_simd())
    if backend == "triton":
        return triton_kernels().cdist(qw, gw)
    if backend == "cuda":
        return cuda_kernels().cdist(qw, gw)
    return ref_cdist(qw, gw)


def _ref_topk(qw, gw, k: int):
    dists, idxs = [], []
    step = ref_chunk_rows(gw.shape[0], gw.shape[1])
    for s in range(0, qw.shape[0], step):
        d = ref_cdist(qw[s:s + step], gw)
        sd, si = torch.sort(d, dim=1, stable=True)  # stable: equal distances keep index order
        # copies of the k columns: a view would keep each chunk's whole (rows, G) sort alive
        # until the cat, a Q x G matrix in all
        dists.append(sd[:, :k].clone())
        idxs.append(si[:, :k].clone())
    return torch.cat(dists), torch.cat(idxs)


def ref_topk_workspace_bytes(Q: int, G: int, k: int, W: int) -> int:
    """An upper bound of the memory :func:`_ref_topk` allocates beyond its outputs (the GPU
    memory check of nac_fast.HashIndex): per query chunk the XOR words and the popcount's
    temporaries (at most 8 int64 tensors of the chunk's pairs x W words), the (rows, G) int32
    distances, the stable sort's values, int64 indices and its workspace (as much again), and
    the chunks' kept top-k columns."""
    rows = min(Q, ref_chunk_rows(G, W))
    pairs = rows * G
    return pairs * W * 8 * 8 + pairs * (4 + 4 + 8) * 2 + Q * k * 12


def _triton_topk(qw, gw, k: int):
    """kernels/hamming_triton.py's exact top-k: a bound on each query's k-th distance from a
    strided sample, then one filtering pass that keeps a few candidates per query and gallery
    slice; no Q x G matrix (the kernels' module docstring)."""
    return triton_kernels().topk(qw, gw, k)


# --------------------------------------------------------------------------------------------
# Public search API
# --------------------------------------------------------------------------------------------

def hamming_distance(query_codes, gallery_codes, *, zero_one: bool = False,
                     backend: str = "auto") -> torch.Tensor:
    """(Q, G) int32 matrix of Hamming distances (number of differing bits).

    This materialises Q x G integers: meant for small sets and tests.  Use :func:`topk` or
    nac_fast.mean_average_precision on large ones."""
    q, g = pair(query_codes, gallery_codes, zero_one)
    return cdist_words(q.words, g.words, resolve_backend(backend, q.words))


def topk(query_codes, gallery_codes, k: int, *, zero_one: bool = False, backend: str = "auto"):
    """The k nearest gallery items of each query by Hamming distance.

    Returns ``(distances, indices)``: int32 and int64 tensors of shape (Q, k), nearest first,
    equal distances in increasing gallery index (the order of a stable sort).  ``k`` must be in
    [1, G]."""
    q, g = pair(query_codes, gallery_codes, zero_one)
    G = g.words.shape[0]
    k = _checks.integer("k", k, numpy=True)  # as HashIndex.search: a numpy int is an int
    if not 1 <= k <= G:
        raise ValueError(f"k must be in [1, {G}] (the gallery size), got {k}")
    return topk_words(q.words, g.words, k, resolve_backend(backend, q.words))


def topk_words(qw: torch.Tensor, gw: torch.Tensor, k: int, backend: str):
    """:func:`topk` on checked packed words and a resolved backend (nac_fast.HashIndex's path)."""
    if backend == "cpu":
        return torch.ops.nac_fast.hamming_topk(qw, gw, k, cpu_simd())
    if backend == "triton":
        return _triton_topk(qw, gw, k)
    if backend == "cuda":  # the same bound and filter pass, csrc/hamming_cuda.cu's kernels
        return cuda_kernels().topk(qw, gw, k)
    return _ref_topk(qw, gw, k)


def rank(query_codes, gallery_codes, *, zero_one: bool = False, backend: str = "auto"):
    """The full ranking of the gallery for every query: :func:`topk` with k = G
    (Q x G int32 distances and int64 indices: 12 bytes per pair, so chunk large query sets)."""
    q, g = pair(query_codes, gallery_codes, zero_one)
    return topk(q, g, g.words.shape[0], backend=backend)
