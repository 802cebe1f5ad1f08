"""scripts/reproduce_vae.py: the plan (commands, skipping finished runs) and the markdown
section generated from the reports (mean +- std, paired differences, the paper beside)."""
import json
import os
import sys

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
