"""The training steps as nac_fast 0.1.0 wrote them out by hand (nac_fast/train/methods.py before the
trainer used its own public criteria), frozen here as the oracle the new path must equal bit for
bit: tests/test_loss.py (one process, several optimizer steps) and tests/test_train_ddp.py
(two processes).  The momentum branch's batch shuffle is the old all-gather one as well
(old_batch_shuffle; the new one is an all-to-all that must give the same rows for the same
permutation).  Only the functional losses, the collectives and the queue are shared with the
code under test; the view pairing, the dtype policy, the enqueue and the EMA's place are the old
ones.  In 0.1.0 the EMA followed each optimizer step (the caller's ema_update_); NACMQ makes the
same update at the start of its next call."""
from __future__ import annotations

import torch
import torch.distributed as dist

from nac_fast.ops.collectives import (_check_batch, all_gather_nograd, all_gather_with_grad,
                                      is_dist, world_size)
from nac_fast.ops.loss import nac_loss, nac_mq_loss, nac_vi_loss
from nac_fast.ops.noise import draw_noise


@torch.no_grad()
def old_batch_shuffle(x, generator=None):
    """MoCo's batch shuffle as nac_fast wrote it before the all-to-all (issue 54): all-gather the
    whole global batch on every rank, permute it (drawn on rank 0, broadcast), keep n rows.
    Returns (x_local_shuffled, idx_unshuffle); the identity in one process."""
    if not is_dist():
        return x, None
    _check_batch("x", x)
    rk = dist.get_rank()
    x_all = all_gather_nograd(x)
    n_all = x_all.shape[0]
    if rk == 0:
        perm = torch.randperm(n_all, generator=generator, device=x.device if generator is None
                              else generator.device)
        perm = perm.to(x.device, non_blocking=True)
    else:
        perm = torch.empty(n_all, dtype=torch.long, device=x.device)
    dist.broadcast(perm, src=0)
    idx_unshuffle = torch.argsort(perm)
    n = x.shape[0]
    return x_all[perm[rk * n:(rk + 1) * n]], idx_unshuffle


@torch.no_grad()
def old_batch_unshuffle(y, idx_unshuffle):
    """old_batch_shuffle's inverse: all-gather the outputs, keep this rank's rows."""
    if idx_unshuffle is None:
        return y
    assert idx_unshuffle.numel() == y.shape[0] * world_size()
    y_all = all_gather_nograd(y)
    n, rk = y.shape[0], dist.get_rank()
    return y_all[idx_unshuffle[rk * n:(rk + 1) * n]]


def _acc(t):
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _loss_dtype(t):
    if t.dtype == torch.float64:
        return t.dtype
    dev = t.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


def _swap_halves(t):
    k = t.shape[0] // 2
    return torch.cat([t[k:], t[:k]])


def old_nac_step(model, x, p, noise=None, backend="auto", *, freeze_codes=False):
    _, a, r = model(x, detach_r_input=freeze_codes)
    dt = _loss_dtype(a)
    a_l, r_l = a.to(dt), r.to(dt)
    if freeze_codes:
        a_l = a_l.detach()
    keys = all_gather_with_grad(torch.tanh(a_l)) if is_dist() else None
    return nac_loss(a_l, r_l, p, keys=keys, noise=noise, backend=backend), a


def old_nac_mq_step(model, momentum_model, queue, x, p, l2, noise=None, shuffle_bn=True,
                    backend="auto", *, freeze_codes=False):
    _, a, r = model(x, detach_r_input=True)
    with torch.no_grad():
        xs, idx = old_batch_shuffle(x) if shuffle_bn else (x, None)
        hm, am = momentum_model.encode(xs)
        hm, am = old_batch_unshuffle(hm, idx), old_batch_unshuffle(am, idx)
        r_hat = momentum_model.infer_logits(_swap_halves(hm))
        queue.enqueue(all_gather_nograd(torch.tanh(_acc(am))))
    dt = _loss_dtype(a)
    a_l = a.to(dt)
    if freeze_codes:
        a_l = a_l.detach()
    if noise is None:
        noise = draw_noise(a_l.shape, p, device=a_l.device, dtype=dt)
    codes = queue.codes if queue.codes.dtype == dt else queue.codes.to(dt)
    loss = nac_mq_loss(a_l, r_hat.to(dt), codes, p, l2=l2, noise=noise, backend=backend)
    vi = nac_vi_loss(a_l, r.to(dt), p, noise=noise)
    return loss + vi, a
