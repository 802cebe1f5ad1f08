"""Synthetic JPEG ImageFolders for tests and benchmarks (nothing can be downloaded at run time).

Images are smooth random colour fields plus shapes and mild noise, so JPEG sizes and decode cost
are close to natural photos of the same resolution (a 400x300 image is ~20-40 KB at quality 90).
"""
from __future__ import annotations

import os

import numpy as np
from PIL import Image, ImageDraw


def synth_image(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    low = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    img = Image.fromarray(low).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(2, 6))):
        # (the bounds clamped for images under 18 px: the draws of larger ones are unchanged)
        x0, y0 = int(rng.integers(0, max(1, width - 8))), int(rng.integers(0, max(1, height - 8)))
        x1 = x0 + int(rng.integers(8, max(9, width // 2)))
        y1 = y0 + int(rng.integers(8, max(9, height // 2)))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=fill)
    arr = np.asarray(img, dtype=np.int16) + rng.integers(-12, 13, (height, width, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def write_jpeg_folder(root, num_classes=4, per_class=25, size_range=(256, 500), seed=0,
                      quality=90) -> str:
    """root/<class_k>/<i>.jpg with random sizes in size_range (both sides). Returns root."""
    if num_classes < 1 or per_class < 1:
        raise ValueError(f"num_classes and per_class must be >= 1, got {num_classes}, {per_class}")
    rng = np.random.default_rng(seed)
    for c in range(num_classes):
        d = os.path.join(root, f"class_{c:02d}")
        os.makedirs(d, exist_ok=True)
        for i in range(per_class):
            w, h = (int(v) for v in rng.integers(size_range[0], size_range[1] + 1, 2))
            synth_image(rng, w, h).save(os.path.join(d, f"{i:05d}.jpg"), quality=quality)
    return root
