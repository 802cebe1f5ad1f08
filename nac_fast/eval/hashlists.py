"""The ImageNet-100 hashing protocol of the literature (HashNet, ICCV 2017; DeepHash-pytorch):
100 ImageNet classes, a database of all their training images, their validation images as the
queries, a training subset of the database; mAP@1000 with Hamming ranking (docs/evaluation.md,
"ImageNet-100 hashing").

Two ways to fix the three sets:

* the published lists, given as files: one image per line, ``<path> <label vector>`` (the
  vector: 0/1 integers, one per class, as in HashNet's and DeepHash-pytorch's train.txt,
  database.txt, test.txt).  :func:`read_list` parses one; :func:`match_list` finds each listed
  image among the images of an evaluation split by file name (ImageNet's file names are unique:
  n01440764_10026.JPEG, ILSVRC2012_val_00000001.JPEG), whatever folder the list names.
* no lists: :func:`imagenet100_split`, a seeded rule (documented there) on the labels of the
  ILSVRC2012 train and val splits.

Bad list files are a ValueError naming the file and the (1-based) row; the CLI turns it into
one line and exit status 2.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from .. import _checks

__all__ = ["read_list", "match_list", "imagenet100_split", "IMAGENET100"]

# The literature's sizes (HashNet's lists, as DeepHash-pytorch distributes them): 100 classes,
# ~13,000 training images (130 per class in the seeded rule), a database of all the training
# images of the 100 classes (128,503 in the lists), the 5,000 validation images as queries.
IMAGENET100 = {"classes": 100, "train_per_class": 130, "map_at": 1000}


def read_list(path: str, *, flag: str = "list") -> tuple[list[str], torch.Tensor]:
    """(paths, labels) of a ``<path> <0/1 label vector>`` list file.  ``labels``: int64 class
    ids (n,) when every row has exactly one 1 (ImageNet-100), else an int8 multi-hot (n, C)
    (relevance: sharing a label).  ValueError "<flag> <file>: row <r>: ..." for an unreadable
    file, an empty one, a row without a label vector, entries other than 0/1, a vector length
    that differs from the first row's, a row with no label, or a path listed twice."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: cannot be read ({exc})") from None
    paths, rows, seen, width = [], [], {}, None
    for r, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        where = f"{flag} {path}: row {r}"
        if len(parts) < 2:
            raise ValueError(f"{where}: expected '<path> <0/1 label vector>', got {line[:80]!r}")
        vec = parts[1:]
        if any(v not in ("0", "1") for v in vec):
            bad = next(v for v in vec if v not in ("0", "1"))
            raise ValueError(f"{where}: label entries must be 0 or 1, got {bad[:20]!r}")
        if width is None:
            width = len(vec)
        elif len(vec) != width:
            raise ValueError(f"{where}: {len(vec)} label entries, the first row has {width}")
        if "1" not in vec:
            raise ValueError(f"{where}: the label vector has no 1 (an image of no class)")
        if parts[0] in seen:
            raise ValueError(f"{where}: {parts[0]!r} is listed again (first at row "
                             f"{seen[parts[0]]})")
        seen[parts[0]] = r
        paths.append(parts[0])
        rows.append(np.frombuffer(" ".join(vec).encode()[::2], dtype=np.uint8) - ord("0"))
    if not paths:
        raise ValueError(f"{flag} {path}: no rows")
    hot = torch.from_numpy(np.stack(rows).astype(np.int8))
    if bool((hot.sum(1) == 1).all()):
        return paths, hot.argmax(1).to(torch.int64)
    return paths, hot


def match_list(list_paths: list[str], split_files: list[str], *, flag: str = "list",
               path: str = "", split: str = "split") -> torch.Tensor:
    """Indices into ``split_files`` (the images of an evaluation split, in its feature order) of
    the images a list names, matched by file name.  A listed image that the split does not hold,
    or a file name the split holds twice, is a ValueError naming the list file and its row."""
    where: dict[str, int] = {}
    dup = set()
    for i, f in enumerate(split_files):
        b = os.path.basename(f)
        if b in where:
            dup.add(b)
        where[b] = i
    out = np.empty(len(list_paths), dtype=np.int64)
    for r, p in enumerate(list_paths):
        b = os.path.basename(p)
        if b not in where:
            raise ValueError(f"{flag} {path}: row {r + 1}: {p!r} is not among the "
                             f"{len(split_files)} images of the {split} split evaluated")
        if b in dup:
            raise ValueError(f"{flag} {path}: row {r + 1}: the {split} split holds more than one "
                             f"file named {b!r}; the list cannot say which")
        out[r] = where[b]
    return torch.from_numpy(out)


def imagenet100_split(train_labels, val_labels, *, classes: int = 100,
                      train_per_class: int = 130, seed: int = 0) -> dict:
    """The seeded ImageNet-100 rule used when no lists are given.

    1. The classes: the first ``classes`` of a permutation of the training split's class ids
       (torch.randperm(C) with a generator seeded ``seed``), sorted ascending.
    2. Database: every training-split image of those classes (split order).
    3. Queries: every validation-split image of those classes (ILSVRC2012: 50 each, 5,000).
    4. Training subset: ``train_per_class`` images per class drawn from the database
       (torch.randperm of each class's database images, in class order, same generator), sorted.

    Returns int64 tensors {"classes", "database", "query", "train"} (indices into the train
    split for database and train, into the val split for query).  A class with fewer than
    ``train_per_class`` training images, or none in the val split, is a ValueError."""
    ytr = torch.as_tensor(train_labels).to("cpu", torch.int64)
    yva = torch.as_tensor(val_labels).to("cpu", torch.int64)
    _checks.positive_int("classes", classes)
    _checks.positive_int("train_per_class", train_per_class)
    C = int(ytr.max()) + 1
    if classes > C:
        raise ValueError(f"classes {classes} exceeds the {C} classes of the training split")
    gen = torch.Generator().manual_seed(_checks.integer("seed", seed, numpy=True))
    chosen = torch.randperm(C, generator=gen)[:classes].sort().values
    keep = torch.zeros(C + 1, dtype=torch.bool)
    keep[chosen] = True
    database = keep[ytr].nonzero().squeeze(1)
    query = keep[yva.clamp(max=C)].nonzero().squeeze(1)
    train = []
    for c in chosen.tolist():
        members = database[ytr[database] == c]
        if members.numel() < train_per_class:
            raise ValueError(f"class {c} has {members.numel()} training images, fewer than "
                             f"train_per_class {train_per_class}")
        if not bool((yva == c).any()):
            raise ValueError(f"class {c} has no image in the validation split")
        train.append(members[torch.randperm(members.numel(), generator=gen)[:train_per_class]])
    return {"classes": chosen, "database": database, "query": query,
            "train": torch.cat(train).sort().values}


# --------------------------------------------------------------------------------------------
# python -m nac_fast.eval --hash-protocol imagenet100
# --------------------------------------------------------------------------------------------

LIST_FLAGS = ("hash_database_list", "hash_query_list", "hash_train_list")


def check_list_flags(args) -> None:
    """Before any work: the list flags need --hash-protocol imagenet100, the database and query
    lists go together, and every list given is read and checked (a bad row is a ValueError
    naming the flag, the file and the row).  The parsed lists are kept on ``args.hash_lists``."""
    k = getattr(args, "hash_classes", None)
    if k is not None and (k < 1 or getattr(args, "hash_protocol", None) != "imagenet100"):
        raise ValueError(f"--hash-classes {k}: a number of classes >= 1 for --hash-protocol "
                         "imagenet100 without lists")
    given = {f: getattr(args, f, None) for f in LIST_FLAGS}
    named = [f"--{f.replace('_', '-')}" for f, v in given.items() if v is not None]
    args.hash_lists = {}
    if not named:
        return
    if getattr(args, "hash_protocol", None) != "imagenet100":
        raise ValueError(f"{named[0]}: the list files are the imagenet100 protocol's; add "
                         "--hash-protocol imagenet100")
    if (given["hash_database_list"] is None) != (given["hash_query_list"] is None):
        raise ValueError("--hash-database-list and --hash-query-list go together (the database "
                         "and the queries of the lists' protocol)")
    for f, v in given.items():
        if v is not None:
            args.hash_lists[f] = read_list(v, flag=f"--{f.replace('_', '-')}")


def _split_files(args, split: str) -> list[str]:
    """The image files of an evaluation split in its feature order (the loader the CLI built
    for it: args.split_loaders[split] = (loader, n_used)); a ValueError naming
    --hash-database-list for data that are not image files."""
    got = getattr(args, "split_loaders", {}).get(split)
    if got is None:
        raise RuntimeError(f"imagenet100 lists: the {split} split's loader was not recorded "
                           "(args.split_loaders, set where the CLI builds its loaders)")
    loader, used = got
    files = getattr(getattr(loader, "source", None), "files", None)
    if files is None:
        raise ValueError(f"--hash-database-list / --hash-query-list match images by file name; "
                         f"the {split} split of this data set has no image files (an in-memory "
                         "data set): leave the lists out for the seeded rule")
    return [files[i] for i in np.asarray(loader.indices)[:used]]


def imagenet100_sets(args, tr: dict, te: dict):
    """(query a, query labels, database a, database labels, description) of the imagenet100
    protocol on the extracted features: from the lists when given (database rows among the
    train split's images, queries among the test (val) split's, labels the lists' vectors), else
    by :func:`imagenet100_split` with seed --split-seed and --hash-classes classes."""
    lists = getattr(args, "hash_lists", {})
    if "hash_database_list" in lists:
        (db_paths, db_y), (q_paths, q_y) = lists["hash_database_list"], lists["hash_query_list"]
        for flag, feats, split in (("--hash-database-list", tr, "train"),
                                   ("--hash-query-list", te, "val")):
            skipped = feats.get("skipped_files") or []
            if skipped:  # the rows after it hold the next files' features: matching would shift
                raise ValueError(f"{flag}: the {split} split's image {skipped[0]!r} could not be "
                                 f"decoded and extraction skipped it ({len(skipped)} such files), "
                                 "so the features no longer line up with the file names the "
                                 "lists match; repair or remove it and rerun (features with a "
                                 "skipped file are extracted again, not reused)")
        if db_y.dim() != q_y.dim() or (db_y.dim() == 2 and db_y.shape[1] != q_y.shape[1]):
            raise ValueError(f"--hash-query-list {args.hash_query_list}: its label vectors do "
                             f"not match --hash-database-list's ({tuple(q_y.shape[1:])} vs "
                             f"{tuple(db_y.shape[1:])} entries per row beyond one class)")
        g = match_list(db_paths, _split_files(args, "train"), flag="--hash-database-list",
                       path=args.hash_database_list, split="train")
        q = match_list(q_paths, _split_files(args, "test"), flag="--hash-query-list",
                       path=args.hash_query_list, split="val")
        info = {"queries": f"--hash-query-list {os.path.basename(args.hash_query_list)}",
                "gallery": f"--hash-database-list {os.path.basename(args.hash_database_list)}"}
        if "hash_train_list" in lists:
            names = {os.path.basename(p) for p in db_paths}
            t_paths = lists["hash_train_list"][0]
            outside = [r for r, p in enumerate(t_paths, 1) if os.path.basename(p) not in names]
            if outside:
                raise ValueError(f"--hash-train-list {args.hash_train_list}: row {outside[0]}: "
                                 f"{t_paths[outside[0] - 1]!r} is not in the database list "
                                 f"({len(outside)} such rows)")
            info["train_list"] = {"file": os.path.basename(args.hash_train_list),
                                  "images": len(t_paths)}
        return te["a"][q], q_y, tr["a"][g], db_y, info
    classes = getattr(args, "hash_classes", None) or IMAGENET100["classes"]
    seed = args.split_seed if getattr(args, "split_seed", None) is not None else args.seed
    try:
        s = imagenet100_split(tr["labels"], te["labels"], classes=classes,
                              train_per_class=IMAGENET100["train_per_class"], seed=seed)
    except ValueError as exc:
        raise ValueError(f"--hash-protocol imagenet100: {exc} (the seeded rule needs "
                         f"{IMAGENET100['train_per_class']} training images of each of "
                         f"{classes} classes: ImageNet's train split, or --hash-classes)") from None
    info = {"queries": f"the val split's images of {classes} classes chosen with seed {seed}",
            "gallery": "every train-split image of those classes",
            "classes": s["classes"].tolist(),
            "train_subset": {"per_class": IMAGENET100["train_per_class"],
                             "images": int(s["train"].numel()),
                             "note": "the literature's training images (the encoder here is "
                                     "unsupervised: reported, not used)"}}
    return (te["a"][s["query"]], te["labels"][s["query"]], tr["a"][s["database"]],
            tr["labels"][s["database"]], info)
