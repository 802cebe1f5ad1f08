"""A training run's configuration: one typed dataclass (TrainConfig), train.py's flags and
recipes that fill it, and the rules that resolve what depends on the data.

    cfg = parse(argv)        # TrainConfig: command line > recipe file > built-in values, checked
    cfg = resolve(cfg, ...)  # + the values that depend on the data and the processes

config.json and every checkpoint store ``asdict(cfg)`` (the resolved object), so a run has one
record of what it trained with.

A recipe is a TOML file of flag values (keys: the flags' names with '_' for '-', e.g.
``batch_size = 512``, ``flip_prob = 0.1``): ``--config configs/imagenet_nac_mq.toml``.  Without
--config the data's scale picks it (`auto_recipe`): at most 200,000 training images of at most
96 px get configs/small.toml (a CPU-sized run that learns on small data), larger data the paper's
ImageNet recipe configs/imagenet.toml; the file format (IDX, CIFAR batches, ImageFolder) does not
matter.  The recipe
is loaded with ``parser.set_defaults(**recipe)``: a flag given on the command line wins, and
``train.py --help`` shows the values a run will use (and the recipe file they come from).
Values left open (None) follow the rules of `resolve`:

    lr            0.075 * sqrt(global batch)                        (the paper's LARS rule)
    warmup        10 epochs, at most 10% of the run                 (the paper's 10 epochs)
    momentum      EMA decay 0.99 for images of <= 64 px, else 0.999
    queue_size    16 x the global batch; a recipe may also write "<k>x" (k x the global batch)
                  or a number of codes, which must be a multiple of the global batch (check)
    compile       on with CUDA (torch.compile of the encoders, inductor), off on CPU
    r_gain        "auto" = 2 (1 - 2 flip_prob) a_gain
    l2            (NAC-MQ) "auto" = 0.1 ((1 - 2p) / 0.8)^2 at the p of each step   ([M:mq-l2])
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import asdict, dataclass, field, replace

import torch

from .. import _checks
from ..ops.loss import mq_l2
from ..ops.momentum import MOMENTUM_BN
from ..ops.reference import LIKELIHOODS, REFERENCE_BACKENDS, SELF_KEYS
from ..data.sources.subset import TRAIN_SUBSETS, HashSubset
from .methods import METHODS
from .models import ARCHS, INFER_INITS, resolve_r_gain

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nac_fast/
# The checkout's configs/ (source tree, editable install), else the copy a wheel ships as
# nac_fast/configs (setup.py's package data).
CONFIG_DIR = next((d for d in (os.path.join(os.path.dirname(_PKG), "configs"),
                               os.path.join(_PKG, "configs")) if os.path.isdir(d)),
                  os.path.join(os.path.dirname(_PKG), "configs"))
# Without --config the recipe follows the training split's scale (nac_fast.data.data_scale), not
# its file format: up to SMALL_DATA_IMAGES images of at most SMALL_DATA_SIDE px is small data
# (configs/small.toml: a CPU-sized encoder and budget, and the heads that learn there,
# docs/results.md), anything larger keeps the paper's ImageNet recipe (configs/imagenet.toml) until a
# GPU run says otherwise.
# The flags that shape NAC's code head and inference network (nac_fast/train/models.py NACModel)
NAC_HEAD_OPTIONS = ("head_bn", "infer_bn", "a_gain", "r_gain", "learn_gain", "infer_init")
SMALL_DATA_IMAGES = 200_000
SMALL_DATA_SIDE = 96
AUTO_RECIPES = {"small": "small.toml", "large": "imagenet.toml"}
COMPILE_BACKENDS = ("inductor", "aot_eager")
MAX_SEED = 2**32 - 1    # --seed: numpy's range; every seed derived from it fits torch's 64 bits


class UsageError(ValueError):
    """A flag, a recipe or the data does not allow the run (train.py: status 2)."""


@dataclass
class TrainConfig:
    """A run's configuration.  The first group are train.py's flags (train.py --help; a recipe
    sets any of them but the per-run ones); `resolve` fills the values left open (None, "auto")
    and the second group once the data and the processes are known; `run.start` the third."""
    # ---- flags (the built-in values; recipes and the command line override them) ----
    recipe: str | None = None          # --config: the recipe file (parse: the file used)
    data: str = "fashion-mnist"
    arch: str = "resnet-tiny"
    method: str = "nac"
    flip_prob: float = 0.1
    flip_prob_final: float | None = None
    flip_prob_final_min_steps: int | None = None
    flip_prob_final_min_images: int | None = None
    channel_likelihood: str = "dot"
    self_key: str = "include"
    noise_draws: int = 1
    epochs: int | None = None
    max_steps: int | None = None
    min_steps: int | None = None
    batch_size: int | None = None      # global
    lr: float | None = None
    warmup_epochs: float | None = None
    wd: float = 1e-6
    queue_size: int | str | None = None
    momentum: float | None = None
    l2: float | str = 0.1              # or "auto" ([M:mq-l2])
    tau: float = 0.5
    code_dim: int = 128
    scale_codes: bool = True
    head_bn: bool = False
    infer_bn: bool = False
    a_gain: float = 1.0
    r_gain: float | str = 1.0
    learn_gain: bool = False
    infer_init: str = "independent"
    bn_per_view: bool = False
    infer_warmup_steps: int = 0
    collapse_warn: float = 0.05
    amp: str = "auto"
    channels_last: bool = True
    compile: bool | None = None        # None: on with CUDA, off on CPU (resolve)
    compile_backend: str = "inductor"
    loss_backend: str = "auto"
    sync_bn: bool = False
    shuffle_bn: bool = True
    momentum_bn: str = "shuffle"       # or "sync": SyncBatchNorm in the momentum encoder
    image_size: int | None = None
    crop_scale: list = field(default_factory=lambda: [0.08, 1.0])  # the crop's area [lo, hi]
    train_subset: str = "all"          # or "paper-hash" (docs/math.md [M:hash-split])
    queries_per_class: int = 1000      # paper-hash: queries per class of train + test
    train_per_class: int = 500         # paper-hash: training images per class of the gallery
    split_seed: int = 0                # paper-hash: the split's seed
    loader: str = "auto"
    on_bad_file: str = "warn"
    val_labels: str | None = None      # a flat val/'s labels file (ILSVRC2012's as distributed)
    workers: int | None = None
    device: str = "auto"
    out: str = "runs/default"
    resume: str | None = None
    overwrite: bool = False
    seed: int = 0
    log_every: int = 10
    save_every: int = 200
    save_mode: str = "async"           # a save's write: in a background thread, or "sync"
    tensorboard: bool = False
    stop_at_step: int | None = None
    progress: bool = True
    # ---- resolved from the data and the processes (resolve) ----
    world_size: int | None = None
    steps_per_epoch: int | None = None
    total_steps: int | None = None
    warmup_steps: int | None = None
    in_channels: int | None = None
    num_images: int | None = None
    batch_note: str | None = None      # parse: why the batch is not the recipe's (fit_batch)
    train_subset_sha256: str | None = None  # paper-hash: the subset's indices_digest (eval checks)
    # ---- the run's identity (run.start) ----
    run_id: str | None = None
    elastic_run_id: str | None = None
    extended: list = field(default_factory=list)   # extensions: [{step, from_total_steps, ...}]
    resized: list = field(default_factory=list)    # world-size changes: [{step, from_world_size,
                                                   # to_world_size}] (run.resize)

    def to_dict(self) -> dict:
        """What config.json and the checkpoints store (plain values: weights_only loads them)."""
        return asdict(self)


# Flags a recipe may not set: where a run writes and where it resumes from are per run.
PER_RUN = ("recipe", "out", "resume", "overwrite", "stop_at_step")


def _number_or_auto(what: str, ok):
    """An argparse/recipe type: 'auto', or a finite number for which ok(x) holds (`what` names
    the accepted values in argparse's message: "invalid <what> value")."""
    def parse(v):
        if isinstance(v, str) and v.strip() == "auto":
            return "auto"
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"expected a {what}, got {v!r}") from None
        if not (math.isfinite(x) and ok(x)):
            raise ValueError(f"expected a {what}, got {v!r}")
        return x
    parse.__name__ = what
    return parse


_gain = _number_or_auto("number > 0 or 'auto'", lambda g: g > 0)     # --r-gain
_l2 = _number_or_auto("number >= 0 or 'auto'", lambda x: x >= 0)     # --l2 ([M:mq-l2])


def _optional_int(v):
    """--flip-prob-final-min-steps/-images: an integer, or 'none' (no value)."""
    if v is None or isinstance(v, str) and v.strip().lower() == "none":
        return None
    if isinstance(v, bool) or isinstance(v, float) and not v.is_integer():
        raise ValueError(f"expected an integer or 'none', got {v!r}")
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ValueError(f"expected an integer or 'none', got {v!r}") from None


_optional_int.__name__ = "integer or 'none'"    # argparse: "invalid integer or 'none' value"


def _optional_float(v):
    """--flip-prob-final: a number, or 'none' (no value)."""
    if v is None or isinstance(v, str) and v.strip().lower() == "none":
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number or 'none', got {v!r}") from None


_optional_float.__name__ = "number or 'none'"


def _crop_scale(v):
    """--crop-scale: "LO" (the area range (LO, 1)) or "LO,HI"; a recipe may also write a number
    or a list [LO, HI].  0 < LO <= HI <= 1.  Returns [LO, HI] (a list: config.json and the
    checkpoints hold the same value)."""
    if isinstance(v, bool):
        raise ValueError(f"expected LO or LO,HI with 0 < LO <= HI <= 1, got {v!r}")
    if isinstance(v, (int, float)):
        parts = [v]
    elif isinstance(v, (list, tuple)):
        parts = list(v)
    else:
        parts = [t.strip() for t in str(v).split(",")]
    try:
        if not 1 <= len(parts) <= 2 or any(isinstance(x, bool) for x in parts):
            raise ValueError
        lo, hi = (float(parts[0]), float(parts[1]) if len(parts) == 2 else 1.0)
    except (TypeError, ValueError):
        raise ValueError(f"expected LO or LO,HI with 0 < LO <= HI <= 1, got {v!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and 0.0 < lo <= hi <= 1.0):
        raise ValueError(f"expected LO or LO,HI with 0 < LO <= HI <= 1, got {v!r}")
    return [lo, hi]


_crop_scale.__name__ = "crop scale (LO or LO,HI with 0 < LO <= HI <= 1)"


def _queue(v):
    """--queue-size: a number of codes, or "<k>x" (k global batches)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    t = str(v).strip()
    if t.isdigit():
        return int(t)
    if t.endswith("x") and t[:-1].isdigit() and int(t[:-1]) >= 1:
        return t
    raise ValueError(f"expected a number of codes or '<k>x' (k global batches), got {v!r}")


class _Parser(argparse.ArgumentParser):
    """argparse with a record of its flags (the Actions add_argument returns) and usage errors
    raised as UsageError (train.py prints them once, on rank 0, with the status line)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.flags: dict[str, list] = {}      # dest -> its actions (--flip-prob and --p: one dest)
        self.option_dest: dict[str, str] = {}  # "--flip-prob" -> "flip_prob"

    def add_argument(self, *a, **k):
        action = super().add_argument(*a, **k)
        if action.dest != "help":
            self.flags.setdefault(action.dest, []).append(action)
            for opt in action.option_strings:
                self.option_dest[opt] = action.dest
        return action

    def error(self, message):
        raise UsageError(message)

    def flag(self, dest: str) -> str:
        """The flag's own name (its first option string)."""
        return self.flags[dest][0].option_strings[0]


def build_parser() -> _Parser:
    """train.py's flags.  Their defaults are TrainConfig's; parse() lays the recipe over them
    with set_defaults and writes the effective default into each flag's help."""
    ap = _Parser(prog="train.py", description="Pretrain an encoder with NAC, NAC-MQ or SimCLR.",
                 allow_abbrev=False)
    a = ap.add_argument
    a("--config", dest="recipe", metavar="RECIPE", help="recipe file (TOML of flag values); "
      f"default by the data's scale: configs/small.toml for at most {SMALL_DATA_IMAGES:,} "
      f"training images of at most {SMALL_DATA_SIDE} px, else configs/imagenet.toml (the "
      "paper's)")
    a("--data", help="fashion-mnist | CIFAR-10 dir | ImageFolder root | synthetic[:N]")
    a("--arch", choices=sorted(ARCHS), help="encoder; resnet-tiny/resnet18-small are CPU-sized")
    a("--method", choices=METHODS, help="objective")
    a("--flip-prob", dest="flip_prob", type=float, metavar="P",
      help="bit-flip probability p of the channel, in (0, 0.5)")
    # A plain-python alias only: torchrun takes "--p" for an abbreviation of its own
    # --print-completion, so the docs, the recipes and the messages say --flip-prob.
    a("--p", dest="flip_prob", type=float, help=argparse.SUPPRESS)
    a("--flip-prob-final", dest="flip_prob_final", type=_optional_float, metavar="P1",
      help="p at the last step: p moves linearly from --flip-prob at the first step to this "
      "value at the last (docs/math.md [M:p-schedule]); 'none': p constant")
    a("--flip-prob-final-min-steps", dest="flip_prob_final_min_steps", type=_optional_int,
      metavar="N", help="--flip-prob-final applies to runs of at least N optimizer steps; a "
      "shorter run keeps p = --flip-prob throughout ([M:p-schedule]); 'none': no step threshold")
    a("--flip-prob-final-min-images", dest="flip_prob_final_min_images", type=_optional_int,
      metavar="M", help="--flip-prob-final applies to runs that see at least M training images "
      "(optimizer steps x global batch); a run that sees fewer keeps p = --flip-prob throughout "
      "([M:p-schedule]); 'none': no image threshold")
    a("--channel-likelihood", choices=LIKELIHOODS, help="the channel's relaxed likelihood: dot = "
      "exp(s z~.z), the paper's; multilinear = prod_d (1 + (1-2p) z~_d z_d) / 2, the channel's "
      "own (docs/math.md [M:multilinear]; not the paper's; the reference loss, no fused kernel)")
    a("--self-key", choices=SELF_KEYS, help="in-batch NAC (--method nac): include = each "
      "image's own clean code is one of its keys, the paper's; exclude = left out, a "
      "leave-one-out denominator (docs/math.md [M:self-key]; not the paper's; every loss "
      "backend)")
    a("--noise-draws", dest="noise_draws", type=int, metavar="K", help="in-batch NAC (--method "
      "nac): the loss averaged over K channel samples of each step's codes (docs/math.md "
      "[M:draws]; 1 = one sample, the paper's; each draw costs one loss call)")
    a("--epochs", type=int, help="epochs")
    a("--min-steps", type=int, help="with --epochs: at least this many optimizer steps (small "
      "data sets train longer than --epochs; the small-data recipe sets it)")
    a("--max-steps", type=int, help="total optimizer steps (overrides --epochs; the lr schedule "
      "spans this many steps). With --resume, a total larger than the checkpoint's extends the "
      "run: training continues exactly from the checkpoint and the cosine is restretched to end "
      "at the new total (the lr jumps up to the value a run planned with this total has at that "
      "step; the warm-up stays the checkpoint's)")
    a("--batch-size", type=int, help="GLOBAL batch (images per step, all processes)")
    a("--lr", type=float, help="base LARS lr")
    a("--warmup-epochs", type=float, help="linear lr warm-up length in epochs")
    a("--wd", type=float, help="weight decay (not on BN parameters and biases)")
    a("--queue-size", type=_queue, help="NAC-MQ queue length M: a multiple of the global batch, "
      "or '<k>x' (k global batches); the paper's 50000 collapses the codes of the short demo "
      "(docs/results.md)")
    a("--momentum", type=float, help="EMA decay of NAC-MQ's momentum model")
    a("--l2", type=_l2, help="lambda of NAC-MQ's lambda*||z||^2, or 'auto': the paper's 0.1 "
      "at its p = 0.1 scaled by ((1-2p)/0.8)^2 to the p of each step (0.039 at p = 0.25), "
      "docs/math.md [M:mq-l2]")
    a("--tau", type=float, help="SimCLR temperature")
    a("--code-dim", type=int, help="code bits D")
    a("--scale-codes", action=argparse.BooleanOptionalAction,
      help="divide a and r by sqrt(D); --no-scale-codes: the authors' initial scale")
    # Head options (nac_fast/train/models.py NACModel; docs/math.md [M:heads]).
    a("--head-bn", action=argparse.BooleanOptionalAction,
      help="BatchNorm1d(affine=False) at the end of the code head g")
    a("--infer-bn", action=argparse.BooleanOptionalAction,
      help="BatchNorm1d(affine=False) at the end of the inference network phi")
    a("--a-gain", type=float, help="gain of the codes: a = g(h) * gain / sqrt(D)")
    a("--r-gain", type=_gain, help="gain of the inference logits: r = phi(h') * gain / sqrt(D); "
      "'auto' = 2(1-2p) * --a-gain (the small-code optimum r ~ 2(1-2p) z)")
    a("--learn-gain", action=argparse.BooleanOptionalAction, help="the gains are learnable "
      "per-bit parameters (initialised to --a-gain, --r-gain) instead of fixed numbers")
    a("--infer-init", choices=INFER_INITS,
      help="initialise the inference network independently or as a copy of the code head")
    a("--bn-per-view", action=argparse.BooleanOptionalAction, help="one encoder/head pass per "
      "view (BatchNorm statistics per view, as the authors' two forward passes) instead of one "
      "pass over both views")
    a("--infer-warmup-steps", type=int, help="for this many first steps the NAC loss trains only "
      "the inference network (codes and its input detached)")
    a("--collapse-warn", type=float, help="warn once when the logged mean |tanh a| is below this "
      "after the lr warm-up (0: never)")
    a("--amp", choices=("auto", "bf16", "fp16", "off"),
      help="autocast dtype; auto = bf16 on GPU, off (fp32) on CPU")
    a("--channels-last", action=argparse.BooleanOptionalAction,
      help="NHWC memory format (faster convolutions on GPU and, measured, on CPU too)")
    a("--compile", action=argparse.BooleanOptionalAction,
      help="torch.compile the encoders: the online encoder's forward and backward and, for "
      "nac-mq, the momentum encoder's forward (no grad); the start line says what is "
      "compiled, the first step's line what it cost. --no-compile: eager, for debugging")
    a("--compile-backend", choices=COMPILE_BACKENDS,
      help="torch.compile's backend: inductor (generated kernels) or aot_eager (the traced "
      "graph run by eager ops: no code generation; tests and debugging)")
    a("--loss-backend", choices=("auto", "reference", "cpu", "triton", "cuda"),
      help="NAC loss backend (nac_fast.nac_loss's backend); auto = cpu on CPU, triton on GPU "
      "(cuda, the experimental tensor-core backend, only when named)")
    a("--sync-bn", action=argparse.BooleanOptionalAction,
      help="SyncBatchNorm in the online model (DDP)")
    a("--shuffle-bn", action=argparse.BooleanOptionalAction,
      help="MoCo's batch shuffle for the momentum branch (NAC-MQ, DDP); --no-shuffle-bn "
      "disables it")
    a("--momentum-bn", choices=MOMENTUM_BN,
      help="the NAC-MQ momentum encoder's BatchNorm under DDP: shuffle = MoCo's shuffle BN "
      "(per-rank statistics of rows shuffled across ranks: one all-to-all of the images, one of "
      "the codes back; --shuffle-bn applies), sync = SyncBatchNorm, the global batch's "
      "statistics (MoCo v3; no shuffle; a collective per BN layer; needs CUDA). "
      "docs/training.md weighs them")
    a("--image-size", type=int, help="crop size")
    a("--crop-scale", dest="crop_scale", type=_crop_scale, metavar="LO[,HI]",
      help="area range of the random resized crop, as a fraction of the image: LO (= LO,1) or "
      "LO,HI; 0.08 is SimCLR's and the authors' CIFAR code's, 0.2 MoCo v2's and the authors' "
      "ImageNet code's (docs/math.md [M:recipe]); every loader crops with it")
    a("--train-subset", choices=TRAIN_SUBSETS, help="all: the training split; paper-hash: the "
      "paper's hashing protocol (docs/math.md [M:hash-split]): pool the training and test "
      "splits, --queries-per-class random queries per class, the rest the gallery, and train on "
      "--train-per-class random gallery images per class (seed --split-seed): the images that "
      "python -m nac_fast.eval --hash-protocol paper assumes (it reads these flags from the "
      "checkpoint)")
    a("--queries-per-class", type=int, metavar="N",
      help="--train-subset paper-hash: queries per class")
    a("--train-per-class", type=int, metavar="N",
      help="--train-subset paper-hash: training images per class")
    a("--split-seed", type=int, metavar="S", help="--train-subset paper-hash: seed of the "
      "split (the evaluation's paper protocol takes the checkpoint's)")
    a("--loader", choices=("auto", "torchvision", "dali-cpu", "dali-gpu"), help="data loader")
    a("--on-bad-file", choices=("warn", "error"),
      help="an ImageFolder file that cannot be read: warn = skip it (named in one warning, "
      "replaced by the next readable image, counted in the loader's skipped_files), error = "
      "stop with an error naming it")
    a("--val-labels", metavar="FILE", help="labels of a flat val/ (ILSVRC2012's as distributed: "
      "LOC_val_solution.csv, or the devkit's ILSVRC2012_validation_ground_truth.txt with a "
      "synsets.txt beside it); default: the one at the --data root or its parent. Read by "
      "--train-subset paper-hash, which pools train/ and val/")
    a("--workers", type=int, help="data workers per process")
    a("--device", choices=("auto", "cpu", "cuda"), help="auto = cuda when available")
    a("--out", help="output directory: last.pt, prev.pt, log.jsonl, config.json, status.json. "
      "A fresh run refuses a directory that holds a run (checkpoints or a log): use --resume, "
      "another --out, or --overwrite")
    a("--resume", nargs="?", const="auto", metavar="PATH",
      help="resume from the newest good checkpoint in --out (last.pt, else prev.pt), or from "
      "the given file or directory; stops (status 2) when there is none. Under torchrun "
      "--max-restarts=K a restarted worker group resumes from --out's newest checkpoint by "
      "itself")
    a("--overwrite", action="store_true", help="start a fresh run (or, with --resume PATH, "
      "continue PATH's run) in an --out that holds another run, deleting its last.pt, prev.pt, "
      "log.jsonl, non_finite.json, status.json and tensorboard/ event files when the new run "
      "starts")
    a("--seed", type=int, help="random seed, in [0, 2^32 - 1]")
    a("--log-every", type=int, help="log every this many steps (OUT/log.jsonl)")
    a("--save-every", type=int, help="checkpoint every this many steps (and at the end) to "
      "OUT/last.pt, the previous one kept as OUT/prev.pt; a crash loses at most this many steps "
      "(with --save-mode async, plus those taken while the newest save was being written)")
    a("--save-mode", choices=("async", "sync"), help="async: a save copies the state to host "
      "memory and a background thread writes it while training goes on (the next save, and the "
      "run's end, wait for it; a failed write stops the run there, status 4); sync: every rank "
      "waits until rank 0 has written the file")
    a("--tensorboard", action=argparse.BooleanOptionalAction,
      help="also log to OUT/tensorboard (torch.utils.tensorboard; needs the tensorboard package)")
    a("--stop-at-step", type=int, help="save and exit after this step although the schedule runs "
      "to --max-steps (split a run over job time limits)")
    a("--progress", action=argparse.BooleanOptionalAction, help="a tqdm bar with an ETA")
    built_in = TrainConfig()
    ap.set_defaults(**{d: getattr(built_in, d) for d in ap.flags})
    return ap


# What a flag left open (None or "auto") becomes: shown in --help next to the default.
def _rules(d: dict) -> dict:
    b = d.get("batch_size")
    out = {
        "lr": "0.075 x sqrt(global batch)" + (f" = {0.075 * math.sqrt(b):.4g} at batch {b}"
                                              if isinstance(b, int) and b > 0 else ""),
        "warmup_epochs": "10 epochs, at most 10%% of the run" + (
            f" = {min(10.0, 0.1 * d['epochs']):g} epochs here"
            if isinstance(d.get("epochs"), int) and d.get("max_steps") is None else ""),
        "momentum": "0.99 for images of <= 64 px, else 0.999",
        "image_size": "the data's native size",
        "workers": "0 on CPU, else min(8, CPUs per process - 1)",
        "epochs": "none: the recipe must set it, or give --max-steps",
        "max_steps": "--epochs x steps per epoch, at least --min-steps",
        "min_steps": "none",
        "recipe": "chosen by --data",
        "resume": "a fresh run",
        "stop_at_step": "run to the end",
        "flip_prob_final": "none: p constant",
        "flip_prob_final_min_steps": "none: no step threshold",
        "flip_prob_final_min_images": "none: no image threshold",
        "compile": "on with CUDA, off on CPU",
    }
    q = d.get("queue_size")
    if q is None or isinstance(q, str):
        k = int(q[:-1]) if isinstance(q, str) else 16
        out["queue_size"] = f"{k} x global batch" + (f" = {k * b}" if isinstance(b, int) else "")
        if q is not None:
            out["queue_size"] = f"{q} = " + out["queue_size"]
    if d.get("r_gain") == "auto" and isinstance(d.get("a_gain"), (int, float)):
        p = d.get("flip_prob")
        out["r_gain"] = f"auto = 2(1-2p) x a_gain = {2 * (1 - 2 * p) * d['a_gain']:.4g}"
    if d.get("l2") == "auto" and isinstance(d.get("flip_prob"), (int, float)):
        p = d["flip_prob"]
        out["l2"] = f"auto = 0.1 ((1-2p)/0.8)^2 = {mq_l2(p):.4g} at p = {p:g}"
    return out


def _describe_defaults(parser: _Parser, path: str, recipe: dict, why: str = "") -> None:
    """Each flag's help ends with the value a run without that flag uses, and where it comes from
    (the recipe file or the built-in value)."""
    values = {d: parser.get_default(d) for d in parser.flags}
    rules, rel = _rules(values), _display(path)
    for dest, actions in parser.flags.items():
        v = values[dest]
        if (actions[0].nargs == 0 and dest not in recipe
                and not isinstance(actions[0], argparse.BooleanOptionalAction)):
            continue  # --sync-bn, --no-progress, ...: their help says what they do
        shown = rules.get(dest) if v is None or dest in ("queue_size", "r_gain", "l2") else None
        shown = rel if dest == "recipe" else shown or str(v).replace("%", "%%")
        src = f"; from {rel}" if dest in recipe else ""
        actions[0].help = f"{actions[0].help} [default: {shown}{src}]"
    parser.epilog = (f"Defaults above: what a run with no other flags uses: the recipe {rel}"
                     + (f" ({why})" if why else "") + " over the built-in values (marked "
                     f"'from {rel}' where the recipe sets them); any flag given wins. Values "
                     "left open follow nac_fast/train/config.py's rules. Exit status: 0 done, "
                     "2 bad flags/recipe/data/--out/checkpoint, 3 non-finite loss, 4 --out not "
                     "writable; under torchrun, which exits 1, the last line of rank 0 "
                     "'train.py: exit status N' and OUT/status.json say which (docs/training.md).")


def _display(path: str) -> str:
    """A path as a user would type it: relative to the working directory when inside it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def data_listing(out):
    """The Listing with which every rank reads an ImageFolder's scale before the run's processes
    know each other: the scan that rank 0 cached in --out (a restart), else a walk of the
    folders (nac_fast/data/sources/listing.py)."""
    from ..data.sources import Listing
    return Listing(cache_dir=out) if isinstance(out, str) else None


def auto_recipe(data: str, out: str | None = None) -> tuple[str, str]:
    """(recipe file, why) for a run without --config: by the scale of `data`'s training split
    (SMALL_DATA_IMAGES, SMALL_DATA_SIDE).  Data that cannot be read gets the small recipe; the
    run then stops at the data with the loader's message."""
    try:
        from ..data.sources import data_scale
        n, side = data_scale(data, listing=data_listing(out))
    except (OSError, ValueError, TypeError) as exc:
        return (os.path.join(CONFIG_DIR, AUTO_RECIPES["small"]),
                f"--data {data!r} could not be read ({exc})")
    small = n <= SMALL_DATA_IMAGES and side <= SMALL_DATA_SIDE
    why = (f"--data {data}: {n:,} training images of {side} px, "
           + (f"at most {SMALL_DATA_IMAGES:,} images of at most {SMALL_DATA_SIDE} px: small data"
              if small else f"more than {SMALL_DATA_IMAGES:,} images or larger than "
                            f"{SMALL_DATA_SIDE} px: the paper's ImageNet recipe"))
    return os.path.join(CONFIG_DIR, AUTO_RECIPES["small" if small else "large"]), why


def recipe_path(config: str | None, data: str) -> str:
    return config if config else auto_recipe(data)[0]


def load_recipe(path: str, parser: _Parser) -> dict:
    """A recipe's flag values, checked against the flags (UsageError naming the file and key)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ModuleNotFoundError as exc:
            raise UsageError("reading a recipe needs Python >= 3.11 (tomllib) or the tomli "
                             "package") from exc
    if not os.path.isfile(path):
        raise UsageError(f"--config {path!r}: no such recipe file (recipes: {CONFIG_DIR})")
    try:
        with open(path, "rb") as f:
            recipe = tomllib.load(f)
    except OSError as exc:
        raise UsageError(f"--config {path!r} cannot be read: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:  # TOML is UTF-8
        raise UsageError(f"--config {path!r}: not valid TOML: {exc}") from exc
    out = {}
    for key, value in recipe.items():
        if key == "description":
            continue
        where = f"--config {path!r}: {key} = {value!r}"
        if key not in parser.flags or key in PER_RUN:
            raise UsageError(f"--config {path!r}: unknown or per-run key {key!r} (a recipe sets "
                             "flag values: batch_size, epochs, method, flip_prob, ...)")
        action = parser.flags[key][0]
        if action.nargs == 0:                       # switches: true / false
            if not isinstance(value, bool):
                raise UsageError(f"{where}: must be true or false")
        elif action.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise UsageError(f"{where}: must be an integer")
        elif action.type is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"{where}: must be a number")
            value = float(value)
        elif action.type is not None:
            if isinstance(value, bool):
                raise UsageError(f"{where}: has the wrong type")
            try:
                value = action.type(value)
            except (TypeError, ValueError) as exc:
                raise UsageError(f"{where}: {exc}") from exc
        elif not isinstance(value, str):
            raise UsageError(f"{where}: must be a string")
        if action.choices is not None and value not in action.choices:
            raise UsageError(f"{where}: must be one of {sorted(action.choices)}")
        out[key] = value
    return out


def _typed_flags(argv, parser: _Parser) -> dict:
    """{dest: the option string the user typed} (the last one, as argparse keeps)."""
    typed = {}
    for tok in argv:
        if tok == "--":
            break
        opt = tok.split("=", 1)[0]
        if opt in parser.option_dest:
            typed[parser.option_dest[opt]] = opt
    return typed


def parse(argv=None) -> TrainConfig:
    """The run's configuration: the command line over the recipe over the built-in values,
    checked.  UsageError (a ValueError) naming the flag as typed, or the recipe file and key."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    pre.add_argument("--data", default=TrainConfig.data)
    pre.add_argument("--out", default=TrainConfig.out)
    known, _ = pre.parse_known_args(argv)
    path, why = ((known.config, "given with --config") if known.config else
                 auto_recipe(known.data, known.out))
    recipe = load_recipe(path, parser)
    parser.set_defaults(**recipe)
    parser.set_defaults(recipe=os.path.abspath(path))
    _describe_defaults(parser, path, recipe, why)
    cfg = TrainConfig(**vars(parser.parse_args(argv)))
    cfg.recipe = os.path.abspath(cfg.recipe)
    typed = _typed_flags(argv, parser)
    if cfg.method == "simclr":
        # The recipe's head options are NAC's (its code head and inference network); SimCLR keeps
        # its own head (the flags' built-in values), and a typed head flag is an error.
        for dest in NAC_HEAD_OPTIONS:
            if dest in typed:
                raise UsageError(f"{typed[dest]} sets NAC's heads; --method simclr has its own "
                                 "projection head")
            setattr(cfg, dest, getattr(TrainConfig, dest))

    def name(dest):
        if dest in typed:
            return typed[dest]
        if dest in recipe:
            return f"{dest} (recipe {_display(path)})"
        return parser.flag(dest)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if "batch_size" not in typed and isinstance(cfg.batch_size, int) and cfg.batch_size > 0:
        _fit_batch_to_data(cfg, world)
    check(cfg, world, name)
    return cfg


def hash_subset(cfg) -> HashSubset | None:
    """The run's --train-subset as the data layer takes it: None (the training split), or the
    paper's hashing subset (a HashSubset of --queries-per-class, --train-per-class,
    --split-seed)."""
    if cfg.train_subset == "all":
        return None
    return HashSubset(cfg.queries_per_class, cfg.train_per_class, cfg.split_seed)


def fit_batch(batch: int, num_images: int, world: int) -> int:
    """A recipe's global batch for a data set of `num_images` training images: halved while it
    is more than a quarter of them (so that an epoch has at least 4 batches) and its half is
    still a multiple of the `world` processes.  ValueError naming an argument that is not a
    positive int (num_images may be 0)."""
    _checks.positive_int("batch", batch)
    _checks.positive_int("world", world)
    _checks.int_in("num_images", num_images, 0)
    while batch > num_images // 4 and batch % 2 == 0 and (batch // 2) % world == 0:
        batch //= 2
    return batch


def _fit_batch_to_data(cfg: TrainConfig, world: int) -> None:
    """The recipe's batch (not typed) fitted to the data (fit_batch), with the reason in
    cfg.batch_note for the start line; data that cannot be read is left to the loader's
    message."""
    try:
        from ..data.sources import data_scale
        n = data_scale(cfg.data, hash_subset(cfg), val_labels=cfg.val_labels,
                       listing=data_listing(cfg.out))[0]
    except (OSError, ValueError, TypeError):
        return
    b = fit_batch(cfg.batch_size, n, world)
    if b != cfg.batch_size:
        cfg.batch_note = (f"the recipe's {cfg.batch_size} halved to a quarter of the {n} "
                          f"training images or less; --batch-size sets it")
        cfg.batch_size = b


# The float flags that must be finite numbers (check: nan and inf refused, naming the flag)
FINITE_FLOATS = ("lr", "warmup_epochs", "wd", "tau", "collapse_warn", "a_gain", "flip_prob",
                 "flip_prob_final", "momentum", "r_gain")  # (l2: its own check, below)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check(cfg: TrainConfig, world: int, name=_flag) -> None:
    """Checks that need no data; UsageError naming the flag (`name(dest)`: as the user gave it)."""
    if cfg.val_labels is not None and not os.path.isfile(cfg.val_labels):
        raise UsageError(f"{name('val_labels')} {cfg.val_labels!r}: no such file")
    pos = {d: getattr(cfg, d) for d in ("batch_size", "epochs", "log_every", "save_every",
                                         "code_dim", "noise_draws")}
    for d in ("max_steps", "min_steps", "image_size", "stop_at_step",
              "flip_prob_final_min_steps", "flip_prob_final_min_images"):
        if getattr(cfg, d) is not None:
            pos[d] = getattr(cfg, d)
    if isinstance(cfg.queue_size, int):
        pos["queue_size"] = cfg.queue_size
    if cfg.train_subset != "all":
        pos.update(queries_per_class=cfg.queries_per_class, train_per_class=cfg.train_per_class)
    for d, v in pos.items():
        if v is None:
            if d == "epochs" and cfg.max_steps is not None:
                continue
            raise UsageError(f"{name(d)} has no value: give it, or set it in the recipe")
        if v < 1:
            raise UsageError(f"{name(d)} must be >= 1, got {v}")
    if cfg.image_size is not None and cfg.image_size < 8:   # the loaders' smallest crop
        raise UsageError(f"{name('image_size')} must be >= 8, got {cfg.image_size}")
    try:
        cfg.crop_scale = _crop_scale(cfg.crop_scale)
    except ValueError as exc:
        raise UsageError(f"{name('crop_scale')}: {exc}") from None
    if not 0 <= cfg.seed <= MAX_SEED:   # seed * 1000 + rank seeds torch: within its 64 bits
        raise UsageError(f"{name('seed')} must lie in [0, {MAX_SEED}], got {cfg.seed}")
    if cfg.train_subset != "all" and cfg.split_seed < 0:
        raise UsageError(f"{name('split_seed')} must be >= 0, got {cfg.split_seed}")
    if not 0.0 < cfg.flip_prob < 0.5:
        raise UsageError(f"{name('flip_prob')} must lie in (0, 0.5), got {cfg.flip_prob}")
    if cfg.flip_prob_final is not None and not 0.0 < cfg.flip_prob_final < 0.5:
        raise UsageError(f"{name('flip_prob_final')} must lie in (0, 0.5), got "
                         f"{cfg.flip_prob_final}")
    if cfg.channel_likelihood == "multilinear" and cfg.loss_backend not in REFERENCE_BACKENDS:
        raise UsageError(f"{name('loss_backend')} {cfg.loss_backend}: the fused kernels compute "
                         f"the dot likelihood only; {name('channel_likelihood')} multilinear runs "
                         "on the reference loss (give --loss-backend auto or reference)")
    if cfg.self_key == "exclude" and cfg.method != "nac":
        raise UsageError(f"{name('self_key')} exclude is an option of in-batch NAC (--method "
                         f"nac), not of {cfg.method} (docs/math.md [M:self-key])")
    if cfg.noise_draws != 1 and cfg.method != "nac":
        raise UsageError(f"{name('noise_draws')} {cfg.noise_draws} is an option of in-batch NAC "
                         f"(--method nac), not of {cfg.method} (docs/math.md [M:draws])")
    for d in FINITE_FLOATS:   # nan/inf pass "< 0" tests and train to NaN weights
        v = getattr(cfg, d)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isfinite(v):
            raise UsageError(f"{name(d)} must be a finite number, got {v}")
    if cfg.lr is not None and not cfg.lr > 0:
        raise UsageError(f"{name('lr')} must be > 0, got {cfg.lr}")
    if cfg.warmup_epochs is not None and cfg.warmup_epochs < 0:
        raise UsageError(f"{name('warmup_epochs')} must be >= 0, got {cfg.warmup_epochs}")
    if not cfg.a_gain > 0:
        raise UsageError(f"{name('a_gain')} must be > 0, got {cfg.a_gain}")
    for d in ("infer_warmup_steps", "collapse_warn", "wd"):
        if getattr(cfg, d) < 0:
            raise UsageError(f"{name(d)} must be >= 0, got {getattr(cfg, d)}")
    try:
        _l2(cfg.l2)
    except ValueError as exc:
        raise UsageError(f"{name('l2')}: {exc}") from None
    if not cfg.tau > 0:
        raise UsageError(f"{name('tau')} must be > 0, got {cfg.tau}")
    if cfg.momentum is not None and not 0.0 <= cfg.momentum < 1.0:
        raise UsageError(f"{name('momentum')} (EMA decay) must lie in [0, 1), got "
                         f"{cfg.momentum}")
    if cfg.workers is not None and cfg.workers < 0:
        raise UsageError(f"{name('workers')} must be >= 0, got {cfg.workers}")
    if cfg.batch_size % world:
        raise UsageError(f"{name('batch_size')} {cfg.batch_size} (global) is not divisible by "
                         f"the world size {world}")
    if isinstance(cfg.queue_size, int) and cfg.method == "nac-mq":
        if cfg.queue_size % cfg.batch_size:
            raise UsageError(f"{name('queue_size')} {cfg.queue_size} must be a multiple of the "
                             f"global batch {cfg.batch_size}")
        if cfg.queue_size < 2 * cfg.batch_size:
            raise UsageError(f"{name('queue_size')} {cfg.queue_size} must hold at least the two "
                             f"views of one global batch ({2 * cfg.batch_size} codes)")
    if cfg.resume in ("auto", "latest") and cfg.overwrite:
        raise UsageError("--resume and --overwrite contradict each other: --resume continues "
                         "the run in --out, --overwrite replaces it (--resume PATH --overwrite "
                         "continues PATH's run in --out, replacing the other run there)")
    if cfg.momentum_bn == "sync" and cfg.method == "nac-mq":
        if world == 1:
            raise UsageError(f"{name('momentum_bn')} sync needs several processes (torchrun)")
        if cfg.device == "cpu" or not torch.cuda.is_available():
            raise UsageError(f"{name('momentum_bn')} sync needs CUDA (PyTorch's SyncBatchNorm "
                             "is GPU-only); on CPU use --momentum-bn shuffle")
    if cfg.sync_bn and world == 1:
        raise UsageError(f"{name('sync_bn')} needs several processes (torchrun)")
    if cfg.sync_bn and (cfg.device == "cpu" or not torch.cuda.is_available()):
        raise UsageError(f"{name('sync_bn')} needs CUDA (PyTorch's SyncBatchNorm is GPU-only); "
                         "on CPU the NAC-MQ momentum branch uses shuffle BN")
    if cfg.amp == "fp16" and cfg.device == "cpu":
        raise UsageError("--amp fp16 needs a GPU (use bf16 or off on CPU)")
    if cfg.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError as exc:
            raise UsageError(f"{name('tensorboard')} needs the tensorboard package (pip install "
                             "tensorboard, or the [dev] extra)") from exc


def default_workers(cfg: TrainConfig, device_type: str) -> int:
    """--workers' rule: 0 on CPU (in-memory data augments in the training process), else
    min(8, CPUs per process - 1)."""
    if cfg.workers is not None:
        return cfg.workers
    cpus = (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return 0 if device_type == "cpu" else max(0, min(8, cpus - 1))


def _queue_size(value, batch: int, method: str) -> int | None:
    if method != "nac-mq":
        return None
    if value is None:
        value = "16x"
    if isinstance(value, str):                       # "<k>x": k global batches
        size = int(value[:-1]) * batch
    else:                                            # a number, e.g. the paper's 65536
        size = (int(value) // batch) * batch
    return max(size, 2 * batch)


def resolve(cfg: TrainConfig, *, world_size: int, device_type: str, steps_per_epoch: int,
            image_size: int, in_channels: int, num_images: int,
            train_subset_sha256: str | None = None) -> TrainConfig:
    """The configuration with every value the run uses (the module docstring's rules), as a new
    TrainConfig (`train_subset_sha256`: the --train-subset's indices_digest, None for all of
    the training split); UsageError naming the flag."""
    total = cfg.max_steps or max(cfg.epochs * steps_per_epoch, cfg.min_steps or 0)
    if cfg.warmup_epochs is None:
        warmup = min(10 * steps_per_epoch, total // 10)
    else:
        warmup = round(cfg.warmup_epochs * steps_per_epoch)
        if warmup > total:
            raise UsageError(f"--warmup-epochs {cfg.warmup_epochs} ({warmup} steps) is longer "
                             f"than the run ({total} steps)")
    amp = {"auto": "bf16" if device_type == "cuda" else "off"}.get(cfg.amp, cfg.amp)
    if amp == "fp16" and device_type != "cuda":
        raise UsageError("--amp fp16 needs a GPU (use bf16 or off on CPU)")
    return replace(
        cfg, world_size=world_size, device=device_type, steps_per_epoch=steps_per_epoch,
        total_steps=total, warmup_steps=warmup, image_size=image_size, in_channels=in_channels,
        num_images=num_images, train_subset_sha256=train_subset_sha256, amp=amp,
        workers=default_workers(cfg, device_type),
        compile=cfg.compile if cfg.compile is not None else device_type == "cuda",
        lr=cfg.lr if cfg.lr is not None else 0.075 * math.sqrt(cfg.batch_size),
        momentum=(cfg.momentum if cfg.momentum is not None else
                  0.99 if image_size <= 64 else 0.999),
        queue_size=_queue_size(cfg.queue_size, cfg.batch_size, cfg.method),
        r_gain=resolve_r_gain(cfg.r_gain, cfg.a_gain, cfg.flip_prob))

