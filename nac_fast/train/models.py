"""Encoders, projection head and inference network for NAC (docs/math.md [M:notation], [M:relax]).

    model = build_model("resnet18", in_channels=1, image_size=28, code_dim=128, inference_net=True)
    h, a, r = model(torch.cat([view1, view2]))    # r: cross-pathway inference logits (see forward)

Architectures (``ARCHS``; `build_encoder` builds any of them):
  resnet18, resnet34, resnet50   torchvision ResNets (widths 64..512, 2048 for resnet50)
  resnet18-small                 ResNet-18 layout at half width (32..256): CPU experiments
  resnet-tiny                    one BasicBlock per stage, widths 16..128: CPU defaults and tests
  vgg16-bn                       torchvision's vgg16_bn(weights=None).features + global average
                                 pool -> 512-d: the paper's hashing encoder (Tables 3-4; the
                                 authors' model.py: vgg16_bn, avgpool 1x1, no classifier)
For inputs of at most 64 px the ResNet stem is replaced by a 3x3 stride-1 convolution without
max-pool (the CIFAR variant the paper uses); larger inputs keep the ImageNet stem.  The VGG is the
same at every size (the authors train it on 32 px CIFAR-10 as it is: five 2x2 max-pools, 1x1 at
the end); its pools round up (ceil_mode), which changes nothing at multiples of 32 px and keeps a
1x1 map for sizes that are not (28 px Fashion-MNIST would reach 0x0).  Any number of input
channels is supported (grayscale Fashion-MNIST has 1): the first convolution takes them.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torchvision
from torchvision.models.resnet import BasicBlock, Bottleneck

from .. import _checks

# ResNets: name -> (block, layers, widths); widths are the base width of each stage (the output
# width is widths[-1] * block.expansion).
RESNETS = {
    "resnet18": (BasicBlock, (2, 2, 2, 2), (64, 128, 256, 512)),
    "resnet34": (BasicBlock, (3, 4, 6, 3), (64, 128, 256, 512)),
    "resnet50": (Bottleneck, (3, 4, 6, 3), (64, 128, 256, 512)),
    "resnet18-small": (BasicBlock, (2, 2, 2, 2), (32, 64, 128, 256)),
    "resnet-tiny": (BasicBlock, (1, 1, 1, 1), (16, 32, 64, 128)),
}
_TORCHVISION = {"resnet18": torchvision.models.resnet18, "resnet34": torchvision.models.resnet34,
                "resnet50": torchvision.models.resnet50}

# VGGs: name -> torchvision's constructor (its .features is the trunk; 512 channels at the end).
VGGS = {"vgg16-bn": torchvision.models.vgg16_bn}
VGG_OUT_DIM = 512
# Every encoder: name -> its spec (a ResNet's (block, layers, widths), a VGG's constructor).
ARCHS = {**RESNETS, **VGGS}

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
        if arch not in RESNETS:
            more = f" ({arch!r} is not a ResNet: build_encoder)" if arch in ARCHS else ""
            raise ValueError(f"arch must be one of {sorted(RESNETS)}, got {arch!r}{more}")
        _checks.positive_int("in_channels", in_channels)
        _checks.int_in("image_size", image_size, 8)
        block, layers, widths = RESNETS[arch]
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


class VGGEncoder(nn.Module):
    """torchvision VGG's convolutional trunk (`features`, BatchNorm in vgg16-bn) + global average
    pool: (B, C, H, W) -> (B, 512) features h.  The authors' hashing encoder (their model.py:
    vgg16_bn() with avgpool = AdaptiveAvgPool2d(1) and classifier = Identity), trained from
    scratch (weights=None: torchvision's init).  `in_channels` != 3 replaces the first
    convolution (same shape otherwise, torchvision's init); the max-pools round up (ceil_mode) so
    that every size >= 8 px keeps a 1x1 map after the fifth pool (identical to torchvision's at
    multiples of 32 px)."""

    def __init__(self, arch: str = "vgg16-bn", in_channels: int = 3, image_size: int = 32):
        super().__init__()
        if arch not in VGGS:
            raise ValueError(f"arch must be one of {sorted(VGGS)}, got {arch!r}")
        _checks.positive_int("in_channels", in_channels)
        _checks.int_in("image_size", image_size, 8)
        features = VGGS[arch](weights=None).features
        if in_channels != 3:
            first = features[0]
            features[0] = nn.Conv2d(in_channels, first.out_channels, first.kernel_size,
                                    stride=first.stride, padding=first.padding)
            nn.init.kaiming_normal_(features[0].weight, mode="fan_out", nonlinearity="relu")
            nn.init.constant_(features[0].bias, 0)
        for m in features:
            if isinstance(m, nn.MaxPool2d):
                m.ceil_mode = True
        self.features = features
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.out_dim = VGG_OUT_DIM
        self.arch, self.in_channels, self.image_size = arch, in_channels, image_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.features(x)), 1)


def build_encoder(arch: str = "resnet18", in_channels: int = 3, image_size: int = 224) -> nn.Module:
    """The encoder f of `arch` (any name in ARCHS): a module (B, C, H, W) -> (B, out_dim)."""
    if arch in VGGS:
        return VGGEncoder(arch, in_channels, image_size)
    if arch not in RESNETS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    return ResNetEncoder(arch, in_channels, image_size)


def mlp(d_in: int, d_hidden: int, d_out: int) -> nn.Sequential:
    """Linear(d,d) -> ReLU -> Linear(d,D): the projection head g and the inference net phi of
    docs/math.md [M:notation]."""
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(inplace=True),
                         nn.Linear(d_hidden, d_out))


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """[view1 rows; view2 rows] -> [view2 rows; view1 rows] (the cross pathway)."""
    k = t.shape[0] // 2
    return torch.cat([t[k:], t[:k]])


# The two head designs (docs/math.md [M:relax] and [M:heads]; docs/results.md measures them):
#   paper     the authors' heads: the flag defaults, configs/fashion_mnist_paper.toml and the
#             ImageNet/CIFAR recipes
#   learning  [M:heads], the demo's default (configs/small.toml, also named
#             configs/fashion_mnist_learning.toml)
INFER_INITS = ("independent", "copy")
A_GAIN_BN = 3.0


def resolve_r_gain(r_gain, a_gain: float, p: float) -> float:
    """The inference logits' gain: a number, or "auto" = 2 (1 - 2p) a_gain (at small codes the Bernoulli term's optimal logits are r = 2 atanh((1 - 2p) z) ~ 2 (1 - 2p) z,
    docs/math.md [M:floor]; with both heads batch-normalised, r = 2 (1 - 2p) a has that slope)."""
    if isinstance(r_gain, str):
        if r_gain != "auto":
            raise ValueError(f"r_gain must be a number > 0 or 'auto', got {r_gain!r}")
        p = _checks.flip_prob("p (needed to resolve r_gain='auto')", p)
        return 2.0 * (1.0 - 2.0 * p) * float(a_gain)
    if not _checks.is_number(r_gain) or not r_gain > 0:
        raise ValueError(f"r_gain must be a number > 0 or 'auto', got {r_gain!r}")
    return float(r_gain)


class Gain(nn.Module):
    """y = x * g: g a fixed number (no parameter) or, when `learnable`, a per-bit (D,) parameter
    initialised to that number (LARS treats it like a BatchNorm weight: no trust ratio, no weight
    decay)."""

    def __init__(self, value: float, dim: int, learnable: bool = False):
        super().__init__()
        if not _checks.is_number(value) or not value > 0:
            raise ValueError(f"gain must be a number > 0, got {value!r}")
        self.value, self.learnable = float(value), bool(learnable)
        self.weight = nn.Parameter(torch.full((dim,), float(value))) if learnable else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return x if self.value == 1.0 else x * self.value
        return x * self.weight.to(x.dtype)

    def extra_repr(self) -> str:
        return f"value={self.value:g}, learnable={self.learnable}"


def head(d: int, code_dim: int, bn: bool) -> nn.Sequential:
    """mlp(d, d, D), followed by BatchNorm1d(D, affine=False) when `bn` (every output unit then has
    mean 0 and variance 1 over the batch: the codes cannot shrink to zero, and each bit is
    balanced in training)."""
    net = mlp(d, d, code_dim)
    if bn:
        net.append(nn.BatchNorm1d(code_dim, affine=False))
    return net


class NACModel(nn.Module):
    """Encoder f, projection head g and (optionally) inference network phi.

    forward(x) with x = cat([view1, view2]) (2K rows) returns (h, a, r) of docs/math.md
    [M:notation]: r = phi(swap_halves(h)), the cross pathway of [M:inbatch].  r is None when the
    model has no inference network (SimCLR) or `with_r=False`.
    `detach_r_input=True` feeds phi sg(h) (NAC-MQ's separately trained online inference net,
    [M:vi]).
    `scale_codes`: a and r divided by sqrt(D), [M:relax].

    Head options (all off / 1 by default: the authors' heads):
      head_bn, infer_bn   BatchNorm1d(D, affine=False) at the end of g, of phi
      a_gain, r_gain      output gains: a = g(h) a_gain / sqrt(D), r = phi(h') r_gain / sqrt(D)
                          (r_gain may be "auto" = 2 (1 - 2p) a_gain, which needs p)
      learn_gain          the gains are per-bit parameters initialised to a_gain, r_gain
      infer_init          "independent" (own random init) or "copy" (phi starts as a copy of g's
                          weights, so r starts as (r_gain / a_gain) x the partner's a)
      bn_per_view         forward() runs the encoder and heads on each view separately, so every
                          BatchNorm normalises over one view's images (the authors' two forward
                          passes); encode() (momentum branch, evaluation) runs one pass.
    """

    def __init__(self, arch="resnet18", in_channels=3, image_size=224, code_dim=128,
                 inference_net=True, scale_codes=True, *, head_bn=False, infer_bn=False,
                 a_gain=1.0, r_gain=1.0, learn_gain=False, infer_init="independent",
                 bn_per_view=False, p=None):
        super().__init__()
        _checks.positive_int("code_dim", code_dim)
        if infer_init not in INFER_INITS:
            raise ValueError(f"infer_init must be one of {INFER_INITS}, got {infer_init!r}")
        for name, v in (("head_bn", head_bn), ("infer_bn", infer_bn), ("learn_gain", learn_gain),
                        ("bn_per_view", bn_per_view), ("scale_codes", scale_codes)):
            _checks.flag(name, v)
        r_gain = resolve_r_gain(r_gain, a_gain, p) if r_gain == "auto" else r_gain
        self.encoder = build_encoder(arch, in_channels, image_size)
        d = self.encoder.out_dim
        self.head = head(d, code_dim, head_bn)
        self.infer = head(d, code_dim, infer_bn) if inference_net else None
        if self.infer is not None and infer_init == "copy":
            with torch.no_grad():
                for i in (0, 2):  # the two Linear layers (a BatchNorm(affine=False) has no weights)
                    self.infer[i].weight.copy_(self.head[i].weight)
                    self.infer[i].bias.copy_(self.head[i].bias)
        self.code_dim = code_dim
        self.scale = 1.0 / math.sqrt(code_dim) if scale_codes else 1.0
        self.a_gain = Gain(a_gain, code_dim, learn_gain)
        self.r_gain = Gain(r_gain, code_dim, learn_gain) if inference_net else None
        self.bn_per_view = bn_per_view
        self.options = dict(head_bn=head_bn, infer_bn=infer_bn, a_gain=float(a_gain),
                            r_gain=float(r_gain), learn_gain=learn_gain, infer_init=infer_init,
                            bn_per_view=bn_per_view)

    @property
    def feature_dim(self) -> int:
        return self.encoder.out_dim

    def _codes(self, h):
        return self.a_gain(self.head(h)) * self.scale

    def encode(self, x):
        """(h, a) without the inference network (momentum branch before un-shuffling)."""
        h = self.encoder(x)
        return h, self._codes(h)

    def infer_logits(self, h):
        if self.infer is None:
            raise RuntimeError("this model was built without an inference network")
        return self.r_gain(self.infer(h)) * self.scale

    def _views(self, fn, t):
        """fn over the whole batch, or over each view's half when bn_per_view."""
        if not self.bn_per_view:
            return fn(t)
        k = t.shape[0] // 2
        if t.shape[0] != 2 * k:
            raise ValueError(f"bn_per_view needs an even number of rows (two views), got "
                             f"{t.shape[0]}")
        return torch.cat([fn(t[:k]), fn(t[k:])])

    def forward(self, x, with_r: bool = True, detach_r_input: bool = False):
        h = self._views(self.encoder, x)
        a = self._views(self._codes, h)
        r = None
        if with_r and self.infer is not None:
            hr = swap_halves(h)
            r = self._views(self.infer_logits, hr.detach() if detach_r_input else hr)
        return h, a, r


def build_model(arch="resnet18", in_channels=3, image_size=224, code_dim=128, inference_net=True,
                scale_codes=True, **options) -> NACModel:
    """NACModel; `options` are its keyword-only head options (NACModel's docstring)."""
    return NACModel(arch, in_channels, image_size, code_dim, inference_net, scale_codes,
                    **options)


# The head options a run's config records (train.py flags; NACModel's keyword-only options).
HEAD_OPTIONS = ("head_bn", "infer_bn", "a_gain", "r_gain", "learn_gain", "infer_init",
                "bn_per_view")
MODEL_CONFIG_KEYS = ("arch", "in_channels", "image_size", "code_dim", "method", "scale_codes",
                     "flip_prob") + HEAD_OPTIONS


def model_kwargs_from_config(cfg: dict) -> dict:
    """The build_model arguments recorded in a training checkpoint's config (TrainConfig.to_dict:
    arch, in_channels, image_size, code_dim, method, scale_codes and the head options).  A
    config whose r_gain is 'auto' has it resolved from flip_prob.  ValueError naming the keys a
    config lacks."""
    missing = [k for k in MODEL_CONFIG_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"the checkpoint's config has no {', '.join(missing)}: not a config of "
                         "this train.py (TrainConfig)")
    opts = {k: cfg[k] for k in HEAD_OPTIONS}
    opts["r_gain"] = resolve_r_gain(opts["r_gain"], opts["a_gain"], cfg["flip_prob"])
    return dict(arch=cfg["arch"], in_channels=cfg["in_channels"], image_size=cfg["image_size"],
                code_dim=cfg["code_dim"], inference_net=cfg["method"] != "simclr",
                scale_codes=cfg["scale_codes"], **opts)
