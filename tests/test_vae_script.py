"""scripts/reproduce_vae.py: the plan (commands, skipping finished runs) and the markdown
section generated from the reports (mean +- std, paired differences, the paper beside).
Duplicated seeds and variants run once, the paired t-test is exact beyond ten seeds, and
output paths in a missing folder fail before any work (an audit's regressions)."""
import json
import math
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import reproduce_vae as rv  # noqa: E402


def _fake_run(runs, variant, seed, iwae, kl):
    d = os.path.join(runs, "vae", variant, f"seed{seed}")
    os.makedirs(d)
    rep = {"test": {"elbo": iwae - 5, "iwae": iwae, "iwae_k": 1000, "kl": kl,
                    "recon": iwae - 5 + kl}, "init": "random", "epochs": 1}
    ev = {"test": rep["test"], "details": {"iwae_images": 32, "test_images": 5000, "pixels": 784,
                                           "train_steps": 234, "iwae_minus_elbo_subset": 50.0,
                                           "train_images": 30000, "test_split_images": 10000,
                                           "loadavg": [9.0, 9.0, 9.0],
                                           "bits_per_dim": {"iwae": -iwae / (784 * 0.693)}}}
    with open(os.path.join(d, "report.json"), "w") as f:
        json.dump(rep, f)
    with open(os.path.join(d, "eval.json"), "w") as f:
        json.dump(ev, f)


def test_doc_from_reports(tmp_path, capsys):
    runs = str(tmp_path)
    for s, (r, n) in enumerate([(-1000, -900), (-1010, -905), (-990, -898)]):
        _fake_run(runs, "random", s, r, 10.0 + s)
        _fake_run(runs, "nac_default", s, n, 20.0 + s)
    doc = str(tmp_path / "out.md")
    assert rv.main(["--runs", runs, "--doc-only", "--doc", doc, "--variants",
                    "random,nac_default"]) == 0
    text = open(doc).read()
    assert "| random init | 3 | -1000.0 ± 10.0 | 11.0 ± 1.0 |" in text
    assert "| NAC (default recipe) + finetune | 3 | -901.0 ± 3.6 |" in text
    assert "-3202 / 33.0" in text and "-2865 / 71.8" in text          # the paper beside
    # paired differences: +100, +105, +92 -> 99.0 +- 6.6, significant; KL +10 each
    assert "| NAC (default recipe) + finetune | 99.0 ± 6.6 | 10.0 ± 0.0 |" in text
    assert ("NAC (default recipe) + finetune vs random init: IWAE LL +99.0 nats, higher in 3/3 "
            "seeds, as in the paper (p < 0.05)") in text
    assert "KL +10.0 nats, larger in 3/3 seeds, as in the paper (p < 0.05)" in text
    assert "python -m nac_fast.vae --data fashion-mnist --init random" in text
    assert "train.py --method nac --data fashion-mnist" in text


def test_not_significant_is_said(tmp_path):
    runs = str(tmp_path)
    for s, (r, n) in enumerate([(-1000, -990), (-1010, -1030), (-990, -985)]):
        _fake_run(runs, "random", s, r, 10.0)
        _fake_run(runs, "simclr", s, n, 10.0)
    doc = str(tmp_path / "out.md")
    rv.main(["--runs", runs, "--doc-only", "--doc", doc, "--variants", "random,simclr"])
    text = open(doc).read()
    assert "IWAE LL -1.7 nats, lower in 1/3 seeds, opposite to the direction of the paper, n.s." in text


def test_dry_run_skips_finished(tmp_path, capsys):
    runs = str(tmp_path)
    _fake_run(runs, "random", 0, -1000, 10.0)
    assert rv.main(["--runs", runs, "--dry-run", "--variants", "random,simclr",
                    "--seeds", "0,1"]) == 0
    out = capsys.readouterr().out.splitlines()
    vae = [line for line in out if "nac_fast.vae" in line]
    pre = [line for line in out if "train.py" in line]
    assert len(vae) == 3 and not any("random/seed0" in line for line in vae)
    assert len(pre) == 2 and all("--method simclr" in line for line in pre)
    assert all("--limit-train 30000" in line and "--resume" in line for line in vae)


@pytest.mark.parametrize("argv", [["--variants", "nope"], ["--seeds", "a"], ["--jobs", "0"],
                                  ["--limit-test", "-1"], ["--doc-only"]])
def test_bad_flags(tmp_path, argv):
    with pytest.raises(SystemExit):
        rv.main(["--runs", str(tmp_path)] + argv)


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
