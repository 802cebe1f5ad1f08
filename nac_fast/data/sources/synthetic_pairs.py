"""A synthetic two-view loader with the interface of nac_fast.data.build_pretrain_loader.

For throughput benchmarks without a data set (bench/train_throughput.py) and for tests that
need exact, cheap control of the data (`--data synthetic` or `synthetic:N` in train.py).
Image i is a fixed random pattern drawn from (seed, i); each view is a random shift and
horizontal flip of it drawn from (seed, epoch, i, view), so batches depend only on
(seed, epoch, batch index) and `set_epoch(epoch, start_batch)` resumes exactly.
"""
from __future__ import annotations

import torch

from ... import _checks


def _fit(x: int) -> int:
    """A derived seed within torch.Generator.manual_seed's range (those within it unchanged)."""
    return x if -2**63 <= x < 2**64 else x % 2**64


class SyntheticPairLoader:
    skipped_files = ()          # generated images: nothing to skip (the loaders' interface)

    def __init__(self, num_images=4096, batch_size=64, rank=0, world_size=1, seed=0,
                 image_size=32, in_channels=3, device="cpu", channels_last=False,
                 dtype=torch.float32):
        for name, v in (("num_images", num_images), ("batch_size", batch_size),
                        ("image_size", image_size), ("in_channels", in_channels)):
            _checks.positive_int(name, v)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.num_images, self.batch_size = num_images, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.image_size, self.in_channels = image_size, in_channels
        self.device, self.channels_last, self.dtype = torch.device(device), channels_last, dtype
        self.epoch, self.start_batch = 0, 0

    def __len__(self):
        # every rank gets the same number of full batches (drop_last)
        return self.num_images // (self.batch_size * self.world_size)

    def set_epoch(self, epoch: int, start_batch: int = 0):
        if not 0 <= start_batch <= len(self):
            raise ValueError(f"start_batch must be in [0, {len(self)}], got {start_batch}")
        self.epoch, self.start_batch = epoch, start_batch

    def _image(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_fit(self.seed * 1_000_003 + i))
        s = self.image_size
        low = torch.randn(self.in_channels, 4, 4, generator=g)  # smooth pattern, some structure
        return torch.nn.functional.interpolate(low[None], size=(s, s), mode="bilinear",
                                               align_corners=False)[0]

    def _view(self, img: torch.Tensor, i: int, v: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(
            _fit(((self.seed * 7919 + self.epoch) * 1_000_003 + i) * 2 + v))
        dx, dy = torch.randint(-2, 3, (2,), generator=g).tolist()
        out = torch.roll(img, shifts=(dy, dx), dims=(1, 2))
        if torch.rand((), generator=g) < 0.5:
            out = out.flip(2)
        return out

    def __iter__(self):
        g = torch.Generator().manual_seed(_fit(self.seed * 31 + self.epoch))
        order = torch.randperm(self.num_images, generator=g)
        per_step = self.batch_size * self.world_size
        for b in range(self.start_batch, len(self)):
            ids = order[b * per_step + self.rank * self.batch_size:
                        b * per_step + (self.rank + 1) * self.batch_size].tolist()
            imgs = [self._image(i) for i in ids]
            v1 = torch.stack([self._view(im, i, 0) for im, i in zip(imgs, ids)])
            v2 = torch.stack([self._view(im, i, 1) for im, i in zip(imgs, ids)])
            yield self._out(v1), self._out(v2)
        self.start_batch = 0  # a resumed epoch starts mid-way only once

    def _out(self, t):
        t = t.to(self.device, self.dtype)
        return t.contiguous(memory_format=torch.channels_last) if self.channels_last else t


class DeviceSyntheticPairLoader(SyntheticPairLoader):
    """SyntheticPairLoader's interface with the images made and kept on `device` (bench/
    train_throughput.py's --data synthetic-device: a loader that costs no host work, no copies).

    `pool` smooth random images (a 4 x 4 random pattern upsampled, like SyntheticPairLoader's) are
    drawn once, on the device.  Batch b of an epoch takes pool images by a seeded random index
    (device generator), view 1 flips each image horizontally with probability 1/2 and view 2 is
    one random roll (host RNG, per batch) of the images plus its own flips.  Every per-batch op
    runs on the device; nothing waits for the host.  Deterministic in (seed, epoch, batch)."""

    def __init__(self, num_images=4096, batch_size=64, rank=0, world_size=1, seed=0,
                 image_size=32, in_channels=3, device="cpu", channels_last=False,
                 dtype=torch.float32, pool=256):
        super().__init__(num_images, batch_size, rank, world_size, seed, image_size, in_channels,
                         device, channels_last, dtype)
        _checks.positive_int("pool", pool)
        g = torch.Generator().manual_seed(_fit(seed * 1_000_003 + 17))
        low = torch.randn(pool, in_channels, 4, 4, generator=g).to(self.device)
        self.pool = torch.nn.functional.interpolate(
            low, size=(image_size, image_size), mode="bilinear", align_corners=False).to(dtype)

    def __iter__(self):
        import random
        seed = _fit((self.seed * 7919 + self.epoch) * 31 + self.rank)
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        host = random.Random(seed)
        B, P = self.batch_size, self.pool.shape[0]
        for b in range(len(self)):
            idx = torch.randint(0, P, (B,), device=self.device, generator=g)
            flip1 = torch.rand(B, 1, 1, 1, device=self.device, generator=g) < 0.5
            flip2 = torch.rand(B, 1, 1, 1, device=self.device, generator=g) < 0.5
            dy, dx = host.randint(-2, 2), host.randint(-2, 2)
            if b < self.start_batch:  # resume: same draws as an uninterrupted epoch
                continue
            x = self.pool[idx]
            v1 = torch.where(flip1, x.flip(3), x)
            x2 = torch.roll(x, shifts=(dy, dx), dims=(2, 3))
            v2 = torch.where(flip2, x2.flip(3), x2)
            yield self._out(v1), self._out(v2)
        self.start_batch = 0
