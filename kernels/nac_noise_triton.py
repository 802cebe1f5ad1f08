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
    return philox_sign_of(offs, tl.load(seed_ptr), p)


@triton.jit
def philox_sign_of(offs, seed, p):
    # philox_sign for the seed's value (an int64 scalar: a seed drawn on the host,
    # nac_fast/ops/noise.py host_seed)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = (offs & 0xFFFFFFFF).to(tl.uint32)
    c1 = ((offs >> 32) & 0xFFFFFFFF).to(tl.uint32)
    w = _philox_first_word(c0, c1, k0, k1).to(tl.int32, bitcast=True)
    u = tl.where(w < 0, ~w, w).to(tl.float32) * 4.6566127342e-10
    return tl.where(u < p, -1.0, 1.0)


# Where a kernel finds its seed (constexpr SEEDED): none (the noise is given: the NAC kernels), in
# a one-element int64 tensor (drawn on the device: graph-safe), or as an int64 argument drawn on
# the host (nac_fast/ops/noise.py host_seed: no launch, no allocation).
NOISE_GIVEN, SEED_FROM_TENSOR, SEED_FROM_HOST = 0, 1, 2
# seed_val when the seed is not the host's: an int64 value (Python ints of 2^31 and more are
# passed as int64, which a host seed always is), never read
NO_HOST_SEED = 1 << 62


def seed_args(seed):
    """(SEEDED, the seed tensor or None, seed_val) for a seed that is None (the noise is given), a
    one-element int64 tensor (as `seed_operand` makes it), or an int drawn on the host."""
    if seed is None:
        return NOISE_GIVEN, None, NO_HOST_SEED
    if isinstance(seed, int):
        return SEED_FROM_HOST, None, host_seed_value(seed)  # checked (below the kernels)
    return SEED_FROM_TENSOR, seed, NO_HOST_SEED


@triton.jit
def seed_sign(offs, SEED, seed_val, p, SEEDED: tl.constexpr):
    # philox_sign of the seed at SEED (SEEDED == SEED_FROM_TENSOR) or of seed_val (SEED_FROM_HOST)
    if SEEDED == 2:
        m = philox_sign_of(offs, seed_val, p)
    else:
        m = philox_sign(offs, SEED, p)
    return m


@triton.jit(do_not_specialize=["numel", "seed_val"])
def _noise_kernel(out_ptr, seed_ptr, seed_val, p, numel, BLOCK: tl.constexpr,
                  SEEDED: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    tl.store(out_ptr + offs,
             seed_sign(offs, seed_ptr, seed_val, p, SEEDED).to(out_ptr.dtype.element_ty),
             mask=mask)


# (Host-side, below the kernels: lines added above them would change their Triton cache keys.)
# A host seed reaches the kernels as an int64 argument only outside [-2^31, 2^32): Triton types an
# int of the int32 range as int32 (philox_sign_of's 64-bit split of it does not compile), and the
# interpreter (CPU tensors, CI) passes one in [2^31, 2^32) as uint32 data under an int64 type,
# whose arithmetic shift it reads as negative: k1 = 0xFFFFFFFF, the noise of another seed, where
# the GPU's int64 gives k1 = 0.  host_seed draws in [2^62, 2^63).
HOST_SEED_GAP = (-(1 << 31), 1 << 32)


def host_seed_value(seed) -> int:
    """seed, an int drawn on the host, checked to be an int64 outside HOST_SEED_GAP (ValueError
    else): what the kernels take as seed_val."""
    if (isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 63
            or HOST_SEED_GAP[0] <= seed < HOST_SEED_GAP[1]):
        raise ValueError(f"a host seed must be an int64 outside [-2^31, 2^32) (the kernels take "
                         f"it as an int64 argument; nac_fast/ops/noise.py host_seed draws in "
                         f"[2^62, 2^63)), got {seed!r}; pass a smaller seed as a one-element int64 "
                         f"tensor")
    return seed


BLOCK = 1024


def _p(p, seed=0):
    return float(p)


def _seed_val(p, seed=0):  # a cached plan's later calls: their seeds checked too
    return host_seed_value(seed)


def noise_plan(out: torch.Tensor, seed, p: float):
    """The launch that fills the floating tensor `out` (any shape, contiguous, any floating dtype:
    +-1 is exact in each) with the noise of `seed` (a one-element int64 tensor on out's device, or
    an int drawn on the host)."""
    n = out.numel()
    seeded, seed_t, seed_val = seed_args(seed)
    return [Launch(_noise_kernel, (cdiv(n, BLOCK),),
                   (out, out if seed_t is None else seed_t, seed_val, float(p), n),
                   dict(BLOCK=BLOCK, SEEDED=seeded), 4, 1, "noise",
                   (("p", _p),) + ((("seed_val", _seed_val),) if seed_t is None else ()))]


PLANS = PlanCache("nac_noise_triton")  # kernels/launch.py Plan: one per (shape, dtype, device)


def _launcher(launches):
    run(launches)


def seed_operand(seed: torch.Tensor) -> torch.Tensor:
    """A seed as the kernels read it (`philox_sign`): one int64 element, shape (1,)."""
    seed = seed.reshape(1)
    return seed if seed.dtype == torch.int64 else seed.to(torch.int64)


def noise(like: torch.Tensor, seed, p: float) -> torch.Tensor:
    """The op's body: the noise of like's shape, dtype and device (launched on like's device),
    written in like's dtype by the kernel (no float32 copy).  seed: a one-element int64 tensor, or
    (eager calls) an int drawn on the host."""
    host = isinstance(seed, int)
    if not host:
        seed = seed_operand(seed)

    def build():
        out = buffer(like.shape, like.dtype, like)
        return noise_plan(out, seed, p), (out,)

    key = (like.shape, like.dtype, like.device, host) if eager_real(like) else None
    return PLANS(key, build, (None if host else seed,), (p, seed if host else 0), _launcher)[0]


@triton_op("nac_fast::nac_noise_triton", mutates_args=())
def nac_noise_triton(like: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    return noise(like, seed, p)


@nac_noise_triton.register_fake
def _(like, seed, p):
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)
