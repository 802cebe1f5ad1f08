"""The data benchmark and the augmentation-grid scripts run and print/write what they promise."""
import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from nac_fast.data.sources import fashion_mnist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.slow
def test_throughput_bench_prints_json_last(tmp_path):
    data = str(tmp_path / "jpegs")
    out = _run("bench/data_throughput.py", "--data", data, "--make-jpegs", "16", "--loader",
               "torchvision", "--size", "64", "--batch", "4", "--batches", "3", "--warmup", "1",
               "--workers", "0")
    res = json.loads(out.strip().splitlines()[-1])
    assert res["loader"] == "torchvision" and res["view_shape"] == [4, 3, 64, 64]
    assert res["num_images"] == 16 and (res["batches"], res["batch"]) == (3, 4)
    # the rates are the measured 3 x 4 images over the measured time; "seconds" is rounded to
    # 3 decimals, so the rate lies between the counts over its rounding interval's ends
    measured = 3 * 4
    lo, hi = measured / (res["seconds"] + 5e-4), measured / max(res["seconds"] - 5e-4, 1e-9)
    assert lo - 0.1 <= res["images_per_s"] <= hi + 0.1, (res, lo, hi)
    assert res["views_per_s"] == pytest.approx(2 * res["images_per_s"], abs=0.2)
    # CPU time of the process tree: more than nothing, at most every CPU busy all the time
    assert 0 < res["cpu_ms_per_image"] <= 1e3 * (res["seconds"] + 1e-3) * res["cpus"] / measured


@pytest.mark.slow
@pytest.mark.skipif(fashion_mnist.find_dir() is None, reason="Fashion-MNIST not installed")
def test_show_augmentations_writes_a_grid(tmp_path):
    png = str(tmp_path / "grid.png")
    out = _run("scripts/show_augmentations.py", "--num", "3", "--out", png)
    assert "3 rows" in out
    w, h = Image.open(png).size
    assert (w, h) == (3 * 28 + 4 * 2, 3 * 28 + 4 * 2)      # 3x3 tiles of 28 px, 2 px padding
    # an existing --out is refused (naming the flag) and kept; --overwrite replaces it
    before = open(png, "rb").read()
    r = subprocess.run([sys.executable, "scripts/show_augmentations.py", "--num", "2", "--out",
                        png], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--out" in r.stderr and "--overwrite" in r.stderr, r.stderr
    assert open(png, "rb").read() == before
    _run("scripts/show_augmentations.py", "--num", "2", "--out", png, "--overwrite")
    assert Image.open(png).size == (3 * 28 + 4 * 2, 2 * 28 + 3 * 2)
