"""The parts of a training run that train.py puts together: where the run may write and start
(`plan_start`, before the data is read), the data loader, the models and their optimiser
(`build`), the start itself (`start`, `resume`), one optimizer step (`train_step`), the
checkpoint's contents (`save`), the stop on a non-finite loss, and how every run ends (`finish`).

    plan = plan_start(cfg, dist_info)    # refuses an --out that holds another run or is not writable
    st = build(cfg, dist_info)           # TrainState: everything a step needs
    start(st, plan)                      # --resume, or by itself after an elastic restart
    loss, a = train_step(st, x)          # x: both views of this rank's batch, on the device
    save(st)                             # atomic, rotated; rank 0 writes every rank's RNG
    stop_non_finite(st, bad)             # RunStopped(EXIT_NON_FINITE), as a failed save (4)
    return finish(status, message, di, st)   # the message once, the status line, status.json

Fault tolerance (docs/training.md "Fault tolerance"): a restarted torchrun worker group resumes
from the newest good checkpoint in --out (last.pt, else prev.pt), a failed save stops every rank
with EXIT_UNWRITABLE and the previous checkpoints intact, a non-finite loss stops with
EXIT_NON_FINITE and is recorded in OUT/non_finite.json so that a restart does not replay it.
"""
from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import math
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from .. import _checks
from ..ops.dispatch import available_backends
from ..ops.loss import mq_l2
from ..ops.momentum import NACMQ
from ..ops.queue import CodeQueue
from . import distributed as nd
from .checkpoint import (CONFIG, LAST, PREV, STATE_KEYS, BackgroundSave, capture_rng_state,
                         load_checkpoint, pick_checkpoint, plain_state_dict, read_json,
                         remove_stale_temp_files, restore_rng_state, save_atomic,
                         write_json_atomic)
from .config import TrainConfig, UsageError, default_workers, hash_subset, resolve
from .lars import LARS, param_groups_for_lars
from .methods import nac_mq_step, nac_step, simclr_step, step_value_checks
from .models import build_model, model_kwargs_from_config
from .monitor import TENSORBOARD
from .schedule import flip_prob_at, get_lr, p_schedule_applies, p_schedule_shortfalls

# Must match for a checkpoint to continue a run exactly; except that total_steps may grow (an
# extended run, see `resume`) and warmup_steps is the checkpoint's unless --warmup-epochs is given.
# The images trained on are part of it (their number, --train-subset and its split's digest);
# the augmentation flags (--image-size, --crop-scale) are not: a resumed run takes the values
# given and records them in config.json and its checkpoints (an --image-size that changes a
# ResNet's stem no longer fits the weights: `resume` says so).
# The number of processes is not among them: a run resumes on another world size when the
# global batch divides by it (`resume`: the elastic resize).
RESUME_KEYS = ("arch", "method", "batch_size", "code_dim", "data", "total_steps",
               "warmup_steps", "queue_size", "seed", "train_subset", "train_subset_sha256",
               "num_images", "self_key", "noise_draws")
# What a checkpoint written before a key existed had (its value then)
RESUME_DEFAULTS = {"train_subset": "all", "train_subset_sha256": None, "self_key": "include",
                   "noise_draws": 1}
# The model the checkpoint's weights are, beyond arch, method and code_dim: a run that builds
# another fails to load them (other state keys) or, with the same keys, records them as a model
# they are not (evaluation builds the model from the config).  The gains count while fixed
# (learn_gain false); learnable ones are parameters, and infer_init, an initialisation, is not.
RESUME_MODEL_KEYS = ("head_bn", "infer_bn", "learn_gain", "scale_codes")
RESUME_GAIN_KEYS = ("a_gain", "r_gain")
EXIT_USAGE = 2          # train.py's status for bad flags, recipe, data, --out or checkpoint
EXIT_NON_FINITE = 3     # ... when a non-finite loss stopped the run
EXIT_UNWRITABLE = 4     # ... when --out or a checkpoint in it could not be written
EXIT_MEANING = {0: "done", 1: "error", EXIT_USAGE: "bad flags, recipe, data, --out or checkpoint",
                EXIT_NON_FINITE: "non-finite loss", EXIT_UNWRITABLE: "--out could not be written"}
LOG = "log.jsonl"
NON_FINITE = "non_finite.json"   # OUT/non_finite.json: where and when a run hit one
STATUS = "status.json"           # OUT/status.json: how the run ended (null while it runs)
# What a run writes in --out and --overwrite deletes (config.json is rewritten at the start)
RUN_FILES = (LAST, PREV, LOG, NON_FINITE, STATUS)


class RunStopped(Exception):
    """The run must not go on: train.py prints the message and exits with `status`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class TrainState:
    cfg: TrainConfig                # the resolved configuration: config.json and every checkpoint
    di: Any                         # nac_fast.train.distributed.DistInfo
    loader: Any
    model: torch.nn.Module          # the plain online model (what checkpoints hold)
    net: torch.nn.Module            # what the step calls: model (nac-mq: mq), under DDP
    optimizer: torch.optim.Optimizer
    scaler: Any
    autocast: Any
    mom_model: torch.nn.Module | None = None  # nac-mq: the NACMQ's momentum_model
    queue: CodeQueue | None = None            # nac-mq: the NACMQ's queue
    mq_criterion: Any = None                  # nac-mq: the NACMQ's NACMQLoss (its p follows
                                              # the run's p schedule, train_step)
    step: int = 0                   # optimizer steps taken (the next update's 0-based index)
    resumed_from: str | None = None  # the checkpoint this process started from
    saved: tuple | None = None       # (path, step): the newest good checkpoint of this run
    rotate: bool = False             # OUT/last.pt is a good checkpoint of this run: keep it as
                                     # prev.pt at the next save (else the save replaces it)
    saver: Any = None                # rank 0, --save-mode async: the BackgroundSave writing
                                     # checkpoints (its write in flight: `save`, `settle_save`)
    last_r: Any = None               # the last step's inference logits (detached), for the log
    compiled: str | None = None      # what --compile compiled (compile_encoders), or None
    listing: Any = None              # the data's Listing (data_listing): its scan is cached at
                                     # `start`, once the run has begun
    began: bool = False              # `start` wrote OUT/config.json and status.json: how the
                                     # run ends is recorded there (finish), whatever the failure
    elapsed_before: float = 0.0      # seconds the run trained before this process (the resumed
                                     # checkpoint's elapsed_s), so the log's time goes on
    t_start: float | None = None     # time.perf_counter() when this process's loop began

    def elapsed(self) -> float:
        """Seconds the run has trained: before this process, and in its loop so far."""
        return self.elapsed_before + (0.0 if self.t_start is None
                                      else time.perf_counter() - self.t_start)

    @property
    def ckpt_path(self) -> str:
        return os.path.join(self.cfg.out, LAST)

    @property
    def prev_path(self) -> str:
        return os.path.join(self.cfg.out, PREV)


def build_loader(cfg: TrainConfig, di, channels_last: bool, listing=None):
    per_rank = cfg.batch_size // di.world_size
    if cfg.data.startswith("synthetic"):
        if cfg.train_subset != "all":
            raise UsageError(f"--train-subset {cfg.train_subset}: --data {cfg.data} has no "
                             "classes and no test split to pool (a labelled data set: "
                             "fashion-mnist, a CIFAR-10 dir, an ImageFolder root)")
        if cfg.loader.startswith("dali"):   # as an in-memory data set refuses it
            raise UsageError(f"--loader {cfg.loader}: DALI reads ImageFolders of JPEG/PNG files; "
                             f"--data {cfg.data} generates its pairs in memory (use --loader "
                             "auto or torchvision)")
        from ..data.sources.synthetic_pairs import SyntheticPairLoader
        head, _, count = cfg.data.partition(":")
        try:
            if head != "synthetic":
                raise ValueError("expected synthetic or synthetic:N")
            n = int(count) if count else 4096
            if n < 1:
                raise ValueError(f"N must be a positive integer, got {n}")
            # generated patterns with random shifts, not crops: --crop-scale does not apply
            return SyntheticPairLoader(n, per_rank, di.rank, di.world_size, cfg.seed,
                                       image_size=cfg.image_size or 32, device=di.device,
                                       channels_last=channels_last)
        except ValueError as exc:
            why = (f"N must be a positive integer, got {count!r}" if "invalid literal" in
                   str(exc) else str(exc))
            raise UsageError(f"--data {cfg.data!r}: synthetic[:N] ({why})") from exc
    if cfg.data != "fashion-mnist" and not os.path.exists(cfg.data):
        raise UsageError(f"--data {cfg.data!r}: no such file or directory (expected "
                         "fashion-mnist, a CIFAR-10 python dir, an ImageFolder root or synthetic)")
    try:
        from ..data import ImageSizeError, build_pretrain_loader
        from ..data.sources.subset import SubsetSizeError
    except ImportError as exc:
        raise UsageError(f"the data loaders (nac_fast.data) cannot be imported: {exc}") from exc
    try:
        return build_pretrain_loader(data=cfg.data, batch_size=per_rank, rank=di.rank,
                                     world_size=di.world_size, seed=cfg.seed,
                                     image_size=cfg.image_size, loader=cfg.loader,
                                     num_workers=default_workers(cfg, di.device.type),
                                     device=str(di.device), channels_last=channels_last,
                                     dtype=torch.float32, on_bad_file=cfg.on_bad_file,
                                     scale=cfg.crop_scale, subset=hash_subset(cfg),
                                     val_labels=cfg.val_labels,
                                     listing=listing or data_listing(cfg, di))
    except SubsetSizeError as exc:
        raise UsageError(f"--train-subset {cfg.train_subset} --queries-per-class "
                         f"{cfg.queries_per_class} --train-per-class {cfg.train_per_class}: too "
                         f"many for --data {cfg.data!r} ({exc}); lower them") from exc
    except ImageSizeError as exc:  # typed, or read from the images: the same rule (>= 8)
        read = (f" (read from --data {cfg.data!r}: the median short side of its images; give "
                "--image-size to resize them)" if exc.from_data else "")
        raise UsageError(f"--image-size must be >= 8, got {exc.size}{read}") from exc
    except (FileNotFoundError, ValueError) as exc:
        # nac_fast.data's messages say how to get the data (e.g. the Debian package)
        raise UsageError(f"--data {cfg.data!r}: {exc}") from exc


def data_listing(cfg: TrainConfig, di):
    """An ImageFolder listed once per run: rank 0 scans it (or reuses its scan cached in --out,
    while the folder is unchanged) and broadcasts the file list to the other ranks
    (nac_fast/data/sources/listing.py).  A new scan is cached once the run has begun (`start`
    flushes it): a run refused at its start leaves --out as it was."""
    from ..data.sources import Listing
    return Listing(cache_dir=cfg.out, first=di.is_main, defer=True,
                   broadcast=nd.broadcast_object if nd.is_dist() else None)


def subset_digest(cfg: TrainConfig) -> str | None:
    """The --train-subset's indices_digest (None: the whole training split): what config.json
    records and what python -m nac_fast.eval --hash-protocol paper checks its split against."""
    subset = hash_subset(cfg)
    if subset is None:
        return None
    from ..data.sources import hash_subset_indices
    from ..data.sources.subset import indices_digest
    return indices_digest(hash_subset_indices(cfg.data, subset, val_labels=cfg.val_labels))


def _split_hint(data: str) -> str:
    """For a bare folder that is the train/ of an ImageFolder root: how to use the root."""
    parent = os.path.dirname(os.path.abspath(data))
    if any(os.path.isdir(os.path.join(parent, s)) for s in ("val", "test")) and \
            os.path.basename(os.path.abspath(data)) == "train":
        return f" (to train on all of it and evaluate on the split beside it: --data {parent})"
    return ""


def build(cfg: TrainConfig, di) -> TrainState:
    """Everything a run needs, on this rank, with the configuration resolved (config.resolve);
    UsageError (naming the flag) for what the flags and the data do not allow, before any
    training."""
    if cfg.loss_backend != "auto" and cfg.loss_backend not in available_backends(di.device):
        raise UsageError(f"--loss-backend {cfg.loss_backend} is not available for "
                         f"{di.device.type} tensors in this install; available: "
                         f"{available_backends(di.device)}")
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    listing = data_listing(cfg, di)
    loader = build_loader(cfg, di, cfg.channels_last, listing)
    if loader.num_images < cfg.batch_size:
        raise UsageError(f"--batch-size {cfg.batch_size} is larger than the data set "
                         f"({loader.num_images} images)")
    if len(loader) < 1:
        raise UsageError(f"--batch-size {cfg.batch_size} leaves no full batch per rank")
    held_out = getattr(getattr(loader, "source", None), "held_out", 0)
    if cfg.train_subset != "all":
        print_main(di, f"data: {cfg.data}, --train-subset {cfg.train_subset}: training on "
                       f"{loader.num_images} images, {cfg.train_per_class} per class from the "
                       f"gallery of the pooled training and test splits ({cfg.queries_per_class} "
                       f"queries per class held out, --split-seed {cfg.split_seed}; docs/math.md "
                       "[M:hash-split]); evaluate with python -m nac_fast.eval --hash-protocol "
                       "paper")
    if held_out:
        from ..data.sources.imagefolder import HOLDOUT_FRACTION
        print_main(di, f"data: {cfg.data} is a folder of class folders without train/ and val/: "
                       f"training on {loader.num_images} of its images; the other {held_out} "
                       f"({HOLDOUT_FRACTION:.0%} of each class, chosen by file name) are its "
                       f"test split, held out for python -m nac_fast.eval{_split_hint(cfg.data)}")
    cfg = resolve(cfg, world_size=di.world_size, device_type=di.device.type,
                  steps_per_epoch=len(loader), image_size=loader.image_size,
                  in_channels=loader.in_channels, num_images=loader.num_images,
                  train_subset_sha256=subset_digest(cfg))
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)

    model = build_model(**model_kwargs_from_config(cfg.to_dict()))  # with the head options
    model.to(di.device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    mq = None
    if cfg.method == "nac-mq":
        # before SyncBN: the key branch keeps BatchNorm for shuffle BN (--momentum-bn sync:
        # NACMQ converts its copy itself).  Codes stored in the loss's dtype (bf16
        # under the GPU's default AMP): the loss reads the queue as it is, with no per-step
        # conversion of M x D elements
        mq = NACMQ(model, queue_size=cfg.queue_size, code_dim=cfg.code_dim, p=cfg.flip_prob,
                   l2=cfg.l2, momentum=cfg.momentum, momentum_bn=cfg.momentum_bn,
                   shuffle_bn=cfg.shuffle_bn if cfg.momentum_bn == "shuffle" else None,
                   queue_dtype=amp_dtype or torch.float32, backend=cfg.loss_backend,
                   likelihood=cfg.channel_likelihood)
    # From here on each rank draws its own channel noise (the loader seeds itself)
    torch.manual_seed(cfg.seed * 1000 + 1 + di.rank)
    if cfg.sync_bn:
        model = nd.convert_sync_bn(model)
        if mq is not None:
            mq.model = model  # the online model only: the momentum copy keeps its BatchNorm
    # the lr is set before every update (train_step: schedule.get_lr of the step)
    optimizer = LARS(param_groups_for_lars(model, cfg.wd), lr=cfg.lr, momentum=0.9,
                     weight_decay=cfg.wd, trust_coefficient=0.001)
    scaler = torch.amp.GradScaler(di.device.type, enabled=cfg.amp == "fp16")
    # after SyncBN (the modules it replaces) and before the first forward
    compiled = compile_encoders(cfg, model, None if mq is None else mq.momentum_model)
    net = model if mq is None else mq
    if nd.is_dist():
        # BN running statistics stay per rank (no broadcast each forward): they only matter for
        # evaluation, where rank 0's are saved.  The flag was renamed in recent torch.
        ddp_kw = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                  inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
                  else {"broadcast_buffers": False})
        # --infer-warmup-steps: during the warm-up the encoder and code head get no gradient,
        # which DDP's reducer refuses unless told to look for unused parameters (their .grad
        # stays None, as in one process); the search costs a graph walk per step, so only then.
        net = torch.nn.parallel.DistributedDataParallel(  # nac-mq: around the NACMQ (MoCo)
            net, device_ids=[di.device.index] if di.device.type == "cuda" else None,
            gradient_as_bucket_view=True, find_unused_parameters=cfg.infer_warmup_steps > 0,
            **ddp_kw)
    autocast = (torch.autocast(di.device.type, dtype=amp_dtype) if amp_dtype is not None
                else contextlib.nullcontext())
    return TrainState(cfg=cfg, di=di, loader=loader, model=model, net=net, optimizer=optimizer,
                      scaler=scaler, autocast=autocast,
                      mom_model=None if mq is None else mq.momentum_model,
                      queue=None if mq is None else mq.queue,
                      mq_criterion=None if mq is None else mq.criterion, compiled=compiled,
                      listing=listing)


def compile_encoders(cfg: TrainConfig, model: torch.nn.Module, mom_model) -> str | None:
    """--compile: torch.compile of the encoders, in place (nn.Module.compile: the modules, their
    state dicts and checkpoints keep their keys, no "_orig_mod." wrapper), fixed shapes
    (dynamic=False: every step has the same batch), inductor's default mode (no autotuning):

      model.encoder      the online ResNet: one graph, forward and backward (AOTAutograd)
      mom_model.encoder  NAC-MQ's momentum ResNet: its forward under torch.no_grad, a graph of
                         its own (nothing saved for a backward)

    The heads (two small MLPs), the loss (its own fused kernels), LARS, the EMA and the queue
    stay eager: they are a few launches each (foreach ops).  DDP wraps the module as before; the
    compiled encoder's backward is one autograd node, so DDP's gradient buckets become ready
    when it ends.  Compilation happens at the first step (train.py times it and prints the cost).
    Returns what is compiled, for the start line (None: nothing)."""
    if not cfg.compile:
        return None
    kw = dict(backend=cfg.compile_backend, dynamic=False)
    model.encoder.compile(**kw)
    parts = ["online encoder fwd+bwd"]
    if mom_model is not None:
        mom_model.encoder.compile(**kw)
        parts.append("momentum encoder fwd (no grad)")
    return f"{cfg.compile_backend}: {', '.join(parts)}"


def prepare_batch(st: TrainState, v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
    """A loader's two views as the step's x = cat([v1, v2]) on the device (channels-last when
    the run is): each view goes to the device first (a cat of pinned host tensors would be
    pageable), without waiting for the copy."""
    dev = st.di.device
    x = torch.cat([v1.to(dev, non_blocking=True), v2.to(dev, non_blocking=True)])
    if st.cfg.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The lr of the update at optimizer step `step` (0-based): schedule.get_lr over the run's
    warm-up and total (an extended run: the new total from its checkpoint's step on)."""
    return get_lr(step, cfg.lr, cfg.warmup_steps, cfg.total_steps)


def flip_prob_of(cfg: TrainConfig, step: int) -> float:
    """The channel's p at optimizer step `step` (0-based): schedule.flip_prob_at over the run's
    total; constant without --flip-prob-final, or in a run shorter than
    --flip-prob-final-min-steps or seeing fewer images than --flip-prob-final-min-images
    (docs/math.md [M:p-schedule])."""
    on = p_schedule_applies(cfg.flip_prob_final, cfg.flip_prob_final_min_steps, cfg.total_steps,
                            cfg.flip_prob_final_min_images, cfg.batch_size)
    return flip_prob_at(step, cfg.flip_prob, cfg.flip_prob_final if on else None,
                        cfg.total_steps)


def describe_p(cfg: TrainConfig) -> str:
    """The channel's p over the run, for the start line: '0.25', '0.25->0.4', or '0.25' with the
    thresholds the run falls short of ([M:p-schedule])."""
    p0, p1 = cfg.flip_prob, cfg.flip_prob_final
    if p1 is None:
        return f"{p0:g}"
    short = p_schedule_shortfalls(cfg.flip_prob_final_min_steps, cfg.total_steps,
                                  cfg.flip_prob_final_min_images, cfg.batch_size)
    return f"{p0:g} (not rising to {p1:g}: {', '.join(short)})" if short else f"{p0:g}->{p1:g}"


def describe_l2(cfg: TrainConfig) -> str:
    """NAC-MQ's lambda for the start line: '0.1', or 'auto' with its value at the run's first p
    (and last, when p rises); a fixed lambda at or above the channel's capacity per bit at the
    run's largest p, ln 2 - H(p), says that the zero code is then the loss's optimum
    ([M:mq-l2])."""
    p0, p1 = flip_prob_of(cfg, 0), flip_prob_of(cfg, max(cfg.total_steps - 1, 0))
    if cfg.l2 == "auto":
        return "auto (" + f"{mq_l2(p0):.3g}" + (f"->{mq_l2(p1):.3g}" if p1 != p0 else "") + ")"
    pmax = max(p0, p1)
    capacity = math.log(2) + pmax * math.log(pmax) + (1 - pmax) * math.log(1 - pmax)
    if cfg.l2 > 0 and cfg.l2 >= capacity:
        return (f"{cfg.l2:g} (warning: >= ln 2 - H(p) = {capacity:.3g} at p = {pmax:g}, what a "
                "bit can gain through the channel: the zero code is the loss's optimum; "
                "--l2 auto or 0, docs/math.md [M:mq-l2])")
    return f"{cfg.l2:g}"


def train_step(st: TrainState, x: torch.Tensor):
    """One optimizer step on this rank's batch x (both views, on the device): the method's loss
    forward (under autocast) and backward, the LARS update at the lr of this step (`lr_at`);
    st.step counts it. The EMA of the momentum model is made by the NACMQ call, before its loss.
    Returns (loss, a), detached device tensors.

    No host sync: the loss-input value checks are off here (`step_value_checks`; the caller
    checks the loss, which NaN/inf inputs reach), scalars stay Python numbers, and nothing reads
    device data (tests/test_sync_free.py runs this function under a dispatch mode that fails on
    any host read).  The only exception is fp16 AMP: GradScaler.step reads its inf flag."""
    a_ = st.cfg
    # r for the log's statistics (st.last_r); the inference net's warm-up: st.step is the number
    # of optimizer steps taken (a Python int, restored on resume)
    out, frozen = {}, st.step < a_.infer_warmup_steps
    # the channel's p of this step (--flip-prob-final: a schedule, [M:p-schedule])
    p = flip_prob_of(a_, st.step)
    with step_value_checks(), st.autocast:
        if a_.method == "nac":
            loss, a = nac_step(st.net, x, p, backend=a_.loss_backend, out=out,
                               freeze_codes=frozen, likelihood=a_.channel_likelihood,
                               self_key=a_.self_key, noise_draws=a_.noise_draws)
        elif a_.method == "nac-mq":
            st.mq_criterion.p = p
            loss, a = nac_mq_step(st.net, x, out=out, freeze_codes=frozen)
        else:
            loss, a = simclr_step(st.net, x, a_.tau)
    st.last_r = out.get("r")
    st.optimizer.zero_grad(set_to_none=True)
    st.scaler.scale(loss).backward()
    lr = lr_at(a_, st.step)
    for g in st.optimizer.param_groups:
        g["lr"] = lr
    st.scaler.step(st.optimizer)
    st.scaler.update()
    st.step += 1
    return loss.detach(), a.detach()


def print_main(di, *a, **k) -> None:
    if di.is_main:
        print(*a, **k, flush=True)


def save(st: TrainState) -> None:
    """Checkpoint the run at st.step (a collective: every rank's RNG goes to rank 0, which writes
    OUT/last.pt, the previous one becoming OUT/prev.pt).  RunStopped(EXIT_UNWRITABLE) on every
    rank when the write failed (disk full, unwritable --out, ...): the message names the file and
    the cause, and the checkpoints already there are left intact (checkpoint.save_atomic).

    --save-mode async (the default): rank 0 waits for the previous save's background write (the
    only wait the ranks share; its failure stops the run here), copies the state to host memory
    (BackgroundSave.snapshot) and hands it to a background thread, and the steps go on while it is
    written; the run's last save (its final step, or --stop-at-step) waits for its write.
    --save-mode sync: every rank waits until rank 0 has written the file."""
    rng = nd.gather_objects(capture_rng_state())
    step = st.step
    failed = None  # rank 0: (step, error) of a checkpoint that could not be written
    if st.di.is_main:
        failed = settle_save(st)  # async: the previous save's write
        if failed is None:
            spe = st.cfg.steps_per_epoch
            state = {"model": st.model.state_dict(), "optimizer": st.optimizer.state_dict(),
                     "momentum_model": st.mom_model.state_dict() if st.mom_model else None,
                     "queue": st.queue.state_dict() if st.queue is not None else None,
                     "scaler": st.scaler.state_dict(), "step": step, "epoch": step // spe,
                     "batch": step % spe, "rng": rng, "config": st.cfg.to_dict(),
                     "elapsed_s": st.elapsed()}
            previous = st.prev_path if st.rotate else None
            if st.cfg.save_mode == "sync":
                try:
                    save_atomic(state, st.ckpt_path, previous=previous)
                except Exception as exc:  # noqa: BLE001  (any failure to write stops the run alike)
                    failed = (step, f"{type(exc).__name__}: {exc}")
                else:
                    st.saved, st.rotate = (st.ckpt_path, step), True
            else:
                if st.saver is None:
                    st.saver = BackgroundSave()
                st.saver.start(st.saver.snapshot(state), st.ckpt_path, previous=previous,
                               label=step)
                if step >= _last_step(st.cfg):  # the run's end: its checkpoint is on disk
                    failed = settle_save(st)
    # also the barrier: no rank goes on before rank 0's file is there (async: the previous one)
    failed, st.saved = nd.broadcast_object((failed, st.saved))
    if failed is not None:
        kept = (f"{st.saved[0]} (step {st.saved[1]}) is intact" if st.saved else
                "this run has no checkpoint yet")
        raise RunStopped(EXIT_UNWRITABLE,
                         f"checkpoint of step {failed[0]} could not be written to {st.ckpt_path}: "
                         f"{failed[1]}; stopping (status {EXIT_UNWRITABLE}); {kept}. Free space "
                         f"or fix --out, then continue with --resume.")


def settle_save(st: TrainState):
    """Rank 0, --save-mode async: wait for the background write in flight (if any) and take its
    outcome: (step, error) when it failed, else None (st.saved is then its checkpoint).  Not a
    collective: `save` shares the result with the other ranks."""
    out = st.saver.wait() if st.saver is not None else None
    if out is None:
        return None
    if out.error is not None:
        return out.label, f"{type(out.error).__name__}: {out.error}"
    st.saved, st.rotate = (out.path, out.label), True
    return None


def _last_step(cfg: TrainConfig) -> int:
    """The step after which train.py's loop ends (--stop-at-step, else the schedule's end)."""
    return min(cfg.total_steps, cfg.stop_at_step or cfg.total_steps)


def stop_non_finite(st: TrainState, bad: tuple) -> None:
    """The stop on the first non-finite loss `bad` = (its step, its value), found at st.step:
    OUT/non_finite.json (rank 0) so that an elastic restart of this job does not replay it
    (start), and RunStopped(EXIT_NON_FINITE) with the message.  No checkpoint is written after
    it: the caller checks before each save."""
    step = st.step
    later = f" (found at step {step})" if bad[0] != step else ""
    unsaved = settle_save(st) if st.di.is_main else None  # a save before it, still being written
    kept = f"{st.saved[0]} (step {st.saved[1]})" if st.saved else "none"
    if unsaved is not None:
        kept += f" (the checkpoint of step {unsaved[0]} could not be written: {unsaved[1]})"
    if st.di.is_main:
        try:
            write_json_atomic({"step": bad[0], "loss": repr(bad[1]), "found_at": step,
                               "checkpoint": kept, "run_id": st.cfg.run_id,
                               "elastic_run_id": st.cfg.elastic_run_id},
                              os.path.join(st.cfg.out, NON_FINITE))
        except OSError as exc:  # the stop itself does not depend on it
            print(f"({NON_FINITE} not written: {exc})", file=sys.stderr)
    raise RunStopped(EXIT_NON_FINITE, f"non-finite loss ({bad[1]}) at step {bad[0]}{later}; "
                                      f"stopping. Last good checkpoint kept: {kept}")


def is_restart(owner: dict, restart: int, job) -> bool:
    """Whether this worker group continues a torchrun job that already started training in --out:
    OUT/config.json (`owner`) records the job's id (TORCHELASTIC_RUN_ID, `job`: --rdzv_id, or a
    fresh one per launch with --standalone).  TORCHELASTIC_RESTART_COUNT (`restart`) alone is not
    enough: each node's agent counts only its own failures, so after another node failed (or was
    replaced) the workers here start with a count of 0.  Under torchrun's static rendezvous the id
    is always "none": there, a count > 0 is required too."""
    if job is None or owner.get("elastic_run_id") != job:
        return False
    return restart > 0 or job != "none"


def run_files(out: str) -> list:
    """The files in `out` that make it hold a run: a checkpoint, or a log with a record."""
    found = [n for n in (LAST, PREV) if os.path.lexists(os.path.join(out, n))]
    try:
        if os.path.getsize(os.path.join(out, LOG)) > 0:
            found.append(LOG)
    except OSError:
        pass
    return found


def check_writable(out: str) -> tuple:
    """RunStopped(EXIT_UNWRITABLE), one line naming the folder, when `out` cannot be created or
    written (read-only file system, permissions, a file in the way): probed with a temp file.
    Returns the folders it created, deepest first (`remove_unused_out` takes them away again
    when the run stops before it begins)."""
    created, d = [], os.path.abspath(out)
    while not os.path.lexists(d):  # (the file system's root exists: the loop ends there)
        created.append(d)
        d = os.path.dirname(d)
    try:
        os.makedirs(out, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tmp-probe.", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise RunStopped(EXIT_UNWRITABLE, f"--out {out!r} cannot be written ({why}); nothing "
                                          "was written. Choose a writable --out.") from exc
    return tuple(created)


def remove_unused_out(created) -> None:
    """Remove the folders `check_writable` created for a run that stopped before it began (bad
    data, a model that does not fit): an empty --out left behind is a half-made run.  A folder
    that is no longer empty (something else wrote there) is kept; the data list that rank 0
    cached there (data_list-*.json.gz, `data_listing`) goes with it."""
    from ..data.sources.listing import CACHE_PREFIX
    for d in created[:1]:           # deepest first: --out itself
        with contextlib.suppress(OSError):
            for name in os.listdir(d):
                if name.startswith(CACHE_PREFIX) and name.endswith(".json.gz"):
                    os.unlink(os.path.join(d, name))
    for d in created:
        try:
            os.rmdir(d)
        except OSError:
            return


def _choose_start(cfg: TrainConfig, again: bool, owner: dict):
    """(path, checkpoint, notes) to start from on rank 0; (None, None, notes) = a fresh start."""
    if again:  # the newest good checkpoint this job wrote; none yet: start as the job did
        path, ck, notes = pick_checkpoint(cfg.out, owner.get("run_id"))
        if path is not None or cfg.resume is None:
            return path, ck, notes
    if cfg.resume is None:
        held = run_files(cfg.out)
        if held and not cfg.overwrite:
            raise RunStopped(EXIT_USAGE,
                             f"--out {cfg.out!r} holds a run ({', '.join(held)}); nothing was "
                             "changed. Continue it with --resume, write this run to a new --out, "
                             "or replace it with --overwrite.")
        return None, None, []
    if cfg.resume in ("auto", "latest"):
        path, ck, notes = pick_checkpoint(cfg.out, owner.get("run_id"))
        if path is None:
            raise RunStopped(EXIT_USAGE,
                             f"--resume: --out {cfg.out!r} holds no checkpoint to resume ({LAST}, "
                             f"{PREV}){''.join('; ' + n for n in notes)}. To start a new run "
                             "there, leave out --resume.")
        return path, ck, notes
    if os.path.isdir(cfg.resume):
        path, ck, notes = pick_checkpoint(
            cfg.resume, (read_json(os.path.join(cfg.resume, CONFIG)) or {}).get("run_id"))
        if path is None:
            raise UsageError(f"--resume {cfg.resume!r}: directory has no checkpoint to resume "
                             f"({LAST}, {PREV}) {'; '.join(notes)}")
    elif not os.path.isfile(cfg.resume):
        raise UsageError(f"--resume {cfg.resume!r}: no such checkpoint file")
    else:
        path, ck, notes = cfg.resume, load_checkpoint(cfg.resume, require=STATE_KEYS), []
    _refuse_other_run(cfg, owner, path, ck)
    return path, ck, notes


def other_run_files(cfg: TrainConfig, owner: dict, ck: dict) -> list:
    """The files of --out that belong to another run than checkpoint `ck` (an explicit --resume
    PATH): [] when --out holds no run, or holds the checkpoint's own run (same run_id)."""
    held = run_files(cfg.out)
    if not held:
        return []
    theirs = ((ck or {}).get("config") or {}).get("run_id")
    if owner.get("run_id") is not None and owner.get("run_id") == theirs:
        return []
    return held


def _refuse_other_run(cfg: TrainConfig, owner: dict, path: str, ck: dict) -> None:
    """--resume PATH into an --out that holds another run: RunStopped(EXIT_USAGE), nothing
    touched, unless --overwrite (the other run's files are deleted when the run starts)."""
    held = other_run_files(cfg, owner, ck)
    if held and not cfg.overwrite:
        raise RunStopped(EXIT_USAGE,
                         f"--out {cfg.out!r} holds another run ({', '.join(held)}) than the "
                         f"checkpoint given with --resume {path!r}; nothing was changed. "
                         "Continue that checkpoint's run in its own folder (--out = the folder "
                         "it came from), write it to a new --out, or replace the run in --out "
                         "with --overwrite.")


@dataclass
class StartPlan:
    path: str | None          # the checkpoint to resume (None: a fresh start)
    notes: list               # what was skipped and why (damaged, another run's)
    again: bool               # a restarted worker group of this torchrun job
    restart: int              # TORCHELASTIC_RESTART_COUNT
    job: str | None           # TORCHELASTIC_RUN_ID
    ck: dict | None = None    # the checkpoint, loaded (rank 0 only)
    created: tuple = ()       # the folders check_writable made for --out (rank 0 only)
    lock: RunLock | None = None  # --out's RunLock, held until the process ends (rank 0 only)


LOCK = ".train.lock"      # OUT/.train.lock: held (flock) by rank 0 for the run's life
LOCK_WAIT_RESTART_S = 180.0  # a restarted torchrun group waits this long for its lock (below)


class RunLock:
    """The lock that makes a run the only one in its --out: fcntl.flock (exclusive) on
    OUT/.train.lock, taken by rank 0 before it looks at what --out holds and held until the
    process ends (`release` removes the file: a run that stopped before it began leaves --out as
    it was).  Two runs started at once into one --out: the one that gets the lock goes on, the
    other stops (RunStopped(EXIT_USAGE), touching nothing), whatever the timing; a check of the
    folder followed by a write could let both through.  The kernel drops the lock when the
    process dies (kill -9 included), so a crashed run leaves at most the file, never a held
    lock; a file that an exiting run unlinked between another's open and flock is detected (the
    inode check) and the lock taken again on the new file."""

    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, out: str, wait_s: float = 0.0) -> RunLock | None:
        """The lock of `out` (which exists); RunStopped(EXIT_USAGE) when another process holds
        it `wait_s` seconds on; None, with a note, on a file system without flock (e.g. Lustre
        mounted without -o flock): the run goes on unprotected and says so."""
        import fcntl
        path = os.path.join(out, LOCK)
        deadline = time.monotonic() + wait_s
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(1.0)
                    continue
                raise RunStopped(EXIT_USAGE,
                                 f"--out {out!r} is in use by another train.py run ({LOCK} is "
                                 f"locked{': ' + holder if holder else ''}); nothing was "
                                 "changed. Wait for that run to end, or write this run to "
                                 "another --out.") from None
            except OSError as exc:
                os.close(fd)
                print(f"note: --out {out!r}: no file locks there ({exc.strerror}); two runs "
                      "started at once into it are not kept apart", file=sys.stderr, flush=True)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                return None
            try:
                on_disk, held = os.stat(path), os.fstat(fd)
                same = (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # a run that ended unlinked it after our open: lock the new file
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                      f"{datetime.datetime.now().isoformat(timespec='seconds')}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Unlink the file (while still holding the lock), then drop the lock."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


def plan_start(cfg: TrainConfig, di) -> StartPlan:
    """Where the run starts, decided on rank 0 before any data is read, and nothing written:

    - a restarted torchrun worker group (`is_restart`) resumes the newest good checkpoint in
      --out that the job wrote, whatever --resume says (none yet: it starts as the job did);
    - --resume [PATH]: that checkpoint; with no checkpoint to resume, RunStopped(EXIT_USAGE);
    - else a fresh start, which refuses an --out holding a run (a checkpoint, or a log with a
      record: RunStopped(EXIT_USAGE), nothing touched) unless --overwrite;
    - --out must be writable: RunStopped(EXIT_UNWRITABLE), one line naming it.

    UsageError (naming the file) when the checkpoint cannot be used."""
    restart, job = nd.restart_count(), os.environ.get("TORCHELASTIC_RUN_ID")
    ck, choice, created, lock = None, None, (), None
    if di.is_main:
        try:
            created = check_writable(cfg.out)
            # the lock first, then what --out holds (RunLock); a restarted group of this job
            # waits for it (the failed group's rank 0, on another node, may still be exiting)
            wait = is_restart(read_json(os.path.join(cfg.out, CONFIG)) or {}, restart, job)
            lock = RunLock.acquire(cfg.out, LOCK_WAIT_RESTART_S if wait else 0.0)
            owner = read_json(os.path.join(cfg.out, CONFIG)) or {}
            again = is_restart(owner, restart, job)
            path, ck, notes = _choose_start(cfg, again, owner)
            choice = (path, notes, again, None)
        except (RunStopped, ValueError) as exc:
            status = exc.status if isinstance(exc, RunStopped) else EXIT_USAGE
            choice = (None, [], False, (status, str(exc)))
            if lock is not None:
                lock.release()
            remove_unused_out(created)
    path, notes, again, err = nd.broadcast_object(choice)
    if err is not None:
        raise RunStopped(*err)
    return StartPlan(path=path, notes=notes, again=again, restart=restart, job=job, ck=ck,
                     created=created, lock=lock)


def remove_run_files(out: str, keep: str | None = None) -> None:
    """--overwrite: delete the other run's RUN_FILES in `out` (but `keep`, the checkpoint being
    resumed) and its TensorBoard event files (OUT/tensorboard/events.out.tfevents.*, the folder
    too once empty), so that neither its log nor its curves mix with the new run's; nothing
    else in `out` is touched."""
    for name in RUN_FILES:
        p = os.path.join(out, name)
        if keep is None or os.path.abspath(p) != os.path.abspath(keep):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
    tb = os.path.join(out, TENSORBOARD)
    if os.path.isdir(tb) and not os.path.islink(tb):
        for name in os.listdir(tb):
            p = os.path.join(tb, name)
            if name.startswith("events.out.tfevents.") and os.path.isfile(p):
                os.unlink(p)
        with contextlib.suppress(OSError):
            os.rmdir(tb)   # only if empty: a user's own files there stay


def start(st: TrainState, plan: StartPlan) -> None:
    """Start the run as planned, on every rank: resume the checkpoint (loaded on every rank), or
    a fresh start (--overwrite: the other run's files deleted first); then OUT/config.json and
    OUT/status.json (status null while the run goes).

    UsageError (naming the file) when the checkpoint does not fit this run; RunStopped when a
    restart after a failure would only replay the non-finite loss that stopped the job
    (OUT/non_finite.json)."""
    cfg, di, restart, job = st.cfg, st.di, plan.restart, plan.job
    for n in plan.notes:
        print_main(di, f"note: {n}", file=sys.stderr)
    cfg.elastic_run_id = job
    if plan.path is None:
        cfg.run_id = nd.broadcast_object(uuid.uuid4().hex)
        if di.is_main and cfg.overwrite and not plan.again:
            remove_run_files(cfg.out)
    else:
        err = None
        try:
            ck = resume(st, plan.path, plan.ck)  # rank 0 reuses the checkpoint it has loaded
        except ValueError as exc:
            err = f"{exc}" if di.is_main else f"rank {di.rank}: {exc}"
        errs = [e for e in nd.gather_objects(err) if e is not None]
        if errs:
            raise UsageError(errs[0])
        if di.is_main and cfg.overwrite and not plan.again:
            # --resume PATH --overwrite: the other run in --out goes (the checkpoint is loaded)
            remove_run_files(cfg.out, keep=plan.path)
        st.resumed_from, st.saved = plan.path, (plan.path, st.step)
        st.rotate = os.path.abspath(plan.path) == os.path.abspath(st.ckpt_path)
        how = f" (restart of torchrun job {job}, restart count {restart})" if plan.again else ""
        print_main(di, f"resumed from {plan.path} at step {st.step} (epoch {ck['epoch']}, batch "
                       f"{ck['batch']}){how}")
    marker = os.path.join(cfg.out, NON_FINITE)
    err = None
    if di.is_main:
        # honoured only after a failure here (count > 0): a count of 0 may be a new launch, which
        # the user made to get past it (e.g. with a lower --lr)
        bad = read_json(marker) if plan.again and restart > 0 else None
        if (bad and bad.get("elastic_run_id") == job and bad.get("run_id") == cfg.run_id
                and bad.get("step", 0) > st.step):
            err = (f"restart {restart} of torchrun job {job}: the job stopped at a non-finite "
                   f"loss at step {bad['step']} ({marker}); resuming from step {st.step} would "
                   "replay it. Not restarting: fix the cause (e.g. a lower --lr) and launch "
                   "again with --resume.")
        else:
            try:
                if restart == 0 and os.path.exists(marker):
                    os.unlink(marker)  # about an earlier launch
                remove_stale_temp_files(cfg.out)
                write_json_atomic(cfg.to_dict(), os.path.join(cfg.out, CONFIG))
                write_status(cfg, None, step=st.step)
                st.began = True
                if st.listing is not None:
                    st.listing.flush()   # the data list scanned at build, kept from now on
            except OSError as exc:
                err = (EXIT_UNWRITABLE, f"--out {cfg.out!r} cannot be written "
                       f"({exc.strerror or type(exc).__name__}); stopping before training.")
    err = nd.broadcast_object(err)
    if isinstance(err, tuple):
        raise RunStopped(*err)
    if err is not None:
        raise RunStopped(EXIT_NON_FINITE, err)


def resume(st: TrainState, path: str, ck: dict | None = None) -> dict:
    """Continue the run saved at `path` (or the checkpoint `ck` loaded from it) exactly;
    ValueError naming what does not match.

    An extended run: a total of steps larger than the checkpoint's (--max-steps or --epochs)
    continues the run with the model, momentum model, queue, optimiser, RNG and data position
    exactly as saved, and from the checkpoint's step on the lr follows the warm-up + cosine
    schedule of the NEW total (the cosine restretched to end at the new last step; the warm-up
    stays the checkpoint's).  So the lr jumps up at the extension (from ~0 if the run had
    finished) to the value a run planned with the new total has at that step.  A smaller total
    is refused.  The lr is a function of the step (schedule.get_lr): nothing else changes."""
    if ck is None:
        ck = load_checkpoint(path, map_location="cpu", require=STATE_KEYS)  # CPU RNG states
    old, cfg = ck["config"], st.cfg
    keys = RESUME_KEYS + RESUME_MODEL_KEYS + (() if old.get("learn_gain") else RESUME_GAIN_KEYS)
    missing = [k for k in keys + ("run_id",) if k not in old and k not in RESUME_DEFAULTS]
    if missing:
        raise ValueError(f"--resume {path}: the checkpoint's config has no {', '.join(missing)}: "
                         "not a checkpoint of this train.py")
    extend = old["total_steps"] < cfg.total_steps
    if cfg.warmup_epochs is None:  # a resumed run keeps its warm-up
        cfg.warmup_steps = old["warmup_steps"]
    new = cfg.to_dict()
    for k in keys:
        was = old.get(k, RESUME_DEFAULTS[k]) if k in RESUME_DEFAULTS else old[k]
        if was != new[k] and not (k == "total_steps" and extend):
            more = {"total_steps": " (a resumed run may extend the schedule, not shorten it)",
                    "num_images": f" (--data {cfg.data!r} changed since the checkpoint: the run "
                                  "cannot continue exactly)"}.get(k, "")
            if k in RESUME_MODEL_KEYS + RESUME_GAIN_KEYS:
                more = (" (the checkpoint's model: resume with the flags or recipe it was "
                        "trained with)")
            raise ValueError(f"--resume {path}: checkpoint has {k}={was!r}, this run "
                             f"{new[k]!r}{more}")
    step, rng = ck["step"], ck["rng"]
    if not _checks.is_int(step) or step < 0:
        raise ValueError(f"--resume {path}: the checkpoint's step is {step!r}, not an int >= 0")
    was_world = old.get("world_size")
    if not _checks.is_int(was_world) or was_world < 1:
        raise ValueError(f"--resume {path}: the checkpoint's world_size is {was_world!r}, not an "
                         "int >= 1")
    if not isinstance(rng, (list, tuple)) or len(rng) != was_world:
        raise ValueError(f"--resume {path}: the checkpoint's rng is not one state per process "
                         f"of its world_size {was_world}")
    if cfg.batch_size % cfg.world_size:   # (parse refuses it first; here for any caller)
        raise ValueError(f"--resume {path}: the global batch {cfg.batch_size} does not divide "
                         f"by this run's {cfg.world_size} processes (the checkpoint's "
                         f"{was_world}); resume on a world size that divides it")
    try:
        st.model.load_state_dict(plain_state_dict(ck["model"]))
        if st.mom_model is not None:
            st.mom_model.load_state_dict(plain_state_dict(ck["momentum_model"]))
            st.queue.load_state_dict(ck["queue"])
    except (RuntimeError, TypeError, AttributeError) as exc:  # load_state_dict's mismatches
        raise ValueError(f"--resume {path}: the checkpoint's weights do not fit the model this "
                         f"run builds ({' '.join(str(exc).split())[:400]}); resume with the flags "
                         f"it was trained with (its {CONFIG})") from exc
    st.optimizer.load_state_dict(ck["optimizer"])
    # the settings this run gives, not the checkpoint's, as for --lr (a function of the step):
    # load_state_dict restored the saved groups' weight decay, which a --wd given now (and
    # recorded in config.json) would otherwise silently not change
    for g in st.optimizer.param_groups:
        g["weight_decay"] = 0.0 if g.get("lars_exclude") else cfg.wd
    st.scaler.load_state_dict(ck["scaler"])
    st.step = step
    el = ck.get("elapsed_s")   # (none in a checkpoint written before it was kept)
    st.elapsed_before = float(el) if _checks.is_number(el) and math.isfinite(el) and el >= 0 \
        else 0.0
    cfg.run_id = old["run_id"]
    cfg.extended = list(old.get("extended") or [])
    cfg.resized = list(old.get("resized") or [])
    if was_world == cfg.world_size:
        restore_rng_state(rng[st.di.rank])
    else:
        resize(st, was_world)
    if extend:
        cfg.extended.append({"step": st.step, "from_total_steps": old["total_steps"],
                             "to_total_steps": cfg.total_steps})
        was = get_lr(st.step, cfg.lr, old["warmup_steps"], old["total_steps"])
        print_main(st.di, f"extended: the schedule now ends at step {cfg.total_steps} (was "
                          f"{old['total_steps']}); lr at step {st.step}: {was:.4g} -> "
                          f"{lr_at(cfg, st.step):.4g}")
    return ck


def resize(st: TrainState, was_world: int) -> None:
    """The elastic resize: a run of `was_world` processes goes on with st.cfg.world_size (its
    global batch divides by both; docs/training.md "Fault tolerance").  What is global continues
    exactly, whatever the world size: the step, the schedule (a function of the step), the
    weights, momentum model, optimiser and queue (every rank held the same), and the sample
    order (global batch k is the same images in the same order at any world size, each rank
    taking its slice of batch_size / world_size: order.ShardedOrder).  What is per rank cannot:
    each rank's RNG streams (the channel noise) restart from a seed of (seed, step, rank, world
    size), the checkpoint's per-rank states being of other ranks; and the per-rank BatchNorm
    statistics (shuffle BN, the online encoder's BN without --sync-bn) are taken over
    batch_size / world_size images instead of batch_size / was_world.  cfg.resized records it."""
    import random

    import numpy as np

    from ..data.order import hash_key
    cfg, di = st.cfg, st.di
    key = int(hash_key(cfg.seed, st.step, di.rank, cfg.world_size, 0xE1A5))
    torch.manual_seed(key)
    np.random.seed(key % 2**32)
    random.seed(key)
    cfg.resized.append({"step": st.step, "from_world_size": was_world,
                        "to_world_size": cfg.world_size})
    print_main(di, f"resized: world size {was_world} -> {cfg.world_size} at step {st.step} (per "
                   f"process batch {cfg.batch_size // was_world} -> "
                   f"{cfg.batch_size // cfg.world_size} of the global {cfg.batch_size}); the "
                   "sample order, queue and schedule go on, the per-process RNG streams are "
                   "reseeded and BatchNorm statistics are per process")


def write_status(cfg: TrainConfig, status: int | None, message: str | None = None,
                 step: int | None = None) -> None:
    """OUT/status.json: how the run ended (status null: it is running, or was killed)."""
    write_json_atomic({"status": status, "meaning": EXIT_MEANING.get(status, "running"),
                       "message": message, "step": step, "run_id": cfg.run_id,
                       "time": datetime.datetime.now().isoformat(timespec="seconds")},
                      os.path.join(cfg.out, STATUS))


LEADER_EXIT_DELAY_S = 2.0    # under torchrun, a failing rank 0 exits this long after its report
FOLLOWER_EXIT_DELAY_S = 5.0  # and the other failing ranks at the latest this long after theirs


def _write_error_file(path: str, text: str) -> None:
    """torchrun's error file for this worker, stamped now: its report's root cause is the worker
    whose record is the earliest."""
    with contextlib.suppress(OSError):
        with open(path, "w") as f:
            json.dump({"message": {"message": text, "extraInfo": {
                "py_callstack": text, "timestamp": str(int(time.time()))}}}, f)


def _follower_exit(path: str, text: str) -> None:
    """A failing rank > 0 under torchrun: its record is written when it exits, which is after rank
    0 has written its own (torchrun stops the other workers, SIGTERM, once one has exited), so
    the report shows rank 0's message as the root cause however far apart the ranks got there;
    and at the latest FOLLOWER_EXIT_DELAY_S on, for a failure rank 0 does not share."""
    def on_term(signum, frame):
        _write_error_file(path, text)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: no handler, record now
        _write_error_file(path, text)
        return
    time.sleep(FOLLOWER_EXIT_DELAY_S)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _write_error_file(path, text)


def finish(status: int, message: str | None = None, di=None, st: TrainState | None = None,
           ) -> int:
    """How every train.py process ends.  Rank 0 prints `message` (status != 0) and, last, the
    line scripts can grep, "train.py: exit status N (meaning)"; a run that got to start also
    records it in OUT/status.json.  Under torchrun (which exits 1 whatever the status) rank 0
    writes the message and the status line to torchrun's error file, so that torchrun's report,
    the last thing it prints, shows them as the root cause with the exit code, and waits a moment
    so that the other ranks, which may reach this point later, can record their failure too; the
    other ranks record one short line when they exit (_follower_exit).  Returns `status`."""
    rank = di.rank if di is not None else int(os.environ.get("RANK", "0") or 0)
    if st is not None and st.saver is not None:  # a save still being written when a run stops
        unsaved = settle_save(st)                # early: it completes (or fails) before exit
        if unsaved is not None:
            message = ((message + "; " if message else "") + f"the checkpoint of step "
                       f"{unsaved[0]} could not be written to {st.ckpt_path}: {unsaved[1]}")
            status = status or EXIT_UNWRITABLE
    stream = sys.stderr if status else sys.stdout
    line = f"train.py: exit status {status} ({EXIT_MEANING.get(status, 'error')})"
    if rank == 0:
        if status and message:
            print(f"train.py: error: {message}", file=sys.stderr, flush=True)
        print(line, file=stream, flush=True)
        if st is not None:
            try:
                write_status(st.cfg, status, message, st.step)
            except OSError as exc:
                print(f"({STATUS} not written: {exc})", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if status and error_file:
        if rank == 0:
            _write_error_file(error_file, f"train.py: error: {message}\n{line}" if message
                              else line)
            if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
                time.sleep(LEADER_EXIT_DELAY_S)
        else:
            _follower_exit(error_file, f"rank {rank} stopped with rank 0 (exit status {status})")
    return status
