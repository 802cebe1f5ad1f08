"""NAC-MQ as one module (MoCo's builder): the online model, its momentum (EMA) copy, the code queue,
the EMA update, the shuffle BN of the momentum branch and the criterion (docs/math.md [M:mq],
[M:vi], [M:ema]).

    mq = NACMQ(model, queue_size=65536, p=0.1, l2=0.1, momentum=0.99)
    loss = mq(view0, view1).loss          # the training loop's one call
    ema_update_(momentum_model, online_model, decay)      # the EMA itself ([M:ema])
"""
from __future__ import annotations

import copy
from typing import NamedTuple

import torch
import torch.nn as nn

from .. import _checks
from .collectives import batch_shuffle, batch_unshuffle
from .loss import NACMQLoss, check_noise
from .queue import CodeQueue


def make_momentum_copy(model: nn.Module) -> nn.Module:
    """A deep copy that never receives gradients (its parameters are an EMA of `model`'s)."""
    mom = copy.deepcopy(model)
    for p in mom.parameters():
        p.requires_grad_(False)
    return mom


@torch.no_grad()
def ema_update_(momentum_model: nn.Module, online_model: nn.Module, decay: float) -> None:
    """The EMA update of docs/math.md [M:ema], for every parameter.

    Buffers (BatchNorm running statistics) are not averaged: as in MoCo, the momentum model's BN
    layers keep the statistics of the batches it sees itself.  `online_model` may be wrapped in
    DistributedDataParallel or torch.compile; parameters are matched by order (a wrapper's
    parameters() are its module's, in the same order: no unwrapping needed, and none that could
    mistake a model's own submodule named `module` for the model), shape, dtype and device.
    """
    decay = _checks.unit_float("decay", decay)
    mp = list(momentum_model.parameters())
    op = list(online_model.parameters())
    if len(mp) != len(op):
        raise ValueError(f"momentum model has {len(mp)} parameters, online model {len(op)}")
    for i, (m, o) in enumerate(zip(mp, op)):  # (metadata only: no device work)
        if m.shape != o.shape or m.dtype != o.dtype or m.device != o.device:
            raise ValueError(f"momentum model's parameter {i} is {tuple(m.shape)} {m.dtype} on "
                             f"{m.device} but the online model's is {tuple(o.shape)} {o.dtype} "
                             f"on {o.device}: the models must have the same architecture")
    # lerp: m + (1-decay)*(o - m) == decay*m + (1-decay)*o: one foreach launch per chunk of
    # tensors of a dtype/device, no kernel per parameter, no host sync (the weight is a Python
    # number); under no_grad the online parameters are read as they are (no detached copies).
    torch._foreach_lerp_(mp, op, 1.0 - decay)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DistributedDataParallel and/or torch.compile wrappers: an attribute
    `module` (DDP, DataParallel) or `_orig_mod` (torch.compile) that holds every parameter of the
    wrapper.  A model that merely has a submodule named `module` beside parameters of its own is
    no wrapper and is returned as it is (unwrapping it would drop those parameters from the
    EMA)."""
    while True:
        inner = None
        for attr in ("_orig_mod", "module"):  # (a compiled module forwards `module` to its
            # model: _orig_mod first)
            cand = getattr(model, attr, None)
            if isinstance(cand, nn.Module) and cand is not model:
                inner = cand
                break
        # the inner module's parameters are the wrapper's own or a subset: equal counts, the
        # same parameters (parameters() lists each once)
        if inner is None or sum(1 for _ in model.parameters()) != \
                sum(1 for _ in inner.parameters()):
            return model
        model = inner


MOMENTUM_BN = ("shuffle", "sync")  # NACMQ's momentum_bn (train.py's --momentum-bn)


class NACMQOutput(NamedTuple):
    """What NACMQ.forward returns: the loss to minimise (MQ + VI terms) and, detached, the online
    model's head pre-activations a and inference logits r of the rows [view 0; view 1] (as the
    model returned them: r's rows come from the partner view) for statistics."""
    loss: torch.Tensor
    a: torch.Tensor
    r: torch.Tensor


def _swap_views(t: torch.Tensor) -> torch.Tensor:
    k = t.shape[0] // 2
    return torch.cat([t[k:], t[:k]])


class NACMQ(nn.Module):
    """NAC-MQ in one module, after MoCo's builder (docs/math.md [M:mq], [M:vi], [M:ema]).

        mq = nac_fast.NACMQ(model, queue_size=65536, p=0.1, l2=0.1, momentum=0.99)
        loss = mq(view0, view1).loss          # then backward and the optimizer step
        # mq.model: the online model; mq.momentum_model: its EMA copy; mq.queue: the CodeQueue

    Each call is one training step's loss:
      1. the online forward on x = cat([view0, view1]);
      2. the EMA update of the momentum model from the online model's current weights
         (ema_update_, [M:ema]): the update that follows the previous optimizer step, made here
         so the loop needs no second call (at the first call both models are equal and the
         update leaves the copy exactly as it is);
      3. the momentum forward without gradient, with MoCo's batch shuffle across ranks around its
         encoder (shuffle BN; the identity in one process) or, with momentum_bn="sync",
         SyncBatchNorm in it;
      4. the criterion, NACMQLoss(gather_distributed=True): the keys of the global batch are
         enqueued, then the MQ term and the online inference network's VI term with one channel
         sample.

    model: the online network, an nn.Module with NACModel's interface (nac_fast.train.models):
        model(x, detach_r_input=True) -> (h, a, r) on x = cat([view0, view1]), with r the
        inference logits phi(sg(h)) of each row's partner view; model.encode(x) -> (h, a) and
        model.infer_logits(h) -> r (the momentum branch).  Build NACMQ before converting the
        model to SyncBatchNorm: the momentum copy keeps plain BatchNorm for shuffle BN (or is
        converted by momentum_bn="sync").
        Under DDP, wrap the NACMQ (not the model) in DistributedDataParallel, as MoCo does.
    queue_size: M, the number of momentum codes.  code_dim: D (default: model.code_dim).
    p, l2, reduction, backend, likelihood: NACMQLoss's.  momentum: the EMA decay in [0, 1].
    momentum_bn: how the momentum encoder's BatchNorm sees the batch under DDP: "shuffle"
        (MoCo's shuffle BN: per-rank BN over rows shuffled across ranks, one all-to-all of the
        images and one of each output back) or "sync" (MoCo v3's: the momentum copy's BatchNorm
        layers become SyncBatchNorm, statistics of the global batch, one all-gather of
        statistics per BN layer, no shuffle; SyncBatchNorm needs a GPU under DDP).
        docs/training.md "The momentum encoder's BatchNorm" weighs them.
    shuffle_bn: with momentum_bn="shuffle", whether to shuffle (False: per-rank BN on the rank's
        own rows; it has an effect only under DDP).  None: True for "shuffle"; "sync" never
        shuffles (True with "sync" is refused).
    queue_dtype: the queue's storage dtype: the loss dtype (the autocast dtype under AMP) saves
        a conversion of M x D elements per step.

    forward(view0, view1, *, noise=None, freeze_codes=False) -> NACMQOutput(loss, a, r).
        noise: None (drawn from torch's RNG) or the (2K, D) +-1 channel sample of the rows
        [view 0; view 1].  freeze_codes: the loss's gradient reaches only the inference network
        (the codes a are detached; the VI term still trains phi).
    """

    def __init__(self, model: nn.Module, *, queue_size: int, code_dim: int | None = None,
                 p: float = 0.1, l2: float | str = 0.1, momentum: float = 0.99,
                 momentum_bn: str = "shuffle", shuffle_bn: bool | None = None,
                 queue_dtype: torch.dtype = torch.float32,
                 reduction: str = "mean", backend: str = "auto", likelihood: str = "dot"):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        for name in ("encode", "infer_logits"):
            if not callable(getattr(model, name, None)):
                raise TypeError(f"model must have NACModel's interface (forward, encode, "
                                f"infer_logits); {type(model).__name__} has no {name}()")
        if code_dim is None:
            code_dim = getattr(model, "code_dim", None)
            if code_dim is None:
                raise ValueError("code_dim must be given: the model has no code_dim attribute")
        _checks.positive_int("queue_size", queue_size)
        _checks.positive_int("code_dim", code_dim)
        if not isinstance(queue_dtype, torch.dtype) or not queue_dtype.is_floating_point:
            raise TypeError(f"queue_dtype must be a floating torch.dtype, got {queue_dtype!r}")
        self.momentum = _checks.unit_float("momentum", momentum)
        if momentum_bn not in MOMENTUM_BN:
            raise ValueError(f"momentum_bn must be one of {', '.join(MOMENTUM_BN)}, got "
                             f"{momentum_bn!r}")
        if shuffle_bn is None:
            shuffle_bn = momentum_bn == "shuffle"
        self.shuffle_bn = _checks.flag("shuffle_bn", shuffle_bn)
        if momentum_bn == "sync" and self.shuffle_bn:
            raise ValueError("shuffle_bn=True contradicts momentum_bn='sync': SyncBatchNorm "
                             "normalises with the global batch's statistics, which a shuffle "
                             "does not change (leave shuffle_bn None or False)")
        self.momentum_bn = momentum_bn
        self.criterion = NACMQLoss(p, l2=l2, gather_distributed=True, reduction=reduction,
                                   backend=backend, likelihood=likelihood)
        self.model = model
        self.momentum_model = make_momentum_copy(model)
        if momentum_bn == "sync":  # (parameters and buffers kept, by name and order)
            self.momentum_model = nn.SyncBatchNorm.convert_sync_batchnorm(self.momentum_model)
        param = next(model.parameters(), None)
        self.queue = CodeQueue(queue_size, code_dim, device=None if param is None else
                               param.device, dtype=queue_dtype)

    @torch.no_grad()
    def update_momentum(self) -> None:
        """The EMA update of the momentum model from the online model ([M:ema]); forward makes
        it first."""
        ema_update_(self.momentum_model, self.model, self.momentum)

    def forward(self, view0: torch.Tensor, view1: torch.Tensor, *,
                noise: torch.Tensor | None = None, freeze_codes: bool = False) -> NACMQOutput:
        _checks.tensor("view0", view0)
        _checks.tensor("view1", view1)
        if view1.shape != view0.shape or view1.dtype != view0.dtype \
                or view1.device != view0.device:
            raise ValueError(f"view1 must match view0 (shape {tuple(view0.shape)}, "
                             f"{view0.dtype}, {view0.device}), got shape {tuple(view1.shape)}, "
                             f"{view1.dtype}, {view1.device}")
        if view0.dim() == 0 or view0.shape[0] == 0:
            raise ValueError(f"view0 must be a non-empty batch, got shape {tuple(view0.shape)}")
        _checks.flag("freeze_codes", freeze_codes)
        k = view0.shape[0]
        if noise is not None:
            check_noise(noise, (2 * k, self.queue.codes.shape[1]), "the rows [view 0; view 1]")
        x = torch.cat([view0, view1])
        _, a, r = self.model(x, detach_r_input=True)  # r: online inference net on sg(h) [M:vi]
        if r is None:
            raise ValueError("model returned no inference logits r: NAC-MQ needs an inference "
                             "network")
        # after the online forward (it does not read the momentum model) and the criterion's
        # checks of what does not depend on the momentum outputs (the online outputs' values,
        # the queue's room and D, the settings, the noise, the backend), so that a call the model
        # or the criterion refuses leaves the momentum model as it was
        self.criterion.check((a[:k], r[k:]), (a[k:], r[:k]), self.queue, noise)
        self.update_momentum()
        if freeze_codes:
            a = a.detach()
        with torch.no_grad():
            xs, plan = batch_shuffle(x) if self.shuffle_bn else (x, None)
            hm, am = self.momentum_model.encode(xs)
            hm, am = batch_unshuffle(hm, plan), batch_unshuffle(am, plan)
            # phi_mom on the rows in the online cross pathway's order [view 1; view 0], so that
            # a BatchNorm in phi sums its statistics as the online model's does
            r_hat = self.momentum_model.infer_logits(_swap_views(hm))
        # the views' own outputs: the model's r (and r_hat) rows come from the partner view
        # (called as a module, its forward: it repeats check, a few microseconds of host)
        loss = self.criterion((a[:k], r[k:]), (a[k:], r[:k]),
                              (am[:k], r_hat[k:]), (am[k:], r_hat[:k]), self.queue, noise=noise)
        return NACMQOutput(loss, a.detach(), r.detach())

    def extra_repr(self) -> str:
        return (f"momentum={self.momentum}, momentum_bn={self.momentum_bn}, "
                f"shuffle_bn={self.shuffle_bn}")
