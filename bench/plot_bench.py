"""PNG plots of a bench_loss.py CSV (`python bench/plot_bench.py bench/results/loss_cpu.csv
[--out DIR]`): time (p20-p80 band) and peak extra memory against size, a line per backend (per
device, D, queue n where several), a panel per (kind, dtype), each case's newest successful row."""
import argparse
import csv
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import check_output_folder  # noqa: E402  (the bench scripts' output-path check)
NEEDED = ("device", "backend", "kind", "dtype", "n", "N", "D", "median_s", "p20_s", "p80_s",
          "peak_extra_mib", "torch")


def _num(x):
    """float(x), or None for an empty, non-numeric, non-finite or non-positive value."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        v = math.nan
    return v if math.isfinite(v) and v > 0 else None


def load(path):
    with open(path, newline="") as f:
        rows = list(reader := csv.DictReader(f))
    if not rows:
        raise SystemExit(f"{path} has no rows")
    if missing := [c for c in NEEDED if c not in (reader.fieldnames or [])]:
        raise SystemExit(f"{path} has no column {', '.join(missing)}: not a bench_loss.py CSV")
    latest = {}
    for row in rows:  # rows are appended in time order: the last one of a key wins
        if (row.get("status") or "ok") != "ok" or _num(row["median_s"]) is None:
            continue
        try:
            int(row["n"]), int(row["N"]), int(row["D"])
        except ValueError:  # a damaged row
            continue
        latest[(row["device"], row["backend"], row["kind"], row["dtype"], row["n"], row["N"],
                row["D"])] = row
    if not latest:
        raise SystemExit(f"{path} has no successful rows")
    return list(latest.values())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("csv")
    ap.add_argument("--out", help="folder for the PNGs (default: beside the CSV)")
    args = ap.parse_args(argv)
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
    devices, Ds = sorted({r["device"] for r in rows}), sorted({r["D"] for r in rows}, key=int)

    def series(r, ns):  # one line per backend, and per device, D and queue n where several
        return (r["backend"],) + ((r["device"],) if len(devices) > 1 else ()) + \
            ((f"D={r['D']}",) if len(Ds) > 1 else ()) + \
            ((f"n={r['n']}",) if len(ns) > 1 and r["kind"] == "mq" else ())
    written = []
    for metric, label, fname in (("median_s", "fwd+bwd time, median (s)", "time"),
                                 ("peak_extra_mib", "peak extra memory (MiB)", "memory")):
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
        for ax, (kind, dtype) in zip(axes[0], panels):
            sel = [r for r in rows if r["kind"] == kind and r["dtype"] == dtype
                   and _num(r[metric]) is not None]
            ns = sorted({r["n"] for r in sel}, key=int)
            for key in sorted({series(r, ns) for r in sel}):
                pts = sorted(((int(r["N"]), _num(r[metric]), r) for r in sel
                              if series(r, ns) == key), key=lambda p: p[:2])
                line, = ax.plot(xs := [p[0] for p in pts], [p[1] for p in pts], marker="o",
                                label=", ".join(key))
                if metric == "median_s":  # p20-p80 band (the median where a bound is missing)
                    ax.fill_between(xs, [_num(p[2]["p20_s"]) or p[1] for p in pts],
                                    [_num(p[2]["p80_s"]) or p[1] for p in pts], alpha=0.2,
                                    color=line.get_color())
            ax.set_xscale("log", base=2), ax.set_yscale("log")
            ax.set_title(f"{kind} (n = {(','.join(ns) or '?') if kind == 'mq' else 'N'}), {dtype}")
            ax.set_xlabel("queue size M" if kind == "mq" else "keys N"), ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend() if sel else None  # (no memory figures: --no-memory rows)
        device = devices[0] if len(devices) == 1 else f"{len(devices)} devices"
        fig.suptitle(f"NAC loss, D={','.join(Ds)}, {device}, torch {rows[-1]['torch']}")
        written.append(os.path.join(out, f"{stem}_{fname}.png"))
        fig.tight_layout(), fig.savefig(written[-1], dpi=110), plt.close(fig)
    print("\n".join(written))


if __name__ == "__main__":
    main()
