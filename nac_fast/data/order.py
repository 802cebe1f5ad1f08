"""Stage 2 of the data path: which images, in which batch, on which rank, and the randomness
each view draws.

sources -> ORDER -> augment -> loaders.  Imports nothing from nac_fast.data.

  * epoch_permutation: the epoch's global order, a function of (seed, epoch) only, the same on
    every rank;
  * ShardedOrder: global batch k = perm[k*B*W:(k+1)*B*W], rank r (the GLOBAL rank) takes its r-th
    slice of B, the < B*W remainder is dropped so every rank runs the same number of steps;
  * EpochLoaderMixin: the epoch contract of every pretraining loader, len() and
    set_epoch(epoch, start_batch) (exact resume: batch k of an epoch is the same whether the epoch
    ran from 0 or restarted at k);
  * uniform: the per-view random numbers, counter-based.

Why counter-based: every random number a view needs is a pure function of
(seed, epoch, dataset index, view, slot).  Nothing depends on the number of workers, the batch
size, the world size, or on how many batches were produced before, so `set_epoch(e, start_batch=k)`
resumes an interrupted epoch bit-exactly and the DALI and torchvision loaders can be fed the very
same augmentation parameters.
"""
from __future__ import annotations

import operator

import numpy as np

from .. import _checks

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wraps modulo 2**64, which numpy defines)."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
    return x ^ (x >> np.uint64(31))


def hash_key(*parts) -> np.ndarray:
    """Chain-hash integer parts (scalars or equal-length arrays) into uint64 keys."""
    with np.errstate(over="ignore"):
        h = np.zeros((), dtype=np.uint64)
        for p in parts:
            p = np.asarray(p).astype(np.int64).astype(np.uint64)
            h = _mix(h ^ p)
        return h


def uniform(seed: int, epoch: int, index: np.ndarray, stream: int, n: int) -> np.ndarray:
    """(len(index), n) float64 uniforms in [0, 1) for dataset `index`es; `stream` separates uses
    (view 1 / view 2 / eval) so the two views of one image are independent."""
    index = np.asarray(index, dtype=np.int64)
    slots = np.arange(n, dtype=np.int64)
    base = hash_key(seed, epoch, stream)
    h = hash_key(base, index[:, None], slots[None, :])
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def evenly_spaced(n: int, k: int) -> np.ndarray:
    """k of the positions 0..n-1 spread evenly: floor(i n / k) for i < k (increasing, distinct
    for k <= n; i (n / k) when k divides n).  Evaluation limits take these, so that a
    class-sorted split keeps every class whatever k (the first k of every (n // k)-th position
    would keep only the first k images for k > n / 2)."""
    _checks.int_in("n", n, 0)
    _checks.int_in("k", k, 0, n)
    return (np.arange(k, dtype=np.int64) * n) // k if k else np.zeros(0, np.int64)


def epoch_permutation(num_images: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's global order; identical on every rank."""
    key = int(hash_key(seed, epoch, 0x5EED))
    return np.random.Generator(np.random.PCG64(key)).permutation(num_images)


class ShardedOrder:
    """Which dataset indices rank `rank` sees in each batch of an epoch.

    Global batch k is perm[k*B*W:(k+1)*B*W]; rank r takes its r-th slice of B.  Shards are
    disjoint, together they cover the epoch (minus the < B*W remainder dropped so every rank runs
    the same number of steps — a rank with one step more would hang the collectives).

    The order is global: for a global batch G = B*W, global batch k (its images, and their order
    from rank 0's slice to the last rank's) and the number of batches per epoch are the same at
    every world size W that divides G.  A run resumed on another world size (the elastic
    resize, nac_fast.train.run.resize) sees the images it would have seen.
    """

    def __init__(self, num_images: int, batch_size: int, rank: int, world_size: int, seed: int):
        _checks.positive_int("batch_size", batch_size)
        _checks.positive_int("world_size", world_size)
        if not _checks.is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        _checks.integer("seed", seed)
        self.num_images, self.batch_size, self.rank, self.world_size, self.seed = (
            num_images, batch_size, rank, world_size, seed)
        self.num_batches = num_images // (batch_size * world_size)
        if self.num_batches == 0:
            raise ValueError(
                f"batch_size={batch_size} per rank x world_size={world_size} = a global batch of "
                f"{batch_size * world_size} images (train.py --batch-size) exceeds the "
                f"{num_images} images of the data set: an epoch would have no batch")

    def rank_indices(self, epoch: int, start_batch: int = 0) -> np.ndarray:
        """(num_batches - start_batch, B) dataset indices of this rank, in batch order."""
        return self.all_rank_indices(epoch, start_batch)[self.rank]

    def all_rank_indices(self, epoch: int, start_batch: int = 0) -> np.ndarray:
        """(W, num_batches - start_batch, B): every rank's remaining batches."""
        B, W, n = self.batch_size, self.world_size, self.num_batches
        if not isinstance(start_batch, int) or not 0 <= start_batch <= n:
            raise ValueError(f"start_batch must be an int in [0, {n}], got {start_batch!r}")
        perm = epoch_permutation(self.num_images, self.seed, epoch)[: n * B * W]
        return perm.reshape(n, W, B).transpose(1, 0, 2)[:, start_batch:]


class EpochLoaderMixin:
    """The epoch contract shared by every pretraining loader; needs `self.order` (ShardedOrder).

    len() is the fixed number of batches per epoch for this rank; set_epoch(epoch, start_batch)
    picks the epoch's order and augmentations and where the next iteration starts (it stays in
    force until the next set_epoch)."""

    epoch = 0
    start_batch = 0

    def __len__(self) -> int:
        return self.order.num_batches

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        try:
            epoch, start_batch = operator.index(epoch), operator.index(start_batch)
        except TypeError:
            raise TypeError(f"epoch and start_batch must be ints, got {epoch!r}, {start_batch!r}") from None
        if epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        if not 0 <= start_batch <= len(self):
            raise ValueError(f"start_batch must be an int in [0, {len(self)}], got {start_batch!r}")
        self.epoch, self.start_batch = epoch, start_batch

    def batch_indices(self) -> np.ndarray:
        """(remaining batches, B) dataset indices this rank sees in the current epoch."""
        return self.order.rank_indices(self.epoch, self.start_batch)
