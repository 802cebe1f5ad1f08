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

    python bench/eval_probe_memory.py --cli-path DIR --rows 400000 --dim 512 --classes 100
    python bench/eval_probe_memory.py --cli-path DIR ...     # again: the cached run

--cli-path DIR: the whole linear task as python -m nac_fast.eval runs it, in this fresh process,
without the image decoding and the network: a stand-in network (its encode gives h = a class
centre plus unit noise of --dim, and a = 32 float32 columns of it) and a loader of 256-image
batches go through the CLI's extract_features (h written once into its float16 SplitFeatures
buffer), the split is cached with the CLI's save_atomic as DIR/features_{train,test}.pt, then
check_finite_features and run_linear_probe (the cached probe) run on it.  When DIR already holds
both files they are loaded as a cache hit does (torch.load), instead.  Peak: VmHWM at the end
minus VmHWM after the imports (the interpreter and torch), against the stored features (h, a
and labels as cached).  DIR's feature files are this bench's own: it refuses a DIR holding
anything else.
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


class _StandInNetwork:
    """encode(x) -> (h, a): x holds each image's (label, index); h = centres[label] + unit noise
    drawn from a generator seeded by the batch's first index, a = h's first 32 columns, float32."""

    def __init__(self, centres):
        self.centres = centres

    def encode(self, x):
        g = torch.Generator().manual_seed(int(x[0, 1]))
        h = self.centres[x[:, 0]] + torch.randn(x.shape[0], self.centres.shape[1], generator=g)
        return h, h[:, :32].float().contiguous()


def _stand_in_loader(rows, classes, seed, batch=256):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (rows,), generator=g)
    for s in range(0, rows, batch):
        yb = y[s:s + batch]
        yield torch.stack([yb, torch.arange(s, s + len(yb)) + seed * rows], 1), yb


def cli_path(args, base) -> dict:
    """The linear task through the CLI's functions (see the module docstring)."""
    from types import SimpleNamespace

    from nac_fast.eval import cli
    from nac_fast.train.checkpoint import save_atomic
    os.makedirs(args.cli_path, exist_ok=True)
    names = {f"features_{s}.pt" for s in ("train", "test")}
    foreign = set(os.listdir(args.cli_path)) - names
    if foreign:
        raise SystemExit(f"--cli-path {args.cli_path!r} holds other files ({sorted(foreign)[0]}); "
                         "name a new folder")
    paths = {s: os.path.join(args.cli_path, f"features_{s}.pt") for s in ("train", "test")}
    hit = all(os.path.isfile(p) for p in paths.values())
    centres = torch.randn(args.classes, args.dim, generator=torch.Generator().manual_seed(0))
    net = _StandInNetwork(centres)
    t0 = time.perf_counter()
    feats = {}
    for split, rows, seed in (("train", args.rows, 1), ("test", args.test_rows, 2)):
        if hit:  # as load_or_extract reads a cache
            feats[split] = torch.load(paths[split], map_location="cpu", weights_only=True)
            continue
        f = cli.extract_features(net, _stand_in_loader(rows, args.classes, seed), rows, "cpu",
                                 True, f"features {split}")
        f["meta"] = {"bench": "eval_probe_memory --cli-path"}
        save_atomic(f, paths[split])
        feats[split] = f
    t_feat = time.perf_counter() - t0
    after_feat = vm("VmHWM")
    run = SimpleNamespace(tasks=["linear"], checkpoint="(stand-in)", which="online",
                          probe="cached", linear_epochs=args.epochs, linear_batch_size=256,
                          seed=0, linear_lrs=list(cli.PAPER_LINEAR_LRS), progress=False,
                          probe_device_mem=args.device_mem)
    cli.check_finite_features(None, run, feats)
    t0 = time.perf_counter()
    c0 = time.process_time()
    res = cli.run_linear_probe(run, feats["train"], feats["test"], torch.device("cpu"), None,
                               None)
    t_probe = time.perf_counter() - t0
    peak = vm("VmHWM")
    stored = sum(t.numel() * t.element_size() for f in feats.values()
                 for k, t in f.items() if k != "meta")
    h_bytes = sum(f["h"].numel() * f["h"].element_size() for f in feats.values())
    return {"mode": "cli-path " + ("cache hit" if hit else "extract + cache"),
            "rows": args.rows, "test_rows": args.test_rows, "dim": args.dim,
            "classes": args.classes, "epochs": args.epochs, "device_mem": args.device_mem,
            "h_dtype": str(feats["train"]["h"].dtype), "a_dtype": str(feats["train"]["a"].dtype),
            "plan": res.plan, "stored_feature_bytes": stored, "stored_h_bytes": h_bytes,
            "vmhwm_after_imports": base, "vmhwm_after_features": after_feat,
            "vmhwm_end": peak, "peak_over_imports": peak - base,
            "peak_over_imports_per_stored": (peak - base) / stored,
            "features_s": round(t_feat, 1), "probe_wall_s": round(t_probe, 1),
            "probe_cpu_s": round(time.process_time() - c0, 1),
            "test_top1": res.test_accuracy, "best_lr": res.best_lr,
            "load_1min": os.getloadavg()[0], "machine": platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__}


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
    ap.add_argument("--cli-path", default=None, metavar="DIR", help="the whole linear task "
                    "through the CLI's extraction, cache and probe, its feature cache in DIR")
    args = ap.parse_args(argv)
    for flag in ("rows", "test_rows", "dim", "classes", "epochs"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be positive")
    if args.cli_path is not None:
        from nac_fast.eval import cli  # noqa: F401  (its imports count in the baseline)
        from nac_fast.train import checkpoint  # noqa: F401
        print(json.dumps(cli_path(args, vm("VmHWM"))))
        return 0
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
