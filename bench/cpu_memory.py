"""Extra peak memory of one NAC in-batch forward+backward on the CPU, as process RSS from outside.

    python bench/cpu_memory.py                            # n = 4096, D = 128, fp32, 3 runs
    python bench/cpu_memory.py --n 2048 --runs 5 --threads 1
    python bench/cpu_memory.py --dtype bfloat16 --csv ''  # print only

bench/bench_loss.py counts what the step allocates through PyTorch's allocator (profiler events).
This script counts what the operating system sees, resident pages, so per-thread buffers,
OpenMP/MKL work space, glibc's heap behaviour and the outputs all show.  Each (backend, run) is
one FRESH Python process, so no allocator state carries over between cases.  In it:

  1. import torch and nac_fast, set the thread count;
  2. warm up: one forward+backward of EVERY measured backend (the same in every process, so both
     backends start from the same state) at n = --warmup-n rows, by default max(256, 128 x
     threads) so every worker thread has had work in both passes: one-time initialisation (OpenMP
     pool, thread stacks and arenas, MKL, autograd) is not counted;
  3. create the inputs at the measured shape (a, r with requires_grad; the +-1 noise), gc;
  4. malloc_trim(0): free heap pages go back to the OS, so the step cannot draw on free memory
     that the warm-up or the set-up happened to leave in the heap (how much that is depends on
     the warm-up, not on the backend: without the trim the measured extra of the fused op
     changed with the warm-up size; figures in bench/results/notes.md);
  5. reset the kernel's RSS high-water mark to the current RSS (write "5" to
     /proc/self/clear_refs, Linux >= 4.0) and read baseline = VmRSS;
  6. one `nac_loss(a, r, 0.1, noise=noise, backend=B).backward()`;
  7. extra = VmHWM - baseline.

So the extra includes what the step leaves behind, a.grad and r.grad (2 x n x D in the
accumulation dtype: 4 MiB at 4096 x 128 fp32), for both backends alike, and the input checks of
nac_fast.ops.loss (on unless NAC_FAST_CHECK_INPUTS=0, which the children inherit).  The table gives
the median and min-max over --runs processes per backend (run in turn: cpu, reference, cpu, ...),
ratio = median(backend) / median(reference) and ratio_worst = max(backend) / min(reference).  One
row per backend is appended to the CSV (default bench/results/cpu_memory.csv).
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import socket
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ["timestamp", "host", "cpu", "threads", "torch", "commit", "n", "D", "dtype", "backend",
          "runs", "extra_rss_mib", "extra_rss_min_mib", "extra_rss_max_mib", "ratio", "ratio_worst",
          "baseline_rss_mib", "warmup_n", "input_checks"]
DTYPES = ("float32", "float64", "bfloat16", "float16")
MIB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line (Linux only)")


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:  # no fallback: a stale high-water mark would give wrong figures
        raise RuntimeError("cannot reset the RSS high-water mark (/proc/self/clear_refs, "
                           f"Linux >= 4.0 needed): {e}") from e


def _trim_heap() -> None:
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "malloc_trim"):
        raise RuntimeError("glibc's malloc_trim is not available: the measurement needs glibc")
    libc.malloc_trim(0)


def default_warmup_n(threads: int) -> int:
    return max(256, 128 * threads)


def measure_once(backend: str, n: int, D: int, dtype: str, threads: int, warmup_n: int,
                 warmup_backends) -> dict:
    """The child process's work: baseline RSS and extra peak RSS of one step, in bytes."""
    import torch
    sys.path.insert(0, ROOT)
    import nac_fast

    torch.set_num_threads(threads)
    dt_ = getattr(torch, dtype)

    def inputs(rows, seed):
        g = torch.Generator().manual_seed(seed)
        a = (torch.randn(rows, D, generator=g) * 1.5).to(dt_).requires_grad_()
        r = torch.randn(rows, D, generator=g).to(dt_).requires_grad_()
        noise = nac_fast.draw_noise((rows, D), 0.1, generator=g).to(dt_)
        return a, r, noise

    for b in warmup_backends if warmup_n > 0 else ():
        wa, wr, wnoise = inputs(warmup_n, 1)
        nac_fast.nac_loss(wa, wr, 0.1, noise=wnoise, backend=b).backward()
        del wa, wr, wnoise
    a, r, noise = inputs(n, n)
    gc.collect()
    _trim_heap()
    _reset_hwm()
    base = _status_kib("VmRSS")
    nac_fast.nac_loss(a, r, 0.1, noise=noise, backend=backend).backward()
    peak = _status_kib("VmHWM")
    if a.grad is None or r.grad is None:
        raise RuntimeError("the step left no gradient")
    return {"baseline": base * 1024, "extra": (peak - base) * 1024,
            "input_checks": bool(nac_fast.ops.loss.CHECK_VALUES)}


def run_child(backend: str, n: int, D: int, dtype: str, threads: int, warmup_n: int,
              warmup_backends) -> dict:
    """One measurement in a fresh interpreter (same Python, same environment)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--backends", backend,
           "--n", str(n), "--D", str(D), "--dtype", dtype, "--threads", str(threads),
           "--warmup-n", str(warmup_n), "--warmup-backends", ",".join(warmup_backends)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"measurement process failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(backends, n: int, D: int, dtype: str, threads: int, runs: int,
            warmup_n: int | None = None):
    """{backend: [child result per run]}; the backends take turns, so a drift of the machine
    touches all of them."""
    if warmup_n is None:
        warmup_n = default_warmup_n(threads)
    res = {b: [] for b in backends}
    for _ in range(runs):
        for b in backends:
            res[b].append(run_child(b, n, D, dtype, threads, warmup_n, backends))
    return res


def summarise(res, ref: str = "reference"):
    rows = []
    for b, rs in res.items():
        xs = [x["extra"] for x in rs]
        med = statistics.median(xs)
        row = {"backend": b, "runs": len(xs), "extra_rss_mib": med / MIB,
               "extra_rss_min_mib": min(xs) / MIB, "extra_rss_max_mib": max(xs) / MIB,
               "ratio": float("nan"), "ratio_worst": float("nan"),
               "baseline_rss_mib": statistics.median(x["baseline"] for x in rs) / MIB,
               "input_checks": rs[0]["input_checks"]}
        if ref in res:
            ys = [x["extra"] for x in res[ref]]
            row["ratio"] = med / statistics.median(ys)
            row["ratio_worst"] = max(xs) / min(ys)
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096, help="rows (in-batch: n = N)")
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--threads", type=int, default=None, help="default: torch's default")
    ap.add_argument("--backends", default="cpu,reference", help="comma list; ratio is to reference")
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per backend")
    ap.add_argument("--warmup-n", type=int, default=None,
                    help="rows of the warm-up step; default max(256, 128 x threads); 0: no "
                    "warm-up (one-time initialisation is counted too)")
    ap.add_argument("--warmup-backends", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--csv", default=os.path.join(ROOT, "bench", "results", "cpu_memory.csv"),
                    help="CSV to append to ('' = none)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("n", "D", "runs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.warmup_n is not None and args.warmup_n < 0:
        ap.error("--warmup-n must be >= 0")
    if args.threads is not None and args.threads < 1:
        ap.error("--threads must be >= 1")
    backends = [b for b in args.backends.split(",") if b]
    if not backends:
        ap.error("--backends is empty")
    if len(set(backends)) != len(backends):  # each would be measured twice, its rows doubled
        ap.error(f"--backends names a backend twice: {args.backends!r}")

    if args.child:
        wb = args.warmup_backends.split(",") if args.warmup_backends else backends
        print(json.dumps(measure_once(backends[0], args.n, args.D, args.dtype, args.threads,
                                      args.warmup_n, wb)))
        return None

    import torch
    sys.path.insert(0, ROOT)
    import nac_fast
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_loss import commit, device_name  # the bench scripts' shared CSV labels
    from bench_csv import append_rows, check_output_file
    avail = nac_fast.available_backends("cpu")
    for b in backends:
        if b not in avail:
            ap.error(f"backend {b!r} is not available on cpu: {avail}")
    if args.csv:  # a folder, a path under a file, a damaged CSV: before the processes run
        check_output_file(ap, "--csv", args.csv)
    threads = args.threads or torch.get_num_threads()
    warmup_n = default_warmup_n(threads) if args.warmup_n is None else args.warmup_n
    res = measure(backends, args.n, args.D, args.dtype, threads, args.runs, warmup_n)
    rows = summarise(res)
    meta = {"timestamp": dt.datetime.now().isoformat(timespec="seconds"),
            "host": socket.gethostname(), "cpu": device_name("cpu"), "threads": threads,
            "torch": torch.__version__, "commit": commit(), "n": args.n, "D": args.D,
            "dtype": args.dtype, "warmup_n": warmup_n}
    print(f"n = N = {args.n}, D = {args.D}, {args.dtype}, {threads} threads, warm-up {warmup_n} "
          f"rows, input checks {'on' if rows[0]['input_checks'] else 'off'}, {args.runs} fresh "
          "processes per backend; extra = RSS high-water mark - RSS before the step")
    print(f"{'backend':>10} {'extra MiB (median)':>19} {'min':>8} {'max':>8} {'ratio':>7} "
          f"{'worst':>7}   per run (MiB)")
    for row in rows:
        per_run = ", ".join(f"{x['extra'] / MIB:.2f}" for x in res[row["backend"]])
        print(f"{row['backend']:>10} {row['extra_rss_mib']:>19.2f} "
              f"{row['extra_rss_min_mib']:>8.2f} {row['extra_rss_max_mib']:>8.2f} "
              f"{row['ratio']:>7.4f} {row['ratio_worst']:>7.4f}   {per_run}")
    if args.csv:  # a CSV with another header is rewritten with FIELDS first (bench_csv)
        append_rows(args.csv, [{**meta, **{k: (f"{v:.4f}" if isinstance(v, float) else v)
                                           for k, v in row.items()}} for row in rows], FIELDS)
        print(f"appended {len(rows)} rows to {args.csv}")
    return rows


if __name__ == "__main__":
    main()
