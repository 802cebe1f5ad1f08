"""The fp16 keys' gradient of the CUDA tensor-core kernel (csrc/nac_cuda_mma.cu), its rounding
steps emulated in numpy on whole problems (issue 23, item 1), and the scale it uses
(csrc/nac_math.h nac::pow2_scale) compiled on the host.

bwd_keys_mma_kernel forms P^T g in fp32 and packs it to fp16 (cvt.rn.f16x2.f32) for the second
tensor-core product.  With reduction="mean", g = 1/n and P ~ 1/N: at n = N = 8192, P g ~ 1e-8,
below fp16's smallest subnormal (6e-8), and the keys' gradient came out 13 % wrong.  The kernel
now multiplies g by a power of two (max |g| 2^k in [2^13, 2^14)) and divides it out of the fp32
accumulator at the store (docs/math.md [M:grad-scale]).

The emulation follows the kernel's steps, each rounded as the hardware rounds it:
  prologue   Q2 = fp16(fp32(fp32(m z) s log2 e)), z = tanh(a) in fp32; keys as given (fp16);
  forward    lse = fp32(ln 2 * log2-sum-exp2 of S2) (the finish kernel's fp32 result; its own
             rounding, ~1e-7, is far below what is measured here);
  backward   S2^T = K Q2^T in fp32 (products of fp16 values are exact in fp32, summed in fp32 by
             numpy's BLAS: another order than the tensor core's, the same precision);
             x = fmaf(lse, -log2 e, S2^T) (one rounding); p = ex2.approx.ftz(x) (exact exp2
             rounded to fp32, results below 2^-126 flushed to 0: the approximation's 2^-22
             relative error is far below fp16's 2^-11); p * fp32(g * gscale) in fp32, rounded to
             fp16 with subnormals (cvt.rn.f16x2.f32); dK = sum of fp16(P^T g) Q2 in fp32, times
             fp32(ln 2 * ginv); then rounded to fp16, the keys' dtype (the autograd glue's cast).
Whether the kernel scales g is read from its source (the expressions below must occur verbatim in
bwd_keys_mma_kernel), so this test fails on a kernel without the scale.
"""
import math
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from test_cuda_mma_layout import ROOT, body, round16

SCALE_USE = "exp2_approx(fmaf(s_lse[b][i], -kLog2e, s[nt][e])) * (s_g[b][i] * gscale)"
SCALE_UNDO = "store_acc<DPAD>(pdk, dk, key0, N, sp * N, D, kLn2 * ginv);"
SCALE_FROM = "const nac::Pow2Scale ps = nac::pow2_scale(gm);"
F32 = np.float32


def kernel_scales_g() -> bool:
    """Whether bwd_keys_mma_kernel scales g (all three steps present in its source)."""
    src = body("bwd_keys_mma_kernel")
    return all(x in src for x in (SCALE_USE, SCALE_UNDO, SCALE_FROM))


def pow2_scale(gmax: float):
    """nac::pow2_scale in numpy: (2^k, 2^-k) as float32, from gmax's exponent bits."""
    e = int(np.array(gmax, F32).view(np.uint32)) >> 23 & 0xFF
    b = min(max(267 - e, 2), 253)
    return (np.array(b << 23, np.uint32).view(F32)[()],
            np.array((254 - b) << 23, np.uint32).view(F32)[()])


def _fp32(x):
    return np.asarray(x, np.float64).astype(F32)


def emulate_keys_grad(a, r, keys, noise, reduction: str, p: float = 0.1,
                      scaled=None, chunk: int = 1024) -> np.ndarray:
    """The keys' gradient (N, D) float64 that bwd_keys_mma_kernel computes for fp16 inputs
    (torch tensors a, r, keys, noise, fp16) and g of `reduction` ("mean" or "sum"), one query
    split; `scaled`: None = as the kernel's source says, else force with/without the scale."""
    assert a.dtype == torch.float16 and keys.dtype == torch.float16
    n, D = a.shape
    s = 0.5 * math.log((1 - p) / p)
    z = np.tanh(a.double().numpy().astype(F32))                   # tanhf, fp32
    mz = _fp32(noise.double().numpy().astype(F32) * z)
    Q2 = round16(_fp32(mz * F32(s * 1.4426950408889634)), "fp16")  # float64 holding fp16 values
    K = keys.double().numpy()
    # forward: lse in natural units, fp32
    S2 = Q2 @ K.T
    mx = S2.max(1, keepdims=True)
    lse = _fp32((mx[:, 0] + np.log2(np.exp2(S2 - mx).sum(1))) * math.log(2))
    del S2
    g = np.full(n, F32(1.0) if reduction == "sum" else F32(1.0) / F32(n), F32)
    if scaled is None:
        scaled = kernel_scales_g()
    gscale, ginv = pow2_scale(float(np.abs(g).max())) if scaled else (F32(1), F32(1))
    gs = _fp32(g.astype(np.float64) * float(gscale))
    log2e = F32(1.4426950408889634)
    Kf, Qf = K.astype(F32), Q2.astype(F32)   # fp16 values: exact in fp32
    dk = np.zeros((K.shape[0], D), F32)
    for i0 in range(0, n, chunk):
        q = Qf[i0:i0 + chunk]
        st = Kf @ q.T                                              # fp32 sums (BLAS)
        x = _fp32(st.astype(np.float64) - lse[i0:i0 + chunk].astype(np.float64) * float(log2e))
        pe = _fp32(np.exp2(x.astype(np.float64)))
        pe[pe < 2.0 ** -126] = 0.0                                # .ftz
        pt = round16(_fp32(pe.astype(np.float64) * gs[i0:i0 + chunk]), "fp16").astype(F32)
        dk += pt @ q                                               # fp32 accumulation
    dk = _fp32(dk.astype(np.float64) * float(_fp32(math.log(2) * float(ginv))))
    return round16(dk, "fp16")  # the op's fp32 result, cast to the keys' dtype by the autograd glue


def exact_keys_grad(a, r, keys, noise, reduction: str, p: float = 0.1,
                    chunk: int = 1024) -> np.ndarray:
    """d/dkeys of the loss in float64 (docs/math.md [M:grad-keys]): sum_i g_i P_ij s m_i z_i,
    from the same fp16-rounded inputs; written independently of nac_fast."""
    n, D = a.shape
    s = 0.5 * math.log((1 - p) / p)
    zt = noise.double().numpy() * np.tanh(a.double().numpy())
    K = keys.double().numpy()
    g = 1.0 if reduction == "sum" else 1.0 / n
    dk = np.zeros_like(K)
    for i0 in range(0, n, chunk):
        L = s * zt[i0:i0 + chunk] @ K.T
        P = np.exp(L - L.max(1, keepdims=True))
        P /= P.sum(1, keepdims=True)
        dk += P.T @ (g * s * zt[i0:i0 + chunk])
    return dk


def fp16_inputs(n, N, D, scale=0.5, seed=0):
    """(a, r, keys, noise) in fp16, a ~ N(0, scale^2), keys tanh of the same: with scale 0.5
    the softmax is nearly flat (P ~ 1/N) and the keys' gradient, ~1e-5 at n = N = 8192, is still
    an fp16 number (smaller codes make it smaller than fp16 can hold, whatever the kernel)."""
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(n, D, generator=gen) * scale).half()
    r = (torch.randn(n, D, generator=gen) * 2).half()
    keys = torch.tanh(torch.randn(N, D, generator=gen) * scale).half()
    noise = torch.where(torch.rand(n, D, generator=gen) < 0.1, -1.0, 1.0).half()
    return a, r, keys, noise


def _rel(x, ref):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("n,N", [(64, 8192), (2048, 2048),
                                 pytest.param(8192, 8192, marks=pytest.mark.slow)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp16_keys_gradient_of_the_cuda_kernel(n, N, reduction):
    """Within 1e-2 of float64 (the issue's absolute goal; measured 4e-4 at 2048, 1.6e-3 at 8192:
    the fp16 rounding of the result itself); without the scale the same steps are not (1.05e-2
    at n = N = 2048, 8.0e-2 at 8192, "mean"): the emulation can fail."""
    a, r, keys, noise = fp16_inputs(n, N, 64)
    ref = exact_keys_grad(a, r, keys, noise, reduction)
    assert kernel_scales_g(), "bwd_keys_mma_kernel no longer scales g (see the module doc)"
    err = _rel(emulate_keys_grad(a, r, keys, noise, reduction), ref)
    assert err <= 1e-2, err
    if reduction == "mean" and n * N >= 2048 * 2048:
        assert _rel(emulate_keys_grad(a, r, keys, noise, reduction, scaled=False), ref) > 1e-2


@pytest.mark.parametrize("gmax", [0.0, 1.0, 1.999, 2.0, 1 / 8192, 3e-30, 1e-40, 6e4, 3e38,
                                  float("inf"), float("nan")])
def test_pow2_scale_python_and_its_range(gmax):
    scale, inv = pow2_scale(gmax)
    assert scale > 0 and inv > 0 and float(scale) * float(inv) == 1.0
    assert math.log2(scale) == round(math.log2(scale))  # a power of two: scaling is exact
    if math.isfinite(gmax) and 2.0 ** -114 <= gmax:
        assert 2 ** 13 <= gmax * float(scale) < 2 ** 14
    elif gmax < 2.0 ** -114:  # zero and tiny: the largest scale that keeps 2^-k normal
        assert scale == 2.0 ** 126


def test_pow2_scale_of_the_cuda_header_matches():
    """csrc/nac_math.h's nac::pow2_scale (what the CUDA kernel calls) compiled on the host: the
    same bits as the numpy version (and so as the Triton kernel's _pow2_scale, which the
    interpreter tests check end to end)."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    values = [0.0, 1.0, 1.999, 2.0, 1 / 8192, 3e-30, 1e-40, 6e4, 3e38, float("inf")]
    prog = ('#include <stdio.h>\n#include "nac_math.h"\nint main() {\n  const float v[] = {'
            + ", ".join("INFINITY" if math.isinf(v) else repr(float(v)) + "f" for v in values)
            + '};\n  for (float x : v) { nac::Pow2Scale p = nac::pow2_scale(x);\n'
            '    printf("%a %a\\n", (double)p.scale, (double)p.inv); }\n}\n')
    tmp = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pow2_scale_{os.getpid()}")
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "t.cpp"), "w") as f:
        f.write(prog)
    subprocess.run([cxx, "-std=c++17", "-O1", "-I", os.path.join(ROOT, "csrc"),
                    os.path.join(tmp, "t.cpp"), "-o", os.path.join(tmp, "t")], check=True)
    out = subprocess.run([os.path.join(tmp, "t")], capture_output=True, text=True, check=True)
    got = [tuple(float.fromhex(x) for x in line.split()) for line in out.stdout.splitlines()]
    shutil.rmtree(tmp, ignore_errors=True)
    want = [tuple(float(x) for x in pow2_scale(v)) for v in values]
    assert got == want
