"""python -m nac_fast.eval on a real (tiny) train.py checkpoint: report contents, feature cache,
prefix-bit mAP, expressivity recomputation, and clear errors for bad arguments.  CPU only.

As a demanding user runs it (an audit; each test failed before its fix): awkward sizes, broken
checkpoints, NaN features, folders that hold another program's files, failures half-way; on a
1-step train.py checkpoint of a tiny JPEG folder (tests/_eval_run.py, a few seconds)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py lives at the repository root
import train  # noqa: E402
from nac_fast.eval import cli as nac_eval  # noqa: E402
from nac_fast import code_statistics, mean_average_precision  # noqa: E402

from _eval_run import edited_checkpoint as _edited_checkpoint  # noqa: E402
from _eval_run import inf_in_encoder as _inf_in_encoder  # noqa: E402
from _eval_run import run  # noqa: E402,F401  (the fixture)
from _eval_run import usage_error as _usage_error  # noqa: E402

D = 32  # a small code so that --bits can name prefixes and an out-of-range value


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    assert train.main(["--max-steps", "2", "--batch-size", "64", "--code-dim", str(D),
                       "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    return str(out / "last.pt")


BASE = ["--data", "fashion-mnist", "--limit-train", "600", "--limit-test", "200",
        "--linear-epochs", "3", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="session")
def evaluated(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    argv = ["--checkpoint", ckpt, "--out", str(out), "--bits", f"8,16,{D}"] + BASE
    assert nac_eval.main(argv) == 0
    with open(out / "report.json") as f:
        return out, json.load(f), argv


def test_report_fields_and_ranges(evaluated, ckpt):
    out, rep, _ = evaluated
    assert rep["checkpoint"] == os.path.abspath(ckpt) and rep["data"] == "fashion-mnist"
    assert rep["splits"] == {"train": {"used": 600, "total": 60000},
                             "test": {"used": 200, "total": 10000}}
    assert rep["config"]["code_dim"] == D and rep["bits"] == [8, 16, D]
    r = rep["results"]
    assert set(r) == {"linear", "hash", "knn", "expressivity"}
    assert 0.0 <= r["linear"]["test_top1"] <= 1.0
    assert r["linear"]["best_lr"] in (0.01, 0.1, 1.0, 10.0)
    # a best rate at an end of the search is flagged (a rate beyond it may fit better)
    assert r["linear"]["best_lr_at_edge"] == {0.01: "smallest", 10.0: "largest"}.get(
        r["linear"]["best_lr"])
    assert 0.0 <= r["knn"]["test_top1"] <= 1.0 and r["knn"]["k"] == 200
    h = r["hash"]
    assert h["protocol"] == "standard" and (h["num_queries"], h["num_gallery"]) == (200, 600)
    assert set(h["map"]) == {"8", "16", str(D)}
    assert all(0.0 <= m <= 1.0 for m in h["map"].values())
    assert "prefix" in h["note"]
    for key in ("features_train_s", "features_test_s", "linear_s", "hash_s"):
        assert 0 < rep["timings"][key] <= rep["timings"]["total_s"], key
    # the total covers the feature extraction and every task, one after the other
    parts = [v for k, v in rep["timings"].items() if k not in ("total_s", "load_model_s")]
    assert len(parts) == 6 and rep["timings"]["total_s"] >= sum(parts)
    md = (out / "report.md").read_text()
    assert "| task | metric | value | details |" in md and "mAP@all" in md


def test_cached_features_match_report(evaluated):
    out, rep, _ = evaluated
    tr = torch.load(out / "features_train.pt", weights_only=False)
    te = torch.load(out / "features_test.pt", weights_only=False)
    assert tr["h"].shape == (600, rep["features"]["train"]["h_dim"])
    assert tr["a"].shape == (600, D) and te["a"].shape == (200, D)
    assert te["labels"].dtype == torch.int64
    # h in 16 bits (half the memory; the probe and kNN upcast a batch at a time), a in float32
    # (its signs are the codes: a float16 -0 would read as a +1 bit), under cache version 3
    assert tr["h"].dtype == te["h"].dtype == torch.float16
    assert tr["a"].dtype == te["a"].dtype == torch.float32
    assert tr["meta"]["version"] == nac_eval.CACHE_VERSION == 3
    # strided subset of Fashion-MNIST test: all 10 classes present
    assert te["labels"].unique().numel() == 10
    qc = torch.where(te["a"] >= 0, 1, -1)
    gc = torch.where(tr["a"] >= 0, 1, -1)
    for k in (8, 16, D):
        # a k-bit figure is exactly the mAP of the first k bits of the D-bit code
        m = mean_average_precision(qc[:, :k].contiguous(), te["labels"],
                                   gc[:, :k].contiguous(), tr["labels"])
        assert rep["results"]["hash"]["map"][str(k)] == pytest.approx(m, abs=1e-12)
        s = code_statistics(te["a"][:, :k]).as_dict()
        got = rep["results"]["expressivity"]["stats"][str(k)]
        assert got["num_distinct"] == s["num_distinct"] and got["num_bits"] == k
        assert got["mean_pairwise_hamming"] == pytest.approx(s["mean_pairwise_hamming"])
        assert 1 <= got["num_distinct"] <= 200
        assert got["fraction_distinct"] == pytest.approx(got["num_distinct"] / 200)
    # kNN: recomputed from the cached encoder features h, written out from the definition
    # (docs/math.md [M:knn]: cosine similarity, k = 200, votes exp(sim / 0.1))
    trn = torch.nn.functional.normalize(tr["h"].float(), dim=1)
    sim = torch.nn.functional.normalize(te["h"].float(), dim=1) @ trn.T
    top, idx = sim.topk(200, dim=1)
    votes = torch.zeros(200, 10, dtype=torch.float64).scatter_add_(
        1, tr["labels"][idx], torch.exp(top.double() / 0.1))
    knn = (votes.argmax(1) == te["labels"]).double().mean().item()
    assert rep["results"]["knn"]["test_top1"] == pytest.approx(knn, abs=1e-12)
    # linear probe: the cached h with the command's epochs and seed give the reported figures
    from nac_fast.eval.metrics import linear_probe
    lp = linear_probe(tr["h"], tr["labels"], te["h"], te["labels"], epochs=3, batch_size=256,
                      seed=0)
    assert rep["results"]["linear"]["test_top1"] == lp.test_accuracy
    assert rep["results"]["linear"]["best_lr"] == lp.best_lr


def test_features_reused_on_second_run(evaluated, ckpt, tmp_path, capsys):
    out, rep1, argv = evaluated
    assert not rep1["features"]["train"]["cached"]
    mtimes = {s: os.stat(out / f"features_{s}.pt").st_mtime_ns for s in ("train", "test")}
    # an --out holding a report is refused before any work: the report stays as it was
    before = (out / "report.json").read_bytes()
    with pytest.raises(SystemExit) as e:
        nac_eval.main(argv + ["--tasks", "knn,hash"])
    assert e.value.code == 2 and (out / "report.json").read_bytes() == before
    err = capsys.readouterr().err
    assert f"--out {str(out)!r} holds the report of an earlier evaluation (checkpoint" in err
    assert "pass --overwrite" in err
    assert nac_eval.main(argv + ["--tasks", "knn,hash", "--overwrite"]) == 0
    rep2 = json.loads((out / "report.json").read_text())
    assert rep2["features"]["train"]["cached"] and rep2["features"]["test"]["cached"]
    assert rep2["timings"]["features_train_s"] == 0.0 and "load_model_s" not in rep2["timings"]
    for s in ("train", "test"):
        assert os.stat(out / f"features_{s}.pt").st_mtime_ns == mtimes[s]
    assert set(rep2["results"]) == {"knn", "hash"}
    assert rep2["results"]["hash"]["map"] == rep1["results"]["hash"]["map"]
    assert rep2["results"]["knn"] == rep1["results"]["knn"]
    # a different limit invalidates the cache (its meta no longer matches)
    other = tmp_path / "o"
    assert nac_eval.main(["--checkpoint", ckpt, "--out", str(other), "--tasks", "expressivity",
                          "--limit-train", "300", "--limit-test", "100", "--no-progress"]) == 0
    (other / "features_test.pt").touch()
    assert nac_eval.main(["--checkpoint", ckpt, "--out", str(other), "--tasks", "expressivity",
                          "--limit-train", "300", "--limit-test", "120", "--no-progress",
                          "--overwrite"]) == 0
    rep3 = json.loads((other / "report.json").read_text())
    assert rep3["features"]["train"]["cached"] and not rep3["features"]["test"]["cached"]
    assert rep3["results"]["expressivity"]["stats"][str(D)]["num_codes"] == 120
    assert rep3["bits"] == [D]  # default: the model's full code only


def test_linear_lrs_widens_the_search_and_the_report_says_so(evaluated, tmp_path, capsys):
    """--linear-lrs: the probe searches the rates given (de-duplicated, in order), the figures
    are linear_probe's on the cached features with that list, and report.json / report.md say
    the search was not the paper's; a best rate at its end is flagged."""
    src, rep1, argv = evaluated
    assert rep1["results"]["linear"]["paper_lrs"] is True
    assert rep1["results"]["linear"]["lrs"] == [0.01, 0.1, 1.0, 10.0]
    out = tmp_path / "e"  # its own report (the shared one is read by other tests)
    out.mkdir()
    for s in ("train", "test"):
        shutil.copy(src / f"features_{s}.pt", out / f"features_{s}.pt")
    argv = argv[:]
    argv[argv.index("--out") + 1] = str(out)
    assert nac_eval.main(argv + ["--tasks", "linear", "--linear-lrs", "100,30,30,0.001"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["features"]["train"]["cached"]  # the same features as the paper-list run
    x = rep["results"]["linear"]
    assert x["lrs"] == [100.0, 30.0, 0.001] and x["paper_lrs"] is False
    assert set(x["val_top1"]) == {"100.0", "30.0", "0.001"}
    tr = torch.load(out / "features_train.pt", weights_only=False)
    te = torch.load(out / "features_test.pt", weights_only=False)
    from nac_fast.eval.metrics import linear_probe
    lp = linear_probe(tr["h"], tr["labels"], te["h"], te["labels"], epochs=3, batch_size=256,
                      seed=0, lrs=(100.0, 30.0, 0.001))
    assert (x["test_top1"], x["best_lr"]) == (lp.test_accuracy, lp.best_lr)
    edge = {0.001: "smallest", 100.0: "largest"}.get(lp.best_lr)
    assert x["best_lr_at_edge"] == edge
    err = capsys.readouterr().err
    assert (("(--linear-lrs): a rate beyond it" in err) == (edge is not None)), err
    md = (out / "report.md").read_text()
    assert "searched 100/30/0.001 (not the paper's)" in md
    # one rate: no search, so no end of it to flag
    assert nac_eval.main(argv + ["--tasks", "linear", "--linear-lrs", "0.5", "--overwrite"]) == 0
    x = json.loads((out / "report.json").read_text())["results"]["linear"]
    assert x["best_lr"] == 0.5 and x["best_lr_at_edge"] is None
    assert "a rate beyond it" not in capsys.readouterr().err


def test_paper_protocol(ckpt, tmp_path, capsys):
    assert nac_eval.main(["--checkpoint", ckpt, "--out", str(tmp_path), "--tasks", "hash",
                          "--hash-protocol", "paper", "--queries-per-class", "10",
                          "--limit-train", "600", "--limit-test", "200", "--no-progress",
                          "--itq"]) == 0
    h = json.loads((tmp_path / "report.json").read_text())["results"]["hash"]
    assert h["protocol"] == "paper" and 0.0 <= h["map_itq"][str(D)] <= 1.0
    assert (h["num_queries"], h["num_gallery"]) == (100, 700)
    assert 0.0 <= h["map"][str(D)] <= 1.0
    # docs/math.md [M:hash-split]: train and test pooled, 10 queries per class (seed 0), the
    # rest the gallery: the mAP of that split of the cached codes
    from nac_fast.eval.metrics import retrieval_split
    tr, te = (torch.load(tmp_path / f"features_{s}.pt", weights_only=False)
              for s in ("train", "test"))
    a = torch.cat([tr["a"], te["a"]])
    y = torch.cat([tr["labels"], te["labels"]])
    sp = retrieval_split(y, queries_per_class=10, train_per_class=None, seed=0)
    c = torch.where(a >= 0, 1, -1)
    m = mean_average_precision(c[sp["query"]], y[sp["query"]], c[sp["gallery"]], y[sp["gallery"]])
    assert h["map"][str(D)] == pytest.approx(m, abs=1e-12)
    # more queries per class than some class has: a usage error naming the flag
    with pytest.raises(SystemExit) as e:
        nac_eval.main(["--checkpoint", ckpt, "--out", str(tmp_path), "--tasks", "hash",
                       "--hash-protocol", "paper", "--queries-per-class", "500",
                       "--limit-train", "600", "--limit-test", "200", "--no-progress",
                       "--overwrite"])
    assert e.value.code == 2
    assert "--queries-per-class 500: too many" in capsys.readouterr().err


@pytest.mark.parametrize("extra, match", [
    (["--tasks", "linear,bogus"], "unknown task"),
    (["--bits", "16,64"], "--bits [16, 64]: the model's codes have D=32 bits"),
    (["--bits", "0,16"], "--bits values must be >= 1"),
    (["--limit-train", "0"], "--limit-train must be >= 1"),
    (["--limit-test", "-5"], "--limit-test must be >= 1"),
    (["--limit-test", "20000"], "--limit-test 20000 exceeds the test split's 10000 images"),
    (["--linear-epochs", "0"], "--linear-epochs must be >= 1"),
    (["--linear-lrs", "0.1,-1"], "--linear-lrs values must be positive numbers, got [-1.0]"),
    (["--linear-lrs", "0.1,nan"], "--linear-lrs values must be positive numbers, got [nan]"),
    (["--linear-lrs", "0.1,fast"], "expected comma-separated numbers, got '0.1,fast'"),
    (["--linear-lrs", ","], "expected at least one number"),
    (["--which", "momentum"], "--which momentum: the checkpoint has no momentum model"),
    (["--data", "/nonexistent/data"], "'/nonexistent/data' is neither"),
    (["--workers", "-1"], "--workers must be >= 0, got -1"),
])
def test_bad_arguments(ckpt, tmp_path, capsys, extra, match):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as e:
        nac_eval.main(["--checkpoint", ckpt, "--out", str(out), "--no-progress"] + extra)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert match in err.split("error:", 1)[1], err  # in the message, not just the usage line
    assert not out.exists()  # the error came before any work


def test_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        nac_eval.main(["--checkpoint", str(tmp_path / "nope.pt"), "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    err = capsys.readouterr().err.split("error:", 1)[1]
    assert "--checkpoint" in err and "no such file" in err
    with pytest.raises(SystemExit):
        nac_eval.main(["--out", str(tmp_path / "o")])  # --checkpoint is required
    assert "--checkpoint" in capsys.readouterr().err.split("error:", 1)[1]


@pytest.mark.slow
def test_help_subprocess():
    p = subprocess.run([sys.executable, "-m", "nac_fast.eval", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for flag in ("--checkpoint", "--tasks", "--bits", "--hash-protocol", "--limit-train"):
        assert flag in p.stdout


def test_itq_is_reported_beside_the_sign_codes(ckpt, evaluated, tmp_path):
    """--itq adds map_itq (docs/math.md [M:itq]) per --bits value, computed from the cached a as
    metrics.itq_fit/itq_codes do, and leaves the sgn(a) mAP as it was."""
    from nac_fast.eval.metrics import itq_codes, itq_fit
    out, rep, argv = evaluated
    assert "map_itq" not in rep["results"]["hash"]  # opt-in
    argv2 = [x if x != str(out) else str(tmp_path) for x in argv] + ["--tasks", "hash", "--itq"]
    assert nac_eval.main(argv2) == 0
    h = json.loads((tmp_path / "report.json").read_text())["results"]["hash"]
    assert h["map"] == rep["results"]["hash"]["map"]
    assert set(h["map_itq"]) == {"8", "16", str(D)}
    tr, te = (torch.load(tmp_path / f"features_{s}.pt", weights_only=False)
              for s in ("train", "test"))
    fit = itq_fit(tr["a"][:, :16], seed=0)
    m = mean_average_precision(itq_codes(te["a"][:, :16], fit), te["labels"],
                               itq_codes(tr["a"][:, :16], fit), tr["labels"])
    assert h["map_itq"]["16"] == pytest.approx(m, abs=1e-12)
    first, last = h["itq_quant_error"]["16"]
    assert last <= first
    assert "ITQ" in (tmp_path / "report.md").read_text()


def _readme_eval_commands():
    import re
    text = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"^## Evaluation\n(.*?)(?=^## )", text, re.S | re.M)
    block = re.search(r"```text\n(.*?)```", m.group(1), re.S).group(1)
    return [c.split() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def test_readme_evaluation_commands_parse_and_quick_means_subsets():
    """The README's two evaluation commands are this CLI's: both parse, the first is the full
    protocol, the second (--quick) fills in the subsets and the 10-epoch probe."""
    full, quick = _readme_eval_commands()
    assert full[:3] == ["python", "-m", "nac_fast.eval"] and quick[:3] == full[:3]
    parser = nac_eval.build_parser()
    a = parser.parse_args(full[3:])
    b = parser.parse_args(quick[3:])
    for args in (a, b):
        args.checkpoint = __file__  # any existing file: check_args only looks that it is one
        nac_eval.check_args(args)
    assert (a.limit_train, a.limit_test, a.linear_epochs, a.quick) == (None, None, 100, False)
    assert a.tasks == ["linear", "hash", "knn", "expressivity"] and a.bits == [16, 32, 64, 128]
    assert (b.limit_train, b.limit_test, b.linear_epochs, b.quick) == (5000, 1000, 10, True)
    c = parser.parse_args(quick[3:] + ["--linear-epochs", "3"])
    c.checkpoint = __file__
    nac_eval.check_args(c)
    assert c.linear_epochs == 3  # an explicit flag wins over --quick


def test_hash_report_names_the_protocol_and_writes_curves(evaluated):
    out, report, _ = evaluated
    h = report["results"]["hash"]
    assert h["queries"] == "test split" and h["gallery"] == "train split"
    assert "ties by gallery index" in h["ranking"] and h["relevance"] == "same class"
    assert set(h["map_at"][str(D)]) == {"1000", "5000"}
    assert 0 <= h["precision_within_radius"][str(D)] <= 1 and h["radius"] == 2
    assert set(h["precision_at_n"][str(D)]) == {"1", "10", "50", "100", "200", "500"}  # <= 600
    for f in ("hash_pr_curve.csv", "hash_precision_at_n.csv", "hash_curves.png"):
        assert os.path.isfile(out / f), f
    rows = open(out / "hash_pr_curve.csv").read().splitlines()
    assert rows[0].startswith("bits,radius,precision,recall")
    assert len(rows) == 1 + sum(int(k) + 1 for k in h["map"])  # radius 0..k for every k
    md = open(out / "report.md").read()
    assert "Hash protocol (standard): queries = test split (200)" in md and "mAP@1000" in md


def test_hash_curves_without_matplotlib_say_so(tmp_path, monkeypatch, capsys):
    """No silent fallback: without matplotlib the CSVs are written and the missing PNG is said."""
    import builtins
    real_import = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib here")
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_mpl)
    curves = {4: {"pr_curve": {"radius": [0, 1, 2, 3, 4], "precision": [1.0] * 5,
                               "recall": [0.1] * 5, "precision_empty_as_zero": [0.5] * 5,
                               "nonempty_fraction": [0.5] * 5, "mean_retrieved": [1.0] * 5},
                  "precision_at_n": {1: 1.0}}}
    info = {"num_queries": 1, "queries": "q", "num_gallery": 2, "gallery": "g"}
    files = nac_eval.write_hash_curves(str(tmp_path), curves, info)
    assert files["curves_png"] is None and "matplotlib" in files["curves_png_skipped"]
    assert "hash_curves.png not drawn" in capsys.readouterr().err
    assert os.path.isfile(tmp_path / "hash_pr_curve.csv") and not os.path.exists(
        tmp_path / "hash_curves.png")


def test_probe_rates_script_refits_each_rate_as_the_final_fit(evaluated, tmp_path, capsys):
    """scripts/probe_rates.py: at the protocol's chosen rate its figure is the report's test
    top-1 (the same final fit); another rate is train_linear_probe's; bad directories and an
    existing --csv are usage errors naming the argument."""
    shared, rep, _ = evaluated
    src = tmp_path / "e"  # the shared report.json is rewritten by other tests: the first one here
    src.mkdir()
    for s in ("train", "test"):
        shutil.copy(shared / f"features_{s}.pt", src / f"features_{s}.pt")
    (src / "report.json").write_text(json.dumps(rep))
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import probe_rates
    lin = rep["results"]["linear"]
    other = 3.0 if lin["best_lr"] != 3.0 else 5.0
    csv_path = tmp_path / "rates.csv"
    assert probe_rates.main([str(src), "--lrs", f"{lin['best_lr']},{other}",
                             "--csv", str(csv_path)]) == 0
    out = capsys.readouterr().out
    assert "not the protocol" in out
    rows = csv_path.read_text().splitlines()
    assert rows[0] == f"eval_dir,protocol_lr,protocol_top1,lr_{lin['best_lr']:g},lr_{other:g}"
    vals = rows[1].split(",")
    assert float(vals[3]) == lin["test_top1"]  # the protocol's final fit, refitted
    tr = torch.load(src / "features_train.pt", weights_only=False)
    te = torch.load(src / "features_test.pt", weights_only=False)
    from nac_fast.eval.metrics import train_linear_probe, linear_predict
    m = train_linear_probe(tr["h"], tr["labels"], lr=other, epochs=3, seed=0)
    assert float(vals[4]) == (linear_predict(m, te["h"]) == te["labels"]).double().mean().item()
    for argv, match in (([str(src), "--csv", str(csv_path)], "exists"),
                        ([str(tmp_path)], "has no report.json"),
                        ([str(src), "--lrs", "1,-2"], "expected positive rates")):
        with pytest.raises(SystemExit) as e:
            probe_rates.main(argv)
        assert e.value.code == 2
        assert match in capsys.readouterr().err


def test_a_bare_folder_trains_and_evaluates_on_its_held_out_part(tmp_path, capsys):
    """Class folders without train/ and val/: train.py says it holds part of each class out and
    trains on the rest; the evaluation scores that part (it was a FileNotFoundError), and the
    report says where its test split came from."""
    from nac_fast.data.sources.synthetic import write_jpeg_folder
    data = write_jpeg_folder(str(tmp_path / "photos"), num_classes=2, per_class=10,
                             size_range=(40, 56))
    out = tmp_path / "run"
    assert train.main(["--data", data, "--max-steps", "2", "--batch-size", "8", "--code-dim",
                       "16", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    said = capsys.readouterr().out
    assert ("training on 16 of its images; the other 4 (20% of each class, chosen by file name) "
            "are its test split") in said, said
    assert "(16 images," in said
    ev = tmp_path / "eval"
    assert nac_eval.main(["--checkpoint", str(out / "last.pt"), "--out", str(ev), "--tasks",
                          "knn,hash", "--device", "cpu", "--no-progress"]) == 0
    rep = json.load(open(ev / "report.json"))
    assert rep["splits"] == {"train": {"used": 16, "total": 16},
                             "test": {"used": 4, "total": 4, "held_out": True}}
    assert rep["results"]["hash"]["num_queries"] == 4
    assert "held out of training by file name" in (ev / "report.md").read_text()
    # the train/ of an ImageFolder root passed as --data: the start line names the root
    from nac_fast.train.run import _split_hint
    os.makedirs(tmp_path / "root" / "train")
    assert _split_hint(str(tmp_path / "root" / "train")) == ""
    os.makedirs(tmp_path / "root" / "val")
    assert f"--data {tmp_path / 'root'})" in _split_hint(str(tmp_path / "root" / "train"))
    assert _split_hint(data) == ""


def _tiny_folder_run(tmp_path, per_class):
    """A 1-step checkpoint trained on a folder of 2 classes of `per_class` JPEGs (its run dir)."""
    from nac_fast.data.sources.synthetic import write_jpeg_folder
    data = write_jpeg_folder(str(tmp_path / "photos"), num_classes=2, per_class=per_class,
                             size_range=(40, 56))
    run = tmp_path / "run"
    assert train.main(["--data", data, "--max-steps", "1", "--batch-size", "8", "--code-dim",
                       "16", "--out", str(run), "--no-progress", "--device", "cpu"]) == 0
    return run


def test_paper_protocol_with_no_gallery_left_is_a_usage_error(tmp_path, capsys):
    """--queries-per-class equal to every class's size makes each pooled image a query: a usage
    error naming the flag (not an internal "gallery_codes is empty"), before any feature is
    extracted when the data set's labels say so (here: 2 classes of 5 images, train + test)."""
    import argparse
    from nac_fast.data.sources.synthetic import write_jpeg_folder
    # the split itself, on features already extracted
    feats = {"a": torch.randn(4, 8), "labels": torch.tensor([0, 0, 1, 1])}
    args = argparse.Namespace(hash_protocol="paper", queries_per_class=3, seed=0)
    with pytest.raises(ValueError, match=r"^--queries-per-class 3: too many for the 6 pooled "
                       r"images \(every class has exactly 3, so all of them would be queries and "
                       r"the gallery would be empty\)"):
        nac_eval.run_hash(args, feats, {"a": torch.randn(2, 8), "labels": torch.tensor([0, 1])},
                          [8])
    run = _tiny_folder_run(tmp_path, per_class=5)
    capsys.readouterr()
    out = tmp_path / "eval"
    with pytest.raises(SystemExit) as e:
        nac_eval.main(["--checkpoint", str(run / "last.pt"), "--out", str(out), "--tasks", "hash",
                       "--hash-protocol", "paper", "--queries-per-class", "5", "--device", "cpu",
                       "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert ("--queries-per-class 5: too many for the 10 pooled images (every class has exactly "
            "5") in err, err
    assert not out.exists()  # before any feature extraction


def test_quick_on_a_small_folder_takes_whole_splits(tmp_path, capsys):
    """--quick's own --limit-train 5000 / --limit-test 1000 are at most each split: a folder of
    10 images is evaluated whole (it failed with "--limit-train 5000 exceeds the train split's
    ... images", a flag never typed); a typed limit beyond the split stays an error."""
    run = _tiny_folder_run(tmp_path, per_class=6)
    capsys.readouterr()
    common = ["--checkpoint", str(run / "last.pt"), "--tasks", "hash", "--device", "cpu",
              "--no-progress"]
    with pytest.raises(SystemExit) as e:
        nac_eval.main(common + ["--out", str(tmp_path / "typed"), "--limit-train", "5000"])
    assert e.value.code == 2
    assert "--limit-train 5000 exceeds the train split's" in capsys.readouterr().err
    out = tmp_path / "quick"
    assert nac_eval.main(common + ["--out", str(out), "--quick"]) in (0, None)
    report = json.loads((out / "report.json").read_text())
    assert report["quick"] is True
    for split in ("train", "test"):
        sz = report["splits"][split]
        assert sz["used"] == sz["total"] < 1000, (split, sz)


def test_cached_features_follow_the_data_and_out_is_checked_first(tmp_path, capsys):
    """Images added to the folder: the features are extracted again (the cache held the old
    split's rows while the report named the new one's size); an --out that cannot be written is
    a usage error before any work; --overwrite without the hash task leaves no earlier hash file
    beside the new report."""
    from nac_fast.data.sources.synthetic import write_jpeg_folder
    run = _tiny_folder_run(tmp_path, per_class=5)
    data = str(tmp_path / "photos")
    out = tmp_path / "eval"
    common = ["--checkpoint", str(run / "last.pt"), "--data", data, "--device", "cpu",
              "--no-progress", "--out", str(out)]
    assert nac_eval.main(common + ["--tasks", "knn,hash"]) in (0, None)
    first = json.loads((out / "report.json").read_text())
    assert (out / "hash_pr_curve.csv").exists()
    write_jpeg_folder(str(tmp_path / "more"), num_classes=2, per_class=3, size_range=(40, 56),
                      seed=5)
    for c in ("class_00", "class_01"):  # three more images a class
        for f in os.listdir(tmp_path / "more" / c):
            shutil.copy(tmp_path / "more" / c / f, tmp_path / "photos" / c / ("x" + f))
    from nac_fast.data.sources import imagefolder
    imagefolder._scan_cache.clear()  # (a new process: a folder is scanned once per process)
    capsys.readouterr()
    assert nac_eval.main(common + ["--tasks", "knn", "--overwrite"]) in (0, None)
    second = json.loads((out / "report.json").read_text())
    for split in ("train", "test"):
        used = second["splits"][split]["used"]
        feats = torch.load(out / f"features_{split}.pt", weights_only=True)
        assert feats["h"].shape[0] == used, (split, used)
    assert sum(second["splits"][s]["used"] for s in ("train", "test")) == \
        sum(first["splits"][s]["used"] for s in ("train", "test")) + 6
    assert not second["features"]["train"]["cached"]
    assert not any((out / f).exists() for f in nac_eval.HASH_FILES)
    # the same data again: the cache is reused
    assert nac_eval.main(common + ["--tasks", "knn", "--overwrite"]) in (0, None)
    assert json.loads((out / "report.json").read_text())["features"]["train"]["cached"]
    (tmp_path / "afile").write_text("x")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        nac_eval.main(common[:-1] + [str(tmp_path / "afile" / "sub"), "--tasks", "knn"])
    assert e.value.code == 2
    assert "--out" in capsys.readouterr().err


def test_tied_learning_rates_are_not_an_edge(tmp_path, capsys):
    """One class: every rate fits alike, so no "best rate at the edge of the search" note."""
    from nac_fast.data.sources.synthetic import write_jpeg_folder
    run = _tiny_folder_run(tmp_path, per_class=5)
    one = write_jpeg_folder(str(tmp_path / "one"), num_classes=1, per_class=12,
                            size_range=(40, 56), seed=3)
    out = tmp_path / "eval"
    capsys.readouterr()
    assert nac_eval.main(["--checkpoint", str(run / "last.pt"), "--data", one, "--device", "cpu",
                          "--no-progress", "--out", str(out), "--tasks", "linear",
                          "--linear-epochs", "1"]) in (0, None)
    lin = json.loads((out / "report.json").read_text())["results"]["linear"]
    assert len(set(lin["val_top1"].values())) == 1 and lin["best_lr_at_edge"] is None
    assert "a rate beyond it" not in capsys.readouterr().err


def test_hash_file_names_in_a_folder_without_a_report_are_left_alone(tmp_path, capsys):
    """Only --overwrite of an earlier evaluation removes its hash files: files of those names in
    an --out that held no report are the user's."""
    run = _tiny_folder_run(tmp_path, per_class=5)
    out = tmp_path / "eval"
    out.mkdir()
    mine = out / nac_eval.HASH_FILES[2]
    mine.write_bytes(b"the user's own")
    capsys.readouterr()
    assert nac_eval.main(["--checkpoint", str(run / "last.pt"), "--data", str(tmp_path / "photos"),
                          "--device", "cpu", "--no-progress", "--out", str(out),
                          "--tasks", "knn"]) in (0, None)
    assert mine.read_bytes() == b"the user's own"


# --------------------------------------------------------------------------------------------
# Under torchrun: extraction sharded over the ranks, failures agreed on; loader workers
# --------------------------------------------------------------------------------------------

def _eval_rank(rank, world, port, argv, log, fail):
    """One rank of a torchrun job, in a spawned process: python -m nac_fast.eval's main with
    torchrun's environment (one thread per rank, as torchrun sets it), stdout and stderr to `log`.
    fail = (rank, "extract" | "args"): that rank alone meets an exception in its feature
    extraction, or a usage error in the argument checks (a test hook)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if fail is not None and fail[0] == rank:
        if fail[1] == "extract":
            def extract_features(*a, **k):
                raise RuntimeError("injected failure")
            nac_eval.extract_features = extract_features
        else:
            check = nac_eval.check_args

            def check_args(args):
                check(args)
                raise ValueError("--data: injected usage error")
            nac_eval.check_args = check_args
    try:
        code = nac_eval.main(argv)
    except SystemExit as exc:
        code = exc.code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)


def _run_ranks(argv, logs_dir, world=2, fail=None, timeout=240):
    """Exit codes and logs of `world` ranks of python -m nac_fast.eval (gloo on loopback); a
    rank still running after `timeout` s (a hang) fails the test."""
    import multiprocessing
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    logs = [str(logs_dir / f"rank{r}.log") for r in range(world)]
    procs = [ctx.Process(target=_eval_rank, args=(r, world, port, argv, logs[r], fail))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    texts = [open(f).read() if os.path.exists(f) else "" for f in logs]
    assert not hung, f"ranks {hung} hung:\n" + "\n".join(texts)
    return [p.exitcode for p in procs], texts


DIST = ["--tasks", "expressivity", "--limit-train", "650", "--limit-test", "50", "--batch-size",
        "64", "--device", "cpu", "--no-progress"]


@pytest.mark.slow
def test_torchrun_ranks_extract_what_one_process_does(ckpt, tmp_path):
    """Two ranks (gloo) shard the extraction by whole batches (650 train images: 6 and 5 batches
    of 64; 50 test images: one batch, rank 1 gets none), gather to rank 0 in the split's order:
    the features one process extracts, bit for bit; only rank 0 writes (the cache once, the
    report), and the cache is one: a torchrun job reuses one process's and the other way round."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert nac_eval.main(["--checkpoint", ckpt, "--out", str(one)] + DIST) == 0
    codes, logs = _run_ranks(["--checkpoint", ckpt, "--out", str(two)] + DIST, tmp_path)
    assert codes == [0, 0], logs
    assert "| codes 32 bits | distinct |" in logs[0] and "| task |" not in logs[1]
    assert sorted(os.listdir(two)) == ["features_test.pt", "features_train.pt", "report.json",
                                       "report.md"]
    for split, n in (("train", 650), ("test", 50)):
        a = torch.load(one / f"features_{split}.pt", weights_only=True)
        b = torch.load(two / f"features_{split}.pt", weights_only=True)
        assert b["h"].shape[0] == n and a["meta"] == b["meta"]
        for k in ("h", "a", "labels"):
            assert torch.equal(a[k], b[k]), (split, k)
    rep = json.loads((two / "report.json").read_text())
    assert rep["extraction"]["ranks"] == 2 and not rep["features"]["train"]["cached"]
    assert rep["results"] == json.loads((one / "report.json").read_text())["results"]
    # the cache one process wrote serves a torchrun job (rank 0 reads it, no rank extracts)
    mtimes = {s: os.stat(one / f"features_{s}.pt").st_mtime_ns for s in ("train", "test")}
    codes, logs = _run_ranks(["--checkpoint", ckpt, "--out", str(one), "--overwrite"] + DIST,
                             tmp_path)
    assert codes == [0, 0], logs
    rep = json.loads((one / "report.json").read_text())
    assert rep["features"]["train"]["cached"] and rep["features"]["test"]["cached"]
    assert {s: os.stat(one / f"features_{s}.pt").st_mtime_ns for s in mtimes} == mtimes
    # and the torchrun job's cache serves one process
    assert nac_eval.main(["--checkpoint", ckpt, "--out", str(two), "--overwrite"] + DIST) == 0
    assert json.loads((two / "report.json").read_text())["features"]["test"]["cached"]


@pytest.mark.parametrize("where, status, message", [
    ("extract", 1, "rank 1 of 2 failed extracting the train split's features: RuntimeError: "
                   "injected failure"),
    ("args", 2, "--data: injected usage error"),
])
@pytest.mark.slow
def test_torchrun_a_failing_rank_stops_every_rank(ckpt, tmp_path, where, status, message):
    """A failure that one rank alone meets (an exception in its extraction, a usage error in its
    checks) stops every rank, none hangs: each exits with the same status and message, and
    nothing is written (no feature cache, no report)."""
    out = tmp_path / "out"
    codes, logs = _run_ranks(["--checkpoint", ckpt, "--out", str(out)] + DIST, tmp_path,
                             fail=(1, where))
    assert codes == [status, status], logs
    for log in logs:
        assert f"python -m nac_fast.eval: error: {message}" in log, log
    if where == "extract":
        assert "Traceback" in logs[1] and "Traceback" not in logs[0]
        assert os.listdir(out) == []  # rank 0 made the folder, nothing in it
    else:
        assert "usage:" in logs[0] and not out.exists()


AUG = ["--tasks", "linear", "--probe", "augmented", "--linear-epochs", "2", "--linear-lrs",
       "0.1,1", "--limit-train", "260", "--limit-test", "50", "--batch-size", "64",
       "--linear-batch-size", "64", "--device", "cpu", "--no-progress"]


@pytest.mark.slow
def test_torchrun_augmented_probe_fits_on_every_rank(ckpt, tmp_path):
    """--probe augmented under torchrun: both ranks encode their share of every batch's crops
    and sum the gradients (augprobe's process-group path), rank 0 scores and writes: the rate
    and the test accuracy of one process (the weights differ only in the summation order of
    the gradients, ~1e-7, which moves no prediction here), and only rank 0 reports."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert nac_eval.main(["--checkpoint", ckpt, "--out", str(one)] + AUG) == 0
    codes, logs = _run_ranks(["--checkpoint", ckpt, "--out", str(two)] + AUG, tmp_path)
    assert codes == [0, 0], logs
    a = json.loads((one / "report.json").read_text())["results"]["linear"]
    b = json.loads((two / "report.json").read_text())["results"]["linear"]
    assert a["plan"]["world_size"] == 1 and b["plan"]["world_size"] == 2
    assert (a["best_lr"], a["test_top1"], a["val_top1"]) == (b["best_lr"], b["test_top1"],
                                                             b["val_top1"]), (a, b)
    assert "| task |" not in logs[1]


def test_augmented_probe_without_scoring_features_is_only_for_other_ranks():
    """train_h=None (the scores left to rank 0) is refused in one process: a ValueError."""
    from nac_fast.eval.augprobe import augmented_linear_probe
    with pytest.raises(ValueError, match="train_h is None"):
        augmented_linear_probe(torch.nn.Identity(), None, None, torch.zeros(4, dtype=torch.long),
                               None, None)


def test_shard_bounds_are_whole_batches_that_cover_the_split():
    from nac_fast.eval.extraction import shard_bounds
    for n, bs, world in ((650, 64, 2), (50, 64, 2), (1, 1, 3), (1000, 7, 8), (64, 64, 1)):
        bounds = [shard_bounds(n, bs, r, world) for r in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(bounds[r][1] == bounds[r + 1][0] for r in range(world - 1))
        assert all(x % bs == 0 or x == n for b in bounds for x in b)
        batches = [-(-(hi - lo) // bs) for lo, hi in bounds]  # balanced: within one batch
        assert max(batches) - min(batches) <= 1 and batches[0] == max(batches)
    assert shard_bounds(650, 64, 0, 2) == (0, 384) and shard_bounds(50, 64, 1, 2) == (50, 50)


@pytest.mark.parametrize("arch", ["resnet-tiny", "resnet18", "vgg16-bn"])
def test_folded_network_gives_the_models_features(arch):
    """extraction_network folds every BatchNorm2d of the encoder into its convolution and runs
    channels-last: the same h and a up to float32 rounding, with trained-like statistics."""
    from nac_fast.eval.extraction import extraction_network
    from nac_fast.train.models import build_model
    torch.manual_seed(0)
    model = build_model(arch=arch, in_channels=3, image_size=32, code_dim=D).eval()
    for m in model.encoder.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-1, 1)
    net = extraction_network(model)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules())
    assert extraction_network(model, eager=True) is model
    x = torch.randn(5, 3, 32, 32)
    with torch.inference_mode():
        h0, a0 = model.encode(x)
        h1, a1 = net.encode(x.contiguous(memory_format=torch.channels_last))
    assert torch.allclose(h1, h0, rtol=1e-5, atol=1e-5 * float(h0.abs().max()))
    assert torch.allclose(a1, a0, rtol=1e-5, atol=1e-5 * float(a0.abs().max()))
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())  # left as it was


def test_workers_decode_a_folder_with_the_features_of_the_main_process(tmp_path, capsys):
    """--workers N decodes an image folder's files in N loader processes: the same features as
    decoding in the main process (--workers 0); the report records the workers."""
    run = _tiny_folder_run(tmp_path, per_class=10)
    feats = {}
    for w in (0, 2):
        out = tmp_path / f"w{w}"
        assert nac_eval.main(["--checkpoint", str(run / "last.pt"), "--out", str(out),
                              "--tasks", "expressivity", "--workers", str(w), "--batch-size",
                              "3", "--device", "cpu", "--no-progress"]) == 0
        assert json.loads((out / "report.json").read_text())["extraction"]["workers"] == w
        feats[w] = torch.load(out / "features_train.pt", weights_only=True)
    for k in ("h", "a", "labels"):
        assert torch.equal(feats[0][k], feats[2][k]), k
    from nac_fast.eval.extraction import MAX_DEFAULT_WORKERS, default_workers
    assert 0 <= default_workers() <= MAX_DEFAULT_WORKERS


def test_an_undecodable_image_is_recorded_with_the_features(tmp_path, capsys):
    """A file that passes the scan but cannot be decoded is skipped by extraction (the next
    file's features take its row): the features record it (skipped_files, which the imagenet100
    lists refuse: tests/test_eval_metrics.py), and such features are extracted again, not
    reused (the file may have been repaired)."""
    import glob
    run = _tiny_folder_run(tmp_path, per_class=10)
    bad = sorted(glob.glob(str(tmp_path / "photos" / "*" / "*")))[3]
    with open(bad, "r+b") as f:  # the JPEG header stays: the scan lets it through
        f.truncate(200)
    out = tmp_path / "ev"
    argv = ["--checkpoint", str(run / "last.pt"), "--out", str(out), "--tasks", "expressivity",
            "--workers", "0", "--device", "cpu", "--no-progress"]
    with pytest.warns(RuntimeWarning):
        assert nac_eval.main(argv) == 0
    feats = {s: torch.load(out / f"features_{s}.pt", weights_only=True) for s in ("train", "test")}
    skipped = feats["train"]["skipped_files"] + feats["test"]["skipped_files"]
    assert skipped == [bad], skipped
    import warnings
    with warnings.catch_warnings():  # the skip warns again (or not: warnings are shown once)
        warnings.simplefilter("ignore", RuntimeWarning)
        assert nac_eval.main(argv + ["--overwrite"]) == 0
    rep = json.loads((out / "report.json").read_text())
    split = "train" if feats["train"]["skipped_files"] else "test"
    assert rep["features"][split]["cached"] is False


def test_split_features_store_h_in_float16_a_in_float32_once():
    """extraction.SplitFeatures, what extract_features writes into: h rounded to float16 (a value
    beyond its range is a FeatureRangeError naming the row; NaN is kept for the check that names
    the checkpoint), a in float32 with its signs (a float16 -1e-30 would be -0), rows put by
    position (a rank's gathered share), and no commit before every row is written."""
    from nac_fast.eval.extraction import SplitFeatures
    from nac_fast.eval.features import FeatureRangeError
    st = SplitFeatures(5, "features train")
    h, a = torch.randn(3, 4), torch.tensor([[-1e-30, 1e-30]] * 3)
    st.write(h, a)
    st.put(0, "labels", torch.arange(5))
    st.put(3, "h", h[:2] * 2)
    st.put(3, "a", a[:2])
    f = st.commit()
    assert f["h"].dtype == torch.float16 and torch.equal(f["h"][:3], h.half())
    assert torch.equal(f["h"][3:], (h[:2] * 2).half()) and f["labels"].tolist() == [0, 1, 2, 3, 4]
    assert f["a"].dtype == torch.float32 and bool((f["a"][:, 0] < 0).all())
    st = SplitFeatures(2, "features test")
    with pytest.raises(FeatureRangeError, match=r"features test: h: row 1 holds a value beyond"):
        st.write(torch.tensor([[1.0], [7e4]]), torch.zeros(2, 1))
    st.write(torch.tensor([[float("nan")]]), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="1 of 2 rows written"):
        st.commit()


# --------------------------------------------------------------------------------------------
# Awkward sizes, broken checkpoints, other programs' folders, failures half-way
# --------------------------------------------------------------------------------------------

def _eval(run, out, *extra):
    ckpt, data = run
    return nac_eval.main(["--checkpoint", ckpt, "--data", data, "--device", "cpu",
                          "--no-progress", "--out", str(out)] + list(extra))


def test_itq_with_a_gallery_of_one_image_is_a_usage_error(run, tmp_path, capsys):
    """--itq standardises the gallery's a: a gallery of 1 image cannot be (it was a traceback,
    "a must have at least 2 rows to standardise", after the hash CSVs had been written)."""
    out = tmp_path / "e"
    err = _usage_error(capsys, _eval, run, out, "--tasks", "hash", "--itq", "--limit-train", "1")
    assert "--itq" in err and "gallery" in err, err
    assert not out.exists()  # before any work
    # without --itq the same gallery of 1 is scored
    assert _eval(run, out, "--tasks", "hash", "--limit-train", "1") == 0
    h = json.loads((out / "report.json").read_text())["results"]["hash"]
    assert h["num_gallery"] == 1


def _nan_in_head(ck):
    """NaN in the projection head's last linear layer: bit 0 of every a is NaN."""
    m = ck["model"]
    key = [k for k in m if k.startswith("head.") and k.endswith("weight") and m[k].dim() == 2][-1]
    m[key] = m[key].clone()
    m[key][0] = float("nan")


def test_nan_features_of_a_diverged_checkpoint_are_refused(run, tmp_path, capsys):
    """A checkpoint whose model gives NaN: the hash task read NaN as sgn = -1 and reported an mAP
    (and code statistics) of garbage without a word; the linear probe and kNN died with a
    traceback ("train_features contains NaN or inf").  Now a usage error naming --checkpoint
    and the features, and no report."""
    bad_a = _edited_checkpoint(run[0], tmp_path / "nan_a.pt", _nan_in_head)
    out = tmp_path / "a"
    err = _usage_error(capsys, nac_eval.main, ["--checkpoint", bad_a, "--data", run[1],
                                               "--device", "cpu", "--no-progress", "--out",
                                               str(out), "--tasks", "hash,expressivity"])
    assert f"--checkpoint {bad_a!r}" in err and "NaN or inf" in err and "a (" in err, err
    assert not (out / "report.json").exists()
    # the tasks on h alone still run: its features are finite
    assert nac_eval.main(["--checkpoint", bad_a, "--data", run[1], "--device", "cpu",
                          "--no-progress", "--out", str(out), "--tasks", "knn"]) == 0
    bad_h = _edited_checkpoint(run[0], tmp_path / "inf_h.pt", _inf_in_encoder)
    out = tmp_path / "h"
    err = _usage_error(capsys, nac_eval.main, ["--checkpoint", bad_h, "--data", run[1],
                                               "--device", "cpu", "--no-progress", "--out",
                                               str(out), "--tasks", "knn"])
    assert f"--checkpoint {bad_h!r}" in err and "NaN or inf" in err and "h (" in err, err
    assert not (out / "report.json").exists()


@pytest.mark.parametrize("edit", ["code_dim", "method"])
def test_weights_that_do_not_fit_the_checkpoints_config_are_a_usage_error(run, tmp_path, capsys,
                                                                          edit):
    """A checkpoint whose config names another code length or method than its weights (a
    RuntimeError traceback from load_state_dict): a usage error naming --checkpoint."""
    def change(ck):
        ck["config"].update(code_dim=32) if edit == "code_dim" else \
            ck["config"].update(method="simclr")
    bad = _edited_checkpoint(run[0], tmp_path / "bad.pt", change)
    out = tmp_path / "e"
    err = _usage_error(capsys, nac_eval.main, ["--checkpoint", bad, "--data", run[1],
                                               "--device", "cpu", "--no-progress", "--out",
                                               str(out), "--tasks", "knn"])
    assert f"--checkpoint {bad!r}" in err and "do not fit" in err, err
    assert not (out / "report.json").exists() and not (out / "features_train.pt").exists()


def test_overwrite_refuses_a_report_that_is_not_an_evaluations(run, tmp_path, capsys):
    """--out a finished python -m nac_fast.vae run: its report.json marks the run finished.
    --overwrite replaced it with an evaluation's report (the VAE then said "finished run,
    nothing to do" over a report of another program) and the refusal without --overwrite
    called it "the report of an earlier evaluation"."""
    out = tmp_path / "vae_run"
    out.mkdir()
    vae_report = {"test": {"elbo": -1.0, "iwae": -1.0, "iwae_k": 2, "kl": 0.0, "recon": -1.0},
                  "init": "random", "epochs": 1}
    (out / "report.json").write_text(json.dumps(vae_report))
    (out / "config.json").write_text(json.dumps({"kind": "vae"}))
    before = (out / "report.json").read_bytes()
    for extra in ([], ["--overwrite"]):
        err = _usage_error(capsys, _eval, run, out, "--tasks", "knn", *extra)
        assert "not the report of an evaluation" in err, err
        assert (out / "report.json").read_bytes() == before
    assert sorted(os.listdir(out)) == ["config.json", "report.json"]


def test_overwrite_that_fails_half_way_leaves_no_stale_report(run, tmp_path, monkeypatch):
    """--overwrite, then a task fails after the hash task wrote its files: the earlier report
    (other tasks, another run) stayed beside the new hash files as if it described them.  Once
    every check has passed, the earlier evaluation's report and hash files are removed first."""
    out = tmp_path / "e"
    assert _eval(run, out, "--tasks", "knn") == 0
    assert (out / "report.json").exists()

    def boom(*a, **k):
        raise RuntimeError("interrupted")
    monkeypatch.setattr(nac_eval, "run_expressivity", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        _eval(run, out, "--tasks", "hash,expressivity", "--overwrite")
    assert (out / "hash_pr_curve.csv").exists()  # the new run's hash files ...
    assert not (out / "report.json").exists()    # ... and no earlier report beside them
    assert not (out / "report.md").exists()
    monkeypatch.undo()
    # a usage error with --overwrite still deletes nothing
    assert _eval(run, out, "--tasks", "hash") == 0
    before = (out / "report.json").read_bytes()
    with pytest.raises(SystemExit):
        _eval(run, out, "--tasks", "hash", "--overwrite", "--bits", "99")
    assert (out / "report.json").read_bytes() == before


# ---- --limit-train / --limit-test N > n / 2 of a class-sorted folder: every class --------------

def test_a_limit_over_half_the_split_keeps_every_class(tmp_path):
    """Bug: N images of n were "every (n // N)-th, the first N": for N > n / 2 the stride is 1,
    so the first N images, and a class-sorted folder lost its last classes (600 of 10 x 100:
    classes 0-5 only, the probe capped at 60%).  They are now floor(i n / N), i < N: the same
    images where N divides n (every limit of the docs), spread over all of it otherwise."""
    from nac_fast.data import build_eval_loader
    from nac_fast.data.order import evenly_spaced
    from nac_fast.data.sources.synthetic import write_jpeg_folder
    from nac_fast.vae import data as vae_data
    for n in (1, 3, 97, 1031):
        for k in {k for k in (1, 2, n // 3, n // 2, n // 2 + 1, n - 1, n) if 1 <= k <= n}:
            idx = evenly_spaced(n, k)
            assert len(idx) == k and idx[0] == 0 and np.all(np.diff(idx) >= 1) and idx[-1] < n
            if n % k == 0:
                assert np.array_equal(idx, np.arange(0, n, n // k))
            # an even spread: gaps of floor(n / k) or ceil(n / k) only
            assert set(np.diff(idx).tolist()) <= {n // k, -(-n // k)}
    data = write_jpeg_folder(str(tmp_path / "photos"), num_classes=5, per_class=4,
                             size_range=(24, 28))
    full = build_eval_loader(data, split="train", batch_size=64, image_size=8)
    labels = np.asarray(full.source.labels)[full.indices]
    assert list(labels) == sorted(labels)   # class-sorted, as ImageFolder lists it
    n = full.num_images
    limit = n // 2 + 2
    for ld, used, total in (nac_eval._subset_loader(data, "train", limit, 64, 8, "cpu"),
                            vae_data._loader(data, "train", 8, limit)):
        assert (used, total) == (limit, n)
        got = torch.cat([y for _, y in ld])
        assert got.tolist() == labels[evenly_spaced(n, limit)].tolist()
        assert set(got.tolist()) == set(labels.tolist()), got
    with pytest.raises(ValueError, match="limit"):
        build_eval_loader(data, split="train", batch_size=64, image_size=8, limit=n + 1)


def test_map_at_k_beyond_the_gallery_says_it_is_capped(run, tmp_path):
    """mAP@K for K above the gallery's size is mAP over the whole gallery (K capped, as --help
    says); report.md labelled it mAP@1000 on an 8-image gallery without a word."""
    out = tmp_path / "e"
    assert _eval(run, out, "--tasks", "hash", "--map-at", "2,1000") == 0
    table = (out / "report.md").read_text()
    rep = json.loads((out / "report.json").read_text())["results"]["hash"]
    g = rep["num_gallery"]
    assert g < 1000
    line = next(ln for ln in table.splitlines() if "mAP@1000" in ln)
    assert f"K capped at the gallery's {g}" in line, line
    line = next(ln for ln in table.splitlines() if "mAP@2 " in ln or "mAP@2|" in ln)
    assert "capped" not in line, line
