"""Training on part of a data set: the paper's hashing subset (docs/math.md [M:hash-split]).

The paper's CIFAR-10 hashing protocol (Tables 3-4) pools the training and the test split (in that
order: the training split's images first), takes `queries_per_class` random images of each class
as the queries and the rest as the gallery, and trains the encoder on `train_per_class` random
gallery images of each class (1000 and 500 in the paper).  `class_split` is that split, the
one `python -m nac_fast.eval --hash-protocol paper` scores (nac_fast.eval.metrics.retrieval_split
calls it), and the evaluation compares the training subset's `indices_digest`, which train.py
records, with its own split's.  `take_pooled` makes the source a loader trains on.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np
import torch

from ... import _checks
from .imagefolder import FolderSource
from .in_memory import InMemorySource

TRAIN_SUBSETS = ("all", "paper-hash")   # train.py --train-subset


class SubsetSizeError(ValueError):
    """A class has fewer images than queries_per_class + train_per_class."""


@dataclass(frozen=True)
class HashSubset:
    """The paper's hashing subset of a data set (train.py --train-subset paper-hash): the
    `train_per_class` training images per class of the split `class_split(pooled labels,
    queries_per_class, train_per_class, seed)`."""
    queries_per_class: int = 1000
    train_per_class: int = 500
    seed: int = 0

    def __post_init__(self):
        _checks.positive_int("queries_per_class", self.queries_per_class)
        _checks.positive_int("train_per_class", self.train_per_class)
        _checks.int_in("seed", self.seed, 0)

    @property
    def tag(self) -> str:
        return (f"paper-hash: {self.train_per_class}/class of the gallery, "
                f"{self.queries_per_class} queries/class, seed {self.seed}")


def class_split(labels, *, queries_per_class: int, train_per_class: int | None,
                seed: int = 0) -> dict:
    """{"query", "gallery", "train"}: int64 index tensors into `labels` (1-D integer class ids),
    each sorted ascending.  Per class in increasing class id, one random permutation of its
    items (torch.Generator seeded with `seed`, shared by the classes in that order): the first
    `queries_per_class` are queries, the next `train_per_class` (None: none) the training
    subset; the gallery is every item that is not a query.  SubsetSizeError when a class has
    fewer than queries_per_class + train_per_class items."""
    _checks.tensor("labels", labels)
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool \
            or labels.dim() != 1 or labels.numel() == 0:
        raise ValueError(f"labels must be non-empty 1-D integer class ids, got {labels.dtype} "
                         f"of shape {tuple(labels.shape)}")
    _checks.positive_int("queries_per_class", queries_per_class)
    if train_per_class is not None:
        _checks.positive_int("train_per_class", train_per_class)
    y = labels.detach().cpu().to(torch.int64)
    gen = torch.Generator().manual_seed(seed)
    query, train = [], []
    for c in torch.unique(y).tolist():
        idx = torch.nonzero(y == c).flatten()
        need = queries_per_class + (train_per_class or 0)
        if idx.numel() < need:
            raise SubsetSizeError(f"class {c} has {idx.numel()} items, fewer than "
                                  f"queries_per_class + train_per_class = {need}")
        idx = idx[torch.randperm(idx.numel(), generator=gen)]
        query.append(idx[:queries_per_class])
        if train_per_class:
            train.append(idx[queries_per_class:queries_per_class + train_per_class])
    q = torch.sort(torch.cat(query)).values
    is_query = torch.zeros(y.numel(), dtype=torch.bool)
    is_query[q] = True
    g = torch.nonzero(~is_query).flatten()
    t = torch.sort(torch.cat(train)).values if train else torch.zeros(0, dtype=torch.int64)
    return {"query": q, "gallery": g, "train": t}


def indices_digest(indices) -> str:
    """A short fingerprint of an index set (sha256 of the sorted int64 indices, 16 hex digits):
    what config.json records of a training subset, and what the evaluation compares."""
    a = np.sort(np.asarray(torch.as_tensor(indices).cpu(), dtype="<i8"))
    return hashlib.sha256(a.tobytes()).hexdigest()[:16]


def _labels(source) -> torch.Tensor:
    return torch.as_tensor(np.asarray(source.labels), dtype=torch.int64)


def pooled_labels(train_source, test_source) -> torch.Tensor:
    """The labels of the pool train + test, the training split's first (the evaluation's order:
    its train features, then its test features)."""
    return torch.cat([_labels(train_source), _labels(test_source)])


def take_pooled(train_source, test_source, indices):
    """A source of the images `indices` (sorted, into the pool train + test) of two sources of
    one data set: an InMemorySource, or a FolderSource (its bad files: both splits')."""
    idx = np.asarray(torch.as_tensor(indices).cpu(), dtype=np.int64)
    n_train = len(train_source.labels)
    a, b = idx[idx < n_train], idx[idx >= n_train] - n_train
    if isinstance(train_source, InMemorySource):
        if not isinstance(test_source, InMemorySource):
            raise TypeError("train and test sources must be of one kind")
        ia, ib = torch.as_tensor(a), torch.as_tensor(b)
        return InMemorySource(
            name=train_source.name,
            images=torch.cat([train_source.images[ia], test_source.images[ib]]),
            labels=torch.cat([train_source.labels[ia], test_source.labels[ib]]),
            mean=train_source.mean, std=train_source.std, num_classes=train_source.num_classes)
    if isinstance(train_source, FolderSource) and isinstance(test_source, FolderSource):
        files = [train_source.files[i] for i in a] + [test_source.files[i] for i in b]
        labels = np.concatenate([np.asarray(train_source.labels)[a],
                                 np.asarray(test_source.labels)[b]]).astype(np.int64)
        return replace(train_source, files=files, labels=labels, held_out=0,
                       bad_files=list(train_source.bad_files) + list(test_source.bad_files))
    raise TypeError(f"cannot take a subset of a {type(train_source).__name__}")
