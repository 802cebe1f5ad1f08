"""The GPU Hamming engine (kernels/hamming_triton.py): its exact top-k (bound from a strided
sample, the filter pass, the rerun of a query whose slice overflowed) and its retrieval pass
(counting-sort AP, rank cut-offs, histograms) against the CPU engine and the torch reference,
on the device Triton runs on here: CUDA tensors on a GPU machine (bench/gpu_suite.sh's test
stage), CPU tensors under TRITON_INTERPRET=1 in CI.

The engine's size constants (the outright base of the bound, the sample ratio, the largest k of
the filter) are shrunk in most tests so that small, fast cases walk every level of the recursion
and every path; a few tests keep the real constants.  On CUDA, a search of 1,000 queries over
2M codes must stay within the workspace the engine reports, far below Q x G.

Also: the distance kernel's launch grids at the sizes users reach (within CUDA's grid limits,
from meta tensors); the top-k of non-contiguous packed words; both GPU engines ("cuda" in
emulation on CPU tensors, "triton" interpreted) against the C++ engine on adversarial inputs
(slice bounds near 2^31 rows, ties, staircases of reruns, code lengths, heavy-tie retrieval).

Also the helper the other hashing test files use to run backend="triton" on that device:
``moved(backend)`` returns nac_fast with tensor arguments moved there and results back on the
CPU."""
from __future__ import annotations

import contextlib
import math
import os
import random

import numpy as np
import pytest
import torch

import nac_fast as H
import nac_fast.ops.retrieval as R
from nac_fast.kernels import hamming_triton as HT
from nac_fast.ops import dispatch, hamming_cuda as HC
from nac_fast.ops.codes import pack_bits_torch
from nac_fast.ops.retrieval import _ref_pass
from _probes import bounds_probe

# Triton runs on CUDA tensors on a GPU machine, on CPU tensors under the interpreter (conftest.py
# sets TRITON_INTERPRET=1 where there is no GPU).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
SKIP_REASON = ("backend 'triton' runs here on neither CUDA tensors (no GPU) nor CPU tensors "
               "(TRITON_INTERPRET=1 unset)")


def triton_runs() -> bool:
    return "triton" in H.available_backends(TRITON_DEVICE, op="hamming")


def _to(x, dev):
    if isinstance(x, H.PackedCodes):
        return H.PackedCodes(x.words.to(dev), x.nbits)
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    return x


def _back(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, tuple) and not isinstance(x, H.PackedCodes):
        return type(x)(_back(v) for v in x)
    if isinstance(x, list):
        return [_back(v) for v in x]
    if isinstance(x, dict):
        return {k: _back(v) for k, v in x.items()}
    return x


class _Moved:
    """nac_fast's functions with their tensor (and PackedCodes) arguments on `device` and their
    tensor results copied back to the CPU."""

    def __init__(self, device):
        self.device = torch.device(device)

    def __getattr__(self, name):
        fn = getattr(H, name)

        def call(*args, **kw):
            out = fn(*(_to(a, self.device) for a in args),
                     **{k: _to(v, self.device) for k, v in kw.items()})
            if isinstance(out, torch.Tensor) or isinstance(out, (tuple, list, dict)):
                assert _devices(out) <= {self.device.type}, f"{name} answered on another device"
            return _back(out)
        return call


def _devices(x) -> set:
    if isinstance(x, torch.Tensor):
        return {x.device.type}
    if isinstance(x, (tuple, list)):
        return set().union(*(_devices(v) for v in x)) if x else set()
    if isinstance(x, dict):
        return _devices(list(x.values()))
    return set()


def moved(backend: str) -> _Moved:
    """nac_fast on the device `backend` runs on in these tests: Triton's (TRITON_DEVICE), else the
    CPU."""
    return _Moved(TRITON_DEVICE if backend == "triton" else "cpu")


# ------------------------------------------------------------------------------------------
# Fixtures and oracles
# ------------------------------------------------------------------------------------------

@pytest.fixture
def dev():
    if not triton_runs():
        pytest.skip(SKIP_REASON)
    return torch.device(TRITON_DEVICE)


@pytest.fixture
def small_engine(monkeypatch):
    """The engine's constants shrunk so that galleries of hundreds of codes take the sampled
    bound, recursively, and the filter pass (the real ones need > 4096 codes)."""
    monkeypatch.setattr(HT, "BASE_ROWS", 24)
    monkeypatch.setattr(HT, "SAMPLE_RATIO", 3)
    monkeypatch.setattr(HT, "BASE_PAIRS", 256)


def words(seed, n, bits, dev, distinct=None):
    """(n, ceil(bits/64)) packed random codes; `distinct`: drawn from that many codes only
    (heavy ties)."""
    g = torch.Generator().manual_seed(seed)
    if distinct is None:
        b = torch.randint(0, 2, (n, bits), generator=g).bool()
    else:
        base = torch.randint(0, 2, (distinct, bits), generator=g).bool()
        b = base[torch.randint(0, distinct, (n,), generator=g)]
    return H.pack_codes(b).words.to(dev)


def ref_topk(qw, gw, k):
    """The torch reference on the CPU: distances, stable sort (ties by index)."""
    bits = qw.shape[1] * 64  # padding bits are 0 on both sides: the same distances
    return H.topk(H.PackedCodes(qw.cpu(), bits), H.PackedCodes(gw.cpu(), bits), k,
                  backend="reference")


def check_topk(qw, gw, k):
    d, i = HT.topk(qw, gw, k)
    assert d.device == qw.device and d.dtype == torch.int32 and i.dtype == torch.int64
    assert d.shape == i.shape == (qw.shape[0], k)
    wd, wi = ref_topk(qw, gw, k)
    assert torch.equal(d.cpu(), wd), (d.cpu(), wd)
    assert torch.equal(i.cpu(), wi), (i.cpu(), wi)


class FilterCalls:
    """Counts the engine's filter passes and the reruns of overflowing queries."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = HT._filter

        def spy(qw, gview, t, k, expect, capacity=None):
            out = real(qw, gview, t, k, expect, capacity=capacity)
            self.calls.append(dict(Q=qw.shape[0], G=gview.shape[0], rerun=capacity is not None,
                                   overflow=bool((out[1] > out[2]).any())))
            return out
        monkeypatch.setattr(HT, "_filter", spy)


# ------------------------------------------------------------------------------------------
# Top-k
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [1, 65, 200, 300])
@pytest.mark.parametrize("Q,G", [(1, 1), (3, 97), (97, 1031), (5, 4099)])
def test_topk_equals_the_reference(dev, small_engine, bits, Q, G):
    """Awkward sizes, 1, 2 (with padding bits), 4 and 5 words a code (5: past the four kept in
    registers), every level of the sampled bound (G = 4099 with base 24 and ratio 3: five
    levels)."""
    qw, gw = words(bits * 7 + Q, Q, bits, dev), words(bits + G, G, bits, dev)
    for k in sorted({1, min(5, G), min(13, G)}):
        check_topk(qw, gw, k)


@pytest.mark.parametrize("distinct", [1, 2, 5])
def test_topk_ties_by_gallery_index(dev, small_engine, distinct):
    """Few distinct codes: every distance ties with hundreds of others, so the answer is the
    first k of the gallery in index order among the nearest (the first k slots of a slice's
    ties, merged over slices)."""
    qw, gw = words(1, 7, 65, dev, distinct), words(2, 1031, 65, dev, distinct)
    for k in (1, 4, 11):
        check_topk(qw, gw, k)


def test_topk_overflowing_slice_reruns_with_a_lower_bound(dev, small_engine, monkeypatch):
    """Copies of the query everywhere but on the sample's stride: the bound (from the sample)
    lets hundreds of items below it into one slice, more than its slots; the query runs again
    with its candidates' k-th distance as the bound, and the answer is still exact."""
    spy = FilterCalls(monkeypatch)
    G, bits = 2000, 128
    qw = words(3, 4, bits, dev)
    gw = words(4, G, bits, dev)
    ratio = HT.SAMPLE_RATIO
    near = torch.arange(G, device=dev)
    near = near[(near % ratio != 0) & (near >= 700) & (near < 1300)]
    gw[near] = qw[0]            # query 0's copies at distance 0, missed by every sample level
    gw[near[::7]] = qw[1] ^ 1   # query 1's at distance 1
    for k in (3, 10):
        spy.calls.clear()
        check_topk(qw, gw, k)
        reruns = [c for c in spy.calls if c["rerun"]]
        assert reruns and reruns[0]["Q"] < qw.shape[0], spy.calls  # only the overflowing rows
        assert not reruns[-1]["overflow"]


def test_topk_every_gallery_code_equal(dev, small_engine):
    qw, gw = words(5, 3, 128, dev), words(6, 1, 128, dev).expand(1500, 2).contiguous()
    check_topk(qw, gw, 7)
    d, i = HT.topk(gw[:2], gw, 5)
    assert (d == 0).all() and torch.equal(i.cpu(), torch.arange(5).expand(2, 5))


def test_topk_large_k_takes_the_chunked_path(dev, small_engine, monkeypatch):
    monkeypatch.setattr(HT, "TOPK_MAX_K", 8)
    monkeypatch.setattr(HT, "DIRECT_PAIRS", 300)  # query chunks of one or a few queries
    qw, gw = words(7, 9, 100, dev), words(8, 400, 100, dev, distinct=30)
    for k in (8, 9, 400):
        check_topk(qw, gw, k)


def test_topk_real_constants(dev):
    """The shipped constants: 4099 > BASE_ROWS codes, so one sampled level and the filter."""
    qw, gw = words(9, 6, 128, dev), words(10, 4099 + 17, 128, dev)
    check_topk(qw, gw, 10)
    check_topk(qw, gw, 1)


def test_topk_bound_is_an_upper_bound_and_tight_on_the_sample(dev, small_engine):
    qw, gw = words(11, 20, 64, dev), words(12, 3000, 64, dev)
    k = 6
    t = HT.kth_bound(qw, gw, k)
    wd, _ = ref_topk(qw, gw, k)
    assert t.dtype == torch.int32 and (t.cpu() == wd[:, -1]).all()  # exact on its own rows
    sample = gw[::HT.SAMPLE_RATIO]
    ts = HT.kth_bound(qw, sample, k)
    assert (ts.cpu() >= wd[:, -1]).all()


def test_triton_topk_of_non_contiguous_packed_words(dev, small_engine):
    """The Triton top-k read non-contiguous packed words (a PackedCodes whose words are a
    transposed or column-sliced view) as if they were contiguous, and returned wrong neighbours
    without an error.  Before the fix: kernels/hamming_triton.py topk passed the words on as
    they were, and the filter kernel reads query word w of row i at i * W + w and gallery word w at
    row * stride(0) + w: with column-major words (stride (1, n)) every query and gallery word
    was read from the wrong place (5 queries x 200 codes of 100 bits: all three layouts wrong)."""
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


def test_topk_workspace_does_not_grow_with_the_gallery():
    """The engine's own figure (what HashIndex checks against free GPU memory): O(Q k), the same
    for 1M and 100M codes, and far below Q x G."""
    cpu = torch.device("cpu")
    a = HT.topk_workspace_bytes(1000, 10 ** 6, 10, 2, cpu)
    b = HT.topk_workspace_bytes(1000, 10 ** 8, 10, 2, cpu)
    assert a == b and a < 1000 * 10 ** 6 * 4 / 100  # 1% of a Q x G int32 matrix
    assert HT.topk_workspace_bytes(2000, 10 ** 8, 10, 2, cpu) < 2.5 * b


def check_topk_peak_memory(engine):
    """A GPU engine's top-k (`engine`: kernels/hamming_triton.py or nac_fast/ops/hamming_cuda.py)
    of 1,000 queries over 2M codes: within the workspace it reports, far below Q x G, exact."""
    dev = torch.device("cuda")
    Q, G, k = 1000, 2_000_000, 10
    gen = torch.Generator(device=dev).manual_seed(0)
    gw = torch.randint(-2 ** 62, 2 ** 62, (G, 2), device=dev, generator=gen)
    qw = gw[torch.randint(0, G, (Q,), device=dev, generator=gen)] ^ 0xF0F0  # near copies
    engine.topk(qw[:2], gw, k)  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    d, i = engine.topk(qw, gw, k)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= engine.topk_workspace_bytes(Q, G, k, 2, dev) + Q * k * 12
    assert peak < Q * G * 4 / 100  # a Q x G int32 matrix would be 8 GB
    # exact on a subset, against the CPU engine
    sub = torch.arange(0, Q, 97, device=dev)
    wd, wi = H.topk(H.PackedCodes(qw[sub].cpu(), 128), H.PackedCodes(gw.cpu(), 128), k)
    assert torch.equal(d[sub].cpu(), wd) and torch.equal(i[sub].cpu(), wi)


@pytest.mark.skipif(TRITON_DEVICE != "cuda", reason="peak GPU memory: needs a GPU")
def test_topk_peak_gpu_memory_is_not_q_by_g():
    check_topk_peak_memory(HT)


# ------------------------------------------------------------------------------------------
# Top-k on the tensor cores (method "mma": int8 products of +-1 codes)
# ------------------------------------------------------------------------------------------

def check_topk_mma(qw, gw, k, nbits=None):
    bits = qw.shape[1] * 64 if nbits is None else nbits
    d, i = HT.topk_with(qw, gw, k, "mma", bits)
    assert d.device == qw.device and d.dtype == torch.int32 and i.dtype == torch.int64
    assert d.shape == i.shape == (qw.shape[0], k)
    wd, wi = ref_topk(qw, gw, k)
    assert torch.equal(d.cpu(), wd), (d.cpu(), wd)
    assert torch.equal(i.cpu(), wi), (i.cpu(), wi)


class MmaCalls:
    """Counts the tensor-core filter's passes (and its reruns) and the ordered popcount passes
    its overflowing tie pools fall back to."""

    def __init__(self, monkeypatch):
        self.calls, self.fallbacks = [], []
        real, real_popc = HT._filter_mma, HT._filter

        def spy(qw, gview, t, k, expect, capacity=None, nbits=None):
            out = real(qw, gview, t, k, expect, capacity, nbits)
            self.calls.append(dict(Q=qw.shape[0], rerun=capacity is not None,
                                   overflow=bool((out[1] > out[2]).any())))
            return out

        def popc(qw, gview, t, k, expect, capacity=None):
            self.fallbacks.append(qw.shape[0])
            return real_popc(qw, gview, t, k, expect, capacity=capacity)
        monkeypatch.setattr(HT, "_filter_mma", spy)
        monkeypatch.setattr(HT, "_filter", popc)


@pytest.mark.parametrize("bits,Q,G", [(1, 17, 1031), (64, 17, 1031), (65, 3, 97), (128, 17, 700),
                                      (200, 3, 97), (1024, 3, 97)])
def test_topk_mma_equals_the_reference(dev, small_engine, bits, Q, G):
    """1 to 16 words a code (1 bit: 63 padding bits; 1024: the widest), partial query blocks
    and tiles, every level of the sampled bound (the same kernel at each level)."""
    qw, gw = words(bits * 5 + Q, Q, bits, dev), words(bits + 3 * G, G, bits, dev)
    for k in sorted({1, 5, min(13, G)}):
        check_topk_mma(qw, gw, k, bits)


@pytest.mark.parametrize("distinct", [None, 3])
def test_topk_mma_filter_holds_the_top_k_for_every_k(dev, distinct):
    """The kernel alone, at the exact k-th distance as its bound, for every k from 1 to G (ties:
    3 distinct codes): the k smallest of its candidates are the top-k, ties by index."""
    Q, G, bits = 5, 45, 70
    qw, gw = words(40, Q, bits, dev, distinct), words(41, G, bits, dev, distinct)
    wd, wi = ref_topk(qw, gw, G)
    for k in range(1, G + 1):
        t = wd[:, k - 1].to(torch.int32).to(dev)
        keys, na, cap = HT._filter_mma(qw, gw, t, k, float(k), nbits=bits)
        assert na.shape == (Q, 1) and (na <= cap).all()
        top = smallest_keys_cpu(keys, k)
        assert torch.equal(top >> 40, wd[:, :k].to(torch.int64)), k
        assert torch.equal(top & ((1 << 40) - 1), wi[:, :k]), k


def smallest_keys_cpu(keys, k):
    return torch.topk(keys.cpu(), k, dim=1, largest=False, sorted=True).values


@pytest.mark.parametrize("distinct", [1, 2, 5])
def test_topk_mma_ties_by_gallery_index(dev, small_engine, distinct):
    qw, gw = words(1, 7, 65, dev, distinct), words(2, 1031, 65, dev, distinct)
    for k in (1, 4, 11):
        check_topk_mma(qw, gw, k, 65)


def test_topk_mma_every_gallery_code_equal(dev, small_engine, monkeypatch):
    """1500 equal codes: every row ties at the bound, far more than a tie pool holds, so the
    queries take the ordered popcount filter at the same bound (and the first k by index)."""
    spy = MmaCalls(monkeypatch)
    qw, gw = words(5, 3, 128, dev), words(6, 1, 128, dev).expand(1500, 2).contiguous()
    check_topk_mma(qw, gw, 7)
    assert spy.fallbacks, "the tie pools did not overflow"
    d, i = HT.topk_with(gw[:2], gw, 5, "mma")
    assert (d == 0).all() and torch.equal(i.cpu(), torch.arange(5).expand(2, 5))


def test_topk_mma_overflowing_pool_reruns_with_a_lower_bound(dev, small_engine, monkeypatch):
    """Copies of query 0 off the sample's stride (as in the popcount test above): hundreds of
    rows below the bound, more than the pool's slots; the query runs again with its
    candidates' k-th distance as the bound, and the answer is exact."""
    spy = MmaCalls(monkeypatch)
    G, bits = 2000, 128
    qw, gw = words(3, 4, bits, dev), words(4, G, bits, dev)
    near = torch.arange(G, device=dev)
    near = near[(near % HT.SAMPLE_RATIO != 0) & (near >= 700) & (near < 1300)]
    gw[near] = qw[0]
    gw[near[::7]] = qw[1] ^ 1
    for k in (3, 10):
        spy.calls.clear()
        check_topk_mma(qw, gw, k)
        reruns = [c for c in spy.calls if c["rerun"]]
        assert reruns and reruns[0]["Q"] < qw.shape[0], spy.calls
        assert not reruns[-1]["overflow"]


def test_topk_mma_ignores_padding_bits(dev, small_engine):
    """The distance is over the nbits real bits: whatever the words hold past them (the
    queries' padding unpacks to 0)."""
    bits = 70
    qw, gw = words(50, 6, bits, dev), words(51, 600, bits, dev)
    d, i = HT.topk_with(qw, gw, 9, "mma", bits)
    noise_q = qw.clone()
    noise_g = gw.clone()
    noise_q[:, 1] |= torch.randint(0, 2 ** 40, (6,), device=dev) << 6
    noise_g[:, 1] |= torch.randint(0, 2 ** 40, (600,), device=dev) << 6
    d2, i2 = HT.topk_with(noise_q, noise_g, 9, "mma", bits)
    assert torch.equal(d, d2) and torch.equal(i, i2)
    wd, wi = H.topk(H.PackedCodes(qw.cpu(), bits), H.PackedCodes(gw.cpu(), bits), 9,
                    backend="reference")
    assert torch.equal(d.cpu(), wd) and torch.equal(i.cpu(), wi)


def test_topk_method_choice_and_arguments(monkeypatch):
    """method="auto" keeps the popcount filter until MMA_MIN_BITS is set from GPU figures, and
    then takes the tensor cores only on a GPU and from that code length on."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert HT.MMA_MIN_BITS is None
    assert HT.topk_method(1024, cuda) == "popc" and HT.topk_method(128, cpu) == "popc"
    monkeypatch.setattr(HT, "MMA_MIN_BITS", 128)
    assert HT.topk_method(128, cuda) == "mma" and HT.topk_method(127, cuda) == "popc"
    assert HT.topk_method(128, cpu) == "popc"
    qw = torch.zeros((2, 2), dtype=torch.int64)
    with pytest.raises(ValueError, match="method must be one of"):
        HT.topk_with(qw, qw, 1, "imma")
    with pytest.raises(TypeError, match="method must be a str"):
        HT.topk_with(qw, qw, 1, None)
    with pytest.raises(ValueError, match=r"nbits must be in \[1, 128\]"):
        HT.topk_with(qw, qw, 1, "mma", 129)


def test_topk_mma_refuses_galleries_past_int32_rows(dev, monkeypatch):
    monkeypatch.setattr(HT, "MAX_ROWS", 50)
    qw, gw = words(30, 2, 64, dev), words(31, 51, 64, dev)
    with pytest.raises(ValueError, match="galleries of at most 50 codes, got 51"):
        HT.topk_with(qw, gw, 3, "mma")


def test_topk_mma_workspace_does_not_grow_with_the_gallery():
    cpu = torch.device("cpu")
    a = HT.topk_mma_workspace_bytes(1000, 10 ** 6, 10, 2, cpu)
    b = HT.topk_mma_workspace_bytes(1000, 10 ** 8, 10, 2, cpu)
    assert a == b and a < 1000 * 10 ** 6 * 4 / 50  # 2% of a Q x G int32 matrix
    assert a > HT.topk_workspace_bytes(1000, 10 ** 6, 10, 2, cpu)


def test_hash_index_topk_method(dev, small_engine):
    """HashIndex(topk_method=...): "mma" searches with the tensor-core filter (the same answer
    as the default), on the Triton backend only; bad values are named."""
    bits = 100
    codes = H.PackedCodes(words(60, 700, bits, dev), bits)
    query = H.PackedCodes(words(61, 9, bits, dev), bits)
    found = []
    for method in ("auto", "popc", "mma"):
        index = H.HashIndex(bits, backend="triton", device=dev, topk_method=method)
        index.add(codes)
        found.append(index.search(query, 6))
    for d, i in found[1:]:
        assert torch.equal(d, found[0][0]) and torch.equal(i, found[0][1])
    with pytest.raises(ValueError, match="topk_method must be one of"):
        H.HashIndex(bits, topk_method="tensor")
    with pytest.raises(TypeError, match="topk_method must be a str"):
        H.HashIndex(bits, topk_method=1)
    cpu_index = H.HashIndex(bits, backend="reference", topk_method="mma")
    cpu_index.add(H.PackedCodes(codes.words.cpu(), bits))
    with pytest.raises(ValueError, match="topk_method 'mma' is a filter of the Triton engine"):
        cpu_index.search(H.PackedCodes(query.words.cpu(), bits), 3)


class _MmaMethod:
    """The Triton engine's tensor-core top-k as an engine for check_topk_peak_memory."""
    topk = staticmethod(lambda qw, gw, k: HT.topk_with(qw, gw, k, "mma"))
    topk_workspace_bytes = staticmethod(HT.topk_mma_workspace_bytes)


@pytest.mark.skipif(TRITON_DEVICE != "cuda", reason="peak GPU memory: needs a GPU")
def test_topk_mma_peak_gpu_memory_is_not_q_by_g():
    check_topk_peak_memory(_MmaMethod)


# ------------------------------------------------------------------------------------------
# Retrieval (AP, cut-offs, histograms)
# ------------------------------------------------------------------------------------------

def labels(seed, n, classes=None, L=None, dev="cpu"):
    g = torch.Generator().manual_seed(seed)
    if classes:
        return torch.randint(0, classes, (n,), generator=g).to(dev)
    return (torch.rand(n, L, generator=g) < 0.15).to(dev)


def assert_same_retrieval(got, qw, gw, ql, gl, cuts, bits):
    """A GPU engine's retrieval outputs `got` against the torch reference's: counts and
    histograms equal, AP and precision sums to 1e-12.  Returns the reference's AP."""
    assert all(t.device == qw.device for t in got)
    ref = _ref_pass(qw.cpu(), gw.cpu(), ql.cpu(), gl.cpu(), cuts, True, bits, "reference")
    ap, nrel, hits, psum, hist, relhist = (t.cpu() for t in got)
    wap, wnrel, whits, wpsum, whist, wrelhist = ref
    assert torch.equal(nrel, wnrel)
    assert torch.equal(torch.isnan(ap), torch.isnan(wap))
    np.testing.assert_allclose(ap.numpy(), wap.numpy(), rtol=1e-12, atol=0, equal_nan=True)
    assert torch.equal(hits, whits)
    np.testing.assert_allclose(psum.numpy(), wpsum.numpy(), rtol=1e-12, atol=0)
    assert torch.equal(hist, whist[:, :bits + 1]) and torch.equal(relhist, wrelhist[:, :bits + 1])
    return wap


def check_retrieval(dev, bits, Q, G, classes=None, L=None, cuts=(), seed=0):
    qw, gw = words(seed + 1, Q, bits, dev), words(seed + 2, G, bits, dev)
    ql, gl = labels(seed + 3, Q, classes, L, dev), labels(seed + 4, G, classes, L, dev)
    qp, gp = H.PackedCodes(qw, bits), H.PackedCodes(gw, bits)
    qlp, glp = ql, gl
    if L:
        qlp, glp = H.pack_codes(ql, zero_one=True).words, H.pack_codes(gl, zero_one=True).words
    got = HT.retrieval(qw, gw, qlp, glp, bits, cuts, hist=True)
    wap = assert_same_retrieval(got, qw, gw, ql, gl, cuts, bits)
    # mAP through the public API, the engine picked for these tensors
    m = H.mean_average_precision(qp, ql, gp, gl, backend="triton")
    want = np.nanmean(wap.numpy()) if (~torch.isnan(wap)).any() else math.nan
    assert (math.isnan(m) and math.isnan(want)) or m == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("bits,Q,G,classes,L", [
    (1, 1, 1, 3, None), (7, 3, 97, 4, None), (64, 97, 1031, 10, None), (128, 5, 4099, 10, None),
    (300, 3, 260, 2, None), (65, 4, 300, None, 3), (128, 3, 200, None, 70),
    (128, 2, 120, None, 150)])
def test_retrieval_equals_the_reference(dev, bits, Q, G, classes, L):
    """Single labels and multi-hot in 1, 2 and 3 packed words (3: past the two kept in
    registers), 1 to 5 code words, gallery slices (several per query block here too)."""
    cuts = tuple(sorted({1, min(7, G), G}))
    check_retrieval(dev, bits, Q, G, classes, L, cuts, seed=bits + G)


@pytest.mark.slow
def test_retrieval_gpu_step_of_one_row(dev, monkeypatch):
    """The GPU's configuration walks one row per step (U = 1); the interpreter normally takes
    64: run the GPU's under the interpreter too, so CI checks the path a GPU takes."""
    monkeypatch.setitem(HT.AP_CONFIG, "interpreter", (32, 1, 1))
    check_retrieval(dev, 128, 33, 61, classes=3, cuts=(1, 10, 61), seed=5)


def test_retrieval_ties_within_a_step(dev, monkeypatch):
    """Few distinct codes and a step of 8 rows: equal distances inside one step take their
    ranks in gallery order from the within-step counts."""
    monkeypatch.setitem(HT.AP_CONFIG, "interpreter", (32, 8, 1))
    for distinct in (1, 3):
        qw, gw = words(20, 9, 16, dev, distinct), words(21, 203, 16, dev, distinct)
        ql, gl = labels(22, 9, 3, dev=dev), labels(23, 203, 3, dev=dev)
        got = HT.retrieval(qw, gw, ql, gl, 16, (1, 5, 100), hist=True)
        ref = _ref_pass(qw.cpu(), gw.cpu(), ql.cpu(), gl.cpu(), (1, 5, 100),
                                        True, 16, "reference")
        for a, b in zip(got, ref):
            b = b[:, :17] if b.dim() == 2 and b.shape[1] == 65 else b
            np.testing.assert_allclose(a.cpu().numpy(), b.numpy(), rtol=1e-12, equal_nan=True)


def test_galleries_past_int32_rows_are_refused(dev, monkeypatch):
    monkeypatch.setattr(HT, "MAX_ROWS", 50)
    qw, gw = words(30, 2, 64, dev), words(31, 51, 64, dev)
    lab = torch.zeros(51, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="galleries of at most 50 codes, got 51"):
        HT.topk(qw, gw, 3)
    with pytest.raises(ValueError, match="galleries of at most 50 codes, got 51"):
        HT.retrieval(qw, gw, lab[:2], lab, 64)


def test_retrieval_refuses_long_codes(dev):
    qw = torch.zeros(2, 17, dtype=torch.int64, device=dev)
    lab = torch.zeros(2, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="at most 1023 bits"):
        HT.retrieval(qw, qw, lab, lab, 1024)


# ------------------------------------------------------------------------------------------
# Launch grids at the sizes users reach (Hamming: G up to 100M codes on one GPU, Q up to 1e6,
# k up to 10000, 1..1024 bits).  The distance kernel (`_cdist_kernel`: hamming_distance and
# the top-k's chunked path for k > TOPK_MAX_K, topk_direct) was launched on the grid (Q tiles,
# G tiles): CUDA caps a grid's second and third dimensions at 65535 blocks, so a gallery past
# 65535 x 64 = 4,194,240 codes failed to launch on a GPU (the interpreter has no such limit).
# The plans are built from meta tensors: nothing is allocated.
# ------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------
# The GPU engines ("cuda" in emulation, "triton" interpreted) against the C++ engine on inputs
# aimed at the branch points of nac_fast/ops/hamming_topk.py (the bound from a strided sample,
# the filter pass's CA + k slots per (query, slice), the overflow rerun, the k > TOPK_MAX_K
# and small-gallery paths) and of the kernels (slices, partial query blocks and tiles, code
# lengths at word boundaries).  Every case equals the C++ engine exactly; the CUDA-only
# cases: tests/test_hamming_cuda.py.
# ------------------------------------------------------------------------------------------

needs_ext = pytest.mark.skipif(dispatch.extension() is None, reason="no compiled extension")

MAX_ROWS = (1 << 31) - 1  # int32's largest row count (each engine's own: E.MAX_ROWS)


def cpu_words(seed, n, bits, distinct=None):
    """words() on CPU tensors (the C++ engine is the oracle)."""
    return words(seed, n, bits, "cpu", distinct)


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
    """The GPU engines that run on CPU tensors here: "cuda" in emulation (csrc/hamming_lanes.h),
    "triton" under TRITON_INTERPRET=1."""
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
# Slice bounds near MAX_ROWS (the defect the audit found)
# ------------------------------------------------------------------------------------------

def slice_bounds_probe(kernel, tmp_path):
    """A Triton function of (G, L) running a kernel's own `start = ...` / `end = ...` statements
    for slices s = 0, 1 (typed as in the kernel: program id and scalars in int32)."""
    return bounds_probe(kernel, tmp_path, pid="s", ints=("G", "L"), stores=("start", "end"))


@needs_ext
@pytest.mark.parametrize("kernel", ["_topk_filter_kernel", "_topk_mma_kernel", "_ap_hist_kernel",
                                    "_ap_rank_kernel"])
def test_triton_last_slice_ends_at_the_gallery_end_near_max_rows(tmp_path, kernel):
    """G = 2^31 - 1 in two slices of L = 2^30 + 32 rows (a multiple of the tiles, as the plans
    make them): the second slice is [L, G).  In int32, s L + L = 2^31 + 64 wrapped to a negative
    end and the slice was skipped.

    Found by the audit of the GPU engines' exactness: the Triton kernels' slice bounds,
    ``end = min(s L + L, G)`` in int32, wrapped past 2^31 - 1 for the last slice of a gallery
    within a few slices' rounding of MAX_ROWS (G = 2^31 - 1 always): that slice ended at a
    negative row and was skipped, so the top-k missed its rows and the retrieval passes did not
    count them (the filter's tile loop, g0 + BG, wrapped there too).  The kernels compute
    ``s L + min(L, G - s L)``, and the Triton engine takes at most 2^31 - 2^16 rows
    (hamming_triton.MAX_ROWS), so the filter's int32 tiles past the last row stay below 2^31
    (int64 rows would cost it a block per SM under Triton 3.6).  A gallery that large needs a
    GPU (test_max_rows_gallery_on_a_gpu); here the kernels' own bound statements run in the
    interpreter (tests/_probes.py)."""
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


@needs_ext
def test_last_rows_found_small_gallery():
    """check_last_rows_found (the GPU test's oracle) on the CPU engines, small constants so the
    filter pass runs in several slices."""
    for E in engines():
        with constants(E, **SMALL):
            check_last_rows_found(E, torch.device("cpu"), 3001)


@needs_ext
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


@needs_ext
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
# Top-k: adversarial inputs, against the C++ engine
# ------------------------------------------------------------------------------------------

@needs_ext
@pytest.mark.parametrize("E", engines(), ids=lambda e: e.__name__.rsplit(".", 1)[-1])
def test_all_gallery_codes_equal(E):
    """Every distance tied: the first k rows, every k from 1 to G (the sampled bound, the filter
    pass in slices of ties, the direct path at k > G / ratio)."""
    G = 301
    gw = cpu_words(1, 1, 65).expand(G, 2).contiguous()
    qw = torch.cat([gw[:1], cpu_words(2, 4, 65)])
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


@needs_ext
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


@needs_ext
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
    gw = cpu_words(1, 1, 65).expand(G, 2).contiguous()
    qw = torch.cat([gw[:1], cpu_words(2, 4, 65)])
    for k in (1, 5, 75, G):
        check(qw, gw, k)
    qw, gw = cpu_words(3, 7, 129, distinct=3), cpu_words(3, 900, 129, distinct=3)
    for k in (1, 9):
        check(qw, gw, k)


@needs_ext
@pytest.mark.parametrize("E", engines(), ids=lambda e: e.__name__.rsplit(".", 1)[-1])
def test_ties_at_the_kth_distance_in_every_slice(E):
    """Three distinct codes, the queries among them: hundreds of rows tie at the k-th distance in
    every slice (more than the k slots at the bound of each); Q not a multiple of the block."""
    qw, gw = cpu_words(3, 7, 129, distinct=3), cpu_words(3, 900, 129, distinct=3)
    for k in (1, 3, 8, 9, 33):
        assert_topk(E, qw, gw, k, **SMALL)


@needs_ext
@pytest.mark.skipif(not (triton_runs() and TRITON_DEVICE == "cpu"), reason=SKIP_REASON)
@pytest.mark.parametrize("bits", [1, 64, 129, 320])
def test_code_lengths_triton(bits):
    qw = cpu_words(bits, 5, bits)
    gw = cpu_words(bits + 1, 200, bits, distinct=None if bits < 8 else 7)
    qw[0] = gw[199]
    for k in (1, 6, 200):
        assert_topk(HT, qw, gw, k, **SMALL)


@needs_ext
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
# Retrieval on heavy ties, against the C++ engine
# ------------------------------------------------------------------------------------------

def assert_retrieval(got, want):
    ap, nrel, hits, psum, hh, rh = got
    wap, wnrel, whits, wpsum, whh, wrh = want
    assert torch.equal(nrel, wnrel) and torch.equal(hits, whits)
    assert torch.equal(hh, whh) and torch.equal(rh, wrh)
    np.testing.assert_allclose(ap.numpy(), wap.numpy(), rtol=1e-12, atol=0, equal_nan=True)
    np.testing.assert_allclose(psum.numpy(), wpsum.numpy(), rtol=1e-12, atol=0)


@needs_ext
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
        gw, qw = cpu_words(2 * it, G, bits, distinct), cpu_words(2 * it + 1, Q, bits, distinct)
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


@needs_ext
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


# ------------------------------------------------------------------------------------------
# The GPU measurement's CPU mode (bench/bench_hamming.py --gpu --device cpu --tiny)
# ------------------------------------------------------------------------------------------

def _gpu_bench(args, env=None):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, os.path.join(root, "bench", "bench_hamming.py"),
                           "--gpu", *args], capture_output=True, text=True, cwd=root,
                          timeout=600, env=dict(os.environ, **(env or {})))


@pytest.mark.parametrize("args,msg", [
    (["--index-sizes", "0", "--cpu-topk-queries", "0"], "--index-sizes: values must be >= 1"),
    (["--index-sizes", "10,x"], "--index-sizes: a comma list of integers"),
    (["--index-sizes", "50", "--cpu-topk-queries", "0", "--k", "51"],
     "--k: at most the smallest gallery (50), got 51"),
    (["--gpu-repeats", "0"], "--gpu-repeats must be >= 1"),
])
def test_gpu_bench_refuses_bad_arguments(args, msg, capsys, monkeypatch):
    """bench/bench_hamming.py --gpu (the hamming and hamming-tc stages): a usage error (exit
    status 2) naming the flag, before any measurement."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "bench"))
    import bench_hamming
    with pytest.raises(SystemExit) as exc:
        bench_hamming.main(["--gpu"] + args)
    assert exc.value.code == 2 and msg in capsys.readouterr().err


@pytest.mark.slow  # ~40 s on the 2-core machine: the interpreter runs every row
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="interpreter plumbing, CI's: on a GPU machine the stage runs the real "
                    "command (and torch 2.11's wrap_triton refuses interpreted kernels)")
def test_gpu_bench_cpu_mode_runs_every_row(tmp_path):
    """The GPU command's plumbing on toy sizes (the Triton engine under the interpreter; the
    hamming and hamming-tc stages' command): every row timed, both top-k filters at two gallery
    sizes and the mAP, each checked against the C++ engine, appended to --csv with the int8
    floor; the one-line summary, then one JSON line."""
    import csv
    import json
    out = tmp_path / "hamming_gpu.csv"
    summ = tmp_path / "summary.txt"
    proc = _gpu_bench(["--device", "cpu", "--tiny", "--csv", str(out), "--summary-out", str(summ)],
                      dict(TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["failures"] == [] and summary["skipped"] == [] and summary["rows"] == 13
    assert summary["goals"] == {}
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 13 and "of_bound" in rows[0] and "speedup_vs_cpu" in rows[0]
    gpu_rows = [r for r in rows if r["engine"] != "cpu"]
    assert all(r["check"].startswith("ok") and float(r["bound_s"]) > 0 for r in gpu_rows)
    assert [(r["method"], r["engine"], r["gallery"], r["queries"]) for r in gpu_rows] == [
        ("map_all", "triton", "200", "33"), ("map_all", "triton", "600", "33"),
        ("map_all", "triton", "600", "16"), ("topk", "triton-popc", "4200", "9"),
        ("topk", "triton-mma", "4200", "9"), ("topk", "triton-popc", "9000", "4"),
        ("topk", "triton-popc", "9000", "9"), ("topk", "triton-mma", "9000", "4"),
        ("topk", "triton-mma", "9000", "9")]
    # like-for-like pairs carry the ratio; rows with another query count do not
    for r in gpu_rows:
        twin = [c for c in rows if c["engine"] == "cpu" and c["method"] == r["method"]
                and c["gallery"] == r["gallery"] and c["queries"] == r["queries"]]
        assert bool(r["speedup_vs_cpu"]) == bool(twin)
    line = summ.read_text()
    assert line.count("; ") == 12 and "topk triton-mma 9x9000" in line
