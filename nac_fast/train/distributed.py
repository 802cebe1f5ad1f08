"""Distributed helpers of the trainer: the process group from torchrun's environment, SyncBN
conversion, rank-aware reductions and object broadcasts.  The collectives the criteria use
themselves (all-gather with gradient, MoCo's batch shuffle) are nac_fast.ops.collectives.

All functions are no-ops (identity) when torch.distributed is not initialised, so the same
training code runs in one process.
"""
from __future__ import annotations

import datetime
import os
import time
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _checks
from ..ops.collectives import is_dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {v!r}") from None


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> DistInfo:
    """Initialise from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    device: "auto" (cuda:LOCAL_RANK when CUDA is present, else cpu), "cpu" or "cuda".
    One process without WORLD_SIZE (plain `python train.py`) gets rank 0 of 1 and no process group.
    The backend is NCCL for CUDA and gloo for CPU.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    _checks.positive_number("timeout_s", timeout_s)
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if world < 1:
        raise ValueError(f"environment variable WORLD_SIZE must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"environment variable RANK must be in [0, WORLD_SIZE = {world}), "
                         f"got {rank}")
    if local_rank < 0:
        raise ValueError(f"environment variable LOCAL_RANK must be >= 0, got {local_rank}")
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        kw = {"device_id": dev} if use_cuda else {}
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's store outlives a failed worker group, keys and all: a restarted group
            # that used it as is could read the dead group's addresses (pytorch/pytorch#135712)
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  world, is_master=False, timeout=timeout)
            ns = fresh_namespace(store, rank, world, timeout_s)
            kw.update(store=dist.PrefixStore(f"nac_fast/{ns}/", store), rank=rank,
                      world_size=world)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timeout, **kw)
    return DistInfo(rank, world, local_rank, dev)


def fresh_namespace(store, rank: int, world: int, timeout_s: float) -> str:
    """A key prefix that all `world` processes agree on and that no earlier worker group used in
    `store`, with no counter that every process would have to share (torchrun's restart count
    is per node).  Rank 0 posts a fresh challenge; every other rank answers the challenge it read
    with its own fresh nonce and waits for rank 0 to acknowledge that nonce, which only the
    current rank 0 can do; a rank that read an earlier group's challenge gets no acknowledgement
    and reads again."""
    nonce = uuid.uuid4().hex
    if rank == 0:
        store.set("nac_fast/challenge", nonce)
        for r in range(1, world):
            key = f"nac_fast/{nonce}/answer/{r}"
            store.wait([key], datetime.timedelta(seconds=timeout_s))
            store.set(f"nac_fast/{nonce}/ack/{r}/{store.get(key).decode()}", "1")
        return nonce
    deadline = time.monotonic() + timeout_s
    while True:
        challenge = store.get("nac_fast/challenge").decode()  # waits for the first one
        store.set(f"nac_fast/{challenge}/answer/{rank}", nonce)
        try:
            store.wait([f"nac_fast/{challenge}/ack/{rank}/{nonce}"], datetime.timedelta(seconds=1))
            return challenge
        except (RuntimeError, TimeoutError):  # DistStoreError: an earlier group's challenge
            if time.monotonic() > deadline:
                raise


def restart_count() -> int:
    """How many times torchrun (--max-restarts) has restarted this worker group: 0 in the first
    attempt and outside torchrun."""
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def convert_sync_bn(model: nn.Module) -> nn.Module:
    """BatchNorm -> SyncBatchNorm (statistics over the global batch) when running distributed."""
    if not is_dist():
        return model
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if not is_dist():
        return t
    t = t.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / dist.get_world_size()


def barrier():
    if is_dist():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj) -> list:
    """The list of `obj` from every rank (on every rank)."""
    if not is_dist():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
