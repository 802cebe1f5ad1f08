"""Microbenchmark of the NAC losses: forward+backward per backend against the reference.

    python bench/bench_loss.py                          # paper shapes, fp32 + bf16, this device
    python bench/bench_loss.py --quick                  # one small shape per kind (smoke run)
    python bench/bench_loss.py --device cuda --compile-reference   # GPU: also torch.compile(ref)
    python bench/bench_loss.py --quick --compile-reference --compile-backend aot_eager   # CPU check
    python bench/bench_loss.py --inbatch 128 --queue "" --inbatch-self 128   # own key left out

Kinds: `inbatch` (n = N, the paper's), `mq` (n = --mq-n rows against an M-key queue) and
`inbatch-self` (n = N with each row's own key left out, self_key="exclude", docs/math.md
[M:self-key]: the fused ops' self_offset).

Rows are appended to a CSV (a failed row: exit status 1); columns and timing: docs/kernels.md
"The benchmark scripts in detail".  host_overhead.py takes its cases' steps and timers from here."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (puts the source tree on sys.path)
from common import ROOT, check_least, check_output_file  # noqa: E402

import nac_fast  # noqa: E402

FIELDS = ["timestamp", "host", "device", "torch", "commit", "threads", "kind", "n", "N", "D",
          "dtype", "backend", "median_s", "p20_s", "p80_s", "peak_extra_mib", "gflops",
          "time_ratio_to_ref", "mem_ratio_to_ref", "reps",
          # added later, at the end (older CSVs stay readable): the GPU suite's, issue 23's (how
          # the time was taken, the machine's load), the fp32 rows' Triton product mode
          "triton", "pct_of_bound", "bound_s", "bound_limiter", "compile_backend",
          "compiled_graphs", "compile_s", "check_inputs", "status", "timer", "loadavg", "fp32_dot"]
P = 0.1  # the channel's bit-flip probability of every case


def inputs(kind, n, N, D, dtype, device, r_grad: bool = True):
    """a, r, noise, queue (None in-batch) of a case, seeded by its size (r_grad: r_hat's grad)."""
    g = torch.Generator(device="cpu").manual_seed(n + N)
    a = (torch.randn(n, D, generator=g) * 1.5).to(device, dtype).requires_grad_()
    r = torch.randn(n, D, generator=g).to(device, dtype).requires_grad_(r_grad or kind != "mq")
    noise = nac_fast.draw_noise((n, D), P, generator=g).to(device, dtype)
    queue = torch.tanh(torch.randn(N, D, generator=g)).to(device, dtype) if kind == "mq" else None
    return a, r, noise, queue


def reference_fn(a, r, noise, queue, self_offset=None):
    """The function torch.compile compiles: the plain reference (no argument checks);
    self_offset 0: each row's own key left out (kind inbatch-self)."""
    from nac_fast.ops import reference
    s = nac_fast.channel_scale(P)
    if queue is None:
        return reference.nac_loss_reference(a, r, noise, s, self_offset=self_offset)
    return reference.nac_mq_loss_reference(a, r, queue, noise, s)


def make_step(kind, n, N, D, dtype, device, backend, compiled_ref=None, *,
              noise_inside: bool = False, r_grad: bool = True):
    """One forward+backward of `backend` at the shape, or of `compiled_ref` (a compiled
    reference_fn); the noise drawn once before, or by each call when noise_inside."""
    a, r, fixed, queue = inputs(kind, n, N, D, dtype, device, r_grad)
    noise = None if noise_inside else fixed  # None: the fused loss draws it
    if compiled_ref is not None:  # the reference takes the noise: drawn here when inside
        draw = lambda: fixed if noise is not None else nac_fast.draw_noise(  # noqa: E731
            (n, D), P, device=device, dtype=dtype)
        own = 0 if kind == "inbatch-self" else None
        loss = lambda: compiled_ref(a, r, draw(), queue, own)  # noqa: E731
    elif kind == "mq":
        loss = lambda: nac_fast.nac_mq_loss(a, r, queue, P, noise=noise, backend=backend)  # noqa: E731
    elif kind == "inbatch-self":
        loss = lambda: nac_fast.nac_loss(a, r, P, noise=noise, backend=backend,  # noqa: E731
                                         self_key="exclude")
    else:
        loss = lambda: nac_fast.nac_loss(a, r, P, noise=noise, backend=backend)  # noqa: E731

    def step():
        a.grad = r.grad = None
        loss().backward()
    return step


def compile_reference(backend_name: str):
    """A fresh torch.compile of reference_fn with the backend `backend_name` (inductor, aot_eager,
    ...; dynamo reset first), and the list of the graphs it compiled: one graph after the reset
    means every call ran it (a failed guard recompiles, and dynamo falls back to eager only past
    its recompile limit)."""
    from torch._dynamo.backends.registry import lookup_backend
    torch._dynamo.reset()
    inner, graphs = lookup_backend(backend_name), []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)
    return torch.compile(reference_fn, backend=counting, dynamic=False, fullgraph=True), graphs


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
    return max(itertools.accumulate((e.nbytes() for e in events), initial=0))


def mean_time(step, calls: int = 1, sync=None, after: bool = False) -> float:
    """Mean host seconds per call of `calls` calls (`sync` before them, and after when `after`)."""
    sync and sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    after and sync()
    return (time.perf_counter() - t0) / calls


def failure(exc, width: int = 300) -> str:
    """"<type>: <first line of the message>" of an exception, cut at `width` characters."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:width]


def time_step(step, device, reps: int, min_time: float):
    """(median, p20, p80, timed reps, first call's seconds, timer) after one warm-up call (it
    compiles); how each device is timed: docs/kernels.md "The benchmark scripts in detail"."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    first = mean_time(step, 1, sync, True)
    if device == "cuda":
        from triton.testing import do_bench
        rep_ms = max(1000.0 * min_time, 1.0)
        med, p20, p80 = do_bench(step, warmup=25, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        reps = max(1, int(rep_ms / max(med, 1e-6)))
        return med / 1e3, p20 / 1e3, p80 / 1e3, reps, first, "do_bench"
    times, t_start = [], time.perf_counter()
    while len(times) < reps or (time.perf_counter() - t_start < min_time and len(times) < 10 * reps):
        times.append(mean_time(step))
    return (*common.quantiles(times), len(times), first, "perf_counter")


def graph_step(step, warmup: int = 3):
    """`step` captured in a CUDA graph (after `warmup` calls on a side stream, as
    torch.cuda.graphs asks); returns the replay, which re-runs its kernels on the same buffers."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def variants(backends, compile_reference: bool, graphs: bool):
    """The rows of one (case, dtype): the backends, the compiled reference after the reference,
    and a "<backend>+graph" row after each fused backend when `graphs`."""
    return [v for b in backends for v in [b] + (["compiled-reference"] if b == "reference" and
                                                compile_reference else [])
            + ([f"{b}+graph"] if graphs and b != "reference" else [])]


def case_bound(kind, n, N, D, dtype, device, dev_name):
    """(fp32_dot: the Triton kernels' fp32 product mode at the case, "" for other dtypes; the
    case's floor, common.bound, on a GPU that common knows, else None)."""
    kname, fp32_dot = "queue" if kind == "mq" else "inbatch", ""
    if dtype == torch.float32:
        try:
            from nac_fast.kernels.nac_triton import fp32_mode_of
        except Exception:  # noqa: BLE001 - no triton: no Triton rows either
            pass
        else:
            fp32_dot = fp32_mode_of(D, kname, n, N, device)
    if device != "cuda" or not common.known_gpu(dev_name):
        return fp32_dot, None
    return fp32_dot, common.bound(kname, n, N, D, str(dtype)[6:], dev_name,
                                  fp32_mode=fp32_dot or "tf32x3")


def _measure(b, case, args, base):
    """(median, p20, p80, reps, peak extra bytes or None) of the row `b` of `case`, `base` told
    how it was timed; a compiled row that did not run its one graph fails."""
    graphs = None
    if b == "compiled-reference":
        cref, graphs = compile_reference(args.compile_backend)
        step = make_step(*case, args.device, "reference", cref)
        base.update(compile_backend=args.compile_backend)
    elif b.endswith("+graph"):
        step = graph_step(make_step(*case, args.device, b[:-len("+graph")]))
    else:
        step = make_step(*case, args.device, b)
    med, p20, p80, reps, first, timer = time_step(step, args.device, args.reps, args.min_time)
    base.update(timer=timer, loadavg="%.2f" % os.getloadavg()[0])
    mem = None if args.no_memory else peak_extra_bytes(step, args.device)
    if graphs is not None:  # every step taken ran the one compiled graph
        base.update(compiled_graphs=len(graphs), compile_s=f"{first:.3f}")
        if len(graphs) != 1:
            raise RuntimeError(f"not compiled: {len(graphs)} graphs compiled (want 1)")
    return med, p20, p80, reps, mem


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    add("--dtypes", default="float32,bfloat16")
    add("--backends", help="comma list; default: all available")
    add("--inbatch", default="1000,2048,4096", help="in-batch sizes n = N (issue #2)")
    add("--queue", default="16384,65536,262144", help="queue sizes M (n=--mq-n)")
    add("--mq-n", type=int, default=512)
    add("--inbatch-self", default="", help="in-batch sizes n = N with each row's own key left "
        "out (kind inbatch-self: self_key='exclude', docs/math.md [M:self-key]); default none")
    add("--D", type=int, default=128)
    add("--reps", type=int, default=7)
    add("--min-time", type=float, default=1.0, help="seconds of timing per case")
    add("--compile-reference", action="store_true", help="also torch.compile(reference)")
    add("--compile-backend", default="inductor", help="torch.compile backend of the "
        "compiled-reference rows (default inductor; aot_eager is cheap, for CPU checks)")
    add("--quick", action="store_true", help="one small shape per kind, fp32 only")
    add("--csv", help="CSV to append to (default bench/results/loss_<device>.csv)")
    add("--no-memory", action="store_true", help="skip the memory measurement")
    add("--graphs", action=argparse.BooleanOptionalAction, default=None,
        help="add a CUDA-graph replay row per fused backend (default: on a GPU)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no GPU is visible")
    if args.graphs is None:
        args.graphs = args.device == "cuda"
    if args.graphs and args.device != "cuda":
        ap.error("--graphs needs --device cuda (CUDA graphs)")
    if args.quick:
        args.inbatch, args.queue, args.dtypes, args.reps, args.min_time = "256", "4096", "float32", 3, 0.1
    check_least(ap, args, {"--reps": 1, "--mq-n": 1, "--D": 1})
    if not args.min_time >= 0:
        ap.error(f"--min-time must be >= 0, got {args.min_time}")
    cases = [("inbatch", n, n) for n in common.int_list(ap, "--inbatch", args.inbatch, 1, True)] \
        + [("mq", args.mq_n, m) for m in common.int_list(ap, "--queue", args.queue, 1, True)] \
        + [("inbatch-self", n, n)
           for n in common.int_list(ap, "--inbatch-self", args.inbatch_self, 2, True)]
    if not cases:
        ap.error("--inbatch, --queue and --inbatch-self are all empty: no case to measure")
    dtypes = []
    for d, t in ((d, getattr(torch, d, None)) for d in args.dtypes.split(",")):
        if not isinstance(t, torch.dtype) or not t.is_floating_point:
            ap.error(f"--dtypes: {d!r} is not a floating-point torch dtype")
        if t in dtypes:
            ap.error(f"--dtypes: {d!r} is given twice (or under two names)")
        dtypes.append(t)
    avail = nac_fast.available_backends(args.device)
    backends = args.backends.split(",") if args.backends else avail
    if bad := [b for b in backends if b not in avail]:
        ap.error(f"backend {bad[0]!r} is not available on {args.device}: {avail}")
    if len(set(backends)) != len(backends):
        ap.error(f"--backends: a backend is given twice in {args.backends!r}")
    # the reference first: every other row's ratios are to its figures of the same case
    backends = ["reference"] + [b for b in backends if b != "reference"]
    if args.compile_reference:
        from torch._dynamo.backends.registry import lookup_backend
        try:
            lookup_backend(args.compile_backend)
        except Exception as exc:
            ap.error(f"--compile-backend {args.compile_backend!r}: {exc}")
    csv_path = args.csv or os.path.join(ROOT, "bench", "results", f"loss_{args.device}.csv")
    check_output_file(ap, "--csv", csv_path)  # before any timing: a bad path costs nothing
    dev_name = common.device_name(args.device)
    from nac_fast.ops import loss as _loss_mod
    run = dict(common.run_fields(dev_name), threads=torch.get_num_threads(),
               check_inputs=int(bool(_loss_mod.CHECK_VALUES)))

    rows = []
    print(f"{'kind':12s} {'n':>6s} {'N':>7s} {'dtype':9s} {'backend':18s} {'median ms':>10s} "
          f"{'p20':>8s} {'p80':>8s} {'peak MiB':>9s} {'GFLOP/s':>8s} {'x ref':>6s} {'mem/ref':>8s} "
          f"{'%bound':>7s}")
    for (kind, n, N), dtype in itertools.product(cases, dtypes):
        flops, ref_t, ref_mem = (4 if kind == "mq" else 6) * n * N * args.D, None, None
        fp32_dot, bnd = case_bound(kind, n, N, args.D, dtype, args.device, dev_name)
        for b in variants(backends, args.compile_reference, args.graphs):
            base = dict(run, kind=kind, n=n, N=N, D=args.D, dtype=str(dtype)[6:], backend=b,
                        bound_s="" if bnd is None else f"{bnd['bound_s']:.9f}",
                        bound_limiter="" if bnd is None else bnd["limiter"], fp32_dot=fp32_dot)
            try:
                med, p20, p80, reps, mem = _measure(b, (kind, n, N, args.D, dtype), args, base)
            except Exception as exc:  # OOM, compile error, not compiled: a failed row
                print(f"{kind:12s} {n:6d} {N:7d} {str(dtype)[6:]:9s} {b:18s} FAILED "
                      f"{failure(exc)}", flush=True)
                rows.append(dict(base, status=f"failed: {failure(exc)}"))
                continue
            finally:
                if b == "compiled-reference":
                    torch._dynamo.reset()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            if b == "reference":
                ref_t, ref_mem = med, mem
            pct = "" if bnd is None else f"{100.0 * bnd['bound_s'] / med:.2f}"  # 100: at the floor
            row = dict(base, median_s=f"{med:.6f}", p20_s=f"{p20:.6f}", p80_s=f"{p80:.6f}",
                       peak_extra_mib="" if mem is None else f"{mem / 2**20:.2f}",
                       gflops=f"{flops / med / 1e9:.1f}",
                       time_ratio_to_ref="" if ref_t is None else f"{med / ref_t:.3f}",
                       mem_ratio_to_ref="" if not ref_mem or mem is None else f"{mem / ref_mem:.4f}",
                       reps=reps, pct_of_bound=pct, status="ok")
            rows.append(row)
            print(f"{kind:12s} {n:6d} {N:7d} {row['dtype']:9s} {b:18s} {med * 1e3:10.3f} "
                  f"{p20 * 1e3:8.3f} {p80 * 1e3:8.3f} {row['peak_extra_mib']:>9s} "
                  f"{row['gflops']:>8s} {row['time_ratio_to_ref']:>6s} "
                  f"{row['mem_ratio_to_ref']:>8s} {pct:>7s}", flush=True)
    common.append_rows(csv_path, rows, FIELDS)
    print(f"appended {len(rows)} rows to {csv_path}")
    print(json.dumps({"rows": rows}))
    if failed := sum(r["status"] != "ok" for r in rows):
        print(f"{failed} row(s) FAILED", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
