"""Turn train.py's JSON-lines log into PNG curves.

    python scripts/plot_train_log.py runs/default/log.jsonl [--out runs/default/curves.png]
    python scripts/plot_train_log.py runs/nac/log.jsonl runs/simclr/log.jsonl --out cmp.png

One panel per logged quantity against the step: first the loss with its zero-code value (D ln 2
for NAC, 2 D ln 2 for NAC-MQ's loss + vi, ln(2B - 1) for SimCLR: the loss of codes that carry
nothing, docs/math.md [M:z0]) as a dashed line, then the statistics docs/training.md says to
judge a run by (loss_excess = loss - that value, code_mag, r_mag, r_slope with the small-code
optimum 2(1 - 2p) dotted, balance_score, distinct_frac, mean_hamming), then lr, img/s and data
wait.  code_sat, the same number as code_mag ([M:code-sat]), is drawn as code_mag when a log
has no code_mag.  Several logs are overlaid, labelled by their directory.  A resumed run's log
repeats the steps after its checkpoint: the last record of each step is plotted (the records of
one step are merged, later values winning, so python -m nac_fast.vae's final {"step", "eval"}
record does not hide that step's training record).  An empty or unreadable log, or one without
any quantity drawn here, is a usage error (exit status 2).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nac_fast._files import atomic_write, check_new_file  # noqa: E402

KEYS = ("loss", "loss_excess", "code_mag", "r_mag", "r_slope", "a_gain", "r_gain", "balance_score",
        "distinct_frac", "mean_hamming", "lr", "flip_prob", "img_per_s", "data_wait")
ZERO_NAME = {"nac": "D ln 2", "nac-mq": "2 D ln 2", "simclr": "ln(2B - 1)"}


def read_log(path: str) -> list[dict]:
    by_step = {}
    with open(path) as f:
        try:
            lines = f.readlines()
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not a text log ({exc.reason} at byte {exc.start})") from None
        for i, line in enumerate(lines, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: not a JSON line ({exc})") from None
            if not isinstance(rec, dict) or "step" not in rec:
                raise ValueError(f"{path}:{i}: record has no 'step'")
            if isinstance(rec["step"], bool) or not isinstance(rec["step"], (int, float)):
                raise ValueError(f"{path}:{i}: 'step' is not a number: {rec['step']!r}")
            if "code_mag" not in rec and "code_sat" in rec:
                rec["code_mag"] = rec["code_sat"]
            by_step.setdefault(rec["step"], {}).update(rec)
    if not by_step:
        raise ValueError(f"{path}: empty log")
    return [by_step[s] for s in sorted(by_step)]


def run_config(log_path: str) -> dict:
    """The config.json beside a log (train.py writes both), or {}."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(log_path)), "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def zero_code_value(recs: list[dict]):
    """The log's zero-code value: loss - loss_excess (the same number at every record), or None
    for a log without loss_excess."""
    vals = [r["loss"] - r["loss_excess"] for r in recs
            if isinstance(r.get("loss"), (int, float)) and isinstance(r.get("loss_excess"),
                                                                      (int, float))]
    return sorted(vals)[len(vals) // 2] if vals else None


def draw(runs):
    """The figure for runs = [(name, records, config)]: one panel per key of KEYS present."""
    import matplotlib.pyplot as plt
    keys = [k for k in KEYS if any(k in r for _, recs, _ in runs for r in recs)]
    cols = 4
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for name, recs, cfg in runs:
            pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
            # a lone point (a log of one record) is a line of no length: drawn as a marker
            line, = ax.plot([s for s, _ in pts], [v for _, v in pts], label=name,
                            marker="o" if len(pts) == 1 else None)
            if key == "loss" and zero_code_value(recs) is not None:
                z = zero_code_value(recs)
                what = ZERO_NAME.get(cfg.get("method"), "zero-code value")
                ax.axhline(z, ls="--", lw=1, color=line.get_color(),
                           label=f"{what} = {z:.2f}" + (f" ({name})" if len(runs) > 1 else ""))
            p = cfg.get("flip_prob", cfg.get("p"))
            sched = [(r["step"], r["flip_prob"]) for r in recs if r.get("flip_prob") is not None]
            if key == "r_slope" and cfg.get("flip_prob_final") is not None and sched:
                # a p schedule ([M:p-schedule]): the small-code optimum moves with p
                ax.plot([s for s, _ in sched], [2 * (1 - 2 * q) for _, q in sched], ls=":",
                        lw=1, color=line.get_color(), label="2(1-2p) at each step's p",
                        marker="_" if len(sched) == 1 else None)
            elif key == "r_slope" and isinstance(p, (int, float)):
                ax.axhline(2 * (1 - 2 * p), ls=":", lw=1, color=line.get_color(),
                           label=f"2(1-2p) = {2 * (1 - 2 * p):.2f}")
        if key == "loss_excess":
            ax.axhline(0.0, ls="--", lw=1, color="gray")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key in ("loss", "r_slope") or (key == keys[0] and len(runs) > 1):
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def run_names(paths: list[str]) -> list[str]:
    """Each log's label: its folder's name, or as many of the folders above it as tell the logs
    apart (runs/a/seed0 and runs/b/seed0: a/seed0 and b/seed0)."""
    parts = [os.path.dirname(p).split(os.sep) for p in paths]
    for depth in range(1, max(map(len, parts)) + 1):
        names = ["/".join(x[-depth:]).lstrip("/") or p for x, p in zip(parts, paths)]
        if len(set(names)) == len(names):
            return names
    return paths


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", help="log.jsonl files")
    ap.add_argument("--out", default=None, help="PNG path (default: curves.png next to the "
                    "first log)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)
    for p in args.logs:
        if not os.path.isfile(p):
            ap.error(f"no such log file: {p}")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.logs[0])), "curves.png")
    try:
        check_new_file("--out", out, args.overwrite)  # (it checks the place is writable too)
        logs = list(dict.fromkeys(os.path.abspath(p) for p in args.logs))  # each drawn once
        runs = [(name, read_log(p), run_config(p)) for name, p in zip(run_names(logs), logs)]
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        ap.error(str(exc))
    if not any(k in r for _, recs, _ in runs for r in recs for k in KEYS):
        ap.error(f"no record of {', '.join(args.logs)} has any of the quantities drawn here "
                 f"({', '.join(KEYS)})")
    import matplotlib
    matplotlib.use("Agg")

    fig = draw(runs)
    try:
        atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=100))
    except OSError as exc:
        ap.error(f"--out {out!r}: {exc.strerror or exc}")
    print(out)
    return fig


if __name__ == "__main__":
    main()
