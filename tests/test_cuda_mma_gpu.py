"""The CUDA backend's tensor-core kernels (csrc/nac_cuda_mma.cu) on a GPU: bf16 and fp16 inputs,
both losses (in-batch keys, given keys, the queue loss), every code width the kernels are built
for (DPAD 32, 64, 128, 256, with D below, at and between them; given keys read in place when
D % 8 == 0, else through the padded copy), shapes with several key / query splits and partial
tiles; forward value and every gradient against the float64 reference, within twice the error
of the reference computed in the same 16-bit dtype (test_loss_backends.py's bf16 rule), and
the backward bit-for-bit deterministic.  Skips without a GPU; bench/gpu_suite.sh's test stage
runs it.  It passed on an H100 (bench/results/NVIDIA-H100-80GB-HBM3_2026-11-27_run3/), which
took 'cuda' out of nac_fast.ops.dispatch.EXPERIMENTAL.
"""
import pytest
import torch

import nac_fast

from _loss_helpers import rel_err, run_loss

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or "cuda" not in nac_fast.available_backends("cuda"),
    reason="needs a GPU and the extension built with its CUDA kernels")

SHAPES = [  # (n, N, D): DPAD 32, 64, 128, 256; splits; partial tiles; D % 8 != 0
    (300, 300, 20), (129, 1031, 64), (97, 517, 100), (64, 300, 250), (1000, 4099, 128),
    (33, 17, 7), (2048, 8192, 256)]


def _inputs(n, N, D, dtype, seed, keys_given, p=0.1):
    g = torch.Generator().manual_seed(seed)
    t = {"a": torch.randn(n, D, generator=g) * 1.5, "r": torch.randn(n, D, generator=g) * 2}
    if keys_given:
        t["keys"] = torch.tanh(torch.randn(N, D, generator=g) * 1.5)
    noise = nac_fast.draw_noise((n, D), p, generator=g)
    return ({k: v.to("cuda", dtype).requires_grad_() for k, v in t.items()},
            noise.to("cuda", dtype))


def _fn(kind):
    if kind == "mq":
        return lambda a, r, keys, **kw: nac_fast.nac_mq_loss(a, r, keys.detach(), kw.pop("p"),
                                                             l2=0.1, **kw)
    return lambda a, r, keys=None, **kw: nac_fast.nac_loss(a, r, kw.pop("p"), keys=keys, **kw)


@pytest.mark.parametrize("n,N,D", SHAPES, ids=["-".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("kind", ["inbatch", "keys", "mq"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_tensor_core_path_against_float64(dtype, kind, n, N, D):
    t, noise = _inputs(n, N, D, dtype, seed=n + N + D, keys_given=kind != "inbatch")
    w = torch.randn(n, generator=torch.Generator().manual_seed(3)).to("cuda")
    fn = _fn(kind)
    kw = dict(p=0.1, reduction="none")
    exact = {k: x.detach().double().requires_grad_() for k, x in t.items()}
    v64, g64 = run_loss(fn, exact, w, backend="reference", noise=noise.double(), **kw)
    vref, gref = run_loss(fn, t, w, backend="reference", noise=noise, **kw)
    v, g = run_loss(fn, t, w, backend="cuda", noise=noise, **kw)
    assert torch.isfinite(v).all()
    assert rel_err(v, v64) <= 2 * rel_err(vref, v64) + 1e-7, (rel_err(v, v64), rel_err(vref, v64))
    for name in g64:
        if kind == "mq" and name == "keys":
            continue
        assert g[name].dtype == dtype and torch.isfinite(g[name]).all(), name
        e, eref = rel_err(g[name], g64[name]), rel_err(gref[name], g64[name])
        assert e <= 2 * eref + 1e-7, (name, e, eref)
    _, g2 = run_loss(fn, t, w, backend="cuda", noise=noise, **kw)
    for name in g:
        if g[name] is None:  # the queue's keys take no gradient (they are detached)
            assert g2[name] is None, name
            continue
        assert torch.equal(g[name], g2[name]), f"{name}: backward not deterministic"
