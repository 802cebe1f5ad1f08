"""Data pipeline for NAC pretraining: two independently augmented views of every image.

    from nac_fast.data import build_pretrain_loader, build_eval_loader
    loader = build_pretrain_loader("fashion-mnist", batch_size=256, rank=rank, world_size=world)
    for epoch in range(epochs):
        loader.set_epoch(epoch)                 # or set_epoch(epoch, start_batch=k) to resume
        for view1, view2 in loader:             # (B, C, H, W) normalised, on `device`
            ...

One straight line; each stage imports only the stages before it:

    sources/   what the images are: Fashion-MNIST, CIFAR-10, ImageFolder file lists (+ the
               bad-file policy), synthetic data for tests and benchmarks
    order.py   which images, in which batch, on which (global) rank; exact resume; the per-view
               random numbers, a function of (seed, epoch, image index, view)
    augment.py the recipe and its tensor, PIL and DALI implementations
    loaders/   batches: tensor (in-memory), folder (PIL workers), dali (CPU/GPU pipelines)
    here       build_pretrain_loader / build_eval_loader choose the source and the loader

Sources (`data`):
  "fashion-mnist" (default, embedded: Debian package path or $NAC_FASHION_MNIST_DIR), or a
  directory holding the IDX files / a torchvision FashionMNIST root;
  a CIFAR-10 python-batches directory;
  an ImageFolder root (train/ and val/ of class folders; a root of class folders is its own
  train split), ILSVRC2012's tree as distributed among them (a flat val/ labelled by
  LOC_val_solution.csv or the devkit's ground truth: `val_labels`).  A multi-process run passes
  a sources.Listing (`listing`): one process scans the folder, the others receive its list, and
  the list is cached between runs (sources/listing.py).
Loaders (`loader`):
  "torchvision": in-memory sources use batched tensor ops (loaders/tensor.py); ImageFolders decode
      and crop with PIL in DataLoader workers and do the colour ops batched (loaders/folder.py);
  "dali-cpu" / "dali-gpu": ImageFolders only, NVIDIA DALI (loaders/dali.py);
  "auto": in-memory -> torchvision; ImageFolder -> dali-gpu if DALI and CUDA are there, dali-cpu
      if DALI is there, else torchvision (also when a file name is not UTF-8: DALI cannot open
      it; an explicit dali-* loader is then a ValueError naming the files).
Every loader draws the same augmentation parameters from (seed, epoch, image index, view), shards
by global rank with equal batch counts (drop_last), and yields the same batch format.  Bad
ImageFolder files follow `on_bad_file` (sources/imagefolder.py): "warn" skips and counts them
(loader.skipped_files), "error" stops naming them.
"""
from __future__ import annotations

import torch

from .. import _checks
from .augment import Recipe, make_recipe
from .loaders.tensor import TensorEvalLoader, TensorPretrainLoader
from .order import evenly_spaced
from .sources import InMemorySource, Listing, hash_train_source, resolve_source
from .sources.imagefolder import check_policy, non_utf8_names
from .sources.subset import TRAIN_SUBSETS, HashSubset

LOADERS = ("auto", "torchvision", "dali-cpu", "dali-gpu")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["build_pretrain_loader", "build_eval_loader", "resolve_source", "dali_available",
           "make_recipe", "Recipe", "LOADERS", "HashSubset", "TRAIN_SUBSETS", "Listing"]


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


MIN_IMAGE_SIZE = 8   # the smallest side a loader crops to (typed, or read from the images)


class ImageSizeError(ValueError):
    """The image size (typed, or the natural size read from the images) is below
    MIN_IMAGE_SIZE; `size` is the value, `from_data` whether it was read from the images."""

    def __init__(self, message, size, from_data):
        super().__init__(message)
        self.size, self.from_data = size, from_data


def _check_size(size, from_data=False):
    """The one >= MIN_IMAGE_SIZE check for a typed image_size and a size read from the data."""
    if not _checks.is_int(size) or size < MIN_IMAGE_SIZE:
        if from_data:
            raise ImageSizeError(f"image_size must be an int >= {MIN_IMAGE_SIZE}, got {size!r} "
                                 "(read from the images: the median short side of a sample of "
                                 f"them); give an image_size >= {MIN_IMAGE_SIZE} to resize them",
                                 size, True)
        raise ImageSizeError(f"image_size must be None or an int >= {MIN_IMAGE_SIZE}, got "
                             f"{size!r}", size, False)
    return size


def _image_size(image_size, source):
    """The size the loader crops to: `image_size`, else the source's natural size (checked)."""
    if image_size is not None:
        return image_size
    return _check_size(source.natural_size, from_data=True)


def _check_common(batch_size, image_size, num_workers, dtype, channels_last, on_bad_file):
    _checks.positive_int("batch_size", batch_size)
    if image_size is not None:
        _check_size(image_size)
    if not _checks.is_int(num_workers) or num_workers < 0:
        raise ValueError(f"num_workers must be a non-negative int, got {num_workers!r}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of {_FLOAT_DTYPES}, got {dtype!r}")
    _checks.flag("channels_last", channels_last)
    check_policy(on_bad_file)          # in-memory sources have no files, but the same check


def _pick_loader(loader, source, device):
    if loader not in LOADERS:
        raise ValueError(f"loader must be one of {LOADERS}, got {loader!r}")
    if isinstance(source, InMemorySource):
        if loader.startswith("dali"):
            raise ValueError(f"loader={loader!r} reads ImageFolders of JPEG/PNG files; {source.name} is "
                             "an in-memory array: use loader='auto' or 'torchvision'")
        return "torchvision"
    if loader != "auto":
        if loader.startswith("dali") and not dali_available():
            raise ValueError(f"loader={loader!r} needs NVIDIA DALI: pip install nvidia-dali-cuda130 "
                             "(nvidia-dali-cuda120 for CUDA 12 drivers), or use loader='torchvision'")
        odd = non_utf8_names(source.files) if loader.startswith("dali") else []
        if odd:
            raise ValueError(f"loader={loader!r}: DALI reads files by UTF-8 names only, and "
                             f"{len(odd)} file name(s) of {source.root} are not UTF-8: "
                             f"{', '.join(odd[:5])}{' ...' if len(odd) > 5 else ''}; rename them "
                             "or use loader='torchvision'")
        return loader
    if not dali_available() or non_utf8_names(source.files):   # DALI cannot open those names
        return "torchvision"
    return "dali-gpu" if torch.device(device).type == "cuda" else "dali-cpu"


def build_pretrain_loader(data="fashion-mnist", batch_size=256, rank=0, world_size=1, seed=0,
                          image_size=None, loader="auto", num_workers=0, device="cpu",
                          channels_last=False, dtype=torch.float32, recipe="auto", scale=None,
                          on_bad_file="warn", subset=None, val_labels=None, listing=None):
    """Two-view pretraining loader; see the module docstring.

    Yields (view1, view2), each (batch_size, C, image_size, image_size) normalised `dtype` on
    `device` (channels_last memory format if asked; DALI's NHWC output is returned as that view
    without a copy).  len() = batches per epoch for this rank.  set_epoch(epoch, start_batch=0).
    rank/world_size: the GLOBAL rank and the number of processes; batch_size is per rank.
    recipe: "small" | "imagenet" | "auto" (imagenet at >= 96 px); scale: crop area range (lo, hi),
    default the recipe's (0.08, 1); every loader crops with it (the crop windows come from
    augment.view_params, DALI's too).  on_bad_file (ImageFolders): "warn" skips an unreadable
    file (counted in loader.skipped_files, named in one warning), "error" raises naming it.
    subset: None (the training split), or a HashSubset: the paper's hashing training images of
    the pool train + test (sources.subset; the source keeps the pool's order), which the
    evaluation's paper protocol assumes.  ValueError when batch_size x world_size exceeds the
    data set (an epoch would have no batch).  ImageFolders: val_labels, the labels file of a
    flat val/ (ILSVRC2012's as distributed; read by a subset, which pools train + test);
    listing, a sources.Listing: the folder scanned by one process of the run and cached between
    runs (sources/listing.py).
    """
    _check_common(batch_size, image_size, num_workers, dtype, channels_last, on_bad_file)
    if subset is not None and not isinstance(subset, HashSubset):
        raise TypeError(f"subset must be None or a HashSubset, got {type(subset).__name__}")
    source = (resolve_source(data, "train", listing=listing) if subset is None
              else hash_train_source(data, subset, val_labels=val_labels, listing=listing)[0])
    size = _image_size(image_size, source)
    rec = make_recipe(recipe, size, scale)
    kind = _pick_loader(loader, source, device)
    if isinstance(source, InMemorySource):
        return TensorPretrainLoader(source, batch_size, rank, world_size, seed, size, rec, device,
                                    channels_last, dtype)
    if kind == "torchvision":
        from .loaders.folder import FolderPretrainLoader
        return FolderPretrainLoader(source, batch_size, rank, world_size, seed, size, rec, device,
                                    channels_last, dtype, num_workers, on_bad_file)
    from .loaders.dali import DaliPretrainLoader
    return DaliPretrainLoader(source, batch_size, rank, world_size, seed, size, rec, device,
                              channels_last, dtype, num_workers, on_bad_file, gpu=kind == "dali-gpu")


def build_eval_loader(data="fashion-mnist", split="train", batch_size=256, rank=0, world_size=1,
                      image_size=None, num_workers=0, device="cpu", channels_last=False,
                      dtype=torch.float32, on_bad_file="warn", limit=None, val_labels=None,
                      listing=None):
    """(images, labels) batches in a fixed order, one centred view: in-memory sources are resized
    whole to image_size (identity at the natural size); ImageFolders are resized to
    image_size/0.875 on the short side and centre-cropped (224 <- 256).  Rank r gets every
    world_size-th image (disjoint, covering the split; the last batch may be smaller).
    limit: `limit` of those images spread evenly over them (`evenly_spaced`: every
    (n / limit)-th where limit divides their number n), so that a class-sorted folder keeps
    every class; a limit above n is a ValueError.  on_bad_file as for build_pretrain_loader (a
    skipped file's place is taken by the next decodable file, with its label).  val_labels,
    listing: as for build_pretrain_loader (a flat val/ is ordered as the same images sorted into
    class folders, so both evaluate alike)."""
    _check_common(batch_size, image_size, num_workers, dtype, channels_last, on_bad_file)
    if split not in ("train", "test", "val"):
        raise ValueError(f"split must be 'train' or 'test' ('val' is an alias), got {split!r}")
    if limit is not None:
        _checks.positive_int("limit", limit)
    source = resolve_source(data, "test" if split == "val" else split,
                            val_labels=val_labels if split != "train" else None, listing=listing)
    size = _image_size(image_size, source)
    if isinstance(source, InMemorySource):
        loader = TensorEvalLoader(source, batch_size, rank, world_size, size, device,
                                  channels_last, dtype)
    else:
        from .loaders.folder import FolderEvalLoader
        loader = FolderEvalLoader(source, batch_size, rank, world_size, size, device,
                                  channels_last, dtype, num_workers, on_bad_file)
    if limit is not None:
        if limit > loader.num_images:
            raise ValueError(f"limit {limit} exceeds the {loader.num_images} images of the "
                             f"{split} split{' for this rank' if world_size > 1 else ''}")
        loader.indices = loader.indices[evenly_spaced(loader.num_images, limit)]
    return loader
