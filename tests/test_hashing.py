"""Tests of the Hamming engine (nac_fast/ops: codes.py packing, search.py, retrieval.py mAP@all;
C++ kernel, Triton and torch reference) against brute-force numpy oracles written from the
definitions, plus the code statistics (nac_fast/codestats.py).  The newer retrieval metrics
(mAP@K, P@H<=r, PR curve, P@N) and HashIndex: tests/test_retrieval_metrics.py,
tests/test_index.py.

Also: every engine's distances, top-k and metrics at once against a second oracle on odd code
lengths, multi-hot labels and all-equal codes; the C++ engine at the limits of its counters
(the longest code's largest distance, 2^16 items at one distance); k as a numpy integer."""
from __future__ import annotations

import itertools
import math
import os
import shutil
import subprocess
import sysconfig

import numpy as np
import pytest
import torch

import nac_fast as H
from nac_fast.ops import dispatch
from test_hamming_gpu import SKIP_REASON, TRITON_DEVICE, moved, triton_runs
from nac_fast.eval.metrics import knn_predict
from nac_fast.ops.codes import MAX_BITS, pack_bits_torch
from nac_fast.ops.search import _ref_popcount64

BIT_COUNTS = [1, 7, 64, 65, 128, 200]


# ------------------------------------------------------------------------------------------
# Fixtures and oracles
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def cpu_kernel():
    """The compiled hamming ops of nac_fast._C.  CI sets NAC_FAST_REQUIRE_EXT=1, so there a
    missing kernel fails instead of skipping."""
    why = dispatch.available_backends("cpu", op="hamming", reasons=True)["cpu"]
    if why is not None:
        if os.environ.get("NAC_FAST_REQUIRE_EXT") == "1":
            pytest.fail(f"the hamming C++ kernel is not available: {why}")
        pytest.skip(f"hamming C++ kernel unavailable ({why}): build with pip install "
                    "--no-build-isolation -e .")
    return torch.ops.nac_fast


@pytest.fixture(params=["reference", "cpu", "triton"])
def backend(request):
    """Each backend on its device: "triton" on CUDA tensors on a GPU machine (bench/gpu_suite.sh's
    test stage), on CPU tensors under TRITON_INTERPRET=1 (CI); calls go through on(backend)."""
    if request.param == "cpu":
        request.getfixturevalue("cpu_kernel")
    if request.param == "triton" and not triton_runs():
        pytest.skip(SKIP_REASON)
    return request.param


def on(backend):
    """nac_fast with tensor arguments on `backend`'s device and results back on the CPU."""
    return moved(backend)


def simd_levels(ops):
    return list(range(int(ops.hamming_simd_level()) + 1))


def rand_pm1(rng, n, d):
    return torch.from_numpy(rng.choice([-1.0, 1.0], size=(n, d)).astype(np.float32))


def np_hamming(q: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Number of positions where the +-1 codes differ."""
    return (q[:, None, :] != g[None, :, :]).sum(-1)


def np_relevant(ql, gl, i, j) -> bool:
    if ql.ndim == 1:
        return bool(ql[i] == gl[j])
    return bool(np.any((ql[i] > 0) & (gl[j] > 0)))


def np_average_precision(q, ql, g, gl):
    """From the definition: rank the gallery by (Hamming distance, gallery index); AP = mean over
    relevant items of (#relevant at or before it) / rank; NaN when there is none."""
    d = np_hamming(q, g)
    out = []
    for i in range(q.shape[0]):
        order = sorted(range(g.shape[0]), key=lambda j: (d[i, j], j))
        hits, total = 0, 0.0
        for r, j in enumerate(order, start=1):
            if np_relevant(ql, gl, i, j):
                hits += 1
                total += hits / r
        out.append(total / hits if hits else math.nan)
    return np.array(out)


def np_map(ap: np.ndarray) -> float:
    ok = ~np.isnan(ap)
    return float(ap[ok].mean()) if ok.any() else math.nan


# ------------------------------------------------------------------------------------------
# Packing
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", BIT_COUNTS)
def test_pack_round_trip(bits):
    rng = np.random.default_rng(bits)
    codes = rand_pm1(rng, 37, bits)
    p = H.pack_codes(codes)
    assert p.nbits == bits and p.words.dtype == torch.int64
    assert p.words.shape == (37, (bits + 63) // 64)
    assert torch.equal(H.unpack_codes(p), codes)
    # 0/1 and bool forms pack to the same words
    zo = (codes > 0).to(torch.int64)
    assert torch.equal(H.pack_codes(zo, zero_one=True).words, p.words)
    assert torch.equal(H.pack_codes(codes > 0).words, p.words)
    assert torch.equal(H.unpack_codes(p, zero_one=True, dtype=torch.int64), zo)
    assert torch.equal(H.unpack_codes(p, dtype=torch.bool), codes > 0)
    # the torch-ops packer (used for tensors on other devices) gives the same words
    assert torch.equal(pack_bits_torch(codes > 0), p.words)
    assert torch.equal(pack_bits_torch((codes > 0).T.contiguous().T), p.words)  # strided


def test_pack_layout():
    """Bit j -> bit j % 64 of word j // 64; +1 sets the bit; padding stays 0."""
    codes = -torch.ones(2, 130)
    codes[0, 65] = 1
    codes[1, 0] = 1
    codes[1, 63] = 1
    codes[1, 129] = 1
    w = H.pack_codes(codes).words
    assert w[0].tolist() == [0, 2, 0]
    assert w[1].tolist() == [1 - 2 ** 63, 0, 2]  # bits 0 and 63 of word 0 (int64 view)


UNSIGNED = [torch.uint8] + [getattr(torch, f"uint{b}") for b in (16, 32, 64)
                             if hasattr(torch, f"uint{b}")]


@pytest.mark.parametrize("dtype", UNSIGNED)
def test_unpack_codes_refuses_a_dtype_that_cannot_hold_minus_one(dtype):
    """An unsigned dtype would wrap -1 to its maximum (255 for uint8): refused for +-1 codes,
    exact for the 0/1 codes of zero_one=True; a dtype that is no torch.dtype is a TypeError
    naming it."""
    p = H.pack_codes(torch.tensor([[1, -1, 1]]))
    with pytest.raises(TypeError, match=f"^dtype {dtype} cannot hold the -1 of \\+-1 codes"):
        H.unpack_codes(p, dtype=dtype)
    assert H.unpack_codes(p, dtype=dtype, zero_one=True).tolist() == [[1, 0, 1]]
    for bad in ("float32", None, np.float32):
        with pytest.raises(TypeError, match="^dtype must be a torch.dtype"):
            H.unpack_codes(p, dtype=bad)
    with pytest.raises(TypeError, match="^dtype must be a real, complex or bool torch.dtype"):
        H.unpack_codes(p, dtype=torch.quint8)
    for ok in (torch.int8, torch.float16, torch.bfloat16, torch.float64, torch.complex64):
        out = H.unpack_codes(p, dtype=ok)
        assert out.dtype == ok and (out.real if out.is_complex() else out).tolist() == [[1, -1, 1]]


@pytest.mark.parametrize("dtype", UNSIGNED)
def test_unsigned_codes_are_not_taken_as_minus_one(dtype):
    """torch compares a uint8 255 equal to -1: +-1 codes in an unsigned dtype are refused (a
    TypeError naming the argument) everywhere codes are taken, not read as -1; 0/1 codes with
    zero_one=True stay exact."""
    top = torch.iinfo(dtype).max
    wrapped = torch.tensor([[1, 0, 1]], dtype=torch.int64).to(dtype)
    wrapped[0, 1] = top                                    # what -1 cast to the dtype gives
    g, gl, ql = torch.tensor([[1, -1, 1]]), torch.tensor([0]), torch.tensor([0])
    calls = [lambda c: H.pack_codes(c),
             lambda c: H.HashIndex(3).add(c),
             lambda c: H.mean_average_precision(c, ql, g, gl),
             lambda c: H.retrieval_metrics(g, gl, c, ql),
             lambda c: H.hamming_distance(c, g)]
    for call in calls:
        with pytest.raises(TypeError, match=f"codes has the unsigned dtype {dtype}"):
            call(wrapped)
    index = H.HashIndex(3)
    with pytest.raises(TypeError, match="^codes has the unsigned dtype torch.uint8"):
        index.add(np.array([[1, 255, 1]], dtype=np.uint8))  # numpy: the same
    with pytest.raises(TypeError, match="looks like 0/1 codes: pass zero_one=True"):
        index.add(np.array([[1, 0, 1]], dtype=np.uint8))
    zo = torch.tensor([[1, 0, 1]], dtype=torch.int64).to(dtype)
    assert torch.equal(H.pack_codes(zo, zero_one=True).words, H.pack_codes(g).words)
    with pytest.raises(ValueError, match="only 0 and 1"):
        H.pack_codes(wrapped, zero_one=True)               # 255 is not a 0/1 code either


def test_zero_one_must_be_a_bool():
    c = torch.tensor([[1, 0, 1]])
    for call in (lambda: H.pack_codes(c, zero_one=1), lambda: H.unpack_codes(H.pack_codes(c > 0),
                                                                              zero_one="no"),
                 lambda: H.hamming_distance(c, c, zero_one=1),
                 lambda: H.mean_average_precision(c, torch.tensor([0]), c, torch.tensor([0]),
                                                  zero_one=1)):
        with pytest.raises(TypeError, match="^zero_one must be a bool"):
            call()


# ------------------------------------------------------------------------------------------
# Distances, top-k, ranking
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", BIT_COUNTS)
def test_popcount_kernel_matches_unpacked(cpu_kernel, bits):
    rng = np.random.default_rng(100 + bits)
    # G = 2 blocks of 2048 + a tail that is not a multiple of 8 or 32
    q, g = rand_pm1(rng, 5, bits), rand_pm1(rng, 2048 + 2048 + 37, bits)
    want = np_hamming(q.numpy(), g.numpy())
    qw, gw = H.pack_codes(q).words, H.pack_codes(g).words
    for simd in simd_levels(cpu_kernel):
        got = cpu_kernel.hamming_cdist(qw, gw, simd)
        assert got.dtype == torch.int32
        np.testing.assert_array_equal(got.numpy(), want, err_msg=f"simd={simd}")


@pytest.mark.parametrize("bits", BIT_COUNTS)
def test_hamming_distance_backends(backend, bits):
    rng = np.random.default_rng(200 + bits)
    q, g = rand_pm1(rng, 9, bits), rand_pm1(rng, 51, bits)
    got = on(backend).hamming_distance(q, g, backend=backend)
    np.testing.assert_array_equal(got.numpy(), np_hamming(q.numpy(), g.numpy()))


@pytest.mark.parametrize("bits", [1, 7, 65, 128])
def test_topk_matches_stable_full_sort(backend, bits):
    rng = np.random.default_rng(300 + bits)
    q, g = rand_pm1(rng, 13, bits), rand_pm1(rng, 257, bits)
    d = np_hamming(q.numpy(), g.numpy())
    order = np.argsort(d, axis=1, kind="stable")
    for k in (1, 5, 100, 257):
        dist, idx = on(backend).topk(q, g, k, backend=backend)
        assert dist.dtype == torch.int32 and idx.dtype == torch.int64 and idx.shape == (13, k)
        np.testing.assert_array_equal(idx.numpy(), order[:, :k], err_msg=f"k={k}")
        np.testing.assert_array_equal(dist.numpy(), np.take_along_axis(d, order[:, :k], 1))
    dist, idx = on(backend).rank(q, g, backend=backend)
    np.testing.assert_array_equal(idx.numpy(), order)


def test_topk_all_simd_levels_agree(cpu_kernel):
    rng = np.random.default_rng(7)
    q, g = rand_pm1(rng, 6, 128), rand_pm1(rng, 4100, 128)
    qw, gw = H.pack_codes(q).words, H.pack_codes(g).words
    order = np.argsort(np_hamming(q.numpy(), g.numpy()), axis=1, kind="stable")
    for simd in simd_levels(cpu_kernel):
        _, idx = cpu_kernel.hamming_topk(qw, gw, 50, simd)
        np.testing.assert_array_equal(idx.numpy(), order[:, :50], err_msg=f"simd={simd}")


@pytest.mark.parametrize("bits", [128, 200])
def test_ranking_equals_faiss(cpu_kernel, bits):
    faiss = pytest.importorskip("faiss")
    rng = np.random.default_rng(400 + bits)
    # 2000 copies of 40 codes -> many ties, so the tie order matters; 1000 random codes give
    # distances that occur once in a row
    base = rand_pm1(rng, 40, bits)
    q = base[torch.from_numpy(rng.integers(0, 40, 30))]
    g = torch.cat([base[torch.from_numpy(rng.integers(0, 40, 2000))], rand_pm1(rng, 1000, bits)])
    g = g[torch.from_numpy(rng.permutation(3000))]
    qp, gp = H.pack_codes(q), H.pack_codes(g)
    index = faiss.IndexBinaryFlat(qp.words.shape[1] * 64)  # padding bits are 0 on both sides
    index.add(gp.words.numpy().view(np.uint8))
    fd, fi = index.search(qp.words.numpy().view(np.uint8), 3000)
    dist, idx = H.rank(qp, gp, backend="cpu")
    np.testing.assert_array_equal(dist.numpy(), fd)
    # faiss orders equal distances its own way: sort its indices within each distance group
    fi_stable = np.take_along_axis(fi, np.lexsort((fi, fd), axis=1), 1)
    np.testing.assert_array_equal(idx.numpy(), fi_stable)
    unique = np.array([[np.count_nonzero(r == v) == 1 for v in r] for r in fd])
    assert unique.any()
    np.testing.assert_array_equal(idx.numpy()[unique], fi[unique])


# ------------------------------------------------------------------------------------------
# Average precision / mAP
# ------------------------------------------------------------------------------------------

def np_num_relevant(ql, gl) -> np.ndarray:
    """Per query, the number of relevant gallery items (same class, or a shared label)."""
    if ql.ndim == 1:
        return (ql[:, None] == gl[None, :]).sum(1)
    return ((ql[:, None, :] > 0) & (gl[None, :, :] > 0)).any(-1).sum(1)


def check_ap(backend, q, ql, g, gl, **kw):
    ap, nrel = on(backend).average_precision(q, ql, g, gl, backend=backend, **kw)
    to_np = (lambda t: t.numpy()) if not kw.get("zero_one") else (lambda t: t.numpy() * 2 - 1)
    want = np_average_precision(to_np(q), ql.numpy(), to_np(g), gl.numpy())
    assert ap.dtype == torch.float64 and nrel.dtype == torch.int64
    np.testing.assert_array_equal(nrel.numpy(), np_num_relevant(ql.numpy(), gl.numpy()))
    np.testing.assert_array_equal(np.isnan(ap.numpy()), np.isnan(want))
    np.testing.assert_allclose(ap.numpy(), want, rtol=1e-12, atol=0, equal_nan=True)
    m, used = on(backend).mean_average_precision(q, ql, g, gl, backend=backend,
                                                 return_num_queries=True, **kw)
    assert used == int((~np.isnan(want)).sum())
    if used:
        assert m == pytest.approx(np_map(want), rel=1e-12)
    else:
        assert math.isnan(m)
    return ap


@pytest.mark.parametrize("bits", BIT_COUNTS)
def test_map_random_single_label(backend, bits):
    rng = np.random.default_rng(500 + bits)
    for trial in range(3):
        nq, ng = int(rng.integers(1, 25)), int(rng.integers(1, 120))
        q, g = rand_pm1(rng, nq, bits), rand_pm1(rng, ng, bits)
        # class 5 exists only among queries -> some queries have no relevant item
        ql = torch.from_numpy(rng.integers(0, 6, nq))
        gl = torch.from_numpy(rng.integers(0, 5, ng))
        check_ap(backend, q, ql, g, gl)


@pytest.mark.parametrize("backend,bits", [(b, n) for b in ("reference", "cpu", "triton")
                                          for n in (7, 65, 128)], indirect=["backend"])
def test_map_random_multi_label(backend, bits):
    rng = np.random.default_rng(600 + bits)
    for L in (3, 70):  # 70 labels -> 2 packed label words
        nq, ng = 17, 90
        q, g = rand_pm1(rng, nq, bits), rand_pm1(rng, ng, bits)
        ql = torch.from_numpy((rng.random((nq, L)) < 0.1).astype(np.int64))
        gl = torch.from_numpy((rng.random((ng, L)) < 0.1).astype(np.int64))
        ql[0] = 0  # a query with no label: no relevant item
        ap = check_ap(backend, q, ql, g, gl)
        assert torch.isnan(ap[0])
        check_ap(backend, q, ql.bool(), g, gl.to(torch.float32))  # bool / float multi-hot


def test_map_heavy_ties(backend):
    """1-bit and few-distinct-code cases: almost everything ties, so AP depends on the
    gallery-index tie order."""
    rng = np.random.default_rng(9)
    for bits in (1, 2, 7):
        base = rand_pm1(rng, 3, bits)
        q = base[torch.from_numpy(rng.integers(0, 3, 11))]
        g = base[torch.from_numpy(rng.integers(0, 3, 300))]
        check_ap(backend, q, torch.from_numpy(rng.integers(0, 3, 11)), g,
                 torch.from_numpy(rng.integers(0, 3, 300)))


def test_map_ties_by_gallery_index_hand_example(backend):
    g = torch.ones(4, 8)  # all gallery codes equal -> one tie group ranked by index
    q = torch.ones(1, 8)
    ap, _ = on(backend).average_precision(q, torch.tensor([1]), g, torch.tensor([0, 1, 0, 1]),
                                          backend=backend)
    assert ap.item() == pytest.approx((1 / 2 + 2 / 4) / 2)
    ap, _ = on(backend).average_precision(q, torch.tensor([1]), g, torch.tensor([1, 1, 0, 0]),
                                          backend=backend)
    assert ap.item() == 1.0


def test_hamming_not_zero_one_dot_product(backend):
    """The authors' bug: with {0,1} dot products, 1111 and 1000 tie for query 1000 and the tie
    puts the wrong item first.  In Hamming distance 1000 is at 0 and 1111 at 3."""
    q = torch.tensor([[1, 0, 0, 0]])
    g = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert (q @ g.T).tolist() == [[1, 1]]  # equal {0,1} dot products
    m = on(backend).mean_average_precision(q, torch.tensor([0]), g, torch.tensor([1, 0]),
                                           zero_one=True, backend=backend)
    assert m == 1.0  # the {0,1}-dot ranking would give 1/2


def test_map_one_query_one_item(backend):
    q, g = torch.ones(1, 128), -torch.ones(1, 128)
    assert on(backend).mean_average_precision(q, torch.tensor([3]), g, torch.tensor([3]),
                                              backend=backend) == 1.0
    m, used = on(backend).mean_average_precision(q, torch.tensor([3]), g, torch.tensor([4]),
                                                 backend=backend, return_num_queries=True)
    assert math.isnan(m) and used == 0


def test_map_skips_queries_without_relevant_items(backend):
    rng = np.random.default_rng(11)
    q, g = rand_pm1(rng, 6, 16), rand_pm1(rng, 40, 16)
    gl = torch.from_numpy(rng.integers(0, 2, 40))
    ql = torch.tensor([0, 1, 7, 0, 9, 1])  # classes 7 and 9 are not in the gallery
    ap, nrel = on(backend).average_precision(q, ql, g, gl, backend=backend)
    assert torch.isnan(ap[[2, 4]]).all() and (nrel[[2, 4]] == 0).all()
    m, used = on(backend).mean_average_precision(q, ql, g, gl, backend=backend,
                                                 return_num_queries=True)
    assert used == 4
    assert m == pytest.approx(ap[[0, 1, 3, 5]].mean().item(), rel=1e-12)


def test_map_packed_input_and_large_gallery(backend):
    """PackedCodes input; gallery larger than one kernel block (2048); bits 65 -> 2 words."""
    rng = np.random.default_rng(12)
    q, g = rand_pm1(rng, 4, 65), rand_pm1(rng, 2500, 65)
    ql = torch.from_numpy(rng.integers(0, 10, 4))
    gl = torch.from_numpy(rng.integers(0, 10, 2500))
    want = np_average_precision(q.numpy(), ql.numpy(), g.numpy(), gl.numpy())
    ap, _ = on(backend).average_precision(H.pack_codes(q), ql, H.pack_codes(g), gl, backend=backend)
    np.testing.assert_allclose(ap.numpy(), want, rtol=1e-12)


def test_ap_all_simd_levels_and_reference_agree(cpu_kernel):
    """Every kernel level against the reference, with sparse relevance (10 classes: the AVX-512
    per-relevant-item path) and dense relevance (2 classes, multi-label: its branch-free path),
    gallery sizes off the 64-item and 2048-item boundaries."""
    rng = np.random.default_rng(13)
    cases = [(64, 3000, 10, None), (128, 3000, 2, None), (200, 2101, 10, None),
             (128, 2500, None, 5), (65, 700, None, 70)]
    for bits, ng, classes, L in cases:
        q, g = rand_pm1(rng, 40, bits), rand_pm1(rng, ng, bits)
        if classes:
            ql = torch.from_numpy(rng.integers(0, classes, 40))
            gl = torch.from_numpy(rng.integers(0, classes, ng))
        else:
            ql = torch.from_numpy(rng.random((40, L)) < 0.3)
            gl = torch.from_numpy(rng.random((ng, L)) < 0.3)
        ref, ref_n = H.average_precision(q, ql, g, gl, backend="reference")
        qw, gw = H.pack_codes(q).words, H.pack_codes(g).words
        if L:
            ql, gl = H.pack_codes(ql, zero_one=True).words, H.pack_codes(gl, zero_one=True).words
        for simd in simd_levels(cpu_kernel):
            ap, n = cpu_kernel.hamming_average_precision(qw, gw, ql, gl, simd)
            np.testing.assert_allclose(ap.numpy(), ref.numpy(), rtol=1e-12,
                                       err_msg=f"simd={simd} case={bits, ng, classes, L}")
            assert torch.equal(n, ref_n)


# ------------------------------------------------------------------------------------------
# Instruction-set levels forced through NAC_FAST_HAMMING_ISA (csrc/hamming.cpp)
# ------------------------------------------------------------------------------------------

# Bits across the nibble kernels' byte sums (<= 192 bits: one chunk of planes) and their 16-bit
# path (> 192), odd word counts (the 8-byte last group of the nibble transposes), 1024 bits.
ISA_BITS = [1, 63, 64, 65, 128, 192, 193, 320, 1024]
ISA_SIZES = [1, 3, 97, 1031]


def forced(monkeypatch, name, fn):
    """fn() run with NAC_FAST_HAMMING_ISA=name (the public functions read it at every call)."""
    monkeypatch.setenv(H.ops.search.HAMMING_ISA_ENV, name)
    try:
        return fn()
    finally:
        monkeypatch.delenv(H.ops.search.HAMMING_ISA_ENV)


def test_isa_levels_listed(cpu_kernel):
    levels = H.ops.search.cpu_isa_levels()
    assert levels == H.ops.search.ISA_LEVELS[:int(cpu_kernel.hamming_simd_level()) + 1]
    assert levels[:2] == ("portable", "scalar") or levels == ("portable",)


@pytest.mark.parametrize("bits", ISA_BITS)
def test_forced_isa_levels_same_distances_and_topk(cpu_kernel, monkeypatch, bits):
    """Every level this CPU runs, forced by name, against the scalar POPCNT path (and that
    against numpy): distances, top-k for k from 1 to G with ties by index (a block of
    duplicated codes, and an all-tied gallery), the full ranking; at 1, 3, 97 and 1031 codes."""
    rng = np.random.default_rng(1000 + bits)
    base = "scalar" if "scalar" in H.ops.search.cpu_isa_levels() else "portable"
    for G in ISA_SIZES:
        q = rand_pm1(rng, 3, bits)
        for g in (rand_pm1(rng, G, bits), torch.ones(G, bits)):  # random, then all tied
            if G > 20:
                g[10:20] = g[3]  # equal distances at scattered indices
            d_np = np_hamming(q.numpy(), g.numpy())
            ks = sorted({min(G, k) for k in (1, 2, 128, 129)} | {G})
            qp, gp = H.pack_codes(q), H.pack_codes(g)  # packed once: the calls below time the engine
            want = forced(monkeypatch, base, lambda: (
                H.hamming_distance(qp, gp, backend="cpu"),
                [H.topk(qp, gp, k, backend="cpu") for k in ks]))
            np.testing.assert_array_equal(want[0].numpy(), d_np)
            order = np.argsort(d_np, axis=1, kind="stable")
            np.testing.assert_array_equal(want[1][-1][1].numpy(), order)
            for level in H.ops.search.cpu_isa_levels():
                got = forced(monkeypatch, level, lambda: (
                    H.hamming_distance(qp, gp, backend="cpu"),
                    [H.topk(qp, gp, k, backend="cpu") for k in ks]))
                msg = f"level={level} bits={bits} G={G}"
                assert torch.equal(got[0], want[0]), msg
                for k, (gd, gi), (wd, wi) in zip(ks, got[1], want[1]):
                    assert torch.equal(gd, wd) and torch.equal(gi, wi), f"{msg} k={k}"


@pytest.mark.parametrize("bits", [1, 64, 65, 128, 193, 1024])
def test_forced_isa_levels_same_retrieval_scores(cpu_kernel, monkeypatch, bits):
    """mAP@all, mAP@K, P@N, P@H<=r and the PR curve (the per-distance histograms) of every level
    equal the scalar path's bit for bit: class ids (int32-sized, and ids beyond int32, which the
    AVX2 mask compares as int64), multi-hot labels; 1 query (tile by tile) and 40 (several query
    blocks: the nibble levels prepare the whole gallery)."""
    rng = np.random.default_rng(2000 + bits)
    base = "scalar" if "scalar" in H.ops.search.cpu_isa_levels() else "portable"
    for G, nq, labels in [(1, 1, "ids"), (97, 40, "ids"), (1031, 1, "ids"), (1031, 40, "big"),
                          (1031, 40, "multi")]:
        q, g = H.pack_codes(rand_pm1(rng, nq, bits)), H.pack_codes(rand_pm1(rng, G, bits))
        if labels == "multi":
            ql, gl = torch.from_numpy(rng.random((nq, 5)) < 0.3), torch.from_numpy(rng.random((G, 5)) < 0.3)
        else:
            off = 2 ** 40 if labels == "big" else -3
            ql = torch.from_numpy(rng.integers(0, 4, nq)) + off
            gl = torch.from_numpy(rng.integers(0, 4, G)) + off
        kw = dict(topk=(1, min(G, 50)), at_n=(1, G), radius=(0, bits // 2, bits), pr=True,
                  backend="cpu")
        want = forced(monkeypatch, base, lambda: H.retrieval_metrics(q, ql, g, gl, **kw))
        want_ap = forced(monkeypatch, base, lambda: H.average_precision(q, ql, g, gl, backend="cpu"))
        for level in H.ops.search.cpu_isa_levels():
            got = forced(monkeypatch, level, lambda: H.retrieval_metrics(q, ql, g, gl, **kw))
            got_ap = forced(monkeypatch, level,
                            lambda: H.average_precision(q, ql, g, gl, backend="cpu"))
            msg = f"level={level} bits={bits} G={G} labels={labels}"
            assert repr(got) == repr(want), msg  # floats bit for bit, NaN included
            assert torch.equal(got_ap[0].nan_to_num(-1.0), want_ap[0].nan_to_num(-1.0)), msg
            assert torch.equal(got_ap[1], want_ap[1]), msg


def test_isa_env_bad_name_and_missing_level(cpu_kernel, monkeypatch):
    q = torch.ones(2, 64)
    monkeypatch.setenv("NAC_FAST_HAMMING_ISA", "sse9")
    with pytest.raises(ValueError, match="NAC_FAST_HAMMING_ISA must be one of auto"):
        H.topk(q, q, 1, backend="cpu")
    with pytest.raises(ValueError, match="NAC_FAST_HAMMING_ISA"):
        H.mean_average_precision(q, torch.zeros(2, dtype=torch.int64), q,
                                 torch.zeros(2, dtype=torch.int64), backend="cpu")
    # an AVX2-only CPU asked for AVX-512BW: a named error, not a slower or faster level
    monkeypatch.setattr(H.ops.search, "cpu_isa_levels", lambda: ("portable", "scalar", "avx2"))
    monkeypatch.setenv("NAC_FAST_HAMMING_ISA", "avx512bw")
    with pytest.raises(ValueError, match="NAC_FAST_HAMMING_ISA=avx512bw but this CPU runs only "
                                         "portable, scalar, avx2"):
        H.hamming_distance(q, q, backend="cpu")
    monkeypatch.setenv("NAC_FAST_HAMMING_ISA", " AVX2 ")  # case and spaces as a shell leaves them
    assert torch.equal(H.hamming_distance(q, q, backend="cpu"), torch.zeros(2, 2, dtype=torch.int32))
    monkeypatch.setenv("NAC_FAST_HAMMING_ISA", "auto")
    assert torch.equal(H.hamming_distance(q, q, backend="cpu"), torch.zeros(2, 2, dtype=torch.int32))


def test_kernel_names_a_missing_level(cpu_kernel):
    """The op itself refuses a level above the CPU's best, naming both (only checkable on a CPU
    without VPOPCNTDQ; every CPU refuses a level above 4)."""
    best = int(cpu_kernel.hamming_simd_level())
    qw = H.pack_codes(torch.ones(2, 64)).words
    with pytest.raises(RuntimeError, match="simd must be -1 \\(auto\\) or a level 0-4"):
        cpu_kernel.hamming_topk(qw, qw, 1, 5)
    if best < 4:
        with pytest.raises(RuntimeError, match=f"supports at most {best}"):
            cpu_kernel.hamming_topk(qw, qw, 1, best + 1)


# ------------------------------------------------------------------------------------------
# Every engine against a brute-force numpy oracle written here: distances by counting differing
# bits, rankings by np.lexsort on (distance, gallery index), AP / mAP@K / P@N / P@H<=r from
# their definitions in docs/math.md [M:rank], [M:ap], [M:ap-at-k], [M:radius],
# [M:precision-at-n]; code lengths that are not multiples of 8 / 32 / 64 bits, tiny
# galleries, K > G, massive ties and multi-hot labels
# ------------------------------------------------------------------------------------------

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
    """Distances, top-k (k = 1, 5, G) and every retrieval metric (K past G) of each engine
    equal the oracle's: 4 distinct gallery codes (ties everywhere), a query equal to a gallery
    item, negative class ids, a query with no relevant item."""
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
    """Multi-hot labels of 63, 65 and 130 classes (around the label words' boundaries) as
    bools, int64 and float32, a query with no label: the metrics equal the oracle's."""
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
    """300 equal gallery codes: every engine ranks them by gallery index, for k on both sides of
    the C++ engine's tile scan / counting-sort switch (128)."""
    dev = _engine_device(backend)
    g = torch.ones(300, 13)
    q = torch.ones(2, 13)
    q[1, 0] = -1
    for k in (1, 128, 129, 300):
        d, i = H.topk(q.to(dev), g.to(dev), k, backend=backend)
        assert torch.equal(i.cpu(), torch.arange(k).expand(2, k))
        assert torch.equal(d.cpu(), torch.tensor([[0], [1]], dtype=torch.int32).expand(2, k))


# ------------------------------------------------------------------------------------------
# The C++ engine at the limits the small-size tests do not reach (csrc/hamming.cpp): the
# largest distance of the longest accepted code (65472 bits, stored as uint16), per-distance
# counts above 2^16 (uint32 counters, ranks and record positions)
# ------------------------------------------------------------------------------------------

SIMD_LEVELS = (range(torch.ops.nac_fast.hamming_simd_level() + 1)
               if dispatch.extension() is not None else [0])


@pytest.mark.parametrize("simd", SIMD_LEVELS)
def test_longest_code_largest_distance(cpu_kernel, simd):
    """1023 words (MAX_BITS): the distance 65472 of complementary codes is exact in every path
    (cdist, top-k small and counting, the retrieval histogram's last bin); 1024 words refused."""
    W = MAX_BITS // 64
    q = torch.zeros(2, W, dtype=torch.int64)
    q[1] = -1
    g = torch.full((300, W), -1, dtype=torch.int64)
    g[::2] = 0
    d = cpu_kernel.hamming_cdist(q, g, simd)
    assert d[0, 1].item() == MAX_BITS and d[0, 0].item() == 0 and d[1, 0].item() == MAX_BITS
    for k in (3, 200):  # k <= 128: tile scan; k > 128: counting sort
        dk, ik = cpu_kernel.hamming_topk(q, g, k, simd)
        assert ik[0, :3].tolist() == [0, 2, 4]
        assert dk[0, -1].item() == (MAX_BITS if k > 150 else 0)
    out = cpu_kernel.hamming_retrieval(q, g, torch.zeros(2, dtype=torch.int64),
                                       torch.zeros(300, dtype=torch.int64), [1, 151], True, simd)
    assert out[4].shape == (2, MAX_BITS + 1)
    assert out[4][0, MAX_BITS].item() == 150 and out[4][0, 0].item() == 150
    with pytest.raises(RuntimeError, match="at most 1023 words"):
        cpu_kernel.hamming_cdist(torch.zeros(1, W + 1, dtype=torch.int64),
                          torch.zeros(1, W + 1, dtype=torch.int64))


@pytest.mark.parametrize("simd", SIMD_LEVELS)
def test_per_distance_counts_above_2_16(cpu_kernel, simd):
    """70,000 gallery items at one distance: per-distance counts, ranks and the relevant items'
    positions pass 2^16 (uint32 in the kernel); AP, hits and histograms stay exact."""
    G = 70_000
    g = torch.zeros(G, 1, dtype=torch.int64)
    g[G // 2:] = 1  # distance 0 for the first half, 1 for the second
    q = torch.zeros(1, 1, dtype=torch.int64)
    gl = (torch.arange(G) % 3 == 0).to(torch.int64)  # relevant: every third item
    ql = torch.ones(1, dtype=torch.int64)
    ap, nrel, hits, psum, h, rh = cpu_kernel.hamming_retrieval(q, g, ql, gl, [G // 2, G], True,
                                                               simd)
    rel = gl == 1
    ranks = torch.arange(1, G + 1, dtype=torch.float64)
    want = (rel.double().cumsum(0) / ranks)[rel].mean().item()
    assert nrel.item() == int(rel.sum())
    assert ap.item() == pytest.approx(want, rel=1e-12)
    assert hits[0].tolist() == [int(rel[:G // 2].sum()), int(rel.sum())]
    assert h[0, :2].tolist() == [G // 2, G // 2]
    assert rh[0, :2].tolist() == [int(rel[:G // 2].sum()), int(rel[G // 2:].sum())]
    dk, ik = cpu_kernel.hamming_topk(q, g, G, simd)
    assert torch.equal(ik[0], torch.arange(G))


# ------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------

def _ok():
    q, g = torch.ones(3, 16), -torch.ones(5, 16)
    return q, torch.tensor([0, 1, 2]), g, torch.tensor([0, 1, 2, 0, 1])


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda a: (a[0][:, :8], *a[1:]), ValueError, "bits"),
    (lambda a: (a[0], a[1][:2], *a[2:]), ValueError, "query_labels"),
    (lambda a: (*a[:3], a[3][:, None].expand(5, 3)), ValueError, "gallery_labels"),
    (lambda a: (*a[:3], torch.zeros(5, 2, 2, dtype=torch.long)), ValueError, "gallery_labels"),
    (lambda a: (a[0][:0], a[1][:0], *a[2:]), ValueError, "query_codes is empty"),
    (lambda a: (*a[:2], a[2][:0], a[3][:0]), ValueError, "gallery_codes is empty"),
    (lambda a: (a[0] * 2, *a[1:]), ValueError, "query_codes must contain only -1 and \\+1"),
    (lambda a: (*a[:2], (a[2] > 0).float(), a[3]), ValueError, "zero_one=True"),
    (lambda a: (a[0].to(torch.complex64), *a[1:]), TypeError, "query_codes"),
    (lambda a: (a[0].numpy(), *a[1:]), TypeError, "query_codes"),
    (lambda a: (a[0], a[1].float(), *a[2:]), TypeError, "query_labels"),
    (lambda a: (a[0][0], *a[1:]), ValueError, "query_codes must be 2-D"),
    (lambda a: (a[0], a[1], a[2], torch.zeros(5, 3)), ValueError, "both"),
    (lambda a: (a[0], torch.zeros(3, 4), a[2], torch.zeros(5, 3)), ValueError, "same L"),
    (lambda a: (a[0], torch.full((3, 4), 2), a[2], torch.zeros(5, 4)), ValueError, "0 and 1"),
])
def test_bad_inputs(backend, mutate, exc, match):
    args = mutate(_ok())
    with pytest.raises(exc, match=match):
        on(backend).mean_average_precision(*args, backend=backend)


def test_bad_inputs_other_functions(backend):
    q, g = torch.ones(3, 16), -torch.ones(5, 16)
    with pytest.raises(ValueError, match="k must be"):
        on(backend).topk(q, g, 6, backend=backend)
    with pytest.raises(ValueError, match="k must be"):
        on(backend).topk(q, g, 0, backend=backend)
    with pytest.raises(TypeError, match="k must be an int"):
        on(backend).topk(q, g, 2.0, backend=backend)
    with pytest.raises(ValueError, match="gallery_codes must contain only 0 and 1"):
        on(backend).hamming_distance(q.clamp(min=0), g, zero_one=True, backend=backend)
    with pytest.raises(ValueError, match="backend must be one of"):
        H.hamming_distance(q, g, backend="gpu")
    with pytest.raises(ValueError, match="nbits"):
        on(backend).hamming_distance(H.PackedCodes(H.pack_codes(q).words, 80), g, backend=backend)
    bad = H.pack_codes(torch.ones(3, 10)).words | (1 << 20)  # a padding bit set
    with pytest.raises(ValueError, match="padding bits"):
        on(backend).hamming_distance(H.PackedCodes(bad, 10), torch.ones(2, 10), backend=backend)
    with pytest.raises(TypeError, match="words must be int64"):
        H.unpack_codes(H.PackedCodes(torch.zeros(2, 1, dtype=torch.int32), 10))
    with pytest.raises(TypeError, match="packed must be PackedCodes"):
        H.unpack_codes(torch.zeros(2, 1, dtype=torch.int64))


def test_kernel_rejects_bad_simd_and_words(cpu_kernel):
    qw = H.pack_codes(torch.ones(2, 64)).words
    with pytest.raises(RuntimeError, match="simd"):
        cpu_kernel.hamming_cdist(qw, qw, 5)
    with pytest.raises(RuntimeError, match="words per code"):
        cpu_kernel.hamming_cdist(qw, H.pack_codes(torch.ones(2, 65)).words)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_kernel.hamming_cdist(qw.int(), qw)


def test_numpy_integers_count_as_ints_where_the_index_takes_them():
    """topk's and knn_predict's k take a numpy int as HashIndex.search's does, with the same
    result as the int; a float or a bool is still a TypeError naming k."""
    g = torch.randint(0, 2, (40, 24)).float() * 2 - 1
    q = g[:5]
    d, i = H.topk(q, g, np.int64(3))
    d2, i2 = H.topk(q, g, 3)
    assert torch.equal(d, d2) and torch.equal(i, i2)
    x, y = torch.randn(30, 4, dtype=torch.float64), torch.arange(30) % 3
    assert torch.equal(knn_predict(x, y, x[:7], k=np.int32(5)), knn_predict(x, y, x[:7], k=5))
    for bad in (3.0, True):
        with pytest.raises(TypeError, match="k must be an int"):
            H.topk(q, g, bad)
        with pytest.raises(TypeError, match="k must be an int"):
            knn_predict(x, y, x[:7], k=bad)


# ------------------------------------------------------------------------------------------
# Expressivity statistics
# ------------------------------------------------------------------------------------------

def np_code_stats(c: np.ndarray):
    n = c.shape[0]
    distinct = len({tuple(r) for r in c.tolist()})
    pair = [np.count_nonzero(c[i] != c[j]) for i, j in itertools.permutations(range(n), 2)]
    return distinct, (float(np.mean(pair)) if pair else math.nan), (c > 0).mean(0)


@pytest.mark.parametrize("bits", [1, 7, 65, 128])
def test_code_statistics_matches_brute_force(bits):
    rng = np.random.default_rng(700 + bits)
    base = rand_pm1(rng, 12, bits)
    codes = base[torch.from_numpy(rng.integers(0, 12, 60))]  # duplicates on purpose
    distinct, mph, bal = np_code_stats(codes.numpy())
    for x in (codes, codes > 0, H.pack_codes(codes), (codes > 0).int()):
        kw = {"zero_one": True} if isinstance(x, torch.Tensor) and x.dtype == torch.int32 else {}
        s = H.code_statistics(x, **kw)
        assert (s.num_codes, s.num_bits, s.num_distinct) == (60, bits, distinct)
        assert s.fraction_distinct == distinct / 60
        assert s.mean_pairwise_hamming == pytest.approx(mph, rel=1e-12)
        assert s.normalized_mean_pairwise_hamming == pytest.approx(mph / bits, rel=1e-12)
        np.testing.assert_allclose(s.bit_freq.numpy(), bal, rtol=1e-12)
        assert s.balance_dev == pytest.approx(np.abs(bal - 0.5).mean())
        assert s.bit_freq_min == bal.min() and s.bit_freq_max == bal.max()


def test_code_statistics_sign_of_preactivations():
    a = torch.tensor([[0.3, -2.0, 0.0], [0.0, 1.0, -0.1], [5.0, -1.0, 0.0]], requires_grad=True)
    s = H.code_statistics(a)  # sgn with 0 -> +1: rows +-+, ++-, +-+
    assert s.num_distinct == 2
    np.testing.assert_allclose(s.bit_freq.numpy(), [1.0, 1 / 3, 2 / 3])
    # pairs (0,1),(0,2),(1,2) have distances 2, 0, 2 -> mean 4/3
    assert s.mean_pairwise_hamming == pytest.approx(4 / 3)
    ent = lambda p: 0.0 if p in (0, 1) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    assert s.bit_entropy_mean == pytest.approx((ent(1.0) + 2 * ent(1 / 3)) / 3)
    d = s.as_dict()
    assert "bit_freq" not in d and d["num_distinct"] == 2


def test_code_statistics_edge_cases():
    s = H.code_statistics(torch.ones(1, 4))
    assert s.num_distinct == 1 and math.isnan(s.mean_pairwise_hamming)
    with pytest.raises(ValueError, match="non-empty"):
        H.code_statistics(torch.ones(0, 4))
    with pytest.raises(ValueError, match="2-D"):
        H.code_statistics(torch.ones(4))
    with pytest.raises(ValueError, match="NaN"):
        H.code_statistics(torch.tensor([[float("nan"), 1.0]]))
    with pytest.raises(TypeError, match="codes"):
        H.code_statistics([[1, -1]])


def test_reference_popcount_edge_words():
    words = torch.tensor([0, -1, 1, -(2 ** 63), 2 ** 63 - 1, 0x5555555555555555, -0x5555555555555556])
    want = [bin(w & 0xFFFFFFFFFFFFFFFF).count("1") for w in words.tolist()]
    assert _ref_popcount64(words).tolist() == want == [0, 64, 1, 1, 63, 32, 32]


# ------------------------------------------------------------------------------------------
# The Triton kernels on the device they are for (bench/gpu_suite.sh: CUDA tensors; CI: CPU
# tensors under TRITON_INTERPRET=1, where the backend fixture above also runs every test)
# ------------------------------------------------------------------------------------------

@pytest.fixture
def triton_device():
    if not triton_runs():
        pytest.skip(SKIP_REASON)
    return torch.device(TRITON_DEVICE)


@pytest.mark.parametrize("bits,ng,classes,L", [(1, 97, 3, None), (64, 1031, 10, None),
                                               (128, 1031, 2, None), (200, 300, None, 5),
                                               (65, 97, None, 70)])
def test_triton_backend_on_its_device(triton_device, bits, ng, classes, L):
    """Distances, top-k and AP of backend='triton' on its device equal the reference's; awkward
    gallery sizes (not multiples of the tiles), 1 to 4 words, single- and multi-label."""
    rng = np.random.default_rng(bits * 7 + ng)
    nq = 3 if triton_device.type == "cpu" else 64
    q, g = rand_pm1(rng, nq, bits), rand_pm1(rng, ng, bits)
    if classes:
        ql, gl = (torch.from_numpy(rng.integers(0, classes, n)) for n in (nq, ng))
    else:
        ql, gl = (torch.from_numpy(rng.random((n, L)) < 0.3) for n in (nq, ng))
    dev = triton_device
    want_d = H.hamming_distance(q, g, backend="reference")
    got_d = H.hamming_distance(q.to(dev), g.to(dev), backend="triton")
    assert got_d.device.type == dev.type and torch.equal(got_d.cpu(), want_d)
    k = min(ng, 50)
    wd, wi = H.topk(q, g, k, backend="reference")
    gd, gi = H.topk(q.to(dev), g.to(dev), k, backend="triton")
    assert torch.equal(gd.cpu(), wd) and torch.equal(gi.cpu(), wi)
    want_ap, want_n = H.average_precision(q, ql, g, gl, backend="reference")
    ap, n = H.average_precision(q.to(dev), ql.to(dev), g.to(dev), gl.to(dev), backend="triton")
    assert torch.equal(n.cpu(), want_n)
    np.testing.assert_allclose(ap.cpu().numpy(), want_ap.numpy(), rtol=1e-12)


def test_triton_backend_limits(triton_device):
    rng = np.random.default_rng(5)
    q, g = rand_pm1(rng, 2, 1100).to(triton_device), rand_pm1(rng, 5, 1100).to(triton_device)
    lab = (torch.zeros(2, dtype=torch.int64, device=triton_device),
           torch.zeros(5, dtype=torch.int64, device=triton_device))
    with pytest.raises(ValueError, match="at most 1023 bits"):
        H.average_precision(q, lab[0], g, lab[1], backend="triton")
    # distances have no such limit
    assert torch.equal(H.hamming_distance(q, g, backend="triton").cpu(),
                       H.hamming_distance(q.cpu(), g.cpu(), backend="reference"))


def test_available_backends_bad_device():
    with pytest.raises(TypeError, match="device"):
        H.available_backends(3, op="hamming")


# ---------------------------------------------------------------------------------------------
# The reference engine's memory (the GPU's fallback), tested on the CPU
# ---------------------------------------------------------------------------------------------
from nac_fast.ops import search as S  # noqa: E402


def _words(seed, n, W):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 62, 2 ** 62, (n, W), generator=g, dtype=torch.int64)


def test_reference_topk_keeps_no_chunk_matrix(monkeypatch):
    """_ref_topk (the reference engine, the GPU's fallback) must hold only the k columns of each
    query chunk until the final cat, not a view into the chunk's whole (rows, G) sort: those views
    kept a Q x G matrix alive (12 bytes a pair), an OOM on a GPU for a large gallery."""
    q, g, k = _words(1, 300, 2), _words(2, 5000, 2), 10
    held = []
    cat = torch.cat

    def spy(ts, *a, **kw):
        held.extend(t.untyped_storage().nbytes() for t in ts)
        return cat(ts, *a, **kw)

    monkeypatch.setattr(torch, "cat", spy)
    D, I = S._ref_topk(q, g, k)
    monkeypatch.setattr(torch, "cat", cat)
    assert D.shape == (300, k) and I.shape == (300, k)
    # the outputs' own bytes (int32 + int64), not 300 x 5000 x 12
    assert sum(held) == 300 * k * (4 + 8)
    d = S.ref_cdist(q, g)
    sd, si = torch.sort(d, dim=1, stable=True)
    assert torch.equal(D, sd[:, :k]) and torch.equal(I, si[:, :k])


def _tied_words(rng, G, W, nshared):
    """(G, W) int64 words: random codes, of which nshared rows at scattered indices are copies of
    one code (more than 2^16 items at one distance from every query)."""
    words = torch.from_numpy(rng.integers(-2 ** 63, 2 ** 63 - 1, size=(G, W), dtype=np.int64))
    rows = torch.from_numpy(np.sort(rng.choice(G, nshared, replace=False)))
    words[rows] = words[0].clone()
    return words


@pytest.mark.parametrize("bits", [64, 128])
def test_isa_levels_same_ap_bits_on_large_ties(cpu_kernel, bits):
    """The retrieval pass of every level gives the scalar level's AP, cut-off sums and histograms
    bit for bit on a gallery with more than 2^16 items at one distance (the records' positions past
    16 bits) and many ties elsewhere; class ids within a byte's range (the byte masks, with query
    ids absent from the gallery, below and above its range), ids spanning more than 255 values
    (the int32 and int64 masks), against the reference AP."""
    rng = np.random.default_rng(56 + bits)
    base = min(1, int(cpu_kernel.hamming_simd_level()))  # scalar POPCNT, else portable
    G, nq, W = 70_001, 7, bits // 64
    gw = _tied_words(rng, G, W, 66_000)
    qw = torch.cat([gw[:1], torch.from_numpy(rng.integers(-2 ** 63, 2 ** 63 - 1, size=(nq - 1, W),
                                                          dtype=np.int64))])
    cls = rng.integers(0, 10, G)
    for gl, ql in [(cls, np.array([0, 3, 9, 5, -1, 10, 7])),           # bytes; -1, 10 absent
                   (cls * 1000 - 4000, np.array([0, 3, 9, 5, -1, 10, 7]) * 1000 - 4000),
                   (cls * 1000 + 2 ** 40, np.array([0, 3, 9, 5, 11, 10, 7]) * 1000 + 2 ** 40)]:
        gl, ql = torch.from_numpy(gl), torch.from_numpy(ql)
        want = cpu_kernel.hamming_retrieval(qw, gw, ql, gl, [1, 5000, 66_000, G], True, base)
        assert (want[1][:4] > 0).all() and (want[1][4:6] == 0).all()
        ref, _ = H.average_precision(H.ops.codes.PackedCodes(qw, bits), ql,
                                     H.ops.codes.PackedCodes(gw, bits), gl, backend="reference")
        np.testing.assert_allclose(want[0].numpy(), ref.numpy(), rtol=1e-12)
        for simd in simd_levels(cpu_kernel):
            got = cpu_kernel.hamming_retrieval(qw, gw, ql, gl, [1, 5000, 66_000, G], True, simd)
            for a, b in zip(got, want):
                assert torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0)), f"simd={simd} ids={gl[:3]}"


@pytest.mark.slow  # ~270 MB of 4096-bit codes, ~12 s of CPU (most in the reference AP)
def test_isa_levels_same_ap_bits_past_packed_records(cpu_kernel):
    """Past the 4-byte records' range (4096 bits: 13 bits of distance, positions below 2^19) the
    pass keeps 6-byte records: more than 2^19 items at one distance, every level the scalar
    level's bits and the reference AP."""
    rng = np.random.default_rng(5619)
    base = min(1, int(cpu_kernel.hamming_simd_level()))
    G, W = 2 ** 19 + 5000, 64
    gw = _tied_words(rng, G, W, 2 ** 19 + 1000)
    qw = torch.cat([gw[:1], torch.from_numpy(rng.integers(-2 ** 63, 2 ** 63 - 1, size=(1, W),
                                                          dtype=np.int64))])
    gl = torch.from_numpy(rng.integers(0, 3, G))
    ql = torch.tensor([0, 2])
    want = cpu_kernel.hamming_retrieval(qw, gw, ql, gl, [7, 2 ** 19 + 10], True, base)
    ref, _ = H.average_precision(H.ops.codes.PackedCodes(qw, 64 * W), ql,
                                 H.ops.codes.PackedCodes(gw, 64 * W), gl, backend="reference")
    np.testing.assert_allclose(want[0].numpy(), ref.numpy(), rtol=1e-12)
    for simd in simd_levels(cpu_kernel):
        got = cpu_kernel.hamming_retrieval(qw, gw, ql, gl, [7, 2 ** 19 + 10], True, simd)
        for a, b in zip(got, want):
            assert torch.equal(a, b), f"simd={simd}"


AARCH64_CXX = "aarch64-linux-gnu-g++"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(AARCH64_CXX) is None,
                    reason=f"no {AARCH64_CXX} (Debian's g++-aarch64-linux-gnu)")
def test_engine_compiles_for_aarch64_with_neon_popcount(tmp_path):
    """What ARM CPUs run (issue 56): csrc/hamming.cpp cross-compiled for AArch64 against this
    torch's headers builds the portable level alone (no x86 level leaks out of its guard), and
    its popcounts are NEON CNT instructions.  Compiled, not run: no AArch64 machine or emulator
    here (docs/evaluation.md says so)."""
    from torch.utils import cpp_extension
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    obj = tmp_path / "hamming_aarch64.o"
    inc = [f"-I{p}" for p in cpp_extension.include_paths()] + [
        "-I" + sysconfig.get_paths()["include"]]
    r = subprocess.run([AARCH64_CXX, "-std=c++20", "-O2", "-c", os.path.join(root, "csrc",
                        "hamming.cpp"), "-o", str(obj), "-DTORCH_EXTENSION_NAME=_C", *inc],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    objdump = AARCH64_CXX.replace("g++", "objdump")
    dis = subprocess.run([objdump, "-d", str(obj)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert "file format elf64-littleaarch64" in dis
    ops = [ln.split("\t")[2].split()[0] for ln in dis.splitlines()
           if ln.count("\t") >= 2 and ln.split("\t")[2].strip()]
    # a 64-bit popcount is CNT (per byte) and ADDV (their sum); the x86 levels are not there
    assert "cnt" in ops and ("addv" in ops or "uaddlv" in ops), sorted(set(ops))[:80]
