"""Microbenchmark of the NAC losses: forward+backward per backend against the reference.

    python bench/bench_loss.py                          # paper shapes, fp32 + bf16, this device
    python bench/bench_loss.py --quick                  # one small shape per kind (smoke run)
    python bench/bench_loss.py --device cuda --compile-reference   # GPU: also torch.compile(ref)
    python bench/plot_bench.py bench/results/loss_cpu.csv          # PNG plots of the CSV

Shapes (issue #2): in-batch n = N in {1000, 2048, 4096}; queue n = 512 with M in {16384, 65536,
262144}; D = 128.  For each (kind, shape, dtype, backend) it reports the median and p20/p80 of the
forward+backward time, the peak extra memory (what the step allocates beyond its inputs; CPU: from
the profiler's allocation events, GPU: max_memory_allocated), GFLOP/s of the useful matrix work
(forward 2nND, backward 2nND per gradient product: in-batch 6nND in all, MQ 4nND) and the ratio to
the reference's time and memory.  Every row is appended to a CSV with host, device, torch version,
commit and timestamp; a table is printed and, last, one JSON line with the rows.
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import nac_fast  # noqa: E402

INBATCH = [1000, 2048, 4096]
QUEUE = [16384, 65536, 262144]
FIELDS = ["timestamp", "host", "device", "torch", "commit", "threads", "kind", "n", "N", "D",
          "dtype", "backend", "median_s", "p20_s", "p80_s", "peak_extra_mib", "gflops",
          "time_ratio_to_ref", "mem_ratio_to_ref", "reps"]


def commit() -> str:
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except Exception:
        return "unknown"


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    name = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} x{os.cpu_count()}"


def make_step(kind, n, N, D, dtype, device, backend, compiled_ref=None):
    g = torch.Generator(device="cpu").manual_seed(n + N)
    a = (torch.randn(n, D, generator=g) * 1.5).to(device, dtype).requires_grad_()
    r = torch.randn(n, D, generator=g).to(device, dtype).requires_grad_()
    noise = nac_fast.draw_noise((n, D), 0.1, generator=g).to(device, dtype)
    queue = torch.tanh(torch.randn(N, D, generator=g)).to(device, dtype) if kind == "mq" else None

    if compiled_ref is not None:
        def step():
            a.grad = r.grad = None
            compiled_ref(a, r, noise, queue).backward()
    elif kind == "mq":
        def step():
            a.grad = r.grad = None
            nac_fast.nac_mq_loss(a, r, queue, 0.1, noise=noise, backend=backend).backward()
    else:
        def step():
            a.grad = r.grad = None
            nac_fast.nac_loss(a, r, 0.1, noise=noise, backend=backend).backward()
    return step


def peak_extra_bytes(step, device) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def time_step(step, device, reps: int, min_time: float):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    step()
    sync()  # warm-up (also compiles)
    times = []
    t_start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - t_start < min_time and len(times) < 10 * reps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    q = statistics.quantiles(times, n=5) if len(times) >= 5 else [min(times)] * 4
    return statistics.median(times), q[0], q[3], len(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--backends", default=None, help="comma list; default: all available")
    ap.add_argument("--inbatch", default=",".join(map(str, INBATCH)))
    ap.add_argument("--queue", default=",".join(map(str, QUEUE)), help="queue sizes M (n=--mq-n)")
    ap.add_argument("--mq-n", type=int, default=512)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds of timing per case")
    ap.add_argument("--compile-reference", action="store_true", help="also torch.compile(reference)")
    ap.add_argument("--quick", action="store_true", help="one small shape per kind, fp32 only")
    ap.add_argument("--csv", default=None, help="CSV to append to (default bench/results/loss_<device>.csv)")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no GPU is visible")
    if args.quick:
        args.inbatch, args.queue, args.dtypes, args.reps, args.min_time = "256", "4096", "float32", 3, 0.1
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    avail = nac_fast.available_backends(args.device)
    backends = args.backends.split(",") if args.backends else avail
    for b in backends:
        if b not in avail:
            ap.error(f"backend {b!r} is not available on {args.device}: {avail}")
    if "reference" not in backends:
        backends = ["reference"] + backends
    csv_path = args.csv or os.path.join(ROOT, "bench", "results", f"loss_{args.device}.csv")
    os.makedirs(os.path.dirname(csv_path), exist_ok=True)
    common = dict(timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  host=socket.gethostname(), device=device_name(args.device),
                  torch=torch.__version__, commit=commit(), threads=torch.get_num_threads())

    def sizes(text):  # "" means none of that kind
        return [int(x) for x in text.split(",") if x.strip()]
    cases = [("inbatch", n, n) for n in sizes(args.inbatch)] + \
            [("mq", args.mq_n, m) for m in sizes(args.queue)]
    compiled_ref = None
    if args.compile_reference:
        from nac_fast import reference

        def ref_fn(a, r, noise, queue):
            s = nac_fast.channel_scale(0.1)
            if queue is None:
                return reference.nac_loss_reference(a, r, noise, s)
            return reference.nac_mq_loss_reference(a, r, queue, noise, s)
        compiled_ref = torch.compile(ref_fn, dynamic=False)

    rows = []
    print(f"{'kind':8s} {'n':>6s} {'N':>7s} {'dtype':9s} {'backend':18s} {'median ms':>10s} "
          f"{'p20':>8s} {'p80':>8s} {'peak MiB':>9s} {'GFLOP/s':>8s} {'x ref':>6s} {'mem/ref':>8s}")
    for kind, n, N in cases:
        flops = (6 if kind == "inbatch" else 4) * n * N * args.D
        for dtype in dtypes:
            ref_t = ref_mem = None
            variants = [(b, None) for b in backends]
            if compiled_ref is not None:
                variants.insert(1, ("compiled-reference", compiled_ref))
            for b, cref in variants:
                step = make_step(kind, n, N, args.D, dtype, args.device,
                                 "reference" if cref is not None else b, cref)
                try:
                    med, p20, p80, reps = time_step(step, args.device, args.reps, args.min_time)
                    mem = None if args.no_memory else peak_extra_bytes(step, args.device)
                except (RuntimeError, ValueError) as exc:  # e.g. out of memory at 262144
                    print(f"{kind:8s} {n:6d} {N:7d} {str(dtype)[6:]:9s} {b:18s} failed: {exc}")
                    continue
                if b == "reference":
                    ref_t, ref_mem = med, mem
                row = dict(common, kind=kind, n=n, N=N, D=args.D, dtype=str(dtype)[6:], backend=b,
                           median_s=f"{med:.6f}", p20_s=f"{p20:.6f}", p80_s=f"{p80:.6f}",
                           peak_extra_mib="" if mem is None else f"{mem / 2**20:.2f}",
                           gflops=f"{flops / med / 1e9:.1f}",
                           time_ratio_to_ref="" if ref_t is None else f"{med / ref_t:.3f}",
                           mem_ratio_to_ref="" if not ref_mem or mem is None else f"{mem / ref_mem:.4f}",
                           reps=reps)
                rows.append(row)
                print(f"{kind:8s} {n:6d} {N:7d} {row['dtype']:9s} {b:18s} {med * 1e3:10.2f} "
                      f"{p20 * 1e3:8.2f} {p80 * 1e3:8.2f} {row['peak_extra_mib']:>9s} "
                      f"{row['gflops']:>8s} {row['time_ratio_to_ref']:>6s} {row['mem_ratio_to_ref']:>8s}",
                      flush=True)
    new = not os.path.exists(csv_path)
    with open(csv_path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        w.writerows(rows)
    print(f"appended {len(rows)} rows to {csv_path}")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
