"""Audit of the CPU kernels at large or awkward sizes (csrc/hamming.cpp, csrc/nac_cpu.cpp,
csrc/nac_noise.cpp and their Python callers in nac_fast/ops/).

* The default query chunk of retrieval_metrics with histograms (pr / radius) is sized by the code
  length: a fixed 4096 queries made the two (chunk, 64 W + 1) int64 histograms 4.3 GB at MAX_BITS
  (about 14 GB peak with the same-shaped temporaries after them).
* Guards of the engine's limits that the small-size tests do not reach: the largest distance of
  the longest accepted code (65472 bits, stored as uint16), and per-distance counts above 2^16
  (uint32 counters, ranks and record positions).
"""
from __future__ import annotations

import math

import pytest
import torch

import nac_fast
from nac_fast.ops import retrieval
from nac_fast.ops.codes import MAX_BITS, PackedCodes

ops = torch.ops.nac_fast
LEVELS = range(ops.hamming_simd_level() + 1)


def _codes(n, words, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**62, 2**62, (n, words), generator=g, dtype=torch.int64)


def test_hist_chunk_bounds_histogram_memory_at_max_bits(monkeypatch):
    """retrieval_metrics(pr=True) on MAX_BITS codes: each call of the retrieval pass gets few
    enough queries that its two int64 histograms stay within 64 MiB (retrieval._HIST_BYTES);
    before, all of up to 4096 queries went in one call (130 here: 136 MB).  Results equal the
    one-call ones."""
    W = MAX_BITS // 64
    Q, G = 130, 64
    q, g = PackedCodes(_codes(Q, W, 0), MAX_BITS), PackedCodes(_codes(G, W, 1), MAX_BITS)
    gen = torch.Generator().manual_seed(2)
    ql, gl = torch.randint(0, 3, (Q,), generator=gen), torch.randint(0, 3, (G,), generator=gen)
    calls = []
    real = retrieval._pass

    def spy(qc, *args, **kw):
        calls.append(qc.words.shape[0])
        return real(qc, *args, **kw)

    monkeypatch.setattr(retrieval, "_pass", spy)
    kw = dict(topk=(5,), at_n=(10,), radius=(MAX_BITS // 2,), pr=True, backend="cpu")
    got = nac_fast.retrieval_metrics(q, ql, g, gl, **kw)
    assert sum(calls) == Q
    bins = 64 * W + 1
    assert max(calls) * bins * 16 <= 4096 * 1025 * 16, calls  # 64 MiB
    calls.clear()
    want = nac_fast.retrieval_metrics(q, ql, g, gl, query_chunk=Q, **kw)
    assert calls == [Q]
    for key in ("map_all", "queries_with_relevant", "map_at", "precision_at_n",
                "precision_within_radius", "empty_ball_fraction"):
        x, y = got[key], want[key]
        for k in (x if isinstance(x, dict) else [None]):
            a, b = (x[k], y[k]) if k is not None else (x, y)
            assert a == pytest.approx(b, rel=1e-12, nan_ok=True), key
    for key, x in got["pr_curve"].items():
        y = want["pr_curve"][key]
        assert all((math.isnan(u) and math.isnan(v)) or u == pytest.approx(v, rel=1e-12)
                   for u, v in zip(x, y)), key


def test_hist_chunk_unchanged_up_to_1024_bits():
    assert [retrieval.hist_query_chunk(w) for w in (1, 2, 16)] == [4096] * 3
    assert retrieval.hist_query_chunk(MAX_BITS // 64) >= 1


@pytest.mark.parametrize("simd", LEVELS)
def test_longest_code_largest_distance(simd):
    """1023 words (MAX_BITS): the distance 65472 of complementary codes is exact in every path
    (cdist, top-k small and counting, the retrieval histogram's last bin); 1024 words refused."""
    W = MAX_BITS // 64
    q = torch.zeros(2, W, dtype=torch.int64)
    q[1] = -1
    g = torch.full((300, W), -1, dtype=torch.int64)
    g[::2] = 0
    d = ops.hamming_cdist(q, g, simd)
    assert d[0, 1].item() == MAX_BITS and d[0, 0].item() == 0 and d[1, 0].item() == MAX_BITS
    for k in (3, 200):  # k <= 128: tile scan; k > 128: counting sort
        dk, ik = ops.hamming_topk(q, g, k, simd)
        assert ik[0, :3].tolist() == [0, 2, 4]
        assert dk[0, -1].item() == (MAX_BITS if k > 150 else 0)
    out = ops.hamming_retrieval(q, g, torch.zeros(2, dtype=torch.int64),
                                torch.zeros(300, dtype=torch.int64), [1, 151], True, simd)
    assert out[4].shape == (2, MAX_BITS + 1)
    assert out[4][0, MAX_BITS].item() == 150 and out[4][0, 0].item() == 150
    with pytest.raises(RuntimeError, match="at most 1023 words"):
        ops.hamming_cdist(torch.zeros(1, W + 1, dtype=torch.int64),
                          torch.zeros(1, W + 1, dtype=torch.int64))


@pytest.mark.parametrize("simd", LEVELS)
def test_per_distance_counts_above_2_16(simd):
    """70,000 gallery items at one distance: per-distance counts, ranks and the relevant items'
    positions pass 2^16 (uint32 in the kernel); AP, hits and histograms stay exact."""
    G = 70_000
    g = torch.zeros(G, 1, dtype=torch.int64)
    g[G // 2:] = 1  # distance 0 for the first half, 1 for the second
    q = torch.zeros(1, 1, dtype=torch.int64)
    gl = (torch.arange(G) % 3 == 0).to(torch.int64)  # relevant: every third item
    ql = torch.ones(1, dtype=torch.int64)
    ap, nrel, hits, psum, h, rh = ops.hamming_retrieval(q, g, ql, gl, [G // 2, G], True, simd)
    rel = gl == 1
    ranks = torch.arange(1, G + 1, dtype=torch.float64)
    want = (rel.double().cumsum(0) / ranks)[rel].mean().item()
    assert nrel.item() == int(rel.sum())
    assert ap.item() == pytest.approx(want, rel=1e-12)
    assert hits[0].tolist() == [int(rel[:G // 2].sum()), int(rel.sum())]
    assert h[0, :2].tolist() == [G // 2, G // 2]
    assert rh[0, :2].tolist() == [int(rel[:G // 2].sum()), int(rel[G // 2:].sum())]
    dk, ik = ops.hamming_topk(q, g, G, simd)
    assert torch.equal(ik[0], torch.arange(G))
