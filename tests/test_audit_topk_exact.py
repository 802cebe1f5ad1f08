"""Audit: exactness of the GPU Hamming engines' top-k and retrieval passes against the C++ engine
(backend="cpu"), on inputs aimed at the branch points of nac_fast/ops/hamming_topk.py (the bound
from a strided sample, the filter pass's CA + k slots per (query, slice), the overflow rerun, the
k > TOPK_MAX_K and small-gallery paths) and of the kernels (slices, partial query blocks and
tiles, code lengths at word boundaries).  The "cuda" engine runs its lane functions in emulation
(csrc/hamming_lanes.h on CPU tensors), the "triton" engine under TRITON_INTERPRET=1.

Found: the Triton kernels' slice bounds, ``end = min(s L + L, G)`` in int32, wrapped past
2^31 - 1 for the last slice of a gallery within a few slices' rounding of MAX_ROWS
(G = 2^31 - 1 always): that slice ended at a negative row and was skipped, so the top-k missed
its rows and the retrieval passes did not count them (the filter's tile loop, g0 + BG, wrapped
there too).  The three kernels compute ``s L + min(L, G - s L)``, and the Triton engine takes
at most 2^31 - 2^16 rows (hamming_triton.MAX_ROWS), so the filter's int32 tiles past the last row
stay below 2^31 (int64 rows would cost it a block per SM under Triton 3.6).  A gallery that large
needs a GPU (the end-to-end test below skips without one); on the CPU the kernels' own bound
statements run in the interpreter.

Everything else held: all adversarial cases below equal the C++ engine exactly."""
from __future__ import annotations

import contextlib
import math
import random

import numpy as np
import pytest
import torch

import nac_fast as H
import nac_fast.ops.retrieval as R
from nac_fast.kernels import hamming_triton as HT
from nac_fast.ops import dispatch, hamming_cuda as HC
from nac_fast.ops.codes import pack_bits_torch
from _probes import bounds_probe
from test_hamming_gpu import SKIP_REASON, TRITON_DEVICE, triton_runs
from test_hamming_gpu import words as device_words

pytestmark = pytest.mark.skipif(dispatch.extension() is None, reason="no compiled extension")

MAX_ROWS = (1 << 31) - 1


def words(seed, n, bits, distinct=None):
    return device_words(seed, n, bits, "cpu", distinct)


@contextlib.contextmanager
def constants(E, **kw):
    """The engine's size constants set (those it has) for the block."""
    old = {n: getattr(E, n) for n in kw if hasattr(E, n)}
    for n in old:
        setattr(E, n, kw[n])
    try:
        yield
    finally:
        for n, v in old.items():
            setattr(E, n, v)


def engines():
    out = [HC]
    if triton_runs() and TRITON_DEVICE == "cpu":
        out.append(HT)
    return out


def assert_topk(E, qw, gw, k, **kw):
    wd, wi = torch.ops.nac_fast.hamming_topk(qw, gw, k)
    with constants(E, **kw):
        d, i = E.topk(qw, gw, k)
    assert torch.equal(d, wd) and torch.equal(i, wi), (E.__name__, k, d, wd, i, wi)


class Reruns:
    """Counts an engine's filter passes that are reruns of overflowing queries."""

    def __init__(self, monkeypatch, E):
        self.capacities = []
        real = E._filter

        def spy(qw, gview, t, k, expect, capacity=None):
            self.capacities.append(capacity)
            return real(qw, gview, t, k, expect, capacity=capacity)
        monkeypatch.setattr(E, "_filter", spy)

    @property
    def reruns(self):
        return sum(c is not None for c in self.capacities)


SMALL = dict(BASE_ROWS=24, SAMPLE_RATIO=4, BASE_PAIRS=256, MIN_SLICE_ROWS=8, TOPK_MIN_TILES=1,
             TOPK_CONFIG={"gpu": HT.TOPK_CONFIG["gpu"], "interpreter": (4, 32, 1)})


# ------------------------------------------------------------------------------------------
# The defect: Triton slice bounds near MAX_ROWS
# ------------------------------------------------------------------------------------------

def slice_bounds_probe(kernel, tmp_path):
    """A Triton function of (G, L) running a kernel's own `start = ...` / `end = ...` statements
    for slices s = 0, 1 (typed as in the kernel: program id and scalars in int32)."""
    return bounds_probe(kernel, tmp_path, pid="s", ints=("G", "L"), stores=("start", "end"))


@pytest.mark.parametrize("kernel", ["_topk_filter_kernel", "_topk_mma_kernel", "_ap_hist_kernel",
                                    "_ap_rank_kernel"])
def test_triton_last_slice_ends_at_the_gallery_end_near_max_rows(tmp_path, kernel):
    """G = 2^31 - 1 in two slices of L = 2^30 + 32 rows (a multiple of the tiles, as the plans
    make them): the second slice is [L, G).  In int32, s L + L = 2^31 + 64 wrapped to a negative
    end and the slice was skipped."""
    if not (triton_runs() and TRITON_DEVICE == "cpu"):
        pytest.skip("the probe runs under TRITON_INTERPRET=1")
    probe = slice_bounds_probe(getattr(HT, kernel), tmp_path)
    L = (1 << 30) + 32
    out = torch.zeros(4, dtype=torch.int64)
    probe[(2,)](out, MAX_ROWS, L)
    assert out.tolist() == [0, L, L, MAX_ROWS]
    out.zero_()
    probe[(2,)](out, 1000, 600)  # an ordinary split
    assert out.tolist() == [0, 600, 600, 1000]


def check_last_rows_found(E, dev, G, bits=3):
    """A gallery of zeros whose last 3 rows are the query (distance 0) and class 0 (the only
    relevant ones): the top 5 are those 3 rows then rows 0, 1; the AP is 1 over 3 relevant."""
    q = (1 << bits) - 1
    gw = torch.zeros(G, 1, dtype=torch.int64, device=dev)
    gw[G - 3:] = q
    qw = torch.full((1, 1), q, dtype=torch.int64, device=dev)
    d, i = E.topk(qw, gw, 5)
    assert d.cpu().tolist() == [[0, 0, 0, bits, bits]]
    assert i.cpu().tolist() == [[G - 3, G - 2, G - 1, 0, 1]]
    del d, i
    gl = torch.ones(G, dtype=torch.int64, device=dev)
    gl[G - 3:] = 0
    ql = torch.zeros(1, dtype=torch.int64, device=dev)
    ap, nrel, hits, _, hist, _ = E.retrieval(qw, gw, ql, gl, bits, (3, 4), hist=True)
    assert nrel.cpu().tolist() == [3] and ap.cpu().tolist() == [1.0]
    assert hits.cpu().tolist() == [[3, 3]]
    assert hist.cpu().tolist() == [[3] + [0] * (bits - 1) + [G - 3]]


def test_last_rows_found_small_gallery():
    """check_last_rows_found (the GPU test's oracle) on the CPU engines, small constants so the
    filter pass runs in several slices."""
    for E in engines():
        with constants(E, **SMALL):
            check_last_rows_found(E, torch.device("cpu"), 3001)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a gallery of 2^31 - 1 codes: a GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_max_rows_gallery_on_a_gpu(backend):
    """G = the engine's MAX_ROWS one-word codes (16 GiB, labels 16 GiB more): the last slice's
    rows are found by the top-k and counted by the retrieval passes."""
    if backend == "triton" and not ("triton" in H.available_backends("cuda", op="hamming")):
        pytest.skip("no Triton on CUDA tensors")
    if backend == "cuda" and not dispatch.cuda_extension_built():
        pytest.skip("the CUDA kernels are not built")
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2 ** 30:
        pytest.skip("needs 40 GiB of free GPU memory")
    E = HT if backend == "triton" else HC
    check_last_rows_found(E, torch.device("cuda"), E.MAX_ROWS)


def test_triton_row_limit_leaves_room_for_a_tile():
    """The filter walks int32 rows in tiles of BG (kernels/hamming_triton.py): at the largest
    gallery the engine accepts, the tile after its last row still indexes below 2^31, and one
    row more is refused before any launch."""
    bg = max(cfg[1] for table in (HT.TOPK_CONFIG, HT.MMA_CONFIG) for cfg in table.values())
    assert HT.MAX_ROWS + bg <= MAX_ROWS
    with pytest.raises(ValueError, match="galleries of at most 2,147,418,112 codes"):
        HT._check_rows(HT.MAX_ROWS + 1)
    HT._check_rows(HT.MAX_ROWS)


# ------------------------------------------------------------------------------------------
# Top-k: adversarial inputs, both engines against the C++ engine
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("E", engines(), ids=lambda e: e.__name__.rsplit(".", 1)[-1])
def test_all_gallery_codes_equal(E):
    """Every distance tied: the first k rows, every k from 1 to G (the sampled bound, the filter
    pass in slices of ties, the direct path at k > G / ratio)."""
    G = 301
    gw = words(1, 1, 65).expand(G, 2).contiguous()
    qw = torch.cat([gw[:1], words(2, 4, 65)])
    for k in (1, 2, 5, 74, 75, 76, G - 1, G):
        assert_topk(E, qw, gw, k, **SMALL)


def staircase(bits, block, ratio, Q=3):
    """Query 0 is the zero code; the sample's rows (multiples of ratio) are at distance `bits`,
    the others in blocks of `block` rows at distances bits - 1, bits - 2, ..., 0 in gallery
    order: the sample's bound is as loose as it gets and each slice's first CA rows below it sit
    one step lower only, so the reruns lower the bound step by step."""
    dists = [d for d in range(bits - 1, -1, -1) for _ in range(block)]
    G = len(dists) * ratio // (ratio - 1) + ratio
    dist = torch.full((G,), bits)
    rows = torch.arange(G)
    rows = rows[rows % ratio != 0][:len(dists)]
    dist[rows] = torch.tensor(dists)
    gw = H.pack_codes(torch.arange(bits)[None, :] < dist[:, None]).words
    qw = H.pack_codes(torch.zeros(Q, bits, dtype=torch.bool)).words
    qw[1], qw[2] = gw[5], gw[-1]
    return qw, gw


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


@pytest.mark.skipif(not (triton_runs() and TRITON_DEVICE == "cpu"), reason=SKIP_REASON)
def test_staircase_reruns_triton(monkeypatch):
    spy = Reruns(monkeypatch, HT)
    qw, gw = staircase(64, 12, SMALL["SAMPLE_RATIO"])
    for k in (1, 13):
        assert_topk(HT, qw, gw, k, **SMALL)
    one = dict(SMALL, TOPK_CONFIG={"gpu": HT.TOPK_CONFIG["gpu"], "interpreter": (4, 1024, 1)})
    spy.capacities.clear()
    assert_topk(HT, qw, gw, 1, **one)
    assert spy.reruns >= 10


@pytest.mark.skipif(not (triton_runs() and TRITON_DEVICE == "cpu"), reason=SKIP_REASON)
def test_tensor_core_filter_on_ties_and_staircases():
    """The Triton engine's tensor-core filter (topk_with, method "mma") on this file's inputs:
    every gallery code equal (k from 1 to G: its tie pools overflow, the ordered filter takes
    over) and three distinct codes (ties at the k-th distance).  Its reruns: test_hamming_gpu.py
    (the staircase's dozens of reruns take minutes in the interpreter)."""
    def check(qw, gw, k):
        wd, wi = torch.ops.nac_fast.hamming_topk(qw, gw, k)
        with constants(HT, **SMALL):
            d, i = HT.topk_with(qw, gw, k, "mma")
        assert torch.equal(d, wd) and torch.equal(i, wi), (k, d, wd, i, wi)
    G = 301
    gw = words(1, 1, 65).expand(G, 2).contiguous()
    qw = torch.cat([gw[:1], words(2, 4, 65)])
    for k in (1, 5, 75, G):
        check(qw, gw, k)
    qw, gw = words(3, 7, 129, distinct=3), words(3, 900, 129, distinct=3)
    for k in (1, 9):
        check(qw, gw, k)


@pytest.mark.parametrize("E", engines(), ids=lambda e: e.__name__.rsplit(".", 1)[-1])
def test_ties_at_the_kth_distance_in_every_slice(E):
    """Three distinct codes, the queries among them: hundreds of rows tie at the k-th distance in
    every slice (more than the k slots at the bound of each); Q not a multiple of the block."""
    qw, gw = words(3, 7, 129, distinct=3), words(3, 900, 129, distinct=3)
    for k in (1, 3, 8, 9, 33):
        assert_topk(E, qw, gw, k, **SMALL)


def test_k_around_the_filter_limit_cuda():
    """The real constants at k = 1023, 1024 (the filter pass, G > 16 k) and 1025 (the direct
    path), with three distinct codes (ties across every slice) and random codes."""
    for qw, gw in ((words(5, 5, 64, 3), words(6, 16_385, 64, 3)),
                   (words(7, 3, 64), words(8, 17_000, 64))):
        for k in (1023, 1024, 1025):
            assert_topk(HC, qw, gw, k)


def test_real_constants_at_the_outright_size_cuda():
    """G = BASE_ROWS (outright) and BASE_ROWS + 1 (a sampled bound of 257 rows), k up to
    G / SAMPLE_RATIO, the queries equal to gallery rows."""
    for G in (4096, 4097, 8193):
        gw = words(G, G, 128, distinct=50)
        qw = torch.cat([gw[G // 2:G // 2 + 2], gw[-1:], words(9, 130, 128)])
        for k in (1, 7, 256, 257, G - 1, G):
            assert_topk(HC, qw, gw, k)


@pytest.mark.parametrize("bits", [1, 63, 64, 65, 127, 129, 1024])
def test_code_lengths_cuda(bits):
    qw, gw = words(bits, 9, bits), words(bits + 1, 700, bits, distinct=None if bits < 8 else 20)
    qw[0] = gw[699]
    for k in (1, 6, 700):
        assert_topk(HC, qw, gw, k, **SMALL)


@pytest.mark.skipif(not (triton_runs() and TRITON_DEVICE == "cpu"), reason=SKIP_REASON)
@pytest.mark.parametrize("bits", [1, 64, 129, 320])
def test_code_lengths_triton(bits):
    qw, gw = words(bits, 5, bits), words(bits + 1, 200, bits, distinct=None if bits < 8 else 7)
    qw[0] = gw[199]
    for k in (1, 6, 200):
        assert_topk(HT, qw, gw, k, **SMALL)


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
        gw = words(rng.randrange(1 << 30), G, bits, distinct)
        qw = words(rng.randrange(1 << 30), Q, bits, distinct)
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


@pytest.mark.skipif(not (triton_runs() and TRITON_DEVICE == "cpu"), reason=SKIP_REASON)
def test_public_api_zero_one_and_pm1_triton():
    """nac_fast.topk / rank / HashIndex with backend="triton" on +-1 floats, 0/1 ints and bools,
    three distinct codes: equal to backend="cpu"."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(0, 2, (3, 65), generator=gen)
    gb = base[torch.randint(0, 3, (300,), generator=gen)]
    qb = torch.cat([gb[:3], torch.randint(0, 2, (2, 65), generator=gen)])
    for k in (1, 9, 299, 300):
        want = H.topk(qb, gb, k, zero_one=True, backend="cpu")
        for args, kw in (((qb, gb), dict(zero_one=True)), ((qb * 2.0 - 1, gb * 2.0 - 1), {}),
                         ((qb.bool(), gb.bool()), {})):
            got = H.topk(*args, k, backend="triton", **kw)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    index, ref = H.HashIndex(65, backend="triton"), H.HashIndex(65, backend="cpu")
    for ix in (index, ref):
        ix.add(gb[:100], zero_one=True)
        ix.add(gb[100:], zero_one=True)
    for k in (1, 5, 1000):
        a, b = index.search(qb, k, zero_one=True), ref.search(qb, k, zero_one=True)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ------------------------------------------------------------------------------------------
# Retrieval on heavy ties
# ------------------------------------------------------------------------------------------

def assert_retrieval(got, want):
    ap, nrel, hits, psum, hh, rh = got
    wap, wnrel, whits, wpsum, whh, wrh = want
    assert torch.equal(nrel, wnrel) and torch.equal(hits, whits)
    assert torch.equal(hh, whh) and torch.equal(rh, wrh)
    np.testing.assert_allclose(ap.numpy(), wap.numpy(), rtol=1e-12, atol=0, equal_nan=True)
    np.testing.assert_allclose(psum.numpy(), wpsum.numpy(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("E", engines(), ids=lambda e: e.__name__.rsplit(".", 1)[-1])
def test_retrieval_passes_on_ties(E):
    """1 to 3 distinct codes (every rank decided by gallery index), queries copied from the
    gallery, single and multi-hot labels (none relevant, all relevant), cut-offs 1, G - 1, G
    repeated: hits, precision sums, AP and histograms of the C++ engine."""
    rng = random.Random(1)
    for it in range(12 if E is HT else 60):
        bits = rng.choice([1, 3, 64, 65, 129, 1023])
        G, Q = rng.choice([1, 2, 37, 300]), rng.choice([1, 5, 33])
        distinct = None if bits < 4 else rng.choice([1, 2, 3])
        gw, qw = words(2 * it, G, bits, distinct), words(2 * it + 1, Q, bits, distinct)
        if it % 3 == 0:
            qw = gw[torch.randint(0, G, (Q,))].clone()
        if it % 2:
            p = rng.choice([0.0, 0.05, 1.0])
            ql, gl = torch.rand(Q, 70) < p, torch.rand(G, 70) < p
            qk, gk = pack_bits_torch(ql), pack_bits_torch(gl)
        else:
            ql, gl = torch.randint(0, 2, (Q,)), torch.randint(0, 2, (G,))
            qk, gk = ql, gl
        cuts = (1, G, max(1, G - 1), G, rng.randint(1, G))
        want = torch.ops.nac_fast.hamming_retrieval(qw, gw, qk, gk, list(cuts), True)
        want = (*want[:4], want[4][:, :bits + 1], want[5][:, :bits + 1])
        assert_retrieval(E.retrieval(qw, gw, qk, gk, bits, cuts, hist=True), want)


def close(a, b, path="metrics"):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            close(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list):
        np.testing.assert_allclose(np.array(a, float), np.array(b, float), rtol=1e-12, atol=1e-15,
                                   equal_nan=True, err_msg=path)
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-12 * abs(b), (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_retrieval_metrics_on_ties(monkeypatch, backend):
    """mAP@all, mAP@K, P@N, P@H<=r and the PR curve through retrieval_metrics with three distinct
    codes, equal to backend="cpu" to 1e-12 ("cuda": the emulation on CPU tensors, reached by
    making the dispatcher pick it)."""
    if backend == "triton" and not (triton_runs() and TRITON_DEVICE == "cpu"):
        pytest.skip(SKIP_REASON)
    gen = torch.Generator().manual_seed(2)
    base = torch.randint(0, 2, (3, 65), generator=gen)
    gb = base[torch.randint(0, 3, (700,), generator=gen)]
    qb = torch.cat([gb[:3], torch.randint(0, 2, (3, 65), generator=gen)])
    labels = [(torch.randint(0, 2, (6,), generator=gen),
               torch.randint(0, 2, (700,), generator=gen)),
              (torch.full((6,), 5), torch.full((700,), 6)),
              (torch.rand(6, 70, generator=gen) < 0.05, torch.rand(700, 70, generator=gen) < 0.05)]

    def metrics(be, ql, gl):
        return R.retrieval_metrics(qb, ql, gb, gl, topk=(1, 5, 700, 10 ** 6), at_n=(1, 7, 700),
                                   radius=(0, 1, 65), pr=True, zero_one=True, backend=be)
    for ql, gl in labels:
        want = metrics("cpu", ql, gl)
        m_want = R.mean_average_precision(qb, ql, gb, gl, zero_one=True, backend="cpu")
        with monkeypatch.context() as m:
            if backend == "cuda":
                m.setattr(R, "resolve_backend", lambda *a, **k: "cuda")
            got = metrics(backend, ql, gl)
            m_got = R.mean_average_precision(qb, ql, gb, gl, zero_one=True, backend=backend)
        close(got, want)
        close(m_got, m_want)
