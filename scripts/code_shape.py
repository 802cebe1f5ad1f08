"""The shape of each code bit's pre-activation over a data split: why sgn(a) can lose information
while BatchNorm keeps every bit's mean and variance fixed (docs/results.md, the longer run).

    python scripts/code_shape.py runs/default/last.pt [more checkpoints] [--data fashion-mnist]

For each checkpoint, over the split's images (the frozen model in eval mode, as
`python -m nac_fast.eval` codes them), per bit d of a = the head's pre-activations:
  skewness      E[x^3] of x = (a_d - mean) / std; mean |skewness| over the bits
  kurtosis      E[x^4], mean over the bits (3 for a Gaussian)
  sign balance  mean over the bits of |P(a_d >= 0) - 1/2| (docs/math.md [M:balance-dev], on
                these codes), and the fraction of bits with P(a_d >= 0) outside [0.3, 0.7]
  |tanh a|      mean |tanh a| (docs/math.md [M:relax])
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def shape_stats(a: torch.Tensor) -> dict:
    """The statistics above for pre-activations a of shape (images, bits)."""
    if a.dim() != 2 or a.shape[0] < 2:
        raise ValueError(f"a must be (images >= 2, bits), got shape {tuple(a.shape)}")
    a = a.double()
    std = a.std(0)
    x = (a - a.mean(0)) / torch.where(std > 0, std, torch.ones_like(std))
    pos = (a >= 0).double().mean(0)
    return {"skewness": (x ** 3).mean(0).abs().mean().item(),
            "kurtosis": (x ** 4).mean(0).mean().item(),
            "balance_dev": (pos - 0.5).abs().mean().item(),
            "skewed_bits": ((pos < 0.3) | (pos > 0.7)).double().mean().item(),
            "code_mag": torch.tanh(a).abs().mean().item()}


def codes_of(checkpoint: str, data: str, split: str, batch_size: int = 500) -> torch.Tensor:
    """The head pre-activations a of the split's images, extracted as `python -m nac_fast.eval`
    does (its extract_features, at the checkpoint's image size)."""
    from nac_fast.data import build_eval_loader
    from nac_fast.eval.cli import extract_features
    from nac_fast.train.checkpoint import load_checkpoint, load_model
    size = int(load_checkpoint(checkpoint)["config"]["image_size"])
    model = load_model(checkpoint, "online").eval()
    loader = build_eval_loader(data, split=split, batch_size=batch_size,
                               image_size=size, device="cpu")
    return extract_features(model, loader, loader.num_images, "cpu", False, "codes")["a"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoints", nargs="+", help="train.py checkpoints (last.pt)")
    ap.add_argument("--data", default="fashion-mnist", help="the data the codes are taken on")
    ap.add_argument("--split", default="test", choices=("train", "test"))
    args = ap.parse_args(argv)
    print("| checkpoint | mean abs skewness | kurtosis | mean abs(P(+1) - 1/2) | "
          "bits with P(+1) outside [0.3, 0.7] | mean abs(tanh a) |")
    print("|---|---|---|---|---|---|")
    for ck in args.checkpoints:
        if not os.path.isfile(ck):
            ap.error(f"checkpoint {ck!r}: no such file")
        s = shape_stats(codes_of(ck, args.data, args.split))
        print(f"| {ck} | {s['skewness']:.2f} | {s['kurtosis']:.1f} | {s['balance_dev']:.3f} | "
              f"{s['skewed_bits']:.2f} | {s['code_mag']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
