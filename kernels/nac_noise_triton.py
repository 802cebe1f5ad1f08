"""Triton kernel of the NAC channel noise drawn from a seed (op nac_fast::nac_noise_triton): the
Philox4x32-10 noise of docs/math.md [M:philox], element e = the flattened output's index.  The
same function as csrc/nac_math.h (noise_sign: the CPU and CUDA ops nac_fast::nac_noise) and
nac_fast/ops/reference.py (philox_noise), written out here rather than calling tl.rand so that the
bits are ours and do not change with Triton's version; tests check all of them bit for bit (and
against Random123's known-answer vector).  The seed is read from device memory: drawing it with
torch.randint on the GPU keeps the host out of the loop.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .launch import Launch, PlanCache, buffer, cdiv, eager_real, run


@triton.jit
def _philox_first_word(c0, c1, k0, k1):
    # uint32 blocks; products wrap mod 2^32 (unsigned), umulhi gives the high word
    c2 = c0 * 0
    c3 = c0 * 0
    for _ in tl.static_range(10):
        n0 = tl.umulhi(c2, 0xCD9E8D57) ^ c1 ^ k0
        n2 = tl.umulhi(c0, 0xD2511F53) ^ c3 ^ k1
        c1 = tl.mul(c2, 0xCD9E8D57, sanitize_overflow=False)
        c3 = tl.mul(c0, 0xD2511F53, sanitize_overflow=False)
        c0 = n0
        c2 = n2
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0


@triton.jit
def philox_sign(offs, seed_ptr, p):
    # The noise (-1.0 / +1.0, fp32) of the int64 element indices `offs` for the seed at seed_ptr
    # (one int64): the first Philox word of (seed, e), as a uniform in [0, 1), below p -> -1.
    # Also the NAC forward's prologue's (kernels/nac_triton.py, SEEDED): the same bits.
    seed = tl.load(seed_ptr)  # int64
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = (offs & 0xFFFFFFFF).to(tl.uint32)
    c1 = ((offs >> 32) & 0xFFFFFFFF).to(tl.uint32)
    w = _philox_first_word(c0, c1, k0, k1).to(tl.int32, bitcast=True)
    u = tl.where(w < 0, ~w, w).to(tl.float32) * 4.6566127342e-10
    return tl.where(u < p, -1.0, 1.0)


@triton.jit(do_not_specialize=["numel"])
def _noise_kernel(out_ptr, seed_ptr, p, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    tl.store(out_ptr + offs, philox_sign(offs, seed_ptr, p).to(out_ptr.dtype.element_ty),
             mask=mask)


BLOCK = 1024


def _p(p):
    return float(p)


def noise_plan(out: torch.Tensor, seed: torch.Tensor, p: float):
    """The launch that fills the floating tensor `out` (any shape, contiguous, any floating dtype:
    +-1 is exact in each) with the noise of `seed` (a one-element int64 tensor on out's device)."""
    n = out.numel()
    return [Launch(_noise_kernel, (cdiv(n, BLOCK),), (out, seed, float(p), n),
                   dict(BLOCK=BLOCK), 4, 1, "noise", (("p", _p),))]


PLANS = PlanCache("nac_noise_triton")  # kernels/launch.py Plan: one per (shape, dtype, device)


def _launcher(launches):
    run(launches)


def seed_operand(seed: torch.Tensor) -> torch.Tensor:
    """A seed as the kernels read it (`philox_sign`): one int64 element, shape (1,)."""
    seed = seed.reshape(1)
    return seed if seed.dtype == torch.int64 else seed.to(torch.int64)


def noise(like: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """The op's body: the noise of like's shape, dtype and device (launched on like's device),
    written in like's dtype by the kernel (no float32 copy)."""
    seed = seed_operand(seed)

    def build():
        out = buffer(like.shape, like.dtype, like)
        return noise_plan(out, seed, p), (out,)

    key = (like.shape, like.dtype, like.device) if eager_real(like) else None
    return PLANS(key, build, (seed,), (p,), _launcher)[0]


@triton_op("nac_fast::nac_noise_triton", mutates_args=())
def nac_noise_triton(like: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    return noise(like, seed, p)


@nac_noise_triton.register_fake
def _(like, seed, p):
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)
