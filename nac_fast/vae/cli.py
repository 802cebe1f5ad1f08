"""Train and evaluate the VAE of the paper's Table 5 from a random or a pretrained encoder.

    python -m nac_fast.vae --data fashion-mnist --init random --epochs 2 --out runs/vae/random
    python -m nac_fast.vae --init runs/nac/last.pt --epochs 2 --out runs/vae/nac     # fine-tune
    python -m nac_fast.vae --init runs/mq/last.pt --which momentum --freeze --out runs/vae/mq
    python -m nac_fast.vae ... --out runs/vae/nac --resume   # continue an interrupted run exactly

The model (nac_fast/vae/model.py, docs/math.md [M:vae-protocol]): the ResNet encoder, one Linear
layer to the mean and log-variance of a diagonal Gaussian posterior, a decoder that mirrors the
encoder with transposed convolutions, a discretised Gaussian likelihood over the 256 values of
each sub-pixel ([M:vae-dgauss]); N(0, I) prior.  Training maximises the one-sample ELBO with the
analytic KL ([M:vae-elbo], [M:vae-kl]) with Adam (0.9, 0.999, eps 1e-8, no weight decay), batch
128, lr 5e-4; a pretrained encoder is fine-tuned at --encoder-lr 5e-5 while the new linear layer
and the decoder keep 5e-4 (the paper's appendix), or kept fixed with --freeze (eval mode: its
BatchNorm statistics are the pretrained ones; a frozen random encoder, the control, keeps its
random weights but estimates its BatchNorm statistics from the training batches, as the random
baseline of docs/results.md does, since its initial statistics describe no data).  --init CKPT
takes the encoder of any train.py checkpoint (nac, nac-mq, simclr; --which online|momentum); its
architecture, channels and image size must match the data (ValueError otherwise).

Output in --out:
  log.jsonl          one record per --log-every steps (loss = -ELBO, elbo, recon, kl, lr, img/s)
                     and a final {"eval": ...} record
  last.pt, prev.pt   checkpoints (nac_fast/train/checkpoint.py's atomic rotation), every
                     --save-every steps and at every epoch's end; --resume continues from the
                     newest good one exactly (same batches, same noise)
  config.json        the run's flags and derived values
  eval.json          the evaluation in full (sizes of the subsets, bits/dim, timings)
  report.json        {"test": {"elbo", "iwae", "iwae_k", "kl", "recon"}, "init", "epochs"}, nats
                     per image; written last: its presence marks a finished run
  reconstructions.png  test images (odd rows) over their reconstructions (even rows: the
                     decoder's mean at z = the posterior mean)
  samples.png        the decoder's mean for z ~ N(0, I)

Test figures: elbo / recon / kl are over the --limit-test images of the test split (default: the
whole split), one posterior sample per image (kl analytic, recon = E_q log p(x|z), elbo = recon -
kl); iwae is the K-sample bound [M:vae-iwae] (K = --iwae-k) on --iwae-images evenly strided test
images (every (n // m)-th image, the first m; eval.json also has that subset's K-sample ELBO).

A folder that holds a finished run is not overwritten (error) unless --overwrite; one that holds
an unfinished run needs --resume (continue) or --overwrite (start again).  --overwrite deletes only
the files above of a run of this CLI (recognised by its config.json / checkpoints of kind "vae"),
and only once every argument, the data included, has been checked; a folder holding another
program's files under these names (a train.py run, an evaluation) is refused, never deleted.
--resume needs the same data (compared by absolute path and image count) and training flags; on a
finished run with a larger --epochs it extends it (training continues, the evaluation is redone),
and with other evaluation flags (--iwae-k, --iwae-images, --limit-test) it evaluates the trained
model again with them (no training).  Usage errors exit with status 2 before anything is written.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from .._checks import int_in
from .._files import check_writable
from ..train.checkpoint import (LAST, PREV, capture_rng_state, load_checkpoint, pick_checkpoint,
                                read_json, remove_stale_temp_files, restore_rng_state,
                                save_atomic, write_json_atomic)
from ..train.models import RESNETS
from .bounds import elbo_terms, iwae_bound
from .data import DEFAULT_MAX_BYTES, epoch_order, load_images, probe
from .encoder import load_pretrained_encoder
from .images import grid, save_png, to_u8
from .likelihood import decoder_mean
from .model import VAE

REPORT, EVAL, CONFIG, LOG = "report.json", "eval.json", "config.json", "log.jsonl"
PNGS = ("reconstructions.png", "samples.png")
STATE_KEYS = ("model", "optimizer", "config", "step", "epoch", "batch", "rng")
# Flags a resumed run must share with its checkpoint (epochs may grow; the rest is bookkeeping).
SAME_ON_RESUME = ("data", "init", "which", "freeze", "arch", "latent_dim", "batch_size", "lr",
                  "encoder_lr", "image_size", "limit_train", "seed")
# Flags of the evaluation only: a finished run resumed with other values is evaluated again.
EVAL_FLAGS = ("limit_test", "test_images", "iwae_k", "iwae_images")
RUN_FILES = (LAST, PREV, REPORT, EVAL, CONFIG, LOG) + PNGS
# --seed range: epoch_order seeds a generator with 1_000_003 * seed + epoch (a signed 64-bit int)
SEED_MAX = 2 ** 40
VERSION = 1


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m nac_fast.vae",
                                 description="Train a VAE whose encoder starts random or from a "
                                 "NAC / NAC-MQ / SimCLR checkpoint; report ELBO, IWAE and KL.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 allow_abbrev=False)
    a = ap.add_argument
    a("--data", default="fashion-mnist", help="fashion-mnist | CIFAR-10 dir | ImageFolder root "
      "(any data train.py reads)")
    a("--init", default="random", help="'random' or a train.py checkpoint whose encoder starts "
      "the VAE's encoder")
    a("--which", default="online", choices=("online", "momentum"),
      help="the checkpoint's online model or NAC-MQ's momentum (EMA) model")
    a("--freeze", action="store_true", help="keep the encoder's weights fixed; only the linear "
      "posterior layer and the decoder train (a pretrained encoder runs in eval mode, a random "
      "one estimates its BatchNorm statistics from the training batches)")
    a("--epochs", type=int, default=2, help="passes over the training split")
    a("--out", required=True, help="output folder")
    a("--resume", action="store_true", help="continue the run in --out from its newest good "
      "checkpoint (a fresh start if it has none)")
    a("--overwrite", action="store_true", help="delete the run files in --out first")
    a("--arch", default=None, choices=sorted(RESNETS), help="encoder for --init random "
      "(default resnet-tiny); with a checkpoint, its own (naming another is an error)")
    a("--latent-dim", type=int, default=32, help="dimension of z")
    a("--batch-size", type=int, default=128, help="training batch (paper: 128)")
    a("--lr", type=float, default=5e-4, help="Adam lr of the posterior layer, the decoder, and a "
      "random encoder (paper: 5e-4)")
    a("--encoder-lr", type=float, default=5e-5, help="Adam lr of a pretrained encoder when "
      "fine-tuned (paper: 5e-5)")
    a("--image-size", type=int, default=None, help="resize the images to this size (default: "
      "the data set's own; with --init it must be the checkpoint's)")
    a("--limit-train", type=int, default=None, help="train on N evenly strided training images")
    a("--limit-test", type=int, default=None, help="evaluate ELBO / KL on N evenly strided test "
      "images")
    a("--iwae-k", type=int, default=1000, help="importance samples K of the IWAE bound")
    a("--iwae-images", type=int, default=100, help="test images the IWAE bound is computed on "
      "(evenly strided; capped at the test images used)")
    a("--iwae-chunk", type=int, default=100, help="importance samples per image per decoder call")
    a("--eval-batch-size", type=int, default=500, help="decoder inputs per call when evaluating")
    a("--seed", type=int, default=0, help="seed of the init, the batch order, the noise and the "
      "evaluation's samples")
    a("--log-every", type=int, default=20, help="steps between log records")
    a("--save-every", type=int, default=200, help="steps between checkpoints (and at every "
      "epoch's end)")
    a("--stop-at-step", type=int, default=None, help="save and stop after this step (the run "
      "continues with --resume)")
    a("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    a("--device", default="auto", choices=("auto", "cpu", "cuda"))
    a("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    return ap


def check_args(args) -> None:
    """Checks that need neither a checkpoint nor data; ValueError naming the flag."""
    for flag in ("epochs", "latent_dim", "batch_size", "iwae_k", "iwae_images", "iwae_chunk",
                 "eval_batch_size", "log_every", "save_every"):
        v = getattr(args, flag)
        if v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    for flag in ("limit_train", "limit_test", "stop_at_step", "threads", "image_size"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if args.image_size is not None and args.image_size < 8:
        raise ValueError(f"--image-size must be >= 8, got {args.image_size}")
    for flag in ("lr", "encoder_lr"):
        v = getattr(args, flag)
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive number, got {v}")
    if args.resume and args.overwrite:
        raise ValueError("--resume and --overwrite contradict each other: pick one")
    if args.init != "random":
        if not os.path.exists(args.init):
            raise ValueError(f"--init {args.init!r}: no such file (use 'random' or a train.py "
                             "checkpoint)")
        if not os.path.isfile(args.init):
            raise ValueError(f"--init {args.init!r} is not a file")
    elif args.which != "online":
        raise ValueError("--which momentum needs --init CHECKPOINT (a random encoder has no "
                         "momentum model)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    int_in("--seed", args.seed, -SEED_MAX, SEED_MAX)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} exists and is not a folder")
    check_writable("--out", os.path.join(args.out, CONFIG))


# --------------------------------------------------------------------------------------------
# The run folder: a finished run is kept unless --overwrite
# --------------------------------------------------------------------------------------------

def _is_vae_checkpoint(path: str):
    """True / False for a checkpoint that loads (of this CLI or not), None when it does not load
    (a torn write of a run: its kind is unknown)."""
    try:
        ck = load_checkpoint(path, require=("config",))
    except ValueError:
        return None
    return isinstance(ck["config"], dict) and ck["config"].get("kind") == "vae"


def check_out(args) -> str:
    """What --out holds, deleting nothing: "empty" (none of this CLI's file names), "finished" or
    "started" (a run of this CLI), after refusing (ValueError naming --out) a folder whose files
    of those names are not this CLI's run (a train.py run, an evaluation, ...) or are not regular
    files, and a run that needs --resume or --overwrite."""
    out = args.out
    present = [n for n in RUN_FILES if os.path.lexists(os.path.join(out, n))]
    if not present:
        return "empty"
    for n in present:
        p = os.path.join(out, n)
        if not (os.path.islink(p) or os.path.isfile(p)):
            raise ValueError(f"--out {out!r}: {n!r} is not a regular file (a folder?); this CLI "
                             "does not delete it: remove or rename it, or name another --out")
    cfg = read_json(os.path.join(out, CONFIG))
    kinds = [_is_vae_checkpoint(os.path.join(out, n)) for n in (LAST, PREV) if n in present]
    if CONFIG in present:
        ours = isinstance(cfg, dict) and cfg.get("kind") == "vae" and False not in kinds
    else:
        ours = True in kinds and False not in kinds
    if not ours:
        raise ValueError(f"--out {out!r} holds {', '.join(present)} that are not a run of "
                         "python -m nac_fast.vae (a train.py run, an evaluation, ...?): nothing "
                         "there is replaced or deleted; name another --out")
    finished = os.path.isfile(os.path.join(out, REPORT))
    started = any(n in present for n in (LAST, PREV))
    if args.overwrite or args.resume:
        pass
    elif finished:
        raise ValueError(f"--out {out!r} holds a finished run ({REPORT}); pass --overwrite to "
                         "replace it, or --resume with a larger --epochs to extend it")
    elif started:
        raise ValueError(f"--out {out!r} holds an unfinished run ({LAST}); pass --resume to "
                         "continue it or --overwrite to start again")
    return "finished" if finished else "started"


def prepare_out(args) -> None:
    """Create --out; with --overwrite delete this CLI's run files there (check_out has vouched
    that they are a VAE run's).  Called once every argument has been checked."""
    out = args.out
    if args.overwrite:
        for n in RUN_FILES:
            p = os.path.join(out, n)
            if os.path.lexists(p):
                os.unlink(p)
    os.makedirs(out, exist_ok=True)
    remove_stale_temp_files(out)


def _not_vae(path: str, ck: dict) -> str | None:
    if isinstance(ck["config"], dict) and ck["config"].get("kind") == "vae":
        return None
    return f"{path} is not a checkpoint of python -m nac_fast.vae"


def pick_vae_checkpoint(out: str):
    """(path, checkpoint) of the newest good VAE checkpoint in out, (None, None) if none; a
    damaged last.pt falls back to prev.pt (train.checkpoint.pick_checkpoint, saying what it
    skipped); ValueError when checkpoints exist but none loads."""
    path, ck, notes = pick_checkpoint(out, reject=_not_vae, require=STATE_KEYS)
    if path is not None and notes:
        print("note: " + "; ".join(notes), file=sys.stderr)
    return path, ck


# --------------------------------------------------------------------------------------------
# Log
# --------------------------------------------------------------------------------------------

class Log:
    """OUT/log.jsonl (appended on resume) and a tqdm bar over the optimizer steps."""

    def __init__(self, out, append, total, initial, progress):
        self.f = open(os.path.join(out, LOG), "a" if append else "w")
        self.bar = None
        if progress:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, initial=initial, desc="vae", unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def write(self, rec):
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        if self.bar is not None and "elbo" in rec:
            self.bar.set_postfix(elbo=f"{rec['elbo']:.1f}", kl=f"{rec['kl']:.1f}",
                                 img_s=f"{rec['img_per_s']:.0f}")

    def tick(self):
        if self.bar is not None:
            self.bar.update(1)

    def close_bar(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self):
        self.close_bar()
        self.f.close()


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------

def strided_subset(n: int, m: int) -> torch.Tensor:
    """The first m of every (n // m)-th index of range(n) (m <= n)."""
    m = min(m, n)
    return torch.arange(0, n, max(1, n // m))[:m]


def evaluate(vae, test, args, device, progress) -> dict:
    """Test ELBO / recon / KL on every test image, the IWAE bound on a strided subset
    (docs/math.md [M:vae-elbo], [M:vae-kl], [M:vae-iwae])."""
    from tqdm.auto import tqdm
    vae.eval()
    g = torch.Generator(device=device).manual_seed(args.seed + 12345)
    n = len(test)
    t0 = time.perf_counter()
    sums = {"elbo": 0.0, "recon": 0.0, "kl": 0.0}
    with torch.no_grad(), tqdm(total=n, desc="test elbo", unit="img", disable=not progress,
                               file=sys.stderr) as bar:
        for s in range(0, n, args.eval_batch_size):
            x = test.images[s:s + args.eval_batch_size].to(device)
            xn = test.normalize(x)
            elbo, recon, kl = elbo_terms(xn, vae.posterior,
                                         lambda _, z, x=x: vae.log_likelihood(x, z), generator=g)
            for k, v in (("elbo", elbo), ("recon", recon), ("kl", kl)):
                sums[k] += float(v.double().sum())
            bar.update(x.shape[0])
    t_elbo = time.perf_counter() - t0
    idx = strided_subset(n, args.iwae_images)
    per_call = max(1, args.eval_batch_size // args.iwae_chunk)
    iw, el, kls = [], [], []
    t0 = time.perf_counter()
    with tqdm(total=len(idx), desc=f"iwae K={args.iwae_k}", unit="img", disable=not progress,
              file=sys.stderr) as bar:
        for s in range(0, len(idx), per_call):
            x = test.images[idx[s:s + per_call]].to(device)
            xn = test.normalize(x)
            r = iwae_bound(x, lambda _, xn=xn: vae.posterior(xn), vae.log_likelihood,
                           k=args.iwae_k, chunk=args.iwae_chunk, generator=g)
            iw.append(r.iwae.cpu())
            el.append(r.elbo.cpu())
            kls.append(r.kl.cpu())
            bar.update(x.shape[0])
    t_iwae = time.perf_counter() - t0
    iw, el, kls = torch.cat(iw), torch.cat(el), torch.cat(kls)
    pixels = test.channels * test.image_size ** 2
    res = {k: v / n for k, v in sums.items()}
    res.update(iwae=float(iw.mean()), iwae_k=int(args.iwae_k))
    bpd = lambda ll: -ll / (pixels * math.log(2.0))  # noqa: E731
    details = {
        "test_images": n, "test_split_images": test.total,
        "iwae_images": int(len(idx)), "iwae_subset": f"test images {idx[0].item()}, "
        f"{idx[1].item() if len(idx) > 1 else ''}... (every {max(1, n // len(idx))}-th, first "
        f"{len(idx)})",
        "iwae_subset_elbo_k_sample_mc": float(el.mean()),
        "iwae_subset_kl": float(kls.mean()),
        "iwae_minus_elbo_subset": float((iw - el).mean()),
        "iwae_std_over_images": float(iw.std()) if len(iw) > 1 else 0.0,
        "pixels": pixels,
        "bits_per_dim": {"elbo": bpd(res["elbo"]), "iwae": bpd(res["iwae"])},
        "seconds": {"elbo": round(t_elbo, 2), "iwae": round(t_iwae, 2)},
    }
    return {"test": res, "details": details}


def write_pngs(vae, test, out, device, seed, n=16):
    """reconstructions.png (test images over their reconstructions) and samples.png (64 prior
    samples), both the decoder's mean [M:vae-dgauss]."""
    vae.eval()
    with torch.no_grad():
        idx = strided_subset(len(test), n)
        x = test.images[idx].to(device)
        mu, _ = vae.posterior(test.normalize(x))
        rec = to_u8(decoder_mean(*vae.decode(mu))).cpu()
        x = x.cpu()
        ncol = 8
        rows = []
        for s in range(0, len(idx), ncol):
            rows += [x[s:s + ncol], rec[s:s + ncol]]
        save_png(grid(torch.cat(rows), ncol), os.path.join(out, PNGS[0]))
        g = torch.Generator(device=device).manual_seed(seed + 777)
        z = torch.randn((64, vae.latent_dim), generator=g, device=device)
        smp = to_u8(decoder_mean(*vae.decode(z))).cpu()
        save_png(grid(smp, 8), os.path.join(out, PNGS[1]))


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def _setup(args):
    """Everything that can fail on bad input, before any training: (config, encoder, info)."""
    check_args(args)
    enc, info = None, None
    if args.init != "random":
        enc, info = load_pretrained_encoder(args.init, args.which)
        if args.arch is not None and args.arch != info["arch"]:
            raise ValueError(f"--arch {args.arch}: the checkpoint's encoder is a {info['arch']} "
                             "(leave --arch out with --init CHECKPOINT)")
        arch = info["arch"]
    else:
        arch = args.arch or "resnet-tiny"
    channels, size, n_train = probe(args.data, "train", args.image_size)
    _, _, n_test = probe(args.data, "test", args.image_size)
    if info is not None:
        if channels != info["in_channels"]:
            raise ValueError(f"--data {args.data!r} has {channels}-channel images; the encoder of "
                             f"--init {args.init!r} takes {info['in_channels']}-channel images")
        if size != info["image_size"]:
            # no silent resize: the user says so with --image-size
            what = (f"--image-size {size}" if args.image_size is not None
                    else f"--data {args.data!r} has {size} px images;")
            raise ValueError(f"{what} the encoder of --init {args.init!r} was trained on "
                             f"{info['image_size']} px images (pass --image-size "
                             f"{info['image_size']} to resize the data to that size)")
    # the checks load_images would make, made before anything is written or deleted
    for split, n, limit in (("train", n_train, args.limit_train),
                            ("test", n_test, args.limit_test)):
        if limit is not None and limit > n:
            raise ValueError(f"--limit-{split} {limit} exceeds the {split} split's {n} images")
        need = (limit or n) * channels * size * size
        if need > DEFAULT_MAX_BYTES:
            raise ValueError(f"--data {args.data!r}: {limit or n} {split} images of {channels}x"
                             f"{size}x{size} need {need / 2 ** 30:.1f} GiB in memory (limit "
                             f"{DEFAULT_MAX_BYTES / 2 ** 30:.1f} GiB): use --limit-{split} or "
                             "--image-size")
    train_images = args.limit_train or n_train
    if train_images // args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size} exceeds the {train_images} training "
                         "images")
    cfg = {k: getattr(args, k) for k in ("data", "which", "freeze", "epochs", "latent_dim",
                                         "batch_size", "lr", "encoder_lr", "limit_train",
                                         "limit_test", "iwae_k", "iwae_images", "seed")}
    # a folder is named by its absolute path: a resume from another working directory compares
    # the same data (a data set's name stays a name)
    cfg["data"] = os.path.abspath(args.data) if os.path.exists(args.data) else args.data
    cfg.update(train_images=train_images, steps_per_epoch=train_images // args.batch_size,
               test_images=args.limit_test or n_test)
    # the IWAE subset as evaluated (strided_subset caps it at the test images): another value
    # above the test split's size is the same evaluation, not a reason to evaluate again
    cfg["iwae_images"] = min(args.iwae_images, cfg["test_images"])
    cfg.update(kind="vae", version=VERSION, arch=arch, in_channels=channels, image_size=size,
               init=args.init if args.init == "random" else os.path.abspath(args.init),
               init_info=info, pretrained=info is not None)
    return cfg, enc


def _same(a, b):
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-12)
        except (TypeError, ValueError):
            return False
    return a == b


def _same_data(cfg, old) -> bool:
    """The run's data: the same absolute path (a checkpoint of an older version may hold the
    path as given, relative) and the same number of training images."""
    a, b = cfg["data"], old.get("data")
    same_path = a == b or (isinstance(b, str) and os.path.exists(b) and os.path.abspath(b) == a)
    return same_path and cfg["train_images"] == old.get("train_images")


def _resume_checks(args, cfg, path, ck) -> str | None:
    """ValueError naming the flag when the command cannot continue the checkpoint's run;
    "done" for a finished run with the same evaluation flags, "reevaluate" for a finished run
    whose evaluation flags changed (printed), else None."""
    old = ck["config"]
    diff = [f"--{k.replace('_', '-')} {cfg[k]!r} (checkpoint: {old.get(k)!r})"
            for k in SAME_ON_RESUME if k != "data" and not _same(cfg[k], old.get(k))]
    if not _same_data(cfg, old):
        diff.insert(0, f"--data {args.data!r} = {cfg['data']!r} with {cfg['train_images']} "
                    f"training images (checkpoint: {old.get('data')!r} with "
                    f"{old.get('train_images')!r})")
    if diff:
        raise ValueError(f"--resume {path}: this command differs from the run's: "
                         + "; ".join(diff))
    total = args.epochs * old["steps_per_epoch"]
    if ck["step"] > total:
        raise ValueError(f"--epochs {args.epochs}: the run in {args.out!r} is already at "
                         f"step {ck['step']} (epoch {ck['epoch']}); it may be extended, "
                         "not shortened")
    if args.stop_at_step is not None and ck["step"] < total and args.stop_at_step <= ck["step"]:
        raise ValueError(f"--stop-at-step {args.stop_at_step}: the run in {args.out!r} is "
                         f"already at step {ck['step']}; name a later step, or leave "
                         "--stop-at-step out to finish it")
    if os.path.isfile(os.path.join(args.out, REPORT)) and ck["step"] == total:
        evaluated = read_json(os.path.join(args.out, CONFIG)) or {}
        changed = [f"--{k.replace('_', '-')} {cfg[k]!r} (report: {evaluated.get(k)!r})"
                   for k in EVAL_FLAGS if not _same(cfg[k], evaluated.get(k))]
        if not changed:
            return "done"
        print(f"{args.out}: finished run, re-evaluating it (no training) with other evaluation "
              "flags: " + "; ".join(changed))
        return "reevaluate"
    return None


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg, pre_encoder = _setup(args)
        check_out(args)
        path, ck = pick_vae_checkpoint(args.out) if args.resume else (None, None)
        reevaluate = False
        if ck is not None:
            what = _resume_checks(args, cfg, path, ck)
            if what == "done":
                print(f"{args.out}: finished run ({REPORT}), nothing to do")
                return 0
            reevaluate = what == "reevaluate"
    except (ValueError, FileNotFoundError, TypeError) as exc:
        parser.error(str(exc))  # exit status 2, nothing written

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if args.device == "auto" else args.device)
    t_start = time.perf_counter()
    try:
        train = load_images(args.data, "train", cfg["image_size"], args.limit_train, args.progress)
        test = load_images(args.data, "test", cfg["image_size"], args.limit_test, args.progress)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))  # nothing written or deleted yet
    spe = len(train) // args.batch_size
    if spe < 1 or len(train) != cfg["train_images"] or len(test) != cfg["test_images"]:
        parser.error(f"--data {args.data!r}: read {len(train)} training and {len(test)} test "
                     f"images, expected {cfg['train_images']} and {cfg['test_images']} (did the "
                     "data change while loading?)")
    cfg.update(mean=list(train.mean), std=list(train.std))
    try:
        # every check has passed: only now may --overwrite delete the old run's files
        prepare_out(args)
        if reevaluate:  # the old figures are stale; a failure below leaves no report to trust
            for n in (REPORT, EVAL):
                if os.path.lexists(os.path.join(args.out, n)):
                    os.unlink(os.path.join(args.out, n))
    except OSError as exc:
        parser.error(f"--out {args.out!r}: {exc.strerror or exc}")
    total = args.epochs * spe

    torch.manual_seed(args.seed)
    vae = VAE(cfg["arch"], cfg["in_channels"], cfg["image_size"], args.latent_dim)
    if pre_encoder is not None:
        vae.encoder.load_state_dict(pre_encoder.state_dict())
    if args.freeze:
        vae.encoder.requires_grad_(False)
    enc_lr = args.encoder_lr if cfg["pretrained"] else args.lr
    vae.to(device)
    opt = torch.optim.Adam(vae.param_groups(args.lr, enc_lr, args.freeze), betas=(0.9, 0.999),
                           eps=1e-8, weight_decay=0.0)
    step, epoch, batch = 0, 0, 0
    if ck is not None:
        vae.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        step, epoch, batch = int(ck["step"]), int(ck["epoch"]), int(ck["batch"])
        restore_rng_state(ck["rng"])
        cfg["run_id"] = ck["config"].get("run_id")
        print(f"resumed from {path} at step {step} (epoch {epoch}, batch {batch})")
    else:
        import uuid
        cfg["run_id"] = uuid.uuid4().hex
    write_json_atomic(cfg, os.path.join(args.out, CONFIG))

    saved = [step if ck is not None else None]  # the step last.pt holds

    def save():
        if saved[0] == step:
            return  # already on disk: a second save would make prev.pt a copy of last.pt
        state = {"model": vae.state_dict(), "optimizer": opt.state_dict(), "config": cfg,
                 "step": step, "epoch": epoch, "batch": batch, "rng": capture_rng_state()}
        save_atomic(state, os.path.join(args.out, LAST), previous=os.path.join(args.out, PREV))
        saved[0] = step

    log = Log(args.out, append=ck is not None, total=total, initial=step, progress=args.progress)
    stopped = False
    try:
        if step < total:
            # a finished run extended with a larger --epochs trains again: its report is stale
            for n in (REPORT, EVAL):
                if os.path.exists(os.path.join(args.out, n)):
                    os.unlink(os.path.join(args.out, n))
        win = {"elbo": 0.0, "recon": 0.0, "kl": 0.0, "n": 0}
        t_win = time.perf_counter()
        while step < total:
            order = epoch_order(len(train), args.seed, epoch)
            vae.train()
            if args.freeze and cfg["pretrained"]:
                vae.encoder.eval()  # the pretrained BatchNorm statistics, unchanged
            while batch < spe and step < total:
                idx = order[batch * args.batch_size:(batch + 1) * args.batch_size]
                x = train.images[idx].to(device)
                xn = train.normalize(x)
                elbo, recon, kl = elbo_terms(xn, vae.posterior,
                                             lambda _, z: vae.log_likelihood(x, z))
                loss = -elbo.mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        f"non-finite loss {loss.item()} at step {step + 1}; the checkpoints in "
                        f"{args.out} are those before it (try a lower --lr)")
                opt.step()
                step, batch = step + 1, batch + 1
                win["elbo"] += float(elbo.detach().sum())
                win["recon"] += float(recon.detach().sum())
                win["kl"] += float(kl.detach().sum())
                win["n"] += x.shape[0]
                log.tick()
                if step % args.log_every == 0 or step == total:
                    dt = time.perf_counter() - t_win
                    rec = {"step": step, "epoch": epoch, "loss": -win["elbo"] / win["n"]}
                    rec.update({k: win[k] / win["n"] for k in ("elbo", "recon", "kl")})
                    rec.update(lr=opt.param_groups[-1]["lr"], img_per_s=win["n"] / max(dt, 1e-9),
                               loadavg=os.getloadavg()[0])
                    log.write(rec)
                    win = {"elbo": 0.0, "recon": 0.0, "kl": 0.0, "n": 0}
                    t_win = time.perf_counter()
                if batch == spe:
                    epoch, batch = epoch + 1, 0
                    save()
                elif step % args.save_every == 0:
                    save()
                if args.stop_at_step is not None and step >= args.stop_at_step and step < total:
                    save()
                    stopped = True
                    break
            if stopped:
                break
        if stopped:
            print(f"stopped at step {step} (--stop-at-step); continue with --resume")
            return 0
        log.close_bar()
        t_train = time.perf_counter() - t_start
        result = evaluate(vae, test, args, device, args.progress)
        write_pngs(vae, test, args.out, device, args.seed)
        details = dict(result["details"], init=cfg["init"], init_info=cfg["init_info"],
                       which=args.which, freeze=args.freeze, arch=cfg["arch"],
                       latent_dim=args.latent_dim, train_steps=step, steps_per_epoch=spe,
                       train_images=len(train),
                       seconds_total=round(time.perf_counter() - t_start, 1),
                       seconds_train_this_process=round(t_train, 1), loadavg=os.getloadavg())
        write_json_atomic({"test": result["test"], "details": details},
                          os.path.join(args.out, EVAL))
        log.write({"step": step, "eval": result["test"]})
        report = {"test": {k: result["test"][k] for k in ("elbo", "iwae", "iwae_k", "kl", "recon")},
                  "init": cfg["init"], "epochs": args.epochs}
        write_json_atomic(report, os.path.join(args.out, REPORT))
    except FloatingPointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        log.close()
    t = result["test"]
    print(f"{args.out}: test ELBO {t['elbo']:.2f}, IWAE(K={t['iwae_k']}) {t['iwae']:.2f} "
          f"(on {result['details']['iwae_images']} images), KL {t['kl']:.2f}, recon "
          f"{t['recon']:.2f} nats/image; bits/dim (IWAE) "
          f"{result['details']['bits_per_dim']['iwae']:.3f}")
    return 0
