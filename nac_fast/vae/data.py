"""The VAE's data: a split of any data set the trainer reads, held in memory as 8-bit images.

    ds = load_images("fashion-mnist", "train", image_size=None, limit=None)
    ds.images        # (N, C, S, S) uint8: the values the likelihood scores
    ds.normalize(x)  # the encoder's input: (x / 255 - mean) / std with the data set's statistics
    order = epoch_order(len(ds), seed, epoch)   # the training order of one epoch (exact resume)

The images come through nac_fast.data.build_eval_loader (one centred view: in-memory data sets
resized whole, ImageFolders resized and centre-cropped) and are rounded back to 8 bits: at the
natural size of an in-memory data set that returns the stored bytes exactly; a resized image is
quantised to 8 bits, and that quantised image is what the VAE models.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..data import build_eval_loader

# An ImageFolder split is decoded into memory once; more than this many bytes is refused.
DEFAULT_MAX_BYTES = 8 * 2 ** 30


@dataclass
class ImageSet:
    images: torch.Tensor        # (N, C, S, S) uint8
    mean: tuple
    std: tuple
    data: str
    split: str
    total: int                  # images in the whole split (N <= total with a limit)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.images.shape[-1])

    def normalize(self, x_u8: torch.Tensor) -> torch.Tensor:
        m = torch.as_tensor(self.mean, dtype=torch.float32, device=x_u8.device).view(1, -1, 1, 1)
        s = torch.as_tensor(self.std, dtype=torch.float32, device=x_u8.device).view(1, -1, 1, 1)
        return (x_u8.float() / 255.0 - m) / s


def _loader(data, split, image_size, limit, batch_size=1024):
    """(loader, n_used, n_split): `limit` images spread evenly over the split (image
    floor(i n / limit): every (n / limit)-th where limit divides n), as nac_fast.eval takes
    them, so that class-sorted folders keep every class."""
    full = build_eval_loader(data, split=split, batch_size=batch_size, image_size=image_size)
    n = full.num_images
    if limit is None:
        return full, n, n
    if limit > n:
        raise ValueError(f"--limit-{split} {limit} exceeds the {split} split's {n} images")
    sub = build_eval_loader(data, split=split, batch_size=batch_size, image_size=image_size,
                            limit=limit)
    return sub, limit, n


def probe(data, split: str = "train", image_size=None):
    """(channels, image_size, n) of a split without decoding it (for argument checks)."""
    ld = build_eval_loader(data, split=split, batch_size=1, image_size=image_size)
    size = image_size if image_size is not None else ld.source.natural_size
    return int(ld.in_channels), int(size), int(ld.num_images)


def load_images(data, split: str, image_size=None, limit=None, progress: bool = False,
                max_bytes: int = DEFAULT_MAX_BYTES) -> ImageSet:
    """The split as uint8 images in memory (see the module docstring)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"--limit-{split} must be a positive int, got {limit!r}")
    ld, n_used, n_total = _loader(data, split, image_size, limit)
    size = image_size if image_size is not None else ld.source.natural_size
    need = n_used * ld.in_channels * size * size
    if need > max_bytes:
        raise ValueError(f"--data {data!r}: {n_used} images of {ld.in_channels}x{size}x{size} "
                         f"need {need / 2 ** 30:.1f} GiB as 8-bit values in memory (limit "
                         f"{max_bytes / 2 ** 30:.1f} GiB): use --limit-{split} or --image-size")
    mean, std = tuple(ld.source.mean), tuple(ld.source.std)
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    out = torch.empty((n_used, ld.in_channels, size, size), dtype=torch.uint8)
    got = 0
    from tqdm.auto import tqdm
    with tqdm(total=n_used, desc=f"load {split}", unit="img", disable=not progress,
              file=sys.stderr) as bar:
        for x, _ in ld:
            take = min(x.shape[0], n_used - got)
            x = x[:take].float() * s + m                      # back to [0, 1]
            out[got:got + take] = torch.round(x * 255.0).clamp_(0, 255).to(torch.uint8)
            got += take
            bar.update(take)
            if got >= n_used:
                break
    if got != n_used:
        raise ValueError(f"--data {data!r}: the {split} split yielded {got} images, expected "
                         f"{n_used}")
    return ImageSet(out, mean, std, str(data), split, n_total)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of one training epoch: a function of (seed, epoch) only, so a resumed run
    visits the same batches in the same order."""
    g = torch.Generator().manual_seed(1_000_003 * int(seed) + int(epoch))
    return torch.randperm(n, generator=g)
