"""Stage 1 of the data path: what the images are.

sources -> order -> augment -> loaders.  Imports nothing else from nac_fast.data.

  fashion_mnist   Fashion-MNIST IDX files (the embedded default: Debian package
                  dataset-fashion-mnist, $NAC_FASHION_MNIST_DIR, or a directory), in memory
  cifar           CIFAR-10 python batches, in memory
  in_memory       InMemorySource: what those two load into (one uint8 tensor + labels)
  imagefolder     FolderSource: an ImageFolder's file list and labels; PIL decoding; the bad-file
                  policy shared by the ImageFolder loaders
  ilsvrc          ILSVRC2012's flat val/ as distributed: its labels files (LOC_val_solution.csv,
                  the devkit's ground truth)
  listing         Listing: a folder scanned once per run (one process scans, the others receive
                  its list; a cache between runs keyed by the folder's stamp)
  synthetic       write_jpeg_folder: JPEG ImageFolders for tests and benchmarks
  synthetic_pairs SyntheticPairLoader: generated two-view batches (`--data synthetic[:N]`), a
                  source that is its own loader (it needs no order, augment or loader stage)
  subset          HashSubset, class_split: the paper's hashing subset of train + test
                  (train.py --train-subset paper-hash; docs/math.md [M:hash-split])

resolve_source(data, split) picks the source for a `data` argument; data_scale(data) says how
large its training split is (images, side), which picks train.py's default recipe (for an
ImageFolder without checking its files: FolderSource.scale_of);
hash_subset_indices / hash_train_source give the paper's hashing subset of `data`.
"""
from __future__ import annotations

import os

from . import cifar, fashion_mnist
from .imagefolder import FolderSource
from .in_memory import InMemorySource
from .listing import Listing
from .subset import HashSubset, class_split, pooled_labels, take_pooled

__all__ = ["data_scale", "resolve_source", "hash_subset_indices", "hash_train_source",
           "InMemorySource", "FolderSource", "HashSubset", "Listing"]


def resolve_source(data, split: str = "train", *, val_labels=None, listing=None):
    """An InMemorySource, or an ImageFolder split (FolderSource), for `data`.  ImageFolders
    only: `val_labels` (a flat val/'s labels file, FolderSource.from_root), `listing` (a
    Listing: scanned once per run, cached between runs); in-memory data sets refuse a
    val_labels (ValueError) and ignore the listing (they are no file tree)."""
    if not isinstance(data, (str, os.PathLike)):
        raise TypeError(f"data must be a name or a path, got {type(data).__name__}")
    data = os.fspath(data)
    folder = _folder(data)
    if val_labels is not None and folder is None:
        raise ValueError(f"val_labels labels the flat val/ of an ImageFolder (ILSVRC2012's), "
                         f"and data {data!r} is none")
    if folder is not None:
        return FolderSource.from_root(data, split, val_labels=val_labels, listing=listing)
    if data.lower() in FASHION_NAMES:
        return fashion_mnist.load(None, split)
    if data.lower() in ("cifar10", "cifar-10"):
        raise ValueError(f"data: CIFAR-10 is not embedded; {cifar.HOW_TO_GET}")
    if not os.path.isdir(data):
        raise FileNotFoundError(
            f"data: {data!r} is neither 'fashion-mnist' nor an existing directory (an ImageFolder "
            f"root with train/ and val/, a CIFAR-10 python-batches dir, or Fashion-MNIST IDX files)")
    if fashion_mnist.find_dir(data) is not None:
        return fashion_mnist.load(data, split)
    return cifar.load(data, split)


FASHION_NAMES = ("fashion-mnist", "fashion_mnist", "fashionmnist")


def _folder(data):
    """`data` (a str) when it names an ImageFolder: an existing folder that is not a name of an
    embedded data set and holds neither Fashion-MNIST nor CIFAR-10; else None."""
    if (data.lower() in FASHION_NAMES + ("cifar10", "cifar-10") or not os.path.isdir(data)
            or fashion_mnist.find_dir(data) is not None or cifar.find_dir(data) is not None):
        return None
    return data


def data_scale(data, subset: HashSubset | None = None, *, val_labels=None,
               listing=None) -> tuple[int, int]:
    """(images, side) of `data`'s training split (with `subset`: of that subset of train +
    test): the number of training images and the side they are trained at by default (the
    source's natural size).  `synthetic[:N]` is (N, 32).  An ImageFolder's without checking its
    files (FolderSource.scale_of: a walk of its folders, or the scan cached for `listing`).  The
    errors of resolve_source for data that does not exist."""
    name = os.fspath(data) if isinstance(data, (str, os.PathLike)) else data
    if isinstance(name, str) and name.startswith("synthetic"):
        n = name.split(":", 1)[1] if ":" in name else "4096"
        return (int(n) if n.isdigit() else 4096), 32
    if subset is None and isinstance(name, str) and _folder(name) is not None:
        return FolderSource.scale_of(data, listing)
    src = resolve_source(data, "train")
    n = len(src.files) if isinstance(src, FolderSource) else int(src.images.shape[0])
    if subset is not None:
        n = int(hash_subset_indices(data, subset, val_labels=val_labels).numel())
    return n, int(src.natural_size)


def hash_subset_indices(data, subset: HashSubset, *, val_labels=None):
    """The indices, into the pool train + test of `data` (the training split's images first),
    of `subset`'s training images: class_split(pooled labels, ...)["train"], sorted.
    SubsetSizeError when a class is too small; the errors of resolve_source."""
    if not isinstance(subset, HashSubset):
        raise TypeError(f"subset must be a HashSubset, got {type(subset).__name__}")
    labels = pooled_labels(resolve_source(data, "train"),
                           resolve_source(data, "test", val_labels=val_labels))
    return class_split(labels, queries_per_class=subset.queries_per_class,
                       train_per_class=subset.train_per_class, seed=subset.seed)["train"]


def hash_train_source(data, subset: HashSubset, *, val_labels=None, listing=None):
    """(source, indices): the source of `subset`'s training images of `data` (the pool train +
    test, in pool order) and their pool indices (hash_subset_indices)."""
    train = resolve_source(data, "train", listing=listing)
    test = resolve_source(data, "test", val_labels=val_labels, listing=listing)
    idx = hash_subset_indices(data, subset, val_labels=val_labels)
    return take_pooled(train, test, idx), idx
