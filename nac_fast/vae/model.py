"""The VAE of the paper's Table 5 (Appendix "Experimental Details for VAE Pretraining";
docs/math.md [M:vae-protocol]):

    encoder    a ResNet (nac_fast.train.models.ResNetEncoder, the one NAC pretrains) -> h
    posterior  one Linear layer h -> (mu, logvar) of a diagonal Gaussian q(z | x)
    decoder    the encoder mirrored with transposed convolutions: Linear z -> the last stage's
               feature map, then per stage (deepest first) the stage's residual blocks and a
               stride-2 ConvTranspose2d up to the next stage's size, finally a 3x3 convolution
               to (mean, log_scale) per sub-pixel of a discretised Gaussian [M:vae-dgauss]

    vae = VAE(arch="resnet-tiny", in_channels=1, image_size=28, latent_dim=32)
    mu, logvar = vae.posterior(x_norm)           # x_norm: the encoder's normalised input
    mean, log_scale = vae.decode(z)              # (B, C, H, W) each, [0, 1] pixel scale
    lp = vae.log_likelihood(x_u8, z)             # (B,) log p(x | z) in nats

Every stage of the decoder has as many residual blocks as the encoder's stage and the same
width, so the decoder is the encoder's size; the spatial sizes are the encoder's, in reverse
(ConvTranspose2d's output_size picks the odd/even size: 4 -> 7 -> 14 -> 28 for 28 px inputs).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..train.models import RESNETS, SMALL_IMAGE_MAX, ResNetEncoder
from .likelihood import discretized_gaussian_log_prob


def _down(s: int) -> int:
    """Output size of a 3x3 (or 7x7) stride-2 convolution / 3x3 stride-2 pool with padding k//2."""
    return (s + 1) // 2


def encoder_sizes(image_size: int) -> list:
    """The spatial size entering each stage of ResNetEncoder (stage 1 first) and after the stem.
    Returns [stem input, stage1, stage2, stage3, stage4] sizes."""
    s = image_size
    sizes = [s]
    if image_size > SMALL_IMAGE_MAX:  # ImageNet stem: 7x7/2 conv, then 3x3/2 max-pool
        s = _down(_down(s))
    sizes.append(s)                   # stage 1 keeps its input size
    for _ in range(3):                # stages 2..4 halve it
        s = _down(s)
        sizes.append(s)
    return sizes


class ResBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the identity, then ReLU (a BasicBlock without stride)."""

    def __init__(self, ch: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU(inplace=True),
            nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(x + self.body(x))


class Up(nn.Module):
    """ConvTranspose2d(3, stride 2, padding 1) to an exact output size, BN, ReLU."""

    def __init__(self, c_in: int, c_out: int, size: int):
        super().__init__()
        self.size = size
        self.conv = nn.ConvTranspose2d(c_in, c_out, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.bn(self.conv(x, output_size=(self.size, self.size))))


class Decoder(nn.Module):
    """z (B, latent) -> (mean, log_scale), each (B, C, S, S): the encoder `arch` mirrored."""

    def __init__(self, arch: str, out_channels: int, image_size: int, latent_dim: int):
        super().__init__()
        block, layers, widths = RESNETS[arch]
        sizes = encoder_sizes(image_size)       # [S, stage1, stage2, stage3, stage4]
        self.start, self.c0 = sizes[-1], widths[-1]
        self.fc = nn.Linear(latent_dim, widths[-1] * self.start * self.start)
        mods = [nn.ReLU(inplace=True)]
        for i in (3, 2, 1, 0):                  # stage 4 first
            mods += [ResBlock(widths[i]) for _ in range(layers[i])]
            if i > 0:
                mods.append(Up(widths[i], widths[i - 1], sizes[i]))
        if image_size > SMALL_IMAGE_MAX:        # undo the ImageNet stem's two halvings
            mods += [Up(widths[0], widths[0], _down(image_size)),
                     Up(widths[0], widths[0], image_size)]
        self.body = nn.Sequential(*mods)
        self.out = nn.Conv2d(widths[0], 2 * out_channels, 3, padding=1)
        self.out_channels = out_channels
        with torch.no_grad():                   # start near mean 0.5, scale e^-1: no large
            self.out.bias[:out_channels] = 0.5  # initial losses
            self.out.bias[out_channels:] = -1.0

    def forward(self, z):
        y = self.fc(z).view(z.shape[0], self.c0, self.start, self.start)
        y = self.out(self.body(y))
        return y[:, :self.out_channels], y[:, self.out_channels:]


class VAE(nn.Module):
    """Encoder (ResNetEncoder), linear posterior head, mirrored decoder; see the module doc."""

    def __init__(self, arch: str = "resnet-tiny", in_channels: int = 3, image_size: int = 32,
                 latent_dim: int = 32):
        super().__init__()
        if isinstance(latent_dim, bool) or not isinstance(latent_dim, int) or latent_dim < 1:
            raise ValueError(f"latent_dim must be a positive int, got {latent_dim!r}")
        self.encoder = ResNetEncoder(arch, in_channels, image_size)   # checks arch and sizes
        self.head = nn.Linear(self.encoder.out_dim, 2 * latent_dim)
        self.decoder = Decoder(arch, in_channels, image_size, latent_dim)
        self.arch, self.in_channels, self.image_size = arch, in_channels, image_size
        self.latent_dim = latent_dim

    def posterior(self, x_norm: torch.Tensor):
        """(mu, logvar) of q(z | x), each (B, latent_dim)."""
        mu, logvar = self.head(self.encoder(x_norm)).chunk(2, dim=1)
        return mu, logvar

    def decode(self, z: torch.Tensor):
        return self.decoder(z)

    def log_likelihood(self, x_u8: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """log p(x | z) of each image (nats), docs/math.md [M:vae-dgauss]."""
        mean, log_scale = self.decoder(z)
        return discretized_gaussian_log_prob(x_u8, mean, log_scale).flatten(1).sum(1)

    def param_groups(self, lr: float, encoder_lr: float, freeze_encoder: bool) -> list:
        """Adam groups: the encoder at encoder_lr (none when frozen), head + decoder at lr."""
        rest = list(self.head.parameters()) + list(self.decoder.parameters())
        groups = [{"params": rest, "lr": lr, "name": "head+decoder"}]
        if not freeze_encoder:
            groups.insert(0, {"params": list(self.encoder.parameters()), "lr": encoder_lr,
                              "name": "encoder"})
        return groups
