"""Pretrain an encoder with Neural Activation Coding (NAC, ICML 2021), NAC-MQ or SimCLR.

One process (CPU or one GPU):
    python train.py                                   # Fashion-MNIST, CPU-sized defaults
    python train.py --method nac-mq --max-steps 200 --out runs/mq
    python train.py --p 0.4 --out runs/hash           # the paper's p for hashing

Several processes on one machine (DDP; gloo on CPU, NCCL on GPUs):
    torchrun --nproc_per_node=2 train.py              # the default run: 2 CPU processes
    torchrun --nproc_per_node=2 train.py --flip-prob 0.4   # torchrun takes "--p" for its own flag
    torchrun --nproc_per_node=8 train.py --data /path/imagenet --arch resnet50 --method nac-mq

Several machines: run the same command on every node with torchrun's rendezvous flags, e.g.
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
             --rdzv_endpoint=HOST_OF_NODE0:29500 --rdzv_id=nac1 \\
             train.py --data /path/imagenet --arch resnet50 --method nac-mq --batch-size 512

Data (--data): "fashion-mnist" (default; Debian package dataset-fashion-mnist, or a torchvision
FashionMNIST root), a CIFAR-10 python directory, an ImageFolder root with train/ (and val/), or
"synthetic[:N]" (random images, for benchmarks and tests).  An ImageFolder root gets the paper's
ImageNet recipe by default (batch 512, 200 epochs, EMA 0.999, queue 65536); other data the short
CPU demo (batch 256, 2 epochs).
--batch-size is GLOBAL (images per optimizer step over all processes); each of the W processes
takes batch/W.  Resume an interrupted run with the same command plus --resume (latest checkpoint
in --out) or --resume PATH.  Outputs in --out: last.pt (checkpoint), log.jsonl (one JSON line per
--log-every steps: that step's loss, loss_avg over the steps since the previous line, lr, img/s,
code statistics), config.json.  Plot the log: python bench/plot_train_log.py OUT/log.jsonl.
A training step never waits for the GPU (no host sync): the loss is read at log points and
before every checkpoint save.  A non-finite loss stops the run there (exit status 3), naming the
first step whose loss was non-finite; no checkpoint is written after that step.
Evaluate: nac_fast.checkpoint.load_model(OUT/last.pt) returns the trained NACModel.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import sys
import time
from types import SimpleNamespace

import torch

from nac_fast import available_backends
from nac_fast import distributed as nd
from nac_fast.checkpoint import (capture_rng_state, load_checkpoint, resolve_resume,
                                 restore_rng_state, save_atomic, LAST)
from nac_fast.lars import LARS, param_groups_for_lars
from nac_fast.methods import (METHODS, code_stats, nac_mq_step, nac_step, simclr_step,
                              step_value_checks)
from nac_fast.models import ARCHS, build_model
from nac_fast.momentum import CodeQueue, ema_update_, make_momentum_copy
from nac_fast.schedule import WarmupCosine


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 allow_abbrev=False)
    a = ap.add_argument
    a("--data", default="fashion-mnist", help="fashion-mnist | CIFAR-10 dir | ImageFolder root | "
      "synthetic[:N]")
    a("--arch", default="resnet-tiny", choices=sorted(ARCHS),
      help="encoder; resnet-tiny/resnet18-small are CPU-sized")
    a("--method", default="nac", choices=METHODS, help="objective")
    # torchrun reads "--p" as an abbreviation of its own --print-completion, so under torchrun
    # write --flip-prob (or put "--" before the script's flags)
    a("--p", "--flip-prob", dest="p", type=float, default=0.1,
      help="bit-flip probability of the channel, in (0, 0.5); under torchrun use --flip-prob")
    a("--epochs", type=int, default=None, help="default: 200 for an ImageFolder root with "
      "train/ (the paper's ImageNet recipe), else 2 (the CPU demo on Fashion-MNIST)")
    a("--max-steps", type=int, default=None, help="total optimizer steps (overrides --epochs; "
      "the lr schedule spans this many steps)")
    a("--batch-size", type=int, default=None, help="GLOBAL batch (images per step, all ranks); "
      "default: 512 for an ImageFolder root with train/ (ImageNet recipe), else 256")
    a("--lr", type=float, default=None, help="base LARS lr; default 0.075*sqrt(batch)")
    a("--warmup-epochs", type=float, default=None,
      help="linear warm-up length; default 10 epochs (paper) capped at 10%% of the run")
    a("--wd", type=float, default=1e-6, help="weight decay (not on BN parameters and biases)")
    a("--queue-size", type=int, default=None, help="NAC-MQ queue length M; default 65536 "
      "(ImageNet recipe, rounded down to a multiple of the global batch) or 16 x batch (the short "
      "CPU demo: keys at most 8 steps old; the paper's 50000 there collapses the codes, see "
      "docs/results.md); the paper's CIFAR-10 run used 50000 with batch 1000")
    a("--momentum", type=float, default=None, help="EMA decay of the momentum model; default "
      "0.99 (<=64 px images) or 0.999")
    a("--l2", type=float, default=0.1, help="lambda of NAC-MQ's lambda*||z||^2")
    a("--tau", type=float, default=0.5, help="SimCLR temperature")
    a("--code-dim", type=int, default=128, help="code bits D")
    a("--no-scale-codes", dest="scale_codes", action="store_false",
      help="do not divide a and r by sqrt(D) (the authors' initial scale)")
    a("--amp", default="auto", choices=("auto", "bf16", "fp16", "off"),
      help="autocast dtype; auto = bf16 on GPU, off (fp32) on CPU")
    a("--channels-last", action=argparse.BooleanOptionalAction, default=True,
      help="NHWC memory format (faster convolutions on GPU and, measured, on CPU too)")
    a("--compile", action="store_true", help="torch.compile the online model")
    a("--loss-backend", default="auto", choices=("auto", "reference", "cpu", "triton", "cuda"),
      help="NAC loss backend (nac_fast.nac_loss's backend); auto = cpu on CPU, triton then cuda "
      "on GPU")
    a("--sync-bn", action="store_true", help="SyncBatchNorm in the online model (DDP)")
    a("--no-shuffle-bn", dest="shuffle_bn", action="store_false",
      help="disable MoCo's batch shuffle for the momentum branch (NAC-MQ, DDP)")
    a("--image-size", type=int, default=None, help="crop size; default the data's native size")
    a("--loader", default="auto", choices=("auto", "torchvision", "dali-cpu", "dali-gpu"))
    a("--workers", type=int, default=None, help="data workers per rank; default: "
      "0 on CPU, else min(8, cpus per rank - 1)")
    a("--device", default="auto", choices=("auto", "cpu", "cuda"))
    a("--out", default="runs/default", help="output directory (checkpoints, logs)")
    a("--resume", nargs="?", const="auto", default=None,
      help="resume from the latest checkpoint in --out, or from the given path")
    a("--seed", type=int, default=0)
    a("--log-every", type=int, default=10)
    a("--save-every", type=int, default=200)
    a("--stop-at-step", type=int, default=None, help="save and exit after this step although the "
      "schedule runs to --max-steps (split a run over job time limits; used by the resume test)")
    a("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    return ap


def resolve_defaults(args) -> None:
    """Recipe-dependent defaults: an ImageFolder root (train/ inside) gets the paper's ImageNet
    recipe (batch 512, 200 epochs); anything else the short CPU demo (batch 256, 2 epochs)."""
    imagenet = os.path.isdir(os.path.join(args.data, "train"))
    args.recipe = "imagenet" if imagenet else "demo"
    if args.batch_size is None:
        args.batch_size = 512 if imagenet else 256
    if args.epochs is None:
        args.epochs = 200 if imagenet else 2


def check_args(args, world: int) -> None:
    """Flag checks that need no data; raises ValueError naming the flag."""
    pos = {"--batch-size": args.batch_size, "--epochs": args.epochs,
           "--log-every": args.log_every, "--save-every": args.save_every,
           "--code-dim": args.code_dim}
    for k in ("max_steps", "queue_size", "image_size", "stop_at_step"):
        if getattr(args, k) is not None:
            pos["--" + k.replace("_", "-")] = getattr(args, k)
    for name, v in pos.items():
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not 0.0 < args.p < 0.5:
        raise ValueError(f"--p must lie in (0, 0.5), got {args.p}")
    if args.lr is not None and not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if args.warmup_epochs is not None and args.warmup_epochs < 0:
        raise ValueError(f"--warmup-epochs must be >= 0, got {args.warmup_epochs}")
    if args.wd < 0 or args.l2 < 0 or not args.tau > 0:
        raise ValueError("--wd and --l2 must be >= 0 and --tau > 0")
    if args.momentum is not None and not 0.0 <= args.momentum < 1.0:
        raise ValueError(f"--momentum (EMA decay) must lie in [0, 1), got {args.momentum}")
    if args.workers is not None and args.workers < 0:
        raise ValueError(f"--workers must be >= 0, got {args.workers}")
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} (global) is not divisible by the "
                         f"world size {world}")
    if args.queue_size is not None and args.method == "nac-mq":
        if args.queue_size % args.batch_size:
            raise ValueError(f"--queue-size {args.queue_size} must be a multiple of the global "
                             f"batch {args.batch_size}")
        if args.queue_size < 2 * args.batch_size:
            raise ValueError(f"--queue-size {args.queue_size} must hold at least the two views "
                             f"of one global batch ({2 * args.batch_size} codes)")
    if args.sync_bn and world == 1:
        raise ValueError("--sync-bn needs several processes (torchrun)")
    if args.sync_bn and (args.device == "cpu" or not torch.cuda.is_available()):
        raise ValueError("--sync-bn needs CUDA (PyTorch's SyncBatchNorm is GPU-only); on CPU the "
                         "NAC-MQ momentum branch uses shuffle BN")
    if args.amp == "fp16" and args.device == "cpu":
        raise ValueError("--amp fp16 needs a GPU (use bf16 or off on CPU)")


def build_loader(args, dist_info, channels_last):
    per_rank = args.batch_size // dist_info.world_size
    if args.data.startswith("synthetic"):
        from nac_fast.synthetic import SyntheticPairLoader
        n = int(args.data.split(":", 1)[1]) if ":" in args.data else 4096
        return SyntheticPairLoader(n, per_rank, dist_info.rank, dist_info.world_size, args.seed,
                                   image_size=args.image_size or 32, device=dist_info.device,
                                   channels_last=channels_last)
    if args.data != "fashion-mnist" and not os.path.exists(args.data):
        raise ValueError(f"--data {args.data!r}: no such file or directory (expected "
                         "fashion-mnist, a CIFAR-10 python dir, an ImageFolder root or synthetic)")
    try:
        from nac_fast.data import build_pretrain_loader
    except ImportError as exc:
        raise ValueError(f"the data loaders (nac_fast.data) cannot be imported: {exc}") from exc
    if args.workers is None:
        cpus = (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        workers = 0 if dist_info.device.type == "cpu" else max(0, min(8, cpus - 1))
    else:
        workers = args.workers
    try:
        return build_pretrain_loader(data=args.data, batch_size=per_rank, rank=dist_info.rank,
                                     world_size=dist_info.world_size, seed=args.seed,
                                     image_size=args.image_size, loader=args.loader,
                                     num_workers=workers, device=str(dist_info.device),
                                     channels_last=channels_last, dtype=torch.float32)
    except (FileNotFoundError, ValueError) as exc:
        # nac_fast.data's messages say how to get the data (e.g. the Debian package)
        raise ValueError(f"--data {args.data!r}: {exc}") from exc


def train_step(st, x):
    """One optimizer step on this rank's batch x (both views, on the device): the method's loss
    forward (under autocast) and backward, the LARS update, the lr schedule and the EMA of the
    momentum model.  Returns (loss, a), detached device tensors.

    No host sync: the loss-input value checks are off here (`step_value_checks`; the caller
    checks the loss, which NaN/inf inputs reach), scalars stay Python numbers, and nothing reads
    device data (tests/test_sync_free.py runs this function under a dispatch mode that fails on
    any host read).  The only exception is fp16 AMP: GradScaler.step reads its inf flag."""
    with step_value_checks(), st.autocast:
        if st.method == "nac":
            loss, a = nac_step(st.net, x, st.p, backend=st.loss_backend)
        elif st.method == "nac-mq":
            loss, a = nac_mq_step(st.net, st.mom_model, st.queue, x, st.p, st.l2,
                                  shuffle_bn=st.shuffle_bn, backend=st.loss_backend)
        else:
            loss, a = simclr_step(st.net, x, st.tau)
    st.optimizer.zero_grad(set_to_none=True)
    st.scaler.scale(loss).backward()
    st.scaler.step(st.optimizer)
    st.scaler.update()
    st.sched.step()
    if st.mom_model is not None:
        ema_update_(st.mom_model, st.model, st.decay)  # after the optimizer step
    return loss.detach(), a.detach()


class LossWatch:
    """What the loop needs from the per-step losses, kept on the device so that a step never
    waits for the host to read its loss.

    update(loss) (every step, device ops only) counts steps in a device tensor, records the FIRST
    step whose loss is non-finite and that loss (torch.where), and sums the window's losses.
    first_non_finite() and read_window() read them (a host sync and, with several processes, a
    collective: every rank calls them at the same steps): at log points and before saves."""

    NONE = 2 ** 62  # "no non-finite loss yet" (larger than any step: the ranks' MIN is the first)

    def __init__(self, step: int, device):
        self.step = torch.tensor(step, dtype=torch.int64, device=device)
        self.first_bad = torch.tensor(self.NONE, dtype=torch.int64, device=device)
        self.bad_value = torch.zeros((), dtype=torch.float32, device=device)
        self.win_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.win_n = 0
        self.first = None

    def update(self, loss: torch.Tensor) -> None:
        loss = loss.detach().float()
        self.step += 1
        new = torch.isfinite(loss).logical_not_() & (self.first_bad == self.NONE)
        self.first_bad = torch.where(new, self.step, self.first_bad)
        self.bad_value = torch.where(new, loss, self.bad_value)
        self.win_sum += loss
        self.win_n += 1
        if self.first is None:
            self.first = loss

    def first_non_finite(self):
        """(step, global loss at that step) of the first non-finite loss on any rank, or None.
        The value is the mean over the ranks whose loss went non-finite at that step (others count
        0): nan or +-inf like the mean over all ranks."""
        fb = self.first_bad.clone()
        if nd.is_dist():
            torch.distributed.all_reduce(fb, op=torch.distributed.ReduceOp.MIN)
        fb_step = int(fb)
        if fb_step == self.NONE:
            return None
        v = torch.where(self.first_bad == fb, self.bad_value, torch.zeros_like(self.bad_value))
        return fb_step, float(nd.all_reduce_mean(v))

    def read_window(self, loss: torch.Tensor):
        """(this step's loss, mean loss since the last read), both averaged over the ranks, as
        Python floats; starts a new window."""
        vals = nd.all_reduce_mean(torch.stack([loss.detach().float(),
                                               self.win_sum / max(self.win_n, 1)]))
        self.win_sum.zero_()
        self.win_n = 0
        loss_g, loss_avg = vals.tolist()
        return loss_g, loss_avg

    def first_loss(self):
        """The first step's loss of this process, averaged over the ranks (None without steps)."""
        return None if self.first is None else float(nd.all_reduce_mean(self.first))


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    resolve_defaults(args)
    try:
        check_args(args, world)
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2 before any work
    di = nd.init_distributed(args.device)
    try:
        return train(args, di, parser)
    finally:
        if nd.is_dist():
            torch.distributed.destroy_process_group()


def train(args, di, parser) -> int:
    main_rank = di.is_main
    say = print if main_rank else (lambda *a, **k: None)
    cuda = di.device.type == "cuda"
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    channels_last = args.channels_last
    amp = {"auto": "bf16" if cuda else "off"}.get(args.amp, args.amp)
    if amp == "fp16" and not cuda:
        parser.error("--amp fp16 needs a GPU (use bf16 or off on CPU)")
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    if args.loss_backend != "auto" and args.loss_backend not in available_backends(di.device):
        parser.error(f"--loss-backend {args.loss_backend} is not available for "
                     f"{di.device.type} tensors in this install; available: "
                     f"{available_backends(di.device)}")

    # ---- data; inconsistencies with the data set are reported before any training
    try:
        loader = build_loader(args, di, channels_last)
        if loader.num_images < args.batch_size:
            raise ValueError(f"--batch-size {args.batch_size} is larger than the data set "
                             f"({loader.num_images} images)")
        if len(loader) < 1:
            raise ValueError(f"--batch-size {args.batch_size} leaves no full batch per rank")
    except ValueError as exc:
        parser.error(str(exc))
    steps_per_epoch = len(loader)
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    if args.warmup_epochs is None:
        warmup = min(10 * steps_per_epoch, total_steps // 10)
    else:
        warmup = round(args.warmup_epochs * steps_per_epoch)
        if warmup > total_steps:
            parser.error(f"--warmup-epochs {args.warmup_epochs} ({warmup} steps) is longer than "
                         f"the run ({total_steps} steps)")
    image_size = loader.image_size
    small = image_size <= 64
    lr = args.lr if args.lr is not None else 0.075 * math.sqrt(args.batch_size)
    decay = args.momentum if args.momentum is not None else (0.99 if small else 0.999)
    queue_size = args.queue_size
    if args.method == "nac-mq" and queue_size is None:
        # Each step enqueues 2B keys, so keys are up to M / 2B steps old.  The paper's queues are
        # old by 25 (CIFAR: 50000, B = 1000) or 64 steps (ImageNet) out of 50,000 or more; in a
        # 700-step demo the 50000 queue (97 steps) let the whole batch drift away from the stale
        # queue mean together and every image got the same code (measured: mean Hamming distance
        # 23 -> 0.5 bits by step 240, docs/results.md).  16 x B keeps keys 8 steps old.
        queue_size = ((65536 // args.batch_size) * args.batch_size if args.recipe == "imagenet"
                      else 16 * args.batch_size)
        queue_size = max(queue_size, 2 * args.batch_size)
    cfg = dict(vars(args), world_size=di.world_size, lr=lr, momentum=decay, amp=amp,
               queue_size=queue_size, channels_last=channels_last, image_size=image_size,
               in_channels=loader.in_channels, num_images=loader.num_images,
               steps_per_epoch=steps_per_epoch, total_steps=total_steps, warmup_steps=warmup)

    # ---- model, momentum model, queue, optimizer, schedule
    model = build_model(args.arch, loader.in_channels, image_size, args.code_dim,
                        inference_net=args.method != "simclr", scale_codes=args.scale_codes)
    model.to(di.device)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    mom_model = queue = None
    if args.method == "nac-mq":
        mom_model = make_momentum_copy(model)  # before SyncBN: the key branch uses shuffle BN
        # codes stored in the loss's dtype (bf16 under the GPU's default AMP): the loss reads the
        # queue as it is, with no per-step conversion of M x D elements
        queue = CodeQueue(queue_size, args.code_dim, device=di.device,
                          dtype=amp_dtype or torch.float32)
    # From here on each rank draws its own channel noise (the loader seeds itself)
    torch.manual_seed(args.seed * 1000 + 1 + di.rank)
    if args.sync_bn:
        model = nd.convert_sync_bn(model)
    optimizer = LARS(param_groups_for_lars(model, args.wd), lr=lr, momentum=0.9,
                     weight_decay=args.wd, trust_coefficient=0.001)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup, total_steps))
    scaler = torch.amp.GradScaler(di.device.type, enabled=amp == "fp16")
    net = model
    if nd.is_dist():
        # BN running statistics stay per rank (no broadcast each forward): they only matter for
        # evaluation, where rank 0's are saved.  The flag was renamed in recent torch.
        ddp_kw = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                  inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
                  else {"broadcast_buffers": False})
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[di.local_rank] if cuda else None, gradient_as_bucket_view=True,
            **ddp_kw)
    if args.compile:
        net = torch.compile(net)
    autocast = (torch.autocast(di.device.type, dtype=torch.bfloat16 if amp == "bf16" else
                               torch.float16) if amp != "off" else contextlib.nullcontext())

    # ---- resume
    step = 0
    if main_rank:
        os.makedirs(args.out, exist_ok=True)
    ckpt_path = os.path.join(args.out, LAST)
    try:
        resume = resolve_resume(args.resume, args.out) if args.resume else None
    except ValueError as exc:
        parser.error(str(exc))
    if resume:
        # on the CPU: RNG states must stay CPU tensors; load_state_dict copies weights over
        ck = load_checkpoint(resume, map_location="cpu")
        old = ck["config"]
        for k in ("arch", "method", "batch_size", "code_dim", "data", "world_size",
                  "total_steps", "warmup_steps", "queue_size", "seed"):
            if old[k] != cfg[k]:
                parser.error(f"--resume {resume}: checkpoint has {k}={old[k]!r}, this run "
                             f"{cfg[k]!r}")
        model.load_state_dict(ck["model"])
        if mom_model is not None:
            mom_model.load_state_dict(ck["momentum_model"])
            queue.load_state_dict(ck["queue"])
        optimizer.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        step = ck["step"]
        restore_rng_state(ck["rng"][di.rank])
        say(f"resumed from {resume} at step {step} (epoch {ck['epoch']}, batch {ck['batch']})")

    def save(at_step):
        rng = nd.gather_objects(capture_rng_state())  # every rank's RNG, saved by rank 0
        if main_rank:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "momentum_model": mom_model.state_dict() if mom_model else None,
                     "queue": queue.state_dict() if queue else None,
                     "scheduler": sched.state_dict(), "scaler": scaler.state_dict(),
                     "step": at_step, "epoch": at_step // steps_per_epoch,
                     "batch": at_step % steps_per_epoch, "rng": rng, "config": cfg}
            save_atomic(state, ckpt_path)
        nd.barrier()

    if main_rank:
        with open(os.path.join(args.out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1, default=str)
        say(f"NAC pretraining: method={args.method} arch={args.arch} data={args.data} "
            f"({loader.num_images} images, {image_size}px, {loader.in_channels} ch) "
            f"world={di.world_size} device={di.device} batch={args.batch_size} lr={lr:.4g} "
            f"steps={total_steps} ({steps_per_epoch}/epoch, warm-up {warmup}) amp={amp}")

    # ---- train
    # a resumed run appends (its first records repeat the steps after the checkpoint, if the
    # previous process got further); a fresh run starts a new log
    log_f = open(os.path.join(args.out, "log.jsonl"), "a" if resume else "w") if main_rank else None
    bar = None
    if main_rank and args.progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=total_steps, initial=step, dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            say("(pip install tqdm for a progress bar)")
    stop = min(total_steps, args.stop_at_step or total_steps)
    status, last_loss, first_loss = 0, None, None
    win_t, win_wait, win_img = time.perf_counter(), 0.0, 0
    t_start = win_t
    net.train()
    if mom_model is not None:
        mom_model.train()
    st = SimpleNamespace(method=args.method, p=args.p, l2=args.l2, tau=args.tau,
                         shuffle_bn=args.shuffle_bn, loss_backend=args.loss_backend, net=net,
                         model=model, mom_model=mom_model, queue=queue, decay=decay,
                         optimizer=optimizer, scaler=scaler, sched=sched, autocast=autocast)
    # The step never reads device data on the host (tests/test_sync_free.py): the loss values are
    # kept on the device and read at log points and before every checkpoint save.
    watch = LossWatch(step, di.device)
    while step < stop and status == 0:
        loader.set_epoch(step // steps_per_epoch, start_batch=step % steps_per_epoch)
        it = iter(loader)
        while step < stop:
            t0 = time.perf_counter()
            try:
                v1, v2 = next(it)
            except StopIteration:
                break
            win_wait += time.perf_counter() - t0
            # each view to the device first: cat of (pinned) host tensors would make one pageable
            # tensor, whose copy blocks the host
            x = torch.cat([v1.to(di.device, non_blocking=True),
                           v2.to(di.device, non_blocking=True)])
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            lr_now = optimizer.param_groups[0]["lr"]  # the lr this update uses
            loss, a = train_step(st, x)
            watch.update(loss)
            step += 1
            win_img += args.batch_size
            if bar is not None:
                bar.update(1)
            log_due = step % args.log_every == 0 or step == stop
            save_due = step % args.save_every == 0 or step == stop
            if not (log_due or save_due):
                continue
            # Checked here, so no checkpoint is ever written after a non-finite loss.  Steps after
            # the first non-finite loss up to here did update the weights in memory (the step does
            # not wait to read the loss); they are never saved.
            bad = watch.first_non_finite()
            if bad is not None:
                bad_step, bad_value = bad
                if main_rank:
                    later = f" (found at step {step})" if bad_step != step else ""
                    print(f"\nnon-finite loss ({bad_value}) at step {bad_step}{later}; stopping. "
                          f"Last good checkpoint kept: "
                          f"{ckpt_path if os.path.exists(ckpt_path) else 'none'}", file=sys.stderr)
                status = 3
                break
            if log_due:
                loss_g, loss_avg = watch.read_window(loss)  # same values on every rank
                last_loss = loss_g
                # after the read, which waited for the window's device work: dt is its real time
                dt = time.perf_counter() - win_t
                if main_rank:
                    rec = {"step": step, "epoch": (step - 1) // steps_per_epoch, "loss": loss_g,
                           "loss_avg": loss_avg,
                           "elapsed_s": round(time.perf_counter() - t_start, 3),
                           "lr": lr_now,
                           "img_per_s": win_img / dt, "data_wait": win_wait / dt,
                           **code_stats(a[: a.shape[0] // 2])}
                    log_f.write(json.dumps(rec) + "\n")
                    log_f.flush()
                    if bar is not None:
                        bar.set_postfix(loss=f"{loss_g:.4f}", lr=f"{rec['lr']:.3g}",
                                        img_s=f"{rec['img_per_s']:.0f}",
                                        wait=f"{100 * rec['data_wait']:.0f}%")
                win_t, win_wait, win_img = time.perf_counter(), 0.0, 0
            if save_due:
                t_save = time.perf_counter()
                save(step)
                win_t += time.perf_counter() - t_save  # img/s measures training, not saving
    if status == 0:
        first_loss = watch.first_loss()
    if bar is not None:
        bar.close()
    if log_f is not None:
        log_f.close()
    if status == 0 and main_rank:
        print(f"done: step {step}/{total_steps}, loss {first_loss} -> {last_loss}; "
              f"checkpoint {ckpt_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
