"""Benchmark of the Hamming engine (nac_fast's ops/search.py, ops/retrieval.py) against FAISS and the torch fallback.

    python bench/bench_hamming.py                      # paper-size protocol: 10,000 x 50,000 x 128
    python bench/bench_hamming.py --queries 1000 --gallery 5000 --repeats 1   # a quick look

Synthetic CIFAR-10-like codes: 10 class prototypes (random +-1), each code is its class
prototype with every bit flipped with probability --flip, labels uniform.  Rows measured:

  nac_fast cpu   mAP@all         nac_fast.mean_average_precision(backend="cpu") from +-1 float codes
                                 (packing and argument checks included)
  nac_fast cpu   full ranking    nac_fast.rank in query chunks: the same output as FAISS's search
  faiss          full ranking    IndexBinaryFlat.search(k=G) in query chunks, use_heap=False (its
                                 counting-sort path; the default heap path is the next row)
  faiss heap     full ranking    the default use_heap=True path, on --faiss-heap-queries queries
  faiss + numpy  mAP@all         FAISS ranking plus AP computed from it with numpy (FAISS has no mAP)
  torch ref      mAP@all         backend="reference" on --torch-queries queries

Times are wall seconds (median, 20th and 80th percentile over --repeats / --slow-repeats runs); peak memory is the
largest resident-set growth over the run, sampled every millisecond.  Prints a table, appends one
CSV row per method to bench/results/hamming_cpu.csv, and prints one JSON line last.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import socket
import sys
import threading
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import nac_fast as H
except ImportError:  # running from a checkout that is not installed
    sys.path.insert(0, ROOT)
    import nac_fast as H
from nac_fast.ops import dispatch  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loss import commit  # noqa: E402  (the bench scripts' one git-commit helper)

CSV_PATH = os.path.join(ROOT, "bench", "results", "hamming_cpu.csv")
CSV_FIELDS = ["timestamp", "host", "cpu", "threads", "torch", "faiss", "git_commit", "method",
              "queries", "gallery", "bits", "repeats", "median_s", "p20_s", "p80_s",
              "peak_rss_mb", "map", "note"]


class PeakRSS:
    """Largest growth of this process's resident set while the block runs (1 ms sampling)."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())

    @property
    def mb(self) -> float:
        return (self.peak - self.base) / 2 ** 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_data(q: int, g: int, bits: int, classes: int, flip: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    protos = torch.randint(0, 2, (classes, bits), generator=gen).float() * 2 - 1

    def draw(n):
        lab = torch.randint(0, classes, (n,), generator=gen)
        sign = torch.where(torch.rand(n, bits, generator=gen) < flip, -1.0, 1.0)
        return protos[lab] * sign, lab

    qc, ql = draw(q)
    gc, gl = draw(g)
    return qc, ql, gc, gl


def np_ap_from_ranking(idx: np.ndarray, ql: np.ndarray, gl: np.ndarray) -> np.ndarray:
    """AP of each row of a ranking (Q, G) of gallery indices; NaN without relevant items."""
    rel = gl[idx] == ql[:, None]
    hits = np.cumsum(rel, axis=1)
    ranks = np.arange(1, idx.shape[1] + 1)
    nrel = rel.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(nrel > 0, (hits / ranks * rel).sum(1) / nrel, np.nan)


def timed(fn, repeats: int):
    times, out, peak = [], None, 0.0
    for _ in range(repeats):
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        peak = max(peak, mem.mb)
    t = np.array(times)
    return {"median_s": float(np.median(t)), "p20_s": float(np.percentile(t, 20)),
            "p80_s": float(np.percentile(t, 80)), "peak_rss_mb": peak, "repeats": repeats}, out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=10000)
    ap.add_argument("--gallery", type=int, default=50000)
    ap.add_argument("--bits", type=int, default=128)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--flip", type=float, default=0.3, help="bit-flip probability around the "
                    "class prototype (0.3 gives mAP ~0.5 at 128 bits)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of the nac_fast mAP row")
    ap.add_argument("--slow-repeats", type=int, default=1,
                    help="runs of the full-ranking and FAISS rows (the slow rows at paper size; "
                    "bench/results/notes.md)")
    ap.add_argument("--chunk", type=int, default=500, help="queries per ranking call (bounds the "
                    "Q x G ranking memory: 12 bytes per pair)")
    ap.add_argument("--torch-queries", type=int, default=1000,
                    help="queries for the torch reference row (much slower than the cpu "
                    "rows); 0 = skip")
    ap.add_argument("--faiss-heap-queries", type=int, default=500,
                    help="queries for FAISS's default heap path (slow at k=G); 0 = skip")
    ap.add_argument("--gpu", action="store_true", help="also time the triton and torch-reference "
                    "backends on CUDA tensors (rows marked cuda; GPU peak memory in the note)")
    ap.add_argument("--no-faiss", action="store_true")
    ap.add_argument("--no-rank", action="store_true", help="skip the nac_fast full-ranking row")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", default=CSV_PATH, help="CSV to append to ('' = none)")
    ap.add_argument("--note", default="", help="free text stored in the CSV rows")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    why = dispatch.available_backends("cpu", op="hamming", reasons=True)["cpu"]
    if why is not None:
        sys.exit(f"the nac_fast hamming C++ kernel is not available: {why}")
    faiss = None
    if not args.no_faiss:
        try:
            import faiss  # noqa: F811
            faiss.omp_set_num_threads(args.threads)
        except ImportError:
            print("faiss not installed (pip install faiss-cpu): FAISS rows skipped", file=sys.stderr)

    Q, G, D = args.queries, args.gallery, args.bits
    qc, ql, gc, gl = make_data(Q, G, D, args.classes, args.flip, args.seed)
    ql_np, gl_np = ql.numpy(), gl.numpy()
    rows = []

    def add(method, queries, stats, m, note=""):
        rows.append({"method": method, "queries": queries, **stats, "map": m, "note": note})
        print(f"  {method:<34} {queries:>6} q  median {stats['median_s']:8.3f} s  "
              f"[p20 {stats['p20_s']:.3f}, p80 {stats['p80_s']:.3f}]  "
              f"peak +{stats['peak_rss_mb']:7.1f} MB  mAP {m if m is None else f'{m:.6f}'}",
              flush=True)

    print(f"Hamming engine, {Q} queries x {G} gallery x {D} bits, {args.classes} classes, "
          f"flip {args.flip}, {args.threads} threads, simd level "
          f"{int(torch.ops.nac_fast.hamming_simd_level())} (2 = AVX-512 VPOPCNTDQ)", flush=True)

    # 1. nac_fast C++ mAP@all
    stats, res = timed(lambda: H.mean_average_precision(qc, ql, gc, gl, backend="cpu",
                                                        return_num_queries=True), args.repeats)
    nac_map, used = res
    add("nac_fast cpu mAP@all", Q, stats, nac_map, f"{used} queries with relevant items")
    nac_stats = stats

    qp, gp = H.pack_codes(qc), H.pack_codes(gc)

    # 2. nac_fast C++ full ranking, the output FAISS produces
    if not args.no_rank:
        def nac_rank():
            for s in range(0, Q, args.chunk):
                H.rank(H.PackedCodes(qp.words[s:s + args.chunk], D), gp, backend="cpu")
        stats, _ = timed(nac_rank, args.slow_repeats)
        add("nac_fast cpu full ranking", Q, stats, None, "packed codes, chunks of "
            f"{args.chunk} queries")

    faiss_rank_stats = faiss_map_stats = None
    faiss_map = None
    if faiss is not None:
        index = faiss.IndexBinaryFlat(gp.words.shape[1] * 64)  # zero padding bits on both sides
        index.add(gp.words.numpy().view(np.uint8))
        qbytes = qp.words.numpy().view(np.uint8)

        # 3. FAISS full ranking (counting-sort path) and 4. + numpy AP
        index.use_heap = False

        def faiss_rank():
            for s in range(0, Q, args.chunk):
                index.search(qbytes[s:s + args.chunk], G)
        faiss_rank_stats, _ = timed(faiss_rank, args.slow_repeats)
        add("faiss IndexBinaryFlat ranking", Q, faiss_rank_stats, None, "use_heap=False")

        def faiss_map_fn():
            aps = []
            for s in range(0, Q, args.chunk):
                _, idx = index.search(qbytes[s:s + args.chunk], G)
                aps.append(np_ap_from_ranking(idx, ql_np[s:s + args.chunk], gl_np))
            a = np.concatenate(aps)
            return float(np.nanmean(a))
        faiss_map_stats, faiss_map = timed(faiss_map_fn, args.slow_repeats)
        add("faiss ranking + numpy AP", Q, faiss_map_stats, faiss_map, "use_heap=False")

        if args.faiss_heap_queries:
            nq = min(args.faiss_heap_queries, Q)
            index.use_heap = True
            stats, _ = timed(lambda: [index.search(qbytes[s:min(s + args.chunk, nq)], G)
                                      for s in range(0, nq, args.chunk)], 1)
            add("faiss IndexBinaryFlat ranking (heap)", nq, stats, None,
                "default use_heap=True; subset of the queries")

    torch_stats = None
    if args.torch_queries:
        nq = min(args.torch_queries, Q)
        torch_stats, m = timed(lambda: H.mean_average_precision(qc[:nq], ql[:nq], gc, gl,
                                                                backend="reference"), 1)
        # the same queries through the C++ kernel, to check the two backends agree
        m_cpu = H.mean_average_precision(qc[:nq], ql[:nq], gc, gl, backend="cpu")
        add("torch reference mAP@all", nq, torch_stats, m,
            f"subset of the queries; cpu backend on the same queries: {m_cpu:.12f}")
        if abs(m - m_cpu) > 1e-9:
            sys.exit(f"reference and cpu backends disagree: {m} vs {m_cpu}")

    gpu_summary = {}
    if args.gpu:
        if not torch.cuda.is_available():
            sys.exit("--gpu: no CUDA device visible")
        dev = torch.device("cuda")
        qd, qld, gd, gld = (t.to(dev) for t in (qc, ql, gc, gl))

        def on_gpu(backend, nq):
            def fn():
                m = H.mean_average_precision(qd[:nq], qld[:nq], gd, gld, backend=backend)
                torch.cuda.synchronize()
                return m
            fn()  # warm-up: Triton compiles on the first call
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            stats, m = timed(fn, args.repeats)
            peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
            return stats, m, peak

        for backend, nq in (("triton", Q), ("reference", Q)):
            stats, m, peak = on_gpu(backend, nq)
            want = nac_map if nq == Q else None
            add(f"nac_fast {backend} mAP@all (cuda)", nq, stats, m,
                f"{torch.cuda.get_device_name()}; GPU peak +{peak:.1f} MiB")
            if want is not None and abs(m - want) > 1e-9:
                sys.exit(f"{backend} on cuda disagrees with the cpu backend: {m} vs {want}")
            gpu_summary[f"{backend}_cuda_median_s"] = stats["median_s"]
            gpu_summary[f"{backend}_cuda_peak_mib"] = round(peak, 1)

    if faiss_map is not None and abs(faiss_map - nac_map) > 1e-9:
        print(f"  note: mAP from the FAISS ranking differs by {faiss_map - nac_map:.3g} "
              "(its tie order is not by gallery index)")

    meta = {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "cpu": cpu_name(), "threads": args.threads,
            "torch": torch.__version__, "faiss": getattr(faiss, "__version__", "") if faiss else "",
            "git_commit": commit(), "gallery": G, "bits": D}
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            if new:
                w.writeheader()
            for r in rows:
                w.writerow({**meta, **r, "note": "; ".join(x for x in (r["note"], args.note) if x)})
        print(f"  appended {len(rows)} rows to {os.path.relpath(args.csv, ROOT)}")

    summary = {"bench": "hamming_cpu", "queries": Q, "gallery": G, "bits": D,
               "threads": args.threads, "map": nac_map, "nac_map_median_s": nac_stats["median_s"],
               "nac_map_peak_rss_mb": round(nac_stats["peak_rss_mb"], 1),
               "target_s": 5.0, "meets_target": nac_stats["median_s"] <= 5.0}
    if faiss_rank_stats:
        summary.update(faiss_rank_median_s=faiss_rank_stats["median_s"],
                       faiss_map_median_s=faiss_map_stats["median_s"],
                       speedup_vs_faiss_rank=faiss_rank_stats["median_s"] / nac_stats["median_s"])
    if torch_stats:
        summary.update(torch_ref_queries=min(args.torch_queries, Q),
                       torch_ref_s=torch_stats["median_s"])
    summary.update(gpu_summary)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
