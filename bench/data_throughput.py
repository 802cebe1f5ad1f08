"""Throughput of the two-view pretraining pipeline alone (no model): images/s after --warmup
batches and the CPU time burnt per image (docs/training.md "The training throughput benchmark").

    python bench/data_throughput.py --data DIR --loader dali-cpu|dali-gpu|torchvision --size 224
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# common puts ROOT on sys.path
from common import append_rows, check_least, check_output_file, quantiles, run_fields  # noqa
from nac_fast.data import LOADERS, MIN_IMAGE_SIZE, build_pretrain_loader, dali_available  # noqa
from nac_fast.data.sources.synthetic import write_jpeg_folder  # noqa: E402

CSV_FIELDS = ["timestamp", "host", "device", "torch", "dali", "commit", "data", "loader",
              "num_images", "size", "batch", "batches", "workers", "dtype", "recipe",
              "view_shape", "seconds", "median_batch_s", "p20_batch_s", "p80_batch_s",
              "images_per_s", "views_per_s", "cpu_ms_per_image", "load_avg_1m", "cpus"]


def _tree_cpu_seconds() -> float:
    """user+sys seconds of this process, its reaped children, and its live descendants (the
    DataLoader workers, read from /proc) so far."""
    import resource
    own, reaped = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                   resource.RUSAGE_CHILDREN))
    total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
    todo, seen = [os.getpid()], set()
    while todo:  # descendants: utime + stime of /proc/PID/stat
        pid = todo.pop()
        try:
            if pid != os.getpid():
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = [int(k) for k in f.read().split() if int(k) not in seen]
        except (OSError, IndexError, ValueError):
            continue
        seen.update(kids)
        todo += kids
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--data", required=True, help="ImageFolder root, CIFAR dir or 'fashion-mnist'")
    add("--loader", default="auto", choices=LOADERS)
    add("--size", type=int, default=None, help="view size (default: natural size)")
    add("--batch", type=int, default=64)
    add("--batches", type=int, default=20, help="measured batches")
    add("--warmup", type=int, default=2)
    add("--workers", type=int, default=len(os.sched_getaffinity(0)), help="loader workers/threads")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    add("--channels-last", action="store_true")
    add("--recipe", default="auto", choices=["auto", "small", "imagenet"])
    add("--make-jpegs", type=int, default=0, metavar="N", help="first write N synthetic 256-500 "
        "px JPEGs (8 classes) to DATA/train if DATA is missing")
    add("--csv", default="", help="append the figures as a row to this CSV ('' = none)")
    a = ap.parse_args(argv)
    if a.csv:  # a folder, a path under a file, a damaged CSV: before any work
        check_output_file(ap, "--csv", a.csv)
    check_least(ap, a, {"--batch": 1, "--batches": 1, "--warmup": 0, "--workers": 0,
                        "--make-jpegs": 0})
    try:
        device = torch.device(a.device)
    except RuntimeError:
        ap.error(f"--device {a.device!r} is not a device (cpu, cuda, cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {a.device!r}: no CUDA device on this machine")
    if a.loader == "dali-gpu" and device.type != "cuda":
        ap.error(f"--loader dali-gpu decodes on the GPU: it needs --device cuda, got {a.device!r}")
    if a.size is not None and a.size < MIN_IMAGE_SIZE:
        ap.error(f"--size must be >= {MIN_IMAGE_SIZE}, got {a.size}")
    if a.make_jpegs and os.path.lexists(a.data) and not os.path.isdir(a.data):
        ap.error(f"--make-jpegs: --data {a.data!r} exists and is not a folder")
    if a.make_jpegs and not os.path.isdir(a.data):  # under train/: every image is read
        write_jpeg_folder(os.path.join(a.data, "train"), num_classes=8,
                          per_class=-(-a.make_jpegs // 8))
    warnings.simplefilter("once")
    try:
        loader = build_pretrain_loader(a.data, batch_size=a.batch, image_size=a.size,
                                       loader=a.loader, num_workers=a.workers, device=a.device,
                                       channels_last=a.channels_last,
                                       dtype=getattr(torch, a.dtype), recipe=a.recipe)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:  # bad --data, --size, --batch
        ap.error(str(exc))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def batches():
        for epoch in itertools.count():
            loader.set_epoch(epoch)
            yield from loader

    it = batches()
    for _ in range(a.warmup):
        next(it)
    sync()
    c0, t0 = _tree_cpu_seconds(), time.perf_counter()
    times = []
    for _ in range(a.batches):
        v1, v2 = next(it)
        sync()  # per batch: the batch times' spread (a GPU pipeline's own queue still overlaps)
        times.append(time.perf_counter() - t0 - sum(times))
    dt, cpu, n = time.perf_counter() - t0, _tree_cpu_seconds() - c0, a.batches * a.batch
    result = {
        "loader": getattr(loader, "kind", a.loader), "data": a.data,
        "num_images": loader.num_images, "size": loader.image_size, "batch": a.batch,
        "batches": a.batches, "workers": a.workers, "device": a.device, "dtype": a.dtype,
        "recipe": loader.recipe.name, "view_shape": list(v1.shape), "seconds": round(dt, 3),
        **{f"{k}_batch_s": round(v, 6) for k, v in zip(("median", "p20", "p80"), quantiles(times))},
        "images_per_s": round(n / dt, 1), "views_per_s": round(2 * n / dt, 1),
        "cpu_ms_per_image": round(1e3 * cpu / n, 2), "load_avg_1m": os.getloadavg()[0],
        "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
        "dali": dali_available(), "host": platform.node()}
    if a.csv:
        row = {k: v for k, v in result.items() if k in CSV_FIELDS}
        fields = run_fields(a.device)
        row.update(timestamp=fields["timestamp"], commit=fields["commit"],
                   view_shape="x".join(map(str, v1.shape)))
        append_rows(a.csv, [row], CSV_FIELDS)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
