"""Triton kernel of the momentum queue's enqueue (nac_fast/ops/queue.py CodeQueue.enqueue_tanh):
the keys of NAC-MQ, z = tanh(a) of the momentum network's pre-activations (docs/math.md [M:mq]),
written into the ring buffer at its write pointer in one launch.

The reference (the plain-PyTorch path, CodeQueue.enqueue_tanh(backend="reference")):

    keys = torch.tanh(torch.cat(parts).to(acc))       # acc: float32 (float64 stays float64)
    idx = (ptr + arange(n)) % M
    codes.index_copy_(0, idx, keys.to(codes.dtype)); ptr.add_(n).remainder_(M)

that is 10 ATen launches a step (the cat, two casts, tanh, arange, add, remainder, index_copy_,
add_, remainder_), each with its host dispatch; here one.

_enqueue_kernel: program i writes rows [i BLOCK_R, (i + 1) BLOCK_R) of the concatenated parts
(row j of part 1 is row n0 + j) at codes[(ptr + row) % M], tanh in the accumulation dtype
(nac_triton._tanh: the formula of csrc/nac_math.h, which the interpreter runs too; within 2 ulp of
float32 of torch.tanh before the rounding to the queue's dtype).  The pointer stays on the device:
every program reads it, then counts itself in with an acq_rel atomic; the last to arrive (every
read of the old pointer is then done) writes ptr = (ptr + n) % M and zeroes the counter for the
next call (kernels/nac_triton.py last_to_arrive, the finish's reduction's too).  n <= M, so no
two rows land on one slot.  Safe under CUDA-graph capture: nothing is read on the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, PlanCache, cdiv, eager_real, run
from .nac_triton import MAX_D, _rne_bf16, _rows_block, _tanh, _tl_acc, block_d, last_to_arrive


@triton.jit(do_not_specialize=["n0", "n1", "M"])
def _enqueue_kernel(X0, X1, CODES, PTR, COUNT, n0, n1, M, D, stride0, stride1,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
                    TANH: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    dmask = (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    in0 = rows < n0
    in1 = (rows >= n0) & (rows < n0 + n1)
    x0 = tl.load(X0 + rows64[:, None] * stride0 + cols[None, :], mask=in0[:, None] & dmask,
                 other=0.0).to(ACC)
    x1 = tl.load(X1 + (rows64 - n0)[:, None] * stride1 + cols[None, :],
                 mask=in1[:, None] & dmask, other=0.0).to(ACC)
    x = tl.where(in0[:, None], x0, x1)
    if TANH:
        x = _tanh(x)
    ptr = tl.load(PTR)
    dst = (ptr + rows64) % M
    if CODES.dtype.element_ty == tl.bfloat16:
        x = _rne_bf16(x.to(tl.float32))
    tl.store(CODES + dst[:, None] * D + cols[None, :], x.to(CODES.dtype.element_ty),
             mask=(in0 | in1)[:, None] & dmask)
    # every thread read PTR above: the last program's write of the new pointer follows them all
    if last_to_arrive(COUNT):
        tl.store(PTR, (ptr + n0 + n1) % M)
        tl.atomic_xchg(COUNT, 0, sem="relaxed")


def enqueue_plan(codes: torch.Tensor, ptr: torch.Tensor, count: torch.Tensor,
                 x0: torch.Tensor, x1: torch.Tensor, tanh: bool = True) -> list:
    """The launch that writes tanh of the rows [x0; x1] (or the rows themselves, tanh False) into
    `codes` (M, D), contiguous, at the ring pointer `ptr` (a 0-dim int64 tensor) and advances it.
    x0, x1: (n0, D), (n1, D), one floating dtype (tanh in float32, float64 for float64), unit
    column stride (x1 may have 0 rows); n0 + n1 <= M.  count: a one-element int32 tensor, zero
    (left zero)."""
    M, D = codes.shape
    if D > MAX_D:
        raise ValueError(f"the Triton enqueue handles codes of D <= {MAX_D}, got D={D}")
    n0, n1 = x0.shape[0], x1.shape[0]
    from .nac_triton import MAX_ROWS  # (here: an import above the kernel moves its lines)
    if n0 + n1 > MAX_ROWS:  # the kernel's rows, and n0 + n1, are int32
        raise ValueError(f"the Triton enqueue writes at most {MAX_ROWS:,} keys a call, got "
                         f"{n0 + n1:,}")
    rows = _rows_block(D, x0.dtype)  # (rows x BLOCK_D) tiles of 4096 elements (fp64: 1024)
    return [Launch(_enqueue_kernel, (cdiv(n0 + n1, rows),),
                   (x0, x1, codes, ptr, count, n0, n1, M, D, x0.stride(0), x1.stride(0)),
                   dict(BLOCK_R=rows, BLOCK_D=block_d(D), ACC=_tl_acc(x0.dtype),
                        TANH=bool(tanh)),
                   4, 1, "enqueue")]


PLANS = PlanCache("queue_enqueue_triton")  # kernels/launch.py Plan: one per shapes and dtypes


def _launcher(launches):
    run(launches)


def enqueue(codes: torch.Tensor, ptr: torch.Tensor, count: torch.Tensor, x0: torch.Tensor,
            x1: torch.Tensor, tanh: bool = True) -> None:
    """Run `enqueue_plan` (its plan cached per shapes, strides, dtypes and device)."""
    def build():
        return enqueue_plan(codes, ptr, count, x0, x1, tanh), ()

    key = ((codes.shape, codes.dtype, codes.device, x0.shape, x0.stride(0), x0.dtype, x1.shape,
            x1.stride(0), x1.dtype, bool(tanh)) if eager_real(codes) else None)
    PLANS(key, build, (codes, ptr, count, x0, x1), (), _launcher)
