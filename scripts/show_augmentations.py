"""Write a PNG grid (one row per image: original | view 1 | view 2) to eyeball the augmentations.

    python scripts/show_augmentations.py --data fashion-mnist --out /tmp/aug.png
    python scripts/show_augmentations.py --data DIR --loader dali-cpu --size 224 --out /tmp/aug.png
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import ImageOps  # noqa: E402
from torchvision.utils import save_image  # noqa: E402

from nac_fast._files import atomic_write, check_new_file  # noqa: E402
from nac_fast.data import LOADERS, MIN_IMAGE_SIZE, build_pretrain_loader  # noqa: E402
from nac_fast.data.sources import resolve_source  # noqa: E402
from nac_fast.data.sources.imagefolder import load_rgb  # noqa: E402
from nac_fast.data.sources import InMemorySource  # noqa: E402


def _unnormalise(x, mean, std):
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return (x.float().cpu() * s + m).clamp(0, 1)


def originals(source, idx, size):
    """The source images, whole (aspect kept, padded) at the view size, float in [0, 1]."""
    if isinstance(source, InMemorySource):
        x = source.images[torch.as_tensor(idx)].float() / 255
        return torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", antialias=True)
    out = []
    for i in idx:
        img = ImageOps.pad(load_rgb(source.files[i]), (size, size), color=(255, 255, 255))
        out.append(torch.from_numpy(np.asarray(img, dtype=np.float32) / 255).permute(2, 0, 1))
    return torch.stack(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="fashion-mnist")
    ap.add_argument("--loader", default="auto", choices=LOADERS)
    ap.add_argument("--size", type=int, default=None)
    ap.add_argument("--num", type=int, default=8, help="images (rows)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epoch", type=int, default=0)
    ap.add_argument("--recipe", default="auto", choices=["auto", "small", "imagenet"])
    ap.add_argument("--out", default="augmentations.png")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    a = ap.parse_args(argv)
    if a.num < 1:
        ap.error(f"--num must be >= 1, got {a.num}")
    if a.size is not None and a.size < MIN_IMAGE_SIZE:
        ap.error(f"--size must be >= {MIN_IMAGE_SIZE}, got {a.size}")
    if a.epoch < 0:
        ap.error(f"--epoch must be >= 0, got {a.epoch}")
    try:
        check_new_file("--out", a.out, a.overwrite)  # (it checks the place is writable too)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        n = len(resolve_source(a.data, "train").labels)
    except (ValueError, FileNotFoundError, OSError) as exc:
        ap.error(f"--data {a.data!r}: {exc}")
    if a.num > n:
        ap.error(f"--num {a.num} exceeds the {n} training images of --data {a.data!r}")
    try:
        ld = build_pretrain_loader(a.data, batch_size=a.num, seed=a.seed, image_size=a.size,
                                   loader=a.loader, recipe=a.recipe)
        ld.set_epoch(a.epoch)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        ap.error(str(exc))
    idx = ld.batch_indices()[0]
    v1, v2 = next(iter(ld))
    src = ld.source
    rows = [originals(src, idx, ld.image_size), _unnormalise(v1, src.mean, src.std),
            _unnormalise(v2, src.mean, src.std)]
    if rows[0].shape[1] == 1:
        rows = [r.expand(-1, 3, -1, -1) for r in rows]
    grid = torch.stack(rows, 1).flatten(0, 1)            # row-major: orig, v1, v2 per image
    atomic_write(a.out, lambda f: save_image(grid, f, format="png", nrow=3, padding=2,
                                             pad_value=1.0))
    print(f"wrote {a.out}: {a.num} rows x (original | view 1 | view 2), {ld.kind} loader, "
          f"recipe {ld.recipe.name}, {ld.image_size} px")


if __name__ == "__main__":
    main()
