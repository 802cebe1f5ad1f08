"""The collectives the criteria and NACMQ use across ranks: all-gather with gradient (the in-batch
negatives of the global batch, docs/math.md [M:inbatch] "Under DDP"), all-gather without it (the
momentum keys every rank enqueues, [M:mq]) and MoCo's batch shuffle for the momentum branch's
BatchNorm (one all-to-all that moves each rank only the rows it encodes, and one that sends the
outputs back).

Every function is the identity when torch.distributed is not initialised (or has one process),
so the same code runs in one process.  The process group itself (torchrun's environment, SyncBN,
rank-aware reductions) is the trainer's: nac_fast.train.distributed.
"""
from __future__ import annotations

import zlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from .dispatch import value_checks_on


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
    collective of host data, no device sync), on other devices only under the value-check policy
    True (nac_fast/ops/dispatch.py; NAC_FAST_CHECK_INPUTS=1: reading the ranks' shapes back is a
    host sync), never while torch.compile traces."""
    if torch.compiler.is_compiling() or x.device.type == "meta":
        return False
    if x.device.type == "cpu":
        return True
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


class ShufflePlan(NamedTuple):
    """What `batch_unshuffle` needs to send the momentum encoder's outputs back to their owners:
    returned by `batch_shuffle` (None in one process).

    idx_unshuffle: argsort of the global permutation (the position of global row g in the
        shuffled global batch), the same tensor on every rank.
    send_order: this rank's rows in the order the shuffle sent them (grouped by the rank that
        encodes them).
    recv_order: for each row the shuffle received (grouped by the rank it came from), its row in
        this rank's shuffled batch.
    send_sizes, recv_sizes: the rows sent to / received from each rank (host lists: the split
        sizes of all_to_all_single)."""
    idx_unshuffle: torch.Tensor
    send_order: torch.Tensor
    recv_order: torch.Tensor
    send_sizes: list
    recv_sizes: list


def _row_major(t: torch.Tensor):
    """t as a tensor whose rows (dim 0) are contiguous blocks in memory order, and the function
    that turns a tensor of that layout back: a channels-last batch is moved as its NHWC view (no
    conversion copy, and the shuffled batch stays channels-last), anything else as it is or
    made contiguous."""
    if t.is_contiguous():
        return t, lambda u: u
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return t.permute(0, 2, 3, 1), lambda u: u.permute(0, 3, 1, 2)
    return t.contiguous(), lambda u: u


@torch.no_grad()
def _exchange_rows(t: torch.Tensor, send_order: torch.Tensor, recv_order: torch.Tensor,
                   send_sizes: list, recv_sizes: list) -> torch.Tensor:
    """One all_to_all_single: rows t[send_order] go out in blocks of send_sizes to ranks 0, 1,
    ...; the blocks of recv_sizes that arrive are placed at rows recv_order of the result.
    Every row moves in t's dtype (bf16 / uint8 images stay so)."""
    v, back = _row_major(t)
    out = v.new_empty((sum(recv_sizes),) + tuple(v.shape[1:]))
    dist.all_to_all_single(out, v.index_select(0, send_order), recv_sizes, send_sizes)
    res = torch.empty_like(out)
    res[recv_order] = out
    return back(res)


@torch.no_grad()
def batch_shuffle(x: torch.Tensor, generator: torch.Generator | None = None):
    """MoCo's batch shuffle: permute the global batch and give each rank n rows of it, moving
    only those rows (one all-to-all), in x's dtype.

    Returns (x_local_shuffled, plan): rows perm[rank * n:(rank + 1) * n] of the global batch (the
    ranks' x concatenated in rank order) for a permutation perm of the n * world_size global
    rows, and the ShufflePlan that `batch_unshuffle` takes.  The permutation is drawn on rank 0
    (from `generator` or torch's global RNG of the batch's device, so a restored RNG state
    reproduces it), on the batch's device, and broadcast (8 bytes a global row).  Each rank then
    receives exactly the n rows it encodes, in x's dtype and memory format: n rows per rank at
    any number of ranks (an all-gather of the global batch, MoCo's way, delivers n * world_size;
    tests/test_train_ddp.py counts the bytes).  The split sizes of the all-to-all must be known
    on the host: one read of 2 x world_size counts per call (free for a CPU batch; on a GPU a
    host wait for the queued work).
    With BN computed per rank, the momentum encoder's batch statistics then mix samples of other
    ranks, so a query cannot find its positive key through shared BN statistics (MoCo, sec. 3.3).
    In one process this is the identity: there is no other rank to mix with.
    Batches that differ across ranks in shape or dtype: ValueError naming x on every rank (on GPU
    tensors only under NAC_FAST_CHECK_INPUTS=1, as all_gather_nograd).
    """
    if not is_dist():
        return x, None
    _check_batch("x", x)
    if _shape_checks_on(x):
        check_same_shape(x, "x", "batch shuffle")
    ws, rk, n = dist.get_world_size(), dist.get_rank(), x.shape[0]
    n_all = n * ws
    if rk == 0:
        perm = torch.randperm(n_all, generator=generator, device=x.device if generator is None
                              else generator.device)
        perm = perm.to(x.device, non_blocking=True)  # a no-op unless the generator's is another
    else:
        perm = torch.empty(n_all, dtype=torch.long, device=x.device)
    dist.broadcast(perm, src=0)
    idx_unshuffle = torch.argsort(perm)
    mine = perm[rk * n:(rk + 1) * n]                # the global rows this rank encodes, in order
    dest = idx_unshuffle[rk * n:(rk + 1) * n] // n  # the rank that encodes each of this rank's rows
    # sent grouped by destination, each group in row order; so the rows arrive grouped by
    # source in ascending global row: the sorted `mine`, whose sort order places them
    send_order = torch.argsort(dest, stable=True)
    recv_order = torch.sort(mine, stable=True).indices
    sizes = torch.stack([torch.bincount(dest, minlength=ws),
                         torch.bincount(mine // n, minlength=ws)]).tolist()  # the host read
    plan = ShufflePlan(idx_unshuffle, send_order, recv_order, sizes[0], sizes[1])
    return _exchange_rows(x, send_order, recv_order, plan.send_sizes, plan.recv_sizes), plan


def _check_batch(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0:
        raise ValueError(f"{name} must be a batch (rows first), got a 0-dim tensor")


@torch.no_grad()
def batch_unshuffle(y: torch.Tensor, plan: ShufflePlan | None) -> torch.Tensor:
    """Undo `batch_shuffle` on outputs (the momentum encoder's codes): row i of the result
    belongs to this rank's input row i.  One all-to-all sends each row back to its owner rank
    (n rows received per rank), in y's dtype.  plan: batch_shuffle's (None: y as it is)."""
    if plan is None:
        return y
    if not isinstance(plan, ShufflePlan):
        raise TypeError(f"plan must be the ShufflePlan batch_shuffle returned, got "
                        f"{type(plan).__name__}")
    _check_batch("y", y)
    n = plan.send_order.numel()
    if y.shape[0] != n:
        raise ValueError(f"y must have as many rows as batch_shuffle's x ({n}, the rows of this "
                         f"rank's shuffled batch), got shape {tuple(y.shape)}")
    # the reverse exchange: what arrived from a rank goes back to it, in the order it came
    return _exchange_rows(y, plan.recv_order, plan.send_order, plan.recv_sizes, plan.send_sizes)
