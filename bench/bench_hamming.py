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

--gpu: the GPU engine (issue 39) beside the C++ engine, in one command on one machine:

    python bench/bench_hamming.py --gpu --csv RESULTS/hamming_gpu.csv        # an H100: < 75 s
    TRITON_INTERPRET=1 python bench/bench_hamming.py --gpu --device cpu --tiny --csv X.csv
                                                       # CI: the same code on toy sizes, CPU tensors

  map_all (gpu)      mAP@all, engine (column "engine") "triton", then "cuda" on a GPU where the
                     extension has its CUDA kernels (csrc/hamming_cuda.cu): --map-queries queries x
                     each of --map-sizes codes
                     (bench's class-prototype codes and labels, made on the device); the codes are
                     on the GPU before the clock starts, the score comes back to the host in it
  map_all (gpu)      the same on the CPU row's queries: the like-for-like pair of the ratio
  map_all (cpu)      the C++ engine on --cpu-map-queries queries (all of them up to 50k codes):
                     measured rows with their own query count, never scaled
  topk (gpu)         HashIndex(device="cuda").search(queries, k): --index-queries queries, each a
                     code of the index with 10% of its bits flipped, over --index-sizes uniformly
                     random codes (made on the GPU); the index is on the GPU before the clock
  topk (cpu)         the same search with a CPU index, on --cpu-topk-queries queries (a subset at
                     100M codes)
  topk-variant       the GPU search at the first index size with other block configurations and
                     sample ratios (--topk-variants): data for choosing the shipped setting
  topk (gpu, cuda)   the same index searched by the "cuda" engine (HashIndex backend "cuda"),
                     checked against the C++ engine and equal to the triton engine's answer

Every GPU row is checked against the C++ engine on --check-queries queries (per-query AP to
1e-12 and equal counts of relevant items; top-k distances and indices equal), column "check"; a
failed check fails the command.  Peak GPU memory: torch's allocator, above what was allocated
before the call.  Rows whose start would pass --budget-s seconds are skipped, said so.  Appends
to --csv, prints a table and one JSON line last.  --device cpu (with TRITON_INTERPRET=1): the
Triton engine under the interpreter, which proves the plumbing and nothing about speed (the
"cuda" engine runs on CUDA tensors only: no rows).
"""
from __future__ import annotations

import argparse
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
from common import append_rows, check_flip, check_least, check_output_file  # noqa: E402

CSV_PATH = os.path.join(ROOT, "bench", "results", "hamming_cpu.csv")
CSV_FIELDS = ["timestamp", "host", "cpu", "threads", "torch", "faiss", "git_commit", "method",
              "queries", "gallery", "bits", "repeats", "median_s", "p20_s", "p80_s",
              "peak_rss_mb", "map", "isa", "note"]


def add_isa_flag(ap) -> None:
    """--isa: the C++ engine's instruction-set level for every row (NAC_FAST_HAMMING_ISA,
    nac_fast/ops/search.py), shared with bench_index.py."""
    from nac_fast.ops.search import ISA_LEVELS
    ap.add_argument("--isa", default="auto", choices=("auto",) + ISA_LEVELS,
                    help="force the C++ engine's instruction-set level (NAC_FAST_HAMMING_ISA); "
                    "auto = the best this CPU has")


def apply_isa(ap, isa: str) -> str:
    """Set NAC_FAST_HAMMING_ISA for --isa (a level the CPU lacks: the flag's error, exit status 2)
    and return the level the C++ rows run: its name, with "(forced)" when not auto."""
    from nac_fast.ops import search
    runs = search.cpu_isa_levels()
    if isa == "auto":
        os.environ.pop(search.HAMMING_ISA_ENV, None)
        return runs[-1]
    if isa not in runs:
        ap.error(f"--isa {isa}: this CPU runs only {', '.join(runs)}")
    os.environ[search.HAMMING_ISA_ENV] = isa
    return f"{isa} (forced; best here: {runs[-1]})"


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


# ------------------------------------------------------------------------------------------------
# --gpu: the GPU engine beside the C++ engine (issue 39)
# ------------------------------------------------------------------------------------------------

GPU_CSV_PATH = os.path.join(ROOT, "bench", "results", "hamming_gpu.csv")
GPU_FIELDS = ["timestamp", "host", "cpu", "gpu", "threads", "torch", "triton", "git_commit",
              "method", "engine", "device", "queries", "gallery", "bits", "k", "repeats",
              "median_s", "p20_s", "p80_s", "peak_gpu_mib", "peak_rss_mb", "map",
              "speedup_vs_cpu", "goal_s", "meets_goal", "check", "note"]
GOALS = {("map_all", 1_000_000, 10000): 0.1, ("topk", 1_000_000, 1000): 0.002,
         ("topk", 100_000_000, 1000): 0.2}  # issue 39, H100, 128 bits
TINY = dict(map_sizes="200,600", map_queries=33, cpu_map_queries="33,16",
            index_sizes="4200,9000", index_queries=9, cpu_topk_queries="9,4",
            check_queries=4, gpu_repeats=1, k=10, topk_variants="32x64x1/8")


def _ints(text: str, name: str) -> list:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{name}: a comma list of integers, got {text!r}") from None


def packed_class_codes(n, bits, protos, classes, flip, gen, device, chunk=1 << 18):
    """(words (n, W) int64, labels (n,)) made on `device`: each code its class prototype with
    every bit flipped with probability `flip` (make_data's codes, packed without a +-1 copy)."""
    from nac_fast.ops.codes import pack_bits_torch
    W = protos.shape[1]
    labels = torch.randint(0, classes, (n,), generator=gen, device=device)
    words = torch.empty((n, W), dtype=torch.int64, device=device)
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        flips = torch.rand((m, bits), generator=gen, device=device) < flip
        words[s:s + m] = protos[labels[s:s + m]] ^ pack_bits_torch(flips)
    return words, labels


def random_codes(n, bits, gen, device, chunk=1 << 24):
    """(n, W) uniformly random codes, padding bits 0, made on `device` in chunks."""
    W = -(-bits // 64)
    out = torch.empty((n, W), dtype=torch.int64, device=device)
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        out[s:s + m] = torch.randint(-2 ** 63, 2 ** 63 - 1, (m, W), dtype=torch.int64,
                                     generator=gen, device=device)
    if bits % 64:
        out[:, -1] &= (1 << (bits % 64)) - 1
    return out


def flip_bits(words, bits, p, gen):
    from nac_fast.ops.codes import pack_bits_torch
    flips = torch.rand((words.shape[0], bits), generator=gen, device=words.device) < p
    return words ^ pack_bits_torch(flips)


def gpu_timed(fn, repeats: int, device):
    """timed() with the device synchronised around each run and the allocator's peak above the
    memory allocated before (MiB; 0 on the CPU)."""
    cuda = device.type == "cuda"

    def run():
        out = fn()
        if cuda:
            torch.cuda.synchronize(device)
        return out
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    stats, out = timed(run, repeats)
    stats["peak_gpu_mib"] = ((torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
                             if cuda else 0.0)
    return stats, out


def profile_kernels(fn, device, path: str, what: str, top: int = 15) -> None:
    """Append to `path` where one call of `fn` spends its time: torch.profiler's table of the
    call's kernels and ops (device time first; on a GPU, the sorting of the filter pass against
    the sample levels, the candidate top-k and the fills), and the wall time of the call."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=top)
    with open(path, "a") as f:
        f.write(f"== {what}: {wall * 1e3:.3f} ms wall (profiled)\n{table}\n")
    print(f"  profile of {what} appended to {path}", flush=True)


def _ap_check(H, qw, ql, gw, gl, bits, n, device, engine="triton"):
    """Per-query AP of a GPU engine against the C++ engine on the first n queries."""
    P = H.PackedCodes
    ap, nrel = H.average_precision(P(qw[:n], bits), ql[:n], P(gw, bits), gl, backend=engine)
    wap, wnrel = H.average_precision(P(qw[:n].cpu(), bits), ql[:n].cpu(), P(gw.cpu(), bits),
                                     gl.cpu(), backend="cpu")
    ap, nrel = ap.cpu(), nrel.cpu()
    same_nan = bool(torch.equal(torch.isnan(ap), torch.isnan(wap)))
    ok = ~torch.isnan(wap)
    rel = float(((ap[ok] - wap[ok]).abs() / wap[ok].abs().clamp(min=1e-300)).max()) if ok.any() \
        else 0.0
    good = same_nan and bool(torch.equal(nrel, wnrel)) and rel <= 1e-12
    return good, f"{'ok' if good else 'FAIL'}: AP of {n} queries vs the C++ engine, max rel " \
                 f"diff {rel:.1e}" + ("" if same_nan else ", NaN pattern differs")


def _ints_variants(text: str) -> list:
    """'BQxBGxWARPS/RATIO,...' -> [(bq, bg, warps, ratio), ...]."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            blocks, ratio = item.split("/")
            bq, bg, warps = (int(x) for x in blocks.split("x"))
            out.append((bq, bg, warps, int(ratio)))
        except ValueError:
            raise SystemExit(f"--topk-variants: BQxBGxWARPS/RATIO items, got {item!r}") from None
    return out


def _variant_name(v=None, kind="gpu") -> str:
    from nac_fast.kernels import hamming_triton as HT
    if v is None:
        bq, bg, warps = HT.TOPK_CONFIG[kind]
        v = (bq, bg, warps, HT.SAMPLE_RATIO)
    return f"top-k setting {v[0]}x{v[1]}x{v[2]}/{v[3]} (BQxBGxwarps/sample ratio)"


class _variant:
    """The GPU top-k's block configuration and sample ratio set to `v` inside the block."""

    def __init__(self, v, device):
        from nac_fast.kernels import hamming_triton as HT
        self.HT, self.v = HT, v
        self.kind = "gpu" if device.type == "cuda" else "interpreter"

    def __enter__(self):
        self.saved = (self.HT.TOPK_CONFIG[self.kind], self.HT.SAMPLE_RATIO)
        self.HT.TOPK_CONFIG[self.kind] = self.v[:3]
        self.HT.SAMPLE_RATIO = self.v[3]

    def __exit__(self, *exc):
        self.HT.TOPK_CONFIG[self.kind], self.HT.SAMPLE_RATIO = self.saved
        return False


def run_gpu(args, ap):
    """--gpu (module docstring)."""
    if args.tiny:
        for key, val in TINY.items():
            setattr(args, key, val)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--gpu: no CUDA device visible (--device cpu runs the interpreter)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--gpu --device cpu: set TRITON_INTERPRET=1 (the Triton engine runs under the "
                 "interpreter on CPU tensors)")
    for name, why in (("triton", dispatch.available_backends(args.device, op="hamming",
                                                             reasons=True)["triton"]),
                      ("cpu", dispatch.available_backends("cpu", op="hamming",
                                                          reasons=True)["cpu"])):
        if why is not None:
            sys.exit(f"the {name} Hamming engine is not available: {why}")
    # the CUDA kernels' engine (csrc/hamming_cuda.cu) beside Triton's, on CUDA tensors
    engines = ["triton"]
    if device.type == "cuda":
        why = dispatch.available_backends(args.device, op="hamming", reasons=True)["cuda"]
        if why is None:
            engines.append("cuda")
        else:
            print(f"  no 'cuda' engine rows: {why}", flush=True)
    import triton
    from nac_fast.index import HashIndex
    t_start = time.perf_counter()
    D, k = args.bits, args.k
    map_sizes, cpu_map_q = _ints(args.map_sizes, "--map-sizes"), _ints(args.cpu_map_queries,
                                                                      "--cpu-map-queries")
    idx_sizes, cpu_topk_q = _ints(args.index_sizes, "--index-sizes"), _ints(
        args.cpu_topk_queries, "--cpu-topk-queries")
    if len(cpu_map_q) != len(map_sizes) or len(cpu_topk_q) != len(idx_sizes):
        ap.error("--cpu-map-queries / --cpu-topk-queries: one value per --map-sizes / "
                 "--index-sizes size")
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "interpreter"
    print(f"GPU Hamming engine vs the C++ engine ({args.threads} threads): {gpu_name}, {D} bits, "
          f"triton {triton.__version__}, torch {torch.__version__}", flush=True)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    rows, failures, skipped = [], [], []
    cpu_times = {}

    def over_budget(what) -> bool:
        if time.perf_counter() - t_start > args.budget_s:
            skipped.append(what)
            print(f"  skipped (past --budget-s {args.budget_s:g} s): {what}", flush=True)
            return True
        return False

    def add(method, engine, dev, queries, G, stats, m=None, check="", note="", kk=""):
        goal = GOALS.get((method, G, queries)) if dev != "cpu" and device.type == "cuda" else None
        key = (method, G, queries)
        speed = ""
        if engine == "cpu":
            cpu_times[key] = stats["median_s"]
        elif key in cpu_times:
            speed = cpu_times[key] / stats["median_s"]
        row = dict(method=method, engine=engine, device=dev, queries=queries, gallery=G, bits=D,
                   k=kk, repeats=stats["repeats"], median_s=stats["median_s"],
                   p20_s=stats["p20_s"], p80_s=stats["p80_s"],
                   peak_gpu_mib=round(stats.get("peak_gpu_mib", 0.0), 1),
                   peak_rss_mb=round(stats["peak_rss_mb"], 1), map=m, speedup_vs_cpu=speed,
                   goal_s=goal, meets_goal=(stats["median_s"] <= goal) if goal else "",
                   check=check, note=note)
        rows.append(row)
        print(f"  {method:<8} {engine:<6} {queries:>6} q x {G:>11,}: median {stats['median_s']:9.5f} s "
              f"[{stats['p20_s']:.5f}, {stats['p80_s']:.5f}]  GPU peak {row['peak_gpu_mib']:8.1f} MiB"
              + (f"  x{speed:.3g} vs cpu" if speed else "") + (f"  goal {goal} s" if goal else "")
              + (f"  {check}" if check else ""), flush=True)

    P = H.PackedCodes
    # ---- mAP@all ----
    if args.only in ("all", "map"):
        W = -(-D // 64)
        protos = random_codes(args.classes, D, gen, device)
        Q = args.map_queries
        qw, ql = packed_class_codes(Q, D, protos, args.classes, args.flip, gen, device)
        for G, nq_cpu in zip(map_sizes, cpu_map_q):
            if over_budget(f"map_all x {G}"):
                continue
            gw, gl = packed_class_codes(G, D, protos, args.classes, args.flip, gen, device)
            nc = min(args.check_queries, Q)
            checks = {}
            for eng in engines:
                good, checks[eng] = _ap_check(H, qw, ql, gw, gl, D, nc, device, eng)  # compiles
                if not good:
                    failures.append(f"map_all {eng} x {G}: {checks[eng]}")
            runs = [(Q, args.gpu_repeats)]
            if nq_cpu and min(nq_cpu, Q) != Q:
                runs.append((min(nq_cpu, Q), args.gpu_repeats))
            qc, qlc, gc, glc = qw.cpu(), ql.cpu(), gw.cpu(), gl.cpu()
            if nq_cpu:
                n = min(nq_cpu, Q)
                stats, m = gpu_timed(lambda: H.mean_average_precision(
                    P(qc[:n], D), qlc[:n], P(gc, D), glc, backend="cpu"),
                    3 if G <= 100_000 else 2, torch.device("cpu"))
                add("map_all", "cpu", "cpu", n, G, stats, m, note=f"{args.threads} threads")
            for eng in engines:
                for n, reps in runs:
                    stats, m = gpu_timed(lambda: H.mean_average_precision(
                        P(qw[:n], D), ql[:n], P(gw, D), gl, backend=eng), reps, device)
                    add("map_all", eng, str(device), n, G, stats, m, check=checks[eng])
                if args.profile_out and G == map_sizes[-1]:
                    profile_kernels(lambda: H.mean_average_precision(
                        P(qw, D), ql, P(gw, D), gl, backend=eng), device, args.profile_out,
                        f"mAP@all, {Q} x {G:,} codes of {D} bits (backend {eng})")
            del gw, gl, gc, glc
    # ---- top-k ----
    if args.only in ("all", "topk"):
        for G, nq_cpu in zip(idx_sizes, cpu_topk_q):
            if over_budget(f"topk x {G}"):
                continue
            Q = args.index_queries
            gw = random_codes(G, D, gen, device)
            pick = torch.randint(0, G, (Q,), generator=gen, device=device)
            qw = flip_bits(gw[pick], D, 0.1, gen)
            gpu = HashIndex(D, device=device, backend="triton")
            gpu.add(P(gw, D))
            del gw
            gpu.search(P(qw[:2], D), k)  # compiles, outside the clock
            stats, (Dg, Ig) = gpu_timed(lambda: gpu.search(P(qw, D), k), args.gpu_repeats, device)
            if args.profile_out and G == idx_sizes[0]:
                profile_kernels(lambda: gpu.search(P(qw, D), k), device, args.profile_out,
                                f"HashIndex.search, {Q} queries, top-{k} of {G:,} codes")
            nc = min(args.check_queries, Q, nq_cpu if nq_cpu else args.check_queries)
            cpu_index = HashIndex(D)
            cpu_index.add(P(gpu.codes.words.cpu(), D))
            qc = qw.cpu()
            Dc, Ic = cpu_index.search(P(qc[:nc], D), k)
            good = bool(torch.equal(Dg[:nc].cpu(), Dc) and torch.equal(Ig[:nc].cpu(), Ic))
            check = (f"{'ok' if good else 'FAIL'}: distances and indices of {nc} queries equal "
                     "to the C++ engine's" if good else
                     f"FAIL: {nc} queries' top-{k} differ from the C++ engine's")
            if not good:
                failures.append(f"topk x {G}: {check}")
            if nq_cpu:
                n = min(nq_cpu, Q)
                cpu_index.search(P(qc[:2], D), k)
                cstats, _ = gpu_timed(lambda: cpu_index.search(P(qc[:n], D), k),
                                      3 if G <= 10_000_000 else 1, torch.device("cpu"))
                add("topk", "cpu", "cpu", n, G, cstats, kk=k,
                    note=f"HashIndex on the CPU, {args.threads} threads")
                if n != Q:  # the GPU on the CPU row's queries too: a like-for-like pair
                    s2, _ = gpu_timed(lambda: gpu.search(P(qw[:n], D), k), args.gpu_repeats,
                                      device)
                    add("topk", "triton", str(device), n, G, s2, kk=k, check=check)
            add("topk", "triton", str(device), Q, G, stats, kk=k, check=check,
                note="HashIndex(device=...) search, queries = index codes with 10% of bits "
                     "flipped; " + _variant_name(
                         kind="gpu" if device.type == "cuda" else "interpreter"))
            if G == idx_sizes[0]:
                for v in _ints_variants(args.topk_variants):
                    if over_budget(f"topk-variant {v} x {G}"):
                        break
                    with _variant(v, device):
                        gpu.search(P(qw[:2], D), k)
                        vs, (Dv, Iv) = gpu_timed(lambda: gpu.search(P(qw, D), k),
                                                 args.gpu_repeats, device)
                    same = bool(torch.equal(Dv, Dg) and torch.equal(Iv, Ig))
                    if not same:
                        failures.append(f"topk-variant {v} x {G}: results differ")
                    add("topk-variant", "triton", str(device), Q, G, vs, kk=k,
                        check=f"{'ok' if same else 'FAIL'}: all {Q} queries equal to the "
                              "shipped setting's results", note=_variant_name(v))
            for eng in engines[1:]:  # the same index, searched by another engine
                gpu.backend = eng
                gpu.search(P(qw[:2], D), k)
                es, (De, Ie) = gpu_timed(lambda: gpu.search(P(qw, D), k), args.gpu_repeats,
                                         device)
                good = bool(torch.equal(De[:nc].cpu(), Dc) and torch.equal(Ie[:nc].cpu(), Ic)
                            and torch.equal(De, Dg) and torch.equal(Ie, Ig))
                echeck = (f"ok: distances and indices of {nc} queries equal to the C++ "
                          f"engine's, all {Q} to the triton engine's" if good else
                          f"FAIL: top-{k} differs from the C++ or the triton engine's")
                if not good:
                    failures.append(f"topk {eng} x {G}: {echeck}")
                if nq_cpu and min(nq_cpu, Q) != Q:
                    n = min(nq_cpu, Q)
                    s2, _ = gpu_timed(lambda: gpu.search(P(qw[:n], D), k), args.gpu_repeats,
                                      device)
                    add("topk", eng, str(device), n, G, s2, kk=k, check=echeck)
                add("topk", eng, str(device), Q, G, es, kk=k, check=echeck,
                    note="HashIndex(device=..., backend=" + repr(eng) + ") search, queries = "
                         "index codes with 10% of bits flipped")
                if args.profile_out and G == idx_sizes[0]:
                    profile_kernels(lambda: gpu.search(P(qw, D), k), device, args.profile_out,
                                    f"HashIndex.search ({eng}), {Q} queries, top-{k} of {G:,} "
                                    "codes")
                del De, Ie
            gpu.backend = "triton"
            del gpu, cpu_index, qc, Dg, Ig
            if device.type == "cuda":
                torch.cuda.empty_cache()

    meta = {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "cpu": cpu_name(), "gpu": gpu_name,
            "threads": args.threads, "torch": torch.__version__, "triton": triton.__version__,
            "git_commit": commit()}
    csv_path = args.csv if args.csv != CSV_PATH else GPU_CSV_PATH
    if csv_path:  # a CSV with another header is rewritten with GPU_FIELDS first (common)
        append_rows(csv_path, [{**meta, **r, "note": "; ".join(x for x in (r["note"], args.note)
                                                                if x)} for r in rows], GPU_FIELDS)
        print(f"  appended {len(rows)} rows to {csv_path}")
    elapsed = time.perf_counter() - t_start
    print(f"\n{'row':<34} {'median s':>10} {'p20-p80 s':>19} {'GPU MiB':>8} {'vs cpu':>7} "
          f"{'goal':>6}  check")
    for r in rows:
        what = f"{r['method']} {r['engine']} {r['queries']}x{r['gallery']:,}"
        sp = f"x{r['speedup_vs_cpu']:.3g}" if r["speedup_vs_cpu"] else ""
        goal = ("" if not r["goal_s"] else ("MET" if r["meets_goal"] else "MISSED"))
        print(f"{what:<34} {r['median_s']:>10.5f} {r['p20_s']:>9.5f}-{r['p80_s']:<9.5f} "
              f"{r['peak_gpu_mib']:>8.1f} {sp:>7} {goal:>6}  {r['check'].split(':')[0]}")
    summary = {"bench": "hamming_gpu", "device": str(device), "gpu": gpu_name, "bits": D,
               "rows": len(rows), "skipped": skipped, "failures": failures,
               "elapsed_s": round(elapsed, 1),
               "goals": {f"{r['method']} {r['engine']} {r['queries']}x{r['gallery']}":
                         bool(r["meets_goal"]) for r in rows if r["goal_s"]}}
    print(json.dumps(summary))
    return 1 if failures else 0


def gpu_options(ap):
    """The actions of the parser's "--gpu" argument group."""
    return next(g for g in ap._action_groups if g.title == "--gpu")._group_actions


def check_args(ap, args) -> None:
    """Usage errors (ap.error, exit status 2) before any measurement: counts below their least
    value, a bit-flip probability outside [0, 0.5] (0.5: codes unrelated to their class), an
    option of the --gpu run given without --gpu, an output file that could not be written."""
    check_least(ap, args, {"--queries": 1, "--gallery": 1, "--bits": 1, "--classes": 1,
                           "--repeats": 1, "--slow-repeats": 1, "--chunk": 1,
                           "--torch-queries": 0, "--faiss-heap-queries": 0, "--threads": 1,
                           "--map-queries": 1, "--index-queries": 1, "--k": 1,
                           "--check-queries": 0, "--gpu-repeats": 1})
    check_flip(ap, args)
    if not args.gpu:  # the "--gpu" group's options would be silently ignored
        given = [a.option_strings[0] for a in gpu_options(ap)
                 if getattr(args, a.dest) != a.default]
        if given:
            ap.error(f"{', '.join(given)}: options of the --gpu run (add --gpu)")
    if args.csv:
        check_output_file(ap, "--csv", args.csv if not args.gpu or args.csv != CSV_PATH
                          else GPU_CSV_PATH)
    if args.gpu and args.profile_out:
        check_output_file(ap, "--profile-out", args.profile_out, csv_file=False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=10000)
    ap.add_argument("--gallery", type=int, default=50000)
    ap.add_argument("--bits", type=int, default=128)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--flip", type=float, default=0.3, help="bit-flip probability around the "
                    "class prototype, in [0, 0.5] (0.3 gives mAP ~0.5 at 128 bits)")
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
    ap.add_argument("--gpu", action="store_true", help="the GPU engine beside the C++ engine "
                    "(module docstring); the CPU-protocol flags are then ignored")
    g = ap.add_argument_group("--gpu")
    g.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the Triton engine under TRITON_INTERPRET=1 (plumbing only)")
    g.add_argument("--tiny", action="store_true", help="toy sizes (CI): maps of 200 and 600 codes x "
                   "33 queries, indexes of 4200 and 9000 codes x 9 queries, one run each")
    g.add_argument("--map-sizes", default="50000,1000000", help="gallery sizes of the mAP rows")
    g.add_argument("--map-queries", type=int, default=10000)
    g.add_argument("--cpu-map-queries", default="10000,2000", help="queries of the C++ mAP row "
                   "at each --map-sizes size (0: no row)")
    g.add_argument("--index-sizes", default="1000000,100000000", help="codes of the top-k rows")
    g.add_argument("--index-queries", type=int, default=1000)
    g.add_argument("--cpu-topk-queries", default="1000,16", help="queries of the CPU index row "
                   "at each --index-sizes size (0: no row)")
    g.add_argument("--k", type=int, default=10)
    g.add_argument("--check-queries", type=int, default=256, help="queries checked against the "
                   "C++ engine in every GPU row")
    g.add_argument("--gpu-repeats", type=int, default=5)
    g.add_argument("--budget-s", type=float, default=70.0, help="skip rows that would start "
                   "after this many seconds")
    g.add_argument("--only", choices=("all", "map", "topk"), default="all")
    g.add_argument("--profile-out", default="", help="append torch.profiler's kernel table of "
                   "one search at the first --index-sizes size and one mAP at the last "
                   "--map-sizes size to this text file")
    g.add_argument("--topk-variants", default="16x64x2/16,32x32x2/16,32x32x4/8",
                   help="other settings of the top-k (BQxBGxWARPS/SAMPLE_RATIO) timed at the "
                   "first --index-sizes size beside the shipped one, rows 'topk-variant' ('' = "
                   "none)")
    ap.add_argument("--no-faiss", action="store_true")
    add_isa_flag(ap)
    ap.add_argument("--no-rank", action="store_true", help="skip the nac_fast full-ranking row")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--csv", default=CSV_PATH, help="CSV to append to ('' = none)")
    ap.add_argument("--note", default="", help="free text stored in the CSV rows")
    args = ap.parse_args(argv)
    check_args(ap, args)

    torch.set_num_threads(args.threads)
    if args.gpu:
        return run_gpu(args, ap)
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
          f"flip {args.flip}, {args.threads} threads, C++ engine level {isa}", flush=True)

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

    if faiss_map is not None and abs(faiss_map - nac_map) > 1e-9:
        print(f"  note: mAP from the FAISS ranking differs by {faiss_map - nac_map:.3g} "
              "(its tie order is not by gallery index)")

    meta = {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(), "cpu": cpu_name(), "threads": args.threads,
            "torch": torch.__version__, "faiss": getattr(faiss, "__version__", "") if faiss else "",
            "git_commit": commit(), "gallery": G, "bits": D, "isa": isa}
    if args.csv:  # a CSV with another header is rewritten with CSV_FIELDS first (common)
        append_rows(args.csv, [{**meta, **r, "note": "; ".join(x for x in (r["note"], args.note)
                                                                if x)} for r in rows], CSV_FIELDS)
        print(f"  appended {len(rows)} rows to {os.path.relpath(args.csv, ROOT)}")

    summary = {"bench": "hamming_cpu", "isa": isa, "queries": Q, "gallery": G, "bits": D,
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
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
