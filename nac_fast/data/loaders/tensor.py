"""Loaders for data sets held in memory as one uint8 tensor (Fashion-MNIST, CIFAR-10).

sources -> order -> augment -> LOADERS.  A batch: ShardedOrder gives this rank's dataset indices,
one index gather takes their images, augment_batch makes each view with batched tensor ops
(grid_sample crop + flip, colour, normalise).

Why no DataLoader: the whole array is a few tens of MB, so a batch is one index gather plus a
handful of batched tensor ops in the training process itself (on the training device when that
is a GPU): no worker processes to start or to compete with the training for the CPU cores, and
on one CPU core far more two-view images per second than a CPU-trained encoder consumes
(bench/results/data_timings.md).
"""
from __future__ import annotations

import numpy as np
import torch

from ... import _checks
from ..augment import Recipe, augment_batch, center_resize, normalize, one_cpu_thread
from ..order import EpochLoaderMixin, ShardedOrder
from ..sources.in_memory import InMemorySource


class TensorPretrainLoader(EpochLoaderMixin):
    """Two-view pretraining batches from an InMemorySource (see nac_fast.data for the contract)."""

    kind = "tensor"
    skipped_files = ()          # nothing to skip: the arrays were checked when they were read

    def __init__(self, source: InMemorySource, batch_size: int, rank: int, world_size: int, seed: int,
                 image_size: int, recipe: Recipe, device, channels_last: bool, dtype):
        self.source = source
        self.order = ShardedOrder(len(source.labels), batch_size, rank, world_size, seed)
        self.batch_size, self.seed, self.recipe = batch_size, seed, recipe
        self.image_size = image_size
        self.device = torch.device(device)
        self.channels_last, self.dtype = channels_last, dtype
        # the whole uint8 array moves to the device once (47 MB for Fashion-MNIST, 150 MB CIFAR)
        self._images = source.images.to(self.device)

    num_images = property(lambda self: len(self.source.labels))
    in_channels = property(lambda self: int(self.source.images.shape[1]))
    num_classes = property(lambda self: self.source.num_classes)

    def __iter__(self):
        for idx in self.batch_indices():
            with one_cpu_thread(self.device):        # restored before the batch is handed over
                imgs = self._images[torch.as_tensor(idx, device=self.device)]
                views = tuple(
                    augment_batch(imgs, idx, self.seed, self.epoch, view, self.recipe,
                                  self.image_size, self.source.mean, self.source.std, self.dtype,
                                  self.channels_last)
                    for view in (0, 1))
            yield views


class TensorEvalLoader:
    """(images, labels) in dataset order, whole image resized to image_size (identity at the
    natural size); rank r takes indices r, r+W, ... so ranks are disjoint and cover the split."""

    kind = "tensor"
    skipped_files = ()

    def __init__(self, source: InMemorySource, batch_size: int, rank: int, world_size: int,
                 image_size: int, device, channels_last: bool, dtype):
        _checks.positive_int("batch_size", batch_size)
        if not _checks.is_int(world_size) or world_size < 1 or not _checks.is_int(rank) \
                or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank!r}, world_size={world_size!r}")
        self.source, self.batch_size, self.image_size = source, batch_size, image_size
        self.device, self.channels_last, self.dtype = torch.device(device), channels_last, dtype
        self.indices = np.arange(rank, len(source.labels), world_size)

    num_images = property(lambda self: len(self.indices))
    in_channels = property(lambda self: int(self.source.images.shape[1]))
    num_classes = property(lambda self: self.source.num_classes)

    def __len__(self) -> int:
        return -(-len(self.indices) // self.batch_size)

    def __iter__(self):
        for s in range(0, len(self.indices), self.batch_size):
            idx = torch.as_tensor(self.indices[s:s + self.batch_size])
            x = center_resize(self.source.images[idx].to(self.device), self.image_size)
            yield (normalize(x, self.source.mean, self.source.std, self.dtype, self.channels_last),
                   self.source.labels[idx].to(self.device))
