"""Autograd and torch.compile glue for the fused backends.

Every fused backend provides two ops with one contract (csrc/nac_cpu.cpp documents the math):

    fwd(a, r, noise, keys?, s, l2, grad_rows) -> (loss_rows, lse, dloss_i/da_i, dloss_i/dr_i)
    bwd_keys(a, noise, keys?, lse, g, s)      -> d/dkeys sum_i g_i loss_i   (d/da via tanh if keys=None)

The forward already returns the row-local gradients (they need only the softmax-weighted mean key,
which the forward accumulates anyway, flash-attention style), so their backward is a scaling by the
upstream gradient g; only the keys' gradient needs a second pass over the tiles, from the saved lse.
Ops are registered with torch.library (fake implementations included), so autograd and
torch.compile both see them.
"""
from __future__ import annotations

import torch

from ._backends import extension

_OPS: dict[str, tuple] = {}


def _fake_fwd(a, r, noise, keys, s, l2, grad_rows):
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    n, d = a.shape
    rows = a.new_empty((n,), dtype=acc)
    grad_shape = (n, d) if grad_rows else (0,)
    return rows, a.new_empty((n,), dtype=acc), a.new_empty(grad_shape, dtype=acc), \
        a.new_empty(grad_shape, dtype=acc)


def _fake_bwd_keys(a, noise, keys, lse, g, s):
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    return a.new_empty((a.shape if keys is None else keys.shape), dtype=acc)


def _register(name: str, fwd, bwd_keys) -> None:
    """Attach fake impls and the autograd formula to one backend's op pair (once)."""
    # Explicit fakes for every backend, triton_op included: tracing a Triton launch with fake
    # tensors fails under TRITON_INTERPRET=1 (it reads data pointers), and the kernels are the
    # whole computation anyway, so the compiled graph treats them as opaque ops.
    torch.library.register_fake(fwd)(_fake_fwd)
    torch.library.register_fake(bwd_keys)(_fake_bwd_keys)

    def setup_context(ctx, inputs, output):
        a, r, noise, keys, s, l2, grad_rows = inputs
        _, lse, ga, gr = output
        ctx.s = s
        ctx.self_keys = keys is None
        ctx.dtypes = (a.dtype, r.dtype, None if keys is None else keys.dtype)
        ctx.save_for_backward(a, noise, keys if keys is not None else a.new_empty(0), lse, ga, gr)

    def backward(ctx, g_rows, _g_lse, _g_ga, _g_gr):
        a, noise, keys, lse, ga, gr = ctx.saved_tensors
        keys = None if ctx.self_keys else keys
        need_a, need_r, _, need_k = ctx.needs_input_grad[:4]
        g = g_rows.contiguous()
        grad_a = grad_r = grad_k = None
        if need_a:
            grad_a = ga * g[:, None]
        if need_r:
            grad_r = (gr * g[:, None]).to(ctx.dtypes[1])
        if (need_a and keys is None) or need_k:
            dk = bwd_keys(a, noise, keys, lse, g, ctx.s)
            if keys is None:
                grad_a = grad_a + dk
            else:
                grad_k = dk.to(ctx.dtypes[2])
        if grad_a is not None:
            grad_a = grad_a.to(ctx.dtypes[0])
        return grad_a, grad_r, None, grad_k, None, None, None

    torch.library.register_autograd(fwd, backward, setup_context=setup_context)
    _OPS[name] = (fwd, bwd_keys)


def _ops(backend: str):
    if backend not in _OPS and backend == "triton":
        from .kernels import nac_triton
        _register("triton", nac_triton.nac_fwd_triton, nac_triton.nac_bwd_keys_triton)
    return _OPS[backend]


if extension() is not None:  # one op, two dispatch keys (CPU kernel here, CUDA kernel if built)
    _register("cpu", torch.ops.nac_fast.nac_fwd.default, torch.ops.nac_fast.nac_bwd_keys.default)
    _OPS["cuda"] = _OPS["cpu"]


def nac_fused(backend, a, r, noise, keys, s, l2, reduction):
    fwd, _ = _ops(backend)
    grad_rows = torch.is_grad_enabled() and (a.requires_grad or r.requires_grad)
    rows, _, _, _ = fwd(a, r, noise, keys, float(s), float(l2), bool(grad_rows))
    if reduction == "mean":
        return rows.mean()
    if reduction == "sum":
        return rows.sum()
    return rows
