"""The hashing metrics as the literature reports them (nac_fast/ops/retrieval.py, docs/math.md
[M:ap-at-k], [M:radius], [M:pr-curve], [M:precision-at-n]) against numpy oracles written from the
definitions: awkward sizes (1, 3, 97, 1031, 4099), few bits (heavy ties), single- and multi-label
relevance, every backend that runs here.

Also: the default query chunk of the histogram passes (pr / radius), sized by the code length so
that its histograms stay within 64 MiB at MAX_BITS; radius=None named in its error."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import nac_fast
from nac_fast.ops import dispatch, retrieval
from nac_fast.ops.codes import MAX_BITS, PackedCodes
from test_hamming_gpu import SKIP_REASON, moved, triton_runs


@pytest.fixture(params=["reference", "cpu", "triton"])
def backend(request):
    """Each backend on its device: "triton" on CUDA tensors on a GPU machine, on CPU tensors
    under TRITON_INTERPRET=1 (test_hamming_gpu.moved)."""
    if request.param == "triton":
        if not triton_runs():
            pytest.skip(SKIP_REASON)
        return request.param
    why = dispatch.available_backends("cpu", op="hamming", reasons=True)[request.param]
    if why is not None:
        pytest.skip(f"{request.param}: {why}")
    return request.param


def np_oracle(q, ql, g, gl, ks, ns, radii):
    """Every metric from its definition, one query at a time (ties by gallery index)."""
    Q, G, D = q.shape[0], g.shape[0], q.shape[1]
    d = (q[:, None, :] != g[None, :, :]).sum(-1)
    if ql.ndim == 1:
        rel = ql[:, None] == gl[None, :]
    else:
        rel = (ql[:, None, :] & gl[None, :, :]).any(-1)
    out = {"ap_all": [], "ap_at": {k: [] for k in ks}, "p_at": {n: [] for n in ns},
           "p_rad": {r: [] for r in radii}, "empty": {r: [] for r in radii},
           "pr_prec": [[] for _ in range(D + 1)], "pr_rec": [[] for _ in range(D + 1)]}
    for i in range(Q):
        order = np.lexsort((np.arange(G), d[i]))  # by distance, then by gallery index
        r = rel[i][order]
        R = r.sum()
        if R:
            hits = np.cumsum(r)
            out["ap_all"].append(float(np.mean(hits[r] / (np.flatnonzero(r) + 1))))
        for k in ks:
            top = r[:k]
            t = top.sum()  # DeepHash-pytorch CalcTopMap: 0 when none, mean over all queries
            out["ap_at"][k].append(0.0 if t == 0 else
                                   float(np.mean(np.arange(1, t + 1) / (np.flatnonzero(top) + 1))))
        for n in ns:
            out["p_at"][n].append(r[:n].sum() / n)
        for rad in range(D + 1):
            ball = d[i] <= rad
            nb = ball.sum()
            p = rel[i][ball].sum() / nb if nb else None
            if rad in radii:
                out["p_rad"][rad].append(0.0 if p is None else p)
                out["empty"][rad].append(nb == 0)
            if p is not None:
                out["pr_prec"][rad].append(p)
            if R:
                out["pr_rec"][rad].append(rel[i][ball].sum() / R)
    return {
        "map_all": float(np.mean(out["ap_all"])) if out["ap_all"] else math.nan,
        "used": len(out["ap_all"]),
        "map_at": {k: float(np.mean(v)) for k, v in out["ap_at"].items()},
        "p_at": {n: float(np.mean(v)) for n, v in out["p_at"].items()},
        "p_rad": {r: float(np.mean(v)) for r, v in out["p_rad"].items()},
        "empty": {r: float(np.mean(v)) for r, v in out["empty"].items()},
        "pr_prec": [float(np.mean(v)) if v else math.nan for v in out["pr_prec"]],
        "pr_rec": [float(np.mean(v)) if v else math.nan for v in out["pr_rec"]],
    }


def _data(seed, nq, ng, bits, classes=None, L=None, p_flip=0.2):
    """Clustered +-1 codes (so that rankings are not noise) with class or multi-hot labels."""
    rng = np.random.default_rng(seed)
    protos = rng.choice([-1.0, 1.0], size=(max(classes or L, 1), bits))

    def draw(n):
        lab = rng.integers(0, protos.shape[0], n)
        flip = np.where(rng.random((n, bits)) < p_flip, -1.0, 1.0)
        return protos[lab] * flip, lab
    q, qlab = draw(nq)
    g, glab = draw(ng)
    if L:  # multi-hot: the prototype's label plus random others
        qlab = (np.eye(L, dtype=bool)[qlab]) | (rng.random((nq, L)) < 0.15)
        glab = (np.eye(L, dtype=bool)[glab]) | (rng.random((ng, L)) < 0.15)
    return q.astype(np.float32), qlab, g.astype(np.float32), glab


CASES = [  # (nq, ng, bits, classes, L)
    (1, 1, 1, 2, None), (3, 3, 3, 2, None), (97, 97, 7, 5, None), (3, 1031, 65, 10, None),
    (3, 4099, 3, 3, None), (5, 1031, 128, None, 6), (97, 300, 7, None, 4), (1, 4099, 200, 7, None),
]


@pytest.mark.parametrize("nq,ng,bits,classes,L", CASES)
def test_metrics_match_numpy_oracle(backend, nq, ng, bits, classes, L):
    q, ql, g, gl = _data(nq * 1000 + ng + bits, nq, ng, bits, classes, L)
    ks = sorted({1, min(5, ng), ng, ng + 7, 1000})
    ns = sorted({1, min(3, ng), ng})
    radii = sorted({0, min(2, bits), bits})
    want = np_oracle(q > 0, ql, g > 0, gl, ks, ns, radii)
    T = torch.from_numpy
    got = moved(backend).retrieval_metrics(T(q), T(ql), T(g), T(gl), topk=ks, at_n=ns,
                                           radius=radii, pr=True, backend=backend)
    np.testing.assert_allclose(got["map_all"], want["map_all"], rtol=1e-12)
    assert got["queries_with_relevant"] == want["used"]
    for k in ks:
        np.testing.assert_allclose(got["map_at"][k], want["map_at"][k], rtol=1e-12, atol=1e-15)
    for n in ns:
        np.testing.assert_allclose(got["precision_at_n"][n], want["p_at"][n], rtol=1e-12)
    for r in radii:
        np.testing.assert_allclose(got["precision_within_radius"][r], want["p_rad"][r], rtol=1e-12)
        np.testing.assert_allclose(got["empty_ball_fraction"][r], want["empty"][r], rtol=1e-12)
    np.testing.assert_allclose(got["pr_curve"]["precision"], want["pr_prec"], rtol=1e-12)
    np.testing.assert_allclose(got["pr_curve"]["recall"], want["pr_rec"], rtol=1e-12)
    assert got["pr_curve"]["precision_empty_as_zero"][radii[-1]] == pytest.approx(
        got["precision_within_radius"][radii[-1]], rel=1e-12)


def test_query_chunks_do_not_change_the_result():
    q, ql, g, gl = _data(3, 97, 500, 16, 4)
    T = torch.from_numpy
    kw = dict(topk=(10, 100), at_n=(50,), radius=(2,), pr=True)
    a = nac_fast.retrieval_metrics(T(q), T(ql), T(g), T(gl), **kw)
    b = nac_fast.retrieval_metrics(T(q), T(ql), T(g), T(gl), query_chunk=7, **kw)
    assert a.keys() == b.keys()
    for key in a:  # equal up to the order of the float64 sums over the chunks
        x, y = a[key], b[key]
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for k2 in x:
                np.testing.assert_allclose(x[k2], y[k2], rtol=1e-13)
        elif isinstance(x, float):
            np.testing.assert_allclose(x, y, rtol=1e-13)
        else:
            assert x == y


def _codes(n, words, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**62, 2**62, (n, words), generator=g, dtype=torch.int64)


@pytest.mark.slow
def test_hist_chunk_bounds_histogram_memory_at_max_bits(monkeypatch):
    """The default query chunk of retrieval_metrics with histograms (pr / radius) is sized by
    the code length: a fixed 4096 queries made the two (chunk, 64 W + 1) int64 histograms 4.3 GB
    at MAX_BITS (about 14 GB peak with the same-shaped temporaries after them).

    retrieval_metrics(pr=True) on MAX_BITS codes: each call of the retrieval pass gets few
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


def test_map_at_k_hand_example():
    """Ties by gallery index decide the top K; a query with nothing relevant in its top K adds 0
    and still counts in the mean (DeepHash-pytorch), unlike mAP@all, which skips R = 0."""
    g = torch.tensor([[1, 1], [1, -1], [1, 1], [-1, -1]], dtype=torch.float32)
    gl = torch.tensor([0, 1, 1, 0])
    q = torch.tensor([[1, 1], [-1, -1], [1, 1]], dtype=torch.float32)
    ql = torch.tensor([1, 0, 2])  # query 2's class is absent from the gallery
    # query 0: ranking 0 (d0, irrelevant), 2 (d0, rel), 1 (d1, rel), 3 (d2): AP@2 = (1/2)/1
    # query 1: ranking 3 (d0, rel), 1, 0?, ... d: g0=2, g1=1, g2=2, g3=0 -> 3, 1, 0, 2: AP@2 = 1
    m, used = nac_fast.mean_average_precision(q, ql, g, gl, topk=2, return_num_queries=True)
    assert used == 2 and m == pytest.approx((0.5 + 1.0 + 0.0) / 3, rel=1e-15)
    m_all, used_all = nac_fast.mean_average_precision(q, ql, g, gl, return_num_queries=True)
    assert used_all == 2
    assert m_all == pytest.approx(((1 / 2 + 2 / 3) / 2 + (1 + 2 / 3) / 2) / 2, rel=1e-15)


def test_precision_within_radius_counts_empty_balls_as_zero():
    g = torch.tensor([[1, 1, 1, 1], [-1, -1, -1, -1]], dtype=torch.float32)
    gl = torch.tensor([0, 1])
    q = torch.tensor([[1, 1, 1, -1], [1, 1, -1, -1]], dtype=torch.float32)
    ql = torch.tensor([0, 0])
    p, empty = nac_fast.precision_within_radius(q, ql, g, gl, radius=1, return_empty_fraction=True)
    assert (p, empty) == (0.5, 0.5)  # query 0: ball {0} all relevant; query 1: empty -> 0
    assert nac_fast.precision_within_radius(q, ql, g, gl, radius=2) == pytest.approx(0.75)
    curve = nac_fast.pr_curve(q, ql, g, gl)
    assert curve["radius"] == [0, 1, 2, 3, 4]
    assert curve["precision"][1] == 1.0 and curve["precision_empty_as_zero"][1] == 0.5
    assert curve["recall"][4] == 1.0 and curve["nonempty_fraction"][0] == 0.0


def test_precision_at_n_and_bad_arguments():
    q, ql, g, gl = (torch.from_numpy(x) for x in _data(5, 4, 20, 8, 3))
    pn = nac_fast.precision_at_n(q, ql, g, gl, n=(1, 20))
    assert set(pn) == {1, 20} and 0 <= pn[1] <= 1
    with pytest.raises(ValueError, match="at_n values must be <= 20"):
        nac_fast.precision_at_n(q, ql, g, gl, n=21)
    with pytest.raises(ValueError, match="at_n values must be >= 1"):
        nac_fast.precision_at_n(q, ql, g, gl, n=0)
    with pytest.raises(ValueError, match="topk values must be >= 1"):
        nac_fast.mean_average_precision(q, ql, g, gl, topk=0)
    with pytest.raises(TypeError, match="topk must be an int"):
        nac_fast.mean_average_precision(q, ql, g, gl, topk=2.5)
    with pytest.raises(ValueError, match=r"radius values must be ints in \[0, 8\]"):
        nac_fast.precision_within_radius(q, ql, g, gl, radius=9)
    with pytest.raises(ValueError, match="query_labels"):
        nac_fast.pr_curve(q, ql[:2], g, gl)


def test_retrieval_metrics_radius_none_names_the_argument():
    """Before the fix: radius=None raised "'NoneType' object is not iterable"."""
    q = torch.ones(2, 8)
    g = torch.ones(3, 8)
    with pytest.raises(TypeError, match="radius must be an int or a sequence"):
        nac_fast.retrieval_metrics(q, torch.zeros(2, dtype=torch.long), g,
                                   torch.zeros(3, dtype=torch.long), radius=None,
                                   backend="reference")


def test_map_topk_is_one_int_and_flags_are_bools():
    """mean_average_precision takes one K (several: retrieval_metrics), named in the error; the
    return_* switches and progress must be bools, checked before any work."""
    q, ql, g, gl = (torch.from_numpy(x) for x in _data(5, 4, 20, 8, 3))
    for several in ((5, 6), [5], (5,)):
        with pytest.raises(TypeError, match=r"^topk must be an int or None \(for several K: "
                           r"retrieval_metrics\(topk=\(5"):
            nac_fast.mean_average_precision(q, ql, g, gl, topk=several)
    with pytest.raises(TypeError, match="^topk must be an int or None, got True"):
        nac_fast.mean_average_precision(q, ql, g, gl, topk=True)
    r = nac_fast.retrieval_metrics(q, ql, g, gl, topk=(5, 6))
    assert nac_fast.mean_average_precision(q, ql, g, gl, topk=np.int64(5)) == r["map_at"][5]
    for call, name in ((lambda: nac_fast.mean_average_precision(q, ql, g, gl,
                                                                 return_num_queries=1),
                        "return_num_queries"),
                       (lambda: nac_fast.mean_average_precision(q, ql, g, gl, topk=5,
                                                                 return_num_queries="no"),
                        "return_num_queries"),
                       (lambda: nac_fast.precision_within_radius(q, ql, g, gl,
                                                                  return_empty_fraction=1),
                        "return_empty_fraction"),
                       (lambda: nac_fast.retrieval_metrics(q, ql, g, gl, progress=1), "progress"),
                       (lambda: nac_fast.pr_curve(q, ql, g, gl, zero_one=0), "zero_one")):
        with pytest.raises(TypeError, match=f"^{name} must be a bool"):
            call()
