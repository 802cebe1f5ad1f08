"""The paper's VAE experiment (Table 5) on Fashion-MNIST, on CPU, over seeds, resumable.

    python scripts/reproduce_vae.py --runs /work/vae_runs --doc docs/results_vae.md
    python scripts/reproduce_vae.py --runs /work/vae_runs --dry-run     # the plan, nothing run
    python scripts/reproduce_vae.py --runs /work/vae_runs --doc-only --doc docs/results_vae.md

Variants (VAE seed S uses the encoder pretrained with seed S):
  random           the VAE from scratch (random encoder, every part at lr 5e-4)
  simclr           encoder pretrained by SimCLR (paper heads recipe), fine-tuned at 5e-5
  nac_default      encoder pretrained by NAC with the default recipe (configs/small.toml)
  nac_paper        encoder pretrained by NAC with the paper's heads
                   (configs/fashion_mnist_paper.toml)
  *_frozen         the same encoders kept fixed (--freeze): only the linear posterior layer and
                   the decoder train (random_frozen: a fixed random encoder, the control)
Pretraining: train.py, 2 processes, batch 256, 2 epochs, resnet-tiny: the budget of
docs/results.md's main table.  VAE: python -m nac_fast.vae, --epochs (default 1) at batch 128,
IWAE with K = --iwae-k on --iwae-images evenly strided test images, ELBO / KL on all 10k.

Every run writes into --runs (pre/<variant>/seedS, vae/<variant>/seedS); a run whose report
exists is skipped, an interrupted one resumes (nac_fast.vae --resume; a pretraining run that is
not finished is started again from scratch, as its folder is train.py's); a run folder that a
running process names as its --out (an earlier invocation's run) is waited for, not started
twice.  Up to
--jobs VAE runs go at once (one CPU thread each) beside one pretraining run.  One JSON line per
finished command goes to --runs/vae/results.jsonl (command, wall time, exit status).

--doc PATH writes the markdown section (tables of mean +- sample std over seeds, the paper's
figures beside them, paired differences to random init, every command, and statements of
where the results agree with the paper), generated from the reports alone.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable

# variant -> (pretraining kind or None, freeze)
VARIANTS = {
    "random": (None, False),
    "simclr": ("simclr", False),
    "nac_default": ("nac_default", False),
    "nac_paper": ("nac_paper", False),
    "simclr_frozen": ("simclr", True),
    "nac_default_frozen": ("nac_default", True),
    "nac_paper_frozen": ("nac_paper", True),
    "random_frozen": (None, True),
}
PRETRAIN = {  # kind -> train.py flags (beside the common ones)
    "simclr": ["--method", "simclr", "--config", "configs/fashion_mnist_paper.toml"],
    "nac_default": ["--method", "nac"],
    "nac_paper": ["--method", "nac", "--config", "configs/fashion_mnist_paper.toml"],
}
PRETRAIN_COMMON = ["--data", "fashion-mnist", "--arch", "resnet-tiny", "--batch-size", "256",
                   "--epochs", "2", "--no-progress", "--log-every", "10",
                   "--save-every", "1000000"]
# The paper's Table 5 (CIFAR-10, ResNet-18, 100 epochs): IWAE log-likelihood, KL (nats/image).
PAPER = {"random": (-3202, 33.0), "simclr": (-3174, 38.9), "moco-v2": (-3103, 32.2),
         "nac": (-2865, 71.8)}
PAPER_ROW = {"random": "random", "simclr": "simclr", "nac_default": "nac", "nac_paper": "nac"}
LABEL = {
    "random": "random init",
    "simclr": "SimCLR + finetune",
    "nac_default": "NAC (default recipe) + finetune",
    "nac_paper": "NAC (paper heads) + finetune",
    "simclr_frozen": "SimCLR, frozen",
    "nac_default_frozen": "NAC (default recipe), frozen",
    "nac_paper_frozen": "NAC (paper heads), frozen",
    "random_frozen": "random init, frozen",
}


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = ap.add_argument
    a("--runs", required=True, help="root folder of the runs (outside the repository)")
    a("--seeds", default="0,1,2")
    a("--variants", default=",".join(VARIANTS), help="comma-separated subset of "
      + ",".join(VARIANTS))
    a("--epochs", type=int, default=1, help="VAE epochs (batch 128)")
    a("--limit-train", type=int, default=30000, help="VAE training images (evenly strided; 0: "
      "all 60k)")
    a("--limit-test", type=int, default=5000, help="test images of the ELBO / KL (evenly "
      "strided; 0: all 10k)")
    a("--iwae-k", type=int, default=1000)
    a("--iwae-images", type=int, default=32, help="test images of the IWAE bound (evenly "
      "strided, a subset of the --limit-test ones)")
    a("--jobs", type=int, default=2, help="VAE runs at once (one thread each)")
    a("--nice", type=int, default=10)
    a("--doc", default=None, help="write the markdown section here")
    a("--figure", default=None, help="with --doc: write a PNG of every variant's "
      "reconstructions (first seed) here and show it in the section")
    a("--curves", default=None, help="with --doc: write a PNG of every run's training ELBO and "
      "KL against the step here and show it in the section")
    a("--notes", default=None, help="with --doc: a markdown file appended to the section "
      "(hand-written readings)")
    a("--doc-only", action="store_true", help="only write --doc from the reports")
    a("--dry-run", action="store_true", help="print the commands, run nothing")
    return ap


def _ints(s):
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--seeds: expected comma-separated integers, got {s!r}")
    if not v:
        raise SystemExit("--seeds: expected at least one seed")
    return v


def pre_dir(args, kind, seed):
    return os.path.join(args.runs, "pre", kind, f"seed{seed}")


def vae_dir(args, variant, seed):
    return os.path.join(args.runs, "vae", variant, f"seed{seed}")


def pretrain_cmd(args, kind, seed):
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"] \
        + PRETRAIN[kind] + PRETRAIN_COMMON + ["--seed", str(seed), "--out",
                                              pre_dir(args, kind, seed)]


def vae_cmd(args, variant, seed):
    kind, freeze = VARIANTS[variant]
    init = "random" if kind is None else os.path.join(pre_dir(args, kind, seed), "last.pt")
    cmd = [PY, "-m", "nac_fast.vae", "--data", "fashion-mnist", "--init", init,
           "--epochs", str(args.epochs), "--iwae-k", str(args.iwae_k),
           "--iwae-images", str(args.iwae_images), "--seed", str(seed), "--threads", "1",
           "--out", vae_dir(args, variant, seed), "--no-progress"]
    for flag, v in (("--limit-train", args.limit_train), ("--limit-test", args.limit_test)):
        if v:
            cmd += [flag, str(v)]
    return cmd + (["--freeze"] if freeze else [])


def pretrain_finished(args, kind, seed) -> bool:
    d = pre_dir(args, kind, seed)
    try:
        with open(os.path.join(d, "config.json")) as f:
            total = json.load(f)["total_steps"]
        last = None
        with open(os.path.join(d, "log.jsonl")) as f:
            for line in f:
                rec = json.loads(line)
                if "step" in rec:
                    last = rec["step"]
    except (OSError, ValueError, KeyError):
        return False
    return last == total and os.path.isfile(os.path.join(d, "last.pt"))


def busy(out_dir: str) -> bool:
    """A process (of an earlier invocation of this script, or started by hand) is running with
    `--out out_dir` on its command line (Linux /proc; elsewhere: never busy)."""
    needle = ["--out", out_dir]
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return False
    for pid in pids:
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        for i in range(len(argv) - 1):
            if argv[i:i + 2] == needle:
                return True
    return False


def vae_finished(args, variant, seed) -> bool:
    return os.path.isfile(os.path.join(vae_dir(args, variant, seed), "report.json"))


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def show(cmd) -> str:
    out = " ".join(shlex.quote(c) for c in cmd)
    return out.replace(PY, "python")


def record(args, rec):
    path = os.path.join(args.runs, "vae", "results.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def run_all(args, variants, seeds) -> int:
    pre_tasks = [(k, s) for s in seeds for k in PRETRAIN
                 if any(VARIANTS[v][0] == k for v in variants)]
    vae_tasks = [(v, s) for v in variants if not v.endswith("_frozen") for s in seeds]
    vae_tasks = sorted(vae_tasks, key=lambda t: (t[1], variants.index(t[0])))
    vae_tasks += sorted([(v, s) for v in variants if v.endswith("_frozen") for s in seeds],
                        key=lambda t: (t[1], variants.index(t[0])))
    pre_todo = [t for t in pre_tasks if not pretrain_finished(args, *t)]
    vae_todo = [t for t in vae_tasks if not vae_finished(args, *t)]
    if args.dry_run:
        for t in pre_todo:
            print(show(pretrain_cmd(args, *t)))
        for t in vae_todo:
            print(show(vae_cmd(args, *t) + ["--resume"]))
        return 0
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    running = {}  # Popen -> (kind, task, cmd, t0, logfile)
    failed = []

    def launch(kind, task, cmd, log_path):
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        f = open(log_path, "a")
        print(f"[{time.strftime('%H:%M:%S')}] start {kind} {task}: {show(cmd)}", flush=True)
        p = subprocess.Popen(["nice", "-n", str(args.nice)] + cmd, cwd=ROOT, env=env, stdout=f,
                             stderr=subprocess.STDOUT)
        running[p] = (kind, task, cmd, time.time(), f)

    while pre_todo or vae_todo or running:
        for p in [p for p in running if p.poll() is not None]:
            kind, task, cmd, t0, f = running.pop(p)
            f.close()
            wall = time.time() - t0
            print(f"[{time.strftime('%H:%M:%S')}] done {kind} {task} rc={p.returncode} "
                  f"({wall / 60:.1f} min)", flush=True)
            record(args, {"kind": kind, "task": list(task), "cmd": show(cmd), "rc": p.returncode,
                          "wall_s": round(wall, 1), "host": platform.node(),
                          "loadavg": os.getloadavg(), "end": time.strftime("%Y-%m-%d %H:%M:%S")})
            if p.returncode != 0:
                failed.append((kind, task))
        busy_pre = (any(v[0] == "pre" for v in running.values())
                    or any(busy(pre_dir(args, *t)) for t in pre_todo))  # one at a time
        if not busy_pre:
            for t in list(pre_todo):
                if pretrain_finished(args, *t):
                    pre_todo.remove(t)
                    continue
                if busy(pre_dir(args, *t)):
                    continue  # another process is training it: wait
                pre_todo.remove(t)
                if ("pre", t) in failed:
                    continue
                launch("pre", t, pretrain_cmd(args, *t),
                       pre_dir(args, *t) + ".log")
                break
        for t in [t for t in vae_todo if vae_finished(args, *t)]:
            vae_todo.remove(t)  # finished by another process
        elsewhere = [t for t in vae_todo if busy(vae_dir(args, *t))]
        n_vae = sum(v[0] == "vae" for v in running.values()) + len(elsewhere)
        for t in list(vae_todo):
            if n_vae >= args.jobs:
                break
            if t in elsewhere:
                continue
            kind = VARIANTS[t[0]][0]
            if kind is not None and not pretrain_finished(args, kind, t[1]):
                if ("pre", (kind, t[1])) in failed:
                    vae_todo.remove(t)
                    failed.append(("vae", t))
                continue
            vae_todo.remove(t)
            launch("vae", t, vae_cmd(args, *t) + ["--resume"], vae_dir(args, *t) + ".log")
            n_vae += 1
        time.sleep(5 if running else 30)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------
# The markdown section
# --------------------------------------------------------------------------------------------

def mean_std(vals):
    n = len(vals)
    if n == 0:
        return None, None
    m = sum(vals) / n
    s = math.sqrt(sum((v - m) ** 2 for v in vals) / (n - 1)) if n > 1 else None
    return m, s


def fmt(vals, digits=1):
    m, s = mean_std(vals)
    if m is None:
        return "-"
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if s is not None else "")


def load(args, variants, seeds):
    out = {}
    for v in variants:
        for s in seeds:
            d = vae_dir(args, v, s)
            try:
                with open(os.path.join(d, "report.json")) as f:
                    rep = json.load(f)
                with open(os.path.join(d, "eval.json")) as f:
                    ev = json.load(f)
            except (OSError, ValueError):
                continue
            out[(v, s)] = (rep, ev)
    return out


def write_figure(args, variants, seed, path) -> list:
    """One PNG: the first block (8 test images over their reconstructions) of every variant's
    reconstructions.png for one seed, stacked, each labelled; returns the labels shown."""
    from PIL import Image, ImageDraw
    blocks, names = [], []
    for v in variants:
        p = os.path.join(vae_dir(args, v, seed), "reconstructions.png")
        if not os.path.isfile(p):
            continue
        with Image.open(p) as im:
            im = im.convert("L")
            # the grid: pad 2, tiles (28 + 2) px, scaled x2 (nac_fast/vae/images.py grid)
            h = min(im.height, 2 * (2 + 2 * 30))
            blocks.append(im.crop((0, 0, im.width, h)))
        names.append(LABEL[v])
    if not blocks:
        return []
    label_w, line = 200, 14
    W = label_w + max(b.width for b in blocks)
    H = sum(b.height + line for b in blocks)
    out = Image.new("L", (W, H), 255)
    draw = ImageDraw.Draw(out)
    y = 0
    for b, n in zip(blocks, names):
        draw.text((4, y + b.height // 2 - 6), n, fill=0)
        out.paste(b, (label_w, y))
        y += b.height + line
    tmp = path + ".tmp.png"
    out.save(tmp)
    os.replace(tmp, path)
    return names


def write_curves(args, variants, seeds, path) -> bool:
    """Training ELBO and KL (log.jsonl windows) against the step, one line per run, one colour
    per variant (fine-tuned solid, frozen dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    colours = {}
    drawn = False
    for v in variants:
        base = v[:-len("_frozen")] if v.endswith("_frozen") else v
        c = colours.setdefault(base, f"C{len(colours)}")
        for i, s in enumerate(seeds):
            p = os.path.join(vae_dir(args, v, s), "log.jsonl")
            if not os.path.isfile(p):
                continue
            recs = []
            with open(p) as f:
                for line in f:
                    try:
                        r = json.loads(line)
                    except ValueError:
                        continue
                    if "elbo" in r and "step" in r:
                        recs.append(r)
            if not recs:
                continue
            st = [r["step"] for r in recs]
            ls = "--" if v.endswith("_frozen") else "-"
            label = LABEL[v] if i == 0 else None
            axes[0].plot(st, [r["elbo"] for r in recs], ls, color=c, lw=1, label=label)
            axes[1].plot(st, [r["kl"] for r in recs], ls, color=c, lw=1, label=label)
            drawn = True
    if not drawn:
        plt.close(fig)
        return False
    axes[0].set_ylabel("training ELBO (nats / image, window mean)")
    axes[1].set_ylabel("training KL (nats / image)")
    for ax in axes:
        ax.set_xlabel("step (batch 128)")
        ax.grid(alpha=0.3)
    axes[0].set_ylim(bottom=max(axes[0].get_ylim()[0], -3000))
    axes[1].legend(fontsize=7)
    fig.suptitle(f"VAE training, every run (seeds {','.join(map(str, seeds))})")
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def write_doc(args, variants, seeds) -> int:
    res = load(args, variants, seeds)
    if not res:
        print("no finished VAE runs to report", file=sys.stderr)
        return 1
    some = next(iter(res.values()))
    iw_k, iw_n = some[0]["test"]["iwae_k"], some[1]["details"]["iwae_images"]
    n_test, pixels = some[1]["details"]["test_images"], some[1]["details"]["pixels"]
    n_split = some[1]["details"].get("test_split_images", n_test)
    steps = some[1]["details"]["train_steps"]
    L = []
    L.append("## VAE with a pretrained encoder (the paper's Table 5)")
    L.append("")
    fig = f" --figure {os.path.relpath(args.figure, ROOT)}" if args.figure else ""
    fig += f" --curves {os.path.relpath(args.curves, ROOT)}" if args.curves else ""
    fig += f" --notes {os.path.relpath(args.notes, ROOT)}" if args.notes else ""
    L.append(f"Generated by `python scripts/reproduce_vae.py --runs RUNS --doc "
             f"{os.path.relpath(args.doc, ROOT)}{fig}` on {time.strftime('%Y-%m-%d')} "
             f"({platform.node()}, {os.cpu_count()} CPUs shared with other jobs; commit "
             f"{commit()}).")
    L.append("")
    L.append(f"Every VAE: `python -m nac_fast.vae` (nac_fast/vae/): resnet-tiny encoder, one "
             f"linear layer to a 32-d diagonal Gaussian posterior, a decoder mirroring the encoder "
             f"with transposed convolutions, a discretised Gaussian over the 256 values of each "
             f"pixel (a proper distribution of the 8-bit data, docs/math.md [M:vae-dgauss]), "
             f"N(0, I) prior; Adam (0.9, 0.999, 1e-8, no weight decay), batch 128, lr 5e-4, a "
             f"pretrained encoder fine-tuned at 5e-5 (the paper's appendix); {args.epochs} epoch"
             f"{'s' if args.epochs > 1 else ''} over {some[1]['details'].get('train_images')} "
             f"evenly strided training images = {steps} steps (the paper: 100 epochs of "
             f"CIFAR-10). The encoders were pretrained "
             f"with the budget of the main table above (train.py, 2 processes, batch 256, 2 "
             f"epochs); VAE seed S starts from the encoder of pretraining seed S. "
             f"Test figures in nats per image (log-likelihood of the 8-bit image, {pixels} "
             f"pixels; bits/dim = -LL / ({pixels} ln 2)): **IWAE** = the importance-weighted "
             f"bound with K = {iw_k} [M:vae-iwae] on a fixed subset of {iw_n} test images (1 in "
             f"{n_test // iw_n} of the {n_test} below), the same images for every run; "
             f"**ELBO**, **KL** (analytic, [M:vae-kl]) and **recon** = E_q log p(x|z), one "
             f"sample per image, on {n_test} test images (1 in {n_split // n_test} of the "
             f"{n_split}). "
             f"Mean ± sample std over seeds {','.join(map(str, seeds))}.")
    L.append("")
    L.append("| encoder | seeds | IWAE LL (K=%d, %d img) | KL | ELBO | recon | bits/dim (IWAE) | "
             "IWAE - ELBO (same %d img) | paper (CIFAR-10): LL / KL |" % (iw_k, iw_n, iw_n))
    L.append("|---|---|---|---|---|---|---|---|---|")
    stats = {}
    for v in variants:
        rows = [res[(v, s)] for s in seeds if (v, s) in res]
        if not rows:
            continue
        iw = [r[0]["test"]["iwae"] for r in rows]
        kl = [r[0]["test"]["kl"] for r in rows]
        el = [r[0]["test"]["elbo"] for r in rows]
        rc = [r[0]["test"]["recon"] for r in rows]
        bpd = [r[1]["details"]["bits_per_dim"]["iwae"] for r in rows]
        gap = [r[1]["details"]["iwae_minus_elbo_subset"] for r in rows]
        stats[v] = {"iwae": iw, "kl": kl, "elbo": el}
        pk = PAPER_ROW.get(v)
        paper = f"{PAPER[pk][0]} / {PAPER[pk][1]}" if pk else "-"
        L.append(f"| {LABEL[v]} | {len(rows)} | {fmt(iw)} | {fmt(kl)} | {fmt(el)} | {fmt(rc)} | "
                 f"{fmt(bpd, 3)} | {fmt(gap)} | {paper} |")
    L.append("| *paper only: MoCo-v2 + finetune* | | | | | | | | %d / %.1f |" % PAPER["moco-v2"])
    L.append("")
    L.append(f"IWAE - ELBO: the K = {iw_k} bound minus the {iw_k}-sample Monte Carlo ELBO on the "
             "same images and samples (>= 0 per image); a large gap means the encoder's q(z|x) "
             "is far from the true posterior (the amortisation gap that the paper argues a "
             "pretrained encoder narrows).")
    if args.figure:
        shown = write_figure(args, variants, seeds[0], args.figure)
        if shown:
            rel = os.path.relpath(args.figure, os.path.dirname(os.path.abspath(args.doc)))
            L.append("")
            L.append(f"![reconstructions, seed {seeds[0]}]({rel})")
            L.append("")
            L.append(f"Seed {seeds[0]}: 8 test images (top row of each block) and their "
                     "reconstructions (the decoder's mean at z = the posterior mean) for "
                     + ", ".join(shown) + f"; every run's `reconstructions.png` and "
                     "`samples.png` (64 prior samples) are in its folder.")
    if args.curves and write_curves(args, variants, seeds, args.curves):
        rel = os.path.relpath(args.curves, os.path.dirname(os.path.abspath(args.doc)))
        L.append("")
        L.append(f"![training ELBO and KL against the step]({rel})")
    L.append("")
    # paired differences to random init (same seed index)
    L.append("Paired differences to random init (same seed; mean ± std over seeds; positive = "
             "higher than random init; the paper's difference beside):")
    L.append("")
    L.append("| encoder | Δ IWAE LL | Δ KL | Δ ELBO | paper Δ LL / Δ KL |")
    L.append("|---|---|---|---|---|")
    for v in variants:
        if v in ("random",) or v not in stats:
            continue
        base = "random_frozen" if v.endswith("_frozen") and "random_frozen" in stats else "random"
        if base == v or base not in stats:
            continue
        pairs = [s for s in seeds if (v, s) in res and (base, s) in res]
        if not pairs:
            continue
        d = {m: [res[(v, s)][0]["test"][m] - res[(base, s)][0]["test"][m] for s in pairs]
             for m in ("iwae", "kl", "elbo")}
        pk = PAPER_ROW.get(v)
        paper = (f"{PAPER[pk][0] - PAPER['random'][0]:+d} / "
                 f"{PAPER[pk][1] - PAPER['random'][1]:+.1f}"
                 if pk else "-")
        vs = "" if base == "random" else " (vs random init, frozen)"
        L.append(f"| {LABEL[v]}{vs} | {fmt(d['iwae'])} | {fmt(d['kl'])} | {fmt(d['elbo'])} | "
                 f"{paper} |")
    L.append("")
    L.append("### Where it agrees with the paper and where not")
    L.append("")
    L += statements(args, res, stats, seeds)
    L.append("")
    if args.notes:
        with open(args.notes) as f:
            L.append(f.read().rstrip("\n"))
        L.append("")
    L.append("### Commands")
    L.append("")
    L.append("`python` is the environment's interpreter; S is the seed (0, 1, 2); the script adds "
             "`--resume` to every VAE command (a no-op for a fresh folder) and runs each with "
             "`nice -n 10`, `OMP_NUM_THREADS=1`.")
    L.append("")
    L.append("```text")
    shown = set()
    for kind in PRETRAIN:
        if any(VARIANTS[v][0] == kind for v in variants):
            L.append(show(pretrain_cmd(argparse.Namespace(**dict(vars(args), runs="RUNS")),
                                       kind, "S")))
    for v in variants:
        c = show(vae_cmd(argparse.Namespace(**dict(vars(args), runs="RUNS")), v, "S"))
        if c not in shown:
            shown.add(c)
            L.append(c)
    L.append("```")
    L.append("")
    # wall time from each run's own eval.json (a run resumed over several processes: the last)
    by = {}
    for (v, _), (_, ev) in res.items():
        kind = "frozen" if v.endswith("_frozen") else "fine-tuned"
        by.setdefault(kind, []).append(ev["details"].get("seconds_total", 0.0) / 60)
    if by:
        loads = [ev["details"]["loadavg"][0] for _, ev in res.values()]
        L.append("Wall time of one VAE run (training + evaluation, one CPU thread, the machine "
                 f"shared with other jobs: 1-min load average {min(loads):.0f}-{max(loads):.0f} "
                 "at the end of the runs): " + "; ".join(
                     f"{k} {min(w):.0f}-{max(w):.0f} min" for k, w in sorted(by.items())) + ".")
        L.append("")
    text = "\n".join(L)
    tmp = args.doc + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, args.doc)
    print(text)
    return 0


def _t_within(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer df >= 1, exactly (Abramowitz & Stegun 26.7.3,
    26.7.4: a finite series in cos(theta), theta = atan(t / sqrt(df)))."""
    th = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(th) ** 2
    if df % 2:  # odd: (2 / pi) (theta + sin cos (1 + 2/3 cos^2 + 2 4 / (3 5) cos^4 + ...))
        term = total = 1.0 if df > 1 else 0.0
        for j in range(3, df - 1, 2):
            term *= (j - 1) / j * c2
            total += term
        return 2.0 / math.pi * (th + math.sin(th) * math.cos(th) * total)
    term = total = 1.0  # even: sin (1 + 1/2 cos^2 + 1 3 / (2 4) cos^4 + ...)
    for j in range(2, df - 1, 2):
        term *= (j - 1) / j * c2
        total += term
    return math.sin(th) * total


def _sig(d):
    """(mean, significant): the paired differences' mean and whether a two-sided paired t-test
    over the seeds rejects a zero mean at 5% (any number of seeds: the exact t distribution)."""
    m, s = mean_std(d)
    if m is None or len(d) < 2:
        return m, False
    if not s:
        return m, m != 0
    t = m / (s / math.sqrt(len(d)))
    return m, 1.0 - _t_within(t, len(d) - 1) < 0.05


def paired(res, a, b, metric, seeds):
    """[metric(a, s) - metric(b, s)] over the seeds both variants finished."""
    return [res[(a, s)][0]["test"][metric] - res[(b, s)][0]["test"][metric]
            for s in seeds if (a, s) in res and (b, s) in res]


def _compare(d, more="higher", less="lower", paper_sign=+1, ref="the paper") -> str:
    """How a set of paired differences compares with the paper's direction (ref: what sets the
    direction), in words (paired t-test over the seeds at 5%; n.s. = not significant)."""
    m, sig = _sig(d)
    if m is None:
        return "no paired runs"
    word = more if m > 0 else less
    if len(d) < 2:
        return f"{word} (one seed, untested)"
    word += f" in {sum((x > 0) == (m > 0) for x in d)}/{len(d)} seeds"
    if m * paper_sign > 0:
        return (f"{word}, as in {ref} (p < 0.05)" if sig else
                f"{word}, the direction of {ref}, n.s.")
    return (f"{word}, opposite to {ref} (p < 0.05)" if sig else
            f"{word}, opposite to the direction of {ref}, n.s.")


WARNING = "warning: the codes are collapsing"
HYP = "the paper's hypothesis (a pretrained encoder narrows the amortisation gap)"


def pretraining_notes(args, seeds) -> list:
    """The pretrained encoders' own state: the final mean |tanh a| of train.py's log and how
    many runs train.py warned of collapsing codes."""
    parts = []
    for kind in PRETRAIN:
        mags, warned, n = [], 0, 0
        for s in seeds:
            d = pre_dir(args, kind, s)
            last = None
            try:
                with open(os.path.join(d, "log.jsonl")) as f:
                    for line in f:
                        last = json.loads(line)
            except (OSError, ValueError):
                continue
            n += 1
            if last and "code_mag" in last:
                mags.append(last["code_mag"])
            for log in (d + ".log", os.path.join(args.runs, "pre", f"{kind}_seed{s}.log")):
                try:
                    with open(log) as f:
                        if WARNING in f.read():
                            warned += 1
                            break
                except OSError:
                    pass
        if n:
            parts.append(f"{kind}: final mean |tanh a| {fmt(mags, 3)}, collapse warning in "
                         f"{warned}/{n} runs")
    if not parts:
        return []
    return ["- The pretrained encoders (train.py's log): " + "; ".join(parts) + " (the main "
            "table above: the paper's heads let the codes shrink towards zero at this budget)."]


def statements(args, res, stats, seeds) -> list:
    """Plain statements computed from the figures (the paper: NAC > MoCo-v2 > SimCLR > random
    in log-likelihood, NAC with by far the largest KL)."""
    out = []
    order = sorted((v for v in stats if not v.endswith("_frozen")),
                   key=lambda v: -mean_std(stats[v]["iwae"])[0])
    out.append("- Paper (CIFAR-10, ResNet-18, 100 epochs): every pretrained encoder beats random "
               "init in log-likelihood, NAC by far (+337 nats vs +28 for SimCLR), and NAC's KL "
               "is twice the others' (71.8 vs 32-39 nats): the posterior carries more "
               "information.")
    out.append("- Significance below: a paired t-test over the seeds (two-sided, 5%); n.s. = "
               "not significant, i.e. the difference is within the seed-to-seed spread.")
    out.append("- Here, fine-tuned, by mean IWAE LL: " + " > ".join(
        f"{LABEL[v]} ({mean_std(stats[v]['iwae'])[0]:.1f})" for v in order) + ".")
    for v in order:
        if v == "random" or "random" not in stats:
            continue
        d, dk, de = (paired(res, v, "random", m, seeds) for m in ("iwae", "kl", "elbo"))
        gap = [res[(v, s)][1]["details"]["iwae_minus_elbo_subset"]
               - res[("random", s)][1]["details"]["iwae_minus_elbo_subset"]
               for s in seeds if (v, s) in res and ("random", s) in res]
        line = (f"- {LABEL[v]} vs random init: IWAE LL {mean_std(d)[0]:+.1f} nats, "
                f"{_compare(d)}; ELBO {mean_std(de)[0]:+.1f}, {_compare(de)}; KL "
                f"{mean_std(dk)[0]:+.1f} nats, {_compare(dk, 'larger', 'smaller')}; IWAE - ELBO "
                f"gap {mean_std(gap)[0]:+.1f} nats, {_compare(gap, 'wider', 'narrower', -1, HYP)}")
        out.append(line + ("" if line.endswith(".") else "."))
    if "simclr" in stats:
        for v in ("nac_default", "nac_paper"):
            if v in stats:
                d = paired(res, v, "simclr", "iwae", seeds)
                dk = paired(res, v, "simclr", "kl", seeds)
                line = (f"- {LABEL[v]} vs SimCLR + finetune (the paper: NAC +309 nats, KL "
                        f"+32.9): IWAE LL {mean_std(d)[0]:+.1f}, {_compare(d)}; KL "
                        f"{mean_std(dk)[0]:+.1f}, {_compare(dk, 'larger', 'smaller')}")
                out.append(line + ("" if line.endswith(".") else "."))
    frozen = [v for v in stats if v.endswith("_frozen")]
    if frozen:
        parts = []
        for v in frozen:
            base = v[:-len("_frozen")]
            if base in stats:
                d = paired(res, v, base, "iwae", seeds)
                parts.append(f"{LABEL[v]}: IWAE LL {mean_std(stats[v]['iwae'])[0]:.1f}, "
                             f"{mean_std(d)[0]:+.1f} vs the same encoder fine-tuned")
        out.append("- Frozen encoders (weights fixed; only the linear posterior layer and the "
                   "decoder train; the paper has no such row): " + "; ".join(parts) + ".")
        if "random_frozen" in stats:
            for v in frozen:
                if v != "random_frozen":
                    d = paired(res, v, "random_frozen", "iwae", seeds)
                    line = (f"- {LABEL[v]} vs random init, frozen (does the pretrained "
                            f"representation alone carry the posterior better than random "
                            f"features?): IWAE LL {mean_std(d)[0]:+.1f}, {_compare(d)}")
                    out.append(line + ("" if line.endswith(".") else "."))
    out += pretraining_notes(args, seeds)
    out.append("- Scale: the paper's figures are CIFAR-10 (3072 sub-pixels, ResNet-18, 100 "
               "epochs) and cannot be compared in absolute value with Fashion-MNIST's (784 "
               "pixels, resnet-tiny, a short budget); only the ordering and the differences "
               "are comparable, and the paper does not state its likelihood's discretisation.")
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # de-duplicated, order kept: a run named twice was launched twice at once into one folder
    seeds = list(dict.fromkeys(_ints(args.seeds)))
    variants = list(dict.fromkeys(v.strip() for v in args.variants.split(",") if v.strip()))
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; choose from {','.join(VARIANTS)}")
    for flag in ("epochs", "iwae_k", "iwae_images", "jobs"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1")
    for flag in ("limit_train", "limit_test"):
        if getattr(args, flag) < 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 0 (0: the whole split)")
    args.runs = os.path.abspath(args.runs)
    if args.notes is not None and not os.path.isfile(args.notes):
        raise SystemExit(f"--notes {args.notes!r}: no such file")
    for flag in ("doc", "figure", "curves"):  # written at the end: checked before any run
        path = getattr(args, flag)
        folder = os.path.dirname(os.path.abspath(path)) if path is not None else None
        if folder is not None and not os.path.isdir(folder):
            raise SystemExit(f"--{flag} {path!r}: no such folder {folder!r}")
    if args.doc_only:
        if not args.doc:
            raise SystemExit("--doc-only needs --doc PATH")
        return write_doc(args, variants, seeds)
    rc = run_all(args, variants, seeds)
    if args.doc and not args.dry_run:
        write_doc(args, variants, seeds)
    return rc


if __name__ == "__main__":
    sys.exit(main())
