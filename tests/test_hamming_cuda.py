"""The Hamming engine's "cuda" backend (nac_fast/ops/hamming_cuda.py, csrc/hamming_cuda.cu): its
distances, exact top-k and retrieval pass against the C++ engine and the torch reference.

On CPU tensors the ops nac_fast::hamming_lanes_* run the CUDA kernels' own lane functions
(csrc/hamming_lanes.h) in emulation, each block of lanes with its emulated shared memory laid out
as on the GPU: CI checks everything of the kernels but the lines that map blockIdx / threadIdx to
(query, slice).  On a GPU machine (bench/gpu_suite.sh's test stage) every test also runs on CUDA
tensors, through the real kernels.

The engine's size constants are shrunk in most top-k tests (as in tests/test_hamming_gpu.py) so
small cases walk every level of the sampled bound, the filter pass and its rerun.

Adversarial top-k inputs (staircases of reruns, k around the filter's limit, the real constants
at the outright size, code lengths, seeded random cases with every constant shrunk) are checked
against the C++ engine exactly; the cases both GPU engines share: tests/test_hamming_gpu.py."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import nac_fast as H
from nac_fast.ops import dispatch, hamming_cuda as HC
from nac_fast.ops.codes import pack_bits_torch
from test_hamming_gpu import assert_same_retrieval, check_topk_peak_memory, labels, words
from test_hamming_gpu import SMALL, Reruns, assert_topk, constants, cpu_words, staircase

pytestmark = pytest.mark.skipif(dispatch.extension() is None, reason="no compiled extension")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and dispatch.cuda_extension_built()
                     else [])


@pytest.fixture(params=DEVICES)
def dev(request):
    return torch.device(request.param)


@pytest.fixture
def small_engine(monkeypatch):
    """Constants shrunk: galleries of hundreds of codes take the sampled bound (recursively) and
    the filter pass, in slices of a few rows."""
    monkeypatch.setattr(HC, "BASE_ROWS", 24)
    monkeypatch.setattr(HC, "SAMPLE_RATIO", 3)
    monkeypatch.setattr(HC, "BASE_PAIRS", 256)
    monkeypatch.setattr(HC, "MIN_SLICE_ROWS", 5)


def check_topk(qw, gw, k):
    d, i = HC.topk(qw, gw, k)
    assert d.device == qw.device and d.dtype == torch.int32 and i.dtype == torch.int64
    wd, wi = torch.ops.nac_fast.hamming_topk(qw.cpu(), gw.cpu(), k)
    assert torch.equal(d.cpu(), wd), (d.cpu(), wd)
    assert torch.equal(i.cpu(), wi), (i.cpu(), wi)


# ------------------------------------------------------------------------------------------
# Distances and top-k
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [1, 63, 64, 65, 128, 200, 513, 1024])
@pytest.mark.parametrize("Q,G", [(1, 1), (3, 97), (97, 1031)])
def test_cdist_equals_the_cpu_engine(dev, bits, Q, G):
    qw, gw = words(bits + Q, Q, bits, dev), words(bits * 3 + G, G, bits, dev)
    d = HC.cdist(qw, gw)
    assert d.dtype == torch.int32 and d.device == qw.device
    assert torch.equal(d.cpu(), torch.ops.nac_fast.hamming_cdist(qw.cpu(), gw.cpu()))


@pytest.mark.parametrize("bits", [1, 65, 200, 1024])
@pytest.mark.parametrize("Q,G", [(1, 1), (3, 97), (97, 1031), (5, 4099)])
def test_topk_equals_the_cpu_engine(dev, small_engine, bits, Q, G):
    """1 to 16 words a code (each MAXW instantiation), every level of the sampled bound."""
    qw, gw = words(bits * 7 + Q, Q, bits, dev), words(bits + G, G, bits, dev)
    for k in sorted({1, min(5, G), min(13, G)}):
        check_topk(qw, gw, k)


@pytest.mark.parametrize("distinct", [1, 2, 5])
def test_topk_ties_by_gallery_index(dev, small_engine, distinct):
    qw, gw = words(1, 7, 65, dev, distinct), words(2, 1031, 65, dev, distinct)
    for k in (1, 4, 11):
        check_topk(qw, gw, k)


def test_topk_overflowing_slice_reruns_with_a_lower_bound(dev, small_engine, monkeypatch):
    """Copies of the query everywhere but on the sample's stride: a slice holds more items below
    the bound than its slots; the query runs again with a lower bound and stays exact."""
    calls = []
    real = HC._filter

    def spy(qw, gview, t, k, expect, capacity=None):
        out = real(qw, gview, t, k, expect, capacity=capacity)
        calls.append(dict(Q=qw.shape[0], rerun=capacity is not None,
                          overflow=bool((out[1] > out[2]).any())))
        return out
    monkeypatch.setattr(HC, "_filter", spy)
    monkeypatch.setattr(HC, "MIN_SLICE_ROWS", 64)  # ~40 copies per slice: more than k = 10's slots
    G = 2000
    qw, gw = words(3, 4, 128, dev), words(4, G, 128, dev)
    near = torch.arange(G, device=dev)
    near = near[(near % HC.SAMPLE_RATIO != 0) & (near >= 700) & (near < 1300)]
    gw[near] = qw[0]
    gw[near[::7]] = qw[1] ^ 1
    for k in (3, 10):
        calls.clear()
        check_topk(qw, gw, k)
        reruns = [c for c in calls if c["rerun"]]
        assert reruns and reruns[0]["Q"] < qw.shape[0], calls
        assert not reruns[-1]["overflow"]


def test_topk_real_constants(dev):
    qw, gw = words(9, 6, 128, dev), words(10, 4099 + 17, 128, dev)
    check_topk(qw, gw, 10)
    check_topk(qw, gw, 1)


def test_topk_large_k_takes_the_chunked_path(dev, small_engine, monkeypatch):
    monkeypatch.setattr(HC, "TOPK_MAX_K", 8)
    monkeypatch.setattr(HC, "DIRECT_PAIRS", 300)
    qw, gw = words(7, 9, 100, dev), words(8, 400, 100, dev, distinct=30)
    for k in (8, 9, 400):
        check_topk(qw, gw, k)


def test_filter_strided_view_and_lanes(dev):
    """The filter op on a strided gallery view (the bound's samples), at block sizes that leave a
    partial block, equals the candidates worked out in torch."""
    qw, g = words(40, 37, 128, dev), words(41, 900, 128, dev)
    gview = g[::7]
    d = torch.ops.nac_fast.hamming_cdist(qw.cpu(), gview.contiguous().cpu())
    t = d.kthvalue(3, dim=1).values.to(torch.int32)
    for lanes, L in ((1, 11), (7, 40), (32, 129), (128, 1000)):
        keys, na = torch.ops.nac_fast.hamming_lanes_filter(qw, gview, t.to(dev), L, 4, 3, lanes)
        keys, na = keys.cpu(), na.cpu()
        S = -(-gview.shape[0] // L)
        assert keys.shape == (37, S * 7) and na.shape == (37, S)
        for q in range(37):
            for s in range(S):
                rows = torch.arange(s * L, min(s * L + L, gview.shape[0]))
                dd = d[q, rows]
                below, at = rows[dd < t[q]], rows[dd == t[q]]
                assert na[q, s] == below.numel()
                slot = keys[q, s * 7:(s + 1) * 7]
                want_b = (d[q, below[:4]].to(torch.int64) << 40) | below[:4]
                want_a = (d[q, at[:3]].to(torch.int64) << 40) | at[:3]
                assert torch.equal(slot[:want_b.numel()], want_b)
                assert torch.equal(slot[4:4 + want_a.numel()], want_a)
                assert (slot[want_b.numel():4] == HC.hamming_topk.EMPTY_KEY).all()
                assert (slot[4 + want_a.numel():] == HC.hamming_topk.EMPTY_KEY).all()


# ------------------------------------------------------------------------------------------
# Top-k: adversarial inputs at the branch points of nac_fast/ops/hamming_topk.py, against the
# C++ engine (the cases the Triton engine shares: tests/test_hamming_gpu.py)
# ------------------------------------------------------------------------------------------

def test_staircase_reruns_cuda(monkeypatch):
    """The real constants, one slice (every overflow in it): k = 1 takes a rerun per distance
    (64), the capacity doubling up to its cap; several slices, and k past a slot count."""
    spy = Reruns(monkeypatch, HC)
    qw, gw = staircase(64, 100, HC.SAMPLE_RATIO)
    for k in (1, 2, 9, 101, 250):
        assert_topk(HC, qw, gw, k)
    with constants(HC, MIN_SLICE_ROWS=10 ** 6):
        spy.capacities.clear()
        assert_topk(HC, qw, gw, 1)
        assert spy.reruns == 64
        assert_topk(HC, qw, gw, 8)


def test_k_around_the_filter_limit_cuda():
    """The real constants at k = 1023, 1024 (the filter pass, G > 16 k) and 1025 (the direct
    path), with three distinct codes (ties across every slice) and random codes."""
    for qw, gw in ((cpu_words(5, 5, 64, 3), cpu_words(6, 16_385, 64, 3)),
                   (cpu_words(7, 3, 64), cpu_words(8, 17_000, 64))):
        for k in (1023, 1024, 1025):
            assert_topk(HC, qw, gw, k)


def test_real_constants_at_the_outright_size_cuda():
    """G = BASE_ROWS (outright) and BASE_ROWS + 1 (a sampled bound of 257 rows), k up to
    G / SAMPLE_RATIO, the queries equal to gallery rows."""
    for G in (4096, 4097, 8193):
        gw = cpu_words(G, G, 128, distinct=50)
        qw = torch.cat([gw[G // 2:G // 2 + 2], gw[-1:], cpu_words(9, 130, 128)])
        for k in (1, 7, 256, 257, G - 1, G):
            assert_topk(HC, qw, gw, k)


@pytest.mark.parametrize("bits", [1, 63, 64, 65, 127, 129, 1024])
def test_code_lengths_cuda(bits):
    qw = cpu_words(bits, 9, bits)
    gw = cpu_words(bits + 1, 700, bits, distinct=None if bits < 8 else 20)
    qw[0] = gw[699]
    for k in (1, 6, 700):
        assert_topk(HC, qw, gw, k, **SMALL)


def test_random_adversarial_cuda():
    """Seeded random cases: sizes, code lengths, tied codes, queries copied from the gallery or
    planted off the sample's stride, constants shrunk to make every path small (slices of 1 row
    up, outright steps of one query, the direct path's chunks)."""
    rng = random.Random(0)
    for _ in range(60):
        bits = rng.choice([1, 7, 63, 64, 65, 128, 200, 1024])
        G = rng.choice([rng.randint(1, 60), rng.randint(60, 700), rng.randint(700, 2000)])
        Q = rng.choice([1, 2, rng.randint(1, 40), 129])
        distinct = None if bits < 8 else rng.choice([None, 1, 2, 10])
        gw = cpu_words(rng.randrange(1 << 30), G, bits, distinct)
        qw = cpu_words(rng.randrange(1 << 30), Q, bits, distinct)
        ratio = rng.choice([2, 3, 16])
        if rng.random() < 0.4:
            qw = gw[torch.randint(0, G, (Q,))].clone()
        elif G > 20:
            lo = rng.randint(0, G - 1)
            near = torch.arange(lo, rng.randint(lo + 1, G))
            near = near[near % ratio != 0]
            gw[near] = qw[0]
        kw = dict(BASE_ROWS=rng.choice([2, 5, 24]), SAMPLE_RATIO=ratio,
                  BASE_PAIRS=rng.choice([1, 256]), TOPK_MAX_K=rng.choice([1024, 3]),
                  MIN_SLICE_ROWS=rng.choice([1, 5, 64]), DIRECT_PAIRS=rng.choice([1, 1 << 24]))
        for k in sorted({1, min(2, G), G, max(1, G - 1), rng.randint(1, G)}):
            assert_topk(HC, qw, gw, k, **kw)


# ------------------------------------------------------------------------------------------
# Retrieval: AP, cut-offs, histograms
# ------------------------------------------------------------------------------------------

def check_retrieval(dev, bits, Q, G, classes=None, L=None, cuts=(), seed=0, distinct=None):
    qw, gw = words(seed + 1, Q, bits, dev, distinct), words(seed + 2, G, bits, dev, distinct)
    ql, gl = labels(seed + 3, Q, classes, L), labels(seed + 4, G, classes, L)
    qlp, glp = (pack_bits_torch(ql), pack_bits_torch(gl)) if L else (ql, gl)
    got = HC.retrieval(qw, gw, qlp.to(dev), glp.to(dev), bits, cuts, hist=True)
    assert_same_retrieval(got, qw, gw, ql, gl, cuts, bits)


@pytest.mark.parametrize("bits,Q,G,classes,L", [
    (1, 1, 1, 3, None), (7, 3, 97, 4, None), (64, 97, 1031, 10, None), (128, 5, 4099, 10, None),
    (300, 3, 260, 2, None), (1024, 2, 50, 3, None), (65, 4, 300, None, 3),
    (128, 3, 200, None, 70), (128, 2, 120, None, 300)])
def test_retrieval_equals_the_reference(dev, bits, Q, G, classes, L):
    """Single labels and multi-hot in 1, 2 and 5 packed words (5: past the four kept in
    registers), 1 to 16 code words, several gallery slices per query block."""
    cuts = (G, 1, min(7, G), 1)  # unsorted, repeated: the caller's order comes back
    check_retrieval(dev, bits, Q, G, classes, L, cuts, seed=bits + G)


@pytest.mark.parametrize("distinct", [1, 3])
def test_retrieval_ties_take_gallery_order(dev, distinct):
    check_retrieval(dev, 16, 9, 203, classes=3, cuts=(1, 5, 100), seed=20, distinct=distinct)


@pytest.mark.parametrize("lanes", [1, 5, 32])
def test_retrieval_passes_at_any_slices_and_lanes(dev, lanes):
    """The two ops directly, at slice lengths from 1 row to the whole gallery and block sizes
    with partial blocks: the same packed histograms and the same AP sums."""
    Q, G, bits = 11, 157, 128
    qw, gw = words(50, Q, bits, dev), words(51, G, bits, dev)
    ql, gl = labels(52, Q, 4).to(dev), labels(53, G, 4).to(dev)
    hs, ps = [], []
    cuts = torch.tensor([3, 50], device=dev)
    for L in (1, 13, G):
        h = torch.ops.nac_fast.hamming_lanes_ap_hist(qw, gw, ql, gl, L, lanes)
        assert h.shape == (-(-G // L), 129, Q)
        tot = h.sum(0)
        start = torch.cumsum(h, 0) - h + (tot.cumsum(0) - tot)[None]
        psum, cps, chit = torch.ops.nac_fast.hamming_lanes_ap_rank(qw, gw, ql, gl, start, cuts,
                                                                   L, lanes)
        hs.append(tot.cpu())
        ps.append((psum.sum(0).cpu(), cps.sum(0).cumsum(0).cpu(), chit.sum(0).cumsum(0).cpu()))
    for h, p in zip(hs[1:], ps[1:]):
        assert torch.equal(h, hs[0])
        np.testing.assert_allclose(p[0].numpy(), ps[0][0].numpy(), rtol=1e-13)
        np.testing.assert_allclose(p[1].numpy(), ps[0][1].numpy(), rtol=1e-13)
        assert torch.equal(p[2], ps[0][2])


def test_retrieval_slice_longer_than_a_counter_chunk():
    """Pass 1 packs a slice's counts in 16-bit halves, flushed every 65,535 rows: one slice of
    70,000 rows (two chunks) counts as the C++ engine does."""
    Q, G, bits = 2, 70_000, 8
    qw, gw = words(60, Q, bits, "cpu"), words(61, G, bits, "cpu", distinct=1)
    ql, gl = labels(62, Q, 2), labels(63, G, 2)
    h = torch.ops.nac_fast.hamming_lanes_ap_hist(qw, gw, ql, gl, G, 32)
    _, _, _, _, hist, relhist = torch.ops.nac_fast.hamming_retrieval(qw, gw, ql, gl, [], True)
    assert torch.equal(h[0] & 0xFFFFFFFF, hist.T) and torch.equal(h[0] >> 32, relhist.T)
    assert int(hist.max()) > 65535  # a counter past 16 bits


def test_public_api_runs_the_cuda_backend_on_cuda_tensors_only(monkeypatch):
    why = H.available_backends("cpu", op="hamming", reasons=True)["cuda"]
    assert why == "the 'cuda' backend runs on CUDA tensors only"
    codes = H.pack_codes(torch.ones(3, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="backend 'cuda' is not available for cpu tensors"):
        H.topk(codes, codes, 1, backend="cuda")


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a GPU and the CUDA kernels")
def test_public_api_on_cuda_equals_the_cpu_engine():
    """What users call: nac_fast.topk / mean_average_precision / HashIndex with backend="cuda"."""
    bits, Q, G = 128, 300, 20_000
    qb = torch.randint(0, 2, (Q, bits), generator=torch.Generator().manual_seed(1)).bool()
    gb = torch.randint(0, 2, (G, bits), generator=torch.Generator().manual_seed(2)).bool()
    ql, gl = labels(3, Q, 10), labels(4, G, 10)
    q, g = H.pack_codes(qb), H.pack_codes(gb)
    qc, gc = H.PackedCodes(q.words.cuda(), bits), H.PackedCodes(g.words.cuda(), bits)
    d, i = H.topk(qc, gc, 10, backend="cuda")
    wd, wi = H.topk(q, g, 10, backend="cpu")
    assert torch.equal(d.cpu(), wd) and torch.equal(i.cpu(), wi)
    m = H.mean_average_precision(qc, ql.cuda(), gc, gl.cuda(), backend="cuda")
    assert m == pytest.approx(H.mean_average_precision(q, ql, g, gl, backend="cpu"), rel=1e-12)
    index = H.HashIndex(bits, backend="cuda", device="cuda")
    index.add(gb)
    d2, i2 = index.search(qb, 10)
    assert torch.equal(d2.cpu(), wd) and torch.equal(i2.cpu(), wi)


def test_bad_input_names_the_argument():
    q = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="at most 1024 bits"):
        HC.retrieval(torch.zeros(2, 17, dtype=torch.int64), torch.zeros(3, 17, dtype=torch.int64),
                     torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 1088)
    with pytest.raises(RuntimeError, match="gallery must be int64"):
        torch.ops.nac_fast.hamming_lanes_cdist(q, q.to(torch.int32))
    with pytest.raises(RuntimeError, match="query and gallery codes have 2 and 3 words"):
        torch.ops.nac_fast.hamming_lanes_cdist(q, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="bound must be contiguous int32"):
        torch.ops.nac_fast.hamming_lanes_filter(q, q, torch.zeros(2, dtype=torch.int64), 1, 1, 1, 4)
    lab = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="lanes must be in"):
        torch.ops.nac_fast.hamming_lanes_ap_hist(q, q, lab, lab, 1, 0)
    with pytest.raises(RuntimeError, match="labels must be contiguous"):
        torch.ops.nac_fast.hamming_lanes_ap_hist(q, q, q[:, 0], q[:, 0], 1, 1)
    with pytest.raises(RuntimeError, match="start must be contiguous int64"):
        torch.ops.nac_fast.hamming_lanes_ap_rank(q, q, lab, lab, q, q[0], 1, 1)


def test_workspace_does_not_grow_with_the_gallery():
    cpu = torch.device("cpu")
    a = HC.topk_workspace_bytes(1000, 10 ** 6, 10, 2, cpu)
    b = HC.topk_workspace_bytes(1000, 10 ** 8, 10, 2, cpu)
    assert b <= 2 * a and b < 1000 * 10 ** 8 * 4 / 100


@pytest.mark.skipif("cuda" not in DEVICES, reason="peak GPU memory: needs a GPU")
def test_topk_peak_gpu_memory_is_not_q_by_g():
    check_topk_peak_memory(HC)


def test_map_equals_on_a_larger_gallery(dev):
    """10 classes, 128 bits, 64 queries x 30,000 codes: the mAP of the C++ engine to 1e-12."""
    check_retrieval(dev, 128, 64, 30_000, classes=10, cuts=(100, 1000), seed=70)


# ---------------------------------------------------------------------------------------------
# Launch limits of csrc/hamming_cuda.cu: block sizes and grids, read out of the source (no GPU
# here: the kernels cannot run).  _src / _body / INT32_MAX are the CUDA loss tests' readers.
# ---------------------------------------------------------------------------------------------
import re  # noqa: E402

from test_loss_cuda import HAMMING_CU, INT32_MAX, _body, _src, res  # noqa: E402


def _strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def _function_bodies(src: str) -> dict:
    """{name: body} of the functions defined at namespace level (braces at depth 1 inside the
    anonymous namespace, or depth 0), found by brace matching on comment-free source."""
    out, depth, i = {}, 0, 0
    ns_depths = []
    while i < len(src):
        ch = src[i]
        if ch == "{":
            head = src[max(src.rfind(";", 0, i), src.rfind("}", 0, i)) + 1:i]
            if re.search(r"\bnamespace\b[^()]*$", head):
                ns_depths.append(depth)
                depth += 1
                i += 1
                continue
            m = re.search(r"\b(\w+)\s*\([^{}]*\)\s*(?:const\s*)?$", head)
            if m and depth == len(ns_depths):
                # a function body: match its braces
                d, j = 0, i
                while True:
                    if src[j] == "{":
                        d += 1
                    elif src[j] == "}":
                        d -= 1
                        if d == 0:
                            break
                    j += 1
                out[m.group(1)] = src[i:j + 1]
                i = j + 1
                continue
            depth += 1
        elif ch == "}":
            depth -= 1
            if ns_depths and ns_depths[-1] == depth:
                ns_depths.pop()
        i += 1
    return out


_LAUNCH = re.compile(r"([\w:<>]+)\s*<<<\s*(.*?)>>>", re.S)


def unchecked_lane_launches(src: str) -> list:
    """The launches of `src` whose block size is `lanes` with no check_block(<that kernel>, ...)
    before them in their function, as 'function: kernel'."""
    bodies = _function_bodies(_strip_comments(src))
    bad = []
    for fname, body in bodies.items():
        for m in _LAUNCH.finditer(body):
            kernel, cfg = m.group(1), res._split_top(m.group(2))
            if len(cfg) < 2 or not re.search(r"\blanes\b", cfg[1]):
                continue
            before = body[:m.start()]
            if not re.search(r"\bcheck_block\s*\(\s*" + re.escape(kernel) + r"\s*,\s*lanes\b",
                             before):
                bad.append(f"{fname}: {kernel}")
    return bad


def test_lane_launches_are_found():
    """The parser sees the launches it must check (a parser that found none would pass)."""
    src = _strip_comments(open(HAMMING_CU).read())
    bodies = _function_bodies(src)
    launched = {m.group(1) for b in bodies.values() for m in _LAUNCH.finditer(b)}
    assert {"kernel", "filter_kernel<M>", "cdist_kernel<M>"} <= launched, launched
    assert unchecked_lane_launches(
        "namespace {\nvoid f(int64_t lanes) {\n  k<M><<<g, lanes, 0, s>>>(a);\n}\n}\n") == ["f: k<M>"]


def test_every_lanes_sized_launch_checks_the_compiled_block_limit():
    """Block size vs the kernel as compiled (csrc/hamming_cuda.cu): the ops hamming_lanes_filter /
    _ap_hist / _ap_rank accept 1 to 1024 lanes (check_lanes, and the CPU emulation runs any of
    them), but the kernels keep a query's code in registers: ptxas gives filter_kernel<16> 72
    registers per thread and the retrieval kernels up to 128 (sm_90, `python
    tools/cuda_resources.py`), so a block of more than 896 (512) threads cannot launch and the op
    died with CUDA's "too many resources requested for launch".  Every launch whose block size is
    `lanes` must first check `lanes` against the compiled kernel's
    cudaFuncAttributes::maxThreadsPerBlock (check_block), which turns that into an error naming
    the limit.  No GPU here: the test reads the launches out of the source."""
    src = open(HAMMING_CU).read()
    assert unchecked_lane_launches(src) == []
    body = _function_bodies(_strip_comments(src)).get("check_block", "")
    assert "cudaFuncGetAttributes" in body and "maxThreadsPerBlock" in body, (
        "check_block must compare lanes with the compiled kernel's maxThreadsPerBlock")


def test_lane_grid_checks_the_query_blocks_against_grid_x_limit():
    """csrc/hamming_cuda.cu lane_grid: gridDim.x = ceil(Q / lanes) queries' blocks, cast to
    unsigned with no bound on Q.  The ops hamming_lanes_filter / _ap_hist / _ap_rank accept
    lanes = 1 and any number of queries; the filter needs ~24 bytes per query (codes, bound, one
    slot, count), so 2^32 + 1 one-word queries fit in ~96 GiB of an H200, and the launch ran one
    block: the other queries kept their EMPTY keys, no error.  (2^31 .. 2^32 - 1 blocks failed to
    launch with CUDA's "invalid configuration argument".)  Now a TORCH_CHECK names the limit."""
    body = _body(_src(HAMMING_CU), "lane_grid")
    check = re.search(r"TORCH_CHECK\(\s*(\w+)\s*<=\s*" + INT32_MAX, body)
    assert check, ("lane_grid must check the query blocks (ceil(Q / lanes), gridDim.x) against "
                   "2^31 - 1 before the unsigned cast: lanes = 1 with 2^32 + 1 queries (96 GiB) "
                   "wrapped to one block")
    var = check.group(1)
    assert re.search(r"\b" + var + r"\s*=\s*\(\s*Q\s*\+\s*lanes\s*-\s*1\s*\)\s*/\s*lanes", body), \
        f"the checked {var} must be the block count ceil(Q / lanes)"
    grid = re.search(r"dim3\(\s*static_cast<unsigned>\((.*?)\)\s*,", body, re.S)
    assert grid and grid.group(1).strip() == var, "gridDim.x must be the checked block count"
    assert check.start() < grid.start(), "the check must come before the cast"


def test_every_launch_over_queries_goes_through_lane_grid_and_cdist_caps_grid_y():
    """No other grid is built from the (unbounded) query count: the lane kernels take
    lane_grid(...); cdist's x is the gallery (< 2^31 rows: <= 2^23 blocks of 256) and its y
    min(Q, 65535), a grid-stride loop over the queries."""
    src = _src(HAMMING_CU)
    launches = re.findall(r"<<<\s*(.*?)\s*,", src, re.S)
    assert launches, "no launch found"
    for grid in launches:
        assert grid.startswith("lane_grid(") or grid == "grid", grid
    cdist = _body(src, "lanes_cdist_cuda")
    assert re.search(r"std::min<int64_t>\(\s*Q\s*,\s*65535\s*\)", cdist)
    assert re.search(r"\(\s*G\s*\+\s*kCdistThreads\s*-\s*1\s*\)\s*/\s*kCdistThreads", cdist)
    calls = re.findall(r"<<<\s*lane_grid\(([^()]*)\)", src)
    assert len(calls) == 2, calls  # the retrieval passes' launch and the filter's
    for call in calls:  # (Q, S, lanes, op): the error names the op
        assert len([a for a in call.split(",") if a.strip()]) == 4, call
