"""Wall time and peak host memory of the linear probe (nac_fast.eval.metrics.linear_probe) on
synthetic ImageNet-sized cached features, in this fresh process (issue 55 point 3).

    python bench/eval_probe_memory.py --rows 1281167 --dim 256 --epochs 1      # the recorded run
    python bench/eval_probe_memory.py --rows 20000 --dim 64 --epochs 1         # a quick look

Features: --classes Gaussian class centres (scale 1) plus unit noise, --dtype storage, written
into one preallocated nac_fast.eval.features.FeatureBuffer 65,536 rows at a time (no float32
copy of the whole set is ever made); labels uniform int64 class ids; a test set of --test-rows.
The probe is the protocol's (4 rates searched on a 10% held-out split, then the final fit) with
--epochs epochs instead of 100; --device-mem bounds its device memory (on the CPU: the streamed
path's chunk buffers).  Peak memory: VmHWM of /proc/self/status (the process's resident-set
high-water mark), read before the features are made, after, and after the probe; the figure of
interest is the growth over the stored features.  Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nac_fast.eval.features import FEATURE_DTYPES, FeatureBuffer  # noqa: E402
from nac_fast.eval.metrics import linear_probe  # noqa: E402


def vm(key: str) -> int:
    """A /proc/self/status figure in bytes (VmHWM, VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def make(rows, dim, classes, dtype, seed, centres):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (rows,), generator=g)
    buf = FeatureBuffer(rows, dim, dtype)
    for s in range(0, rows, 65536):
        yb = y[s:s + 65536]
        buf.write(centres[yb] + torch.randn(len(yb), dim, generator=g))
    return buf.commit(), y


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1281167)
    ap.add_argument("--test-rows", type=int, default=50000)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--dtype", default="float16", choices=list(FEATURE_DTYPES))
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--device-mem", default=None, help="linear_probe device_mem (e.g. 64M)")
    ap.add_argument("--stream", action="store_true", help="force the streamed path")
    args = ap.parse_args(argv)
    base = vm("VmHWM")
    t0 = time.perf_counter()
    centres = torch.randn(args.classes, args.dim, generator=torch.Generator().manual_seed(0))
    dtype = FEATURE_DTYPES[args.dtype]
    tr, ytr = make(args.rows, args.dim, args.classes, dtype, 1, centres)
    te, yte = make(args.test_rows, args.dim, args.classes, dtype, 2, centres)
    t_make = time.perf_counter() - t0
    after_make = vm("VmHWM")
    stored = tr.numel() * tr.element_size() + te.numel() * te.element_size()
    t0 = time.perf_counter()
    c0 = time.process_time()
    res = linear_probe(tr, ytr, te, yte, epochs=args.epochs, device_mem=args.device_mem,
                       stream=True if args.stream else None)
    t_probe = time.perf_counter() - t0
    peak = vm("VmHWM")
    out = {"rows": args.rows, "test_rows": args.test_rows, "dim": args.dim,
           "classes": args.classes, "dtype": args.dtype, "epochs": args.epochs,
           "device_mem": args.device_mem, "plan": res.plan,
           "stored_feature_bytes": stored, "vmhwm_start": base, "vmhwm_after_features": after_make,
           "vmhwm_after_probe": peak, "growth_over_start": peak - base,
           "growth_over_start_per_stored": (peak - base) / stored,
           "probe_growth_over_features": peak - after_make,
           "make_s": round(t_make, 1), "probe_wall_s": round(t_probe, 1),
           "probe_cpu_s": round(time.process_time() - c0, 1),
           "test_top1": res.test_accuracy, "best_lr": res.best_lr,
           "load_1min": os.getloadavg()[0], "machine": platform.machine(),
           "cpus": os.cpu_count(), "torch": torch.__version__}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
