"""Draw PNG plots of a bench_loss.py CSV: time and peak extra memory against size, one line per
backend, one panel per (kind, dtype).  Uses each (device, backend, kind, dtype, n, N)'s newest row
that succeeded (rows with a "status" other than "ok", i.e. failed cases, are left out; CSVs from
before the status column count every row).

    python bench/plot_bench.py bench/results/loss_cpu.csv [--out bench/results]
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"{path} has no rows")
    latest = OrderedDict()
    for row in rows:  # rows are appended in time order: the last one of a key wins
        if (row.get("status") or "ok") != "ok" or not row.get("median_s"):
            continue
        latest[(row["device"], row["backend"], row["kind"], row["dtype"], row["n"], row["N"])] = row
    if not latest:
        raise SystemExit(f"{path} has no successful rows")
    return list(latest.values())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("csv")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: beside the CSV)")
    args = ap.parse_args(argv)
    from bench_csv import check_output_folder  # the bench scripts' output-path check
    if not os.path.isfile(args.csv):
        ap.error(f"csv {args.csv!r}: " + ("is a folder; give a bench_loss.py CSV"
                                          if os.path.isdir(args.csv) else "no such file"))
    out = args.out or os.path.dirname(os.path.abspath(args.csv))
    check_output_folder(ap, "--out", out)  # before reading and drawing
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load(args.csv)
    os.makedirs(out, exist_ok=True)
    stem = os.path.splitext(os.path.basename(args.csv))[0]
    panels = sorted({(r["kind"], r["dtype"]) for r in rows})
    written = []
    for metric, label, fname in (("median_s", "fwd+bwd time, median (s)", "time"),
                                 ("peak_extra_mib", "peak extra memory (MiB)", "memory")):
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
        for ax, (kind, dtype) in zip(axes[0], panels):
            sel = [r for r in rows if r["kind"] == kind and r["dtype"] == dtype and r[metric]]
            for backend in sorted({r["backend"] for r in sel}):
                pts = sorted((int(r["N"]), float(r[metric]), r) for r in sel if r["backend"] == backend)
                xs = [p[0] for p in pts]
                ys = [p[1] for p in pts]
                line, = ax.plot(xs, ys, marker="o", label=backend)
                if metric == "median_s":  # p20-p80 band
                    ax.fill_between(xs, [float(p[2]["p20_s"]) for p in pts],
                                    [float(p[2]["p80_s"]) for p in pts], alpha=0.2,
                                    color=line.get_color())
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            n_desc = "n = N" if kind == "inbatch" else f"n = {sel[0]['n'] if sel else '?'}"
            ax.set_title(f"{kind} ({n_desc}), {dtype}")
            ax.set_xlabel("keys N" if kind == "inbatch" else "queue size M")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        device = rows[-1]["device"]
        fig.suptitle(f"NAC loss, D={rows[-1]['D']}, {device}, torch {rows[-1]['torch']}")
        fig.tight_layout()
        path = os.path.join(out, f"{stem}_{fname}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    for p in written:
        print(p)


if __name__ == "__main__":
    main()
