"""Write a small labelled ImageFolder (root/train/<class>/*.png, root/val/<class>/*.png) from data
that ships with this machine's packages, for checks on data the recipes were not tuned on.

    python scripts/make_image_folder.py digits OUT      # scikit-learn's 1,797 handwritten digits
    python scripts/make_image_folder.py shapes OUT      # procedural coloured shapes, 10 classes

digits   scikit-learn's bundled 8x8 digits (UCI), 10 classes, upsampled to --size px (bilinear),
         grey on black, saved as RGB PNGs; 80% train / 20% val, stratified, seeded.  Needs
         scikit-learn (`make setup` installs it; not a dependency of nac_fast).
shapes   --per-class images per class of 10 shapes (disc, square, triangle, cross, ring, star,
         horizontal bars, vertical bars, diagonal stripes, dots), each with a random colour,
         background colour, size, position and rotation, plus pixel noise; 80/20 split.

Refuses to write into a non-empty OUT (nothing of the user's is overwritten); writes into a
temporary folder beside OUT and renames it into place at the end (no half-written folder).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
from PIL import Image, ImageDraw

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nac_fast._files import atomic_folder, check_writable  # noqa: E402

MAX_SIZE = 4096  # --size: a small labelled folder, 3 x size^2 bytes an image
SHAPES = ("disc", "square", "triangle", "cross", "ring", "star", "hbars", "vbars", "diagonal",
          "dots")


def digits(size: int, seed: int):
    from sklearn.datasets import load_digits
    d = load_digits()
    imgs = []
    for x in d.images:  # values 0..16
        im = Image.fromarray(np.uint8(np.clip(x * 16, 0, 255))).resize((size, size),
                                                                        Image.BILINEAR)
        imgs.append(im.convert("RGB"))
    return imgs, [str(int(t)) for t in d.target]


def _shape(draw, kind, cx, cy, r, angle, color, rng):
    def rot(px, py):
        c, s = math.cos(angle), math.sin(angle)
        return cx + c * px - s * py, cy + s * px + c * py
    if kind == "disc":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif kind == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=color, width=max(2, int(r / 3)))
    elif kind == "square":
        draw.polygon([rot(-r, -r), rot(r, -r), rot(r, r), rot(-r, r)], fill=color)
    elif kind == "triangle":
        draw.polygon([rot(0, -r), rot(r * 0.87, r / 2), rot(-r * 0.87, r / 2)], fill=color)
    elif kind == "cross":
        w = r / 3
        draw.polygon([rot(-r, -w), rot(r, -w), rot(r, w), rot(-r, w)], fill=color)
        draw.polygon([rot(-w, -r), rot(w, -r), rot(w, r), rot(-w, r)], fill=color)
    elif kind == "star":
        pts = [rot((r if i % 2 == 0 else r / 2.5) * math.cos(i * math.pi / 5 - math.pi / 2),
                   (r if i % 2 == 0 else r / 2.5) * math.sin(i * math.pi / 5 - math.pi / 2))
               for i in range(10)]
        draw.polygon(pts, fill=color)
    elif kind in ("hbars", "vbars", "diagonal"):
        n, w = 3, r / 4
        for i in range(n):
            off = (i - (n - 1) / 2) * r * 0.7
            if kind == "hbars":
                q = [(-r, off - w), (r, off - w), (r, off + w), (-r, off + w)]
            elif kind == "vbars":
                q = [(off - w, -r), (off + w, -r), (off + w, r), (off - w, r)]
            else:
                q = [(off - w - r / 2, -r), (off + w - r / 2, -r), (off + w + r / 2, r),
                     (off - w + r / 2, r)]
            draw.polygon([(cx + x, cy + y) for x, y in q], fill=color)
    elif kind == "dots":
        for _ in range(5):
            px, py = rng.uniform(-r, r, 2)
            d = max(1.5, r / 5)
            draw.ellipse([cx + px - d, cy + py - d, cx + px + d, cy + py + d], fill=color)


def shapes(size: int, per_class: int, seed: int):
    rng = np.random.default_rng(seed)
    imgs, labels = [], []
    for k, kind in enumerate(SHAPES):
        for _ in range(per_class):
            bg = tuple(int(v) for v in rng.integers(0, 256, 3))
            while True:  # a foreground colour far enough from the background
                fg = tuple(int(v) for v in rng.integers(0, 256, 3))
                if sum(abs(a - b) for a, b in zip(fg, bg)) > 150:
                    break
            im = Image.new("RGB", (size, size), bg)
            r = rng.uniform(0.2, 0.4) * size
            cx, cy = rng.uniform(r, size - r, 2)
            _shape(ImageDraw.Draw(im), kind, cx, cy, r, rng.uniform(0, 2 * math.pi), fg, rng)
            x = np.asarray(im, dtype=np.float32) + rng.normal(0, 12, (size, size, 3))
            imgs.append(Image.fromarray(np.uint8(np.clip(x, 0, 255))))
            labels.append(kind)
    return imgs, labels


def split(labels, val_frac: float, seed: int):
    """Stratified: per class, a seeded permutation; the first val_frac go to val."""
    rng = np.random.default_rng(seed + 1)
    labels = np.asarray(labels)
    val = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        val[idx[:int(round(val_frac * len(idx)))]] = True
    return val


def val_count(n: int, val_frac: float) -> int:
    """Images of a class of n that split() puts in val/."""
    return int(round(val_frac * n))


def check_sides(counts: dict, val_frac: float) -> None:
    """ValueError naming --val-frac unless every class keeps >= 1 image in train/ and in val/."""
    for c, n in sorted(counts.items()):
        v = val_count(n, val_frac)
        if not 1 <= v <= n - 1:
            raise ValueError(f"--val-frac {val_frac} puts {v} of class {c!r}'s {n} images in "
                             f"val/ and {n - v} in train/: each class needs at least one image on "
                             "each side (pick a fraction nearer 0.5, or more --per-class)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("source", choices=("digits", "shapes"))
    ap.add_argument("out", help="the folder to create (must not exist or be empty)")
    ap.add_argument("--size", type=int, default=32, help="image side in pixels")
    ap.add_argument("--per-class", type=int, default=300, help="shapes: images per class")
    ap.add_argument("--val-frac", type=float, default=0.2, help="fraction held out as val/")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 8 <= args.size <= MAX_SIZE:   # a small labelled folder: 3 x size^2 bytes an image
        ap.error(f"--size must lie in [8, {MAX_SIZE}], got {args.size}")
    if args.source == "shapes" and args.per_class < 5:  # digits has its own class sizes
        ap.error(f"--per-class must be >= 5, got {args.per_class}")
    if not 0 < args.val_frac < 1:
        ap.error(f"--val-frac must lie in (0, 1), got {args.val_frac}")
    if args.source == "shapes":
        try:
            check_sides({"each": args.per_class}, args.val_frac)
        except ValueError as exc:
            ap.error(str(exc))
    out = os.path.abspath(args.out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        ap.error(f"{out} exists and is not an empty folder: give a new OUT")
    try:
        check_writable("OUT", os.path.join(out, "x"))
    except ValueError as exc:
        ap.error(str(exc))
    if args.source == "digits":
        try:
            import sklearn  # noqa: F401
        except ImportError:
            ap.error("digits: the data set ships with scikit-learn, which is not installed "
                     "(pip install scikit-learn, or `make setup`); 'shapes' needs nothing more")
    imgs, labels = (digits(args.size, args.seed) if args.source == "digits"
                    else shapes(args.size, args.per_class, args.seed))
    try:
        check_sides({c: labels.count(c) for c in set(labels)}, args.val_frac)
    except ValueError as exc:
        ap.error(str(exc))
    val = split(labels, args.val_frac, args.seed)
    with atomic_folder(out) as tmp:  # an empty out (checked above) is replaced
        for i, (im, lab, v) in enumerate(zip(imgs, labels, val)):
            d = os.path.join(tmp, "val" if v else "train", lab)
            os.makedirs(d, exist_ok=True)
            im.save(os.path.join(d, f"{i:05d}.png"))
    print(f"{out}: {int((~val).sum())} train / {int(val.sum())} val images, "
          f"{len(set(labels))} classes, {args.size} px")
    return 0


if __name__ == "__main__":
    sys.exit(main())
