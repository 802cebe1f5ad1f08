"""Autograd and torch.compile glue for the fused backends of the NAC losses.

Every fused backend (cpu, cuda, triton) provides the two ops fwd and bwd of docs/math.md
[M:passes]: the forward returns the rows' losses, lse and ga [M:ga] (row i's own gradient, only
when a needs one); the backward assembles d/da, d/dr and d/dkeys [M:grad-a] from them.  lse is in
the units of the backend's own backward (base 2 for triton, [M:lse-online]): only that backend's
backward reads it.  Ops are registered with torch.library (fake implementations included), so
autograd and torch.compile both see them.

The Triton forward also returns the codes its prologue computed (Q, and K = tanh(a) for the
in-batch keys), saved for its backward so that the backward does not recompute them; its
backward returns the gradients in the inputs' dtype (the compiled ops: in the accumulation dtype,
cast here).  g reaches every backward as autograd gives it (an expanded scalar for
reduction="sum"): each op reads or copies it as it needs.

self_offset (every op's last argument): -1, every key in each row's logsumexp (the paper's); o >= 0,
row i's own key, key o + i, left out and log(N - 1) for log N (docs/math.md [M:self-key]); the
backward is handed the forward's.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .dispatch import eager_real as _eager_real
from .dispatch import extension
from .reference import acc_dtype, reduce_rows

_OPS: dict[str, tuple] = {}


def _fake_fwd(a, r, noise, keys, s, l2, grad_rows, self_offset=-1):
    n, d = a.shape
    acc = acc_dtype(a.dtype)
    return a.new_empty((n,), dtype=acc), a.new_empty((n,), dtype=acc), \
        a.new_empty((n, d) if grad_rows else (0,), dtype=acc)


def _fake_bwd(a, r, noise, keys, lse, ga, g, s, need_a, need_r, need_keys, self_offset=-1):
    acc = acc_dtype(a.dtype)
    kshape = a.shape if keys is None else keys.shape
    return (a.new_empty(a.shape if need_a else (0,), dtype=acc),
            a.new_empty(a.shape if need_r else (0,), dtype=acc),
            a.new_empty(kshape if need_keys and keys is not None else (0,), dtype=acc))


def _fake_fwd_triton(a, r, noise, keys, s, l2, grad_rows, self_offset=-1):
    from ..kernels.nac_triton import saved_parts
    n, d = a.shape
    parts, pdt = saved_parts(a, keys)
    if parts:  # fp32 in bf16x6 / fp16x3: the codes are (parts, rows, D) 16-bit parts
        nk = n if keys is None else keys.shape[0]
        return (*_fake_fwd(a, r, noise, keys, s, l2, grad_rows),
                a.new_empty((parts, n, d), dtype=pdt), a.new_empty((parts, nk, d), dtype=pdt))
    return (*_fake_fwd(a, r, noise, keys, s, l2, grad_rows), a.new_empty((n, d)),
            a.new_empty((n, d) if keys is None else (0,)))


def _fake_bwd_triton(a, r, noise, keys, lse, ga, g, q, k, s, need_a, need_r, need_keys,
                     self_offset=-1):
    kshape = a.shape if keys is None else keys.shape
    return (a.new_empty(a.shape if need_a else (0,)), a.new_empty(a.shape if need_r else (0,)),
            a.new_empty(kshape if need_keys and keys is not None else (0,)))


def _backward(bwd, ctx, g_rows, tensors=None, **kw):
    """(d/da, d/dr, None, d/dkeys, *more) of both autograd layers (the registered ops' and
    _FusedNAC's): one call of the backend's backward with the forward's saved tensors (`tensors`,
    else ctx.saved_tensors), each gradient in its input's dtype, None where no gradient is asked
    for; `kw` go to the backward, whose outputs past the third (_FusedNAC's d/drv) follow.  The
    forward's self_offset (ctx.self_offset) goes to the backward by name."""
    a, r, noise, keys, lse, ga, *saved = ctx.saved_tensors if tensors is None else tensors
    keys = None if ctx.self_keys else keys
    need_a, need_r, _, need_k = ctx.needs_input_grad[:4]
    need_k = bool(need_k and keys is not None)
    grad_a, grad_r, grad_k, *more = bwd(a, r, noise, keys, lse, ga, g_rows, *saved, ctx.s,
                                        bool(need_a), bool(need_r), need_k,
                                        self_offset=ctx.self_offset, **kw)
    cast = lambda t, dtype: t if t.dtype == dtype else t.to(dtype)  # noqa: E731
    return (cast(grad_a, ctx.dtypes[0]) if need_a else None,
            cast(grad_r, ctx.dtypes[1]) if need_r else None, None,
            cast(grad_k, ctx.dtypes[2]) if need_k else None, *more)


def _register(name: str, fwd, bwd, fake_fwd=_fake_fwd, fake_bwd=_fake_bwd) -> None:
    """Attach fake impls and the autograd formula to one backend's op pair (once).  The forward
    returns (loss rows, lse, ga, *saved): `saved` (the Triton op's codes) go to the backward
    after g."""
    # Explicit fakes for every backend, triton_op included: tracing a Triton launch with fake
    # tensors fails under TRITON_INTERPRET=1 (it reads data pointers), and the kernels are the
    # whole computation anyway, so the compiled graph treats them as opaque ops.
    torch.library.register_fake(fwd)(fake_fwd)
    torch.library.register_fake(bwd)(fake_bwd)

    def setup_context(ctx, inputs, output):
        # (self_offset: given, or the schema's default -1 where a caller left it out)
        a, r, noise, keys, s, l2, grad_rows, *self_offset = inputs
        _, lse, ga, *saved = output
        ctx.s = s
        ctx.self_offset = self_offset[0] if self_offset else -1
        ctx.n_inputs = len(inputs)
        ctx.self_keys = keys is None
        ctx.dtypes = (a.dtype, r.dtype, None if keys is None else keys.dtype)
        ctx.save_for_backward(a, r, noise, keys if keys is not None else a.new_empty(0), lse, ga,
                              *saved)
        # lse, ga and the saved codes take no gradient: without this, autograd would hand
        # backward an (n, D) zero tensor for ga (2 MiB at 4096 x 128 fp32, a fifth of the CPU
        # op's whole extra memory).
        ctx.set_materialize_grads(False)

    def backward(ctx, g_rows, *_g_others):
        if g_rows is None:  # only lse, ga or the codes were used downstream: no gradient flows
            return (None,) * ctx.n_inputs
        return (*_backward(bwd, ctx, g_rows), *(None,) * (ctx.n_inputs - 4))

    torch.library.register_autograd(fwd, backward, setup_context=setup_context)
    _OPS[name] = (fwd, bwd)


def _ops(backend: str):
    if backend not in _OPS and backend == "triton":
        from ..kernels import nac_triton
        _register("triton", nac_triton.nac_fwd_triton, nac_triton.nac_bwd_triton,
                  _fake_fwd_triton, _fake_bwd_triton)
    return _OPS[backend]


if extension() is not None:  # one op, two dispatch keys (CPU kernel here, CUDA kernel if built)
    _register("cpu", torch.ops.nac_fast.nac_fwd.default, torch.ops.nac_fast.nac_bwd.default)
    _OPS["cuda"] = _OPS["cpu"]
    if hasattr(torch.ops.nac_fast, "nac_noise"):
        @torch.library.register_fake("nac_fast::nac_noise")
        def _fake_noise(like, seed, p):
            return torch.empty(like.shape, dtype=like.dtype, device=like.device)


# ---- the eager path: an autograd.Function over the ops' bodies ------------------------------
# Outside torch.compile the registered ops cost their dispatch: torch.library's Python autograd
# kernel and backend_impl (its aliasing check) around every forward and backward, about a
# millisecond a call on an H100 (bench/results/NVIDIA-H100-80GB-HBM3_2026-11-27/README.md).  So
# eager calls go through _FusedNAC below: the Triton bodies directly (their plans cached,
# kernels/launch.py Plan), the compiled ops below the autograd key (C++ dispatch only).  The
# autograd formula is the same `_backward` the registered ops use, and the tests compare the two
# paths (tests/test_loss_host.py).  Traced calls (torch.compile, fake tensors, dispatch modes,
# tensor subclasses) keep the registered ops, which tracing understands.

def _below_autograd(op):
    def call(*args):
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)
    return call


_EAGER: dict[str, tuple] = {}


def _eager_ops(backend: str):
    """(fwd, bwd) of `backend`'s eager path.  fwd(a, r, noise, keys, s, l2, grad_rows, seed, p,
    self_offset=) -> (rows, lse, ga, *saved, noise): the Triton body draws the noise from `seed`
    when noise is None (the compiled ops are always handed it); bwd(..., g_scale, self_offset=)
    -> the gradients of sum_i g_i g_scale loss_i (the compiled ops: g_scale 1 only)."""
    ops = _EAGER.get(backend)
    if ops is None:
        if backend == "triton":
            from ..kernels import nac_triton
            ops = (nac_triton.fwd, nac_triton.bwd)
            _ops("triton")  # its torch.library ops registered now, outside any tracing
        else:
            fwd_op = _below_autograd(torch.ops.nac_fast.nac_fwd.default)
            bwd_op = _below_autograd(torch.ops.nac_fast.nac_bwd.default)

            def fwd(a, r, noise, keys, s, l2, grad_rows, seed=None, p=0.0, self_offset=-1):
                return (*fwd_op(a, r, noise, keys, s, l2, grad_rows, self_offset), noise)

            def bwd(*args, g_scale=1.0, self_offset=-1):
                if g_scale != 1.0:
                    raise ValueError(f"the {backend} backward takes g as it is (g_scale 1)")
                return bwd_op(*args, self_offset)
            ops = (fwd, bwd)
        _EAGER[backend] = ops
    return ops


def takes_seed(backend: str, a: torch.Tensor) -> bool:
    """Whether nac_fused draws the noise itself for `backend` from a seed (noise=None, seed=...):
    the Triton backend's eager calls, whose forward draws it in its prologue (one launch and one
    buffer fewer than drawing it first).  Every other call is handed the noise."""
    return backend == "triton" and _eager_real(a)


# reduction -> how the backward's g reaches the rows: "none" as is; "sum" expanded; "mean"
# expanded and scaled by fl32(1/n) inside the Triton backward (g_scale: no MeanBackward launch;
# what autograd's g / n computes on a GPU, a CPU's exact quotient within one ulp), or for the
# compiled ops and float64 divided before (g / n, autograd's MeanBackward bit for bit).
def _recip32(n: int) -> float:
    """fl32(1 / n): the fp32 quotient, rounded once (as torch's a * (1 / b) computes it)."""
    return float(np.float32(1.0) / np.float32(n))


def _reduced_by(backend: str, reduction: str) -> dict:
    """The eager forward's own reduction, as its keyword: the Triton finish reduces "mean" and
    "sum" itself (one program adds the others' partial sums in a fixed order: one launch fewer
    than torch's mean; the same value but for the order of the additions); {} where the rows
    are reduced here, by torch."""
    return {"reduction": reduction} if backend == "triton" and reduction != "none" else {}


class _FusedNAC(torch.autograd.Function):
    """The fused loss of `backend`, reduced; backward = the same formula as the registered ops'
    (`_register`'s backward): one fused backward call, the gradients cast to the inputs' dtypes.
    rv (Triton only): NAC-MQ's online inference logits, whose term [M:vi] each row then includes
    and whose gradient the same backward call gives.  self_offset: the ops' (-1: every key)."""

    @staticmethod
    def forward(ctx, a, r, noise, keys, backend, s, l2, grad_rows, reduction, seed, p, rv,
                self_offset):
        fwd, _ = _eager_ops(backend)
        extra = {} if rv is None else {"rv": rv}
        red = _reduced_by(backend, reduction)
        rows, lse, ga, *saved, noise = fwd(a, r, noise, keys, s, l2, grad_rows, seed, p, **extra,
                                           **red, self_offset=self_offset)
        ctx.backend = backend
        ctx.s = s
        ctx.self_offset = self_offset
        ctx.reduction = reduction
        ctx.n = a.shape[0]
        ctx.self_keys = keys is None
        ctx.dtypes = (a.dtype, r.dtype, None if keys is None else keys.dtype)
        ctx.rv_dtype = None if rv is None else rv.dtype
        # given keys that take no gradient (the momentum queue): no backward reads them (ga holds
        # their part of d/da), so they are held outside save_for_backward, and a later in-place
        # write to them (the queue's next enqueue: gradient accumulation over two steps' losses)
        # does not invalidate this graph
        ctx.const_keys = keys if keys is not None and not keys.requires_grad else None
        ctx.save_for_backward(a, r, noise, None if ctx.const_keys is not None else keys, lse, ga,
                              *saved, *extra.values())
        return rows if red else reduce_rows(rows, reduction)

    @staticmethod
    def backward(ctx, g):
        grads = _FusedNAC._grads(ctx, g)
        # create_graph=True (grad mode on in backward): the kernels have no derivative, so the
        # gradients carry a node that raises if anything differentiates through them (torch's
        # once_differentiable looks only at g, which is a constant for a loss's first gradient:
        # the second derivative would be silently zero).  The node also takes the forward's
        # inputs that require grad, so that every path from the gradients back to them (and to
        # what made them: the weights of a gradient penalty) runs through it; with the gradients
        # alone it is reached only from the gradients' own leaves, and autograd.grad of the
        # weights or of the inputs skips it (a silently wrong or missing second derivative).
        if torch.is_grad_enabled() and any(t is not None for t in grads):
            saved = ctx.saved_tensors
            ins = [t for t in (*saved[:4], saved[-1] if ctx.rv_dtype is not None else None)
                   if t is not None and t.requires_grad]
            err = torch._C._functions.DelayedError(
                f"nac_fast: the fused {ctx.backend!r} backend's backward is once differentiable "
                "(its kernels have no derivative); for a second derivative (a gradient penalty, "
                "create_graph=True) use backend='reference'".encode(), len(grads) + len(ins))
            alias = [None if t is None else t.detach().requires_grad_() for t in grads]
            grads = err(*alias, *ins)[:len(grads)]
        return grads

    @staticmethod
    def _grads(ctx, g):
        n = ctx.n
        bwd = _eager_ops(ctx.backend)[1]
        tensors, kw = ctx.saved_tensors, {}
        if ctx.const_keys is not None:
            tensors = (*tensors[:3], ctx.const_keys, *tensors[4:])
        need_rv = ctx.rv_dtype is not None and ctx.needs_input_grad[11]
        if ctx.rv_dtype is not None:
            tensors, kw = tensors[:-1], dict(rv=tensors[-1], need_rv=need_rv)
        if ctx.reduction == "none":
            grads = _backward(bwd, ctx, g, tensors, **kw)
        elif ctx.reduction == "mean" and ctx.backend == "triton" and \
                ctx.dtypes[0] != torch.float64:
            grads = _backward(functools.partial(bwd, g_scale=_recip32(n)), ctx, g.expand(n),
                              tensors, **kw)
        else:
            grads = _backward(bwd, ctx, (g / n if ctx.reduction == "mean" else g).expand(n),
                              tensors, **kw)
        grad_rv = None
        if need_rv:
            grad_rv = grads[4] if grads[4].dtype == ctx.rv_dtype else grads[4].to(ctx.rv_dtype)
        return (*grads[:4], None, None, None, None, None, None, None, grad_rv, None)


def nac_fused(backend, a, r, noise, keys, s, l2, reduction, seed=None, p=0.0, rv=None,
              self_offset=-1):
    """The fused loss rows of `backend`, reduced: eager calls through _FusedNAC, traced ones
    through the registered ops.  noise None: drawn from `seed` (a one-element int64 tensor, or an
    int drawn on the host: noise.host_seed) with flip probability p, where `takes_seed` says the
    backend does so.  rv: NAC-MQ's online inference logits, whose term [M:vi] the rows then
    include (where `takes_seed` holds).  self_offset: -1, every key in each row's logsumexp; o >=
    0, row i's own key (keys[o + i]; keys=None: o = 0) left out, [M:self-key] (the ops check it:
    o in [0, N - n], N >= 2)."""
    if (noise is None or rv is not None) and not takes_seed(backend, a):
        raise ValueError(f"backend {backend!r} here needs the noise itself, not a seed, and "
                         "computes no inference term")
    needs_grad = torch.is_grad_enabled() and (
        a.requires_grad or r.requires_grad or (keys is not None and keys.requires_grad)
        or (rv is not None and rv.requires_grad))
    grad_rows = needs_grad and a.requires_grad  # ga is only needed for d/da
    if _eager_real(a):
        if needs_grad:
            return _FusedNAC.apply(a, r, noise, keys, backend, float(s), float(l2),
                                   bool(grad_rows), reduction, seed, float(p), rv,
                                   int(self_offset))
        extra = {} if rv is None else {"rv": rv}
        red = _reduced_by(backend, reduction)
        rows = _eager_ops(backend)[0](a, r, noise, keys, float(s), float(l2), False, seed,
                                      float(p), **extra, **red, self_offset=int(self_offset))[0]
        return rows if red else reduce_rows(rows, reduction)
    fwd, _ = _ops(backend)
    rows = fwd(a, r, noise, keys, float(s), float(l2), bool(grad_rows), int(self_offset))[0]
    return reduce_rows(rows, reduction)
