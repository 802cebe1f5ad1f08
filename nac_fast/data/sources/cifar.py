"""CIFAR-10 python batches (cifar-10-python.tar.gz extracted: data_batch_1..5, test_batch),
held in memory as uint8 (50000, 3, 32, 32)."""
from __future__ import annotations

import os
import pickle

import numpy as np
import torch

from .in_memory import InMemorySource

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
HOW_TO_GET = ("extract cifar-10-python.tar.gz (https://www.cs.toronto.edu/~kriz/cifar.html) and pass "
              "data=<dir> holding data_batch_1..5 and test_batch (or its parent with "
              "cifar-10-batches-py/)")
_FILES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
_cache: dict = {}


def find_dir(data):
    if not data or not os.path.isdir(data):
        return None
    for d in (data, os.path.join(data, "cifar-10-batches-py")):
        if os.path.isfile(os.path.join(d, "data_batch_1")):
            return d
    return None


def load(data, split="train") -> InMemorySource:
    if split not in _FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    d = find_dir(data)
    if d is None:
        raise FileNotFoundError(f"data: no CIFAR-10 python batches in {data!r}; {HOW_TO_GET}")
    key = (os.path.realpath(d), split)
    if key not in _cache:
        xs, ys = [], []
        for name in _FILES[split]:
            p = os.path.join(d, name)
            if not os.path.isfile(p):
                raise FileNotFoundError(f"data: {p} is missing; {HOW_TO_GET}")
            with open(p, "rb") as f:
                batch = pickle.load(f, encoding="bytes")
            xs.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(batch[b"labels"], dtype=np.int64))
        _cache[key] = InMemorySource(
            name="cifar10", images=torch.from_numpy(np.concatenate(xs)),
            labels=torch.from_numpy(np.concatenate(ys)), mean=MEAN, std=STD, num_classes=10)
    return _cache[key]
