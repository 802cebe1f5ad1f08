"""Small PIL images for the data tests (tests/test_data_augment.py, tests/test_data_folder.py)."""
from __future__ import annotations

import numpy as np
from PIL import Image


def random_image(w=40, h=30, seed=0):
    """A w x h RGB image of uniform random pixels, the same for the same seed."""
    a = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(a)
