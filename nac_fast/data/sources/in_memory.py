"""A data set held in memory as one uint8 tensor: what Fashion-MNIST and CIFAR-10 load into."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class InMemorySource:
    name: str
    images: torch.Tensor        # (N, C, H, W) uint8
    labels: torch.Tensor        # (N,) int64
    mean: tuple                 # per-channel statistics the loaders normalise with
    std: tuple
    num_classes: int

    @property
    def natural_size(self) -> int:
        return int(self.images.shape[-1])
