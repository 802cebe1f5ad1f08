"""The collectives the criteria and NACMQ use across ranks: all-gather with gradient (the in-batch
negatives of the global batch, docs/math.md [M:inbatch] "Under DDP"), all-gather without it (the
momentum keys every rank enqueues, [M:mq]) and MoCo's batch shuffle for the momentum branch's
BatchNorm.

Every function is the identity when torch.distributed is not initialised (or has one process),
so the same code runs in one process.  The process group itself (torchrun's environment, SyncBN,
rank-aware reductions) is the trainer's: nac_fast.train.distributed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def is_dist() -> bool:
    """Whether torch.distributed is initialised with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


class _AllGatherWithGrad(torch.autograd.Function):
    """all_gather whose backward hands each rank the SUM over ranks of the gradient of its slice.

    Every rank's loss reads the gathered keys, so the gradient of the global objective with
    respect to rank r's rows is the sum of all ranks' contributions; DDP then averages parameter
    gradients over ranks, which together with a per-rank mean equals the gradient of the mean over
    the global batch (tests/test_train_ddp.py checks this against one process).  gloo has no
    reduce_scatter, so the backward is an all_reduce of the whole gradient and a slice.
    """

    @staticmethod
    def forward(ctx, x):
        ws = dist.get_world_size()
        out = [torch.empty_like(x) for _ in range(ws)]
        dist.all_gather(out, x.contiguous())
        ctx.rank, ctx.n = dist.get_rank(), x.shape[0]
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n]


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate x (same shape on every rank) from all ranks in rank order, differentiably (the
    in-batch keys of the global batch, docs/math.md [M:inbatch])."""
    if not is_dist():
        return x
    return _AllGatherWithGrad.apply(x)


@torch.no_grad()
def all_gather_nograd(x: torch.Tensor) -> torch.Tensor:
    """Concatenate x (same shape on every rank) from all ranks in rank order, without gradient."""
    if not is_dist():
        return x
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return torch.cat(out)


@torch.no_grad()
def batch_shuffle(x: torch.Tensor, generator: torch.Generator | None = None):
    """MoCo's batch shuffle: gather the global batch, permute it, give each rank a slice.

    Returns (x_local_shuffled, idx_unshuffle).  The permutation is drawn on rank 0 (from
    `generator` or torch's global RNG of the batch's device, so a restored RNG state reproduces
    it), on the batch's device, and broadcast: no host round trip (a permutation drawn on the
    CPU and copied to a GPU would make the host wait for the GPU every step).
    With BN computed per rank, the momentum encoder's batch statistics then mix samples of other
    ranks, so a query cannot find its positive key through shared BN statistics (MoCo, sec. 3.3).
    In one process this is the identity: there is no other rank to mix with.
    """
    if not is_dist():
        return x, None
    rk = dist.get_rank()
    x_all = all_gather_nograd(x)
    n_all = x_all.shape[0]
    if rk == 0:
        perm = torch.randperm(n_all, generator=generator, device=x.device if generator is None
                              else generator.device)
        perm = perm.to(x.device, non_blocking=True)  # a no-op unless the generator's is another
    else:
        perm = torch.empty(n_all, dtype=torch.long, device=x.device)
    dist.broadcast(perm, src=0)
    idx_unshuffle = torch.argsort(perm)
    n = x.shape[0]
    return x_all[perm[rk * n:(rk + 1) * n]], idx_unshuffle


@torch.no_grad()
def batch_unshuffle(y: torch.Tensor, idx_unshuffle: torch.Tensor | None) -> torch.Tensor:
    """Undo `batch_shuffle` on outputs: row i of the result belongs to this rank's input row i."""
    if idx_unshuffle is None:
        return y
    y_all = all_gather_nograd(y)
    n, rk = y.shape[0], dist.get_rank()
    return y_all[idx_unshuffle[rk * n:(rk + 1) * n]]
