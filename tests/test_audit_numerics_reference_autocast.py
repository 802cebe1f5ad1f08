"""Audit (numerics): the reference loss ignores autocast, as the fused losses and nac_vi_loss do.

Under torch.autocast the reference's logits matmul ran in the autocast dtype: nac_loss(a, r, p,
backend="reference") with fp32 inputs gave bf16-precision rows (7.6e-4 off float64 at n = 64,
D = 128; the fused kernels: 1e-7), and the multilinear likelihood's series, documented to run in
float32 (docs/math.md [M:multilinear]), ran its matmul in bf16 (4.2e-4).  nac_fast/ops/reference.py
`nac_rows_reference` now turns autocast off inside.
"""
import pytest
import torch

import nac_fast

from _loss_helpers import rel_err, run_loss


def _inputs(n=48, N=64, D=96, seed=7):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(n, D, generator=g) * 1.5, "r": torch.randn(n, D, generator=g) * 2,
            "keys": torch.tanh(torch.randn(N, D, generator=g) * 1.5)}, \
        nac_fast.draw_noise((n, D), 0.1, generator=g)


@pytest.mark.parametrize("kind", ["inbatch", "keys", "mq"])
@pytest.mark.parametrize("likelihood", ["dot", "multilinear"])
def test_reference_under_autocast_keeps_fp32_precision(kind, likelihood):
    t, noise = _inputs()
    if kind == "inbatch":
        del t["keys"]

    def fn(a, r, keys=None, noise=None):
        if kind == "mq":
            return nac_fast.nac_mq_loss(a, r, keys.detach(), 0.1, l2=0.1, noise=noise,
                                        backend="reference", likelihood=likelihood)
        return nac_fast.nac_loss(a, r, 0.1, keys=keys, noise=noise, backend="reference",
                                 likelihood=likelihood)

    leaves64 = {k: v.double().requires_grad_() for k, v in t.items()}
    v64, g64 = run_loss(fn, leaves64, noise=noise.double())
    leaves = {k: x.requires_grad_(k != "keys" or kind == "keys") for k, x in t.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the forward under autocast, the
        v = fn(**leaves, noise=noise)                    # backward outside (torch's advice)
    v.backward()
    g = {k: x.grad for k, x in leaves.items() if x.grad is not None}
    assert v.dtype == torch.float32
    assert rel_err(v, v64) <= 1e-5, rel_err(v, v64)
    for name in g64:
        if kind == "mq" and name == "keys":
            continue
        assert rel_err(g[name], g64[name]) <= 1e-4, (name, rel_err(g[name], g64[name]))


def test_multilinear_criterion_under_autocast_is_the_bf16_call():
    """NACLoss under autocast hands the loss bf16 inputs; the multilinear series then runs in
    float32 exactly as for the same bf16 inputs without autocast (before: its matmul in bf16)."""
    t, noise = _inputs(n=32, D=64)
    a0, a1 = t["a"][:16], t["a"][16:]
    r0, r1 = t["r"][:16], t["r"][16:]
    crit = nac_fast.NACLoss(0.25, backend="reference", likelihood="multilinear")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp = crit((a0, r0), (a1, r1), noise=noise)
    plain = crit((a0.bfloat16(), r0.bfloat16()), (a1.bfloat16(), r1.bfloat16()),
                 noise=noise.bfloat16())
    assert torch.equal(amp, plain), (amp.item(), plain.item())
