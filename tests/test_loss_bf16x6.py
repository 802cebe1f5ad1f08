"""fp32 in bf16x6 (NAC_FAST_FP32_DOT=bf16x6, kernels/nac_triton.py _parts3/_dot6): the Triton
backend's fp32 products as six bf16 tensor-core products of three-part operand splits.

Against float64 with the fp32 budgets of tests/test_loss_backends.py (1e-5 on the value, 1e-4 on
the gradients), at the awkward sizes, in-batch, with given keys and NAC-MQ; the split itself
against torch's own bf16 rounding; the plan's shapes and launches; determinism; torch.compile
(on a GPU: bench/gpu_suite.sh runs this file with NAC_FAST_TEST_DEVICE=cuda).
"""
import os

import pytest
import torch

import nac_fast

from _loss_helpers import fused_backends, rel_err, run_loss

DEVICE = os.environ.get("NAC_FAST_TEST_DEVICE", "cpu")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and DEVICE == "cpu"
pytestmark = pytest.mark.skipif("triton" not in fused_backends(DEVICE),
                                reason="the Triton backend does not run here")


@pytest.fixture(autouse=True)
def bf16x6(monkeypatch):
    monkeypatch.setenv("NAC_FAST_FP32_DOT", "bf16x6")


def _fn(kind):
    if kind == "mq":
        return lambda a, r, keys, **kw: nac_fast.nac_mq_loss(a, r, keys.detach(), kw.pop("p"),
                                                             l2=0.1, **kw)
    return lambda a, r, keys=None, **kw: nac_fast.nac_loss(a, r, kw.pop("p"), keys=keys, **kw)


def _inputs(n, N, D, seed, kind, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    t = {"a": torch.randn(n, D, generator=g) * scale, "r": torch.randn(n, D, generator=g) * 2}
    if kind != "inbatch":
        t["keys"] = torch.tanh(torch.randn(N, D, generator=g) * 1.5)
    noise = nac_fast.draw_noise((n, D), 0.1, generator=g)
    return {k: v.to(DEVICE).requires_grad_() for k, v in t.items()}, noise.to(DEVICE)


CASES = [("inbatch", n, n, D) for n, D in ((1, 1), (3, 7), (97, 128), (130, 16), (33, 64))]
CASES += [("keys", n, N, D) for n, N, D in ((1, 131, 1), (3, 1031, 7), (97, 131, 128),
                                             (40, 4099, 32))]
CASES += [("mq", n, N, D) for n, N, D in ((1, 1, 7), (3, 4099, 128), (97, 1031, 64))]


@pytest.mark.parametrize("kind,n,N,D", CASES, ids=[f"{k}-{n}-{N}-{D}" for k, n, N, D in CASES])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_against_float64(kind, n, N, D, reduction):
    t, noise = _inputs(n, N, D, n * 7 + N + D, kind)
    w = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(DEVICE)
    kw = dict(p=0.1, reduction=reduction)
    v64, g64 = run_loss(_fn(kind), {k: x.double().detach().requires_grad_() for k, x in t.items()},
                        w, backend="reference", noise=noise.double(), **kw)
    v, g = run_loss(_fn(kind), t, w, backend="triton", noise=noise, **kw)
    assert v.dtype == torch.float32
    assert rel_err(v, v64) <= 1e-5, rel_err(v, v64)
    for name in g64:
        if kind == "mq" and name == "keys":
            continue
        assert g[name].dtype == torch.float32
        assert rel_err(g[name], g64[name]) <= 1e-4, (name, rel_err(g[name], g64[name]))


def test_no_worse_than_exact_fp32_products(monkeypatch):
    """bf16x6 keeps 27 bits of each operand: its error against float64 is within 2x (and 1e-7
    absolute) of the exact-FMA fp32 products' (NAC_FAST_FP32_DOT=ieee) on the same inputs."""
    t, noise = _inputs(97, 1031, 128, 5, "keys")
    w = torch.ones(97, device=DEVICE)
    kw = dict(p=0.1, noise=noise, reduction="none")
    v64, g64 = run_loss(_fn("keys"), {k: x.double().detach().requires_grad_()
                                      for k, x in t.items()}, w, backend="reference",
                        **{**kw, "noise": noise.double()})
    v6, g6 = run_loss(_fn("keys"), t, w, backend="triton", **kw)
    monkeypatch.setenv("NAC_FAST_FP32_DOT", "ieee")
    ve, ge = run_loss(_fn("keys"), t, w, backend="triton", **kw)
    assert rel_err(v6, v64) <= 2 * rel_err(ve, v64) + 1e-7
    for name in g64:
        assert rel_err(g6[name], g64[name]) <= 2 * rel_err(ge[name], g64[name]) + 1e-7, name


def test_parts_are_torchs_bf16_roundings():
    """_parts_kernel (given keys' split): x0 = bf16(x), x1 = bf16(x - x0), x2 = bf16(x - x0 - x1),
    each bit for bit torch's round-to-nearest-even cast (the interpreter truncates its own cast:
    the kernel rounds first), and x0 + x1 + x2 within 2^-26 of x, at magnitudes 1e-20 to 1e20
    (where all three parts are normal numbers: codes and their products live near 1)."""
    from nac_fast.kernels import nac_triton as NT
    from nac_fast.kernels.launch import run, Launch
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(97, 33, generator=g) * 10.0 ** torch.randint(-20, 21, (97, 1),
                                                                 generator=g)).to(DEVICE)
    x[0, :4] = torch.tensor([0.0, -0.0, 1.0 + 2 ** -8 + 2 ** -10, -(1.0 + 2 ** -8)])
    N, D = x.shape
    out = torch.empty((3, N, D), dtype=torch.bfloat16, device=DEVICE)
    run([Launch(NT._parts_kernel, (NT.cdiv(N, 16),), (x, out, N, D, x.stride(0)),
                dict(BLOCK_M=16, BLOCK_D=NT.block_d(D), RNE=x.device.type == "cpu"), 4, 1,
                "parts")])
    x0 = x.to(torch.bfloat16)
    x1 = (x - x0.float()).to(torch.bfloat16)
    x2 = (x - x0.float() - x1.float()).to(torch.bfloat16)
    for got, want in zip(out, (x0, x1, x2)):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    s = out.double().sum(0)
    assert ((s - x.double()).abs() <= 2.0 ** -26 * x.double().abs()).all()


@pytest.mark.parametrize("given", [False, True])
def test_plan_keeps_bf16_parts(given):
    """The forward hands the backward (3, rows, D) bf16 parts; given keys are split once, by a
    launch before the forward (and their parts, not the keys, go to the keys' backward)."""
    from nac_fast.kernels import nac_triton as NT
    from nac_fast.kernels.launch import target_of
    n, N, D = 40, 70, 16
    a = torch.randn(n, D, device=DEVICE)
    keys = torch.tanh(torch.randn(N, D, device=DEVICE)) if given else None
    launches, (loss, lse, ga, q, k, _) = NT.fwd_plan(a, a, torch.ones_like(a), keys, 1.1, 0.1,
                                                      True, target_of(a.device))
    assert q.shape == (3, n, D) and q.dtype == torch.bfloat16
    assert k.shape == (3, N if given else n, D) and k.dtype == torch.bfloat16
    tags = [L.tag for L in launches]
    assert tags == ((["parts", "fwd"] if given else ["prologue", "fwd"])
                    + ([] if NT.folding() else ["finish"]))
    assert NT.parts_mode(torch.float32, 128) and not NT.parts_mode(torch.float32, 129)
    assert not NT.parts_mode(torch.bfloat16, 128)


def test_fp32_dot_sets_the_mode_for_a_block_and_restores_it(monkeypatch):
    from nac_fast.kernels import nac_triton as NT
    with NT.fp32_dot("ieee"):
        assert NT.fp32_precision(128) == "ieee"
        with NT.fp32_dot(None):  # None: the environment as it is
            assert NT.fp32_precision(128) == "ieee"
    assert os.environ["NAC_FAST_FP32_DOT"] == "bf16x6"  # this file's fixture, restored
    monkeypatch.delenv("NAC_FAST_FP32_DOT")
    with NT.fp32_dot("bf16x6"):
        assert NT.parts_mode(torch.float32, 64)
    assert "NAC_FAST_FP32_DOT" not in os.environ
    with pytest.raises(ValueError, match="mode"):
        with NT.fp32_dot("bf16x3"):
            pass
    assert "NAC_FAST_FP32_DOT" not in os.environ


def test_backward_is_deterministic():
    t, noise = _inputs(97, 97, 128, 11, "inbatch")
    grads = []
    for _ in range(2):
        a = t["a"].detach().clone().requires_grad_()
        nac_fast.nac_loss(a, t["r"], 0.1, noise=noise, backend="triton").backward()
        grads.append(a.grad)
    assert torch.equal(grads[0], grads[1])


def test_torch_compile_matches_eager():
    if INTERPRETED:
        pytest.skip("AOTAutograd runs a triton_op's launches on functional tensors, which the "
                    "interpreter cannot read; bench/gpu_suite.sh runs this test on a GPU")
    t, noise = _inputs(40, 40, 16, 2, "mq")

    def step(a, r, keys):
        return nac_fast.nac_mq_loss(a * 1.5, r, keys, 0.1, noise=noise, backend="triton")

    eager = step(t["a"], t["r"], t["keys"].detach())
    ga, gr = torch.autograd.grad(eager, (t["a"], t["r"]))
    out = torch.compile(step, backend="aot_eager", fullgraph=True)(t["a"], t["r"],
                                                                   t["keys"].detach())
    ca, cr = torch.autograd.grad(out, (t["a"], t["r"]))
    assert torch.allclose(out, eager, rtol=1e-6)
    assert torch.allclose(ca, ga, rtol=1e-5, atol=1e-7)
    assert torch.allclose(cr, gr, rtol=1e-5, atol=1e-7)


def _table_says(monkeypatch, mode):
    """The tuned table's fp32 choice for every call (`nac_triton.call_fp32_mode`: on a GPU, the
    faster whole step of the autotune stage's figures; here given), NAC_FAST_FP32_DOT unset."""
    from nac_fast.kernels import nac_triton as NT
    monkeypatch.delenv("NAC_FAST_FP32_DOT", raising=False)
    monkeypatch.setattr(NT, "call_fp32_mode",
                        lambda dtype, D, kind, n, N, device: mode if dtype == torch.float32
                        and NT.block_d(D) <= NT.TF32_MAX_D else None)
    NT.FWD_PLANS.clear()
    NT.BWD_PLANS.clear()


@pytest.mark.parametrize("kind", ["inbatch", "keys", "mq"])
def test_the_tables_fp32_choice_runs_bf16x6_unless_the_environment_says(kind, monkeypatch):
    """NAC_FAST_FP32_DOT unset and the tuned table choosing bf16x6 for the call's shape: the plan
    runs bf16x6, the same bits as NAC_FAST_FP32_DOT=bf16x6, its codes saved as parts (and the
    fake forward, torch.compile's shapes, agrees); set, the environment decides."""
    from nac_fast.kernels import nac_triton as NT
    from nac_fast.ops.nac import _fake_fwd_triton
    t, noise = _inputs(40, 70, 16, 4, kind)
    w = torch.randn(40, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    kw = dict(p=0.1, noise=noise, reduction="none")
    want = run_loss(_fn(kind), t, w, backend="triton", **kw)          # env bf16x6
    _table_says(monkeypatch, "bf16x6")
    got = run_loss(_fn(kind), t, w, backend="triton", **kw)
    assert torch.equal(got[0], want[0])
    for k in want[1]:  # (NAC-MQ's queue takes no gradient: None in both)
        assert (got[1][k] is None and want[1][k] is None) or torch.equal(got[1][k], want[1][k])
    keys = None if kind == "inbatch" else t["keys"].detach()
    a = t["a"].detach()
    out = NT.fwd(a, t["r"].detach(), noise, keys, 1.1, 0.1, True)
    assert out[3].shape == (3, 40, 16) and out[3].dtype == torch.bfloat16
    fake = _fake_fwd_triton(a, a, noise, keys, 1.1, 0.1, True)
    assert [x.shape for x in fake[3:5]] == [x.shape for x in out[3:5]]
    monkeypatch.setenv("NAC_FAST_FP32_DOT", "tf32x3")                 # the environment wins
    assert NT.fwd(a, t["r"].detach(), noise, keys, 1.1, 0.1, True)[3].shape == (40, 16)
    assert NT.saved_parts(a, keys) == (0, None)
    monkeypatch.delenv("NAC_FAST_FP32_DOT")
    _table_says(monkeypatch, "tf32x3")
    assert NT.fwd(a, t["r"].detach(), noise, keys, 1.1, 0.1, True)[3].shape == (40, 16)
    assert NT.fp32_mode_of(16, "inbatch", 40, 40, DEVICE) == "tf32x3"
    _table_says(monkeypatch, "bf16x6")
    assert NT.fp32_mode_of(16, "inbatch", 40, 40, DEVICE) == "bf16x6"
    assert NT.fp32_mode_of(200, "inbatch", 40, 40, DEVICE) == "ieee"  # D > TF32_MAX_D


@pytest.mark.parametrize("fwd_mode,bwd_env", [("bf16x6", "tf32x3"), ("tf32x3", "bf16x6"),
                                               ("bf16x6", "ieee")])
def test_the_backward_runs_the_mode_its_saved_codes_were_made_in(fwd_mode, bwd_env,
                                                                   monkeypatch):
    """NAC_FAST_FP32_DOT changed between a forward and its backward: the backward follows the
    saved codes (bf16x6's (3, n, D) parts, or (n, D) codes, which a bf16x6 environment then
    reads in tf32x3), the same gradients as a call made wholly in the forward's mode."""
    t, noise = _inputs(33, 33, 64, 9, "inbatch")
    monkeypatch.setenv("NAC_FAST_FP32_DOT", fwd_mode)
    a, r = (t[k].detach().clone().requires_grad_() for k in ("a", "r"))
    nac_fast.nac_loss(a, r, 0.1, noise=noise, backend="triton").backward()
    a2, r2 = (t[k].detach().clone().requires_grad_() for k in ("a", "r"))
    loss = nac_fast.nac_loss(a2, r2, 0.1, noise=noise, backend="triton")
    monkeypatch.setenv("NAC_FAST_FP32_DOT", bwd_env)
    loss.backward()
    assert torch.equal(a2.grad, a.grad) and torch.equal(r2.grad, r.grad)
