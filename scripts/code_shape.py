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
  |corr|        mean |correlation| between two different bits
  eff. rank     participation ratio (sum lambda)^2 / sum lambda^2 of the bits' correlation
                matrix's eigenvalues: D for independent bits, 1 for copies of one bit

With --retrieval Q, also the mAP@all (percent) of Q random test queries against the training
images as gallery (relevant = same class, ties by gallery index as in [M:rank]), ranked two
ways over the same codes: by Hamming distance of sgn(a) (what the evaluation reports, on a
query subset), of sgn(a - median) (each bit's median over the gallery: balanced bits), and by
the cosine of the continuous a. Hamming below cosine by much: the binarisation
loses the ranking; both low: the code space itself does not group the classes.
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
    d = a.shape[1]
    corr = x.T @ x / (a.shape[0] - 1)
    lam = torch.linalg.eigvalsh(corr).clamp_min(0)
    off = (corr - torch.diag(torch.diag(corr))).abs().sum() / max(d * (d - 1), 1)
    return {"skewness": (x ** 3).mean(0).abs().mean().item(),
            "kurtosis": (x ** 4).mean(0).mean().item(),
            "balance_dev": (pos - 0.5).abs().mean().item(),
            "skewed_bits": ((pos < 0.3) | (pos > 0.7)).double().mean().item(),
            "code_mag": torch.tanh(a).abs().mean().item(),
            "mean_abs_corr": off.item(),
            "eff_rank": (lam.sum() ** 2 / (lam ** 2).sum()).item() if lam.sum() > 0 else 0.0}


def _aps(score: torch.Tensor, query_labels: torch.Tensor, gallery_labels: torch.Tensor):
    """AP of each query row of score (ranked by descending score, ties by gallery index) that
    has a relevant gallery item."""
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    rel = (gallery_labels[order] == query_labels[:, None]).double()
    prec = rel.cumsum(1) / torch.arange(1, rel.shape[1] + 1, dtype=torch.float64)
    n_rel = rel.sum(1)
    keep = n_rel > 0
    return (prec * rel).sum(1)[keep] / n_rel[keep]


def ranking_map(score: torch.Tensor, query_labels: torch.Tensor, gallery_labels: torch.Tensor,
                chunk: int = 256) -> float:
    """mAP@all of ranking each query's gallery by descending score (Q, G), ties by gallery index
    (docs/math.md [M:rank], [M:ap]); relevant = same label.  With score = sgn(q) . sgn(g)
    = D - 2 Hamming it is nac_fast.mean_average_precision."""
    if score.dim() != 2 or score.shape != (len(query_labels), len(gallery_labels)):
        raise ValueError(f"score must be (queries, gallery) = ({len(query_labels)}, "
                         f"{len(gallery_labels)}), got shape {tuple(score.shape)}")
    return torch.cat([_aps(score[i:i + chunk], query_labels[i:i + chunk], gallery_labels)
                      for i in range(0, score.shape[0], chunk)]).mean().item()


def retrieval_maps(a_query, y_query, a_gallery, y_gallery, chunk: int = 256) -> dict:
    """mAP of the same codes ranked by Hamming distance of sgn(a) and of sgn(a - m), m each
    bit's median over the gallery (the evaluation's mean_average_precision on sign_codes), and
    by cosine of a (ranking_map, scores computed chunk queries at a time)."""
    from nac_fast.eval.cli import sign_codes
    from nac_fast import mean_average_precision
    med = a_gallery.median(0).values
    gal = torch.nn.functional.normalize(a_gallery.double(), dim=1)
    cos = [_aps(torch.nn.functional.normalize(a_query[i:i + chunk].double(), dim=1) @ gal.T,
                y_query[i:i + chunk], y_gallery) for i in range(0, len(a_query), chunk)]
    return {"hamming_map": float(mean_average_precision(
                sign_codes(a_query), y_query, sign_codes(a_gallery), y_gallery)),
            "median_map": float(mean_average_precision(
                sign_codes(a_query - med), y_query, sign_codes(a_gallery - med), y_gallery)),
            "cosine_map": torch.cat(cos).mean().item()}


def features_of(checkpoint: str, data: str, splits, batch_size: int = 500,
                progress: bool = False) -> dict:
    """{split: {"a", "labels"}}: the head pre-activations a of each split's images and their
    labels, extracted as `python -m nac_fast.eval` does (its extract_features, at the
    checkpoint's image size), the checkpoint loaded once."""
    from nac_fast.data import build_eval_loader
    from nac_fast.eval.cli import extract_features
    from nac_fast.train.checkpoint import load_checkpoint, load_model
    size = int(load_checkpoint(checkpoint)["config"]["image_size"])
    model = load_model(checkpoint, "online").eval()
    out = {}
    for split in splits:
        loader = build_eval_loader(data, split=split, batch_size=batch_size,
                                   image_size=size, device="cpu")
        f = extract_features(model, loader, loader.num_images, "cpu", progress,
                             f"codes ({split})")
        out[split] = {"a": f["a"], "labels": f["labels"]}
    return out


def check_input(checkpoint: str, data: str, splits) -> dict:
    """ValueError (naming the checkpoint or --data) unless the checkpoint loads as a train.py
    model and --data has its channels in every split: checked for every checkpoint before the
    table's header is printed.  Returns {split: its number of images}."""
    from nac_fast.data import build_eval_loader
    from nac_fast.train.checkpoint import load_checkpoint, load_model
    cfg = load_checkpoint(checkpoint)["config"]
    if not isinstance(cfg, dict) or cfg.get("kind") == "vae" or "code_dim" not in cfg:
        raise ValueError(f"checkpoint {checkpoint!r} is not a train.py checkpoint (no code_dim: "
                         "a python -m nac_fast.vae checkpoint?)")
    load_model(checkpoint, "online")
    size = int(cfg["image_size"])
    sizes = {}
    for split in splits:
        try:
            ld = build_eval_loader(data, split=split, batch_size=1, image_size=size, device="cpu")
        except FileNotFoundError as exc:
            raise ValueError(f"--data {data!r}: {exc}") from None
        want = cfg.get("in_channels")
        if want is not None and int(ld.in_channels) != int(want):
            raise ValueError(f"--data {data!r} has {ld.in_channels}-channel images; the model of "
                             f"{checkpoint!r} takes {want}-channel images")
        sizes[split] = int(ld.num_images)
    return sizes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoints", nargs="+", help="train.py checkpoints (last.pt)")
    ap.add_argument("--data", default="fashion-mnist", help="the data the codes are taken on")
    ap.add_argument("--split", default="test", choices=("train", "test"))
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bar for the feature extraction (on stderr, with an ETA)")
    ap.add_argument("--retrieval", type=int, default=0, metavar="Q",
                    help="also the Hamming, median-centred Hamming and cosine mAP of Q random "
                         "test queries (seed 0) against the training images; 0: off")
    args = ap.parse_args(argv)
    if args.retrieval < 0:
        ap.error(f"--retrieval must be >= 0, got {args.retrieval}")
    splits = sorted({args.split, "train", "test"}) if args.retrieval else [args.split]
    for ck in args.checkpoints:
        if not os.path.isfile(ck):
            ap.error(f"checkpoint {ck!r}: no such file")
        try:
            sizes = check_input(ck, args.data, splits)
        except (ValueError, FileNotFoundError, RuntimeError, KeyError) as exc:
            ap.error(str(exc))
        if args.retrieval > sizes["test"]:  # the header would name more queries than are run
            ap.error(f"--retrieval {args.retrieval} exceeds the {sizes['test']} test images of "
                     f"--data {args.data!r}")
    head = ("| checkpoint | mean abs skewness | kurtosis | mean abs(P(+1) - 1/2) | "
            "bits with P(+1) outside [0.3, 0.7] | mean abs(tanh a) | mean abs corr | eff. rank |")
    if args.retrieval:
        head += f" mAP Hamming ({args.retrieval} q) | mAP Hamming, median-centred | mAP cosine |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for ck in args.checkpoints:
        f = features_of(ck, args.data, splits, progress=args.progress)
        s = shape_stats(f[args.split]["a"])
        row = (f"| {ck} | {s['skewness']:.2f} | {s['kurtosis']:.1f} | {s['balance_dev']:.3f} | "
               f"{s['skewed_bits']:.2f} | {s['code_mag']:.3f} | {s['mean_abs_corr']:.3f} | "
               f"{s['eff_rank']:.1f} |")
        if args.retrieval:
            te, tr = f["test"], f["train"]
            q = torch.randperm(len(te["labels"]), generator=torch.Generator().manual_seed(0))
            q = q[:args.retrieval].sort().values
            m = retrieval_maps(te["a"][q], te["labels"][q], tr["a"], tr["labels"])
            row += (f" {100 * m['hamming_map']:.1f} | {100 * m['median_map']:.1f} | "
                    f"{100 * m['cosine_map']:.1f} |")
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
