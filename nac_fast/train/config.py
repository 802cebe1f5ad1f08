"""train.py's flags, its recipes, and the one place where their defaults are resolved.

    args = parse(argv)                 # flags <- recipe file <- built-in rules, checked
    run = resolve_run(args, loader, world)   # what depends on the data: steps, lr, queue, EMA

A recipe is a TOML file of flag values (keys: the flags' names with '_' for '-', e.g.
``batch_size = 512``): ``--config configs/imagenet_nac_mq.toml``.  Without --config, an ImageFolder
root (a folder with train/) gets configs/imagenet.toml (the paper's ImageNet recipe) and anything
else configs/fashion_mnist.toml (the short CPU demo).  Precedence: a flag given on the command
line, else the recipe's value, else the flag's default below.  Values left open (None) follow the
rules of resolve_run:

    lr            0.075 * sqrt(global batch)                        (the paper's LARS rule)
    warmup        10 epochs, at most 10% of the run                 (the paper's 10 epochs)
    momentum      EMA decay 0.99 for images of <= 64 px, else 0.999
    queue_size    16 x the global batch; a recipe may also write "<k>x" (k x the global batch)
                  or a number, rounded down to a multiple of the global batch
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

import torch

from .methods import METHODS
from .models import ARCHS, INFER_INITS


def _gain(v):
    """--r-gain: a number > 0 or 'auto'."""
    if isinstance(v, str) and v.strip() == "auto":
        return "auto"
    try:
        g = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number > 0 or 'auto', got {v!r}") from None
    if not g > 0:
        raise ValueError(f"expected a number > 0 or 'auto', got {v!r}")
    return g

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nac_fast/
# The checkout's configs/ (source tree, editable install), else the copy a wheel ships as
# nac_fast/configs (setup.py's package data).
CONFIG_DIR = next((d for d in (os.path.join(os.path.dirname(_PKG), "configs"),
                               os.path.join(_PKG, "configs")) if os.path.isdir(d)),
                  os.path.join(os.path.dirname(_PKG), "configs"))
AUTO_RECIPES = {"imagefolder": "imagenet.toml", "other": "fashion_mnist.toml"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Pretrain an encoder with NAC, NAC-MQ or SimCLR.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 allow_abbrev=False)
    a = ap.add_argument
    a("--config", default=None, help="recipe (TOML of flag values); default: configs/imagenet.toml "
      "for an ImageFolder root, else configs/fashion_mnist.toml")
    a("--data", default="fashion-mnist", help="fashion-mnist | CIFAR-10 dir | ImageFolder root | "
      "synthetic[:N]")
    a("--arch", default="resnet-tiny", choices=sorted(ARCHS),
      help="encoder; resnet-tiny/resnet18-small are CPU-sized")
    a("--method", default="nac", choices=METHODS, help="objective")
    # torchrun reads "--p" as an abbreviation of its own --print-completion, so under torchrun
    # write --flip-prob (or put "--" before the script's flags)
    a("--p", "--flip-prob", dest="p", type=float, default=0.1,
      help="bit-flip probability of the channel, in (0, 0.5); under torchrun use --flip-prob")
    a("--epochs", type=int, default=None, help="epochs (recipe: 200 ImageNet, 2 demo)")
    a("--max-steps", type=int, default=None, help="total optimizer steps (overrides --epochs; "
      "the lr schedule spans this many steps). With --resume, a total larger than the "
      "checkpoint's extends the run: training continues exactly from the checkpoint and the "
      "cosine is restretched to end at the new total (the lr jumps up to the value a run "
      "planned with this total has at that step; the warm-up stays the checkpoint's)")
    a("--batch-size", type=int, default=None, help="GLOBAL batch (images per step, all ranks; "
      "recipe: 512 ImageNet, 256 demo)")
    a("--lr", type=float, default=None, help="base LARS lr; default 0.075*sqrt(batch)")
    a("--warmup-epochs", type=float, default=None,
      help="linear warm-up length; default 10 epochs (paper) capped at 10%% of the run")
    a("--wd", type=float, default=1e-6, help="weight decay (not on BN parameters and biases)")
    a("--queue-size", type=int, default=None, help="NAC-MQ queue length M, a multiple of the "
      "global batch; recipe: 65536 ImageNet, 16 x batch demo (keys at most 8 steps old; the "
      "paper's 50000 there collapses the codes, see docs/results.md)")
    a("--momentum", type=float, default=None, help="EMA decay of the momentum model; default "
      "0.99 (<=64 px images) or 0.999")
    a("--l2", type=float, default=0.1, help="lambda of NAC-MQ's lambda*||z||^2")
    a("--tau", type=float, default=0.5, help="SimCLR temperature")
    a("--code-dim", type=int, default=128, help="code bits D")
    a("--no-scale-codes", dest="scale_codes", action="store_false",
      help="do not divide a and r by sqrt(D) (the authors' initial scale)")
    # Head options (nac_fast/train/models.py NACModel; reproduce_fmnist.py's ablation). The flag
    # defaults are the authors' heads; the demo recipe configs/fashion_mnist.toml sets the learning
    # heads (docs/results.md).
    bool_flag = dict(action=argparse.BooleanOptionalAction, default=False)
    a("--head-bn", **bool_flag, help="BatchNorm1d(affine=False) at the end of the code head g")
    a("--infer-bn", **bool_flag, help="BatchNorm1d(affine=False) at the end of the inference "
      "network phi")
    a("--a-gain", type=float, default=1.0, help="gain of the codes: a = g(h) * gain / sqrt(D)")
    a("--r-gain", type=_gain, default=1.0, help="gain of the inference logits: r = phi(h') * "
      "gain / sqrt(D); 'auto' = 2(1-2p) * --a-gain (the small-code optimum r ~ 2(1-2p) z)")
    a("--learn-gain", **bool_flag, help="the gains are learnable per-bit parameters (initialised "
      "to --a-gain, --r-gain) instead of fixed numbers")
    a("--infer-init", default="independent", choices=INFER_INITS,
      help="initialise the inference network independently or as a copy of the code head")
    a("--bn-per-view", **bool_flag, help="one encoder/head pass per view (BatchNorm statistics "
      "per view, as the authors' two forward passes) instead of one pass over both views")
    a("--infer-warmup-steps", type=int, default=0, help="for this many first steps the NAC loss "
      "trains only the inference network (codes and its input detached)")
    a("--collapse-warn", type=float, default=0.05, help="warn once when the logged mean "
      "|tanh a| is below this after the lr warm-up (0: never)")
    a("--amp", default="auto", choices=("auto", "bf16", "fp16", "off"),
      help="autocast dtype; auto = bf16 on GPU, off (fp32) on CPU")
    a("--channels-last", action=argparse.BooleanOptionalAction, default=True,
      help="NHWC memory format (faster convolutions on GPU and, measured, on CPU too)")
    a("--compile", action="store_true", help="torch.compile the online model")
    a("--loss-backend", default="auto", choices=("auto", "reference", "cpu", "triton", "cuda"),
      help="NAC loss backend (nac_fast.nac_loss's backend); auto = cpu on CPU, triton on GPU "
      "(cuda, the experimental tensor-core backend, only when named)")
    a("--sync-bn", action="store_true", help="SyncBatchNorm in the online model (DDP)")
    a("--no-shuffle-bn", dest="shuffle_bn", action="store_false",
      help="disable MoCo's batch shuffle for the momentum branch (NAC-MQ, DDP)")
    a("--image-size", type=int, default=None, help="crop size; default the data's native size")
    a("--loader", default="auto", choices=("auto", "torchvision", "dali-cpu", "dali-gpu"))
    a("--on-bad-file", default="warn", choices=("warn", "error"),
      help="an ImageFolder file that cannot be read: warn = skip it (named in one warning, "
      "replaced by the next readable image, counted in the loader's skipped_files), error = "
      "stop with an error naming it")
    a("--workers", type=int, default=None, help="data workers per rank; default: "
      "0 on CPU, else min(8, cpus per rank - 1)")
    a("--device", default="auto", choices=("auto", "cpu", "cuda"))
    a("--out", default="runs/default", help="output directory (checkpoints, logs)")
    a("--resume", nargs="?", const="auto", default=None,
      help="resume from the newest good checkpoint in --out (last.pt, else prev.pt), or from "
      "the given file or directory. Under torchrun --max-restarts=K a restarted worker group "
      "resumes from --out's newest checkpoint by itself")
    a("--seed", type=int, default=0)
    a("--log-every", type=int, default=10)
    a("--save-every", type=int, default=200, help="checkpoint every this many steps (and at the "
      "end) to OUT/last.pt, the previous one kept as OUT/prev.pt; a crash loses at most this "
      "many steps")
    a("--tensorboard", action="store_true",
      help="also log to OUT/tensorboard (torch.utils.tensorboard; needs the tensorboard package)")
    a("--stop-at-step", type=int, default=None, help="save and exit after this step although the "
      "schedule runs to --max-steps (split a run over job time limits; used by the resume test)")
    a("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    return ap


# Flags a recipe may not set: where a run writes and where it resumes from are per run.
_NOT_IN_RECIPES = {"config", "out", "resume", "stop_at_step"}


def _explicit_dests(parser: argparse.ArgumentParser, argv) -> set:
    """The dests given on the command line (argparse keeps no record: parse again with every
    default suppressed)."""
    saved = [(a, a.default) for a in parser._actions]
    try:
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        return set(vars(parser.parse_known_args(argv)[0]))
    finally:
        for a, d in saved:
            a.default = d


def recipe_path(args) -> str:
    if args.config:
        return args.config
    kind = "imagefolder" if os.path.isdir(os.path.join(args.data, "train")) else "other"
    return os.path.join(CONFIG_DIR, AUTO_RECIPES[kind])


def load_recipe(path: str, parser: argparse.ArgumentParser) -> dict:
    """A recipe's flag values, checked against the flags (ValueError naming the key)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ModuleNotFoundError as exc:
            raise ValueError("reading a recipe needs Python >= 3.11 (tomllib) or the tomli "
                             "package") from exc
    if not os.path.isfile(path):
        raise ValueError(f"--config {path!r}: no such recipe file (recipes: {CONFIG_DIR})")
    with open(path, "rb") as f:
        try:
            recipe = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config {path!r}: not valid TOML: {exc}") from exc
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    out = {}
    for key, value in recipe.items():
        if key == "description":
            continue
        if key not in actions or key in _NOT_IN_RECIPES:
            raise ValueError(f"--config {path!r}: unknown or per-run key {key!r} (a recipe sets "
                             "flag values: batch_size, epochs, method, ...)")
        action = actions[key]
        if key == "queue_size" and isinstance(value, str):
            if not (value.endswith("x") and value[:-1].isdigit() and int(value[:-1]) >= 1):
                raise ValueError(f"--config {path!r}: queue_size must be a number or '<k>x', "
                                 f"got {value!r}")
        elif value is not None and action.type is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError(f"--config {path!r}: {key} = {value!r} has the wrong type")
            try:
                value = action.type(value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"--config {path!r}: {key} = {value!r}: {exc}") from exc
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"--config {path!r}: {key} must be one of {sorted(action.choices)}, "
                             f"got {value!r}")
        out[key] = value
    return out


def parse(argv=None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The run's flags: the command line over the recipe over the defaults, checked (exits with
    a usage error, status 2, naming the flag or the recipe key)."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    try:
        path = recipe_path(args)
        recipe = load_recipe(path, parser)
        explicit = _explicit_dests(parser, argv)
        for key, value in recipe.items():
            if key not in explicit:
                setattr(args, key, value)
        args.recipe = os.path.splitext(os.path.basename(path))[0]
        check_args(args, int(os.environ.get("WORLD_SIZE", "1") or 1))
    except ValueError as exc:
        parser.error(str(exc))
    return args


def check_args(args, world: int) -> None:
    """Flag checks that need no data; raises ValueError naming the flag."""
    pos = {"--batch-size": args.batch_size, "--epochs": args.epochs,
           "--log-every": args.log_every, "--save-every": args.save_every,
           "--code-dim": args.code_dim}
    for k in ("max_steps", "image_size", "stop_at_step"):
        if getattr(args, k) is not None:
            pos["--" + k.replace("_", "-")] = getattr(args, k)
    if isinstance(args.queue_size, int):
        pos["--queue-size"] = args.queue_size
    for name, v in pos.items():
        if v is None:
            raise ValueError(f"{name} has no value: the recipe must set it")
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if not 0.0 < args.p < 0.5:
        raise ValueError(f"--p must lie in (0, 0.5), got {args.p}")
    if args.lr is not None and not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    if args.warmup_epochs is not None and args.warmup_epochs < 0:
        raise ValueError(f"--warmup-epochs must be >= 0, got {args.warmup_epochs}")
    if not args.a_gain > 0:
        raise ValueError(f"--a-gain must be > 0, got {args.a_gain}")
    if args.infer_warmup_steps < 0 or args.collapse_warn < 0:
        raise ValueError("--infer-warmup-steps and --collapse-warn must be >= 0")
    for flag in ("head_bn", "infer_bn", "learn_gain", "bn_per_view", "scale_codes"):
        if not isinstance(getattr(args, flag), bool):
            raise ValueError(f"--{flag.replace('_', '-')} must be true or false, got "
                             f"{getattr(args, flag)!r}")
    if args.wd < 0 or args.l2 < 0 or not args.tau > 0:
        raise ValueError("--wd and --l2 must be >= 0 and --tau > 0")
    if args.momentum is not None and not 0.0 <= args.momentum < 1.0:
        raise ValueError(f"--momentum (EMA decay) must lie in [0, 1), got {args.momentum}")
    if args.workers is not None and args.workers < 0:
        raise ValueError(f"--workers must be >= 0, got {args.workers}")
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} (global) is not divisible by the "
                         f"world size {world}")
    if isinstance(args.queue_size, int) and args.method == "nac-mq":
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
    if args.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError as exc:
            raise ValueError("--tensorboard needs the tensorboard package (pip install "
                             "tensorboard, or the [dev] extra)") from exc


@dataclass
class Run:
    """What a run's flags resolve to once the data is known (recorded in config.json and every
    checkpoint)."""
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    lr: float
    momentum: float
    queue_size: int | None
    amp: str


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


def resolve_run(args, steps_per_epoch: int, image_size: int, device_type: str) -> Run:
    """The data-dependent values of the run (module docstring); ValueError naming the flag."""
    total = args.max_steps or args.epochs * steps_per_epoch
    if args.warmup_epochs is None:
        warmup = min(10 * steps_per_epoch, total // 10)
    else:
        warmup = round(args.warmup_epochs * steps_per_epoch)
        if warmup > total:
            raise ValueError(f"--warmup-epochs {args.warmup_epochs} ({warmup} steps) is longer "
                             f"than the run ({total} steps)")
    lr = args.lr if args.lr is not None else 0.075 * math.sqrt(args.batch_size)
    momentum = args.momentum if args.momentum is not None else (0.99 if image_size <= 64
                                                                else 0.999)
    amp = {"auto": "bf16" if device_type == "cuda" else "off"}.get(args.amp, args.amp)
    if amp == "fp16" and device_type != "cuda":
        raise ValueError("--amp fp16 needs a GPU (use bf16 or off on CPU)")
    return Run(steps_per_epoch=steps_per_epoch, total_steps=total, warmup_steps=warmup, lr=lr,
               momentum=momentum, queue_size=_queue_size(args.queue_size, args.batch_size,
                                                         args.method), amp=amp)
