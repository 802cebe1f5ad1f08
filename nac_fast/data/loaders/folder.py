"""torchvision-style loaders for ImageFolders: PIL decoding in DataLoader workers.

sources -> order -> augment -> LOADERS.  A pretraining batch: ShardedOrder gives this rank's
dataset indices; a worker decodes each file once (sources.imagefolder.decode_or_next: a file that
does not decode is replaced by the next one that does) and makes both views' crop and flip with
PIL (augment.pil_crop_flip_views); the colour stage (jitter, grayscale, blur, normalise:
augment.colour_blur, the same code as the in-memory loader) runs batched, on the GPU when
training there, else in the workers' collate.  Files that fail are skipped, counted in
`skipped_files` and warned about, or stop the run, by the bad-file policy of
sources.imagefolder (`on_bad_file`).
"""
from __future__ import annotations

import numpy as np
import torch

from ..augment import (Recipe, colour_blur, normalize, one_cpu_thread, pil_center_crop,
                       pil_crop_flip_views, view_params)
from ..order import EpochLoaderMixin, ShardedOrder
from ..sources.imagefolder import BadFiles, FolderSource, decode_or_next


class _TwoViewCrops(torch.utils.data.Dataset):
    """Worker side: decode once, crop/resize/flip twice (uint8)."""

    def __init__(self, source: FolderSource, recipe, seed, size):
        self.files, self.recipe, self.seed, self.size = source.files, recipe, seed, size

    def __len__(self):
        return len(self.files)

    def __getitem__(self, item):
        epoch, i = item
        img, _, bad = decode_or_next(self.files, i)
        # the views' randomness is drawn for index i even when a substitute was decoded: the
        # batch's parameters stay those of the order (as in the DALI loader)
        v1, v2 = pil_crop_flip_views(img, self.recipe, self.seed, epoch, i, self.size)
        return v1, v2, epoch, i, bad


class _Collate:
    """Stacks the uint8 views; with `finish` (CPU training) it also runs the batched colour stage
    right here, in the worker process.  Why: in the main process the colour stage competes with
    the workers for the same CPU cores, and torch's intra-op threads spin while they wait; in the
    workers it is single-threaded and parallel across workers."""

    def __init__(self, finish=None):
        self.finish = finish

    def __call__(self, items):
        v1, v2, epoch, idx, bad = zip(*items)
        idx = np.array(idx)
        v1, v2 = torch.stack(v1), torch.stack(v2)
        if self.finish is not None:
            v1, v2 = self.finish(v1, epoch[0], idx, 0), self.finish(v2, epoch[0], idx, 1)
        return v1, v2, idx, [b for bs in bad for b in bs]


class _Finish:
    """uint8 view batch -> jittered, grayscaled, blurred, normalised float batch."""

    def __init__(self, recipe, seed, mean, std, dtype, channels_last):
        self.recipe, self.seed, self.mean, self.std = recipe, seed, mean, std
        self.dtype, self.channels_last = dtype, channels_last

    def __call__(self, v_u8, epoch, idx, view):
        p = view_params(self.recipe, self.seed, epoch, idx, view)
        with one_cpu_thread(v_u8.device):         # a no-op in workers (already 1 thread)
            x = colour_blur(v_u8.float().div_(255.0), p, self.recipe)
            return normalize(x, self.mean, self.std, self.dtype, self.channels_last)


class _EpochBatches(torch.utils.data.Sampler):
    def __init__(self, rows, epoch):
        self.rows, self.epoch = rows, epoch

    def __iter__(self):
        return ([(self.epoch, int(i)) for i in row] for row in self.rows)

    def __len__(self):
        return len(self.rows)


class FolderPretrainLoader(EpochLoaderMixin):
    kind = "torchvision"

    def __init__(self, source: FolderSource, batch_size, rank, world_size, seed, image_size,
                 recipe: Recipe, device, channels_last, dtype, num_workers, on_bad_file):
        self._bad = BadFiles(on_bad_file)
        self._bad.report(source.bad_files, "non-image or corrupt files")
        self.source, self.on_bad_file = source, on_bad_file
        self.order = ShardedOrder(len(source.files), batch_size, rank, world_size, seed)
        self.batch_size, self.seed, self.recipe, self.image_size = batch_size, seed, recipe, image_size
        self.device, self.channels_last, self.dtype = torch.device(device), channels_last, dtype
        self.num_workers = num_workers
        self._crops = _TwoViewCrops(source, recipe, seed, image_size)

    num_images = property(lambda self: len(self.source.files))
    in_channels = property(lambda self: 3)
    num_classes = property(lambda self: self.source.num_classes)
    skipped_files = property(lambda self: tuple(self._bad.skipped))

    def __iter__(self):
        finish = _Finish(self.recipe, self.seed, self.source.mean, self.source.std, self.dtype,
                         self.channels_last)
        on_cpu = self.device.type == "cpu"        # else the colour stage runs on the GPU
        dl = torch.utils.data.DataLoader(
            self._crops, batch_sampler=_EpochBatches(self.batch_indices(), self.epoch),
            num_workers=self.num_workers, collate_fn=_Collate(finish if on_cpu else None),
            pin_memory=not on_cpu, prefetch_factor=4 if self.num_workers else None)
        for v1, v2, idx, bad in dl:
            if bad:
                self._bad.report([self.source.files[j] for j in bad], "undecodable files")
            if not on_cpu:
                v1, v2 = (finish(v.to(self.device, non_blocking=True), self.epoch, idx, view)
                          for view, v in ((0, v1), (1, v2)))
            yield v1, v2


class _CenterCrops(torch.utils.data.Dataset):
    def __init__(self, source, size):
        self.files, self.labels, self.size = source.files, source.labels, size

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        img, j, bad = decode_or_next(self.files, i)
        # a substitute comes with its own label
        return pil_center_crop(img, self.size), int(self.labels[j]), bad


def _collate_eval(items):
    x, y, bad = zip(*items)
    return torch.stack(x), torch.tensor(y, dtype=torch.int64), [b for bs in bad for b in bs]


class FolderEvalLoader:
    """(images, labels) in dataset order, one centred view (augment.pil_center_crop); rank r takes
    indices r, r+W, ... so ranks are disjoint and cover the split (the last batch may be smaller).
    A file that does not decode is replaced by the next decodable one, with that one's label."""

    kind = "torchvision"

    def __init__(self, source: FolderSource, batch_size, rank, world_size, image_size, device,
                 channels_last, dtype, num_workers, on_bad_file):
        self._bad = BadFiles(on_bad_file)
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) \
                or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank!r}, world_size={world_size!r}")
        self._bad.report(source.bad_files, "non-image or corrupt files")
        self.source, self.batch_size, self.image_size = source, batch_size, image_size
        self.device, self.channels_last, self.dtype = torch.device(device), channels_last, dtype
        self.num_workers, self.on_bad_file = num_workers, on_bad_file
        self.indices = np.arange(rank, len(source.files), world_size)

    num_images = property(lambda self: len(self.indices))
    in_channels = property(lambda self: 3)
    num_classes = property(lambda self: self.source.num_classes)
    skipped_files = property(lambda self: tuple(self._bad.skipped))

    def __len__(self):
        return -(-len(self.indices) // self.batch_size)

    def __iter__(self):
        ds = torch.utils.data.Subset(_CenterCrops(self.source, self.image_size), self.indices.tolist())
        dl = torch.utils.data.DataLoader(ds, batch_size=self.batch_size, num_workers=self.num_workers,
                                         collate_fn=_collate_eval, pin_memory=self.device.type == "cuda")
        for x, y, bad in dl:
            if bad:
                self._bad.report([self.source.files[j] for j in bad], "undecodable files")
            x = x.to(self.device, non_blocking=True).float().div_(255.0)
            yield (normalize(x, self.source.mean, self.source.std, self.dtype, self.channels_last),
                   y.to(self.device))
