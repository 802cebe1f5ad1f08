"""The predictions of bench/gpu_notes.md that the next GPU run measures, checked against its
results ("predict, change, measure": each change was written down with what it should do before
any GPU ran it).

    python bench/check_predictions.py bench/results/<gpu>_<date>_run4 bench/results/<gpu>_<date>_run4t
        [--markdown OUT.md]

Each prediction names the results file that measures it (host_gpu.csv of the suite's host stage,
loss_gpu.csv of bench-quick, hamming_gpu.csv of the hamming stage), the rows (the last matching
row with status ok, over the folders given, in order), the figure made of them and the predicted
range.  One line per prediction, last:

    HELD | MISSED | not measured,  <section>: <case>: measured <figure>, predicted <range>

and with --markdown the same as a table for gpu_notes.md's `prediction / outcome` cells.  A figure
outside the range is MISSED whichever side it falls (a faster kernel than predicted is a wrong
model too); nothing is rounded towards the range.  Exit status 0 whatever the verdicts (they are
findings), 2 on bad arguments or a damaged CSV.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import sys
from typing import Callable, Optional

FILES = ("host_gpu.csv", "loss_gpu.csv", "hamming_gpu.csv")


@dataclasses.dataclass(frozen=True)
class Prediction:
    section: str       # the gpu_notes.md section that made it
    case: str
    unit: str          # of the figure and the range
    lo: float
    hi: float
    figure: Callable   # rows by file -> the measured figure in `unit`, or None (not measured)


def _num(row, col) -> Optional[float]:
    try:
        x = float(row.get(col, ""))
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _last(rows, **where) -> Optional[dict]:
    """The last row whose columns equal `where` (compared as text), of those with status ok (and,
    in hamming_gpu.csv, a check that starts with ok)."""
    hit = None
    for r in rows:
        if (r.get("status") or "ok") != "ok" or not (r.get("check") or "ok").startswith("ok"):
            continue  # a failed row, or a GPU row whose results differed from the C++ engine's
        if all(str(r.get(k, "")) == str(v) for k, v in where.items()):
            hit = r
    return hit


def _host(R, kind, n, N, backend, col, dtype="bfloat16"):
    r = _last(R["host_gpu.csv"], mode="gpu", kind=kind, n=n, N=N, D=128, dtype=dtype,
              backend=backend)
    return None if r is None else _num(r, col)


def _fold_host_us(kind, n, N):
    def f(R):
        a, b = (_host(R, kind, n, N, "triton-unfolded", "host_s"),
                _host(R, kind, n, N, "triton", "host_s"))
        return None if a is None or b is None else (a - b) * 1e6
    return f


def _fold_graph_pct(kind, n, N):
    def f(R):
        a, b = (_host(R, kind, n, N, "triton", "graph_s"),
                _host(R, kind, n, N, "triton-unfolded", "graph_s"))
        return None if a is None or not b else 100.0 * (a / b - 1.0)
    return f


def _fp32_ms(kind, n, N, mode):
    def f(R):
        best = None
        for backend in ("triton+graph", "triton"):  # graph replay where measured (issue 38)
            r = _last(R["loss_gpu.csv"], kind=kind, n=n, N=N, D=128, dtype="float32",
                      backend=backend, fp32_dot=mode)
            x = None if r is None else _num(r, "median_s")
            if x is not None:
                best = x * 1e3
                break
        return best
    return f


def _hamming(method, queries, gallery, scale):
    def f(R):
        r = _last(R["hamming_gpu.csv"], method=method, engine="cuda", queries=queries,
                  gallery=gallery)
        x = None if r is None else _num(r, "median_s")
        return None if x is None else x * scale
    return f


PREDICTIONS = [
    # "The row-wise tails folded into the matrix kernels" (fifth session of 2026-11-28)
    Prediction("fold", "in-batch 512 bf16, host per fwd+bwd, unfolded minus folded", "us",
               20, 60, _fold_host_us("inbatch", 512, 512)),
    Prediction("fold", "queue 256 x 65536 bf16, host per fwd+bwd, unfolded minus folded", "us",
               10, 30, _fold_host_us("mq", 256, 65536)),
    Prediction("fold", "in-batch 8192 bf16, graph, folded vs unfolded", "%", -8, 3,
               _fold_graph_pct("inbatch", 8192, 8192)),
    Prediction("fold", "queue 8192 x 65536 bf16, graph, folded vs unfolded", "%", -8, 3,
               _fold_graph_pct("mq", 8192, 65536)),
    # "fp32 in bf16x6" and "fp32 in fp16x3" (third and fourth sessions of 2026-11-28)
    Prediction("fp32 in bf16x6", "in-batch 8192 fp32 fwd+bwd", "ms", 0.95, 1.5,
               _fp32_ms("inbatch", 8192, 8192, "bf16x6")),
    Prediction("fp32 in bf16x6", "queue 8192 x 65536 fp32 fwd+bwd", "ms", 3.8, 5.9,
               _fp32_ms("mq", 8192, 65536, "bf16x6")),
    Prediction("fp32 in fp16x3", "in-batch 8192 fp32 fwd+bwd", "ms", 0.47, 0.74,
               _fp32_ms("inbatch", 8192, 8192, "fp16x3")),
    # "The CUDA Hamming engine" (fourth session of 2026-11-27)
    Prediction("CUDA Hamming engine", "mAP@all 10k x 1M", "s", 0.03, 0.06,
               _hamming("map_all", 10000, 1_000_000, 1.0)),
    Prediction("CUDA Hamming engine", "top-10 1k x 1M", "ms", 1.5, 3.0,
               _hamming("topk", 1000, 1_000_000, 1e3)),
    Prediction("CUDA Hamming engine", "top-10 1k x 100M", "s", 0.11, 0.2,
               _hamming("topk", 1000, 100_000_000, 1.0)),
]


def read_results(dirs) -> dict:
    """{file name: rows of that file over `dirs`, in the order given} (a missing file: none)."""
    out = {name: [] for name in FILES}
    for d in dirs:
        for name in FILES:
            path = os.path.join(d, name)
            if not os.path.exists(path):
                continue
            try:
                with open(path, newline="") as f:
                    out[name].extend(csv.DictReader(f))
            except (OSError, UnicodeDecodeError, csv.Error) as exc:
                raise ValueError(f"{path}: {exc}") from exc
    return out


def verdicts(results) -> list:
    """[(verdict, Prediction, figure or None)] in PREDICTIONS' order."""
    out = []
    for p in PREDICTIONS:
        x = p.figure(results)
        v = "not measured" if x is None else ("HELD" if p.lo <= x <= p.hi else "MISSED")
        out.append((v, p, x))
    return out


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="results folders of the GPU suite, in run order")
    ap.add_argument("--markdown", default=None, help="also write the table here (a new file)")
    ap.add_argument("--overwrite", action="store_true", help="--markdown may replace a file")
    args = ap.parse_args(argv)
    for d in args.dirs:
        if not os.path.isdir(d):
            ap.error(f"{d}: not a folder")
    if not any(os.path.exists(os.path.join(d, f)) for d in args.dirs for f in FILES):
        ap.error(f"none of {', '.join(FILES)} in {', '.join(args.dirs)}")
    if args.markdown:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_csv import check_output_file
        check_output_file(ap, "--markdown", args.markdown, csv_file=False)
        if os.path.exists(args.markdown) and not args.overwrite:
            ap.error(f"--markdown {args.markdown!r} exists; --overwrite replaces it")
    try:
        results = read_results(args.dirs)
    except ValueError as exc:
        ap.error(str(exc))
    rows = verdicts(results)
    for v, p, x in rows:
        print(f"{v:<12}  {p.section}: {p.case}: measured {_fmt(x)} {p.unit}, predicted "
              f"{p.lo:g} .. {p.hi:g} {p.unit}")
    if args.markdown:
        from nac_fast._files import atomic_write
        lines = ["| what | case | predicted | measured | outcome |", "|---|---|---|---|---|"]
        lines += [f"| {p.section} | {p.case} | {p.lo:g} .. {p.hi:g} {p.unit} | "
                  f"{_fmt(x)}{'' if x is None else ' ' + p.unit} | {v} |" for v, p, x in rows]
        text = "\n".join(lines) + "\n"
        atomic_write(args.markdown, lambda f: f.write(text), mode="w")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
