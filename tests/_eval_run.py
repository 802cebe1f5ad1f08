"""A tiny trained checkpoint on a JPEG folder, and what the evaluation and VAE tests do to it
(tests/test_eval_cli.py, tests/test_vae_cli.py): damaged copies of it, and the usage error a CLI
must give for them."""
from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py lives at the repository root
import train  # noqa: E402


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


def usage_error(capsys, fn, *args) -> str:
    """fn(*args) exits with status 2; the text after "error:" on stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        fn(*args)
    assert e.value.code == 2
    return capsys.readouterr().err.split("error:", 1)[1]


def edited_checkpoint(src, dst, edit):
    """A copy of checkpoint src at dst, edit(ck) applied to its contents; returns dst."""
    ck = torch.load(src, map_location="cpu", weights_only=False)
    edit(ck)
    torch.save(ck, dst)
    return str(dst)


def inf_in_encoder(ck):
    """inf in the encoder's first convolution: every feature h is inf or NaN."""
    m = ck["model"]
    m["encoder.net.conv1.weight"] = m["encoder.net.conv1.weight"].clone()
    m["encoder.net.conv1.weight"][0] = float("inf")
