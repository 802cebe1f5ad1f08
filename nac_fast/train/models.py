"""Encoders, projection head and inference network for NAC (NAC_SPEC.md, "Notation").

    model = build_model("resnet18", in_channels=1, image_size=28, code_dim=128, inference_net=True)
    h, a, r = model(torch.cat([view1, view2]))    # r: cross-pathway inference logits (see forward)

Architectures (``ARCHS``):
  resnet18, resnet34, resnet50   torchvision ResNets (widths 64..512, 2048 for resnet50)
  resnet18-small                 ResNet-18 layout at half width (32..256): CPU experiments
  resnet-tiny                    one BasicBlock per stage, widths 16..128: CPU defaults and tests
For inputs of at most 64 px the stem is replaced by a 3x3 stride-1 convolution without max-pool
(the CIFAR variant the paper uses); larger inputs keep the ImageNet stem.  Any number of input
channels is supported (grayscale Fashion-MNIST has 1).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torchvision
from torchvision.models.resnet import BasicBlock, Bottleneck

# name -> (block, layers, widths); widths are the base width of each stage (the output width is
# widths[-1] * block.expansion).
ARCHS = {
    "resnet18": (BasicBlock, (2, 2, 2, 2), (64, 128, 256, 512)),
    "resnet34": (BasicBlock, (3, 4, 6, 3), (64, 128, 256, 512)),
    "resnet50": (Bottleneck, (3, 4, 6, 3), (64, 128, 256, 512)),
    "resnet18-small": (BasicBlock, (2, 2, 2, 2), (32, 64, 128, 256)),
    "resnet-tiny": (BasicBlock, (1, 1, 1, 1), (16, 32, 64, 128)),
}
_TORCHVISION = {"resnet18": torchvision.models.resnet18, "resnet34": torchvision.models.resnet34,
                "resnet50": torchvision.models.resnet50}

SMALL_IMAGE_MAX = 64  # inputs up to this size get the 3x3 stride-1 stem without max-pool


def _resnet_trunk(block, layers, widths) -> torchvision.models.ResNet:
    """A torchvision ResNet with arbitrary stage widths.

    torchvision's ResNet hard-codes widths 64..512, so the narrow variants are built by the same
    class with `_make_layer` re-run at other widths: the blocks, init and forward are torchvision's.
    """
    net = torchvision.models.ResNet(block, list(layers))
    if tuple(widths) == (64, 128, 256, 512):
        return net
    net.inplanes = widths[0]
    net.conv1 = nn.Conv2d(3, widths[0], kernel_size=7, stride=2, padding=3, bias=False)
    net.bn1 = nn.BatchNorm2d(widths[0])
    net.layer1 = net._make_layer(block, widths[0], layers[0])
    net.layer2 = net._make_layer(block, widths[1], layers[1], stride=2)
    net.layer3 = net._make_layer(block, widths[2], layers[2], stride=2)
    net.layer4 = net._make_layer(block, widths[3], layers[3], stride=2)
    for m in net.modules():  # torchvision's init, re-applied to the re-made layers
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
    return net


class ResNetEncoder(nn.Module):
    """torchvision ResNet without its classifier: (B, C, H, W) -> (B, d) pooled features h."""

    def __init__(self, arch: str = "resnet18", in_channels: int = 3, image_size: int = 224):
        super().__init__()
        if arch not in ARCHS:
            raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
        if isinstance(in_channels, bool) or not isinstance(in_channels, int) or in_channels < 1:
            raise ValueError(f"in_channels must be a positive int, got {in_channels!r}")
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 8:
            raise ValueError(f"image_size must be an int >= 8, got {image_size!r}")
        block, layers, widths = ARCHS[arch]
        net = (_TORCHVISION[arch]() if arch in _TORCHVISION else _resnet_trunk(block, layers, widths))
        self.small_stem = image_size <= SMALL_IMAGE_MAX
        if self.small_stem:
            # The paper's CIFAR encoder: a 7x7/2 stem plus max-pool would shrink a 32 px image to
            # 8 px before the first block, so small inputs get a 3x3 stride-1 stem and no pool.
            net.conv1 = nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False)
            net.maxpool = nn.Identity()
        elif in_channels != 3:
            net.conv1 = nn.Conv2d(in_channels, widths[0], 7, stride=2, padding=3, bias=False)
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
        net.fc = nn.Identity()
        self.net = net
        self.out_dim = widths[-1] * block.expansion
        self.arch, self.in_channels, self.image_size = arch, in_channels, image_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp(d_in: int, d_hidden: int, d_out: int) -> nn.Sequential:
    """Linear(d,d) -> ReLU -> Linear(d,D): the spec's projection head g and inference net phi."""
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(inplace=True),
                         nn.Linear(d_hidden, d_out))


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """[view1 rows; view2 rows] -> [view2 rows; view1 rows] (the cross pathway)."""
    k = t.shape[0] // 2
    return torch.cat([t[k:], t[:k]])


class NACModel(nn.Module):
    """Encoder f, projection head g and (optionally) inference network phi.

    forward(x) with x = cat([view1, view2]) (2K rows) returns (h, a, r):
      h = f(x), a = g(h) (pre-activations; the code is tanh(a), the hash code sgn(a)),
      r = phi(h of the *other* view) for every row, i.e. phi(swap_halves(h)): the cross pathway
          that keeps the inference net from reading the code it has to predict.  r is None when
          the model has no inference network (SimCLR) or `with_r=False`.
    `detach_r_input=True` feeds phi sg(h) (NAC-MQ's separately trained online inference net).
    Both a and r are divided by sqrt(D) when `scale_codes` (the authors' initial-scale choice).
    """

    def __init__(self, arch="resnet18", in_channels=3, image_size=224, code_dim=128,
                 inference_net=True, scale_codes=True):
        super().__init__()
        if isinstance(code_dim, bool) or not isinstance(code_dim, int) or code_dim < 1:
            raise ValueError(f"code_dim must be a positive int, got {code_dim!r}")
        self.encoder = ResNetEncoder(arch, in_channels, image_size)
        d = self.encoder.out_dim
        self.head = mlp(d, d, code_dim)
        self.infer = mlp(d, d, code_dim) if inference_net else None
        self.code_dim = code_dim
        self.scale = 1.0 / math.sqrt(code_dim) if scale_codes else 1.0

    @property
    def feature_dim(self) -> int:
        return self.encoder.out_dim

    def encode(self, x):
        """(h, a) without the inference network (momentum branch before un-shuffling)."""
        h = self.encoder(x)
        return h, self.head(h) * self.scale

    def infer_logits(self, h):
        if self.infer is None:
            raise RuntimeError("this model was built without an inference network")
        return self.infer(h) * self.scale

    def forward(self, x, with_r: bool = True, detach_r_input: bool = False):
        h, a = self.encode(x)
        r = None
        if with_r and self.infer is not None:
            hr = swap_halves(h)
            r = self.infer_logits(hr.detach() if detach_r_input else hr)
        return h, a, r


def build_model(arch="resnet18", in_channels=3, image_size=224, code_dim=128, inference_net=True,
                scale_codes=True) -> NACModel:
    return NACModel(arch, in_channels, image_size, code_dim, inference_net, scale_codes)


def model_kwargs_from_config(cfg: dict) -> dict:
    """The build_model arguments recorded in a training checkpoint's config."""
    return dict(arch=cfg["arch"], in_channels=cfg["in_channels"], image_size=cfg["image_size"],
                code_dim=cfg["code_dim"], inference_net=cfg["method"] != "simclr",
                scale_codes=cfg["scale_codes"])
