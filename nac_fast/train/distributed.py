"""Distributed helpers of the trainer: the process group from torchrun's environment, SyncBN
conversion, rank-aware reductions and object broadcasts.  The collectives the criteria use
themselves (all-gather with gradient, MoCo's batch shuffle) are nac_fast.ops.collectives.

All functions are no-ops (identity) when torch.distributed is not initialised, so the same
training code runs in one process.
"""
from __future__ import annotations

import datetime
import itertools
import os
import re
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
        raise LaunchError(f"environment variable {name} must be an integer, got {v!r}") from None


class LaunchError(ValueError):
    """The launcher's variables are incomplete or inconsistent (train.py: one line, status 2)."""


# The variables that make a process one task of a `srun` launch (one task per GPU)
SLURM_TASK_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
# A SLURM launch without MASTER_PORT meets on SLURM_PORT_BASE + SLURM_JOB_ID mod SLURM_PORT_SPAN:
# below Linux's ephemeral ports (32768 on), and two jobs that share a node meet on different
# ports unless their ids are a multiple of SLURM_PORT_SPAN apart
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 15000
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def slurm_hosts(nodelist: str):
    """The host names of a SLURM compressed host list, in order (a generator: the first one of
    ten thousand costs nothing):  "node[01-03,07],gpu5" -> node01 node02 node03 node07 gpu5;
    "rack[1-2]-n[1-2]" -> rack1-n1 rack1-n2 rack2-n1 rack2-n2.  Zero padding is kept (the width
    of the range's first bound).  ValueError naming the list when it is not one."""
    if not isinstance(nodelist, str) or not nodelist.strip():
        raise ValueError(f"host list must be a non-empty string, got {nodelist!r}")
    items, depth, start = [], 0, 0
    for i, c in enumerate(nodelist):          # top-level commas separate the items
        if c == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"host list {nodelist!r}: nested '['")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {nodelist!r}: ']' without '['")
        elif c == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"host list {nodelist!r}: '[' without ']'")
    items.append(nodelist[start:])
    parts = [_host_item(item.strip(), nodelist) for item in items]
    for choices in parts:
        yield from ("".join(p) for p in itertools.product(*choices))


def _host_item(item: str, nodelist: str) -> list:
    """One item of a host list as a list of choices per segment: literals are one choice, a
    bracket group the names of its ranges."""
    if not item:
        raise ValueError(f"host list {nodelist!r}: an empty host name")
    out, pos = [], 0
    for m in re.finditer(r"\[([^\]]*)\]", item):
        out.append([item[pos:m.start()]])
        out.append(_host_range(m.group(1), nodelist))
        pos = m.end()
    out.append([item[pos:]])
    return out


def _host_range(spec: str, nodelist: str) -> list:
    names = []
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"host list {nodelist!r}: [{spec}] is not a list of numbers and "
                             "ranges (e.g. [01-04,07])")
        a, b = int(lo), int(hi) if dash else int(lo)
        if b < a:
            raise ValueError(f"host list {nodelist!r}: range {part.strip()} goes down")
        names.extend(str(k).zfill(len(lo)) for k in range(a, b + 1))
    return names


def slurm_launch_env(env=None) -> dict | None:
    """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) for a task of `srun python train.py` (one task per GPU), from SLURM's:
    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE (when a plain number), the
    first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST, SLURM_NODELIST) and MASTER_PORT,
    else SLURM_PORT_BASE + SLURM_JOB_ID mod SLURM_PORT_SPAN.  MASTER_ADDR and MASTER_PORT, when
    set, win.

    None when this is no SLURM task launch: torchrun's variables are set (`srun torchrun ...`:
    torchrun's win), or one task (SLURM_NTASKS=1, or no SLURM_PROCID and at most one
    SLURM_NTASKS, e.g. an salloc shell): a one-process run.  LaunchError, one line naming what is missing or inconsistent, for a
    partial or contradictory set."""
    env = os.environ if env is None else env
    if any(env.get(k, "") != "" for k in TORCHRUN_VARS):
        return None
    got = {k: env.get(k, "") for k in SLURM_TASK_VARS}
    if got["SLURM_PROCID"] == "" and got["SLURM_NTASKS"] in ("", "1"):
        return None
    ints = {}
    for k, v in got.items():
        if v != "":
            try:
                ints[k] = int(v)
            except ValueError:
                raise LaunchError(f"SLURM launch: {k}={v!r} is not an integer") from None
    shown = ", ".join(f"{k}={got[k]}" for k in SLURM_TASK_VARS if got[k] != "")
    missing = [k for k in SLURM_TASK_VARS if k not in ints]
    if missing:
        raise LaunchError(f"SLURM launch ({shown}) without {', '.join(missing)}: start one "
                          "task per GPU with srun (srun python train.py ...), or unset the "
                          "SLURM_* variables for a one-process run")
    rank, world, local = ints["SLURM_PROCID"], ints["SLURM_NTASKS"], ints["SLURM_LOCALID"]
    if world < 1 or not 0 <= rank < world or not 0 <= local < world:
        raise LaunchError(f"SLURM launch ({shown}): inconsistent, SLURM_PROCID and "
                          "SLURM_LOCALID must lie in [0, SLURM_NTASKS)")
    if world == 1:   # one task (e.g. `srun -n1`, a one-task batch script): a one-process run
        return None
    out = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local)}
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    if per_node.isdigit():
        if not local < int(per_node):
            raise LaunchError(f"SLURM launch ({shown}, SLURM_NTASKS_PER_NODE={per_node}): "
                              "SLURM_LOCALID must be < SLURM_NTASKS_PER_NODE")
        out["LOCAL_WORLD_SIZE"] = per_node
    addr = env.get("MASTER_ADDR", "")
    if not addr:
        lists = [k for k in SLURM_NODELIST_VARS if env.get(k, "")]
        if not lists:
            raise LaunchError(f"SLURM launch ({shown}) without SLURM_JOB_NODELIST (or "
                              "SLURM_STEP_NODELIST, MASTER_ADDR): no host to meet on")
        try:
            addr = next(slurm_hosts(env[lists[0]]))
        except ValueError as exc:
            raise LaunchError(f"SLURM launch: {lists[0]}: {exc}") from None
    port = env.get("MASTER_PORT", "")
    if not port:
        job = env.get("SLURM_JOB_ID", "")
        if not job.isdigit():
            raise LaunchError(f"SLURM launch ({shown}) without MASTER_PORT or SLURM_JOB_ID "
                              f"(got {job!r}): no port to meet on")
        port = str(SLURM_PORT_BASE + int(job) % SLURM_PORT_SPAN)
    elif not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"MASTER_PORT={port!r} is not a port number")
    out.update(MASTER_ADDR=addr, MASTER_PORT=port)
    return out


def adopt_slurm_env() -> dict | None:
    """A task of `srun python train.py`: sets torchrun's variables in os.environ from SLURM's
    (slurm_launch_env), so that everything after it (the flags' checks of the world size, the
    process group, the workers per process) sees one run of SLURM_NTASKS processes.  Returns
    what it set (None: not a SLURM task launch; nothing set).  LaunchError as
    slurm_launch_env."""
    found = slurm_launch_env()
    if found:
        os.environ.update(found)
    return found


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> DistInfo:
    """Initialise from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT),
    or from SLURM's for a `srun python train.py` task (adopt_slurm_env: train.py calls it first).

    device: "auto" (cuda:LOCAL_RANK when CUDA is present, else cpu; a process that sees one
    GPU only takes that one), "cpu" or "cuda".  LaunchError (a ValueError) for launcher
    variables that do not fit.
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
        raise LaunchError(f"environment variable WORLD_SIZE must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise LaunchError(f"environment variable RANK must be in [0, WORLD_SIZE = {world}), "
                          f"got {rank}")
    if local_rank < 0:
        raise LaunchError(f"environment variable LOCAL_RANK must be >= 0, got {local_rank}")
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available")
    if use_cuda:
        dev = torch.device("cuda", _gpu_of(local_rank))
        torch.cuda.set_device(dev)
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


def _gpu_of(local_rank: int) -> int:
    """The GPU of the process of LOCAL_RANK: cuda:LOCAL_RANK of the GPUs it sees, or the only one
    it sees (a launcher that binds one GPU to each process: `srun --gpus-per-task=1`,
    CUDA_VISIBLE_DEVICES set per process); LaunchError when it sees several but fewer than
    LOCAL_RANK + 1."""
    count = torch.cuda.device_count()
    if local_rank < count:
        return local_rank
    if count == 1:
        return 0
    raise LaunchError(f"LOCAL_RANK={local_rank}, but this process sees {count} GPUs "
                      f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): at "
                      f"most {count} processes per node, one per GPU")


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
