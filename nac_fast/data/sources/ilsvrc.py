"""ILSVRC2012's val/ as distributed: a flat folder of ILSVRC2012_val_%08d.JPEG files whose labels
live in a file beside it, not in class folders.

Two labels files are read:
  LOC_val_solution.csv   (Kaggle's) header `ImageId,PredictionString`, then one row per image:
                         `ILSVRC2012_val_00000001,n01751748 x y x y [n01751748 x y x y ...]`;
                         the image's class is the WordNet id of its boxes (all boxes name one).
  ILSVRC2012_validation_ground_truth.txt   (the devkit's) line i holds the 1-based ILSVRC2012_ID
                         of ILSVRC2012_val_%08d (i); the IDs follow the devkit's synset order, read
                         from a synsets.txt beside it (line k: `<wnid> [words]` of ILSVRC2012_ID k;
                         the real devkit keeps the order in data/meta.mat: write it with
                         `python -c "import scipy.io as s; m = s.loadmat('meta.mat')['synsets'];
                         print('\\n'.join(r[0][1][0] for r in m if r[0][0][0][0] <= 1000))"
                         > synsets.txt`).
`find_labels(root)` looks for them where the tree as distributed puts them: the tree's root, or
its parent (Kaggle's ILSVRC/Data/CLS-LOC/ sits two levels below LOC_val_solution.csv: pass that
file with --val-labels there).  Every error is a ValueError naming the file and the row.
"""
from __future__ import annotations

import os

CSV_NAME = "LOC_val_solution.csv"
CSV_HEADER = "ImageId,PredictionString"
DEVKIT_NAME = "ILSVRC2012_validation_ground_truth.txt"
DEVKIT_DIR = os.path.join("ILSVRC2012_devkit_t12", "data")
SYNSETS_NAME = "synsets.txt"


def find_labels(root):
    """The labels file of a tree's flat val/: LOC_val_solution.csv at `root` or its parent, else
    the devkit's ground truth (root/ILSVRC2012_devkit_t12/data/ or beside root); None when there
    is none (only stat calls: nothing is opened)."""
    parent = os.path.dirname(os.path.abspath(root).rstrip(os.sep))
    for p in (os.path.join(root, CSV_NAME), os.path.join(parent, CSV_NAME),
              os.path.join(root, DEVKIT_DIR, DEVKIT_NAME), os.path.join(root, DEVKIT_NAME),
              os.path.join(parent, DEVKIT_DIR, DEVKIT_NAME)):
        if os.path.isfile(p):
            return os.path.abspath(p)
    return None


def label_files(path) -> list:
    """The files a labels file's labels are read from (the devkit's: its synsets.txt too)."""
    if _is_devkit(path):
        return [path, os.path.join(os.path.dirname(path), SYNSETS_NAME)]
    return [path]


def _is_devkit(path) -> bool:
    return not os.fspath(path).lower().endswith(".csv")


def read_labels(path) -> dict:
    """{image id (file name without extension): (WordNet id, row)} of a labels file (CSV or the
    devkit's ground truth).  ValueError naming the file and the row when it is malformed."""
    return _read_devkit(path) if _is_devkit(path) else _read_csv(path)


def _lines(path):
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read().splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"data: labels file {path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise ValueError(f"data: labels file {path} cannot be read "
                         f"({exc.strerror or exc})") from None


def _read_csv(path) -> dict:
    lines = _lines(path)
    if not lines or lines[0].strip().lstrip("\ufeff") != CSV_HEADER:
        got = lines[0][:60] if lines else "an empty file"
        raise ValueError(f"data: labels file {path} row 1: expected the header {CSV_HEADER!r}, "
                         f"got {got!r}")
    out = {}
    for row, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        image, comma, pred = line.strip().partition(",")
        toks = pred.split()
        where = f"data: labels file {path} row {row}"
        if not comma or not image or not toks or len(toks) % 5:
            raise ValueError(f"{where}: expected 'ImageId,wnid x y x y [wnid x y x y ...]', got "
                             f"{line[:80]!r}")
        wnids = set(toks[0::5])
        if len(wnids) != 1:
            raise ValueError(f"{where}: image {image} has boxes of several classes "
                             f"({', '.join(sorted(wnids))})")
        if not all(t.lstrip("-").isdigit() for i, t in enumerate(toks) if i % 5):
            raise ValueError(f"{where}: a box coordinate is not an integer: {line[:80]!r}")
        if image in out:
            raise ValueError(f"{where}: image {image} has a second row")
        out[image] = (toks[0], row)
    return out


def _read_devkit(path) -> dict:
    syn_path = os.path.join(os.path.dirname(path), SYNSETS_NAME)
    if not os.path.isfile(syn_path):
        raise ValueError(f"data: labels file {path}: the devkit's synset order is read from "
                         f"{syn_path} (line k: the WordNet id of ILSVRC2012_ID k), which is "
                         "missing; write it from the devkit's meta.mat (see "
                         "nac_fast/data/sources/ilsvrc.py) or use LOC_val_solution.csv")
    synsets = []
    for row, line in enumerate(_lines(syn_path), start=1):
        toks = line.split()
        if not toks or not toks[0].startswith("n"):
            raise ValueError(f"data: synsets file {syn_path} row {row}: expected '<wnid> "
                             f"[words]', got {line[:80]!r}")
        synsets.append(toks[0])
    lines = _lines(path)
    while lines and not lines[-1].strip():   # a final newline or two
        lines.pop()
    out = {}
    for row, line in enumerate(lines, start=1):
        s = line.strip()
        if not s.isdigit() or not 1 <= int(s) <= len(synsets):
            raise ValueError(f"data: labels file {path} row {row}: expected an ILSVRC2012_ID in "
                             f"1..{len(synsets)} (the lines of {syn_path}), got {line[:40]!r}")
        out[f"ILSVRC2012_val_{row:08d}"] = (synsets[int(s) - 1], row)
    return out


def flat_labels(files, path, classes) -> list:
    """The class indices (into `classes`, the training split's) of the flat val `files` by the
    labels file `path`.  ValueError naming the file and the row (or the image it lacks)."""
    table = read_labels(path)
    index = {c: k for k, c in enumerate(classes)}
    out = []
    for p in files:
        image = os.path.splitext(os.path.basename(p))[0]
        wnid, row = table.get(image, (None, None))
        if wnid is None:
            raise ValueError(f"data: labels file {path} has no row for the val image {p} "
                             f"({len(table)} rows); it labels another val/ (--val-labels names "
                             "the right one)")
        if wnid not in index:
            raise ValueError(f"data: labels file {path} row {row}: class {wnid} of image {image} "
                             "is not a class folder of train/")
        out.append(index[wnid])
    return out
