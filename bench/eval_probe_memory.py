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
high-water mark), read before the features are made (the interpreter and torch), after; then VmRSS with the
features stored and the temporaries of making them freed, VmHWM reset to it (clear_refs), and
VmHWM after the probe: the probe's peak over the resting features is its own overhead.  Prints one JSON line.
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


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: "5" > /proc/self/clear_refs), so that the
    probe's peak is not the peak of making the features."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


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
    import gc
    gc.collect()
    resting = vm("VmRSS")  # the features stored, the temporaries of making them freed
    reset = reset_peak()
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
           "vmrss_resting": resting, "peak_reset": reset, "vmhwm_after_probe": peak,
           "peak_over_start": peak - base, "peak_over_start_per_stored": (peak - base) / stored,
           "probe_peak_over_resting": peak - resting,
           "probe_peak_over_resting_per_stored": (peak - resting) / stored,
           "make_s": round(t_make, 1), "probe_wall_s": round(t_probe, 1),
           "probe_cpu_s": round(time.process_time() - c0, 1),
           "test_top1": res.test_accuracy, "best_lr": res.best_lr,
           "load_1min": os.getloadavg()[0], "machine": platform.machine(),
           "cpus": os.cpu_count(), "torch": torch.__version__}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
