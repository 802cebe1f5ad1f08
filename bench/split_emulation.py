"""Error of the fp32 product schemes of the Triton kernels, emulated, on the NAC loss's own products.

    python bench/split_emulation.py                       # table + bench/results/split_emulation_cpu.csv
    python bench/split_emulation.py --n 256 --N 512,65536 --p 0.1,1e-4

The fused kernels make four kinds of n x N x D products, each with operands of its own range:
  S    = Q K^T          the logits: Q = s log2(e) m tanh(a) (|Q| <= s log2 e), K = tanh(.) in [-1, 1]
  A    = P K            the rows' softmax-weighted keys: P in [0, 1], rows summing to 1
  S^T  = K Q^T          the backward's logits (as S)
  dK   = (P g)^T Q      the keys' gradient: P g with g = 1/n (reduction "mean"): tiny values
An fp32 scheme splits each fp32 operand into 16- or 19-bit parts whose pairwise products are exact
in fp32 (tensor-core inputs), and sums some of those products.  This script computes each product
from the same fp32 operands under each scheme, the parts' products and their sums in float64 (so
what it measures is the scheme's representation error alone: the tensor cores' fp32 accumulation
adds the same ~2^-24 |S| to every scheme), and prints the norm-wise relative error against the
float64 product of the fp32 operands:
  tf32x3     TF32 big + small (cvt.rna: 11 significant bits each), xb yb + xb ys + xs yb
             (the kernels' default, nac_triton._dot)
  bf16x6     three bf16 parts (8 bits each), the six products with i + j <= 2 (NAC_FAST_FP32_DOT=bf16x6)
  bf16x3     two bf16 parts, three products (tried and removed: it failed the fp32 budget)
  fp16x3     two fp16 parts (11 bits each), three products, the operands as they are (fp16's
             range: subnormals below 2^-14, so small values and their residuals lose bits)
  fp16x3s    the same after scaling each operand by a power of two that puts its largest
             magnitude in [2^14, 2^15) (undone exactly on the product)
fp16 and bf16 tensor cores run at the same rate, twice TF32's: fp16x3 is three 16-bit products
where bf16x6 is six (bench/gpu_notes.md "fp32 in fp16x3").  Rows are appended to the CSV with the
host, versions and commit.
"""
from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import platform
import socket
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
LOG2E = 1.4426950408889634
SCHEMES = ("tf32x3", "bf16x6", "bf16x3", "fp16x3", "fp16x3s")
FIELDS = ["timestamp", "host", "torch", "commit", "n", "N", "D", "p", "product", "scheme",
          "rel_err", "max_abs_err", "ratio_to_tf32x3"]


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> TF32 (11 significant bits), round to nearest, ties away (cvt.rna.tf32.f32): add
    half a unit of the 13 dropped bits to the magnitude, then clear them."""
    bits = x.contiguous().view(torch.int32)
    bits = (bits + 0x1000) & ~0x1FFF
    return bits.view(torch.float32)


def parts(x: torch.Tensor, scheme: str) -> list:
    """The scheme's parts of the fp32 tensor x, as float64 (each exactly its 16/19-bit value)."""
    if scheme == "tf32x3":
        xb = round_tf32(x)
        return [xb.double(), round_tf32(x - xb).double()]
    if scheme in ("bf16x6", "bf16x3"):
        x0 = x.to(torch.bfloat16).float()
        x1 = (x - x0).to(torch.bfloat16).float()
        out = [x0, x1]
        if scheme == "bf16x6":
            out.append((x - x0 - x1).to(torch.bfloat16).float())
        return [t.double() for t in out]
    if scheme == "fp16x3":
        x0 = x.to(torch.float16).float()
        return [x0.double(), (x - x0).to(torch.float16).double()]
    raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")


def pow2_scale(x: torch.Tensor) -> float:
    """2^e with max|x| 2^e in [2^14, 2^15) (1 for an all-zero x)."""
    m = float(x.abs().max())
    return 1.0 if m == 0.0 else 2.0 ** (14 - math.floor(math.log2(m)))


def product(x: torch.Tensor, y: torch.Tensor, scheme: str) -> torch.Tensor:
    """x @ y (fp32 operands) under `scheme`, in float64."""
    if scheme == "fp16x3s":
        sx, sy = pow2_scale(x), pow2_scale(y)
        return product(x * sx, y * sy, "fp16x3") / (sx * sy)
    xs, ys = parts(x, scheme), parts(y.t().contiguous(), scheme)
    ys = [t.t() for t in ys]
    pairs = {"tf32x3": [(0, 0), (0, 1), (1, 0)], "bf16x3": [(0, 0), (0, 1), (1, 0)],
             "fp16x3": [(0, 0), (0, 1), (1, 0)],
             "bf16x6": [(i, j) for i in range(3) for j in range(3) if i + j <= 2]}[scheme]
    out = None
    for i, j in sorted(pairs, key=lambda ij: -(ij[0] + ij[1])):  # smallest first
        t = xs[i] @ ys[j]
        out = t if out is None else out + t
    return out


def operands(n: int, N: int, D: int, p: float, seed: int = 0) -> dict:
    """fp32 operands of the four products at one shape, as the kernels see them."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, D, generator=g) * 1.5
    keys = torch.tanh(torch.randn(N, D, generator=g) * 1.5)
    m = torch.where(torch.rand(n, D, generator=g) < p, -1.0, 1.0)
    s = 0.5 * math.log((1 - p) / p)
    Q = (s * LOG2E * m * torch.tanh(a)).float()
    S64 = Q.double() @ keys.double().t()
    P = torch.softmax(S64 * math.log(2.0), dim=1).float()  # exp2(S - lse2), rows sum to 1
    Pg = (P.double() / n).float()                            # g = 1/n: reduction "mean"
    return dict(Q=Q, K=keys.float(), P=P, Pg=Pg)


PRODUCTS = {  # name -> (left, right) as functions of the operands
    "S = Q K^T": lambda o: (o["Q"], o["K"].t()),
    "A = P K": lambda o: (o["P"], o["K"]),
    "dK = (P g)^T Q": lambda o: (o["Pg"].t(), o["Q"]),
}


def measure(n: int, N: int, D: int, p: float) -> list:
    o = operands(n, N, D, p)
    rows = []
    for name, f in PRODUCTS.items():
        x, y = f(o)
        x, y = x.contiguous(), y.contiguous()
        ref = x.double() @ y.double()
        errs = {}
        for scheme in SCHEMES:
            got = product(x, y, scheme)
            d = got - ref
            errs[scheme] = (float(d.norm() / ref.norm()), float(d.abs().max()))
        for scheme, (rel, mx) in errs.items():
            rows.append(dict(n=n, N=N, D=D, p=p, product=name, scheme=scheme,
                             rel_err=f"{rel:.3e}", max_abs_err=f"{mx:.3e}",
                             ratio_to_tf32x3=f"{rel / errs['tf32x3'][0]:.3f}"))
    return rows


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - no git: say so
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=256, help="query rows")
    ap.add_argument("--N", default="512,65536", help="keys, comma-separated")
    ap.add_argument("--D", type=int, default=128, help="code bits")
    ap.add_argument("--p", default="0.1,1e-4", help="flip probabilities, comma-separated")
    ap.add_argument("--csv", default=os.path.join(ROOT, "bench", "results",
                                                  "split_emulation_cpu.csv"),
                    help="CSV to append the rows to ('' for none)")
    args = ap.parse_args(argv)
    try:
        Ns = [int(x) for x in args.N.split(",") if x]
        ps = [float(x) for x in args.p.split(",") if x]
    except ValueError as exc:
        ap.error(f"--N / --p: {exc}")
    if args.n < 1 or args.D < 1 or not Ns or min(Ns) < 1:
        ap.error("--n, --D and every --N must be >= 1")
    if not ps or not all(0.0 < p < 0.5 for p in ps):
        ap.error("--p: flip probabilities must be in (0, 0.5)")
    if args.csv:  # a folder, a path under a file, a damaged CSV: before any measurement
        from bench_csv import check_output_file
        check_output_file(ap, "--csv", args.csv)
    base = dict(timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                host=socket.gethostname(), torch=torch.__version__, commit=_commit())
    rows = []
    print(f"{'n':>5s} {'N':>6s} {'p':>7s} {'product':16s} " + " ".join(f"{s:>9s}" for s in SCHEMES))
    for N in Ns:
        for p in ps:
            got = measure(args.n, N, args.D, p)
            rows += [dict(base, **r) for r in got]
            for name in PRODUCTS:
                errs = {r["scheme"]: r["rel_err"] for r in got if r["product"] == name}
                print(f"{args.n:5d} {N:6d} {p:7.0e} {name:16s} "
                      + " ".join(f"{errs[s]:>9s}" for s in SCHEMES), flush=True)
    if args.csv:
        from bench_loss import append_rows  # (a CSV with another header keeps its columns)
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        append_rows(args.csv, rows, FIELDS)
        print(f"appended {len(rows)} rows to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
