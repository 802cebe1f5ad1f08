"""Benchmark of the Hamming engine (nac_fast's ops/search.py, ops/retrieval.py, HashIndex): the C++
engine against FAISS and the torch fallback, the index's top-k, the GPU engines and their goals.

    python bench/bench_hamming.py [--index | --gpu] [options]

Three runs, one CSV each: the CPU protocol (hamming_cpu.csv), --index (index_cpu.csv), --gpu
(hamming_gpu.csv; the hamming-tc stage's hamming_tc.csv). Rows, columns, goals and commands:
docs/evaluation.md "The Hamming benchmark".  A failed GPU check exits 1; the last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (ROOT, append_rows, check_least, check_output_file,  # noqa: E402
                    device_name, int_list, quantiles, run_fields, write_text)

import nac_fast as H  # noqa: E402  (common put the source tree on sys.path)
from nac_fast.ops import dispatch  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
_RUN = ["timestamp", "host", "cpu", "threads", "torch", "faiss", "git_commit", "method", "queries",
        "gallery", "bits"]
CSV_FIELDS = _RUN + ["repeats", "median_s", "p20_s", "p80_s", "peak_rss_mb", "map", "isa", "note"]
INDEX_FIELDS = _RUN + ["k", "repeats", "median_s", "p20_s", "p80_s", "gpairs_per_s", "peak_rss_mb",
                       "bytes_per_code", "load1_before", "load1_after", "goal_s", "meets_goal",
                       "isa", "note"]
GPU_FIELDS = ["timestamp", "host", "cpu", "gpu", "threads", "torch", "triton", "git_commit",
              "method", "engine", "device", "queries", "gallery", "bits", "k", "repeats",
              "median_s", "p20_s", "p80_s", "peak_gpu_mib", "peak_rss_mb", "map",
              "speedup_vs_cpu", "bound_s", "of_bound", "goal_s", "meets_goal", "check", "note"]
# (method, gallery, queries) -> seconds, on an H100 at 128 bits: issue 56 (issue 39's, halved)
GOALS = {("topk", 1_000_000, 1000): 0.001, ("topk", 100_000_000, 1000): 0.05,
         ("map_all", 1_000_000, 10000): 0.05}
INT8_OPS = 1979e12            # H100 SXM dense int8 tensor-core operations a second (bound_s)
TINY = dict(map_sizes="200,600", map_queries=33, cpu_map_queries="33,16",
            index_sizes="4200,9000", index_queries=9, cpu_topk_queries="9,4",
            check_queries=4, gpu_repeats=1, k=10)

# every option once: (flag, argparse keywords, {run: default}); a run's options are those with a
# default for it (None: no default), and an option of another run is a usage error
C, I, G_ = "cpu", "index", "gpu"
ALL = (C, I, G_)
OPTIONS = [
    ("--queries", dict(type=int, help="queries (cpu; top-k rows: index)"), {C: 10000, I: 1000}),
    ("--gallery", dict(type=int), {C: 50000, I: 1_000_000}),
    ("--bits", dict(type=int), dict.fromkeys(ALL, 128)),
    ("--classes", dict(type=int), {C: 10, G_: 10}),
    ("--flip", dict(type=float, help="bit-flip probability around the class prototype, in "
                    "[0, 0.5] (0.3: mAP ~0.5 at 128 bits)"), {C: 0.3, I: 0.3, G_: 0.3}),
    ("--repeats", dict(type=int, help="runs of the mAP row (cpu), each top-k row (index)"),
     {C: 3, I: 5}),
    ("--slow-repeats", dict(type=int, help="runs of the full-ranking and FAISS rows"), {C: 1}),
    ("--chunk", dict(type=int, help="queries per ranking call (12 bytes per pair)"), {C: 500}),
    ("--torch-queries", dict(type=int, help="torch reference row queries; 0: none"), {C: 1000}),
    ("--no-rank", dict(action="store_true", help="skip the nac_fast full-ranking row"), {C: False}),
    ("--no-faiss", dict(action="store_true"), {C: False, I: False}),
    ("--map-queries", dict(type=int, help="queries of the mAP@all rows (index: 0 = skip)"),
     {I: 10000, G_: 10000}),
    ("--map-repeats", dict(type=int), {I: 3}),
    ("--k", dict(type=int), {I: 10, G_: 10}),
    ("--device", dict(choices=("cuda", "cpu"), help="cpu: the Triton engine under "
                      "TRITON_INTERPRET=1 (plumbing only)"), {G_: "cuda"}),
    ("--tiny", dict(action="store_true", help="toy sizes (CI)"), {G_: False}),
    ("--check-queries", dict(type=int, help="queries of each GPU row checked against C++"),
     {G_: 256}),
    ("--map-sizes", dict(help="gallery sizes of the mAP rows"), {G_: "50000,1000000"}),
    ("--cpu-map-queries", dict(help="C++ mAP row queries per --map-sizes size (0: no row)"),
     {G_: "10000,2000"}),
    ("--index-sizes", dict(help="codes of the top-k rows"), {G_: "1000000,100000000"}),
    ("--index-queries", dict(type=int), {G_: 1000}),
    ("--cpu-topk-queries", dict(help="CPU index row queries per --index-sizes size (0: no row)"),
     {G_: "1000,16"}),
    ("--gpu-repeats", dict(type=int), {G_: 5}),
    ("--budget-s", dict(type=float, help="skip rows starting after this many seconds"), {G_: 70.0}),
    ("--only", dict(choices=("all", "map", "topk")), {G_: "all"}),
    ("--profile-run", dict(action="store_true", help="one tensor-core search of the last "
                           "--index-sizes size and nothing else (Nsight Compute)"), {G_: False}),
    ("--summary-out", dict(help="write the rows in one line here (the GPU suite's stage detail)"),
     {G_: ""}),
    ("--threads", dict(type=int), dict.fromkeys(ALL, torch.get_num_threads())),
    ("--seed", dict(type=int), dict.fromkeys(ALL, 0)),
    ("--csv", dict(help="CSV to append to ('' = none)"), {
        r: os.path.join(RESULTS, f) for r, f in ((C, "hamming_cpu.csv"), (I, "index_cpu.csv"),
                                                 (G_, "hamming_gpu.csv"))}),
    ("--note", dict(help="free text stored in the CSV rows"), dict.fromkeys(ALL, "")),
]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(fn, repeats: int, device=None):
    """Wall seconds (median, p20, p80) of `repeats` runs, the largest resident-set growth (MB, 1 ms
    sampling) and, on a CUDA device (synchronised around each run), the allocator's peak above
    what was allocated before."""
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times, out, peak = [], None, 0.0
    for _ in range(repeats):
        stop, box = threading.Event(), [_rss()] * 2  # [base, peak]

        def sample():
            while not stop.wait(0.001):
                box[1] = max(box[1], _rss())
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        stop.set()
        sampler.join()
        peak = max(peak, (max(box[1], _rss()) - box[0]) / 2 ** 20)
    med, p20, p80 = quantiles(times)
    return {"median_s": med, "p20_s": p20, "p80_s": p80, "peak_rss_mb": peak, "repeats": repeats,
            "peak_gpu_mib": ((torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
                             if cuda else 0.0)}, out


def make_data(q: int, g: int, bits: int, classes: int, flip: float, seed: int):
    """(query codes, labels, gallery codes, labels), +-1 floats around random class prototypes."""
    gen = torch.Generator().manual_seed(seed)
    protos = torch.randint(0, 2, (classes, bits), generator=gen).float() * 2 - 1

    def draw(n):
        lab = torch.randint(0, classes, (n,), generator=gen)
        return protos[lab] * torch.where(torch.rand(n, bits, generator=gen) < flip, -1.0, 1.0), lab
    return (*draw(q), *draw(g))


def np_ap_from_ranking(idx: np.ndarray, ql: np.ndarray, gl: np.ndarray) -> np.ndarray:
    """AP of each row of a ranking (Q, G) of gallery indices; NaN without relevant items."""
    rel = gl[idx] == ql[:, None]
    nrel = rel.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(nrel > 0, (np.cumsum(rel, axis=1) / np.arange(1, idx.shape[1] + 1) * rel
                                   ).sum(1) / nrel, np.nan)


def cpu_engine_and_faiss(ap, args):
    """(the --isa level the C++ rows run, with "(forced)" when not auto; faiss or None); exits when
    the C++ engine is missing; a level this CPU lacks is --isa's usage error."""
    from nac_fast.ops import search
    why = dispatch.available_backends("cpu", op="hamming", reasons=True)["cpu"]
    if why is not None:
        sys.exit(f"the nac_fast hamming C++ kernel is not available: {why}")
    runs = search.cpu_isa_levels()
    if args.isa == "auto":
        os.environ.pop(search.HAMMING_ISA_ENV, None)
        isa = runs[-1]
    elif args.isa not in runs:
        ap.error(f"--isa {args.isa}: this CPU runs only {', '.join(runs)}")
    else:
        os.environ[search.HAMMING_ISA_ENV] = args.isa
        isa = f"{args.isa} (forced; best here: {runs[-1]})"
    if args.no_faiss:
        return isa, None
    try:
        import faiss
        faiss.omp_set_num_threads(args.threads)
        return isa, faiss
    except ImportError:
        print("faiss not installed (pip install faiss-cpu): FAISS rows skipped", file=sys.stderr)
        return isa, None


def write_csv(args, rows, fields, **base):
    """Append rows (with the run's columns `base`; --note joined to each row's note) to --csv; a
    CSV with another header is rewritten with `fields` first (common.append_rows)."""
    if args.csv:
        run = run_fields(device_name("cpu").rsplit(" x", 1)[0])
        base = {**run, "cpu": run["device"], "git_commit": run["commit"], "threads": args.threads,
                **base}
        full = [{**base, **r, "note": "; ".join(x for x in (r.get("note", ""), args.note) if x)}
                for r in rows]
        append_rows(args.csv, [{f: r.get(f, "") for f in fields} for r in full], fields)
        print(f"  appended {len(rows)} rows to {args.csv}")


def report(rows, row, *extra) -> None:
    """Append `row` to `rows` and print it: method, queries, median [p20, p80], the extra texts."""
    rows.append(row)
    print(f"  {row['method']:<28} {row['queries']:>6} q  median {row['median_s']:9.6f} s "
          f"[{row['p20_s']:.6f}, {row['p80_s']:.6f}]  " + "  ".join(x for x in extra if x),
          flush=True)


def _chunks(n, chunk):
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


# ---- The CPU protocol: mAP@all and full rankings against FAISS and the torch reference

def run_cpu(args, ap):
    isa, faiss = cpu_engine_and_faiss(ap, args)
    Q, G, D, ch = args.queries, args.gallery, args.bits, _chunks(args.queries, args.chunk)
    qc, ql, gc, gl = make_data(Q, G, D, args.classes, args.flip, args.seed)
    rows = []

    def add(method, queries, stats, m, note=""):
        report(rows, {"method": method, "queries": queries, **stats, "map": m, "note": note},
               f"peak +{stats['peak_rss_mb']:.1f} MB", f"mAP {m if m is None else f'{m:.6f}'}")

    print(f"Hamming engine, {Q} queries x {G} gallery x {D} bits, {args.classes} classes, "
          f"flip {args.flip}, {args.threads} threads, C++ engine level {isa}", flush=True)
    nac_stats, (nac_map, used) = timed(lambda: H.mean_average_precision(
        qc, ql, gc, gl, backend="cpu", return_num_queries=True), args.repeats)
    add("nac_fast cpu mAP@all", Q, nac_stats, nac_map, f"{used} queries with relevant items")
    qp, gp = H.pack_codes(qc), H.pack_codes(gc)
    if not args.no_rank:  # the output FAISS produces
        stats, _ = timed(lambda: [H.rank(H.PackedCodes(qp.words[s:e], D), gp, backend="cpu")
                                  for s, e in ch], args.slow_repeats)
        add("nac_fast cpu full ranking", Q, stats, None,
            f"packed codes, chunks of {args.chunk} queries")
    summary = {"bench": "hamming_cpu", "isa": isa, "queries": Q, "gallery": G, "bits": D,
               "threads": args.threads, "map": nac_map, "nac_map_median_s": nac_stats["median_s"],
               "nac_map_peak_rss_mb": round(nac_stats["peak_rss_mb"], 1),
               "target_s": 5.0, "meets_target": nac_stats["median_s"] <= 5.0}
    if faiss is not None:
        index = faiss.IndexBinaryFlat(gp.words.shape[1] * 64)  # zero padding bits on both sides
        index.add(gp.words.numpy().view(np.uint8))
        qbytes, ql_np, gl_np = qp.words.numpy().view(np.uint8), ql.numpy(), gl.numpy()
        index.use_heap = False  # its counting-sort path: its faster full ranking
        faiss_rank, _ = timed(lambda: [index.search(qbytes[s:e], G) for s, e in ch],
                              args.slow_repeats)
        add("faiss IndexBinaryFlat ranking", Q, faiss_rank, None, "use_heap=False")
        faiss_map_stats, faiss_map = timed(lambda: float(np.nanmean(np.concatenate([
            np_ap_from_ranking(index.search(qbytes[s:e], G)[1], ql_np[s:e], gl_np)
            for s, e in ch]))), args.slow_repeats)
        add("faiss ranking + numpy AP", Q, faiss_map_stats, faiss_map, "use_heap=False")
        summary.update(faiss_rank_median_s=faiss_rank["median_s"],
                       faiss_map_median_s=faiss_map_stats["median_s"],
                       speedup_vs_faiss_rank=faiss_rank["median_s"] / nac_stats["median_s"])
    if args.torch_queries:
        nq = min(args.torch_queries, Q)
        torch_stats, m = timed(lambda: H.mean_average_precision(qc[:nq], ql[:nq], gc, gl,
                                                                backend="reference"), 1)
        m_cpu = H.mean_average_precision(qc[:nq], ql[:nq], gc, gl, backend="cpu")
        add("torch reference mAP@all", nq, torch_stats, m,
            f"subset of the queries; cpu backend on the same queries: {m_cpu:.12f}")
        if abs(m - m_cpu) > 1e-9:
            sys.exit(f"reference and cpu backends disagree: {m} vs {m_cpu}")
        summary.update(torch_ref_queries=nq, torch_ref_s=torch_stats["median_s"])
    if faiss is not None and abs(faiss_map - nac_map) > 1e-9:
        print(f"  note: mAP from the FAISS ranking differs by {faiss_map - nac_map:.3g} "
              "(its tie order is not by gallery index)")
    write_csv(args, rows, CSV_FIELDS, faiss=getattr(faiss, "__version__", ""), gallery=G, bits=D,
              isa=isa)
    print(json.dumps(summary))
    return 0


# ---- --index: HashIndex.search against FAISS's IndexBinaryFlat, and mAP@all at 1M codes (issue 25)

def run_index(args, ap):
    isa, faiss = cpu_engine_and_faiss(ap, args)
    G, D, k = args.gallery, args.bits, args.k
    qc, ql, gc, gl = make_data(max(args.queries, args.map_queries), G, D, 10, args.flip, args.seed)
    qb, gb = qc > 0, gc > 0
    del qc, gc
    index = H.HashIndex(D)
    index.add(gb)
    bytes_per_code = index.codes.words.element_size() * index.codes.words.shape[1]
    qp = H.pack_codes(qb[:args.queries])
    rows = []

    def run(method, queries, k, fn, repeats, goal=None, note=""):
        l0 = os.getloadavg()[0]  # the machine is shared: a figure under load is slower than code
        stats, out = timed(fn, repeats)
        row = {"method": method, "queries": queries, "k": k, **stats, "load1_before": l0,
               "load1_after": os.getloadavg()[0], "gpairs_per_s": queries * G / stats[
                   "median_s"] / 1e9, "goal_s": goal,
               "meets_goal": (stats["median_s"] <= goal) if goal else None, "note": note}
        report(rows, row, f"x {G} k={k}", f"{row['gpairs_per_s']:.2f} G pairs/s",
               f"load {l0:.1f} -> {row['load1_after']:.1f}", f"goal {goal} s" if goal else "")
        return row, out

    print(f"HashIndex benchmark: {G} codes of {D} bits ({bytes_per_code} bytes each), "
          f"{args.threads} threads, C++ engine level {isa}, load {os.getloadavg()[0]:.1f}",
          flush=True)
    index.search(qp, k)  # warm-up (page faults of the output, thread pool start)
    top, (Dn, _) = run("HashIndex.search", args.queries, k, lambda: index.search(qp, k),
                       args.repeats, goal=0.3)
    summary = {"bench": "index_cpu", "isa": isa, "gallery": G, "bits": D, "threads": args.threads,
               "topk_median_s": top["median_s"], "topk_goal_s": 0.3, "map_median_s": None,
               "map_goal_s": 5.0}
    if faiss is not None:
        fx = faiss.IndexBinaryFlat(index.codes.words.shape[1] * 64)
        fx.add(index.codes.words.numpy().view(np.uint8))
        qbytes = qp.words.numpy().view(np.uint8)
        fx.search(qbytes[:10], k)
        row, (fD, _) = run("faiss IndexBinaryFlat.search", args.queries, k,
                           lambda: fx.search(qbytes, k), args.repeats)
        same = bool(np.array_equal(fD, Dn.numpy()))
        row["note"] = f"faiss {faiss.__version__}; same distances as HashIndex: {same}"
        if not same:
            sys.exit("FAISS and HashIndex disagree on the distances")
        summary["faiss_topk_median_s"] = row["median_s"]
    if args.map_queries:
        Qm = args.map_queries
        row, m = run("nac_fast mAP@all", Qm, G, lambda: H.mean_average_precision(
            qb[:Qm], ql[:Qm], gb, gl, backend="cpu"), args.map_repeats, goal=5.0)
        row["note"] = f"mAP {m:.6f}"
        summary["map_median_s"] = row["median_s"]
    write_csv(args, rows, INDEX_FIELDS, faiss=getattr(faiss, "__version__", ""), gallery=G, bits=D,
              bytes_per_code=bytes_per_code, isa=isa)
    print(json.dumps({**summary, "load1": os.getloadavg()[0]}))
    return 0


# ---- --gpu (issues 39 and 56): the GPU engines, checked against the C++ engine

def _flips(m, bits, p, gen, device):
    from nac_fast.ops.codes import pack_bits_torch
    return pack_bits_torch(torch.rand((m, bits), generator=gen, device=device) < p)


def packed_class_codes(n, bits, protos, classes, flip, gen, device, chunk=1 << 18):
    """(words (n, W) int64, labels (n,)) made on `device`: each code its class prototype with
    every bit flipped with probability `flip` (make_data's codes, packed without a +-1 copy)."""
    labels = torch.randint(0, classes, (n,), generator=gen, device=device)
    words = torch.empty((n, protos.shape[1]), dtype=torch.int64, device=device)
    for s, e in _chunks(n, chunk):
        words[s:e] = protos[labels[s:e]] ^ _flips(e - s, bits, flip, gen, device)
    return words, labels


def random_codes(n, bits, gen, device, chunk=1 << 24):
    """(n, W) uniformly random codes, padding bits 0, made on `device` in chunks."""
    W = -(-bits // 64)
    out = torch.empty((n, W), dtype=torch.int64, device=device)
    for s, e in _chunks(n, chunk):
        out[s:e] = torch.randint(-2 ** 63, 2 ** 63 - 1, (e - s, W), dtype=torch.int64,
                                 generator=gen, device=device)
    if bits % 64:
        out[:, -1] &= (1 << (bits % 64)) - 1
    return out


def topk_codes(G, Q, bits, gen, device):
    """(gallery, queries): G random codes, and Q of them with 10% of their bits flipped."""
    gw = random_codes(G, bits, gen, device)
    pick = torch.randint(0, G, (Q,), generator=gen, device=device)
    return gw, gw[pick] ^ _flips(Q, bits, 0.1, gen, device)


def _ap_check(qw, ql, gw, gl, bits, n, engine="triton"):
    """Per-query AP of a GPU engine against the C++ engine on the first n queries."""
    P = H.PackedCodes
    ap, nrel = H.average_precision(P(qw[:n], bits), ql[:n], P(gw, bits), gl, backend=engine)
    wap, wnrel = H.average_precision(P(qw[:n].cpu(), bits), ql[:n].cpu(), P(gw.cpu(), bits),
                                     gl.cpu(), backend="cpu")
    ap, nrel, ok = ap.cpu(), nrel.cpu(), ~torch.isnan(wap)
    same_nan = bool(torch.equal(torch.isnan(ap), torch.isnan(wap)))
    rel = float(((ap[ok] - wap[ok]).abs() / wap[ok].abs().clamp(min=1e-300)).max()) if ok.any() \
        else 0.0
    good = same_nan and bool(torch.equal(nrel, wnrel)) and rel <= 1e-12
    return good, f"{'ok' if good else 'FAIL'}: AP of {n} queries vs the C++ engine, max rel " \
                 f"diff {rel:.1e}" + ("" if same_nan else ", NaN pattern differs")


def run_gpu(args, ap):
    """mAP@all at --map-sizes and top-k at --index-sizes by every engine the device has (top-k:
    the Triton engine's popcount and tensor-core filters, then cuda), the C++ engine's rows beside
    them, each row's int8 floor and goal."""
    import triton
    if args.tiny:
        vars(args).update(TINY)
    map_sizes, cpu_map_q, idx_sizes, cpu_topk_q = (int_list(ap, f, getattr(args, f[2:].replace(
        "-", "_")), least) for f, least in (("--map-sizes", 1), ("--cpu-map-queries", 0),
                                            ("--index-sizes", 1), ("--cpu-topk-queries", 0)))
    if not idx_sizes:
        ap.error("--index-sizes: give at least one gallery size")
    if len(cpu_map_q) != len(map_sizes) or len(cpu_topk_q) != len(idx_sizes):
        ap.error("--cpu-map-queries / --cpu-topk-queries: one value per --map-sizes / "
                 "--index-sizes size")
    if args.k > min(idx_sizes):
        ap.error(f"--k: at most the smallest gallery ({min(idx_sizes)}), got {args.k}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible (--device cpu runs the interpreter)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu: set TRITON_INTERPRET=1 (the Triton engine runs under the "
                 "interpreter on CPU tensors)")
    reasons = dispatch.available_backends(args.device, op="hamming", reasons=True)
    for name, why in (("triton", reasons["triton"]),
                      ("C++", dispatch.available_backends("cpu", op="hamming",
                                                          reasons=True)["cpu"])):
        if why is not None:
            sys.exit(f"the {name} Hamming engine is not available: {why}")
    cuda_engine = device.type == "cuda" and reasons["cuda"] is None
    if device.type == "cuda" and not cuda_engine:
        print(f"  no 'cuda' engine rows: {reasons['cuda']}", flush=True)
    map_engines = ["triton"] + (["cuda"] if cuda_engine else [])
    # top-k engines: (row name, HashIndex backend, topk_method); the first is the others' check
    topk_engines = [("triton-popc", "triton", "popc"), ("triton-mma", "triton", "mma")] + \
        ([("cuda", "cuda", "auto")] if cuda_engine else [])
    P, D, k, W = H.PackedCodes, args.bits, args.k, -(-args.bits // 64)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "interpreter"
    if args.profile_run:  # the hamming-tc stage's Nsight Compute target: nothing but the filter
        G, Q = idx_sizes[-1], args.index_queries
        gw, qw = topk_codes(G, Q, D, gen, device)
        index = H.HashIndex(D, device=device, backend="triton", topk_method="mma")
        index.add(P(gw, D))
        index.search(P(qw, D), k)
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"profile run: {Q} queries, top-{k} of {G:,} codes (method mma)")
        return 0
    print(f"GPU Hamming engines vs the C++ engine ({args.threads} threads): {gpu_name}, {D} bits, "
          f"triton {triton.__version__}, torch {torch.__version__}", flush=True)
    t_start = time.perf_counter()
    rows, failures, skipped, cpu_times = [], [], [], {}

    def over_budget(what) -> bool:
        if time.perf_counter() - t_start > args.budget_s:
            skipped.append(what)
            print(f"  skipped (past --budget-s {args.budget_s:g} s): {what}", flush=True)
            return True
        return False

    def add(method, engine, queries, G, fn, repeats, check="", note=""):
        """Time fn (on the CPU for the C++ engine), add its row; fn's output."""
        stats, out = timed(fn, repeats, cpu if engine == "cpu" else device)
        goal = GOALS.get((method, G, queries)) \
            if engine != "cpu" and device.type == "cuda" and D == 128 else None
        key, speed = (method, G, queries), ""
        if engine == "cpu":
            cpu_times[key] = stats["median_s"]
        elif key in cpu_times:
            speed = cpu_times[key] / stats["median_s"]
        bound = queries * G * 64 * W * 2 / INT8_OPS
        row = dict(stats, method=method, engine=engine, queries=queries, gallery=G, bits=D,
                   device="cpu" if engine == "cpu" else dev, k=k if method == "topk" else "",
                   peak_gpu_mib=round(stats["peak_gpu_mib"], 1),
                   peak_rss_mb=round(stats["peak_rss_mb"], 1),
                   map=out if method == "map_all" else None, speedup_vs_cpu=speed,
                   bound_s=bound, of_bound=bound / stats["median_s"], goal_s=goal,
                   meets_goal=(stats["median_s"] <= goal) if goal else "", check=check, note=note)
        report(rows, row, f"{engine} x {G:,}", f"GPU peak {row['peak_gpu_mib']:.1f} MiB",
               f"x{speed:.3g} vs cpu" if speed else "", f"int8 floor {bound:.2e} s",
               f"goal {goal} s" if goal else "", check)
        return out

    dev, cpu = str(device), torch.device("cpu")
    if args.only in ("all", "map"):  # ---- mAP@all ----
        protos = random_codes(args.classes, D, gen, device)
        Q = args.map_queries
        qw, ql = packed_class_codes(Q, D, protos, args.classes, args.flip, gen, device)
        for G, nq_cpu in zip(map_sizes, cpu_map_q):
            if over_budget(f"map_all x {G}"):
                continue
            gw, gl = packed_class_codes(G, D, protos, args.classes, args.flip, gen, device)
            checks = {}
            for eng in map_engines:  # compiles too
                good, checks[eng] = _ap_check(qw, ql, gw, gl, D,
                                              min(args.check_queries, Q), eng)
                if not good:
                    failures.append(f"map_all {eng} x {G}: {checks[eng]}")
            ns = [Q] + ([min(nq_cpu, Q)] if nq_cpu and min(nq_cpu, Q) != Q else [])
            if nq_cpu:
                n = ns[-1]
                qc, qlc, gc, glc = qw[:n].cpu(), ql[:n].cpu(), gw.cpu(), gl.cpu()
                add("map_all", "cpu", n, G, lambda: H.mean_average_precision(
                    P(qc, D), qlc, P(gc, D), glc, backend="cpu"), 3 if G <= 100_000 else 2,
                    note=f"{args.threads} threads")
                del qc, gc
            for eng in map_engines:
                for n in ns:  # the CPU row's query count too: the like-for-like pair
                    add("map_all", eng, n, G, lambda: H.mean_average_precision(
                        P(qw[:n], D), ql[:n], P(gw, D), gl, backend=eng), args.gpu_repeats,
                        check=checks[eng])
            del gw, gl
    if args.only in ("all", "topk"):  # ---- top-k: one index, each engine
        for G, nq_cpu in zip(idx_sizes, cpu_topk_q):
            if over_budget(f"topk x {G}"):
                continue
            Q = args.index_queries
            gw, qw = topk_codes(G, Q, D, gen, device)
            nc = min(args.check_queries, Q, nq_cpu or args.check_queries)
            cpu_index = H.HashIndex(D)
            cpu_index.add(P(gw.cpu(), D))
            qc = qw.cpu()
            Dc, Ic = cpu_index.search(P(qc[:nc], D), k)
            index = H.HashIndex(D, device=device, backend="triton")
            index.add(P(gw, D))
            del gw
            if nq_cpu:
                n = min(nq_cpu, Q)
                cpu_index.search(P(qc[:2], D), k)
                add("topk", "cpu", n, G, lambda: cpu_index.search(P(qc[:n], D), k),
                    3 if G <= 10_000_000 else 1,
                    note=f"HashIndex on the CPU, {args.threads} threads")
            del cpu_index
            first = None
            for name, backend, method in topk_engines:
                index.backend, index.topk_method = backend, method
                Dg, Ig = index.search(P(qw, D), k)  # compiles, outside the clock
                good = bool(torch.equal(Dg[:nc].cpu(), Dc) and torch.equal(Ig[:nc].cpu(), Ic))
                if first is None:
                    first = (name, Dg, Ig)
                good = good and bool(torch.equal(Dg, first[1]) and torch.equal(Ig, first[2]))
                check = (f"ok: distances and indices of {nc} queries equal to the C++ engine's"
                         + ("" if name == first[0] else f", all {Q} to {first[0]}'s") if good
                         else f"FAIL: top-{k} differs from the C++ engine's ({nc} queries) or "
                              f"{first[0]}'s")
                if not good:
                    failures.append(f"topk {name} x {G}: {check}")
                if nq_cpu and (n := min(nq_cpu, Q)) != Q:  # the CPU row's queries: like for like
                    add("topk", name, n, G, lambda: index.search(P(qw[:n], D), k),
                        args.gpu_repeats, check=check)
                add("topk", name, Q, G, lambda: index.search(P(qw, D), k), args.gpu_repeats,
                    check=check, note="HashIndex search, queries = index codes with 10% of bits "
                    "flipped")
            del index, first, Dg, Ig, qc
            if device.type == "cuda":
                torch.cuda.empty_cache()
    write_csv(args, rows, GPU_FIELDS, gpu=gpu_name, triton=triton.__version__)
    for r in rows:  # each row named once, with its goal's verdict
        r["what"] = f"{r['method']} {r['engine']} {r['queries']}x{r['gallery']}"
        r["verdict"] = "" if not r["goal_s"] else ("MET" if r["meets_goal"] else "MISSED")
    if args.summary_out:  # the rows in one line (the GPU suite's stage detail)
        write_text(args.summary_out, "; ".join(
            f"{r['what']} {r['median_s'] * 1e3:.3g} ms"
            + (f" goal {r['goal_s']} {r['verdict']}" if r["goal_s"] else "") for r in rows) + "\n")
    print(json.dumps({"bench": "hamming_gpu", "device": dev,
                      "gpu": gpu_name, "bits": D, "rows": len(rows), "skipped": skipped,
                      "failures": failures, "elapsed_s": round(time.perf_counter() - t_start, 1),
                      "goals": {r["what"]: bool(r["meets_goal"]) for r in rows if r["goal_s"]}}))
    return 1 if failures else 0


def parse_args(argv=None):
    """(parser, args): the run's options filled with its defaults; usage errors (exit status 2)
    before any measurement: an option of another run, counts below their least value, a bit-flip
    probability outside [0, 0.5], an output file that could not be written."""
    from nac_fast.ops.search import ISA_LEVELS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    runs = ap.add_mutually_exclusive_group()
    runs.add_argument("--index", action="store_true", help="HashIndex top-k and mAP@all at 1M")
    runs.add_argument("--gpu", action="store_true", help="the GPU engines beside the C++ engine "
                      "and their goals (issues 39, 56)")
    ap.add_argument("--isa", choices=("auto",) + ISA_LEVELS, help="force the C++ engine's "
                    "instruction-set level (NAC_FAST_HAMMING_ISA); auto = the best this CPU has")
    for flag, kw, _ in OPTIONS:
        ap.add_argument(flag, default=None, **kw)
    args = ap.parse_args(argv)
    run = "index" if args.index else "gpu" if args.gpu else "cpu"
    owners = {flag: modes for flag, _, modes in OPTIONS}
    owners["--isa"] = {C: "auto", I: "auto"}
    given = [f for f, modes in owners.items()
             if run not in modes and getattr(args, f[2:].replace("-", "_")) not in (None, False)]
    if given:  # they would be silently ignored
        names = {C: "CPU protocol (no run flag)", I: "--index", G_: "--gpu"}
        ap.error(f"{', '.join(given)}: options of the " + " / ".join(
            names[m] for m in names if any(m in owners[f] for f in given))
            + f" run, not of the {names[run]} run")
    for flag, modes in owners.items():
        dest = flag[2:].replace("-", "_")
        if run in modes and getattr(args, dest) is None:
            setattr(args, dest, modes[run])
    least = {"--queries": 1, "--gallery": 1, "--bits": 1, "--classes": 1, "--repeats": 1,
             "--slow-repeats": 1, "--chunk": 1, "--torch-queries": 0,
             "--threads": 1, "--map-queries": 0 if run == "index" else 1, "--map-repeats": 1,
             "--index-queries": 1, "--k": 1, "--check-queries": 0, "--gpu-repeats": 1}
    check_least(ap, args, {f: v for f, v in least.items() if run in owners[f]})
    if args.flip is not None and not 0.0 <= args.flip <= 0.5:  # 0.5: codes unrelated to the class
        ap.error(f"--flip: a bit-flip probability in [0, 0.5], got {args.flip}")
    if args.csv:
        check_output_file(ap, "--csv", args.csv)
    if args.summary_out:
        check_output_file(ap, "--summary-out", args.summary_out, csv_file=False)
    return ap, args, run


def main(argv=None):
    ap, args, run = parse_args(argv)
    torch.set_num_threads(args.threads)
    return {"cpu": run_cpu, "index": run_index, "gpu": run_gpu}[run](args, ap)


if __name__ == "__main__":
    sys.exit(main())
