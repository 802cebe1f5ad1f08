"""Audit of the Hamming engines against a brute-force numpy oracle written here (distances by
counting differing bits, rankings by np.lexsort on (distance, gallery index), AP / mAP@K / P@N /
P@H<=r from their definitions in docs/math.md [M:rank], [M:ap], [M:ap-at-k], [M:radius],
[M:precision-at-n]), on code lengths that are not multiples of 8 / 32 / 64 bits, tiny galleries,
K > G, massive ties and multi-hot labels; and a regression test: the Triton top-k read
non-contiguous packed words (a PackedCodes whose words are a transposed or column-sliced view)
as if they were contiguous, and returned wrong neighbours without an error.

Triton runs on CUDA tensors on a GPU machine, on CPU tensors under TRITON_INTERPRET=1 (set by
tests/conftest.py where there is no GPU), as in tests/test_hamming_gpu.py."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import nac_fast as H
from nac_fast.kernels import hamming_triton as HT
from test_hamming_gpu import SKIP_REASON, TRITON_DEVICE, triton_runs


def _engine_device(backend):
    if backend == "triton":
        if not triton_runs():
            pytest.skip(SKIP_REASON)
        return TRITON_DEVICE
    if backend == "cpu" and "cpu" not in H.available_backends("cpu", op="hamming"):
        pytest.skip("the compiled hamming kernel is not built")
    return "cpu"


def _np_dist(q, g):
    return (q[:, None, :] != g[None, :, :]).sum(-1)


def _np_rel(ql, gl):
    if ql.ndim == 1:
        return ql[:, None] == gl[None, :]
    return (ql.astype(np.int64) @ gl.astype(np.int64).T) > 0


def _np_topk(d, k):
    idx = np.stack([np.lexsort((np.arange(d.shape[1]), row))[:k] for row in d])
    return np.take_along_axis(d, idx, 1), idx


def _np_scores(q, ql, g, gl, ks, ns, radii):
    d, rel = _np_dist(q, g), _np_rel(ql, gl)
    Q, G = d.shape
    aps, map_at, p_at, p_r = [], dict.fromkeys(ks, 0.0), dict.fromkeys(ns, 0.0), dict.fromkeys(radii, 0.0)
    for i in range(Q):
        r = rel[i][np.lexsort((np.arange(G), d[i]))].astype(np.float64)
        prec = np.cumsum(r) / np.arange(1, G + 1) * r
        if r.sum() > 0:
            aps.append(prec.sum() / r.sum())
        for k in ks:
            h = r[:min(k, G)].sum()
            map_at[k] += prec[:min(k, G)].sum() / h / Q if h else 0.0
        for n in ns:
            p_at[n] += r[:n].sum() / n / Q
        for rr in radii:
            m = d[i] <= rr
            p_r[rr] += (rel[i][m].sum() / m.sum()) / Q if m.any() else 0.0
    return (np.mean(aps) if aps else math.nan), map_at, p_at, p_r


def _pm1(b):
    return torch.from_numpy(b.astype(np.float32) * 2 - 1)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("D", [1, 7, 31, 33, 63, 65, 127, 129, 257])
def test_engines_match_the_oracle_on_odd_code_lengths(backend, D):
    dev = _engine_device(backend)
    rng = np.random.default_rng(D)
    Q, G = 3, 97
    q = rng.random((Q, D)) < 0.5
    g = (rng.random((4, D)) < 0.5)[rng.integers(0, 4, G)]  # 4 distinct codes: ties everywhere
    g[5] = q[0]                                            # a query equal to a gallery item
    ql, gl = rng.integers(-3, 1, Q), rng.integers(-3, 1, G)  # negative class ids
    ql[2] = 7                                              # a query with no relevant item
    d = _np_dist(q, g)
    got = H.hamming_distance(_pm1(q).to(dev), _pm1(g).to(dev), backend=backend).cpu()
    assert got.dtype == torch.int32 and np.array_equal(got.numpy(), d)
    for k in (1, 5, G):
        td, ti = H.topk(_pm1(q).to(dev), _pm1(g).to(dev), k, backend=backend)
        ed, ei = _np_topk(d, k)
        assert td.dtype == torch.int32 and ti.dtype == torch.int64
        assert np.array_equal(td.cpu().numpy(), ed) and np.array_equal(ti.cpu().numpy(), ei)
    ks, ns, radii = (1, 10, G, G + 5), (1, G), tuple(sorted({0, min(2, D), D}))
    want = _np_scores(q, ql, g, gl, ks, ns, radii)
    r = H.retrieval_metrics(_pm1(q).to(dev), torch.from_numpy(ql).to(dev), _pm1(g).to(dev),
                            torch.from_numpy(gl).to(dev), topk=ks, at_n=ns, radius=radii,
                            backend=backend)
    assert r["queries_with_relevant"] == 2
    assert r["map_all"] == pytest.approx(want[0], abs=1e-12)
    for k in ks:
        assert r["map_at"][k] == pytest.approx(want[1][k], abs=1e-12)
    for n in ns:
        assert r["precision_at_n"][n] == pytest.approx(want[2][n], abs=1e-12)
    for rr in radii:
        assert r["precision_within_radius"][rr] == pytest.approx(want[3][rr], abs=1e-12)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("L", [63, 65, 130])
def test_engines_match_the_oracle_with_multi_hot_labels(backend, L):
    dev = _engine_device(backend)
    rng = np.random.default_rng(L)
    Q, G, D = 6, 80, 70
    q, g = rng.random((Q, D)) < 0.5, rng.random((G, D)) < 0.5
    ql, gl = rng.random((Q, L)) < 3 / L, rng.random((G, L)) < 3 / L
    ql[0] = False
    want = _np_scores(q, ql, g, gl, (5,), (5,), (30,))
    for cast in (lambda t: t, lambda t: t.long(), lambda t: t.float()):
        r = H.retrieval_metrics(torch.from_numpy(q).to(dev), cast(torch.from_numpy(ql)).to(dev),
                                torch.from_numpy(g).to(dev), cast(torch.from_numpy(gl)).to(dev),
                                topk=(5,), at_n=(5,), radius=(30,), backend=backend)
        assert r["map_all"] == pytest.approx(want[0], abs=1e-12)
        assert r["map_at"][5] == pytest.approx(want[1][5], abs=1e-12)
        assert r["precision_at_n"][5] == pytest.approx(want[2][5], abs=1e-12)
        assert r["precision_within_radius"][30] == pytest.approx(want[3][30], abs=1e-12)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_all_equal_codes_rank_by_gallery_index(backend):
    dev = _engine_device(backend)
    g = torch.ones(300, 13)
    q = torch.ones(2, 13)
    q[1, 0] = -1
    for k in (1, 128, 129, 300):
        d, i = H.topk(q.to(dev), g.to(dev), k, backend=backend)
        assert torch.equal(i.cpu(), torch.arange(k).expand(2, k))
        assert torch.equal(d.cpu(), torch.tensor([[0], [1]], dtype=torch.int32).expand(2, k))


@pytest.fixture
def small_engine(monkeypatch):
    """The Triton top-k's constants shrunk (as tests/test_hamming_gpu.py does) so that a small
    gallery takes the sampled bound and the filter kernel, not the outright path."""
    monkeypatch.setattr(HT, "BASE_ROWS", 24)
    monkeypatch.setattr(HT, "SAMPLE_RATIO", 3)
    monkeypatch.setattr(HT, "BASE_PAIRS", 256)


def test_triton_topk_of_non_contiguous_packed_words(small_engine):
    """Before the fix: kernels/hamming_triton.py topk passed the words on as they were, and the
    filter kernel reads query word w of row i at i * W + w and gallery word w at
    row * stride(0) + w: with column-major words (stride (1, n)) every query and gallery word
    was read from the wrong place (5 queries x 200 codes of 100 bits: all three layouts wrong)."""
    dev = _engine_device("triton")
    rng = np.random.default_rng(0)
    D = 100
    q = torch.from_numpy(rng.random((5, D)) < 0.5)
    g = torch.from_numpy(rng.random((200, D)) < 0.5)
    pq, pg = H.pack_codes(q), H.pack_codes(g)
    want_d, want_i = H.topk(pq, pg, 3, backend="reference")

    def col_major(p):  # the same words, stored column-major
        return H.PackedCodes(p.words.t().contiguous().t().to(dev), p.nbits)

    def col_slice(p):  # the same words, the first half of a wider row
        return H.PackedCodes(torch.cat([p.words, p.words], 1).to(dev)[:, :p.words.shape[1]],
                             p.nbits)

    on = lambda p: H.PackedCodes(p.words.to(dev), p.nbits)  # noqa: E731
    for a, b in [(col_major(pq), on(pg)), (on(pq), col_major(pg)), (col_major(pq), col_major(pg)),
                 (col_slice(pq), col_slice(pg))]:
        assert not (a.words.is_contiguous() and b.words.is_contiguous())
        d, i = H.topk(a, b, 3, backend="triton")
        assert torch.equal(d.cpu(), want_d) and torch.equal(i.cpu(), want_i)
    # the bound alone (hamming_triton.kth_bound) on the same views
    t = HT.kth_bound(col_major(pq).words, col_major(pg).words, 3)
    assert torch.equal(t.cpu(), HT.kth_bound(on(pq).words, on(pg).words, 3).cpu())
    assert bool((t.cpu() >= want_d[:, -1]).all())
