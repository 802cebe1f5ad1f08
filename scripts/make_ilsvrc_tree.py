"""Write an ILSVRC2012-shaped tree of generated JPEGs, for tests and start-up benchmarks.

The layout, names, labels files and quirks of ImageNet as distributed, at any size (no download):

    python scripts/make_ilsvrc_tree.py --out tree --classes 100 --train-per-class 1000 --size 32
    python scripts/make_ilsvrc_tree.py --out tree --classes 10 --train-per-class 20 \\
        --val-per-class 5 --quirks grey=0.05,cmyk=0.02,png=0.02,exif=0.02,truncated=0.02 --devkit

OUT/train/<wnid>/<wnid>_<k>.JPEG     class folders named by WordNet ids (n01440764 style; drawn
                                     from --seed), k distinct numbers per class
OUT/val/ILSVRC2012_val_00000001.JPEG ...   flat, the classes in a seeded shuffled order
OUT/LOC_val_solution.csv             `ImageId,PredictionString`, rows
                                     `ILSVRC2012_val_00000001,n01751748 x y x y n01751748 x y x y`
                                     (one or two boxes of the image's class; rows in a shuffled
                                     order, as Kaggle's file)
OUT/LOC_synset_mapping.txt           `n01440764 words` per class, sorted by WordNet id (Kaggle's)
OUT/ILSVRC2012_devkit_t12/data/      with --devkit: ILSVRC2012_validation_ground_truth.txt (the
                                     1-based ILSVRC2012_ID of val image i on line i) and
                                     synsets.txt (`wnid words` on line ILSVRC2012_ID: the devkit's
                                     synset order, a seeded permutation; the real devkit keeps it
                                     in meta.mat)
OUT/make_ilsvrc_tree.json            the arguments and which files carry which quirk

Images are --size px squares (an EXIF-rotated one is stored 3/4 --size wide and --size high,
and is --size wide and 3/4 --size high once its rotation is applied) of smooth colour fields and
shapes, a few templates per class encoded once; each file is a template's bytes with its own
name in a JPEG comment (distinct files, cheap to write).
--quirks NAME=FRACTION,...: that fraction of all files (train and val; rounded, at least one when
the fraction is > 0) carries the quirk, as ImageNet's files do at lower rates:
  grey       a one-channel (L) JPEG
  cmyk       a CMYK JPEG
  png        PNG bytes named .JPEG
  exif       a JPEG whose EXIF orientation (6) rotates it by 90 degrees
  truncated  a JPEG cut to 60% of its bytes: its header passes the loaders' scan, its decode
             fails (their --on-bad-file policy)
Refuses a non-empty --out unless --overwrite; writes into a temporary folder beside it and renames
it into place at the end (no half-written tree; --overwrite replaces the old tree only then).
--reuse keeps an --out whose make_ilsvrc_tree.json records the same arguments (one line says so),
replaces a tree made with other arguments only with --overwrite, and refuses a non-empty --out
that is not such a tree (even with --overwrite).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import struct
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nac_fast._files import atomic_folder, check_writable  # noqa: E402
from nac_fast.data.sources.synthetic import synth_image  # noqa: E402

QUIRKS = ("grey", "cmyk", "png", "exif", "truncated")
MAX_SIZE = 1024
MAX_CLASSES = 20_000
TEMPLATES = 4            # JPEG templates per class (each file: a template + its own comment)
TRUNCATE_AT = 0.6        # a truncated file keeps this part of its bytes
QUALITY = 90
DEVKIT = os.path.join("ILSVRC2012_devkit_t12", "data")
# what make_ilsvrc_tree.json records of the arguments (a tree with the same ones is --reuse'd)
ARGUMENTS = ("classes", "train_per_class", "val_per_class", "size", "seed", "quirks", "devkit")


def parse_quirks(text: str) -> dict:
    """{quirk: fraction} from 'grey=0.01,cmyk=0.002' ('none' or '': {}).  ValueError naming
    --quirks for an unknown quirk, a fraction outside [0, 1], or fractions summing over 1."""
    out: dict = {}
    if text.strip().lower() in ("", "none"):
        return out
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        if name not in QUIRKS or not eq:
            raise ValueError(f"--quirks: {part.strip()!r} is not NAME=FRACTION with NAME one of "
                             f"{', '.join(QUIRKS)}")
        try:
            frac = float(value)
        except ValueError:
            frac = -1.0
        if not 0 <= frac <= 1:
            raise ValueError(f"--quirks: {name}'s fraction must lie in [0, 1], got {value!r}")
        if name in out:
            raise ValueError(f"--quirks: {name} is given twice")
        out[name] = frac
    if sum(out.values()) > 1:
        raise ValueError(f"--quirks: the fractions sum to {sum(out.values()):g} > 1 (one quirk "
                         "per file)")
    return out


def wordnet_ids(classes: int, seed: int) -> list:
    """`classes` distinct n%08d ids, sorted, drawn from `seed` (n01440764 style)."""
    rng = np.random.default_rng([seed, 1])
    return [f"n{v:08d}" for v in sorted(rng.choice(np.arange(1_000_000, 15_000_000), classes,
                                                   replace=False))]


def _encode(im: Image.Image, fmt="JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _with_comment(jpeg: bytes, text: str) -> bytes:
    """A JPEG's bytes with a COM segment holding `text` right after its SOI marker."""
    payload = text.encode()
    return jpeg[:2] + b"\xff\xfe" + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


def _quirk_bytes(im: Image.Image, quirk: str) -> bytes:
    if quirk == "grey":
        return _encode(im.convert("L"), quality=QUALITY)
    if quirk == "cmyk":
        return _encode(im.convert("CMYK"), quality=QUALITY)
    if quirk == "png":
        return _encode(im, "PNG")
    if quirk == "exif":
        w, h = im.size
        upright = im.resize((w, max(1, h * 3 // 4)))
        exif = Image.Exif()
        exif[0x0112] = 6          # orientation 6: shown rotated 90 degrees clockwise
        return _encode(upright.transpose(Image.Transpose.ROTATE_90), quality=QUALITY,
                       exif=exif.tobytes())
    if quirk == "truncated":
        b = _encode(im, quality=QUALITY)
        return b[:int(len(b) * TRUNCATE_AT)]
    raise ValueError(f"quirk must be one of {QUIRKS}, got {quirk!r}")


def _class_images(args):
    """The TEMPLATES images of one class (PIL) and their JPEG bytes."""
    seed, c, size = args
    rng = np.random.default_rng([seed, 2, c])
    ims = [synth_image(rng, size, size) for _ in range(TEMPLATES)]
    return ims, [_encode(im, quality=QUALITY) for im in ims]


def _write_class(job):
    """Write one class's files: job = (seed, class index, size, [(path, template, quirk)])."""
    seed, c, size, files = job
    ims, jpegs = _class_images((seed, c, size))
    for path, t, quirk in files:
        data = (_quirk_bytes(ims[t], quirk) if quirk else
                _with_comment(jpegs[t], os.path.basename(path)))
        with open(path, "wb") as f:
            f.write(data)
    return len(files)


def plan(classes, train_per_class, val_per_class, size, seed, quirks):
    """The tree as data: wnids, {class: [(relative path, template, quirk)]}, val labels (class
    index of val image i), devkit order (a permutation of the class indices), boxes."""
    wnids = wordnet_ids(classes, seed)
    rng = np.random.default_rng([seed, 3])
    files = {c: [] for c in range(classes)}
    for c, w in enumerate(wnids):
        ks = np.sort(rng.choice(np.arange(1, 20 * train_per_class + 2), train_per_class,
                                replace=False))
        files[c] += [(os.path.join("train", w, f"{w}_{k}.JPEG"), int(k) % TEMPLATES, None)
                     for k in ks]
    val_labels = rng.permutation(np.repeat(np.arange(classes), val_per_class))
    for i, c in enumerate(val_labels):
        files[int(c)].append((os.path.join("val", f"ILSVRC2012_val_{i + 1:08d}.JPEG"),
                              i % TEMPLATES, None))
    flat = [(c, j) for c in range(classes) for j in range(len(files[c]))]
    order = rng.permutation(len(flat))
    chosen: dict = {q: [] for q in quirks}
    at = 0
    for q, frac in quirks.items():
        n = 0 if frac == 0 else max(1, int(round(frac * len(flat))))
        for i in order[at:at + n]:
            c, j = flat[i]
            path, t, _ = files[c][j]
            files[c][j] = (path, t, q)
            chosen[q].append(path)
        at += n
    if at > len(flat):
        raise ValueError(f"--quirks: {at} quirky files asked of a tree of {len(flat)}")
    devkit_order = rng.permutation(classes)            # devkit ID k (1-based) = class order[k-1]
    boxes = rng.integers(0, size, (len(val_labels), 2, 4))
    nbox = rng.integers(1, 3, len(val_labels))
    return wnids, files, val_labels, devkit_order, boxes, nbox, {q: sorted(v) for q, v in
                                                                 chosen.items()}


def recorded_arguments(out: str):
    """The ARGUMENTS that out/make_ilsvrc_tree.json records, or None when it records none."""
    try:
        with open(os.path.join(out, "make_ilsvrc_tree.json")) as f:
            made = json.load(f)
        return {k: made[k] for k in ARGUMENTS}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_labels(tmp, wnids, val_labels, devkit_order, boxes, nbox, devkit, rng):
    rows = []
    for i, c in enumerate(val_labels):
        w = wnids[int(c)]
        parts = []
        for b in boxes[i][:nbox[i]]:
            (x0, x1), (y0, y1) = sorted(b[:2]), sorted(b[2:])
            parts.append(f"{w} {x0} {y0} {x1} {y1}")
        bs = " ".join(parts)
        rows.append(f"ILSVRC2012_val_{i + 1:08d},{bs}")
    rows = [rows[i] for i in rng.permutation(len(rows))]
    with open(os.path.join(tmp, "LOC_val_solution.csv"), "w") as f:
        f.write("ImageId,PredictionString\n" + "".join(r + "\n" for r in rows))
    with open(os.path.join(tmp, "LOC_synset_mapping.txt"), "w") as f:
        f.write("".join(f"{w} class {c} of the generated tree\n" for c, w in enumerate(wnids)))
    if devkit:
        d = os.path.join(tmp, DEVKIT)
        os.makedirs(d)
        ident = {int(c): k + 1 for k, c in enumerate(devkit_order)}   # class -> ILSVRC2012_ID
        with open(os.path.join(d, "ILSVRC2012_validation_ground_truth.txt"), "w") as f:
            f.write("".join(f"{ident[int(c)]}\n" for c in val_labels))
        with open(os.path.join(d, "synsets.txt"), "w") as f:
            f.write("".join(f"{wnids[int(c)]} class {int(c)} of the generated tree\n"
                            for c in devkit_order))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="the tree's root (must not exist or be empty)")
    ap.add_argument("--classes", type=int, default=10, help="WordNet-id class folders")
    ap.add_argument("--train-per-class", type=int, default=20)
    ap.add_argument("--val-per-class", type=int, default=5, help="flat val/ images per class")
    ap.add_argument("--size", type=int, default=32, help="image side in pixels")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quirks", default="none",
                    help=f"NAME=FRACTION,... with NAME in {', '.join(QUIRKS)} (or none)")
    ap.add_argument("--devkit", action="store_true",
                    help="also write the devkit's ground-truth file and its synset order")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                    help="processes that encode and write (one class at a time)")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    ap.add_argument("--reuse", action="store_true",
                    help="keep an --out made with the same arguments (its make_ilsvrc_tree.json); "
                    "refuse a non-empty --out that is not such a tree")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    args = ap.parse_args(argv)
    if not 1 <= args.classes <= MAX_CLASSES:
        ap.error(f"--classes must lie in [1, {MAX_CLASSES}], got {args.classes}")
    if args.train_per_class < 1:
        ap.error(f"--train-per-class must be >= 1, got {args.train_per_class}")
    if args.val_per_class < 0:
        ap.error(f"--val-per-class must be >= 0, got {args.val_per_class}")
    if not 8 <= args.size <= MAX_SIZE:
        ap.error(f"--size must lie in [8, {MAX_SIZE}], got {args.size}")
    if args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    if not 0 <= args.seed < 2 ** 63:
        ap.error(f"--seed must lie in [0, 2**63), got {args.seed}")
    try:
        quirks = parse_quirks(args.quirks)
    except ValueError as exc:
        ap.error(str(exc))
    out = os.path.abspath(args.out)
    if os.path.lexists(out) and not os.path.isdir(out):
        ap.error(f"--out {out!r} is a file; name a folder")
    wanted = dict(zip(ARGUMENTS, (args.classes, args.train_per_class, args.val_per_class,
                                  args.size, args.seed, quirks, args.devkit)))
    if args.reuse and os.path.isdir(out) and os.listdir(out):
        made = recorded_arguments(out)
        if made is None:
            ap.error(f"--out {out!r} is not a make_ilsvrc_tree.py tree (no readable "
                     "make_ilsvrc_tree.json): not replaced")
        if made == wanted:
            print(f"{out}: reused, its make_ilsvrc_tree.json records the same arguments")
            return 0
        if not args.overwrite:
            ap.error(f"--out {out!r} is a make_ilsvrc_tree.py tree of other arguments; pass "
                     "--overwrite to replace it")
    if os.path.isdir(out) and os.listdir(out) and not args.overwrite:
        ap.error(f"--out {out!r} is not empty; pass --overwrite to replace it")
    try:
        check_writable("--out", os.path.join(out, "x"))
    except ValueError as exc:
        ap.error(str(exc))
    try:
        wnids, files, val_labels, devkit_order, boxes, nbox, chosen = plan(
            args.classes, args.train_per_class, args.val_per_class, args.size, args.seed, quirks)
    except ValueError as exc:
        ap.error(str(exc))
    total = sum(len(v) for v in files.values())
    with atomic_folder(out) as tmp:  # --overwrite checked above: a non-empty out is replaced
        os.makedirs(os.path.join(tmp, "val"))
        for w in wnids:
            os.makedirs(os.path.join(tmp, "train", w))
        jobs = [(args.seed, c, args.size, [(os.path.join(tmp, p), t, q) for p, t, q in fs])
                for c, fs in files.items()]
        from tqdm import tqdm
        with tqdm(total=total, unit="file", disable=not args.progress, desc="make_ilsvrc_tree",
                  file=sys.stderr) as bar:
            if args.workers == 1:
                for job in jobs:
                    bar.update(_write_class(job))
            else:
                with ProcessPoolExecutor(args.workers) as ex:
                    for n in ex.map(_write_class, jobs, chunksize=max(1, len(jobs) // 64)):
                        bar.update(n)
        write_labels(tmp, wnids, val_labels, devkit_order, boxes, nbox, args.devkit,
                     np.random.default_rng([args.seed, 4]))
        with open(os.path.join(tmp, "make_ilsvrc_tree.json"), "w") as f:
            json.dump({**wanted, "wnids": wnids, "quirk_files": chosen}, f, indent=1)
    n_val = len(val_labels)
    print(f"{out}: {total - n_val} train images in {args.classes} class folders, {n_val} val "
          f"images (flat, LOC_val_solution.csv), {args.size} px"
          + "".join(f", {len(v)} {q}" for q, v in chosen.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
