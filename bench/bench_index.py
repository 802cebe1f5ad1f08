"""Benchmark of nac_fast.HashIndex against FAISS's IndexBinaryFlat, and of mAP@all at 1M codes.

    python bench/bench_index.py                       # 1,000 queries x top-10 over 1M x 128 bits;
                                                      # mAP@all of 10,000 queries over the same 1M
    python bench/bench_index.py --gallery 100000 --map-queries 1000 --repeats 1   # a quick look
    python bench/bench_index.py --isa avx2 --threads 1 --map-queries 0   # a level forced (issue 56:
                                      # the AVX2 path measured on an AVX-512 machine)

Synthetic CIFAR-10-like codes (bench_hamming.make_data: 10 class prototypes, each bit flipped
with probability --flip).  Rows, each timed on the same data in the same run:

  HashIndex.search          nac_fast.HashIndex(bits).search(queries, k) (C++ engine: query blocks x
                            gallery tiles, one compare per candidate against the k-th distance)
  faiss IndexBinaryFlat     index.search(queries, k), its default (heap) path, --threads threads
  nac_fast mAP@all          nac_fast.mean_average_precision over the whole 1M ranking (backend cpu)

    python bench/bench_index.py --gpu --csv RESULTS/index_gpu.csv   # the GPU index (issue 39):
                                      # bench_hamming.py --gpu --only topk, its flags

Goals of issue 25 on the 2-core development machine: top-10 <= 0.3 s, mAP@all (10k x 1M) <= 5 s.
Every row records the load average (1 min) before and after it: the machine is shared, and a
figure taken under load is slower than the code.  Memory: resident-set growth while the row runs
(1 ms sampling) and the index's own bytes per code.  Appends to bench/results/index_cpu.csv and
prints one JSON line last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import nac_fast  # noqa: E402
from bench_hamming import add_isa_flag, apply_isa, cpu_name, make_data, timed  # noqa: E402
from bench_loss import commit  # noqa: E402
from common import append_rows, check_flip, check_least, check_output_file  # noqa: E402
from nac_fast.ops import dispatch  # noqa: E402

CSV_PATH = os.path.join(ROOT, "bench", "results", "index_cpu.csv")
CSV_FIELDS = ["timestamp", "host", "cpu", "threads", "torch", "faiss", "git_commit", "method",
              "queries", "gallery", "bits", "k", "repeats", "median_s", "p20_s", "p80_s",
              "gpairs_per_s", "peak_rss_mb", "bytes_per_code", "load1_before", "load1_after",
              "goal_s", "meets_goal", "isa", "note"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--gpu" in argv:  # HashIndex on a GPU beside the CPU index: bench_hamming.py's GPU rows
        import bench_hamming
        return bench_hamming.main(["--only", "topk"] + argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gallery", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=1000, help="queries of the top-k rows")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--map-queries", type=int, default=10000, help="queries of the mAP@all row "
                    "(0 = skip)")
    ap.add_argument("--bits", type=int, default=128)
    ap.add_argument("--flip", type=float, default=0.3, help="bit-flip probability around the "
                    "class prototype, in [0, 0.5]")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--map-repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-faiss", action="store_true")
    add_isa_flag(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", default=CSV_PATH, help="CSV to append to ('' = none)")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    check_least(ap, args, {"--gallery": 1, "--queries": 1, "--k": 1, "--map-queries": 0,
                           "--bits": 1, "--repeats": 1, "--map-repeats": 1, "--threads": 1})
    check_flip(ap, args)
    if args.csv:
        check_output_file(ap, "--csv", args.csv)  # before any measurement

    torch.set_num_threads(args.threads)
    why = dispatch.available_backends("cpu", op="hamming", reasons=True)["cpu"]
    if why is not None:
        sys.exit(f"the nac_fast hamming C++ kernel is not available: {why}")
    isa = apply_isa(ap, args.isa)
    faiss = None
    if not args.no_faiss:
        try:
            import faiss  # noqa: F811
            faiss.omp_set_num_threads(args.threads)
        except ImportError:
            print("faiss not installed: FAISS row skipped", file=sys.stderr)

    G, D = args.gallery, args.bits
    nq = max(args.queries, args.map_queries)
    qc, ql, gc, gl = make_data(nq, G, D, 10, args.flip, args.seed)
    qb, gb = qc > 0, gc > 0
    del qc, gc
    index = nac_fast.HashIndex(D)
    index.add(gb)
    bytes_per_code = index.codes.words.element_size() * index.codes.words.shape[1]
    qp = nac_fast.pack_codes(qb[:args.queries])
    rows = []

    def add(method, queries, k, stats, goal=None, note=""):
        pairs = queries * G
        row = {"method": method, "queries": queries, "k": k, **stats,
               "gpairs_per_s": pairs / stats["median_s"] / 1e9, "goal_s": goal,
               "meets_goal": (stats["median_s"] <= goal) if goal else None, "note": note}
        rows.append(row)
        print(f"  {method:<28} {queries:>6} q x {G} k={k}: median {stats['median_s']:.3f} s "
              f"[p20 {stats['p20_s']:.3f}, p80 {stats['p80_s']:.3f}]  "
              f"{row['gpairs_per_s']:.2f} G pairs/s  load {stats['load1_before']:.1f} -> "
              f"{stats['load1_after']:.1f}" + (f"  goal {goal} s" if goal else ""), flush=True)

    def run(fn, repeats):
        l0 = os.getloadavg()[0]
        stats, out = timed(fn, repeats)
        stats.update(load1_before=l0, load1_after=os.getloadavg()[0])
        return stats, out

    print(f"HashIndex benchmark: {G} codes of {D} bits ({bytes_per_code} bytes each), "
          f"{args.threads} threads, C++ engine level {isa}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)

    index.search(qp, args.k)  # warm-up (page faults of the output, thread pool start)
    stats, (Dn, In) = run(lambda: index.search(qp, args.k), args.repeats)
    add("HashIndex.search", args.queries, args.k, stats, goal=0.3)

    if faiss is not None:
        fx = faiss.IndexBinaryFlat(index.codes.words.shape[1] * 64)
        fx.add(index.codes.words.numpy().view(np.uint8))
        qbytes = qp.words.numpy().view(np.uint8)
        fx.search(qbytes[:10], args.k)
        stats, (fD, fI) = run(lambda: fx.search(qbytes, args.k), args.repeats)
        same = bool(np.array_equal(fD, Dn.numpy()))
        add("faiss IndexBinaryFlat.search", args.queries, args.k, stats,
            note=f"faiss {faiss.__version__}; same distances as HashIndex: {same}")
        if not same:
            sys.exit("FAISS and HashIndex disagree on the distances")

    map_s = None
    if args.map_queries:
        Qm = args.map_queries
        stats, m = run(lambda: nac_fast.mean_average_precision(qb[:Qm], ql[:Qm], gb, gl,
                                                               backend="cpu"), args.map_repeats)
        add("nac_fast mAP@all", Qm, G, stats, goal=5.0, note=f"mAP {m:.6f}")
        map_s = stats["median_s"]

    meta = {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "cpu": cpu_name(), "threads": args.threads,
            "torch": torch.__version__, "faiss": getattr(faiss, "__version__", "") if faiss else "",
            "git_commit": commit(), "gallery": G, "bits": D, "bytes_per_code": bytes_per_code,
            "isa": isa}
    if args.csv:  # a CSV with another header is rewritten with CSV_FIELDS first (common)
        append_rows(args.csv, [{**meta, **r, "note": "; ".join(x for x in (r["note"], args.note)
                                                                if x)} for r in rows], CSV_FIELDS)
        print(f"  appended {len(rows)} rows to {os.path.relpath(args.csv, ROOT)}")
    summary = {"bench": "index_cpu", "isa": isa, "gallery": G, "bits": D, "threads": args.threads,
               "topk_median_s": rows[0]["median_s"], "topk_goal_s": 0.3,
               "map_median_s": map_s, "map_goal_s": 5.0,
               "load1": os.getloadavg()[0]}
    if faiss is not None:
        summary["faiss_topk_median_s"] = rows[1]["median_s"]
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
