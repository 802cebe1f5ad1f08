"""Audit of python -m nac_fast.eval, python -m nac_fast.vae and scripts/reproduce_vae.py as a
demanding user runs them: awkward sizes, broken checkpoints, NaN features, folders that hold
another program's files, failures half-way, duplicated flags.  Each test failed before its fix.
CPU; one 1-step train.py checkpoint on a tiny JPEG folder (a few seconds)."""
import json
import math
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py lives at the repository root
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import train  # noqa: E402
import reproduce_vae as rv  # noqa: E402
from nac_fast.eval import cli as nac_eval  # noqa: E402
from nac_fast.vae import cli as vae_cli  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 1-step checkpoint trained on a folder of 2 classes of 5 JPEGs: 8 training images (its
    train split), 2 held out (its test split); (checkpoint path, data folder)."""
    from nac_fast.data.sources.synthetic import write_jpeg_folder
    tmp = tmp_path_factory.mktemp("audit_eval_vae")
    data = write_jpeg_folder(str(tmp / "photos"), num_classes=2, per_class=5,
                             size_range=(40, 56))
    out = tmp / "run"
    assert train.main(["--data", data, "--max-steps", "1", "--batch-size", "8", "--code-dim",
                       "16", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    return str(out / "last.pt"), data


def _eval(run, out, *extra):
    ckpt, data = run
    return nac_eval.main(["--checkpoint", ckpt, "--data", data, "--device", "cpu",
                          "--no-progress", "--out", str(out)] + list(extra))


def _usage_error(capsys, fn, *args) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        fn(*args)
    assert e.value.code == 2
    return capsys.readouterr().err.split("error:", 1)[1]


def _edited_checkpoint(src, dst, edit):
    ck = torch.load(src, map_location="cpu", weights_only=False)
    edit(ck)
    torch.save(ck, dst)
    return str(dst)


# --------------------------------------------------------------------------------------------
# python -m nac_fast.eval
# --------------------------------------------------------------------------------------------

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


def _inf_in_encoder(ck):
    m = ck["model"]
    m["encoder.net.conv1.weight"] = m["encoder.net.conv1.weight"].clone()
    m["encoder.net.conv1.weight"][0] = float("inf")


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


# --------------------------------------------------------------------------------------------
# python -m nac_fast.vae
# --------------------------------------------------------------------------------------------

def test_vae_init_from_a_diverged_checkpoint_is_a_usage_error(run, tmp_path, capsys):
    """--init a checkpoint whose encoder holds inf / NaN: the run started, wrote config.json and
    log.jsonl and stopped at step 1 with "non-finite loss ... (try a lower --lr)", advice that
    does not help.  Now a usage error naming --init, before anything is written."""
    bad = _edited_checkpoint(run[0], tmp_path / "inf.pt", _inf_in_encoder)
    out = tmp_path / "v"
    err = _usage_error(capsys, vae_cli.main, ["--init", bad, "--data", run[1], "--out", str(out),
                                              "--epochs", "1", "--batch-size", "4",
                                              "--no-progress", "--device", "cpu"])
    assert f"--init {bad!r}" in err and "NaN or inf" in err and "conv1" in err, err
    assert not out.exists()


# --------------------------------------------------------------------------------------------
# scripts/reproduce_vae.py
# --------------------------------------------------------------------------------------------

def _fake_run(runs, variant, seed, iwae, kl):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_vae_script import _fake_run as fake
    fake(runs, variant, seed, iwae, kl)


def test_duplicated_seeds_and_variants_run_once(tmp_path, capsys):
    """--seeds 0,0 or --variants random,random: every run was planned twice, and run_all launched
    both copies at once with the same --out (two processes training into one folder); the doc
    counted the seed twice (its mean +- std over 3 "seeds" of 2)."""
    runs = str(tmp_path)
    assert rv.main(["--runs", runs, "--dry-run", "--variants", "random,simclr,random",
                    "--seeds", "1,1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(set(lines)) == 3, lines  # simclr pretraining, 2 VAE runs
    _fake_run(runs, "random", 0, -1000, 10.0)
    _fake_run(runs, "random", 1, -1010, 12.0)
    doc = str(tmp_path / "doc.md")
    assert rv.main(["--runs", runs, "--doc-only", "--doc", doc, "--variants", "random",
                    "--seeds", "0,1,0"]) == 0
    assert "| random init | 2 | -1005.0 ± 7.1 | 11.0 ± 1.4 |" in open(doc).read()


def _t_test_p(d):
    from scipy import stats
    return stats.ttest_1samp(d, 0.0).pvalue


def test_paired_t_test_is_exact_beyond_ten_seeds():
    """_sig took 2.0 as the 5% critical value for every df > 9 (the true ones: 2.228 at df 10,
    2.086 at df 20, 2.042 at df 30), calling p up to 0.07 significant.  Checked against
    scipy's t-test at df 1..40."""
    pytest.importorskip("scipy")
    # 11 seeds, t = 2.1 (p = 0.062): not significant
    d = np.array([1.0] * 6 + [-1.0] * 5)
    d = d - d.mean()
    d = list(d + 2.1 * d.std(ddof=1) / math.sqrt(len(d)))
    assert _t_test_p(d) > 0.05
    assert rv._sig(d) == (pytest.approx(np.mean(d)), False)
    rng = np.random.default_rng(0)
    for n in list(range(2, 42)):
        for shift in (0.3, 0.6, 1.0):
            d = list(rng.normal(shift, 1.0, n))
            p = _t_test_p(d)
            if abs(p - 0.05) > 1e-3:  # (the table's rounded values may differ at the edge)
                assert rv._sig(d)[1] == (p < 0.05), (n, shift, p)


def test_doc_paths_in_a_missing_folder_fail_before_any_work(tmp_path):
    """--doc (or --figure, --curves) in a folder that does not exist: a FileNotFoundError
    traceback once every run had finished; now an error naming the flag at the start."""
    runs = str(tmp_path)
    _fake_run(runs, "random", 0, -1000, 10.0)
    for flag in ("--doc", "--figure", "--curves"):
        argv = ["--runs", runs, "--doc-only", "--variants", "random", "--seeds", "0",
                flag, str(tmp_path / "nodir" / "x")]
        if flag != "--doc":
            argv += ["--doc", str(tmp_path / "doc.md")]
        with pytest.raises(SystemExit) as e:
            rv.main(argv)
        assert flag in str(e.value) and "no such folder" in str(e.value), e.value
    assert not (tmp_path / "doc.md").exists()


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
