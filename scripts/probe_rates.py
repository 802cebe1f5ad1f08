"""The linear probe's test top-1 at every rate of its search: a diagnostic of the lr search.

    python scripts/probe_rates.py runs/x/eval runs/y/eval [--lrs 0.01,0.1,1,10,30,100] [--csv F]

Each argument is an output directory of `python -m nac_fast.eval` that ran the linear task (its
cached features_train.pt / features_test.pt and report.json). For each rate the probe is fitted
as the protocol's final fit is (docs/math.md [M:linear-probe]: all training rows, the report's
epochs, batch and seed) and scored on the test split. The protocol picks its rate on a held-out
10% of the training rows; this table judges every rate on the test split, so its best column is
NOT a protocol figure. It answers two questions about a probe: is the search wide enough (does a
rate beyond its end score higher?), and how much of a difference between two models is the
choice of rate (on a small data set the held-out 10% is a few hundred images).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from nac_fast._files import atomic_write, check_writable  # noqa: E402
from nac_fast.eval.cli import float_list  # noqa: E402
from nac_fast.eval.metrics import accuracy, linear_predict, train_linear_probe  # noqa: E402


def _lrs(s: str) -> list[float]:
    out = float_list(s)
    if any(not (v > 0 and math.isfinite(v)) for v in out):
        raise argparse.ArgumentTypeError(f"expected positive rates, got {s!r}")
    return list(dict.fromkeys(out))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("eval_dirs", nargs="+", help="output directories of python -m nac_fast.eval "
                    "with a linear result and cached features")
    ap.add_argument("--lrs", type=_lrs, default=None, help="rates to fit (default: each "
                    "report's own search)")
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no tqdm bar (one per fit, over its epochs)")
    ap.add_argument("--csv", default=None, help="also write the table here (refuses to "
                    "overwrite an existing file)")
    return ap


def load(eval_dir: str, mmap: bool = False) -> tuple[dict, dict, dict]:
    """(linear result + settings from report.json, train features, test features); ValueError
    naming the directory when one of them is missing, damaged or of another kind.  mmap: the
    features mapped, not read (a check of every directory before the fits, in little memory)."""
    rep_path = os.path.join(eval_dir, "report.json")
    if not os.path.isfile(rep_path):
        raise ValueError(f"eval_dirs: {eval_dir!r} has no report.json (not an nac_fast.eval "
                         "output directory)")
    try:
        with open(rep_path) as f:
            rep = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"eval_dirs: {rep_path!r} is not a JSON report ({exc})") from None
    res = rep.get("results") if isinstance(rep, dict) else None
    lin = res.get("linear") if isinstance(res, dict) else None
    if lin is None:
        raise ValueError(f"eval_dirs: {eval_dir!r}: its report has no linear result (run "
                         "nac_fast.eval with --tasks linear)")
    missing = [k for k in ("lrs", "epochs", "batch_size", "best_lr", "test_top1")
               if not isinstance(lin, dict) or k not in lin]
    if missing:
        raise ValueError(f"eval_dirs: {rep_path!r}: its linear result has no "
                         f"{', '.join(missing)} (a damaged report?)")
    feats = []
    for split in ("train", "test"):
        p = os.path.join(eval_dir, f"features_{split}.pt")
        if not os.path.isfile(p):
            raise ValueError(f"eval_dirs: {eval_dir!r} has no cached {split} features ({p})")
        try:
            f = torch.load(p, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as exc:  # noqa: BLE001 - torch.load's errors of a damaged file vary
            raise ValueError(f"eval_dirs: {p!r} is not a feature cache "
                             f"({type(exc).__name__}: {exc})") from None
        if not (isinstance(f, dict) and isinstance(f.get("h"), torch.Tensor)
                and isinstance(f.get("labels"), torch.Tensor)):
            raise ValueError(f"eval_dirs: {p!r} is not a feature cache of nac_fast.eval (no "
                             "'h' and 'labels' tensors)")
        feats.append(f)
    return dict(lin, seed=rep.get("seed", 0)), feats[0], feats[1]


def rates_table(eval_dir: str, lrs=None, progress: bool = False) -> dict:
    """{"dir", "protocol_lr", "protocol_top1", "test_top1": {lr: top-1}} for one directory."""
    lin, tr, te = load(eval_dir)
    lrs = list(lrs or lin["lrs"])
    got = {}
    for lr in lrs:
        m = train_linear_probe(tr["h"], tr["labels"], lr=lr, epochs=lin["epochs"],
                               batch_size=lin["batch_size"], seed=lin["seed"],
                               progress=progress)
        got[lr] = accuracy(linear_predict(m, te["h"]), te["labels"])
    return {"dir": eval_dir, "protocol_lr": lin["best_lr"], "protocol_top1": lin["test_top1"],
            "test_top1": got}


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.csv and os.path.lexists(args.csv):
        ap.error(f"--csv {args.csv!r} exists; give another path")
    dirs = list(dict.fromkeys(args.eval_dirs))  # a directory named twice is fitted once
    try:
        if args.csv:  # before any fit: a path under a file or in an unwritable place
            check_writable("--csv", args.csv)
        for d in dirs:  # every directory checked before the first fit (mapped, then let go)
            load(d, mmap=True)
    except ValueError as exc:
        ap.error(str(exc))
    rows = [rates_table(d, args.lrs, args.progress) for d in dirs]
    lrs = list(dict.fromkeys(lr for r in rows for lr in r["test_top1"]))
    print("test top-1 (%) of the linear probe fitted at each rate (judged on the test split: "
          "a diagnostic, not the protocol)\n")
    print("| eval dir | protocol's rate | protocol's top-1 | " +
          " | ".join(f"lr {lr:g}" for lr in lrs) + " |")
    print("|---|---|---|" + "---|" * len(lrs))
    for r in rows:
        cells = [f"{100 * r['test_top1'][lr]:.1f}" if lr in r["test_top1"] else "" for lr in lrs]
        print(f"| {r['dir']} | {r['protocol_lr']:g} | {100 * r['protocol_top1']:.1f} | " +
              " | ".join(cells) + " |")
    if args.csv:
        def write(f):  # the folder is made; the file appears whole or not at all
            w = csv.writer(f)
            w.writerow(["eval_dir", "protocol_lr", "protocol_top1"] + [f"lr_{lr:g}" for lr in lrs])
            for r in rows:
                w.writerow([r["dir"], r["protocol_lr"], r["protocol_top1"]] +
                           [r["test_top1"].get(lr, "") for lr in lrs])
        atomic_write(args.csv, write, mode="w")
    return 0


if __name__ == "__main__":
    sys.exit(main())
