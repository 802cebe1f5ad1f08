"""The fp16 keys' gradient against float64: the Triton kernels under the interpreter, the CUDA
tensor-core kernel's rounding steps emulated in numpy, and the fp16 reference.

    TRITON_INTERPRET=1 python bench/fp16_keys_grad.py                 # n = 512, 2048, 8192
    TRITON_INTERPRET=1 python bench/fp16_keys_grad.py --n 512 --no-emulation

Case (issue 23, item 1): in-batch NAC, fp16 inputs, D = 64, p = 0.1, keys passed with gradient
(N = n), reduction "mean" and "sum"; a ~ N(0, scale^2), keys = tanh of the same (default 0.5:
a nearly flat softmax, P ~ 1/N, with keys' gradients fp16 can still hold; the inputs of
tests/test_cuda_mma_numerics.fp16_inputs).
--interp-blocks sets the interpreter's tiles (default 32x128, CI's) to wider ones: the
interpreter's time is per tile step, and the tiles only change the fp32 summation order.  The error is the norm-wise relative error
||g - g64|| / ||g64|| of the keys' gradient, g64 from the float64 reference on the same
(fp16-rounded) inputs.  With reduction="mean", g = 1/n and P ~ 1/N, so P g ~ 1e-8 at n = 8192:
below fp16's smallest subnormal (6e-8) when the kernel rounds P g to fp16 for the tensor cores.
The emulation (tests/test_cuda_mma_numerics.py: `emulate_keys_grad`) reads from
csrc/nac_cuda_mma.cu whether the kernel scales g.  Prints one line per case and a JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

import nac_fast  # noqa: E402




def keys_grad(a, r, keys, noise, reduction, backend, dtype=None):
    t = [x.to(dtype) if dtype else x for x in (a, r, keys)]
    t = [x.detach().clone().requires_grad_() for x in t]
    out = nac_fast.nac_loss(t[0], t[1], 0.1, keys=t[2], noise=noise.to(t[0].dtype),
                            reduction=reduction, backend=backend)
    out.backward()
    return t[2].grad


def rel_err(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="512,2048,8192")
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--reductions", default="mean,sum")
    ap.add_argument("--scale", type=float, default=0.5, help="size of the codes a and keys")
    ap.add_argument("--interp-blocks", default="", help="e.g. 128x512: the interpreter's tiles")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--no-emulation", action="store_true")
    args = ap.parse_args(argv)
    try:
        ns = [int(x) for x in args.n.split(",")]
    except ValueError:
        ap.error(f"--n: a comma list of integers, got {args.n!r}")
    if min(ns) < 1 or args.D < 1:
        ap.error(f"--n and --D must be >= 1, got --n {args.n} --D {args.D}")
    reductions = args.reductions.split(",")
    if not set(reductions) <= {"mean", "sum"}:
        ap.error(f"--reductions: a comma list of mean and sum, got {args.reductions!r}")
    if args.interp_blocks:
        try:
            bm, bn = (int(x) for x in args.interp_blocks.split("x"))
        except ValueError:
            ap.error(f"--interp-blocks: BMxBN, e.g. 128x512, got {args.interp_blocks!r}")
    triton = not args.no_triton
    if triton and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("set TRITON_INTERPRET=1 (the Triton kernels run under the interpreter here)")
    import test_cuda_mma_numerics as emu
    if args.interp_blocks and triton:
        from nac_fast.kernels import launch, nac_triton
        nac_triton._INTERP = {k: launch.Config(bm, bn) for k in nac_triton._INTERP}
    rows = []
    for n in ns:
        a, r, keys, noise = emu.fp16_inputs(n, n, args.D, args.scale)
        for reduction in reductions:
            row = dict(n=n, D=args.D, scale=args.scale, reduction=reduction)
            g64 = keys_grad(a, r, keys, noise, reduction, "reference", torch.float64)
            row["reference_fp16"] = rel_err(keys_grad(a, r, keys, noise, reduction, "reference"),
                                            g64)
            if triton:
                t0 = time.perf_counter()
                row["triton_interpreter"] = rel_err(
                    keys_grad(a, r, keys, noise, reduction, "triton"), g64)
                row["triton_s"] = round(time.perf_counter() - t0, 1)
            if not args.no_emulation:
                got = emu.emulate_keys_grad(a, r, keys, noise, reduction)
                row["cuda_emulation"] = rel_err(torch.from_numpy(got), g64)
                row["cuda_scales_g"] = emu.kernel_scales_g()
                row["cuda_emulation_unscaled"] = rel_err(torch.from_numpy(
                    emu.emulate_keys_grad(a, r, keys, noise, reduction, scaled=False)), g64)
            rows.append(row)
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
