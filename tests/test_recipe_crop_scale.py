"""train.py --crop-scale: the random resized crop's area range, a flag and a recipe key
(docs/math.md [M:recipe]: (0.08, 1) for the CIFAR recipes as the authors' CIFAR code, (0.2, 1)
for the ImageNet ones as the authors' ImageNet code), carried to every loader that crops (the
in-memory tensor loader, the PIL ImageFolder loader and the DALI pipeline)."""
import json
import os
import struct
import sys

import numpy as np
import pytest
import torch

from nac_fast.data import Recipe, build_pretrain_loader
from nac_fast.data.sources.synthetic import write_jpeg_folder
from nac_fast.train.config import UsageError, parse
from nac_fast.train.distributed import DistInfo
from nac_fast.train.run import build_loader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
DI = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def write_idx_dir(d, n_train=120, n_test=60, classes=4, seed=0):
    """A Fashion-MNIST-layout IDX folder of random 28x28 images, labels cycling over classes."""
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)

    def write(path, arr):
        with open(path, "wb") as f:
            f.write(struct.pack(">HBB", 0, 8, arr.ndim))
            f.write(struct.pack(">" + "I" * arr.ndim, *arr.shape))
            f.write(arr.astype(np.uint8).tobytes())
    for pre, n in (("train", n_train), ("t10k", n_test)):
        write(os.path.join(d, f"{pre}-images-idx3-ubyte"), rng.integers(0, 256, (n, 28, 28)))
        write(os.path.join(d, f"{pre}-labels-idx1-ubyte"), np.arange(n) % classes)
    return str(d)


@pytest.mark.parametrize("given, want", [
    ([], [0.08, 1.0]),
    (["--crop-scale", "0.2"], [0.2, 1.0]),
    (["--crop-scale", "0.2,0.5"], [0.2, 0.5]),
    (["--crop-scale", "1"], [1.0, 1.0]),
])
def test_the_flag(given, want):
    assert parse(["--data", "synthetic"] + given).crop_scale == want


@pytest.mark.parametrize("bad", ["0", "-0.1", "1.5", "0.5,0.4", "x", "0.1,0.2,0.3", "nan",
                                 "0.1,inf", ""])
def test_bad_values_name_the_flag(bad):
    with pytest.raises(UsageError, match="--crop-scale"):
        parse(["--data", "synthetic", "--crop-scale", bad])


def test_recipe_key_and_its_errors(tmp_path):
    head = "batch_size = 64\nepochs = 1\n"
    ok = tmp_path / "ok.toml"
    ok.write_text(head + "crop_scale = [0.3, 0.9]\n")
    assert parse(["--config", str(ok), "--data", "synthetic"]).crop_scale == [0.3, 0.9]
    one = tmp_path / "one.toml"
    one.write_text(head + "crop_scale = 0.25\n")
    assert parse(["--config", str(one), "--data", "synthetic"]).crop_scale == [0.25, 1.0]
    # the command line beats the recipe
    assert parse(["--config", str(ok), "--data", "synthetic", "--crop-scale", "0.5"]
                 ).crop_scale == [0.5, 1.0]
    for text in ("crop_scale = 2\n", "crop_scale = [0.5, 0.1]\n", "crop_scale = true\n",
                 "crop_scale = [0.1, 0.2, 0.3]\n"):
        bad = tmp_path / "bad.toml"
        bad.write_text(head + text)
        with pytest.raises(UsageError, match=r"bad\.toml.*crop_scale"):
            parse(["--config", str(bad), "--data", "synthetic"])


@pytest.mark.parametrize("name, want", [
    ("imagenet.toml", [0.2, 1.0]),           # the authors' moco/main.py (MoCo v2)
    ("imagenet_nac_mq.toml", [0.2, 1.0]),
    ("cifar10.toml", [0.08, 1.0]),           # the authors' utils.py (torchvision's default)
    ("cifar10_hashing.toml", [0.08, 1.0]),
    ("small.toml", [0.08, 1.0]),
])
def test_recipes(name, want):
    cfg = parse(["--config", os.path.join(CONFIGS, name), "--data", "synthetic"])
    assert cfg.crop_scale == want


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    r = str(tmp_path_factory.mktemp("crop_folder"))
    write_jpeg_folder(os.path.join(r, "train"), num_classes=2, per_class=6, size_range=(40, 70))
    write_jpeg_folder(os.path.join(r, "val"), num_classes=2, per_class=3, size_range=(40, 70),
                      seed=1)
    return r


def _loader_kinds():
    kinds = ["torchvision"]
    try:
        import nvidia.dali  # noqa: F401
        kinds.append("dali-cpu")
    except ImportError:
        pass
    return kinds


@pytest.mark.parametrize("kind", _loader_kinds())
def test_every_loader_gets_the_flag(folder, tmp_path, kind):
    """train.py's loader (run.build_loader) crops with --crop-scale, whatever the loader."""
    cfg = parse(["--data", folder, "--crop-scale", "0.3,0.7", "--batch-size", "4", "--loader",
                 kind, "--image-size", "16", "--out", str(tmp_path / "o")])
    ld = build_loader(cfg, DI, channels_last=False)
    assert ld.kind == kind and ld.recipe.scale == (0.3, 0.7)
    assert next(iter(ld))[0].shape == (4, 3, 16, 16)


def test_in_memory_loader_gets_the_flag(tmp_path):
    d = write_idx_dir(tmp_path / "fm")
    cfg = parse(["--data", d, "--crop-scale", "0.2", "--batch-size", "8"])
    ld = build_loader(cfg, DI, channels_last=False)
    assert ld.kind == "tensor" and ld.recipe.scale == (0.2, 1.0)


def test_dali_crops_with_the_scale(folder):
    """The DALI pipeline crops with the given scale, not the default: at (0.5, 0.6) it makes the
    torchvision loader's views (to ~1 uint8 level, hue off) and not its own default-scale ones."""
    pytest.importorskip("nvidia.dali")
    rec = Recipe("nohue", hue=0.0)
    kw = dict(batch_size=4, image_size=24, num_workers=1, recipe=rec, seed=3)
    d = build_pretrain_loader(folder, loader="dali-cpu", scale=(0.5, 0.6), **kw)
    t = build_pretrain_loader(folder, loader="torchvision", scale=(0.5, 0.6), **kw)
    d0 = build_pretrain_loader(folder, loader="dali-cpu", **kw)
    assert d.recipe.scale == (0.5, 0.6) and d0.recipe.scale == (0.08, 1.0)
    (a1, a2), (b1, b2), (c1, c2) = next(iter(d)), next(iter(t)), next(iter(d0))
    for a, b, c in ((a1, b1, c1), (a2, b2, c2)):
        assert (a - b).abs().mean() < 0.012
        assert (a - c).abs().mean() > 0.1


def test_resume_with_another_crop_scale_is_taken_and_recorded(tmp_path, capsys):
    """Like --image-size, the crop scale is not part of what a resumed run must match: the run
    continues with the value given, recorded in config.json and the checkpoints."""
    sys.path.insert(0, ROOT)
    import train
    d = write_idx_dir(tmp_path / "fm")
    out = str(tmp_path / "run")
    base = ["--data", d, "--batch-size", "16", "--code-dim", "16", "--out", out,
            "--no-progress", "--device", "cpu", "--save-every", "1"]
    assert train.main(base + ["--max-steps", "2", "--stop-at-step", "1"]) == 0
    assert json.load(open(os.path.join(out, "config.json")))["crop_scale"] == [0.08, 1.0]
    assert train.main(base + ["--max-steps", "2", "--resume", "--crop-scale", "0.4"]) == 0
    assert json.load(open(os.path.join(out, "config.json")))["crop_scale"] == [0.4, 1.0]
    ck = torch.load(os.path.join(out, "last.pt"), weights_only=True)
    assert ck["step"] == 2 and ck["config"]["crop_scale"] == [0.4, 1.0]
    assert "resumed from" in capsys.readouterr().out
