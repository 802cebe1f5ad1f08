"""Feature-extraction images/s of python -m nac_fast.eval, before and after issue 55's
changes, in one process on the same split, so that both see the same machine load.

    python bench/eval_extract.py --checkpoint CKPT [--data fashion-mnist] [--split train]
        [--chunk 4096] [--rounds 1]

old: the network as trained (eager, NCHW, whole --batch-size batches), what the CLI ran before
(and runs with --eager-extraction --workers 0); new: the CLI's default network
(nac_fast.eval.extraction.extraction_network: batch norm folded, channels-last, CPU
micro-batches).  The split is cut into chunks of --chunk images and each chunk is extracted by
old then new, alternately (new first in every other chunk), so a change of load hits both; the
table sums each one's wall and CPU time over the whole split.  Both go through
cli.extract_features with the loader of the split (the in-memory loader for fashion-mnist).
Results: bench/results/eval_extract_cpu.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from nac_fast.data import build_eval_loader  # noqa: E402
from nac_fast.eval.cli import extract_features  # noqa: E402
from nac_fast.eval.extraction import CPU_MICRO_BATCH, extraction_network  # noqa: E402
from nac_fast.train.checkpoint import load_checkpoint, load_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--data", default="fashion-mnist")
    ap.add_argument("--split", default="train", choices=("train", "test"))
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=4096, help="images per alternation")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the split")
    args = ap.parse_args(argv)
    for flag in ("batch_size", "chunk", "rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not os.path.isfile(args.checkpoint):
        ap.error(f"--checkpoint {args.checkpoint!r}: no such file")
    cfg = load_checkpoint(args.checkpoint)["config"]
    model = load_model(args.checkpoint, "online").eval()
    variants = {"old": (model, {}),
                "new": (extraction_network(model), {"micro_batch": CPU_MICRO_BATCH,
                                                    "channels_last": True})}
    loader = build_eval_loader(args.data, split=args.split, batch_size=args.batch_size,
                               image_size=int(cfg["image_size"]))
    everything = loader.indices.copy()
    n = len(everything)
    wall = {k: 0.0 for k in variants}
    cpu = dict(wall)
    feats = {k: [] for k in variants}
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        for i, s in enumerate(range(0, n, args.chunk)):
            loader.indices = everything[s:s + args.chunk]
            order = list(variants) if (i + r) % 2 == 0 else list(variants)[::-1]
            for k in order:
                net, opts = variants[k]
                c0, t0 = time.process_time(), time.perf_counter()
                f = extract_features(net, loader, len(loader.indices), "cpu", False, k, **opts)
                wall[k] += time.perf_counter() - t0
                cpu[k] += time.process_time() - c0
                if r == 0:
                    feats[k].append(f["h"])
    print(f"{args.data} {args.split} split, {n} images x {args.rounds} round(s), chunks of "
          f"{args.chunk}, torch threads {torch.get_num_threads()}, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')}, load average {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    print("| path | wall s | images/s | CPU s | images per CPU-second |")
    print("|---|---|---|---|---|")
    for k in variants:
        m = n * args.rounds
        print(f"| {k} | {wall[k]:.1f} | {m / wall[k]:.0f} | {cpu[k]:.1f} | {m / cpu[k]:.0f} |")
    print(f"new / old: {wall['old'] / wall['new']:.2f}x images/s, "
          f"{cpu['old'] / cpu['new']:.2f}x images per CPU-second")
    h_old, h_new = torch.cat(feats["old"]), torch.cat(feats["new"])
    print(f"max |h_new - h_old| = {float((h_new - h_old).abs().max()):.2e} "
          f"(max |h| {float(h_old.abs().max()):.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
