"""The evaluation view of a trained model, for images that come from no data set: what
`python -m nac_fast.index` does to a user's image before encoding it.

    prep = checkpoint_preprocessing(checkpoint["config"])   # from the run's saved config
    x = load_image(path, prep)                                # (C, S, S) float, normalised

The preprocessing is the one the model was evaluated with (nac_fast.data.build_eval_loader), read
from the data set the checkpoint's config names: its per-channel mean and std, the image size and
channels the model was built for, and the resize rule of its loader:

  "whole"        Fashion-MNIST and CIFAR-10 (in-memory sources): the whole image, bilinear and
                 antialiased, to image_size x image_size (augment.center_resize)
  "center-crop"  ImageFolders: the short side to image_size / 0.875, then the centre crop
                 (augment.pil_center_crop, the ImageNet convention)

A config that records "mean" and "std" itself is used as it is.  Images are decoded with PIL and
converted to grayscale ("L") for 1-channel models and to RGB for 3-channel ones.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from .augment import center_resize, normalize, pil_center_crop
from .sources import cifar, fashion_mnist
from .sources.imagefolder import IMAGENET_MEAN, IMAGENET_STD, open_image

__all__ = ["checkpoint_preprocessing", "load_image", "RESIZE_RULES"]

RESIZE_RULES = ("whole", "center-crop")
_FMNIST_NAMES = ("fashion-mnist", "fashion_mnist", "fashionmnist")


def checkpoint_preprocessing(config: dict) -> dict:
    """``{"data", "image_size", "in_channels", "mean", "std", "resize"}`` of a train.py
    checkpoint's config (``checkpoint["config"]`` or the run's config.json).

    ValueError, naming what is missing, when the config does not say: no data set, image size
    or channels; synthetic training data; or a data folder that is gone and no recorded
    mean/std (the constants come from the data set's kind, which only the folder shows)."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (a checkpoint's 'config'), got {type(config).__name__}")
    missing = [k for k in ("data", "image_size", "in_channels") if config.get(k) is None]
    if missing:
        raise ValueError(f"the checkpoint's config records no {', '.join(missing)}: its "
                         "preprocessing is unknown")
    data, size, ch = str(config["data"]), int(config["image_size"]), int(config["in_channels"])
    if ch not in (1, 3):
        raise ValueError(f"the checkpoint's model takes {ch}-channel images; only 1 (grayscale) "
                         "and 3 (RGB) can be decoded from image files")
    out = {"data": data, "image_size": size, "in_channels": ch}
    if config.get("mean") is not None and config.get("std") is not None:
        mean, std = tuple(config["mean"]), tuple(config["std"])
        resize = config.get("resize", "whole")
    elif data.lower() in _FMNIST_NAMES:
        mean, std, resize = fashion_mnist.MEAN, fashion_mnist.STD, "whole"
    elif data.startswith("synthetic"):
        raise ValueError(f"the checkpoint was trained on generated data ({data!r}); it has no "
                         "image preprocessing to apply to image files")
    elif not os.path.isdir(data):
        raise ValueError(f"the checkpoint was trained on {data!r}, which is not a folder here, and "
                         "its config records no mean/std: the normalisation is unknown")
    elif fashion_mnist.find_dir(data) is not None:
        mean, std, resize = fashion_mnist.MEAN, fashion_mnist.STD, "whole"
    elif cifar.find_dir(data) is not None:
        mean, std, resize = cifar.MEAN, cifar.STD, "whole"
    else:
        mean, std, resize = IMAGENET_MEAN, IMAGENET_STD, "center-crop"
    if len(mean) != ch or len(std) != ch:
        raise ValueError(f"the normalisation of {data!r} has {len(mean)} channels but the model "
                         f"takes {ch}")
    if resize not in RESIZE_RULES:
        raise ValueError(f"resize rule {resize!r} is not one of {RESIZE_RULES}")
    out.update(mean=[float(m) for m in mean], std=[float(s) for s in std], resize=resize)
    return out


def load_image(path, prep: dict) -> torch.Tensor:
    """One image file -> the model's input (C, S, S) float32, normalised as ``prep`` says.
    Raises what PIL raises for a file it cannot decode (OSError, ValueError, ...)."""
    # as the loaders decode it: EXIF orientation applied, 16-bit/float samples scaled to 8 bits
    im = open_image(path).convert("L" if prep["in_channels"] == 1 else "RGB")
    size = prep["image_size"]
    if prep["resize"] == "center-crop":
        u8 = pil_center_crop(im, size)
    else:
        a = np.asarray(im, dtype=np.uint8)
        u8 = torch.from_numpy(a.copy()).reshape(a.shape[0], a.shape[1], -1).permute(2, 0, 1)
    if prep["resize"] == "center-crop":
        x = u8.float().div_(255.0)[None]
    else:
        x = center_resize(u8[None], size)
    return normalize(x, prep["mean"], prep["std"], torch.float32, False)[0]
