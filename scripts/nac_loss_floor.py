"""Where can the in-batch NAC loss go?  Its value for idealised codes of a given magnitude.

    python scripts/nac_loss_floor.py                     # batch 256 images, D = 128, p = 0.1
    python scripts/nac_loss_floor.py --images 1000 --p 0.4

A newcomer who watches `train.py` sees the NAC loss start near D ln 2 (88.72 for D = 128) and
move by tenths.  This script shows why: it evaluates the loss exactly as nac_fast.nac_loss
computes it (reference backend) for the ideal encoder of docs/math.md [M:floor] (K images with
distinct random sign patterns, both views the same code z = t * sign, the best inference logits r
for that code).  Rows: the magnitude t, the contrastive part mean(lse - log n), the Bernoulli part
-mean(bern), and the loss.

At t = 0 the best r is 0 and the loss is D ln 2 ([M:z0]); why larger t first lowers it and then
raises it, and the table this script prints for its defaults: [M:floor].  The whole range below
the start is about 1.2 at batch 256: a loss that moves from 88.72 towards 87.5 is not a stalled
run; judge training by the evaluation (linear probe, hash mAP) and the code statistics in the log.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nac_fast  # noqa: E402


def loss_at(t: float, images: int, D: int, p: float, gen: torch.Generator):
    sign = torch.randint(0, 2, (images, D), generator=gen, dtype=torch.float64) * 2 - 1
    z = t * torch.cat([sign, sign])  # both views of an image share the code
    q = (1 - 2 * p) * z  # E[z~] given the clean code
    r = torch.log1p(q) - torch.log1p(-q)
    a = torch.atanh(z.clamp(-1 + 1e-12, 1 - 1e-12))  # tanh(a) = z
    noise = nac_fast.draw_noise(a.shape, p, generator=gen, dtype=torch.float64)
    per_row = nac_fast.nac_loss(a, r, p, noise=noise, reduction="none", backend="reference")
    s = nac_fast.channel_scale(p)
    zt = noise * z
    lse = torch.logsumexp(s * zt @ z.T, dim=1) - math.log(2 * images)
    return float(lse.mean()), float((per_row - lse).mean()), float(per_row.mean())


MATRICES = 4   # n x n float64 matrices alive at once in the reference loss and the lse


def available_bytes() -> int | None:
    """The memory this machine has available (Linux: SC_AVPHYS_PAGES), or None if unknown."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=256, help="images per batch (n = 2 x images rows)")
    ap.add_argument("--dim", type=int, default=128, help="code bits D")
    ap.add_argument("--p", type=float, default=0.1, help="flip probability")
    ap.add_argument("--magnitudes", default="0,0.05,0.1,0.15,0.2,0.25,0.3,0.5,1",
                    help="code magnitudes t to evaluate")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.images < 1 or args.dim < 1:
        ap.error("--images and --dim must be >= 1")
    if not 0 < args.p < 0.5:
        ap.error("--p must lie in (0, 0.5)")
    # the reference (and the lse here) hold a few n x n float64 logits at once, n = 2 x images
    need, have = MATRICES * 8 * (2 * args.images) ** 2, available_bytes()
    if have is not None and need > have:
        most = int(math.isqrt(have // (MATRICES * 8)) // 2)
        ap.error(f"--images {args.images}: about {need / 2**30:.1f} GiB of n x n logits, this "
                 f"machine has {have / 2**30:.1f} GiB available (at most --images {most})")
    try:
        ts = [float(x) for x in args.magnitudes.split(",")]
    except ValueError:
        ap.error(f"--magnitudes must be comma-separated numbers, got {args.magnitudes!r}")
    if any(not 0 <= t <= 1 for t in ts):
        ap.error("--magnitudes must lie in [0, 1]")
    gen = torch.Generator().manual_seed(args.seed)
    print(f"in-batch NAC loss, {args.images} images (n = {2 * args.images} rows), D = {args.dim}, "
          f"p = {args.p}; D ln 2 = {args.dim * math.log(2):.3f}")
    print(f"{'t':>6} {'lse - log n':>12} {'-bern':>10} {'loss':>10}")
    best = None
    for t in ts:
        c, b, total = loss_at(t, args.images, args.dim, args.p, gen)
        best = (total, t) if best is None or total < best[0] else best
        print(f"{t:>6.3g} {c:>12.3f} {b:>10.3f} {total:>10.3f}")
    print(f"lowest: {best[0]:.3f} at t = {best[1]:g}")


if __name__ == "__main__":
    main()
