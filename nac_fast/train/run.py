"""The parts of a training run that train.py puts together: the data loader, the models and
their optimiser (`build`), where the run starts (`start`, `resume`), one optimizer step
(`train_step`), the checkpoint's contents (`save`) and the stop on a non-finite loss.

    st = build(args, dist_info)          # TrainState: everything a step needs
    ck = start(st)                        # --resume, or by itself after an elastic restart
    loss, a = train_step(st, x)           # x: both views of this rank's batch, on the device
    status = save(st, step)               # atomic, rotated; rank 0 writes every rank's RNG
    status = stop_non_finite(st, bad, step)

Fault tolerance (docs/training.md "Fault tolerance"): a restarted torchrun worker group resumes from the
newest good checkpoint in --out (last.pt, else prev.pt), a failed save stops every rank with
EXIT_SAVE_FAILED and the previous checkpoints intact, a non-finite loss stops with
EXIT_NON_FINITE and is recorded in OUT/non_finite.json so that a restart does not replay it.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sys
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..ops.dispatch import available_backends
from ..ops.momentum import NACMQ
from ..ops.queue import CodeQueue
from . import distributed as nd
from .checkpoint import (CONFIG, LAST, PREV, STATE_KEYS, capture_rng_state, load_checkpoint,
                         pick_checkpoint, read_json, remove_stale_temp_files, restore_rng_state,
                         save_atomic, write_json_atomic)
from .config import Run, resolve_run
from .lars import LARS, param_groups_for_lars
from .methods import nac_mq_step, nac_step, simclr_step, step_value_checks
from .models import build_model, model_kwargs_from_config
from .schedule import WarmupCosine

# Must match for a checkpoint to continue a run exactly; except that total_steps may grow (an
# extended run, see `resume`) and warmup_steps is the checkpoint's unless --warmup-epochs is given.
RESUME_KEYS = ("arch", "method", "batch_size", "code_dim", "data", "world_size", "total_steps",
               "warmup_steps", "queue_size", "seed")
EXIT_NON_FINITE = 3     # train.py's status when a non-finite loss stopped the run
EXIT_SAVE_FAILED = 4    # ... when a checkpoint could not be written
NON_FINITE = "non_finite.json"   # OUT/non_finite.json: where and when a run hit one


class RunStopped(Exception):
    """The run must not go on: train.py prints the message and exits with `status`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class TrainState:
    args: Any
    di: Any                         # nac_fast.train.distributed.DistInfo
    run: Run
    cfg: dict                       # flags + run values: config.json and every checkpoint
    loader: Any
    model: torch.nn.Module          # the plain online model (what checkpoints hold)
    net: torch.nn.Module            # what the step calls: model (nac-mq: mq) under DDP /
                                    # torch.compile
    optimizer: torch.optim.Optimizer
    sched: Any
    scaler: Any
    autocast: Any
    mom_model: torch.nn.Module | None = None  # nac-mq: the NACMQ's momentum_model
    queue: CodeQueue | None = None            # nac-mq: the NACMQ's queue
    step: int = 0
    extras: dict = field(default_factory=dict)
    resumed_from: str | None = None  # the checkpoint this process started from
    saved: tuple | None = None       # (path, step): the newest good checkpoint of this run
    rotate: bool = False             # OUT/last.pt is a good checkpoint of this run: keep it as
                                     # prev.pt at the next save (else the save replaces it)
    last_r: Any = None               # the last step's inference logits (detached), for the log

    @property
    def ckpt_path(self) -> str:
        return os.path.join(self.args.out, LAST)

    @property
    def prev_path(self) -> str:
        return os.path.join(self.args.out, PREV)


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

    model = build_model(**model_kwargs_from_config(cfg))  # with the head options (models.py)
    model.to(di.device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    mq = None
    if args.method == "nac-mq":
        # before SyncBN: the key branch uses shuffle BN.  Codes stored in the loss's dtype (bf16
        # under the GPU's default AMP): the loss reads the queue as it is, with no per-step
        # conversion of M x D elements
        mq = NACMQ(model, queue_size=run.queue_size, code_dim=args.code_dim, p=args.p,
                   l2=args.l2, momentum=run.momentum, shuffle_bn=args.shuffle_bn,
                   queue_dtype=amp_dtype or torch.float32, backend=args.loss_backend)
    # From here on each rank draws its own channel noise (the loader seeds itself)
    torch.manual_seed(args.seed * 1000 + 1 + di.rank)
    if args.sync_bn:
        model = nd.convert_sync_bn(model)
        if mq is not None:
            mq.model = model  # the online model only: the momentum copy keeps its BatchNorm
    optimizer = LARS(param_groups_for_lars(model, args.wd), lr=run.lr, momentum=0.9,
                     weight_decay=args.wd, trust_coefficient=0.001)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                              WarmupCosine(run.warmup_steps, run.total_steps))
    scaler = torch.amp.GradScaler(di.device.type, enabled=run.amp == "fp16")
    if args.compile and mq is not None:
        # the online model's forward, as for nac: NACMQ's noise, enqueue and EMA stay eager
        mq.model = torch.compile(model)
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
            net, device_ids=[di.local_rank] if di.device.type == "cuda" else None,
            gradient_as_bucket_view=True, find_unused_parameters=args.infer_warmup_steps > 0,
            **ddp_kw)
    if args.compile and mq is None:
        net = torch.compile(net)
    autocast = (torch.autocast(di.device.type, dtype=amp_dtype) if amp_dtype is not None
                else contextlib.nullcontext())
    return TrainState(args=args, di=di, run=run, cfg=cfg, loader=loader, model=model, net=net,
                      optimizer=optimizer, sched=sched, scaler=scaler, autocast=autocast,
                      mom_model=None if mq is None else mq.momentum_model,
                      queue=None if mq is None else mq.queue)


def train_step(st: TrainState, x: torch.Tensor):
    """One optimizer step on this rank's batch x (both views, on the device): the method's loss
    forward (under autocast) and backward, the LARS update, the lr schedule and the EMA of the
    momentum model (made by the NACMQ call, before its loss).  Returns (loss, a), detached
    device tensors.

    No host sync: the loss-input value checks are off here (`step_value_checks`; the caller
    checks the loss, which NaN/inf inputs reach), scalars stay Python numbers, and nothing reads
    device data (tests/test_sync_free.py runs this function under a dispatch mode that fails on
    any host read).  The only exception is fp16 AMP: GradScaler.step reads its inf flag."""
    a_ = st.args
    # r for the log's statistics (st.last_r); the inference net's warm-up: sched.last_epoch is
    # the number of optimizer steps taken (a Python int, restored on resume)
    out, frozen = {}, st.sched.last_epoch < a_.infer_warmup_steps
    with step_value_checks(), st.autocast:
        if a_.method == "nac":
            loss, a = nac_step(st.net, x, a_.p, backend=a_.loss_backend, out=out,
                               freeze_codes=frozen)
        elif a_.method == "nac-mq":
            loss, a = nac_mq_step(st.net, x, out=out, freeze_codes=frozen)
        else:
            loss, a = simclr_step(st.net, x, a_.tau)
    st.last_r = out.get("r")
    st.optimizer.zero_grad(set_to_none=True)
    st.scaler.scale(loss).backward()
    st.scaler.step(st.optimizer)
    st.scaler.update()
    st.sched.step()
    return loss.detach(), a.detach()


def print_main(di, *a, **k) -> None:
    if di.is_main:
        print(*a, **k, flush=True)


def save(st: TrainState, step: int) -> int:
    """Checkpoint the run at `step` (a collective: every rank's RNG goes to rank 0, which writes
    OUT/last.pt, the previous one becoming OUT/prev.pt).  Returns 0, or EXIT_SAVE_FAILED on every
    rank when the write failed (disk full, unwritable --out, ...): the message names the file
    and the cause, and the checkpoints already there are left intact (checkpoint.save_atomic)."""
    rng = nd.gather_objects(capture_rng_state())
    err = None
    if st.di.is_main:
        spe = st.run.steps_per_epoch
        state = {"model": st.model.state_dict(), "optimizer": st.optimizer.state_dict(),
                 "momentum_model": st.mom_model.state_dict() if st.mom_model else None,
                 "queue": st.queue.state_dict() if st.queue is not None else None,
                 "scheduler": st.sched.state_dict(), "scaler": st.scaler.state_dict(),
                 "step": step, "epoch": step // spe, "batch": step % spe, "rng": rng,
                 "config": st.cfg}
        try:
            save_atomic(state, st.ckpt_path, previous=st.prev_path if st.rotate else None)
        except Exception as exc:  # noqa: BLE001  (any failure to write stops the run alike)
            err = f"{type(exc).__name__}: {exc}"
    err = nd.broadcast_object(err)  # also the barrier: no rank goes on before the file is there
    if err is not None:
        kept = (f"{st.saved[0]} (step {st.saved[1]}) is intact" if st.saved else
                "this run has no checkpoint yet")
        print_main(st.di, f"\ncheckpoint of step {step} could not be written to {st.ckpt_path}: "
                          f"{err}\nstopping (status {EXIT_SAVE_FAILED}); {kept}. Free space or fix "
                          f"--out, then continue with --resume.", file=sys.stderr)
        return EXIT_SAVE_FAILED
    st.saved, st.rotate = (st.ckpt_path, step), True
    return 0


def stop_non_finite(st: TrainState, bad: tuple, step: int) -> int:
    """The stop on the first non-finite loss `bad` = (its step, its value), found at `step`: the
    message, and OUT/non_finite.json (rank 0) so that an elastic restart of this job does not
    replay it (start).  No checkpoint is written after it: the caller checks before each save.
    Returns EXIT_NON_FINITE."""
    later = f" (found at step {step})" if bad[0] != step else ""
    kept = f"{st.saved[0]} (step {st.saved[1]})" if st.saved else "none"
    print_main(st.di, f"\nnon-finite loss ({bad[1]}) at step {bad[0]}{later}; stopping. "
                      f"Last good checkpoint kept: {kept}", file=sys.stderr)
    if st.di.is_main:
        try:
            write_json_atomic({"step": bad[0], "loss": repr(bad[1]), "found_at": step,
                               "checkpoint": kept, "run_id": st.cfg.get("run_id"),
                               "elastic_run_id": st.cfg.get("elastic_run_id")},
                              os.path.join(st.args.out, NON_FINITE))
        except OSError as exc:  # the stop itself does not depend on it
            print(f"({NON_FINITE} not written: {exc})", file=sys.stderr)
    return EXIT_NON_FINITE


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


def _choose_start(args, again: bool, owner: dict):
    """(path, checkpoint, notes) to start from on rank 0; (None, None, notes) = a fresh start."""
    if again:  # the newest good checkpoint this job wrote; none yet: start as the job did
        path, ck, notes = pick_checkpoint(args.out, owner.get("run_id"))
        if path is not None:
            return path, ck, notes
    if args.resume is None:
        return None, None, []
    if args.resume in ("auto", "latest"):
        return pick_checkpoint(args.out, owner.get("run_id"))
    if os.path.isdir(args.resume):
        path, ck, notes = pick_checkpoint(
            args.resume, (read_json(os.path.join(args.resume, CONFIG)) or {}).get("run_id"))
        if path is None:
            raise ValueError(f"--resume {args.resume!r}: directory has no checkpoint to resume "
                             f"({LAST}, {PREV}) {'; '.join(notes)}")
        return path, ck, notes
    if not os.path.isfile(args.resume):
        raise ValueError(f"--resume {args.resume!r}: no such checkpoint file")
    return args.resume, load_checkpoint(args.resume, require=STATE_KEYS), []


def start(st: TrainState) -> dict | None:
    """Where the run starts, decided on rank 0 and loaded on every rank: the checkpoint --resume
    names (none: a fresh start); in a restarted torchrun worker group (`is_restart`) the newest
    good checkpoint in --out that the job wrote, whatever --resume says.  Writes OUT/config.json.
    Returns the checkpoint resumed (None: a fresh start).

    ValueError (naming the file) when the checkpoint cannot be used; RunStopped when a restart
    after a failure would only replay the non-finite loss that stopped the job
    (OUT/non_finite.json)."""
    args, di = st.args, st.di
    restart, job = nd.restart_count(), os.environ.get("TORCHELASTIC_RUN_ID")
    ck = choice = None
    again = False
    if di.is_main:
        try:
            owner = read_json(os.path.join(args.out, CONFIG)) or {}
            again = is_restart(owner, restart, job)
            path, ck, notes = _choose_start(args, again, owner)
            choice = (path, notes, None, again)
        except ValueError as exc:
            choice = (None, [], str(exc), again)
    path, notes, err, again = nd.broadcast_object(choice)
    if err is not None:
        raise ValueError(err)
    for n in notes:
        print_main(di, f"note: {n}", file=sys.stderr)
    st.cfg["elastic_run_id"] = job
    if path is None:
        st.cfg["run_id"] = nd.broadcast_object(uuid.uuid4().hex)
    else:
        err = None
        try:
            ck = resume(st, path, ck)  # rank 0 reuses the checkpoint it has loaded
        except ValueError as exc:
            err = f"{exc}" if di.is_main else f"rank {di.rank}: {exc}"
        errs = [e for e in nd.gather_objects(err) if e is not None]
        if errs:
            raise ValueError(errs[0])
        st.resumed_from, st.saved = path, (path, st.step)
        st.rotate = os.path.abspath(path) == os.path.abspath(st.ckpt_path)
        how = f" (restart of torchrun job {job}, restart count {restart})" if again else ""
        print_main(di, f"resumed from {path} at step {st.step} (epoch {ck['epoch']}, batch "
                       f"{ck['batch']}){how}")
    marker = os.path.join(args.out, NON_FINITE)
    if di.is_main:
        # honoured only after a failure here (count > 0): a count of 0 may be a new launch, which
        # the user made to get past it (e.g. with a lower --lr)
        bad = read_json(marker) if again and restart > 0 else None
        if (bad and bad.get("elastic_run_id") == job and bad.get("run_id") == st.cfg["run_id"]
                and bad.get("step", 0) > st.step):
            err = (f"restart {restart} of torchrun job {job}: the job stopped at a non-finite "
                   f"loss at step {bad['step']} ({marker}); resuming from step {st.step} would "
                   "replay it. Not restarting: fix the cause (e.g. a lower --lr) and launch "
                   "again with --resume.")
        else:
            err = None
            if restart == 0 and os.path.exists(marker):
                os.unlink(marker)  # about an earlier launch
            remove_stale_temp_files(args.out)
            write_json_atomic(st.cfg, os.path.join(args.out, CONFIG))
    err = nd.broadcast_object(err)
    if err is not None:
        raise RunStopped(EXIT_NON_FINITE, err)
    return ck


def resume(st: TrainState, path: str, ck: dict | None = None) -> dict:
    """Continue the run saved at `path` (or the checkpoint `ck` loaded from it) exactly;
    ValueError naming what does not match.

    An extended run: a total of steps larger than the checkpoint's (--max-steps or --epochs)
    continues the run with the model, momentum model, queue, optimiser, RNG and data position
    exactly as saved, and from the checkpoint's step on the lr follows the warm-up + cosine
    schedule of the NEW total (the cosine restretched to end at the new last step; the warm-up
    stays the checkpoint's).  So the lr jumps up at the extension (from ~0 if the run had
    finished) to the value a run planned with the new total has at that step.  A smaller total
    is refused."""
    if ck is None:
        ck = load_checkpoint(path, map_location="cpu", require=STATE_KEYS)  # CPU RNG states
    old, new = ck["config"], st.cfg
    extend = old["total_steps"] < new["total_steps"]
    if st.args.warmup_epochs is None:  # a resumed run keeps its warm-up
        st.run.warmup_steps = new["warmup_steps"] = old["warmup_steps"]
    for k in RESUME_KEYS:
        if old[k] != new[k] and not (k == "total_steps" and extend):
            more = (" (a resumed run may extend the schedule, not shorten it)"
                    if k == "total_steps" else "")
            raise ValueError(f"--resume {path}: checkpoint has {k}={old[k]!r}, this run "
                             f"{new[k]!r}{more}")
    st.model.load_state_dict(ck["model"])
    if st.mom_model is not None:
        st.mom_model.load_state_dict(ck["momentum_model"])
        st.queue.load_state_dict(ck["queue"])
    st.optimizer.load_state_dict(ck["optimizer"])
    st.sched.load_state_dict(ck["scheduler"])  # also the schedule's own (old) step counts
    st.scaler.load_state_dict(ck["scaler"])
    st.step = ck["step"]
    restore_rng_state(ck["rng"][st.di.rank])
    new["run_id"] = old.get("run_id") or uuid.uuid4().hex  # older checkpoints have none
    new["extended"] = list(old.get("extended") or [])
    if extend:
        new["extended"].append({"step": st.step, "from_total_steps": old["total_steps"],
                                "to_total_steps": new["total_steps"]})
    lr_was = st.optimizer.param_groups[0]["lr"]
    set_schedule(st.sched, st.run.warmup_steps, st.run.total_steps)
    if extend:
        print_main(st.di, f"extended: the schedule now ends at step {new['total_steps']} (was "
                          f"{old['total_steps']}); lr at step {st.step}: {lr_was:.4g} -> "
                          f"{st.optimizer.param_groups[0]['lr']:.4g}")
    return ck


def set_schedule(sched, warmup_steps: int, total_steps: int) -> None:
    """Point a loaded LambdaLR(WarmupCosine) at (warmup_steps, total_steps) from its current
    step on, setting the optimizer's lrs exactly as the scheduler's own step would."""
    WarmupCosine(warmup_steps, total_steps)  # checks the values
    for lam in {id(f): f for f in sched.lr_lambdas}.values():
        lam.warmup_steps, lam.total_steps = warmup_steps, total_steps
    lrs = [base * lam(sched.last_epoch) for lam, base in zip(sched.lr_lambdas, sched.base_lrs)]
    for g, lr in zip(sched.optimizer.param_groups, lrs):
        g["lr"] = lr
    sched._last_lr = lrs
