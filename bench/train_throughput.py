"""Training throughput: images/s and data-wait fraction of train.py's step for one config.

    python bench/train_throughput.py --arch resnet-tiny --method nac --batch-size 256
    python bench/train_throughput.py --data fashion-mnist --arch resnet18-small --method nac-mq
    torchrun --nproc_per_node=8 bench/train_throughput.py --data /path/imagenet --arch resnet50 \
        --method nac-mq --batch-size 1024 --amp bf16 --channels-last --loader dali-gpu

It runs train.py itself (same model, loss, optimizer, DDP, loader) for --warmup + --steps steps
with checkpoints off and measures the last --steps from train.py's log (img/s over all ranks,
data-wait = time blocked on the loader / wall time, on rank 0).  The last line printed is one
JSON object: {"arch", "method", "batch_size", "world_size", "device", "img_per_s", "data_wait",
"step_ms", ...}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--data", default="synthetic:65536",
                    help="synthetic[:N] (default, no data wait from decoding) or a train.py --data")
    ap.add_argument("--arch", default="resnet-tiny")
    ap.add_argument("--method", default="nac")
    ap.add_argument("--batch-size", type=int, default=256, help="global batch")
    ap.add_argument("--image-size", type=int, default=None)
    ap.add_argument("--steps", type=int, default=20, help="measured steps")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured first steps")
    ap.add_argument("--amp", default="auto")
    ap.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--loader", default="auto")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--queue-size", type=int, default=None)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be >= 1")

    import torch
    import train
    out = tempfile.mkdtemp(prefix="nac_tp_")
    total = args.warmup + args.steps
    targv = ["--data", args.data, "--arch", args.arch, "--method", args.method,
             "--batch-size", str(args.batch_size), "--max-steps", str(total),
             "--log-every", str(args.warmup), "--save-every", str(10 ** 9), "--no-progress",
             "--amp", args.amp, "--loader", args.loader, "--out", out,
             "--warmup-epochs", "0"]
    for flag, v in (("--image-size", args.image_size), ("--workers", args.workers),
                    ("--queue-size", args.queue_size)):
        if v is not None:
            targv += [flag, str(v)]
    if args.channels_last is not None:
        targv.append("--channels-last" if args.channels_last else "--no-channels-last")
    if args.compile:
        targv.append("--compile")
    # log-every = warmup: the log's first record covers the warm-up steps (compilation, first
    # allocations), the later ones only measured steps.  --steps is rounded up to whole windows.
    if args.steps % args.warmup:
        total = args.warmup * (1 + -(-args.steps // args.warmup))
        targv[targv.index("--max-steps") + 1] = str(total)
    status = train.main(targv)
    if status:
        sys.exit(status)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    with open(os.path.join(out, "log.jsonl")) as f:
        recs = [json.loads(line) for line in f][1:]
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    # windows have equal step counts, so the mean of rates weights them by time correctly only
    # via the harmonic mean: total images / total time
    secs = sum(args.warmup * args.batch_size / r["img_per_s"] for r in recs)
    imgs = args.warmup * args.batch_size * len(recs)
    wait = sum(r["data_wait"] * args.warmup * args.batch_size / r["img_per_s"] for r in recs)
    dev = "cpu"
    if torch.cuda.is_available() and cfg.get("device") != "cpu":
        dev = torch.cuda.get_device_name(0)
    res = {"arch": args.arch, "method": args.method, "data": args.data,
           "batch_size": args.batch_size, "world_size": cfg["world_size"],
           "image_size": cfg["image_size"], "amp": cfg["amp"],
           "channels_last": cfg["channels_last"], "compile": args.compile, "device": dev,
           "threads": torch.get_num_threads(), "measured_steps": len(recs) * args.warmup,
           "img_per_s": round(imgs / secs, 1), "data_wait": round(wait / secs, 4),
           "step_ms": round(1000 * secs / (len(recs) * args.warmup), 1)}
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
