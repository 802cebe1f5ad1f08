"""PNG grids of images (Pillow only): the VAE's reconstructions and prior samples."""
from __future__ import annotations

import os
import tempfile

import torch


def grid(images: torch.Tensor, ncol: int, pad: int = 2, scale: int = 2) -> torch.Tensor:
    """(N, C, H, W) uint8 -> (rows * (H + pad) + pad, ...) uint8 tile image, C in {1, 3};
    each pixel repeated `scale` times for legibility."""
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"grid needs (N, 1|3, H, W) uint8 images, got {images.dtype} "
                         f"{tuple(images.shape)}")
    n, c, h, w = images.shape
    rows = -(-n // ncol)
    out = torch.full((c, rows * (h + pad) + pad, ncol * (w + pad) + pad), 255, dtype=torch.uint8)
    for i in range(n):
        r, q = divmod(i, ncol)
        out[:, pad + r * (h + pad):pad + r * (h + pad) + h,
            pad + q * (w + pad):pad + q * (w + pad) + w] = images[i]
    if scale > 1:
        out = out.repeat_interleave(scale, 1).repeat_interleave(scale, 2)
    return out


def save_png(tile: torch.Tensor, path: str) -> None:
    """Write a (C, H, W) uint8 tile atomically (temp file, rename)."""
    from PIL import Image
    arr = tile.permute(1, 2, 0).numpy()
    img = Image.fromarray(arr[:, :, 0] if arr.shape[2] == 1 else arr)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + ".", dir=d)
    os.close(fd)
    try:
        img.save(tmp, format="PNG")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def to_u8(x01: torch.Tensor) -> torch.Tensor:
    return torch.round(x01.clamp(0, 1) * 255).to(torch.uint8)
