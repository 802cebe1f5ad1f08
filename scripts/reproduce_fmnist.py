"""Small-scale reproduction on Fashion-MNIST (issues 6 and 16), on CPU, over seeds, resumable.

    python scripts/reproduce_fmnist.py --grid all --dry-run       # the plan and its estimated cost
    python scripts/reproduce_fmnist.py --grid all --doc docs/results.md --notes docs/results_notes.md
    python scripts/reproduce_fmnist.py --grid main --seeds 0,1,2  # one grid (main, ablation, psweep)
    python scripts/reproduce_fmnist.py --grid long --epochs 20 --curve-steps 234,702,1404,2340
    python scripts/reproduce_fmnist.py --grid budgets --epochs 10    # each method's default
    python scripts/reproduce_fmnist.py --grid pschedule --epochs 10  # the default's p schedule's parts
    python scripts/reproduce_fmnist.py --grid likelihood             # the multilinear likelihood
    python scripts/reproduce_fmnist.py --doc docs/results.md --notes docs/results_notes.md  # page

`--grid all` runs the grids main (NAC, NAC-MQ with the paper's heads, with the 'learning'
heads and with the learning heads' gains learnable (the default recipe), SimCLR, random init),
ablation (each head ingredient alone, all together, each left out, for NAC and NAC-MQ, and
SimCLR) and psweep (p in {0.05, 0.1, 0.2, 0.4} with the default recipe's heads and with fixed
gains), every variant
for every seed (default 0, 1, 2) at one budget: SimCLR gets the same epochs, batch, encoder and
augmentations as NAC (equal compute).

A grid is a set of named variants: a method and the train.py flags that the variant adds to a
recipe: `paper` = `--config configs/fashion_mnist_paper.toml` (the authors' heads),
`learning` = `--config configs/fashion_mnist_learning.toml` (the paper recipe plus --head-bn
--a-gain 3 --infer-bn --r-gain auto --infer-init copy, docs/math.md [M:heads]; the default
recipe configs/small.toml trains them with --learn-gain), so each name says exactly
what it changes.  Every variant is trained once per seed with the same encoder (resnet-tiny), batch, budget and
augmentations, then evaluated with `python -m nac_fast.eval` on the full splits (linear probe,
kNN, hash mAP@all at 16/32/64/128 bits, expressivity; gallery = the 60k training images,
queries = the 10k test images).  `random` is the untrained encoder, its BatchNorm statistics set
from 50 training batches.

One JSON line per finished run goes to OUT/<grid>/results.jsonl: the figures, the held-out mean
|tanh a| (from the evaluation's cached test features), the training log's learning statistics
(code_mag, r_mag, r_slope, loss_excess: their trace and last values), whether train.py warned of
collapsed codes, the commands and the wall time.  A run whose line exists (same variant, seed
and budget) is skipped, so an interrupted grid continues where it stopped; a failed run is
reported and the others go on.

--curve-steps S1,S2,...: the runs of the --curve-seeds are trained in pieces (train.py
--stop-at-step, then --resume, which continues exactly) and evaluated at each of those steps
(hash and expressivity), for figures against the step.

--data D runs a grid on other data (an image folder): `--heldout ROOT` gives the page a
section with every grid run under ROOT.

--doc PATH writes the results page from every OUT/*/results.jsonl (mean +- std over the seeds),
with the curves (curves.png) and the machine-readable summary (results_summary.json) beside it
and --notes appended.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import shlex
import subprocess
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BITS = (16, 32, 64, 128)
# recipe name -> train.py --config (None: train.py's default recipe, configs/small.toml,
# which is 'learning' + --learn-gain today; the grids name the pinned recipes plus flags, so they
# keep measuring the same runs when the default changes)
RECIPES = {"paper": os.path.join("configs", "fashion_mnist_paper.toml"),
           "learning": os.path.join("configs", "fashion_mnist_learning.toml"),
           "default": None}
WARNING = "warning: the codes are collapsing"

# The ingredients of the head ablation (train.py flags; nac_fast/train/models.py NACModel).
HB = ["--head-bn", "--a-gain", "3"]             # end-BN of the code head, fixed gain 3
IB = ["--infer-bn", "--r-gain", "auto"]         # end-BN of the inference net, gain 2(1-2p) x 3
COPY = ["--infer-init", "copy"]                 # the inference net starts as a copy of the head
LEARN = ["--learn-gain"]                        # the gains are learnable (per bit)
FULL = HB + IB + COPY                           # all three: the 'learning' recipe's heads
WARM = ["--infer-warmup-steps", "50"]           # 50 steps that train only the inference net
PERVIEW = ["--bn-per-view"]                     # one BatchNorm pass per view (the authors')
EXCL = ["--self-key", "exclude"]                # each row's own key left out ([M:self-key])


def _grid_main() -> dict:
    """The paper's heads, the learning heads with fixed gains and with learnable gains (the
    default recipe, configs/small.toml), for NAC and NAC-MQ; SimCLR; random init."""
    return {"nac:paper": ("nac", [], "paper"), "nac:learning": ("nac", [], "learning"),
            "nac:learning+learngain": ("nac", LEARN, "learning"),
            "nac-mq:paper": ("nac-mq", [], "paper"),
            "nac-mq:learning": ("nac-mq", [], "learning"),
            "nac-mq:learning+learngain": ("nac-mq", LEARN, "learning"),
            "simclr": ("simclr", [], "paper"), "random": ("random", [], "paper")}


# The head ablation's variants (flags over the paper recipe), run for NAC and for NAC-MQ: each
# ingredient alone (paper + x), all together (full), each one left out (full - x), fixed against
# learnable gains.
HEAD_ABLATION = {
    "paper": [],
    "paper+headbn": HB,
    "paper+inferbn": IB,
    "paper+copy": COPY + ["--r-gain", "auto"],
    "full": FULL,
    "full-headbn": IB + COPY + ["--a-gain", "3"],
    "full-inferbn": HB + COPY + ["--r-gain", "auto"],
    "full-copy": HB + IB,
    "full+learngain": FULL + LEARN,
}


def _grid_ablation() -> dict:
    """HEAD_ABLATION for NAC and NAC-MQ; for NAC also the fixes the probe did not try (the
    inference net's warm-up, per-view BatchNorm); SimCLR at the same budget."""
    v = {f"{m}:{name}": (m, flags, "paper") for m in ("nac", "nac-mq")
         for name, flags in HEAD_ABLATION.items()}
    v.update({"nac:paper+warmup": ("nac", WARM, "paper"),
              "nac:full-copy+warmup": ("nac", HB + IB + WARM, "paper"),
              "nac:full+perview": ("nac", FULL + PERVIEW, "paper"),
              "nac:full+learngain+perview": ("nac", FULL + LEARN + PERVIEW, "paper"),
              "simclr": ("simclr", [], "paper")})
    return v


def _grid_explore() -> dict:
    """The size of the fixed code gain (mean |tanh a| ~ 0.07 a_gain / 1) around the default."""
    return {f"nac:full:again{g}": ("nac", IB + COPY + ["--head-bn", "--a-gain", g], "paper")
            for g in ("1.5", "2", "4", "6")}


def _grid_psweep() -> dict:
    """p with the default recipe's heads (learnable gains) and with fixed gains; p = 0.1 is
    main's nac:learning+learngain and the ablation's nac:full."""
    v = {}
    for p in ("0.05", "0.1", "0.2", "0.4"):
        v[f"nac:learngain:p{p}"] = ("nac", LEARN + ["--flip-prob", p], "learning")
    for p in ("0.05", "0.1", "0.2", "0.4"):
        v[f"nac:full:p{p}"] = ("nac", FULL + ["--flip-prob", p], "paper")
    return v


def _grid_long() -> dict:
    return {"nac:paper": ("nac", [], "paper"), "nac:learning": ("nac", [], "learning"),
            "nac:learning+learngain": ("nac", LEARN, "learning"),
            "simclr": ("simclr", [], "paper")}


def _grid_budgets() -> dict:
    """Each method's default (issue 26): train.py's default recipe for NAC, SimCLR with its
    standard head; run at every budget (--epochs 2, 10, 20) and on held-out data (--data)."""
    return {"nac:default": ("nac", [], "default"), "simclr": ("simclr", [], "paper")}


def _grid_pschedule() -> dict:
    """The default's p schedule taken apart ([M:p-schedule]): p = 0.25 throughout, and the ramp
    to 0.35 instead of 0.4 (between the p whose channel capacity D (ln 2 - h(p)) equals the
    ln(2n - 1) nats in-batch NAC can reward: 0.345 at n = 256, 0.363 at n = 64, D = 128); the
    default itself is the budgets grid's nac:default."""
    return {"nac:p-constant": ("nac", ["--flip-prob-final", "none"], "default"),
            "nac:p-end0.35": ("nac", ["--flip-prob-final", "0.35"], "default")}


def _grid_likelihood() -> dict:
    """The channel's own relaxed likelihood ([M:multilinear]) in place of exp(s z~ . z), over the
    default recipe; the default itself is the budgets grid's nac:default."""
    return {"nac:multilinear": ("nac", ["--channel-likelihood", "multilinear"], "default")}


def _grid_mq() -> dict:
    """NAC-MQ over the default recipe: its lambda ||z||^2 ([M:mq-l2]: the paper's 0.1, the
    default before it was measured here; 0.039, the paper's scaled by ((1 - 2p) / 0.8)^2 to
    p = 0.25, `--l2 auto`; 0, today's small-data default) and its keys' lag (EMA decay 0.99, the
    default for small images; 0.9; 0: the online weights; 0.999), at 0.1 and at 0.  In-batch NAC at
    the same budget is the budgets grid's nac:default."""
    return {"nac-mq:l2-0.1": ("nac-mq", ["--l2", "0.1"], "default"),
            "nac-mq:l2-0.1+m0.9": ("nac-mq", ["--l2", "0.1", "--momentum", "0.9"], "default"),
            "nac-mq:l2-0.1+m0": ("nac-mq", ["--l2", "0.1", "--momentum", "0"], "default"),
            "nac-mq:l2-0.039": ("nac-mq", ["--l2", "0.039"], "default"),
            "nac-mq:l2-0": ("nac-mq", ["--l2", "0"], "default"),
            "nac-mq:l2-0+m0.9": ("nac-mq", ["--l2", "0", "--momentum", "0.9"], "default"),
            "nac-mq:l2-0+m0.999": ("nac-mq", ["--l2", "0", "--momentum", "0.999"], "default")}


def _grid_folders() -> dict:
    """Candidates for issue 58 (NAC's hash codes on folders no recipe was tuned on), each one
    change over the default recipe, or two: each image's own code left out of its keys
    ([M:self-key]), the heads' gain G ([M:heads]: 2, 3, 4, 9), code bits
    D = 64 (a channel of half the capacity, [M:recipe-small]), the p ramp at any budget
    ([M:p-schedule]), NAC-MQ, G = 3 with each of the others and with p = 0.2, 0.3, and the
    inference network trained alone for the first 100 steps (`--infer-warmup-steps`), and
    the own key left out with G = 3, with D = 64 or 256, with the p ramp, with fixed gains,
    with p = 0.2 or 0.3, without the code head's BatchNorm, with one BatchNorm pass per view and
    with the loss averaged over 4 or 8 channel draws ([M:draws]).
    NAC-MQ is the mq grid's nac-mq:l2-0; the default itself is the budgets grid's nac:default."""
    return {"nac:exclude-self": ("nac", EXCL, "default"),
            "nac:again3": ("nac", ["--a-gain", "3"], "default"),
            "nac:again9": ("nac", ["--a-gain", "9"], "default"),
            "nac:dim64": ("nac", ["--code-dim", "64"], "default"),
            "nac:ramp": ("nac", ["--flip-prob-final-min-images", "none"], "default"),
            "nac:again2": ("nac", ["--a-gain", "2"], "default"),
            "nac:again4": ("nac", ["--a-gain", "4"], "default"),
            "nac:again3+dim64": ("nac", ["--a-gain", "3", "--code-dim", "64"], "default"),
            "nac:again3+ramp": ("nac", ["--a-gain", "3", "--flip-prob-final-min-images", "none"],
                                "default"),
            "nac-mq:again3": ("nac-mq", ["--a-gain", "3", "--l2", "0"], "default"),
            "nac:again3+p0.2": ("nac", ["--a-gain", "3", "--flip-prob", "0.2"], "default"),
            "nac:again3+p0.3": ("nac", ["--a-gain", "3", "--flip-prob", "0.3"], "default"),
            "nac:infer-warm100": ("nac", ["--infer-warmup-steps", "100"], "default"),
            "nac:exclude-self+again3": ("nac", EXCL + ["--a-gain", "3"], "default"),
            "nac:exclude-self+dim64": ("nac", EXCL + ["--code-dim", "64"], "default"),
            "nac:exclude-self+ramp": ("nac", EXCL + ["--flip-prob-final-min-images", "none"],
                                      "default"),
            "nac:exclude-self+fixedgain": ("nac", EXCL + ["--no-learn-gain"], "default"),
            "nac:exclude-self+p0.2": ("nac", EXCL + ["--flip-prob", "0.2"], "default"),
            "nac:exclude-self+dim256": ("nac", EXCL + ["--code-dim", "256"], "default"),
            "nac:exclude-self+nohbn": ("nac", EXCL + ["--no-head-bn"], "default"),
            "nac:exclude-self+p0.3": ("nac", EXCL + ["--flip-prob", "0.3"], "default"),
            "nac:exclude-self+perview": ("nac", EXCL + PERVIEW, "default"),
            "nac:exclude-self+draws4": ("nac", EXCL + ["--noise-draws", "4"], "default"),
            "nac:exclude-self+draws8": ("nac", EXCL + ["--noise-draws", "8"], "default")}


GRIDS = {"main": _grid_main, "ablation": _grid_ablation, "explore": _grid_explore,
         "psweep": _grid_psweep, "long": _grid_long, "budgets": _grid_budgets,
         "pschedule": _grid_pschedule, "likelihood": _grid_likelihood, "mq": _grid_mq,
         "folders": _grid_folders}
ALL = ("main", "ablation", "psweep")  # --grid all: the grids of the issue, one budget, in order


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = ap.add_argument
    a("--grid", default=None, choices=sorted(GRIDS) + ["all"],
      help="the variants to run; all = " + " + ".join(ALL))
    a("--only", default="", help="comma-separated variant names of the grid(s) ('' = all)")
    a("--out", default="runs/repro", help="output root; a grid writes OUT/<grid>/")
    a("--seeds", default="0,1,2", help="comma-separated training (and evaluation) seeds")
    a("--epochs", type=int, default=3, help="training epochs")
    a("--max-steps", type=int, default=None, help="optimizer steps instead of --epochs")
    a("--batch-size", type=int, default=256, help="global batch (images)")
    a("--nproc", type=int, default=2, help="training processes (torchrun) per run")
    a("--arch", default="resnet-tiny", help="encoder of every run")
    a("--data", default="fashion-mnist", help="training/evaluation data (train.py --data)")
    a("--linear-epochs", type=int, default=100, help="linear-probe epochs (paper: 100)")
    a("--limit-train", type=int, default=None, help="evaluation train images (tests)")
    a("--limit-test", type=int, default=None, help="evaluation test images (tests)")
    a("--bn-batches", type=int, default=50, help="training batches that set the random-init "
      "encoder's BatchNorm statistics")
    a("--curve-steps", default="", help="comma-separated steps at which to evaluate hashing")
    a("--curve-seeds", default="0", help="the seeds whose runs get --curve-steps")
    a("--curve-limit", default="", help="TRAIN,TEST: evaluate the curve's points on this many "
      "train (gallery) and test (query) images (strided subsets; '' = the full splits)")
    a("--log-every", type=int, default=10, help="train.py --log-every")
    a("--doc", default=None, help="write the results page here (from every OUT/*/results.jsonl)")
    a("--notes", default=None, help="markdown files appended to the page (comma-separated, in "
      "order)")
    a("--heldout", default="", help="comma-separated output roots of the budgets grid run on "
      "other data (--out R --data D --grid budgets): the page gets a section per root; a "
      "root of Fashion-MNIST runs (another budget or --batch-size) gets one headed as such, "
      "not as held-out data")
    a("--dry-run", action="store_true", help="print the plan (the runs still to do, their "
      "commands) and its estimated cost; run nothing")
    return ap


def _ints(s: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {s!r}") from None


def check_args(args):
    """(variants, seeds, curve steps, curve seeds); ValueError naming the flag."""
    if args.grid is None and args.doc is None:
        raise ValueError("give --grid (run a grid) or --doc (write the page), or both")
    # de-duplicated, order kept: a run named twice would be launched twice into one folder
    seeds = list(dict.fromkeys(_ints(args.seeds, "--seeds")))
    if not seeds:
        raise ValueError("--seeds needs at least one seed")
    curve, curve_seeds = _ints(args.curve_steps, "--curve-steps"), list(dict.fromkeys(
        _ints(args.curve_seeds, "--curve-seeds")))
    from nac_fast.train.config import MAX_SEED
    for flag, values in (("--seeds", seeds), ("--curve-seeds", curve_seeds)):
        bad = [v for v in values if not 0 <= v <= MAX_SEED]
        if bad:  # train.py's range: every run would stop at its start
            raise ValueError(f"{flag} must lie in [0, {MAX_SEED}] (train.py --seed), got {bad}")
    if any(s < 1 for s in curve) or curve != sorted(set(curve)):
        raise ValueError(f"--curve-steps must be increasing steps >= 1, got {args.curve_steps!r}")
    for flag in ("epochs", "batch_size", "nproc", "linear_epochs", "bn_batches", "log_every"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("max_steps", "limit_train", "limit_test"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    lim = _ints(args.curve_limit, "--curve-limit")
    if lim and (len(lim) != 2 or min(lim) < 1):
        raise ValueError(f"--curve-limit must be TRAIN,TEST (two counts >= 1), got "
                         f"{args.curve_limit!r}")
    args.curve_limits = tuple(lim) if lim else None
    args.notes_files = [n for n in (args.notes or "").split(",") if n.strip()]
    for notes in args.notes_files:
        if not os.path.isfile(notes):
            raise ValueError(f"--notes {notes!r}: no such file")
    args.heldout_roots = [r for r in args.heldout.split(",") if r.strip()]
    grids = ALL if args.grid == "all" else (args.grid,) if args.grid else ()
    per_grid = {g: GRIDS[g]() for g in grids}
    only = [v for v in args.only.split(",") if v]
    bad = [v for v in only if not any(v in vs for vs in per_grid.values())]
    if bad:
        names = sorted({k for vs in per_grid.values() for k in vs})
        raise ValueError(f"--only: {bad} are not variants of grid {args.grid} "
                         f"(its variants: {', '.join(names)})")
    if only:
        per_grid = {g: {k: v for k, v in vs.items() if k in only} for g, vs in per_grid.items()}
        per_grid = {g: vs for g, vs in per_grid.items() if vs}
    return per_grid, seeds, curve, curve_seeds


def commit() -> str:
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except Exception:  # a copy of the tree without .git
        return "unknown"


def budget_tag(args) -> str:
    b = f"{args.max_steps} steps" if args.max_steps else f"{args.epochs} epochs"
    return f"{b}, {args.nproc} proc, batch {args.batch_size}, {args.arch}"


def run_dir(args, variant: str, seed: int) -> str:
    return os.path.join(args.out, args.grid, variant.replace(":", "_"), f"seed{seed}")


def train_cmd(args, method, flags, recipe, seed, out, extra=()) -> list:
    cmd = ["train.py"] + (["--config", RECIPES[recipe]] if RECIPES[recipe] else [])
    cmd += ["--data", args.data, "--arch", args.arch, "--method", method, "--batch-size",
            str(args.batch_size), "--seed", str(seed), "--out", out, "--no-progress",
            "--log-every", str(args.log_every), "--save-every", "1000000"]
    if "--max-steps" not in extra:
        cmd += ["--max-steps", str(args.max_steps)] if args.max_steps else ["--epochs",
                                                                           str(args.epochs)]
    cmd += list(flags) + list(extra)  # torchrun takes "--p": the grids write --flip-prob
    if args.nproc == 1:
        return [sys.executable] + cmd
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.nproc}"] + cmd


def eval_bits(ckpt) -> tuple:
    """BITS, cut to the run's code bits D (train.py's config.json beside the checkpoint; a
    variant with --code-dim 64 is scored at 16, 32 and 64 bits, D itself always among them)."""
    try:
        with open(os.path.join(os.path.dirname(ckpt), "config.json")) as f:
            d = int(json.load(f)["code_dim"])
    except (OSError, KeyError, TypeError, ValueError):
        return BITS  # not trained yet (--dry-run): the default code
    return tuple(b for b in BITS if b < d) + (d,)


def eval_cmd(args, ckpt, out, seed, tasks="linear,knn,hash,expressivity", limits=None) -> list:
    cmd = [sys.executable, "-m", "nac_fast.eval", "--checkpoint", ckpt, "--data", args.data,
           "--out", out, "--no-progress", "--tasks", tasks,
           "--bits", ",".join(map(str, eval_bits(ckpt))),
           "--linear-epochs", str(args.linear_epochs), "--seed", str(seed)]
    lt, ls = limits if limits else (args.limit_train, args.limit_test)
    if lt:
        cmd += ["--limit-train", str(lt)]
    if ls:
        cmd += ["--limit-test", str(ls)]
    if os.path.exists(os.path.join(out, "report.json")):
        cmd.append("--overwrite")  # an earlier attempt's evaluation of a run trained again
    return cmd


def show(cmd) -> str:
    """The command as a user of this checkout types it: `python`, and paths below the working
    directory relative to it (no machine's paths in the results page or its summary)."""
    here = os.getcwd().rstrip(os.sep) + os.sep
    return " ".join("python" if c == sys.executable else
                    shlex.quote(c[len(here):] if c.startswith(here) else c) for c in cmd)


def run_cmd(cmd, log_path, dry) -> None:
    print("$ " + show(cmd), flush=True)
    if dry:
        return
    with open(log_path, "a") as log:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"command failed (exit {rc}), log {log_path}:\n{tail}")


def random_init_checkpoint(args, template_ckpt: str, out_dir: str, seed: int) -> dict:
    """A checkpoint of the *initialised* model (seed) with the configuration of a trained
    run, its BatchNorm running statistics averaged over --bn-batches training batches (train-mode
    forward passes, no gradient, no weight change): eval-mode BN with the init statistics (mean 0,
    var 1) would scale the features arbitrarily and make the baseline weaker than it is."""
    import torch
    from nac_fast.train.checkpoint import load_checkpoint, save_atomic
    from nac_fast.data import build_eval_loader
    from nac_fast.train.models import build_model, model_kwargs_from_config

    cfg = dict(load_checkpoint(template_ckpt)["config"])
    cfg.update(method="random-init", epochs=0, max_steps=0, total_steps=0, out=out_dir)
    torch.manual_seed(seed)
    model = build_model(**dict(model_kwargs_from_config(cfg), inference_net=True))
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the calibration batches
    model.train()
    loader = build_eval_loader(args.data, split="train", batch_size=args.batch_size,
                               image_size=cfg["image_size"])
    with torch.no_grad():
        for i, (x, _) in enumerate(loader):
            if i == args.bn_batches:
                break
            model.encode(x)
    path = os.path.join(out_dir, "last.pt")
    save_atomic({"model": model.state_dict(), "momentum_model": None, "step": 0, "epoch": 0,
                 "config": cfg}, path)
    return cfg


def heldout_code_mag(eval_dir: str):
    """Mean |tanh a| over the test split's codes (the evaluation's feature cache)."""
    import torch
    path = os.path.join(eval_dir, "features_test.pt")
    if not os.path.isfile(path):
        return None
    a = torch.load(path, map_location="cpu", weights_only=True)["a"]
    return float(torch.tanh(a.double()).abs().mean())


def eval_figures(eval_dir: str) -> dict:
    with open(os.path.join(eval_dir, "report.json")) as f:
        r = json.load(f)
    res, out = r["results"], {"step": r["step"]}
    if "linear" in res:
        out["linear_top1"] = res["linear"]["test_top1"]
        out["linear_lr"] = res["linear"]["best_lr"]
    if "knn" in res:
        out["knn_top1"] = res["knn"]["test_top1"]
    if "hash" in res:
        out["map"] = {str(b): v for b, v in res["hash"]["map"].items()}
    if "expressivity" in res:
        stats = res["expressivity"]["stats"]  # the full code's (128 bits but for --code-dim)
        st = stats[str(max(int(b) for b in stats))]
        out["distinct128"] = st["fraction_distinct"]
        out["hamming128"] = st["normalized_mean_pairwise_hamming"]
        # reports written before the rename call balance_dev balance_mean_abs_deviation
        out["balance_dev128"] = st.get("balance_dev", st.get("balance_mean_abs_deviation"))
    out["heldout_code_mag"] = heldout_code_mag(eval_dir)
    return out


LOG_KEYS = ("loss", "code_mag", "r_mag", "r_slope", "loss_excess", "mean_hamming",
            "distinct_frac", "balance_score", "bit_balance")  # bit_balance: logs before the rename


def log_summary(d: str) -> dict:
    """The training log's trace of the learning statistics, its last values, and whether
    train.py warned of collapsed codes."""
    path = os.path.join(d, "log.jsonl")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    trace = [{k: r[k] for k in ("step",) + LOG_KEYS if r.get(k) is not None} for r in recs]
    tpath = os.path.join(d, "train.txt")
    warned = False
    if os.path.isfile(tpath):
        with open(tpath) as f:
            warned = WARNING in f.read()
    return {"loss_first": recs[0]["loss"] if recs else None, "last": trace[-1] if trace else {},
            "trace": trace, "collapse_warning": warned}


# TrainConfig fields that nac_fast.train.config.resolve (or run.start) fills or rewrites, and the
# per-launch --overwrite: a checkpoint's value of these need not equal the parsed command's
RESOLVED = ("world_size", "device", "steps_per_epoch", "total_steps", "warmup_steps", "image_size",
            "in_channels", "num_images", "amp", "workers", "lr", "momentum", "queue_size",
            "r_gain", "run_id", "elastic_run_id", "extended", "overwrite")


def with_built_ins(saved: dict) -> dict:
    """A configuration saved by an earlier commit, completed with TrainConfig's built-in value
    for every key added since (a key saved before it existed had its built-in value)."""
    from nac_fast.train.config import TrainConfig
    return dict(vars(TrainConfig()), **saved)


def trained_already(args, d: str, method: str, seed: int, planned: str | None = None) -> bool:
    """The run in d finished the training this grid plans (an interrupted grid stopped in its
    evaluation): last.pt is at its run's last step, with this method, seed, batch and budget,
    and with every value of `planned` (the run's signature) but those train.py resolves at the
    start (RESOLVED): a checkpoint of another recipe (an earlier default, other flags) is
    trained again, not evaluated as this one."""
    path = os.path.join(d, "last.pt")
    if not os.path.isfile(path):
        return False
    from nac_fast.train.checkpoint import load_checkpoint
    try:
        ck = load_checkpoint(path)
    except Exception:  # damaged or foreign: train again
        return False
    cfg = ck.get("config") or {}
    budget = (cfg.get("max_steps") == args.max_steps if args.max_steps else
              cfg.get("epochs") == args.epochs and cfg.get("max_steps") is None)
    if planned is not None:
        saved = with_built_ins(cfg)
        fixed = {k: v for k, v in json.loads(planned)[1].items() if k not in RESOLVED}
        if any(saved.get(k) != v for k, v in fixed.items()):
            return False
    return (budget and ck.get("step") == cfg.get("total_steps") and cfg.get("method") == method
            and cfg.get("seed") == seed and cfg.get("batch_size") == args.batch_size)


def do_run(args, name, method, flags, recipe, seed, curve) -> dict:
    d = run_dir(args, name, seed)
    reuse = (not args.dry_run and method != "random" and not curve
             and trained_already(args, d, method, seed,
                                 signature(args, method, flags, recipe, seed)))
    if not args.dry_run:
        os.makedirs(d, exist_ok=True)
        for stale in ("eval.txt",) if reuse else ("train.txt", "eval.txt"):  # interrupted attempt
            if os.path.isfile(os.path.join(d, stale)):
                os.remove(os.path.join(d, stale))
    ckpt, cmds, points = os.path.join(d, "last.pt"), [], []
    t0 = time.perf_counter()
    if reuse:
        print(f"   trained already ({ckpt} is at its last step): evaluating only", flush=True)
        cmds.append(show(train_cmd(args, method, flags, recipe, seed, d)))
    elif method == "random":
        tmpl = os.path.join(d, "template")
        tc = train_cmd(args, "nac", flags, recipe, seed, tmpl, ["--max-steps", "1"])
        cmds += [show(tc), f"# random init: the model of seed {seed}, BN statistics from "
                           f"{args.bn_batches} training batches (scripts/reproduce_fmnist.py)"]
        run_cmd(tc, os.path.join(d, "train.txt"), args.dry_run)
        if not args.dry_run:
            random_init_checkpoint(args, os.path.join(tmpl, "last.pt"), d, seed)
    else:
        # an interrupted attempt left a run in d: train.py refuses a fresh run there unless told
        earlier = any(os.path.exists(os.path.join(d, f)) for f in ("last.pt", "prev.pt",
                                                                   "log.jsonl"))
        for i, stop in enumerate([s for s in curve] + [None]):
            extra = (["--stop-at-step", str(stop)] if stop else []) + (
                ["--resume"] if i else ["--overwrite"] if earlier else [])
            tc = train_cmd(args, method, flags, recipe, seed, d, extra)
            cmds.append(show(tc))
            run_cmd(tc, os.path.join(d, "train.txt"), args.dry_run)
            if stop:
                ed = os.path.join(d, f"eval_step{stop}")
                ec = eval_cmd(args, ckpt, ed, seed, "hash,expressivity", args.curve_limits)
                cmds.append(show(ec))
                run_cmd(ec, os.path.join(d, "eval.txt"), args.dry_run)
                if not args.dry_run:
                    points.append(eval_figures(ed))
    t_train = time.perf_counter() - t0
    ed = os.path.join(d, "eval")
    ec = eval_cmd(args, ckpt, ed, seed)
    cmds.append(show(ec))
    run_cmd(ec, os.path.join(d, "eval.txt"), args.dry_run)
    if args.dry_run:
        return {}
    fig = eval_figures(ed)
    for e in [ed] + [os.path.join(d, f"eval_step{s}") for s in curve]:
        for split in ("train", "test"):  # the feature caches (70 MB a run): figures are taken
            f = os.path.join(e, f"features_{split}.pt")
            if os.path.isfile(f):
                os.remove(f)
    if curve:
        points.append({k: fig.get(k) for k in ("step", "map", "distinct128", "hamming128",
                                               "heldout_code_mag")})
        points[-1]["full_splits"] = True  # the others: --curve-limit's subsets
    return {"grid": args.grid, "variant": name, "method": method, "recipe": recipe,
            "flags": flags, "seed": seed, "budget": budget_tag(args), **fig,
            **log_summary(d), "curve": points, "commands": cmds,
            "seconds_train": round(t_train, 1),
            "seconds_total": round(time.perf_counter() - t0, 1)}


def load_rows(path: str) -> list:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- the cost model (--dry-run) ----------------------------------------------------------------
# Seconds on this project's machine (2 CPU cores), measured on 2026-11-23 from the runs/repro logs
# and report.json timings of the 2-epoch grid with nothing else running; read the totals as +-50%,
# much more when other jobs share the cores (an earlier, shared measurement was 3-15x slower).
#   train  0.27-0.31 s per optimizer step of 256 images (2 processes, resnet-tiny; NAC 0.27-0.30,
#          SimCLR 0.31); NAC-MQ x 1.3 for the momentum network's forward pass (not measured)
#   eval   features 0.27 ms per image (report.json: 15-17 s for the 60000 training images);
#          linear probe 0.065 s per epoch of one fit on 60000 features (metrics.linear_probe makes
#          5 fits: 4 learning rates + the final one; 30 epochs: 9-13 s); kNN, hash and
#          expressivity ~5 s
#   each process launch (torchrun, data loading) ~15 s
TRAIN_IMAGES, TEST_IMAGES = 60000, 10000
COST = dict(step_s_per_image=0.29 / 256, mq_factor=1.3, feature_s=0.00027,
            linear_epoch_s=0.065, linear_fits=5, eval_fixed_s=5.0, launch_s=15.0)


def total_steps(args) -> int:
    """Optimizer steps of one run (--epochs counted on Fashion-MNIST's training split)."""
    return args.max_steps or args.epochs * (TRAIN_IMAGES // args.batch_size)


def measured_seconds(args, method: str, flags=()) -> tuple[float, float, int] | None:
    """(training seconds per step, evaluation seconds, number of runs) as measured by the
    finished runs under --out (any grid) with the same processes, batch and architecture and no
    curve: medians of their recorded wall times, over the runs trained with the same flags where
    there are any (a flag such as --channel-likelihood multilinear changes the cost), else over
    the method family's (NAC-MQ or not).  None when there is no such run (then the cost model
    above estimates)."""
    tail = budget_tag(args).split(", ", 1)[1]
    mq = method == "nac-mq"
    same, family = [], []
    for g in GRIDS:
        for r in load_rows(os.path.join(args.out, g, "results.jsonl")):
            if (r.get("reused_from") or r.get("curve") or not r.get("step")
                    or "seconds_train" not in r or (r.get("method") == "nac-mq") != mq
                    or str(r.get("budget", "")).split(", ", 1)[-1] != tail):
                continue
            t = (r["seconds_train"] / r["step"], r["seconds_total"] - r["seconds_train"])
            family.append(t)
            if r.get("method") == method and list(r.get("flags") or []) == list(flags):
                same.append(t)
    rows = same or family
    if not rows:
        return None
    return (statistics.median(t[0] for t in rows), statistics.median(t[1] for t in rows),
            len(rows))


def estimate_seconds(args, method: str, curve) -> tuple[float, float]:
    """(training, evaluation) seconds of one run of the grid: the cost model above."""
    c = COST
    lt = args.limit_train or TRAIN_IMAGES
    ls = args.limit_test or TEST_IMAGES

    def evaluation(n_train, n_test, linear):
        s = c["launch_s"] + c["eval_fixed_s"] + (n_train + n_test) * c["feature_s"]
        if linear:
            s += c["linear_fits"] * args.linear_epochs * c["linear_epoch_s"] * n_train / TRAIN_IMAGES
        return s

    if method == "random":  # a 1-step template run, then --bn-batches forward passes
        train = c["launch_s"] + 256 * c["step_s_per_image"] + (
            args.bn_batches * args.batch_size * c["step_s_per_image"] / 3)
        return train, evaluation(lt, ls, True)
    steps = total_steps(args)
    train = steps * args.batch_size * c["step_s_per_image"] * (
        c["mq_factor"] if method == "nac-mq" else 1.0) + c["launch_s"] * (1 + len(curve))
    cl = args.curve_limits or (lt, ls)
    ev = evaluation(lt, ls, True) + len(curve) * evaluation(cl[0], cl[1], False)
    return train, ev


# train.py settings that do not change what a run trains (where it writes, how it logs)
NOT_TRAINING = ("out", "config", "recipe", "description", "progress", "log_every", "save_every",
                "stop_at_step", "resume", "tensorboard")


def signature(args, method, flags, recipe, seed) -> str | None:
    """What a run trains, as train.py resolves it (recipe file + flags, nac_fast.train.config.parse)
    plus the budget: two variants with the same signature (e.g. main's nac:learning and the
    ablation's nac:full, or the same nac:paper in two grids) are one run, trained once.  None for
    the random-init baseline (never shared)."""
    if method == "random":
        return None
    from nac_fast.train.config import parse
    cmd = train_cmd(args, method, flags, recipe, seed, "OUT")
    argv = cmd[cmd.index("train.py") + 1:]
    if "--config" in argv:
        i = argv.index("--config") + 1
        argv[i] = os.path.join(ROOT, argv[i])
    cfg = {k: v for k, v in sorted(vars(parse(argv)).items()) if k not in NOT_TRAINING}
    return json.dumps([budget_tag(args), cfg], sort_keys=True, default=str)


def current_signature(row) -> str | None:
    """The signature of a finished run's training as train.py resolves its command today: its
    first train.py command, parsed at HEAD, with its budget.  None for the random-init baseline,
    for runs of the default recipe (whose meaning moves with the default) and for a command that
    no longer parses.  Lets runs recorded before a change of the signature's keys (e.g. --p
    renamed --flip-prob) be reused."""
    if row.get("method") == "random" or row.get("recipe") == "default":
        return None
    kept = _train_argv(row)
    if kept is None:
        return None
    from nac_fast.train.config import parse
    try:
        cfg = {k: v for k, v in sorted(vars(parse(kept + ["--out", "OUT"])).items())
               if k not in NOT_TRAINING}
    except (ValueError, SystemExit):
        return None
    return json.dumps([row["budget"], cfg], sort_keys=True, default=str)


def _train_argv(row) -> list | None:
    """The first train.py command of a finished run, as train.py's argv (paths of --config made
    absolute, the per-run flags dropped); None when the row has no train.py command."""
    cmd = next((c for c in row.get("commands", []) if " train.py " in f" {c} "), None)
    if cmd is None:
        return None
    argv = shlex.split(cmd)
    argv = argv[argv.index("train.py") + 1:]
    drop = {"--out": 1, "--stop-at-step": 1, "--resume": 0, "--overwrite": 0}
    kept, i = [], 0
    while i < len(argv):
        if argv[i] in drop:
            i += 1 + drop[argv[i]]
            continue
        kept.append(argv[i])
        i += 1
    if "--config" in kept:
        j = kept.index("--config") + 1
        kept[j] = os.path.join(ROOT, kept[j])
    return kept


# what a run of each method's default keeps from the grid's command: the data, the budget, the
# encoder, the seed and the method; the recipe (--config) and every other flag come from train.py
BUDGET_FLAGS = {"--data": 1, "--arch": 1, "--method": 1, "--batch-size": 1, "--seed": 1,
                "--epochs": 1, "--max-steps": 1, "--no-progress": 0, "--log-every": 1,
                "--save-every": 1}


@functools.lru_cache(maxsize=None)
def _steps_per_epoch(data: str, batch_size: int) -> int:
    """Optimizer steps per epoch of `data` at this global batch (drop_last), read once per data
    set: the page asks it of every row."""
    from nac_fast.data.sources import data_scale
    return max(1, data_scale(data)[0] // batch_size)


def default_and_epochs(row) -> tuple[bool, float | None]:
    """(trained with its method's default recipe as train.py resolves it today, training epochs).
    A run is a default run when its resolved configuration equals that of `train.py --method M`
    with only the grid's data, budget, encoder and seed: e.g. SimCLR's runs over
    fashion_mnist_paper.toml are (NAC's head options do not apply to SimCLR), NAC's over it are
    not.  Epochs: --epochs, or the steps over the steps per epoch for a --max-steps budget."""
    c = _compare_with_today(row)
    return (False, None) if c is None else (c[1], c[2])


def trains_as_today(row) -> bool:
    """The run's command, run today, trains what the run trained: False for a command without
    --config (or over its recipe's flags) whose default recipe has changed since, e.g. the
    p schedule's step threshold.  Runs without a train.py command (random init) count as today's."""
    c = _compare_with_today(row)
    return True if c is None else c[0]


def _compare_with_today(row):
    """(the run trained what its command trains today, it trained today's default recipe of its
    method, training epochs), or None when the row has no parseable train.py command."""
    argv = _train_argv(row) if row.get("method") != "random" else None
    if argv is None:
        return None
    from nac_fast.train.config import parse
    base, i = [], 0
    while i < len(argv):
        n = BUDGET_FLAGS.get(argv[i])
        if n is not None:
            base += argv[i:i + 1 + n]
            i += 1 + n
        else:
            i += 1
    try:
        full, dflt = parse(argv + ["--out", "OUT"]), parse(base + ["--out", "OUT"])
        # the row's flags name what it trained, also where its variant was relabelled after the
        # run (its command then lacks them): a repeated flag parses to the same value
        flagged = parse(argv + list(row.get("flags") or []) + ["--out", "OUT"])
    except (ValueError, SystemExit):
        return None
    spe = _steps_per_epoch(full.data, full.batch_size)

    def steps(c):
        return c.max_steps or max(c.epochs * spe, c.min_steps or 0)
    ignore = set(NOT_TRAINING) | {"epochs", "max_steps", "min_steps"}
    if full.method != "nac-mq":
        ignore |= {"l2"}                     # NAC-MQ's lambda: no term of the other losses
    if full.method == "simclr":
        ignore |= {"flip_prob", "flip_prob_final", "flip_prob_final_min_steps",
                   "flip_prob_final_min_images", "channel_likelihood"}  # no channel
    command = _effective_p_schedule(vars(flagged), steps(full))
    trained = command
    if row.get("recipe") == "default" and row.get("signature"):
        # a command without --config meant the default of its day: what the run trained is the
        # configuration recorded with it (its signature), not its command parsed today; a key
        # recorded before it existed had its built-in value
        recorded = with_built_ins(json.loads(row["signature"])[1])
        trained = _effective_p_schedule({k: recorded[k] for k in vars(full)}, steps(full))
    today = _effective_p_schedule(vars(dflt), steps(dflt))

    def same(a, b):
        return all(a[k] == b[k] for k in a if k not in ignore)
    return (same(trained, command), steps(full) == steps(dflt) and same(trained, today),
            round(steps(full) / spe, 2))


def _effective_p_schedule(cfg: dict, total_steps: int) -> dict:
    """cfg with its p schedule as a run of total_steps trains it ([M:p-schedule]): the final p
    where the schedule applies, else None; the thresholds themselves then say nothing more."""
    from nac_fast.train.schedule import p_schedule_applies
    p1 = cfg.get("flip_prob_final")
    on = p_schedule_applies(p1, cfg.get("flip_prob_final_min_steps"), total_steps,
                            cfg.get("flip_prob_final_min_images"), cfg.get("batch_size"))
    return dict(cfg, flip_prob_final=p1 if on else None, flip_prob_final_min_steps=None,
                flip_prob_final_min_images=None)


def reusable_rows(args) -> dict:
    """{signature: row} of the finished runs of every grid under --out (each row under the
    signature it was recorded with and, for the pinned recipes, the one its command has today)."""
    out = {}
    for g in GRIDS:
        for r in load_rows(os.path.join(args.out, g, "results.jsonl")):
            if r.get("reused_from"):
                continue
            for sig in (r.get("signature"), current_signature(r)):
                if sig:
                    out.setdefault(sig, r)
    return out


def hours(s: float) -> str:
    return f"{s / 3600:.1f} h"


def run_grid(args, variants, seeds, curve, curve_seeds, planned=None) -> tuple[int, list]:
    """Runs (or, with --dry-run, lists) the grid's runs that are not done yet; returns (status,
    plan), plan = [(variant, seed, train_s, eval_s)] of the runs still to do (their estimates).
    A run whose signature (what it trains) matches a finished run of any grid under --out, with
    no curve to evaluate, copies that run's line instead of training again; `planned` (a set,
    shared over the grids of one call) lets a dry run count such a run once."""
    planned = set() if planned is None else planned
    gdir = os.path.join(args.out, args.grid)
    if not args.dry_run:
        os.makedirs(gdir, exist_ok=True)
    results = os.path.join(gdir, "results.jsonl")
    done = {(r["variant"], r["seed"], r["budget"]) for r in load_rows(results)}
    failed, plan = [], []
    for seed in seeds:  # seed-major: a partial grid has every variant at the first seeds
        for name, (method, flags, recipe) in variants.items():
            if (name, seed, budget_tag(args)) in done:
                if args.dry_run:
                    print(f"== {args.grid} {name} seed {seed}: done ({results})", flush=True)
                continue
            c = curve if seed in curve_seeds else []
            sig = signature(args, method, flags, recipe, seed)
            same = reusable_rows(args).get(sig) if sig and not c else None
            if same is not None or (args.dry_run and sig in planned and not c):
                src = (f"{same['grid']} {same['variant']}" if same is not None else
                       "a run planned above")
                print(f"== {args.grid} {name} seed {seed}: the same run as {src} (reused)",
                      flush=True)
                if same is not None and not args.dry_run:
                    row = dict(same, grid=args.grid, variant=name, flags=flags, recipe=recipe,
                               reused_from=f"{same['grid']}/{same['variant']}")
                    with open(results, "a") as f:
                        f.write(json.dumps(row) + "\n")
                continue
            if sig:
                planned.add(sig)
            m = None if c else measured_seconds(args, method, flags)
            if m:  # this machine's own wall times at this batch beat the cost model
                t_tr, t_ev = m[0] * total_steps(args), m[1]
                how = f"as {m[2]} finished run{'s' * (m[2] > 1)} under --out took"
            else:
                (t_tr, t_ev), how = estimate_seconds(args, method, c), "cost model"
            plan.append((name, seed, t_tr, t_ev))
            print(f"== {args.grid} {name} seed {seed} ({budget_tag(args)}; estimated "
                  f"{(t_tr + t_ev) / 60:.0f} min, {how})", flush=True)
            try:
                row = do_run(args, name, method, flags, recipe, seed, c)
            except RuntimeError as exc:  # the other runs are independent: go on
                print(str(exc), file=sys.stderr, flush=True)
                failed.append(f"{args.grid} {name} seed {seed}")
                continue
            if row:
                row["commit"], row["signature"] = commit(), sig
                with open(results, "a") as f:
                    f.write(json.dumps(row) + "\n")
                last = row.get("last", {})
                print(f"   mAP@128 {row.get('map', {}).get('128')}  linear "
                      f"{row.get('linear_top1')}  kNN {row.get('knn_top1')}  code_mag "
                      f"{last.get('code_mag')}  r_slope {last.get('r_slope')}  "
                      f"({row['seconds_total']:.0f} s)", flush=True)
    if failed:
        print("failed: " + "; ".join(failed), file=sys.stderr)
        return 1, plan
    return 0, plan


def print_plan(plans: dict) -> float:
    """The dry run's summary: runs to do per grid and their estimated cost; returns the total s."""
    total = 0.0
    print("\nplan (runs not done yet; estimated wall time: as the finished runs under --out "
          "at this batch took, else the cost model of 2 CPU cores, +-50%):")
    for g, plan in plans.items():
        tr, ev = sum(p[2] for p in plan), sum(p[3] for p in plan)
        total += tr + ev
        print(f"  {g:9s} {len(plan):3d} runs  train {hours(tr)}  eval {hours(ev)}  "
              f"total {hours(tr + ev)}")
    n = sum(len(p) for p in plans.values())
    print(f"  all       {n:3d} runs  estimated {hours(total)} of wall time, {hours(2 * total)} of "
          f"CPU-core time (2 cores busy)")
    return total


# ---- the page --------------------------------------------------------------------------------

def mean_std(vals):
    vals = [v for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return None, None, 0
    m = sum(vals) / len(vals)
    s = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return m, s, len(vals)


def fmt(vals, scale=100.0, digits=1) -> str:
    m, s, n = mean_std(vals)
    if m is None:
        return "-"
    if n == 1:
        return f"{scale * m:.{digits}f}"
    return f"{scale * m:.{digits}f} ± {scale * s:.{digits}f}"


def groups_of(rows: list) -> dict:
    """{(budget, variant): [rows]} in the order first seen."""
    g = {}
    for r in rows:
        g.setdefault((r["budget"], r["variant"]), []).append(r)
    return g


def describe(r) -> str:
    if r["method"] == "random":
        return "untrained encoder"
    base = "SimCLR's own head" if r["method"] == "simclr" else {
        "paper": "paper heads", "learning": "learning heads",
        "default": "default recipe"}.get(r["recipe"], r["recipe"])
    if r["recipe"] == "default" and not trains_as_today(r):
        base += f" of commit {r.get('commit', 'unknown')} (today's differs)"
    return base + (" + `" + " ".join(r["flags"]) + "`" if r["flags"] else "")


def results_table(rows: list) -> list:
    L = ["| variant | runs as | seeds | mAP@all 128 b % | 64 b % | 16 b % | linear top-1 % | "
         "kNN top-1 % | distinct codes 128 b % | held-out mean abs(tanh a) | log: code_mag | "
         "r_slope | loss_excess | collapse warning |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    budget = None
    for (b, name), g in groups_of(rows).items():
        if b != budget:
            budget = b
            L.append(f"| *{b}* | | | | | | | | | | | | | |")
        last = [x.get("last", {}) for x in g]
        trained = g[0]["method"] != "random"
        L.append(
            f"| {name} | {describe(g[0])} | {len(g)} | "
            f"{fmt([x.get('map', {}).get('128') for x in g])} | "
            f"{fmt([x.get('map', {}).get('64') for x in g])} | "
            f"{fmt([x.get('map', {}).get('16') for x in g])} | "
            f"{fmt([x.get('linear_top1') for x in g])} | {fmt([x.get('knn_top1') for x in g])} | "
            f"{fmt([x.get('distinct128') for x in g], 100, 0)} | "
            f"{fmt([x.get('heldout_code_mag') for x in g], 1, 3)} | "
            + (f"{fmt([v.get('code_mag') for v in last], 1, 3)} | "
               f"{fmt([v.get('r_slope') for v in last], 1, 2)} | "
               f"{fmt([v.get('loss_excess') for v in last], 1, 2)} | "
               f"{sum(bool(x.get('collapse_warning')) for x in g)}/{len(g)} |"
               if trained else "- | - | - | - |"))
    return L


def plot_curves(all_rows: dict, path: str) -> bool:
    """code_mag (training log) and hash mAP (evaluated checkpoints) against the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(g, rows) for g, rows in all_rows.items() if g in ("main", "long") and rows]
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 3.8 * len(panels)), squeeze=False)
    for (grid, rows), (ax0, ax1) in zip(panels, axes):
        colours = {}
        for r in rows:
            if r["method"] == "random" or r["method"] == "simclr" and not r.get("curve"):
                continue
            c = colours.setdefault(r["variant"], f"C{len(colours)}")
            tr = [t for t in r.get("trace", []) if "code_mag" in t]
            if r["method"] != "simclr" and tr:
                ax0.plot([t["step"] for t in tr], [t["code_mag"] for t in tr], color=c, lw=1,
                         alpha=0.8, label=r["variant"] if r["seed"] == min(
                             x["seed"] for x in rows if x["variant"] == r["variant"]) else None)
            if r.get("curve"):
                pts = [p for p in r["curve"] if p.get("map")]
                ax1.plot([p["step"] for p in pts], [100 * p["map"]["128"] for p in pts], "o-",
                         color=c, label=f"{r['variant']} (seed {r['seed']})")
        ax0.set(xlabel="step", ylabel="mean |tanh a| (training batch)",
                title=f"{grid}: code magnitude")
        if ax0.lines:
            ax0.set_yscale("log")
        else:  # rows restored from results_summary.json, which keeps no training trace
            ax0.text(0.5, 0.5, "no training log in these rows\n(results_summary.json keeps none)",
                     ha="center", va="center", transform=ax0.transAxes, color="0.4")
        ax1.set(xlabel="step", ylabel="128-bit mAP@all (%)", title=f"{grid}: hash retrieval")
        for ax in (ax0, ax1):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_page(args) -> int:
    import torch
    all_rows = {}
    for g in GRIDS:
        rows = load_rows(os.path.join(args.out, g, "results.jsonl"))
        if rows:
            all_rows[g] = rows
    if not all_rows:
        raise SystemExit(f"no results under {args.out}/*/results.jsonl")
    titles = {"main": "Main table", "ablation": "Ablation of the head options",
              "explore": "The code gain",
              "psweep": "Flip probability p (learning heads, in-batch NAC)",
              "long": "Longer run",
              "budgets": "Each method's default at every budget",
              "pschedule": "The default's p schedule taken apart (docs/math.md [M:p-schedule])",
              "likelihood": "The channel's own likelihood (docs/math.md [M:multilinear])",
              "mq": "NAC-MQ: its lambda (docs/math.md [M:mq-l2]) and its keys' lag"}
    commits = sorted({r.get("commit", "unknown") for rows in all_rows.values() for r in rows})
    mins = sum(r.get("seconds_total", 0) for rows in all_rows.values() for r in rows) / 60
    L = ["# Small-scale reproduction on Fashion-MNIST", "",
         f"Generated by `python scripts/reproduce_fmnist.py --doc {args.doc}"
         + (f" --notes {args.notes}" if args.notes else "")
         + (f" --heldout {args.heldout}" if args.heldout else "") + f"` on {time.strftime('%Y-%m-%d')} "
         f"from the runs of the grids below ({platform.node()}, {os.cpu_count()} CPUs shared with "
         f"other jobs, torch {torch.__version__}, commits {', '.join(commits)}; "
         f"{mins:.0f} min of runs in all).", "",
         "Every run: encoder `resnet-tiny`, global batch 256, the same augmentations "
         "(train.py's Fashion-MNIST recipe); each figure is the mean ± sample std over the seeds "
         "(`seeds` runs, seeds 0, 1, 2, ...). Evaluation: `python -m nac_fast.eval` on the full "
         "splits (gallery = the 60k training images, queries = the 10k test images, relevant = "
         "same class, Hamming ranking with ties by gallery index); k-bit figures are the first k "
         "bits of the 128-bit code. `held-out mean abs(tanh a)` is over the test images' codes; "
         "the `log:` columns are the training log's last record (view-1 rows of one batch): "
         "`code_mag` = mean abs(tanh a), `r_slope` = least-squares slope of r on tanh a (one "
         "intercept per bit), `loss_excess` = loss minus its zero-code value (D ln 2 for NAC, "
         "2 D ln 2 for NAC-MQ's loss + vi, ln(2B-1) for SimCLR). `runs as`: the flags over "
         "`configs/fashion_mnist_paper.toml` (*paper heads*) or "
         "`configs/fashion_mnist_learning.toml` (*learning heads*, fixed gains, docs/math.md "
         "[M:heads]); the default recipe configs/small.toml trains the learning heads "
         "with `--learn-gain`.", ""]
    for g in GRIDS:
        if g not in all_rows:
            continue
        L += [f"## {titles[g]}", ""] + results_table(all_rows[g]) + [""]
    for root in args.heldout_roots:
        # every grid run on that data (budgets: the defaults; pschedule: its parts)
        rows = [r for g in GRIDS for r in load_rows(os.path.join(root, g, "results.jsonl"))]
        if not rows:
            raise SystemExit(f"--heldout {root}: no results in {root}/*/results.jsonl")
        argv = _train_argv(rows[0]) or []
        data = argv[argv.index("--data") + 1] if "--data" in argv else root
        name = os.path.basename(os.path.normpath(data))
        budgets = ", ".join(dict.fromkeys(r["budget"] for r in rows))
        grids = ", ".join(dict.fromkeys(r["grid"] for r in rows))
        if name == "fashion-mnist":     # the data the recipes were tuned on: not held out
            all_rows[f"extra:{name}:{budgets}"] = rows
            L += [f"## Fashion-MNIST at another budget ({budgets})", "",
                  f"Not held-out data: the main grids' protocol at a budget or batch they do not "
                  f"cover, a check of a recipe rule (the reading below says which). "
                  f"`--out {root}` (the grids {grids}).", ""] + results_table(rows) + [""]
            continue
        all_rows[f"heldout:{name}:{budgets}"] = rows
        L += [f"## Held-out data: {name} ({budgets})", "",
              f"`{data}`: not Fashion-MNIST (issue 26's held-out check; the reading below says "
              f"which of its runs, if any, informed a recipe value). Same protocol, "
              f"`--out {root} --data {data}` (the grids {grids}); k-bit figures are "
              "the first k bits of the code.", ""] + results_table(rows) + [""]
    have_plot = plot_curves(all_rows, os.path.join(os.path.dirname(os.path.abspath(args.doc)),
                                                   "curves.png"))
    if have_plot:
        L += ["## Curves", "", "![code magnitude and mAP against the step](curves.png)", ""]
    L += ["## Commands", "", "One line per run as it was run (`python` is the environment's "
          "interpreter); every run's line in `runs/repro/<grid>/results.jsonl` (and "
          "`results_summary.json` beside this page) has its commands and wall time.", "",
          "```text"]
    here = os.getcwd().rstrip(os.sep) + os.sep          # paths as a user of this checkout types
    for g, rows in all_rows.items():
        args_seen = set()
        for r in rows:
            for c in r["commands"]:
                key = c.replace(here, "").replace(f"--seed {r['seed']}", "--seed S").replace(
                    f"seed{r['seed']}", "seedS")
                if key not in args_seen:
                    args_seen.add(key)
                    L.append(key)
    L += ["```", "", "`S` is the seed (0, 1, 2, ...).", ""]
    md = "\n".join(L)
    for notes in args.notes_files:
        with open(notes) as f:
            md += "\n" + f.read()
    with open(args.doc, "w") as f:
        f.write(md)
    summary = {}
    for g, rows in all_rows.items():
        summary[g] = []
        for r in rows:
            d, ep = default_and_epochs(r)
            summary[g].append(dict({k: v for k, v in r.items() if k != "trace"}, default=d,
                                   epochs=ep))
    with open(os.path.join(os.path.dirname(os.path.abspath(args.doc)), "results_summary.json"),
              "w") as f:
        json.dump(summary, f, indent=1)
    print(md)
    return 0


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        per_grid, seeds, curve, curve_seeds = check_args(args)
    except ValueError as exc:
        ap.error(str(exc))
    status, plans, planned = 0, {}, set()
    for g, variants in per_grid.items():
        gargs = argparse.Namespace(**dict(vars(args), grid=g))
        st, plans[g] = run_grid(gargs, variants, seeds, curve, curve_seeds, planned)
        status = max(status, st)
    if args.dry_run and per_grid:
        print_plan(plans)
    if args.doc and not args.dry_run:
        write_page(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
