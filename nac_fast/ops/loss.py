"""Public NAC loss API: argument checking, noise, backend choice.

    nac_loss(a, r, p, *, keys=None, noise=None, reduction="mean", backend="auto",
             likelihood="dot", self_key="include", self_offset=0, noise_draws=1)
    nac_mq_loss(a, r_hat, queue, p, *, l2=0.1, noise=None, reduction="mean", backend="auto",
                likelihood="dot")
    nac_vi_loss(a, r, p, *, noise=None, reduction="mean")
    NACLoss(p, ...)(out0, out1)                          # nn.Module criteria of the two
    NACMQLoss(p, l2=...)(out0, out1, mom0, mom1, queue)  # views' outputs, out_v = (a_v, r_v)

Every backend computes the same function, docs/math.md [M:rows]; `nac_fast.ops.reference` is the
oracle.  likelihood="multilinear" (the channel's own relaxed likelihood, [M:multilinear]; a change
of the method, not the paper's) has no fused kernel: it runs on the reference, and a fused
backend asked for by name is refused.  self_key="exclude" (each row's own code left out of its
keys, [M:self-key]; also not the paper's) runs on every backend: the fused kernels take it as
their ops' self_offset.

Host syncs: p, s and l2 stay Python numbers (pass p as a float: a tensor p is read with .item()),
the noise seed is drawn on the inputs' device, and the data-reading value checks follow the policy
CHECK_VALUES below (default "auto": CPU tensors only).  With it, a loss call on GPU tensors never
waits for the device; tests/test_sync_free.py proves it for the training steps.
"""
from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.nn as nn

from .. import _checks
from . import dispatch as _dispatch
from . import nac as _nac
from . import reference
from .collectives import all_gather_nograd, all_gather_with_grad, is_dist, rank as _rank
from .dispatch import BACKENDS, resolve_backend
from .noise import _draw, _scale, _seed, draw_noise, host_seed
from .queue import CodeQueue

_REDUCTIONS = ("mean", "sum", "none")

# ---- value checks ---------------------------------------------------------------------------
# The value-check policy (CHECK_VALUES, NAC_FAST_CHECK_INPUTS, value_checks_on, value_checks) lives
# with the dispatcher (nac_fast/ops/dispatch.py), where collectives.py reads it too; its names stay
# importable from here, and nac_fast.ops.loss.CHECK_VALUES reads and sets the dispatcher's policy.
_CHECK_ENV = _dispatch._CHECK_ENV
_parse_check_values = _dispatch._parse_check_values
value_checks_on = _dispatch.value_checks_on
value_checks = _dispatch.value_checks


class _LossModule(types.ModuleType):
    """This module's type: `CHECK_VALUES` is nac_fast.ops.dispatch.CHECK_VALUES (read and set), so
    the documented switch `nac_fast.ops.loss.CHECK_VALUES = False` keeps working."""

    @property
    def CHECK_VALUES(self):
        return _dispatch.CHECK_VALUES

    @CHECK_VALUES.setter
    def CHECK_VALUES(self, mode):
        _dispatch.CHECK_VALUES = mode


sys.modules[__name__].__class__ = _LossModule


def _check_matrix(name: str, t, *, d: int | None = None, rows: int | None = None,
                  rows_of: str = "a", cols_of: str = "a") -> None:
    _checks.tensor(name, t)
    if not t.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, D), got shape {tuple(t.shape)}")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name} must be non-empty, got shape {tuple(t.shape)}")
    if d is not None and t.shape[1] != d:
        raise ValueError(f"{name} must have D={d} columns like {cols_of}, got shape "
                         f"{tuple(t.shape)}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows like {rows_of}, got shape {tuple(t.shape)}")


def _check_finite(name: str, t: torch.Tensor) -> None:
    # aminmax propagates NaN and exposes +-inf in one pass with no temporaries; torch.isfinite
    # allocated 5 bytes per element (a 65536 x 128 queue: 40 MiB, 14x the fused kernel's peak).
    if value_checks_on(t.device):
        lo, hi = torch.aminmax(t.detach())
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
            raise ValueError(f"{name} contains NaN or inf")


def check_noise(noise, shape, of: str = "a's") -> None:
    """An explicit channel sample: a real tensor of `shape` that does not require grad
    (TypeError/ValueError naming noise); its values (+-1) are checked by the loss under the
    value-check policy."""
    _checks.tensor("noise", noise, "a torch.Tensor of +-1")
    if tuple(noise.shape) != tuple(shape):
        raise ValueError(f"noise must have {of} shape {tuple(shape)}, got {tuple(noise.shape)}")
    if not _checks.signed_real(noise.dtype):
        # unsigned: -1 cannot be held (and uint8's 255 == -1 is True in torch)
        raise TypeError(f"noise must hold +-1 as a signed real number dtype, got {noise.dtype}")
    if noise.requires_grad:  # the reference would differentiate through it, the fused kernels
        # not: a sample of the channel, a constant of the loss (as the queue is)
        raise ValueError("noise must not require grad (it is a sample of the channel, a constant "
                         "of the loss); pass noise.detach()")


def _check_noise_values(noise) -> None:
    """An explicit channel sample holds only -1 and +1 (ValueError), checked where the value-check
    policy reads data on noise's device."""
    if value_checks_on(noise.device) and not bool(((noise == 1) | (noise == -1)).all()):
        raise ValueError("noise must contain only -1 and +1")


def _prepare(a, r, p, keys, noise, reduction, *, r_name="r", keys_name="keys", draw=True,
             draws=1):
    """Validate the common arguments; returns (p, s, noise in a's dtype: None when not given and
    not `draw`n, for `_channel` to decide).  draws > 1: an explicit noise is (draws, n, D)."""
    p = _checks.flip_prob("p", p)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    _check_matrix("a", a)
    n, d = a.shape
    _check_matrix(r_name, r, d=d, rows=n)
    if r.dtype != a.dtype:
        raise TypeError(f"{r_name} must have a's dtype {a.dtype}, got {r.dtype}")
    tensors = [("a", a), (r_name, r)]
    if keys is not None:
        _check_matrix(keys_name, keys, d=d)
        if keys.dtype != a.dtype:
            raise TypeError(f"{keys_name} must have a's dtype {a.dtype}, got {keys.dtype}")
        tensors.append((keys_name, keys))
    if noise is not None:
        if draws == 1:
            check_noise(noise, (n, d))
        else:
            check_noise(noise, (draws, n, d), "the (noise_draws, n, D)")
        tensors.append(("noise", noise))
    for name, t in tensors[1:]:
        if t.device != a.device:
            raise ValueError(f"{name} is on {t.device} but a is on {a.device}; "
                             "all inputs must be on one device")
    for name, t in tensors:
        if name != "noise":
            _check_finite(name, t)
    if noise is None:
        if draw:
            noise = _draw((n, d), p, device=a.device, dtype=a.dtype)
    else:
        _check_noise_values(noise)
        noise = noise.to(a.dtype)
    return p, _scale(p), noise


def _choice(name, value, choices) -> str:
    """`value` of the option `name` if it is one of the names `choices` (ValueError naming it)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _reference_only(name, value, choices, unfused, backend, refusal) -> str:
    """`value` of the option `name` if it is one of `choices` that `backend` computes: no fused
    kernel computes the choice `unfused`, so with it a fused backend named is refused
    (ValueError "backend '<backend>' <refusal>"); reference.REFERENCE_BACKENDS run it."""
    _choice(name, value, choices)
    if value == unfused and _check_backend_name(backend) not in reference.REFERENCE_BACKENDS:
        raise ValueError(f"backend {backend!r} {refusal}")
    return value


def _check_likelihood(likelihood, backend) -> str:
    """A likelihood name that `backend` computes: the fused kernels compute the dot form only,
    so the multilinear one is refused with a fused backend named (ValueError)."""
    return _reference_only("likelihood", likelihood, reference.LIKELIHOODS, "multilinear",
                           backend, "has no multilinear likelihood (the fused kernels compute "
                           "the dot form, docs/math.md [M:multilinear]); use "
                           "backend='reference' or 'auto'")


def _channel(impl, a, p, noise):
    """(noise, seed) for the implementation `impl`: the noise as given; else, where the fused
    forward draws it itself (nac.takes_seed: Triton's eager path), a seed from torch's RNG: drawn
    on the host from a's CUDA generator where it can be (noise.host_seed: an int, no launch), else
    on a's device (a one-element tensor); the same bits as drawing the noise of that seed first
    (docs/math.md [M:philox]); else the noise, drawn now."""
    if noise is not None:
        return noise, None
    if _nac.takes_seed(impl, a):
        seed = host_seed(a.device)
        return None, (_seed(a.device) if seed is None else seed)
    return _draw(tuple(a.shape), p, device=a.device, dtype=a.dtype), None


def _backend_for(backend, a, keys, likelihood) -> str:
    """The implementation that runs (likelihood checked against backend by _check_likelihood):
    resolve_backend's, the reference for the multilinear likelihood.  self_key does not enter:
    every backend computes both key sets ([M:self-key])."""
    if likelihood == "multilinear":
        return "reference"
    return resolve_backend(backend, a, keys=keys)  # auto: the faster path per dtype


def _check_self_key(self_key) -> str:
    """A self_key name (ValueError naming self_key otherwise): "include" or "exclude", both
    computed by every backend ([M:self-key])."""
    return _choice("self_key", self_key, reference.SELF_KEYS)


def _self_offset(self_key, self_offset, n, keys) -> int | None:
    """The index in the keys of row 0's own code when self_key is "exclude" (None: every key
    counts).  keys=None: the rows' own codes are the keys, the offset is 0.  ValueError naming
    self_offset unless the n own codes lie inside the N keys and one other key is left."""
    if isinstance(self_offset, bool) or not isinstance(self_offset, int):
        raise TypeError(f"self_offset must be an int, got {type(self_offset).__name__}")
    if self_key == "include":
        if self_offset != 0:
            raise ValueError(f"self_offset={self_offset} is used with self_key='exclude' only")
        return None
    count = n if keys is None else keys.shape[0]
    if keys is None and self_offset != 0:
        raise ValueError(f"self_offset must be 0 without keys (the rows' own codes are the "
                         f"keys), got {self_offset}")
    if not 0 <= self_offset <= count - n:
        raise ValueError(f"self_offset must lie in [0, N - n] = [0, {count - n}] (row i's own "
                         f"code is keys[self_offset + i]; n = {n}, N = {count}), got "
                         f"{self_offset}")
    if count < 2:
        raise ValueError("self_key='exclude' needs at least 2 keys (the row's own and one "
                         f"other), got N = {count}")
    return self_offset


def _check_draws(noise_draws) -> int:
    """noise_draws, an int >= 1 (ValueError naming noise_draws)."""
    return _checks.positive_int("noise_draws", noise_draws)


def nac_loss(a, r, p, *, keys=None, noise=None, reduction="mean", backend="auto",
             likelihood="dot", self_key="include", self_offset=0, noise_draws=1):
    """In-batch NAC loss to minimise (docs/math.md [M:inbatch]).

    a: (n, D) projection-head pre-activations (tanh is applied inside).
    r: (n, D) inference-network logits for the same rows.
    p: bit-flip probability of the channel, 0 < p < 0.5.
    keys: None = the batch's own clean codes tanh(a), self included; or (N, D) codes (e.g.
        all-gathered from every rank) that receive gradient.
    noise: None = drawn inside from torch's RNG; or an explicit (n, D) tensor of +-1.
    reduction: "mean" (fp32 scalar), "sum", or "none" ((n,) per-row losses).
    backend: "reference" | "cpu" | "triton" | "cuda" | "auto".
    likelihood: "dot" (the paper's: logits s z~ . k) | "multilinear" (sum_d log(1 + (1-2p) z~_d
        k_d), docs/math.md [M:multilinear]: reference backend only; "auto" picks it).
    self_key: "include" (the paper's: row i's own clean code is one of its keys) | "exclude"
        (left out, and log(N - 1) for log N: docs/math.md [M:self-key]; every backend).
    self_offset: with "exclude", row i's own code is keys[self_offset + i] (0 without keys; with
        keys all-gathered from every rank, this rank's index times n).
    noise_draws: the loss averaged over this many independent channel samples of the same rows
        (docs/math.md [M:draws]; 1, the paper's, one sample).  The same expected loss and
        gradient, with less variance; each draw costs one loss call (forward and backward).
        An explicit noise is then (noise_draws, n, D), draw j's sample at noise[j].
    """
    _check_likelihood(likelihood, backend)
    _check_self_key(self_key)
    draws = _check_draws(noise_draws)
    p, s, noise = _prepare(a, r, p, keys, noise, reduction, draw=False, draws=draws)
    offset = _self_offset(self_key, self_offset, a.shape[0], keys)
    impl = _backend_for(backend, a, keys, likelihood)
    total = None
    for j in range(draws):
        nz, seed = _channel(impl, a, p, noise if noise is None or draws == 1 else noise[j])
        if impl == "reference":
            loss = reference.nac_loss_reference(a, r, nz, s, keys=keys, reduction=reduction,
                                                likelihood=likelihood, self_offset=offset)
        else:
            loss = _nac.nac_fused(impl, a, r, nz, keys, s, 0.0, reduction, seed, p,
                                  self_offset=-1 if offset is None else offset)
        total = loss if total is None else total + loss
    return total if draws == 1 else total / draws


def nac_mq_loss(a, r_hat, queue, p, *, l2=0.1, noise=None, reduction="mean", backend="auto",
                likelihood="dot"):
    """NAC-MQ loss to minimise (docs/math.md [M:mq]; s multiplies the similarity, [M:mq-scale]).

    queue: (M, D) momentum codes; a constant of the loss (pass it detached: no gradient reaches it).
    r_hat: (n, D) logits of the momentum inference network (normally detached too).
    l2: lambda of the ||z||^2 regulariser (0.1 in the paper), or "auto": `mq_l2(p)`, the paper's
        0.1 at p = 0.1 scaled by ((1 - 2p) / 0.8)^2 (docs/math.md [M:mq-l2]).
    likelihood: as nac_loss's.
    """
    if isinstance(queue, torch.Tensor) and queue.requires_grad:
        raise ValueError("queue must not require grad (it is a buffer of momentum codes); "
                         "pass queue.detach()")
    _check_l2(l2)
    _check_likelihood(likelihood, backend)
    if queue is None:
        raise TypeError("queue must be a torch.Tensor of shape (M, D), got None")
    p, s, noise = _prepare(a, r_hat, p, queue, noise, reduction, r_name="r_hat",
                           keys_name="queue", draw=False)
    l2 = _l2_value(l2, p)
    impl = _backend_for(backend, a, queue, likelihood)
    noise, seed = _channel(impl, a, p, noise)
    if impl == "reference":
        return reference.nac_mq_loss_reference(a, r_hat, queue, noise, s, l2=l2,
                                               reduction=reduction, likelihood=likelihood)
    return _nac.nac_fused(impl, a, r_hat, noise, queue, s, l2, reduction, seed, p)


def _mq_and_vi_fused(a, r_hat, r, codes, p, l2, noise, reduction, backend, likelihood):
    """NACMQLoss's two terms, nac_mq_loss + nac_vi_loss with one channel sample, in one fused
    call where the backend computes them together (the Triton backend's eager path: the finish
    adds each row's inference term, the rows' backward gives d/dr; the noise, when not given, is
    drawn by the forward from the seed drawn here, the same bits as draw_noise's).  None where it
    does not (the criterion then makes the two calls).  The criterion has checked the inputs'
    shapes, dtypes, devices and values; the loss checks its own again as nac_mq_loss does."""
    if likelihood != "dot" or r.dtype != a.dtype:
        return None
    impl = _backend_for(backend, a, codes, likelihood)
    if not _nac.takes_seed(impl, a):
        return None
    p, s, noise = _prepare(a, r_hat, p, codes, noise, reduction, r_name="r_hat",
                           keys_name="queue", draw=False)
    noise, seed = _channel(impl, a, p, noise)
    return _nac.nac_fused(impl, a, r_hat, noise, codes, s, _l2_value(l2, p), reduction, seed, p,
                          rv=r)


def nac_vi_loss(a, r, p, *, noise=None, reduction="mean"):
    """The online inference network's own term of NAC-MQ (docs/math.md [M:vi]).

    z~ = m * tanh(a) is detached: only r (the online inference net) is trained by it.  Pass the
    same `noise` as to `nac_mq_loss` to use one channel sample per step.  It is O(nD) elementwise
    work, so plain PyTorch on every device, computed in float32 (float64 for float64 inputs)
    whatever the input dtype and autocast state, like the fused losses: bf16/fp16 a and r are
    widened first and r's gradient is cast back to r's dtype.
    """
    p, _, noise = _prepare(a, r, p, None, noise, reduction)
    acc = reference.acc_dtype(a.dtype)
    with _autocast_off(a.device.type):
        zt = noise.to(acc) * torch.tanh(a.detach().to(acc))
        rows = -reference.bernoulli_term(zt, r.to(acc))
    return reference.reduce_rows(rows, reduction)


def _autocast_off(device_type: str):
    """A context that disables autocast on `device_type` if it is on there (else a no-op)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


# ---- criteria (nn.Module API, lightly/MoCo style) -------------------------------------------
# The criteria take the two views' outputs, lightly's criterion(out0, out1): out_v = (a_v, r_v),
# view v's head pre-activations and its OWN inference logits r_v = phi(h_v).  They pair them
# across the views themselves, rows [view 0; view 1] with a = [a0; a1] and r = [r1; r0] (the
# cross pathway of docs/math.md [M:inbatch]: a row's logits come from its partner view).

def loss_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the criteria hand the losses their inputs in, for model output `t`: the autocast
    dtype of t's device when autocast is on there (bf16 by default on GPU), else t's own dtype
    (float64 stays float64: autocast never narrows it).  The fused losses widen each tile and
    compute in float32 whatever this dtype is, and return a float32 loss."""
    if t.dtype != torch.float64 and _autocast_on(t):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


def _autocast_on(t: torch.Tensor) -> bool:
    """Whether autocast is on for t's device."""
    dev = t.device.type
    return torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)


def _check_reduction(reduction) -> str:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    return reduction


def _check_backend_name(backend) -> str:
    names = BACKENDS + ("auto",)
    if not isinstance(backend, str) or backend not in names:
        raise ValueError(f"backend must be one of {names}, got {backend!r}")
    return backend


# NAC-MQ's l2 = "auto" (docs/math.md [M:mq-l2]): the paper's lambda at the paper's p, scaled with
# what a bit of code magnitude t can gain through the channel at small t, ((1 - 2p) t)^2 / 2.
PAPER_L2, PAPER_L2_P = 0.1, 0.1


def mq_l2(p: float) -> float:
    """NAC-MQ's lambda for l2="auto" at flip probability p: 0.1 ((1 - 2p) / 0.8)^2, the paper's
    0.1 at its p = 0.1 (0.039 at p = 0.25, 0.00625 at p = 0.4), so that lambda ||z||^2 keeps the
    paper's ratio to the Bernoulli term's gain at small codes (docs/math.md [M:mq-l2])."""
    p = _checks.flip_prob("p", p)
    return PAPER_L2 * ((1.0 - 2.0 * p) / (1.0 - 2.0 * PAPER_L2_P)) ** 2


def _check_l2(l2):
    """l2 as given: "auto", or a finite float >= 0 (ValueError naming l2)."""
    if isinstance(l2, str):
        if l2 != "auto":
            raise ValueError(f"l2 must be a finite float >= 0 or 'auto', got {l2!r}")
        return l2
    return _checks.nonnegative_float("l2", l2, finite=True)


def _l2_value(l2, p: float) -> float:
    return mq_l2(p) if l2 == "auto" else float(l2)


def _view_pair(name: str, out, like=None, *, r_optional: bool = False):
    """(a, r) of one view's outputs `out`, checked (TypeError/ValueError naming `name`); `like`:
    the first view's (name, a) that this view must match in shape, device and (autocast off on
    that device: under autocast every input goes to the loss in the autocast dtype) dtype."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"{name} must be a pair (a, r) of one view's outputs (head "
                        f"pre-activations, inference logits), got {type(out).__name__}"
                        + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    a, r = out
    if like is None:
        _check_matrix(f"{name}[0]", a, cols_of=f"{name}[0]")
        ref_name, ref = f"{name}[0]", a
    else:
        ref_name, ref = like
        _check_matrix(f"{name}[0]", a, d=ref.shape[1], rows=ref.shape[0], rows_of=ref_name,
                      cols_of=ref_name)
    if not (r is None and r_optional):
        _check_matrix(f"{name}[1]", r, d=ref.shape[1], rows=ref.shape[0], rows_of=ref_name,
                      cols_of=ref_name)
    for what, t in ((f"{name}[0]", a), (f"{name}[1]", r)):
        if t is None:
            continue
        if t.dtype != ref.dtype and not _autocast_on(ref):
            raise TypeError(f"{what} must have {ref_name}'s dtype {ref.dtype}, got {t.dtype}")
        if t.device != ref.device:
            raise ValueError(f"{what} is on {t.device} but {ref_name} is on {ref.device}; all "
                             "inputs must be on one device")
    return a, r


class NACLoss(nn.Module):
    """In-batch NAC as a criterion of the two views' outputs (docs/math.md [M:inbatch]).

        criterion = nac_fast.NACLoss(p=0.1)
        loss = criterion((a0, r0), (a1, r1))    # view v: head pre-activations a_v = g(h_v) and
                                                # inference logits r_v = phi(h_v), (K, D) each

    The criterion pairs the views itself: the 2K rows are [view 0; view 1], a = [a0; a1] and
    r = [r1; r0] (each row's logits come from its partner view), and the keys are the rows' clean
    codes tanh(a), self and partner included.

    p: the channel's flip probability in (0, 0.5).
    gather_distributed: under torch.distributed (more than one process), the keys are the clean
        codes of the GLOBAL batch, all-gathered with gradient, and this rank's 2K rows are the
        queries (docs/math.md [M:inbatch] "Under DDP"): with DDP's gradient averaging the
        gradient is that of the loss over the global batch (reduction "mean"; with "sum" or
        "none" summed, DDP's averaging makes it 1/world_size of the gradient of the global
        batch's summed loss, as for any summed loss under DDP).  One process: no effect.
    reduction: "mean" | "sum" | "none" ((2K,) rows in the order [view 0; view 1]).
    backend: "auto" | "reference" | "cpu" | "triton" | "cuda" (nac_fast.available_backends()).
    likelihood: "dot" (the paper's) | "multilinear" (docs/math.md [M:multilinear]; reference
        backend only): nac_loss's.
    self_key: "include" (the paper's: each row's own clean code is one of its keys) | "exclude"
        (left out, docs/math.md [M:self-key]; every backend): nac_loss's.  With
        gather_distributed, row i's own code is found at this rank's place in the gathered keys.
    noise_draws: the loss averaged over this many channel samples (docs/math.md [M:draws]; 1,
        the paper's): nac_loss's.  Under gather_distributed the keys are gathered once.
    forward(out0, out1, noise=None): noise None = drawn from torch's RNG, or an explicit
        (2K, D) tensor of +-1 for the rows [view 0; view 1] ((noise_draws, 2K, D) with
        noise_draws > 1).
    Under autocast, a and r go to the loss in the autocast dtype (loss_dtype; the loss still
    computes in float32).  Bad input: TypeError/ValueError naming the argument (out0[1] is r0).
    """

    def __init__(self, p: float = 0.1, *, gather_distributed: bool = False,
                 reduction: str = "mean", backend: str = "auto", likelihood: str = "dot",
                 self_key: str = "include", noise_draws: int = 1):
        super().__init__()
        self.p = _checks.flip_prob("p", p)
        self.gather_distributed = _checks.flag("gather_distributed", gather_distributed)
        self.reduction = _check_reduction(reduction)
        self.backend = _check_backend_name(backend)
        self.likelihood = _check_likelihood(likelihood, backend)
        self.self_key = _check_self_key(self_key)
        self.noise_draws = _check_draws(noise_draws)

    def forward(self, out0, out1, noise: torch.Tensor | None = None) -> torch.Tensor:
        a0, r0 = _view_pair("out0", out0)
        a1, r1 = _view_pair("out1", out1, ("out0[0]", a0))
        a, r = torch.cat([a0, a1]), torch.cat([r1, r0])
        if _autocast_on(a):
            dt = loss_dtype(a)
            a, r = a.to(dt), r.to(dt)
        keys, offset = None, 0
        if self.gather_distributed and is_dist():
            keys = all_gather_with_grad(torch.tanh(a))
            if self.self_key == "exclude":  # every rank gathers the same number of rows
                offset = _rank() * a.shape[0]
        return nac_loss(a, r, self.p, keys=keys, noise=noise, reduction=self.reduction,
                        backend=self.backend, likelihood=self.likelihood,
                        self_key=self.self_key, self_offset=offset,
                        noise_draws=self.noise_draws)

    def extra_repr(self) -> str:
        return (f"p={self.p}, gather_distributed={self.gather_distributed}, "
                f"reduction={self.reduction!r}, backend={self.backend!r}, "
                f"likelihood={self.likelihood!r}, self_key={self.self_key!r}, "
                f"noise_draws={self.noise_draws}")


class NACMQLoss(nn.Module):
    """NAC with a momentum queue as a criterion of the two views' outputs (docs/math.md [M:mq],
    plus the online inference network's term [M:vi]).

        criterion = nac_fast.NACMQLoss(p=0.1, l2=0.1)
        queue = nac_fast.CodeQueue(65536, D)
        loss = criterion((a0, r0), (a1, r1), (am0, rm0), (am1, rm1), queue)

    out_v = (a_v, r_v): the online network's head pre-activations of view v and its inference
        logits r_v = phi(sg(h_v)) (detached input: only phi learns from them).  r_v None (in both
        views) leaves out the VI term.
    momentum_out_v = (am_v, rm_v): the momentum network's head pre-activations and inference
        logits of view v (computed without gradient).
    queue: a CodeQueue.  The criterion enqueues the keys tanh(am) of both views BEFORE the loss
        (every query finds its partner's key), then computes, with rows [view 0; view 1],
        nac_mq_loss(a = [a0; a1], r_hat = [rm1; rm0], queue) + nac_vi_loss(a, r = [r1; r0]),
        both terms with one channel sample.  The queue's codes are read in the loss dtype (as
        stored when that is their dtype: store them so, CodeQueue(dtype=...); else converted,
        M x D elements per call).
    gather_distributed: under torch.distributed, every rank enqueues the keys of the GLOBAL batch
        (all-gathered, in rank order), so the queues stay equal across ranks.  One process: no
        effect.
    l2: lambda of lambda ||z||^2 (0.1 in the paper), or "auto": `mq_l2(p)` of the criterion's p
    at each call (it follows a p changed between steps).  p, reduction, backend, likelihood,
    noise: as NACLoss.
    """

    def __init__(self, p: float = 0.1, *, l2: float | str = 0.1, gather_distributed: bool = False,
                 reduction: str = "mean", backend: str = "auto", likelihood: str = "dot"):
        super().__init__()
        self.p = _checks.flip_prob("p", p)
        self.l2 = _check_l2(l2)
        self.gather_distributed = _checks.flag("gather_distributed", gather_distributed)
        self.reduction = _check_reduction(reduction)
        self.backend = _check_backend_name(backend)
        self.likelihood = _check_likelihood(likelihood, backend)

    def check(self, out0, out1, queue, noise=None):
        """The checks of a call that do not read the momentum network's outputs: the online
        views' outputs, the queue (its D, device and room for the keys of both views), the
        criterion's settings (changeable between calls), the noise and the backend (ValueError /
        TypeError naming the argument).  Returns (a0, r0, a1, r1, the backend the loss runs).
        `forward` makes them first; NACMQ makes them before its EMA update, so that a refused
        call leaves the momentum model as it was."""
        a0, r0 = _view_pair("out0", out0, r_optional=True)
        like = ("out0[0]", a0)
        a1, r1 = _view_pair("out1", out1, like, r_optional=True)
        if (r0 is None) != (r1 is None):
            raise ValueError("out0[1] and out1[1] (the online inference logits) must both be "
                             "tensors (with the VI term) or both None (without it)")
        if not isinstance(queue, CodeQueue):
            raise TypeError(f"queue must be a nac_fast.CodeQueue (the criterion enqueues the "
                            f"momentum keys), got {type(queue).__name__}")
        size, D = queue.codes.shape
        if D != a0.shape[1]:
            raise ValueError(f"queue must hold codes of D={a0.shape[1]} like out0[0], got D={D}")
        if queue.codes.device != a0.device:
            raise ValueError(f"queue is on {queue.codes.device} but out0[0] is on {a0.device}; "
                             "all inputs must be on one device")
        keys = 2 * a0.shape[0] * (torch.distributed.get_world_size()
                                  if self.gather_distributed and is_dist() else 1)
        if keys > size:
            raise ValueError(f"cannot enqueue {keys} keys (both views"
                             f"{' of every rank' if keys > 2 * a0.shape[0] else ''}) into a "
                             f"queue of size {size}")
        p = _checks.flip_prob("p", self.p)
        _check_reduction(self.reduction)
        _check_l2(self.l2)
        _check_likelihood(self.likelihood, self.backend)
        if self.likelihood == "multilinear":
            reference.multilinear_terms(1.0 - 2.0 * p, torch.finfo(
                reference.acc_dtype(a0.dtype)).eps / 2)
        if noise is not None:
            check_noise(noise, (2 * a0.shape[0], a0.shape[1]), "the rows [view 0; view 1]")
            if noise.device != a0.device:
                raise ValueError(f"noise is on {noise.device} but out0[0] is on {a0.device}; "
                                 "all inputs must be on one device")
            _check_noise_values(noise)
        if value_checks_on(a0.device):  # (one device, checked above: one policy for all)
            for name, t in (("out0[0]", a0), ("out0[1]", r0), ("out1[0]", a1), ("out1[1]", r1)):
                if t is not None:
                    _check_finite(name, t)
        # the backend the loss will run (ValueError where it cannot run here) for the rows in
        # the loss dtype, the queue's codes standing in for the keys
        dt = loss_dtype(a0) if _autocast_on(a0) else a0.dtype
        impl = _backend_for(self.backend, a0 if dt == a0.dtype else a0.detach()[:1].to(dt),
                            queue.codes, self.likelihood)
        return a0, r0, a1, r1, impl

    def forward(self, out0, out1, momentum_out0, momentum_out1, queue: CodeQueue,
                noise: torch.Tensor | None = None) -> torch.Tensor:
        # every check before the queue changes (a refused call leaves it as it was); the loss
        # repeats those of its own inputs
        a0, r0, a1, r1, impl = self.check(out0, out1, queue, noise)
        like = ("out0[0]", a0)
        am0, rm0 = _view_pair("momentum_out0", momentum_out0, like)
        am1, rm1 = _view_pair("momentum_out1", momentum_out1, like)
        if value_checks_on(a0.device):
            for name, t in (("momentum_out0[0]", am0), ("momentum_out0[1]", rm0),
                            ("momentum_out1[0]", am1), ("momentum_out1[1]", rm1)):
                _check_finite(name, t)
        a, r_hat = torch.cat([a0, a1]), torch.cat([rm1, rm0])
        r = None if r0 is None else torch.cat([r1, r0])
        dt = a.dtype
        if _autocast_on(a):
            dt = loss_dtype(a)
            a, r_hat = a.to(dt), r_hat.to(dt)
            r = None if r is None else r.to(dt)
        with torch.no_grad():
            # the keys tanh(am) of both views, tanh in float32 (float64 stays) whatever the AMP
            # dtype, rounded to the queue's dtype; on a GPU one launch (CodeQueue.enqueue_tanh).
            # Gathered: the pre-activations in their own dtype (tanh is elementwise: the same keys)
            parts = ((all_gather_nograd(torch.cat([am0, am1])),)
                     if self.gather_distributed and is_dist() else (am0, am1))
            queue.enqueue_tanh(*parts, backend=self.backend if self.backend in (
                "reference", "triton") else "auto")
        codes = queue.codes if queue.codes.dtype == dt else queue.codes.to(dt)
        if codes is queue.codes and impl == "reference" and torch.is_grad_enabled():
            # the reference's autograd saves the codes it multiplies: a copy, so that the next
            # enqueue (gradient accumulation: two calls before one backward) leaves this loss's
            # graph valid, as the fused backends, which read no codes in their backward, do
            codes = codes.clone()
        if r is not None:
            both = _mq_and_vi_fused(a, r_hat, r, codes, self.p, self.l2, noise, self.reduction,
                                    impl, self.likelihood)
            if both is not None:
                return both
        if noise is None:  # one channel sample for both terms
            noise = draw_noise(a.shape, self.p, device=a.device, dtype=dt)
        loss = nac_mq_loss(a, r_hat, codes, self.p, l2=self.l2, noise=noise,
                           reduction=self.reduction, backend=impl,  # (resolved above, once)
                           likelihood=self.likelihood)
        if r is not None:
            loss = loss + nac_vi_loss(a, r, self.p, noise=noise, reduction=self.reduction)
        return loss

    def extra_repr(self) -> str:
        return (f"p={self.p}, l2={self.l2!r}, gather_distributed={self.gather_distributed}, "
                f"reduction={self.reduction!r}, backend={self.backend!r}, "
                f"likelihood={self.likelihood!r}")
