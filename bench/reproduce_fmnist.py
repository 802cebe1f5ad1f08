"""Small-scale reproduction of the paper's tables on Fashion-MNIST (issue 6), on CPU.

    python bench/reproduce_fmnist.py                        # everything, ~50 min on 2 cores
    python bench/reproduce_fmnist.py --doc docs/results.md  # ... and write the results page
    python bench/reproduce_fmnist.py --dry-run              # print the commands only
    python bench/reproduce_fmnist.py --doc docs/results.md --notes docs/results_notes.md

Trains, with the same encoder (resnet-tiny), epochs, batch, augmentations and seed:
  nac      in-batch NAC, p = 0.1 (the paper's linear-evaluation setting)
  nac-mq   NAC with the momentum queue, p = 0.1
  simclr   NT-Xent baseline, tau = 0.5
  random   no training: the initialised encoder, its BatchNorm statistics set from training images
and a flip-probability sweep of in-batch NAC over p in {0.05, 0.1, 0.2, 0.3, 0.4} (the paper's
figure on p; the p = 0.1 run is shared with the main table).  Each trained model is evaluated with
`python -m nac_fast.eval` (linear probe, hash mAP@all at 16/32/64/128 bits, kNN, expressivity) on
the full Fashion-MNIST splits: gallery = the 60k training images, queries = the 10k test images.

Every step is a subprocess with the exact command recorded in OUT/summary.json; a step whose
output exists (OUT/<run>/last.pt with the planned step count, OUT/<run>/eval/report.json) is
skipped, so an interrupted reproduction continues where it stopped.  Writes OUT/summary.json,
OUT/results.md and OUT/p_sweep.png; --doc PATH also writes the markdown there (with the plot
and summary.json, as results_summary.json, beside it).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, when imported

from bench_loss import commit  # noqa: E402  (the bench scripts' one git-commit helper)

MAIN = ("nac", "nac-mq", "simclr", "random")
BITS = (16, 32, 64, 128)


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = ap.add_argument
    a("--out", default="runs/repro", help="output directory")
    a("--data", default="fashion-mnist", help="training/evaluation data (see train.py --data)")
    a("--arch", default="resnet-tiny", help="encoder for every method")
    a("--epochs", type=int, default=3, help="training epochs of every method")
    a("--max-steps", type=int, default=None, help="optimizer steps instead of --epochs (tests)")
    a("--batch-size", type=int, default=256, help="global batch (images)")
    a("--nproc", type=int, default=2, help="training processes (torchrun) per run")
    a("--seed", type=int, default=0, help="training and evaluation seed")
    a("--p", type=float, default=0.1, help="flip probability of the main-table NAC runs")
    a("--p-sweep", default="0.05,0.1,0.2,0.3,0.4", help="flip probabilities of the NAC sweep "
      "('' for none)")
    a("--methods", default=",".join(MAIN), help="subset of " + ",".join(MAIN))
    a("--linear-epochs", type=int, default=100, help="linear-probe epochs (paper: 100)")
    a("--limit-train", type=int, default=None, help="evaluation train images (tests)")
    a("--limit-test", type=int, default=None, help="evaluation test images (tests)")
    a("--bn-batches", type=int, default=50, help="training batches that set the random-init "
      "encoder's BatchNorm statistics")
    a("--doc", default=None, help="also write the results page here (e.g. docs/results.md)")
    a("--notes", default=None, help="a markdown file appended to the page (hand-written "
      "reading of the figures)")
    a("--dry-run", action="store_true", help="print the commands, run nothing")
    return ap


def parse_floats(s: str, flag: str) -> list[float]:
    try:
        vals = [float(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated numbers, got {s!r}") from None
    for v in vals:
        if not 0.0 < v < 0.5:
            raise ValueError(f"{flag}: every p must lie in (0, 0.5), got {v}")
    return vals


def check_args(args) -> tuple[list[str], list[float]]:
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in MAIN]
    if bad or not methods:
        raise ValueError(f"--methods must be a non-empty subset of {','.join(MAIN)}, got "
                         f"{args.methods!r}")
    sweep = parse_floats(args.p_sweep, "--p-sweep")
    parse_floats(str(args.p), "--p")
    for flag in ("epochs", "batch_size", "nproc", "linear_epochs", "bn_batches"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("max_steps", "limit_train", "limit_test"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if "random" in methods and not ({"nac", "nac-mq", "simclr"} & set(methods)) and not sweep:
        raise ValueError("--methods random needs a trained run beside it (it copies that run's "
                         "configuration)")
    return methods, sweep


def plan(args, methods, sweep) -> list[dict]:
    """The runs: name, method, p.  The sweep's p == --p run is the main-table NAC run."""
    runs = []
    tag = lambda p: f"{p:g}".replace(".", "")  # noqa: E731  0.05 -> 005
    for m in methods:
        if m == "random":
            continue
        p = args.p
        runs.append({"name": f"{m}_p{tag(p)}" if m != "simclr" else "simclr", "method": m,
                     "p": p if m != "simclr" else None})
    for p in sweep:
        name = f"nac_p{tag(p)}"
        if not any(r["name"] == name for r in runs):
            runs.append({"name": name, "method": "nac", "p": p})
    if "random" in methods:
        runs.append({"name": "random", "method": "random", "p": None})
    return runs


def train_cmd(args, run) -> list[str]:
    out = os.path.join(args.out, run["name"])
    flags = ["train.py", "--data", args.data, "--arch", args.arch, "--method", run["method"],
             "--batch-size", str(args.batch_size), "--seed", str(args.seed), "--out", out,
             "--no-progress", "--log-every", "20"]
    flags += ["--max-steps", str(args.max_steps)] if args.max_steps else ["--epochs",
                                                                         str(args.epochs)]
    if run["p"] is not None:
        flags += ["--flip-prob", f"{run['p']:g}"]  # torchrun would take "--p" for its own flag
    if args.nproc == 1:
        return [sys.executable] + flags
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.nproc}"] + flags


def eval_cmd(args, run) -> list[str]:
    d = os.path.join(args.out, run["name"])
    cmd = [sys.executable, "-m", "nac_fast.eval", "--checkpoint", os.path.join(d, "last.pt"),
           "--data", args.data, "--out", os.path.join(d, "eval"), "--no-progress",
           "--bits", ",".join(map(str, BITS)), "--linear-epochs", str(args.linear_epochs),
           "--seed", str(args.seed)]
    if args.limit_train:
        cmd += ["--limit-train", str(args.limit_train)]
    if args.limit_test:
        cmd += ["--limit-test", str(args.limit_test)]
    return cmd


def random_init_checkpoint(args, template_ckpt: str, out_dir: str) -> dict:
    """A checkpoint of the *initialised* model (seed --seed) with the configuration of a trained
    run, its BatchNorm running statistics averaged over --bn-batches training batches (train-mode
    forward passes, no gradient, no weight change): eval-mode BN with the init statistics (mean 0,
    var 1) would scale the features arbitrarily and make the baseline weaker than it is."""
    import torch
    from nac_fast.train.checkpoint import load_checkpoint, save_atomic
    from nac_fast.data import build_eval_loader
    from nac_fast.train.models import build_model, model_kwargs_from_config

    cfg = dict(load_checkpoint(template_ckpt)["config"])
    cfg.update(method="random-init", epochs=0, max_steps=0, total_steps=0, out=out_dir)
    torch.manual_seed(args.seed)
    model = build_model(**dict(model_kwargs_from_config(cfg), inference_net=True))
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the calibration batches
    model.train()
    loader = build_eval_loader(args.data, split="train", batch_size=args.batch_size,
                               image_size=cfg["image_size"])
    with torch.no_grad():
        for i, (x, _) in enumerate(loader):
            if i == args.bn_batches:
                break
            model.encode(x)
    path = os.path.join(out_dir, "last.pt")
    save_atomic({"model": model.state_dict(), "momentum_model": None, "step": 0, "epoch": 0,
                 "config": cfg}, path)
    return cfg


def show(cmd) -> str:
    return " ".join("python" if c == sys.executable else shlex.quote(c) for c in cmd)


def run_cmd(cmd, log_path, dry) -> float:
    print("$ " + show(cmd), flush=True)
    if dry:
        return 0.0
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"command failed (exit {rc}), log {log_path}:\n{tail}")
    return time.perf_counter() - t0


def planned_steps_done(ckpt: str, args) -> bool:
    if not os.path.isfile(ckpt):
        return False
    from nac_fast.train.checkpoint import load_checkpoint
    ck = load_checkpoint(ckpt)
    return ck.get("step") == ck["config"]["total_steps"] and (
        args.max_steps is None or ck["config"]["total_steps"] == args.max_steps) and (
        args.max_steps is not None or ck["config"]["epochs"] == args.epochs)


def collect(args, runs) -> dict:
    rows = {}
    for run in runs:
        rep = os.path.join(args.out, run["name"], "eval", "report.json")
        with open(rep) as f:
            r = json.load(f)
        res = r["results"]
        log = os.path.join(args.out, run["name"], "log.jsonl")
        losses = []
        if os.path.isfile(log):
            with open(log) as f:
                losses = [json.loads(line)["loss"] for line in f if line.strip()]
        rows[run["name"]] = {
            "method": run["method"], "p": run["p"], "step": r["step"],
            "linear_top1": res["linear"]["test_top1"], "linear_lr": res["linear"]["best_lr"],
            "knn_top1": res["knn"]["test_top1"],
            "map": {int(b): v for b, v in res["hash"]["map"].items()},
            "distinct": {int(b): s["fraction_distinct"]
                         for b, s in res["expressivity"]["stats"].items()},
            "hamming": {int(b): s["normalized_mean_pairwise_hamming"]
                        for b, s in res["expressivity"]["stats"].items()},
            "balance_dev": {int(b): s["balance_mean_abs_deviation"]
                            for b, s in res["expressivity"]["stats"].items()},
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        }
    return rows


def pct(v):
    return f"{100 * v:.1f}"


def markdown(args, runs, rows, cmds, timings, meta) -> str:
    L = ["# Small-scale reproduction on Fashion-MNIST", "",
         f"Generated by `{meta['command']}` on {meta['date']} ({meta['host']}, {meta['cpus']} CPUs, "
         f"torch {meta['torch']}, commit {meta['commit']}); {meta['total_min']:.1f} min in all.",
         "", f"Every method: encoder `{args.arch}`, global batch {args.batch_size}, "
         + (f"{args.max_steps} steps" if args.max_steps else f"{args.epochs} epochs")
         + f", {args.nproc} processes, seed {args.seed}, the same augmentations (train.py's "
         "Fashion-MNIST recipe). Evaluation: `python -m nac_fast.eval` on the full splits "
         "(gallery = training images, queries = test images, relevant = same class, Hamming "
         "ranking with ties by gallery index); k-bit figures are the first k bits of the "
         "128-bit code.", "",
         "## Main table", "",
         "| method | p | linear top-1 % | kNN top-1 % | mAP@all 16 b | 32 b | 64 b | 128 b | "
         "distinct codes (128 b) % | mean Hamming / D | loss first -> last |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    main_names = [r["name"] for r in runs if r["method"] != "nac" or r["p"] == args.p]
    for name in main_names:
        if name not in rows:
            continue
        x = rows[name]
        loss = (f"{x['loss_first']:.3f} -> {x['loss_last']:.3f}"
                if x["loss_first"] is not None else "-")
        L.append(f"| {x['method']} | {x['p'] if x['p'] is not None else '-'} | "
                 f"{pct(x['linear_top1'])} | {pct(x['knn_top1'])} | "
                 + " | ".join(pct(x["map"][b]) for b in BITS)
                 + f" | {pct(x['distinct'][128])} | {x['hamming'][128]:.3f} | {loss} |")
    sweep = sorted((x["p"], n) for n, x in rows.items() if x["method"] == "nac")
    if len(sweep) > 1:
        L += ["", "## Flip probability p (in-batch NAC)", "", "![p sweep](p_sweep.png)", "",
              "| p | linear top-1 % | kNN top-1 % | mAP 16 b | 32 b | 64 b | 128 b | "
              "distinct codes (128 b) % | loss first -> last |", "|---|---|---|---|---|---|---|---|---|"]
        for p, n in sweep:
            x = rows[n]
            L.append(f"| {p:g} | {pct(x['linear_top1'])} | {pct(x['knn_top1'])} | "
                     + " | ".join(pct(x["map"][b]) for b in BITS)
                     + f" | {pct(x['distinct'][128])} | {x['loss_first']:.3f} -> "
                       f"{x['loss_last']:.3f} |")
    L += ["", "## Commands", "", "Each run, in the order run (`python` is the environment's interpreter; "
          "wall time of the run and its evaluation after each):", "",
          "```text"]
    for name, cs in cmds.items():
        for c in cs:
            L.append(c)
        L.append(f"# {name}: {timings.get(name, 0) / 60:.1f} min")
    L += ["```", ""]
    return "\n".join(L)


def plot(rows, path) -> bool:
    sweep = sorted((x["p"], x) for x in rows.values() if x["method"] == "nac")
    if len(sweep) < 2:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ps = [p for p, _ in sweep]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for b in BITS:
        axes[0].plot(ps, [100 * x["map"][b] for _, x in sweep], "o-", label=f"{b} bits")
    axes[0].set(xlabel="flip probability p", ylabel="mAP@all (%)", title="hash retrieval")
    axes[0].legend()
    axes[1].plot(ps, [100 * x["linear_top1"] for _, x in sweep], "o-", label="linear probe")
    axes[1].plot(ps, [100 * x["knn_top1"] for _, x in sweep], "s-", label="kNN (k=200)")
    axes[1].set(xlabel="flip probability p", ylabel="test top-1 (%)", title="classification")
    axes[1].legend()
    axes[2].plot(ps, [100 * x["distinct"][128] for _, x in sweep], "o-", label="distinct codes")
    axes[2].plot(ps, [100 * x["hamming"][128] for _, x in sweep], "s-",
                 label="mean Hamming / D")
    axes[2].set(xlabel="flip probability p", ylabel="% (128-bit codes, test set)",
                title="expressivity")
    axes[2].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("In-batch NAC on Fashion-MNIST, by channel flip probability")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        methods, sweep = check_args(args)
        if args.notes is not None and not os.path.isfile(args.notes):
            raise ValueError(f"--notes {args.notes!r}: no such file")
    except ValueError as exc:
        ap.error(str(exc))
    runs = plan(args, methods, sweep)
    os.makedirs(args.out, exist_ok=True)
    cmds, timings, commits = {}, {}, set()
    trained = [r for r in runs if r["method"] != "random"]
    for run in runs:
        d = os.path.join(args.out, run["name"])
        os.makedirs(d, exist_ok=True)
        ck = os.path.join(d, "last.pt")
        t0 = time.perf_counter()
        ran = False
        if run["method"] == "random":
            cmds[run["name"]] = [f"# random init: bench/reproduce_fmnist.py builds the model (seed {args.seed}) "
                                 f"and sets BN statistics from {args.bn_batches} batches"]
            if not args.dry_run and not os.path.isfile(ck):
                random_init_checkpoint(args, os.path.join(args.out, trained[0]["name"], "last.pt"),
                                       d)
                ran = True
        else:
            tc = train_cmd(args, run)
            cmds[run["name"]] = [show(tc)]
            if args.dry_run or not planned_steps_done(ck, args):
                if os.path.isfile(ck) and not args.dry_run:
                    os.remove(ck)  # a different plan: start over
                run_cmd(tc, os.path.join(d, "train.txt"), args.dry_run)
                ran = True
        ec = eval_cmd(args, run)
        cmds[run["name"]].append(show(ec))
        if args.dry_run or not os.path.isfile(os.path.join(d, "eval", "report.json")):
            run_cmd(ec, os.path.join(d, "eval.txt"), args.dry_run)
            ran = True
        tfile = os.path.join(d, "seconds.json")
        if not args.dry_run:
            if ran or not os.path.isfile(tfile):
                with open(tfile, "w") as f:  # kept, so a later call that skips it still reports it
                    json.dump({"seconds": time.perf_counter() - t0, "commit": commit()}, f)
            with open(tfile) as f:
                rec = json.load(f)
            timings[run["name"]] = rec["seconds"]
            commits.add(rec.get("commit", "unknown"))
    if args.dry_run:
        return 0

    import torch
    rows = collect(args, runs)
    run_commits = ", ".join(sorted(commits))  # of the runs (a later call may only collect)
    meta = {"command": "python bench/reproduce_fmnist.py " + " ".join(
                shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
            "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "commit": run_commits,
            "total_min": sum(timings.values()) / 60}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"meta": meta, "args": vars(args), "runs": rows, "commands": cmds,
                   "seconds": timings}, f, indent=1)
    md = markdown(args, runs, rows, cmds, timings, meta)
    if args.notes:
        with open(args.notes) as f:
            md += "\n" + f.read()
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    have_plot = plot(rows, os.path.join(args.out, "p_sweep.png"))
    if args.doc:
        os.makedirs(os.path.dirname(os.path.abspath(args.doc)), exist_ok=True)
        with open(args.doc, "w") as f:
            f.write(md)
        ddir = os.path.dirname(os.path.abspath(args.doc))
        shutil.copy(os.path.join(args.out, "summary.json"),
                    os.path.join(ddir, "results_summary.json"))  # the figures, machine-readable
        if have_plot:
            shutil.copy(os.path.join(args.out, "p_sweep.png"), os.path.join(ddir, "p_sweep.png"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
