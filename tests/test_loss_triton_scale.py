"""The Triton keys' backward's g scale (issue 23, item 1; docs/math.md [M:grad-scale]), fast.

The end-to-end fp16 checks at n = 4096/8192 (tests/test_loss_backends.py
test_fp16_keys_gradient_does_not_underflow) take minutes under the interpreter; these take
seconds: the scale function against its numpy twin (which csrc/nac_math.h's is checked against),
and the keys' kernel's fp32 output with a g so small that P g underflows fp16 entirely.
"""
import math
import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and
                                not torch.cuda.is_available(), reason="Triton cannot run here")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from nac_fast.kernels import nac_triton  # noqa: E402
from test_loss_cuda import fp16_inputs, pow2_scale  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _scale_kernel(X, S, INV, BLOCK: tl.constexpr):
    for i in tl.static_range(BLOCK):
        s, inv = nac_triton._pow2_scale(tl.load(X + i))
        tl.store(S + i, s)
        tl.store(INV + i, inv)


def test_triton_pow2_scale_matches_the_numpy_and_cuda_one():
    values = [0.0, 1.0, 1.999, 2.0, 1 / 8192, 3e-30, 1e-40, 6e4, 3e38, float("inf")]
    x = torch.tensor(values, dtype=torch.float32, device=DEVICE)
    s, inv = torch.empty_like(x), torch.empty_like(x)
    _scale_kernel[(1,)](x, s, inv, BLOCK=len(values))
    want = [pow2_scale(v) for v in values]
    assert s.tolist() == [float(w[0]) for w in want]
    assert inv.tolist() == [float(w[1]) for w in want]


@pytest.mark.parametrize("g_value", [1e-9, 1.0])
def test_keys_kernel_keeps_tiny_products(g_value, monkeypatch):
    """g = 1e-9: P g ~ 4e-12, nothing of it survives a rounding to fp16 (whose smallest subnormal
    is 6e-8); the kernel's fp32 split shares must still be the float64 gradient to fp16 precision
    (before the scale they were all zero: error 1)."""
    monkeypatch.setenv("NAC_FAST_TRITON_CPU_PROGRAMS", "4")  # several splits: fp32 shares out
    n, N, D = 64, 256, 64
    a, r, keys, noise = (x.to(DEVICE) for x in fp16_inputs(n, N, D))
    s = 0.5 * math.log(0.9 / 0.1)
    loss, lse, ga, q, k, _ = nac_triton.fwd(a, r, noise, keys, s, 0.0, False)
    g = torch.full((n,), g_value, device=DEVICE)
    launches, _ = nac_triton.bwd_plan(a, r, noise, keys, lse, ga, g, q, k, s, False, False, True,
                                      nac_triton.target_of(a.device))
    keys_launch = launches[0]
    assert keys_launch.tag == "bwd_keys" and keys_launch.grid[1] > 1
    nac_triton.run([keys_launch])
    got = keys_launch.args[4].sum(0).double().cpu().numpy()
    zt = noise.double().cpu().numpy() * np.tanh(a.double().cpu().numpy())
    logits = s * zt @ keys.double().cpu().numpy().T
    P = np.exp(logits - logits.max(1, keepdims=True))
    P /= P.sum(1, keepdims=True)
    want = P.T @ (g_value * s * zt)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err <= 2e-3, err
