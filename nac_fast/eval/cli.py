"""Evaluate a trained NAC / NAC-MQ / SimCLR checkpoint (docs/math.md [M:linear-probe], [M:knn],
[M:hash-split], [M:stats]).

    python -m nac_fast.eval --checkpoint runs/default/last.pt --data fashion-mnist --out runs/eval
    python -m nac_fast.eval --checkpoint CKPT --data fashion-mnist --out DIR \\
        --tasks linear,hash,knn,expressivity --bits 16,32,64,128 --linear-epochs 100
    python -m nac_fast.eval --checkpoint CKPT --out DIR --quick     # a quick look (not the protocol):
                                                             # --limit-train 5000 --limit-test 1000
                                                             # --linear-epochs 10
    python -m nac_fast.eval --checkpoint CKPT --out DIR --tasks hash --hash-protocol paper \\
        --queries-per-class 1000                             # the paper's CIFAR-10-style split
    python -m nac_fast.eval --checkpoint CKPT --out DIR      # a run of train.py --train-subset
                                                             # paper-hash: the paper protocol,
                                                             # the split it trained on

What it does:
  1. Loads the frozen model (``--which online|momentum``) in eval mode and, under torch.no_grad,
     extracts for every image of the train and test splits (one centred view, deterministic
     order) the encoder features h and the projection-head pre-activations a.  They are cached
     in ``DIR/features_{train,test}.pt`` ({"h", "a", "labels", "meta"}: h in float16, each
     split's rows written once into buffers of its final size, a in float32 so that its signs
     are kept exactly; extraction.SplitFeatures); a later run with the
     same checkpoint file (path, size, mtime), --which, data, limit and image size reuses them
     (the report says so under "features"), anything else recomputes them.
  2. Runs the tasks on the cached tensors:
     - linear: linear probe on h [M:linear-probe] (held-out 10% of the training split for the
       lr search): test top-1 and the chosen lr.
     - knn: cosine kNN on h [M:knn] (k capped at the training-set size): top-1.
     - hash: codes c = sgn(a) [M:code], mAP@all with Hamming ranking [M:ap] (and mAP@K
       [M:ap-at-k], P@H<=r [M:radius], P@N [M:precision-at-n], the PR curve [M:pr-curve]: CSVs
       and hash_curves.png in DIR), under the
       "standard" or "paper" protocol of [M:hash-split] (paper: metrics.retrieval_split).  A
       checkpoint trained with train.py --train-subset paper-hash gets the paper protocol by
       default, with the split it trained on (its --queries-per-class and --split-seed; other
       values, or limits, which change the pool, are usage errors) and checked: the split's
       training images must be the ones the run trained on (their digest, recorded by train.py).
       Bit counts: the model's D by default; for every k < D named in --bits the figure is the
       mAP of the first k bits of the same D-bit code (a k-bit PREFIX of one D-bit model, NOT a
       separately trained k-bit model as in the paper's tables) [M:prefix].
       With --itq also "map_itq": the mAP of sgn of the ITQ-rotated standardised a [M:itq]
       (rotation fitted on the gallery's a, no labels; one per k), beside the sgn(a) figure.
     - expressivity: nac_fast.code_statistics of the test-split codes [M:stats] (distinct
       codes, mean pairwise Hamming distance, balance_dev, bit entropy), for D and every prefix
       in --bits; the report's keys are CodeStatistics' field names.
  3. Writes DIR/report.json (checkpoint, data, split sizes, training config, every task's
     numbers, timings) and DIR/report.md (a markdown table and the hash protocol), atomically,
     and prints the table.  A DIR that holds an earlier report is refused before any work
     unless --overwrite (which replaces the report and reuses the matching feature cache; the
     earlier report and hash files are removed before this run writes its first file of them,
     so a run that fails half-way leaves none beside files it does not describe); a report.json
     that is not an evaluation's (a python -m nac_fast.vae run's) is refused, --overwrite or not.
     Feature extraction, the probe's epochs, kNN and hashing show tqdm bars with an ETA
     (--no-progress: none).

--limit-train / --limit-test N evaluate on N images of the split spread evenly over it (image
floor(i n / N) for i < N: every (n / N)-th where N divides n), so that class-sorted folders keep
all classes.
Bad arguments (missing checkpoint, unknown task, bits outside [1, D], bad limits, data that does
not match the checkpoint, --itq with a gallery of 1 image) stop with a usage error (exit
status 2) before any feature extraction; so do weights that do not fit the checkpoint's config
(when the model is loaded) and features that hold NaN or inf (a diverged run: sgn(NaN) would be
a bit -1 of every code), once extracted, before any task.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import numpy as np
import torch

from .._files import atomic_write, check_writable
from ..train.checkpoint import load_checkpoint, load_model, save_atomic, write_json_atomic
from ..data import build_eval_loader
from ..data.sources.subset import indices_digest
from .metrics import itq_codes, itq_fit, knn_accuracy, linear_probe, retrieval_split
from .augprobe import check_probe_flags, run_linear_probe
from .hashlists import check_list_flags, imagenet100_sets
from ..codestats import code_statistics
from ..ops.retrieval import mean_average_precision, retrieval_metrics
from ..ops.search import resolve_backend
from ..train.distributed import broadcast_object, gather_objects, init_distributed
from .extraction import (CPU_MICRO_BATCH, H_DTYPE, MAX_DEFAULT_WORKERS, SplitFeatures,
                         default_workers, extraction_network, gather_rows, shard_bounds)
from .features import FeatureRangeError

TASKS = ("linear", "hash", "knn", "expressivity")
PRECISION_AT_N = (1, 10, 50, 100, 200, 500, 1000)
PAPER_LINEAR_LRS = (0.01, 0.1, 1.0, 10.0)  # docs/math.md [M:linear-probe]
QUICK = {"limit_train": 5000, "limit_test": 1000, "linear_epochs": 10}
FEATURE_FILE = "features_{}.pt"
# write_hash_curves's files: the PR curve, P@N, their PNG
HASH_FILES = ("hash_pr_curve.csv", "hash_precision_at_n.csv", "hash_curves.png")
HELD_OUT = (" (the test split: a part of each class of a folder without train/ and val/, held out "
            "of training by file name)")
# Bump when the cached tensors' meaning changes, so stale caches are recomputed, never misread.
CACHE_VERSION = 3  # 2: a --limit that does not divide the split spreads over all of it;
#                   3: h stored in float16 (extraction.H_DTYPE), a float32 as before


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------

def _list_of(cast, what: str):
    """An argparse type: comma-separated values of `cast` (at least one)."""
    def parse(s: str) -> list:
        try:
            out = [cast(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {s!r}")
        if not out:
            raise argparse.ArgumentTypeError(f"expected at least one {what[:-1]}")
        return out
    parse.__name__ = f"{what[:-1]} list"  # argparse names the type in its messages
    return parse


# argparse types (also scripts/probe_rates.py's)
int_list = _list_of(int, "integers")
float_list = _list_of(float, "numbers")


def _task_list(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [t for t in out if t not in TASKS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown task(s) {bad or s!r}; choose from "
                                         f"{','.join(TASKS)}")
    return list(dict.fromkeys(out))  # de-duplicated, order kept


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m nac_fast.eval",
                                 description="Evaluate a NAC checkpoint: linear probe, hash "
                                 "retrieval mAP, kNN, code expressivity.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 allow_abbrev=False)
    a = ap.add_argument
    a("--checkpoint", required=True, help="train.py checkpoint (e.g. runs/default/last.pt)")
    a("--data", default=None, help="fashion-mnist | CIFAR-10 dir | ImageFolder root (train/ and "
      "val/, or class folders alone: their test split is the part of each class train.py held "
      "out); default: the data set recorded in the checkpoint")
    a("--out", required=True, help="output directory (feature cache, report.json, report.md)")
    a("--val-labels", metavar="FILE", default=None, help="labels of a flat val/ (ILSVRC2012's as "
      "distributed: LOC_val_solution.csv, or the devkit's ILSVRC2012_validation_ground_truth.txt "
      "with a synsets.txt beside it); default: the one at the --data root or its parent")
    a("--overwrite", action="store_true", help="replace the report of an earlier evaluation in "
      "--out (its cached features are reused where they match); without it such an --out is "
      "refused")
    a("--tasks", type=_task_list, default=list(TASKS), help="comma-separated subset of "
      + ",".join(TASKS))
    a("--bits", type=int_list, default=None, help="comma-separated code lengths for hash and "
      "expressivity; k < D means the first k bits of the D-bit code; default: D")
    a("--quick", action="store_true", help="a quick look: --limit-train 5000 --limit-test 1000 "
      "--linear-epochs 10 unless given (NOT the protocol: see the README's 'quick look')")
    a("--linear-epochs", type=int, default=None, help="linear-probe epochs (paper and default: "
      "100; --quick: 10)")
    a("--linear-batch-size", type=int, default=256, help="linear-probe SGD batch size")
    a("--linear-lrs", type=float_list, default=list(PAPER_LINEAR_LRS),
      help="comma-separated learning rates of the linear probe's search (default: the paper's; "
      "another list is not the protocol, and report.json records the list searched)")
    a("--knn-k", type=int, default=200, help="kNN neighbours (capped at the train-set size)")
    a("--knn-temperature", type=float, default=0.1, help="kNN vote temperature")
    a("--limit-train", type=int, default=None, help="use N images of the train split")
    a("--limit-test", type=int, default=None, help="use N images of the test split")
    a("--batch-size", type=int, default=256, help="feature-extraction batch size")
    a("--workers", type=int, default=None, help="loader worker processes of feature extraction "
      "(per rank under torchrun) that decode an image folder's files; 0: decode in the main "
      "process.  Default: the CPU cores of this process's share of the node (its cores / the "
      f"processes torchrun started on the node), at most {MAX_DEFAULT_WORKERS}.  In-memory data "
      "sets (fashion-mnist, CIFAR-10) need none: a batch is one tensor gather")
    a("--eager-extraction", action="store_true", help="extract with the network as trained "
      "(eager, NCHW, whole batches) instead of its copy with batch norm folded into the "
      "convolutions, channels-last, in CPU micro-batches (the default: 1.65x the images/s on "
      "a 2-core CPU, features equal to ~1e-6; bench/results/eval_extract_cpu.md)")
    a("--which", default="online", choices=("online", "momentum"),
      help="which model of the checkpoint (momentum: NAC-MQ's EMA model)")
    a("--hash-protocol", default=None, choices=("standard", "paper", "imagenet100"),
      help="standard: queries = test split, gallery = train split; paper: pooled splits, "
      "--queries-per-class queries per class, the rest the gallery (default: paper for a "
      "checkpoint trained with train.py --train-subset paper-hash, else standard); "
      "imagenet100: the literature's ImageNet-100 (HashNet): --hash-database-list / "
      "--hash-query-list, or a seeded rule without them (docs/evaluation.md)")
    a("--queries-per-class", type=int, default=None, help="queries per class (paper protocol; "
      "default: the checkpoint's --queries-per-class when it trained on the paper-hash subset, "
      "else 1000)")
    a("--split-seed", type=int, default=None, help="seed of the paper protocol's split "
      "(default: the checkpoint's --split-seed when it trained on the paper-hash subset, else "
      "--seed)")
    a("--map-at", type=int_list, default=[1000, 5000], help="K values of mAP@K "
      "(DeepHash-pytorch convention, docs/math.md [M:ap-at-k]); capped at the gallery size")
    a("--radius", type=int, default=2, help="Hamming radius of the hash-lookup precision P@H<=r")
    a("--precision-at-n", type=int_list, default=list(PRECISION_AT_N),
      help="N values of the P@N curve (those above the gallery size are dropped)")
    a("--itq", action="store_true", help="also report the mAP of ITQ-rotated codes "
      "(docs/math.md [M:itq]: a rotation fitted on the gallery's a, no labels; a post-processing "
      "for comparison, not NAC's code sgn(a))")
    # issue 55: the probe at full size, the anchors' probe, ImageNet-100 (augprobe, hashlists)
    a("--probe", default="cached", choices=("cached", "augmented"), help="linear probe on the "
      "cached centre-crop features, or on fresh random-resized crops + flips through the frozen "
      "encoder every epoch (MoCo's protocol; docs/evaluation.md 'Which probe')")
    a("--probe-device-mem", default=None, metavar="BYTES", help="device memory the cached "
      "probe may take (e.g. 8G); features beyond it stay on the host and are streamed in "
      "chunks, with the same epochs (default: no bound); kNN's train features are streamed "
      "within it too, with the same predictions")
    a("--hash-database-list", default=None, metavar="FILE", help="imagenet100: the database "
      "list ('<path> <0/1 label vector>' per line, HashNet / DeepHash-pytorch database.txt), "
      "images of the train split matched by file name")
    a("--hash-query-list", default=None, metavar="FILE", help="imagenet100: the query list "
      "(test.txt), images of the val split")
    a("--hash-train-list", default=None, metavar="FILE", help="imagenet100: the training list "
      "(train.txt), checked to lie in the database and reported")
    a("--hash-classes", type=int, default=None, help="imagenet100 without lists: classes drawn "
      "by the seeded rule (default 100)")
    a("--seed", type=int, default=0, help="seed of the linear probe (and of the paper split "
      "unless --split-seed or the checkpoint names one)")
    a("--device", default="auto", choices=("auto", "cpu", "cuda"))
    a("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    return ap


def check_args(args) -> None:
    """Checks that need neither the checkpoint nor the data; raises ValueError naming the flag.
    Fills in --quick's values and the defaults that depend on it."""
    args.quick_limits = []  # the --limit-* that --quick set: at most the split, not an error
    if getattr(args, "quick", False):
        for k, v in QUICK.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
                if k.startswith("limit_"):
                    args.quick_limits.append(k)
    if args.linear_epochs is None:
        args.linear_epochs = 100
    if args.radius < 0:
        raise ValueError(f"--radius must be >= 0, got {args.radius}")
    for flag in ("map_at", "precision_at_n"):
        if min(getattr(args, flag)) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} values must be >= 1, got "
                             f"{getattr(args, flag)}")
    for flag in ("linear_epochs", "linear_batch_size", "knn_k", "batch_size", "queries_per_class"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if getattr(args, "workers", None) is None:
        args.workers = default_workers()
    elif args.workers < 0:
        raise ValueError(f"--workers must be >= 0, got {args.workers}")
    if args.split_seed is not None and args.split_seed < 0:
        raise ValueError(f"--split-seed must be >= 0, got {args.split_seed}")
    for flag in ("limit_train", "limit_test"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if args.limit_train is not None and "linear" in args.tasks and args.limit_train < 2:
        raise ValueError("--limit-train must be >= 2 for the linear probe (it holds out a "
                         "validation split for the lr search)")
    args.linear_lrs = list(dict.fromkeys(args.linear_lrs))  # de-duplicated, order kept
    bad = [v for v in args.linear_lrs if not (v > 0 and math.isfinite(v))]
    if bad:
        raise ValueError(f"--linear-lrs values must be positive numbers, got {bad}")
    if not (args.knn_temperature > 0 and math.isfinite(args.knn_temperature)):
        raise ValueError(f"--knn-temperature must be a positive number, got {args.knn_temperature}")
    if args.bits is not None and min(args.bits) < 1:
        raise ValueError(f"--bits values must be >= 1, got {args.bits}")
    if not os.path.exists(args.checkpoint):
        raise FileNotFoundError(f"--checkpoint {args.checkpoint!r}: no such file")
    if not os.path.isfile(args.checkpoint):
        raise ValueError(f"--checkpoint {args.checkpoint!r} is not a file")
    if args.val_labels is not None and not os.path.isfile(args.val_labels):
        raise FileNotFoundError(f"--val-labels {args.val_labels!r}: no such file")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    check_probe_flags(args)   # --probe, --probe-device-mem
    check_list_flags(args)    # --hash-*-list: read and checked before any work
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} is not a folder")
    report = os.path.join(args.out, "report.json")
    check_writable("--out", report)  # a parent that is a file, read-only: before any work
    # --overwrite of an earlier evaluation: its files are this run's to replace (and only then)
    args.replaces_report = os.path.lexists(report)
    if os.path.lexists(report):
        try:
            with open(report) as f:
                old = json.load(f)
            what = f" (checkpoint {old['checkpoint']!r}, tasks {','.join(old['tasks'])})"
            ours = isinstance(old.get("results"), dict)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            ours = False
        if not ours:  # another program's (a python -m nac_fast.vae run's: its finished mark)
            raise ValueError(f"--out {args.out!r} holds a report.json that is not the report of "
                             "an evaluation (a python -m nac_fast.vae run? a damaged file?): "
                             "nothing there is replaced, --overwrite or not; name another --out")
        if not args.overwrite:
            raise ValueError(f"--out {args.out!r} holds the report of an earlier evaluation"
                             f"{what}; pass --overwrite to replace it (its cached features are "
                             "reused where they match) or name another --out")


# --------------------------------------------------------------------------------------------
# Feature extraction with a cache
# --------------------------------------------------------------------------------------------

def _subset_loader(data, split, limit, batch_size, image_size, device, cap=False,
                   val_labels=None):
    """(loader, n_used, n_split): `limit` images spread evenly over the split (image
    floor(i n / limit), i < limit: every (n / limit)-th where limit divides n), so that a
    class-sorted folder keeps every class.  A limit beyond the split is a ValueError naming
    --limit-<split>, or with `cap` (--quick's own limit) the whole split."""
    full = build_eval_loader(data, split=split, batch_size=batch_size, image_size=image_size,
                             device=device, val_labels=val_labels)
    n = full.num_images
    if limit is None or limit >= n:
        if limit is not None and limit > n and not cap:
            raise ValueError(f"--limit-{split} {limit} exceeds the {split} split's {n} images")
        return full, n, n
    sub = build_eval_loader(data, split=split, batch_size=batch_size, image_size=image_size,
                            device=device, limit=limit, val_labels=val_labels)
    return sub, limit, n


def _data_key(data) -> str:
    """--data as the cache knows it: a path made absolute (the same relative name from another
    folder is other data), a named data set as it is."""
    data = str(data)
    return os.path.abspath(data) if os.path.exists(data) else data


def _cache_meta(args, data, split, limit, image_size, size=None) -> dict:
    """What a split's cached features must match to be reused: the checkpoint (path, size,
    mtime), which network, the data (absolute path), the split, the limit, the image size and,
    `size` = {"used", "total"}, the images used of the split's images now (a folder whose images
    were added or removed is other data)."""
    st = os.stat(args.checkpoint)
    meta = {"version": CACHE_VERSION, "checkpoint": os.path.abspath(args.checkpoint),
            "checkpoint_size": st.st_size, "checkpoint_mtime_ns": st.st_mtime_ns,
            "which": args.which, "data": _data_key(data), "split": split, "limit": limit,
            "image_size": image_size}
    if size is not None:
        meta.update(used=int(size["used"]), total=int(size["total"]))
    if getattr(args, "val_labels", None) is not None and split != "train":
        meta["val_labels"] = os.path.abspath(args.val_labels)
    return meta


def extract_features(model, loader, n_used, device, progress, desc, *, micro_batch=None,
                     channels_last=False, rows=None, commit=True):
    """{"h", "a", "labels"} (CPU; h in extraction.H_DTYPE = float16, a float32, labels int64)
    for the first n_used images of loader, written into an extraction.SplitFeatures allocated
    once (no list of batches concatenated: no second copy).  micro_batch: the network sees at
    most that many images at a time (each loader batch split in order); channels_last: the
    images go in channels-last (the network of extraction.extraction_network expects it).
    rows (default n_used): the store's size, its first n_used rows extracted here; with
    commit=False the SplitFeatures itself comes back (rank 0 under torchrun: the other ranks'
    rows are gathered into it).  A value of h beyond float16's range is a
    features.FeatureRangeError naming the row."""
    from tqdm.auto import tqdm
    store = SplitFeatures(n_used if rows is None else rows, desc)
    got = 0
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    with torch.inference_mode(), tqdm(total=n_used, desc=desc, unit="img",
                                      disable=not progress, file=sys.stderr) as bar:
        for x, y in loader:
            take = min(x.shape[0], n_used - got)
            x, y = x[:take].to(device, non_blocking=True, memory_format=fmt), y[:take]
            for xs in (x.split(micro_batch) if micro_batch else (x,)):
                h, a = model.encode(xs)  # h = f(x), a = g(h) (scaled pre-activations)
                store.write(h, a)
            store.put(got, "labels", y.cpu().to(torch.int64))
            got += take
            bar.update(take)
            if got >= n_used:
                break
    if got != n_used:
        raise RuntimeError(f"{desc}: the loader gave {got} images, {n_used} were planned")
    return store.commit() if commit else store


def _extract_options(args, device) -> dict:
    """extract_features's micro_batch / channels_last for this run (--eager-extraction: none)."""
    if args.eager_extraction:
        return {}
    return {"micro_batch": CPU_MICRO_BATCH if torch.device(device).type == "cpu" else None,
            "channels_last": True}


def _skipped(loader) -> list[str]:
    """The files `loader` skipped as undecodable (a folder's loader; [] for others).  Each takes
    no row: the next decodable file's features take its place, so the rows no longer line up
    with the split's file list (imagenet100 lists are matched by file name: hashlists)."""
    return [str(p) for p in (getattr(loader, "skipped_files", None) or [])]


def load_or_extract(args, model, data, split, limit, image_size, device, model_device,
                    size=None, ranks=None):
    """Cached features for a split if their meta matches this run (`_cache_meta`; `size`: the
    split's {"used", "total"} images now) and they hold one row per image used, else extract
    and save.  `model`: a callable that gives the network to extract with.
    ranks (torchrun: train.distributed.DistInfo): rank 0 reads the cache and tells the others;
    on a miss every rank extracts its shard (_extract_shard) and rank 0 gathers and saves the
    split's features; the other ranks get (None, cached, seconds, path)."""
    meta = _cache_meta(args, data, split, limit, image_size, size)
    path = os.path.join(args.out, FEATURE_FILE.format(split))
    hit = None
    if os.path.isfile(path) and (ranks is None or ranks.rank == 0):
        try:
            cached = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # a corrupt or foreign file is recomputed, not trusted
            cached = None
        if (isinstance(cached, dict) and cached.get("meta") == meta
                and all(isinstance(cached.get(k), torch.Tensor) for k in ("h", "a", "labels"))
                and (size is None or all(int(cached[k].shape[0]) == int(size["used"])
                                         for k in ("h", "a", "labels")))
                and not cached.get("skipped_files")):  # extracted again: it may be repaired
            hit = cached
    if (hit is not None) if ranks is None else broadcast_object(hit is not None):
        return hit, True, 0.0, path
    loader, n_used, _ = _subset_loader(data, split, limit, args.batch_size, image_size, device,
                                       val_labels=getattr(args, "val_labels", None))
    if hasattr(loader, "num_workers"):  # a folder's loader: --workers decode its files
        loader.num_workers = args.workers
    t0 = time.perf_counter()
    if ranks is not None:
        feats = _extract_shard(args, model, loader, n_used, model_device, split, ranks)
    else:
        feats = extract_features(model(), loader, n_used, model_device, args.progress,
                                 f"features {split}", **_extract_options(args, model_device))
    dt = time.perf_counter() - t0
    if ranks is None:
        feats["skipped_files"] = _skipped(loader)
        feats["meta"] = meta
        save_atomic(feats, path)
        return feats, False, dt, path
    problem = None
    if feats is not None:  # rank 0 alone writes (the others' feats are None: theirs are in it)
        feats["meta"] = meta
        try:
            save_atomic(feats, path)
        except Exception as exc:
            problem = _crash(exc, ranks, f"saving {path}")
    stop_if_failed(ranks, problem)  # the others learn whether it could
    return feats, False, dt, path


# --------------------------------------------------------------------------------------------
# Under torchrun: one process group, extraction sharded over the ranks, failures agreed on
# --------------------------------------------------------------------------------------------

class UsageError(Exception):
    """A usage error (exit status 2) that one rank met, for the ranks to agree on."""


class _Raising:
    """Stands in for the parser where a rank must not exit alone: .error raises UsageError."""

    @staticmethod
    def error(message):
        raise UsageError(message)


def start_ranks(parser, args):
    """Under torchrun (WORLD_SIZE > 1): the process group, from train.distributed
    .init_distributed (gloo on the CPU, NCCL on GPUs: --device as there, rank r on cuda:LOCAL_RANK);
    else None (one process, no group)."""
    if os.environ.get("WORLD_SIZE", "1") in ("", "1"):
        return None
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")  # every rank alike
    try:
        ranks = init_distributed(args.device)
    except ValueError as exc:  # a malformed torchrun environment (RANK, WORLD_SIZE, ...)
        parser.error(str(exc))
    return ranks if ranks.world_size > 1 else None


def end_ranks() -> None:
    """Leave the process group (when there is one)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def stop_if_failed(ranks, problem, extra=None) -> list:
    """The end of a phase, on every rank: `problem` is None (this rank did its part) or (status,
    message).  Every rank's (problem, extra) is all-gathered; when some rank failed, every rank
    stops here (SystemExit) with the first failing rank's message and status (2: a usage error,
    printed with the usage line as parser.error does; 1: an exception, whose traceback the
    failing rank printed), so that no rank waits in a collective for one that left.  Else every
    rank's `extra`, in rank order."""
    got = gather_objects((problem, extra))
    failed = next((p for p, _ in got if p is not None), None)
    if failed is None:
        return [e for _, e in got]
    status, message = failed
    end_ranks()
    parser = build_parser()
    if status == 2:
        parser.error(message)
    parser.exit(status, f"{parser.prog}: error: {message}\n")


def _crash(exc, ranks, what: str) -> tuple:
    """(1, message) for an exception this rank met while `what`; its traceback printed here."""
    traceback.print_exc()
    return 1, (f"rank {ranks.rank} of {ranks.world_size} failed {what}: "
               f"{type(exc).__name__}: {exc}")


def _extract_shard(args, model, loader, n_used, device, split, ranks):
    """Under torchrun: this rank's shard of the split's first n_used images
    (extraction.shard_bounds: whole batches, in the order of one process), its features
    extracted, and every rank's gathered to rank 0 in rank order, i.e. the split's order: the
    features one process extracts, bit for bit.  A failure on any rank stops every rank
    (stop_if_failed) before the gather.  Rank 0 gets {"h", "a", "labels"}, the others None."""
    world = ranks.world_size
    bounds = [shard_bounds(n_used, args.batch_size, r, world) for r in range(world)]
    lo, hi = bounds[ranks.rank]
    store, problem = None, None
    try:
        if hi > lo:  # fewer batches than ranks leaves some rank none (never rank 0)
            loader.indices = loader.indices[:n_used][lo:hi]
            # rank 0 extracts into a store of the whole split: the others' rows are put into it
            # as they arrive (no second copy, no list of chunks)
            store = extract_features(model(), loader, hi - lo, device,
                                     args.progress and ranks.rank == 0,
                                     f"features {split} (rank 0's shard of {world})",
                                     rows=n_used if ranks.rank == 0 else None, commit=False,
                                     **_extract_options(args, device))
    except (UsageError, FeatureRangeError) as exc:
        problem = 2, str(exc)
    except Exception as exc:
        problem = _crash(exc, ranks, f"extracting the {split} split's features")
    mine = None if store is None else {"h": store.h.tensor, "a": store.a, "labels": store.labels}
    shape = None if mine is None else {k: tuple(mine[k].shape[1:]) for k in ("h", "a", "labels")}
    got = stop_if_failed(ranks, problem, (_skipped(loader), shape))
    widths = next(w for _, w in got if w is not None)
    skipped = [f for sk, _ in got for f in sk]  # every rank's, in rank order
    counts = [b - a for a, b in bounds]
    dtypes = {"h": H_DTYPE, "a": torch.float32, "labels": torch.int64}
    for k in ("h", "a", "labels"):
        # the rows sent were stored by their rank's own SplitFeatures, which checked h's range
        put = (lambda start, rows, k=k: store.put(start, k, rows)) if ranks.rank == 0 else None
        gather_rows(None if mine is None else mine[k][:counts[ranks.rank]], counts, widths[k],
                    dtypes[k], ranks.device, put=put)
    return {**store.commit(), "skipped_files": skipped} if ranks.rank == 0 else None


# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------

# the cached tensor each task reads: the encoder's h or the head's pre-activations a
TASK_FEATURES = {"linear": "h", "knn": "h", "hash": "a", "expressivity": "a"}


def check_finite_features(parser, args, feats) -> None:
    """A usage error naming --checkpoint when the features some task reads hold NaN or inf (a
    diverged run): sgn(NaN) would silently be a bit -1 of every code, and the probe and kNN
    refuse such features.  The cache is kept (it is what the checkpoint gives)."""
    bad = []
    for key in dict.fromkeys(TASK_FEATURES[t] for t in args.tasks):
        for split in ("train", "test"):
            x = feats[split][key]
            # a block of rows at a time: a whole-tensor mask of 1.28M x 2048 would be 2.6 GB
            step = max(1, (1 << 22) // max(1, x.shape[1])) if x.dim() == 2 else max(1, len(x))
            rows = sum(int((~torch.isfinite(x[s:s + step])).any(1).sum())
                       for s in range(0, x.shape[0], step)) if x.numel() else 0
            if rows:
                bad.append(f"{key} ({rows} of the {x.shape[0]} {split} images)")
    if bad:
        parser.error(f"--checkpoint {args.checkpoint!r}: its {args.which} model gives NaN or inf "
                     f"features {', '.join(bad)} (a diverged run?); tasks on them would score "
                     "nothing meaningful")


def sign_codes(a: torch.Tensor) -> torch.Tensor:
    """c = sgn(a) with 0 -> +1 (docs/math.md [M:code]), as int8 +-1."""
    return torch.where(a >= 0, 1, -1).to(torch.int8)


def _finite(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def trained_subset(cfg: dict) -> dict | None:
    """The hashing subset a checkpoint's run trained on (train.py --train-subset paper-hash):
    {"queries_per_class", "train_per_class", "split_seed", "sha256"}, or None (it trained on
    its data's training split)."""
    if not isinstance(cfg, dict) or cfg.get("train_subset", "all") == "all":
        return None
    return {"train_subset": cfg["train_subset"],
            **{k: cfg.get(k) for k in ("queries_per_class", "train_per_class", "split_seed")},
            "sha256": cfg.get("train_subset_sha256")}


def resolve_hash_args(args, cfg: dict) -> None:
    """--hash-protocol, --queries-per-class and --split-seed left open, from the checkpoint's
    config: a run trained on the paper-hash subset gets the paper protocol with its own split;
    a value given that differs from it is a ValueError naming the flag (another split could put
    the training images among the queries).  Otherwise standard, 1000, --seed."""
    sub = args.trained_subset = trained_subset(cfg)
    if args.hash_protocol is None:
        args.hash_protocol = "paper" if sub is not None else "standard"
    if sub is not None and args.hash_protocol == "paper":
        for flag in ("queries_per_class", "split_seed"):   # train.py's flags of the same names
            v, want = getattr(args, flag), sub[flag]
            if v is None:
                setattr(args, flag, want)
            elif v != want:
                name = flag.replace("_", "-")
                raise ValueError(f"--{name} {v}: the checkpoint trained on the paper-hash "
                                 f"subset of the split with --{name} {want} (train.py "
                                 "--train-subset paper-hash); another split could put its "
                                 f"training images among the queries: leave the flag out, or "
                                 f"give {want}")
    if args.queries_per_class is None:
        args.queries_per_class = 1000
    if args.split_seed is None:
        args.split_seed = args.seed


def check_hash_limits(args) -> None:
    """A checkpoint trained on the paper-hash subset, scored under the paper protocol: the pool
    must be the whole of both splits (the subset was drawn from them), so --limit-train and
    --limit-test (and --quick's) are a ValueError naming the flag."""
    if getattr(args, "trained_subset", None) is None or args.hash_protocol != "paper" \
            or "hash" not in args.tasks:
        return
    for split in ("train", "test"):
        v = getattr(args, f"limit_{split}")
        if v is not None:
            how = (f"--quick (its --limit-{split} {v})"
                   if f"limit_{split}" in getattr(args, "quick_limits", ()) else
                   f"--limit-{split} {v}")
            raise ValueError(f"{how}: the checkpoint trained on the paper-hash subset of the "
                             "whole pooled training and test splits, and a smaller pool is "
                             "another split (its training images could be queries); evaluate "
                             "the hash task on the whole splits, or with --hash-protocol "
                             "standard")


def _split_seed(args) -> int:
    """The paper split's seed: --split-seed as resolve_hash_args left it, else --seed."""
    seed = getattr(args, "split_seed", None)
    return args.seed if seed is None else seed


def paper_split(args, pool_y: torch.Tensor) -> dict:
    """metrics.retrieval_split of the pooled labels for --hash-protocol paper (seed
    --split-seed); a ValueError naming --queries-per-class when a class has too few items or no
    item is left for the gallery (every class exactly --queries-per-class items).  For a
    checkpoint trained on the paper-hash subset (args.trained_subset), also the split's training
    images, which must be the ones the run trained on (their digest): else a ValueError naming
    --hash-protocol."""
    q = args.queries_per_class
    seed = _split_seed(args)
    sub = getattr(args, "trained_subset", None)
    if sub is not None:
        try:
            idx = retrieval_split(pool_y, queries_per_class=q,
                                  train_per_class=sub["train_per_class"], seed=seed)
        except ValueError as exc:
            raise ValueError(f"--hash-protocol paper: the checkpoint trained on the paper-hash "
                             f"subset ({q} queries and {sub['train_per_class']} training images "
                             f"per class), which these {pool_y.numel()} pooled images cannot "
                             f"hold ({exc}): not the data it trained on") from exc
        got = indices_digest(idx["train"])
        if sub["sha256"] is not None and got != sub["sha256"]:
            raise ValueError(f"--hash-protocol paper: the checkpoint trained on the paper-hash "
                             f"subset with digest {sub['sha256']}, this split of the data's "
                             f"{pool_y.numel()} pooled labels gives {got}: other data than the "
                             "run's (or another version of it), whose split could put the "
                             "training images among the queries")
        return idx
    try:
        idx = retrieval_split(pool_y, queries_per_class=q, train_per_class=None, seed=seed)
    except ValueError as exc:  # class sizes are only known once the labels are loaded
        raise ValueError(f"--queries-per-class {q}: too many for the {pool_y.numel()} pooled "
                         f"images ({exc}); lower it or raise the limits") from exc
    if idx["gallery"].numel() == 0:
        raise ValueError(f"--queries-per-class {q}: too many for the {pool_y.numel()} pooled "
                         f"images (every class has exactly {q}, so all of them would be queries "
                         "and the gallery would be empty); lower it or raise the limits")
    return idx


def _planned_labels(loader, n_used: int):
    """The labels of the first n_used images a loader will yield (its source's labels at its
    indices), or None when it does not expose them; for the checks made before extraction (a
    folder's undecodable file shifts them: the split is checked again on the extracted ones)."""
    labels = getattr(getattr(loader, "source", None), "labels", None)
    indices = getattr(loader, "indices", None)
    if labels is None or indices is None:
        return None
    return torch.as_tensor(np.asarray(labels)[np.asarray(indices)[:n_used]], dtype=torch.int64)


def check_itq_gallery(args, gallery: int) -> None:
    """--itq fits its rotation on the gallery's a, standardised per bit: a ValueError naming
    --itq for a gallery of fewer than 2 images (metrics.itq_fit)."""
    if getattr(args, "itq", False) and gallery < 2:
        raise ValueError(f"--itq: the gallery has {gallery} image(s); the ITQ rotation is fitted "
                         "on the gallery's standardised a and needs at least 2 (raise "
                         "--limit-train, or leave --itq out)")


def run_hash(args, tr, te, bits, device=torch.device("cpu")) -> dict:
    """The hashing scores, on the Hamming engine of `device`: the C++ engine for the CPU, the
    Triton engine (kernels/hamming_triton.py) for a GPU; both exact, with the same tie order."""
    if args.hash_protocol == "standard":
        qa, ql, ga, gl = te["a"], te["labels"], tr["a"], tr["labels"]
        split = {"queries": "test split", "gallery": "train split"}
    elif args.hash_protocol == "imagenet100":   # hashlists: the lists, or the seeded rule
        qa, ql, ga, gl, split = imagenet100_sets(args, tr, te)
    else:
        pool_a = torch.cat([tr["a"], te["a"]])
        pool_y = torch.cat([tr["labels"], te["labels"]])
        idx = paper_split(args, pool_y)
        qa, ql = pool_a[idx["query"]], pool_y[idx["query"]]
        ga, gl = pool_a[idx["gallery"]], pool_y[idx["gallery"]]
        split = {"queries": f"{args.queries_per_class} per class of train+test (seed "
                 f"{_split_seed(args)})", "gallery": "the rest of train+test"}
    sub = getattr(args, "trained_subset", None)
    if sub is not None:  # what the encoder trained on (train.py --train-subset)
        split["trained_on"] = sub
    qc, gc = sign_codes(qa).to(device), sign_codes(ga).to(device)
    ql, gl = ql.to(device), gl.to(device)  # the engine is the one of the codes' device
    G = int(gc.shape[0])
    check_itq_gallery(args, G)
    ks = sorted(set(args.map_at))
    ns = sorted(n for n in set(args.precision_at_n) if n <= G)
    radius = args.radius
    out = {"protocol": args.hash_protocol, **split, "num_queries": int(qc.shape[0]),
           "num_gallery": G, "code_bits": int(qc.shape[1]),
           "ranking": "Hamming distance, ties by gallery index (the order of the split)",
           "relevance": "same class",
           "metrics": {"map": "mAP@all: AP over the whole ranking, queries without a relevant "
                              "item skipped [M:ap]",
                       "map_at": "mAP@K, DeepHash-pytorch CalcTopMap: AP over the relevant items "
                                 "in the top K, a query with none adds 0, mean over all queries "
                                 "[M:ap-at-k]",
                       "precision_within_radius": f"P@H<={radius}: relevant / retrieved within "
                                                  "the Hamming ball, 0 when it is empty "
                                                  "[M:radius]",
                       "precision_at_n": "P@N: relevant among the first N, mean over all "
                                         "queries [M:precision-at-n]",
                       "pr_curve": "precision and recall of the Hamming ball of radius r = "
                                   "0..bits [M:pr-curve]"},
           "note": "k < code_bits: the first k bits of the code_bits-bit code (a prefix of one "
                   "model), not a separately trained k-bit model", "map": {},
           "queries_used": {}, "map_at": {}, "queries_with_hit_at": {},
           "precision_within_radius": {}, "empty_ball_fraction": {}, "precision_at_n": {},
           "radius": radius,
           "engine": f"{resolve_backend('auto', qc, int(qc.shape[1]))} ({qc.device.type})"}
    curves = {}
    for k in bits:
        r = retrieval_metrics(qc[:, :k].contiguous(), ql, gc[:, :k].contiguous(), gl,
                              topk=ks, at_n=ns, radius=min(radius, k), pr=True,
                              progress=args.progress)
        out["map"][str(k)] = _finite(r["map_all"])
        out["queries_used"][str(k)] = r["queries_with_relevant"]
        out["map_at"][str(k)] = {str(K): _finite(v) for K, v in r["map_at"].items()}
        out["queries_with_hit_at"][str(k)] = {str(K): v for K, v in r["queries_with_hit_at"].items()}
        out["precision_within_radius"][str(k)] = r["precision_within_radius"][min(radius, k)]
        out["empty_ball_fraction"][str(k)] = r["empty_ball_fraction"][min(radius, k)]
        out["precision_at_n"][str(k)] = {str(n): v for n, v in r["precision_at_n"].items()}
        curves[k] = r
    retire_earlier_report(args)  # its hash files are about to be replaced
    out["files"] = write_hash_curves(args.out, curves, out)
    if getattr(args, "itq", False):
        out["map_itq"], out["itq_quant_error"] = {}, {}
        for k in bits:  # one rotation per prefix length, fitted on the gallery's first k bits
            fit = itq_fit(ga[:, :k], seed=args.seed)
            out["map_itq"][str(k)] = _finite(mean_average_precision(
                itq_codes(qa[:, :k], fit).to(device), ql, itq_codes(ga[:, :k], fit).to(device),
                gl))
            out["itq_quant_error"][str(k)] = [fit["quant_error"][0], fit["quant_error"][-1]]
    return out


def retire_earlier_report(args) -> None:
    """--overwrite of an earlier evaluation: remove its report and hash files before this run
    writes the first file of its own (once), so that a run failing half-way leaves no earlier
    report beside files it does not describe (the features cache is keyed by its meta and
    stays).  Files of those names in a folder that held no report are the user's, left alone."""
    if not getattr(args, "replaces_report", False) or getattr(args, "retired_report", False):
        return
    for name in ("report.json", "report.md") + HASH_FILES:
        p = os.path.join(args.out, name)
        if os.path.isfile(p) or os.path.islink(p):
            os.unlink(p)
    args.retired_report = True


def write_hash_curves(out_dir: str, curves: dict, info: dict) -> dict:
    """hash_pr_curve.csv / .png (precision-recall by Hamming radius) and hash_precision_at_n.csv
    / .png (P@N), one line per code length; written atomically.  Returns their paths."""
    import csv
    import io
    files = {}
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["bits", "radius", "precision", "recall", "precision_empty_as_zero",
                "nonempty_fraction", "mean_retrieved"])
    for k, r in curves.items():
        c = r["pr_curve"]
        for i in c["radius"]:
            w.writerow([k, i, c["precision"][i], c["recall"][i], c["precision_empty_as_zero"][i],
                        c["nonempty_fraction"][i], c["mean_retrieved"][i]])
    files["pr_curve_csv"] = os.path.join(out_dir, HASH_FILES[0])
    atomic_write(files["pr_curve_csv"], lambda f: f.write(buf.getvalue()), mode="w")
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["bits", "n", "precision"])
    for k, r in curves.items():
        for n, v in r["precision_at_n"].items():
            w.writerow([k, n, v])
    files["precision_at_n_csv"] = os.path.join(out_dir, HASH_FILES[1])
    atomic_write(files["precision_at_n_csv"], lambda f: f.write(buf.getvalue()), mode="w")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # the CSVs are the results; the picture needs matplotlib
        files["curves_png"] = None
        files["curves_png_skipped"] = f"matplotlib is not installed ({exc})"
        print("note: hash_curves.png not drawn: matplotlib is not installed (pip install "
              "matplotlib); the curves are in hash_pr_curve.csv and hash_precision_at_n.csv",
              file=sys.stderr)
        return files
    proto = (f"{info['num_queries']} queries ({info['queries']}) x {info['num_gallery']} gallery "
             f"({info['gallery']}); ties by gallery index")
    fig, ax = plt.subplots(1, 2, figsize=(11, 4.3))
    for k, r in curves.items():
        c = r["pr_curve"]
        ax[0].plot(c["recall"], c["precision"], marker=".", ms=3, label=f"{k} bits")
        ns = list(r["precision_at_n"])
        ax[1].plot(ns, [r["precision_at_n"][n] for n in ns], marker="o", ms=3, label=f"{k} bits")
    ax[0].set(xlabel="recall", ylabel="precision (queries that retrieve something)",
              title="PR curve by Hamming radius r = 0..bits", xlim=(0, 1.01), ylim=(0, 1.01))
    ax[1].set(xlabel="N (top of the ranking)", ylabel="precision", title="P@N", ylim=(0, 1.01))
    if any(len(r["precision_at_n"]) > 1 for r in curves.values()):
        ax[1].set_xscale("log")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(proto, fontsize=8)
    fig.tight_layout()
    files["curves_png"] = os.path.join(out_dir, HASH_FILES[2])
    atomic_write(files["curves_png"], lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return files


def run_expressivity(te, bits) -> dict:
    codes = sign_codes(te["a"])
    return {"split": "test", "stats": {str(k): {key: _finite(v) for key, v in
                                                code_statistics(codes[:, :k]).as_dict().items()}
                                       for k in bits}}


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def _fmt(v, pct=False):
    if v is None:
        return "n/a"
    if pct:
        return f"{100 * v:.2f}%"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def markdown_table(report: dict) -> str:
    r = report["results"]
    rows = []
    if "linear" in r:
        x = r["linear"]
        edge = f" ({x['best_lr_at_edge']} of the search)" if x.get("best_lr_at_edge") else ""
        searched = ("" if x.get("paper_lrs", True) else
                    ", searched " + "/".join(f"{v:g}" for v in x["lrs"]) + " (not the paper's)")
        rows.append(("linear probe (h)", "test top-1", _fmt(x["test_top1"], True),
                     f"lr {x['best_lr']:g}{edge}{searched}, {x['epochs']} epochs"
                     + (", augmented crops (--probe augmented)"
                        if x.get("probe") == "augmented" else "")))
    if "knn" in r:
        x = r["knn"]
        rows.append(("kNN (h)", "test top-1", _fmt(x["test_top1"], True),
                     f"k={x['k']}, T={x['temperature']:g}"))
    if "hash" in r:
        x = r["hash"]
        for k, m in x["map"].items():
            kind = "full code" if int(k) == x["code_bits"] else f"prefix of {x['code_bits']}-bit"
            rows.append((f"hash {k} bits", "mAP@all", _fmt(m, True),
                         f"{x['protocol']}, {x['num_queries']} q x {x['num_gallery']} g, {kind}"))
            for K, v in x.get("map_at", {}).get(k, {}).items():
                capped = (f"; K capped at the gallery's {x['num_gallery']}"
                          if int(K) > x["num_gallery"] else "")
                rows.append((f"hash {k} bits", f"mAP@{K}", _fmt(v, True),
                             f"DeepHash-pytorch convention (no hit in the top K: AP 0){capped}"))
            if k in x.get("precision_within_radius", {}):
                rows.append((f"hash {k} bits", f"P@H<={x['radius']}",
                             _fmt(x["precision_within_radius"][k], True),
                             f"{_fmt(x['empty_ball_fraction'][k], True)} of the queries "
                             "retrieve nothing (counted as 0)"))
            pn = x.get("precision_at_n", {}).get(k, {})
            if pn:
                rows.append((f"hash {k} bits", "P@N", ", ".join(
                    f"P@{n} {_fmt(v, True)}" for n, v in pn.items() if n in ("100", "1000")) or
                    ", ".join(f"P@{n} {_fmt(v, True)}" for n, v in list(pn.items())[-2:]),
                    "the whole curve: hash_precision_at_n.csv, hash_curves.png"))
        for k, m in x.get("map_itq", {}).items():
            rows.append((f"hash {k} bits, ITQ", "mAP@all", _fmt(m, True),
                         "sgn of the ITQ-rotated standardised a, rotation fitted on the gallery "
                         "(docs/math.md [M:itq]); not the model's code"))
    if "expressivity" in r:
        for k, s in r["expressivity"]["stats"].items():
            rows.append((f"codes {k} bits", "distinct",
                         f"{s['num_distinct']}/{s['num_codes']} "
                         f"({_fmt(s['fraction_distinct'], True)})",
                         f"mean Hamming {_fmt(s['mean_pairwise_hamming'])} "
                         f"({_fmt(s['normalized_mean_pairwise_hamming'])} of D), balance_dev "
                         f"mean|f-0.5| {_fmt(s['balance_dev'])}, "
                         f"entropy {_fmt(s['bit_entropy_mean'])}"))
    sizes = report["splits"]
    head = (f"Evaluation of `{report['checkpoint']}` ({report['which']} model, "
            f"{report['config'].get('method')} / {report['config'].get('arch')}, step "
            f"{report['step']}) on {report['data']}: train {sizes['train']['used']} of "
            f"{sizes['train']['total']}, test {sizes['test']['used']} of {sizes['test']['total']} "
            f"images{HELD_OUT if sizes['test'].get('held_out') else ''}.\n\n")
    lines = ["| task | metric | value | details |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    tail = ""
    if "hash" in r:
        x = r["hash"]
        tail += (f"\nHash protocol ({x['protocol']}): queries = {x['queries']} "
                 f"({x['num_queries']}), gallery = {x['gallery']} ({x['num_gallery']}); ranking "
                 f"by Hamming distance, ties by gallery index; relevance: {x['relevance']}; "
                 f"mAP@all and mAP@K ({', '.join(next(iter(x['map_at'].values()), {}).keys())}); "
                 f"codes: sgn(a), {x['code_bits']} bits, shorter lengths are its prefixes. "
                 "PR curve and P@N: hash_pr_curve.csv, hash_precision_at_n.csv, hash_curves.png.\n")
        t = x.get("trained_on")
        if t:
            tail += (f"The encoder trained on the paper-hash subset: {t['train_per_class']} "
                     f"images per class of the gallery of {t['queries_per_class']} queries per "
                     f"class, split seed {t['split_seed']} (train.py --train-subset "
                     f"{t['train_subset']}; subset digest {t['sha256']}"
                     + (", the split's, checked" if x["protocol"] == "paper" else "") + ").\n")
    if report.get("quick"):
        tail += ("\n**Quick look** (--quick): subsets and a 10-epoch probe; not the protocol, "
                 "not comparable with docs/results.md.\n")
    return head + "\n".join(lines) + "\n" + tail


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def augmented_probe_on_every_rank(args, feats, device, model, ranks):
    """--probe augmented under torchrun: every rank encodes its share of each batch's crops and
    the gradients are summed (augprobe's process-group path), so the probe's 100 epochs of
    crops take all the node's GPUs, not rank 0's alone.  Rank 0 holds the cached features that
    score the rates and the test split; the others get the training labels from it.  Rank 0
    gets the result, the others None.  A failure on a rank before the fit stops every rank
    (stop_if_failed); one during it ends the rank's process, and torchrun stops the others."""
    import torch.distributed as dist
    from .augprobe import augmented_linear_probe
    box = [feats["train"]["labels"] if ranks.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    problem = res = None
    try:
        loader = args.split_loaders["train"][0]
        if ranks.rank == 0:
            tr, te = feats["train"], feats["test"]
            scoring = dict(train_h=tr["h"], test_h=te["h"], test_labels=te["labels"])
        else:
            scoring = dict(train_h=None, test_h=None, test_labels=None)
        net = model()
    except Exception as exc:
        problem = _crash(exc, ranks, "preparing the augmented probe")
    stop_if_failed(ranks, problem)
    res = augmented_linear_probe(net, loader, train_labels=box[0], epochs=args.linear_epochs,
                                 batch_size=args.linear_batch_size, seed=args.seed,
                                 lrs=args.linear_lrs, progress=args.progress, device=device,
                                 num_workers=getattr(args, "workers", 0) or 0, **scoring)
    return res if ranks.rank == 0 else None


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    ranks = start_ranks(parser, args)  # torchrun: the process group; else None
    problem = None
    try:
        check_args(args)
        ck = load_checkpoint(args.checkpoint)
        cfg = ck.get("config") if isinstance(ck, dict) else None
        if not isinstance(cfg, dict) or "code_dim" not in cfg:
            raise ValueError(f"--checkpoint {args.checkpoint!r} is not a train.py checkpoint "
                             "(no config)")
        if args.which == "momentum" and ck.get("momentum_model") is None:
            raise ValueError(f"--which momentum: the checkpoint has no momentum model (method "
                             f"{cfg.get('method')})")
        D = int(cfg["code_dim"])
        bits = sorted(set(args.bits if args.bits is not None else [D]))
        if max(bits) > D:
            raise ValueError(f"--bits {args.bits}: the model's codes have D={D} bits; values "
                             f"must lie in [1, {D}]")
        resolve_hash_args(args, cfg)
        data = args.data if args.data is not None else cfg.get("data")
        if not isinstance(data, str) or data.startswith("synthetic"):
            raise ValueError(f"--data: the checkpoint was trained on {data!r}; name a real data "
                             "set to evaluate on")
        image_size = int(cfg["image_size"])
        # Build the loaders now (cheap: no images decoded) so data errors and limits beyond the
        # split size are reported before any feature extraction.
        sizes, held_out, planned = {}, False, []
        for split, limit in (("train", args.limit_train), ("test", args.limit_test)):
            quick = f"limit_{split}" in getattr(args, "quick_limits", ())
            ld, used, total = _subset_loader(data, split, limit, args.batch_size, image_size, "cpu",
                                             cap=quick, val_labels=args.val_labels)
            if quick and limit is not None and limit >= total:  # --quick on a small split: all
                setattr(args, f"limit_{split}", None)
            planned.append(_planned_labels(ld, used))
            args.split_loaders = {**getattr(args, "split_loaders", {}), split: (ld, used)}
            if ld.in_channels != cfg["in_channels"]:
                raise ValueError(f"--data {data!r} has {ld.in_channels}-channel images, the "
                                 f"checkpoint's model takes {cfg['in_channels']}")
            sizes[split] = {"used": used, "total": total}
            if split == "train":  # a bare folder of classes: its test split was held out of it
                held_out = bool(getattr(getattr(ld, "source", None), "held_out", 0))
        if held_out:
            sizes["test"]["held_out"] = True
        check_hash_limits(args)
        if "hash" in args.tasks and args.hash_protocol == "paper" and all(
                y is not None for y in planned):  # the split of the labels to be extracted
            check_itq_gallery(args, int(paper_split(args, torch.cat(planned))["gallery"].numel()))
        elif "hash" in args.tasks and args.hash_protocol == "standard":
            check_itq_gallery(args, sizes["train"]["used"])
    except (ValueError, FileNotFoundError, TypeError) as exc:
        if ranks is None:
            parser.error(str(exc))  # exit status 2, before any work
        problem = 2, str(exc)
    except Exception as exc:  # under torchrun: the ranks stop together, none hangs
        if ranks is None:
            raise
        problem = _crash(exc, ranks, "checking the arguments, checkpoint and data")
    if ranks is not None:
        stop_if_failed(ranks, problem)  # every rank stops with the message of one that failed

    if ranks is not None:
        device = ranks.device  # cuda:LOCAL_RANK, or the CPU
    elif args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if ranks is None or ranks.rank == 0:  # only rank 0 writes
        os.makedirs(args.out, exist_ok=True)
    timings = {}
    t_start = time.perf_counter()

    _model = []

    def model():  # loaded only when some split's features are not cached
        if not _model:
            t0 = time.perf_counter()
            try:
                m = load_model(args.checkpoint, args.which)
            except (RuntimeError, ValueError, KeyError, TypeError) as exc:
                # a config that names another model than the weights (method, code_dim, arch)
                detail = " ".join(" ".join(str(exc).splitlines()[:2]).split())[:400]
                # under torchrun while the ranks work together: agreed on (stop_if_failed)
                grouped = ranks is not None and torch.distributed.is_initialized()
                (_Raising if grouped else parser).error(
                    f"--checkpoint {args.checkpoint!r}: its {args.which} model's weights do not "
                    f"fit the model its config describes (method {cfg.get('method')!r}, arch "
                    f"{cfg.get('arch')!r}, code_dim {D}): {detail}")
            _model.append(extraction_network(m.to(device).eval(), args.eager_extraction))
            timings["load_model_s"] = time.perf_counter() - t0
        return _model[0]

    feats, feat_info = {}, {}
    for split, limit in (("train", args.limit_train), ("test", args.limit_test)):
        try:
            f, cached, dt, path = load_or_extract(args, model, data, split, limit, image_size,
                                                  "cpu", device, sizes[split], ranks)
        except FeatureRangeError as exc:  # one process (under torchrun the ranks agree on it)
            parser.error(f"--checkpoint {args.checkpoint!r}: its {args.which} model's "
                         f"features {exc}")
        if f is None:  # a rank other than 0: its shard went to rank 0
            continue
        feats[split] = f
        feat_info[split] = {"path": path, "cached": cached, "h_dim": int(f["h"].shape[1]),
                            "a_dim": int(f["a"].shape[1])}
        timings[f"features_{split}_s"] = dt
    probe_done = None   # --probe augmented under torchrun: fitted by every rank together
    if ranks is not None:  # the tasks run once, on rank 0; the other ranks are done
        problem = None
        if ranks.rank == 0:
            try:
                check_finite_features(_Raising, args, feats)
            except UsageError as exc:
                problem = 2, str(exc)
        stop_if_failed(ranks, problem)
        if "linear" in args.tasks and args.probe == "augmented":
            t0 = time.perf_counter()
            probe_done = augmented_probe_on_every_rank(args, feats, device, model, ranks)
            timings["linear_ranks_s"] = time.perf_counter() - t0
        end_ranks()
        if ranks.rank != 0:
            return 0
    else:
        check_finite_features(parser, args, feats)
    tr, te = feats["train"], feats["test"]

    results = {}
    for task in args.tasks:
        t0 = time.perf_counter()
        if task == "linear":
            # The probe trains on the eval device (GPU if any); the cached features stay on
            # the host and are moved there whole or in chunks (--probe-device-mem).
            res = probe_done or run_linear_probe(args, tr, te, device, model,
                                                 lambda: args.split_loaders["train"][0])
            lrs = list(res.val_accuracy) or [res.best_lr]   # the rates searched, in order
            # the best rate at an end of the search: a rate outside it may fit better
            # (not when another rate ties with it: every rate fit alike, e.g. one class)
            val = res.val_accuracy
            tied = sum(1 for v in val.values() if v == val[res.best_lr]) > 1
            edge = (None if len(lrs) == 1 or tied else "largest" if res.best_lr == max(lrs)
                    else "smallest" if res.best_lr == min(lrs) else None)
            paper = tuple(lrs) == PAPER_LINEAR_LRS
            if edge:
                whose = ("the paper's; docs/math.md [M:linear-probe]" if paper
                         else "--linear-lrs")
                print(f"note: the linear probe's best rate, {res.best_lr:g}, is the {edge} of "
                      f"its search {lrs} ({whose}): a rate beyond it may fit these features "
                      "better (--linear-lrs widens the search)", file=sys.stderr)
            results["linear"] = {"test_top1": res.test_accuracy, "best_lr": res.best_lr,
                                 "best_lr_at_edge": edge,
                                 "val_top1": {str(k): v for k, v in res.val_accuracy.items()},
                                 "epochs": args.linear_epochs, "val_fraction": 0.1,
                                 "batch_size": args.linear_batch_size, "lrs": lrs,
                                 "paper_lrs": paper, "probe": args.probe, "plan": res.plan,
                                 "features": "h (encoder, head dropped)"}
        elif task == "knn":
            k = min(args.knn_k, int(tr["h"].shape[0]))
            # the features stay on the host (16 bits); moved and upcast a chunk at a time,
            # the train features streamed when --probe-device-mem bounds the device's memory
            acc = knn_accuracy(tr["h"], tr["labels"], te["h"], te["labels"], k=k,
                               temperature=args.knn_temperature, progress=args.progress,
                               device=device, device_mem=args.probe_device_mem)
            results["knn"] = {"test_top1": acc, "k": k, "temperature": args.knn_temperature,
                              "features": "h (encoder)"}
        elif task == "hash":
            try:
                results["hash"] = run_hash(args, tr, te, bits, device)
            except ValueError as exc:
                if not str(exc).startswith(("--queries-per-class", "--hash-", "--itq")):
                    raise
                parser.error(str(exc))  # the features stay cached: a rerun is cheap
        elif task == "expressivity":
            results["expressivity"] = run_expressivity(te, bits)
        timings[f"{task}_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - t_start

    report = {"checkpoint": os.path.abspath(args.checkpoint), "which": args.which,
              "step": ck.get("step"), "data": data, "image_size": image_size,
              "device": str(device), "seed": args.seed, "tasks": args.tasks, "bits": bits,
              "splits": sizes, "features": feat_info, "config": cfg, "results": results,
              "timings": timings, "quick": bool(args.quick), "threads": torch.get_num_threads(),
              "extraction": {"ranks": 1 if ranks is None else ranks.world_size,
                             "workers": args.workers,
                             "network": "as trained (--eager-extraction)" if args.eager_extraction
                             else "batch norm folded, channels-last"
                             + (f", micro-batches of {CPU_MICRO_BATCH}"
                                if device.type == "cpu" else "")},
              "command": "python -m nac_fast.eval " + " ".join(
                  sys.argv[1:] if argv is None else argv)}
    # --overwrite: the earlier evaluation's hash files would sit beside a report without them
    # (the evaluation in --out is this one, whole)
    retire_earlier_report(args)
    write_json_atomic(report, os.path.join(args.out, "report.json"))
    table = markdown_table(report)
    atomic_write(os.path.join(args.out, "report.md"), lambda f: f.write(table), mode="w")
    print(table)
    return 0
