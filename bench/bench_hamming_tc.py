"""The GPU goals of the Hamming engine (issue 56) in one command, each row checked against the
C++ engine in the same run: the `hamming-tc` stage of bench/gpu_suite.sh.

    python bench/bench_hamming_tc.py --csv RESULTS/hamming_tc.csv        # an H100: 2-4 min
    TRITON_INTERPRET=1 python bench/bench_hamming_tc.py --device cpu --tiny --csv X.csv
                                          # the same code on toy sizes, CPU tensors (the plumbing)

Rows (128-bit codes; engine column: "triton-popc" and "triton-mma", the Triton engine's two top-k
filters, kernels/hamming_triton.py `topk_with`; "cuda", csrc/hamming_cuda.cu; "cpu", the C++
engine):

  topk      HashIndex(device=...).search of --queries codes of the index with 10% of their bits
            flipped, top --k, over each of --sizes uniformly random codes made on the device (the
            index on the device before the clock starts).  Check: distances and indices of
            --check-queries queries equal to the C++ engine's (a CPU index of the same codes), and
            every query's equal to the triton-popc engine's.
  map_all   nac_fast.mean_average_precision of --map-queries x --map-gallery class-prototype codes
            (bench_hamming.py's), engines triton and cuda.  Check: per-query AP of --check-queries
            queries against the C++ engine to 1e-12, equal counts of relevant items.

Column bound_s: the int8 tensor-core floor of the pairs' products, Q x G x 64 W multiply-adds at
INT8_OPS operations a second (an H100 SXM's dense int8 peak; 2 operations a multiply-add), and
of_bound = bound_s / median_s.  Goals (goal_s, meets_goal): GOALS, on a GPU only.  A failed check
fails the command (exit 1).  --profile-run: one search of the largest gallery by the
tensor-core filter and nothing else (the stage runs Nsight Compute around it: how close the
filter kernel comes to the tensor cores' peak).  Appends to --csv, prints a table and one JSON
line last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hamming import (_ap_check, cpu_name, flip_bits, gpu_timed,  # noqa: E402
                           packed_class_codes, random_codes)
from bench_loss import commit  # noqa: E402
from common import append_rows, check_least, check_output_file  # noqa: E402

import nac_fast as H  # noqa: E402
from nac_fast.ops import dispatch  # noqa: E402

INT8_OPS = 1979e12            # H100 SXM dense int8 tensor-core operations a second
GOALS = {("topk", 1_000_000, 1000): 0.001, ("topk", 100_000_000, 1000): 0.05,
         ("map_all", 1_000_000, 10000): 0.05}   # issue 56, an H100, 128 bits
TINY = dict(sizes="4200,9000", queries=9, map_queries=33, map_gallery=600, check_queries=4,
            repeats=1)
FIELDS = ["timestamp", "host", "cpu", "gpu", "torch", "triton", "git_commit", "method", "engine",
          "device", "queries", "gallery", "bits", "k", "repeats", "median_s", "p20_s", "p80_s",
          "peak_gpu_mib", "map", "bound_s", "of_bound", "goal_s", "meets_goal", "check", "note"]


def _sizes(ap, text):
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sizes: a comma list of integers, got {text!r}")
    if not out or min(out) < 1:
        ap.error(f"--sizes: positive gallery sizes, got {text!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--bits", type=int, default=128)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--sizes", default="1000000,100000000", help="top-k gallery sizes")
    ap.add_argument("--map-queries", type=int, default=10000)
    ap.add_argument("--map-gallery", type=int, default=1_000_000)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--check-queries", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="toy sizes (the CPU rehearsal)")
    ap.add_argument("--profile-run", action="store_true",
                    help="one tensor-core search of the largest size, for Nsight Compute")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", default="", help="CSV to append to ('' = none)")
    args = ap.parse_args(argv)
    if args.tiny:
        for key, val in TINY.items():
            setattr(args, key, val)
    check_least(ap, args, {"--bits": 1, "--k": 1, "--queries": 1, "--map-queries": 1,
                           "--map-gallery": 1, "--classes": 1, "--check-queries": 1,
                           "--repeats": 1})
    sizes = _sizes(ap, args.sizes)
    if args.k > min(sizes):
        ap.error(f"--k: at most the smallest gallery ({min(sizes)}), got {args.k}")
    if args.csv:
        check_output_file(ap, "--csv", args.csv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible (--device cpu runs the interpreter)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu: set TRITON_INTERPRET=1 (the Triton engine runs under the "
                 "interpreter on CPU tensors)")
    reasons = dispatch.available_backends(args.device, op="hamming", reasons=True)
    if reasons["triton"] is not None:
        sys.exit(f"the triton Hamming engine is not available: {reasons['triton']}")
    if dispatch.available_backends("cpu", op="hamming", reasons=True)["cpu"] is not None:
        sys.exit("the C++ Hamming engine (the check) is not available: build the extension")
    cuda_engine = device.type == "cuda" and reasons["cuda"] is None
    if device.type == "cuda" and not cuda_engine:
        print(f"  no 'cuda' engine rows: {reasons['cuda']}", flush=True)

    import triton
    from nac_fast.index import HashIndex
    P, D, k = H.PackedCodes, args.bits, args.k
    W = -(-D // 64)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "interpreter"

    if args.profile_run:  # the stage's Nsight Compute target: nothing but the filter's searches
        G = sizes[-1]
        gw = random_codes(G, D, gen, device)
        qw = flip_bits(gw[torch.randint(0, G, (args.queries,), generator=gen, device=device)],
                       D, 0.1, gen)
        index = HashIndex(D, device=device, backend="triton", topk_method="mma")
        index.add(P(gw, D))
        index.search(P(qw, D), k)
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"profile run: {args.queries} queries, top-{k} of {G:,} codes (method mma)")
        return 0

    print(f"Hamming engine, GPU goals (issue 56): {gpu_name}, {D} bits, triton "
          f"{triton.__version__}, torch {torch.__version__}", flush=True)
    rows, failures = [], []
    t_start = time.perf_counter()

    def add(method, engine, Q, G, stats, check, m=None, note=""):
        goal = GOALS.get((method, G, Q)) if device.type == "cuda" and D == 128 else None
        bound = Q * G * 64 * W * 2 / INT8_OPS
        rows.append(dict(method=method, engine=engine, device=str(device), queries=Q, gallery=G,
                         bits=D, k=k if method == "topk" else "", repeats=stats["repeats"],
                         median_s=stats["median_s"], p20_s=stats["p20_s"], p80_s=stats["p80_s"],
                         peak_gpu_mib=round(stats.get("peak_gpu_mib", 0.0), 1), map=m,
                         bound_s=bound, of_bound=bound / stats["median_s"], goal_s=goal,
                         meets_goal=(stats["median_s"] <= goal) if goal else "", check=check,
                         note=note))
        print(f"  {method:<7} {engine:<11} {Q:>6} q x {G:>11,}: median {stats['median_s']:.6f} s "
              f"(int8 floor {bound:.2e} s){f'  goal {goal} s' if goal else ''}  {check}",
              flush=True)

    # ---- top-k: the two Triton filters and the CUDA engine on one index ----
    for G in sizes:
        Q = args.queries
        gw = random_codes(G, D, gen, device)
        qw = flip_bits(gw[torch.randint(0, G, (Q,), generator=gen, device=device)], D, 0.1, gen)
        nc = min(args.check_queries, Q)
        cpu_index = HashIndex(D)
        cpu_index.add(P(gw.cpu(), D))
        Dc, Ic = cpu_index.search(P(qw[:nc].cpu(), D), k)
        del cpu_index
        index = HashIndex(D, device=device, backend="triton")
        index.add(P(gw, D))
        del gw
        first = None
        engines = [("triton-popc", "triton", "popc"), ("triton-mma", "triton", "mma")]
        if cuda_engine:
            engines.append(("cuda", "cuda", "auto"))
        for name, backend, method in engines:
            index.backend, index.topk_method = backend, method
            index.search(P(qw[:2], D), k)  # compiles, outside the clock
            stats, (Dg, Ig) = gpu_timed(lambda: index.search(P(qw, D), k), args.repeats, device)
            good = bool(torch.equal(Dg[:nc].cpu(), Dc) and torch.equal(Ig[:nc].cpu(), Ic))
            if first is None:
                first = (Dg, Ig)
            same = bool(torch.equal(Dg, first[0]) and torch.equal(Ig, first[1]))
            check = (f"ok: {nc} queries equal to the C++ engine's, all {Q} to triton-popc's"
                     if good and same else
                     f"FAIL: top-{k} differs from the C++ engine's ({nc} queries) or "
                     "triton-popc's")
            if not (good and same):
                failures.append(f"topk {name} x {G}: {check}")
            add("topk", name, Q, G, stats, check,
                note="HashIndex search, queries = index codes with 10% of bits flipped")
        del index, first, Dg, Ig
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- mAP@all: the Triton passes and the CUDA engine's shared-memory counters ----
    protos = random_codes(args.classes, D, gen, device)
    Q, G = args.map_queries, args.map_gallery
    qw, ql = packed_class_codes(Q, D, protos, args.classes, 0.3, gen, device)
    gw, gl = packed_class_codes(G, D, protos, args.classes, 0.3, gen, device)
    nc = min(args.check_queries, Q)
    for eng in ["triton"] + (["cuda"] if cuda_engine else []):
        good, check = _ap_check(H, qw, ql, gw, gl, D, nc, device, eng)  # compiles too
        if not good:
            failures.append(f"map_all {eng} x {G}: {check}")
        stats, m = gpu_timed(lambda: H.mean_average_precision(P(qw, D), ql, P(gw, D), gl,
                                                              backend=eng), args.repeats, device)
        add("map_all", eng, Q, G, stats, check, m=m)

    meta = {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "cpu": cpu_name(), "gpu": gpu_name,
            "torch": torch.__version__, "triton": triton.__version__, "git_commit": commit()}
    if args.csv:
        append_rows(args.csv, [{**meta, **r} for r in rows], FIELDS)
        print(f"  appended {len(rows)} rows to {args.csv}")
    print(f"\n{'row':<40} {'median s':>10} {'of int8 floor':>14} {'goal':>7}  check")
    for r in rows:
        what = f"{r['method']} {r['engine']} {r['queries']}x{r['gallery']:,}"
        goal = "" if not r["goal_s"] else ("MET" if r["meets_goal"] else "MISSED")
        print(f"{what:<40} {r['median_s']:>10.6f} {r['of_bound']:>14.3f} {goal:>7}  "
              f"{r['check'].split(':')[0]}")
    print(json.dumps({"bench": "hamming_tc", "device": str(device), "gpu": gpu_name, "bits": D,
                      "rows": len(rows), "failures": failures,
                      "elapsed_s": round(time.perf_counter() - t_start, 1),
                      "goals": {f"{r['method']} {r['engine']} {r['queries']}x{r['gallery']}":
                                bool(r["meets_goal"]) for r in rows if r["goal_s"]}}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
