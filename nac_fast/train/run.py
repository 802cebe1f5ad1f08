"""The parts of a training run that train.py puts together: the data loader, the models and
their optimiser (`build`), one optimizer step (`train_step`), and the checkpoint's contents
(`save`, `resume`).

    st = build(args, dist_info)          # TrainState: everything a step needs
    resume(st, path)                      # exact: weights, queue, optimiser, schedule, RNG
    loss, a = train_step(st, x)           # x: both views of this rank's batch, on the device
    save(st, step)                        # atomic, rank 0 writes every rank's RNG
"""
from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..ops.dispatch import available_backends
from . import distributed as nd
from .checkpoint import (LAST, capture_rng_state, load_checkpoint, restore_rng_state,
                         save_atomic)
from .config import Run, resolve_run
from .lars import LARS, param_groups_for_lars
from .methods import nac_mq_step, nac_step, simclr_step, step_value_checks
from .models import build_model
from .momentum import CodeQueue, ema_update_, make_momentum_copy
from .schedule import WarmupCosine

# Must match for a checkpoint to continue a run exactly.
RESUME_KEYS = ("arch", "method", "batch_size", "code_dim", "data", "world_size", "total_steps",
               "warmup_steps", "queue_size", "seed")


@dataclass
class TrainState:
    args: Any
    di: Any                         # nac_fast.train.distributed.DistInfo
    run: Run
    cfg: dict                       # flags + run values: config.json and every checkpoint
    loader: Any
    model: torch.nn.Module          # the plain online model (what checkpoints hold)
    net: torch.nn.Module            # what the step calls: model under DDP / torch.compile
    optimizer: torch.optim.Optimizer
    sched: Any
    scaler: Any
    autocast: Any
    mom_model: torch.nn.Module | None = None
    queue: CodeQueue | None = None
    step: int = 0
    extras: dict = field(default_factory=dict)

    @property
    def ckpt_path(self) -> str:
        return os.path.join(self.args.out, LAST)


def build_loader(args, di, channels_last: bool):
    per_rank = args.batch_size // di.world_size
    if args.data.startswith("synthetic"):
        from ..data.sources.synthetic_pairs import SyntheticPairLoader
        n = int(args.data.split(":", 1)[1]) if ":" in args.data else 4096
        return SyntheticPairLoader(n, per_rank, di.rank, di.world_size, args.seed,
                                   image_size=args.image_size or 32, device=di.device,
                                   channels_last=channels_last)
    if args.data != "fashion-mnist" and not os.path.exists(args.data):
        raise ValueError(f"--data {args.data!r}: no such file or directory (expected "
                         "fashion-mnist, a CIFAR-10 python dir, an ImageFolder root or synthetic)")
    try:
        from ..data import build_pretrain_loader
    except ImportError as exc:
        raise ValueError(f"the data loaders (nac_fast.data) cannot be imported: {exc}") from exc
    if args.workers is None:
        cpus = (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        workers = 0 if di.device.type == "cpu" else max(0, min(8, cpus - 1))
    else:
        workers = args.workers
    try:
        return build_pretrain_loader(data=args.data, batch_size=per_rank, rank=di.rank,
                                     world_size=di.world_size, seed=args.seed,
                                     image_size=args.image_size, loader=args.loader,
                                     num_workers=workers, device=str(di.device),
                                     channels_last=channels_last, dtype=torch.float32,
                                     on_bad_file=args.on_bad_file)
    except (FileNotFoundError, ValueError) as exc:
        # nac_fast.data's messages say how to get the data (e.g. the Debian package)
        raise ValueError(f"--data {args.data!r}: {exc}") from exc


def build(args, di) -> TrainState:
    """Everything a run needs, on this rank; ValueError (naming the flag) for what the flags and
    the data do not allow, before any training."""
    if args.loss_backend != "auto" and args.loss_backend not in available_backends(di.device):
        raise ValueError(f"--loss-backend {args.loss_backend} is not available for "
                         f"{di.device.type} tensors in this install; available: "
                         f"{available_backends(di.device)}")
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    loader = build_loader(args, di, args.channels_last)
    if loader.num_images < args.batch_size:
        raise ValueError(f"--batch-size {args.batch_size} is larger than the data set "
                         f"({loader.num_images} images)")
    if len(loader) < 1:
        raise ValueError(f"--batch-size {args.batch_size} leaves no full batch per rank")
    run = resolve_run(args, len(loader), loader.image_size, di.device.type)
    cfg = dict(vars(args), world_size=di.world_size, **asdict(run), channels_last=args.channels_last,
               image_size=loader.image_size, in_channels=loader.in_channels,
               num_images=loader.num_images)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(run.amp)

    model = build_model(args.arch, loader.in_channels, loader.image_size, args.code_dim,
                        inference_net=args.method != "simclr", scale_codes=args.scale_codes)
    model.to(di.device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    mom_model = queue = None
    if args.method == "nac-mq":
        mom_model = make_momentum_copy(model)  # before SyncBN: the key branch uses shuffle BN
        # codes stored in the loss's dtype (bf16 under the GPU's default AMP): the loss reads the
        # queue as it is, with no per-step conversion of M x D elements
        queue = CodeQueue(run.queue_size, args.code_dim, device=di.device,
                          dtype=amp_dtype or torch.float32)
    # From here on each rank draws its own channel noise (the loader seeds itself)
    torch.manual_seed(args.seed * 1000 + 1 + di.rank)
    if args.sync_bn:
        model = nd.convert_sync_bn(model)
    optimizer = LARS(param_groups_for_lars(model, args.wd), lr=run.lr, momentum=0.9,
                     weight_decay=args.wd, trust_coefficient=0.001)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                              WarmupCosine(run.warmup_steps, run.total_steps))
    scaler = torch.amp.GradScaler(di.device.type, enabled=run.amp == "fp16")
    net = model
    if nd.is_dist():
        # BN running statistics stay per rank (no broadcast each forward): they only matter for
        # evaluation, where rank 0's are saved.  The flag was renamed in recent torch.
        ddp_kw = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                  inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
                  else {"broadcast_buffers": False})
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[di.local_rank] if di.device.type == "cuda" else None,
            gradient_as_bucket_view=True, **ddp_kw)
    if args.compile:
        net = torch.compile(net)
    autocast = (torch.autocast(di.device.type, dtype=amp_dtype) if amp_dtype is not None
                else contextlib.nullcontext())
    return TrainState(args=args, di=di, run=run, cfg=cfg, loader=loader, model=model, net=net,
                      optimizer=optimizer, sched=sched, scaler=scaler, autocast=autocast,
                      mom_model=mom_model, queue=queue)


def train_step(st: TrainState, x: torch.Tensor):
    """One optimizer step on this rank's batch x (both views, on the device): the method's loss
    forward (under autocast) and backward, the LARS update, the lr schedule and the EMA of the
    momentum model.  Returns (loss, a), detached device tensors.

    No host sync: the loss-input value checks are off here (`step_value_checks`; the caller
    checks the loss, which NaN/inf inputs reach), scalars stay Python numbers, and nothing reads
    device data (tests/test_sync_free.py runs this function under a dispatch mode that fails on
    any host read).  The only exception is fp16 AMP: GradScaler.step reads its inf flag."""
    a_ = st.args
    with step_value_checks(), st.autocast:
        if a_.method == "nac":
            loss, a = nac_step(st.net, x, a_.p, backend=a_.loss_backend)
        elif a_.method == "nac-mq":
            loss, a = nac_mq_step(st.net, st.mom_model, st.queue, x, a_.p, a_.l2,
                                  shuffle_bn=a_.shuffle_bn, backend=a_.loss_backend)
        else:
            loss, a = simclr_step(st.net, x, a_.tau)
    st.optimizer.zero_grad(set_to_none=True)
    st.scaler.scale(loss).backward()
    st.scaler.step(st.optimizer)
    st.scaler.update()
    st.sched.step()
    if st.mom_model is not None:
        ema_update_(st.mom_model, st.model, st.run.momentum)  # after the optimizer step
    return loss.detach(), a.detach()


def save(st: TrainState, step: int) -> None:
    """Checkpoint the run at `step` (a collective: every rank's RNG goes to rank 0, which
    writes)."""
    rng = nd.gather_objects(capture_rng_state())
    if st.di.is_main:
        spe = st.run.steps_per_epoch
        state = {"model": st.model.state_dict(), "optimizer": st.optimizer.state_dict(),
                 "momentum_model": st.mom_model.state_dict() if st.mom_model else None,
                 "queue": st.queue.state_dict() if st.queue is not None else None,
                 "scheduler": st.sched.state_dict(), "scaler": st.scaler.state_dict(),
                 "step": step, "epoch": step // spe, "batch": step % spe, "rng": rng,
                 "config": st.cfg}
        save_atomic(state, st.ckpt_path)
    nd.barrier()


def resume(st: TrainState, path: str) -> dict:
    """Continue the run saved at `path` exactly; ValueError naming what does not match."""
    ck = load_checkpoint(path, map_location="cpu")  # RNG states must stay CPU tensors
    old = ck["config"]
    for k in RESUME_KEYS:
        if old[k] != st.cfg[k]:
            raise ValueError(f"--resume {path}: checkpoint has {k}={old[k]!r}, this run "
                             f"{st.cfg[k]!r}")
    st.model.load_state_dict(ck["model"])
    if st.mom_model is not None:
        st.mom_model.load_state_dict(ck["momentum_model"])
        st.queue.load_state_dict(ck["queue"])
    st.optimizer.load_state_dict(ck["optimizer"])
    st.sched.load_state_dict(ck["scheduler"])
    st.scaler.load_state_dict(ck["scaler"])
    st.step = ck["step"]
    restore_rng_state(ck["rng"][st.di.rank])
    return ck
