"""scripts/reproduce_fmnist.py (issue 6's small-scale reproduction) end to end at toy size: it trains,
evaluates, makes the random-init baseline, writes the summary and the page, skips finished steps
when run again, and rejects bad flags before any work."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "reproduce_fmnist.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import reproduce_fmnist as R  # noqa: E402

TOY = ["--max-steps", "1", "--nproc", "1", "--batch-size", "32", "--limit-train", "256",
       "--limit-test", "128", "--linear-epochs", "1", "--bn-batches", "2"]


def _fmnist_available():
    from nac_fast.data import build_eval_loader
    try:
        build_eval_loader("fashion-mnist", split="test", batch_size=8)
        return True
    except Exception:
        return False


def test_dry_run_commands():
    out = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", "/tmp/nac-dry"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    train_cmds = [ln for ln in out.splitlines() if "train.py" in ln]
    # nac, nac-mq, simclr + 4 more sweep values (p = 0.1 is shared with the main table)
    assert len(train_cmds) == 7
    assert all("--nproc_per_node=2" in c for c in train_cmds)
    # torchrun would swallow "--p"; the script must use the alias
    assert not any(" --p " in c for c in train_cmds)
    assert sum("--flip-prob" in c for c in train_cmds) == 6  # all but simclr
    assert out.count("nac_fast.eval") == 8  # random init is evaluated too


@pytest.mark.parametrize("argv,match", [
    (["--methods", "nac,moco"], "--methods must be a non-empty subset"),
    (["--p-sweep", "0.1,0.7"], "every p must lie in (0, 0.5)"),
    (["--p-sweep", "x"], "comma-separated numbers"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--methods", "random", "--p-sweep", ""], "needs a trained run"),
])
def test_bad_flags(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        R.main(argv + ["--dry-run"])
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_toy_reproduction_end_to_end(tmp_path):
    if not _fmnist_available():
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    out, doc = tmp_path / "repro", tmp_path / "docs" / "results.md"
    notes = tmp_path / "notes.md"
    notes.write_text("## Reading\n\nhand-written line\n")
    argv = TOY + ["--out", str(out), "--methods", "nac,random", "--p-sweep", "0.1,0.3",
                  "--doc", str(doc), "--notes", str(notes)]
    assert R.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"nac_p01", "nac_p03", "random"}
    for name, row in summary["runs"].items():
        assert 0.0 <= row["linear_top1"] <= 1.0 and set(row["map"]) == {"16", "32", "64", "128"}
    assert summary["runs"]["random"]["step"] == 0 and summary["runs"]["nac_p01"]["step"] == 1
    page = doc.read_text()
    assert "| nac | 0.1 |" in page and "| random | - |" in page
    assert "hand-written line" in page and (doc.parent / "p_sweep.png").stat().st_size > 1000
    # a second run finds everything done: no training, no evaluation
    mtime = os.path.getmtime(out / "nac_p01" / "last.pt")
    assert R.main(argv) == 0
    assert os.path.getmtime(out / "nac_p01" / "last.pt") == mtime
