"""Write images of an in-memory data set (Fashion-MNIST, CIFAR-10) as PNG files in class folders,
the layout `python -m nac_fast.index build` reads labels from: OUT/<class name>/<split>_<index>.png.

    python scripts/export_images.py --data fashion-mnist --split train --per-class 200 --out photos/
    python scripts/export_images.py --data fashion-mnist --split test --per-class 1 --out queries/

The first --per-class images of each class in data-set order (--offset skips that many first),
written losslessly (the PNG holds the exact uint8 pixels the data set has).  An existing --out is
refused unless --overwrite.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nac_fast.data.sources import InMemorySource, resolve_source  # noqa: E402

FASHION_MNIST_CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt",
                         "sneaker", "bag", "ankle-boot")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                   "truck")


def export(data: str, split: str, per_class: int, out: str, offset: int = 0) -> list:
    """Write the PNGs; returns their paths."""
    from PIL import Image
    src = resolve_source(data, split)
    if not isinstance(src, InMemorySource):
        raise ValueError(f"--data {data!r} is an image folder already; nothing to export")
    names = (FASHION_MNIST_CLASSES if "fashion" in src.name.lower() or src.images.shape[1] == 1
             else CIFAR10_CLASSES)
    written = []
    for c in range(src.num_classes):
        idx = (src.labels == c).nonzero().flatten()[offset:offset + per_class].tolist()
        d = os.path.join(out, names[c] if c < len(names) else str(c))
        os.makedirs(d, exist_ok=True)
        for i in idx:
            a = src.images[i].permute(1, 2, 0).numpy()
            im = Image.fromarray(a[:, :, 0] if a.shape[2] == 1 else a)
            p = os.path.join(d, f"{split}_{i:05d}.png")
            im.save(p)
            written.append(p)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="fashion-mnist")
    ap.add_argument("--split", default="test", choices=("train", "test"))
    ap.add_argument("--per-class", type=int, default=10)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    if args.per_class < 1 or args.offset < 0:
        ap.error("--per-class must be >= 1 and --offset >= 0")
    if os.path.exists(args.out) and os.listdir(args.out) and not args.overwrite:
        ap.error(f"--out {args.out!r} exists and is not empty; pass --overwrite")
    try:
        n = len(export(args.data, args.split, args.per_class, args.out, args.offset))
    except (ValueError, FileNotFoundError) as exc:
        ap.error(str(exc))
    print(f"wrote {n} images to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
