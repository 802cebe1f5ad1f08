"""Write images of an in-memory data set (Fashion-MNIST, CIFAR-10) as PNG files in class folders,
the layout `python -m nac_fast.index build` reads labels from: OUT/<class name>/<split>_<index>.png.

    python scripts/export_images.py --data fashion-mnist --split train --per-class 200 --out photos/
    python scripts/export_images.py --data fashion-mnist --split test --per-class 1 --out queries/

The first --per-class images of each class in data-set order (--offset skips that many first),
written losslessly (the PNG holds the exact uint8 pixels the data set has).  An existing, non-empty
--out is refused unless --overwrite, which replaces the previous export whole: the new one is
written into a temporary folder first, then the old export's files (<class>/<split>_<index>.png,
nothing else) are deleted and the new ones moved in, so the folder holds exactly the asked images.
Bad arguments (an --out that is a file or cannot be written, an --offset past every class, ...)
exit with status 2 before anything is written.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nac_fast._files import check_writable  # noqa: E402
from nac_fast.data.sources import InMemorySource, resolve_source  # noqa: E402

FASHION_MNIST_CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt",
                         "sneaker", "bag", "ankle-boot")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                   "truck")


# the files an export writes: OUT/<class>/<split>_<index>.png
EXPORTED = re.compile(r"(train|test)_\d{5,}\.png")


def _source(data: str, split: str):
    src = resolve_source(data, split)
    if not isinstance(src, InMemorySource):
        raise ValueError(f"--data {data!r} is an image folder already; nothing to export")
    return src


def _class_names(src):
    names = (FASHION_MNIST_CLASSES if "fashion" in src.name.lower() or src.images.shape[1] == 1
             else CIFAR10_CLASSES)
    return [names[c] if c < len(names) else str(c) for c in range(src.num_classes)]


def export(data: str, split: str, per_class: int, out: str, offset: int = 0, src=None,
           progress: bool = False) -> list:
    """Write the PNGs (a tqdm bar with an ETA on stderr with `progress`); returns their paths."""
    from PIL import Image
    from tqdm.auto import tqdm
    src = _source(data, split) if src is None else src
    names = _class_names(src)
    per = [(c, (src.labels == c).nonzero().flatten()[offset:offset + per_class].tolist())
           for c in range(src.num_classes)]
    written = []
    with tqdm(total=sum(len(idx) for _, idx in per), unit="img", desc="export",
              disable=not progress) as bar:
        for c, idx in per:
            d = os.path.join(out, names[c])
            os.makedirs(d, exist_ok=True)
            for i in idx:
                a = src.images[i].permute(1, 2, 0).numpy()
                im = Image.fromarray(a[:, :, 0] if a.shape[2] == 1 else a)
                p = os.path.join(d, f"{split}_{i:05d}.png")
                im.save(p)
                written.append(p)
                bar.update()
    return written


def remove_old_export(out: str, names) -> int:
    """Delete the files a previous export wrote in out (<class>/<split>_<index>.png of the data
    set's class names) and the class folders this leaves empty; nothing else."""
    gone = 0
    for name in names:
        d = os.path.join(out, name)
        if not os.path.isdir(d) or os.path.islink(d):
            continue
        for f in os.listdir(d):
            p = os.path.join(d, f)
            if EXPORTED.fullmatch(f) and os.path.isfile(p) and not os.path.islink(p):
                os.unlink(p)
                gone += 1
        if not os.listdir(d):
            os.rmdir(d)
    return gone


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="fashion-mnist")
    ap.add_argument("--split", default="test", choices=("train", "test"))
    ap.add_argument("--per-class", type=int, default=10)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bar (on stderr, with an ETA)")
    args = ap.parse_args(argv)
    if args.per_class < 1:
        ap.error(f"--per-class must be >= 1, got {args.per_class}")
    if args.offset < 0:
        ap.error(f"--offset must be >= 0, got {args.offset}")
    out = args.out
    if not out:
        ap.error("--out must name a folder, got ''")
    if os.path.lexists(out) and not os.path.isdir(out):
        ap.error(f"--out {out!r} exists and is not a folder")
    if os.path.isdir(out) and os.listdir(out) and not args.overwrite:
        ap.error(f"--out {out!r} exists and is not empty; pass --overwrite")
    try:
        check_writable("--out", os.path.join(out, "x.png"))
        src = _source(args.data, args.split)
    except (ValueError, FileNotFoundError) as exc:
        ap.error(str(exc))
    largest = max(int((src.labels == c).sum()) for c in range(src.num_classes))
    if args.offset >= largest:
        ap.error(f"--offset {args.offset} skips every image: the largest class of the "
                 f"{args.split} split has {largest}")
    names = _class_names(src)
    for name in names:  # a class's folder taken by a file of the user's: refused before any change
        d = os.path.join(out, name)
        if os.path.lexists(d) and (os.path.islink(d) or not os.path.isdir(d)):
            ap.error(f"--out {out!r}: {d!r} is not a folder, and the export writes its "
                     f"{name!r} images there; move it away or give another --out")
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-export-", dir=parent)
    except OSError as exc:
        ap.error(f"--out {out!r}: {exc.strerror or exc}")
    try:
        n = len(export(args.data, args.split, args.per_class, tmp, args.offset, src=src,
                       progress=args.progress))
        if not os.path.isdir(out):
            os.rename(tmp, out)
        else:
            # replace the previous export whole: its files go, the new ones move in
            remove_old_export(out, names)
            for name in sorted(os.listdir(tmp)):
                d = os.path.join(out, name)
                os.makedirs(d, exist_ok=True)
                for f in sorted(os.listdir(os.path.join(tmp, name))):
                    os.replace(os.path.join(tmp, name, f), os.path.join(d, f))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {n} images to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
