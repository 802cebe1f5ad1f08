"""Precision of every input dtype against float64: what the README's precision table reports.

    python bench/precision_table.py                 # table + bench/results/precision_cpu.csv
    python bench/precision_table.py --n 512 --N 4096 --D 128

For each input dtype it measures the norm-wise relative error (against the float64 reference on
the same, already rounded, inputs) of the per-row losses and of the gradients of a, r and keys:
  - `reference` in that dtype (plain PyTorch: the yardstick of the tests' "2x" budgets);
  - the fused `cpu` kernel;
  - the Triton kernels under the interpreter (TRITON_INTERPRET=1): the GPU kernels' own code and
    arithmetic up to the order of fp32 sums: products of bf16/fp16 operands are exact in fp32 as
    on tensor cores, and fp32 products go through the kernels' own TF32 splits, so each fp32
    mode (NAC_FAST_FP32_DOT = tf32x3, the default; tf32; ieee; fp16x3 (in-batch; given keys run
    bf16x6), whose fp16 part products are exact in fp32 too; bf16x6, whose bf16 part products
    are exact in fp32 too) is measured as the GPU runs it.
GPU figures proper come from the GPU suite (bench/gpu_suite.sh test), which runs the same
tolerances on CUDA tensors.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

import nac_fast  # noqa: E402
from bench_csv import append_rows, check_least, check_output_file  # noqa: E402



def rel(x, ref):
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def run(fn, tensors, g):
    leaves = {k: v.detach().clone().requires_grad_() for k, v in tensors.items()}
    rows = fn(**leaves)
    (rows * g.to(rows.dtype)).sum().backward()
    return rows.detach(), {k: v.grad for k, v in leaves.items()}


FP32_MODES = ("tf32x3", "tf32", "ieee", "bf16x6", "fp16x3")


def _fp32_dot(mode):
    """The Triton kernels' fp32 product mode `mode` for a block (None: nothing set; the Triton
    kernels are imported only for a mode, which only a Triton variant has)."""
    if mode is None:
        return contextlib.nullcontext()
    from nac_fast.kernels.nac_triton import fp32_dot
    return fp32_dot(mode)
DTYPES = ("bfloat16", "float16", "float32", "float64")


def measure(kind, n, N, D, p, seed, dtypes=DTYPES, fp32_modes=FP32_MODES):
    gen = torch.Generator().manual_seed(seed)
    base = {"a": torch.randn(n, D, generator=gen) * 1.5, "r": torch.randn(n, D, generator=gen) * 2}
    if kind == "keys":
        base["keys"] = torch.tanh(torch.randn(N, D, generator=gen) * 1.5)
    noise32 = nac_fast.draw_noise((n, D), p, generator=gen)
    g = torch.randn(n, generator=gen)
    s = nac_fast.channel_scale(p)
    rows = []
    for dname in dtypes:
        dtype = getattr(torch, dname)
        t = {k: v.to(dtype) for k, v in base.items()}
        noise = noise32.to(dtype)

        def loss(backend, noise_=noise):
            def fn(a, r, keys=None):
                return nac_fast.nac_loss(a, r, p, keys=keys, noise=noise_, reduction="none",
                                         backend=backend)
            return fn
        exact_v, exact_g = run(loss("reference", noise.double()),
                               {k: v.double() for k, v in t.items()}, g)
        avail = nac_fast.available_backends("cpu")
        variants = [(b, b, None) for b in ("reference", "cpu") if b in avail]
        if "triton" in avail:
            modes = fp32_modes if dtype == torch.float32 and D <= 128 else (None,)
            variants += [("triton" + (f" {m}" if m else ""), "triton", m) for m in modes]
        for label, backend, mode in variants:
            with _fp32_dot(mode):
                v, gr = run(loss(backend), t, g)
            rows.append(dict(kind=kind, dtype=dname, method=label, loss=rel(v, exact_v),
                             **{f"grad_{k}": rel(gr[k], exact_g[k]) for k in exact_g}))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--N", type=int, default=2048)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--fp32-modes", default=",".join(FP32_MODES),
                    help="the Triton kernels' fp32 product modes to measure (NAC_FAST_FP32_DOT)")
    ap.add_argument("--csv", default=os.path.join(ROOT, "bench", "results", "precision_cpu.csv"),
                    help="CSV to append to ('' = none)")
    args = ap.parse_args(argv)
    dtypes = args.dtypes.split(",")
    modes = args.fp32_modes.split(",")
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"--dtypes: {d!r} is not one of {', '.join(DTYPES)}")
    for m in modes:
        if m not in FP32_MODES:
            ap.error(f"--fp32-modes: {m!r} is not one of {', '.join(FP32_MODES)}")
    for flag, items in (("--dtypes", dtypes), ("--fp32-modes", modes)):
        if len(set(items)) != len(items):  # each would be measured twice, its rows doubled
            ap.error(f"{flag}: an item is given twice in {','.join(items)!r}")
    check_least(ap, args, {"--n": 1, "--N": 1, "--D": 1})
    if not 0 < args.p < 0.5:
        ap.error(f"--p: a flip probability in the open interval (0, 0.5), got {args.p}")
    if args.csv:
        check_output_file(ap, "--csv", args.csv)  # before the measurement (a bare name: ./NAME)
    rows = measure("inbatch", args.n, args.n, args.D, args.p, args.seed, dtypes, modes)
    rows += measure("keys", args.n, args.N, args.D, args.p, args.seed + 1, dtypes, modes)
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    fields = ["timestamp", "torch", "kind", "n", "N", "D", "dtype", "method", "loss", "grad_a",
              "grad_r", "grad_keys"]
    # a CSV with another header is rewritten with these fields first (bench_csv.append_rows)
    if args.csv:
        append_rows(args.csv, [dict(r, timestamp=stamp, torch=torch.__version__, n=args.n,
                                    N=args.n if r["kind"] == "inbatch" else args.N, D=args.D)
                               for r in rows], fields)
    print(f"{'kind':8s} {'dtype':9s} {'method':24s} {'loss':>9s} {'grad_a':>9s} {'grad_r':>9s} "
          f"{'grad_keys':>9s}")
    for r in rows:
        print(f"{r['kind']:8s} {r['dtype']:9s} {r['method']:24s} {r['loss']:9.2e} "
              f"{r['grad_a']:9.2e} {r['grad_r']:9.2e} "
              f"{r['grad_keys'] if isinstance(r.get('grad_keys'), str) else format(r.get('grad_keys', float('nan')), '9.2e')}")
    if args.csv:
        print(f"appended {len(rows)} rows to {args.csv}")


if __name__ == "__main__":
    main()
