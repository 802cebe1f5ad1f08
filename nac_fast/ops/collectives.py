"""The collectives the criteria and NACMQ use across ranks: all-gather with gradient (the in-batch
negatives of the global batch, docs/math.md [M:inbatch] "Under DDP"), all-gather without it (the
momentum keys every rank enqueues, [M:mq]) and MoCo's batch shuffle for the momentum branch's
BatchNorm.

Every function is the identity when torch.distributed is not initialised (or has one process),
so the same code runs in one process.  The process group itself (torchrun's environment, SyncBN,
rank-aware reductions) is the trainer's: nac_fast.train.distributed.
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist


def is_dist() -> bool:
    """Whether torch.distributed is initialised with more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


_SHAPE_SLOTS = 8  # dimensions compared exactly by check_same_shape (the rest: by their product)


def _shape_checks_on(x: torch.Tensor) -> bool:
    """Whether check_same_shape runs for x: always for CPU tensors (the check is a tiny
    collective of host data, no device sync), on other devices only under
    the loss's value-check policy True (NAC_FAST_CHECK_INPUTS=1: reading the ranks' shapes back
    is a host sync), never while torch.compile traces."""
    if torch.compiler.is_compiling() or x.device.type == "meta":
        return False
    if x.device.type == "cpu":
        return True
    from .loss import value_checks_on  # (loss imports this module)
    return value_checks_on(x.device)


def check_same_shape(x: torch.Tensor, name: str = "x", what: str = "all-gather") -> None:
    """ValueError naming `name` unless x has the same shape and dtype on every rank (an
    all-gather of rows needs it: with different sizes gloo aborts the process, NCCL's result is
    undefined).  A collective: every rank must call it; every rank raises alike.  A no-op in one
    process.  The typical cause: the last, smaller batch of an epoch (drop_last=False)."""
    if not is_dist():
        return
    meta = [zlib.crc32(str(x.dtype).encode()), x.dim()]
    dims = list(x.shape[:_SHAPE_SLOTS]) + [-1] * max(0, _SHAPE_SLOTS - x.dim())
    rest = 1
    for v in x.shape[_SHAPE_SLOTS:]:
        rest *= v
    dev = torch.device("cpu") if dist.get_backend() == "gloo" else x.device
    mine = torch.tensor(meta + dims + [rest], dtype=torch.long, device=dev)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    rows = [t.tolist() for t in every]
    if any(r != rows[0] for r in rows):
        def desc(r):
            d = r[1]
            return f"{tuple(r[2:2 + min(d, _SHAPE_SLOTS)])}" + ("" if d <= _SHAPE_SLOTS else "...")
        shapes = ", ".join(f"rank {i}: {desc(r)}" for i, r in enumerate(rows))
        dtypes = "" if all(r[0] == rows[0][0] for r in rows) else " or dtype"
        raise ValueError(f"{name} must have the same shape and dtype on every rank for the "
                         f"{what}, but its shape{dtypes} differs ({shapes}; on this rank, "
                         f"{dist.get_rank()}: {x.dtype}); drop the last "
                         "incomplete batch (e.g. DataLoader(drop_last=True)) so that every rank "
                         "has the same batch size")


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
    in-batch keys of the global batch, docs/math.md [M:inbatch]).  Shapes that differ across
    ranks: ValueError on every rank (check_same_shape; on GPU tensors only under
    NAC_FAST_CHECK_INPUTS=1)."""
    if not is_dist():
        return x
    if _shape_checks_on(x):
        check_same_shape(x, "x", "all-gather with gradient")
    return _AllGatherWithGrad.apply(x)


@torch.no_grad()
def all_gather_nograd(x: torch.Tensor) -> torch.Tensor:
    """Concatenate x (same shape on every rank) from all ranks in rank order, without gradient.
    Shapes that differ across ranks: as all_gather_with_grad."""
    if not is_dist():
        return x
    if _shape_checks_on(x):
        check_same_shape(x, "x", "all-gather")
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
    _check_batch("x", x)
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


def _check_batch(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0:
        raise ValueError(f"{name} must be a batch (rows first), got a 0-dim tensor")


@torch.no_grad()
def batch_unshuffle(y: torch.Tensor, idx_unshuffle: torch.Tensor | None) -> torch.Tensor:
    """Undo `batch_shuffle` on outputs: row i of the result belongs to this rank's input row i."""
    if idx_unshuffle is None:
        return y
    _check_batch("y", y)
    if not isinstance(idx_unshuffle, torch.Tensor) or idx_unshuffle.dim() != 1 \
            or idx_unshuffle.numel() != y.shape[0] * world_size():
        got = (tuple(idx_unshuffle.shape) if isinstance(idx_unshuffle, torch.Tensor)
               else type(idx_unshuffle).__name__)
        raise ValueError(f"idx_unshuffle must be batch_shuffle's permutation of the global batch, "
                         f"{y.shape[0]} rows x {world_size()} ranks, got {got} (y must have as "
                         "many rows as batch_shuffle's x)")
    y_all = all_gather_nograd(y)
    n, rk = y.shape[0], dist.get_rank()
    return y_all[idx_unshuffle[rk * n:(rk + 1) * n]]
