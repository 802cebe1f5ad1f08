"""Turn train.py's JSON-lines log into PNG curves.

    python scripts/plot_train_log.py runs/default/log.jsonl [--out runs/default/curves.png]
    python scripts/plot_train_log.py runs/nac/log.jsonl runs/simclr/log.jsonl --out cmp.png

One panel per logged quantity (loss, lr, img/s, data wait, distinct codes, mean Hamming
distance, balance score, code saturation) against the step; several logs are overlaid, labelled
by their directory.  A resumed run's log repeats the steps after its checkpoint: the last record
of each step is plotted.  Logs written before 'bit_balance' was renamed 'balance_score' (the same
quantity, docs/math.md [M:balance-score]) are read with the key renamed.
"""
from __future__ import annotations

import argparse
import json
import os

KEYS = ("loss", "lr", "img_per_s", "data_wait", "distinct_frac", "mean_hamming", "balance_score",
        "code_sat")
OLD_KEYS = {"bit_balance": "balance_score"}  # key in older logs -> key now


def read_log(path: str) -> list[dict]:
    by_step = {}
    with open(path) as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: not a JSON line ({exc})") from None
            if "step" not in rec:
                raise ValueError(f"{path}:{i}: record has no 'step'")
            for old, new in OLD_KEYS.items():
                if old in rec and new not in rec:
                    rec[new] = rec.pop(old)
            by_step[rec["step"]] = rec
    if not by_step:
        raise ValueError(f"{path}: empty log")
    return [by_step[s] for s in sorted(by_step)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", help="log.jsonl files")
    ap.add_argument("--out", default=None, help="PNG path (default: next to the first log)")
    args = ap.parse_args(argv)
    for p in args.logs:
        if not os.path.isfile(p):
            ap.error(f"no such log file: {p}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(os.path.basename(os.path.dirname(os.path.abspath(p))) or p, read_log(p))
            for p in args.logs]
    keys = [k for k in KEYS if any(k in r for _, recs in runs for r in recs)]
    cols = 4
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for name, recs in runs:
            pts = [(r["step"], r[key]) for r in recs if key in r]
            ax.plot([s for s, _ in pts], [v for _, v in pts], label=name)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    if len(runs) > 1:
        axes.flat[0].legend()
    fig.tight_layout()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.logs[0])), "curves.png")
    fig.savefig(out, dpi=100)
    print(out)


if __name__ == "__main__":
    main()
