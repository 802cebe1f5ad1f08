"""scripts/reproduce_fmnist.py (the small-scale reproduction, issues 6 and 16) end to end at toy
size: it trains and evaluates every variant over seeds, makes the random-init baseline, records
one line per run, evaluates the curve's steps, writes the page, skips finished runs when run
again, and rejects bad flags before any work."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "reproduce_fmnist.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import reproduce_fmnist as R  # noqa: E402

TOY = ["--seeds", "0", "--nproc", "1", "--batch-size", "32", "--limit-train", "256", "--limit-test", "128",
       "--linear-epochs", "1", "--bn-batches", "2", "--log-every", "1"]


def _fmnist_available():
    from nac_fast.data import build_eval_loader
    try:
        build_eval_loader("fashion-mnist", split="test", batch_size=8)
        return True
    except Exception:
        return False


@pytest.mark.slow
def test_dry_run_commands(tmp_path):
    dry = str(tmp_path / "dry")
    out = subprocess.run([sys.executable, SCRIPT, "--grid", "main", "--dry-run", "--seeds", "0,1",
                          "--out", dry], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout
    train_cmds = [ln for ln in out.splitlines() if ln.startswith("$") and "train.py" in ln]
    # nac and nac-mq with both recipes and with learnable gains, simclr, and random's 1-step
    # template, for 2 seeds
    assert len(train_cmds) == 2 * 8
    assert all("--nproc_per_node=2" in c for c in train_cmds)
    paper = [c for c in train_cmds if "--config configs/fashion_mnist_paper.toml" in c]
    learning = [c for c in train_cmds if "--config configs/fashion_mnist_learning.toml" in c]
    assert len(paper) == 2 * 4 and len(learning) == 2 * 4
    assert sum(c.endswith(" --learn-gain") for c in learning) == 2 * 2
    assert sum("--seed 1 " in c for c in train_cmds) == 8
    assert out.count("nac_fast.eval") == 2 * 8
    abl = subprocess.run([sys.executable, SCRIPT, "--grid", "ablation", "--dry-run", "--only",
                          "nac:full,nac:paper+copy", "--seeds", "0", "--out", dry],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert "--head-bn --a-gain 3 --infer-bn --r-gain auto --infer-init copy" in abl
    assert "--infer-init copy --r-gain auto" in abl and abl.count("train.py") == 2
    assert not os.path.exists(dry)  # a dry run writes nothing


def _plan(out):
    """The dry run's summary lines {grid: (runs, total hours)}."""
    plan = {}
    for ln in out.splitlines():
        parts = ln.split()
        if len(parts) > 2 and parts[0] in ("main", "ablation", "psweep", "all") and \
                parts[2] == "runs":
            plan[parts[0]] = (int(parts[1]), float(parts[-2] if parts[0] != "all" else parts[4]))
    return plan


@pytest.mark.slow
def test_dry_run_plans_the_whole_grid_with_its_cost(tmp_path):
    out_dir = tmp_path / "repro"
    argv = [sys.executable, SCRIPT, "--grid", "all", "--dry-run", "--out", str(out_dir)]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    plan = _plan(out)
    # 3 seeds (the default); main 8 variants; ablation 23 of which 7 are main's runs (nac:paper,
    # nac:full = nac:learning, nac-mq:paper, nac-mq:full = nac-mq:learning, simclr,
    # nac:full+learngain = nac:learning+learngain and its NAC-MQ twin); psweep 8 of which the two
    # p = 0.1 are main's nac:learning+learngain and nac:learning: trained once, counted once
    assert plan["main"][0] == 3 * 8 and plan["ablation"][0] == 3 * 16 and plan["psweep"][0] == 3 * 6
    assert plan["all"][0] == 3 * 30
    assert out.count("(reused)") == 3 * 9
    for g in ("ablation", "psweep"):  # SimCLR, every ablation ingredient, every p are planned
        assert g in out
    for v in ("ablation simclr", "nac-mq:full-copy", "nac:full:p0.05", "nac:full:p0.2",
              "nac:full:p0.4", "nac:paper+headbn", "nac:paper+inferbn", "nac:paper+copy"):
        assert v in out
    # the estimate is the cost model's sum over the planned runs
    args = R.build_parser().parse_args(["--grid", "all", "--out", str(out_dir)])
    per_grid, seeds, curve, _ = R.check_args(args)
    want = 0.0
    for g, variants in per_grid.items():
        for name, (method, flags, recipe) in variants.items():
            if g == "main" or (g == "ablation" and name not in (
                    "nac:paper", "nac:full", "nac-mq:paper", "nac-mq:full", "simclr",
                    "nac:full+learngain", "nac-mq:full+learngain")) or (
                    g == "psweep" and name not in ("nac:full:p0.1", "nac:learngain:p0.1")):
                want += len(seeds) * sum(R.estimate_seconds(args, method, []))
    assert plan["all"][1] == pytest.approx(want / 3600, abs=0.051)
    assert 2 < plan["all"][1] < 12  # hours: 90 runs of 3 epochs + the full evaluation, 2 idle cores
    # resumable: a finished run is not planned again (nor its duplicates in the later grids)
    (out_dir / "main").mkdir(parents=True)
    sig = R.signature(args, "simclr", [], "paper", 0)
    row = {"grid": "main", "variant": "simclr", "seed": 0, "budget": R.budget_tag(args),
           "signature": sig}
    (out_dir / "main" / "results.jsonl").write_text(json.dumps(row) + "\n")
    out2 = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    plan2 = _plan(out2)
    assert plan2["main"][0] == 3 * 8 - 1 and plan2["all"][0] == 3 * 30 - 1
    assert "== main simclr seed 0: done" in out2
    assert "== ablation simclr seed 0: the same run as main simclr (reused)" in out2
    # a shorter budget is another run: nothing done, a smaller estimate
    out3 = subprocess.run(argv + ["--max-steps", "50", "--linear-epochs", "10", "--seeds", "0"],
                          capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert _plan(out3)["all"][0] == 30 and _plan(out3)["all"][1] < plan["all"][1] / 3


def test_estimates_come_from_the_finished_runs_at_the_same_batch(tmp_path, capsys):
    """A run's estimate is the median wall time per step of the finished runs under --out with
    the same processes, batch and architecture, scaled to its steps: those of its method and
    flags where there are any, else its family's (NAC-MQ apart); reused rows, rows with a curve
    and other batches do not count; with none, the cost model."""
    args = R.build_parser().parse_args(["--grid", "budgets", "--out", str(tmp_path),
                                        "--max-steps", "1000", "--batch-size", "64"])
    assert R.measured_seconds(args, "nac") is None
    tail = "2 proc, batch 64, resnet-tiny"

    def row(method, steps, s_train, s_total, **kw):
        return dict(dict(variant=method, seed=0, method=method, step=steps,
                         budget=f"{steps} steps, {tail}",
                         seconds_train=s_train, seconds_total=s_total, curve=[]), **kw)
    rows = {"budgets": [row("nac", 100, 20.0, 30.0), row("simclr", 400, 120.0, 135.0),
                        row("nac", 200, 50.0, 60.0),
                        row("nac", 100, 900.0, 950.0, reused_from="main/x"),
                        row("nac", 100, 900.0, 950.0, curve=[{"step": 50}]),
                        row("nac", 100, 900.0, 950.0, budget="100 steps, 2 proc, batch 256, "
                            "resnet-tiny"),
                        row("nac-mq", 100, 40.0, 50.0)],
            "pschedule": [row("nac", 100, 30.0, 42.0)]}
    for g, rs in rows.items():
        (tmp_path / g).mkdir()
        (tmp_path / g / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    # nac's own runs (no flags): per step 0.2, 0.25, 0.3 -> 0.25; evaluation 10, 10, 12 -> 10
    assert R.measured_seconds(args, "nac") == pytest.approx((0.25, 10.0, 3))
    assert R.measured_seconds(args, "simclr") == pytest.approx((0.3, 15.0, 1))
    assert R.measured_seconds(args, "nac-mq") == pytest.approx((0.4, 10.0, 1))
    # a run with flags of its own: the runs with the same flags, where there are any
    slow = row("nac", 100, 100.0, 112.0, flags=["--channel-likelihood", "multilinear"])
    with open(tmp_path / "budgets" / "results.jsonl", "a") as f:
        f.write(json.dumps(slow) + "\n")
    assert R.measured_seconds(args, "nac", ["--channel-likelihood", "multilinear"]) == \
        pytest.approx((1.0, 12.0, 1))
    # no run with these flags: the family's (every NAC run, SimCLR's too: not NAC-MQ)
    assert R.measured_seconds(args, "nac", ["--flip-prob", "0.3"])[2] == 5
    assert R.measured_seconds(args, "nac")[2] == 3
    args.batch_size = 128
    assert R.measured_seconds(args, "nac") is None
    # the dry run prints the measured estimate: 1000 steps x 0.25 s + 10 s = 4.3 min
    assert R.main(["--grid", "budgets", "--only", "nac:default", "--seeds", "5", "--out",
                   str(tmp_path), "--max-steps", "1000", "--batch-size", "64", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "estimated 4 min, as 3 finished runs under --out took)" in out, out


@pytest.mark.parametrize("argv,match", [
    (["--grid", "main", "--only", "nac:moco"], "are not variants of grid main"),
    (["--grid", "main", "--seeds", "x"], "comma-separated integers"),
    (["--grid", "main", "--epochs", "0"], "--epochs must be >= 1"),
    (["--grid", "main", "--curve-steps", "5,3"], "increasing steps"),
    (["--grid", "main", "--curve-limit", "100"], "TRAIN,TEST"),
    ([], "give --grid"),
])
def test_bad_flags(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        R.main(argv + ["--dry-run"])
    assert e.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.slow
def test_toy_grid_end_to_end(tmp_path):
    if not _fmnist_available():
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    out, doc = tmp_path / "repro", tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    notes = tmp_path / "notes.md"
    notes.write_text("## Reading\n\nhand-written line\n")
    argv = TOY + ["--out", str(out), "--grid", "main", "--only", "nac:learning,random",
                  "--max-steps", "2", "--curve-steps", "1", "--curve-limit", "128,64"]
    assert R.main(argv) == 0
    rows = [json.loads(x) for x in (out / "main" / "results.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["nac:learning", "random"]
    nac, rnd = rows
    assert nac["step"] == 2 and rnd["step"] == 0
    assert [p["step"] for p in nac["curve"]] == [1, 2]
    assert 0.0 <= nac["map"]["128"] <= 1.0 and set(nac["map"]) == {"16", "32", "64", "128"}
    assert {"code_mag", "r_slope", "loss_excess"} <= set(nac["last"])
    # eval-mode BN: 2 steps leave the running variance near its initial 1, so the held-out codes
    # are smaller than the training batch's (~0.2); real runs converge within ~50 steps
    assert 0 < nac["heldout_code_mag"] < nac["last"]["code_mag"]
    assert not nac["collapse_warning"]
    assert not list((out / "main").rglob("features_*.pt"))  # caches removed once read
    # a second call finds both runs done: no training, no evaluation; then the page
    mtime = os.path.getmtime(out / "main" / "nac_learning" / "seed0" / "last.pt")
    assert R.main(argv + ["--doc", str(doc), "--notes", str(notes)]) == 0
    assert os.path.getmtime(out / "main" / "nac_learning" / "seed0" / "last.pt") == mtime
    # the ablation's nac:full trains what main's nac:learning trained: its line is copied, no run
    abl = TOY + ["--out", str(out), "--grid", "ablation", "--only", "nac:full", "--max-steps", "2"]
    assert R.main(abl) == 0
    (row,) = [json.loads(x) for x in (out / "ablation" / "results.jsonl").read_text().splitlines()]
    assert row["reused_from"] == "main/nac:learning" and row["variant"] == "nac:full"
    assert row["map"] == nac["map"] and row["grid"] == "ablation"
    assert not (out / "ablation" / "nac_full").exists()
    page = doc.read_text()
    assert "| nac:learning | learning heads | 1 |" in page and "| random | untrained encoder |" in page
    assert "hand-written line" in page and (doc.parent / "curves.png").stat().st_size > 1000
    summary = json.loads((doc.parent / "results_summary.json").read_text())
    assert [r["variant"] for r in summary["main"]] == ["nac:learning", "random"]


def test_default_runs_and_their_epochs_are_marked():
    """results_summary.json's "default" / "epochs": a run is a default run when train.py, given
    only the grid's data, budget, encoder, seed and method, trains the same thing today."""
    def row(method, extra, budget=("--epochs", "2")):
        cmd = (f"python -m torch.distributed.run --standalone --nproc_per_node=2 train.py "
               f"{extra} --data synthetic:512 --arch resnet-tiny --method {method} "
               f"--batch-size 64 --seed 1 --out /x/seed1 --no-progress --log-every 10 "
               f"--save-every 1000000 {' '.join(budget)}")
        return {"method": method, "commands": [cmd, "python -m nac_fast.eval --checkpoint c"]}
    paper = "--config configs/fashion_mnist_paper.toml"
    # 512 images at batch 64: 8 steps an epoch; the small recipe trains at least 400 steps
    assert R.default_and_epochs(row("nac", "")) == (True, 50.0)
    assert R.default_and_epochs(row("nac", "--flip-prob 0.1")) == (False, 50.0)
    assert R.default_and_epochs(row("nac", paper)) == (False, 2.0)
    # SimCLR has no channel and its own head: over the paper's recipe it trains its default,
    # but only where the small recipe's 400-step floor does not lengthen the default run
    assert R.default_and_epochs(row("simclr", paper, ("--max-steps", "120"))) == (True, 15.0)
    assert R.default_and_epochs(row("simclr", paper)) == (False, 2.0)
    # NAC-MQ's lambda counts for NAC-MQ only: 0 on small data, the paper's 0.1 in its recipe
    assert R.default_and_epochs(row("nac-mq", "")) == (True, 50.0)
    assert R.default_and_epochs(row("nac-mq", "--l2 0.1")) == (False, 50.0)
    assert R.default_and_epochs(row("nac", "--l2 0.1")) == (True, 50.0)
    assert R.default_and_epochs({"method": "random", "commands": ["python x.py"]}) == (False, None)


def test_a_default_run_of_an_earlier_default_is_not_marked_default():
    """A command without --config means the default of its day: the row's recorded signature
    (what it trained; a key recorded before it existed has its built-in value), not its command
    parsed today, decides whether it trained today's default.  The p schedule counts only
    where it applies (runs that see at least flip_prob_final_min_images images and, where set,
    last flip_prob_final_min_steps steps)."""
    from nac_fast.train.config import parse

    def row(epochs, **change):
        cmd = ("python -m torch.distributed.run --standalone --nproc_per_node=2 train.py "
               "--data synthetic:512 --arch resnet-tiny --method nac --batch-size 64 --seed 1 "
               f"--out /x/seed1 --no-progress --log-every 10 --save-every 1000000 "
               f"--epochs {epochs}")
        cfg = {k: v for k, v in sorted(vars(parse(cmd.split("train.py ")[1].split())).items())
               if k not in R.NOT_TRAINING}
        cfg = {k: v for k, v in dict(cfg, **change).items() if v != "drop"}
        return {"method": "nac", "recipe": "default", "commands": [cmd],
                "signature": json.dumps(["b", cfg], sort_keys=True, default=str)}
    # 512 images at batch 64: 8 steps an epoch; 880 epochs = 7040 steps = 450,560 images seen
    # >= the recipe's 450,000
    assert R.default_and_epochs(row(880)) == (True, 880.0)
    assert R.default_and_epochs(row(880, flip_prob_final=None)) == (False, 880.0)  # no ramp
    assert R.default_and_epochs(row(880, flip_prob_final="drop",                   # before the
                                    flip_prob_final_min_steps="drop",              # keys
                                    flip_prob_final_min_images="drop")) == (False, 880.0)
    assert R.default_and_epochs(row(880, flip_prob_final_min_images="drop")) == (True, 880.0)
    assert R.default_and_epochs(row(880, flip_prob=0.3)) == (False, 880.0)
    # 260 epochs = 2080 steps but 133,120 images: the default of commit ff36b25 (a 2,000-step
    # threshold, no image threshold) ramped there, today's keeps p constant
    assert R.default_and_epochs(row(260, flip_prob_final_min_steps=2000,
                                    flip_prob_final_min_images="drop")) == (False, 260.0)
    assert R.default_and_epochs(row(260)) == (True, 260.0)
    # 2 epochs = the recipe's 400-step floor, 25,600 images: the schedule does not apply, so a
    # run of the earlier default (constant p = 0.25, keys not recorded) trained today's default
    assert R.default_and_epochs(row(2, flip_prob_final="drop", flip_prob_final_min_steps="drop",
                                    flip_prob_final_min_images="drop")) == (True, 50.0)
    # the page names such a run for what it is: the default of its commit, not today's
    earlier = dict(row(880, flip_prob_final=None), commit="abc1234", flags=[])
    assert not R.trains_as_today(earlier)
    assert "of commit abc1234 (today's differs)" in R.describe(earlier)
    assert R.trains_as_today(row(880)) and R.trains_as_today(row(2, flip_prob_final="drop"))
    assert R.describe(dict(row(880), commit="abc1234", flags=[])) == "default recipe"
    # a variant relabelled after its run (its command lacks the flags): its flags say what it
    # trained, so it is described by them, not as an earlier default
    relabelled = dict(earlier, flags=["--flip-prob-final", "none"])
    assert R.trains_as_today(relabelled)
    assert R.describe(relabelled) == "default recipe + `--flip-prob-final none`"


def test_a_finished_checkpoint_of_another_recipe_is_trained_again(tmp_path):
    """trained_already (an interrupted grid continues with the evaluation) accepts a finished
    last.pt only when it trained what the grid plans: same budget, method, seed, batch and
    every value train.py does not resolve at the start, so an earlier default's checkpoint in
    the run's folder is not evaluated as today's default."""
    import torch
    args = R.build_parser().parse_args(["--grid", "budgets", "--epochs", "2",
                                        "--batch-size", "64"])
    planned = R.signature(args, "nac", [], "default", 0)
    cfg = dict(json.loads(planned)[1], total_steps=400, lr=0.6, amp="off", queue_size=None,
               world_size=2, overwrite=True, run_id="x")  # resolved and per-launch values
    torch.save({"model": {}, "step": 400, "config": cfg}, tmp_path / "last.pt")
    assert R.trained_already(args, str(tmp_path), "nac", 0, planned)
    assert not R.trained_already(args, str(tmp_path), "nac", 1, planned)        # another seed
    other = R.signature(args, "nac", ["--flip-prob-final", "none"], "default", 0)
    assert not R.trained_already(args, str(tmp_path), "nac", 0, other)         # another recipe
    torch.save({"model": {}, "step": 399, "config": cfg}, tmp_path / "last.pt")
    assert not R.trained_already(args, str(tmp_path), "nac", 0, planned)       # not finished


def test_heldout_section_lists_every_grid_of_its_root(tmp_path):
    """--heldout ROOT: the page's section for ROOT has the rows of each grid run there (the
    defaults of budgets and pschedule's parts of the p schedule), and results_summary.json
    marks only the default runs (7040 steps x batch 64 = 450,560 images seen: the default's p
    rises there, so the constant-p variant is not the default); a root with no rows is
    refused."""
    def row(grid, variant, method, flags, seed, m128):
        extra = "--config configs/fashion_mnist_paper.toml " if method == "simclr" else ""
        cmd = (f"python -m torch.distributed.run --standalone --nproc_per_node=2 train.py "
               f"{extra}--data synthetic:512 --arch resnet-tiny --method {method} "
               f"--batch-size 64 --seed {seed} --out /x/seed{seed} --no-progress --log-every 10 "
               f"--save-every 1000000 --max-steps 7040 {' '.join(flags)}").strip()
        return {"grid": grid, "variant": variant, "method": method,
                "recipe": "paper" if method == "simclr" else "default", "flags": flags,
                "seed": seed, "budget": "7040 steps, 2 proc, batch 64, resnet-tiny",
                "map": {"16": 0.3, "32": 0.4, "64": 0.5, "128": m128}, "linear_top1": 0.9,
                "knn_top1": 0.8, "commands": [cmd], "seconds_total": 60.0}

    def write(root, grid, rows):
        (root / grid).mkdir(parents=True)
        (root / grid / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main_root, held = tmp_path / "repro", tmp_path / "held"
    write(main_root, "budgets", [row("budgets", "simclr", "simclr", [], 0, 0.5)])
    write(held, "budgets", [row("budgets", "nac:default", "nac", [], s, 0.6) for s in (0, 1)])
    write(held, "pschedule", [row("pschedule", "nac:p-constant", "nac",
                                  ["--flip-prob-final", "none"], s, 0.55) for s in (0, 1)])
    doc = tmp_path / "docs" / "results.md"
    doc.parent.mkdir()
    assert R.main(["--out", str(main_root), "--doc", str(doc), "--heldout", str(held)]) == 0
    page = doc.read_text()
    section = page[page.index("## Held-out data: synthetic:512"):]
    assert "(the grids budgets, pschedule)" in section
    assert "| nac:default | default recipe | 2 | 60.0 ± 0.0 |" in section
    assert "| nac:p-constant | default recipe + `--flip-prob-final none` | 2 | 55.0 ± 0.0 |" in \
        section
    summary = json.loads((doc.parent / "results_summary.json").read_text())
    (key,) = [k for k in summary if k.startswith("heldout:")]
    assert [(r["variant"], r["default"]) for r in summary[key]] == \
        [("nac:default", True)] * 2 + [("nac:p-constant", False)] * 2
    # Fashion-MNIST at another batch is not held-out data: its section and key say so
    fm = tmp_path / "fmb64"
    # (run from elsewhere into this checkout: the page shows the path as typed from here)
    write(fm, "budgets", [dict(row("budgets", "nac:default", "nac", [], 0, 0.6), commands=[
        row("budgets", "nac:default", "nac", [], 0, 0.6)["commands"][0].replace(
            "synthetic:512", "fashion-mnist").replace(
            "/x/seed0", os.path.join(os.getcwd(), "runs", "fm", "seed0"))])])
    assert R.main(["--out", str(main_root), "--doc", str(doc), "--heldout",
                   f"{held},{fm}"]) == 0
    page = doc.read_text()
    assert "## Held-out data: fashion-mnist" not in page
    assert "## Fashion-MNIST at another budget (7040 steps" in page
    assert "Not held-out data" in page
    assert "--out runs/fm/seedS " in page and os.getcwd() + os.sep not in page
    summary = json.loads((doc.parent / "results_summary.json").read_text())
    assert len([k for k in summary if k.startswith("heldout:")]) == 1
    assert [k for k in summary if k.startswith("extra:fashion-mnist:")]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no results in"):
        R.main(["--out", str(main_root), "--doc", str(doc), "--heldout", str(empty)])


def test_seeds_named_twice_are_run_once_and_out_of_range_refused(tmp_path):
    """--seeds 0,0 planned every run twice, both launched into the same folder; a seed train.py
    refuses (--seed in [0, 2^32 - 1]) failed every run at its start instead of the script at
    its own."""
    args = R.build_parser().parse_args(["--grid", "main", "--out", str(tmp_path),
                                        "--seeds", "1,0,1", "--curve-seeds", "2,2"])
    _, seeds, _, curve_seeds = R.check_args(args)
    assert seeds == [1, 0] and curve_seeds == [2]
    for flag in ("--seeds", "--curve-seeds"):
        args = R.build_parser().parse_args(["--grid", "main", "--out", str(tmp_path),
                                            flag, "0,-1"])
        with pytest.raises(ValueError, match=f"{flag} must lie in"):
            R.check_args(args)


@pytest.mark.parametrize("code_dim, want", [(128, (16, 32, 64, 128)), (64, (16, 32, 64)),
                                            (48, (16, 32, 48)), (8, (8,)), (None, R.BITS)])
def test_a_variant_with_fewer_code_bits_is_scored_at_the_lengths_it_has(tmp_path, code_dim, want):
    """A grid variant with --code-dim 64 trained, then its evaluation stopped at a usage error
    (--bits 128 of a 64-bit code): the evaluation takes BITS cut to D, D itself included; before
    training (no config.json: the dry run) it plans the default lengths."""
    ckpt = tmp_path / "last.pt"
    if code_dim is not None:
        (tmp_path / "config.json").write_text(json.dumps({"code_dim": code_dim}))
    assert R.eval_bits(str(ckpt)) == want
    cmd = R.eval_cmd(R.build_parser().parse_args(["--grid", "budgets"]), str(ckpt),
                     str(tmp_path / "eval"), 0)
    assert cmd[cmd.index("--bits") + 1] == ",".join(map(str, want))
