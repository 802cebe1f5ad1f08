"""Fashion-MNIST (60k train / 10k test, 28x28 grayscale) from IDX files, held in memory.

Looked up, in order: a directory given as `data` (the IDX files themselves, or a torchvision root
holding FashionMNIST/raw/), $NAC_FASHION_MNIST_DIR, and the Debian package path
/usr/share/datasets/fashion-mnist (`apt-get install dataset-fashion-mnist`).
"""
from __future__ import annotations

import gzip
import os
import struct

import numpy as np
import torch

from .in_memory import InMemorySource

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
MEAN, STD = (0.2860,), (0.3530,)        # per-pixel statistics of the 60k training images
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
           "Bag", "Ankle boot")
HOW_TO_GET = ("install the Debian package (apt-get install dataset-fashion-mnist, files land in "
              f"{DEBIAN_DIR}), or pass data=<dir> holding train-images-idx3-ubyte[.gz] etc. or a "
              "torchvision root with FashionMNIST/raw/")
_PREFIX = {"train": "train", "test": "t10k"}
_cache: dict = {}


def _candidates(root):
    return [root, os.path.join(root, "FashionMNIST", "raw"), os.path.join(root, "raw")]


def find_dir(data=None):
    """The directory holding the IDX files, or None."""
    roots = [data] if data is not None else [os.environ.get("NAC_FASHION_MNIST_DIR"), DEBIAN_DIR]
    for root in roots:
        if not root or not os.path.isdir(root):
            continue
        for d in _candidates(root):
            if _idx_path(d, "train-images-idx3-ubyte"):
                return d
    return None


def _idx_path(d, stem):
    for name in (stem, stem + ".gz"):
        p = os.path.join(d, name)
        if os.path.isfile(p):
            return p
    return None


def read_idx(path) -> np.ndarray:
    """Parse an IDX file (optionally gzipped): big-endian magic, dims, then uint8 data."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path} is not a uint8 IDX file (magic {raw[:4]!r})")
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path} is truncated: header says {dims}, found {data.size} bytes")
    return data.reshape(dims)


def load(data=None, split="train") -> InMemorySource:
    if split not in _PREFIX:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    d = find_dir(data)
    if d is None:
        where = repr(data) if data is not None else f"$NAC_FASHION_MNIST_DIR or {DEBIAN_DIR}"
        raise FileNotFoundError(f"data: no Fashion-MNIST IDX files found in {where}; {HOW_TO_GET}")
    key = (os.path.realpath(d), split)
    if key not in _cache:        # decompress the 26 MB train set once per process
        pre = _PREFIX[split]
        img_p = _idx_path(d, f"{pre}-images-idx3-ubyte")
        lab_p = _idx_path(d, f"{pre}-labels-idx1-ubyte")
        if img_p is None or lab_p is None:
            raise FileNotFoundError(f"data: {d} lacks the {split} split ({pre}-*-ubyte); {HOW_TO_GET}")
        images, labels = read_idx(img_p), read_idx(lab_p)
        if images.ndim != 3 or labels.shape != (images.shape[0],):
            raise ValueError(f"data: {img_p} / {lab_p} shapes {images.shape} / {labels.shape} do not match")
        _cache[key] = InMemorySource(
            name="fashion-mnist", images=torch.from_numpy(images.copy()).unsqueeze(1),
            labels=torch.from_numpy(labels.astype(np.int64)), mean=MEAN, std=STD,
            num_classes=len(CLASSES))
    return _cache[key]
