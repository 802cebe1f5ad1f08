"""Audit: index / launch arithmetic at the sizes the project states users reach (Hamming: gallery G
up to 100M codes on one GPU, queries Q up to 1e6, k up to 10000, code lengths 1..1024 bits).

The Triton distance kernel (kernels/hamming_triton.py `_cdist_kernel`), which serves
hamming_distance(backend="triton") and the top-k's chunked path for k > TOPK_MAX_K
(nac_fast/ops/hamming_topk.py topk_direct: one query against the whole gallery), was launched on
the grid (Q tiles, G tiles): CUDA caps a grid's second and third dimensions at 65535 blocks, so
any gallery past 65535 x 64 = 4,194,240 codes failed to launch on a GPU (the interpreter, which CI
runs, has no such limit).  The plans are built from meta tensors: nothing is allocated."""
from __future__ import annotations

import pytest
import torch

from nac_fast.kernels import hamming_triton as HT

GRID_X_MAX = (1 << 31) - 1  # CUDA: gridDim.x
GRID_YZ_MAX = 65535         # CUDA: gridDim.y, gridDim.z


def _cuda_grid_ok(grid) -> bool:
    g = tuple(grid) + (1,) * (3 - len(grid))
    return 1 <= g[0] <= GRID_X_MAX and 1 <= g[1] <= GRID_YZ_MAX and 1 <= g[2] <= GRID_YZ_MAX


def _meta(*shape, dtype=torch.int64):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("Q,G,bits", [
    (1, 100_000_000, 64),       # topk_direct's chunk at k > 1024 over 100M codes (step = 1)
    (1, 4_194_241, 1024),       # one code past the old limit, the longest codes
    (16, 6_000_000, 128),
    (1_000_000, 16, 64),        # a million queries against a small gallery
    (2_100_000, 1_000, 64),     # Q tiles past 65535 (hamming_distance, 8.4 GB of output)
])
def test_cdist_grid_fits_cuda_limits(Q, G, bits):
    W = -(-bits // 64)
    launches = HT.cdist_plan(_meta(Q, W), _meta(G, W), _meta(Q, G, dtype=torch.int32))
    for L in launches:
        assert _cuda_grid_ok(L.grid), L.grid
        # every (query tile, gallery tile) pair has a program
        BQ, BG = HT.CDIST_BLOCKS
        assert L.grid[0] * (L.grid[1] if len(L.grid) > 1 else 1) >= \
            -(-Q // BQ) * -(-G // BG)


def test_topk_direct_chunk_grid_at_100m_codes():
    """k = 10000 > TOPK_MAX_K over 100M codes: topk_direct computes one query's distances to
    the whole gallery per step (DIRECT_PAIRS // G = 0 -> 1 query): its cdist launch must fit."""
    G = 100_000_000
    step = max(1, HT.DIRECT_PAIRS // G)
    launches = HT.cdist_plan(_meta(step, 2), _meta(G, 2), _meta(step, G, dtype=torch.int32))
    assert all(_cuda_grid_ok(L.grid) for L in launches), [L.grid for L in launches]


@pytest.mark.parametrize("Q,G", [(1, 1), (33, 65), (70, 129), (5, 300), (64, 64)])
def test_cdist_flattened_grid_values(Q, G):
    """The distances (interpreter on CPU tensors, or the GPU) are those of the reference at
    shapes with partial tiles on both axes: every (query, gallery) pair is covered once."""
    from nac_fast.ops.search import ref_cdist
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(Q * 1000 + G)
    for W in (1, 3):
        qw = torch.randint(-(1 << 62), 1 << 62, (Q, W), generator=gen, dtype=torch.int64)
        gw = torch.randint(-(1 << 62), 1 << 62, (G, W), generator=gen, dtype=torch.int64)
        got = HT.cdist(qw.to(dev), gw.to(dev)).cpu()
        assert torch.equal(got, ref_cdist(qw, gw))
