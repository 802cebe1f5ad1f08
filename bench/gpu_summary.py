"""Summary of a GPU suite run (bench/gpu_suite.sh): summary.json with the goal checks.

    python bench/gpu_summary.py bench/results/NVIDIA-H100-80GB-HBM3_2026-11-23 [MORE_DIRS_OR_FILES]
        [--out summary.json] [--require-goals]
    python bench/gpu_summary.py --check-junit pytest_gpu.xml --require-passed triton,cuda

summary.json's keys, the goals and the JUnit verdict: docs/kernels.md "The benchmark scripts in
detail".
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (puts the source tree on sys.path)

REFERENCE, COMPILED = "reference", "compiled-reference"
GOAL_SHAPES, GOAL_D = [("inbatch", 8192, 8192), ("queue", 8192, 65536)], 128
GOAL_TRAIN_IMG_S = 2000.0  # issue 40: per H100, train.py's defaults
# the loss's goals: (shapes, dtype, [(what, goal)], judged only where the figure was measured)
LOSS_GOALS = [(GOAL_SHAPES, "bfloat16", [("speed vs eager", 5.0), ("speed vs torch.compile", 2.0),
                                         ("roofline", 50.0), ("memory", 1 / 20)], False),
              # issue 38: its two larger shapes' roofline; fp32 (any product mode) >= 2x eager
              ([("inbatch", 16384, 16384), ("queue", 8192, 262144)], "bfloat16",
               [("roofline", 50.0)], True),
              (GOAL_SHAPES, "float32", [("speed vs eager", 2.0)], True)]

# Skips expected on a GPU machine although they name triton/cuda: (test id regex, reason regex)
ALLOWED_SKIPS: list = [
    # fake cuda:1 / cuda:3 tensors on a machine with fewer GPUs (the logic is CI's, without CUDA)
    (r"test_loss\.TestDeviceGuard", r"fake cuda:\d+ tensors need \d+ GPUs"),
    # the Hamming GPU command's interpreter plumbing: CI's; the stage runs the real command
    (r"test_gpu_bench_cpu_mode_runs_every_row", r"interpreter plumbing, CI's"),
]
_SUSPECT_ID = re.compile(r"triton|cuda", re.I)
_SUSPECT_REASON = re.compile(r"triton|cuda|gpu|fused backend|empty parameter set|extension|"
                             r"NAC_FAST_REQUIRE_EXT|kernel", re.I)


# ---- inputs -----------------------------------------------------------------------------------

def collect(inputs):
    """{'loss': [csv paths], 'train': [json paths], 'versions': [json paths]} in input order."""
    found = {"loss": [], "train": [], "versions": []}
    for p in inputs:
        if not os.path.exists(p):
            raise ValueError(f"input {p!r} does not exist")
        for f in filter(os.path.exists, [os.path.join(p, x) for x in ("versions.json",
                        "loss_gpu.csv", "train.json")] if os.path.isdir(p) else [p]):
            base = os.path.basename(f)
            what = "loss" if base.endswith(".csv") else "versions" if base == "versions.json" \
                else "train" if base.startswith("train") and base.endswith(".json") else None
            if what is None:
                raise ValueError(f"input {f!r}: expected a results folder, a bench_loss CSV, "
                                 "train*.json or versions.json")
            found[what].append(f)
    return found


def _ok(row) -> bool:
    """A row that succeeded with a finite positive median time (NaN: no figure, no JSON)."""
    try:
        med = float(row.get("median_s") or "nan")
    except ValueError:
        return False
    return math.isfinite(med) and med > 0 and (row.get("status") or "").strip() in ("", "ok")


def load_loss_rows(paths, device=None):
    """Newest ok row per (kind, n, N, D, dtype, backend) over the CSVs (later files and later rows
    win; rows with another device than `device`, if given, are ignored).  All rows kept must come
    from one device."""
    latest = {}
    for p in paths:
        with open(p, newline="") as f:
            for row in csv.DictReader(f):
                if device and device.lower() not in row.get("device", "").lower():
                    continue
                key = (row["kind"], int(row["n"]), int(row["N"]), int(row["D"]), row["dtype"],
                       _backend_label(row))
                latest[key] = row
                if not _ok(row):
                    del latest[key]  # the case's newest run failed: its old figure is stale
    if len(devices := {r.get("device", "") for r in latest.values()}) > 1:
        raise ValueError(f"the loss CSVs hold rows of several devices {sorted(devices)}: pick one "
                         "with --device")
    return latest


def _backend_label(row) -> str:
    """The backend, with a Triton fp32 row's product mode other than tf32x3: "triton[bf16x6]"."""
    b, mode = row["backend"], (row.get("fp32_dot") or "").strip()
    if row.get("dtype") == "float32" and mode and mode != "tf32x3" and b.startswith("triton"):
        return b.replace("triton", f"triton[{mode}]", 1)
    return b


def _f(x, nd=4, scale=1.0):
    """x (times scale) rounded to nd places; None for an empty or non-finite figure."""
    if x in (None, ""):
        return None
    v = float(x) * scale
    return round(v, nd) if math.isfinite(v) else None


def loss_entries(latest):
    """One entry per fused row, beside its case's reference and compiled-reference rows."""
    out = []
    for key in sorted(latest):
        kind, n, N, D, dtype, backend = key
        if backend in (REFERENCE, COMPILED):
            continue
        row, ref, comp = latest[key], latest.get(key[:5] + (REFERENCE,)), \
            latest.get(key[:5] + (COMPILED,))
        out.append({"kind": "queue" if kind == "mq" else kind, "n": n, "N": N, "D": D,
                    "dtype": dtype, "backend": backend, "fused_ms": _f(row["median_s"], 4, 1e3),
                    "eager_ms": ref and _f(ref["median_s"], 4, 1e3),
                    "compile_ms": comp and _f(comp["median_s"], 4, 1e3),
                    "fused_peak_mb": _f(row.get("peak_extra_mib"), 2),
                    "eager_peak_mb": ref and _f(ref.get("peak_extra_mib"), 2),
                    "pct_of_bound": _f(row.get("pct_of_bound"), 2)})
    return out


def load_train(paths):
    if not paths:
        return None
    with open(paths[-1]) as f:
        text = f.read().strip()
    if not text:
        raise ValueError(f"{paths[-1]} is empty (train_throughput.py's JSON line expected)")
    res = json.loads(text.splitlines()[-1])  # train_throughput.py prints one JSON line last
    if not isinstance(res, dict):
        raise ValueError(f"{paths[-1]}: the last line is not a JSON object")
    if (world := int(res.get("world_size", 1))) < 1:
        raise ValueError(f"{paths[-1]}: world_size must be >= 1, got {world}")
    return {"arch": res["arch"], "method": res["method"],
            "batch_per_gpu": int(res["batch_size"]) // world,
            "img_per_s": round(float(res["img_per_s"]) / world, 1),
            "data_wait_frac": round(float(res["data_wait"]), 4)}


def build_summary(inputs, device=None, commit=None):
    found = collect(inputs)
    if not found["loss"] and not found["train"]:
        raise ValueError(f"no loss CSV and no train.json in {inputs}")
    versions = {}
    for p in found["versions"]:
        with open(p) as f:
            versions.update(json.load(f))
    latest = load_loss_rows(found["loss"], device)
    newest = max(latest.values(), key=lambda r: r.get("timestamp", ""), default={})
    return {"gpu": versions.get("gpu") or newest.get("device", ""),
            "date": versions.get("date") or (newest.get("timestamp", "")[:10]),
            "commit": commit or versions.get("commit") or newest.get("commit", "unknown"),
            "torch": versions.get("torch") or newest.get("torch", ""),
            "triton": versions.get("triton") or newest.get("triton", ""),
            "loss": loss_entries(latest), "train": load_train(found["train"])}


# ---- goals --------------------------------------------------------------------------------------

def _line(ok, text):
    return ok, f"{'PASS' if ok else 'MISS'} {text}"


def _figure(e, what):
    """(the figure the goal `what` judges for the entry `e`, its text) or (None, why none)."""
    base = e["eager_ms"] if what == "speed vs eager" else e["compile_ms"]
    fm, em, pct = e["fused_peak_mb"], e["eager_peak_mb"], e["pct_of_bound"]
    if what == "roofline":
        return (None, "no bound for this GPU") if pct is None else (pct, f"{pct:.1f}% of bound")
    if what == "memory":
        if fm is None or em is None:
            return None, "peak memory not measured"
        return (fm / em if em else (math.inf if fm else 0.0), f"{fm:.1f} MiB vs eager {em:.1f} MiB = "
                + (f"1/{em / fm:.0f}" if fm > 0 else "0"))
    if base is None:
        return None, "no baseline row"
    return base / e["fused_ms"], f"{base / e['fused_ms']:.2f}x"


def goal_checks(summary):
    """[(ok: bool, line)] for the goals (docs/kernels.md "The benchmark scripts in detail"): each
    LOSS_GOALS check on the fastest fused entry of its case, then training's."""
    lines = []
    for shapes, dtype, checks, where_measured in LOSS_GOALS:
        for kind, n, N in shapes:
            case = f"{kind} {n}x{N} D={GOAL_D} {dtype} fwd+bwd"
            best = min((e for e in summary["loss"] if (e["kind"], e["n"], e["N"], e["D"],
                                                       e["dtype"]) == (kind, n, N, GOAL_D, dtype)),
                       key=lambda e: e["fused_ms"], default=None)
            for what, goal in checks:
                x, text = (None, "no fused row measured") if best is None else _figure(best, what)
                if x is None and where_measured:
                    continue
                tag = case if best is None else \
                    f"{case} [{best['backend']}, fastest fused, {best['fused_ms']:.3f} ms]"
                if x is None:
                    lines.append(_line(False, f"{tag} {what}: {text}"))
                elif what == "memory":
                    lines.append(_line(x <= goal, f"{tag} {what}: {text} (goal <= 1/{1 / goal:g})"))
                else:
                    unit = "%" if what == "roofline" else "x"
                    lines.append(_line(x >= goal, f"{tag} {what}: {text} (goal >= {goal:g}{unit})"))
    if (t := summary["train"]) is None:
        return lines + [_line(False, "training throughput: no train.json")]
    goal_cfg = (t["arch"], t["method"]) == ("resnet50", "nac-mq")
    return lines + [_line(goal_cfg and t["img_per_s"] >= GOAL_TRAIN_IMG_S,
                          f"training {t['arch']} {t['method']} batch {t['batch_per_gpu']}/GPU: "
                          f"{t['img_per_s']:.0f} img/s per GPU, data wait "
                          f"{100 * t['data_wait_frac']:.1f}% (goal >= {GOAL_TRAIN_IMG_S:g} img/s "
                          f"per H100{'' if goal_cfg else ', for resnet50 nac-mq: not this config'})")]


# ---- JUnit ---------------------------------------------------------------------------------------

def check_junit(path, require_passed=()):
    """Counts and the verdict of a pytest JUnit XML (docs/kernels.md)."""
    count = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        return {"ok": False, **count, "violations": [f"cannot read {path}: {exc}"],
                "allowed_skips": []}
    passed, failed, errors, violations, allowed = [], [], [], [], []
    for tc in root.iter("testcase"):
        tid, kids = f"{tc.get('classname', '')}::{tc.get('name', '')}", {c.tag for c in tc}
        if "failure" in kids or "error" in kids:
            (failed if "failure" in kids else errors).append(tid)
        elif "skipped" in kids:
            sk = tc.find("skipped")
            reason = " ".join(x for x in (sk.get("message", ""), sk.text or "") if x)
            count["skipped"] += 1
            if _SUSPECT_ID.search(tid) or _SUSPECT_REASON.search(reason):
                if any(re.search(i, tid) and re.search(r, reason) for i, r in ALLOWED_SKIPS):
                    allowed.append(f"{tid}: {reason.strip()[:160]}")
                else:
                    violations.append(f"skipped on the GPU: {tid}: {reason.strip()[:200]}")
        else:
            passed.append(tc.get("name", ""))
    violations += [f"failed: {t}" for t in failed] + [f"error: {t}" for t in errors]
    count.update(passed=len(passed), failed=len(failed), errors=len(errors))
    if sum(count.values()) == 0:
        violations.append("no tests ran")
    params = [m.group(1).split("-") for m in map(re.compile(r"\[(.*)\]$").search, passed) if m]
    violations += [f"no passed test has the backend {b!r} among its parameters"
                   for b in require_passed if not any(b in p for p in params)]
    return {"ok": not violations, **count, "violations": violations, "allowed_skips": allowed}


# ---- CLI -------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("inputs", nargs="*", help="result folders or loss CSV / train.json / versions.json")
    add("--out", help="summary.json path (default: in the first folder given, else ./summary.json)")
    add("--device", help="use only loss rows whose device contains this")
    add("--commit", help="commit to record (default: versions.json / CSV)")
    add("--require-goals", action="store_true", help="exit 3 if a goal is missed")
    add("--check-junit", metavar="XML")
    add("--require-passed", default="", help="with --check-junit: comma list of backends that "
        "must appear in a passed test's parameters")
    add("--status-file", help="write the one-line verdict here too")
    args = ap.parse_args(argv)
    for flag in ("--out", "--status-file"):  # before any work
        if path := getattr(args, flag[2:].replace("-", "_")):
            common.check_output_file(ap, flag, path, csv_file=False)
    if args.check_junit:
        res = check_junit(args.check_junit, [b for b in args.require_passed.split(",") if b])
        bad = len([v for v in res["violations"] if v.startswith("skipped")])
        line = (f"{res['failed']} failed, {res['passed']} passed, {res['skipped']} skipped"
                f"{f' ({bad} not allowed)' if bad else ''}, {res['errors']} errors")
        print("\n".join([f"  expected skip on a GPU machine: {a}" for a in res["allowed_skips"]]
                        + [f"  {v}" for v in res["violations"]]
                        + [f"junit {args.check_junit}: {line}: {'OK' if res['ok'] else 'FAIL'}"]))
        if args.status_file:
            common.write_text(args.status_file, line + ("" if res["ok"] else
                                                        f"; {len(res['violations'])} problem(s)")
                              + "\n")
        return 0 if res["ok"] else 1
    if not args.inputs:
        ap.error("give result folders or files (or --check-junit XML)")
    try:
        summary = build_summary(args.inputs, device=args.device, commit=args.commit)
    except (ValueError, KeyError, json.JSONDecodeError) as exc:
        print(f"gpu_summary: {exc}", file=sys.stderr)
        return 2
    out = args.out or (os.path.join(args.inputs[0], "summary.json") if os.path.isdir(args.inputs[0])
                       else "summary.json")
    common.check_output_file(ap, "--out", out, csv_file=False)  # (the default: in the first folder)
    checks = goal_checks(summary)
    summary["goals"] = [line for _, line in checks]  # "PASS ..." / "MISS ..."
    common.write_text(out, json.dumps(summary, indent=1, allow_nan=False) + "\n")
    print("\n".join([f"wrote {out}"] + summary["goals"]))
    missed = sum(not ok for ok, _ in checks)
    if args.status_file:
        common.write_text(args.status_file, f"goals: {len(checks) - missed} PASS, {missed} MISS\n")
    return 3 if args.require_goals and missed else 0


if __name__ == "__main__":
    sys.exit(main())
