"""fp32 in fp16x3 (NAC_FAST_FP32_DOT=fp16x3, kernels/nac_triton.py _parts2h/_dot3h): the Triton
backend's in-batch fp32 products as three fp16 tensor-core products of two-part operand splits,
the operands scaled by fixed powers of two (H_Q, H_K) and the keys' backward's P^T g by the fp16
path's per-split one; given keys run bf16x6.

Against float64 with the fp32 budgets of tests/test_loss_backends.py (1e-5 on the value, 1e-4 on
the gradients) at the awkward sizes, flip probabilities near both ends, codes near 0 and upstream
gradients over twelve decades; no worse than tf32x3 (2x and 1e-7); the split bit for bit torch's
fp16 rounding; the plan's shapes; determinism.  The GPU suite runs this file on CUDA tensors.
"""
import os

import pytest
import torch

import nac_fast

from _loss_helpers import fused_backends, rel_err, run_loss

DEVICE = os.environ.get("NAC_FAST_TEST_DEVICE", "cpu")
pytestmark = pytest.mark.skipif("triton" not in fused_backends(DEVICE),
                                reason="the Triton backend does not run here")


@pytest.fixture(autouse=True)
def fp16x3(monkeypatch):
    monkeypatch.setenv("NAC_FAST_FP32_DOT", "fp16x3")


try:
    import triton
    import triton.language as tl
    from nac_fast.kernels.nac_triton import _parts2h

    @triton.jit
    def _split_kernel(X, X0, X1, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        x0, x1 = _parts2h(tl.load(X + o))
        tl.store(X0 + o, x0)
        tl.store(X1 + o, x1)
except ImportError:  # no Triton: the module is skipped
    _split_kernel = None


def _inputs(n, D, seed, scale=1.5, p=0.1):
    g = torch.Generator().manual_seed(seed)
    t = {"a": torch.randn(n, D, generator=g) * scale, "r": torch.randn(n, D, generator=g) * 2}
    noise = nac_fast.draw_noise((n, D), p, generator=g)
    return {k: v.to(DEVICE).requires_grad_() for k, v in t.items()}, noise.to(DEVICE)


def _loss(a, r, **kw):
    return nac_fast.nac_loss(a, r, kw.pop("p"), **kw)


def _against_f64(t, noise, w, p=0.1, reduction="none"):
    kw = dict(p=p, reduction=reduction)
    v64, g64 = run_loss(_loss, {k: x.double().detach().requires_grad_() for k, x in t.items()},
                        w, backend="reference", noise=noise.double(), **kw)
    v, g = run_loss(_loss, t, w, backend="triton", noise=noise, **kw)
    assert v.dtype == torch.float32
    return rel_err(v, v64), {k: rel_err(g[k], g64[k]) for k in g64}


SIZES = [(1, 1), (3, 7), (33, 64), (97, 128), (130, 16), (257, 128)]


@pytest.mark.parametrize("n,D", SIZES, ids=[f"{n}-{D}" for n, D in SIZES])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_against_float64(n, D, reduction):
    t, noise = _inputs(n, D, n * 7 + D)
    w = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(DEVICE)
    ve, ge = _against_f64(t, noise, w, reduction=reduction)
    assert ve <= 1e-5, ve
    assert all(e <= 1e-4 for e in ge.values()), ge


@pytest.mark.parametrize("p,scale,wlog", [(1e-6, 1.5, 0), (0.45, 1.5, 0), (0.1, 1e-3, 0),
                                          (0.1, 40.0, 0), (0.1, 1.5, 12)],
                         ids=["p-1e-6", "p-0.45", "codes-near-0", "saturated", "g-12-decades"])
def test_ranges_fp16_holds_only_scaled(p, scale, wlog):
    """The fixed scales keep |Q| H_Q and z H_K inside fp16 for any flip probability (s up to
    ~7 here), codes near 0 lose nothing that matters, and the per-split power of two lifts P^T g
    whatever the upstream gradient's magnitude (weights from 1e-6 to 1e6 in one call)."""
    n, D = 97, 128
    t, noise = _inputs(n, D, 5, scale=scale, p=p)
    g = torch.Generator().manual_seed(2)
    w = (torch.rand(n, generator=g) * 2 - 1) * 10.0 ** (
        (torch.rand(n, generator=g) - 0.5) * wlog)
    ve, ge = _against_f64(t, noise, w.to(DEVICE), p=p)
    assert ve <= 1e-5, ve
    assert all(e <= 1e-4 for e in ge.values()), ge


def test_no_worse_than_tf32x3(monkeypatch):
    """fp16x3's splits hold what tf32x3's do (11 + 11 bits): its error against float64 is within
    2x (and 1e-7) of tf32x3's on the same inputs (bench/split_emulation.py: the same error on
    each product)."""
    t, noise = _inputs(257, 128, 8)
    w = torch.ones(257, device=DEVICE)
    ve, ge = _against_f64(t, noise, w)
    monkeypatch.setenv("NAC_FAST_FP32_DOT", "tf32x3")
    vt, gt = _against_f64(t, noise, w)
    assert ve <= 2 * vt + 1e-7, (ve, vt)
    for k in ge:
        assert ge[k] <= 2 * gt[k] + 1e-7, (k, ge[k], gt[k])


def test_split_is_torchs_fp16_rounding():
    """_parts2h: x0 = fp16(x), x1 = fp16(x - x0), each bit for bit torch's cast (round to
    nearest even, subnormals kept), and x0 + x1 within 2^-22 |x| where x1 is a normal number
    (|x| >= 2^-3), at the magnitudes the scaled operands take (up to 2^15)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=g) * 2.0 ** torch.randint(-20, 15, (4096,), generator=g)
    x[:4] = torch.tensor([0.0, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 32767.0])
    x = x.to(DEVICE)
    x0 = torch.empty(4096, dtype=torch.float16, device=DEVICE)
    x1 = torch.empty_like(x0)
    _split_kernel[(1,)](x, x0, x1, BLOCK=4096)
    want0 = x.to(torch.float16)
    want1 = (x - want0.float()).to(torch.float16)
    assert torch.equal(x0.view(torch.int16), want0.view(torch.int16))
    assert torch.equal(x1.view(torch.int16), want1.view(torch.int16))
    big = x.abs() >= 2.0 ** -3
    err = (x0.double() + x1.double() - x.double()).abs()
    assert (err[big] <= 2.0 ** -22 * x.double().abs()[big]).all()


@pytest.mark.parametrize("kind", ["inbatch", "keys"])
def test_plan_keeps_fp16_parts_in_batch_and_runs_given_keys_in_bf16x6(kind):
    """In-batch, the prologue hands the backward (2, n, D) fp16 parts; given keys (whose range
    fp16x3's fixed scales do not hold) run bf16x6: its (3, rows, D) bf16 parts, its bits."""
    from nac_fast.kernels import nac_triton as NT
    n, N, D = 40, 70, 16
    g = torch.Generator().manual_seed(4)
    a = torch.randn(n, D, generator=g).to(DEVICE)
    keys = torch.tanh(torch.randn(N, D, generator=g)).to(DEVICE) if kind == "keys" else None
    out = NT.fwd(a, a, torch.ones_like(a), keys, 1.1, 0.1, True)
    if keys is None:
        assert out[3].shape == (2, n, D) and out[3].dtype == torch.float16
        assert NT.fp32_mode_of(D, "inbatch", n, n, DEVICE) == "fp16x3"
        return
    assert out[3].shape == (3, n, D) and out[3].dtype == torch.bfloat16
    assert NT.fp32_mode_of(D, "queue", n, N, DEVICE) == "bf16x6"
    os.environ["NAC_FAST_FP32_DOT"] = "bf16x6"
    want = NT.fwd(a, a, torch.ones_like(a), keys, 1.1, 0.1, True)
    assert all(torch.equal(x, y) for x, y in zip(out, want))


def test_backward_is_deterministic_and_follows_its_saved_parts(monkeypatch):
    t, noise = _inputs(97, 128, 11)
    grads = []
    for env_at_backward in ("fp16x3", "fp16x3", "tf32x3"):
        a = t["a"].detach().clone().requires_grad_()
        loss = nac_fast.nac_loss(a, t["r"], 0.1, noise=noise, backend="triton")
        monkeypatch.setenv("NAC_FAST_FP32_DOT", env_at_backward)
        loss.backward()
        monkeypatch.setenv("NAC_FAST_FP32_DOT", "fp16x3")
        grads.append(a.grad)
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])
